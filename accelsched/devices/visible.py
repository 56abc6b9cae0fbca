"""``CUDA_VISIBLE_DEVICES``: which physical devices a process may use, and in what order.

NVML ignores ``CUDA_VISIBLE_DEVICES`` and numbers devices physically; CUDA numbers the
visible ones from 0 in the order listed. Everything in accelsched that talks to CUDA
(leases, ``current_device()``) uses CUDA indices; everything that talks to NVML uses
NVML indices; this module is the one place that maps between them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence

__all__ = ["parse_visible", "resolve_visible", "visible_from_env"]

logger = logging.getLogger(__name__)


def parse_visible(value: str | None) -> list[str] | None:
    """Split a ``CUDA_VISIBLE_DEVICES`` value into entries.

    ``None`` (unset) means every device; the empty string means none.
    """
    if value is None:
        return None
    return [part.strip() for part in value.split(",") if part.strip()]


def visible_from_env(env: Mapping[str, str] | None = None) -> list[str] | None:
    return parse_visible((os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES"))


def resolve_visible(entries: Sequence[str] | None, uuids: Sequence[str]) -> list[int]:
    """Map visible-device entries to NVML indices, in CUDA order.

    Entries are indices, ``GPU-`` UUIDs or unique UUID prefixes (as CUDA accepts), or
    ``MIG-`` UUIDs, which are matched to their parent device when NVML lists them.
    Like CUDA, the list ends at the first entry that names no device, or names one twice.
    """
    if entries is None:
        return list(range(len(uuids)))
    out: list[int] = []
    for entry in entries:
        index = _match(entry, uuids)
        if index is None or index in out:
            logger.warning(
                "CUDA_VISIBLE_DEVICES entry %r names no device (or repeats one); "
                "CUDA ignores it and every entry after it",
                entry,
            )
            break
        out.append(index)
    return out


def _match(entry: str, uuids: Sequence[str]) -> int | None:
    if entry.isdigit():
        i = int(entry)
        return i if i < len(uuids) else None
    if entry.startswith("MIG-"):
        # MIG instances are not enumerated by this inventory; a MIG UUID is reported
        # only when NVML lists the instance's UUID itself.
        hits = [i for i, u in enumerate(uuids) if u == entry]
        return hits[0] if hits else None
    needle = entry if entry.startswith("GPU-") else "GPU-" + entry
    hits = [i for i, u in enumerate(uuids) if u.startswith(needle)]
    return hits[0] if len(hits) == 1 else None
