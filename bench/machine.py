"""Facts about the machine and the checkout a run was measured on, for the
report's header and the JSON file."""

from __future__ import annotations

import os
import platform
import subprocess
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
