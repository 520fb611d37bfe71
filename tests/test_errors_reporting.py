"""Tests for torchmp.errors, reporting: ChildFailedError's root cause and report,
@record, and interoperability with torch's error files.

The reading contract is a mixin run against torchmp's ProcessFailure always and
torch's when torch is importable, so any drift from the reference shows up as a
failing torch-side test. Everything else pins torchmp's own guarantees (atomic
writes, defensive reads, nanosecond ordering) with exact values.  Shared
fixtures and builders: tests/errors_helpers.py.
"""
from __future__ import annotations

import json
import logging
import os
import re
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

import torchmp.errors as errors
from torchmp.errors import (
    ChildFailedError,
    ErrorHandler,
    ProcessFailure,
    record,
)

from errors_helpers import LINK_MSG, TS, nested, raised, write_json

pytestmark = pytest.mark.usefixtures("_fake_faulthandler")


# ---------------------------------------------------------------- ChildFailedError


def _fail(tmp_path: Path, rank: int, *, ts_ns: int | None = None, file_ns: int | None = None,
          exitcode: int = 1, terminated: bool = False, file_ts: int = TS) -> ProcessFailure:
    path = tmp_path / f"{rank}.json"
    if file_ns is not None:
        write_json(path, nested(f"ValueError: rank {rank}", ts=file_ts, ts_ns=file_ns))
    return ProcessFailure(rank, 1000 + rank, exitcode, str(path), timestamp_ns=ts_ns,
                          terminated_by_launcher=terminated)


class TestRootCause:
    def test_same_second_ordered_by_error_file_ns(self, tmp_path: Path) -> None:
        failures = {
            0: _fail(tmp_path, 0, file_ns=TS * 10**9 + 900_000_000),
            1: _fail(tmp_path, 1, file_ns=TS * 10**9 + 100_000_000),
        }
        assert failures[0].timestamp == failures[1].timestamp == TS  # a tie for torch
        rank, failure = ChildFailedError("trainer", failures).get_first_failure()
        assert (rank, failure) == (1, failures[1])

    def test_same_second_ordered_by_launcher_ns(self, tmp_path: Path) -> None:
        failures = {
            0: _fail(tmp_path, 0, ts_ns=TS * 10**9 + 2, exitcode=-9),
            1: _fail(tmp_path, 1, ts_ns=TS * 10**9 + 1, exitcode=-11),
        }
        assert ChildFailedError("t", failures).get_first_failure()[0] == 1

    def test_terminated_by_launcher_is_never_root_cause(self, tmp_path: Path) -> None:
        failures = {
            # the sibling's own error file (SignalException recorded) is even earlier
            0: _fail(tmp_path, 0, file_ns=TS * 10**9, exitcode=-15, terminated=True),
            1: _fail(tmp_path, 1, ts_ns=TS * 10**9 + 500),
            2: _fail(tmp_path, 2, ts_ns=TS * 10**9 + 1, exitcode=-15, terminated=True),
        }
        assert ChildFailedError("t", failures).get_first_failure()[0] == 1

    def test_all_terminated_falls_back_to_earliest(self, tmp_path: Path) -> None:
        failures = {
            0: _fail(tmp_path, 0, ts_ns=TS * 10**9 + 9, terminated=True),
            1: _fail(tmp_path, 1, ts_ns=TS * 10**9 + 3, terminated=True),
        }
        assert ChildFailedError("t", failures).get_first_failure()[0] == 1

    def test_exact_tie_goes_to_first_in_dict_order(self, tmp_path: Path) -> None:
        failures = {
            5: _fail(tmp_path, 5, ts_ns=TS * 10**9),
            2: _fail(tmp_path, 2, ts_ns=TS * 10**9),
        }
        assert ChildFailedError("t", failures).get_first_failure()[0] == 5

    def test_no_failures_is_an_error(self) -> None:
        with pytest.raises(ValueError, match="at least one failure"):
            ChildFailedError("t", {})


class TestReport:
    def test_exact_report_root_cause_last_as_torch_2_13(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(errors.socket, "getfqdn", lambda: "node7.example")
        failures = {
            0: _fail(tmp_path, 0, ts_ns=TS * 10**9 + 5, exitcode=-15, terminated=True),
            1: _fail(tmp_path, 1, file_ns=TS * 10**9 + 1),
        }
        when = datetime.fromtimestamp(TS).isoformat(sep="_")
        err = ChildFailedError("trainer", failures)
        expected = f"""
============================================================
trainer FAILED
------------------------------------------------------------
Failures:
[0]:
  time      : {when}
  host      : node7.example
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 1000)  (SIGTERM) [terminated by launcher]
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 1000
------------------------------------------------------------
Root Cause (first observed failure):
[1]:
  time      : {when}
  host      : node7.example
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 1001) 
  error_file: {tmp_path}/1.json
  traceback : Traceback:
    boom
  
============================================================"""  # noqa: W291, W293 (torch's report has these trailing spaces)
        assert str(err) == expected
        assert str(err).index("Failures:") < str(err).index("Root Cause")

    def test_single_failure_has_no_other_failures(self, tmp_path: Path) -> None:
        err = ChildFailedError("echo", {0: _fail(tmp_path, 0, ts_ns=1, exitcode=2)})
        text = str(err)
        assert "\nFailures:\n  <NO_OTHER_FAILURES>\n" in text
        assert f"traceback : {LINK_MSG}" in text
        assert text.splitlines()[2] == "echo FAILED"

    def test_message_dict_without_callstack_shows_inner_message(self, tmp_path: Path) -> None:
        path = write_json(tmp_path / "e.json", {"message": {"message": "E: inner"}})
        err = ChildFailedError("t", {0: ProcessFailure(0, 1, 1, str(path))})
        assert "  traceback : E: inner\n" in str(err)

    def test_width_is_capped_at_60(self, tmp_path: Path) -> None:
        err = ChildFailedError("x" * 100, {0: _fail(tmp_path, 0, ts_ns=1)})
        assert str(err).splitlines()[1] == "=" * 60


# -------------------------------------------------------------------------- record


class RecordingHandler(ErrorHandler):
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def initialize(self) -> None:
        self.calls.append(("initialize", None))

    def record_exception(self, e: BaseException) -> None:
        self.calls.append(("record_exception", e))

    def dump_error_file(self, rootcause_error_file: str, error_code: int = 0) -> None:
        self.calls.append(("dump_error_file", (rootcause_error_file, error_code)))


class TestRecord:
    def test_bare_decorator_writes_error_file_and_reraises(
        self, error_file: Path, _fake_faulthandler: list[dict[str, Any]]
    ) -> None:
        @record
        def main(x: int) -> int:
            raise ValueError(f"bad {x}")

        with pytest.raises(ValueError, match="bad 3"):
            main(3)
        data = json.loads(error_file.read_text())
        assert data["message"]["message"] == "ValueError: bad 3"
        assert "in main" in data["message"]["extraInfo"]["py_callstack"]
        assert _fake_faulthandler == [{"all_threads": True}]

    def test_success_returns_value_and_keeps_metadata(self, error_file: Path) -> None:
        @record
        def main(a: int, b: int = 2) -> int:
            """Doc."""
            return a * b

        assert main(4, b=5) == 20
        assert (main.__name__, main.__doc__) == ("main", "Doc.")
        assert not error_file.exists()

    def test_with_error_handler_keyword(self) -> None:
        handler = RecordingHandler()

        @record(error_handler=handler)
        def main() -> None:
            raise KeyError("k")

        with pytest.raises(KeyError) as info:
            main()
        assert handler.calls == [("initialize", None), ("record_exception", info.value)]

    def test_torch_style_positional_call(self) -> None:
        handler = RecordingHandler()
        wrapped = record(lambda: 7, handler)
        assert wrapped() == 7
        assert handler.calls == [("initialize", None)]

    @pytest.mark.parametrize("code", [0, None])
    def test_clean_system_exit_returns_none(self, error_file: Path, code: int | None) -> None:
        @record
        def main() -> int:
            sys.exit(code)

        assert main() is None
        assert not error_file.exists()

    @pytest.mark.parametrize("exc", [SystemExit(2), SystemExit("fatal"), KeyboardInterrupt()])
    def test_other_base_exceptions_propagate_unrecorded(
        self, error_file: Path, exc: BaseException
    ) -> None:
        @record
        def main() -> None:
            raise exc

        with pytest.raises(type(exc)):
            main()
        assert not error_file.exists()

    def test_child_failed_error_dumps_root_cause_file(
        self, error_file: Path, tmp_path: Path
    ) -> None:
        failures = {
            0: _fail(tmp_path, 0, file_ns=TS * 10**9 + 9, exitcode=1),
            1: _fail(tmp_path, 1, file_ns=TS * 10**9 + 1, exitcode=-6),
        }

        @record
        def launcher() -> None:
            raise ChildFailedError("trainer", failures)

        with pytest.raises(ChildFailedError):
            launcher()
        expected = nested("ValueError: rank 1", ts_ns=TS * 10**9 + 1)
        expected["message"]["errorCode"] = -6
        assert json.loads(error_file.read_text()) == expected
        assert sorted(os.listdir(tmp_path)) == ["0.json", "1.json", "error.json"]

    def test_child_failed_error_without_error_file_writes_nothing(
        self, error_file: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        handler = RecordingHandler()

        @record(error_handler=handler)
        def launcher() -> None:
            raise ChildFailedError("t", {4: _fail(tmp_path, 4, ts_ns=1, exitcode=-9)})

        with caplog.at_level(logging.INFO, logger=errors.__name__):
            with pytest.raises(ChildFailedError):
                launcher()
        assert handler.calls == [("initialize", None)]
        assert "local_rank 4 FAILED with no error file." in caplog.text
        assert not error_file.exists()


# --------------------------------------------------------- interoperability with torch


@pytest.fixture
def torch_errors() -> Any:
    return pytest.importorskip("torch.distributed.elastic.multiprocessing.errors")


class TestTorchInterop:
    def test_torch_reads_what_torchmp_writes(self, torch_errors: Any, error_file: Path) -> None:
        ErrorHandler().record_exception(raised(ValueError("from torchmp")))
        ours = ProcessFailure(0, 5, 1, str(error_file))
        theirs = torch_errors.ProcessFailure(0, 5, 1, str(error_file))
        assert theirs.message == ours.message
        assert theirs.message["message"] == "ValueError: from torchmp"
        assert theirs.timestamp == ours.timestamp
        assert theirs.error_file_data == ours.error_file_data

    def test_torchmp_reads_what_torch_writes(self, torch_errors: Any, error_file: Path) -> None:
        try:
            raise ValueError("from torch")
        except ValueError as e:
            torch_errors.ErrorHandler().record_exception(e)
        ours = ProcessFailure(0, 5, 1, str(error_file))
        theirs = torch_errors.ProcessFailure(0, 5, 1, str(error_file))
        assert ours.message == theirs.message
        assert ours.timestamp == theirs.timestamp
        assert ours.message["message"] == "ValueError: from torch"  # type: ignore[index]

    def test_same_failure_blocks_and_root_cause(self, torch_errors: Any, tmp_path: Path) -> None:
        specs = [(0, TS + 2, 1), (1, TS, -6), (2, TS + 1, 3)]
        for rank, ts, _ in specs:
            write_json(tmp_path / f"{rank}.json", nested(f"E: rank {rank}", ts=ts))
        paths = {rank: str(tmp_path / f"{rank}.json") for rank, _, _ in specs}
        ours = ChildFailedError("t", {r: ProcessFailure(r, 9, c, paths[r]) for r, _, c in specs})
        theirs = torch_errors.ChildFailedError(
            "t", {r: torch_errors.ProcessFailure(r, 9, c, paths[r]) for r, _, c in specs}
        )
        assert ours.get_first_failure()[0] == theirs.get_first_failure()[0] == 1

        def blocks(text: str) -> dict[str, str]:
            found = re.findall(r"^(\[\d+\]:\n(?:  .*\n?)+)", text, flags=re.M)
            return {b.splitlines()[0]: b.rstrip("\n") for b in found}

        assert blocks(str(ours)) == blocks(str(theirs))
        assert len(blocks(str(ours))) == 3
