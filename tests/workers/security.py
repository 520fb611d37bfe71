"""Function-launch workers for tests/test_security.py.

Imported as workers.security (tests/ is on sys.path, and spawned workers
and the forkserver get the launcher's sys.path) so these functions pickle by
reference.
"""
import os


def environ() -> dict:
    """The worker's whole os.environ, and what a child process of it sees."""
    import subprocess

    child = subprocess.run(["env", "-0"], stdout=subprocess.PIPE, check=True).stdout
    seen_by_child = dict(item.split("=", 1) for item in child.decode("utf-8", "surrogateescape").split("\0") if item)
    return {"os.environ": dict(os.environ), "child": seen_by_child}


def echo_args(*args):
    """The arguments exactly as received, and what a shell-free exec of
    printf makes of them."""
    import subprocess

    printed = subprocess.run(["printf", "%s\\0"] + [str(a) for a in args], stdout=subprocess.PIPE,
                             check=True).stdout
    return args, printed.split(b"\0")[:-1]
