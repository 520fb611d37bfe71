"""Partial lines and progress bars on the console.

The rules (csrc/torchmp.h, framer.c), checked through ``_core.frame`` with
the test's own clock (a number in the chunks moves it on by that many
seconds and runs the time rules):

* a partial line (no newline yet) is shown, prefixed and with a newline
  added, once its oldest byte is 0.1 s old, not before; its continuation
  starts a new console line;
* a line with a carriage return that something follows is a progress bar:
  its current state (what follows the last \\r) is shown once 0.1 s old,
  then at most once a second per stream, and the line's final state at its
  newline always (once); a bar that ends its updates with \\r ("10%\\r")
  becomes one once the \\r is 0.1 s old with no newline after it;
* CRLF lines are shown unchanged; the console shows what a terminal would
  show of each line, the log file keeps every byte.

Then real launches (the launcher in a subprocess, its stdout a file): a
``Loading...`` partial line is on the console while the worker still
sleeps; a tqdm-like bar gives a handful of console lines; ``torchmp run
--timestamps`` stamps partial and progress lines too.

Every launch carries a unique ``TORCHMP_TEST_TAG`` that its workers inherit;
cleanup kills leftovers by that tag and by the launcher's process group
(never by name), even when a test fails.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, example, given, settings, strategies as st

from torchmp import _core

from helpers import Launcher, Launchers
from test_fuzz import model_framer, model_lines

P = b"[p]:"


def frame(chunks, prefix: bytes = P, **kwargs) -> bytes:
    """The console bytes the framer shows for chunks (bytes, or seconds the
    clock moves on); the console (a memfd) takes everything."""
    fd = os.memfd_create("console", os.MFD_CLOEXEC)
    try:
        left = _core.frame(fd, prefix, list(chunks), **kwargs)
        assert left == 0, "a memfd console kept a backlog"
        size = os.lseek(fd, 0, os.SEEK_CUR)
        return os.pread(fd, size, 0) if size else b""
    finally:
        os.close(fd)


def contents(out: bytes, prefix: bytes = P) -> list[bytes]:
    """The console lines without prefix and newline (each must have both)."""
    assert out == b"" or out.endswith(b"\n"), out
    lines = out.split(b"\n")[:-1]
    for line in lines:
        assert line.startswith(prefix), line
    return [line[len(prefix):] for line in lines]


def settings_(n: int) -> settings:
    return settings(max_examples=n, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


# --- partial lines -----------------------------------------------------------------


def test_partial_line_is_shown_once_its_oldest_byte_is_a_tenth_of_a_second_old():
    # Not before: the rest of the line arrives within 0.1 s, one line.
    assert frame([b"Loading...", 0.099, b" done\n"]) == b"[p]:Loading... done\n"
    assert frame([b"Loading...", 0.05, 0.04, b" done\n"]) == b"[p]:Loading... done\n"
    # At 0.1 s it is shown, with a newline added; the continuation starts a
    # console line of its own.
    assert frame([b"Loading...", 0.1, b" done\n"]) == b"[p]:Loading...\n[p]: done\n"
    assert frame([b"Loading...", 5.0, b" done\n"]) == b"[p]:Loading...\n[p]: done\n"
    # The oldest byte counts, not the newest: bytes keep arriving, the line
    # is still shown 0.1 s after it began.
    assert frame([b"Load", 0.06, b"ing...", 0.06, b" done\n"]) == b"[p]:Loading...\n[p]: done\n"


def test_continuations_each_start_a_new_console_line():
    assert frame([b"abc", 0.2, b"def", 0.2, b"ghi\n"]) == b"[p]:abc\n[p]:def\n[p]:ghi\n"
    assert frame([b"abc", 0.2, b"def\nxyz\n"]) == b"[p]:abc\n[p]:def\n[p]:xyz\n"
    # A prompt that is never finished is shown once, not again at the end.
    assert frame([b"(Pdb) ", 0.3]) == b"[p]:(Pdb) \n"
    # Nothing is lost or doubled by the time rules.
    assert frame([b"a", 0.2, b"b", 0.05, b"c", 0.2, b"d\n", b"e\n"]) == b"[p]:a\n[p]:bc\n[p]:d\n[p]:e\n"


# Found by this file: the newline of a partial line already shown came out
# as an extra empty console line.
def test_a_bare_newline_after_a_shown_partial_line_adds_no_empty_line():
    # print("Loading...", end="", flush=True); time.sleep(1); print()
    # A terminal shows "Loading..." and moves on; the console should not
    # show an empty "[p]:" line for the newline that ends it.
    assert frame([b"Loading...", 0.2, b"\n", b"next\n"]) == b"[p]:Loading...\n[p]:next\n"


def test_the_time_rules_do_not_change_a_line_that_arrives_whole():
    assert frame([b"one\n", 3.0, b"two\n", 0.5]) == b"[p]:one\n[p]:two\n"


# --- progress bars ---------------------------------------------------------------------


def test_progress_updates_are_rate_limited_and_the_final_state_shown_once():
    chunks: list = []
    for i in range(50):  # 50 updates, one every 0.1 s: 5 s
        chunks += [b"\r%d%%" % i, 0.1]
    chunks.append(b"\n")
    shown = contents(frame(chunks))
    # Once 0.1 s old, then at most once a second, then the final state.
    assert 2 <= len(shown) <= 6, shown
    assert shown[0] == b"0%"
    assert shown[-1] == b"49%" and shown.count(b"49%") == 1
    values = [int(s[:-1]) for s in shown]
    assert values == sorted(set(values))


def test_progress_final_state_at_the_newline():
    # Shown by the clock, nothing changed since: not shown again.
    assert frame([b"\r5%", 0.2, b"\n"]) == b"[p]:5%\n"
    assert frame([b"\r5%", 0.2, b"\r", 1.5, b"\n"]) == b"[p]:5%\n"
    # Changed since: the final state follows.
    assert frame([b"\r5%", 0.2, b"\r6%\n"]) == b"[p]:5%\n[p]:6%\n"
    # Never shown by the clock: only the final state.
    assert frame([b"\r1%\r2%\r3%", 0.05, b"\n"]) == b"[p]:3%\n"
    # The rate limit is per stream, across lines.
    out = contents(frame([b"\r1", 0.2, b"\r2", 0.2, b"\n", b"\r3", 0.2, b"\r4", 0.2, b"\n"]))
    assert out == [b"1", b"2", b"4"]


# Found by this file: a redraw of the state already shown (tqdm's close()
# redraws the bar before its newline) counted as a change.
def test_a_redraw_of_the_state_already_shown_is_not_shown_again():
    assert frame([b"\r5%", 0.2, b"\r5%", b"\n"]) == b"[p]:5%\n"


def test_bars_that_end_each_update_with_a_carriage_return():
    # "10%\r" with nothing after it for 0.1 s: a progress bar, shown without
    # waiting for a newline ...
    shown = contents(frame([b"10%\r", 0.1, b"20%\r", 0.1, b"30%\r", 0.1, b"\n"]))
    assert shown[0] == b"10%" and shown[-1] in (b"30%", b"30%\r") and len(shown) == 2
    # ... and its final state at the newline once (the \r only overwrote).
    assert frame([b"10%\r", 0.1, b"\n"]) == b"[p]:10%\n"
    # Within 0.1 s a newline makes it a CRLF line: unchanged.
    assert frame([b"10%\r", 0.05, b"\n"]) == b"[p]:10%\r\n"
    # Not before 0.1 s; and then as a bar whose state is the latest one.
    assert frame([b"10%\r", 0.09, b"\n"]) == b"[p]:10%\r\n"
    assert frame([b"10%\r", 0.09, b"20%\r", 0.09, b"\n"]) == b"[p]:20%\n"


def test_crlf_lines_are_unchanged():
    data = b"a\r\nbb\r\n\r\nccc\r\n"
    expected = b"[p]:a\r\n[p]:bb\r\n[p]:\r\n[p]:ccc\r\n"
    assert frame([data]) == expected
    assert frame([bytes([b]) for b in data]) == expected
    assert frame([b"a\r\n", 0.5, b"bb\r", 0.05, b"\n\r\n", 2.0, b"ccc\r\n", 1.0]) == expected
    # What a terminal shows: text after the last interior carriage return.
    assert frame([b"abc\rxy\r\n"]) == b"[p]:xy\r\n"


def test_timestamps_on_partial_and_progress_lines():
    out = contents(frame([b"Loading", 0.2, b"\r5%", 0.2, b"\r6%\n"], timestamps=True))
    assert len(out) == 3
    for line, text in zip(out, (b"Loading", b"5%", b"6%"), strict=True):
        assert re.fullmatch(rb"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z " + re.escape(text), line), line


# --- properties ------------------------------------------------------------------------

STEPS = st.sampled_from([0.0, 0.01, 0.05, 0.0999, 0.1, 0.1001, 0.3, 0.99, 1.0, 2.5])
_BYTES = st.lists(st.sampled_from([b"a", b"b", b"\r", b"\n", b"\xff", b"\x00", b"ok\r\n"]),
                  min_size=1, max_size=10).map(b"".join)
_PREFIXES = st.binary(max_size=6).filter(lambda p: b"\n" not in p)


def _data(chunks) -> bytes:
    return b"".join(c for c in chunks if isinstance(c, bytes))


@settings_(400)
@given(chunks=st.lists(st.one_of(_BYTES, STEPS), max_size=25), prefix=_PREFIXES,
       max_line=st.one_of(st.just(256 * 1024), st.integers(1, 24)), scratch=st.sampled_from([0, 7, 4096]))
def test_every_console_line_is_prefixed_and_shows_what_a_terminal_would(chunks, prefix, max_line, scratch):
    out = frame(chunks, prefix, max_line=max_line, scratch=scratch)
    for content in contents(out, prefix):
        # Interior carriage returns were applied (a trailing run is kept).
        assert b"\r" not in content.rstrip(b"\r"), content
        assert len(content) <= max_line
    if not _data(chunks):
        assert out == b""


@settings_(400)
@given(chunks=st.lists(st.one_of(_BYTES, st.just(0.0)), max_size=25), prefix=_PREFIXES,
       max_line=st.one_of(st.just(256 * 1024), st.integers(1, 24)))
@example(chunks=[b"a\rb", 0.0, b"c\r", 0.0, b"\n"], prefix=P, max_line=256 * 1024)
def test_with_the_clock_standing_still_the_console_is_the_model(chunks, prefix, max_line):
    data = _data(chunks)
    out = frame(chunks, prefix, max_line=max_line)
    assert out == model_framer(prefix, data, max_line)
    if max_line == 256 * 1024:
        assert out == model_lines(prefix, data)


_PLAIN = st.lists(st.sampled_from([b"a", b"bc", b"\n", b"\xff", b"\x00", b"xyz\n"]),
                  min_size=1, max_size=8).map(b"".join)


@settings_(400)
@given(chunks=st.lists(st.one_of(_PLAIN, STEPS), max_size=30),
       max_line=st.one_of(st.just(256 * 1024), st.integers(1, 16)))
def test_without_carriage_returns_the_time_rules_only_add_line_breaks(chunks, max_line):
    # Whatever the clock does: every byte is shown once and in order; the
    # only difference is where console lines break.
    data = _data(chunks)
    out = frame(chunks, max_line=max_line)
    shown = contents(out)
    assert b"".join(shown) == data.replace(b"\n", b"")
    assert all(len(c) <= max_line for c in shown)
    # Breaks come from newlines, full pieces, the clock (at most one per
    # chunk of bytes) and the end.
    breaks = data.count(b"\n") + len(data) // max_line + sum(isinstance(c, bytes) for c in chunks) + 1
    assert len(shown) <= breaks


@st.composite
def _progress_input(draw):
    """Lines that are progress bars from their first byte: updates "\\rS<k>"
    and "\\rT<k>\\r" (a bar that ends its updates with \\r), each state
    unique; newlines, cuts between reads, and clock steps."""
    ops = draw(st.lists(st.one_of(st.sampled_from(["upd", "upd", "upd", "crend", "nl", "cut"]), STEPS, STEPS),
                        min_size=4, max_size=80))
    chunks: list = []
    lines: list[list[bytes]] = [[]]
    pending = b""
    for k, op in enumerate(ops):
        if isinstance(op, float):
            if pending:
                chunks.append(pending)
                pending = b""
            chunks.append(op)
        elif op == "cut":
            if pending:
                chunks.append(pending)
                pending = b""
        elif op == "nl":
            pending += b"\n"
            lines.append([])
        elif op == "upd":
            pending += b"\rS%d" % k
            lines[-1].append(b"S%d" % k)
        else:
            pending += b"\rT%d\r" % k
            lines[-1].append(b"T%d" % k)
    if pending:
        chunks.append(pending)
    return chunks, lines


@settings_(500)
@given(inp=_progress_input())
@example(inp=([b"\rS0", 0.1, b"\rS1", 0.1, b"\rS2", 2.5, b"\rS3\n"], [[b"S0", b"S1", b"S2", b"S3"], []]))
def test_progress_lines_per_stream_are_bounded_by_the_clock(inp):
    chunks, lines = inp
    elapsed = sum(c for c in chunks if isinstance(c, float))
    shown = contents(frame(chunks))
    # lines[-1] is the unterminated last line (often empty).
    where = {state: (li, pos) for li, states in enumerate(lines) for pos, state in enumerate(states)}
    empty_lines = [li for li, states in enumerate(lines[:-1]) if not states]
    cur = (-1, -1)
    seen = set()
    for content in shown:
        if content == b"":
            nxt = [li for li in empty_lines if li > cur[0]]
            assert nxt, f"an empty console line with no empty line to show: {shown}"
            cur = (nxt[0], -1)
            seen.add(cur)
            continue
        state = content
        if content.endswith(b"\r"):  # a CRLF-looking final state: "\rT<k>\r\n"
            state = content[:-1]
            assert state.startswith(b"T"), content
        assert state in where, f"{content!r} is not a state that was written"
        pos = where[state]
        # In order, each state at most once, never one from a line before.
        assert pos > cur, f"{content!r} after {cur}: {shown}"
        cur = pos
        seen.add(pos)
    assert sum(1 for c in shown if c == b"") == len(empty_lines)
    finals = set()
    for li, states in enumerate(lines):
        if states:
            final = (li, len(states) - 1)
            finals.add(final)
            assert final in seen, f"line {li}: final state {states[-1]!r} not shown: {shown}"
    # Shown by the clock: at most once 0.1 s in, then once a second.
    by_clock = [p for p in seen if p[1] >= 0 and p not in finals]
    event(f"shown by the clock: {min(len(by_clock), 4)}")
    assert len(by_clock) <= 1 + math.floor(elapsed + 1e-9), (elapsed, shown)
    # The bound as stated: 1 + elapsed seconds + the lines (the last one
    # ends with the stream).
    progress_lines = sum(1 for c in shown if c != b"")
    assert progress_lines <= 1 + elapsed + len(lines)


# --- real launches ---------------------------------------------------------------------

# The launcher: one rank, stdout teed; a report (log path, exit codes) in a
# file; its own stdout (the console) is a file the test reads.
LAUNCHER = """
import json, os, sys
import torchmp
from torchmp import Std
P = json.loads({params!r})
ctx = torchmp.start_processes("w", sys.executable, {{0: ("-c", P["code"], *P["args"])}}, {{0: {{}}}},
                              torchmp.DefaultLogsSpecs(log_dir=P["log_dir"], tee=Std.OUT))
r = ctx.wait(30)
ctx.close()
with open(P["report"], "w") as f:
    json.dump({{"done": r is not None, "failures": {{str(k): v.exitcode for k, v in r.failures.items()}},
               "stdout": r.stdouts[0]}}, f)
"""


@dataclass
class Launched:
    """A launcher whose console (stdout) and stderr are files."""
    launcher: Launcher
    console: Path
    err: Path
    report: Path

    @property
    def proc(self) -> subprocess.Popen:
        return self.launcher.proc

    def finish(self, timeout: float = 30) -> int:
        return self.launcher.wait(timeout, f"the launcher did not finish in {timeout}s")


@pytest.fixture
def launcher(tmp_path):
    """start(code, *args) runs LAUNCHER; start(code, *args, cli=[...]) runs
    ``torchmp run CLI -- python -c code ARGS``.  Each launcher is stopped
    at the end of the test, by tag and process group, which then checks
    nothing is left."""
    launchers = Launchers()

    def start(code: str, *args: str, cli: list[str] | None = None) -> Launched:
        n = len(launchers.started)
        console, err, report = tmp_path / f"console{n}", tmp_path / f"err{n}", tmp_path / f"report{n}.json"
        log_dir = tmp_path / f"logs{n}"
        with open(console, "wb") as out, open(err, "wb") as errf:
            if cli is None:
                params = json.dumps({"code": code, "args": list(args), "log_dir": str(log_dir),
                                     "report": str(report)})
                # The library launches: TORCHELASTIC_SIGNALS_TO_HANDLE is left as it is.
                launched = launchers.python(LAUNCHER.format(params=params), stdout=out, stderr=errf, unset=())
            else:
                launched = launchers.start(
                    [sys.executable, "-m", "torchmp", "run", *cli, "--log-dir", str(log_dir), "--",
                     sys.executable, "-c", code, *args], stdout=out, stderr=errf)
        return Launched(launched, console, err, report)

    with launchers:
        yield start
    assert launchers.left() == []


LOADING = """
import sys, time
print("Loading...", end="", flush=True)
with open(sys.argv[1], "w") as f:
    f.write(repr(time.monotonic()))   # when "Loading..." was written
time.sleep(1)
print(" done")
"""


def test_loading_partial_line_is_on_the_console_while_the_worker_sleeps(launcher, tmp_path):
    flag = tmp_path / "printed"
    run = launcher(LOADING, str(flag))
    deadline = time.monotonic() + 20
    while not (flag.exists() and flag.read_text()):
        assert run.proc.poll() is None, run.err.read_text()
        assert time.monotonic() < deadline, "the worker did not start"
        time.sleep(0.005)
    printed_at = float(flag.read_text())
    # Half a second later at most (the rule says 0.1 s), well before the
    # worker wakes up at printed_at + 1 s.
    while b"[w0]:Loading...\n" not in run.console.read_bytes():
        assert time.monotonic() < printed_at + 0.6, (
            f"not on the console 0.6 s after it was written: {run.console.read_bytes()!r}")
        time.sleep(0.005)
    assert b"done" not in run.console.read_bytes()
    assert run.finish() == 0, run.err.read_text()
    report = json.loads(run.report.read_text())
    assert report["failures"] == {}
    assert run.console.read_bytes() == b"[w0]:Loading...\n[w0]: done\n"
    assert Path(report["stdout"]).read_bytes() == b"Loading... done\n"


TQDM_LIKE = """
import os, time
for i in range(30):
    os.write(1, b"\\r%d%%" % i)
    time.sleep(0.1)
os.write(1, b"\\n")
"""


def test_tqdm_like_bar_gives_a_handful_of_console_lines(launcher):
    run = launcher(TQDM_LIKE)
    assert run.finish() == 0, run.err.read_text()
    report = json.loads(run.report.read_text())
    assert report["failures"] == {}
    assert Path(report["stdout"]).read_bytes() == b"".join(b"\r%d%%" % i for i in range(30)) + b"\n"
    shown = contents(run.console.read_bytes(), b"[w0]:")
    # 3 s of updates: shown at 0.1 s, then about once a second, then the
    # final state.
    assert 2 <= len(shown) <= 6, shown
    values = [int(re.fullmatch(rb"(\d+)%", s).group(1)) for s in shown]
    assert values == sorted(set(values)) and values[-1] == 29, shown


TIMESTAMPED = """
import os, time
os.write(1, b"Loading...")
time.sleep(0.5)
os.write(1, b" done\\n")
for i in range(10):
    os.write(1, b"\\r%d%%" % i)
    time.sleep(0.1)
os.write(1, b"\\n")
"""

TS = rb"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3})Z "


def test_torchmp_run_timestamps_partial_and_progress_lines(launcher, tmp_path):
    run = launcher(TIMESTAMPED, cli=["--timestamps", "--tee", "3", "-n", "1", "--name", "w", "--no-summary"])
    assert run.finish() == 0, run.err.read_text()
    lines = run.console.read_bytes().split(b"\n")
    assert lines.pop() == b""
    stamps, texts = [], []
    for line in lines:
        m = re.fullmatch(rb"\[w0\]:" + TS + rb"(.*)", line)
        assert m, line
        stamps.append(m.group(1))
        texts.append(m.group(2))
    assert texts[:2] == [b"Loading...", b" done"], texts
    progress = texts[2:]
    assert 1 <= len(progress) <= 4 and progress[-1] == b"9%", texts
    values = [int(t[:-1]) for t in progress]
    assert values == sorted(set(values))
    assert stamps == sorted(stamps)
    m = re.search(r"^torchmp: log directory: (.+)$", run.err.read_text(), re.M)
    assert m, run.err.read_text()
    log = Path(m.group(1)) / "0" / "stdout.log"
    assert log.read_bytes() == b"Loading... done\n" + b"".join(b"\r%d%%" % i for i in range(10)) + b"\n"
