"""Results entering a worker's memory, as the leak check counts them (worker event loop).

Every task's result passes here, so the common cases cost a few comparisons: a result
its GPU task measured is held at its measurement without a look at its value, and an
unmeasured number or string (what most tiny tasks return) holds nothing on a device.
What live results hold is legitimate: the leak estimate takes it off
(:class:`LiveResults`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from accelsched import internals
from accelsched.devices.nvml import DeviceInfo
from accelsched.policy.leases import LeaseTable
from accelsched.worker.ledger import Ledger

if TYPE_CHECKING:
    from distributed import Worker

__all__ = ["LiveResults", "stored"]


class LiveResults:
    """The device bytes each result in the worker's memory holds, and their sum per
    device (``owned``: the inventory's list, kept up to date in place)."""

    def __init__(self, *, ledger: Ledger, owned: list[DeviceInfo], leases: LeaseTable) -> None:
        self.ledger = ledger
        self.owned = owned
        self.leases = leases
        self.live: dict[Any, dict[int, int]] = {}  # key -> device bytes it holds
        self.total: dict[int, int] = {}  # device -> bytes of live results

    def stored(self, key: Any, value: Any, *, arrived: bool = False) -> None:
        """``key`` entered the worker's memory holding ``value``: computed here (measured
        by its task, else known by type) or ``arrived`` from a peer (known by type, else
        measured on its idle devices)."""
        if arrived:
            held = self.ledger.arrived(value, {d.index for d in self.owned} - self.leases.busy())
        else:
            held = self.ledger.held(key, value)
        if held:
            self.live[key] = held
            for d, n in held.items():
                self.total[d] = self.total.get(d, 0) + n

    def released(self, key: Any) -> None:
        for d, n in self.live.pop(key, {}).items():
            self.total[d] = self.total.get(d, 0) - n
            self.ledger.forget(d)  # its memory went back unmeasured


def stored(live: LiveResults, worker: Worker, key: Any, *, computed: bool) -> None:
    """``key`` entered ``worker``'s memory: ``computed`` here, or data from elsewhere (a
    peer's transfer, a replica, a scatter), measured on arrival."""
    if not computed:
        live.stored(key, internals.stored_value(worker, key), arrived=True)
        return
    ledger = live.ledger
    if ledger.measured(key):  # what it holds is known without its value
        live.stored(key, None)
        return
    value = internals.stored_value(worker, key)
    if not ledger.holds_nothing(value):
        live.stored(key, value)
