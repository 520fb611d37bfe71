"""Odd consoles, and what a context leaves behind.

* A ``sys.stdout`` whose ``write()`` raises: an ``EAGAIN`` once is retried
  and every line still shown; a batch it refuses is left out with a marker
  per stream, the console stays on for every rank, the first failure is
  logged once.
* A ``write()`` that calls ``ctx.close()``: no deadlock.
* ``os.fork()`` in a launcher with an object console: the children exit at
  once (no lock copied while held) and say nothing about the parent's
  contexts.
* A ``sys.stdout.write`` wrapped in place (as experiment trackers do): the
  wrapper sees the teed lines.
* ``torchmp run > /dev/full``: said once on stderr and in the summary.
* ``close()`` closes every descriptor the context opened: 300 cycles with
  object consoles and the garbage collector off leave the fd count flat.
"""
from __future__ import annotations

import contextlib
import errno
import gc
import json
import logging
import os
import re
import sys
import time

import pytest

from torchmp import Std

from helpers import Launchers, launch

RANKS = 3
LINES = 300


def _writer(rank: int) -> tuple[str, ...]:
    code = (f"import os\nfor i in range({LINES}): os.write(1, b'r{rank} l%04d\\n' % i)\n")
    return ("-c", code)


class FlakyConsole:
    """A text console whose write() raises `failure` on the calls numbered
    in `failing` (counting from 0)."""

    def __init__(self, failure: BaseException, failing: set[int]) -> None:
        self.failure = failure
        self.failing = failing
        self.calls = 0
        self.parts: list[str] = []

    def write(self, text: str) -> int:
        call = self.calls
        self.calls += 1
        if call in self.failing:
            raise self.failure
        self.parts.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def _run_into(sink, tmp_path, **kw):
    with contextlib.redirect_stdout(sink):
        ctx = launch(sys.executable, {r: _writer(r) for r in range(RANKS)}, log_dir=tmp_path / "logs",
                     tee=Std.OUT, name="f", **kw)
        try:
            result = ctx.wait(30)
        finally:
            ctx.close()
    assert result is not None and not result.is_failed()
    return result


def _shown(text: str) -> dict[int, list[int]]:
    shown: dict[int, list[int]] = {r: [] for r in range(RANKS)}
    for m in re.finditer(r"^\[f(\d)\]:r(\d) l(\d{4})$", text, re.M):
        assert m[1] == m[2]
        shown[int(m[1])].append(int(m[3]))
    return shown


def test_a_write_that_raises_eagain_once_is_retried(tmp_path):
    sink = FlakyConsole(BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable", 0), {0})
    _run_into(sink, tmp_path)
    text = "".join(sink.parts)
    assert "not shown" not in text
    # Every rank's every line: the console stayed on.
    assert _shown(text) == {r: list(range(LINES)) for r in range(RANKS)}


def test_a_batch_the_console_refuses_is_left_out_with_a_marker(tmp_path, caplog):
    # The first two writes raise (the first batch, tried again, fails again
    # with something that is not worth a retry): its lines are counted in a
    # marker per stream; the console stays on; one warning.
    sink = FlakyConsole(ValueError("I/O operation on closed file"), {0, 1})
    caplog.set_level(logging.WARNING, logger="torchmp")
    result = _run_into(sink, tmp_path, console_backlog=4096)
    text = "".join(sink.parts)
    shown = _shown(text)
    markers = re.findall(r"^\[f(\d)\]:torchmp: (\d+) lines? \(.*\) not shown: writing to sys.stdout failed; "
                         r"complete log: (.+)$", text, re.M)
    assert markers, text[:2000]
    left_out = {r: 0 for r in range(RANKS)}
    for rank, count, path in markers:
        assert path == result.stdouts[int(rank)]
        left_out[int(rank)] += int(count)
    for rank in range(RANKS):
        assert shown[rank] == sorted(shown[rank])
        assert len(shown[rank]) + left_out[rank] == LINES, (rank, len(shown[rank]), left_out[rank])
    assert any(shown[r] for r in range(RANKS)), "the console did not stay on"
    warnings = [r for r in caplog.records if "writing teed lines to sys.stdout failed" in r.getMessage()]
    assert len(warnings) == 1


CLOSE_IN_WRITE = """
import json, sys, threading
import torchmp
from torchmp import Std

class CloseOnWrite:
    def __init__(self):
        self.parts = []
        self.closed_it = False
    def write(self, text):
        self.parts.append(text)
        # The first write once start_processes has returned: the lines that
        # come before it does may be written before ctx exists.
        if ctx is not None and not self.closed_it:
            self.closed_it = True
            ctx.close()          # from inside the console's write()
            ctx.wait(5)
        return len(text)
    def flush(self):
        pass

sink = CloseOnWrite()
real = sys.stdout
sys.stdout = sink
ctx = None
# A burst, then a line every 10 ms until close() stops it: a write comes
# after start_processes has returned, however late that is.
code = ("import os, time\\nfor i in range(2000): os.write(1, b'line %d\\\\n' % i)\\n"
        "while True:\\n    os.write(1, b'tick\\\\n')\\n    time.sleep(0.01)")
ctx = torchmp.start_processes("c", sys.executable, {r: ("-c", code) for r in range(2)}, {r: {} for r in range(2)},
                              torchmp.DefaultLogsSpecs(log_dir=sys.argv[1], tee=Std.OUT))
result = ctx.wait(60)
ctx.close()
sys.stdout = real
print(json.dumps({"result": result is not None, "parts": len(sink.parts), "closed_in_write": sink.closed_it}))
"""


def test_a_write_that_closes_the_context_does_not_deadlock(tmp_path):
    with Launchers() as launchers:
        run = launchers.python(CLOSE_IN_WRITE, str(tmp_path / "logs"))
        code, out, err = run.communicate(30)
    assert launchers.left() == []
    assert code == 0, err
    report = json.loads(out.splitlines()[-1])
    assert report["result"] and report["parts"] >= 1 and report["closed_in_write"]


FORK_WITH_OBJECT_CONSOLE = """
import io, json, os, sys, time
import torchmp
from torchmp import Std

class Slowish(io.StringIO):
    def write(self, text):
        time.sleep(0.0005)
        return super().write(text)

real = sys.stdout
sys.stdout = Slowish()
code = "import os\\nwhile True: os.write(1, b'x' * 99 + b'\\\\n')"
ctx = torchmp.start_processes("k", sys.executable, {r: ("-c", code) for r in range(2)}, {r: {} for r in range(2)},
                              torchmp.DefaultLogsSpecs(log_dir=sys.argv[1], tee=Std.OUT))
hung = 0
for i in range(30):
    pid = os.fork()
    if pid == 0:
        sys.exit(0)
    deadline = time.monotonic() + 5
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            hung += 1
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            break
        time.sleep(0.005)
    time.sleep(0.01)
ctx.close()
sys.stdout = real
print(json.dumps({"hung": hung}))
"""


def test_fork_with_an_object_console(tmp_path):
    with Launchers() as launchers:
        run = launchers.python(FORK_WITH_OBJECT_CONSOLE, str(tmp_path / "logs"))
        code, out, err = run.communicate(240)
    assert launchers.left() == []
    assert code == 0, err
    assert json.loads(out.splitlines()[-1]) == {"hung": 0}
    # The children had no context of theirs to close at their exit.
    assert "at exit failed" not in err and "Traceback" not in err, err[-2000:]


WRAPPED_WRITE = """
import json, sys
import torchmp
from torchmp import Std

seen = []
original = sys.stdout.write
def tracking_write(text):
    seen.append(text)
    return original(text)
sys.stdout.write = tracking_write   # an experiment tracker's capture
code = "import os\\nfor i in range(100): os.write(1, b'line %d\\\\n' % i)"
ctx = torchmp.start_processes("t", sys.executable, {r: ("-c", code) for r in range(2)}, {r: {} for r in range(2)},
                              torchmp.DefaultLogsSpecs(log_dir=sys.argv[1], tee=Std.OUT))
ctx.wait(30)
ctx.close()
captured = "".join(seen)
sys.stderr.write(json.dumps({r: [int(l.split()[-1]) for l in captured.splitlines() if l.startswith("[t%d]:" % r)]
                             for r in range(2)}) + "\\n")
"""


def test_a_wrapped_stdout_write_sees_the_teed_lines(tmp_path):
    with Launchers() as launchers:
        run = launchers.python(WRAPPED_WRITE, str(tmp_path / "logs"))
        code, out, err = run.communicate(30)
    assert launchers.left() == []
    assert code == 0, err
    seen = json.loads(err.splitlines()[-1])
    assert seen == {"0": list(range(100)), "1": list(range(100))}
    # ... and the lines still reach the real stdout, once.
    assert sorted(out.splitlines()) == sorted(f"[t{r}]:line {i}" for r in range(2) for i in range(100))


def test_torchmp_run_into_a_full_file_system_says_so(tmp_path):
    # /dev/full: every write fails with ENOSPC, like a file on a full disk.
    worker = "import os; [os.write(1, b'line %d\\n' % i) for i in range(1000)]"
    with Launchers(unset=("TORCHELASTIC_SIGNALS_TO_HANDLE", "PYTHONUNBUFFERED")) as launchers:
        with open("/dev/full", "wb") as full, open(tmp_path / "err", "wb") as err:
            run = launchers.start([sys.executable, "-m", "torchmp", "run", "--tee", "3", "-n", "2", "--log-dir",
                                   str(tmp_path / "logs"), "--", sys.executable, "-c", worker],
                                  stdout=full, stderr=err)
        code = run.wait(30)
    assert launchers.left() == []
    text = (tmp_path / "err").read_text()
    assert code == 0, text
    said = [line for line in text.splitlines()
            if line.startswith("torchmp: the console (stdout) could not be written:")]
    assert said == ["torchmp: the console (stdout) could not be written: No space left on device; "
                    "it is off for the rest of the run (the log files are complete)"], text
    summary = text[text.index("torchmp: summary of"):]
    assert ("torchmp: the console (stdout) could not be written (No space left on device) and was off "
            "from then on; the log files are complete") in summary, text
    for rank in range(2):
        logs = list((tmp_path / "logs").glob(f"*/attempt_0/{rank}/stdout.log"))
        assert len(logs) == 1 and logs[0].read_text().count("\n") == 1000


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.no_leak_guard
def test_close_closes_every_descriptor_without_the_garbage_collector(tmp_path, monkeypatch):
    out = open(tmp_path / "stdout", "w")
    err = open(tmp_path / "stderr", "w")
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    gc.collect()
    gc.disable()
    try:
        base = None
        for cycle in range(300):
            ctx = launch("/bin/echo", {0: ("a",), 1: ("b",)}, log_dir=tmp_path / "logs" / str(cycle), tee=Std.ALL)
            ctx.wait(30)
            ctx.close()
            if cycle == 20:  # warmed up (the I/O thread, the forwarding machinery)
                time.sleep(0.2)
                base = _fds()
        # Released groups are freed by the I/O thread a moment after close().
        deadline = time.monotonic() + 10
        while _fds() > base and time.monotonic() < deadline:
            time.sleep(0.02)
        after = _fds()
    finally:
        gc.enable()
        monkeypatch.undo()
        out.close()
        err.close()
    assert after <= base, f"{base} fds after 20 cycles, {after} after 300"


@pytest.fixture(autouse=True)
def _fresh_env(monkeypatch):
    monkeypatch.delenv("TORCHMP_CONSOLE_STALL", raising=False)
    monkeypatch.delenv("TORCHMP_CONSOLE_EXIT_WAIT", raising=False)

