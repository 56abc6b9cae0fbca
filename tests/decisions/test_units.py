"""Decisions without a cluster: ownership, fallback timing, leases, options."""

from __future__ import annotations

import pickle
import re
from typing import Any

import dask
import numpy as np
import pytest

import accelsched
from accelsched.config import GUARD_OPTIONS, PLACEMENT_OPTIONS, Threshold, resolve_options
from accelsched.devices import resolve_devices, visible_from_env
from accelsched.policy.marks import Mark
from accelsched.policy.requests import Claim, Requests, decide_claim, grant, owned
from accelsched.policy.requirements import LeaseTable, NoFreeDevice
from accelsched.policy.timeouts import (
    CHAIN,
    NO_GPU_CAPACITY,
    TIMEOUT,
    Waiting,
    parse_task_timeout,
    sweep,
    task_timeout,
)
from accelsched.scheduler.grants import Grants

UUIDS = [
    "GPU-aaaaaaaa-0000-0000-0000-000000000000",
    "GPU-bbbbbbbb-0000-0000-0000-000000000001",
    "GPU-cccccccc-0000-0000-0000-000000000002",
]


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, [0, 1, 2]),
        ("", []),
        ("1", [1]),
        ("2,0", [2, 0]),
        ("GPU-bbbbbbbb-0000-0000-0000-000000000001", [1]),
        ("GPU-cccc,0", [2, 0]),  # unique prefix, like CUDA
        ("0,7,1", [0]),  # CUDA stops at the first invalid entry
        ("1,1", [1]),  # and at a repeated one
        ("MIG-0000", []),
    ],
)
def test_visible_devices(value: str | None, expected: list[int]) -> None:
    env = {} if value is None else {"CUDA_VISIBLE_DEVICES": value}
    assert [v.nvml_index for v in resolve_devices(visible_from_env(env), UUIDS)] == expected


def test_ownership_plain_and_dask_cuda() -> None:
    assert owned([1, 0], under_dask_cuda=False) == [1, 0]
    assert owned([1, 0], under_dask_cuda=True) == [1]
    assert owned([], under_dask_cuda=True) == []


@pytest.mark.parametrize(
    "declared, has, advertise, expected",
    [
        (2, 2, True, Claim(2, None)),
        (4, 2, True, Claim(2, "fewer-devices")),
        (2, 0, True, Claim(0, "no-devices")),
        (None, 2, True, Claim(2, "advertised")),
        (None, 2, False, Claim(0, None)),
        (0, 1, True, Claim(1, "advertised")),
        (1, 2, True, Claim(1, None)),
        (None, 0, True, Claim(0, None)),
    ],
)
def test_decide_claim(declared, has, advertise, expected) -> None:  # type: ignore[no-untyped-def]
    assert decide_claim(declared, has, advertise_undeclared=advertise) == expected


def _claim(grants: Grants, worker: str, uuids: list[str]) -> tuple[list[str], dict[str, str]]:
    """Claim devices by UUID; the UUIDs granted and the refused ones with their owners."""
    wanted = [{"index": i, "uuid": u, "name": "x", "memory": 1} for i, u in enumerate(uuids)]
    granted, refused = grants.claim(worker, wanted)  # type: ignore[arg-type]
    return [d["uuid"] for d in granted], refused


def test_registry_exclusive_then_released() -> None:
    reg = Grants(share_gpus=False)
    assert _claim(reg, "a", UUIDS[:2]) == (UUIDS[:2], {})
    assert _claim(reg, "b", UUIDS[1:]) == ([UUIDS[2]], {UUIDS[1]: "a"})
    assert reg.remove("a") == ["b"]  # refused one of a's: may claim it now
    assert _claim(reg, "b", UUIDS[1:]) == (UUIDS[1:], {})
    assert (reg.uuids("a"), reg.uuids("b")) == ([], UUIDS[1:])  # b owns them, a none


def test_registry_shared() -> None:
    reg = Grants(share_gpus=True)
    _claim(reg, "a", UUIDS[:1])
    assert _claim(reg, "b", UUIDS[:1]) == (UUIDS[:1], {})
    reg.remove("a")
    assert (reg.uuids("a"), reg.uuids("b")) == ([], UUIDS[:1])  # b owns it now


def test_grant_numbers() -> None:
    owners = {UUIDS[0]: "a"}
    assert grant(UUIDS[:2], owners, share=False) == ([UUIDS[1]], {UUIDS[0]: "a"})
    assert grant(UUIDS[:2], owners, share=True) == (UUIDS[:2], {})
    assert grant([], owners, share=False) == ([], {})


def test_grant_numbers_through_claims() -> None:
    for share, expected in ((False, ([UUIDS[1]], {UUIDS[0]: "a"})), (True, (UUIDS[:2], {}))):
        reg = Grants(share_gpus=share)
        _claim(reg, "a", UUIDS[:1])
        assert _claim(reg, "b", UUIDS[:2]) == expected
        assert _claim(reg, "c", []) == ([], {})


def test_a_request_is_acted_on_once_and_only_from_its_process() -> None:
    """Stale (another process at that address now, or none), no id, replayed: refused."""
    requests = Requests()
    assert requests.refusal("w", "Worker-old", "Worker-new", "1") == "stale"
    assert requests.refusal("w", "Worker-old", None, "1") == "stale"
    assert requests.refusal("w", None, "Worker-new", "1") == "stale"
    assert requests.refusal("w", "Worker-new", "Worker-new", "") == "no-id"
    assert requests.refusal("w", "Worker-new", "Worker-new", ["1"]) == "no-id"
    assert requests.refusal("w", "Worker-new", "Worker-new", "1") is None
    assert requests.refusal("w", "Worker-new", "Worker-new", "1") == "replayed"
    assert requests.refusal("w", "Worker-new", "Worker-new", "2") is None
    assert requests.refusal("v", "Worker-v", "Worker-v", "1") is None  # per worker
    requests.forget("w")  # it left: the next process at its address starts afresh
    assert requests.refusal("w", "Worker-next", "Worker-next", "1") is None


def decided(waited: float, timeout: float | None, chain: bool, capacity: bool) -> str | None:
    """Why a task unrunnable for ``waited`` seconds falls back now (None: it waits)."""
    w = Waiting("k", since=0.0, amount=1, timeout=timeout, predecessor_fell_back=chain)
    proposals, _ = sweep([w], now=waited, largest=1 if capacity else 0)
    return proposals[0].reason if proposals else None


def test_fallback_policy_numbers() -> None:
    assert decided(1e9, timeout=None, chain=True, capacity=False) is None
    assert task_timeout(5.0, {}) == 5.0 and task_timeout(5.0, {"fallback_timeout": None}) is None
    assert task_timeout(5.0, {"fallback_timeout": 0.0}) == 0.0
    # a task's own annotation, else its step's, else a dual step's CPU form where the
    # plugin has no default, else the default
    step, dual_step = Mark(timeout=2.0, timeout_given=True), Mark(cpu_form=30.0)
    own = {"fallback_timeout": 1.0}
    assert task_timeout(5.0, {}, step) == 2.0 and task_timeout(5.0, own, step) == 1.0
    assert task_timeout(5.0, {}, dual_step) == 5.0 and task_timeout(None, {}, dual_step) == 30.0
    assert task_timeout(None, {}, Mark()) is None
    assert task_timeout(None, {}, Mark(timeout_given=True, cpu_form=30.0)) is None  # its own None
    with pytest.raises(ValueError, match="fallback_timeout"):
        task_timeout(5.0, {"fallback_timeout": "soon"})
    kw = dict(chain=False, capacity=False)
    assert decided(4.99, timeout=5.0, **kw) is None
    assert decided(5.0, timeout=5.0, **kw) == TIMEOUT
    assert decided(0.0, timeout=0.0, **kw) == NO_GPU_CAPACITY
    assert decided(0.0, timeout=5.0, chain=True, capacity=False) == CHAIN
    # GPU capacity came back: the successor waits its own timeout
    assert decided(1.0, timeout=5.0, chain=True, capacity=True) is None


@pytest.mark.parametrize(
    "value, seconds",
    [("500ms", 0.5), (2, 2.0), ("1min", 60.0), (0, 0.0), (None, None), (False, None)],
)
def test_task_timeout_parsing(value, seconds) -> None:  # type: ignore[no-untyped-def]
    assert parse_task_timeout(value) == seconds


@pytest.mark.parametrize("value", ["soon", -1, [1], True, "5 parsecs"])
def test_task_timeout_invalid_names_value(value) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=repr(value).replace("[", r"\[").replace("]", r"\]")):
        parse_task_timeout(value)


def test_lease_table_distinct_devices_and_fractions() -> None:
    t = LeaseTable([0, 1])
    assert t.grant("a", 1) == (0,)
    assert t.grant("b", 1) == (1,)
    with pytest.raises(NoFreeDevice, match="'c'"):
        t.grant("c", 1)
    t.release("a")
    assert t.grant("c", 1) == (0,)
    t.release("b")
    t.release("c")
    assert t.grant("two", 2) == (0, 1)
    t.release("two")
    assert t.grant("h1", 0.5) == (0,)
    assert t.grant("h2", 0.5) == (0,)  # fractions pack: device 1 stays whole
    assert t.grant("whole", 1) == (1,)
    assert t.grant("h3", 0.5) == (0,)  # nothing fits: least busy
    assert len(t.holders()) == 4
    # fractions that do not tile a device never fail: 5 x 0.4 on two devices
    f = LeaseTable([0, 1])
    assert [f.grant(i, 0.4) for i in range(5)] == [(0,), (0,), (1,), (1,), (0,)]
    assert f.grant("x", 1.5) == (1, 0)
    # devices named out of order: a whole device is still the lowest idle index
    u = LeaseTable([1, 0])
    assert u.grant("a", 1) == (0,) and u.grant("b", 1) == (1,)
    u.release("a")
    u.release("b")
    u.set_devices([3, 2])
    assert u.grant("c", 1) == (2,)
    # a whole device shares no device a fraction holds, however small (before, one
    # below float precision left room "for" it)
    v = LeaseTable([0, 1])
    assert v.grant("tiny", 1e-17) == (0,) and v.grant("w", 1) == (1,)


def test_options_validated_at_construction() -> None:
    with pytest.raises(ValueError, match="fallback_timeout='soon'"):
        accelsched.PlacementPlugin(fallback_timeout="soon")
    with pytest.raises(ValueError, match="leak_threshold=-5"):
        accelsched.GuardPlugin(leak_threshold=-5)
    with pytest.raises(ValueError, match="unrequested_gpu='maybe'"):
        accelsched.GuardPlugin(unrequested_gpu="maybe")
    with pytest.raises(TypeError, match="share_gpus=1"):
        accelsched.PlacementPlugin(share_gpus=1)
    with pytest.raises(ValueError, match="fallback_interval=0"):
        accelsched.PlacementPlugin(fallback_interval=0)
    with pytest.raises(ValueError, match="leak_confirmations=0"):
        accelsched.GuardPlugin(leak_confirmations=0)
    with pytest.raises(TypeError, match="'fallback_timout'"):
        accelsched.PlacementPlugin(fallback_timout=1)
    with pytest.raises(TypeError, match="'bogus'"):
        accelsched.register(object(), bogus=1)
    for not_a_client in (None, "tcp://scheduler:8786"):
        with pytest.raises(TypeError, match=f"takes a distributed Client, not {not_a_client!r}"):
            accelsched.register(not_a_client)


def test_a_fraction_too_large_for_a_float_names_the_option() -> None:
    with pytest.raises(ValueError, match="invalid free_pools_above=1000"):
        accelsched.GuardPlugin(free_pools_above=10**400)  # (before: a bare OverflowError)


def test_a_bare_exception_name_must_be_a_builtins() -> None:
    """``oom_exceptions``: a bare name is a builtin's (``MemoryError``); one no builtin
    exception has is refused, naming it (before: taken as ``builtins.OutOfMemoryError``,
    which never matches, so no ``dual`` step ran its CPU form on CuPy's)."""
    taken = accelsched.GuardPlugin(oom_exceptions=["MemoryError", "a.b.OutOfMemoryError"])
    assert taken.options["oom_exceptions"] == ("builtins.MemoryError", "a.b.OutOfMemoryError")
    for bad in ("OutOfMemoryError", "len", "nan"):
        with pytest.raises(ValueError, match=rf"oom_exceptions=.*{bad!r} is no builtin exception"):
            accelsched.GuardPlugin(oom_exceptions=[bad])


@pytest.mark.parametrize(
    "option", ["max_restarts", "max_concurrent_restarts", "leak_confirmations", "free_pools_every"]
)
def test_a_count_past_what_a_message_carries_is_refused(option: str) -> None:
    """Counts travel in heartbeats and events as 64-bit integers: one of 2**63 or more is
    refused at construction, naming it (before: accepted, then the scheduler's status and
    events connections broke on it, as a worker's heartbeat does for a byte figure)."""
    cls = accelsched.PlacementPlugin if "restarts" in option else accelsched.GuardPlugin
    assert cls(**{option: 2**63 - 1}).options[option] == 2**63 - 1
    for bad in (2**63, 2**64, str(2**64)):
        with pytest.raises(ValueError, match=rf"invalid {option}={bad!r}: .*under {2**63}"):
            cls(**{option: bad})


def test_numpy_numbers_are_numbers_as_gpu_and_dual_take_them() -> None:
    """A count or duration computed with numpy is taken as plain Python's, and kept as
    one (the options travel to every worker); a count is still no float (before: every
    numpy scalar refused, where ``gpu(count=np.int64(2))`` took it)."""
    placement = accelsched.PlacementPlugin(
        max_restarts=np.int64(2), fallback_timeout=np.float32(1.5), restart_window=np.int32(60)
    ).options
    guard = accelsched.GuardPlugin(
        leak_confirmations=np.int8(3), free_pools_above=np.float32(0.5)
    ).options
    taken = (placement["max_restarts"], placement["fallback_timeout"], placement["restart_window"])
    assert taken == (2, 1.5, 60.0) and type(placement["max_restarts"]) is int
    assert (guard["leak_confirmations"], guard["free_pools_above"]) == (3, 0.5)
    assert type(guard["free_pools_above"]) is float
    for bad in (np.float64(2.5), np.bool_(True)):
        with pytest.raises(TypeError, match="max_restarts=.*expected a non-negative integer"):
            accelsched.PlacementPlugin(max_restarts=bad)
    with pytest.raises(ValueError, match="fallback_timeout=.*nan"):
        accelsched.PlacementPlugin(fallback_timeout=np.float64("nan"))


def test_config_and_env_and_arguments() -> None:
    with dask.config.set({"accelsched.placement.fallback-timeout": "3s"}):
        assert accelsched.PlacementPlugin().options["fallback_timeout"] == 3.0
        assert accelsched.PlacementPlugin(fallback_timeout=None).options["fallback_timeout"] is None
    with (
        dask.config.set({"accelsched.guard.leak-threshold": "bad"}),
        # (where the value came from: nobody typed it where the error shows)
        pytest.raises(ValueError, match="^dask config accelsched.guard.leak-threshold: .*='bad'"),
    ):
        accelsched.GuardPlugin()


def test_env_override_in_subprocess() -> None:
    import os
    import subprocess
    import sys

    env = dict(os.environ, DASK_ACCELSCHED__PLACEMENT__FALLBACK_TIMEOUT="750ms")
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import accelsched; print(accelsched.PlacementPlugin().options['fallback_timeout'])",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "0.75"


def test_thresholds() -> None:
    opts = resolve_options(GUARD_OPTIONS, {"leak_threshold": "1GiB"}, "G")
    assert opts["leak_threshold"] == Threshold(nbytes=2**30)
    assert (
        resolve_options(GUARD_OPTIONS, {"leak_threshold": 0.25}, "G")["leak_threshold"].resolve(400)
        == 100
    )
    assert (
        resolve_options(GUARD_OPTIONS, {"leak_threshold": 4096}, "G")["leak_threshold"].resolve(1)
        == 4096
    )
    for bad in (0, 1.5, "lots", None):
        with pytest.raises((ValueError, TypeError), match="leak_threshold"):
            resolve_options(GUARD_OPTIONS, {"leak_threshold": bad}, "G")
    assert resolve_options(PLACEMENT_OPTIONS, {}, "P")["share_gpus"] is False


def test_numbers_of_bytes_as_numpy_and_dask_config_give_them() -> None:
    """A numpy integer, and a whole number of bytes written as a float (dask config reads
    ``DASK_ACCELSCHED__GUARD__FREE_POOLS_MIN=1e6`` so), are bytes; a fraction of a byte
    is not (before: both refused, while ``np.float64(0.2)`` and ``1e9`` as a threshold
    were taken)."""
    import numpy as np

    def guard(**given: Any) -> dict[str, Any]:
        return resolve_options(GUARD_OPTIONS, given, "G")

    assert guard(leak_threshold=np.int64(4096))["leak_threshold"] == Threshold(nbytes=4096)
    assert guard(free_pools_min=np.int32(7))["free_pools_min"] == 7
    with dask.config.set({"accelsched.guard.free-pools-min": 1e6}):
        assert guard()["free_pools_min"] == 10**6
    for bad in (1.5, -1.0, float("nan"), 1e30):
        with pytest.raises((ValueError, TypeError), match=re.escape(f"free_pools_min={bad!r}")):
            guard(free_pools_min=bad)


def test_plugins_pickle_only_options() -> None:
    p = accelsched.PlacementPlugin(fallback_timeout="2s")
    q = pickle.loads(pickle.dumps(p))
    assert q.options == p.options and q.scheduler is None
    g = pickle.loads(pickle.dumps(accelsched.GuardPlugin(leak_threshold="1GiB")))
    assert g.options["leak_threshold"].nbytes == 2**30


def test_dual_outside_tasks_runs_cpu_form() -> None:
    f = accelsched.dual(lambda x: ("gpu", x), lambda x: ("cpu", x))
    assert f(1) == ("cpu", 1)
    assert pickle.loads(pickle.dumps(accelsched.dual(abs, round)))(-2.4) == -2  # CPU form
    with pytest.raises(TypeError, match="cpu_fn"):
        accelsched.dual(abs, 3)  # type: ignore[arg-type]
    assert accelsched.current_device() is None
    import numpy

    assert accelsched.array_module() is numpy


def test_device_nbytes_of_containers() -> None:
    from accelsched.devices import SCAN_LIMIT, device_nbytes

    class OnDevice:
        def __init__(self, device: int, n: int) -> None:
            self.device, self.n = device, n

    device_nbytes.register(OnDevice)(lambda o: {o.device: o.n})
    assert device_nbytes([OnDevice(0, 10), (OnDevice(1, 5), OnDevice(0, 1))]) == {0: 11, 1: 5}
    assert device_nbytes({"a": OnDevice(1, 7), "b": 3}) == {1: 7}
    assert device_nbytes(list(range(10 * SCAN_LIMIT))) == {}  # long host lists: not scanned
    assert device_nbytes([OnDevice(0, 1)] * (10 * SCAN_LIMIT)) == {0: 10 * SCAN_LIMIT}
    assert device_nbytes(b"bytes") == {}
