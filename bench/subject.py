"""Which torchmp the bench measures, and a loud refusal when there is none.

``python -m bench`` runs from the repository root, so the interpreter puts the
root first on ``sys.path`` and ``import torchmp`` would find the source tree,
which has no compiled core after ``pip install .``.  A bench whose subject is
missing must not quietly measure only the others, so the subject is chosen by
one rule, checked by importing its compiled core, and then pinned for every
process of the run:

* the cwd entry that ``-m``/``-c``/a script puts first on ``sys.path`` is not
  searched: ``python -m bench`` measures the torchmp the interpreter would
  import from anywhere else, i.e. the one on ``PYTHONPATH`` (a developer's
  in-place build: ``PYTHONPATH=$PWD``) or else the installed one;
* the first ``torchmp`` package on that path is the subject.  If it cannot
  import ``torchmp._core`` (an unbuilt source tree, a core of another
  version), the bench refuses with the reason and how to build; it never falls
  back to another copy further down the path;
* the chosen package's parent directory goes first on ``sys.path`` and, through
  ``BENCH_TORCHMP_HOME``, on the path of every bench process started later
  (``bench/__init__.py`` reads it), so launchers in child processes measure the
  same files.  torchmp's own function workers already import the launcher's
  torchmp.

``BENCH_TORCHMP_MODULE`` (another module with torch's API) makes that module
the subject instead; it too must import, or the bench refuses.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
from dataclasses import dataclass

HOME_VAR = "BENCH_TORCHMP_HOME"
BUILD_HINT = (
    "install it (pip install .) and run python -m bench from the repository root, or build it in place "
    "(python setup.py build_ext --inplace) and run PYTHONPATH=$PWD python -m bench"
)


class SubjectMissing(RuntimeError):
    """The module the bench is meant to measure cannot be imported as a working package."""


@dataclass(frozen=True)
class Subject:
    module: str  # what ApiImpl imports ("torchmp", or BENCH_TORCHMP_MODULE)
    path: str  # the package directory (resolved)
    version: str
    core: str | None  # the compiled core's file, for torchmp

    def describe(self) -> str:
        core = f", core {self.core}" if self.core else ""
        return f"{self.module} {self.version} from {self.path}{core}"


def search_path() -> list[str]:
    """sys.path without the entry the interpreter added for the cwd or the script's directory
    (a pin that bench/__init__.py put before that entry stays first)."""
    path = list(sys.path)
    home = os.environ.get(HOME_VAR)
    pinned = bool(home) and path[:1] == [home]
    if pinned:
        path = path[1:]
    if not getattr(sys.flags, "safe_path", False):  # -P / PYTHONSAFEPATH: there is no such entry
        path = path[1:]
    return ([home] if pinned and home else []) + path


def _core_files(pkg_dir: str) -> list[str]:
    try:
        names = os.listdir(pkg_dir)
    except OSError:
        return []
    return sorted(n for n in names
                  if n.startswith("_core.") and any(n.endswith(s) for s in importlib.machinery.EXTENSION_SUFFIXES))


def locate(path: list[str]) -> str:
    """The directory of the first torchmp package on ``path``; SubjectMissing if there is none
    or if that one has no compiled core (never a copy further down)."""
    spec = importlib.machinery.PathFinder.find_spec("torchmp", path)
    if spec is None or not spec.submodule_search_locations:
        raise SubjectMissing(f"torchmp is not installed and not on PYTHONPATH: {BUILD_HINT}")
    pkg_dir = os.path.realpath(list(spec.submodule_search_locations)[0])
    if not _core_files(pkg_dir):
        raise SubjectMissing(f"the torchmp at {pkg_dir} has no compiled core (torchmp/_core*.so): {BUILD_HINT}")
    return pkg_dir


def pin(pkg_dir: str) -> None:
    """Make ``import torchmp`` find pkg_dir, here and in every bench process started later."""
    home = os.path.dirname(pkg_dir)
    if sys.path[:1] != [home]:
        sys.path.insert(0, home)
    os.environ[HOME_VAR] = home


def check_imported(mod, pkg_dir: str) -> str:
    """The core's file once torchmp (already imported as ``mod``) is the one at pkg_dir and its core imports."""
    got = os.path.realpath(os.path.dirname(mod.__file__ or ""))
    if got != pkg_dir:
        raise SubjectMissing(f"imported torchmp from {got}, expected {pkg_dir} (another copy shadows it on sys.path)")
    try:
        core = importlib.import_module("torchmp._core")
    except ImportError as e:
        raise SubjectMissing(f"the torchmp at {pkg_dir} cannot import its compiled core: {e}: {BUILD_HINT}") from e
    return os.path.realpath(core.__file__ or "?")


def resolve(module: str) -> Subject:
    """Find, pin and import the subject; SubjectMissing with the reason if it is not usable."""
    if module != "torchmp":
        try:
            mod = importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - any import failure means the subject is missing
            raise SubjectMissing(f"cannot import {module} (BENCH_TORCHMP_MODULE): {type(e).__name__}: {e}") from e
        top = importlib.import_module(module.split(".")[0])
        return Subject(module, os.path.dirname(os.path.realpath(mod.__file__ or "?")),
                       str(getattr(top, "__version__", "?")), None)
    pkg_dir = locate(search_path())
    pin(pkg_dir)
    if "torchmp" in sys.modules:  # imported before the pin (e.g. by a test harness): must be the same one
        mod = sys.modules["torchmp"]
    else:
        try:
            mod = importlib.import_module("torchmp")
        except Exception as e:  # noqa: BLE001 - e.g. the core/version check at import
            raise SubjectMissing(f"cannot import the torchmp at {pkg_dir}: {type(e).__name__}: {e}") from e
    core = check_imported(mod, pkg_dir)
    return Subject("torchmp", pkg_dir, str(getattr(mod, "__version__", "?")), core)
