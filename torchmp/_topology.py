"""The machine's CPU, NUMA and GPU topology, read from sysfs.

Everything comes from the kernel's files (no ``numactl``, ``hwloc`` or CUDA):

* NUMA nodes: ``/sys/devices/system/node/possible`` and ``node<N>/cpulist``,
  ``has_memory``;
* CPUs: ``/sys/devices/system/cpu/cpu<N>/topology/{thread_siblings_list,
  physical_package_id}`` and ``cache/index<K>/{type,level,shared_cpu_list}``;
* GPUs: ``/sys/bus/pci/devices/<address>/{class,vendor,numa_node}`` (see
  :meth:`Topology.gpus`), and ``/proc/driver/nvidia/gpus/<address>/information``
  to resolve GPU UUIDs in ``CUDA_VISIBLE_DEVICES``.

``root`` (default ``/``, or ``$TORCHMP_SYSFS_ROOT``) is prepended to every
path, so tests describe any machine with a directory of small files.  A file
that is missing is a :class:`BindingError` naming it: torchmp does not guess a
topology it cannot read.
"""
from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["BindingError", "Gpu", "Topology", "format_cpulist", "parse_cpulist"]

#: Read the topology under this directory instead of ``/`` (tests; a copy of
#: another machine's sysfs).
ROOT_VAR = "TORCHMP_SYSFS_ROOT"

# PCI vendor ids and the class codes (base class, subclass) their GPUs use:
# VGA (0x0300), 3D controller (0x0302: datacenter NVIDIA) and display
# controller (0x0380: AMD Instinct).
_NVIDIA = 0x10DE
_AMD = 0x1002
_GPU_CLASSES = {_NVIDIA: frozenset({0x0300, 0x0302}), _AMD: frozenset({0x0300, 0x0302, 0x0380})}
_VENDOR_NAMES = {_NVIDIA: "NVIDIA", _AMD: "AMD"}

_PCI_ADDRESS = re.compile(r"([0-9a-fA-F]{4,}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])")


class BindingError(RuntimeError):
    """The topology cannot give the binding asked for: a sysfs file is
    missing, a rank has no GPU, a NUMA node has too few cores."""


def parse_cpulist(text: str, what: str = "CPU list") -> frozenset[int]:
    """``"0-3,8,10-11"`` (the kernel's list format; empty: no CPUs) -> a set.

    >>> sorted(parse_cpulist("0-2,5"))
    [0, 1, 2, 5]
    """
    out: set[int] = set()
    for item in text.strip().split(","):
        item = item.strip()
        if not item:
            continue
        lo, sep, hi = item.partition("-")
        if not (lo.isascii() and lo.isdigit() and (not sep or hi.isascii() and hi.isdigit())):
            raise ValueError(f"{what}: {item!r} in {text.strip()!r} is not a number or a range like 0-3")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"{what}: the range {item!r} in {text.strip()!r} runs backwards")
        out.update(range(first, last + 1))
    return frozenset(out)


def format_cpulist(cpus: Iterable[int]) -> str:
    """The kernel's compact list format: ``{0, 1, 2, 5}`` -> ``"0-2,5"``.

    >>> format_cpulist([5, 0, 1, 2])
    '0-2,5'
    """
    parts: list[str] = []
    run: list[int] = []
    for cpu in sorted(set(cpus)):
        if run and cpu == run[-1] + 1:
            run.append(cpu)
            continue
        if run:
            parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [cpu]
    if run:
        parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(parts)


@dataclass(frozen=True)
class Gpu:
    """One GPU as the launcher's workers see it."""

    index: int        # its device index (cuda:<index>) under the visibility variables
    pci_address: str  # e.g. 0000:3b:00.0
    numa_node: int    # the node sysfs names (-1, "no affinity", counts as node 0, as torch does)
    vendor: str       # NVIDIA or AMD


def _pci_key(address: str) -> tuple[int, ...]:
    m = _PCI_ADDRESS.fullmatch(address)
    if m is None:
        return (1 << 32,)
    return tuple(int(part, 16) for part in m.groups())


class Topology:
    """One machine's topology, read lazily and cached.

    ``allowed_cpus``: the CPUs the launcher may use (default: the calling
    thread's affinity, ``os.sched_getaffinity(0)``, what torch intersects
    with too); ``environ``: where ``CUDA_VISIBLE_DEVICES`` and friends are
    read (default ``os.environ``).
    """

    def __init__(self, root: str | os.PathLike[str] | None = None, *,
                 allowed_cpus: Iterable[int] | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
        if root is None:
            root = os.environ.get(ROOT_VAR) or "/"
        self.root = os.fspath(root)
        if allowed_cpus is None:
            if not hasattr(os, "sched_getaffinity"):
                raise BindingError("CPU binding needs sched_getaffinity, which this system does not have")
            allowed_cpus = os.sched_getaffinity(0)
        self.allowed_cpus: frozenset[int] = frozenset(allowed_cpus)
        self.environ: Mapping[str, str] = os.environ if environ is None else environ

    # -- files ------------------------------------------------------------
    def path(self, relative: str) -> str:
        return os.path.join(self.root, relative.lstrip("/"))

    def _read(self, relative: str, why: str) -> str:
        path = self.path(relative)
        try:
            with open(path, encoding="ascii", errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            raise BindingError(
                f"cannot read the {why}: {path} does not exist (a kernel without NUMA "
                "support, or sysfs not mounted?); torchmp does not guess the topology") from None
        except OSError as e:
            raise BindingError(f"cannot read the {why}: {path}: {e.strerror or e}") from None

    def _read_list(self, relative: str, why: str) -> frozenset[int]:
        text = self._read(relative, why)
        try:
            return parse_cpulist(text, self.path(relative))
        except ValueError as e:
            raise BindingError(f"cannot read the {why}: {e}") from None

    def _read_int(self, relative: str, why: str) -> int:
        text = self._read(relative, why).strip()
        try:
            return int(text, 0)
        except ValueError:
            raise BindingError(f"cannot read the {why}: {self.path(relative)} holds {text!r}") from None

    # -- NUMA nodes ---------------------------------------------------------
    def has_numa_info(self) -> bool:
        return os.path.isdir(self.path("sys/devices/system/node"))

    @functools.cached_property
    def possible_nodes(self) -> tuple[int, ...]:
        """Every node the kernel could bring up (``node/possible``), as torch's socket mode reads them."""
        return tuple(sorted(self._read_list("sys/devices/system/node/possible", "NUMA nodes")))

    def node_exists(self, node: int) -> bool:
        return os.path.isdir(self.path(f"sys/devices/system/node/node{node}"))

    @functools.cache  # noqa: B019 - one Topology per launch; its files do not change meanwhile
    def node_cpus(self, node: int) -> frozenset[int]:
        """Every CPU of ``node``, allowed or not."""
        return self._read_list(f"sys/devices/system/node/node{node}/cpulist", f"CPUs of NUMA node {node}")

    def allowed_node_cpus(self, node: int) -> frozenset[int]:
        return self.node_cpus(node) & self.allowed_cpus

    @functools.cached_property
    def nodes_with_cpus(self) -> tuple[int, ...]:
        """The nodes that exist and hold at least one allowed CPU, in order."""
        return tuple(n for n in self.possible_nodes if self.node_exists(n) and self.allowed_node_cpus(n))

    @functools.cached_property
    def node_of_cpu(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for node in self.possible_nodes:
            if self.node_exists(node):
                for cpu in self.node_cpus(node):
                    out[cpu] = node
        return out

    @functools.cached_property
    def memory_nodes(self) -> frozenset[int]:
        """The nodes with memory (``node/has_memory``): where MPOL_BIND may point."""
        return self._read_list("sys/devices/system/node/has_memory", "NUMA nodes with memory")

    # -- CPUs -------------------------------------------------------------
    @functools.cache  # noqa: B019
    def package_of(self, cpu: int) -> int:
        """The socket (``physical_package_id``) of ``cpu``."""
        return self._read_int(f"sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id",
                              f"socket of CPU {cpu}")

    @functools.cache  # noqa: B019
    def core_of(self, cpu: int) -> int:
        """The physical core of ``cpu``, named by its lowest hardware thread
        (``thread_siblings_list``), as torch names it."""
        siblings = self._read_list(f"sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list",
                                   f"hardware threads of CPU {cpu}'s core")
        if not siblings:
            raise BindingError(f"CPU {cpu} lists no hardware thread in its thread_siblings_list")
        return min(siblings)

    @functools.cache  # noqa: B019
    def last_level_cache_of(self, cpu: int) -> int:
        """The largest-level data or unified cache of ``cpu`` (an L3 "core
        complex" on most machines), named by the lowest CPU sharing it."""
        relative = f"sys/devices/system/cpu/cpu{cpu}/cache"
        try:
            entries = os.listdir(self.path(relative))
        except OSError as e:
            raise BindingError(
                f"cannot read the caches of CPU {cpu}: {self.path(relative)}: {e.strerror or e}") from None
        best_level = -1
        sharing: frozenset[int] = frozenset()
        # In index order: of two caches at the top level, the first counts
        # (torch takes the first its directory listing returns).
        indices = sorted(int(e[5:]) for e in entries if e.startswith("index") and e[5:].isdecimal())
        for index in indices:
            base = f"{relative}/index{index}"
            kind = self._read(f"{base}/type", f"type of cache {index} of CPU {cpu}").strip()
            if kind not in ("Unified", "Data"):
                continue
            level = self._read_int(f"{base}/level", f"level of cache {index} of CPU {cpu}")
            if level <= best_level:
                continue
            best_level = level
            sharing = self._read_list(f"{base}/shared_cpu_list", f"CPUs sharing cache {index} of CPU {cpu}")
        if not sharing:
            raise BindingError(f"CPU {cpu} lists no data or unified cache under {self.path(relative)}")
        return min(sharing)

    # -- GPUs -------------------------------------------------------------
    @functools.cached_property
    def _pci_gpus(self) -> list[tuple[str, int, int]]:
        """(address, vendor id, numa node) of every GPU on the PCI bus, in
        address order: NVIDIA's if there are any, else AMD's (an AMD
        processor's integrated graphics must not shift the NVIDIA indices)."""
        base = "sys/bus/pci/devices"
        try:
            addresses = os.listdir(self.path(base))
        except FileNotFoundError:
            raise BindingError(
                f"cannot look for GPUs: {self.path(base)} does not exist (sysfs not mounted?)") from None
        except OSError as e:
            raise BindingError(f"cannot look for GPUs: {self.path(base)}: {e.strerror or e}") from None
        found: dict[int, list[tuple[str, int, int]]] = {_NVIDIA: [], _AMD: []}
        for address in sorted(addresses, key=_pci_key):
            try:
                with open(self.path(f"{base}/{address}/vendor"), encoding="ascii") as f:
                    vendor = int(f.read().strip(), 16)
                with open(self.path(f"{base}/{address}/class"), encoding="ascii") as f:
                    pci_class = int(f.read().strip(), 16) >> 8
            except (OSError, ValueError):
                continue  # not a device we could use anyway
            if pci_class not in _GPU_CLASSES.get(vendor, ()):
                continue
            node = self._read_int(f"{base}/{address}/numa_node", f"NUMA node of GPU {address}")
            # Single-node machines often say -1 ("no affinity"): node 0.
            found[vendor].append((address, vendor, max(node, 0)))
        return found[_NVIDIA] or found[_AMD]

    def _nvidia_uuids(self) -> dict[str, str]:
        """PCI address -> ``GPU-...`` UUID, from the NVIDIA driver's files."""
        out: dict[str, str] = {}
        base = self.path("proc/driver/nvidia/gpus")
        try:
            addresses = os.listdir(base)
        except OSError:
            return out
        for address in addresses:
            try:
                with open(os.path.join(base, address, "information"), encoding="utf-8", errors="replace") as f:
                    for line in f:
                        key, _, value = line.partition(":")
                        if key.strip() == "GPU UUID":
                            out[address.lower()] = value.strip()
            except OSError:
                continue
        return out

    def _select(self, devices: list[tuple[str, int, int]], variable: str) -> list[tuple[str, int, int]]:
        """CUDA's rule for a visibility list: entries are indices or UUID
        prefixes; the list ends at the first entry that names no device
        (or one already listed)."""
        value = self.environ.get(variable)
        if value is None:
            return devices
        uuids: dict[str, str] | None = None
        chosen: list[tuple[str, int, int]] = []
        for entry in value.split(","):
            entry = entry.strip()
            pick = None
            if entry.isascii() and entry.isdigit():
                if int(entry) < len(devices):
                    pick = devices[int(entry)]
            elif entry.startswith("MIG-"):
                raise BindingError(
                    f"{variable}={value!r} names a MIG instance ({entry}); its GPU cannot be found "
                    "from sysfs: list the GPUs by index or GPU- UUID to bind")
            elif entry.upper().startswith("GPU-"):
                if uuids is None:
                    uuids = self._nvidia_uuids()
                if not uuids:
                    raise BindingError(
                        f"{variable}={value!r} names GPUs by UUID, and {self.path('proc/driver/nvidia/gpus')} "
                        "(which maps UUIDs to PCI addresses) is not readable: list them by index to bind")
                matches = [d for d in devices if uuids.get(d[0].lower(), "").lower().startswith(entry.lower())]
                if len(matches) == 1:
                    pick = matches[0]
            if pick is None or pick in chosen:
                break
            chosen.append(pick)
        return chosen

    @functools.cached_property
    def gpus(self) -> tuple[Gpu, ...]:
        """The GPUs the workers can use, in device-index order.

        Found on the PCI bus: NVIDIA (vendor 0x10de) VGA and 3D controllers,
        else AMD (0x1002) VGA, 3D and display controllers; numbered in PCI
        address order (CUDA's ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, nvidia-smi's
        order), then filtered and reordered as ``CUDA_VISIBLE_DEVICES`` says
        (AMD: ``ROCR_VISIBLE_DEVICES``, then ``HIP_VISIBLE_DEVICES`` or
        else ``CUDA_VISIBLE_DEVICES``)."""
        devices = self._pci_gpus
        if devices and devices[0][1] == _AMD:
            devices = self._select(devices, "ROCR_VISIBLE_DEVICES")
            variable = "HIP_VISIBLE_DEVICES" if "HIP_VISIBLE_DEVICES" in self.environ else "CUDA_VISIBLE_DEVICES"
            devices = self._select(devices, variable)
        else:
            devices = self._select(devices, "CUDA_VISIBLE_DEVICES")
        return tuple(Gpu(i, address, node, _VENDOR_NAMES[vendor])
                     for i, (address, vendor, node) in enumerate(devices))

    def visibility_note(self) -> str:
        """What limited the visible GPUs, for error messages."""
        shown = [f"{v}={self.environ[v]!r}" for v in
                 ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES") if v in self.environ]
        return f" ({', '.join(shown)})" if shown else ""
