"""Exits, fail-fast, close escalation, signals, waiting, and the API surface."""
from __future__ import annotations

import asyncio
import errno
import json
import mmap
import os
import resource
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import torchmp
from torchmp import DefaultLogsSpecs, RunProcsResult, SignalException, Std, SubprocessContext

from helpers import (WORKERS, kill_groups, launch, pid_alive, popen_launcher, python_worker, read_pids,
                     run_launcher, wait_gone)


def test_success_result_shape_and_resources(tmp_path):
    ctx = launch("sh", {0: ("-c", "exit 0"), 1: ("-c", "exit 0")}, log_dir=tmp_path, redirects=Std.OUT)
    pids = ctx.pids()
    result = ctx.wait()
    ctx.close()
    assert isinstance(result, RunProcsResult) and not result.is_failed()
    assert result.return_values == {0: None, 1: None}
    assert result.stderrs == {0: "", 1: ""} and result.stdouts[0].endswith("/0/stdout.log")
    assert set(result.resources) == {0, 1}
    for rank, usage in result.resources.items():
        assert usage.pid == pids[rank] and usage.exitcode == 0
        assert 0 < usage.wall_time < 10 and usage.user_time >= 0 and usage.max_rss > 0


def test_the_result_s_resource_usages_are_the_dataclass_s_own(tmp_path):
    # wait() makes each ResourceUsage without the dataclass's __init__ (it
    # runs cold there): the objects must be the same as the class makes.
    import copy
    import dataclasses
    import pickle

    ctx = launch("sh", {0: ("-c", "exit 0"), 1: ("-c", "exit 5")}, log_dir=tmp_path)
    result = ctx.wait()
    ctx.close()
    assert sorted(result.resources) == [0, 1]
    for rank, usage in result.resources.items():
        fields = dataclasses.asdict(usage)
        assert list(fields) == ["pid", "exitcode", "wall_time", "user_time", "system_time", "max_rss"]
        made = torchmp.ResourceUsage(**fields)
        assert usage == made and hash(usage) == hash(made) and repr(usage) == repr(made)
        assert pickle.loads(pickle.dumps(usage)) == usage and copy.copy(usage) == usage
        assert dataclasses.replace(usage, exitcode=7).exitcode == 7 and usage.exitcode == (0, 5)[rank]
        with pytest.raises(dataclasses.FrozenInstanceError):
            usage.pid = 1  # type: ignore[misc]


def test_a_clean_result_is_the_dataclass_s_own(tmp_path):
    # When every rank exited 0, wait() makes its RunProcsResult without the
    # dataclass's __init__ (it runs cold there): the same object as the
    # class makes, and as mutable.
    import copy
    import dataclasses
    import pickle

    ctx = launch("sh", {0: ("-c", "echo a"), 1: ("-c", "echo b >&2")}, log_dir=tmp_path, redirects=Std.ALL)
    result = ctx.wait()
    ctx.close()
    fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
    assert list(fields) == ["return_values", "failures", "stdouts", "stderrs", "resources"]
    assert fields["return_values"] == {0: None, 1: None} and fields["failures"] == {}
    assert sorted(fields["resources"]) == [0, 1] and not result.is_failed()
    assert Path(fields["stdouts"][0]).read_text() == "a\n" and Path(fields["stderrs"][1]).read_text() == "b\n"
    made = RunProcsResult(**fields)
    assert result == made and repr(result) == repr(made) and vars(result) == vars(made)
    assert pickle.loads(pickle.dumps(result)) == result and copy.deepcopy(result) == result
    assert dataclasses.asdict(result) == dataclasses.asdict(made)
    assert dataclasses.replace(result, failures={}) == result
    result.return_values = {0: 1}  # (torch's code sets fields of its results)
    assert result.return_values == {0: 1}


def _exited(pid: int) -> bool:
    """Whether pid has exited (a zombie, or gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except FileNotFoundError:
        return True


def _wait_exited(ctx, rank: int) -> None:
    deadline = time.monotonic() + 30
    while ctx._group.snapshot()[1][rank].state != torchmp._core.PROC_EXITED:
        assert time.monotonic() < deadline, f"rank {rank} did not exit"
        time.sleep(0.005)


def test_a_snapshot_hands_out_an_unchanged_rank_s_record_again(tmp_path):
    # The snapshot after the last exit makes that rank's record only (it
    # runs cold there): an unchanged rank's record is the same object, a
    # changed one's is new and says what changed.
    flag = tmp_path / "go"
    ctx = launch("sh", {0: ("-c", "exit 0"), 1: ("-c", f"while [ ! -e {flag} ]; do sleep 0.01; done; exit 4")},
                 log_dir=tmp_path / "logs")
    try:
        _wait_exited(ctx, 0)
        _, first = ctx._group.snapshot()
        _, again = ctx._group.snapshot()
        assert again[0] is first[0] and again[1] is first[1]
        assert first[1].state == torchmp._core.PROC_RUNNING
        flag.touch()
        _wait_exited(ctx, 1)
        _, last = ctx._group.snapshot()
        assert last[0] is first[0] and last[1] is not first[1]
        assert last[1].pid == first[1].pid and last[1].wait_status >> 8 == 4 and last[1].exit_mono_ns > 0
    finally:
        flag.touch()
        result = ctx.wait(30)
        ctx.close()
    assert result.failures[1].exitcode == 4


@pytest.mark.parametrize("last, others", [(0, "exit 0"), (2, "sleep 0.1"), (1, "sleep 0.1")])
def test_the_clean_result_is_made_while_the_last_rank_runs(tmp_path, monkeypatch, last, others):
    # wait() takes in the other ranks' exits when one is left (before its
    # sleep, or woken for it), and drafts the clean result then; after the
    # last exit it only adds that rank's usage.  The result is the same as
    # the long way makes, in rank order.
    from torchmp import _native

    made = []
    real = _native.made_without_init

    def spy(cls, **fields):
        made.append((cls.__name__, _exited(pids[last])))
        return real(cls, **fields)

    monkeypatch.setattr(_native, "made_without_init", spy)
    args = {rank: ("-c", "sleep 0.3" if rank == last else others) for rank in range(3)}
    ctx = launch("sh", args, log_dir=tmp_path)
    pids = ctx.pids()
    result = ctx.wait(30)
    ctx.close()
    if not torchmp._core.PORTABLE_BUILD:
        # (Without pidfds a rank's usage is read when its zombie is reaped,
        # which for a rank that exited before wait() is at the close: its
        # record changes after the draft, and the long way runs.)
        assert ("RunProcsResult", False) in made and ("RunProcsResult", True) not in made, made
    assert not result.is_failed() and result.return_values == {0: None, 1: None, 2: None}
    assert list(result.resources) == [0, 1, 2]
    assert {rank: usage.pid for rank, usage in result.resources.items()} == pids
    assert result.resources[last].wall_time >= 0.25 and result.resources[last].exitcode == 0
    assert result == RunProcsResult(return_values={0: None, 1: None, 2: None}, failures={},
                                    stdouts=result.stdouts, stderrs=result.stderrs,
                                    resources=result.resources)


def test_a_drafted_result_gives_way_to_the_last_rank_s_failure(tmp_path):
    # The draft made while one rank is left is for a clean end only.
    ctx = launch("sh", {0: ("-c", "sleep 0.3; exit 3"), 1: ("-c", "exit 0"), 2: ("-c", "exit 0")},
                 log_dir=tmp_path)
    result = ctx.wait(30)
    ctx.close()
    assert result.is_failed() and sorted(result.failures) == [0] and result.failures[0].exitcode == 3
    assert list(result.resources) == [0, 1, 2] and result.resources[0].exitcode == 3


def test_a_subclass_asked_about_clean_exits_is_still_asked(tmp_path):
    # The clean result skips _clean_exit_problems only where the class
    # finds none there (the base's): an override still turns a rank that
    # exited 0 into a failure.
    class Asking(SubprocessContext):
        def _clean_exit_problems(self, ranks):
            return {rank: "exited 0 too early" for rank in ranks if rank == 1}

    ctx = launch("sh", {0: ("-c", "exit 0"), 1: ("-c", "exit 0")}, log_dir=tmp_path)
    ctx.__class__ = Asking
    result = ctx.wait()
    ctx.close()
    assert sorted(result.failures) == [1] and result.failures[1].exitcode == 0
    assert result.failures[1].message == "exited 0 too early" and sorted(result.resources) == [0, 1]


@pytest.mark.parametrize("how", ["subclass", "instance"])
def test_the_close_that_wait_makes_is_an_overriding_close(tmp_path, how):
    # wait() closes a finished context without going through close() (that
    # path runs cold); a close() of a subclass's own, or one set on the
    # instance, still runs when the result comes, as torch's wait() has it.
    calls = []

    class Closing(SubprocessContext):
        def close(self, death_sig=None, timeout=30):
            calls.append((death_sig, timeout))
            super().close(death_sig, timeout)

    def start():
        return torchmp.start_processes(name="t", entrypoint="sh", args={0: ("-c", "exit 0"), 1: ("-c", "exit 0")},
                                       envs={0: {}, 1: {}}, logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)))
    ctx = start()
    if how == "subclass":
        ctx.__class__ = Closing
    else:
        plain_close = ctx.close

        def own_close(death_sig=None, timeout=30):
            calls.append((death_sig, timeout))
            plain_close(death_sig, timeout)
        ctx.close = own_close
    try:
        result = ctx.wait()
        assert result is not None and not result.is_failed() and sorted(result.resources) == [0, 1]
        assert calls == [(None, ctx.fail_fast_timeout)]
        assert ctx._closed
    finally:
        SubprocessContext.close(ctx)


def test_a_close_from_a_handler_inside_the_close_that_wait_makes(tmp_path):
    # A signal handler on the waiting thread may close the context while the
    # close that wait() makes is under way (the close lock is re-entrant):
    # that close then finds its group released, and the result still comes
    # from the final snapshot, through poll() as through wait().
    ctx = launch("sh", {0: ("-c", "exit 0"), 1: ("-c", "exit 4")}, log_dir=tmp_path, kill_on_bad_exit=False)
    deadline = time.monotonic() + 30
    while any(info.state != torchmp._core.PROC_EXITED for info in ctx._group.snapshot()[1]):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    quiet = ctx._close_quiet
    handled = []

    def interrupted_close_quiet(group):
        if not handled:
            handled.append(True)
            ctx.close()  # what the handler does, at this point of the close
        return quiet(group)

    ctx._close_quiet = interrupted_close_quiet
    try:
        result = ctx.wait(0)
        assert handled and ctx._closed and result is not None and list(result.failures) == [1]
        assert result.failures[1].exitcode == 4 and sorted(result.resources) == [0, 1]
    finally:
        SubprocessContext.close(ctx)


def test_cpu_time_is_measured(tmp_path):
    entry, args = python_worker("x = 0\nfor i in range(3_000_000): x += i")
    ctx = launch(entry, {0: args}, log_dir=tmp_path)
    result = ctx.wait(60)
    ctx.close()
    usage = result.resources[0]
    assert usage.user_time + usage.system_time > 0.05
    assert usage.wall_time >= usage.user_time * 0.5


@pytest.mark.parametrize("cmd, code, signame", [
    ("exit 3", 3, "<N/A>"),
    ("kill -KILL $$", -9, "SIGKILL"),
    ("kill -SEGV $$", -11, "SIGSEGV"),
    ("kill -ABRT $$", -6, "SIGABRT"),
])
def test_exit_codes_and_signals(tmp_path, cmd, code, signame):
    ctx = launch("sh", {0: ("-c", cmd)}, log_dir=tmp_path)
    result = ctx.wait(30)
    ctx.close()
    failure = result.failures[0]
    assert failure.exitcode == code and failure.signal_name() == signame
    assert failure.pid == result.resources[0].pid
    assert not failure.terminated_by_launcher


def test_fail_fast_terminates_siblings_and_reports_root_cause(tmp_path):
    args = {0: ("-c", "sleep 0.2; exit 5"), 1: ("-c", "exec sleep 100"), 2: ("-c", "exec sleep 100")}
    ctx = launch("sh", args, log_dir=tmp_path)
    pids = ctx.pids()
    t0 = time.monotonic()
    result = ctx.wait(30)
    elapsed = time.monotonic() - t0
    assert elapsed < 5
    assert set(result.failures) == {0, 1, 2}
    assert result.failures[0].exitcode == 5
    assert result.failures[1].exitcode == -signal.SIGTERM and result.failures[1].terminated_by_launcher
    assert all(not pid_alive(p) for p in pids.values())
    from torchmp.errors import ChildFailedError
    err = ChildFailedError("trainer", result.failures)
    rank, first = err.get_first_failure()
    assert rank == 0 and first.exitcode == 5
    ctx.close()


def test_close_escalates_to_sigkill_on_term_ignoring_workers(tmp_path):
    pidfile = tmp_path / "pids"
    ctx = launch(sys.executable, {r: (str(WORKERS / "ignore_term.py"), str(pidfile)) for r in range(2)},
                 log_dir=tmp_path / "logs")
    pids = read_pids(pidfile, 2)
    t0 = time.monotonic()
    ctx.close(timeout=0.5)
    elapsed = time.monotonic() - t0
    assert 0.5 <= elapsed < 2.0
    assert wait_gone(pids, 0.1) == []
    result = ctx.wait(0)
    assert {f.exitcode for f in result.failures.values()} == {-signal.SIGKILL}


def test_close_is_idempotent_and_safe_after_exit(tmp_path):
    ctx = launch("true", {0: ()}, log_dir=tmp_path)
    ctx.wait()
    ctx.close()
    ctx.close()
    ctx.close(signal.SIGKILL, timeout=0)
    assert ctx.wait(0) is not None


def test_close_kills_grandchildren_through_the_process_group(tmp_path):
    pidfile = tmp_path / "gc"
    ctx = launch("sh", {0: ("-c", f"sleep 100 & echo $! > {pidfile}; sleep 100")}, log_dir=tmp_path / "l")
    grandchild = read_pids(pidfile, 1)
    try:
        assert pid_alive(grandchild[0])
        ctx.close()
        assert wait_gone(grandchild, 2.0) == []
    finally:
        kill_groups(grandchild)


def test_grandchildren_of_exited_workers_are_killed_when_the_run_ends(tmp_path):
    pidfile = tmp_path / "gc"
    # The grandchild ignores SIGTERM and outlives its parent; wait() closes
    # the context once the run is decided, as torch's does, and that takes
    # down what is left in the workers' process groups.
    ctx = launch("sh", {0: ("-c", f"(trap '' TERM; exec sleep 100) > /dev/null 2>&1 & echo $! > {pidfile}")},
                 log_dir=tmp_path / "l")
    grandchild = read_pids(pidfile, 1)
    try:
        assert pid_alive(grandchild[0])
        result = ctx.wait(10)
        assert not result.is_failed()
        assert wait_gone(grandchild, 2.0) == []
        ctx.close()
    finally:
        kill_groups(grandchild)


def _proc_state(pid):
    """The state letter of pid in /proc ("Z": a zombie), None once reaped."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except FileNotFoundError:
        return None


def _until_exited(ctx, ranks, timeout=10.0):
    deadline = time.monotonic() + timeout
    while any(ctx._group.snapshot()[1][r].state != torchmp._core.PROC_EXITED for r in ranks):
        assert time.monotonic() < deadline, "the ranks did not exit"
        time.sleep(0.01)


def test_the_one_call_close_does_nothing_while_anything_is_left_to_stop(tmp_path):
    # Group.close_quiet is the close() that wait() makes when every rank is
    # done: it reaps, finishes the streams and hands back the final
    # snapshot in one native call.  It must decline, and touch nothing,
    # while a rank runs, while a grandchild lives on in an exited rank's
    # group, and (asked to) while a rank's death by SIGKILL waits to be
    # explained: those are the shutdown policy's and the OOM look's.
    pidfile = tmp_path / "gc"
    ctx = launch("sh", {0: ("-c", "exec sleep 30"),
                        1: ("-c", f"(exec sleep 30) > /dev/null 2>&1 & echo $! > {pidfile}")},
                 log_dir=tmp_path / "l")
    pids = ctx.pids()
    grandchild = read_pids(pidfile, 1)[0]
    group = ctx._group
    try:
        _until_exited(ctx, [1])
        assert group.close_quiet() is None  # rank 0 runs
        os.kill(pids[0], signal.SIGKILL)
        _until_exited(ctx, [0])
        assert group.close_quiet() is None  # the grandchild lives in rank 1's group
        assert pid_alive(grandchild) and _proc_state(pids[1]) == "Z"  # still pinned
        os.kill(grandchild, signal.SIGKILL)
        assert wait_gone([grandchild]) == []
        # Nothing alive now, but rank 0 died of a SIGKILL: its zombie stays
        # for the OOM look.
        assert group.close_quiet(unless_killed=True) is None
        assert _proc_state(pids[0]) == "Z" and _proc_state(pids[1]) == "Z"
        forkserver_pids, (_, ranks) = group.close_quiet()
        assert forkserver_pids == []
        assert [info.state for info in ranks] == [torchmp._core.PROC_EXITED] * 2
        assert [info.pid for info in ranks] == [pids[0], pids[1]]
        assert ranks[0].wait_status == signal.SIGKILL and ranks[1].wait_status == 0
        # Reaped: neither pid is a child of this process any more.
        for pid in pids.values():
            with pytest.raises(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        result = ctx.wait(0)
        assert sorted(result.failures) == [0] and result.failures[0].exitcode == -signal.SIGKILL
    finally:
        ctx.close(signal.SIGKILL, 0)
        kill_groups([grandchild])


def _signal_from_another_thread(sig, delay):
    """A timer thread that sends sig to itself: CPython's C handler runs in
    that thread, and only flags the signal for the main thread (as when the
    kernel gives a process's signal to some other thread)."""
    return threading.Timer(delay, lambda: signal.pthread_kill(threading.get_ident(), sig))


@pytest.mark.parametrize("wakeup_fd", ["none", "an event loop's"])
def test_a_handler_runs_during_wait_whichever_thread_took_the_signal(tmp_path, wakeup_fd):
    # A graceful-shutdown handler that closes the context while main sits
    # in wait(20): it must run at once, not when the wait times out.
    ctx = launch("sleep", {0: ("30",), 1: ("30",)}, log_dir=tmp_path)
    ran: list[float] = []

    def handler(signum, frame):
        ran.append(time.monotonic())
        ctx.close(timeout=5)

    previous = signal.signal(signal.SIGUSR1, handler)
    theirs = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC) if wakeup_fd != "none" else None
    if theirs is not None:
        signal.set_wakeup_fd(theirs[1])
    timer = _signal_from_another_thread(signal.SIGUSR1, 0.3)
    try:
        t0 = time.monotonic()
        timer.start()
        result = ctx.wait(20)
        elapsed = time.monotonic() - t0
    finally:
        timer.cancel()
        timer.join()
        after = signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGUSR1, previous)
        ctx.close()
        if theirs is not None:
            os.close(theirs[0])
            os.close(theirs[1])
    assert ran and ran[0] - t0 < 3, f"the handler ran {ran[0] - t0 if ran else None} s in"
    assert elapsed < 5
    assert result is not None and {r: f.exitcode for r, f in result.failures.items()} == {0: -15, 1: -15}
    # The process's wake-up fd is as it was: none, or the event loop's.
    assert after == (-1 if theirs is None else theirs[1])


def test_wait_timeout_returns_none_and_poll(tmp_path):
    ctx = launch("sleep", {0: ("100",)}, log_dir=tmp_path)
    try:
        assert ctx.wait(0) is None
        t0 = time.monotonic()
        assert ctx.wait(0.2) is None
        assert 0.2 <= time.monotonic() - t0 < 1.0
    finally:
        ctx.close()


def test_another_contexts_exit_neither_ends_nor_busies_this_wait(tmp_path):
    # wait() also watches the workers' exits directly; an exit of another
    # context's worker wakes it, and it must go back to sleep, not return
    # early or poll until its own deadline.  The other exit must come while
    # this wait sleeps: on a machine loaded enough (sanitizer lanes side by
    # side) that its worker is not even started by then, try again, up to
    # three times; a wait that ends early or busies fails at once.
    for attempt in range(3):
        a = launch("sleep", {0: ("100",)}, log_dir=tmp_path / f"a{attempt}")
        b = launch("sh", {0: ("-c", "sleep 0.1")}, log_dir=tmp_path / f"b{attempt}")
        try:
            cpu0, t0 = time.process_time(), time.monotonic()
            assert a.wait(1.0) is None
            elapsed, cpu = time.monotonic() - t0, time.process_time() - cpu0
            assert 1.0 <= elapsed < 2.5
            assert cpu < 0.1, f"{cpu:.3f} s of CPU while waiting"
            result = b.wait(0)
        finally:
            a.close()
            b.close()
        if result is not None:
            assert not result.is_failed()
            return
    pytest.fail("in three tries the other context's worker never exited while this one waited 1 s")


def test_wait_is_event_driven_not_period_driven(tmp_path):
    ctx = launch("sh", {0: ("-c", "sleep 0.3")}, log_dir=tmp_path)
    t0 = time.monotonic()
    result = ctx.wait(timeout=30, period=10)
    elapsed = time.monotonic() - t0
    ctx.close()
    assert not result.is_failed()
    exit_lag = elapsed - result.resources[0].wall_time
    assert elapsed < 1.0 and exit_lag < 0.25


def _timed_wait(ctx, timeout):
    """ctx.wait(timeout), then close ctx (SIGKILL, no grace) whatever
    happened: (when the wait began, its result, how long it took)."""
    try:
        t0 = time.monotonic()
        result = ctx.wait(timeout)
        return t0, result, time.monotonic() - t0
    finally:
        ctx.close(signal.SIGKILL, 0)


@pytest.mark.parametrize("kill_on_bad_exit", [True, False])
def test_wait_wakes_its_caller_for_the_deciding_exit_only(tmp_path, kill_on_bad_exit):
    # Four ranks exit 0.4 s apart; the second to exit fails.  wait() looks
    # at the ranks once before it sleeps (_poll); when the result is decided
    # (the failure under fail-fast, else the last exit), the core says so
    # and wait() goes straight to the result (_finish) -- never a look for
    # an exit that decides nothing and leaves more than one rank running.
    # Once one rank is left (without fail-fast: after the third exit), it
    # looks once more, while that rank runs, and takes in the exits so far:
    # that look keeps the path after the deciding exit warm (docs/profiles.md).
    # It is the only look then: wait() goes back to sleep on what it saw,
    # without a _poll that would look again while the last exit may come.
    # (0.4 s: on a loaded machine the ranks' starts spread over 0.2 s, which
    # reordered exits 0.15 s apart.)
    launched = time.monotonic()  # before any rank's clock starts
    ctx = launch("sh", {0: ("-c", "sleep 1.2"), 1: ("-c", "sleep 0.8; exit 3"), 2: ("-c", "sleep 0.4"),
                        3: ("-c", "sleep 1.6")}, log_dir=tmp_path, kill_on_bad_exit=kill_on_bad_exit)
    looks = []
    running_at_looks = []
    finishes = []
    poll, take_in, finish = ctx._poll, ctx._take_in, ctx._finish

    def counted_poll():
        looks.append(time.monotonic())
        running_at_looks.append([r for r, info in enumerate(ctx._snapshot()[1])
                                 if info.state == torchmp._core.PROC_RUNNING])
        return poll()

    def counted_take_in(ranks):
        looks.append(time.monotonic())
        running_at_looks.append([r for r, info in enumerate(ranks) if info.state == torchmp._core.PROC_RUNNING])
        return take_in(ranks)

    def counted_finish():
        finishes.append(time.monotonic())
        return finish()

    ctx._poll, ctx._take_in, ctx._finish = counted_poll, counted_take_in, counted_finish
    t0, result, elapsed = _timed_wait(ctx, 30)
    assert result is not None and list(result.failures) == ([1, 0, 3] if kill_on_bad_exit else [1])
    when = [round(t - t0, 3) for t in looks + finishes]
    assert len(finishes) == 1, when
    assert running_at_looks == ([[0, 1, 2, 3]] if kill_on_bad_exit else [[0, 1, 2, 3], [3]]), when
    if kill_on_bad_exit:  # (the ranks' clocks started before t0, during the launch)
        assert t0 + elapsed - launched >= 0.8 and elapsed < 1.15 and result.failures[0].terminated_by_launcher
    else:
        # After the last exit: 1.6 s after rank 3 started, which was during
        # the launch, before t0 (the bound from t0 failed by 0.6 ms in CI).
        assert t0 + elapsed - launched >= 1.6 and sorted(result.resources) == [0, 1, 2, 3]
        # Ranks 0-2 were taken in at the second look, rank 3 at the end: the
        # result says of each what the final snapshot does.
        for rank, info in enumerate(ctx._final[1]):
            usage = result.resources[rank]
            assert (usage.pid, usage.exitcode, usage.max_rss) == (info.pid, 3 if rank == 1 else 0,
                                                                  info.maxrss_kb * 1024)
            assert usage.wall_time == (info.exit_mono_ns - info.start_mono_ns) / 1e9 > 0.3


def test_wait_returns_when_its_look_at_one_rank_left_sees_the_last_exit(tmp_path):
    # When one rank is left, wait() looks at the ranks once and sleeps again
    # on what it saw.  If the last exit was recorded before that look, the
    # look is what decides: a sleep would wait for a change that never
    # comes (here until the timeout).  The look is held back until the last
    # rank has exited, as a busy machine may do to it.
    ctx = launch("sh", {0: ("-c", "sleep 0.2"), 1: ("-c", "sleep 0.5")}, log_dir=tmp_path)
    snapshot = ctx._snapshot
    held_looks = []

    def late_snapshot():
        version, ranks = snapshot()
        if sum(info.state == torchmp._core.PROC_RUNNING for info in ranks) == 1:
            time.sleep(0.8)
            version, ranks = snapshot()
            held_looks.append([info.state == torchmp._core.PROC_RUNNING for info in ranks])
        return version, ranks

    ctx._snapshot = late_snapshot
    _, result, elapsed = _timed_wait(ctx, 10)
    assert held_looks == [[False, False]]  # the case itself: the held look saw both exits
    assert result is not None and not result.failures and sorted(result.resources) == [0, 1]
    assert elapsed < 5, elapsed


def _wait_counting_sleeps(ctx, seen: dict) -> None:
    before = resource.getrusage(resource.RUSAGE_THREAD)
    seen["result"] = ctx.wait(30)
    after = resource.getrusage(resource.RUSAGE_THREAD)
    seen["sleeps"] = after.ru_nvcsw - before.ru_nvcsw


def test_the_waiting_thread_sleeps_through_the_exits_that_decide_nothing(tmp_path):
    # Six ranks exit 0.15 s apart, all with status 0: only the last exit
    # decides.  The thread in wait() is woken when one rank is left (from
    # then on it watches that rank's exit itself) and by the last exit; the
    # four exits before are the I/O thread's alone.  Each wake-up of the
    # waiting thread ends a sleep of it: counted from the kernel's own tally
    # of that thread's voluntary context switches (RUSAGE_THREAD), not from
    # the clock.  A contended lock is a sleep too, and on a loaded machine
    # (sanitizer lanes side by side) there are more of those: a run over the
    # bound is tried again, up to three times.  Woken by every exit, each
    # run is over it.
    counts = []
    for attempt in range(3):
        ctx = launch("sleep", {r: (f"{0.3 + 0.15 * r:.2f}",) for r in range(6)}, log_dir=tmp_path / str(attempt))
        seen: dict = {}
        thread = threading.Thread(target=_wait_counting_sleeps, args=(ctx, seen))
        try:
            thread.start()
            thread.join(30)
        finally:
            ctx.close(signal.SIGKILL, 0)
        result = seen["result"]
        assert result is not None and not result.is_failed() and sorted(result.resources) == list(range(6))
        # (Two or three on an idle machine.  Woken by every exit: 6 to 10.)
        counts.append(seen["sleeps"])
        if seen["sleeps"] <= 4:
            return
    pytest.fail(f"the waiting thread slept {counts} times in three runs (at most 4 expected)")


def test_a_wait_for_the_deciding_exit_is_woken_once_when_one_rank_is_left(tmp_path):
    # The core's side of the look above, on either backend: a wait begun
    # with more than one rank running returns when one is left, undecided;
    # a wait begun with one left sleeps until that rank's exit decides, and
    # says so (WAIT_DECIDED), which saves the woken caller a decided() call.
    # Ranks 0 and 1 exit 0 once the test makes the file `go`, not after a
    # fixed time: under a sanitizer with lanes beside it, a launch can take
    # longer than any sleep short enough for a unit test.
    go = tmp_path / "go"
    until_go = ("-c", f"while ! [ -e '{go}' ]; do sleep 0.02; done")
    ctx = launch("sh", {0: until_go, 1: until_go, 2: ("-c", "exec sleep 30")}, log_dir=tmp_path / "logs")
    try:
        group = ctx._group
        version, ranks = group.snapshot()
        assert [info.state for info in ranks] == [torchmp._core.PROC_RUNNING] * 3
        go.touch()
        assert group.wait(20, version, True, True) == torchmp._core.WAIT_CHANGED == 1
        assert not group.decided(True)
        version, ranks = group.snapshot()
        assert [info.state for info in ranks] == [torchmp._core.PROC_EXITED] * 2 + [torchmp._core.PROC_RUNNING]
        t0 = time.monotonic()
        assert group.wait(0.5, version, True, True) == 0
        assert time.monotonic() - t0 >= 0.5
        os.kill(ranks[2].pid, signal.SIGKILL)  # the deciding exit
        assert group.wait(20, version, True, True) == torchmp._core.WAIT_DECIDED == 2
        assert group.decided(True)
        # Without until_decided a change is only a change.
        assert group.wait(20, version) == torchmp._core.WAIT_CHANGED
    finally:
        ctx.close(signal.SIGKILL, 0)


def test_context_manager_closes(tmp_path):
    with launch("sleep", {0: ("100",)}, log_dir=tmp_path) as ctx:
        pid = ctx.pids()[0]
        assert pid_alive(pid)
    assert wait_gone([pid], 1.0) == []


def test_sigterm_to_launcher_raises_signal_exception_and_close_cleans_up(tmp_path):
    pidfile = tmp_path / "pids"
    script = f"""
        import sys
        import torchmp
        from torchmp import SignalException
        ctx = torchmp.start_processes("w", "sh", {{0: ("-c", "echo $$ >> {pidfile}; exec sleep 100")}},
                                      {{0: {{}}}}, torchmp.DefaultLogsSpecs(log_dir="{tmp_path}/logs"))
        try:
            # "ready" from inside the try: a SIGTERM right after it is read
            # must not find the launcher still before the try.
            print("ready", flush=True)
            ctx.wait()
        except SignalException as e:
            print("caught", e.sigval.name, flush=True)
            ctx.close(e.sigval)
            print("closed", flush=True)
    """
    launcher = popen_launcher(script, stdout=subprocess.PIPE)
    workers = []
    try:
        assert launcher.stdout.readline() == b"ready\n"
        workers = read_pids(pidfile, 1)
        launcher.send_signal(signal.SIGTERM)
        out, _ = launcher.communicate(timeout=10)
        assert out == b"caught SIGTERM\nclosed\n"
        assert wait_gone(workers, 1.0) == []
    finally:
        kill_groups([launcher.pid] + workers)
        launcher.wait()
        launcher.stdout.close()


# A launch interrupted once every worker runs, before start_processes returns
# (the caller never gets the context): patched into the launcher program.
_INTERRUPT_LAUNCH = """
    import os, signal, sys, threading, time
    from pathlib import Path
    import torchmp
    from torchmp import api

    real_launch = api.SubprocessContext._launch

    def launch_then_interrupt(self, group, streams):
        real_launch(self, group, streams)
        pidfile = Path("{pidfile}")
        while not pidfile.exists() or len(pidfile.read_text().split()) < 2:
            time.sleep(0.01)
        {interrupt}

    api.SubprocessContext._launch = launch_then_interrupt
    worker = ("-c", '{worker}; echo $$ >> {pidfile}; while :; do sleep 0.05; done')
    t0 = time.monotonic()
    try:
        torchmp.start_processes("w", "sh", {{0: worker, 1: worker}}, {{0: {{}}, 1: {{}}}},
                                torchmp.DefaultLogsSpecs(log_dir="{logs}"))
    except BaseException as e:
        print(type(e).__name__, f"{{time.monotonic() - t0:.1f}}", flush=True)
    time.sleep(30)  # alive: the workers' parent-death signal must not be what kills them
"""


def _interrupted_launch(tmp_path, worker, interrupt):
    pidfile = tmp_path / "pids"
    script = _INTERRUPT_LAUNCH.format(pidfile=pidfile, logs=tmp_path / "logs", worker=worker,
                                      interrupt=interrupt)
    launcher = popen_launcher(script, stdout=subprocess.PIPE)
    workers = []
    try:
        workers = read_pids(pidfile, 2)
        line = launcher.stdout.readline().decode()  # teardown or no, at most ~30 s
        left = wait_gone(workers, 1.0)
        assert launcher.poll() is None
        return line.split(), left
    finally:
        kill_groups([launcher.pid] + workers)
        launcher.wait()
        launcher.stdout.close()


def test_ctrl_c_during_start_passes_sigint_to_the_started_workers(tmp_path):
    got = tmp_path / "got"
    (name, _), left = _interrupted_launch(
        tmp_path, f'trap "echo INT >> {got}; exit 3" INT', "raise KeyboardInterrupt")
    assert name == "KeyboardInterrupt"
    assert left == []
    assert got.read_text() == "INT\nINT\n"


def test_a_second_signal_during_the_start_teardown_kills_at_once(tmp_path):
    # The workers ignore SIGTERM: the first signal's teardown would wait 30 s;
    # the second one, 0.3 s later, must cut it short -- and not leave them.
    (name, seconds), left = _interrupted_launch(
        tmp_path, "trap \"\" TERM",
        "threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start(); "
        "os.kill(os.getpid(), signal.SIGTERM); time.sleep(10)")
    assert name == "SignalException"
    assert 0.2 < float(seconds) < 5
    assert left == []


def test_signals_to_handle_env_var(monkeypatch, tmp_path):
    old = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGUSR1, NOSUCHSIG")
    try:
        ctx = launch("true", {0: ()}, log_dir=tmp_path)
        ctx.wait()
        ctx.close()
        assert signal.getsignal(signal.SIGUSR1) is not old[signal.SIGUSR1]
        assert signal.getsignal(signal.SIGTERM) is old[signal.SIGTERM]
        with pytest.raises(SignalException) as info:
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(1)
        assert info.value.sigval == signal.SIGUSR1
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# --- the two start_processes signatures -----------------------------------

def test_torch_19_signature_layout(tmp_path):
    log_dir = tmp_path / "legacy"
    ctx = torchmp.start_processes("trainer", "echo", {0: ("a",), 1: ("b",)}, {0: {}, 1: {}}, str(log_dir),
                                  "spawn", Std.OUT, Std.NONE)
    result = ctx.wait(30)
    ctx.close()
    assert result.stdouts == {0: str(log_dir / "0" / "stdout.log"), 1: str(log_dir / "1" / "stdout.log")}
    assert (log_dir / "1" / "stdout.log").read_bytes() == b"b\n"
    # keywords of the 1.9 form, envs omitted
    ctx = torchmp.start_processes(name="t", entrypoint="echo", args={0: "hello"},
                                  log_dir=str(tmp_path / "kw"), redirects=Std.ALL)
    result = ctx.wait(30)
    ctx.close()
    assert (tmp_path / "kw" / "0" / "stdout.log").read_bytes() == b"hello\n"


def test_torch_19_log_dir_checks_before_start(tmp_path):
    (tmp_path / "nonempty").mkdir()
    (tmp_path / "nonempty" / "x").write_text("x")
    with pytest.raises(RuntimeError, match="nonempty"):
        torchmp.start_processes("t", "true", {0: ()}, {0: {}}, str(tmp_path / "nonempty"))
    (tmp_path / "afile").write_text("x")
    with pytest.raises(NotADirectoryError):
        torchmp.start_processes("t", "true", {0: ()}, {0: {}}, str(tmp_path / "afile"))


@pytest.mark.parametrize("args, envs, exc, needle", [
    ({0: (), 2: ()}, None, ValueError, "args"),
    ({0: (), 1: ()}, {0: {}}, ValueError, "envs"),
    ({0: (), 1: ()}, {0: {}, 1: {}, 2: {}}, ValueError, "envs"),
    ([(), ()], None, ValueError, "args"),
    ({0: ()}, {0: "FOO=1"}, ValueError, "envs[0]"),
])
def test_bad_rank_mappings_rejected_before_start(tmp_path, args, envs, exc, needle):
    with pytest.raises(exc) as info:
        torchmp.start_processes("t", "true", args, envs, DefaultLogsSpecs(log_dir=str(tmp_path / "l")))
    assert needle in str(info.value)
    assert not any((tmp_path / "l").iterdir())


def test_other_bad_inputs(tmp_path):
    specs = DefaultLogsSpecs(log_dir=str(tmp_path / "l"))
    with pytest.raises(TypeError, match="numa_options must be a NumaOptions"):
        torchmp.start_processes("t", "true", {0: ()}, {0: {}}, specs, numa_options=object())
    with pytest.raises(TypeError, match="logs_specs"):
        torchmp.start_processes("t", "true", {0: ()}, {0: {}})
    with pytest.raises(TypeError, match="entrypoint"):
        torchmp.start_processes("t", 42, {0: ()}, {0: {}}, specs)
    with pytest.raises(TypeError, match="unexpected keyword"):
        torchmp.start_processes("t", "true", {0: ()}, {0: {}}, specs, bogus=1)
    with pytest.raises(ValueError, match="NUL"):
        torchmp.start_processes("t", "echo", {0: ("a\0b",)}, {0: {}}, specs)
    assert not any((tmp_path / "l").iterdir())


def test_symlink_planted_as_log_file_is_not_followed(tmp_path):
    specs = DefaultLogsSpecs(log_dir=str(tmp_path / "l"), redirects=Std.OUT)
    envs = {0: {}}
    ctx = SubprocessContext("t", "echo", {0: ("x",)}, envs, specs)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.symlink(victim, ctx.stdouts[0])
    with pytest.raises(OSError, match="symlink"):
        ctx.start()
    ctx.close()
    assert victim.read_text() == "precious"


def test_torch_logs_specs_objects_are_accepted(tmp_path):
    torch_api = pytest.importorskip("torch.distributed.elastic.multiprocessing.api")
    specs = torch_api.DefaultLogsSpecs(log_dir=str(tmp_path), redirects=torch_api.Std.ALL)
    ctx = torchmp.start_processes("t", "echo", {0: ("via torch specs",)}, {0: {}}, specs)
    result = ctx.wait(30)
    ctx.close()
    assert Path(result.stdouts[0]).read_bytes() == b"via torch specs\n"


def test_user_subclass_of_pcontext_keeps_torch_polling_wait():
    class Fake(torchmp.PContext):
        def __init__(self):
            self.polls = 0

        def _start(self):
            pass

        def _poll(self):
            self.polls += 1
            return RunProcsResult() if self.polls == 3 else None

        def pids(self):
            return {}

        def _close(self, death_sig, timeout=30):
            pass

    fake = Fake()
    assert fake.wait(timeout=5, period=0.01) is not None and fake.polls == 3


def test_low_nofile_is_raised_or_fails_cleanly(tmp_path):
    script = f"""
        import os, resource, sys
        import torchmp
        from torchmp import Std
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, {{hard}}))
        ctx = torchmp.start_processes("w", "true", {{r: () for r in range(256)}}, {{r: {{}} for r in range(256)}},
                                      torchmp.DefaultLogsSpecs(log_dir="{tmp_path}/logs", tee=Std.ALL))
        r = ctx.wait(60)
        ctx.close()
        print(r.is_failed(), resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 256)
    """
    # The hard limit allows more: the launcher raises its soft limit.
    res = run_launcher(script.replace("{hard}", "4096"))
    assert res.stdout == b"False True\n", res.stderr
    # The hard limit does not: a clear error before anything starts.
    res = run_launcher(script.replace("{hard}", "256"))
    assert res.returncode == 1 and b"RLIMIT_NOFILE is 256" in res.stderr and b"OSError" in res.stderr


def test_a_wait_passes_on_every_signal_an_event_loop_listens_for(tmp_path):
    # An asyncio loop learns of a signal from the byte CPython writes to its
    # wake-up fd, nothing else.  wait() finds out whose that fd is by
    # swapping its own in for a moment: a signal in that moment must still
    # reach the loop, once.  Real-time signals queue, a byte each.
    sig = signal.SIGRTMIN + 3
    ctx = launch("sleep", {0: ("30",)}, log_dir=tmp_path)
    loop = asyncio.new_event_loop()
    heard: list[int] = []
    sent = 0
    # How many the loop has heard, for the sender to read.
    counter = tmp_path / "heard"
    counter.write_bytes(bytes(8))
    with open(counter, "r+b") as f:
        heard_count = mmap.mmap(f.fileno(), 8)

    def on_signal() -> None:
        heard.append(sig)
        struct.pack_into("q", heard_count, 0, len(heard))

    async def main() -> None:
        nonlocal sent
        # Sent from another process, a byte each, at about the pace the loop
        # reads them, and never more than 64 ahead of what it has heard: its
        # wake-up socket holds a few hundred one-byte writes, and CPython
        # drops what does not fit (a loop held up on a busy machine, not the
        # swap).  Signals the swap lost are never heard: past 64 of them the
        # sender gives up (status 3).
        sender = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""\
            import mmap, os, struct, sys, time
            with open({str(counter)!r}, "r+b") as f:
                heard = mmap.mmap(f.fileno(), 8)
            for i in range(2000):
                deadline = time.monotonic() + 20
                while i - struct.unpack_from("q", heard, 0)[0] >= 64:
                    if time.monotonic() > deadline:
                        sys.exit(3)
                    time.sleep(0.0005)
                os.kill({os.getpid()}, {int(sig)})
                time.sleep(0.0003)
            """)])
        try:
            while sender.poll() is None:
                # Short waits, so that the swaps take much of the time
                # (0 only polls: no swap).
                for _ in range(20):
                    assert ctx.wait(1e-5) is None
                await asyncio.sleep(0)  # the loop reads its wake-up fd
        finally:
            sender.kill()
            sender.wait()
        sent = 2000 if sender.returncode == 0 else -1
        deadline = time.monotonic() + 10
        while len(heard) < sent and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # and nothing more

    try:
        loop.add_signal_handler(sig, on_signal)
        loop.run_until_complete(main())
    finally:
        loop.close()  # (its handler gone: SIG_DFL would end pytest on a straggler)
        signal.signal(sig, signal.SIG_IGN)
        ctx.close()
        heard_count.close()
    assert sent == 2000
    assert len(heard) == sent
    assert signal.set_wakeup_fd(-1) == -1



# The poll backend (no pidfd: kernels before 5.3, TORCHMP_BACKEND=poll) learns
# of exits from its SIGCHLD handler.  A program can take SIGCHLD from it: a
# handler of its own installed later, or the signal blocked in every thread.
# The exits must still be seen, within the loop's own looks (once a second,
# then every 0.1 s while SIGCHLD is taken), by a context's wait(),
# torchmp.run and run_async; the program's handler keeps getting the signal.
SIGCHLD_TAKEN = """
    import asyncio, json, signal, sys, tempfile, time
    how = sys.argv[1]
    if how == "blocked":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    import torchmp
    got = []
    ctx = torchmp.start_processes("c", "sleep", {0: ("0.2",)}, {0: {}},
                                  torchmp.DefaultLogsSpecs(log_dir=tempfile.mkdtemp()))
    if how == "replaced":
        signal.signal(signal.SIGCHLD, lambda *_: got.append(1))
    t0 = time.monotonic()
    result = ctx.wait(10)
    took = {"wait": time.monotonic() - t0}
    ctx.close()
    assert result is not None and not result.is_failed(), result
    t0 = time.monotonic()
    assert torchmp.run(["sleep", "0.2"], timeout=10).returncode == 0
    took["run"] = time.monotonic() - t0
    t0 = time.monotonic()
    assert asyncio.run(torchmp.run_async(["sleep", "0.2"], timeout=10)).returncode == 0
    took["run_async"] = time.monotonic() - t0
    print(json.dumps({"took": took, "handled": len(got)}))
"""


@pytest.mark.parametrize("how", ["replaced", "blocked"])
def test_poll_backend_sees_exits_when_the_program_takes_sigchld(how):
    res = run_launcher(SIGCHLD_TAKEN.replace("sys.argv[1]", repr(how)), env={"TORCHMP_BACKEND": "poll"})
    assert res.returncode == 0, res.stderr.decode()
    seen = json.loads(res.stdout)
    # 0.2 s of sleep, plus the look (1 s for the context, taken while it
    # waited; 0.1 s after), plus a loaded machine's slack; before, the wait
    # ran to its 10 s and run() timed out.
    for what, seconds in seen["took"].items():
        assert seconds < 3.0, (what, seconds)
    if how == "replaced":
        assert seen["handled"] >= 3, "the program's own SIGCHLD handler was not called for each exit"


IGNORED_SIGCHLD = """
    import asyncio, json, os, signal, tempfile
    import torchmp
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    log_dir = tempfile.mkdtemp()
    errors = {}
    for what, start in (
            ("context", lambda: torchmp.start_processes("c", "true", {0: ()}, {0: {}},
                                                        torchmp.DefaultLogsSpecs(log_dir=log_dir))),
            ("run", lambda: torchmp.run(["true"])),
            ("run_async", lambda: asyncio.run(torchmp.run_async(["true"])))):
        try:
            start()
        except ChildProcessError as e:
            errors[what] = [e.errno, str(e)]
    print(json.dumps({"errors": errors, "log_dir": os.listdir(log_dir)}))
"""


def test_an_ignored_sigchld_is_refused_before_anything_starts():
    # With SIGCHLD ignored the kernel reaps every child at its exit, status
    # and all: no exit could be told (before, a rank "failed" with 255 and a
    # misleading reason, and run() raced between 255 and ProcessLookupError).
    # A clear error, before a directory or a process exists.
    res = run_launcher(IGNORED_SIGCHLD)
    assert res.returncode == 0, res.stderr.decode()
    seen = json.loads(res.stdout)
    assert sorted(seen["errors"]) == ["context", "run", "run_async"], seen
    for errnum, message in seen["errors"].values():
        assert errnum == errno.ECHILD and "SIGCHLD is ignored in this process" in message, message
    assert seen["log_dir"] == []
