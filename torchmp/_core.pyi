"""Type stub for torchmp._core, the compiled half of torchmp (csrc/_core.pyx).

Kept in sync with the compiled module by tests/test_packaging.py: every public
name here exists in the module with the same parameters, and every public
name of the module is declared here.
"""

from collections.abc import Iterable
from enum import IntEnum
from typing import Any, Final, NamedTuple

__version__: Final[str]
COLLECT_HAS_RUSAGE: Final[bool]
HAVE_BINDING: Final[bool]
HAVE_FOLLOW: Final[bool]

class StreamMode(IntEnum):
    """How a stream of a rank is wired (StreamSpec.mode)."""

    INHERIT = ...
    FILE = ...
    TEE = ...
    RETURN = ...

class ProcState(IntEnum):
    """Where a rank is (ProcInfo.state, a plain int there: compare with these)."""

    UNSTARTED = ...
    RUNNING = ...
    EXITED = ...

STREAM_INHERIT: Final[StreamMode]
STREAM_FILE: Final[StreamMode]
STREAM_TEE: Final[StreamMode]
STREAM_RETURN: Final[StreamMode]  # the return channel's mode
FD_RETURN: Final[int]  # the worker's fd of its return channel
FD_PAYLOAD: Final[int]

PROC_UNSTARTED: Final[ProcState]
PROC_RUNNING: Final[ProcState]
PROC_EXITED: Final[ProcState]

EXIT_TRAILER_MAGIC: Final[str]
# How long a wait of the main thread sleeps at a time while an event loop's
# wake-up fd is set (csrc/signal_wake.pxi).
SIGNAL_SLICE_SECONDS: Final[float]

class ProcInfo(NamedTuple):
    """One rank as Group.snapshot() saw it."""

    state: int
    pid: int
    wait_status: int
    start_mono_ns: int
    exit_mono_ns: int
    exit_real_ns: int
    utime_ns: int
    stime_ns: int
    maxrss_kb: int
    out_log_errno: int
    err_log_errno: int
    status_lost: bool

class ExitRecord(NamedTuple):
    """What collect_exit says of an exited child."""

    wait_status: int
    utime_ns: int
    stime_ns: int
    maxrss_kb: int

class StreamState(NamedTuple):
    """One rank's teed pipes as Group.stream_state() saw them."""

    stdout_open: bool
    stderr_open: bool
    stdout_last_ns: int
    stderr_last_ns: int

class WorkerFds(NamedTuple):
    """A prepared rank's worker-side fds (Group.prepare); -1 for none."""

    stdout: int
    stderr: int
    return_channel: int

class Forked(NamedTuple):
    """What Group.fork_rank returns: (pid, -1) in the parent, (0, return_fd) in the worker."""

    pid: int
    return_fd: int

class StreamSpec(NamedTuple):
    """How one stream of a rank (stdout, stderr, the return channel) is wired."""

    mode: StreamMode | int
    fd: int
    console: int | QueueConsole
    prefix: bytes | None
    timestamps: bool = ...
    log_path: bytes | None = ...
    backlog: int = ...
    tail: int = ...
    open_log: bool = ...
    follow_log: bool = ...

class Binding(NamedTuple):
    """Where a worker runs: sched_setaffinity to cpus and, if mems is not
    empty, set_mempolicy(MPOL_BIND) to those NUMA nodes."""

    cpus: tuple[int, ...]
    mems: tuple[int, ...]

class RankSpec(NamedTuple):
    """One rank of Group.spawn."""

    path: bytes
    argv: list[bytes]
    envp: list[bytes]
    out: StreamSpec
    err: StreamSpec
    return_channel: StreamSpec
    payload_fd: int
    binding: Binding | None = ...

def redirect_fd(std_fd: int, target_fd: int) -> int: ...
def restore_fd(std_fd: int, saved_fd: int) -> None: ...
def child_setup(
    stdout_fd: int, stderr_fd: int, pdeathsig: bool, parent_pid: int,
    binding: Binding | tuple[tuple[int, ...], tuple[int, ...]] | None = ...,
) -> None: ...
def backend() -> str: ...
def open_fd_count() -> int: ...
def cgroup_root_version(path: str | bytes) -> int: ...
def nofile_limits() -> tuple[int, int]: ...
def create_log(path: bytes) -> None: ...
def find_in_path(name: bytes, search_path: bytes) -> tuple[bytes | None, bytes | None]: ...
def keeper_pid() -> int: ...
def set_child_subreaper(on: bool = ...) -> None: ...
def route_sent_faults(sig: int, handler: Any) -> None: ...
def collect_exit(pid: int) -> ExitRecord | None: ...
def consoles_pending(fd: int = ...) -> int: ...
def consoles_shown(fd: int = ...) -> int: ...
def loop_exists() -> bool: ...
def groups_alive() -> int: ...
def console_say(fd: int, data: bytes) -> bool: ...
def line_cuts(data: CaptureBuffer | bytes, piece: int) -> list[int]: ...
def set_console_stall(seconds: float) -> None: ...
def console_gone(err: int) -> bool: ...
def console_failure(std_fd: int) -> int: ...
def queues_generation() -> int: ...
def queues_wait(seen: int, timeout: float = ...) -> bool: ...
def queues_post() -> None: ...
def frame(
    fd: int,
    prefix: bytes,
    chunks: list[bytes | int | float],
    max_line: int = ...,
    scratch: int = ...,
    timestamps: bool = ...,
    backlog: int = ...,
    log_path: bytes | None = ...,
) -> int: ...

DEFAULT_CONSOLE_BACKLOG: Final[int]

class QueueConsole:
    def take(self) -> CaptureBuffer | bytes: ...
    def pending(self) -> int: ...
    def say(self, data: bytes) -> bool: ...

class CaptureBuffer:
    def __len__(self) -> int: ...
    def __bytes__(self) -> bytes: ...
    def __buffer__(self, flags: int) -> memoryview: ...

class SpawnError(OSError):
    rank: int
    step: int
    errno_: int
    cause: OSError

class Group:
    @property
    def nprocs(self) -> int: ...
    @property
    def started(self) -> int: ...
    def __init__(
        self,
        nprocs: int,
        out_filters: list[bytes] | None = ...,
        filtered_out_fd: int = ...,
        err_filters: list[bytes] | None = ...,
        filtered_err_fd: int = ...,
    ) -> None: ...
    def release(self) -> None: ...
    def spawn(self, specs: list[RankSpec]) -> None: ...
    def prepare(self, specs: list[tuple[StreamSpec, StreamSpec, StreamSpec]]) -> list[WorkerFds]: ...
    def close_worker_fds(self, rank: int) -> None: ...
    def fork_rank(
        self, rank: int, pdeathsig: bool, default_signals: tuple[int, ...] = ..., binding: Binding | None = ...,
    ) -> Forked: ...
    def adopt(self, workers: list[tuple[int, int]], by_forkserver: bool) -> None: ...
    def adopt_forked(self) -> None: ...
    def forkserver_fork(self, rank: int, sock_fd: int, message: bytes, fds: list[int], timeout: float) -> int: ...
    def drop_unstarted(self) -> None: ...
    def take_return(self, rank: int) -> CaptureBuffer | bytes: ...
    def version(self) -> int: ...
    def snapshot(self) -> tuple[int, list[ProcInfo]]: ...
    def stream_state(self) -> list[StreamState]: ...
    def tail(self, rank: int, which: int = ..., limit: int = ...) -> bytes: ...
    def wait(self, timeout: float, known_version: int, until_decided: bool = False, fail_fast: bool = True) -> bool: ...
    def killpg(self, sig: int) -> None: ...
    def send_signal(self, sig: int, ranks: Iterable[int] | None = ...) -> list[int]: ...
    def busy(self) -> list[int]: ...
    def reap(self) -> list[int]: ...
    def finish_streams(self) -> None: ...
    def watch(self, notifier: Notifier, token: int, until_decided: bool = False,
              fail_fast: bool = True) -> None: ...
    def unwatch(self, notifier: Notifier) -> None: ...

# Commands (torchmp.run, run_async) and the notifier an event loop is woken through.
IO_INHERIT: Final[int]
IO_PIPE: Final[int]
IO_STDOUT: Final[int]
CMD_EXITED: Final[int]
CMD_DONE: Final[int]
CMD_REAPED: Final[int]
CMD_WATCHED: Final[int]
UNTIL_EXITED: Final[int]
UNTIL_DONE: Final[int]
NOTE_EXITED: Final[int]
NOTE_DONE: Final[int]
NOTE_CHANGED: Final[int]

def backend_choice() -> str: ...

class CommandInfo(NamedTuple):
    """One command as Command.info() saw it."""

    pid: int
    state: int
    wait_status: int
    status_lost: bool
    start_mono_ns: int
    exit_mono_ns: int
    utime_ns: int
    stime_ns: int
    maxrss_kb: int

class Notifier:
    def fileno(self) -> int: ...
    def close(self) -> None: ...
    def take(self) -> tuple[list[tuple[int, int]], bool]: ...

class Command:
    @property
    def pid(self) -> int: ...
    @property
    def state(self) -> int: ...
    def close(self) -> None: ...
    def info(self) -> CommandInfo: ...
    def watch(self, notifier: Notifier, token: int) -> None: ...
    def wait(self, timeout: float, until: int) -> bool: ...
    def killpg(self, sig: int) -> None: ...
    def busy(self) -> bool: ...
    def reap(self) -> None: ...
    def output(self, which: int) -> tuple[bytes, bytes, int, int]: ...

def start_command(
    program: bytes,
    argv: list[bytes],
    envp: list[bytes] | None,
    search_path: bytes | None,
    cwd: bytes | None,
    stdin: int,
    stdout: int,
    stderr: int,
    pass_fds: tuple[int, ...],
    max_output: int,
    drain: float,
    filename: object,
    cwd_name: object,
) -> Command: ...

# ---------------------------------------------------------------------------
# For the tests (and a user's diagnostics) only: no torchmp module uses these.
# They let the suite check the core's own contracts -- which build this is,
# the worker setup steps and how their failures read, the exit trailer a
# forkserver writes, the keeper's and the subreaper's state.

PORTABLE_BUILD: Final[bool]
KEEPER_WITHOUT_LIBC: Final[bool]
STEP_EXEC: Final[int]
STEP_AFFINITY: Final[int]
STEP_MEMPOLICY: Final[int]
STEP_CHDIR: Final[int]
STEP_COUNT: Final[int]
EXIT_TRAILER_SIZE: Final[int]
def exit_trailer_fields() -> tuple[tuple[str, int, int], ...]: ...
def step_name(step: int) -> str: ...
def exec_error(step: int, errnum: int, path: str | None) -> OSError: ...
def is_child_subreaper() -> bool: ...
