"""The CI's partial test selections (.ci/selections) name tests that exist.

The sanitizer run and the portable round leave out a few test files that run
no C line the rest of their selection does not (measured with .ci/coverage);
everything else, a new test file included, runs there by default.  A renamed
or removed file or test must not leave a stale name behind: a left-out file
that was renamed would come back in unmeasured, a deselected test that was
renamed would run where it cannot pass, and the sdist round's list would
silently shrink.  Skips outside a repository checkout.
"""
from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SELECTIONS = REPO / ".ci" / "selections"

pytestmark = pytest.mark.skipif(not SELECTIONS.is_file(), reason="no .ci/selections (not a repository checkout)")

LISTS = ("SANITIZE_EXCLUDE", "SANITIZE_POLL_EXCLUDE", "SANITIZE_POLL_PART2", "PORTABLE_EXCLUDE", "PORTABLE_DESELECT",
         "SDIST_TESTS")


def _selections() -> dict[str, list[str]]:
    script = "source .ci/selections\n" + "".join(
        f'printf "{name}\\t%s\\n" "${{{name}[@]}}"\n' for name in LISTS)
    out = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, check=True).stdout
    found: dict[str, list[str]] = {name: [] for name in LISTS}
    for line in out.splitlines():
        name, _, value = line.partition("\t")
        found[name] += value.split()
    return found


def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_every_list_is_defined() -> None:
    found = _selections()
    assert found["PORTABLE_DESELECT"], "the portable round deselects the parent-death tests"
    assert found["SDIST_TESTS"], "the sdist round runs some tests"
    assert found["SANITIZE_POLL_PART2"], "the ASan poll round's second part runs some tests"


def test_the_poll_rounds_second_part_runs_what_the_round_runs() -> None:
    # A file of the second part that the round leaves out would be run there
    # all the same (the part names its files), unmeasured by .ci/coverage.
    found = _selections()
    left_out = set(found["SANITIZE_POLL_EXCLUDE"])
    assert not left_out & set(found["SANITIZE_POLL_PART2"]), "SANITIZE_POLL_PART2 names a left-out file"


@pytest.mark.parametrize("name", [n for n in LISTS if n != "PORTABLE_DESELECT"])
def test_listed_test_files_exist(name: str) -> None:
    for entry in _selections()[name]:
        path = REPO / entry
        assert entry.startswith("tests/test_") and path.is_file(), f"{name} in .ci/selections: no test file {entry}"


def test_deselected_tests_exist() -> None:
    for node in _selections()["PORTABLE_DESELECT"]:
        file, _, func = node.partition("::")
        path = REPO / file
        assert path.is_file(), f"PORTABLE_DESELECT in .ci/selections: no test file {file}"
        assert func.split("[")[0] in _test_functions(path), f"PORTABLE_DESELECT in .ci/selections: no test {node}"
