"""``failfast``: failure detection plus teardown of the siblings.

4 ranks of ``/bin/sh``: rank 0 runs ``sleep 0.1; exit 1``, the others
``exec sleep 60``.  From rank 0's exit (stamped by the pidfd watcher) we measure
when ``wait()`` returned with the failure (``detect``) and when the last sibling
was dead (``teardown`` = max of both).  We also check that the result names rank
0 with exit code 1 and that no sibling is still running when ``wait()`` returns.
"""

from bench.common import TRIAL_TIMEOUT, Result, alive, cleanup, interleave, mono_ns, record, trial_scope
from bench.impls import ALL_IMPLS

TITLE = "failure detection + teardown: rank 0 exits 1 at 0.1s, 3 siblings sleep 60"
N = 4


def run_failfast(ctx) -> Result:
    impls = ctx.select(ALL_IMPLS)
    res = Result("failfast", TITLE, impls)
    res.params = {"n": N, "rank0": "sh -c 'sleep 0.1; exit 1'", "others": "sh -c 'exec sleep 60'"}
    res.metric("detect_ms", "fail -> wait() return", "ms", "lower")
    res.metric("teardown_ms", "fail -> siblings dead", "ms", "lower")
    res.metric("left", "alive at return", "n", "info", agg="max")
    watcher = ctx.watcher

    def trial(impl):
        with trial_scope(ctx, "failfast") as s:
            args = {r: ("-c", "sleep 0.1; exit 1" if r == 0 else "exec sleep 60") for r in range(N)}
            job = s.track(ctx.impls[impl].start_binary("/bin/sh", args, s.envs(N), s.dir))
            pids = job.pids()
            watcher.watch(pids.values())
            out = job.wait(TRIAL_TIMEOUT)
            t1 = mono_ns()
            left = [r for r in range(1, N) if alive(pids[r])]
            if left:  # the impl left them running: kill them so the watcher can finish
                cleanup(s.tag, [pids[r] for r in left])
            exits = watcher.collect(30.0)
            if not out.failed or out.failures.get(0) != 1:
                raise RuntimeError(f"failure not reported as rank 0 exit 1: {out.failures}")
            res.note(impl, "exitcodes", {str(k): v for k, v in sorted(out.failures.items())})
        t_fail = exits[pids[0]]
        t_dead = max(exits[pids[r]] for r in range(1, N))
        return {"detect_ms": (t1 - t_fail) / 1e6, "teardown_ms": (max(t1, t_dead) - t_fail) / 1e6,
                "left": len(left)}

    samples = interleave(impls, ctx.reps(10, 4), trial, warmup=1,
                         on_error=lambda i, m: res.error(i, "", m), log=ctx.log)
    record(res, samples)
    return res
