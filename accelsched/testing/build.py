"""Build the fake ``libnvidia-ml.so.1`` from ``fakenvml.c``, once per source version.

pynvml loads NVML with a plain ``CDLL("libnvidia-ml.so.1")``, so the only way to show it
GPUs on a CPU-only machine is a shared library of that name on the library path. Shipping
a binary would tie the wheel to one platform; the C file is tiny, so it is compiled on
first use into a cache directory keyed by a hash of the source (and the machine type),
so a changed source never reuses a stale library. Several processes may build at once
(pytest-xdist, parallel CI jobs): each compiles to a private file and renames it into
place, and a rename is atomic, so a reader only ever sees a whole library.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["SONAME", "SOURCE", "cache_root", "library_dir", "library_path"]

logger = logging.getLogger(__name__)

SONAME = "libnvidia-ml.so.1"
SOURCE = Path(__file__).with_name("fakenvml.c")


def cache_root() -> Path:
    """``$ACCELSCHED_CACHE_DIR``, else ``~/.cache/accelsched``."""
    value = os.environ.get("ACCELSCHED_CACHE_DIR")
    return Path(value) if value else Path.home() / ".cache" / "accelsched"


def library_path() -> Path:
    """Where the library for the current source lives (whether built yet or not)."""
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + platform.machine().encode()).hexdigest()[:16]
    return cache_root() / f"fakenvml-{digest}" / SONAME


def _compiler() -> list[str] | None:
    """``$CC`` if set (and only it: a CI that names its compiler means it), else cc or gcc."""
    value = os.environ.get("CC")
    if value:
        return shlex.split(value)
    for name in ("cc", "gcc"):
        found = shutil.which(name)
        if found:
            return [found]
    return None


def library_dir() -> Path | None:
    """The directory holding the fake ``libnvidia-ml.so.1``, built if needed.

    None when it cannot be built (no working C compiler, unwritable cache); the reason
    is logged on one line.
    """
    target = library_path()
    if target.is_file():
        return target.parent
    compiler = _compiler()
    if compiler is None:
        logger.warning("fake NVML not built: no C compiler found (set $CC, or install cc/gcc)")
        return None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
        os.close(fd)
    except OSError as e:
        logger.warning("fake NVML not built: cannot write to %s (%s)", target.parent, e)
        return None
    command = [*compiler, "-shared", "-fPIC", "-O2", f"-Wl,-soname,{SONAME}"]
    command += ["-o", tmp, str(SOURCE)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            error = (result.stderr or result.stdout).strip().splitlines()
            logger.warning(
                "fake NVML not built: %s failed: %s",
                shlex.join(compiler),
                error[-1] if error else f"exit code {result.returncode}",
            )
            return None
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("fake NVML not built: cannot run %s (%s)", shlex.join(compiler), e)
        return None
    finally:
        Path(tmp).unlink(missing_ok=True)
    return target.parent
