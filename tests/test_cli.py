"""``torchmp run``: the real command in a subprocess, checked from outside.

Every launch carries a unique ``TORCHMP_TEST_TAG`` in its environment, which
the workers inherit; cleanup finds leftovers by that tag (never by name) and
kills their process groups, even when a test fails.
"""
from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

import torchmp

from helpers import TORCHMP_PATH, Launcher, Launchers, table_rows, tagged, wait_gone, wait_no_tagged

ROW = re.compile(
    r"^\s*(?P<rank>\d+)\s+(?P<pid>\d+)\s+(?P<exit>\S+)\s+(?P<wall>\d+\.\d{3})s\s+"
    r"(?P<cpu>\d+\.\d{3})s\s+(?P<rss>\d+\.\d) MiB(?:\s+(?P<note>.+))?$"
)


@pytest.fixture
def torchmp_cli():
    """Start ``python -m torchmp ARGS`` (a Launcher); stopped at the end of the test."""
    # Not a Slurm job's: the runs must not take their shape from it.
    unset = ["TORCHELASTIC_SIGNALS_TO_HANDLE", *(k for k in os.environ if k.startswith("SLURM_"))]
    with Launchers(trailing_pathsep=True, unset=unset) as launchers:
        def start(*args: str, env: dict[str, str] | None = None, preamble: str | None = None) -> Launcher:
            # preamble: code run in the launcher's interpreter before the command.
            head = ["-m", "torchmp"] if preamble is None else [
                "-c", textwrap.dedent(preamble) + "\nfrom torchmp.__main__ import main\nsys.exit(main())"]
            return launchers.start([sys.executable, *head, *args], env=env)

        yield start


@pytest.fixture
def run(torchmp_cli):
    """Run to completion: (returncode, stdout, stderr); checks nothing is left."""

    def go(*args: str, env: dict[str, str] | None = None, timeout: float = 60):
        c = torchmp_cli(*args, env=env)
        result = c.communicate(timeout)
        assert wait_no_tagged(c.tag) == []
        return result

    return go


def log_dir_of(stderr: str) -> Path:
    m = re.search(r"^torchmp: log directory: (.+)$", stderr, re.M)
    assert m, stderr
    return Path(m.group(1))


def summary_rows(stderr: str) -> dict[int, dict[str, str]]:
    lines = stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("torchmp: summary of "))
    assert re.fullmatch(r"rank\s+pid\s+exit\s+wall\s+cpu\s+max rss", lines[start + 1]), lines[start + 1]
    return table_rows(lines[start + 2:], ROW)


def summary_title(stderr: str) -> str:
    return next(line for line in stderr.splitlines() if line.startswith("torchmp: summary of "))


# ---------------------------------------------------------------------------
# Success


def test_success_env_output_files_and_summary(run, tmp_path):
    code, out, err = run(
        "run", "-n", "3", "--log-dir", str(tmp_path), "--",
        "sh", "-c", 'echo "$$ $RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT"; '
                    'echo "to stderr $RANK" >&2')
    assert code == 0, err
    lines = sorted(out.splitlines())
    assert len(lines) == 3
    pids, ports = {}, set()
    for rank, line in enumerate(lines):
        m = re.fullmatch(rf"\[sh{rank}\]:(\d+) {rank} {rank} 3 3 127\.0\.0\.1 (\d+)", line)
        assert m, line
        pids[rank] = int(m.group(1))
        ports.add(int(m.group(2)))
    assert len(ports) == 1 and 0 < ports.pop() < 65536

    # stderr: where the logs are (first), the teed lines, the summary (last).
    err_lines = err.splitlines()
    assert err_lines[0].startswith("torchmp: log directory: ")
    attempt = log_dir_of(err)
    assert attempt.parent.parent == tmp_path and attempt.name == "attempt_0"
    assert attempt.parent.name.startswith("sh_")
    assert sorted(ln for ln in err_lines if ln.startswith("[")) == [f"[sh{r}]:to stderr {r}" for r in range(3)]
    for rank in range(3):
        assert (attempt / str(rank) / "stdout.log").read_text() == lines[rank].split(":", 1)[1] + "\n"
        assert (attempt / str(rank) / "stderr.log").read_text() == f"to stderr {rank}\n"

    assert re.fullmatch(r"torchmp: summary of sh: 3/3 ranks succeeded, exit code 0, \d+\.\d\ds",
                        summary_title(err))
    rows = summary_rows(err)
    assert sorted(rows) == [0, 1, 2]
    for rank, row in rows.items():
        assert int(row["pid"]) == pids[rank]
        assert row["exit"] == "0" and row["note"] is None
        assert float(row["wall"]) < 10 and float(row["rss"]) > 0
    assert err_lines[-5] == summary_title(err)  # the table ends stderr


def test_console_script_entry_point_and_version(tmp_path):
    env = dict(os.environ, PYTHONPATH=TORCHMP_PATH)
    # What the installed console script runs: torchmp.__main__:main.
    script = "import sys; from torchmp.__main__ import main; sys.exit(main())"
    p = subprocess.run([sys.executable, "-c", script, "run", "-n", "2", "--no-summary",
                        "--log-dir", str(tmp_path), "--", "echo", "hi"],
                       capture_output=True, text=True, env=env, cwd="/", timeout=20)
    assert p.returncode == 0, p.stderr
    assert sorted(p.stdout.splitlines()) == ["[echo0]:hi", "[echo1]:hi"]
    p = subprocess.run([sys.executable, "-m", "torchmp", "--version"],
                       capture_output=True, text=True, env=env, cwd="/", timeout=20)
    assert p.returncode == 0 and p.stdout.strip() == f"torchmp {torchmp.__version__}"


def test_default_log_dir_is_fresh_under_tempdir(run):
    code, out, err = run("run", "-n", "1", "--no-summary", "--", "echo", "x")
    attempt = log_dir_of(err)
    root = attempt.parent.parent
    try:
        assert code == 0
        assert root.parent == Path(tempfile.gettempdir()) and root.name.startswith("torchmp_")
        assert (attempt / "0" / "stdout.log").read_text() == "x\n"
        assert out == "[echo0]:x\n"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_env_option_and_error_file(run, tmp_path):
    code, out, err = run(
        "run", "-n", "2", "--log-dir", str(tmp_path), "--no-summary",
        "--env", "FOO=a=b", "--env", "EMPTY=", "--env", "WORLD_SIZE=99", "--",
        "sh", "-c", 'echo "$FOO|$EMPTY|${EMPTY+set}|$WORLD_SIZE|$TORCHELASTIC_ERROR_FILE"')
    assert code == 0, err
    attempt = log_dir_of(err)
    assert sorted(out.splitlines()) == [
        f"[sh{r}]:a=b||set|99|{attempt / str(r) / 'error.json'}" for r in range(2)]


def test_multinode_ranks_and_master(run, tmp_path):
    code, out, err = run(
        "run", "-n", "2", "--nnodes", "3", "--node-rank", "2", "--master-addr", "10.1.2.3",
        "--master-port", "12345", "--log-dir", str(tmp_path), "--",
        "sh", "-c", 'echo "$RANK $LOCAL_RANK $GROUP_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE '
                    '$GROUP_WORLD_SIZE $MASTER_ADDR:$MASTER_PORT"')
    assert code == 0, err
    assert sorted(out.splitlines()) == [
        "[sh4]:4 0 2 6 2 3 10.1.2.3:12345",
        "[sh5]:5 1 2 6 2 3 10.1.2.3:12345",
    ]
    assert sorted(summary_rows(err)) == [4, 5]


def test_prefix_template(run, torchmp_cli, tmp_path):
    c = torchmp_cli("run", "-n", "2", "--name", "job", "--log-dir", str(tmp_path), "--prefix",
                    "{host}/{local_rank}/{rank}/{pid}/{name}|{rank:>3}> ", "--", "echo", "hi")
    code, out, err = c.communicate()
    assert code == 0, err
    host = socket.gethostname()
    assert sorted(out.splitlines()) == [
        f"{host}/{r}/{r}/{c.proc.pid}/job|  {r}> hi" for r in range(2)]
    # An empty prefix: the bare lines.
    code, out, err = run("run", "-n", "1", "--prefix", "", "--log-dir", str(tmp_path), "--",
                         "echo", "bare")
    assert code == 0 and out == "bare\n"


# ---------------------------------------------------------------------------
# Streams: redirects, tee, filter


def test_redirects_and_tee_per_rank(run, tmp_path):
    code, out, err = run(
        "run", "-n", "2", "--redirects", "0:1", "--tee", "1:3", "--log-dir", str(tmp_path),
        "--no-summary", "--", "sh", "-c", 'echo "out $RANK"; echo "err $RANK" >&2')
    assert code == 0, err
    attempt = log_dir_of(err)
    # rank 0: stdout only to its file, stderr straight to the console (no tee).
    assert (attempt / "0" / "stdout.log").read_text() == "out 0\n"
    assert not (attempt / "0" / "stderr.log").exists()
    # rank 1: both teed.
    assert (attempt / "1" / "stdout.log").read_text() == "out 1\n"
    assert (attempt / "1" / "stderr.log").read_text() == "err 1\n"
    assert out.splitlines() == ["[sh1]:out 1"]
    err_lines = err.splitlines()
    assert "err 0" in err_lines and "[sh1]:err 1" in err_lines


def test_redirects_without_tee_keep_console_quiet(run, tmp_path):
    code, out, err = run("run", "-n", "2", "--redirects", "3", "--log-dir", str(tmp_path),
                         "--no-summary", "--", "sh", "-c", 'echo "out $RANK"; echo "err $RANK" >&2')
    assert code == 0, err
    assert out == ""
    assert err.splitlines() == [f"torchmp: log directory: {log_dir_of(err)}"]
    for r in range(2):
        assert (log_dir_of(err) / str(r) / "stdout.log").read_text() == f"out {r}\n"
        assert (log_dir_of(err) / str(r) / "stderr.log").read_text() == f"err {r}\n"


def test_tee_off_is_raw_console(run, tmp_path):
    code, out, err = run("run", "-n", "2", "--tee", "0", "--log-dir", str(tmp_path),
                         "--no-summary", "--", "sh", "-c", 'echo "out $RANK"')
    assert code == 0, err
    assert sorted(out.splitlines()) == ["out 0", "out 1"]
    assert not (log_dir_of(err) / "0" / "stdout.log").exists()


def test_local_ranks_filter(run, tmp_path):
    code, out, err = run("run", "-n", "3", "--local-ranks-filter", "0,2", "--log-dir",
                         str(tmp_path), "--no-summary", "--",
                         "sh", "-c", 'echo "out $RANK"; echo "err $RANK" >&2')
    assert code == 0, err
    assert sorted(out.splitlines()) == ["[sh0]:out 0", "[sh2]:out 2"]
    assert sorted(ln for ln in err.splitlines() if ln.startswith("[")) == ["[sh0]:err 0", "[sh2]:err 2"]
    for r in range(3):  # the files are complete for every rank
        assert (log_dir_of(err) / str(r) / "stdout.log").read_text() == f"out {r}\n"


# ---------------------------------------------------------------------------
# Failures and exit codes


def test_failure_fail_fast_report_and_exit_code(run, tmp_path):
    t0 = time.monotonic()
    # The other ranks sleep far longer than any stall of a loaded CI machine
    # (one run under ASan took 16.6 s here, against 0.3-1.5 s in 460 runs
    # under load on its own): what is checked is that fail-fast stopped
    # them (SIGTERM below), not how fast the machine was.
    code, out, err = run("run", "-n", "3", "--log-dir", str(tmp_path), "--",
                         "sh", "-c", '[ "$RANK" = 1 ] && exit 7; exec sleep 600', timeout=120)
    elapsed = time.monotonic() - t0
    assert code == 7, err
    assert "\nsh FAILED\n" in err
    root = err.split("Root Cause (first observed failure):\n", 1)[1].split("\n===")[0]
    assert "  rank      : 1 (local_rank: 1)\n" in root
    assert "  exitcode  : 7 (pid: " in root
    assert re.fullmatch(r"torchmp: summary of sh: 0/3 ranks succeeded, exit code 7, \d+\.\d\ds",
                        summary_title(err))
    rows = summary_rows(err)
    assert (rows[1]["exit"], rows[1]["note"]) == ("7", "root cause")
    for r in (0, 2):
        assert (rows[r]["exit"], rows[r]["note"]) == ("SIGTERM", "terminated by torchmp")
    # the report comes before the summary, both after the workers' output
    assert err.index("sh FAILED") < err.index("torchmp: summary of")
    assert elapsed < 60, err  # fail-fast, not the sleep


def test_an_ignored_sigchld_is_set_back_so_every_exit_is_told(torchmp_cli, tmp_path):
    # Started with SIGCHLD ignored (SIG_IGN: a wrapper can leave it so, and
    # it is inherited across exec), the kernel would reap every rank at its
    # exit, status and all; torchmp run puts the default back first.
    la = torchmp_cli("run", "-n", "2", "--log-dir", str(tmp_path), "--",
                     "sh", "-c", '[ "$RANK" = 1 ] && { sleep 0.3; exit 3; }; exit 0',
                     preamble="import signal, sys\nsignal.signal(signal.SIGCHLD, signal.SIG_IGN)")
    code, out, err = la.communicate(60)
    assert wait_no_tagged(la.tag) == []
    assert code == 3, err
    assert "status was lost" not in err
    rows = summary_rows(err)
    assert (rows[0]["exit"], rows[1]["exit"], rows[1]["note"]) == ("0", "3", "root cause")


def test_signal_death_exit_code_is_128_plus_signal(run, tmp_path):
    code, out, err = run("run", "-n", "2", "--log-dir", str(tmp_path), "--",
                         "sh", "-c", '[ "$RANK" = 0 ] && kill -KILL $$; exec sleep 30')
    assert code == 128 + signal.SIGKILL
    assert "exitcode  : -9 (pid: " in err and "(SIGKILL)" in err
    rows = summary_rows(err)
    assert (rows[0]["exit"], rows[0]["note"]) == ("SIGKILL", "root cause")


def test_recorded_exception_in_report(run, tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(
        "import os\n"
        "from torchmp.errors import record\n"
        "@record\n"
        "def main():\n"
        "    if os.environ['RANK'] == '1':\n"
        "        raise ValueError('boom from rank 1')\n"
        "main()\n")
    code, out, err = run("run", "-n", "2", "--log-dir", str(tmp_path / "logs"),
                         "--redirects", "2", "--", sys.executable, str(worker))
    assert code == 1
    assert "\nworker FAILED\n" in err  # the default name: the script's stem
    root = err.split("Root Cause (first observed failure):\n", 1)[1]
    error_file = log_dir_of(err) / "1" / "error.json"
    assert f"  error_file: {error_file}\n" in root
    assert "ValueError: boom from rank 1" in root
    assert error_file.exists()
    rows = summary_rows(err)
    assert (rows[1]["exit"], rows[1]["note"]) == ("1", "root cause: ValueError: boom from rank 1")
    assert rows[0]["exit"] in ("0", "SIGTERM")  # done, or stopped by the fail-fast


@pytest.mark.parametrize("kind,code", [("missing", 127), ("not-executable", 126),
                                       ("not-on-path", 127)])
def test_command_cannot_run(run, tmp_path, kind, code):
    extra = []
    if kind == "missing":
        cmd = str(tmp_path / "no-such-program")
    elif kind == "not-executable":
        cmd = str(tmp_path / "plain-file")
        Path(cmd).write_text("#!/bin/sh\n")
    else:  # looked up on the PATH the workers get
        cmd = "true"
        extra = ["--env", f"PATH={tmp_path}"]
    rc, out, err = run("run", "-n", "2", *extra, "--log-dir", str(tmp_path / "logs"), "--", cmd)
    assert rc == code
    assert err == f"torchmp: error: cannot run {cmd!r}: " + (
        "No such file or directory\n" if code == 127 else "Permission denied\n")
    assert out == "" and not (tmp_path / "logs").exists()


def test_exec_format_error_is_126(run, tmp_path):
    cmd = tmp_path / "no-shebang"
    cmd.write_text("echo hi\n")
    cmd.chmod(0o755)
    rc, out, err = run("run", "-n", "2", "--log-dir", str(tmp_path / "logs"), "--", str(cmd))
    assert rc == 126
    assert f"torchmp: error: [Errno 8] Exec format error: '{cmd}'" in err
    assert out == ""


def test_unusable_log_dir_is_an_error(run, tmp_path):
    (tmp_path / "file").write_text("")
    rc, out, err = run("run", "-n", "1", "--log-dir", str(tmp_path / "file" / "logs"), "--", "true")
    assert rc == 1
    assert err == (f"torchmp: error: cannot create log directory {tmp_path}/file/logs: "
                   f"{tmp_path}/file is not a directory (mkdir: Not a directory)\n")
    assert out == ""


# ---------------------------------------------------------------------------
# Signals to torchmp run


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_terminates_workers(torchmp_cli, tmp_path, sig):
    # Each worker has a grandchild in its process group (a background job,
    # which a non-interactive sh starts with SIGINT ignored): it must go too,
    # after the grace period that now covers the whole group.
    c = torchmp_cli("run", "-n", "2", "--shutdown-timeout", "1", "--log-dir", str(tmp_path / "logs"), "--",
                    "sh", "-c", f'sleep 30 & echo $$ > {tmp_path}/pid.$RANK.tmp; '
                                f'mv {tmp_path}/pid.$RANK.tmp {tmp_path}/pid.$RANK; wait')
    pids = c.wait_pid_files([tmp_path / "pid.0", tmp_path / "pid.1"])
    # torchmp run, its keeper, 2 workers, 2 grandchildren -- once the `mv`
    # that renamed the last pid file has exited too (under ASan, which every
    # child preloads, its exit takes a while).
    deadline = time.monotonic() + 10
    while len(found := tagged(c.tag)) != 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(found) == 6, [(p.pid, p.name()) for p in found]
    os.kill(c.proc.pid, sig)
    code, out, err = c.communicate()
    assert code == 128 + sig
    assert f"torchmp: got {sig.name}: terminated the workers" in err
    rows = summary_rows(err)
    for r in range(2):
        assert int(rows[r]["pid"]) == pids[r]
        assert rows[r]["exit"] == sig.name  # the workers got the same signal
    assert "FAILED" not in err  # not a worker failure report
    assert wait_no_tagged(c.tag) == []


def test_stubborn_workers_are_killed_after_shutdown_timeout(torchmp_cli, tmp_path):
    c = torchmp_cli("run", "-n", "2", "--shutdown-timeout", "0.5", "--log-dir",
                    str(tmp_path / "logs"), "--", "sh", "-c",
                    f"trap '' TERM; echo $$ > {tmp_path}/pid.$RANK.tmp; "
                    f"mv {tmp_path}/pid.$RANK.tmp {tmp_path}/pid.$RANK; while :; do sleep 0.05; done")
    c.wait_pid_files([tmp_path / "pid.0", tmp_path / "pid.1"])
    t0 = time.monotonic()
    os.kill(c.proc.pid, signal.SIGTERM)
    code, out, err = c.communicate()
    assert code == 128 + signal.SIGTERM
    assert 0.4 < time.monotonic() - t0 < 5
    rows = summary_rows(err)
    assert [rows[r]["exit"] for r in range(2)] == ["SIGKILL", "SIGKILL"]
    assert wait_no_tagged(c.tag) == []


def test_a_signal_during_the_launch_gets_the_shutdown_timeout_too(torchmp_cli, tmp_path):
    # The signal lands once the workers run but before start_processes has
    # returned: it must be handled like one a moment later (--shutdown-timeout
    # 0.5), not by start_processes' own 30 s teardown.
    preamble = f"""
        import os, signal, sys, time
        from pathlib import Path
        from torchmp import api

        real_launch = api.SubprocessContext._launch

        def launch_then_signal(self, group, streams):
            real_launch(self, group, streams)
            while not all((Path("{tmp_path}") / f"pid.{{r}}").exists() for r in range(2)):
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)  # a handler would run here

        api.SubprocessContext._launch = launch_then_signal
    """
    c = torchmp_cli("run", "-n", "2", "--shutdown-timeout", "0.5", "--log-dir",
                    str(tmp_path / "logs"), "--", "sh", "-c",
                    f"trap '' TERM; echo $$ > {tmp_path}/pid.$RANK.tmp; "
                    f"mv {tmp_path}/pid.$RANK.tmp {tmp_path}/pid.$RANK; while :; do sleep 0.05; done",
                    preamble=preamble)
    pids = c.wait_pid_files([tmp_path / "pid.0", tmp_path / "pid.1"])
    t0 = time.monotonic()
    code, out, err = c.communicate()
    assert code == 128 + signal.SIGTERM, err
    assert time.monotonic() - t0 < 5
    assert "torchmp: got SIGTERM: terminated the workers" in err
    rows = summary_rows(err)
    assert [(int(rows[r]["pid"]), rows[r]["exit"]) for r in range(2)] == [
        (pids[0], "SIGKILL"), (pids[1], "SIGKILL")]
    assert wait_no_tagged(c.tag) == []


def test_second_signal_kills_at_once(torchmp_cli, tmp_path):
    c = torchmp_cli("run", "-n", "1", "--log-dir", str(tmp_path / "logs"), "--", "sh", "-c",
                    f"trap '' INT; echo $$ > {tmp_path}/pid.tmp; mv {tmp_path}/pid.tmp "
                    f"{tmp_path}/pid; while :; do sleep 0.05; done")
    [pid] = c.wait_pid_files([tmp_path / "pid"])
    os.kill(c.proc.pid, signal.SIGINT)
    time.sleep(0.3)
    assert c.proc.poll() is None  # waiting for the worker (up to 30 s)
    os.kill(c.proc.pid, signal.SIGINT)
    code, out, err = c.communicate(timeout=10)
    assert code == 128 + signal.SIGINT
    assert summary_rows(err)[0]["exit"] == "SIGKILL"
    # The SIGKILL is the death signal itself: no "unable to shut down via
    # SIGKILL, forcefully exiting via SIGKILL" after it.
    shutdown = [line for line in err.splitlines()
                if line.startswith(("torchmp: Sending", "torchmp: Unable", "torchmp: got"))]
    assert shutdown == [
        f"torchmp: Sending process {pid} closing signal SIGINT",
        f"torchmp: Sending process {pid} closing signal SIGKILL",
        "torchmp: got SIGINT: terminated the workers",
    ]


def test_sigkilled_launcher_leaves_nothing(torchmp_cli, tmp_path):
    c = torchmp_cli("run", "-n", "2", "--log-dir", str(tmp_path / "logs"), "--",
                    "sh", "-c", f'echo $$ > {tmp_path}/pid.$RANK.tmp; '
                                f'mv {tmp_path}/pid.$RANK.tmp {tmp_path}/pid.$RANK; exec sleep 30')
    pids = c.wait_pid_files([tmp_path / "pid.0", tmp_path / "pid.1"])
    os.kill(c.proc.pid, signal.SIGKILL)
    c.proc.wait(timeout=10)
    assert wait_no_tagged(c.tag) == [], pids


# ---------------------------------------------------------------------------
# Usage errors: exit 2, argparse's format, nothing started


@pytest.mark.parametrize("args,message", [
    ([], "no command given"),
    (["-n", "0"], "-n/--nproc must be at least 1, got 0"),
    (["-n", "x"], "argument -n/--nproc/--nproc-per-node: invalid int value: 'x'"),
    (["--tee", "5"], "--tee: invalid Std setting '5'"),
    (["--redirects", "0:3,7:1"], "--redirects: local rank 7 is out of range 0..1"),
    (["--local-ranks-filter", "0,a"], "--local-ranks-filter: expected a comma-separated list"),
    (["--local-ranks-filter", "2"], "--local-ranks-filter: local rank 2 is out of range 0..1"),
    (["--prefix", "{bogus}"], "--prefix: unknown field {bogus}"),
    (["--prefix", "[{rank"], "--prefix: malformed template"),
    (["--env", "NOVALUE"], "--env: expected KEY=VALUE, got 'NOVALUE'"),
    (["--nnodes", "2"], "--nnodes > 1 needs --master-addr and --master-port"),
    (["--node-rank", "1"], "--node-rank must be in 0..0, got 1"),
    (["--start-method", "thread"], "argument --start-method: invalid choice: 'thread'"),
])
def test_usage_errors(run, tmp_path, args, message):
    marker = tmp_path / "started"
    base = ["run"] if args[:2] == ["-n", "0"] or args[:2] == ["-n", "x"] else ["run", "-n", "2"]
    command = [] if message == "no command given" else ["--", "touch", str(marker)]
    code, out, err = run(*base, *args, "--log-dir", str(tmp_path / "logs"), *command)
    assert code == 2
    assert err.startswith("usage: torchmp run -n N [options] -- COMMAND [ARGS...]\n")
    assert f"torchmp run: error: {message}" in err
    assert out == ""
    assert "log directory" not in err and not marker.exists()
    assert not (tmp_path / "logs").exists()


def test_missing_nproc_and_top_level_usage(run):
    code, out, err = run("run", "--", "true")
    assert code == 2 and "the following arguments are required: -n/--nproc" in err
    code, out, err = run()
    assert code == 2 and "torchmp: error: the following arguments are required: COMMAND" in err
    code, out, err = run("bogus")
    assert code == 2 and "invalid choice: 'bogus'" in err


def test_timestamps(run, tmp_path):
    code, out, err = run("run", "-n", "2", "--timestamps", "--no-summary",
                         "--log-dir", str(tmp_path), "--",
                         "sh", "-c", 'echo "out $RANK"; echo "err $RANK" >&2; printf "last $RANK"')
    assert code == 0, err
    stamp = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"
    lines = out.splitlines()
    assert len(lines) == 4
    # Lines read at different moments carry different stamps: compare them
    # with the stamp checked and then removed.
    for line in lines:
        assert re.fullmatch(rf"\[sh\d\]:{stamp} .*", line), lines
    unstamped = sorted(re.sub(rf"^(\[sh\d\]:){stamp} ", r"\1", line) for line in lines)
    assert unstamped == ["[sh0]:last 0", "[sh0]:out 0", "[sh1]:last 1", "[sh1]:out 1"]
    for rank in range(2):
        assert re.search(rf"^\[sh{rank}\]:{stamp} err {rank}$", err, re.M), err
        # the files keep the worker's bytes
        assert (log_dir_of(err) / str(rank) / "stdout.log").read_text() == f"out {rank}\nlast {rank}"


def test_command_after_options_without_double_dash(run, tmp_path):
    # Without '--' the command starts at the first non-option; a later '--'
    # belongs to the command.
    code, out, err = run("run", "-n", "1", "--no-summary", "--log-dir", str(tmp_path),
                         "echo", "-n", "a", "--", "b")
    assert code == 0, err
    assert out == "[echo0]:a -- b\n"


# ---------------------------------------------------------------------------
# Defects: names that escape --log-dir, the count of succeeded ranks after a
# signal, log directories that cannot be made, error files that are links


@pytest.mark.parametrize("name", ["../../x", "a/b", "/abs", ".", ".."])
def test_name_that_is_not_a_plain_file_name_is_a_usage_error(run, tmp_path, name):
    # The name is the first part of the run's directory under --log-dir: a
    # '/' in it would put the logs (and error files) somewhere else.
    base = tmp_path / "a" / "b"
    marker = tmp_path / "started"
    code, out, err = run("run", "-n", "1", "--name", name, "--log-dir", str(base),
                         "--", "touch", str(marker))
    assert code == 2
    assert err == (
        "usage: torchmp run -n N [options] -- COMMAND [ARGS...]\n"
        f"torchmp run: error: --name: {name!r} cannot name the run's log directory "
        "(it must not contain '/' or a NUL byte, nor be '.' or '..')\n")
    assert out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing created, anywhere


def test_name_with_nul_byte_is_a_usage_error(tmp_path, capsys):
    from torchmp import cli

    marker = tmp_path / "started"
    with pytest.raises(SystemExit) as exc:
        cli.main(["-n", "1", "--name", "a\0b", "--log-dir", str(tmp_path / "logs"),
                  "--", "touch", str(marker)])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.endswith(
        "torchmp run: error: --name: 'a\\x00b' cannot name the run's log directory "
        "(it must not contain '/' or a NUL byte, nor be '.' or '..')\n")
    assert list(tmp_path.iterdir()) == []


def test_plain_names_with_dots_are_fine(run, tmp_path):
    code, out, err = run("run", "-n", "1", "--name", "..job.v2", "--no-summary",
                         "--log-dir", str(tmp_path), "--", "true")
    assert code == 0, err
    assert log_dir_of(err).parent.parent == tmp_path
    assert log_dir_of(err).parent.name.startswith("..job.v2_")


def _pid_file_cmd(tmp_path: Path, body: str) -> str:
    return (f"echo $$ > {tmp_path}/pid.$RANK.tmp; mv {tmp_path}/pid.$RANK.tmp "
            f"{tmp_path}/pid.$RANK; {body}")


def test_ranks_that_exit_0_on_the_launchers_signal_did_not_succeed(torchmp_cli, tmp_path):
    # Rank 0 finishes before torchmp run gets SIGTERM: it succeeded. Ranks 1
    # and 2 exit 0 when the signal is passed on to them: terminated, not a
    # success -- the exit code (143) says the run did not complete.
    c = torchmp_cli("run", "-n", "3", "--log-dir", str(tmp_path / "logs"), "--", "sh", "-c",
                    _pid_file_cmd(tmp_path, '[ "$RANK" = 0 ] && exit 0; '
                                            "trap 'exit 0' TERM; sleep 30 & wait"))
    pids = c.wait_pid_files([tmp_path / f"pid.{r}" for r in range(3)])
    assert wait_gone([pids[0]]) == []  # exited (a zombie, or reaped already)
    time.sleep(0.3)  # for torchmp run to see the exit (its pidfd wakes at once)
    os.kill(c.proc.pid, signal.SIGTERM)
    code, out, err = c.communicate()
    assert code == 128 + signal.SIGTERM
    assert re.fullmatch(r"torchmp: summary of sh: 1/3 ranks succeeded, exit code 143, \d+\.\d\ds",
                        summary_title(err)), err
    rows = summary_rows(err)
    assert [(rows[r]["exit"], rows[r]["note"]) for r in range(3)] == [
        ("0", None), ("0", "terminated by torchmp"), ("0", "terminated by torchmp")]
    assert wait_no_tagged(c.tag) == []


def test_ranks_that_exit_0_on_the_fail_fast_did_not_succeed(run, tmp_path):
    # Ranks 0 and 2 say they are ready only once their trap and background
    # job are in place: a job forked after the fail-fast signal would miss
    # it and hold its group for the whole grace period.
    code, out, err = run("run", "-n", "3", "--log-dir", str(tmp_path / "logs"), "--", "sh", "-c",
                         f'if [ "$RANK" = 1 ]; then '
                         f'while [ ! -e {tmp_path}/pid.0 ] || '
                         f'[ ! -e {tmp_path}/pid.2 ]; do sleep 0.01; done; '
                         "exit 7; fi; trap 'exit 0' TERM; sleep 30 & "
                         + _pid_file_cmd(tmp_path, "wait"))
    assert code == 7
    assert re.fullmatch(r"torchmp: summary of sh: 0/3 ranks succeeded, exit code 7, \d+\.\d\ds",
                        summary_title(err)), err
    rows = summary_rows(err)
    assert [(rows[r]["exit"], rows[r]["note"]) for r in range(3)] == [
        ("0", "terminated by torchmp"), ("7", "root cause"), ("0", "terminated by torchmp")]


@pytest.mark.parametrize("log_dir,message", [
    # procfs answers mkdir with ENOENT although /proc exists: name the real cause
    ("/proc/x", "cannot create log directory /proc/x: /proc is not writable "
                "(mkdir: No such file or directory)"),
    ("/proc/x/y/z", "cannot create log directory /proc/x/y/z: /proc is not writable "
                    "(mkdir /proc/x: No such file or directory)"),
])
def test_log_dir_that_cannot_be_created(run, tmp_path, log_dir, message):
    marker = tmp_path / "started"
    code, out, err = run("run", "-n", "1", "--log-dir", log_dir, "--", "touch", str(marker))
    assert code == 1
    assert err == f"torchmp: error: {message}\n"
    assert out == "" and not marker.exists()


def test_log_dir_in_which_no_run_directory_can_be_made(run, tmp_path):
    # /proc exists and is a directory, but the run's directory cannot be made in it.
    marker = tmp_path / "started"
    code, out, err = run("run", "-n", "1", "--log-dir", "/proc", "--", "touch", str(marker))
    assert code == 1
    assert re.fullmatch(r"torchmp: error: cannot create log directory /proc/touch_\w+: "
                        r"/proc is not writable \(mkdir: No such file or directory\)\n", err), err
    assert out == "" and not marker.exists()


def test_log_dir_that_is_a_dangling_symlink(run, tmp_path):
    link = tmp_path / "logs"
    link.symlink_to(tmp_path / "gone")
    code, out, err = run("run", "-n", "1", "--log-dir", str(link), "--", "true")
    assert code == 1
    assert err == (f"torchmp: error: cannot create log directory {link}: {link} is a "
                   "dangling symbolic link (mkdir: File exists)\n")


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_log_dir_permission_denied(run, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        code, out, err = run("run", "-n", "1", "--log-dir", str(locked / "a" / "logs"),
                             "--", "true")
    finally:
        locked.chmod(0o700)
    assert code == 1
    assert err == (f"torchmp: error: cannot create log directory {locked}/a/logs: {locked} "
                   f"is not writable (mkdir {locked}/a: Permission denied)\n")


@pytest.mark.parametrize("errno_,strerror,expected", [
    (errno.EACCES, "Permission denied",
     "cannot create log directory {d}/a/logs: {d} is not writable "
     "(mkdir {d}/a: Permission denied)"),
    (errno.EROFS, "Read-only file system",
     "cannot create log directory {d}/a/logs: Read-only file system (mkdir {d}/a)"),
    (errno.ENOSPC, "No space left on device",
     "cannot create log directory {d}/a: No space left on device"),
])
def test_mkdir_error_messages(tmp_path, errno_, strerror, expected):
    # The message built from hand-made errors, as root too: {d} is mode 0500.
    from torchmp.cli.logdir import describe_mkdir_error

    d = tmp_path / "locked"
    d.mkdir(mode=0o500)
    failing = f"{d}/a"
    requested = f"{d}/a/logs" if errno_ != errno.ENOSPC else failing
    e = OSError(errno_, strerror, failing)
    try:
        assert describe_mkdir_error(e, requested) == expected.format(d=d)
    finally:
        d.chmod(0o700)


def test_symlinked_error_file_is_not_followed(run, tmp_path):
    # A worker pointing its error file at something else (here a file too big
    # to read; /proc/kmsg or a FIFO alike) gets "no error file", and a warning.
    big = tmp_path / "big"
    big.write_bytes(b"x" * (2 << 20))
    code, out, err = run("run", "-n", "1", "--log-dir", str(tmp_path / "logs"), "--", "sh", "-c",
                         f'ln -s {big} "$TORCHELASTIC_ERROR_FILE"; exit 3')
    assert code == 3
    error_file = log_dir_of(err) / "0" / "error.json"
    assert re.search(rf"^torchmp: rank 0 \(pid \d+\): error file {re.escape(str(error_file))} "
                     r"is a symbolic link, not a regular file; ignored \(no error file\)$", err, re.M)
    root = err.split("Root Cause (first observed failure):\n", 1)[1]
    assert "  error_file: <N/A>\n" in root
    assert ("  traceback : To enable traceback see: "
            "https://pytorch.org/docs/stable/elastic/errors.html\n") in root
