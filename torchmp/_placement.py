"""Where each rank runs: the CPU set (and memory policy) every rank is bound
to, decided in the launcher before anything starts.

One owner for the policy: :func:`plan` turns ``numa_options`` (torch's
``NumaOptions`` or torchmp's, duck-typed), ``cpu_affinity={rank: cpus}`` and
``mem_bind`` into one :class:`torchmp._core.Binding` per bound rank, which the
native child setup applies with ``sched_setaffinity`` (and ``set_mempolicy``)
before exec, or before the function runs.

The four ``numa_options`` modes compute exactly the CPU sets of torch 2.13's
``torch.numa.binding`` for the same topology and GPU mapping (local rank
``r`` uses GPU ``r``); :func:`cores`, :func:`numa_nodes` and :func:`cpu_map`
are ``torchmp run --cpu-bind``'s modes for machines without GPUs.
"""
from __future__ import annotations

import enum
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from torchmp import _core
from torchmp._topology import BindingError, Topology, format_cpulist, parse_cpulist

__all__ = [
    "AFFINITY_MODES", "MEM_BIND_MODES", "affinity_mode", "bind_current_process", "cores", "cpu_map",
    "cpus_for_gpu", "cpus_of", "describe", "numa_nodes", "plan",
]

logger = logging.getLogger("torchmp.api")

#: torch's ``AffinityMode`` values.
AFFINITY_MODES = ("node", "socket", "exclusive", "core-complex")
#: ``mem_bind`` / ``--mem-bind`` values (srun's spellings).
MEM_BIND_MODES = ("none", "local")


def affinity_mode(numa_options: Any) -> tuple[str, bool]:
    """(mode, fall back if binding fails) of a ``NumaOptions``-like object:
    torch's, torchmp's, or anything with ``affinity_mode`` (an enum whose
    value is a mode, or the mode's string)."""
    if not hasattr(numa_options, "affinity_mode"):
        raise TypeError(
            "numa_options must be a NumaOptions (torch.numa.binding's or torchmp.numa's), "
            f"got {type(numa_options).__name__}")
    mode = numa_options.affinity_mode
    value = mode.value if isinstance(mode, enum.Enum) else mode
    if value not in AFFINITY_MODES:
        raise ValueError(f"numa_options.affinity_mode must be one of {', '.join(AFFINITY_MODES)}; got {mode!r}")
    return str(value), bool(getattr(numa_options, "should_fall_back_if_binding_fails", False))


# ---------------------------------------------------------------------------
# torch's modes: the CPUs near a rank's GPU


def _gpu_node(topo: Topology, gpu_index: int) -> int:
    gpus = topo.gpus
    if gpu_index >= len(gpus):
        seen = f"{len(gpus)} GPU{'s' if len(gpus) != 1 else ''} visible{topo.visibility_note()}"
        raise BindingError(
            f"local rank {gpu_index} binds near GPU {gpu_index}, but there {'is' if len(gpus) == 1 else 'are'} "
            f"{seen}; GPUs are found on the PCI bus under {topo.path('sys/bus/pci/devices')}")
    return gpus[gpu_index].numa_node


def _node_cpus(topo: Topology, node: int) -> frozenset[int]:
    cpus = topo.allowed_node_cpus(node)
    if not cpus:
        raise BindingError(
            f"NUMA node {node} has no CPU this launcher may use (node CPUs "
            f"{format_cpulist(topo.node_cpus(node)) or 'none'}, allowed {format_cpulist(topo.allowed_cpus)})")
    return cpus


def _peers(topo: Topology, node: int, gpu_index: int) -> tuple[int, int]:
    """(this GPU's position among the visible GPUs on its node, their number)."""
    peers = [g.index for g in topo.gpus if g.numa_node == node]
    return peers.index(gpu_index), len(peers)


def _group(cpus: Iterable[int], key: Callable[[int], int]) -> dict[int, set[int]]:
    groups: dict[int, set[int]] = {}
    for cpu in cpus:
        groups.setdefault(key(cpu), set()).add(cpu)
    return groups


def _mode_node(topo: Topology, gpu_index: int) -> frozenset[int]:
    return _node_cpus(topo, _gpu_node(topo, gpu_index))


def _mode_socket(topo: Topology, gpu_index: int) -> frozenset[int]:
    socket = topo.package_of(min(_node_cpus(topo, _gpu_node(topo, gpu_index))))
    cpus: set[int] = set()
    # torch stops with an error at a possible node that does not exist or
    # has no allowed CPU (a memory-only node); such a node adds no CPU.
    for node in topo.nodes_with_cpus:
        node_cpus = topo.allowed_node_cpus(node)
        if topo.package_of(min(node_cpus)) == socket:
            cpus |= node_cpus
    return frozenset(cpus)


def _mode_exclusive(topo: Topology, gpu_index: int) -> frozenset[int]:
    node = _gpu_node(topo, gpu_index)
    position, count = _peers(topo, node, gpu_index)
    by_core = sorted(_group(_node_cpus(topo, node), topo.core_of).items())
    share, extra = divmod(len(by_core), count)
    if share < 1:
        raise BindingError(
            f"NUMA node {node} has {len(by_core)} physical core{'s' if len(by_core) != 1 else ''} this "
            f"launcher may use but {count} GPUs: exclusive binding needs a core per GPU")
    # The lowest GPU indices take the cores that do not divide evenly.
    start = position * share + min(position, extra)
    end = start + share + (1 if position < extra else 0)
    return frozenset(cpu for _, threads in by_core[start:end] for cpu in threads)


def _mode_core_complex(topo: Topology, gpu_index: int) -> frozenset[int]:
    node = _gpu_node(topo, gpu_index)
    position, _ = _peers(topo, node, gpu_index)
    caches = _group(_node_cpus(topo, node), topo.last_level_cache_of)
    # The caches with the most usable CPUs first, then by lowest CPU.
    ordered = sorted(caches.items(), key=lambda item: (-len(item[1]), item[0]))
    return frozenset(ordered[position % len(ordered)][1])


_MODES: dict[str, Callable[[Topology, int], frozenset[int]]] = {
    "node": _mode_node,
    "socket": _mode_socket,
    "exclusive": _mode_exclusive,
    "core-complex": _mode_core_complex,
}


def cpus_for_gpu(topo: Topology, mode: str, gpu_index: int) -> frozenset[int]:
    """The CPUs torch 2.13's ``AffinityMode(mode)`` binds the worker using
    GPU ``gpu_index`` to (never empty: BindingError instead)."""
    if mode not in _MODES:
        raise ValueError(f"unknown affinity mode {mode!r}; the modes are {', '.join(AFFINITY_MODES)}")
    cpus = _MODES[mode](topo, gpu_index)
    if not cpus:
        raise BindingError(f"{mode} binding for GPU {gpu_index} found no CPU to bind to")
    return cpus


# ---------------------------------------------------------------------------
# --cpu-bind's modes (no GPU needed)


def cores(topo: Topology, nprocs: int) -> dict[int, frozenset[int]]:
    """The allowed physical cores (every hardware thread of each), in NUMA
    node order, cut into ``nprocs`` contiguous blocks as even as can be (the
    lowest ranks take one more); more ranks than cores is an error."""
    node_of = topo.node_of_cpu if topo.has_numa_info() else {}
    by_core = _group(topo.allowed_cpus, topo.core_of)
    ordered = sorted(by_core.items(), key=lambda item: (node_of.get(item[0], 0), item[0]))
    if nprocs > len(ordered):
        raise ValueError(
            f"cores binding: {nprocs} ranks but only {len(ordered)} physical "
            f"core{'s' if len(ordered) != 1 else ''} allowed (CPUs {format_cpulist(topo.allowed_cpus)})")
    share, extra = divmod(len(ordered), nprocs)
    out = {}
    start = 0
    for rank in range(nprocs):
        end = start + share + (1 if rank < extra else 0)
        out[rank] = frozenset(cpu for _, threads in ordered[start:end] for cpu in threads)
        start = end
    return out


def numa_nodes(topo: Topology, nprocs: int) -> dict[int, frozenset[int]]:
    """Each rank on every allowed CPU of one NUMA node, ranks spread over
    the nodes in blocks (ranks 0..k-1 on the first node, and so on)."""
    if not topo.has_numa_info():
        raise BindingError(
            f"numa binding: {topo.path('sys/devices/system/node')} does not exist (a kernel without "
            "NUMA support?); torchmp does not guess the nodes")
    nodes = topo.nodes_with_cpus
    if not nodes:
        raise BindingError(f"numa binding: no NUMA node holds an allowed CPU ({format_cpulist(topo.allowed_cpus)})")
    return {rank: topo.allowed_node_cpus(nodes[rank * len(nodes) // nprocs]) for rank in range(nprocs)}


def _cpu_id(text: str, spec: str) -> int:
    lowered = text.lower()
    digits = lowered[2:] if lowered.startswith("0x") else lowered
    allowed = "0123456789abcdef" if digits is not lowered else "0123456789"
    if not digits or any(c not in allowed for c in digits):
        raise ValueError(f"map:{spec}: {text!r} is not a CPU id")
    return int(digits, 16 if digits is not lowered else 10)


def cpu_map(spec: str, nprocs: int, allowed: frozenset[int]) -> dict[int, frozenset[int]]:
    """srun's ``map_cpu:LIST``: rank ``i`` on the one CPU at position ``i``
    of LIST, which is reused from its start for more ranks; ``ID*N`` repeats
    an id; ids are decimal, or hexadecimal after ``0x``; each must be in
    ``allowed``."""
    cpus: list[int] = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            raise ValueError(f"map:{spec}: empty entry")
        cpu_text, star, count_text = item.partition("*")
        cpu = _cpu_id(cpu_text.strip(), spec)
        count = 1
        if star:
            if not count_text.strip().isdigit() or int(count_text) < 1:
                raise ValueError(f"map:{spec}: {item!r} needs a repeat count of at least 1 after '*'")
            count = int(count_text)
        if cpu not in allowed:
            raise ValueError(f"map:{spec}: CPU {cpu} is outside the CPUs this launcher may use "
                             f"({format_cpulist(allowed)})")
        cpus.extend([cpu] * min(count, nprocs))
    return {rank: frozenset({cpus[rank % len(cpus)]}) for rank in range(nprocs)}


# ---------------------------------------------------------------------------
# The plan


def _cpu_set(value: Any, rank: int) -> frozenset[int]:
    if isinstance(value, str):
        return parse_cpulist(value, f"cpu_affinity[{rank}]")
    try:
        cpus = frozenset(value)
    except TypeError:
        raise TypeError(
            f"cpu_affinity[{rank}] must be CPU ids (a set, a list or a string like '0-3'), "
            f"got {type(value).__name__}") from None
    for cpu in cpus:
        if isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < 0:
            raise ValueError(f"cpu_affinity[{rank}]: {cpu!r} is not a CPU id")
    return cpus


def _check_cpu_affinity(cpu_affinity: Any, nprocs: int, allowed: frozenset[int]) -> dict[int, frozenset[int]]:
    if not isinstance(cpu_affinity, Mapping):
        raise TypeError(f"cpu_affinity must be a dict {{local_rank: cpus}}, got {type(cpu_affinity).__name__}")
    out = {}
    for rank, value in cpu_affinity.items():
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < nprocs:
            raise ValueError(f"cpu_affinity: {rank!r} is not a local rank in 0..{nprocs - 1}")
        cpus = _cpu_set(value, rank)
        if not cpus:
            raise ValueError(f"cpu_affinity[{rank}] is empty")
        outside = cpus - allowed
        if outside:
            raise ValueError(
                f"cpu_affinity[{rank}]: CPU{'s' if len(outside) > 1 else ''} {format_cpulist(outside)} "
                f"{'are' if len(outside) > 1 else 'is'} outside the CPUs this launcher may use "
                f"({format_cpulist(allowed)})")
        out[rank] = cpus
    return out


def _allowed_mems() -> frozenset[int] | None:
    """The nodes the launcher's cpuset lets it allocate on, None if unknown."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Mems_allowed_list:"):
                    return parse_cpulist(line.split(":", 1)[1], "Mems_allowed_list")
    except (OSError, ValueError):
        pass
    return None


def _local_mems(topo: Topology, rank: int, cpus: frozenset[int], allowed: frozenset[int] | None) -> frozenset[int]:
    if not topo.has_numa_info():
        raise BindingError(
            f"mem_bind='local': {topo.path('sys/devices/system/node')} does not exist (a kernel without "
            "NUMA support?): there is no NUMA memory to bind to")
    nodes = frozenset(topo.node_of_cpu[cpu] for cpu in cpus if cpu in topo.node_of_cpu)
    mems = nodes & topo.memory_nodes
    if allowed is not None:
        mems &= allowed
    if not mems:
        raise BindingError(
            f"mem_bind='local': local rank {rank}'s CPUs {format_cpulist(cpus)} are on NUMA node(s) "
            f"{format_cpulist(nodes) or '?'}, none of which has memory this launcher may use")
    return mems


def _numa_cpus(topo: Topology, mode: str, fall_back: bool, rank: int) -> frozenset[int] | None:
    try:
        return cpus_for_gpu(topo, mode, rank)
    except BindingError as e:
        if not fall_back:
            raise
        # torch's should_fall_back_if_binding_fails: the rank runs unbound.
        logger.warning("local rank %s runs without NUMA binding (%s binding failed: %s)", rank, mode, e)
        return None


def bind_current_process(numa_options: Any, local_rank: int) -> None:
    """torch's binding of a running process (``api._wrap``): every thread
    that still has the main thread's affinity moves to the CPUs near GPU
    ``local_rank``.  torchmp's own workers are bound before they start."""
    mode, fall_back = affinity_mode(numa_options)
    cpus = _numa_cpus(Topology(), mode, fall_back, local_rank)
    if cpus is None:
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    for name in os.listdir("/proc/self/task"):
        try:
            tid = int(name)
            # A thread someone bound already keeps its own affinity.
            if os.sched_getaffinity(tid) == before:
                os.sched_setaffinity(tid, cpus)
        except (OSError, ValueError):
            pass  # the thread has exited meanwhile


def plan(nprocs: int, numa_options: Any = None, cpu_affinity: Any = None, mem_bind: str | None = None,
         topology: Topology | None = None) -> dict[int, _core.Binding]:
    """Each bound rank's :class:`~torchmp._core.Binding` (ranks not in the
    result run where the launcher may run).  Every bad option is an error
    here, before anything starts: ValueError/TypeError for the options,
    BindingError for what the topology cannot give."""
    if mem_bind is not None and mem_bind not in MEM_BIND_MODES:
        raise ValueError(f"mem_bind must be one of {', '.join(MEM_BIND_MODES)}; got {mem_bind!r}")
    if numa_options is None and cpu_affinity is None:
        if mem_bind == "local":
            raise ValueError("mem_bind='local' binds memory to the NUMA nodes of a rank's CPUs: "
                             "it needs numa_options or cpu_affinity")
        return {}
    if numa_options is not None and cpu_affinity is not None:
        raise ValueError("numa_options and cpu_affinity both say where ranks run: give one of them")
    mode, fall_back = affinity_mode(numa_options) if numa_options is not None else ("", False)
    if not _core.HAVE_BINDING:
        raise NotImplementedError("CPU binding needs sched_setaffinity, which this build of torchmp lacks")
    topo = topology if topology is not None else Topology()
    cpus: dict[int, frozenset[int]] = {}
    if numa_options is None:
        cpus = _check_cpu_affinity(cpu_affinity, nprocs, topo.allowed_cpus)
    else:
        for rank in range(nprocs):
            rank_cpus = _numa_cpus(topo, mode, fall_back, rank)
            if rank_cpus is not None:
                cpus[rank] = rank_cpus
    mems_allowed = _allowed_mems() if mem_bind == "local" and topo.root == "/" else None
    out = {}
    for rank, rank_cpus in sorted(cpus.items()):
        mems = _local_mems(topo, rank, rank_cpus, mems_allowed) if mem_bind == "local" else frozenset()
        out[rank] = _core.Binding(tuple(sorted(rank_cpus)), tuple(sorted(mems)))
    return out


def cpus_of(pid: int) -> frozenset[int] | None:
    """The CPUs the kernel lets ``pid`` run on (``Cpus_allowed_list`` of
    its ``/proc/<pid>/status``), None if it cannot be read."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Cpus_allowed_list:"):
                    return parse_cpulist(line.split(":", 1)[1])
    except (OSError, ValueError):
        pass
    return None


def describe(binding: _core.Binding | None, actual: frozenset[int] | None = None) -> str:
    """Where a rank runs, for reports: ``bound to cpus 0-3`` (``, memory
    on node 0``) or ``not bound (cpus 0-63)``.  ``actual``: the CPUs the
    kernel reports for the rank (:func:`cpus_of`), shown when known."""
    if binding is None:
        return "not bound" if actual is None else f"not bound (cpus {format_cpulist(actual)})"
    text = f"bound to cpus {format_cpulist(actual if actual is not None else binding.cpus)}"
    if binding.mems:
        text += f", memory on node{'s' if len(binding.mems) > 1 else ''} {format_cpulist(binding.mems)}"
    return text
