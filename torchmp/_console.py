"""Where teed lines are shown, and the console policy around it.

The I/O thread never blocks on a console (``csrc/console.c``) and never
loses a line a live console can still take (``csrc/loop_consoles.c``): what
a console cannot take now waits in a backlog bounded per stream, and a
stream with a log file that falls behind the bound is held back and caught
up from its log later.  This module owns the Python half:

* which console a teed stream goes to: the launcher's own fd 1 / fd 2 when
  ``sys.stdout`` / ``sys.stderr`` is that fd (a plain file object whose
  ``write`` nobody replaced), else the object itself (a notebook's stream,
  ``contextlib.redirect_stdout``, a captured run, a wrapped ``write``), fed by
  a forwarding thread (``_console_objects``) so the I/O thread never needs
  the GIL;
* the bound (``console_backlog=``, ``TORCHMP_CONSOLE_BACKLOG``,
  ``torchmp run --console-backlog``) and the stall time
  (``TORCHMP_CONSOLE_STALL``): a console that takes nothing for that long
  while lines wait for it has the lines it was not given yet left out, with a
  marker, and is not waited for at exit;
* torchmp's own words (logging, the failure report, the summary): through
  the same console, after the workers' lines logged before them, never
  blocking (``say``, ``ConsoleHandler``, the last-resort handler of the
  ``torchmp`` loggers);
* standard fds that were closed at start (occupied with /dev/null, so no log
  file can take fd 1 or 2 and be mistaken for a console; the console is off);
* a console switched off by a failure other than its reader leaving (a full
  file system): said once;
* letting a live console catch up before results are returned and before the
  launcher exits, without ever waiting on a stalled one for long.
"""

from __future__ import annotations

import atexit
import errno
import io
import logging
import os
import re
import sys
import time
import weakref
from typing import Any, TextIO

from . import _console_objects, _core
from ._inputs import getenv
from ._signals import is_interrupt
from ._console_objects import Forwarder, ObjectConsole

__all__ = ["Forwarder", "ObjectConsole"]

logger = logging.getLogger("torchmp.console")

DEFAULT_BACKLOG: int = _core.DEFAULT_CONSOLE_BACKLOG
BACKLOG_ENV = "TORCHMP_CONSOLE_BACKLOG"
# How long a console may take nothing while lines wait for it before it
# counts as stalled (then the lines it was not given yet are left out, and
# the launcher's exit does not wait for it any longer).  The exit wait's old
# name still works.
STALL_ENV = "TORCHMP_CONSOLE_STALL"
EXIT_STALL_ENV = "TORCHMP_CONSOLE_EXIT_WAIT"
DEFAULT_STALL = 10.0
# When wait() has its result: how long an fd console that stopped moving is
# waited for (a live one is followed until it caught up).
RESULT_STALL = 0.05

_SIZE = re.compile(r"^\s*(\d+)\s*([kmg]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(value: object, what: str = "console backlog") -> int:
    """Bytes from an int or a string like ``4M``, ``512KiB``, ``0``."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be a size in bytes, got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        m = _SIZE.match(value)
        if m is None:
            raise ValueError(f"{what} must be a size like 4M, 512K or 1048576, got {value!r}")
        size = int(m.group(1)) * _UNITS[m.group(2).lower()]
    else:
        raise TypeError(f"{what} must be a size in bytes, got {type(value).__name__}")
    if size < 0 or size > 1 << 40:
        raise ValueError(f"{what} must be between 0 and 1 TiB, got {size}")
    return size


def backlog_bound(explicit: object = None) -> int:
    """The bound in force: the explicit one, else the env var, else the default."""
    if explicit is not None:
        return parse_size(explicit)
    env = getenv(BACKLOG_ENV)
    if env:
        return parse_size(env, f"{BACKLOG_ENV}")
    return DEFAULT_BACKLOG


def stall_time() -> float:
    """Seconds without progress after which a console is stalled."""
    for name in (STALL_ENV, EXIT_STALL_ENV):
        value = getenv(name)
        if value:
            try:
                return max(0.0, float(value))
            except ValueError:
                break
    return DEFAULT_STALL


def apply_stall() -> None:
    """Hand the stall time in force to the native consoles (at each start)."""
    _core.set_console_stall(stall_time())


# Kept for callers of the old name.
exit_stall = stall_time


# -- standard fds closed at start ----------------------------------------------

_closed_std_fds: set[int] = set()
_claimed = False


def claim_std_fds() -> None:
    """Occupy a closed fd 0, 1 or 2 with /dev/null (once, before torchmp
    opens anything), so a log file never lands there and is never taken for
    the console.  A console that was closed stays off."""
    global _claimed
    if _claimed:
        return
    _claimed = True
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        null = os.open(os.devnull, os.O_RDWR)
        if null != fd:
            os.dup2(null, fd, inheritable=True)
            os.close(null)
        else:
            os.set_inheritable(fd, True)
        _closed_std_fds.add(fd)


# -- which console ---------------------------------------------------------------

def _writes_to_fd(target: Any, fd: int) -> bool:
    """Whether writing to ``target`` is writing to the process's ``fd`` and
    nothing else: a plain text file object on it whose ``write`` nobody
    replaced (an experiment tracker that wraps ``sys.stdout.write`` in place
    must see the lines, so its object gets them)."""
    if not isinstance(target, io.TextIOWrapper) or type(target).write is not io.TextIOWrapper.write:
        return False
    if "write" in getattr(target, "__dict__", {}):
        return False
    try:
        return target.fileno() == fd
    except (AttributeError, OSError, ValueError):
        return False


def _std_stream(which: int) -> TextIO | None:
    return sys.stdout if which == 0 else sys.stderr


# Whether an fd console (the launcher's fd 1 or 2, fed by the I/O thread)
# was given anything in this process: a teed stream's sink, torchmp's own
# words.  Until then no console can have bytes waiting or have failed.
_fd_consoles_used = False


def console_for(which: int) -> Any:
    """The console of stream ``which`` (0: stdout, 1: stderr): the launcher's
    fd (1 or 2), an ObjectConsole, or -1 for none."""
    global _fd_consoles_used
    fd = which + 1
    target = _std_stream(which)
    if target is None or fd in _closed_std_fds:
        return -1
    if _writes_to_fd(target, fd):
        _fd_consoles_used = True
        try:
            target.flush()  # what the program printed comes first
        except (OSError, ValueError):
            pass
        return fd
    return ObjectConsole(target, "sys.stdout" if which == 0 else "sys.stderr")


# -- torchmp's own words ---------------------------------------------------------

_forwarders: weakref.WeakSet[Forwarder] = weakref.WeakSet()


def track(forwarder: Forwarder) -> None:
    _forwarders.add(forwarder)


def say(text: str, which: int = 1) -> None:
    """Show torchmp's own whole lines on the launcher's stderr (which=1) or
    stdout (0): through the same console as the workers' lines, after those
    logged before them, without ever blocking (a console that cannot take
    them keeps them within its bound; past it they are left out)."""
    global _fd_consoles_used
    fd = which + 1
    target = _std_stream(which)
    if not text or target is None or fd in _closed_std_fds:
        return
    if not text.endswith("\n"):
        text += "\n"
    data = text.encode("utf-8", "replace")
    # A process with no I/O thread has no workers' lines to keep order with
    # (a worker, a program before its first launch): written as logging's
    # last resort would, rather than starting a thread (and a keeper) for it.
    if _writes_to_fd(target, fd) and _core.loop_exists():
        _fd_consoles_used = True
        if which == 1:
            try:
                target.flush()  # the program's own pending text first (stderr is line-buffered)
            except (OSError, ValueError):
                pass
        try:
            _core.console_say(fd, data)
        except OSError:
            pass  # no console to be had: the words are lost, nothing else
        return
    for forwarder in list(_forwarders):
        if forwarder.say(target, data):
            return
    # An object no running context writes to, or no I/O thread: nothing to be
    # ordered with.
    try:
        target.write(text)
        target.flush()
    except Exception as e:
        if is_interrupt(e):  # a signal's, not the console's
            raise


class ConsoleHandler(logging.Handler):
    """A logging handler whose records go through say(): line-whole, never
    blocking, in order with the workers' lines."""

    def __init__(self, which: int = 1, level: int = logging.NOTSET) -> None:
        super().__init__(level)
        self.which = which

    def emit(self, record: logging.LogRecord) -> None:
        try:
            say(self.format(record), self.which)
        except Exception as e:
            if is_interrupt(e):
                raise
            self.handleError(record)


class _LastResort(ConsoleHandler):
    """What ``logging.lastResort`` does for records of the ``torchmp``
    loggers that no handler of the program's takes -- show the message on
    stderr -- but through say(), so a stalled stderr never holds up a
    fail-fast or a close().  Stands aside whenever the program configured
    any handler that the record reaches (or set ``logging.lastResort`` to
    None)."""

    def __init__(self) -> None:
        super().__init__(1)

    def handle(self, record: logging.LogRecord) -> bool:
        last = logging.lastResort
        if last is None or record.levelno < last.level or self._others_take(record):
            return False
        return super().handle(record)

    def _others_take(self, record: logging.LogRecord) -> bool:
        c: logging.Logger | None = logging.getLogger(record.name)
        while c is not None:
            if any(h is not self and record.levelno >= h.level for h in c.handlers):
                return True
            if not c.propagate:
                return False
            c = c.parent
        return False


_last_resort = _LastResort()
logging.getLogger("torchmp").addHandler(_last_resort)


# -- a console switched off ------------------------------------------------------

#: The launcher's fds whose console a failure switched off (fd -> errno).
failures: dict[int, int] = {}


def check_failures() -> dict[int, int]:
    """Say once (a warning) that a console was switched off by something
    else than its reader leaving (a full file system); all so far."""
    for fd in (1, 2):
        err = _core.console_failure(fd)
        if err and fd not in failures:
            failures[fd] = err
            logger.warning("the console (%s) could not be written: %s; it is off for the rest of the run "
                           "(the log files are complete)", "stdout" if fd == 1 else "stderr",
                           os.strerror(err) if err != errno.ENOMEM else "out of memory")
    return failures


# -- letting consoles catch up --------------------------------------------------

# The last wait given up: what all consoles had shown by then, and how long
# it had waited for progress.  A wait that would be no longer, with nothing
# shown since (the exit after the report), does not start over.
_given_up: tuple[int, float] | None = None


def settle_for_result() -> None:
    """What the consoles get once wait() has its result: the fd consoles are
    let catch up (one that stopped moving is waited for RESULT_STALL), and a
    console switched off is said (check_failures).  Nothing is asked of the
    core before an fd console was used: this is on the path from the last
    exit to wait()'s return, where each call into the core costs
    microseconds (docs/profiles.md, "The result and the consoles after the
    last exit")."""
    if _fd_consoles_used:
        settle(RESULT_STALL)
        check_failures()


def settle(stall: float, limit: float | None = None, fd: int = -1) -> bool:
    """Wait while the launcher's fd consoles (fd >= 0: the console of that
    fd only) still have lines to show and keep taking them; give up once
    one took nothing for ``stall`` seconds (or after ``limit``).  True if
    everything was shown."""
    global _given_up
    if _core.consoles_pending(fd) == 0:
        return True
    shown = _core.consoles_shown(fd)
    if _given_up is not None and _given_up[1] >= stall and _core.consoles_shown() == _given_up[0]:
        return False  # still stuck where the last wait left it
    start = last_move = time.monotonic()
    nap = 0.001
    while _core.consoles_pending(fd):
        now = time.monotonic()
        if now - last_move >= stall or (limit is not None and now - start >= limit):
            _given_up = (_core.consoles_shown(), stall)
            return False
        time.sleep(nap)
        nap = min(nap * 2, 0.02)
        now_shown = _core.consoles_shown(fd)
        if now_shown > shown:
            shown, last_move = now_shown, time.monotonic()
    return True


def _drain_at_exit() -> None:
    stall = stall_time()
    for f in list(_forwarders):
        f.follow(stall)
    settle(stall)


def _after_fork_in_child() -> None:
    global _forwarders, _given_up
    _console_objects.after_fork_in_child()
    _forwarders = weakref.WeakSet()
    _given_up = None


os.register_at_fork(after_in_child=_after_fork_in_child)

# Registered at import, before the api module registers its own exit hook:
# atexit runs last-in first-out, so contexts left open are closed first and
# their last lines are in the backlog by the time it is drained.
atexit.register(_drain_at_exit)
