"""``torchmp run``'s command line: the parser and the launch plan, every
option checked before anything starts (see :mod:`torchmp.cli`)."""
from __future__ import annotations

import argparse
import os
import re
import socket
import string
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

from torchmp import _console, _slurm
from torchmp._inputs import stderr_tail_bound
from torchmp._shutdown import SHUTDOWN_GRACE_SECONDS
from torchmp._signals import (
    DEFAULT_FORWARD_SIGNALS,
    DEFAULT_REPORT_SIGNAL,
    FORWARD_SIGNALS_VAR,
    REPORT_SIGNAL_VAR,
    check_launcher_signals,
    parse_optional_signal,
    parse_signal,
    parse_signal_list,
)
from torchmp._placement import (
    AFFINITY_MODES,
    MEM_BIND_MODES,
    cpus_of,
    describe as _describe_binding,
    cores as _cores,
    cpu_map as _cpu_map,
    cpus_for_gpu as _cpus_for_gpu,
    numa_nodes as _numa_nodes,
    plan as _plan_bindings,
)
from torchmp._topology import BindingError, Topology
from torchmp.logs_specs import Std, to_map
from torchmp.cli.console import write_console

PROG = "torchmp run"

#: Fields a ``--prefix`` template may use.
PREFIX_FIELDS = ("name", "rank", "local_rank", "pid", "host")
DEFAULT_PREFIX = "[{name}{rank}]:"

#: Set in every rank (unless already set, or --no-faulthandler): CPython then
#: enables faulthandler at startup, so a fatal signal prints the Python stack.
FAULTHANDLER_VAR = "PYTHONFAULTHANDLER"


class UsageError(Exception):
    pass


# ---------------------------------------------------------------------------
# Parsing


class _Parser(argparse.ArgumentParser):
    def _print_message(self, message: str, file: Any = None) -> None:
        # argparse swallows a failed write, but what a block-buffered stdout
        # holds is written by the interpreter's last flush: failing there, it
        # prints "Exception ignored ..." and exits 120 instead of 0 or 2.
        if message:
            write_console(file or sys.stderr, message)

    def error(self, message: str) -> NoReturn:
        # argparse's own format ("usage: ...", "prog: error: ..."), exit code 2.
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = _Parser(
        prog=prog,
        usage=f"{prog} -n N [options] -- COMMAND [ARGS...]",
        description=(
            "Launch N copies of COMMAND on this host, with torchrun's environment "
            "variables, teed and prefixed output, log files, fail-fast, the "
            "failure report and a summary table."
        ),
        epilog=(
            "Exit status: 0 if every rank succeeded; else the root-cause rank's exit "
            "code, or 128+N if it died by signal N (as srun); 128+N if torchmp run "
            "itself got signal N; 2 for bad usage; 127/126 if COMMAND cannot be found/run.  "
            "SIGUSR2 to torchmp run prints where each rank is (a hang report), "
            "stopping nothing; SIGUSR1 is passed on to every rank; any other signal that "
            "would kill it stops the ranks first (then 128+N)."
        ),
    )
    p.add_argument("-n", "--nproc", "--nproc-per-node", dest="nproc", type=int, default=None,
                   metavar="N", help="number of copies (local ranks) to start on this host (required, "
                                     "except in a Slurm job that sets SLURM_GPUS_ON_NODE or "
                                     "SLURM_NTASKS_PER_NODE)")
    p.add_argument("--name", default=None,
                   help="the job's name, used in prefixes and the failure report "
                        "(default: the command's base name)")
    p.add_argument("--log-dir", default=None, metavar="DIR",
                   help="base directory for log files (default: a fresh directory under "
                        f"{tempfile.gettempdir()}); the run's directory is printed to stderr; "
                        f"{os.devnull} writes no files")
    p.add_argument("--redirects", default="0", metavar="SPEC",
                   help="streams written to the log files only: 0=none 1=stdout 2=stderr 3=both, "
                        "or per local rank as '0:3,1:0' (default: 0)")
    p.add_argument("--tee", default=None, metavar="SPEC",
                   help="streams written to the log files and, prefixed, to the console "
                        "(same syntax; default: every stream that is not in --redirects)")
    p.add_argument("--local-ranks-filter", default=None, metavar="RANKS",
                   help="only these local ranks (e.g. '0,2') reach the console; the log files "
                        "are written for every rank")
    p.add_argument("--prefix", default=DEFAULT_PREFIX, metavar="TEMPLATE",
                   help="console line prefix, a str.format template with the fields "
                        "{name} {rank} {local_rank} {pid} {host}; {pid} is the pid of "
                        f"torchmp run itself (the workers do not exist yet) (default: "
                        f"'{DEFAULT_PREFIX}')")
    p.add_argument("--timestamps", action="store_true",
                   help="stamp every teed console line, after its prefix, with the UTC time "
                        "it was read (e.g. 2026-11-29T09:54:05.123Z); the log files keep the "
                        "workers' exact bytes")
    p.add_argument("--console-backlog", default=None, metavar="SIZE",
                   help="how much of each teed stream may wait in memory for a console that "
                        "falls behind (a slow or stalled pipe or terminal); past it the log "
                        "files are the backlog and the console catches up from them (e.g. 16M, "
                        "512K, 0; default 4M, or $TORCHMP_CONSOLE_BACKLOG).  A console that "
                        "takes nothing for $TORCHMP_CONSOLE_STALL seconds (10) has whole lines "
                        "left out, with a marker line saying how many")
    p.add_argument("--stderr-tail", type=int, default=None, metavar="LINES",
                   help="how many of a failed rank's last stderr lines its failure report and "
                        "summary row use when it left no error file (default 20, or "
                        "$TORCHMP_STDERR_TAIL; 0: none)")
    p.add_argument("--start-method", default="spawn", choices=("spawn", "fork", "forkserver"),
                   help="accepted for torchrun compatibility; it only matters for Python "
                        "function entrypoints, and torchmp run starts binaries (fork+exec)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="set an environment variable in every rank (repeatable; applied last, "
                        "so it can override the ones torchmp run sets)")
    p.add_argument("--no-summary", dest="summary", action="store_false",
                   help="do not print the end-of-run summary table")
    p.add_argument("--no-faulthandler", dest="faulthandler", action="store_false",
                   help=f"do not set {FAULTHANDLER_VAR}=1 in the ranks (by default it is set unless "
                        "torchmp run's environment or --env sets it, so a Python rank killed by "
                        "SIGSEGV, SIGABRT, SIGBUS, SIGFPE or SIGILL prints its Python stack to its "
                        "stderr)")
    p.add_argument("--hang-report-after", type=float, default=None, metavar="SECONDS",
                   help="when no rank has written any output for SECONDS, print where each "
                        "rank is (the hang report --hang-report-signal asks for), once per "
                        "silence: again only after new output and another SECONDS of silence")
    p.add_argument("--forward-signals", default=None, metavar="LIST",
                   help="signals torchmp run passes on to the process group of every running "
                        "rank, stopping nothing: comma-separated names or numbers (USR1, SIGUSR2, "
                        f"RTMIN+1), or 'none' (default: USR1, or ${FORWARD_SIGNALS_VAR})")
    p.add_argument("--hang-report-signal", default=None, metavar="SIG",
                   help="the signal that asks torchmp run for a hang report, or 'none' "
                        f"(default: USR2, or ${REPORT_SIGNAL_VAR})")
    p.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="stop the job SECONDS after the launch: a hang report first, then the "
                        "normal shutdown (SIGTERM, --shutdown-timeout, SIGKILL); exit status 124")
    p.add_argument("--signal", dest="warn_signal", default=None, metavar="SIG[@SECONDS]",
                   help="srun's spelling: send SIG to every running rank's process group SECONDS "
                        "(default 60) before --time-limit, so that training can checkpoint")
    p.add_argument("--wait", dest="wait_after_exit", type=float, default=None, metavar="SECONDS",
                   help="srun's --wait: once the first rank has exited successfully, give the "
                        "others SECONDS to finish, then stop them (default: wait for them all)")
    p.add_argument("--kill-on-bad-exit", type=int, default=1, choices=(0, 1), metavar="{0,1}",
                   help="srun's name: 1 (default) a failing rank stops the others (fail-fast); "
                        "0 every rank runs to its end and the report lists every failure")
    p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="torchrun's name: when a rank fails, stop the others and start the whole "
                        "group again, up to N times (each attempt in its own attempt_K directory, "
                        "with TORCHELASTIC_RESTART_COUNT=K); default 0")
    p.add_argument("--shutdown-timeout", type=float, default=SHUTDOWN_GRACE_SECONDS,
                   metavar="SECONDS",
                   help="when torchmp run gets a signal, how long the workers get to exit "
                        f"after it is passed on to them, before SIGKILL (default: {SHUTDOWN_GRACE_SECONDS:g}; "
                        f"the fail-fast shutdown after a rank fails always allows {SHUTDOWN_GRACE_SECONDS:g})")
    p.add_argument("--nnodes", type=int, default=None,
                   help="number of hosts in the job (default: 1, or $SLURM_NNODES in a Slurm job); "
                        "each host runs its own torchmp run with the same "
                        "--master-addr/--master-port")
    p.add_argument("--node-rank", type=int, default=None,
                   help="this host's index in 0..nnodes-1 (default: 0, or $SLURM_NODEID); "
                        "RANK = node_rank * N + LOCAL_RANK")
    p.add_argument("--master-addr", default=None,
                   help="MASTER_ADDR for the ranks (default: 127.0.0.1, or the first host of the "
                        "Slurm job's node list; required if --nnodes > 1)")
    p.add_argument("--master-port", type=int, default=None,
                   help="MASTER_PORT for the ranks (default: a free port on 127.0.0.1, or one "
                        "derived from $SLURM_JOB_ID; required if --nnodes > 1)")
    p.add_argument("--no-slurm", dest="slurm", action="store_false",
                   help="ignore the Slurm job this runs in: take nothing from SLURM_* variables "
                        "(by default, inside a job ($SLURM_JOB_ID) and when none of --nnodes, "
                        "--node-rank, --master-addr, --master-port is given, they come from the "
                        "job, and -n from $SLURM_GPUS_ON_NODE or $SLURM_NTASKS_PER_NODE)")
    p.add_argument("--cpu-bind", default=None, metavar="MODE",
                   help="bind each rank to CPUs (srun's spelling): none; cores (the allowed "
                        "physical cores split evenly among the ranks); numa (each rank on one "
                        "NUMA node's CPUs, ranks spread over the nodes in blocks; srun's ldoms); "
                        "map:LIST (rank i on the i-th CPU of LIST, e.g. map:0,4,8,12; srun's "
                        "map_cpu:LIST); a leading 'verbose,' also reports the bindings")
    p.add_argument("--numa-binding", default=None, choices=AFFINITY_MODES,
                   help="bind local rank i to the CPUs near GPU i, as torchrun --numa-binding "
                        "does (GPUs found in sysfs; CUDA_VISIBLE_DEVICES honoured)")
    p.add_argument("--mem-bind", default=None, choices=MEM_BIND_MODES,
                   help="local: also bind each rank's memory to the NUMA nodes of its CPUs "
                        "(srun's spelling; needs --cpu-bind or --numa-binding)")
    p.add_argument("--report-bindings", action="store_true",
                   help="say where each rank runs (the CPUs the kernel lets it use) when it "
                        "starts, and in the summary (mpirun's name)")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND",
                   help="the program to run and its arguments (after '--')")
    return p


def split_command(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """Split at the first ``--``: (options, command), command None if absent."""
    try:
        i = argv.index("--")
    except ValueError:
        return argv, None
    return argv[:i], argv[i + 1:]


def _parse_std(text: str, nproc: int, option: str) -> dict[int, Std]:
    try:
        setting = Std.from_str(text)
    except ValueError as e:
        raise UsageError(f"{option}: {e}") from None
    if isinstance(setting, dict):
        bad = sorted(r for r in setting if r >= nproc)
        if bad:
            raise UsageError(
                f"{option}: local rank {bad[0]} is out of range 0..{nproc - 1} in {text!r}")
    return to_map(setting, nproc)


def _parse_ranks_filter(text: str, nproc: int) -> set[int]:
    ranks: set[int] = set()
    for item in text.split(","):
        item = item.strip()
        if not item.isascii() or not item.isdigit():
            raise UsageError(
                f"--local-ranks-filter: expected a comma-separated list of local ranks "
                f"(e.g. '0,2'), got {text!r}")
        rank = int(item)
        if rank >= nproc:
            raise UsageError(
                f"--local-ranks-filter: local rank {rank} is out of range 0..{nproc - 1}")
        ranks.add(rank)
    return ranks


def _parse_env(items: Sequence[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--env: expected KEY=VALUE, got {item!r}")
        if "\0" in item:
            raise UsageError(f"--env: {item!r} contains a NUL byte")
        env[key] = value
    return env


def _check_prefix(template: str) -> None:
    try:
        fields = list(string.Formatter().parse(template))
    except ValueError as e:
        raise UsageError(f"--prefix: malformed template {template!r}: {e}") from None
    for _, field, _, _ in fields:
        if field is None:
            continue
        base = field.split(".", 1)[0].split("[", 1)[0]
        if base not in PREFIX_FIELDS:
            shown = "{}" if field == "" else "{" + field + "}"
            raise UsageError(
                f"--prefix: unknown field {shown} in {template!r}; the fields are "
                + " ".join("{" + f + "}" for f in PREFIX_FIELDS))
    try:
        template.format(name="n", rank=0, local_rank=0, pid=1, host="h")
    except (ValueError, KeyError, IndexError, AttributeError, TypeError) as e:
        raise UsageError(f"--prefix: cannot format {template!r}: {e}") from None


def _check_name(name: str) -> None:
    """The name starts the run's directory under ``--log-dir`` (torchrun's
    ``{log_dir}/{name}_<random>``): it must be one path component, or the logs
    and error files would land outside ``--log-dir``."""
    if "/" in name or "\0" in name or name in (".", ".."):
        raise UsageError(
            f"--name: {name!r} cannot name the run's log directory "
            "(it must not contain '/' or a NUL byte, nor be '.' or '..')")


_PYTHON_RE = re.compile(r"python[0-9.]*")


def default_name(command: Sequence[str]) -> str:
    """The job name when ``--name`` is not given: the script's stem for
    ``python [opts] script.py ...``, else the program's base name."""
    program = os.path.basename(command[0])
    if _PYTHON_RE.fullmatch(program):
        for arg in command[1:]:
            if arg in ("-c", "-m"):
                break
            if arg.startswith("-"):
                continue
            if arg.endswith(".py"):
                return os.path.splitext(os.path.basename(arg))[0] or program
            break
    return program


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def parse_cpu_bind(text: str) -> tuple[str, str, bool]:
    """``--cpu-bind``'s value -> (mode, map list, verbose); srun's names
    (``map_cpu:``, ``ldoms``, ``verbose,``/``quiet,`` prefixes) are accepted."""
    verbose = False
    rest = text.strip()
    while True:
        head, sep, tail = rest.partition(",")
        if sep and head in ("verbose", "v", "quiet", "q"):
            verbose = head in ("verbose", "v")
            rest = tail
            continue
        break
    if rest in ("verbose", "v"):
        return "none", "", True
    mode, colon, listed = rest.partition(":")
    mode = {"map_cpu": "map", "ldoms": "numa", "no": "none"}.get(mode, mode)
    if mode == "map" and colon and listed:
        return "map", listed, verbose
    if mode in ("none", "cores", "numa") and not colon:
        return mode, "", verbose
    raise UsageError(
        f"--cpu-bind: unknown mode {text!r}; the modes are none, cores, numa, map:LIST "
        "(srun's map_cpu:LIST and ldoms too, after an optional 'verbose,')")


def _rank_cpus(args: argparse.Namespace, nproc: int) -> tuple[dict[int, frozenset[int]] | None, bool]:
    """(each rank's CPUs, or None for no binding; verbose) from --cpu-bind /
    --numa-binding, checked against this machine."""
    mode, listed, verbose = parse_cpu_bind(args.cpu_bind) if args.cpu_bind is not None else ("none", "", False)
    if args.numa_binding is not None and mode != "none":
        raise UsageError("--cpu-bind and --numa-binding both say where ranks run: give one of them")
    if mode == "none" and args.numa_binding is None:
        if args.mem_bind == "local":
            raise UsageError("--mem-bind local binds memory near a rank's CPUs: it needs "
                              "--cpu-bind or --numa-binding")
        return None, verbose
    option = "--numa-binding" if args.numa_binding is not None else "--cpu-bind"
    try:
        topo = Topology()
        if args.numa_binding is not None:
            cpus = {rank: _cpus_for_gpu(topo, args.numa_binding, rank) for rank in range(nproc)}
        elif mode == "cores":
            cpus = _cores(topo, nproc)
        elif mode == "numa":
            cpus = _numa_nodes(topo, nproc)
        else:
            cpus = _cpu_map(listed, nproc, topo.allowed_cpus)
        # The same checks start_processes makes (CPUs allowed, memory nodes),
        # here so that a bad option is a usage error.
        _plan_bindings(nproc, cpu_affinity=cpus, mem_bind=args.mem_bind, topology=topo)
    except (ValueError, TypeError, BindingError, NotImplementedError) as e:
        raise UsageError(f"{option}: {e}") from None
    return cpus, verbose


def where_ranks_run(ctx: Any) -> dict[int, str]:
    """--report-bindings: each started local rank's CPUs as the kernel has
    them (read right after the launch), and its memory binding.  A rank
    that is gone already (a quick one is reaped at its exit) is described
    by what it started with: its binding, or if unbound the launcher's own
    CPUs, which it inherited."""
    bindings = getattr(ctx, "bindings", {})
    inherited: frozenset[int] | None = None
    where = {}
    for local, pid in sorted(ctx.pids().items()):
        binding = bindings.get(local)
        actual = cpus_of(pid)
        if actual is None and binding is None and hasattr(os, "sched_getaffinity"):
            if inherited is None:
                inherited = frozenset(os.sched_getaffinity(0))
            actual = inherited
        where[local] = _describe_binding(binding, actual)
    return where


_T = TypeVar("_T")

#: srun's --signal default: this many seconds before the time limit.
DEFAULT_WARN_SECONDS = 60.0


def _parse_warn_signal(text: str, time_limit: float | None) -> tuple[int, float]:
    """``USR1@90`` (or ``USR1``: 60 s) -> (signal, seconds before the limit)."""
    name, at, when = text.partition("@")
    try:
        sig = parse_signal(name)
    except ValueError as e:
        raise UsageError(f"--signal: {e}") from None
    try:
        seconds = float(when) if at else DEFAULT_WARN_SECONDS
    except ValueError:
        raise UsageError(f"--signal: {when!r} is not a number of seconds (SIG@SECONDS)") from None
    if time_limit is None:
        raise UsageError("--signal needs --time-limit (it is sent SECONDS before it)")
    if not 0 <= seconds < time_limit:
        raise UsageError(f"--signal: {seconds:g}s before the time limit must be in 0..{time_limit:g}s "
                          "(--time-limit)")
    return sig, seconds


def _signal_setting(given: str | None, var: str, default: str, option: str, parse: Callable[[str], _T]) -> _T:
    """A signal setting from its option, else its environment variable, else
    the default; a usage error that names where a bad value came from."""
    text, source = ((given, option) if given is not None
                    else (os.environ[var], f"${var}") if var in os.environ else (default, option))
    try:
        return parse(text)
    except ValueError as e:
        raise UsageError(f"{source}: {e}") from None


class Plan:
    """Everything a launch needs, checked before anything starts."""

    def __init__(self, args: argparse.Namespace, command: list[str]) -> None:
        if not command:
            raise UsageError("no command given (put it after '--', e.g. "
                              f"{PROG} -n 2 -- python train.py)")
        rendezvous_given = any(v is not None for v in (args.nnodes, args.node_rank, args.master_addr,
                                                       args.master_port))
        try:
            alloc = (_slurm.allocation(os.environ, rendezvous=not rendezvous_given, nproc=args.nproc is None)
                     if args.slurm else None)
        except _slurm.SlurmError as e:
            raise UsageError(f"Slurm: {e} (or --no-slurm to ignore the job)") from None
        #: What came from the Slurm job, said before the launch ("" for nothing).
        self.slurm_note = alloc.describe() if alloc is not None else ""
        if alloc is not None:
            for option in ("nproc", "nnodes", "node_rank", "master_addr", "master_port"):
                if getattr(args, option) is None:
                    setattr(args, option, getattr(alloc, option))
        if args.nproc is None:
            raise UsageError("the following arguments are required: -n/--nproc")
        if args.nnodes is None:
            args.nnodes = 1
        if args.node_rank is None:
            args.node_rank = 0
        if args.nproc < 1:
            raise UsageError(f"-n/--nproc must be at least 1, got {args.nproc}")
        if args.nnodes < 1:
            raise UsageError(f"--nnodes must be at least 1, got {args.nnodes}")
        if not 0 <= args.node_rank < args.nnodes:
            raise UsageError(
                f"--node-rank must be in 0..{args.nnodes - 1}, got {args.node_rank}")
        if args.nnodes > 1 and (args.master_addr is None or args.master_port is None):
            raise UsageError("--nnodes > 1 needs --master-addr and --master-port "
                              "(the same on every host)")
        if args.master_port is not None and not 0 < args.master_port < 65536:
            raise UsageError(f"--master-port must be in 1..65535, got {args.master_port}")
        #: Each rank's CPUs (None: no binding), and whether to say where ranks run.
        self.cpu_affinity, verbose = _rank_cpus(args, args.nproc)
        self.mem_bind: str | None = args.mem_bind
        self.report_bindings: bool = args.report_bindings or verbose
        if not args.shutdown_timeout >= 0:
            raise UsageError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
        if args.hang_report_after is not None and not 0 < args.hang_report_after < float("inf"):
            raise UsageError(f"--hang-report-after must be > 0 seconds, got {args.hang_report_after}")
        self.command = command
        self.nproc: int = args.nproc
        self.name: str = args.name if args.name is not None else default_name(command)
        if not self.name:
            raise UsageError("--name must not be empty")
        if args.name is not None:  # a default name is a base name already
            _check_name(self.name)
        redirects = _parse_std(args.redirects, self.nproc, "--redirects")
        if args.tee is None:
            # Tee whatever is not redirected: output reaches the console prefixed.
            tee = {r: Std(Std.ALL & ~redirects[r]) for r in redirects}
        else:
            tee = _parse_std(args.tee, self.nproc, "--tee")
        self.redirects = redirects
        self.tee = tee
        self.ranks_filter = (None if args.local_ranks_filter is None
                             else _parse_ranks_filter(args.local_ranks_filter, self.nproc))
        _check_prefix(args.prefix)
        self.prefix_template: str = args.prefix
        self.user_env = _parse_env(args.env)
        self.start_method: str = args.start_method
        self.summary: bool = args.summary
        self.shutdown_timeout: float = args.shutdown_timeout
        self.timestamps: bool = args.timestamps
        self.faulthandler: bool = args.faulthandler
        self.hang_report_after: float | None = args.hang_report_after
        #: The report signal (None: none) and the signals passed on to the ranks.
        self.report_signal: int | None = _signal_setting(
            args.hang_report_signal, REPORT_SIGNAL_VAR, DEFAULT_REPORT_SIGNAL.name, "--hang-report-signal",
            parse_optional_signal)
        forward: list[int] = _signal_setting(
            args.forward_signals, FORWARD_SIGNALS_VAR, ",".join(s.name for s in DEFAULT_FORWARD_SIGNALS),
            "--forward-signals", parse_signal_list)
        try:
            self.forward_signals = check_launcher_signals(forward, self.report_signal)
        except ValueError as e:
            raise UsageError(f"--forward-signals/--hang-report-signal: {e}") from None
        if args.time_limit is not None and not 0 < args.time_limit < float("inf"):
            raise UsageError(f"--time-limit must be > 0 seconds, got {args.time_limit}")
        self.time_limit: float | None = args.time_limit
        if args.wait_after_exit is not None and not 0 <= args.wait_after_exit < float("inf"):
            raise UsageError(f"--wait must be >= 0 seconds, got {args.wait_after_exit}")
        self.wait_after_exit: float | None = args.wait_after_exit
        self.kill_on_bad_exit: bool = bool(args.kill_on_bad_exit)
        if args.max_restarts < 0:
            raise UsageError(f"--max-restarts must be >= 0, got {args.max_restarts}")
        self.max_restarts: int = args.max_restarts
        #: --signal: (signal, seconds before the time limit), or None.
        self.warn_signal = None if args.warn_signal is None else _parse_warn_signal(args.warn_signal, self.time_limit)
        try:
            self.console_backlog: int = _console.backlog_bound(args.console_backlog)
        except (TypeError, ValueError) as e:
            raise UsageError(f"--console-backlog: {e}" if args.console_backlog is not None else str(e)) from None
        try:
            self.stderr_tail: int = stderr_tail_bound(args.stderr_tail)
        except ValueError as e:
            raise UsageError(f"--stderr-tail: {e}" if args.stderr_tail is not None else str(e)) from None
        self.nnodes: int = args.nnodes
        self.node_rank: int = args.node_rank
        self.master_addr: str = args.master_addr or "127.0.0.1"
        self.master_port: int | None = args.master_port
        self.log_dir_arg: str | None = args.log_dir
        if self.log_dir_arg is not None:
            if not self.log_dir_arg:
                raise UsageError("--log-dir must not be empty")
            if self.log_dir_arg != os.devnull and os.path.exists(self.log_dir_arg) \
                    and not os.path.isdir(self.log_dir_arg):
                raise UsageError(f"--log-dir: {self.log_dir_arg} exists and is not a directory")

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.nproc + local_rank

    def envs(self, master_port: int, restart_count: int = 0) -> dict[int, dict[str, str]]:
        world = self.nnodes * self.nproc
        envs = {}
        for local in range(self.nproc):
            rank = self.global_rank(local)
            env = {
                "LOCAL_RANK": str(local),
                "RANK": str(rank),
                "GROUP_RANK": str(self.node_rank),
                "ROLE_RANK": str(rank),
                "ROLE_NAME": self.name,
                "LOCAL_WORLD_SIZE": str(self.nproc),
                "WORLD_SIZE": str(world),
                "GROUP_WORLD_SIZE": str(self.nnodes),
                "ROLE_WORLD_SIZE": str(world),
                "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(master_port),
                "TORCHELASTIC_RUN_ID": self.name,
                "TORCHELASTIC_RESTART_COUNT": str(restart_count),
                "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts),
            }
            # Set by the user (even empty: off) in torchmp run's environment,
            # which the ranks inherit, or with --env: theirs.
            if self.faulthandler and FAULTHANDLER_VAR not in os.environ \
                    and FAULTHANDLER_VAR not in self.user_env:
                env[FAULTHANDLER_VAR] = "1"
            env.update(self.user_env)
            envs[local] = env
        return envs

    def prefixes(self) -> dict[int, str]:
        host = socket.gethostname()
        return {
            local: self.prefix_template.format(
                name=self.name, rank=self.global_rank(local), local_rank=local,
                pid=os.getpid(), host=host)
            for local in range(self.nproc)
        }
