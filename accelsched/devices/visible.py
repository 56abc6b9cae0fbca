"""``CUDA_VISIBLE_DEVICES``: which physical devices a process may use, and in what order.

NVML ignores ``CUDA_VISIBLE_DEVICES`` and numbers devices physically; CUDA numbers the
visible ones from 0 in the order listed. Everything in accelsched that talks to CUDA
(leases, ``current_device()``) uses CUDA indices; everything that talks to NVML uses
NVML indices; this module is the one place that maps between them.

MIG: NVML lists a MIG device (``MIG-<uuid>``) under its parent GPU, not in the device
count. CUDA runs work on MIG devices, never on a GPU in MIG mode as a whole, and a CUDA
process enumerates **one MIG device at most** ("only enumeration of a single MIG
instance is supported", NVIDIA's MIG user guide, for CUDA 11/R450 and CUDA 12/R525;
``CUDA_VISIBLE_DEVICES=MIG-a,MIG-b`` gives ``cudaGetDeviceCount() == 1``). So
:func:`resolve_devices` keeps the first MIG device it meets and leaves out later ones,
with a warning; GPUs not in MIG mode listed around it stay visible.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Visible", "resolve_devices", "visible_from_env"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Visible:
    """One CUDA device: the GPU with NVML index ``nvml_index``, or its MIG device
    ``mig_uuid``."""

    nvml_index: int
    mig_uuid: str | None = None


def visible_from_env(env: Mapping[str, str] | None = None) -> list[str] | None:
    """The entries of ``CUDA_VISIBLE_DEVICES``: None (unset) means every device, the
    empty string none."""
    value = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    return None if value is None else [part.strip() for part in value.split(",") if part.strip()]


def resolve_devices(
    entries: Sequence[str] | None,
    uuids: Sequence[str],
    migs: Mapping[int, Sequence[str]] | None = None,
) -> list[Visible]:
    """The CUDA devices of a process, in CUDA order.

    ``uuids``: the GPUs' UUIDs by NVML index; ``migs``: for each GPU in MIG mode (its
    NVML index), the UUIDs of its MIG devices by their index under it (none: no MIG).
    Entries are indices, ``GPU-`` UUIDs or unique prefixes, ``MIG-`` UUIDs or unique
    prefixes. A GPU in MIG mode named as a whole (or every device, when ``entries`` is
    None) stands for its first MIG device, as CUDA enumerates it. Only the first MIG
    device met is kept (see the module docstring); a MIG-mode GPU with no MIG device
    adds nothing. Like CUDA, the list ends at the first entry that names no device, or
    names one twice.
    """
    migs = migs or {}
    names: Sequence[str] = [str(i) for i in range(len(uuids))] if entries is None else entries
    out: list[Visible] = []
    seen: set[tuple[int, str | None]] = set()
    mig_taken = False
    for entry in names:
        found = _match(entry, uuids, migs)
        if found is None or (found.nvml_index, found.mig_uuid) in seen:
            logger.warning(
                "CUDA_VISIBLE_DEVICES entry %r names no device (or repeats one); "
                "CUDA ignores it and every entry after it",
                entry,
            )
            break
        seen.add((found.nvml_index, found.mig_uuid))
        if found.nvml_index in migs and found.mig_uuid is None:
            continue  # a GPU in MIG mode without MIG devices: nothing CUDA can use
        if found.mig_uuid is not None:
            if mig_taken:
                logger.warning(
                    "CUDA_VISIBLE_DEVICES entry %r is a second MIG device; a CUDA process "
                    "enumerates one MIG device only, so it is left out",
                    entry,
                )
                continue
            mig_taken = True
        out.append(found)
    return out


def _match(entry: str, uuids: Sequence[str], migs: Mapping[int, Sequence[str]]) -> Visible | None:
    if entry.isascii() and entry.isdigit():  # CUDA reads ASCII digits only ("²", "３": none)
        i = int(entry)
        return _whole(i, migs) if i < len(uuids) else None
    if entry.startswith("MIG-"):
        hits = [
            Visible(parent, uuid)
            for parent, under in migs.items()
            for uuid in under
            if uuid.startswith(entry)
        ]
        exact = [v for v in hits if v.mig_uuid == entry]
        return exact[0] if exact else hits[0] if len(hits) == 1 else None
    needle = entry if entry.startswith("GPU-") else "GPU-" + entry
    gpus = [i for i, u in enumerate(uuids) if u.startswith(needle)]
    return _whole(gpus[0], migs) if len(gpus) == 1 else None


def _whole(index: int, migs: Mapping[int, Sequence[str]]) -> Visible:
    """GPU ``index`` named as a whole: itself, or its first MIG device in MIG mode."""
    under = migs.get(index)
    if under:
        return Visible(index, under[0])
    return Visible(index)
