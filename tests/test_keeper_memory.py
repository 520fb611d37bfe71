"""The keeper does not hold on to the launcher's memory (issue 22).

The keeper is forked from the launcher.  It used to keep that copy-on-write
view of the launcher for its whole life: every page the launcher wrote
afterwards was copied, and the keeper ended up owning the old copies (a
launcher that rewrote 64 MB got a keeper of 64 MB more).  It now drops its
private anonymous memory at birth, and must still do its one job: kill the
workers' process groups when the launcher dies.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from helpers import Launchers, pid_alive, read_pids, wait_gone
from torchmp import _core

pytestmark = [
    pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs /proc/PID/smaps_rollup"),
    pytest.mark.skipif(not _core.keeper_drops_memory(),
                       reason="this build's keeper keeps its memory (sanitizer, coverage, valgrind, portable)"),
]

LAUNCHER = """
import os, sys, time
from torchmp import start_processes, DefaultLogsSpecs, _core
tmp = sys.argv[1]
heap = bytearray(64 << 20)
for i in range(0, len(heap), 4096):
    heap[i] = 1
# Each rank leaves a child in its process group: once the launcher is
# SIGKILLed only the keeper can stop it (PDEATHSIG reaches the ranks only).
script = 'sleep 60 & echo $! > "$0"; wait'
ctx = start_processes("k", "/bin/sh", {r: ("-c", script, f"{tmp}/child{r}") for r in range(2)},
                      {0: {}, 1: {}}, DefaultLogsSpecs(log_dir=tmp))
print(_core.keeper_pid(), *ctx.pids().values(), flush=True)
while not os.path.exists(f"{tmp}/go"):  # the test has looked at the keeper
    time.sleep(0.01)
for i in range(0, len(heap), 4096):
    heap[i] = 2
print("rewritten", flush=True)
time.sleep(60)
"""


def _private_dirty_kb(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Private_Dirty:"):
                return int(line.split()[1])
    raise AssertionError(f"no Private_Dirty line for {pid}")


def test_keeper_owns_none_of_the_launchers_rewritten_memory_and_still_kills(tmp_path: Path) -> None:
    children: list[int] = []
    with Launchers(trailing_pathsep=True, follow=True) as launchers:
        run = launchers.python(LAUNCHER, str(tmp_path))
        run.wait_for(lambda: len(run.out) >= 1, 30, "the keeper's and the ranks' pids")
        keeper, *leaders = (int(x) for x in run.out[0].split())
        assert keeper > 0 and pid_alive(keeper) and len(leaders) == 2
        children = [read_pids(tmp_path / f"child{r}", 1, 10)[0] for r in range(2)]
        before = _private_dirty_kb(keeper)
        (tmp_path / "go").touch()
        run.wait_for(lambda: "rewritten" in run.out, 30, "the launcher's rewrite of its heap")
        after = _private_dirty_kb(keeper)
        # Before the fix the keeper now owned the 64 MB the launcher rewrote.
        assert after - before < 8 * 1024, (before, after)
        assert after < 32 * 1024, after
        # And it still does its job.
        os.kill(run.proc.pid, signal.SIGKILL)
        run.proc.wait(10)
        assert wait_gone([keeper, *leaders, *children], 5.0) == []
    for pid in children:  # (only if the test failed before the keeper's kill)
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
