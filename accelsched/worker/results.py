"""Results entering a worker's memory, as the leak check counts them (worker event loop).

Every task's result passes here, so the common cases cost a few comparisons: a result
its GPU task measured is held at its measurement without a look at its value, and an
unmeasured number or string (what most tiny tasks return) holds nothing on a device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from accelsched import internals
from accelsched.worker.leak_check import LeakCheck

if TYPE_CHECKING:
    from distributed import Worker

__all__ = ["stored"]


def stored(leaks: LeakCheck, worker: Worker, key: Any, *, computed: bool) -> None:
    """``key`` entered ``worker``'s memory: ``computed`` here, or data from elsewhere (a
    peer's transfer, a replica, a scatter), measured on arrival."""
    if not computed:
        leaks.stored(key, internals.stored_value(worker, key), arrived=True)
        return
    ledger = leaks.ledger
    if ledger.measured(key):  # what it holds is known without its value
        leaks.stored(key, None)
        return
    value = internals.stored_value(worker, key)
    if not ledger.holds_nothing(value):
        leaks.stored(key, value)
