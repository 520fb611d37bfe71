"""Where ranks run, computed against fake machines (tests/fake_sysfs.py):
torch's four NUMA modes (and, with torch installed, torch's own code on the
same files giving the same CPU sets), --cpu-bind's modes, GPU discovery and
visibility, and every bad option.  Nothing is bound here: see test_binding.py."""
from __future__ import annotations

import builtins
import logging
import os
import types
from pathlib import Path

import pytest

from fake_sysfs import Device, Machine, two_sockets

from torchmp import _core, _placement
from torchmp._topology import BindingError, Topology, format_cpulist, parse_cpulist
from torchmp.numa import AffinityMode, NumaOptions

MODES = ("node", "socket", "exclusive", "core-complex")

#: plan() refuses to plan a binding the build cannot apply.
needs_binding = pytest.mark.skipif(not _core.HAVE_BINDING, reason="a build without binding (TORCHMP_PORTABLE)")


def topo_of(machine: Machine, tmp_path: Path, allowed=None, environ=None) -> Topology:
    root = machine.write(tmp_path / "root")
    return Topology(root, allowed_cpus=machine.cpus if allowed is None else allowed, environ=environ or {})


def cpus(text: str) -> frozenset[int]:
    return parse_cpulist(text)


# ---------------------------------------------------------------------------
# cpulists


@pytest.mark.parametrize("text, expected", [
    ("0-3,8,10-11\n", {0, 1, 2, 3, 8, 10, 11}),
    ("", set()),
    ("\n", set()),
    ("5", {5}),
    (" 1 , 3-4 ", {1, 3, 4}),
])
def test_parse_cpulist(text, expected):
    assert parse_cpulist(text) == expected


@pytest.mark.parametrize("text, needle", [("0-", "not a number"), ("a", "not a number"),
                                          ("3-1", "runs backwards"), ("1-2-3", "not a number"),
                                          ("-1", "not a number")])
def test_parse_cpulist_rejects(text, needle):
    with pytest.raises(ValueError, match=needle):
        parse_cpulist(text)


def test_format_cpulist():
    assert format_cpulist([]) == ""
    assert format_cpulist([3]) == "3"
    assert format_cpulist([7, 0, 1, 2, 5, 6]) == "0-2,5-7"
    assert parse_cpulist(format_cpulist(range(0, 100, 3))) == set(range(0, 100, 3))


# ---------------------------------------------------------------------------
# GPUs


def test_gpus_in_pci_order_without_other_devices(tmp_path):
    topo = topo_of(two_sockets(gpus_per_node=2), tmp_path)
    assert [(g.index, g.pci_address, g.numa_node, g.vendor) for g in topo.gpus] == [
        (0, "0000:1b:00.0", 0, "NVIDIA"), (1, "0000:1b:01.0", 0, "NVIDIA"),
        (2, "0000:3b:00.0", 1, "NVIDIA"), (3, "0000:3b:01.0", 1, "NVIDIA"),
        (4, "0000:8b:00.0", 2, "NVIDIA"), (5, "0000:8b:01.0", 2, "NVIDIA"),
        (6, "0000:bb:00.0", 3, "NVIDIA"), (7, "0000:bb:01.0", 3, "NVIDIA"),
    ]


@pytest.mark.parametrize("value, expected", [
    ("2,0", ["0000:8b:00.0", "0000:1b:00.0"]),
    ("3", ["0000:bb:00.0"]),
    ("", []),
    ("1,7,2", ["0000:3b:00.0"]),          # CUDA: the list ends at the first bad entry
    ("1,-1,2", ["0000:3b:00.0"]),
    ("1,1", ["0000:3b:00.0"]),
    (" 0 , 1", ["0000:1b:00.0", "0000:3b:00.0"]),
    ("GPU-20aaaaaa", ["0000:8b:00.0"]),   # a UUID prefix, from the NVIDIA driver's files
    ("GPU-20aaaaaa-1111-2222-3333-444444444440,0", ["0000:8b:00.0", "0000:1b:00.0"]),
    ("GPU-ffff,0", []),
])
def test_cuda_visible_devices(tmp_path, value, expected):
    topo = topo_of(two_sockets(), tmp_path, environ={"CUDA_VISIBLE_DEVICES": value})
    assert [g.pci_address for g in topo.gpus] == expected
    assert [g.index for g in topo.gpus] == list(range(len(expected)))


def test_mig_devices_cannot_be_placed(tmp_path):
    topo = topo_of(two_sockets(), tmp_path, environ={"CUDA_VISIBLE_DEVICES": "MIG-0b1c2d3e-aaaa"})
    with pytest.raises(BindingError, match="MIG instance"):
        list(topo.gpus)


def test_uuid_without_the_driver_files_is_an_error(tmp_path):
    machine = two_sockets()
    for dev in machine.devices:
        dev.uuid = None
    topo = topo_of(machine, tmp_path, environ={"CUDA_VISIBLE_DEVICES": "GPU-20aaaaaa"})
    with pytest.raises(BindingError, match="proc/driver/nvidia/gpus"):
        list(topo.gpus)


def test_amd_gpus_and_their_variables(tmp_path):
    machine = two_sockets(gpu_vendor=0x1002, gpu_class=0x038000)
    environ = {"ROCR_VISIBLE_DEVICES": "3,2,1", "HIP_VISIBLE_DEVICES": "2,0", "CUDA_VISIBLE_DEVICES": "0"}
    topo = topo_of(machine, tmp_path, environ=environ)
    assert [(g.pci_address, g.vendor) for g in topo.gpus] == [("0000:3b:00.0", "AMD"), ("0000:bb:00.0", "AMD")]


def test_nvidia_gpus_win_over_an_integrated_amd_one(tmp_path):
    machine = two_sockets()
    machine.devices.append(Device("0000:0a:00.0", 0x1002, 0x030000, 0))  # an APU's graphics
    topo = topo_of(machine, tmp_path)
    assert [g.vendor for g in topo.gpus] == ["NVIDIA"] * 4


def test_gpu_without_affinity_counts_as_node_0(tmp_path):
    machine = two_sockets()
    for dev in machine.devices:
        dev.numa_node = -1
    topo = topo_of(machine, tmp_path)
    assert {g.numa_node for g in topo.gpus} == {0}
    assert _placement.cpus_for_gpu(topo, "node", 3) == cpus("0-3,16-19")


# ---------------------------------------------------------------------------
# torch's modes, by hand


@pytest.mark.parametrize("mode, gpu, expected", [
    ("node", 0, "0-3,16-19"),
    ("node", 3, "12-15,28-31"),
    ("socket", 0, "0-7,16-23"),
    ("socket", 1, "0-7,16-23"),
    ("socket", 2, "8-15,24-31"),
    ("exclusive", 1, "4-7,20-23"),           # one GPU per node: the whole node
    ("core-complex", 0, "0-1,16-17"),        # the node's first L3 of two
    ("core-complex", 2, "8-9,24-25"),
])
def test_modes_one_gpu_per_node(tmp_path, mode, gpu, expected):
    topo = topo_of(two_sockets(), tmp_path)
    assert _placement.cpus_for_gpu(topo, mode, gpu) == cpus(expected)


@pytest.mark.parametrize("mode, expected", [
    # 2 GPUs per node; node 0 = cores 0-3 (threads 0-3 and 16-19)
    ("exclusive", ["0-1,16-17", "2-3,18-19"]),
    ("core-complex", ["0-1,16-17", "2-3,18-19"]),
    ("node", ["0-3,16-19", "0-3,16-19"]),
])
def test_modes_two_gpus_per_node(tmp_path, mode, expected):
    topo = topo_of(two_sockets(gpus_per_node=2), tmp_path)
    assert [_placement.cpus_for_gpu(topo, mode, gpu) for gpu in (0, 1)] == [cpus(e) for e in expected]
    # GPUs 2 and 3 are node 1's: the same split of node 1.
    assert _placement.cpus_for_gpu(topo, mode, 3) == frozenset(c + 4 for c in cpus(expected[1]))


def test_exclusive_gives_the_remainder_to_the_lowest_gpus(tmp_path):
    # 3 GPUs per node would not fit the fake bus layout: take 5 cores, 2 GPUs.
    topo = topo_of(two_sockets(gpus_per_node=2, cores_per_node=5, threads=1), tmp_path)
    assert _placement.cpus_for_gpu(topo, "exclusive", 0) == cpus("0-2")
    assert _placement.cpus_for_gpu(topo, "exclusive", 1) == cpus("3-4")


def test_exclusive_needs_a_core_per_gpu(tmp_path):
    topo = topo_of(two_sockets(gpus_per_node=2), tmp_path, allowed=cpus("0,16,4-7"))
    with pytest.raises(BindingError, match="NUMA node 0 has 1 physical core this launcher may use but 2 GPUs"):
        _placement.cpus_for_gpu(topo, "exclusive", 1)


def test_core_complex_with_more_gpus_than_complexes_reuses_them(tmp_path):
    topo = topo_of(two_sockets(gpus_per_node=2, cores_per_node=2, threads=1), tmp_path)
    # cores_per_node=2: one core per L3 half, so two complexes per node.
    assert _placement.cpus_for_gpu(topo, "core-complex", 0) == cpus("0")
    assert _placement.cpus_for_gpu(topo, "core-complex", 1) == cpus("1")
    topo = topo_of(two_sockets(gpus_per_node=2, cores_per_node=2, threads=1), tmp_path / "b",
                   allowed=cpus("0,2-7"))
    # Only one complex of node 0 left: both GPUs share it.
    assert [_placement.cpus_for_gpu(topo, "core-complex", g) for g in (0, 1)] == [cpus("0"), cpus("0")]


def test_modes_keep_to_the_allowed_cpus(tmp_path):
    allowed = cpus("1-15,17-31")  # CPUs 0 and 16 (core 0) are not ours
    topo = topo_of(two_sockets(), tmp_path, allowed=allowed)
    assert _placement.cpus_for_gpu(topo, "node", 0) == cpus("1-3,17-19")
    assert _placement.cpus_for_gpu(topo, "socket", 0) == cpus("1-7,17-23")
    # Largest complex first: node 0's second complex (2 cores) beats the first (1 left).
    assert _placement.cpus_for_gpu(topo, "core-complex", 0) == cpus("2-3,18-19")


def test_node_without_allowed_cpus_is_an_error(tmp_path):
    topo = topo_of(two_sockets(), tmp_path, allowed=cpus("4-15,20-31"))
    for mode in MODES:
        with pytest.raises(BindingError, match="NUMA node 0 has no CPU this launcher may use"):
            _placement.cpus_for_gpu(topo, mode, 0)


def test_socket_mode_skips_memory_only_and_absent_nodes(tmp_path):
    machine = two_sockets()
    machine.nodes[4] = []          # a CXL memory expander: memory, no CPUs
    machine.absent_nodes = [5]     # possible, never brought up
    topo = topo_of(machine, tmp_path)
    assert _placement.cpus_for_gpu(topo, "socket", 0) == cpus("0-7,16-23")


def test_rank_without_a_gpu(tmp_path):
    topo = topo_of(two_sockets(), tmp_path, environ={"CUDA_VISIBLE_DEVICES": "1,0"})
    with pytest.raises(BindingError, match=r"local rank 2 binds near GPU 2, but there are 2 GPUs visible "
                                           r"\(CUDA_VISIBLE_DEVICES='1,0'\)"):
        _placement.cpus_for_gpu(topo, "node", 2)
    # Reordered: GPU 0 is the bus's second, on node 1.
    assert _placement.cpus_for_gpu(topo, "node", 0) == cpus("4-7,20-23")


def test_missing_sysfs_says_so(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    topo = Topology(empty, allowed_cpus=[0, 1], environ={})
    with pytest.raises(BindingError, match=f"cannot look for GPUs: {empty}/sys/bus/pci/devices does not exist"):
        _placement.cpus_for_gpu(topo, "node", 0)
    machine = two_sockets()
    root = machine.write(tmp_path / "nonuma")
    import shutil
    shutil.rmtree(root / "sys/devices/system/node")
    topo = Topology(root, allowed_cpus=machine.cpus, environ={})
    with pytest.raises(BindingError, match="does not exist .a kernel without NUMA support"):
        _placement.cpus_for_gpu(topo, "node", 0)
    with pytest.raises(BindingError, match="torchmp does not guess the nodes"):
        _placement.numa_nodes(topo, 2)


def test_unknown_mode():
    with pytest.raises(ValueError, match="unknown affinity mode 'rack'"):
        _placement.cpus_for_gpu(Topology("/nonexistent", allowed_cpus=[0], environ={}), "rack", 0)


# ---------------------------------------------------------------------------
# torch's modes, against torch's own code on the same files


def _torch_binding(monkeypatch, root: Path, topo: Topology):
    """torch.numa.binding reading the fake machine: its files under root,
    topo's allowed CPUs as the thread's affinity, topo's GPUs as CUDA's."""
    binding = pytest.importorskip("torch.numa.binding")
    torch = pytest.importorskip("torch")

    def fake_open(path, *args, **kwargs):
        return builtins.open(str(root) + path, *args, **kwargs)

    fake_os = types.SimpleNamespace(
        listdir=lambda path: os.listdir(str(root) + path),
        path=os.path,
        sched_getaffinity=lambda pid: set(topo.allowed_cpus),
    )
    monkeypatch.setattr(binding, "open", fake_open, raising=False)
    monkeypatch.setattr(binding, "os", fake_os)
    gpus = topo.gpus

    def properties(index):
        domain, bus, rest = gpus[index].pci_address.split(":")
        return types.SimpleNamespace(pci_domain_id=int(domain, 16), pci_bus_id=int(bus, 16),
                                     pci_device_id=int(rest.split(".")[0], 16))

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(binding, "_get_gpu_count", lambda: len(gpus))
    return lambda mode, gpu: binding._get_logical_cpus_to_bind_to(
        gpu_index=gpu, numa_options=binding.NumaOptions(affinity_mode=binding.AffinityMode(mode)))


MACHINES = {
    "2x2 nodes, 1 GPU/node": lambda: two_sockets(),
    "2x2 nodes, 2 GPUs/node": lambda: two_sockets(gpus_per_node=2),
    "5 cores/node, no SMT": lambda: two_sockets(gpus_per_node=2, cores_per_node=5, threads=1),
    "4 threads/core": lambda: two_sockets(threads=4, cores_per_node=2),
}
ALLOWED = {"all": None, "cpuset": "1-3,5-13,17-19,21-31"}


@pytest.mark.parametrize("machine_name", sorted(MACHINES))
@pytest.mark.parametrize("allowed_name", sorted(ALLOWED))
def test_same_cpu_sets_as_torch(monkeypatch, tmp_path, machine_name, allowed_name):
    machine = MACHINES[machine_name]()
    allowed = ALLOWED[allowed_name]
    allowed_set = None if allowed is None else cpus(allowed) & set(machine.cpus)
    topo = topo_of(machine, tmp_path, allowed=allowed_set)
    torch_cpus = _torch_binding(monkeypatch, tmp_path / "root", topo)
    compared = 0
    for mode in MODES:
        for gpu in range(len(topo.gpus)):
            try:
                expected = torch_cpus(mode, gpu)
            except Exception as e:  # torch fails here: so must torchmp
                with pytest.raises(BindingError):
                    _placement.cpus_for_gpu(topo, mode, gpu)
                assert "physical cores" in str(e), e
                continue
            assert _placement.cpus_for_gpu(topo, mode, gpu) == expected, (mode, gpu)
            compared += 1
    assert compared >= 4 * len(topo.gpus) - len(topo.gpus)


def test_torch_stops_at_a_memory_only_node_and_torchmp_does_not(monkeypatch, tmp_path):
    machine = two_sockets()
    machine.nodes[4] = []
    topo = topo_of(machine, tmp_path)
    torch_cpus = _torch_binding(monkeypatch, tmp_path / "root", topo)
    with pytest.raises(ValueError):  # min() of node 4's empty CPU set
        torch_cpus("socket", 0)
    assert _placement.cpus_for_gpu(topo, "socket", 0) == torch_cpus("node", 0) | torch_cpus("node", 1)


# ---------------------------------------------------------------------------
# --cpu-bind's modes


def test_cores_split_evenly_lowest_ranks_take_the_rest(tmp_path):
    topo = topo_of(two_sockets(), tmp_path)  # 16 cores x 2 threads
    out = _placement.cores(topo, 3)
    # Cores in node order: 6, 5, 5 of them.
    assert out[0] == cpus("0-5,16-21")
    assert out[1] == cpus("6-10,22-26")
    assert out[2] == cpus("11-15,27-31")
    assert _placement.cores(topo, 16)[15] == cpus("15,31")


def test_cores_follow_the_nodes_when_cpus_interleave(tmp_path):
    # Node 0 has the even CPUs, node 1 the odd ones (round-robin numbering).
    machine = Machine(nodes={0: [0, 2, 4, 6], 1: [1, 3, 5, 7]}, socket=dict.fromkeys(range(8), 0),
                      siblings={c: [c] for c in range(8)}, l3={c: [c] for c in range(8)})
    topo = topo_of(machine, tmp_path)
    assert _placement.cores(topo, 2) == {0: cpus("0,2,4,6"), 1: cpus("1,3,5,7")}


def test_cores_more_ranks_than_cores(tmp_path):
    topo = topo_of(two_sockets(), tmp_path, allowed=cpus("0-2,16-18"))
    with pytest.raises(ValueError, match=r"4 ranks but only 3 physical cores allowed \(CPUs 0-2,16-18\)"):
        _placement.cores(topo, 4)


@pytest.mark.parametrize("nprocs, expected", [
    (4, [0, 1, 2, 3]), (2, [0, 2]), (8, [0, 0, 1, 1, 2, 2, 3, 3]), (3, [0, 1, 2]), (5, [0, 0, 1, 2, 3]),
])
def test_numa_nodes_in_blocks(tmp_path, nprocs, expected):
    topo = topo_of(two_sockets(), tmp_path)
    out = _placement.numa_nodes(topo, nprocs)
    assert [out[r] for r in range(nprocs)] == [topo.allowed_node_cpus(n) for n in expected]


def test_cpu_map():
    allowed = frozenset(range(32))
    assert _placement.cpu_map("3,1", 5, allowed) == {0: {3}, 1: {1}, 2: {3}, 3: {1}, 4: {3}}
    assert _placement.cpu_map("0x10,2*2", 4, allowed) == {0: {16}, 1: {2}, 2: {2}, 3: {16}}
    assert _placement.cpu_map("7*1000000000", 2, allowed) == {0: {7}, 1: {7}}
    for spec, needle in (("1,,2", "empty entry"), ("a", "'a' is not a CPU id"), ("1*0", "repeat count"),
                         ("2*x", "repeat count"), ("40", "CPU 40 is outside the CPUs this launcher may use"),
                         ("-1", "'-1' is not a CPU id")):
        with pytest.raises(ValueError, match=needle):
            _placement.cpu_map(spec, 2, allowed)


# ---------------------------------------------------------------------------
# plan(): the options start_processes takes


@needs_binding
def test_plan_numa_options_torchmp_torch_and_duck_typed(tmp_path):
    topo = topo_of(two_sockets(), tmp_path)
    expected = {r: _core.Binding(tuple(sorted(topo.allowed_node_cpus(r))), ()) for r in range(4)}
    assert _placement.plan(4, NumaOptions(AffinityMode.NODE), topology=topo) == expected
    duck = types.SimpleNamespace(affinity_mode="node")
    assert _placement.plan(4, duck, topology=topo) == expected
    torch_binding = pytest.importorskip("torch.numa.binding")
    torch_options = torch_binding.NumaOptions(affinity_mode=torch_binding.AffinityMode.NODE)
    assert _placement.plan(4, torch_options, topology=topo) == expected


@needs_binding
def test_plan_falls_back_per_rank_when_asked(tmp_path, caplog):
    topo = topo_of(two_sockets(), tmp_path, environ={"CUDA_VISIBLE_DEVICES": "0"})
    with pytest.raises(BindingError, match="local rank 1"):
        _placement.plan(2, NumaOptions(AffinityMode.NODE), topology=topo)
    with caplog.at_level(logging.WARNING, logger="torchmp.api"):
        out = _placement.plan(2, NumaOptions(AffinityMode.NODE, should_fall_back_if_binding_fails=True),
                              topology=topo)
    assert out == {0: _core.Binding(tuple(sorted(cpus("0-3,16-19"))), ())}
    assert "local rank 1 runs without NUMA binding (node binding failed: local rank 1 binds near GPU 1" \
        in caplog.text


@needs_binding
@pytest.mark.parametrize("kwargs, exc, needle", [
    ({"numa_options": object()}, TypeError, "numa_options must be a NumaOptions"),
    ({"numa_options": types.SimpleNamespace(affinity_mode="rack")}, ValueError, "affinity_mode must be one of"),
    ({"cpu_affinity": [0]}, TypeError, "cpu_affinity must be a dict"),
    ({"cpu_affinity": {2: {0}}}, ValueError, "cpu_affinity: 2 is not a local rank in 0..1"),
    ({"cpu_affinity": {True: {0}}}, ValueError, "True is not a local rank"),
    ({"cpu_affinity": {0: set()}}, ValueError, r"cpu_affinity\[0\] is empty"),
    ({"cpu_affinity": {0: ""}}, ValueError, r"cpu_affinity\[0\] is empty"),
    ({"cpu_affinity": {0: "0-"}}, ValueError, "not a number or a range"),
    ({"cpu_affinity": {0: 3}}, TypeError, r"cpu_affinity\[0\] must be CPU ids"),
    ({"cpu_affinity": {0: [1.5]}}, ValueError, "1.5 is not a CPU id"),
    ({"cpu_affinity": {0: [-1]}}, ValueError, "-1 is not a CPU id"),
    ({"cpu_affinity": {1: "30-40"}}, ValueError,
     r"cpu_affinity\[1\]: CPUs 32-40 are outside the CPUs this launcher may use \(0-31\)"),
    ({"cpu_affinity": {0: {0}}, "numa_options": NumaOptions(AffinityMode.NODE)}, ValueError, "give one of them"),
    ({"mem_bind": "local"}, ValueError, "needs numa_options or cpu_affinity"),
    ({"cpu_affinity": {0: {0}}, "mem_bind": "near"}, ValueError, "mem_bind must be one of none, local"),
])
def test_plan_bad_options(tmp_path, kwargs, exc, needle):
    topo = topo_of(two_sockets(), tmp_path)
    with pytest.raises(exc, match=needle):
        _placement.plan(2, topology=topo, **kwargs)


@needs_binding
def test_plan_cpu_affinity_and_local_memory(tmp_path):
    machine = two_sockets()
    topo = topo_of(machine, tmp_path)
    assert _placement.plan(3, cpu_affinity={0: "0-1", 2: [5, 4]}, topology=topo) == {
        0: _core.Binding((0, 1), ()), 2: _core.Binding((4, 5), ())}
    out = _placement.plan(2, cpu_affinity={0: "0,4", 1: {31}}, mem_bind="local", topology=topo)
    assert out == {0: _core.Binding((0, 4), (0, 1)), 1: _core.Binding((31,), (3,))}
    assert _placement.plan(2, mem_bind="none", topology=topo) == {}
    # A node without memory cannot hold a rank's memory.
    machine.memory_nodes = [1, 2, 3]
    topo = topo_of(machine, tmp_path / "b")
    with pytest.raises(BindingError, match=r"local rank 0's CPUs 0-1 are on NUMA node\(s\) 0, none of which"):
        _placement.plan(1, cpu_affinity={0: "0-1"}, mem_bind="local", topology=topo)


@pytest.mark.skipif(_core.HAVE_BINDING, reason="this build can bind")
def test_plan_without_binding_support_says_so(tmp_path):
    topo = topo_of(two_sockets(), tmp_path)
    assert _placement.plan(2, topology=topo) == {}
    with pytest.raises(NotImplementedError, match="CPU binding needs sched_setaffinity"):
        _placement.plan(2, cpu_affinity={0: {0}}, topology=topo)


def test_describe():
    assert _placement.describe(None) == "not bound"
    assert _placement.describe(None, cpus("0-3")) == "not bound (cpus 0-3)"
    assert _placement.describe(_core.Binding((0, 1, 2, 8), ())) == "bound to cpus 0-2,8"
    assert _placement.describe(_core.Binding((0, 1), (0, 2)), cpus("1")) == "bound to cpus 1, memory on nodes 0,2"
