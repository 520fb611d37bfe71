"""Where ``torchmp run``'s log files go: torchrun's layout, announced before
any rank starts, and a failed mkdir of the log directory explained (the
errno alone can mislead)."""
from __future__ import annotations

import errno
import os

from torchmp.cli.console import say
from torchmp.logs_specs import DefaultLogsSpecs, LogsDest

__all__ = ["AnnouncingLogsSpecs", "SetupError", "describe_mkdir_error"]


class SetupError(Exception):
    """Something torchmp run needs could not be made (nothing was started);
    ``str()`` is the whole message."""


class AnnouncingLogsSpecs(DefaultLogsSpecs):
    """torchrun's layout; says where the run's files are before any rank starts."""

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        try:
            dest = super().reify(envs)
        except OSError as e:  # the run's directories, inside --log-dir
            raise SetupError(describe_mkdir_error(e, self.root_log_dir)) from e
        if self.root_log_dir == os.devnull:
            say(f"no log files (--log-dir {os.devnull})")
        elif self.attempt_dir is not None:
            say(f"log directory: {self.attempt_dir}")
        return dest


def describe_mkdir_error(e: OSError, requested: str) -> str:
    """``cannot create log directory ...: why`` for a failed mkdir.

    ``requested`` is the directory asked for; ``e.filename`` is the one whose
    mkdir failed (an ancestor, when ``os.makedirs`` stopped early, or the
    run's directory inside it).  The errno alone can mislead: procfs and
    sysfs answer mkdir with ENOENT although the parent exists, so the parent
    is looked at to name the real cause.
    """
    failing = os.fsdecode(e.filename) if e.filename is not None else requested
    # The requested directory, if the failing one is it or one of its parents.
    inside = requested.rstrip(os.sep) + os.sep
    shown = requested if inside.startswith(failing.rstrip(os.sep) + os.sep) else failing
    call = "mkdir" if failing == shown else f"mkdir {failing}"
    strerror = e.strerror or str(e)
    parent = os.path.dirname(failing.rstrip(os.sep)) or "."
    diagnosis = None
    if e.errno in (errno.ENOENT, errno.EACCES, errno.EPERM) and os.path.isdir(parent):
        try:
            mode = os.stat(parent).st_mode
        except OSError:
            mode = 0
        if not mode & 0o222 or not os.access(parent, os.W_OK | os.X_OK):
            diagnosis = f"{parent} is not writable"
        elif e.errno == errno.ENOENT:
            diagnosis = f"{parent} does not allow creating directories"
    elif e.errno == errno.ENOTDIR:
        ancestor = parent
        while ancestor not in ("", os.sep, ".") and not os.path.lexists(ancestor):
            ancestor = os.path.dirname(ancestor)
        if os.path.lexists(ancestor) and not os.path.isdir(ancestor):
            diagnosis = f"{ancestor} is not a directory"
    elif e.errno == errno.EEXIST:
        diagnosis = (f"{failing} is a dangling symbolic link" if os.path.islink(failing)
                     else f"{failing} exists and is not a directory")
    reason = f"{diagnosis} ({call}: {strerror})" if diagnosis else (
        strerror if failing == shown else f"{strerror} ({call})")
    return f"cannot create log directory {shown}: {reason}"
