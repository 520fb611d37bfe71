"""How torchmp stops what it started: one policy for a context's ranks
(``close()``, fail-fast) and for a command (``torchmp.run``'s timeout, what a
finished command left in its group, a cancelled ``run_async``).

1. The death signal (SIGTERM unless told otherwise) to every process group
   that still holds a process: the leader, or anything the leader left.
2. Wait until every group is empty, or the grace period ends.  A leader's
   exit is an event; a group emptying is not (the kernel has none), so a
   group whose leader has exited is looked at again after 2 ms, doubling to
   50 ms.
3. SIGKILL to what is left, and up to :data:`KILL_GRACE_SECONDS` for the
   leaders to go: a process in uninterruptible sleep (D state) is abandoned,
   never waited on forever.
4. One last SIGKILL for whatever joined a group meanwhile (only a member can
   add to a group, so this is not needed when every group was empty).

The policy is a generator of waits, so that ``close()`` and ``run`` drive it
in the calling thread and ``wait_async`` / ``run_async`` on an event loop.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Generator, Sized

from torchmp import _core

# typing only for the type checker: torchmp.run's imports stay off it
# (tests/test_import_graph.py).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Protocol

#: How long the processes get to exit after the death signal, before
#: SIGKILL, unless told otherwise: torch's fixed 30 s (close()'s default,
#: fail-fast, a launch interrupted, the contexts closed at exit, ``torchmp run
#: --shutdown-timeout``).
SHUTDOWN_GRACE_SECONDS = 30.0

# How long a SIGKILLed process gets to go before it is abandoned: one in
# uninterruptible sleep (wedged on a device) cannot be reaped, and the
# launcher must not hang on it.
KILL_GRACE_SECONDS = 5.0

# A group whose leader has exited but which still holds other processes is
# looked at again this often: from 2 ms, doubling, to 50 ms.
GROUP_POLL_FIRST = 0.002
GROUP_POLL_MAX = 0.05

#: What the policy waits for: (seconds, version) -- until the target's
#: version is no longer ``version`` (a leader exited) or the seconds pass.
Wait = tuple[float, int]


if TYPE_CHECKING:
    class Target(Protocol):
        """What is stopped: a context's native group, or one command."""

        def version(self) -> int:
            """A counter that moves when a leader exits."""

        def running(self) -> bool:
            """Some leader still runs."""

        def busy(self) -> Sized:
            """What still holds a living process (empty: nothing)."""

        def killpg(self, sig: int) -> None:
            """Signal every process group whose leader's pid is still pinned."""


class Ranks:
    """A context's ranks (a native group) as the policy sees them; running()
    says whether some leader still runs, as the context observes it."""

    def __init__(self, group: _core.Group, running: Callable[[], bool]) -> None:
        self._group = group
        self.running = running

    def version(self) -> int:
        return self._group.version()

    def busy(self) -> Sized:
        return self._group.busy()

    def killpg(self, sig: int) -> None:
        self._group.killpg(sig)


def _until_empty(target: Target, deadline: float) -> Generator[Wait, None, Sized]:
    nap = GROUP_POLL_FIRST
    while True:
        version = target.version()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return target.busy()
        if target.running():
            yield remaining, version  # leaders first: their exits are events
            continue
        busy = target.busy()
        if not busy:
            return busy
        yield min(nap, remaining), version
        nap = min(nap * 2, GROUP_POLL_MAX)


def stop(target: Target, death_sig: int, grace: float,
         on_signal: Callable[[], None] | None = None,
         on_kill: Callable[[Sized], None] | None = None,
         kill_grace: float | None = None) -> Generator[Wait, None, bool]:
    """The policy above; returns whether SIGKILL was needed.  on_signal runs
    once the death signal went out, on_kill(busy) after the SIGKILL;
    kill_grace (default KILL_GRACE_SECONDS) bounds the wait after it."""
    busy = target.busy()
    signalled = bool(busy)
    if busy:
        # Signal first, then say so: no signal waits for a console.
        target.killpg(int(death_sig))
        if on_signal is not None:
            on_signal()
        busy = yield from _until_empty(target, time.monotonic() + max(0.0, float(grace)))
    killed = bool(busy)
    if killed:
        target.killpg(int(signal.SIGKILL))
        if on_kill is not None:
            on_kill(busy)
        yield from _until_empty(target, time.monotonic() + (KILL_GRACE_SECONDS if kill_grace is None else kill_grace))
    if signalled:
        target.killpg(int(signal.SIGKILL))
    return killed


def run_blocking(steps: Generator[Wait, None, bool], wait: Callable[[float, int], object]) -> bool:
    """Drive the policy in the calling thread: ``wait(seconds, version)``
    blocks until the version moves or the seconds pass."""
    try:
        seconds, version = next(steps)
        while True:
            wait(seconds, version)
            seconds, version = steps.send(None)
    except StopIteration as done:
        return bool(done.value)
