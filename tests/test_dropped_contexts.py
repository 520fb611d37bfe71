"""Contexts the program drops without wait() or close() (issue 23.5).

A context pins its ranks' pids (their zombies) until close(); once the
program can no longer reach it, nothing can signal through it, so its ranks
are reaped at the next launch once their exits are recorded: 200 dropped
contexts leave no zombies.  What
a dropped context still runs is not touched by that launch and is stopped at
interpreter exit the normal way (death signal first), as before.
"""
from __future__ import annotations

import gc
import os
import sys
import time

import pytest

import torchmp
from torchmp import DefaultLogsSpecs, _core, _orphans

from helpers import Launchers, pid_alive, wait_gone

def _children() -> dict[int, str]:
    """This process's children and their states (from /proc)."""
    found = {}
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            found[int(name)] = fields[0].decode()
    return found


def _wait_recorded(pids: list[int], timeout: float) -> list[int]:
    """Wait until torchmp has recorded the exits of pids that dropped
    contexts ran; return those still running in its records.  The kernel
    makes a rank a zombie a moment before torchmp's I/O thread records its
    exit (longer on a loaded machine, and on the poll backend, which learns
    of it from a SIGCHLD), and a launch reaps a dropped context only once
    every exit of it is recorded."""
    deadline = time.monotonic() + timeout
    while True:
        # Queued when their context went, or taken by a launch since and
        # not released yet (an earlier launch found an exit unrecorded).
        orphans = [r.orphan for r in list(_orphans._gone) if not r.closed]
        orphans += [o for o in list(_orphans._orphans) if not o.released]
        running = [info.pid for orphan in orphans for info in orphan._group.snapshot()[1]
                   if info.state == _core.PROC_RUNNING and info.pid in pids]
        if not running or time.monotonic() >= deadline:
            return running
        time.sleep(0.01)


def _return(value: int) -> int:
    return value


def _launch(kind: str, log_dir: str) -> torchmp.PContext:
    specs = DefaultLogsSpecs(log_dir=log_dir)
    if kind == "binary":
        return torchmp.start_processes("drop", "true", args={0: (), 1: ()}, envs=None, logs_specs=specs)
    # A function context holds a reference cycle (its workers' view): only
    # the garbage collector finds it unreachable.
    return torchmp.start_processes("drop", _return, args={0: (0,)}, envs=None, logs_specs=specs,
                                   start_method="fork")


@pytest.mark.parametrize("kind", ["binary", "fork"])
def test_dropped_contexts_leave_no_zombies(tmp_path, kind):
    pids: list[int] = []
    for i in range(200):
        ctx = _launch(kind, str(tmp_path / str(i)))
        pids.extend(ctx.pids().values())
        del ctx  # no wait(), no close()
    try:
        # Every rank has exited (a zombie, or already reaped).
        assert wait_gone(pids, 20.0) == []
        gc.collect()
        assert _wait_recorded(pids, 20.0) == []
        last = _launch(kind, str(tmp_path / "last"))
        result = last.wait()
        last.close()
        assert result is not None and not result.is_failed()
        children = _children()
        assert [pid for pid, state in children.items() if state == "Z"] == []
        assert not any(pid in children for pid in pids)
        assert [pid for pid in pids if pid_alive(pid)] == []
    finally:
        for pid in pids:
            if pid_alive(pid):
                os.kill(pid, 9)


@pytest.mark.parametrize("closed", [False, True])
def test_a_context_going_runs_no_python_code_of_torchmp(tmp_path, closed):
    """A context becomes garbage at any allocation, in any thread.  Python
    code run then (a weak reference's callback) is where a handled signal's
    exception would be lost ("Exception ignored in ..."): the context's
    going runs none, its registry entry is queued by a C call and taken at
    the next launch, which still reaps what a dropped context left."""
    ctx = _launch("binary", str(tmp_path / "dropped"))
    pids = list(ctx.pids().values())
    if closed:
        assert not ctx.wait(30).is_failed()
        ctx.close()
    ran: list[str] = []

    def hook(frame, event, arg):
        if event == "call" and "/torchmp/" in frame.f_code.co_filename:
            ran.append(frame.f_code.co_name)

    try:
        sys.setprofile(hook)
        try:
            del ctx  # (a binary context holds no cycle: it goes here)
        finally:
            sys.setprofile(None)
        assert ran == []
        assert wait_gone(pids, 20.0) == []
        assert _wait_recorded(pids, 20.0) == []
        last = _launch("binary", str(tmp_path / "last"))
        assert not last.wait(30).is_failed()
        last.close()
        children = _children()
        assert [pid for pid, state in children.items() if state == "Z"] == []
        assert not any(pid in children for pid in pids)
    finally:
        for pid in pids:
            if pid_alive(pid):
                os.kill(pid, 9)


DROP_SCRIPT = """
    import gc, os, sys, time
    import torchmp
    from torchmp import DefaultLogsSpecs

    marks = sys.argv[1]
    body = ('trap \\'echo term >> "%s/term"; kill $child 2>/dev/null; exit 0\\' TERM; '
            'sleep 300 & child=$!; echo $child >> "%s/children"; wait') % (marks, marks)
    ctx = torchmp.start_processes("dropped", "sh", args={0: ("-c", body), 1: ("-c", body)}, envs=None,
                                  logs_specs=DefaultLogsSpecs(log_dir=marks + "/logs"))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if len(open(marks + "/children").read().split()) == 2:
                break
        except FileNotFoundError:
            pass
        time.sleep(0.01)
    leaders = list(ctx.pids().values())
    print(" ".join(str(p) for p in leaders), flush=True)
    del ctx
    gc.collect()
    # The next launch reaps only what has exited: the dropped ranks still run.
    other = torchmp.start_processes("other", "true", args={0: ()}, envs=None,
                                    logs_specs=DefaultLogsSpecs(log_dir=marks + "/other"))
    other.wait()
    other.close()
    with open("/proc/%d/stat" % leaders[0]) as f:
        print("running" if f.read().rsplit(")", 1)[1].split()[0] not in "ZX" else "gone", flush=True)
    # falls off the end: the dropped context's ranks are stopped at exit
"""


def test_dropped_context_still_running_is_stopped_at_exit(tmp_path):
    with Launchers(trailing_pathsep=True) as launchers:
        run = launchers.python(DROP_SCRIPT, str(tmp_path))
        rc, out, err = run.communicate(60)
        assert rc == 0, err
        first, second = out.splitlines()
        leaders = [int(x) for x in first.split()]
        children = [int(x) for x in (tmp_path / "children").read_text().split()]
        assert second == "running", err
        # Every rank got the death signal (not a bare SIGKILL), and nothing
        # of theirs is left.
        assert (tmp_path / "term").read_text().split() == ["term", "term"], err
        assert wait_gone(leaders + children, 1.0) == []


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
