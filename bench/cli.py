"""Command line: parse options, run the scenarios, print, save."""

from __future__ import annotations

import argparse
import dataclasses
import json
import datetime
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback

from bench import report, scenarios, subject
from bench.common import REPO_ROOT, Ctx, is_interrupt, set_child_subreaper
from bench.machine import git_info, log_dir_info, machine_info
from bench.impls import ALL_IMPLS, DEFAULT_IMPLS, TORCH_MODULE, resolve, torchmp_module


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Benchmark torchmp against a careful stdlib launcher, the posix_spawn/pidfd floor "
                    "and torch's module, side by side in one run (see bench/README.md).",
        epilog="scenarios: " + "; ".join(f"{k}: {v}" for k, v in scenarios.TITLES.items()))
    p.add_argument("--quick", action="store_true", help="smaller data, fewer repetitions (< 5 min on 2 cores)")
    p.add_argument("--only", type=_csv, default=None, metavar="SCENARIO[,..]",
                   help=f"scenarios to run (default all: {','.join(scenarios.ORDER)})")
    p.add_argument("--impl", type=_csv, default=None, metavar="IMPL[,..]",
                   help=f"implementations (default: {','.join(DEFAULT_IMPLS)}; also: "
                        f"{','.join(i for i in ALL_IMPLS if i not in DEFAULT_IMPLS)})")
    p.add_argument("--repeat", type=int, default=None, metavar="N",
                   help="repetitions per measurement (overrides the per-scenario defaults)")
    p.add_argument("--json", default=os.path.join(REPO_ROOT, "docs", "bench.json"), metavar="PATH",
                   help="where to write the results (default docs/bench.json)")
    p.add_argument("--chart", default=os.path.join(REPO_ROOT, "docs", "bench.png"), metavar="PATH",
                   help="where to write the PNG chart (default docs/bench.png; needs matplotlib)")
    p.add_argument("--keep-tmp", action="store_true", help="keep the temporary directory")
    p.add_argument("--list", action="store_true", help="list scenarios and implementations, then exit")
    p.add_argument("--subject", action="store_true",
                   help="print which torchmp would be measured (path, version, compiled core) and exit; "
                        "exit status 2 if there is none")
    p.add_argument("--report", metavar="JSON", default=None,
                   help="measure nothing: print the table and draw the chart from a saved JSON file")
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), default=None,
                   help="measure nothing: how far two saved runs are apart, per median and per ratio "
                        "(--only/--impl filter; --tolerance marks the cells beyond it)")
    p.add_argument("--tolerance", type=float, default=0.10, metavar="FRACTION",
                   help="for --compare: mark changes beyond this fraction (default 0.10)")
    p.add_argument("--agreement", metavar="JSON", default=None,
                   help="measure nothing: from a saved run's samples, how far two runs of 15, 30 and 60 "
                        "rounds would be apart on each torchmp/stdlib figure (how the default rounds were chosen)")
    a = p.parse_args(argv)
    for s in a.only or []:
        if s not in scenarios.ORDER:
            p.error(f"unknown scenario {s!r} (known: {', '.join(scenarios.ORDER)})")
    for i in a.impl or []:
        if i not in ALL_IMPLS:
            p.error(f"unknown impl {i!r} (known: {', '.join(ALL_IMPLS)})")
    if a.repeat is not None and a.repeat < 1:
        p.error("--repeat must be >= 1")
    return a


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv=None) -> int:
    a = parse(argv)
    if a.agreement:
        with open(a.agreement) as f:
            print(report.agreement(json.load(f), [15, 30, 60]))
        return 0
    if a.compare:
        docs = []
        for path in a.compare:
            with open(path) as f:
                docs.append(json.load(f))
        text, _marked = report.compare(docs[0], docs[1], a.only, a.impl, a.tolerance)
        print(text)
        return 0
    if a.report:
        with open(a.report) as f:
            doc = json.load(f)
        render(doc, report.load_json(doc), a.chart)
        return 0
    if a.list:
        for s in scenarios.ORDER:
            print(f"{s:<11} {scenarios.TITLES[s]}")
        print("impls:", ", ".join(ALL_IMPLS))
        return 0
    only = a.only or scenarios.ORDER
    order = [s for s in scenarios.ORDER if s in only]
    names = [i for i in ALL_IMPLS if i in (a.impl or DEFAULT_IMPLS)]
    subj = None
    if "torchmp" in names or a.subject:
        # The subject must be there before anything is measured: never a table without it.
        try:
            subj = subject.resolve(torchmp_module())
        except subject.SubjectMissing as e:
            log(f"bench: refusing to run: {e}")
            return 2
        log(f"bench: measuring {subj.describe()}")
    if a.subject:
        print(subj.describe())
        return 0
    missing = scenarios.missing_modules(order)
    for s, modules in missing.items():
        log(f"bench: refusing to run: the {s} scenario needs {', '.join(modules)}, which does not import here "
            f"(pip install '.[bench]', or leave {s} out with --only)")
    if missing:
        return 2
    set_child_subreaper()
    signal.signal(signal.SIGTERM, _terminate)  # clean up like ^C does

    started = time.monotonic()
    load_start = os.getloadavg()
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    log(f"bench: {'quick' if a.quick else 'full'} run, scenarios {','.join(order)}")
    impls, unavailable = resolve(names)
    if "torchmp" in unavailable:
        log(f"bench: refusing to run: {subj.describe() if subj else 'torchmp'}: {unavailable['torchmp']}")
        return 2
    versions = {n: impls[n].version() for n in impls}
    for n in names:
        if n in impls:
            log(f"  {n:<10} available ({versions[n] or '?'})")
        else:
            log(f"  {n:<10} UNAVAILABLE: {unavailable[n]}")
    tmp = tempfile.mkdtemp(prefix="torchmp-bench-")
    log_dirs = log_dir_info(tmp, keep=True)
    log(f"bench: log directories under {tmp} ({log_dirs['fstype']}): mkdir {log_dirs['mkdir_us_median']} us")
    ctx = Ctx(impls, unavailable, a.quick, a.repeat, tmp, log)
    results = {}
    failed: dict[str, str] = {}
    try:
        for s in order:
            log(f"[{s}] ({time.monotonic() - started:.0f}s elapsed)")
            t = time.monotonic()
            try:
                res = scenarios.get(s)(ctx)
            except Exception as e:
                if is_interrupt(e):
                    raise  # handled below: not a failure of this scenario
                # One scenario's failure does not cost the others theirs: it is
                # reported with its traceback, and the exit status says so.
                failed[s] = traceback.format_exc()
                log(f"bench: the {s} scenario failed; going on with the others:\n{failed[s]}")
                continue
            res.elapsed_s = time.monotonic() - t
            results[s] = res
    except BaseException as e:
        # ^C, or SIGTERM (is_interrupt): report what was measured.
        if not is_interrupt(e):
            raise
        log(f"interrupted ({type(e).__name__}): reporting what was measured")
    finally:
        ctx.close()
        # Again at the end: on some file systems a mkdir gets slower after
        # deletions nearby, the run's own included; the run keeps its trials'
        # inodes until now for that reason (bench/README.md, "The log
        # directories").
        log_dirs["mkdir_us_median_at_end"] = log_dir_info(tmp, keep=True)["mkdir_us_median"]
        if a.keep_tmp:
            log(f"temporary files kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    total = time.monotonic() - started

    mach = machine_info()
    mach["loadavg_at_start"] = load_start
    mach["loadavg_at_end"] = os.getloadavg()
    mach["log_dirs"] = log_dirs
    tm_mod = torchmp_module()
    doc = {
        "date": date,
        "mode": "quick" if a.quick else "full",
        "argv": sys.argv[1:] if argv is None else list(argv),
        "total_s": round(total, 1),
        "machine": mach,
        "git": git_info(),
        "versions": {"python": mach["python"], **{n: versions.get(n) for n in names},
                     "torchmp_module": tm_mod, "torch_module": TORCH_MODULE},
        "subject": dataclasses.asdict(subj) if subj else None,
        "impls": {n: ({"available": True, "version": versions[n]} if n in impls
                      else {"available": False, "reason": unavailable[n]}) for n in names},
        "scenarios": report.to_json(results, names),
        "targets": report.evaluate_targets(results, names),
    }
    if failed:
        doc["failed_scenarios"] = failed
    report.write_json(a.json, doc)
    render(doc, results, a.chart)
    print(f"results: {a.json}")
    if failed:
        log(f"bench: {len(failed)} scenario(s) failed ({', '.join(failed)}); the others are saved")
        return 1
    return 0


def _load(v) -> str:
    return f"{v[0]:.2f}" if v else "?"


def _terminate(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def render(doc, results, chart_path) -> None:
    """Print header, table and targets; draw the chart."""
    names = list(doc["impls"])
    unavailable = {n: d["reason"] for n, d in doc["impls"].items() if not d.get("available")}
    versions = {n: d.get("version") for n, d in doc["impls"].items()}
    mach = doc["machine"]
    header = [
        f"torchmp benchmark, {doc['date']}, {doc['mode']} run, {doc['total_s']:.0f}s",
        f"machine: {mach['nproc']} cpus ({mach['cpu_model']}), kernel {mach['kernel']}, "
        f"python {mach['python']}, load average {_load(mach.get('loadavg_at_start'))} at start, "
        f"{_load(mach.get('loadavg_at_end'))} at end",
        "versions: " + ", ".join(f"{n} {versions.get(n) or 'unavailable'}" for n in names),
    ]
    dirs = mach.get("log_dirs")
    if dirs:
        header.append(f"log directories: under {dirs['root']}, a {dirs['fstype']} file system ({dirs['source']}): "
                      f"mkdir {dirs['mkdir_us_median']} us at the start, {dirs.get('mkdir_us_median_at_end', '?')} us "
                      "at the end (torch's layout makes 2 + N per launch)")
    subj = doc.get("subject")
    if subj:
        core = f", core {subj['core']}" if subj.get("core") else ""
        header.append(f"measured: {subj['module']} {subj['version']} from {subj['path']}{core}")
    tm_mod = doc["versions"].get("torchmp_module")
    if tm_mod and tm_mod != "torchmp":
        header.append(f"NOTE: the torchmp column is {tm_mod} (BENCH_TORCHMP_MODULE)")
    # Scenarios measured in a run of their own and merged into this file.
    separate = doc.get("separate_runs", {})
    for scen, run in separate.items():
        header.append(f"{scen}: a separate run, {run['date']}, load average "
                      f"{_load(run['machine'].get('loadavg_at_start'))} at start, "
                      f"{_load(run['machine'].get('loadavg_at_end'))} at end (python -m bench {' '.join(run['argv'])})")
    for n, why in unavailable.items():
        header.append(f"unavailable: {n}: {why}")
    for scen, tb in doc.get("failed_scenarios", {}).items():
        header.append(f"FAILED: the {scen} scenario: {tb.strip().splitlines()[-1]} (no figures)")
    header.append("values are medians unless marked; 'vs X' rows are ratios to X's value in this run")
    print("\n".join(header))
    print(report.table(results, names, unavailable))
    print(report.targets_table(report.evaluate_targets(results, names), names))
    print()
    sub = f"{doc['date'][:10]}, {mach['nproc']} cpus, {mach['cpu_model']}, {doc['mode']} run"
    if tm_mod and tm_mod != "torchmp":
        sub += f" (torchmp column = {tm_mod})"
    if separate:
        sub += "; " + ", ".join(f"{scen}: {run['date'][:10]}" for scen, run in separate.items())
    msg = report.chart(chart_path, results, names, sub)
    print(f"chart: {chart_path}" if msg is None else f"chart: {msg}")
