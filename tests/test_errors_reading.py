"""Tests for torchmp.errors, reading error.json: the torch contract (ProcessFailure),
torchmp's guarantees, malformed and oversized files, only regular files.

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
import resource
import stat
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from torchmp.errors import (
    ErrorHandler,
    ProcessFailure,
)
from torchmp.errors import error_handler as error_handler_mod

from errors_helpers import CAP, LINK_MSG, TS, nested, write_json

pytestmark = pytest.mark.usefixtures("_fake_faulthandler")


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
