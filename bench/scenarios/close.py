"""``close``: latency of ``close(timeout=0.5)``.

4 ranks, two kinds: plain ``/bin/sleep 100`` (die on SIGTERM) and TERM-ignoring
``sh -c "trap '' TERM; exec sleep 100"`` (need the SIGKILL after the timeout).
Before ``close`` we wait until every worker runs ``sleep`` (and, for the
TERM-ignoring kind, until SIGTERM shows in its ``SigIgn`` mask).  Timed from the
call to the return of ``close``; afterwards every worker must be gone and reaped.
Target: TERM-ignoring <= timeout + 5 ms.
"""

from bench.common import Result, interleave, mono_ns, proc_state, record, trial_scope, wait_until

TITLE = "close(timeout=0.5) latency, 4 ranks: call .. return"
IMPLS = ["torchmp", "stdlib", "floor", "torch"]  # period plays no part in close
N = 4
TIMEOUT = 0.5
KINDS = {
    "plain": ("/bin/sleep", ("100",)),
    "ignore": ("/bin/sh", ("-c", "trap '' TERM; exec sleep 100")),
}


def _ready(pid: int, need_ignore: bool) -> bool:
    try:
        with open(f"/proc/{pid}/comm") as f:
            if f.read().strip() != "sleep":
                return False
        if need_ignore:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("SigIgn:"):
                        return bool(int(line.split()[1], 16) & (1 << 14))
            return False
        return True
    except OSError:
        return False


def run_close(ctx) -> Result:
    impls = ctx.select(IMPLS)
    res = Result("close", TITLE, impls)
    res.params = {"n": N, "timeout_s": TIMEOUT, "kinds": {k: " ".join([e, *a]) for k, (e, a) in KINDS.items()}}
    for kind, (entry, a) in KINDS.items():
        key = f"{kind}_ms"
        res.metric(key, "TERM-ignoring" if kind == "ignore" else "plain", "ms", "lower")

        def trial(impl, kind=kind, entry=entry, a=a, key=key):
            with trial_scope(ctx, "close") as s:
                job = s.track(ctx.impls[impl].start_binary(entry, {r: a for r in range(N)}, s.envs(N), s.dir))
                pids = list(job.pids().values())
                if not wait_until(lambda: all(_ready(p, kind == "ignore") for p in pids), 10.0):
                    raise RuntimeError("workers did not reach sleep")
                t0 = mono_ns()
                job.close(TIMEOUT)
                t1 = mono_ns()
                states = [proc_state(p) for p in pids]
                if any(st is not None for st in states):
                    raise RuntimeError(f"workers not gone/reaped after close: {states}")
            return {key: (t1 - t0) / 1e6}

        ctx.log(f"  {kind}")
        samples = interleave(impls, ctx.reps(7, 3), trial, warmup=0,
                             on_error=lambda i, m, k=kind: res.error(i, k, m), log=ctx.log)
        record(res, samples)
    return res
