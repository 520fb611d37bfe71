"""The launcher's signals: one owner for which signals stop a launch
(``TORCHELASTIC_SIGNALS_TO_HANDLE``; for ``torchmp run`` every other fatal
one too), which ones ``torchmp run`` forwards or takes as the hang report's
request, the handler that turns them into :class:`SignalException`, and
closing a context whatever signal lands meanwhile.  Used by the contexts,
``torchmp run`` and the torchrun plug-in."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

from torchmp import _core
from torchmp._inputs import getenv

# The C function under signal.signal (CPython's _signal; no stubs), and the
# stdlib's wrapper it stands in for.
from _signal import signal as _c_signal  # type: ignore[import-not-found]

_STDLIB_SIGNAL = signal.signal

if TYPE_CHECKING:
    from torchmp._pcontext import PContext

logger = logging.getLogger("torchmp.api")

#: The signals a launcher turns into SignalException (and ``torchmp run``
#: into "terminate the workers, exit 128 + N") unless
#: TORCHELASTIC_SIGNALS_TO_HANDLE names others: torchelastic's default.
DEFAULT_HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
_DEFAULT_HANDLED_NAMES = ",".join(s.name for s in DEFAULT_HANDLED_SIGNALS)

#: Signals whose default action does not end a process (or that cannot be
#: caught): every other signal, left alone, would kill a launcher.
_NOT_FATAL = frozenset(getattr(signal, name) for name in (
    "SIGCHLD", "SIGCONT", "SIGSTOP", "SIGTSTP", "SIGTTIN", "SIGTTOU", "SIGURG", "SIGWINCH", "SIGKILL")
    if hasattr(signal, name))

#: Fatal signals a launcher leaves alone: a debugger's breakpoints and
#: seccomp's verdicts are not requests, and returning from a handler would
#: swallow them.
_NOT_REQUESTS = frozenset(getattr(signal, name) for name in ("SIGTRAP", "SIGSYS") if hasattr(signal, name))

#: Fault signals: a handler that returns from a real one runs the faulting
#: instruction again, so only the ones another process sent are caught
#: (torchmp._core.route_sent_faults).
FAULT_SIGNALS = tuple(getattr(signal, name) for name in ("SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL")
                      if hasattr(signal, name))

#: The signals ``torchmp run`` passes on to its ranks unless told otherwise
#: (``--forward-signals``, or this variable): what Slurm's ``--signal`` and
#: the requeue logic of Lightning and submitit send before a time limit.
FORWARD_SIGNALS_VAR = "TORCHMP_FORWARD_SIGNALS"
DEFAULT_FORWARD_SIGNALS = (signal.SIGUSR1,)

#: The signal that asks ``torchmp run`` for a hang report, unless told
#: otherwise (``--hang-report-signal``, or this variable).
REPORT_SIGNAL_VAR = "TORCHMP_HANG_REPORT_SIGNAL"
DEFAULT_REPORT_SIGNAL = signal.SIGUSR2


def fatal_signals() -> list[int]:
    """Every signal this process can catch whose default action ends it
    (the real-time signals included), in number order."""
    return sorted(s for s in signal.valid_signals() if s not in _NOT_FATAL)


def signal_name(sig: int) -> str:
    """``SIGUSR1``; ``SIGRTMIN+3`` for a real-time signal Python has no name for."""
    try:
        return signal.Signals(sig).name
    except ValueError:
        rtmin = getattr(signal, "SIGRTMIN", None)
        if rtmin is not None and sig > rtmin:
            return f"SIGRTMIN+{sig - rtmin}"
        return f"signal {sig}"


def parse_signal(text: str) -> int:
    """A signal from ``USR1``, ``SIGUSR1``, ``usr1``, ``10`` or
    ``RTMIN+3``; ValueError (saying why) for anything else, and for
    SIGKILL and SIGSTOP, which cannot be caught."""
    word = text.strip().upper()
    name = word if word.startswith("SIG") else "SIG" + word
    sig: int | None = None
    if word.isdigit():
        sig = int(word)
    else:
        base, plus, offset = name.partition("+")
        minus = ""
        if not plus:
            base, minus, offset = name.partition("-")
        known = getattr(signal, base, None)
        if isinstance(known, signal.Signals) and (plus or minus) and offset.isdigit() \
                and base in ("SIGRTMIN", "SIGRTMAX"):
            sig = int(known) + (int(offset) if plus else -int(offset))
        elif isinstance(known, signal.Signals) and not (plus or minus):
            sig = int(known)
    if sig is None or sig not in signal.valid_signals():
        raise ValueError(f"unknown signal {text!r}")
    if sig in (signal.SIGKILL, signal.SIGSTOP):
        raise ValueError(f"{signal_name(sig)} cannot be caught")
    return sig


def parse_optional_signal(text: str) -> int | None:
    """:func:`parse_signal`, or None for ``none`` / empty."""
    return None if text.strip().lower() in ("", "none") else parse_signal(text)


def check_launcher_signals(forward: Sequence[int], report: int | None) -> list[int]:
    """The signals ``torchmp run`` passes on to its ranks, checked against
    the ones that stop it: ValueError if one is forwarded and also stops
    the job (SIGTERM, SIGINT, SIGHUP, SIGQUIT) or asks for the hang report,
    or if the report signal stops the job.  A signal
    TORCHELASTIC_SIGNALS_TO_HANDLE names stops the job, as in torchelastic,
    so it is left out of the answer (the report signal gives way the same
    way: see ``torchmp.cli.job``)."""
    for sig in forward:
        if sig in DEFAULT_HANDLED_SIGNALS:
            raise ValueError(f"{signal_name(sig)} stops the job (it is passed on to the ranks, "
                             "then SIGKILL after --shutdown-timeout); it cannot be forwarded")
        if sig == report:
            raise ValueError(f"{signal_name(sig)} asks for the hang report; to forward it, choose "
                             "another --hang-report-signal (or none)")
    if report in DEFAULT_HANDLED_SIGNALS:
        raise ValueError(f"{signal_name(report)} stops the job; it cannot ask for the hang report")
    handled = handled_signals(log_unknown=False)
    return [sig for sig in forward if sig not in handled]


def stop_signals(forward: Sequence[int], report: int | None) -> list[int]:
    """Every signal that would kill this process by its default action and
    that it neither forwards nor takes as the report request, nor ignores
    already (Python ignores SIGPIPE and SIGXFSZ): ``torchmp run`` catches
    them all and stops the ranks the normal way.  SIGTRAP and SIGSYS are
    left alone (not requests), and so are SIGKILL and SIGSTOP (cannot be)."""
    keep = set(forward) | {report} | _NOT_REQUESTS
    return [sig for sig in fatal_signals()
            if sig not in keep and (sig in DEFAULT_HANDLED_SIGNALS or signal.getsignal(sig) != signal.SIG_IGN)]


def parse_signal_list(text: str) -> list[int]:
    """``USR1,USR2`` (or ``none`` / empty: no signal) -> signals, each once."""
    if text.strip().lower() in ("", "none"):
        return []
    found: list[int] = []
    for item in text.split(","):
        sig = parse_signal(item)
        if sig not in found:
            found.append(sig)
    return found


# Signals Windows cannot handle (torch logs them at INFO there).
_WINDOWS_UNSUPPORTED = ("SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")


class SignalException(Exception):
    """Raised in the launcher when it receives one of the handled signals
    (``TORCHELASTIC_SIGNALS_TO_HANDLE``, default SIGTERM, SIGINT, SIGHUP,
    SIGQUIT).  Catch it, ``close(e.sigval)`` the context, and exit."""

    def __init__(self, msg: str, sigval: signal.Signals) -> None:
        super().__init__(msg)
        self.sigval = sigval


# What a handled signal raises wherever the main thread happens to be:
# SignalException, Ctrl-C's KeyboardInterrupt, and the class of another
# handler given to install_handlers (the torchrun plug-in's raises torch's
# SignalException).  A catch-all around a console's write or flush must let
# these through: swallowed there, the launch would carry on as if no signal
# had come.
_interrupts: tuple[type[BaseException], ...] = (SignalException, KeyboardInterrupt)


def is_interrupt(exc: BaseException) -> bool:
    """Whether ``exc`` is a handled signal's exception, which no catch-all
    may swallow."""
    return isinstance(exc, _interrupts)


def count_as_interrupt(cls: type[BaseException]) -> None:
    """Make :func:`is_interrupt` true for ``cls`` too (a handler of the
    caller's raises it)."""
    global _interrupts
    if not issubclass(cls, _interrupts):
        _interrupts += (cls,)


def terminate_process_handler(signum: int, frame: FrameType | None) -> None:
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


def finish_despite_interrupts(step: Callable[[], Any]) -> BaseException | None:
    """``step()``, started again each time a handled signal's exception (or
    Ctrl-C) cuts it short: a cleanup that must be finished (the escapee
    sweep as ``torchmp run`` exits).  Returns the first such exception, for
    the caller to raise once the cleanup is done (None if none came).  Each
    retry is started by one more signal, so this ends."""
    first: BaseException | None = None
    while True:
        try:
            step()
            return first
        except BaseException as e:
            if not is_interrupt(e):
                raise
            first = first or e


def interrupt_signal(exc: BaseException) -> signal.Signals:
    """The signal behind an exception that stopped a launch (SIGTERM if none)."""
    if isinstance(exc, SignalException):
        return exc.sigval
    if isinstance(exc, KeyboardInterrupt):
        return signal.SIGINT
    return signal.SIGTERM


def _handled_signal_names() -> list[str]:
    """The names TORCHELASTIC_SIGNALS_TO_HANDLE lists (default torchelastic's
    four): the variable's one parser, behind handled_signals and
    install_handlers."""
    names = getenv("TORCHELASTIC_SIGNALS_TO_HANDLE")
    if names is None:
        names = _DEFAULT_HANDLED_NAMES
    return [name.strip() for name in names.split(",") if name.strip()]


def handled_signals(log_unknown: bool = True) -> list[signal.Signals]:
    """The signals that stop a launch: those named in
    TORCHELASTIC_SIGNALS_TO_HANDLE (default SIGTERM, SIGINT, SIGHUP,
    SIGQUIT); unknown names are skipped (and logged, unless the caller knows
    they were logged already).  Every launcher asks this function."""
    found = []
    for name in _handled_signal_names():
        sig = getattr(signal, name, None)
        if not isinstance(sig, signal.Signals):
            if log_unknown:
                logger.warning("Failed to register signal handler for %s: no such signal", name)
            continue
        found.append(sig)
    return found


# torch's names, looked up through this module at call time (torch's tests
# replace them to watch what start() does).


def install_handlers(signal_module: Any = signal, threading_module: Any = threading,
                     log: logging.Logger | Any = None, is_windows: bool = False,
                     handler: Callable[[int, FrameType | None], Any] = terminate_process_handler) -> None:
    """Point the handled signals (:func:`handled_signals`'s names) at
    ``handler`` (by default one raising SignalException), with torch's log
    lines (none if ``log`` is None); only the main thread can install
    handlers.  The modules and the logger are parameters: torch's tests
    replace api.signal, api.threading and api.logger, and PContext.start
    passes those (see api); the torchrun plug-in passes a handler raising
    torch's own SignalException."""
    if threading_module.current_thread() is not threading_module.main_thread():
        if log is not None:
            log.warning(
                "Failed to register signal handlers since torchelastic is running on a child thread. "
                "This could lead to orphaned worker processes if the torchrun is terminated."
            )
        return
    # The stdlib's signal.signal converts its arguments and the previous
    # handler to enums (an exception per call for a function handler): on
    # every start() that was most of this function's cost.  The C function
    # underneath does the same installation; a replaced module or function
    # (torch's tests watch the calls) is called as it is.
    install = signal_module.signal
    if install is _STDLIB_SIGNAL:
        install = _c_signal
    # Asked once, not in each log.info: a disabled INFO (the default) then
    # costs nothing per signal.  A logger without the method (a stand-in a
    # test passes) gets every call.
    enabled = getattr(log, "isEnabledFor", None)
    log_info = log is not None and (enabled is None or enabled(logging.INFO))
    for sig_name in _handled_signal_names():
        try:
            sig = getattr(signal_module, sig_name)
            install(int(sig) if install is _c_signal else sig, handler)
            if log_info:
                log.info("Registered signal handler for %s", sig_name)
        except (AttributeError, ValueError, OSError) as e:
            if log is not None:
                log.warning("Failed to register signal handler for %s: %s", sig_name, e)
        except RuntimeError as e:
            if log is None:
                pass
            elif is_windows and sig_name in _WINDOWS_UNSUPPORTED:
                log.info("Signal %s is not supported on Windows, skipping", sig_name)
            else:
                log.warning("Failed to register signal handler for %s: %s", sig_name, e)


class StopSignal(SignalException):
    """A signal that stops ``torchmp run`` though it is none of the handled
    ones: the workers are terminated with SIGTERM, the exit status is
    128 + ``signum``."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"Process {os.getpid()} got signal: {signal_name(signum)}", sigval=signal.SIGTERM)
        self.signum = signum


def _stop_handler(signum: int, frame: FrameType | None) -> None:
    raise StopSignal(signum)


def install_launcher_handlers(forward: Sequence[int], report: int | None) -> list[int]:
    """``torchmp run``'s handlers: catch every signal that would kill it and
    that it neither forwards nor takes as the report request.  The handled
    signals (torchelastic's four, which ``torchmp run`` always passes on,
    and whatever :func:`handled_signals` names: start_processes installs
    those too) raise SignalException with the signal itself, any other one
    :class:`StopSignal` (the workers get SIGTERM).  Returns the signals to
    block while the workers start: all of these and the handled ones, bar
    the faults (a real fault cannot wait)."""
    handled = set(DEFAULT_HANDLED_SIGNALS) | set(handled_signals(log_unknown=False))
    # A report signal TORCHELASTIC_SIGNALS_TO_HANDLE names stops the job.
    caught = stop_signals(forward, None if report in handled else report)
    for sig in caught:
        handler = terminate_process_handler if sig in handled else _stop_handler
        if sig in FAULT_SIGNALS:
            _core.route_sent_faults(sig, handler)
        else:
            signal.signal(sig, handler)
    return sorted(sig for sig in set(caught) | handled if sig not in FAULT_SIGNALS)
