"""Function entrypoints: what is particular to the fork start method (the
tests of every start method are in test_functions.py).

The torch 1.9 signature, print() when sys.stdout is not fd 1, entrypoints
that cannot be pickled, forking from a thread, exits seen while the I/O
thread is busy, and a fork failing half way through a launch.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import pytest

import torchmp
from torchmp import Std, _core

from workers import functions as fw
from fn_helpers import UNPICKLABLE, expected_streams, run, start, use_fd_level_std
from fn_helpers import forkserver_hygiene  # noqa: F401 (autouse: a fixture of this module)
from helpers import launch, pid_alive


def test_torch_19_signature_with_a_function(tmp_path, monkeypatch):
    use_fd_level_std(monkeypatch)
    log_dir = tmp_path / "legacy"
    ctx = torchmp.start_processes("trainer", fw.write_everywhere, {0: (0,), 1: (1,)}, {0: {}, 1: {}},
                                  str(log_dir), "fork", Std.ALL, Std.NONE)
    try:
        result = ctx.wait(30)
    finally:
        ctx.close()
    assert result.return_values == {0: 0, 1: 1}
    for rank in (0, 1):
        assert result.stdouts[rank] == str(log_dir / str(rank) / "stdout.log")
        assert (log_dir / str(rank) / "stdout.log").read_bytes() == expected_streams(rank)[0]
        assert (log_dir / str(rank) / "stderr.log").read_bytes() == expected_streams(rank)[1]


def test_fork_worker_print_reaches_the_log_when_sys_stdout_is_not_fd_1(tmp_path, monkeypatch):
    # pytest capture, Jupyter, or a launcher that reassigned sys.stdout: the
    # worker must still print() to its fd 1, where the redirect is.
    elsewhere = open(tmp_path / "launcher-own-stdout.txt", "w")
    try:
        monkeypatch.setattr(sys, "stdout", elsewhere)
        result = run(tmp_path, fw.write_everywhere, {0: (0,)}, "fork", redirects=Std.ALL)
    finally:
        monkeypatch.undo()
        elsewhere.close()
    assert (tmp_path / "launcher-own-stdout.txt").read_text() == ""
    assert Path(result.stdouts[0]).read_bytes() == expected_streams(0)[0]


def test_wait_again_after_an_unpickling_error_does_not_report_success(tmp_path):
    ctx = start(tmp_path, fw.return_unpicklable_in_launcher, {0: ()}, "fork")
    try:
        with pytest.raises(RuntimeError):
            ctx.wait(30)
    finally:
        ctx.close()
    with pytest.raises(RuntimeError, match="could not be unpickled"):
        ctx.wait(0)


@pytest.mark.parametrize("kind", sorted(UNPICKLABLE))
def test_unpicklable_entrypoint_works_with_fork(tmp_path, kind):
    fn, arg, expected = UNPICKLABLE[kind]
    result = run(tmp_path, fn, {0: (arg,), 1: (arg + 1,)}, "fork")
    assert not result.is_failed(), result.failures
    assert result.return_values == {0: expected, 1: fn(arg + 1)}


def test_fork_from_a_non_main_thread(tmp_path):
    box: dict[str, object] = {}

    def body():
        try:
            ctx = start(tmp_path, fw.ident, {0: (), 1: ()}, "fork")
            try:
                box["pids"] = ctx.pids()
                box["result"] = ctx.wait(30)
            finally:
                ctx.close(signal.SIGKILL, timeout=5)
        except BaseException as e:  # reported below
            box["error"] = e

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(60)
    assert not thread.is_alive()
    assert "error" not in box, box.get("error")
    result = box["result"]
    assert not result.is_failed(), result.failures
    pids = box["pids"]
    # (pid, ppid, is the main thread): the worker is a child of this process
    # and its forking thread became its main thread.
    assert result.return_values == {r: (pids[r], os.getpid(), True) for r in (0, 1)}


class _DevNullTee:
    """Logs specs teeing stdout into /dev/null: output that only keeps the
    I/O thread busy, without filling a disk."""

    root_log_dir = os.devnull

    def reify(self, envs):
        from torchmp import LogsDest

        n = len(envs)
        return LogsDest(stdouts=dict.fromkeys(range(n), os.devnull), stderrs=dict.fromkeys(range(n), ""),
                        tee_stdouts=dict.fromkeys(range(n), os.devnull), error_files=dict.fromkeys(range(n), ""))


def test_fork_worker_exiting_at_once_is_seen_while_the_io_thread_is_busy(tmp_path, monkeypatch):
    monkeypatch.setattr(torchmp._native, "KILL_GRACE_SECONDS", 0.5)
    # Keep the I/O thread busy copying a flood of teed output (to /dev/null,
    # console included), so the wake-ups of a launch pile up behind it.
    # Both consoles: fd 1 and sys.stdout.  Under pytest's capture sys.stdout
    # is its own file object, which a teed stream is written to (not fd 1):
    # left alone, the flood went there, gigabytes that pytest then kept in
    # memory for the run's report (the process 1.2 GB bigger after this test).
    console = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    monkeypatch.setattr(sys, "stdout", open(os.devnull, "w"))
    flood = None
    try:
        os.dup2(null, 1)
        flood = torchmp.start_processes("flood", "sh", {0: ("-c", "exec cat /dev/zero",)}, {0: {}}, _DevNullTee())
        for i in range(100):
            ctx = start(tmp_path, fw.exit_now, {r: (0,) for r in range(4)}, "fork", log_dir=tmp_path / f"l{i}")
            try:
                result = ctx.wait(2)
            finally:
                ctx.close(signal.SIGKILL, timeout=0.5)
            assert result is not None, f"launch {i}: a worker's exit was never seen"
            # os._exit(0) skips the return value: each exit is seen and reported.
            assert {r: f.exitcode for r, f in result.failures.items()} == {0: 0, 1: 0, 2: 0, 3: 0}
    finally:
        if flood is not None:
            flood.close(signal.SIGKILL, timeout=1)
        os.dup2(console, 1)
        os.close(console)
        os.close(null)
        sys.stdout.close()


class _ForkFailsAt(_core.Group):
    """A native group whose fork of one rank fails (as fork() does under
    RLIMIT_NPROC or memory pressure), or is interrupted by a signal."""

    fail_rank = 0
    error: BaseException = OSError(11, "fork: Resource temporarily unavailable")
    forked: list[int] = []

    def fork_rank(self, rank, *args):
        if rank == self.fail_rank:
            raise self.error
        pid, ret_fd = super().fork_rank(rank, *args)
        if pid:
            type(self).forked.append(pid)
        return pid, ret_fd


@pytest.mark.parametrize("error", [OSError(11, "fork: Resource temporarily unavailable"), KeyboardInterrupt()],
                         ids=["EAGAIN", "interrupt"])
def test_a_fork_failing_half_way_tears_down_the_ranks_started(tmp_path, monkeypatch, error):
    use_fd_level_std(monkeypatch)
    group_class = type("Group", (_ForkFailsAt,), {"fail_rank": 2, "error": error, "forked": []})
    monkeypatch.setattr(_core, "Group", group_class)
    with pytest.raises(type(error)):
        launch(fw.announce_and_sleep, {r: (str(tmp_path / f"pid{r}"),) for r in range(4)},
               log_dir=tmp_path / "logs", start_method="fork", tee=Std.ALL)
    assert len(group_class.forked) == 2
    for pid in group_class.forked:
        # killed and reaped by the launcher, not left to the leak guard
        assert not pid_alive(pid)
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
