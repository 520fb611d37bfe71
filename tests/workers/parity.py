"""Worker functions for tests/test_parity_*.py (function launches).

They live in a module of their own so that spawn and forkserver workers --
of torchmp and of torch's implementation alike -- can unpickle them by
reference (tests/ is on sys.path, and sys.path travels to spawned workers).
"""
from __future__ import annotations

import os
import sys
import time


def echo(value):
    """Return the argument unchanged."""
    return value


def square_with_env(x: int, name: str):
    """A rank-specific value plus what the rank sees of its environment."""
    return {"x": x, "square": x * x, "env": os.environ.get(name)}


def raise_runtime_error(message: str):
    raise RuntimeError(message)


def fail_or_sleep(rank: int, failing_rank: int, code: int, delay: float, sleep: float):
    """The failing rank exits with ``code`` after ``delay`` s; the others sleep."""
    if rank == failing_rank:
        time.sleep(delay)
        sys.exit(code)
    time.sleep(sleep)
    return rank


def sleep_then_return(seconds: float, value=None):
    time.sleep(seconds)
    return value


def write_streams(rank: int) -> None:
    """Write to stdout and stderr through Python and through the raw fds."""
    print(f"out {rank}")
    print(f"err {rank}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(1, f"fd out {rank}\n".encode())
    os.write(2, f"fd err {rank}\n".encode())


def ignore_term_and_sleep(pidfile: str, seconds: float) -> None:
    """Ignore SIGTERM, announce the pid, then sleep."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(pidfile, "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(seconds)
