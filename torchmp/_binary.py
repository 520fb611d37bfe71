"""``SubprocessContext``: ranks that run a binary, exec'd by the core."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchmp._launch.exec import BinaryLaunch, resolve_executable
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

    def _launch_for(self, name: str, entrypoint: Any, args: dict[int, tuple[Any, ...]],
                    envs: dict[int, dict[str, str]]) -> BinaryLaunch:
        if not isinstance(entrypoint, str):
            raise TypeError(f"SubprocessContext needs a str entrypoint, got {type(entrypoint).__name__}")
        # Resolve now, so a missing binary fails before any directory exists;
        # once per distinct PATH, not once per rank.
        resolved: dict[str | None, bytes] = {}
        paths: dict[int, bytes] = {}
        for rank in range(len(args)):
            path_var = envs[rank].get("PATH")
            key = None if path_var is None else str(path_var)
            if key not in resolved:
                resolved[key] = resolve_executable(entrypoint, envs[rank])
            paths[rank] = resolved[key]
        for rank, argv in args.items():
            for a in argv:
                has_nul = b"\0" in a if isinstance(a, bytes) else "\0" in str(a)
                if has_nul:
                    raise ValueError(f"args[{rank}]: argument {a!r} contains a NUL byte")
        return BinaryLaunch(name, entrypoint, paths, args, envs)
