"""How a rank's streams are wired, as every launch takes them: the native
core's ``StreamSpec`` records, and the log files they point at."""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Container, Mapping

from torchmp import _core
from torchmp._inputs import getenv

logger = logging.getLogger("torchmp.api")

_LOG_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)

#: The worker inherits the launcher's stream.
NO_STREAM = _core.StreamSpec(_core.STREAM_INHERIT, -1, -1, None)
#: A function worker's return channel: the I/O thread keeps what it writes.
RETURN_CHANNEL = _core.StreamSpec(_core.STREAM_RETURN, -1, -1, None)

#: A rank's (stdout, stderr) as the native core is to wire them.
RankStreams = tuple[_core.StreamSpec, _core.StreamSpec]


def _log_error(e: OSError, path: str) -> OSError:
    """What a log file that cannot be opened is reported as."""
    if e.errno == errno.ELOOP:
        return OSError(e.errno, f"refusing to follow a symlink for a log file: {path}", path)
    if e.errno == errno.ENXIO:
        return OSError(e.errno, f"refusing a FIFO as a log file: {path}", path)
    if getattr(e, "wrong_type", False):
        return OSError(errno.EINVAL, f"a log file must be a regular file or a device: {path}", path)
    return e


def open_log(path: str) -> int:
    """Open a log file for a worker: truncate, never through a symlink
    planted in the log directory, never block on a FIFO planted there, mode
    from the umask.  Character devices (/dev/null) are fine."""
    try:
        fd = os.open(path, _LOG_FLAGS | os.O_NONBLOCK, 0o666)
    except OSError as e:
        raise _log_error(e, path) from None
    try:
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISCHR(mode)):
            raise OSError(errno.EINVAL, f"a log file must be a regular file or a device: {path}", path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def prepare_log(path: str) -> str:
    """Create (or truncate) and check a worker's log file the way
    :func:`open_log` does, without keeping it open: the native core opens
    it again when the rank starts.  The absolute path.  (One C call: a
    redirected launch makes two per rank.)"""
    try:
        _core.create_log(os.fsencode(path))
    except OSError as e:
        raise _log_error(e, path) from None
    return os.path.abspath(path)


#: TORCHMP_TEE_TAIL=1 follows every teed log even when fds are plentiful,
#: =0 never does (tests and operations); unset, logs are followed only when
#: piping them would not fit RLIMIT_NOFILE.
FOLLOW_ENV = "TORCHMP_TEE_TAIL"
#: What following logs costs once: the inotify fd, and the one a log is read
#: with for a moment.
FOLLOW_FDS = 2


def launch_fds_needed(stdouts: Mapping[int, str], stderrs: Mapping[int, str], tee_stdouts: Container[int],
                      tee_stderrs: Container[int], nprocs: int, fds_per_rank: int, stderr_tail_pipe: bool,
                      follow: bool = False) -> int:
    """The most fds a context holds at once while starting: per teed stream
    the loop's pipe end and (with a file) the log it writes, or nothing if
    its log is followed (``follow``: the worker writes it, one inotify fd
    says when it grew); none for a redirected one (the core opens its log
    when the rank starts and closes it once the worker has it); a pipe for
    an unlogged stderr whose tail is kept (``stderr_tail_pipe``);
    ``fds_per_rank`` per rank (the pidfd, plus what the launch adds); the
    few of the rank being started, and the I/O thread's own: some slack."""
    needed = 16 + (FOLLOW_FDS if follow else 0)
    for which, paths, tees in ((0, stdouts, tee_stdouts), (1, stderrs, tee_stderrs)):
        for rank in range(nprocs):
            path = paths.get(rank)
            if path:
                piped = not follow or not followable(stdouts, stderrs, rank)
                needed += 2 if rank in tees and piped else 0
            elif which == 1 and stderr_tail_pipe:
                needed += 1
    return needed + fds_per_rank * nprocs


def followable(stdouts: Mapping[int, str], stderrs: Mapping[int, str], rank: int) -> bool:
    """Whether a rank's teed logs can be followed: not one file for both
    streams (whose bytes would not say which stream wrote them)."""
    out, err = stdouts.get(rank), stderrs.get(rank)
    return not (out and err and os.path.abspath(out) == os.path.abspath(err))


def follow_wanted() -> bool | None:
    """TORCHMP_TEE_TAIL: True (always follow), False (never), None (when
    the pipes would not fit)."""
    value = (getenv(FOLLOW_ENV) or "").strip()
    if value in ("", "auto"):
        return None
    return value not in ("0", "false", "no", "off")


#: What :func:`fd_limits` says for no limit (``RLIM_INFINITY``).
NO_FD_LIMIT = -1


def fd_budget_fits(needed: int, limits: tuple[int, int, int] | None) -> bool:
    """Whether ``needed`` more fds fit the hard RLIMIT_NOFILE (the soft one
    can be raised to it), given :func:`fd_limits`."""
    if limits is None:
        return True
    in_use, _soft, hard = limits
    return hard == NO_FD_LIMIT or needed + in_use <= hard


def surely_fits(needed: int) -> bool:
    """Whether ``needed`` more fds surely fit under the soft RLIMIT_NOFILE,
    told without counting the open ones (:func:`fd_limits` walks
    /proc/self/fd): true for most launches, which are far from the limit.
    False when it cannot be told so: count."""
    try:
        return _core.fd_room(needed)
    except OSError:
        return False


def fd_limits() -> tuple[int, int, int] | None:
    """(fds in use, soft limit, hard limit), or None where unknown."""
    try:
        soft, hard = _core.nofile_limits()
        try:
            in_use = _core.open_fd_count()
        except OSError:
            # The portable build counts no /proc/self/fd in C; /dev/fd lists
            # the same on Linux and macOS, and one more: the listing's own,
            # closed again by now.
            in_use = len(os.listdir("/dev/fd")) - 1
    except OSError:
        return None
    return in_use, soft, hard


def ensure_fd_budget(needed: int, nprocs: int, limits: tuple[int, int, int] | None = None) -> None:
    """Raise the soft RLIMIT_NOFILE if a launch needs ``needed`` more fds, or
    fail with a clear error before anything starts (a launch that runs out of
    fds half-way would have to tear down what it started).  ``limits``: what
    :func:`fd_limits` said just now (None: ask it)."""
    if limits is None:
        limits = fd_limits()
    if limits is None:
        return
    in_use, soft, hard = limits
    needed += in_use
    if soft == NO_FD_LIMIT or needed <= soft:
        return
    # The OOM watch's two kept descriptors are a cache: a launch that needs
    # them gets them (the next launch with room opens them again).
    needed -= _core.drop_kept_files()
    if needed <= soft:
        return
    if hard == NO_FD_LIMIT or needed <= hard:
        import resource  # here only: most launches have the fds they need

        new_soft = needed if hard == NO_FD_LIMIT else min(hard, max(needed, 2 * soft))
        new_hard = resource.RLIM_INFINITY if hard == NO_FD_LIMIT else hard
        resource.setrlimit(resource.RLIMIT_NOFILE, (new_soft, new_hard))
        logger.info("raised the soft RLIMIT_NOFILE from %s to %s for %s ranks", soft, new_soft, nprocs)
        return
    raise OSError(
        errno.EMFILE,
        f"starting {nprocs} ranks needs about {needed} open files but RLIMIT_NOFILE is "
        f"{soft} (hard {hard}); raise it (ulimit -n) or tee fewer streams")
