"""Facts about the machine and the checkout a run was measured on, for the
report's header and the JSON file."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import tempfile
import time
from typing import Any

from bench.common import REPO_ROOT


def machine_info() -> dict[str, Any]:
    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        libc = " ".join(platform.libc_ver())
    except Exception:  # noqa: BLE001
        libc = None
    import resource

    return {
        "nproc": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "cpu_model": cpu,
        "mem_total_bytes": mem,
        "kernel": platform.release(),
        "os": platform.platform(),
        "libc": libc,
        "python": platform.python_version(),
        "python_impl": platform.python_implementation(),
        "loadavg_at_start": os.getloadavg(),
        "rlimit_nofile": resource.getrlimit(resource.RLIMIT_NOFILE),
    }


def _mount_of(path: str) -> tuple[str, str, str] | None:
    """(mount point, file system type, source) of the mount that holds path."""
    path = os.path.realpath(path)
    best = None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                point = left.split()[4].replace("\\040", " ")
                fstype, source = right.split()[:2]
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and (best is None or len(point) >= len(best[0])):
                    best = (point, fstype, source)
    except (OSError, IndexError):
        return None
    return best


def log_dir_info(root: str, count: int = 100, keep: bool = False) -> dict[str, Any]:
    """Where the run's log directories live, and what one mkdir costs there:
    torch's layout (torch and torchmp) makes 2 + N directories per launch of
    N ranks, the stdlib and floor launchers none unless they write logs, so
    on a slow file system the launch rows measure it as much as the launchers
    (bench/README.md, "The log directories").  keep: leave the probe's
    directories in root (for root to be removed whole later)."""
    mount = _mount_of(root)
    times = []
    probe = None
    try:
        probe = tempfile.mkdtemp(prefix="mkdir-probe-", dir=root)
        for i in range(count):
            t0 = time.perf_counter_ns()
            os.mkdir(os.path.join(probe, str(i)))
            times.append(time.perf_counter_ns() - t0)
    except OSError:
        pass
    finally:
        # keep: the run removes its whole root at the end; deleting the probe
        # now would slow its next mkdirs on ext4 without a journal
        # (bench.common.retire).
        if probe is not None and not keep:
            for i in range(len(times)):
                os.rmdir(os.path.join(probe, str(i)))
            os.rmdir(probe)
    return {
        "root": root,
        "mount": mount[0] if mount else None,
        "fstype": mount[1] if mount else None,
        "source": mount[2] if mount else None,
        "mkdir_us_median": round(statistics.median(times) / 1e3, 1) if times else None,
    }


def git_info() -> dict[str, Any]:
    def git(*a):
        try:
            return subprocess.run(
                ["git", *a], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "--verify", "-q", "HEAD") or None,
            "dirty": bool(git("status", "--porcelain"))}
