"""Spawn/reap utilities for the tests (psutil's tests/__init__.py style)."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import psutil

import torchmp
from torchmp import DefaultLogsSpecs, Std

HERE = Path(__file__).resolve().parent
WORKERS = HERE / "workers"  # worker scripts, run by path
REPO = HERE.parent

#: Where the torchmp these tests import comes from (installed, or a built
#: source tree): launcher programs are given it on PYTHONPATH.
TORCHMP_PATH = str(Path(torchmp.__file__).resolve().parent.parent)


def fd_target(fd: int | str) -> str:
    """What this process's fd points to (a path, pipe:[...]), "?" if closed."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


def pid_alive(pid: int) -> bool:
    """True if pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in (b"Z", b"X")


def wait_gone(pids, timeout: float = 5.0) -> list[int]:
    """Wait until none of pids is alive; return the ones still alive."""
    deadline = time.monotonic() + timeout
    alive = [p for p in pids if pid_alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.01)
        alive = [p for p in alive if pid_alive(p)]
    return alive


def kill_groups(pids) -> None:
    """Last-resort cleanup by process group, then by pid."""
    for pid in pids:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except OSError:
                pass


def read_pids(path: Path, count: int, timeout: float = 30.0) -> list[int]:
    """Wait for a file with `count` pids (one a line) written by workers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            lines = path.read_text().split()
        except FileNotFoundError:
            lines = []
        if len(lines) >= count:
            return [int(x) for x in lines[:count]]
        time.sleep(0.01)
    raise AssertionError(f"workers did not write {count} pids to {path}")


def launch(entrypoint, args, envs=None, *, log_dir, redirects=Std.NONE, tee=Std.NONE,
           name="trainer", local_ranks_filter=None, **kwargs):
    specs = DefaultLogsSpecs(log_dir=str(log_dir), redirects=redirects, tee=tee,
                             local_ranks_filter=local_ranks_filter)
    if envs is None:
        envs = {r: {} for r in range(len(args))}
    return torchmp.start_processes(name, entrypoint, args, envs, specs, **kwargs)


def shown_while_waiting(capfdbinary, wanted: bytes, go: Path) -> bytes:
    """The console's stdout until ``wanted`` is in it (30 s at most), then
    ``go`` is made: the rank waits for it to go on."""
    seen = b""
    try:
        deadline = time.monotonic() + 30
        while wanted not in seen and time.monotonic() < deadline:
            time.sleep(0.02)
            seen += capfdbinary.readouterr()[0]
    finally:
        go.touch()
    return seen


# A rank writing 2 MB lines, each in one write(), as fast as it can.  A line
# is longer than the launcher's largest pipe (1 MiB), so each write is copied
# up to a full pipe and waits for room, and a stop lands inside it, with the
# first part of the line already read.
LONG_LINES = """
import os, sys
line = b"L" * 1_999_999 + b"\\n"
for _ in range(int(sys.argv[1])):
    view = memoryview(line)
    while view:
        view = view[os.write(1, view):]
"""
LONG_LINE_BYTES = b"L" * 1_999_999 + b"\n"


def _stable_size(path: Path) -> int:
    size = -1
    while True:
        time.sleep(0.05)
        now = path.stat().st_size if path.exists() else 0
        if now == size:
            return size
        size = now


def stop_inside_a_long_line(pid: int, log: Path) -> float | None:
    """Stop a LONG_LINES rank (SIGSTOP) until the stop lands inside a line,
    as its log shows once the launcher has read all there is; keep it
    stopped past the idle partial-line time (0.1 s), and go on (SIGCONT).
    How long it was stopped, or None if no stop landed inside a line in 50
    tries.  The caller sends SIGCONT again in its cleanup, whatever failed."""
    for _ in range(50):
        stopped = time.monotonic()
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            return None  # it wrote every line and exited
        if _stable_size(log) % len(LONG_LINE_BYTES):
            # Stopped for 0.2 s or more in all (the stable size took 0.1 s):
            # twice the idle time, and well short of the launcher's 1 s hold
            # on a loaded machine.
            time.sleep(0.1)
            os.kill(pid, signal.SIGCONT)
            return time.monotonic() - stopped
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.01)
    return None


def launcher_env(env=None, *, tag: str | None = None, unset: Iterable[str] = (),
                 trailing_pathsep: bool = False) -> dict[str, str]:
    """The environment of a launcher program: this one, with TORCHMP_PATH
    first on PYTHONPATH, TAG_VAR=tag (if a tag is given), the names in
    `unset` removed, then `env` on top.

    trailing_pathsep: PYTHONPATH is TORCHMP_PATH + os.pathsep + the old
    value even when there is none (an empty entry, which puts the cwd on
    sys.path), as test_cli, test_torchrun and test_process_safety have
    always launched; otherwise empty parts are left out.
    """
    full_env = dict(os.environ)
    if trailing_pathsep:
        full_env["PYTHONPATH"] = TORCHMP_PATH + os.pathsep + full_env.get("PYTHONPATH", "")
    else:
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in (TORCHMP_PATH, full_env.get("PYTHONPATH")) if p)
    if tag is not None:
        full_env[TAG_VAR] = tag
    for name in unset:
        full_env.pop(name, None)
    if env:
        full_env.update(env)
    return full_env


def popen_launcher(script: str, *, env=None, **kwargs) -> subprocess.Popen:
    """Start a launcher program in a fresh interpreter, in its own session.

    It uses this interpreter and environment, so it imports the same torchmp
    as the tests (installed, or a source tree on PYTHONPATH); its cwd is "/"
    so that `python -c` cannot pick up an unbuilt source tree from the cwd.
    """
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], env=launcher_env(env),
                            cwd="/", start_new_session=True, **kwargs)


def run_launcher(script: str, *, timeout: float = 60, env=None, stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE) -> subprocess.CompletedProcess:
    """Run a launcher program to completion (its console is ours to read)."""
    proc = popen_launcher(script, env=env, stdout=stdout, stderr=stderr)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_groups([proc.pid])
        proc.communicate()
        raise
    finally:
        kill_groups([proc.pid])
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def table_rows(lines: Iterable[str], row: re.Pattern[str]) -> dict[int, dict[str, str | None]]:
    """The rows of a table printed one a line (a summary, a hang report),
    up to the first line that is not one: the groups of `row`, by rank."""
    rows = {}
    for line in lines:
        m = row.match(line)
        if not m:
            break
        rows[int(m["rank"])] = m.groupdict()
    return rows


def python_worker(code: str) -> tuple[str, tuple[str, ...]]:
    """(entrypoint, args) for a binary launch of `python -c code`."""
    return sys.executable, ("-c", textwrap.dedent(code))


# --- processes found by a tag in their environment --------------------------

#: Set to a unique value in the environment of a launcher under test, so its
#: workers (which inherit it) can be found and killed even if it dies.
TAG_VAR = "TORCHMP_TEST_TAG"


def tagged(tag: str) -> list[psutil.Process]:
    """The processes whose environment has TAG_VAR=tag."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(TAG_VAR) == tag:
                found.append(p)
        except (psutil.Error, OSError):
            pass
    return found


def kill_tagged(tag: str) -> None:
    for p in tagged(tag):
        for kill in (os.killpg, os.kill):
            try:
                kill(p.pid, signal.SIGKILL)
            except OSError:
                pass


def stop_launcher(proc: subprocess.Popen, tag: str | None = None, timeout: float = 10.0) -> None:
    """Kill what a launcher test started -- the processes carrying tag, and
    the launcher's own process group -- and reap the launcher."""
    if tag is not None:
        kill_tagged(tag)
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass


def wait_no_tagged(tag: str, timeout: float = 5.0) -> list[psutil.Process]:
    """Wait until no tagged process is left (zombies aside); returns those left."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for p in tagged(tag):
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    left.append(p)
            except psutil.Error:
                pass  # gone meanwhile
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)


# --- a launcher program under test, stopped by tag and process group -----------

class Launcher:
    """A launcher program (``argv``) in a session of its own, with a unique
    TAG_VAR its workers inherit.

    Its environment is launcher_env(env, tag=self.tag, unset=unset,
    trailing_pathsep=...) and its cwd "/" unless told (so that ``python -m``
    or ``python -c`` cannot pick up an unbuilt source tree from the cwd);
    stdin is /dev/null, stdout and stderr are pipes, text with errors
    replaced unless text=False.  Read them with communicate(), or with
    follow=True line by line as they come (self.out, self.err, wait_for(),
    finish()).  stdout and stderr can be given instead (a file, an fd, a
    pipe's or a terminal's end the test reads itself, as Popen takes them):
    then wait() for the exit.  stop() kills what is left -- the processes
    carrying the tag and the launcher's process group -- and reaps it; use
    it in a fixture's teardown or a ``with`` block (Launchers) so it runs
    when a test fails.
    """

    def __init__(self, argv: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | Path = "/",
                 unset: Iterable[str] = ("TORCHELASTIC_SIGNALS_TO_HANDLE",), trailing_pathsep: bool = False,
                 text: bool = True, errors: str = "replace", follow: bool = False,
                 stdout: Any = subprocess.PIPE, stderr: Any = subprocess.PIPE) -> None:
        self.tag = uuid.uuid4().hex
        self.text = text
        self.proc = subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
            env=launcher_env(env, tag=self.tag, unset=unset, trailing_pathsep=trailing_pathsep),
            cwd=cwd, start_new_session=True, text=text, errors=errors if text else None)
        self.out: list = []
        self.err: list = []
        self._cond = threading.Condition()
        self._readers: list[threading.Thread] = []
        if follow:  # the streams that are pipes (the others are not ours to read)
            self._readers = [threading.Thread(target=self._read, args=(s, lines), daemon=True)
                             for s, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))
                             if s is not None]
            for t in self._readers:
                t.start()

    def _read(self, stream, lines: list) -> None:
        newline = "\n" if self.text else b"\n"
        for line in stream:
            with self._cond:
                lines.append(line.rstrip(newline))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def communicate(self, timeout: float = 60) -> tuple[int, str, str]:
        """Wait for the launcher's exit: (returncode, stdout, stderr).  If it
        does not exit in time, it is killed and the test fails."""
        assert not self._readers, "communicate() of a launcher whose output is followed"
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_launcher(self.proc, self.tag)
            out, err = self.proc.communicate()
            raise AssertionError(f"launcher did not finish in {timeout}s:\n{out}\n{err}") from None
        return self.proc.returncode, out, err

    def wait(self, timeout: float = 60, message: str | None = None) -> int:
        """Wait for the launcher's exit: its returncode (for a launcher whose
        stdout and stderr are not pipes; else communicate()).  If it does not
        exit in time, it is killed and the test fails with message."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            stop_launcher(self.proc, self.tag)
            raise AssertionError(message or f"launcher did not finish in {timeout}s") from None

    def wait_pid_files(self, paths: Sequence[Path], timeout: float = 60.0) -> list[int]:
        """Wait for the workers to write their pids, one a file (written to a
        temporary name and renamed, so a file that is there is whole).  If the
        launcher exits first, or the time runs out, the test fails at once
        with what there is to see: the launcher's state, the processes that
        carry its tag, and its output (after it is stopped)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return [int(p.read_text()) for p in paths]
            except (FileNotFoundError, ValueError):
                pass
            exited = self.proc.poll()
            if exited is not None or time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        missing = [str(p) for p in paths if not p.exists()]
        state = f"exited with {exited}" if exited is not None else f"still running after {timeout}s"
        running = []
        for p in tagged(self.tag):
            try:
                running.append(f"{p.pid} {p.status()} {' '.join(p.cmdline())}")
            except psutil.Error:
                pass  # gone meanwhile
        stop_launcher(self.proc, self.tag)
        out = err = ""
        if self.proc.stdout is not None and self.proc.stderr is not None and not self._readers:
            out, err = self.proc.communicate()
        raise AssertionError(f"workers did not write {missing}; the launcher {state}; tagged: {running}\n"
                             f"stdout: {out}\nstderr: {err}")

    def wait_for(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        """With follow=True: wait until predicate() (over self.out and
        self.err) is true, or fail the test showing the output so far."""
        with self._cond:
            if not self._cond.wait_for(predicate, timeout):
                raise AssertionError(f"timed out waiting for {what}:\n" + "\n".join(map(str, self.out + self.err)))

    def finish(self, timeout: float = 60) -> int:
        """With follow=True: wait for the exit and the last lines; the returncode."""
        code = self.proc.wait(timeout)
        for t in self._readers:
            t.join(5)
        return code

    def stop(self) -> None:
        """Kill what is left of the run, reap the launcher, close its pipes
        (again and again if need be)."""
        stop_launcher(self.proc, self.tag)
        for t in self._readers:
            t.join(5)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream:
                stream.close()

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class Launchers:
    """The launchers a test starts, all stopped when the ``with`` block (a
    fixture's teardown) ends, whether the test passed or not.  Keyword
    arguments given here are defaults for every Launcher."""

    def __init__(self, **defaults) -> None:
        self.defaults = defaults
        self.started: list[Launcher] = []

    def start(self, argv: Sequence[str], **kwargs) -> Launcher:
        launched = Launcher(argv, **{**self.defaults, **kwargs})
        self.started.append(launched)
        return launched

    def python(self, script: str, *args: str, argv_prefix: Sequence[str] = (), **kwargs) -> Launcher:
        """A launcher ``[*argv_prefix, python, -c, script, *args]``, script dedented."""
        return self.start([*argv_prefix, sys.executable, "-c", textwrap.dedent(script), *args], **kwargs)

    def __enter__(self) -> Launchers:
        return self

    def __exit__(self, *exc) -> None:
        for launched in self.started:
            launched.stop()

    def left(self, timeout: float = 5.0) -> list[psutil.Process]:
        """After the ``with`` block: the processes of any launcher started
        that are still alive (zombies aside), waiting up to timeout for each."""
        return [p for launched in self.started for p in wait_no_tagged(launched.tag, timeout)]


def can_unshare_pid() -> bool:
    """Whether a private pid namespace can be made here (unshare --pid),
    with its next pid settable (ns_last_pid)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    probe = subprocess.run(
        [unshare, "--pid", "--fork", "--mount-proc", "sh", "-c", "echo $$ > /proc/sys/kernel/ns_last_pid"],
        capture_output=True, timeout=10)
    return probe.returncode == 0


def interrupt_once_started(code, seen: dict[str, int]):
    """A ``sys.settrace`` hook: in the frames of ``code`` (run's or
    run_async's), at the first line after its local ``cmd`` (the started
    command) is set, note the command's pid in ``seen["pid"]`` and raise
    KeyboardInterrupt there -- what a signal's handler does when a tracer
    (coverage, a debugger) lets it run at any line."""
    def in_frame(frame, event, arg):
        if event == "line" and "pid" not in seen:
            cmd = frame.f_locals.get("cmd")
            if cmd is not None:
                seen["pid"] = cmd.pid
                raise KeyboardInterrupt
        return in_frame

    return lambda frame, event, arg: in_frame if frame.f_code is code else None


def stale_look_after_sigkill(monkeypatch, waits_here: bool) -> dict[str, float]:
    """Make a command's shutdown race its own SIGKILL: the SIGKILL goes out
    from inside the policy's first look after it, once that look has seen
    the leader running, and the look answers "running" only once the
    leader is dead (and, unless the command is waited for in the calling
    thread, its exit recorded) -- the exit coming between a look and the
    wait after it, as it does when a loaded machine preempts the launcher
    there.  Returns when the SIGKILL was asked for ("killed"), when the
    stale answer was given ("stale") and when the policy looked again
    ("next"); "gone" if the leader was not running at that look."""
    from torchmp import _core
    from torchmp._launch import command as _command

    seen: dict[str, float] = {}
    real_killpg, real_running = _command._Command.killpg, _command._Command.running

    def killpg(self, sig: int) -> None:
        if sig == signal.SIGKILL and "stale" not in seen:
            seen.setdefault("killed", time.monotonic())  # sent by the look below
            return
        real_killpg(self, sig)

    def running(self) -> bool:
        if "killed" not in seen or "next" in seen or "gone" in seen:
            return real_running(self)
        if "stale" in seen:
            seen["next"] = time.monotonic()
            return real_running(self)
        if not real_running(self):
            seen["gone"] = time.monotonic()
            real_killpg(self, signal.SIGKILL)
            return False
        real_killpg(self, signal.SIGKILL)
        deadline = time.monotonic() + 10
        pid = self._cmd.pid
        while time.monotonic() < deadline:
            try:
                dead = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None
            except ChildProcessError:
                dead = True  # (reaped already)
            if dead and (waits_here or self._cmd.state & _core.CMD_EXITED):
                break
            time.sleep(0.001)
        seen["stale"] = time.monotonic()
        return True

    monkeypatch.setattr(_command._Command, "killpg", killpg)
    monkeypatch.setattr(_command._Command, "running", running)
    return seen


def check_looked_again_at_once(seen: dict[str, float], pidfile: Path) -> None:
    """After a command run under stale_look_after_sigkill: the policy looked
    again at once after the stale answer (not after the kill grace), and the
    leader (its pid in pidfile) is gone."""
    (pid,) = read_pids(pidfile, 1)
    try:
        assert "stale" in seen and "next" in seen, seen
        assert seen["next"] - seen["stale"] < 1.0, seen
        assert wait_gone([pid], 1) == []
    finally:
        kill_groups([pid])
