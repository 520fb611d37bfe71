"""Input checks shared by every launch path: all of them run before any
directory is created or any process started."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from torchmp.logs_specs import RankMappingError, validate_full_rank

# The start methods of function launches (binaries: fork+exec by the core).
START_METHODS = ("spawn", "fork", "forkserver")


def _check_name(name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    return name


def _encode_env_item(rank: int, key: object, value: object) -> tuple[bytes, bytes]:
    if isinstance(key, str):
        kb = os.fsencode(key)
    elif isinstance(key, bytes):
        kb = key
    else:
        raise ValueError(f"envs[{rank}]: environment variable names must be str, got {key!r}")
    if not kb or b"=" in kb or b"\0" in kb:
        raise ValueError(
            f"envs[{rank}]: invalid environment variable name {key!r} "
            "(it must be non-empty and contain neither '=' nor NUL)"
        )
    if isinstance(value, bytes):
        vb = value
    else:
        try:
            text = value if isinstance(value, str) else str(value)
        except Exception as e:
            raise ValueError(f"envs[{rank}][{key!r}]: value cannot be converted to str: {e}") from e
        vb = os.fsencode(text)
    if b"\0" in vb:
        raise ValueError(f"envs[{rank}][{key!r}]: value contains a NUL byte")
    return kb, vb


def _normalize_args(args: object, what: str = "args") -> dict[int, tuple[Any, ...]]:
    if not isinstance(args, Mapping):
        raise RankMappingError(f"{what} must be a dict keyed by local rank, got {type(args).__name__}")
    validate_full_rank(args, len(args), what)
    out: dict[int, tuple[Any, ...]] = {}
    for rank in range(len(args)):
        value = args[rank]
        if isinstance(value, (str, bytes)):
            value = (value,)  # one argument, not a sequence of characters
        elif value is None:
            value = ()
        else:
            try:
                value = tuple(value)
            except TypeError:
                raise ValueError(f"{what}[{rank}] must be a tuple of arguments, got {value!r}") from None
        out[rank] = value
    return out


def _normalize_envs(envs: object, nprocs: int) -> dict[int, dict[str, str]]:
    if envs is None:
        return {rank: {} for rank in range(nprocs)}
    if not isinstance(envs, Mapping):
        raise RankMappingError(f"envs must be a dict keyed by local rank, got {type(envs).__name__}")
    validate_full_rank(envs, nprocs, "envs")
    for rank in range(nprocs):
        env = envs[rank]
        if not isinstance(env, Mapping):
            raise ValueError(f"envs[{rank}] must be a dict of environment variables, got {type(env).__name__}")
        for key, value in env.items():
            _encode_env_item(rank, key, value)
    return envs  # type: ignore[return-value]  # validated; reify mutates it like torch


def _check_prefixes(prefixes: object, nprocs: int) -> dict[int, str] | None:
    if prefixes is None:
        return None
    if not isinstance(prefixes, Mapping):
        raise TypeError(f"log_line_prefixes must be a dict of rank -> str, got {type(prefixes).__name__}")
    for rank, prefix in prefixes.items():
        if not isinstance(rank, int) or not 0 <= rank < nprocs:
            raise ValueError(f"log_line_prefixes: {rank!r} is not a local rank in 0..{nprocs - 1}")
        if not isinstance(prefix, str):
            raise TypeError(f"log_line_prefixes[{rank}] must be a str, got {type(prefix).__name__}")
    return dict(prefixes)


def _check_filters(filters: object, what: str) -> list[str] | None:
    if filters is None:
        return None
    if isinstance(filters, str) or not all(isinstance(f, str) for f in filters):  # type: ignore[attr-defined]
        raise TypeError(f"{what} must be a list of str, got {filters!r}")
    return list(filters)  # type: ignore[call-overload, no-any-return]


# A failed rank's report carries the last lines of its stderr: this many by
# default, and at most TAIL_BYTES_PER_LINE bytes per line kept in memory.
DEFAULT_STDERR_TAIL_LINES = 20
TAIL_BYTES_PER_LINE = 400


def stderr_tail_bound(value: object = None) -> int:
    """The number of stderr lines a failure report keeps: ``value``, else
    ``$TORCHMP_STDERR_TAIL``, else 20.  Raises ValueError for anything but a
    non-negative int (checked before anything starts)."""
    source = "stderr_tail"
    if value is None:
        env = os.environ.get("TORCHMP_STDERR_TAIL")
        if env is None or env.strip() == "":
            return DEFAULT_STDERR_TAIL_LINES
        source, value = "TORCHMP_STDERR_TAIL", env.strip()
        try:
            value = int(value)
        except ValueError:
            raise ValueError(f"{source} must be a number of lines, got {env!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{source} must be a non-negative number of lines, got {value!r}")
    return value


def _watch_stderr_setting(value: object) -> bool:
    """watch_stderr=, else $TORCHMP_WATCH_STDERR (1/0, true/false, yes/no):
    how a launcher that cannot pass keywords (the torchrun plug-in) opts in."""
    if value is not None:
        return bool(value)
    env = os.environ.get("TORCHMP_WATCH_STDERR", "").strip().lower()
    if env in ("", "0", "false", "no", "off"):
        return False
    if env in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"TORCHMP_WATCH_STDERR must be 1 or 0 (true/false, yes/no), got {env!r}")
