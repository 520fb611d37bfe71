"""Name deaths by the kernel OOM killer -- only with evidence about the rank.

A rank that dies of a SIGKILL torchmp did not send was often killed by the
OOM killer, but the exit status alone cannot say so, and neither can a
cgroup's OOM-kill count alone: it says that *some* process of the cgroup
was killed (a rank's helper, another job's process), not which one.  So::

    watch = start_watch()        # at launch; None: nothing readable
    ...
    watch.explain(pid, exit_mono_ns)
    # 'killed by the kernel OOM killer (memory cgroup /job: oom_kill 0 -> 1;
    #  the kernel log names pid 8275 at 14:02:11)'
    # or 'an OOM kill in the same cgroup at 14:02:08 may be related'
    # or None
    watch.stop()                 # before the ranks' zombies are reaped

The evidence, on cgroup v1 and v2 alike:

* The kernel's log (``/dev/kmsg``): the OOM killer logs every kill as
  ``Killed process <pid> (<name>) ...``, and (rate-limited) the victim's
  cgroup in an ``oom-kill:...,task_memcg=...,pid=<pid>`` line.  The watch
  opens the log at launch positioned at its end, so it reads exactly the
  records logged while the context ran, and takes the last of them while
  the ranks' zombies still pin their pids (:meth:`OomWatch.stop`): a record
  naming a rank's pid is that rank's.  This is the only evidence that names
  a rank.  It needs read access to the log (root or CAP_SYSLOG, or anyone
  when ``kernel.dmesg_restrict`` is 0) and a launcher in the initial pid
  and cgroup namespaces (where the kernel's pids and paths are ours).
* The memory cgroup's counter (v2 ``memory.events``, v1
  ``memory.oom_control``, key ``oom_kill``; v2 counts kills in the subtree,
  v1 in the cgroup itself only).  It only ever supports "an OOM kill in the
  same cgroup ... may be related": at the time the kernel logged a kill in
  the launcher's cgroup during the rank's life; without the log, between
  the two looks at the counter that bracket its rise.  On v2 a rank whose
  zombie lies outside the launcher's cgroup gets no such hint.

Nothing here raises for a missing or unreadable controller, file or log:
the answer is then None.  Standard library only; cost per launch: one read
of /proc/self/cgroup and one of the counter file (the mount table is read
once per process), and the open of /dev/kmsg (one fd per running context).
"""
from __future__ import annotations

import io
import os
import re
import time
from dataclasses import dataclass

__all__ = [
    "KernelLog",
    "MemCgroup",
    "Mount",
    "OomKill",
    "OomWatch",
    "memory_cgroup",
    "parse_kmsg_record",
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


# --- the kernel's log -------------------------------------------------------------

KMSG_PATH = "/dev/kmsg"
# The inode numbers of the initial pid and cgroup namespaces (PROC_PID_INIT_INO,
# PROC_CGROUP_INIT_INO): the kernel logs pids and cgroup paths as seen there.
_INIT_PID_NS = 0xEFFFFFFC
_INIT_CGROUP_NS = 0xEFFFFFFB

_KILLED = re.compile(rb"Killed process (\d+) \(")
# oom-kill:constraint=...,oom_memcg=/a,task_memcg=/a/b,task=python3,pid=8275,uid=0
_SUMMARY = re.compile(rb"oom-kill:.*,task_memcg=(.*),task=.*,pid=(\d+),uid=\d+$")


@dataclass(frozen=True)
class OomKill:
    """One OOM kill as the kernel logged it."""

    pid: int             # as the initial pid namespace sees it
    mono_ns: int         # the record's time (printk's clock: CLOCK_MONOTONIC)
    memcg: str | None    # the victim's memory cgroup, when the kernel said


def parse_kmsg_record(record: bytes) -> tuple[int, int, int, bytes] | None:
    """(facility, sequence number, time in microseconds, message) of one
    /dev/kmsg record, or None if it is not one."""
    header, sep, rest = record.partition(b";")
    fields = header.split(b",")
    if not sep or len(fields) < 4:
        return None
    try:
        prefix, seq, usec = int(fields[0]), int(fields[1]), int(fields[2])
    except ValueError:
        return None
    return prefix >> 3, seq, usec, rest.split(b"\n", 1)[0]


class KernelLog:
    """The kernel's records of OOM kills since it was opened, from
    /dev/kmsg (readable by root or CAP_SYSLOG, or by anyone when
    kernel.dmesg_restrict is 0).  Only kernel records count (facility 0: a
    process writing to /dev/kmsg cannot make one)."""

    def __init__(self, fd: int) -> None:
        self._file: io.FileIO | None = io.FileIO(fd, "rb", closefd=True)
        self.kills: list[OomKill] = []
        self.lost = False              # records were overwritten before read
        self._memcg: dict[int, str] = {}

    @classmethod
    def open(cls, path: str | None = None) -> KernelLog | None:
        """The log (KMSG_PATH) from now on, or None where it cannot be read
        or its pids and cgroup paths are not the ones this process sees."""
        if not _in_init_namespaces():
            return None
        try:
            fd = os.open(path or KMSG_PATH, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            os.lseek(fd, 0, os.SEEK_END)
            return cls(fd)
        except OSError:
            os.close(fd)
            return None

    def read(self) -> None:
        """Take in the records logged since the last read."""
        f = self._file
        while f is not None:
            try:
                record = f.read(8192)
            except BrokenPipeError:    # overwritten before we read them
                self.lost = True
                continue
            except OSError:
                self.lost = True
                self.close()
                return
            if not record:             # None: nothing new (EAGAIN)
                return
            self._take(record)

    def _take(self, record: bytes) -> None:
        parsed = parse_kmsg_record(record)
        if parsed is None or parsed[0] != 0:
            return
        _, _, usec, message = parsed
        summary = _SUMMARY.search(message)
        if summary is not None:
            self._memcg[int(summary.group(2))] = summary.group(1).decode("utf-8", "surrogateescape")
            return
        killed = _KILLED.search(message)
        if killed is not None:
            pid = int(killed.group(1))
            self.kills.append(OomKill(pid, usec * 1000, self._memcg.pop(pid, None)))

    def close(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            f.close()


_namespaces: tuple[int, bool] | None = None


def _in_init_namespaces() -> bool:
    # A process cannot change its own pid namespace: read once per pid.
    global _namespaces
    if _namespaces is None or _namespaces[0] != os.getpid():
        try:
            ok = (os.stat("/proc/self/ns/pid").st_ino == _INIT_PID_NS
                  and os.stat("/proc/self/ns/cgroup").st_ino == _INIT_CGROUP_NS)
        except OSError:
            ok = False
        _namespaces = (os.getpid(), ok)
    return _namespaces[1]


# --- explaining a SIGKILL -------------------------------------------------------------

# How much later than a rank's exit (the launcher's clock) a kernel record
# may be stamped and still be of its life: the two clocks can drift apart.
CLOCK_SLACK_NS = 5_000_000_000


def _clock(mono_ns: int) -> str:
    """A CLOCK_MONOTONIC time as local wall-clock HH:MM:SS."""
    wall = time.time_ns() - (time.monotonic_ns() - mono_ns)
    return time.strftime("%H:%M:%S", time.localtime(wall / 1e9))


class OomWatch:
    """What tells a rank's SIGKILL by the OOM killer from any other SIGKILL:
    the kernel's log of the kills since the context started (it names the
    victim's pid), and the memory cgroup's OOM-kill counter (it says only
    that someone in the cgroup was killed, so it alone names no rank)."""

    def __init__(self, cgroup: MemCgroup | None, before: int | None,
                 kernel_log: KernelLog | None = None) -> None:
        self.cgroup = cgroup
        self.before = before
        self.kernel_log = kernel_log
        # (CLOCK_MONOTONIC ns, oom_kill count) at start and at each look since.
        self._counts: list[tuple[int, int]] = [] if before is None else [(time.monotonic_ns(), before)]

    def __repr__(self) -> str:
        return f"OomWatch({self.cgroup!r}, before={self.before}, kernel_log={self.kernel_log is not None})"

    def _look(self) -> int | None:
        after = read_oom_kills(self.cgroup) if self.cgroup is not None else None
        if after is not None:
            self._counts.append((time.monotonic_ns(), after))
        if self.kernel_log is not None:
            self.kernel_log.read()
        return after

    def stop(self) -> None:
        """The last look, while the ranks' zombies still pin their pids: a
        kernel record read later could name a new process with a reused pid."""
        self._look()
        if self.kernel_log is not None:
            self.kernel_log.close()

    def _same_cgroup(self, kill: OomKill) -> bool:
        # The kernel names the victim's cgroup from the hierarchy's root, as
        # /proc/self/cgroup does in the initial cgroup namespace.  A record
        # without one (the kernel rate-limits that line) counts if our
        # counter moved.
        if self.cgroup is None:
            return False
        if kill.memcg is None:
            return bool(self.before is not None and self._counts and self._counts[-1][1] > self.before)
        if self.cgroup.version == 1:  # v1 counts a kill in the victim's own cgroup only
            return kill.memcg == self.cgroup.path
        return self.cgroup.contains(MemCgroup(2, kill.memcg, ""))

    def explain(self, pid: int | None = None, exit_mono_ns: int | None = None) -> str | None:
        """What to say about a rank's SIGKILL that torchmp did not send, or
        None: "killed by the kernel OOM killer (...)" where the kernel's log
        names its pid; else "an OOM kill in the same cgroup at HH:MM:SS (or
        between two times) may be related" when one happened in the
        launcher's memory cgroup while the rank lived.

        pid is the rank's; exit_mono_ns when it was reaped (None: now)."""
        after = self._look()
        end = (time.monotonic_ns() if exit_mono_ns is None else exit_mono_ns) + CLOCK_SLACK_NS
        log = self.kernel_log
        kills = [k for k in log.kills if k.mono_ns <= end] if log is not None else []
        if pid is not None and any(k.pid == pid for k in kills):
            victim = next(k for k in kills if k.pid == pid)
            evidence = [f"the kernel log names pid {pid} at {_clock(victim.mono_ns)}"]
            if self.cgroup is not None and after is not None and self.before is not None and after > self.before:
                evidence.insert(0, f"memory cgroup {self.cgroup.path}: oom_kill {self.before} -> {after}")
            return f"killed by the kernel OOM killer ({'; '.join(evidence)})"
        ours = [k for k in kills if k.pid != pid and self._same_cgroup(k)]
        if ours:
            # The last kill before the exit; else (clock drift) the first after.
            before = [k for k in ours if k.mono_ns <= end - CLOCK_SLACK_NS]
            kill = before[-1] if before else ours[0]
            return f"an OOM kill in the same cgroup at {_clock(kill.mono_ns)} may be related"
        if log is not None and not log.lost:
            return None  # the log is complete: no kill in our cgroup while the rank lived
        return self._counter_hint(pid, exit_mono_ns)

    def _counter_hint(self, pid: int | None, exit_mono_ns: int | None) -> str | None:
        """Without the kernel's word: the counter's rise, placed between the
        two looks that bracket it."""
        if self.cgroup is None or not self._counts:
            return None
        if pid is not None and self.cgroup.version == 2:
            # A zombie's cgroup still reads on v2 (on v1 it is "/"): a rank
            # outside the launcher's cgroup is not counted there.
            rank = memory_cgroup(pid)
            if rank is not None and not self.cgroup.contains(rank):
                return None
        exit_ns = time.monotonic_ns() if exit_mono_ns is None else exit_mono_ns
        # The first look at or after the exit, and the last one before it
        # that saw fewer kills.
        hi = next(((t, c) for t, c in self._counts if t >= exit_ns), self._counts[-1])
        lo = [(t, c) for t, c in self._counts if t < hi[0] and c < hi[1]]
        if not lo:
            return None
        return (f"an OOM kill in the same cgroup between {_clock(lo[-1][0])} and {_clock(hi[0])} "
                "may be related")


def start_watch() -> OomWatch | None:
    """An OomWatch from now on, or None if neither this process's memory
    cgroup counter nor the kernel's log can be read."""
    try:
        cg = memory_cgroup("self")
        before = read_oom_kills(cg) if cg is not None else None
        if before is None:
            cg = None
        log = KernelLog.open()
        if cg is None and log is None:
            return None
        return OomWatch(cg, before, log)
    except (OSError, ValueError):
        return None
