"""Name deaths by the kernel OOM killer -- only with evidence about the rank.

A rank that dies of a SIGKILL torchmp did not send was often killed by the
OOM killer, but the exit status alone cannot say so, and neither can a
cgroup's OOM-kill counter alone: it says that *some* process of the cgroup
was killed (a rank's helper, another job's process), not which one::

    watch = start_watch()        # at launch; None: no readable memory cgroup
    ...
    watch.stop()                 # at close, before the ranks' zombies are reaped
    watch.explain(pid, exit_mono_ns)
    # 'killed by the kernel OOM killer (memory cgroup /job: oom_kill 0 -> 1;
    #  the kernel log names pid 8275 at 14:02:11)'
    # or 'an OOM kill in the same cgroup at 14:02:08 may be related'
    # or None

The evidence, on cgroup v1 and v2 alike:

* The memory cgroup's counter (v2 ``memory.events``, v1
  ``memory.oom_control``, key ``oom_kill``; v2 counts kills in the subtree,
  v1 in the cgroup itself only), read at launch and at close (if a rank
  died of a SIGKILL torchmp did not send): ``n`` kills
  in the launcher's cgroup while the context ran.  The kernel raises it
  before it sends the SIGKILL.
* The kernel's log (``/dev/kmsg``), read only when the counter moved,
  before the ranks' zombies are reaped (so that the pids in it are still
  theirs): the OOM killer logs each kill as ``oom-kill:...,task_memcg=
  <cgroup>,...,pid=<pid>`` and ``Killed process <pid> (...)``.  The last
  ``n`` kills it lists in the launcher's cgroup are exactly the kills the
  counter counted -- no clock involved (the log's timestamps drift from
  CLOCK_MONOTONIC).  A rank whose pid is among them was the OOM killer's;
  this is the only evidence that names a rank.  Where that cannot be told
  for sure -- the log unreadable (it needs root or CAP_SYSLOG, or
  ``kernel.dmesg_restrict`` = 0), a launcher outside the initial pid and
  cgroup namespaces (whose pids and paths the log uses), a newer kill whose
  cgroup line the kernel rate-limited away, kills older than the log
  reaches -- no rank is named.
* Any other SIGKILL while the counter moved gets "an OOM kill in the same
  cgroup ... may be related": at the kernel's time of the last of those
  kills before the rank's exit, or, without the log, between the two looks
  at the counter that bracket its rise.  On v2 a rank whose zombie lies
  outside the launcher's cgroup gets no such hint.

Nothing here raises for a missing or unreadable controller, file or log:
the answer is then None.  Standard library only; cost per context: one read
of /proc/self/cgroup and of the counter file at launch (the mount table is
read once per process); at close, where a rank died of a SIGKILL torchmp
did not send, the counter again, and the kernel's log (whole) only if the
counter moved.  No descriptor is held.
"""
from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torchmp import _core

__all__ = [
    "MemCgroup",
    "Mount",
    "OomKill",
    "OomWatch",
    "memory_cgroup",
    "oom_kills",
    "parse_kmsg_record",
    "parse_memory_events",
    "parse_mountinfo",
    "parse_oom_control",
    "read_kernel_log",
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


#: Where each version's hierarchy is mounted by systemd and container runtimes.
USUAL_MOUNTS = {1: "/sys/fs/cgroup/memory", 2: "/sys/fs/cgroup"}
COUNTER_FILES = {1: "memory.oom_control", 2: "memory.events"}


def _memory_paths(proc_cgroup: str) -> tuple[str | None, str | None]:
    """The (v1 memory, v2) cgroup paths of a /proc/<pid>/cgroup text."""
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
    return v1, v2


def resolve_memory_cgroup(proc_cgroup: str, mounts: list[Mount]) -> MemCgroup | None:
    """The memory cgroup described by a /proc/<pid>/cgroup text, or None.

    A v1 memory line wins over the v2 line: on a hybrid system the memory
    controller is on v1 and the v2 hierarchy has no counters.
    """
    v1, v2 = _memory_paths(proc_cgroup)
    if v1 is not None:
        v1_mounts = [m for m in mounts if m.fstype == "cgroup" and "memory" in m.super_options]
        base = _under_mount(v1_mounts, v1)
        if base is not None:
            return MemCgroup(1, v1, os.path.join(base, COUNTER_FILES[1]))
    if v2 is not None:
        base = _under_mount([m for m in mounts if m.fstype == "cgroup2"], v2)
        if base is not None:
            return MemCgroup(2, v2, os.path.join(base, COUNTER_FILES[2]))
    return None


def memory_cgroup_at_usual_mount(proc_cgroup: str) -> MemCgroup | None:
    """What :func:`resolve_memory_cgroup` finds, without the mount table,
    when the hierarchy it would pick is mounted whole at its usual place;
    None when that cannot be told (then the table decides)."""
    v1, v2 = _memory_paths(proc_cgroup)
    version, path = (1, v1) if v1 is not None else (2, v2)
    if path is None:
        return None
    mount_point = USUAL_MOUNTS[version]
    if _core.cgroup_root_version(mount_point) != version:
        return None
    # A v1 hierarchy there could be another controller's.
    if version == 1 and not os.path.exists(os.path.join(mount_point, COUNTER_FILES[1])):
        return None
    base = _under_mount([Mount("/", mount_point, "", frozenset())], path)
    return None if base is None else MemCgroup(version, path, os.path.join(base, COUNTER_FILES[version]))


# --- reading the system ---------------------------------------------------------

def _kept_slot(path: str) -> int | None:
    """Where _core.read_kept keeps the file every launch reads, if it is one."""
    if path == "/proc/self/cgroup":
        return 0
    return 1 if path.endswith(_COUNTER_SUFFIXES) else None


_COUNTER_SUFFIXES = tuple("/" + name for name in COUNTER_FILES.values())


def _read(path: str) -> str:
    # Every launch reads /proc/self/cgroup and the counter: through
    # descriptors the core keeps open, since opening them (a path walk
    # through /proc or the cgroup file system) costs more than reading them
    # (docs/profiles.md).  The rest with raw reads: open()'s text layer
    # costs several times the system calls.
    slot = _kept_slot(path)
    if slot is not None:
        data = _core.read_kept(slot, path)
        if data is not None:
            return data.decode("utf-8", "surrogateescape")
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8", "surrogateescape")


_mounts: tuple[int, list[Mount]] | None = None


def _cgroup_mounts() -> list[Mount]:
    global _mounts
    # Keyed by pid so that a forked child (possibly in another mount
    # namespace after unshare) reads its own table once.
    if _mounts is None or _mounts[0] != os.getpid():
        _mounts = (os.getpid(), parse_mountinfo(_read("/proc/self/mountinfo")))
    return _mounts[1]


# The last resolution, keyed by (pid, /proc/<pid>/cgroup text): the text is
# read on every call (a process can be moved to another cgroup), the parse
# and the mount lookup are done again only when it changed (or in a forked
# child, whose mount table may be another namespace's).
_resolved: tuple[int, str, MemCgroup | None] | None = None


def memory_cgroup(pid: int | str = "self") -> MemCgroup | None:
    """The memory cgroup of pid (or "self"), or None if it cannot be found."""
    global _resolved
    try:
        text = _read(f"/proc/{pid}/cgroup")
        me = os.getpid()
        cached = _resolved
        if pid == "self" and cached is not None and cached[0] == me and cached[1] == text:
            return cached[2]
        cg = memory_cgroup_at_usual_mount(text) or resolve_memory_cgroup(text, _cgroup_mounts())
        if pid == "self":
            _resolved = (me, text, cg)
        return cg
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
    mono_ns: int         # the record's time (printk's clock, close to CLOCK_MONOTONIC)
    memcg: str | None    # the victim's memory cgroup; None where the kernel left it out


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


def oom_kills(records: Iterable[bytes]) -> list[OomKill]:
    """The OOM kills in /dev/kmsg records, oldest first.  Each kill is an
    ``oom-kill:...,task_memcg=<cgroup>,...,pid=<pid>`` line (rate-limited by
    the kernel: it may be missing) and then ``Killed process <pid> (...)``
    (always there).  Only kernel records count (facility 0: a process
    writing to /dev/kmsg cannot make one)."""
    kills: list[OomKill] = []
    summarized: set[int] = set()   # pids whose summary came, their Killed line not yet
    for record in records:
        parsed = parse_kmsg_record(record)
        if parsed is None or parsed[0] != 0:
            continue
        _, _, usec, message = parsed
        summary = _SUMMARY.search(message)
        if summary is not None:
            pid = int(summary.group(2))
            kills.append(OomKill(pid, usec * 1000, summary.group(1).decode("utf-8", "surrogateescape")))
            summarized.add(pid)
            continue
        killed = _KILLED.search(message)
        if killed is not None:
            pid = int(killed.group(1))
            if pid in summarized:
                summarized.discard(pid)
            else:
                kills.append(OomKill(pid, usec * 1000, None))
    return kills


def read_kernel_log(path: str | None = None, attempts: int = 3) -> list[bytes] | None:
    """Every record in the kernel's log (KMSG_PATH), oldest first, or None
    where it cannot be read (root or CAP_SYSLOG, or anyone when
    kernel.dmesg_restrict is 0) or keeps being overwritten while read, or
    where its pids and cgroup paths are not the ones this process sees."""
    if not _in_init_namespaces():
        return None
    for _ in range(attempts):
        try:
            fd = os.open(path or KMSG_PATH, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None
        records: list[bytes] = []
        try:
            while True:
                records.append(os.read(fd, 8192))   # one record per read
        except BlockingIOError:                     # the end
            return records
        except BrokenPipeError:                     # overwritten under us: again
            continue
        except OSError:
            return None
        finally:
            os.close(fd)
    return None


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


def _last_kills(kills: list[OomKill], count: int, ours: Callable[[str], bool]) -> list[OomKill] | None:
    """The last ``count`` kills of our cgroup, or None if they cannot be
    told for sure: a newer kill whose cgroup the kernel did not log, or
    fewer than count left in the log (the oldest were overwritten)."""
    found: list[OomKill] = []
    for kill in reversed(kills):
        if len(found) == count:
            break
        if kill.memcg is None:
            return None
        if ours(kill.memcg):
            found.append(kill)
    return found[::-1] if len(found) == count else None


# --- explaining a SIGKILL -------------------------------------------------------------

# How much later than a rank's exit (the launcher's clock) a kernel record
# may be stamped and still count as before it: printk's clock is not
# steered by NTP and drifts from CLOCK_MONOTONIC.
CLOCK_SLACK_NS = 5_000_000_000


def _clock(mono_ns: int) -> str:
    """A CLOCK_MONOTONIC time as local wall-clock HH:MM:SS."""
    wall = time.time_ns() - (time.monotonic_ns() - mono_ns)
    return time.strftime("%H:%M:%S", time.localtime(wall / 1e9))


class OomWatch:
    """What tells a rank's SIGKILL by the OOM killer from any other SIGKILL.

    The cgroup's counter says how many processes of the launcher's memory
    cgroup were OOM-killed since the start -- ``n`` -- but not which.  The
    kernel's log says which: its last ``n`` kills in that cgroup are exactly
    those (read before the ranks' zombies are reaped, so that their pids
    are still theirs).  The log is read only when the counter moved."""

    def __init__(self, cgroup: MemCgroup, before: int) -> None:
        self.cgroup = cgroup
        self.before = before
        # (CLOCK_MONOTONIC ns, oom_kill count) at start and at each look since.
        self._counts: list[tuple[int, int]] = [(time.monotonic_ns(), before)]
        self._stopped = False
        self._kills: tuple[int, list[OomKill] | None] | None = None   # (for count, kills)

    def __repr__(self) -> str:
        return f"OomWatch({self.cgroup!r}, before={self.before})"

    def _ours(self, memcg: str) -> bool:
        # v1 counts a kill in the victim's own cgroup only; v2 in every ancestor.
        if self.cgroup.version == 1:
            return memcg == self.cgroup.path
        return self.cgroup.contains(MemCgroup(2, memcg, ""))

    def _look(self) -> int:
        """The count now (after stop(): as it was then), and the kills of
        the kernel's log it stands for, if it moved."""
        if not self._stopped:
            after = read_oom_kills(self.cgroup)
            if after is not None and after >= self._counts[-1][1]:
                self._counts.append((time.monotonic_ns(), after))
        count = self._counts[-1][1]
        if count > self.before and (self._kills is None or self._kills[0] != count):
            records = read_kernel_log()
            kills = None
            if records is not None:
                kills = _last_kills(oom_kills(records), count - self.before, self._ours)
            self._kills = (count, kills)
        return count

    def stop(self, look: bool = True) -> None:
        """The last look, while the ranks' zombies still pin their pids: a
        kernel record read later could name a new process with a reused
        pid.  look=False: nothing will be asked (no rank died of a SIGKILL
        torchmp did not send): stop without reading anything."""
        if not self._stopped:
            if look:
                self._look()
            self._stopped = True

    def explain(self, pid: int | None = None, exit_mono_ns: int | None = None) -> str | None:
        """What to say about a rank's SIGKILL that torchmp did not send, or
        None: "killed by the kernel OOM killer (...)" where the kernel's log
        has its pid among the launcher's cgroup's kills since the start;
        else "an OOM kill in the same cgroup at HH:MM:SS (or between two
        times) may be related" when one happened while the rank lived.

        pid is the rank's; exit_mono_ns when it was reaped (None: now)."""
        count = self._look()
        if count <= self.before:
            return None
        exit_ns = time.monotonic_ns() if exit_mono_ns is None else exit_mono_ns
        kills = self._kills[1] if self._kills is not None else None
        if kills is None:
            return self._counter_hint(pid, exit_mono_ns)
        victim = next((k for k in kills if k.pid == pid), None)
        if victim is not None:
            return (f"killed by the kernel OOM killer (memory cgroup {self.cgroup.path}: "
                    f"oom_kill {self.before} -> {count}; the kernel log names pid {pid} "
                    f"at {_clock(victim.mono_ns)})")
        # The last kill before the exit; else one just after it (the clocks
        # drift); none at all if they all came later.
        before = [k for k in kills if k.mono_ns <= exit_ns]
        near = [k for k in kills if exit_ns < k.mono_ns <= exit_ns + CLOCK_SLACK_NS]
        kill = before[-1] if before else near[0] if near else None
        if kill is None:
            return None
        return f"an OOM kill in the same cgroup at {_clock(kill.mono_ns)} may be related"

    def _counter_hint(self, pid: int | None, exit_mono_ns: int | None) -> str | None:
        """Without the kernel's word: the counter's rise, placed between the
        two looks that bracket it."""
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
    """An OomWatch on this process's memory cgroup, or None if unavailable."""
    try:
        cg = memory_cgroup("self")
        if cg is None:
            return None
        before = read_oom_kills(cg)
        return None if before is None else OomWatch(cg, before)
    except (OSError, ValueError):
        return None
