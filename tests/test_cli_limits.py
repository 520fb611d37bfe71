"""``torchmp run``'s time limit and exit policies.

* ``--time-limit SECONDS``: at the limit a hang report is written first (on
  stderr and in the run's directory), then the normal shutdown (SIGTERM,
  ``--shutdown-timeout``, SIGKILL); exit status 124, the summary says
  "time limit".
* ``--signal SIG@SECONDS``: SIG to every running rank's process group that
  many seconds before the limit (srun's spelling), so a rank can checkpoint.

Real ranks (Python scripts that trap signals and print what they got, and
sleeping shells); launchers in sessions of their own, cleaned up by tag and
process group (helpers.Launchers).
"""
from __future__ import annotations

import re
import sys
import textwrap
import time
from pathlib import Path

import pytest

from helpers import Launcher, Launchers, wait_no_tagged

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
    signal.signal(signal.SIGUSR1, on)
    signal.signal(signal.SIGTERM, on)
    print("ready", flush=True)
    if sys.argv[1] == "fail" and rank == "1":
        sys.exit(3)
    time.sleep(60)
""")


@pytest.fixture
def run(tmp_path):
    """Start ``python -m torchmp run -n 2 OPTIONS -- python rank.py MODE`` in
    tmp_path, its output followed; stopped at the end of the test."""
    (tmp_path / "rank.py").write_text(RANK)
    with Launchers(follow=True) as launchers:
        def start(*options: str, mode: str = "stay") -> Launcher:
            return launchers.start(
                [sys.executable, "-m", "torchmp", "run", "-n", "2", "--log-dir", str(tmp_path / "logs"),
                 *options, "--", sys.executable, "rank.py", mode],
                cwd=tmp_path, unset=UNSET, env={"PATH": "/usr/bin:/bin"})  # no py-spy: quick reports
        yield start


def logs(tmp_path: Path, rank: int) -> str:
    [path] = (tmp_path / "logs").glob(f"rank_*/attempt_0/{rank}/stdout.log")
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
    started = time.monotonic()
    la = run("--time-limit", "30", "--signal", "USR1@28.5", mode="exit")
    assert la.finish(60) == 0
    assert time.monotonic() - started >= 1.5
    assert "torchmp: 28.5s before the time limit: sent SIGUSR1 to rank 0, 1" in la.err
    for rank in (0, 1):
        assert logs(tmp_path, rank) == f"ready\nrank {rank} got SIGUSR1\n"
    assert not any("hang report" in line for line in la.err)
    assert wait_no_tagged(la.tag) == []


def test_signal_then_time_limit(run, tmp_path):
    # The ranks note the warning and go on; the limit stops them.
    la = run("--time-limit", "2.5", "--signal", "USR1@1.5", "--shutdown-timeout", "20")
    assert la.finish(60) == 124
    warned = index(la.err, r"^torchmp: 1\.5s before the time limit: sent SIGUSR1 to rank 0, 1$")
    assert warned < index(la.err, r"hang report 1 of rank \(time limit of 2\.5s\)")
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
