"""Event loops without a thread per process.

Each event loop that waits for torchmp (``run_async``, ``ctx.wait_async``)
gets one notifier (csrc/notifier.c) while anything on it waits: its one
descriptor is registered with ``loop.add_reader``, the I/O thread posts a
note when a watched command exits or its output is complete, or a watched
group's state moves on, and the loop's callback wakes whoever waits.  No
thread, no descriptor and no child watcher per command, whatever the number
in flight.

Works on every asyncio loop that implements ``add_reader`` (the default
selector loop on Linux and macOS, uvloop), and so under anyio's asyncio
backend.  trio is not supported (its loop has no ``add_reader``;
``trio.lowlevel.wait_readable`` on the same descriptor would be the way).

Notes are only wake-ups: the native state (a command's ``state`` bits, a
group's version) is the truth, read again after every one.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Generator

from torchmp import _core

_tokens = itertools.count(1)

sleep = asyncio.sleep


class _Watch:
    """One event loop's notifier, and who waits on it (by token)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.notifier = _core.Notifier()
        self.fd = self.notifier.fileno()
        self.wakers: dict[int, Callable[[], None]] = {}
        self.users = 0
        try:
            loop.add_reader(self.fd, self._dispatch)
        except NotImplementedError:
            self.notifier.close()
            raise RuntimeError(
                f"torchmp's asyncio support needs an event loop with add_reader(), and "
                f"{type(loop).__name__} has none (on Windows, use a selector event loop)") from None

    def _dispatch(self) -> None:
        notes, overflow = self.notifier.take()
        wakers = self.wakers
        if overflow:
            for wake in list(wakers.values()):
                wake()
            return
        for token, _what in notes:
            waker = wakers.get(token)
            if waker is not None:
                waker()

    def close(self) -> None:
        try:
            self.loop.remove_reader(self.fd)
        except (RuntimeError, ValueError):  # the loop is closed already
            pass
        self.notifier.close()


_watches: dict[asyncio.AbstractEventLoop, _Watch] = {}


def acquire() -> _Watch:
    """The running loop's watch, created on first use."""
    loop = asyncio.get_running_loop()
    watch = _watches.get(loop)
    if watch is None:
        watch = _watches[loop] = _Watch(loop)
    watch.users += 1
    return watch


def release(watch: _Watch) -> None:
    """Once nothing on the loop waits any more, its descriptor goes."""
    watch.users -= 1
    if watch.users == 0:
        if _watches.get(watch.loop) is watch:
            del _watches[watch.loop]
        watch.close()


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class _Waiter:
    """Sleeps until a note for its token, or a timeout."""

    def __init__(self, watch: _Watch) -> None:
        self.watch = watch
        self.token = next(_tokens)
        self._fut: asyncio.Future[None] | None = None
        watch.wakers[self.token] = self._note

    def _note(self) -> None:
        fut = self._fut
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def _sleep(self, timeout: float | None) -> None:
        loop = self.watch.loop
        fut = self._fut = loop.create_future()
        handle = None if timeout is None else loop.call_later(max(0.0, timeout), _wake, fut)
        try:
            await fut
        finally:
            if handle is not None:
                handle.cancel()
            self._fut = None

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
        deadline = None if timeout is None else self.watch.loop.time() + timeout
        while not self.cmd.state & state:
            left = None if deadline is None else deadline - self.watch.loop.time()
            if left is not None and left <= 0:
                return False
            await self._sleep(left)
        return True


class GroupWaiter(_Waiter):
    """A context's native group, waited for on this loop."""

    def __init__(self, watch: _Watch, group: _core.Group) -> None:
        super().__init__(watch)
        self.group = group
        try:
            group.watch(watch.notifier, self.token)
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


async def drive_group(steps: Generator[tuple[float, int], None, bool], group: _core.Group) -> bool:
    """Drive the shutdown policy (torchmp._shutdown) for a context's group
    on the running loop."""
    watch = acquire()
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
        release(watch)


async def drive_command(steps: Generator[tuple[float, int], None, bool], waiter: CommandWaiter) -> bool:
    """Drive the shutdown policy for one watched command."""
    try:
        seconds, _version = next(steps)
        while True:
            if waiter.cmd.state & _core.CMD_EXITED:
                await asyncio.sleep(seconds)  # a group emptying has no event
            else:
                await waiter.until(_core.CMD_EXITED, seconds)
            seconds, _version = steps.send(None)
    except StopIteration as done:
        return bool(done.value)
