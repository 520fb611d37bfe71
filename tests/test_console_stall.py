"""A console that never holds the job back: the launcher's stdout is a pipe
that nobody reads.

Each test runs a launcher in a subprocess (a session of its own) whose fd 1
(and in one variant fd 2) is the write end of a pipe (or a terminal) the
test does not read while the workers write megabytes of numbered lines through tee.  With a
console write that can block, the I/O thread stops on the full pipe, the
workers stop on their full tee pipes, and wait() never returns.  Checked:

* wait() returns within seconds while the pipe is still unread (and while
  the console still has a backlog), with every worker's exit status right;
* every log file is byte-exact;
* fail-fast works while the console is stalled;
* once the test drains the pipe (only after the launcher reported that
  wait() returned), the launcher finishes, and the console got every line,
  whole, prefixed, in order, once: the log files were its backlog;
* a console that took nothing for the stall time (TORCHMP_CONSOLE_STALL)
  has whole lines left out instead, with one marker per stream that lost
  lines, and the marker counts plus the lines shown add up to the lines
  written.

Every launch carries a unique ``TORCHMP_TEST_TAG`` that its workers inherit;
cleanup kills leftovers by that tag and by the launcher's process group
(never by name), even when a test fails.
"""
from __future__ import annotations

import errno
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
import tty
from dataclasses import dataclass
from pathlib import Path

import pytest

from torchmp import _core

from helpers import Launcher, Launchers, wait_gone

NRANKS = 4
LINE_LEN = 100
LINES = 20000            # 100-byte lines: 2 MB per rank and stream
WAIT_BOUND = 5.0         # "within a few seconds"; a blocked console never returns
HANG = 30.0              # the test's own limit for anything that should take a second


def expected_line(rank: int, stream: str, i: int) -> bytes:
    """Line i of a rank's stream: 100 bytes with its newline."""
    head = b"r%d %s %07d " % (rank, stream.encode(), i)
    return head + b"x" * (LINE_LEN - 1 - len(head)) + b"\n"


def expected_log(rank: int, stream: str, count: int = LINES) -> bytes:
    return b"".join(expected_line(rank, stream, i) for i in range(count))


# The worker: argv = rank, lines, streams ("out" or "out,err"), fail mode,
# a directory for its flag files.  It writes its pid first, then the lines
# in 65000-byte pieces (cut anywhere: reads do not end at line ends),
# alternating between its streams.
WORKER = r"""
import os, sys, time
rank, lines, streams, mode, flags = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4], sys.argv[5]
with open(os.path.join(flags, "pid.%d" % rank), "w") as f:
    f.write(str(os.getpid()))
def line(s, i):
    head = b"r%d %s %07d " % (rank, s.encode(), i)
    return head + b"x" * (99 - len(head)) + b"\n"
def write_all(fd, data):
    while data:
        data = data[os.write(fd, data):]
if mode == "fail" and rank == 0:
    # Fail once the others have written everything (the console is stalled
    # by then), and say when.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(flags, "done.%d" % r)) for r in range(1, int(sys.argv[6]))):
        time.sleep(0.01)
    with open(os.path.join(flags, "failed_at"), "w") as f:
        f.write(repr(time.time()))
    os._exit(1)
data = {s: b"".join(line(s, i) for i in range(lines)) for s in streams}
fds = {"out": 1, "err": 2}
for a in range(0, lines * 100, 65000):
    for s in streams:
        write_all(fds[s], data[s][a:a + 65000])
open(os.path.join(flags, "done.%d" % rank), "w").close()
if mode == "fail":
    time.sleep(60)
"""

# The launcher: start_processes with tee, wait(), a report in a file (never
# on its own stdout: that is the stalled console), close(), a normal exit.
LAUNCHER = """
import json, os, sys, time
import torchmp
from torchmp import Std, _core
P = json.loads({params!r})
tee = Std.ALL if P["streams"] == "out,err" else Std.OUT
ctx = torchmp.start_processes(
    "w", sys.executable,
    {{r: ("-c", P["worker"], str(r), str(P["lines"]), P["streams"], P["mode"], P["flags"], str(P["nranks"]))
      for r in range(P["nranks"])}},
    {{r: {{}} for r in range(P["nranks"])}},
    torchmp.DefaultLogsSpecs(log_dir=P["log_dir"], tee=tee))
started = time.monotonic()
r = ctx.wait(P["wait_timeout"])
took = time.monotonic() - started
report = {{
    "took": took, "returned_at": time.time(), "result": r is not None,
    "pending": _core.consoles_pending(),
    "failures": {{str(k): v.exitcode for k, v in r.failures.items()}} if r is not None else None,
    "stdouts": {{str(k): v for k, v in r.stdouts.items()}} if r is not None else None,
    "stderrs": {{str(k): v for k, v in r.stderrs.items()}} if r is not None else None,
}}
with open(P["report"] + ".tmp", "w") as f:
    json.dump(report, f)
os.rename(P["report"] + ".tmp", P["report"])
ctx.close()
if P["hold"]:  # the exit waits as long as the test wants the console unread
    while not os.path.exists(P["hold"]):
        time.sleep(0.01)
"""


@dataclass
class Launch:
    """One launcher subprocess writing its console into an unread pipe (or
    terminal)."""
    launcher: Launcher
    read_fd: int
    report_path: Path
    flags: Path
    log_dir: Path
    stderr_path: Path | None

    def wait_report(self, timeout: float = HANG) -> dict:
        """The launcher's report once wait() returned (the pipe still unread)."""
        deadline = time.monotonic() + timeout
        while not self.report_path.exists():
            if self.proc.poll() is not None:
                raise AssertionError(f"the launcher exited ({self.proc.returncode}) without a report: "
                                     f"{self.stderr_text()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"wait() did not return in {timeout}s while the console was "
                                     "stalled (the I/O thread blocks on the console?)")
            time.sleep(0.01)
        return json.loads(self.report_path.read_text())

    @property
    def proc(self) -> subprocess.Popen:
        return self.launcher.proc

    def drain(self, timeout: float = HANG, nap: float = 0.0, size: int = 1 << 20) -> bytes:
        """Read the pipe to EOF (everyone holding its write end is gone);
        nap: a pause after each read of up to size bytes (a slow reader)."""
        chunks = []
        deadline = time.monotonic() + timeout
        while True:
            if nap:
                time.sleep(nap)
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"the console pipe did not reach EOF in {timeout}s "
                                     f"(launcher returncode {self.proc.poll()})")
            ready, _, _ = select.select([self.read_fd], [], [], min(left, 0.5))
            if not ready:
                continue
            try:
                chunk = os.read(self.read_fd, size)
            except OSError as e:  # a pty whose other side is closed
                if e.errno != errno.EIO:
                    raise
                chunk = b""
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)

    def finish(self, timeout: float = HANG) -> int:
        return self.launcher.wait(timeout, f"the launcher did not finish in {timeout}s after its console "
                                  "was drained")

    def stderr_text(self) -> str:
        if self.stderr_path is None or not self.stderr_path.exists():
            return ""
        return self.stderr_path.read_text(errors="replace")[-4000:]

    def close(self) -> None:
        """Close the test's end of the console (once the launcher is stopped)."""
        if self.read_fd >= 0:
            os.close(self.read_fd)
            self.read_fd = -1


@pytest.fixture
def stalled():
    """start(**kw) -> Launch; everything started is killed and reaped after
    the test, by tag and process group, pass or fail."""
    started: list[Launch] = []
    launchers = Launchers()

    def start(tmp: Path, *, streams: str = "out", mode: str = "ok", nranks: int = NRANKS,
              lines: int = LINES, cli: bool = False, pty: bool = False, env: dict | None = None,
              hold: bool = False) -> Launch:
        flags = tmp / "flags"
        flags.mkdir()
        log_dir = tmp / "logs"
        report = tmp / "report.json"
        if pty:
            # A terminal nobody reads (raw: the console's bytes unchanged).
            r, w = os.openpty()
            tty.setraw(w)
        else:
            r, w = os.pipe()
        err_path = None if streams == "out,err" else tmp / "launcher.err"
        err_file = None
        try:
            if streams == "out,err":
                stderr = w  # 2>&1
            else:
                err_file = open(err_path, "wb")
                stderr = err_file
            if cli:
                launcher = launchers.start(_cli_argv(flags, log_dir, nranks, lines), stdout=w, stderr=stderr,
                                           unset=("TORCHELASTIC_SIGNALS_TO_HANDLE", "PYTHONUNBUFFERED"), env=env)
            else:
                params = json.dumps({
                    "worker": WORKER, "lines": lines, "streams": streams, "mode": mode,
                    "flags": str(flags), "nranks": nranks, "log_dir": str(log_dir),
                    "report": str(report), "wait_timeout": 120,
                    "hold": str(tmp / "hold") if hold else ""})
                # The library launches: TORCHELASTIC_SIGNALS_TO_HANDLE is left as it is.
                launcher = launchers.python(LAUNCHER.format(params=params), stdout=w, stderr=stderr, unset=(),
                                            env=env)
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)  # only the launcher (and what it starts) holds the write end
            if err_file is not None:
                err_file.close()
        launch = Launch(launcher, r, report, flags, log_dir, err_path)
        started.append(launch)
        return launch

    with launchers:
        yield start
    for launch in started:
        launch.close()
    assert launchers.left() == []


def _cli_argv(flags: Path, log_dir: Path, nranks: int, lines: int) -> list[str]:
    """``python -m torchmp run --tee 3 -n N -- python -c WORKER ...``: rank
    from LOCAL_RANK (the worker script reads it from argv, so a shell
    wrapper passes it)."""
    code = (f"import os, sys; sys.argv = ['w', os.environ['LOCAL_RANK'], {str(lines)!r}, 'out', 'ok', "
            f"{str(flags)!r}, '0']; exec(compile({WORKER!r}, 'worker', 'exec'))")
    return [sys.executable, "-m", "torchmp", "run", "--tee", "3", "-n", str(nranks), "--name", "w",
            "--log-dir", str(log_dir), "--", sys.executable, "-c", code]


# --- reading the console --------------------------------------------------------

LINE_RE = re.compile(rb"\[w(\d+)\]:r(\d+) (out|err) (\d{7}) x+\n")
MARKER_RE = re.compile(
    rb"\[w(\d+)\]:torchmp: (\d+) lines? \((\d+) (bytes|KiB|MiB)\) not shown: "
    rb"the console fell behind(?:; complete log: (.+))?\n")
UNITS = {b"bytes": 1, b"KiB": 1 << 10, b"MiB": 1 << 20}


@dataclass
class Console:
    shown: dict            # (rank, stream) -> [line numbers in console order]
    markers: list          # (rank, lines, (size_lo, size_hi), log path or None)
    bad: list              # console lines that are neither


def parse_console(data: bytes) -> Console:
    shown: dict = {}
    markers = []
    bad = []
    lines = data.split(b"\n")
    tail = lines.pop()
    if tail:
        bad.append(tail + b"  <- no newline at the end of the console")
    for raw in lines:
        line = raw + b"\n"
        m = LINE_RE.fullmatch(line)
        if m:
            rank, stream, i = int(m.group(1)), m.group(3).decode(), int(m.group(4))
            if int(m.group(2)) != rank or line[len(b"[w%d]:" % rank):] != expected_line(rank, stream, i):
                bad.append(line)
            else:
                shown.setdefault((rank, stream), []).append(i)
            continue
        m = MARKER_RE.fullmatch(line)
        if m:
            value, unit = int(m.group(3)), UNITS[m.group(4)]
            path = m.group(5).decode() if m.group(5) is not None else None
            markers.append((int(m.group(1)), int(m.group(2)), (value * unit, (value + 1) * unit), path))
            continue
        bad.append(line)
    return Console(shown, markers, bad)


def check_console(console: Console, logs: dict, written: dict, episodes: int = 1) -> None:
    """logs: (rank, stream) -> log path; written: (rank, stream) -> lines
    written; episodes: how many times the console may have fallen behind
    and caught up (a marker line per stream each time)."""
    assert console.bad == [], f"{len(console.bad)} torn or unknown console lines, e.g. {console.bad[:3]}"
    by_path = {os.path.abspath(p): key for key, p in logs.items()}
    dropped: dict = {}
    dropped_by_rank: dict = {}
    for rank, count, (lo, hi), path in console.markers:
        assert count > 0
        # The size is that of the lines not shown (prefix included or not).
        prefix_len = len(b"[w%d]:" % rank)
        assert lo <= count * (LINE_LEN + prefix_len) and hi > count * LINE_LEN, (count, lo, hi)
        if path is not None:
            key = by_path.get(os.path.abspath(path))
            assert key is not None and key[0] == rank, f"marker of rank {rank} names {path}"
            assert episodes > 1 or key not in dropped, f"two marker lines for {key}"
            dropped[key] = dropped.get(key, 0) + count
        dropped_by_rank[rank] = dropped_by_rank.get(rank, 0) + count
    for key, total in written.items():
        nums = console.shown.get(key, [])
        assert all(a < b for a, b in zip(nums, nums[1:], strict=False)), f"{key}: lines repeated or out of order"
        assert all(0 <= i < total for i in nums)
    for rank in {k[0] for k in written}:
        keys = [k for k in written if k[0] == rank]
        shown = sum(len(console.shown.get(k, [])) for k in keys)
        total = sum(written[k] for k in keys)
        # A marker names every line that is not shown, and nothing more.
        assert shown + dropped_by_rank.get(rank, 0) == total, (
            f"rank {rank}: {shown} lines shown + {dropped_by_rank.get(rank, 0)} in marker lines "
            f"!= {total} written")
        if shown < total:
            assert dropped_by_rank.get(rank, 0) > 0, f"rank {rank} lost lines without a marker line"
    if dropped:  # markers name their log: the count per stream adds up too
        for key, total in written.items():
            assert len(console.shown.get(key, [])) + dropped.get(key, 0) == total, key


def check_logs(logs: dict, written: dict) -> None:
    for key, path in logs.items():
        data = Path(path).read_bytes()
        expected = expected_log(key[0], key[1], written[key])
        assert data == expected, f"{path}: {len(data)} bytes, expected {len(expected)}"


def report_logs(report: dict, streams: str, nranks: int) -> dict:
    logs = {(r, "out"): report["stdouts"][str(r)] for r in range(nranks)}
    if streams == "out,err":
        logs.update({(r, "err"): report["stderrs"][str(r)] for r in range(nranks)})
    return logs


# --- the tests ----------------------------------------------------------------


@pytest.mark.parametrize("streams,pty", [("out", False), ("out,err", False), ("out", True)],
                         ids=["stdout-pipe", "stdout-and-stderr-2>&1-pipe", "stdout-pty"])
def test_wait_returns_while_the_console_is_unread(stalled, tmp_path, streams, pty):
    lines = LINES if streams == "out" else LINES // 2
    launch = stalled(tmp_path, streams=streams, lines=lines, pty=pty)
    report = launch.wait_report()
    # The pipe is still unread: wait() returned anyway, in seconds.
    assert report["result"], "wait() returned None"
    assert report["took"] < WAIT_BOUND, f"wait() took {report['took']:.1f}s"
    assert report["failures"] == {}, report["failures"]
    # It really was stalled: lines were waiting for the console.
    assert report["pending"] > 0
    logs = report_logs(report, streams, NRANKS)
    written = {key: lines for key in logs}
    check_logs(logs, written)
    # The launcher is still there: it does not exit with the tail of the
    # console unshown.  Draining lets it finish.
    assert launch.proc.poll() is None, "the launcher exited with its console backlog unshown"
    console = parse_console(launch.drain())
    assert launch.finish() == 0, launch.stderr_text()
    # 8 MB through a full pipe and a 4 MiB backlog: the logs were the
    # backlog, so a console that was stalled for less than the stall time
    # gets every line.
    assert console.markers == []
    check_console(console, logs, written)
    if launch.stderr_path is not None:
        assert launch.stderr_text() == ""


def test_fail_fast_while_the_console_is_stalled(stalled, tmp_path):
    # Ranks 1..3 write 2 MB each (the console stalls), then sleep 60 s;
    # rank 0 then exits 1: wait() returns the failure promptly and the
    # sleepers are terminated.
    launch = stalled(tmp_path, mode="fail")
    report = launch.wait_report()
    assert report["result"]
    failed_at = float((launch.flags / "failed_at").read_text())
    assert report["returned_at"] - failed_at < WAIT_BOUND, (
        f"wait() returned {report['returned_at'] - failed_at:.1f}s after rank 0 failed")
    assert report["pending"] > 0, "the console was not stalled"
    failures = {int(k): v for k, v in report["failures"].items()}
    assert failures[0] == 1
    for rank in range(1, NRANKS):
        # Terminated by the fail-fast (or already gone): never a clean exit.
        assert failures.get(rank) == -signal.SIGTERM, failures
    pids = [int((launch.flags / f"pid.{r}").read_text()) for r in range(NRANKS)]
    assert wait_gone(pids, 5.0) == []
    logs = {(r, "out"): report["stdouts"][str(r)] for r in range(NRANKS)}
    written = {(0, "out"): 0, **{(r, "out"): LINES for r in range(1, NRANKS)}}
    check_logs(logs, written)
    assert launch.proc.poll() is None, "the launcher exited with its console backlog unshown"
    console = parse_console(launch.drain())
    assert launch.finish() == 0, launch.stderr_text()
    assert console.markers == []
    check_console(console, logs, written)
    assert "Traceback" not in launch.stderr_text()


def test_torchmp_run_with_an_unread_stdout_pipe(stalled, tmp_path):
    # torchmp run --tee 3 -n 2 -- python -c ...: stdout (the teed worker
    # lines) is a pipe nobody reads; stderr is a file.
    nranks = 2
    lines = 30000  # 3 MB per rank: 6 MB in all
    launch = stalled(tmp_path, nranks=nranks, lines=lines, cli=True)
    pid_files = [launch.flags / f"pid.{r}" for r in range(nranks)]
    deadline = time.monotonic() + HANG
    while not all(p.exists() and p.read_text() for p in pid_files):
        assert launch.proc.poll() is None, launch.stderr_text()
        assert time.monotonic() < deadline, "the workers did not start"
        time.sleep(0.01)
    pids = [int(p.read_text()) for p in pid_files]
    # The workers are not held back: they finish while stdout is unread
    # (a blocked I/O thread would leave them stuck on full tee pipes).
    assert wait_gone(pids, 10.0) == [], "the workers were held back by the stalled console"
    assert all((launch.flags / f"done.{r}").exists() for r in range(nranks))
    assert launch.proc.poll() is None, "torchmp run exited with its console backlog unshown"
    # The report goes to stderr, another console: it does not wait for the
    # stalled stdout (and its wall time is the job's, not the console's).
    deadline = time.monotonic() + 3.0
    while "summary of w:" not in launch.stderr_text():
        assert time.monotonic() < deadline, "the summary waited for the stalled stdout"
        time.sleep(0.02)
    took = re.search(r"summary of w: .*, (\d+\.\d+)s$", launch.stderr_text(), re.M)
    assert took and float(took.group(1)) < 3.0, launch.stderr_text()
    m = re.search(r"^torchmp: log directory: (.+)$", launch.stderr_text(), re.M)
    assert m, launch.stderr_text()
    attempt = Path(m.group(1))
    logs = {(r, "out"): str(attempt / str(r) / "stdout.log") for r in range(nranks)}
    written = {key: lines for key in logs}
    check_logs(logs, written)
    console = parse_console(launch.drain())
    code = launch.finish()
    err = launch.stderr_text()
    assert code == 0, err
    assert re.search(rf"^torchmp: summary of w: {nranks}/{nranks} ranks succeeded, exit code 0, ", err, re.M), err
    assert "Traceback" not in err
    assert console.markers == []
    check_console(console, logs, written)
    for r in range(nranks):
        assert (attempt / str(r) / "stderr.log").read_bytes() == b""


def test_a_slow_reader_gets_every_line(stalled, tmp_path):
    # The console is read from the start, but slower than the workers write
    # (64 KiB every 10 ms): it falls behind the 4 MiB backlog again and
    # again.  It is alive, only slow: it gets every line, whole, in order,
    # once (the logs are the backlog), and no marker.
    launch = stalled(tmp_path)
    console = parse_console(launch.drain(nap=0.01, size=64 * 1024))
    assert launch.finish() == 0, launch.stderr_text()
    report = launch.wait_report(timeout=0)
    assert report["result"] and report["failures"] == {}
    logs = report_logs(report, "out", NRANKS)
    written = {key: LINES for key in logs}
    check_logs(logs, written)
    assert console.markers == []
    check_console(console, logs, written)


@pytest.mark.parametrize("streams", ["out", "out,err"], ids=["stdout-pipe", "stdout-and-stderr-2>&1-pipe"])
def test_a_console_that_takes_nothing_for_the_stall_time_has_lines_left_out(stalled, tmp_path, streams):
    # The same unread pipe, but the launcher's stall time is 0.3 s and the
    # test reads nothing for 1.5 s after wait() returned: the console made
    # no progress at all.  When it is read again it gets the lines it held,
    # then one marker per stream for the whole lines it was not given, then
    # whatever came later -- never a torn line, and the counts add up.
    lines = LINES if streams == "out" else LINES // 2
    launch = stalled(tmp_path, streams=streams, lines=lines, env={"TORCHMP_CONSOLE_STALL": "0.3"}, hold=True)
    report = launch.wait_report()
    assert report["result"] and report["failures"] == {}
    assert report["pending"] > 0
    time.sleep(1.5)
    # The launcher may exit now: its exit waits only while the console moves
    # (0.3 s without progress: it gives up), so the test reads at once.
    (tmp_path / "hold").touch()
    console = parse_console(launch.drain())
    assert launch.finish() == 0, launch.stderr_text()
    logs = report_logs(report, streams, NRANKS)
    written = {key: lines for key in logs}
    check_logs(logs, written)
    assert console.markers, "a console that took nothing for 1.5 s (stall time 0.3 s) had nothing left out"
    check_console(console, logs, written)


def frame_into_unread_pipe(prefix: bytes, chunks: list, before: bytes = b"", **kwargs) -> tuple[bool, int, bytes]:
    """The console the I/O thread uses, fed by hand (_core.frame) into a
    pipe that nobody reads while it runs (and that holds ``before`` from
    another writer): (whether frame() blocked, the bytes it left waiting,
    what the pipe then holds after ``before``)."""
    import threading

    r, w = os.pipe()
    result: list = []
    try:
        if before:
            os.write(w, before)
        thread = threading.Thread(target=lambda: result.append(_core.frame(w, prefix, chunks, **kwargs)),
                                  daemon=True)
        thread.start()
        thread.join(10)
        blocked = thread.is_alive()
        os.set_blocking(r, False)
        got = b""
        while True:
            try:
                chunk = os.read(r, 1 << 20)
            except BlockingIOError:
                if not thread.is_alive():
                    break
                time.sleep(0.01)  # unblock an old-style blocking framer
                continue
            if not chunk:
                break
            got += chunk
        thread.join(10)
    finally:
        os.close(w)
        os.close(r)
    assert got.startswith(before)
    return blocked, result[0] if result else -1, got[len(before):]


@pytest.mark.parametrize("backlog", [0, 10000, None], ids=["backlog-0", "backlog-10000", "default-backlog"])
def test_framer_into_a_pipe_nobody_reads_returns_at_once(backlog):
    # 2000 lines (132 KB) into a pipe that holds 64 KiB and is never read.
    # It must not block; what waits stays within the bound; the pipe holds
    # the start of the console, in order.
    lines = [b"line %05d " % i + b"y" * 50 + b"\n" for i in range(2000)]
    prefix = b"[p]:"
    expected = b"".join(prefix + line for line in lines)
    kwargs = {} if backlog is None else {"backlog": backlog}
    blocked, left, got = frame_into_unread_pipe(prefix, [b"".join(lines[:700]), 0.5, b"".join(lines[700:])],
                                                **kwargs)
    assert not blocked, "the framer blocked on a pipe nobody reads"
    bound = _core.DEFAULT_CONSOLE_BACKLOG if backlog is None else backlog
    # The bound, plus the rest of a line the pipe took the start of, plus
    # a marker line queued once the backlog had nothing else.
    assert 0 < left <= bound + len(prefix) + len(lines[0]) + 200
    assert expected.startswith(got) and len(got) > 0
    assert len(got) + left <= len(expected)


@pytest.mark.parametrize("filled", [0, 1000, 60001], ids=["empty", "1000-bytes-in", "60001-bytes-in"])
def test_a_full_pipe_console_holds_only_whole_lines(filled):
    # A pipe console takes whole lines or nothing: once nobody reads it,
    # what it holds ends at a line end.  A write that the full pipe cut in
    # the middle of a line left that line torn for good when the launcher
    # exited with its console still stalled, and let any other writer of
    # the pipe (the launcher's own messages, a worker sharing its stderr)
    # land inside it.  The lines (67 bytes with the prefix) do not divide
    # the pipe's size, and the pipe may already hold another writer's bytes.
    # The framer batches lines as the I/O thread does (a scratch buffer).
    lines = [b"line %05d " % i + b"z" * 51 + b"\n" for i in range(3000)]
    prefix = b"[p]:"
    expected = b"".join(prefix + line for line in lines)
    other = b"o" * (filled - 1) + b"\n" if filled else b""
    blocked, left, shown = frame_into_unread_pipe(
        prefix, [b"".join(lines[:1500]), 0.2, b"".join(lines[1500:])], before=other, scratch=1 << 16)
    assert not blocked, "the framer blocked on a pipe nobody reads"
    assert len(shown) > 0 and expected.startswith(shown)
    assert shown.endswith(b"\n"), f"the pipe console ends in a torn line: {shown[-80:]!r}"
    assert left > 0
