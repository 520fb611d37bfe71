"""Consoles that are Python objects (a notebook's ``sys.stdout``,
``contextlib.redirect_stdout``, a captured run, a wrapped ``write``).

The I/O thread frames teed lines into a native queue console (it never needs
the GIL); one forwarding thread per process takes what waits and writes it to
the object in batches -- many lines per ``write()``, one GIL acquisition per
batch.  It sleeps in C (``_core.queues_wait``, no fd, no GIL) until some
queue has lines.  The queue is bounded like every console; a stream with a
log file is caught up from its log when the object falls behind, so a slow
object gets every line.

What an object does to us:

* a ``write()`` that raises: retried a few times (what a ``BlockingIOError``
  says was written is not written twice); a batch it still refuses is left
  out with one marker line per stream naming the complete log, the console
  stays on, and the first failure is logged once;
* a ``write()`` that calls ``close()`` or ``wait()`` of a context: nothing
  here waits for the forwarding thread from the forwarding thread itself,
  and no lock is held while an object is written;
* ``os.fork()``: the child starts with no forwarding thread and no consoles
  (``after_fork_in_child``).
"""

from __future__ import annotations

import io
import logging
import threading
import time
from typing import Any

from . import _core
from ._signals import is_interrupt

logger = logging.getLogger("torchmp.console")

#: How often a batch an object refuses is tried (pauses of 10, 20, 40 ms).
WRITE_ATTEMPTS = 4
#: Bytes of whole lines per write() to an object, at most (but one line).
WRITE_PIECE = 256 * 1024


def format_size(nbytes: int) -> str:
    """As the native marker lines say it."""
    if nbytes >= 10 << 20:
        return f"{nbytes >> 20} MiB"
    if nbytes >= 10 << 10:
        return f"{nbytes >> 10} KiB"
    return f"{nbytes} bytes"


class ObjectConsole:
    """A teed stream's console that is a Python object: the I/O thread
    queues framed lines natively; the forwarding thread writes them."""

    def __init__(self, target: Any, name: str) -> None:
        self.target = target
        self.name = name                    # "sys.stdout" or "sys.stderr", for messages
        self.queue = _core.QueueConsole()
        self.written = 0                    # bytes the object took (progress)
        self.in_flight = 0                  # bytes taken from the queue, being written
        self.closing = False                # its context is closed: leave once drained
        # prefix -> complete log, for the marker of a batch the object refused
        self._logs: list[tuple[bytes, str]] = []
        self._unshown: dict[bytes | None, list[int]] = {}
        self._failed_once = False

    def add_source(self, prefix: bytes, log_path: str) -> None:
        self._logs.append((prefix, log_path))
        self._logs.sort(key=lambda item: -len(item[0]))  # the longest prefix wins

    def drained(self) -> bool:
        return self.in_flight == 0 and self.queue.pending() == 0

    def forward(self) -> bool:
        """Write one batch of what waits; False if nothing did (any thread,
        but one at a time: the forwarding thread)."""
        # In flight from before the take: a waiter never sees the bytes
        # neither in the queue nor here.
        self.in_flight = 1
        try:
            markers = self._markers()
            if markers and self._write_batch(markers) is None:
                self._unshown.clear()  # said; else they are said with the next
            data = self.queue.take()
            if not data:
                return False
            # Whole lines, a few hundred KB a write(): text that size stays
            # in the CPU's caches on its way through decode and the
            # object (a 4 MB str is several times slower a byte).
            view = memoryview(data)
            start = 0
            for end in _core.line_cuts(data, WRITE_PIECE):
                unwritten = self._write_batch(view[start:end])
                if unwritten is not None:
                    self._not_shown(*unwritten)
                start = end
        finally:
            self.in_flight = 0
        return True

    # -- writing -------------------------------------------------------------
    def _bytes_path(self) -> Any:
        """The binary layer under a plain text file object, written byte-exact
        (a write() somebody replaced or overrode is called instead: it is
        what sees the lines)."""
        target = self.target
        if not isinstance(target, io.TextIOWrapper) or type(target).write is not io.TextIOWrapper.write:
            return None
        if "write" in getattr(target, "__dict__", {}):
            return None
        raw = getattr(target, "buffer", None)
        return raw if isinstance(raw, (io.BufferedIOBase, io.RawIOBase)) else None

    def _write_batch(self, data: Any) -> tuple[bytes, BaseException] | None:
        """Write data (bytes, or a buffer of them); what the object refused
        (and why), or None."""
        raw = self._bytes_path()
        payload: Any = memoryview(data) if raw is not None else str(data, "utf-8", "replace")
        failure: BaseException | None = None
        for attempt in range(WRITE_ATTEMPTS):
            try:
                if raw is not None:
                    self.target.flush()  # the text layer's pending output first
                    raw.write(payload)
                else:
                    self.target.write(payload)
                failure = None
                break
            except (BlockingIOError, InterruptedError) as e:
                # What it says it took is not written again.
                done = getattr(e, "characters_written", 0) or 0
                payload = payload[done:]
                failure = e
            except Exception as e:  # closed, its reader gone, refuses text
                if is_interrupt(e):  # a signal's, not the object's
                    raise
                failure = e
                break
            time.sleep(0.01 * (1 << attempt))
        if failure is not None:
            return (bytes(payload) if raw is not None else payload.encode("utf-8", "replace")), failure
        self.written += len(data)
        flush = getattr(raw if raw is not None else self.target, "flush", None)
        if flush is not None:
            try:
                flush()
            except Exception as e:  # what it holds goes out with its next flush
                if is_interrupt(e):
                    raise
        return None

    def _not_shown(self, data: bytes, failure: BaseException) -> None:
        for line in data.splitlines(keepends=True):
            key = next((p for p, _ in self._logs if line.startswith(p)), None)
            count = self._unshown.setdefault(key, [0, 0])
            count[0] += 1
            count[1] += len(line)
        if not self._failed_once:
            self._failed_once = True
            logger.warning("writing teed lines to %s failed (%s: %s); lines it does not take are left out of it, "
                           "with a marker naming their complete log", self.name, type(failure).__name__, failure)

    def _markers(self) -> bytes:
        """One line per stream whose lines the object refused."""
        logs = dict(self._logs)
        out = []
        for key, (lines, nbytes) in self._unshown.items():
            where = f"; complete log: {logs[key]}" if key is not None else ""
            out.append((key or b"") + (f"torchmp: {lines} line{'' if lines == 1 else 's'} ({format_size(nbytes)}) "
                                       f"not shown: writing to {self.name} failed{where}\n").encode())
        return b"".join(out)


class _ForwardingThread:
    """The one thread that writes object consoles' lines.  It ends (joined by
    the close() that removes the last console, if it is idle) when no console
    is left; everything here is guarded by _lock, which is never held while
    an object is written."""

    def __init__(self) -> None:
        self.consoles: list[ObjectConsole] = []
        self.writing = False
        self.thread = threading.Thread(target=self._run, name="torchmp-console", daemon=True)

    def _run(self) -> None:
        global _thread
        while True:
            seen = _core.queues_generation()
            with _lock:
                for c in [c for c in self.consoles if c.closing and c.drained()]:
                    self.consoles.remove(c)
                if not self.consoles:
                    if _thread is self:
                        _thread = None
                    _progress.notify_all()
                    return
                consoles = list(self.consoles)
                self.writing = True
            moved = False
            try:
                for c in consoles:
                    try:
                        moved = c.forward() or moved
                    except Exception as e:  # ours, not the object's: say so, keep the others going
                        if is_interrupt(e):
                            raise
                        logger.exception("forwarding teed lines to %s failed", c.name)
            finally:
                with _lock:
                    self.writing = False
                    _progress.notify_all()
            if not moved:
                _core.queues_wait(seen)


# Re-entrant: a signal handler on a thread inside one of these sections may
# close a context, which comes back here.
_lock = threading.RLock()
_progress = threading.Condition(_lock)
_thread: _ForwardingThread | None = None
# How long close() waits for an idle forwarding thread to end.
_THREAD_END_WAIT_S = 1.0


def after_fork_in_child() -> None:
    """The parent's thread does not exist in a forked child, and its locks
    may have been held by it: start clean, with no consoles."""
    global _thread, _lock, _progress
    _thread = None
    _lock = threading.RLock()
    _progress = threading.Condition(_lock)


class Forwarder:
    """A context's object consoles, handed to the forwarding thread."""

    def __init__(self, consoles: list[ObjectConsole]) -> None:
        global _thread
        self.consoles = consoles
        with _lock:
            start = _thread is None
            if start:
                _thread = _ForwardingThread()
            thread = _thread
            assert thread is not None
            thread.consoles.extend(consoles)
            if start:
                thread.thread.start()
        _core.queues_post()

    def _progress(self) -> tuple[int, bool]:
        done = all(c.drained() for c in self.consoles)
        return sum(c.written for c in self.consoles), done

    def follow(self, stall: float) -> bool:
        """Wait until every line so far is written to the objects, as long as
        they take some within ``stall`` seconds; True if all were.  From the
        forwarding thread itself (an object's write() that waits on a
        context): at once."""
        thread = _thread
        if thread is not None and thread.thread is threading.current_thread():
            return all(c.drained() for c in self.consoles)
        written, done = self._progress()
        last_move = time.monotonic()
        while not done:
            left = stall - (time.monotonic() - last_move)
            if left <= 0:
                return False
            with _lock:
                if _thread is None:  # ended (or a fork): nobody writes them
                    return all(c.drained() for c in self.consoles)
                _progress.wait(min(left, 0.05))
            now_written, done = self._progress()
            if now_written > written:
                written, last_move = now_written, time.monotonic()
        return True

    def detach(self) -> None:
        """The context is closed: its consoles leave the thread once what
        they hold is written.  Never waits on an object; if the thread is
        left with nothing and is idle, it is joined, so a closed context
        leaves no thread behind."""
        with _lock:
            for c in self.consoles:
                c.closing = True
            thread = _thread
            idle = thread is not None and not thread.writing and all(
                c.closing and c.drained() for c in thread.consoles)
        _core.queues_post()
        if thread is not None and idle and thread.thread is not threading.current_thread():
            thread.thread.join(_THREAD_END_WAIT_S)

    def say(self, target: Any, data: bytes) -> bool:
        """torchmp's own lines to the console of ``target``, in order with
        the workers' lines; False if no console of this context writes to it."""
        for c in self.consoles:
            if c.target is target and not c.closing:
                c.queue.say(data)
                return True
        return False
