"""Input checks shared by every launch path: all of them run before any
directory is created or any process started."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any, TypeGuard


class RankMappingError(ValueError, RuntimeError):
    """A per-rank mapping (``args``, ``envs``, ...) is not keyed by exactly ``0..n-1``.

    It derives from both ``ValueError`` and ``RuntimeError`` so that code written
    against either of torch's error types keeps catching it.

    >>> issubclass(RankMappingError, ValueError), issubclass(RankMappingError, RuntimeError)
    (True, True)
    """

    # Documented, and re-exported, as torchmp.logs_specs.RankMappingError (as
    # torch users know it from its logs_specs/api pair): tracebacks say so.
    __module__ = "torchmp.logs_specs"


def is_int(value: object) -> TypeGuard[int]:
    """An int that is not a bool (True is not rank 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def as_rank(key: object, what: str) -> int:
    if not is_int(key):
        raise TypeError(
            f"{what}: local rank keys must be ints, got {type(key).__name__} {key!r}"
        )
    return _nonnegative_rank(key, what)


def _nonnegative_rank(key: int, what: str) -> int:
    if key < 0:
        raise ValueError(f"{what}: local rank keys must be >= 0, got {key!r}")
    return int(key)


_ENVIRON_TYPE = type(os.environ)
_ENVIRONB_TYPE = type(os.environb)  # (the same class, as the type checker sees it for bytes)


def getenv(name: str) -> str | None:
    """``os.environ.get(name)`` at the cost of a dict lookup.  A launch reads
    about eight settings, most of them unset, and a missing name costs
    ``os.environ.get`` a KeyError raised and caught (about 1.3 us each)."""
    environ = os.environ
    if type(environ) is not _ENVIRON_TYPE:  # replaced by a test or a framework
        return environ.get(name)
    raw = environ._data.get(name.encode("utf-8", "surrogateescape"))  # type: ignore[attr-defined]
    return None if raw is None else os.fsdecode(raw)


def getenvb(name: bytes) -> bytes | None:
    """``os.environb.get(name)`` at the cost of a dict lookup (see getenv)."""
    environb = os.environb
    if type(environb) is not _ENVIRONB_TYPE:  # replaced by a test or a framework
        return environb.get(name)
    return environb._data.get(name)  # type: ignore[attr-defined, no-any-return]


def _sort_keys(keys: Iterable[Any]) -> list[Any]:
    # Ints (not bools) first in numeric order, then everything else by repr.
    return sorted(
        keys,
        key=lambda k: (0, k, "") if is_int(k) else (1, 0, f"{type(k).__name__}{k!r}"),
    )


_ONLY_INT = {int}  # (bool keys fail this too: True is not rank 1)


def validate_full_rank(d: Mapping[int, Any], nprocs: int, what: str) -> None:
    """Check that ``d`` is a mapping keyed by exactly the local ranks ``0..nprocs-1``.

    Raises :class:`RankMappingError` (a ``ValueError`` and a ``RuntimeError``)
    naming the missing ranks and the unexpected keys.

    >>> validate_full_rank({0: "a", 1: "b"}, 2, "args")
    >>> validate_full_rank({0: {}, "a": {}}, 2, "envs")
    Traceback (most recent call last):
      ...
    torchmp.logs_specs.RankMappingError: envs: missing local ranks [1]; unexpected keys ['a'] (expected keys 0..1 for nprocs=2)
    """  # noqa: E501 (a doctest: the error message in full)
    if type(d) is dict and type(nprocs) is int and len(d) == nprocs and (
            nprocs == 0 or (set(map(type, d)) == _ONLY_INT and min(d) >= 0 and max(d) < nprocs)):
        # The common case, checked several times on every launch (without a
        # generator: n distinct ints in 0..n-1 are exactly the ranks).
        return
    if not is_int(nprocs):
        raise TypeError(f"nprocs must be an int, got {type(nprocs).__name__} {nprocs!r}")
    if nprocs < 0:
        raise ValueError(f"nprocs must be >= 0, got {nprocs}")
    expected = "no keys for nprocs=0" if nprocs == 0 else (
        f"keys 0..{nprocs - 1} for nprocs={nprocs}"
    )
    if not isinstance(d, Mapping):
        raise RankMappingError(
            f"{what}: expected a dict keyed by local rank ({expected}), got "
            f"{type(d).__name__}"
        )
    present = {k for k in d if is_int(k) and 0 <= k < nprocs}
    missing = [r for r in range(nprocs) if r not in present]
    unexpected = _sort_keys(k for k in d if not (is_int(k) and 0 <= k < nprocs))
    if not missing and not unexpected:
        return
    parts = []
    if missing:
        parts.append(f"missing local ranks {missing}")
    if unexpected:
        parts.append(f"unexpected keys {unexpected}")
    raise RankMappingError(f"{what}: {'; '.join(parts)} (expected {expected})")


def check_envs(envs: Mapping[int, Any]) -> int:
    """Validate a reify() ``envs`` argument; return the number of local ranks."""
    # (type(x) is dict first: an ABC's isinstance costs several times more,
    # and these run on every launch.)
    if type(envs) is not dict and not isinstance(envs, Mapping):
        raise RankMappingError(
            f"envs: expected a dict keyed by local rank, got {type(envs).__name__}"
        )
    nprocs = len(envs)
    validate_full_rank(envs, nprocs, "envs")
    for rank in range(nprocs):
        if type(envs[rank]) is not dict and not isinstance(envs[rank], MutableMapping):
            raise RankMappingError(
                f"envs[{rank}]: expected a dict of environment variables, got "
                f"{type(envs[rank]).__name__}"
            )
    return nprocs


def as_log_dir(log_dir: object, what: str = "log_dir") -> str:
    path: str | bytes | None = None
    if isinstance(log_dir, (str, bytes, os.PathLike)):
        try:
            path = os.fspath(log_dir)
        except TypeError:  # a __fspath__ that returns neither str nor bytes
            pass
    if path is None:
        raise TypeError(
            f"{what} must be a str or os.PathLike path, got "
            f"{type(log_dir).__name__} {log_dir!r}"
        ) from None
    if not isinstance(path, str):
        raise TypeError(f"{what} must be a str path, got {type(path).__name__} {path!r}")
    return path


def as_ranks_filter(value: object) -> set[int] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(
            "local_ranks_filter must be a set (or other iterable) of ints, got "
            f"{type(value).__name__} {value!r}"
        )
    return {as_rank(r, "local_ranks_filter") for r in value}


# The start methods of function launches (binaries: fork+exec by the core).
START_METHODS = ("spawn", "fork", "forkserver")


def check_name(name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    return name


# What os.fsencode uses, read once: ``text.encode(FS_ENCODING, FS_ERRORS)``
# is os.fsencode(text) for a str, without its Python-level call (these run
# for every variable and argument of every rank, several times a launch).
FS_ENCODING = sys.getfilesystemencoding()
FS_ERRORS = sys.getfilesystemencodeerrors()


def encode_env_item(rank: int, key: object, value: object) -> tuple[bytes, bytes]:
    if type(key) is str and type(value) is str:
        # The usual item, encoded as os.fsencode does, without its calls;
        # anything wrong with it is named by the checks below.
        kb = key.encode(FS_ENCODING, FS_ERRORS)
        vb = value.encode(FS_ENCODING, FS_ERRORS)
        if kb and b"=" not in kb and b"\0" not in kb and b"\0" not in vb:
            return kb, vb
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


def normalize_args(args: object, what: str = "args") -> dict[int, tuple[Any, ...]]:
    if type(args) is not dict and not isinstance(args, Mapping):
        raise RankMappingError(f"{what} must be a dict keyed by local rank, got {type(args).__name__}")
    validate_full_rank(args, len(args), what)
    out: dict[int, tuple[Any, ...]] = {}
    for rank in range(len(args)):
        value = args[rank]
        if type(value) is tuple:
            pass
        elif isinstance(value, (str, bytes)):
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


def normalize_envs(envs: object, nprocs: int) -> dict[int, dict[str, str]]:
    if envs is None:
        return {rank: {} for rank in range(nprocs)}
    if type(envs) is not dict and not isinstance(envs, Mapping):
        raise RankMappingError(f"envs must be a dict keyed by local rank, got {type(envs).__name__}")
    validate_full_rank(envs, nprocs, "envs")
    for rank in range(nprocs):
        env = envs[rank]
        if type(env) is not dict and not isinstance(env, Mapping):
            raise ValueError(f"envs[{rank}] must be a dict of environment variables, got {type(env).__name__}")
        for key, value in env.items():
            encode_env_item(rank, key, value)
    # Validated above; the caller's dict itself (reify mutates it, as torch does).
    return envs  # type: ignore[return-value]


def check_prefixes(prefixes: object, nprocs: int) -> dict[int, str] | None:
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


def check_filters(filters: object, what: str) -> list[str] | None:
    if filters is None:
        return None
    items = None if isinstance(filters, str) or not isinstance(filters, Iterable) else list(filters)
    if items is None or not all(isinstance(f, str) for f in items):
        raise TypeError(f"{what} must be a list of str, got {filters!r}")
    return items


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
        env = getenv("TORCHMP_STDERR_TAIL")
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


def watch_stderr_setting(value: object) -> bool:
    """watch_stderr=, else $TORCHMP_WATCH_STDERR (1/0, true/false, yes/no):
    how a launcher that cannot pass keywords (the torchrun plug-in) opts in."""
    if value is not None:
        return bool(value)
    env = (getenv("TORCHMP_WATCH_STDERR") or "").strip().lower()
    if env in ("", "0", "false", "no", "off"):
        return False
    if env in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"TORCHMP_WATCH_STDERR must be 1 or 0 (true/false, yes/no), got {env!r}")
