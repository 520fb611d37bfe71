"""``idle``: what a launcher costs while 64 teed ranks do nothing.

64 ranks ``/bin/sleep S`` with tee=ALL (both streams), the launcher in a child
process blocked in ``wait()``.  Once ``start`` returned we let it settle, then
sample the launcher from outside: CPU % over a window (sum of its threads'
``/proc/PID/task/*/schedstat``, ns resolution), and at the end of the window
its thread count, fd count and RSS (psutil).  ``extra threads`` and ``fds per
rank`` are relative to the launcher's own counts just before ``start``.
Targets: <= 1 extra thread in total, <= 0.2 % CPU, <= 4 fds per rank.
"""

import time

from bench.common import Result, interleave, mono_ns, record, run_child, stderr_tail, task_cpu_ns, trial_scope
from bench.impls import ALL_IMPLS

TITLE = "64 idle ranks teeing both streams: launcher threads, fds, RSS, CPU"
N = 64


def run_idle(ctx) -> Result:
    import psutil

    impls = ctx.select(ALL_IMPLS)
    settle, window = (0.5, 1.5) if ctx.quick else (0.5, 4.0)
    sleep_s = settle + window + 1.5
    res = Result("idle", TITLE, impls)
    res.params = {"n": N, "tee": "ALL", "worker": f"/bin/sleep {sleep_s}", "settle_s": settle, "window_s": window}
    res.metric("extra_threads", "extra threads", "n", "lower")
    res.metric("threads", "threads (total)", "n", "lower")
    res.metric("fds_per_rank", "fds per rank", "n", "lower")
    res.metric("cpu_pct", "CPU while idle", "%", "lower")
    res.metric("rss_mb", "RSS", "MB", "lower")
    res.metric("rss_delta_mb", "RSS growth", "MB", "lower")

    def trial(impl):
        sample = {}

        def on_ready(proc, ready):
            time.sleep(settle)
            c0, w0 = task_cpu_ns(proc.pid), mono_ns()
            time.sleep(window)
            c1, w1 = task_cpu_ns(proc.pid), mono_ns()
            p = psutil.Process(proc.pid)
            threads, fds, rss = p.num_threads(), p.num_fds(), p.memory_info().rss
            if proc.poll() is not None or c0 is None or c1 is None:
                raise RuntimeError("launcher ended before the idle window closed")
            sample.update(
                extra_threads=threads - ready["threads_before"], threads=threads,
                fds_per_rank=(fds - ready["fds_before"]) / N,
                cpu_pct=100.0 * (c1 - c0) / (w1 - w0),
                rss_mb=rss / 2**20, rss_delta_mb=(rss - ready["rss_before"]) / 2**20,
            )

        with trial_scope(ctx, "idle") as s:
            spec = {"impl": impl, "entry": "/bin/sleep", "args_template": [str(sleep_s)], "n": N,
                    "tag": s.tag, "log_dir": s.dir + "/logs", "tee": 3, "timeout": 120}
            result, facts = run_child(ctx, spec, s.dir, timeout=180, on_ready=on_ready)
            if not result or not result.get("ok"):
                why = (result or {}).get("error") or stderr_tail(facts["stderr"])
                raise RuntimeError(f"launcher failed: {why}")
            if not sample:
                raise RuntimeError("no sample taken")
        return sample

    samples = interleave(impls, ctx.reps(2, 1), trial, warmup=0,
                         on_error=lambda i, m: res.error(i, "", m), log=ctx.log)
    record(res, samples)
    return res
