"""Naming deaths by the kernel OOM killer (torchmp/_oom.py), only with
evidence about the rank.

The parsers, the cgroup path resolution and the watch's rules are tested on
fixture text (kernel log records fed through a seqpacket socket, counter
files); the real tests create a child memory cgroup with a small limit on
the cgroup v1 hierarchy (root only, skipped where it is not writable) and
get processes OOM-killed in it: a victim rank (named) and a bystander
SIGKILLed by hand after another process's OOM kill (not named), in one run,
with and without the kernel's log.
"""
from __future__ import annotations

import errno
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from torchmp import _core, _oom
from torchmp._oom import MemCgroup, Mount, OomWatch

from helpers import Launcher, launcher_env

# --- fixture text -----------------------------------------------------------------

# A cgroup v1 host (this is the layout of the test machine), hybrid: a cgroup2
# mount without controllers beside the v1 hierarchies.
MOUNTINFO_V1 = """\
24 29 0:22 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime shared:7 - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime shared:9 - cgroup cgroup rw,memory
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw,nsdelegate
"""
CGROUP_V1 = """\
9:name=systemd:/user.slice
4:memory:/process_api/abc
2:cpu,cpuacct:/
0::/user.slice
"""

# A pure cgroup v2 host (systemd's default since 2021).
MOUNTINFO_V2 = """\
22 1 259:1 / / rw,relatime shared:1 - ext4 /dev/root rw
30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot
"""  # noqa: E501 (a verbatim /proc/self/mountinfo line)
CGROUP_V2 = "0::/user.slice/user-1000.slice/session-3.scope\n"

# A container without a cgroup namespace: its own part of the host's
# hierarchy bind-mounted on /sys/fs/cgroup/memory (mount root != "/").
MOUNTINFO_BIND_V1 = """\
700 690 0:60 / /sys/fs/cgroup ro,nosuid,nodev,noexec,relatime - tmpfs tmpfs rw,mode=755
705 700 0:32 /docker/c0ffee /sys/fs/cgroup/memory ro,nosuid,nodev,noexec,relatime master:15 - cgroup cgroup rw,memory
"""
MOUNTINFO_BIND_V2 = """\
801 800 0:26 /kubepods/pod7/ctr /sys/fs/cgroup ro,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw
"""

MEMORY_EVENTS = """\
low 0
high 12
max 340
oom 3
oom_kill 2
oom_group_kill 0
"""
OOM_CONTROL = """\
oom_kill_disable 0
under_oom 0
oom_kill 7
"""
OOM_CONTROL_OLD = "oom_kill_disable 0\nunder_oom 0\n"          # before Linux 4.13


# --- parsers ----------------------------------------------------------------------

def test_parse_memory_events() -> None:
    assert _oom.parse_memory_events(MEMORY_EVENTS) == 2
    assert _oom.parse_memory_events("oom_kill 0\n") == 0
    assert _oom.parse_memory_events("oom_kill 18446744073709551615") == 2**64 - 1


def test_parse_oom_control() -> None:
    assert _oom.parse_oom_control(OOM_CONTROL) == 7
    assert _oom.parse_oom_control(OOM_CONTROL_OLD) is None


@pytest.mark.parametrize("text", [
    "", "\n", "garbage", "oom_kill\n", "oom_kill -1\n", "oom_kill x\n", "oom_kill 1 2\n",
    "oom_kill ²\n", "oom_kill 0x10\n", "\x00\xff oom_kill", "oom_kill_disable 0\n",
    "oom 3\noom_group_kill 4\n",
])
def test_parsers_return_none_on_garbage(text: str) -> None:
    assert _oom.parse_memory_events(text) is None
    assert _oom.parse_oom_control(text) is None


def test_parse_mountinfo() -> None:
    mounts = _oom.parse_mountinfo(MOUNTINFO_V1)
    assert [(m.fstype, m.mount_point) for m in mounts] == [
        ("cgroup", "/sys/fs/cgroup/cpu,cpuacct"),
        ("cgroup", "/sys/fs/cgroup/memory"),
        ("cgroup", "/sys/fs/cgroup/systemd"),
        ("cgroup2", "/sys/fs/cgroup/unified"),
    ]
    assert mounts[1] == Mount("/", "/sys/fs/cgroup/memory", "cgroup", frozenset({"rw", "memory"}))
    # Optional fields vary in number; the fields after "-" are what counts.
    assert _oom.parse_mountinfo(MOUNTINFO_V2) == [Mount(
        "/", "/sys/fs/cgroup", "cgroup2", frozenset({"rw", "nsdelegate", "memory_recursiveprot"}))]


def test_parse_mountinfo_escapes_and_garbage() -> None:
    text = ("1 2 0:9 /a\\040b /mnt/my\\040cg\\134x rw - cgroup cgroup rw,memory\n"
            "garbage\n"
            "1 2 0:9 / /x rw - cgroup\n"           # truncated after the separator
            "1 2 0:9 / /y rw shared:1 master:2 - cgroup2 none rw\n")
    assert _oom.parse_mountinfo(text) == [
        Mount("/a b", "/mnt/my cg\\x", "cgroup", frozenset({"rw", "memory"})),
        Mount("/", "/y", "cgroup2", frozenset({"rw"})),
    ]


# --- resolution -------------------------------------------------------------------

def resolve(cgroup: str, mountinfo: str) -> MemCgroup | None:
    return _oom.resolve_memory_cgroup(cgroup, _oom.parse_mountinfo(mountinfo))


def test_resolve_v1() -> None:
    assert resolve(CGROUP_V1, MOUNTINFO_V1) == MemCgroup(
        1, "/process_api/abc", "/sys/fs/cgroup/memory/process_api/abc/memory.oom_control")
    assert resolve("4:memory:/\n", MOUNTINFO_V1) == MemCgroup(
        1, "/", "/sys/fs/cgroup/memory/memory.oom_control")
    # memory sharing a hierarchy with other controllers
    both = "3:cpu,memory:/j\n"
    mi = "5 1 0:9 / /cg/cpu,memory rw - cgroup cgroup rw,cpu,memory\n"
    assert resolve(both, mi) == MemCgroup(1, "/j", "/cg/cpu,memory/j/memory.oom_control")


def test_resolve_v2() -> None:
    assert resolve(CGROUP_V2, MOUNTINFO_V2) == MemCgroup(
        2, "/user.slice/user-1000.slice/session-3.scope",
        "/sys/fs/cgroup/user.slice/user-1000.slice/session-3.scope/memory.events")


def test_resolve_hybrid_prefers_v1_memory() -> None:
    # The memory controller is on v1; the cgroup2 mount has no counters.
    assert resolve(CGROUP_V1, MOUNTINFO_V1).version == 1  # type: ignore[union-attr]
    # Without a v1 memory line, the v2 one is used.
    assert resolve("2:cpu,cpuacct:/\n0::/user.slice\n", MOUNTINFO_V1) == MemCgroup(
        2, "/user.slice", "/sys/fs/cgroup/unified/user.slice/memory.events")
    # A v1 memory line whose hierarchy is not mounted here: fall back to v2.
    assert resolve("4:memory:/x\n0::/y\n", MOUNTINFO_V2) == MemCgroup(
        2, "/y", "/sys/fs/cgroup/y/memory.events")


def test_resolve_mount_root_not_slash() -> None:
    assert resolve("4:memory:/docker/c0ffee\n", MOUNTINFO_BIND_V1) == MemCgroup(
        1, "/docker/c0ffee", "/sys/fs/cgroup/memory/memory.oom_control")
    assert resolve("4:memory:/docker/c0ffee/sub\n", MOUNTINFO_BIND_V1) == MemCgroup(
        1, "/docker/c0ffee/sub", "/sys/fs/cgroup/memory/sub/memory.oom_control")
    assert resolve("0::/kubepods/pod7/ctr/app\n", MOUNTINFO_BIND_V2) == MemCgroup(
        2, "/kubepods/pod7/ctr/app", "/sys/fs/cgroup/app/memory.events")
    # Outside the mounted subtree (a prefix of a name is not a parent): unreachable.
    assert resolve("4:memory:/docker/c0ffee2\n", MOUNTINFO_BIND_V1) is None
    assert resolve("4:memory:/\n", MOUNTINFO_BIND_V1) is None


def test_resolve_longest_mount_root_wins() -> None:
    mi = ("5 1 0:9 / /all rw - cgroup2 cgroup2 rw\n"
          "6 1 0:9 /a/b /ab rw - cgroup2 cgroup2 rw\n")
    assert resolve("0::/a/b/c\n", mi) == MemCgroup(2, "/a/b/c", "/ab/c/memory.events")
    assert resolve("0::/a/x\n", mi) == MemCgroup(2, "/a/x", "/all/a/x/memory.events")


@pytest.mark.parametrize("cgroup, mountinfo", [
    ("", MOUNTINFO_V1),
    ("garbage\n", MOUNTINFO_V1),
    (CGROUP_V2, ""),                                  # no cgroup mounts at all
    ("2:cpu,cpuacct:/\n", MOUNTINFO_V1),              # no memory line, no v2 line
    ("0::/../outside\n", MOUNTINFO_V2),              # outside our cgroup namespace
    ("4:memory:relative\n", MOUNTINFO_V1),
])
def test_resolve_none(cgroup: str, mountinfo: str) -> None:
    assert resolve(cgroup, mountinfo) is None


def test_contains() -> None:
    job = MemCgroup(2, "/job", "/x")
    assert job.contains(MemCgroup(2, "/job", "/y"))
    assert job.contains(MemCgroup(2, "/job/rank1", "/y"))
    assert not job.contains(MemCgroup(2, "/job2", "/y"))
    assert not job.contains(MemCgroup(2, "/", "/y"))
    assert not job.contains(MemCgroup(1, "/job", "/y"))
    assert MemCgroup(2, "/", "/x").contains(job)


# --- the kernel's log, on fixture records ------------------------------------------

# Records as /dev/kmsg gives them, one per read: "prefix,seq,usec,flags;text"
# then dictionary lines.  prefix is facility << 3 | level; 0 is the kernel.
SUMMARY = (b"6,901,300474831,-;oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,"
           b"mems_allowed=0,oom_memcg=/job,task_memcg=/job/sub,task=python3,pid=8275,uid=0\n")
KILLED = (b"3,902,300474842,-;Memory cgroup out of memory: Killed process 8275 (python3) "
          b"total-vm:74652kB, anon-rss:65280kB, file-rss:6084kB, shmem-rss:0kB, UID:0 pgtables:188kB "
          b"oom_score_adj:0\n SUBSYSTEM=memory\n")


def test_parse_kmsg_record() -> None:
    assert _oom.parse_kmsg_record(KILLED) == (
        0, 902, 300474842, KILLED.split(b";", 1)[1].split(b"\n")[0])
    assert _oom.parse_kmsg_record(b"14,5,77,-;user text; with ;\n")[:3] == (1, 5, 77)  # type: ignore[index]
    for bad in (b"", b"garbage", b"6,1,2;no flags\n", b"x,1,2,-;a\n", b"6,1,2,-no separator\n"):
        assert _oom.parse_kmsg_record(bad) is None, bad


def test_oom_kills_kernel_records_only() -> None:
    records = [b"6,1,100,-;random driver message\n", SUMMARY, KILLED,
               # a process writing to /dev/kmsg is facility 1 (user), never 0
               b"11,3,300474900,-;Killed process 4242 (python3) total-vm:1kB\n",
               b"12,4,300474901,-;oom-kill:constraint=X,task_memcg=/job,task=x,pid=4243,uid=0\n",
               # a kill whose summary line the kernel rate-limited away
               b"3,5,300475000,-;Out of memory: Killed process 77 (java) total-vm:1kB\n",
               b"6,6,300475100,-;oom_reaper: reaped process 77 (java), now anon-rss:0kB\n",
               # a summary whose Killed line is not logged yet (a kill in progress)
               b"6,7,300475200,-;oom-kill:constraint=CONSTRAINT_MEMCG,oom_memcg=/a,b,task_memcg=/a,b,"
               b"task=odd,pid=1,pid=9,uid=0\n"]
    assert _oom.oom_kills(records) == [_oom.OomKill(8275, 300474831000, "/job/sub"),
                                       _oom.OomKill(77, 300475000000, None),
                                       _oom.OomKill(9, 300475200000, "/a,b")]
    assert _oom.oom_kills([]) == []


def test_read_kernel_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _oom.read_kernel_log(str(tmp_path / "missing")) is None
    # A FIFO with a record in it stands in for /dev/kmsg: read to EAGAIN.
    fifo = tmp_path / "kmsg"
    os.mkfifo(fifo)
    w = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    try:
        os.write(w, KILLED)
        assert _oom.read_kernel_log(str(fifo)) == [KILLED]
    finally:
        os.close(w)
    monkeypatch.setattr(_oom, "_namespaces", (os.getpid(), False))
    assert _oom.read_kernel_log(str(fifo)) is None     # another pid or cgroup namespace


def clock(mono_ns: int) -> str:
    return time.strftime("%H:%M:%S", time.localtime((time.time_ns() - time.monotonic_ns() + mono_ns) / 1e9))


def kill_records(seq: int, pid: int, mono_ns: int, memcg: str | None) -> list[bytes]:
    usec = mono_ns // 1000
    records = [f"3,{seq},{usec},-;Memory cgroup out of memory: Killed process {pid} (python3) "
               "total-vm:1kB\n".encode()]
    if memcg is not None:
        records.insert(0, f"6,{seq - 1},{usec},-;oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),"
                          f"cpuset=/,mems_allowed=0,oom_memcg={memcg},task_memcg={memcg},task=python3,"
                          f"pid={pid},uid=0\n".encode())
    return records


class Fixture:
    """A v1 watch on a fixture counter file, and a kernel log the test writes."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: int = 1) -> None:
        self.file = tmp_path / ("memory.oom_control" if version == 1 else "memory.events")
        self.version = version
        self.log: list[bytes] | None = []
        self.reads = 0
        self.count(0)
        monkeypatch.setattr(_oom, "read_kernel_log", self._read_log)
        cg = MemCgroup(version, "/job", str(self.file))
        self.watch = OomWatch(cg, _oom.read_oom_kills(cg) or 0)

    def _read_log(self) -> list[bytes] | None:
        self.reads += 1
        return None if self.log is None else list(self.log)

    def count(self, n: int) -> None:
        self.file.write_text(OOM_CONTROL.replace("oom_kill 7", f"oom_kill {n}") if self.version == 1
                             else MEMORY_EVENTS.replace("oom_kill 2", f"oom_kill {n}"))

    def kill(self, pid: int, mono_ns: int, memcg: str | None = "/job") -> None:
        assert self.log is not None
        self.log += kill_records(len(self.log) + 2, pid, mono_ns, memcg)


@pytest.fixture
def fx(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Fixture:
    return Fixture(tmp_path, monkeypatch)


def test_watch_names_only_the_pid_the_kernel_log_names(fx: Fixture) -> None:
    now = time.monotonic_ns()
    fx.kill(500, now - 9_000_000_000)          # before the start: not counted
    fx.kill(501, now - 3_000_000_000)          # a helper
    fx.kill(600, now)                          # the victim
    fx.count(2)
    fx.watch.stop()                            # the look before the reap
    assert fx.watch.explain(600, now + 1000) == (
        "killed by the kernel OOM killer (memory cgroup /job: oom_kill 0 -> 2; "
        f"the kernel log names pid 600 at {clock(now)})")
    # SIGKILLed by hand after the helper's kill: the helper's kill (the last
    # before its exit) may be related; nothing names it.
    assert fx.watch.explain(700, now - 1_000_000_000) == (
        f"an OOM kill in the same cgroup at {clock(now - 3_000_000_000)} may be related")
    # A rank that exited before both kills: nothing to say.
    assert fx.watch.explain(800, now - 10_000_000_000) is None
    # pid 500 was killed before the start: a pid reused since is not its.
    assert fx.watch.explain(500, now) == f"an OOM kill in the same cgroup at {clock(now)} may be related"
    # After stop(), neither the counter nor the log is read again.
    reads = fx.reads
    fx.count(5)
    fx.kill(900, now)
    assert "names pid 600" in (fx.watch.explain(600, now) or "") and fx.watch.explain(900, now) is not None
    assert fx.reads == reads and "names pid 900" not in (fx.watch.explain(900, now) or "")


def test_watch_reads_the_log_only_when_the_counter_moved(fx: Fixture) -> None:
    fx.kill(600, time.monotonic_ns())          # a kill in the log, but not since the start
    assert fx.watch.explain(600) is None and fx.reads == 0


def test_watch_counts_kills_of_its_own_cgroup(fx: Fixture) -> None:
    now = time.monotonic_ns()
    fx.kill(600, now)                          # ours
    fx.kill(601, now, "/other")                # v1: only kills in /job itself count
    fx.kill(602, now, "/job/sub")
    fx.count(1)
    assert "names pid 600" in (fx.watch.explain(600, now) or "")
    assert fx.watch.explain(601, now) == f"an OOM kill in the same cgroup at {clock(now)} may be related"


def test_watch_v2_counts_the_subtree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fx = Fixture(tmp_path, monkeypatch, version=2)
    now = time.monotonic_ns()
    fx.kill(600, now, "/job/rank1")
    fx.kill(601, now, "/jobs")
    fx.count(1)
    assert "names pid 600" in (fx.watch.explain(600, now) or "")


@pytest.mark.parametrize("case", ["unreadable", "too-short", "rate-limited"])
def test_watch_that_cannot_tell_names_nobody(fx: Fixture, case: str) -> None:
    now = time.monotonic_ns()
    fx.kill(600, now)
    fx.count(1)
    if case == "unreadable":
        fx.log = None
    elif case == "too-short":
        fx.count(2)                            # two kills counted, one left in the log
    else:
        fx.kill(601, now, memcg=None)          # a newer kill of unknown cgroup
    hint = fx.watch.explain(600, now)
    assert hint is not None and re.fullmatch(
        r"an OOM kill in the same cgroup between (\d\d:\d\d:\d\d) and (\d\d:\d\d:\d\d) may be related", hint), hint


def test_watch_counter_hint_brackets_the_rise(fx: Fixture) -> None:
    fx.log = None
    exit_ns = time.monotonic_ns()
    fx.count(1)
    hint = fx.watch.explain(600, exit_ns)
    m = re.fullmatch(r"an OOM kill in the same cgroup between (\d\d:\d\d:\d\d) and (\d\d:\d\d:\d\d) "
                     r"may be related", hint or "")
    assert m, hint
    assert m.group(1) == clock(fx.watch._counts[0][0]) and m.group(2) == clock(fx.watch._counts[1][0])


def test_watch_counter_rise_after_the_exit_is_not_related(fx: Fixture) -> None:
    fx.log = None
    exit_ns = time.monotonic_ns()
    fx.watch.explain(None)                     # a look after the exit: no kill yet
    fx.count(1)
    assert fx.watch.explain(600, exit_ns) is None
    # A rank that exited after that look: the rise may be of its life.
    assert fx.watch.explain(601, time.monotonic_ns()) is not None


@pytest.mark.parametrize("content", [None, "", "garbage", OOM_CONTROL_OLD, "oom_kill 1"])
def test_watch_unreadable_gives_none(tmp_path: Path, content: str | None) -> None:
    f = tmp_path / "memory.events"
    if content is not None:
        f.write_text(content)
    watch = OomWatch(MemCgroup(2, "/job", str(f)), 5)   # "oom_kill 1" is a fall: None too
    assert watch.explain(None) is None
    assert watch.explain(os.getpid()) is None


def test_watch_v2_rank_cgroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events = tmp_path / "memory.events"
    events.write_text("oom_kill 0\n")
    watch = OomWatch(MemCgroup(2, "/job", str(events)), 0)
    events.write_text("oom_kill 1\n")
    rank: dict[int, MemCgroup | None] = {
        10: MemCgroup(2, "/job", "-"), 11: MemCgroup(2, "/job/rank1", "-"),
        12: MemCgroup(2, "/elsewhere", "-"), 13: None,
    }
    monkeypatch.setattr(_oom, "memory_cgroup", lambda pid="self": rank[pid])
    monkeypatch.setattr(_oom, "read_kernel_log", lambda: None)   # the counter alone
    assert watch.explain(10) is not None       # same cgroup
    assert watch.explain(11) is not None       # a descendant: v2 counts hierarchically
    assert watch.explain(12) is None           # not ours: the rise is someone else's
    assert watch.explain(13) is not None       # unknown: the launcher's counter decides


def test_start_watch_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_: object) -> None:
        raise OSError(errno.EACCES, "denied")
    monkeypatch.setattr(_oom, "_mounts", None)
    monkeypatch.setattr(_oom, "_read", boom)
    assert _oom.start_watch() is None
    assert _oom.memory_cgroup(1) is None

    def bad(*_: object) -> None:
        raise ValueError("bad")
    monkeypatch.setattr(_oom, "_read", bad)
    assert _oom.start_watch() is None


def test_live_system_does_not_raise() -> None:
    cg = _oom.memory_cgroup()
    watch = _oom.start_watch()
    if watch is not None:
        assert watch.cgroup == cg
        assert watch.explain(os.getpid()) is None
        assert watch.explain(None) is None
        watch.stop()


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Forget the cached mount table and cgroup; list every file _oom reads."""
    monkeypatch.setattr(_oom, "_mounts", None)
    monkeypatch.setattr(_oom, "_resolved", None)
    reads: list[str] = []
    real = _oom._read

    def counting(path: str) -> str:
        reads.append(path)
        return real(path)
    monkeypatch.setattr(_oom, "_read", counting)
    return reads


def test_mount_table_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = _count_reads(monkeypatch)
    for attempt in range(2):
        reads.clear()
        watch = _oom.start_watch()
        if watch is not None:
            watch.stop(look=False)          # close() with no SIGKILL to explain
        if attempt:
            # A launch reads at most /proc/self/cgroup and one counter file;
            # such a close() nothing.
            assert len(reads) <= 2 and "/proc/self/mountinfo" not in reads, reads
    if watch is not None:
        reads.clear()
        _oom.start_watch().stop()           # a close() with one: the counter once more
        assert len(reads) <= 3, reads


def test_a_hierarchy_mounted_whole_at_its_usual_place_needs_no_mount_table(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh process's first read of /proc/self/mountinfo costs 100-200 us of
    kernel time; where the memory hierarchy is mounted whole at
    /sys/fs/cgroup/memory (v1) or /sys/fs/cgroup (v2) the watch finds the same
    counter without it."""
    text = _oom._read("/proc/self/cgroup")
    expected = _oom.resolve_memory_cgroup(text, _oom.parse_mountinfo(_oom._read("/proc/self/mountinfo")))
    usual = _oom.memory_cgroup_at_usual_mount(text)
    if usual is None:
        pytest.skip("this system's memory hierarchy is not mounted whole at its usual place")
    assert usual == expected
    reads = _count_reads(monkeypatch)
    watch = _oom.start_watch()
    assert watch is not None and watch.cgroup == expected
    watch.stop(look=False)
    assert reads == ["/proc/self/cgroup", expected.counter_file]


def test_a_subtree_mounted_at_the_usual_place_is_resolved_through_the_mount_table(
        v1_cgroup: Callable[..., Path], tmp_path: Path) -> None:
    """A container without a cgroup namespace: a bind mount of part of the
    hierarchy at /sys/fs/cgroup/memory, under which the paths of
    /proc/self/cgroup do not resolve.  Made for real in a private mount
    namespace; the watch must read the counter through the mount table."""
    if not shutil.which("unshare") or not shutil.which("mount"):
        pytest.skip("needs unshare and mount")
    cg = v1_cgroup(256 * MiB)
    script = textwrap.dedent(f"""\
        import json, os, subprocess
        from torchmp import _oom
        with open({str(cg / "cgroup.procs")!r}, "w") as f:
            f.write(str(os.getpid()))
        subprocess.run(["mount", "--bind", {str(cg)!r}, {str(V1_ROOT)!r}], check=True)
        text = _oom._read("/proc/self/cgroup")
        watch = _oom.start_watch()
        print(json.dumps({{"usual": repr(_oom.memory_cgroup_at_usual_mount(text)),
                          "cgroup": watch and watch.cgroup.path, "counter": watch and watch.cgroup.counter_file,
                          "before": watch and watch.before}}))
    """)
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", script],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path, env=launcher_env())
    if proc.returncode != 0 and "unshare failed" in proc.stderr:
        pytest.skip(f"cannot make a mount namespace: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["usual"] == "None"
    assert out["cgroup"] == "/" + cg.name
    assert out["counter"] == str(V1_ROOT / "memory.oom_control")   # the cgroup's own, seen through the mount
    assert out["before"] == 0



# --- the two files every launch reads, through kept descriptors -------------------

def _kept_fds() -> dict[int, str]:
    """This process's descriptors of /proc/self/cgroup and of a memory
    cgroup's counter file, with what each is."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target == f"/proc/{os.getpid()}/cgroup" or target.endswith(("/memory.oom_control", "/memory.events")):
            found[int(name)] = target
    return found


def _live_watch() -> OomWatch:
    _oom.start_watch()
    watch = _oom.start_watch()   # kept from the second read on
    if watch is None or not watch.cgroup.counter_file.startswith("/sys/fs/cgroup"):
        pytest.skip("no readable memory cgroup of the kernel's here")
    return watch


def test_a_launch_reads_the_oom_files_through_descriptors_it_keeps(tmp_path: Path) -> None:
    """Opening /proc/self/cgroup and the counter (a path walk each) was most
    of the OOM baseline's cost at every launch: from the second launch of
    a process on, both stay open, and a launch opens neither again.  A
    process that launches once holds no more fds than before."""
    script = textwrap.dedent("""\
        import json, os
        from torchmp import _oom
        ends = ("/cgroup", "/memory.oom_control", "/memory.events")
        def kept():
            return sorted(n for n in os.listdir("/proc/self/fd")
                          if os.path.exists(f"/proc/self/fd/{n}")
                          and os.readlink(f"/proc/self/fd/{n}").endswith(ends))
        counts = []
        for _ in range(3):
            watch = _oom.start_watch()
            counts.append(len(kept()))
        print(json.dumps({"watch": watch is not None, "counts": counts}))
    """)
    # cwd: `-c` puts it first on sys.path, and a source checkout there (CI
    # runs from one) would shadow the torchmp under test.
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path, env=launcher_env())
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    if out["watch"]:
        assert out["counts"] == [0, 2, 2]
    watch = _live_watch()
    kept = _kept_fds()
    assert sorted(kept.values()) == sorted([f"/proc/{os.getpid()}/cgroup", watch.cgroup.counter_file])
    for _ in range(3):
        again = _oom.start_watch()
        assert again is not None and again.cgroup == watch.cgroup
        assert again.before == _oom.parse_oom_control(Path(watch.cgroup.counter_file).read_text()) \
            if watch.cgroup.version == 1 else True
    assert _kept_fds() == kept


def test_a_kept_descriptor_closed_behind_its_back_is_neither_read_nor_closed(tmp_path: Path) -> None:
    """A library that closes every fd it does not know (a daemonizer) frees
    the kept number, and the next file opened may get it: the watch must
    not take that file for the counter, nor close it."""
    watch = _live_watch()
    number = next(fd for fd, target in _kept_fds().items() if target == watch.cgroup.counter_file)
    impostor = tmp_path / "memory.oom_control"
    impostor.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 977\n")
    os.close(number)
    fd = os.open(impostor, os.O_RDONLY)
    if fd != number:
        os.dup2(fd, number)
        os.close(fd)
    try:
        again = _oom.start_watch()
        assert again is not None and again.before != 977
        assert os.readlink(f"/proc/self/fd/{number}") == str(impostor)   # still open, still the impostor
        assert os.lseek(number, 0, os.SEEK_CUR) == 0
    finally:
        os.close(number)
    # The pair on its numbers again (the lowest free), for the leak guard.
    _core.drop_kept_files()
    _oom.start_watch()


def test_a_forked_child_reads_its_own_cgroup_not_its_parents() -> None:
    """The kept /proc/self/cgroup is the parent's in a forked child: the
    child closes both inherited descriptors at once and opens its own."""
    _live_watch()
    parent = os.getpid()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            inherited = [t for t in _kept_fds().values() if t == f"/proc/{parent}/cgroup"]
            _oom.start_watch()
            watch = _oom.start_watch()
            own = sorted(_kept_fds().values())
            os.write(w, json.dumps({"inherited": inherited, "own": own,
                                    "counter": watch and watch.cgroup.counter_file}).encode())
        finally:
            os._exit(0)
    os.close(w)
    try:
        with os.fdopen(r, "rb") as f:
            out = json.loads(f.read())
    finally:
        os.waitpid(pid, 0)
    assert out["inherited"] == []
    assert f"/proc/{pid}/cgroup" in out["own"] and f"/proc/{parent}/cgroup" not in out["own"]
    assert out["counter"] in out["own"]


def test_a_launch_short_of_fds_is_given_the_kept_descriptors(tmp_path: Path) -> None:
    """The kept pair is a cache: under a hard fd limit a launch that needs
    their two fds gets them, as if they had never been opened."""
    script = textwrap.dedent("""\
        import json, resource
        from torchmp import _oom
        from torchmp._launch.streams import ensure_fd_budget, fd_limits
        if _oom.start_watch() is None or _oom.start_watch() is None:   # kept from the second on
            raise SystemExit(3)
        in_use, _, _ = fd_limits()
        needed = 20
        limit = in_use + needed - 2           # room only without the kept pair
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
        ensure_fd_budget(needed, 1)
        print(json.dumps({"in_use": fd_limits()[0], "before": in_use}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path, env=launcher_env())
    if proc.returncode == 3:
        pytest.skip("no readable memory cgroup here")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["in_use"] == out["before"] - 2


# --- real OOM kills in a cgroup v1 memory cgroup ----------------------------------

V1_ROOT = Path("/sys/fs/cgroup/memory")
MiB = 1 << 20
_seq = itertools.count()

# Fills memory 1 MiB at a time; bytearray zero-fills, so every page is touched.
ALLOC = "b = []\nwhile True:\n    b.append(bytearray(1 << 20))\n"


def _v1_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create a memory cgroup"
    if not (V1_ROOT / "cgroup.procs").exists() or not (V1_ROOT / "memory.oom_control").exists():
        return f"no cgroup v1 memory hierarchy at {V1_ROOT}"
    if not os.access(V1_ROOT, os.W_OK):
        return f"{V1_ROOT} is not writable"
    if _oom.parse_oom_control((V1_ROOT / "memory.oom_control").read_text()) is None:
        return "kernel has no oom_kill counter in memory.oom_control (< 4.13)"
    return None


def _procs(cg: Path) -> list[int]:
    try:
        return [int(x) for x in (cg / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def _limit(cg: Path, limit: int) -> None:
    (cg / "memory.limit_in_bytes").write_text(str(limit))
    # memsw >= limit is enforced: set it after the limit, and equal so
    # that swap does not let the process outgrow the limit.
    if (cg / "memory.memsw.limit_in_bytes").exists():
        (cg / "memory.memsw.limit_in_bytes").write_text(str(limit))


def _remove(cg: Path, timeout: float = 5.0) -> None:
    """Kill the processes left in a memory cgroup and remove it (if it is
    still there)."""
    for pid in _procs(cg):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    # rmdir fails with EBUSY until the killed tasks are gone.
    deadline = time.monotonic() + timeout
    while True:
        try:
            cg.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


@pytest.fixture
def v1_cgroup() -> Iterator[Callable[..., Path]]:
    """make(limit) creates a child memory cgroup of the root with a limit,
    make(limit, parent=cg) one of cg; all are removed afterwards, the
    children first."""
    reason = _v1_skip_reason()
    if reason:
        pytest.skip(reason)
    made: list[Path] = []

    def make(limit: int, parent: Path | None = None) -> Path:
        cg = (parent or V1_ROOT) / f"torchmp-test-{os.getpid()}-{next(_seq)}"
        try:
            cg.mkdir()
        except OSError as e:
            if parent is None and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                pytest.skip(f"cannot create {cg}: {e}")
            raise
        made.append(cg)
        _limit(cg, limit)
        return cg

    yield make
    for cg in reversed(made):
        _remove(cg)


# Runs inside the cgroup: a rank that SIGKILLs itself (not an OOM kill), then
# a rank that allocates until the OOM killer takes it.  Each is explained
# while still a zombie (waitid WNOWAIT, as the launcher keeps it) and again
# once reaped.
DRIVER = textwrap.dedent("""\
    import json, os, signal, subprocess, sys
    from torchmp import _oom          # imported before moving: not charged to the cgroup
    cg = sys.argv[1]
    with open(cg + "/cgroup.procs", "w") as f:
        f.write(str(os.getpid()))
    watch = _oom.start_watch()
    out = {"cgroup": watch.cgroup.path, "before": watch.before}

    def run(code, key):
        child = subprocess.Popen([sys.executable, "-c", code])
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
        with open(f"/proc/{child.pid}/cgroup") as f:
            zombie_cgroup = f.read()
        zombie = watch.explain(child.pid)
        child.wait()
        out[key] = {"rc": child.returncode, "zombie": zombie, "pid": child.pid,
                    "reaped": watch.explain(child.pid), "zombie_cgroup": zombie_cgroup}

    run("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "selfkill")
    run(sys.argv[2], "oom")
    watch.stop()
    print(json.dumps(out))
""")


@pytest.mark.parametrize("attempt", range(3))
def test_v1_oom_kill_is_named(v1_cgroup: Callable[..., Path], tmp_path: Path,
                              attempt: int) -> None:
    cg = v1_cgroup(64 * MiB)
    rel = "/" + cg.relative_to(V1_ROOT).as_posix()
    t0 = time.monotonic()
    with Launcher([sys.executable, "-c", DRIVER, str(cg), ALLOC], cwd=tmp_path, unset=()) as driver:
        code, stdout, stderr = driver.communicate(60)
    elapsed = time.monotonic() - t0
    assert code == 0, stderr
    out = json.loads(stdout)
    assert out["cgroup"] == rel and out["before"] == 0

    # A SIGKILL that is not the OOM killer's is not named.
    assert out["selfkill"]["rc"] == -signal.SIGKILL
    assert out["selfkill"]["zombie"] is None and out["selfkill"]["reaped"] is None

    oom = out["oom"]
    assert oom["rc"] == -signal.SIGKILL, oom
    if kernel_log_usable():
        pattern = (r"killed by the kernel OOM killer \(memory cgroup " + re.escape(rel)
                   + rf": oom_kill 0 -> 1; the kernel log names pid {oom['pid']} at \d\d:\d\d:\d\d\)")
    else:  # the counter alone names nobody
        pattern = r"an OOM kill in the same cgroup between \S+ and \S+ may be related"
    for key in ("zombie", "reaped"):
        assert re.fullmatch(pattern, oom[key] or ""), (key, oom[key])
    assert _oom.parse_oom_control((cg / "memory.oom_control").read_text()) == 1
    # Kernel fact the design relies on: a v1 zombie's memory line reads "/".
    assert "memory:/\n" in oom["zombie_cgroup"]
    assert elapsed < 10, elapsed


def test_v1_oom_kill_counts_only_the_victims_cgroup(v1_cgroup: Callable[..., Path],
                                                    tmp_path: Path) -> None:
    # Why explain() uses the launcher's own cgroup on v1: its counter is not
    # hierarchical, an OOM kill in a child cgroup does not show in the parent.
    parent = v1_cgroup(1 << 40)
    child = v1_cgroup(64 * MiB, parent=parent)
    with Launcher(["sh", "-c", 'echo $$ > "$1/cgroup.procs" && exec "$2" -c "$3"', "sh",
                   str(child), sys.executable, ALLOC], cwd=tmp_path, unset=()) as rank:
        code, _, stderr = rank.communicate(60)
    assert code == -signal.SIGKILL, stderr
    assert _oom.parse_oom_control((child / "memory.oom_control").read_text()) == 1
    assert _oom.parse_oom_control((parent / "memory.oom_control").read_text()) == 0


def test_a_kept_counter_of_a_removed_cgroup_is_not_read(v1_cgroup: Callable[..., Path]) -> None:
    """A cgroup removed and made again at the same path (a job's cgroup,
    between two jobs): the kept descriptor is the old cgroup's file.  The
    watch must read the new one."""
    cg = v1_cgroup(64 * MiB)
    counter = str(cg / "memory.oom_control")
    (cg / "memory.oom_control").write_text("1")         # oom_kill_disable: tells the two apart
    assert _oom._read(counter).startswith("oom_kill_disable 1\n")
    assert _oom._read(counter).startswith("oom_kill_disable 1\n")   # kept from the second read on
    assert counter in _kept_fds().values()
    cg.rmdir()
    cg.mkdir()
    try:
        assert _oom._read(counter).startswith("oom_kill_disable 0\n")
    finally:
        _oom.start_watch()   # the launcher's own counter on the kept number again


RANKS = textwrap.dedent("""\
    import os, time
    if os.environ["RANK"] == "1":
        b = []
        while True:
            b.append(bytearray(1 << 20))
    time.sleep(30)
""")


def test_torchmp_run_names_oom_kill(v1_cgroup: Callable[..., Path], tmp_path: Path) -> None:
    # Room for the launcher and a sleeping rank (~40-60 MiB); rank 1 grows
    # until the OOM killer picks it, the biggest process of the cgroup.
    cg = v1_cgroup(200 * MiB)
    t0 = time.monotonic()
    with Launcher(["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cg / "cgroup.procs"),
                   sys.executable, "-m", "torchmp", "run", "-n", "2", "--log-dir", str(tmp_path / "logs"),
                   "--", sys.executable, "-c", RANKS], cwd=tmp_path) as launcher:
        code, _, err = launcher.communicate(60)
    elapsed = time.monotonic() - t0
    assert code == 128 + signal.SIGKILL, err
    assert _oom.parse_oom_control((cg / "memory.oom_control").read_text()) == 1, err
    assert "Root Cause (first observed failure):" in err, err
    root_cause = err.split("Root Cause (first observed failure):", 1)[1].split("=" * 60)[0]
    summary = err.split("torchmp: summary of", 1)[1]
    rows = [line for line in summary.splitlines() if re.match(r"\s*1\s+\d+\s", line)]
    assert len(rows) == 1, err
    if kernel_log_usable():
        assert "killed by the kernel OOM killer (memory cgroup /torchmp-test-" in root_cause, err
        assert "the kernel log names pid" in root_cause, err
        assert rows[0].endswith("root cause: killed by the kernel OOM killer"), err
    else:
        assert "an OOM kill in the same cgroup between" in root_cause, err
    assert elapsed < 10, elapsed


def kernel_log_usable() -> bool:
    """Whether this process can read the kernel's log (/dev/kmsg) and sees
    pids and cgroup paths as the kernel logs them (the initial pid and
    cgroup namespaces: inode numbers 0xEFFFFFFC and 0xEFFFFFFB)."""
    try:
        if (os.stat("/proc/self/ns/pid").st_ino, os.stat("/proc/self/ns/cgroup").st_ino) != (
                0xEFFFFFFC, 0xEFFFFFFB):
            return False
        os.close(os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK))
    except OSError:
        return False
    return True


# One run, three deaths in one memory cgroup: rank 1's helper is OOM-killed
# (rank 1 lives on), then rank 1 is SIGKILLed by hand (a bystander), then
# rank 0 grows until the OOM killer takes it (the victim).  The driver sits
# in the cgroup and waits for the result only at the end, as a launcher
# busy elsewhere would.
VICTIM_AND_BYSTANDER = textwrap.dedent("""\
    import json, os, signal, sys, time
    import torchmp
    from torchmp import DefaultLogsSpecs, _core, _oom
    cg, flags, alloc = sys.argv[1], sys.argv[2], sys.argv[3]
    if sys.argv[4] == "no-kernel-log":
        _oom.KMSG_PATH = "/nonexistent/kmsg"
    with open(cg + "/cgroup.procs", "w") as f:
        f.write(str(os.getpid()))
    victim = ("import os, time\\n"
              f"while not os.path.exists({flags + '/go'!r}): time.sleep(0.01)\\n" + alloc)
    bystander = ("import subprocess, sys, time\\n"
                 f"rc = subprocess.call([sys.executable, '-c', {alloc!r}])\\n"
                 f"open({flags + '/helper'!r}, 'w').write(f'{{rc}} {{time.time()}}')\\n"
                 "time.sleep(60)\\n")
    ctx = torchmp.start_processes("oomjob", sys.executable, {0: ("-c", victim), 1: ("-c", bystander)},
                                  {0: {}, 1: {}}, DefaultLogsSpecs(log_dir=flags + "/logs"))
    try:
        pids = ctx.pids()
        while not os.path.exists(flags + "/helper"):
            time.sleep(0.01)
        time.sleep(0.2)
        os.kill(pids[1], signal.SIGKILL)               # by hand, after the helper's OOM kill
        time.sleep(0.2)
        open(flags + "/go", "w").close()
        # The result only once torchmp has seen both deaths: a rank still
        # running when the fail-fast starts is one torchmp terminated.
        while any(info.state != _core.PROC_EXITED for info in ctx._group.snapshot()[1]):
            time.sleep(0.01)
        result = ctx.wait(60)
    finally:
        ctx.close()
    helper_rc, helper_at = open(flags + "/helper").read().split()
    print(json.dumps({"pids": pids, "helper_rc": int(helper_rc), "helper_at": float(helper_at),
                      "failures": {r: [f.exitcode, f.cause, f.message] for r, f in result.failures.items()}}))
""")


def clock_seconds(hhmmss: str) -> int:
    h, m, sec = map(int, hhmmss.split(":"))
    return h * 3600 + m * 60 + sec


@pytest.mark.parametrize("evidence", ["kernel-log", "no-kernel-log"])
def test_victim_named_bystander_not(v1_cgroup: Callable[..., Path], tmp_path: Path, evidence: str) -> None:
    if evidence == "kernel-log" and not kernel_log_usable():
        pytest.skip("the kernel log (/dev/kmsg) is not readable here in the initial namespaces")
    cg = v1_cgroup(200 * MiB)
    flags = tmp_path / "flags"
    flags.mkdir()
    with Launcher([sys.executable, "-c", VICTIM_AND_BYSTANDER, str(cg), str(flags), ALLOC, evidence],
                  cwd=tmp_path, unset=()) as driver:
        code, stdout, stderr = driver.communicate(90)
    assert code == 0, stderr
    out = json.loads(stdout)
    assert out["helper_rc"] == -signal.SIGKILL, out
    assert _oom.parse_oom_control((cg / "memory.oom_control").read_text()) == 2, out
    failures = out["failures"]
    assert sorted(failures) == ["0", "1"], out
    (victim_code, victim_cause, victim_message), (by_code, by_cause, by_message) = failures["0"], failures["1"]
    assert victim_code == by_code == -signal.SIGKILL, out
    rel = "/" + cg.relative_to(V1_ROOT).as_posix()
    victim_pid, bystander_pid = out["pids"]["0"], out["pids"]["1"]
    # The bystander: not named, whatever the evidence; an OOM kill in its
    # cgroup may be related.
    assert "OOM killer" not in by_message and by_message.startswith(
        f"Signal 9 (SIGKILL) received by PID {bystander_pid}; an OOM kill in the same cgroup "), out
    if evidence == "kernel-log":
        # ... the helper's, logged before the bystander's death.
        m = re.fullmatch(r"an OOM kill in the same cgroup at (\d\d:\d\d:\d\d) may be related", by_cause)
        assert m, out
        helper_clock = clock_seconds(time.strftime("%H:%M:%S", time.localtime(out["helper_at"])))
        assert 0 <= (helper_clock - clock_seconds(m.group(1))) % 86400 <= 2, out
        # The victim: named, the kernel's record of its pid as evidence.
        assert re.fullmatch(rf"killed by the kernel OOM killer \(memory cgroup {re.escape(rel)}: oom_kill 0 -> 2; "
                            rf"the kernel log names pid {victim_pid} at \d\d:\d\d:\d\d\)", victim_cause), out
        assert victim_message == f"Signal 9 (SIGKILL) received by PID {victim_pid}; {victim_cause}"
    else:
        # The counter alone cannot tell whose kill it counted: neither rank is named.
        for cause in (by_cause, victim_cause):
            assert re.fullmatch(r"an OOM kill in the same cgroup between \d\d:\d\d:\d\d and "
                                r"\d\d:\d\d:\d\d may be related", cause), out
