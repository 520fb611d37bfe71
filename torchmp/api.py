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

import abc
import atexit
import contextlib
import errno
import logging
import os
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from torchmp import _console, _core, _oom
from torchmp.errors import ProcessFailure
from torchmp.logs_specs import (
    DefaultLogsSpecs,
    LegacyLogsSpecs,
    LogsDest,
    LogsSpecs,
    RankMappingError,
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

# torch's private name, which its tests import.
_validate_full_rank = validate_full_rank

# How long close() waits for a SIGKILLed worker before abandoning it: a worker
# in uninterruptible sleep (D state, e.g. wedged on a device) cannot be reaped,
# and the launcher must not hang on it.
KILL_GRACE_SECONDS = 5.0

_LOG_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)


class SignalException(Exception):
    """Raised in the launcher when it receives one of the handled signals
    (``TORCHELASTIC_SIGNALS_TO_HANDLE``, default SIGTERM, SIGINT, SIGHUP,
    SIGQUIT).  Catch it, ``close(e.sigval)`` the context, and exit."""

    def __init__(self, msg: str, sigval: signal.Signals) -> None:
        super().__init__(msg)
        self.sigval = sigval


def _terminate_process_handler(signum: int, frame: FrameType | None) -> None:
    sigval = signal.Signals(signum)
    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)


def close_despite_interrupts(ctx: PContext, death_sig: signal.Signals, timeout: float) -> None:
    """``ctx.close(death_sig, timeout)``, finished whatever lands meanwhile.

    A signal turned into an exception (or Ctrl-C) during the grace period
    would otherwise unwind out of ``close`` and leave the workers running.
    Instead it cuts the grace short: SIGKILL at once, as ``torchmp run`` does
    on a second signal.  Each retry is started by one more signal, so this
    ends."""
    while True:
        try:
            ctx.close(death_sig, timeout)  # type: ignore[arg-type]
            return
        except (SignalException, KeyboardInterrupt):
            death_sig, timeout = signal.SIGKILL, 0


def _interrupt_signal(exc: BaseException) -> signal.Signals:
    """The signal behind an exception that stopped a launch (SIGTERM if none)."""
    if isinstance(exc, SignalException):
        return exc.sigval
    if isinstance(exc, KeyboardInterrupt):
        return signal.SIGINT
    return signal.SIGTERM


def handled_signals() -> list[signal.Signals]:
    """The signals named in TORCHELASTIC_SIGNALS_TO_HANDLE (default SIGTERM,
    SIGINT, SIGHUP, SIGQUIT); unknown names are logged and skipped."""
    names = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    found = []
    for name in names.split(","):
        name = name.strip()
        if not name:
            continue
        sig = getattr(signal, name, None)
        if not isinstance(sig, signal.Signals):
            logger.warning("Failed to register signal handler for %s: no such signal", name)
            continue
        found.append(sig)
    return found


# torch's names, looked up through this module at call time (torch's tests
# replace them to watch what start() does).
IS_WINDOWS = sys.platform == "win32"
_WINDOWS_UNSUPPORTED = ("SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")


def _install_signal_handlers() -> None:
    """Turn TORCHELASTIC_SIGNALS_TO_HANDLE into SignalException, with torch's
    log lines; only the main thread can install handlers."""
    if threading.current_thread() is not threading.main_thread():
        logger.warning(
            "Failed to register signal handlers since torchelastic is running on a child thread. "
            "This could lead to orphaned worker processes if the torchrun is terminated."
        )
        return
    names = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    for sig_name in names.split(","):
        sig_name = sig_name.strip()
        if not sig_name:
            continue
        try:
            signal.signal(getattr(signal, sig_name), _terminate_process_handler)
            logger.info("Registered signal handler for %s", sig_name)
        except (AttributeError, ValueError, OSError) as e:
            logger.warning("Failed to register signal handler for %s: %s", sig_name, e)
        except RuntimeError as e:
            if IS_WINDOWS and sig_name in _WINDOWS_UNSUPPORTED:
                logger.info("Signal %s is not supported on Windows, skipping", sig_name)
            else:
                logger.warning("Failed to register signal handler for %s: %s", sig_name, e)


@dataclass(frozen=True)
class ResourceUsage:
    """What one rank cost, measured by the launcher when it reaped the rank.

    ``wall_time``, ``user_time`` and ``system_time`` are seconds; ``max_rss``
    is bytes (the peak resident set of the worker or of its largest waited-for
    descendant, as ``getrusage`` reports it).
    """

    pid: int
    exitcode: int
    wall_time: float
    user_time: float
    system_time: float
    max_rss: int


@dataclass
class RunProcsResult:
    """Results of a completed run, all mapped by local rank.

    ``return_values`` holds function return values (``None`` for each rank of
    a binary launch that succeeded), ``failures`` the failed ranks,
    ``stdouts``/``stderrs`` the log file paths (empty string: not redirected)
    and, beyond torch, ``resources`` each reaped rank's :class:`ResourceUsage`.
    """

    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, ProcessFailure] = field(default_factory=dict)
    stdouts: dict[int, str] = field(default_factory=dict)
    stderrs: dict[int, str] = field(default_factory=dict)
    resources: dict[int, ResourceUsage] = field(default_factory=dict)

    def is_failed(self) -> bool:
        return len(self.failures) > 0


class TeeTail:
    """One teed stream of one rank, in the place of torch's ``TailLog``
    threads (``PContext._tail_logs``): torchmp's I/O thread does the
    teeing, so there is nothing to start or stop; ``stopped()`` says whether
    the stream has been drained to its end and closed."""

    def __init__(self, context: PContext, rank: int, which: int) -> None:
        self.context = context
        self.rank = rank
        self.which = which  # 0 stdout, 1 stderr
        self._started = False

    def start(self) -> TeeTail:
        self._started = True
        return self

    def stop(self) -> None:
        """Nothing to stop: the stream ends with the worker (close() drains it)."""

    def stopped(self) -> bool:
        return self._started and self.context._stream_done(self.rank, self.which)

    def __repr__(self) -> str:
        what = ("stdout", "stderr")[self.which]
        return f"<TeeTail {self.context.name} rank {self.rank} {what} stopped={self.stopped()}>"


class PContext(abc.ABC):
    """Base class of a set of launched workers (torch's ``PContext``).

    Subclasses implement ``_start``, ``_poll``, ``pids`` and ``_close``.  The
    base ``wait`` polls ``_poll`` every ``period`` seconds, exactly as torch
    does, so user subclasses and mocks keep working; torchmp's own contexts
    override it with an event-driven wait.
    """

    def __init__(
        self,
        name: str,
        entrypoint: Callable[..., Any] | str,
        args: dict[int, tuple[Any, ...]],
        envs: dict[int, dict[str, str]],
        logs_specs: LogsSpecs,
        log_line_prefixes: dict[int, str] | None = None,
        duplicate_stdout_filters: list[str] | None = None,
        duplicate_stderr_filters: list[str] | None = None,
    ) -> None:
        self.name = name
        nprocs = len(args)
        logs_dest = logs_specs.reify(envs)
        validate_full_rank(logs_dest.stdouts, nprocs, "stdouts")
        validate_full_rank(logs_dest.stderrs, nprocs, "stderrs")
        self.entrypoint = entrypoint
        self.args = args
        self.envs = envs
        self.stdouts = logs_dest.stdouts
        self.stderrs = logs_dest.stderrs
        self.error_files = logs_dest.error_files
        self.nprocs = nprocs
        self.log_line_prefixes = log_line_prefixes
        self.duplicate_stdout_filters = duplicate_stdout_filters
        self.duplicate_stderr_filters = duplicate_stderr_filters
        self._logs_dest = logs_dest
        # torch's tailers, one per teed stream of each rank (see TeeTail).
        self._tail_logs: list[TeeTail] = [
            TeeTail(self, rank, which)
            for which, tees in enumerate((logs_dest.tee_stdouts, logs_dest.tee_stderrs))
            for rank in sorted(tees)
        ]

    def start(self) -> None:
        """Start the workers; on the main thread, first install the handlers
        that turn the termination signals into :class:`SignalException`."""
        # A spawn/forkserver worker re-importing a main module that has no
        # __main__ guard must not start a nested job (nor install handlers).
        from torchmp._worker import refuse_nested_launch

        refuse_nested_launch()
        _install_signal_handlers()
        self._start()
        for tail in self._tail_logs:
            tail.start()

    def _stream_done(self, rank: int, which: int) -> bool:
        """Whether the teed stream ``which`` (0 stdout, 1 stderr) of ``rank``
        has reached its end and every byte of it was written out.  Contexts
        that tee override this; the base has nothing teed to wait for."""
        return True

    @abc.abstractmethod
    def _start(self) -> None:
        raise NotImplementedError

    @abc.abstractmethod
    def _poll(self) -> RunProcsResult | None:
        """All-or-nothing: a result once every rank succeeded or any failed."""
        raise NotImplementedError

    def wait(self, timeout: float = -1, period: float = 1) -> RunProcsResult | None:
        """Wait up to ``timeout`` seconds (negative: forever, 0: just poll)
        for a result; ``None`` if the workers are still running."""
        if timeout == 0:
            return self._poll()
        deadline = None if timeout < 0 else time.monotonic() + timeout
        while True:
            result = self._poll()
            if result is not None:
                return result
            if deadline is not None and time.monotonic() >= deadline:
                return None
            nap = period if deadline is None else min(period, max(0.0, deadline - time.monotonic()))
            time.sleep(nap)

    @abc.abstractmethod
    def pids(self) -> dict[int, int]:
        raise NotImplementedError

    @abc.abstractmethod
    def _close(self, death_sig: signal.Signals, timeout: int = 30) -> None:
        raise NotImplementedError

    def close(self, death_sig: signal.Signals | None = None, timeout: int = 30) -> None:
        """Terminate every worker: ``death_sig`` (default SIGTERM) to each
        worker's process group, SIGKILL to what is left after ``timeout``
        seconds.  Idempotent."""
        if not death_sig:
            death_sig = signal.SIGTERM
        self._close(death_sig=death_sig, timeout=timeout)

    def __enter__(self) -> PContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------
# Input checks shared by every launch path: all of them run before any
# directory is created or any process started.


def _check_name(name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    return name


def _encode_env_item(rank: int, key: object, value: object) -> tuple[bytes, bytes]:
    if isinstance(key, str):
        kb = os.fsencode(key)
    elif isinstance(key, bytes):
        kb = key
    else:
        raise ValueError(f"envs[{rank}]: environment variable names must be str, got {key!r}")
    if not kb or b"=" in kb or b"\0" in kb:
        raise ValueError(
            f"envs[{rank}]: invalid environment variable name {key!r} "
            "(it must be non-empty and contain neither '=' nor NUL)"
        )
    if isinstance(value, bytes):
        vb = value
    else:
        try:
            text = value if isinstance(value, str) else str(value)
        except Exception as e:
            raise ValueError(f"envs[{rank}][{key!r}]: value cannot be converted to str: {e}") from e
        vb = os.fsencode(text)
    if b"\0" in vb:
        raise ValueError(f"envs[{rank}][{key!r}]: value contains a NUL byte")
    return kb, vb


def _normalize_args(args: object, what: str = "args") -> dict[int, tuple[Any, ...]]:
    if not isinstance(args, Mapping):
        raise RankMappingError(f"{what} must be a dict keyed by local rank, got {type(args).__name__}")
    validate_full_rank(args, len(args), what)
    out: dict[int, tuple[Any, ...]] = {}
    for rank in range(len(args)):
        value = args[rank]
        if isinstance(value, (str, bytes)):
            value = (value,)  # one argument, not a sequence of characters
        elif value is None:
            value = ()
        else:
            try:
                value = tuple(value)
            except TypeError:
                raise ValueError(f"{what}[{rank}] must be a tuple of arguments, got {value!r}") from None
        out[rank] = value
    return out


def _normalize_envs(envs: object, nprocs: int) -> dict[int, dict[str, str]]:
    if envs is None:
        return {rank: {} for rank in range(nprocs)}
    if not isinstance(envs, Mapping):
        raise RankMappingError(f"envs must be a dict keyed by local rank, got {type(envs).__name__}")
    validate_full_rank(envs, nprocs, "envs")
    for rank in range(nprocs):
        env = envs[rank]
        if not isinstance(env, Mapping):
            raise ValueError(f"envs[{rank}] must be a dict of environment variables, got {type(env).__name__}")
        for key, value in env.items():
            _encode_env_item(rank, key, value)
    return envs  # type: ignore[return-value]  # validated; reify mutates it like torch


def _check_prefixes(prefixes: object, nprocs: int) -> dict[int, str] | None:
    if prefixes is None:
        return None
    if not isinstance(prefixes, Mapping):
        raise TypeError(f"log_line_prefixes must be a dict of rank -> str, got {type(prefixes).__name__}")
    for rank, prefix in prefixes.items():
        if not isinstance(rank, int) or not 0 <= rank < nprocs:
            raise ValueError(f"log_line_prefixes: {rank!r} is not a local rank in 0..{nprocs - 1}")
        if not isinstance(prefix, str):
            raise TypeError(f"log_line_prefixes[{rank}] must be a str, got {type(prefix).__name__}")
    return dict(prefixes)


def _check_filters(filters: object, what: str) -> list[str] | None:
    if filters is None:
        return None
    if isinstance(filters, str) or not all(isinstance(f, str) for f in filters):  # type: ignore[attr-defined]
        raise TypeError(f"{what} must be a list of str, got {filters!r}")
    return list(filters)  # type: ignore[call-overload, no-any-return]


def _exec_search_path(env: Mapping[str, Any]) -> list[bytes]:
    path = env.get("PATH")
    if path is None:
        path_b = os.environb.get(b"PATH", os.defpath.encode())
    else:
        path_b = os.fsencode(str(path))
    return path_b.split(b":")


def resolve_executable(entrypoint: str, env: Mapping[str, Any] | None = None) -> bytes:
    """Find ``entrypoint`` the way a shell's execvp would, without a shell.

    A name with a slash is used as given; otherwise each ``PATH`` entry (the
    worker's ``PATH`` if ``env`` sets one) is tried in order.  Raises
    ``FileNotFoundError`` if nothing matches and ``PermissionError`` if the
    only matches cannot be executed.
    """
    name = os.fsencode(entrypoint)
    if not name:
        raise FileNotFoundError(errno.ENOENT, "empty command", entrypoint)
    if b"\0" in name:
        raise ValueError(f"entrypoint contains a NUL byte: {entrypoint!r}")
    if b"/" in name:
        candidates = [name]
    else:
        candidates = [os.path.join(d or b".", name) for d in _exec_search_path(env or {})]
    denied: bytes | None = None
    for candidate in candidates:
        try:
            st = os.stat(candidate)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) or not os.access(candidate, os.X_OK):
            denied = denied or candidate
            continue
        return candidate
    if denied is not None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(denied))
    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), entrypoint)


def _open_log(path: str) -> int:
    """Open a log file for a worker: truncate, never through a symlink
    planted in the log directory, never block on a FIFO planted there, mode
    from the umask.  Character devices (/dev/null) are fine."""
    try:
        fd = os.open(path, _LOG_FLAGS | os.O_NONBLOCK, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OSError(e.errno, f"refusing to follow a symlink for a log file: {path}", path) from None
        if e.errno == errno.ENXIO:
            raise OSError(e.errno, f"refusing a FIFO as a log file: {path}", path) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISCHR(mode)):
            raise OSError(errno.EINVAL, f"a log file must be a regular file or a device: {path}", path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _exitcode(wait_status: int) -> int:
    if os.WIFSIGNALED(wait_status):
        return -os.WTERMSIG(wait_status)
    if os.WIFEXITED(wait_status):
        return os.WEXITSTATUS(wait_status)
    return 255


# ---------------------------------------------------------------------------
# The native contexts.


_NO_STREAM = (_core.STREAM_INHERIT, -1, -1, None)
_CAPTURE = (_core.STREAM_CAPTURE, -1, -1, None)


@dataclass
class _ExecPlan:
    """One rank of an exec launch, ready for the native core (but its fds)."""

    path: bytes
    argv: list[bytes]
    envp: list[bytes]
    capture_return: bool = False
    payload_fd: int = -1


def _launcher_environ() -> dict[bytes, bytes]:
    """The launcher's environment as ready envp entries (b"K=V"), by name."""
    data = getattr(os.environb, "_data", None)
    # os.environb's own dict, read at C speed; iterating the mapping costs a
    # Python-level call per variable.
    items = data.items() if isinstance(data, dict) else os.environb.items()
    return {k: k + b"=" + v for k, v in items}


def _exec_env(rank: int, overrides: Mapping[Any, Any], base: dict[bytes, bytes] | None = None) -> list[bytes]:
    """The launcher's environment (or base, a _launcher_environ() snapshot
    taken once per launch) with envs[rank] on top, as envp entries."""
    entries = _launcher_environ() if base is None else dict(base)
    for key, value in overrides.items():
        kb, vb = _encode_env_item(rank, key, value)
        entries[kb] = kb + b"=" + vb
    return list(entries.values())


# A failed rank's report carries the last lines of its stderr: this many by
# default, and at most TAIL_BYTES_PER_LINE bytes per line kept in memory.
DEFAULT_STDERR_TAIL_LINES = 20
TAIL_BYTES_PER_LINE = 400


def stderr_tail_bound(value: object = None) -> int:
    """The number of stderr lines a failure report keeps: ``value``, else
    ``$TORCHMP_STDERR_TAIL``, else 20.  Raises ValueError for anything but a
    non-negative int (checked before anything starts)."""
    source = "stderr_tail"
    if value is None:
        env = os.environ.get("TORCHMP_STDERR_TAIL")
        if env is None or env.strip() == "":
            return DEFAULT_STDERR_TAIL_LINES
        source, value = "TORCHMP_STDERR_TAIL", env.strip()
        try:
            value = int(value)
        except ValueError:
            raise ValueError(f"{source} must be a number of lines, got {env!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{source} must be a non-negative number of lines, got {value!r}")
    return value


def _watch_stderr_setting(value: object) -> bool:
    """watch_stderr=, else $TORCHMP_WATCH_STDERR (1/0, true/false, yes/no):
    how a launcher that cannot pass keywords (the torchrun plug-in) opts in."""
    if value is not None:
        return bool(value)
    env = os.environ.get("TORCHMP_WATCH_STDERR", "").strip().lower()
    if env in ("", "0", "false", "no", "off"):
        return False
    if env in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"TORCHMP_WATCH_STDERR must be 1 or 0 (true/false, yes/no), got {env!r}")


def _last_lines(data: bytes, lines: int, truncated: bool) -> str:
    """The last ``lines`` lines of data as text; a first line cut by the
    byte bound (truncated) is dropped."""
    if truncated:
        cut = data.find(b"\n")
        data = data[cut + 1:] if cut >= 0 else b""
    text = data.decode("utf-8", errors="replace").replace("\r\n", "\n")
    kept = text.rstrip("\n").split("\n")[-lines:] if lines else []
    return "\n".join(line.rsplit("\r", 1)[-1] for line in kept).strip("\n")


def _file_tail(path: str, nbytes: int) -> tuple[bytes, bool]:
    """The last nbytes of a file, and whether there was more before them."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK)
    except OSError:
        return b"", False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return b"", False
        size = os.lseek(fd, 0, os.SEEK_END)
        start = max(0, size - nbytes)
        return os.pread(fd, size - start, start), start > 0
    except OSError:
        return b"", False
    finally:
        os.close(fd)


class _NativeContext(PContext):
    """A PContext whose workers the native I/O thread starts, watches and
    reaps.  Subclasses only say how each rank is started (``_launch``)."""

    # torchmp extension: a UTC time after the prefix of every teed console line.
    log_line_timestamps: bool = False
    # torchmp extension: the console backlog bound per teed stream, bytes
    # (None: TORCHMP_CONSOLE_BACKLOG, else the default; see _console).
    console_backlog: int | None = None
    # How long siblings get after SIGTERM when a rank fails, before SIGKILL
    # (torch's fixed 30 s by default).
    fail_fast_timeout: float = 30
    # torchmp extension: how many of its last stderr lines a failed rank's
    # report carries (0: none; see stderr_tail_bound).
    stderr_tail: int = DEFAULT_STDERR_TAIL_LINES
    # torchmp extension: pass a stderr that is neither teed nor redirected
    # through the I/O thread too (unprefixed), so failures get its tail.
    watch_stderr: bool = False

    def __init__(
        self,
        name: str,
        entrypoint: Callable[..., Any] | str,
        args: dict[int, tuple[Any, ...]],
        envs: dict[int, dict[str, str]],
        logs_specs: LogsSpecs,
        log_line_prefixes: dict[int, str] | None = None,
        numa_options: Any = None,
        duplicate_stdout_filters: list[str] | None = None,
        duplicate_stderr_filters: list[str] | None = None,
    ) -> None:
        # Every check runs before reify() creates any directory.
        name = _check_name(name)
        if numa_options is not None:
            raise NotImplementedError("numa_options is not supported by torchmp; pass None")
        args = _normalize_args(args)
        envs = _normalize_envs(envs, len(args))
        log_line_prefixes = _check_prefixes(log_line_prefixes, len(args))
        duplicate_stdout_filters = _check_filters(duplicate_stdout_filters, "duplicate_stdout_filters")
        duplicate_stderr_filters = _check_filters(duplicate_stderr_filters, "duplicate_stderr_filters")
        self._check_entrypoint(entrypoint, args, envs)
        super().__init__(
            name, entrypoint, args, envs, logs_specs, log_line_prefixes,
            duplicate_stdout_filters, duplicate_stderr_filters,
        )
        self._group: Any = None
        self._result: RunProcsResult | None = None
        self._closed = False
        # close() from any thread or signal handler, any number at once: one
        # runs, the others wait for it.  Re-entrant, for a handler that
        # closes the context while its own thread is inside close().
        self._close_lock = threading.RLock()
        self._terminated_by_launcher: set[int] = set()
        self._abandoned: set[int] = set()
        # The last snapshot, kept once close() has released the native group.
        self._final: tuple[int, list[tuple[Any, ...]]] | None = None
        self._forwarder: _console.Forwarder | None = None
        # Failed ranks' stderr tails, taken from the native group before it
        # is released: (bytes, whether the bound cut older bytes).
        self._tails: dict[int, tuple[bytes, bool]] = {}
        # The OOM killer's count at start, to name its kills (None: unknown).
        self._oom_watch: _oom.OomWatch | None = None

    # -- what and how to start (subclass) -----------------------------------
    @abc.abstractmethod
    def _check_entrypoint(self, entrypoint: Any, args: dict[int, tuple[Any, ...]],
                          envs: dict[int, dict[str, str]]) -> None:
        """Reject an entrypoint or args this context cannot start."""
        raise NotImplementedError

    @abc.abstractmethod
    def _launch(self, group: Any, streams: list[tuple[tuple[Any, ...], tuple[Any, ...]]]) -> None:
        """Start every rank in ``group``; ``streams[rank]`` is its (stdout,
        stderr) plan for the native core."""
        raise NotImplementedError

    def _spawn(self, group: Any, streams: list[tuple[tuple[Any, ...], tuple[Any, ...]]],
               plans: list[_ExecPlan]) -> None:
        """Exec-launch every rank from the I/O thread.  If rank k cannot be
        started, ranks < k are killed and reaped and the OSError raised."""
        specs = [
            (plan.path, plan.argv, plan.envp, out, err, _CAPTURE if plan.capture_return else _NO_STREAM,
             plan.payload_fd)
            for plan, (out, err) in zip(plans, streams)
        ]
        try:
            group.spawn(specs)
        except _core.SpawnError as e:
            logger.error("failed to start local rank %s of %s: %s", e.rank, self.name, e)
            self._close(signal.SIGKILL, timeout=KILL_GRACE_SECONDS)
            raise e.cause from None

    def _return_values(self, exited_ok: list[int]) -> dict[int, Any]:
        return dict.fromkeys(range(self.nprocs))

    def _before_release(self, group: Any) -> None:
        """Last chance to take what the native group holds (return values)."""

    def _clean_exit_problem(self, rank: int) -> str | None:
        """Why a rank that exited with code 0 still failed, if it did."""
        return None

    def _lost_status_reason(self, rank: int) -> str:
        return ("its exit status was lost: another part of this process reaped it "
                "(a waitpid(-1) or SIGCHLD handler outside torchmp)")

    # -- start ------------------------------------------------------------
    def _prefix(self, rank: int) -> bytes:
        if self.log_line_prefixes and rank in self.log_line_prefixes:
            text = self.log_line_prefixes[rank]
        else:
            text = f"[{self.name}{rank}]:"
        return os.fsencode(text)

    def _stream_spec(self, rank: int, which: int, opened: list[int], consoles: list[Any],
                     backlog: int) -> tuple[Any, ...]:
        paths = self.stdouts if which == 0 else self.stderrs
        tees = self._logs_dest.tee_stdouts if which == 0 else self._logs_dest.tee_stderrs
        path = paths.get(rank, "")
        # One byte over the bound: tells whether older bytes were cut.
        tail = self.stderr_tail * TAIL_BYTES_PER_LINE + 1 if which == 1 and self.stderr_tail else 0
        console = consoles[which]
        sink = console.queue if isinstance(console, _console.ObjectConsole) else console
        if not path:
            if which == 1 and self.watch_stderr and tail:
                # Shown as it was (no prefix), but through a pipe: the tail
                # is kept as it passes.
                return (_core.STREAM_TEE, -1, sink, b"", False, None, backlog, tail)
            return (_core.STREAM_INHERIT, -1, -1, None)
        fd = _open_log(path)
        opened.append(fd)
        if rank in tees:
            return (_core.STREAM_TEE, fd, sink, self._prefix(rank), self.log_line_timestamps,
                    os.fsencode(os.path.abspath(path)), backlog, tail)
        return (_core.STREAM_FILE, fd, -1, None)

    # Launcher fds per rank beyond its streams: the pidfd, plus what a
    # subclass adds (return channel, spawn payload).
    _fds_per_rank = 1

    def _fds_needed(self) -> int:
        """The most fds this context holds at once while starting: per stream
        with a file, the file as opened here and (if teed) the loop's pipe
        end and its own copy of the file; per rank _fds_per_rank; a few in
        flight per spawn; some slack."""
        needed = 16
        for paths, tees in ((self.stdouts, self._logs_dest.tee_stdouts),
                            (self.stderrs, self._logs_dest.tee_stderrs)):
            for rank in range(self.nprocs):
                if paths.get(rank):
                    needed += 3 if rank in tees else 1
        return needed + self._fds_per_rank * self.nprocs

    def _ensure_fd_budget(self) -> None:
        """Raise the soft RLIMIT_NOFILE if this context needs it, or fail
        with a clear error before anything starts (a launch that runs out of
        fds half-way would have to tear down what it started)."""
        try:
            import resource

            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            in_use = len(os.listdir("/proc/self/fd"))
        except (ImportError, OSError):
            return
        needed = in_use + self._fds_needed()
        if soft == resource.RLIM_INFINITY or needed <= soft:
            return
        if hard == resource.RLIM_INFINITY or needed <= hard:
            new_soft = needed if hard == resource.RLIM_INFINITY else min(hard, max(needed, 2 * soft))
            resource.setrlimit(resource.RLIMIT_NOFILE, (new_soft, hard))
            logger.info("raised the soft RLIMIT_NOFILE from %s to %s for %s ranks", soft, new_soft, self.nprocs)
            return
        raise OSError(
            errno.EMFILE,
            f"starting {self.nprocs} ranks needs about {needed} open files but RLIMIT_NOFILE is "
            f"{soft} (hard {hard}); raise it (ulimit -n) or tee fewer streams")

    def _start(self) -> None:
        if self._group is not None:
            raise ValueError("The workers are already started. Most likely start() got called twice.")
        # Before anything is opened: a closed fd 1 or 2 must not become a log.
        _console.claim_std_fds()
        backlog = _console.backlog_bound(self.console_backlog)
        self._ensure_fd_budget()
        # The OOM killer's count before any rank runs: a later SIGKILL that
        # torchmp did not send is checked against it.
        self._oom_watch = _oom.start_watch()
        consoles: list[Any] = [-1, -1]
        if self._logs_dest.tee_stdouts:
            consoles[0] = _console.console_for(0)
        if self._logs_dest.tee_stderrs or (self.watch_stderr and self.stderr_tail):
            consoles[1] = _console.console_for(1)
        objects = [c for c in consoles if isinstance(c, _console.ObjectConsole)]
        opened: list[int] = []
        try:
            filtered: list[tuple[list[bytes] | None, int]] = []
            for filters, path in (
                (self.duplicate_stdout_filters, self._logs_dest.filtered_stdout),
                (self.duplicate_stderr_filters, self._logs_dest.filtered_stderr),
            ):
                if filters:
                    fd = _open_log(path)
                    opened.append(fd)
                    filtered.append(([os.fsencode(f) for f in filters], fd))
                else:
                    filtered.append((None, -1))
            streams = [
                (self._stream_spec(rank, 0, opened, consoles, backlog),
                 self._stream_spec(rank, 1, opened, consoles, backlog))
                for rank in range(self.nprocs)
            ]
            if objects:
                self._forwarder = _console.Forwarder(objects)
                _console.track(self._forwarder)
            self._group = _core.Group(self.nprocs, filtered[0][0], filtered[0][1], filtered[1][0], filtered[1][1])
            _live_contexts.add(self)
            self._launch(self._group, streams)
        finally:
            for fd in opened:
                os.close(fd)

    # -- observe ----------------------------------------------------------
    def _snapshot(self) -> tuple[int, list[tuple[Any, ...]]]:
        if self._final is None:
            try:
                return self._group.snapshot()  # type: ignore[no-any-return]
            except ValueError:
                pass  # released by a close() in another thread: _final is set
        assert self._final is not None
        return self._final

    def pids(self) -> dict[int, int]:
        if self._group is None:
            return {}
        _, ranks = self._snapshot()
        return {rank: info[1] for rank, info in enumerate(ranks) if info[0] != _core.PROC_UNSTARTED}

    def _decided(self, ranks: list[tuple[Any, ...]]) -> bool:
        exited = [info for info in ranks if info[0] == _core.PROC_EXITED]
        return len(exited) == self.nprocs or any(_exitcode(info[2]) != 0 for info in exited)

    def _poll(self) -> RunProcsResult | None:
        if self._result is not None:
            return self._result
        if self._group is None:
            raise RuntimeError("wait()/poll before start()")
        _, ranks = self._snapshot()
        if not self._decided(ranks) and not self._closed:
            return None
        return self._finish()

    def _finish(self) -> RunProcsResult:
        """The result, once decided: close (fail-fast), collect, settle."""
        # Fail-fast: the first failure terminates the siblings, whose exits
        # are recorded too but are never the root cause.
        self.close(timeout=self.fail_fast_timeout)  # type: ignore[arg-type]
        ranks = self._snapshot()[1] if self._group is not None else []
        self._result = self._build_result(ranks)
        # Every line is in the log files now.  The consoles: all of it for
        # an object console; a live fd console is followed until it caught
        # up, a stalled one is not waited for.
        if self._forwarder is not None:
            self._forwarder.finish()
        _console.settle(_console.RESULT_STALL)
        return self._result

    def _build_result(self, ranks: list[tuple[Any, ...]]) -> RunProcsResult:
        failures: dict[int, ProcessFailure] = {}
        resources: dict[int, ResourceUsage] = {}
        exited_ok: list[int] = []
        for rank, info in enumerate(ranks):
            (state, pid, status, start_ns, exit_ns, exit_real_ns, utime, stime, maxrss, out_err, err_err,
             status_lost) = info
            if state == _core.PROC_RUNNING and rank in self._abandoned:
                failures[rank] = ProcessFailure(
                    local_rank=rank, pid=pid, exitcode=-signal.SIGKILL,
                    error_file=self.error_files.get(rank, ""),
                    timestamp_ns=time.time_ns(), terminated_by_launcher=True)
                why = (f"did not exit {KILL_GRACE_SECONDS:.1f}s after SIGKILL and was abandoned "
                       "(uninterruptible sleep?)")
                if failures[rank].error_file_data.get("message") in (None, "<NONE>"):
                    failures[rank].message = why
                continue
            if state != _core.PROC_EXITED:
                continue
            code = _exitcode(status)
            resources[rank] = ResourceUsage(
                pid=pid,
                exitcode=code,
                wall_time=(exit_ns - start_ns) / 1e9,
                user_time=utime / 1e9,
                system_time=stime / 1e9,
                max_rss=maxrss * 1024,
            )
            for what, e in (("stdout", out_err), ("stderr", err_err)):
                if e:
                    logger.error(
                        "writing the %s log of local rank %s failed (%s); output after that point "
                        "is missing from the file", what, rank, os.strerror(e))
            problem = self._clean_exit_problem(rank) if code == 0 else None
            if problem is not None:
                failures[rank] = ProcessFailure(
                    local_rank=rank, pid=pid, exitcode=0, error_file=self.error_files.get(rank, ""),
                    timestamp_ns=exit_real_ns)
                if failures[rank].error_file_data.get("message") in (None, "<NONE>"):
                    failures[rank].message = problem
            elif code != 0:
                # A lost status (the forkserver died with its workers) is a
                # failure of its own, whatever close() sent meanwhile.
                killed = rank in self._terminated_by_launcher and not status_lost
                failures[rank] = ProcessFailure(
                    local_rank=rank,
                    pid=pid,
                    exitcode=code,
                    error_file=self.error_files.get(rank, ""),
                    timestamp_ns=exit_real_ns,
                    terminated_by_launcher=killed,
                    # A rank torchmp killed has nothing to say about the failure.
                    stderr_tail="" if killed else self._stderr_tail(rank),
                    cause=None if killed else self._death_cause(pid, code),
                )
                if status_lost:
                    why = self._lost_status_reason(rank)
                    logger.error("local rank %s (pid %s): %s", rank, pid, why)
                    if failures[rank].error_file_data.get("message") in (None, "<NONE>"):
                        failures[rank].message = why
            else:
                exited_ok.append(rank)
        result = RunProcsResult(
            failures=failures, stdouts=self.stdouts, stderrs=self.stderrs, resources=resources
        )
        if failures:
            first = min(
                failures.values(),
                key=lambda f: (f.terminated_by_launcher, f.precise_timestamp_ns),
            )
            if first.terminated_by_launcher:
                logger.info("%s: every failed rank was terminated by the launcher (close())", self.name)
            else:
                logger.error(
                    "failed (exitcode: %s) local_rank: %s (pid: %s) of %s",
                    first.exitcode, first.local_rank, first.pid, self.entrypoint,
                )
        else:
            result.return_values = self._return_values(exited_ok)
        return result

    def wait(self, timeout: float = -1, period: float = 1) -> RunProcsResult | None:
        """Like torch's ``wait`` but event-driven: it returns as soon as the
        deciding exit is recorded (``period`` is accepted and ignored).  Safe
        while other threads or a signal handler call ``close()``: a wait
        woken by a close returns the result."""
        if timeout == 0 or self._group is None or self._closed:
            return self._poll()
        deadline = None if timeout < 0 else time.monotonic() + timeout
        group = self._group
        while True:
            try:
                # Read before the poll: an exit recorded after it ends the
                # sleep below at once.
                version = group.version()
            except ValueError:  # closed meanwhile
                return self._poll()
            result = self._poll()
            if result is not None:
                return result
            if deadline is None:
                remaining = -1.0
            else:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
            try:
                group.wait(remaining, version)
            except ValueError:
                pass  # closed by another thread or a handler: _poll has the result

    def _wait_for(self, condition: Callable[[list[tuple[Any, ...]]], bool],
                  timeout: float | None) -> list[tuple[Any, ...]]:
        """Wait until condition(per-rank snapshot) holds, up to timeout
        seconds (None: forever; 0 or less: look once); the last snapshot."""
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        while True:
            group = self._group
            if group is None:
                return []
            version, ranks = self._snapshot()
            if condition(ranks) or self._final is not None:
                return ranks
            remaining = -1.0 if deadline is None else deadline - time.monotonic()
            if deadline is not None and remaining <= 0:
                return ranks
            try:
                group.wait(remaining, version)
            except ValueError:
                pass  # released by a close(): the final snapshot is next

    # -- terminate ----------------------------------------------------------
    def _running(self) -> list[int]:
        _, ranks = self._snapshot()
        return [r for r, info in enumerate(ranks) if info[0] == _core.PROC_RUNNING]

    # How often close() looks again at groups whose leader has exited but
    # which still hold other processes (there is no event for a process
    # group emptying): from 2 ms, doubling, to 50 ms.
    _GROUP_POLL_FIRST = 0.002
    _GROUP_POLL_MAX = 0.05

    def _wait_groups(self, group: Any, deadline: float) -> list[int]:
        """Wait until every rank's process group is empty (leaders exited,
        and nothing else left in their groups) or the deadline; returns the
        ranks whose groups are still busy."""
        nap = self._GROUP_POLL_FIRST
        while True:
            version = group.version()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return group.busy()  # type: ignore[no-any-return]
            if self._running():
                group.wait(remaining, version)  # leaders first: their exits are events
                continue
            busy = group.busy()
            if not busy:
                return []
            group.wait(min(nap, remaining), version)
            nap = min(nap * 2, self._GROUP_POLL_MAX)

    def _close(self, death_sig: signal.Signals, timeout: float = 30) -> None:
        with self._close_lock:
            if self._group is None or self._closed:
                return
            try:
                self._close_group(self._group, death_sig, timeout)
            except ValueError:
                # A signal handler on this thread closed the context while
                # this close waited: the group is down and released.
                if not self._closed:
                    raise

    def _close_group(self, group: Any, death_sig: signal.Signals, timeout: float) -> None:
        # Workers an interrupted launch started but never got to watch.
        group.adopt_forked()
        _, ranks = group.snapshot()
        pids = {rank: info[1] for rank, info in enumerate(ranks) if info[0] != _core.PROC_UNSTARTED}
        running = [rank for rank, info in enumerate(ranks) if info[0] == _core.PROC_RUNNING]
        self._terminated_by_launcher |= set(running)
        # The grace period is the whole group's: a leader that is a shell
        # (sh -c 'python train.py') exits at once on SIGTERM while its child
        # is still saving a checkpoint.  Groups whose leader exited stay
        # signallable: the leader's zombie pins the group id until reap().
        busy = group.busy()
        signalled = bool(busy)
        if busy:
            for rank in running:
                logger.warning("Sending process %s closing signal %s", pids.get(rank), death_sig.name)
            group.killpg(int(death_sig))
            busy = self._wait_groups(group, time.monotonic() + max(0.0, float(timeout)))
        if busy:
            group.killpg(int(signal.SIGKILL))
            if death_sig != signal.SIGKILL:
                for rank in busy:
                    logger.warning(
                        "Unable to shutdown process %s via %s, forcefully exiting via SIGKILL",
                        pids.get(rank), death_sig.name)
            self._wait_groups(group, time.monotonic() + KILL_GRACE_SECONDS)
            running = self._running()
            for rank in running:
                logger.error(
                    "Process %s (local rank %s) did not exit %.1fs after SIGKILL; abandoning it. "
                    "It may be in uninterruptible sleep (wedged on a device); the I/O thread "
                    "reaps it if it ever exits.", pids.get(rank), rank, KILL_GRACE_SECONDS)
            self._abandoned = set(running)
        # The last signal: whatever joined a group meanwhile.  Not needed if
        # every group was found empty to begin with: only a member can add
        # to a group.  After reap() no group id of this context is signalled
        # again.
        if signalled:
            group.killpg(int(signal.SIGKILL))
        self._release_foreign(group.reap())
        group.finish_streams()
        if self._forwarder is not None:
            self._forwarder.finish()
        # Free the native side now (fds included) rather than whenever the
        # garbage collector gets to this object.
        self._final = group.snapshot()
        self._keep_tails(group, self._final[1])
        self._before_release(group)
        # Closed before the release: an interrupt landing in between must not
        # make a retried close() use a released group.
        self._closed = True
        _live_contexts.discard(self)
        group.release()

    def _release_foreign(self, pids: list[int]) -> None:
        """Workers started by a forkserver: tell it to reap these."""

    def _keep_tails(self, group: Any, ranks: list[tuple[Any, ...]]) -> None:
        if not self.stderr_tail:
            return
        cap = self.stderr_tail * TAIL_BYTES_PER_LINE
        for rank, info in enumerate(ranks):
            if info[0] == _core.PROC_EXITED and info[2] != 0:
                data = group.tail(rank, 1, cap + 1)
                if data:
                    self._tails[rank] = (data[-cap:], len(data) > cap)

    def _death_cause(self, pid: int, exitcode: int) -> str | None:
        """Why a rank died, where the exit status does not say: a SIGKILL
        torchmp did not send is checked against the OOM killer's count."""
        if exitcode != -signal.SIGKILL or self._oom_watch is None:
            return None
        return self._oom_watch.explain(pid)

    def _stderr_tail(self, rank: int) -> str:
        """The last stderr lines of a failed rank: as the I/O thread kept
        them, or read from the end of its redirect file."""
        if not self.stderr_tail:
            return ""
        data, truncated = self._tails.get(rank, (b"", False))
        path = self.stderrs.get(rank, "")
        if not data and path and rank not in self._logs_dest.tee_stderrs:
            data, truncated = _file_tail(path, self.stderr_tail * TAIL_BYTES_PER_LINE)
        return _last_lines(data, self.stderr_tail, truncated)

    def _stream_done(self, rank: int, which: int) -> bool:
        if self._group is None:
            return False
        if self._final is not None:
            return True  # close() drained every stream before the release
        try:
            return not self._group.stream_state()[rank][which]
        except ValueError:
            return self._final is not None

    def output_ages(self) -> dict[int, float | None]:
        """Seconds since each rank last wrote to stdout or stderr, as far as
        torchmp can see: teed streams as the bytes pass, redirected ones by
        their log file's modification time; None where it cannot tell (a
        stream written straight to the launcher's terminal) or before the
        first byte."""
        if self._group is None or self._final is not None:
            return {}
        try:
            state = self._group.stream_state()
        except ValueError:
            return {}
        now_mono = time.monotonic_ns()
        now_real = time.time()
        ages: dict[int, float | None] = {}
        for rank, (_out_open, _err_open, out_ns, err_ns) in enumerate(state):
            age: float | None = None
            last = max(out_ns, err_ns)
            if last:
                age = (now_mono - last) / 1e9
            for paths, tees in ((self.stdouts, self._logs_dest.tee_stdouts),
                                (self.stderrs, self._logs_dest.tee_stderrs)):
                path = paths.get(rank, "")
                if path and rank not in tees:
                    try:
                        st = os.stat(path)
                    except OSError:
                        continue
                    file_age = max(0.0, now_real - st.st_mtime)
                    if st.st_size and (age is None or file_age < age):
                        age = file_age
            ages[rank] = age
        return ages


# Contexts started and not closed yet: closed the normal way (death signal,
# grace period, SIGKILL) if the launcher exits without closing them.  Strong
# references: a context the program dropped still has workers to stop.
_live_contexts: set[_NativeContext] = set()

# The grace period those contexts get at exit, as close()'s default.
EXIT_CLOSE_TIMEOUT = 30.0


def _close_live_contexts_at_exit() -> None:
    for ctx in list(_live_contexts):
        try:
            close_despite_interrupts(ctx, signal.SIGTERM, EXIT_CLOSE_TIMEOUT)
        except Exception as e:  # pragma: no cover - keep closing the others
            logger.error("closing %s at exit failed: %r", ctx.name, e)


atexit.register(_close_live_contexts_at_exit)


class SubprocessContext(_NativeContext):
    """``PContext`` holding worker processes invoked as a binary."""

    def __init__(
        self,
        name: str,
        entrypoint: str,
        args: dict[int, tuple[Any, ...]],
        envs: dict[int, dict[str, str]],
        logs_specs: LogsSpecs,
        log_line_prefixes: dict[int, str] | None = None,
        numa_options: Any = None,
        duplicate_stdout_filters: list[str] | None = None,
        duplicate_stderr_filters: list[str] | None = None,
    ) -> None:
        super().__init__(
            name, entrypoint, args, envs, logs_specs, log_line_prefixes, numa_options,
            duplicate_stdout_filters, duplicate_stderr_filters,
        )

    def _check_entrypoint(self, entrypoint: Any, args: dict[int, tuple[Any, ...]],
                          envs: dict[int, dict[str, str]]) -> None:
        if not isinstance(entrypoint, str):
            raise TypeError(f"SubprocessContext needs a str entrypoint, got {type(entrypoint).__name__}")
        # Resolve now, so a missing binary fails before any directory exists;
        # once per distinct PATH, not once per rank.
        resolved: dict[str | None, bytes] = {}
        self._paths: dict[int, bytes] = {}
        for rank in range(len(args)):
            path_var = envs[rank].get("PATH")
            key = None if path_var is None else str(path_var)
            if key not in resolved:
                resolved[key] = resolve_executable(entrypoint, envs[rank])
            self._paths[rank] = resolved[key]
        for rank, argv in args.items():
            for a in argv:
                has_nul = b"\0" in a if isinstance(a, bytes) else "\0" in str(a)
                if has_nul:
                    raise ValueError(f"args[{rank}]: argument {a!r} contains a NUL byte")

    def _launch(self, group: Any, streams: list[tuple[tuple[Any, ...], tuple[Any, ...]]]) -> None:
        plans = []
        environ = _launcher_environ()
        for rank in range(self.nprocs):
            argv = [os.fsencode(self.entrypoint)]  # type: ignore[arg-type]
            argv += [a if isinstance(a, bytes) else os.fsencode(str(a)) for a in self.args[rank]]
            plans.append(_ExecPlan(self._paths[rank], argv, _exec_env(rank, self.envs[rank], environ)))
        self._spawn(group, streams, plans)


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
    level to the given files ("" for none), ``fn`` run under ``record``, its
    return value put on ``ret_vals[local_rank]``, then a wait on the event.
    torchmp's own workers do not go through this (see torchmp._worker)."""
    from torchmp.errors import record
    from torchmp.redirects import redirect_stderr, redirect_stdout

    if numa_options is not None:
        raise NotImplementedError("numa_options is not supported by torchmp; pass None")
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


def _function_context_class() -> type[PContext]:
    from torchmp._functions import MultiprocessContext as cls

    return cls


def __getattr__(name: str) -> Any:
    # MultiprocessContext lives with the function-launch machinery; expose it
    # here under torch's name without importing that module eagerly.
    if name == "MultiprocessContext":
        return _function_context_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------
# start_processes


_VALID_START_METHODS = ("spawn", "fork", "forkserver")


def start_processes(
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
    teed stream may leave waiting for a console that falls behind (default
    4 MiB, or ``TORCHMP_CONSOLE_BACKLOG``); past it, whole lines are left
    out of the console only, and a marker line says how many;
    ``stderr_tail`` (lines, default 20 or ``TORCHMP_STDERR_TAIL``; 0: off)
    is how much of a failed rank's stderr its :class:`ProcessFailure` keeps
    (``stderr_tail``, and the message when there is no error file);
    ``watch_stderr=True`` routes a stderr that is neither teed nor redirected
    through torchmp too, unchanged on the console, so its tail is kept (the
    worker then writes to a pipe, not a terminal).
    """
    timestamps = bool(kwargs.pop("log_line_timestamps", False))
    console_backlog = kwargs.pop("console_backlog", None)
    stderr_tail = kwargs.pop("stderr_tail", None)
    watch_stderr = _watch_stderr_setting(kwargs.pop("watch_stderr", None))
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
    for key, value in zip(names, positional):
        options[key] = value
    if "log_dir" in kwargs:
        if logs_specs is not None:
            raise TypeError("start_processes() got both a fifth positional argument and log_dir=")
        logs_specs = kwargs.pop("log_dir")
    for key, value in kwargs.items():
        if key not in options:
            raise TypeError(f"start_processes() got an unexpected keyword argument {key!r}")
        if key in dict(zip(names, positional)):
            raise TypeError(f"start_processes() got multiple values for argument {key!r}")
        options[key] = value

    name = _check_name(name)
    args = _normalize_args(args)
    nprocs = len(args)
    envs = _normalize_envs(envs, nprocs)
    start_method = options["start_method"]
    if not callable(entrypoint) and not isinstance(entrypoint, str):
        raise TypeError(f"entrypoint must be a callable or a str, got {type(entrypoint).__name__}")
    if callable(entrypoint) and start_method not in _VALID_START_METHODS:
        raise ValueError(f"start_method must be one of {_VALID_START_METHODS}, got {start_method!r}")

    if legacy:
        if logs_specs is None:
            raise TypeError("start_processes() needs log_dir")
        spec_obj: Any = LegacyLogsSpecs(
            os.fspath(logs_specs),  # type: ignore[arg-type]
            redirects=options["redirects"], tee=options["tee"])
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

    context: PContext
    if isinstance(entrypoint, str):
        context = SubprocessContext(name, entrypoint, args, envs, spec_obj, **extra)
    else:
        context = _function_context_class()(  # type: ignore[call-arg]
            name, entrypoint, args, envs, start_method=start_method, logs_specs=spec_obj, **extra)
    if timestamps:
        context.log_line_timestamps = True  # type: ignore[attr-defined]
    if console_backlog is not None:
        context.console_backlog = backlog  # type: ignore[attr-defined]
    context.stderr_tail = tail_lines  # type: ignore[attr-defined]
    context.watch_stderr = watch_stderr  # type: ignore[attr-defined]
    try:
        context.start()
    except BaseException as e:
        # The caller never gets the context: nothing it started may outlive
        # this call.  The workers get the signal that interrupted the launch
        # (SIGTERM after an error) and close()'s usual grace.
        close_despite_interrupts(context, _interrupt_signal(e), 30)
        raise
    return context
