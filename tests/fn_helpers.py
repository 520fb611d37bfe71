"""Shared by the tests of function entrypoints (tests/test_functions*.py):
the start methods, the launch helpers, the forkserver hygiene fixture and
what the workers of tests/workers/functions.py write.

Kept out of workers/functions.py, which spawn and forkserver workers import and
which must stay light.
"""
from __future__ import annotations

import signal
import sys

import pytest

from torchmp import RunProcsResult
from torchmp._launch import forkserver as _forkserver

from helpers import launch

METHODS = ("spawn", "fork", "forkserver")
PICKLING_METHODS = ("spawn", "forkserver")
MB = 1 << 20


def server_pid() -> int | None:
    server = _forkserver._server
    if server is None or server._group is None:
        return None
    return server._group.snapshot()[1][0][1]


@pytest.fixture(autouse=True)
def forkserver_hygiene():
    """Each test starts with no forkserver and ends with none: a server
    started during a test is stopped (and reaped) before the leak guard
    looks for leftover children and fds."""
    _forkserver.get_forkserver()._stop()
    _forkserver.set_forkserver_preload([])
    yield
    _forkserver.set_forkserver_preload([])
    _forkserver.get_forkserver()._stop()


def use_fd_level_std(monkeypatch) -> None:
    """Make sys.stdout/sys.stderr write to fds 1/2, as in a real launcher.

    pytest's capture replaces them with objects writing to a file of its own;
    a forked worker would inherit those objects (see
    test_fork_worker_print_reaches_the_log_when_sys_stdout_is_not_fd_1)."""
    monkeypatch.setattr(sys, "stdout", sys.__stdout__)
    monkeypatch.setattr(sys, "stderr", sys.__stderr__)


def start(tmp_path, fn, args, start_method, envs=None, *, log_dir=None, **kw):
    return launch(fn, args, envs, log_dir=log_dir or tmp_path / "logs", start_method=start_method, **kw)


def run(tmp_path, fn, args, start_method, envs=None, *, timeout=30, **kw) -> RunProcsResult:
    """Launch, wait for the result, and always close (killing the groups)."""
    ctx = start(tmp_path, fn, args, start_method, envs, **kw)
    try:
        result = ctx.wait(timeout)
    finally:
        ctx.close(signal.SIGKILL, timeout=5)
    assert result is not None, f"no result within {timeout}s"
    return result


def expected_streams(rank: int) -> tuple[bytes, bytes]:
    """What fw.write_everywhere(rank) writes to fd 1 and fd 2, in order."""
    out = (f"print {rank}\nos.write {rank}\nlibc printf {rank}\nlibc puts\nfrom-child {rank}\n".encode()
           + b"non-utf8 \xff\xfe\x00 bytes\n"
           + f"tail {rank} (unflushed, no newline)".encode())
    err = f"from-child-err {rank}\nprint err {rank}\nos.write err\n".encode()
    return out, err


def _make_local():
    offset = 10

    def local(x):
        return x + offset

    return local


UNPICKLABLE = {
    "lambda": (lambda x: x * 2, 21, 42),
    "local": (_make_local(), 5, 15),
}
