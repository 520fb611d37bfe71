"""Fixtures of the bench's own tests (tests/test_bench_*.py): the
repository's bench/ package, imported from beside tests/.  Those modules
skip without it (an installed wheel's tests have no bench/)."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
NO_BENCH = pytest.mark.skipif(not (REPO / "bench" / "common.py").is_file(), reason="no bench/ beside tests/")


def _bench_module(name: str):
    sys.path.insert(0, str(REPO))
    try:
        yield importlib.import_module(f"bench.{name}")
    finally:
        sys.path.remove(str(REPO))


@pytest.fixture
def bench_common():
    yield from _bench_module("common")


@pytest.fixture
def bench_impls():
    yield from _bench_module("impls")
