"""torchmp's modules import one another without a cycle (function-level
imports included), apart from one documented patch point: PContext.start
reaches the handlers through ``torchmp.api`` at call time, because torch's
tests replace ``api.signal``, ``api.threading`` and ``api.logger`` and expect
start() to use the replacements.  The second half pins that behaviour."""
from __future__ import annotations

import ast
import signal
from pathlib import Path
from unittest import mock

import torchmp
from torchmp import DefaultLogsSpecs, api

from helpers import run_launcher

ROOT = Path(torchmp.__file__).parent

#: The one edge allowed to close a cycle (api -> _native -> _pcontext -> api),
#: and only as a function-level import.
PATCH_POINT = ("torchmp._pcontext", "torchmp.api")


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _type_checking_only(tree: ast.AST) -> set[int]:
    """The nodes under ``if TYPE_CHECKING:`` (never run)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
            if name == "TYPE_CHECKING":
                skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def _targets(module: str, path: Path, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> set[str]:
    """The torchmp modules an import statement runs: the named module, a
    submodule imported by name, and the packages between (a package's
    ``__init__`` runs first), but not the importer's own packages, which are
    already being imported when it runs."""
    named: set[str] = set()
    if isinstance(node, ast.Import):
        named.update(a.name for a in node.names)
    else:
        base = node.module or ""
        if node.level:
            package = module if path.name == "__init__.py" else module.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{base}" if base else package
        named.add(base)
        named.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules)
    ran: set[str] = set()
    for name in named:
        parts = name.split(".")
        if parts[0] != "torchmp":
            continue
        ran.update(".".join(parts[:i]) for i in range(2, len(parts) + 1))
    own_packages = {module.rsplit(".", i)[0] for i in range(1, module.count(".") + 1)}
    return {t for t in ran if t in modules and t != module and t not in own_packages}


def import_graph() -> dict[str, dict[str, bool]]:
    """module -> {imported module: whether only at function level}."""
    modules = _modules()
    graph: dict[str, dict[str, bool]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_only(tree)
        top_level = {id(n) for n in tree.body}
        edges: dict[str, bool] = {}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skip:
                lazy = id(node) not in top_level
                for target in _targets(module, path, node, modules):
                    edges[target] = edges.get(target, True) and lazy
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, dict[str, bool]]) -> list[str] | None:
    """One cycle of the graph (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, {})):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            found = visit(module)
            if found:
                return found
    return None


def test_the_graph_sees_function_level_imports_and_packages():
    graph = import_graph()
    assert graph["torchmp._pcontext"][PATCH_POINT[1]] is True  # function-level
    assert graph["torchmp.cli.job"]["torchmp.api"] is False  # module level
    # Importing a package's module runs the package first; a module's own
    # package is not an edge (it is being imported already).
    assert "torchmp.cli" in graph["torchmp.__main__"]
    assert "torchmp.cli" not in graph["torchmp.cli.main"]
    assert find_cycle({"a": {"b": False}, "b": {"c": True}, "c": {"a": True}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": False}, "b": {}}) is None


def test_the_import_graph_is_a_dag_apart_from_the_documented_patch_point():
    graph = import_graph()
    # The patch point is still there (else this allowance should go) and
    # is a function-level import, never a module-level one.
    assert graph[PATCH_POINT[0]].get(PATCH_POINT[1]) is True
    del graph[PATCH_POINT[0]][PATCH_POINT[1]]
    assert find_cycle(graph) is None


# ---------------------------------------------------------------------------
# The patch point: start() looks up api.signal, api.threading and api.logger
# when it runs, as torch's tests expect.


def _context(tmp_path: Path) -> torchmp.PContext:
    specs = DefaultLogsSpecs(log_dir=str(tmp_path / "logs"))
    return torchmp.SubprocessContext("patched", "true", {0: ()}, {0: {}}, specs)


def test_start_installs_the_handlers_through_api_signal_and_api_logger(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGUSR1")
    real_term, real_usr1 = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)
    fake_signal, fake_threading, fake_logger = mock.MagicMock(), mock.MagicMock(), mock.MagicMock()
    fake_threading.current_thread.return_value = fake_threading.main_thread.return_value
    ctx = _context(tmp_path)
    with mock.patch.object(api, "signal", fake_signal), mock.patch.object(api, "threading", fake_threading), \
            mock.patch.object(api, "logger", fake_logger):
        try:
            ctx.start()
        finally:
            ctx.close()
    assert fake_signal.signal.call_args_list == [
        mock.call(fake_signal.SIGTERM, api._terminate_process_handler),
        mock.call(fake_signal.SIGUSR1, api._terminate_process_handler),
    ]
    fake_logger.info.assert_any_call("Registered signal handler for %s", "SIGTERM")
    fake_logger.info.assert_any_call("Registered signal handler for %s", "SIGUSR1")
    # Only the replacements were touched.
    assert signal.getsignal(signal.SIGTERM) is real_term
    assert signal.getsignal(signal.SIGUSR1) is real_usr1


def test_start_off_the_main_thread_as_api_threading_says_warns_through_api_logger(tmp_path):
    fake_signal, fake_threading, fake_logger = mock.MagicMock(), mock.MagicMock(), mock.MagicMock()
    fake_threading.current_thread.return_value = object()  # not main_thread()
    ctx = _context(tmp_path)
    with mock.patch.object(api, "signal", fake_signal), mock.patch.object(api, "threading", fake_threading), \
            mock.patch.object(api, "logger", fake_logger):
        try:
            ctx.start()
            assert ctx.wait(30) is not None  # the workers started all the same
        finally:
            ctx.close()
    fake_signal.signal.assert_not_called()
    fake_logger.warning.assert_called_once_with(
        "Failed to register signal handlers since torchelastic is running on a child thread. "
        "This could lead to orphaned worker processes if the torchrun is terminated.")


def test_a_launch_imports_no_module_of_its_own(tmp_path):
    # A program's first launch pays for every module it imports (a search of
    # sys.path, a dlopen for an extension): what a binary launch, its
    # failure report and run() need comes with the names themselves.
    result = run_launcher(f"""
        import sys, torchmp
        from torchmp import DefaultLogsSpecs, Std, run, start_processes
        before = set(sys.modules)
        specs = DefaultLogsSpecs(log_dir={str(tmp_path)!r}, redirects=Std.ERR, tee=Std.OUT)
        ctx = start_processes("w", "sh", {{0: ("-c", "echo out"), 1: ("-c", "exit 3")}}, {{0: {{}}, 1: {{}}}}, specs)
        result = ctx.wait(30)
        ctx.close()
        assert result.is_failed() and result.failures[1].exitcode == 3, result
        assert run(["sh", "-c", "echo hi"], capture_output=True, timeout=30).stdout == b"hi\\n"
        print("new:", sorted(set(sys.modules) - before))
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == b"new: []", result.stdout


def test_run_does_not_import_asyncio_or_the_group_launchers():
    # A program that only runs commands (an agent's tool, a build step)
    # must not pay for asyncio's import (tens of milliseconds), typing's or
    # the launchers of rank groups: what subprocess.run would cost it.
    result = run_launcher("""
        import sys
        from torchmp import run
        assert run(["true"]).returncode == 0
        print(sorted(m for m in ("asyncio", "dataclasses", "pickle", "tempfile", "logging", "typing",
                                 "torchmp._aio", "torchmp._launch.exec", "torchmp._native") if m in sys.modules))
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"[]\n", result.stdout


def test_importing_torchmp_compiles_no_source_at_run_time():
    # An agent whose every tool call is a new interpreter, and every spawned
    # function worker, pays for what `import torchmp` runs.  Compiling source
    # at import (collections.namedtuple compiles each record's __new__) cost
    # 0.65 ms of the import's 2.3; the core's records are classes instead.
    # Audited: the compile of a source string, not of a module's file.
    result = run_launcher("""
        import sys
        import subprocess  # the stdlib's own records are made here, before the hook
        compiled = []
        def hook(event, args):
            if event == "compile" and not str(args[1]).endswith(".py"):
                compiled.append((args[1], bytes(args[0] or b"")[:50]))
        sys.addaudithook(hook)
        import torchmp
        from torchmp import run
        import torchmp._launch.worker
        assert run(["true"]).returncode == 0
        print(compiled)
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"[]\n", result.stdout


def test_importing_the_core_makes_no_enum_class_and_no_function_object():
    # The compiled core's import is most of `import torchmp` (0.8 of 1.3 ms
    # in a fresh interpreter).  Two IntEnum classes cost 0.17 ms of it, and
    # a Cython function object with its code object for each of the core's
    # functions and its extension types' methods 0.1 ms more: its constants
    # are plain ints, and those functions and methods are the C API's
    # builtins (with the text signature that inspect reads).
    result = run_launcher("""
        import enum, inspect, sys
        def enums():
            found, todo = set(), [enum.Enum]
            while todo:
                cls = todo.pop()
                found.add(cls)
                todo.extend(cls.__subclasses__())
            return found
        before = enums()
        import torchmp
        from torchmp import _core, run
        assert run(["true"]).returncode == 0
        made = sorted(f"{c.__module__}.{c.__qualname__}" for c in enums() - before
                      if c.__module__.startswith("torchmp"))
        callables = [getattr(_core, n) for n in dir(_core) if not n.startswith("_")]
        callables += [getattr(c, n) for c in callables if isinstance(c, type) for n in vars(c)
                      if not n.startswith("_") and callable(getattr(c, n))]
        with_code = sorted(getattr(f, "__qualname__", repr(f)) for f in callables if hasattr(f, "__code__"))
        print(made, with_code, inspect.signature(_core.redirect_fd))
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"[] [] (std_fd, target_fd)\n", result.stdout
