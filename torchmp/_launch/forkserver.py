"""The forkserver start method.

One server per launcher process, started on first use through the native
exec path (so it is in its own session, has PR_SET_PDEATHSIG, and is reaped
by the I/O thread).  It imports the launcher's ``__main__`` (as
``__mp_main__``, like multiprocessing) and the modules named with
:func:`set_forkserver_preload`, then forks one worker per request.

Protocol, over a Unix socket pair (the server's end is its fd 4):

* request: 4-byte length, a flags byte, then a pickle of ``(env, pickle of
  (fn, args), binding)`` (binding: ``(cpus, mems)`` or None),
  with the worker's stdout, stderr and return-channel fds attached
  (SCM_RIGHTS);
* reply: 8-byte pid (negative: -errno of a failed fork);
* release (flag ``_RELEASE``): the launcher is done signalling these workers'
  process groups; 8-byte pids, no reply.

The worker is the server's child, not the launcher's.  When it exits the
server reads its status without reaping it (``waitid(WNOWAIT)``), appends a
``tmpEXIT1`` trailer (wait status, user/sys CPU, max RSS) to the worker's
return channel, and keeps the zombie until the launcher releases it: the
zombie pins the pid and process group id the launcher may still signal.
If the server dies, its workers die with it (their parent-death signal) and
their channels end without a trailer: the launcher reports them as failed
with "the forkserver died".
"""

from __future__ import annotations

import errno
import os
import pickle
import select
import signal
import socket
import struct
import sys
import threading
import time
from typing import Any

from collections.abc import Callable, Mapping, Sequence

from torchmp import _core
from torchmp._launch import worker as _worker
from torchmp._launch.env import exec_env, rank_environb
from torchmp._launch.exec import FunctionLaunch, alias_main_for_workers
from torchmp._launch.streams import NO_STREAM, RETURN_CHANNEL, RankStreams

__all__ = ["ForkserverLaunch", "set_forkserver_preload", "get_forkserver"]

_REPLY = struct.Struct("<q")
_LENGTH = struct.Struct("<I")
_TRAILER = struct.Struct("<8sqqqq")
_TRAILER_MAGIC = _core.EXIT_TRAILER_MAGIC.encode("ascii")
_PID = struct.Struct("<q")
_RELEASE = 0x80  # flags bit of a release message

# A request not answered in this time means the server is wedged.
REPLY_TIMEOUT = 60.0

_preload: list[str] = []


def set_forkserver_preload(modules: list[str]) -> None:
    """Modules the forkserver imports once, so workers start with them
    loaded.  Takes effect when the server (re)starts."""
    if isinstance(modules, str) or not all(isinstance(m, str) for m in modules):
        raise TypeError("set_forkserver_preload() takes a list of module names")
    _preload[:] = list(modules)


class ForkServerDied(RuntimeError):
    """The forkserver is gone; workers it started are reported as failed."""


class ForkServer:
    def __init__(self) -> None:
        self._owner = os.getpid()
        # Re-entrant: a launch that fails closes its context, which releases
        # the workers the server started (release() takes the lock too).
        self._lock = threading.RLock()
        self._sock: socket.socket | None = None
        self._group: _core.Group | None = None

    # -- server process -----------------------------------------------------
    def _alive(self) -> bool:
        if self._group is None or self._sock is None:
            return False
        _, ranks = self._group.snapshot()
        if ranks[0].state != _core.PROC_RUNNING:
            return False
        # The I/O thread may not have seen a fresh death yet; the socket
        # knows at once (an idle server never writes: readable means EOF).
        try:
            readable, _, _ = select.select([self._sock], [], [], 0)
            return not readable or self._sock.recv(1, socket.MSG_PEEK) != b""
        except OSError:
            return False

    def _start(self) -> None:
        self._stop()
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            prep = _worker.preparation_data()
            setup = pickle.dumps((prep, list(_preload)), protocol=pickle.HIGHEST_PROTOCOL)
            argv = _worker.interpreter_argv("torchmp._launch.forkserver", "server_main")
            env = exec_env(0, {})  # the launcher's
            group = _core.Group(1)
            group.spawn([_core.RankSpec(os.fsencode(sys.executable), argv, env, NO_STREAM, NO_STREAM, NO_STREAM,
                                        child_sock.fileno())])
        except BaseException:
            parent_sock.close()
            raise
        finally:
            child_sock.close()
        self._group = group
        self._sock = parent_sock
        try:
            self._send_message(setup, [])
            self._recv_reply()  # the server answers 0 once its imports are done
        except BaseException:
            self._stop()
            raise

    def _stop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._group is not None:
            group, self._group = self._group, None
            try:
                group.killpg(signal.SIGKILL)
            except OSError:
                pass
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                version, ranks = group.snapshot()
                if ranks[0].state != _core.PROC_RUNNING:
                    break
                group.wait(deadline - time.monotonic(), version)
            group.finish_streams()
            group.release()

    def _send_message(self, data: bytes, fds: list[int]) -> None:
        assert self._sock is not None
        message = _LENGTH.pack(len(data)) + data
        try:
            sent = socket.send_fds(self._sock, [message], fds)
            if sent < len(message):
                self._sock.sendall(message[sent:])
        except OSError as e:  # EPIPE, ECONNRESET: the server is gone
            raise ForkServerDied(f"the torchmp forkserver is gone ({e})") from None

    def _recv_reply(self) -> int:
        assert self._sock is not None
        buf = b""
        deadline = time.monotonic() + REPLY_TIMEOUT
        while len(buf) < _REPLY.size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ForkServerDied(f"the torchmp forkserver did not answer within {REPLY_TIMEOUT:.0f}s")
            ready, _, _ = select.select([self._sock], [], [], remaining)
            if not ready:
                continue
            try:
                chunk = self._sock.recv(_REPLY.size - len(buf))
            except OSError as e:
                raise ForkServerDied(f"the torchmp forkserver is gone ({e})") from None
            if not chunk:
                raise ForkServerDied("the torchmp forkserver died")
            buf += chunk
        pid: int = _REPLY.unpack(buf)[0]
        return pid

    def release(self, pids: list[int]) -> None:
        """Let the server reap these workers' zombies (see the module doc)."""
        with self._lock:
            if self._sock is None or not pids:
                return
            body = b"".join(_PID.pack(pid) for pid in pids)
            try:
                self._send_message(bytes([_RELEASE]) + body, [])
            except ForkServerDied:
                pass  # gone: its zombies went with it

    # -- launching ----------------------------------------------------------
    def launch(self, group: _core.Group, streams: Sequence[RankStreams], fn: Callable[..., Any],
               args: Mapping[int, tuple[Any, ...]], envs: Mapping[int, Mapping[str, Any]],
               bindings: Mapping[int, _core.Binding], abort: Callable[[], None]) -> None:
        with self._lock:
            if not self._alive():
                self._start()
            # Every rank's streams in one I/O-thread round trip.
            worker_fds = group.prepare([(out, err, RETURN_CHANNEL) for out, err in streams])
            try:
                for rank in range(len(streams)):
                    out_fd, err_fd, ret_fd = worker_fds[rank]
                    try:
                        # The launcher's environment now, not the server's from
                        # when it started: a variable removed since must not leak.
                        env = rank_environb(rank, envs[rank])
                        # The env apart from the function: a worker whose
                        # function cannot be unpickled still knows where its
                        # error file goes.
                        # The binding as plain tuples: the worker applies it
                        # in its setup, before the function is unpickled.
                        binding = bindings.get(rank)
                        body = pickle.dumps(
                            (env, pickle.dumps((fn, args[rank]), protocol=pickle.HIGHEST_PROTOCOL),
                             None if binding is None else tuple(binding)),
                            protocol=pickle.HIGHEST_PROTOCOL)
                        fds = [fd for fd in (out_fd, err_fd) if fd >= 0] + [ret_fd]
                        flags = (out_fd >= 0) | (err_fd >= 0) << 1
                        data = bytes([flags]) + body
                        assert self._sock is not None
                        # Send and reply in C: the pid is recorded in the group
                        # before any signal handler can run.
                        pid = group.forkserver_fork(rank, self._sock.fileno(), _LENGTH.pack(len(data)) + data,
                                                    fds, REPLY_TIMEOUT)
                    except OSError as e:
                        self._stop()
                        if e.errno == errno.ETIMEDOUT:
                            raise ForkServerDied(
                                f"the torchmp forkserver did not answer within {REPLY_TIMEOUT:.0f}s") from None
                        raise ForkServerDied(f"the torchmp forkserver is gone ({e})") from None
                    finally:
                        group.close_worker_fds(rank)
                    if pid <= 0:
                        raise OSError(-pid, f"forkserver could not fork local rank {rank}: {os.strerror(-pid)}")
                    # Watched at once: its pidfd should be open before it can exit.
                    group.adopt_forked()
            except BaseException:
                # Every rank the server started is killed (abort adopts the
                # last one if it was not watched yet).
                try:
                    group.drop_unstarted()
                finally:
                    abort()
                raise
            group.drop_unstarted()


class ForkserverLaunch(FunctionLaunch):
    """``forkserver``: this process's forkserver (started on first use) forks
    every rank; the launcher gets the pids and watches them."""

    method = "forkserver"

    def launch(self, group: _core.Group, streams: Sequence[RankStreams], bindings: Mapping[int, _core.Binding],
               abort: Callable[[], None]) -> None:
        alias_main_for_workers()
        get_forkserver().launch(group, streams, self.fn, self.args, self.envs, bindings, abort)

    def release(self, pids: list[int]) -> None:
        if pids:
            get_forkserver().release(pids)

    def lost_status_reason(self) -> str | None:
        return "its exit status was lost: the forkserver that started it died"


_server: ForkServer | None = None


def get_forkserver() -> ForkServer:
    global _server
    if _server is None or _server._owner != os.getpid():
        _server = ForkServer()
    return _server


# ---------------------------------------------------------------------------
# The server process.

def _recv_message(sock: socket.socket) -> tuple[bytes, list[int]] | None:
    head, fds, _, _ = socket.recv_fds(sock, _LENGTH.size, 8)
    if not head:
        return None
    while len(head) < _LENGTH.size:
        more = sock.recv(_LENGTH.size - len(head))
        if not more:
            return None
        head += more
    (length,) = _LENGTH.unpack(head)
    body = bytearray()
    while len(body) < length:
        chunk = sock.recv(min(1 << 20, length - len(body)))
        if not chunk:
            return None
        body += chunk
    return bytes(body), list(fds)


def _trailer(status: int, utime_ns: int, stime_ns: int, maxrss_kb: int) -> bytes:
    return _TRAILER.pack(_TRAILER_MAGIC, status, utime_ns, stime_ns, maxrss_kb)


def server_main() -> None:
    sock = socket.socket(fileno=_worker.FD_PAYLOAD)
    sock.setblocking(True)
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ret_fds: dict[int, int] = {}  # worker pid -> our copy of its return channel
    held: set[int] = set()  # exited workers whose zombies the launcher may still need
    server_pid = os.getpid()

    message = _recv_message(sock)
    if message is None:
        return
    prep, preload = pickle.loads(message[0])
    main_error: BaseException | None = None
    try:
        _worker.prepare(prep)
    except BaseException as e:  # a main module that fails to import must not kill the server
        main_error = e
        print(f"torchmp forkserver: could not import the main module: {e!r}", file=sys.stderr)
    for name in preload:
        try:
            __import__(name)
        except BaseException as e:
            print(f"torchmp forkserver: could not preload {name}: {e!r}", file=sys.stderr)
    sock.sendall(_REPLY.pack(0))

    def collect() -> None:
        for pid in list(ret_fds):
            try:
                exited = _core.collect_exit(pid)
            except ChildProcessError:
                exited = _core.ExitRecord(255 << 8, 0, 0, 0)
            if exited is None:
                continue
            fd = ret_fds.pop(pid)
            if _core.COLLECT_HAS_RUSAGE:
                held.add(pid)
            else:
                # No rusage without reaping here: reap now (the pid is then
                # no longer pinned on such systems).
                _, status, ru = os.wait4(pid, 0)
                exited = _core.ExitRecord(status, int(ru.ru_utime * 1e9), int(ru.ru_stime * 1e9), ru.ru_maxrss)
            try:
                _worker.write_all(fd, _trailer(*exited))
            except OSError:
                pass
            os.close(fd)

    def release(body: bytes) -> None:
        for (pid,) in _PID.iter_unpack(body[: len(body) // _PID.size * _PID.size]):
            if pid in held:
                held.discard(pid)
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass

    sock_fd = sock.fileno()
    while True:
        try:
            ready, _, _ = select.select([sock_fd, wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in ready:
            try:
                while os.read(wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
            collect()
        if sock_fd not in ready:
            continue
        message = _recv_message(sock)
        if message is None:
            return  # the launcher is gone; our workers follow by their death signal
        data, fds = message
        flags, body = data[0], data[1:]
        if flags & _RELEASE:
            release(body)
            continue
        fds_iter = iter(fds)
        out_fd = next(fds_iter) if flags & 1 else -1
        err_fd = next(fds_iter) if flags & 2 else -1
        ret_fd = next(fds_iter)
        try:
            pid = os.fork()
        except OSError as e:
            pid = -(e.errno or 1)
        if pid == 0:
            _server_child(server_pid, sock, wake_r, wake_w, ret_fds, out_fd, err_fd, ret_fd, body, main_error)
        for fd in (out_fd, err_fd):
            if fd >= 0:
                os.close(fd)
        if pid > 0:
            ret_fds[pid] = ret_fd
        else:
            os.close(ret_fd)
        sock.sendall(_REPLY.pack(pid))
        collect()


def _server_child(server_pid: int, sock: socket.socket, wake_r: int, wake_w: int, ret_fds: dict[int, int],
                  out_fd: int, err_fd: int, ret_fd: int, body: bytes, main_error: BaseException | None) -> None:
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        # Siblings' return channels must not be held open by this worker, or
        # their exits would wait for it.
        for fd in list(ret_fds.values()) + [wake_r, wake_w]:
            os.close(fd)
        sock.close()
        os.set_inheritable(ret_fd, False)  # the worker's own children must not hold it
        env, call, binding = pickle.loads(body)  # bytes and tuples of ints only
        # The rank's env first: a setup that fails (a binding the kernel
        # refuses) is then recorded in the rank's error file.
        os.environb.clear()
        os.environb.update(env)
        _core.child_setup(out_fd, err_fd, True, server_pid, binding)
        for fd in (out_fd, err_fd):
            if fd > 2:
                os.close(fd)
        try:
            fn, args = pickle.loads(call)
        except Exception:
            if main_error is not None:
                # The real cause: the function lives in a main module that
                # could not be imported (e.g. it launches without a guard).
                raise main_error from None
            raise
    except BaseException as e:
        import traceback

        traceback.print_exc()
        _worker.record_failure(e)
        os._exit(code)
    _worker.run(fn, args, ret_fd)
