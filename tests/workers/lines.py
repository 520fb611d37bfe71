"""Worker that writes numbered lines: `lines.py RANK COUNT [stream]`.

Each line is `r<RANK> <SEQ> <padding>` so a reader can check that no line
was torn, lost or duplicated.
"""
import os
import sys

rank, count = int(sys.argv[1]), int(sys.argv[2])
fd = 2 if len(sys.argv) > 3 and sys.argv[3] == "err" else 1
pad = "x" * 60
buf = []
for i in range(count):
    buf.append(f"r{rank} {i} {pad}\n")
    if len(buf) == 97:  # odd batch size: writes do not line up with pipe buffers
        os.write(fd, "".join(buf).encode())
        buf.clear()
if buf:
    os.write(fd, "".join(buf).encode())
