"""The ``command`` strategy: one command for ``torchmp.run`` and
``run_async``, started by the calling thread through the core's one spawner
(csrc/spawn.c, as every worker is) -- no log directory, no error file, no
I/O-thread round trip.

:func:`plan` turns ``subprocess.run``'s parameters into a :class:`Plan` (every
check made before anything starts); :meth:`Plan.start` starts it.  From then
on the command is waited for in the calling thread (``Command.wait``: its
pidfd and pipes in one ``ppoll``, the GIL released) or, on an event loop and
where there is no pidfd, by the I/O thread (``Command.watch``).  What it
leaves behind is stopped by the one shutdown policy (:mod:`torchmp._shutdown`).
"""

from __future__ import annotations

import errno
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Generator, Iterable, Mapping

from torchmp import _core, _shutdown
from torchmp._launch.payload import payload_file

# typing only for the type checker: torchmp.run's imports stay off it
# (tests/test_import_graph.py).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

#: After SIGTERM, how long a command's process group gets to empty before
#: SIGKILL (a timeout, what a finished command left behind, a cancellation).
GRACE_SECONDS = 1.0
#: How long a command's output is still read after its leader exited: what a
#: process it left holding the pipes writes later is not waited for.
DRAIN_SECONDS = 0.1

# Popen parameters run() passes through but torchmp cannot honour, with the
# one value that means what torchmp does anyway.
_FIXED = {
    "preexec_fn": (None, "no Python code runs between fork and exec in torchmp (the child of a vfork must not)"),
    "close_fds": (True, "the command never inherits fds other than pass_fds"),
    "restore_signals": (True, "the command always starts with default signal dispositions"),
    "start_new_session": (True, "the command always runs in a session (and process group) of its own"),
    "process_group": (0, "the command always runs in a session (and process group) of its own"),
    "user": (None, "torchmp does not switch users"),
    "group": (None, "torchmp does not switch groups"),
    "extra_groups": (None, "torchmp does not switch groups"),
    "umask": (-1, "torchmp does not change the umask"),
    "pipesize": (-1, "torchmp sizes its pipes itself"),
    "startupinfo": (None, "a Windows parameter"),
    "creationflags": (0, "a Windows parameter"),
}
# No effect in run(): its pipes are read by torchmp, never through file objects.
_IGNORED = ("bufsize",)


def check_popen_kwargs(kwargs: Mapping[str, Any]) -> None:
    """Refuse the Popen parameters that cannot hold here, clearly."""
    for name, value in kwargs.items():
        if name in _IGNORED:
            continue
        if name not in _FIXED:
            raise TypeError(f"run() got an unexpected keyword argument {name!r}")
        fixed, why = _FIXED[name]
        if value is not fixed and value != fixed:
            raise ValueError(f"torchmp.run does not support {name}={value!r}: {why}")


def _fsencode_arg(value: object, what: str) -> bytes:
    if isinstance(value, bytes):
        data = value
    elif isinstance(value, (str, os.PathLike)):
        data = os.fsencode(value)
    else:
        raise TypeError(f"{what} must be str, bytes or os.PathLike, not {type(value).__name__}")
    if b"\0" in data:
        raise ValueError(f"{what} contains a NUL byte: {value!r}")
    return data


_FS_ENCODING = sys.getfilesystemencoding()
_FS_ERRORS = sys.getfilesystemencodeerrors()


def _argv(items: list[Any]) -> list[bytes]:
    """args as argv: str and bytes at C speed (os.fsencode's own encoding),
    the rest through _fsencode_arg's checks."""
    argv = []
    for i, a in enumerate(items):
        if type(a) is str:
            b = a.encode(_FS_ENCODING, _FS_ERRORS)
        elif type(a) is bytes:
            b = a
        else:
            b = _fsencode_arg(a, f"args[{i}]")
        if b"\0" in b:
            raise ValueError(f"args[{i}] contains a NUL byte: {a!r}")
        argv.append(b)
    return argv


def _fd_of(value: object, what: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what} must be None, PIPE, DEVNULL, an fd or a file object, not a bool")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{what}={value} is not an fd, PIPE or DEVNULL")
        return value
    fileno = getattr(value, "fileno", None)
    if fileno is None:
        raise TypeError(f"{what} must be None, PIPE, DEVNULL, an fd or a file object, not {type(value).__name__}")
    fd = fileno()
    if not isinstance(fd, int) or fd < 0:
        raise ValueError(f"{what}.fileno() returned {fd!r}")
    return int(fd)


def _envp(env: Mapping[Any, Any]) -> list[bytes]:
    entries = []
    for key, value in env.items():
        kb = _fsencode_arg(key, "an environment variable name")
        if not kb or b"=" in kb:
            raise ValueError(f"illegal environment variable name {key!r}")
        entries.append(kb + b"=" + _fsencode_arg(value, f"env[{key!r}]"))
    return entries


def _search_path(env: Mapping[Any, Any] | None) -> bytes:
    """PATH as os.get_exec_path(env) reads it."""
    if env is None:
        # os.environb's own dict: its get() is a Python-level call chain.
        data = getattr(os.environb, "_data", None)
        path = data.get(b"PATH") if isinstance(data, dict) else os.environb.get(b"PATH")
    else:
        text, raw = env.get("PATH"), env.get(b"PATH")
        if text is not None and raw is not None:
            raise ValueError("env cannot contain 'PATH' and b'PATH' keys")
        path = raw if raw is not None else (os.fsencode(text) if text is not None else None)
    return path if path is not None else os.defpath.encode()


def check_timeout(timeout: object) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds or None, not {type(timeout).__name__}")
    if math.isnan(timeout) or timeout < 0:
        raise ValueError(f"timeout must be >= 0, got {timeout!r}")
    return float(timeout)


class Plan:
    """One command, checked and wired, ready to start.  (A plain class, not
    a dataclass: importing dataclasses would cost ``import torchmp.run``
    more than the rest of it.)"""

    __slots__ = ("program", "argv", "envp", "search_path", "cwd", "stdin", "stdout", "stderr", "pass_fds",
                 "max_output", "filename", "cwd_name", "opened")

    def __init__(self, program: bytes, argv: list[bytes], envp: list[bytes] | None, search_path: bytes | None,
                 cwd: bytes | None, stdin: int, stdout: int, stderr: int, pass_fds: tuple[int, ...],
                 max_output: int, filename: Any, cwd_name: Any) -> None:
        self.program = program          # a path, or a name searched on search_path
        self.argv = argv
        self.envp = envp                # None: this process's environment
        self.search_path = search_path
        self.cwd = cwd
        self.stdin = stdin              # an fd, or _core.IO_INHERIT
        self.stdout = stdout            # an fd, IO_INHERIT or IO_PIPE
        self.stderr = stderr            # also IO_STDOUT
        self.pass_fds = pass_fds
        self.max_output = max_output    # -1: no bound
        self.filename = filename        # what an exec failure names
        self.cwd_name = cwd_name        # what a chdir failure names
        self.opened: list[int] = []     # ours, closed once started

    def start(self) -> _core.Command:
        return _core.start_command(
            self.program, self.argv, self.envp, self.search_path, self.cwd, self.stdin, self.stdout,
            self.stderr, self.pass_fds, self.max_output, DRAIN_SECONDS, self.filename, self.cwd_name)

    def close(self) -> None:
        while self.opened:
            os.close(self.opened.pop())


def plan(args: Any, *, stdin: Any = None, input: bytes | None = None, stdout: Any = None,
         stderr: Any = None, shell: bool = False, cwd: Any = None, env: Mapping[Any, Any] | None = None,
         executable: Any = None, pass_fds: Iterable[int] = (), max_output: int | None = None) -> Plan:
    """subprocess's parameters (capture_output already folded into stdout
    and stderr, input already encoded) as a Plan; every error is raised
    before anything is opened or started."""
    if isinstance(args, (str, bytes)):
        items: list[Any] = [args]
    elif isinstance(args, os.PathLike):
        if shell:
            raise TypeError("path-like args is not allowed when shell is true")
        items = [args]
    else:
        try:
            items = list(args)
        except TypeError:
            raise TypeError(f"args must be a str, bytes, os.PathLike or a sequence of them, "
                            f"not {type(args).__name__}") from None
    if not items or (len(items) == 1 and isinstance(items[0], (str, bytes)) and not items[0]):
        raise ValueError("args is empty: there is no command to run")
    argv = _argv(items)
    if shell:
        argv = [b"/bin/sh", b"-c"] + argv
    name: Any = items[0] if executable is None else executable
    if shell:
        name = "/bin/sh" if executable is None else executable
    program = argv[0] if executable is None and not shell else _fsencode_arg(name, "executable")
    if executable is not None and shell:
        argv[0] = program
    if max_output is not None and (isinstance(max_output, bool) or not isinstance(max_output, int)):
        raise TypeError(f"max_output must be an int or None, not {type(max_output).__name__}")
    if max_output is not None and max_output < 0:
        raise ValueError(f"max_output must be >= 0, got {max_output}")
    if stdout == subprocess.STDOUT:
        raise ValueError("stdout=STDOUT is not a target: STDOUT is for stderr only")
    if input is not None and stdin is not None:
        raise ValueError("stdin and input arguments may not both be used.")
    stdin_fd = _core.IO_INHERIT if stdin in (None, subprocess.PIPE, subprocess.DEVNULL) else _fd_of(stdin, "stdin")
    out_fd = _core.IO_INHERIT if stdout in (None, subprocess.PIPE, subprocess.DEVNULL) else _fd_of(stdout, "stdout")
    err_fd = (_core.IO_INHERIT if stderr in (None, subprocess.PIPE, subprocess.DEVNULL, subprocess.STDOUT)
              else _fd_of(stderr, "stderr"))
    keep: tuple[int, ...] = ()
    if pass_fds:
        try:
            keep = tuple(sorted({int(fd) for fd in pass_fds}))
        except (TypeError, ValueError):
            raise TypeError(f"pass_fds must be an iterable of fds, got {pass_fds!r}") from None
        if any(fd < 0 for fd in keep):
            raise ValueError(f"pass_fds holds a negative fd: {keep}")
    envp = None if env is None else _envp(env)
    search = None if b"/" in program else _search_path(env)
    cwd_b = None if cwd is None else _fsencode_arg(cwd, "cwd")

    made = Plan(program, argv, envp, search, cwd_b, stdin_fd, out_fd, err_fd, keep,
                -1 if max_output is None else max_output, name, cwd)
    try:
        if input is not None:
            # The input is the command's stdin as a file: written before it
            # starts, so a command that never reads it cannot block on it.
            made.stdin = payload_file(input)
            made.opened.append(made.stdin)
            os.lseek(made.stdin, 0, os.SEEK_SET)
        elif stdin == subprocess.PIPE:
            # Nothing to send (run() closes such a stdin at once): a pipe
            # already at its end.
            r, w = os.pipe2(os.O_CLOEXEC)
            os.close(w)
            made.opened.append(r)
            made.stdin = r
        elif stdin == subprocess.DEVNULL:
            made.stdin = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            made.opened.append(made.stdin)
        for which, value in (("stdout", stdout), ("stderr", stderr)):
            if value == subprocess.PIPE:
                setattr(made, which, _core.IO_PIPE)
            elif value == subprocess.DEVNULL:
                fd = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
                made.opened.append(fd)
                setattr(made, which, fd)
        if stderr == subprocess.STDOUT:
            made.stderr = _core.IO_STDOUT
    except BaseException:
        made.close()
        raise
    return made


# ---- stopping it -------------------------------------------------------------

class _Command:
    """One command as the shutdown policy sees it."""

    def __init__(self, cmd: _core.Command) -> None:
        self._cmd = cmd

    def version(self) -> int:
        return self._cmd.state & _core.CMD_EXITED

    def running(self) -> bool:
        return not self._cmd.state & _core.CMD_EXITED

    def busy(self) -> tuple[bool, ...]:
        return (True,) if self._cmd.busy() else ()

    def killpg(self, sig: int) -> None:
        self._cmd.killpg(sig)


def stop_steps(cmd: _core.Command, death_sig: int = signal.SIGTERM,
               grace: float = GRACE_SECONDS) -> Generator[_shutdown.Wait, None, bool]:
    """The shutdown policy over one command's process group."""
    return _shutdown.stop(_Command(cmd), death_sig, grace)


def wait_blocking(cmd: _core.Command, seconds: float, version: int) -> None:
    """One wait of the policy, in the calling thread: until the version
    moves or the seconds pass."""
    exited = cmd.state & _core.CMD_EXITED
    if exited != version:
        # The leader exited after the policy looked (a signal it just sent
        # is often that quick): look again now, not after the whole wait.
        return
    if exited:
        time.sleep(seconds)  # a group emptying has no event
    else:
        cmd.wait(seconds, _core.UNTIL_EXITED)


def stop_blocking(cmd: _core.Command, death_sig: int = signal.SIGTERM, grace: float = GRACE_SECONDS) -> None:
    """Stop what is left of the command's group; interrupted (a second
    Ctrl-C), it goes straight to SIGKILL."""
    try:
        _shutdown.run_blocking(stop_steps(cmd, death_sig, grace), lambda s, v: wait_blocking(cmd, s, v))
    except BaseException:
        cmd.killpg(signal.SIGKILL)
        raise


def output_error(lost_errno: int) -> Exception | None:
    """A capture that could not keep what it should have (no memory)."""
    if not lost_errno:
        return None
    if lost_errno == errno.ENOMEM:
        return MemoryError("the command's output did not fit in memory")
    return OSError(lost_errno, os.strerror(lost_errno))
