"""Fake machines for the topology tests: a directory laid out as the
kernel's sysfs (and the NVIDIA driver's /proc files), small files only.

``Machine`` describes one; ``write(root)`` creates the files under root, and
``Topology(root, allowed_cpus=...)`` reads them back.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from torchmp._topology import format_cpulist


@dataclass
class Device:
    address: str            # 0000:1b:00.0
    vendor: int             # 0x10de
    pci_class: int          # 0x030200
    numa_node: int          # -1 for "no affinity"
    uuid: str | None = None  # written to /proc/driver/nvidia/gpus/<address>/information


@dataclass
class Machine:
    #: node -> its CPUs (every node in possible unless listed in absent_nodes).
    nodes: dict[int, list[int]]
    #: cpu -> socket
    socket: dict[int, int]
    #: cpu -> the hardware threads of its core (itself included)
    siblings: dict[int, list[int]]
    #: cpu -> the CPUs sharing its L3
    l3: dict[int, list[int]]
    devices: list[Device] = field(default_factory=list)
    #: nodes listed in node/possible without a directory (never brought up)
    absent_nodes: list[int] = field(default_factory=list)
    #: nodes with memory (default: every node)
    memory_nodes: list[int] | None = None

    @property
    def cpus(self) -> list[int]:
        return sorted(c for cpus in self.nodes.values() for c in cpus)

    def write(self, root: Path) -> Path:
        def put(relative: str, text: str) -> None:
            path = root / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text + "\n")

        node_dir = "sys/devices/system/node"
        possible = sorted(set(self.nodes) | set(self.absent_nodes))
        put(f"{node_dir}/possible", format_cpulist(possible))
        put(f"{node_dir}/online", format_cpulist(self.nodes))
        memory = self.memory_nodes if self.memory_nodes is not None else list(self.nodes)
        put(f"{node_dir}/has_memory", format_cpulist(memory))
        for node, cpus in self.nodes.items():
            put(f"{node_dir}/node{node}/cpulist", format_cpulist(cpus))
        cpu_dir = "sys/devices/system/cpu"
        put(f"{cpu_dir}/online", format_cpulist(self.cpus))
        for cpu in self.cpus:
            base = f"{cpu_dir}/cpu{cpu}"
            put(f"{base}/topology/physical_package_id", str(self.socket[cpu]))
            put(f"{base}/topology/thread_siblings_list", format_cpulist(self.siblings[cpu]))
            core = format_cpulist(self.siblings[cpu])
            # L1d, L1i, L2 per core; the L3 as described.
            for index, (kind, level, shared) in enumerate((
                    ("Data", 1, core), ("Instruction", 1, core), ("Unified", 2, core),
                    ("Unified", 3, format_cpulist(self.l3[cpu])))):
                put(f"{base}/cache/index{index}/type", kind)
                put(f"{base}/cache/index{index}/level", str(level))
                put(f"{base}/cache/index{index}/shared_cpu_list", shared)
        (root / "sys/bus/pci/devices").mkdir(parents=True, exist_ok=True)
        for dev in self.devices:
            base = f"sys/bus/pci/devices/{dev.address}"
            put(f"{base}/vendor", f"0x{dev.vendor:04x}")
            put(f"{base}/class", f"0x{dev.pci_class:06x}")
            put(f"{base}/numa_node", str(dev.numa_node))
            if dev.uuid is not None:
                put(f"proc/driver/nvidia/gpus/{dev.address}/information",
                    f"Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 1\nGPU UUID: \t {dev.uuid}\n"
                    "Video BIOS: \t 96.00.74.00.01\nBus Type: \t PCIe\n")
        return root


# PCI addresses of the GPUs, one block per node (numbered in address order).
_GPU_BUSES = ("1b", "3b", "8b", "bb")


def two_sockets(gpus_per_node: int = 1, threads: int = 2, cores_per_node: int = 4,
                gpu_vendor: int = 0x10DE, gpu_class: int = 0x030200) -> Machine:
    """2 sockets x 2 NUMA nodes, ``cores_per_node`` cores per node with
    ``threads`` hardware threads each (Linux numbering: the first thread of
    every core, then the second), each node's L3 split in two core
    complexes, ``gpus_per_node`` GPUs on every node, and the devices a real
    server has besides (a BMC's VGA, an NVSwitch, a GPU's audio function)."""
    ncores = 4 * cores_per_node
    nodes: dict[int, list[int]] = {}
    socket: dict[int, int] = {}
    siblings: dict[int, list[int]] = {}
    l3: dict[int, list[int]] = {}
    for node in range(4):
        cores = range(node * cores_per_node, (node + 1) * cores_per_node)
        nodes[node] = sorted(c + t * ncores for c in cores for t in range(threads))
        half = cores_per_node // 2
        for i, core in enumerate(cores):
            threads_of = [core + t * ncores for t in range(threads)]
            complex_cores = cores[:half] if i < half else cores[half:]
            for cpu in threads_of:
                socket[cpu] = node // 2
                siblings[cpu] = threads_of
                l3[cpu] = sorted(c + t * ncores for c in complex_cores for t in range(threads))
    devices = [
        Device("0000:02:00.0", 0x1A03, 0x030000, -1),         # ASPEED BMC VGA: not a GPU
        Device("0000:05:00.0", 0x10DE, 0x068000, 0),          # NVSwitch bridge: not a GPU
    ]
    for node in range(4):
        for k in range(gpus_per_node):
            address = f"0000:{_GPU_BUSES[node]}:{k:02x}.0"
            devices.append(Device(address, gpu_vendor, gpu_class, node,
                                  uuid=f"GPU-{node}{k}aaaaaa-1111-2222-3333-44444444444{k}"))
            # The GPU's own audio function: class 0x0403, not a GPU.
            devices.append(Device(f"0000:{_GPU_BUSES[node]}:{k:02x}.1", gpu_vendor, 0x040300, node))
    return Machine(nodes, socket, siblings, l3, devices)


def like_this_host(cpus: list[int], gpu_nodes: list[int]) -> Machine:
    """One NUMA node per CPU of this machine (one core, one L3 each) and a
    GPU on each node of gpu_nodes: a topology whose bindings this machine
    can really apply."""
    nodes = {i: [cpu] for i, cpu in enumerate(cpus)}
    socket = dict.fromkeys(cpus, 0)
    siblings = {cpu: [cpu] for cpu in cpus}
    l3 = {cpu: [cpu] for cpu in cpus}
    devices = [Device(f"0000:{_GPU_BUSES[i]}:00.0", 0x10DE, 0x030200, node) for i, node in enumerate(gpu_nodes)]
    return Machine(nodes, socket, siblings, l3, devices)
