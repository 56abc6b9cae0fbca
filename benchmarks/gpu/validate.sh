#!/usr/bin/env bash
# Real-GPU validation in one call: install, GPU tests, GPU benchmark; all inside ~5 minutes.
#
#   bash benchmarks/gpu/validate.sh [--wheels DIR] [--out DIR] [--budget SECONDS]
#                                   [--device | --dry-run] [--keep-venv]
#                                   [-k PYTEST_EXPR] [--no-tests] [--no-bench]
#
# On a GPU machine (nvidia-smi lists a GPU, or --device): installs dask, distributed and
# accelsched from the carried wheel folder (no network) into that machine's python3, runs
# `pytest -m gpu` and `python -m benchmarks gpu`. Elsewhere (or --dry-run): the same
# steps in a throwaway virtual environment seeded with what the GPU image already has,
# nothing installed into this machine's Python; the GPU tests skip and the benchmark
# runs with --fake (its figures are labelled as not GPU figures).
#
# Everything goes to --out (default: $OUT when set, else benchmarks/gpu/out):
#   env.txt      machine, driver, versions, the install log
#   pytest.log   pytest output;  junit.xml  its junit report (with recorded figures)
#   bench.log    benchmark output;  gpu.json, gpu.txt  its figures (and provenance)
#   summary.txt  one line per step (exit code, seconds), the test counts, the table
# Each step runs under `timeout`, sized so that one stuck step cannot eat the budget.
# Exit code: 0 when every step passed (GPU tests skipped on a dry run count as passed).
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
wheels="$here/wheels"
out="${OUT:-$here/out}"
budget=290
mode=auto
keep_venv=0
select=""
run_tests=1
run_bench=1
while (($#)); do
    case "$1" in
        --wheels) wheels="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        --budget) budget="$2"; shift 2 ;;
        --device) mode=device; shift ;;
        --dry-run) mode=dry; shift ;;
        --keep-venv) keep_venv=1; shift ;;
        -k) select="$2"; shift 2 ;;
        --no-tests) run_tests=0; shift ;;
        --no-bench) run_bench=0; shift ;;
        -h | --help) sed -n '2,23p' "$0"; exit 0 ;;
        *) echo "validate.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
mkdir -p "$out"
out="$(cd "$out" && pwd)"
for f in env.txt pytest.log junit.xml bench.log gpu.json gpu.txt summary.txt; do
    rm -f "${out:?}/$f"
done
wheels="$(cd "$wheels" 2>/dev/null && pwd || echo "$wheels")"
cd "$root" || exit 2
export PYTHONUNBUFFERED=1
export PYTHONDONTWRITEBYTECODE=1
export CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-/tmp/accelsched-cupy-cache}"
export ACCELSCHED_CACHE_DIR="${ACCELSCHED_CACHE_DIR:-/tmp/accelsched-validate-cache}"

start=$SECONDS
summary="$out/summary.txt"
: >"$summary"
status=0
note() { echo "validate: $*" | tee -a "$summary"; }
left() { echo $((budget - (SECONDS - start))); }
# cap WANT seconds by what is left, keeping RESERVE seconds for later steps
cap() {
    local want=$1 reserve=${2:-0} have
    have=$(($(left) - reserve))
    ((have < want)) && want=$have
    ((want < 10)) && want=10
    echo "$want"
}
step() {  # step NAME RC SECONDS
    local name=$1 rc=$2 secs=$3 verdict=ok
    case "$rc" in
        0) ;;
        124 | 137) verdict="TIMED OUT"; status=1 ;;
        *) verdict="FAILED"; status=1 ;;
    esac
    note "$(printf '%-8s rc=%-3s %4ss  %s' "$name" "$rc" "$secs" "$verdict")"
}

# --- where are we -------------------------------------------------------------------
gpu_listed=0
if command -v nvidia-smi >/dev/null && timeout 30 nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    gpu_listed=1
fi
if [[ $mode == auto ]]; then
    if ((gpu_listed)); then mode=device; else mode=dry; fi
fi
{
    echo "# accelsched GPU validation, $(date -u +%FT%TZ), mode=$mode"
    echo "uname: $(uname -a)"
    echo "cpus: $(nproc 2>/dev/null)  memory: $(free -g 2>/dev/null | awk '/^Mem:/{print $2 " GiB"}')"
    echo "checkout: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "wheels: $wheels"
    ls -1 "$wheels" 2>/dev/null | sed 's/^/  /'
    if ((gpu_listed)); then
        timeout 30 nvidia-smi 2>&1
        timeout 30 nvidia-smi --query-gpu=index,uuid,name,memory.total,driver_version,compute_mode \
            --format=csv 2>&1
    else
        echo "nvidia-smi: no GPU listed"
    fi
} >"$out/env.txt" 2>&1

# --- python: the machine's own on a GPU machine, a throwaway venv elsewhere -------------
venv=""
cleanup() {
    if [[ -n $venv && $keep_venv == 0 ]]; then rm -rf "$(dirname "$venv")"; fi
}
trap cleanup EXIT
t0=$SECONDS
if [[ $mode == device ]]; then
    py="${PYTHON:-python3}"
    note "device mode: installing into $(command -v "$py")"
else
    base="${DRY_RUN_PYTHON:-}"
    if [[ -z $base ]]; then
        # the GPU image runs Python 3.12: dry-run on it when this machine has it
        candidates=(python3.12)
        if command -v pyenv >/dev/null; then
            for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.|$)'); do
                candidates+=("$(pyenv root)/versions/$v/bin/python3")
            done
        fi
        for candidate in "${candidates[@]}" python3; do
            if command -v "$candidate" >/dev/null && "$candidate" -c 'import venv' 2>/dev/null; then
                base=$candidate
                break
            fi
        done
    fi
    venv="$(mktemp -d /tmp/accelsched-validate-XXXXXX)/venv"
    note "dry-run mode: throwaway venv $venv ($("$base" --version 2>&1))"
    "$base" -m venv "$venv" >>"$out/env.txt" 2>&1 || { note "venv creation failed"; exit 2; }
    py="$venv/bin/python"
    # What the GPU image already holds (KINDS.md), so the carried wheels are tested as
    # they will be used there: only what is missing comes from the wheel folder.
    timeout "$(cap 150 60)" "$py" -m pip install -q --disable-pip-version-check \
        numpy pytest pytest-timeout nvidia-ml-py click cloudpickle fsspec packaging pyyaml \
        toolz jinja2 msgpack psutil sortedcontainers >>"$out/env.txt" 2>&1
    rc=$?
    step seed $rc $((SECONDS - t0))
    ((rc)) && exit 1
fi

# --- install from the carried wheels (no network) -----------------------------------
t0=$SECONDS
{
    echo "# install: $py -m pip install --no-index --find-links $wheels -r $wheels/requirements.txt"
    "$py" --version
    "$py" -m pip --version
} >>"$out/env.txt" 2>&1
if [[ ! -f $wheels/requirements.txt ]]; then
    note "no wheel folder at $wheels (run benchmarks/gpu/make_wheels.sh and carry it)"
    rc=2
else
    timeout -k 5 "$(cap 90 150)" "$py" -m pip install --no-index --find-links "$wheels" \
        --no-cache-dir --no-compile --disable-pip-version-check -r "$wheels/requirements.txt" \
        >>"$out/env.txt" 2>&1
    rc=$?
    if ((rc)) && [[ $mode == device ]]; then
        # the image's environment refused: put only what it lacks beside it instead
        site=/tmp/accelsched-site
        echo "# install failed (rc=$rc); retrying with --target $site" >>"$out/env.txt"
        timeout -k 5 "$(cap 60 150)" "$py" -m pip install --no-index --no-deps --no-cache-dir \
            --no-compile --disable-pip-version-check --upgrade --target "$site" \
            "$wheels"/dask-*.whl "$wheels"/distributed-*.whl "$wheels"/tornado-*.whl \
            "$wheels"/partd-*.whl "$wheels"/locket-*.whl "$wheels"/zict-*.whl \
            "$wheels"/tblib-*.whl "$wheels"/accelsched-*.whl >>"$out/env.txt" 2>&1
        rc=$?
        export PYTHONPATH="$PYTHONPATH:$site"
    fi
fi
"$py" - >>"$out/env.txt" 2>&1 <<'PY'
from importlib.metadata import version, PackageNotFoundError
for name in ("dask", "distributed", "accelsched", "nvidia-ml-py", "cupy-cuda13x", "numpy",
             "tornado", "cloudpickle", "msgpack", "pytest", "pytest-timeout", "torch"):
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        print(f"{name}: not installed")
import accelsched, dask, distributed
print("accelsched imported from", accelsched.__file__)
PY
((rc == 0)) && { "$py" -c 'import dask, distributed, accelsched' 2>>"$out/env.txt" || rc=3; }
step install $rc $((SECONDS - t0))
if ((rc)); then
    note "install failed: see env.txt; not running tests or benchmark"
    exit 1
fi
# The checkout's accelsched wins over the installed wheel (the same code unless edited
# since make_wheels.sh): tests, benchmark and the workers they spawn import this tree.
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"

junit_counts() {  # tests/passed/failed/errors/skipped from a junit XML report
    "$py" - "$1" <<'PY'
import sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except Exception as exc:
    print(f"no junit report ({exc.__class__.__name__})")
    sys.exit()
suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
print(f"tests={n['tests']} passed={n['tests'] - n['failures'] - n['errors'] - n['skipped']} "
      f"failed={n['failures']} errors={n['errors']} skipped={n['skipped']}")
PY
}

# --- GPU tests ----------------------------------------------------------------------
if ((run_tests)); then
    t0=$SECONDS
    # the project's addopts spread the suite over pytest-xdist, which the GPU image lacks:
    # these few tests run in one process
    pytest_args=(-o addopts=-ra -m gpu -q -p no:cacheprovider -o timeout=100
        --junitxml="$out/junit.xml")
    [[ -n $select ]] && pytest_args+=(-k "$select")
    bench_reserve=75
    ((run_bench)) || bench_reserve=5
    # (the GPU tests' own module: the others import the test extras, hypothesis and
    # dask-jobqueue, which the image lacks too)
    timeout -k 10 "$(cap 150 $bench_reserve)" "$py" -m pytest "${pytest_args[@]}" \
        tests/as_users/test_gpu.py \
        >"$out/pytest.log" 2>&1
    rc=$?
    tail -n 25 "$out/pytest.log"
    counts="$(junit_counts "$out/junit.xml")"
    if ((rc == 5)); then
        note "pytest collected no gpu test (exit 5)"
        [[ $mode == device ]] || rc=0
    elif ((rc == 0)) && [[ $mode == device ]] && [[ $counts == *" passed=0 "* ]]; then
        note "every gpu test skipped on a GPU machine: the skip check is wrong"
        rc=6
    fi
    step pytest $rc $((SECONDS - t0))
    note "gpu tests: $counts"
fi

# --- benchmark ----------------------------------------------------------------------
if ((run_bench)); then
    t0=$SECONDS
    bench_args=(gpu --out "$out")
    [[ $mode == device ]] || bench_args+=(--fake)
    timeout -k 10 "$(cap 120 5)" "$py" -m benchmarks "${bench_args[@]}" \
        >"$out/bench.log" 2>&1
    rc=$?
    step bench $rc $((SECONDS - t0))
fi

note "total ${SECONDS}s of a ${budget}s budget; files in $out"
if [[ -f $out/gpu.txt ]]; then
    cat "$out/gpu.txt" >>"$summary"
    echo
    cat "$out/gpu.txt"
elif [[ -f $out/bench.log ]]; then
    tail -n 20 "$out/bench.log"
fi
exit $status
