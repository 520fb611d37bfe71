"""A launcher in its own process: ``python -m bench.child SPEC.json``.

Used where the launcher itself is what is measured: its fd 1/2 are files (so the
console can be checked line by line), its threads, fds, RSS and CPU are its own,
and its RLIMIT_NOFILE can be lowered.  It behaves like a user's launcher script:
start, wait, close, exit; if ``start`` raises, the exception propagates and the
interpreter exits the ordinary way (whatever is left running is the impl's doing).

The spec (JSON) holds: impl, entry, args {rank: [..]} or args_template + n, tag,
log_dir, redirects, tee, timeout, nofile, console ("object": ``sys.stdout`` is a
``PyConsole``), ready_fd, result.  A JSON line goes to
``ready_fd`` once start returned (or failed); the result JSON goes to ``result``.
"""

import json
import os
import resource
import sys
import time


def _snapshot():
    from bench.common import count_fds, count_threads, peak_rss_bytes, rss_bytes

    ru = resource.getrusage(resource.RUSAGE_SELF)
    rc = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "threads": count_threads(),
        "fds": count_fds(),
        "rss": rss_bytes(),
        "cpu": ru.ru_utime + ru.ru_stime,
        "cpu_children": rc.ru_utime + rc.ru_stime,
        "maxrss_kb": ru.ru_maxrss,  # includes the RSS of the bench at fork time: see peak_rss
        "peak_rss": peak_rss_bytes(),
        "t": time.monotonic(),
    }


def _check_subject(why):
    """This launcher must measure the torchmp the bench chose (bench/subject.py), or fail."""
    from bench import subject
    from bench.impls import torchmp_module

    if why is not None:
        raise subject.SubjectMissing(f"the subject is missing in the child launcher: {why}")
    home = os.environ.get(subject.HOME_VAR)
    if torchmp_module() == "torchmp" and home:
        subject.check_imported(sys.modules["torchmp"], os.path.realpath(os.path.join(home, "torchmp")))


class PyConsole:
    """A console written in Python, as a notebook's stream or a framework
    that routes output is: ``write(str)`` into a text file on fd 1's file."""

    def __init__(self) -> None:
        self.file = open(os.dup(1), "w", encoding="utf-8", errors="surrogateescape")

    def write(self, text: str) -> int:
        return self.file.write(text)

    def flush(self) -> None:
        self.file.flush()


def main(argv):
    with open(argv[1]) as f:
        spec = json.load(f)
    if spec.get("console") == "object":
        sys.stdout = PyConsole()
    if spec.get("nofile"):
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (int(spec["nofile"]), hard))

    from bench import impls
    from bench.common import TAG_VAR, fmt_exc

    ready_fd = spec["ready_fd"]
    result = {"impl": spec["impl"], "ok": False}

    def emit_ready(msg):
        os.write(ready_fd, (json.dumps(msg) + "\n").encode())

    def save():
        with open(spec["result"] + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(spec["result"] + ".tmp", spec["result"])

    impl = impls.make(spec["impl"])
    why = impl.check()
    if spec["impl"] == "torchmp":
        _check_subject(why)
    if why is not None:
        result["unavailable"] = why
        save()
        emit_ready({"started": False, "unavailable": why})
        return 0

    if "args_template" in spec:
        n = int(spec["n"])
        args = {r: tuple(a.format(rank=r) for a in spec["args_template"]) for r in range(n)}
    else:
        args = {int(r): tuple(a) for r, a in spec["args"].items()}
        n = len(args)
    envs = {r: {TAG_VAR: spec["tag"], **spec.get("env", {})} for r in range(n)}

    before = _snapshot()
    result["before"] = before
    result["rlimit_nofile_before"] = resource.getrlimit(resource.RLIMIT_NOFILE)
    t0 = time.monotonic()
    try:
        job = impl.start_binary(spec["entry"], args, envs, spec["log_dir"],
                                spec.get("redirects", 0), spec.get("tee", 0))
    except BaseException as e:
        result.update(stage="start", error=fmt_exc(e), error_type=type(e).__name__,
                      errno=getattr(e, "errno", None), t_fail=time.monotonic() - t0,
                      rlimit_nofile_after=resource.getrlimit(resource.RLIMIT_NOFILE))
        save()
        emit_ready({"started": False, "error": fmt_exc(e)})
        raise  # as a user's launcher would: traceback, exit status 1
    t1 = time.monotonic()
    emit_ready({"started": True, "n": n, "threads_before": before["threads"],
                "fds_before": before["fds"], "rss_before": before["rss"], "pids": job.pids()})
    try:
        out = job.wait(float(spec.get("timeout", 300)))
        t2 = time.monotonic()
        job.close(float(spec.get("close_timeout", 30)))
    except BaseException as e:
        result.update(stage="wait", error=fmt_exc(e), error_type=type(e).__name__)
        save()
        raise
    t3 = time.monotonic()
    sys.stdout.flush()
    sys.stderr.flush()
    after = _snapshot()
    result.update(
        ok=True,
        failed=out.failed,
        failures={str(k): v for k, v in out.failures.items()},
        stdouts={str(k): v for k, v in out.stdouts.items()},
        stderrs={str(k): v for k, v in out.stderrs.items()},
        t_start=t1 - t0,
        t_wait=t2 - t0,
        t_close=t3 - t0,
        t0_mono=t0,  # CLOCK_MONOTONIC: lets the bench place these times on its own clock
        cpu_self=after["cpu"] - before["cpu"],
        cpu_children=after["cpu_children"] - before["cpu_children"],
        after=after,
        rlimit_nofile_after=resource.getrlimit(resource.RLIMIT_NOFILE),
        resources=bool(out.resources),
    )
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
