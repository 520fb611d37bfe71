"""``torchmp torchrun``: torch's torchrun with torchmp managing the workers.

Skipped without PyTorch (``.ci/run`` installs torch 2.13).  Each test runs
the real command in a subprocess, bounded by a timeout; every process a test
starts carries a unique ``TORCHMP_TEST_TAG`` in its environment, and cleanup
kills what is left by that tag (process group, then pid), even on failure.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from helpers import TORCHMP_PATH, Launcher, Launchers, wait_no_tagged

# torch is imported by the first test that runs, not at collection: the
# suite runs its torch tests last (conftest.py), so that most tests do not
# fork and collect a process that holds torch.
pytestmark = [pytest.mark.torch,
              pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")]


@pytest.fixture(scope="module", autouse=True)
def _torch_distributed() -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("torch.distributed.run")
    if not torch.distributed.is_available():  # pragma: no cover
        pytest.skip("torch.distributed is not available")

TORCHMP = [sys.executable, "-m", "torchmp", "torchrun"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]

# Printed by every worker: torchmp's workers have PDEATHSIG=SIGKILL, torch's none.
PDEATHSIG_SNIPPET = """
import ctypes, signal
def pdeathsig():
    libc = ctypes.CDLL(None, use_errno=True)
    value = ctypes.c_int(0)
    libc.prctl(2, ctypes.byref(value), 0, 0, 0)  # PR_GET_PDEATHSIG
    return value.value
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def launch():
    """Start a command (a Launcher) with OMP_NUM_THREADS=1 unless set, and
    no TORCHELASTIC_*, LOGLEVEL or TORCH_LOGS of ours; stopped at the end of
    the test."""
    with Launchers(trailing_pathsep=True) as launchers:
        def start(argv: list[str], env: dict[str, str] | None = None) -> Launcher:
            unset = [key for key in os.environ if key.startswith("TORCHELASTIC_") or key in ("LOGLEVEL", "TORCH_LOGS")]
            full_env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
            return launchers.start(argv, env=full_env, unset=unset)

        yield start


# The time limits below only guard against a hang.  Every agent and most
# workers here import torch first: seconds each, tens of seconds at the end
# of a CI round that runs beside two ASan rounds.
HANG_SECONDS = 150


def run_job(launch, argv, env=None, timeout=HANG_SECONDS):
    job = launch(argv, env)
    result = job.communicate(timeout)
    assert wait_no_tagged(job.tag) == [], "processes left behind"
    return result


def wait_for_workers(job: Launcher, pids_dir: Path, pattern: str = "[0-9]", count: int = 2) -> None:
    """Until the agent's workers have written their pid files (the agents
    import torch before they start anything: HANG_SECONDS); an agent that
    exited instead is reported with its output."""
    deadline = time.monotonic() + HANG_SECONDS
    while len(list(pids_dir.glob(pattern))) < count:
        if job.proc.poll() is not None:
            code, out, err = job.communicate(10)
            pytest.fail(f"the agent exited ({code}) before its workers started:\n{out}\n{err}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {count} workers after {HANG_SECONDS} s: {sorted(p.name for p in pids_dir.iterdir())}")
        time.sleep(0.02)


def worker_lines(text: str, prefix: str = "[default") -> list[str]:
    return sorted(line for line in text.splitlines() if line.startswith(prefix))


def printed_per_rank(text: str, header: str = r"\[default\d+\]:") -> dict[str, str]:
    """What each rank printed, in order, whatever the line breaks.

    torch's tail threads read the log files and can catch a line mid-write:
    they then print it in two pieces, each with the prefix.  Comparing the
    text per rank rather than the lines keeps a torch tear from failing a
    parity test; torchmp's own lines are checked exactly against the logs."""
    printed: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = re.match(f"({header})(.*)$", line)
        if m:
            printed.setdefault(m.group(1), []).append(m.group(2))
    return {rank: "".join(parts) for rank, parts in printed.items()}


def write(path: Path, code: str, prelude: str = "") -> Path:
    path.write_text(prelude + textwrap.dedent(code))
    return path


# ---------------------------------------------------------------------------


def test_without_torch_exits_2(tmp_path):
    # Hide torch from a fresh interpreter: the command must say so, exit 2.
    blocker = write(tmp_path / "sitecustomize.py", """
        import sys
        class _NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("No module named 'torch' (hidden by the test)")
                return None
        sys.meta_path.insert(0, _NoTorch())
        """)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{TORCHMP_PATH}")
    for argv in ([*TORCHMP, "--standalone", "x.py"],
                 [sys.executable, "-m", "torchmp.torchrun", "--standalone", "x.py"]):
        p = subprocess.run(argv, capture_output=True, text=True, env=env, cwd="/", timeout=HANG_SECONDS)
        assert p.returncode == 2, p.stderr
        assert "error: PyTorch is not installed" in p.stderr
        assert "'torchmp run' works without it" in p.stderr
        assert "Traceback" not in p.stderr
    assert blocker.exists()


def test_two_nodes_gloo_all_reduce(launch, tmp_path):
    script = write(tmp_path / "allreduce.py", prelude=PDEATHSIG_SNIPPET, code="""
        import os
        import torch
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        assert t.item() == world * (world + 1) / 2, t.item()
        print(f"rank {rank} of {world} node {os.environ['GROUP_RANK']} "
              f"local {os.environ['LOCAL_RANK']} sum {t.item():g} pdeathsig {pdeathsig()}", flush=True)
        dist.destroy_process_group()
        """)
    port = free_port()
    argv = [*TORCHMP, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", uuid.uuid4().hex,
            "--rdzv-conf", f"join_timeout={HANG_SECONDS}", "--tee", "1", "--monitor-interval", "0.1",
            str(script)]
    agents = [launch(argv), launch(argv)]
    results = [a.communicate(timeout=HANG_SECONDS) for a in agents]
    for a in agents:
        assert wait_no_tagged(a.tag) == []
    seen = {}
    for code, out, err in results:
        assert code == 0, err
        lines = worker_lines(out)
        assert len(lines) == 2, out
        nodes = set()
        for line in lines:
            m = re.fullmatch(r"\[default(\d)\]:rank (\d) of 4 node (\d) local (\d) sum 10 pdeathsig (\d+)",
                             line)
            assert m, line
            local, rank, node, local_env, deathsig = map(int, m.groups())
            assert local == local_env and rank == node * 2 + local
            assert deathsig == signal.SIGKILL  # started by torchmp, not by torch
            seen[rank] = line
            nodes.add(node)
        assert len(nodes) == 1
    assert sorted(seen) == [0, 1, 2, 3]


def test_failed_attempt_is_restarted(launch, tmp_path):
    script = write(tmp_path / "flaky.py", """
        import os, sys
        rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
        print(f"rank {rank} attempt {attempt}", flush=True)
        if rank == "1" and attempt == "0":
            sys.exit(3)
        """)
    logs = tmp_path / "logs"
    # (python -m torchmp.torchrun: the module's own entry point)
    code, out, err = run_job(launch, [
        sys.executable, "-m", "torchmp.torchrun", "--standalone", "--nproc-per-node", "2",
        "--max-restarts", "1",
        "--monitor-interval", "0.1", "--tee", "3", "--log-dir", str(logs), str(script)])
    assert code == 0, err
    lines = worker_lines(out)
    assert "[default1]:rank 1 attempt 0" in lines
    assert "[default0]:rank 0 attempt 1" in lines and "[default1]:rank 1 attempt 1" in lines
    assert "ChildFailedError" not in err
    (run_dir,) = logs.iterdir()
    assert sorted(p.name for p in run_dir.iterdir()) == ["attempt_0", "attempt_1"]
    assert (run_dir / "attempt_0" / "1" / "stdout.log").read_text() == "rank 1 attempt 0\n"
    for r in range(2):
        assert (run_dir / "attempt_1" / str(r) / "stdout.log").read_text() == f"rank {r} attempt 1\n"


def _tree(root: Path) -> dict[str, Path]:
    """Files under root, keyed by path with the random run directory normalised."""
    (run_dir,) = root.iterdir()
    return {str(p.relative_to(run_dir)): p for p in sorted(run_dir.rglob("*")) if p.is_file()}


def _report(err: str) -> str:
    """The ChildFailedError report, with run-specific values blanked."""
    body = err.split("ChildFailedError: \n", 1)[1]
    body = re.sub(r"time      : \S+", "time      : T", body)
    body = re.sub(r"host      : \S+", "host      : H", body)
    body = re.sub(r"\(pid: \d+\)", "(pid: P)", body)
    body = re.sub(r"error_file: \S+/attempt_", "error_file: .../attempt_", body)
    return body


def _both(launch, tmp_path, args, env=None):
    """Run the same job under torchrun and torchmp torchrun."""
    results = {}
    for which, prefix in (("torch", TORCHRUN), ("torchmp", TORCHMP)):
        logs = tmp_path / f"logs-{which}"
        results[which] = (logs, *run_job(launch, [*prefix, "--log-dir", str(logs), *args], env))
    return results


def test_parity_redirects_tee_filter_and_failure_report(launch, tmp_path):
    # rank 1 fails (recorded), after ranks 0 and 2 are done, so the failures
    # are deterministic; stdout is redirected, stderr teed, rank 2 filtered out.
    script = write(tmp_path / "job.py", """
        import os, sys, time
        from torchmp.errors import record

        def exited(pid):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    return f.read().rsplit(")", 1)[1].split()[0] in "ZX"
            except (FileNotFoundError, ProcessLookupError):
                # (ProcessLookupError: reaped between the open and the read.)
                return True

        @record
        def main():
            rank = int(os.environ["LOCAL_RANK"])
            d = os.environ["PIDS_DIR"]
            for i in range(3):
                print(f"out {rank} line {i}", flush=True)
                print(f"err {rank} line {i}", file=sys.stderr, flush=True)
            with open(f"{d}/{rank}.tmp", "w") as f:
                f.write(str(os.getpid()))
            os.rename(f"{d}/{rank}.tmp", f"{d}/{rank}")
            if rank == 1:
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline:
                    try:
                        pids = [int(open(f"{d}/{r}").read()) for r in (0, 2)]
                    except FileNotFoundError:
                        time.sleep(0.01)
                        continue
                    if all(exited(p) for p in pids):
                        break
                    time.sleep(0.01)
                raise ValueError("rank 1 failed on purpose")

        main()
        """)
    results = {}
    for which, prefix in (("torch", TORCHRUN), ("torchmp", TORCHMP)):
        pids_dir = tmp_path / f"pids-{which}"
        pids_dir.mkdir()
        logs = tmp_path / f"logs-{which}"
        results[which] = (logs, *run_job(launch, [
            *prefix, "--standalone", "--nproc-per-node", "3", "--monitor-interval", "0.1",
            "--log-dir", str(logs), "--redirects", "1", "--tee", "2",
            "--local-ranks-filter", "0,1", str(script)], env={"PIDS_DIR": str(pids_dir)}))

    (t_logs, t_code, t_out, t_err), (m_logs, m_code, m_out, m_err) = results["torch"], results["torchmp"]
    assert t_code == m_code == 1, m_err
    # the same files, with the same bytes (error.json: same message)
    t_tree, m_tree = _tree(t_logs), _tree(m_logs)
    assert sorted(t_tree) == sorted(m_tree)
    assert "attempt_0/1/error.json" in m_tree and "attempt_0/2/stdout.log" in m_tree
    for rel in t_tree:
        if rel.endswith("error.json"):
            t_msg = json.loads(t_tree[rel].read_text())["message"]["message"]
            m_msg = json.loads(m_tree[rel].read_text())["message"]["message"]
            assert t_msg == m_msg == "ValueError: rank 1 failed on purpose"
        else:
            assert t_tree[rel].read_bytes() == m_tree[rel].read_bytes(), rel
    # the same prefixed console lines: stderr of ranks 0 and 1 only
    assert worker_lines(t_out) == worker_lines(m_out) == []
    assert printed_per_rank(t_err) == printed_per_rank(m_err)
    for r in (0, 1):  # torchmp's console: exactly the log's lines, prefixed
        assert [line for line in m_err.splitlines() if line.startswith(f"[default{r}]:")] == [
            f"[default{r}]:{line}" for line in m_tree[f"attempt_0/{r}/stderr.log"].read_text().splitlines()]
    assert "[default0]:err 0 line 2" in worker_lines(m_err)
    assert not any(line.startswith("[default2]") for line in m_err.splitlines())
    # torch's own ChildFailedError report, naming the same root cause
    assert "torch.distributed.elastic.multiprocessing.errors.ChildFailedError" in m_err
    assert _report(t_err) == _report(m_err)
    assert "rank      : 1 (local_rank: 1)" in _report(m_err)


def test_parity_tee_prefix_template_and_duplicate_filters(launch, tmp_path):
    script = write(tmp_path / "ok.py", prelude=PDEATHSIG_SNIPPET, code="""
        import os, sys
        rank = os.environ["LOCAL_RANK"]
        for fruit in ("apple", "banana", "cherry apple"):
            print(f"{fruit} {rank}", flush=True)
        print(f"err {rank}", file=sys.stderr, flush=True)
        print(f"pdeathsig {pdeathsig()}", file=sys.stderr, flush=True)
        """)
    env = {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "<${role_name}|${rank}|${local_rank}> "}
    results = {}
    for which, prefix in (("torch", TORCHRUN), ("torchmp", TORCHMP)):
        logs = tmp_path / f"logs-{which}"
        results[which] = (logs, *run_job(launch, [
            *prefix, "--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.1",
            "--log-dir", str(logs), "--tee", "3", "--duplicate-stdout-filters", "apple",
            str(script)], env=env))
    (t_logs, t_code, t_out, t_err), (m_logs, m_code, m_out, m_err) = results["torch"], results["torchmp"]
    assert t_code == m_code == 0, m_err
    t_tree, m_tree = _tree(t_logs), _tree(m_logs)
    assert sorted(t_tree) == sorted(m_tree)
    for rel in t_tree:
        if rel.endswith("stderr.log"):
            continue  # differs in the pdeathsig line, checked below
        if rel.endswith("filtered_stdout.log"):
            # lines from different ranks may interleave in either order
            assert sorted(t_tree[rel].read_text().splitlines()) == sorted(
                m_tree[rel].read_text().splitlines()), rel
            continue
        assert t_tree[rel].read_bytes() == m_tree[rel].read_bytes(), rel
    assert "attempt_0/filtered_stdout.log" in m_tree
    assert sorted(m_tree["attempt_0/filtered_stdout.log"].read_text().splitlines()) == [
        "<default|0|0> apple 0", "<default|0|0> cherry apple 0",
        "<default|1|1> apple 1", "<default|1|1> cherry apple 1"]
    header = r"<default\|\d+\|\d+> "
    assert printed_per_rank(t_out, header) == printed_per_rank(m_out, header)
    assert len(worker_lines(m_out, "<")) == 6
    m_err_lines = worker_lines(m_err, "<")
    assert [ln for ln in m_err_lines if "pdeathsig" not in ln] == ["<default|0|0> err 0", "<default|1|1> err 1"]
    assert {rank: text.replace("pdeathsig 0", "") for rank, text in printed_per_rank(t_err, header).items()} == {
        rank: text.replace("pdeathsig 9", "") for rank, text in printed_per_rank(m_err, header).items()}
    assert [ln for ln in m_err_lines if "pdeathsig" in ln] == [
        "<default|0|0> pdeathsig 9", "<default|1|1> pdeathsig 9"]
    assert all("pdeathsig 0" in text for text in printed_per_rank(t_err, header).values())


def test_sigterm_to_agent_stops_workers_like_torchrun(launch, tmp_path):
    script = write(tmp_path / "sleepy.py", """
        import os, time
        d = os.environ["PIDS_DIR"]
        with open(f"{d}/{os.environ['LOCAL_RANK']}", "w") as f:
            f.write(str(os.getpid()))
        time.sleep(60)
        """)
    outcomes = {}
    for which, prefix in (("torch", TORCHRUN), ("torchmp", TORCHMP)):
        pids_dir = tmp_path / f"pids-{which}"
        pids_dir.mkdir()
        job = launch([*prefix, "--standalone", "--nproc-per-node", "2", "--monitor-interval",
                      "0.1", "--log-dir", str(tmp_path / f"logs-{which}"), str(script)],
                     env={"PIDS_DIR": str(pids_dir)})
        wait_for_workers(job, pids_dir, "*")
        time.sleep(0.2)  # let the pid files be complete
        os.kill(job.proc.pid, signal.SIGTERM)
        code, out, err = job.communicate(timeout=HANG_SECONDS)
        assert wait_no_tagged(job.tag) == []
        last = re.sub(r"Process \d+", "Process P", err.rstrip().splitlines()[-1])
        outcomes[which] = (code, last, "Received 15 death signal, shutting down workers" in err)
    assert outcomes["torchmp"] == outcomes["torch"] == (
        1, "torch.distributed.elastic.multiprocessing.api.SignalException: Process P got signal: 15",
        True)


def test_sigkilled_agent_leaves_no_workers(launch, tmp_path):
    # Beyond torchrun: a SIGKILLed agent cannot clean up, so its workers
    # must die with it (PDEATHSIG), not linger as orphans.
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    script = write(tmp_path / "sleepy.py", """
        import os, time
        d = os.environ["PIDS_DIR"]
        with open(f"{d}/{os.environ['LOCAL_RANK']}.tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(f"{d}/{os.environ['LOCAL_RANK']}.tmp", f"{d}/{os.environ['LOCAL_RANK']}")
        time.sleep(60)
        """)
    job = launch([*TORCHMP, "--standalone", "--nproc-per-node", "2", "--log-dir",
                  str(tmp_path / "logs"), str(script)], env={"PIDS_DIR": str(pids_dir)})
    wait_for_workers(job, pids_dir)
    pids = [int((pids_dir / str(r)).read_text()) for r in range(2)]
    os.kill(job.proc.pid, signal.SIGKILL)
    job.proc.wait(timeout=10)
    assert wait_no_tagged(job.tag) == [], pids


# ---------------------------------------------------------------------------
# The adapter's conversions, in process


def test_results_convert_to_torch_classes_root_cause_first(tmp_path):
    from torch.distributed.elastic.multiprocessing import api as torch_api
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from torchmp import RunProcsResult
    from torchmp.errors import ProcessFailure as TmFailure
    from torchmp.torchrun import TorchrunContext, to_torch_result

    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    now = time.time_ns()
    failures = {
        # rank 0 was killed by the launcher after rank 1 failed, in the same second
        0: TmFailure(0, 100, -15, "", timestamp_ns=now + 1000, terminated_by_launcher=True),
        1: TmFailure(1, 101, 5, str(bad), timestamp_ns=now),
    }
    result = to_torch_result(RunProcsResult(failures=failures, stdouts={0: "", 1: ""},
                                            stderrs={0: "", 1: ""}))
    assert isinstance(result, torch_api.RunProcsResult) and result.is_failed()
    assert list(result.failures) == [1, 0]  # root cause first for torch's min()
    for rank, f in result.failures.items():
        assert type(f) is ProcessFailure
        assert (f.local_rank, f.pid, f.exitcode) == (failures[rank].local_rank,
                                                     failures[rank].pid, failures[rank].exitcode)
        assert f.timestamp == failures[rank].timestamp
    # the malformed error file was read once, by torchmp, without raising
    assert "bad.json" in str(result.failures[1].message)
    assert result.failures[0].signal_name() == "SIGTERM"
    err = ChildFailedError("job", result.failures)
    assert err.get_first_failure()[0] == 1
    assert "exitcode  : 5 (pid: 101)" in err.format_msg()
    assert issubclass(TorchrunContext, torch_api.PContext)


def test_signal_exception_converts_to_torch(tmp_path):
    from torch.distributed.elastic.multiprocessing.api import SignalException as TorchSignal

    import torchmp.api
    from torchmp.torchrun import TorchrunContext

    class Raising:
        def wait(self, timeout, period):
            raise torchmp.api.SignalException("got it", signal.SIGTERM)

        def close(self, death_sig, timeout):
            raise torchmp.api.SignalException("got it", signal.SIGINT)

    ctx = TorchrunContext(Raising())  # type: ignore[arg-type]
    with pytest.raises(TorchSignal) as e:
        ctx.wait(0)
    assert e.value.sigval == signal.SIGTERM and str(e.value) == "got it"
    with pytest.raises(TorchSignal) as e:
        ctx.close()
    assert e.value.sigval == signal.SIGINT


def test_torchs_signal_exception_is_not_swallowed_by_a_console(tmp_path):
    # After a launch the plug-in's handlers raise torch's SignalException.
    # A handler that runs inside a console object's write, while torchmp
    # shows its own words there, must not be taken for the console's own
    # failure and dropped.
    script = """
        import logging, os, signal, sys
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torchmp import DefaultLogsSpecs
        from torchmp.torchrun import start_processes

        class Tripwire:
            def __init__(self, real):
                self.real, self.armed = real, True
            def write(self, text):
                if self.armed:
                    self.armed = False
                    os.kill(os.getpid(), signal.SIGTERM)
                return self.real.write(text)
            def flush(self):
                self.real.flush()

        ctx = start_processes("plain", "true", args={0: ()}, envs={0: {}},
                              logs_specs=DefaultLogsSpecs(log_dir=sys.argv[1]))
        ctx.wait()
        ctx.close()
        sys.stderr = Tripwire(sys.__stderr__)
        try:
            logging.getLogger("torchmp.api").warning("torchmp's own words")
            print("not interrupted")
        except SignalException as e:
            print("interrupted by", e.sigval.name)
    """
    with Launchers() as launchers:
        run = launchers.python(script, str(tmp_path / "logs"))
        rc, out, err = run.communicate(HANG_SECONDS)
    assert rc == 0, err[-3000:]
    assert out == "interrupted by SIGTERM\n", out + err[-3000:]
    assert wait_no_tagged(run.tag, 10) == []


def test_numa_binding_is_honoured(launch, tmp_path):
    # A fake topology (TORCHMP_SYSFS_ROOT) whose two NUMA nodes are this
    # machine's first two CPUs, a GPU on each: --numa-binding node puts rank
    # 0 on one CPU and rank 1 on the other, in torchmp's workers (PDEATHSIG),
    # without numactl (which torch's own binding needs).
    from fake_sysfs import like_this_host

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs")
    root = like_this_host(cpus[:2], gpu_nodes=[0, 1]).write(tmp_path / "sysfs")
    script = write(tmp_path / "where.py", prelude=PDEATHSIG_SNIPPET, code="""
        import os
        print(f"local {os.environ['LOCAL_RANK']} cpus {sorted(os.sched_getaffinity(0))} pdeathsig {pdeathsig()}",
              flush=True)
        """)
    argv = [*TORCHMP, "--standalone", "--nproc-per-node", "2", "--numa-binding", "node", "--tee", "1",
            "--monitor-interval", "0.1", str(script)]
    for visible, order in (("0,1", cpus[:2]), ("1,0", cpus[1::-1])):
        code, out, err = run_job(launch, argv, env={"TORCHMP_SYSFS_ROOT": str(root), "CUDA_VISIBLE_DEVICES": visible})
        assert code == 0, err
        assert worker_lines(out) == [f"[default{r}]:local {r} cpus [{order[r]}] pdeathsig {int(signal.SIGKILL)}"
                                     for r in (0, 1)]
        assert "not supported by torchmp" not in err
