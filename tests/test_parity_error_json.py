"""Parity with torch: error.json, the root cause and the report layout.

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
import re



import pytest

from parity_helpers import PY, launched, wait_result

pytestmark = pytest.mark.usefixtures("multiprocessing_helpers", "restore_signal_handlers")


# ================================================================================
# error.json: root cause and the report
# ================================================================================

ROOT_CAUSE_WORKER = """\
import os, signal, sys, time
from {errors_module} import record


@record
def main():
    rank = sys.argv[1]
    own_dir = os.path.dirname(os.environ["TORCHELASTIC_ERROR_FILE"])
    if rank == "1":
        with open(os.path.join(own_dir, "pid.tmp"), "w") as f:
            f.write(str(os.getpid()))
        os.rename(os.path.join(own_dir, "pid.tmp"), os.path.join(own_dir, "pid"))
        # fail first, once rank 0 is ready to outlive fail-fast's SIGTERM
        while not os.path.exists(os.path.join(own_dir, "..", "0", "ready")):
            time.sleep(0.01)
        raise RuntimeError("rank 1 failed first")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(os.path.join(own_dir, "ready"), "w").close()
    # Until rank 1 has exited, not only written its error file: the exit of
    # an interpreter that imported torch can take longer on a loaded machine
    # than the sleep below, and the launcher must see rank 1's exit first.
    # Both ranks are children of the launcher, so rank 1's pid stays a
    # zombie (not another process) until the launcher reaps it -- which it
    # may do at the exit (the early reap): then the stat file is gone, or
    # goes between its open and its read (ESRCH).
    pid_file = os.path.join(own_dir, "..", "1", "pid")
    while not os.path.exists(pid_file):
        time.sleep(0.01)
    with open(pid_file) as f:
        pid = int(f.read())
    while True:
        try:
            with open(f"/proc/{{pid}}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        except (FileNotFoundError, ProcessLookupError):
            break
        time.sleep(0.01)
    time.sleep(1.1 - time.time() % 1)  # a later whole second than rank 1's
    raise RuntimeError("rank 0 failed later")


if __name__ == "__main__":
    main()
"""

def expected_failure(rank: int, message: str) -> str:
    """One rank's entry in torch 2.13's report of that run, masked."""
    return f"""[{rank}]:
  time      : <TIME>
  host      : <HOST>
  rank      : {rank} (local_rank: {rank})
  exitcode  : 1 (pid: <PID>)
  error_file: <ERROR_FILE>
  traceback : Traceback (most recent call last):
    File "<PATH>", line <N>, in wrapper
      return f(*args, **kwargs)
             ^^^^^^^^^^^^^^^^^^
    File "<PATH>", line <N>, in main
      raise RuntimeError("{message}")
  RuntimeError: {message}
"""


# torch 2.13's report for that run, ranks in order, with the variable parts
# masked (see mask_report).
EXPECTED_REPORT = f"""
============================================================
rootcause FAILED
------------------------------------------------------------
Failures:
{expected_failure(0, "rank 0 failed later")}
------------------------------------------------------------
Root Cause (first observed failure):
{expected_failure(1, "rank 1 failed first")}
============================================================"""


def mask_report(text: str) -> str:
    text = re.sub(r"(?m)^(  time      : ).*$", r"\1<TIME>", text)
    text = re.sub(r"(?m)^(  host      : ).*$", r"\1<HOST>", text)
    text = re.sub(r"\(pid: \d+\)", "(pid: <PID>)", text)
    text = re.sub(r"(?m)^(  error_file: ).*$", r"\1<ERROR_FILE>", text)
    text = re.sub(r'File "[^"]*", line \d+', 'File "<PATH>", line <N>', text)
    # DELIBERATE DIFFERENCE: torchmp marks the ranks it killed after the
    # first failure (rank 0 here got fail-fast's SIGTERM, ignored it and
    # failed on its own a second later); torch has no such marker.
    return text.replace(" [terminated by launcher]", "")


def test_error_json_root_cause_and_report(impl, tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(ROOT_CAUSE_WORKER.format(errors_module=impl.errors_module))
    log_dir = tmp_path / "logs"
    with launched(impl, "rootcause", PY, {0: (str(worker), 0), 1: (str(worker), 1)},
                  log_dir=log_dir) as pc:
        pids = pc.pids()
        # Both workers import torch (its errors module) before anything
        # else: seconds each, tens of seconds on a loaded CI machine.  The
        # bound is only against a hang.
        result = wait_result(pc, timeout=120)
    assert result is not None
    assert sorted(result.failures) == [0, 1]
    f0, f1 = result.failures[0], result.failures[1]
    assert (f0.pid, f0.exitcode, f1.pid, f1.exitcode) == (pids[0], 1, pids[1], 1)
    for rank, f in ((0, f0), (1, f1)):
        assert fnmatch.fnmatch(f.error_file, f"{log_dir}/test_run_id_*/attempt_0/{rank}/error.json")
        assert f.message["message"] == f"RuntimeError: rank {rank} " + (
            "failed later" if rank == 0 else "failed first")
        assert f.timestamp == int(f.message["extraInfo"]["timestamp"])
    assert f1.timestamp < f0.timestamp
    # Both orders of the failures dict pick the same root cause.
    for failures in (result.failures, {1: f1, 0: f0}, {0: f0, 1: f1}):
        err = impl.ChildFailedError("rootcause", failures)
        rank, first = err.get_first_failure()
        assert (rank, first) == (1, f1)
    report = impl.ChildFailedError("rootcause", {0: f0, 1: f1}).format_msg()
    masked = mask_report(report)
    # Lines compared without trailing blanks (the template leaves a space
    # after "(pid: ...)" when there is no signal name, and the indented
    # traceback ends in "  "): that exact spacing is checked once here.
    assert [ln.rstrip() for ln in masked.split("\n")] == EXPECTED_REPORT.split("\n")
    assert masked.count("  exitcode  : 1 (pid: <PID>) \n") == 2
    assert f"error_file: {f1.error_file}\n" in report
    assert str(impl.ChildFailedError("rootcause", {0: f0, 1: f1})) == report


def test_error_file_round_trip(impl, tmp_path, monkeypatch):
    """ErrorHandler writes, ProcessFailure reads: torch's JSON shape, and a
    hand-written file of the plain {"message": str} shape."""
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    try:
        raise KeyError("missing")
    except KeyError as e:
        impl.ErrorHandler().record_exception(e)
    f = impl.ProcessFailure(local_rank=2, pid=1234, exitcode=1, error_file=str(error_file))
    assert f.error_file == str(error_file)
    assert f.message["message"] == "KeyError: 'missing'"
    assert f.message["extraInfo"]["py_callstack"].endswith("KeyError: 'missing'\n")
    assert f.timestamp == int(f.message["extraInfo"]["timestamp"])

    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"message": "by hand", "timestamp": 1700000000}))
    g = impl.ProcessFailure(local_rank=0, pid=1, exitcode=-6, error_file=str(plain))
    assert (g.message, g.timestamp, g.signal_name()) == ("by hand", 1700000000, "SIGABRT")
    plain.write_text(json.dumps({"message": "no time"}))
    h = impl.ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(plain))
    assert (h.message, h.timestamp) == ("no time", 0)
    # the plain shape's message is shown as is
    report = impl.ChildFailedError("x", {0: g}).format_msg()
    assert "  traceback : by hand\n" in report
    # torch's template puts a space before the " (SIGABRT)" it builds: two spaces
    assert "  exitcode  : -6 (pid: 1)  (SIGABRT)\n" in report
