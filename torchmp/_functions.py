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

How each of them starts a worker is :mod:`torchmp._launch`; this module
observes the workers and reports their results.
"""

from __future__ import annotations

import pickle
import signal
from collections.abc import Callable, Mapping
from typing import Any

from torchmp import _core
from torchmp._inputs import START_METHODS
from torchmp._launch import Launch
from torchmp._launch.exec import SpawnLaunch
from torchmp._launch.fork import ForkLaunch
from torchmp._native import _NativeContext, logger
from torchmp._pcontext import RunProcsResult, exitcode
from torchmp._signals import is_interrupt
from torchmp.errors import ProcessFailure
from torchmp.logs_specs import LogsSpecs

__all__ = ["MultiprocessContext", "ProcessExitedException", "WorkerView", "WorkersView"]


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
        return exitcode(info.wait_status) if info.state == _core.PROC_EXITED else None

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
            code = exitcode(info.wait_status)
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
            # Every rank's streams are prepared before the first fork: a teed
            # pipe's worker end, a redirect's log.
            for paths in (self.stdouts, self.stderrs):
                needed += sum(1 for rank in range(self.nprocs) if paths.get(rank))
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

    def _launch_for(self, name: str, entrypoint: Any, args: dict[int, tuple[Any, ...]],
                    envs: dict[int, dict[str, str]]) -> Launch:
        if not callable(entrypoint):
            raise TypeError(f"MultiprocessContext needs a callable entrypoint, got {type(entrypoint).__name__}")
        if self.start_method == "spawn":
            return SpawnLaunch(name, entrypoint, args, envs)
        if self.start_method == "fork":
            return ForkLaunch(name, entrypoint, args, envs)
        from torchmp._launch.forkserver import ForkserverLaunch

        return ForkserverLaunch(name, entrypoint, args, envs)

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
                if is_interrupt(e):  # a signal's, not the value's (its __setstate__ is Python)
                    raise
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

    def _clean_exit_problems(self, ranks: list[int]) -> dict[int, str]:
        # A worker sends its pickled return value (None included) before it
        # exits; exit code 0 with nothing sent means the function never
        # returned: os._exit(0) somewhere in it.  (torch 2.13 waits forever
        # for such a rank's value.)
        return {rank: "exited with code 0 without returning a value (os._exit() before the function returned?)"
                for rank in ranks if not self._return_blobs.get(rank) and rank not in self._return_values_cache}
