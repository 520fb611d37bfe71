"""How many ranks a launcher runs under a hard RLIMIT_NOFILE.

``python -m bench.fd_capacity [--impl torchmp,torch] [--limits 64,256,1024]
[--modes tee,redirect]`` finds, for each implementation, mode and hard limit,
the largest N for which ``start_processes`` of N binary ranks (soft = hard =
the limit, set in a fresh interpreter) starts, every rank exits 0 and every
rank's two log files hold exactly what it wrote (for ``tee``, a second figure
also asks that every line reached the console).  ``tee`` is ``tee=3`` (both
streams teed to the console), ``redirect`` is ``redirects=3`` without tee.
Every rank sleeps until all ranks have started, so all of them are alive (and
hold their descriptors) at once.  One JSON line per (impl, mode, limit).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile

# Run by the child interpreter: argv = impl, mode, n, limit, log_dir.
_CHILD = r"""
import os, resource, sys, time
impl, mode, n, limit, log_dir = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
if impl == "torch":
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes
else:
    from torchmp import DefaultLogsSpecs, Std, start_processes
# Each rank waits for the go file, so every rank is alive at once.
go = os.path.join(log_dir, "go")
script = ('i=0; while [ ! -e "$GO" ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done; '
          'printf "out %s\n" "$LOCAL_RANK"; printf "err %s\n" "$LOCAL_RANK" >&2')
args = {r: ("-c", script) for r in range(n)}
envs = {r: {"LOCAL_RANK": str(r), "GO": go} for r in range(n)}
specs = DefaultLogsSpecs(log_dir=os.path.join(log_dir, "logs"), redirects=Std.ALL,
                        tee=Std.ALL if mode == "tee" else Std.NONE)
try:
    ctx = start_processes("cap", "/bin/sh", args, envs, specs)
except Exception as e:
    print("START-FAILED", type(e).__name__, e)
    sys.exit(3)
os.mkdir(go)  # (a directory: creating it needs no descriptor)
res = ctx.wait(120)
ctx.close()
if res is None or res.is_failed():
    print("FAILED", res and res.failures)
    sys.exit(4)
for r in range(n):
    with open(res.stdouts[r], "rb") as f:
        out = f.read()
    with open(res.stderrs[r], "rb") as f:
        err = f.read()
    if out != b"out %d\n" % r or err != b"err %d\n" % r:
        print("WRONG-LOG", r, out, err)
        sys.exit(5)
print("OK")
"""


def runs(impl: str, mode: str, n: int, limit: int, python: str, console: bool) -> bool:
    """Whether ``n`` ranks run under hard limit ``limit`` (and, if
    ``console``, whether a teed job also showed every line on the console)."""
    with tempfile.TemporaryDirectory() as d:
        proc = subprocess.Popen([python, "-c", _CHILD, impl, mode, str(n), str(limit), d],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:  # a hang counts as a failure
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return False
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # whatever it left behind
            except OSError:
                pass
        if proc.returncode != 0 or not out.strip().endswith(b"OK"):
            return False
        if console and mode == "tee":
            lines = set(out.splitlines()) | set(err.splitlines())
            return all(b"[cap%d]:out %d" % (r, r) in lines and b"[cap%d]:err %d" % (r, r) in lines
                       for r in range(n))
        return True


def capacity(impl: str, mode: str, limit: int, python: str, console: bool = False) -> int:
    """The largest N that runs (bisection between 0 and the limit)."""
    lo, hi = 0, limit  # runs(lo) holds (N=0 trivially), runs(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if runs(impl, mode, mid, limit, python, console):
            lo = mid
        else:
            hi = mid
    return lo


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", default="torchmp,torch")
    p.add_argument("--limits", default="64,256,1024")
    p.add_argument("--modes", default="tee,redirect")
    p.add_argument("--python", default=sys.executable)
    a = p.parse_args(argv)
    for limit in [int(x) for x in a.limits.split(",")]:
        for mode in a.modes.split(","):
            for impl in a.impl.split(","):
                row = {"impl": impl, "mode": mode, "hard_limit": limit,
                       "capacity": capacity(impl, mode, limit, a.python)}
                if mode == "tee":
                    # A tee that lost console lines (torch's tailer threads
                    # fail with EMFILE and log it) still "runs": both figures.
                    row["capacity_console_complete"] = capacity(impl, mode, limit, a.python, console=True)
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
