"""Test-wide guards: every test must leave no fd, child process or zombie.

The guard snapshots the process's open fds and its children before each
test and compares after it.  The torchmp I/O thread's own fds (created on
first use, kept for the process's life) are created before the first
snapshot.  Leftover children are killed by process group and reaped, so a
failing test never leaves processes behind, and the test is failed.
"""
from __future__ import annotations

import ctypes
import functools
import gc
import inspect
import itertools
import os
import re
import signal
import sys
import time

import psutil
import pytest

import torchmp
from torchmp import _core, _oom

from helpers import fd_target

# Fixtures of the errors, parity and bench suites, none autouse: their
# modules ask for them (tests/errors_helpers.py, tests/parity_helpers.py,
# tests/bench_helpers.py).
pytest_plugins = ["errors_helpers", "parity_helpers", "bench_helpers"]


def _open_fds() -> set[int]:
    # listdir opens a descriptor of its own while it reads; keep only fds
    # that still exist afterwards.
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        fds.add(int(name))
    return fds


def _children() -> list[psutil.Process]:
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def _kill_and_reap(procs: list[psutil.Process]) -> None:
    for p in procs:
        for kill in (os.killpg, os.kill):
            try:
                kill(p.pid, signal.SIGKILL)
            except OSError:
                pass
    for p in procs:
        try:
            os.waitpid(p.pid, 0)
        except ChildProcessError:
            pass
        except OSError:
            pass


# pytest's process is the launcher of most tests, and with vfork off (the
# poll round) every launch forks it: the fork copies its page tables and the
# exec tears them down again, so each MB it holds costs every such launch.
# A few tests pass tens of MB through it (64 MB return values, 16 MB of
# console text), and glibc keeps what they freed: its mmap threshold rises
# to the largest block freed, so the next big blocks come from the heap and
# stay there.  With the threshold fixed and the heap trimmed after each
# test, the process stays at 80-99 MB through the non-torch tests instead of
# growing to 150 MB by the middle of the suite.  (Under the sanitizers'
# preload these calls reach glibc's allocator, which ASan has replaced:
# harmless no-ops.)
try:
    _libc = ctypes.CDLL(None)
    _malloc_trim = _libc.malloc_trim
    _M_MMAP_THRESHOLD = -3
    _libc.mallopt(_M_MMAP_THRESHOLD, 128 * 1024)  # glibc's default, made fixed
except (OSError, AttributeError):  # not glibc
    _malloc_trim = None


@pytest.fixture(scope="session", autouse=True)
def _start_io_thread() -> None:
    # The I/O thread and its control fd live as long as the process, and so
    # do the OOM watch's two kept descriptors from a second launch on.
    _core.backend()
    _oom.start_watch()
    _oom.start_watch()


@pytest.fixture(autouse=True)
def leak_guard(request: pytest.FixtureRequest):
    if request.node.get_closest_marker("no_leak_guard"):
        yield
        return
    # Young generations only: a full collection walks every object, torch's
    # 190k too once a parity test has imported it (0.1 s CPU, most of the
    # suite's CPU when done for every test), and what the guard needs
    # released -- what the test before dropped -- is young.
    gc.collect(1)
    fds_before = _open_fds()
    children_before = {p.pid for p in _children()}
    yield
    # Groups are released asynchronously by the I/O thread: allow it a moment.
    deadline = time.monotonic() + 10.0
    for attempt in itertools.count():
        # One full collection, only when a young one did not release it all.
        gc.collect(2 if attempt == 1 else 1)
        leaked_fds = _open_fds() - fds_before
        leftover = [p for p in _children() if p.pid not in children_before]
        if (not leaked_fds and not leftover) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    if _malloc_trim is not None:
        _malloc_trim(0)
    problems = []
    if leaked_fds:
        problems.append("leaked fds: " + ", ".join(f"{fd}->{fd_target(fd)}" for fd in sorted(leaked_fds)))
    if leftover:
        desc = []
        for p in leftover:
            try:
                desc.append(f"{p.pid} ({p.status()}: {' '.join(p.cmdline())[:80]})")
            except psutil.Error:
                desc.append(f"{p.pid} (gone)")
        problems.append("leftover child processes: " + "; ".join(desc))
        _kill_and_reap(leftover)
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)


# An import of torch in a test's body or in one of its fixtures.
_TORCH_IMPORT = re.compile(r"""importorskip\(\s*["']torch\b|^\s*(?:import|from)\s+torch\b""", re.M)


def _imports_torch(item: pytest.Item) -> bool:
    if item.get_closest_marker("torch"):
        return True
    functions = [getattr(item, "function", None)]
    fixture_info = getattr(item, "_fixtureinfo", None)
    if fixture_info is not None:
        for defs in fixture_info.name2fixturedefs.values():
            functions += [d.func for d in defs]
    # ... and the module's own helpers they call (one level down).
    for function in list(functions):
        code, names = getattr(function, "__code__", None), getattr(function, "__globals__", {})
        if code is not None:
            functions += [names[n] for n in code.co_names
                          if inspect.isfunction(names.get(n)) and names[n].__module__ == function.__module__]
    return any(_source_imports_torch(function) for function in functions if function is not None)


@functools.cache
def _source_imports_torch(function: object) -> bool:
    # Cached: the items of one test function share it, and every item's
    # fixtures (pytest's own included) would otherwise be read and tokenized
    # again for each item -- most of the suite's collection time.
    try:
        return _TORCH_IMPORT.search(inspect.getsource(function)) is not None  # type: ignore[arg-type]
    except (OSError, TypeError):
        return False


_RUNS_LAST = pytest.StashKey[bool]()  # torch's tests and those marked `last`
_torch_too_early: list[str] = []  # the test after which torch was first seen too early


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The tests that import torch run last: once torch is imported, the test
    # process holds ~1.2 GB and 190k objects, and every fork of it (the fork
    # start method, the poll round's no-vfork spawns: 130 ms each) and every
    # full collection costs many times more.  Stable: the rest keep their
    # order, and so do these.
    # The same for a test marked `last`, which leaves the process big by
    # other means (see the marker's description in pyproject.toml).
    for item in items:
        item.stash[_RUNS_LAST] = _imports_torch(item) or item.get_closest_marker("last") is not None
    items.sort(key=lambda item: item.stash[_RUNS_LAST])


@pytest.fixture(autouse=True)
def torch_comes_last(request: pytest.FixtureRequest):
    """Fails the first test that is not ordered last with torch's but after
    which torch is loaded: _imports_torch missed how that test (or its collection)
    imports torch, and every test ordered after it would pay for it.  The
    message says how to tell conftest."""
    yield
    if _torch_too_early or request.node.stash.get(_RUNS_LAST, True) or "torch" not in sys.modules:
        return
    _torch_too_early.append(request.node.nodeid)
    pytest.fail("torch is loaded after this test, which conftest.py did not order with the tests that "
                "import torch (they run last): if this test imports torch, directly or through what it "
                "calls, mark it @pytest.mark.torch; if torch came in earlier (at collection), find who "
                "imports it", pytrace=False)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "no_leak_guard: the test manages its own leak checks")


def pytest_report_header(config: pytest.Config) -> str:
    return f"torchmp {torchmp.__version__}, backend {_core.backend()}, core {_core.__file__}"
