"""Worker functions for tests/test_functions.py.

They live in a module of their own (tests/ is on sys.path, and sys.path
travels to spawned workers and to the forkserver) so that spawn and
forkserver workers can unpickle them by reference.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

# Who imported this module: a spawn worker imports it itself when it unpickles
# its function; a forkserver worker inherits it from the server when the
# server preloaded it.
IMPORTED_BY_PID = os.getpid()


@dataclass
class Payload:
    """A user-defined object travelling back as a return value."""

    rank: int
    tags: tuple[str, ...]
    table: dict[str, list[float]] = field(default_factory=dict)


def big_bytes(rank: int, size: int) -> bytes:
    """Deterministic, rank-specific bytes of the given size."""
    block = bytes(range(256))
    data = bytearray(block * (size // 256) + block[: size % 256])
    data[:8] = rank.to_bytes(8, "little")
    data[-1] = (rank * 7 + 1) & 0xFF
    return bytes(data)


# --- return values -----------------------------------------------------------

def return_rich(rank: int):
    """A different kind of value per rank: dict, None, object, nested, bytes."""
    kind = rank % 5
    if kind == 0:
        return {"rank": rank, "nested": {"a": [1, 2.5, None], "b": (True, False)}, 3: "int key"}
    if kind == 1:
        return None
    if kind == 2:
        return Payload(rank, ("x", "y"), {"loss": [0.5, 0.25]})
    if kind == 3:
        return [frozenset({1, 2}), b"\x00\xff raw", "caf\u00e9", 2**70, -0.0]
    return (rank, os.getpid())


def return_big(rank: int, size: int) -> bytes:
    return big_bytes(rank, size)


def return_arg(value):
    return value


# --- environment -------------------------------------------------------------

def read_env(names: tuple[str, ...]) -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in names}


# --- output --------------------------------------------------------------------

def write_everywhere(rank: int) -> int:
    """Write to stdout and stderr through every layer: Python, the fd, C stdio
    and a child process.  Ends with unflushed Python output and no newline."""
    import ctypes

    libc = ctypes.CDLL(None)
    print(f"print {rank}", flush=True)
    os.write(1, f"os.write {rank}\n".encode())
    libc.printf(b"libc printf %d\n", ctypes.c_int(rank))
    libc.fflush(None)
    libc.puts(b"libc puts")
    libc.fflush(None)
    os.system(f"echo from-child {rank}")
    os.system(f"echo from-child-err {rank} >&2")
    print(f"print err {rank}", file=sys.stderr, flush=True)
    os.write(2, b"os.write err\n")
    os.write(1, b"non-utf8 \xff\xfe\x00 bytes\n")
    sys.stdout.write(f"tail {rank} (unflushed, no newline)")
    return rank


# --- failures --------------------------------------------------------------------

def raise_value_error(rank: int, delay: float = 0.0):
    if delay:
        time.sleep(delay)
    raise ValueError(f"boom from rank {rank}")


def sys_exit(code):
    sys.exit(code)


def kill_self(sig: int):
    os.kill(os.getpid(), sig)
    time.sleep(30)  # not reached


def return_lambda():
    return lambda: 1


def return_lock():
    return threading.Lock()


def raise_or_sleep(rank: int, fail_rank: int, delay: float, pidfile: str):
    with open(pidfile, "a") as f:
        f.write(f"{os.getpid()}\n")
    if rank == fail_rank:
        time.sleep(delay)
        raise ValueError(f"rank {rank} failed on purpose")
    time.sleep(100)


def spawn_grandchild(pidfile: str):
    """Start `sleep 100` (our own child, in our process group) and wait."""
    child = subprocess.Popen(["sleep", "100"])
    with open(pidfile, "a") as f:
        f.write(f"{child.pid}\n")
    time.sleep(100)


def announce_and_sleep(pidfile: str, seconds: float = 100):
    with open(pidfile, "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(seconds)


# --- forkserver ---------------------------------------------------------------------

def preload_report(modules: tuple[str, ...]):
    """What this worker inherited: who imported this module, which modules
    were already loaded, and who our parent is (the forkserver)."""
    return {
        "imported_by": IMPORTED_BY_PID,
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "loaded": {m: m in sys.modules for m in modules},
    }


def ident():
    return os.getpid(), os.getppid(), threading.current_thread() is threading.main_thread()


def sigterm_disposition() -> bool:
    """True if SIGTERM has its default action in the worker."""
    return signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def blocked_signals() -> set[int]:
    """The signals blocked in the worker's main thread."""
    return {int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])}


def segfault():
    import ctypes

    ctypes.string_at(0)


def fork_lingering_grandchild(pidfile: str, seconds: float = 30):
    """Fork (without exec) a grandchild that outlives us and inherits every
    fd we have, then return."""
    pid = os.fork()
    if pid == 0:
        try:
            time.sleep(seconds)
        finally:
            os._exit(0)
    with open(pidfile, "a") as f:
        f.write(f"{pid}\n")
    print("worker done", flush=True)
    return 42


def _refuse_to_unpickle():
    raise RuntimeError("this object refuses to be unpickled")


class UnpicklableInLauncher:
    """Pickles fine in the worker; unpickling it fails in the launcher."""

    def __reduce__(self):
        return (_refuse_to_unpickle, ())


def return_unpicklable_in_launcher():
    return UnpicklableInLauncher()


def arg_digest(data: bytes):
    import hashlib

    return len(data), hashlib.sha256(data).hexdigest()


def burn_cpu(seconds: float) -> int:
    """Spin for about `seconds` of CPU time and touch ~32 MB."""
    block = bytearray(32 << 20)
    for i in range(0, len(block), 4096):
        block[i] = 1
    end = time.process_time() + seconds
    n = 0
    while time.process_time() < end:
        n += 1
    return len(block)


def loaded_modules(names: tuple[str, ...]) -> dict[str, bool]:
    return {name: name in sys.modules for name in names}


def exit_now(code: int = 0):
    """Exit at once, skipping everything (the fastest possible worker)."""
    os._exit(code)


def pipe_ends(readable: bool = False) -> list[str]:
    """The pipes this process can write to, or with ``readable`` read from
    (as /proc names such as 'pipe:[123]')."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
            with open(f"/proc/self/fdinfo/{name}") as f:
                flags = next(int(line.split()[1], 8) for line in f if line.startswith("flags:"))
        except OSError:
            continue  # the listing's own fd
        if target.startswith("pipe:") and (flags & os.O_ACCMODE == os.O_RDONLY) == readable:
            found.append(target)
    return sorted(found)


def pipe_write_ends() -> list[str]:
    """The pipes this worker can write to."""
    return pipe_ends()


def pipe_write_ends_after(go: str) -> list[str]:
    """pipe_write_ends() once the file ``go`` exists (the test looks at the
    launcher meanwhile, with every worker alive)."""
    while not os.path.exists(go):
        time.sleep(0.005)
    return pipe_write_ends()


def echo_env_and_return(name: str) -> str:
    """Write an env var to fds 1 and 2; return it."""
    value = os.environ[name]
    os.write(1, f"stdout {value}\n".encode())
    os.write(2, f"stderr {value}\n".encode())
    return value


def placement() -> tuple[str, str, str]:
    """Where this worker runs: (its CPUs, a new thread's CPUs, the memory
    policy of its first mapping), as /proc says."""
    def cpus(path: str) -> str:
        with open(path) as f:
            return next(line for line in f if line.startswith("Cpus_allowed_list:")).split()[1]

    seen: list[str] = []
    t = threading.Thread(target=lambda: seen.append(cpus(f"/proc/self/task/{threading.get_native_id()}/status")))
    t.start()
    t.join()
    with open("/proc/self/numa_maps") as f:
        policy = f.readline().split()[1]
    return cpus("/proc/self/status"), seen[0], policy


def interpreter_cmdline() -> str:
    """The command line of the interpreter this worker runs in (a forkserver
    worker: its forkserver's)."""
    with open("/proc/self/cmdline", "rb") as f:
        return f.read().decode()
