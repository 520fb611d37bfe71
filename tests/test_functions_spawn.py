"""Function entrypoints: what is particular to the spawn start method (the
tests of every start method are in test_functions.py)."""
from __future__ import annotations

from pathlib import Path

import fn_workers as fw
from fn_helpers import forkserver_hygiene  # noqa: F401 (autouse: a fixture of this module)
from helpers import run_launcher


def test_spawn_worker_imports_nothing_heavy(tmp_path):
    # From a launcher whose __main__ is light (`python -c`): under the pytest
    # command, workers would re-import pytest's script as __mp_main__.
    heavy = ("torchmp.api", "torchmp.errors", "torchmp.logs_specs", "torchmp._functions", "logging", "json")
    res = run_launcher(f"""
        import sys
        sys.path.insert(0, {str(Path(fw.__file__).parent)!r})
        import fn_workers, torchmp
        ctx = torchmp.start_processes("t", fn_workers.loaded_modules, {{0: ({heavy!r},)}}, {{0: {{}}}},
                                      torchmp.DefaultLogsSpecs(log_dir={str(tmp_path)!r}), start_method="spawn")
        result = ctx.wait(60)
        ctx.close()
        print(result.return_values[0])
    """)
    assert res.returncode == 0, res.stderr
    assert res.stdout.decode().strip() == str(dict.fromkeys(heavy, False))
