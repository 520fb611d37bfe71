"""How the bench interleaves its rounds (bench.common.interleave): every
impl in alternating order, and a cap on the counted rounds of a slow
baseline (the redirect row runs 60 rounds, torch 15: bench/README.md,
"Noise").  These tests need the repository's bench/ package and skip
without it."""
from __future__ import annotations

import pytest

from bench_helpers import NO_BENCH

pytestmark = NO_BENCH


@pytest.fixture
def bench_common(bench_common, monkeypatch):
    # No untimed trials before quick ones here: these fakes are all quick.
    monkeypatch.setattr(bench_common, "PRE_TRIALS", 0)
    return bench_common


def _run(bench_common, reps, warmup=0, at_most=None, fail=()):
    calls = []

    def trial(impl):
        calls.append(impl)
        if impl in fail:
            raise RuntimeError(f"{impl} broke")
        return {"n": len(calls)}

    errors = []
    out = bench_common.interleave(["a", "b", "torch"], reps, trial, warmup=warmup,
                                  on_error=lambda i, m: errors.append((i, m)), at_most=at_most)
    return calls, out, errors


def test_rounds_alternate_their_order(bench_common):
    calls, out, _ = _run(bench_common, 3)
    assert calls == ["a", "b", "torch", "torch", "b", "a", "a", "b", "torch"]
    assert {impl: [s["n"] for s in samples] for impl, samples in out.items()} == {
        "a": [1, 6, 7], "b": [2, 5, 8], "torch": [3, 4, 9]}


def test_a_capped_impl_runs_its_rounds_first_then_drops_out(bench_common):
    calls, out, _ = _run(bench_common, 4, warmup=1, at_most={"torch": 2})
    # The warm-up round counts for no cap; then torch runs in the first two
    # counted rounds only, the others in all four.
    assert calls == ["a", "b", "torch",
                     "torch", "b", "a",
                     "a", "b", "torch",
                     "b", "a",
                     "a", "b"]
    assert [len(out[i]) for i in ("a", "b", "torch")] == [4, 4, 2]


def test_a_failing_impl_is_dropped_and_reported_once(bench_common):
    calls, out, errors = _run(bench_common, 3, fail=("b",))
    assert calls.count("b") == 1
    assert out["b"] == [] and len(out["a"]) == len(out["torch"]) == 3
    assert errors == [("b", "RuntimeError: b broke")]
