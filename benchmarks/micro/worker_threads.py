"""A worker process's CPU by what its threads do: the executor's thread that runs the
tasks, the event loop that runs distributed's state machine and the plugins' hooks, and
the rest (offloaded serialization, the profiler, the monitors).

A difference in worker CPU per task says how much; this says where: a hook's cost lands
on the event loop, a runner's on the executor's thread, and a worker slower per task
spends more on the loop's per-interval work (its batched sends) as well.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping
from typing import Any

from distributed import Client

#: What a worker process's threads do, as :func:`thread_roles` names them.
ROLES = ("executor", "event loop", "other")
#: Per worker process id, its threads' roles by native thread id.
Roles = Mapping[int, Mapping[int, str]]


def _roles_here(dask_worker: Any) -> dict[int, str]:
    """In a worker (``client.run`` calls it on the event loop): its threads' roles by
    native id; threads not named here (offload, profiling, monitors) are "other"."""
    import threading

    threads = list(dask_worker.executors["default"]._threads)  # (a set a task may grow)
    roles = {t.native_id: "executor" for t in threads}
    roles[threading.get_native_id()] = "event loop"
    return roles


def thread_roles(client: Client) -> Roles:
    """Per worker process id, its threads' roles (after a warm-up: the executor's thread
    starts with the first task)."""
    pids = client.run(os.getpid)
    return {pids[addr]: roles for addr, roles in client.run(_roles_here).items()}


def thread_cpu(workers: list, roles: Roles) -> dict[str, float]:
    """CPU seconds the worker processes' threads spent so far, summed by role. A thread
    that ends between two readings takes its CPU with it (the process's figure keeps
    it): the roles' sum can fall short of the worker's, "other" most (never the
    executor's thread or the event loop, which live as long as the worker)."""
    spent = dict.fromkeys(ROLES, 0.0)
    for w in workers:
        named = roles.get(w.pid, {})
        for t in w.threads():
            spent[named.get(t.id, "other")] += t.user_time + t.system_time
    return spent


def counted(roles: Roles) -> dict[str, int]:
    """How many threads of each role ``roles`` names, over all workers."""
    return dict(Counter(role for named in roles.values() for role in named.values()))
