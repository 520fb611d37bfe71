"""A Python rank that crashes in native code shows its Python stack.

``torchmp run`` sets ``PYTHONFAULTHANDLER=1`` in its ranks unless the user
set it (in the launcher's environment, which the ranks inherit, or with
``--env``; an empty value means off, as CPython reads it) or passed
``--no-faulthandler``.  The library (``start_processes``) passes the
environment as given.

The crashes are real: ``ctypes.string_at(0)`` reads address 0 (SIGSEGV).
Every launch carries a unique ``TORCHMP_TEST_TAG`` its workers inherit;
cleanup kills leftovers by that tag and by the launcher's process group.
"""
from __future__ import annotations

import re
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from torchmp import Std

from helpers import Launcher, launch, python_worker, wait_no_tagged

CRASH = textwrap.dedent("""\
    import ctypes


    def crash():
        ctypes.string_at(0)


    print("about to crash", flush=True)
    crash()
""")


def run_cli(args: list[str], cwd: Path, env: dict[str, str] | None = None,
            drop: tuple[str, ...] = ("PYTHONFAULTHANDLER",), timeout: float = 30) -> tuple[int, str, str]:
    """``python -m torchmp run ...`` to completion, from ``cwd`` (outside the
    source tree); ``drop``: variables removed from its environment (then
    ``env`` is set on top)."""
    with Launcher([sys.executable, "-m", "torchmp", "run", *args], env=env, cwd=cwd,
                  unset=("TORCHELASTIC_SIGNALS_TO_HANDLE", *drop)) as launcher:
        result = launcher.communicate(timeout)
        assert wait_no_tagged(launcher.tag) == []
        return result


def attempt_dir(stderr: str) -> Path:
    m = re.search(r"^torchmp: log directory: (.+)$", stderr, re.M)
    assert m, stderr
    return Path(m.group(1))


@pytest.fixture
def crash_script(tmp_path: Path) -> Path:
    path = tmp_path / "crash.py"
    path.write_text(CRASH)
    return path


def assert_python_stack(text: str, script: Path) -> None:
    assert "Fatal Python error: Segmentation fault" in text, text
    # The frames, innermost first: crash() at line 5, called from line 9.
    assert re.search(rf'File "{re.escape(str(script))}", line 5 in crash', text), text
    assert re.search(rf'File "{re.escape(str(script))}", line 9 in <module>', text), text


def test_segfault_shows_python_stack_in_redirected_log(tmp_path, crash_script):
    code, out, err = run_cli(["-n", "1", "--redirects", "2", "--log-dir", str(tmp_path / "logs"),
                              "--", sys.executable, str(crash_script)], cwd=tmp_path)
    assert code == 128 + signal.SIGSEGV, err
    log = (attempt_dir(err) / "0" / "stderr.log").read_text()
    assert_python_stack(log, crash_script)
    assert "[crash0]:about to crash" in out
    assert "SIGSEGV" in err  # the summary names the signal


def test_segfault_shows_python_stack_teed(tmp_path, crash_script):
    code, out, err = run_cli(["-n", "2", "--log-dir", str(tmp_path / "logs"),
                              "--", sys.executable, str(crash_script)], cwd=tmp_path)
    assert code == 128 + signal.SIGSEGV, err
    attempt = attempt_dir(err)
    # Both ranks crash, but the fail-fast may stop one before its own crash,
    # or in the middle of its dump (its SIGTERM ends the dump): the ranks
    # that crashed are the ones the summary shows dead of SIGSEGV.
    crashed = [int(r) for r in re.findall(r"^\s*(\d+)\s+\d+\s+SIGSEGV\s", err, re.M)]
    assert crashed, err
    for rank in crashed:
        assert_python_stack((attempt / str(rank) / "stderr.log").read_text(), crash_script)
        assert f"[crash{rank}]:Fatal Python error: Segmentation fault" in err


def test_no_faulthandler_option(tmp_path, crash_script):
    code, _, err = run_cli(["-n", "1", "--redirects", "2", "--no-faulthandler",
                            "--log-dir", str(tmp_path / "logs"), "--", sys.executable, str(crash_script)],
                           cwd=tmp_path)
    assert code == 128 + signal.SIGSEGV, err
    log = (attempt_dir(err) / "0" / "stderr.log").read_text()
    assert "Fatal Python error" not in log and "File " not in log, log


@pytest.mark.parametrize("how", ["launcher-env", "env-option"])
def test_users_empty_setting_is_respected(tmp_path, crash_script, how):
    # CPython enables faulthandler for any non-empty value ("0" included):
    # empty is how a user turns it off, and torchmp must not override it.
    args = ["-n", "1", "--redirects", "2", "--log-dir", str(tmp_path / "logs")]
    env = None
    if how == "launcher-env":
        env = {"PYTHONFAULTHANDLER": ""}
    else:
        args += ["--env", "PYTHONFAULTHANDLER="]
    code, _, err = run_cli([*args, "--", sys.executable, str(crash_script)], cwd=tmp_path, env=env)
    assert code == 128 + signal.SIGSEGV, err
    log = (attempt_dir(err) / "0" / "stderr.log").read_text()
    assert "Fatal Python error" not in log, log


SHOW = "import os, faulthandler; print(repr(os.environ.get('PYTHONFAULTHANDLER')), faulthandler.is_enabled())"


@pytest.mark.parametrize("args, env, expected", [
    ([], None, "'1' True"),
    (["--no-faulthandler"], None, "None False"),
    ([], {"PYTHONFAULTHANDLER": ""}, "'' False"),
    ([], {"PYTHONFAULTHANDLER": "yes"}, "'yes' True"),
    (["--env", "PYTHONFAULTHANDLER="], None, "'' False"),
    (["--env", "PYTHONFAULTHANDLER="], {"PYTHONFAULTHANDLER": "1"}, "'' False"),
    # --no-faulthandler: torchmp sets nothing; the user's own setting stays.
    (["--no-faulthandler"], {"PYTHONFAULTHANDLER": "1"}, "'1' True"),
])
def test_what_the_rank_sees(tmp_path, args, env, expected):
    # --name: the default name is the interpreter's base name (python, python3, ...)
    code, out, err = run_cli(["-n", "2", "--no-summary", "--name", "job", "--log-dir", str(tmp_path / "logs"),
                              *args, "--", sys.executable, "-c", SHOW], cwd=tmp_path, env=env)
    assert code == 0, err
    assert sorted(out.splitlines()) == [f"[job0]:{expected}", f"[job1]:{expected}"]


def test_library_keeps_the_environment_as_given(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTHONFAULTHANDLER", raising=False)
    entry, args = python_worker(SHOW)
    ctx = launch(entry, {0: args, 1: args}, {0: {}, 1: {"X": "1"}}, log_dir=tmp_path, redirects=Std.OUT)
    try:
        result = ctx.wait(30)
        assert result is not None and not result.is_failed()
        for rank in range(2):
            assert Path(result.stdouts[rank]).read_text() == "None False\n"
    finally:
        ctx.close()
