"""Soak: 1000 start/wait/close cycles with tee on must leave nothing behind
(binary workers; 500 more with forked function workers), and so must 10,000
torchmp.run and 10,000 run_async calls.

After a warm-up (caches, the I/O thread's buffers, allocator arenas), the
launcher's open fds, threads and zombie children must stay flat and its
resident set must not grow by 1 MB over the rest of the run.  The figures
are printed (pytest -s, or -rP) for the record.
"""
from __future__ import annotations

import gc
import os
import time

import psutil
import pytest

from torchmp import DefaultLogsSpecs, Std
import torchmp

pytestmark = pytest.mark.slow

CYCLES = 1000
WARMUP = 100
PAGE = os.sysconf("SC_PAGE_SIZE")


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def _zombies() -> int:
    n = 0
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                n += 1
        except psutil.Error:
            pass
    return n


def _settle(fds: int, deadline_s: float = 2.0) -> None:
    # Released groups are freed by the I/O thread shortly after close().
    deadline = time.monotonic() + deadline_s
    while _fds() > fds and time.monotonic() < deadline:
        time.sleep(0.005)


@pytest.mark.parametrize("kind, cycles", [("binary", CYCLES), ("fork", CYCLES // 2)])
def test_start_wait_close_cycles_leave_nothing_behind(tmp_path, capfd, kind, cycles):
    # One specs object: every cycle reuses the run directory and wipes the
    # attempt directory, as a restarting agent does.
    specs = DefaultLogsSpecs(log_dir=str(tmp_path), tee=Std.ALL)
    if kind == "binary":
        entry, args, kw = "sh", {r: ("-c", "echo x; echo y >&2") for r in range(2)}, {}
    else:
        # A forked worker writing to its fds 1 and 2 (tee pipes); the return
        # value (bytes written) comes back through the return channel.
        entry, args, kw = os.write, {0: (1, b"x\n"), 1: (2, b"y\n")}, {"start_method": "fork"}

    def cycle() -> None:
        ctx = torchmp.start_processes("soak", entry, args, {0: {}, 1: {}}, specs, **kw)
        result = ctx.wait(30)
        ctx.close()
        assert result is not None and not result.is_failed(), result
        assert kind == "binary" or result.return_values == {0: 2, 1: 2}

    for _ in range(WARMUP):
        cycle()
    capfd.readouterr()
    gc.collect()
    before = {"fds": _fds(), "threads": _threads(), "zombies": _zombies(), "rss": _rss()}
    t0 = time.monotonic()
    for i in range(cycles - WARMUP):
        cycle()
        if i % 100 == 99:
            capfd.readouterr()  # keep pytest's capture file small
    elapsed = time.monotonic() - t0
    out, err = capfd.readouterr()
    gc.collect()
    _settle(before["fds"])
    after = {"fds": _fds(), "threads": _threads(), "zombies": _zombies(), "rss": _rss()}
    growth = after["rss"] - before["rss"]
    with capfd.disabled():
        print(f"\nsoak ({kind}): {cycles - WARMUP} cycles after {WARMUP} warm-up in {elapsed:.1f}s "
              f"({elapsed / (cycles - WARMUP) * 1000:.1f} ms/cycle); "
              f"fds {before['fds']}->{after['fds']}, threads {before['threads']}->{after['threads']}, "
              f"zombies {before['zombies']}->{after['zombies']}, "
              f"RSS {before['rss'] / 2**20:.1f}->{after['rss'] / 2**20:.1f} MiB ({growth / 1024:+.0f} KiB)")
    assert after["fds"] == before["fds"]
    assert after["threads"] == before["threads"]
    assert after["zombies"] == before["zombies"] == 0
    assert growth < 1 << 20, f"RSS grew by {growth / 1024:.0f} KiB over {cycles - WARMUP} cycles"


RUNS = 10_000
RUN_WARMUP = 500


def _children() -> int:
    return len(psutil.Process().children(recursive=True))


@pytest.mark.parametrize("kind", ["run", "run_async"])
def test_ten_thousand_runs_leave_nothing_behind(kind):
    """10,000 sequential torchmp.run / run_async calls (capturing both
    streams, every tenth with input, every hundredth timing out): fds,
    threads, children and RSS flat after the warm-up."""
    import asyncio
    import subprocess

    def one(i: int) -> None:
        if kind == "run":
            r = torchmp.run(["sh", "-c", "echo $0", str(i)], capture_output=True, input=b"x" if i % 10 == 0 else None)
        else:
            r = asyncio.run(torchmp.run_async(["sh", "-c", "echo $0", str(i)], capture_output=True,
                                              input=b"x" if i % 10 == 0 else None))
        assert r.stdout == f"{i}\n".encode(), r

    def timing_out() -> None:
        with pytest.raises(subprocess.TimeoutExpired):
            if kind == "run":
                torchmp.run(["sleep", "5"], timeout=0.001)
            else:
                asyncio.run(torchmp.run_async(["sleep", "5"], timeout=0.001))

    for i in range(RUN_WARMUP):
        one(i)
    timing_out()
    gc.collect()
    before = {"fds": _fds(), "threads": _threads(), "children": _children(), "rss": _rss()}
    t0 = time.monotonic()
    for i in range(RUNS):
        one(i)
        if i % 100 == 99:
            timing_out()
    elapsed = time.monotonic() - t0
    gc.collect()
    _settle(before["fds"])
    after = {"fds": _fds(), "threads": _threads(), "children": _children(), "rss": _rss()}
    growth = after["rss"] - before["rss"]
    print(f"\nsoak ({kind}): {RUNS} calls in {elapsed:.1f}s ({elapsed / RUNS * 1000:.2f} ms each); {before} -> {after}")
    assert after["fds"] == before["fds"]
    assert after["threads"] == before["threads"]
    assert after["children"] == before["children"] == 0
    assert growth < 2 << 20, f"RSS grew by {growth / 1024:.0f} KiB over {RUNS} calls"
