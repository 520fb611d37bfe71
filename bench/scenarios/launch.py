"""``launch``: launch+reap of N x ``/bin/true``, N = 1, 16, 128, 1024.

Timed from the call that starts the workers to the return of ``wait()`` (every
worker reaped).  torch/torchmp get ``DefaultLogsSpecs(tmpdir)`` with redirects and
tee NONE (their per-rank log directories are part of what the API does).
Targets: N=128 <= 1.15x floor, N=1 <= 1.5x floor.
"""

import os

from bench.common import TRIAL_TIMEOUT, Result, interleave, mono_ns, record, trial_scope
from bench.impls import ALL_IMPLS

TITLE = "launch+reap of N x /bin/true: start .. wait() returned"
SIZES = [int(s) for s in os.environ.get("BENCH_LAUNCH_SIZES", "1,16,128,1024").split(",")]
# (full rounds, quick rounds, warm-up rounds): enough rounds that two full runs
# agree within 10 % on every N (bench/README.md, "Noise").
REPS = {1: (60, 7, 2), 16: (30, 5, 1), 128: (15, 3, 1), 1024: (10, 1, 0)}


def run_launch(ctx) -> Result:
    impls = ctx.select(ALL_IMPLS)
    res = Result("launch", TITLE, impls)
    res.params = {"sizes": SIZES, "entry": "/bin/true"}
    for n in SIZES:
        key = f"n{n}"
        res.metric(key, f"N={n}", "ms", "lower")
        full, quick, warm = REPS[n]

        def trial(impl, n=n, key=key):
            with trial_scope(ctx, f"launch{n}") as s:
                args = {r: () for r in range(n)}
                envs = s.envs(n)
                t0 = mono_ns()
                job = s.track(ctx.impls[impl].start_binary("/bin/true", args, envs, s.dir))
                out = job.wait(TRIAL_TIMEOUT)
                t1 = mono_ns()
                if out.failed:
                    raise RuntimeError(f"workers failed: {out.failures}")
                if out.resources is not None:
                    res.note(impl, "resources_reported", sorted(out.resources) == list(range(n)))
            return {key: (t1 - t0) / 1e6}

        ctx.log(f"  N={n}")
        samples = interleave(impls, ctx.reps(full, quick), trial, warmup=warm,
                             on_error=lambda i, m, n=n: res.error(i, f"N={n}", m), log=ctx.log)
        record(res, samples)
    return res
