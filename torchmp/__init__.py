"""torchmp: launch and manage n copies of a worker process on one host.

A drop-in for ``torch.distributed.elastic.multiprocessing`` that does not
need PyTorch: the same ``start_processes``, ``PContext``, redirects, tee and
``error.json`` behaviour, with the hot paths (fork/exec, stream redirection,
the tee multiplexer, reaping) in one native I/O thread.

>>> import torchmp
>>> ctx = torchmp.start_processes("demo", "true", args={0: (), 1: ()},
...                               envs={0: {}, 1: {}}, logs_specs=torchmp.DefaultLogsSpecs())
>>> ctx.wait().is_failed()
False
>>> ctx.close()
"""

from torchmp._version import __version__

try:
    from torchmp import _core
except ImportError as e:  # pragma: no cover - exercised by packaging tests
    raise ImportError(
        "torchmp's compiled core (torchmp._core) could not be imported; torchmp has no "
        f"pure-Python fallback. Reinstall torchmp for this interpreter. ({e})"
    ) from e

if _core.__version__ != __version__:  # pragma: no cover - exercised by packaging tests
    raise ImportError(
        f"torchmp {__version__} found a compiled core built for torchmp {_core.__version__} "
        f"at {_core.__file__}; rebuild it (pip install --force-reinstall torchmp, or "
        "python setup.py build_ext --inplace for a source checkout)."
    )

from torchmp.api import (  # noqa: E402
    DefaultLogsSpecs,
    LogsDest,
    LogsSpecs,
    PContext,
    ResourceUsage,
    RunProcsResult,
    SignalException,
    Std,
    SubprocessContext,
    start_processes,
    to_map,
)
from torchmp.errors import ProcessFailure  # noqa: E402

__all__ = [
    "DefaultLogsSpecs",
    "LogsDest",
    "LogsSpecs",
    "MultiprocessContext",
    "PContext",
    "ProcessFailure",
    "ResourceUsage",
    "RunProcsResult",
    "SignalException",
    "Std",
    "SubprocessContext",
    "__version__",
    "start_processes",
    "to_map",
]


def __getattr__(name: str) -> object:
    if name == "MultiprocessContext":
        from torchmp.api import MultiprocessContext

        return MultiprocessContext
    raise AttributeError(f"module 'torchmp' has no attribute {name!r}")
