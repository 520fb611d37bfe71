"""The bench's trials must not slow each other down through its own cleanup.

On ext4 without a journal (the CI VM) every new inode steps over the inodes
deleted in the last ~35 s, so a bench that deleted each trial's log
directories made the next trial's ``mkdir`` calls several times dearer and
charged that to the launcher that makes directories (torch's layout: 2 + N
per launch).  ``bench.common.retire`` frees a finished trial's data and keeps
its inodes until the run ends.  These tests need the repository's bench/
package and skip without it.
"""
from __future__ import annotations

import os
from pathlib import Path

from bench_helpers import NO_BENCH

pytestmark = NO_BENCH


def _inodes(root: Path) -> dict[str, int]:
    found = {str(root): root.stat().st_ino}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(dirpath, name)
            found[str(path)] = path.lstat().st_ino
    return found


def test_a_retired_trial_keeps_its_inodes_and_frees_its_data(bench_common, tmp_path):
    trial = tmp_path / "launch-x"
    rank = trial / "test_run_id_abc" / "attempt_0" / "0"
    rank.mkdir(parents=True)
    (rank / "stdout.log").write_bytes(b"x" * 200_000)
    (rank / "empty.log").write_bytes(b"")
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"y" * 1000)
    (rank / "link").symlink_to(outside)
    before = _inodes(trial)

    bench_common.retire(str(trial))

    assert _inodes(trial) == before  # nothing deleted, nothing re-created
    assert (rank / "stdout.log").stat().st_size == 0
    assert (rank / "stdout.log").stat().st_blocks == 0
    assert outside.read_bytes() == b"y" * 1000  # a symlink's target is not the trial's


def test_a_trial_scope_retires_its_directory_instead_of_deleting_it(bench_common, tmp_path):
    ctx = bench_common.Ctx({}, {}, quick=True, repeat=1, tmp_root=str(tmp_path), log=lambda *a: None)
    try:
        with bench_common.trial_scope(ctx, "launch") as scope:
            log = Path(scope.dir, "attempt_0", "0", "stdout.log")
            log.parent.mkdir(parents=True)
            log.write_bytes(b"z" * 50_000)
            ino = log.stat().st_ino
        assert log.stat().st_ino == ino
        assert log.stat().st_size == 0
    finally:
        ctx.close()


def test_the_runs_mkdir_probe_keeps_its_directories_for_the_run_to_remove(bench_common, tmp_path):
    # The header's mkdir probe runs just before the first scenario: deleting
    # its directories then would slow that scenario's launches the same way.
    from bench.machine import log_dir_info

    info = log_dir_info(str(tmp_path), count=20, keep=True)
    assert info["mkdir_us_median"] > 0
    [probe] = tmp_path.iterdir()
    assert probe.name.startswith("mkdir-probe-")
    assert sorted(int(p.name) for p in probe.iterdir()) == list(range(20))
