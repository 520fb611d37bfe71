"""Redirect and tee: exact bytes in the log files, whole lines on the console."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from torchmp import Std, _core

from helpers import (LONG_LINE_BYTES, LONG_LINES, WORKERS, kill_groups, launch, read_pids, run_launcher,
                     shown_while_waiting, stop_inside_a_long_line, wait_gone)

NON_UTF8 = b"caf\xe9 \xff\xfe bytes\x00nul\r\n"


def printf_script(data: bytes) -> str:
    """A shell command that writes `data` exactly (printf with octal escapes)."""
    return "printf '" + "".join(f"\\{b:03o}" for b in data) + "'"


def test_redirect_writes_exact_bytes_including_non_utf8_and_no_final_newline(tmp_path):
    data_out = b"line one\n" + NON_UTF8 + b"last line without newline"
    data_err = b"\xf0\x28\x8c\x28 broken utf-8\n"
    ctx = launch("sh", {0: ("-c", printf_script(data_out) + "; " + printf_script(data_err) + " >&2")},
                 log_dir=tmp_path, redirects=Std.ALL)
    result = ctx.wait(30)
    ctx.close()
    assert Path(result.stdouts[0]).read_bytes() == data_out
    assert Path(result.stderrs[0]).read_bytes() == data_err


def test_tee_log_exact_and_console_prefixed(tmp_path, capfdbinary):
    data = b"alpha\n" + NON_UTF8 + b"tail-no-newline"
    ctx = launch("sh", {0: ("-c", printf_script(data)), 1: ("-c", printf_script(b"err line\n") + " >&2")},
                 log_dir=tmp_path, tee=Std.ALL)
    result = ctx.wait(30)
    ctx.close()
    out, err = capfdbinary.readouterr()
    assert Path(result.stdouts[0]).read_bytes() == data
    assert Path(result.stderrs[1]).read_bytes() == b"err line\n"
    # The console gets every line with its rank prefix; the final line with
    # no newline is printed (with one added) when the stream ends.
    expected = b"[trainer0]:alpha\n[trainer0]:" + NON_UTF8 + b"[trainer0]:tail-no-newline\n"
    assert out == expected
    assert err == b"[trainer1]:err line\n"


def test_custom_prefixes_and_ranks_filter(tmp_path, capfd):
    args = {r: ("-c", f"echo hello{r}") for r in range(3)}
    ctx = launch("sh", args, log_dir=tmp_path, tee=Std.OUT, local_ranks_filter={0, 2},
                 log_line_prefixes={2: "<two> "})
    result = ctx.wait(30)
    ctx.close()
    out, _ = capfd.readouterr()
    assert sorted(out.splitlines()) == sorted(["[trainer0]:hello0", "<two> hello2"])
    # Rank 1 is filtered from the console but its file is still written.
    assert Path(result.stdouts[1]).read_bytes() == b"hello1\n"


def test_duplicate_filters_write_matching_lines_with_prefix(tmp_path, capfd):
    args = {0: ("-c", "echo 'loss=1.0'; echo noise; echo 'ERROR bad' >&2; echo fine >&2"),
            1: ("-c", "echo 'loss=0.5'; echo more noise")}
    ctx = launch("sh", args, log_dir=tmp_path, tee=Std.ALL,
                 duplicate_stdout_filters=["loss="], duplicate_stderr_filters=["ERROR"])
    result = ctx.wait(30)
    ctx.close()
    capfd.readouterr()
    attempt_dir = Path(result.stdouts[0]).parent.parent
    filtered_out = (attempt_dir / "filtered_stdout.log").read_bytes().splitlines()
    assert sorted(filtered_out) == [b"[trainer0]:loss=1.0", b"[trainer1]:loss=0.5"]
    assert (attempt_dir / "filtered_stderr.log").read_bytes() == b"[trainer0]:ERROR bad\n"


@pytest.mark.slow
def test_many_teed_lines_are_never_torn_or_lost(tmp_path):
    nranks, count = 4, 20000
    console = tmp_path / "console.txt"
    script = f"""
        import sys
        import torchmp
        from torchmp import Std
        ctx = torchmp.start_processes(
            "trainer", sys.executable,
            {{r: ("{WORKERS / 'lines.py'}", r, {count}) for r in range({nranks})}},
            {{r: {{}} for r in range({nranks})}},
            torchmp.DefaultLogsSpecs(log_dir="{tmp_path}/logs", tee=Std.OUT))
        r = ctx.wait(120)
        ctx.close()
        assert not r.is_failed(), r.failures
        for rank in range({nranks}):
            print("LOG", rank, r.stdouts[rank], file=sys.stderr)
    """
    with open(console, "wb") as f:
        res = run_launcher(script, stdout=f, timeout=120)
    assert res.returncode == 0, res.stderr
    pad = "x" * 60
    seen = {r: [] for r in range(nranks)}
    torn = 0
    for line in console.read_text().splitlines():
        m = re.fullmatch(r"\[trainer(\d)\]:r(\d) (\d+) (x{60})", line)
        if not m or m.group(1) != m.group(2):
            torn += 1
            continue
        seen[int(m.group(1))].append(int(m.group(3)))
    assert torn == 0
    for r in range(nranks):
        assert seen[r] == list(range(count)), f"rank {r}: lines lost or reordered"
    logs = dict(line.split()[1:] for line in res.stderr.decode().splitlines() if line.startswith("LOG"))
    for r in range(nranks):
        expected = "".join(f"r{r} {i} {pad}\n" for i in range(count)).encode()
        assert Path(logs[str(r)]).read_bytes() == expected


def test_output_written_just_before_exit_is_there_when_wait_returns(tmp_path, capfd):
    # 100 KB more than a pipe holds, written right before exit.
    ctx = launch(sys.executable, {0: ("-c", "import os; os.write(1, b'y' * 200000 + b'\\nEND'); os._exit(3)")},
                 log_dir=tmp_path, tee=Std.OUT)
    result = ctx.wait(30)
    out, _ = capfd.readouterr()
    assert result.failures[0].exitcode == 3
    assert Path(result.stdouts[0]).read_bytes() == b"y" * 200000 + b"\nEND"
    assert out.endswith("[trainer0]:END\n")
    ctx.close()


def test_grandchild_holding_the_pipe_does_not_hang_wait(tmp_path, capfd):
    pidfile = tmp_path / "gc.pid"
    # The worker starts a grandchild that inherits stdout and sleeps, then exits.
    cmd = f"(echo $(exec sh -c 'echo $PPID') > /dev/null; sleep 100 & echo $! > {pidfile}); echo worker-done"
    ctx = launch("sh", {0: ("-c", cmd)}, log_dir=tmp_path / "logs", tee=Std.OUT)
    grandchild = []
    try:
        result = ctx.wait(10)
        assert result is not None and not result.is_failed()
        grandchild = read_pids(pidfile, 1)
        out, _ = capfd.readouterr()
        assert "[trainer0]:worker-done\n" in out
        ctx.close()
        # close() kills what is left in the worker's process group.
        assert wait_gone(grandchild, 2.0) == []
    finally:
        kill_groups(grandchild)
        ctx.close()


def test_launcher_not_waiting_does_not_stall_workers(tmp_path):
    # 4 MB per rank through tee pipes while the launcher sleeps: the I/O
    # thread drains them, so the workers finish on their own.
    script = f"""
        import time, sys
        import torchmp
        from torchmp import Std
        ctx = torchmp.start_processes("t", sys.executable,
            {{r: ("-c", "import os\\nfor _ in range(64): os.write(1, b'z' * 65535 + b'\\\\n')") for r in range(2)}},
            {{0: {{}}, 1: {{}}}}, torchmp.DefaultLogsSpecs(log_dir="{tmp_path}/logs", tee=Std.OUT))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            time.sleep(0.05)
            r = ctx.wait(0)
            if r is not None:
                break
        print("DONE", r is not None and not r.is_failed(), file=sys.stderr)
        ctx.close()
    """
    res = run_launcher(script, stdout=open(os.devnull, "wb"))
    assert b"DONE True" in res.stderr, res.stderr


def test_console_closed_keeps_logs_complete(tmp_path):
    script = f"""
        import os, sys
        import torchmp
        from torchmp import Std
        r_, w_ = os.pipe()
        os.dup2(w_, 1)
        os.close(r_)  # nobody reads our console: writes get EPIPE
        ctx = torchmp.start_processes("t", "sh", {{0: ("-c", "seq 1 50000")}}, {{0: {{}}}},
                                      torchmp.DefaultLogsSpecs(log_dir="{tmp_path}/logs", tee=Std.OUT))
        r = ctx.wait(30)
        ctx.close()
        print("LOG", r.stdouts[0], r.is_failed(), file=sys.stderr)
    """
    res = run_launcher(script)
    line = [ln for ln in res.stderr.decode().splitlines() if ln.startswith("LOG")][0]
    _, path, failed = line.split()
    assert failed == "False"
    expected = "".join(f"{i}\n" for i in range(1, 50001)).encode()
    assert Path(path).read_bytes() == expected


@pytest.mark.parametrize("chunks", [
    [b"a\nb", b"c\n", b"", b"d"],
    [b"x" * 10, b"\n\n", b"\xff\x00\r\n"],
    [b"no newline at all"],
    [b"\n"],
])
def test_framer_is_independent_of_chunking(tmp_path, chunks):
    whole = b"".join(chunks)
    outs = []
    for parts in (chunks, [whole], [bytes([b]) for b in whole]):
        path = tmp_path / f"f{len(outs)}"
        with open(path, "wb") as f:
            _core.frame(f.fileno(), b"[p]:", parts)
        outs.append(path.read_bytes())
    assert outs[0] == outs[1] == outs[2]
    lines = whole.split(b"\n")
    if lines[-1] == b"":
        lines = lines[:-1]
    assert outs[0] == b"".join(b"[p]:" + line + b"\n" for line in lines)


@pytest.mark.parametrize("chunks", [
    [b"a" * 25, b"b" * 10 + b"\nc\n"],
    [b"a" * 25 + b"b" * 10 + b"\nc\n"],
    [bytes([x]) for x in b"a" * 25 + b"b" * 10 + b"\nc\n"],
])
def test_framer_cuts_overlong_lines_every_max_line_bytes(tmp_path, chunks):
    path = tmp_path / "f"
    with open(path, "wb") as f:
        _core.frame(f.fileno(), b">", chunks, 16)
    assert path.read_bytes() == b">" + b"a" * 16 + b"\n>" + b"a" * 9 + b"b" * 7 + b"\n>bbb\n>c\n"


def test_framer_line_of_exactly_max_line_is_one_line(tmp_path):
    for chunks in ([b"x" * 16, b"\n"], [b"x" * 16 + b"\n"]):
        path = tmp_path / "f"
        with open(path, "wb") as f:
            _core.frame(f.fileno(), b">", chunks, 16)
        assert path.read_bytes() == b">" + b"x" * 16 + b"\n"


def test_log_line_timestamps_on_console_not_in_log(tmp_path, capfdbinary):
    ctx = launch("sh", {0: ("-c", "echo one; echo two")}, log_dir=tmp_path, tee=Std.OUT,
                 log_line_timestamps=True)
    result = ctx.wait(30)
    ctx.close()
    out, _ = capfdbinary.readouterr()
    lines = out.splitlines()
    assert len(lines) == 2
    for line, text in zip(lines, (b"one", b"two"), strict=True):
        assert re.fullmatch(rb"\[trainer0\]:\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z " + text, line), line
    assert Path(result.stdouts[0]).read_bytes() == b"one\ntwo\n"


def test_a_line_whose_writer_stops_half_way_through_a_full_pipe_is_shown_whole(tmp_path, capfdbinary):
    # A write longer than the free pipe space is copied up to a full pipe,
    # and the writer waits for room; stopped there (SIGSTOP, or starved on a
    # loaded machine) for longer than the idle partial-line time, it has
    # the first part of its line read and the rest still to come.  The
    # console must show that line whole once the rest comes.
    lines = 20
    ctx = launch(sys.executable, {0: ("-c", LONG_LINES, str(lines))}, log_dir=tmp_path, tee=Std.OUT, name="w")
    pid = ctx.pids()[0]
    log = Path(ctx.stdouts[0])
    try:
        stopped_for = stop_inside_a_long_line(pid, log)
        resumed = time.monotonic()
        result = ctx.wait(60)
        resumed_to_exit = time.monotonic() - resumed
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)  # never leave it stopped, whatever failed
        ctx.close()
    assert stopped_for is not None, "never stopped the rank inside a line"
    assert result is not None and not result.is_failed()
    assert log.read_bytes() == LONG_LINE_BYTES * lines
    out, _ = capfdbinary.readouterr()
    shown = [line for line in out.split(b"\n") if line.startswith(b"[w0]:")]
    # Each line in pieces of 256 KiB, as every line longer than that is.
    piece, length = 256 * 1024, len(LONG_LINE_BYTES) - 1
    whole = [5 + piece] * (length // piece) + [5 + length % piece]
    assert [len(line) for line in shown] == whole * lines, (
        f"stopped for {stopped_for:.3f} s; then {resumed_to_exit:.3f} s to the exit")
    assert all(line == b"[w0]:" + b"L" * (len(line) - 5) for line in shown)


# One write() of twice the default pipe: the launcher reads the first
# 64 KiB and grows the pipe, and the writer has put the second 64 KiB in
# before the pipe grew, filling it at its old size.  Then the writer pauses
# 0.3 s (as one stopped there would), and writes the rest of its line.
AROUND_THE_GROWTH = """
import fcntl, os, time
assert fcntl.fcntl(1, fcntl.F_GETPIPE_SZ) == 65536
os.write(1, b"L" * 131072)
time.sleep(0.3)
os.write(1, b"L" * 1000 + b"\\n")
"""


def test_a_line_paused_at_a_pipe_filled_before_it_grew_is_shown_whole(tmp_path, capfdbinary):
    # The second read is full for the size the pipe had when it was
    # written, not for the size it has when read.
    ctx = launch(sys.executable, {0: ("-c", AROUND_THE_GROWTH)}, log_dir=tmp_path, tee=Std.OUT, name="g")
    result = ctx.wait(60)
    ctx.close()
    assert result is not None and not result.is_failed()
    assert Path(result.stdouts[0]).read_bytes() == b"L" * 132072 + b"\n"
    out, _ = capfdbinary.readouterr()
    assert [len(line) for line in out.split(b"\n") if line.startswith(b"[g0]:")] == [5 + 132072]


def test_a_partial_line_after_a_burst_that_filled_the_pipe_is_still_shown_while_the_rank_waits(tmp_path, capfdbinary):
    # What the hold above costs an idle rank: a prompt that ends one write()
    # of 64 KiB, which filled the pipe, is shown after 1 s rather than
    # 0.1 s -- but shown while the rank waits.
    go = tmp_path / "go"
    prompt = b"prompt> "
    lines = b"".join(b"%099d\n" % i for i in range((65536 - len(prompt)) // 100))
    burst = lines + b"-" * (65536 - len(prompt) - len(lines) - 1) + b"\n" + prompt
    script = (f"import os, time\nos.write(1, {burst!r})\n"
              f"while not os.path.exists({str(go)!r}): time.sleep(0.01)\nos.write(1, b' end\\n')\n")
    ctx = launch(sys.executable, {0: ("-c", script)}, log_dir=tmp_path / "logs", tee=Std.OUT, name="p")
    seen = shown_while_waiting(capfdbinary, b"[p0]:" + prompt + b"\n", go)
    result = ctx.wait(60)
    ctx.close()
    out = seen + capfdbinary.readouterr()[0]
    assert len(burst) == 65536
    assert Path(result.stdouts[0]).read_bytes() == burst + b" end\n"
    want = [b"[p0]:" + line for line in burst.split(b"\n")[:-1]] + [b"[p0]:" + prompt, b"[p0]: end"]
    assert [x for x in out.splitlines() if x.startswith(b"[p0]:")] == want
