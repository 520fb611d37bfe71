"""Parity with torch: redirect and tee file layout and bytes, the teed console (in a
driver subprocess), duplicate filters, the run id layout and start errors.

Every test takes the ``impl`` fixture (tests/parity_helpers.py), which is
torchmp always and torch's ``torch.distributed.elastic.multiprocessing`` when
torch is importable (the uvloop pattern: one test body, two loops).  The
expected values are torch 2.13's behaviour, observed, not read off torchmp;
where torchmp differs on purpose the test says so in a comment and asserts
each side's value (those differences are listed in docs/compat.md).
"""
from __future__ import annotations

import fnmatch
import json
import os
from pathlib import Path

import pytest


from parity_helpers import PY, attempt_dir_of, finish_driver, launched, popen_driver, py_args, wait_result

pytestmark = pytest.mark.usefixtures("multiprocessing_helpers", "restore_signal_handlers")


# ================================================================================
# redirects and tee: file layout and bytes
# ================================================================================

STREAMS_CODE = """
    import sys
    r = sys.argv[1]
    print("a" + r)
    print("b" + r, file=sys.stderr)
    print("c" + r)
"""


@pytest.mark.parametrize("config", ["redirect_all", "redirect_rank0_out", "tee_err_redirect_out"])
def test_redirect_tee_layout_and_bytes(impl, tmp_path, config):
    Std = impl.Std
    kw = {
        "redirect_all": {"redirects": Std.ALL},
        "redirect_rank0_out": {"redirects": {0: Std.OUT}},
        "tee_err_redirect_out": {"redirects": Std.OUT, "tee": Std.ERR},
    }[config]
    log_dir = tmp_path / "logs"
    with launched(impl, "rd", PY, py_args(STREAMS_CODE, 2), log_dir=log_dir, **kw) as pc:
        result = wait_result(pc, timeout=30)
    assert not result.is_failed()
    (run_dir,) = os.listdir(log_dir)
    assert fnmatch.fnmatch(run_dir, "test_run_id_*")
    attempt = log_dir / run_dir / "attempt_0"
    assert sorted(os.listdir(log_dir / run_dir)) == ["attempt_0"]
    assert sorted(os.listdir(attempt)) == ["0", "1"]

    def path(rank, stream):
        return str(attempt / str(rank) / f"{stream}.log")

    expected_out = {
        "redirect_all": {0: path(0, "stdout"), 1: path(1, "stdout")},
        "redirect_rank0_out": {0: path(0, "stdout"), 1: ""},
        "tee_err_redirect_out": {0: path(0, "stdout"), 1: path(1, "stdout")},
    }[config]
    expected_err = {
        "redirect_all": {0: path(0, "stderr"), 1: path(1, "stderr")},
        "redirect_rank0_out": {0: "", 1: ""},
        "tee_err_redirect_out": {0: path(0, "stderr"), 1: path(1, "stderr")},
    }[config]
    assert result.stdouts == expected_out
    assert result.stderrs == expected_err
    for rank in (0, 1):
        files = sorted(os.listdir(attempt / str(rank)))
        expected_files = sorted(
            os.path.basename(p) for p in (expected_out[rank], expected_err[rank]) if p)
        assert files == expected_files  # no error.json: nothing failed
        if expected_out[rank]:
            assert Path(expected_out[rank]).read_bytes() == f"a{rank}\nc{rank}\n".encode()
        if expected_err[rank]:
            assert Path(expected_err[rank]).read_bytes() == f"b{rank}\n".encode()


TEE_DRIVER = """
    log_dir, prefixes, only = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    prefixes = {int(k): v for k, v in prefixes.items()} if prefixes is not None else None
    code = "import sys; r = sys.argv[1]; print('a' + r); print('b' + r, file=sys.stderr); print('c' + r)"
    specs = DefaultLogsSpecs(log_dir=log_dir, tee=Std.ALL,
                             local_ranks_filter=set(only) if only is not None else None)
    pc = start_processes("trainer", PY, {0: ("-c", code, 0), 1: ("-c", code, 1)}, {0: {}, 1: {}},
                         specs, log_line_prefixes=prefixes)
    result = pc.wait(period=0.05)
    pc.close()
    sys.stdout.flush()
    print("RESULT " + json.dumps({"failed": result.is_failed(), "stdouts": result.stdouts,
                                  "stderrs": result.stderrs}), flush=True)
"""


@pytest.mark.parametrize("prefixes, only", [(None, None), ({"0": "[r0]:"}, None), (None, [1])],
                         ids=["default", "custom_rank0", "local_ranks_filter_1"])
def test_tee_console_lines(impl, tmp_path, prefixes, only):
    proc = popen_driver(impl, tmp_path, TEE_DRIVER, str(tmp_path / "logs"), json.dumps(prefixes),
                        json.dumps(only))
    out, err = finish_driver(proc)
    assert proc.returncode == 0, err
    result = json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:])
    assert result["failed"] is False
    prefix = {0: "[r0]:" if prefixes else "[trainer0]:", 1: "[trainer1]:"}
    shown = [0, 1] if only is None else only
    out_lines = [ln for ln in out.splitlines() if ln.startswith("[")]
    err_lines = [ln for ln in err.splitlines() if ln.startswith("[")]
    assert sorted(out_lines) == sorted(f"{prefix[r]}{x}{r}" for r in shown for x in "ac")
    assert sorted(err_lines) == sorted(f"{prefix[r]}b{r}" for r in shown)
    # each rank's lines keep their order
    for r in shown:
        assert [ln for ln in out_lines if ln.startswith(prefix[r])] == [f"{prefix[r]}a{r}", f"{prefix[r]}c{r}"]
    # the files hold the bytes, without prefixes -- for the ranks the filter
    # keeps off the console too
    for rank in (0, 1):
        assert Path(result["stdouts"][str(rank)]).read_bytes() == f"a{rank}\nc{rank}\n".encode()
        assert Path(result["stderrs"][str(rank)]).read_bytes() == f"b{rank}\n".encode()


TEE_EDGES_DRIVER = r"""
    code = "import os, sys; os.write(1, b'x\\xff\\xfey\\n'); sys.stdout.write('partial'); sys.stdout.flush()"
    pc = start_processes("trainer", PY, {0: ("-c", code)}, {0: {}},
                         DefaultLogsSpecs(log_dir=sys.argv[1], tee=Std.OUT))
    result = pc.wait(period=0.05)
    pc.close()
    print("END", flush=True)
    print(result.stdouts[0], file=sys.stderr)
"""


def test_tee_non_utf8_and_final_partial_line(impl, tmp_path):
    """DELIBERATE DIFFERENCES (README "What it does differently"): torchmp's
    console gets the worker's bytes untouched where torch's tailer decodes
    with errors="replace" (U+FFFD for each bad byte); and torchmp ends a
    final line that has no newline, where torch leaves the console in the
    middle of that line (the next output continues it).  The file holds the
    exact bytes both ways."""
    proc = popen_driver(impl, tmp_path, TEE_EDGES_DRIVER, str(tmp_path / "logs"))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    log = err.decode().strip().splitlines()[-1]
    assert Path(log).read_bytes() == b"x\xff\xfey\npartial"
    if impl.name == "torch":
        assert out == b"[trainer0]:x\xef\xbf\xbd\xef\xbf\xbdy\n[trainer0]:partialEND\n"
    else:
        assert out == b"[trainer0]:x\xff\xfey\n[trainer0]:partial\nEND\n"


def test_duplicate_filters_files(impl, tmp_path):
    code = """
        import sys
        r = sys.argv[1]
        print("keep a" + r)
        print("drop b" + r)
        print("keep e" + r, file=sys.stderr)
    """
    with launched(impl, "dup", PY, py_args(code, 2), log_dir=tmp_path, redirects=impl.Std.ALL,
                  tee={0: impl.Std.ALL}, duplicate_stdout_filters=["keep"],
                  duplicate_stderr_filters=["keep"]) as pc:
        result = wait_result(pc, timeout=30)
    assert not result.is_failed()
    attempt = Path(attempt_dir_of(result.stdouts[0]))
    assert sorted(os.listdir(attempt)) == ["0", "1", "filtered_stderr.log", "filtered_stdout.log"]
    # only teed ranks are filtered, with their prefix
    assert (attempt / "filtered_stdout.log").read_bytes() == b"[dup0]:keep a0\n"
    assert (attempt / "filtered_stderr.log").read_bytes() == b"[dup0]:keep e0\n"
    assert Path(result.stdouts[1]).read_bytes() == b"keep a1\ndrop b1\n"


def test_run_id_and_restart_count_layout(impl, tmp_path):
    code = "import os; print(os.environ['TORCHELASTIC_ERROR_FILE'])"
    envs = {0: {"TORCHELASTIC_RUN_ID": "myrun", "TORCHELASTIC_RESTART_COUNT": "2"}, 1: {}}
    with launched(impl, "ids", PY, py_args(code, 2), envs, log_dir=tmp_path,
                  redirects=impl.Std.OUT) as pc:
        result = wait_result(pc, timeout=30)
    (run_dir,) = os.listdir(tmp_path)
    assert fnmatch.fnmatch(run_dir, "myrun_*")
    attempt = tmp_path / run_dir / "attempt_2"
    for rank in (0, 1):
        assert result.stdouts[rank] == str(attempt / str(rank) / "stdout.log")
        # every rank's TORCHELASTIC_ERROR_FILE, from envs[0]'s ids
        assert Path(result.stdouts[rank]).read_text() == f"{attempt / str(rank) / 'error.json'}\n"
    assert result.stderrs == {0: "", 1: ""}


def test_start_errors(impl, tmp_path):
    specs = impl.DefaultLogsSpecs(log_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError) as e:
        impl.start_processes("x", str(tmp_path / "missing"), {0: ()}, {0: {}}, specs)
    assert e.value.errno == 2
    with pytest.raises(PermissionError) as e:
        impl.start_processes("x", "/etc/passwd", {0: ()}, {0: {}}, specs)
    assert e.value.errno == 13
    # The messages differ (torchmp names the missing and unexpected ranks);
    # the type both are caught as is torch's RuntimeError.
    with pytest.raises(RuntimeError, match="envs"):
        impl.start_processes("x", "true", {0: (), 1: ()}, {0: {}}, specs)
    with pytest.raises(RuntimeError, match="args"):
        impl.start_processes("x", "true", {0: (), 2: ()}, {0: {}, 2: {}}, specs)
