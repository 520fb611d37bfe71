"""The log is the console's backlog: a console that is slower than the
workers, or stops for a while, gets every line once it takes lines again.

* A slow Python object as ``sys.stdout`` (4 ranks writing as fast as they
  can, a console at 20 MB/s, a 256 KiB bound): every line, whole, in order
  per rank, exactly once, no marker, all of it written when ``wait()``
  returns.
* Lines held back while the console was stuck come out as the live path
  would have shown them: their timestamps are when they arrived, a partial
  line that sat alone for more than 0.1 s is a line of its own.
* A line whose writer stopped right after filling the pipe (as one stopped
  or starved inside a long write() does) comes out whole, live and held
  back: not cut where the writer stopped.
* A log that is gone while lines are held back: the lines it held are left
  out whole, with a marker, and the console goes on.
* Memory stays within the bound while a console takes nothing at all.

(The slow and stalled pipes are in test_console_stall.py.)
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import textwrap
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from torchmp import Std

from helpers import Launchers, launch

RANKS = 4


class SlowConsole:
    """A text console that takes `rate` bytes a second, and can be held
    (its write() waits until released)."""

    def __init__(self, rate: float = 20e6) -> None:
        self.rate = rate
        self.parts: list[str] = []
        self.open = threading.Event()
        self.open.set()

    def write(self, text: str) -> int:
        self.open.wait()
        time.sleep(len(text) / self.rate)
        self.parts.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def text(self) -> str:
        return "".join(self.parts)


def _writer_code(lines: int) -> str:
    # Numbered 100-byte lines in 64 KB writes, as fast as the pipe takes them.
    return textwrap.dedent(f"""
        import os, sys
        r = int(sys.argv[1])
        data = b"".join(b"r%d %07d " % (r, i) + b"x" * 88 + b"\\n" for i in range({lines}))
        for a in range(0, len(data), 65536):
            view = memoryview(data)[a:a + 65536]
            while view:
                view = view[os.write(1, view):]
    """)


LINE = re.compile(r"\[c(\d)\]:r(\d) (\d{7}) x{88}")


def test_a_slow_object_console_gets_every_line(tmp_path):
    lines = 40000  # 4 MB per rank, 16 MB in all: 0.8 s at the console's pace
    sink = SlowConsole()
    with contextlib.redirect_stdout(sink):
        ctx = launch(sys.executable, {r: ("-c", _writer_code(lines), str(r)) for r in range(RANKS)},
                     log_dir=tmp_path / "logs", tee=Std.OUT, name="c", console_backlog=256 * 1024)
        try:
            result = ctx.wait(120)
            got = sink.text()  # all of it by the time wait() returns
        finally:
            ctx.close()
    assert result is not None and not result.is_failed()
    seen: dict[int, list[int]] = {r: [] for r in range(RANKS)}
    bad = []
    for line in got.splitlines():
        m = LINE.fullmatch(line)
        if m is None or m[1] != m[2]:
            bad.append(line)
            continue
        seen[int(m[1])].append(int(m[3]))
    assert bad == [], f"{len(bad)} lines that are not whole worker lines, e.g. {bad[:3]}"
    for rank in range(RANKS):
        assert seen[rank] == list(range(lines)), (
            f"rank {rank}: {len(seen[rank])} of {lines} lines, in order: {seen[rank] == sorted(seen[rank])}")
    for rank in range(RANKS):
        assert Path(result.stdouts[rank]).stat().st_size == lines * 100


FILLS = 900  # 900 lines of 72 bytes: 64,800 bytes

HELD_WORKER = textwrap.dedent("""
    import os, sys, time
    FILLS = @FILLS@
    WROTE = open(@WROTE@, "w")
    def out(b, name=None):
        if name:  # when it was written, for the test to check its time against
            WROTE.write("%s %r\\n" % (name, time.time()))
            WROTE.flush()
        os.write(1, b)
    # Past the 16 KiB bound, in one write an empty pipe (64 KiB) takes
    # whole: a write larger than the pipe would be read in pieces, and a
    # line cut at a piece's end is rightly shown as a partial line if the
    # writer is kept from the rest for 0.1 s (a loaded machine).
    out(b"".join(b"fill %05d " % i + b"y" * 60 + b"\\n" for i in range(FILLS)))
    out(b"line A\\n", "A")
    time.sleep(1.0)
    out(b"line B\\n", "B")
    out(b"part C", "C")       # alone for 0.3 s: shown as a line of its own
    time.sleep(0.3)
    out(b" and D\\n", "D")
    out(b"tail without a newline")
""").replace("@FILLS@", str(FILLS))

TS = r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3})Z "


def _ts(text: str, what: str) -> float:
    m = re.search(r"^\[h0\]:" + TS + re.escape(what) + "$", text, re.M)
    assert m, f"no console line {what!r} in {text[-500:]!r}"
    return datetime.strptime(m[1], "%Y-%m-%dT%H:%M:%S.%f").replace(tzinfo=timezone.utc).timestamp()


def _one_rank_to(sink: SlowConsole, code: str, log_dir: Path, name: str, release_after: float, **kwargs):
    """One rank of Python `code`, its stdout teed to `sink` as sys.stdout
    (bound 16 KiB), the sink let go `release_after` s on; its result."""
    release = threading.Timer(release_after, sink.open.set)
    with contextlib.redirect_stdout(sink):
        ctx = launch(sys.executable, {0: ("-c", code)}, log_dir=log_dir, tee=Std.OUT, name=name,
                     console_backlog=16 * 1024, **kwargs)
        release.start()
        try:
            return ctx.wait(60)
        finally:
            release.cancel()
            sink.open.set()
            ctx.close()


def test_held_back_lines_come_out_as_the_live_path_shows_them(tmp_path):
    # The console is stuck (its write() waits) from the first line on, and
    # let go 2.5 s later, after the worker exited: everything but what fit
    # in the 16 KiB bound was held back and comes from the log.
    sink = SlowConsole(rate=1e9)
    sink.open.clear()
    wrote_path = tmp_path / "wrote"
    result = _one_rank_to(sink, HELD_WORKER.replace("@WROTE@", repr(str(wrote_path))), tmp_path / "logs", "h", 2.5,
                          log_line_timestamps=True)
    assert result is not None and not result.is_failed()
    text = sink.text()
    assert "not shown" not in text
    fills = re.findall(r"^\[h0\]:" + TS + r"fill (\d{5}) y{60}$", text, re.M)
    assert [int(n) for _, n in fills] == list(range(FILLS))
    # The times are the arrival times, not when the console got the lines
    # (2.5 s on): each at or after the worker's write (the stamps have
    # milliseconds), and soon after it.  Its rest carries its own arrival
    # time, 0.3 s after the partial's.  (0.25 s: an I/O thread on a loaded
    # machine, an ASan build beside other jobs, reads late; one read line B
    # 75 ms after its write.)
    wrote = {name: float(when) for name, when in (line.split() for line in wrote_path.read_text().splitlines())}
    for what, name in (("line A", "A"), ("line B", "B"), (" and D", "D")):
        late = _ts(text, what) - wrote[name]
        assert -0.002 <= late < 0.25, (what, late)
    # The partial line was alone for 0.3 s: shown as a line of its own 0.1 s
    # after it came.
    part_c = _ts(text, "part C") - wrote["C"]
    assert 0.098 <= part_c < 0.35 and _ts(text, "part C") < _ts(text, " and D"), part_c
    assert text.endswith("tail without a newline\n")
    assert Path(result.stdouts[0]).read_bytes().endswith(b"line A\nline B\npart C and D\ntail without a newline")


# A writer that stops right after a write() that filled the pipe, as one
# stopped (SIGSTOP) or starved inside a longer write() does: the launcher
# reads a full pipe, then nothing for 0.3 s, then another full pipe, then
# (50 ms later) the rest of the line.  The pipe is made 32 KiB first: the launcher grows
# only pipes it reads 64 KiB from at once, so the size stays the one the
# writer fills, and the line stays shorter than the 256 KiB pieces that
# every longer line is cut into.
FULL_PIPE_PAUSE = textwrap.dedent("""
    import array, fcntl, os, termios, time
    cap = fcntl.fcntl(1, fcntl.F_SETPIPE_SZ, 32768)

    def fill(data):
        # Into the empty pipe, exactly its size: one read takes it all.
        left = array.array("i", [0])
        while fcntl.ioctl(1, termios.FIONREAD, left) == 0 and left[0] > 0:
            time.sleep(0.001)
        assert len(data) == cap == fcntl.fcntl(1, fcntl.F_GETPIPE_SZ)
        os.write(1, data)

    os.write(1, b"".join(b"%099d\\n" % i for i in range(1000)))  # more than the console takes
    fill(b"before\\n" + b"L" * (cap - 7))
    time.sleep(0.3)
    fill(b"L" * cap)
    time.sleep(0.05)
    os.write(1, b"L" * 1000 + b"\\n" + b"after\\n")
""")


@pytest.mark.parametrize("held", [False, True], ids=["live", "held-back"])
def test_a_line_whose_writer_stopped_after_filling_the_pipe_comes_out_whole(tmp_path, held):
    # Live, and held back (the console stuck from the start: past the first
    # 16 KiB, the lines are framed later from the log at the times their
    # bytes came): the line comes out whole, not cut where the writer
    # stopped.
    sink = SlowConsole(rate=1e9)
    if held:
        sink.open.clear()  # let go 1.5 s on, after the worker's 0.3 s
    result = _one_rank_to(sink, FULL_PIPE_PAUSE, tmp_path / "logs", "s", 1.5)
    assert result is not None and not result.is_failed()
    log = Path(result.stdouts[0]).read_bytes()
    numbered = b"".join(b"%099d\n" % i for i in range(1000))
    line = b"L" * (2 * 32768 - 7 + 1000)
    assert log == numbered + b"before\n" + line + b"\nafter\n"
    assert sink.text() == "".join(f"[s0]:{x}\n" for x in log.decode().split("\n")[:-1])


LOST_WORKER = textwrap.dedent("""
    import os, sys, time
    for i in range(4000):
        os.write(1, b"before %05d " % i + b"z" * 60 + b"\\n")
    open(sys.argv[1], "w").close()       # tells the test: the log may go now
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.01)
    for i in range(100):
        os.write(1, b"after %05d\\n" % i)
""")


def test_a_log_that_is_gone_while_lines_are_held_back(tmp_path):
    # The lines held back are in the log; the log is removed (and another
    # file takes its name) before the console is let go: those lines cannot
    # come back.  They are left out whole, with a marker naming the log, and
    # the lines after them are shown.
    sink = SlowConsole(rate=1e9)
    sink.open.clear()
    written, removed = tmp_path / "written", tmp_path / "removed"
    with contextlib.redirect_stdout(sink):
        ctx = launch(sys.executable, {0: ("-c", LOST_WORKER, str(written), str(removed))},
                     log_dir=tmp_path / "logs", tee=Std.OUT, name="g", console_backlog=16 * 1024)
        try:
            deadline = time.monotonic() + 30
            log = Path(ctx.stdouts[0])
            # Every line written is in the log (the I/O thread can lag the
            # worker on a busy machine): only then is the log removed.
            while not written.exists() or log.stat().st_size < 4000 * 74:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            log.unlink()
            log.write_text("somebody else's file\n")
            sink.open.set()
            time.sleep(0.3)
            removed.touch()
            result = ctx.wait(60)
        finally:
            sink.open.set()
            ctx.close()
    assert result is not None and not result.is_failed()
    text = sink.text()
    shown = [int(n) for n in re.findall(r"^\[g0\]:before (\d{5}) z{60}$", text, re.M)]
    markers = re.findall(r"^\[g0\]:torchmp: (\d+) lines? \(.*\) not shown: the console fell behind; "
                         r"complete log: (.+)$", text, re.M)
    assert len(markers) == 1 and markers[0][1] == str(log)
    assert shown == list(range(len(shown))) and len(shown) + int(markers[0][0]) == 4000
    assert re.findall(r"^\[g0\]:after (\d{5})$", text, re.M) == [f"{i:05d}" for i in range(100)]
    assert all(line.startswith("[g0]:") for line in text.splitlines())


# The launcher of the memory test: 4 ranks of 50 MB each into a stdout pipe
# nobody reads; its peak RSS and wait() time go to a report file.
MEMORY_LAUNCHER = """
import json, os, sys, time
import torchmp
from torchmp import Std
def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
code, log_dir, report = sys.argv[1], sys.argv[2], sys.argv[3]
before = status("VmRSS")
t0 = time.monotonic()
ctx = torchmp.start_processes("m", sys.executable, {r: ("-c", code, str(r)) for r in range(4)},
                              {r: {} for r in range(4)}, torchmp.DefaultLogsSpecs(log_dir=log_dir, tee=Std.OUT),
                              console_backlog=1 << 20)
result = ctx.wait(120)
took = time.monotonic() - t0
with open(report, "w") as f:
    json.dump({"grew": status("VmHWM") - before, "took": took, "ok": not result.is_failed()}, f)
ctx.close()
os._exit(0)  # the console stays unread: no exit wait
"""


def test_memory_stays_within_the_bound_while_the_console_takes_nothing(tmp_path):
    r, w = os.pipe()
    report = tmp_path / "report.json"
    try:
        with Launchers() as launchers:
            run = launchers.python(MEMORY_LAUNCHER, _writer_code(500_000), str(tmp_path / "logs"), str(report),
                                   stdout=w, stderr=None)
            os.close(w)
            w = -1
            assert run.wait(120) == 0
        assert launchers.left() == []
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    facts = json.loads(report.read_text())
    assert facts["ok"]
    # 200 MB went through; the console held 1 MiB at most (plus a line, the
    # I/O thread's buffers and the arrival records).
    assert facts["grew"] < 24 << 20, facts
    assert facts["took"] < 60, facts


@pytest.fixture(autouse=True)
def _no_stall_env(monkeypatch):
    monkeypatch.delenv("TORCHMP_CONSOLE_STALL", raising=False)
    monkeypatch.delenv("TORCHMP_CONSOLE_EXIT_WAIT", raising=False)
