"""The implementations under test, behind one small interface.

``Impl.start_binary(...)`` / ``Impl.start_function(...)`` return a ``Job`` with
``pids()``, ``wait(timeout)`` (all-or-nothing, fail-fast, like ``PContext.wait``)
and ``close(timeout)``.

* ``torchmp``   ``import torchmp`` (module name from ``BENCH_TORCHMP_MODULE``,
                default ``torchmp``), default ``wait()``.
* ``torch``     ``torch.distributed.elastic.multiprocessing``, default ``wait()``
                (``period=1``).
* ``torch-p01`` the same with ``wait(period=0.01)``.
* ``stdlib``    ``subprocess.Popen(start_new_session=True)`` / ``multiprocessing``
                as a careful user writes it: files for redirects, one thread per
                pipe for tee with rank prefixes, exits learnt through
                ``os.waitid(P_ALL, WNOWAIT)`` and reaped by ``Popen``.
* ``stdlib-contract`` (opt-in: ``--impl``) the ``stdlib`` launcher doing, with
                the stdlib's own calls, what torch's API promises beyond a
                spawn: torch's log layout and error-file path, its four signal
                handlers, the binary found before anything starts, the fd
                limit, the OOM-kill baseline, the groups signalled before
                ``wait()`` returns.  It shows what those promises cost; the
                targets stay against ``stdlib``.
* ``floor-contract`` (opt-in) the ``floor`` launcher keeping the same
                promises the same way: the least a pidfd launcher that keeps
                torch's promises can cost from Python.
* ``floor``     bare ``os.posix_spawn(setsid=True)`` + ``os.pidfd_open`` + one
                ``epoll`` + ``os.waitpid``: the limit of launch and reap from
                Python.  For tee it is a single-threaded epoll loop that frames
                lines with bytes methods.
"""

from __future__ import annotations

import importlib
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

OUT, ERR = 1, 2
ALL_IMPLS = ["torchmp", "stdlib", "floor", "torch", "torch-p01", "stdlib-contract", "floor-contract"]
# What a run measures unless --impl says otherwise: the -contract launchers
# explain a gap (bench/README.md, "What is compared"), they are no baseline
# of a target.
DEFAULT_IMPLS = ALL_IMPLS[:5]
TORCH_MODULE = "torch.distributed.elastic.multiprocessing"
HANDLED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
# The numbers, and the C functions under signal.getsignal/signal.signal: the
# stdlib wrappers convert to and from enums (about 6 and 10 us a call here),
# and the save runs inside the timed launch of torch and torchmp only.
_HANDLED_NUMBERS = {name: int(getattr(signal, name)) for name in HANDLED_SIGNALS if hasattr(signal, name)}
from _signal import getsignal as _c_getsignal, signal as _c_signal  # noqa: E402  # type: ignore[import-not-found]


@dataclass
class Outcome:
    failed: bool
    failures: dict[int, int] = field(default_factory=dict)  # rank -> exitcode
    return_values: dict[int, Any] = field(default_factory=dict)
    stdouts: dict[int, str] = field(default_factory=dict)
    stderrs: dict[int, str] = field(default_factory=dict)
    resources: dict[int, Any] | None = None


class Job:
    def pids(self) -> dict[int, int]:
        raise NotImplementedError

    def wait(self, timeout: float) -> Outcome:
        raise NotImplementedError

    def close(self, timeout: float = 30.0) -> None:
        raise NotImplementedError


class Impl:
    name = ""
    binary = True
    function = False

    def check(self) -> str | None:
        """None if usable, else why not."""
        return None

    def version(self) -> str | None:
        return None

    def start_binary(self, entry, args, envs, log_dir, redirects=0, tee=0, name="bench") -> Job:
        raise NotImplementedError

    def start_function(self, fn, args, envs, log_dir, start_method, name="bench") -> Job:
        raise NotImplementedError


def _quiet_logging(modname: str) -> None:
    import logging

    for n in {modname, modname.split(".")[0] + ".distributed.elastic", "torchmp"}:
        logging.getLogger(n).setLevel(logging.CRITICAL)


# --------------------------------------------------------------------------- torch API


class ApiImpl(Impl):
    """torch's module or anything with its API (torchmp)."""

    function = True

    def __init__(self, name: str, modname: str, period: float | None = None):
        self.name = name
        self.modname = modname
        self.period = period
        self.mod = None

    def check(self) -> str | None:
        try:
            mod = importlib.import_module(self.modname)
        except Exception as e:  # noqa: BLE001 - any import failure means unavailable
            return f"cannot import {self.modname}: {type(e).__name__}: {e}"
        missing = [a for a in ("start_processes", "DefaultLogsSpecs", "Std") if not hasattr(mod, a)]
        if missing:
            return f"{self.modname} has no {', '.join(missing)}"
        self.mod = mod
        _quiet_logging(self.modname)
        return None

    def version(self) -> str | None:
        top = self.modname.split(".")[0]
        try:
            v = getattr(importlib.import_module(top), "__version__", None)
            if v:
                return str(v)
        except Exception:  # noqa: BLE001
            pass
        try:
            from importlib.metadata import version

            return version(top)
        except Exception:  # noqa: BLE001
            return None

    def _specs(self, log_dir, redirects, tee):
        m = self.mod
        return m.DefaultLogsSpecs(log_dir=log_dir, redirects=m.Std(redirects), tee=m.Std(tee))

    def start_binary(self, entry, args, envs, log_dir, redirects=0, tee=0, name="bench") -> Job:
        saved = _save_signals()
        pc = self.mod.start_processes(
            name=name, entrypoint=entry, args=args, envs=envs,
            logs_specs=self._specs(log_dir, redirects, tee),
        )
        return ApiJob(pc, self.period, saved)

    def start_function(self, fn, args, envs, log_dir, start_method, name="bench") -> Job:
        saved = _save_signals()
        pc = self.mod.start_processes(
            name=name, entrypoint=fn, args=args, envs=envs,
            logs_specs=self._specs(log_dir, 0, 0), start_method=start_method,
        )
        return ApiJob(pc, self.period, saved)


def _save_signals():
    if threading.current_thread() is not threading.main_thread():
        return None
    return {num: _c_getsignal(num) for num in _HANDLED_NUMBERS.values()}


def _restore_signals(saved) -> None:
    if not saved or threading.current_thread() is not threading.main_thread():
        return
    for num, handler in saved.items():
        if handler is not None:
            _c_signal(num, handler)


class ApiJob(Job):
    def __init__(self, pc, period, saved_signals):
        self.pc = pc
        self.period = period
        self._saved = saved_signals

    def pids(self):
        return dict(self.pc.pids())

    def wait(self, timeout):
        if self.period is None:
            r = self.pc.wait(timeout)  # the default period
        else:
            r = self.pc.wait(timeout, period=self.period)
        if r is None:
            raise TimeoutError(f"wait({timeout}) returned None")
        return Outcome(
            failed=r.is_failed(),
            failures={k: f.exitcode for k, f in r.failures.items()},
            return_values=dict(r.return_values or {}),
            stdouts=dict(r.stdouts or {}),
            stderrs=dict(r.stderrs or {}),
            resources=getattr(r, "resources", None),
        )

    def close(self, timeout=30.0):
        try:
            self.pc.close(timeout=timeout)
        finally:
            _restore_signals(self._saved)


# --------------------------------------------------------------------------- stdlib


def _rank_paths(log_dir: str, rank: int) -> tuple[str, str]:
    d = os.path.join(log_dir, str(rank))
    return os.path.join(d, "stdout.log"), os.path.join(d, "stderr.log")


class StdlibImpl(Impl):
    name = "stdlib"
    function = True

    def version(self):
        return sys.version.split()[0]

    def start_binary(self, entry, args, envs, log_dir, redirects=0, tee=0, name="bench") -> Job:
        return StdlibJob(entry, args, envs, log_dir, redirects, tee, name)

    def start_function(self, fn, args, envs, log_dir, start_method, name="bench") -> Job:
        return MpJob(fn, args, envs, start_method)


def _pump(pipe, logf, prefix: bytes, console, lock) -> None:
    """One thread per pipe: exact bytes to the log file, prefixed lines to the console."""
    with pipe, logf:
        for line in pipe:
            logf.write(line)
            if not line.endswith(b"\n"):
                line += b"\n"
            with lock:
                console.write(prefix + line)


class StdlibJob(Job):
    # Whether a rank's process group is signalled (SIGTERM) just before the
    # rank is reaped, while its zombie pins the group id: stdlib-contract.
    signals_group_at_exit = False

    def __init__(self, entry, args, envs, log_dir, redirects, tee, name):
        self._init_state(len(args))
        base = dict(os.environ)
        try:
            for r in range(self.n):
                self._start_one(r, entry, args[r], {**base, **{k: str(v) for k, v in envs[r].items()}},
                                log_dir, redirects, tee, name)
        except BaseException:
            self.close(0)  # careful user: no half-started job left behind
            raise

    def _init_state(self, n: int) -> None:
        self.n = n
        self.procs: dict[int, subprocess.Popen] = {}
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()
        self.stdouts: dict[int, str] = {}
        self.stderrs: dict[int, str] = {}
        self.consoles = (sys.stdout.buffer, sys.stderr.buffer)

    def _start_one(self, r, entry, a, env, log_dir, redirects, tee, name, dirs_made=False):
        out_path, err_path = _rank_paths(log_dir, r)
        opened = []
        targets = []
        logs = []
        try:
            for bit, path in ((OUT, out_path), (ERR, err_path)):
                if (redirects | tee) & bit:
                    if not dirs_made:
                        os.makedirs(os.path.dirname(path), exist_ok=True)
                    f = open(path, "wb")  # noqa: SIM115
                    opened.append(f)
                    (self.stdouts if bit == OUT else self.stderrs)[r] = path
                    if tee & bit:
                        targets.append(subprocess.PIPE)
                        logs.append(f)
                    else:
                        targets.append(f)
                        logs.append(None)
                else:
                    targets.append(None)
                    logs.append(None)
            p = subprocess.Popen([entry, *map(str, a)], env=env, stdout=targets[0],
                                 stderr=targets[1], start_new_session=True)
        except BaseException:
            for f in opened:
                f.close()
            raise
        self.procs[r] = p
        prefix = f"[{name}{r}]:".encode()
        for pipe, logf, cons, f in ((p.stdout, logs[0], self.consoles[0], targets[0]),
                                    (p.stderr, logs[1], self.consoles[1], targets[1])):
            if pipe is not None:
                t = threading.Thread(target=_pump, args=(pipe, logf, prefix, cons, self.lock), daemon=True)
                t.start()
                self.threads.append(t)
            elif f is not None and f is not subprocess.PIPE:
                f.close()  # the child has its own copy of a redirect file

    def pids(self):
        return {r: p.pid for r, p in self.procs.items()}

    def _wait_any(self, running: dict[int, subprocess.Popen]) -> int:
        by_pid = {p.pid: r for r, p in running.items()}
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            info = None
        r = by_pid.get(info.si_pid) if info is not None else None
        if r is None:  # not one of ours: fall back to in-order Popen.wait
            r = next(iter(running))
        elif self.signals_group_at_exit:
            try:
                os.killpg(info.si_pid, signal.SIGTERM)  # what the rank left in its group
            except ProcessLookupError:
                pass
        running[r].wait()
        return r

    def wait(self, timeout):
        running = {r: p for r, p in self.procs.items() if p.returncode is None}
        failed = any(p.returncode for p in self.procs.values())
        while running and not failed:
            r = self._wait_any(running)
            if running.pop(r).returncode != 0:
                failed = True
        if failed:
            self.close(30.0)
        for t in self.threads:
            t.join()
        self._flush()
        failures = {r: p.returncode for r, p in self.procs.items() if p.returncode}
        return Outcome(failed=bool(failures), failures=failures,
                       return_values={r: None for r in self.procs} if not failures else {},
                       stdouts=self.stdouts, stderrs=self.stderrs)

    def _flush(self):
        with self.lock:
            for c in self.consoles:
                try:
                    c.flush()
                except (OSError, ValueError):
                    pass

    def close(self, timeout=30.0):
        live = [p for p in self.procs.values() if p.poll() is None]
        for p in live:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        for p in live:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in live:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        for t in self.threads:
            t.join(5.0)
        self._flush()


class StdlibContractImpl(StdlibImpl):
    name = "stdlib-contract"
    function = False  # (torch's promises are priced on binaries)
    start_function = Impl.start_function

    def start_binary(self, entry, args, envs, log_dir, redirects=0, tee=0, name="bench") -> Job:
        return StdlibContractJob(entry, args, envs, log_dir, redirects, tee, name)


def _signal_exit(signum, frame):
    raise SystemExit(128 + signum)


class _OomCounter:
    """The launcher's memory cgroup's OOM-kill counter, read through kept
    descriptors as torchmp does: /proc/self/cgroup read again each launch (a
    launcher can be moved), the counter file opened once per cgroup."""

    def __init__(self):
        self.cgroup_fd = os.open("/proc/self/cgroup", os.O_RDONLY | os.O_CLOEXEC)
        self.path = None
        self.fd = -1

    def read(self) -> int | None:
        text = os.pread(self.cgroup_fd, 4096, 0).decode()
        path = None
        for line in text.splitlines():
            _, controllers, rel = line.split(":", 2)
            if "memory" in controllers.split(","):
                path = f"/sys/fs/cgroup/memory{rel.rstrip('/')}/memory.oom_control"
            elif controllers == "" and path is None:
                path = f"/sys/fs/cgroup{rel.rstrip('/')}/memory.events"
        if path != self.path:
            if self.fd >= 0:
                os.close(self.fd)
            self.path, self.fd = path, -1
            try:
                self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC) if path else -1
            except OSError:
                self.fd = -1
        if self.fd < 0:
            return None
        for line in os.pread(self.fd, 4096, 0).split(b"\n"):
            if line.startswith(b"oom_kill "):
                return int(line.split()[1])
        return None

    def close(self) -> None:
        for fd in (self.cgroup_fd, self.fd):
            if fd >= 0:
                os.close(fd)
        self.cgroup_fd = self.fd = -1


_oom_counter: _OomCounter | None = None


class _TorchPromises:
    """What torch's API promises beyond the spawn, kept the cheapest way the
    stdlib allows (the fast signal calls, kept descriptors), for the
    ``-contract`` launchers:

    * the binary is found, and the fd limit read (raised if the ranks need
      it), before any directory or process is made;
    * the OOM-kill counter's baseline (what names a rank's OOM kill later);
    * torch's layout: ``{log_dir}/{name}_<random>/attempt_0/{rank}/``, with
      ``TORCHELASTIC_ERROR_FILE`` in each rank's environment and the logs
      beside it;
    * torch's four signal handlers, on the main thread (``put_back``
      restores the ones before).

    (The last promise, each rank's process group signalled while its zombie
    still pins the group id, is the job's: ``_PromisesKept``.)
    """

    def __init__(self, entry: str, envs: dict[int, dict[str, str]], log_dir: str, name: str) -> None:
        global _oom_counter
        self.saved_handlers: dict[int, Any] | None = None
        n = len(envs)
        if os.sep in entry:
            if not os.access(entry, os.X_OK):
                raise FileNotFoundError(f"{entry} is not an executable file")
        elif shutil.which(entry) is None:
            raise FileNotFoundError(f"{entry} not found in PATH")
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        need = 64 + 5 * n
        if soft != resource.RLIM_INFINITY and soft < need and (hard == resource.RLIM_INFINITY or need <= hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
        if _oom_counter is None:
            _oom_counter = _OomCounter()
        self.oom_kills_before = _oom_counter.read()
        if not os.path.isdir(log_dir):  # (torch's DefaultLogsSpecs makes it)
            os.makedirs(log_dir)
        self.attempt = os.path.join(tempfile.mkdtemp(prefix=f"{name}_", dir=log_dir), "attempt_0")
        os.mkdir(self.attempt)
        if threading.current_thread() is threading.main_thread():
            self.saved_handlers = {num: _c_signal(num, _signal_exit) for num in _HANDLED_NUMBERS.values()}

    def rank_env(self, rank: int, env: dict[str, str]) -> dict[str, str]:
        """Make rank's directory; env with its error file's path."""
        rank_dir = os.path.join(self.attempt, str(rank))
        os.mkdir(rank_dir)
        return {**env, "TORCHELASTIC_ERROR_FILE": os.path.join(rank_dir, "error.json")}

    def put_back(self) -> None:
        """The handlers as they were before."""
        saved, self.saved_handlers = self.saved_handlers, None
        for num, handler in (saved or {}).items():
            if handler is not None:
                _c_signal(num, handler)


class _PromisesKept:
    """What the ``-contract`` jobs add to their launcher's: each rank's
    process group signalled (SIGTERM) just before the rank is reaped, as
    torch's ``wait()`` closes the context before it returns, and torch's
    handlers put back at ``close()``."""

    promises: _TorchPromises
    signals_group_at_exit = True

    def close(self, timeout=30.0):
        try:
            super().close(timeout)  # type: ignore[misc]
        finally:
            self.promises.put_back()


class StdlibContractJob(_PromisesKept, StdlibJob):
    """StdlibJob keeping torch's promises."""

    def __init__(self, entry, args, envs, log_dir, redirects, tee, name):
        self._init_state(len(args))
        self.promises = _TorchPromises(entry, envs, log_dir, name)
        base = dict(os.environ)
        try:
            for r in range(self.n):
                env = self.promises.rank_env(r, {**base, **{k: str(v) for k, v in envs[r].items()}})
                self._start_one(r, entry, args[r], env, self.promises.attempt, redirects, tee, name, dirs_made=True)
        except BaseException:
            self.close(0)
            raise


class MpJob(Job):
    """multiprocessing.get_context(method).Process + one Pipe per rank for the value."""

    def __init__(self, fn, args, envs, start_method):
        import multiprocessing as mp

        from bench import workers

        ctx = mp.get_context(start_method)
        self.procs = {}
        self.conns = {}
        try:
            for r in range(len(args)):
                rd, wr = ctx.Pipe(duplex=False)
                p = ctx.Process(target=workers.mp_entry, args=(wr, fn, tuple(args[r]), dict(envs[r])))
                p.start()
                wr.close()
                self.procs[r] = p
                self.conns[r] = rd
        except BaseException:
            self.close(0)
            raise

    def pids(self):
        return {r: p.pid for r, p in self.procs.items()}

    def wait(self, timeout):
        values, failures = {}, {}
        for r, c in self.conns.items():
            try:
                values[r] = c.recv()
            except EOFError:
                pass
            c.close()
        for r, p in self.procs.items():
            p.join(timeout)
            if p.exitcode is None:
                raise TimeoutError(f"rank {r} still running")
            if p.exitcode != 0:
                failures[r] = p.exitcode
        return Outcome(failed=bool(failures), failures=failures, return_values=values)

    def close(self, timeout=30.0):
        for p in self.procs.values():
            if p.exitcode is None:
                p.terminate()
        for p in self.procs.values():
            p.join(timeout)
            if p.exitcode is None:
                p.kill()
                p.join()
        for c in self.conns.values():
            c.close()


# --------------------------------------------------------------------------- floor


def _write_all(fd: int, data: bytes) -> None:
    mv = memoryview(data)
    while mv:
        n = os.write(fd, mv)
        mv = mv[n:]


class _Stream:
    __slots__ = ("rank", "logfd", "console", "prefix", "partial")

    def __init__(self, rank, logfd, console, prefix):
        self.rank = rank
        self.logfd = logfd
        self.console = console
        self.prefix = prefix
        self.partial = b""


class FloorImpl(Impl):
    name = "floor"

    def version(self):
        return sys.version.split()[0]

    def start_binary(self, entry, args, envs, log_dir, redirects=0, tee=0, name="bench") -> Job:
        return FloorJob(entry, args, envs, log_dir, redirects, tee, name)


class FloorJob(Job):
    # Whether a rank's process group is signalled (SIGTERM) just before the
    # rank is reaped, while its zombie pins the group id: floor-contract.
    signals_group_at_exit = False

    def __init__(self, entry, args, envs, log_dir, redirects, tee, name):
        self.n = len(args)
        self.ep = select.epoll()
        self.pid: dict[int, int] = {}
        self.pidfd: dict[int, int] = {}  # fd -> rank
        self.status: dict[int, int] = {}  # rank -> exitcode
        self.streams: dict[int, _Stream] = {}  # read fd -> stream
        self.logfds: list[int] = []
        self.stdouts: dict[int, str] = {}
        self.stderrs: dict[int, str] = {}
        self.terminating = False
        path = entry if os.sep in entry else shutil.which(entry)
        if path is None:
            raise FileNotFoundError(2, "No such file or directory", entry)
        base = dict(os.environ)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        try:
            for r in range(self.n):
                env = {**base, **{k: str(v) for k, v in envs[r].items()}}
                fa = []
                child_ends = []
                try:
                    for bit, fdno in ((OUT, 1), (ERR, 2)):
                        if not (redirects | tee) & bit:
                            continue
                        lp = _rank_paths(log_dir, r)[0 if bit == OUT else 1]
                        (self.stdouts if bit == OUT else self.stderrs)[r] = lp
                        os.makedirs(os.path.dirname(lp), exist_ok=True)
                        if tee & bit:
                            logfd = os.open(lp, flags, 0o644)
                            self.logfds.append(logfd)
                            rfd, wfd = os.pipe2(os.O_CLOEXEC)
                            child_ends.append(wfd)
                            fa.append((os.POSIX_SPAWN_DUP2, wfd, fdno))
                            self.streams[rfd] = _Stream(r, logfd, fdno, f"[{name}{r}]:".encode())
                            self.ep.register(rfd, select.EPOLLIN)
                        else:
                            fa.append((os.POSIX_SPAWN_OPEN, fdno, lp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
                    pid = os.posix_spawn(path, [entry, *map(str, args[r])], env, file_actions=fa, setsid=True)
                finally:
                    for w in child_ends:
                        os.close(w)
                self.pid[r] = pid
                pfd = os.pidfd_open(pid)
                self.pidfd[pfd] = r
                self.ep.register(pfd, select.EPOLLIN)
        except BaseException:
            self.close(0)
            raise

    def pids(self):
        return dict(self.pid)

    def _pump(self, timeout: float) -> None:
        for fd, _ in self.ep.poll(timeout):
            r = self.pidfd.pop(fd, None)
            if r is not None:
                self.ep.unregister(fd)
                os.close(fd)
                if self.signals_group_at_exit:
                    try:
                        os.killpg(self.pid[r], signal.SIGTERM)  # what the rank left in its group
                    except ProcessLookupError:
                        pass
                _, st = os.waitpid(self.pid[r], 0)
                self.status[r] = os.waitstatus_to_exitcode(st)
                continue
            st = self.streams.get(fd)
            if st is not None:
                self._read(fd, st)

    def _read(self, fd: int, st: _Stream) -> None:
        data = os.read(fd, 65536)
        if not data:
            if st.partial:
                _write_all(st.console, st.prefix + st.partial + b"\n")
                st.partial = b""
            self.ep.unregister(fd)
            os.close(fd)
            del self.streams[fd]
            return
        _write_all(st.logfd, data)
        buf = st.partial + data if st.partial else data
        i = buf.rfind(b"\n")
        if i < 0:
            st.partial = buf
            return
        st.partial = buf[i + 1 :]
        p = st.prefix
        _write_all(st.console, p + buf[:i].replace(b"\n", b"\n" + p) + b"\n")

    def _signal(self, sig) -> None:
        for r, pid in self.pid.items():
            if r not in self.status:
                try:
                    os.killpg(pid, sig)
                except ProcessLookupError:
                    pass

    def wait(self, timeout):
        deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
        kill_at = None
        while True:
            if not self.terminating and any(self.status.values()):
                self.terminating = True
                self._signal(signal.SIGTERM)
                kill_at = time.monotonic() + 30.0
            if len(self.status) == self.n and not self.streams:
                break
            now = time.monotonic()
            if kill_at is not None and now >= kill_at:
                self._signal(signal.SIGKILL)
                kill_at = None
            left = [d - now for d in (deadline, kill_at) if d is not None]
            t = max(0.0, min(left)) if left else -1.0
            if deadline is not None and now >= deadline:
                raise TimeoutError("floor wait timed out")
            self._pump(t)
        self._close_fds()
        failures = {r: c for r, c in self.status.items() if c != 0}
        return Outcome(failed=bool(failures), failures=failures,
                       return_values={r: None for r in self.pid} if not failures else {},
                       stdouts=self.stdouts, stderrs=self.stderrs)

    def close(self, timeout=30.0):
        if len(self.status) < len(self.pid):
            self._signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while len(self.status) < len(self.pid):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._pump(left)
            if len(self.status) < len(self.pid):
                self._signal(signal.SIGKILL)
                while len(self.status) < len(self.pid):
                    self._pump(-1)
        end = time.monotonic() + 1.0  # drain what the workers left in the pipes
        while self.streams and time.monotonic() < end:
            self._pump(max(0.0, end - time.monotonic()))
        self._close_fds()

    def _close_fds(self):
        for fd in list(self.streams) + list(self.pidfd) + self.logfds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.streams.clear()
        self.pidfd.clear()
        self.logfds = []
        try:
            self.ep.close()
        except OSError:
            pass


class FloorContractImpl(FloorImpl):
    name = "floor-contract"

    def start_binary(self, entry, args, envs, log_dir, redirects=0, tee=0, name="bench") -> Job:
        return FloorContractJob(entry, args, envs, log_dir, redirects, tee, name)


class FloorContractJob(_PromisesKept, FloorJob):
    """FloorJob keeping torch's promises."""

    def __init__(self, entry, args, envs, log_dir, redirects, tee, name):
        self.promises = _TorchPromises(entry, envs, log_dir, name)
        try:
            envs = {r: self.promises.rank_env(r, envs[r]) for r in range(len(args))}
            super().__init__(entry, args, envs, self.promises.attempt, redirects, tee, name)
        except BaseException:
            self.promises.put_back()  # (again, if the floor's own clean-up did: no harm)
            raise


# --------------------------------------------------------------------------- registry


def torchmp_module() -> str:
    return os.environ.get("BENCH_TORCHMP_MODULE") or "torchmp"


def make(name: str) -> Impl:
    if name == "torchmp":
        return ApiImpl("torchmp", torchmp_module())
    if name == "torch":
        return ApiImpl("torch", TORCH_MODULE)
    if name == "torch-p01":
        return ApiImpl("torch-p01", TORCH_MODULE, period=0.01)
    if name == "stdlib":
        return StdlibImpl()
    if name == "floor":
        return FloorImpl()
    if name == "stdlib-contract":
        return StdlibContractImpl()
    if name == "floor-contract":
        return FloorContractImpl()
    raise ValueError(f"unknown impl {name!r} (known: {', '.join(ALL_IMPLS)})")


def resolve(names: list[str]) -> tuple[dict[str, Impl], dict[str, str]]:
    """Instantiate and check impls: (available by name, unavailable name -> reason)."""
    ok: dict[str, Impl] = {}
    bad: dict[str, str] = {}
    for n in names:
        impl = make(n)
        why = impl.check()
        if why is None:
            ok[n] = impl
        else:
            bad[n] = why
    return ok, bad


Factory = Callable[[str], Impl]
