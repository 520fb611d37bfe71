"""Contexts started and not closed yet, and those the program dropped
without ``wait()`` or ``close()``.

A live context is closed the normal way if the launcher exits without
closing it (``live_contexts``).  A context pins its ranks' pids until
``close()`` (their zombies stay, so that no signal of the context can reach a
process that reused a pid).  Once the context is unreachable nothing can
signal through it any more, so its native group becomes an :class:`Orphan`
(the callback of a weak reference to the context, which holds the group, not
the context).  An orphan whose ranks have all exited, leaving nothing in
their process groups, is reaped and released at the next launch, so dropped
contexts do not pile up zombies (torch's reap at its next launch too).
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


# Groups of dropped contexts, until reaped (appended by the finalizers, which
# may run in any thread at any allocation: they only append).
_orphans: list[Orphan] = []
# One reaper at a time (a finalizer never takes it).
_reaping = threading.Lock()


# Contexts started and not closed yet, by id(): a weak reference each, whose
# callback makes the context's group an orphan if the context becomes
# garbage first.  forget() drops the reference, and with it the callback.
# One registry for both questions (which contexts to close at exit, which
# groups were dropped): they are the same set of contexts.
_live: dict[int, weakref.ref[Any]] = {}


def watch(context: Any, name: str, group: _core.Group, launcher: Launch, forwarder: Forwarder | None) -> None:
    """``context`` is live until ``forget(context)``; if it becomes garbage
    before that, ``group`` becomes an orphan."""
    key = id(context)
    orphan = Orphan(name, group, launcher, forwarder)

    # (The containers are bound now: at interpreter teardown this may run
    # after the module's globals are gone.)
    def dropped(ref: weakref.ref[Any], live: dict[int, weakref.ref[Any]] = _live,
                orphans: list[Orphan] = _orphans) -> None:
        if live.get(key) is ref:  # (the id is not reused before this runs)
            del live[key]
        orphans.append(orphan)

    _live[key] = weakref.ref(context, dropped)


def forget(context: Any) -> None:
    """``context`` was closed: not live any more, never an orphan."""
    _live.pop(id(context), None)


def live_contexts() -> list[Any]:
    """The contexts started and not closed yet (that are still reachable)."""
    return [c for c in (ref() for ref in list(_live.values())) if c is not None]


def reap_finished() -> None:
    """Reap and release every orphan with nothing left to stop."""
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
    _orphans.clear()
