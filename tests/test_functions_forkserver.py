"""Function entrypoints: what is particular to the forkserver start method
(the tests of every start method are in test_functions.py).

The forkserver's life cycle: started once and reused, its death reported
and a new server started, its preload.
"""
from __future__ import annotations

import os
import select
import signal
import time

import psutil
import pytest

from torchmp._launch import forkserver as _forkserver
from torchmp.errors import ChildFailedError

from workers import functions as fw
from fn_helpers import run, server_pid, start
from fn_helpers import forkserver_hygiene  # noqa: F401 (autouse: a fixture of this module)
from helpers import Launchers, kill_groups, pid_alive, read_pids, wait_gone


def test_forkserver_death_is_reported_and_a_new_server_starts(tmp_path):
    pidfile = tmp_path / "pids"
    ctx = start(tmp_path, fw.announce_and_sleep, {0: (str(pidfile),), 1: (str(pidfile),)}, "forkserver")
    workers = list(ctx.pids().values())
    server = server_pid()
    try:
        read_pids(pidfile, 2, timeout=20)
        assert server is not None and pid_alive(server)
        assert all(psutil.Process(w).ppid() == server for w in workers)
        os.kill(server, signal.SIGKILL)
        t0 = time.monotonic()
        result = ctx.wait(30)
        assert time.monotonic() - t0 < 10
    finally:
        ctx.close(signal.SIGKILL, timeout=5)
        kill_groups([p for p in workers if pid_alive(p)])
    assert result is not None and set(result.failures) == {0, 1}
    for rank, failure in result.failures.items():
        # The workers died of their parent-death signal with the server.
        assert failure.pid == workers[rank] and failure.exitcode == -signal.SIGKILL
        assert failure.message == "its exit status was lost: the forkserver that started it died"
    assert "forkserver" in str(ChildFailedError("trainer", result.failures))
    assert wait_gone(workers + [server], 5.0) == []
    # The next launch starts a new server and works.
    result = run(tmp_path, fw.ident, {0: (), 1: ()}, "forkserver", log_dir=tmp_path / "again")
    assert not result.is_failed(), result.failures
    new_server = server_pid()
    assert new_server not in (None, server) and pid_alive(new_server)
    assert {v[1] for v in result.return_values.values()} == {new_server}


def _kill_idle_server() -> int:
    server = server_pid()
    sock = _forkserver.get_forkserver()._sock
    os.kill(server, signal.SIGKILL)
    # The server's end of the socket is closed: it is dead as far as the
    # launcher can tell (the I/O thread may not have reaped it yet).
    ready, _, _ = select.select([sock], [], [], 5)
    assert ready
    return server


def test_launch_right_after_an_idle_forkserver_died_starts_a_new_one(tmp_path):
    # The I/O thread may not have reaped the server yet (a race the launcher
    # used to lose in most attempts, with ConnectionResetError or
    # ForkServerDied('Broken pipe')).
    for attempt in range(3):
        run(tmp_path, fw.ident, {0: ()}, "forkserver", log_dir=tmp_path / f"warm{attempt}")
        dead = _kill_idle_server()
        result = run(tmp_path, fw.ident, {0: ()}, "forkserver", log_dir=tmp_path / f"next{attempt}")
        assert not result.is_failed(), result.failures
        assert result.return_values[0][1] == server_pid() != dead


def test_launch_after_an_idle_forkserver_died_and_was_reaped(tmp_path):
    run(tmp_path, fw.ident, {0: ()}, "forkserver", log_dir=tmp_path / "warm")
    dead = _kill_idle_server()
    deadline = time.monotonic() + 15
    while _forkserver.get_forkserver()._alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    result = run(tmp_path, fw.ident, {0: ()}, "forkserver", log_dir=tmp_path / "next")
    assert not result.is_failed(), result.failures
    assert result.return_values[0][1] == server_pid() != dead


def test_forkserver_preload_is_imported_by_a_fresh_server(tmp_path):
    modules = ("workers.functions", "colorsys")
    # Without a preload, the server has neither; each worker imports
    # workers.functions itself when it unpickles its function.
    _forkserver.get_forkserver()._stop()
    result = run(tmp_path, fw.preload_report, {0: (modules,)}, "forkserver", log_dir=tmp_path / "a")
    plain = result.return_values[0]
    assert plain["imported_by"] == plain["pid"]
    assert plain["loaded"] == {"workers.functions": True, "colorsys": False}
    _forkserver.get_forkserver()._stop()

    _forkserver.set_forkserver_preload(list(modules))
    result = run(tmp_path, fw.preload_report, {0: (modules,), 1: (modules,)}, "forkserver",
                 log_dir=tmp_path / "b")
    server = server_pid()
    for rank in (0, 1):
        report = result.return_values[rank]
        assert report["ppid"] == server
        assert report["imported_by"] == server  # imported once, in the server
        assert report["loaded"] == {"workers.functions": True, "colorsys": True}


def test_forkserver_preload_rejects_a_bare_string():
    with pytest.raises(TypeError):
        _forkserver.set_forkserver_preload("json")


def test_forkserver_survives_a_bad_preload(tmp_path, capfd):
    _forkserver.get_forkserver()._stop()
    _forkserver.set_forkserver_preload(["no_such_module_torchmp_t", "colorsys"])
    result = run(tmp_path, fw.preload_report, {0: (("colorsys",),)}, "forkserver")
    assert not result.is_failed(), result.failures
    assert result.return_values[0]["loaded"] == {"colorsys": True}
    _, err = capfd.readouterr()
    assert "no_such_module_torchmp_t" in err


def test_forkserver_is_started_once_and_reused(tmp_path):
    assert server_pid() is None
    first = run(tmp_path, fw.ident, {0: ()}, "forkserver", log_dir=tmp_path / "a")
    server = server_pid()
    second = run(tmp_path, fw.ident, {0: (), 1: ()}, "forkserver", log_dir=tmp_path / "b")
    assert server is not None and server_pid() == server and pid_alive(server)
    # (pid, ppid, main thread): every worker is a fresh child of the one server
    assert first.return_values[0][1] == server
    assert {v[1] for v in second.return_values.values()} == {server}
    assert len({first.return_values[0][0]} | {v[0] for v in second.return_values.values()}) == 3


# A SIGTERM from another process lands at a random moment in a forkserver
# launch of 64 sleeping ranks; 1 s after start_processes raised, no worker of
# the server may be alive.  (A worker forked just before the signal was
# dropped with its streams, looked exited, and was never signalled.)
INTERRUPTED_LAUNCH = """
    import os, random, signal, subprocess, sys, time
    import psutil
    import torchmp
    from torchmp import DefaultLogsSpecs, SignalException

    wanted, attempts, log_root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]

    def launch(i):
        return torchmp.start_processes("intr", time.sleep, args={r: (30,) for r in range(64)}, envs=None,
                                       logs_specs=DefaultLogsSpecs(log_dir=os.path.join(log_root, str(i))),
                                       start_method="forkserver")

    killer = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, time\\n"
        "for line in sys.stdin:\\n"
        "    time.sleep(float(line))\\n"
        "    os.kill(os.getppid(), 15)\\n"
        "    print('sent', flush=True)\\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def server_workers():
        found = []
        for server in psutil.Process().children():
            try:
                if "forkserver" not in " ".join(server.cmdline()):
                    continue
                workers = server.children()
            except psutil.Error:
                continue
            for p in workers:  # one gone meanwhile must not hide the others
                try:
                    if p.status() != psutil.STATUS_ZOMBIE:
                        found.append(p)
                except psutil.Error:
                    pass
        return found

    launch("warm").close()  # the server is up: the signals land in the forks
    # The shortest of three launches: on a loaded machine one launch can take
    # several times another, and a delay past the launch's end lands nowhere.
    spans = []
    for i in range(3):
        t0 = time.monotonic()
        ctx = launch(f"timed{i}")
        spans.append(time.monotonic() - t0)
        ctx.close()
    span = min(spans)
    with_workers = interrupted = tried = 0
    while interrupted < wanted and tried < attempts:
        i = tried
        tried += 1
        killer.stdin.write(f"{random.uniform(0, span)}\\n")
        killer.stdin.flush()
        ctx = None
        try:
            ctx = launch(i)
            time.sleep(5)  # the signal lands here instead: not a run that counts
        except SignalException:
            if ctx is None:
                interrupted += 1
                time.sleep(1)
                left = server_workers()
                with_workers += bool(left)
                for p in left:
                    p.kill()
        killer.stdout.readline()
        if ctx is not None:
            ctx.close(signal.SIGKILL, 5)
    killer.stdin.close()
    killer.wait()
    print("with_workers", with_workers, "interrupted", interrupted, "tried", tried)
"""


def test_an_interrupted_forkserver_launch_leaves_no_worker_alive(tmp_path):
    with Launchers(trailing_pathsep=True) as launchers:
        # Until 10 signals landed in a launch (a signal that lands after the
        # launch returned does not count), at most 60 tries.
        run = launchers.python(INTERRUPTED_LAUNCH, "10", "60", str(tmp_path))
        rc, out, err = run.communicate(600)
        assert rc == 0, err[-3000:]
        words = out.split()
        assert words[:2] == ["with_workers", "0"], out + err[-2000:]
        assert int(words[3]) >= 10, f"only {words[3]} of {words[5]} signals landed in a launch"
    assert launchers.left() == []
