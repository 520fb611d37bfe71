"""Shared by the tests of torchmp.errors (tests/test_errors_*.py): constants,
fixtures and builders of error files.

tests/conftest.py loads this module as a plugin (``pytest_plugins``), so its
fixtures are known everywhere; none is autouse.  Each errors module asks for
the faulthandler stand-in around every test with

    pytestmark = pytest.mark.usefixtures("_fake_faulthandler")

(``_fake_faulthandler`` keeps its name: tests read the calls it recorded).
"""
from __future__ import annotations

import faulthandler
import json
from pathlib import Path
from typing import Any

import pytest

from torchmp.errors import error_handler as error_handler_mod

ENV = "TORCHELASTIC_ERROR_FILE"
CAP = error_handler_mod.MAX_ERROR_FILE_BYTES
LINK_MSG = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
TS = 1_700_000_000  # a fixed second, so reports and ordering are deterministic

# ----------------------------------------------------------------------------- helpers


@pytest.fixture
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
