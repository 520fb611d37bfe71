"""How many ranks run under a hard RLIMIT_NOFILE (issue 23.4).

Each case runs a launcher in a fresh interpreter whose soft and hard limits
are both set to the limit, so the soft limit cannot be raised: jobs of torch
2.13's own capacity (measured with bench/fd_capacity.py: 29 ranks at 64, 125
at 256, the figures its tee reaches only by losing console lines) run with
every rank's log bytes exact, teed ones with every console line shown too
(their logs are followed rather than piped: tests/test_tee_follow.py); past
torchmp's capacity is a clear error before any process starts, with nothing
left behind.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest

from torchmp import DefaultLogsSpecs, Std, _core, _native, start_processes

from helpers import Launchers

CAPACITY_SCRIPT = r"""
import os, resource, sys
limit, n, mode, log_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
from torchmp import DefaultLogsSpecs, Std, start_processes

def children():
    me = str(os.getpid())
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[1] == me:
                        found.append(int(name))
            except OSError:
                pass
    return found

# Every rank waits until all of them run, so all hold their fds at once.
go = os.path.join(log_dir, "go")
script = ('i=0; while [ ! -e "$GO" ] && [ $i -lt 1000 ]; do sleep 0.02; i=$((i+1)); done; '
          'printf "out %s\n" "$R"; printf "err %s\n" "$R" >&2')
specs = DefaultLogsSpecs(log_dir=os.path.join(log_dir, "logs"), redirects=Std.ALL,
                         tee=Std.ALL if mode == "tee" else Std.NONE)
fds_before = len(os.listdir("/proc/self/fd"))
try:
    ctx = start_processes("cap", "/bin/sh", {r: ("-c", script) for r in range(n)},
                          {r: {"R": str(r), "GO": go} for r in range(n)}, specs)
except OSError as e:
    # Nothing started, nothing kept open.
    print("refused", e.errno, len(children()), len(os.listdir("/proc/self/fd")) - fds_before, str(e),
          file=sys.stderr, flush=True)
    sys.exit(3)
os.mkdir(go)  # (creating a directory needs no descriptor)
result = ctx.wait(120)
ctx.close()
assert result is not None and not result.is_failed(), result
for r in range(n):
    with open(result.stdouts[r], "rb") as f:
        assert f.read() == b"out %d\n" % r, r
    with open(result.stderrs[r], "rb") as f:
        assert f.read() == b"err %d\n" % r, r
print("ran", n, flush=True)
"""


def _run(tmp_path, limit: int, n: int, mode: str) -> tuple[int, str, str]:
    with Launchers(trailing_pathsep=True) as launchers:
        run = launchers.python(CAPACITY_SCRIPT, str(limit), str(n), mode, str(tmp_path))
        return run.communicate(150)


# (hard limit, mode, ranks that must run): torch's capacity, teed or not
# (torchmp's teed one was 6 and 33, then 9 and 47: see docs/compat.md).
# A build without inotify (TORCHMP_PORTABLE, macOS) pipes every teed stream:
# its teed capacity is still the old one.
_FOLLOWS = pytest.mark.skipif(not _core.HAVE_FOLLOW, reason="this build cannot follow logs (no inotify)")


@pytest.mark.parametrize("limit, mode, n", [
    (64, "redirect", 29), (256, "redirect", 125),
    pytest.param(64, "tee", 29, marks=_FOLLOWS), pytest.param(256, "tee", 125, marks=_FOLLOWS),
])
def test_jobs_run_under_a_hard_fd_limit(tmp_path, limit, mode, n):
    rc, out, err = _run(tmp_path, limit, n, mode)
    assert rc == 0, err[-3000:]
    assert out.splitlines()[-1] == f"ran {n}"
    if mode == "tee":
        lines = set(out.splitlines()) | set(err.splitlines())
        missing = [r for r in range(n) if f"[cap{r}]:out {r}" not in lines or f"[cap{r}]:err {r}" not in lines]
        assert missing == []


# One rank per fd over the limit at least: past any capacity.
@pytest.mark.parametrize("limit, mode, n", [(64, "redirect", 64), (64, "tee", 64), (256, "tee", 256)])
def test_past_the_capacity_is_a_clear_error_before_anything_starts(tmp_path, limit, mode, n):
    rc, out, err = _run(tmp_path, limit, n, mode)
    assert rc == 3, err[-3000:]
    line = next(x for x in err.splitlines() if x.startswith("refused"))
    words = line.split()
    # EMFILE, no child process, no fd left open, and the message says why.
    assert words[1:4] == ["24", "0", "0"], line
    assert f"RLIMIT_NOFILE is {limit} (hard {limit})" in line


# --- the budget check without counting: one poll below the soft limit ---------

FD_ROOM_SCRIPT = r"""
import json, os, resource
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from torchmp import _core
out = {"free": _core.fd_room(5)}
os.dup2(0, 63)
out["the_last_number_taken"] = _core.fd_room(5)
os.close(63)
os.dup2(0, 58)
out["one_below_the_polled_numbers"] = _core.fd_room(5)
out["one_among_them"] = _core.fd_room(6)
out["more_than_the_limit"] = _core.fd_room(65)
print(json.dumps(out))
"""


def test_fd_room_is_told_by_the_numbers_just_below_the_soft_limit(tmp_path):
    """n more fds surely fit when the n numbers below the soft limit are free
    (the kernel hands out the lowest free number); anything else is left to
    the count."""
    proc = subprocess.run([sys.executable, "-c", FD_ROOM_SCRIPT], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {
        "free": True, "the_last_number_taken": False, "one_below_the_polled_numbers": True,
        "one_among_them": False, "more_than_the_limit": False}


def test_a_launch_far_from_the_fd_limit_does_not_count_its_fds(tmp_path, monkeypatch):
    """Counting the open fds walks /proc/self/fd (a path walk and a
    getdents64 that formats every entry): 14 us of a one-rank launch.  Only
    a launch that may not fit counts, and one with teed streams, which
    chooses between pipes and followed logs by the count."""
    counted = []
    real = _native.fd_limits

    def counting():
        counted.append(True)
        return real()
    monkeypatch.setattr(_native, "fd_limits", counting)

    def launch(**streams):
        ctx = start_processes("room", "true", {0: ()}, {0: {}}, DefaultLogsSpecs(log_dir=str(tmp_path), **streams))
        result = ctx.wait(30)
        ctx.close()
        assert result is not None and not result.is_failed(), result

    launch()
    launch(redirects=Std.ALL)
    assert counted == []
    launch(tee=Std.ALL)
    assert counted == [True]
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return
    os.dup2(0, soft - 1)   # the number just below the limit taken: count
    try:
        launch()
    finally:
        os.close(soft - 1)
    assert counted == [True, True]
