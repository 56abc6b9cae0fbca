"""``--preload accelsched``: the plugins on a cluster started from the command line.

GPU clusters are mostly started by ``dask scheduler``/``dask worker``/``dask cuda worker``,
helm charts, dask-jobqueue and dask-gateway, where nobody calls
:func:`accelsched.register`. distributed imports a preload module in the server's start
and calls its ``dask_setup(server, ...)``; here that is a click command, so the options
of :func:`accelsched.register` can follow on the command line
(``dask scheduler --preload accelsched --fallback-timeout 30s``) or come from
``distributed.scheduler.preload-argv``. Options not given come from dask config
(``accelsched.placement.*``, ``accelsched.guard.*``), as for the plugins themselves.

- **scheduler**: adds the :class:`~accelsched.PlacementPlugin` and hands the
  :class:`~accelsched.GuardPlugin` to every worker, present and future, as
  ``client.register_plugin`` would.
- **worker**: once the worker has started (and registered), sets up a guard unless the
  scheduler already handed it one: the scheduler's is the cluster's, one guard per worker.

Plugin names are those :func:`accelsched.register` uses, so a later ``register(client)``
changes nothing. ``docs/deploy.md`` shows each deployment.

A failure shows as one line and a non-zero exit. distributed logs a failing preload and
runs the server on, and its commands exit with 0 once their servers close. So a bad
argument parsed on the command line is one click error line (exit 2) without the usage
text, and a failure once a server runs stops it and makes the command in that process
exit with 1, as supervisors (systemd, Kubernetes, Slurm) expect of a failure.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import click

from accelsched import config, internals
from accelsched.config import GUARD_OPTIONS, PLACEMENT_OPTIONS, Option
from accelsched.internals import servers
from accelsched.internals.forkserver import FastRestart
from accelsched.protocol import GUARD_PLUGIN
from accelsched.scheduler.placement_plugin import PlacementPlugin
from accelsched.worker.guard_plugin import GuardPlugin, preimport

__all__ = ["dask_setup", "dask_teardown", "setup_server", "split_options"]

logger = logging.getLogger(__name__)


class PreloadError(click.UsageError):
    """A bad preload argument or config value: click prints ``Error: <message>``, one
    line without the usage text (which would be the preload's, that nobody typed), and
    the command exits with 2, click's code for a usage error."""

    def show(self, file: Any = None) -> None:
        click.ClickException.show(self, file)


class BadPreloadValue(PreloadError, click.BadParameter):
    """A bad value (:class:`click.BadParameter`), shown as :class:`PreloadError`."""


def exit_nonzero_after_the_command() -> None:
    """Make the command running in this process (``dask scheduler``, ``dask worker``
    with ``--no-nanny``, or, run there, a worker's nanny) exit with 1 once it has closed
    its servers, through click's own ``Exit``.

    distributed's commands run the server inside their click callback, so the command's
    context is current here; it closes when the callback returns, after the server has
    closed cleanly. In a process no such command runs (a ``LocalCluster``, a test) nothing
    changes: the server stops, the process goes on.
    """
    if _dask_command() is None:  # (a command's context is current where one runs)
        return

    def fail() -> None:
        raise click.exceptions.Exit(1)

    click.get_current_context().find_root().call_on_close(fail)


def _dask_command() -> str | None:
    """The module of the distributed/dask-cuda command running in this process's
    current click context (``distributed.cli.dask_worker``, ...), or None; run as
    ``python -m`` (as dask-jobqueue's job scripts start workers), its module is
    ``__main__``, named by its spec."""
    ctx = click.get_current_context(silent=True)
    callback = getattr(getattr(ctx, "command", None), "callback", None)
    module = getattr(callback, "__module__", None) or ""
    if module == "__main__":  # ``python -m distributed.cli.dask_worker`` (dask-jobqueue's)
        module = getattr(getattr(sys.modules.get("__main__"), "__spec__", None), "name", "")
    return module if module.startswith(("distributed.cli.", "dask_cuda.cli")) else None


def refuse_swallowed_option() -> None:
    """A worker's command whose scheduler address is an option: its optional address
    argument takes the first argument it does not know, a preload's option when no
    address comes before it (``dask worker --scheduler-file s.json --preload accelsched
    --leak-threshold=2GiB``, or the address given last), which the command then ignores.
    An error naming it, not an option silently dropped."""
    command = click.get_current_context(silent=True)
    address = command.params.get("scheduler") if command is not None else None
    if isinstance(address, str) and address.startswith("-"):
        raise PreloadError(
            f"{address!r} was taken for the scheduler's address (the worker's command takes "
            "the first argument it does not know for it): give the address before "
            "--preload; with --scheduler-file, or the address in dask config, give "
            "accelsched's options to this worker in dask config instead "
            "(DASK_ACCELSCHED__GUARD__..., or distributed.worker.preload-argv)"
        )


def refuse_placement_options(placement_options: dict[str, Any]) -> None:
    """A worker given the scheduler's options: an error naming each with its value."""
    given = [
        f"{o.flag} {placement_options[o.name]!r}"
        for o in config.PLACEMENT_OPTIONS
        if o.name in placement_options
    ]
    if given:
        raise PreloadError(
            f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to the scheduler "
            "(placement), not to a worker: give "
            f"{'it' if len(given) == 1 else 'them'} to `dask scheduler --preload accelsched`"
        )


#: Command-line spellings of "no value" for options that take one (``fallback_timeout``).
_NONE = ("none", "null", "never")


#: Options given as a list: repeated on the command line (``none``: the empty list).
_SEVERAL = ("oom_exceptions", "preimport")


def _is_none(value: Any) -> bool:
    """Whether a command-line value says "no value" (``none``, ``null``, ``never``)."""
    return isinstance(value, str) and value.strip().lower() in _NONE


#: An option given as ``none`` on the command line: None, which wins over config (a
#: value click leaves None is one not given, which config fills).
NOTHING: Any = object()


def _validator(opt: Option) -> Any:
    """A click callback that parses the value as the plugin will and fails naming it.

    Without a value on the command line it checks the dask config value instead, so a
    bad ``DASK_ACCELSCHED__...`` stops ``dask scheduler``/``dask worker`` as they parse
    their arguments, before anything starts.
    """

    def validate(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        given = value is not None and value != ()
        if given and _is_none(value):
            value = None
        elif given and isinstance(value, tuple) and any(_is_none(v) for v in value):
            if len(value) > 1:  # "none" and names: which one was meant is not ours to guess
                none = next(v for v in value if _is_none(v))
                raise click.BadParameter(
                    f"invalid {opt.name}={list(value)!r}: {none!r} stands alone (no names)",
                    ctx=ctx,
                    param=param,
                )
            return ()  # a list option given as none: the empty list, which wins over config
        try:
            config.parse_option(opt, {opt.name: value} if given else {})
        except (TypeError, ValueError) as exc:
            raise click.BadParameter(str(exc), ctx=ctx, param=param) from None
        return (NOTHING if value is None else value) if given else None

    return validate


def split_options(given: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Placement and guard options out of the parsed command line (given ones only)."""
    chosen = {k: None if v is NOTHING else v for k, v in given.items() if v is not None}
    return config.only(PLACEMENT_OPTIONS, chosen), config.only(GUARD_OPTIONS, chosen)


async def setup_server(server: Any, invalid: str | None = None, **given: Any) -> None:
    """Install what belongs on ``server``; on any error, one log line and stop it.

    distributed logs and ignores an exception from a preload, and the server would run
    without accelsched: GPU workers unverified, a GPU-less one keeping its ``GPU: 1``.
    Inside ``dask scheduler``/``dask worker`` (a click command runs the server in this
    process), the command then exits with 1, so a supervisor sees the failure.
    """
    try:
        if invalid is not None:
            raise PreloadError(invalid)
        await _install(server, given)
    except Exception as exc:
        message = exc.format_message() if isinstance(exc, click.ClickException) else str(exc)
        logger.error("accelsched: %s; stopping this %s", message, type(server).__name__.lower())
        exit_nonzero_after_the_command()
        server.loop.add_callback(
            servers.stop,
            server,
            reason=f"accelsched-preload-failed: {message}",
            in_nanny=exit_nonzero_after_the_command,
        )


async def _install(server: Any, given: dict[str, Any]) -> None:
    from distributed import Nanny, Scheduler, Worker

    placement_options, guard_options = split_options(given)
    if isinstance(server, Scheduler):
        placement = PlacementPlugin(**placement_options)  # validated: a bad value stops here
        guard = GuardPlugin(**guard_options)
        fast = FastRestart() if guard.options["fast_restart"] else None
        running = servers.running_plugins(server)
        if running["placement"] is not None:  # an earlier preload (a second --preload)
            logger.warning(
                "accelsched: the plugins are installed already: this preload's options are "
                "not used (placement %s, guard %s; running: placement %s, guard %s)",
                placement.options,
                guard.options,
                running["placement"].options,
                running["guard"].options if running["guard"] is not None else None,
            )
            return
        await servers.install_on_scheduler(server, placement, guard, fast)
        logger.info(
            "accelsched: PlacementPlugin installed, GuardPlugin handed to every worker "
            "(placement %s, guard %s)",
            placement.options,
            guard.options,
        )
    elif isinstance(server, Worker):
        refuse_placement_options(placement_options)
        guard = GuardPlugin(**guard_options)  # validated now: a bad value stops the start
        # this worker's own options: a guard its scheduler hands it applies them as well,
        # unless given the same option explicitly (see accelsched.config; logged there)
        config.worker_preload_options[server] = {k: guard.options[k] for k in guard_options}
        preimport(guard.options["preimport"])  # before the worker starts, so before any task
        internals.spawn(server, _install_guard, server, guard)
    elif isinstance(server, Nanny):
        raise PreloadError(
            "accelsched guards the worker process: use `--preload accelsched`, "
            "not `--preload-nanny accelsched`"
        )
    else:
        raise PreloadError(f"accelsched cannot be preloaded into {type(server).__name__}")


async def _install_guard(worker: Any, guard: GuardPlugin) -> None:
    """After the start: the worker is registered, so the guard's report finds it known
    (a report sent from inside the start would reach the scheduler before the worker).
    A guard its scheduler handed it is set up by then, with this worker's options."""
    await worker.start()  # at once if it has started; raises if its start failed
    if GUARD_PLUGIN in worker.plugins:
        return
    await worker.plugin_add(guard, name=GUARD_PLUGIN, catch_errors=False)
    logger.info("accelsched: GuardPlugin installed by preload")


class _PreloadCommand(click.Command):
    """``dask_setup``: a click command whose bad arguments stop the server.

    On the command line (``dask scheduler --preload accelsched --bad x``) distributed
    parses the arguments itself and click exits with its usage error. Arguments from
    config (``distributed.scheduler.preload-argv``) are parsed in the server's start,
    where distributed would log the error and run on without accelsched: there the
    error is handed to :func:`setup_server`, which stops the server.
    """

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """Parse as click does; every error becomes one clean line (:class:`PreloadError`),
        and a worker's command refuses the scheduler's options before anything starts."""
        try:
            # a worker's command (``dask worker``, ``dask cuda worker``) checks a preload's
            # arguments as it parses its command line, before any worker starts
            module = _dask_command() or ""
            worker = module.endswith("dask_worker") or "dask_cuda" in module
            if worker:
                refuse_swallowed_option()
            rest = super().parse_args(ctx, args)
            if worker:
                refuse_placement_options(split_options(ctx.params)[0])
        except click.BadParameter as exc:
            raise BadPreloadValue(exc.message, param=exc.param, param_hint=exc.param_hint) from None
        except click.UsageError as exc:
            raise PreloadError(exc.format_message()) from None
        return rest

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        # less the flags of dask-cuda's own preload: ``dask cuda worker`` and
        # ``LocalCUDACluster`` add ``dask_cuda.initialize`` with ``--create-cuda-context``
        # to the worker's preloads, and distributed hands one flat argument list to every
        # preload: accelsched's receives that flag too. The reverse also holds, so
        # dask-cuda's preload fails on accelsched's options: under dask-cuda, options
        # come from dask config (said in the log)
        command = getattr(sys.modules.get("dask_cuda.initialize"), "dask_setup", None)
        flags = {
            name
            for p in (command.params if isinstance(command, click.Command) else ())
            if isinstance(p, click.Option) and p.is_flag
            for name in (*p.opts, *p.secondary_opts)
        }
        args, given = [a for a in args if a not in flags], args  # a copy: click pops it
        if args and len(args) < len(given):
            logger.warning(
                "accelsched: dask-cuda gives every preload the same arguments, so its own "
                "preload (dask_cuda.initialize) is handed %s and fails on them; give "
                "accelsched's options to dask-cuda workers through dask config "
                "(DASK_ACCELSCHED__...) instead",
                " ".join(args),
            )
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.ClickException as exc:
            ctx = click.Context(self, info_name=info_name, parent=parent)
            ctx.params = {"invalid": exc.format_message()}
            return ctx


dask_setup = _PreloadCommand(
    "dask_setup",
    params=[
        click.Option(
            [opt.flag],
            default=None,
            multiple=opt.name in _SEVERAL,
            callback=_validator(opt),
            help=f"({'scheduler' if opt.name in config.NOT_PER_WORKER else side}) dask config "
            f"{opt.key}" + ("; repeat for several" if opt.name in _SEVERAL else ""),
        )
        for side, options in (("scheduler", PLACEMENT_OPTIONS), ("worker", GUARD_OPTIONS))
        for opt in options
    ],
    callback=setup_server,
    help="accelsched preload: options of accelsched.register() (default: dask config).",
)


def dask_teardown(server: Any) -> None:
    """Nothing to undo: a closing scheduler closes its plugins, a closing worker tears
    its plugins down. distributed calls it when the server closes."""
