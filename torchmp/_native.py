"""The native contexts: workers the I/O thread of :mod:`torchmp._core`
starts, watches and reaps, and everything that talks to it (stream specs,
fd budget, results, close)."""

from __future__ import annotations

import abc
import atexit
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Generator, Mapping, Sized
from typing import Any, cast

from torchmp import _console, _core, _oom, _orphans, _placement, _shutdown
from torchmp._launch import Launch, adopt_interrupted
from torchmp._launch.streams import (
    NO_STREAM, RankStreams, ensure_fd_budget, fd_budget_fits, fd_limits, follow_wanted, followable,
    launch_fds_needed, open_log, prepare_log, surely_fits,
)
from torchmp._inputs import (
    DEFAULT_STDERR_TAIL_LINES, TAIL_BYTES_PER_LINE, check_filters, check_name, check_prefixes,
    normalize_args, normalize_envs,
)
from torchmp._pcontext import PContext, ResourceUsage, RunProcsResult, exitcode, made_without_init
from torchmp._shutdown import KILL_GRACE_SECONDS as KILL_GRACE_SECONDS
from torchmp._shutdown import SHUTDOWN_GRACE_SECONDS
from torchmp._signals import close_despite_interrupts
from torchmp.errors import ProcessFailure, root_cause
from torchmp._tails import file_tail, rank_tail
from torchmp.logs_specs import LogsSpecs

# torch's contexts log as its api module; so do torchmp's.
logger = logging.getLogger("torchmp.api")


def reaped_elsewhere_reason() -> str:
    """Why a child's exit status was lost when torchmp did not reap it."""
    if _core.children_reaped_at_exit():  # ignored since the launch (it is checked then)
        return ("its exit status was lost: SIGCHLD is ignored in this process (SIG_IGN), so the kernel "
                "reaped it at its exit")
    return ("its exit status was lost: another part of this process reaped it "
            "(a waitpid(-1) or SIGCHLD handler outside torchmp)")


class _NativeContext(PContext):
    """A PContext whose workers the native I/O thread starts, watches and
    reaps.  Subclasses only say how each rank is started (``_launch``)."""

    # torchmp extension: a UTC time after the prefix of every teed console line.
    log_line_timestamps: bool = False
    # torchmp extension: the console backlog bound per teed stream, bytes
    # (None: TORCHMP_CONSOLE_BACKLOG, else the default; see _console).
    console_backlog: int | None = None
    # How long siblings get after SIGTERM when a rank fails, before SIGKILL
    # (torch's fixed 30 s by default).
    fail_fast_timeout: float = SHUTDOWN_GRACE_SECONDS
    kill_on_bad_exit: bool = True  # torchmp extension: False, every rank runs to its end
    # torchmp extension: how many of its last stderr lines a failed rank's
    # report carries (0: none; see stderr_tail_bound).
    stderr_tail: int = DEFAULT_STDERR_TAIL_LINES
    # torchmp extension: pass a stderr that is neither teed nor redirected
    # through the I/O thread too (unprefixed), so failures get its tail.
    watch_stderr: bool = False
    # Whether this class closes with torchmp's own close() and _close(), so
    # that wait() may make its quiet close without them (_finish).
    _close_is_plain: bool = True
    # Whether this class asks _clean_exit_problems about ranks that exited 0
    # (the base finds none: its result then needs no look at them).
    _checks_clean_exits: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._close_is_plain = cls.close is PContext.close and cls._close is _NativeContext._close
        cls._checks_clean_exits = cls._clean_exit_problems is not _NativeContext._clean_exit_problems

    def __init__(
        self,
        name: str,
        entrypoint: Callable[..., Any] | str,
        args: dict[int, tuple[Any, ...]],
        envs: dict[int, dict[str, str]],
        logs_specs: LogsSpecs,
        log_line_prefixes: dict[int, str] | None = None,
        numa_options: Any = None,
        duplicate_stdout_filters: list[str] | None = None,
        duplicate_stderr_filters: list[str] | None = None,
        *,
        cpu_affinity: Mapping[int, Any] | None = None,
        mem_bind: str | None = None,
    ) -> None:
        # Every check runs before reify() creates any directory.
        _core.check_exit_statuses_collectable()
        name = check_name(name)
        args = normalize_args(args)
        envs = normalize_envs(envs, len(args))
        # Where each rank runs (numa_options: torch's; cpu_affinity, mem_bind:
        # torchmp's), applied in the child by the native setup.
        self._bindings: dict[int, _core.Binding] = _placement.plan(
            len(args), numa_options, cpu_affinity, mem_bind)
        log_line_prefixes = check_prefixes(log_line_prefixes, len(args))
        duplicate_stdout_filters = check_filters(duplicate_stdout_filters, "duplicate_stdout_filters")
        duplicate_stderr_filters = check_filters(duplicate_stderr_filters, "duplicate_stderr_filters")
        self._launcher = self._launch_for(name, entrypoint, args, envs)
        super().__init__(
            name, entrypoint, args, envs, logs_specs, log_line_prefixes,
            duplicate_stdout_filters, duplicate_stderr_filters,
        )
        self._group: _core.Group | None = None
        self._result: RunProcsResult | None = None
        self._closed = False
        # close() from any thread or signal handler, any number at once: one
        # runs, the others wait for it.  Re-entrant, for a handler that
        # closes the context while its own thread is inside close().
        self._close_lock = threading.RLock()
        self._terminated_by_launcher: set[int] = set()
        self._abandoned: set[int] = set()
        # The last snapshot, kept once close() has released the native group.
        self._final: tuple[int, list[_core.ProcInfo]] | None = None
        # This context's entry in torchmp._orphans, from the start.
        self._registration: _orphans.Registration | None = None
        self._forwarder: _console.Forwarder | None = None
        # Failed ranks' stderr tails, taken from the native group before it
        # is released: (bytes, whether the bound cut older bytes).
        self._tails: dict[int, tuple[bytes, bool]] = {}
        # Exited ranks' ResourceUsage, by rank, with the snapshot it was made
        # from (_usage).
        self._usages: dict[int, tuple[_core.ProcInfo, ResourceUsage]] = {}
        # The clean result drafted while one rank is left (_take_in): that
        # rank, the snapshot the draft was made from, the draft.
        self._draft: tuple[int, list[_core.ProcInfo], RunProcsResult] | None = None
        # The OOM killer's count at start, to name its kills (None: unknown).
        self._oom_watch: _oom.OomWatch | None = None
        # Whether close() found a SIGKILL torchmp did not send, to explain.
        self._oom_suspects = False
        # Hands the group to torchmp._orphans if the program drops this
        # context without closing it.

    @property
    def bindings(self) -> dict[int, _core.Binding]:
        """torchmp extension: where each bound rank runs (its CPUs, and the
        NUMA nodes its memory is bound to); ranks not listed are not bound."""
        return dict(self._bindings)

    # -- what and how to start (subclass) -----------------------------------
    @abc.abstractmethod
    def _launch_for(self, name: str, entrypoint: Any, args: dict[int, tuple[Any, ...]],
                    envs: dict[int, dict[str, str]]) -> Launch:
        """Reject an entrypoint or args this context cannot start; the
        strategy (torchmp._launch) that will start them."""
        raise NotImplementedError

    def _launch(self, group: _core.Group, streams: list[RankStreams]) -> None:
        """Start every rank in ``group``; ``streams[rank]`` is its (stdout,
        stderr) plan for the native core, ``self._bindings`` where each runs.
        A rank that cannot start tears down those started before it
        (SIGKILL) and raises."""
        self._launcher.launch(group, streams, self._bindings, self._abort_launch)

    def _abort_launch(self) -> None:
        self._close(signal.SIGKILL, timeout=KILL_GRACE_SECONDS)

    def _return_values(self) -> dict[int, Any]:
        return dict.fromkeys(range(self.nprocs))

    def _before_release(self, group: _core.Group) -> None:
        """Last chance to take what the native group holds (return values)."""

    def _clean_exit_problems(self, ranks: list[int]) -> dict[int, str]:
        """Why ranks that exited with code 0 still failed, by rank: those
        that did (asked once per result, not per rank: it is on the path
        from the last exit to wait()'s return)."""
        return {}

    def _lost_status_reason(self, rank: int) -> str:
        return self._launcher.lost_status_reason() or reaped_elsewhere_reason()

    # -- start ------------------------------------------------------------
    def _prefix(self, rank: int) -> bytes:
        if self.log_line_prefixes and rank in self.log_line_prefixes:
            text = self.log_line_prefixes[rank]
        else:
            text = f"[{self.name}{rank}]:"
        return os.fsencode(text)

    def _stream_spec(self, rank: int, which: int, consoles: list[Any], backlog: int) -> _core.StreamSpec:
        paths = self.stdouts if which == 0 else self.stderrs
        tees = self._logs_dest.tee_stdouts if which == 0 else self._logs_dest.tee_stderrs
        path = paths.get(rank, "")
        # One byte over the bound: tells whether older bytes were cut.
        tail = self.stderr_tail * TAIL_BYTES_PER_LINE + 1 if which == 1 and self.stderr_tail else 0
        console = consoles[which]
        sink = console.queue if isinstance(console, _console.ObjectConsole) else console
        if path and rank in tees and isinstance(console, _console.ObjectConsole):
            console.add_source(self._prefix(rank), os.path.abspath(path))
        if not path:
            if which == 1 and self.watch_stderr and tail:
                # Shown as it was (no prefix), but through a pipe: the tail
                # is kept as it passes.
                return _core.StreamSpec(_core.STREAM_TEE, -1, sink, b"", False, None, backlog, tail)
            return NO_STREAM
        # Created, truncated and checked now, so a bad path fails before
        # anything starts; opened again by the core only when the rank starts.
        log_path = os.fsencode(prepare_log(path))
        if rank in tees:
            return _core.StreamSpec(_core.STREAM_TEE, -1, sink, self._prefix(rank), self.log_line_timestamps,
                                    log_path, backlog, tail, True,
                                    self._follow_logs and followable(self.stdouts, self.stderrs, rank))
        return _core.StreamSpec(_core.STREAM_FILE, -1, -1, None, False, log_path, open_log=True)

    _fds_per_rank = 1  # launcher fds per rank: the pidfd, plus what a subclass adds
    # Whether teed logs are followed rather than piped (_choose_follow).
    _follow_logs = False

    def _fds_needed(self) -> int:
        return launch_fds_needed(self.stdouts, self.stderrs, self._logs_dest.tee_stdouts,
                                 self._logs_dest.tee_stderrs, self.nprocs, self._fds_per_rank,
                                 bool(self.watch_stderr and self.stderr_tail), self._follow_logs)

    def _choose_follow(self, limits: tuple[int, int, int] | None) -> bool:
        """Whether the teed logs are followed (the worker writes its log, one
        inotify fd says when it grew: no fd per stream) rather than piped (a
        pipe and the log per stream): only when the pipes would not fit the
        hard RLIMIT_NOFILE, unless TORCHMP_TEE_TAIL says otherwise."""
        if not _core.HAVE_FOLLOW or not (self._logs_dest.tee_stdouts or self._logs_dest.tee_stderrs):
            return False
        wanted = follow_wanted()
        if wanted is not None:
            return wanted
        self._follow_logs = False
        return not fd_budget_fits(self._fds_needed(), limits)

    def _ensure_fd_budget(self) -> None:
        if not (self._logs_dest.tee_stdouts or self._logs_dest.tee_stderrs):
            # No pipes or followed logs to choose between: one poll says
            # whether the launch surely fits, and only a launch near the
            # limit counts its fds (docs/profiles.md).
            self._follow_logs = False
            if surely_fits(self._fds_needed()):
                return
        limits = fd_limits()  # a /proc/self/fd scan
        self._follow_logs = self._choose_follow(limits)
        ensure_fd_budget(self._fds_needed(), self.nprocs, limits)

    def _start(self) -> None:
        if self._group is not None:
            raise ValueError("The workers are already started. Most likely start() got called twice.")
        # Before anything is opened: a closed fd 1 or 2 must not become a log.
        _console.claim_std_fds()
        backlog = _console.backlog_bound(self.console_backlog)
        _console.apply_stall()
        # Dropped contexts whose ranks are all gone: their zombies (and fds) go now.
        _orphans.reap_finished()
        self._ensure_fd_budget()
        consoles: list[Any] = [-1, -1]
        if self._logs_dest.tee_stdouts:
            consoles[0] = _console.console_for(0)
        if self._logs_dest.tee_stderrs or (self.watch_stderr and self.stderr_tail):
            consoles[1] = _console.console_for(1)
        objects = [c for c in consoles if isinstance(c, _console.ObjectConsole)]
        opened: list[int] = []
        try:
            filtered: list[tuple[list[bytes] | None, int]] = []
            for filters, path in (
                (self.duplicate_stdout_filters, self._logs_dest.filtered_stdout),
                (self.duplicate_stderr_filters, self._logs_dest.filtered_stderr),
            ):
                if filters:
                    fd = open_log(path)
                    opened.append(fd)
                    filtered.append(([os.fsencode(f) for f in filters], fd))
                else:
                    filtered.append((None, -1))
            streams = [
                (self._stream_spec(rank, 0, consoles, backlog),
                 self._stream_spec(rank, 1, consoles, backlog))
                for rank in range(self.nprocs)
            ]
            if objects:
                self._forwarder = _console.Forwarder(objects)
                _console.track(self._forwarder)
            self._group = _core.Group(self.nprocs, filtered[0][0], filtered[0][1], filtered[1][0], filtered[1][1])
            self._registration = _orphans.watch(self, self.name, self._group, self._launcher, self._forwarder)
            # From before any rank runs: what the OOM killer did meanwhile,
            # for a later SIGKILL that torchmp did not send.
            self._oom_watch = _oom.start_watch()
            self._launch(self._group, streams)
        finally:
            for fd in opened:
                os.close(fd)

    # -- observe ----------------------------------------------------------
    def _snapshot(self) -> tuple[int, list[_core.ProcInfo]]:
        group = self._group
        if self._final is None and group is not None:
            try:
                return group.snapshot()
            except ValueError:
                pass  # released by a close() in another thread: _final is set
        assert self._final is not None
        return self._final

    def pids(self) -> dict[int, int]:
        if self._group is None:
            return {}
        _, ranks = self._snapshot()
        return {rank: info.pid for rank, info in enumerate(ranks) if info.state != _core.PROC_UNSTARTED}

    def _decided(self, ranks: list[_core.ProcInfo]) -> bool:
        # wait() sleeps in Group.wait(until_decided=True), which applies this
        # rule in C after each exit: keep the two the same.
        exited = [info for info in ranks if info.state == _core.PROC_EXITED]
        return len(exited) == self.nprocs or (
            self.kill_on_bad_exit and any(exitcode(info.wait_status) != 0 for info in exited))

    def _poll(self) -> RunProcsResult | None:
        if self._result is not None:
            return self._result
        if self._group is None:
            raise RuntimeError("wait()/poll before start()")
        _, ranks = self._snapshot()
        if not self._decided(ranks) and not self._closed:
            return None
        return self._finish()

    def _finish(self) -> RunProcsResult:
        """The result, once decided: close (fail-fast), collect, settle.

        This runs between the deciding exit and wait()'s return, after a
        sleep that left the caches cold: each Python call on it costs a few
        microseconds (docs/profiles.md, "The finish in fewer calls").  So
        when every rank is done (the common end of wait()), the quiet close
        is made here, not through close() and _close(); a close() of a
        subclass or an instance's own, or the subreaper's sweep, is never
        skipped."""
        ranks = None
        lock = self._close_lock
        if (self._close_is_plain and self.subreaper_id is None and "close" not in self.__dict__
                and lock.acquire(blocking=False)):  # (busy: another thread is closing; close() waits for it)
            try:
                group = self._group
                if group is not None and not self._closed:
                    final = self._close_quiet(group)
                    if final is not None:
                        ranks = final[1]
            except ValueError:
                # As in _close: a signal handler on this thread closed the
                # context meanwhile; the group is down and released.
                if not self._closed:
                    raise
            finally:
                lock.release()
        if ranks is None:
            # Fail-fast: the first failure terminates the siblings, whose
            # exits are recorded too but are never the root cause.
            self.close(timeout=self.fail_fast_timeout)
            ranks = self._snapshot()[1] if self._group is not None else []
        self._result = self._build_result(ranks)
        # Every line is in the log files now.  The consoles: an object
        # console is followed until all of it is written (unless it takes
        # nothing for the stall time); a live fd console is followed until
        # it caught up, a stalled one is not waited for.
        if self._forwarder is not None:
            self._forwarder.follow(_console.stall_time())
        _console.settle_for_result()
        return self._result

    def _build_result(self, ranks: list[_core.ProcInfo]) -> RunProcsResult:
        # (This runs between the deciding exit and wait()'s return, after a
        # sleep that left the caches cold: every step it does not take
        # counts.  See docs/profiles.md.)
        draft = self._draft
        if draft is not None:
            self._draft = None
            left, taken, result = draft
            last = ranks[left]
            # The snapshot hands out an unchanged rank's record as the same
            # object: the list compares by identity first, rank by rank.
            if (last.state == _core.PROC_EXITED and not last.wait_status and not last.out_log_errno
                    and not last.err_log_errno and not self._checks_clean_exits and ranks[:left] == taken[:left]
                    and ranks[left + 1:] == taken[left + 1:]):
                result.resources[left] = self._usage(left, last)
                return result
        resources, unclean = self._resources(ranks)
        if not unclean and not self._checks_clean_exits:
            # The common end: every rank exited 0, its logs whole.
            return made_without_init(RunProcsResult, return_values=self._return_values(), failures={},
                                     stdouts=self.stdouts, stderrs=self.stderrs, resources=resources)
        failures: dict[int, ProcessFailure] = {}
        exited = _core.PROC_EXITED
        clean: list[int] = []
        for rank, info in enumerate(ranks):
            if info.state != exited:
                if info.state == _core.PROC_RUNNING and rank in self._abandoned:
                    failures[rank] = self._abandoned_failure(rank, info.pid)
                continue
            status = info.wait_status
            code = exitcode(status) if status else 0
            if info.out_log_errno or info.err_log_errno:
                self._log_write_failed(rank, info)
            if code == 0:
                clean.append(rank)
            else:
                failures[rank] = self._exit_failure(rank, info, code)
        for rank, problem in self._clean_exit_problems(clean).items():
            failures[rank] = ProcessFailure(
                local_rank=rank, pid=ranks[rank].pid, exitcode=0, error_file=self.error_files.get(rank, ""),
                timestamp_ns=ranks[rank].exit_real_ns)
            if not failures[rank].has_recorded_message:
                failures[rank].message = problem
        if not failures:
            result = RunProcsResult(failures=failures, stdouts=self.stdouts, stderrs=self.stderrs,
                                    resources=resources)
            result.return_values = self._return_values()
            return result
        # torch's order: the ranks that failed by themselves, then those the
        # launcher terminated, each by rank.
        failures = dict(sorted(failures.items(), key=lambda kv: (kv[1].terminated_by_launcher, kv[0])))
        first = failures[root_cause(failures)]
        if first.terminated_by_launcher:
            logger.info("%s: every failed rank was terminated by the launcher (close())", self.name)
        else:
            logger.error(
                "failed (exitcode: %s) local_rank: %s (pid: %s) of %s",
                first.exitcode, first.local_rank, first.pid, self.entrypoint,
            )
        return RunProcsResult(failures=failures, stdouts=self.stdouts, stderrs=self.stderrs, resources=resources)

    def _abandoned_failure(self, rank: int, pid: int) -> ProcessFailure:
        """The failure of a rank close() gave up on, still running."""
        failure = ProcessFailure(
            local_rank=rank, pid=pid, exitcode=-signal.SIGKILL,
            error_file=self.error_files.get(rank, ""),
            timestamp_ns=time.time_ns(), terminated_by_launcher=True)
        if not failure.has_recorded_message:
            failure.message = (f"did not exit {KILL_GRACE_SECONDS:.1f}s after SIGKILL and was abandoned "
                               "(uninterruptible sleep?)")
        return failure

    def _log_write_failed(self, rank: int, info: _core.ProcInfo) -> None:
        """Say which of an exited rank's log files lost output, and why."""
        for what, e in (("stdout", info.out_log_errno), ("stderr", info.err_log_errno)):
            if e:
                logger.error(
                    "writing the %s log of local rank %s failed (%s); output after that point "
                    "is missing from the file", what, rank, os.strerror(e))

    def _exit_failure(self, rank: int, info: _core.ProcInfo, code: int) -> ProcessFailure:
        """The failure of a rank that exited with a status other than 0."""
        # A lost status (the forkserver died with its workers) is a
        # failure of its own, whatever close() sent meanwhile.
        killed = rank in self._terminated_by_launcher and not info.status_lost
        failure = ProcessFailure(
            local_rank=rank,
            pid=info.pid,
            exitcode=code,
            error_file=self.error_files.get(rank, ""),
            timestamp_ns=info.exit_real_ns,
            terminated_by_launcher=killed,
            # A rank torchmp killed has nothing to say about the failure.
            stderr_tail="" if killed else self._stderr_tail(rank),
            cause=None if killed else self._death_cause(info, code),
        )
        if info.status_lost:
            why = self._lost_status_reason(rank)
            logger.error("local rank %s (pid %s): %s", rank, info.pid, why)
            if not failure.has_recorded_message:
                failure.message = why
        return failure

    def _resources(self, ranks: list[_core.ProcInfo]) -> tuple[dict[int, ResourceUsage], int]:
        """The exited ranks' ResourceUsage, by rank, each made once for what
        the snapshot says of it (a later snapshot that says anything else
        makes it anew); and how many ranks did not exit 0 with their log
        files whole (none: a result needs no failure)."""
        known = self._usages
        resources: dict[int, ResourceUsage] = {}
        unclean = 0
        exited = _core.PROC_EXITED
        for rank, info in enumerate(ranks):
            if info.state != exited:
                unclean += 1
                continue
            if info.wait_status or info.out_log_errno or info.err_log_errno:
                unclean += 1
            kept = known.get(rank)
            # (An unchanged rank's record is the same object: see the draft.)
            resources[rank] = kept[1] if kept is not None and kept[0] is info else self._usage(rank, info)
        return resources, unclean

    def _usage(self, rank: int, info: _core.ProcInfo) -> ResourceUsage:
        """The ResourceUsage of an exited rank, as its record says (kept
        with it)."""
        status = info.wait_status
        usage = made_without_init(
            ResourceUsage,
            pid=info.pid,
            exitcode=exitcode(status) if status else 0,
            wall_time=(info.exit_mono_ns - info.start_mono_ns) / 1e9,
            user_time=info.utime_ns / 1e9,
            system_time=info.stime_ns / 1e9,
            max_rss=info.maxrss_kb * 1024,
        )
        self._usages[rank] = (info, usage)
        return usage

    def _take_in(self, ranks: list[_core.ProcInfo]) -> None:
        """What the result will say of the ranks exited so far, made while
        one still runs: their usages, and if they all exited clean, the
        clean result but for the last rank's usage (_build_result completes
        it if that rank exits clean too and nothing else changed)."""
        resources, unclean = self._resources(ranks)
        if unclean != 1 or len(resources) != len(ranks) - 1 or self._checks_clean_exits:
            return
        # The last rank keeps its place in rank order until its usage comes.
        drafted: dict[int, ResourceUsage | None] = {rank: resources.get(rank) for rank in range(len(ranks))}
        left = next(rank for rank, usage in drafted.items() if usage is None)
        self._draft = (left, ranks, made_without_init(
            RunProcsResult, return_values=self._return_values(), failures={}, stdouts=self.stdouts,
            stderrs=self.stderrs, resources=drafted))

    def wait(self, timeout: float = -1, period: float = 1) -> RunProcsResult | None:
        """Like torch's ``wait`` but event-driven: it returns as soon as the
        deciding exit is recorded (``period`` is accepted and ignored).  Safe
        while other threads or a signal handler call ``close()``: a wait
        woken by a close returns the result."""
        if timeout == 0 or self._group is None or self._closed:
            return self._poll()
        deadline = None if timeout < 0 else time.monotonic() + timeout
        group = self._group
        version: int | None = None
        while True:
            if version is None:
                try:
                    # Read before the poll: an exit recorded after it ends the
                    # sleep below at once.
                    version = group.version()
                except ValueError:  # closed meanwhile
                    return self._poll()
                result = self._poll()
                if result is not None:
                    return result
                if self._draft is None and group.left() == 1:
                    # One rank is left already (the only one, or the
                    # others exited before this wait): the sleep below
                    # wakes for its exit only, so take in now.
                    self._take_in(self._snapshot()[1])
            if deadline is None:
                remaining = -1.0
            else:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
            try:
                # Woken for the exit that decides (the last one, or a failure
                # under fail-fast), not for each one before it; the core's
                # word on it saves _poll's snapshot on the way to the result.
                woken = group.wait(remaining, version, True, self.kill_on_bad_exit)
                version = None  # (a timeout: one more look before giving up)
                if woken:
                    # (WAIT_DECIDED: the core applied the rule as it woke;
                    # asking again would be one more call run cold.)
                    if woken == _core.WAIT_DECIDED or group.decided(self.kill_on_bad_exit):
                        return self._result if self._result is not None else self._finish()
                    if not self._closed:
                        # Once, when one rank is left: take in the others'
                        # exits while it runs.  The stdlib's launcher reaps
                        # each rank as it exits, so its path after the last
                        # exit is warm; ours slept through them and ran cold
                        # (docs/profiles.md).  Then back to sleep on what
                        # this look saw, unless it saw the deciding exit
                        # too: nothing would wake that sleep.
                        version, ranks = self._snapshot()
                        if self._decided(ranks):
                            return self._result if self._result is not None else self._finish()
                        self._take_in(ranks)
            except ValueError:
                pass  # closed by another thread or a handler: _poll has the result

    async def wait_async(self, timeout: float | None = None, period: float = 1) -> RunProcsResult | None:
        """``wait`` on an event loop (asyncio's, uvloop, trio): the I/O thread
        wakes the loop through one descriptor when an exit decides the result; a
        fail-fast close() that follows awaits its grace period rather than
        blocking the loop.  ``None`` after ``timeout`` seconds (None or
        negative: no limit; 0: look once)."""
        from torchmp import _aio

        group = self._group
        if group is None or self._result is not None or self._closed:
            return self._poll()
        if not await _aio.wait_group(
                group, lambda: self._result is not None or self._closed or self._decided(self._snapshot()[1]),
                None if timeout is None or timeout < 0 else timeout, self.kill_on_bad_exit):
            return None
        if not self._closed:
            await self._close_async(signal.SIGTERM, self.fail_fast_timeout)
        return self._poll()

    def _wait_for(self, condition: Callable[[list[_core.ProcInfo]], bool],
                  timeout: float | None) -> list[_core.ProcInfo]:
        """Wait until condition(per-rank snapshot) holds, up to timeout
        seconds (None: forever; 0 or less: look once); the last snapshot."""
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        while True:
            group = self._group
            if group is None:
                return []
            version, ranks = self._snapshot()
            if condition(ranks) or self._final is not None:
                return ranks
            remaining = -1.0 if deadline is None else deadline - time.monotonic()
            if deadline is not None and remaining <= 0:
                return ranks
            try:
                group.wait(remaining, version)
            except ValueError:
                pass  # released by a close(): the final snapshot is next

    # -- terminate ----------------------------------------------------------
    def _running(self) -> list[int]:
        _, ranks = self._snapshot()
        return [r for r, info in enumerate(ranks) if info.state == _core.PROC_RUNNING]

    def _unreaped_pids(self) -> list[int]:
        # close() reaped every rank but those it abandoned (still running);
        # a rank reaped at its exit had let its pid go long before.  (Before
        # close(), every started rank, to be safe: a zombie is not told
        # apart from a rank reaped at its exit here.)
        _, ranks = self._snapshot()
        if not self._closed:
            return [info.pid for info in ranks if info.state != _core.PROC_UNSTARTED]
        return [info.pid for info in ranks if info.state == _core.PROC_RUNNING]

    def _send_signal(self, sig: int, ranks: list[int] | None) -> list[int]:
        try:  # (ValueError: released by a close() in another thread meanwhile)
            return [] if self._group is None or self._closed else self._group.send_signal(sig, ranks)
        except ValueError:
            return []

    def _close(self, death_sig: signal.Signals, timeout: float = SHUTDOWN_GRACE_SECONDS) -> None:
        with self._close_lock:
            if self._group is None or self._closed:
                return
            group = self._group
            try:
                if self._close_quiet(group) is not None:
                    return
                killed = _shutdown.run_blocking(self._stop_steps(group, death_sig, timeout), group.wait)
                self._after_stop(group, killed)
            except ValueError:
                # A signal handler on this thread closed the context while
                # this close waited: the group is down and released.
                if not self._closed:
                    raise

    async def _close_async(self, death_sig: signal.Signals, timeout: float) -> None:
        """close() on an event loop: its waits are awaited, not slept."""
        from torchmp import _aio

        while not self._close_lock.acquire(blocking=False):
            await _aio.sleep(0.005)  # another thread is closing: it is done soon
        try:
            if self._group is None or self._closed:
                return
            group = self._group
            try:
                if self._close_quiet(group) is not None:
                    return
                killed = await _aio.drive_group(self._stop_steps(group, death_sig, timeout), group)
                self._after_stop(group, killed)
            except ValueError:
                if not self._closed:
                    raise
        finally:
            self._close_lock.release()

    def _stop_steps(self, group: _core.Group, death_sig: signal.Signals,
                    timeout: float) -> Generator[_shutdown.Wait, None, bool]:
        """The shutdown policy (torchmp._shutdown) over this context's ranks:
        the grace period is each rank's whole group's -- a leader that is a
        shell (sh -c 'python train.py') exits at once on SIGTERM while its
        child is still saving a checkpoint.  Groups whose leader exited stay
        signallable: the leader's zombie pins the group id until reap()."""
        # Workers an interrupted launch started but never got to watch.
        adopt_interrupted(group)
        _, ranks = group.snapshot()
        pids = {rank: info.pid for rank, info in enumerate(ranks) if info.state != _core.PROC_UNSTARTED}
        running = [rank for rank, info in enumerate(ranks) if info.state == _core.PROC_RUNNING]
        self._terminated_by_launcher |= set(running)
        # (Only a rank that exited before this close can have died of a
        # SIGKILL torchmp did not send: the others it terminates.)
        self._oom_suspects = self._oom_watch is not None and self._unsent_sigkills(ranks)

        def on_signal() -> None:  # (after the signal went out: no signal waits for a console)
            for rank in running:
                logger.warning("Sending process %s closing signal %s", pids.get(rank), death_sig.name)

        def on_kill(busy: Sized) -> None:
            if death_sig != signal.SIGKILL:
                for rank in cast("list[int]", busy):
                    logger.warning(
                        "Unable to shutdown process %s via %s, forcefully exiting via SIGKILL",
                        pids.get(rank), death_sig.name)

        # The module's name, read now: tests shorten it.
        ranks_target = _shutdown.Ranks(group, lambda: bool(self._running()))
        return _shutdown.stop(ranks_target, death_sig, timeout, on_signal, on_kill, KILL_GRACE_SECONDS)

    def _after_stop(self, group: _core.Group, killed: bool) -> None:
        if killed:
            running = self._running()
            for rank in running:
                logger.error(
                    "Process %s (local rank %s) did not exit %.1fs after SIGKILL; abandoning it. "
                    "It may be in uninterruptible sleep (wedged on a device); the I/O thread "
                    "reaps it if it ever exits.", self.pids().get(rank), rank, KILL_GRACE_SECONDS)
            self._abandoned = set(running)
        if self._oom_watch is not None:
            # While the zombies still pin the ranks' pids; a look only if
            # there is a SIGKILL to explain.
            self._oom_watch.stop(self._oom_suspects)
        # After reap() no group id of this context is signalled again.
        forkserver_pids = group.reap()
        group.finish_streams()
        self._let_go(group, forkserver_pids, group.snapshot())

    def _close_quiet(self, group: _core.Group) -> tuple[int, list[_core.ProcInfo]] | None:
        """The common close(), the one wait() makes once every rank is done:
        nothing is left to stop, so the shutdown policy is not built and
        the group is closed in one native call (this is on the path from
        the last exit to wait()'s return).  The final snapshot; None, with
        nothing done, if something is left to stop, or a rank died of a
        SIGKILL while the OOM killer is watched (the policy's path asks it,
        before the reap).  Caller holds the close lock."""
        oom_watch = self._oom_watch
        quiet = group.close_quiet(unless_killed=oom_watch is not None)
        if quiet is None:
            return None
        self._oom_suspects = False
        if oom_watch is not None:
            oom_watch.stop(False)
        forkserver_pids, final = quiet
        self._let_go(group, forkserver_pids, final)
        return final

    def _let_go(self, group: _core.Group, forkserver_pids: list[int],
                final: tuple[int, list[_core.ProcInfo]]) -> None:
        """The end of every close(): the ranks are reaped and their streams
        finished; keep what the result needs and release the native group."""
        if forkserver_pids:
            self._launcher.release(forkserver_pids)
        if self._forwarder is not None:
            # What the objects still have to show is written by the
            # forwarding thread; close() does not wait for it.
            self._forwarder.detach()
        # Free the native side now (fds included) rather than whenever the
        # garbage collector gets to this object.
        self._final = final
        if self.stderr_tail:
            # The failed ranks' stderr tails, which the result reports.
            cap = self.stderr_tail * TAIL_BYTES_PER_LINE
            for rank, info in enumerate(final[1]):
                if info.state == _core.PROC_EXITED and info.wait_status != 0:
                    data = group.tail(rank, 1, cap + 1)
                    if data:
                        self._tails[rank] = (data[-cap:], len(data) > cap)
        self._before_release(group)
        # Closed before the release: an interrupt landing in between must not
        # make a retried close() use a released group.
        self._closed = True
        if self._registration is not None:
            _orphans.forget(self._registration)
        group.release()

    def _unsent_sigkills(self, ranks: list[_core.ProcInfo]) -> bool:
        """Whether a rank died of a SIGKILL torchmp did not send."""
        return any(info.state == _core.PROC_EXITED and exitcode(info.wait_status) == -signal.SIGKILL
                   and (rank not in self._terminated_by_launcher or info.status_lost)
                   for rank, info in enumerate(ranks))

    def _death_cause(self, info: _core.ProcInfo, exitcode: int) -> str | None:
        """Why a rank died, where the exit status does not say: a SIGKILL
        torchmp did not send is checked against what the OOM killer did."""
        if exitcode != -signal.SIGKILL or self._oom_watch is None:
            return None
        return self._oom_watch.explain(info.pid, info.exit_mono_ns)

    def _stderr_tail(self, rank: int) -> str:
        """The last stderr lines of a failed rank: as the I/O thread kept
        them, or read from the end of its redirect file."""
        if not self.stderr_tail:
            return ""
        data, truncated = self._tails.get(rank, (b"", False))
        path = self.stderrs.get(rank, "")
        if not data and path and rank not in self._logs_dest.tee_stderrs:
            data, truncated = file_tail(path, self.stderr_tail * TAIL_BYTES_PER_LINE)
        return rank_tail(data, truncated, path, self.stderr_tail, TAIL_BYTES_PER_LINE)

    def _stream_done(self, rank: int, which: int) -> bool:
        if self._group is None:
            return False
        if self._final is not None:
            return True  # close() drained every stream before the release
        try:
            return not self._group.stream_state()[rank][which]
        except ValueError:
            return self._final is not None

    def output_ages(self) -> dict[int, float | None]:
        """Seconds since each rank last wrote to stdout or stderr, as far as
        torchmp can see: teed streams as the bytes pass, redirected ones by
        their log file's modification time; None where it cannot tell (a
        stream written straight to the launcher's terminal) or before the
        first byte."""
        if self._group is None or self._final is not None:
            return {}
        try:
            state = self._group.stream_state()
        except ValueError:
            return {}
        now_mono = time.monotonic_ns()
        now_real = time.time()
        ages: dict[int, float | None] = {}
        for rank, (_out_open, _err_open, out_ns, err_ns) in enumerate(state):
            age: float | None = None
            last = max(out_ns, err_ns)
            if last:
                age = (now_mono - last) / 1e9
            for paths, tees in ((self.stdouts, self._logs_dest.tee_stdouts),
                                (self.stderrs, self._logs_dest.tee_stderrs)):
                path = paths.get(rank, "")
                if path and rank not in tees:
                    try:
                        st = os.stat(path)
                    except OSError:
                        continue
                    file_age = max(0.0, now_real - st.st_mtime)
                    if st.st_size and (age is None or file_age < age):
                        age = file_age
            ages[rank] = age
        return ages


# The grace period those contexts get at exit, as close()'s default.
EXIT_CLOSE_TIMEOUT = SHUTDOWN_GRACE_SECONDS


def _close_live_contexts_at_exit() -> None:
    """Contexts started and not closed yet are closed the normal way (death
    signal, grace period, SIGKILL) if the launcher exits without closing
    them; a context the program dropped became an orphan (torchmp._orphans),
    reaped at the next launch once its ranks are gone, and is stopped here
    like these if it still runs."""
    for ctx in _orphans.live_contexts():
        try:
            close_despite_interrupts(ctx, signal.SIGTERM, EXIT_CLOSE_TIMEOUT)
        except Exception as e:  # pragma: no cover - keep closing the others
            logger.error("closing %s at exit failed: %r", ctx.name, e)
    _orphans.stop_all(signal.SIGTERM, EXIT_CLOSE_TIMEOUT)


atexit.register(_close_live_contexts_at_exit)
# A forked child has no contexts of its own to close at its exit: its
# parent's are its parent's.
os.register_at_fork(after_in_child=_orphans.forget_after_fork)
