"""The ``exec`` strategy: the I/O thread forks and execs every rank of a
group (csrc/spawn.c), in one round trip.  Binaries start this way, and so do
``spawn`` function workers (a fresh interpreter reading its function from a
payload file); so does the forkserver itself."""

from __future__ import annotations

import errno
import logging
import os
import pickle
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torchmp import _core
from torchmp._launch import Launch, worker
from torchmp._inputs import FS_ENCODING, FS_ERRORS, getenvb
from torchmp._launch.env import exec_env, launcher_environ
from torchmp._launch.payload import payload_file
from torchmp._launch.streams import NO_STREAM, RETURN_CHANNEL, RankStreams
from torchmp._signals import is_interrupt

# torch's contexts log as its api module; so do torchmp's.
logger = logging.getLogger("torchmp.api")


def _exec_search_path(env: Mapping[str, Any]) -> bytes:
    path = env.get("PATH")
    if path is None:
        inherited = getenvb(b"PATH")
        return os.defpath.encode() if inherited is None else inherited
    return os.fsencode(str(path))


def resolve_executable(entrypoint: str, env: Mapping[str, Any] | None = None) -> bytes:
    """Find ``entrypoint`` the way a shell's execvp would, without a shell.

    A name with a slash is used as given; otherwise each ``PATH`` entry (the
    worker's ``PATH`` if ``env`` sets one) is tried in order.  Raises
    ``FileNotFoundError`` if nothing matches and ``PermissionError`` if the
    only matches cannot be executed (a directory, or no execute permission).
    """
    name = entrypoint.encode(FS_ENCODING, FS_ERRORS)  # os.fsencode, without its call
    if not name:
        raise FileNotFoundError(errno.ENOENT, "empty command", entrypoint)
    if b"\0" in name:
        raise ValueError(f"entrypoint contains a NUL byte: {entrypoint!r}")
    # A name with a slash is the only candidate: an empty search path.
    search_path = b"" if b"/" in name else _exec_search_path(env or {})
    found, denied = _core.find_in_path(name, search_path)
    if found is not None:
        return found
    if denied is not None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(denied))
    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), entrypoint)


@dataclass
class ExecPlan:
    """One rank of an exec launch, ready for the native core (but its fds)."""

    path: bytes
    argv: list[bytes]
    envp: list[bytes]
    return_channel: bool = False  # a pipe for the pickled return value
    payload_fd: int = -1
    binding: _core.Binding | None = None  # where the worker runs (None: where the launcher may)


def spawn_ranks(group: _core.Group, streams: Sequence[RankStreams], plans: Sequence[ExecPlan],
                abort: Callable[[], None], name: str) -> None:
    """Exec every rank from the I/O thread.  If rank k cannot be started,
    ranks < k are torn down (``abort``) and its OSError is raised."""
    specs = [
        _core.RankSpec(plan.path, plan.argv, plan.envp, out, err,
                       RETURN_CHANNEL if plan.return_channel else NO_STREAM, plan.payload_fd, plan.binding)
        for plan, (out, err) in zip(plans, streams, strict=True)
    ]
    try:
        group.spawn(specs)
    except _core.SpawnError as e:
        logger.error("failed to start local rank %s of %s: %s", e.rank, name, e)
        abort()
        raise e.cause from None


class BinaryLaunch(Launch):
    """Every rank execs ``program`` (already found on each rank's PATH) with
    its args, in the launcher's environment with its envs on top."""

    method = "exec"

    def __init__(self, name: str, program: str, paths: Mapping[int, bytes],
                 args: Mapping[int, tuple[Any, ...]], envs: Mapping[int, Mapping[str, Any]]) -> None:
        self.name = name
        self.program = program
        self.paths = paths
        self.args = args
        self.envs = envs

    def launch(self, group: _core.Group, streams: Sequence[RankStreams], bindings: Mapping[int, _core.Binding],
               abort: Callable[[], None]) -> None:
        environ = launcher_environ()
        program = self.program.encode(FS_ENCODING, FS_ERRORS)
        plans = []
        for rank in range(len(streams)):
            argv = [program] + [a if isinstance(a, bytes) else os.fsencode(str(a)) for a in self.args[rank]]
            plans.append(ExecPlan(self.paths[rank], argv, exec_env(rank, self.envs[rank], environ),
                                  binding=bindings.get(rank)))
        spawn_ranks(group, streams, plans, abort, self.name)


def alias_main_for_workers() -> None:
    """Workers that re-import the main module do so as ``__mp_main__``, so
    objects of its classes come back pickled under that name: the launcher
    gets the same alias (multiprocessing sets it up too)."""
    if "__main__" in sys.modules:
        sys.modules.setdefault("__mp_main__", sys.modules["__main__"])


def check_picklable(method: str, fn: Callable[..., Any], args: Mapping[int, tuple[Any, ...]]) -> None:
    """A clear error, before anything starts, for what ``spawn`` and
    ``forkserver`` cannot send to a worker."""
    # A handled signal's SignalException is an Exception too (as torch's
    # is): it stops the launch as itself, not as an unpicklable payload.
    try:
        pickle.dumps(fn, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        if is_interrupt(e):
            raise
        name = getattr(fn, "__qualname__", repr(fn))
        raise ValueError(
            f"entrypoint {name} cannot be pickled for start_method={method!r} ({e}); "
            "define it at module level (not a lambda or a local function), or use start_method='fork'"
        ) from None
    for rank, rank_args in args.items():
        try:
            pickle.dumps(rank_args, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            if is_interrupt(e):
                raise
            raise ValueError(f"args[{rank}] cannot be pickled for start_method={method!r}: {e}") from None


class FunctionLaunch(Launch):
    """A start method whose ranks each run ``fn(*args[rank])`` with
    ``envs[rank]`` on top of the launcher's environment."""

    #: Whether ``fn`` and the args reach the ranks pickled (checked here,
    #: before anything starts: spawn and forkserver; a fork inherits them).
    pickled = True

    def __init__(self, name: str, fn: Callable[..., Any], args: Mapping[int, tuple[Any, ...]],
                 envs: Mapping[int, Mapping[str, Any]]) -> None:
        if self.pickled:
            check_picklable(self.method, fn, args)
        self.name = name
        self.fn = fn
        self.args = args
        self.envs = envs


class SpawnLaunch(FunctionLaunch):
    """``spawn``: every rank is a fresh interpreter (exec'd like a binary)
    that reads its pickled function and args from a payload file and sends
    its return value down its return channel (see ``worker``)."""

    method = "spawn"

    def launch(self, group: _core.Group, streams: Sequence[RankStreams], bindings: Mapping[int, _core.Binding],
               abort: Callable[[], None]) -> None:
        alias_main_for_workers()
        prep = worker.preparation_data()
        argv = worker.interpreter_argv("torchmp._launch.worker", "spawn_main")
        path = os.fsencode(sys.executable)
        payload_fds: list[int] = []
        environ = launcher_environ()
        try:
            plans = []
            for rank in range(len(streams)):
                fd = payload_file(worker.encode_payload(prep, self.fn, self.args[rank]))
                payload_fds.append(fd)
                plans.append(ExecPlan(path, argv, exec_env(rank, self.envs[rank], environ), return_channel=True,
                                      payload_fd=fd, binding=bindings.get(rank)))
            spawn_ranks(group, streams, plans, abort, self.name)
        finally:
            for fd in payload_fds:
                os.close(fd)
