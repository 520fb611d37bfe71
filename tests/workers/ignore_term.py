"""Worker that ignores SIGTERM, announces its pid, then sleeps."""
import os
import signal
import sys
import time

signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(sys.argv[1], "a") as f:
    f.write(f"{os.getpid()}\n")
time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 120)
