"""Real binding on this machine: each rank's CPUs and memory policy as the
kernel reports them from inside the rank (its Cpus_allowed_list, a new
thread's, the policy in /proc/self/numa_maps), for every way a rank starts;
numa_options on a fake topology whose nodes are this machine's CPUs; bad
options stop before anything starts; the child's own failures (a CPU or node
the kernel refuses) come back as errors naming the step."""
from __future__ import annotations

import os
import signal
import sys
import textwrap
import types
from pathlib import Path

import pytest

import torchmp
from torchmp import DefaultLogsSpecs, Std, _core, _placement
from torchmp._topology import BindingError
from torchmp.numa import AffinityMode, NumaOptions

from workers import functions as fw
from fake_sysfs import like_this_host
from fn_helpers import forkserver_hygiene  # noqa: F401 (autouse: a fixture of this module)
from helpers import HERE, launch, run_launcher

CPUS = sorted(os.sched_getaffinity(0))
ALL = _placement.format_cpulist(CPUS)
STARTS = ("binary", "spawn", "fork", "forkserver")

pytestmark = pytest.mark.skipif(len(CPUS) < 2 or not _core.HAVE_BINDING,
                                reason="needs 2 CPUs and a build with binding")

# A binary rank printing what fw.placement() returns.
PRINT_PLACEMENT = textwrap.dedent(f"""
    import sys
    sys.path.insert(0, {str(HERE)!r})
    from workers import functions as fn_workers
    print(*fn_workers.placement())
""")


def run_ranks(tmp_path: Path, start: str, nprocs: int, **kwargs) -> dict[int, tuple[str, str, str]]:
    """Start nprocs ranks reporting where they run; {rank: (cpus, a thread's cpus, memory policy)}."""
    log_dir = tmp_path / "logs"
    if start == "binary":
        ctx = launch(sys.executable, {r: ("-c", PRINT_PLACEMENT) for r in range(nprocs)},
                     log_dir=log_dir, redirects=Std.OUT, **kwargs)
    else:
        ctx = launch(fw.placement, {r: () for r in range(nprocs)}, log_dir=log_dir, start_method=start, **kwargs)
    try:
        result = ctx.wait(60)
    finally:
        ctx.close(signal.SIGKILL, timeout=5)
    assert result is not None and not result.failures, result and result.failures
    if start != "binary":
        return dict(result.return_values)
    return {r: tuple(Path(result.stdouts[r]).read_text().split()) for r in range(nprocs)}  # type: ignore[misc]


@pytest.mark.parametrize("start", STARTS)
def test_cpu_affinity_binds_each_rank_and_its_threads(tmp_path, start):
    first, second = CPUS[0], CPUS[1]
    seen = run_ranks(tmp_path, start, 3, cpu_affinity={0: {second}, 1: str(first)})
    assert seen[0] == (str(second), str(second), "default")
    assert seen[1] == (str(first), str(first), "default")
    assert seen[2] == (ALL, ALL, "default")  # not asked: the launcher's CPUs


@pytest.mark.parametrize("start", STARTS)
def test_mem_bind_local_sets_the_memory_policy(tmp_path, start):
    node = _placement.Topology().node_of_cpu[CPUS[1]]
    seen = run_ranks(tmp_path, start, 2, cpu_affinity={0: {CPUS[1]}}, mem_bind="local")
    assert seen[0] == (str(CPUS[1]), str(CPUS[1]), f"bind:{node}")
    assert seen[1] == (ALL, ALL, "default")


@pytest.fixture
def two_fake_nodes(tmp_path, monkeypatch):
    """This machine's first two CPUs as two NUMA nodes with a GPU each."""
    root = like_this_host(CPUS[:2], gpu_nodes=[0, 1]).write(tmp_path / "sysfs")
    monkeypatch.setenv("TORCHMP_SYSFS_ROOT", str(root))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return root


@pytest.mark.parametrize("start", STARTS)
def test_numa_options_bind_near_each_ranks_gpu(tmp_path, two_fake_nodes, monkeypatch, start):
    seen = run_ranks(tmp_path, start, 2, numa_options=NumaOptions(AffinityMode.NODE))
    assert [seen[r][:2] for r in (0, 1)] == [(str(CPUS[0]),) * 2, (str(CPUS[1]),) * 2]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    seen = run_ranks(tmp_path / "again", start, 2, numa_options=NumaOptions(AffinityMode.EXCLUSIVE))
    assert [seen[r][0] for r in (0, 1)] == [str(CPUS[1]), str(CPUS[0])]


def test_torchs_own_numa_options(tmp_path, two_fake_nodes):
    binding = pytest.importorskip("torch.numa.binding")
    options = binding.NumaOptions(affinity_mode=binding.AffinityMode.SOCKET)
    ctx = launch(sys.executable, {0: ("-c", PRINT_PLACEMENT)}, log_dir=tmp_path / "logs", redirects=Std.OUT,
                 numa_options=options)
    try:
        result = ctx.wait(60)
    finally:
        ctx.close(signal.SIGKILL, timeout=5)
    assert not result.failures
    both = _placement.format_cpulist(CPUS[:2])
    assert Path(result.stdouts[0]).read_text().split()[:2] == [both, both]
    assert ctx.bindings == {0: _core.Binding(tuple(CPUS[:2]), ())}


def test_no_binding_asked_leaves_the_spec_empty(tmp_path):
    ctx = launch("true", {0: ()}, log_dir=tmp_path / "logs")
    try:
        assert ctx.wait(30) is not None
    finally:
        ctx.close()
    assert ctx.bindings == {}


# ---------------------------------------------------------------------------
# Bad options: an error before anything starts


def _assert_nothing_started(log_dir: Path) -> None:
    assert not log_dir.exists() or not any(log_dir.iterdir())


@pytest.mark.parametrize("kwargs, exc, needle", [
    ({"cpu_affinity": {0: {4096}}}, ValueError, "CPU 4096 is outside the CPUs this launcher may use"),
    ({"cpu_affinity": {0: "0-"}}, ValueError, "not a number or a range"),
    ({"cpu_affinity": {1: {0}}}, ValueError, "1 is not a local rank in 0..0"),
    ({"mem_bind": "local"}, ValueError, "needs numa_options or cpu_affinity"),
    ({"numa_options": types.SimpleNamespace(affinity_mode="rack")}, ValueError, "affinity_mode must be one of"),
    ({"numa_options": "node"}, TypeError, "numa_options must be a NumaOptions"),
])
@pytest.mark.parametrize("start", STARTS)
def test_bad_options_before_anything_starts(tmp_path, start, kwargs, exc, needle):
    log_dir = tmp_path / "logs"
    entry = ("true", {0: ()}) if start == "binary" else (fw.ident, {0: ()})
    extra = {} if start == "binary" else {"start_method": start}
    with pytest.raises(exc, match=needle):
        torchmp.start_processes("t", entry[0], entry[1], {0: {}}, DefaultLogsSpecs(log_dir=str(log_dir)),
                                **kwargs, **extra)
    _assert_nothing_started(log_dir)


def test_a_machine_without_the_files_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHMP_SYSFS_ROOT", str(tmp_path / "nothing"))
    log_dir = tmp_path / "logs"
    with pytest.raises(BindingError, match=f"cannot look for GPUs: {tmp_path}/nothing/sys/bus/pci/devices "
                                           "does not exist"):
        torchmp.start_processes("t", "true", {0: ()}, {0: {}}, DefaultLogsSpecs(log_dir=str(log_dir)),
                                numa_options=NumaOptions(AffinityMode.NODE))
    _assert_nothing_started(log_dir)


def test_no_gpu_for_a_rank(tmp_path, two_fake_nodes, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    log_dir = tmp_path / "logs"
    with pytest.raises(BindingError, match=r"local rank 1 binds near GPU 1, but there is 1 GPU visible "
                                           r"\(CUDA_VISIBLE_DEVICES='1'\)"):
        torchmp.start_processes("t", "true", {0: (), 1: ()}, {0: {}, 1: {}}, DefaultLogsSpecs(log_dir=str(log_dir)),
                                numa_options=NumaOptions(AffinityMode.NODE))
    _assert_nothing_started(log_dir)
    # Unless told to run such a rank unbound, as torch's option says.
    ctx = launch("true", {0: (), 1: ()}, log_dir=log_dir,
                 numa_options=NumaOptions(AffinityMode.NODE, should_fall_back_if_binding_fails=True))
    try:
        assert not ctx.wait(30).failures
    finally:
        ctx.close()
    assert ctx.bindings == {0: _core.Binding((CPUS[1],), ())}


# ---------------------------------------------------------------------------
# What the kernel refuses in the child: the step and errno come back


def _refused(tmp_path, start: str, binding: _core.Binding):
    """A context whose rank 0 asks the kernel for binding (past the
    launcher's checks, as a CPU taken offline after them would be)."""
    log_dir = str(tmp_path / "logs")
    specs = DefaultLogsSpecs(log_dir=log_dir, redirects=Std.ERR)
    if start == "binary":
        ctx: torchmp.PContext = torchmp.SubprocessContext("t", "true", {0: ()}, {0: {}}, specs)
    else:
        ctx = torchmp.MultiprocessContext("t", fw.ident, {0: ()}, {0: {}}, start, specs)
    ctx._bindings = {0: binding}  # type: ignore[attr-defined]
    return ctx


@pytest.mark.parametrize("binding, step, errname", [
    (_core.Binding((4000,), ()), "sched_setaffinity (CPU binding)", "EINVAL"),
    (_core.Binding((0,), (1000,)), "set_mempolicy (memory binding)", "EINVAL"),
])
@pytest.mark.parametrize("start", STARTS)
def test_child_setup_failure_names_the_step(tmp_path, start, binding, step, errname):
    ctx = _refused(tmp_path, start, binding)
    if start in ("binary", "spawn"):  # exec'd: the spawn error record
        with pytest.raises(OSError) as info:
            ctx.start()
        ctx.close()
        assert info.value.errno == getattr(__import__("errno"), errname)
        assert f"worker setup step: {step}" in str(info.value)
        return
    ctx.start()
    try:
        result = ctx.wait(30)
    finally:
        ctx.close(signal.SIGKILL, timeout=5)
    failure = result.failures[0]
    stderr = Path(result.stderrs[0]).read_text()
    if start == "fork":  # in C, before any Python runs in the child
        assert failure.exitcode == 127
        assert stderr == f"torchmp: worker setup failed during {step}: {os.strerror(22)}\n"
    else:  # in the forkserver's bootstrap: an error the worker records
        assert failure.exitcode == 1
        assert f"(worker setup step: {step})" in str(failure.message)


def test_binding_masks_are_checked_in_the_core():
    with pytest.raises(ValueError, match="CPU -1 is out of range"):
        _core.child_setup(-1, -1, False, os.getpid(), ((-1,), ()))
    with pytest.raises(ValueError, match="NUMA node 32768 is out of range"):
        _core.child_setup(-1, -1, False, os.getpid(), ((0,), (32768,)))


def test_wrap_binds_the_running_process_as_torch_does(two_fake_nodes):
    # torch's api._wrap runs the worker body in the calling process: a
    # process of its own here, with a thread that exists before the binding.
    out = run_launcher("""
        import queue, threading, os
        from torchmp import api
        from torchmp.numa import NumaOptions, AffinityMode

        gate = threading.Event()
        early = threading.Thread(target=gate.wait)
        early.start()

        class Event:
            def wait(self): pass

        def body():
            return sorted(os.sched_getaffinity(0)), sorted(os.sched_getaffinity(early.native_id))

        q = queue.Queue()
        api._wrap(1, body, {1: ()}, {1: {}}, {1: ""}, {1: ""}, {1: q}, Event(),
                  NumaOptions(AffinityMode.NODE))
        gate.set()
        print(q.get())
    """, env={"TORCHMP_SYSFS_ROOT": str(two_fake_nodes)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.decode().split() == [f"([{CPUS[1]}],", f"[{CPUS[1]}])"]
