"""Asking a hung job where each rank is: ``torchmp run``'s hang report.

* The /proc readers and the table, on fixture files (a command name with
  spaces and parentheses), and the once-per-silence policy with a fake clock.
* Who makes the reports: a thread of their own, woken through the signal
  wake-up fd or its silence timer, whatever the main thread is doing (an
  in-process stub context).
* The real thing: ``torchmp run -n 3`` with a rank blocked in a pipe read, a
  busy one and a sleeping one; SIGUSR2 prints the table, stops nothing; and
  ``--hang-report-after`` prints it by itself once per silence.

Launchers run from a temporary directory (not the source tree), each with a
unique ``TORCHMP_TEST_TAG`` its workers inherit; cleanup kills leftovers by
that tag and by the launcher's process group, never by name.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from torchmp import _procfs
from torchmp.cli import hang as _hang
from torchmp.cli.job import Job
from torchmp.cli.plan import Plan, UsageError, build_parser

from helpers import Launcher, Launchers, pid_alive, table_rows, tagged, wait_no_tagged

TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------------------
# /proc parsing, on fixtures


def stat_line(pid: int, comm: str, state: str = "S", pgrp: int = 0, utime: int = 7, stime: int = 3,
              rss: int = 100) -> str:
    # Fields 3.. of proc(5): state ppid pgrp session tty_nr tpgid flags minflt
    # cminflt majflt cmajflt utime stime cutime cstime priority nice
    # num_threads itrealvalue starttime vsize rss ...
    rest = [state, "1", str(pgrp or pid), str(pid), "0", "-1", "4194304", "10", "0", "0", "0",
            str(utime), str(stime), "0", "0", "20", "0", "1", "0", "555", "16957440", str(rss),
            "18446744073709551615", "1", "1", "0", "0", "0", "0", "0", "16781318", "0", "1", "0", "0",
            "17", "0", "0", "0", "0", "0"]
    return f"{pid} ({comm}) {' '.join(rest)}\n"


@pytest.mark.parametrize("comm", ["python3", "a b", "x) S 1 2 3 (", "((", ")", "", "tr (ainer) R"])
def test_parse_stat_splits_at_the_last_paren(comm):
    st = _procfs.parse_stat(stat_line(4242, comm, state="D", pgrp=4240, utime=11, stime=5, rss=321))
    assert st.pid == 4242 and st.comm == comm and st.state == "D"
    assert st.ppid == 1 and st.pgrp == 4240 and st.utime == 11 and st.stime == 5
    assert st.starttime == 555 and st.rss_pages == 321


def test_parse_stat_of_a_real_process():
    st = _procfs.parse_stat(Path(f"/proc/{os.getpid()}/stat").read_text())
    assert st.pid == os.getpid() and st.pgrp == os.getpgrp() and st.state == "R"


@pytest.mark.parametrize("text", ["", "garbage", "12 (x) S 1 2", "x (y) S" + " 0" * 30])
def test_parse_stat_rejects_what_is_not_a_stat_line(text):
    with pytest.raises(ValueError):
        _procfs.parse_stat(text)


def test_parse_statm():
    assert _procfs.parse_statm("4139 3357 1736 1 0 420 0\n") == 3357
    with pytest.raises(ValueError):
        _procfs.parse_statm("4139")


def fake_proc(root: Path, pid: int, comm: str = "python3", state: str = "S", utime: int = 7,
              stime: int = 3, resident: int | None = 256, wchan: str | None = "do_nanosleep") -> None:
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    (d / "stat").write_text(stat_line(pid, comm, state, utime=utime, stime=stime, rss=100))
    if resident is not None:
        (d / "statm").write_text(f"9000 {resident} 100 1 0 300 0\n")
    if wchan is not None:
        (d / "wchan").write_text(wchan)


def test_read_wchan(tmp_path):
    fake_proc(tmp_path, 10, wchan="anon_pipe_read")
    fake_proc(tmp_path, 11, wchan="0")      # running (or hidden)
    fake_proc(tmp_path, 12, wchan="")
    fake_proc(tmp_path, 13, wchan=None)     # unreadable
    assert _procfs.read_wchan(10, str(tmp_path)) == "anon_pipe_read"
    assert [_procfs.read_wchan(p, str(tmp_path)) for p in (11, 12, 13, 14)] == ["-"] * 4


def test_sample(tmp_path):
    fake_proc(tmp_path, 20, comm="a) b", state="S", utime=30, stime=12, resident=512)
    fake_proc(tmp_path, 21, resident=None)  # statm missing: stat's rss field
    s = _procfs.sample(20, str(tmp_path))
    assert s == _procfs.RankSample(20, "S", 42, 512 * PAGE, "do_nanosleep")
    assert _procfs.sample(21, str(tmp_path)).rss == 100 * PAGE
    assert _procfs.sample(22, str(tmp_path)) == _procfs.RankSample(22, "", 0, 0, "-")  # gone


def test_state_names():
    assert [_procfs.state_name(c) for c in "RSDZTt"] == [
        "running", "sleeping", "uninterruptible (D)", "zombie", "stopped", "traced"]
    assert _procfs.state_name("?") == "?" and _procfs.state_name("") == "?"


def column_starts(line: str) -> list[int]:
    return [m.start() for m in re.finditer(r"(?<!\S)\S", line)]


def test_format_table_aligns_columns():
    rows = [
        (0, _procfs.RankSample(123, "S", 0, 10 * 1024 * 1024, "anon_pipe_read"), 0.0, 12.34),
        (1, _procfs.RankSample(4567890, "R", 0, 1536 * 1024 * 1024, "-"), 123.456, None),
        (2, _procfs.RankSample(77, "D", 0, 0, "folio_wait_bit_common"), 0.5, 0.04),
        (3, _procfs.RankSample(78, "", 0, 0, "-"), None, 3.0),
        (10, None, None, None),
    ]
    lines = _hang.format_table(rows).splitlines()
    assert re.split(r"\s{2,}", lines[0]) == ["rank", "pid", "state", "cpu", "rss", "last output", "wchan"]
    assert re.split(r"\s{2,}", lines[1].strip()) == [
        "0", "123", "sleeping", "0.00s", "10.0 MiB", "12.3s ago", "anon_pipe_read"]
    assert re.split(r"\s{2,}", lines[2].strip()) == [
        "1", "4567890", "running", "123.46s", "1536.0 MiB", "-", "-"]
    assert re.split(r"\s{2,}", lines[3].strip())[2] == "uninterruptible (D)"
    assert re.split(r"\s{2,}", lines[4].strip()) == ["3", "78", "gone", "-", "-", "3.0s ago", "-"]
    assert re.split(r"\s{2,}", lines[5].strip()) == ["10", "-", "not started", "-", "-", "-", "-"]
    # Numbers are right-aligned (they end together), words left-aligned
    # (they start together), as in the summary table.
    pid_ends = {line.index(line.split()[1]) + len(line.split()[1]) for line in lines}
    state_starts = {line.index(line.split()[2]) for line in lines}
    assert len(pid_ends) == 1 and state_starts == {lines[0].index("state")}


# ---------------------------------------------------------------------------
# The silence policy and the report's bookkeeping


def test_silence_policy_once_per_silence():
    w = _hang.HangWatch(after=1.0, started=100.0)
    assert w.check({0: None, 1: None}, 100.4) == (False, pytest.approx(0.6))
    assert w.check({}, 101.0) == (True, 1.0)                  # silent for 1 s since the start
    assert w.check({}, 102.5) == (False, 1.0)                 # still silent: not again
    assert w.check({0: None}, 110.0) == (False, 1.0)
    assert w.check({0: 0.25, 1: None}, 110.5) == (False, pytest.approx(0.75))  # new output re-arms
    assert w.check({0: 1.0, 1: None}, 111.25) == (True, 1.0)
    assert w.check({0: 2.0, 1: 5.0}, 112.25) == (False, 1.0)
    # Output that keeps coming never makes a report.
    for t in range(120, 130):
        due, wake = w.check({0: 0.1}, float(t))
        assert not due and 0 < wake <= 1.0
    assert _hang.HangWatch(after=None, started=0.0).check({}, 1e9) == (False, -1.0)


def test_report_cpu_since_the_last_report(tmp_path):
    fake_proc(tmp_path, 30, state="R", utime=3 * TICK, stime=TICK, wchan="0")
    fake_proc(tmp_path, 31, state="S", utime=0, stime=0, wchan="anon_pipe_read")
    w = _hang.HangWatch(after=None, started=50.0)
    text = w.report("job", "asked by SIGUSR2", {0: 30, 1: 31}, range(3), lambda r: r + 10,
                    {0: 2.0, 1: None, 2: None}, 60.0, proc=str(tmp_path))
    lines = text.splitlines()
    assert lines[0] == ("torchmp: hang report 1 of job (asked by SIGUSR2), 10.0s after start, "
                        "last output 2.0s ago; cpu: since the start")
    rows = {int(line.split()[0]): line.split() for line in lines[2:]}
    assert rows[10][1:4] == ["30", "running", "4.00s"] and rows[10][-1] == "-"
    assert rows[11][1:4] == ["31", "sleeping", "0.00s"] and rows[11][-1] == "anon_pipe_read"
    assert rows[12][1:3] == ["-", "not"]  # rank 2 has no process
    fake_proc(tmp_path, 30, state="R", utime=5 * TICK, stime=TICK, wchan="0")
    text = w.report("job", "no output for 5s", {0: 30, 1: 31}, range(2), lambda r: r,
                    {}, 65.5, proc=str(tmp_path))
    assert text.splitlines()[0] == ("torchmp: hang report 2 of job (no output for 5s), 15.5s after "
                                    "start, no output seen; cpu: since report 1, 5.5s ago")
    assert text.splitlines()[2].split()[3] == "2.00s"


class FilesCtx:
    def __init__(self, stdouts, stderrs, ages=None):
        self.stdouts, self.stderrs = stdouts, stderrs
        if ages is not None:
            self.output_ages = lambda: dict(ages)


def test_output_ages_from_the_context_and_the_log_files(tmp_path):
    now = time.time()
    old, new, empty = tmp_path / "old.log", tmp_path / "new.log", tmp_path / "empty.log"
    old.write_text("x\n")
    new.write_text("y\n")
    empty.write_text("")
    os.utime(old, (now - 30, now - 30))
    os.utime(new, (now - 2, now - 2))
    os.utime(empty, (now, now))
    stdouts = {0: str(old), 1: "", 2: str(empty), 3: os.devnull}
    stderrs = {0: str(new), 1: "", 2: "", 3: ""}
    # No output_ages() (an older context): the files alone; an empty file or
    # /dev/null tells nothing.
    ages = _hang.output_ages(FilesCtx(stdouts, stderrs), now)
    assert ages[0] == pytest.approx(2, abs=0.01) and ages[1] is None and ages[2] is None and ages[3] is None
    # With output_ages(): the newer of the two.
    ages = _hang.output_ages(FilesCtx(stdouts, stderrs, {0: 5.0, 1: 0.5, 2: None, 3: None}), now)
    assert ages[0] == pytest.approx(2, abs=0.01) and ages[1] == 0.5 and ages[2] is None


def test_python_pids_by_group_finds_this_interpreter():
    found = _procfs.python_pids_by_group([os.getpgrp(), 999999999])
    assert found[999999999] == []
    if re.fullmatch(r"python[0-9.]*[dmu]*", os.path.basename(os.readlink("/proc/self/exe"))):
        assert os.getpid() in found[os.getpgrp()]


def fake_py_spy(directory: Path, body: str) -> str:
    path = directory / "py-spy"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def test_py_spy_dumps_in_parallel_with_a_time_limit(tmp_path):
    exe = fake_py_spy(tmp_path, 'if [ "$3" = 2 ]; then exec sleep 30; fi\necho "stack of $3 ($1 $2)"\n')
    started = time.monotonic()
    out = _hang.py_spy_dumps([1, 2, 3], timeout=0.5, py_spy=exe)
    assert time.monotonic() - started < 3
    assert out[1] == "stack of 1 (dump --pid)\n" and out[3] == "stack of 3 (dump --pid)\n"
    assert out[2] == "(py-spy gave no answer within 0.5s)\n"
    failing = fake_py_spy(tmp_path, 'echo "Permission denied" >&2; exit 1\n')
    assert _hang.py_spy_dumps([7], py_spy=failing)[7] == "Permission denied\n(py-spy exited with 1)\n"
    assert _hang.py_spy_dumps([7], py_spy=str(tmp_path / "missing"))[7].startswith("py-spy could not be started")


def test_py_spy_is_optional(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert _hang.py_spy_dumps([os.getpid()]) == {}


# ---------------------------------------------------------------------------
# Waking the run loop (in process, with a stub context)


def make_run(*options: str) -> Job:
    args = build_parser().parse_args([*options, "-n", "1", "true"])
    return Job(Plan(args, args.command))


class StubCtx:
    """A context whose wait does busy() first (the main thread at work, as
    in a fail-fast), then sleeps until the test releases it."""

    stdouts: dict[int, str] = {}
    stderrs: dict[int, str] = {}

    def __init__(self, busy=None) -> None:
        self.calls = 0
        self.busy = busy
        self.release = threading.Event()

    def pids(self):
        return {}

    def wait(self, timeout: float = -1, period: float = 1):
        self.calls += 1
        if self.busy is not None:
            self.busy()
        self.release.wait(10)
        return "result"


@pytest.fixture
def report_handler(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_SIGNALS_TO_HANDLE", raising=False)
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGUSR2)}  # USR1: forwarded
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)
    assert signal.set_wakeup_fd(-1) == -1  # given back


def run_stub(run: Job, ctx: StubCtx, signal_at: float | None = None,
             reports_wanted: int = 1) -> list[tuple[str, float, bool, bool]]:
    """Run run.wait() over ctx: each report as (reason, when, whether the
    wait was still asleep or busy, whether it was made off the main
    thread); the wait is released once reports_wanted are made."""
    reports: list[tuple[str, float, bool, bool]] = []

    def report(reason: str) -> None:
        reports.append((reason, time.monotonic(), not ctx.release.is_set(),
                        threading.current_thread() is not threading.main_thread()))
        if len(reports) >= reports_wanted:
            ctx.release.set()

    run.hang_report = report  # type: ignore[method-assign]
    run.ctx = ctx
    run.install_report_handler()
    timer = None
    if signal_at is not None:
        timer = threading.Timer(signal_at, signal.pthread_kill, (threading.main_thread().ident, signal.SIGUSR2))
        timer.start()
    try:
        run.wait()
    finally:
        if timer is not None:
            timer.join()
        run.reports.stop()
    assert run.result == "result" and ctx.calls == 1  # the wait was never cut short
    return reports


def test_signal_makes_a_report_while_the_wait_sleeps(report_handler):
    reports = run_stub(make_run(), StubCtx(), signal_at=0.1)
    # Made while the wait still slept (it sleeps 10 s unless released).
    assert [(r[0], r[2], r[3]) for r in reports] == [("asked by SIGUSR2", True, True)]


def test_signal_while_the_main_thread_is_busy(report_handler):
    # As in a fail-fast grace: the main thread is at work inside the wait
    # (no frame of the wait's own); the report does not wait for it.
    sent: list[float] = []

    def busy():
        sent.append(time.monotonic())
        signal.raise_signal(signal.SIGUSR2)
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            pass
        sent.append(time.monotonic())

    reports = run_stub(make_run(), StubCtx(busy=busy))
    assert len(reports) == 1 and reports[0][0] == "asked by SIGUSR2" and reports[0][3]
    assert reports[0][1] < sent[1], (reports, sent)  # made while the main thread was busy


def test_silence_timer_while_the_main_thread_is_busy(report_handler):
    busy_until: list[float] = []

    def busy():
        busy_until.append(time.monotonic() + 2.0)
        while time.monotonic() < busy_until[0]:
            pass

    run = make_run("--hang-report-after", "0.3")
    run.hang.started = time.monotonic()
    reports = run_stub(run, StubCtx(busy=busy))
    assert [r[0] for r in reports] == ["no output for 0.3s"] and reports[0][3]
    assert reports[0][1] < busy_until[0], (reports, busy_until)   # made while the main thread was busy


def test_signal_before_the_reports_start_is_answered_first(report_handler):
    run = make_run()
    run.install_report_handler()
    signal.raise_signal(signal.SIGUSR2)  # during the launch, say
    reports = run_stub(run, StubCtx())
    assert [r[0] for r in reports] == ["asked by SIGUSR2"]


def test_signals_coalesce_and_stop_finishes_the_report(report_handler):
    # Three signals while a report is being made: one more report, not three.
    run = make_run()
    ctx = StubCtx()
    made: list[float] = []

    def slow_report(reason: str) -> None:
        made.append(time.monotonic())
        if len(made) == 1:
            for _ in range(3):
                os.kill(os.getpid(), signal.SIGUSR2)
            time.sleep(0.5)
        else:
            ctx.release.set()

    run.hang_report = slow_report  # type: ignore[method-assign]
    run.ctx = ctx
    run.install_report_handler()
    os.kill(os.getpid(), signal.SIGUSR2)
    run.wait()
    time.sleep(0.3)
    run.reports.stop()
    assert len(made) == 2, made
    assert run.reports._thread is not None and not run.reports._thread.is_alive()


@pytest.mark.parametrize("hold", [(), (signal.SIGUSR1,)])
def test_a_signal_while_the_report_thread_starts(report_handler, hold):
    # A handler that raises (SignalException) runs as threading.Thread.start
    # begins.  Not held, it cuts the start short: the thread never starts,
    # and stop() gives everything back all the same.  Held, it is handled
    # once start() returns, the thread running.
    from torchmp._signals import SignalException, terminate_process_handler

    signal.signal(signal.SIGUSR1, terminate_process_handler)  # the fixture puts it back
    reports = _hang.ReportThread(signal.SIGUSR2, lambda asked: -1.0)
    reports.arm()
    real = threading.Thread.start
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])

    def start(thread: threading.Thread) -> None:
        signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
        real(thread)

    threading.Thread.start = start  # type: ignore[method-assign]
    try:
        with pytest.raises(SignalException):
            reports.start(hold=hold) if hold else reports.start()
    finally:
        threading.Thread.start = real  # type: ignore[method-assign]
    thread = reports._thread
    assert thread is not None and thread.is_alive() == bool(hold)
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask  # nothing left blocked
    reports.stop()
    assert not thread.is_alive() and reports._read_fd == reports._write_fd == -1


def test_a_signal_as_stop_closes_the_pipe_leaves_no_second_close(report_handler):
    # A handler that raises as stop() has closed the pipe's first end (the
    # job shutting down after a SIGTERM): the second stop() on the job's way
    # out must not close that number again -- EBADF, or by then someone
    # else's file.
    from torchmp._signals import SignalException, terminate_process_handler

    signal.signal(signal.SIGUSR1, terminate_process_handler)  # the fixture puts it back
    reports = _hang.ReportThread(signal.SIGUSR2, lambda asked: -1.0)
    reports.arm()
    reports.start()
    stop_code = _hang.ReportThread.stop.__code__

    def after_the_first_close(frame, event, arg):
        if event == "c_return" and arg is os.close and frame.f_code is stop_code:
            sys.setprofile(None)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)  # its handler raises here

    sys.setprofile(after_the_first_close)
    try:
        with pytest.raises(SignalException):
            reports.stop()
    finally:
        sys.setprofile(None)
    someone_elses = os.open(os.devnull, os.O_RDONLY)  # likely the number just closed
    try:
        reports.stop()
        os.fstat(someone_elses)  # still open
    finally:
        os.close(someone_elses)
    assert reports._read_fd == reports._write_fd == -1


def test_torchelastic_signals_to_handle_naming_sigusr2_wins(report_handler, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGUSR2")
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    first = make_run()
    first.install_report_handler()
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN  # left to start_processes
    first.reports.stop()
    # The silence timer still makes its reports.
    run = make_run("--hang-report-after", "0.2")
    run.hang.started = time.monotonic()
    reports = run_stub(run, StubCtx())
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
    assert [r[0] for r in reports] == ["no output for 0.2s"]


def test_usage_errors():
    for bad in ("0", "-1", "nan", "inf"):
        args = build_parser().parse_args(["--hang-report-after", bad, "-n", "1", "true"])
        with pytest.raises(UsageError, match="--hang-report-after must be > 0"):
            Plan(args, args.command)


# ---------------------------------------------------------------------------
# The real thing


WORKER = textwrap.dedent("""\
    import os, sys, time
    rank = int(os.environ["LOCAL_RANK"])
    print("ready", flush=True)
    if rank == 0:
        r, w = os.pipe()
        os.read(r, 1)                  # blocked in a pipe read
    elif rank == 1:
        while True:                    # busy
            pass
    else:
        time.sleep(600)
""")


@pytest.fixture
def launcher():
    """Start ``python -m torchmp run ARGS`` in cwd (a Launcher whose stdout
    and stderr are read line by line as they come); stopped at the end of
    the test."""
    with Launchers(follow=True) as launchers:
        def start(*args: str, cwd: Path, env: dict[str, str] | None = None) -> Launcher:
            return launchers.start([sys.executable, "-m", "torchmp", "run", *args], cwd=cwd, env=env)

        yield start


TITLE = re.compile(r"^torchmp: hang report (\d+) of (\S+) \((.+?)\), \d+\.\ds after start, (.+); cpu: (.+)$")
ROW = re.compile(r"^\s*(?P<rank>\d+)\s+(?P<pid>\d+)\s+(?P<state>\S+(?: \(D\))?)\s+(?P<cpu>\d+\.\d\d)s\s+"
                 r"(?P<rss>\d+\.\d) MiB\s+(?P<age>\d+\.\ds ago|-)\s+(?P<wchan>\S+)$")


def parse_report(lines: list[str], number: int) -> tuple[re.Match, dict[int, dict[str, str]]]:
    start = next(i for i, line in enumerate(lines)
                 if (m := TITLE.match(line)) and int(m.group(1)) == number)
    title = TITLE.match(lines[start])
    assert re.split(r"\s{2,}", lines[start + 1]) == ["rank", "pid", "state", "cpu", "rss", "last output",
                                                     "wchan"], lines[start + 1]
    return title, table_rows(lines[start + 2:], ROW)


def reports_in(lines: list[str]) -> list[str]:
    return [line for line in lines if TITLE.match(line)]


def wchan_visible() -> bool:
    """Whether this kernel shows wait channels to us (some hide them: "0")."""
    p = subprocess.Popen(["sleep", "5"])
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if _procfs.sample(p.pid).state == "S":
                return _procfs.read_wchan(p.pid) != "-"
            time.sleep(0.01)
        return False
    finally:
        p.kill()
        p.wait()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (0 once it is gone)."""
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return times.user + times.system


def _wait_for_cpu(used: Callable[[], float], seconds: float, timeout: float = 30) -> None:
    """Wait until used() reaches seconds: on a loaded machine (CI's lanes
    side by side on two cores) a busy rank gets less than a second of CPU
    per second."""
    deadline = time.monotonic() + timeout
    while used() < seconds:
        assert time.monotonic() < deadline, f"not {seconds:.2f} CPU seconds in {timeout} s"
        time.sleep(0.05)


def test_sigusr2_prints_where_each_rank_is_and_stops_nothing(launcher, tmp_path):
    (tmp_path / "w.py").write_text(WORKER)
    la = launcher("-n", "3", "--log-dir", str(tmp_path / "logs"), "--", sys.executable, "w.py",
                  cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})  # no py-spy
    la.wait_for(lambda: sum(line.endswith("]:ready") for line in la.out) == 3, 30, "3 ready lines")
    time.sleep(1.0)  # every rank's last output is a second old
    _wait_for_cpu(lambda: max(_cpu_seconds(p.pid) for p in psutil.Process(la.proc.pid).children()), 0.5)
    sent = time.monotonic()
    la.proc.send_signal(signal.SIGUSR2)
    la.wait_for(lambda: any("hang report 1 saved in" in line for line in la.err), 30, "report 1")
    assert time.monotonic() - sent < 5
    title, rows = parse_report(la.err, 1)
    assert title.group(2) == "w" and title.group(3) == "asked by SIGUSR2"
    assert title.group(5) == "since the start"
    assert sorted(rows) == [0, 1, 2]
    pipe, busy, sleeper = rows[0], rows[1], rows[2]
    assert pipe["state"] == "sleeping" and sleeper["state"] == "sleeping" and busy["state"] == "running"
    assert float(busy["cpu"]) > 0.3
    assert float(pipe["cpu"]) < 0.3 and float(sleeper["cpu"]) < 0.3  # the interpreter's start-up
    for row in rows.values():
        assert float(row["rss"]) > 1
        assert row["age"].endswith("s ago") and float(row["age"].split("s")[0]) >= 0.9
    assert busy["wchan"] in ("-", "0")
    if wchan_visible():
        assert "pipe" in pipe["wchan"], pipe         # pipe_read, pipe_wait, anon_pipe_read...
        assert "sleep" in sleeper["wchan"], sleeper  # hrtimer_nanosleep, do_nanosleep...
    assert any("with py-spy installed" in line for line in la.err)

    # Nothing was stopped.
    pids = {rank: int(row["pid"]) for rank, row in rows.items()}
    assert la.proc.poll() is None
    for pid in pids.values():
        assert pid_alive(pid) and _procfs.sample(pid).state in ("R", "S")

    # The same report is in the run's directory.
    saved = next(line for line in la.err if "hang report 1 saved in" in line).split(" saved in ", 1)[1]
    assert Path(saved).parent.name == "attempt_0" and Path(saved).name == "hang-report-1.txt"
    text = Path(saved).read_text()
    assert TITLE.match(text.splitlines()[0]) and text.splitlines()[1].startswith("rank ")
    assert text.count(f"  {pids[1]}  running  ") == 1

    # A second report: CPU since the first (0.4 s more of it in the busy rank).
    _wait_for_cpu(lambda: _cpu_seconds(pids[1]), _cpu_seconds(pids[1]) + 0.4)
    la.proc.send_signal(signal.SIGUSR2)
    la.wait_for(lambda: any("hang report 2 saved in" in line for line in la.err), 30, "report 2")
    title, rows = parse_report(la.err, 2)
    assert title.group(5).startswith("since report 1, ")
    assert float(rows[1]["cpu"]) > 0.2 and float(rows[0]["cpu"]) < 0.05 and float(rows[2]["cpu"]) < 0.05
    assert sum("with py-spy installed" in line for line in la.err) == 1  # said once

    la.proc.send_signal(signal.SIGTERM)
    assert la.finish() == 128 + signal.SIGTERM
    assert wait_no_tagged(la.tag) == []
    assert "torchmp: got SIGTERM: terminated the workers" in la.err


def test_report_with_py_spy_shows_each_python_rank(launcher, tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake_py_spy(bindir, 'echo "Thread $3 (idle): \\"MainThread\\""\necho "    <module> (w.py:9)"\n')
    (tmp_path / "w.py").write_text(WORKER.replace("rank == 1", "rank == 99"))  # no busy rank
    # Rank 0 is Python itself; rank 1 runs it under a shell: the Python
    # process of its group is dumped.
    la = launcher("-n", "2", "--log-dir", str(tmp_path / "logs"), "--", "sh", "-c",
                  f'if [ "$LOCAL_RANK" = 0 ]; then exec {sys.executable} w.py; fi; {sys.executable} w.py; exit 0',
                  cwd=tmp_path,
                  env={"PATH": f"{bindir}:/usr/bin:/bin"})
    la.wait_for(lambda: sum(line.endswith("]:ready") for line in la.out) == 2, 30, "2 ready lines")
    la.proc.send_signal(signal.SIGUSR2)
    la.wait_for(lambda: any("hang report 1 saved in" in line for line in la.err), 30, "report 1")
    _, rows = parse_report(la.err, 1)
    shell = int(rows[1]["pid"])
    dumps = [line for line in la.err if line.startswith("torchmp: py-spy dump of rank")]
    assert len(dumps) == 2, la.err
    assert dumps[0] == f"torchmp: py-spy dump of rank 0 (pid {rows[0]['pid']}):"
    m = re.fullmatch(r"torchmp: py-spy dump of rank 1 \(pid (\d+)\):", dumps[1])
    assert m and int(m.group(1)) != shell  # the trainer, not the shell
    assert _procfs.parse_stat(Path(f"/proc/{m.group(1)}/stat").read_text()).pgrp == shell
    assert f"Thread {m.group(1)} (idle): \"MainThread\"" in la.err
    saved = next(line for line in la.err if "hang report 1 saved in" in line).split(" saved in ", 1)[1]
    assert f"Thread {m.group(1)} (idle)" in Path(saved).read_text()
    la.proc.send_signal(signal.SIGTERM)
    assert la.finish() == 128 + signal.SIGTERM


SILENT = textwrap.dedent("""\
    import os, sys, time
    print("ready", flush=True)
    # Blocked (sleeping, not polling) until the test opens the FIFO to write.
    os.open(sys.argv[1], os.O_RDONLY)
    print("more", flush=True)
    time.sleep(600)
""")


def silent_report(lines: list[str], nranks: int, after: int = 0) -> int | None:
    """The number of the first report (after report ``after``) in which every
    rank had been silent for about a second (a rank slow to start, or to
    answer the flag, can make an earlier one)."""
    for title in reports_in(lines):
        number = int(TITLE.match(title).group(1))
        if number <= after:
            continue
        _, rows = parse_report(lines, number)
        if len(rows) == nranks and all(row["age"] != "-" and float(row["age"].split("s")[0]) >= 0.9
                                       for row in rows.values()):
            return number
    return None


@pytest.mark.parametrize("streams", ["tee", "redirected"])
def test_hang_report_after_once_per_silence(launcher, tmp_path, streams):
    (tmp_path / "s.py").write_text(SILENT)
    flag = tmp_path / "flag"
    os.mkfifo(flag)
    extra = ["--redirects", "3"] if streams == "redirected" else []
    la = launcher("-n", "2", "--hang-report-after", "1", *extra, "--log-dir", str(tmp_path / "logs"),
                  "--", sys.executable, "s.py", str(flag), cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})
    if streams == "tee":
        la.wait_for(lambda: sum(line.endswith("]:ready") for line in la.out) == 2, 30, "2 ready lines")
    started = time.monotonic()
    la.wait_for(lambda: silent_report(la.err, 2) is not None, 30, "a report of both ranks silent")
    if streams == "tee":
        assert time.monotonic() - started < 3
    first = silent_report(la.err, 2)
    title, rows = parse_report(la.err, first)
    assert title.group(3) == "no output for 1s"
    assert all(row["state"] == "sleeping" for row in rows.values())
    time.sleep(2.5)  # silence goes on: no further report
    assert len(reports_in(la.err)) == first, la.err
    # Both ranks wake (ENXIO, not a hang, if neither waits): new output, then silence again: one more
    os.close(os.open(flag, os.O_WRONLY | os.O_NONBLOCK))
    la.wait_for(lambda: (silent_report(la.err, 2, after=first) or 0) > first, 30, "the next report")
    second = silent_report(la.err, 2, after=first)
    title, _ = parse_report(la.err, second)
    assert title.group(3) == "no output for 1s"
    if streams == "tee":
        assert sum(line.endswith("]:more") for line in la.out) == 2
    time.sleep(1.5)
    assert len(reports_in(la.err)) == second, la.err
    la.proc.send_signal(signal.SIGTERM)
    assert la.finish() == 128 + signal.SIGTERM


def test_torchelastic_signals_to_handle_makes_sigusr2_stop_the_job(launcher, tmp_path):
    la = launcher("-n", "2", "--log-dir", str(tmp_path / "logs"), "--", sys.executable, "-c",
                  "import time; print('ready', flush=True); time.sleep(600)", cwd=tmp_path,
                  env={"TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGUSR2"})
    la.wait_for(lambda: sum(line.endswith("]:ready") for line in la.out) == 2, 30, "2 ready lines")
    la.proc.send_signal(signal.SIGUSR2)
    assert la.finish() == 128 + signal.SIGUSR2
    assert not reports_in(la.err)
    assert wait_no_tagged(la.tag) == []


# ---------------------------------------------------------------------------
# Reports during a shutdown: ranks that trap SIGTERM and linger


TRAPS = textwrap.dedent("""\
    import os, signal, sys, time
    rank = int(os.environ["LOCAL_RANK"])
    linger, mode = sys.argv[1], sys.argv[2]
    def on_term(*_):
        print("got TERM", flush=True)
        os.open(linger, os.O_RDONLY)   # asleep until the test opens the FIFO
        os._exit(0)
    signal.signal(signal.SIGTERM, on_term)
    print("ready", flush=True)
    if rank == 0 and mode == "fail":
        while not os.path.exists("go"):
            time.sleep(0.01)
        sys.exit(3)
    while True:
        time.sleep(0.1)
        if mode == "tick":
            print("tick", flush=True)
""")


def start_traps(launcher, tmp_path, mode: str, *options: str):
    (tmp_path / "traps.py").write_text(TRAPS)
    linger = tmp_path / "linger"
    os.mkfifo(linger)
    la = launcher("-n", "3", *options, "--log-dir", str(tmp_path / "logs"), "--", sys.executable, "traps.py",
                  str(linger), mode, cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})
    la.wait_for(lambda: sum(line.endswith("]:ready") for line in la.out) == 3, 30, "3 ready lines")
    return la, linger


def got_term(la, n: int) -> None:
    """Wait until n ranks said they got SIGTERM and are asleep in the
    FIFO's open (the state a report must show)."""
    la.wait_for(lambda: sum(line.endswith("]:got TERM") for line in la.out) == n, 30, f"{n} 'got TERM' lines")
    deadline = time.monotonic() + 30
    while True:
        asleep = []
        for p in tagged(la.tag):
            try:
                if "traps.py" in " ".join(p.cmdline()):
                    s = _procfs.sample(p.pid)   # wchan "-" where the kernel hides it
                    if s.state == "S" and (s.wchan == "-" or "partner" in s.wchan or "fifo" in s.wchan):
                        asleep.append(p)
            except psutil.Error:
                pass
        if len(asleep) >= n:
            return
        assert time.monotonic() < deadline, "the ranks did not go to sleep in the FIFO's open"
        time.sleep(0.01)


def release(linger) -> None:
    os.close(os.open(linger, os.O_WRONLY | os.O_NONBLOCK))


def test_sigusr2_during_the_fail_fast_grace(launcher, tmp_path):
    la, linger = start_traps(launcher, tmp_path, "fail")
    (tmp_path / "go").touch()                      # rank 0 exits 3: fail-fast
    got_term(la, 2)
    la.proc.send_signal(signal.SIGUSR2)
    la.wait_for(lambda: any("hang report 1 saved in" in line for line in la.err), 30, "report 1")
    title, rows = parse_report(la.err, 1)
    assert title.group(3) == "asked by SIGUSR2"
    assert title.group(4).startswith("2 of 3 ranks still running, "), title.group(0)
    assert sorted(rows) == [1, 2] and all(row["state"] == "sleeping" for row in rows.values()), rows
    assert la.proc.poll() is None                  # the grace goes on
    release(linger)
    assert la.finish() == 3
    summary = la.err[la.err.index(next(line for line in la.err if line.startswith("torchmp: summary of"))):]
    assert any(re.match(r"\s*0\s+\d+\s+3\s.*root cause", line) for line in summary), la.err
    assert len(reports_in(la.err)) == 1
    assert wait_no_tagged(la.tag) == []


def test_sigusr2_during_the_grace_after_sigterm(launcher, tmp_path):
    la, linger = start_traps(launcher, tmp_path, "sleep")
    la.proc.send_signal(signal.SIGTERM)
    got_term(la, 3)
    for number in (1, 2):                          # as often as asked
        la.proc.send_signal(signal.SIGUSR2)
        saved = f"hang report {number} saved in"
        la.wait_for(lambda saved=saved: any(saved in line for line in la.err), 30, f"report {number}")
        title, rows = parse_report(la.err, number)
        assert title.group(3) == "asked by SIGUSR2" and sorted(rows) == [0, 1, 2], la.err
        assert all(row["state"] == "sleeping" for row in rows.values()), rows
    release(linger)
    assert la.finish() == 128 + signal.SIGTERM
    assert "torchmp: got SIGTERM: terminated the workers" in la.err
    assert wait_no_tagged(la.tag) == []


def test_hang_report_after_fires_during_the_grace(launcher, tmp_path):
    # The ranks write every 0.1 s until they get SIGTERM, then nothing: the
    # silence is in the grace, and so is its report.
    la, linger = start_traps(launcher, tmp_path, "tick", "--hang-report-after", "2")
    la.proc.send_signal(signal.SIGTERM)
    got_term(la, 3)
    before = len(reports_in(la.err))
    la.wait_for(lambda: len(reports_in(la.err)) > before, 30, "a report during the grace")
    number = int(TITLE.match(reports_in(la.err)[before]).group(1))
    la.wait_for(lambda: any(f"hang report {number} saved in" in line for line in la.err), 30, "the table")
    title, rows = parse_report(la.err, number)
    assert title.group(3) == "no output for 2s" and sorted(rows) == [0, 1, 2], la.err
    assert all(float(row["age"].split("s")[0]) >= 1.9 for row in rows.values()), rows
    release(linger)
    assert la.finish() == 128 + signal.SIGTERM
    assert wait_no_tagged(la.tag) == []
