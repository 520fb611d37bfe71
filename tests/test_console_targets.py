"""Where teed lines go: the console torch users get, and no console at all.

* ``sys.stdout`` / ``sys.stderr`` replaced by the program (a notebook kernel,
  ``contextlib.redirect_stdout``, a captured run): teed lines go to that
  object, in order and complete by the time ``wait()`` returns.  When the
  object is the process's own fd 1 / 2, lines go straight to the fd.
* A launcher started with fd 1 or 2 closed (``cmd 2>&-``, a daemon): the
  closed fd is occupied with /dev/null before any log is opened, so no log
  file takes fd 2 and is mistaken for the console; logs stay exact.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
import threading
import textwrap
from pathlib import Path

import pytest
from helpers import stop_launcher

import torchmp
from torchmp.api import DefaultLogsSpecs, Std

RANKS = 3
LINES = 200


def _writer(rank: int, stream: str = "stdout") -> tuple[str, ...]:
    code = (f"import sys\nfor i in range({LINES}): sys.{stream}.write('r{rank} l%04d\\n' % i)\n"
            f"sys.{stream}.write('r{rank} tail')")
    return ("-c", code)


def _expected(rank: int) -> list[str]:
    return [f"r{rank} l{i:04d}" for i in range(LINES)] + [f"r{rank} tail"]


def _run(tmp_path: Path, tee: Std, stream: str = "stdout") -> torchmp.api.RunProcsResult:
    specs = DefaultLogsSpecs(log_dir=str(tmp_path / "logs"), tee=tee)
    ctx = torchmp.start_processes("obj", sys.executable, {r: _writer(r, stream) for r in range(RANKS)},
                                  {r: {} for r in range(RANKS)}, specs)
    try:
        result = ctx.wait(30)
    finally:
        ctx.close()
    assert result is not None and not result.is_failed()
    return result


def _check_console(text: str) -> None:
    per_rank: dict[int, list[str]] = {r: [] for r in range(RANKS)}
    for line in text.splitlines():
        assert line.startswith("[obj"), f"console line without a rank prefix: {line!r}"
        rank = int(line[4:line.index("]")])
        per_rank[rank].append(line[line.index(":") + 1:])
    for rank in range(RANKS):
        assert per_rank[rank] == _expected(rank)  # in order, complete, the tail included


def _check_logs(result: torchmp.api.RunProcsResult, stream: str = "stdout") -> None:
    paths = result.stdouts if stream == "stdout" else result.stderrs
    for rank in range(RANKS):
        want = "".join(f"r{rank} l{i:04d}\n" for i in range(LINES)) + f"r{rank} tail"
        assert Path(paths[rank]).read_text() == want


def test_redirect_stdout_to_stringio_gets_the_teed_lines(tmp_path):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        result = _run(tmp_path, Std.OUT)
        got = buf.getvalue()  # as wait() returned, before anything else ran
    _check_console(got)
    _check_logs(result)


def test_redirect_stderr_to_stringio_gets_the_teed_lines(tmp_path):
    buf = io.StringIO()
    with contextlib.redirect_stderr(buf):
        result = _run(tmp_path, Std.ERR, "stderr")
        got = buf.getvalue()
    _check_console(got)
    _check_logs(result, "stderr")


def test_an_object_whose_fileno_is_another_file(tmp_path):
    path = tmp_path / "console.txt"
    with open(path, "w") as f, contextlib.redirect_stdout(f):
        print("before the launch", flush=False)  # buffered in the object: must come first
        result = _run(tmp_path, Std.OUT)
        print("after the launch")
    text = path.read_text()
    assert text.startswith("before the launch\n") and text.endswith("after the launch\n")
    _check_console(text[len("before the launch\n"):-len("after the launch\n")])
    _check_logs(result)


class _Collector:
    """A file-like object with write() only (no fileno, no flush, no buffer)."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.threads: set[str] = set()

    def write(self, text: str) -> int:
        self.parts.append(text)
        self.threads.add(threading.current_thread().name)
        return len(text)


def test_an_object_without_fileno(tmp_path):
    sink = _Collector()
    with contextlib.redirect_stdout(sink):
        result = _run(tmp_path, Std.OUT)
    _check_console("".join(sink.parts))
    _check_logs(result)
    # Every part is whole lines: an object never sees half a line.
    assert all(part.endswith("\n") for part in sink.parts)


def test_the_process_fd_1_keeps_the_direct_path(tmp_path, capfdbinary, monkeypatch):
    # sys.stdout is the process's own fd 1 (pytest's capture replaced fd 1
    # itself, so the bytes land in capfdbinary): no forwarding thread.
    monkeypatch.setattr(sys, "stdout", sys.__stdout__)
    capfdbinary.readouterr()
    before = {t.name for t in threading.enumerate()}
    specs = DefaultLogsSpecs(log_dir=str(tmp_path / "logs"), tee=Std.OUT)
    ctx = torchmp.start_processes("obj", sys.executable, {r: _writer(r) for r in range(RANKS)},
                                  {r: {} for r in range(RANKS)}, specs)
    try:
        assert "torchmp-console" not in {t.name for t in threading.enumerate()} - before
        assert ctx._forwarder is None  # nothing between the I/O thread and fd 1
        result = ctx.wait(30)
    finally:
        ctx.close()
    assert result is not None and not result.is_failed()
    out, _ = capfdbinary.readouterr()
    _check_console(out.decode())
    _check_logs(result)


def test_the_forwarding_thread_writes_while_the_launcher_sleeps(tmp_path):
    # A notebook user does not call wait() at once: the lines still arrive.
    sink = _Collector()
    code = "import sys, time\nprint('early', flush=True)\ntime.sleep(30)"
    specs = DefaultLogsSpecs(log_dir=str(tmp_path / "logs"), tee=Std.OUT)
    with contextlib.redirect_stdout(sink):
        ctx = torchmp.start_processes("obj", sys.executable, {0: ("-c", code)}, {0: {}}, specs)
    try:
        for _ in range(200):
            if "".join(sink.parts):
                break
            threading.Event().wait(0.05)
        assert "".join(sink.parts) == "[obj0]:early\n"
        assert sink.threads == {"torchmp-console"}
    finally:
        ctx.close(timeout=1)
    # close() of the last context with an object console ends the thread
    # before it returns: nothing of ours keeps running behind the caller.
    assert "torchmp-console" not in {t.name for t in threading.enumerate()}


# -- standard fds closed at start ---------------------------------------------------

_LAUNCHER = textwrap.dedent("""
    import os, sys
    import torchmp
    from torchmp.api import DefaultLogsSpecs, Std
    code = ("import sys\\nfor i in range(50):\\n"
            " sys.stdout.write('out %d %d\\\\n' % (R, i)); sys.stderr.write('err %d %d\\\\n' % (R, i))")
    args = {r: ("-c", code.replace("R", str(r))) for r in range(3)}
    specs = DefaultLogsSpecs(log_dir=sys.argv[1], tee=Std.ALL)
    ctx = torchmp.start_processes("cl", sys.executable, args, {r: {} for r in range(3)}, specs)
    result = ctx.wait(30)
    ctx.close()
    with open(sys.argv[2], "w") as f:
        f.write(repr((result.is_failed(), result.stdouts, result.stderrs,
                      os.readlink("/proc/self/fd/1") if os.path.exists("/proc/self/fd/1") else None,
                      os.readlink("/proc/self/fd/2") if os.path.exists("/proc/self/fd/2") else None)))
""")


@pytest.mark.parametrize("closed", ["2", "1", "1 2"])
def test_closed_std_fds_at_start_keep_the_logs_exact(tmp_path, closed):
    script = tmp_path / "launcher.py"
    script.write_text(_LAUNCHER)
    report = tmp_path / "report"
    console = tmp_path / "console"
    redirs = " ".join(f"{fd}>&-" for fd in closed.split())
    # The console file takes the std fd that stays open, if one does.
    open_fds = [fd for fd in ("1", "2") if fd not in closed.split()]
    keep = open_fds[0] if open_fds else None
    cmd = f'exec "$0" "$1" "$2" "$3" {keep + ">" + chr(34) + "$4" + chr(34) if keep else ""} {redirs}'
    proc = subprocess.Popen(["sh", "-c", cmd, sys.executable, str(script), str(tmp_path / "logs"), str(report),
                             str(console)], start_new_session=True)
    try:
        assert proc.wait(60) == 0
    finally:
        stop_launcher(proc)
    failed, stdouts, stderrs, fd1, fd2 = eval(report.read_text())
    assert not failed
    for rank in range(3):
        assert Path(stdouts[rank]).read_text() == "".join(f"out {rank} {i}\n" for i in range(50))
        assert Path(stderrs[rank]).read_text() == "".join(f"err {rank} {i}\n" for i in range(50))
    for fd, target in (("1", fd1), ("2", fd2)):
        if fd in closed.split():
            assert target == "/dev/null"  # occupied, not a log file
    if keep is None:
        return
    # The open console got exactly its own stream's lines, prefixed.
    stream = "out" if keep == "1" else "err"
    lines = console.read_text().splitlines()
    assert sorted(lines) == sorted(f"[cl{r}]:{stream} {r} {i}" for r in range(3) for i in range(50))


@pytest.mark.parametrize("closed", ["1", "2"])
def test_torchmp_run_with_a_closed_std_fd(tmp_path, closed):
    keep = "2" if closed == "1" else "1"
    console = tmp_path / "console"
    logs = tmp_path / "logs"
    cmd = f'exec "$0" -m torchmp run -n 3 --log-dir "$1" --no-summary -- sh -c "echo out; echo err >&2" ' \
          f'{keep}>"$2" {closed}>&-'
    # cwd: not the source tree, whose torchmp/ (without its built core, in an
    # installed run) would shadow the installed one for python -m.
    proc = subprocess.Popen(["sh", "-c", cmd, sys.executable, str(logs), str(console)], start_new_session=True,
                            cwd=str(tmp_path))
    try:
        assert proc.wait(60) == 0
    finally:
        stop_launcher(proc)
    for rank in range(3):
        (out,) = logs.glob(f"*/attempt_0/{rank}/stdout.log")
        (err,) = logs.glob(f"*/attempt_0/{rank}/stderr.log")
        assert out.read_text() == "out\n" and err.read_text() == "err\n"
    lines = console.read_text().splitlines()
    stream = "out" if keep == "1" else "err"
    assert sorted(line for line in lines if line.startswith("[sh")) == [f"[sh{r}]:{stream}" for r in range(3)]


def test_object_writes_are_cut_at_line_ends():
    # What an object console gets per write(): whole lines, at most a piece
    # long, but a line longer than a piece whole; the rest at the end.
    from torchmp import _core

    assert _core.line_cuts(b"ab\ncd\nef\n", 6) == [6, 9]
    assert _core.line_cuts(b"ab\ncd\nef\n", 4) == [3, 6, 9]
    assert _core.line_cuts(b"abcdefgh\nx\n", 3) == [9, 11]   # the long line whole
    assert _core.line_cuts(b"ab\nno newline", 5) == [3, 13]  # a tail without one
    assert _core.line_cuts(b"", 5) == []
