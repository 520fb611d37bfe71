"""What ``torchmp run`` writes to its own console: messages, the failure
report, hang reports and the end-of-run summary.  Once a run is under way
they go through the console the workers' lines go through
(``_console.say``): whole lines, after the workers' lines logged before
them, never blocking -- a stalled stderr holds up neither a fail-fast nor
the exit.  Only argparse's own output (usage, --help, before anything runs)
is written to the stream itself, through a console that may be closed or
gone (then it is dropped, never an error)."""
from __future__ import annotations

import os
import sys
from typing import Any

from torchmp import _console, _core

__all__ = ["console_gone", "drop_console", "say", "settle_console", "show", "write_console"]

def console_gone(e: BaseException | None) -> bool:
    """Whether a write error means the console is closed or gone (the
    core's one errno set for it)."""
    return isinstance(e, OSError) and e.errno is not None and _core.console_gone(e.errno)


def drop_console(stream: Any) -> None:
    """Point the fd of a console that is closed or gone at /dev/null.

    Whatever is still buffered, and anything written later (by this module,
    the native core's copy of the workers' lines, the interpreter's last
    flush at exit), then goes nowhere without an error, so a closed console
    changes neither the exit status nor what reaches the log files.
    """
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        fd = -1  # not a file: nothing to repoint, the error is swallowed only
    if fd >= 0:
        try:
            null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            null = -1
        if null >= 0:
            try:
                if null != fd:
                    os.dup2(null, fd)  # fds 0-2 stay inheritable, as they were
            except OSError:
                pass
            finally:
                if null != fd:
                    os.close(null)
    try:
        stream.flush()  # what the failed write left in the buffer: to /dev/null
    except (OSError, ValueError):
        pass


def write_console(stream: Any, text: str) -> None:
    """Write and flush ``text``; a console that is closed or gone is dropped,
    and one that was closed when the launcher started (None) is off."""
    if stream is None:
        return
    try:
        stream.write(text)
        stream.flush()
    except OSError as e:
        if not console_gone(e):
            raise
        drop_console(stream)


def settle_console() -> None:
    """Flush stdout and stderr, dropping either if it is closed or gone, so the
    interpreter's own flush at exit finds nothing to fail on (which would
    print "Exception ignored ... BrokenPipeError" and exit 120)."""
    for stream in (sys.stdout, sys.stderr):
        if stream is None:
            continue
        try:
            stream.flush()
        except OSError as e:
            if console_gone(e):
                drop_console(stream)
        except ValueError:  # closed by someone else
            pass


def say(message: str) -> None:
    _console.say(f"torchmp: {message}\n")


def show(text: str) -> None:
    """A report or the summary: to stderr, after the workers' lines logged
    before it (a hang report while the job runs, too), never waiting on a
    console that does not take it (every report is in the logs or its file
    as well; at exit the console gets as long as it makes progress)."""
    _console.say(text)
