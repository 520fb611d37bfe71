"""Packaging (issue 7): the compiled core against its stub and its version,
the files a wheel must carry, and the release configuration.

The first group of checks runs wherever torchmp is imported from: a source
tree, an installed wheel, a wheel under cibuildwheel.  The second reads the
project's own files (wheels.yml, pyproject.toml, setup.py) and skips when the
tests run from a copy outside the repository.  .ci/packaging runs this file
against an installed wheel from the repository with TORCHMP_EXPECT_INSTALLED=1
(and TORCHMP_ACTIONLINT pointing at actionlint), and the whole suite from the
portable build with TORCHMP_EXPECT_PORTABLE=1.

This file needs no fixture of tests/conftest.py, so on macOS (no /proc, which
the conftest fixtures read) it runs with ``--noconftest``.
"""
from __future__ import annotations

import ast
import enum
import importlib.metadata
import inspect
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest

import torchmp
from torchmp import _core

PKG = Path(torchmp.__file__).resolve().parent
REPO = Path(__file__).resolve().parent.parent
STUB = PKG / "_core.pyi"

# The project's own files are there only in a source tree (or an unpacked sdist).
in_source_tree = pytest.mark.skipif(
    not (REPO / "pyproject.toml").is_file() or not (REPO / "setup.py").is_file(),
    reason="not running from a source tree",
)
# The workflow is in the repository, not in the sdist.
in_repository = pytest.mark.skipif(
    not os.path.lexists(REPO / "wheels.yml") and not (REPO / ".github").exists(),
    reason="not running from a repository checkout",
)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


# --------------------------------------------------------------------------- the stub


def _stub_tree() -> ast.Module:
    return ast.parse(STUB.read_text(encoding="utf-8"), filename=str(STUB))


def _public(name: str) -> bool:
    return not name.startswith("_") or name == "__version__"


def _stub_names(body: list[ast.stmt]) -> dict[str, ast.stmt]:
    names: dict[str, ast.stmt] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = node
    return names


def _stub_params(fn: ast.FunctionDef) -> list[tuple[str, Any, bool]]:
    """(name, kind, has_default) for each parameter, as inspect would see it."""
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [False] * (len(positional) - len(a.defaults)) + [True] * len(a.defaults)
    params = [
        (arg.arg, inspect.Parameter.POSITIONAL_ONLY if i < len(a.posonlyargs)
         else inspect.Parameter.POSITIONAL_OR_KEYWORD, defaults[i])
        for i, arg in enumerate(positional)
    ]
    if a.vararg:
        params.append((a.vararg.arg, inspect.Parameter.VAR_POSITIONAL, False))
    params += [(arg.arg, inspect.Parameter.KEYWORD_ONLY, d is not None)
               for arg, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)]
    if a.kwarg:
        params.append((a.kwarg.arg, inspect.Parameter.VAR_KEYWORD, False))
    return params


def _runtime_params(obj: Any) -> list[tuple[str, Any, bool]]:
    sig = inspect.signature(obj)
    return [(p.name, p.kind, p.default is not inspect.Parameter.empty) for p in sig.parameters.values()]


def _drop_self(params: list[tuple[str, Any, bool]]) -> list[tuple[str, Any, bool]]:
    return params[1:] if params and params[0][0] == "self" else params


def _is_property(fn: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list)


def test_typing_files_ship_with_the_package() -> None:
    assert (PKG / "py.typed").is_file(), f"{PKG} has no py.typed marker"
    assert STUB.is_file(), f"{PKG} has no _core.pyi stub"


def test_stub_and_core_have_the_same_public_names() -> None:
    stub = {n for n in _stub_names(_stub_tree().body) if _public(n)}
    runtime = {n for n in dir(_core) if _public(n)}
    assert sorted(runtime - stub) == [], f"in {_core.__file__} but not declared in {STUB}"
    assert sorted(stub - runtime) == [], f"declared in {STUB} but not in {_core.__file__}"


def test_stub_constants_have_the_runtime_types() -> None:
    kinds = {"int": int, "bool": bool, "str": str, "float": float}
    for name, node in _stub_names(_stub_tree().body).items():
        if not (_public(name) and isinstance(node, ast.AnnAssign)):
            continue
        annotation = ast.unparse(node.annotation)
        match = re.fullmatch(r"(?:Final\[)?(\w+)\]?", annotation)
        assert match, f"{name}: unexpected annotation {annotation}"
        kind = kinds.get(match.group(1)) or getattr(_core, match.group(1), None)
        assert isinstance(kind, type), f"{name}: unexpected annotation {annotation}"
        assert type(getattr(_core, name)) is kind, name


def test_stub_function_signatures_match_the_core() -> None:
    checked = 0
    for name, node in _stub_names(_stub_tree().body).items():
        if isinstance(node, ast.FunctionDef) and _public(name):
            assert _stub_params(node) == _runtime_params(getattr(_core, name)), f"_core.{name}"
            checked += 1
    assert checked >= 8


def test_stub_classes_match_the_core() -> None:
    classes = [n for n in _stub_tree().body if isinstance(n, ast.ClassDef)]
    assert {c.name for c in classes} >= {"Group", "SpawnError"}
    for cls in classes:
        runtime = getattr(_core, cls.name)
        if [ast.unparse(b) for b in cls.bases] == ["NamedTuple"]:
            # a record of the boundary: the same fields, in the same order
            fields = [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)]
            assert issubclass(runtime, tuple) and list(runtime._fields) == fields, cls.name
            continue
        if [ast.unparse(b) for b in cls.bases] == ["IntEnum"]:
            # modes and states: the same members, in the same order
            names = [t.id for n in cls.body if isinstance(n, ast.Assign) for t in n.targets]
            assert issubclass(runtime, enum.IntEnum) and list(runtime.__members__) == names, cls.name
            continue
        assert [ast.unparse(b) for b in cls.bases] == [b.__name__ for b in runtime.__bases__
                                                       if b is not object], cls.name
        members = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef) and _public(n.name)}
        runtime_members = {n for n in vars(runtime) if _public(n)}
        if issubclass(runtime, BaseException):
            continue  # its attributes are set per instance: see the SpawnError test
        assert sorted(runtime_members - set(members)) == [], f"_core.{cls.name}: not in the stub"
        assert sorted(set(members) - runtime_members) == [], f"_core.{cls.name}: not in the core"
        for name, fn in members.items():
            attr = getattr(runtime, name)
            if _is_property(fn):
                assert inspect.isdatadescriptor(attr) and not callable(attr), f"{cls.name}.{name}"
            else:
                assert _drop_self(_stub_params(fn)) == _drop_self(_runtime_params(attr)), \
                    f"_core.{cls.name}.{name}"


def test_stub_group_constructor_matches_the_core() -> None:
    # Group's __cinit__ has no introspectable signature: call it with every
    # parameter of the stub's __init__, by keyword.
    group_cls = next(n for n in _stub_tree().body if isinstance(n, ast.ClassDef) and n.name == "Group")
    init = next(n for n in group_cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    values = {"nprocs": 1}
    kwargs = {}
    for name, _, _ in _drop_self(_stub_params(init)):
        kwargs[name] = values.get(name, -1 if name.endswith("_fd") else None)
    group = _core.Group(**kwargs)
    try:
        assert group.nprocs == 1 and group.started == 0
    finally:
        group.release()


def test_stub_spawn_error_attributes_exist() -> None:
    spawn_error = next(n for n in _stub_tree().body if isinstance(n, ast.ClassDef) and n.name == "SpawnError")
    declared = [n.target.id for n in spawn_error.body
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    inherit = (_core.STREAM_INHERIT, -1, -1, None)
    group = _core.Group(1)
    try:
        with pytest.raises(_core.SpawnError) as info:
            group.spawn([(b"/nonexistent/torchmp-packaging-test", [b"x"], [], inherit, inherit, inherit, -1)])
    finally:
        group.release()
    assert declared and all(hasattr(info.value, name) for name in declared), declared
    assert isinstance(info.value.cause, FileNotFoundError)


def test_portable_build_uses_the_poll_backend() -> None:
    if _env_flag("TORCHMP_EXPECT_PORTABLE"):
        assert _core.PORTABLE_BUILD, f"{_core.__file__} is not a portable build"
    if _core.PORTABLE_BUILD:
        assert _core.backend() == "poll"


# --------------------------------------------------------------------------- version


def test_version_is_single_sourced() -> None:
    assert torchmp.__version__ == _core.__version__
    assert not (PKG / "_version.py").exists()  # one place only: torchmp/__init__.py
    try:
        dist = importlib.metadata.distribution("torchmp")
    except importlib.metadata.PackageNotFoundError:
        return
    # Only when the installed distribution is the torchmp under test.
    if Path(str(dist.locate_file("torchmp/__init__.py"))).resolve() == Path(torchmp.__file__).resolve():
        assert dist.version == torchmp.__version__


def test_version_mismatch_fails_at_import_naming_the_core(tmp_path: Path) -> None:
    # A package whose version moved on without rebuilding _core: what a
    # source checkout looks like after a version bump and no rebuild.
    copy = tmp_path / "torchmp"
    shutil.copytree(PKG, copy, ignore=shutil.ignore_patterns("__pycache__"))
    init = (copy / "__init__.py").read_text(encoding="utf-8")
    bumped = re.sub(r'^__version__ = "[^"]+"$', '__version__ = "0.0.0+stale"', init, count=1, flags=re.M)
    assert bumped != init
    (copy / "__init__.py").write_text(bumped, encoding="utf-8")
    core = Path(_core.__file__)
    stale_core = copy / core.relative_to(PKG)
    assert stale_core.is_file()
    # -I: no PYTHONPATH, no user site, no cwd on sys.path -- only the copy.
    code = f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import torchmp"
    proc = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True,
                          cwd=tmp_path, timeout=60)
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: "), proc.stderr
    assert str(stale_core) in last
    assert "0.0.0+stale" in last and _core.__version__ in last


@in_source_tree
def test_setup_py_compiles_the_version_from_the_package_s_init() -> None:
    # Run setup.py's own reader (not the whole setup.py, which would build).
    source = (REPO / "setup.py").read_text(encoding="utf-8")
    tree = ast.parse(source)
    reader = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_version")
    namespace: dict[str, Any] = {"os": os, "re": re, "HERE": str(REPO)}
    exec(compile(ast.Module(body=[reader], type_ignores=[]), "setup.py", "exec"), namespace)
    init_py = (REPO / "torchmp" / "__init__.py").read_text(encoding="utf-8")
    assert re.findall(r'^__version__ = "([^"]+)"$', init_py, re.M) == [namespace["_version"]()]
    assert '("TORCHMP_VERSION"' in source  # ... and it is what _core reports
    pyproject = _pyproject()
    assert "version" not in pyproject["project"] and "version" in pyproject["project"]["dynamic"]


# --------------------------------------------------------------------------- installed wheel


@pytest.mark.skipif(not _env_flag("TORCHMP_EXPECT_INSTALLED"), reason="TORCHMP_EXPECT_INSTALLED is not set")
def test_torchmp_is_the_installed_wheel() -> None:
    site = {Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")}
    for path in (torchmp.__file__, _core.__file__):
        assert any(Path(path).resolve().is_relative_to(s) for s in site), f"{path} is not installed"
    dist = importlib.metadata.distribution("torchmp")
    files = {str(f) for f in dist.files or ()}
    assert {"torchmp/py.typed", "torchmp/_core.pyi"} <= files
    assert any(re.fullmatch(r"torchmp/_core\..*(\.so|\.pyd)", f) for f in files)
    assert not any(f.startswith(("csrc/", "tests/")) for f in files)
    meta = dist.metadata
    assert meta["License-Expression"] == "BSD-3-Clause"
    assert meta["Requires-Python"] == ">=3.10"
    assert {"test", "bench"} <= set(meta.get_all("Provides-Extra") or ())
    assert meta["Description-Content-Type"] == "text/markdown"
    body = (dist.read_text("METADATA") or "").split("\n\n", 1)[-1]
    assert "torchmp" in body and len(body) > 500, "no long description (from README.md)"
    assert any(str(f).endswith("licenses/LICENSE") for f in dist.files or ())


# --------------------------------------------------------------------------- project files


def _pyproject() -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        tomllib = pytest.importorskip("tomli")
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _workflow() -> dict[Any, Any]:
    yaml = pytest.importorskip("yaml")
    path = REPO / "wheels.yml"
    if not path.exists():
        pytest.skip("no wheels.yml here")
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    assert isinstance(data, dict)
    return data


def _steps(job: dict[str, Any]) -> list[dict[str, Any]]:
    return list(job.get("steps", []))


@in_repository
def test_wheels_yml_is_one_file_that_github_reads() -> None:
    real = REPO / ".github" / "workflows" / "wheels.yml"
    root = REPO / "wheels.yml"
    assert real.is_file() and not real.is_symlink(), "GitHub reads only a real file in .github/workflows/"
    assert root.is_symlink(), "wheels.yml at the root must be a symlink, not a second copy"
    assert os.readlink(root) == ".github/workflows/wheels.yml"
    assert root.resolve() == real.resolve()


@in_repository
def test_wheels_yml_names_its_jobs_and_the_cibuildwheel_step() -> None:
    wf = _workflow()
    triggers = wf.get("on", wf.get(True))  # YAML 1.1 reads a bare `on` as True
    assert {"push", "pull_request", "workflow_dispatch"} <= set(triggers)
    jobs = wf["jobs"]
    assert set(jobs) == {"build_wheels", "build_sdist"}

    wheels = jobs["build_wheels"]
    matrix = wheels["strategy"]["matrix"]["include"]
    assert {(m["runner"].split("-")[0], m["archs"]) for m in matrix} == {
        ("ubuntu", "x86_64"), ("ubuntu", "aarch64"), ("macos", "arm64"), ("macos", "x86_64"),
    }
    steps = _steps(wheels)
    cibw = [s for s in steps if "-m cibuildwheel" in s.get("run", "")
            or str(s.get("uses", "")).startswith("pypa/cibuildwheel")]
    assert len(cibw) == 1, "one cibuildwheel step"
    assert cibw[0]["env"]["CIBW_ARCHS"] == "${{ matrix.archs }}"
    installs = [s["run"] for s in steps if "pip install cibuildwheel==" in s.get("run", "")]
    assert installs, "cibuildwheel is pinned"
    uploads = [s for s in steps if str(s.get("uses", "")).startswith("actions/upload-artifact@")]
    assert uploads and uploads[0]["with"]["path"] == "wheelhouse/*.whl"

    sdist = _steps(jobs["build_sdist"])
    assert any("python -m build --sdist" in s.get("run", "") for s in sdist)
    assert any(re.search(r'pytest"? tests', s.get("run", "")) for s in sdist), "the sdist is tested"
    uploads = [s for s in sdist if str(s.get("uses", "")).startswith("actions/upload-artifact@")]
    assert uploads and uploads[0]["with"]["path"] == "dist/*.tar.gz"


@in_repository
def test_wheels_yml_passes_actionlint() -> None:
    actionlint = os.environ.get("TORCHMP_ACTIONLINT") or shutil.which("actionlint")
    if not actionlint:
        pytest.skip("actionlint is not installed (.ci/packaging installs it)")
    proc = subprocess.run([actionlint, "wheels.yml"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@in_source_tree
def test_pyproject_configures_cibuildwheel() -> None:
    cibw = _pyproject()["tool"]["cibuildwheel"]
    assert cibw["build"] == ["cp310-*", "cp311-*", "cp312-*", "cp313-*"]
    assert cibw["test-extras"] == ["test"]
    assert "tests" in cibw["test-sources"]
    assert cibw["test-command"].startswith("pytest tests")
    macos = cibw["macos"]
    assert macos["environment"]["TORCHMP_PORTABLE"] == "1"
    assert macos["test-environment"]["TORCHMP_BACKEND"] == "poll"
    assert any("pytest" in c for c in macos["test-command"])


@in_source_tree
def test_pyproject_metadata() -> None:
    project = _pyproject()["project"]
    assert project["license"] == "BSD-3-Clause"
    assert project["license-files"] == ["LICENSE"] and (REPO / "LICENSE").is_file()
    assert "BSD 3-Clause" in (REPO / "LICENSE").read_text(encoding="utf-8")
    assert project["requires-python"] == ">=3.10"
    assert project["readme"] == "README.md" and (REPO / "README.md").is_file()
    assert {"test", "bench"} <= set(project["optional-dependencies"])
    classifiers = set(project["classifiers"])
    assert {f"Programming Language :: Python :: 3.{v}" for v in (10, 11, 12, 13)} <= classifiers
    assert "Typing :: Typed" in classifiers
    # setuptools refuses a License classifier next to a license expression.
    assert not any(c.startswith("License ::") for c in classifiers)
