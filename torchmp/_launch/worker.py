"""The worker side of a function launch (spawn, fork and forkserver).

A spawned worker starts as ``python -c "from torchmp._launch.worker import
spawn_main; spawn_main()"`` with its payload on fd ``FD_PAYLOAD`` (4) and its
return channel on fd ``FD_RETURN`` (3).  This module imports only the
standard library pieces it needs and the compiled core, which ``import
torchmp`` has loaded already (``torchmp.errors`` only when there is an error
to record), so a worker starts about as fast as a bare interpreter.

Payload layout: an 8-byte little-endian length, then a pickle of the
preparation data (sys.path, argv, how to re-import the main module), then a
pickle of ``(fn, args)``.  The two are separate because ``fn`` may live in
the main module, which must be re-imported before ``fn`` can be unpickled.
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Callable
from typing import Any, NoReturn

# The worker's fds, as the C core's spawn plan places them (one source:
# torchmp/__init__.py imports _core before this module runs, so this costs
# no import).
from torchmp._core import FD_PAYLOAD as FD_PAYLOAD, FD_RETURN as FD_RETURN  # re-exported


def _read_all(fd: int) -> bytes:
    """Read a payload file from its start (its offset is shared with the
    launcher's descriptor, so do not rely on it)."""
    chunks: list[bytes] = []
    offset = 0
    while True:
        chunk = os.pread(fd, 1 << 20, offset)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        offset += len(chunk)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def interpreter_argv(module: str, function: str) -> list[bytes]:
    """argv of a fresh interpreter that runs ``module.function()``.

    ``-c`` puts the current directory first on sys.path, where an unbuilt
    source checkout of torchmp may sit: point that entry at the torchmp this
    launcher runs instead (prepare() installs the launcher's sys.path later).
    """
    import subprocess

    import torchmp

    # The directory that holds the torchmp package (not this module's, which
    # sits one package deeper).
    home = os.path.dirname(os.path.dirname(os.path.abspath(torchmp.__file__)))
    code = f"import sys; sys.path[0] = {home!r}; from {module} import {function}; {function}()"
    argv = [os.fsencode(sys.executable)]
    # multiprocessing's own way to pass -X, -W, -O... on; private, so not in typeshed.
    argv += [os.fsencode(a) for a in subprocess._args_from_interpreter_flags()]  # type: ignore[attr-defined]
    return argv + [b"-c", code.encode()]


# --- re-importing the main module, the way multiprocessing's spawn does ----

def preparation_data() -> dict[str, Any]:
    """What a fresh interpreter needs to unpickle functions of this one."""
    data: dict[str, Any] = {"sys_path": list(sys.path), "sys_argv": list(sys.argv)}
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    name = getattr(spec, "name", None)
    if name is not None:
        data["main_name"] = name
    else:
        path = getattr(main, "__file__", None)
        if path is not None:
            data["main_path"] = os.path.normpath(os.path.abspath(path))
    return data


def _install_main(run: Callable[[], dict[str, Any]]) -> None:
    import types

    module = types.ModuleType("__mp_main__")
    module.__dict__.update(run())
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module


# True while a spawn/forkserver process re-imports the launcher's main module.
_bootstrapping = False


def refuse_nested_launch() -> None:
    """Raise if called while the main module is being re-imported: a script
    without an ``if __name__ == "__main__":`` guard would otherwise start a
    whole new job from every worker (multiprocessing refuses the same way)."""
    if _bootstrapping:
        raise RuntimeError(
            "An attempt has been made to start a new process before the current process has "
            "finished its bootstrapping phase.  This worker re-imports the launcher's main "
            "module (start_method 'spawn' or 'forkserver'), and that module starts workers at "
            "import time.  Protect the launch with:\n\n    if __name__ == \"__main__\":\n"
            "        ...start_processes(...)\n\nor use start_method='fork'.")


def prepare(data: dict[str, Any]) -> None:
    global _bootstrapping
    _bootstrapping = True
    try:
        _prepare(data)
    finally:
        _bootstrapping = False


def _prepare(data: dict[str, Any]) -> None:
    sys.path[:] = data["sys_path"]
    sys.argv[:] = data["sys_argv"]
    name = data.get("main_name")
    path = data.get("main_path")
    if name is not None:
        # A package's __main__ would run the whole program again: skip it,
        # as multiprocessing does.
        if name == "__main__" or name.endswith(".__main__"):
            return
        import runpy

        _install_main(lambda: runpy.run_module(name, run_name="__mp_main__", alter_sys=True))
    elif path is not None:
        if os.path.splitext(os.path.basename(path))[0] == "ipython":
            return
        import runpy

        _install_main(lambda: runpy.run_path(path, run_name="__mp_main__"))


def encode_payload(prep: dict[str, Any], fn: Callable[..., Any], args: tuple[Any, ...]) -> bytes:
    head = pickle.dumps(prep, protocol=pickle.HIGHEST_PROTOCOL)
    body = pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
    return len(head).to_bytes(8, "little") + head + body


def decode_payload(data: bytes) -> tuple[dict[str, Any], bytes]:
    n = int.from_bytes(data[:8], "little")
    return pickle.loads(data[8 : 8 + n]), data[8 + n :]


# --- running the function ----------------------------------------------------

def fresh_stdio() -> None:
    """Make sys.stdout/sys.stderr write to fds 1/2 again.

    A forked worker inherits the launcher's stream objects, which need not be
    fds 1/2 (pytest capture, Jupyter, a launcher that reassigned them): the
    redirect is on the fds, so print() must go there too."""
    import io

    for fd, name in ((1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        encoding = getattr(old, "encoding", None) or "utf-8"
        errors = getattr(old, "errors", None) or ("backslashreplace" if fd == 2 else "strict")
        setattr(sys, name, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=encoding,
                                            errors=errors, line_buffering=fd == 2))

def record_failure(exc: BaseException) -> None:
    """Write error.json like ``@record`` would (imported only on failure)."""
    try:
        from torchmp.errors import get_error_handler

        handler = get_error_handler()
        handler.record_exception(exc)
    except Exception as e:  # never let recording hide the real failure
        print(f"torchmp: could not write the error file: {e!r}", file=sys.stderr)


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    print(e.code, file=sys.stderr)
    return 1


def _flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            pass


def run(fn: Callable[..., Any], args: tuple[Any, ...], ret_fd: int) -> NoReturn:
    """Run fn under error recording, send its pickled return value down
    ret_fd, and exit.  Never returns: a forked worker must not unwind into
    the launcher's stack."""
    code = 1
    try:
        import faulthandler

        faulthandler.enable(all_threads=True)
        try:
            value = fn(*args)
        except SystemExit as e:
            code = _exit_code(e)
            if code == 0:
                # sys.exit(0) is a clean end: the launcher gets None.  Only a
                # worker that skipped all this (os._exit) sends nothing.
                write_all(ret_fd, pickle.dumps(None, protocol=pickle.HIGHEST_PROTOCOL))
        except BaseException as e:
            import traceback

            record_failure(e)
            traceback.print_exc()
            code = 1
        else:
            try:
                blob = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as e:
                name = getattr(fn, "__qualname__", repr(fn))
                problem = TypeError(f"the return value of {name} could not be pickled: {e!r}")
                record_failure(problem)
                print(f"torchmp: {problem}", file=sys.stderr)
                code = 1
            else:
                write_all(ret_fd, blob)
                code = 0
    except BaseException:
        code = 1
    finally:
        _flush_stdio()
        os._exit(code)


def spawn_main() -> NoReturn:
    """Entry point of a spawned worker (see the module docstring)."""
    os.set_inheritable(FD_RETURN, False)  # not for the worker's own children
    try:
        payload = _read_all(FD_PAYLOAD)
        os.close(FD_PAYLOAD)
        prep, body = decode_payload(payload)
        prepare(prep)
        fn, args = pickle.loads(body)
    except BaseException as e:
        import traceback

        record_failure(e)
        traceback.print_exc()
        _flush_stdio()
        os._exit(1)
    run(fn, args, FD_RETURN)
