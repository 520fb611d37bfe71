"""torchmp.redirects: fd-level redirection of the launcher's own streams."""
from __future__ import annotations

import os

import pytest

from torchmp.redirects import redirect, redirect_stdout

from helpers import run_launcher


# pytest replaces sys.stdout/sys.stderr, so the Python-level parts run in a
# fresh interpreter whose streams are the real fds.

def test_redirect_stdout_captures_python_c_and_subprocess_output(tmp_path):
    path = tmp_path / "out.log"
    res = run_launcher(f"""
        import ctypes, subprocess
        from torchmp.redirects import redirect_stdout
        print("before")
        with redirect_stdout({str(path)!r}):
            print("python line")
            ctypes.CDLL(None).printf(b"c line\\n")  # left in C stdio's buffer: the redirect flushes it
            subprocess.run(["sh", "-c", "echo subprocess line"], check=True)
        print("after")
    """)
    assert res.returncode == 0, res.stderr
    assert path.read_bytes() == b"python line\nc line\nsubprocess line\n"
    assert res.stdout == b"before\nafter\n"


def test_redirect_stderr_and_truncation(tmp_path):
    path = tmp_path / "err.log"
    path.write_bytes(b"old content that must go\n")
    res = run_launcher(f"""
        import os, sys
        from torchmp.redirects import redirect_stderr
        with redirect_stderr({str(path)!r}):
            os.write(2, b"\\xff raw bytes\\n")
            print("py err", file=sys.stderr)
        print("restored", file=sys.stderr)
    """)
    assert path.read_bytes() == b"\xff raw bytes\npy err\n"
    assert res.stderr == b"restored\n"


def test_nested_and_restored_on_exception(tmp_path, capfd):
    a, b = tmp_path / "a", tmp_path / "b"
    with pytest.raises(RuntimeError):
        with redirect_stdout(a):
            os.write(1, b"1\n")
            with redirect_stdout(b):
                os.write(1, b"2\n")
                raise RuntimeError("boom")
    os.write(1, b"3\n")
    assert a.read_bytes() == b"1\n" and b.read_bytes() == b"2\n"
    assert capfd.readouterr().out == "3\n"


def test_bad_stream_and_unopenable_file_leave_nothing_changed(tmp_path, capfd):
    with pytest.raises(ValueError, match="unknown standard stream"):
        with redirect("stdin", tmp_path / "x"):
            pass
    with pytest.raises(FileNotFoundError):
        with redirect_stdout(tmp_path / "missing" / "x"):
            pass
    os.write(1, b"still console\n")
    assert capfd.readouterr().out == "still console\n"
