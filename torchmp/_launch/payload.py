"""Anonymous files that carry bytes to a child on its stdin: a spawned
function worker's payload (:mod:`torchmp._launch.exec`) and a command's
``input`` (:mod:`torchmp._launch.command`).  Light on purpose: importing
``torchmp.run`` loads this, not the group launchers."""

from __future__ import annotations

import os


def payload_file(data: bytes) -> int:
    """An anonymous file holding data (memfd where there is one), its offset
    at the end of the data."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("torchmp-payload", os.MFD_CLOEXEC)
    else:  # pragma: no cover - non-Linux
        import tempfile

        f = tempfile.TemporaryFile()
        fd = os.dup(f.fileno())
        f.close()
        os.set_inheritable(fd, False)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        raise
    return fd
