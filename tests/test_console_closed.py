"""A closed console is not an error (``torchmp run``).

The reader of ``torchmp run``'s output goes away (``torchmp run ... | head
-1``: writes fail with EPIPE) or its terminal does (a pty whose master side
is closed: writes fail with EIO).  Neither may kill the launcher, change its
exit status or cut the log files short: the console is dropped, the workers
run on, and the exit status is the srun-style one a healthy console gets.

Every launch carries a unique ``TORCHMP_TEST_TAG`` that its workers inherit;
cleanup kills leftovers by that tag and by the launcher's process group
(never by name), even when a test fails.
"""
from __future__ import annotations

import os
import select
import sys
import time
from pathlib import Path

import pytest

from helpers import Launcher, Launchers

NPROC = 3
LINES = 3000  # per rank and stream: ~150 KB per console, more than a pipe holds
FAILING_RANK, FAILING_CODE = 1, 3

# What the remaining console must not show.
NOISE = ("Traceback", "Exception ignored", "Logging error", "BrokenPipeError", "Errno")


def worker_script(tmp: Path, fail: bool) -> str:
    """Each rank writes a first line, waits for ``go`` (the console is closed
    by then), then writes LINES lines to each stream.  With ``fail``, rank 1
    exits 3 once the others have written everything (so every log file is
    complete whatever the fail-fast does)."""
    others = " ".join(str(r) for r in range(NPROC) if r != FAILING_RANK)
    script = (
        'echo "start $RANK"; '
        f"while [ ! -e {tmp}/go ]; do sleep 0.005; done; "
        f'for i in $(seq {LINES}); do echo "out $RANK $i"; echo "err $RANK $i" >&2; done; '
    )
    if fail:
        script += (
            f'if [ "$RANK" = {FAILING_RANK} ]; then '
            f"for r in {others}; do while [ ! -e {tmp}/done.$r ]; do sleep 0.005; done; done; "
            f"exit {FAILING_CODE}; fi; "
        )
    script += f"touch {tmp}/done.$RANK"
    return script


def expected_log(rank: int, stream: str) -> bytes:
    head = f"start {rank}\n" if stream == "out" else ""
    return (head + "".join(f"{stream} {rank} {i}\n" for i in range(1, LINES + 1))).encode()


@pytest.fixture
def torchmp_run():
    """Start ``python -m torchmp run ARGS`` with the given stdout/stderr (a
    Launcher, in a session of its own: a pty it writes to is never its
    controlling terminal).  Its stdout is block-buffered on a pipe as users
    have it (a PYTHONUNBUFFERED test runner would hide what is left in a
    buffer for the interpreter's last flush).  Stopped at the end of the
    test by tag and process group, which then checks nothing is left."""
    unset = ("TORCHELASTIC_SIGNALS_TO_HANDLE", "PYTHONUNBUFFERED")
    with Launchers(trailing_pathsep=True, unset=unset) as launchers:
        def start(*args: str, stdout: int, stderr: int) -> Launcher:
            return launchers.start([sys.executable, "-m", "torchmp", "run", *args], stdout=stdout, stderr=stderr)

        yield start
    assert launchers.left() == []


class Launch:
    """One ``torchmp run -n NPROC --tee 3 -- sh -c WORKER`` and its log dir."""

    def __init__(self, launcher: Launcher, log_dir: Path) -> None:
        self.launcher, self.proc, self.log_dir = launcher, launcher.proc, log_dir

    def wait(self, timeout: float = 60) -> int:
        return self.launcher.wait(timeout, f"torchmp run did not finish in {timeout}s")

    def attempt_dir(self) -> Path:
        [run_dir] = self.log_dir.iterdir()
        return run_dir / "attempt_0"

    def check_logs_complete(self) -> None:
        attempt = self.attempt_dir()
        for rank in range(NPROC):
            for stream in ("out", "err"):
                path = attempt / str(rank) / f"std{stream}.log"
                data = path.read_bytes()
                assert data == expected_log(rank, stream), (
                    f"{path}: {len(data)} bytes, expected {len(expected_log(rank, stream))}")


@pytest.fixture
def launches(torchmp_run):
    def start(tmp: Path, fail: bool, stdout: int, stderr: int) -> Launch:
        log_dir = tmp / "logs"
        launcher = torchmp_run("-n", str(NPROC), "--tee", "3", "--log-dir", str(log_dir),
                               "--", "sh", "-c", worker_script(tmp, fail), stdout=stdout, stderr=stderr)
        return Launch(launcher, log_dir)

    return start


def read_a_line(fd: int, timeout: float = 30) -> bytes:
    """Read from fd until a newline (or EOF/EIO), like ``head -1``."""
    data = b""
    deadline = time.monotonic() + timeout
    while b"\n" not in data:
        left = deadline - time.monotonic()
        assert left > 0, f"no line in {timeout}s: {data!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: a pty's slave side closed
            break
        if not chunk:
            break
        data += chunk
    return data


def healthy_exit_code(tmp: Path, launches, fail: bool) -> int:
    """The exit status with a console that reads everything (files)."""
    tmp.mkdir()
    (tmp / "go").touch()
    with open(tmp / "out", "wb") as out, open(tmp / "err", "wb") as err:
        launch = launches(tmp, fail, out.fileno(), err.fileno())
        code = launch.wait()
    launch.check_logs_complete()
    err_text = (tmp / "err").read_text(errors="replace")
    assert not any(n in err_text for n in NOISE), err_text
    return code


def expected_exit_code(tmp_path: Path, launches, fail: bool) -> int:
    if not fail:
        return 0
    code = healthy_exit_code(tmp_path / "healthy", launches, fail)
    assert code == FAILING_CODE  # srun's rule: the root-cause rank's exit code
    return code


@pytest.mark.parametrize("fail", [False, True], ids=["all-exit-0", "rank-1-exits-3"])
@pytest.mark.parametrize("closed", ["both", "stdout", "stderr"])
def test_reader_that_goes_away(launches, tmp_path, closed, fail):
    # torchmp run ... | head -1, with stdout, stderr or both into the pipe;
    # the other stream (if any) goes to a file that must show no traceback.
    expected = expected_exit_code(tmp_path, launches, fail)
    tmp = tmp_path / "closed"
    tmp.mkdir()
    rest_path = tmp / "remaining"
    r, w = os.pipe()
    try:
        with open(rest_path, "wb") as rest:
            streams = {"both": (w, w), "stdout": (w, rest.fileno()),
                       "stderr": (rest.fileno(), w)}[closed]
            launch = launches(tmp, fail, *streams)
        os.close(w)
        w = -1
        first = read_a_line(r)
        assert first, "torchmp run wrote nothing"
    finally:
        if w >= 0:
            os.close(w)
        os.close(r)  # the reader goes away: from now on writes fail with EPIPE
    (tmp / "go").touch()

    code = launch.wait()
    rest = rest_path.read_text(errors="replace")
    assert code == expected, rest
    launch.check_logs_complete()
    assert not any(n in rest for n in NOISE), rest
    if closed == "stdout":  # the summary still reaches stderr, with the same code
        assert f"ranks succeeded, exit code {expected}, " in rest, rest
    elif closed == "stderr":  # every worker line still reaches stdout
        assert sorted(rest.splitlines()) == sorted(
            f"[sh{r}]:{line}" for r in range(NPROC)
            for line in expected_log(r, "out").decode().splitlines())


@pytest.mark.parametrize("fail", [False, True], ids=["all-exit-0", "rank-1-exits-3"])
def test_terminal_that_goes_away(launches, tmp_path, fail):
    # stdout and stderr are a pty's slave side; the master is closed after a
    # first line, so every later write fails with EIO.  The pty is not the
    # launcher's controlling terminal (a session of its own, and the fds
    # are inherited, never opened), so no SIGHUP is involved.
    expected = expected_exit_code(tmp_path, launches, fail)
    tmp = tmp_path / "closed"
    tmp.mkdir()
    master, slave = os.openpty()
    try:
        try:
            launch = launches(tmp, fail, slave, slave)
        finally:
            os.close(slave)
        first = read_a_line(master)
        assert first.startswith(b"torchmp: log directory: "), first
        with open(f"/proc/{launch.proc.pid}/stat", "rb") as f:
            tty_nr = int(f.read().rsplit(b")", 1)[1].split()[4])
        assert tty_nr == 0, "the pty became the launcher's controlling terminal"
    finally:
        os.close(master)  # the terminal goes away: writes fail with EIO
    (tmp / "go").touch()

    code = launch.wait()
    assert code == expected
    launch.check_logs_complete()


def test_log_handler_with_a_closed_console(capsys, monkeypatch):
    # The handler torchmp run installs, on a stderr whose reader is gone:
    # the records are lost, nothing else -- no "--- Logging error ---", no
    # traceback, no exception.
    import io
    import logging

    from torchmp import _console

    r, w = os.pipe()
    os.close(r)
    stream = io.TextIOWrapper(io.FileIO(w, "w"), line_buffering=True)
    monkeypatch.setattr(sys, "stderr", stream)
    try:
        handler = _console.ConsoleHandler()
        handler.setFormatter(logging.Formatter("torchmp: %(message)s"))
        for message in ("Sending process 1 closing signal SIGTERM", "and more"):
            handler.handle(logging.LogRecord("torchmp.api", logging.WARNING, __file__, 1, message, None, None))
    finally:
        monkeypatch.undo()
        try:
            stream.close()
        except BrokenPipeError:
            pass  # what the failed writes left in its buffer
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""


@pytest.mark.parametrize("closed,args,code", [
    ("stdout", ["--help"], 0),
    ("stderr", ["-n", "0", "--", "true"], 2),  # bad usage
])
def test_exit_flush_finds_nothing_to_fail_on(torchmp_run, tmp_path, closed, args, code):
    # argparse swallows a failed write (or, on a block-buffered stdout, never
    # makes one): what is left in the buffer used to fail the interpreter's
    # last flush, which printed "Exception ignored ... BrokenPipeError" and
    # turned the exit status into 120.
    r, w = os.pipe()
    os.close(r)
    try:
        with open(tmp_path / "rest", "wb") as rest:
            streams = (w, rest.fileno()) if closed == "stdout" else (rest.fileno(), w)
            returncode = torchmp_run(*args, stdout=streams[0], stderr=streams[1]).wait(20)
    finally:
        os.close(w)
    assert returncode == code
    assert (tmp_path / "rest").read_bytes() == b""
