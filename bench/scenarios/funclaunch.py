"""``funclaunch``: launch N Python functions per start method and collect their return values.

The function is ``bench.workers.echo_rank`` (returns its rank).  torchmp and
torch use ``start_processes(entrypoint=fn, start_method=m)`` + ``wait()``;
stdlib is ``multiprocessing.get_context(m).Process`` with one ``Pipe`` per rank
for the value.  Timed from start to every value collected and every worker
reaped.  There is no floor for function launch: the baseline is stdlib.
"""

import multiprocessing as mp

from bench import workers
from bench.common import TRIAL_TIMEOUT, Result, interleave, mono_ns, record, trial_scope

TITLE = "function launch per start method: start .. all values back"
IMPLS = ["torchmp", "stdlib", "torch", "torch-p01"]


def run_funclaunch(ctx) -> Result:
    impls = [i for i in ctx.select(IMPLS) if ctx.impls[i].function]
    res = Result("funclaunch", TITLE, impls)
    methods = [m for m in ("spawn", "fork", "forkserver") if m in mp.get_all_start_methods()]
    sizes = [4] if ctx.quick else [4, 16]
    res.params = {"methods": methods, "sizes": sizes, "fn": "bench.workers.echo_rank"}
    for method in methods:
        for n in sizes:
            key = f"{method}_n{n}"
            res.metric(key, f"{method} N={n}", "ms", "lower")

            def trial(impl, n=n, key=key, method=method):
                with trial_scope(ctx, f"func-{method}") as s:
                    args = {r: (r,) for r in range(n)}
                    t0 = mono_ns()
                    job = s.track(ctx.impls[impl].start_function(workers.echo_rank, args, s.envs(n),
                                                                 s.dir, method))
                    out = job.wait(TRIAL_TIMEOUT)
                    t1 = mono_ns()
                    if out.failed:
                        raise RuntimeError(f"workers failed: {out.failures}")
                    if out.return_values != {r: r for r in range(n)}:
                        raise RuntimeError(f"wrong return values: {out.return_values}")
                return {key: (t1 - t0) / 1e6}

            ctx.log(f"  {method} N={n}")
            # forkserver: one warm-up round so the server's start-up is not timed.
            # spawn gets few repetitions: torch's spawned workers import torch.
            reps = ctx.reps(3, 1) if method == "spawn" else ctx.reps(11, 3)
            samples = interleave(impls, reps, trial, warmup=1 if method == "forkserver" else 0,
                                 on_error=lambda i, m, k=key: res.error(i, k, m), log=ctx.log)
            record(res, samples)
    return res
