"""Where teed lines are shown, and the console policy around it.

The I/O thread never blocks on a console (``csrc/console.c``): what a
console cannot take now waits in a backlog bounded per stream; past the bound
whole lines are dropped from the console only and a marker line says how many
and where the complete log is.  This module owns the Python half:

* which console a teed stream goes to: the launcher's own fd 1 / fd 2 when
  ``sys.stdout`` / ``sys.stderr`` is that fd, else the object itself (a
  notebook's stream, ``contextlib.redirect_stdout``, a captured test run),
  fed by a forwarding thread so the I/O thread never needs the GIL;
* the bound (``console_backlog=``, ``TORCHMP_CONSOLE_BACKLOG``,
  ``torchmp run --console-backlog``);
* standard fds that were closed at start (occupied with /dev/null, so no log
  file can take fd 1 or 2 and be mistaken for a console; the console is off);
* letting a live console catch up before results are returned and before the
  launcher exits, without ever waiting on a stalled one for long.
"""

from __future__ import annotations

import atexit
import io
import os
import re
import select
import sys
import threading
import time
import weakref
from typing import Any, TextIO

from . import _core

DEFAULT_BACKLOG: int = _core.DEFAULT_CONSOLE_BACKLOG
BACKLOG_ENV = "TORCHMP_CONSOLE_BACKLOG"
# At exit, how long a console may make no progress before its backlog is
# given up (a reader that resumes within it still gets every line).
EXIT_STALL_ENV = "TORCHMP_CONSOLE_EXIT_WAIT"
DEFAULT_EXIT_STALL = 10.0
# When wait() has its result: how long a console that stopped moving is
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
    env = os.environ.get(BACKLOG_ENV)
    if env:
        return parse_size(env, f"{BACKLOG_ENV}")
    return DEFAULT_BACKLOG


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


# -- consoles that are Python objects -------------------------------------------

class ObjectConsole:
    """A teed stream's console that is a Python object: the I/O thread
    queues framed lines natively; they are written to the object here."""

    def __init__(self, target: Any) -> None:
        self.target = target
        self.queue = _core.QueueConsole()
        self.lock = threading.Lock()
        self.broken = False

    def pump(self) -> None:
        """Write whatever waits, in order (any thread)."""
        with self.lock:
            data = self.queue.take()
            while data:
                if not self.broken:
                    self._write(data)
                data = self.queue.take()  # marker lines follow a catch-up

    def _write(self, data: bytes) -> None:
        target = self.target
        try:
            raw = getattr(target, "buffer", None)
            if isinstance(raw, (io.BufferedIOBase, io.RawIOBase)):
                # Byte-exact: the text layer's pending output first.
                target.flush()
                raw.write(data)
                raw.flush()
            else:
                target.write(data.decode("utf-8", "replace"))
                flush = getattr(target, "flush", None)
                if flush is not None:
                    flush()
        except Exception:
            # Closed, its reader gone, or it refuses text: a console, not
            # the job (and not the forwarding thread either).
            self.broken = True


class _ForwardingThread:
    """The thread that writes object consoles' lines: it sleeps in poll()
    (no GIL) on their notify fds, so lines reach a notebook while the
    program does something else than wait().  One per process at most, and
    only while some context has an object console: it ends (and closes its
    wake pipe) when the last one is removed.  _lock guards everything here."""

    def __init__(self, consoles: list[ObjectConsole]) -> None:
        self.consoles = {c.queue.fileno(): c for c in consoles}
        self.wake_r, self.wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self.ended = False
        self.thread = threading.Thread(target=self._run, name="torchmp-console", daemon=True)
        self.thread.start()

    def wake(self) -> None:
        """(Under _lock.)"""
        if self.ended:
            return
        try:
            os.write(self.wake_w, b"x")
        except BlockingIOError:
            pass  # already awake

    def _run(self) -> None:
        global _thread
        while True:
            with _lock:
                if not self.consoles:
                    # Under the lock: nobody can wake a closed pipe (or
                    # whatever reuses its fd numbers).
                    if _thread is self:
                        _thread = None
                    self.ended = True
                    os.close(self.wake_r)
                    os.close(self.wake_w)
                    return
                watched = dict(self.consoles)
            poller = select.poll()
            poller.register(self.wake_r, select.POLLIN)
            for fd in watched:
                poller.register(fd, select.POLLIN)
            try:
                events = poller.poll()
            except InterruptedError:
                continue
            for fd, _ in events:
                if fd == self.wake_r:
                    try:
                        while os.read(self.wake_r, 64):
                            pass
                    except BlockingIOError:
                        pass
                elif fd in watched:
                    watched[fd].pump()
            del watched


_thread: _ForwardingThread | None = None
_lock = threading.Lock()
# Bounds the wait for the forwarding thread to end: it is stuck only if a
# console's write() is (then it is the console's problem, not close()'s).
_THREAD_END_WAIT_S = 1.0


def _forget_thread_after_fork() -> None:
    global _thread, _lock
    _thread = None  # the parent's thread does not exist in the child
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_thread_after_fork)


class Forwarder:
    """A context's object consoles, handed to the forwarding thread."""

    def __init__(self, consoles: list[ObjectConsole]) -> None:
        global _thread
        self.consoles = consoles
        self.stopped = False
        with _lock:
            if _thread is None:
                _thread = _ForwardingThread(consoles)
            else:
                for c in consoles:
                    _thread.consoles[c.queue.fileno()] = c
                _thread.wake()
            self.thread = _thread

    def finish(self) -> None:
        """Write what waits now, from the caller's thread, and stop."""
        if not self.stopped:
            self.stopped = True
            with _lock:
                for c in self.consoles:
                    self.thread.consoles.pop(c.queue.fileno(), None)
                last = not self.thread.consoles
                self.thread.wake()
            # The last context gone: the thread ends now, not some time after
            # close() returned, so a closed context leaves no thread behind.
            # It only has to wake, see no consoles and close its pipe.
            if last and self.thread.thread is not threading.current_thread():
                self.thread.thread.join(_THREAD_END_WAIT_S)
        for c in self.consoles:
            c.pump()


def console_for(which: int) -> Any:
    """The console of stream ``which`` (0: stdout, 1: stderr): the launcher's
    fd (1 or 2), an ObjectConsole, or -1 for none."""
    fd = which + 1
    target: TextIO | None = sys.stdout if which == 0 else sys.stderr
    if target is None or fd in _closed_std_fds:
        return -1
    try:
        same = target.fileno() == fd
    except (AttributeError, OSError, ValueError):
        same = False
    if same:
        try:
            target.flush()  # what the program printed comes first
        except (OSError, ValueError):
            pass
        return fd
    return ObjectConsole(target)


# -- letting consoles catch up --------------------------------------------------

_forwarders: weakref.WeakSet[Forwarder] = weakref.WeakSet()


def track(forwarder: Forwarder) -> None:
    _forwarders.add(forwarder)


# The last wait given up: what all consoles still held then, and how long it
# had waited for progress.  A wait that would be no longer, with nothing
# moved since (the exit after the report), does not start over.
_given_up: tuple[int, float] | None = None


def settle(stall: float, limit: float | None = None, fd: int = -1) -> bool:
    """Wait while the launcher's fd consoles (fd >= 0: the console of that
    fd only) still have lines to show and keep taking them; give up once one
    made no progress for ``stall`` seconds (or after ``limit``).  True if
    everything was shown."""
    global _given_up
    pending = _core.consoles_pending(fd)
    if pending == 0:
        return True
    if _given_up is not None and _given_up[1] >= stall and _core.consoles_pending() == _given_up[0]:
        return False  # still stuck where the last wait left it
    start = last_move = time.monotonic()
    nap = 0.001
    while pending:
        now = time.monotonic()
        if now - last_move >= stall or (limit is not None and now - start >= limit):
            _given_up = (_core.consoles_pending(), stall)
            return False
        time.sleep(nap)
        nap = min(nap * 2, 0.02)
        left = _core.consoles_pending(fd)
        if left < pending:
            last_move = time.monotonic()
        pending = left
    return True
    start = last_move = time.monotonic()
    nap = 0.001
    while pending:
        now = time.monotonic()
        if now - last_move >= stall or (limit is not None and now - start >= limit):
            return False
        time.sleep(nap)
        nap = min(nap * 2, 0.02)
        left = _core.consoles_pending()
        if left < pending:
            last_move = time.monotonic()
        pending = left
    return True


def exit_stall() -> float:
    try:
        return max(0.0, float(os.environ.get(EXIT_STALL_ENV, DEFAULT_EXIT_STALL)))
    except ValueError:
        return DEFAULT_EXIT_STALL


def _drain_at_exit() -> None:
    for f in list(_forwarders):
        f.finish()
    settle(exit_stall())


# Registered at import, before the api module registers its own exit hook:
# atexit runs last-in first-out, so contexts left open are closed first and
# their last lines are in the backlog by the time it is drained.
atexit.register(_drain_at_exit)
