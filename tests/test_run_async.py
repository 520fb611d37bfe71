"""Event loops natively: ``await torchmp.run_async(...)`` (run's parameters
and result) and ``await ctx.wait_async()``, on asyncio's default loop,
uvloop, trio and anyio.  The
I/O thread wakes an event loop through one descriptor, however many
commands are in flight; cancelling a task stops and reaps the command's
whole process group before the cancellation goes on."""
from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import torchmp
from torchmp import DefaultLogsSpecs, Std, _aio
from torchmp._launch.command import GRACE_SECONDS

from helpers import (check_looked_again_at_once, interrupt_once_started, kill_groups, launch, pid_alive, read_pids,
                     stale_look_after_sigkill, wait_gone)

PY = sys.executable
SLACK = 2.0
# A timeout the command's first lines (its pids, "started") surely beat, even
# under ASan on a loaded CI machine, where 0.5 s did not always.
TIMEOUT_AFTER_START = 2.0


def _loops():
    yield pytest.param(asyncio.new_event_loop, id="asyncio")
    try:
        import uvloop
    except ImportError:
        yield pytest.param(None, id="uvloop", marks=pytest.mark.skip(reason="uvloop is not installed"))
    else:
        # libuv makes a process-wide pipe with its first loop (its signal
        # lock), kept for the process's life: not a leak of a test's.
        uvloop.new_event_loop().close()
        yield pytest.param(uvloop.new_event_loop, id="uvloop")


@pytest.fixture(params=list(_loops()))
def arun(request):
    """Run a coroutine to completion on a fresh loop of the kind asked for."""
    factory = request.param

    def run(coro, timeout: float = 120):
        loop = factory()
        try:
            return loop.run_until_complete(asyncio.wait_for(coro, timeout))
        finally:
            loop.close()

    return run


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _fds_settle(count, expected: int, timeout: float = 10.0) -> int:
    """count() once it is expected, or after timeout: the I/O thread lets go
    of a finished command (and so of the notifier it points at) a moment
    after posting that it is done."""
    deadline = time.monotonic() + timeout
    while count() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return count()


async def _settle_async(count, expected, timeout: float = 10.0):
    """_fds_settle for a coroutine: the loop keeps running while it waits."""
    deadline = time.monotonic() + timeout
    while count() != expected and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return count()


def _is_eventfd(fd: int | str) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventfd]"
    except OSError:
        return False


def _eventfds() -> int:
    return sum(map(_is_eventfd, os.listdir("/proc/self/fd")))


# --------------------------------------------------------------------------- run_async

def test_same_result_and_errors_as_run(arun):
    async def main():
        r = await torchmp.run_async(["sh", "-c", "echo out; echo err >&2; exit 4"], capture_output=True, text=True)
        assert isinstance(r, torchmp.CompletedProcess)
        assert (r.returncode, r.stdout, r.stderr) == (4, "out\n", "err\n") and r.pid > 0 and r.wall_time > 0
        with pytest.raises(subprocess.CalledProcessError) as e:
            await torchmp.run_async(["sh", "-c", "exit 2"], check=True)
        assert e.value.returncode == 2
        with pytest.raises(FileNotFoundError):
            await torchmp.run_async(["no-such-command-torchmp"])
        with pytest.raises(ValueError, match="max_output"):
            await torchmp.run_async(["true"], max_output=-3)
        r = await torchmp.run_async(["cat"], input=b"in", capture_output=True, max_output=1)
        assert r.stdout == b"i\n[... 1 bytes omitted ...]\n" and r.stdout_omitted == 1

    arun(main())


def test_many_in_flight_share_one_descriptor_and_no_thread(arun):
    async def main():
        # The I/O thread, and uvloop's own wake-up eventfds, exist from here
        # on; the first command's notifier is gone once the I/O thread lets
        # go of it (counted with it, the end's count could never match).
        watch = _aio.acquire()
        await torchmp.run_async(["true"])
        notifier_fd = watch.fd
        _aio.release(watch)
        assert not await _settle_async(lambda: _is_eventfd(notifier_fd), False), "the I/O thread kept the notifier"
        threads, eventfds = _threads(), _eventfds()
        seen = {"threads": 0, "eventfds": 0}
        sem = asyncio.Semaphore(32)

        async def one(i):
            async with sem:
                seen["threads"] = max(seen["threads"], _threads())
                seen["eventfds"] = max(seen["eventfds"], _eventfds())
                r = await torchmp.run_async(["sh", "-c", f"echo {i}; sleep 0.0{i % 5}"], capture_output=True)
                return r.stdout

        outs = await asyncio.gather(*(one(i) for i in range(128)))
        assert outs == [f"{i}\n".encode() for i in range(128)]
        assert seen["threads"] == threads, seen  # no thread per command
        assert seen["eventfds"] <= eventfds + 1, seen  # one notifier for the loop
        # Gone once nothing waits (the I/O thread lets go of the last
        # command a moment after posting that it is done).
        assert await _settle_async(_eventfds, eventfds) == eventfds

    arun(main())


def test_the_loop_runs_while_commands_run(arun):
    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.ensure_future(ticker())
        await torchmp.run_async(["sleep", "0.5"])
        task.cancel()
        assert ticks >= 20, ticks

    arun(main())


def test_timeout_stops_the_whole_group(arun, tmp_path):
    pidfile = tmp_path / "pids"

    async def main():
        t0 = time.monotonic()
        with pytest.raises(subprocess.TimeoutExpired) as e:
            await torchmp.run_async(
                ["sh", "-c", f"echo $$ >> {pidfile}; sleep 30 & echo $! >> {pidfile}; echo started; wait"],
                capture_output=True, timeout=TIMEOUT_AFTER_START)
        return time.monotonic() - t0, e.value

    elapsed, exc = arun(main())
    pids = read_pids(pidfile, 2)
    try:
        assert exc.stdout == b"started\n"
        assert TIMEOUT_AFTER_START <= elapsed < TIMEOUT_AFTER_START + GRACE_SECONDS + SLACK, elapsed
        assert wait_gone(pids, 1) == []
    finally:
        kill_groups(pids)


def test_a_leader_gone_right_after_the_sigkill_is_not_waited_for(arun, tmp_path, monkeypatch):
    # run_async's side of test_run's test of the same name: the I/O thread
    # records the exit while the policy is between its look and its wait.
    seen = stale_look_after_sigkill(monkeypatch, False)
    pidfile = tmp_path / "pid"

    async def main():
        with pytest.raises(subprocess.TimeoutExpired):
            await torchmp.run_async(["sh", "-c", f"trap '' TERM; echo $$ > {pidfile}; exec sleep 30"],
                                    timeout=TIMEOUT_AFTER_START)

    arun(main())
    check_looked_again_at_once(seen, pidfile)


def test_a_grandchild_holding_the_pipe_does_not_hold_back_the_result(arun, tmp_path):
    pidfile = tmp_path / "pid"

    async def main():
        t0 = time.monotonic()
        r = await torchmp.run_async(["sh", "-c", f"sleep 30 & echo $! > {pidfile}; echo hi"], capture_output=True,
                                    timeout=20)
        return r, time.monotonic() - t0

    r, elapsed = arun(main())
    (grandchild,) = read_pids(pidfile, 1)
    try:
        assert r.stdout == b"hi\n" and elapsed < GRACE_SECONDS + SLACK
        assert wait_gone([grandchild], 2) == []
    finally:
        kill_groups([grandchild])


@pytest.mark.parametrize("how", ["cancel", "asyncio.timeout", "wait_for"])
def test_cancelling_stops_and_reaps_the_group_before_it_goes_on(arun, tmp_path, how):
    if how == "asyncio.timeout" and not hasattr(asyncio, "timeout"):
        pytest.skip("asyncio.timeout is Python 3.11+")
    pidfile = tmp_path / "pids"
    cmd = ["sh", "-c", f"echo $$ >> {pidfile}; sleep 30 & echo $! >> {pidfile}; wait"]

    # Each way cancels once the command has written both pids: a fixed
    # timeout (0.5 s) ran out before that under ASan on a loaded CI machine.
    async def main():
        loop = asyncio.get_running_loop()
        if how == "cancel":
            task = asyncio.ensure_future(torchmp.run_async(cmd))
            await loop.run_in_executor(None, read_pids, pidfile, 2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        elif how == "wait_for":
            task = asyncio.ensure_future(torchmp.run_async(cmd))
            await loop.run_in_executor(None, read_pids, pidfile, 2)
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(task, 0.1)
        else:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(None) as deadline:  # type: ignore[attr-defined]
                    loop.run_in_executor(None, read_pids, pidfile, 2).add_done_callback(
                        lambda _: deadline.reschedule(loop.time() + 0.1))
                    await torchmp.run_async(cmd)
        # By now: every process of the group is gone, and the leader reaped.
        return [p.pid for p in psutil.Process().children(recursive=True)]

    children = arun(main())
    pids = read_pids(pidfile, 2)
    try:
        assert children == [] and not any(pid_alive(p) for p in pids)
    finally:
        kill_groups(pids)


def test_an_interrupt_right_after_the_start_kills_the_command_before_it_goes_on(arun):
    # As for run(): under a tracer a handler can run at the first line after
    # the command started, before anything watches it; the command is
    # killed there, not left to whoever drops the traceback.
    seen: dict[str, int] = {}

    async def traced():
        previous = sys.gettrace()
        sys.settrace(interrupt_once_started(torchmp.run_async.__code__, seen))
        try:
            await torchmp.run_async(["sleep", "30"])
        finally:
            sys.settrace(previous)

    try:
        with pytest.raises(KeyboardInterrupt) as interrupted:
            arun(traced())
        assert "pid" in seen, "run_async() never held its command"
        # Dead while the traceback still holds run_async's frame (SIGKILL:
        # a coroutine cannot sit out the grace period; the I/O thread reaps).
        assert wait_gone([seen["pid"]], 2) == []
    finally:
        del interrupted
        kill_groups(list(seen.values()))


def test_a_signal_inside_the_loops_dispatch_reaches_a_waiting_task(arun):
    # The notifier's reader callback took the notes when a handled signal's
    # handler raised in it (a SIGTERM under torch's handlers).  asyncio
    # would log and drop what a callback raises: the interrupt goes to one
    # waiting task instead, and the commands whose notes were taken are
    # still woken, not left to wait forever.
    code = _aio._Watch.dispatch.__code__
    tripped: list[int] = []

    def in_dispatch(frame, event, arg):
        if event == "line" and not tripped and frame.f_locals.get("notes"):
            tripped.append(1)
            raise torchmp.SignalException("a signal in dispatch", signal.SIGTERM)
        return in_dispatch

    async def traced():
        previous = sys.gettrace()
        sys.settrace(lambda frame, event, arg: in_dispatch if frame.f_code is code else None)
        try:
            return await asyncio.gather(
                torchmp.run_async(["sh", "-c", "sleep 0.2; echo first"], capture_output=True),
                torchmp.run_async(["sh", "-c", "sleep 0.8; echo second"], capture_output=True),
                return_exceptions=True)
        finally:
            sys.settrace(previous)

    results = arun(traced(), timeout=20)
    assert tripped, "the signal never landed in dispatch"
    interrupted = [r for r in results if isinstance(r, torchmp.SignalException)]
    finished = [r for r in results if not isinstance(r, BaseException)]
    assert [str(e) for e in interrupted] == ["a signal in dispatch"], results
    assert len(finished) == 1 and finished[0].returncode == 0 and finished[0].stdout in (b"first\n", b"second\n")
    assert psutil.Process().children(recursive=True) == []


def test_a_signal_inside_the_timeouts_wake_up_reaches_the_waiting_task(tmp_path):
    # The same inside the callback that ends a wait_async's timeout, where
    # the interpreter looks for signals: once event.done() has returned.
    # The wait ends at its timeout, with the interrupt.
    import inspect

    code = _aio._AsyncioWatch.wake.__code__
    lines, first = inspect.getsourcelines(_aio._AsyncioWatch.wake)
    setting = first + next(i for i, line in enumerate(lines) if "event.set_result" in line)
    tripped: list[int] = []

    def in_wake(frame, event, arg):
        if event == "line" and frame.f_lineno == setting and not tripped:
            tripped.append(1)
            raise torchmp.SignalException("a signal in wake", signal.SIGTERM)
        return in_wake

    ctx = torchmp.start_processes("timed", "sleep", args={0: ("30",)}, envs=None,
                                  logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)))
    try:
        async def traced():
            previous = sys.gettrace()
            sys.settrace(lambda frame, event, arg: in_wake if frame.f_code is code else None)
            try:
                return await ctx.wait_async(timeout=0.2)
            finally:
                sys.settrace(previous)

        started = time.monotonic()
        with pytest.raises(torchmp.SignalException, match="a signal in wake"):
            asyncio.run(asyncio.wait_for(traced(), 20))
        assert tripped, "the signal never landed in the wake-up"
        assert time.monotonic() - started < 10
    finally:
        ctx.close()


def test_a_hundred_tasks_cancelled_at_random_moments_leave_nothing(arun, tmp_path):
    fds = len(os.listdir("/proc/self/fd"))
    rng = random.Random(1234)

    async def main():
        tasks = [asyncio.ensure_future(torchmp.run_async(
            ["sh", "-c", f"echo $$ >> {tmp_path}/{i}; sleep 30 & wait"], capture_output=True))
            for i in range(100)]
        for task in tasks:
            await asyncio.sleep(rng.uniform(0, 0.01))
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, asyncio.CancelledError) for r in results), results
        return [p.pid for p in psutil.Process().children(recursive=True)]

    assert arun(main()) == []
    leaders = [int(line) for f in tmp_path.iterdir() for line in f.read_text().split()]
    assert not any(pid_alive(p) for p in leaders)
    assert _fds_settle(lambda: len(os.listdir("/proc/self/fd")), fds) == fds


def test_under_anyio_on_asyncio():
    anyio = pytest.importorskip("anyio")

    async def main():
        return await torchmp.run_async(["echo", "anyio"], capture_output=True)

    assert anyio.run(main, backend="asyncio").stdout == b"anyio\n"


def test_a_loop_without_add_reader_gets_a_clear_error():
    class NoReaders(asyncio.SelectorEventLoop):
        def add_reader(self, *args, **kwargs):
            raise NotImplementedError

    loop = NoReaders()
    try:
        with pytest.raises(RuntimeError, match="add_reader"):
            loop.run_until_complete(torchmp.run_async(["true"]))
    finally:
        loop.close()


# --------------------------------------------------------------------------- ctx.wait_async

def test_wait_async_returns_what_wait_returns(arun, tmp_path):
    async def main():
        ctx = launch("sh", {0: ("-c", "echo zero"), 1: ("-c", "sleep 0.2; exit 3")}, log_dir=tmp_path,
                     redirects=Std.OUT)
        t0 = time.monotonic()
        result = await ctx.wait_async()
        return result, time.monotonic() - t0, ctx

    result, elapsed, ctx = arun(main())
    assert sorted(result.failures) == [1] and result.failures[1].exitcode == 3
    assert open(result.stdouts[0]).read() == "zero\n" and elapsed < 0.2 + SLACK
    ctx.close()


def test_wait_async_timeout_and_then_the_result(arun, tmp_path):
    async def main():
        ctx = launch("sleep", {0: ("0.3",)}, log_dir=tmp_path)
        try:
            assert await ctx.wait_async(timeout=0) is None
            assert await ctx.wait_async(timeout=0.05) is None
            result = await ctx.wait_async()
            assert not result.is_failed() and result.resources[0].exitcode == 0
            assert await ctx.wait_async() is result
        finally:
            ctx.close()

    arun(main())


@pytest.mark.parametrize("kill_on_bad_exit", [True, False])
def test_wait_async_wakes_the_loop_for_the_deciding_exit_only(arun, tmp_path, monkeypatch, kill_on_bad_exit):
    # Five ranks exit 0.15 s apart; the third fails.  The I/O thread wakes the
    # loop for this wait once the result is decided (the failure under
    # fail-fast, else the last exit), not for each exit before it: each such
    # wake-up is Python run on the loop.  (A fail-fast close() that follows
    # watches the siblings' exits through a waiter of its own.)
    notes: dict[int, int] = {}
    note = _aio.GroupWaiter._note

    def counted(self):
        notes[self.token] = notes.get(self.token, 0) + 1
        note(self)

    monkeypatch.setattr(_aio.GroupWaiter, "_note", counted)

    async def main():
        ctx = launch("sh", {r: ("-c", f"sleep {0.3 + 0.15 * r:.2f}; exit {3 if r == 2 else 0}") for r in range(5)},
                     log_dir=tmp_path, kill_on_bad_exit=kill_on_bad_exit)
        try:
            return await ctx.wait_async()
        finally:
            ctx.close(signal.SIGKILL, 0)

    result = arun(main())
    assert list(result.failures) == ([2, 3, 4] if kill_on_bad_exit else [2])
    # The wait's waiter is the first to get a note (the close's comes after).
    assert notes and notes[next(iter(notes))] == 1, notes


def term_ignored_then_a_failure(tmp_path: Path) -> dict[int, tuple[str, ...]]:
    """Rank 1 ignores SIGTERM; rank 0 fails 0.1 s after rank 1 said so (after
    a fixed delay alone, a loaded machine had rank 1 killed by the SIGTERM
    before its trap ran)."""
    ready = tmp_path / "rank1-ignores-term"
    return {0: ("-c", f"while [ ! -e {ready} ]; do sleep 0.01; done; sleep 0.1; exit 1"),
            1: ("-c", f"trap '' TERM; : > {ready}; exec sleep 30")}


def ticks_after(ticks: list[int], since_ns: int) -> int:
    """How many of the ticks (time.time_ns()) came after since_ns."""
    return sum(1 for t in ticks if t > since_ns)


def test_wait_async_fail_fast_close_does_not_block_the_loop(arun, tmp_path):
    async def main():
        ctx = launch("sh", term_ignored_then_a_failure(tmp_path), log_dir=tmp_path)
        ctx.fail_fast_timeout = 0.5
        pids = list(ctx.pids().values())
        ticks: list[int] = []

        async def ticker():
            while True:
                await asyncio.sleep(0.01)
                ticks.append(time.time_ns())

        task = asyncio.ensure_future(ticker())
        result = await ctx.wait_async()
        task.cancel()
        return result, ticks, pids

    result, ticks, pids = arun(main())
    assert sorted(result.failures) == [0, 1] and result.failures[1].exitcode == -signal.SIGKILL
    # The 0.5 s grace passed on the loop, awaited: ~50 ticks after rank 0's
    # exit (blocked, the loop would not tick at all after it).
    assert ticks_after(ticks, result.failures[0].timestamp_ns) >= 25, ticks
    assert wait_gone(pids, 1) == []


def test_wait_async_on_function_workers(arun, tmp_path):
    async def main():
        ctx = torchmp.start_processes("f", os.getpid, {0: (), 1: ()}, {0: {}, 1: {}},
                                      DefaultLogsSpecs(log_dir=str(tmp_path)), start_method="fork")
        result = await ctx.wait_async()
        assert result.return_values == {r: pid for r, pid in ctx.pids().items()}

    arun(main())


def test_cancelling_wait_async_leaves_the_context_to_its_owner(arun, tmp_path):
    eventfds = _eventfds()

    async def main():
        ctx = launch("sleep", {0: ("30",)}, log_dir=tmp_path)
        task = asyncio.ensure_future(ctx.wait_async())
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert pid_alive(ctx.pids()[0])
        ctx.close(timeout=1)
        return ctx

    ctx = arun(main())
    assert ctx.wait(0) is not None and _fds_settle(_eventfds, eventfds) == eventfds


# --------------------------------------------------------------------------- trio (and anyio on it)

def test_trio_run_async_and_many_in_flight():
    trio = pytest.importorskip("trio")
    torchmp.run(["true"])  # the I/O thread exists from here on

    async def main():
        threads = _threads()
        r = await torchmp.run_async(["sh", "-c", "echo out; exit 3"], capture_output=True, text=True)
        assert (r.returncode, r.stdout) == (3, "out\n")
        with pytest.raises(subprocess.TimeoutExpired):
            await torchmp.run_async(["sleep", "5"], timeout=0.2)
        outs: dict[int, bytes] = {}
        limit = trio.CapacityLimiter(16)

        async def one(i):
            async with limit:
                outs[i] = (await torchmp.run_async(["echo", str(i)], capture_output=True)).stdout
                assert _threads() == threads

        async with trio.open_nursery() as nursery:
            for i in range(64):
                nursery.start_soon(one, i)
        assert outs == {i: f"{i}\n".encode() for i in range(64)}

    trio.run(main)


def test_trio_cancellation_stops_and_reaps_the_group(tmp_path):
    trio = pytest.importorskip("trio")
    pidfile = tmp_path / "pids"

    async def main():
        # Cancelled by the scope's deadline, set once both pids are written.
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                async def cancel_once_written():
                    await trio.to_thread.run_sync(read_pids, pidfile, 2)
                    scope.deadline = trio.current_time() + 0.1

                nursery.start_soon(cancel_once_written)
                await torchmp.run_async(["sh", "-c", f"echo $$ >> {pidfile}; sleep 30 & echo $! >> {pidfile}; wait"])
        assert scope.cancelled_caught
        return [p.pid for p in psutil.Process().children(recursive=True)]

    children = trio.run(main)
    pids = read_pids(pidfile, 2)
    try:
        assert children == [] and not any(pid_alive(p) for p in pids)
    finally:
        kill_groups(pids)


def test_trio_wait_async_keeps_the_run_going(tmp_path):
    trio = pytest.importorskip("trio")

    async def main():
        ctx = launch("sh", term_ignored_then_a_failure(tmp_path), log_dir=tmp_path)
        ctx.fail_fast_timeout = 0.5
        ticks: list[int] = []

        async def ticker():
            while True:
                await trio.sleep(0.01)
                ticks.append(time.time_ns())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            result = await ctx.wait_async()
            nursery.cancel_scope.cancel()
        assert sorted(result.failures) == [0, 1]  # as with asyncio
        assert ticks_after(ticks, result.failures[0].timestamp_ns) >= 25, ticks

    trio.run(main)


def test_under_anyio_on_trio():
    anyio = pytest.importorskip("anyio")
    pytest.importorskip("trio")

    async def main():
        return await torchmp.run_async(["echo", "anyio"], capture_output=True)

    assert anyio.run(main, backend="trio").stdout == b"anyio\n"


def test_no_event_loop_is_a_clear_error():
    import types

    def drive(coro: types.CoroutineType) -> None:
        coro.send(None)

    with pytest.raises(RuntimeError, match="running asyncio or trio event loop"):
        drive(torchmp.run_async(["true"]))
