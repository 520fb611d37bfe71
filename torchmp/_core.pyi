"""Type stub for torchmp._core, the compiled half of torchmp (csrc/_core.pyx).

Kept in sync with the compiled module by tests/test_packaging.py: every public
name here exists in the module with the same parameters, and every public
name of the module is declared here.
"""

from typing import Final, NamedTuple

__version__: Final[str]
PORTABLE_BUILD: Final[bool]
COLLECT_HAS_RUSAGE: Final[bool]
HAVE_BINDING: Final[bool]

STREAM_INHERIT: Final[int]
STREAM_FILE: Final[int]
STREAM_TEE: Final[int]
STREAM_CAPTURE: Final[int]  # the return channel's mode
FD_RETURN: Final[int]  # the worker's fd of its return channel
FD_PAYLOAD: Final[int]

PROC_UNSTARTED: Final[int]
PROC_RUNNING: Final[int]
PROC_EXITED: Final[int]

STEP_EXEC: Final[int]
STEP_AFFINITY: Final[int]
STEP_MEMPOLICY: Final[int]
STEP_COUNT: Final[int]

EXIT_TRAILER_MAGIC: Final[str]
EXIT_TRAILER_SIZE: Final[int]

def exit_trailer_fields() -> tuple[tuple[str, int, int], ...]: ...

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

class StreamSpec(NamedTuple):
    """How one stream of a rank (stdout, stderr, the return channel) is wired."""

    mode: int
    fd: int
    console: int | QueueConsole
    prefix: bytes | None
    timestamps: bool = ...
    log_path: bytes | None = ...
    backlog: int = ...
    tail: int = ...

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
    ret: StreamSpec
    payload_fd: int
    binding: Binding | None = ...

def redirect_fd(std_fd: int, target_fd: int) -> int: ...
def restore_fd(std_fd: int, saved_fd: int) -> None: ...
def child_setup(
    stdout_fd: int, stderr_fd: int, pdeathsig: bool, parent_pid: int,
    binding: Binding | tuple[tuple[int, ...], tuple[int, ...]] | None = ...,
) -> None: ...
def step_name(step: int) -> str: ...
def exec_error(step: int, errnum: int, path: str | None) -> OSError: ...
def backend() -> str: ...
def loop_fd_count() -> int: ...
def keeper_pid() -> int: ...
def collect_exit(pid: int) -> tuple[int, int, int, int] | None: ...
def consoles_pending(fd: int = ...) -> int: ...
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
    def fileno(self) -> int: ...
    def take(self) -> bytes: ...
    def pending(self) -> int: ...

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
    def prepare(self, specs: list[tuple[StreamSpec, StreamSpec, StreamSpec]]) -> list[tuple[int, int, int]]: ...
    def close_worker_fds(self, rank: int) -> None: ...
    def fork_rank(
        self, rank: int, pdeathsig: bool, default_signals: tuple[int, ...] = ..., binding: Binding | None = ...,
    ) -> tuple[int, int]: ...
    def adopt(self, workers: list[tuple[int, int]], by_forkserver: bool) -> None: ...
    def adopt_forked(self) -> None: ...
    def forkserver_fork(self, rank: int, sock_fd: int, message: bytes, fds: list[int], timeout: float) -> int: ...
    def drop_unstarted(self) -> None: ...
    def take_return(self, rank: int) -> CaptureBuffer | bytes: ...
    def version(self) -> int: ...
    def snapshot(self) -> tuple[int, list[ProcInfo]]: ...
    def stream_state(self) -> list[tuple[bool, bool, int, int]]: ...
    def tail(self, rank: int, which: int = ..., limit: int = ...) -> bytes: ...
    def wait(self, timeout: float, known_version: int) -> bool: ...
    def killpg(self, sig: int) -> None: ...
    def busy(self) -> list[int]: ...
    def reap(self) -> list[int]: ...
    def finish_streams(self) -> None: ...
