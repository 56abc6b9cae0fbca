"""When a failing GPU counts as healthy again: decisions only, no distributed import.

A device that stops answering NVML is withdrawn at once. Taking it back at its first
answer would let a flapping device (failing and answering by turns) withdraw and
re-offer itself, with an event and a restart request each time, at every check. So a
device must answer for a streak of checks first, and each new failure doubles the
streak it needs (up to a ceiling): one glitch costs a few checks, a flapping device
stays out. Nothing here restarts a worker into a fault it can see (:func:`judge_answers`).
A device a process left out of its inventory (it did not answer then) is on
probation: asked again with backoff, back under the same rule, and reported until the
scheduler grants it.
:func:`judge_answers` turns a check's NVML answers into proposals.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from accelsched.policy.leak import DeviceRecord
from accelsched.policy.proposals import Proposal

__all__ = ["Answer", "DeviceHealth", "judge_answers"]


@dataclass
class DeviceHealth:
    """Per device (its :class:`~accelsched.policy.leak.DeviceRecord`): withdrawn or not,
    how often it failed, its current good streak; and, for a device left out of the
    inventory, when to try it again.

    Probation: a device left out at a start (often right after a restart its failure
    caused) is probed after ``first`` seconds, and the wait doubles with each failed
    probe up to ``longest``: a dead GPU costs one NVML query now and then, a glitch a few
    seconds. While it answers it is probed at the ``first`` pace, and it is back after
    the same streak as any withdrawn device (a failure meanwhile starts it over, and the
    wait goes on doubling: a flapping device stays out). A device back is due at once, to
    be reported to the scheduler; a report that does not get it granted is one more failed
    try, on the same doubling wait from ``first``, until :meth:`granted`.
    """

    streak: int = 3  # good answers needed after a first failure
    ceiling: int = 96  # most ever needed
    first: float = 1.0  # seconds to the first probe; the pace while a device answers
    longest: float = 30.0  # the most seconds between two probes
    #: device -> its record (the leak decisions share it: one record per device)
    devices: defaultdict[int, DeviceRecord] = field(
        default_factory=lambda: defaultdict(DeviceRecord)
    )

    def __post_init__(self) -> None:
        if self.streak < 1 or self.ceiling < self.streak or not 0 < self.first <= self.longest:
            raise ValueError(
                f"invalid streak={self.streak!r}, ceiling={self.ceiling!r}, "
                f"first={self.first!r}, longest={self.longest!r}"
            )

    @property
    def withdrawn(self) -> set[int]:
        """The devices out of service (not offered)."""
        return {d for d, r in self.devices.items() if r.withdrawn}

    def failed(self, device: int) -> bool:
        """The device did not answer; True when this withdraws it (news, said once)."""
        r = self.devices[device]
        r.good, r.restart_asked = 0, False  # a new failure: once back, ask again
        if r.withdrawn:
            return False
        r.withdrawn, r.failures = True, r.failures + 1
        return True

    def needed(self, device: int) -> int:
        """Good answers in a row the withdrawn ``device`` needs before it is back."""
        failures = max(1, self.devices[device].failures)
        return min(self.ceiling, self.streak * 2 ** (failures - 1))

    def answered(self, device: int) -> bool:
        """The device answered; True when this brings a withdrawn device back."""
        r = self.devices[device]
        if not r.withdrawn:
            return False
        r.good += 1
        if r.good < self.needed(device):
            return False
        r.withdrawn, r.good = False, 0
        return True

    # --- probation: devices left out of the inventory -------------------------------

    def left_out(self, device: int, now: float) -> None:
        """``device`` did not answer when the inventory was taken at ``now``."""
        self.failed(device)
        r = self.devices[device]
        r.probe_at, r.probe_wait = now + self.first, min(self.longest, 2 * self.first)

    @property
    def waiting(self) -> list[int]:
        """The devices left out and still out, or back but not granted yet, in order."""
        return self.due(float("inf"))

    def due(self, now: float) -> list[int]:
        """The devices to probe, or to report again, at ``now``, in order."""
        devices = self.devices.items()
        return sorted(d for d, r in devices if r.probe_at is not None and r.probe_at <= now)

    def probe_answered(self, device: int, now: float) -> bool:
        """A probe of ``device`` answered; True when this brings it back (report it now)."""
        r = self.devices[device]
        if r.probe_at is None or not r.withdrawn:
            return False
        back = self.answered(device)
        r.probe_at, r.probe_wait = (now, self.first) if back else (now + self.first, r.probe_wait)
        return back

    def retry(self, device: int, now: float) -> float:
        """A try at ``device`` failed at ``now``: a probe (its streak starts over) or a
        report not granted. Returns the wait before the next try (0: not on probation);
        the wait after doubles."""
        r = self.devices[device]
        if r.probe_at is None:
            return 0.0
        if r.withdrawn:
            self.failed(device)
        wait = r.probe_wait
        r.probe_at, r.probe_wait = now + wait, min(self.longest, 2 * wait)
        return wait

    def granted(self, device: int) -> None:
        """The scheduler granted ``device`` back: off probation."""
        self.devices[device].probe_at = None


@dataclass(frozen=True)
class Answer:
    """How one device answered a check's NVML query."""

    device: int
    uuid: str
    error: str | None = None  # the repr of what NVML raised; None: it answered
    granted: bool = True  # the scheduler granted it to this worker: only then withdrawn


def judge_answers(
    health: DeviceHealth, answers: Iterable[Answer], *, recover: bool
) -> list[Proposal]:
    """What a check's answers call for, device by device in the order asked.

    A granted device that stops answering is withdrawn once (however many checks see it
    fail): no new lease lands on it and the worker advertises one GPU fewer, but it keeps
    serving its other devices and CPU work. It does NOT ask for a restart: a fault NVML
    shows now is the device's or the driver's, which a new process does not cure (a GPU
    off the bus stays lost), and a new process started during it may not start at all
    (distributed's own GPU diagnostics query the first visible device as it starts). So
    the worker waits for the device to answer. One that answered long enough (the streak
    :class:`DeviceHealth` requires) comes back in this process when ``recover``
    (``recover_gpus``); without it, only then does the worker ask for a restart (reason
    ``gpu-unhealthy``), into a device that answers: the new process verifies it again.
    """
    out: list[Proposal] = []
    for a in answers:
        if a.error is not None:
            if a.granted and health.failed(a.device):
                detail = {"uuid": a.uuid, "error": a.error}
                out.append(Proposal("withdraw", a.device, "gpu-unhealthy", detail=detail))
        elif health.answered(a.device):
            if recover:
                out.append(Proposal("recover", a.device, detail={"uuid": a.uuid}))
            else:  # out of this process; a restart takes it back, now that it answers
                r = health.devices[a.device]
                r.withdrawn = True
                if not r.restart_asked:  # once: the restart is the cure
                    r.restart_asked = True
                    proposal = Proposal("ask-restart", (a.device,), "gpu-unhealthy", {"nbytes": 0})
                    out.append(proposal)
    return out
