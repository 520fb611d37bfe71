"""``many`` and ``nofile``: 1024 teed ranks, and the same under RLIMIT_NOFILE = 1024.

``many``: 1024 ranks ``/bin/echo many-<rank>`` with tee=ALL, launcher in a child
process: time from start to ``wait()`` + ``close()``, whether it worked, and how
many of the 1024 prefixed console lines are missing.

``nofile``: 1024 ranks ``/bin/sleep 3`` with tee=ALL, the launcher's soft
RLIMIT_NOFILE set to 1024 before it imports anything.  Recorded: whether the
launch worked (and the limit it ended with), else the error it raised, and how
many workers were left running once the launcher had exited (found by their
BENCH_TAG in /proc/*/environ, then killed by process group).
Target: it launches, or it fails with a clear error and nothing left running.
"""

import re

from bench.common import Result, cleanup, find_tagged, interleave, record, run_child, stderr_tail, trial_scope
from bench.impls import ALL_IMPLS

N = 1024
_LINE = re.compile(rb"\[bench(\d+)\]:many-(\d+)\n")


def run_many(ctx) -> Result:
    impls = ctx.select(ALL_IMPLS)
    res = Result("many", f"{N} teed ranks (/bin/echo) launch+reap, launcher in a child process", impls)
    res.params = {"n": N, "tee": "ALL", "worker": "/bin/echo many-RANK"}
    res.metric("seconds", "start..wait+close", "s", "lower")
    res.metric("ok", "worked", "bool", "info", agg="min")
    res.metric("missing", "console lines missing", "n", "info", agg="max")
    res.metric("cpu", "launcher CPU", "s", "lower")

    def trial(impl):
        with trial_scope(ctx, "many") as s:
            spec = {"impl": impl, "entry": "/bin/echo", "args_template": ["many-{rank}"], "n": N,
                    "tag": s.tag, "log_dir": s.dir + "/logs", "tee": 3, "timeout": 300}
            result, facts = run_child(ctx, spec, s.dir, timeout=400)
            if facts["hung"]:
                raise RuntimeError("launcher did not finish")
            if not result or not result.get("ok") or result.get("failed"):
                why = (result or {}).get("error") or (result or {}).get("failures") or stderr_tail(facts["stderr"])
                res.note(impl, "error", why)
                return {"ok": 0, "missing": N}
            seen = set()
            with open(facts["console"], "rb") as f:
                for raw in f:
                    m = _LINE.fullmatch(raw)
                    if m and m[1] == m[2]:
                        seen.add(int(m[1]))
            return {"seconds": result["t_close"], "ok": 1, "missing": N - len(seen), "cpu": result["cpu_self"]}

    samples = interleave(impls, ctx.reps(2, 1), trial, warmup=0,
                         on_error=lambda i, m: res.error(i, "", m), log=ctx.log)
    record(res, samples)
    return res


def run_nofile(ctx) -> Result:
    impls = ctx.select(["torchmp", "stdlib", "floor", "torch"])  # period plays no part
    res = Result("nofile", f"{N} teed ranks at RLIMIT_NOFILE soft = 1024 (launcher in a child process)", impls)
    res.params = {"n": N, "tee": "ALL", "worker": "/bin/sleep 3", "nofile_soft": 1024}
    res.metric("ok", "launched", "bool", "info", agg="min")
    res.metric("left_running", "left running", "n", "info", agg="max")

    def trial(impl):
        with trial_scope(ctx, "nofile") as s:
            spec = {"impl": impl, "entry": "/bin/sleep", "args_template": ["3"], "n": N, "tag": s.tag,
                    "log_dir": s.dir + "/logs", "tee": 3, "timeout": 120, "nofile": 1024}
            result, facts = run_child(ctx, spec, s.dir, timeout=180)
            left = find_tagged(s.tag)
            killed = cleanup(s.tag, left)
            result = result or {}
            ok = bool(result.get("ok")) and not result.get("failed")
            if ok:
                res.note(impl, "rlimit_after", result.get("rlimit_nofile_after"))
            else:
                err = result.get("error") or stderr_tail(facts["stderr"], 300)
                res.note(impl, "error", err)
            if facts["hung"]:
                res.note(impl, "hung", True)
            res.note(impl, "killed_by_bench", killed)
            return {"ok": int(ok), "left_running": len(left)}

    samples = interleave(impls, ctx.reps(1, 1), trial, warmup=0, on_error=lambda i, m: res.error(i, "", m), log=ctx.log)
    record(res, samples)
    return res
