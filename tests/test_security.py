"""Security: permissions, size caps, environment hygiene, literal arguments.

Covered elsewhere (not repeated): a binary's argv is literal, never a shell
(test_spawn.py); env keys/values with NUL or '=' are rejected
(test_spawn.py); a symlink planted as a log file is not followed
(test_lifecycle.py); error.json is read with a size cap
(test_errors_reading.py).  Here:

* log files and directories get their permissions from the umask, as torch
  creates them, and the workers run with the launcher's umask;
* a worker writing a 1 GB (sparse) error.json does not blow up the
  launcher's memory, and the failure says why the file was not read;
* a worker's environment is exactly os.environ + envs[rank] (+ the error
  file variable): nothing deleted from os.environ, nothing set behind
  os.environ's back, nothing of torchmp's own;
* a function launch's args reach the function literally, shell
  metacharacters included;
* a FIFO planted as a log file does not hang the launcher.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchmp import Std
from torchmp._launch import forkserver as _forkserver
from torchmp.errors import ChildFailedError

from helpers import launch, run_launcher

METHODS = ("spawn", "fork", "forkserver")


@pytest.fixture
def secworkers():
    """tests/workers/security.py, importable here and in spawned workers (they
    get the launcher's sys.path, tests/ on it)."""
    from workers import security as mod
    return mod


@pytest.fixture(autouse=True)
def _no_forkserver_left():
    yield
    _forkserver.get_forkserver()._stop()  # before the leak guard looks for children


# --- permissions from the umask ------------------------------------------------------

_UMASK_LAUNCHER = """
import json, os, stat, sys
import torchmp
from torchmp import Std

root = sys.argv[1]
os.umask(0o027)
specs = torchmp.DefaultLogsSpecs(log_dir=os.path.join(root, "default"), redirects={0: Std.ALL}, tee={1: Std.ALL})
ctx = torchmp.start_processes("w", "sh", {0: ("-c", "umask; echo err >&2"), 1: ("-c", "echo out; echo err >&2")},
                              {0: {}, 1: {}}, specs, duplicate_stdout_filters=["out"])
r = ctx.wait(30)
ctx.close()
assert not r.is_failed(), r
# the torch 1.9 form
ctx = torchmp.start_processes("w", "sh", {0: ("-c", "echo legacy")}, {0: {}}, os.path.join(root, "legacy"),
                              "spawn", Std.ALL, Std.NONE)
assert not ctx.wait(30).is_failed()
ctx.close()
modes = {}
for top, dirs, files in os.walk(root):
    for name in dirs + files:
        path = os.path.join(top, name)
        modes[os.path.relpath(path, root)] = stat.S_IMODE(os.lstat(path).st_mode)
print(json.dumps({"umask_after": os.umask(0o022), "modes": modes,
                  "worker_umask": open(r.stdouts[0]).read().strip()}))
"""


def test_log_files_and_directories_take_their_mode_from_the_umask(tmp_path):
    res = run_launcher(_UMASK_LAUNCHER.replace("sys.argv[1]", repr(str(tmp_path))))
    assert res.returncode == 0, res.stderr.decode()[-3000:]
    report = json.loads(res.stdout.splitlines()[-1])  # after rank 1's teed line
    assert report["umask_after"] == 0o027  # torchmp does not change the launcher's umask
    assert report["worker_umask"] == "0027"  # and the workers inherit it
    modes = report["modes"]
    files = {p: m for p, m in modes.items() if p.endswith((".log", ".json"))}
    dirs = {p: m for p, m in modes.items() if p not in files}
    names = {os.path.basename(p) for p in files}
    assert {"stdout.log", "stderr.log", "filtered_stdout.log"} <= names, sorted(modes)
    assert all(m == 0o640 for m in files.values()), {p: oct(m) for p, m in files.items()}
    # Directories as torch makes them: os.makedirs (0o777 & ~umask), except
    # the run directory, which torch creates with tempfile.mkdtemp (0o700).
    run_dirs = [p for p in dirs if p.count(os.sep) == 1 and p.startswith("default" + os.sep)]
    assert len(run_dirs) == 1 and dirs[run_dirs[0]] == 0o700
    others = {p: m for p, m in dirs.items() if p not in run_dirs}
    assert {"default", "legacy", os.path.join("legacy", "0")} <= set(others)
    assert any(p.endswith("attempt_0") for p in others)
    assert all(m == 0o750 for m in others.values()), {p: oct(m) for p, m in others.items()}


# --- error.json size cap, end to end ----------------------------------------------------

def test_a_1gb_error_file_from_a_worker_does_not_exhaust_the_launcher(tmp_path):
    code = ("import os, sys\n"
            "with open(os.environ['TORCHELASTIC_ERROR_FILE'], 'wb') as f:\n"
            "    f.truncate(1 << 30)\n"
            "sys.exit(1)")
    maxrss_before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    ctx = launch(sys.executable, {0: ("-c", code)}, log_dir=tmp_path)
    result = ctx.wait(30)
    ctx.close()
    report = str(ChildFailedError("trainer", result.failures))
    elapsed = time.monotonic() - t0
    grown_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - maxrss_before_kb
    failure = result.failures[0]
    assert os.path.getsize(failure.error_file) == 1 << 30
    assert failure.exitcode == 1
    assert "is larger than" in failure.message and "not read" in failure.message
    assert failure.error_file in report and "larger than" in report
    assert grown_kb < 100 * 1024, f"the launcher's max RSS grew by {grown_kb} KiB"
    assert elapsed < 10


# --- the environment a worker gets -------------------------------------------------------

def _parse_env0(data: bytes) -> dict[str, str]:
    return dict(item.split("=", 1) for item in data.decode("utf-8", "surrogateescape").split("\0") if item)


@pytest.fixture
def env_changes(monkeypatch):
    """Changes to the launcher's environment the workers must reflect: one
    variable deleted from os.environ, one added, one set with os.putenv only
    (not part of os.environ, so not part of what a worker gets)."""
    monkeypatch.setenv("TORCHMP_SEC_DELETED", "secret")
    monkeypatch.delenv("TORCHMP_SEC_DELETED")
    monkeypatch.setenv("TORCHMP_SEC_ADDED", "added")
    os.putenv("TORCHMP_SEC_PUTENV", "behind os.environ's back")
    yield
    os.unsetenv("TORCHMP_SEC_PUTENV")


def _expected_env(envs_rank: dict) -> dict[str, str]:
    expected = dict(os.environ)
    expected.update({k: str(v) for k, v in envs_rank.items()})
    return expected


def test_binary_worker_env_is_os_environ_plus_envs_and_nothing_else(tmp_path, env_changes):
    envs = {0: {"LOCAL_RANK": 0, "TORCHMP_SEC_OVERRIDE": "child"}}
    ctx = launch("env", {0: ("-0",)}, envs, log_dir=tmp_path, redirects=Std.OUT)
    result = ctx.wait(30)
    ctx.close()
    assert not result.is_failed()
    worker = _parse_env0(Path(result.stdouts[0]).read_bytes())
    expected = _expected_env(envs[0])
    assert "TORCHELASTIC_ERROR_FILE" in expected  # set in envs by the logs specs
    assert worker == expected, {"extra": set(worker) - set(expected), "missing": set(expected) - set(worker)}


# forkserver: found by this suite (workers got the server's environment from
# when it started: a variable deleted from os.environ since still reached
# them); fixed in 73725f8.
@pytest.mark.parametrize("start_method", METHODS)
def test_function_worker_env_is_os_environ_plus_envs_and_nothing_else(tmp_path, secworkers, monkeypatch,
                                                                      start_method):
    monkeypatch.setenv("TORCHMP_SEC_DELETED", "secret")
    # A forkserver started now sees the variable; the launch below must not.
    warm = launch(secworkers.environ, {0: ()}, log_dir=tmp_path / "warm", start_method=start_method)
    assert not warm.wait(60).is_failed()
    warm.close()
    monkeypatch.delenv("TORCHMP_SEC_DELETED")
    monkeypatch.setenv("TORCHMP_SEC_ADDED", "added")
    envs = {0: {"LOCAL_RANK": 0, "TORCHMP_SEC_OVERRIDE": "child"}, 1: {"LOCAL_RANK": "1"}}
    ctx = launch(secworkers.environ, {0: (), 1: ()}, envs, log_dir=tmp_path / "logs", start_method=start_method)
    result = ctx.wait(60)
    ctx.close()
    assert not result.is_failed(), result.failures
    for rank in (0, 1):
        expected = _expected_env(envs[rank])
        seen = result.return_values[rank]
        # A spawned worker's whole C environment is os.environ + envs; a
        # forked one inherits the launcher's C environment, which may hold
        # more than os.environ (pytest sets COLUMNS/LINES behind its back).
        for where in ("os.environ", "child") if start_method != "fork" else ("os.environ",):
            got = seen[where]
            assert got == expected, (where, {"extra": set(got) - set(expected), "missing": set(expected) - set(got)})


# --- function args stay literal ------------------------------------------------------------

TRICKY = ("a b", "'q'", '"dq"', "$(echo pwned)", "`id`", "; rm -rf /", "&& echo x", "| cat", "*", "~", "$HOME",
          "\\", "\n", "", "\u00e9\u4e2d", "-n", "--", "%s%n", "${IFS}", "> /tmp/torchmp-pwned")


@pytest.mark.parametrize("start_method", METHODS)
def test_function_args_with_shell_metacharacters_stay_literal(tmp_path, secworkers, start_method):
    ctx = launch(secworkers.echo_args, {0: TRICKY, 1: ("$(touch /tmp/torchmp-pwned)",)}, log_dir=tmp_path,
                 start_method=start_method)
    result = ctx.wait(60)
    ctx.close()
    assert not result.is_failed(), result.failures
    args, printed = result.return_values[0]
    assert args == TRICKY
    assert printed == [a.encode() for a in TRICKY]
    assert result.return_values[1][0] == ("$(touch /tmp/torchmp-pwned)",)
    assert not os.path.exists("/tmp/torchmp-pwned")


# --- a FIFO planted as a log file ---------------------------------------------------------

_FIFO_LAUNCHER = """
import os, sys
from torchmp import SubprocessContext, DefaultLogsSpecs, Std
ctx = SubprocessContext("t", "echo", {0: ("x",)}, {0: {}}, DefaultLogsSpecs(log_dir=sys.argv[1], redirects=Std.OUT))
os.mkfifo(ctx.stdouts[0])
try:
    ctx.start()
except OSError as e:
    print("refused", e.errno, flush=True)
else:
    r = ctx.wait(10)
    print("started", r is not None, flush=True)
ctx.close()
"""


# Found by this suite (the launcher blocked in open() forever); fixed in 73725f8.
def test_a_fifo_planted_as_a_log_file_does_not_hang_the_launcher(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _FIFO_LAUNCHER, str(tmp_path / "logs")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd="/", start_new_session=True)
    try:
        out, err = proc.communicate(timeout=3)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("the launcher hung opening a FIFO planted as its log file")
    assert out.startswith((b"refused", b"started True")), err.decode()[-2000:]
