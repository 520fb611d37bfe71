"""Worker entrypoints for function launch.

Kept free of heavy imports: spawn/forkserver children import this module to
unpickle the entrypoint.
"""

import os


def echo_rank(rank):
    """The trivial function of the ``funclaunch`` scenario: return the rank."""
    return rank


def mp_entry(conn, fn, args, env):
    """How a careful multiprocessing user runs ``fn`` and returns its value."""
    os.environ.update(env)
    try:
        conn.send(fn(*args))
    finally:
        conn.close()
