"""Function entrypoints, the same tests under spawn, fork and forkserver.

Return values, environments, fd-level redirects and tee, error.json, exit
codes and signals, pickling errors, fail-fast, process-group cleanup, the
``__main__`` guard and fd hygiene.  What is particular to one start method
is in test_functions_spawn.py, test_functions_fork.py and
test_functions_forkserver.py; the shared helpers are in fn_helpers.py, the
worker functions in tests/workers/functions.py (so spawn and forkserver workers can
import them).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

import torchmp
from torchmp import ProcessFailure, Std
from torchmp.errors import ChildFailedError

from workers import functions as fw
from fn_helpers import (MB, METHODS, PICKLING_METHODS, UNPICKLABLE, expected_streams, run, server_pid, start,
                        use_fd_level_std)
from fn_helpers import forkserver_hygiene  # noqa: F401 (autouse: a fixture of this module)
from helpers import kill_groups, pid_alive, popen_launcher, read_pids, wait_gone


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def read_error_json(failure: ProcessFailure) -> dict:
    return json.loads(Path(failure.error_file).read_text())


def all_exited(ctx) -> bool:
    """The I/O thread has recorded every rank's exit (without calling wait)."""
    from torchmp import _core

    _, ranks = ctx._group.snapshot()
    return all(info[0] == _core.PROC_EXITED for info in ranks)


# --- return values ------------------------------------------------------------

@pytest.mark.parametrize("start_method", METHODS)
def test_return_values_come_back_exactly_rank_by_rank(tmp_path, start_method):
    ctx = start(tmp_path, fw.return_rich, {r: (r,) for r in range(5)}, start_method)
    try:
        pids = ctx.pids()
        result = ctx.wait(60)
    finally:
        ctx.close(signal.SIGKILL, timeout=5)
    assert not result.is_failed(), result.failures
    values = result.return_values
    assert sorted(values) == [0, 1, 2, 3, 4]
    assert values[0] == {"rank": 0, "nested": {"a": [1, 2.5, None], "b": (True, False)}, 3: "int key"}
    assert values[1] is None
    assert type(values[2]) is fw.Payload and values[2] == fw.Payload(2, ("x", "y"), {"loss": [0.5, 0.25]})
    assert values[3] == [frozenset({1, 2}), b"\x00\xff raw", "caf\u00e9", 2**70, -0.0]
    assert str(values[3][4]) == "-0.0"
    assert values[4] == (4, pids[4])  # rank 4's value came from rank 4's process
    assert set(result.failures) == set()


@pytest.mark.parametrize("start_method", METHODS)
def test_64mb_return_value_while_launcher_is_not_waiting(tmp_path, start_method):
    size = 64 * MB
    ctx = start(tmp_path, fw.return_big, {0: (0, size), 1: (1, 1000)}, start_method)
    try:
        pids = list(ctx.pids().values())
        time.sleep(1.0)
        # The I/O thread drains the return pipes on its own: the workers
        # finish without the launcher calling wait().
        assert wait_gone(pids, 20) == []
        result = ctx.wait(30)
    finally:
        ctx.close(signal.SIGKILL, timeout=5)
    assert not result.is_failed(), result.failures
    value = result.return_values[0]
    assert type(value) is bytes and len(value) == size
    assert value == fw.big_bytes(0, size)
    assert result.return_values[1] == fw.big_bytes(1, 1000)


@pytest.mark.parametrize("start_method", METHODS)
def test_return_value_survives_close_before_wait(tmp_path, start_method):
    ctx = start(tmp_path, fw.return_arg, {0: ({"k": [1, 2]},)}, start_method)
    try:
        deadline = time.monotonic() + 20
        while not all_exited(ctx) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all_exited(ctx)
    finally:
        ctx.close()
    result = ctx.wait(0)
    assert not result.is_failed() and result.return_values == {0: {"k": [1, 2]}}


# --- environment --------------------------------------------------------------

@pytest.mark.parametrize("start_method", METHODS)
def test_each_worker_sees_its_envs_before_the_function_runs(tmp_path, start_method, monkeypatch):
    monkeypatch.setenv("TORCHMP_T_INHERITED", "from-launcher")
    monkeypatch.setenv("TORCHMP_T_OVERRIDDEN", "launcher-value")
    names = ("LOCAL_RANK", "TORCHMP_T_STR", "TORCHMP_T_FLOAT", "TORCHMP_T_INHERITED",
             "TORCHMP_T_OVERRIDDEN", "TORCHELASTIC_ERROR_FILE", "TORCHMP_T_ONLY_RANK1")
    envs = {
        0: {"LOCAL_RANK": 0, "TORCHMP_T_STR": "zero", "TORCHMP_T_FLOAT": 0.5,
            "TORCHMP_T_OVERRIDDEN": "rank0"},
        1: {"LOCAL_RANK": 1, "TORCHMP_T_STR": "one \u00e9", "TORCHMP_T_FLOAT": 1.5,
            "TORCHMP_T_OVERRIDDEN": "rank1", "TORCHMP_T_ONLY_RANK1": True},
    }
    ctx = start(tmp_path, fw.read_env, {0: (names,), 1: (names,)}, start_method, envs)
    try:
        result = ctx.wait(60)
    finally:
        ctx.close(signal.SIGKILL, timeout=5)
    assert not result.is_failed(), result.failures
    assert result.return_values[0] == {
        "LOCAL_RANK": "0", "TORCHMP_T_STR": "zero", "TORCHMP_T_FLOAT": "0.5",
        "TORCHMP_T_INHERITED": "from-launcher", "TORCHMP_T_OVERRIDDEN": "rank0",
        "TORCHELASTIC_ERROR_FILE": ctx.error_files[0], "TORCHMP_T_ONLY_RANK1": None,
    }
    assert result.return_values[1] == {
        "LOCAL_RANK": "1", "TORCHMP_T_STR": "one \u00e9", "TORCHMP_T_FLOAT": "1.5",
        "TORCHMP_T_INHERITED": "from-launcher", "TORCHMP_T_OVERRIDDEN": "rank1",
        "TORCHELASTIC_ERROR_FILE": ctx.error_files[1], "TORCHMP_T_ONLY_RANK1": "True",
    }
    assert ctx.error_files[0] != ctx.error_files[1]
    # The launcher's own environment is untouched.
    assert os.environ["TORCHMP_T_OVERRIDDEN"] == "launcher-value"
    assert "TORCHMP_T_STR" not in os.environ


@pytest.mark.parametrize("start_method", METHODS)
def test_bytes_env_keys_and_values(tmp_path, start_method):
    names = ("TORCHMP_T_BVAL", "TORCHMP_T_BKEY", "b'TORCHMP_T_BKEY'")
    envs = {0: {"TORCHMP_T_BVAL": b"raw-bytes", b"TORCHMP_T_BKEY": "v"}}
    result = run(tmp_path, fw.read_env, {0: (names,)}, start_method, envs)
    assert result.return_values == {0: {"TORCHMP_T_BVAL": "raw-bytes", "TORCHMP_T_BKEY": "v",
                                         "b'TORCHMP_T_BKEY'": None}}


# --- arguments ----------------------------------------------------------------

@pytest.mark.parametrize("start_method", METHODS)
def test_large_args_reach_the_worker(tmp_path, start_method):
    import hashlib

    data = os.urandom(16 * MB)
    result = run(tmp_path, fw.arg_digest, {0: (data,), 1: (data[:1000],)}, start_method)
    assert result.return_values == {0: (len(data), hashlib.sha256(data).hexdigest()),
                                    1: (1000, hashlib.sha256(data[:1000]).hexdigest())}


# --- streams ------------------------------------------------------------------

@pytest.mark.parametrize("start_method", METHODS)
def test_redirect_is_fd_level_and_exact(tmp_path, start_method, monkeypatch):
    use_fd_level_std(monkeypatch)
    result = run(tmp_path, fw.write_everywhere, {0: (0,), 1: (1,)}, start_method, redirects=Std.ALL)
    assert not result.is_failed(), result.failures
    assert result.return_values == {0: 0, 1: 1}
    for rank in (0, 1):
        out, err = expected_streams(rank)
        assert Path(result.stdouts[rank]).read_bytes() == out
        assert Path(result.stderrs[rank]).read_bytes() == err


@pytest.mark.parametrize("start_method", METHODS)
def test_redirect_only_stderr_leaves_stdout_on_the_console(tmp_path, start_method, capfdbinary, monkeypatch):
    use_fd_level_std(monkeypatch)
    result = run(tmp_path, fw.write_everywhere, {0: (0,)}, start_method, redirects=Std.ERR)
    console_out, console_err = capfdbinary.readouterr()
    assert not result.is_failed(), result.failures
    assert result.stdouts == {0: ""} and result.stderrs[0].endswith("/0/stderr.log")
    out, err = expected_streams(0)
    assert Path(result.stderrs[0]).read_bytes() == err
    assert console_out == out and console_err == b""


@pytest.mark.parametrize("start_method", METHODS)
def test_tee_prefixes_console_lines_and_keeps_the_log_exact(tmp_path, start_method, capfdbinary, monkeypatch):
    use_fd_level_std(monkeypatch)
    result = run(tmp_path, fw.write_everywhere, {0: (0,), 1: (1,)}, start_method, tee=Std.ALL,
                 log_line_prefixes={1: "<one> "})
    console_out, console_err = capfdbinary.readouterr()
    assert not result.is_failed(), result.failures
    prefixes = {0: b"[trainer0]:", 1: b"<one> "}
    for rank in (0, 1):
        out, err = expected_streams(rank)
        assert Path(result.stdouts[rank]).read_bytes() == out
        assert Path(result.stderrs[rank]).read_bytes() == err
    for stream, console in ((0, console_out), (1, console_err)):
        got: dict[int, list[bytes]] = {0: [], 1: []}
        for line in console.splitlines(keepends=True):
            ranks = [r for r, p in prefixes.items() if line.startswith(p)]
            assert len(ranks) == 1, f"console line without a rank prefix: {line!r}"
            got[ranks[0]].append(line[len(prefixes[ranks[0]]):])
        for rank in (0, 1):
            lines = expected_streams(rank)[stream].splitlines(keepends=True)
            if not lines[-1].endswith(b"\n"):
                lines[-1] += b"\n"  # a final partial line is printed with a newline
            assert got[rank] == lines, (rank, stream)


# --- failures -----------------------------------------------------------------

@pytest.mark.parametrize("start_method", METHODS)
def test_exception_writes_torch_shaped_error_json(tmp_path, start_method, monkeypatch):
    use_fd_level_std(monkeypatch)
    t0 = int(time.time())
    result = run(tmp_path, fw.raise_value_error, {0: (0,)}, start_method, redirects=Std.ERR)
    failure = result.failures[0]
    assert set(result.failures) == {0}
    assert failure.exitcode == 1 and failure.signal_name() == "<N/A>"
    assert failure.error_file.startswith(str(tmp_path / "logs") + "/")
    assert failure.error_file.endswith("/0/error.json")
    data = read_error_json(failure)
    assert set(data) == {"message"}
    assert data["message"]["message"] == "ValueError: boom from rank 0"
    extra = data["message"]["extraInfo"]
    assert {"py_callstack", "timestamp"} <= set(extra)
    assert "raise ValueError(f\"boom from rank {rank}\")" in extra["py_callstack"]
    assert "in raise_value_error" in extra["py_callstack"]
    assert extra["py_callstack"].startswith("Traceback (most recent call last):")
    assert isinstance(extra["timestamp"], str) and t0 <= int(extra["timestamp"]) <= time.time() + 1
    assert failure.message == data["message"]
    assert failure.message["message"] == "ValueError: boom from rank 0"
    assert failure.timestamp == int(extra["timestamp"])
    # The traceback is also on the worker's stderr.
    err = Path(result.stderrs[0]).read_text()
    assert "ValueError: boom from rank 0" in err
    assert "boom from rank 0" in str(ChildFailedError("trainer", result.failures))
    assert result.return_values == {}


@pytest.mark.parametrize("start_method", METHODS)
def test_sys_exit_code_is_the_exitcode(tmp_path, start_method):
    result = run(tmp_path, fw.sys_exit, {0: (3,)}, start_method)
    assert set(result.failures) == {0}
    failure = result.failures[0]
    assert failure.exitcode == 3 and failure.signal_name() == "<N/A>"
    assert failure.error_file == "<N/A>"  # SystemExit is not an error to record


@pytest.mark.parametrize("start_method", METHODS)
def test_os_exit_0_without_returning_is_a_failure(tmp_path, start_method):
    result = run(tmp_path, fw.exit_now, {0: (0,), 1: ()}, start_method)
    assert sorted(result.failures) == [0, 1]
    for failure in result.failures.values():
        assert failure.exitcode == 0
        assert "without returning a value" in failure.message


@pytest.mark.parametrize("start_method", METHODS)
def test_sys_exit_zero_and_none_are_success(tmp_path, start_method):
    result = run(tmp_path, fw.sys_exit, {0: (0,), 1: (None,)}, start_method)
    assert not result.is_failed(), result.failures
    assert result.return_values == {0: None, 1: None}
    assert [result.resources[r].exitcode for r in (0, 1)] == [0, 0]


@pytest.mark.parametrize("start_method", METHODS)
def test_sys_exit_with_a_message_is_exitcode_1_and_prints_it(tmp_path, start_method, monkeypatch):
    use_fd_level_std(monkeypatch)
    result = run(tmp_path, fw.sys_exit, {0: ("fatal: bad config",)}, start_method, redirects=Std.ERR)
    assert result.failures[0].exitcode == 1
    assert Path(result.stderrs[0]).read_bytes() == b"fatal: bad config\n"


@pytest.mark.parametrize("start_method", METHODS)
def test_worker_killed_by_a_signal(tmp_path, start_method):
    ctx = start(tmp_path, fw.kill_self, {0: (int(signal.SIGKILL),)}, start_method)
    try:
        pid = ctx.pids()[0]
        result = ctx.wait(30)
    finally:
        ctx.close(signal.SIGKILL, timeout=5)
    failure = result.failures[0]
    assert failure.exitcode == -9 and failure.signal_name() == "SIGKILL"
    assert failure.pid == pid and not failure.terminated_by_launcher
    assert failure.message == f"Signal 9 (SIGKILL) received by PID {pid}"
    assert failure.error_file == "<N/A>"


@pytest.mark.parametrize("start_method", METHODS)
def test_segfault_is_minus_11_with_a_python_traceback(tmp_path, start_method, monkeypatch):
    use_fd_level_std(monkeypatch)
    result = run(tmp_path, fw.segfault, {0: ()}, start_method, redirects=Std.ERR)
    failure = result.failures[0]
    assert failure.exitcode == -signal.SIGSEGV and failure.signal_name() == "SIGSEGV"
    err = Path(result.stderrs[0]).read_text()
    assert err.startswith("Fatal Python error: Segmentation fault")
    assert 'in segfault' in err and "workers/functions.py" in err


@pytest.mark.parametrize("start_method", METHODS)
def test_resources_are_measured_for_function_workers(tmp_path, start_method):
    ctx = start(tmp_path, fw.burn_cpu, {0: (0.2,), 1: (0.0,)}, start_method)
    try:
        pids = ctx.pids()
        result = ctx.wait(60)
    finally:
        ctx.close()
    assert not result.is_failed(), result.failures
    assert result.return_values == {0: 32 << 20, 1: 32 << 20}
    for rank in (0, 1):
        usage = result.resources[rank]
        assert usage.pid == pids[rank] and usage.exitcode == 0
        assert usage.max_rss >= 32 << 20
        assert 0 < usage.wall_time < 30
    busy = result.resources[0]
    assert busy.user_time + busy.system_time >= 0.15
    assert busy.wall_time >= busy.user_time * 0.5


@pytest.mark.parametrize("start_method", METHODS)
@pytest.mark.parametrize("fn", [fw.return_lambda, fw.return_lock], ids=["lambda", "lock"])
def test_unpicklable_return_value_is_a_clear_failure(tmp_path, start_method, fn):
    t0 = time.monotonic()
    result = run(tmp_path, fn, {0: ()}, start_method, timeout=30)
    assert time.monotonic() - t0 < 15
    assert set(result.failures) == {0}
    failure = result.failures[0]
    assert failure.exitcode == 1
    data = read_error_json(failure)
    text = data["message"]["message"]
    assert "could not be pickled" in text
    assert fn.__name__ in text
    assert text.startswith("TypeError: ")
    assert failure.message["message"] == text


@pytest.mark.parametrize("start_method", METHODS)
def test_return_value_that_cannot_be_unpickled_in_the_launcher(tmp_path, start_method):
    ctx = start(tmp_path, fw.return_unpicklable_in_launcher, {0: ()}, start_method)
    try:
        with pytest.raises(RuntimeError) as info:
            ctx.wait(30)
    finally:
        ctx.close()
    text = str(info.value)
    assert "return value of local rank 0" in text and "could not be unpickled in the launcher" in text
    assert "this object refuses to be unpickled" in text


# --- pickling the entrypoint (spawn and forkserver) ---------------------------

@pytest.mark.parametrize("start_method", PICKLING_METHODS)
@pytest.mark.parametrize("kind", sorted(UNPICKLABLE))
def test_unpicklable_entrypoint_rejected_before_anything_starts(tmp_path, start_method, kind):
    fn, arg, _ = UNPICKLABLE[kind]
    before = children()
    log_dir = tmp_path / "logs"
    with pytest.raises(ValueError) as info:
        start(tmp_path, fn, {0: (arg,), 1: (arg,)}, start_method, log_dir=log_dir)
    assert "cannot be pickled" in str(info.value)
    assert fn.__qualname__ in str(info.value)
    assert children() == before
    assert server_pid() is None  # not even the forkserver was started
    assert not log_dir.exists() or list(log_dir.rglob("*")) == []


@pytest.mark.parametrize("start_method", PICKLING_METHODS)
def test_unpicklable_args_rejected_before_anything_starts(tmp_path, start_method):
    before = children()
    log_dir = tmp_path / "logs"
    with pytest.raises(ValueError, match=r"args\[1\]"):
        start(tmp_path, fw.return_arg, {0: (1,), 1: (threading.Lock(),)}, start_method, log_dir=log_dir)
    assert children() == before
    assert server_pid() is None
    assert not log_dir.exists() or list(log_dir.rglob("*")) == []


# --- fail-fast and cleanup ----------------------------------------------------

@pytest.mark.parametrize("start_method", METHODS)
def test_fail_fast_terminates_siblings_and_blames_the_raising_rank(tmp_path, start_method):
    pidfile = tmp_path / "pids"
    args = {r: (r, 1, 0.3, str(pidfile)) for r in range(3)}
    ctx = start(tmp_path, fw.raise_or_sleep, args, start_method)
    pids = list(ctx.pids().values())
    try:
        read_pids(pidfile, 3, timeout=20)
        t0 = time.monotonic()
        result = ctx.wait(60)
        elapsed = time.monotonic() - t0
    finally:
        ctx.close(signal.SIGKILL, timeout=5)
        kill_groups([p for p in pids if pid_alive(p)])
    assert elapsed < 5
    # As torch's function contexts: only the rank that failed by itself is a
    # failure; the siblings torchmp terminated show in resources.
    assert set(result.failures) == {1}
    assert result.failures[1].exitcode == 1 and not result.failures[1].terminated_by_launcher
    assert result.failures[1].message["message"] == "ValueError: rank 1 failed on purpose"
    for rank in (0, 2):
        assert result.resources[rank].exitcode == -signal.SIGTERM
    assert wait_gone(pids, 1.0) == []
    rank, first = ChildFailedError("trainer", result.failures).get_first_failure()
    assert rank == 1 and first is result.failures[1]


@pytest.mark.parametrize("start_method", METHODS)
def test_close_kills_the_workers_process_group(tmp_path, start_method):
    pidfile = tmp_path / "grandchild"
    ctx = start(tmp_path, fw.spawn_grandchild, {0: (str(pidfile),)}, start_method)
    grandchild: list[int] = []
    worker = ctx.pids()[0]
    try:
        grandchild = read_pids(pidfile, 1, timeout=20)
        assert pid_alive(grandchild[0]) and pid_alive(worker)
        assert os.getpgid(grandchild[0]) == os.getpgid(worker) == worker
        ctx.close()
        assert wait_gone(grandchild + [worker], 5.0) == []
        result = ctx.wait(0)
        assert result.failures[0].exitcode == -signal.SIGTERM
        assert result.failures[0].terminated_by_launcher
    finally:
        ctx.close(signal.SIGKILL, timeout=5)
        kill_groups([p for p in grandchild if pid_alive(p)])


@pytest.mark.parametrize("start_method", METHODS)
def test_forked_grandchild_does_not_delay_the_workers_exit(tmp_path, start_method, monkeypatch):
    use_fd_level_std(monkeypatch)
    pidfile = tmp_path / "grandchild"
    ctx = start(tmp_path, fw.fork_lingering_grandchild, {0: (str(pidfile),)}, start_method, tee=Std.ALL)
    grandchild: list[int] = []
    try:
        grandchild = read_pids(pidfile, 1, timeout=20)
        result = ctx.wait(3)
        assert result is not None, "wait() blocked on the worker's grandchild"
        assert not result.is_failed() and result.return_values == {0: 42}
        # the run is over: the grandchild went with the worker's process group
        assert wait_gone(grandchild, 5) == []
    finally:
        ctx.close(signal.SIGKILL, timeout=5)
        kill_groups([p for p in grandchild if pid_alive(p)])


@pytest.mark.parametrize("start_method", METHODS)
def test_workers_die_with_a_sigkilled_launcher(tmp_path, start_method):
    pidfile = tmp_path / "pids"
    script = f"""
        import json, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import torchmp
        from torchmp import _core
        from torchmp._launch import forkserver as _forkserver
        from workers import functions as fn_workers
        ctx = torchmp.start_processes("w", fn_workers.announce_and_sleep,
                                      {{0: ({str(pidfile)!r},), 1: ({str(pidfile)!r},)}}, {{0: {{}}, 1: {{}}}},
                                      torchmp.DefaultLogsSpecs(log_dir={str(tmp_path / "logs")!r}),
                                      start_method={start_method!r})
        server = None
        if {start_method!r} == "forkserver":
            server = _forkserver.get_forkserver()._group.snapshot()[1][0][1]
        print(json.dumps({{"pids": list(ctx.pids().values()), "server": server}}), flush=True)
        ctx.wait()
    """
    launcher = popen_launcher(script, stdout=subprocess.PIPE)
    doomed: list[int] = []
    try:
        report = json.loads(launcher.stdout.readline())
        doomed = report["pids"] + ([report["server"]] if report["server"] else [])
        assert sorted(read_pids(pidfile, 2, timeout=20)) == sorted(report["pids"])
        launcher.kill()
        launcher.wait(10)
        assert wait_gone(doomed, 5.0) == []
    finally:
        kill_groups([launcher.pid] + [p for p in doomed if pid_alive(p)])
        launcher.wait()
        launcher.stdout.close()


# --- the __main__ guard -------------------------------------------------------

MAIN_SCRIPT = '''
import os
import sys

with open(os.environ["TORCHMP_T_MARKER"], "a") as f:
    f.write(f"{os.getpid()} {__name__}\\n")


class Box:
    def __init__(self, value):
        self.value = value


def work(rank, with_box):
    value = {"rank": rank, "name": __name__, "pid": os.getpid()}
    if with_box:
        value["box"] = Box(rank * 10)  # an instance of a class of the main module
    return value


if __name__ == "__main__":
    import json
    import torchmp
    from torchmp import _core
    from torchmp._launch import forkserver as _forkserver

    log_dir, start_method, with_box = sys.argv[1], sys.argv[2], sys.argv[3] == "box"
    with open(os.environ["TORCHMP_T_MARKER"], "a") as f:
        f.write(f"{os.getpid()} guarded\\n")
    ctx = torchmp.start_processes("m", work, {0: (0, with_box), 1: (1, with_box)}, {0: {}, 1: {}},
                                  torchmp.DefaultLogsSpecs(log_dir=log_dir), start_method=start_method)
    server = None
    if start_method == "forkserver":
        server = _forkserver.get_forkserver()._group.snapshot()[1][0][1]
    try:
        result = ctx.wait(60)
        pids = ctx.pids()
    finally:
        ctx.close()
        _forkserver.get_forkserver()._stop()
    values = {}
    for rank, value in result.return_values.items():
        if "box" in value:
            box = value["box"]
            value["box"] = [type(box) is Box, box.value]
        values[rank] = value
    print(json.dumps({"launcher": os.getpid(), "server": server, "pids": pids, "values": values,
                      "failures": {r: str(f.message) for r, f in result.failures.items()}}))
'''


def run_main_script(tmp_path, start_method: str, with_box: bool) -> dict:
    script = tmp_path / "launcher_script.py"
    script.write_text(MAIN_SCRIPT)
    env = dict(os.environ, TORCHMP_T_MARKER=str(tmp_path / "marker"))
    argv = [sys.executable, str(script), str(tmp_path / "logs"), start_method, "box" if with_box else "plain"]
    proc = subprocess.Popen(argv, env=env, cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        kill_groups([proc.pid])
        if proc.returncode is None:
            proc.communicate()
    assert proc.returncode == 0, err.decode(errors="replace")
    report = json.loads(out)
    report["pids"] = {int(r): p for r, p in report["pids"].items()}
    report["values"] = {int(r): v for r, v in report["values"].items()}
    report["marker"] = sorted(tuple(line.split()) for line in (tmp_path / "marker").read_text().splitlines())
    assert wait_gone(list(report["pids"].values()) + ([report["server"]] if report["server"] else []), 5) == []
    return report


@pytest.mark.parametrize("start_method", METHODS)
def test_main_guard_runs_only_in_the_launcher(tmp_path, start_method):
    report = run_main_script(tmp_path, start_method, with_box=False)
    launcher, pids = report["launcher"], report["pids"]
    assert report["failures"] == {}
    # A function of the main module runs in the worker as the re-imported
    # module (__mp_main__) for spawn/forkserver, as __main__ itself for fork.
    worker_name = "__main__" if start_method == "fork" else "__mp_main__"
    assert report["values"] == {r: {"rank": r, "name": worker_name, "pid": pids[r]} for r in (0, 1)}
    expected = [(str(launcher), "__main__"), (str(launcher), "guarded")]
    if start_method == "spawn":
        # each spawned worker re-imports the script as __mp_main__, and only
        # the unguarded part runs
        expected += [(str(pids[r]), "__mp_main__") for r in (0, 1)]
    elif start_method == "forkserver":
        # the server imports it once; the workers it forks inherit it
        expected += [(str(report["server"]), "__mp_main__")]
    assert report["marker"] == sorted(expected)


@pytest.mark.parametrize("start_method", METHODS)
def test_return_value_of_a_main_module_class(tmp_path, start_method):
    # A spawn/forkserver worker pickles it as __mp_main__.Box; the launcher
    # must map that back to its own __main__ (as multiprocessing does).
    report = run_main_script(tmp_path, start_method, with_box=True)
    assert report["failures"] == {}
    assert [report["values"][r]["box"] for r in (0, 1)] == [[True, 0], [True, 10]]


# --- signal dispositions and masks --------------------------------------------

@pytest.mark.parametrize("start_method", METHODS)
def test_worker_gets_the_default_sigterm_action(tmp_path, start_method):
    # start() installs the launcher's SignalException handlers; a forked
    # worker must not inherit them.
    old = signal.getsignal(signal.SIGTERM)
    try:
        result = run(tmp_path, fw.sigterm_disposition, {0: ()}, start_method)
        assert signal.getsignal(signal.SIGTERM) is torchmp.api._terminate_process_handler
    finally:
        signal.signal(signal.SIGTERM, old)
    assert result.return_values == {0: True}


@pytest.mark.parametrize("start_method", METHODS)
def test_worker_starts_with_no_signals_blocked(tmp_path, start_method):
    # A launcher may hold signals while it launches (torchmp run does):
    # a worker must not inherit that, or a SIGTERM to it would wait forever.
    held = {signal.SIGTERM, signal.SIGUSR1}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        result = run(tmp_path, fw.blocked_signals, {0: ()}, start_method)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    assert result.return_values == {0: set()}


# --- fd hygiene ---------------------------------------------------------------

@pytest.mark.parametrize("start_method", METHODS)
def test_a_worker_holds_no_other_ranks_pipe_ends(tmp_path, start_method, monkeypatch):
    """Every rank's streams are prepared before the first worker starts: a
    worker holding another rank's write ends would delay that rank's EOFs."""
    use_fd_level_std(monkeypatch)
    go = tmp_path / "go"
    ctx = start(tmp_path, fw.pipe_write_ends_after, {r: (str(go),) for r in range(3)}, start_method, tee=Std.ALL)
    try:
        # While every worker runs: the launcher's write ends (a fork worker
        # inherits them) and the read ends of the pipes it drains -- every
        # rank's stdout, stderr and return channel among them.
        launcher_pipes = set(fw.pipe_write_ends())
        drained = set(fw.pipe_ends(readable=True))
        go.touch()
        result = ctx.wait(30)
    finally:
        ctx.close(signal.SIGKILL, timeout=5)
    assert result is not None and not result.is_failed(), result
    # A rank's pipes are those it can write to and the launcher drains (not
    # its own, and not one the worker made itself after the fork).
    own = {rank: (set(pipes) - launcher_pipes) & drained for rank, pipes in result.return_values.items()}
    for rank in own:
        # stdout, stderr and the return channel: its own three pipes, no more
        assert len(own[rank]) == 3, (rank, own)
        for other in own:
            if other != rank:
                assert not own[rank] & own[other], (rank, other, own)


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("start_method", METHODS)
def test_function_launch_loops_do_not_grow_fds(tmp_path, start_method, monkeypatch):
    import gc

    use_fd_level_std(monkeypatch)

    def cycle(i):
        ctx = start(tmp_path, fw.write_everywhere, {r: (r,) for r in range(2)}, start_method,
                    log_dir=tmp_path / f"l{i}", redirects=Std.OUT, tee=Std.ERR)
        try:
            result = ctx.wait(30)
        finally:
            ctx.close()
        assert not result.is_failed(), result.failures
        assert result.return_values == {0: 0, 1: 1}

    cycle(0)  # the first forkserver launch starts the server (its fds stay)
    gc.collect()
    before = _fd_count()
    for i in range(1, 3):
        cycle(i)
    gc.collect()
    deadline = time.monotonic() + 10
    while _fd_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _fd_count() == before
