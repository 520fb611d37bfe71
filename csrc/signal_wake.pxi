# Signal wake-ups for the blocking waits of the main thread (Group.wait,
# Command.wait).  Included by _core.pyx.
#
# A Python signal handler runs in the main thread, but CPython's C handler
# runs in whichever thread the kernel gave the signal to, and only sets a
# flag there.  A main thread asleep in ppoll() is woken (EINTR) only if it
# took the signal itself while asleep: a signal taken by another thread (a
# timer's, a library's), or by the main thread a moment before it went to
# sleep, would leave the handler waiting for the wait's timeout -- for ever
# without one.  CPython also writes the signal's number to its wake-up fd
# (signal.set_wakeup_fd), from any thread: while the main thread sleeps in
# one of these waits, that fd is a pipe of ours, and the wait watches it.
#
# Only when no wake-up fd is set: one set by somebody else (an event loop of
# the main thread) is left as it was, and the wait sleeps in slices of
# SIGNAL_SLICE_SECONDS instead.  Finding out which takes a swap (CPython has
# no getter); what a signal wrote to our pipe during the swap is passed on
# to the owner (signal_wake_give_back).

import signal as _signal_module

cdef object _set_wakeup_fd = _signal_module.set_wakeup_fd

# The pipe's ends, made at import (or by a forked child's first wait: it
# closes its parent's at once); -1 if they could not be made.
cdef int _wake_r = -1
cdef int _wake_w = -1
# Waits of the main thread sleeping with the pipe installed (a handler run
# by one may wait again: close() in a handler).
cdef int _wake_depth = 0

#: How long a wait of the main thread sleeps at a time when another wake-up
#: fd is set: the longest a handler can wait for a signal another thread took.
SIGNAL_SLICE_SECONDS = 0.05

# What signal_wake_begin returns when the wait must sleep in slices.
cdef enum:
    SIGNAL_WAKE_SLICES = -3


cdef int fd_above_std(int fd) noexcept:
    """fd moved to 3 or above (the same open pipe end): a standard fd the
    program started with closed must stay closed, not become our pipe."""
    cdef int moved
    if fd > 2:
        return fd
    moved = fcntl(fd, F_DUPFD_CLOEXEC, 3)
    c_close(fd)
    return moved


cdef bint signal_wake_open() except -1:
    """Make the pipe: False if it cannot be made (out of fds)."""
    global _wake_r, _wake_w
    cdef int r, w
    try:
        r, w = _os.pipe()  # (CLOEXEC)
    except OSError:
        return False
    r = fd_above_std(r)
    w = fd_above_std(w)
    if r < 0 or w < 0:
        if r >= 0:
            c_close(r)
        if w >= 0:
            c_close(w)
        return False
    # Non-blocking: CPython's handler must never block on a full pipe (it
    # requires this of a wake-up fd), nor our drain on an empty one.
    _os.set_blocking(r, False)
    _os.set_blocking(w, False)
    _wake_r, _wake_w = r, w
    return True


cdef int signal_wake_begin() except -2:
    """Before a blocking wait: the fd to watch for signals (the pipe's read
    end, installed as CPython's wake-up fd: end the wait with
    signal_wake_end), -1 outside the main thread (no handler runs there), or
    SIGNAL_WAKE_SLICES."""
    global _wake_depth
    if _wake_r < 0 and not signal_wake_open():
        return SIGNAL_WAKE_SLICES  # out of fds: the wait still works, in slices
    try:
        # (Two system calls: CPython checks the fd each time.)
        previous = _set_wakeup_fd(_wake_w, warn_on_full_buffer=False)
    except ValueError:  # not the main thread
        return -1
    if previous == -1 or previous == _wake_w:
        _wake_depth += 1
        return _wake_r
    signal_wake_give_back(previous)
    return SIGNAL_WAKE_SLICES


cdef int signal_wake_give_back(int fd) except -1:
    """Make fd, somebody else's, CPython's wake-up fd again after a swap
    that found it there, with what CPython wrote to our pipe meanwhile: an
    event loop learns of a signal from that byte alone (asyncio's
    add_signal_handler, the CLI's report thread), so a signal that came
    between the two swaps would otherwise be lost to it.  The pipe is empty
    whenever it is not installed (signal_wake_end), so all it holds came in
    that window.  (Put back with CPython's default warn_on_full_buffer,
    asyncio's: CPython has no getter for what the owner chose.)"""
    cdef bytearray window = bytearray()
    _set_wakeup_fd(fd)
    signal_wake_empty(_wake_r, window)
    if window:
        try:
            _os.write(fd, window)
        except OSError:
            pass  # full, or not writable: CPython would have dropped it too
    return 0


cdef int signal_wake_end(int fd) except -1:
    """After a blocking wait that signal_wake_begin gave fd: the wake-up fd
    as it was before the outermost wait, and the pipe emptied (a signal may
    have come after the wait's last look), so that it holds nothing while it
    is not installed."""
    global _wake_depth
    if fd < 0:
        return 0
    _wake_depth -= 1
    if _wake_depth <= 0:
        _wake_depth = 0
        current = _set_wakeup_fd(-1)
        if current != _wake_w and current != -1:
            _set_wakeup_fd(current)  # set by a handler meanwhile: theirs now
        signal_wake_empty(_wake_r, None)
    return 0


cdef int signal_wake_empty(int fd, bytearray kept) except -1:
    """Read the pipe (non-blocking) until it is empty: one read when it
    already is.  What it held, a signal's number per byte, goes to kept
    unless that is None: a wait does not need it (the flags CPython set are
    what PyErr_CheckSignals acts on), an owner given its fd back does."""
    cdef char buf[512]
    cdef ssize_t n
    if fd < 0:
        return 0
    while True:
        n = c_read(fd, buf, sizeof(buf))
        if n <= 0:
            return 0
        if kept is not None:
            kept.extend(buf[:n])


cdef int64_t signal_wake_slice_ns(int fd, int64_t wait_ns) noexcept:
    """The sleep of one call: wait_ns (negative: forever), cut to a slice
    when the wait cannot watch for signals itself."""
    cdef int64_t slice_ns = <int64_t>(SIGNAL_SLICE_SECONDS * 1e9)
    if fd == SIGNAL_WAKE_SLICES and (wait_ns < 0 or wait_ns > slice_ns):
        return slice_ns
    return wait_ns


def _signal_wake_forget_after_fork():
    # A forked child gets its own pipe when it first waits: with its
    # parent's, each would wake the other.  Forked while the main thread
    # waited (by another thread), it also inherited the pipe as CPython's
    # wake-up fd, which must not outlive the pipe.
    global _wake_r, _wake_w, _wake_depth
    if _wake_r >= 0:
        try:
            current = _set_wakeup_fd(-1)
            if current != _wake_w and current != -1:
                _set_wakeup_fd(current)
        except ValueError:
            pass
        _os.close(_wake_r)
        _os.close(_wake_w)
    _wake_r = _wake_w = -1
    _wake_depth = 0


# At import, so that a program's fds do not change at its first wait (what
# counts of them, torchmp's fd budget among them, would see as a leak).
signal_wake_open()
_os.register_at_fork(after_in_child=_signal_wake_forget_after_fork)
