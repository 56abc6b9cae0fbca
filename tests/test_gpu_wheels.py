"""The real-GPU run installs accelsched without network, from the wheels
``benchmarks/gpu/make_wheels.sh`` carries onto an image that holds some distributions
already (``benchmarks/gpu/validate.sh``'s dry run seeds a venv with those). Everything
accelsched needs there, and what that needs in turn, must be on the image or carried: a
dependency added to ``pyproject.toml`` without its wheel fails the GPU run at its install
step (as bokeh and typing_extensions once did), and nothing else here would say so."""

from __future__ import annotations

import importlib.metadata as md
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
GPU = ROOT / "benchmarks" / "gpu"
#: The GPU image's Python, as markers see it.
IMAGE_PYTHON = {"python_version": "3.12", "python_full_version": "3.12.0"}


def shell_array(script: str, name: str) -> list[str]:
    """The words of the bash array ``name=( ... )``."""
    found = re.search(rf"^{name}=\((.*?)\)", script, re.S | re.M)
    assert found, f"no {name}=(...) in make_wheels.sh"
    return found.group(1).split()


def on_the_image() -> set[str]:
    """What validate.sh's dry run seeds its venv with: what the GPU image holds."""
    script = (GPU / "validate.sh").read_text()
    found = re.search(r"pip install -q --disable-pip-version-check \\\n(.*?)>>", script, re.S)
    assert found, "validate.sh: the seeding pip install was not found"
    return {canonicalize_name(w) for w in found.group(1).replace("\\", " ").split()}


def needed_there() -> set[str]:
    """accelsched's dependencies and theirs, all the way down, as pip resolves them on
    the image's Python (read from the distributions installed here)."""
    tomllib = pytest.importorskip("tomllib")  # (Python 3.11 on)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    todo = [Requirement(spec) for spec in project["dependencies"]]
    needed: set[str] = set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in needed:
            continue
        needed.add(name)
        for spec in md.requires(req.name) or []:
            sub = Requirement(spec)
            extras = req.extras | {""}
            if sub.marker is None or any(
                sub.marker.evaluate({**IMAGE_PYTHON, "extra": e}) for e in extras
            ):
                todo.append(sub)
    return needed


def test_every_distribution_accelsched_needs_reaches_the_gpu_image() -> None:
    script = (GPU / "make_wheels.sh").read_text()
    carried = {canonicalize_name(n) for n in shell_array(script, "missing")}
    carried |= {canonicalize_name(n) for n in shell_array(script, "present")}
    needed = needed_there()
    assert {"dask", "distributed", "bokeh", "nvidia-ml-py"} <= needed  # the walk works
    absent = sorted(needed - carried - on_the_image())
    assert not absent, f"neither on the GPU image nor carried by make_wheels.sh: {absent}"


def test_the_gpu_tests_run_without_the_suites_test_extras() -> None:
    """The image has no pytest-xdist, hypothesis or dask-jobqueue: validate.sh drops the
    project's addopts (xdist's options) and collects the GPU tests' module alone."""
    script = (GPU / "validate.sh").read_text()
    assert "-o addopts=-ra" in script
    assert re.search(
        r'"\$py" -m pytest "\$\{pytest_args\[@\]\}" \\\n\s+tests/as_users/test_gpu.py', script
    )
