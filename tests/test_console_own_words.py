"""torchmp's own words (logging, the failure report, the summary) go through
the console the workers' lines go through: never blocking, never inside a
worker's line, never holding up a signal or the exit.

* Fail-fast with stderr a pipe nobody reads (8 ranks, library and CLI): the
  siblings get SIGTERM at once, not once somebody reads the pipe.
* ``torchmp run`` with a stalled stderr: every rank exits 0, and so does the
  launcher, once its stderr took nothing for the stall time.
* stdout and stderr on one slow pipe (``2>&1 | slow reader``): every line on
  it is a whole worker line or a whole line of torchmp's.

Every launcher runs in a session of its own and is stopped by tag and
process group at the end, pass or fail.
"""
from __future__ import annotations

import os
import re
import select
import sys
import textwrap
import time

import pytest

from helpers import Launchers

NRANKS = 8

# argv: rank, flag dir, nranks.  Ranks > 0 fill stderr (the unread pipe) with
# 100 KB each, say so, and wait for SIGTERM, noting when it came; rank 0
# fails once they all filled theirs, noting when.
FAILFAST_WORKER = textwrap.dedent("""
    import os, signal, sys, time
    rank, flags, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    def note(name):
        with open(os.path.join(flags, name + ".tmp"), "w") as f:
            f.write(repr(time.time()))
        os.rename(os.path.join(flags, name + ".tmp"), os.path.join(flags, name))
    if rank == 0:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(
                os.path.exists(os.path.join(flags, "filled.%d" % r)) for r in range(1, n)):
            time.sleep(0.01)
        time.sleep(0.2)  # the I/O thread has read it all
        note("failed")
        os._exit(1)
    signal.signal(signal.SIGTERM, lambda *_: (note("term.%d" % rank), os._exit(0)))
    line = b"r%d " % rank + b"e" * 96 + b"\\n"
    os.write(2, line * 1000)
    note("filled.%d" % rank)
    for _ in range(1200):  # short sleeps: see test_cli_signals.RANK
        time.sleep(0.05)
""")

LIBRARY_LAUNCHER = """
import sys
import torchmp
from torchmp import Std
worker, flags, n, log_dir = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
ctx = torchmp.start_processes("ff", sys.executable, {r: ("-c", worker, str(r), flags, str(n)) for r in range(n)},
                              {r: {} for r in range(n)}, torchmp.DefaultLogsSpecs(log_dir=log_dir, tee=Std.ALL))
result = ctx.wait(120)
ctx.close()
"""


def _drain(fd: int, timeout: float = 60.0, nap: float = 0.0, size: int = 1 << 20) -> bytes:
    """Read fd to EOF (nap: a pause before each read of up to size bytes)."""
    chunks = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if nap:
            time.sleep(nap)
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            chunk = os.read(fd, size)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    raise AssertionError("the console did not reach its end")


@pytest.mark.parametrize("how", ["library", "cli"])
def test_fail_fast_does_not_wait_for_an_unread_stderr(tmp_path, how):
    flags = tmp_path / "flags"
    flags.mkdir()
    r, w = os.pipe()
    try:
        with Launchers(unset=("TORCHELASTIC_SIGNALS_TO_HANDLE", "PYTHONUNBUFFERED")) as launchers:
            with open(tmp_path / "out", "wb") as out:
                if how == "library":
                    launcher = launchers.python(LIBRARY_LAUNCHER, FAILFAST_WORKER, str(flags), str(NRANKS),
                                                str(tmp_path / "logs"), stdout=out, stderr=w)
                else:
                    code = (f"import os, sys; sys.argv = ['w', os.environ['LOCAL_RANK'], {str(flags)!r}, "
                            f"'{NRANKS}']; exec(compile({FAILFAST_WORKER!r}, 'worker', 'exec'))")
                    launcher = launchers.start(
                        [sys.executable, "-m", "torchmp", "run", "--tee", "3", "-n", str(NRANKS), "--name", "ff",
                         "--log-dir", str(tmp_path / "logs"), "--", sys.executable, "-c", code],
                        stdout=out, stderr=w)
            os.close(w)
            w = -1
            deadline = time.monotonic() + 60
            while not (flags / "failed").exists():
                assert launcher.proc.poll() is None, "the launcher exited before rank 0 failed"
                assert time.monotonic() < deadline, "rank 0 never failed"
                time.sleep(0.01)
            failed_at = float((flags / "failed").read_text())
            # The pipe is still unread.  The siblings are told at once.
            deadline = time.monotonic() + 5
            terms = [flags / f"term.{rank}" for rank in range(1, NRANKS)]
            while not all(t.exists() for t in terms) and time.monotonic() < deadline:
                time.sleep(0.01)
            missing = [t.name for t in terms if not t.exists()]
            assert missing == [], f"{missing} got no SIGTERM within 5 s of the failure (stderr unread)"
            took = max(float(t.read_text()) for t in terms) - failed_at
            assert took < 2.0, f"the siblings got SIGTERM {took:.2f}s after rank 0 failed"
            err = _drain(r)
            code = launcher.wait(30)
        assert launchers.left() == []
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    assert code == (1 if how == "cli" else 0)
    text = err.decode(errors="replace")
    assert "Sending process" in text and "closing signal SIGTERM" in text
    for line in text.splitlines():
        # Whole worker lines, and torchmp's own lines apart from them.
        if not re.fullmatch(r"\[ff(\d)\]:r\1 e{96}", line):
            assert "eeeeeeee" not in line and not line.startswith("[ff"), line


STALLED_CLI_WORKER = textwrap.dedent("""
    import os
    line = b"rank %s " % os.environ["LOCAL_RANK"].encode() + b"e" * 90 + b"\\n"
    os.write(2, line * 2000)
""")


def test_torchmp_run_exits_although_its_stderr_is_stalled(tmp_path):
    # Every rank writes 200 KB to stderr (teed: the unread pipe fills) and
    # exits 0.  The summary cannot be shown; the launcher gives its console
    # the stall time (1 s here) and exits 0 anyway.
    r, w = os.pipe()
    try:
        with Launchers(unset=("TORCHELASTIC_SIGNALS_TO_HANDLE", "PYTHONUNBUFFERED")) as launchers:
            with open(tmp_path / "out", "wb") as out:
                launcher = launchers.start(
                    [sys.executable, "-m", "torchmp", "run", "--tee", "3", "-n", "4", "--log-dir",
                     str(tmp_path / "logs"), "--", sys.executable, "-c", STALLED_CLI_WORKER],
                    stdout=out, stderr=w, env={"TORCHMP_CONSOLE_STALL": "1", "TORCHMP_CONSOLE_EXIT_WAIT": "1"})
            os.close(w)
            w = -1
            code = launcher.wait(15, "torchmp run did not exit: it waited for its stalled stderr")
        assert launchers.left() == []
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    assert code == 0


# Ranks write 8 KB lines to stdout, fast; rank 3 fails after 2 MB, so the
# launcher logs fail-fast lines, the failure report and the summary while
# the console holds the rest of some worker line.
SHARED_WORKER = textwrap.dedent("""
    import os, sys, time
    rank = int(os.environ["LOCAL_RANK"])
    for i in range(10 ** 6):
        line = b"r%d %07d " % (rank, i)
        os.write(1, line + b"w" * (8191 - len(line)) + b"\\n")
        if rank == 3 and i == 250:
            sys.exit(3)
""")


def test_launcher_lines_never_land_inside_a_worker_line(tmp_path):
    # stdout and stderr are one pipe, read slowly (torchmp run ... 2>&1 |
    # slow reader): every line is a whole 8 KB worker line or one of the
    # launcher's own, never a mix.
    r, w = os.pipe()
    try:
        with Launchers(unset=("TORCHELASTIC_SIGNALS_TO_HANDLE", "PYTHONUNBUFFERED")) as launchers:
            launcher = launchers.start(
                [sys.executable, "-m", "torchmp", "run", "--tee", "3", "-n", "4", "--name", "s", "--log-dir",
                 str(tmp_path / "logs"), "--", sys.executable, "-c", SHARED_WORKER],
                stdout=w, stderr=w)
            os.close(w)
            w = -1
            data = _drain(r, timeout=120, nap=0.005, size=16 * 1024)
            code = launcher.wait(30)
        assert launchers.left() == []
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    assert code == 3
    assert data.endswith(b"\n")
    worker = re.compile(rb"\[s(\d)\]:r(\d) (\d{7}) w+")
    own = 0
    for line in data.split(b"\n")[:-1]:
        m = worker.fullmatch(line)
        if m is not None:
            assert m[1] == m[2] and len(line) == len(b"[s0]:") + 8191, line[:80]
            continue
        # Not a worker line: then it must not hold any piece of one.
        assert b"wwwwwwww" not in line and not re.search(rb"\[s\d\]:r\d \d{7}", line), (
            f"a launcher line and a worker line mixed: {line[:120]!r}...{line[-60:]!r}")
        own += 1
    assert own > 0
    text = data.decode(errors="replace")
    own_lines = [line for line in text.splitlines() if "wwwwwwww" not in line]
    assert "Sending process" in text and "summary of s:" in text and "Root Cause" in text, "\n".join(own_lines)


@pytest.fixture(autouse=True)
def _fresh_env(monkeypatch):
    monkeypatch.delenv("TORCHMP_CONSOLE_STALL", raising=False)
    monkeypatch.delenv("TORCHMP_CONSOLE_EXIT_WAIT", raising=False)

