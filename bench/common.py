"""Shared helpers: clocks, results, interleaved trials, process hygiene.

Every process a benchmark starts carries ``BENCH_TAG=<run>-<trial>`` in its
environment.  Cleanup finds leftovers by that tag (``/proc/*/environ``) and by the
pids the implementation reported, and kills them by *process group* (never by
name).  The bench process makes itself a child subreaper so that workers
orphaned by a dead launcher are re-parented to it and can be reaped.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import stat
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TAG_VAR = "BENCH_TAG"
TRIAL_TIMEOUT = 300.0  # seconds; a trial that takes longer is a failure of the impl


def mono_ns() -> int:
    """CLOCK_MONOTONIC in ns: one clock for every process on the machine."""
    return time.monotonic_ns()


def is_interrupt(e: BaseException) -> bool:
    """^C or SIGTERM: KeyboardInterrupt (the bench's own handler raises it for
    SIGTERM too), or torch's SignalException once a torch-like launcher has
    installed its handlers.  Not a failure of what was running: it ends the run."""
    return isinstance(e, KeyboardInterrupt) or type(e).__name__ == "SignalException"


def fmt_exc(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {e}"
    return msg if len(msg) < 400 else msg[:400] + "..."


# --------------------------------------------------------------------------- results


@dataclass
class Metric:
    key: str
    label: str
    unit: str
    better: str = "lower"  # "lower" | "higher" | "info"
    agg: str = "median"  # how samples are reduced: median | max | min
    compare: str = "ratio"  # against the baselines: "ratio" (a / b) or "diff" (a - b)
    values: dict[str, list[float]] = field(default_factory=dict)

    def add(self, impl: str, value: float | None) -> None:
        if value is None:
            return
        self.values.setdefault(impl, []).append(float(value))

    def reduce(self, impl: str) -> float | None:
        v = self.values.get(impl)
        if not v:
            return None
        if self.agg == "max":
            return max(v)
        if self.agg == "min":
            return min(v)
        return statistics.median(v)


class Result:
    """What a scenario returns: metrics per impl, plus notes, errors and skips."""

    def __init__(self, name: str, title: str, impls: Iterable[str]):
        self.name = name
        self.title = title
        self.impls = list(impls)
        self.metrics: dict[str, Metric] = {}
        self.info: dict[str, dict[str, Any]] = {}
        self.errors: dict[str, str] = {}
        self.skipped: dict[str, str] = {}
        self.params: dict[str, Any] = {}
        self.elapsed_s = 0.0

    def metric(self, key, label, unit, better="lower", agg="median", compare="ratio") -> Metric:
        if key not in self.metrics:
            self.metrics[key] = Metric(key, label, unit, better, agg, compare)
        return self.metrics[key]

    def note(self, impl: str, key: str, value: Any) -> None:
        self.info.setdefault(impl, {})[key] = value

    def error(self, impl: str, where: str, msg: str) -> None:
        prev = self.errors.get(impl)
        text = f"{where}: {msg}" if where else msg
        self.errors[impl] = text if not prev else prev + " | " + text

    def value(self, key: str, impl: str) -> float | None:
        m = self.metrics.get(key)
        return m.reduce(impl) if m else None


QUICK_TRIAL_S = 0.1
PRE_TRIALS = 5


def interleave(
    impls: list[str],
    reps: int,
    trial: Callable[[str], dict[str, float]],
    warmup: int = 1,
    on_error: Callable[[str, str], None] | None = None,
    log: Callable[[str], None] | None = None,
    at_most: dict[str, int] | None = None,
) -> dict[str, list[dict[str, float]]]:
    """Run ``trial(impl)`` for every impl, repetitions interleaved.

    Order alternates A B C, C B A, A B C, ... (counterbalanced), so machine drift
    and order effects cancel.  Warm-up rounds are run and discarded.  An impl
    whose trial raises is recorded through ``on_error`` and not run again for
    this parameter set.

    A trial shorter than QUICK_TRIAL_S is preceded by PRE_TRIALS untimed ones
    of the same impl: after a second of idling (torch's default ``wait()``
    sleeps that long) the next process creation on a VM is 3-5x slower, a
    penalty that survives busy CPUs and only creating processes clears, and
    cross-CPU wake-ups (torchmp's hand-offs to its I/O thread) stay slow for
    a few more launches.  Without them the impl that follows torch gets a
    slow sample every other round and its median lands between two modes.

    ``at_most`` caps the counted rounds of some impls: the rounds that two
    runs need to agree on figures a few per cent apart need not be spent on
    a baseline whose trial takes seconds and whose figure is far from theirs.
    """
    out: dict[str, list[dict[str, float]]] = {i: [] for i in impls}
    dead: set[str] = set()
    quick: dict[str, bool] = {}
    rounds = [(True, r) for r in range(warmup)] + [(False, r) for r in range(reps)]
    for n, (is_warm, r) in enumerate(rounds):
        order = impls if n % 2 == 0 else impls[::-1]
        for impl in order:
            if impl in dead or (not is_warm and at_most and r >= at_most.get(impl, reps)):
                continue
            try:
                for _ in range(PRE_TRIALS if quick.get(impl) else 0):
                    trial(impl)
                t0 = time.monotonic()
                sample = trial(impl)
                quick[impl] = time.monotonic() - t0 < QUICK_TRIAL_S
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # noqa: BLE001 - a failing impl must not stop the run
                if is_interrupt(e):
                    raise
                dead.add(impl)
                if log:
                    log(f"    {impl}: trial failed: {fmt_exc(e)}")
                    if os.environ.get("BENCH_DEBUG"):
                        traceback.print_exc()
                if on_error:
                    on_error(impl, fmt_exc(e))
                continue
            if not is_warm:
                out[impl].append(sample)
    return out


def record(res: Result, samples: dict[str, list[dict[str, float]]]) -> None:
    """Feed interleave() output into a Result's metrics (keys must exist)."""
    for impl, lst in samples.items():
        for s in lst:
            for k, v in s.items():
                if k in res.metrics:
                    res.metrics[k].add(impl, v)


# --------------------------------------------------------------------------- processes


def proc_state(pid: int) -> str | None:
    """Single-letter state from /proc/PID/stat, None if the pid is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    try:
        return data[data.rindex(b")") + 2 : data.rindex(b")") + 3].decode()
    except ValueError:
        return None


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie)."""
    st = proc_state(pid)
    return st is not None and st not in ("Z", "X")


def _environ_has(pid: int, needle: bytes, prefix: bool) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:
        return False
    if needle not in env:
        return False
    for ent in env.split(b"\0"):
        if ent == needle or (prefix and ent.startswith(needle)):
            return True
    return False


def find_tagged(tag: str, prefix: bool = False) -> list[int]:
    """Live processes whose environment holds BENCH_TAG=tag (or tag* with prefix)."""
    needle = f"{TAG_VAR}={tag}".encode()
    me = os.getpid()
    found = []
    for ent in os.listdir("/proc"):
        if not ent.isdigit():
            continue
        pid = int(ent)
        if pid == me:
            continue
        if _environ_has(pid, needle, prefix) and alive(pid):
            found.append(pid)
    return found


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def kill_groups(pids: Iterable[int], sig: int = signal.SIGKILL) -> int:
    """Signal each pid's process group (or the pid alone if it shares ours)."""
    mine = os.getpgrp()
    n = 0
    for pid in set(pids):
        try:
            pgid = os.getpgid(pid)
        except ProcessLookupError:
            continue
        try:
            if pgid != mine and pgid > 1:
                os.killpg(pgid, sig)
            else:
                os.kill(pid, sig)
            n += 1
        except (ProcessLookupError, PermissionError):
            pass
    return n


def cleanup(tag: str | None, pids: Iterable[int] = (), prefix: bool = False, wait_s: float = 5.0) -> int:
    """Kill every live process of this trial (by tag and by pid) by process group.

    Returns how many live processes were found.  Waits (bounded) until they are
    gone and reaps those that are (or were re-parented to be) our children.
    """
    victims = set()
    tag_needle = f"{TAG_VAR}={tag}".encode() if tag else None
    for pid in pids:
        if not alive(pid):
            _reap(pid)
            continue
        # guard against pid reuse: only ours (by tag) or our own children
        if tag_needle and _environ_has(pid, tag_needle, prefix):
            victims.add(pid)
        elif _ppid(pid) == os.getpid():
            victims.add(pid)
    if tag:
        victims.update(find_tagged(tag, prefix))
    if not victims:
        return 0
    kill_groups(victims)
    deadline = time.monotonic() + wait_s
    pending = set(victims)
    while pending and time.monotonic() < deadline:
        for pid in list(pending):
            _reap(pid)
            if not alive(pid):
                _reap(pid)
                pending.discard(pid)
        if pending:
            time.sleep(0.005)
    return len(victims)


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return int(data[data.rindex(b")") + 2 :].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def set_child_subreaper() -> bool:
    """prctl(PR_SET_CHILD_SUBREAPER): orphaned workers of a dead launcher become ours."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def task_cpu_ns(pid: int) -> int | None:
    """CPU time of all threads of pid, in ns (schedstat: ns resolution)."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    ok = False
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                total += int(f.read().split()[0])
                ok = True
        except (OSError, ValueError, IndexError):
            continue
    if not ok:
        try:
            import psutil

            ct = psutil.Process(pid).cpu_times()
            return int((ct.user + ct.system) * 1e9)
        except Exception:  # noqa: BLE001
            return None
    return total


def count_threads(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def count_fds(pid: int | str = "self") -> int:
    n = len(os.listdir(f"/proc/{pid}/fd"))
    return n - 1 if pid == "self" else n  # listdir's own fd


def rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes(pid: int | str = "self") -> int | None:
    """VmHWM: the peak RSS of the process's current image.

    Not ``ru_maxrss``: Linux carries that across execve, so a launcher started
    from the bench (which has torch imported) would report the bench's RSS.
    """
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# --------------------------------------------------------------------------- exit watcher


class ExitWatcher:
    """Records workers' exit times from outside every implementation.

    A helper process (``python -m bench.watcher``) opens a pidfd per worker
    (pidfds work for non-children) and stamps CLOCK_MONOTONIC the moment each
    becomes readable, i.e. the moment the process exited.  Being a separate
    process it is not delayed by the GIL of the launcher under test.
    """

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.watcher"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=REPO_ROOT,
            env=child_env(),
        )
        line = self._readline(30.0)
        if line.strip() != "ready":
            raise RuntimeError(f"exit watcher did not start: {line!r}")

    def watch(self, pids: Iterable[int]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((" ".join(str(p) for p in pids) + "\n").encode())
        self.proc.stdin.flush()
        line = self._readline(10.0)
        if line.strip() != "armed":
            raise RuntimeError(f"exit watcher not armed: {line!r}")

    def collect(self, timeout: float) -> dict[int, int]:
        """{pid: exit time ns}; -1 for a pid that was already gone when armed."""
        line = self._readline(timeout)
        if not line:
            raise TimeoutError("exit watcher: workers did not exit in time")
        out = {}
        for item in line.split():
            pid, t = item.split(":")
            out[int(pid)] = int(t)
        return out

    def _readline(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        buf = b""
        deadline = time.monotonic() + timeout
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                return ""
            r, _, _ = select.select([fd], [], [], left)
            if not r:
                return ""
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            buf += chunk
        return buf.decode()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# --------------------------------------------------------------------------- context


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    pp = env.get("PYTHONPATH")
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + pp if pp else "")
    if extra:
        env.update(extra)
    return env


class Ctx:
    """What a scenario gets: the available impls, options, temp space, tags, logging."""

    def __init__(self, impls, unavailable, quick, repeat, tmp_root, log, verbose=False):
        self.impls = impls  # name -> Impl (available, in run order)
        self.unavailable = unavailable  # name -> reason
        self.quick = quick
        self.repeat = repeat
        self.tmp_root = tmp_root
        self.log = log
        self.verbose = verbose
        self.run_id = uuid.uuid4().hex[:10]
        self._n = 0
        self._watcher: ExitWatcher | None = None

    def reps(self, full: int, quick: int) -> int:
        if self.repeat:
            return self.repeat
        return quick if self.quick else full

    def select(self, names: Iterable[str]) -> list[str]:
        names = list(names)
        return [n for n in self.impls if n in names]

    def new_tag(self) -> str:
        self._n += 1
        return f"{self.run_id}-{self._n}"

    def mkdtemp(self, prefix: str) -> str:
        return tempfile.mkdtemp(prefix=prefix + "-", dir=self.tmp_root)

    @property
    def watcher(self) -> ExitWatcher:
        if self._watcher is None or self._watcher.proc.poll() is not None:
            self._watcher = ExitWatcher()
        return self._watcher

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None
        cleanup(self.run_id, prefix=True)


@contextlib.contextmanager
def trial_scope(ctx: Ctx, prefix: str):
    """A fresh tag + temp dir; on exit, close tracked jobs and kill leftovers."""
    scope = _Scope(ctx.new_tag(), ctx.mkdtemp(prefix))
    try:
        yield scope
    finally:
        for job in scope.jobs:
            with contextlib.suppress(Exception):
                job.close(2.0)
        pids = []
        for job in scope.jobs:
            with contextlib.suppress(Exception):
                pids.extend(job.pids().values())
        left = cleanup(scope.tag, pids)
        if left:
            scope.leftovers = left
        retire(scope.dir)


def retire(path: str) -> None:
    """Free a finished trial's disk space but keep its inodes until the run
    ends (the run's temporary root is removed then, after the last measurement).

    On ext4 without a journal (this project's CI VM) every new inode -- a
    ``mkdir``, a created log file -- first steps over each inode of its block
    group deleted in the last ~35 s (the kernel's ``recently_deleted``), so
    deleting a trial's 2 + N directories would make the next trial's launcher
    pay for the bench's own cleanup (figures: bench/README.md, "The log
    directories").  Truncating frees the data blocks without freeing an
    inode."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            file = os.path.join(root, name)
            with contextlib.suppress(OSError):
                st = os.lstat(file)
                if stat.S_ISREG(st.st_mode) and st.st_size:
                    os.truncate(file, 0)


@dataclass
class _Scope:
    tag: str
    dir: str
    jobs: list = field(default_factory=list)
    leftovers: int = 0

    def envs(self, n: int, extra: dict[str, str] | None = None) -> dict[int, dict[str, str]]:
        return {r: {TAG_VAR: self.tag, **(extra or {})} for r in range(n)}

    def track(self, job):
        self.jobs.append(job)
        return job


def wait_until(pred: Callable[[], bool], timeout: float, step: float = 0.002) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()


# --------------------------------------------------------------------------- child launcher


def run_child(
    ctx: Ctx,
    spec: dict[str, Any],
    workdir: str,
    timeout: float,
    on_ready: Callable[[subprocess.Popen, dict], None] | None = None,
    extra_env: dict[str, str] | None = None,
    stdout: int | None = None,
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Run one launch in ``python -m bench.child`` with fd 1/2 going to files.

    ``stdout``, if given, is an fd (e.g. the write end of a pipe) that becomes
    the child's fd 1 instead of the console file; ``facts["console"]`` is then
    None and reading that fd is the caller's business.

    Returns (the child's result JSON or None, facts about the child process:
    returncode, console/stderr paths, whether it hung, ready message).
    """
    spec = dict(spec)
    spec_path = os.path.join(workdir, "spec.json")
    result_path = os.path.join(workdir, "result.json")
    console = os.path.join(workdir, "console.out")
    errlog = os.path.join(workdir, "console.err")
    rfd, wfd = os.pipe()
    spec["ready_fd"] = wfd
    spec["result"] = result_path
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    facts: dict[str, Any] = {"console": console if stdout is None else None, "stderr": errlog, "hung": False}
    try:
        with open(console, "wb") as out, open(errlog, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "bench.child", spec_path],
                stdin=subprocess.DEVNULL,
                stdout=out if stdout is None else stdout,
                stderr=err,
                pass_fds=(wfd,),
                cwd=REPO_ROOT,
                env=child_env(extra_env),
            )
    finally:
        os.close(wfd)
    try:
        ready = _read_json_line(rfd, timeout)
        facts["ready"] = ready
        if ready and ready.get("started") and on_ready is not None:
            on_ready(proc, ready)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            facts["hung"] = True
            kill_groups([proc.pid])
            proc.wait()
    finally:
        os.close(rfd)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    facts["returncode"] = proc.returncode
    result = None
    if os.path.exists(result_path):
        with open(result_path) as f:
            result = json.load(f)
    return result, facts


def _read_json_line(fd: int, timeout: float) -> dict | None:
    buf = b""
    deadline = time.monotonic() + timeout
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        r, _, _ = select.select([fd], [], [], left)
        if not r:
            return None
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        buf += chunk
    try:
        return json.loads(buf.decode()) if buf.strip() else None
    except ValueError:
        return None


def stderr_tail(path: str, n: int = 600) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n))
            return f.read().decode(errors="replace").strip()
    except OSError:
        return ""
