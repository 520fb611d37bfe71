"""Launch and manage ``n`` copies of a worker: the contexts and their results.

This module mirrors ``torch.distributed.elastic.multiprocessing.api``: the
same class names, the same constructor signatures and the same behaviour, so
code written against either import path works.  The work itself (fork/exec,
redirection, the tee multiplexer, reaping) is done by the native I/O thread
in :mod:`torchmp._core`; this module only decides what to launch and how to
report it.

Example (binary workers, torch 2.x form)::

    from torchmp import start_processes, DefaultLogsSpecs, Std

    ctx = start_processes(
        name="trainer",
        entrypoint="echo",
        args={0: ("hello",), 1: ("world",)},
        envs={0: {}, 1: {}},
        logs_specs=DefaultLogsSpecs(log_dir="/tmp/logs", tee=Std.ALL),
    )
    result = ctx.wait()          # event-driven: returns as the last rank exits
    assert not result.is_failed()
    ctx.close()

Errors:

========================  ==================================================
what went wrong           what you get
========================  ==================================================
args/envs mis-keyed       ``RankMappingError`` (a ValueError and RuntimeError)
bad env key/value         ``ValueError`` naming the rank and the key
binary not found          ``FileNotFoundError`` (before anything starts)
binary not executable     ``PermissionError`` (before anything starts)
exec failed at rank k     the matching ``OSError``; ranks < k are reaped
a rank failed             ``RunProcsResult.failures`` (``ProcessFailure``)
launcher got a signal     ``SignalException`` (from ``start``/``wait``)
========================  ==================================================
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import uuid
from collections.abc import Callable
from typing import Any, overload

from torchmp import _console, _core, _escapees
from torchmp._functions import MultiprocessContext
from torchmp._inputs import (
    DEFAULT_STDERR_TAIL_LINES as DEFAULT_STDERR_TAIL_LINES,
    START_METHODS,
    as_log_dir,
    check_name,
    normalize_args,
    normalize_envs,
    watch_stderr_setting,
    stderr_tail_bound as stderr_tail_bound,
)
from torchmp._binary import SubprocessContext
from torchmp._native import (
    KILL_GRACE_SECONDS as KILL_GRACE_SECONDS,
    _NativeContext as _NativeContext,
)
from torchmp._pcontext import PContext, ResourceUsage, RunProcsResult, TeeTail as TeeTail
from torchmp._shutdown import SHUTDOWN_GRACE_SECONDS
from torchmp._signals import (
    SignalException,
    interrupt_signal,
    terminate_process_handler,
    close_despite_interrupts as close_despite_interrupts,
    handled_signals as handled_signals,
    install_handlers,
)
from torchmp.logs_specs import (
    DefaultLogsSpecs,
    LegacyLogsSpecs,
    LogsDest,
    LogsSpecs,
    Std,
    to_map,
    validate_full_rank,
)

__all__ = [
    "DefaultLogsSpecs",
    "LogsDest",
    "LogsSpecs",
    "MultiprocessContext",
    "PContext",
    "ResourceUsage",
    "RunProcsResult",
    "SignalException",
    "Std",
    "SubprocessContext",
    "to_map",
]

logger = logging.getLogger(__name__)

# torch's private names, which its tests import (the handler: to compare
# the installed one with).
_validate_full_rank = validate_full_rank
_terminate_process_handler = terminate_process_handler

# torch's names, looked up through this module at call time (torch's tests
# replace them to watch what start() does).
IS_WINDOWS = sys.platform == "win32"


def _install_signal_handlers() -> None:
    """What PContext.start installs, with this module's signal, threading,
    logger and IS_WINDOWS as they are at call time."""
    install_handlers(signal, threading, logger, IS_WINDOWS)


def _wrap(
    local_rank: int,
    fn: Callable[..., Any],
    args: dict[int, tuple[Any, ...]],
    envs: dict[int, dict[str, str]],
    stdout_redirects: dict[int, str],
    stderr_redirects: dict[int, str],
    ret_vals: dict[int, Any],
    queue_finished_reading_event: Any,
    numa_options: Any = None,
) -> None:
    """torch's body of a function worker, run in the calling process: the
    rank's env applied to ``os.environ``, stdout/stderr redirected at the fd
    level to the given files ("" for none), the process bound as
    ``numa_options`` says (GPU ``local_rank``), ``fn`` run under ``record``,
    its return value put on ``ret_vals[local_rank]``, then a wait on the event.
    torchmp's own workers do not go through this (see torchmp._launch.worker)."""
    from torchmp.errors import record
    from torchmp.redirects import redirect_stderr, redirect_stdout

    if numa_options is not None:
        from torchmp import _placement

        _placement.bind_current_process(numa_options, local_rank)
    rank_args = args[local_rank]
    rank_env = envs[local_rank]
    ret_val = ret_vals[local_rank]
    out_path = stdout_redirects[local_rank]
    err_path = stderr_redirects[local_rank]
    for key, value in rank_env.items():
        os.environ[key] = value
    with contextlib.ExitStack() as stack:
        if out_path:
            stack.enter_context(redirect_stdout(out_path))
        if err_path:
            stack.enter_context(redirect_stderr(err_path))
        ret = record(fn)(*rank_args)
    ret_val.put(ret)
    queue_finished_reading_event.wait()



# ---------------------------------------------------------------------------
# start_processes


@overload
def start_processes(
    name: str,
    entrypoint: Callable[..., Any] | str,
    args: dict[int, tuple[Any, ...]],
    envs: dict[int, dict[str, str]] | None,
    logs_specs: LogsSpecs,
    log_line_prefixes: dict[int, str] | None = None,
    start_method: str = "spawn",
    numa_options: Any = None,
    duplicate_stdout_filters: list[str] | None = None,
    duplicate_stderr_filters: list[str] | None = None,
    *,
    log_line_timestamps: bool = False,
    console_backlog: int | str | None = None,
    stderr_tail: int | None = None,
    watch_stderr: bool | None = None,
    cpu_affinity: dict[int, Any] | None = None,
    mem_bind: str | None = None,
    kill_on_bad_exit: bool = True,
    subreaper: bool = False,
) -> PContext: ...


@overload
def start_processes(
    name: str,
    entrypoint: Callable[..., Any] | str,
    args: dict[int, tuple[Any, ...]],
    envs: dict[int, dict[str, str]] | None,
    log_dir: str | os.PathLike[str],
    start_method: str = "spawn",
    redirects: Std | dict[int, Std] = Std.NONE,
    tee: Std | dict[int, Std] = Std.NONE,
    *,
    log_line_timestamps: bool = False,
    console_backlog: int | str | None = None,
    stderr_tail: int | None = None,
    watch_stderr: bool | None = None,
    cpu_affinity: dict[int, Any] | None = None,
    mem_bind: str | None = None,
    kill_on_bad_exit: bool = True,
    subreaper: bool = False,
) -> PContext: ...


def start_processes(  # type: ignore[misc]  # one body for both overloads: its 5th parameter is logs_specs or log_dir
    name: str,
    entrypoint: Callable[..., Any] | str,
    args: dict[int, tuple[Any, ...]],
    envs: dict[int, dict[str, str]] | None = None,
    logs_specs: LogsSpecs | str | os.PathLike[str] | None = None,
    *positional: Any,
    **kwargs: Any,
) -> PContext:
    """Start ``n = len(args)`` copies of ``entrypoint`` and return the context.

    Two signatures are accepted, told apart by the fifth argument:

    * torch 2.x: ``start_processes(name, entrypoint, args, envs, logs_specs,
      log_line_prefixes=None, start_method="spawn", numa_options=None,
      duplicate_stdout_filters=None, duplicate_stderr_filters=None)`` where
      ``logs_specs`` is any object with ``reify(envs)`` (torch's own
      ``DefaultLogsSpecs`` included);
    * torch 1.9: ``start_processes(name, entrypoint, args, envs, log_dir,
      start_method="spawn", redirects=Std.NONE, tee=Std.NONE)`` with files in
      ``{log_dir}/{local_rank}/``.

    ``entrypoint`` is a callable (function launch) or a ``str`` naming a
    binary (looked up on ``PATH``, never run through a shell; args are cast
    with ``str()``).  Every input is checked before anything starts.

    torchmp extensions (keyword only): ``log_line_timestamps=True`` puts a UTC
    time (``2026-11-29T09:54:05.123Z``) after the prefix of every teed line;
    ``console_backlog`` (bytes, or a size like ``"16M"``) bounds what each
    teed stream may leave waiting in memory for a console that falls behind
    (default 4 MiB, or ``TORCHMP_CONSOLE_BACKLOG``); past it, the stream's
    log file is the backlog and the console catches up from it (a console
    that takes nothing for ``TORCHMP_CONSOLE_STALL`` seconds, default 10,
    has whole lines left out, with a marker line saying how many);
    ``stderr_tail`` (lines, default 20 or ``TORCHMP_STDERR_TAIL``; 0: off)
    is how much of a failed rank's stderr its :class:`ProcessFailure` keeps
    (``stderr_tail``, and the message when there is no error file);
    ``watch_stderr=True`` routes a stderr that is neither teed nor redirected
    through torchmp too, unchanged on the console, so its tail is kept (the
    worker then writes to a pipe, not a terminal);
    ``kill_on_bad_exit=False`` (srun's ``--kill-on-bad-exit=0``) lets a
    failing rank leave the others running: the result comes once every
    rank has exited, with every failure in it (the root cause is still the
    first by time); the default ``True`` is torch's fail-fast.
    ``subreaper=True`` makes this process a child subreaper
    (``PR_SET_CHILD_SUBREAPER``; process-wide, and kept): a rank's
    descendant that leaves its process group (``setsid``, a double fork) is
    re-parented here, and ``close()`` stops it (SIGTERM, the same grace,
    SIGKILL) and reaps it after the ranks; ``ctx.escaped`` counts them.  It
    is told apart from the process's own children by ``TORCHMP_CONTEXT_ID``
    (set in every rank's environment, inherited): one that clears its
    environment is missed, and one that exits before ``close()`` stays a
    zombie of this process.

    Placement: ``numa_options`` (torch's ``NumaOptions``, or
    :class:`torchmp.numa.NumaOptions` without torch) binds local rank ``r``
    to the CPUs near GPU ``r`` as torch computes them (see
    :mod:`torchmp.numa`); the torchmp extension ``cpu_affinity={local_rank:
    cpus}`` (a set of CPU ids or a string like ``"0-3,8"``; ranks left out
    are not bound) binds ranks to given CPUs, on machines without GPUs too;
    ``mem_bind="local"`` also binds each bound rank's memory to the NUMA
    nodes of its CPUs.  The binding is set in the child before exec (or
    before the function runs) with ``sched_setaffinity`` /
    ``set_mempolicy``; ``ctx.bindings`` says where each rank runs.  CPUs
    outside the launcher's own affinity, or a topology that cannot be read,
    are an error before anything starts.
    """
    placement = {"cpu_affinity": kwargs.pop("cpu_affinity", None), "mem_bind": kwargs.pop("mem_bind", None)}
    timestamps = bool(kwargs.pop("log_line_timestamps", False))
    console_backlog = kwargs.pop("console_backlog", None)
    stderr_tail = kwargs.pop("stderr_tail", None)
    watch_stderr = watch_stderr_setting(kwargs.pop("watch_stderr", None))
    kill_on_bad_exit = kwargs.pop("kill_on_bad_exit", True)
    subreaper = kwargs.pop("subreaper", False)
    for keyword, value in (("kill_on_bad_exit", kill_on_bad_exit), ("subreaper", subreaper)):
        if not isinstance(value, bool):
            raise TypeError(f"{keyword} must be True or False, got {value!r}")
    # Checked before anything starts (the env vars too).
    backlog = _console.backlog_bound(console_backlog)
    tail_lines = stderr_tail_bound(stderr_tail)
    legacy = "log_dir" in kwargs or isinstance(logs_specs, (str, bytes, os.PathLike))
    if legacy:
        names: tuple[str, ...] = ("start_method", "redirects", "tee")
        defaults: dict[str, Any] = {"start_method": "spawn", "redirects": Std.NONE, "tee": Std.NONE}
    else:
        names = (
            "log_line_prefixes", "start_method", "numa_options",
            "duplicate_stdout_filters", "duplicate_stderr_filters",
        )
        defaults = {
            "log_line_prefixes": None, "start_method": "spawn", "numa_options": None,
            "duplicate_stdout_filters": None, "duplicate_stderr_filters": None,
        }
    if len(positional) > len(names):
        raise TypeError(f"start_processes() takes at most {5 + len(names)} positional arguments")
    options = dict(defaults)
    for key, value in zip(names, positional, strict=False):
        options[key] = value
    if "log_dir" in kwargs:
        if logs_specs is not None:
            raise TypeError("start_processes() got both a fifth positional argument and log_dir=")
        logs_specs = kwargs.pop("log_dir")
    for key, value in kwargs.items():
        if key not in options:
            raise TypeError(f"start_processes() got an unexpected keyword argument {key!r}")
        if key in dict(zip(names, positional, strict=False)):
            raise TypeError(f"start_processes() got multiple values for argument {key!r}")
        options[key] = value

    # name, args and envs are checked by the context's constructor, before
    # anything starts; the subreaper needs them first (its marker goes into
    # every rank's env, and no bad input may leave this process a subreaper).
    subreaper_id = None
    if subreaper:
        _core.check_exit_statuses_collectable()
        name = check_name(name)
        args = normalize_args(args)
        envs = normalize_envs(envs, len(args))
        _escapees.make_subreaper()  # OSError (ENOSYS) before anything starts
        subreaper_id = uuid.uuid4().hex
        envs = {rank: {**env, _escapees.MARKER_VAR: subreaper_id} for rank, env in envs.items()}
    start_method = options["start_method"]
    if not callable(entrypoint) and not isinstance(entrypoint, str):
        raise TypeError(f"entrypoint must be a callable or a str, got {type(entrypoint).__name__}")
    if callable(entrypoint) and start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}")

    if legacy:
        if logs_specs is None:
            raise TypeError("start_processes() needs log_dir")
        spec_obj: Any = LegacyLogsSpecs(
            as_log_dir(logs_specs), redirects=options["redirects"], tee=options["tee"])
        spec_obj.validate()
        extra: dict[str, Any] = {}
    else:
        if logs_specs is None:
            raise TypeError(
                "start_processes() needs logs_specs (torch 2.x form) or log_dir (torch 1.9 form)")
        if not callable(getattr(logs_specs, "reify", None)):
            raise TypeError(f"logs_specs must have a reify(envs) method, got {type(logs_specs).__name__}")
        spec_obj = logs_specs
        extra = {
            "log_line_prefixes": options["log_line_prefixes"],
            "numa_options": options["numa_options"],
            "duplicate_stdout_filters": options["duplicate_stdout_filters"],
            "duplicate_stderr_filters": options["duplicate_stderr_filters"],
        }

    context: _NativeContext
    rank_envs: Any = envs  # None too: the constructor gives each rank an empty env then
    if isinstance(entrypoint, str):
        context = SubprocessContext(name, entrypoint, args, rank_envs, spec_obj, **extra, **placement)
    else:
        context = MultiprocessContext(
            name, entrypoint, args, rank_envs, start_method=start_method, logs_specs=spec_obj, **extra, **placement)
    if timestamps:
        context.log_line_timestamps = True
    if console_backlog is not None:
        context.console_backlog = backlog
    context.stderr_tail = tail_lines
    context.watch_stderr = watch_stderr
    context.kill_on_bad_exit = kill_on_bad_exit
    context.subreaper_id = subreaper_id
    try:
        context.start()
    except BaseException as e:
        # The caller never gets the context: nothing it started may outlive
        # this call.  The workers get the signal that interrupted the launch
        # (SIGTERM after an error) and close()'s usual grace.
        close_despite_interrupts(context, interrupt_signal(e), SHUTDOWN_GRACE_SECONDS)
        raise
    return context
