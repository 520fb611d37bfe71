"""NUMA binding: each worker on the CPUs close to its GPU, as torch does it.

torch 2.13's ``start_processes(..., numa_options=NumaOptions(...))`` and
``torchrun --numa-binding MODE`` bind local rank ``r`` to CPUs near GPU
``r``. torchmp accepts torch's own :class:`torch.numa.binding.NumaOptions`,
and this module's equivalent where torch is not installed; both compute the
same CPU sets::

    from torchmp import start_processes, DefaultLogsSpecs
    from torchmp.numa import AffinityMode, NumaOptions

    ctx = start_processes("train", "python3", args={r: ("train.py",) for r in range(8)},
                          envs={r: {} for r in range(8)}, logs_specs=DefaultLogsSpecs(),
                          numa_options=NumaOptions(AffinityMode.NODE))
    print(ctx.bindings)   # {0: Binding(cpus=(0, 1, ...), mems=()), ...}

The modes (``AffinityMode``), each over the CPUs the launcher itself may use
(its ``sched_getaffinity``):

========================  ====================================================
``node``                  every CPU of the NUMA node of the rank's GPU
``socket``                every CPU of every NUMA node on that GPU's socket
``exclusive``             that node's physical cores split evenly among the
                          GPUs on the node (lowest GPUs take the remainder)
``core-complex``          one last-level-cache group (an L3 "core complex")
                          of that node per GPU, largest groups first, reused
                          round-robin when there are more GPUs than groups
========================  ====================================================

Differences from torch: the binding is set in the child before exec (or
before the function runs) with ``sched_setaffinity``, so ``numactl`` is not
needed and no extra process is exec'd; GPUs are found in sysfs (PCI class and
vendor, see :class:`torchmp._topology.Topology`), not through CUDA, so the
launcher never initialises a GPU; and ``socket`` mode skips NUMA nodes with no
usable CPU (memory-only nodes) where torch stops with an error.  When the
topology cannot give a binding (no sysfs, a rank without a GPU, fewer cores
than GPUs) :class:`BindingError` is raised before anything starts, unless
``should_fall_back_if_binding_fails`` is set: then that rank runs unbound and
a warning says why, as in torch.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from torchmp._topology import BindingError

__all__ = ["AffinityMode", "BindingError", "NumaOptions"]


class AffinityMode(str, enum.Enum):
    """torch's ``torch.numa.binding.AffinityMode``, value for value."""

    NODE = "node"
    SOCKET = "socket"
    EXCLUSIVE = "exclusive"
    CORE_COMPLEX = "core-complex"


@dataclass(frozen=True)
class NumaOptions:
    """torch's ``torch.numa.binding.NumaOptions``, field for field.

    ``should_fall_back_if_binding_fails``: a rank whose binding cannot be
    computed runs unbound (with a warning) instead of failing the launch.
    """

    affinity_mode: AffinityMode

    should_fall_back_if_binding_fails: bool = False
