"""The layout the code promises (docs/architecture.md), checked on the source itself."""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest
from distributed import Scheduler
from distributed.utils_test import gen_cluster

import accelsched
from accelsched import internals
from tests.utils import ROOT

PACKAGE = ROOT / "accelsched"
SOURCES = sorted(p for p in PACKAGE.rglob("*.py"))


def _folder(name: str) -> set[str]:
    return {
        "accelsched." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts)
        for p in (PACKAGE / name).glob("*.py")
    } - {f"accelsched.{name}.__init__"} | {f"accelsched.{name}"}


# The rules follow the folders: a new file is under them by where it is put.
SCHEDULER_SIDE = _folder("scheduler")
WORKER_SIDE = _folder("worker")
#: Decisions only: no distributed, nothing of either side. Everything in policy/, and the
#: vocabulary both sides share (messages, events).
PURE = _folder("policy") | {
    "accelsched.protocol",
    "accelsched.events",
}
#: distributed modules the package may import outside internals/: the documented API.
PUBLIC_DISTRIBUTED = {
    "distributed",
    "distributed.diagnostics.plugin",
    "distributed.scheduler",  # WorkerState, for type hints
    "distributed.core",  # Status
    "distributed.metrics",  # time
    "distributed.comm.addressing",
}

#: Private attributes and undocumented behaviour of distributed (and dask) that only
#: accelsched/internals/ may touch: names flagged on whatever object they are reached.
PRIVATE = [
    r"_ongoing_background_tasks",
    r"\bscheduler_info\(",  # its "workers" may be the client's periodic, empty refresh
    r"scheduler\.identity\b",
    r"stream_comms",
    r"(?<!internals)\.unrunnable\b",
    r"[\"']unrunnable[\"']",
    r"bulk_schedule_unrunnable",
    r"\.handlers\b",
    r"periodic_callbacks",
    r"_task_spec",
    r"\brun_spec\b",
    r"used_resources",
    r"(?<!fallback)\.transitions?\(",
    r"handle_worker_status_change",
    r"(?<!client)\.(restart|retire)_workers\b",
    r"\.executors\b",
    r"state\.tasks",
    r"total_resources",
    r"worker_plugins",
    r"NVML_STATE",
    r"_correct_state",
    r"_startup_lock",
    r"\.has_what\b",
    r"\.who_has\b",
    r"\.processing\b",
    r"\.data\.fast\b",
    r"(?<!internals)\.resources\s*\[[^]]*\]\s*=",
    r"\b(scheduler|s)\.resources\b",
    r"\b(scheduler|s)\.running\b",
    r"(loose|worker|host)_restrictions",
    r"\.(resource_restrictions|annotations)\s*(\[[^]]*\]\s*)?=(?!=)",
    r"\.(resource_restrictions|annotations|resources)\.(pop|update|setdefault|clear)\(",
    r"(?<!distributed)\.metrics\b",
    r"http_application",
    r"dashboard\.(scheduler|core)\b",
    r"state\.(executing|long_running)\b",
    r"multiprocessing-method",
    r"forkserver_preload|get_mp_context",
    r"move_task_request|\.extensions\b",
]
#: Names whose private parts are not distributed's: our own objects (a simulated buffer,
#: pool), a ctypes library handle, pynvml's error table.
OWN_PRIVATE_OK = {"self", "cls", "buf", "_POOL", "lib"}
OWN_PRIVATE_CHAINS = {"pynvml.NVMLError"}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def code_lines(path: Path) -> list[tuple[int, str]]:
    """Source lines without comments and docstrings (they may name what they explain)."""
    text = path.read_text()
    tree = ast.parse(text)
    docs: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docs |= set(range(body[0].lineno, (body[0].end_lineno or body[0].lineno) + 1))
    lines = text.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            lines[row - 1] = lines[row - 1][:col]
    return [(n, line) for n, line in enumerate(lines, 1) if n not in docs and line.strip()]


def private_attributes(path: Path) -> list[str]:
    """``x._name`` where ``x`` is not one of our own objects (dunders aside)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and not (isinstance(node.value, ast.Name) and node.value.id in OWN_PRIVATE_OK)
            and ast.unparse(node.value) not in OWN_PRIVATE_CHAINS
        ):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
    return found


def test_private_distributed_use_only_in_the_door() -> None:
    pattern = re.compile("|".join(PRIVATE))
    found = [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
        for p in SOURCES
        if "internals" not in p.relative_to(PACKAGE).parts
        for n, line in code_lines(p)
        if pattern.search(line)
    ]
    assert not found, "private distributed use outside accelsched/internals/:\n" + "\n".join(found)


def test_no_private_attribute_outside_the_door() -> None:
    found = [
        hit
        for p in SOURCES
        if "internals" not in p.relative_to(PACKAGE).parts
        for hit in private_attributes(p)
    ]
    assert not found, "private attributes outside accelsched/internals/:\n" + "\n".join(found)


def test_the_grep_would_catch_a_private_use() -> None:
    """The check above is not vacuous: the door itself matches it."""
    pattern = re.compile("|".join(PRIVATE))
    hits = [
        line
        for p in (PACKAGE / "internals").glob("*.py")
        for _, line in code_lines(p)
        if pattern.search(line)
    ]
    assert len(hits) >= 20


@pytest.mark.parametrize(
    "side, other", [(SCHEDULER_SIDE, WORKER_SIDE), (WORKER_SIDE, SCHEDULER_SIDE)]
)
def test_sides_speak_only_through_the_protocol(side: set[str], other: set[str]) -> None:
    assert side and other
    for path in SOURCES:
        name = module_name(path)
        if name not in side:
            continue
        crossing = {m for m in imports(path) if m in other or m.rsplit(".", 1)[0] in other}
        assert not crossing, f"{name} imports {crossing} from the other side"


def test_decision_modules_import_no_distributed() -> None:
    for path in SOURCES:
        name = module_name(path)
        if name not in PURE:
            continue
        bad = {
            m
            for m in imports(path)
            if m.split(".")[0] in ("distributed", "tornado")
            or m.startswith("dask._task_spec")
            or m in SCHEDULER_SIDE | WORKER_SIDE
        }
        assert not bad, f"{name} is a decision module but imports {bad}"


def test_decision_modules_load_no_distributed() -> None:
    """Importing a decision module loads neither distributed nor a side: ``accelsched``'s
    own ``__init__`` imports the plugins on first use only."""
    assert len(PURE) >= 10
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in sorted(PURE))
        + "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('distributed', 'tornado')"
        " or m.startswith(('accelsched.scheduler', 'accelsched.worker', 'accelsched.testing')))\n"
        "print(bad)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]", out.stdout


def _distributed_imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return [(n, m) for n, m in found if m.split(".")[0] in ("distributed", "dask")]


def test_only_public_distributed_modules_outside_the_door() -> None:
    """Found by the AST, wherever the import stands (inside functions too): a dashboard
    component, a private module of dask or distributed, or a module distributed does not
    document is imported in ``accelsched/internals/`` only."""
    found = [
        f"{p.relative_to(ROOT)}:{n}: {m}"
        for p in SOURCES
        if "internals" not in p.relative_to(PACKAGE).parts
        for n, m in _distributed_imports(p)
        if (m.startswith("distributed") and m not in PUBLIC_DISTRIBUTED)
        or any(part.startswith("_") for part in m.split("."))
    ]
    assert not found, "distributed internals imported outside accelsched/internals/:\n" + (
        "\n".join(found)
    )


def test_the_import_check_would_catch_a_dashboard_import() -> None:
    """The check above is not vacuous: the door's own imports fail it."""
    door = [
        m
        for p in (PACKAGE / "internals").glob("*.py")
        for _, m in _distributed_imports(p)
        if m.startswith("distributed") and m not in PUBLIC_DISTRIBUTED
    ]
    assert "distributed.dashboard.components.scheduler" in door


def test_no_two_files_share_a_name() -> None:
    """One name, one file: searches, tracebacks and editor tabs are never ambiguous."""
    seen: dict[str, list[str]] = {}
    for p in SOURCES:
        if p.name not in ("__init__.py", "__main__.py"):
            seen.setdefault(p.stem, []).append(str(p.relative_to(ROOT)))
    twice = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not twice, twice


#: What only a test or the demo uses: the simulated devices.
TEST_ONLY = ("testing", "demo")


def test_production_code_imports_no_test_double() -> None:
    """Nothing outside ``accelsched/testing`` and the demo imports the simulated devices;
    the simulated NVML is passed in (dask config ``accelsched.nvml-backend``). The command
    line reaches ``accelsched simulate`` (a testing tool) inside its dispatch only."""
    found = []
    for p in SOURCES:
        rel = p.relative_to(PACKAGE)
        if rel.parts[0] in TEST_ONLY:
            continue
        tree = ast.parse(p.read_text())
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if not any(n.startswith("accelsched.testing") for n in names):
                continue
            if rel.parts[0] == "cli" and id(node) not in top:
                continue
            found.append(f"{rel}:{node.lineno}")
    assert not found, found
    text = (PACKAGE / "accelsched.yaml").read_text()
    assert "accelsched.testing" not in text


def test_pins_match_the_tested_range() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    oldest, newest = internals.TESTED_DISTRIBUTED
    major, minor, _ = newest.split(".")
    for pkg in ("distributed", "dask[array]"):
        (pin,) = [d for d in project["dependencies"] if d.startswith(pkg + ">")]
        assert pin == f"{pkg}>={oldest},<{major}.{int(minor) + 1}", pin
    ci = (ROOT / ".ci" / "oldest.txt").read_text().split()
    assert sorted(ci) == [f"dask=={oldest}", f"distributed=={oldest}"]


# --- the contract check on a real cluster -------------------------------------------------
# A distributed that changed cannot be installed beside this one: each test alters one
# internal of a real scheduler or worker for the length of a registration, and puts it back.


@gen_cluster(client=True, nthreads=[])
async def test_changed_scheduler_internals_fail_registration(c, s: Scheduler) -> None:
    saved = s.unrunnable
    s.unrunnable = set()  # type: ignore[assignment]  # what distributed had before 2024
    try:
        with pytest.raises(internals.IncompatibleDistributed) as info:
            await c.register_plugin(accelsched.PlacementPlugin())
    finally:
        s.unrunnable = saved
    message = str(info.value)
    assert "Scheduler.unrunnable" in message
    assert internals.TESTED_DISTRIBUTED[0] in message and internals.TESTED_DISTRIBUTED[1] in message
    assert "accelsched-placement" not in s.plugins
    await c.register_plugin(accelsched.PlacementPlugin())  # intact again: registers
    assert "accelsched-placement" in s.plugins


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_changed_worker_internals_fail_registration(c, s, a) -> None:
    saved = a.executors
    a.executors = None  # type: ignore[assignment]
    try:
        with pytest.raises(internals.IncompatibleDistributed, match=r"Worker\.executors"):
            await c.register_plugin(accelsched.GuardPlugin())
    finally:
        a.executors = saved
    stream, written = a.batched_stream, a.batched_stream.byte_count
    del stream.byte_count  # what the guard reads to know its events are written
    try:
        with pytest.raises(
            internals.IncompatibleDistributed, match=r"Worker\.batched_stream\.byte_count"
        ):
            await c.register_plugin(accelsched.GuardPlugin())
    finally:
        stream.byte_count = written


def test_the_installed_package_carries_the_license() -> None:
    """What pip installed (from the wheel it built, as the README's commands do) lists
    the project's LICENSE among its files, word for word."""
    from importlib.metadata import distribution

    dist = distribution("accelsched")
    licenses = [f for f in dist.files or () if f.name == "LICENSE"]
    assert licenses, [str(f) for f in dist.files or ()]
    assert licenses[0].read_text() == (ROOT / "LICENSE").read_text()
    assert dist.metadata["License"] == "BSD-3-Clause" or "BSD-3-Clause" in str(
        dist.metadata.get_all("License-Expression")
    )


def test_every_test_the_reliability_table_names_exists() -> None:
    """docs/reliability.md gives a test per row: each one it names must exist."""
    text = (ROOT / "docs" / "reliability.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    body = [r for r in rows if not r.startswith(("| Input", "| Fault"))]
    assert len(body) >= 25
    missing = []
    for row in body:
        cited = re.findall(r"`(?:(test_\w+)\.py)?::(test_\w+)(?:\[[^]]*\])?`", row)
        assert cited, f"a row without a test: {row}"
        module = None
        for mod, name in cited:
            module = mod or module
            assert module, row
            (path,) = (ROOT / "tests").rglob(f"{module}.py")  # one file of that name
            source = path.read_text()
            if not re.search(rf"^(async )?def {name}\(", source, re.M):
                missing.append(f"{module}.py::{name}")
    assert not missing, missing


def test_the_parts_diagram_names_every_part_and_only_parts_that_exist() -> None:
    """docs/architecture.md's diagram of the parts is the map a newcomer reads: every
    module of the scheduler side, the worker side and the decisions is on it, and every
    file on it exists."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    diagram = text.split("## The parts", 1)[1].split("```")[1]
    named = set(re.findall(r"\b(\w+\.py)\b", diagram))
    for folder in ("scheduler", "worker", "policy"):
        modules = {p.name for p in (ROOT / "accelsched" / folder).glob("*.py")} - {"__init__.py"}
        assert modules <= named, (folder, sorted(modules - named))
    existing = {p.name for p in (ROOT / "accelsched").rglob("*.py")}
    assert named <= existing, sorted(named - existing)
