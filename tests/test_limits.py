"""Time limits and exit policies: ``torchmp run`` and the library.

* ``--time-limit SECONDS``: at the limit a hang report is written first (on
  stderr and in the run's directory), then the normal shutdown (SIGTERM,
  ``--shutdown-timeout``, SIGKILL); exit status 124, the summary says
  "time limit".
* ``--signal SIG@SECONDS``: SIG to every running rank's process group that
  many seconds before the limit (srun's spelling), so a rank can checkpoint.
* ``--wait SECONDS``: once a rank exited 0, the others get that long, then
  the normal shutdown.
* ``--max-restarts N``: a failed attempt is reported and the whole group
  started again, each attempt in its own ``attempt_K`` with
  ``TORCHELASTIC_RESTART_COUNT=K``; the exit status is the last attempt's.
* ``--kill-on-bad-exit 0`` (``start_processes(kill_on_bad_exit=False)``): a
  failing rank leaves the others running; every failure is reported, the
  first by time as the root cause.

Real ranks (Python scripts that trap signals and print what they got, and
sleeping shells); launchers in sessions of their own, cleaned up by tag and
process group (helpers.Launchers).
"""
from __future__ import annotations

import re
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from helpers import Launcher, Launchers, launch, wait_no_tagged

UNSET = ("TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCHMP_FORWARD_SIGNALS", "TORCHMP_HANG_REPORT_SIGNAL")

# Traps SIGUSR1 (prints it; "exit": then finishes) and SIGTERM (prints it,
# exits 0); otherwise sleeps, or with "fail" exits 3 at once.
RANK = textwrap.dedent("""\
    import os, signal, sys, time
    rank = os.environ["RANK"]
    def on(sig, _):
        print(f"rank {rank} got {signal.Signals(sig).name}", flush=True)
        if sig == signal.SIGTERM or sys.argv[1] == "exit":
            sys.exit(0)
    # Held until "ready" is whole: a timed signal landing inside that print
    # ran the handler there, and its line tore "ready" ("readyrank 1 got ...").
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGTERM})
    signal.signal(signal.SIGUSR1, on)
    signal.signal(signal.SIGTERM, on)
    print("ready", flush=True)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1, signal.SIGTERM})
    if sys.argv[1] == "fail" and rank == "1":
        sys.exit(3)
    for _ in range(1200):  # short sleeps: see test_cli_signals.RANK
        time.sleep(0.05)
""")


@pytest.fixture
def run(tmp_path):
    """Start ``python -m torchmp run -n 2 OPTIONS -- python rank.py MODE`` in
    tmp_path, its output followed; stopped at the end of the test."""
    (tmp_path / "rank.py").write_text(RANK)
    with Launchers(follow=True) as launchers:
        def start(*options: str, mode: str = "stay", command: tuple[str, ...] = (), n: int = 2) -> Launcher:
            return launchers.start(
                [sys.executable, "-m", "torchmp", "run", "-n", str(n), "--log-dir", str(tmp_path / "logs"),
                 *options, "--", *(command or (sys.executable, "rank.py", mode))],
                cwd=tmp_path, unset=UNSET, env={"PATH": "/usr/bin:/bin"})  # no py-spy: quick reports
        yield start


def logs(tmp_path: Path, rank: int) -> str:
    [path] = (tmp_path / "logs").glob(f"*/attempt_0/{rank}/stdout.log")
    return path.read_text()


def index(lines: list[str], pattern: str) -> int:
    return next(i for i, line in enumerate(lines) if re.search(pattern, line))


def test_time_limit_reports_then_shuts_down_and_exits_124(run, tmp_path):
    started = time.monotonic()
    la = run("--time-limit", "2", "--shutdown-timeout", "20")
    code = la.finish(60)
    assert code == 124
    assert time.monotonic() - started >= 2
    err = la.err
    report = index(err, r"^torchmp: hang report 1 of rank \(time limit of 2s\), \d+\.\ds after start, ")
    saved = index(err, r"^torchmp: hang report 1 saved in ")
    terms = [i for i, line in enumerate(err) if "closing signal SIGTERM" in line]
    assert len(terms) == 2 and report < saved < min(terms)  # the evidence first, then the shutdown
    assert "torchmp: time limit of 2s reached: terminated the workers" in err
    title = next(line for line in err if line.startswith("torchmp: summary of rank: "))
    assert title.startswith("torchmp: summary of rank: 0/2 ranks succeeded, exit code 124 (time limit), ")
    assert not any("root cause" in line for line in err)
    assert not any("FAILED" in line for line in err)
    path = Path(err[saved].split(" saved in ", 1)[1])
    assert path.name == "hang-report-1.txt"
    assert path.read_text().startswith("torchmp: hang report 1 of rank (time limit of 2s)")
    for rank in (0, 1):  # SIGTERM, and the ranks' handlers ran: not SIGKILL
        assert logs(tmp_path, rank) == f"ready\nrank {rank} got SIGTERM\n"
    assert wait_no_tagged(la.tag) == []


def test_a_job_within_its_time_limit_ends_as_usual(run, tmp_path):
    la = run("--time-limit", "30", mode="fail")
    assert la.finish(60) == 3  # the root cause's, not 124
    assert not any("hang report" in line or "time limit" in line for line in la.err)
    assert wait_no_tagged(la.tag) == []


def test_signal_before_the_time_limit(run, tmp_path):
    # The warning comes 3 s after the start, as in test_signal_then_time_limit:
    # under the sanitizers a rank once took about 1.5 s to print "ready".
    started = time.monotonic()
    la = run("--time-limit", "30", "--signal", "USR1@27", mode="exit")
    assert la.finish(60) == 0
    assert time.monotonic() - started >= 3
    assert "torchmp: 27s before the time limit: sent SIGUSR1 to rank 0, 1" in la.err
    for rank in (0, 1):
        assert logs(tmp_path, rank) == f"ready\nrank {rank} got SIGUSR1\n"
    assert not any("hang report" in line for line in la.err)
    assert wait_no_tagged(la.tag) == []


def test_signal_then_time_limit(run, tmp_path):
    # The ranks note the warning and go on; the limit stops them.  The
    # warning comes 3 s after the start: a rank's Python must have its
    # handler by then, and under the sanitizers (libasan preloaded into every
    # child) on a loaded machine it once took over 1 s (exit 138: SIGUSR1).
    la = run("--time-limit", "5.5", "--signal", "USR1@2.5", "--shutdown-timeout", "20")
    assert la.finish(60) == 124
    warned = index(la.err, r"^torchmp: 2\.5s before the time limit: sent SIGUSR1 to rank 0, 1$")
    assert warned < index(la.err, r"hang report 1 of rank \(time limit of 5\.5s\)")
    for rank in (0, 1):
        assert logs(tmp_path, rank) == f"ready\nrank {rank} got SIGUSR1\nrank {rank} got SIGTERM\n"
    assert wait_no_tagged(la.tag) == []


@pytest.mark.parametrize("options, message", [
    (("--signal", "USR1@5"), "--signal needs --time-limit"),
    (("--time-limit", "3", "--signal", "USR1@5"), "--signal: 5s before the time limit must be in 0..3s"),
    (("--time-limit", "3", "--signal", "USR1"), "--signal: 60s before the time limit must be in 0..3s"),
    (("--time-limit", "3", "--signal", "USR1@soon"), "--signal: 'soon' is not a number of seconds"),
    (("--time-limit", "3", "--signal", "BOGUS@1"), "--signal: unknown signal 'BOGUS'"),
    (("--time-limit", "0"), "--time-limit must be > 0 seconds, got 0.0"),
    (("--time-limit", "inf"), "--time-limit must be > 0 seconds, got inf"),
])
def test_bad_limits_are_usage_errors(run, tmp_path, options, message):
    la = run(*options)
    assert la.finish() == 2
    assert any(message in line for line in la.err), la.err
    assert not (tmp_path / "logs").exists()


# ---------------------------------------------------------------------------
# --wait and --kill-on-bad-exit

# Rank r of "sh -c RANKS_SH sh SPEC...": sleeps, then exits, as its word of
# SPEC says ("0.2:0" sleep 0.2 s then exit 0; "hang": sleep 60).
RANKS_SH = ('eval "w=\\${$((LOCAL_RANK + 1))}"; '
            'if [ "$w" = hang ]; then exec sleep 60; fi; '
            'sleep "${w%:*}"; echo "rank $LOCAL_RANK done"; exit "${w#*:}"')


def sh_ranks(*spec: str) -> tuple[str, ...]:
    return ("/bin/sh", "-c", RANKS_SH, "sh", *spec)


def test_wait_gives_the_rest_that_long_then_stops_them(run, tmp_path):
    started = time.monotonic()
    la = run("--wait", "1.5", "--shutdown-timeout", "20", command=sh_ranks("0:0", "hang", "hang"), n=3)
    assert la.finish(60) == 128 + 15  # the stopped ranks' SIGTERM
    elapsed = time.monotonic() - started
    assert 1.5 <= elapsed < 30
    err = la.err
    stop = index(err, r"^torchmp: --wait 1\.5s after the first rank's exit is over: stopping the ranks still running$")
    assert stop < min(i for i, line in enumerate(err) if "closing signal SIGTERM" in line)
    assert sum("closing signal SIGTERM" in line for line in err) == 2
    title = next(line for line in err if line.startswith("torchmp: summary of sh: "))
    assert title.startswith("torchmp: summary of sh: 1/3 ranks succeeded, exit code 143 (--wait), ")
    assert not any("FAILED" in line or "root cause" in line for line in err)
    assert logs(tmp_path, 0) == "rank 0 done\n"
    assert wait_no_tagged(la.tag) == []


def test_wait_is_not_needed_when_the_rest_finish_in_time(run, tmp_path):
    started = time.monotonic()
    la = run("--wait", "30", command=sh_ranks("0:0", "0.5:0"))
    assert la.finish(60) == 0
    assert time.monotonic() - started < 25
    assert not any("--wait" in line for line in la.err)


def test_wait_starts_only_with_a_successful_exit(run, tmp_path):
    # A failure is still fail-fast (the default --kill-on-bad-exit 1).
    la = run("--wait", "30", "--shutdown-timeout", "20", command=sh_ranks("0:3", "hang"))
    assert la.finish(60) == 3
    assert not any("--wait" in line for line in la.err)
    assert wait_no_tagged(la.tag) == []


def test_kill_on_bad_exit_0_lets_every_rank_finish(run, tmp_path):
    la = run("--kill-on-bad-exit", "0", command=sh_ranks("0:3", "0.6:5", "1.2:0"), n=3)
    assert la.finish(60) == 3  # the first failure by time is the root cause
    err = la.err
    assert not any("closing signal" in line for line in err)
    for rank in range(3):
        assert logs(tmp_path, rank) == f"rank {rank} done\n"
    failures = err.index("Failures:")
    root = err.index("Root Cause (first observed failure):")
    assert any("rank      : 1 (local_rank: 1)" in line for line in err[failures:root])
    assert any("rank      : 0 (local_rank: 0)" in line for line in err[root:])
    assert any("exitcode  : 5 " in line for line in err[failures:root])
    title = next(line for line in err if line.startswith("torchmp: summary of sh: "))
    assert title.startswith("torchmp: summary of sh: 1/3 ranks succeeded, exit code 3, ")
    assert not any("terminated by torchmp" in line for line in err)


def test_bad_exit_policy_options(run, tmp_path):
    for options, message in ((("--kill-on-bad-exit", "2"), "--kill-on-bad-exit: invalid choice: 2"),
                             (("--wait", "-1"), "--wait must be >= 0 seconds, got -1.0"),
                             (("--max-restarts", "-1"), "--max-restarts must be >= 0, got -1")):
        la = run(*options)
        assert la.finish() == 2
        assert any(message in line for line in la.err), la.err
        assert not (tmp_path / "logs").exists()


def test_library_kill_on_bad_exit_false(tmp_path):
    ctx = launch("/bin/sh", {0: ("-c", "exit 3"), 1: ("-c", "sleep 0.6; echo done; exit 0"),
                             2: ("-c", "sleep 0.3; exit 4")},
                 log_dir=tmp_path / "logs", kill_on_bad_exit=False)
    try:
        result = ctx.wait(30)
        assert result is not None
        assert sorted(result.failures) == [0, 2]
        assert result.failures[0].exitcode == 3 and result.failures[2].exitcode == 4
        assert not any(f.terminated_by_launcher for f in result.failures.values())
        assert result.resources[1].exitcode == 0 and result.resources[1].wall_time >= 0.6
    finally:
        ctx.close(signal.SIGKILL, 0)


def test_library_kill_on_bad_exit_checked_before_anything_starts(tmp_path):
    with pytest.raises(TypeError, match="kill_on_bad_exit must be True or False, got 0"):
        launch("/bin/sh", {0: ("-c", "exit 0")}, log_dir=tmp_path / "logs", kill_on_bad_exit=0)
    assert list((tmp_path / "logs").iterdir()) == []  # (DefaultLogsSpecs made it) no run directory


# ---------------------------------------------------------------------------
# --max-restarts

# Rank 1 fails its first $0 attempts, once rank 0 has said its line (in the
# working directory, tmp_path, a file per attempt says so): on a loaded
# machine the fail-fast SIGTERM could otherwise reach rank 0 before its echo.
FAIL_ONCE = (
    'echo "rank $RANK attempt $TORCHELASTIC_RESTART_COUNT of $TORCHELASTIC_MAX_RESTARTS"; '
    'said="said.$TORCHELASTIC_RESTART_COUNT"; '
    'if [ "$RANK" = 0 ]; then : > "$said"; fi; '
    'if [ "$RANK" = 1 ] && [ "$TORCHELASTIC_RESTART_COUNT" -lt "$0" ]; then '
    'i=0; while [ ! -e "$said" ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i + 1)); done; exit 3; fi; '
    'sleep 0.3')


def attempts(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "logs").glob("*/attempt_*"))


def attempt_log(tmp_path: Path, attempt: int, rank: int) -> str:
    [path] = (tmp_path / "logs").glob(f"*/attempt_{attempt}/{rank}/stdout.log")
    return path.read_text()


def test_a_rank_that_fails_once_then_succeeds(run, tmp_path):
    la = run("--max-restarts", "2", command=("/bin/sh", "-c", FAIL_ONCE, "1"))
    assert la.finish(60) == 0
    assert attempts(tmp_path) == ["attempt_0", "attempt_1"]
    for rank in (0, 1):
        assert attempt_log(tmp_path, 0, rank) == f"rank {rank} attempt 0 of 2\n"
        assert attempt_log(tmp_path, 1, rank) == f"rank {rank} attempt 1 of 2\n"
    err = la.err
    first = index(err, r"^torchmp: summary of sh, attempt 0: 0/2 ranks succeeded, exit code 3, ")
    assert index(err, r"^sh FAILED$") < first < index(err, r"^torchmp: restarting sh \(restart 1 of 2\)$")
    assert index(err, r"^torchmp: restarting sh") < index(err, r"^torchmp: log directory: .*/attempt_1$")
    assert err[-4].startswith("torchmp: summary of sh, attempt 1: 2/2 ranks succeeded, exit code 0, ")
    assert sum(line == "sh FAILED" for line in err) == 1
    assert wait_no_tagged(la.tag) == []


def test_restarts_run_out(run, tmp_path):
    la = run("--max-restarts", "2", command=("/bin/sh", "-c", FAIL_ONCE, "99"))
    assert la.finish(60) == 3  # the last attempt's
    assert attempts(tmp_path) == ["attempt_0", "attempt_1", "attempt_2"]
    assert sum(line == "sh FAILED" for line in la.err) == 3  # one report per failed attempt
    assert [line for line in la.err if line.startswith("torchmp: restarting")] == [
        "torchmp: restarting sh (restart 1 of 2)", "torchmp: restarting sh (restart 2 of 2)"]
    assert attempt_log(tmp_path, 2, 1) == "rank 1 attempt 2 of 2\n"


def test_no_restart_after_a_signal(run, tmp_path):
    la = run("--max-restarts", "3", command=("/bin/sh", "-c", "echo ready; exec sleep 60"))
    la.wait_for(lambda: sum(line.endswith("]:ready") for line in la.out) == 2, 30, "2 ready lines")
    la.proc.send_signal(signal.SIGTERM)
    code = la.finish(60)
    output = "stderr:\n" + "\n".join(la.err) + "\nstdout:\n" + "\n".join(la.out)
    assert code == 128 + signal.SIGTERM, output
    assert attempts(tmp_path) == ["attempt_0"], output
    assert not any("restarting" in line for line in la.err), output
    assert wait_no_tagged(la.tag) == []
