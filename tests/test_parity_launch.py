"""Parity with torch: binary and function launches, their results and failures, fail-fast.

Every test takes the ``impl`` fixture (tests/parity_helpers.py), which is
torchmp always and torch's ``torch.distributed.elastic.multiprocessing`` when
torch is importable (the uvloop pattern: one test body, two loops).  The
expected values are torch 2.13's behaviour, observed, not read off torchmp;
where torchmp differs on purpose the test says so in a comment and asserts
each side's value (those differences are listed in docs/compat.md).
"""
from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import signal
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from helpers import wait_gone
from parity_helpers import LINK_MSG, PY, SYSTEM_TERMINATED, attempt_dir_of, launched, py_args, wait_result
from workers import parity as pw

pytestmark = pytest.mark.usefixtures("multiprocessing_helpers", "restore_signal_handlers")


# ================================================================================
# binary launches: results and failures
# ================================================================================

def test_binary_success_return_values(impl, tmp_path):
    args = py_args("import sys; sys.exit(0)", 3)
    with launched(impl, "ok", PY, args, log_dir=tmp_path) as pc:
        pids = pc.pids()
        result = wait_result(pc)
    assert isinstance(result, impl.RunProcsResult)
    assert result.is_failed() is False
    assert result.return_values == {0: None, 1: None, 2: None}
    assert result.failures == {}
    assert result.stdouts == {0: "", 1: "", 2: ""}
    assert result.stderrs == {0: "", 1: "", 2: ""}
    assert sorted(pids) == [0, 1, 2]
    assert wait_gone(pids.values()) == []


def test_binary_exit_code_failure_fields(impl, tmp_path):
    # rank 0 succeeds at once, rank 1 exits 7 a moment later
    code = """
        import sys, time
        if sys.argv[1] == "1":
            time.sleep(0.3)
            sys.exit(7)
    """
    with launched(impl, "exit7", PY, py_args(code, 2), log_dir=tmp_path) as pc:
        pids = pc.pids()
        before = time.time()
        result = wait_result(pc)
    assert result.is_failed()
    assert result.return_values == {}
    assert list(result.failures) == [1]
    f = result.failures[1]
    assert isinstance(f, impl.ProcessFailure)
    assert (f.local_rank, f.pid, f.exitcode) == (1, pids[1], 7)
    # The rank never wrote TORCHELASTIC_ERROR_FILE: no file.
    assert f.error_file == "<N/A>"
    assert f.error_file_data == {"message": "<NONE>", "errorTraits": SYSTEM_TERMINATED}
    # torch's generic text (torchmp's too; see the next test for a captured stderr)
    assert f.message == LINK_MSG
    assert f.signal_name() == "<N/A>"
    assert type(f.timestamp) is int
    assert int(before) - 1 <= f.timestamp <= time.time() + 1
    assert f.timestamp_isoformat() == datetime.fromtimestamp(f.timestamp).isoformat(sep="_")
    assert wait_gone(pids.values()) == []


def test_binary_signal_death_fields(impl, tmp_path):
    # rank 0 SIGKILLs itself; rank 1 sleeps and is terminated by fail-fast.
    code = """
        import os, signal, sys, time
        if sys.argv[1] == "0":
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(30)
    """
    with launched(impl, "sig", PY, py_args(code, 2), log_dir=tmp_path) as pc:
        pids = pc.pids()
        result = wait_result(pc, timeout=20)
    assert result is not None and result.is_failed()
    assert sorted(result.failures) == [0, 1]
    f0, f1 = result.failures[0], result.failures[1]
    assert (f0.pid, f0.exitcode, f0.signal_name()) == (pids[0], -9, "SIGKILL")
    assert (f1.pid, f1.exitcode, f1.signal_name()) == (pids[1], -15, "SIGTERM")
    # Deaths by signal whose stderr is not captured: the same message both ways.
    assert f0.message == f"Signal 9 (SIGKILL) received by PID {pids[0]}"
    assert f1.message == f"Signal 15 (SIGTERM) received by PID {pids[1]}"
    for f in (f0, f1):
        assert f.error_file == "<N/A>"
        # Only "message" is compared: torch's ProcessFailure adds errorTraits
        # to a module-level dict that every file-less failure shares, so after
        # any exit-code failure in the process its signal failures carry
        # errorTraits too; torchmp gives each failure its own dict.
        assert f.error_file_data["message"] == "<NONE>"
        assert type(f.timestamp) is int
    assert wait_gone(pids.values()) == []


def test_binary_failure_message_with_captured_stderr(impl, tmp_path):
    """A rank whose stderr is redirected fails with a Python traceback and no
    error file: ``message`` is torch's generic text both ways.

    DELIBERATE DIFFERENCE, in the report only: torchmp keeps the tail of a
    failed rank's captured stderr, and ChildFailedError's "traceback" field
    shows the traceback found there, where torch's shows ``message``.
    """
    code = """
        import sys, time
        if sys.argv[1] == "0":
            raise ValueError("bad input")
        time.sleep(30)
    """
    # rank 0 fails with a traceback on its stderr; rank 1 is then terminated
    with launched(impl, "tail", PY, py_args(code, 2), log_dir=tmp_path,
                  redirects=impl.Std.ERR) as pc:
        pids = pc.pids()
        result = wait_result(pc, timeout=20)
    f0, f1 = result.failures[0], result.failures[1]
    assert (f0.exitcode, f0.error_file) == (1, "<N/A>")
    assert f0.error_file_data == {"message": "<NONE>", "errorTraits": SYSTEM_TERMINATED}
    assert f0.message == LINK_MSG
    assert f1.exitcode == -15
    assert f1.message == f"Signal 15 (SIGTERM) received by PID {pids[1]}"
    stderr0 = Path(result.stderrs[0]).read_bytes()
    assert stderr0.startswith(b"Traceback (most recent call last):\n")
    assert stderr0.endswith(b"ValueError: bad input\n")
    assert Path(result.stderrs[1]).read_bytes() == b""
    report = impl.ChildFailedError("tail", {0: f0}).format_msg()
    if impl.name == "torch":
        assert f"  traceback : {LINK_MSG}\n" in report
    else:
        assert "  traceback : Traceback (most recent call last):\n" in report
        assert "\n  ValueError: bad input\n" in report
        assert f0.headline == "ValueError: bad input"  # torchmp's one-line summary


# ================================================================================
# fail-fast
# ================================================================================

# Rank 1 exits 3 after 0.3 s; the others would sleep 30 s.
RANK_1_FAILS = """
    import sys, time
    if sys.argv[1] == "1":
        time.sleep(0.3)
        sys.exit(3)
    time.sleep(30)
"""


def test_fail_fast_binary(impl, tmp_path):
    with launched(impl, "ff", PY, py_args(RANK_1_FAILS, 3), log_dir=tmp_path) as pc:
        pids = pc.pids()
        t0 = time.monotonic()
        result = wait_result(pc, timeout=25)
        elapsed = time.monotonic() - t0
        assert wait_gone(pids.values(), timeout=0.5) == []
    assert result is not None, "wait() did not return although rank 1 failed"
    assert elapsed < 10
    # Binary contexts report the terminated siblings too.
    assert {r: f.exitcode for r, f in result.failures.items()} == {0: -15, 1: 3, 2: -15}
    assert {r: f.pid for r, f in result.failures.items()} == pids
    # The root cause is the rank that failed by itself.
    rank, first = impl.ChildFailedError("ff", result.failures).get_first_failure()
    assert (rank, first.exitcode) == (1, 3)


def test_failures_listed_in_observed_order(impl, tmp_path):
    """torch's binary context lists the failures in the order it saw them:
    the rank that failed first, then the siblings fail-fast terminated.  The
    report's [idx] numbers follow that order."""
    with launched(impl, "order", PY, py_args(RANK_1_FAILS, 3), log_dir=tmp_path) as pc:
        result = wait_result(pc, timeout=25)
    assert list(result.failures) == [1, 0, 2]


@pytest.mark.parametrize("start_method", ["spawn", "fork", "forkserver"])
def test_fail_fast_function(impl, tmp_path, start_method):
    # The siblings sleep 120 s: a result well before that is fail-fast.  The
    # margin is wide because the time counts the workers' start too, and a
    # spawned torch worker imports torch (21 s seen on a CI with two extra
    # CPU hogs).
    args = {rank: (rank, 1, 3, 0.3, 120) for rank in range(3)}
    try:
        with launched(impl, "fff", pw.fail_or_sleep, args, log_dir=tmp_path,
                      start_method=start_method) as pc:
            pids = pc.pids()
            t0 = time.monotonic()
            result = wait_result(pc, timeout=100)
            elapsed = time.monotonic() - t0
            assert wait_gone(pids.values(), timeout=0.5) == []
    finally:
        _stop_forkservers(impl)
    assert result is not None, "wait() did not return although rank 1 failed"
    assert elapsed < 90
    # Function contexts report only the rank that failed by itself.
    assert list(result.failures) == [1]
    f = result.failures[1]
    assert (f.local_rank, f.pid, f.exitcode) == (1, pids[1], 3)
    assert f.error_file == "<N/A>"  # sys.exit(3) is not recorded
    assert f.signal_name() == "<N/A>"
    assert result.return_values == {}


def _stop_forkservers(impl) -> None:
    """Each implementation's forkserver is a child of ours: stop it so that the
    leak guard does not count it."""
    if impl.name == "torchmp":
        from torchmp._launch import forkserver as _forkserver

        _forkserver.get_forkserver()._stop()
    else:
        from multiprocessing import forkserver

        with contextlib.suppress(Exception):
            forkserver._forkserver._stop()


# ================================================================================
# function launches
# ================================================================================

def test_function_return_values(impl, tmp_path):
    args = {0: (2, "PARITY_VAR"), 1: (3, "PARITY_VAR")}
    envs = {0: {"PARITY_VAR": "zero"}, 1: {"PARITY_VAR": "one"}}
    with launched(impl, "fn", pw.square_with_env, args, envs, log_dir=tmp_path,
                  start_method="spawn") as pc:
        pids = pc.pids()
        result = wait_result(pc, timeout=60)
    assert result is not None and not result.is_failed()
    assert result.return_values == {
        0: {"x": 2, "square": 4, "env": "zero"},
        1: {"x": 3, "square": 9, "env": "one"},
    }
    assert result.failures == {}
    assert result.stdouts == {0: "", 1: ""}
    assert result.stderrs == {0: "", 1: ""}
    assert wait_gone(pids.values()) == []


def test_function_exception_error_file(impl, tmp_path):
    with launched(impl, "boom", pw.raise_runtime_error, {0: ("boom",)}, log_dir=tmp_path,
                  start_method="fork") as pc:
        pids = pc.pids()
        result = wait_result(pc, timeout=30)
    assert list(result.failures) == [0]
    f = result.failures[0]
    assert (f.local_rank, f.pid, f.exitcode) == (0, pids[0], 1)
    assert fnmatch.fnmatch(f.error_file, f"{tmp_path}/test_run_id_*/attempt_0/0/error.json")
    assert json.loads(Path(f.error_file).read_text()) == f.error_file_data
    inner = f.error_file_data["message"]
    assert inner["message"] == "RuntimeError: boom"
    stack = inner["extraInfo"]["py_callstack"]
    assert stack.startswith("Traceback (most recent call last):\n")
    assert "in raise_runtime_error\n" in stack
    assert stack.endswith("RuntimeError: boom\n")
    # message is the inner dict (torch's behaviour), timestamp from the file
    assert f.message == inner
    assert type(f.timestamp) is int
    assert f.timestamp == int(inner["extraInfo"]["timestamp"])
    assert abs(f.timestamp - time.time()) < 60
    assert f.signal_name() == "<N/A>"
    report = str(impl.ChildFailedError("boom", result.failures))
    assert "  traceback : Traceback (most recent call last):\n" in report
    assert "RuntimeError: boom" in report


def test_function_signal_death(impl, tmp_path):
    with launched(impl, "fnkill", pw.sleep_then_return, {0: (30,), 1: (30,)}, log_dir=tmp_path,
                  start_method="fork") as pc:
        pids = pc.pids()
        time.sleep(0.2)
        os.kill(pids[0], signal.SIGKILL)
        result = wait_result(pc, timeout=20)
        assert wait_gone(pids.values(), timeout=0.5) == []
    assert list(result.failures) == [0]
    f = result.failures[0]
    assert (f.pid, f.exitcode, f.signal_name()) == (pids[0], -9, "SIGKILL")
    assert f.message == f"Signal 9 (SIGKILL) received by PID {pids[0]}"
    assert f.error_file == "<N/A>"
    assert f.error_file_data["message"] == "<NONE>"  # see test_binary_signal_death_fields


def test_function_redirects_fd_level(impl, tmp_path, monkeypatch):
    # As in a real launcher, sys.stdout/sys.stderr write to fds 1/2: pytest's
    # capture replaces them with objects on files of its own, and torch
    # redirects the fd of whatever sys.stdout is (sys.stdout.fileno()), so a
    # forked worker's os.write(1, ...) would miss torch's log file here.
    monkeypatch.setattr(sys, "stdout", sys.__stdout__)
    monkeypatch.setattr(sys, "stderr", sys.__stderr__)
    with launched(impl, "fnout", pw.write_streams, {0: (0,), 1: (1,)}, log_dir=tmp_path,
                  redirects={0: impl.Std.ALL, 1: impl.Std.ERR}, start_method="fork") as pc:
        result = wait_result(pc, timeout=30)
    assert not result.is_failed()
    assert result.return_values == {0: None, 1: None}
    attempt = attempt_dir_of(result.stdouts[0])
    assert result.stdouts == {0: f"{attempt}/0/stdout.log", 1: ""}
    assert result.stderrs == {0: f"{attempt}/0/stderr.log", 1: f"{attempt}/1/stderr.log"}
    assert Path(result.stdouts[0]).read_bytes() == b"out 0\nfd out 0\n"
    assert Path(result.stderrs[0]).read_bytes() == b"err 0\nfd err 0\n"
    assert Path(result.stderrs[1]).read_bytes() == b"err 1\nfd err 1\n"
