"""The parts of torch's module surface that torch's own tests drive:
_tail_logs, MultiprocessContext._pc, _wrap, _validate_full_rank, and the
signal handlers PContext.start installs."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import threading
import time

import pytest

from workers import functions as fw
from helpers import launch, python_worker
from torchmp import Std, api
from torchmp._functions import ProcessExitedException
from torchmp.logs_specs import RankMappingError


def test_tail_logs_one_per_teed_stream_and_stopped_once_drained(tmp_path):
    code = "import time; print('hi', flush=True); time.sleep(30)"
    entry, args = python_worker(code)
    ctx = launch(entry, {0: args, 1: args}, log_dir=tmp_path, redirects={1: Std.ERR},
                 tee={0: Std.ALL, 1: Std.OUT})
    try:
        tails = ctx._tail_logs
        # rank 0: stdout and stderr; rank 1: stdout (its stderr is a file)
        assert [(t.rank, t.which) for t in tails] == [(0, 0), (1, 0), (0, 1)]
        # The workers hold their pipes open: nothing is drained yet.
        assert not any(t.stopped() for t in tails)
    finally:
        ctx.close()
    assert all(t.stopped() for t in tails)


def test_tail_log_stops_when_its_stream_ends_before_the_worker(tmp_path):
    # The worker closes its stdout and lives on: that stream is done.
    code = "import os, sys, time; print('x', flush=True); os.close(1); time.sleep(30)"
    entry, args = python_worker(code)
    ctx = launch(entry, {0: args}, log_dir=tmp_path, tee=Std.ALL)
    try:
        out, err = ctx._tail_logs
        deadline = time.monotonic() + 10
        while not out.stopped() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert out.stopped() and not err.stopped()
    finally:
        ctx.close()


def test_pc_view_of_function_workers(tmp_path):
    ctx = launch(fw.raise_or_sleep, {0: (0, 1, 30, str(tmp_path / "p")), 1: (1, 1, 0.5, str(tmp_path / "p"))},
                 log_dir=tmp_path / "logs", start_method="fork")
    try:
        pc = ctx._pc
        assert pc.pids() == list(ctx.pids().values())
        assert [p.pid for p in pc.processes] == pc.pids()
        assert pc.join(-1) is False and all(p.is_alive() for p in pc.processes)
        assert pc.processes[0].exitcode is None
        with pytest.raises(ProcessExitedException) as raised:
            while not pc.join(20):
                pass
        assert (raised.value.error_index, raised.value.error_pid, raised.value.exit_code) == (1, pc.pids()[1], 1)
        assert pc.processes[1].exitcode == 1 and not pc.processes[1].is_alive()
        result = ctx.wait(30)
        assert set(result.failures) == {1}
        assert pc.processes[0].exitcode == -signal.SIGTERM
    finally:
        ctx.close()


def test_pc_join_true_once_all_succeeded(tmp_path):
    ctx = launch(fw.ident, {0: (), 1: ()}, log_dir=tmp_path, start_method="fork")
    try:
        while not ctx._pc.join():
            pass
        assert ctx._is_done()
        assert [p.exitcode for p in ctx._pc.processes] == [0, 0]
        assert not ctx.wait(10).is_failed()
    finally:
        ctx.close()


def test_wrap_runs_the_function_with_redirects_and_env(tmp_path, monkeypatch):
    out, err = tmp_path / "out.log", tmp_path / "err.log"
    queue = multiprocessing.SimpleQueue()

    class Event:
        waited = 0

        def wait(self) -> None:
            self.waited += 1

    event = Event()
    monkeypatch.delenv("WRAP_TEST", raising=False)
    api._wrap(0, fw.echo_env_and_return, {0: ("WRAP_TEST",)}, {0: {"WRAP_TEST": "yes"}},
              {0: str(out)}, {0: str(err)}, {0: queue}, event, None)
    assert queue.get() == "yes"
    assert event.waited == 1
    assert out.read_bytes() == b"stdout yes\n" and err.read_bytes() == b"stderr yes\n"
    # numa_options is torch's NumaOptions or the like (test_binding binds with it).
    with pytest.raises(TypeError, match="numa_options must be a NumaOptions"):
        api._wrap(0, fw.ident, {0: ()}, {0: {}}, {0: ""}, {0: ""}, {0: queue}, event, object())


def test_validate_full_rank_raises_runtime_error():
    with pytest.raises(RuntimeError):
        api._validate_full_rank({}, 10, "")
    assert issubclass(RankMappingError, RuntimeError)


def test_start_registers_handlers_through_the_signal_module(monkeypatch, caplog):
    calls = []
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGUSR1, NOPE,SIGTERM")
    monkeypatch.setattr(api.signal, "signal", lambda sig, handler: calls.append((sig, handler)))
    caplog.set_level(logging.INFO, logger="torchmp.api")
    api._install_signal_handlers()
    assert calls == [(signal.SIGUSR1, api._terminate_process_handler),
                     (signal.SIGTERM, api._terminate_process_handler)]
    messages = [r.getMessage() for r in caplog.records]
    assert "Registered signal handler for SIGUSR1" in messages
    assert any(m.startswith("Failed to register signal handler for NOPE") for m in messages)


def test_start_off_the_main_thread_warns_with_torchs_text(caplog):
    caplog.set_level(logging.WARNING, logger="torchmp.api")
    t = threading.Thread(target=api._install_signal_handlers)
    t.start()
    t.join()
    assert [r.getMessage() for r in caplog.records] == [
        "Failed to register signal handlers since torchelastic is running on a child thread. "
        "This could lead to orphaned worker processes if the torchrun is terminated."]


def test_terminate_handler_text():
    with pytest.raises(api.SignalException) as raised:
        api._terminate_process_handler(signal.SIGTERM, None)
    assert raised.value.sigval == signal.SIGTERM
    assert str(raised.value) == f"Process {os.getpid()} got signal: {int(signal.SIGTERM)}"
    assert sys.platform != "win32" and api.IS_WINDOWS is False
