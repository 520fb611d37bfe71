"""Scenario registry: name -> module with ``TITLE``, ``TARGETS`` and ``run(ctx) -> Result``."""

import importlib

ORDER = ["launch", "funclaunch", "lag", "failfast", "tee", "redirect", "teeobject", "console", "idle", "close",
         "many", "nofile", "agent"]
MODULES = {
    "launch": "launch",
    "funclaunch": "funclaunch",
    "lag": "lag",
    "failfast": "failfast",
    "tee": "streams",
    "redirect": "streams",
    "teeobject": "streams",
    "console": "console",
    "idle": "idle",
    "close": "close",
    "many": "many",
    "nofile": "many",
    "agent": "agent",
}

TITLES = {
    "launch": "launch+reap of N x /bin/true, N = 1, 16, 128, 1024",
    "funclaunch": "function launch per start method (spawn, fork, forkserver), N = 4, 16",
    "lag": "exit-detection lag of wait(), 4 x sleep 0.2",
    "failfast": "failure detection + teardown of 3 sleeping siblings",
    "tee": "tee with prefixes, 4 ranks x 50 MB of 100-byte lines: MB/s, launcher CPU, line integrity",
    "redirect": "redirect only, same data: MB/s, launcher CPU, exact logs",
    "teeobject": "tee into a Python object as sys.stdout, 4 ranks x 10 MB: MB/s, launcher CPU, line integrity",
    "console": "console stalled for 5 s, then drained: wait() time, workers blocked in write(), exact logs, RSS",
    "idle": "64 idle ranks teeing both streams: launcher threads, fds, RSS, CPU %",
    "close": "close(timeout=0.5) of plain and TERM-ignoring workers",
    "many": "1024 teed ranks launch+reap",
    "nofile": "1024 teed ranks at RLIMIT_NOFILE soft = 1024: works, or clear error and nothing left",
    "agent": "torchmp.run / run_async / one-rank start_processes vs subprocess.run / create_subprocess_exec",
}


# Modules a scenario imports beyond the standard library (the `bench` extra):
# checked before anything is measured, so a full run does not stop with an
# ImportError twenty minutes in, its results lost.
NEEDS = {
    "idle": ("psutil",),
}


def missing_modules(order) -> dict[str, list[str]]:
    """{scenario: [modules that do not import here]} for the scenarios in order."""
    missing: dict[str, list[str]] = {}
    for name in order:
        for module in NEEDS.get(name, ()):
            try:
                importlib.import_module(module)
            except ImportError:
                missing.setdefault(name, []).append(module)
    return missing


def get(name):
    mod = importlib.import_module(f"bench.scenarios.{MODULES[name]}")
    return getattr(mod, "run_" + name)
