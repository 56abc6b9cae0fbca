"""What the scheduler holds about each worker's GPUs: the record every other part reads.

Workers register before their plugins run, so what a worker declares counts for nothing
until its guard has verified its devices. Per worker address this keeps the devices
granted (one owner per GPU UUID, :func:`~accelsched.policy.ownership.grant`: the owners
are these grants, kept nowhere else),
the UUIDs it was refused, the ``GPU`` count it registered with (put back on unregister),
the count its guard offers now, and its quarantine. From these follow the counts
placement may use (:meth:`Grants.placed`).

Nothing here talks to distributed: the parts that act on the scheduler
(:mod:`accelsched.scheduler.device_reports`,
:mod:`accelsched.scheduler.scheduler_actor`) change it through the methods below, and readers
(the status snapshot) get a :class:`WorkerGrant`, never the dicts.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

from accelsched.policy.ownership import grant
from accelsched.policy.requirements import mebibytes, share
from accelsched.protocol import DeviceRecord

__all__ = ["Grants", "WorkerGrant"]


class WorkerGrant(NamedTuple):
    """One worker's GPUs as the scheduler holds them, to read (the records are the
    grant's own: a reader copies what it keeps)."""

    devices: tuple[DeviceRecord, ...]  # granted, in the order its guard reported them
    declared: float | None  # the GPU count it registered with; None: declared none
    quarantined: str | None  # why its GPUs are out of placement; None: they are not


class Grants:
    """Grants, ownership, declarations, offers and quarantine, per worker address."""

    def __init__(self, *, share_gpus: bool) -> None:
        self.share_gpus = share_gpus  # more than one worker may drive a GPU UUID
        self._granted: dict[str, list[DeviceRecord]] = {}  # worker -> devices granted
        self._refused: dict[str, set[str]] = {}  # worker -> UUIDs it was refused
        self._declared: dict[str, float] = {}  # worker -> GPU count it registered with
        self._offered: dict[str, int] = {}  # worker -> granted GPUs its guard offers now
        self._offered_uuids: dict[str, set[str]] = {}  # worker -> which, when it said
        self._held: dict[str, dict[str, int]] = {}  # worker -> UUID -> bytes results hold
        self._quarantined: dict[str, str] = {}  # worker -> reason

    # --- reading -----------------------------------------------------------------------

    def of(self, worker: str) -> WorkerGrant:
        return WorkerGrant(
            tuple(self._granted.get(worker, ())),
            self._declared.get(worker),
            self._quarantined.get(worker),
        )

    def granted_devices(self) -> dict[str, list[DeviceRecord]]:
        """Every worker's granted devices, as its guard reported them (read-only use)."""
        return self._granted

    def reported(self, worker: str) -> bool:
        """Whether ``worker``'s guard has reported (its grant may be empty)."""
        return worker in self._granted

    def owners(self) -> dict[str, str]:
        """Who owns each granted GPU UUID (shared: the first worker granted it)."""
        owners: dict[str, str] = {}
        for worker, devices in self._granted.items():
            for d in devices:
                owners.setdefault(d["uuid"], worker)
        return owners

    def uuids(self, worker: str) -> list[str]:
        """The UUIDs granted to ``worker``, in its guard's order (the inventory reply)."""
        return [d["uuid"] for d in self._granted.get(worker, ())]

    def placed(self, worker: str) -> int:
        """The GPU count placement uses: what the guard offers, within the grant (0 while
        quarantined)."""
        if worker in self._quarantined:
            return 0
        return min(self._offered.get(worker, 0), len(self._granted.get(worker, ())))

    def gauge(self) -> tuple[int, int]:
        """(GPUs placement may use, GPUs of quarantined workers): the metrics gauge."""
        granted = {w: len(d) for w, d in self._granted.items()}
        quarantined = sum(granted.get(w, 0) for w in self._quarantined)
        return sum(granted.values()) - quarantined, quarantined

    # --- declarations --------------------------------------------------------------------

    def declare(self, worker: str, count: float) -> None:
        """``worker`` registered declaring ``count`` GPUs (the first word stands)."""
        self._declared.setdefault(worker, count)

    def correct_declaration(self, worker: str, count: float) -> None:
        """The worker's own word on what it was started with: a plugin registered after
        an earlier one found the count that one had corrected."""
        if worker in self._declared:
            self._declared[worker] = count

    def take_declarations(self) -> dict[str, float]:
        """Every declaration, forgotten here: the counts to put back on unregister."""
        declared, self._declared = self._declared, {}
        return declared

    # --- grants ----------------------------------------------------------------------------

    def claim(
        self, worker: str, wanted: list[DeviceRecord]
    ) -> tuple[list[DeviceRecord], dict[str, str]] | None:
        """Grant ``worker`` the devices of ``wanted`` nobody else owns; returns them and
        the refused UUIDs with their owners (None: a repeated report, nothing changed)."""
        previous = self._granted.pop(worker, None)  # stands in nobody's way
        if (
            previous is not None
            and not self._refused.get(worker)
            and [d["uuid"] for d in previous] == [d["uuid"] for d in wanted]
        ):
            self._granted[worker] = previous
            return None
        uuids, refused = grant([d["uuid"] for d in wanted], self.owners(), share=self.share_gpus)
        granted = [d for d in wanted if d["uuid"] in uuids]
        self._granted[worker] = granted
        self._refused[worker] = set(refused)
        return granted, refused

    def offer(
        self,
        worker: str,
        count: int,
        uuids: list[str] | None = None,
        held: dict[str, int] | None = None,
    ) -> None:
        """``worker``'s guard offers ``count`` of its granted GPUs now: those of ``uuids``
        (None: it did not say which); ``held``: bytes its results hold on each."""
        self._offered[worker] = count
        self._held[worker] = dict(held or {})
        if uuids is None:
            self._offered_uuids.pop(worker, None)
        else:
            self._offered_uuids[worker] = set(uuids)

    def offered_devices(self, worker: str) -> list[DeviceRecord]:
        """The granted devices ``worker`` offers now, in its guard's order: those it named,
        else the first ones (as many as it offers)."""
        granted = self._granted.get(worker, [])
        named = self._offered_uuids.get(worker)
        if named is None:
            return granted[: self._offered.get(worker, 0)]
        return [d for d in granted if d["uuid"] in named]

    def sharers(self, worker: str) -> set[str]:
        """The other workers granted one of ``worker``'s devices (``share_gpus``; without
        it a device has one owner, and nothing is looked through)."""
        if not self.share_gpus:
            return set()
        mine = set(self.uuids(worker))
        return {w for w, ds in self._granted.items() if w != worker and mine & set(self.uuids(w))}

    def shares(self, worker: str, count: int) -> tuple[dict[str, int], int]:
        """The bytes ``worker``'s declared tasks may take on each of its first ``count``
        offered devices (each device's capacity divided among the workers granted it),
        and the ``GPU-memory`` (MiB) to place against: those less what results hold."""
        held = self._held.get(worker, {})
        # workers granted each device: one without share_gpus (no look over the cluster)
        owners: Counter[str] = Counter()
        if self.share_gpus:
            owners.update(d["uuid"] for ds in self._granted.values() for d in ds)
        mine = {
            d["uuid"]: share(int(d["memory"]), owners[d["uuid"]] or 1)
            for d in self.offered_devices(worker)[:count]
        }
        room = sum(mebibytes(max(0, b - held.get(u, 0))) for u, b in mine.items())
        return mine, room

    def quarantine(self, worker: str, reason: str) -> bool:
        """Note ``worker``'s quarantine; False when it was quarantined already."""
        if worker in self._quarantined:
            return False
        self._quarantined[worker] = reason
        return True

    def remove(self, worker: str) -> list[str]:
        """Forget ``worker`` (it left) and free its GPUs; returns the other workers that
        were refused one of them, which may claim it now."""
        freed = {d["uuid"] for d in self._granted.pop(worker, ())}
        self._refused.pop(worker, None)
        self._declared.pop(worker, None)
        self._offered.pop(worker, None)
        self._offered_uuids.pop(worker, None)
        self._held.pop(worker, None)
        self._quarantined.pop(worker, None)
        return [other for other, uuids in self._refused.items() if uuids & freed]
