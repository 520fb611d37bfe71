"""Tests for torchmp.errors, writing error.json: the package surface,
ErrorHandler.record_exception, the atomic write, initialize() and
dump_error_file().

The reading contract is a mixin run against torchmp's ProcessFailure always and
torch's when torch is importable, so any drift from the reference shows up as a
failing torch-side test. Everything else pins torchmp's own guarantees (atomic
writes, defensive reads, nanosecond ordering) with exact values.  Shared
fixtures and builders: tests/errors_helpers.py.
"""
from __future__ import annotations

import ast
import faulthandler
import json
import logging
import os
import stat
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

import torchmp.errors as errors
from torchmp.errors import (
    ErrorHandler,
    ProcessFailure,
    get_error_handler,
)
from torchmp.errors import error_handler as error_handler_mod

from errors_helpers import ENV, nested, raised, write_json

pytestmark = pytest.mark.usefixtures("_fake_faulthandler")


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
