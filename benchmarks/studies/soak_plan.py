"""What the soak runs on and what strikes it: the simulated devices, the ``dask worker``
commands, and the faults, drawn up front from a seed (:func:`plan`) so that a run can be
repeated and its plan printed; :mod:`benchmarks.studies.soak_cluster` carries them out."""

from __future__ import annotations

import random
from dataclasses import dataclass

GIB = 2**30
#: The simulated devices, by NVML index: name, memory, compute capability.
DEVICES = (
    ("NVIDIA H100 80GB HBM3", 80 * GIB, "9.0"),
    ("NVIDIA A100-SXM4-40GB", 40 * GIB, "8.0"),
    ("NVIDIA A100-SXM4-40GB", 40 * GIB, "8.0"),
    ("NVIDIA L4", 24 * GIB, "8.9"),
    ("Tesla T4", 16 * GIB, "7.5"),
    ("Tesla T4", 16 * GIB, "7.5"),
)


@dataclass(frozen=True)
class Spec:
    """One ``dask worker`` command: its name, the devices it sees, its threads."""

    name: str
    devices: str
    nthreads: int
    late: bool = False


WORKERS = (
    Spec("h100", "0", 4),
    Spec("a100x2", "1,2", 4),
    Spec("l4", "3", 2),
    Spec("t4x2", "4,5", 2, late=True),
    Spec("cpu", "", 2),
)
#: Fault kinds drawn for the plan, and how often each is drawn against the others.
KINDS = {"kill": 3, "leave-join": 2, "nvml": 3, "restart-workers": 1}


@dataclass(frozen=True)
class Fault:
    at: float  # seconds after the load started
    kind: str
    target: str  # a worker's name, or a device index for "nvml"
    seconds: float  # how long a device fails, or a left worker stays away
    calls: str = "all"  # for "nvml": which NVML calls fail

    def __str__(self) -> str:
        extra = f" {self.calls} for {self.seconds:.1f} s" if self.kind == "nvml" else ""
        if self.kind == "leave-join":
            extra = f" away {self.seconds:.1f} s"
        return f"{self.at:7.1f} s  {self.kind:<15} {self.target}{extra}"


def plan(seed: int, duration: float, count: int) -> list[Fault]:
    """``count`` faults at random times within the load (the late join among them)."""
    rng = random.Random(seed)
    late = [s.name for s in WORKERS if s.late]
    faults = [Fault(rng.uniform(0.1, 0.4) * duration, "late-join", n, 0) for n in late]
    names = [s.name for s in WORKERS]
    more = max(0, count - len(faults) - len(KINDS))  # every kind at least once
    for kind in [*KINDS, *rng.choices(list(KINDS), weights=list(KINDS.values()), k=more)]:
        at = rng.uniform(0.03, 0.92) * duration
        if kind == "nvml":
            device = str(rng.randrange(len(DEVICES)))
            calls = rng.choice(("all", "all", "lost", "memory"))
            faults.append(Fault(at, kind, device, rng.uniform(2, 8), calls))
        else:
            faults.append(Fault(at, kind, rng.choice(names), rng.uniform(1, 5)))
    return sorted(faults, key=lambda f: f.at)
