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

For one command at a time (an agent's tools), ``torchmp.run`` and
``await torchmp.run_async(...)`` are ``subprocess.run`` without its traps:

>>> torchmp.run(["echo", "hi"], capture_output=True).stdout
b'hi\\n'

The public names are loaded on first use, so a spawned function worker
(which imports ``torchmp._launch.worker``) starts about as fast as a bare
interpreter.
"""

from __future__ import annotations

import sys

# The single source of torchmp's version: setup.py reads it from here for the
# package metadata and compiles it into _core.  (Here, not in a module of its
# own: a fresh interpreter's import of one more module costs it 0.1 ms.)
__version__ = "0.1.0"

# typing only for the type checker: ``import torchmp`` stays off it (an
# agent whose tool calls are new interpreters pays every import).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

try:
    from torchmp import _core as _core
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

_EXPORTS = {
    "DefaultLogsSpecs": "torchmp.api",
    "LogsDest": "torchmp.api",
    "LogsSpecs": "torchmp.api",
    "PContext": "torchmp.api",
    "ResourceUsage": "torchmp.api",
    "RunProcsResult": "torchmp.api",
    "SignalException": "torchmp.api",
    "Std": "torchmp.api",
    "SubprocessContext": "torchmp.api",
    "start_processes": "torchmp.api",
    "to_map": "torchmp.api",
    "MultiprocessContext": "torchmp._functions",
    "NumaOptions": "torchmp.numa",
    "ProcessFailure": "torchmp.errors",
    "CompletedProcess": "torchmp._run",
    "run": "torchmp._run",
    "run_async": "torchmp._run",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'torchmp' has no attribute {name!r}")
    # __import__, not importlib.import_module: importing importlib would cost
    # every new interpreter that imports torchmp a quarter of a millisecond.
    __import__(module)
    value = getattr(sys.modules[module], name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


# Explicit "X as X" re-exports: __all__ is computed, so mypy cannot read it.
if TYPE_CHECKING:
    from torchmp._functions import MultiprocessContext as MultiprocessContext
    from torchmp._run import CompletedProcess as CompletedProcess, run as run, run_async as run_async
    from torchmp.api import (
        DefaultLogsSpecs as DefaultLogsSpecs,
        LogsDest as LogsDest,
        LogsSpecs as LogsSpecs,
        PContext as PContext,
        ResourceUsage as ResourceUsage,
        RunProcsResult as RunProcsResult,
        SignalException as SignalException,
        Std as Std,
        SubprocessContext as SubprocessContext,
        start_processes as start_processes,
        to_map as to_map,
    )
    from torchmp.errors import ProcessFailure as ProcessFailure
    from torchmp.numa import NumaOptions as NumaOptions
