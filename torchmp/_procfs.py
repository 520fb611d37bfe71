"""What ``/proc`` says of a process, read without touching it (stdlib only:
psutil is not a run-time dependency): its ``stat`` and ``statm`` lines, its
kernel wait channel, and the Python processes of a process group.  The hang
report (:mod:`torchmp.cli.hang`) and the escapee sweep
(:mod:`torchmp._escapees`) read processes through it."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "ProcStat", "RankSample", "parse_stat", "parse_statm", "read_wchan", "state_name", "sample",
    "python_pids_by_group",
]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

#: ``/proc/<pid>/stat`` state letters (proc(5)), as the report shows them.
STATE_NAMES = {
    "R": "running",
    "S": "sleeping",
    "D": "uninterruptible (D)",
    "Z": "zombie",
    "T": "stopped",
    "t": "traced",
    "X": "dead",
    "x": "dead",
    "I": "idle",
    "K": "wakekill",
    "W": "waking",
    "P": "parked",
}


@dataclass(frozen=True)
class ProcStat:
    """The fields of ``/proc/<pid>/stat`` a report uses (times in clock ticks)."""

    pid: int
    comm: str
    state: str
    ppid: int
    pgrp: int
    utime: int
    stime: int
    starttime: int
    rss_pages: int


def parse_stat(text: str) -> ProcStat:
    """Parse one ``/proc/<pid>/stat`` line.

    The command name (field 2) is in parentheses and may itself contain
    spaces and parentheses (``(a) b)``), so it runs from the first ``(`` to
    the *last* ``)``; the other fields are split on whitespace after it.
    Raises ValueError for a line that is not a stat line.
    """
    open_at = text.find("(")
    close_at = text.rfind(")")
    if open_at < 0 or close_at < open_at:
        raise ValueError(f"not a /proc/<pid>/stat line: {text[:80]!r}")
    pid = int(text[:open_at])
    comm = text[open_at + 1:close_at]
    rest = text[close_at + 1:].split()
    if len(rest) < 22:
        raise ValueError(f"short /proc/<pid>/stat line: {text[:80]!r}")
    return ProcStat(
        pid=pid,
        comm=comm,
        state=rest[0],
        ppid=int(rest[1]),
        pgrp=int(rest[2]),
        utime=int(rest[11]),
        stime=int(rest[12]),
        starttime=int(rest[19]),
        rss_pages=int(rest[21]),
    )


def parse_statm(text: str) -> int:
    """Resident pages from ``/proc/<pid>/statm`` (its second field)."""
    fields = text.split()
    if len(fields) < 2:
        raise ValueError(f"not a /proc/<pid>/statm line: {text[:80]!r}")
    return int(fields[1])


def _read(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode("utf-8", "replace")


def read_wchan(pid: int, proc: str = "/proc") -> str:
    """The kernel function ``pid`` sleeps in, or ``-``: not waiting (the
    kernel's ``0``: running, or hidden from us), or unreadable."""
    try:
        text = _read(f"{proc}/{pid}/wchan").strip()
    except OSError:
        return "-"
    return text if text and text != "0" else "-"


def state_name(letter: str) -> str:
    return STATE_NAMES.get(letter, letter or "?")


@dataclass(frozen=True)
class RankSample:
    """One rank's process as read from ``/proc`` at one moment."""

    pid: int
    state: str          # a /proc state letter; "" if the process is gone
    cpu_ticks: int      # utime + stime, clock ticks
    rss: int            # bytes
    wchan: str


def sample(pid: int, proc: str = "/proc") -> RankSample:
    """Read ``pid``'s state, CPU time, RSS and wait channel from ``/proc``."""
    try:
        st = parse_stat(_read(f"{proc}/{pid}/stat"))
    except (OSError, ValueError):
        return RankSample(pid, "", 0, 0, "-")
    try:
        rss_pages = parse_statm(_read(f"{proc}/{pid}/statm"))
    except (OSError, ValueError):
        rss_pages = st.rss_pages
    return RankSample(pid, st.state, st.utime + st.stime, rss_pages * _PAGE, read_wchan(pid, proc))


_PYTHON_EXE = re.compile(r"python[0-9.]*[dmu]*")


def _is_python(pid: int, proc: str) -> bool:
    try:
        exe = os.path.basename(os.readlink(f"{proc}/{pid}/exe"))
    except OSError:
        return False
    return bool(_PYTHON_EXE.fullmatch(exe.removesuffix(" (deleted)")))


def python_pids_by_group(pgids: Iterable[int], proc: str = "/proc") -> dict[int, list[int]]:
    """The live Python processes in each of the process groups ``pgids`` (a
    rank's leader, and whatever it started in its group: the trainer under
    ``sh -c 'python train.py'``), leader first; one pass over ``/proc``."""
    found: dict[int, list[int]] = {pgid: [] for pgid in pgids}
    try:
        names = os.listdir(proc)
    except OSError:
        return found
    for name in names:
        if not name.isdigit():
            continue
        pid = int(name)
        try:
            st = parse_stat(_read(f"{proc}/{pid}/stat"))
        except (OSError, ValueError):
            continue
        if st.pgrp in found and st.state not in ("Z", "X", "x") and _is_python(pid, proc):
            found[st.pgrp].append(pid)
    for pgid, pids in found.items():
        pids.sort(key=lambda p: (p != pgid, p))
    return found
