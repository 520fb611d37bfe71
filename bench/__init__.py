"""torchmp benchmark suite: ``python -m bench [--quick] [--only ...] [--impl ...]``.

Measures torchmp side by side with a careful stdlib launcher, the bare
posix_spawn/pidfd floor and torch's own module, in one run, repetitions
interleaved, medians and ratios reported.  See bench/README.md.
"""

import os as _os
import sys as _sys

# Processes the bench starts (python -m bench.child, the watcher) import the
# torchmp the parent chose (bench/subject.py), not the one their cwd entry on
# sys.path would find first.
_home = _os.environ.get("BENCH_TORCHMP_HOME")
if _home and _sys.path[:1] != [_home]:
    _sys.path.insert(0, _home)

__all__ = ["main"]


def main(argv=None):
    from bench.cli import main as _main

    return _main(argv)
