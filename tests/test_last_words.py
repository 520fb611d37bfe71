"""A failed rank's last words: the tail of its stderr in its ProcessFailure
and in the failure report, when it left no error file."""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest

from helpers import launch, python_worker, run_launcher
from torchmp import Std
from torchmp.errors import ChildFailedError, ProcessFailure, last_words
from torchmp.api import DEFAULT_STDERR_TAIL_LINES, stderr_tail_bound

RAISES = """
import sys
print("loading", file=sys.stderr, flush=True)
def main():
    raise ValueError("boom")
main()
"""

SLEEPS = "import time; time.sleep(30)"

TO_ENABLE = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"


def _run(tmp_path, code_by_rank, **kwargs):
    entry = sys.executable
    args = {r: python_worker(code)[1] for r, code in code_by_rank.items()}
    ctx = launch(entry, args, log_dir=tmp_path, **kwargs)
    try:
        result = ctx.wait(60)
    finally:
        ctx.close()
    assert result is not None
    return ctx, result


@pytest.mark.parametrize("redirects,tee", [
    (Std.NONE, Std.ALL),   # teed: kept by the I/O thread as the bytes pass
    (Std.ERR, Std.NONE),   # redirected: read from the end of the file
])
def test_traceback_becomes_message_and_report(tmp_path, redirects, tee):
    ctx, result = _run(tmp_path, {0: RAISES, 1: SLEEPS}, redirects=redirects, tee=tee)
    failure = result.failures[0]
    assert failure.exitcode == 1 and failure.error_file == "<N/A>"
    assert failure.message == TO_ENABLE  # torch's field, unchanged
    assert failure.headline == "ValueError: boom"
    assert failure.stderr_tail.splitlines()[0] == "loading"
    assert failure.stderr_tail.splitlines()[-1] == "ValueError: boom"
    assert 'File "<string>", line 5, in main' in failure.stderr_tail
    # The sibling torchmp terminated has nothing to say.
    assert result.failures[1].terminated_by_launcher and result.failures[1].stderr_tail == ""
    report = str(ChildFailedError("job", result.failures))
    root = report.split("Root Cause (first observed failure):\n", 1)[1]
    assert "  traceback : Traceback (most recent call last):\n" in root
    assert "\n  ValueError: boom\n" in root
    assert TO_ENABLE not in report


def test_last_lines_without_traceback(tmp_path):
    code = ("import sys\n"
            "for i in range(30): print(f'line {i}', file=sys.stderr)\n"
            "print('config file missing', file=sys.stderr); sys.exit(3)\n")
    _, result = _run(tmp_path, {0: code}, tee=Std.ALL)
    failure = result.failures[0]
    assert failure.exitcode == 3
    assert failure.message == TO_ENABLE
    assert failure.headline == "config file missing"
    lines = failure.stderr_tail.splitlines()
    assert len(lines) == DEFAULT_STDERR_TAIL_LINES
    assert lines == [f"line {i}" for i in range(11, 30)] + ["config file missing"]
    report = str(ChildFailedError("job", result.failures))
    assert "  traceback : config file missing\n  last 20 lines of stderr:\n    line 11\n" in report


def test_signal_death_keeps_its_message_and_shows_the_tail(tmp_path):
    code = ("import os, signal, sys; print('about to crash', file=sys.stderr, flush=True); "
            "os.kill(os.getpid(), signal.SIGSEGV)")
    _, result = _run(tmp_path, {0: code}, tee=Std.ALL)
    failure = result.failures[0]
    assert failure.exitcode == -signal.SIGSEGV
    assert failure.message == failure.headline == f"Signal 11 (SIGSEGV) received by PID {failure.pid}"
    assert failure.stderr_tail == "about to crash"
    assert "last 1 line of stderr:\n    about to crash" in str(ChildFailedError("job", result.failures))


def test_error_file_wins_over_the_tail(tmp_path):
    # A script file, not -c: the worker's sys.path[0] is then the script's
    # folder, not the cwd (a source checkout there would shadow torchmp).
    script = tmp_path / "recorded.py"
    script.write_text("import sys\nfrom torchmp.errors import record\n"
                      "@record\ndef main():\n    raise KeyError('recorded')\nmain()\n")
    ctx = launch(sys.executable, {0: (str(script),)}, log_dir=tmp_path / "logs", tee=Std.ALL)
    try:
        result = ctx.wait(60)
    finally:
        ctx.close()
    failure = result.failures[0]
    assert failure.error_file.endswith("error.json")
    assert failure.message["message"] == failure.headline == "KeyError: 'recorded'"
    assert last_words(failure) is None
    report = str(ChildFailedError("job", result.failures))
    assert "of stderr" not in report


def test_tail_is_bounded_and_ends_with_the_last_bytes(tmp_path):
    # 4 MiB of stderr in many chunks: the ring wraps many times; what is kept
    # is exactly the file's last lines.
    code = ("import sys, os\n"
            "for i in range(60000): os.write(2, b'%06d ' % i + b'x' * 60 + b'\\n')\n"
            "sys.exit(5)\n")
    _, result = _run(tmp_path, {0: code}, tee=Std.ALL, stderr_tail=7)
    failure = result.failures[0]
    with open(result.stderrs[0], "rb") as f:
        expected = f.read().decode().splitlines()[-7:]
    assert failure.stderr_tail.splitlines() == expected
    assert failure.headline == expected[-1]


def test_cut_first_line_keeps_its_start_and_progress_bars_show_their_last_state(tmp_path):
    code = ("import os, sys\n"
            "os.write(2, b'y' * 5000 + b'\\n')\n"      # longer than the byte bound
            "os.write(2, b'10%\\r50%\\r100%\\n')\n"
            "sys.exit(2)\n")
    _, result = _run(tmp_path, {0: code}, tee=Std.ALL, stderr_tail=2)
    # 2 lines keep at most 800 bytes: the 5000-byte line is cut; its start
    # (400 bytes a line) is read back from the log file.
    assert result.failures[0].stderr_tail == "y" * 400 + " [... 4600 bytes cut]\n100%"


def test_stderr_tail_zero_turns_it_off(tmp_path):
    _, result = _run(tmp_path, {0: RAISES}, tee=Std.ALL, stderr_tail=0)
    failure = result.failures[0]
    assert failure.stderr_tail == ""
    assert failure.message == failure.headline == TO_ENABLE


def test_inherited_stderr_has_no_tail_unless_watched(tmp_path):
    # Through a launcher whose fd 2 we read: watch_stderr keeps the console
    # byte-identical (no prefix) and gives the failure its tail.
    script = f"""
        import json, sys
        import torchmp
        from torchmp import DefaultLogsSpecs
        import os
        for watch in (False, True):
            # the keyword, then the variable a torchrun user can set
            kw = {{"watch_stderr": True}} if watch else {{}}
            os.environ["TORCHMP_WATCH_STDERR"] = "0"
            ctx = torchmp.start_processes(
                "w", sys.executable, {{0: ("-c", {RAISES!r})}}, {{0: {{}}}},
                DefaultLogsSpecs(log_dir={str(tmp_path)!r}), **kw)
            r = ctx.wait(60)
            ctx.close()
            f = r.failures[0]
            print(json.dumps([watch, f.headline, f.stderr_tail]), flush=True)
        os.environ["TORCHMP_WATCH_STDERR"] = "1"
        ctx = torchmp.start_processes("w", sys.executable, {{0: ("-c", {RAISES!r})}}, {{0: {{}}}},
                                      DefaultLogsSpecs(log_dir={str(tmp_path)!r}))
        r = ctx.wait(60)
        ctx.close()
        print(json.dumps(["env", r.failures[0].headline, r.failures[0].stderr_tail]), flush=True)
        os.environ["TORCHMP_WATCH_STDERR"] = "maybe"
        try:
            torchmp.start_processes("w", sys.executable, {{0: ("-c", "pass")}}, {{0: {{}}}},
                                    DefaultLogsSpecs(log_dir={str(tmp_path)!r}))
        except ValueError as e:
            print(json.dumps(["bad", str(e), ""]), flush=True)
        """
    done = run_launcher(script)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.decode().splitlines()]
    assert rows[0] == [False, TO_ENABLE, ""]
    assert rows[1][0] is True and rows[1][1] == "ValueError: boom"
    assert rows[2][0] == "env" and rows[2][1] == "ValueError: boom"
    assert rows[1][2].startswith("loading\nTraceback (most recent call last):")
    # The worker's stderr reached the launcher's stderr unchanged, both times.
    err = done.stderr.decode()
    assert err.count("loading\nTraceback (most recent call last):\n") == 3
    assert rows[3] == ["bad", "TORCHMP_WATCH_STDERR must be 1 or 0 (true/false, yes/no), got 'maybe'", ""]
    assert "[w0]" not in err


def test_bad_tail_values_fail_before_anything_starts(tmp_path, monkeypatch):
    for bad in (-1, 1.5, "20", True):
        with pytest.raises(ValueError, match="stderr_tail"):
            launch(sys.executable, {0: ("-c", "pass")}, log_dir=tmp_path / "x", stderr_tail=bad)
    monkeypatch.setenv("TORCHMP_STDERR_TAIL", "lots")
    with pytest.raises(ValueError, match="TORCHMP_STDERR_TAIL"):
        launch(sys.executable, {0: ("-c", "pass")}, log_dir=tmp_path / "y")
    # DefaultLogsSpecs made the base directories; no run directory was made in them.
    assert list((tmp_path / "x").iterdir()) == [] and list((tmp_path / "y").iterdir()) == []
    monkeypatch.setenv("TORCHMP_STDERR_TAIL", "3")
    assert stderr_tail_bound() == 3
    assert stderr_tail_bound(5) == 5


def test_failure_fields_from_a_given_tail():
    tb = ('Traceback (most recent call last):\n  File "t.py", line 1, in <module>\n'
          '    f()\nRuntimeError: first line\nsecond line of the message')
    f = ProcessFailure(0, 10, 1, "/nonexistent", stderr_tail="noise\n" + tb)
    assert f.headline == "RuntimeError: first line"
    assert last_words(f) == tb
    # a tail with a header but no exception line is no traceback
    g = ProcessFailure(0, 11, 4, "/nonexistent", stderr_tail='Traceback (most recent call last):\n  File "x"')
    assert g.headline == '  File "x"'
    h = ProcessFailure(0, 12, -9, "/nonexistent", stderr_tail="", cause="killed by the kernel OOM killer")
    assert h.message == "Signal 9 (SIGKILL) received by PID 12; killed by the kernel OOM killer"


def test_torchrun_report_carries_the_last_words():
    pytest.importorskip("torch.distributed.elastic.multiprocessing")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError as TorchCFE

    from torchmp.torchrun import to_torch_failure

    tail = 'Traceback (most recent call last):\n  File "t.py", line 3, in main\nValueError: boom'
    f = ProcessFailure(1, 4242, 1, "/nonexistent", stderr_tail=tail)
    text = TorchCFE("job", {1: to_torch_failure(f)}).format_msg()
    assert ("  traceback : Traceback (most recent call last):\n    File \"t.py\", line 3, in main\n"
            "  ValueError: boom") in text
    assert os.environ.get("TORCHMP_NO_SUCH") is None
