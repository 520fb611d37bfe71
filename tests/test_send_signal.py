"""``ctx.send_signal(sig, ranks=None)``: a signal to the process groups of
some ranks, stopping nothing.

Real workers: ``sh -c`` leaders with a trapping child in the same group,
each writing what it got to a file the test reads; a rank that exited
with a child left in its group (its zombie pins the group id); and a
context that is closed (no group id of it is signalled again).
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from helpers import launch, pid_alive, read_pids, wait_gone

# A rank: the shell leader and a child in its process group both note each
# SIGUSR1 in the rank's own file; the child stays until SIGTERM.
TRAPPER = r"""
out="$1"
trap 'echo "sh $$ got USR1" >> "$out"' USR1
sh -c 'trap "echo \"child \$\$ got USR1\" >> \"$0\"" USR1; trap "exit 0" TERM
       echo $$ >> "$0.pids"; while :; do sleep 0.05; done' "$out" &
echo $$ >> "$out.pids"
while :; do sleep 0.05; done
"""


def wait_lines(path: Path, count: int, timeout: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= count:
            return lines
        time.sleep(0.01)
    raise AssertionError(f"{path}: fewer than {count} lines: {path.read_text() if path.exists() else ''}")


@pytest.fixture
def trappers(tmp_path):
    """Three ranks of TRAPPER, started and ready; closed at the end."""
    outs = [tmp_path / f"out{r}" for r in range(3)]
    ctx = launch("/bin/sh", {r: ("-c", TRAPPER, "sh", str(outs[r])) for r in range(3)}, log_dir=tmp_path / "logs")
    try:
        pids = [read_pids(Path(f"{out}.pids"), 2) for out in outs]  # leader and child, either order
        yield ctx, outs, pids
    finally:
        ctx.close(signal.SIGKILL, 0)


def test_every_running_rank_gets_it_in_its_whole_group(trappers):
    ctx, outs, pids = trappers
    assert ctx.send_signal(signal.SIGUSR1) == [0, 1, 2]
    for rank, (out, pair) in enumerate(zip(outs, pids, strict=True)):
        leader = ctx.pids()[rank]
        child = next(p for p in pair if p != leader)
        assert sorted(wait_lines(out, 2)) == [f"child {child} got USR1", f"sh {leader} got USR1"]
    assert ctx.wait(0) is None  # nothing stopped
    assert all(pid_alive(p) for pair in pids for p in pair)


def test_chosen_ranks_only(trappers):
    ctx, outs, _ = trappers
    assert ctx.send_signal(signal.SIGUSR1, ranks=[2, 0, 2]) == [0, 2]
    assert len(wait_lines(outs[0], 2)) == 2 and len(wait_lines(outs[2], 2)) == 2
    time.sleep(0.3)
    assert not outs[1].exists()
    assert ctx.send_signal(signal.SIGUSR1, ranks=[]) == []


@pytest.mark.parametrize("ranks, sig", [
    ([0, 3], signal.SIGUSR1),       # no rank 3
    ([-1], signal.SIGUSR1),
    (["0"], signal.SIGUSR1),
    ([True], signal.SIGUSR1),
    (None, 100000),                 # no such signal
    (None, "USR1"),
])
def test_unknown_ranks_or_signal_raise_before_anything_is_sent(trappers, ranks, sig):
    ctx, outs, _ = trappers
    with pytest.raises(ValueError):
        ctx.send_signal(sig, ranks=ranks)
    time.sleep(0.3)
    assert not any(out.exists() for out in outs)
    assert ctx.wait(0) is None


def test_exited_rank_left_out_by_default_but_its_pinned_group_can_be_named(tmp_path):
    # Rank 0 exits 0 and leaves a child in its group; rank 1 runs on.
    out = tmp_path / "orphan"
    script = ('trap "echo child got USR1 >> $0" USR1; echo $$ > $0.pid; '
              'while :; do sleep 0.05; done')
    ctx = launch("/bin/sh", {0: ("-c", f"sh -c '{script}' {out} & exit 0"),
                             1: ("-c", "sleep 60")}, log_dir=tmp_path / "logs")
    child = None
    try:
        child = read_pids(Path(f"{out}.pid"), 1)[0]
        deadline = time.monotonic() + 10
        while ctx._running() != [1] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ctx._running() == [1]
        assert ctx.send_signal(signal.SIGUSR1) == [1]     # running ranks only
        time.sleep(0.3)
        assert not out.exists()
        # Named: the zombie still pins the group id, and the child is in it.
        assert ctx.send_signal(signal.SIGUSR1, ranks=[0]) == [0]
        assert wait_lines(out, 1) == ["child got USR1"]
    finally:
        ctx.close(signal.SIGTERM, 5)
        # close() stops the child through its pinned group; if it did not,
        # the test fails below, and leaves no child behind either way.
        left = wait_gone([child]) if child is not None else []
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert left == []
    # Closed: the zombies are reaped, the group ids may be anybody's now.
    assert ctx.send_signal(signal.SIGUSR1) == []
    assert ctx.send_signal(signal.SIGUSR1, ranks=[0, 1]) == []
    assert wait_lines(out, 1) == ["child got USR1"]


def test_a_rank_ended_by_its_signal_is_an_ordinary_failure(tmp_path):
    ctx = launch("/bin/sh", {0: ("-c", "sleep 60")}, log_dir=tmp_path / "logs")
    try:
        assert ctx.send_signal(signal.SIGTERM) == [0]
        result = ctx.wait(10)
        assert result is not None and result.failures[0].exitcode == -signal.SIGTERM
    finally:
        ctx.close(signal.SIGKILL, 0)
