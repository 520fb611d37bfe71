"""The base of every context (torch's ``PContext``) and what a run returns."""

from __future__ import annotations

import abc
import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from torchmp import _escapees
from torchmp._shutdown import SHUTDOWN_GRACE_SECONDS
from torchmp.errors import ProcessFailure
from torchmp.logs_specs import LogsSpecs, validate_full_rank


def exitcode(wait_status: int) -> int:
    """A raw wait status as ``subprocess`` reports it: the exit code, or
    minus the signal that killed the process."""
    if os.WIFSIGNALED(wait_status):
        return -os.WTERMSIG(wait_status)
    if os.WIFEXITED(wait_status):
        return os.WEXITSTATUS(wait_status)
    return 255


@dataclass(frozen=True)
class ResourceUsage:
    """What one rank cost, measured by the launcher when it reaped the rank.

    ``wall_time``, ``user_time`` and ``system_time`` are seconds; ``max_rss``
    is bytes (the peak resident set of the worker or of its largest waited-for
    descendant, as ``getrusage`` reports it).
    """

    pid: int
    exitcode: int
    wall_time: float
    user_time: float
    system_time: float
    max_rss: int


@dataclass
class RunProcsResult:
    """Results of a completed run, all mapped by local rank.

    ``return_values`` holds function return values (``None`` for each rank of
    a binary launch that succeeded), ``failures`` the failed ranks,
    ``stdouts``/``stderrs`` the log file paths (empty string: not redirected)
    and, beyond torch, ``resources`` each reaped rank's :class:`ResourceUsage`.
    """

    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, ProcessFailure] = field(default_factory=dict)
    stdouts: dict[int, str] = field(default_factory=dict)
    stderrs: dict[int, str] = field(default_factory=dict)
    resources: dict[int, ResourceUsage] = field(default_factory=dict)

    def is_failed(self) -> bool:
        return len(self.failures) > 0


_Made = TypeVar("_Made")


def made_without_init(cls: type[_Made], **fields: Any) -> _Made:
    """``cls(**fields)`` for a dataclass, made without running its
    ``__init__`` (for a frozen one, a Python call per field).  wait()'s
    results and usages are made this way between the deciding exit and
    ``wait()``'s return, where each call runs cold (docs/profiles.md, "The
    finish in fewer calls").  The instance is the same as the class makes
    (fields, equality, hash, repr, pickle) when ``fields`` are all of the
    class's, by name, and none has a ``__post_init__`` to run."""
    made = object.__new__(cls)
    made.__dict__.update(fields)
    return made


class TeeTail:
    """One teed stream of one rank, in the place of torch's ``TailLog``
    threads (``PContext._tail_logs``): torchmp's I/O thread does the
    teeing, so there is nothing to start or stop; ``stopped()`` says whether
    the stream has been drained to its end and closed."""

    def __init__(self, context: PContext, rank: int, which: int) -> None:
        self.context = context
        self.rank = rank
        self.which = which  # 0 stdout, 1 stderr
        self._started = False

    def start(self) -> TeeTail:
        self._started = True
        return self

    def stop(self) -> None:
        """Nothing to stop: the stream ends with the worker (close() drains it)."""

    def stopped(self) -> bool:
        return self._started and self.context._stream_done(self.rank, self.which)

    def __repr__(self) -> str:
        what = ("stdout", "stderr")[self.which]
        return f"<TeeTail {self.context.name} rank {self.rank} {what} stopped={self.stopped()}>"


class PContext(abc.ABC):
    """Base class of a set of launched workers (torch's ``PContext``).

    Subclasses implement ``_start``, ``_poll``, ``pids`` and ``_close``.  The
    base ``wait`` polls ``_poll`` every ``period`` seconds, exactly as torch
    does, so user subclasses and mocks keep working; torchmp's own contexts
    override it with an event-driven wait.
    """

    def __init__(
        self,
        name: str,
        entrypoint: Callable[..., Any] | str,
        args: dict[int, tuple[Any, ...]],
        envs: dict[int, dict[str, str]],
        logs_specs: LogsSpecs,
        log_line_prefixes: dict[int, str] | None = None,
        duplicate_stdout_filters: list[str] | None = None,
        duplicate_stderr_filters: list[str] | None = None,
    ) -> None:
        self.name = name
        nprocs = len(args)
        logs_dest = logs_specs.reify(envs)
        validate_full_rank(logs_dest.stdouts, nprocs, "stdouts")
        validate_full_rank(logs_dest.stderrs, nprocs, "stderrs")
        self.entrypoint = entrypoint
        self.args = args
        self.envs = envs
        self.stdouts = logs_dest.stdouts
        self.stderrs = logs_dest.stderrs
        self.error_files = logs_dest.error_files
        self.nprocs = nprocs
        self.log_line_prefixes = log_line_prefixes
        self.duplicate_stdout_filters = duplicate_stdout_filters
        self.duplicate_stderr_filters = duplicate_stderr_filters
        self._logs_dest = logs_dest
        # torch's tailers, one per teed stream of each rank (see TeeTail).
        self._tail_logs: list[TeeTail] = [
            TeeTail(self, rank, which)
            for which, tees in enumerate((logs_dest.tee_stdouts, logs_dest.tee_stderrs))
            for rank in sorted(tees)
        ]

    #: torchmp extension (``start_processes(..., subreaper=True)``): the id
    #: its ranks carry in ``TORCHMP_CONTEXT_ID``, and how many processes that
    #: had left their rank's process group ``close()`` stopped.
    subreaper_id: str | None = None
    escaped: int = 0

    def start(self) -> None:
        """Start the workers; on the main thread, first install the handlers
        that turn the termination signals into :class:`SignalException`."""
        # A spawn/forkserver worker re-importing a main module that has no
        # __main__ guard must not start a nested job (nor install handlers).
        from torchmp._launch.worker import refuse_nested_launch

        refuse_nested_launch()
        # Through the api module, whose names torch's tests replace
        # (api.signal, api.threading, api.logger): looked up at call time.
        # This function-level import is the one edge allowed to close a cycle
        # in the import graph (api -> _native -> _pcontext -> api); see
        # tests/test_import_graph.py, which pins both.
        from torchmp import api

        api._install_signal_handlers()
        self._start()
        for tail in self._tail_logs:
            tail.start()

    def _stream_done(self, rank: int, which: int) -> bool:
        """Whether the teed stream ``which`` (0 stdout, 1 stderr) of ``rank``
        has reached its end and every byte of it was written out.  Contexts
        that tee override this; the base has nothing teed to wait for."""
        return True

    @abc.abstractmethod
    def _start(self) -> None:
        raise NotImplementedError

    @abc.abstractmethod
    def _poll(self) -> RunProcsResult | None:
        """All-or-nothing: a result once every rank succeeded or any failed."""
        raise NotImplementedError

    def wait(self, timeout: float = -1, period: float = 1) -> RunProcsResult | None:
        """Wait up to ``timeout`` seconds (negative: forever, 0: just poll)
        for a result; ``None`` if the workers are still running."""
        if timeout == 0:
            return self._poll()
        deadline = None if timeout < 0 else time.monotonic() + timeout
        while True:
            result = self._poll()
            if result is not None:
                return result
            if deadline is not None and time.monotonic() >= deadline:
                return None
            nap = period if deadline is None else min(period, max(0.0, deadline - time.monotonic()))
            time.sleep(nap)

    async def wait_async(self, timeout: float | None = None, period: float = 1) -> RunProcsResult | None:
        """``wait`` on an event loop: ``None`` after ``timeout`` seconds (None
        or negative: no limit).  torchmp's own contexts are woken by their
        workers' exits; this base (for subclasses of the user's) looks every
        ``period`` seconds, as ``wait`` does."""
        import asyncio

        deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
        while True:
            result = self._poll()
            if result is not None:
                return result
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return None
            await asyncio.sleep(period if remaining is None else min(period, remaining))

    @abc.abstractmethod
    def pids(self) -> dict[int, int]:
        raise NotImplementedError

    @abc.abstractmethod
    def _close(self, death_sig: signal.Signals, timeout: float = SHUTDOWN_GRACE_SECONDS) -> None:
        raise NotImplementedError

    def send_signal(self, sig: int, ranks: Iterable[int] | None = None) -> list[int]:
        """Send ``sig`` to the process group of each of ``ranks`` (local
        ranks; default: every rank still running) and return the ranks whose
        groups got it, stopping nothing itself (a torchmp extension).

        As in :meth:`close`, a group is signalled only while its id cannot
        belong to anybody else: its leader is running, or has exited and its
        zombie is not reaped yet (torchmp reaps in ``close()``, after the
        last signal: from then on no rank is signalled).  ``ValueError`` for a rank that is not one of this
        context's, or an unknown signal, before anything is sent (0 sends
        nothing: which groups are still there)."""
        if isinstance(sig, bool) or not isinstance(sig, int) or (sig and sig not in signal.valid_signals()):
            raise ValueError(f"unknown signal {sig!r}")
        chosen = None
        if ranks is not None:
            given = list(ranks)
            unknown = [r for r in given if isinstance(r, bool) or not isinstance(r, int)
                       or not 0 <= r < self.nprocs]
            if unknown:
                raise ValueError(f"unknown local rank(s) {unknown} (this context has ranks "
                                 f"0..{self.nprocs - 1})")
            chosen = sorted(set(given))
        return self._send_signal(int(sig), chosen)

    def _unreaped_pids(self) -> list[int]:
        """After close(): the ranks' pids that are still this process's
        children (not reaped).  Every other rank's pid is free, and may be
        anybody's by now -- an escapee's too."""
        return list(self.pids().values())

    def _send_signal(self, sig: int, ranks: list[int] | None) -> list[int]:
        raise NotImplementedError(f"{type(self).__name__} cannot send signals to its ranks")

    def close(self, death_sig: signal.Signals | None = None, timeout: float = SHUTDOWN_GRACE_SECONDS) -> None:
        """Terminate every worker: ``death_sig`` (default SIGTERM) to each
        worker's process group, SIGKILL to what is left after ``timeout``
        seconds.  Idempotent."""
        if not death_sig:
            death_sig = signal.SIGTERM
        self._close(death_sig=death_sig, timeout=timeout)
        if self.subreaper_id is not None:
            # The ranks are gone: now what left their groups (subreaper=True).
            self.escaped += _escapees.stop(self._unreaped_pids(), self.pids().values(), timeout,
                                           marker=self.subreaper_id)

    def __enter__(self) -> PContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
