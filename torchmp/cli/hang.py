"""Where is each rank?  The hang report of ``torchmp run``.

A report is a table, one row per rank, read from ``/proc`` without touching
the workers (stdlib only: psutil is not a run-time dependency)::

    rank    pid  state     cpu    rss       last output  wchan
       0  41721  sleeping  0.02s   9.6 MiB  5.0s ago     anon_pipe_read
       1  41722  running   4.98s   9.5 MiB  5.0s ago     -
       2  41723  sleeping  0.02s   9.4 MiB  5.0s ago     hrtimer_nanosleep

``cpu`` is the CPU time (user + system) the rank used since the previous
report (since it started, in the first); ``wchan`` is the kernel function it
sleeps in (``/proc/<pid>/wchan``; ``-`` when it is not waiting).  Where
``py-spy`` is installed, the Python stack of every Python process in each
rank's process group follows the table (``py-spy dump``, run in parallel,
each with a time limit).

The pieces are the samples of :mod:`torchmp._procfs` (plain functions over
``/proc`` text), a formatter (:func:`format_table`),
:class:`HangWatch`, which keeps what a report needs from the previous one
(CPU times, the report count) and decides when a job that went silent gets
a report by itself (once per silence, re-armed by new output), and
:class:`ReportThread`, which makes the reports whatever the launcher's main
thread is doing -- also while it shuts the job down, when a rank that does
not stop is what one wants to see (ranks that have exited are left out).
"""

from __future__ import annotations

import math
import os
import select
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import FrameType
from typing import Any

from torchmp._procfs import RankSample, sample, state_name

__all__ = ["HangWatch", "ReportThread", "format_table", "output_ages", "py_spy_dumps"]

_MIB = 1024 * 1024
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

#: How long each ``py-spy dump`` may take (they run in parallel).
PY_SPY_TIMEOUT = 5.0

def _format_rss(nbytes: int) -> str:
    return f"{nbytes / _MIB:.1f} MiB"


def _format_age(age: float | None) -> str:
    return "-" if age is None else f"{age:.1f}s ago"


def format_table(rows: Sequence[tuple[int, RankSample | None, float | None, float | None]]) -> str:
    """The report's table: per row (rank, sample or None when the rank has
    no process, CPU seconds to show, seconds since its last output).  Columns
    are aligned as in ``torchmp run``'s summary table."""
    header = ("rank", "pid", "state", "cpu", "rss", "last output", "wchan")
    cells = []
    for rank, s, cpu, age in rows:
        if s is None:
            cells.append((str(rank), "-", "not started", "-", "-", _format_age(age), "-"))
        elif not s.state:
            cells.append((str(rank), str(s.pid), "gone", "-", "-", _format_age(age), "-"))
        else:
            cells.append((str(rank), str(s.pid), state_name(s.state),
                          "-" if cpu is None else f"{cpu:.2f}s", _format_rss(s.rss),
                          _format_age(age), s.wchan))
    widths = [max(len(r[i]) for r in (header, *cells)) for i in range(len(header))]
    left = {2, 5, 6}  # state, last output and wchan read better left-aligned

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip()

    return "\n".join([line(header), *(line(c) for c in cells)]) + "\n"


def output_ages(ctx: Any, now_real: float | None = None) -> dict[int, float | None]:
    """Seconds since each rank last wrote a line, as far as the launcher can
    tell: the context's ``output_ages()`` (lines that passed through it)
    where it has one, and the modification time of the rank's non-empty log
    files (streams written straight to a file).  None where neither tells."""
    getter = getattr(ctx, "output_ages", None)
    ages: dict[int, float | None] = {}
    if callable(getter):
        try:
            ages = dict(getter())
        except (OSError, ValueError):
            ages = {}
    now = time.time() if now_real is None else now_real
    stdouts: Mapping[int, str] = getattr(ctx, "stdouts", {}) or {}
    stderrs: Mapping[int, str] = getattr(ctx, "stderrs", {}) or {}
    for rank in set(stdouts) | set(stderrs) | set(ages):
        age = ages.get(rank)
        for path in (stdouts.get(rank, ""), stderrs.get(rank, "")):
            if not path:
                continue
            try:
                st = os.stat(path)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode) or not st.st_size:
                continue  # /dev/null (--log-dir /dev/null), or nothing written yet
            file_age = max(0.0, now - st.st_mtime)
            if age is None or file_age < age:
                age = file_age
        ages[rank] = age
    return ages


class HangWatch:
    """What the reports of one job remember, and when a silent job gets one.

    ``after`` (``--hang-report-after``): once no rank has written anything
    for that many seconds, :meth:`check` says a report is due -- once per
    silence: the next one only after new output and another ``after``
    seconds without any.
    """

    def __init__(self, after: float | None, started: float) -> None:
        self.after = after
        self.started = started        # time.monotonic() of the launch
        self.count = 0
        self._cpu_ticks: dict[int, int] = {}
        self._last_report: float | None = None
        self._armed = True
        self._mark = 0.0              # the newest output when the last silence report was due

    def newest_output(self, ages: Mapping[int, float | None], now: float) -> float:
        """Monotonic time of the newest output of any rank (the launch if none)."""
        known = [a for a in ages.values() if a is not None]
        return max(self.started, now - min(known)) if known else self.started

    def check(self, ages: Mapping[int, float | None], now: float) -> tuple[bool, float]:
        """(a report is due now, seconds until the next check; -1: none needed)."""
        if self.after is None:
            return False, -1.0
        newest = self.newest_output(ages, now)
        if not self._armed:
            # Re-armed by output newer than the silence that was reported
            # (half a period of slack against clock jitter in the ages).
            if newest <= self._mark + self.after / 2:
                return False, self.after
            self._armed = True
        due = newest + self.after
        if now >= due:
            self._armed = False
            self._mark = newest
            return True, self.after
        return False, due - now

    def report(self, name: str, reason: str, pids: Mapping[int, int], ranks: Iterable[int],
               global_rank: Callable[[int], int], ages: Mapping[int, float | None], now: float,
               proc: str = "/proc") -> str:
        """Sample every rank and return the report's title and table.  Ranks
        that have exited (a zombie or gone: during a shutdown, most of them)
        are left out of the table; the title says how many are still running."""
        self.count += 1
        rows: list[tuple[int, RankSample | None, float | None, float | None]] = []
        total = exited = 0
        for local in ranks:
            total += 1
            pid = pids.get(local)
            if pid is None:
                rows.append((global_rank(local), None, None, ages.get(local)))
                continue
            s = sample(pid, proc)
            if s.state in ("", "Z", "X", "x"):
                exited += 1
                continue
            cpu = None
            if s.state:
                cpu = (s.cpu_ticks - self._cpu_ticks.get(pid, 0)) / _CLK_TCK
                self._cpu_ticks[pid] = s.cpu_ticks
            rows.append((global_rank(local), s, cpu, ages.get(local)))
        since = ("since the start" if self._last_report is None
                 else f"since report {self.count - 1}, {now - self._last_report:.1f}s ago")
        self._last_report = now
        if any(a is not None for a in ages.values()):
            last = f"last output {now - self.newest_output(ages, now):.1f}s ago"
        else:
            last = "no output seen"
        running = f"{total - exited} of {total} ranks still running, " if exited else ""
        title = (f"torchmp: hang report {self.count} of {name} ({reason}), "
                 f"{now - self.started:.1f}s after start, {running}{last}; cpu: {since}\n")
        return title + format_table(rows)


# ---------------------------------------------------------------------------
# The thread that makes the reports


class ReportThread:
    """Makes the hang reports of a run on a thread of its own, so that a
    report asked for at any moment gets made: while the run loop sleeps in
    the context's wait, and while the launcher is shutting down (the
    fail-fast grace, the grace after a SIGTERM), when the main thread is
    busy in ``close()``.

    The report signal reaches it through :func:`signal.set_wakeup_fd`: the
    interpreter's C-level handler writes the signal's number into a pipe
    the moment the signal arrives, whatever the main thread is doing -- no
    Python handler, frame or exception is involved in the wake-up.  The
    Python-level handler for the signal only has to exist (and does
    nothing).  The silence timer is the thread's own poll timeout.

    ``due(asked)`` makes the reports that are due (``asked``: the signal
    came) and returns the seconds until it must be called again (-1: only
    when the signal comes).  The signals in ``forward`` reach the thread the
    same way, and ``forward_one(sig)`` is called for each that came, once
    per delivery, before the reports.  Usage, on the main thread::

        reports = ReportThread(signal.SIGUSR2, due)
        reports.arm()        # before the launch: signals are caught from now
        reports.start()      # once there is something to report on
        ...
        reports.stop()       # a report in progress is finished first
    """

    def __init__(self, signum: int | None, due: Callable[[bool], float], forward: Sequence[int] = (),
                 forward_one: Callable[[int], None] | None = None) -> None:
        self.signum = signum
        self._due = due
        self.forward = tuple(forward)
        self._forward_one = forward_one
        self._read_fd = self._write_fd = -1
        self._previous_wakeup_fd = -1
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._catching = False
        self._asks = False

    def arm(self, catch_signal: bool = True) -> None:
        """Make the wake-up pipe and install the (empty) handlers of the
        forwarded signals and, with catch_signal, of the report signal, and
        the pipe as the wake-up fd; main thread only.  Signals that arrive
        before start() wait in the pipe."""
        if self._read_fd >= 0:
            return
        self._read_fd, self._write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        # The wake-up fd hears every signal with a Python handler: the report
        # signal asks only if it is ours (not start_processes' to stop the job).
        self._asks = catch_signal and self.signum is not None
        caught = ([self.signum] if self.signum is not None and self._asks else []) + list(self.forward)
        if caught:
            for sig in caught:
                signal.signal(sig, _wake_only)
            self._previous_wakeup_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
            self._catching = True

    def start(self, hold: Sequence[int] = ()) -> None:
        """Start the thread (once).  The signals in ``hold`` -- those whose
        handlers raise, e.g. SignalException -- are blocked meanwhile: an
        exception raised inside threading.Thread.start may leave a thread
        that never starts, or one that starts and dies at once.  Held, such
        a signal is handled when start() returns, the thread running (the
        thread keeps them blocked: they are the main thread's).  This needs
        every other thread to block them too, as torchmp's I/O thread does."""
        if self._read_fd < 0 or self._thread is not None:
            return
        try:
            # In the try: a handler may raise in this very call, signals blocked.
            signal.pthread_sigmask(signal.SIG_BLOCK, hold)
            self._thread = threading.Thread(target=self._run, name="torchmp-hang-reports", daemon=True)
            self._thread.start()
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, hold)

    def _run(self) -> None:
        asked = False
        while not self._stopping:
            timeout = self._due(asked)
            asked = False
            ready = select.poll()
            ready.register(self._read_fd, select.POLLIN)
            if not ready.poll(-1 if timeout < 0 else max(1, math.ceil(timeout * 1000))):
                continue
            try:
                data = os.read(self._read_fd, 4096)
            except BlockingIOError:
                continue
            if self._forward_one is not None:
                for sig in data:
                    if sig in self.forward:
                        self._forward_one(sig)
            asked = self._asks and self.signum is not None and self.signum in data

    def stop(self, timeout: float = PY_SPY_TIMEOUT + 5) -> None:
        """Stop the thread (after the report it is making, waiting at most
        timeout seconds) and give the wake-up fd back; main thread only."""
        if self._read_fd < 0:
            return
        self._stopping = True
        try:
            os.write(self._write_fd, b"\0")
        except OSError:
            pass  # full: the thread has a wake-up to read anyway
        if self._thread is not None:
            try:
                self._thread.join(timeout)
            except RuntimeError:
                # Its start() was cut short (an exception from a signal
                # handler): it never ran, or it has yet to reach _run, where
                # _stopping ends it before it touches the pipe.
                pass
        if self._catching:
            replaced = signal.set_wakeup_fd(self._previous_wakeup_fd)
            if replaced != self._write_fd:
                signal.set_wakeup_fd(replaced)  # someone else's since ours: leave it
            self._catching = False
        # Forgotten before they are closed: a handler raising between the two
        # closes must not leave a number that the next stop() closes again
        # (by then, maybe someone else's file).
        read_fd, write_fd = self._read_fd, self._write_fd
        self._read_fd = self._write_fd = -1
        try:
            if self._thread is None or not self._thread.is_alive():
                # (Never closed under a thread still polling it: the number
                # could be reused before its poll returns.)
                os.close(read_fd)
        finally:
            os.close(write_fd)


def _wake_only(signum: int, frame: FrameType | None) -> None:
    """The Python handler of the report signal and the forwarded ones:
    nothing to do, the wake-up fd has already woken the report thread."""


# ---------------------------------------------------------------------------
# py-spy


def py_spy_dumps(pids: Sequence[int], timeout: float = PY_SPY_TIMEOUT,
                 py_spy: str | None = None) -> dict[int, str]:
    """``py-spy dump --pid P`` for each pid, all at once, each cut off after
    ``timeout`` seconds; pid -> what it printed (or why there is nothing).
    Empty if py-spy is not installed."""
    exe = py_spy or shutil.which("py-spy")
    if exe is None or not pids:
        return {}
    running: list[tuple[int, subprocess.Popen[bytes], Any]] = []
    out: dict[int, str] = {}
    try:
        for pid in pids:
            # A file, not a pipe: a big dump never waits for us to read it.
            sink = tempfile.TemporaryFile()
            try:
                p = subprocess.Popen([exe, "dump", "--pid", str(pid)], stdin=subprocess.DEVNULL,
                                     stdout=sink, stderr=subprocess.STDOUT)
            except OSError as e:
                sink.close()
                out[pid] = f"py-spy could not be started: {e}"
                continue
            running.append((pid, p, sink))
        deadline = time.monotonic() + timeout
        for pid, p, sink in running:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
                note = "" if p.returncode == 0 else f"(py-spy exited with {p.returncode})\n"
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                note = f"(py-spy gave no answer within {timeout:g}s)\n"
            sink.seek(0)
            out[pid] = sink.read().decode("utf-8", "replace") + note
    finally:
        for _, p, sink in running:
            if p.poll() is None:
                p.kill()
                p.wait()
            sink.close()
    return out
