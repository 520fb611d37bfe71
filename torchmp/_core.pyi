"""Type stub for torchmp._core, the compiled half of torchmp (csrc/_core.pyx).

Kept in sync with the compiled module by tests/test_packaging.py: every public
name here exists in the module with the same parameters, and every public
name of the module is declared here.
"""

from typing import Final

__version__: Final[str]
PORTABLE_BUILD: Final[bool]

STREAM_INHERIT: Final[int]
STREAM_FILE: Final[int]
STREAM_TEE: Final[int]
STREAM_CAPTURE: Final[int]
FD_RETURN: Final[int]
FD_PAYLOAD: Final[int]

PROC_UNSTARTED: Final[int]
PROC_RUNNING: Final[int]
PROC_EXITED: Final[int]

STEP_EXEC: Final[int]

# (mode, fd, console, prefix[, timestamps]): how one stream of a rank is wired.
_StreamSpec = tuple[int, int, int, bytes | None] | tuple[int, int, int, bytes | None, bool]
# (path, argv, envp, out, err, ret, payload_fd): one rank of Group.spawn.
_RankSpec = tuple[bytes, list[bytes], list[bytes], _StreamSpec, _StreamSpec, _StreamSpec, int]
# (state, pid, wait_status, start_mono_ns, exit_mono_ns, exit_real_ns,
#  utime_ns, stime_ns, maxrss_kb, out_log_errno, err_log_errno, status_lost)
_ProcInfo = tuple[int, int, int, int, int, int, int, int, int, int, int, int]

def redirect_fd(std_fd: int, target_fd: int) -> int: ...
def restore_fd(std_fd: int, saved_fd: int) -> None: ...
def child_setup(stdout_fd: int, stderr_fd: int, pdeathsig: bool, parent_pid: int) -> None: ...
def step_name(step: int) -> str: ...
def exec_error(step: int, errnum: int, path: str | None) -> OSError: ...
def backend() -> str: ...
def loop_fd_count() -> int: ...
def frame(
    fd: int,
    prefix: bytes,
    chunks: list[bytes],
    max_line: int = ...,
    scratch: int = ...,
    timestamps: bool = ...,
) -> None: ...

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
    def spawn(self, specs: list[_RankSpec]) -> None: ...
    def prepare(self, specs: list[tuple[_StreamSpec, _StreamSpec, _StreamSpec]]) -> list[tuple[int, int, int]]: ...
    def close_worker_fds(self, rank: int) -> None: ...
    def fork_rank(self, rank: int, pdeathsig: bool, default_signals: tuple[int, ...] = ...) -> tuple[int, int]: ...
    def adopt(self, workers: list[tuple[int, int]], foreign: bool) -> None: ...
    def drop_unstarted(self) -> None: ...
    def take_return(self, rank: int) -> bytes: ...
    def snapshot(self) -> tuple[int, list[_ProcInfo]]: ...
    def wait(self, timeout: float) -> bool: ...
    def killpg(self, sig: int, include_exited: bool = ...) -> None: ...
    def finish_streams(self) -> None: ...
