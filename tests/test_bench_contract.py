"""The bench's ``-contract`` launchers (issue 22): the careful stdlib
launcher (``stdlib-contract``) and the floor (``floor-contract``) doing,
with the stdlib's own calls, what torch's API promises beyond the spawn, so
that a run can show what those promises cost beside the ``stdlib`` and
``floor`` columns.  They are measured only when ``--impl`` names them.
These tests need the repository's bench/ package and skip without it."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from bench_helpers import NO_BENCH

pytestmark = NO_BENCH

CONTRACT_IMPLS = ["stdlib-contract", "floor-contract"]


@pytest.fixture(autouse=True)
def bench_impls(bench_impls):
    yield bench_impls
    # The launcher keeps two descriptors for its OOM baseline, as torchmp
    # does, for the life of the process: not past a test.
    if bench_impls._oom_counter is not None:
        bench_impls._oom_counter.close()
        bench_impls._oom_counter = None


def _gone(pid: int) -> bool:
    """Dead: no such process, or a zombie (reaped here if it is ours)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    if state in ("Z", "X"):
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        return True
    return False


@pytest.mark.parametrize("name", CONTRACT_IMPLS)
def test_it_is_measured_only_when_named(bench_impls, name):
    assert name in bench_impls.ALL_IMPLS
    assert name not in bench_impls.DEFAULT_IMPLS
    assert bench_impls.DEFAULT_IMPLS == ["torchmp", "stdlib", "floor", "torch", "torch-p01"]
    impl = bench_impls.make(name)
    assert impl.name == name
    assert impl.check() is None


@pytest.mark.parametrize("name", CONTRACT_IMPLS)
def test_a_missing_binary_fails_before_anything_is_made(bench_impls, tmp_path, name):
    impl = bench_impls.make(name)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(FileNotFoundError, match="torchmp-no-such-binary"):
        impl.start_binary("torchmp-no-such-binary", {0: ()}, {0: {}}, str(tmp_path))
    with pytest.raises(FileNotFoundError):
        impl.start_binary(str(tmp_path / "nothing-here"), {0: ()}, {0: {}}, str(tmp_path))
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) is before
    with pytest.raises(ChildProcessError):  # no child was started
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)


@pytest.mark.parametrize("name", CONTRACT_IMPLS)
def test_a_spawn_that_fails_puts_the_handlers_back(bench_impls, tmp_path, name):
    """Found and executable, but no program: the exec fails after the
    handlers are in, and they are put back; no child is left."""
    impl = bench_impls.make(name)
    bogus = tmp_path / "bogus"
    bogus.write_bytes(b"\x00\x01 not a program\n")
    bogus.chmod(0o755)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(OSError):
        impl.start_binary(str(bogus), {0: ()}, {0: {}}, str(tmp_path / "logs"))
    assert signal.getsignal(signal.SIGTERM) is before
    with pytest.raises(ChildProcessError):
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)


@pytest.mark.parametrize("name", CONTRACT_IMPLS)
def test_it_lays_out_torchs_directories_and_error_file(bench_impls, tmp_path, name):
    impl = bench_impls.make(name)
    log_dir = tmp_path / "logs"  # made as torch's DefaultLogsSpecs makes it
    job = impl.start_binary("/bin/sh", {0: ("-c", 'printf "%s" "$TORCHELASTIC_ERROR_FILE"'), 1: ("-c", "exit 0")},
                            {0: {}, 1: {}}, str(log_dir), redirects=1, name="lay")
    try:
        out = job.wait(30)
    finally:
        job.close(5)
    assert not out.failed
    (run,) = log_dir.iterdir()
    assert run.name.startswith("lay_")
    attempt = run / "attempt_0"
    assert sorted(p.name for p in attempt.iterdir()) == ["0", "1"]
    assert out.stdouts == {0: str(attempt / "0" / "stdout.log"), 1: str(attempt / "1" / "stdout.log")}
    assert (attempt / "0" / "stdout.log").read_bytes() == str(attempt / "0" / "error.json").encode()
    assert (attempt / "1" / "stdout.log").read_bytes() == b""


@pytest.mark.parametrize("name", CONTRACT_IMPLS)
def test_its_handlers_are_torchs_four_and_are_put_back_at_close(bench_impls, tmp_path, name):
    impl = bench_impls.make(name)
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    before = {n: signal.getsignal(getattr(signal, n)) for n in names}
    job = impl.start_binary("/bin/true", {0: ()}, {0: {}}, str(tmp_path))
    try:
        during = {n: signal.getsignal(getattr(signal, n)) for n in names}
        job.wait(30)
    finally:
        job.close(5)
    assert all(during[n] is bench_impls._signal_exit for n in names)
    assert {n: signal.getsignal(getattr(signal, n)) for n in names} == before


@pytest.mark.parametrize("name", CONTRACT_IMPLS)
def test_wait_signals_what_a_rank_left_in_its_group(bench_impls, tmp_path, name):
    impl = bench_impls.make(name)
    job = impl.start_binary("/bin/sh", {0: ("-c", "sleep 30 & echo $!; exit 0")}, {0: {}}, str(tmp_path),
                            redirects=1)
    stray = None
    try:
        out = job.wait(30)
        stray = int(Path(out.stdouts[0]).read_text())
        deadline = time.monotonic() + 5
        while not _gone(stray) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _gone(stray), "the rank's background sleep outlived wait()"
    finally:
        job.close(5)
        if stray is not None and not _gone(stray):
            os.kill(stray, signal.SIGKILL)
