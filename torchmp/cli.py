"""``torchmp run``: launch ``n`` copies of a command on this host.

::

    torchmp run -n 4 -- python train.py --epochs 3

starts four copies of ``python train.py --epochs 3`` through
:func:`torchmp.start_processes`, each with the environment ``torchrun
--standalone`` would give it (``LOCAL_RANK``, ``RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` on a free port, ...).
By default every line a worker writes goes to its log file and, prefixed
with ``[{name}{rank}]:``, to the console.  The first failing rank stops the
others (fail-fast), the torchelastic failure report is printed, and an
end-of-run summary table (rank, pid, exit, wall time, CPU time, max RSS) goes
to stderr.

Exit status (as ``srun``):

==================================  ==========================================
what happened                       exit status
==================================  ==========================================
every rank exited 0                 0
a rank failed                       the root-cause rank's exit code, or
                                    128 + N if signal N killed it
``torchmp run`` got signal N        128 + N (after terminating the workers)
bad usage (nothing started)         2
the log directory cannot be made    1 (nothing started)
the command cannot be found         127 (126: found but not executable)
==================================  ==========================================

Log files are laid out as ``torchrun``'s:
``{log_dir}/{run_id}_<random>/attempt_0/{local_rank}/{stdout.log,stderr.log,error.json}``.

A console that is closed or gone (``| head -1``, a terminal that went away)
is not an error: it is dropped -- its fd is pointed at ``/dev/null`` -- while
the log files stay complete and the exit status stays the workers'.

Where is each rank of a job that hangs?  ``kill -USR2 <pid of torchmp run>``
prints a table (pid, state, CPU time, RSS, seconds since its last output,
kernel wait channel) per rank without stopping anything, plus each Python
rank's stack where ``py-spy`` is installed; ``--hang-report-after S`` prints
it by itself once no rank has written anything for S seconds (see
:mod:`torchmp._hang`).  Python ranks run with ``PYTHONFAULTHANDLER=1`` (unless
it is set already, or ``--no-faulthandler``), so a native crash shows the
Python stack in the rank's stderr.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import re
import shutil
import signal
import socket
import string
import sys
import tempfile
import threading
import time
from collections.abc import Collection, Sequence
from types import FrameType
from typing import Any, NoReturn

from torchmp import _console, _hang
from torchmp._exec import resolve_executable
from torchmp._inputs import stderr_tail_bound
from torchmp._signals import SignalException, close_despite_interrupts, handled_signals
from torchmp.api import start_processes
from torchmp.errors import ChildFailedError, ProcessFailure
from torchmp.logs_specs import DefaultLogsSpecs, LogsDest, Std, to_map

__all__ = ["build_parser", "main"]

PROG = "torchmp run"

#: Fields a ``--prefix`` template may use.
PREFIX_FIELDS = ("name", "rank", "local_rank", "pid", "host")
DEFAULT_PREFIX = "[{name}{rank}]:"

#: Signals that make ``torchmp run`` terminate its workers and exit 128 + N.
HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)

#: The signal that asks ``torchmp run`` for a hang report (unless
#: TORCHELASTIC_SIGNALS_TO_HANDLE names it: then it stops the job).
REPORT_SIGNAL = signal.SIGUSR2

#: Set in every rank (unless already set, or --no-faulthandler): CPython then
#: enables faulthandler at startup, so a fatal signal prints the Python stack.
FAULTHANDLER_VAR = "PYTHONFAULTHANDLER"

_MIB = 1024 * 1024

logger = logging.getLogger("torchmp.cli")


class _UsageError(Exception):
    pass


class _SetupError(Exception):
    """Something torchmp run needs could not be made (nothing was started);
    ``str()`` is the whole message."""


# ---------------------------------------------------------------------------
# Parsing


class _Parser(argparse.ArgumentParser):
    def _print_message(self, message: str, file: Any = None) -> None:
        # argparse swallows a failed write, but what a block-buffered stdout
        # holds is written by the interpreter's last flush: failing there, it
        # prints "Exception ignored ..." and exits 120 instead of 0 or 2.
        if message:
            _write_console(file or sys.stderr, message)

    def error(self, message: str) -> NoReturn:
        # argparse's own format ("usage: ...", "prog: error: ..."), exit code 2.
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = _Parser(
        prog=prog,
        usage=f"{prog} -n N [options] -- COMMAND [ARGS...]",
        description=(
            "Launch N copies of COMMAND on this host, with torchrun's environment "
            "variables, teed and prefixed output, log files, fail-fast, the "
            "failure report and a summary table."
        ),
        epilog=(
            "Exit status: 0 if every rank succeeded; else the root-cause rank's exit "
            "code, or 128+N if it died by signal N (as srun); 128+N if torchmp run "
            "itself got signal N; 2 for bad usage; 127/126 if COMMAND cannot be found/run.  "
            f"{REPORT_SIGNAL.name} to torchmp run prints where each rank is (a hang report), "
            "stopping nothing."
        ),
    )
    p.add_argument("-n", "--nproc", "--nproc-per-node", dest="nproc", type=int, required=True,
                   metavar="N", help="number of copies (local ranks) to start on this host")
    p.add_argument("--name", default=None,
                   help="the job's name, used in prefixes and the failure report "
                        "(default: the command's base name)")
    p.add_argument("--log-dir", default=None, metavar="DIR",
                   help="base directory for log files (default: a fresh directory under "
                        f"{tempfile.gettempdir()}); the run's directory is printed to stderr; "
                        f"{os.devnull} writes no files")
    p.add_argument("--redirects", default="0", metavar="SPEC",
                   help="streams written to the log files only: 0=none 1=stdout 2=stderr 3=both, "
                        "or per local rank as '0:3,1:0' (default: 0)")
    p.add_argument("--tee", default=None, metavar="SPEC",
                   help="streams written to the log files and, prefixed, to the console "
                        "(same syntax; default: every stream that is not in --redirects)")
    p.add_argument("--local-ranks-filter", default=None, metavar="RANKS",
                   help="only these local ranks (e.g. '0,2') reach the console; the log files "
                        "are written for every rank")
    p.add_argument("--prefix", default=DEFAULT_PREFIX, metavar="TEMPLATE",
                   help="console line prefix, a str.format template with the fields "
                        "{name} {rank} {local_rank} {pid} {host}; {pid} is the pid of "
                        f"torchmp run itself (the workers do not exist yet) (default: "
                        f"'{DEFAULT_PREFIX}')")
    p.add_argument("--timestamps", action="store_true",
                   help="stamp every teed console line, after its prefix, with the UTC time "
                        "it was read (e.g. 2026-11-29T09:54:05.123Z); the log files keep the "
                        "workers' exact bytes")
    p.add_argument("--console-backlog", default=None, metavar="SIZE",
                   help="how much of each teed stream may wait for a console that falls "
                        "behind (a stalled pipe or terminal) before whole lines are left out "
                        "of the console -- never out of the log files -- with a marker line "
                        "saying how many (e.g. 16M, 512K, 0; default 4M, or "
                        "$TORCHMP_CONSOLE_BACKLOG)")
    p.add_argument("--stderr-tail", type=int, default=None, metavar="LINES",
                   help="how many of a failed rank's last stderr lines its failure report and "
                        "summary row use when it left no error file (default 20, or "
                        "$TORCHMP_STDERR_TAIL; 0: none)")
    p.add_argument("--start-method", default="spawn", choices=("spawn", "fork", "forkserver"),
                   help="accepted for torchrun compatibility; it only matters for Python "
                        "function entrypoints, and torchmp run starts binaries (fork+exec)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="set an environment variable in every rank (repeatable; applied last, "
                        "so it can override the ones torchmp run sets)")
    p.add_argument("--no-summary", dest="summary", action="store_false",
                   help="do not print the end-of-run summary table")
    p.add_argument("--no-faulthandler", dest="faulthandler", action="store_false",
                   help=f"do not set {FAULTHANDLER_VAR}=1 in the ranks (by default it is set unless "
                        "torchmp run's environment or --env sets it, so a Python rank killed by "
                        "SIGSEGV, SIGABRT, SIGBUS, SIGFPE or SIGILL prints its Python stack to its "
                        "stderr)")
    p.add_argument("--hang-report-after", type=float, default=None, metavar="SECONDS",
                   help="when no rank has written any output for SECONDS, print where each "
                        f"rank is (the hang report {REPORT_SIGNAL.name} asks for), once per "
                        "silence: again only after new output and another SECONDS of silence")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="when torchmp run gets a signal, how long the workers get to exit "
                        "after it is passed on to them, before SIGKILL (default: 30; the "
                        "fail-fast shutdown after a rank fails always allows 30)")
    p.add_argument("--nnodes", type=int, default=1,
                   help="number of hosts in the job (default: 1); each host runs its own "
                        "torchmp run with the same --master-addr/--master-port")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this host's index in 0..nnodes-1 (default: 0); "
                        "RANK = node_rank * N + LOCAL_RANK")
    p.add_argument("--master-addr", default=None,
                   help="MASTER_ADDR for the ranks (default: 127.0.0.1; required if --nnodes > 1)")
    p.add_argument("--master-port", type=int, default=None,
                   help="MASTER_PORT for the ranks (default: a free port on 127.0.0.1; "
                        "required if --nnodes > 1)")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND",
                   help="the program to run and its arguments (after '--')")
    return p


def _split_command(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """Split at the first ``--``: (options, command), command None if absent."""
    try:
        i = argv.index("--")
    except ValueError:
        return argv, None
    return argv[:i], argv[i + 1:]


def _parse_std(text: str, nproc: int, option: str) -> dict[int, Std]:
    try:
        setting = Std.from_str(text)
    except ValueError as e:
        raise _UsageError(f"{option}: {e}") from None
    if isinstance(setting, dict):
        bad = sorted(r for r in setting if r >= nproc)
        if bad:
            raise _UsageError(
                f"{option}: local rank {bad[0]} is out of range 0..{nproc - 1} in {text!r}")
    return to_map(setting, nproc)


def _parse_ranks_filter(text: str, nproc: int) -> set[int]:
    ranks: set[int] = set()
    for item in text.split(","):
        item = item.strip()
        if not item.isascii() or not item.isdigit():
            raise _UsageError(
                f"--local-ranks-filter: expected a comma-separated list of local ranks "
                f"(e.g. '0,2'), got {text!r}")
        rank = int(item)
        if rank >= nproc:
            raise _UsageError(
                f"--local-ranks-filter: local rank {rank} is out of range 0..{nproc - 1}")
        ranks.add(rank)
    return ranks


def _parse_env(items: Sequence[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise _UsageError(f"--env: expected KEY=VALUE, got {item!r}")
        if "\0" in item:
            raise _UsageError(f"--env: {item!r} contains a NUL byte")
        env[key] = value
    return env


def _check_prefix(template: str) -> None:
    try:
        fields = list(string.Formatter().parse(template))
    except ValueError as e:
        raise _UsageError(f"--prefix: malformed template {template!r}: {e}") from None
    for _, field, _, _ in fields:
        if field is None:
            continue
        base = field.split(".", 1)[0].split("[", 1)[0]
        if base not in PREFIX_FIELDS:
            shown = "{}" if field == "" else "{" + field + "}"
            raise _UsageError(
                f"--prefix: unknown field {shown} in {template!r}; the fields are "
                + " ".join("{" + f + "}" for f in PREFIX_FIELDS))
    try:
        template.format(name="n", rank=0, local_rank=0, pid=1, host="h")
    except (ValueError, KeyError, IndexError, AttributeError, TypeError) as e:
        raise _UsageError(f"--prefix: cannot format {template!r}: {e}") from None


def _check_name(name: str) -> None:
    """The name starts the run's directory under ``--log-dir`` (torchrun's
    ``{log_dir}/{name}_<random>``): it must be one path component, or the logs
    and error files would land outside ``--log-dir``."""
    if "/" in name or "\0" in name or name in (".", ".."):
        raise _UsageError(
            f"--name: {name!r} cannot name the run's log directory "
            "(it must not contain '/' or a NUL byte, nor be '.' or '..')")


_PYTHON_RE = re.compile(r"python[0-9.]*")


def default_name(command: Sequence[str]) -> str:
    """The job name when ``--name`` is not given: the script's stem for
    ``python [opts] script.py ...``, else the program's base name."""
    program = os.path.basename(command[0])
    if _PYTHON_RE.fullmatch(program):
        for arg in command[1:]:
            if arg in ("-c", "-m"):
                break
            if arg.startswith("-"):
                continue
            if arg.endswith(".py"):
                return os.path.splitext(os.path.basename(arg))[0] or program
            break
    return program


def _free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class _Plan:
    """Everything a launch needs, checked before anything starts."""

    def __init__(self, args: argparse.Namespace, command: list[str]) -> None:
        if not command:
            raise _UsageError("no command given (put it after '--', e.g. "
                              f"{PROG} -n 2 -- python train.py)")
        if args.nproc < 1:
            raise _UsageError(f"-n/--nproc must be at least 1, got {args.nproc}")
        if args.nnodes < 1:
            raise _UsageError(f"--nnodes must be at least 1, got {args.nnodes}")
        if not 0 <= args.node_rank < args.nnodes:
            raise _UsageError(
                f"--node-rank must be in 0..{args.nnodes - 1}, got {args.node_rank}")
        if args.nnodes > 1 and (args.master_addr is None or args.master_port is None):
            raise _UsageError("--nnodes > 1 needs --master-addr and --master-port "
                              "(the same on every host)")
        if args.master_port is not None and not 0 < args.master_port < 65536:
            raise _UsageError(f"--master-port must be in 1..65535, got {args.master_port}")
        if not args.shutdown_timeout >= 0:
            raise _UsageError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
        if args.hang_report_after is not None and not 0 < args.hang_report_after < float("inf"):
            raise _UsageError(f"--hang-report-after must be > 0 seconds, got {args.hang_report_after}")
        self.command = command
        self.nproc: int = args.nproc
        self.name: str = args.name if args.name is not None else default_name(command)
        if not self.name:
            raise _UsageError("--name must not be empty")
        if args.name is not None:  # a default name is a base name already
            _check_name(self.name)
        redirects = _parse_std(args.redirects, self.nproc, "--redirects")
        if args.tee is None:
            # Tee whatever is not redirected: output reaches the console prefixed.
            tee = {r: Std(Std.ALL & ~redirects[r]) for r in redirects}
        else:
            tee = _parse_std(args.tee, self.nproc, "--tee")
        self.redirects = redirects
        self.tee = tee
        self.ranks_filter = (None if args.local_ranks_filter is None
                             else _parse_ranks_filter(args.local_ranks_filter, self.nproc))
        _check_prefix(args.prefix)
        self.prefix_template: str = args.prefix
        self.user_env = _parse_env(args.env)
        self.start_method: str = args.start_method
        self.summary: bool = args.summary
        self.shutdown_timeout: float = args.shutdown_timeout
        self.timestamps: bool = args.timestamps
        self.faulthandler: bool = args.faulthandler
        self.hang_report_after: float | None = args.hang_report_after
        try:
            self.console_backlog: int = _console.backlog_bound(args.console_backlog)
        except (TypeError, ValueError) as e:
            raise _UsageError(f"--console-backlog: {e}" if args.console_backlog is not None else str(e)) from None
        try:
            self.stderr_tail: int = stderr_tail_bound(args.stderr_tail)
        except ValueError as e:
            raise _UsageError(f"--stderr-tail: {e}" if args.stderr_tail is not None else str(e)) from None
        self.nnodes: int = args.nnodes
        self.node_rank: int = args.node_rank
        self.master_addr: str = args.master_addr or "127.0.0.1"
        self.master_port: int | None = args.master_port
        self.log_dir_arg: str | None = args.log_dir
        if self.log_dir_arg is not None:
            if not self.log_dir_arg:
                raise _UsageError("--log-dir must not be empty")
            if self.log_dir_arg != os.devnull and os.path.exists(self.log_dir_arg) \
                    and not os.path.isdir(self.log_dir_arg):
                raise _UsageError(f"--log-dir: {self.log_dir_arg} exists and is not a directory")

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.nproc + local_rank

    def envs(self, master_port: int) -> dict[int, dict[str, str]]:
        world = self.nnodes * self.nproc
        envs = {}
        for local in range(self.nproc):
            rank = self.global_rank(local)
            env = {
                "LOCAL_RANK": str(local),
                "RANK": str(rank),
                "GROUP_RANK": str(self.node_rank),
                "ROLE_RANK": str(rank),
                "ROLE_NAME": self.name,
                "LOCAL_WORLD_SIZE": str(self.nproc),
                "WORLD_SIZE": str(world),
                "GROUP_WORLD_SIZE": str(self.nnodes),
                "ROLE_WORLD_SIZE": str(world),
                "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(master_port),
                "TORCHELASTIC_RUN_ID": self.name,
                "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_MAX_RESTARTS": "0",
            }
            # Set by the user (even empty: off) in torchmp run's environment,
            # which the ranks inherit, or with --env: theirs.
            if self.faulthandler and FAULTHANDLER_VAR not in os.environ \
                    and FAULTHANDLER_VAR not in self.user_env:
                env[FAULTHANDLER_VAR] = "1"
            env.update(self.user_env)
            envs[local] = env
        return envs

    def prefixes(self) -> dict[int, str]:
        host = socket.gethostname()
        return {
            local: self.prefix_template.format(
                name=self.name, rank=self.global_rank(local), local_rank=local,
                pid=os.getpid(), host=host)
            for local in range(self.nproc)
        }


class _AnnouncingLogsSpecs(DefaultLogsSpecs):
    """torchrun's layout; says where the run's files are before any rank starts."""

    #: The run's directory ({log_dir}/{name}_<random>/attempt_0), None for none.
    run_dir: str | None = None

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        try:
            dest = super().reify(envs)
        except OSError as e:  # the run's directories, inside --log-dir
            raise _SetupError(_describe_mkdir_error(e, self.root_log_dir)) from e
        if self.root_log_dir == os.devnull:
            _say(f"no log files (--log-dir {os.devnull})")
        elif dest.error_files:
            attempt_dir = os.path.dirname(os.path.dirname(dest.error_files[0]))
            self.run_dir = attempt_dir
            _say(f"log directory: {attempt_dir}")
        return dest


def _describe_mkdir_error(e: OSError, requested: str) -> str:
    """``cannot create log directory ...: why`` for a failed mkdir.

    ``requested`` is the directory asked for; ``e.filename`` is the one whose
    mkdir failed (an ancestor, when ``os.makedirs`` stopped early, or the
    run's directory inside it).  The errno alone can mislead: procfs and
    sysfs answer mkdir with ENOENT although the parent exists, so the parent
    is looked at to name the real cause.
    """
    failing = os.fsdecode(e.filename) if e.filename is not None else requested
    # The requested directory, if the failing one is it or one of its parents.
    inside = requested.rstrip(os.sep) + os.sep
    shown = requested if inside.startswith(failing.rstrip(os.sep) + os.sep) else failing
    call = "mkdir" if failing == shown else f"mkdir {failing}"
    strerror = e.strerror or str(e)
    parent = os.path.dirname(failing.rstrip(os.sep)) or "."
    diagnosis = None
    if e.errno in (errno.ENOENT, errno.EACCES, errno.EPERM) and os.path.isdir(parent):
        try:
            mode = os.stat(parent).st_mode
        except OSError:
            mode = 0
        if not mode & 0o222 or not os.access(parent, os.W_OK | os.X_OK):
            diagnosis = f"{parent} is not writable"
        elif e.errno == errno.ENOENT:
            diagnosis = f"{parent} does not allow creating directories"
    elif e.errno == errno.ENOTDIR:
        ancestor = parent
        while ancestor not in ("", os.sep, ".") and not os.path.lexists(ancestor):
            ancestor = os.path.dirname(ancestor)
        if os.path.lexists(ancestor) and not os.path.isdir(ancestor):
            diagnosis = f"{ancestor} is not a directory"
    elif e.errno == errno.EEXIST:
        diagnosis = (f"{failing} is a dangling symbolic link" if os.path.islink(failing)
                     else f"{failing} exists and is not a directory")
    reason = f"{diagnosis} ({call}: {strerror})" if diagnosis else (
        strerror if failing == shown else f"{strerror} ({call})")
    return f"cannot create log directory {shown}: {reason}"


# ---------------------------------------------------------------------------
# Reporting


#: Write errors that mean the console is closed (EPIPE: the reader of a pipe
#: went away) or gone (EIO: a terminal whose master side was closed).
_CONSOLE_GONE = frozenset((errno.EPIPE, errno.EIO))


def _console_gone(e: BaseException | None) -> bool:
    return isinstance(e, OSError) and e.errno in _CONSOLE_GONE


def _drop_console(stream: Any) -> None:
    """Point the fd of a console that is closed or gone at /dev/null.

    Whatever is still buffered, and anything written later (by this module,
    the native core's copy of the workers' lines, the interpreter's last
    flush at exit), then goes nowhere without an error, so a closed console
    changes neither the exit status nor what reaches the log files.
    """
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        fd = -1  # not a file: nothing to repoint, the error is swallowed only
    if fd >= 0:
        try:
            null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            null = -1
        if null >= 0:
            try:
                if null != fd:
                    os.dup2(null, fd)  # fds 0-2 stay inheritable, as they were
            except OSError:
                pass
            finally:
                if null != fd:
                    os.close(null)
    try:
        stream.flush()  # what the failed write left in the buffer: to /dev/null
    except (OSError, ValueError):
        pass


def _write_console(stream: Any, text: str) -> None:
    """Write and flush ``text``; a console that is closed or gone is dropped,
    and one that was closed when the launcher started (None) is off."""
    if stream is None:
        return
    try:
        stream.write(text)
        stream.flush()
    except OSError as e:
        if not _console_gone(e):
            raise
        _drop_console(stream)


def _settle_console() -> None:
    """Flush stdout and stderr, dropping either if it is closed or gone, so the
    interpreter's own flush at exit finds nothing to fail on (which would
    print "Exception ignored ... BrokenPipeError" and exit 120)."""
    for stream in (sys.stdout, sys.stderr):
        if stream is None:
            continue
        try:
            stream.flush()
        except OSError as e:
            if _console_gone(e):
                _drop_console(stream)
        except ValueError:  # closed by someone else
            pass


def _say(message: str) -> None:
    _write_console(sys.stderr, f"torchmp: {message}\n")


def _show_report(text: str) -> None:
    """Write a hang report to stderr while the job runs: after the lines the
    console already has, and never waiting long on a console that does not
    take it (the report is in its file too)."""
    stream = sys.stderr
    if stream is None:
        return
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        _write_console(stream, text)  # not a file: the object takes it
        return
    try:
        stream.flush()
    except (OSError, ValueError):
        pass
    _console.settle(_console.RESULT_STALL, limit=1.0, fd=fd)
    _hang.write_without_blocking(fd, text.encode("utf-8", "replace"))


def exit_code_for(failure: ProcessFailure) -> int:
    """srun's rule: the exit code, or 128 + N for a death by signal N."""
    if failure.exitcode < 0:
        return 128 + (-failure.exitcode)
    return failure.exitcode


def _format_rss(nbytes: int) -> str:
    return f"{nbytes / _MIB:.1f} MiB"


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return str(code)


#: How much of a failure's one-line reason the summary table shows.
SUMMARY_REASON_WIDTH = 100


def _summary_reason(failure: ProcessFailure) -> str:
    """Why a rank failed, in a few words for its summary row: what the
    launcher found out (the OOM killer), else the error file's message or
    the rank's last words; nothing where the exit column says it all."""
    if failure.cause:
        return failure.cause.split(" (", 1)[0]
    recorded = failure.error_file_data.get("message") not in (None, "<NONE>")
    if not recorded and not failure.stderr_tail.strip():
        return ""
    reason = failure.headline
    if len(reason) > SUMMARY_REASON_WIDTH:
        reason = reason[:SUMMARY_REASON_WIDTH - 3] + "..."
    return reason


def format_summary(
    plan_name: str,
    nproc: int,
    global_rank: Any,
    result: Any,
    notes: dict[int, str],
    exit_code: int,
    elapsed: float,
    terminated: Collection[int] = (),
) -> str:
    """The end-of-run table, one row per local rank (``?`` where unknown).

    A rank succeeded if it exited 0 on its own: one in ``terminated`` (stopped by
    the fail-fast or by the signal torchmp run got) did not, whatever its exit
    code -- a worker that exits 0 on SIGTERM was cut short, as the exit code says.
    """
    header = ("rank", "pid", "exit", "wall", "cpu", "max rss", "")
    rows = []
    resources = getattr(result, "resources", {}) if result is not None else {}
    for local in range(nproc):
        usage = resources.get(local)
        if usage is None:
            rows.append((str(global_rank(local)), "?", "?", "?", "?", "?", notes.get(local, "")))
            continue
        rows.append((
            str(global_rank(local)),
            str(usage.pid),
            _exit_text(usage.exitcode),
            f"{usage.wall_time:.3f}s",
            f"{usage.user_time + usage.system_time:.3f}s",
            _format_rss(usage.max_rss),
            notes.get(local, ""),
        ))
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    left = {2, 6}  # exit and note read better left-aligned

    def line(cells: Sequence[str]) -> str:
        out = [c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))]
        return "  ".join(out).rstrip()

    succeeded = sum(1 for local in range(nproc)
                    if local not in terminated and resources.get(local) is not None
                    and resources[local].exitcode == 0)
    title = (f"torchmp: summary of {plan_name}: {succeeded}/{nproc} ranks succeeded, "
             f"exit code {exit_code}, {elapsed:.2f}s")
    return "\n".join([title, line(header), *(line(r) for r in rows)]) + "\n"


# ---------------------------------------------------------------------------
# Running


def _raise_signal_exception(signum: int, frame: FrameType | None) -> None:
    sigval = signal.Signals(signum)
    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)


def _install_handlers() -> None:
    for sig in HANDLED_SIGNALS:
        signal.signal(sig, _raise_signal_exception)


class _ConsoleHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A StreamHandler that drops a console that is closed or gone instead of
    printing "--- Logging error ---" and a traceback about it."""

    def handleError(self, record: logging.LogRecord) -> None:
        if _console_gone(sys.exc_info()[1]):
            _drop_console(self.stream)
            return
        super().handleError(record)


def _configure_logging() -> None:
    log = logging.getLogger("torchmp")
    if not any(getattr(h, "_torchmp_cli", False) for h in log.handlers):
        # No stderr at all (closed at start): messages go nowhere.
        handler: logging.Handler = (_ConsoleHandler(sys.stderr) if sys.stderr is not None
                                    else logging.NullHandler())
        handler.setFormatter(logging.Formatter("torchmp: %(message)s"))
        handler._torchmp_cli = True  # type: ignore[attr-defined]
        log.addHandler(handler)
    log.setLevel(logging.WARNING)
    log.propagate = False


#: How soon a report signal that landed outside the context's wait is sent
#: again (doubling, up to 1 s, while it keeps landing there).
_REDELIVERY_FIRST = 0.05


class _ReportRequested(Exception):
    """Raised by the report signal's handler, and only where the run loop
    sleeps in the context's ``wait``: it unwinds that wait and nothing else."""


def _wait_codes(ctx: Any) -> frozenset[Any]:
    """The code objects of ``wait`` along the context's class hierarchy."""
    codes = set()
    for cls in type(ctx).__mro__:
        code = getattr(cls.__dict__.get("wait"), "__code__", None)
        if code is not None:
            codes.add(code)
    return frozenset(codes)


def _in_wait(frame: FrameType | None, codes: frozenset[Any]) -> bool:
    """Whether a signal handler interrupted the context's ``wait`` itself
    (asleep in the native wait, or between its own statements, which only
    read), not something it called (fail-fast, building the result), where
    an exception would cut work short.  A build with Cython profiling shows
    the native ``Group.wait`` as a frame of its own, called from that wait."""
    if frame is None:
        return False
    if frame.f_code in codes:
        return True
    back = frame.f_back
    return frame.f_code.co_name == "wait" and back is not None and back.f_code in codes


class _Run:
    def __init__(self, plan: _Plan) -> None:
        self.plan = plan
        self.ctx: Any = None
        self.result: Any = None
        self.signal: signal.Signals | None = None
        self.started = time.monotonic()
        self.specs: _AnnouncingLogsSpecs | None = None
        self.hang = _hang.HangWatch(plan.hang_report_after, self.started)
        self._sleeping = False      # in the run loop's ctx.wait
        self._wait_code_set: frozenset[Any] = frozenset()
        self._redelivery_pending = False
        self._redelivery_delay = _REDELIVERY_FIRST
        self._py_spy_hint = True

    def launch(self) -> None:
        plan = self.plan
        port = plan.master_port if plan.master_port is not None else _free_port()
        envs = plan.envs(port)
        log_dir = plan.log_dir_arg
        try:
            if log_dir is None:
                log_dir = tempfile.mkdtemp(prefix="torchmp_")
            specs = self.specs = _AnnouncingLogsSpecs(
                log_dir=log_dir, redirects=plan.redirects, tee=plan.tee,
                local_ranks_filter=plan.ranks_filter)
        except OSError as e:  # it makes --log-dir and its parents
            raise _SetupError(
                _describe_mkdir_error(e, log_dir or tempfile.gettempdir())) from e
        extra: dict[str, Any] = {"console_backlog": plan.console_backlog, "stderr_tail": plan.stderr_tail}
        if plan.timestamps:
            extra["log_line_timestamps"] = True
        self.started = self.hang.started = time.monotonic()
        # A signal raised inside start_processes would reach the handlers
        # before self.ctx is set: start_processes would then tear the workers
        # down with its own 30 s grace, not --shutdown-timeout.  Held until
        # the context is ours, it is handled by shut_down like any other.
        # (Workers start with an empty signal mask whatever the launcher's.)
        signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED_SIGNALS)
        try:
            self.ctx = start_processes(
                name=plan.name,
                entrypoint=plan.command[0],
                args={r: tuple(plan.command[1:]) for r in range(plan.nproc)},
                envs=envs,
                logs_specs=specs,
                log_line_prefixes=plan.prefixes(),
                start_method=plan.start_method,
                **extra,
            )
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, HANDLED_SIGNALS)

    # -- hang reports -------------------------------------------------------
    def install_report_handler(self) -> None:
        """SIGUSR2 asks for a hang report -- unless TORCHELASTIC_SIGNALS_TO_HANDLE
        names it: start_processes then makes it stop the job, as asked."""
        if REPORT_SIGNAL not in handled_signals():
            signal.signal(REPORT_SIGNAL, self._on_report_signal)

    def _on_report_signal(self, signum: int, frame: FrameType | None) -> None:
        # Runs on the main thread.  The report is made by the run loop, not
        # here: a flag, and a wake-up for the loop if it is asleep.
        self.hang.requested = True
        if not self._sleeping:
            return  # the loop looks at the flag before it waits again
        if _in_wait(frame, self._wait_code_set):
            raise _ReportRequested()
        # Inside what the wait called (an exit being handled: not to be cut
        # short).  The wait may go back to sleep: ask it again in a moment.
        self._redeliver()

    def _redeliver(self) -> None:
        """Send the report signal to the main thread again in a moment: one
        at a time, less often the longer the wait stays busy (a fail-fast
        shutdown can take its whole grace period)."""
        if self._redelivery_pending:
            return
        self._redelivery_pending = True
        delay = self._redelivery_delay
        self._redelivery_delay = min(2 * delay, 1.0)
        main = threading.main_thread().ident

        def again() -> None:
            self._redelivery_pending = False
            if self.hang.requested and self._sleeping and main is not None:
                signal.pthread_kill(main, REPORT_SIGNAL)

        timer = threading.Timer(delay, again)
        timer.daemon = True
        timer.start()

    def _reports_due(self) -> float:
        """Make the reports that are due; the timeout for the next wait
        (-1: none, the wait is woken by the exits and the signal alone)."""
        if self.hang.requested:
            self.hang.requested = False
            self._redelivery_delay = _REDELIVERY_FIRST
            self._try_report(f"asked by {REPORT_SIGNAL.name}")
        if self.hang.after is None:
            return -1.0
        due, next_check = self.hang.check(_hang.output_ages(self.ctx), time.monotonic())
        if due:
            self._try_report(f"no output for {self.hang.after:g}s")
        return max(0.01, next_check)

    def _try_report(self, reason: str) -> None:
        # A report is a diagnosis: whatever goes wrong in it, the job goes on.
        try:
            self.hang_report(reason)
        except SignalException:
            raise
        except Exception as e:
            _say(f"hang report failed: {type(e).__name__}: {e}")

    def hang_report(self, reason: str) -> None:
        """Print where each rank is (and, with py-spy, its Python stack) to
        stderr and save it in the run's directory; nothing is stopped."""
        plan, ctx = self.plan, self.ctx
        try:
            pids = dict(ctx.pids())
        except (ValueError, RuntimeError):
            pids = {}
        text = self.hang.report(plan.name, reason, pids, range(plan.nproc), plan.global_rank,
                                _hang.output_ages(ctx), time.monotonic())
        text += self._stacks(pids)
        run_dir = self.specs.run_dir if self.specs is not None else None
        if run_dir is not None:
            path = os.path.join(run_dir, f"hang-report-{self.hang.count}.txt")
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
                             | getattr(os, "O_NOFOLLOW", 0), 0o644)
                with open(fd, "w", encoding="utf-8", errors="replace") as f:
                    f.write(text)
                text += f"torchmp: hang report {self.hang.count} saved in {path}\n"
            except OSError as e:
                text += f"torchmp: hang report {self.hang.count} not saved: {path}: {e.strerror}\n"
        _show_report(text)

    def _stacks(self, pids: dict[int, int]) -> str:
        """``py-spy dump`` of every Python process of every running rank."""
        py_spy = shutil.which("py-spy")
        if py_spy is None:
            hint, self._py_spy_hint = self._py_spy_hint, False
            return ("torchmp: with py-spy installed, hang reports show each Python rank's stack\n"
                    if hint else "")
        groups = _hang.python_pids_by_group(pids.values())
        targets = [(local, pid) for local in sorted(pids) for pid in groups.get(pids[local], [])]
        dumps = _hang.py_spy_dumps([pid for _, pid in targets], py_spy=py_spy)
        parts = []
        for local, pid in targets:
            dump = dumps.get(pid, "").rstrip("\n")
            parts.append(f"torchmp: py-spy dump of rank {self.plan.global_rank(local)} "
                         f"(pid {pid}):\n{dump}\n")
        return "".join(parts)

    def wait(self) -> None:
        """The context's wait, woken also for the hang reports that are due."""
        self._wait_code_set = _wait_codes(self.ctx)
        while True:
            timeout = self._reports_due()
            self._sleeping = True
            try:
                result = self.ctx.wait(timeout)
            except _ReportRequested:
                continue
            finally:
                self._sleeping = False
            if result is not None:
                self.result = result
                return

    def shut_down(self, sig: signal.Signals) -> None:
        """Terminate the workers with ``sig``; a second signal means SIGKILL now."""
        self.signal = self.signal or sig
        if self.ctx is not None:
            close_despite_interrupts(self.ctx, sig, self.plan.shutdown_timeout)
            self.result = self.ctx.wait(0)

    def exit_code(self) -> int:
        if self.signal is not None:
            return 128 + int(self.signal)
        if self.result is None or not self.result.failures:
            return 0
        _, first = self._child_failed_error().get_first_failure()
        return exit_code_for(first)

    def _child_failed_error(self) -> ChildFailedError:
        failures = {self.plan.global_rank(local): f for local, f in self.result.failures.items()}
        return ChildFailedError(self.plan.name, failures)

    def terminated(self) -> set[int]:
        """Local ranks torchmp stopped (fail-fast, or the signal it got),
        whatever their exit code."""
        if self.result is None:
            return set()
        ranks = {local for local, failure in self.result.failures.items()
                 if failure.terminated_by_launcher or (
                     self.signal is not None
                     and failure.exitcode in (-self.signal, -signal.SIGKILL))}
        # A rank that exits 0 when told to stop is in no failure: the context
        # knows which ranks were still running when it sent the signal.
        ranks.update(getattr(self.ctx, "_terminated_by_launcher", ()))
        return ranks

    def notes(self) -> dict[int, str]:
        notes: dict[int, str] = {}
        if self.result is None:
            return notes
        root = None
        if self.result.failures and self.signal is None:
            root = self._child_failed_error().get_first_failure()[1].local_rank
        terminated = self.terminated()
        for local in range(self.plan.nproc):
            if local == root:
                notes[local] = "root cause"
            elif local in terminated:
                notes[local] = "terminated by torchmp"
            failure = self.result.failures.get(local)
            if failure is not None and local not in terminated:
                why = _summary_reason(failure)
                if why:
                    notes[local] = f"{notes[local]}: {why}" if local in notes else why
        return notes

    def report(self) -> None:
        elapsed = time.monotonic() - self.started
        # The report follows the workers' last lines on the console it is
        # written to (stderr; stdout too when they are one): let that console
        # catch up first, as long as it makes progress.
        if sys.stderr is not None:
            _console.settle(_console.exit_stall(), fd=2)
        if self.signal is not None:
            _say(f"got {self.signal.name}: terminated the workers")
        elif self.result is not None and self.result.failures:
            _write_console(sys.stderr, self._child_failed_error().format_msg() + "\n")
        if self.plan.summary:
            _write_console(sys.stderr, format_summary(
                self.plan.name, self.plan.nproc, self.plan.global_rank, self.result,
                self.notes(), self.exit_code(), elapsed,
                self.terminated()))


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """Entry point of ``torchmp run``; returns the exit status.

    A console (stdout or stderr) that is closed or gone is dropped, not an
    error: the exit status is the one a healthy console would have got.
    """
    try:
        return _main(argv, prog)
    finally:
        _settle_console()


def _main(argv: Sequence[str] | None, prog: str) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    options, command = _split_command(argv)
    args = parser.parse_args(options)
    if command is not None:
        # Options first, then '--' and the command; a command started before
        # '--' keeps the '--' and what follows as its own arguments.
        args.command = (args.command + ["--"] + command) if args.command else command
    try:
        plan = _Plan(args, args.command)
    except _UsageError as e:
        parser.error(str(e))

    # A command that cannot be found or run: the shell's 127/126, before
    # anything is created (PATH as the workers will see it).
    try:
        resolve_executable(plan.command[0], plan.user_env)
    except OSError as e:
        _say(f"error: cannot run {plan.command[0]!r}: {e.strerror or e}")
        return 127 if isinstance(e, FileNotFoundError) else 126

    _configure_logging()
    run = _Run(plan)
    _install_handlers()  # before the first worker exists
    run.install_report_handler()
    try:
        try:
            run.launch()
            run.wait()
        except SignalException as e:
            run.shut_down(e.sigval)
        except _SetupError as e:
            _say(f"error: {e}")
            return 1
        except OSError as e:
            # exec failed after all (e.g. ENOEXEC), or a log file, a pipe or
            # fork failed: nothing is left running (start_processes
            # reaped what it had started).
            _say(f"error: {e}")
            if run.ctx is None and e.filename is not None and \
                    os.fsdecode(e.filename) in (plan.command[0], os.path.basename(plan.command[0])):
                return 127 if isinstance(e, FileNotFoundError) else 126
            return 1
        run.report()
        return run.exit_code()
    except SignalException as e:
        # A signal while reporting: the workers are already gone or going.
        run.shut_down(e.sigval)
        return 128 + int(e.sigval)
    finally:
        if run.ctx is not None:
            close_despite_interrupts(run.ctx, signal.SIGKILL, 0)
