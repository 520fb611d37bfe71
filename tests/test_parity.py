"""The parity suite: one behaviour test body run against two implementations.

Every test takes the ``impl`` fixture, which is torchmp always and torch's
``torch.distributed.elastic.multiprocessing`` when torch is importable (the
uvloop pattern: one test body, two loops).  The expected values are torch
2.13's behaviour, observed, not read off torchmp; where torchmp differs on
purpose the test says so in a comment and asserts each side's value (those
differences are listed in docs/compat.md).

Covered: exit codes and the fields of failures, fail-fast (binary and
function contexts), function return values and error.json, redirect and tee
file layout and bytes, the teed console (in a driver subprocess), the root
cause and the report layout, timeouts, signals, close() and both
signatures of start_processes.
"""
from __future__ import annotations

import contextlib
import fnmatch
import json
import logging
import os
import re
import select
import signal
import subprocess
import sys
import textwrap
import time
import traceback
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

import torchmp
from helpers import pid_alive, wait_gone

from workers import parity as pw

PY = sys.executable
PERIOD = 0.05  # torch's wait() polls every `period` s; torchmp ignores it
HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
LINK_MSG = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
SYSTEM_TERMINATED = {"category": "system_terminated_error", "retryability": "False"}
TORCHMP_ORIGIN = str(Path(torchmp.__file__).resolve().parent.parent)


# --- the two implementations ----------------------------------------------------

def _namespace(name: str, module: str, errors_module: str) -> SimpleNamespace:
    import importlib

    mod = importlib.import_module(module)
    err = importlib.import_module(errors_module)
    return SimpleNamespace(
        name=name,
        module=module,
        errors_module=errors_module,
        start_processes=mod.start_processes,
        DefaultLogsSpecs=mod.DefaultLogsSpecs,
        Std=mod.Std,
        RunProcsResult=mod.RunProcsResult,
        SignalException=mod.SignalException,
        ProcessFailure=err.ProcessFailure,
        ChildFailedError=err.ChildFailedError,
        record=err.record,
        ErrorHandler=err.ErrorHandler,
    )


def _traceback_as_text(record: logging.LogRecord) -> bool:
    """A logging filter: the record's traceback as text (still shown), not
    as objects (which keep every frame of it alive)."""
    if record.exc_info:
        record.exc_text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
        record.exc_info = None
    return True


@pytest.fixture(params=["torchmp", pytest.param("torch", marks=pytest.mark.torch)])
def impl(request: pytest.FixtureRequest) -> SimpleNamespace:
    if request.param == "torch":
        pytest.importorskip("torch.distributed.elastic.multiprocessing",
                            reason="torch is not installed: the torch side of the parity suite")
        # torch logs a failed function worker with logger.exception(); the
        # record that pytest's log capture keeps holds the traceback, whose
        # frames keep the context -- and its queues' pipes -- alive past the
        # leak guard.  Keep the text of the traceback, drop the objects.
        logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
        logger.addFilter(_traceback_as_text)
        request.addfinalizer(lambda: logger.removeFilter(_traceback_as_text))
        # torch's ProcessFailure adds "errorTraits" to its module-level
        # _EMPTY_ERROR_DATA, the dict every file-less failure shares: put it
        # back as it was, so that this module leaves torch as it found it.
        from torch.distributed.elastic.multiprocessing import errors as torch_errors

        shared = torch_errors._EMPTY_ERROR_DATA
        saved = dict(shared)
        request.addfinalizer(lambda: (shared.clear(), shared.update(saved)))
        return _namespace("torch", "torch.distributed.elastic.multiprocessing",
                          "torch.distributed.elastic.multiprocessing.errors")
    return _namespace("torchmp", "torchmp", "torchmp.errors")


@pytest.fixture(scope="module", autouse=True)
def _multiprocessing_helpers():
    """torch's function contexts use multiprocessing's synchronisation
    objects, which start multiprocessing's resource tracker (a long-lived
    child) under spawn and forkserver.  Start it before the per-test leak
    guard takes its snapshot, and stop it when this module is done if it was
    this module that started it."""
    import importlib.util
    from multiprocessing import resource_tracker

    if importlib.util.find_spec("torch") is None:
        yield  # torchmp's function contexts do not use it
        return
    tracker = resource_tracker._resource_tracker
    started_here = getattr(tracker, "_pid", None) is None
    resource_tracker.ensure_running()
    yield
    if started_here:
        with contextlib.suppress(Exception):
            tracker._stop()


@pytest.fixture(autouse=True)
def _restore_signal_handlers():
    """start_processes() installs SignalException handlers on the main
    thread (both implementations): give pytest its own back."""
    saved = {s: signal.getsignal(s) for s in HANDLED_SIGNALS}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


# --- helpers ---------------------------------------------------------------------



def kill_leftovers(pids) -> None:
    """Last resort: SIGKILL, by process group then by pid, the given pids that
    are still our own live descendants (never anything found by name)."""
    try:
        ours = {p.pid for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        ours = set()
    for pid in pids:
        if pid in ours and pid_alive(pid):
            for kill in (os.killpg, os.kill):
                with contextlib.suppress(OSError):
                    kill(pid, signal.SIGKILL)


def wait_result(pc, timeout: float = -1):
    return pc.wait(timeout, period=PERIOD)


@contextlib.contextmanager
def launched(impl, name, entrypoint, args, envs=None, *, log_dir, redirects=None, tee=None,
             **kwargs):
    """start_processes with a DefaultLogsSpecs; closes the context (and kills
    anything left, by pid) whatever happens."""
    Std = impl.Std
    specs = impl.DefaultLogsSpecs(log_dir=str(log_dir),
                                  redirects=Std.NONE if redirects is None else redirects,
                                  tee=Std.NONE if tee is None else tee)
    if envs is None:
        envs = {rank: {} for rank in args}
    pc = impl.start_processes(name, entrypoint, args, envs, specs, **kwargs)
    pids = dict(pc.pids())
    try:
        yield pc
    finally:
        try:
            pc.close(timeout=2)
        finally:
            with contextlib.suppress(Exception):
                pids.update(pc.pids())
            kill_leftovers(pids.values())


def py_args(code: str, nprocs: int, *extra) -> dict[int, tuple]:
    """Binary args for `python -c code <rank> extra...` per rank."""
    code = textwrap.dedent(code)
    return {rank: ("-c", code, rank, *extra) for rank in range(nprocs)}


def attempt_dir_of(path: str) -> str:
    """`<log_dir>/<run_id>_<random>/attempt_0` of a rank's file path."""
    return os.path.dirname(os.path.dirname(path))


# --- driver subprocesses ------------------------------------------------------------

DRIVER_HEADER = """\
import json, os, signal, sys, time
from {module} import DefaultLogsSpecs, SignalException, Std, start_processes
PY = sys.executable
"""


def _driver_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (TORCHMP_ORIGIN, env.get("PYTHONPATH")) if p)
    env["PYTHONIOENCODING"] = "utf-8"  # the console encoding torch's tailer writes with
    return env


def popen_driver(impl, tmp_path: Path, body: str, *argv: str) -> subprocess.Popen:
    """A launcher program of its own (fd 1/2 are pipes we read), cwd tmp_path."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER_HEADER.format(module=impl.module) + textwrap.dedent(body))
    return subprocess.Popen([PY, str(script), *argv], cwd=tmp_path, env=_driver_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)


def finish_driver(proc: subprocess.Popen, timeout: float = 60) -> tuple[str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return out.decode(), err.decode()


def read_line(proc: subprocess.Popen, prefix: str, timeout: float = 30) -> str:
    """The first line of the driver's stdout that starts with prefix."""
    deadline = time.monotonic() + timeout
    buf = b""
    fd = proc.stdout.fileno()
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        buf += chunk
        complete = buf[: buf.rfind(b"\n") + 1]  # whole lines only
        for line in complete.decode(errors="replace").splitlines():
            if line.startswith(prefix):
                return line
    raise AssertionError(f"driver did not print {prefix!r}; got {buf!r}")


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
    args = {rank: (rank, 1, 3, 0.3, 30) for rank in range(3)}
    try:
        with launched(impl, "fff", pw.fail_or_sleep, args, log_dir=tmp_path,
                      start_method=start_method) as pc:
            pids = pc.pids()
            t0 = time.monotonic()
            result = wait_result(pc, timeout=40)
            elapsed = time.monotonic() - t0
            assert wait_gone(pids.values(), timeout=0.5) == []
    finally:
        _stop_forkservers(impl)
    assert result is not None, "wait() did not return although rank 1 failed"
    assert elapsed < 15
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


# ================================================================================
# redirects and tee: file layout and bytes
# ================================================================================

STREAMS_CODE = """
    import sys
    r = sys.argv[1]
    print("a" + r)
    print("b" + r, file=sys.stderr)
    print("c" + r)
"""


@pytest.mark.parametrize("config", ["redirect_all", "redirect_rank0_out", "tee_err_redirect_out"])
def test_redirect_tee_layout_and_bytes(impl, tmp_path, config):
    Std = impl.Std
    kw = {
        "redirect_all": {"redirects": Std.ALL},
        "redirect_rank0_out": {"redirects": {0: Std.OUT}},
        "tee_err_redirect_out": {"redirects": Std.OUT, "tee": Std.ERR},
    }[config]
    log_dir = tmp_path / "logs"
    with launched(impl, "rd", PY, py_args(STREAMS_CODE, 2), log_dir=log_dir, **kw) as pc:
        result = wait_result(pc, timeout=30)
    assert not result.is_failed()
    (run_dir,) = os.listdir(log_dir)
    assert fnmatch.fnmatch(run_dir, "test_run_id_*")
    attempt = log_dir / run_dir / "attempt_0"
    assert sorted(os.listdir(log_dir / run_dir)) == ["attempt_0"]
    assert sorted(os.listdir(attempt)) == ["0", "1"]

    def path(rank, stream):
        return str(attempt / str(rank) / f"{stream}.log")

    expected_out = {
        "redirect_all": {0: path(0, "stdout"), 1: path(1, "stdout")},
        "redirect_rank0_out": {0: path(0, "stdout"), 1: ""},
        "tee_err_redirect_out": {0: path(0, "stdout"), 1: path(1, "stdout")},
    }[config]
    expected_err = {
        "redirect_all": {0: path(0, "stderr"), 1: path(1, "stderr")},
        "redirect_rank0_out": {0: "", 1: ""},
        "tee_err_redirect_out": {0: path(0, "stderr"), 1: path(1, "stderr")},
    }[config]
    assert result.stdouts == expected_out
    assert result.stderrs == expected_err
    for rank in (0, 1):
        files = sorted(os.listdir(attempt / str(rank)))
        expected_files = sorted(
            os.path.basename(p) for p in (expected_out[rank], expected_err[rank]) if p)
        assert files == expected_files  # no error.json: nothing failed
        if expected_out[rank]:
            assert Path(expected_out[rank]).read_bytes() == f"a{rank}\nc{rank}\n".encode()
        if expected_err[rank]:
            assert Path(expected_err[rank]).read_bytes() == f"b{rank}\n".encode()


TEE_DRIVER = """
    log_dir, prefixes, only = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    prefixes = {int(k): v for k, v in prefixes.items()} if prefixes is not None else None
    code = "import sys; r = sys.argv[1]; print('a' + r); print('b' + r, file=sys.stderr); print('c' + r)"
    specs = DefaultLogsSpecs(log_dir=log_dir, tee=Std.ALL,
                             local_ranks_filter=set(only) if only is not None else None)
    pc = start_processes("trainer", PY, {0: ("-c", code, 0), 1: ("-c", code, 1)}, {0: {}, 1: {}},
                         specs, log_line_prefixes=prefixes)
    result = pc.wait(period=0.05)
    pc.close()
    sys.stdout.flush()
    print("RESULT " + json.dumps({"failed": result.is_failed(), "stdouts": result.stdouts,
                                  "stderrs": result.stderrs}), flush=True)
"""


@pytest.mark.parametrize("prefixes, only", [(None, None), ({"0": "[r0]:"}, None), (None, [1])],
                         ids=["default", "custom_rank0", "local_ranks_filter_1"])
def test_tee_console_lines(impl, tmp_path, prefixes, only):
    proc = popen_driver(impl, tmp_path, TEE_DRIVER, str(tmp_path / "logs"), json.dumps(prefixes),
                        json.dumps(only))
    out, err = finish_driver(proc)
    assert proc.returncode == 0, err
    result = json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:])
    assert result["failed"] is False
    prefix = {0: "[r0]:" if prefixes else "[trainer0]:", 1: "[trainer1]:"}
    shown = [0, 1] if only is None else only
    out_lines = [ln for ln in out.splitlines() if ln.startswith("[")]
    err_lines = [ln for ln in err.splitlines() if ln.startswith("[")]
    assert sorted(out_lines) == sorted(f"{prefix[r]}{x}{r}" for r in shown for x in "ac")
    assert sorted(err_lines) == sorted(f"{prefix[r]}b{r}" for r in shown)
    # each rank's lines keep their order
    for r in shown:
        assert [ln for ln in out_lines if ln.startswith(prefix[r])] == [f"{prefix[r]}a{r}", f"{prefix[r]}c{r}"]
    # the files hold the bytes, without prefixes -- for the ranks the filter
    # keeps off the console too
    for rank in (0, 1):
        assert Path(result["stdouts"][str(rank)]).read_bytes() == f"a{rank}\nc{rank}\n".encode()
        assert Path(result["stderrs"][str(rank)]).read_bytes() == f"b{rank}\n".encode()


TEE_EDGES_DRIVER = r"""
    code = "import os, sys; os.write(1, b'x\\xff\\xfey\\n'); sys.stdout.write('partial'); sys.stdout.flush()"
    pc = start_processes("trainer", PY, {0: ("-c", code)}, {0: {}},
                         DefaultLogsSpecs(log_dir=sys.argv[1], tee=Std.OUT))
    result = pc.wait(period=0.05)
    pc.close()
    print("END", flush=True)
    print(result.stdouts[0], file=sys.stderr)
"""


def test_tee_non_utf8_and_final_partial_line(impl, tmp_path):
    """DELIBERATE DIFFERENCES (README "What it does differently"): torchmp's
    console gets the worker's bytes untouched where torch's tailer decodes
    with errors="replace" (U+FFFD for each bad byte); and torchmp ends a
    final line that has no newline, where torch leaves the console in the
    middle of that line (the next output continues it).  The file holds the
    exact bytes both ways."""
    proc = popen_driver(impl, tmp_path, TEE_EDGES_DRIVER, str(tmp_path / "logs"))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    log = err.decode().strip().splitlines()[-1]
    assert Path(log).read_bytes() == b"x\xff\xfey\npartial"
    if impl.name == "torch":
        assert out == b"[trainer0]:x\xef\xbf\xbd\xef\xbf\xbdy\n[trainer0]:partialEND\n"
    else:
        assert out == b"[trainer0]:x\xff\xfey\n[trainer0]:partial\nEND\n"


def test_duplicate_filters_files(impl, tmp_path):
    code = """
        import sys
        r = sys.argv[1]
        print("keep a" + r)
        print("drop b" + r)
        print("keep e" + r, file=sys.stderr)
    """
    with launched(impl, "dup", PY, py_args(code, 2), log_dir=tmp_path, redirects=impl.Std.ALL,
                  tee={0: impl.Std.ALL}, duplicate_stdout_filters=["keep"],
                  duplicate_stderr_filters=["keep"]) as pc:
        result = wait_result(pc, timeout=30)
    assert not result.is_failed()
    attempt = Path(attempt_dir_of(result.stdouts[0]))
    assert sorted(os.listdir(attempt)) == ["0", "1", "filtered_stderr.log", "filtered_stdout.log"]
    # only teed ranks are filtered, with their prefix
    assert (attempt / "filtered_stdout.log").read_bytes() == b"[dup0]:keep a0\n"
    assert (attempt / "filtered_stderr.log").read_bytes() == b"[dup0]:keep e0\n"
    assert Path(result.stdouts[1]).read_bytes() == b"keep a1\ndrop b1\n"


def test_run_id_and_restart_count_layout(impl, tmp_path):
    code = "import os; print(os.environ['TORCHELASTIC_ERROR_FILE'])"
    envs = {0: {"TORCHELASTIC_RUN_ID": "myrun", "TORCHELASTIC_RESTART_COUNT": "2"}, 1: {}}
    with launched(impl, "ids", PY, py_args(code, 2), envs, log_dir=tmp_path,
                  redirects=impl.Std.OUT) as pc:
        result = wait_result(pc, timeout=30)
    (run_dir,) = os.listdir(tmp_path)
    assert fnmatch.fnmatch(run_dir, "myrun_*")
    attempt = tmp_path / run_dir / "attempt_2"
    for rank in (0, 1):
        assert result.stdouts[rank] == str(attempt / str(rank) / "stdout.log")
        # every rank's TORCHELASTIC_ERROR_FILE, from envs[0]'s ids
        assert Path(result.stdouts[rank]).read_text() == f"{attempt / str(rank) / 'error.json'}\n"
    assert result.stderrs == {0: "", 1: ""}


def test_start_errors(impl, tmp_path):
    specs = impl.DefaultLogsSpecs(log_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError) as e:
        impl.start_processes("x", str(tmp_path / "missing"), {0: ()}, {0: {}}, specs)
    assert e.value.errno == 2
    with pytest.raises(PermissionError) as e:
        impl.start_processes("x", "/etc/passwd", {0: ()}, {0: {}}, specs)
    assert e.value.errno == 13
    # The messages differ (torchmp names the missing and unexpected ranks);
    # the type both are caught as is torch's RuntimeError.
    with pytest.raises(RuntimeError, match="envs"):
        impl.start_processes("x", "true", {0: (), 1: ()}, {0: {}}, specs)
    with pytest.raises(RuntimeError, match="args"):
        impl.start_processes("x", "true", {0: (), 2: ()}, {0: {}, 2: {}}, specs)


# ================================================================================
# error.json: root cause and the report
# ================================================================================

ROOT_CAUSE_WORKER = """\
import os, signal, sys, time
from {errors_module} import record


@record
def main():
    rank = sys.argv[1]
    own_dir = os.path.dirname(os.environ["TORCHELASTIC_ERROR_FILE"])
    if rank == "1":
        # fail first, once rank 0 is ready to outlive fail-fast's SIGTERM
        while not os.path.exists(os.path.join(own_dir, "..", "0", "ready")):
            time.sleep(0.01)
        raise RuntimeError("rank 1 failed first")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(os.path.join(own_dir, "ready"), "w").close()
    while not os.path.exists(os.path.join(own_dir, "..", "1", "error.json")):
        time.sleep(0.01)
    time.sleep(1.1 - time.time() % 1)  # a later whole second than rank 1's
    raise RuntimeError("rank 0 failed later")


if __name__ == "__main__":
    main()
"""

def expected_failure(rank: int, message: str) -> str:
    """One rank's entry in torch 2.13's report of that run, masked."""
    return f"""[{rank}]:
  time      : <TIME>
  host      : <HOST>
  rank      : {rank} (local_rank: {rank})
  exitcode  : 1 (pid: <PID>)
  error_file: <ERROR_FILE>
  traceback : Traceback (most recent call last):
    File "<PATH>", line <N>, in wrapper
      return f(*args, **kwargs)
             ^^^^^^^^^^^^^^^^^^
    File "<PATH>", line <N>, in main
      raise RuntimeError("{message}")
  RuntimeError: {message}
"""


# torch 2.13's report for that run, ranks in order, with the variable parts
# masked (see mask_report).
EXPECTED_REPORT = f"""
============================================================
rootcause FAILED
------------------------------------------------------------
Failures:
{expected_failure(0, "rank 0 failed later")}
------------------------------------------------------------
Root Cause (first observed failure):
{expected_failure(1, "rank 1 failed first")}
============================================================"""


def mask_report(text: str) -> str:
    text = re.sub(r"(?m)^(  time      : ).*$", r"\1<TIME>", text)
    text = re.sub(r"(?m)^(  host      : ).*$", r"\1<HOST>", text)
    text = re.sub(r"\(pid: \d+\)", "(pid: <PID>)", text)
    text = re.sub(r"(?m)^(  error_file: ).*$", r"\1<ERROR_FILE>", text)
    text = re.sub(r'File "[^"]*", line \d+', 'File "<PATH>", line <N>', text)
    # DELIBERATE DIFFERENCE: torchmp marks the ranks it killed after the
    # first failure (rank 0 here got fail-fast's SIGTERM, ignored it and
    # failed on its own a second later); torch has no such marker.
    return text.replace(" [terminated by launcher]", "")


def test_error_json_root_cause_and_report(impl, tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(ROOT_CAUSE_WORKER.format(errors_module=impl.errors_module))
    log_dir = tmp_path / "logs"
    with launched(impl, "rootcause", PY, {0: (str(worker), 0), 1: (str(worker), 1)},
                  log_dir=log_dir) as pc:
        pids = pc.pids()
        result = wait_result(pc, timeout=40)
    assert result is not None
    assert sorted(result.failures) == [0, 1]
    f0, f1 = result.failures[0], result.failures[1]
    assert (f0.pid, f0.exitcode, f1.pid, f1.exitcode) == (pids[0], 1, pids[1], 1)
    for rank, f in ((0, f0), (1, f1)):
        assert fnmatch.fnmatch(f.error_file, f"{log_dir}/test_run_id_*/attempt_0/{rank}/error.json")
        assert f.message["message"] == f"RuntimeError: rank {rank} " + (
            "failed later" if rank == 0 else "failed first")
        assert f.timestamp == int(f.message["extraInfo"]["timestamp"])
    assert f1.timestamp < f0.timestamp
    # Both orders of the failures dict pick the same root cause.
    for failures in (result.failures, {1: f1, 0: f0}, {0: f0, 1: f1}):
        err = impl.ChildFailedError("rootcause", failures)
        rank, first = err.get_first_failure()
        assert (rank, first) == (1, f1)
    report = impl.ChildFailedError("rootcause", {0: f0, 1: f1}).format_msg()
    masked = mask_report(report)
    # Lines compared without trailing blanks (the template leaves a space
    # after "(pid: ...)" when there is no signal name, and the indented
    # traceback ends in "  "): that exact spacing is checked once here.
    assert [ln.rstrip() for ln in masked.split("\n")] == EXPECTED_REPORT.split("\n")
    assert masked.count("  exitcode  : 1 (pid: <PID>) \n") == 2
    assert f"error_file: {f1.error_file}\n" in report
    assert str(impl.ChildFailedError("rootcause", {0: f0, 1: f1})) == report


def test_error_file_round_trip(impl, tmp_path, monkeypatch):
    """ErrorHandler writes, ProcessFailure reads: torch's JSON shape, and a
    hand-written file of the plain {"message": str} shape."""
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    try:
        raise KeyError("missing")
    except KeyError as e:
        impl.ErrorHandler().record_exception(e)
    f = impl.ProcessFailure(local_rank=2, pid=1234, exitcode=1, error_file=str(error_file))
    assert f.error_file == str(error_file)
    assert f.message["message"] == "KeyError: 'missing'"
    assert f.message["extraInfo"]["py_callstack"].endswith("KeyError: 'missing'\n")
    assert f.timestamp == int(f.message["extraInfo"]["timestamp"])

    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"message": "by hand", "timestamp": 1700000000}))
    g = impl.ProcessFailure(local_rank=0, pid=1, exitcode=-6, error_file=str(plain))
    assert (g.message, g.timestamp, g.signal_name()) == ("by hand", 1700000000, "SIGABRT")
    plain.write_text(json.dumps({"message": "no time"}))
    h = impl.ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(plain))
    assert (h.message, h.timestamp) == ("no time", 0)
    # the plain shape's message is shown as is
    report = impl.ChildFailedError("x", {0: g}).format_msg()
    assert "  traceback : by hand\n" in report
    # torch's template puts a space before the " (SIGABRT)" it builds: two spaces
    assert "  exitcode  : -6 (pid: 1)  (SIGABRT)\n" in report


# ================================================================================
# timeouts
# ================================================================================

def test_wait_timeout_and_poll(impl, tmp_path):
    with launched(impl, "slow", PY, py_args("import time; time.sleep(30)", 2),
                  log_dir=tmp_path) as pc:
        pids = pc.pids()
        t0 = time.monotonic()
        assert pc.wait(0) is None
        assert time.monotonic() - t0 < 0.5
        t0 = time.monotonic()
        assert pc.wait(timeout=0.5, period=0.1) is None
        elapsed = time.monotonic() - t0
        assert 0.45 <= elapsed < 3
        assert all(pid_alive(p) for p in pids.values())
        pc.close()
        assert wait_gone(pids.values(), timeout=0.5) == []
        # After close() the result is decided: the ranks it terminated.
        result = pc.wait(0)
    assert result is not None and result.is_failed()
    assert {r: f.exitcode for r, f in result.failures.items()} == {0: -15, 1: -15}


def test_wait_timeout_returns_result_when_done(impl, tmp_path):
    with launched(impl, "quick", PY, py_args("pass", 2), log_dir=tmp_path) as pc:
        result = pc.wait(timeout=20, period=PERIOD)
    assert result is not None and result.return_values == {0: None, 1: None}


@pytest.mark.parametrize("kind", ["binary", "function"])
def test_close_timeout_kills_term_ignoring_worker(impl, tmp_path, kind):
    pidfile = tmp_path / "pids"
    if kind == "binary":
        script = Path(__file__).resolve().parent / "workers" / "ignore_term.py"
        entry, args, kw = PY, {0: (str(script), str(pidfile), 60)}, {}
    else:
        entry, args, kw = pw.ignore_term_and_sleep, {0: (str(pidfile), 60)}, {"start_method": "fork"}
    with launched(impl, "stubborn", entry, args, log_dir=tmp_path / "logs", **kw) as pc:
        pid = pc.pids()[0]
        deadline = time.monotonic() + 10
        while not (pidfile.exists() and pidfile.read_text().strip()):
            assert time.monotonic() < deadline, "worker did not start"
            time.sleep(0.01)
        t0 = time.monotonic()
        pc.close(timeout=1)
        elapsed = time.monotonic() - t0
        assert wait_gone([pid], timeout=0.5) == []
        result = pc.wait(0)
    assert 0.9 <= elapsed < 10
    assert {r: f.exitcode for r, f in result.failures.items()} == {0: -9}
    assert result.failures[0].signal_name() == "SIGKILL"


# ================================================================================
# signals
# ================================================================================

SIGNAL_DRIVER = """
    ready = sys.argv[2]
    code = ("import os, sys, time; open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid())); "
            "os.rename(sys.argv[1] + '.tmp', sys.argv[1]); time.sleep(30)")
    pc = start_processes("sleeper", PY, {0: ("-c", code, ready)}, {0: {}},
                         DefaultLogsSpecs(log_dir=sys.argv[1], redirects=Std.ALL))
    while not os.path.exists(ready):  # the rank is past its start-up
        time.sleep(0.01)
    try:
        print("READY", pc.pids()[0], flush=True)  # the signal may come at once
        pc.wait(period=0.05)
        print("NO SIGNAL", flush=True)
    except SignalException as e:
        print("SIGVAL", e.sigval.name, type(e.sigval).__name__, flush=True)
        pc.close(e.sigval, timeout=5)
        result = pc.wait(0)
        print("CLOSED", {r: f.exitcode for r, f in result.failures.items()}, flush=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_signal_to_launcher_raises_signal_exception(impl, tmp_path, sig):
    """start_processes() makes SIGTERM/SIGINT/... raise SignalException in the
    launcher (on its main thread); closing with e.sigval kills the ranks with
    that signal."""
    ready = tmp_path / "ready"
    proc = popen_driver(impl, tmp_path, SIGNAL_DRIVER, str(tmp_path / "logs"), str(ready))
    try:
        rank_pid = int(read_line(proc, "READY ").split()[1])
        assert rank_pid == int(ready.read_text())
        assert pid_alive(rank_pid)
        os.kill(proc.pid, sig)
        out, err = finish_driver(proc, timeout=30)
        assert proc.returncode == 0, err
        lines = out.splitlines()
        assert f"SIGVAL {sig.name} Signals" in lines
        assert f"CLOSED {{0: {-int(sig)}}}" in lines
        assert wait_gone([rank_pid], timeout=2) == []
    finally:
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        # The rank has a session of its own: kill it by its pid if the
        # driver left it behind (it is no child of ours by then).
        with contextlib.suppress(FileNotFoundError, ValueError):
            pid = int(ready.read_text())
            if pid_alive(pid) and "ready" in " ".join(psutil.Process(pid).cmdline()):
                for kill in (os.killpg, os.kill):
                    with contextlib.suppress(OSError):
                        kill(pid, signal.SIGKILL)


# ================================================================================
# close()
# ================================================================================

@pytest.mark.parametrize("kind", ["binary", "function"])
def test_close_is_idempotent_and_keeps_pids(impl, tmp_path, kind):
    if kind == "binary":
        entry, args, kw = PY, py_args("import time; time.sleep(30)", 2), {}
    else:
        entry, args, kw = pw.sleep_then_return, {0: (30,), 1: (30,)}, {"start_method": "fork"}
    with launched(impl, "closing", entry, args, log_dir=tmp_path, **kw) as pc:
        pids = pc.pids()
        assert sorted(pids) == [0, 1]
        assert all(pid_alive(p) for p in pids.values())
        pc.close()
        assert wait_gone(pids.values(), timeout=0.5) == []
        pc.close()
        pc.close(signal.SIGKILL, timeout=1)
        assert pc.pids() == pids


def test_close_with_death_sig(impl, tmp_path):
    with launched(impl, "killed", PY, py_args("import time; time.sleep(30)", 2),
                  log_dir=tmp_path) as pc:
        pids = pc.pids()
        pc.close(signal.SIGKILL)
        assert wait_gone(pids.values(), timeout=0.5) == []
        result = pc.wait(0)
    assert {r: f.exitcode for r, f in result.failures.items()} == {0: -9, 1: -9}
    assert {r: f.message for r, f in result.failures.items()} == {
        r: f"Signal 9 (SIGKILL) received by PID {pids[r]}" for r in (0, 1)}


def test_close_after_wait(impl, tmp_path):
    with launched(impl, "done", PY, py_args("pass", 1), log_dir=tmp_path) as pc:
        pids = pc.pids()
        result = wait_result(pc, timeout=20)
        pc.close()
        pc.close()
        assert pc.pids() == pids
    assert result.return_values == {0: None}


# ================================================================================
# both signatures
# ================================================================================

def test_torch2_signature_positional_and_keywords(impl, tmp_path):
    Std = impl.Std
    args = {0: ("-c", "print('hi')")}
    pc = impl.start_processes("pos", PY, args, {0: {}},
                              impl.DefaultLogsSpecs(log_dir=str(tmp_path / "a"), redirects=Std.OUT),
                              {0: "[p]:"}, "spawn")
    try:
        result = wait_result(pc, timeout=20)
    finally:
        pc.close()
    assert Path(result.stdouts[0]).read_bytes() == b"hi\n"
    pc = impl.start_processes(
        name="kw", entrypoint=PY, args=args, envs={0: {}},
        logs_specs=impl.DefaultLogsSpecs(log_dir=str(tmp_path / "b"), redirects=Std.OUT),
        log_line_prefixes=None, start_method="spawn", numa_options=None,
        duplicate_stdout_filters=None, duplicate_stderr_filters=None)
    try:
        result = wait_result(pc, timeout=20)
    finally:
        pc.close()
    assert Path(result.stdouts[0]).read_bytes() == b"hi\n"


def test_torch19_signature(impl, tmp_path):
    """DELIBERATE DIFFERENCE: torch 1.9's ``log_dir=``/``redirects=``/``tee=``
    form works in torchmp only; torch 2.13 has no such parameters."""
    Std = impl.Std
    log_dir = tmp_path / "logs19"
    kwargs = dict(name="old", entrypoint=PY, args={0: ("-c", "print('hi')")}, envs={0: {}},
                  log_dir=str(log_dir), redirects=Std.ALL)
    if impl.name == "torch":
        with pytest.raises(TypeError, match="log_dir"):
            impl.start_processes(**kwargs)
        assert not log_dir.exists()
        return
    pc = impl.start_processes(**kwargs)
    try:
        result = wait_result(pc, timeout=20)
    finally:
        pc.close()
    assert result.stdouts == {0: str(log_dir / "0" / "stdout.log")}
    assert (log_dir / "0" / "stdout.log").read_bytes() == b"hi\n"
    assert (log_dir / "0" / "stderr.log").read_bytes() == b""
