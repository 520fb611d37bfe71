"""Function launch: ``MultiprocessContext`` with spawn, fork and forkserver.

Every start method ends in the same native machinery as a binary launch:
each worker is in its own session (process group), its stdout/stderr are the
redirect file or a tee pipe at the fd level (so C code and the worker's own
subprocesses are captured), and its pickled return value comes back through
a pipe that the I/O thread drains into memory -- any size, whether or not the
launcher is calling ``wait``.

=============  ==============================================================
start method   how a worker starts
=============  ==============================================================
``spawn``      a fresh interpreter exec'd by the I/O thread; the pickled
               function, args and the data to re-import ``__main__`` arrive
               on an inherited fd (``if __name__ == "__main__":`` guards work
               as with multiprocessing)
``fork``       the calling thread forks (through CPython's fork hooks) and the
               child runs the function.  Caveat of fork: only the forking
               thread exists in the child, so locks held by other threads at
               that moment stay locked there; do not fork a launcher whose
               other threads hold locks the function needs.  The parent-death
               signal is armed only when forking from the main thread (it
               fires when the *forking thread* exits).
``forkserver`` a long-lived server (started on first use, preloading
               ``set_forkserver_preload`` modules) forks each worker; the
               launcher still gets pids, exit codes and rusage and kills whole
               process groups; a dead server is reported, never waited on.
=============  ==============================================================
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping
from typing import Any

from torchmp import _core
from torchmp._launch import worker as _worker
from torchmp._launch.exec import (
    _RETURN_CHANNEL, RankStreams, _ExecPlan, _exec_env, _exitcode, _launcher_environ, apply_rank_env,
)
from torchmp._inputs import START_METHODS
from torchmp._native import KILL_GRACE_SECONDS, _NativeContext, logger
from torchmp._pcontext import RunProcsResult
from torchmp._signals import SignalException, handled_signals
from torchmp.errors import ProcessFailure
from torchmp.logs_specs import LogsSpecs

__all__ = ["MultiprocessContext", "ProcessExitedException", "WorkerView", "WorkersView"]



# A forked worker must die of the signals the launcher turns into
# SignalException (api.handled_signals()) like any other process, not raise
# in the user's function.


def _payload_file(data: bytes) -> int:
    """An anonymous file holding data (memfd where there is one)."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("torchmp-payload", os.MFD_CLOEXEC)
    else:  # pragma: no cover - non-Linux
        f = tempfile.TemporaryFile()
        fd = os.dup(f.fileno())
        f.close()
        os.set_inheritable(fd, False)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_picklable(start_method: str, entrypoint: Callable[..., Any], args: dict[int, tuple[Any, ...]]) -> None:
    if start_method == "fork":
        return
    try:
        pickle.dumps(entrypoint, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        name = getattr(entrypoint, "__qualname__", repr(entrypoint))
        raise ValueError(
            f"entrypoint {name} cannot be pickled for start_method={start_method!r} ({e}); "
            "define it at module level (not a lambda or a local function), or use start_method='fork'"
        ) from None
    for rank, rank_args in args.items():
        try:
            pickle.dumps(rank_args, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            raise ValueError(f"args[{rank}] cannot be pickled for start_method={start_method!r}: {e}") from None


class ProcessExitedException(Exception):
    """A worker exited with a non-zero code or by a signal, as
    ``torch.multiprocessing.ProcessExitedException`` says it (raised by
    ``MultiprocessContext._pc.join``)."""

    def __init__(self, msg: str, error_index: int, error_pid: int, exit_code: int,
                 signal_name: str | None = None) -> None:
        super().__init__(msg)
        self.msg = msg
        self.error_index = error_index
        self.error_pid = error_pid
        self.exit_code = exit_code
        self.signal_name = signal_name


def _names_failed_worker(e: BaseException) -> bool:
    # torch.multiprocessing's ProcessRaisedException and ProcessExitedException
    # (a replaced _pc may raise them) and torchmp's own, without importing torch.
    return isinstance(e, Exception) and hasattr(e, "error_index") and hasattr(e, "error_pid")


class WorkerView:
    """One rank of a function context as ``torch.multiprocessing``'s
    ``Process`` shows it to a launcher: ``pid``, ``exitcode``,
    ``is_alive()``, ``join(timeout)``.  A read-only view of the native
    group; signals go to process groups through the context (close())."""

    def __init__(self, context: MultiprocessContext, rank: int) -> None:
        self._context = context
        self.rank = rank

    def _info(self) -> _core.ProcInfo:
        return self._context._snapshot()[1][self.rank]

    @property
    def pid(self) -> int | None:
        info = self._info()
        return None if info.state == _core.PROC_UNSTARTED else info.pid

    @property
    def exitcode(self) -> int | None:
        info = self._info()
        return _exitcode(info.wait_status) if info.state == _core.PROC_EXITED else None

    def is_alive(self) -> bool:
        return bool(self._info()[0] == _core.PROC_RUNNING)

    def join(self, timeout: float | None = None) -> None:
        self._context._wait_for(lambda ranks: ranks[self.rank].state != _core.PROC_RUNNING, timeout)


class WorkersView:
    """The workers of a function context as ``torch.multiprocessing``'s
    ``ProcessContext`` (``MultiprocessContext._pc`` in torch): ``processes``,
    ``pids()``, and ``join(timeout)``, which returns True once every worker
    exited with code 0, False while some run (after waiting up to timeout
    seconds for the next exit; negative: no wait), and raises
    :class:`ProcessExitedException` naming the first worker that failed.
    Unlike torch's, join() does not terminate the others: the context's
    fail-fast close() does."""

    def __init__(self, context: MultiprocessContext) -> None:
        self._context = context
        self.processes = [WorkerView(context, rank) for rank in range(context.nprocs)]

    def pids(self) -> list[int]:
        return [p for p in self._context.pids().values()]

    def join(self, timeout: float | None = None) -> bool:
        ctx = self._context
        ranks = ctx._wait_for(_any_change_after(ctx), timeout)
        # errors.root_cause_order, on the raw snapshot: never a rank torchmp
        # terminated, then the earliest exit.
        failed = [(rank in ctx._terminated_by_launcher, info.exit_real_ns, rank, info)
                  for rank, info in enumerate(ranks)
                  if info.state == _core.PROC_EXITED and info.wait_status != 0]
        if failed:
            _, _, rank, info = min(failed)
            code = _exitcode(info.wait_status)
            name = signal.Signals(-code).name if code < 0 and -code in _SIGNAL_NUMBERS else None
            what = f"signal {name}" if name else f"exit code {code}"
            raise ProcessExitedException(f"process {rank} terminated with {what}", rank, info.pid, code, name)
        return all(info.state == _core.PROC_EXITED for info in ranks)


_SIGNAL_NUMBERS = {int(s) for s in signal.Signals}


def _any_change_after(ctx: MultiprocessContext) -> Callable[[list[_core.ProcInfo]], bool]:
    """A condition true once a worker exits (or every worker has): the
    'blocks until a process exits' of torch's join()."""
    first = [info.state for info in ctx._snapshot()[1]] if ctx._group is not None else []

    def changed(ranks: list[_core.ProcInfo]) -> bool:
        states = [info.state for info in ranks]
        return states != first or all(s != _core.PROC_RUNNING for s in states)

    return changed


class MultiprocessContext(_NativeContext):
    """``PContext`` holding worker processes invoked as a function."""

    _fds_per_rank = 3  # pidfd, return channel (both ends until forked), spawn payload

    def _fds_needed(self) -> int:
        needed = super()._fds_needed()
        if self.start_method != "spawn":
            # Every rank's teed pipe ends are prepared before the first fork.
            needed += len(self._logs_dest.tee_stdouts) + len(self._logs_dest.tee_stderrs)
        return needed

    def __init__(
        self,
        name: str,
        entrypoint: Callable[..., Any],
        args: dict[int, tuple[Any, ...]],
        envs: dict[int, dict[str, str]],
        start_method: str,
        logs_specs: LogsSpecs,
        log_line_prefixes: dict[int, str] | None = None,
        numa_options: Any = None,
        duplicate_stdout_filters: list[str] | None = None,
        duplicate_stderr_filters: list[str] | None = None,
        *,
        cpu_affinity: Mapping[int, Any] | None = None,
        mem_bind: str | None = None,
    ) -> None:
        if start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}")
        self.start_method = start_method
        super().__init__(
            name, entrypoint, args, envs, logs_specs, log_line_prefixes, numa_options,
            duplicate_stdout_filters, duplicate_stderr_filters, cpu_affinity=cpu_affinity, mem_bind=mem_bind,
        )
        # torch's handle on the workers (its mp.ProcessContext): a view here.
        self._pc: Any = None
        self._return_values_cache: dict[int, Any] = {}
        # Each rank's pickled return value as the I/O thread captured it (no
        # copy), until unpickled.
        self._return_blobs: dict[int, Any] = {}

    def _check_entrypoint(self, entrypoint: Any, args: dict[int, tuple[Any, ...]],
                          envs: dict[int, dict[str, str]]) -> None:
        if not callable(entrypoint):
            raise TypeError(f"MultiprocessContext needs a callable entrypoint, got {type(entrypoint).__name__}")
        _check_picklable(self.start_method, entrypoint, args)
        self._fn: Callable[..., Any] = entrypoint  # self.entrypoint, as its type

    # -- launching ------------------------------------------------------------
    def _launch(self, group: _core.Group, streams: list[RankStreams]) -> None:
        if self.start_method != "fork" and "__main__" in sys.modules:
            # Workers re-import the main module as __mp_main__, so objects of
            # its classes come back pickled under that name (multiprocessing
            # sets up the same alias).
            sys.modules.setdefault("__mp_main__", sys.modules["__main__"])
        if self.start_method == "spawn":
            self._launch_spawn(group, streams)
        elif self.start_method == "fork":
            self._launch_fork(group, streams)
        else:
            from torchmp._launch.forkserver import get_forkserver

            get_forkserver().launch(self, group, streams)

    def _launch_spawn(self, group: _core.Group, streams: list[RankStreams]) -> None:
        prep = _worker.preparation_data()
        argv = _worker.interpreter_argv("torchmp._launch.worker", "spawn_main")
        path = os.fsencode(sys.executable)
        payload_fds: list[int] = []
        environ = _launcher_environ()
        try:
            plans = []
            for rank in range(self.nprocs):
                payload = _worker.encode_payload(prep, self._fn, self.args[rank])
                fd = _payload_file(payload)
                payload_fds.append(fd)
                plans.append(_ExecPlan(path, argv, _exec_env(rank, self.envs[rank], environ), return_channel=True,
                                       payload_fd=fd))
            self._spawn(group, streams, plans)
        finally:
            for fd in payload_fds:
                os.close(fd)

    def _launch_fork(self, group: _core.Group, streams: list[RankStreams]) -> None:
        # Python-level buffers would otherwise be written twice (parent and child).
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        on_main_thread = threading.current_thread() is threading.main_thread()
        launcher_signals = tuple(int(s) for s in handled_signals())
        # One I/O-thread round trip to open every rank's streams and one to
        # watch every worker: per-rank round trips cost more than the fork
        # itself once forked workers compete for the CPU.
        try:
            group.prepare([(out, err, _RETURN_CHANNEL) for out, err in streams])
        except OSError as e:
            logger.error("failed to set up the streams of local rank %s of %s: %s",
                         getattr(e, "rank", "?"), self.name, e)
            raise
        # A signal handler that runs inside CPython's fork hooks (logging
        # registers some) raises there, and CPython prints and drops what a
        # hook raises: the launcher would carry on as if no signal had come.
        # Such interrupts are kept and raised once fork_rank has returned.
        interrupts: list[BaseException] = []
        previous_hook = sys.unraisablehook

        def keep_interrupts(unraisable: Any) -> None:
            if isinstance(unraisable.exc_value, (SignalException, KeyboardInterrupt)):
                interrupts.append(unraisable.exc_value)
            else:
                previous_hook(unraisable)

        sys.unraisablehook = keep_interrupts
        try:
            for rank in range(self.nprocs):
                # fork_rank records the pid in the group before it returns, so
                # a signal landing anywhere after the fork cannot lose it.
                pid, ret_fd = group.fork_rank(rank, on_main_thread, launcher_signals, self._bindings.get(rank))
                if pid == 0:
                    sys.unraisablehook = previous_hook
                    # The child must never unwind into the launcher's frames.
                    try:
                        _fork_child(self._fn, self.args[rank], rank, self.envs[rank],
                                    ret_fd, launcher_signals)
                    finally:
                        os._exit(1)
                if interrupts:
                    raise interrupts[0]
            group.adopt_forked()
        except BaseException as e:
            sys.unraisablehook = previous_hook
            if isinstance(e, OSError):
                logger.error("failed to start the workers of %s: %s", self.name, e)
            self._abort_launch(group)
            raise
        finally:
            sys.unraisablehook = previous_hook
        group.drop_unstarted()

    def _abort_launch(self, group: _core.Group) -> None:
        """A launch failed half-way: drop the ranks never started and tear
        down every one that was (close() first adopts any forked worker not
        watched yet)."""
        try:
            group.drop_unstarted()
        finally:
            self._close(signal.SIGKILL, timeout=KILL_GRACE_SECONDS)

    def _start(self) -> None:
        super()._start()
        self._pc = WorkersView(self)

    # -- results ----------------------------------------------------------------
    def _is_done(self) -> bool:
        """Every worker exited with code 0 (torch: every return value came)."""
        if self._group is None:
            return False
        return all(info.state == _core.PROC_EXITED and info.wait_status == 0 for info in self._snapshot()[1])

    def _poll(self) -> RunProcsResult | None:
        # torch's shape, over _pc: a failed worker makes join() raise; once
        # all are done, join until each has exited.
        if self._result is not None:
            return self._result
        pc = self._pc
        if pc is None:
            raise RuntimeError("wait()/poll before start()")
        try:
            pc.join(-1)
            if not self._is_done() and not self._closed:
                return None
            while not pc.join():
                logger.debug("entrypoint fn finished, waiting for all child procs to exit...")
        except Exception as e:
            if not _names_failed_worker(e):
                raise
            if self._group is None:
                return self._result_from(e)  # a replaced _pc: only it knows the failure
        return self._finish()

    def _result_from(self, e: Any) -> RunProcsResult:
        """torch's result for a failure that only a replaced ``_pc`` knows of."""
        rank = int(e.error_index)
        exitcode = self._pc.processes[rank].exitcode
        logger.error("failed (exitcode: %s) local_rank: %s (pid: %s) of fn: %s (start_method: %s)",
                     exitcode, rank, e.error_pid, getattr(self.entrypoint, "__qualname__", self.entrypoint),
                     self.start_method)
        self.close()
        self._result = RunProcsResult(
            failures={rank: ProcessFailure(local_rank=rank, pid=e.error_pid, exitcode=exitcode,
                                           error_file=self.error_files.get(rank, ""))},
            stdouts=self.stdouts, stderrs=self.stderrs)
        return self._result

    def _build_result(self, ranks: list[_core.ProcInfo]) -> RunProcsResult:
        # torch's function contexts report the ranks that failed by
        # themselves, not the siblings torchmp then terminated (its binary
        # contexts do list those, and so do torchmp's).  If torchmp killed
        # every failed rank (close() while all were running), they stay.
        result = super()._build_result(ranks)
        own = {rank: f for rank, f in result.failures.items() if not f.terminated_by_launcher}
        if own:
            result.failures = own
        return result

    def _return_values(self) -> dict[int, Any]:
        values: dict[int, Any] = {}
        for rank in range(self.nprocs):
            values[rank] = self._return_value(rank)
        return values

    def _return_value(self, rank: int) -> Any:
        if rank not in self._return_values_cache:
            # Kept until it unpickles: a failed attempt must fail again next time.
            blob = self._return_blobs.get(rank, b"")
            try:
                self._return_values_cache[rank] = pickle.loads(blob) if blob else None
            except Exception as e:
                raise RuntimeError(
                    f"the return value of local rank {rank} ({len(blob)} bytes) could not be "
                    f"unpickled in the launcher: {e!r}") from e
            self._return_blobs.pop(rank, None)
        return self._return_values_cache[rank]

    def _before_release(self, group: _core.Group) -> None:
        # close() releases the native group: keep the return values.
        for rank in range(self.nprocs):
            if rank not in self._return_blobs:
                self._return_blobs[rank] = group.take_return(rank)

    def _clean_exit_problem(self, rank: int) -> str | None:
        # A worker sends its pickled return value (None included) before it
        # exits; exit code 0 with nothing sent means the function never
        # returned: os._exit(0) somewhere in it.  (torch 2.13 waits forever
        # for such a rank's value.)
        if self._return_blobs.get(rank) or rank in self._return_values_cache:
            return None
        return "exited with code 0 without returning a value (os._exit() before the function returned?)"

    def _release_foreign(self, pids: list[int]) -> None:
        if pids and self.start_method == "forkserver":
            from torchmp._launch.forkserver import get_forkserver

            get_forkserver().release(pids)

    def _lost_status_reason(self, rank: int) -> str:
        if self.start_method == "forkserver":
            return "its exit status was lost: the forkserver that started it died"
        return super()._lost_status_reason(rank)


def _fork_child(fn: Callable[..., Any], args: tuple[Any, ...], rank: int, env: dict[str, Any], ret_fd: int,
                default_signals: tuple[int, ...]) -> None:
    """Body of a forked worker: never returns into the launcher's frames."""
    try:
        # fork_rank reset these in C at fork, so none of the launcher's
        # handlers can run here; this tells Python's own table the same
        # (signal.getsignal, and a handler the function installs on top).
        for sig in default_signals:
            signal.signal(sig, signal.SIG_DFL)
        _worker.fresh_stdio()
        apply_rank_env(rank, env)
    except BaseException:
        os._exit(1)
    _worker.run(fn, args, ret_fd)
