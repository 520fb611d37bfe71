"""Naming deaths by the kernel OOM killer (torchmp/_oom.py).

The parsers and the cgroup path resolution are tested on fixture text; the
real tests create a child memory cgroup with a small limit on the cgroup v1
hierarchy (root only, skipped where it is not writable) and get a process
OOM-killed in it.
"""
from __future__ import annotations

import errno
import itertools
import json
import os
import re
import signal
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from torchmp import _oom
from torchmp._oom import MemCgroup, Mount, OomWatch

from helpers import Launcher

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


# --- OomWatch on fixture files ----------------------------------------------------

def test_watch_explains_a_rise(tmp_path: Path) -> None:
    events = tmp_path / "memory.events"
    events.write_text(MEMORY_EVENTS)          # oom_kill 2
    watch = OomWatch(MemCgroup(2, "/job", str(events)), _oom.read_oom_kills(
        MemCgroup(2, "/job", str(events))) or 0)
    assert watch.before == 2
    assert watch.explain(None) is None
    events.write_text(MEMORY_EVENTS.replace("oom_kill 2", "oom_kill 3"))
    assert watch.explain(None) == (
        "killed by the kernel OOM killer (memory cgroup /job: oom_kill 2 -> 3)")
    # a pid whose cgroup cannot be read (reaped): the launcher's counter decides
    assert watch.explain(2**22 + 1) is not None


def test_watch_v1_format(tmp_path: Path) -> None:
    ctl = tmp_path / "memory.oom_control"
    ctl.write_text(OOM_CONTROL.replace("oom_kill 7", "oom_kill 0"))
    watch = OomWatch(MemCgroup(1, "/torchmp-test-123", str(ctl)), 0)
    ctl.write_text(OOM_CONTROL.replace("oom_kill 7", "oom_kill 1"))
    # On v1 the pid is not consulted: the kernel lists "/" for an exiting task.
    assert watch.explain(os.getpid()) == (
        "killed by the kernel OOM killer (memory cgroup /torchmp-test-123: oom_kill 0 -> 1)")


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
    events.write_text("oom_kill 1\n")
    watch = OomWatch(MemCgroup(2, "/job", str(events)), 0)
    rank: dict[int, MemCgroup | None] = {
        10: MemCgroup(2, "/job", "-"), 11: MemCgroup(2, "/job/rank1", "-"),
        12: MemCgroup(2, "/elsewhere", "-"), 13: None,
    }
    monkeypatch.setattr(_oom, "memory_cgroup", lambda pid="self": rank[pid])
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


def test_mount_table_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_oom, "_mounts", None)
    reads: list[str] = []
    real = _oom._read

    def counting(path: str) -> str:
        reads.append(path)
        return real(path)
    monkeypatch.setattr(_oom, "_read", counting)
    _oom.start_watch()
    reads.clear()
    _oom.start_watch()
    # A launch reads at most /proc/self/cgroup and one counter file.
    assert len(reads) <= 2 and "/proc/self/mountinfo" not in reads, reads


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
        out[key] = {"rc": child.returncode, "zombie": zombie,
                    "reaped": watch.explain(child.pid), "zombie_cgroup": zombie_cgroup}

    run("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "selfkill")
    run(sys.argv[2], "oom")
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
    pattern = (r"killed by the kernel OOM killer \(memory cgroup "
               + re.escape(rel) + r": oom_kill (\d+) -> (\d+)\)")
    for key in ("zombie", "reaped"):
        m = re.fullmatch(pattern, oom[key] or "")
        assert m, (key, oom[key])
        assert int(m.group(2)) == int(m.group(1)) + 1 == 1
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
    # The environment as it is, less PYTHONPATH: the installed torchmp.
    with Launcher(["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cg / "cgroup.procs"),
                   sys.executable, "-m", "torchmp", "run", "-n", "2", "--log-dir", str(tmp_path / "logs"),
                   "--", sys.executable, "-c", RANKS], cwd=tmp_path, unset=("PYTHONPATH",)) as launcher:
        code, _, err = launcher.communicate(60)
    elapsed = time.monotonic() - t0
    assert code == 128 + signal.SIGKILL, err
    assert _oom.parse_oom_control((cg / "memory.oom_control").read_text()) == 1, err
    assert "Root Cause (first observed failure):" in err, err
    root_cause = err.split("Root Cause (first observed failure):", 1)[1].split("=" * 60)[0]
    assert "killed by the kernel OOM killer (memory cgroup /torchmp-test-" in root_cause, err
    summary = err.split("torchmp: summary of", 1)[1]
    rows = [line for line in summary.splitlines() if re.match(r"\s*1\s+\d+\s", line)]
    assert len(rows) == 1 and "OOM killer" in rows[0], err
    assert elapsed < 10, elapsed
