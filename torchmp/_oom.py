"""Name deaths by the kernel OOM killer.

A rank that dies of a SIGKILL torchmp did not send was most often killed by
the OOM killer, but the exit status alone cannot say so.  The memory cgroup
can: the kernel counts its OOM kills (cgroup v2 ``memory.events``, v1
``memory.oom_control``, key ``oom_kill``) and raises the count *before* it
sends the SIGKILL, so by the time the launcher reaps the rank the count has
already moved.  We read the launcher's counter at launch and again when a
rank turns out to have been SIGKILLed::

    watch = start_watch()            # None: no readable memory cgroup
    ...
    note = watch.explain(pid) if watch else None
    # 'killed by the kernel OOM killer (memory cgroup /job: oom_kill 0 -> 1)'

The kernel counts a kill in the victim's cgroup; v2 also counts it in every
ancestor, v1 does not.  Ranks inherit the launcher's cgroup, so the
launcher's counter is the one to watch.  The check is a heuristic: another
process of the same cgroup killed at the same moment is indistinguishable.

Nothing here raises for a missing or unreadable controller or file: the
answer is then None.  Standard library only; cost per launch is one read of
/proc/self/cgroup and one of the counter file (the mount table is read once
per process).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

__all__ = [
    "MemCgroup",
    "Mount",
    "OomWatch",
    "memory_cgroup",
    "parse_memory_events",
    "parse_mountinfo",
    "parse_oom_control",
    "read_oom_kills",
    "resolve_memory_cgroup",
    "start_watch",
]


@dataclass(frozen=True)
class Mount:
    """A cgroup filesystem mount, from one line of /proc/self/mountinfo."""

    root: str            # the directory of the hierarchy mounted here
    mount_point: str
    fstype: str          # "cgroup" (v1) or "cgroup2"
    super_options: frozenset[str]


@dataclass(frozen=True)
class MemCgroup:
    """The memory cgroup of a process and where its OOM-kill counter is."""

    version: int         # 1 or 2
    path: str            # as listed in /proc/<pid>/cgroup
    counter_file: str    # absolute path of memory.oom_control / memory.events

    def contains(self, other: MemCgroup) -> bool:
        """True if other is this cgroup or one of its descendants."""
        if other.version != self.version:
            return False
        if self.path == "/" or other.path == self.path:
            return True
        return other.path.startswith(self.path.rstrip("/") + "/")


# --- pure parsers ---------------------------------------------------------------

_OCTAL = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    # The kernel writes space, tab, newline and backslash in paths as \ooo.
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    """The cgroup (v1) and cgroup2 mounts listed in a mountinfo text."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        # id parent major:minor root mount-point options [optional...] - fstype source super-options
        try:
            sep = fields.index("-", 6)
        except ValueError:
            continue
        if len(fields) < sep + 4:
            continue
        fstype = fields[sep + 1]
        if fstype not in ("cgroup", "cgroup2"):
            continue
        mounts.append(Mount(
            root=_unescape(fields[3]),
            mount_point=_unescape(fields[4]),
            fstype=fstype,
            super_options=frozenset(fields[sep + 3].split(",")),
        ))
    return mounts


def _oom_kill_value(text: str) -> int | None:
    # Both files are flat "key value" lines.
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "oom_kill":
            return int(parts[1]) if parts[1].isascii() and parts[1].isdigit() else None
    return None


def parse_memory_events(text: str) -> int | None:
    """The oom_kill count of a cgroup v2 memory.events text, or None."""
    return _oom_kill_value(text)


def parse_oom_control(text: str) -> int | None:
    """The oom_kill count of a cgroup v1 memory.oom_control text, or None.

    Kernels before 4.13 have no oom_kill line: None.
    """
    return _oom_kill_value(text)


def _under_mount(mounts: list[Mount], path: str) -> str | None:
    # A container without a cgroup namespace sees a bind mount of part of the
    # hierarchy (root /docker/<id>); the process's path is listed from the
    # hierarchy's root, so strip the mount's root.  Paths with ".." lie
    # outside our cgroup namespace and cannot be reached through any mount.
    if not path.startswith("/") or ".." in path.split("/"):
        return None
    best: tuple[int, str] | None = None
    for m in mounts:
        root = m.root.rstrip("/")
        if path == root or path.startswith(root + "/") or root == "":
            if best is None or len(root) > best[0]:
                best = (len(root), m.mount_point.rstrip("/") + path[len(root):])
    return None if best is None else (best[1] or "/")


def resolve_memory_cgroup(proc_cgroup: str, mounts: list[Mount]) -> MemCgroup | None:
    """The memory cgroup described by a /proc/<pid>/cgroup text, or None.

    A v1 memory line wins over the v2 line: on a hybrid system the memory
    controller is on v1 and the v2 hierarchy has no counters.
    """
    v1: str | None = None
    v2: str | None = None
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    if v1 is not None:
        v1_mounts = [m for m in mounts if m.fstype == "cgroup" and "memory" in m.super_options]
        base = _under_mount(v1_mounts, v1)
        if base is not None:
            return MemCgroup(1, v1, os.path.join(base, "memory.oom_control"))
    if v2 is not None:
        base = _under_mount([m for m in mounts if m.fstype == "cgroup2"], v2)
        if base is not None:
            return MemCgroup(2, v2, os.path.join(base, "memory.events"))
    return None


# --- reading the system ---------------------------------------------------------

def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        return f.read()


_mounts: tuple[int, list[Mount]] | None = None


def _cgroup_mounts() -> list[Mount]:
    global _mounts
    # Keyed by pid so that a forked child (possibly in another mount
    # namespace after unshare) reads its own table once.
    if _mounts is None or _mounts[0] != os.getpid():
        _mounts = (os.getpid(), parse_mountinfo(_read("/proc/self/mountinfo")))
    return _mounts[1]


def memory_cgroup(pid: int | str = "self") -> MemCgroup | None:
    """The memory cgroup of pid (or "self"), or None if it cannot be found."""
    try:
        text = _read(f"/proc/{pid}/cgroup")
        return resolve_memory_cgroup(text, _cgroup_mounts())
    except (OSError, ValueError):
        return None


def read_oom_kills(cg: MemCgroup) -> int | None:
    """The current oom_kill count of cg, or None if it cannot be read."""
    try:
        text = _read(cg.counter_file)
    except (OSError, ValueError):
        return None
    return parse_memory_events(text) if cg.version == 2 else parse_oom_control(text)


class OomWatch:
    """A baseline of the launcher's OOM-kill counter, to explain SIGKILLs."""

    def __init__(self, cgroup: MemCgroup, before: int) -> None:
        self.cgroup = cgroup
        self.before = before

    def __repr__(self) -> str:
        return f"OomWatch({self.cgroup!r}, before={self.before})"

    def explain(self, pid: int | None = None) -> str | None:
        """The OOM-kill message for a rank SIGKILLed by someone else, or None.

        pid is the rank's, still unreaped if possible.  On v2 a zombie's
        /proc/<pid>/cgroup still names its cgroup: if that lies outside the
        launcher's, a rise of the launcher's counter is someone else's kill.
        On v1 the kernel lists "/" for an exiting task, so it says nothing and
        is not read.  A descendant is counted in the launcher's counter on v2
        (hierarchical); on v1 it is not, and the answer is None.
        """
        if pid is not None and self.cgroup.version == 2:
            rank = memory_cgroup(pid)
            if rank is not None and not self.cgroup.contains(rank):
                return None
        after = read_oom_kills(self.cgroup)
        if after is None or after <= self.before:
            return None
        return (f"killed by the kernel OOM killer (memory cgroup {self.cgroup.path}: "
                f"oom_kill {self.before} -> {after})")


def start_watch() -> OomWatch | None:
    """An OomWatch on this process's memory cgroup, or None if unavailable."""
    try:
        cg = memory_cgroup("self")
        if cg is None:
            return None
        before = read_oom_kills(cg)
        return None if before is None else OomWatch(cg, before)
    except (OSError, ValueError):
        return None
