"""What an exec needs, prepared in the parent before any fork: the
resolved path, the log files opened, the environment as envp, and exit
statuses read back.  A rank's environment is built here for every start
method (envp for an exec, a dict for a forkserver worker, os.environ for a
forked one), all with _inputs._encode_env_item's encoding."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torchmp import _core
from torchmp._inputs import _encode_env_item

_LOG_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)


def _exec_search_path(env: Mapping[str, Any]) -> list[bytes]:
    path = env.get("PATH")
    if path is None:
        path_b = os.environb.get(b"PATH", os.defpath.encode())
    else:
        path_b = os.fsencode(str(path))
    return path_b.split(b":")


def resolve_executable(entrypoint: str, env: Mapping[str, Any] | None = None) -> bytes:
    """Find ``entrypoint`` the way a shell's execvp would, without a shell.

    A name with a slash is used as given; otherwise each ``PATH`` entry (the
    worker's ``PATH`` if ``env`` sets one) is tried in order.  Raises
    ``FileNotFoundError`` if nothing matches and ``PermissionError`` if the
    only matches cannot be executed.
    """
    name = os.fsencode(entrypoint)
    if not name:
        raise FileNotFoundError(errno.ENOENT, "empty command", entrypoint)
    if b"\0" in name:
        raise ValueError(f"entrypoint contains a NUL byte: {entrypoint!r}")
    if b"/" in name:
        candidates = [name]
    else:
        candidates = [os.path.join(d or b".", name) for d in _exec_search_path(env or {})]
    denied: bytes | None = None
    for candidate in candidates:
        try:
            st = os.stat(candidate)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) or not os.access(candidate, os.X_OK):
            denied = denied or candidate
            continue
        return candidate
    if denied is not None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(denied))
    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), entrypoint)


def _open_log(path: str) -> int:
    """Open a log file for a worker: truncate, never through a symlink
    planted in the log directory, never block on a FIFO planted there, mode
    from the umask.  Character devices (/dev/null) are fine."""
    try:
        fd = os.open(path, _LOG_FLAGS | os.O_NONBLOCK, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OSError(e.errno, f"refusing to follow a symlink for a log file: {path}", path) from None
        if e.errno == errno.ENXIO:
            raise OSError(e.errno, f"refusing a FIFO as a log file: {path}", path) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISCHR(mode)):
            raise OSError(errno.EINVAL, f"a log file must be a regular file or a device: {path}", path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _exitcode(wait_status: int) -> int:
    if os.WIFSIGNALED(wait_status):
        return -os.WTERMSIG(wait_status)
    if os.WIFEXITED(wait_status):
        return os.WEXITSTATUS(wait_status)
    return 255


# Stream specs without a file: the worker inherits the launcher's stream, or
# (the return channel) the I/O thread keeps what the worker writes.
_NO_STREAM = _core.StreamSpec(_core.STREAM_INHERIT, -1, -1, None)
_RETURN_CHANNEL = _core.StreamSpec(_core.STREAM_CAPTURE, -1, -1, None)

#: A rank's (stdout, stderr) as the native core is to wire them.
RankStreams = tuple[_core.StreamSpec, _core.StreamSpec]


@dataclass
class _ExecPlan:
    """One rank of an exec launch, ready for the native core (but its fds)."""

    path: bytes
    argv: list[bytes]
    envp: list[bytes]
    return_channel: bool = False  # a pipe for the pickled return value
    payload_fd: int = -1


def _launcher_environ() -> dict[bytes, bytes]:
    """The launcher's environment as ready envp entries (b"K=V"), by name."""
    data = getattr(os.environb, "_data", None)
    # os.environb's own dict, read at C speed; iterating the mapping costs a
    # Python-level call per variable.
    items = data.items() if isinstance(data, dict) else os.environb.items()
    return {k: k + b"=" + v for k, v in items}


def rank_environb(rank: int, overrides: Mapping[Any, Any]) -> dict[bytes, bytes]:
    """The launcher's environment with envs[rank] on top, name -> value (what
    a forkserver worker sets as its os.environb)."""
    env = dict(os.environb)
    for key, value in overrides.items():
        kb, vb = _encode_env_item(rank, key, value)
        env[kb] = vb
    return env


def apply_rank_env(rank: int, overrides: Mapping[Any, Any]) -> None:
    """Put envs[rank] into this process's environment (a forked worker, whose
    environment is the launcher's already)."""
    for key, value in overrides.items():
        kb, vb = _encode_env_item(rank, key, value)
        os.environb[kb] = vb


def _exec_env(rank: int, overrides: Mapping[Any, Any], base: dict[bytes, bytes] | None = None) -> list[bytes]:
    """The launcher's environment (or base, a _launcher_environ() snapshot
    taken once per launch) with envs[rank] on top, as envp entries."""
    entries = _launcher_environ() if base is None else dict(base)
    for key, value in overrides.items():
        kb, vb = _encode_env_item(rank, key, value)
        entries[kb] = kb + b"=" + vb
    return list(entries.values())
