"""``torchrun`` with its workers started, watched and reaped by torchmp.

::

    torchmp torchrun --nnodes 2 --nproc-per-node 8 \\
        --rdzv-backend c10d --rdzv-endpoint node0:29400 train.py
    python -m torchmp.torchrun ...        # the same

takes exactly ``torchrun``'s arguments and runs ``torch.distributed.run``:
torch's rendezvous, elastic agent, restarts, error reporting and exit codes.
The one thing that changes is the agent's ``start_processes``: it is
torchmp's (one native I/O thread for tee and reaping, process groups and
``PDEATHSIG`` for every worker, event-driven exits).  Everything the agent
gets back is torch's own type (``ProcessFailure``, ``RunProcsResult``,
``SignalException``), so its ``except`` clauses and its
``ChildFailedError`` report behave as with plain ``torchrun``.

PyTorch is imported only here, when this command runs; without it the
command says so and exits with status 2.

Programmatic use (``elastic_launch`` or a custom agent)::

    from torchmp.torchrun import patched

    with patched():
        elastic_launch(config, entrypoint)(*args)

``--numa-binding`` (``numa_options``) binds each worker to the same CPUs
torch would choose, set in the child before exec with
``sched_setaffinity``, so ``numactl`` is not needed (see
:mod:`torchmp.numa`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any

import torchmp
from torchmp import api as _tm_api
from torchmp._shutdown import SHUTDOWN_GRACE_SECONDS
from torchmp._signals import count_as_interrupt, install_handlers
from torchmp.errors import last_words, root_cause_order

__all__ = ["main", "patched", "start_processes", "TorchNotAvailable"]

logger = logging.getLogger(__name__)

class TorchNotAvailable(ImportError):
    """PyTorch (``torch.distributed``) cannot be imported."""


class _Torch:
    """The pieces of torch the plug-in talks to, imported on first use."""

    def __init__(self) -> None:
        try:
            import torch.distributed.run as run
            from torch.distributed.elastic.agent.server import local_elastic_agent
            from torch.distributed.elastic.multiprocessing import api as mp_api
            from torch.distributed.elastic.multiprocessing import errors as mp_errors
        except ImportError as e:
            raise TorchNotAvailable(str(e)) from e
        self.run: Any = run
        self.agent: Any = local_elastic_agent
        self.api: Any = mp_api
        self.ProcessFailure: Any = mp_errors.ProcessFailure
        self.SignalException: Any = mp_api.SignalException
        self.RunProcsResult: Any = mp_api.RunProcsResult
        # Let isinstance(ctx, torch's PContext) hold for the adapter.
        mp_api.PContext.register(TorchrunContext)


_torch: _Torch | None = None


def _load_torch() -> _Torch:
    global _torch
    if _torch is None:
        _torch = _Torch()
    return _torch


# ---------------------------------------------------------------------------
# Conversions to torch's classes


def _torch_signal_exception(e: _tm_api.SignalException) -> BaseException:
    t = _load_torch()
    exc: BaseException = t.SignalException(str(e), sigval=e.sigval)
    return exc


def _raise_torch_signal(signum: int, frame: FrameType | None) -> None:
    sigval = signal.Signals(signum)
    raise _load_torch().SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)


def _install_torch_signal_handlers() -> None:
    """Point the handled signals (``TORCHELASTIC_SIGNALS_TO_HANDLE``, set by
    torchrun) at a handler raising torch's ``SignalException``, which is what
    the agent catches to shut the workers down with that signal (quietly:
    torchmp logged any failure when it tried the same)."""
    count_as_interrupt(_load_torch().SignalException)
    install_handlers(handler=_raise_torch_signal)


def to_torch_failure(failure: torchmp.ProcessFailure) -> Any:
    """torch's ``ProcessFailure`` with the fields torchmp read.

    Built without torch's ``__post_init__``, which would read the error file
    again (and raise on a malformed one, inside the agent); torchmp has read
    it already, defensively.
    """
    cls = _load_torch().ProcessFailure
    out = cls.__new__(cls)
    out.local_rank = failure.local_rank
    out.pid = failure.pid
    out.exitcode = failure.exitcode
    out.error_file = failure.error_file
    data = failure.error_file_data
    out.error_file_data = dict(data) if isinstance(data, dict) else data
    out.message = failure.message
    out.timestamp = failure.timestamp
    detail = last_words(failure)
    if detail is not None and isinstance(failure.message, str):
        # torch's report shows a dict message's py_callstack, indented, as the
        # traceback: the rank's last words reach the report torch prints.
        out.message = {"message": failure.message,
                       "extraInfo": {"py_callstack": detail, "timestamp": str(failure.timestamp)}}
    return out


def to_torch_result(result: torchmp.RunProcsResult) -> Any:
    """torch's ``RunProcsResult``; failures root cause first.

    torch picks the root cause as the failure with the smallest whole-second
    ``timestamp``, ties going to the first in the dict; ordering the dict by
    torchmp's finer rule (never a rank torchmp killed, then nanoseconds)
    makes torch's report name the same root cause as torchmp's.
    """
    t = _load_torch()
    ordered = sorted(
        result.failures.items(),
        key=lambda kv: root_cause_order(kv[1]),
    )
    out = t.RunProcsResult(
        return_values=dict(result.return_values),
        failures={rank: to_torch_failure(f) for rank, f in ordered},
        stdouts=dict(result.stdouts),
        stderrs=dict(result.stderrs),
    )
    out.resources = dict(getattr(result, "resources", {}))  # torchmp's extra, kept
    return out


class TorchrunContext:
    """A started torchmp ``PContext`` that answers in torch's classes.

    ``wait`` returns torch's ``RunProcsResult`` holding torch's
    ``ProcessFailure`` objects; a torchmp ``SignalException`` raised while
    waiting or closing comes out as torch's.  Everything else is delegated.
    """

    def __init__(self, inner: _tm_api.PContext) -> None:
        self._inner = inner
        self._result: Any = None

    @property
    def inner(self) -> _tm_api.PContext:
        return self._inner

    def start(self) -> None:  # started by start_processes, as torch's contexts are
        raise ValueError("The workers are already started.")

    def pids(self) -> dict[int, int]:
        return self._inner.pids()

    def wait(self, timeout: float = -1, period: float = 1) -> Any:
        if self._result is not None:
            return self._result
        try:
            result = self._inner.wait(timeout, period)
        except _tm_api.SignalException as e:
            raise _torch_signal_exception(e) from None
        if result is not None:
            self._result = to_torch_result(result)
        return self._result

    def close(self, death_sig: signal.Signals | None = None, timeout: float = SHUTDOWN_GRACE_SECONDS) -> None:
        try:
            self._inner.close(death_sig, timeout)
        except _tm_api.SignalException as e:
            raise _torch_signal_exception(e) from None

    def __enter__(self) -> TorchrunContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        # name, entrypoint, args, envs, stdouts, stderrs, error_files, nprocs, ...
        return getattr(self._inner, name)


# ---------------------------------------------------------------------------
# The agent's start_processes


def start_processes(
    name: str,
    entrypoint: Callable[..., Any] | str,
    args: dict[int, tuple[Any, ...]],
    envs: dict[int, dict[str, str]],
    logs_specs: Any,
    log_line_prefixes: dict[int, str] | None = None,
    start_method: str = "spawn",
    numa_options: Any = None,
    duplicate_stdout_filters: list[str] | None = None,
    duplicate_stderr_filters: list[str] | None = None,
) -> Any:
    """torch 2.x's ``start_processes`` signature, done by torchmp.

    Returns a :class:`TorchrunContext` (torch's classes out).
    ``numa_options`` (``--numa-binding``) binds each worker as torch would,
    in the child before exec, without ``numactl``.
    """
    _load_torch()
    try:
        inner = torchmp.start_processes(
            name=name, entrypoint=entrypoint, args=args, envs=envs, logs_specs=logs_specs,
            log_line_prefixes=log_line_prefixes, start_method=start_method,
            numa_options=numa_options, duplicate_stdout_filters=duplicate_stdout_filters,
            duplicate_stderr_filters=duplicate_stderr_filters,
        )
        _install_torch_signal_handlers()
    except _tm_api.SignalException as e:
        # start_processes has already closed what it started.
        raise _torch_signal_exception(e) from None
    return TorchrunContext(inner)


@contextlib.contextmanager
def patched() -> Iterator[None]:
    """Make torch's ``LocalElasticAgent`` start its workers with torchmp
    for the duration of the block (raises :class:`TorchNotAvailable`)."""
    t = _load_torch()
    saved = t.agent.start_processes
    t.agent.start_processes = start_processes
    try:
        yield
    finally:
        t.agent.start_processes = saved


@contextlib.contextmanager
def _torch_logging() -> Iterator[None]:
    """Log torchmp's messages (e.g. "Sending process ... closing signal") through
    torch.distributed's handlers and level, so they read as torchrun's do."""
    log = logging.getLogger("torchmp")
    if log.handlers:
        yield  # the application configured torchmp's logging itself
        return
    source = logging.getLogger("torch.distributed")
    handlers = source.handlers or logging.getLogger("torch").handlers
    saved = (log.level, log.propagate)
    for h in handlers:
        log.addHandler(h)
    if handlers:
        log.setLevel(source.getEffectiveLevel())
        log.propagate = False
    try:
        yield
    finally:
        for h in handlers:
            log.removeHandler(h)
        log.level, log.propagate = saved


@contextlib.contextmanager
def _argv0(prog: str) -> Iterator[None]:
    # torchrun's parser takes its name from sys.argv[0].
    saved = sys.argv[0] if sys.argv else None
    if sys.argv:
        sys.argv[0] = prog
    else:
        sys.argv.append(prog)
    try:
        yield
    finally:
        if saved is None:
            sys.argv.pop(0)
        else:
            sys.argv[0] = saved


def main(argv: Sequence[str] | None = None, prog: str = "python -m torchmp.torchrun") -> int:
    """Run ``torchrun`` with ``argv`` (default ``sys.argv[1:]``).

    Returns 0 on success.  As with ``torchrun``, a failed job raises torch's
    ``ChildFailedError`` and a signal raises its ``SignalException`` (the
    interpreter prints them and exits with status 1); a missing PyTorch is
    reported on stderr and returns 2.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        _load_torch()
    except TorchNotAvailable as e:
        sys.stderr.write(
            f"{prog}: error: PyTorch is not installed or torch.distributed cannot be "
            f"imported ({e}).\n"
            f"{prog} runs torch's own torchrun and needs it: pip install torch. "
            "'torchmp run' works without it.\n"
        )
        return 2
    with _argv0(prog), _torch_logging(), patched():
        _load_torch().run.main(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
