"""One launch seam (issue 21, item 3): torchmp/_launch/ is the only Python
code that drives the core's launch calls -- Group's spawn, fork and
forkserver calls and the one-command start -- so the contexts, run and
run_async only pick a strategy, observe, reap and report."""
from __future__ import annotations

import ast
from pathlib import Path

import torchmp
from torchmp import _core

PACKAGE = Path(torchmp.__file__).parent
SEAM = PACKAGE / "_launch"

# What starts a process, or hands one to a group: Group's launch calls and
# the one-command start.  (Observing, signalling and reaping -- snapshot,
# wait, killpg, busy, reap -- stay with the contexts.)
LAUNCH_CALLS = {"spawn", "prepare", "fork_rank", "forkserver_fork", "close_worker_fds", "adopt",
                "adopt_forked", "drop_unstarted", "start_command"}


def _launch_calls(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.ImportFrom) and node.module in ("torchmp._core", "torchmp"):
            name = next((a.name for a in node.names if a.name in LAUNCH_CALLS), None)
        if name in LAUNCH_CALLS:
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {name}")
    return found


def test_the_names_checked_are_the_cores_launch_calls():
    # A rename in the core must not make the check below vacuous.
    for name in LAUNCH_CALLS - {"start_command"}:
        assert callable(getattr(_core.Group, name)), name
    assert callable(_core.start_command)


def test_only_the_launch_package_drives_the_cores_launch_calls():
    outside = [p for p in sorted(PACKAGE.rglob("*.py")) if SEAM not in p.parents]
    assert len(outside) > 10  # the whole package is looked at
    offenders = [hit for p in outside for hit in _launch_calls(p)]
    assert offenders == [], "launch calls outside torchmp/_launch/:\n" + "\n".join(offenders)


def test_every_start_method_and_the_command_live_in_the_seam():
    seam_calls = {hit.rsplit(": ", 1)[1] for p in SEAM.rglob("*.py") for hit in _launch_calls(p)}
    # exec (spawn), fork (fork_rank), forkserver (forkserver_fork), run (start_command)
    assert {"spawn", "fork_rank", "forkserver_fork", "start_command"} <= seam_calls, seam_calls
