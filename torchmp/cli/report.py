"""What ``torchmp run`` writes to its own console: messages, the failure
report, hang reports and the end-of-run summary.  Once a run is under way
they go through the console the workers' lines go through
(``_console.say``): whole lines, after the workers' lines logged before
them, never blocking -- a stalled stderr holds up neither a fail-fast nor
the exit.  Only argparse's own output (usage, --help, before anything runs)
is written to the stream itself, through a console that may be closed or
gone (then it is dropped, never an error)."""
from __future__ import annotations

import os
import signal
import sys
from collections.abc import Collection, Sequence
from typing import Any

from torchmp import _console, _core
from torchmp.errors import ProcessFailure

_MIB = 1024 * 1024

# ---------------------------------------------------------------------------
# Reporting


def _console_gone(e: BaseException | None) -> bool:
    """Whether a write error means the console is closed or gone (the
    core's one errno set for it)."""
    return isinstance(e, OSError) and e.errno is not None and _core.console_gone(e.errno)


def _drop_console(stream: Any) -> None:
    """Point the fd of a console that is closed or gone at /dev/null.

    Whatever is still buffered, and anything written later (by this module,
    the native core's copy of the workers' lines, the interpreter's last
    flush at exit), then goes nowhere without an error, so a closed console
    changes neither the exit status nor what reaches the log files.
    """
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        fd = -1  # not a file: nothing to repoint, the error is swallowed only
    if fd >= 0:
        try:
            null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            null = -1
        if null >= 0:
            try:
                if null != fd:
                    os.dup2(null, fd)  # fds 0-2 stay inheritable, as they were
            except OSError:
                pass
            finally:
                if null != fd:
                    os.close(null)
    try:
        stream.flush()  # what the failed write left in the buffer: to /dev/null
    except (OSError, ValueError):
        pass


def _write_console(stream: Any, text: str) -> None:
    """Write and flush ``text``; a console that is closed or gone is dropped,
    and one that was closed when the launcher started (None) is off."""
    if stream is None:
        return
    try:
        stream.write(text)
        stream.flush()
    except OSError as e:
        if not _console_gone(e):
            raise
        _drop_console(stream)


def _settle_console() -> None:
    """Flush stdout and stderr, dropping either if it is closed or gone, so the
    interpreter's own flush at exit finds nothing to fail on (which would
    print "Exception ignored ... BrokenPipeError" and exit 120)."""
    for stream in (sys.stdout, sys.stderr):
        if stream is None:
            continue
        try:
            stream.flush()
        except OSError as e:
            if _console_gone(e):
                _drop_console(stream)
        except ValueError:  # closed by someone else
            pass


def _say(message: str) -> None:
    _console.say(f"torchmp: {message}\n")


def _show(text: str) -> None:
    """A report or the summary: to stderr, after the workers' lines logged
    before it (a hang report while the job runs, too), never waiting on a
    console that does not take it (every report is in the logs or its file
    as well; at exit the console gets as long as it makes progress)."""
    _console.say(text)


def exit_code_for(failure: ProcessFailure) -> int:
    """srun's rule: the exit code, or 128 + N for a death by signal N."""
    if failure.exitcode < 0:
        return 128 + (-failure.exitcode)
    return failure.exitcode


def _format_rss(nbytes: int) -> str:
    return f"{nbytes / _MIB:.1f} MiB"


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return str(code)


#: How much of a failure's one-line reason the summary table shows.
SUMMARY_REASON_WIDTH = 100


def _summary_reason(failure: ProcessFailure) -> str:
    """Why a rank failed, in a few words for its summary row: what the
    launcher found out (the OOM killer), else the error file's message or
    the rank's last words; nothing where the exit column says it all."""
    if failure.cause:
        return failure.cause.split(" (", 1)[0]
    if not failure.has_recorded_message and not failure.stderr_tail.strip():
        return ""
    reason = failure.headline
    if len(reason) > SUMMARY_REASON_WIDTH:
        reason = reason[:SUMMARY_REASON_WIDTH - 3] + "..."
    return reason


def format_summary(
    plan_name: str,
    nproc: int,
    global_rank: Any,
    result: Any,
    notes: dict[int, str],
    exit_code: int,
    elapsed: float,
    terminated: Collection[int] = (),
    bindings: dict[int, str] | None = None,
    why: str = "",
) -> str:
    """The end-of-run table, one row per local rank (``?`` where unknown);
    ``why`` the run ended that way, after the exit code (``time limit``).

    A rank succeeded if it exited 0 on its own: one in ``terminated`` (stopped by
    the fail-fast or by the signal torchmp run got) did not, whatever its exit
    code -- a worker that exits 0 on SIGTERM was cut short, as the exit code says.
    """
    header: tuple[str, ...] = ("rank", "pid", "exit", "wall", "cpu", "max rss", "")
    # --report-bindings: where each rank ran, before the note.
    where = () if bindings is None else ("where",)
    header = header[:6] + where + header[6:]
    rows = []
    resources = getattr(result, "resources", {}) if result is not None else {}
    for local in range(nproc):
        usage = resources.get(local)
        placed = () if bindings is None else (bindings.get(local, "?"),)
        if usage is None:
            rows.append((str(global_rank(local)), "?", "?", "?", "?", "?", *placed, notes.get(local, "")))
            continue
        rows.append((
            str(global_rank(local)),
            str(usage.pid),
            _exit_text(usage.exitcode),
            f"{usage.wall_time:.3f}s",
            f"{usage.user_time + usage.system_time:.3f}s",
            _format_rss(usage.max_rss),
            *placed,
            notes.get(local, ""),
        ))
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    left = {2, len(header) - 1} | ({6} if where else set())  # exit, where and note read better left-aligned

    def line(cells: Sequence[str]) -> str:
        out = [c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))]
        return "  ".join(out).rstrip()

    succeeded = sum(1 for local in range(nproc)
                    if local not in terminated and resources.get(local) is not None
                    and resources[local].exitcode == 0)
    title = (f"torchmp: summary of {plan_name}: {succeeded}/{nproc} ranks succeeded, "
             f"exit code {exit_code}{f' ({why})' if why else ''}, {elapsed:.2f}s")
    return "\n".join([title, line(header), *(line(r) for r in rows)]) + "\n"
