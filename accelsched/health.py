"""When a failing GPU counts as healthy again: decisions only, no distributed import.

A device that stops answering NVML is withdrawn at once. Taking it back at its first
answer would let a flapping device (failing and answering by turns) withdraw and
re-offer itself, with an event and a restart request each time, at every check. So a
device must answer for a streak of checks first, and each new failure doubles the
streak it needs (up to a ceiling): one glitch costs a few checks, a flapping device
stays out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["DeviceHealth"]


@dataclass
class DeviceHealth:
    """Per device: withdrawn or not, how often it failed, its current good streak."""

    streak: int = 3  # good answers needed after a first failure
    ceiling: int = 96  # most ever needed
    _failures: dict[int, int] = field(default_factory=dict)
    _good: dict[int, int] = field(default_factory=dict)  # device -> answers in a row
    withdrawn: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.streak < 1 or self.ceiling < self.streak:
            raise ValueError(f"invalid streak={self.streak!r}, ceiling={self.ceiling!r}")

    def failed(self, device: int) -> bool:
        """The device did not answer; True when this withdraws it (news, said once)."""
        self._good.pop(device, None)
        if device in self.withdrawn:
            return False
        self.withdrawn.add(device)
        self._failures[device] = self._failures.get(device, 0) + 1
        return True

    def needed(self, device: int) -> int:
        """Good answers in a row the withdrawn ``device`` needs before it is back."""
        failures = max(1, self._failures.get(device, 1))
        return min(self.ceiling, self.streak * 2 ** (failures - 1))

    def answered(self, device: int) -> bool:
        """The device answered; True when this brings a withdrawn device back."""
        if device not in self.withdrawn:
            return False
        self._good[device] = self._good.get(device, 0) + 1
        if self._good[device] < self.needed(device):
            return False
        self.withdrawn.discard(device)
        self._good.pop(device, None)
        return True
