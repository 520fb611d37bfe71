"""The harness of the parity suite (tests/test_parity_*.py): the two
implementations behind the ``impl`` fixture, the fixtures every parity module
uses, and the helpers that launch, wait and drive.

tests/conftest.py loads this module as a plugin (``pytest_plugins``), so its
fixtures are known everywhere; none is autouse.  Each parity module asks for
the two it needs around every test with

    pytestmark = pytest.mark.usefixtures("multiprocessing_helpers", "restore_signal_handlers")
"""
from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

import torchmp
from helpers import pid_alive


PY = sys.executable
PERIOD = 0.05  # torch's wait() polls every `period` s; torchmp ignores it
HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
LINK_MSG = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
SYSTEM_TERMINATED = {"category": "system_terminated_error", "retryability": "False"}
TORCHMP_ORIGIN = str(Path(torchmp.__file__).resolve().parent.parent)


# --- the two implementations ----------------------------------------------------

def _namespace(name: str, module: str, errors_module: str) -> SimpleNamespace:
    import importlib

    mod = importlib.import_module(module)
    err = importlib.import_module(errors_module)
    return SimpleNamespace(
        name=name,
        module=module,
        errors_module=errors_module,
        start_processes=mod.start_processes,
        DefaultLogsSpecs=mod.DefaultLogsSpecs,
        Std=mod.Std,
        RunProcsResult=mod.RunProcsResult,
        SignalException=mod.SignalException,
        ProcessFailure=err.ProcessFailure,
        ChildFailedError=err.ChildFailedError,
        record=err.record,
        ErrorHandler=err.ErrorHandler,
    )


def _traceback_as_text(record: logging.LogRecord) -> bool:
    """A logging filter: the record's traceback as text (still shown), not
    as objects (which keep every frame of it alive)."""
    if record.exc_info:
        record.exc_text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
        record.exc_info = None
    return True


@pytest.fixture(params=["torchmp", pytest.param("torch", marks=pytest.mark.torch)])
def impl(request: pytest.FixtureRequest) -> SimpleNamespace:
    if request.param == "torch":
        pytest.importorskip("torch.distributed.elastic.multiprocessing",
                            reason="torch is not installed: the torch side of the parity suite")
        # torch logs a failed function worker with logger.exception(); the
        # record that pytest's log capture keeps holds the traceback, whose
        # frames keep the context -- and its queues' pipes -- alive past the
        # leak guard.  Keep the text of the traceback, drop the objects.
        logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
        logger.addFilter(_traceback_as_text)
        request.addfinalizer(lambda: logger.removeFilter(_traceback_as_text))
        # torch's ProcessFailure adds "errorTraits" to its module-level
        # _EMPTY_ERROR_DATA, the dict every file-less failure shares: put it
        # back as it was, so that this module leaves torch as it found it.
        from torch.distributed.elastic.multiprocessing import errors as torch_errors

        shared = torch_errors._EMPTY_ERROR_DATA
        saved = dict(shared)
        request.addfinalizer(lambda: (shared.clear(), shared.update(saved)))
        return _namespace("torch", "torch.distributed.elastic.multiprocessing",
                          "torch.distributed.elastic.multiprocessing.errors")
    return _namespace("torchmp", "torchmp", "torchmp.errors")


@pytest.fixture(scope="module")
def multiprocessing_helpers():
    """torch's function contexts use multiprocessing's synchronisation
    objects, which start multiprocessing's resource tracker (a long-lived
    child) under spawn and forkserver.  Start it before the per-test leak
    guard takes its snapshot, and stop it when this module is done if it was
    this module that started it."""
    import importlib.util
    from multiprocessing import resource_tracker

    if importlib.util.find_spec("torch") is None:
        yield  # torchmp's function contexts do not use it
        return
    tracker = resource_tracker._resource_tracker
    started_here = getattr(tracker, "_pid", None) is None
    resource_tracker.ensure_running()
    yield
    if started_here:
        with contextlib.suppress(Exception):
            tracker._stop()


@pytest.fixture
def restore_signal_handlers():
    """start_processes() installs SignalException handlers on the main
    thread (both implementations): give pytest its own back."""
    saved = {s: signal.getsignal(s) for s in HANDLED_SIGNALS}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


# --- helpers ---------------------------------------------------------------------


def kill_leftovers(pids) -> None:
    """Last resort: SIGKILL, by process group then by pid, the given pids that
    are still our own live descendants (never anything found by name)."""
    try:
        ours = {p.pid for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        ours = set()
    for pid in pids:
        if pid in ours and pid_alive(pid):
            for kill in (os.killpg, os.kill):
                with contextlib.suppress(OSError):
                    kill(pid, signal.SIGKILL)


def wait_result(pc, timeout: float = -1):
    return pc.wait(timeout, period=PERIOD)


@contextlib.contextmanager
def launched(impl, name, entrypoint, args, envs=None, *, log_dir, redirects=None, tee=None,
             **kwargs):
    """start_processes with a DefaultLogsSpecs; closes the context (and kills
    anything left, by pid) whatever happens."""
    Std = impl.Std
    specs = impl.DefaultLogsSpecs(log_dir=str(log_dir),
                                  redirects=Std.NONE if redirects is None else redirects,
                                  tee=Std.NONE if tee is None else tee)
    if envs is None:
        envs = {rank: {} for rank in args}
    pc = impl.start_processes(name, entrypoint, args, envs, specs, **kwargs)
    pids = dict(pc.pids())
    try:
        yield pc
    finally:
        try:
            pc.close(timeout=2)
        finally:
            with contextlib.suppress(Exception):
                pids.update(pc.pids())
            kill_leftovers(pids.values())


def py_args(code: str, nprocs: int, *extra) -> dict[int, tuple]:
    """Binary args for `python -c code <rank> extra...` per rank."""
    code = textwrap.dedent(code)
    return {rank: ("-c", code, rank, *extra) for rank in range(nprocs)}


def attempt_dir_of(path: str) -> str:
    """`<log_dir>/<run_id>_<random>/attempt_0` of a rank's file path."""
    return os.path.dirname(os.path.dirname(path))


# --- driver subprocesses ------------------------------------------------------------

DRIVER_HEADER = """\
import json, os, signal, sys, time
from {module} import DefaultLogsSpecs, SignalException, Std, start_processes
PY = sys.executable
"""


def _driver_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (TORCHMP_ORIGIN, env.get("PYTHONPATH")) if p)
    env["PYTHONIOENCODING"] = "utf-8"  # the console encoding torch's tailer writes with
    return env


def popen_driver(impl, tmp_path: Path, body: str, *argv: str) -> subprocess.Popen:
    """A launcher program of its own (fd 1/2 are pipes we read), cwd tmp_path."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER_HEADER.format(module=impl.module) + textwrap.dedent(body))
    return subprocess.Popen([PY, str(script), *argv], cwd=tmp_path, env=_driver_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)


def finish_driver(proc: subprocess.Popen, timeout: float = 60) -> tuple[str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return out.decode(), err.decode()


def read_line(proc: subprocess.Popen, prefix: str, timeout: float = 30) -> str:
    """The first line of the driver's stdout that starts with prefix."""
    deadline = time.monotonic() + timeout
    buf = b""
    fd = proc.stdout.fileno()
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        buf += chunk
        complete = buf[: buf.rfind(b"\n") + 1]  # whole lines only
        for line in complete.decode(errors="replace").splitlines():
            if line.startswith(prefix):
                return line
    raise AssertionError(f"driver did not print {prefix!r}; got {buf!r}")
