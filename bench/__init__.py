"""torchmp benchmark suite: ``python -m bench [--quick] [--only ...] [--impl ...]``.

Measures torchmp side by side with a careful stdlib launcher, the bare
posix_spawn/pidfd floor and torch's own module, in one run, repetitions
interleaved, medians and ratios reported.  See bench/README.md.
"""

__all__ = ["main"]


def main(argv=None):
    from bench.cli import main as _main

    return _main(argv)
