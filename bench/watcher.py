"""Exit-time watcher: ``python -m bench.watcher`` (used by bench.common.ExitWatcher).

Protocol on stdin/stdout, one line each:
  in:  "PID PID ...\\n"   -> out: "armed\\n" once a pidfd is open for each pid
  then, once every pid has exited: "PID:NS PID:NS ...\\n" (CLOCK_MONOTONIC ns of
  the exit; -1 when the pid was already gone when the line arrived).
EOF on stdin ends the watcher.
"""

import os
import select
import sys
import time


def _realtime() -> str:
    """Best effort: a SCHED_FIFO watcher is woken at once, so its stamps are precise."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        return "fifo"
    except (OSError, AttributeError):
        return "other"


def main() -> int:
    out = sys.stdout
    _realtime()
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        pids = [int(p) for p in line.split()]
        ep = select.epoll()
        fds = {}
        stamps = {}
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                stamps[pid] = -1
                continue
            fds[fd] = pid
            ep.register(fd, select.EPOLLIN)
        out.write("armed\n")
        out.flush()
        while fds:
            for fd, _ in ep.poll():
                t = time.monotonic_ns()
                pid = fds.pop(fd)
                stamps[pid] = t
                ep.unregister(fd)
                os.close(fd)
        ep.close()
        out.write(" ".join(f"{p}:{stamps[p]}" for p in pids) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
