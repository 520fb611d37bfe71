"""Soak: 1000 start/wait/close cycles with tee on must leave nothing behind
(binary workers; 500 more with forked function workers), and so must 10,000
torchmp.run and 10,000 run_async calls.

After a warm-up (caches, the I/O thread's buffers, allocator arenas), the
launcher's open fds, threads and children must stay flat and its resident
set must not grow by more than the bound over the rest of the run.  The
figures are printed (pytest -s, or -rP) for the record.

Each soak runs in a fresh interpreter of its own, the launcher, which
imports only torchmp, psutil and what it tests.  Two reasons:

* a bigger launcher makes every fork dearer, and the soaks make 12,000 and
  more: by the time the suite gets here pytest's process has grown to about
  150 MB (captured output, hypothesis, the tests' own buffers), and with
  vfork off (the poll round) one torchmp.run of `sh -c` took 13-15 ms in a
  process of that size against 3-5 ms in a fresh one -- most of the poll
  round's soak time;
* the launcher's RSS, fds and threads are then torchmp's and the soak's
  alone, not whatever another test or pytest allocated meanwhile.
"""
from __future__ import annotations

import json
from collections import Counter

import pytest

from helpers import run_launcher

pytestmark = pytest.mark.slow

CYCLES = 1000
WARMUP = 100
RUNS = 10_000
RUN_WARMUP = 500

# What every launcher program below starts with: how it counts what it
# holds, and how it reports (one JSON line, the last one it prints).
_MEASURE = """
import gc, json, os, sys, time
import psutil
import torchmp

PAGE = os.sysconf("SC_PAGE_SIZE")

def held():
    gc.collect()
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * PAGE
    zombies = 0
    children = psutil.Process().children(recursive=True)
    for child in children:
        try:
            zombies += child.status() == psutil.STATUS_ZOMBIE
        except psutil.Error:
            pass
    return {"fds": len(os.listdir("/proc/self/fd")), "threads": len(os.listdir("/proc/self/task")),
            "children": len(children), "zombies": zombies, "rss": rss}

def settle(fds, deadline_s=2.0):
    # Released groups are freed by the I/O thread shortly after close().
    deadline = time.monotonic() + deadline_s
    while len(os.listdir("/proc/self/fd")) > fds and time.monotonic() < deadline:
        time.sleep(0.005)

def report(before, elapsed, count):
    settle(before["fds"])
    print(json.dumps({"before": before, "after": held(), "elapsed": elapsed, "count": count}))
"""

_CYCLES = _MEASURE + """
from torchmp import DefaultLogsSpecs, Std
kind, cycles, warmup, log_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
# One specs object: every cycle reuses the run directory and wipes the
# attempt directory, as a restarting agent does.  The tee goes to this
# launcher's stdout and stderr, which the test reads whole.
specs = DefaultLogsSpecs(log_dir=log_dir, tee=Std.ALL)
if kind == "binary":
    entry, args, kw = "sh", {r: ("-c", "echo x; echo y >&2") for r in range(2)}, {}
else:
    # A forked worker writing to its fds 1 and 2 (tee pipes); the return
    # value (bytes written) comes back through the return channel.
    entry, args, kw = os.write, {0: (1, b"x\\n"), 1: (2, b"y\\n")}, {"start_method": "fork"}

def cycle():
    ctx = torchmp.start_processes("soak", entry, args, {0: {}, 1: {}}, specs, **kw)
    result = ctx.wait(30)
    ctx.close()
    assert result is not None and not result.is_failed(), result
    assert kind == "binary" or result.return_values == {0: 2, 1: 2}, result

for _ in range(warmup):
    cycle()
before = held()
t0 = time.monotonic()
for _ in range(cycles - warmup):
    cycle()
report(before, time.monotonic() - t0, cycles - warmup)
"""

_RUNS = _MEASURE + """
import asyncio, subprocess
kind, runs, warmup = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

def one(i):
    argv = ["sh", "-c", "echo $0", str(i)]
    stdin = b"x" if i % 10 == 0 else None
    if kind == "run":
        r = torchmp.run(argv, capture_output=True, input=stdin)
    else:
        r = asyncio.run(torchmp.run_async(argv, capture_output=True, input=stdin))
    assert r.stdout == f"{i}\\n".encode() and r.stderr == b"" and r.returncode == 0, r

def timing_out():
    try:
        if kind == "run":
            torchmp.run(["sleep", "5"], timeout=0.001)
        else:
            asyncio.run(torchmp.run_async(["sleep", "5"], timeout=0.001))
    except subprocess.TimeoutExpired:
        return
    raise AssertionError("sleep 5 with timeout=0.001 did not time out")

for i in range(warmup):
    one(i)
timing_out()
before = held()
t0 = time.monotonic()
for i in range(runs):
    one(i)
    if i % 100 == 99:
        timing_out()
report(before, time.monotonic() - t0, runs)
"""


def _soak(script: str, *args: object, timeout: float) -> tuple[dict, dict, str, bytes, bytes]:
    """Run a soak launcher program to its end; its report, its output."""
    argv = [str(a) for a in args]
    proc = run_launcher(f"import sys\nsys.argv[1:] = {argv!r}\n" + script, timeout=timeout)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-4000:]
    last = proc.stdout.rstrip(b"\n").rsplit(b"\n", 1)[-1]
    figures = json.loads(last)
    return figures["before"], figures["after"], _summary(figures), proc.stdout, proc.stderr


def _summary(figures: dict) -> str:
    before, after = figures["before"], figures["after"]
    return (f"{figures['count']} in {figures['elapsed']:.1f}s "
            f"({figures['elapsed'] / figures['count'] * 1000:.2f} ms each); "
            + ", ".join(f"{k} {before[k]}->{after[k]}" for k in ("fds", "threads", "children", "zombies"))
            + f", RSS {before['rss'] / 2**20:.1f}->{after['rss'] / 2**20:.1f} MiB "
            f"({(after['rss'] - before['rss']) / 1024:+.0f} KiB)")


def _assert_flat(before: dict, after: dict, rss_bound: int, what: str) -> None:
    assert after["fds"] == before["fds"]
    assert after["threads"] == before["threads"]
    assert after["children"] == before["children"] == 0
    assert after["zombies"] == before["zombies"] == 0
    growth = after["rss"] - before["rss"]
    assert growth < rss_bound, f"RSS grew by {growth / 1024:.0f} KiB over {what}"


@pytest.mark.parametrize("kind, cycles", [("binary", CYCLES), ("fork", CYCLES // 2)])
def test_start_wait_close_cycles_leave_nothing_behind(tmp_path, kind, cycles):
    before, after, summary, out, err = _soak(_CYCLES, kind, cycles, WARMUP, tmp_path, timeout=600)
    print(f"\nsoak ({kind}): cycles after {WARMUP} warm-up: {summary}")
    # Every cycle's tee reached the launcher's console whole, and nothing else did.
    ranks = (0, 1) if kind == "binary" else (0,)  # (the forked rank 0 writes x to fd 1, rank 1 y to fd 2)
    assert Counter(out.splitlines()[:-1]) == {f"[soak{r}]:x".encode(): cycles for r in ranks}
    ranks = (0, 1) if kind == "binary" else (1,)
    assert Counter(err.splitlines()) == {f"[soak{r}]:y".encode(): cycles for r in ranks}
    _assert_flat(before, after, 1 << 20, f"{cycles - WARMUP} cycles")


@pytest.mark.parametrize("kind", ["run", "run_async"])
def test_ten_thousand_runs_leave_nothing_behind(kind):
    """10,000 sequential torchmp.run / run_async calls (capturing both
    streams, every tenth with input, every hundredth timing out): fds,
    threads, children and RSS flat after the warm-up."""
    before, after, summary, _, err = _soak(_RUNS, kind, RUNS, RUN_WARMUP, timeout=900)
    print(f"\nsoak ({kind}): calls: {summary}")
    assert err == b""
    _assert_flat(before, after, 2 << 20, f"{RUNS} calls")
