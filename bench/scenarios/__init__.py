"""Scenario registry: name -> module with ``TITLE``, ``TARGETS`` and ``run(ctx) -> Result``."""

import importlib

ORDER = ["launch", "funclaunch", "lag", "failfast", "tee", "redirect", "idle", "close", "many", "nofile"]
MODULES = {
    "launch": "launch",
    "funclaunch": "funclaunch",
    "lag": "lag",
    "failfast": "failfast",
    "tee": "streams",
    "redirect": "streams",
    "idle": "idle",
    "close": "close",
    "many": "many",
    "nofile": "many",
}


def get(name):
    mod = importlib.import_module(f"bench.scenarios.{MODULES[name]}")
    return getattr(mod, "run_" + name)
