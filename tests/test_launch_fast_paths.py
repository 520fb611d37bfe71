"""The shortcuts the launch path takes for speed (issue 22) give the same
answers as the long way: the OOM-killer baseline's cached cgroup follows a
move to another cgroup and a fork, the signal handlers installed through
CPython's C function are torch's handler, as signal.signal would install, and
a finished launch's group is freed without a wake-up of the I/O thread of its
own; a first launch makes no descriptor only to throw it away, and a lone
rank's spawn and exit make no system call they need not."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from torchmp import _oom, _signals, api
from torchmp._launch.exec import _exec_search_path, resolve_executable

from helpers import can_unshare_pid, launcher_env, run_launcher

CGROUP_V2 = "0::/job/a\n"
MOUNTINFO_V2 = "30 1 0:26 / {root} rw,nosuid - cgroup2 cgroup2 rw\n"


@pytest.fixture
def fake_proc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """/proc/self/cgroup and /proc/self/mountinfo as the test says, and a
    cgroup2 mount under tmp_path; _oom's caches emptied."""
    files = {"/proc/self/cgroup": CGROUP_V2, "/proc/self/mountinfo": MOUNTINFO_V2.format(root=tmp_path)}
    real = _oom._read

    def read(path: str) -> str:
        return files[path] if path in files else real(path)

    monkeypatch.setattr(_oom, "_read", read)
    monkeypatch.setattr(_oom, "_mounts", None)
    monkeypatch.setattr(_oom, "_resolved", None)
    for job, count in (("job/a", 3), ("job/b", 7)):
        d = tmp_path / job
        d.mkdir(parents=True)
        (d / "memory.events").write_text(f"low 0\nhigh 0\nmax 0\noom 1\noom_kill {count}\n")
    return files


def test_oom_baseline_follows_a_move_to_another_cgroup(fake_proc: dict[str, str], tmp_path: Path) -> None:
    first = _oom.start_watch()
    assert first is not None and first.cgroup.path == "/job/a" and first.before == 3
    assert _oom.start_watch().cgroup == first.cgroup  # (the cached answer)
    fake_proc["/proc/self/cgroup"] = "0::/job/b\n"  # the launcher was moved meanwhile
    moved = _oom.start_watch()
    assert moved is not None and moved.cgroup.path == "/job/b" and moved.before == 7
    assert moved.cgroup.counter_file == str(tmp_path / "job" / "b" / "memory.events")


def test_oom_baseline_cache_is_not_a_forked_childs(fake_proc: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    watch = _oom.start_watch()
    assert watch is not None
    # An entry left by another process (as a fork inherits it) is not used.
    cached = _oom._resolved
    assert cached is not None
    monkeypatch.setattr(_oom, "_resolved", (cached[0] + 1, *cached[1:3], _oom.MemCgroup(2, "/stale", "-")))
    again = _oom.start_watch()
    assert again is not None and again.cgroup.path == "/job/a"


def test_oom_baseline_reads_a_counter_larger_than_one_read(tmp_path: Path) -> None:
    counter = tmp_path / "memory.events"
    counter.write_text("x " * 70000 + "\noom_kill 5\n")  # past one 64 KiB read
    assert _oom.read_oom_kills(_oom.MemCgroup(2, "/", str(counter))) == 5


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="handlers need the main thread")
def test_handlers_installed_through_the_c_function_are_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGUSR1,SIGUSR2")
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2)}
    try:
        for s in saved:
            signal.signal(s, signal.SIG_DFL)
        api._install_signal_handlers()
        for s in saved:
            assert signal.getsignal(s) is _signals.terminate_process_handler
        with pytest.raises(api.SignalException) as raised:
            os.kill(os.getpid(), signal.SIGUSR1)
            signal.pthread_sigmask(signal.SIG_BLOCK, [])  # a point where the handler runs
        assert raised.value.sigval == signal.SIGUSR1
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def test_a_replaced_signal_function_is_still_called(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[object, object]] = []
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGUSR2")
    monkeypatch.setattr(signal, "signal", lambda sig, handler: calls.append((sig, handler)))
    api._install_signal_handlers()
    assert calls == [(signal.SIGUSR2, _signals.terminate_process_handler)]


class _CountingLogger(logging.Logger):
    def __init__(self, level: int) -> None:
        super().__init__("counting", level)
        self.infos: list[tuple[object, ...]] = []

    def info(self, msg: object, *args: object, **kwargs: object) -> None:  # type: ignore[override]
        self.infos.append((msg, *args))


class _InfoOnly:
    """A logger stand-in with no isEnabledFor: it gets every line."""

    def __init__(self) -> None:
        self.infos: list[tuple[object, ...]] = []

    def info(self, msg: object, *args: object) -> None:
        self.infos.append((msg, *args))


def test_handler_log_lines_asked_once_of_the_logger(monkeypatch: pytest.MonkeyPatch) -> None:
    """A logger at INFO gets torch's line per handler; one above INFO is not
    called for them at all (the level is asked once); a stand-in without
    isEnabledFor gets them all."""
    monkeypatch.setattr(signal, "signal", lambda sig, handler: None)  # nothing really installed
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGUSR1,SIGUSR2")
    lines = [("Registered signal handler for %s", "SIGUSR1"), ("Registered signal handler for %s", "SIGUSR2")]
    for log, expected in ((_CountingLogger(logging.INFO), lines), (_CountingLogger(logging.WARNING), []),
                          (_InfoOnly(), lines)):
        _signals.install_handlers(signal, threading, log)
        assert log.infos == expected, log


def test_the_inherited_path_is_read_as_os_environb_says(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A binary is looked up on the launcher's PATH (read through the
    environment's own dict), or on os.environb's word where a framework
    replaced it; os.defpath without one."""
    (tmp_path / "only-here").write_text("#!/bin/sh\n")
    (tmp_path / "only-here").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert resolve_executable("only-here") == os.fsencode(tmp_path / "only-here")
    monkeypatch.setattr(os, "environb", {b"PATH": os.fsencode(tmp_path)})
    assert resolve_executable("only-here") == os.fsencode(tmp_path / "only-here")
    monkeypatch.setattr(os, "environb", {})
    assert _exec_search_path({}) == os.defpath.encode()


def test_a_finished_launch_is_freed_without_a_wake_up_of_its_own(tmp_path: Path) -> None:
    # A one-binary launch spawned in the caller's thread wakes the I/O thread
    # once, for the exit (it records it even while the caller collects it).
    # When close() has reaped the rank, freeing the group waits for the I/O
    # thread's next wake-up instead of waking it again -- and the groups are
    # still freed, a bounded number at a time.
    script = f"""
        import json, os, torchmp
        from torchmp import _core
        def launch():
            ctx = torchmp.start_processes("w", "true", {{0: ()}}, {{0: {{}}}},
                                          torchmp.DefaultLogsSpecs(log_dir={str(tmp_path)!r}))
            ctx.wait()
            ctx.close()
        for _ in range(100):
            launch()
        io = [t for t in os.listdir("/proc/self/task")
              if open(f"/proc/self/task/{{t}}/comm").read().strip() == "torchmp-io"][0]
        def sleeps():
            for line in open(f"/proc/self/task/{{io}}/status"):
                if line.startswith("voluntary_ctxt_switches"):
                    return int(line.split()[1])
        before = sleeps()
        for _ in range(40):
            launch()
        woken = sleeps() - before
        most = 0
        for _ in range(300):
            launch()
            most = max(most, _core.groups_alive())
        print(json.dumps({{"backend": _core.backend(), "woken": woken, "most_alive": most}}))
    """
    res = run_launcher(script, timeout=120)
    assert res.returncode == 0, res.stderr.decode()
    got = json.loads(res.stdout)
    # Groups released since the I/O thread last woke wait for it: 64 ranks'
    # worth at most, plus those released while it wakes up.
    assert got["most_alive"] <= 128, got
    if got["backend"] == "epoll":  # (the poll backend spawns from the I/O thread: a command each)
        assert got["woken"] <= 70, got  # 80 when each release woke it


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_a_first_launch_makes_no_descriptor_it_throws_away(tmp_path: Path) -> None:
    # The first launch of a process makes the I/O thread.  Choosing its
    # backend used to open a pidfd of the launcher itself only to close it,
    # and naming the thread opened /proc/self/task/TID/comm from the
    # launching thread: 60 us of the launcher's CPU together.  Now the
    # probe makes no descriptor and the thread names itself.
    script = f"""
        import json, os, time, torchmp
        from torchmp import _core
        ctx = torchmp.start_processes("w", "true", {{0: (), 1: ()}}, {{0: {{}}, 1: {{}}}},
                                      torchmp.DefaultLogsSpecs(log_dir={str(tmp_path / "logs")!r}))
        pids = sorted(ctx.pids().values())
        ctx.wait()
        ctx.close()
        # The thread names itself when it first runs: on a busy machine that
        # can come after a short launch has returned.
        for _ in range(500):
            names = [open(f"/proc/self/task/{{t}}/comm").read().strip() for t in os.listdir("/proc/self/task")]
            if "torchmp-io" in names:
                break
            time.sleep(0.01)
        print(json.dumps({{"backend": _core.backend(), "ranks": pids, "threads": names}}))
    """
    trace = tmp_path / "trace"
    code = textwrap.dedent(script)
    res = subprocess.run(["strace", "-f", "-qq", "-e", "trace=pidfd_open,openat", "-o", str(trace),
                          sys.executable, "-c", code], cwd=tmp_path, capture_output=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert res.returncode == 0, res.stderr.decode()
    got = json.loads(res.stdout)
    assert "torchmp-io" in got["threads"]
    calls = trace.read_text().splitlines()
    pidfds = sorted(int(m[1]) for line in calls if (m := re.search(r"pidfd_open\((-?\d+), ", line)))
    # One per rank (the poll backend watches none); a probe names no process.
    ranks = got["ranks"] if got["backend"] == "epoll" else []
    assert [pid for pid in pidfds if pid > 0] == ranks, [line for line in calls if "pidfd_open" in line]
    # (The script reads the names back: only an open to write counts.)
    assert not [line for line in calls if "/comm" in line and "O_RDONLY" not in line]


def test_the_result_asks_the_consoles_only_once_one_was_used(tmp_path: Path) -> None:
    # wait() lets the launcher's fd consoles catch up and says if one was
    # switched off, once it has its result.  Until something was given to an
    # fd console (a teed stream, torchmp's own words) none can have bytes
    # waiting or have failed, and the core is not asked: that is on the path
    # from the last exit to wait()'s return.  Once one was, it is asked at
    # every result, also of launches that tee nothing.
    script = f"""
        import json, torchmp
        from torchmp import _console, _core
        asked = []
        for name in ("consoles_pending", "consoles_shown", "console_failure"):
            def counted(*args, _real=getattr(_core, name), _name=name):
                asked.append(_name)
                return _real(*args)
            setattr(_core, name, counted)
        def launch(tee, log_dir):
            ctx = torchmp.start_processes("w", "echo", {{0: ("hello",)}}, {{0: {{}}}},
                                          torchmp.DefaultLogsSpecs(log_dir=log_dir, tee=tee))
            result = ctx.wait(30)
            ctx.close()
            assert not result.is_failed(), result.failures
            got = sorted(set(asked))
            asked.clear()
            return got
        seen = {{"quiet": launch(torchmp.Std.NONE, {str(tmp_path / "a")!r})}}
        seen["teed"] = launch(torchmp.Std.OUT, {str(tmp_path / "b")!r})
        seen["quiet_after"] = launch(torchmp.Std.NONE, {str(tmp_path / "c")!r})
        print(json.dumps(seen))
    """
    res = run_launcher(script)
    assert res.returncode == 0, res.stderr.decode()
    last = res.stdout.decode().splitlines()[-1]
    assert json.loads(last) == {"quiet": [], "teed": ["console_failure", "consoles_pending"],
                                "quiet_after": ["console_failure", "consoles_pending"]}, res.stdout
    # The worker's line reached the console each time (prefixed when teed).
    assert res.stdout.decode().splitlines()[:-1] == ["hello", "[w0]:hello", "hello"]


LONE_RANKS = """
import json, os, sys, torchmp
d = sys.argv[1]
ranks = []
for i in range(6):
    if i == 1:
        os.umask(0o022)  # the mark: what follows is warm
    ctx = torchmp.start_processes("w", "true", {0: ()}, {0: {}},
                                  torchmp.DefaultLogsSpecs(log_dir=os.path.join(d, str(i))))
    ranks.append(ctx.pids()[0])
    assert not ctx.wait(30).is_failed()
    ctx.close()
print(json.dumps({"launcher": os.getpid(), "ranks": ranks[1:]}))
"""


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_a_lone_rank_s_spawn_and_exit_make_no_call_they_need_not(tmp_path: Path) -> None:
    # Five warm launches of one `true`, traced in a pid namespace of their
    # own (so that no other process takes a pid meanwhile).  The vfork
    # child, which its launcher waits for, takes its pid from setsid() and
    # closes every descriptor it does not keep in one close_range (it used
    # to call getpid(), close 3 and 4 one by one, then close_range from 5).
    # The launcher, waiting for the rank, records its exit itself without
    # waking itself through its own eventfd; and with no pid handed out
    # since the rank's, the look for what is left in its process group
    # before reaping it reads ns_last_pid once, not twice.
    if not can_unshare_pid():
        pytest.skip("no private pid namespace here (unshare --pid)")
    trace = tmp_path / "trace"
    res = subprocess.run([shutil.which("unshare"), "--pid", "--fork", "--mount-proc",
                          shutil.which("strace"), "-ff", "-qq", "-ttt", "-y", "-o", str(trace), "-e",
                          "trace=umask,getpid,close,close_range,pread64,write,vfork,execve,eventfd2,pipe,pipe2",
                          sys.executable, "-c", LONE_RANKS, str(tmp_path)],
                         capture_output=True, timeout=120, cwd="/", env=launcher_env(),
                         start_new_session=True)
    assert res.returncode == 0, res.stderr.decode()
    got = json.loads(res.stdout.decode().splitlines()[-1])
    # One file per task (-ff): "<seconds.micros> <call>(...) = <result>".
    tasks = {int(p.name.rsplit(".", 1)[1]): [line.split(" ", 1) for line in p.read_text().splitlines()]
             for p in tmp_path.glob("trace.*")}
    launcher = tasks[got["launcher"]]
    mark = next(float(t) for t, call in launcher if call.startswith("umask("))
    warm = [call for t, call in launcher if float(t) > mark]
    # (Without vfork, TORCHMP_NO_VFORK, the child is a fork: its pid is
    # looked up by the C library's fork handlers, and the pipe it reports a
    # failed exec on splits the range it closes.)
    if any(call.startswith("vfork(") for call in warm):
        for rank in got["ranks"]:
            before_exec = []
            for _, call in tasks[rank]:
                if call.startswith("execve("):
                    break
                before_exec.append(call)
            assert before_exec, f"no trace of rank {rank}"
            assert not [c for c in before_exec if c.startswith(("getpid(", "close("))], before_exec
            assert len([c for c in before_exec if c.startswith("close_range(")]) == 1, before_exec
    # The channels the launcher made to wait on: eventfds, or the write ends
    # of pipes where there are none (the portable build).  The I/O thread's
    # own, made before the mark, is written to when a command is handed to it.
    waits = {m[1] for call in warm if (m := re.match(r"eventfd2\(.*\) = (\d+)<", call))}
    waits |= {m[1] for call in warm if (m := re.match(r"pipe2?\(\[\d+<[^>]*>, (\d+)<", call))}
    assert waits
    own_wakeups = [call for call in warm if (m := re.match(r"write\((\d+)<", call)) and m[1] in waits]
    assert own_wakeups == []
    # Each exit's look reads the counter once: the old look's two reads came
    # one right after the other in one task.  (close() reads it too, for its
    # own look, when it finds the rank not reaped yet: the I/O thread may
    # record an exit, wake the waiter and be beaten to the early reap.  Its
    # read is the only one of that look, so it is never half of a pair.)
    def reads_counter(call: str) -> bool:
        return call.startswith("pread64(") and "ns_last_pid>" in call

    looks, pairs = 0, []
    for calls in tasks.values():
        warm_calls = [call for t, call in calls if float(t) > mark]
        looks += sum(map(reads_counter, warm_calls))
        pairs += [(a, b) for a, b in zip(warm_calls, warm_calls[1:], strict=False)
                  if reads_counter(a) and reads_counter(b)]
    assert pairs == []
    assert looks >= len(got["ranks"])
