"""GPU steps marked in code (``dual``, ``@gpu``) reach placement wherever dask puts them:
fused dask.array tasks, DataFrame partitions under query planning, delayed calls,
``client.submit``; with fusion at dask's defaults and no ``dask.annotate``."""

from __future__ import annotations

import functools
import pickle
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator

import dask
import dask.array as da
import numpy as np
import pytest
from dask._task_spec import DataNode, Task, TaskRef
from distributed import Nanny
from distributed.utils_test import gen_cluster

import accelsched
from accelsched.policy.marks import Mark, find_mark
from accelsched.policy.timeouts import DUAL_TIMEOUT
from tests.utils import cvd, events, gpus, past_deadline, run_python, wait_for

# ---- the walk, with numbers ---------------------------------------------------------------


def host(x):  # type: ignore[no-untyped-def]
    return x


def on_device(x):  # type: ignore[no-untyped-def]
    return x


step = accelsched.dual(on_device, host)
#: A dual step's mark: one GPU, and a CPU form to fall back to after DUAL_TIMEOUT.
DUAL = Mark(count=1, cpu_form=DUAL_TIMEOUT)


@accelsched.gpu(count=2, fallback_timeout="5s")
def big(x):  # type: ignore[no-untyped-def]
    return x


@accelsched.gpu
def small(x):  # type: ignore[no-untyped-def]
    return x


def test_marks_found_where_dask_nests_them() -> None:
    assert find_mark(Task("k", host, 1)) is None
    assert find_mark(Task("k", step, 1)) == DUAL
    # a DataFrame partition: apply_and_enforce(..., _func=<step>)
    assert find_mark(Task("k", host, TaskRef("a"), _func=step)) == DUAL
    # a fused task: a subgraph of tasks in a dict argument
    fused = Task("k", host, {"inner": Task("i", big, 1), "other": Task("o", host, 2)})
    assert find_mark(fused) == Mark(count=2, timeout=5.0, timeout_given=True)
    # partials, compositions, lists
    assert find_mark(functools.partial(small, 1)) == Mark(count=1)
    assert find_mark(Task("k", host, [functools.partial(host, step)])) == DUAL
    # several steps: the largest count, the shortest own timeout
    both = Task("k", host, Task("a", step, 1), Task("b", big, 1))
    assert find_mark(both) == Mark(count=2, timeout=5.0, timeout_given=True)


@accelsched.gpu(count=2, fallback_timeout=None)
def strict(x):  # type: ignore[no-untyped-def]
    return x


def test_a_step_marked_strict_keeps_the_task_it_is_fused_into_strict() -> None:
    """Fused with a step that gives a timeout, a step marked ``fallback_timeout=None``
    (GPU-only: it must never run on the host) keeps the task strict, whichever comes
    first (before: the other's 1 s, and the strict step ran on the host after it)."""
    from accelsched.policy.timeouts import task_timeout

    quick = accelsched.dual(on_device, host, fallback_timeout="1s")
    for steps in ((quick, strict), (strict, quick), (big, strict, quick)):
        fused = Task("k", host, *(Task(f"s{i}", f, 1) for i, f in enumerate(steps)))
        mark = find_mark(fused)
        assert mark == Mark(count=2, timeout=None, timeout_given=True), steps
        assert task_timeout(30.0, {}, mark) is None
    # a fused dask.array chain, as dask builds it
    chain = da.ones(4, chunks=2).map_blocks(quick).map_blocks(strict)
    (chain,) = dask.optimize(chain)
    marks = [find_mark(t) for t in dict(chain.__dask_graph__()).values()]
    assert marks == [Mark(count=2, timeout=None, timeout_given=True)] * 2


def inc(x):  # type: ignore[no-untyped-def]
    return x + 1


def test_a_step_fused_into_a_long_chain_is_found() -> None:
    """A marked step followed by hundreds of operations dask.array fuses into one task:
    the fused subgraph's tasks are calls, all read (before: the first 64 items of it, and
    a step further from the chain's end ran as a CPU task, without a GPU or a word)."""
    for n in (63, 64, 200):
        chain = da.ones(4, chunks=2).map_blocks(step)
        for _ in range(n):
            chain = chain.map_blocks(inc)
        (chain,) = dask.optimize(chain)
        tasks = list(dict(chain.__dask_graph__()).values())
        assert len(tasks) == 2 and all(find_mark(t) == DUAL for t in tasks), n
    # a step deep in a fused subgraph's first task is not crowded out by the others
    # (before: a walk that read every task of a long subgraph first missed it)
    for op in (lambda x: (x + 1)[:, None][:, 0], lambda x: (x + 1).T):
        chain = da.ones((400, 400), chunks=(100, 400)).map_blocks(step)
        for _ in range(100):
            chain = op(chain)
        (chain,) = dask.optimize(chain)
        tasks = list(dict(chain.__dask_graph__()).values())
        assert sum(find_mark(t) == DUAL for t in tasks) == 4
    # nor one in a late task of a subgraph whose first tasks are wide (each reads twelve
    # others): a glance at each task past the first 64 takes its function's mark
    for at in (0, 70, 199):
        subgraph = {
            f"k{i}": Task(
                f"k{i}",
                step if i == at else host,
                *[TaskRef(f"k{j}") for j in range(max(0, i - 12), i)],
            )
            for i in range(200)
        }
        assert find_mark(Task("out", host, DataNode(None, subgraph))) == DUAL, at
    # data stays data: past 64 items of a list, the walk goes on only while it meets calls
    assert find_mark(Task("k", host, [0] * 64 + [step])) == DUAL
    assert find_mark(Task("k", host, [0] * 65 + [step])) is None
    assert find_mark(Task("k", host, [functools.partial(host, 0)] * 999 + [step])) is None


def test_the_walk_never_enters_data_and_is_bounded() -> None:
    class Trap:
        """An array-like whose attributes must not be walked."""

        __array__ = None

        @property
        def func(self):  # type: ignore[no-untyped-def]
            raise AssertionError("walked into data")

    assert find_mark(Task("k", host, DataNode(None, Trap()))) is None
    deep: object = step
    for _ in range(5000):
        deep = [deep]
    assert find_mark(deep) is None  # past MAX_VISITS: unmarked, and quickly
    assert find_mark(deep, max_visits=10_000) == DUAL


def test_gpu_decorator_validates_and_pickles() -> None:
    assert small(3) == 3 and small.__name__ == "small" and big.__doc__ is None
    again = pickle.loads(pickle.dumps(big))
    assert again(4) == 4 and find_mark(again) == Mark(count=2, timeout=5.0, timeout_given=True)
    with pytest.raises(ValueError, match=r"invalid count=0"):
        accelsched.gpu(count=0)
    with pytest.raises(ValueError, match=r"invalid count=nan"):
        accelsched.gpu(count=float("nan"))
    with pytest.raises(ValueError, match=r"fallback_timeout annotation='soon'"):
        accelsched.gpu(fallback_timeout="soon")
    with pytest.raises(TypeError, match="needs a callable"):
        accelsched.gpu(3)  # type: ignore[call-overload]

    async def coro(x: int) -> int:
        return x

    async def agen(x: int) -> AsyncIterator[int]:
        yield x

    class Awaited:
        async def __call__(self, x: int) -> int:
            return x

    # distributed runs a coroutine task on its event loop, never under a lease: marked, it
    # returned a coroutine nobody awaited (a serialization error at the task's end)
    with pytest.raises(TypeError, match=r"coroutine function \(coro is async def\)"):
        accelsched.gpu(coro)
    with pytest.raises(TypeError, match="cpu_fn cannot be a coroutine function"):
        accelsched.dual(host, coro)
    for odd in (agen, Awaited(), functools.partial(coro, 1)):  # async all the same
        with pytest.raises(TypeError, match=r"\((agen|Awaited|coro) is async def\)"):
            accelsched.gpu(odd)

    def gen(x: int) -> Iterator[int]:
        yield x

    class Yields:
        def __call__(self, x: int) -> Iterator[int]:
            yield x

    # a generator's body runs as it is iterated, after the step and its lease ended
    # (before: taken, and run on no device with numpy, without a word)
    for lazy in (gen, Yields(), functools.partial(gen, 1)):
        with pytest.raises(TypeError, match=r"generator function \((gen|Yields) yields\)"):
            accelsched.gpu(lazy)
    with pytest.raises(TypeError, match="cpu_fn cannot be a generator function"):
        accelsched.dual(host, gen)
    # a count no worker can have, or a declared memory on more than one device: every
    # task of the step would err (before: taken here, each task erred on the scheduler)
    with pytest.raises(ValueError, match=r"count=1000000: no worker can ever offer more"):
        accelsched.gpu(count=10**6)
    for count in (2, 0.5):
        with pytest.raises(ValueError, match=f"declares memory takes one device, not {count}"):
            accelsched.gpu(count=count, memory="1GiB")
    assert find_mark(accelsched.gpu(count=1.0, memory="1GiB")(host)) is not None
    with pytest.raises(TypeError, match="put @staticmethod above"):  # bound on instances
        accelsched.gpu(staticmethod(host))
    with pytest.raises(TypeError, match=r"dual\(\) needs a gpu_fn, got None"):
        accelsched.dual(None, host)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"dual\(\) needs a cpu_fn, got None"):
        accelsched.dual(host, None)  # type: ignore[arg-type]

    class Steps:
        @staticmethod
        @accelsched.gpu
        def scaled(x: int) -> int:
            return 2 * x

    assert Steps.scaled(2) == Steps().scaled(2) == 4 and find_mark(Steps().scaled)
    strict = accelsched.gpu(fallback_timeout=None)(host)
    assert find_mark(strict) == Mark(count=1, timeout=None, timeout_given=True)


# ---- on a cluster, with fusion and query planning at dask's defaults ---------------------


def where_gpu(block):  # type: ignore[no-untyped-def]
    """On a GPU: the block filled with the device index; on the host: -1."""
    return np.full_like(block, accelsched.current_device(), dtype="f8")


def where_host(block):  # type: ignore[no-untyped-def]
    return np.full_like(block, -1, dtype="f8")


where = accelsched.dual(where_gpu, where_host)


def device_now(*args):  # type: ignore[no-untyped-def]
    return accelsched.current_device()


def _tag_gpu(part):  # type: ignore[no-untyped-def]
    return part.assign(dev=float(accelsched.current_device()))


def _tag_host(part):  # type: ignore[no-untyped-def]
    return part.assign(dev=-1.0)


tag = accelsched.dual(_tag_gpu, _tag_host)


defaults = {"optimization.fuse.active": None, "dataframe.query-planning": None}


@pytest.mark.usefixtures("fake_gpus_2")
@gen_cluster(
    client=True,
    Worker=Nanny,
    nthreads=[("127.0.0.1", 1, cvd("0")), ("127.0.0.1", 1, cvd(""))],
    timeout=60,
)
async def test_marked_steps_are_placed_with_fusion_and_query_planning(c, s, gpu, cpu):
    await accelsched.register(c)
    await wait_for(lambda: gpus(s, gpu.worker_address) == 1)
    with dask.config.set(defaults):
        # dask.array, fused (default optimization): every block on the GPU
        x = da.ones((400, 10), chunks=(10, 10))
        y = (x.map_blocks(where) + 0).sum(axis=1)
        assert (await c.compute(y) == 0).all()
        # a DataFrame partition under query planning
        pd = pytest.importorskip("pandas")
        dd = pytest.importorskip("dask.dataframe")
        df = dd.from_pandas(pd.DataFrame({"a": np.arange(40.0)}), npartitions=4)
        out = df.map_partitions(tag, meta={"a": "f8", "dev": "f8"})
        assert set((await c.compute(out.dev)).tolist()) == {0.0}
        # delayed calls, submit and map of a @gpu step
        assert await c.compute(dask.delayed(accelsched.gpu(device_now))(1)) == 0
        assert await c.submit(accelsched.gpu(device_now), 1) == 0
        assert await c.gather(c.map(accelsched.gpu(device_now), range(3))) == [0, 0, 0]
    # nothing ran on the CPU worker, nothing fell back
    assert not events(s, "fallback")
    assert not events(s, "unrequested-gpu-use")


@pytest.mark.usefixtures("fake_gpus_2")
@gen_cluster(client=True, Worker=Nanny, nthreads=[("127.0.0.1", 1, cvd(""))], timeout=60)
async def test_marked_steps_fall_back_by_their_own_or_the_default_timeout(c, s, cpu):
    await accelsched.register(c, fallback_timeout="300ms")
    with dask.config.set(defaults):
        x = da.ones((40, 10), chunks=(10, 10))
        assert (await c.compute(x.map_blocks(where).sum(axis=1)) == -10).all()
        quick = accelsched.gpu(fallback_timeout=0)(device_now)
        assert await c.submit(quick, 1, key="quick") is None
        strict = accelsched.gpu(fallback_timeout=None)(device_now)
        waiting = c.submit(strict, 1, key="strict")
        await wait_for(lambda: "strict" in s.tasks and s.tasks["strict"].state == "no-worker")
        await past_deadline(s, "strict", 0.3)  # the default timeout's: still waiting
        assert s.tasks["strict"].state == "no-worker"
    reasons = {e["key"]: e["reason"] for e in events(s, "fallback")}
    assert reasons["quick"] == "no-gpu-capacity"
    assert "strict" not in reasons
    assert sum(1 for r in reasons.values() if r in ("timeout", "chain")) >= 4
    del waiting


class Model:
    @accelsched.gpu
    def predict(self, x):  # type: ignore[no-untyped-def]
        return (x, accelsched.current_device())

    @accelsched.gpu(count=2)
    def __call__(self, x):  # type: ignore[no-untyped-def]
        return x


class AttrDict(dict):
    """Attribute access raises KeyError: the walk must shrug, not fail the submission."""

    __getattr__ = dict.__getitem__

    def __reduce__(self) -> tuple:
        # pickle looks up ``__getstate__`` before Python 3.11: a KeyError there is no
        # "not found", so the instance travels as the dict it is
        return (AttrDict, (dict(self),))


def test_methods_and_callable_instances_stay_marked() -> None:
    m = Model()
    assert m.predict(3) == (3, None) and m(4) == 4  # bound, on the host
    assert find_mark(Task("k", m.predict, 1)) == Mark(count=1)
    assert find_mark(Task("k", m, 1)) == Mark(count=2)
    assert pickle.loads(pickle.dumps(m.predict))(5) == (5, None)


def test_the_task_function_is_found_before_long_arguments() -> None:
    assert find_mark(Task("k", step, list(range(5000)))) == DUAL
    assert find_mark(Task("k", host, list(range(5000)) + [step])) is None  # data, not calls
    assert find_mark(functools.partial(host, AttrDict(a=1))) is None
    assert find_mark(Task("k", step, AttrDict(a=1))) == DUAL


def test_a_type_seen_first_with_none_still_carries_marks_later() -> None:
    """The walk learns per type which attributes to read; a ``DataNode`` holding None
    seen first must not hide the marked step the next one holds. Run in a fresh
    interpreter: the per-type plans live for the process."""
    code = (
        "import accelsched\n"
        "from dask._task_spec import DataNode, Task\n"
        "from accelsched.policy.marks import find_mark\n"
        "def f(x):\n    return x\n"
        "step = accelsched.dual(f, f)\n"
        "assert find_mark(DataNode('a', None)) is None\n"
        "print(find_mark(Task('k', f, DataNode('b', step))))\n"
    )
    out = run_python(code, timeout=120)
    assert out == repr(DUAL), out


@pytest.mark.usefixtures("fake_gpus_2")
@gen_cluster(client=True, Worker=Nanny, nthreads=[("127.0.0.1", 1, cvd("0"))], timeout=60)
async def test_an_odd_neighbour_costs_no_task_its_mark(c, s, gpu):
    await accelsched.register(c)
    await wait_for(lambda: gpus(s, gpu.worker_address) == 1)
    odd = c.submit(functools.partial(host, AttrDict(a=1)), key="odd")
    marked = c.submit(accelsched.gpu(device_now), 1, key="marked")
    long = c.submit(accelsched.gpu(device_now), list(range(3000)), key="long")
    assert await marked == 0 and await long == 0 and await odd == {"a": 1}


# ---- how steps travel: from a script's __main__ to processes that cannot import it -------

#: A client script: its steps live in ``__main__`` (recursive, reading a global, a lambda,
#: a method, a closure, a partial, a dual); it pickles them as distributed's client does.
CLIENT = """
import functools, sys
import cloudpickle
import accelsched

SCALE = int(sys.argv[2])

@accelsched.gpu
def normalise(x):
    return x * SCALE

@accelsched.gpu(fallback_timeout="1s")
def fact(n):
    return 1 if n <= 1 else n * fact(n - 1)

class Model:
    @accelsched.gpu(count=2)
    def predict(self, x):
        return x + 100

def make(k):
    @accelsched.gpu
    def inner(x):
        return x - k
    return inner

steps = [
    normalise, fact, Model().predict, make(7), accelsched.gpu(lambda y: -y),
    functools.partial(normalise, 5), accelsched.dual(lambda x: ("gpu", x), lambda x: ("cpu", x)),
]
with open(sys.argv[1], "wb") as f:
    f.write(cloudpickle.dumps(steps))
"""

#: Another process (a scheduler, a worker): it has accelsched, not the client's script.
SERVER = """
import pickle, sys
import cloudpickle
from accelsched.policy.marks import find_mark
with open(sys.argv[1], "rb") as f:
    steps = pickle.loads(f.read())
marks = [find_mark(s) for s in steps]
results = [s(1) for s in steps[:4]] + [steps[4](3), steps[5](), steps[6](2)]
# passed on, as the scheduler sends each task to a worker
again = pickle.loads(cloudpickle.dumps(steps))
print(repr((results, [m.count for m in marks], marks[1].timeout, again[0](2), again[1](4))))
"""


def test_steps_from_a_scripts_main_travel_by_value_and_keep_their_mark(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "client.py").write_text(CLIENT)
    blob = tmp_path / "steps.pkl"
    subprocess.run([sys.executable, "client.py", str(blob), "3"], cwd=tmp_path, check=True)
    server = tmp_path / "server"
    server.mkdir()  # the client's folder is not on its path
    results, counts, timeout, again_a, again_b = eval(run_python(SERVER, str(blob), cwd=server))
    assert results == [3, 1, 101, -6, -3, 15, ("cpu", 2)]  # no lease here: the CPU form
    assert counts == [1, 1, 2, 1, 1, 1, 1] and timeout == 1.0
    assert (again_a, again_b) == (6, 24)


def test_a_step_shipped_again_carries_the_globals_of_its_time(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A notebook that changes a global and submits again: the new value travels."""
    (tmp_path / "client.py").write_text(CLIENT)
    server = tmp_path / "server"
    server.mkdir()
    for scale in ("2", "5"):
        blob = tmp_path / f"steps{scale}.pkl"
        subprocess.run([sys.executable, "client.py", str(blob), scale], cwd=tmp_path, check=True)
        results, *_ = eval(run_python(SERVER, str(blob), cwd=server))
        assert results[0] == int(scale)


LIBRARY = """
import accelsched

@accelsched.gpu(count=2)
def libstep(x):
    return x + 1

def on_gpu(x):
    return ("gpu", x)

def on_cpu(x):
    return ("cpu", x)

both = accelsched.dual(on_gpu, on_cpu)
"""

WITHOUT_LIBRARY = """
import pickle, sys
import cloudpickle
from accelsched.policy.marks import find_mark
with open(sys.argv[1], "rb") as f:
    step, both = pickle.loads(f.read())
errors = []
for s in (step, both):
    try:
        s(1)
    except RuntimeError as exc:
        errors.append(str(exc))
with open(sys.argv[2], "wb") as f:
    f.write(cloudpickle.dumps([step, both]))
print(repr((find_mark(step).count, find_mark(both).count, errors)))
"""


def test_a_step_this_process_cannot_import_keeps_its_mark_and_errs_alone(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A scheduler without the client's library places the task; a worker that has the
    library runs it; one that lacks it too fails that task, naming the step."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "mylib.py").write_text(LIBRARY)
    with_lib = {**__import__("os").environ, "PYTHONPATH": str(lib)}
    first, second = tmp_path / "a.pkl", tmp_path / "b.pkl"
    run_python(
        "import sys, cloudpickle, mylib\n"
        "open(sys.argv[1], 'wb').write(cloudpickle.dumps([mylib.libstep, mylib.both]))",
        str(first),
        cwd=tmp_path,
        env=with_lib,
    )
    counts_and_errors = eval(run_python(WITHOUT_LIBRARY, str(first), str(second), cwd=tmp_path))
    step_count, dual_count, errors = counts_and_errors
    assert (step_count, dual_count) == (2, 1)
    assert len(errors) == 2
    assert "step 'mylib.libstep' could not be loaded" in errors[0]
    assert "No module named 'mylib'" in errors[0]
    assert "step dual(on_gpu, on_cpu) could not be loaded" in errors[1]
    out = run_python(
        "import pickle, sys\n"
        "step, both = pickle.loads(open(sys.argv[1], 'rb').read())\n"
        "print(repr((step(1), both(1), type(step).__name__)))",
        str(second),
        cwd=tmp_path,
        env=with_lib,
    )
    assert eval(out) == (2, ("cpu", 1), "GPUStep")
