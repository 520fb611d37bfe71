"""Nothing escapes: processes that leave their rank's process group.

A rank's descendant that calls ``setsid`` (or double-forks into a session of
its own) is out of reach of the signals sent to the rank's group.  ``torchmp
run`` is a child subreaper, so such a process is re-parented to it when its
parent exits; it is then found, stopped after the ranks (SIGTERM, the
grace, SIGKILL) and reaped, and the summary says how many there were.  The
library does the same with ``start_processes(..., subreaper=True)``, for the
processes that carry the context's id (never the process's own children).

The escapees write their pids to a file; the test checks they are gone.
Library runs happen in a launcher program of their own: a subreaper is a
process-wide setting, not one to leave in the test process.
"""
from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from helpers import (Launcher, Launchers, can_unshare_pid, kill_groups, launcher_env, read_pids, run_launcher,
                     wait_gone, wait_no_tagged)
from torchmp import _core

# The portable build has no child subreaper (docs/packaging.md): only the
# last test, which checks what it does instead, runs there.
needs_subreaper = pytest.mark.skipif(_core.PORTABLE_BUILD,
                                     reason="a build without the child subreaper (TORCHMP_PORTABLE)")

UNSET = ("TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCHMP_FORWARD_SIGNALS", "TORCHMP_HANG_REPORT_SIGNAL")

# A rank whose child leaves the group for a session of its own and becomes
# a sleep ("$2": what it does on SIGTERM: "die" or "ignore", which exec
# keeps), then exits ("$1": its exit code) without waiting for it -- once
# both ranks' escapees exist, so that a failing rank 0 cannot stop rank 1
# before its escapee is born (seen under ASan).
RANK = r"""
setsid sh -c 'echo $$ >> "$0"; if [ "$1" = ignore ]; then trap "" TERM; fi; exec sleep 97' "$PWD/pids" "$2" &
while [ "$(wc -l < "$PWD/pids" 2>/dev/null || echo 0)" -lt 2 ]; do sleep 0.01; done
[ "$LOCAL_RANK" = 0 ] || sleep 0.3
exit "$1"
"""


@pytest.fixture
def run(tmp_path):
    with Launchers(follow=True) as launchers:
        def start(*options: str, code: str = "0", on_term: str = "die") -> Launcher:
            return launchers.start(
                [sys.executable, "-m", "torchmp", "run", "-n", "2", "--log-dir", str(tmp_path / "logs"),
                 *options, "--", "/bin/sh", "-c", RANK, "sh", code, on_term],
                cwd=tmp_path, unset=UNSET)
        yield start


def escapees(tmp_path: Path) -> list[int]:
    return read_pids(tmp_path / "pids", 2)


def written(tmp_path: Path) -> list[int]:
    """Every escapee pid written so far (cleanup)."""
    path = tmp_path / "pids"
    return [int(x) for x in path.read_text().split()] if path.exists() else []


@needs_subreaper
def test_setsid_children_are_stopped_after_a_clean_run(run, tmp_path):
    la = run()
    try:
        assert la.finish(60) == 0
        pids = escapees(tmp_path)
        assert wait_gone(pids, 5) == []
        assert la.err[-1] == ("torchmp: 2 processes had left their rank's process group (setsid, a double "
                              "fork): stopped after the ranks")
        assert any(line.startswith("torchmp: summary of sh: 2/2 ranks succeeded, exit code 0, ") for line in la.err)
    finally:
        kill_groups(written(tmp_path))
    assert wait_no_tagged(la.tag) == []


@needs_subreaper
def test_an_escapee_that_ignores_sigterm_gets_sigkill_after_the_grace(run, tmp_path):
    started = time.monotonic()
    la = run("--shutdown-timeout", "1", on_term="ignore")
    try:
        assert la.finish(60) == 0
        assert 1 <= time.monotonic() - started < 20
        assert wait_gone(escapees(tmp_path), 5) == []
        assert la.err[-1].startswith("torchmp: 2 processes had left their rank's process group")
    finally:
        kill_groups(written(tmp_path))


@needs_subreaper
def test_escapees_are_stopped_after_a_failure_too(run, tmp_path):
    la = run(code="3")
    try:
        assert la.finish(60) == 3
        assert wait_gone(escapees(tmp_path), 5) == []
        assert la.err[-1].startswith("torchmp: 2 processes had left their rank's process group")
    finally:
        kill_groups(written(tmp_path))


# torchmp run with its last escapee sweep (the one on its way out, grace 0)
# hooked: SIGTERM comes again as that sweep makes its first system call.
LAST_SWEEP = r"""
import os, signal, sys
from torchmp import _escapees
from torchmp.cli import main

sweep = _escapees.stop.__code__
armed = []


def in_the_last_sweep(frame, event, arg):
    if frame.f_code is sweep:
        if event == "call" and frame.f_locals.get("grace") == 0:
            armed.append(True)
        elif event == "c_return" and armed:
            sys.setprofile(None)
            os.kill(os.getpid(), signal.SIGTERM)


sys.setprofile(in_the_last_sweep)
sys.exit(main(sys.argv[1:]))
"""

# A rank whose child leaves for a session of its own, the rank staying.
STAYING_RANK = r"""
setsid sh -c 'echo $$ >> "$0"; exec sleep 97' "$PWD/pids" &
exec sleep 60
"""


@needs_subreaper
def test_a_second_sigterm_during_the_last_sweep_does_not_cut_it_short(tmp_path):
    # The first SIGTERM stops the job; shutting down, torchmp run sweeps the
    # escapees once, on its way out.  A second SIGTERM there used to cut the
    # sweep short (the escapees outlived the job) and leave main() as a
    # traceback, exit 1.
    (tmp_path / "hooked.py").write_text(LAST_SWEEP)
    with Launchers(follow=True) as launchers:
        la = launchers.start([sys.executable, "hooked.py", "-n", "2", "--log-dir", str(tmp_path / "logs"), "--",
                              "/bin/sh", "-c", STAYING_RANK], cwd=tmp_path, unset=UNSET)
        try:
            pids = escapees(tmp_path)
            la.proc.send_signal(signal.SIGTERM)
            code = la.finish(60)
            output = "\n".join(la.err)
            assert code == 128 + signal.SIGTERM, output
            assert not any("Traceback" in line for line in la.err), output
            assert wait_gone(pids, 5) == []
        finally:
            kill_groups(written(tmp_path))
    assert wait_no_tagged(la.tag) == []


LIBRARY = """
import os, subprocess, sys, time
import torchmp
from torchmp import DefaultLogsSpecs
out = os.getcwd()
# The process's own child in a session of its own: never taken for an escapee.
own = subprocess.Popen(["sleep", "60"], start_new_session=True)
ctx = torchmp.start_processes(
    "esc", "/bin/sh", {r: ("-c", RANK, "sh", "0", "die") for r in range(2)},
    {r: {"LOCAL_RANK": str(r)} for r in range(2)},
    DefaultLogsSpecs(log_dir=os.path.join(out, "logs")), subreaper=True)
result = ctx.wait(30)
ctx.close()
alive = own.poll() is None
own.kill(); own.wait()
print(result.failures, ctx.escaped, alive, flush=True)
"""


@needs_subreaper
def test_library_subreaper_stops_the_contexts_escapees_only(tmp_path):
    script = f"RANK = {RANK!r}\n" + LIBRARY
    done = run_launcher(f"import os; os.chdir({str(tmp_path)!r})\n" + script, timeout=60)
    try:
        assert done.returncode == 0, done.stderr
        assert done.stdout.decode().splitlines() == ["{} 2 True"]
        assert wait_gone(escapees(tmp_path), 5) == []
    finally:
        kill_groups(written(tmp_path))


@needs_subreaper
def test_library_subreaper_must_be_a_bool(tmp_path):
    import torchmp
    from torchmp import DefaultLogsSpecs

    with pytest.raises(TypeError, match="subreaper must be True or False, got 1"):
        torchmp.start_processes("x", "/bin/true", {0: ()}, {0: {}},
                                DefaultLogsSpecs(log_dir=str(tmp_path / "logs")), subreaper=1)
    assert list((tmp_path / "logs").iterdir()) == []
    assert not torchmp._core.is_child_subreaper()  # checked before anything was set


def _is_zombie(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # reaped since it was listed: not a zombie
        return False


@needs_subreaper
def test_reparented_processes_that_exit_during_the_run_are_reaped_meanwhile(tmp_path):
    # Each rank leaves three short-lived orphans (their shell exits first),
    # then runs on: they must not pile up as zombies of torchmp run.
    rank = "for i in 1 2 3; do sh -c 'sleep 0.1 &'; done; echo ready; sleep 8"
    with Launchers(follow=True) as launchers:
        la = launchers.start([sys.executable, "-m", "torchmp", "run", "-n", "2", "--log-dir", str(tmp_path / "logs"),
                              "--", "/bin/sh", "-c", rank], cwd=tmp_path, unset=UNSET)
        la.wait_for(lambda: sum(line.endswith("]:ready") for line in la.out) == 2, 30, "2 ready lines")
        launcher = psutil.Process(la.proc.pid)
        deadline = time.monotonic() + 7
        zombies = None
        while time.monotonic() < deadline:
            zombies = [p.pid for p in launcher.children() if _is_zombie(p)]
            if not zombies and time.monotonic() > deadline - 6:  # reaped (after at most one sweep)
                break
            time.sleep(0.1)
        assert zombies == [], "re-parented processes left as zombies of torchmp run"
        assert la.finish(60) == 0
        # They stayed in their rank's groups: not counted as escapees.
        assert not any("had left their rank's process group" in line for line in la.err)


@pytest.mark.skipif(not _core.PORTABLE_BUILD, reason="the Linux build has the child subreaper")
def test_a_build_without_the_subreaper_says_so_only_when_asked(tmp_path):
    # torchmp run goes on silently (the docs say what it cannot catch);
    # the library's explicit opt-in is refused before anything starts.
    with Launcher([sys.executable, "-m", "torchmp", "run", "-n", "1", "--log-dir", str(tmp_path / "logs"),
                   "--", "sh", "-c", "echo ran"], unset=UNSET) as launcher:
        code, out, err = launcher.communicate(60)
    assert code == 0, err
    assert out == "[sh0]:ran\n"
    assert "subreaper" not in err and "cannot catch" not in err, err
    result = run_launcher(f"""
        import errno, torchmp
        try:
            torchmp.start_processes("w", "sh", {{0: ("-c", "echo started > {tmp_path}/started")}}, {{0: {{}}}},
                                    torchmp.DefaultLogsSpecs(log_dir="{tmp_path}/lib"), subreaper=True)
        except OSError as e:
            print("refused", errno.errorcode[e.errno])
    """)
    assert result.stdout == b"refused ENOSYS\n", result
    assert not (tmp_path / "started").exists()
    assert not (tmp_path / "lib").exists() or not any((tmp_path / "lib").iterdir())


# Rank 0 exits at once (reaped at its exit, its pid free); then, once told,
# rank 1 forks a child that leaves its group, and exits: the child is
# re-parented to the launcher, the subreaper.  The launcher sets the
# namespace's next pid to rank 0's first, so the escapee gets that pid.
FREED_PID = """
import os, sys, time
import torchmp
from torchmp import DefaultLogsSpecs
d = sys.argv[1]
RANK1 = '''
import os, sys, time
d = sys.argv[1]
while not os.path.exists(d + "/go"):
    time.sleep(0.005)
if os.fork() == 0:
    os.setsid()
    with open(d + "/escapee.tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(d + "/escapee.tmp", d + "/escapee")
    time.sleep(60)
    os._exit(0)
while not os.path.exists(d + "/escapee"):
    time.sleep(0.005)
'''
ctx = torchmp.start_processes("esc", sys.executable, {0: ("-c", "pass"), 1: ("-c", RANK1, d)}, None,
                              DefaultLogsSpecs(log_dir=d + "/logs"), subreaper=True)
freed = ctx.pids()[0]
deadline = time.monotonic() + 10
while os.path.exists(f"/proc/{freed}") and time.monotonic() < deadline:
    time.sleep(0.005)
reaped_early = not os.path.exists(f"/proc/{freed}")
with open("/proc/sys/kernel/ns_last_pid", "w") as f:
    f.write(str(freed - 1))
open(d + "/go", "w").close()
result = ctx.wait(30)
with open(d + "/escapee") as f:
    escapee = int(f.read())
alive = os.path.exists(f"/proc/{escapee}")
print(freed, escapee, int(reaped_early), ctx.escaped, int(alive), result.failures, flush=True)
"""


@needs_subreaper
def test_an_escapee_on_the_freed_pid_of_a_rank_reaped_at_its_exit_is_stopped(tmp_path):
    # The sweep used to skip every rank's pid as torchmp's own; once a rank
    # is reaped at its exit, that pid may be an escapee's (here it is, in a
    # private pid namespace, which also takes every process with it when
    # the launcher ends).
    if not can_unshare_pid():
        pytest.skip("no private pid namespace here (unshare --pid, ns_last_pid)")
    # (cwd "/": `python -c` must not pick up an unbuilt source tree from the cwd.)
    done = subprocess.run([shutil.which("unshare"), "--pid", "--fork", "--mount-proc", sys.executable, "-c",
                           FREED_PID, str(tmp_path)], capture_output=True, timeout=60, start_new_session=True,
                          cwd="/", env=launcher_env())
    assert done.returncode == 0, done.stderr
    freed, escapee, reaped_early, escaped, alive, failures = done.stdout.decode().split(maxsplit=5)
    assert reaped_early == "1", "rank 0 was not reaped at its exit"
    assert escapee == freed, "the setup did not put the escapee on the freed pid"
    assert alive == "0", "close() left the escapee on a freed rank pid running"
    assert escaped == "1"
    assert failures.strip() == "{}"
