"""The ``torchmp`` command (also ``python -m torchmp``).

::

    torchmp run -n 4 -- python train.py        # n copies on this host
    torchmp torchrun --nproc-per-node 4 train.py  # torchrun, workers run by torchmp

``torchmp run`` is :mod:`torchmp.cli`; ``torchmp torchrun`` is
:mod:`torchmp.torchrun` and takes exactly ``torchrun``'s arguments (it needs
PyTorch; nothing else here does).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]

_COMMANDS = {
    "run": "launch N copies of a command on this host (see 'torchmp run -h')",
    "torchrun": "run torchrun with torchmp managing the workers "
                "(takes torchrun's arguments; needs PyTorch)",
}


def _top_parser() -> argparse.ArgumentParser:
    from torchmp import __version__

    p = argparse.ArgumentParser(
        prog="torchmp",
        description="Launch and manage n copies of a worker process.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n" + "\n".join(f"  {k:<10}{v}" for k, v in _COMMANDS.items()),
    )
    p.add_argument("--version", action="version", version=f"torchmp {__version__}")
    p.add_argument("command", choices=sorted(_COMMANDS), metavar="COMMAND",
                   help="one of: " + ", ".join(_COMMANDS) + "; its arguments follow")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch ``torchmp COMMAND ...``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "torchrun":
        # Every argument belongs to torchrun's own parser (including -h).
        from torchmp import torchrun

        return torchrun.main(argv[1:], prog="torchmp torchrun")
    if argv and argv[0] == "run":
        from torchmp.cli import main as run_main

        return run_main(argv[1:], prog="torchmp run")
    _top_parser().parse_args(argv)  # prints help/version/usage errors and exits
    return 2  # pragma: no cover - parse_args exits for anything but run/torchrun


if __name__ == "__main__":
    sys.exit(main())
