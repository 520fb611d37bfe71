"""``lag``: exit-detection lag of ``wait()``.

4 workers ``/bin/sleep 0.2``.  A separate watcher process holds a pidfd per
worker and stamps CLOCK_MONOTONIC when each exits; lag = the moment ``wait()``
returned minus the last worker's exit.  torchmp and torch use their default
``wait()``; torch-p01 uses ``period=0.01``.
Target: torchmp's lag <= floor's lag + 1 ms.
"""

from bench.common import TRIAL_TIMEOUT, Result, interleave, mono_ns, record, trial_scope
from bench.impls import ALL_IMPLS

TITLE = "exit-detection lag: wait() return - last worker exit (4 x sleep 0.2)"
N = 4


def run_lag(ctx) -> Result:
    impls = ctx.select(ALL_IMPLS)
    res = Result("lag", TITLE, impls)
    res.params = {"n": N, "worker": "/bin/sleep 0.2"}
    res.metric("lag", "lag", "ms", "lower", compare="diff")
    res.metric("total", "start..wait()", "ms", "lower")
    watcher = ctx.watcher

    def trial(impl):
        with trial_scope(ctx, "lag") as s:
            t0 = mono_ns()
            job = s.track(ctx.impls[impl].start_binary("/bin/sleep", {r: ("0.2",) for r in range(N)},
                                                       s.envs(N), s.dir))
            pids = list(job.pids().values())
            watcher.watch(pids)
            out = job.wait(TRIAL_TIMEOUT)
            t1 = mono_ns()
            exits = watcher.collect(10.0)
            if out.failed:
                raise RuntimeError(f"workers failed: {out.failures}")
            if min(exits.values()) < 0:
                raise RuntimeError("a worker exited before the watcher was armed")
        return {"lag": (t1 - max(exits.values())) / 1e6, "total": (t1 - t0) / 1e6}

    samples = interleave(impls, ctx.reps(60, 5), trial, warmup=1,
                         on_error=lambda i, m: res.error(i, "", m), log=ctx.log)
    record(res, samples)
    return res
