"""The entry point of ``torchmp run`` (see :mod:`torchmp.cli`): parse, check
the command, set up torchmp's logging, the subreaper and the signal
handlers, then run the job and return its exit status."""
from __future__ import annotations

import errno
import logging
import os
import signal
import sys
from collections.abc import Sequence

from torchmp import _console, _core, _escapees
from torchmp._launch.exec import resolve_executable
from torchmp._signals import (
    SignalException,
    close_despite_interrupts,
    finish_despite_interrupts,
    install_launcher_handlers,
)
from torchmp.cli.console import say, settle_console
from torchmp.cli.exit_codes import exit_code_for_signal
from torchmp.cli.job import Job
from torchmp.cli.logdir import SetupError
from torchmp.cli.plan import PROG, Plan, UsageError, build_parser, split_command

__all__ = ["main"]

logger = logging.getLogger("torchmp.cli")


# The handler _configure_logging added (main() may run more than once in a
# process, e.g. in tests: one handler, not one per run).
_cli_handler: logging.Handler | None = None


def _configure_logging() -> None:
    """torchmp's log records (fail-fast's "Sending process N closing signal
    SIGTERM", ...) go to stderr through the workers' console: never
    blocking, never inside a worker's line."""
    global _cli_handler
    log = logging.getLogger("torchmp")
    if _cli_handler is None or _cli_handler not in log.handlers:
        handler = _console.ConsoleHandler()
        handler.setFormatter(logging.Formatter("torchmp: %(message)s"))
        log.addHandler(handler)
        _cli_handler = handler
    log.setLevel(logging.WARNING)
    log.propagate = False


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """Entry point of ``torchmp run``; returns the exit status.

    A console (stdout or stderr) that is closed or gone is dropped, not an
    error: the exit status is the one a healthy console would have got.
    """
    try:
        try:
            return _main(argv, prog)
        finally:
            settle_console()
    except SignalException as e:
        # A signal _main's own handling did not take: during the last
        # cleanup or the last flush (the job over, its ranks gone), or
        # before the launch.  The exit a signal gives, not a traceback and 1.
        return exit_code_for_signal(e)


def _main(argv: Sequence[str] | None, prog: str) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    options, command = split_command(argv)
    args = parser.parse_args(options)
    if command is not None:
        # Options first, then '--' and the command; a command started before
        # '--' keeps the '--' and what follows as its own arguments.
        args.command = (args.command + ["--"] + command) if args.command else command
    try:
        plan = Plan(args, args.command)
    except UsageError as e:
        parser.error(str(e))
    # SIGCHLD ignored (SIG_IGN, inherited from whatever started us) makes
    # the kernel reap every child at its exit, status and all: no rank's
    # exit could be told.  This process is torchmp run's own; the default
    # goes back before the I/O thread (whose poll backend chains to it).
    if _core.children_reaped_at_exit():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    # The I/O thread from here on: everything torchmp run says goes through
    # its consoles, so a stalled stderr never blocks it, from the first line.
    try:
        _core.backend()
    except OSError:
        pass  # the launch reports it

    # A command that cannot be found or run: the shell's 127/126, before
    # anything is created (PATH as the workers will see it).
    try:
        resolve_executable(plan.command[0], plan.user_env)
    except OSError as e:
        say(f"error: cannot run {plan.command[0]!r}: {e.strerror or e}")
        return 127 if isinstance(e, FileNotFoundError) else 126

    if plan.slurm_note:
        say(plan.slurm_note)
    _configure_logging()
    run = Job(plan)
    try:
        # An orphaned descendant of a rank comes here, not to pid 1: found
        # and stopped with the ranks (_escapees).
        _escapees.make_subreaper()
    except OSError as e:
        run.escaped = None
        # A build without the setting (the portable one) says so in its
        # docs, not in every run; a kernel that refuses it is news.
        if e.errno != errno.ENOSYS:
            say(f"cannot catch processes that leave their rank's process group: {e.strerror or e}")
    run.caught = install_launcher_handlers(plan.forward_signals, plan.report_signal)  # before the first worker exists
    run.install_report_handler()
    try:
        try:
            run.launch()
            run.wait()
            while run.restart_due():
                run.restart()
                run.launch()
                run.wait()
        except SignalException as e:
            run.shut_down(e)
        except SetupError as e:
            say(f"error: {e}")
            return 1
        except OSError as e:
            # exec failed after all (e.g. ENOEXEC), or a log file, a pipe or
            # fork failed: nothing is left running (start_processes
            # reaped what it had started).
            say(f"error: {e}")
            if run.ctx is None and e.filename is not None and \
                    os.fsdecode(e.filename) in (plan.command[0], os.path.basename(plan.command[0])):
                return 127 if isinstance(e, FileNotFoundError) else 126
            return 1
        run.reports.stop()  # the workers are gone: no report after the summary
        run.stop_escapees()
        run.report()
        return run.exit_code()
    except SignalException as e:
        # A signal while reporting: the workers are already gone or going.
        run.shut_down(e)
        return exit_code_for_signal(e)
    finally:
        if run.ctx is not None:
            close_despite_interrupts(run.ctx, signal.SIGKILL, 0)
        # A signal cuts neither the last escapee sweep nor the report
        # thread's stop short (escapees would outlive the job); it is
        # raised once they are done (main() makes it the exit status).
        in_sweep = finish_despite_interrupts(lambda: run.stop_escapees(grace=0))
        in_stop = finish_despite_interrupts(run.reports.stop)
        interrupted = in_sweep or in_stop
        if interrupted is not None:
            raise interrupted
