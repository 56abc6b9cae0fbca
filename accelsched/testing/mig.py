"""MIG partitions for :func:`accelsched.testing.fake_gpus`: the ``mig=`` argument.

A MIG partition is written as NVIDIA names MIG devices: ``"<g>g.<m>gb"``, ``g`` compute
slices (1, 2, 3, 4 or 7 of the GPU's 7) and ``m`` GiB of memory of its own, such as
``"3g.40gb"`` or ``"1g.10gb"`` (a ``"+me"`` suffix, media extensions, is accepted and
kept in the name). Each becomes one MIG device: a GPU instance with one compute
instance, named ``"<GPU name> MIG <profile>"`` like the real ones.

``mig`` takes one of:

* ``None``: no GPU in MIG mode (the default);
* a list of profiles, ``["3g.40gb", "3g.40gb"]``: every GPU in MIG mode with those;
* one entry per GPU, each a list of profiles or None (that GPU not in MIG mode):
  ``[["4g.40gb", "3g.40gb"], None]``. An empty list is MIG mode with no MIG device.

Checked as a GPU would: at most 7 MIG devices, 7 compute slices and the GPU's memory.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from accelsched.testing import state

__all__ = ["SLICES", "check_mig", "profile_bytes", "mig_devices"]

#: Compute slices of a MIG-capable GPU (A100, H100, H200).
SLICES = 7
_PROFILE = re.compile(r"^([12347])g\.([1-9][0-9]{0,3})gb(\+me)?$")


def profile_bytes(profile: object) -> tuple[int, int]:
    """(compute slices, memory bytes) of a profile such as ``"3g.40gb"``."""
    if not isinstance(profile, str):
        raise TypeError(
            f"fake_gpus: a MIG profile must be a string like '3g.40gb', got {profile!r}"
        )
    found = _PROFILE.match(profile)
    if found is None:
        raise ValueError(
            f"fake_gpus: not a MIG profile: {profile!r}; expected '<g>g.<m>gb' with g one "
            "of 1, 2, 3, 4, 7 compute slices and m GiB, such as '3g.40gb' or '1g.10gb'"
        )
    return int(found.group(1)), int(found.group(2)) * 2**30


def check_mig(mig: Any, count: int, totals: Sequence[int]) -> list[list[str] | None]:
    """The partition of each GPU (None: not in MIG mode), checked against the GPU."""
    if mig is None:
        return [None] * count
    if isinstance(mig, str) or not isinstance(mig, Sequence):
        raise TypeError(
            "fake_gpus: mig must be None, a list of MIG profiles for every GPU "
            f"(['3g.40gb', '3g.40gb']) or one list (or None) per GPU, got {mig!r}"
        )
    if all(isinstance(p, str) for p in mig):
        per_gpu: list[Any] = [list(mig)] * count
    elif len(mig) != count:
        raise ValueError(
            f"fake_gpus: mig given per GPU must have {count} entries (one per GPU), got {mig!r}"
        )
    else:
        per_gpu = list(mig)
    out: list[list[str] | None] = []
    for i, (profiles, total) in enumerate(zip(per_gpu, totals, strict=True)):
        if profiles is None:
            out.append(None)
            continue
        if isinstance(profiles, str) or not isinstance(profiles, Sequence):
            raise TypeError(
                f"fake_gpus: mig for GPU {i} must be a list of MIG profiles or None, "
                f"got {profiles!r}"
            )
        sizes = [profile_bytes(p) for p in profiles]
        if len(sizes) > state.MAX_MIG_PER_GPU or sum(g for g, _ in sizes) > SLICES:
            raise ValueError(
                f"fake_gpus: MIG devices {list(profiles)!r} do not fit GPU {i}: at most "
                f"{state.MAX_MIG_PER_GPU} devices and {SLICES} compute slices"
            )
        if sum(m for _, m in sizes) > total:
            raise ValueError(
                f"fake_gpus: MIG devices {list(profiles)!r} need more memory than GPU {i} "
                f"has ({total} bytes)"
            )
        out.append(list(profiles))
    if (n := sum(len(p) for p in out if p)) > state.MAX_MIGS:
        raise ValueError(
            f"fake_gpus: {n} MIG devices in all; the simulated library holds at most "
            f"{state.MAX_MIGS} (as a machine of 8 GPUs of 7 holds 56)"
        )
    return out


def mig_devices(
    partitions: Sequence[list[str] | None], names: Sequence[str]
) -> list[state.FakeMig]:
    """The MIG devices of checked partitions, with new UUIDs; GPU instance ids from 1."""
    out: list[state.FakeMig] = []
    for parent, (profiles, gpu_name) in enumerate(zip(partitions, names, strict=True)):
        for k, profile in enumerate(profiles or ()):
            name = f"{gpu_name} MIG {profile}"
            if len(name.encode()) > 95:
                raise ValueError(
                    f"fake_gpus: the MIG device name {name!r} is over NVML's 95 bytes; "
                    "use a shorter GPU name"
                )
            total = profile_bytes(profile)[1]
            out.append(state.FakeMig(state.new_uuid("MIG"), name, total, parent, k + 1))
    return out
