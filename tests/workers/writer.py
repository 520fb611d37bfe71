"""Worker that writes numbered 64-byte lines: `writer.py COUNT [BATCH] [PAUSE] [stream]`.

Line i is `%08d` % i, a space, 54 letters and a newline, so a reader can
tell exactly how much of the output arrived (expected_output() below gives
the bytes).  BATCH lines go out per write(), with PAUSE seconds between
writes; the exit code is 0 whatever a write does (EPIPE, ENOSPC: the
launcher's problem is under test, not the worker's).
"""
import os
import sys
import time


def expected_output(count: int) -> bytes:
    return b"".join(b"%08d %s\n" % (i, bytes([97 + i % 26]) * 54) for i in range(count))


def main() -> None:
    count = int(sys.argv[1])
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    pause = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    fd = 2 if len(sys.argv) > 4 and sys.argv[4] == "err" else 1
    data = expected_output(count)
    step = 64 * batch
    for start in range(0, len(data), step):
        try:
            view = memoryview(data)[start:start + step]
            while view:
                view = view[os.write(fd, view):]
        except OSError as e:
            sys.stderr.write(f"writer: {e}\n")
            os._exit(0)
        if pause:
            time.sleep(pause)


if __name__ == "__main__":
    main()
