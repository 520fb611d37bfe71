"""Fixtures of the bench's own tests (tests/test_bench_*.py): the
repository's bench/ package, imported from beside tests/.  Those modules
skip without it (an installed wheel's tests have no bench/)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
NO_BENCH = pytest.mark.skipif(not (REPO / "bench" / "common.py").is_file(), reason="no bench/ beside tests/")


@pytest.fixture
def bench_common():
    sys.path.insert(0, str(REPO))
    try:
        import bench.common
        yield bench.common
    finally:
        sys.path.remove(str(REPO))
