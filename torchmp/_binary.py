"""``SubprocessContext``: ranks that run a binary, fork+exec'd by the core."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from torchmp import _core
from torchmp._launch.exec import RankStreams, _exec_env, _ExecPlan, _launcher_environ, resolve_executable
from torchmp._native import _NativeContext
from torchmp.logs_specs import LogsSpecs


class SubprocessContext(_NativeContext):
    """``PContext`` holding worker processes invoked as a binary."""

    def __init__(
        self,
        name: str,
        entrypoint: str,
        args: dict[int, tuple[Any, ...]],
        envs: dict[int, dict[str, str]],
        logs_specs: LogsSpecs,
        log_line_prefixes: dict[int, str] | None = None,
        numa_options: Any = None,
        duplicate_stdout_filters: list[str] | None = None,
        duplicate_stderr_filters: list[str] | None = None,
        *,
        cpu_affinity: Mapping[int, Any] | None = None,
        mem_bind: str | None = None,
    ) -> None:
        super().__init__(
            name, entrypoint, args, envs, logs_specs, log_line_prefixes, numa_options,
            duplicate_stdout_filters, duplicate_stderr_filters, cpu_affinity=cpu_affinity, mem_bind=mem_bind,
        )

    def _check_entrypoint(self, entrypoint: Any, args: dict[int, tuple[Any, ...]],
                          envs: dict[int, dict[str, str]]) -> None:
        if not isinstance(entrypoint, str):
            raise TypeError(f"SubprocessContext needs a str entrypoint, got {type(entrypoint).__name__}")
        # Resolve now, so a missing binary fails before any directory exists;
        # once per distinct PATH, not once per rank.
        self._program: str = entrypoint  # self.entrypoint, as its type
        resolved: dict[str | None, bytes] = {}
        self._paths: dict[int, bytes] = {}
        for rank in range(len(args)):
            path_var = envs[rank].get("PATH")
            key = None if path_var is None else str(path_var)
            if key not in resolved:
                resolved[key] = resolve_executable(entrypoint, envs[rank])
            self._paths[rank] = resolved[key]
        for rank, argv in args.items():
            for a in argv:
                has_nul = b"\0" in a if isinstance(a, bytes) else "\0" in str(a)
                if has_nul:
                    raise ValueError(f"args[{rank}]: argument {a!r} contains a NUL byte")

    def _launch(self, group: _core.Group, streams: list[RankStreams]) -> None:
        plans = []
        environ = _launcher_environ()
        for rank in range(self.nprocs):
            argv = [os.fsencode(self._program)]
            argv += [a if isinstance(a, bytes) else os.fsencode(str(a)) for a in self.args[rank]]
            plans.append(_ExecPlan(self._paths[rank], argv, _exec_env(rank, self.envs[rank], environ)))
        self._spawn(group, streams, plans)
