"""What a GPU task needs of its device: parsed, checked and matched with numbers."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from accelsched.policy.requirements import (
    MAX_MEMORY,
    Cancelled,
    DeviceFacts,
    LeaseTable,
    NoFreeDevice,
    Requirement,
    capacity,
    held_counted,
    mebibytes,
    pack,
    parse_requirement,
    requirement_problem,
    share,
)
from accelsched.scheduler.grants import Grants

GiB = 1 << 30
MiB = 1 << 20
H100 = DeviceFacts("NVIDIA H100 80GB HBM3", 80 * GiB, (9, 0))
A100 = DeviceFacts("NVIDIA A100-SXM4-40GB", 40 * GiB, (8, 0))
T4 = DeviceFacts("Tesla T4", 16 * GiB, (7, 5))
SLICE = DeviceFacts("NVIDIA A100-SXM4-40GB MIG 3g.20gb", 20 * GiB, (8, 0), mig=True)
UNKNOWN_CC = DeviceFacts("NVIDIA Simulated GPU", 16 * GiB, None)


@pytest.mark.parametrize(
    "given_, expected",
    [
        ({"memory": "24GiB"}, Requirement(memory=24 * GiB)),
        ({"memory": 1000}, Requirement(memory=1000)),
        ({"memory": 2.0 * GiB}, Requirement(memory=2 * GiB)),
        ({"model": "*H100*"}, Requirement(model="*H100*")),
        ({"capability": "8.0"}, Requirement(capability=(8, 0))),
        ({"capability": (9, 0)}, Requirement(capability=(9, 0))),
        ({"mig": True}, Requirement(mig=True)),
        ({"memory": None, "mig": None}, Requirement()),
        ({}, Requirement()),
        (None, Requirement()),
    ],
)
def test_parse(given_, expected) -> None:
    assert parse_requirement(given_) == expected
    assert parse_requirement(expected) == expected  # a pickled one is checked the same


@pytest.mark.parametrize(
    "bad, named",
    [
        ({"memroy": "1GiB"}, "'memroy'"),
        ({"memory": "lots"}, "memory='lots'"),
        ({"memory": 0}, "memory=0"),
        ({"memory": -1}, "memory=-1"),
        ({"memory": MAX_MEMORY + 1}, f"memory={MAX_MEMORY + 1}"),
        ({"memory": math.nan}, "memory=nan"),
        ({"memory": 1.5}, "memory=1.5"),
        ({"memory": "1.5"}, "memory='1.5'"),  # parse_bytes took it for 1 byte
        ({"memory": "0.5B"}, "memory='0.5B'"),
        # no number (dask reads one of the unit) or a fraction of a byte however written
        ({"memory": ""}, "memory=''"),
        ({"memory": " "}, "memory=' '"),
        ({"memory": "GiB"}, "memory='GiB'"),
        ({"memory": "1.5e0"}, "memory='1.5e0'"),
        ({"memory": "1.5B"}, "memory='1.5B'"),
        ({"memory": "1e400"}, "memory='1e400'"),
        ({"memory": "1025PiB"}, "memory='1025PiB'"),
        ({"memory": True}, "memory=True"),
        ({"model": ""}, "model=''"),
        ({"model": 5}, "model=5"),
        ({"model": "x" * 201}, "model="),
        ({"model": "H100\x1b[2J"}, "unprintable"),
        ({"capability": "eight"}, "capability='eight'"),
        ({"capability": 8.0}, "capability=8.0"),
        ({"capability": (8, -1)}, "capability=(8, -1)"),
        ({"mig": "yes"}, "mig='yes'"),
        ("24GiB", "'24GiB'"),
        (Requirement(memory=-5), "memory=-5"),  # unpickled: checked as strictly
    ],
)
def test_bad_values_are_named(bad, named) -> None:
    with pytest.raises(ValueError, match="GPU requirement") as info:
        parse_requirement(bad)
    assert named in str(info.value)
    assert requirement_problem(bad) == str(info.value)


@pytest.mark.parametrize(
    "req, fits",
    [
        (Requirement(), {H100, A100, T4, SLICE, UNKNOWN_CC}),
        (Requirement(memory=24 * GiB), {H100, A100}),
        (Requirement(memory=60 * GiB), {H100}),
        (Requirement(memory=100 * GiB), set()),
        (Requirement(model="*h100*"), {H100}),  # case-insensitive
        (Requirement(model="NVIDIA A100*"), {A100, SLICE}),
        (Requirement(capability=(8, 0)), {H100, A100, SLICE}),  # unknown: not proven
        (Requirement(capability=(7, 5)), {H100, A100, T4, SLICE}),
        (Requirement(mig=True), {SLICE}),
        (Requirement(mig=False, model="*A100*"), {A100}),
    ],
)
def test_fits(req, fits) -> None:
    assert {d for d in (H100, A100, T4, SLICE, UNKNOWN_CC) if req.fits(d)} == fits


def test_labels_name_the_requirement() -> None:
    assert Requirement().label() == "any" and not Requirement()
    r = Requirement(memory=24 * GiB, model="*H100*", capability=(9, 0), mig=False)
    assert r.label() == "memory>=24GiB,model=*H100*,capability>=9.0,whole-gpu" and r
    assert Requirement(memory=1000).label() == "memory>=1000B"


def test_pack_best_fit() -> None:
    # two devices of 80 and 40 (GiB), nothing leased: a 4 GiB task goes to the smaller
    devices = [(0, 80, 0), (1, 40, 0)]
    assert pack(4, devices) == 1
    # the 40 has 2 left: a 4 goes to the 80; a 60 goes to the 80; a 90 nowhere
    devices = [(0, 80, 0), (1, 40, 38)]
    assert pack(4, devices) == 0 and pack(60, devices) == 0 and pack(90, devices) is None
    # an exact fit is best
    assert pack(20, [(0, 80, 50), (1, 40, 20)]) == 1
    # a device held whole takes no declared task
    assert pack(1, [(0, 80, 0), (1, 40, 0)], whole=[1]) == 0
    assert pack(1, [(0, 80, 0)], whole=[0]) is None


@given(
    st.lists(st.tuples(st.integers(1, 100), st.integers(0, 100)), min_size=0, max_size=8),
    st.integers(1, 120),
)
def test_pack_never_overfills(caps, need) -> None:
    devices = [(i, cap, min(leased, cap)) for i, (cap, leased) in enumerate(caps)]
    chosen = pack(need, devices)
    rooms = {i: cap - leased for i, cap, leased in devices}
    if chosen is None:
        assert all(room < need for room in rooms.values())
    else:
        assert rooms[chosen] >= need
        assert rooms[chosen] == min(r for r in rooms.values() if r >= need)


# --- written on a step: checked there, and again where a pickle arrives ------------------


def _double(x: int) -> int:
    return 2 * x


def test_steps_carry_their_requirement_through_a_pickle() -> None:
    import pickle

    import cloudpickle

    import accelsched
    from accelsched.policy.marks import Mark, find_mark, mark_problem

    step = accelsched.gpu(memory="24GiB", model="*H100*", capability="9.0")(_double)
    both = accelsched.dual(_double, _double, memory="4GiB", mig=False)
    plain = accelsched.dual(_double, _double)
    for obj, want in (
        (step, Requirement(memory=24 * GiB, model="*H100*", capability=(9, 0))),
        (both, Requirement(memory=4 * GiB, mig=False)),
        (plain, None),
    ):
        for again in (pickle.loads(cloudpickle.dumps(obj)), obj):
            mark = find_mark(again)
            assert mark is not None and mark.requirement == want and mark_problem(mark) is None
            assert again(21) == 42
    forged = Mark(count=1, requirement=Requirement(memory=-1))
    assert "memory=-1" in (mark_problem(forged) or "")


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"memory": "a lot"}, "memory='a lot'"),
        ({"capability": "nine"}, "capability='nine'"),
        ({"mig": "no"}, "mig='no'"),
        ({"model": ""}, "model=''"),
    ],
)
def test_bad_requirements_raise_where_written(kwargs, named) -> None:
    import accelsched

    with pytest.raises(ValueError, match=r"^gpu\(\): invalid GPU requirement") as info:
        accelsched.gpu(**kwargs)(_double)
    assert named in str(info.value)
    with pytest.raises(ValueError, match=r"^dual\(\): invalid GPU requirement"):
        accelsched.dual(_double, _double, **kwargs)


def test_fused_steps_combine_their_requirements() -> None:
    from accelsched.policy.requirements import Conflict, combine

    assert combine([]) is None
    a, b = Requirement(memory=4 * GiB, capability=(8, 0)), Requirement(memory=8 * GiB)
    assert combine([a]) is a
    assert combine([a, b]) == Requirement(memory=8 * GiB, capability=(8, 0))
    assert combine([a, Requirement(model="*H100*")]) == Requirement(
        memory=4 * GiB, capability=(8, 0), model="*H100*"
    )
    clash = combine([Requirement(model="*H100*"), Requirement(model="*A100*")])
    assert isinstance(clash, Conflict) and not clash.fits(H100)
    assert "model=*A100* and model=*H100*" in clash.label()
    assert "conflicting" in (requirement_problem(clash) or "")
    assert isinstance(combine([Requirement(mig=True), Requirement(mig=False)]), Conflict)


# --- on the worker: the lease table takes requirements ------------------------------------


def _table() -> LeaseTable:
    table = LeaseTable()
    table.set_devices([0, 1], {0: H100, 1: A100})  # 80 and 40 GiB
    return table


def test_declared_tasks_share_a_device_while_they_fit() -> None:
    table = _table()
    four = Requirement(memory=4 * GiB)
    # best fit: the smaller device fills first (capacity 38 GiB: nine 4 GiB tasks)
    got = [table.grant(f"s{i}", 0, four) for i in range(9)]
    assert got == [(1,)] * 9 and table.declared() == {0: 0, 1: 36 * GiB}
    assert table.grant("s9", 0, four) == (0,)  # the tenth: 2 GiB left on the 40
    big = Requirement(memory=60 * GiB, model="*H100*")
    assert table.grant("big", 0, big) == (0,)  # 76 - 4 = 72 left on the H100
    assert table.declared() == {0: 64 * GiB, 1: 36 * GiB}
    table.release("big")
    assert table.declared()[0] == 4 * GiB


def test_a_whole_device_task_and_declared_tasks_never_share() -> None:
    table = _table()
    assert table.grant("whole", 1) == (0,)
    assert table.grant("small", 0, Requirement(memory=GiB)) == (1,)  # not the held one
    with pytest.raises(NoFreeDevice, match=r"a device with memory>=60GiB,model=\*A100\*"):
        table.grant("big", 0, Requirement(memory=60 * GiB, model="*A100*"))  # 40 GiB


def test_a_waiting_whole_device_task_claims_its_device_from_new_declared_tasks() -> None:
    """A stream of small declared tasks would keep a device busy for as long as it
    flows; a whole-device task waiting for it claims it, so it starts once the tasks
    already there end."""
    table = _table()
    small = Requirement(memory=GiB, model="*A100*")
    assert table.grant("s1", 0, small) == (1,)
    assert table.grant("s2", 0, small) == (1,)
    whole = Requirement(model="*A100*")
    assert table.grant("whole", 1, whole) is None  # waits for s1 and s2
    assert table.grant("s3", 0, small) is None  # packed there before: waits now
    assert table.grant("other", 0, Requirement(memory=GiB)) == (0,)  # unclaimed: packs
    table.release("s1")
    assert table.grant("s3", 0, small) is None  # the claim holds while it waits
    table.release("s2")
    assert table.grant("whole", 1, whole) == (1,)
    assert table.grant("s3", 0, small) is None  # held whole now
    table.release("whole")
    assert table.grant("s3", 0, small) == (1,)  # the claim went with its lease


def test_a_task_cancelled_while_it_waits_gives_up_its_claim_and_stops_waiting() -> None:
    """It waited on, claiming its device, and ran once the device was free, though its
    result would be dropped."""
    table = _table()
    small = Requirement(memory=GiB, model="*A100*")
    whole = Requirement(model="*A100*")
    assert table.grant("s1", 0, small) == (1,)
    table.started("whole", gpu=True)
    assert table.grant("whole", 1, whole) is None  # waits, claiming the A100
    assert table.grant("s2", 0, small) is None
    assert table.cancel("whole") is True
    assert table.grant("s2", 0, small) == (1,)  # the claim went with the cancel
    with pytest.raises(Cancelled, match="'whole' was cancelled while it waited"):
        table.grant("whole", 1, whole)
    table.resume("whole")  # wanted again while its thread ran on: it waits again
    assert table.grant("whole", 1, whole) is None
    assert table.cancel("s1") is False  # holds its lease: runs to its end
    assert table.grant("s3", 0, small) is None  # claimed again by the resumed one


def test_a_waiting_task_claims_what_older_claims_leave_it() -> None:
    """A task needing two A100s, finding one claimed by an older waiter, claimed nothing:
    the stream of declared tasks went on packing onto the other while it waited. It
    claims that one now; a younger claim never holds back an older waiter."""
    table = LeaseTable()
    table.set_devices([0, 1, 2], {0: H100, 1: A100, 2: A100})
    assert table.grant("s0", 0, Requirement(memory=30 * GiB, model="*H100*")) == (0,)
    assert table.grant("s1", 0, Requirement(memory=GiB, model="*A100*")) == (1,)
    # past device 1's room (38 GiB less s1's one): device 2
    assert table.grant("s2", 0, Requirement(memory=37 * GiB + GiB // 2, model="*A100*")) == (2,)
    assert table.grant("one", 1) is None  # claims the least declared on: device 1
    pair = Requirement(model="*A100*")
    assert table.grant("pair", 2, pair) is None  # claims what is left of its A100s: 2
    small = Requirement(memory=GiB // 4, model="*A100*")  # fits in either's room
    assert table.grant("s3", 0, small) is None  # neither A100 takes it now
    table.release("s1")
    assert table.grant("one", 1) == (1,)
    assert table.grant("pair", 2, pair) is None  # claims both A100s now
    table.release("s2")
    assert table.grant("s3", 0, small) is None  # device 2 is free, but claimed
    table.release("one")
    assert table.grant("pair", 2, pair) == (1, 2)


def test_a_claim_goes_with_a_task_no_device_can_hold_any_more() -> None:
    table = _table()
    small = Requirement(memory=GiB, model="*A100*")
    assert table.grant("s1", 0, small) == (1,)
    assert table.grant("whole", 1, Requirement(model="*A100*")) is None
    table.set_devices([0], {0: H100})  # the A100 withdrawn
    with pytest.raises(NoFreeDevice):
        table.grant("whole", 1, Requirement(model="*A100*"))
    table.set_devices([0, 1], {0: H100, 1: A100})  # back
    assert table.grant("s2", 0, small) == (1,)  # nobody claims it now


def test_a_task_no_device_here_fits_is_sent_back_at_once() -> None:
    table = _table()
    with pytest.raises(NoFreeDevice, match="model=\\*T4\\*"):
        table.grant("t4", 1, Requirement(model="*T4*"))
    with pytest.raises(NoFreeDevice, match="memory>=100GiB"):
        table.grant("huge", 0, Requirement(memory=100 * GiB))
    assert len(table.holders()) == 0


def test_a_task_whose_room_is_split_waits_for_a_lease_to_end() -> None:
    table = _table()
    fill = Requirement(memory=38 * GiB, model="*A100*")
    assert table.grant("a", 0, fill) == (1,)
    assert table.grant("b", 0, Requirement(memory=70 * GiB)) == (0,)
    ten = Requirement(memory=10 * GiB)
    assert table.grant("c", 0, ten) is None  # 6 GiB left on one, 0 on the other: it waits
    assert table.grant("c", 0, ten) is None and len(table.holders()) == 2
    table.release("a")
    assert table.grant("c", 0, ten) == (1,)


# --- room that counts what is there: results held, devices shared -----------------------


def test_a_shared_device_is_divided_among_the_workers_granted_it() -> None:
    cap = capacity(16 * GiB)  # 16 GiB less its 0.8 GiB reserve, in whole MiB (down)
    assert cap == 15564 * MiB and 16 * GiB - (16 * GiB) // 20 - cap < MiB
    assert share(16 * GiB) == cap and share(16 * GiB, 0) == cap
    assert share(16 * GiB, 2) == 7782 * MiB  # 7.6 GiB each: one 6 GiB task, never two
    assert share(16 * GiB, 3) == 5188 * MiB and share(16 * GiB, 7) == 2223 * MiB  # MiB, down
    assert 2 * share(16 * GiB, 2) <= cap and 3 * share(80 * GiB, 3) <= capacity(80 * GiB)


def test_results_count_against_the_offered_room_in_steps_of_a_sixteenth() -> None:
    assert held_counted(0, 16 * GiB) == 0
    assert held_counted(1, 16 * GiB) == GiB  # a byte held: one step (a GiB of 16)
    assert held_counted(10 * GiB, 16 * GiB) == 10 * GiB
    assert held_counted(10 * GiB + 1, 16 * GiB) == 11 * GiB  # never less than held
    assert held_counted(5 * GiB, 80 * GiB) == 5 * GiB  # 5 GiB steps on 80 GiB
    assert held_counted(3, 8 << 20) == 1 << 20  # at least 1 MiB a step
    # whole MiB a step: an 80 GB card's sixteenth (5097.4 MiB) counts as 5097 MiB
    assert held_counted(1, 85520809984) == 5097 * MiB


def test_grants_divide_a_shared_device_and_take_what_results_hold_off() -> None:
    """Two workers granted one 16 GiB device each place against half its capacity; the
    results one holds come off its figure alone; a sharer gone, the other has it all."""
    grants = Grants(share_gpus=True)
    record = {"index": 0, "uuid": "GPU-a", "name": "T4", "memory": 16 * GiB}
    for worker in ("w1", "w2"):
        grants.claim(worker, [record])  # type: ignore[list-item]
    grants.offer("w1", 1, ["GPU-a"])
    grants.offer("w2", 1, ["GPU-a"], held={"GPU-a": 5 * GiB})
    half = capacity(16 * GiB) // 2
    assert grants.sharers("w1") == {"w2"}
    assert half == 7782 * MiB
    assert grants.shares("w1", 1) == ({"GPU-a": half}, 7782)
    assert grants.shares("w2", 1) == ({"GPU-a": half}, 7782 - 5 * 1024)
    grants.remove("w2")
    assert grants.shares("w1", 1) == ({"GPU-a": capacity(16 * GiB)}, 15564)  # 15.2 GiB in MiB
    assert grants.shares("w1", 0) == ({}, 0)


def test_a_shared_device_passes_room_on_only_once_let_go() -> None:
    """w1 packs a 16 GiB device alone, then w2 is granted it too: w2's share is what w1
    may still take leaves. w1 was told the whole device; told half, it may still pack
    it all until its guard says it packs within half; tasks packed under the whole one
    (12 GiB) leave w2 3.2 GiB until they end."""
    grants = Grants(share_gpus=True)
    record = {"index": 0, "uuid": "GPU-a", "name": "T4", "memory": 16 * GiB}
    cap = capacity(16 * GiB)
    half = cap // 2
    grants.claim("w1", [record])  # type: ignore[list-item]
    grants.offer("w1", 1, ["GPU-a"], packs={})  # before any reply: packs nothing
    grants.tell("w1", grants.shares("w1", 1)[0])
    assert grants.of("w1").told == {"GPU-a": cap}
    grants.claim("w2", [record])  # type: ignore[list-item]
    grants.offer("w2", 1, ["GPU-a"], packs={})
    assert grants.shares("w2", 1)[0] == {"GPU-a": 0}  # w1 was told it all
    assert grants.shares("w1", 1)[0] == {"GPU-a": half}  # w2 takes nothing yet
    grants.tell("w2", {"GPU-a": 0})
    grants.offer("w1", 1, ["GPU-a"], packs={"GPU-a": cap})  # as it stood when it offered
    grants.tell("w1", {"GPU-a": half})
    assert grants.shares("w2", 1)[0] == {"GPU-a": 0}  # it applies half once the reply comes
    assert grants.untold("w1") == []
    grants.offer("w1", 1, ["GPU-a"], packs={"GPU-a": 12 * GiB})  # half applied, tasks run on
    assert grants.shares("w2", 1)[0] == {"GPU-a": cap - 12 * GiB}
    assert grants.untold("w1") == ["w2"]  # told 0: asked to offer again, to learn it
    grants.offer("w1", 1, ["GPU-a"], packs={"GPU-a": half})  # they ended
    assert grants.shares("w2", 1)[0] == {"GPU-a": half}
    grants.offer("w2", 1, ["GPU-a"], packs={"GPU-a": 0})
    grants.tell("w2", {"GPU-a": half})
    assert grants.untold("w2") == [] and grants.untold("w1") == []
    assert grants.shares("w1", 1)[0]["GPU-a"] + grants.shares("w2", 1)[0]["GPU-a"] <= cap
    grants.remove("w2")
    assert grants.shares("w1", 1)[0] == {"GPU-a": cap}


def test_a_need_placed_in_the_room_offered_always_fits_the_lease_table() -> None:
    """The scheduler places a declared need (whole MiB, rounded up) against the room a
    worker offers (whole MiB, rounded down); the worker's lease table packs by the byte.
    Whatever the device's size, its sharers, what results hold and what a sharer packs,
    the largest need placeable in the room fits the table, and a byte more is not
    placeable: nothing the scheduler places there is sent back (it was, again and again,
    when the room was rounded up)."""
    checked = 0
    for memory in (16 * GiB, 85520809984, 40 * GiB + 12345):
        for sharers in (1, 2, 3):
            for held_bytes in (0, 1, 3 * GiB + 7):
                for other_packs in (None, 2 * GiB + 5):
                    grants = Grants(share_gpus=True)
                    record = {"index": 0, "uuid": "GPU-a", "name": "T4", "memory": memory}
                    for w in range(sharers):
                        grants.claim(f"w{w}", [record])  # type: ignore[list-item]
                    if other_packs is not None and sharers > 1:
                        grants.offer("w1", 1, ["GPU-a"], packs={"GPU-a": other_packs})
                    held = {"GPU-a": held_counted(held_bytes, memory)}
                    grants.offer("w0", 1, ["GPU-a"], held=held)
                    shares, room = grants.shares("w0", 1)
                    table = LeaseTable(held=lambda d, h=held_bytes: h)
                    facts = {0: DeviceFacts("T4", memory, (7, 5))}
                    table.set_devices([0], facts, {0: shares["GPU-a"]})
                    largest = room * MiB
                    assert room > 0 and mebibytes(largest) == room and mebibytes(largest + 1) > room
                    assert table.grant("largest", 0, Requirement(memory=largest)) == (0,), (
                        memory,
                        sharers,
                        held_bytes,
                        other_packs,
                    )
                    checked += 1
    assert checked == 54


def test_room_results_hold_is_not_packed_into() -> None:
    """A 10 GiB result on a 16 GiB device (15.2 GiB declarable): an 8 GiB task does not
    fit beside it. No lease ending makes room, and the room offered (15.2 less 10) is
    under 8 GiB: sent back, to go where there is room. Released, it fits."""
    held = {0: 10 * GiB}
    table = LeaseTable(held=lambda d: held.get(d, 0))
    table.set_devices([0], {0: T4})
    eight = Requirement(memory=8 * GiB)
    with pytest.raises(NoFreeDevice, match="beside the results they hold"):
        table.grant("honest", 0, eight)
    assert table.grant("small", 0, Requirement(memory=5 * GiB)) == (0,)  # 5.2 left
    table.release("small")
    held[0] = 0
    assert table.grant("honest", 0, eight) == (0,)


def test_a_task_waits_while_leases_that_end_hold_the_room_results_leave() -> None:
    held = {0: 4 * GiB}
    table = LeaseTable(held=lambda d: held.get(d, 0))
    table.set_devices([0], {0: T4})
    six = Requirement(memory=6 * GiB)
    assert table.grant("a", 0, six) == (0,)  # 4 + 6 of 15.2
    assert table.grant("b", 0, six) is None  # 4 + 6 + 6 > 15.2: waits for a
    table.started("a")
    table.release("a")  # its result not in memory yet: its room is held still
    assert table.grant("b", 0, six) is None
    held[0] += 6 * GiB  # in memory now, held by the ledger
    assert table.ended("a")
    with pytest.raises(NoFreeDevice):  # 10 GiB held, 5.2 offered: goes elsewhere
        table.grant("b", 0, six)


def test_a_worker_packs_within_its_share_of_a_shared_device() -> None:
    table = LeaseTable()
    table.set_devices([0], {0: T4}, shares={0: share(16 * GiB, 2)})
    six = Requirement(memory=6 * GiB)
    assert table.grant("a", 0, six) == (0,)
    assert table.grant("b", 0, six) is None  # 12 GiB is past its 7.6: waits for a
    with pytest.raises(NoFreeDevice):  # never fits its share
        table.grant("c", 0, Requirement(memory=8 * GiB))
    table.release("a")
    assert table.grant("b", 0, six) == (0,)


def test_room_split_by_results_over_devices_waits_rather_than_bounce() -> None:
    """Two 16 GiB devices each holding 10 GiB of results: 10.4 GiB offered in all, so the
    scheduler may place a 6 GiB task here, though no one device has room: it waits for
    results to go (sent back, it would be placed here again)."""
    held = {0: 10 * GiB, 1: 10 * GiB}
    table = LeaseTable(held=lambda d: held.get(d, 0))
    table.set_devices([0, 1], {0: T4, 1: T4})
    six = Requirement(memory=6 * GiB)
    assert table.grant("six", 0, six) is None
    held[1] = 0
    assert table.grant("six", 0, six) == (1,)
