"""Text table, issue-4 targets (PASS/MISS), JSON file and PNG chart."""

from __future__ import annotations

import json
import os
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.common import Result

BASELINES = ("floor", "stdlib")
CLOSE_TIMEOUT_MS = 500.0


# --------------------------------------------------------------------------- numbers


def fnum(v: float | None) -> str:
    if v is None:
        return "-"
    if float(v).is_integer() and abs(v) < 1e7:
        return str(int(v))
    a = abs(v)
    if a >= 1000:
        return f"{v:.0f}"
    if a >= 100:
        return f"{v:.1f}"
    if a >= 10:
        return f"{v:.2f}"
    return f"{v:.3f}"


def fratio(v: float | None) -> str:
    if v is None:
        return "-"
    if v >= 100:
        return f"{v:.0f}x"
    if v >= 10:
        return f"{v:.1f}x"
    return f"{v:.2f}x"


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


# --------------------------------------------------------------------------- targets


@dataclass
class Target:
    id: str
    text: str
    scenarios: tuple[str, ...]
    # (results, impl) -> (shown value, passed) ; passed None = not measurable
    check: Callable[[dict[str, Result], str], tuple[str, bool | None]]


def _v(results, scen, key, impl):
    r = results.get(scen)
    return r.value(key, impl) if r else None


def _ratio_target(scen, key, base, limit, higher=False):
    def check(results, impl):
        a, b = _v(results, scen, key, impl), _v(results, scen, key, base)
        r = ratio(a, b)
        if r is None:
            return "-", None
        return fratio(r), (r >= limit if higher else r <= limit)

    return check


def _lag_check(results, impl):
    a, b = _v(results, "lag", "lag", impl), _v(results, "lag", "lag", "floor")
    if a is None or b is None:
        return "-", None
    d = a - b
    return f"{d:+.2f}ms", d <= 1.0


def _tee_vs_redirect(results, impl):
    r = ratio(_v(results, "tee", "mbps", impl), _v(results, "redirect", "mbps", impl))
    return (fratio(r), r >= 0.9) if r is not None else ("-", None)


def _tee_integrity(results, impl, scen="tee"):
    vals = [_v(results, scen, k, impl) for k in ("torn", "lost", "logs_bad")]
    if any(v is None for v in vals):
        return "-", None
    torn, lost, bad = (int(v) for v in vals)
    return f"{torn}/{lost}/{bad}", torn == 0 and lost == 0 and bad == 0


def _limit(scen, key, limit, unit=""):
    def check(results, impl):
        v = _v(results, scen, key, impl)
        if v is None:
            return "-", None
        return f"{fnum(v)}{unit}", v <= limit

    return check


def _many_check(results, impl):
    ok, missing = _v(results, "many", "ok", impl), _v(results, "many", "missing", impl)
    if ok is None:
        return "-", None
    return ("ok" if ok and not missing else f"ok={int(ok)} missing={missing}"), bool(ok) and not missing


def _nofile_check(results, impl):
    r = results.get("nofile")
    if not r:
        return "-", None
    ok, left = r.value("ok", impl), r.value("left_running", impl)
    if ok is None or left is None:
        return "-", None
    if ok:
        return "launched", left == 0
    err = (r.info.get(impl) or {}).get("error") or ""
    return f"error,{int(left)} left", left == 0 and bool(err)


TARGETS = [
    Target("launch128", "launch+reap 128 bins <= 1.15x floor", ("launch",),
           _ratio_target("launch", "n128", "floor", 1.15)),
    Target("launch1", "launch+reap 1 bin <= 1.5x floor", ("launch",),
           _ratio_target("launch", "n1", "floor", 1.5)),
    Target("lag", "exit lag, default wait() <= floor+1ms", ("lag",), _lag_check),
    Target("tee_speed", "tee MB/s >= 0.9x redirect MB/s", ("tee", "redirect"), _tee_vs_redirect),
    Target("tee_cpu", "tee launcher CPU <= 0.25x torch", ("tee",),
           _ratio_target("tee", "cpu", "torch", 0.25)),
    Target("tee_lines", "tee torn/lost lines/bad logs = 0/0/0", ("tee",), _tee_integrity),
    Target("teeobj_speed", "tee to a Python object MB/s >= 1.5x torch", ("teeobject",),
           _ratio_target("teeobject", "mbps", "torch", 1.5, higher=True)),
    Target("teeobj_lines", "tee to a Python object torn/lost/bad logs = 0/0/0", ("teeobject",),
           lambda results, impl: _tee_integrity(results, impl, "teeobject")),
    Target("idle_threads", "idle 64 teed: <= 1 extra thread", ("idle",), _limit("idle", "extra_threads", 1)),
    Target("idle_cpu", "idle 64 teed: <= 0.2% CPU", ("idle",), _limit("idle", "cpu_pct", 0.2, "%")),
    Target("idle_fds", "idle 64 teed: <= 4 fds per rank", ("idle",), _limit("idle", "fds_per_rank", 4)),
    Target("close", "close TERM-ignoring <= timeout+5ms", ("close",),
           _limit("close", "ignore_ms", CLOSE_TIMEOUT_MS + 5, "ms")),
    Target("many", "1024 teed ranks launch and reap", ("many",), _many_check),
    Target("nofile", "nofile=1024: runs, or error + 0 left", ("nofile",), _nofile_check),
    # issue 21: an agent's commands, against the stdlib it would use instead
    Target("run_true_wall", "run(true) wall <= 1.0x subprocess.run", ("agent",),
           _ratio_target("agent", "true_wall", "stdlib", 1.0)),
    Target("run_true_cpu", "run(true) CPU <= 1.0x subprocess.run", ("agent",),
           _ratio_target("agent", "true_cpu", "stdlib", 1.0)),
    Target("run_echo", "run(echo, capture) wall <= 0.8x stdlib", ("agent",),
           _ratio_target("agent", "echo_wall", "stdlib", 0.8)),
    Target("run_async_rate", "run_async launch/s >= 2x asyncio", ("agent",),
           _ratio_target("agent", "async_rate", "stdlib", 2.0, higher=True)),
    Target("run_async_cpu", "run_async CPU/launch <= 0.5x asyncio", ("agent",),
           _ratio_target("agent", "async_cpu", "stdlib", 0.5)),
    Target("context1", "start_processes(1)+wait+close <= 1.2x run", ("agent",),
           _ratio_target("agent", "context_wall", "stdlib", 1.2)),
]


def evaluate_targets(results: dict[str, Result], impls: list[str]) -> list[dict[str, Any]]:
    out = []
    for t in TARGETS:
        if not any(s in results for s in t.scenarios):
            continue
        row = {"id": t.id, "target": t.text, "results": {}}
        for impl in impls:
            shown, passed = t.check(results, impl)
            row["results"][impl] = {
                "value": shown,
                "status": "n/a" if passed is None else ("PASS" if passed else "MISS"),
            }
        out.append(row)
    return out


# --------------------------------------------------------------------------- text


def _status_cell(impl, res: Result, unavailable: dict[str, str]) -> str | None:
    if impl in unavailable:
        return "unavail"
    if impl in res.skipped:
        return "skip"
    if impl not in res.impls:
        return "n/a"
    return None


def fspread(vals: list[float] | None) -> str:
    """min..max of the samples behind a cell ('' for fewer than two)."""
    if not vals or len(vals) < 2:
        return ""
    return f"{fnum(min(vals))}..{fnum(max(vals))}"


def table(results: dict[str, Result], impls: list[str], unavailable: dict[str, str]) -> str:
    w0, w = 30, max([14] + [len(i) + 2 for i in impls])
    lines = []
    for res in results.values():
        lines.append("")
        lines.append(f"== {res.name}: {res.title} ({res.elapsed_s:.0f}s) ==")
        lines.append(" " * w0 + "".join(f"{i:>{w}}" for i in impls))
        for m in res.metrics.values():
            agg = "" if m.agg == "median" else f" {m.agg}"
            label = f"{m.label} ({m.unit}{agg})"
            cells = []
            for i in impls:
                st = _status_cell(i, res, unavailable)
                if st is None:
                    v = m.reduce(i)
                    st = fnum(v) if v is not None else ("error" if i in res.errors else "-")
                cells.append(st)
            lines.append(f"{label[:w0 - 1]:<{w0}}" + "".join(f"{c:>{w}}" for c in cells))
            # The spread behind each figure: a median is only as good as the samples around it.
            counts = sorted({len(m.values[i]) for i in impls if len(m.values.get(i) or ()) > 1})
            if counts:
                n = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
                cells = [fspread(m.values.get(i)) for i in impls]
                lines.append(f"{'  min..max of ' + n:<{w0}}" + "".join(f"{c:>{w}}" for c in cells))
            if m.better == "info":
                continue
            for b in BASELINES:
                bv = m.reduce(b)
                if bv is None or b not in impls:
                    continue
                if m.compare == "diff":
                    cells = [f"{m.reduce(i) - bv:+.2f}" if m.reduce(i) is not None else "" for i in impls]
                elif bv > 0:
                    cells = [fratio(ratio(m.reduce(i), bv)) if m.reduce(i) is not None else "" for i in impls]
                else:  # a zero or negative baseline has no meaningful ratio
                    continue
                lines.append(f"{'  vs ' + b:<{w0}}" + "".join(f"{c:>{w}}" for c in cells))
        for i, e in res.errors.items():
            lines.append(f"  ! {i}: {e}")
        for i, e in res.skipped.items():
            lines.append(f"  - {i}: skipped: {e}")
        for i, notes in res.info.items():
            if notes:
                text = ", ".join(f"{k}={_short(v)}" for k, v in notes.items())
                lines.append(f"  . {i}: {text}")
    return "\n".join(lines)


def _short(v, n=160):
    s = v if isinstance(v, str) else json.dumps(v, default=str)
    return s if len(s) <= n else s[: n - 3] + "..."


def targets_table(rows: list[dict[str, Any]], impls: list[str]) -> str:
    if not rows:
        return ""
    w0, w = 40, 20
    lines = ["", "== issue 4 targets (the subject is torchmp; other columns for context) =="]
    lines.append(" " * w0 + "".join(f"{i:>{w}}" for i in impls))
    for row in rows:
        cells = []
        for i in impls:
            r = row["results"][i]
            cells.append("-" if r["status"] == "n/a" else f"{r['status']} {r['value']}"[: w - 1])
        lines.append(f"{row['target'][:w0 - 1]:<{w0}}" + "".join(f"{c:>{w}}" for c in cells))
    return "\n".join(lines)


# --------------------------------------------------------------------------- json


def to_json(results: dict[str, Result], impls: list[str]) -> dict[str, Any]:
    out = {}
    for name, res in results.items():
        metrics = {}
        for key, m in res.metrics.items():
            per = {}
            bases = {b: m.reduce(b) for b in BASELINES}
            for i, vals in m.values.items():
                v = m.reduce(i)
                per[i] = {
                    "value": v,
                    "samples": vals,
                    "min": min(vals),
                    "max": max(vals),
                    **{f"ratio_vs_{b}": ratio(v, bv) for b, bv in bases.items() if bv},
                    **{f"diff_vs_{b}": v - bv for b, bv in bases.items() if bv is not None and m.compare == "diff"},
                }
            metrics[key] = {"label": m.label, "unit": m.unit, "better": m.better, "agg": m.agg,
                            "compare": m.compare, "impls": per}
        out[name] = {
            "title": res.title,
            "params": res.params,
            "elapsed_s": round(res.elapsed_s, 2),
            "impls": res.impls,
            "metrics": metrics,
            "info": res.info,
            "errors": res.errors,
            "skipped": res.skipped,
        }
    return out


def write_json(path: str, doc: dict[str, Any]) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)


# --------------------------------------------------------------------------- chart

# (scenario, metric keys, title, log scale)
PANELS = [
    ("launch", ["n1", "n16", "n128", "n1024"], "launch+reap /bin/true (ms)", True),
    ("funclaunch", None, "function launch (ms)", True),
    ("lag", ["lag"], "exit-detection lag (ms)", True),
    ("failfast", ["teardown_ms"], "failure -> siblings dead (ms)", True),
    ("tee", ["mbps"], "tee 4 ranks (MB/s)", False),
    ("redirect", ["mbps"], "redirect 4 ranks (MB/s)", False),
    ("tee", ["cpu"], "tee: launcher CPU (s)", False),
    ("console", ["wait_s", "workers_s", "blocked_s"], "console stalled 5 s (s)", True),
    ("idle", ["extra_threads", "fds_per_rank", "cpu_pct"], "64 idle teed ranks", True),
    ("close", ["plain_ms", "ignore_ms"], "close(timeout=0.5) (ms)", True),
    ("many", ["seconds"], "1024 teed ranks (s)", True),
    ("agent", ["true_wall", "echo_wall", "context_wall"], "agent: one command, wall per launch (ms)", True),
    ("agent", ["true_cpu", "echo_cpu", "context_cpu", "async_cpu"], "agent: launcher CPU per launch (ms)", True),
    ("agent", ["async_rate"], "agent: 256 x true, 32 in flight (launch/s)", False),
    ("agent", ["cold_wall", "cold_cpu"], "agent: fresh python, import + one run (ms)", False),
]
COLORS = {"torchmp": "#d62728", "stdlib": "#1f77b4", "floor": "#7f7f7f", "torch": "#ff7f0e", "torch-p01": "#bcbd22",
          "stdlib-contract": "#17becf", "floor-contract": "#9467bd"}


def chart(path: str, results: dict[str, Result], impls: list[str], subtitle: str) -> str | None:
    """Write the PNG; returns a message if it was skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install '.[bench]' or pip install matplotlib): chart skipped"
    panels = []
    for scen, keys, title, logy in PANELS:
        res = results.get(scen)
        if not res:
            continue
        keys = keys or list(res.metrics)
        keys = [k for k in keys if k in res.metrics and any(res.metrics[k].values.values())]
        if keys:
            panels.append((res, keys, title, logy))
    if not panels:
        return "no data to chart"
    cols = 3
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.6 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (res, keys, title, logy) in zip(axes.flat, panels, strict=False):  # spare axes are hidden above
        group = [i for i in impls if any(res.metrics[k].reduce(i) is not None for k in keys)]
        width = 0.8 / max(1, len(group))
        for j, impl in enumerate(group):
            xs, ys, vs = [], [], []
            for x, k in enumerate(keys):
                v = res.metrics[k].reduce(impl)
                if v is not None:
                    xs.append(x + (j - (len(group) - 1) / 2) * width)
                    ys.append(max(v, 1e-3) if logy else v)
                    vs.append(v)
            bars = ax.bar(xs, ys, width, label=impl, color=COLORS.get(impl))
            for b, y, v in zip(bars, ys, vs, strict=True):
                ax.annotate(fnum(v), (b.get_x() + b.get_width() / 2, y), ha="center", va="bottom",
                            fontsize=6, rotation=90 if len(keys) * len(group) > 8 else 0)
        ax.set_xticks(range(len(keys)))
        # Wrapped, so that the labels of a panel with several long ones do not overlap.
        ax.set_xticklabels([textwrap.fill(res.metrics[k].label, max(14, 64 // len(keys))) for k in keys], fontsize=8)
        ax.set_title(title, fontsize=10)
        if logy:
            ax.set_yscale("log")
        ax.tick_params(axis="y", labelsize=7)
        ax.legend(fontsize=7)
    fig.suptitle(f"torchmp benchmark — {subtitle}", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def load_json(doc: dict[str, Any]) -> dict[str, Result]:
    """Rebuild Results from a saved JSON document (for --report)."""
    out = {}
    for name, sd in doc.get("scenarios", {}).items():
        res = Result(name, sd.get("title", ""), sd.get("impls", []))
        res.params = sd.get("params", {})
        res.elapsed_s = sd.get("elapsed_s", 0.0)
        res.info = sd.get("info", {})
        res.errors = sd.get("errors", {})
        res.skipped = sd.get("skipped", {})
        for key, md in sd.get("metrics", {}).items():
            m = res.metric(key, md["label"], md["unit"], md.get("better", "lower"), md.get("agg", "median"),
                           md.get("compare", "ratio"))
            for impl, d in md.get("impls", {}).items():
                m.values[impl] = list(d.get("samples", []))
        out[name] = res
    return out


# --------------------------------------------------------------------------- two runs


def _rel(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or a == 0 else b / a - 1


def compare(doc_a: dict[str, Any], doc_b: dict[str, Any], only: list[str] | None, impls: list[str] | None,
            tolerance: float = 0.10) -> tuple[str, int]:
    """How far two runs' figures are apart: each median and each ratio to a baseline (for
    "diff" metrics the difference to it), run A -> run B, relative change; cells whose change
    exceeds ``tolerance`` are marked ``!``.  Returns (text, number of marked cells)."""
    ra, rb = load_json(doc_a), load_json(doc_b)
    lines = [f"A: {doc_a.get('date')} {doc_a.get('mode')} run ({doc_a.get('total_s')}s)",
             f"B: {doc_b.get('date')} {doc_b.get('mode')} run ({doc_b.get('total_s')}s)",
             f"change = B/A - 1; '!' marks a change beyond {tolerance:.0%}"]
    marked = 0

    def cell(a: float | None, b: float | None, fmt: Callable[[float | None], str]) -> str:
        nonlocal marked
        r = _rel(a, b)
        flag = "!" if r is not None and abs(r) > tolerance else " "
        marked += flag == "!"
        ch = "" if r is None else f"{r:+.1%}"
        return f"{fmt(a):>9} {fmt(b):>9} {ch:>7}{flag}"

    for name, res_a in ra.items():
        res_b = rb.get(name)
        if res_b is None or (only and name not in only):
            continue
        lines += ["", f"== {name} ==", f"{'':<34}{'value A':>9} {'value B':>9} {'change':>8}"
                  + "".join(f" {b + ' A':>9} {b + ' B':>9} {'change':>8}" for b in BASELINES)]
        for key, ma in res_a.metrics.items():
            mb = res_b.metrics.get(key)
            if mb is None or ma.better == "info":
                continue
            for impl in ma.values:
                if impls and impl not in impls:
                    continue
                row = f"{(ma.label + ' ' + impl)[:33]:<34}" + cell(ma.reduce(impl), mb.reduce(impl), fnum)
                for b in BASELINES:
                    ba, bb = ma.reduce(b), mb.reduce(b)
                    va, vb = ma.reduce(impl), mb.reduce(impl)
                    if b == impl or None in (ba, bb, va, vb):
                        row += " " * 28
                    elif ma.compare == "diff":
                        row += " " + cell(va - ba, vb - bb, lambda v: "-" if v is None else f"{v:+.3f}")  # type: ignore[operator]
                    else:
                        row += " " + cell(ratio(va, ba), ratio(vb, bb), fratio)
                lines.append(row.rstrip())
    lines.append("")
    lines.append(f"{marked} cell(s) changed by more than {tolerance:.0%}")
    return "\n".join(lines), marked


def agreement(doc: dict[str, Any], rounds: list[int], pairs: int = 2000, seed: int = 1) -> str:
    """How far apart two runs of n rounds would be, resampled from one run's samples.

    For every median metric of torchmp with a stdlib value, draw two runs of n
    rounds (with replacement) from the saved samples and compare their
    torchmp/stdlib ratios (for "diff" metrics: their torchmp - stdlib
    differences, relative to the full sample's); print the median and the
    90th percentile of that distance per n.  A pool of a few samples says
    little: the table gives its size.
    """
    import random

    rng = random.Random(seed)
    lines = [f"{'metric':<34}{'pool':>6}" + "".join(f"{f'{n} rounds':>16}" for n in rounds),
             "(median, 90th percentile of |run A - run B| over " f"{pairs} resampled pairs)"]
    for name, res in load_json(doc).items():
        for m in res.metrics.values():
            t, s = m.values.get("torchmp"), m.values.get("stdlib")
            if m.agg != "median" or m.better == "info" or not t or not s:
                continue
            cells = []
            for n in rounds:
                dist = sorted(_distance(rng, t, s, n, m.compare == "diff") for _ in range(pairs))
                cells.append(f"{dist[len(dist) // 2]:.0%}, {dist[int(len(dist) * 0.9)]:.0%}")
            label = f"{(name + ' ' + m.label)[:33]:<34}{min(len(t), len(s)):>6}"
            lines.append(label + "".join(f"{c:>16}" for c in cells))
    return "\n".join(lines)


def _distance(rng: Any, t: list[float], s: list[float], n: int, diff: bool) -> float:
    """Two resampled runs of n rounds: how far apart their torchmp-vs-stdlib figures are."""
    import statistics

    a, b = (statistics.median(rng.choices(t, k=n)) for _ in range(2))
    c, d = (statistics.median(rng.choices(s, k=n)) for _ in range(2))
    if diff:
        whole = statistics.median(t) - statistics.median(s)
        return abs((a - c) - (b - d)) / abs(whole) if whole else 0.0
    return abs((a / c) / (b / d) - 1) if c > 0 and d > 0 and b > 0 else 0.0
