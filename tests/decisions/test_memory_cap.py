"""A task's allocations against the device memory it declared, with numbers; and CuPy's
allocator counting them (CuPy is imported without a GPU; the blocks it hands out here
are stand-ins that no CUDA call touches, since this machine has no device to allocate
on: the allocator's bookkeeping is what is checked)."""

from __future__ import annotations

import gc
import pickle
import threading

import pytest

from accelsched import DeclaredMemoryExceeded
from accelsched.devices import MemoryCap, counted_allocator
from accelsched.policy.requirements import combine, parse_requirement

GiB = 2**30


def test_an_enforced_cap_refuses_the_allocation_past_the_declaration_and_counts_nothing():
    cap = MemoryCap("t", 2 * GiB, enforce=True)
    cap.take(GiB)
    cap.take(GiB)  # exactly what it declared
    with pytest.raises(DeclaredMemoryExceeded) as refused:
        cap.take(1)
    assert (refused.value.declared, refused.value.held, refused.value.attempted) == (
        2 * GiB,
        2 * GiB,
        1,
    )
    assert "task 't' declared 2.00 GiB" in str(refused.value)
    assert cap.held == 2 * GiB and cap.peak == 2 * GiB and not cap.over
    cap.give(GiB)
    cap.take(GiB)  # room again once an allocation ended
    assert cap.held == 2 * GiB


def test_an_unenforced_cap_measures_the_peak():
    cap = MemoryCap("t", 2 * GiB, enforce=False)
    cap.take(3 * GiB)
    cap.give(3 * GiB)
    cap.take(GiB)
    assert (cap.held, cap.peak, cap.over) == (GiB, 3 * GiB, True)


def test_a_cap_needs_a_declaration():
    with pytest.raises(ValueError, match="declared bytes > 0, got 0"):
        MemoryCap("t", 0, enforce=True)


def test_the_error_travels_with_its_figures():
    err = DeclaredMemoryExceeded("('x', 1)", 2 * GiB, GiB, 10 * GiB)
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, MemoryError) and str(back) == str(err)
    assert (back.key, back.declared, back.held, back.attempted) == (
        "('x', 1)",
        2 * GiB,
        GiB,
        10 * GiB,
    )


def test_enforce_is_a_requirement_key_that_needs_memory_and_leaves_placement_alone():
    need = parse_requirement({"memory": "2GiB", "enforce": True})
    assert need.enforce is True and need.label() == "memory>=2GiB"
    with pytest.raises(ValueError, match="enforce=True without memory"):
        parse_requirement({"enforce": True})
    with pytest.raises(ValueError, match="invalid GPU requirement enforce='yes'"):
        parse_requirement({"memory": "2GiB", "enforce": "yes"})
    off = parse_requirement({"memory": "1GiB", "enforce": False})
    loose = parse_requirement({"memory": "3GiB"})
    assert combine([off, need]) == parse_requirement({"memory": "2GiB", "enforce": True})
    assert combine([off, loose]).enforce is False  # type: ignore[union-attr]
    assert combine([loose, loose]).enforce is None  # type: ignore[union-attr]


# --- CuPy's allocator -------------------------------------------------------------------


class _Inner:
    """Stands in for CuPy's pool: hands out unowned blocks at made-up addresses."""

    def __init__(self, fail: bool = False) -> None:
        self.given = 0
        self.fail = fail

    def __call__(self, size: int):  # type: ignore[no-untyped-def]
        from cupy.cuda.memory import MemoryPointer, UnownedMemory

        if self.fail:
            raise MemoryError("the pool is out of memory")
        self.given += 1
        return MemoryPointer(UnownedMemory(0x1000 * self.given, size, None, 0), 0)


def test_cupys_allocator_counts_blocks_while_arrays_hold_them():
    pytest.importorskip("cupy")
    cap = MemoryCap("t", 2 * GiB, enforce=True)
    malloc = counted_allocator(cap, _Inner())
    first = malloc(GiB)
    second = malloc(GiB)
    assert cap.held == 2 * GiB and first.mem.size == GiB and first.ptr == 0x1000
    with pytest.raises(DeclaredMemoryExceeded):
        malloc(1)
    del first  # the array that held it is gone: its bytes are given back
    gc.collect()
    assert cap.held == GiB
    del second
    gc.collect()
    assert cap.held == 0 and cap.peak == 2 * GiB


def test_cupys_allocator_gives_back_what_the_pool_could_not_allocate():
    pytest.importorskip("cupy")
    cap = MemoryCap("t", 2 * GiB, enforce=True)
    with pytest.raises(MemoryError, match="the pool is out of memory"):
        counted_allocator(cap, _Inner(fail=True))(GiB)
    assert cap.held == 0


def test_the_counting_allocator_is_this_threads_alone():
    cupy = pytest.importorskip("cupy")
    from accelsched.devices import Cuda

    default = cupy.cuda.get_allocator()
    cap = MemoryCap("t", GiB, enforce=True)
    undo = Cuda().count(cap)
    assert undo is not None
    try:
        here = cupy.cuda.get_allocator()
        elsewhere: list[object] = []
        thread = threading.Thread(target=lambda: elsewhere.append(cupy.cuda.get_allocator()))
        thread.start()
        thread.join()
        assert here is not default and elsewhere == [default]
    finally:
        undo()
    assert cupy.cuda.get_allocator() == default
