"""How a worker starts: every launch of torchmp, in one place.

The contexts (:mod:`torchmp._native` and its two kinds) decide *what* runs
and how each rank's streams are wired; a strategy of this package starts it.
These modules are the only Python code that drives the native group's
launch calls (``Group.spawn``, ``prepare``, ``fork_rank``,
``forkserver_fork``, ``adopt``, ``drop_unstarted``): once a launch has
returned, the contexts only observe, signal, reap and report.

==============  ==========================  =====================================
strategy        used for                    how a process starts
==============  ==========================  =====================================
``exec``        binaries, ``spawn``         the I/O thread forks and execs every
(exec.py)       function workers, the       rank (csrc/spawn.c) in one round
                forkserver itself           trip: ``Group.spawn``
``fork``        ``fork`` function workers   the calling thread forks through
(fork.py)                                   CPython's fork hooks:
                                            ``Group.prepare``, ``fork_rank``,
                                            ``adopt``
``forkserver``  ``forkserver`` function     a long-lived server forks each
(forkserver.py) workers                     worker: ``Group.prepare``,
                                            ``forkserver_fork``, ``adopt``
``command``     ``torchmp.run`` and         the calling thread forks and execs
(command.py)    ``run_async``               one command (csrc/spawn.c again);
                                            it is watched from there, or by the
                                            I/O thread
==============  ==========================  =====================================

A worker's own side (the payload a spawned interpreter reads, running the
function, sending its return value back) is :mod:`torchmp._launch.worker`;
its environment is built by :mod:`torchmp._launch.env`, its streams are
the records of :mod:`torchmp._launch.streams`, and what it reads on stdin
(a payload, a command's ``input``) is a file of
:mod:`torchmp._launch.payload`.

Every group strategy has multiprocessing's shape for its start methods
(``popen_fork``, ``popen_spawn_posix``, ``popen_forkserver``): an object
built with what every rank runs, and :meth:`Launch.launch`, which starts
them.  This module imports nothing of its own, so a spawned worker that
imports :mod:`torchmp._launch.worker` loads no more of torchmp than that.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence

# typing only for the type checker: torchmp.run's imports stay off it
# (tests/test_import_graph.py).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from torchmp import _core
    from torchmp._launch.streams import RankStreams


class Launch(abc.ABC):
    """One start method, built with what every rank of a context runs."""

    #: ``"exec"``, ``"spawn"``, ``"fork"`` or ``"forkserver"``.
    method: str = ""

    @abc.abstractmethod
    def launch(self, group: _core.Group, streams: Sequence[RankStreams], bindings: Mapping[int, _core.Binding],
               abort: Callable[[], None]) -> None:
        """Start every rank of ``group``; ``streams[rank]`` is its (stdout,
        stderr) wiring, ``bindings.get(rank)`` where it runs (None: where the
        launcher may).

        Returns once every rank runs and the group watches it.  If a rank
        cannot be started, the group watches every worker started so far,
        nothing prepared for the other ranks stays open, and ``abort()``
        (the context's teardown: SIGKILL to every started rank's group, then
        reap) has run before the error propagates.
        """
        raise NotImplementedError

    def release(self, pids: list[int]) -> None:
        """The context is done signalling these workers: let their zombies
        go (only a forkserver holds zombies of its own)."""
        return None

    def lost_status_reason(self) -> str | None:
        """Why a rank's exit status can be lost with this start method
        (None: only because something else in this process reaped it)."""
        return None


def adopt_interrupted(group: _core.Group) -> None:
    """Watch every worker a launch forked but was interrupted (a signal, an
    error) before it could watch: so that closing the context stops it too."""
    group.adopt_forked()
