"""Spawn/reap utilities for the tests (psutil's tests/__init__.py style)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

import torchmp
from torchmp import DefaultLogsSpecs, Std

HERE = Path(__file__).resolve().parent
BIN = HERE / "bin"
REPO = HERE.parent


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


def read_pids(path: Path, count: int, timeout: float = 5.0) -> list[int]:
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


def popen_launcher(script: str, *, env=None, **kwargs) -> subprocess.Popen:
    """Start a launcher program in a fresh interpreter, in its own session.

    It uses this interpreter and environment, so it imports the same torchmp
    as the tests (installed, or a source tree on PYTHONPATH); its cwd is "/"
    so that `python -c` cannot pick up an unbuilt source tree from the cwd.
    """
    full_env = dict(os.environ)
    # Wherever this torchmp came from (installed, or a built source tree).
    origin = str(Path(torchmp.__file__).resolve().parent.parent)
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (origin, full_env.get("PYTHONPATH")) if p)
    if env:
        full_env.update(env)
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], env=full_env,
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
