"""``torchmp run``: launch ``n`` copies of a command on this host.

::

    torchmp run -n 4 -- python train.py --epochs 3

starts four copies of ``python train.py --epochs 3`` through
:func:`torchmp.start_processes`, each with the environment ``torchrun
--standalone`` would give it (``LOCAL_RANK``, ``RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` on a free port, ...).
By default every line a worker writes goes to its log file and, prefixed
with ``[{name}{rank}]:``, to the console.  The first failing rank stops the
others (fail-fast), the torchelastic failure report is printed, and an
end-of-run summary table (rank, pid, exit, wall time, CPU time, max RSS) goes
to stderr.

Exit status (as ``srun``):

==================================  ==========================================
what happened                       exit status
==================================  ==========================================
every rank exited 0                 0
a rank failed                       the root-cause rank's exit code, or
                                    128 + N if signal N killed it
``torchmp run`` got signal N        128 + N (after terminating the workers)
                                    unless it forwards N (see below)
``--time-limit`` reached            124 (a hang report, then the shutdown)
bad usage (nothing started)         2
the log directory cannot be made    1 (nothing started)
the command cannot be found         127 (126: found but not executable)
==================================  ==========================================

Log files are laid out as ``torchrun``'s:
``{log_dir}/{run_id}_<random>/attempt_0/{local_rank}/{stdout.log,stderr.log,error.json}``
(``attempt_K`` for restart K of ``--max-restarts``).

A console that is closed or gone (``| head -1``, a terminal that went away)
is not an error: it is dropped -- its fd is pointed at ``/dev/null`` -- while
the log files stay complete and the exit status stays the workers'.

Signals: SIGTERM, SIGINT, SIGHUP and SIGQUIT are passed on to every rank's
process group, SIGKILL after ``--shutdown-timeout``; the signals of
``--forward-signals`` (default SIGUSR1) are passed on and the job goes on;
any other signal that would kill ``torchmp run`` stops the ranks the normal
way (SIGTERM, grace, SIGKILL) and prints the report before it exits 128 + N.

Where is each rank of a job that hangs?  ``kill -USR2 <pid of torchmp run>``
prints a table (pid, state, CPU time, RSS, seconds since its last output,
kernel wait channel) per rank without stopping anything, plus each Python
rank's stack where ``py-spy`` is installed; ``--hang-report-after S`` prints
it by itself once no rank has written anything for S seconds (see
:mod:`torchmp.cli.hang`).  Python ranks run with ``PYTHONFAULTHANDLER=1`` (unless
it is set already, or ``--no-faulthandler``), so a native crash shows the
Python stack in the rank's stderr.

The package: :mod:`~torchmp.cli.main` (the entry point), :mod:`~torchmp.cli.plan`
(the parser and the launch plan), :mod:`~torchmp.cli.job` (a running job: launch,
wait, restarts, shutdown, reports), :mod:`~torchmp.cli.logdir` (where the log files go),
:mod:`~torchmp.cli.hang` (the hang report),
:mod:`~torchmp.cli.console` (what torchmp run writes itself),
:mod:`~torchmp.cli.report` (the summary table) and :mod:`~torchmp.cli.exit_codes`.
"""
from __future__ import annotations

from torchmp.cli.main import main
from torchmp.cli.plan import build_parser

__all__ = ["build_parser", "main"]
