"""The launcher's signals: one owner for which signals stop a launch
(``TORCHELASTIC_SIGNALS_TO_HANDLE``), the handler that turns them into
:class:`SignalException`, and closing a context whatever signal lands
meanwhile.  Used by the contexts, ``torchmp run`` and the torchrun plug-in."""

from __future__ import annotations

import logging
import os
import signal
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchmp._pcontext import PContext

logger = logging.getLogger("torchmp.api")

#: The signals a launcher turns into SignalException (and ``torchmp run``
#: into "terminate the workers, exit 128 + N") unless
#: TORCHELASTIC_SIGNALS_TO_HANDLE names others: torchelastic's default.
DEFAULT_HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
_DEFAULT_HANDLED_NAMES = ",".join(s.name for s in DEFAULT_HANDLED_SIGNALS)

# Signals Windows cannot handle (torch logs them at INFO there).
_WINDOWS_UNSUPPORTED = ("SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")


class SignalException(Exception):
    """Raised in the launcher when it receives one of the handled signals
    (``TORCHELASTIC_SIGNALS_TO_HANDLE``, default SIGTERM, SIGINT, SIGHUP,
    SIGQUIT).  Catch it, ``close(e.sigval)`` the context, and exit."""

    def __init__(self, msg: str, sigval: signal.Signals) -> None:
        super().__init__(msg)
        self.sigval = sigval


def _terminate_process_handler(signum: int, frame: FrameType | None) -> None:
    """The handler of every handled signal: raise SignalException."""
    sigval = signal.Signals(signum)
    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)


def close_despite_interrupts(ctx: PContext, death_sig: signal.Signals, timeout: float) -> None:
    """``ctx.close(death_sig, timeout)``, finished whatever lands meanwhile.

    A signal turned into an exception (or Ctrl-C) during the grace period
    would otherwise unwind out of ``close`` and leave the workers running.
    Instead it cuts the grace short: SIGKILL at once, as ``torchmp run`` does
    on a second signal.  Each retry is started by one more signal, so this
    ends."""
    while True:
        try:
            ctx.close(death_sig, timeout)
            return
        except (SignalException, KeyboardInterrupt):
            death_sig, timeout = signal.SIGKILL, 0


def _interrupt_signal(exc: BaseException) -> signal.Signals:
    """The signal behind an exception that stopped a launch (SIGTERM if none)."""
    if isinstance(exc, SignalException):
        return exc.sigval
    if isinstance(exc, KeyboardInterrupt):
        return signal.SIGINT
    return signal.SIGTERM


def handled_signals(log_unknown: bool = True) -> list[signal.Signals]:
    """The signals named in TORCHELASTIC_SIGNALS_TO_HANDLE (default SIGTERM,
    SIGINT, SIGHUP, SIGQUIT); unknown names are skipped (and logged, unless
    the caller knows they were logged already)."""
    names = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", _DEFAULT_HANDLED_NAMES)
    found = []
    for name in names.split(","):
        name = name.strip()
        if not name:
            continue
        sig = getattr(signal, name, None)
        if not isinstance(sig, signal.Signals):
            if log_unknown:
                logger.warning("Failed to register signal handler for %s: no such signal", name)
            continue
        found.append(sig)
    return found


# torch's names, looked up through this module at call time (torch's tests
# replace them to watch what start() does).


def install_handlers(signal_module: Any, threading_module: Any, log: logging.Logger | Any,
                     is_windows: bool) -> None:
    """Turn TORCHELASTIC_SIGNALS_TO_HANDLE into SignalException, with torch's
    log lines; only the main thread can install handlers.  The modules and
    the logger are parameters: torch's tests replace api.signal, api.threading
    and api.logger, and PContext.start passes those (see api)."""
    if threading_module.current_thread() is not threading_module.main_thread():
        log.warning(
            "Failed to register signal handlers since torchelastic is running on a child thread. "
            "This could lead to orphaned worker processes if the torchrun is terminated."
        )
        return
    names = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", _DEFAULT_HANDLED_NAMES)
    for sig_name in names.split(","):
        sig_name = sig_name.strip()
        if not sig_name:
            continue
        try:
            signal_module.signal(getattr(signal_module, sig_name), _terminate_process_handler)
            log.info("Registered signal handler for %s", sig_name)
        except (AttributeError, ValueError, OSError) as e:
            log.warning("Failed to register signal handler for %s: %s", sig_name, e)
        except RuntimeError as e:
            if is_windows and sig_name in _WINDOWS_UNSUPPORTED:
                log.info("Signal %s is not supported on Windows, skipping", sig_name)
            else:
                log.warning("Failed to register signal handler for %s: %s", sig_name, e)
