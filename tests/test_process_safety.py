"""Process control that never hurts the job (issue: safe kills, group grace,
no crash, no strays).

Each test drives the adversarial case itself, in a launcher of its own (a
subprocess) wherever the case could crash, hang or kill the launcher:

* a recycled pid in a private pid namespace must never be signalled;
* the grace period covers a rank's whole process group;
* close() racing wait(), close() and a signal handler must not crash;
* a signal anywhere in a launch leaves no untracked worker;
* nothing of a rank survives its launcher, however the launcher ends.

Every launcher carries a unique TORCHMP_TEST_TAG that its workers inherit:
cleanup finds leftovers by that tag and kills them by process group.
"""
from __future__ import annotations

import os
import shutil
import signal
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

import torchmp
from torchmp import _core
from helpers import (TAG_VAR, Launcher, Launchers, can_unshare_pid, kill_tagged, launcher_env, pid_alive, wait_gone,
                     wait_no_tagged)


@pytest.fixture
def launcher():
    """Start ``[*argv_prefix, python, -c, script, *args]`` (a Launcher);
    stopped at the end of the test."""
    with Launchers(trailing_pathsep=True) as launchers:
        def start(script: str, *args: str, env: dict[str, str] | None = None,
                  argv_prefix: list[str] | None = None) -> Launcher:
            return launchers.python(script, *args, argv_prefix=argv_prefix or (), env=env)

        yield start


def wait_for_file(path: Path, text: str = "", timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            content = path.read_text()
        except FileNotFoundError:
            content = None
        if content is not None and text in content:
            return content
        time.sleep(0.01)
    raise AssertionError(f"{path} did not get {text!r} in {timeout}s")


# ---------------------------------------------------------------------------
# 1. A signal never reaches a process that is not ours.

REUSE_SCRIPT = """
    import os, subprocess, sys, time
    import torchmp
    from torchmp import DefaultLogsSpecs

    ctx = torchmp.start_processes(
        "reuse", "sh", args={0: ("-c", "exec sleep 30"), 1: ("-c", sys.argv[2])}, envs=None,
        logs_specs=DefaultLogsSpecs(log_dir=sys.argv[1]))
    victim = ctx.pids()[1]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{victim}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        except (FileNotFoundError, ProcessLookupError):  # (reaped before the open, or before the read)
            break
        time.sleep(0.005)
    time.sleep(0.2)  # time for a launcher that reaps at once to have reaped
    # The next pid handed out is the victim's, if it is free: an unrelated
    # program starts there and makes a session (and process group) of its own.
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(victim - 1))
    stranger = subprocess.Popen(["sleep", "30"], start_new_session=True)
    ctx.close(timeout=5)
    alive = stranger.poll() is None
    victim_reaped = not os.path.exists(f"/proc/{victim}")
    stranger.kill()
    stranger.wait()
    print(victim, stranger.pid, int(alive), int(victim_reaped))
"""


@pytest.mark.parametrize("how", ["killed", "exited"])
def test_recycled_pid_in_a_private_pid_namespace_is_never_signalled(launcher, tmp_path, how):
    """killed: the rank died of a signal, and its zombie pins its pid until
    close() is done with it.  exited: it exited by itself leaving its group
    empty, so torchmp let the pid go at once (nothing could be signalled
    through it) -- and a stranger that gets it must live through close()."""
    if not can_unshare_pid():
        pytest.skip("no private pid namespace here (unshare --pid, ns_last_pid)")
    rank1 = {"killed": "kill -TERM $$", "exited": "exit 0"}[how]
    run = launcher(REUSE_SCRIPT, str(tmp_path), rank1,
                   argv_prefix=[shutil.which("unshare"), "--pid", "--fork", "--mount-proc"])
    rc, out, err = run.communicate(60)
    assert rc == 0, err
    victim, stranger, alive, victim_reaped = (int(x) for x in out.split())
    if how == "killed":
        assert stranger != victim, "the killed rank's pid was free for reuse while torchmp could still signal it"
    else:
        # Nothing else hands out pids in this namespace: the rank was reaped
        # at its exit, before close(), and the stranger took its pid.
        assert stranger == victim, "the rank that exited with an empty group was not reaped before close()"
    # Either way the stranger lives through close(), and no zombie is left.
    assert alive == 1, "close() killed a process that is not torchmp's"
    assert victim_reaped == 1 or stranger == victim


def test_killed_rank_stays_a_zombie_until_close_then_is_reaped(tmp_path):
    ctx = torchmp.start_processes("zombie", "sh", args={0: ("-c", "exec sleep 30"), 1: ("-c", "kill -TERM $$")},
                                  envs=None, logs_specs=torchmp.DefaultLogsSpecs(log_dir=str(tmp_path)))
    try:
        pids = ctx.pids()
        deadline = time.monotonic() + 10
        while psutil.Process(pids[1]).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.1)
        # Recorded, but not reaped: the zombie keeps pid and group id ours.
        assert psutil.Process(pids[1]).status() == psutil.STATUS_ZOMBIE
        result = ctx.wait(10)
        assert result is not None and result.failures[1].exitcode == -signal.SIGTERM
        assert result.resources[1].exitcode == -signal.SIGTERM and result.resources[1].wall_time > 0
        assert not psutil.pid_exists(pids[1]) or psutil.Process(pids[1]).status() != psutil.STATUS_ZOMBIE
        assert wait_gone([pids[0]]) == []
    finally:
        ctx.close(signal.SIGKILL, 1)


# ---------------------------------------------------------------------------
# 2. The grace period covers the whole process group.

SAVER = """
import os, signal, sys, time
ready, ckpt = sys.argv[1], sys.argv[2]
def save(signum, frame):
    time.sleep(2)  # writing a checkpoint after SIGTERM
    with open(ckpt, "w") as f:
        f.write("saved")
    sys.exit(0)
signal.signal(signal.SIGTERM, save)
with open(ready, "a") as f:
    f.write(f"{os.getpid()}\\n")
while True:
    time.sleep(0.1)
"""


def _wrapper_args(tmp_path: Path, rank: int) -> tuple[str, ...]:
    saver = tmp_path / "saver.py"
    saver.write_text(SAVER)
    # The shell is the rank's leader; SIGTERM ends it at once while its
    # child, in the same process group, is still saving.
    script = (f'trap "exit 143" TERM; "{sys.executable}" "{saver}" "{tmp_path}/ready" '
              f'"{tmp_path}/ckpt{rank}" & wait')
    return ("-c", script)


def test_close_gives_the_whole_group_its_grace_period(tmp_path):
    ctx = torchmp.start_processes(
        "wrap", "sh", args={0: _wrapper_args(tmp_path, 0), 1: _wrapper_args(tmp_path, 1)}, envs=None,
        logs_specs=torchmp.DefaultLogsSpecs(log_dir=str(tmp_path / "logs")))
    savers: list[int] = []
    try:
        deadline = time.monotonic() + 20
        while len(savers) < 2 and time.monotonic() < deadline:
            try:
                savers = [int(x) for x in (tmp_path / "ready").read_text().split()]
            except FileNotFoundError:
                pass
            time.sleep(0.01)
        assert len(savers) == 2
        t0 = time.monotonic()
        ctx.close(signal.SIGTERM, timeout=20)
        elapsed = time.monotonic() - t0
        assert (tmp_path / "ckpt0").read_text() == "saved"
        assert (tmp_path / "ckpt1").read_text() == "saved"
        # close() returns once the groups are empty, not at the timeout.
        assert 1.9 < elapsed < 15, elapsed
        assert wait_gone(savers, 1) == []
    finally:
        for pid in savers:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        ctx.close(signal.SIGKILL, 1)


def test_background_helper_of_an_exited_rank_gets_the_death_signal(tmp_path):
    """A rank that succeeded left a helper in its group: close() (called by
    wait() once the result is in) gives it SIGTERM first, not SIGKILL."""
    mark = tmp_path / "helper"
    # The helper says it is up once its trap is set: a SIGTERM before that
    # would kill it without a word (the close() follows the leader's exit
    # within a millisecond).
    helper = (f'( trap \'echo term > "{mark}"; exit 0\' TERM; echo started > "{mark}.up"; '
              f'while :; do sleep 0.05; done ) & exit 0')
    ctx = torchmp.start_processes("helper", "sh", args={0: ("-c", helper)}, envs=None,
                                  logs_specs=torchmp.DefaultLogsSpecs(log_dir=str(tmp_path / "logs")))
    try:
        wait_for_file(tmp_path / "helper.up", "started")
        result = ctx.wait(20)
        assert result is not None and not result.is_failed()
        assert wait_for_file(mark, "term", timeout=5) == "term\n"
    finally:
        ctx.close(signal.SIGKILL, 1)


def test_torchmp_run_sigterm_gives_the_whole_group_its_grace_period(launcher, tmp_path):
    (tmp_path / "saver.py").write_text(SAVER)
    run = launcher("import sys\nfrom torchmp.__main__ import main\nsys.exit(main())",
                   "run", "-n", "1", "--shutdown-timeout", "20", "--log-dir", str(tmp_path / "logs"),
                   "--", "sh", *_wrapper_args(tmp_path, 0))
    try:
        pid = int(wait_for_file(tmp_path / "ready", "\n", timeout=20).split()[0])
        os.kill(run.proc.pid, signal.SIGTERM)
        rc, out, err = run.communicate(30)
        assert (tmp_path / "ckpt0").read_text() == "saved", err
        assert rc == 143, err
        assert wait_gone([pid], 1) == []
    finally:
        run.stop()


# ---------------------------------------------------------------------------
# 3. No crash when close() races wait() or another close().

RACE_SCRIPT = """
    import os, random, signal, sys, threading, time
    import torchmp
    from torchmp import DefaultLogsSpecs

    mode, rounds = sys.argv[1], int(sys.argv[2])
    specs = DefaultLogsSpecs(log_dir=sys.argv[3])
    rng = random.Random(1234)
    outcomes = {}

    def launch():
        return torchmp.start_processes("race", "sleep", args={0: ("30",), 1: ("30",)}, envs=None,
                                       logs_specs=specs)

    for i in range(rounds):
        ctx = launch()
        pids = list(ctx.pids().values())
        delay = rng.uniform(0, 0.003)
        if mode == "handler":
            # A graceful-shutdown handler that closes while main sits in wait().
            signal.signal(signal.SIGUSR1, lambda s, f: ctx.close(timeout=5))
            timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGUSR1))
            timer.start()
            result = ctx.wait(30)
            timer.join()
        elif mode == "watchdog":
            timer = threading.Timer(delay, ctx.close, kwargs={"timeout": 5})
            timer.start()
            result = ctx.wait(30)
            timer.join()
        elif mode == "two_closers":
            threads = [threading.Thread(target=ctx.close, kwargs={"timeout": 5}) for _ in range(2)]
            for t in threads:
                t.start()
            time.sleep(delay)
            ctx.close(timeout=5)
            for t in threads:
                t.join()
            result = ctx.wait(0)
        else:
            raise SystemExit(f"unknown mode {mode}")
        if result is None:
            raise SystemExit(f"round {i}: wait() returned None after close()")
        key = tuple(sorted((r, f.exitcode) for r, f in result.failures.items()))
        outcomes[key] = outcomes.get(key, 0) + 1
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    raise SystemExit(f"round {i}: worker {pid} outlived close(): {f.read()[:60]}")
            except FileNotFoundError:
                pass
    print("ok", rounds, sorted(outcomes.items()))
"""


@pytest.mark.parametrize("mode, rounds", [("handler", 300), ("watchdog", 1000), ("two_closers", 1000)])
def test_close_racing_wait_or_close_never_crashes(launcher, tmp_path, mode, rounds):
    run = launcher(RACE_SCRIPT, mode, str(rounds), str(tmp_path))
    rc, out, err = run.communicate(300)
    assert rc == 0, f"rc={rc} (a negative rc is the signal that killed the launcher)\n{out}\n{err[-3000:]}"
    assert out.startswith(f"ok {rounds} "), out
    # Every round ended with both ranks terminated by close().
    assert "(0, -15), (1, -15)" in out or "(0, -9), (1, -9)" in out, out


def test_wait_from_many_threads_all_return_the_result(tmp_path):
    import threading

    ctx = torchmp.start_processes("waiters", "sh", args={0: ("-c", "sleep 0.3; exit 0")}, envs=None,
                                  logs_specs=torchmp.DefaultLogsSpecs(log_dir=str(tmp_path)))
    results: list[object] = []
    threads = [threading.Thread(target=lambda: results.append(ctx.wait(20))) for _ in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(results) == 8
        assert all(r is not None and not r.is_failed() for r in results)  # type: ignore[attr-defined]
    finally:
        ctx.close()


# ---------------------------------------------------------------------------
# 4. No untracked worker after an interrupted launch.

INTERRUPT_SCRIPT = """
    import os, random, signal, subprocess, sys, time
    import psutil
    import torchmp
    from torchmp import DefaultLogsSpecs, SignalException, _orphans

    method, runs, nprocs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    launches = iter(range(1_000_000))

    def launch():
        # A log dir per launch: each launch a run of its own.  (A signal
        # inside a reused spec's removal of the old attempt has a test of
        # its own below.)
        specs = DefaultLogsSpecs(log_dir=os.path.join(sys.argv[4], str(next(launches))))
        if method == "exec":
            return torchmp.start_processes("intr", "sleep", args={r: ("30",) for r in range(nprocs)},
                                           envs=None, logs_specs=specs)
        return torchmp.start_processes("intr", time.sleep, args={r: (30,) for r in range(nprocs)}, envs=None,
                                       logs_specs=specs, start_method=method)

    # The signal comes from another process, as a Ctrl-C or a scheduler's
    # SIGTERM does: the kernel delivers it to the main thread, whenever that
    # thread has it unblocked.
    killer = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, time\\n"
        "for line in sys.stdin:\\n"
        "    time.sleep(float(line))\\n"
        "    os.kill(os.getppid(), 15)\\n"
        "    print('sent', flush=True)\\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def living_children():
        found = []
        for p in psutil.Process().children(recursive=True):
            try:
                if (p.pid != killer.pid and p.status() != psutil.STATUS_ZOMBIE
                        and "forkserver" not in " ".join(p.cmdline())):
                    found.append(p)
            except psutil.Error:
                pass
        return found

    def by_signal(exc):
        # SignalException, or what it caused where it landed (e.g. the
        # EBADF of a shutil.rmtree it interrupted): the launch was stopped.
        while exc is not None:
            if isinstance(exc, SignalException):
                return True
            exc = exc.__context__
        return False

    # How long one launch takes here: the signals land all over it.  The
    # first launch starts what later ones reuse (the forkserver: a whole
    # interpreter, seconds under a sanitizer on a loaded machine), so the
    # second is timed: from the first, most signals of the 100 runs would
    # come after their launch, and the wait for them would outlast the
    # test's 400 s.
    launch().close(signal.SIGKILL, 5)
    t0 = time.monotonic()
    launch().close(signal.SIGKILL, 5)
    span = (time.monotonic() - t0) * 1.2
    leaks = interrupted = 0
    for i in range(runs):
        ctx = None
        try:
            try:
                killer.stdin.write(f"{random.uniform(0, span)}\\n")
                killer.stdin.flush()
                sent_by = time.monotonic() + span
                ctx = launch()
                # The signal is on its way (or was lost): its handler raises
                # here.  (Waited for from when the killer sends it at the
                # latest: under a sanitizer the first launch, and so span,
                # can be longer than a later launch by seconds.)
                deadline = max(sent_by, time.monotonic()) + 5
                while time.monotonic() < deadline:
                    time.sleep(0.001)
            except Exception as e:
                if not by_signal(e):
                    raise
                interrupted += 1
        except Exception as e:  # landed in the except clause above
            if not by_signal(e):
                raise
            interrupted += 1
        killer.stdout.readline()  # it sent this run's one signal
        # Whatever a context knows about is closed; anything alive after
        # that is a worker nobody tracks.
        for known in [ctx, *_orphans.live_contexts()]:
            if known is not None:
                known.close(signal.SIGKILL, 5)
        strays = living_children()
        if strays:
            leaks += len(strays)
            for p in strays:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass
                try:
                    p.kill()
                    p.wait(5)
                except psutil.Error:
                    pass
    killer.stdin.close()
    killer.wait()
    print("leaks", leaks, "interrupted", interrupted)
"""


@pytest.mark.parametrize("method, runs, nprocs", [
    ("fork", 120, 64),
    ("forkserver", 100, 64),
    ("exec", 120, 64),
    ("spawn", 100, 4),  # a spawn worker is a whole interpreter: fewer per launch
])
def test_signal_anywhere_in_a_launch_leaves_no_untracked_worker(launcher, tmp_path, method, runs, nprocs):
    run = launcher(INTERRUPT_SCRIPT, method, str(runs), str(nprocs), str(tmp_path))
    rc, out, err = run.communicate(400)
    assert rc == 0, err[-3000:]
    words = out.split()
    assert words[:2] == ["leaks", "0"], out + err[-2000:]
    assert int(words[3]) == runs, f"only {words[3]} of {runs} signals interrupted the launcher\n{err[-2000:]}"
    # A handler's exception raised inside a fork hook is printed and dropped:
    # the launcher would carry on as if no signal had come.
    assert "Exception ignored" not in err, err[-3000:]
    assert wait_no_tagged(run.tag, 10) == []


# A signal whose handler runs inside a console's write or flush, or while a
# worker's return value is unpickled, stops the launcher as anywhere else.
# Those calls sit in catch-alls for the console's own failures (an odd
# object, a closed stream) or the value's.  The random signals above hit the
# fork launch's flush once in thousands of runs and were swallowed: here the
# console, or the value, sends the signal itself.
TRIPPED_CONSOLE_SCRIPT = """
    import logging, os, signal, sys, time
    import psutil
    import torchmp
    from torchmp import DefaultLogsSpecs, SignalException
    from torchmp._signals import install_handlers

    where, log_dir = sys.argv[1], sys.argv[2]

    class Tripwire:
        # A console object whose first write or flush sends SIGTERM to its
        # own process: the handler runs (and raises) inside that call.
        def __init__(self, real, on):
            self.real, self.on, self.armed = real, on, True

        def _trip(self, call):
            if self.armed and call == self.on:
                self.armed = False
                os.kill(os.getpid(), signal.SIGTERM)

        def write(self, text):
            self._trip("write")
            return self.real.write(text)

        def flush(self):
            self._trip("flush")
            self.real.flush()

    def trip():
        os.kill(os.getpid(), signal.SIGTERM)

    class Tripped:
        # Unpickled in the launcher, it sends the launcher SIGTERM.
        def __reduce__(self):
            return trip, ()

    outcome = "not interrupted"
    try:
        if where == "return value":
            ctx = torchmp.start_processes("tripped", Tripped, args={0: ()}, envs=None,
                                          logs_specs=DefaultLogsSpecs(log_dir=log_dir), start_method="fork")
            try:
                ctx.wait(30)
            finally:
                ctx.close()
        elif where == "fork launch":
            # The fork launch flushes the launcher's streams first.
            sys.stdout = Tripwire(sys.__stdout__, "flush")
            ctx = torchmp.start_processes("tripped", time.sleep, args={0: (30,), 1: (30,)}, envs=None,
                                          logs_specs=DefaultLogsSpecs(log_dir=log_dir), start_method="fork")
            ctx.close()
        else:
            # torchmp's own words, on a console object, outside any launch.
            install_handlers()
            sys.stderr = Tripwire(sys.__stderr__, "write")
            logging.getLogger("torchmp.api").warning("torchmp's own words")
    except SignalException as e:
        outcome = f"interrupted by {e.sigval.name}"
    finally:
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    alive = [p.pid for p in psutil.Process().children(recursive=True)
             if p.status() != psutil.STATUS_ZOMBIE and "forkserver" not in " ".join(p.cmdline())]
    print(outcome, "| alive:", alive, flush=True)
"""


@pytest.mark.parametrize("where", ["fork launch", "own words", "return value"])
def test_a_signal_inside_a_catch_all_is_not_swallowed(launcher, tmp_path, where):
    run = launcher(TRIPPED_CONSOLE_SCRIPT, where, str(tmp_path / "logs"))
    rc, out, err = run.communicate(60)
    assert rc == 0, err[-3000:]
    assert out == "interrupted by SIGTERM | alive: []\n", out + err[-3000:]
    assert "Exception ignored" not in err and "Logging error" not in err, err[-3000:]
    assert wait_no_tagged(run.tag, 10) == []


# A reused DefaultLogsSpecs clears the attempt's old directory (torch with
# shutil.rmtree(ignore_errors=True), whose catch-all swallows what a handler
# raises inside it).  A signal at every point of that removal where a
# handler can run must stop the reify.
REIFY_SCRIPT = """
    import os, shutil, signal, sys
    from torchmp import DefaultLogsSpecs, SignalException
    from torchmp._signals import install_handlers

    install_handlers()
    specs = DefaultLogsSpecs(log_dir=sys.argv[1])

    def reify():
        dest = specs.reify({r: {} for r in range(4)})
        for rank in range(4):
            with open(dest.error_files[rank], "w") as f:  # something to remove next time
                f.write("{}")

    def point(frame, event):  # in shutil (the removal), once a call returned
        return event == "c_return" and frame.f_code.co_filename == shutil.__file__

    reify()
    points = [0]

    def count(frame, event, arg):
        if point(frame, event):
            points[0] += 1

    sys.setprofile(count)
    reify()
    sys.setprofile(None)
    total, lost, me = points[0], [], os.getpid()
    for k in range(1, total + 1):
        points[0] = 0

        def interrupt(frame, event, arg):
            if point(frame, event):
                points[0] += 1
                if points[0] == k:
                    os.kill(me, signal.SIGTERM)

        try:
            sys.setprofile(interrupt)
            try:
                reify()
            finally:
                sys.setprofile(None)
            lost.append(k)
        except SignalException:
            pass
        reify()  # a whole attempt directory again
    print("points", total, "lost", lost)
"""


def test_a_signal_inside_the_old_attempts_removal_stops_the_reify(launcher, tmp_path):
    run = launcher(REIFY_SCRIPT, str(tmp_path / "logs"))
    rc, out, err = run.communicate(120)
    assert rc == 0, err[-3000:]
    words = out.split()
    assert words[0] == "points" and int(words[1]) > 10, out
    assert out.split(" lost ", 1)[1] == "[]\n", out


# The same at every point of torchmp's Python where a handler can run, one
# run per point.  The interpreter runs handlers as a function starts and
# once a call has returned: a profile hook counts those points in torchmp's
# frames (its functions' starts and returns, the returns of the C functions
# they call) in one run, then sends SIGTERM at the k-th in run k, so the
# handler raises right there.  Every signal must come out as
# SignalException, and nothing the run started may be left running.
EVERY_POINT_SCRIPT = """
    import inspect, os, signal, subprocess, sys, time
    import psutil
    import torchmp
    from torchmp import DefaultLogsSpecs, SignalException, _orphans
    from torchmp._signals import install_handlers

    what, log_root = sys.argv[1], sys.argv[2]
    runs = iter(range(1_000_000))

    def one_run():
        specs = DefaultLogsSpecs(log_dir=os.path.join(log_root, str(next(runs))))
        if what == "run":
            try:
                torchmp.run(["sh", "-c", "echo hi; exec sleep 30"], capture_output=True, timeout=0.05)
            except subprocess.TimeoutExpired:
                pass
            return
        if what in ("fork", "forkserver"):
            ctx = torchmp.start_processes("every", abs, args={0: (1,), 1: (2,)}, envs=None, logs_specs=specs,
                                          start_method=what)
        elif what == "tee":  # the workers' lines on the launcher's console, as it writes its own
            specs = DefaultLogsSpecs(log_dir=specs.root_log_dir, tee=torchmp.Std.ALL)
            ctx = torchmp.start_processes("every", "echo", args={0: ("hi",), 1: ("ho",)}, envs=None,
                                          logs_specs=specs)
        else:
            ctx = torchmp.start_processes("every", "true", args={0: (), 1: ()}, envs=None, logs_specs=specs)
        try:
            ctx.wait(30)
        finally:
            ctx.close()

    def point(frame, event):
        # (Not in a generator's frame: all() drops a generator it stopped
        # early, and closing it enters the frame without looking for
        # signals; only a hook like this one would run a handler there.)
        code = frame.f_code
        return (event in ("call", "return", "c_return") and "/torchmp/" in code.co_filename
                and not code.co_flags & inspect.CO_GENERATOR)

    def strays(known):
        found = []
        for p in psutil.Process().children(recursive=True):
            try:
                if p.pid not in known and p.status() != psutil.STATUS_ZOMBIE:
                    found.append((p.pid, p.cmdline()))
            except psutil.Error:
                pass
        return found

    install_handlers()
    one_run()
    known = {p.pid for p in psutil.Process().children(recursive=True)}  # the keeper, if any

    def count(frame, event, arg):
        if point(frame, event):
            points[0] += 1

    points = [0]
    sys.setprofile(count)
    one_run()
    sys.setprofile(None)
    total, lost, left = points[0], [], []
    me = os.getpid()
    for k in range(1, total + 1):
        points[0], where = 0, []

        def interrupt(frame, event, arg):
            if point(frame, event):
                points[0] += 1
                if points[0] == k and os.getpid() == me:
                    where.append(f"{event} in {frame.f_code.co_name}:{frame.f_lineno}")
                    os.kill(me, signal.SIGTERM)

        interrupted = False
        try:
            sys.setprofile(interrupt)
            try:
                one_run()
            finally:
                sys.setprofile(None)
        except SignalException:
            interrupted = True
        if where and not interrupted:
            lost.append((k, where[0]))
        for ctx in _orphans.live_contexts():
            ctx.close(signal.SIGKILL, 5)
        found = strays(known)
        settled = time.monotonic() + 2  # (a rank that was exiting by itself)
        while found and time.monotonic() < settled:
            time.sleep(0.01)
            found = strays(known)
        if found:
            left.append((k, where, found))
            for pid, _ in found:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
    print("points", total, "lost", lost, "left", left, flush=True)
"""


@pytest.mark.parametrize("what", ["fork", "forkserver", "exec", "tee", "run"])
def test_a_signal_at_every_point_of_a_run_stops_it_and_leaves_nothing(launcher, tmp_path, what):
    run = launcher(EVERY_POINT_SCRIPT, what, str(tmp_path / "logs"))
    rc, out, err = run.communicate(300)
    assert rc == 0, err[-3000:]
    verdict = out.splitlines()[-1]  # (after the teed workers' lines)
    words = verdict.split()
    assert words[0] == "points" and int(words[1]) > 20, verdict
    assert verdict.split(" lost ", 1)[1] == "[] left []", verdict
    assert "Exception ignored" not in err, err[-3000:]
    assert wait_no_tagged(run.tag, 10) == []


# ---------------------------------------------------------------------------
# 5. Nothing survives the launcher.

def _descendants(pid: int) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


# How the keeper starts: exec'd from torchmp/_keeper (the default where it
# is built), or forked from the launcher (TORCHMP_KEEPER_HELPER="", and where
# the program cannot be run).
KEEPER_STARTS = [pytest.param("default", marks=pytest.mark.skipif(
    _core.PORTABLE_BUILD, reason="the portable build forks its keeper")), "none", "exits", "killed"]


def _helper_env(tmp_path: Path, helper: str) -> dict[str, str]:
    """The launcher's environment for a keeper program that is missing or
    fails: "none" (the launcher forks its keeper), "not-a-program" (the exec
    fails), "exits" (exec'd, exits 1 without forking a keeper), "killed"
    (exec'd, killed by a signal before it says whether it forked one)."""
    if helper == "default":
        return {}
    if helper == "none":
        return {"TORCHMP_KEEPER_HELPER": ""}
    program = tmp_path / "keeper"
    program.write_text({"not-a-program": "not a program\n",
                        "exits": "#!/bin/sh\nexit 1\n",
                        "killed": "#!/bin/sh\nkill -KILL $$\n"}[helper])
    program.chmod(0o755)
    return {"TORCHMP_KEEPER_HELPER": str(program)}


@pytest.mark.parametrize("keeper_start", KEEPER_STARTS)
def test_sigkilled_torchmp_run_leaves_no_process_of_any_rank(launcher, tmp_path, keeper_start):
    body = (f'sleep 300 & "{sys.executable}" -c "import time; time.sleep(300)" & '
            f'echo up >> "{tmp_path}/up"; wait')
    run = launcher("import sys\nfrom torchmp.__main__ import main\nsys.exit(main())",
                   "run", "-n", "2", "--log-dir", str(tmp_path / "logs"), "--", "sh", "-c", body,
                   env=_helper_env(tmp_path, keeper_start))
    try:
        deadline = time.monotonic() + 20
        procs: list[int] = []
        while time.monotonic() < deadline:
            procs = [p for p in _descendants(run.proc.pid) if pid_alive(p)]
            up = (tmp_path / "up").read_text().split() if (tmp_path / "up").exists() else []
            # two shells, each with a sleep and a python
            if len(up) == 2 and sum(1 for p in procs if _name(p) in ("sleep", "python3", "python")) >= 4:
                break
            time.sleep(0.02)
        workers = [p for p in procs if _name(p) in ("sh", "sleep", "python3", "python")
                   or "time.sleep(300)" in _cmdline(p)]
        assert len(workers) >= 6, [(p, _name(p)) for p in procs]
        groups = {p: _pgid(p) for p in workers}
        keepers = [p for p in psutil.pids() if _name(p) == "torchmp-keeper" and _environ_has(p, run)]
        os.kill(run.proc.pid, signal.SIGKILL)
        run.proc.wait(10)
        left = wait_gone(workers, 5.0)
        # What a failure needs to be understood: which groups the keeper left,
        # and whether it was there at all.
        assert left == [], (
            f"alive: {[(p, _name(p), groups[p]) for p in left]}; every worker's group: {groups}; "
            f"keepers before the kill: {keepers}, alive now: {[k for k in keepers if pid_alive(k)]}")
    finally:
        run.stop()


def _pgid(pid: int) -> int:
    try:
        return os.getpgid(pid)
    except OSError:
        return 0


def _environ_has(pid: int, run: Launcher) -> bool:
    """Whether pid carries the test tag of the launcher ``run``."""
    try:
        return psutil.Process(pid).environ().get(TAG_VAR) == run.tag
    except psutil.Error:
        return False


def _name(pid: int) -> str:
    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return ""


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


EXIT_SCRIPT = """
    import os, sys, time
    import torchmp
    from torchmp import DefaultLogsSpecs

    how, marks = sys.argv[1], sys.argv[2]
    body = ('trap \\'echo term >> "%s/term"; kill $child 2>/dev/null; exit 0\\' TERM; '
            'sleep 300 & child=$!; echo $child >> "%s/children"; wait') % (marks, marks)
    ctx = torchmp.start_processes("noclose", "sh", args={0: ("-c", body), 1: ("-c", body)}, envs=None,
                                  logs_specs=DefaultLogsSpecs(log_dir=marks + "/logs"))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if len(open(marks + "/children").read().split()) == 2:
                break
        except FileNotFoundError:
            pass
        time.sleep(0.01)
    print(" ".join(str(p) for p in ctx.pids().values()), flush=True)
    if how == "sys.exit":
        sys.exit(3)
    if how == "raise":
        raise RuntimeError("the launcher script failed")
    # "end": falls off the end with the context open
"""


@pytest.mark.parametrize("how, code", [("end", 0), ("sys.exit", 3), ("raise", 1)])
def test_launcher_exit_without_close_closes_the_normal_way(launcher, tmp_path, how, code):
    run = launcher(EXIT_SCRIPT, how, str(tmp_path))
    rc, out, err = run.communicate(60)
    assert rc == code, err
    leaders = [int(x) for x in out.split()]
    children = [int(x) for x in (tmp_path / "children").read_text().split()]
    # Every rank got the death signal (not a bare SIGKILL) ...
    assert (tmp_path / "term").read_text().split() == ["term", "term"], err
    # ... and nothing of theirs is left.
    assert wait_gone(leaders + children, 1.0) == []


@pytest.mark.parametrize("helper", ["default", "none", "not-a-program", "exits", "killed"])
def test_keeper_is_no_child_of_the_launcher_and_exits_with_it(launcher, tmp_path, helper):
    # Exec'd from torchmp/_keeper by default (where it is built); forked
    # from the launcher without it, or when it cannot be run, or when it
    # ends without starting one.
    env = _helper_env(tmp_path, helper)
    run = launcher("""
        import sys, time
        from torchmp import _core
        _core.backend()
        print(_core.keeper_pid(), flush=True)
        time.sleep(30)
    """, env=env)
    try:
        line = run.proc.stdout.readline()  # type: ignore[union-attr]
        keeper = int(line)
        assert keeper > 0 and pid_alive(keeper)
        assert keeper not in _descendants(run.proc.pid)
        program = Path(_core.__file__).with_name("_keeper")
        if helper == "default" and not _core.PORTABLE_BUILD:
            assert os.readlink(f"/proc/{keeper}/exe") == str(program.resolve())
        else:
            assert os.path.samefile(f"/proc/{keeper}/exe", f"/proc/{run.proc.pid}/exe")
        if not _core.PORTABLE_BUILD:  # naming it takes prctl
            deadline = time.monotonic() + 5  # it names itself just after it starts
            while psutil.Process(keeper).name() != "torchmp-keeper" and time.monotonic() < deadline:
                time.sleep(0.01)
            assert psutil.Process(keeper).name() == "torchmp-keeper"
        os.kill(run.proc.pid, signal.SIGKILL)
        run.proc.wait(10)
        assert wait_gone([keeper], 2.0) == []
    finally:
        run.stop()


def _elf_segment_types(path: Path) -> set[int]:
    """The p_type of every program header of a 64-bit little-endian ELF file."""
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "not a 64-bit little-endian ELF file"
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    return {struct.unpack_from("<I", data, phoff + i * phentsize)[0] for i in range(phnum)}


PT_DYNAMIC, PT_INTERP = 2, 3


@pytest.mark.skipif(not _core.KEEPER_WITHOUT_LIBC,
                    reason="the keeper's program is built with the C library here (not x86-64, or a "
                           "sanitizer or gcov build)")
def test_the_keepers_program_starts_without_a_loader_or_a_c_library(tmp_path):
    # A launcher's first launch waits for this program to start, fork the
    # keeper and exit: dynamically linked, the loader's work (mapping libc,
    # glibc's probing of the CPU's caches) was most of that wait.
    program = Path(_core.__file__).with_name("_keeper")
    types = _elf_segment_types(program)
    assert PT_INTERP not in types and PT_DYNAMIC not in types, types
    # Started by anything but a launcher, it does nothing: 2, and no keeper
    # (fd 3 is no pipe, or fd 4 is not a table).
    table = tmp_path / "table"
    table.write_bytes(bytes(4 * 65536))
    for redirections in ("", f'3</dev/null 4<>"{table}"', f'3<>"{table}" 4<>"{table}"'):
        before = set(psutil.pids())
        rc = subprocess.run(["sh", "-c", f'exec "$0" {redirections}', str(program)], timeout=10).returncode
        assert rc == 2, redirections
        assert not [p for p in set(psutil.pids()) - before if _name(p) == "torchmp-keeper"], redirections


@pytest.mark.skipif(_core.PORTABLE_BUILD, reason="the portable build forks its keeper")
def test_first_command_starts_while_its_keeper_is_still_starting(launcher, tmp_path):
    # The keeper's program is exec'd with the process's first torchmp.run,
    # and the command is spawned without waiting for it to have forked the
    # keeper.  This program will not start the keeper before the command has
    # run: a launcher that waited first would see it give up after 20 s and
    # fork a keeper of its own (whose program is Python's, not
    # torchmp/_keeper).  (A context waits for its keeper before its first
    # rank: see csrc/loop_thread.c.)
    real = Path(_core.__file__).with_name("_keeper").resolve()
    ran = tmp_path / "ran"
    helper = tmp_path / "keeper"
    helper.write_text(f'#!/bin/sh\nfor i in $(seq 2000); do\n  [ -e "{ran}" ] && exec "{real}"\n'
                      f'  sleep 0.01\ndone\nexit 1\n')
    helper.chmod(0o755)
    run = launcher("""
        import os, sys
        import torchmp
        from torchmp import _core
        torchmp.run(["touch", sys.argv[1]]).check_returncode()
        keeper = _core.keeper_pid()
        print(keeper, os.readlink(f"/proc/{keeper}/exe"), flush=True)
    """, str(ran), env={"TORCHMP_KEEPER_HELPER": str(helper)})
    rc, out, err = run.communicate(60)
    assert rc == 0, err
    keeper, program = out.split()
    assert int(keeper) > 0
    assert program == str(real)
    assert wait_gone([int(keeper)], 5.0) == []  # the launcher has exited: so has its keeper



@pytest.mark.skipif(_core.PORTABLE_BUILD, reason="the portable build forks its keeper")
def test_a_contexts_first_rank_starts_once_its_keeper_runs(launcher, tmp_path):
    # Unlike torchmp.run's first command, a context's first rank waits for
    # the keeper (its launcher may only ever poll, and nothing else would
    # learn that the keeper's start failed).  This program takes 0.3 s to
    # start the real keeper and marks when it does: the rank must see the mark.
    real = Path(_core.__file__).with_name("_keeper").resolve()
    mark = tmp_path / "keeper-started"
    helper = tmp_path / "keeper"
    helper.write_text(f'#!/bin/sh\nsleep 0.3\n: > "{mark}"\nexec "{real}"\n')
    helper.chmod(0o755)
    run = launcher("""
        import sys
        import torchmp
        from torchmp import _core
        ctx = torchmp.start_processes("k", "sh", {0: ("-c", f'test -e "{sys.argv[1]}" && echo kept || echo early')},
                                      {0: {}}, torchmp.DefaultLogsSpecs(log_dir=sys.argv[2], redirects=torchmp.Std.OUT))
        result = ctx.wait(30)
        ctx.close()
        print(open(result.stdouts[0]).read().strip(), _core.keeper_pid() > 0, flush=True)
    """, str(mark), str(tmp_path / "logs"), env={"TORCHMP_KEEPER_HELPER": str(helper)})
    rc, out, err = run.communicate(60)
    assert rc == 0, err
    assert out.split() == ["kept", "True"], (out, err)


# ---------------------------------------------------------------------------
# 6. Smaller defects.

NO_GUARD_SCRIPT = """\
import os, sys
import torchmp
from torchmp import DefaultLogsSpecs


def work(path):
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\\n")


# No `if __name__ == "__main__":` guard: a worker that re-imports this
# module must refuse to start a nested job.
ctx = torchmp.start_processes(
    "noguard", work, args={0: (sys.argv[2] + "/ran",), 1: (sys.argv[2] + "/ran",)}, envs=None,
    logs_specs=DefaultLogsSpecs(log_dir=sys.argv[2] + "/logs"), start_method=sys.argv[1])
result = ctx.wait(60)
ctx.close()
for rank, failure in sorted(result.failures.items()):
    print(rank, failure.exitcode, str(failure.message).replace("\\n", " ")[:300])
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_script_without_main_guard_fails_clearly_and_never_nests(tmp_path, method):
    script = tmp_path / "noguard.py"
    script.write_text(NO_GUARD_SCRIPT)
    tag = uuid.uuid4().hex
    env = launcher_env(tag=tag, trailing_pathsep=True)
    try:
        proc = subprocess.run([sys.executable, str(script), method, str(tmp_path)], env=env, cwd="/",
                              capture_output=True, text=True, timeout=120, start_new_session=True)
    finally:
        kill_tagged(tag)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Every rank failed on its own (exit 1) or was stopped by the fail-fast;
    # as torch's function contexts, only the former are failures.
    codes = [line.split()[:2] for line in lines]
    assert [rank for rank, _ in codes] in (["0"], ["1"], ["0", "1"]), proc.stdout + proc.stderr[-2000:]
    assert {code for _, code in codes} == {"1"}, codes
    for line in lines:
        if line.split()[1] == "1":
            assert "finished its bootstrapping phase" in line, line
    assert not (tmp_path / "ran").exists()  # no worker ran the job, nested or not
    assert wait_no_tagged(tag, 5) == []


BIG_RETURN_SCRIPT = """
    import resource, sys
    import torchmp
    from torchmp import DefaultLogsSpecs

    def big(n):
        return b"x" * n

    size = int(sys.argv[2])
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ctx = torchmp.start_processes("big", big, args={0: (size,)}, envs=None,
                                  logs_specs=DefaultLogsSpecs(log_dir=sys.argv[1]), start_method="fork")
    value = ctx.wait(120).return_values[0]
    assert len(value) == size
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print((peak - base) * 1024 / size)
"""


def test_a_big_return_value_costs_the_launcher_at_most_one_copy(launcher, tmp_path):
    size = 256 * 2**20
    run = launcher(BIG_RETURN_SCRIPT, str(tmp_path), str(size))
    rc, out, err = run.communicate(120)
    assert rc == 0, err[-2000:]
    # The value itself plus the captured pickle it is read from; a further
    # copy (the capture copied into a bytes object first) would make it 3.
    assert float(out) < 2.5, out


def test_a_group_refuses_work_in_a_forked_child_however_it_was_forked():
    """A worker group belongs to the process that made it: the core keeps its
    pid current across fork() (an atfork handler, not a getpid() per call),
    so a child forked from the main thread, from another thread or from a
    child refuses to launch through its copy, while the parent still can."""
    import threading

    group = _core.Group(1, None, -1, None, -1)
    r, w = os.pipe()

    def forked_child_reports() -> None:
        pid = os.fork()
        if pid == 0:
            try:
                try:
                    group.spawn([])
                    verdict = b"spawned"
                except RuntimeError:
                    verdict = b"refused"
                if os.environ.get("_TORCHMP_TEST_NESTED") != "1":
                    os.environ["_TORCHMP_TEST_NESTED"] = "1"
                    forked_child_reports()          # the grandchild reports too
                os.write(w, verdict + b"\n")
            finally:
                os._exit(0)
        os.waitpid(pid, 0)

    try:
        forked_child_reports()
        thread = threading.Thread(target=forked_child_reports)
        thread.start()
        thread.join()
        os.close(w)
        w = -1
        with os.fdopen(r, "rb") as f:
            verdicts = f.read().split()
        assert verdicts == [b"refused"] * 4, verdicts
        group.spawn([])                              # the parent's own still works
    finally:
        if w != -1:
            os.close(w)
        group.release()
