"""The bench measures the torchmp under test, or refuses to run (issue 22); it
also refuses to start when a scenario it would run needs a module that does
not import (psutil, of the bench extra), and keeps the other scenarios'
figures when one fails.

``python -m bench`` from a checkout whose torchmp/ has no compiled core (the
state after ``pip install .``) used to mark torchmp UNAVAILABLE and go on
measuring the others.  Most of these tests run the bench's command line only
as far as choosing its subject: no benchmark runs (one runs the quick
fail-fast scenario of the floor alone).  They need the repository's
bench/ package (a source tree or an unpacked sdist) and skip without it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import torchmp

REPO = Path(__file__).resolve().parent.parent
SUBJECT_DIR = Path(torchmp.__file__).resolve().parent  # the torchmp these tests run against

pytestmark = pytest.mark.skipif(not (REPO / "bench" / "__main__.py").is_file(), reason="no bench/ beside tests/")


def _coreless_copy(dest: Path) -> Path:
    """torchmp's Python files without the compiled core: an unbuilt source tree."""
    pkg = dest / "torchmp"
    shutil.copytree(SUBJECT_DIR, pkg, ignore=shutil.ignore_patterns("_core.*.so", "_core.*.pyd", "__pycache__"))
    assert not list(pkg.glob("_core.*.so"))
    return pkg


def _bench(args: list[str], cwd: Path, pythonpath: str, bench_env: dict[str, str] | None = None,
           hidden: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """``python -m bench ARGS``; ``hidden``: modules that do not import there
    (a None in sys.modules, whatever sys.path holds: the bench puts its
    subject's home, maybe site-packages, first)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BENCH_")}
    env.update(bench_env or {})
    env["PYTHONPATH"] = pythonpath
    command = ["-m", "bench"]
    if hidden:
        command = ["-c", f"import runpy, sys; sys.modules.update(dict.fromkeys({list(hidden)!r})); "
                         "runpy.run_module('bench', run_name='__main__', alter_sys=True)"]
    return subprocess.run([sys.executable, *command, *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=120)


def test_bench_refuses_a_torchmp_without_its_compiled_core(tmp_path: Path) -> None:
    pkg = _coreless_copy(tmp_path / "src")
    out_json = tmp_path / "bench.json"
    # bench/ from the repository (the cwd), torchmp from PYTHONPATH: the unbuilt copy comes first,
    # and an installed torchmp further down must not be measured in its place.
    r = _bench(["--only", "launch", "--impl", "torchmp,floor", "--json", str(out_json),
                "--chart", str(tmp_path / "bench.png")], cwd=REPO, pythonpath=str(tmp_path / "src"))
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert f"refusing to run: the torchmp at {pkg} has no compiled core" in r.stderr, r.stderr
    assert "build_ext --inplace" in r.stderr and "pip install ." in r.stderr, r.stderr
    assert "[launch]" not in r.stderr and r.stdout == "", (r.stdout, r.stderr)  # nothing was measured
    assert not out_json.exists() and not (tmp_path / "bench.png").exists()


def test_bench_skips_the_unbuilt_checkout_it_runs_from(tmp_path: Path) -> None:
    # The state after `pip install .`: the cwd holds bench/ and a torchmp/ without a core; the
    # subject is the torchmp on PYTHONPATH (here: the one under test), not the cwd's copy.
    checkout = tmp_path / "checkout"
    _coreless_copy(checkout)
    shutil.copytree(REPO / "bench", checkout / "bench", ignore=shutil.ignore_patterns("__pycache__"))
    r = _bench(["--subject"], cwd=checkout, pythonpath=str(SUBJECT_DIR.parent))
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert r.stdout.startswith(f"torchmp {torchmp.__version__} from {SUBJECT_DIR}, core {SUBJECT_DIR}/_core."), r.stdout


def test_bench_subject_search_names_what_is_missing(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO))
    try:
        from bench import subject
    finally:
        sys.path.remove(str(REPO))
    with pytest.raises(subject.SubjectMissing, match="torchmp is not installed and not on PYTHONPATH"):
        subject.locate([str(tmp_path)])
    pkg = _coreless_copy(tmp_path / "src")
    with pytest.raises(subject.SubjectMissing, match=f"the torchmp at {pkg} has no compiled core"):
        subject.locate([str(tmp_path / "src"), str(SUBJECT_DIR.parent)])
    assert subject.locate([str(SUBJECT_DIR.parent)]) == str(SUBJECT_DIR)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_bench_says_where_its_log_directories_live_and_what_a_mkdir_costs(tmp_path: Path) -> None:
    # torch's layout makes 2 + N directories per launch: the header says what
    # one costs where the run's log directories are, and leaves nothing there.
    import json
    import tempfile

    for root in (Path(tempfile.mkdtemp(dir="/dev/shm")), tmp_path):
        try:
            out = subprocess.run(
                [sys.executable, "-c", "import json, sys; from bench.machine import log_dir_info; "
                 "print(json.dumps(log_dir_info(sys.argv[1])))", str(root)],
                cwd=REPO, capture_output=True, text=True, timeout=60, check=True).stdout
            info = json.loads(out)
            assert info["root"] == str(root)
            assert info["mkdir_us_median"] > 0
            assert list(root.iterdir()) == []
            if str(root).startswith("/dev/shm/"):
                assert (info["mount"], info["fstype"]) == ("/dev/shm", "tmpfs")
            else:
                assert info["fstype"] and info["source"]
        finally:
            if str(root).startswith("/dev/shm/"):
                shutil.rmtree(root, ignore_errors=True)


def test_bench_refuses_to_start_a_scenario_whose_module_does_not_import(tmp_path: Path) -> None:
    # A full run used to stop with an ImportError at the idle scenario, some
    # twenty minutes in, and write nothing.  Here psutil does not import:
    # the bench must say so before it measures anything.
    out_json = tmp_path / "bench.json"
    r = _bench(["--only", "idle", "--impl", "torchmp,floor", "--json", str(out_json),
                "--chart", str(tmp_path / "bench.png")], cwd=REPO, pythonpath=str(SUBJECT_DIR.parent),
               hidden=("psutil",))
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "refusing to run: the idle scenario needs psutil, which does not import here" in r.stderr, r.stderr
    assert "pip install '.[bench]'" in r.stderr, r.stderr
    assert "[idle]" not in r.stderr and "Traceback" not in r.stderr and r.stdout == "", (r.stdout, r.stderr)
    assert not out_json.exists() and not (tmp_path / "bench.png").exists()


def test_bench_names_only_the_modules_of_the_scenarios_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO))
    from bench import scenarios

    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil now raises ImportError
    assert scenarios.missing_modules(scenarios.ORDER) == {"idle": ["psutil"]}
    assert scenarios.missing_modules([s for s in scenarios.ORDER if s != "idle"]) == {}


def test_bench_keeps_what_it_measured_when_a_scenario_fails(tmp_path: Path) -> None:
    # A scenario that raises (here launch, whose sizes do not parse) used to
    # end the run with a traceback and nothing saved; the others' figures
    # are now kept, and the exit status says that one failed.
    import json

    out_json = tmp_path / "bench.json"
    r = _bench(["--quick", "--only", "launch,failfast", "--impl", "floor", "--json", str(out_json),
                "--chart", str(tmp_path / "bench.png")], cwd=REPO, pythonpath=str(SUBJECT_DIR.parent),
               bench_env={"BENCH_LAUNCH_SIZES": "not-a-size"})
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "bench: the launch scenario failed; going on with the others" in r.stderr, r.stderr
    assert "[failfast]" in r.stderr and "1 scenario(s) failed (launch)" in r.stderr, r.stderr
    assert "FAILED: the launch scenario: ValueError" in r.stdout, r.stdout
    doc = json.loads(out_json.read_text())
    assert "ValueError" in doc["failed_scenarios"]["launch"]
    assert "launch" not in doc["scenarios"] and doc["scenarios"]["failfast"]
