"""csrc/poller.c on its own: tests/c/poller_test.c, compiled here with the
system C compiler against poller.c alone, run once per backend (epoll, poll)
and build (plain; TORCHMP_PORTABLE, where epoll is not built in; ASan +
UBSan with leak checking, where the compiler has them).

The driver checks add/remove/re-add, readiness of pipes and sockets, hangups,
timeouts, a signal during a wait, a thousand fds (every ready one gets its
turn when there are more than a wait returns), the epoll fd's own
readiness, torchmp_wait_readable, and the errors (bad fd, an fd added twice,
removing what is not watched, a regular file); it prints ``ok <case>`` per
case and exits 0 only if every check passed.  Skipped where there is no C
compiler or no csrc/ (tests run from an installed copy).
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
CSRC = HERE.parent / "csrc"
DRIVER = HERE / "c" / "poller_test.c"

CASES = ["case_new_and_free", "case_timeouts", "case_pipe_readiness", "case_wakes_on_data", "case_hangup",
         "case_writable", "case_modify", "case_errors", "case_many_fds", "case_interrupted", "case_nested",
         "case_wait_readable"]

BUILDS = {
    "plain": ["-O2"],
    "portable": ["-O2", "-DTORCHMP_PORTABLE"],
    "sanitized": ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
                  "-fno-sanitize-recover=undefined"],
}


def _compiler() -> list[str] | None:
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    argv = shlex.split(cc)
    if not argv or shutil.which(argv[0]) is None:
        return None
    return argv


def _clean_env() -> dict[str, str]:
    # Not the sanitizer preload .ci/sanitize runs the suite under: the
    # compiler is no part of what it checks, and the sanitized driver
    # brings its own runtime.
    return {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


@pytest.fixture(scope="module")
def binaries(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path | str]:
    """build name -> the driver binary, or why it could not be built."""
    if not (CSRC / "poller.c").is_file() or not DRIVER.is_file():
        pytest.skip("csrc/ and tests/c/ are not here (tests run from an installed copy)")
    cc = _compiler()
    if cc is None:
        pytest.skip("no C compiler")
    out = tmp_path_factory.mktemp("poller")
    built: dict[str, Path | str] = {}
    for name, flags in BUILDS.items():
        exe = out / f"poller_test_{name}"
        cmd = cc + ["-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter", *flags, f"-I{CSRC}",
                    "-o", str(exe), str(DRIVER), str(CSRC / "poller.c"), "-pthread"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=_clean_env(), timeout=300)
        if proc.returncode == 0:
            built[name] = exe
        elif name == "sanitized":
            built[name] = f"the compiler cannot build with sanitizers: {proc.stderr.strip()[-500:]}"
        else:
            pytest.fail(f"compiling the poller test driver failed:\n$ {shlex.join(cmd)}\n{proc.stderr}")
    return built


def _run(exe: Path, backend: str, sanitized: bool) -> subprocess.CompletedProcess[str]:
    env = _clean_env()
    if sanitized:
        # Leaks count here (the suite's own ASan options switch them off for
        # CPython's sake); reports still go where the caller sends them.
        env["ASAN_OPTIONS"] = ":".join(filter(None, [env.get("ASAN_OPTIONS"), "detect_leaks=1"]))
        env["UBSAN_OPTIONS"] = ":".join(filter(None, [env.get("UBSAN_OPTIONS"), "print_stacktrace=1"]))
    return subprocess.run([str(exe), backend], capture_output=True, text=True, env=env, timeout=120)


def _epoll_built(build: str) -> bool:
    return sys.platform.startswith("linux") and build != "portable"


@pytest.mark.parametrize("backend", ["epoll", "poll"])
@pytest.mark.parametrize("build", list(BUILDS))
def test_poller_backend(binaries: dict[str, Path | str], build: str, backend: str) -> None:
    exe = binaries[build]
    if isinstance(exe, str):
        pytest.skip(exe)
    proc = _run(exe, backend, build == "sanitized")
    report = f"exit {proc.returncode}\n--- stdout\n{proc.stdout}--- stderr\n{proc.stderr}"
    assert proc.returncode == 0, report
    lines = proc.stdout.splitlines()
    assert not [line for line in lines if line.startswith("FAIL")], report
    if backend == "epoll" and not _epoll_built(build):
        # Not compiled in: asking for it says so (ENOSYS), and nothing else runs.
        assert len(lines) == 1 and lines[0].startswith("epoll: not built"), report
        return
    assert [line[3:] for line in lines if line.startswith("ok ")] == CASES, report
    summary = lines[-1].split()
    assert summary[0] == f"{backend}:" and summary[3:] == ["0", "failed"] and int(summary[1]) > 1000, report
    assert "runtime error" not in proc.stderr and "Sanitizer" not in proc.stderr, report


def test_driver_rejects_an_unknown_backend(binaries: dict[str, Path | str]) -> None:
    exe = binaries["plain"]
    assert isinstance(exe, Path)
    proc = subprocess.run([str(exe), "kqueue"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "usage" in proc.stderr
