"""Function entrypoints: what is particular to the spawn start method (the
tests of every start method are in test_functions.py)."""
from __future__ import annotations

import functools
import os
import signal
from pathlib import Path

import pytest

from workers import functions as fw
import torchmp
from torchmp import DefaultLogsSpecs, SignalException
from fn_helpers import forkserver_hygiene  # noqa: F401 (autouse: a fixture of this module)
from helpers import run_launcher


def test_spawn_worker_imports_nothing_heavy(tmp_path):
    # From a launcher whose __main__ is light (`python -c`): under the pytest
    # command, workers would re-import pytest's script as __mp_main__.
    heavy = ("torchmp.api", "torchmp.errors", "torchmp.logs_specs", "torchmp._functions", "logging", "json")
    res = run_launcher(f"""
        import sys
        sys.path.insert(0, {str(Path(fw.__file__).parent.parent)!r})
        import torchmp
        from workers import functions as fn_workers
        ctx = torchmp.start_processes("t", fn_workers.loaded_modules, {{0: ({heavy!r},)}}, {{0: {{}}}},
                                      torchmp.DefaultLogsSpecs(log_dir={str(tmp_path)!r}), start_method="spawn")
        result = ctx.wait(60)
        ctx.close()
        print(result.return_values[0])
    """)
    assert res.returncode == 0, res.stderr
    assert res.stdout.decode().strip() == str(dict.fromkeys(heavy, False))


class _InterruptsPickling:
    """An argument whose pickling is cut short by a handled signal."""

    def __reduce__(self):
        raise SignalException("Process 1 got signal: SIGTERM", sigval=signal.SIGTERM)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
@pytest.mark.parametrize("where", ["entrypoint", "args"])
def test_a_signal_during_the_pickle_check_stops_the_launch_as_a_signal(tmp_path, method, where):
    # A SignalException is an Exception (as torch's is): the pickle check
    # must not take it for an unpicklable payload (CI's interrupted
    # forkserver launch got "entrypoint sleep cannot be pickled").
    entry = functools.partial(os.getpid, _InterruptsPickling()) if where == "entrypoint" else os.getpid
    args = {0: (_InterruptsPickling(),)} if where == "args" else {0: ()}
    with pytest.raises(SignalException):
        torchmp.start_processes("w", entry, args, {0: {}}, DefaultLogsSpecs(log_dir=str(tmp_path)),
                                start_method=method)
    assert not any(tmp_path.iterdir())  # refused before anything was made


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_fresh_interpreter_puts_the_directory_holding_torchmp_first_on_its_path(tmp_path, method):
    # Its `-c` points sys.path[0] at the torchmp the launcher runs (not at
    # the current directory, where an unbuilt checkout may sit).  It named
    # the torchmp package's own directory once the launch code moved into
    # torchmp/_launch/, putting api, numa, redirects... first on the path.
    from fn_helpers import run

    result = run(tmp_path, fw.interpreter_cmdline, {0: ()}, method)
    home = os.path.dirname(os.path.dirname(os.path.abspath(torchmp.__file__)))
    assert f"sys.path[0] = {home!r};" in result.return_values[0]
