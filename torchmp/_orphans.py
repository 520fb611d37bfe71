"""Contexts started and not closed yet, and those the program dropped
without ``wait()`` or ``close()``.

A live context is closed the normal way if the launcher exits without
closing it (``live_contexts``).  A context pins its ranks' pids until
``close()`` (their zombies stay, so that no signal of the context can reach a
process that reused a pid).  Once the context is unreachable nothing can
signal through it any more, so its native group becomes an :class:`Orphan`
(a weak reference to the context, which holds the group, not the context,
is queued when the context goes, and taken at the next launch).  An orphan
whose ranks have all exited, leaving nothing in their process groups, is
reaped and released at the next launch that finds those exits recorded (the
I/O thread records an exit a moment after the kernel has the zombie; a
launch in between leaves the orphan to the one after), so dropped contexts
do not pile up zombies (torch's reap at its next launch too).
Whatever still runs at interpreter exit is stopped the way ``close()`` stops
it (death signal, grace, SIGKILL), as it was before.
"""

from __future__ import annotations

import logging
import signal
import threading
import weakref
from typing import TYPE_CHECKING, Any

from torchmp import _core, _shutdown

if TYPE_CHECKING:
    from torchmp._console import Forwarder
    from torchmp._launch import Launch

logger = logging.getLogger("torchmp.api")


class Orphan:
    """The native side of a context the program dropped before close()."""

    def __init__(self, name: str, group: _core.Group, launcher: Launch, forwarder: Forwarder | None) -> None:
        self.name = name
        self._group = group
        self._launcher = launcher
        self._forwarder = forwarder
        self.released = False

    def _running(self) -> bool:
        return any(info.state == _core.PROC_RUNNING for info in self._group.snapshot()[1])

    def finished(self) -> bool:
        """Every rank exited and left nothing behind in its process group:
        there is nothing to stop, only zombies to reap."""
        return not self.released and not self._running() and not self._group.busy()

    def close(self, death_sig: signal.Signals, timeout: float = 30) -> None:
        """Stop what still runs (the one stop policy), then reap and release."""
        if self.released:
            return
        group = self._group
        if group.busy():
            logger.warning("stopping the ranks of %s, a context dropped without close(), with %s",
                           self.name, death_sig.name)
        _shutdown.run_blocking(
            _shutdown.stop(_shutdown.Ranks(group, self._running), death_sig, timeout), group.wait)
        self.release()

    def release(self) -> None:
        """Reap the ranks (their pids are no longer pinned) and free the group."""
        if self.released:
            return
        group = self._group
        self._launcher.release(group.reap())
        group.finish_streams()
        if self._forwarder is not None:
            self._forwarder.detach()
        self.released = True
        group.release()


# Groups of dropped contexts, until reaped.
_orphans: list[Orphan] = []
# One reaper at a time.
_reaping = threading.Lock()


class Registration(weakref.ref):  # type: ignore[type-arg]
    """A started context's entry in the registry, which the context holds:
    a weak reference to it, queued on _gone when the context goes."""

    __slots__ = ("orphan", "closed")
    orphan: Orphan
    closed: bool
    # By identity, in C (not by the context's own equality, nor by a Python
    # method that would run where a signal's exception can be lost).
    __hash__ = object.__hash__
    __eq__ = object.__eq__


# Started contexts' registrations, until their context goes (an ordered set:
# the exit closes them in launch order).  One registry for both questions
# (which contexts to close at exit, which groups were dropped): they are
# the same set of contexts.
_live: dict[Registration, None] = {}
# The registrations of contexts that went, until taken (_take_gone).  The
# callback is this list's append: no Python code runs when a context goes,
# which may be at any allocation in any thread, so a handled signal that
# comes then raises in the code that was running rather than being lost in
# a callback.  close() only marks its registration (forget); the
# registration and its orphan go with the context, so nothing is freed on
# the way from the last exit to wait()'s return (docs/profiles.md).
_gone: list[Registration] = []


def watch(context: Any, name: str, group: _core.Group, launcher: Launch,
          forwarder: Forwarder | None) -> Registration:
    """``context`` is live until ``forget`` of the registration returned
    (which the context keeps); if it becomes garbage before that,
    ``group`` becomes an orphan."""
    registration = Registration(context, _gone.append)
    registration.orphan = Orphan(name, group, launcher, forwarder)
    registration.closed = False
    _live[registration] = None
    return registration


def forget(registration: Registration) -> None:
    """Its context was closed: not live any more, never an orphan."""
    registration.closed = True


def live_contexts() -> list[Any]:
    """The contexts started and not closed yet (that are still reachable)."""
    return [c for c in (r() for r in list(_live) if not r.closed) if c is not None]


def _take_gone() -> None:
    """The groups of contexts that went unclosed become orphans; every gone
    context leaves the registry.  Safe from any thread, and against a
    signal anywhere in it: an orphan is then listed twice (harmless), never
    lost."""
    while _gone:
        registration = _gone[0]
        if not registration.closed:
            _orphans.append(registration.orphan)
            registration.closed = True
        _live.pop(registration, None)
        try:
            _gone.remove(registration)
        except ValueError:  # (taken by another thread meanwhile)
            pass


def reap_finished() -> None:
    """Reap and release every orphan with nothing left to stop."""
    if _gone:
        _take_gone()
    if not _orphans or not _reaping.acquire(blocking=False):
        return
    try:
        for orphan in list(_orphans):
            try:
                if orphan.finished():
                    orphan.release()
            except (OSError, RuntimeError, ValueError) as e:  # pragma: no cover - keep going with the others
                # (A handled signal's SignalException is not caught: it
                # stops the launch; the orphan is looked at again next time.)
                logger.error("releasing %s, a dropped context, failed: %r", orphan.name, e)
                orphan.released = True
            if orphan.released:
                _orphans.remove(orphan)
    finally:
        _reaping.release()


def stop_all(death_sig: signal.Signals, timeout: float) -> None:
    """At exit: stop and reap every orphan (a signal during the grace cuts it
    short with SIGKILL, as for the live contexts)."""
    from torchmp._signals import close_despite_interrupts

    _take_gone()
    while _orphans:
        orphan = _orphans.pop()
        try:
            close_despite_interrupts(orphan, death_sig, timeout)  # type: ignore[arg-type]
        except Exception as e:  # pragma: no cover - keep closing the others
            logger.error("stopping %s, a dropped context, at exit failed: %r", orphan.name, e)


def forget_after_fork() -> None:
    """A forked child has no contexts or orphans of its own: they are its
    parent's."""
    _live.clear()
    _gone.clear()
    _orphans.clear()
