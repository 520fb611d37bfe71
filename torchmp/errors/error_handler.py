"""Writing (and safely reading) the ``error.json`` a worker leaves for its launcher.

A worker that dies with an exception writes a small JSON document to the path in
``TORCHELASTIC_ERROR_FILE``; the launcher reads it back into a
:class:`~torchmp.errors.ProcessFailure`. The document has torch's shape so that
torch-based tooling (and torch's own agent) can read what torchmp writes, and vice
versa::

    {"message": {"message": "ValueError: bad input",
                 "extraInfo": {"py_callstack": "Traceback ...",
                               "timestamp": "1700000000",
                               "timestamp_ns": "1700000000123456789"}}}

``timestamp_ns`` is torchmp's addition: torch only has whole seconds, so two ranks
that fail in the same second cannot be ordered and the wrong one can be blamed as the
root cause. Readers that do not know the key ignore it.

Two things torch does not do, and why:

* The file is written atomically (temp file in the same directory + ``os.replace``).
  The launcher may read the file the instant the worker exits -- or while a dying
  worker is still writing -- and a half-written file would be reported as garbage.
  A reader sees either the old file, or no file, or the complete new one.
* Reading is capped and never raises on bad content (see :func:`_read_error_file`).
  The file is written by user code, so the launcher must treat it as untrusted input:
  a malformed or enormous file must not crash or exhaust the agent, and only a
  regular file is read -- a symlink is not followed, so a worker cannot make the
  launcher block on a FIFO, read a device or ``/proc/kmsg``, or report another
  file's content as its own.
"""

from __future__ import annotations

import errno
import faulthandler
import json
import logging
import os
import stat
import tempfile
import time
import traceback
import warnings
from typing import Any, Final

__all__ = ["ErrorHandler"]

logger = logging.getLogger(__name__)

JSON = dict[str, Any]

#: The environment variable naming the file a worker writes its error to.
ERROR_FILE_ENV: Final = "TORCHELASTIC_ERROR_FILE"

#: Upper bound on how much of an error file is read. A real error file is a
#: traceback (kilobytes); anything bigger is a bug or an attack, and reading it whole
#: could take the launcher down with the job.
MAX_ERROR_FILE_BYTES: Final = 1 << 20


class _UnreadableErrorFile(Exception):
    """An error file exists but its content cannot be used; ``str()`` says why."""


class _NotARegularFile(FileNotFoundError):
    """The error file path names something other than a regular file (a symlink,
    FIFO, device, socket or directory); treated as no error file. ``str()`` says
    what it is, for the warning the caller logs."""


#: O_NOFOLLOW: a symlink is never followed (a worker could point its error file at
#: /proc/kmsg, another job's files or a device). O_NONBLOCK: opening a FIFO that the
#: checks below did not catch (swapped in after the lstat) does not wait for a writer.
_OPEN_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

_READ_CHUNK: Final = 1 << 16


def _file_kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return f"not a regular file (mode {stat.filemode(mode)})"


def _not_regular(path: str, mode: int) -> _NotARegularFile:
    return _NotARegularFile(f"error file {path} is {_file_kind(mode)}, not a regular file")


def _read_error_file(path: str, limit: int = MAX_ERROR_FILE_BYTES) -> Any:
    """Read and parse the JSON error file at ``path``, reading at most ``limit`` bytes.

    Returns whatever JSON value the file holds (the caller checks its shape).

    Raises ``FileNotFoundError`` when there is no file at ``path`` (``os.devnull``,
    what ``--log-dir /dev/null`` gives, counts as none), and its subclass
    :class:`_NotARegularFile` when ``path`` is anything but a regular file -- torch
    checks ``os.path.isfile`` and treats a directory or FIFO like a missing file.
    Stricter than torch, a symlink is not followed: the path is chosen by the
    launcher but the file is made by the worker, which could link it to a FIFO (a
    blocking read would hang the launcher), a device, ``/proc/kmsg`` (reading
    consumes the kernel log) or files the worker should not show. ``lstat`` first,
    so such things are never even opened; then ``O_NOFOLLOW`` and ``fstat`` on the
    open file close the race of a path swapped in between.
    Raises :class:`_UnreadableErrorFile` with a one-line explanation for every other
    problem (permissions, I/O error, a read that would block, too large, not UTF-8,
    not JSON).
    """
    if path == os.devnull:
        raise FileNotFoundError(f"error file {path} is the null device: no error file")
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(f"error file {path} does not exist") from None
    except OSError as e:
        raise _UnreadableErrorFile(
            f"error file {path} could not be opened: {_os_error_text(e)}"
        ) from None
    if not stat.S_ISREG(mode):
        raise _not_regular(path, mode)
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(f"error file {path} does not exist") from None
    except OSError as e:
        if e.errno == errno.ELOOP:  # made a symlink since the lstat
            raise _not_regular(path, stat.S_IFLNK) from None
        raise _UnreadableErrorFile(
            f"error file {path} could not be opened: {_os_error_text(e)}"
        ) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(path, mode)
        # One byte more than the cap tells "exactly at the cap" from "over it"
        # without trusting st_size (it lies for /proc files and races with
        # writers). os.read, not a buffered file: a "regular" file can still
        # answer a non-blocking read with EAGAIN (/proc/kmsg does), which
        # os.read raises while a buffered read returns None.
        chunks: list[bytes] = []
        remaining = limit + 1
        while remaining > 0:
            chunk = os.read(fd, min(remaining, _READ_CHUNK))
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
        raw = b"".join(chunks)
    except OSError as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise _UnreadableErrorFile(
            f"error file {path} could not be read: {_os_error_text(e)}"
        ) from None
    finally:
        os.close(fd)

    if len(raw) > limit:
        raise _UnreadableErrorFile(
            f"error file {path} is larger than {limit} bytes; not read"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _UnreadableErrorFile(f"error file {path} is not valid UTF-8: {e}") from None
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        # ValueError covers JSONDecodeError and int-digit limits; RecursionError a
        # deeply nested document ("[[[[...").
        raise _UnreadableErrorFile(f"error file {path} is not valid JSON: {e}") from None


def _os_error_text(e: OSError) -> str:
    if e.errno is not None and e.strerror:
        return f"{e.strerror} (errno {e.errno})"
    return str(e)


def _current_umask() -> int:
    """The process umask, read without changing it.

    ``os.umask`` can only be read by setting it, which races with other threads
    creating files; Linux exposes it in ``/proc/self/status`` instead. Falls back to
    the common 0o022.
    """
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as fp:
            for line in fp:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


class ErrorHandler:
    """Write an exception, with its traceback and time, to the worker's error file.

    The file is named by the environment variable ``TORCHELASTIC_ERROR_FILE`` (the
    launcher sets it for each rank). When the variable is unset, the content that
    would have been written is logged instead, so running a ``@record``-ed script by
    hand still works.

    Subclass it to customise error handling; override :meth:`initialize` and
    :meth:`record_exception` (and ``_get_error_file_path`` to choose another path).
    """

    def _get_error_file_path(self) -> str | None:
        """Return the path to write to, or ``None`` to only log the error."""
        return os.environ.get(ERROR_FILE_ENV) or None

    def initialize(self) -> None:
        """Prepare to capture errors; call before running the code to watch.

        Enables :mod:`faulthandler` for all threads so that a hard crash (SIGSEGV,
        SIGABRT, ...) -- which no ``except`` can catch -- still leaves a Python stack
        on stderr. A failure to enable it is a warning, not an error: losing the crash
        trace is no reason to refuse to run the worker.
        """
        try:
            faulthandler.enable(all_threads=True)
        except Exception as e:
            warnings.warn(
                f"Unable to enable fault handler. {type(e).__name__}: {e}",
                stacklevel=2,
            )

    def _write_error_file(self, file_path: str, error_msg: str) -> None:
        """Atomically replace ``file_path`` with ``error_msg``; warn (never raise) on failure.

        The content goes to a temp file in the target's own directory (``os.replace``
        is only atomic within one filesystem), which is then renamed over the target.
        The temp file is removed on every failure path, so a failed write leaves the
        directory exactly as it was -- including any previous error file.

        No fsync: the reader is the launcher on the same host, which sees the renamed
        file through the page cache; durability across a host crash does not matter
        because a host crash ends the job anyway.

        Not raising matters because this runs inside ``except`` blocks of
        :func:`~torchmp.errors.record`: an ``OSError`` here would replace the user's
        exception -- the thing we are trying to report.
        """
        target = os.path.realpath(file_path)  # keep a symlinked error file a symlink
        directory, name = os.path.split(target)
        tmp_path: str | None = None
        try:
            fd, tmp_path = tempfile.mkstemp(
                dir=directory, prefix=f".{name}.", suffix=".tmp"
            )
            with os.fdopen(fd, "w", encoding="utf-8") as fp:
                # mkstemp creates 0600; give the file the mode open() would have.
                os.fchmod(fp.fileno(), 0o666 & ~_current_umask())
                fp.write(error_msg)
            os.replace(tmp_path, target)
            tmp_path = None
        except Exception as e:
            warnings.warn(
                f"Unable to write error to file {file_path}. {type(e).__name__}: {e}",
                stacklevel=2,
            )
        finally:
            if tmp_path is not None:
                try:
                    os.unlink(tmp_path)
                except OSError:
                    pass

    def record_exception(self, e: BaseException) -> None:
        """Write ``e`` (type, message, traceback, time) to the error file as JSON.

        Like torch, an existing error file is overwritten without a warning: the
        newest exception of this process is its cause of death. The traceback is the
        one carried by ``e``, so this also works outside an ``except`` block.
        """
        now_ns = time.time_ns()
        data: JSON = {
            "message": {
                "message": f"{type(e).__name__}: {e}",
                "extraInfo": {
                    "py_callstack": "".join(
                        traceback.format_exception(type(e), e, e.__traceback__)
                    ),
                    "timestamp": str(now_ns // 1_000_000_000),
                    "timestamp_ns": str(now_ns),
                },
            }
        }
        file = self._get_error_file_path()
        if file:
            self._write_error_file(file, json.dumps(data))
        else:
            logger.info(
                "%s is not set; the error is logged instead of written:\n%s",
                ERROR_FILE_ENV,
                json.dumps(data, indent=2),
            )

    def override_error_code_in_rootcause_data(
        self,
        rootcause_error_file: str,
        rootcause_error: JSON,
        error_code: int = 0,
    ) -> None:
        """Set ``errorCode`` in a child's error data to the exit code the parent saw.

        A child killed by a signal cannot know its own exit status; the parent can.
        Only the nested (``{"message": {...}}``) shape has a place for it; the plain
        string shape is left alone with a warning, as torch does.
        """
        if "message" not in rootcause_error:
            logger.warning(
                "child error file (%s) does not have field `message`. \n"
                "cannot override error code: %s",
                rootcause_error_file,
                error_code,
            )
        elif not isinstance(rootcause_error["message"], dict):
            logger.warning(
                "child error file (%s) has a new message format. \n"
                "skipping error code override",
                rootcause_error_file,
            )
        else:
            rootcause_error["message"]["errorCode"] = error_code

    def dump_error_file(self, rootcause_error_file: str, error_code: int = 0) -> None:
        """Copy a child's error file to this process's error file (the root cause).

        Used when this process is itself a launcher: the child's root-cause error is
        what its own launcher (or the scheduler) should see. ``error_code`` (the
        child's exit code) is written into the copy as ``errorCode``.

        Deviation from torch: a child file that is missing or unreadable does not
        raise (torch raises, from inside ``record``'s ``except`` block, hiding the
        ``ChildFailedError``); a copy explaining the problem is written instead.
        An existing error file of this process is logged, then replaced (as torch).
        """
        rootcause_error: JSON
        try:
            loaded = _read_error_file(rootcause_error_file)
            if not isinstance(loaded, dict):
                raise _UnreadableErrorFile(
                    f"error file {rootcause_error_file} does not hold a JSON object"
                )
            rootcause_error = loaded
        except (FileNotFoundError, _UnreadableErrorFile) as e:
            logger.warning("cannot copy child error file: %s", e)
            now_ns = time.time_ns()
            rootcause_error = {
                "message": {
                    "message": str(e),
                    "extraInfo": {
                        "timestamp": str(now_ns // 1_000_000_000),
                        "timestamp_ns": str(now_ns),
                    },
                }
            }
        if error_code:
            self.override_error_code_in_rootcause_data(
                rootcause_error_file, rootcause_error, error_code
            )
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "child error file (%s) contents:\n%s",
                rootcause_error_file,
                json.dumps(rootcause_error, indent=2),
            )

        my_error_file = self._get_error_file_path()
        if my_error_file:
            self._warn_if_exists(my_error_file)
            self._write_error_file(my_error_file, json.dumps(rootcause_error))
            logger.info("dumped error file to parent's %s", my_error_file)
        else:
            logger.error(
                "no error file defined for parent, to copy child error file (%s)",
                rootcause_error_file,
            )

    def _warn_if_exists(self, my_error_file: str) -> None:
        """Log the content of an error file that is about to be replaced.

        This happens when a child inherited this process's ``TORCHELASTIC_ERROR_FILE``
        and wrote to it before its own value was set (torch's comment on ``_rm``
        explains the race). Torch removes the file first; the atomic replace makes
        that unnecessary, and avoids a window with no file at all.
        """
        try:
            original = _read_error_file(my_error_file)
        except _NotARegularFile as e:
            logger.warning("%s; not read, will be replaced", e)
            return
        except FileNotFoundError:
            return
        except _UnreadableErrorFile as e:
            logger.warning(
                "%s already exists and will be overwritten."
                " Unable to load original contents: %s",
                my_error_file,
                e,
            )
            return
        logger.warning(
            "%s already exists and will be overwritten. Original contents:\n%s",
            my_error_file,
            json.dumps(original, indent=2),
        )
