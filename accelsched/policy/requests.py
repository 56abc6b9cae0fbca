"""Which requests from workers to act on: decisions only, no distributed import.

Nothing here authenticates anyone: in distributed, anyone connected is trusted (any
client may run code on the scheduler; TLS keeps strangers out; docs/architecture.md).
What this guards against are accidents. A request names the worker address it speaks
for and the process that sent it (distributed's ``Worker.id``, the scheduler's
``WorkerState.server_id``), and carries an id that process never uses twice:

- a late request from a process that was replaced (a restart's second request, arriving
  after the new process registered at the same address) must not restart the fresh one;
- a request handled twice (replayed, retried) is acted on once.
"""

from __future__ import annotations

__all__ = ["Requests"]


class Requests:
    """The request ids seen from each worker address, while its process is registered."""

    def __init__(self) -> None:
        self._seen: dict[str, set[str]] = {}  # worker -> ids acted on

    def refusal(
        self, worker: str, process: object, registered: str | None, request: object
    ) -> str | None:
        """Why a request naming ``worker``, sent by ``process``, is not acted on, with
        ``registered`` the process the scheduler holds at that address (None: no worker
        there); None: act on it (its id is spent). The reasons: ``"stale"``,
        ``"no-id"``, ``"replayed"``."""
        if registered is None or process != registered:
            return "stale"
        if not isinstance(request, str) or not request:
            return "no-id"
        seen = self._seen.setdefault(worker, set())
        if request in seen:
            return "replayed"
        seen.add(request)
        return None

    def forget(self, worker: str) -> None:
        """The worker left: a process registering at its address starts afresh."""
        self._seen.pop(worker, None)
