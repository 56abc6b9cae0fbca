"""The ``accelsched`` command (also ``dask accelsched``): ``demo``, ``status``,
``events``, ``simulate``, ``version``, in click as dask's own.

The same group is ``accelsched`` (also ``python -m accelsched``) and ``dask accelsched``:
dask's command finds it through the ``dask_cli`` entry point group, as it finds
distributed's ``dask scheduler`` and ``dask worker``. ``simulate`` runs in
:mod:`accelsched.testing.simulate`.

``status`` and ``events`` ask a running scheduler, in bounded time. The scheduler is
given by its address or by ``--scheduler-file PATH``: ``dask scheduler --scheduler-file
PATH`` writes its identity there once it listens, and ``dask worker --scheduler-file``
reads it; these commands read it the same way (:func:`address_from_file`).

distributed bounds how long a client tries to connect, not the handshake after it: a
peer that accepts and never answers (a dashboard port given by mistake, a stopped or
swamped scheduler) would hold a synchronous ``Client`` forever, and so would a call to
it. So the commands run an asynchronous client, and every wait on the network (the
connection, each snapshot, the event log) is bounded by ``--timeout`` with
``asyncio.wait_for``. Whatever goes wrong on the way is one line on stderr and an exit
code of :mod:`accelsched.display`: an address that is no address before
anything is sent, anything after it (refused, silent, a peer speaking another protocol,
a scheme that needs configuration, such as ``tls://``) as unreachable.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import logging
import math
import os
import select
import signal
import stat
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, Final, NoReturn, TextIO, TypeVar, cast

import click
import dask

from accelsched import __version__
from accelsched.display import (
    EXIT_CODES_HELP,
    NO_ACCELSCHED,
    OK,
    OUTPUT_FAILED,
    UNREACHABLE,
    USAGE,
    ask_snapshot,
    one_line,
    render,
    shown,
)
from accelsched.events import ACTIONS
from accelsched.protocol import StatusReply

if TYPE_CHECKING:
    from distributed import Client

__all__ = [
    "cli",
    "main",
    "print_status",
    "print_events",
    "address_problem",
    "address_from_file",
    "MAX_SCHEDULER_FILE",
]

T = TypeVar("T")

#: Seconds between two looks at the event log under ``events --follow``.
FOLLOW_EVERY = 0.5


def _fail(command: str, problem: str, code: int) -> int:
    """Say what went wrong on one line of stderr; the exit code. ``command``: '' for
    the program itself (``accelsched --version``)."""
    print(f"accelsched{f' {command}' if command else ''}: {problem}", file=sys.stderr)
    return code


class _Unreachable(Exception):
    """The scheduler did not answer within the time given, or not as a scheduler."""


class _OutputFailed(OSError):
    """The output could not be written (not the reader gone: that is ``BrokenPipeError``);
    an ``OSError`` still for callers in Python."""


def _write(out: TextIO, text: str) -> None:
    """Write ``text`` to ``out`` now. ``BrokenPipeError``: the reader left, also when
    nothing is written (``events --follow | head`` on a quiet cluster); another
    failure (a full disk) is :class:`_OutputFailed`."""
    try:
        if text:
            out.write(text)
            out.flush()
        elif _reader_gone(out):
            raise BrokenPipeError
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise _OutputFailed(exc.strerror or str(exc)) from None


def _reader_gone(out: TextIO) -> bool:
    """Whether ``out`` is a pipe whose reading end was closed (a write would fail)."""
    try:
        poll = select.poll()
        poll.register(out.fileno(), select.POLLOUT)
        # a pipe's reader gone: POLLERR on Linux, POLLHUP elsewhere (and for a socket)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll here, or no file descriptor
        return False


def address_problem(address: str) -> str | None:
    """Why ``address`` is no scheduler address (a scheme distributed does not know, no
    port, a port out of range), or None: checked before anything is sent, so that what
    goes wrong later is the scheduler's doing, not the address's."""
    from distributed.comm.addressing import get_address_host_port, parse_address

    from accelsched.internals.client_side import check_scheme

    try:
        scheme, location = parse_address(address)
        if scheme == "inproc":
            return "an inproc address is reachable from its own process only"
        if scheme not in ("tcp", "tls", "ws", "wss"):  # no port distributed reads (ucx)
            check_scheme(scheme)
            return None
        given = location.rpartition(":")[2]  # int() would take " 1", "+1" and "١"
        tail = ":" in location and not location.endswith("]")  # "[::1]": no port
        if tail and not (given.isascii() and given.isdigit()):
            return f"port {given!r} is no number"
        port = get_address_host_port(address)[1]  # or "missing port number"
    except (ValueError, TypeError) as exc:
        return " ".join(str(exc).split())
    return None if 0 < port < 65536 else f"port {port} is out of range"


async def _within(seconds: float, call: Awaitable[T]) -> T:
    """``call``'s result, or :class:`_Unreachable` after ``seconds`` or on any error
    (what a peer that is no scheduler sends makes distributed raise anything). An error
    at the limit is the limit's: distributed's connect, cancelled there, may raise its own
    (``asyncio.wait_for`` passes it on), or its own limit, a little later, came first on
    a busy event loop."""
    start = time.monotonic()
    try:
        return await asyncio.wait_for(call, seconds)
    except asyncio.TimeoutError:
        raise _Unreachable(f"no answer within {seconds:.3g}s") from None
    except Exception as exc:
        if time.monotonic() - start >= seconds:
            raise _Unreachable(f"no answer within {seconds:.3g}s") from None
        raise _Unreachable(one_line(exc)) from exc


async def _server_kind(address: str, seconds: float) -> str | None:
    """What answers at ``address`` (``"Worker"``, ``"Nanny"``, ``"Scheduler"``), or None:
    asked when a client's handshake failed there, for a message that says why."""
    from distributed.core import rpc

    try:
        async with rpc(address, timeout=seconds) as server:
            identity = await asyncio.wait_for(server.identity(), seconds)
    except Exception:
        return None
    kind = identity.get("type") if isinstance(identity, dict) else None
    return kind if isinstance(kind, str) and kind.isidentifier() else None


def _run(
    command: str,
    address: str,
    seconds: float,
    connect: float | None,
    every: float | None,
    out: TextIO,
    text: Callable[[Client, StatusReply], Awaitable[str]],
) -> int:
    """Write ``text(client, snapshot)`` to ``out`` once, or every ``every`` seconds, from
    a client of ``address`` (connected within ``connect``, default ``seconds``; each
    snapshot within ``seconds``); the exit code. From inside a running event loop (a
    notebook) it runs on a thread of its own."""
    problem = address_problem(address)
    if problem is not None:
        return _fail(command, f"invalid scheduler address {address!r}: {shown(problem)}", USAGE)

    async def session() -> int:
        from distributed import Client

        within = seconds if connect is None else connect
        # distributed's own limit a little later: ours, on the handshake too, says it first
        client = Client(
            address, asynchronous=True, timeout=f"{within + 1!r}s", set_as_default=False
        )

        async def body() -> int:
            failed = "cannot reach a scheduler at"
            try:
                try:
                    await _within(within, client)
                except _Unreachable as exc:
                    kind = None if exc.__cause__ is None else await _server_kind(address, within)
                    if kind is None or kind == "Scheduler":
                        raise
                    raise _Unreachable(
                        f"that is a {kind.lower()}'s address: give the scheduler's (the address "
                        "its workers were given), or --scheduler-file"
                    ) from None
                failed = "lost the scheduler at"
                while True:
                    if client.status != "running" or client.scheduler is None:
                        # lost for longer than it tries to reconnect (a --watch pause)
                        raise _Unreachable("the client gave up reconnecting")
                    snap = await _within(seconds, ask_snapshot(client.scheduler))
                    if snap is None:  # it runs no accelsched
                        return _fail(
                            command,
                            f"the scheduler at {shown(address)} runs no accelsched (no "
                            "PlacementPlugin registered: accelsched.register(client) or dask "
                            "scheduler --preload accelsched)",
                            NO_ACCELSCHED,
                        )
                    # BrokenPipeError: the reader left (status --watch | head)
                    _write(out, await text(client, cast(StatusReply, snap)))
                    if every is None:
                        return OK
                    await asyncio.sleep(every)
            except _Unreachable as exc:
                return _fail(command, f"{failed} {shown(address)}: {exc}", UNREACHABLE)

        async def close() -> None:  # a half-started client too, now rather than at exit
            with contextlib.suppress(Exception):  # one that never connected, or lost
                await asyncio.wait_for(client.close(timeout=1), 2)

        return await _interruptible(body, close)

    try:
        asyncio.get_running_loop()
    except RuntimeError:  # none: the command line, a plain thread
        return asyncio.run(session())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(session())).result()


#: Seconds between the cancellations that Ctrl-C sends until its work has stopped.
RECANCEL_EVERY = 0.1


async def _interruptible(
    body: Callable[[], Awaitable[T]], cleanup: Callable[[], Awaitable[None]]
) -> T:
    """``body()``'s result, then ``cleanup()`` however it ended. On the main thread,
    Ctrl-C cancels ``body`` and is raised as ``KeyboardInterrupt`` after the cleanup.

    asyncio.run cancels its task on Ctrl-C only from Python 3.11; before, the
    interrupt struck whichever task was running (a client's start), which asyncio
    then reported as never retrieved. And until Python 3.12 ``asyncio.wait_for``
    swallows a cancellation that meets its result (a connection made as Ctrl-C comes):
    the start went on to wait a minute on the handshake. So the cancellation is sent
    again until ``body`` has stopped, and the cleanup is outside its reach."""
    loop = asyncio.get_running_loop()
    work = asyncio.ensure_future(body())
    interrupted = False

    def interrupt() -> None:
        nonlocal interrupted
        interrupted = True
        if not work.done():
            work.cancel()
            loop.call_later(RECANCEL_EVERY, interrupt)

    try:
        loop.add_signal_handler(signal.SIGINT, interrupt)
        ours = True
    except (RuntimeError, ValueError):  # not the main thread (a notebook's): not ours
        ours = False
    try:
        await asyncio.wait({work})  # which cancels nothing itself
    finally:
        work.cancel()  # none when done: ours cancelled from outside
        try:
            await cleanup()  # a second Ctrl-C meanwhile is only noted
        finally:
            if ours:
                loop.remove_signal_handler(signal.SIGINT)
    if interrupted:
        if not work.cancelled():
            work.exception()  # retrieved: the interrupt is the news
        raise KeyboardInterrupt
    return work.result()


def print_status(
    address: str,
    out: TextIO,
    *,
    as_json: bool = False,
    watch: float | None = None,
    timeout: float = 10.0,
    connect: float | None = None,
) -> int:
    """``accelsched status``: the table (or ``--json``), once or every ``watch`` seconds
    until Ctrl-C (exit 0 then); ``timeout`` seconds for each wait on the scheduler,
    ``connect`` (default ``timeout``) for the connection."""
    if watch is not None and not MIN_WATCH <= watch < float("inf"):
        raise ValueError(f"invalid watch={watch!r}: expected seconds >= {MIN_WATCH}")
    drawn = False  # once drawn, Ctrl-C under --watch is the way to stop: exit 0

    async def status(client: Client, snap: StatusReply) -> str:
        nonlocal drawn
        drawn = True
        if as_json:
            return _json_line(snap, sort_keys=True)
        # under --watch, redrawn in place on a terminal
        clear = "\x1b[H\x1b[2J" if out.isatty() else time.strftime("-- %H:%M:%S\n")
        return ("" if watch is None else clear) + render(snap) + "\n"

    try:
        return _run("status", address, timeout, connect, watch, out, status)
    except KeyboardInterrupt:
        if watch is None or not drawn:
            raise
        return OK


def print_events(
    address: str,
    actions: list[str] | None,
    out: TextIO,
    timeout: float = 10.0,
    connect: float | None = None,
    *,
    as_json: bool = False,
    follow: bool = False,
) -> int:
    """``accelsched events``: the scheduler's accelsched events, oldest first, workers by
    name (a restarted worker's old address too), or ``as_json`` one object a line as
    logged; ``follow``: then the new ones as they come, every :data:`FOLLOW_EVERY`
    seconds, until Ctrl-C (``KeyboardInterrupt``). ``timeout`` seconds for each wait,
    ``connect`` (default ``timeout``) for the connection."""
    from accelsched import events

    if unknown := sorted(set(actions or ()) - events.ACTIONS):
        return _fail(
            "events", f"unknown action(s) {unknown}; known: {sorted(events.ACTIONS)}", USAGE
        )
    shown_until = float("-inf")  # the scheduler's time of the last event printed

    def line(stamp: float, msg: Any, names: dict[str, str]) -> str:
        """The event as a line ('' for one that is not ours or not asked for)."""
        if (
            not isinstance(msg, dict)
            or msg.get("action") not in events.ACTIONS  # logged before accelsched held the topic
            or (actions and msg["action"] not in actions)
        ):
            return ""  # not one of ours, or not asked for
        if as_json:  # as logged; odd figures as their repr
            return _json_line({"time": stamp, **msg}, default=repr, skipkeys=True)
        owner = msg.get("owner")
        if isinstance(owner, str):  # gpu-rejected: the owner's address(es), by name too
            msg = {**msg, "owner": names.get(owner, owner)}
        elif isinstance(owner, list):
            msg = {**msg, "owner": [names.get(o, o) if isinstance(o, str) else o for o in owner]}
        # every figure of an event may come from a worker (its name, its devices'): the
        # line is shown, so none of it acts on the terminal or starts a line
        when = time.strftime("%H:%M:%S", time.localtime(stamp))
        return f"{when} [{msg['action']}] {shown(events.describe(msg, names))}\n"

    async def new_lines(client: Client, snap: StatusReply) -> str:
        nonlocal shown_until
        log = await _within(timeout, client.get_events(events.TOPIC))
        new = [(stamp, msg) for stamp, msg in log if stamp > shown_until]
        shown_until = max([shown_until, *(stamp for stamp, _ in new)])
        return "".join(line(stamp, msg, snap["names"]) for stamp, msg in new)

    return _run(
        "events", address, timeout, connect, FOLLOW_EVERY if follow else None, out, new_lines
    )


def _json_line(value: Any, **options: Any) -> str:
    """``value`` as one line of strict JSON, ASCII: a name's control characters arrive
    as \\u001b, never raw (C1 and bidi controls too, which JSON would let through), and a
    figure that is no finite number (an odd event's NaN, inf) as its name in a string:
    ``NaN`` and ``Infinity`` are no JSON, and strict parsers refuse the line."""
    try:
        return json.dumps(value, ensure_ascii=True, allow_nan=False, **options) + "\n"
    except ValueError:  # (out of range float values: only then walk it)
        return json.dumps(_finite(value), ensure_ascii=True, **options) + "\n"


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # 'nan', 'inf', '-inf'
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


#: A scheduler file is a few hundred bytes; anything this large is not one.
MAX_SCHEDULER_FILE: Final = 2**20


def address_from_file(path: str, deadline: float, command: str) -> str | int:
    """The address in a scheduler file (``dask scheduler --scheduler-file PATH``), or the
    exit code.

    The scheduler writes the file in place once it listens, so a reader can find it
    missing, empty or half written: it is waited for, then read with distributed's own
    reader, which tries again until it parses, until ``deadline`` (``time.monotonic``).
    A file that never appeared or is still empty then is :data:`UNREACHABLE` (the
    scheduler is not up yet); one that holds something else is :data:`USAGE`. Only a
    regular file of a sane size is opened: a FIFO would block and ``/dev/zero`` would
    never end."""
    while True:
        try:
            st = os.stat(path)
            break
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                return _fail(
                    command,
                    f"no scheduler file at {shown(path)} "
                    "(is the scheduler started with --scheduler-file?)",
                    UNREACHABLE,
                )
            time.sleep(0.05)
        except (OSError, ValueError) as exc:  # a symlink loop, a NUL in the path
            return _no_scheduler_file(command, path, one_line(exc))
    if not (regular := stat.S_ISREG(st.st_mode)) or st.st_size > MAX_SCHEDULER_FILE:
        return _no_scheduler_file(
            command, path, f"{st.st_size} bytes" if regular else "not a regular file"
        )
    from accelsched.internals.client_side import read_json_file

    try:
        # distributed's reader takes a falsy document for one not written yet: wrapped
        # in a tuple, "{}" or "null" is judged at once, not waited on
        (cfg,) = read_json_file(
            path,
            load=lambda f: (json.load(f),),
            timeout=max(deadline - time.monotonic(), 0.01),  # at least one read
        )
    # asyncio's TimeoutError is distributed's, and not the builtin before Python 3.11;
    # RecursionError: nested too deep to parse
    except (TimeoutError, asyncio.TimeoutError, RecursionError):
        with contextlib.suppress(OSError):  # gone meanwhile: not "still empty"
            if os.path.getsize(path) == 0:
                return _fail(
                    command,
                    f"the scheduler file {shown(path)} is still empty (is the scheduler starting?)",
                    UNREACHABLE,
                )
        return _no_scheduler_file(command, path, "it holds no JSON")
    except OSError as exc:  # no permission
        return _no_scheduler_file(command, path, one_line(exc))
    address = cfg.get("address") if isinstance(cfg, dict) else None
    if isinstance(address, str) and address:
        return address
    return _no_scheduler_file(command, path, f"it names no address: {address!r}")


def _no_scheduler_file(command: str, path: str, problem: str) -> int:
    return _fail(command, f"{shown(path)} is no scheduler file ({problem})", USAGE)


#: Seconds a connection gets at least after ``--scheduler-file`` waited for its file
#: (one ``--timeout`` covers both).
MIN_CONNECT = 1.0
#: Exit code after Ctrl-C before an answer, and ending ``events --follow`` (128 + SIGINT).
INTERRUPTED = 130


@click.group(
    name="accelsched",
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 88},
    epilog=f"status and events: {EXIT_CODES_HELP}",
)
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=lambda ctx, _, given: given and not ctx.resilient_parsing and _print_version(ctx),
    help="Show the version and exit.",
)
def cli() -> None:
    """GPUs as real, scarce, fallible hardware for Dask's distributed scheduler.

    status and events take the scheduler as dask's own commands do: SCHEDULER (its
    address), --scheduler-file PATH, or dask config scheduler-address
    (DASK_SCHEDULER_ADDRESS)."""


def main(argv: list[str] | None = None) -> int:
    """``accelsched ARGS``: the exit code. A usage error ends the program (exit 2, as
    click's own); every other outcome is returned, for callers in Python. Ctrl-C before
    a command could take it (while distributed is imported, in the first second) is
    exit 130 without a traceback (click writes an empty line first)."""
    try:
        code = cli.main(argv, prog_name="accelsched", standalone_mode=False)
    except click.UsageError as exc:
        exc.show()
        raise SystemExit(exc.exit_code) from None
    except click.exceptions.Abort as exc:  # click's, in our mode, for Ctrl-C and for EOF
        if isinstance(exc.__context__, KeyboardInterrupt):
            return INTERRUPTED
        raise
    except KeyboardInterrupt:
        return INTERRUPTED
    return code if isinstance(code, int) else 0


def _timeout(ctx: click.Context, param: click.Parameter, value: str) -> float:
    """``--timeout``: a duration (``10s``, ``500ms``, seconds), finite and > 0 (nothing can
    be reached in no time), read as accelsched reads durations (``.5s``: half a second)."""
    from accelsched.config import parse_optional_duration

    try:
        seconds = parse_optional_duration("--timeout", value)
    except (TypeError, ValueError):
        seconds = None  # (its message would offer None, which means no limit elsewhere)
    if seconds is None or not 0 < seconds < float("inf"):
        raise click.BadParameter(
            f"invalid --timeout={value!r}: expected a duration > 0, like '10s' or '500ms'"
        )
    return seconds


#: The shortest ``--watch`` pause: each snapshot is a request the scheduler answers on its
#: event loop, so a watch costs it at most ten a second.
MIN_WATCH = 0.1


def _interval(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    """``--watch`` SECONDS: a number from :data:`MIN_WATCH` on."""
    if value is None:
        return None
    with contextlib.suppress(ValueError):
        if MIN_WATCH <= (seconds := float(value)) < float("inf"):
            return seconds
    raise click.BadParameter(
        f"invalid SECONDS {value!r}: expected a number >= {MIN_WATCH} (each snapshot asks "
        "the scheduler)"
    )


@contextlib.contextmanager
def _to_stdout(ctx: click.Context) -> Iterator[TextIO]:
    """stdout, for a command to write to: its reader gone (``accelsched status --watch |
    head``) ends the command with exit 0; output that cannot be written (stdout closed,
    a full disk) with one line and exit 74. Either way stdout then points at
    ``os.devnull``, so the flush at exit does not fail again. The command line's alone: a
    caller in Python gets the error."""
    try:
        if sys.stdout is None:  # (started with its descriptor closed)
            raise _OutputFailed("stdout is closed")
        yield sys.stdout
    except BrokenPipeError:
        _quiet_stdout()
        ctx.exit(OK)
    except _OutputFailed as exc:
        _quiet_stdout()
        # (the program itself: --version, as `accelsched` or under `dask accelsched`)
        command = "" if isinstance(ctx.command, click.Group) else str(ctx.command.name)
        ctx.exit(_fail(command, f"cannot write its output: {exc}", OUTPUT_FAILED))


def _quiet_stdout() -> None:
    with contextlib.suppress(AttributeError, OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _scheduler_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Where the scheduler is, as dask's own commands take it: the address, the file
    ``dask scheduler --scheduler-file`` writes, or dask config ``scheduler-address``
    (``DASK_SCHEDULER_ADDRESS``); and how long to try to reach it."""
    command = click.option(
        "--timeout",
        default="10s",
        metavar="DURATION",
        callback=_timeout,
        help="How long to try to reach the scheduler, its scheduler file included (default 10s).",
    )(command)
    command = click.option(
        "--scheduler-file",
        metavar="PATH",
        help="Read the address from the file dask scheduler --scheduler-file PATH writes "
        "(waiting for it within --timeout), instead of giving SCHEDULER.",
    )(command)
    return click.argument("scheduler", required=False)(command)


def _ask(ctx: click.Context, run: Callable[[str, float, TextIO], int]) -> NoReturn:
    """``status`` or ``events``: the address (one ``--timeout`` for the scheduler file and
    the connection together), then ``run(address, seconds to connect, stdout)``'s exit
    code."""
    address, timeout, path = (ctx.params[k] for k in ("scheduler", "timeout", "scheduler_file"))
    if path == "":
        raise click.BadParameter(
            "invalid PATH '': expected a file name", ctx, param_hint="'--scheduler-file'"
        )
    if address is None and path is None:
        address = dask.config.get("scheduler-address", None)
    if (address is None) == (path is None):  # both, or neither (nor in dask config)
        raise click.UsageError(
            "give a SCHEDULER address or --scheduler-file PATH"
            + (", not both" if path is not None else " (or set DASK_SCHEDULER_ADDRESS)")
        )
    try:  # the import too (distributed's): a Ctrl-C in the first second is 130 here
        from accelsched.demo.quiet import quiet_logs
    except KeyboardInterrupt:  # (`dask accelsched status` runs click's own way: no main())
        ctx.exit(INTERRUPTED)
    # distributed's own log lines (a reconnect that failed, ...) would come on top of the
    # one line each error is
    with quiet_logs(logging.CRITICAL), _to_stdout(ctx) as out:
        try:
            connect = timeout
            if path is not None:
                deadline = time.monotonic() + timeout
                found = address_from_file(path, deadline, str(ctx.command.name))
                if isinstance(found, int):  # its exit code (dask config's address may be
                    ctx.exit(found)  # an int too, which is no exit code: a bad address)
                address = found
                connect = max(deadline - time.monotonic(), MIN_CONNECT)
            ctx.exit(run(address, connect, out))
        except KeyboardInterrupt:  # Ctrl-C before anything was shown, or ending --follow
            ctx.exit(INTERRUPTED)


@cli.command(
    help="A table per worker: verified GPUs, leases, leak estimate, quarantine, restarts, "
    "fallbacks; the options in effect and the GPU tasks waiting, by why.",
    epilog=EXIT_CODES_HELP,
)
@_scheduler_options
@click.option(
    "--json", "as_json", is_flag=True, help="Print the snapshot as JSON (one object a line)."
)
@click.option(
    "--watch",
    is_flag=False,
    flag_value="2",
    callback=_interval,
    metavar="[SECONDS]",
    help="Redraw every SECONDS (default 2) until Ctrl-C.",
)
@click.pass_context
def status(
    ctx: click.Context, timeout: float, as_json: bool, watch: float | None, **_: Any
) -> NoReturn:
    _ask(
        ctx,
        lambda address, connect, out: print_status(
            address, out, as_json=as_json, watch=watch, timeout=timeout, connect=connect
        ),
    )


@cli.command(help="Print accelsched's events from a running cluster's scheduler.")
@_scheduler_options
@click.option(
    "--action",
    "actions",
    multiple=True,
    type=click.Choice(sorted(ACTIONS)),
    help="Only these actions (repeatable).",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object a line, as logged.")
@click.option("--follow", is_flag=True, help="Then print new events as they come, until Ctrl-C.")
@click.pass_context
def events(
    ctx: click.Context,
    timeout: float,
    actions: tuple[str, ...],
    as_json: bool,
    follow: bool,
    **_: Any,
) -> NoReturn:
    _ask(
        ctx,
        lambda address, connect, out: print_events(
            address, list(actions), out, timeout, connect, as_json=as_json, follow=follow
        ),
    )


@cli.command()
@click.option(
    "--report",
    metavar="PATH",
    help="Where to write the report: a .html file or a folder (default accelsched-demo.html "
    "in the system's temporary folder; the path is printed).",
)
@click.pass_context
def demo(ctx: click.Context, report: str | None) -> NoReturn:
    """Run a local cluster (real GPUs when NVML sees any, else simulated ones) through
    placement, a leak and a fallback, and write an HTML report."""
    from accelsched.demo import main as demo_main

    ctx.exit(demo_main(report))


class _OwnParser(click.Command):
    """A command that parses its arguments itself (``simulate`` keeps its argparse
    parser: ``--`` and everything after it reach it untouched)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.args = list(args)
        return []


@cli.command(
    cls=_OwnParser,
    add_help_option=False,
    short_help="Run a command (dask worker, dask scheduler, python script.py) on simulated "
    "GPUs, as accelsched.testing.fake_gpus shows them.",
)
@click.pass_context
def simulate(ctx: click.Context) -> NoReturn:
    # a testing tool: its module (and the simulated devices) load only here
    from accelsched.testing.simulate import simulate_arguments, simulate_main

    parser = argparse.ArgumentParser(
        prog=ctx.command_path,
        usage=f"{ctx.command_path} [-h] --gpus N [options] -- COMMAND [ARG ...]",
        description="Run COMMAND where NVML (pynvml, distributed, dask-cuda, accelsched) "
        "sees N simulated GPUs; exit with its exit code. Signals sent to this process "
        "reach COMMAND; the simulation is removed when it ends.",
    )
    simulate_arguments(parser)
    ctx.exit(simulate_main(parser, parser.parse_args(ctx.args)))


@cli.command()
@click.pass_context
def version(ctx: click.Context) -> NoReturn:
    """Print the version."""
    with _to_stdout(ctx) as out:
        _write(out, f"{__version__}\n")
    ctx.exit(OK)


def _print_version(ctx: click.Context) -> NoReturn:
    """``accelsched --version``, as click's own option says it, its output checked as
    every command's (click's wrote a traceback to a full disk, and exited 1)."""
    with _to_stdout(ctx) as out:
        _write(out, f"accelsched, version {__version__}\n")
    ctx.exit(OK)
