"""Every ```python and ```pycon block of README.md and docs/*.md runs here, one test each
(test id ``file:line``), so an example that no longer works fails by name.

How a block runs is set by an HTML comment on the line before it (docs/testing.md,
"The examples in these docs"):

- no comment: a complete program. It runs as a script in its own folder, in a fresh
  Python process (``__name__ == "__main__"``; spawned workers re-import it), and must
  exit 0.
- ``<!-- example: session -->``: a snippet of a session. It runs in a client process of
  its own (``python session.py``, in its ``__main__`` as a user's script), in the names
  of the ``<!-- example: preamble -->`` block of docs/testing.md plus ``client`` (a
  Client of one shared cluster started as users start one: a ``dask scheduler``
  process, two ``dask worker`` processes ``gpu-0`` and ``gpu-1`` each under
  ``accelsched simulate --gpus 1`` (16 GiB), and one without a GPU, whose address is
  ``cpu_worker``; accelsched registered). A block that calls ``accelsched.register``
  itself finds none registered, as on a cluster a user starts, and the session's own
  registration is restored after it. ``pycon`` blocks run as doctests in the same
  names. ``<!-- example: session only=NAME,... -->``: the block sees only those names
  (as a reader who pastes it has only them: the README's first snippet, given a
  scheduler address); a name it uses and does not define fails it.
- ``<!-- example: event -->``: one or more event dicts. Each must be a literal with a
  known ``action`` that ``accelsched.events.describe`` puts into words (no raw dict).
- ``<!-- example: file=NAME -->``: a file of a test suite (``conftest.py``), compiled here
  and written next to the page's ``pytest`` block.
- ``<!-- example: pytest file=NAME -->``: a test module. It is written as NAME, with the
  page's ``file=`` blocks, into a folder where ``python -m pytest`` must pass.
- ``<!-- example: preamble -->``: the session names (run by every session block).

Nothing is skipped: a block with any other comment fails.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.utils import ROOT

FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w+-]*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*example:\s*(?P<spec>.*?)\s*-->\s*$")
BASE_ENV = dict(os.environ)  # before any fake-GPU session of this module changes it


@dataclass(frozen=True)
class Block:
    """One example: where it is, how it runs (``kind``, options) and its code."""

    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    kind: str
    options: dict[str, str]
    code: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def doc_files() -> list[Path]:
    """README.md and every page under docs/: new pages are picked up as they appear."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def parse(path: Path) -> Iterator[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m["lang"]:
            i += 1
            continue
        indent, lang, start = m["indent"], m["lang"], i
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1
        lang = {"py": "python", "python3": "python"}.get(lang, lang)  # none escapes the test
        if lang not in ("python", "pycon"):
            continue
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(prev)
        spec = marker["spec"].split() if marker else ["script"]
        kind, options = spec[0], dict(t.split("=", 1) for t in spec[1:] if "=" in t)
        if kind.startswith("file="):
            kind, options["file"] = "file", kind.split("=", 1)[1]
        yield Block(path, start + 1, lang, kind, options, "\n".join(body) + "\n")


BLOCKS = [b for p in doc_files() for b in parse(p)]


def preamble() -> Block:
    (block,) = [b for b in BLOCKS if b.kind == "preamble"]
    return block


# --- the shared session ---------------------------------------------------------------


class Session:
    """A client process (``python session.py``, as a user's script) holding the
    preamble's names and ``client``, on a cluster of ``dask`` command processes. It runs
    each block sent on its stdin in its ``__main__`` and answers one JSON line."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc

    def run(self, block: Block, keep: bool = False) -> None:
        """Run ``block`` there; ``keep``: its names stay (the setup, the preamble)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        only = block.options["only"].split(",") if "only" in block.options else None
        request = {
            "code": block.code,
            "id": block.id,
            "lang": block.lang,
            "keep": keep,
            "only": only,
        }
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()  # pytest-timeout bounds a block that hangs
        assert line, f"{block.id}: the session process ended (exit {self.proc.wait()})"
        answer = json.loads(line)
        assert answer["ok"], f"{block.id}:\n{answer['output'][-6000:]}"


#: The session process: the names every block gets, then blocks from stdin, each run in
#: ``__main__`` (what it defines or changes is undone after it, and the clients it made
#: are closed, unless it is the preamble).
SESSION = r"""
import contextlib
import doctest
import io
import json
import sys
import time
import traceback

from distributed import Client

import accelsched

ADDRESS = sys.argv[1]
client = Client(ADDRESS, timeout=30)
accelsched.register(client)
client.wait_for_workers(3, timeout=60)
deadline = time.monotonic() + 60
while sum(m["action"] == "gpu-verified" for _, m in client.get_events("accelsched")) < 2:
    assert time.monotonic() < deadline, "the simulated GPUs were not verified"
    time.sleep(0.05)
cpu_worker = next(
    a for a, w in client.scheduler_info(n_workers=-1)["workers"].items() if w["name"] == "cpu"
)
scheduler_address = ADDRESS


def verified():
    return sum(m["action"] == "gpu-verified" for _, m in client.get_events("accelsched"))


def unregister():
    for unregister_plugin, name in (
        (client.unregister_worker_plugin, "accelsched-guard"),
        (client.unregister_scheduler_plugin, "accelsched-placement"),
    ):
        with contextlib.suppress(ValueError):
            unregister_plugin(name)


def register_defaults():
    # the session's registration, after a block that registered its own options
    from accelsched.internals.servers import running_plugins

    running = client.run_on_scheduler(running_plugins)
    if {side: getattr(p, "options", None) for side, p in running.items()} == {
        "placement": accelsched.PlacementPlugin().options,
        "guard": accelsched.GuardPlugin().options,
    }:
        return
    unregister()
    before = verified()
    accelsched.register(client)
    deadline = time.monotonic() + 60
    while verified() < before + 2:
        assert time.monotonic() < deadline, "the simulated GPUs were not verified again"
        time.sleep(0.05)


def run_block(code, block_id, lang, keep, only):
    names = globals()
    saved = dict(names)
    client_type = Client  # (a block with ``only`` does not see the name)
    # a block that registers accelsched itself finds none registered, as on the cluster
    # a user starts (register() refuses options that differ from plugins running)
    own = "accelsched.register(" in code and not keep
    if own and "unregister_" not in code:  # (a block that unregisters first shows how)
        unregister()
    if only is not None:  # the block sees only these names, as the reader who pastes it
        for key in list(names):
            if not key.startswith("__") and key not in only:
                del names[key]
    try:
        if lang == "pycon":
            test = doctest.DocTestParser().get_doctest(code, dict(names), block_id, block_id, 0)
            runner = doctest.DocTestRunner(
                optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
            )
            out = io.StringIO()
            runner.run(test, out=out.write)
            assert runner.failures == 0, out.getvalue()
        else:
            exec(compile(code, block_id, "exec"), names)
    finally:
        if not keep:
            for key, value in list(names.items()):
                if isinstance(value, client_type) and saved.get(key) is not value:
                    value.close()
                if key not in saved:
                    del names[key]
            names.update(saved)
        if own:
            register_defaults()


answers = sys.stdout
for line in sys.stdin:
    request = json.loads(line)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            run_block(
                request["code"], request["id"], request["lang"], request["keep"], request["only"]
            )
        ok = True
    except BaseException:
        ok = False
        out.write(traceback.format_exc())
    answers.write(json.dumps({"ok": ok, "output": out.getvalue()}) + "\n")
    answers.flush()
"""


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    """The cluster as users start it: a ``dask scheduler`` process, two ``dask worker``
    processes each under ``accelsched simulate --gpus 1`` and one without a GPU, all
    declaring ``GPU=1``; the blocks run in a client process of their own that registers
    accelsched. No process can import the tests, nor the client's folder."""
    from tests import processes
    from tests.processes import running

    tmp = tmp_path_factory.mktemp("session")
    paths = [str(ROOT)]
    simulate = [str(Path(sys.executable).with_name("accelsched")), "simulate", "--gpus", "1"]
    sched = processes.scheduler(tmp, paths=paths, cwd=tmp)
    with running(sched):
        address = processes.scheduler_address(tmp / "scheduler.json", sched)
        workers = [
            processes.worker(
                tmp,
                name,
                address,
                "--nthreads",
                "2",
                "--resources",
                "GPU=1",
                before=simulate if name != "cpu" else (),
                env={} if name != "cpu" else {"CUDA_VISIBLE_DEVICES": ""},
                paths=paths,
                cwd=tmp,
            )  # fmt: skip
            for name in ("gpu-0", "gpu-1", "cpu")
        ]
        client_dir = tmp / "client"
        client_dir.mkdir()
        (client_dir / "session.py").write_text(SESSION)
        with running(*workers), open(tmp / "client.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "session.py", address],
                cwd=client_dir,
                env={**BASE_ENV, "PYTHONPATH": str(ROOT)},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
            try:
                ns = Session(proc)
                ns.run(preamble(), keep=True)
                yield ns
            finally:
                assert proc.stdin is not None
                proc.stdin.close()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _run_session(block: Block, ns: Session) -> None:
    ns.run(block)


# --- the tests ------------------------------------------------------------------------


def test_every_page_has_examples_found() -> None:
    """The parser finds the blocks (a broken fence pattern would make every page pass)."""
    assert len(BLOCKS) >= 30
    assert {b.path.name for b in BLOCKS} >= {"README.md", "index.md", "testing.md"}


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_example(block: Block, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if block.kind in ("session", "preamble"):
        ns = request.getfixturevalue("session")
        if block.kind == "session":
            _run_session(block, ns)
        # the preamble ran in the fixture
    elif block.kind == "script":
        assert block.lang == "python", f"{block.id}: a pycon block needs `example: session`"
        _run_script(block, tmp_path, [sys.executable, "example.py"], {"example.py": block.code})
    elif block.kind == "event":
        _check_events(block)
    elif block.kind == "file":
        compile(block.code, block.id, "exec")
        users = [b for b in BLOCKS if b.path == block.path and b.kind == "pytest"]
        assert users, f"{block.id}: no `example: pytest` block on the page uses it"
    elif block.kind == "pytest":
        files = {
            b.options["file"]: b.code for b in BLOCKS if b.path == block.path and b.kind == "file"
        }
        files[block.options["file"]] = block.code
        _run_script(
            block, tmp_path, [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], files
        )
    else:
        pytest.fail(f"{block.id}: unknown example kind {block.kind!r} (see tests/test_docs.py)")


SCRIPT_TIMEOUT = 100  # s; under pytest-timeout's 120, so a hung example shows its output
GRACE = 15  # s an example's processes get to end after it exits (a resource tracker, ...)
MARK = "ACCELSCHED_DOCS_EXAMPLE"  # in the environment of an example and what it starts


def _run_script(block: Block, folder: Path, argv: list[str], files: dict[str, str]) -> None:
    """Run ``argv`` in ``folder`` and require exit 0 and nothing left running.

    An example that starts processes must stop them. Each process it starts inherits a
    mark in its environment (a new session or process group does not shed it), so once
    the example has exited and its processes had :data:`GRACE` seconds to end, or at
    once after :data:`SCRIPT_TIMEOUT` or an interrupt, what still carries the mark is
    killed and fails the test. The output goes to a file, never a pipe: a process left
    holding a pipe would make the example seem never to end, and a full pipe would
    block it."""
    for name, code in files.items():
        (folder / name).write_text(code, encoding="utf-8")
    mark = f"{os.getpid()}-{time.monotonic_ns()}"
    log = folder / ".output"
    with open(log, "w+b") as out:
        proc = subprocess.Popen(
            argv,
            cwd=folder,
            env={**BASE_ENV, MARK: mark},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        returncode = None
        try:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(SCRIPT_TIMEOUT)
            returncode = proc.poll()
        finally:  # an interrupt or pytest-timeout too: nothing is left running
            if returncode is None:
                proc.kill()
                proc.wait()
            survivors = _stop_marked(mark, grace=0 if returncode is None else GRACE)
    output = log.read_text(encoding="utf-8", errors="replace")
    ended = f"ran past {SCRIPT_TIMEOUT}s" if returncode is None else f"exited {returncode}"
    left = f", left processes running: {survivors}" if survivors else ""
    assert returncode == 0 and not survivors, f"{block.id} {ended}{left}:\n{output[-6000:]}"


def _stop_marked(mark: str, grace: float) -> list[str]:
    """Wait up to ``grace`` seconds for the processes carrying ``mark`` to end, SIGKILL
    what is left and return those processes' command lines."""
    deadline = time.monotonic() + grace
    while (left := _marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    return [" ".join(p.info["cmdline"] or [])[:200] for p in left]


def _marked(mark: str) -> list[psutil.Process]:
    """The live processes whose environment carries ``mark`` (zombies have ended:
    they are only not reaped)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        with contextlib.suppress(psutil.Error):  # gone, or not ours to read
            if p.environ().get(MARK) == mark:
                found.append(p)
    return found


def _check_events(block: Block) -> None:
    from accelsched import events

    exprs = ast.parse(block.code).body
    assert exprs, f"{block.id}: no event"
    for node in exprs:
        assert isinstance(node, ast.Expr), f"{block.id}: an event block holds only dicts"
        msg = ast.literal_eval(node.value)
        assert isinstance(msg, dict) and msg.get("action") in events.ACTIONS, msg
        line = events.describe(msg)
        assert msg["action"] in events._LINES and line and "{" not in line, (msg, line)
