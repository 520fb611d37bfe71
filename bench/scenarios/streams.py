"""``tee`` and ``redirect``: stream throughput, launcher CPU, line integrity.

4 ranks, each ``/bin/cat`` of a file of 100-byte lines (50 MB per rank; 10 MB
with --quick).  Each line is ``r<rank:04> s<seq:010> <81 letters>\\n``, so every
console line can be traced back to its rank and sequence number.

The launcher runs in a child process (``bench.child``) whose fd 1 is a file:
that file is the console.

* ``tee``: tee=ALL (redirects NONE).  Checked: MB/s (total bytes / time from
  start to ``wait()`` + ``close()`` returned), the launcher's CPU seconds
  (getrusage(RUSAGE_SELF) of the launcher process over that span, all its
  threads), and integrity: every console line must be ``[bench<r>]:`` + one
  whole worker line of rank r; we count whole, torn (any other line) and lost
  (expected minus distinct whole) lines, and compare each ``stdout.log`` with
  the data byte for byte.
* ``redirect``: redirects=ALL, tee NONE: MB/s, launcher CPU, exact log files,
  empty console.
* ``teeobject``: tee=ALL as in ``tee``, but the launcher's ``sys.stdout`` is a
  console written in Python (``PyConsole``: ``write(str)`` into a text file,
  as a notebook's stream or a framework that routes output is), torchmp and
  torch only (the others write fd 1 or ``sys.stdout.buffer``).  The same
  checks as ``tee``: MB/s, launcher CPU, and the verify run of every console
  line (whole, torn, lost, duplicated) and of every ``stdout.log``.

Targets: tee >= 0.9x redirect (same impl), tee CPU <= 0.25x torch, 0 torn/lost;
teeobject >= 1.5x torch's MB/s, 0 torn/lost.
"""

import filecmp
import os
import re

from bench.common import Result, fmt_exc, interleave, record, retire, run_child, stderr_tail, trial_scope
from bench.impls import ALL_IMPLS

RANKS = 4
LINE = 100
# (full, quick) rounds: redirect's sub-0.1 s trials need more of them than tee's
# for two runs to agree within 10 %, its launcher CPU most of all: each trial's
# is one fresh process's (bench/README.md, "Noise").  torch's trials take
# seconds each (its import in the launcher, its one-second poll), and its
# figures are far from the rest: it keeps the rounds redirect had before.
REPS = {"tee": (3, 2), "teeobject": (3, 2), "redirect": (60, 3)}
TORCH_REPS = (15, 3)
PAD = (b"abcdefghijklmnopqrstuvwxyz" * 4)[:81]
NAME = b"bench"


def _line(rank: int, seq: int) -> bytes:
    return b"r%04d s%010d %s\n" % (rank, seq, PAD)


def make_data(d: str, mb: int) -> tuple[list[str], int]:
    """One data file per rank; returns (paths, lines per rank)."""
    lines = mb * 1_000_000 // LINE
    paths = []
    for r in range(RANKS):
        p = os.path.join(d, f"rank{r}.dat")
        with open(p, "wb") as f:
            step = 100_000
            for s0 in range(0, lines, step):
                f.write(b"".join([_line(r, s) for s in range(s0, min(lines, s0 + step))]))
        paths.append(p)
    return paths, lines


_RX = re.compile(rb"\[" + NAME + rb"(\d+)\]:r(\d{4}) s(\d{10}) " + re.escape(PAD) + rb"\n")


def check_console(path: str, ranks: int, lines: int) -> dict[str, int]:
    """Count whole / torn / duplicated / lost console lines."""
    seen = [bytearray(lines) for _ in range(ranks)]
    whole = torn = dup = 0
    match = _RX.fullmatch
    with open(path, "rb") as f:
        for raw in f:
            m = match(raw)
            if m is None:
                torn += 1
                continue
            r, r2, s = int(m[1]), int(m[2]), int(m[3])
            if r != r2 or r >= ranks or s >= lines:
                torn += 1
                continue
            if seen[r][s]:
                dup += 1
            else:
                seen[r][s] = 1
                whole += 1
    return {"whole": whole, "torn": torn, "dup": dup, "lost": ranks * lines - whole}


OBJECT_IMPLS = ["torchmp", "torch"]


def _run(ctx, scen: str) -> Result:
    tee = scen in ("tee", "teeobject")
    to_object = scen == "teeobject"
    impls = ctx.select(OBJECT_IMPLS if to_object else ALL_IMPLS)
    title = ("tee to a Python object as sys.stdout" if to_object else "tee with prefixes" if tee
             else "redirect only") + f", {RANKS} ranks x %d MB of 100-byte lines (launcher in a child process)"
    mb = 10 if ctx.quick or to_object else 50
    res = Result(scen, title % mb, impls)
    res.params = {"ranks": RANKS, "mb_per_rank": mb, "line_bytes": LINE, "worker": "/bin/cat FILE",
                  "redirects": "NONE" if tee else "ALL", "tee": "ALL" if tee else "NONE",
                  "console": "PyConsole (write(str) in Python) as sys.stdout" if to_object else "fd 1, a file"}
    res.metric("mbps", "throughput", "MB/s", "higher")
    res.metric("seconds", "start..wait+close", "s", "lower")
    res.metric("cpu", "launcher CPU", "s", "lower")
    if tee:
        res.metric("torn", "torn lines", "n", "info", agg="max")
        res.metric("lost", "lost lines", "n", "info", agg="max")
    res.metric("logs_bad", "log files not exact", "n", "info", agg="max")
    datadir = ctx.mkdtemp(f"{scen}-data")
    ctx.log(f"  generating {RANKS} x {mb} MB")
    paths, lines = make_data(datadir, mb)
    total = sum(os.path.getsize(p) for p in paths)

    def trial(impl):
        with trial_scope(ctx, scen) as s:
            spec = {"impl": impl, "entry": "/bin/cat", "args": {str(r): [paths[r]] for r in range(RANKS)},
                    "tag": s.tag, "log_dir": os.path.join(s.dir, "logs"), "redirects": 0 if tee else 3,
                    "tee": 3 if tee else 0, "timeout": 600}
            if to_object:
                spec["console"] = "object"
            result, facts = run_child(ctx, spec, s.dir, timeout=900)
            if facts["hung"]:
                raise RuntimeError("launcher did not finish")
            if not result or not result.get("ok"):
                why = (result or {}).get("error") or stderr_tail(facts["stderr"])
                raise RuntimeError(f"launcher failed: {why}")
            if result.get("failed"):
                raise RuntimeError(f"workers failed: {result.get('failures')}")
            bad = 0
            for r in range(RANKS):
                log = result["stdouts"].get(str(r))
                try:
                    same = bool(log) and filecmp.cmp(log, paths[r], shallow=False)
                except OSError as e:
                    same = False
                    res.note(impl, f"log{r}", fmt_exc(e))
                bad += not same
            sample = {"mbps": total / 1e6 / result["t_close"], "seconds": result["t_close"],
                      "cpu": result["cpu_self"], "logs_bad": bad}
            if tee:
                c = check_console(facts["console"], RANKS, lines)
                sample.update(torn=c["torn"], lost=c["lost"])
                if c["dup"]:
                    res.note(impl, "duplicated_lines", c["dup"])
            else:
                size = os.path.getsize(facts["console"])
                if size:
                    res.note(impl, "console_bytes", size)
            return sample

    try:
        torch_reps = ctx.reps(*TORCH_REPS)
        samples = interleave(impls, ctx.reps(*REPS[scen]), trial, warmup=0,
                             on_error=lambda i, m: res.error(i, "", m), log=ctx.log,
                             at_most={"torch": torch_reps, "torch-p01": torch_reps})
    finally:
        retire(datadir)
    record(res, samples)
    return res


def run_tee(ctx) -> Result:
    return _run(ctx, "tee")


def run_redirect(ctx) -> Result:
    return _run(ctx, "redirect")


def run_teeobject(ctx) -> Result:
    return _run(ctx, "teeobject")
