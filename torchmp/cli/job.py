"""A running ``torchmp run`` job: the launch (and the restarts), the wait with
its time limit, ``--wait`` and escapee sweeps, the hang reports, the
forwarded signals, the shutdown and the end-of-run report."""
from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
from typing import Any

from torchmp import _console, _core, _escapees
from torchmp._signals import (
    SignalException,
    close_despite_interrupts,
    handled_signals,
    signal_name,
)
from torchmp._procfs import python_pids_by_group
from torchmp.api import start_processes
from torchmp.cli import hang
from torchmp.cli.console import say, show
from torchmp.cli.exit_codes import TIME_LIMIT_EXIT, exit_code_for, signal_number
from torchmp.cli.logdir import AnnouncingLogsSpecs, SetupError, describe_mkdir_error
from torchmp.cli.plan import Plan, free_port, where_ranks_run
from torchmp.cli.report import format_summary, summary_reason
from torchmp.errors import ChildFailedError

__all__ = ["ESCAPEE_SWEEP_SECONDS", "Job"]

#: How often a running job's re-parented processes that exited are reaped.
ESCAPEE_SWEEP_SECONDS = 5.0


class Job:
    """One ``torchmp run`` job: its attempts' launches, the wait (time
    limit, --wait, escapee sweeps), the reports and the shutdown."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.ctx: Any = None
        self.result: Any = None
        #: The signal that stopped the run (and the one its workers got).
        self.signal: int | None = None
        self.death_signal = signal.SIGTERM
        #: What install_launcher_handlers caught and the handled signals
        #: (blocked while the workers start).
        self.caught: list[int] = sorted(handled_signals(log_unknown=False))
        self.started = time.monotonic()
        #: The first attempt's start (--time-limit counts from it), and which
        #: attempt this is (--max-restarts).
        self.job_started: float | None = None
        self.attempt = 0
        #: Processes that had left their rank's process group, stopped
        #: (this attempt's; None: torchmp run could not be a subreaper).
        self.escaped: int | None = 0
        self.specs: AnnouncingLogsSpecs | None = None
        self.hang = hang.HangWatch(plan.hang_report_after, self.started)
        # The reports are made on a thread of their own, woken by the report
        # signal or the silence timer, so that the main thread may be
        # anywhere (asleep in the wait, in a fail-fast or a shutdown grace).
        # The forwarded signals reach the same thread the same way.
        self.reports = hang.ReportThread(plan.report_signal, self._reports_due,
                                          plan.forward_signals, self._forward)
        self._py_spy_hint = True
        # One report at a time: the report thread's and the time limit's.
        self._report_lock = threading.Lock()
        #: Whether --time-limit stopped the job, or --wait the last ranks.
        self.timed_out = False
        self.waited_out = False
        #: Where each local rank runs, for --report-bindings (else empty).
        self.bindings: dict[int, str] = {}

    def launch(self) -> None:
        plan = self.plan
        port = plan.master_port if plan.master_port is not None else free_port()
        envs = plan.envs(port, self.attempt)
        log_dir = plan.log_dir_arg
        try:
            if log_dir is None:
                log_dir = tempfile.mkdtemp(prefix="torchmp_")
            # One run directory for every attempt: each has its attempt_K.
            specs = self.specs = self.specs or AnnouncingLogsSpecs(
                log_dir=log_dir, redirects=plan.redirects, tee=plan.tee,
                local_ranks_filter=plan.ranks_filter)
        except OSError as e:  # it makes --log-dir and its parents
            raise SetupError(
                describe_mkdir_error(e, log_dir or tempfile.gettempdir())) from e
        extra: dict[str, Any] = {"console_backlog": plan.console_backlog, "stderr_tail": plan.stderr_tail,
                                 "kill_on_bad_exit": plan.kill_on_bad_exit}
        if plan.timestamps:
            extra["log_line_timestamps"] = True
        if plan.cpu_affinity is not None:
            extra.update(cpu_affinity=plan.cpu_affinity, mem_bind=plan.mem_bind)
        self.started = self.hang.started = time.monotonic()
        if self.job_started is None:
            self.job_started = self.started
        # A signal raised inside start_processes would reach the handlers
        # before self.ctx is set: start_processes would then tear the workers
        # down with its own 30 s grace, not --shutdown-timeout.  Held until
        # the context is ours, it is handled by shut_down like any other.
        # (Workers start with an empty signal mask whatever the launcher's.)
        try:
            # In the try: a pending signal's handler may raise in this very
            # call, the signals blocked already; the finally unblocks them.
            signal.pthread_sigmask(signal.SIG_BLOCK, self.caught)
            self.ctx = start_processes(
                name=plan.name,
                entrypoint=plan.command[0],
                args={r: tuple(plan.command[1:]) for r in range(plan.nproc)},
                envs=envs,
                logs_specs=specs,
                log_line_prefixes=plan.prefixes(),
                start_method=plan.start_method,
                **extra,
            )
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, self.caught)
        if plan.report_bindings:
            self.bindings = where_ranks_run(self.ctx)
            for local, text in self.bindings.items():
                say(f"rank {plan.global_rank(local)} (pid {self.ctx.pids().get(local, '?')}) {text}")

    # -- hang reports -------------------------------------------------------
    def install_report_handler(self) -> None:
        """The report signal (SIGUSR2) asks for a hang report -- unless
        TORCHELASTIC_SIGNALS_TO_HANDLE names it: start_processes then makes
        it stop the job, as asked.  From now on it and the forwarded signals
        are caught; reports (and the silence timer's) and forwarding start
        with the launch (start_reports)."""
        report = self.plan.report_signal
        catch = report is not None and report not in handled_signals()
        if catch or self.hang.after is not None or self.plan.forward_signals:
            self.reports.arm(catch_signal=catch)

    def _forward(self, sig: int) -> None:
        """On the report thread: pass sig on to every running rank's group."""
        self._send(sig, f"got {signal_name(sig)}", "passed it on")

    def _send(self, sig: int, why: str, done: str) -> None:
        """sig to every running rank's group, saying so (``why: done to rank 0, 1``)."""
        try:
            ranks = self.ctx.send_signal(sig)
        except OSError as e:
            say(f"{why}: could not send {signal_name(sig)}: {e.strerror or e}")
            return
        if ranks:
            say(f"{why}: {done} to rank " + ", ".join(str(self.plan.global_rank(r)) for r in ranks))
        else:
            say(f"{why}: no rank left to send {signal_name(sig)} to")

    def start_reports(self) -> None:
        """Make reports from now on (once the context exists)."""
        if self.ctx is not None:
            # Not with a SignalException in the middle of the thread's start.
            self.reports.start(hold=self.caught)

    def _reports_due(self, asked: bool) -> float:
        """On the report thread: make the reports that are due; the seconds
        until the next check (-1: none, only the signal wakes it)."""
        try:
            if asked:
                self._try_report(f"asked by {signal_name(self.plan.report_signal or 0)}")
            if self.hang.after is None:
                return -1.0
            due, next_check = self.hang.check(hang.output_ages(self.ctx), time.monotonic())
            if due:
                self._try_report(f"no output for {self.hang.after:g}s")
            return max(0.01, next_check)
        except Exception as e:
            say(f"hang report failed: {type(e).__name__}: {e}")
            return -1.0

    def _try_report(self, reason: str) -> None:
        # A report is a diagnosis: whatever goes wrong in it, the job goes on.
        try:
            self.hang_report(reason)
        except Exception as e:
            say(f"hang report failed: {type(e).__name__}: {e}")

    def hang_report(self, reason: str) -> None:
        """Print where each rank is (and, with py-spy, its Python stack) to
        stderr and save it in the run's directory; nothing is stopped."""
        with self._report_lock:
            self._hang_report(reason)

    def _hang_report(self, reason: str) -> None:
        plan, ctx = self.plan, self.ctx
        try:
            pids = dict(ctx.pids())
        except (ValueError, RuntimeError):
            pids = {}
        text = self.hang.report(plan.name, reason, pids, range(plan.nproc), plan.global_rank,
                                hang.output_ages(ctx), time.monotonic())
        text += self._stacks(pids)
        attempt_dir = self.specs.attempt_dir if self.specs is not None else None
        if attempt_dir is not None:
            path = os.path.join(attempt_dir, f"hang-report-{self.hang.count}.txt")
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
                             | getattr(os, "O_NOFOLLOW", 0), 0o644)
                with open(fd, "w", encoding="utf-8", errors="replace") as f:
                    f.write(text)
                text += f"torchmp: hang report {self.hang.count} saved in {path}\n"
            except OSError as e:
                text += f"torchmp: hang report {self.hang.count} not saved: {path}: {e.strerror}\n"
        show(text)

    def _stacks(self, pids: dict[int, int]) -> str:
        """``py-spy dump`` of every Python process of every running rank."""
        py_spy = shutil.which("py-spy")
        if py_spy is None:
            hint, self._py_spy_hint = self._py_spy_hint, False
            return ("torchmp: with py-spy installed, hang reports show each Python rank's stack\n"
                    if hint else "")
        groups = python_pids_by_group(pids.values())
        targets = [(local, pid) for local in sorted(pids) for pid in groups.get(pids[local], [])]
        dumps = hang.py_spy_dumps([pid for _, pid in targets], py_spy=py_spy)
        parts = []
        for local, pid in targets:
            dump = dumps.get(pid, "").rstrip("\n")
            parts.append(f"torchmp: py-spy dump of rank {self.plan.global_rank(local)} "
                         f"(pid {pid}):\n{dump}\n")
        return "".join(parts)

    def wait(self) -> None:
        """The context's wait (the report thread makes the hang reports),
        the --signal warning and the --time-limit."""
        self.start_reports()
        plan = self.plan
        deadline = None if plan.time_limit is None else (self.job_started or self.started) + plan.time_limit
        warn_at = None if plan.warn_signal is None or deadline is None else deadline - plan.warn_signal[1]
        # --wait: when the first rank exited 0 (None: not yet), and the
        # rest's deadline.
        first_exit: float | None = None
        stop_rest_at: float | None = None
        # Re-parented processes that exited meanwhile are reaped this often.
        sweep_at = None if self.escaped is None else time.monotonic() + ESCAPEE_SWEEP_SECONDS
        result = None
        while result is None:
            now = time.monotonic()
            if sweep_at is not None and now >= sweep_at:
                self.reap_escapees()
                sweep_at = now + ESCAPEE_SWEEP_SECONDS
            if warn_at is not None and now >= warn_at and plan.warn_signal is not None:
                sig, before = plan.warn_signal
                self._send(sig, f"{before:g}s before the time limit", f"sent {signal_name(sig)}")
                warn_at = None
            if deadline is not None and now >= deadline:
                self.stop_at_time_limit()
                return
            if plan.wait_after_exit is not None and first_exit is None and self._succeeded():
                first_exit = now
                stop_rest_at = now + plan.wait_after_exit
            if stop_rest_at is not None and now >= stop_rest_at:
                self.stop_the_rest()
                return
            due = [t for t in (warn_at, deadline, stop_rest_at, sweep_at) if t is not None]
            timeout = max(0.0, min(due) - now) if due else -1.0
            if plan.wait_after_exit is not None and first_exit is None:
                # Woken by every exit, not only the deciding one.
                self.ctx._wait_for(lambda ranks: self._succeeded(ranks) or self.ctx._decided(ranks),
                                   None if timeout < 0 else timeout)
                result = self.ctx.wait(0)
            else:
                result = self.ctx.wait(timeout)
        self.result = result

    def restart_due(self) -> bool:
        """--max-restarts: whether this attempt failed by itself and may be
        followed by another (not after a signal, the time limit or --wait)."""
        return (self.attempt < self.plan.max_restarts and self.signal is None and not self.timed_out
                and not self.waited_out and self.result is not None and bool(self.result.failures))

    def reap_escapees(self) -> None:
        """While the ranks run: reap what was re-parented here and exited."""
        if self.escaped is not None and self.ctx is not None:
            pids = list(self.ctx.pids().values())
            self.escaped += _escapees.reap_exited(pids, pids)

    def stop_escapees(self, grace: float | None = None) -> None:
        """Stop and reap what left the ranks' process groups (re-parented
        here: torchmp run is a child subreaper), once the ranks are gone."""
        if self.escaped is None or self.ctx is None:
            return
        self.escaped += _escapees.stop(self.ctx._unreaped_pids(), list(self.ctx.pids().values()),
                                       self.plan.shutdown_timeout if grace is None else grace)

    def restart(self) -> None:
        """This attempt's report, then on to the next (launch() starts it)."""
        self.stop_escapees()
        self.report()
        self.escaped = 0 if self.escaped is not None else None
        self.attempt += 1
        say(f"restarting {self.plan.name} (restart {self.attempt} of {self.plan.max_restarts})")
        self.result = None
        self.bindings = {}

    def _succeeded(self, ranks: Any = None) -> list[int]:
        """The local ranks that exited 0 (by themselves: the run goes on)."""
        if ranks is None:
            ranks = self.ctx._snapshot()[1]
        return [r for r, info in enumerate(ranks) if info.state == _core.PROC_EXITED and info.wait_status == 0]

    def stop_the_rest(self) -> None:
        """--wait is over: the normal shutdown for the ranks still running."""
        self.waited_out = True
        say(f"--wait {self.plan.wait_after_exit:g}s after the first rank's exit is over: "
             "stopping the ranks still running")
        close_despite_interrupts(self.ctx, signal.SIGTERM, self.plan.shutdown_timeout)
        self.result = self.ctx.wait(0)

    def stop_at_time_limit(self) -> None:
        """Where each rank is (the hang report), then the normal shutdown."""
        self.timed_out = True
        self._try_report(f"time limit of {self.plan.time_limit:g}s")
        close_despite_interrupts(self.ctx, signal.SIGTERM, self.plan.shutdown_timeout)
        self.result = self.ctx.wait(0)

    def shut_down(self, e: SignalException) -> None:
        """Terminate the workers (with the signal itself if it is a handled
        one, else SIGTERM); a second signal means SIGKILL now."""
        if self.signal is None:
            self.signal = signal_number(e)
            self.death_signal = e.sigval
        if self.ctx is not None:
            self.start_reports()  # a report asked for during the grace is made too
            close_despite_interrupts(self.ctx, e.sigval, self.plan.shutdown_timeout)
            self.result = self.ctx.wait(0)

    def exit_code(self) -> int:
        if self.signal is not None:
            return 128 + int(self.signal)
        if self.timed_out:
            return TIME_LIMIT_EXIT
        if self.result is None or not self.result.failures:
            return 0
        _, first = self._child_failed_error().get_first_failure()
        return exit_code_for(first)

    def _child_failed_error(self) -> ChildFailedError:
        failures = {self.plan.global_rank(local): f for local, f in self.result.failures.items()}
        return ChildFailedError(self.plan.name, failures)

    def terminated(self) -> set[int]:
        """Local ranks torchmp stopped (fail-fast, or the signal it got),
        whatever their exit code."""
        if self.result is None:
            return set()
        ranks = {local for local, failure in self.result.failures.items()
                 if failure.terminated_by_launcher or (
                     self.signal is not None
                     and failure.exitcode in (-self.death_signal, -signal.SIGKILL))}
        # A rank that exits 0 when told to stop is in no failure: the context
        # knows which ranks were still running when it sent the signal.
        ranks.update(getattr(self.ctx, "_terminated_by_launcher", ()))
        return ranks

    def notes(self) -> dict[int, str]:
        notes: dict[int, str] = {}
        if self.result is None:
            return notes
        root = None
        if self.result.failures and self.signal is None and not self.timed_out:
            root = self._child_failed_error().get_first_failure()[1].local_rank
        terminated = self.terminated()
        if self.waited_out and root in terminated:
            root = None  # the ranks --wait stopped caused nothing
        for local in range(self.plan.nproc):
            if local == root:
                notes[local] = "root cause"
            elif local in terminated:
                notes[local] = "terminated by torchmp"
            failure = self.result.failures.get(local)
            if failure is not None and local not in terminated:
                why = summary_reason(failure)
                if why:
                    notes[local] = f"{notes[local]}: {why}" if local in notes else why
        return notes

    def report(self) -> None:
        """The failure report and the summary, after the workers' last lines
        (the console keeps them in order; none of it waits for a console)."""
        elapsed = time.monotonic() - self.started
        if self.signal is not None:
            say(f"got {signal_name(self.signal)}: terminated the workers")
        elif self.timed_out:
            say(f"time limit of {self.plan.time_limit:g}s reached: terminated the workers")
        elif self.result is not None and self.result.failures and not (
                self.waited_out and set(self.result.failures) <= self.terminated()):
            show(self._child_failed_error().format_msg() + "\n")
        if self.plan.summary:
            name = self.plan.name if not self.plan.max_restarts else f"{self.plan.name}, attempt {self.attempt}"
            summary = format_summary(
                name, self.plan.nproc, self.plan.global_rank, self.result,
                self.notes(), self.exit_code(), elapsed,
                self.terminated(), self.bindings or None,
                why=self._why())
            for fd, err in sorted(_console.check_failures().items()):
                summary += (f"torchmp: the console ({'stdout' if fd == 1 else 'stderr'}) could not be written "
                            f"({os.strerror(err)}) and was off from then on; the log files are complete\n")
            show(summary)
        if self.escaped:
            say(f"{self.escaped} process{'es' if self.escaped > 1 else ''} had left their rank's process group "
                 "(setsid, a double fork): stopped after the ranks")

    def _why(self) -> str:
        """What ended the run, for the summary's title ("" for the ranks)."""
        if self.signal is not None:
            return ""
        return "time limit" if self.timed_out else "--wait" if self.waited_out else ""
