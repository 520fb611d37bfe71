"""Followed logs: tee without a pipe and a log fd per stream (issue 23.4).

When the pipes of a teed launch would not fit RLIMIT_NOFILE, each worker
writes its log file itself and the I/O thread follows the files to the
console (one inotify fd for all of them).  TORCHMP_TEE_TAIL=1 forces that
mode here, so every test below runs it with plenty of fds: the log bytes
must be exact and the console must show the lines the pipe tee shows.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from torchmp import Std, _core

from helpers import launch, shown_while_waiting

pytestmark = pytest.mark.skipif(not _core.HAVE_FOLLOW, reason="this build cannot follow logs (no inotify)")


@pytest.fixture(autouse=True)
def follow_logs(monkeypatch):
    monkeypatch.setenv("TORCHMP_TEE_TAIL", "1")


def fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def run(tmp_path, args, tee=Std.ALL, name="f", redirects=Std.NONE):
    ctx = launch("sh", {r: ("-c", a) for r, a in enumerate(args)}, log_dir=tmp_path, tee=tee, name=name,
                 redirects=redirects)
    result = ctx.wait(60)
    ctx.close()
    assert result is not None
    return result


def test_many_lines_written_fast_are_all_shown_in_order_and_logged_exactly(tmp_path, capfdbinary):
    # Two ranks, 20000 lines each as fast as the shell writes them, some of
    # them long: the log is exact, the console has every line, whole, in order.
    script = ('i=0; while [ $i -lt 20000 ]; do echo "line $i of $R $P"; i=$((i+1)); done')
    long = "x" * 3000
    result = run(tmp_path, [script.replace("$R", "0").replace("$P", ""),
                            script.replace("$R", "1").replace("$P", long)])
    out, _ = capfdbinary.readouterr()
    assert not result.is_failed()
    for r, pad in ((0, ""), (1, long)):
        want = b"".join(b"line %d of %d %s\n" % (i, r, pad.encode()) for i in range(20000))
        assert Path(result.stdouts[r]).read_bytes() == want
        shown = [line for line in out.split(b"\n") if line.startswith(b"[f%d]:" % r)]
        assert shown == [b"[f%d]:" % r + line for line in want.split(b"\n")[:-1]]


def test_a_last_line_without_newline_is_shown_at_the_exit(tmp_path, capfdbinary):
    result = run(tmp_path, ["printf 'one\\ntwo\\nthree'", "printf 'lonely'"])
    out, _ = capfdbinary.readouterr()
    assert Path(result.stdouts[0]).read_bytes() == b"one\ntwo\nthree"
    assert Path(result.stdouts[1]).read_bytes() == b"lonely"
    assert sorted(out.splitlines()) == sorted([b"[f0]:one", b"[f0]:two", b"[f0]:three", b"[f1]:lonely"])


def test_a_rank_writing_after_a_partial_line(tmp_path, capfdbinary):
    # A partial line that waits is shown while the rank waits (the pipe
    # tee's idle rule); its continuation then comes on a line of its own.
    go = tmp_path / "go"
    ctx = launch("sh", {0: ("-c", f"printf 'start '; while [ ! -e '{go}' ]; do sleep 0.01; done; "
                                  "printf 'rest\\nnext\\n'")},
                 log_dir=tmp_path / "logs", tee=Std.ALL, name="f")
    seen = shown_while_waiting(capfdbinary, b"[f0]:start \n", go)
    result = ctx.wait(60)
    ctx.close()
    out = seen + capfdbinary.readouterr()[0]
    assert Path(result.stdouts[0]).read_bytes() == b"start rest\nnext\n"
    lines = out.splitlines()
    assert [x for x in lines if x.startswith(b"[f0]:")] == [b"[f0]:start ", b"[f0]:rest", b"[f0]:next"]


# A worker that writes one line in one write() whose copy into the file
# stops half way for STALL seconds: the first part of the line ends at a
# page boundary of the file, and the source buffer's next page is missing
# behind a userfaultfd that this process fills only after the stall.  (A
# preempted writer on a loaded machine does the same, for less time.)  A
# backlog written just before keeps the I/O thread reading when the first
# part becomes visible, so it reads it.
STALLED_WRITE_WORKER = r"""
import ctypes, mmap, os, select, struct, sys, threading, time

PAGE = 4096
UFFDIO_API, UFFDIO_REGISTER, UFFDIO_COPY = 0xC018AA3F, 0xC020AA00, 0xC028AA03
SYS_userfaultfd = 323
libc = ctypes.CDLL(None, use_errno=True)
libc.ioctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p)

def check(rc, what):
    if rc < 0:
        e = ctypes.get_errno()
        raise OSError(e, what + ": " + os.strerror(e))

line, head, stall = sys.argv[1].encode() + b"\n", int(sys.argv[2]), float(sys.argv[3])
uffd = libc.syscall(SYS_userfaultfd, os.O_CLOEXEC | os.O_NONBLOCK)
check(uffd, "userfaultfd")
check(libc.ioctl(uffd, UFFDIO_API, ctypes.create_string_buffer(struct.pack("QQQ", 0xAA, 0, 0))), "UFFDIO_API")
buf = mmap.mmap(-1, 2 * PAGE)
base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
buf[PAGE - head:PAGE] = line[:head]  # the first page only: the second stays missing
check(libc.ioctl(uffd, UFFDIO_REGISTER, ctypes.create_string_buffer(struct.pack("QQQQ", base + PAGE, PAGE, 1, 0))),
      "UFFDIO_REGISTER")
rest = ctypes.create_string_buffer(line[head:].ljust(PAGE, b"\0"), PAGE)

def fill_after_the_stall():
    select.select([uffd], [], [])
    os.read(uffd, 32)  # the write's fault on the missing page
    time.sleep(stall)
    check(libc.ioctl(uffd, UFFDIO_COPY, ctypes.create_string_buffer(
        struct.pack("QQQQq", base + PAGE, ctypes.addressof(rest), PAGE, 0, 0))), "UFFDIO_COPY")

filler = threading.Thread(target=fill_after_the_stall)
filler.start()
backlog = b"".join(b"backlog %06d\n" % i for i in range(200000))
pad = (PAGE - head - len(backlog)) % PAGE
os.write(1, backlog + b"p" * (pad + PAGE - 1) + b"\n")
assert os.write(1, memoryview(buf)[PAGE - head:PAGE - head + len(line)]) == len(line)
filler.join()
"""


def userfaultfd_available() -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(323, os.O_CLOEXEC) if os.uname().machine == "x86_64" else -1
    if fd < 0:
        return False
    os.close(fd)
    return True


@pytest.mark.skipif(not userfaultfd_available(),
                    reason="needs userfaultfd (x86-64, root or vm.unprivileged_userfaultfd)")
def test_a_line_whose_write_stalls_half_way_is_shown_whole(tmp_path, capfdbinary):
    # The pipe tee shows such a line whole (a write of up to PIPE_BUF bytes
    # reaches a pipe whole); the followed log's size ends at the page
    # boundary inside it for 0.3 s, three times the idle partial line's
    # 0.1 s.  (A preempted writer tore a line of the test above once, in
    # CI's poll round on a loaded machine.)
    worker = tmp_path / "stalled_write.py"
    worker.write_text(STALLED_WRITE_WORKER)
    line = "line " + "y" * 3000
    ctx = launch(sys.executable, {0: (str(worker), line, "1000", "0.3")}, log_dir=tmp_path / "logs",
                 tee=Std.ALL, name="f")
    result = ctx.wait(60)
    ctx.close()
    out, err = capfdbinary.readouterr()
    assert result is not None and not result.is_failed(), err[-2000:]
    logged = Path(result.stdouts[0]).read_bytes()
    assert logged.endswith(b"\n" + line.encode() + b"\n")
    shown = [x for x in out.splitlines() if x.startswith(b"[f0]:")]
    assert shown == [b"[f0]:" + x for x in logged.splitlines()]
    assert shown[-1] == b"[f0]:" + line.encode()


def test_a_partial_line_at_a_page_boundary_is_still_shown_while_the_rank_waits(tmp_path, capfdbinary):
    # What the rule above costs an idle rank whose partial line ends at a
    # multiple of 4096 bytes (block-buffered output): it is shown after 1 s
    # rather than 0.1 s, but shown while the rank waits.
    go = tmp_path / "go"
    first = "a" * 4095
    ctx = launch("sh", {0: ("-c", f"printf '{first}\\n'; printf '%04096d' 7; "
                                  f"while [ ! -e '{go}' ]; do sleep 0.01; done; printf ' end\\n'")},
                 log_dir=tmp_path / "logs", tee=Std.ALL, name="f")
    partial = b"[f0]:" + b"%04096d" % 7 + b"\n"
    seen = shown_while_waiting(capfdbinary, partial, go)
    result = ctx.wait(60)
    ctx.close()
    out = seen + capfdbinary.readouterr()[0]
    assert Path(result.stdouts[0]).read_bytes() == first.encode() + b"\n" + b"%04096d" % 7 + b" end\n"
    assert [x for x in out.splitlines() if x.startswith(b"[f0]:")] == [
        b"[f0]:" + first.encode(), b"[f0]:" + b"%04096d" % 7, b"[f0]: end"]


def test_both_streams_go_to_their_own_console(tmp_path, capfdbinary):
    script = ('i=0; while [ $i -lt 500 ]; do echo "out $i"; echo "err $i" >&2; i=$((i+1)); done; '
              'printf "out-end"; printf "err-end" >&2')
    result = run(tmp_path, [script, script])
    out, err = capfdbinary.readouterr()
    for r in range(2):
        assert Path(result.stdouts[r]).read_bytes() == b"".join(b"out %d\n" % i for i in range(500)) + b"out-end"
        assert Path(result.stderrs[r]).read_bytes() == b"".join(b"err %d\n" % i for i in range(500)) + b"err-end"
        prefix = b"[f%d]:" % r
        assert [x for x in out.splitlines() if x.startswith(prefix)] == (
            [prefix + b"out %d" % i for i in range(500)] + [prefix + b"out-end"])
        assert [x for x in err.splitlines() if x.startswith(prefix)] == (
            [prefix + b"err %d" % i for i in range(500)] + [prefix + b"err-end"])


def test_only_the_teed_stream_is_followed(tmp_path, capfdbinary):
    result = run(tmp_path, ["echo to-out; echo to-err >&2"], tee=Std.ERR, redirects=Std.ALL)
    out, err = capfdbinary.readouterr()
    assert Path(result.stdouts[0]).read_bytes() == b"to-out\n"
    assert Path(result.stderrs[0]).read_bytes() == b"to-err\n"
    assert b"to-out" not in out and b"to-out" not in err
    assert err.splitlines() == [b"[f0]:to-err"]


def test_a_rank_killed_by_a_signal_has_every_line_shown(tmp_path, capfdbinary):
    script = ('i=0; while [ $i -lt 300 ]; do echo "before $i"; i=$((i+1)); done; '
              'printf "cut"; echo "to stderr" >&2; kill -KILL $$')
    result = run(tmp_path, [script, "echo fine"])
    out, err = capfdbinary.readouterr()
    assert result.is_failed() and result.failures[0].exitcode == -signal.SIGKILL
    want = b"".join(b"before %d\n" % i for i in range(300)) + b"cut"
    assert Path(result.stdouts[0]).read_bytes() == want
    assert [x for x in out.splitlines() if x.startswith(b"[f0]:")] == (
        [b"[f0]:before %d" % i for i in range(300)] + [b"[f0]:cut"])
    assert b"[f0]:to stderr" in err.splitlines()


def test_a_teed_rank_holds_no_fd_of_its_streams_and_close_leaves_none(tmp_path, capfdbinary):
    # Warm up: the I/O thread's own fds live as long as the process.
    run(tmp_path / "warm", ["true"])
    before = fds()
    n = 20
    go = tmp_path / "go"
    script = f'while [ ! -e "{go}" ]; do sleep 0.02; done; echo "out $R"; echo "err $R" >&2'
    ctx = launch("sh", {r: ("-c", script) for r in range(n)}, {r: {"R": str(r)} for r in range(n)},
                 log_dir=tmp_path / "logs", tee=Std.ALL, name="f")
    try:
        time.sleep(0.3)
        during = fds()
    finally:
        go.mkdir()
    result = ctx.wait(60)
    ctx.close()
    # A pidfd a rank at most (none on the poll backend), the inotify fd and
    # the console's: never the two pipes and two logs a rank a pipe tee holds.
    assert len(during - before) <= n + 4, sorted(during - before)
    assert not result.is_failed()
    out, err = capfdbinary.readouterr()
    for r in range(n):
        assert Path(result.stdouts[r]).read_bytes() == b"out %d\n" % r
        assert Path(result.stderrs[r]).read_bytes() == b"err %d\n" % r
        assert b"[f%d]:out %d" % (r, r) in out.splitlines()
        assert b"[f%d]:err %d" % (r, r) in err.splitlines()
    deadline = time.monotonic() + 5
    while fds() - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fds() - before == set()


def test_a_log_shared_by_both_streams_is_piped(tmp_path, capfdbinary):
    # One file for stdout and stderr cannot be followed as two streams: that
    # rank's streams are piped; every line still shows.
    from torchmp import DefaultLogsSpecs, start_processes
    from torchmp.logs_specs import LogsDest

    class OneFile(DefaultLogsSpecs):
        def reify(self, envs):
            dest = super().reify(envs)
            return LogsDest(dest.stdouts, dict(dest.stdouts), dest.tee_stdouts, dest.tee_stderrs, dest.error_files,
                            dest.filtered_stdout, dest.filtered_stderr)

    ctx = start_processes("f", "sh", {0: ("-c", "echo one; sleep 0.2; echo two >&2")}, {0: {}},
                          OneFile(log_dir=str(tmp_path), tee=Std.ALL))
    result = ctx.wait(30)
    ctx.close()
    out, err = capfdbinary.readouterr()
    assert not result.is_failed()
    assert out.splitlines() == [b"[f0]:one"]
    assert err.splitlines() == [b"[f0]:two"]
