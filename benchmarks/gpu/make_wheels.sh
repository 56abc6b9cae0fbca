#!/usr/bin/env bash
# Build the wheel folder that validate.sh installs from on a GPU machine without network.
#
#   bash benchmarks/gpu/make_wheels.sh [DIR]     (default: benchmarks/gpu/wheels, git-ignored)
#
# The GPU machine's image runs Python 3.12 (x86-64, manylinux) and already holds numpy,
# nvidia-ml-py, cupy, pytest and most of dask's small dependencies, but not dask,
# distributed, tornado, partd, locket, zict, tblib or bokeh (and what bokeh needs beyond
# it: contourpy, narwhals, pillow, xyzservices) or typing_extensions. This folder carries
# those, a backup copy of every other dependency (pip only takes one when the image's
# version does not satisfy a requirement), and accelsched's own wheel. Versions are the
# ones installed here, so the GPU run uses what the test suite passed with on this
# machine (tests/test_gpu_wheels.py checks that nothing accelsched needs is left out).
# Another target: PYVER=3.13 (3.12 or later: below that dask also needs importlib_metadata).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
dest="${1:-$here/wheels}"
pyver="${PYVER:-3.12}"
# the Python whose dask the suite passed with: $PYTHON, else the checkout's .venv (the
# README's commands make it), else python3
py="${PYTHON:-}"
[[ -z $py && -x $root/.venv/bin/python ]] && py="$root/.venv/bin/python"
py="${py:-python3}"
mkdir -p "$dest"
dest="$(cd "$dest" && pwd)"

# Exact pins: what the project is tested with here.
required_dask="2026.8.0"

# name -> installed version here ("" when not installed: newest that fits then)
installed() {
    "$py" - "$1" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
try:
    print(version(sys.argv[1]))
except PackageNotFoundError:
    print("")
PY
}

for name in dask distributed; do
    have="$(installed "$name")"
    if [[ "$have" != "$required_dask" ]]; then
        echo "make_wheels: $name $required_dask expected in $py, found '${have:-none}'" \
            "(PYTHON=... names another)" >&2
        exit 1
    fi
done

# Missing on the GPU image: always needed (bokeh, accelsched's dashboard and report, with
# what it needs beyond the image).
missing=(dask distributed tornado partd locket zict tblib bokeh contourpy narwhals pillow
    xyzservices typing_extensions)
# Present on the GPU image (as last read): carried as a fallback only.
present=(click cloudpickle fsspec packaging pyyaml toolz jinja2 markupsafe msgpack psutil
    sortedcontainers)

platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
    manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$tag")
done

download() {  # name==version, or name when not installed here
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
        --implementation cp "${platforms[@]}" -d "$dest" "$1" 2>&1 |
        grep -v "is ignored: it is neither a file nor a directory"
    return "${PIPESTATUS[0]}"
}

case "$pyver" in
    3.[0-9] | 3.1[01]) echo "make_wheels: PYVER must be 3.12 or later" >&2; exit 2 ;;
esac
reqs=()
for name in "${missing[@]}" "${present[@]}"; do
    version="$(installed "$name")"
    spec="$name${version:+==$version}"
    echo "make_wheels: $spec (python $pyver)"
    if ! download "$spec"; then
        echo "make_wheels: no python $pyver wheel for $spec" >&2
        exit 1
    fi
done
reqs+=("dask==$required_dask" "distributed==$required_dask")

# accelsched itself, from this checkout (a pure-Python wheel).
version="$("$py" -c 'import tomllib,sys; print(tomllib.load(open(sys.argv[1],"rb"))["project"]["version"])' \
    "$root/pyproject.toml" 2>/dev/null || true)"
rm -f "$dest"/accelsched-*.whl
"$py" -m pip wheel -q --no-deps -w "$dest" "$root"
reqs+=("accelsched${version:+==$version}")

printf '%s\n' "${reqs[@]}" >"$dest/requirements.txt"
(cd "$dest" && ls -1 ./*.whl | sed 's|^\./||' >MANIFEST && sha256sum ./*.whl >SHA256SUMS)
du -sh "$dest"
echo "make_wheels: $(wc -l <"$dest/MANIFEST") wheels in $dest; install with:"
echo "  python3 -m pip install --no-index --find-links $dest -r $dest/requirements.txt"
