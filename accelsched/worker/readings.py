"""A check's NVML readings of this worker's idle devices, and what their answers call for.

Each check queries, through NVML, every owned device no GPU task holds: this process's
memory there (what the leak estimate starts from) and the device's memory info (what
pools and users read). A device whose query raises has stopped answering; one that
answers after failing may come back. Whether either is news is
:func:`~accelsched.policy.health.judge_answers`'s to say, with
:class:`~accelsched.policy.health.DeviceHealth` (shared with
:class:`~accelsched.worker.rejoin.Rejoin`, so a device failing again needs a longer
streak, whichever part saw it fail).
"""

from __future__ import annotations

from collections.abc import Callable

from accelsched.devices.nvml import DeviceInfo, NVMLMonitor
from accelsched.devices.records import MemoryReading
from accelsched.policy.health import Answer, DeviceHealth, judge_answers
from accelsched.policy.proposals import Proposal

__all__ = ["DeviceReadings"]


class DeviceReadings:
    """Reads the owned devices (``owned``, kept up to date in place by the inventory)."""

    def __init__(
        self,
        *,
        monitor: NVMLMonitor,
        owned: list[DeviceInfo],
        granted: Callable[[], list[DeviceInfo]],
        health: DeviceHealth,
        recover: bool,
    ) -> None:
        self.monitor = monitor
        self.owned = owned
        self._granted = granted
        self.health = health
        self.recover = recover  # ``recover_gpus``: a withdrawn device answering comes back

    def take(self, busy: set[int]) -> tuple[dict[int, MemoryReading], list[Proposal]]:
        """This process's reading of each owned device not in ``busy``, and the
        proposals its answers call for (withdraw, recover, ask for a restart)."""
        readings: dict[int, MemoryReading] = {}
        answers: list[Answer] = []
        for dev in self.owned:
            if dev.index in busy:
                continue
            try:
                readings[dev.index] = self.monitor.process_memory(dev.index)
                self.monitor.used(dev.index)
            except Exception as exc:  # NVMLError: the device stopped answering
                readings.pop(dev.index, None)
                granted = dev in self._granted()  # not ours to offer: nothing to withdraw
                answers.append(Answer(dev.index, dev.uuid, error=repr(exc), granted=granted))
                continue
            answers.append(Answer(dev.index, dev.uuid))
        return readings, judge_answers(self.health, answers, recover=self.recover)

    def again(self, device: int) -> MemoryReading | None:
        """This process's reading of ``device`` now; None when NVML does not answer (the
        next check withdraws it)."""
        try:
            return self.monitor.process_memory(device)
        except Exception:  # NVMLError
            return None
