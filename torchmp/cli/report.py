"""The end-of-run summary table of ``torchmp run``: one row per rank (pid,
exit, wall time, CPU time, max RSS, where it ran, a note saying why it
failed or who stopped it)."""
from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from torchmp.cli.exit_codes import exit_text
from torchmp.errors import ProcessFailure

__all__ = ["SUMMARY_REASON_WIDTH", "format_summary", "summary_reason"]

_MIB = 1024 * 1024


def _format_rss(nbytes: int) -> str:
    return f"{nbytes / _MIB:.1f} MiB"


#: How much of a failure's one-line reason the summary table shows.
SUMMARY_REASON_WIDTH = 100


def summary_reason(failure: ProcessFailure) -> str:
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
            exit_text(usage.exitcode),
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
