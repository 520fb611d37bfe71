"""A failed rank's last words as text: the bytes the I/O thread kept of its
stderr, or the end of its log file when nothing passed through torchmp."""

from __future__ import annotations

import os
import stat


def _last_lines(data: bytes, lines: int, truncated: bool) -> str:
    """The last ``lines`` lines of data as text; a first line cut by the
    byte bound (truncated) is dropped."""
    if truncated:
        cut = data.find(b"\n")
        data = data[cut + 1:] if cut >= 0 else b""
    text = data.decode("utf-8", errors="replace").replace("\r\n", "\n")
    kept = text.rstrip("\n").split("\n")[-lines:] if lines else []
    return "\n".join(line.rsplit("\r", 1)[-1] for line in kept).strip("\n")


def _file_tail(path: str, nbytes: int) -> tuple[bytes, bool]:
    """The last nbytes of a file, and whether there was more before them."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK)
    except OSError:
        return b"", False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return b"", False
        size = os.lseek(fd, 0, os.SEEK_END)
        start = max(0, size - nbytes)
        return os.pread(fd, size - start, start), start > 0
    except OSError:
        return b"", False
    finally:
        os.close(fd)
