"""A rank's environment, built once per start method: ``envp`` entries for an
exec, a name -> value dict for a forkserver worker, ``os.environ`` itself for
a forked one.  Every variable is encoded by ``_inputs.encode_env_item``, so
the three agree byte for byte."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from torchmp._inputs import encode_env_item


# The last launcher_environ(): a copy of the environment it was made from,
# and its entries.  An environment that compares equal (one dict comparison
# at C speed) gets the same entries, not forty concatenations again.
_last_environ: tuple[dict[bytes, bytes], dict[bytes, bytes]] | None = None


def launcher_environ() -> dict[bytes, bytes]:
    """The launcher's environment as ready envp entries (b"K=V"), by name.
    The dict is shared by the calls that see the same environment: callers
    copy it before they change it (exec_env does)."""
    global _last_environ
    data = getattr(os.environb, "_data", None)
    if not isinstance(data, dict):
        return {k: k + b"=" + v for k, v in os.environb.items()}
    # os.environb's own dict, read at C speed; iterating the mapping costs a
    # Python-level call per variable.
    last = _last_environ
    if last is not None and last[0] == data:
        return last[1]
    entries = {k: k + b"=" + v for k, v in data.items()}
    _last_environ = (dict(data), entries)
    return entries


def exec_env(rank: int, overrides: Mapping[Any, Any], base: dict[bytes, bytes] | None = None) -> list[bytes]:
    """The launcher's environment (or base, a launcher_environ() snapshot
    taken once per launch) with envs[rank] on top, as envp entries."""
    if not overrides:
        return list((launcher_environ() if base is None else base).values())
    entries = dict(launcher_environ() if base is None else base)
    for key, value in overrides.items():
        kb, vb = encode_env_item(rank, key, value)
        entries[kb] = kb + b"=" + vb
    return list(entries.values())


def rank_environb(rank: int, overrides: Mapping[Any, Any]) -> dict[bytes, bytes]:
    """The launcher's environment with envs[rank] on top, name -> value (what
    a forkserver worker sets as its os.environb)."""
    env = dict(os.environb)
    for key, value in overrides.items():
        kb, vb = encode_env_item(rank, key, value)
        env[kb] = vb
    return env


def apply_rank_env(rank: int, overrides: Mapping[Any, Any]) -> None:
    """Put envs[rank] into this process's environment (a forked worker, whose
    environment is the launcher's already)."""
    for key, value in overrides.items():
        kb, vb = encode_env_item(rank, key, value)
        os.environb[kb] = vb
