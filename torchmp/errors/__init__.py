"""Propagating worker errors to the launcher, through ``error.json`` files.

A worker's exception lives in another process, so the launcher cannot ``except`` it.
Instead, the launcher sets ``TORCHELASTIC_ERROR_FILE`` for each rank; a worker whose
entrypoint is decorated with :func:`record` writes any uncaught exception there (as
torch-compatible JSON, see :mod:`torchmp.errors.error_handler`); the launcher reads
each failed rank's file into a :class:`ProcessFailure` and raises
:class:`ChildFailedError`, which names the **first** failure as the root cause.
Function entrypoints given to ``start_processes`` are run under :func:`record`
automatically; binaries opt in by decorating their ``main``.

Example (a worker binary, and what its launcher sees)::

    from torchmp.errors import record

    @record
    def main() -> None:
        raise ValueError("bad input")

    if __name__ == "__main__":
        main()

    # error.json: {"message": {"message": "ValueError: bad input",
    #              "extraInfo": {"py_callstack": "Traceback ...",
    #                            "timestamp": "1700000000",
    #                            "timestamp_ns": "1700000000123456789"}}}

    from torchmp.errors import ChildFailedError, ProcessFailure

    failure = ProcessFailure(local_rank=0, pid=4242, exitcode=1,
                             error_file="/tmp/run/0/error.json")
    failure.message["message"]         # 'ValueError: bad input'
    raise ChildFailedError("trainer", {0: failure})   # message: the failure report

Error taxonomy (torch's categories; torchmp handles the "Worker Failure" row):

+----------------+----------------+-----------------------------------------------------+
| Category       | Sub-category   | Description and how it reaches the user             |
+================+================+=====================================================+
| User error     | Input error    | invalid arguments to the launcher API (e.g. ranks   |
|                |                | missing from ``args``): raised in the launcher,     |
|                |                | before any process starts                           |
|                +----------------+-----------------------------------------------------+
|                | Worker failure | a worker exits non-zero or by a signal: a           |
|                |                | :class:`ProcessFailure` per rank, read from its     |
|                |                | ``error.json`` when there is one, collected into a  |
|                |                | :class:`ChildFailedError`                           |
+----------------+----------------+-----------------------------------------------------+
| Platform error | n/a            | the launcher itself fails: an ordinary exception in |
|                |                | the launcher process                                |
+----------------+----------------+-----------------------------------------------------+
| Infra error    | n/a            | failures outside launcher and workers (host loss):  |
|                |                | seen by the scheduler, not by torchmp               |
+----------------+----------------+-----------------------------------------------------+

How torchmp improves on torch here:

* The root cause is ordered by nanoseconds (``timestamp_ns`` from the error file or
  from the launcher), not whole seconds, and ranks the launcher itself killed after
  the first failure (``terminated_by_launcher``) are never blamed.
* A malformed, oversized or unreadable ``error.json`` becomes a failure whose
  ``message`` says what is wrong with the file; it never raises inside the launcher.
* ``error.json`` is read only if it is a regular file: a symlink is not followed
  (to a FIFO, a device, ``/proc/kmsg``), and a FIFO or device is never opened.
* ``error.json`` is written atomically, so a reader never sees half a file.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from functools import wraps
from string import Template
from typing import Any, Final, ParamSpec, TypeVar, overload

from .error_handler import (
    MAX_ERROR_FILE_BYTES,
    ErrorHandler,
    _NotARegularFile,
    _read_error_file,
    _UnreadableErrorFile,
)
from .handlers import get_error_handler
from torchmp._tails import exception_headline, python_traceback

__all__ = [
    "ProcessFailure",
    "ChildFailedError",
    "record",
    "ErrorHandler",
    "get_error_handler",
]

logger = logging.getLogger(__name__)

JSON = dict[str, Any]
GlobalRank = int

_NOT_AVAILABLE: Final = "<N/A>"
#: torch's ``error_file_data["message"]`` when no error file recorded one.
NO_MESSAGE: Final = "<NONE>"
_NS_PER_S: Final = 1_000_000_000

_R = TypeVar("_R")
_P = ParamSpec("_P")


def _as_int(value: object) -> int | None:
    """Interpret a timestamp from an error file (torch writes a str of an int).

    Returns ``None`` for anything unusable, so a bad timestamp degrades the ordering
    instead of failing the whole read.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if math.isfinite(value) else None
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return None
    return None


@dataclass
class ProcessFailure:
    """The result of a worker process that failed, with what its error file says.

    Constructed by the launcher as ``ProcessFailure(local_rank, pid, exitcode,
    error_file)`` exactly like torch's. The constructor reads ``error_file``:

    * Missing file (the worker did not use ``@record``, or died by a signal):
      ``error_file`` becomes ``"<N/A>"`` and ``message`` is made up from the exit
      status -- ``"Signal 9 (SIGKILL) received by PID 123"`` for a signal. A path
      that is not a regular file (a symlink -- never followed --, FIFO, device,
      socket, directory) counts as missing, with a warning logged.
    * ``{"message": {"message": ..., "extraInfo": {...}}}`` (what :class:`ErrorHandler`
      writes): ``message`` is that inner **dict**, as in torch, so the report can
      show its ``py_callstack``; ``timestamp`` comes from ``extraInfo``.
    * ``{"message": "<string>"}`` (a file the user wrote by hand): ``message`` is the
      string; ``timestamp`` is the top-level ``"timestamp"`` if any.
    * Anything else (not JSON, not UTF-8, wrong shape, over
      ``MAX_ERROR_FILE_BYTES``, unreadable): never raises -- unlike torch, whose
      agent crashes on a bad file. ``message`` explains the problem and
      ``error_file_problem`` holds the explanation; ``exitcode`` is kept.

    Extra keyword-only fields set by torchmp's launcher (torch code never passes
    them, and gets torch's behaviour):

    * ``timestamp_ns``: when the launcher saw the process exit, in ns since the
      epoch. Used for ``timestamp`` when the file does not give one, and for the
      root-cause ordering.
    * ``terminated_by_launcher``: the launcher killed this rank because another one
      failed first; such a rank is never chosen as the root cause.
    * ``stderr_tail``: the last lines the rank wrote to stderr, as the launcher saw
      them pass (or read from the end of its redirect file). ``message`` stays
      torch's; with no error file, the report shows the tail instead (see
      :attr:`headline` and :func:`last_words`).
    * ``cause``: what the launcher found out about the death beyond the exit
      status, e.g. ``"killed by the kernel OOM killer (...)"`` (the kernel's log
      names the rank) or ``"an OOM kill in the same cgroup at 14:02:08 may be
      related"``; added to ``message``.
    """

    local_rank: int
    pid: int
    exitcode: int
    error_file: str
    error_file_data: JSON = field(init=False)
    message: str | JSON = field(init=False)  # the nested dict is torch's behaviour
    timestamp: int = field(init=False)
    timestamp_ns: int | None = field(default=None, kw_only=True)
    terminated_by_launcher: bool = field(default=False, kw_only=True)
    stderr_tail: str = field(default="", kw_only=True, repr=False)
    cause: str | None = field(default=None, kw_only=True)
    error_file_problem: str | None = field(
        init=False, default=None, repr=False, compare=False
    )
    _file_timestamp_ns: int | None = field(
        init=False, default=None, repr=False, compare=False
    )
    _observed_ns: int | None = field(
        init=False, default=None, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        self.error_file_data = {"message": NO_MESSAGE}
        self.message = ""
        file_timestamp: int | None = None
        # torch: a hand-written {"message": "<str>"} file without "timestamp" gets 0
        # (it sorts first). Kept for parity, unless the launcher gave timestamp_ns.
        default_timestamp: int | None = None
        try:
            data = _read_error_file(self.error_file, MAX_ERROR_FILE_BYTES)
        except _NotARegularFile as e:
            # Not the worker's error report, whatever it points to: say so, and
            # carry on as if there were no file (torch's rule for a FIFO).
            logger.warning(
                "rank %s (pid %s): %s; ignored (no error file)", self.local_rank, self.pid, e
            )
            self.error_file = _NOT_AVAILABLE
        except FileNotFoundError:
            self.error_file = _NOT_AVAILABLE
        except _UnreadableErrorFile as e:
            self._set_problem(str(e))
        else:
            message = data.get("message") if isinstance(data, dict) else None
            if isinstance(data, dict) and isinstance(message, (str, dict)):
                self.error_file_data = data
                self.message = message
                extra = data if isinstance(message, str) else message.get("extraInfo")
                if isinstance(message, str):
                    default_timestamp = 0
                if isinstance(extra, dict):
                    file_timestamp = _as_int(extra.get("timestamp"))
                    self._file_timestamp_ns = _as_int(extra.get("timestamp_ns"))
                if logger.isEnabledFor(logging.DEBUG):
                    logger.debug(
                        "User process failed with error data: %s",
                        json.dumps(data, indent=2),
                    )
            else:
                self._set_problem(
                    f"error file {self.error_file} has an unexpected shape:"
                    ' expected a JSON object whose "message" is a string or an'
                    f" object, got {_describe(data)}"
                )

        if file_timestamp is not None:
            self.timestamp = file_timestamp
        elif self._file_timestamp_ns is not None:
            self.timestamp = self._file_timestamp_ns // _NS_PER_S
        elif self.timestamp_ns is not None:
            self.timestamp = self.timestamp_ns // _NS_PER_S
        elif default_timestamp is not None:
            self.timestamp = default_timestamp
        else:
            # Nothing better known than "now", when the launcher built this failure;
            # keep "now" in ns too, so the ordering does not drop to whole seconds.
            self._observed_ns = time.time_ns()
            self.timestamp = self._observed_ns // _NS_PER_S

        # Make up an informative message if the file did not give one: the
        # rank's own last words first, then its exit status.
        if not self.message:
            if self.exitcode >= 0:
                self.error_file_data["errorTraits"] = {
                    "category": "system_terminated_error",
                    "retryability": "False",
                }
            if self.exitcode < 0:
                # signals typically do not leave an error file
                self.message = self._signal_message()
            else:
                self.message = (
                    "To enable traceback see:"
                    " https://pytorch.org/docs/stable/elastic/errors.html"
                )
        if self.cause and isinstance(self.message, str):
            self.message = f"{self.message}; {self.cause}" if self.message else self.cause

    @property
    def has_recorded_message(self) -> bool:
        """Whether the error file recorded a message (``error_file_data`` is
        torch's ``{"message": NO_MESSAGE}`` when there was no file)."""
        return self.error_file_data.get("message") not in (None, NO_MESSAGE)

    @property
    def headline(self) -> str:
        """This failure in one line, for reports: the error file's message;
        without one, the exception a Python traceback in the stderr tail
        names (an exception group with its first exception; see
        :func:`torchmp._tails.exception_headline`), else (a non-zero exit)
        the tail's last line, else ``message``."""
        message = self.message
        if isinstance(message, dict):
            inner = message.get("message", _NOT_AVAILABLE)
            return str(inner).split("\n", 1)[0]
        if not self.has_recorded_message and self.stderr_tail.strip():
            exception_line = exception_headline(self.stderr_tail)
            if exception_line is not None:
                return exception_line if not self.cause else f"{exception_line}; {self.cause}"
            if self.exitcode > 0:
                return self.stderr_tail.rstrip().rsplit("\n", 1)[-1]
        return str(message).split("\n", 1)[0]

    def _set_problem(self, explanation: str) -> None:
        logger.warning("rank %s (pid %s): %s", self.local_rank, self.pid, explanation)
        self.error_file_problem = explanation
        self.error_file_data = {"message": explanation}
        self.message = explanation
        if self.exitcode < 0:
            self.message += f"; {self._signal_message()}"

    def _signal_message(self) -> str:
        return f"Signal {-self.exitcode} ({self.signal_name()}) received by PID {self.pid}"

    @property
    def precise_timestamp_ns(self) -> int:
        """The failure time in ns since the epoch, for ordering failures.

        Prefers the error file's ``timestamp_ns`` (when the worker recorded the
        exception), then the launcher's ``timestamp_ns`` (when it saw the exit), then
        the construction time if that is where ``timestamp`` came from, then
        ``timestamp`` in whole seconds (torch's only resolution).
        """
        if self._file_timestamp_ns is not None:
            return self._file_timestamp_ns
        if self.timestamp_ns is not None:
            return self.timestamp_ns
        if self._observed_ns is not None:
            return self._observed_ns
        return self.timestamp * _NS_PER_S

    def signal_name(self) -> str:
        """The name of the signal that killed the process, or ``"<N/A>"``.

        Never raises: an exit code that maps to no known signal is ``"<N/A>"`` too,
        since this runs while reporting another failure.
        """
        if self.exitcode < 0:
            try:
                return signal.Signals(-self.exitcode).name
            except ValueError:
                return _NOT_AVAILABLE
        return _NOT_AVAILABLE

    def timestamp_isoformat(self) -> str:
        """Return ``timestamp`` as local time in ISO format (``YYYY-MM-DD_HH:MM:SS``)."""
        try:
            return datetime.fromtimestamp(self.timestamp).isoformat(sep="_")
        except (OverflowError, OSError, ValueError):
            # a nonsense timestamp from a user-written file must not break the report
            return _NOT_AVAILABLE


def _describe(value: object) -> str:
    if isinstance(value, dict):
        if "message" not in value:
            return 'an object without "message"'
        return f'"message" of type {type(value["message"]).__name__}'
    return f"a JSON {type(value).__name__}"


_FAILURE_FORMAT_TEMPLATE: Final = """[${idx}]:
  time      : ${time}
  host      : ${hostname}
  rank      : ${rank} (local_rank: ${local_rank})
  exitcode  : ${exitcode} (pid: ${pid}) ${signal_name}${terminated}
  error_file: ${error_file}
  traceback : ${message}"""

# torch 2.13's layout: the other failures first, the root cause last, where it
# is nearest to the prompt. The blank line before is intentional, as in torch.
_MSG_FORMAT_TEMPLATE: Final = """
${boarder}
${title}
${section}
Failures:
${other_failures}
${section}
Root Cause (first observed failure):
${root_failure}
${boarder}"""


class ChildFailedError(Exception):
    """Raised by a launcher when one or more of its child processes failed.

    ``failures`` maps each failed rank to its :class:`ProcessFailure`. The message is
    torch 2.13's report: the other failures first, then the root cause (see
    :meth:`get_first_failure`); each failure is shown with torch's fields (time, host,
    rank, exit code and signal, error file, traceback).

    Raised from a function decorated with :func:`record`, it makes the root cause's
    error file the error file of this process too, so nested launchers (scheduler ->
    agent -> workers) report the worker's traceback rather than their own.

    Example::

        ChildFailedError("trainer", {1: ProcessFailure(1, 4242, 1, "1/error.json")})
    """

    def __init__(self, name: str, failures: dict[GlobalRank, ProcessFailure]) -> None:
        if not failures:
            raise ValueError("ChildFailedError needs at least one failure")
        self.name = name
        self.failures = failures
        super().__init__(self.format_msg())

    def get_first_failure(self) -> tuple[GlobalRank, ProcessFailure]:
        """Return the root-cause ``(rank, failure)``: the first one to fail.

        Ranks the launcher killed because of another failure are skipped (unless that
        is all there is); among the rest the earliest ``precise_timestamp_ns`` wins,
        ties going to the first in ``failures`` order (as torch's ``min``).
        """
        rank = root_cause(self.failures)
        return rank, self.failures[rank]

    def format_msg(self, boarder_delim: str = "=", section_delim: str = "-") -> str:
        """Render the report (torch's layout and parameter names)."""
        title = f"{self.name} FAILED"
        root_rank, _ = self.get_first_failure()
        hostname = socket.getfqdn()  # once: it can be a slow DNS lookup

        root_failure_fmt = ""
        other_failures_fmt: list[str] = []
        width = len(title)
        for idx, (rank, failure) in enumerate(self.failures.items()):
            fmt, w = self._format_failure(idx, rank, failure, hostname)
            width = max(width, w)
            if rank == root_rank:
                root_failure_fmt = fmt
            else:
                other_failures_fmt.append(fmt)

        width = min(width, 60)
        return Template(_MSG_FORMAT_TEMPLATE).substitute(
            boarder=boarder_delim * width,
            title=title,
            section=section_delim * width,
            root_failure=root_failure_fmt,
            other_failures="\n".join(other_failures_fmt or ["  <NO_OTHER_FAILURES>"]),
        )

    @staticmethod
    def _format_failure(
        idx: int, rank: int, failure: ProcessFailure, hostname: str
    ) -> tuple[str, int]:
        # ``message`` is a str (signals, hand-written files, problems) or torch's dict
        # {"message": ..., "extraInfo": {"py_callstack": ..., ...}}: show the
        # traceback, else the inner message, else <N/A>.
        msg: object = failure.message
        if isinstance(msg, dict):
            extra = msg.get("extraInfo")
            callstack = extra.get("py_callstack") if isinstance(extra, dict) else None
            if callstack is None:
                callstack = msg.get("message", _NOT_AVAILABLE)
            msg = str(callstack).replace("\n", "\n  ")  # indent the traceback
        else:
            msg = _with_last_words(failure, str(msg))

        signal_name = failure.signal_name()
        fmt = Template(_FAILURE_FORMAT_TEMPLATE).substitute(
            idx=idx,
            time=failure.timestamp_isoformat(),
            hostname=hostname,
            rank=rank,
            local_rank=failure.local_rank,
            exitcode=failure.exitcode,
            pid=failure.pid,
            signal_name=f" ({signal_name})" if signal_name != _NOT_AVAILABLE else "",
            terminated=(
                " [terminated by launcher]" if failure.terminated_by_launcher else ""
            ),
            error_file=failure.error_file,
            message=msg,
        )
        width = max(len(line) for line in fmt.split("\n"))
        return fmt, width


def root_cause_order(failure: ProcessFailure) -> tuple[bool, int]:
    """The sort key of the root-cause rule, the one owner of it: never a rank
    the launcher terminated (unless all were), then the earliest failure in
    nanoseconds."""
    return failure.terminated_by_launcher, failure.precise_timestamp_ns


def root_cause(failures: dict[int, ProcessFailure]) -> int:
    """The rank of the root cause among ``failures`` (ties: the first in
    dict order, as torch's ``min``)."""
    return min(failures, key=lambda rank: root_cause_order(failures[rank]))


def last_words(failure: ProcessFailure) -> str | None:
    """What a failure without an error file shows as its traceback, from its
    stderr tail: the Python traceback in it, else its message followed by
    the tail's last lines; None when there is no tail or an error file won."""
    tail = failure.stderr_tail.rstrip()
    if not tail or failure.has_recorded_message:
        return None
    traceback = python_traceback(tail)
    if traceback is not None:
        return traceback if not failure.cause else f"{traceback}\n({failure.cause})"
    lines = tail.split("\n")
    return (f"{failure.headline}\nlast {len(lines)} line{'s' if len(lines) != 1 else ''} of stderr:\n"
            + "\n".join(f"  {line}" for line in lines))


def _with_last_words(failure: ProcessFailure, message: str) -> str:
    """The report's traceback field (indented for the report)."""
    text = last_words(failure)
    return message if text is None else text.replace("\n", "\n  ")


@overload
def record(
    fn: Callable[_P, _R], error_handler: ErrorHandler | None = None
) -> Callable[_P, _R | None]: ...


@overload
def record(
    fn: None = None, error_handler: ErrorHandler | None = None
) -> Callable[[Callable[_P, _R]], Callable[_P, _R | None]]: ...


def record(
    fn: Callable[_P, _R] | None = None, error_handler: ErrorHandler | None = None
) -> Callable[_P, _R | None] | Callable[[Callable[_P, _R]], Callable[_P, _R | None]]:
    """Record uncaught exceptions of ``fn`` in the error file, then re-raise them.

    Use it once per process, on the top-level function (typically ``main``), as
    ``@record`` or ``@record(error_handler=MyHandler())``. Equivalent to::

        error_handler = get_error_handler()
        error_handler.initialize()
        try:
            fn()
        except SystemExit as e:
            if e.code not in (0, None):  # a clean exit is not an error
                raise
        except ChildFailedError as e:   # this process is a launcher
            _, failure = e.get_first_failure()
            error_handler.dump_error_file(failure.error_file, failure.exitcode)
            raise
        except Exception as e:
            error_handler.record_exception(e)
            raise

    A clean ``SystemExit`` (code 0 or ``None``) returns ``None`` instead of
    propagating, so that entry points run via ``runpy`` finish normally. Other
    non-``Exception`` exits (``KeyboardInterrupt``, a non-zero ``SystemExit``)
    propagate unrecorded, as in torch.
    """
    handler = get_error_handler() if error_handler is None else error_handler

    def wrap(f: Callable[_P, _R]) -> Callable[_P, _R | None]:
        @wraps(f)
        def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R | None:
            handler.initialize()
            try:
                return f(*args, **kwargs)
            except SystemExit as se:
                if se.code is None or se.code == 0:
                    return None
                raise
            except ChildFailedError as e:
                rank, failure = e.get_first_failure()
                if failure.error_file != _NOT_AVAILABLE:
                    handler.dump_error_file(failure.error_file, failure.exitcode)
                else:
                    logger.info(
                        "local_rank %s FAILED with no error file."
                        " Decorate your entrypoint fn with @record for traceback info."
                        " See: https://pytorch.org/docs/stable/elastic/errors.html",
                        rank,
                    )
                raise
            except Exception as e:
                handler.record_exception(e)
                raise

        return wrapper

    if fn is None:
        return wrap
    return wrap(fn)
