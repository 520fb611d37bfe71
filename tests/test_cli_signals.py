"""``torchmp run`` and the signals a scheduler sends it.

* SIGUSR1 (``--forward-signals``, ``$TORCHMP_FORWARD_SIGNALS``) is passed on
  to every running rank's process group and the job goes on: ranks that
  trap it print it and finish; ranks that do not die of it, and that is
  their failure as usual.
* The hang report's signal is a setting (``--hang-report-signal``), so
  SIGUSR2 can be forwarded instead.
* Any other signal that would kill the launcher (SIGUSR1 when not
  forwarded, SIGALRM, a real-time signal, a SIGSEGV sent with kill) stops the
  ranks the normal way -- SIGTERM, the grace, SIGKILL -- and the report and
  summary are printed before it exits 128 + N.
* Conflicting or unknown signals are bad usage, before anything starts.

Launchers run from a temporary directory in sessions of their own; cleanup
is by tag and process group (helpers.Launchers).
"""
from __future__ import annotations

import signal
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import Launcher, Launchers, wait_no_tagged

UNSET = ("TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCHMP_FORWARD_SIGNALS", "TORCHMP_HANG_REPORT_SIGNAL")

# A rank that traps SIGUSR1 and SIGUSR2 (prints which, then finishes) and
# SIGTERM (prints it, exits 0); "plain" traps nothing.
RANK = textwrap.dedent("""\
    import os, signal, sys, time
    rank = os.environ["RANK"]
    def on(sig, _):
        print(f"rank {rank} got {signal.Signals(sig).name}", flush=True)
        sys.exit(0)
    if sys.argv[1] == "trap":
        for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM):
            signal.signal(sig, on)
    print("ready", flush=True)
    # Short sleeps, not one long one: a signal that lands after the
    # interpreter's last look for one and before the sleep's system call
    # (the rank preempted just there) has its handler run when the sleep
    # ends -- after one of 60 s, the launcher's SIGKILL.
    for _ in range(1200):
        time.sleep(0.05)
    sys.exit(5)
""")


@pytest.fixture
def run(tmp_path):
    """Start ``python -m torchmp run -n 2 OPTIONS -- python rank.py MODE``
    in tmp_path, with its output followed; stopped at the end of the test."""
    (tmp_path / "rank.py").write_text(RANK)
    with Launchers(follow=True) as launchers:
        def start(*options: str, mode: str = "trap", env: dict[str, str] | None = None) -> Launcher:
            return launchers.start(
                [sys.executable, "-m", "torchmp", "run", "-n", "2", "--log-dir", str(tmp_path / "logs"),
                 *options, "--", sys.executable, "rank.py", mode],
                cwd=tmp_path, env=env, unset=UNSET)
        yield start


def ready(la: Launcher) -> None:
    la.wait_for(lambda: sum(line.endswith("]:ready") for line in la.out) == 2, 30, "2 ready lines")


def logs(tmp_path: Path, rank: int) -> str:
    [path] = (tmp_path / "logs").glob(f"rank_*/attempt_0/{rank}/stdout.log")
    return path.read_text()


def summary(la: Launcher) -> str:
    return next(line for line in la.err if line.startswith("torchmp: summary of rank: "))


def test_usr1_is_passed_on_and_the_job_goes_on(run, tmp_path):
    la = run()
    ready(la)
    la.proc.send_signal(signal.SIGUSR1)
    assert la.finish() == 0
    assert "torchmp: got SIGUSR1: passed it on to rank 0, 1" in la.err
    assert summary(la).startswith("torchmp: summary of rank: 2/2 ranks succeeded, exit code 0, ")
    for rank in (0, 1):
        assert logs(tmp_path, rank) == f"ready\nrank {rank} got SIGUSR1\n"
    assert not any("terminated" in line for line in la.err)
    assert wait_no_tagged(la.tag) == []


def test_a_rank_killed_by_the_forwarded_signal_is_its_failure(run):
    la = run(mode="plain")
    ready(la)
    la.proc.send_signal(signal.SIGUSR1)
    assert la.finish() == 128 + signal.SIGUSR1  # the root-cause rank's, as srun
    assert "torchmp: got SIGUSR1: passed it on to rank 0, 1" in la.err
    assert any("Signal 10 (SIGUSR1) received by PID" in line for line in la.err)
    assert summary(la).startswith("torchmp: summary of rank: 0/2 ranks succeeded, exit code 138, ")
    assert not any("got SIGUSR1: terminated the workers" in line for line in la.err)
    assert wait_no_tagged(la.tag) == []


@pytest.mark.parametrize("how", ["option", "env"])
def test_usr2_forwarded_and_the_report_on_another_signal(run, tmp_path, how):
    report = signal.SIGRTMIN + 1
    if how == "option":
        la = run("--forward-signals", "usr1,SIGUSR2", "--hang-report-signal", "RTMIN+1")
    else:
        la = run(env={"TORCHMP_FORWARD_SIGNALS": "USR2", "TORCHMP_HANG_REPORT_SIGNAL": str(int(report))})
    ready(la)
    la.proc.send_signal(report)
    la.wait_for(lambda: any("hang report 1 saved in" in line for line in la.err), 30, "report 1")
    assert any("hang report 1 of rank (asked by SIGRTMIN+1)" in line for line in la.err)
    la.proc.send_signal(signal.SIGUSR2)
    assert la.finish() == 0
    assert "torchmp: got SIGUSR2: passed it on to rank 0, 1" in la.err
    for rank in (0, 1):
        assert logs(tmp_path, rank) == f"ready\nrank {rank} got SIGUSR2\n"
    assert wait_no_tagged(la.tag) == []


@pytest.mark.parametrize("sig, options", [
    (signal.SIGUSR1, ("--forward-signals", "none")),
    (signal.SIGALRM, ()),
    (signal.SIGRTMIN + 2, ()),
    (signal.SIGSEGV, ()),      # sent with kill(): a request, not a fault
    (signal.SIGUSR2, ("--hang-report-signal", "none")),
])
def test_any_other_fatal_signal_stops_the_ranks_the_normal_way(run, tmp_path, sig, options):
    la = run("--shutdown-timeout", "20", *options)
    ready(la)
    la.proc.send_signal(sig)
    assert la.finish() == 128 + sig
    name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else f"SIGRTMIN+{sig - signal.SIGRTMIN}"
    assert f"torchmp: got {name}: terminated the workers" in la.err
    assert sum("closing signal SIGTERM" in line for line in la.err) == 2
    assert summary(la).startswith(f"torchmp: summary of rank: 0/2 ranks succeeded, exit code {128 + sig}, ")
    for rank in (0, 1):  # SIGTERM reached the ranks (their handler ran): not SIGKILL
        assert logs(tmp_path, rank) == f"ready\nrank {rank} got SIGTERM\n"
    assert wait_no_tagged(la.tag) == []


def test_torchelastic_signals_to_handle_naming_usr1_makes_it_stop_the_job(run, tmp_path):
    la = run(env={"TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGUSR1"})
    ready(la)
    la.proc.send_signal(signal.SIGUSR1)
    assert la.finish() == 128 + signal.SIGUSR1
    assert "torchmp: got SIGUSR1: terminated the workers" in la.err
    assert not any("passed it on" in line for line in la.err)
    for rank in (0, 1):  # the ranks got SIGUSR1 itself, as in torchelastic
        assert logs(tmp_path, rank) == f"ready\nrank {rank} got SIGUSR1\n"


# torchmp run with its launch hooked: the signal comes while the workers
# start (the same module before and after the command line became a package).
EARLY = textwrap.dedent("""\
    import os, signal, sys
    try:
        from torchmp.cli import job as launching
    except ImportError:
        import torchmp.cli as launching
    real = launching.start_processes
    def start_processes(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGUSR2)
        return real(*args, **kwargs)
    launching.start_processes = start_processes
    from torchmp.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def test_a_handled_report_signal_during_the_launch_waits_for_the_context_and_stops_the_job(tmp_path):
    # TORCHELASTIC_SIGNALS_TO_HANDLE names SIGUSR2: it stops the job, as in
    # torchelastic, from the first moment -- held while the workers start,
    # then passed on to them -- not the default action that would kill
    # torchmp run and leave the ranks.
    (tmp_path / "rank.py").write_text(RANK)
    (tmp_path / "early.py").write_text(EARLY)
    with Launchers(follow=True) as launchers:
        la = launchers.start(
            [sys.executable, "early.py", "-n", "2", "--log-dir", str(tmp_path / "logs"), "--",
             sys.executable, "rank.py", "trap"],
            cwd=tmp_path, env={"TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGUSR2"}, unset=UNSET[1:])
        assert la.finish() == 128 + signal.SIGUSR2
        assert "torchmp: got SIGUSR2: terminated the workers" in la.err
        summary = "torchmp: summary of rank: 0/2 ranks succeeded, exit code 140"
        assert any(line.startswith(summary) for line in la.err), la.err
    assert wait_no_tagged(la.tag) == []


@pytest.mark.parametrize("options, env, message", [
    (("--forward-signals", "TERM"), {}, "--forward-signals/--hang-report-signal: SIGTERM stops the job"),
    (("--forward-signals", "USR2"), {}, "SIGUSR2 asks for the hang report; to forward it, choose another"),
    (("--forward-signals", "USR1,BOGUS"), {}, "--forward-signals: unknown signal 'BOGUS'"),
    (("--forward-signals", "KILL"), {}, "--forward-signals: SIGKILL cannot be caught"),
    (("--hang-report-signal", "INT"), {}, "SIGINT stops the job; it cannot ask for the hang report"),
    ((), {"TORCHMP_FORWARD_SIGNALS": "USR1;USR2"}, "$TORCHMP_FORWARD_SIGNALS: unknown signal 'USR1;USR2'"),
    ((), {"TORCHMP_HANG_REPORT_SIGNAL": "RTMIN+999"}, "$TORCHMP_HANG_REPORT_SIGNAL: unknown signal 'RTMIN+999'"),
])
def test_bad_signal_settings_are_usage_errors(run, tmp_path, options, env, message):
    la = run(*options, env=env)
    assert la.finish() == 2
    assert any(message in line for line in la.err), la.err
    assert not (tmp_path / "logs").exists()
    assert not la.out


# torchmp run with the start of its report thread hooked: SIGTERM comes to
# the main thread just as threading.Thread.start begins (a handler raising
# there leaves a thread that never starts).
REPORT_THREAD_START = textwrap.dedent("""\
    import signal, sys, threading
    real = threading.Thread.start
    def start(self):
        if self.name == "torchmp-hang-reports":
            signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
        real(self)
    threading.Thread.start = start
    from torchmp.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def test_sigterm_while_the_report_thread_starts_stops_the_job_the_normal_way(tmp_path):
    # The signal is held until the thread has started, then handled as
    # anywhere else: the ranks get SIGTERM, exit 143 -- not a traceback
    # from joining a thread that never started, and exit 1.
    (tmp_path / "rank.py").write_text(RANK)
    (tmp_path / "hooked.py").write_text(REPORT_THREAD_START)
    with Launchers(follow=True) as launchers:
        la = launchers.start(
            [sys.executable, "hooked.py", "-n", "2", "--log-dir", str(tmp_path / "logs"), "--",
             sys.executable, "rank.py", "trap"],
            cwd=tmp_path, unset=UNSET)
        code = la.finish()
        output = "stderr:\n" + "\n".join(la.err) + "\nstdout:\n" + "\n".join(la.out)
        assert code == 128 + signal.SIGTERM, output
        assert "torchmp: got SIGTERM: terminated the workers" in la.err, output
        assert not any("Traceback" in line for line in la.err), output
    assert wait_no_tagged(la.tag) == []


# torchmp run with a SIGTERM as it flushes its console for the last time,
# the job over: the handler raises inside settle_console's flush.
LAST_FLUSH = textwrap.dedent("""\
    import os, signal, sys
    from torchmp.cli import main
    from torchmp.cli.console import settle_console

    settle = settle_console.__code__

    def at_the_last_flush(frame, event, arg):
        if event == "c_return" and frame.f_code is settle:
            sys.setprofile(None)
            os.kill(os.getpid(), signal.SIGTERM)

    sys.setprofile(at_the_last_flush)
    sys.exit(main(sys.argv[1:]))
""")


def test_sigterm_at_the_last_flush_exits_as_a_signal_does(tmp_path):
    (tmp_path / "hooked.py").write_text(LAST_FLUSH)
    with Launchers(follow=True) as launchers:
        la = launchers.start([sys.executable, "hooked.py", "-n", "2", "--log-dir", str(tmp_path / "logs"), "--",
                              "true"], cwd=tmp_path, unset=UNSET)
        code = la.finish()
        output = "stderr:\n" + "\n".join(la.err) + "\nstdout:\n" + "\n".join(la.out)
        assert code == 128 + signal.SIGTERM, output
        assert not any("Traceback" in line for line in la.err), output
    assert wait_no_tagged(la.tag) == []
