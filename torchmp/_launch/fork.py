"""The ``fork`` strategy: the calling thread forks each function worker
through CPython's fork hooks, and the child runs the function.

Caveat of fork: only the forking thread exists in the child, so locks held
by other threads at that moment stay locked there.  The parent-death signal
is armed only when forking from the main thread (it fires when the *forking
thread* exits)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torchmp import _core
from torchmp._launch import worker
from torchmp._launch.env import apply_rank_env
from torchmp._launch.exec import FunctionLaunch
from torchmp._launch.streams import RETURN_CHANNEL, RankStreams
from torchmp._signals import handled_signals, is_interrupt

logger = logging.getLogger("torchmp.api")


class ForkLaunch(FunctionLaunch):
    method = "fork"
    pickled = False

    def launch(self, group: _core.Group, streams: Sequence[RankStreams], bindings: Mapping[int, _core.Binding],
               abort: Callable[[], None]) -> None:
        # Python-level buffers would otherwise be written twice (parent and child).
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception as e:
                if is_interrupt(e):  # a signal landed here: it stops the launch
                    raise
        on_main_thread = threading.current_thread() is threading.main_thread()
        # A forked worker must die of the signals the launcher turns into
        # SignalException like any other process, not raise in the function.
        launcher_signals = tuple(int(s) for s in handled_signals())
        # One I/O-thread round trip to open every rank's streams and one to
        # watch every worker: per-rank round trips cost more than the fork
        # itself once forked workers compete for the CPU.
        try:
            group.prepare([(out, err, RETURN_CHANNEL) for out, err in streams])
        except OSError as e:
            logger.error("failed to set up the streams of local rank %s of %s: %s",
                         getattr(e, "rank", "?"), self.name, e)
            raise
        # A signal handler that runs inside CPython's fork hooks (logging
        # registers some) raises there, and CPython prints and drops what a
        # hook raises: the launcher would carry on as if no signal had come.
        # Such interrupts are kept and raised once fork_rank has returned.
        interrupts: list[BaseException] = []
        previous_hook = sys.unraisablehook

        def keep_interrupts(unraisable: Any) -> None:
            if is_interrupt(unraisable.exc_value):
                interrupts.append(unraisable.exc_value)
            else:
                previous_hook(unraisable)

        sys.unraisablehook = keep_interrupts
        try:
            for rank in range(len(streams)):
                # fork_rank records the pid in the group before it returns, so
                # a signal landing anywhere after the fork cannot lose it.
                pid, ret_fd = group.fork_rank(rank, on_main_thread, launcher_signals, bindings.get(rank))
                if pid == 0:
                    sys.unraisablehook = previous_hook
                    # The child must never unwind into the launcher's frames.
                    try:
                        _fork_child(self.fn, self.args[rank], rank, self.envs[rank], ret_fd, launcher_signals)
                    finally:
                        os._exit(1)
                if interrupts:
                    raise interrupts[0]
            group.adopt_forked()
        except BaseException as e:
            sys.unraisablehook = previous_hook
            if isinstance(e, OSError):
                logger.error("failed to start the workers of %s: %s", self.name, e)
            try:
                group.drop_unstarted()
            finally:
                abort()  # adopts every forked worker not watched yet, then kills it
            raise
        finally:
            sys.unraisablehook = previous_hook
        group.drop_unstarted()


def _fork_child(fn: Callable[..., Any], args: tuple[Any, ...], rank: int, env: Mapping[str, Any], ret_fd: int,
                default_signals: tuple[int, ...]) -> None:
    """Body of a forked worker: never returns into the launcher's frames."""
    try:
        # fork_rank reset these in C at fork, so none of the launcher's
        # handlers can run here; this tells Python's own table the same
        # (signal.getsignal, and a handler the function installs on top).
        for sig in default_signals:
            signal.signal(sig, signal.SIG_DFL)
        worker.fresh_stdio()
        apply_rank_env(rank, env)
    except BaseException:
        os._exit(1)
    worker.run(fn, args, ret_fd)
