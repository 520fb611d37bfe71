"""``torchmp run --cpu-bind / --numa-binding / --mem-bind / --report-bindings``:
the real command, each rank printing the CPUs the kernel gives it; every bad
option a usage error before anything starts."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from torchmp import _core
from torchmp._topology import format_cpulist

from fake_sysfs import like_this_host
from helpers import Launchers, wait_no_tagged

CPUS = sorted(os.sched_getaffinity(0))
ALL = format_cpulist(CPUS)
pytestmark = pytest.mark.skipif(len(CPUS) < 2 or not _core.HAVE_BINDING,
                                reason="needs 2 CPUs and a build with binding")

SHOW = ["--", "sh", "-c", "grep Cpus_allowed_list /proc/self/status | cut -f2; head -1 /proc/self/numa_maps"]


@pytest.fixture
def cli():
    with Launchers(trailing_pathsep=True) as launchers:
        def run(*args: str, env: dict[str, str] | None = None, timeout: float = 30):
            unset = [k for k in os.environ if k.startswith("SLURM_")] + [
                "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCHMP_SYSFS_ROOT", "CUDA_VISIBLE_DEVICES"]
            launched = launchers.start([sys.executable, "-m", "torchmp", "run", *args], env=env, unset=unset)
            result = launched.communicate(timeout)
            assert wait_no_tagged(launched.tag) == []
            return result

        yield run


def rank_lines(out: str) -> dict[int, list[str]]:
    """What each rank printed: its CPUs, then its first mapping's policy."""
    lines: dict[int, list[str]] = {}
    for line in out.splitlines():
        m = re.match(r"\[sh(\d+)\]:(.*)$", line)
        if m:
            lines.setdefault(int(m[1]), []).append(m[2])
    return {rank: [got[0], got[1].split()[1]] for rank, got in lines.items()}


def test_map_binds_and_reports(cli, tmp_path):
    a, b = CPUS[0], CPUS[1]
    code, out, err = cli("-n", "3", "--cpu-bind", f"map:{b},{a}", "--report-bindings",
                         "--log-dir", str(tmp_path), *SHOW)
    assert code == 0, err
    assert rank_lines(out) == {0: [str(b), "default"], 1: [str(a), "default"], 2: [str(b), "default"]}
    said = re.findall(r"^torchmp: rank (\d) \(pid (\d+)\) (.*)$", err, re.M)
    assert [(r, text) for r, _, text in said] == [("0", f"bound to cpus {b}"), ("1", f"bound to cpus {a}"),
                                                  ("2", f"bound to cpus {b}")]
    rows = err[err.index("torchmp: summary of sh"):].splitlines()
    assert re.fullmatch(r"rank\s+pid\s+exit\s+wall\s+cpu\s+max rss\s+where", rows[1]), rows[1]
    for rank, (_, pid, text) in enumerate(said):
        assert re.match(rf"\s*{rank}\s+{pid}\s+0\s+\S+\s+\S+\s+\S+ MiB\s+{re.escape(text)}$", rows[2 + rank])


def test_srun_spellings_and_verbose(cli, tmp_path):
    a, b = CPUS[0], CPUS[1]
    code, out, err = cli("-n", "2", f"--cpu-bind=verbose,map_cpu:{b}*1,{a}", "--log-dir", str(tmp_path), *SHOW)
    assert code == 0, err
    assert rank_lines(out) == {0: [str(b), "default"], 1: [str(a), "default"]}
    assert "torchmp: rank 0 (pid" in err and f") bound to cpus {b}\n" in err


def test_cores_and_memory(cli, tmp_path):
    node = _node_of(CPUS[0])
    code, out, err = cli("-n", "2", "--cpu-bind", "cores", "--mem-bind", "local", "--no-summary",
                         "--log-dir", str(tmp_path), *SHOW)
    assert code == 0, err
    seen = rank_lines(out)
    assert {seen[0][0], seen[1][0]} <= {format_cpulist(c) for c in _cores_of(2)}
    assert seen[0][0] != seen[1][0]
    assert {seen[0][1], seen[1][1]} == {f"bind:{node}"}


def test_numa_mode_on_this_machine(cli, tmp_path):
    from torchmp._topology import Topology

    topo = Topology()
    code, out, err = cli("-n", "2", "--cpu-bind", "ldoms", "--no-summary", "--log-dir", str(tmp_path), *SHOW)
    assert code == 0, err
    nodes = topo.nodes_with_cpus
    expected = [format_cpulist(topo.allowed_node_cpus(nodes[r * len(nodes) // 2])) for r in (0, 1)]
    assert [rank_lines(out)[r][0] for r in (0, 1)] == expected


def test_none_and_unbound_ranks_are_reported(cli, tmp_path):
    code, out, err = cli("-n", "2", "--cpu-bind", "none", "--report-bindings", "--log-dir", str(tmp_path), *SHOW)
    assert code == 0, err
    assert rank_lines(out) == {0: [ALL, "default"], 1: [ALL, "default"]}
    assert re.findall(r"^torchmp: rank \d \(pid \d+\) (.*)$", err, re.M) == [f"not bound (cpus {ALL})"] * 2


def test_a_rank_reaped_before_the_report_is_described_by_what_it_started_with():
    # A quick rank is reaped at its exit, possibly before --report-bindings
    # reads its /proc entry: an unbound one started with the launcher's CPUs.
    from torchmp.cli.plan import where_ranks_run

    gone = subprocess.Popen(["true"])
    gone.wait()

    class Started:
        bindings: dict[int, object] = {}

        def pids(self) -> dict[int, int]:
            return {0: gone.pid, 1: os.getpid()}

    assert where_ranks_run(Started()) == {0: f"not bound (cpus {ALL})", 1: f"not bound (cpus {ALL})"}


def test_numa_binding_with_a_fake_topology(cli, tmp_path):
    root = like_this_host(CPUS[:2], gpu_nodes=[0, 1]).write(tmp_path / "sysfs")
    env = {"TORCHMP_SYSFS_ROOT": str(root), "CUDA_VISIBLE_DEVICES": "1,0"}
    code, out, err = cli("-n", "2", "--numa-binding", "node", "--no-summary", "--log-dir", str(tmp_path / "l"),
                         *SHOW, env=env)
    assert code == 0, err
    assert [rank_lines(out)[r][0] for r in (0, 1)] == [str(CPUS[1]), str(CPUS[0])]


def _node_of(cpu: int) -> int:
    from torchmp._topology import Topology
    return Topology().node_of_cpu[cpu]


def _cores_of(n: int) -> list[frozenset[int]]:
    from torchmp import _placement
    from torchmp._topology import Topology
    out = _placement.cores(Topology(), n)
    return [out[r] for r in range(n)]


@pytest.mark.parametrize("args, message", [
    (["--cpu-bind", "sockets"], "--cpu-bind: unknown mode 'sockets'; the modes are none, cores, numa, map:LIST"),
    (["--cpu-bind", "map:"], "--cpu-bind: unknown mode 'map:'"),
    (["--cpu-bind", "map:4096"], "--cpu-bind: map:4096: CPU 4096 is outside the CPUs this launcher may use"),
    (["--cpu-bind", "map:0,x"], "--cpu-bind: map:0,x: 'x' is not a CPU id"),
    (["-n", "9999", "--cpu-bind", "cores"], "--cpu-bind: cores binding: 9999 ranks but only"),
    (["--numa-binding", "rack"], "argument --numa-binding: invalid choice: 'rack'"),
    (["--mem-bind", "local"], "--mem-bind local binds memory near a rank's CPUs: it needs --cpu-bind or "
                              "--numa-binding"),
    (["--mem-bind", "bogus"], "argument --mem-bind: invalid choice: 'bogus'"),
    (["--cpu-bind", "cores", "--numa-binding", "node"], "--cpu-bind and --numa-binding both say where ranks "
                                                        "run: give one of them"),
    (["--numa-binding", "node"], "--numa-binding: local rank 0 binds near GPU 0, but there are 0 GPUs visible"),
])
def test_bad_options_are_usage_errors(cli, tmp_path, args, message):
    marker = tmp_path / "started"
    root = tmp_path / "sysfs"
    like_this_host(CPUS[:2], gpu_nodes=[]).write(root)  # no GPU on it
    base = [] if args[0] == "-n" else ["-n", "2"]
    code, out, err = cli(*base, *args, "--log-dir", str(tmp_path / "logs"), "--", "touch", str(marker),
                         env={"TORCHMP_SYSFS_ROOT": str(root)})
    assert code == 2, err
    assert f"torchmp run: error: {message}" in err
    assert out == "" and not marker.exists() and not (tmp_path / "logs").exists()


def test_machine_without_sysfs_says_so(cli, tmp_path):
    code, out, err = cli("-n", "1", "--cpu-bind", "numa", "--log-dir", str(tmp_path / "logs"), "--", "true",
                         env={"TORCHMP_SYSFS_ROOT": str(tmp_path / "none")})
    assert code == 2
    assert (f"torchmp run: error: --cpu-bind: numa binding: {tmp_path}/none/sys/devices/system/node does not "
            "exist (a kernel without NUMA support?); torchmp does not guess the nodes") in err
