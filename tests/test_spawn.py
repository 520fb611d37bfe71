"""Binary launch: exec errors, argv/env fidelity, what a worker inherits."""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import threading

import pytest

import torchmp
from torchmp import Std, _core

from helpers import (kill_groups, launch, pid_alive, popen_launcher, python_worker, read_pids, run_launcher,
                     wait_gone)


def run_one(tmp_path, entrypoint, args, env=None, **kw):
    ctx = launch(entrypoint, {0: args}, {0: env or {}}, log_dir=tmp_path / "logs", redirects=Std.ALL, **kw)
    try:
        result = ctx.wait(timeout=30)
    finally:
        ctx.close()
    assert result is not None
    out = open(result.stdouts[0], "rb").read()
    err = open(result.stderrs[0], "rb").read()
    return result, out, err


# --- exec error records, decoded without forking (CPython test_subprocess style)

def test_exec_error_decoder_picks_oserror_subclass():
    e = _core.exec_error(_core.STEP_EXEC, errno.ENOENT, "/no/such")
    assert type(e) is FileNotFoundError and e.errno == errno.ENOENT and e.filename == "/no/such"
    e = _core.exec_error(_core.STEP_EXEC, errno.EACCES, "/x")
    assert type(e) is PermissionError and e.filename == "/x"
    e = _core.exec_error(_core.STEP_EXEC, errno.ENOEXEC, "/x")
    assert type(e) is OSError and e.errno == errno.ENOEXEC


def test_exec_error_decoder_names_setup_steps():
    # Every step the C core has (a new one is in STEP_COUNT), each named.
    steps = range(1, _core.STEP_COUNT)
    assert _core.STEP_EXEC in steps and len(steps) >= 13
    names = [_core.step_name(step) for step in steps]
    assert "unknown step" not in names and len(set(names)) == len(names), names
    for step in steps:
        e = _core.exec_error(step, errno.EBADF, "/bin/x")
        assert e.errno == errno.EBADF
        if step == _core.STEP_EXEC:
            assert e.filename == "/bin/x"
        else:
            assert _core.step_name(step) in str(e) and e.filename is None
    assert "no errno" in str(_core.exec_error(4, 0, "/x"))
    assert _core.step_name(0) == "none"
    assert _core.step_name(_core.STEP_COUNT) == "unknown step"
    assert _core.step_name(-1) == "unknown step"
    assert _core.step_name(999) == "unknown step"


# --- resolution happens before anything starts

def test_missing_binary_raises_before_anything_is_created(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        launch("no-such-binary-torchmp", {0: (), 1: ()}, log_dir=tmp_path / "logs")
    assert info.value.filename == "no-such-binary-torchmp"
    assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").iterdir())


def test_non_executable_raises_permission_error(tmp_path):
    script = tmp_path / "noexec.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o644)
    with pytest.raises(PermissionError) as info:
        launch(str(script), {0: ()}, log_dir=tmp_path / "logs")
    assert info.value.errno == errno.EACCES and info.value.filename == str(script)


def test_path_lookup_uses_the_workers_path(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    tool = bindir / "mytool"
    tool.write_text("#!/bin/sh\necho found-$1\n")
    tool.chmod(0o755)
    result, out, _ = run_one(tmp_path, "mytool", ("x",), env={"PATH": f"{bindir}:/usr/bin:/bin"})
    assert out == b"found-x\n" and not result.is_failed()


class _PlantedLogs(torchmp.LogsSpecs):
    """Rank 0's stdout log is whatever path the test planted."""

    def __init__(self, stdout_path):
        super().__init__(os.path.dirname(stdout_path), Std.OUT)
        self.stdout_path = stdout_path

    @property
    def root_log_dir(self):
        return str(self._root_log_dir)

    def reify(self, envs):
        return torchmp.LogsDest(stdouts={0: self.stdout_path}, stderrs={0: ""},
                                error_files={r: "" for r in envs})


@pytest.mark.parametrize("planted", ["symlink", "fifo", "directory", "socket"])
def test_a_planted_log_path_is_refused_before_anything_starts(tmp_path, planted):
    """Something planted where a log is to be written: refused with a clear
    error before any rank runs, nothing written through it."""
    import socket
    target = tmp_path / "victim"
    target.write_bytes(b"keep")
    log = tmp_path / "stdout.log"
    sock = None
    if planted == "symlink":
        log.symlink_to(target)
    elif planted == "fifo":
        os.mkfifo(log)
    elif planted == "directory":
        log.mkdir()
    else:
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(log))
    marker = tmp_path / "ran"
    try:
        with pytest.raises(OSError) as info:
            ctx = torchmp.start_processes("planted", "/bin/sh", {0: ("-c", f"touch {marker}; echo hi")}, {0: {}},
                                          _PlantedLogs(str(log)))
            ctx.close()
    finally:
        if sock is not None:
            sock.close()
    err = info.value
    expected = {"symlink": (errno.ELOOP, "refusing to follow a symlink for a log file"),
                "fifo": (errno.ENXIO, "refusing a FIFO as a log file"),
                "directory": (errno.EISDIR, "Is a directory"),
                "socket": (errno.ENXIO, "refusing a FIFO as a log file")}[planted]
    assert (err.errno, err.filename) == (expected[0], str(log)) and expected[1] in str(err), repr(err)
    assert target.read_bytes() == b"keep" and not marker.exists()


def test_path_lookup_steps_over_directories_and_non_executables(tmp_path, monkeypatch):
    """execvp's order: a directory or a file without execute permission of
    that name is passed over; an empty entry is the current directory; with
    no executable match, the first denied candidate is named."""
    from torchmp._launch.exec import resolve_executable
    as_dir, no_x, good, cwd = (tmp_path / n for n in ("as_dir", "no_x", "good", "cwd"))
    for d in (as_dir, no_x, good, cwd):
        d.mkdir()
    (as_dir / "tool").mkdir()
    (no_x / "tool").write_text("#!/bin/sh\n")
    (no_x / "tool").chmod(0o644)
    for d in (good, cwd):
        (d / "tool").write_text("#!/bin/sh\n")
        (d / "tool").chmod(0o755)
    path = f"{tmp_path}/missing:{as_dir}:{no_x}/:{good}"
    assert resolve_executable("tool", {"PATH": path}) == os.fsencode(good / "tool")
    with pytest.raises(PermissionError) as info:
        resolve_executable("tool", {"PATH": f"{as_dir}:{no_x}"})
    assert info.value.filename == str(as_dir / "tool")
    monkeypatch.chdir(cwd)
    assert resolve_executable("tool", {"PATH": f"{as_dir}/missing::{good}"}) == b"./tool"
    assert resolve_executable("tool", {"PATH": f"{no_x}:.:{good}"}) == b"./tool"
    with pytest.raises(FileNotFoundError):
        resolve_executable("tool", {"PATH": f"{tmp_path}/missing"})
    assert resolve_executable(str(good / "tool")) == os.fsencode(good / "tool")
    with pytest.raises(PermissionError):
        resolve_executable(str(no_x / "tool"))


def test_exec_failure_at_rank_k_reaps_started_ranks(tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir()
    bad.mkdir()
    pidfile = tmp_path / "pids"
    (good / "tool").write_text(f"#!/bin/sh\necho $$ >> {pidfile}\nexec sleep 100\n")
    (good / "tool").chmod(0o755)
    (bad / "tool").write_bytes(b"\x7fELF-not-really")  # executable, but not a format exec knows
    (bad / "tool").chmod(0o755)
    envs = {0: {"PATH": f"{good}:/bin:/usr/bin"}, 1: {"PATH": f"{good}:/bin:/usr/bin"},
            2: {"PATH": str(bad)}}
    with pytest.raises(OSError) as info:
        launch("tool", {0: (), 1: (), 2: ()}, envs, log_dir=tmp_path / "logs")
    assert info.value.errno == errno.ENOEXEC
    assert info.value.filename == str(bad / "tool")
    # The two started ranks were terminated and reaped (the leak guard also
    # fails the test if any child or zombie is left).
    try:
        started = [int(x) for x in pidfile.read_text().split()] if pidfile.exists() else []
        assert wait_gone(started, 2.0) == []
    finally:
        kill_groups(started)


# --- argv and env reach the worker exactly

def test_argv_is_literal_never_a_shell(tmp_path):
    tricky = ("a b", "'q'", '"dq"', "$(echo pwned)", "; rm -rf /", "*", "", "\u00e9\u4e2d")
    entry, args = python_worker("import sys, json; sys.stdout.write(json.dumps(sys.argv[1:]))")
    _, out, _ = run_one(tmp_path, entry, args + tricky)
    import json
    assert json.loads(out) == list(tricky)


def test_string_args_is_one_argument_and_values_are_cast(tmp_path):
    ctx = launch("echo", {0: "hello world", 1: (1, 2.5, [3])}, log_dir=tmp_path / "logs", redirects=Std.OUT)
    result = ctx.wait(30)
    ctx.close()
    assert open(result.stdouts[0], "rb").read() == b"hello world\n"
    assert open(result.stdouts[1], "rb").read() == b"1 2.5 [3]\n"


def test_env_inherits_and_overrides_and_casts(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHMP_TEST_INHERITED", "parent")
    monkeypatch.setenv("TORCHMP_TEST_OVERRIDE", "parent")
    entry, args = python_worker(
        "import os; print(os.environ['TORCHMP_TEST_INHERITED'], os.environ['TORCHMP_TEST_OVERRIDE'],"
        " os.environ['LOCAL_RANK'], os.environ['TORCHELASTIC_ERROR_FILE'].endswith('error.json'))")
    _, out, _ = run_one(tmp_path, entry, args, env={"TORCHMP_TEST_OVERRIDE": "child", "LOCAL_RANK": 0})
    assert out == b"parent child 0 True\n"


def test_each_launch_sees_the_launcher_s_environment_as_it_is_then(tmp_path, monkeypatch):
    # The envp entries are reused while the environment compares equal: a
    # variable set, changed or removed between launches must still show.
    entry, args = python_worker("import os; print(os.environ.get('TORCHMP_TEST_CHANGING', '-'))")
    monkeypatch.delenv("TORCHMP_TEST_CHANGING", raising=False)
    seen = []
    for step, value in enumerate(["one", "two", None, "two", None]):
        if value is None:
            monkeypatch.delenv("TORCHMP_TEST_CHANGING", raising=False)
        else:
            monkeypatch.setenv("TORCHMP_TEST_CHANGING", value)
        for envs in ({}, {"LOCAL_RANK": 0}):  # (with nothing on top, and with)
            ctx = launch(entry, {0: args}, {0: envs}, log_dir=tmp_path / f"logs{step}-{len(envs)}",
                         redirects=Std.ALL)
            try:
                result = ctx.wait(30)
            finally:
                ctx.close()
            assert result is not None and not result.is_failed()
            seen.append(open(result.stdouts[0], "rb").read())
    assert seen == [b"one\n"] * 2 + [b"two\n"] * 2 + [b"-\n"] * 2 + [b"two\n"] * 2 + [b"-\n"] * 2


@pytest.mark.parametrize("env, needle", [
    ({"A=B": "x"}, "'A=B'"),
    ({"": "x"}, "''"),
    ({"K": "a\0b"}, "NUL"),
    ({"K\0": "x"}, "NUL"),
    ({1: "x"}, "names must be str"),
])
def test_bad_env_rejected_before_start(tmp_path, env, needle):
    with pytest.raises(ValueError) as info:
        launch("true", {0: ()}, {0: env}, log_dir=tmp_path / "logs")
    assert needle in str(info.value) and "envs[0]" in str(info.value)
    assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").iterdir())


def test_worker_inherits_only_stdio(tmp_path):
    # Make sure the launcher has extra inheritable fds around.
    r, w = os.pipe()
    os.set_inheritable(r, True)
    try:
        _, out, _ = run_one(tmp_path, "sh", ("-c", "ls /proc/$$/fd"))
    finally:
        os.close(r)
        os.close(w)
    assert sorted(int(x) for x in out.split()) == [0, 1, 2]  # the shell's fds: stdio only


@pytest.mark.parametrize("nprocs", [1, 3])
def test_worker_is_a_session_leader_with_clean_signals(tmp_path, nprocs):
    """One rank's child finds the caught signals itself, a batch's are found
    once by the launcher: either way SIGPIPE and SIGXFSZ are back to default
    and a disposition the launcher ignores stays ignored."""
    # `exec cat` keeps the worker's pid, so cat reports on the worker itself.
    # (A Python worker would not do: CPython ignores SIGPIPE at start-up.)
    previous = signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        ctx = launch("sh", {r: ("-c", "exec cat /proc/self/stat /proc/self/status") for r in range(nprocs)},
                     log_dir=tmp_path / "logs", redirects=Std.ALL)
        try:
            result = ctx.wait(timeout=30)
        finally:
            ctx.close()
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert result is not None and not result.is_failed()
    for rank in range(nprocs):
        out = open(result.stdouts[rank], "rb").read()
        stat_line, status = out.split(b"\n", 1)
        pid = int(stat_line.split()[0])
        ppid, pgrp, session = (int(x) for x in stat_line.rsplit(b")", 1)[1].split()[1:4])
        fields = dict(line.split(b":", 1) for line in status.splitlines() if b":" in line)
        assert (pgrp, session) == (pid, pid)
        assert ppid == os.getpid()
        assert int(fields[b"SigBlk"], 16) == 0
        ignored = int(fields[b"SigIgn"], 16)
        assert ignored & (1 << (signal.SIGPIPE - 1)) == 0
        assert ignored & (1 << (signal.SIGXFSZ - 1)) == 0
        assert ignored & (1 << (signal.SIGUSR2 - 1))


def test_worker_gets_parent_death_signal(tmp_path):
    entry, args = python_worker("""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        sig = ctypes.c_int()
        libc.prctl(2, ctypes.byref(sig), 0, 0, 0)  # PR_GET_PDEATHSIG
        print(sig.value)
    """)
    _, out, _ = run_one(tmp_path, entry, args)
    assert out == b"%d\n" % signal.SIGKILL


@pytest.mark.parametrize("no_vfork", ["0", "1"])
def test_launcher_sigkilled_takes_workers_with_it(tmp_path, no_vfork):
    pidfile = tmp_path / "pids"
    script = f"""
        import os, sys, time
        import torchmp
        ctx = torchmp.start_processes("w", "sh", {{0: ("-c", "echo $$ >> {pidfile}; exec sleep 100"),
                                                  1: ("-c", "echo $$ >> {pidfile}; exec sleep 100")}},
                                      {{0: {{}}, 1: {{}}}}, torchmp.DefaultLogsSpecs(log_dir="{tmp_path}/logs"))
        print("started", flush=True)
        time.sleep(100)
    """
    launcher = popen_launcher(script, env={"TORCHMP_NO_VFORK": no_vfork}, stdout=subprocess.PIPE)
    workers = []
    try:
        assert launcher.stdout.readline() == b"started\n"
        workers = read_pids(pidfile, 2)
        assert all(pid_alive(p) for p in workers)
        launcher.kill()
        launcher.wait()
        assert wait_gone(workers, 1.0) == []
    finally:
        kill_groups([launcher.pid] + workers)
        launcher.wait()
        launcher.stdout.close()


def test_no_vfork_kill_switch_and_poll_backend_work(tmp_path):
    script = f"""
        import torchmp
        from torchmp import _core
        ctx = torchmp.start_processes("w", "sh", {{0: ("-c", "exit 7")}}, {{0: {{}}}},
                                      torchmp.DefaultLogsSpecs(log_dir="{tmp_path}/logs"))
        r = ctx.wait(30)
        ctx.close()
        print(_core.backend(), r.failures[0].exitcode)
    """
    res = run_launcher(script, env={"TORCHMP_NO_VFORK": "1", "TORCHMP_BACKEND": "poll"})
    assert res.stdout == b"poll 7\n", res.stderr


@pytest.mark.parametrize("no_vfork", ["0", "1"])
def test_a_child_that_cannot_exec_reports_its_step_and_is_reaped(tmp_path, no_vfork):
    # A vfork child leaves its {step, errno} record in the launcher's memory;
    # a fork()ed one writes it to a pipe.  Either way the launcher gets the
    # step that failed, reaps the child and keeps no descriptor.
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x7fELF-not-really")  # executable, but not a format exec knows
    bad.chmod(0o755)
    script = f"""
        import errno, os, torchmp
        # Both launch paths first: what they keep for the process (the I/O
        # thread, the keeper, the OOM files kept from their second read) is
        # open before the count.
        torchmp.run(["true"])
        for warm in range(2):
            ctx = torchmp.start_processes("w", "true", {{0: ()}}, {{0: {{}}}},
                                          torchmp.DefaultLogsSpecs(log_dir={str(tmp_path / "logs")!r}))
            ctx.wait()
            ctx.close()
        fds = sorted(os.listdir("/proc/self/fd"))
        seen = []
        for attempt in range(3):
            try:
                torchmp.run([{str(bad)!r}])
            except OSError as e:
                seen.append(("exec", errno.errorcode[e.errno], e.filename))
            try:
                torchmp.run(["true"], cwd={str(tmp_path / "missing")!r})
            except OSError as e:
                seen.append(("chdir", type(e).__name__, str(e.filename)))
            try:
                torchmp.start_processes("w", {str(bad)!r}, {{0: ()}}, {{0: {{}}}},
                                        torchmp.DefaultLogsSpecs(log_dir={str(tmp_path / "logs")!r}))
            except OSError as e:
                seen.append(("rank", errno.errorcode[e.errno], e.filename))
        try:
            os.waitpid(-1, os.WNOHANG)
            left = "a child is left"
        except ChildProcessError:
            left = "no child"
        print(sorted(set(seen)), sorted(os.listdir("/proc/self/fd")) == fds, left,
              torchmp.run(["echo", "ok"], capture_output=True).stdout)
    """
    res = run_launcher(script, env={"TORCHMP_NO_VFORK": no_vfork})
    expected = [("chdir", "FileNotFoundError", str(tmp_path / "missing")),
                ("exec", "ENOEXEC", str(bad)), ("rank", "ENOEXEC", str(bad))]
    assert res.stdout.decode() == f"{expected} True no child b'ok\\n'\n", res.stderr.decode()


def test_spawn_loops_do_not_grow_fds(tmp_path):
    def cycle(i):
        ctx = launch("sh", {r: ("-c", "echo out; echo err >&2") for r in range(4)},
                     log_dir=tmp_path / f"l{i}", tee=Std.ALL)
        assert not ctx.wait(30).is_failed()
        ctx.close()
    cycle(0)
    import gc
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    for i in range(1, 20):
        cycle(i)
    gc.collect()
    import time
    deadline = time.monotonic() + 2
    while len(os.listdir("/proc/self/fd")) > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(os.listdir("/proc/self/fd")) == before


def test_ranks_outlive_the_thread_that_started_them(tmp_path):
    # PR_SET_PDEATHSIG fires when the spawning *thread* exits: a context
    # started from a short-lived thread must not lose its ranks with it (the
    # main thread spawns in place; any other hands the spawn to the I/O thread).
    started: dict[str, object] = {}

    def start() -> None:
        started["ctx"] = torchmp.start_processes(
            "t", "sh", {0: ("-c", "sleep 0.5; exit 0"), 1: ("-c", "sleep 0.5; exit 0")}, None,
            torchmp.DefaultLogsSpecs(log_dir=str(tmp_path)))

    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
    ctx = started["ctx"]
    try:
        result = ctx.wait(20)  # type: ignore[attr-defined]
        assert result is not None
        # (SIGKILLed with the thread, they would be failures with exit code -9)
        assert {r: f.exitcode for r, f in result.failures.items()} == {}
    finally:
        ctx.close()  # type: ignore[attr-defined]
