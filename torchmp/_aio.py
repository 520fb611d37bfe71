"""Event loops without a thread per process.

Each event loop that waits for torchmp (``run_async``, ``ctx.wait_async``)
gets one notifier (csrc/notifier.c): its one descriptor is watched by the
loop, the I/O thread posts a note when a watched command exits or its
output is complete, or a watched group's state moves on, and the loop wakes
whoever waits.  No thread, no descriptor and no child watcher per command,
whatever the number in flight.

* asyncio: any loop with ``add_reader`` (the default selector loop on Linux
  and macOS, uvloop), and anyio on its asyncio backend.  The descriptor is
  registered while anything on the loop waits.
* trio (and anyio on its trio backend): a system task of the run waits on
  the descriptor (``trio.lowlevel.wait_readable``) for as long as the run
  lasts.  Cleanup after a cancellation is shielded (it is bounded by the
  stop policy's grace).

Notes are only wake-ups: the native state (a command's ``state`` bits, a
group's version) is the truth, read again after every one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import sys
import time
from collections.abc import Callable, Generator
from typing import Any

from torchmp import _core
from torchmp._signals import is_interrupt

_tokens = itertools.count(1)


class _Watch:
    """One event loop's notifier, and who waits on it (by token)."""

    notifier: _core.Notifier
    wakers: dict[int, _Waiter]
    # A handled signal's exception raised inside one of this watch's loop
    # callbacks, for the first waiter that wakes up to raise in its task
    # (kept only while a waiter sleeps: one is then woken to take it).
    interrupted: BaseException | None = None

    def dispatch(self) -> None:
        try:
            notes, overflow = self.notifier.take()
            wakers = self.wakers
            if overflow:
                for waker in list(wakers.values()):
                    waker.note()
                return
            for token, _what in notes:
                found = wakers.get(token)
                if found is not None:
                    found.note()
        except BaseException as e:
            # A signal's handler raised here, the notes taken: every waiter
            # looks again, as after an overflow, rather than sleep on a lost
            # note.  asyncio would log and drop what a callback raises (trio
            # would end the run): the interrupt goes to a waiting task.
            waiters = list(self.wakers.values())
            if is_interrupt(e) and any(waiter.asleep() for waiter in waiters):
                self.interrupted = e
            for waker in waiters:
                waker.note()
            if self.interrupted is not e:
                raise

    def raise_interrupted(self) -> None:
        """In a task that woke up: raise the interrupt a callback took."""
        e = self.interrupted
        if e is not None:
            self.interrupted = None
            raise e

    # What the async library does for it (per library below).
    def new_event(self) -> Any:
        raise NotImplementedError

    def wake(self, event: Any) -> None:
        raise NotImplementedError

    async def wait_event(self, event: Any, timeout: float | None) -> None:
        raise NotImplementedError

    async def sleep(self, seconds: float) -> None:
        raise NotImplementedError

    def shielded(self) -> contextlib.AbstractContextManager[Any]:
        """Around cleanup after a cancellation: what it takes for the
        cleanup's own awaits to go through."""
        return contextlib.nullcontext()


class _AsyncioWatch(_Watch):
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.notifier = _core.Notifier()
        self.fd = self.notifier.fileno()
        self.wakers = {}
        self.users = 0
        try:
            loop.add_reader(self.fd, self.dispatch)
        except NotImplementedError:
            self.notifier.close()
            raise RuntimeError(
                f"torchmp's asyncio support needs an event loop with add_reader(), and "
                f"{type(loop).__name__} has none (on Windows, use a selector event loop)") from None

    def close(self) -> None:
        try:
            self.loop.remove_reader(self.fd)
        except (RuntimeError, ValueError):  # the loop is closed already
            pass
        self.notifier.close()

    def new_event(self) -> asyncio.Future[None]:
        return self.loop.create_future()

    def wake(self, event: asyncio.Future[None]) -> None:
        # Also on the way out: a signal's handler raising in this callback
        # (a wait's timeout) must not take the wake-up with it, and the
        # interrupt goes to the task woken (asyncio would log and drop it).
        try:
            if not event.done():
                event.set_result(None)
        except BaseException as e:
            if is_interrupt(e):
                self.interrupted = e
            if not event.done():
                event.set_result(None)
            if self.interrupted is not e:
                raise

    async def wait_event(self, event: asyncio.Future[None], timeout: float | None) -> None:
        handle = None if timeout is None else self.loop.call_later(max(0.0, timeout), self.wake, event)
        try:
            await event
        finally:
            if handle is not None:
                handle.cancel()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class _TrioWatch(_Watch):
    def __init__(self, trio: Any) -> None:
        self.trio = trio
        self.notifier = _core.Notifier()
        self.fd = self.notifier.fileno()
        self.wakers = {}
        trio.lowlevel.spawn_system_task(self._pump, name="torchmp notifier")

    async def _pump(self) -> None:
        # Until the run ends (trio cancels its system tasks then).
        try:
            while True:
                await self.trio.lowlevel.wait_readable(self.fd)
                self.dispatch()
        finally:
            self.notifier.close()

    def new_event(self) -> Any:
        return self.trio.Event()

    def wake(self, event: Any) -> None:
        event.set()

    async def wait_event(self, event: Any, timeout: float | None) -> None:
        with self.trio.move_on_after(float("inf") if timeout is None else max(0.0, timeout)):
            await event.wait()

    async def sleep(self, seconds: float) -> None:
        await self.trio.sleep(seconds)

    def shielded(self) -> contextlib.AbstractContextManager[Any]:
        scope: contextlib.AbstractContextManager[Any] = self.trio.CancelScope(shield=True)
        return scope


_asyncio_watches: dict[asyncio.AbstractEventLoop, _AsyncioWatch] = {}
_trio_watch: Any = None  # trio.lowlevel.RunVar, made on first use under trio


def _running_trio() -> Any:
    trio = sys.modules.get("trio")
    if trio is None:
        return None
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        return None
    return trio


def acquire() -> _Watch:
    """The running event loop's watch, made on first use."""
    global _trio_watch
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        trio = _running_trio()
        if trio is None:
            raise RuntimeError("torchmp's async calls need a running asyncio or trio event loop") from None
        if _trio_watch is None:
            _trio_watch = trio.lowlevel.RunVar("torchmp_watch")
        watch: _TrioWatch | None = _trio_watch.get(None)
        if watch is None:
            watch = _TrioWatch(trio)
            _trio_watch.set(watch)
        return watch
    found = _asyncio_watches.get(loop)
    if found is None:
        found = _asyncio_watches[loop] = _AsyncioWatch(loop)
    found.users += 1
    return found


def release(watch: _Watch) -> None:
    """asyncio: once nothing on the loop waits any more, its descriptor
    goes (trio's lasts as long as its run)."""
    if not isinstance(watch, _AsyncioWatch):
        return
    watch.users -= 1
    if watch.users == 0:
        if _asyncio_watches.get(watch.loop) is watch:
            del _asyncio_watches[watch.loop]
        watch.close()


async def sleep(seconds: float) -> None:
    """Sleep on whichever event loop runs."""
    if _running_trio() is not None:
        await sys.modules["trio"].sleep(seconds)
    else:
        await asyncio.sleep(seconds)


class _Waiter:
    """Sleeps until a note for its token, or a timeout."""

    def __init__(self, watch: _Watch) -> None:
        self.watch = watch
        self.token = next(_tokens)
        self._event: Any = None
        watch.wakers[self.token] = self

    def note(self) -> None:
        """A note for this waiter's token: wake it."""
        self._note()

    def asleep(self) -> bool:
        """Whether its task sleeps in :meth:`_sleep` (and raises, once woken,
        an interrupt a callback took)."""
        return self._event is not None

    def _note(self) -> None:
        if self._event is not None:
            self.watch.wake(self._event)

    async def _sleep(self, timeout: float | None) -> None:
        self._event = self.watch.new_event()
        try:
            await self.watch.wait_event(self._event, timeout)
        finally:
            self._event = None
        self.watch.raise_interrupted()

    def close(self) -> None:
        self.watch.wakers.pop(self.token, None)


class CommandWaiter(_Waiter):
    """A command handed to the I/O thread, waited for on this loop."""

    def __init__(self, watch: _Watch, cmd: _core.Command) -> None:
        super().__init__(watch)
        self.cmd = cmd
        try:
            cmd.watch(watch.notifier, self.token)
        except BaseException:
            self.close()
            raise

    async def until(self, state: int, timeout: float | None) -> bool:
        """Whether the command reached state (CMD_* bits) within timeout
        seconds (None: no limit)."""
        if self.cmd.state & state:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.cmd.state & state:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            await self._sleep(left)
        return True


class GroupWaiter(_Waiter):
    """A context's native group, waited for on this loop."""

    def __init__(self, watch: _Watch, group: _core.Group, fail_fast: bool | None = None) -> None:
        """fail_fast None: woken by every change; True or False: only once
        the result is decided (Group.watch's until_decided)."""
        super().__init__(watch)
        self.group = group
        try:
            group.watch(watch.notifier, self.token, fail_fast is not None, bool(fail_fast))
        except BaseException:
            self.close()
            raise

    async def changed(self, version: int, timeout: float | None) -> None:
        """Until the group's version is no longer version (or it is closed),
        or timeout seconds pass."""
        try:
            if self.group.version() != version:
                return
        except ValueError:
            return
        await self._sleep(timeout)

    def close(self) -> None:
        self.group.unwatch(self.watch.notifier)
        super().close()


async def wait_group(group: _core.Group, decided: Callable[[], bool], timeout: float | None,
                     fail_fast: bool) -> bool:
    """Until decided() holds, or timeout seconds pass (None: no limit);
    False on the timeout.  decided() is looked at again when the core says
    the group's result is decided (every rank exited, or with fail_fast one
    failed) or the wait was interrupted: the loop sleeps through the exits
    before.  A group released meanwhile counts as decided."""
    deadline = None if timeout is None else time.monotonic() + timeout
    watch = acquire()
    try:
        waiter = GroupWaiter(watch, group, fail_fast)
        try:
            while True:
                try:
                    version = group.version()
                except ValueError:  # released meanwhile
                    return True
                if decided():
                    return True
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                await waiter.changed(version, remaining)
        finally:
            waiter.close()
    finally:
        release(watch)


async def drive_group(steps: Generator[tuple[float, int], None, bool], group: _core.Group) -> bool:
    """Drive the shutdown policy (torchmp._shutdown) for a context's group
    on the running loop."""
    watch = acquire()
    try:
        waiter = GroupWaiter(watch, group)
        try:
            seconds, version = next(steps)
            while True:
                await waiter.changed(version, seconds)
                seconds, version = steps.send(None)
        except StopIteration as done:
            return bool(done.value)
        finally:
            waiter.close()
    finally:
        release(watch)


async def drive_command(steps: Generator[tuple[float, int], None, bool], waiter: CommandWaiter) -> bool:
    """Drive the shutdown policy for one watched command."""
    try:
        seconds, version = next(steps)
        while True:
            exited = waiter.cmd.state & _core.CMD_EXITED
            # (A leader that exited after the policy looked: look again now;
            # see _command.wait_blocking.)
            if exited == version:
                if exited:
                    await waiter.watch.sleep(seconds)  # a group emptying has no event
                else:
                    await waiter.until(_core.CMD_EXITED, seconds)
            seconds, version = steps.send(None)
    except StopIteration as done:
        return bool(done.value)
