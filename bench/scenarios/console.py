"""``console``: tee into a console that nobody reads for 5 s, then drains.

A launcher's console is often a pipe whose reader can stall: a terminal paused
with ^S, a ``| less`` nobody scrolls, a log shipper that is backed up.  Whether
that stalls the *workers* (and ``wait()``) depends on the launcher: a tee that
writes the console with blocking writes stops reading the workers' pipes once
the console pipe is full, so the workers block in ``write()`` and training
waits for a terminal.  This scenario measures what each impl does.

4 ranks, tee=ALL with the default prefixes.  Each worker is a small Python
program (``python -S -c WORKER``) that writes a file of 100-byte lines
(``r<rank:04> s<seq:010> <81 letters>``, as in ``tee``; 8 MB per rank, 2 MB
with --quick, far more than a 64 KiB pipe buffer) to its stdout in 8000-byte
``os.write`` calls (about what a block-buffered ``print`` does) as fast as it
can, summing ``time.monotonic_ns()`` around each call, then exits 0.  It writes
its totals to a report file, not to a stream, so they survive a launcher that
never forwards them.

The launcher runs in a child process (``bench.child``) whose fd 1 is the write
end of a pipe.  The bench does not read that pipe until 5 s after ``start``
returned (also with --quick: the stall is the point), then reads it to EOF.
Every trial has a hard timeout of 60 s; a launcher still running then is
killed and reported as hung, its workers killed by BENCH_TAG (process group).

Reported per impl:

* start..``wait()`` returned, start..``close()`` returned, start..the last
  worker's last write returned, and whether ``wait()`` returned before the
  drain began (a launcher whose tee blocks on the console cannot);
* the workers' time inside ``write()`` (max over ranks);
* whether every ``stdout.log`` equals the data byte for byte, and how many
  bytes are missing if not;
* the launcher's peak RSS (VmHWM; ``ru_maxrss`` would include the bench's own
  RSS, carried across exec) and its growth over the RSS before ``start`` (an
  impl that buffers the stalled console in memory shows here);
* console lines: whole worker lines (distinct), torn lines (a fragment of a
  worker line: must be 0) and other lines (anything that is not worker data,
  e.g. an impl's marker that lines were not shown).  Reported, never failed on.

``floor`` is not run: its tee loop writes the console with plain blocking
writes and has no policy for a stalled console, so it is no limit here, just
one more launcher that blocks (like ``stdlib``).
"""

from __future__ import annotations

import filecmp
import glob
import os
import re
import select
import sys
import threading
import time

from bench.common import Result, fmt_exc, interleave, record, retire, run_child, stderr_tail, trial_scope
from bench.scenarios.streams import _RX, NAME, PAD, RANKS, make_data

STALL_S = 5.0
HARD_TIMEOUT = 60.0  # per trial; a launcher still running then is killed and reported as hung
WAIT_TIMEOUT = 50.0  # the launcher's own wait(timeout): a well-behaved impl times out before the kill
CHUNK = 8000  # bytes per write(): 80 whole lines

# The worker: argv = data file, chunk size, report file.  Only builtin modules
# (-S: no site), so it starts in ~10 ms and measures the writes, not imports.
# The report is written even if a write fails (EPIPE from a dead launcher).
WORKER = """\
import os, sys, time
path, chunk, report = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with open(path, 'rb') as f:
    mv = memoryview(f.read())
off = blocked = 0
t_first = time.monotonic_ns()
try:
    while off < len(mv):
        t = time.monotonic_ns()
        n = os.write(1, mv[off:off + chunk])
        blocked += time.monotonic_ns() - t
        off += n
finally:
    t_end = time.monotonic_ns()
    with open(report + '.tmp', 'w') as f:
        f.write('%d %d %d %d' % (off, blocked, t_first, t_end))
    os.replace(report + '.tmp', report)
"""


# --------------------------------------------------------------------------- console


class _Drain(threading.Thread):
    """Holds the console pipe unread until ``STALL_S`` after ``arm()``, then reads it to EOF.

    ``arm`` is the ``on_ready`` hook of ``run_child``, so the stall counts from
    the moment ``start`` returned (the workers are writing by then).  Reads are
    bounded by poll timeouts so a write end held by a leftover process cannot
    hang the bench: ``stop()`` ends the thread.
    """

    def __init__(self, fd: int, path: str):
        super().__init__(daemon=True)
        self.fd = fd
        self.path = path
        self.t_armed: float | None = None
        self.t_drain: float | None = None
        self._armed = threading.Event()
        self._halt = threading.Event()

    def arm(self, *_):
        if not self._armed.is_set():
            self.t_armed = time.monotonic()
            self._armed.set()

    def stop(self):
        self.arm()
        self._halt.set()

    def run(self):
        self._armed.wait()
        left = self.t_armed + STALL_S - time.monotonic()
        if left > 0:
            self._halt.wait(left)  # stop(): start failed, or a leftover holds the pipe; still drain
        self.t_drain = time.monotonic()
        with open(self.path, "wb") as out:
            while True:
                r, _, _ = select.select([self.fd], [], [], 0.2)
                if not r:
                    if self._halt.is_set():
                        break
                    continue
                chunk = os.read(self.fd, 1 << 20)
                if not chunk:
                    break
                out.write(chunk)


_HEAD = re.compile(rb"r\d{4} s\d{10} ")  # a worker line's head, anywhere in a console line
_PREFIX = re.compile(rb"\[" + NAME + rb"\d+\]:")
# what is left of a worker line cut anywhere: [r][digits][ ][s][digits][ ][letters]
_FRAG = re.compile(rb"r?\d{0,4} ?s?\d{0,10} ?([a-z]*)")


def _is_fragment(raw: bytes) -> bool:
    """Is this console line (not a whole worker line) a piece of worker data?"""
    if not raw.endswith(b"\n"):
        return True  # cut off at the end of the console
    body = raw[:-1]
    m = _PREFIX.match(body)
    if m:
        body = body[m.end():]
    if _HEAD.search(body):
        return True  # two lines run together, or a line with a foreign prefix
    m = _FRAG.fullmatch(body)
    # the letters must be a piece of PAD: an impl's own message ("12 dropped") is not
    return m is not None and m[1] in PAD


def classify_console(path: str, ranks: int, lines: int) -> dict:
    """Count whole (distinct) / duplicated / torn / other console lines.

    ``cut_end``: the console ends without a newline (its last line, counted as
    torn, was cut: the launcher exited with a partial line written).
    """
    seen = [bytearray(lines) for _ in range(ranks)]
    whole = dup = torn = other = 0
    example = None
    cut_end = False
    match = _RX.fullmatch
    with open(path, "rb") as f:
        for raw in f:
            cut_end = not raw.endswith(b"\n")
            m = match(raw)
            if m is not None:
                r, r2, s = int(m[1]), int(m[2]), int(m[3])
                if r == r2 and r < ranks and s < lines:
                    if seen[r][s]:
                        dup += 1
                    else:
                        seen[r][s] = 1
                        whole += 1
                    continue
            if _is_fragment(raw):
                torn += 1
            else:
                other += 1
                if example is None:
                    example = raw[:200].decode(errors="replace").rstrip("\n")
    return {"whole": whole, "dup": dup, "torn": torn, "other": other, "example": example, "cut_end": cut_end}


# --------------------------------------------------------------------------- logs and workers


def _log_path(result: dict | None, logdir: str, r: int) -> str | None:
    """The impl's stdout.log of rank r; found on disk when the launcher never reported."""
    if result and result.get("stdouts", {}).get(str(r)):
        return result["stdouts"][str(r)]
    # stdlib/floor: logs/<r>/stdout.log; torch/torchmp: logs/<run id>/attempt_0/<r>/stdout.log
    found = glob.glob(os.path.join(logdir, "**", str(r), "stdout.log"), recursive=True)
    return found[0] if len(found) == 1 else None


def _check_logs(result, logdir, paths) -> tuple[bool, int, dict]:
    """(every log exact, bytes missing over all ranks, notes)."""
    exact, missing, notes = True, 0, {}
    for r, data in enumerate(paths):
        want = os.path.getsize(data)
        log = _log_path(result, logdir, r)
        if log is None or not os.path.exists(log):
            exact = False
            missing += want
            notes[f"log{r}"] = "missing"
            continue
        got = os.path.getsize(log)
        try:
            same = got == want and filecmp.cmp(log, data, shallow=False)
        except OSError as e:
            same = False
            notes[f"log{r}"] = fmt_exc(e)
        if not same:
            exact = False
            missing += max(0, want - got)
            if got >= want:
                notes[f"log{r}"] = f"differs ({got} bytes, {want} expected)"
    return exact, missing, notes


def _worker_reports(d: str) -> list[tuple[int, int, int, int] | None]:
    """(bytes written, ns inside write(), first write ns, last write returned ns) per rank."""
    out = []
    for r in range(RANKS):
        try:
            with open(os.path.join(d, f"w{r}.txt")) as f:
                out.append(tuple(int(x) for x in f.read().split()))
        except (OSError, ValueError):
            out.append(None)
    return out


# --------------------------------------------------------------------------- scenario


def run_console(ctx) -> Result:
    impls = ctx.select(["torchmp", "stdlib", "torch", "torch-p01"])  # floor: see the docstring
    mb = 2 if ctx.quick else 8
    res = Result("console", f"console stalled for {STALL_S:g} s, then drained: {RANKS} ranks x {mb} MB "
                 "of 100-byte lines, tee=ALL (launcher in a child process)", impls)
    res.params = {"ranks": RANKS, "mb_per_rank": mb, "line_bytes": 100, "write_bytes": CHUNK,
                  "worker": "python -S -c WORKER FILE (os.write loop)", "tee": "ALL", "stall_s": STALL_S,
                  "console": "pipe, unread for stall_s after start() returned, then read to EOF",
                  "hard_timeout_s": HARD_TIMEOUT}
    res.metric("wait_s", "start..wait() returned", "s", "lower")
    res.metric("close_s", "start..close() returned", "s", "lower")
    res.metric("workers_s", "start..workers wrote all", "s", "lower")
    res.metric("blocked_s", "write() time, max rank", "s", "lower")
    res.metric("before_drain", "wait() pre-drain", "bool", "info", agg="min")
    res.metric("logs_ok", "logs byte-exact", "bool", "info", agg="min")
    res.metric("missing_bytes", "log bytes missing", "B", "info", agg="max")
    res.metric("rss_mb", "launcher peak RSS", "MiB", "lower")
    res.metric("rss_growth_mb", "peak RSS over pre-start", "MiB", "lower")
    res.metric("whole", "console whole lines", "n", "info", agg="min")
    res.metric("torn", "console torn lines", "n", "info", agg="max")
    res.metric("other", "console other lines", "n", "info", agg="max")
    datadir = ctx.mkdtemp("console-data")
    ctx.log(f"  generating {RANKS} x {mb} MB")
    paths, lines = make_data(datadir, mb)
    res.params["lines_expected"] = RANKS * lines

    def trial(impl):
        with trial_scope(ctx, "console") as s:
            logdir = os.path.join(s.dir, "logs")
            args = {str(r): ["-S", "-c", WORKER, paths[r], str(CHUNK), os.path.join(s.dir, f"w{r}.txt")]
                    for r in range(RANKS)}
            spec = {"impl": impl, "entry": sys.executable, "args": args, "tag": s.tag, "log_dir": logdir,
                    "tee": 3, "timeout": WAIT_TIMEOUT}
            rfd, wfd = os.pipe()
            drain = _Drain(rfd, os.path.join(s.dir, "console.out"))
            drain.start()
            try:
                result, facts = run_child(ctx, spec, s.dir, timeout=HARD_TIMEOUT, on_ready=drain.arm, stdout=wfd)
            finally:
                os.close(wfd)  # with the launcher gone, the drain sees EOF
                if drain.t_armed is None:  # start failed, or never said so: nothing to stall for
                    drain.stop()
                drain.join(STALL_S + 10.0)  # a launcher that returned at once: the stall still runs out
                if drain.is_alive():  # a leftover process holds the write end
                    drain.stop()
                    drain.join()
                os.close(rfd)
            sample = _measure(impl, result, facts, drain, logdir, s.dir, paths, lines)
            if facts["hung"]:
                for k, v in sample.items():  # keep what is known; the raise stops further trials
                    res.metrics[k].add(impl, v)
                raise RuntimeError(f"hung: launcher still running after {HARD_TIMEOUT:g} s, killed")
            if not result or not result.get("ok"):
                for k, v in sample.items():
                    res.metrics[k].add(impl, v)
                why = (result or {}).get("error") or stderr_tail(facts["stderr"])
                raise RuntimeError(f"launcher failed: {why}")
            return sample

    def _measure(impl, result, facts, drain, logdir, d, paths, lines) -> dict:
        sample = {}
        ok, missing, notes = _check_logs(result, logdir, paths)
        sample.update(logs_ok=int(ok), missing_bytes=missing)
        for k, v in notes.items():
            res.note(impl, k, v)
        reps = _worker_reports(d)
        if all(reps):
            sample["blocked_s"] = max(w[1] for w in reps) / 1e9
        else:
            res.note(impl, "worker_reports_missing", [r for r, w in enumerate(reps) if w is None])
        c = classify_console(drain.path, RANKS, lines)
        sample.update(whole=c["whole"], torn=c["torn"], other=c["other"])
        if c["dup"]:
            res.note(impl, "duplicated_lines", c["dup"])
        if c["cut_end"]:
            res.note(impl, "console_ends_mid_line", True)
        if c["example"] is not None:
            res.note(impl, "other_line", c["example"])
        if result and result.get("ok"):
            t0 = result["t0_mono"]
            sample.update(wait_s=result["t_wait"], close_s=result["t_close"],
                          before_drain=int(drain.t_drain is not None and t0 + result["t_wait"] < drain.t_drain))
            if all(reps):
                sample["workers_s"] = max(w[3] for w in reps) / 1e9 - t0
            peak = result["after"].get("peak_rss")
            if peak is not None:
                sample["rss_mb"] = peak / 2**20
                sample["rss_growth_mb"] = (peak - result["before"]["rss"]) / 2**20
            if result.get("failed"):
                res.note(impl, "failures", result.get("failures"))
        return sample

    try:
        samples = interleave(impls, ctx.reps(3, 1), trial, warmup=0,
                             on_error=lambda i, m: res.error(i, "", m), log=ctx.log)
    finally:
        retire(datadir)
    record(res, samples)
    return res
