"""Redirect the process's stdout/stderr at the file-descriptor level.

Unlike ``contextlib.redirect_stdout`` this moves fd 1 (or 2) itself, so
output of C extensions and of subprocesses started inside the block lands in
the file too.  The fd juggling (flush C stdio, dup, dup2, restore) is done in
the compiled core; nothing is loaded through ctypes.

>>> import os, tempfile
>>> path = os.path.join(tempfile.mkdtemp(), "out.log")
>>> with redirect_stdout(path):
...     _ = os.system("echo from a subprocess")
>>> open(path).read()
'from a subprocess\\n'

The file is created (or truncated).  Python-level buffers of ``sys.stdout``
/ ``sys.stderr`` are flushed on the way in and out, so output written before
the block does not end up in the file.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

from torchmp import _core

__all__ = ["redirect", "redirect_stdout", "redirect_stderr"]

_STREAMS = {"stdout": 1, "stderr": 2}


def _flush_python(std: str) -> None:
    stream = getattr(sys, std, None)
    if stream is not None:
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


@contextmanager
def redirect(std: str, to_file: str | os.PathLike[str]) -> Iterator[None]:
    """Redirect ``std`` ("stdout" or "stderr") to the file ``to_file``."""
    if std not in _STREAMS:
        raise ValueError(f"unknown standard stream <{std}>, must be one of {set(_STREAMS)}")
    std_fd = _STREAMS[std]
    target = os.open(to_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    try:
        _flush_python(std)
        saved = _core.redirect_fd(std_fd, target)
    finally:
        os.close(target)
    try:
        yield
    finally:
        _flush_python(std)
        _core.restore_fd(std_fd, saved)


redirect_stdout = partial(redirect, "stdout")
redirect_stderr = partial(redirect, "stderr")
