"""Tests for torchmp.errors: writing, reading and reporting error.json files.

The reading contract is a mixin run against torchmp's ProcessFailure always and
torch's when torch is importable, so any drift from the reference shows up as a
failing torch-side test. Everything else pins torchmp's own guarantees (atomic
writes, defensive reads, nanosecond ordering) with exact values.
"""

from __future__ import annotations

import ast
import faulthandler
import json
import logging
import os
import re
import resource
import stat
import sys
import time
import warnings
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

import torchmp.errors as errors
from torchmp.errors import (
    ChildFailedError,
    ErrorHandler,
    ProcessFailure,
    get_error_handler,
    record,
)
from torchmp.errors import error_handler as error_handler_mod

ENV = "TORCHELASTIC_ERROR_FILE"
CAP = error_handler_mod.MAX_ERROR_FILE_BYTES
LINK_MSG = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
TS = 1_700_000_000  # a fixed second, so reports and ordering are deterministic


# ----------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True)
def _fake_faulthandler(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Record faulthandler.enable calls instead of re-targeting pytest's handler."""
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(faulthandler, "enable", lambda **kw: calls.append(kw))
    return calls


@pytest.fixture
def error_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "error.json"
    monkeypatch.setenv(ENV, str(path))
    return path


def write_json(path: Path, obj: object) -> Path:
    path.write_text(json.dumps(obj))
    return path


def nested(message: str, ts: int | str = TS, ts_ns: int | None = None,
           callstack: str | None = "Traceback:\n  boom\n") -> dict[str, Any]:
    extra: dict[str, Any] = {"timestamp": str(ts)}
    if callstack is not None:
        extra["py_callstack"] = callstack
    if ts_ns is not None:
        extra["timestamp_ns"] = str(ts_ns)
    return {"message": {"message": message, "extraInfo": extra}}


def raised(exc: BaseException) -> BaseException:
    """Return ``exc`` after raising it, so that it carries a traceback."""
    try:
        raise exc
    except BaseException as e:  # noqa: BLE001 - test helper
        return e


# ------------------------------------------------------------------ package surface


def test_public_names() -> None:
    assert errors.__all__ == [
        "ProcessFailure",
        "ChildFailedError",
        "record",
        "ErrorHandler",
        "get_error_handler",
    ]
    for name in errors.__all__:
        assert getattr(errors, name) is not None
    assert errors.__doc__ is not None
    assert "Worker failure" in errors.__doc__  # the taxonomy table
    assert "@record" in errors.__doc__  # the example


def test_no_torch_import_in_sources() -> None:
    pkg = Path(errors.__file__).parent
    for src in sorted(pkg.glob("*.py")):
        tree = ast.parse(src.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            assert not any(n == "torch" or n.startswith("torch.") for n in names), src


def test_get_error_handler_returns_fresh_handler() -> None:
    a, b = get_error_handler(), get_error_handler()
    assert type(a) is ErrorHandler and a is not b


# ------------------------------------------------------------ ErrorHandler: writing


class TestRecordException:
    def test_exact_json(self, error_file: Path) -> None:
        before = time.time_ns()
        ErrorHandler().record_exception(raised(ValueError("bad input")))
        after = time.time_ns()

        data = json.loads(error_file.read_text())
        assert list(data) == ["message"]
        assert list(data["message"]) == ["message", "extraInfo"]
        assert data["message"]["message"] == "ValueError: bad input"
        extra = data["message"]["extraInfo"]
        assert list(extra) == ["py_callstack", "timestamp", "timestamp_ns"]
        assert extra["py_callstack"].startswith("Traceback (most recent call last):\n")
        assert extra["py_callstack"].endswith("ValueError: bad input\n")
        assert "in raised" in extra["py_callstack"]
        ts_ns = int(extra["timestamp_ns"])
        assert before <= ts_ns <= after
        assert extra["timestamp"] == str(ts_ns // 10**9)  # torch's str-of-int seconds

    def test_traceback_comes_from_the_exception_not_the_current_context(
        self, error_file: Path
    ) -> None:
        exc = raised(KeyError("k"))
        # called outside any except block: traceback.format_exc() would say "None"
        ErrorHandler().record_exception(exc)
        data = json.loads(error_file.read_text())
        assert data["message"]["message"] == "KeyError: 'k'"
        assert "NoneType: None" not in data["message"]["extraInfo"]["py_callstack"]
        assert data["message"]["extraInfo"]["py_callstack"].endswith("KeyError: 'k'\n")

    def test_non_ascii_message_round_trips(self, error_file: Path) -> None:
        ErrorHandler().record_exception(raised(RuntimeError("ünïcødé ☃")))
        failure = ProcessFailure(0, 1, 1, str(error_file))
        assert isinstance(failure.message, dict)
        assert failure.message["message"] == "RuntimeError: ünïcødé ☃"

    def test_existing_file_is_overwritten_silently_like_torch(
        self, error_file: Path, tmp_path: Path
    ) -> None:
        write_json(error_file, nested("Old: stale"))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ErrorHandler().record_exception(raised(OSError("new")))
        assert json.loads(error_file.read_text())["message"]["message"] == "OSError: new"
        assert sorted(os.listdir(tmp_path)) == ["error.json"]

    def test_no_temp_file_left_and_mode_follows_umask(
        self, error_file: Path, tmp_path: Path
    ) -> None:
        old = os.umask(0o027)
        try:
            ErrorHandler().record_exception(raised(ValueError("x")))
        finally:
            os.umask(old)
        assert sorted(os.listdir(tmp_path)) == ["error.json"]
        assert stat.S_IMODE(error_file.stat().st_mode) == 0o640

    @pytest.mark.parametrize("value", [None, ""])
    def test_env_unset_logs_instead_of_writing(
        self,
        value: str | None,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        if value is None:
            monkeypatch.delenv(ENV, raising=False)
        else:
            monkeypatch.setenv(ENV, value)
        monkeypatch.chdir(tmp_path)
        with caplog.at_level(logging.INFO, logger=error_handler_mod.__name__):
            ErrorHandler().record_exception(raised(ValueError("only logged")))
        assert "ValueError: only logged" in caplog.text
        assert f"{ENV} is not set" in caplog.text
        assert os.listdir(tmp_path) == []


class TestAtomicWrite:
    def test_replace_is_the_only_way_the_target_changes(
        self, error_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        write_json(error_file, nested("Old: one"))
        seen: list[tuple[str, str, str]] = []
        real_replace = os.replace

        def spy(src: str, dst: str) -> None:
            # at rename time the target still holds the old, complete document and
            # the new one is complete in a temp file in the same directory
            seen.append((src, error_file.read_text(), Path(src).read_text()))
            real_replace(src, dst)

        monkeypatch.setattr(os, "replace", spy)
        ErrorHandler().record_exception(raised(ValueError("two")))
        assert len(seen) == 1
        src, old_text, new_text = seen[0]
        assert Path(src).parent == tmp_path
        assert json.loads(old_text)["message"]["message"] == "Old: one"
        assert json.loads(new_text)["message"]["message"] == "ValueError: two"
        assert sorted(os.listdir(tmp_path)) == ["error.json"]

    def test_missing_directory_warns_and_creates_nothing(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv(ENV, str(tmp_path / "missing" / "error.json"))
        with pytest.warns(UserWarning, match=r"Unable to write error to file .*error\.json"):
            ErrorHandler().record_exception(raised(ValueError("x")))
        assert os.listdir(tmp_path) == []

    def test_target_is_a_directory_temp_file_removed(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        target = tmp_path / "error.json"
        target.mkdir()
        monkeypatch.setenv(ENV, str(target))
        with pytest.warns(UserWarning, match="IsADirectoryError"):
            ErrorHandler().record_exception(raised(ValueError("x")))
        assert os.listdir(tmp_path) == ["error.json"]
        assert os.listdir(target) == []

    def test_failure_while_writing_keeps_old_file(
        self, error_file: Path, tmp_path: Path
    ) -> None:
        error_file.write_text("old")
        with pytest.warns(UserWarning, match="UnicodeEncodeError"):
            ErrorHandler()._write_error_file(str(error_file), "\udcff")  # unencodable
        assert error_file.read_text() == "old"
        assert os.listdir(tmp_path) == ["error.json"]

    @pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
    def test_unwritable_directory(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        monkeypatch.setenv(ENV, str(locked / "error.json"))
        try:
            with pytest.warns(UserWarning, match="PermissionError"):
                ErrorHandler().record_exception(raised(ValueError("x")))
            assert os.listdir(locked) == []
        finally:
            locked.chmod(0o700)

    def test_symlinked_error_file_stays_a_symlink(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        real = tmp_path / "real.json"
        real.write_text("{}")
        link = tmp_path / "error.json"
        link.symlink_to(real)
        monkeypatch.setenv(ENV, str(link))
        ErrorHandler().record_exception(raised(ValueError("via link")))
        assert link.is_symlink()
        assert json.loads(real.read_text())["message"]["message"] == "ValueError: via link"
        assert sorted(os.listdir(tmp_path)) == ["error.json", "real.json"]


def test_initialize_enables_faulthandler_for_all_threads(
    _fake_faulthandler: list[dict[str, Any]]
) -> None:
    ErrorHandler().initialize()
    assert _fake_faulthandler == [{"all_threads": True}]


def test_initialize_warns_when_faulthandler_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(**kw: Any) -> None:
        raise RuntimeError("no stderr")

    monkeypatch.setattr(faulthandler, "enable", broken)
    with pytest.warns(UserWarning, match="Unable to enable fault handler. RuntimeError: no stderr"):
        ErrorHandler().initialize()


class TestDumpErrorFile:
    def test_copies_child_file_with_error_code(
        self, error_file: Path, tmp_path: Path
    ) -> None:
        child = write_json(tmp_path / "child.json", nested("ValueError: child", ts_ns=5))
        ErrorHandler().dump_error_file(str(child), error_code=-9)
        expected = nested("ValueError: child", ts_ns=5)
        expected["message"]["errorCode"] = -9
        assert json.loads(error_file.read_text()) == expected
        assert sorted(os.listdir(tmp_path)) == ["child.json", "error.json"]

    def test_zero_error_code_is_not_written(self, error_file: Path, tmp_path: Path) -> None:
        child = write_json(tmp_path / "child.json", nested("E: x"))
        ErrorHandler().dump_error_file(str(child))
        assert json.loads(error_file.read_text()) == nested("E: x")

    def test_existing_parent_file_is_logged_then_replaced(
        self, error_file: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        write_json(error_file, {"message": "stale parent"})
        child = write_json(tmp_path / "child.json", nested("E: child"))
        with caplog.at_level(logging.WARNING, logger=error_handler_mod.__name__):
            ErrorHandler().dump_error_file(str(child), 1)
        assert f"{error_file} already exists and will be overwritten" in caplog.text
        assert "stale parent" in caplog.text
        assert json.loads(error_file.read_text())["message"]["message"] == "E: child"
        assert json.loads(error_file.read_text())["message"]["errorCode"] == 1

    def test_string_shape_is_copied_without_error_code(
        self, error_file: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        child = write_json(tmp_path / "child.json", {"message": "plain", "timestamp": "7"})
        with caplog.at_level(logging.WARNING, logger=error_handler_mod.__name__):
            ErrorHandler().dump_error_file(str(child), 3)
        assert json.loads(error_file.read_text()) == {"message": "plain", "timestamp": "7"}
        assert "skipping error code override" in caplog.text

    def test_malformed_child_file_does_not_raise(self, error_file: Path, tmp_path: Path) -> None:
        child = tmp_path / "child.json"
        child.write_text("{not json")
        ErrorHandler().dump_error_file(str(child), 2)
        data = json.loads(error_file.read_text())
        assert data["message"]["message"].startswith(f"error file {child} is not valid JSON: ")
        assert data["message"]["errorCode"] == 2
        assert set(data["message"]["extraInfo"]) == {"timestamp", "timestamp_ns"}

    def test_parent_without_error_file_logs_error(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        monkeypatch.delenv(ENV, raising=False)
        child = write_json(tmp_path / "child.json", nested("E: x"))
        with caplog.at_level(logging.ERROR, logger=error_handler_mod.__name__):
            ErrorHandler().dump_error_file(str(child))
        assert "no error file defined for parent" in caplog.text
        assert os.listdir(tmp_path) == ["child.json"]


# ------------------------------------------------------ reading: the torch contract


class _ReadingContract:
    """Reading behaviour torchmp shares with torch; run against both."""

    @pytest.fixture
    def PF(self) -> Any:
        raise NotImplementedError

    def test_nested_shape(self, PF: Any, tmp_path: Path) -> None:
        data = nested("ValueError: boom", ts=TS + 1)
        path = write_json(tmp_path / "error.json", data)
        f = PF(3, 42, 1, str(path))
        assert f.error_file == str(path)
        assert f.error_file_data == data
        assert f.message == data["message"]  # the dict, as torch does
        assert f.timestamp == TS + 1
        assert f.exitcode == 1 and f.pid == 42 and f.local_rank == 3

    def test_string_shape_with_timestamp(self, PF: Any, tmp_path: Path) -> None:
        path = write_json(tmp_path / "error.json", {"message": "user wrote this", "timestamp": "123"})
        f = PF(0, 1, 2, str(path))
        assert f.message == "user wrote this"
        assert f.timestamp == 123
        assert f.error_file_data == {"message": "user wrote this", "timestamp": "123"}

    def test_string_shape_without_timestamp_is_zero(self, PF: Any, tmp_path: Path) -> None:
        path = write_json(tmp_path / "error.json", {"message": "no time"})
        f = PF(0, 1, 2, str(path))
        assert (f.message, f.timestamp) == ("no time", 0)

    def test_missing_file_signal(self, PF: Any, tmp_path: Path) -> None:
        before = int(time.time())
        f = PF(1, 42, -9, str(tmp_path / "nope.json"))
        assert f.error_file == "<N/A>"
        assert f.message == "Signal 9 (SIGKILL) received by PID 42"
        assert f.error_file_data == {"message": "<NONE>"}
        assert before <= f.timestamp <= int(time.time())

    def test_missing_file_nonzero_exit(self, PF: Any, tmp_path: Path) -> None:
        f = PF(1, 42, 3, str(tmp_path / "nope.json"))
        assert f.message == LINK_MSG
        assert f.error_file_data["errorTraits"] == {
            "category": "system_terminated_error",
            "retryability": "False",
        }

    def test_directory_counts_as_missing(self, PF: Any, tmp_path: Path) -> None:
        (tmp_path / "error.json").mkdir()
        f = PF(0, 7, -15, str(tmp_path / "error.json"))
        assert (f.error_file, f.message) == ("<N/A>", "Signal 15 (SIGTERM) received by PID 7")

    @pytest.mark.parametrize(
        ("exitcode", "name"),
        [(-9, "SIGKILL"), (-15, "SIGTERM"), (-11, "SIGSEGV"), (1, "<N/A>"), (0, "<N/A>"), (-200, "<N/A>")],
    )
    def test_signal_name(self, PF: Any, tmp_path: Path, exitcode: int, name: str) -> None:
        assert PF(0, 1, exitcode, str(tmp_path / "nope")).signal_name() == name

    def test_timestamp_isoformat(self, PF: Any, tmp_path: Path) -> None:
        path = write_json(tmp_path / "error.json", nested("E: x", ts=TS))
        expected = datetime.fromtimestamp(TS).isoformat(sep="_")
        assert PF(0, 1, 1, str(path)).timestamp_isoformat() == expected


class TestReadingTorchmp(_ReadingContract):
    @pytest.fixture
    def PF(self) -> Any:
        return ProcessFailure


class TestReadingTorch(_ReadingContract):
    @pytest.fixture
    def PF(self) -> Any:
        mod = pytest.importorskip("torch.distributed.elastic.multiprocessing.errors")
        return mod.ProcessFailure


# ---------------------------------------------------- reading: torchmp's guarantees


class TestProcessFailureExtras:
    def test_positional_signature_like_torch_extras_keyword_only(self, tmp_path: Path) -> None:
        f = ProcessFailure(0, 1, 1, str(tmp_path / "nope"))
        assert f.timestamp_ns is None and f.terminated_by_launcher is False
        with pytest.raises(TypeError):
            ProcessFailure(0, 1, 1, str(tmp_path / "nope"), 5)  # type: ignore[misc]

    def test_launcher_timestamp_ns_sets_timestamp(self, tmp_path: Path) -> None:
        ns = TS * 10**9 + 123_456_789
        f = ProcessFailure(0, 1, -9, str(tmp_path / "nope"), timestamp_ns=ns)
        assert f.timestamp == TS
        assert f.precise_timestamp_ns == ns

    def test_file_timestamp_wins_over_launcher(self, tmp_path: Path) -> None:
        path = write_json(tmp_path / "e.json", nested("E: x", ts=TS - 5))
        f = ProcessFailure(0, 1, 1, str(path), timestamp_ns=TS * 10**9)
        assert f.timestamp == TS - 5
        assert f.precise_timestamp_ns == TS * 10**9  # no ns in the file: the launcher's

    def test_file_timestamp_ns_is_the_precise_key(self, tmp_path: Path) -> None:
        file_ns = TS * 10**9 + 42
        path = write_json(tmp_path / "e.json", nested("E: x", ts=TS, ts_ns=file_ns))
        f = ProcessFailure(0, 1, 1, str(path), timestamp_ns=TS * 10**9 + 999)
        assert f.precise_timestamp_ns == file_ns

    def test_string_shape_uses_launcher_time_when_file_has_none(self, tmp_path: Path) -> None:
        path = write_json(tmp_path / "e.json", {"message": "hand written"})
        f = ProcessFailure(0, 1, 1, str(path), timestamp_ns=TS * 10**9 + 7)
        assert (f.timestamp, f.precise_timestamp_ns) == (TS, TS * 10**9 + 7)

    def test_bad_file_timestamp_falls_back(self, tmp_path: Path) -> None:
        path = write_json(tmp_path / "e.json", nested("E: x", ts="not-a-number"))
        f = ProcessFailure(0, 1, 1, str(path), timestamp_ns=TS * 10**9)
        assert f.timestamp == TS
        assert f.error_file_problem is None and f.message == nested("E: x", ts="not-a-number")["message"]

    def test_nested_shape_without_extra_info_is_accepted(self, tmp_path: Path) -> None:
        path = write_json(tmp_path / "e.json", {"message": {"message": "E: bare"}})
        f = ProcessFailure(0, 1, 1, str(path), timestamp_ns=TS * 10**9)
        assert f.message == {"message": "E: bare"} and f.timestamp == TS

    def test_no_timing_information_orders_by_construction_time(self, tmp_path: Path) -> None:
        before = time.time_ns()
        f = ProcessFailure(0, 1, -9, str(tmp_path / "nope"))
        after = time.time_ns()
        assert before <= f.precise_timestamp_ns <= after
        assert f.timestamp == f.precise_timestamp_ns // 10**9

    def test_error_file_data_not_shared_between_failures(self, tmp_path: Path) -> None:
        a = ProcessFailure(0, 1, 1, str(tmp_path / "nope"))
        b = ProcessFailure(1, 2, -9, str(tmp_path / "nope"))
        assert "errorTraits" in a.error_file_data
        assert b.error_file_data == {"message": "<NONE>"}

    def test_absurd_timestamp_does_not_break_isoformat(self, tmp_path: Path) -> None:
        path = write_json(tmp_path / "e.json", {"message": "m", "timestamp": str(10**20)})
        assert ProcessFailure(0, 1, 1, str(path)).timestamp_isoformat() == "<N/A>"

    def test_fifo_is_missing_and_does_not_block(self, tmp_path: Path) -> None:
        fifo = tmp_path / "error.json"
        os.mkfifo(fifo)
        f = ProcessFailure(0, 1, -9, str(fifo))
        assert f.error_file == "<N/A>"


class TestMalformedErrorFile:
    @pytest.mark.parametrize(
        ("content", "expected"),
        [
            (b"", "is not valid JSON: Expecting value: line 1 column 1 (char 0)"),
            (b'{"message": ', "is not valid JSON: Expecting value: line 1 column 13 (char 12)"),
            (b'{"message": "\xff\xfe"}',
             "is not valid UTF-8: 'utf-8' codec can't decode byte 0xff in position 13: invalid start byte"),
            (b"[1, 2]", 'has an unexpected shape: expected a JSON object whose "message" is a string or an object, '
                        'got a JSON list'),
            (b'{"msg": "x"}', 'has an unexpected shape: expected a JSON object whose "message" is a string or an '
                              'object, got an object without "message"'),
            (b'{"message": 5}', 'has an unexpected shape: expected a JSON object whose "message" is a string or an '
                                'object, got "message" of type int'),
            (b"null", 'has an unexpected shape: expected a JSON object whose "message" is a string or an object, '
                      'got a JSON NoneType'),
        ],
    )
    def test_message_explains(self, tmp_path: Path, content: bytes, expected: str) -> None:
        path = tmp_path / "error.json"
        path.write_bytes(content)
        f = ProcessFailure(2, 99, 1, str(path), timestamp_ns=TS * 10**9)
        explanation = f"error file {path} {expected}"
        assert f.message == explanation
        assert f.error_file_problem == explanation
        assert f.error_file_data == {"message": explanation}
        assert (f.exitcode, f.error_file, f.timestamp) == (1, str(path), TS)

    def test_deeply_nested_json(self, tmp_path: Path) -> None:
        path = tmp_path / "error.json"
        path.write_text("[" * 200_000)
        f = ProcessFailure(0, 1, 1, str(path))
        assert isinstance(f.message, str)
        assert f.message.startswith(f"error file {path} is not valid JSON: ")

    def test_signal_exit_keeps_signal_in_message(self, tmp_path: Path) -> None:
        path = tmp_path / "error.json"
        path.write_text("garbage")
        f = ProcessFailure(0, 7, -9, str(path))
        assert f.message == (
            f"error file {path} is not valid JSON: Expecting value: line 1 column 1 (char 0)"
            "; Signal 9 (SIGKILL) received by PID 7"
        )

    def test_permission_error(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        path = write_json(tmp_path / "error.json", nested("E: x"))
        real_open = os.open

        def deny(p: Any, flags: int, *a: Any, **kw: Any) -> int:
            if os.fspath(p) == str(path):
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(p, flags, *a, **kw)

        monkeypatch.setattr(os, "open", deny)
        f = ProcessFailure(0, 1, 1, str(path))
        assert f.message == f"error file {path} could not be opened: Permission denied (errno 13)"
        assert f.exitcode == 1

    @pytest.mark.skipif(os.geteuid() == 0, reason="root can read mode-000 files")
    def test_permission_error_for_real(self, tmp_path: Path) -> None:
        path = write_json(tmp_path / "error.json", nested("E: x"))
        path.chmod(0)
        f = ProcessFailure(0, 1, 1, str(path))
        assert f.message == f"error file {path} could not be opened: Permission denied (errno 13)"

    def test_file_of_exactly_the_cap_is_read(self, tmp_path: Path) -> None:
        head = b'{"message": "'
        tail = b'"}'
        path = tmp_path / "error.json"
        path.write_bytes(head + b"x" * (CAP - len(head) - len(tail)) + tail)
        assert path.stat().st_size == CAP
        f = ProcessFailure(0, 1, 1, str(path))
        assert f.error_file_problem is None
        assert f.message == "x" * (CAP - len(head) - len(tail))

    def test_one_byte_over_the_cap_is_refused(self, tmp_path: Path) -> None:
        path = tmp_path / "error.json"
        path.write_bytes(b'{"message": "' + b"x" * CAP + b'"}')
        f = ProcessFailure(0, 1, 1, str(path))
        assert f.message == f"error file {path} is larger than {CAP} bytes; not read"

    def test_sparse_1gb_file_is_not_read_into_memory(self, tmp_path: Path) -> None:
        path = tmp_path / "error.json"
        with open(path, "wb") as fp:
            fp.truncate(1 << 30)
        rss_before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.monotonic()
        f = ProcessFailure(0, 1, 1, str(path))
        elapsed = time.monotonic() - t0
        rss_delta_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before_kb
        assert f.message == f"error file {path} is larger than {CAP} bytes; not read"
        assert rss_delta_kb < 100 * 1024, f"max RSS grew by {rss_delta_kb} KiB"
        assert elapsed < 0.5


# ----------------------------------------- reading: only regular files, never followed


def _make_target(kind: str, tmp_path: Path) -> str:
    """A path that is not a plain error file, of the given kind."""
    if kind == "fifo":
        target = tmp_path / "fifo"
        os.mkfifo(target)
        return str(target)
    if kind == "dev-zero":
        return "/dev/zero"
    if kind == "big":
        target = tmp_path / "big.json"
        target.write_bytes(b'{"message": "' + b"x" * (2 * CAP) + b'"}')
        return str(target)
    if kind == "json":  # a valid error file elsewhere: still not read through a link
        return str(write_json(tmp_path / "elsewhere.json", nested("E: not mine")))
    assert kind == "dangling"
    return str(tmp_path / "nothing-here")


class TestErrorFileIsOnlyARegularFile:
    """A worker controls its error file path: it can point it anywhere.

    A symlink (to a FIFO, a device, ``/proc/kmsg``, another job's file) must not be
    followed, and anything but a regular file is "no error file" plus a warning.
    """

    @pytest.mark.parametrize("kind", ["fifo", "dev-zero", "big", "json", "dangling"])
    @pytest.mark.parametrize("exitcode", [1, -9])
    def test_symlink_is_not_followed(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str, exitcode: int
    ) -> None:
        link = tmp_path / "error.json"
        link.symlink_to(_make_target(kind, tmp_path))
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="torchmp.errors"):
            f = ProcessFailure(3, 42, exitcode, str(link))
        assert time.monotonic() - t0 < 1.0
        assert f.error_file == "<N/A>"
        assert f.error_file_problem is None
        if exitcode < 0:
            assert f.message == "Signal 9 (SIGKILL) received by PID 42"
            assert f.error_file_data == {"message": "<NONE>"}
        else:
            assert f.message == LINK_MSG
        assert [r.getMessage() for r in caplog.records] == [
            f"rank 3 (pid 42): error file {link} is a symbolic link, not a regular file;"
            " ignored (no error file)"
        ]

    @pytest.mark.parametrize(
        ("kind", "what"),
        [("fifo", "a FIFO"), ("dev-zero", "a character device"), ("dir", "a directory"),
         ("socket", "a socket")],
    )
    def test_other_non_regular_files_warn(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str, what: str
    ) -> None:
        import socket

        path = tmp_path / "error.json"
        sock = None
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "dir":
            path.mkdir()
        elif kind == "socket":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(str(path))
        try:
            target = "/dev/zero" if kind == "dev-zero" else str(path)
            with caplog.at_level(logging.WARNING, logger="torchmp.errors"):
                f = ProcessFailure(0, 7, 2, target)
        finally:
            if sock is not None:
                sock.close()
        assert (f.error_file, f.message, f.error_file_problem) == ("<N/A>", LINK_MSG, None)
        assert [r.getMessage() for r in caplog.records] == [
            f"rank 0 (pid 7): error file {target} is {what}, not a regular file;"
            " ignored (no error file)"
        ]

    def test_devnull_is_silently_no_error_file(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        # --log-dir /dev/null gives every rank os.devnull as its error file.
        with caplog.at_level(logging.WARNING, logger="torchmp.errors"):
            f = ProcessFailure(0, 7, 2, os.devnull)
        assert (f.error_file, f.message) == ("<N/A>", LINK_MSG)
        assert caplog.records == []

    def test_regular_file_whose_read_would_block(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # /proc/kmsg is a "regular" file that answers a non-blocking read with
        # EAGAIN (and consumes the kernel log when it has data). Reading one must
        # not raise in the launcher: stand in for it with a FIFO that has a writer
        # but no data, reported as a regular file.
        path = tmp_path / "error.json"
        os.mkfifo(path)
        writer = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        real_fstat, real_lstat = os.fstat, os.lstat

        def as_regular(st: os.stat_result) -> os.stat_result:
            fields = list(st)
            fields[0] = stat.S_IFREG | 0o400
            return os.stat_result(fields)

        def fake_fstat(fd: int) -> os.stat_result:
            st = real_fstat(fd)
            return as_regular(st) if stat.S_ISFIFO(st.st_mode) else st

        def fake_lstat(p: Any, *a: Any, **kw: Any) -> os.stat_result:
            st = real_lstat(p, *a, **kw)
            return as_regular(st) if os.fspath(p) == str(path) else st

        monkeypatch.setattr(os, "fstat", fake_fstat)
        monkeypatch.setattr(os, "lstat", fake_lstat)
        try:
            f = ProcessFailure(0, 1, 1, str(path))
        finally:
            os.close(writer)
        explanation = (
            f"error file {path} could not be read: Resource temporarily unavailable (errno 11)"
        )
        assert (f.message, f.error_file_problem) == (explanation, explanation)
        assert f.error_file == str(path)

    def test_symlinked_child_file_is_not_copied(
        self, error_file: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        child = tmp_path / "child.json"
        child.symlink_to(write_json(tmp_path / "secret.json", nested("E: secret")))
        with caplog.at_level(logging.WARNING, logger=error_handler_mod.__name__):
            ErrorHandler().dump_error_file(str(child), 1)
        data = json.loads(error_file.read_text())
        assert data["message"]["message"] == (
            f"error file {child} is a symbolic link, not a regular file"
        )
        assert "secret" not in error_file.read_text()
        assert f"cannot copy child error file: error file {child} is a symbolic link" in caplog.text


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
