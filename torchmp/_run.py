"""``torchmp.run`` and ``run_async``: ``subprocess.run``'s contract for one
command, without its traps.

The command starts in a session (process group) of its own; its leader's
exit ends the wait even when a process it left behind holds the output pipes
(those are read for at most 0.1 s more); what is left in its group is
stopped (SIGTERM, a 1 s grace, SIGKILL); a timeout stops the whole group the
same way and raises ``subprocess.TimeoutExpired`` within timeout + grace;
``max_output`` bounds what is kept of each captured stream.  See
docs/agents.md for every difference from ``subprocess.run``.
"""

from __future__ import annotations

import codecs
import locale
import os
import signal
import subprocess
import sys
from collections.abc import Iterable, Mapping

from torchmp import _core
from torchmp._launch import command as _command
from torchmp._launch.command import GRACE_SECONDS as GRACE_SECONDS

# typing only for the type checker: torchmp.run's imports stay off it
# (tests/test_import_graph.py).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__all__ = ["CompletedProcess", "run", "run_async"]


class CompletedProcess(subprocess.CompletedProcess):  # type: ignore[type-arg]  # generic only in typeshed
    """What ``torchmp.run`` returns: a ``subprocess.CompletedProcess``
    (``args``, ``returncode``, ``stdout``, ``stderr``,
    ``check_returncode()``) plus what torchmp measured: ``pid``,
    ``wall_time``, ``user_time`` and ``system_time`` (seconds), ``max_rss``
    (bytes), and how many bytes of each captured stream ``max_output`` left
    out (``stdout_omitted``, ``stderr_omitted``; 0: all of it is there)."""

    def __init__(self, args: Any, returncode: int, stdout: Any = None, stderr: Any = None, *, pid: int = 0,
                 wall_time: float = 0.0, user_time: float = 0.0, system_time: float = 0.0, max_rss: int = 0,
                 stdout_omitted: int = 0, stderr_omitted: int = 0) -> None:
        super().__init__(args, returncode, stdout, stderr)
        self.pid = pid
        self.wall_time = wall_time
        self.user_time = user_time
        self.system_time = system_time
        self.max_rss = max_rss
        self.stdout_omitted = stdout_omitted
        self.stderr_omitted = stderr_omitted

    def __repr__(self) -> str:
        return (f"{super().__repr__()[:-1]}, pid={self.pid}, wall_time={self.wall_time:.6f}, "
                f"user_time={self.user_time:.6f}, system_time={self.system_time:.6f}, max_rss={self.max_rss})")


def omitted_marker(count: int) -> bytes:
    """What stands in a captured stream for the bytes max_output left out."""
    return b"\n[... %d bytes omitted ...]\n" % count


def _text_encoding() -> str:
    if sys.flags.utf8_mode:
        return "utf-8"
    getencoding = getattr(locale, "getencoding", None)  # 3.11+
    return getencoding() if getencoding is not None else locale.getpreferredencoding(False)


def _is_utf8(encoding: str) -> bool:
    try:
        return codecs.lookup(encoding).name in ("utf-8", "utf-8-sig")
    except LookupError:
        return False


class _Call:
    """One run()/run_async() call: its checked parameters and its plan."""

    def __init__(self, args: Any, stdin: Any, input: Any, stdout: Any, stderr: Any, capture_output: bool,
                 shell: bool, cwd: Any, timeout: Any, check: bool, encoding: str | None, errors: str | None,
                 text: bool | None, env: Mapping[Any, Any] | None, universal_newlines: bool | None,
                 executable: Any, pass_fds: Iterable[int], max_output: int | None,
                 popen_kwargs: Mapping[str, Any]) -> None:
        if popen_kwargs:
            _command.check_popen_kwargs(popen_kwargs)
        if capture_output:
            if stdout is not None or stderr is not None:
                raise ValueError("stdout and stderr arguments may not be used with capture_output.")
            stdout = stderr = subprocess.PIPE
        if text is not None and universal_newlines is not None and bool(universal_newlines) != bool(text):
            raise subprocess.SubprocessError("Cannot disambiguate when both text and universal_newlines are "
                                             "supplied but different. Pass one or the other.")
        self.text = bool(encoding or errors or text or universal_newlines)
        self.encoding = encoding or (_text_encoding() if self.text else None)
        self.errors = errors or "strict"
        self.timeout = _command.check_timeout(timeout)
        self.check = check
        self.args = args
        if input is not None:
            if self.text:
                if not isinstance(input, str):
                    raise TypeError(f"input must be str in text mode, not {type(input).__name__}")
                assert self.encoding is not None
                input = input.encode(self.encoding, self.errors)
            elif isinstance(input, str) or not isinstance(input, (bytes, bytearray, memoryview)):
                raise TypeError(f"input must be a bytes-like object, not {type(input).__name__} "
                                "(text=True takes a str)")
        self.capture = (stdout == subprocess.PIPE, stderr == subprocess.PIPE)
        self.plan = _command.plan(args, stdin=stdin, input=input, stdout=stdout, stderr=stderr, shell=shell,
                                  cwd=cwd, env=env, executable=executable, pass_fds=pass_fds,
                                  max_output=max_output)

    def start(self) -> _core.Command:
        try:
            _core.check_exit_statuses_collectable()
            return self.plan.start()
        finally:
            self.plan.close()

    def _stream(self, cmd: _core.Command, which: int, raw: bool) -> tuple[Any, int]:
        """A captured stream as the caller gets it, and how many bytes of it
        max_output left out."""
        if not self.capture[which]:
            return None, 0
        head, tail, total, lost = cmd.output(which)
        problem = _command.output_error(lost)
        if problem is not None:
            raise problem
        omitted = total - len(head) - len(tail)
        if raw or not self.text:
            data = head + omitted_marker(omitted) + tail if omitted else head + tail
            return (data if data or not raw else None), omitted
        assert self.encoding is not None
        if not omitted:
            text = (head + tail).decode(self.encoding, self.errors)
        else:
            # The cuts may split a character: the head's unfinished one and
            # the tail's stray continuation bytes count as left out.
            decoder = codecs.getincrementaldecoder(self.encoding)(self.errors)
            first = decoder.decode(head, final=False)
            omitted += len(decoder.getstate()[0])
            skip = 0
            if _is_utf8(self.encoding):
                while skip < min(3, len(tail)) and 0x80 <= tail[skip] < 0xC0:
                    skip += 1
            omitted += skip
            text = first + omitted_marker(omitted).decode("ascii") + tail[skip:].decode(self.encoding, self.errors)
        return text.replace("\r\n", "\n").replace("\r", "\n"), omitted

    def result(self, cmd: _core.Command, finished: bool) -> CompletedProcess:
        if not finished:
            # The stdlib's own exception, with the output so far as bytes
            # (as subprocess gives it).
            raise subprocess.TimeoutExpired(self.args, self.timeout or 0.0, self._stream(cmd, 0, True)[0],
                                            self._stream(cmd, 1, True)[0])
        info = cmd.info()
        stdout, out_omitted = self._stream(cmd, 0, False)
        stderr, err_omitted = self._stream(cmd, 1, False)
        code = os.waitstatus_to_exitcode(info.wait_status)
        if self.check and code:
            raise subprocess.CalledProcessError(code, self.args, stdout, stderr)
        return CompletedProcess(
            self.args, code, stdout, stderr, pid=info.pid,
            wall_time=max(0, info.exit_mono_ns - info.start_mono_ns) / 1e9, user_time=info.utime_ns / 1e9,
            system_time=info.stime_ns / 1e9, max_rss=info.maxrss_kb * 1024,
            stdout_omitted=out_omitted, stderr_omitted=err_omitted)


_backend: list[bool] = []


def _waits_here() -> bool:
    """Whether a command can be waited for in the calling thread (its pidfd:
    the epoll backend), decided once per process."""
    if not _backend:
        _backend.append(_core.backend_choice() == "epoll")
    return _backend[0]


def run(args: Any, *, stdin: Any = None, input: Any = None, stdout: Any = None, stderr: Any = None,
        capture_output: bool = False, shell: bool = False, cwd: Any = None, timeout: float | None = None,
        check: bool = False, encoding: str | None = None, errors: str | None = None, text: bool | None = None,
        env: Mapping[Any, Any] | None = None, universal_newlines: bool | None = None, executable: Any = None,
        pass_fds: Iterable[int] = (), max_output: int | None = None, **popen_kwargs: Any) -> CompletedProcess:
    """Run a command and return a :class:`CompletedProcess`, like
    ``subprocess.run`` with the same parameters and meaning.

    Raises ``subprocess.TimeoutExpired`` (the whole process group was
    stopped: SIGTERM, :data:`GRACE_SECONDS`, SIGKILL), ``CalledProcessError``
    with ``check=True``, ``FileNotFoundError`` / ``PermissionError`` when the
    command cannot be started, and ``ValueError`` / ``TypeError`` for bad
    input before anything starts.  ``max_output`` (bytes, per captured
    stream) keeps the first and the last ``max_output // 2`` bytes with a
    marker line between them.  ``preexec_fn``, ``start_new_session=False``,
    ``process_group`` other than 0, ``user``/``group``/``umask`` and
    ``close_fds=False`` are refused.

    >>> import torchmp
    >>> torchmp.run(["echo", "hello"], capture_output=True, text=True).stdout
    'hello\\n'
    """
    call = _Call(args, stdin, input, stdout, stderr, capture_output, shell, cwd, timeout, check, encoding, errors,
                 text, env, universal_newlines, executable, pass_fds, max_output, popen_kwargs)
    here = _waits_here()
    cmd: _core.Command | None = None
    waitable = here  # cmd.wait works: what stopping it with the grace takes
    notifier = None
    try:
        try:
            cmd = call.start()
            if not here:
                # No pidfd: only the I/O thread sees the exit; it wakes this
                # thread through a notifier of its own.
                notifier = _core.Notifier()
                cmd.watch(notifier, 0)
                waitable = True
            finished = cmd.wait(-1.0 if call.timeout is None else call.timeout, _core.UNTIL_EXITED)
            if cmd.busy():  # what is left of the group (usually nothing)
                _command.stop_blocking(cmd)
        except BaseException:
            # Interrupted (Ctrl-C, a handled signal) at any point once it
            # started: the command, in a session of its own, got nothing;
            # stop it the same way, then let the interrupt go on.  (Before
            # it could be waited for, close() below kills it.)
            if cmd is not None and waitable:
                _command.stop_blocking(cmd)
            raise
        if cmd.state & _core.CMD_EXITED:
            cmd.wait(-1.0, _core.UNTIL_DONE)  # the rest of the output: at most DRAIN_SECONDS
            cmd.reap()
        return call.result(cmd, finished)
    finally:
        if cmd is not None:
            cmd.close()  # anything not reaped by now: SIGKILL, reaped by the I/O thread
        if notifier is not None:
            notifier.close()


async def run_async(args: Any, *, stdin: Any = None, input: Any = None, stdout: Any = None, stderr: Any = None,
                    capture_output: bool = False, shell: bool = False, cwd: Any = None,
                    timeout: float | None = None, check: bool = False, encoding: str | None = None,
                    errors: str | None = None, text: bool | None = None, env: Mapping[Any, Any] | None = None,
                    universal_newlines: bool | None = None, executable: Any = None, pass_fds: Iterable[int] = (),
                    max_output: int | None = None, **popen_kwargs: Any) -> CompletedProcess:
    """:func:`run` for an event loop (asyncio's, uvloop, trio, anyio): the
    same parameters, result and errors.

    The command is started from the event loop's thread (the loop is blocked
    for as long as a fork+exec takes) and watched by torchmp's I/O thread,
    which wakes the loop through one descriptor for all commands in flight.
    Cancelling the task stops the command's whole process group (SIGTERM,
    the grace, SIGKILL) and reaps it before the cancellation goes on; under
    asyncio a second cancellation meanwhile sends SIGKILL at once (under
    trio the cleanup is shielded).
    """
    # Here, not at the top: importing asyncio costs a program that only
    # calls run() tens of milliseconds.
    from torchmp import _aio

    call = _Call(args, stdin, input, stdout, stderr, capture_output, shell, cwd, timeout, check, encoding, errors,
                 text, env, universal_newlines, executable, pass_fds, max_output, popen_kwargs)
    watch = _aio.acquire()
    try:
        started: _core.Command | None = None
        try:
            cmd = started = call.start()
            waiter = _aio.CommandWaiter(watch, cmd)
        except BaseException:
            # (An interrupt right after the start too: the command is killed
            # now, not when the traceback that holds it is dropped.)
            if started is not None:
                started.close()
            raise
        try:
            try:
                finished = await waiter.until(_core.CMD_EXITED, call.timeout)
                if cmd.busy():  # what is left of the group (usually nothing)
                    await _aio.drive_command(_command.stop_steps(cmd), waiter)
            except BaseException:
                # Cancelled (or interrupted): the whole group is stopped and
                # reaped before the cancellation goes on.
                with watch.shielded():
                    try:
                        await _aio.drive_command(_command.stop_steps(cmd), waiter)
                    except BaseException:
                        # Cancelled again: SIGKILL now; the I/O thread reaps it.
                        cmd.killpg(signal.SIGKILL)
                        raise
                raise
            finally:
                if cmd.state & _core.CMD_EXITED:
                    with watch.shielded():
                        await waiter.until(_core.CMD_DONE, None)  # at most DRAIN_SECONDS after the exit
                    cmd.reap()
            return call.result(cmd, finished)
        finally:
            waiter.close()
            cmd.close()
    finally:
        _aio.release(watch)
