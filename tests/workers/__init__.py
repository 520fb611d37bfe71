"""What the tests start: worker functions and worker scripts, in one place.

Modules of worker functions (``functions``, ``parity``, ``security``) are
imported as ``workers.NAME``: tests/ is on sys.path, and sys.path travels to
spawned workers and to the forkserver, so spawn and forkserver workers
unpickle their functions by reference.  They import nothing heavy (a spawn
test checks what a worker loads), and neither does this package.

Scripts (``ignore_term.py``, ``lines.py``, ``writer.py``) are run by path as
binary entrypoints: ``helpers.WORKERS / "NAME.py"``.
"""
