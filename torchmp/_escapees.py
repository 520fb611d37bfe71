"""Processes that left their rank's process group: one owner for finding,
stopping and reaping them.

A rank's descendant that calls ``setsid()`` or ``setpgid()``, or a daemon
that double-forks into a session of its own, is out of the reach of the
signals torchmp sends to the rank's process group.  With this process a
child subreaper (``PR_SET_CHILD_SUBREAPER``: ``torchmp run`` always, the
library with ``start_processes(..., subreaper=True)``), such a descendant
is re-parented here when its parent exits, instead of to pid 1: it is then
one of this process's children that torchmp did not start itself.  In
``torchmp run`` every such child is one; in a library user's process, which
may start children of its own, only those that carry the context's
:data:`MARKER_VAR` (inherited from the rank's environment) are.
:func:`stop` finds those, stops them as the ranks are stopped (SIGTERM to
each one's process group if it leads one, else to it; a grace; SIGKILL)
and reaps them.

A child stays ours and unreaped (a zombie) until we reap it, so its pid --
and the process group it leads -- cannot be anybody else's while it is
signalled: the rule ``close()`` follows for the ranks.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Collection

from torchmp import _core
from torchmp._procfs import parse_stat

#: Set in every rank's environment by a context with subreaper=True: its
#: escapees carry it (a process that clears its environment is missed).
MARKER_VAR = "TORCHMP_CONTEXT_ID"

#: How often stop() looks again while it waits for the escapees to exit.
_POLL_SECONDS = 0.02
#: How long a SIGKILLed escapee may take to exit before it is left alone
#: (uninterruptible sleep), as close() does for the ranks.
_KILL_GRACE_SECONDS = 5.0


def make_subreaper() -> None:
    """Make this process a child subreaper (process-wide, and kept: other
    code of the process may rely on it by then).  OSError where the kernel
    (or a portable build) has no such setting."""
    _core.set_child_subreaper(True)


def _carries(pid: int, marker: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return marker in f.read().split(b"\0")
    except OSError:
        return False  # gone, or not ours to read (another uid): not taken


def _children(marker: bytes | None = None) -> dict[int, tuple[int, bool]]:
    """This process's children (those whose environment holds ``marker``,
    if given): pid -> (process group, whether it exited)."""
    me = os.getpid()
    found: dict[int, tuple[int, bool]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", encoding="utf-8", errors="replace") as f:
                stat = parse_stat(f.read())
        except (OSError, ValueError):
            continue  # gone meanwhile
        if stat.ppid == me and (marker is None or _carries(stat.pid, marker)):
            found[stat.pid] = (stat.pgrp, stat.state in ("Z", "X"))
    return found


def _signal(pid: int, pgrp: int, sig: int) -> None:
    try:
        if pgrp == pid:  # leads a group: its id is pinned while the pid is ours
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _left_its_group(pid: int, pgrp: int, rank_groups: Collection[int]) -> bool:
    """Whether a re-parented child had left its rank's process group.  One
    that leads a group with a rank's id made that group itself, after the
    rank's was gone and its id free again (a rank's own group has only ever
    had the rank as its leader)."""
    return pgrp not in rank_groups or pid == pgrp


def reap_exited(known: Collection[int], rank_groups: Collection[int]) -> int:
    """Reap the children torchmp did not start that have exited already
    (re-parented here while the job runs: without this they would stay
    zombies until its end, one pid each); returns how many had left their
    rank's process group.  For ``torchmp run`` only: a library user's own
    children are not ours to reap."""
    skip = set(known) | {_core.keeper_pid()}
    own_group = os.getpgrp()
    count = 0
    for pid, (pgrp, exited) in _children().items():
        if exited and pid not in skip and pgrp != own_group:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                continue
            count += _left_its_group(pid, pgrp, rank_groups)
    return count


def stop(known: Collection[int], rank_groups: Collection[int], grace: float, marker: str | None = None) -> int:
    """Stop and reap every child of this process that torchmp did not start:
    not in ``known`` (ranks, of every open context), not the keeper, not in
    this process's own process group (what the launcher itself runs, such
    as py-spy).  Children in one of ``rank_groups`` (a rank's orphan that
    stayed in its group: the group's signals reached it) are reaped too.
    With ``marker`` (a context's id), only children whose environment has
    ``MARKER_VAR=marker``.

    SIGTERM, then up to ``grace`` seconds, then SIGKILL; a child that keeps
    escaping (its own children re-parented here as it dies) is followed.
    Returns how many had left their rank's process group."""
    skip = set(known) | {_core.keeper_pid(), os.getpid()}
    own_group = os.getpgrp()
    seen: dict[int, int] = {}
    signalled: dict[int, int] = {}
    deadline = time.monotonic() + max(0.0, grace)
    wanted = None if marker is None else f"{MARKER_VAR}={marker}".encode()
    while True:
        kids = {pid: v for pid, v in _children(wanted).items() if pid not in skip and v[0] != own_group}
        for pid, (pgrp, _) in kids.items():
            seen.setdefault(pid, pgrp)
        alive = {pid: pgrp for pid, (pgrp, exited) in kids.items() if not exited}
        now = time.monotonic()
        if not alive or now >= deadline + _KILL_GRACE_SECONDS:
            break
        sig = signal.SIGTERM if now < deadline else signal.SIGKILL
        for pid, pgrp in alive.items():
            if signalled.get(pid) != sig:
                _signal(pid, pgrp, sig)
                signalled[pid] = sig
        time.sleep(_POLL_SECONDS)
    for pid in seen:
        try:
            os.waitpid(pid, os.WNOHANG)  # the ones left running stay ours
        except ChildProcessError:
            pass
    return sum(1 for pid, pgrp in seen.items() if _left_its_group(pid, pgrp, rank_groups))
