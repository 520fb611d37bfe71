"""``torchmp run``'s exit status (as ``srun``'s) and how the summary names an
exit: the code, or the signal that killed the rank."""
from __future__ import annotations

import signal

from torchmp._signals import SignalException
from torchmp.errors import ProcessFailure

__all__ = ["TIME_LIMIT_EXIT", "exit_code_for", "exit_code_for_signal", "signal_number", "exit_text"]

#: ``--time-limit`` reached: ``timeout(1)``'s and mpirun's status.
TIME_LIMIT_EXIT = 124


def exit_code_for(failure: ProcessFailure) -> int:
    """srun's rule: the exit code, or 128 + N for a death by signal N."""
    if failure.exitcode < 0:
        return 128 + (-failure.exitcode)
    return failure.exitcode


def signal_number(e: SignalException) -> int:
    """The signal that stopped the launcher: a StopSignal's own (its
    ``sigval`` is SIGTERM, what the workers are stopped with), otherwise the
    handled signal's."""
    return getattr(e, "signum", int(e.sigval))


def exit_code_for_signal(e: SignalException) -> int:
    """128 + N for the launcher stopped by signal N, as a shell reports it."""
    return 128 + signal_number(e)


def exit_text(code: int) -> str:
    """``7``, or ``SIGKILL`` for a death by signal 9 (``signal 77`` unnamed)."""
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return str(code)
