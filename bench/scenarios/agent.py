"""``agent``: what an agent does -- one short command at a time, or dozens at
once from asyncio -- against what it would use instead, side by side.

* ``true``: sequential ``torchmp.run(["true"])`` / ``subprocess.run(["true"])``
  / the floor (``os.posix_spawn`` + ``os.waitpid``): wall time and the
  launcher's CPU (``RUSAGE_SELF``: every thread of it) per launch.
* ``echo``: the same for ``["echo", "hello"]`` with ``capture_output=True``
  (floor: ``posix_spawn`` with a pipe, read to EOF).
* ``async``: 256 launches of ``true``, 32 in flight, on asyncio's default
  loop: ``torchmp.run_async`` / ``asyncio.create_subprocess_exec`` +
  ``wait()`` / the floor (``os.posix_spawn``, a pidfd per command in the
  loop, ``os.waitpid``): launches per second and the launcher's CPU per
  launch.  The children's own CPU per launch (``RUSAGE_CHILDREN``) is noted:
  with every CPU busy, launches/s cannot pass cpus / (children's + the
  launcher's CPU per launch), whatever the launcher.
* ``context``: ``start_processes`` of one ``/bin/true`` + ``wait()`` +
  ``close()`` (``DefaultLogsSpecs`` in a temp dir) for torchmp, against
  ``subprocess.run(["true"])`` in the stdlib column.
* ``cold``: a fresh interpreter (``python script.py``) that imports what it needs
  and runs ``true`` once -- an agent whose every tool call is a new Python
  process: ``from torchmp import run`` / ``import subprocess`` / ``import
  os`` + ``posix_spawnp``: wall time per interpreter and its CPU
  (``RUSAGE_CHILDREN``: the interpreter and its ``true``).  The torchmp
  interpreter checks that it imported the subject; bytecode is cached
  (``PYTHONDONTWRITEBYTECODE`` is dropped for these interpreters, and the
  warm-up round writes it for a source tree).

Targets (issue 21): true <= 1.0x subprocess.run (wall and CPU; goal 0.8x);
echo <= 0.8x; async >= 2x create_subprocess_exec's launches/s and <= 0.5x
its CPU per launch; context <= 1.2x subprocess.run.
"""

from __future__ import annotations

import asyncio
import os
import resource
import subprocess
import sys
import tempfile
import time

from bench.common import Result, interleave, record

TITLE = "one command at a time, or 32 at once from asyncio: per launch"
IMPLS = ["torchmp", "stdlib", "floor"]
SEQ = 40           # launches per sequential trial
COLD = 5           # fresh interpreters per cold trial
ASYNC_N = 256
ASYNC_IN_FLIGHT = 32


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _per_launch(fn, n: int) -> tuple[float, float]:
    """(wall ms, launcher CPU ms) per launch over n calls of fn."""
    c0, t0 = _cpu(), time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e3, (_cpu() - c0) / n * 1e3


def _floor_true() -> None:
    pid = os.posix_spawnp("true", ["true"], os.environ)
    os.waitpid(pid, 0)


def _floor_echo() -> None:
    r, w = os.pipe()
    try:
        pid = os.posix_spawnp("echo", ["echo", "hello"], os.environ,
                              file_actions=[(os.POSIX_SPAWN_DUP2, w, 1), (os.POSIX_SPAWN_CLOSE, r)])
    finally:
        os.close(w)
    chunks = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    if b"".join(chunks) != b"hello\n":
        raise RuntimeError("floor: wrong output")


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _cold_scripts(subject_file: str | None) -> dict[str, str]:
    scripts = {
        "stdlib": "import subprocess\nsubprocess.run(['true'])\n",
        "floor": "import os\nos.waitpid(os.posix_spawnp('true', ['true'], os.environ), 0)\n",
    }
    if subject_file is not None:
        scripts["torchmp"] = (f"import torchmp\nassert torchmp.__file__ == {subject_file!r}, torchmp.__file__\n"
                              "from torchmp import run\nrun(['true'])\n")
    return scripts


def _cold(script: str, env: dict[str, str]) -> tuple[float, float]:
    """(wall ms, CPU ms) per fresh interpreter running the script file, COLD
    of them.  A file, not ``-c``: ``-c`` puts the bench's working directory
    (a checkout, whose torchmp may not be the subject) first on sys.path."""
    k0, t0 = _children_cpu(), time.perf_counter()
    for _ in range(COLD):
        pid = os.posix_spawn(sys.executable, [sys.executable, script], env)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            raise RuntimeError(f"a fresh interpreter failed (wait status {status}): {script!r}")
    return (time.perf_counter() - t0) / COLD * 1e3, (_children_cpu() - k0) / COLD * 1e3


def _async_batch(launch) -> tuple[float, float, float]:
    """(launches/s, launcher CPU ms, children's CPU ms per launch) of
    ASYNC_N launches."""

    async def main() -> tuple[float, float, float]:
        sem = asyncio.Semaphore(ASYNC_IN_FLIGHT)

        async def one() -> None:
            async with sem:
                await launch()

        c0, k0, t0 = _cpu(), _children_cpu(), time.perf_counter()
        await asyncio.gather(*(one() for _ in range(ASYNC_N)))
        return (ASYNC_N / (time.perf_counter() - t0), (_cpu() - c0) / ASYNC_N * 1e3,
                (_children_cpu() - k0) / ASYNC_N * 1e3)

    return asyncio.run(main())


async def _floor_async() -> None:
    loop = asyncio.get_running_loop()
    pid = os.posix_spawnp("true", ["true"], os.environ)
    fd = os.pidfd_open(pid)
    exited = loop.create_future()
    loop.add_reader(fd, exited.set_result, None)
    try:
        await exited
    finally:
        loop.remove_reader(fd)
        os.close(fd)
    os.waitpid(pid, 0)


async def _stdlib_async() -> None:
    proc = await asyncio.create_subprocess_exec("true")
    if await proc.wait() != 0:
        raise RuntimeError("stdlib: true failed")


def run_agent(ctx) -> Result:
    impls = ctx.select(IMPLS)
    res = Result("agent", TITLE, impls)
    tm = getattr(ctx.impls.get("torchmp"), "mod", None)
    if "torchmp" in impls and not hasattr(tm, "run"):
        res.skipped["torchmp"] = f"{getattr(tm, '__name__', 'the torchmp column')} has no run()"
        impls = [i for i in impls if i != "torchmp"]
    res.params = {"sequential_per_trial": SEQ, "async": {"launches": ASYNC_N, "in_flight": ASYNC_IN_FLIGHT}}
    log_dir = tempfile.mkdtemp(prefix="agent-ctx-", dir=ctx.tmp_root)

    def start_processes_once() -> None:
        c = tm.start_processes("agent", "true", {0: ()}, {0: {}}, tm.DefaultLogsSpecs(log_dir=log_dir))
        result = c.wait()
        c.close()
        if result.is_failed():
            raise RuntimeError(f"start_processes: {result.failures}")

    sequential = {
        "true": {"torchmp": lambda: tm.run(["true"]), "stdlib": lambda: subprocess.run(["true"]),
                 "floor": _floor_true},
        "echo": {"torchmp": lambda: tm.run(["echo", "hello"], capture_output=True),
                 "stdlib": lambda: subprocess.run(["echo", "hello"], capture_output=True),
                 "floor": _floor_echo},
        "context": {"torchmp": start_processes_once, "stdlib": lambda: subprocess.run(["true"])},
    }
    labels = {"true": "run(['true'])", "echo": "run(['echo','hello'], capture)",
              "context": "start_processes 1 bin+wait+close"}
    for case, fns in sequential.items():
        res.metric(f"{case}_wall", f"{labels[case]}: wall", "ms", "lower")
        res.metric(f"{case}_cpu", f"{labels[case]}: CPU", "ms", "lower")

        def trial(impl, case=case, fns=fns):
            wall, cpu = _per_launch(fns[impl], SEQ)
            return {f"{case}_wall": wall, f"{case}_cpu": cpu}

        ctx.log(f"  {case}")
        samples = interleave([i for i in impls if i in fns], ctx.reps(15, 5), trial, warmup=1,
                             on_error=lambda i, m, c=case: res.error(i, c, m), log=ctx.log)
        record(res, samples)

    res.metric("cold_wall", "fresh python: import + run(['true']): wall", "ms", "lower")
    res.metric("cold_cpu", "fresh python: import + run(['true']): CPU", "ms", "lower")
    scripts = _cold_scripts(getattr(tm, "__file__", None) if "torchmp" in impls else None)
    # Every column's interpreter gets the same sys.path: the subject's home
    # first, so the torchmp column imports the torchmp under test.
    env = dict(os.environ)
    # Cached bytecode, as an installed package has: without it every cold
    # interpreter would compile torchmp's sources (the stdlib's are cached).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if "torchmp" in scripts:
        home = os.path.dirname(os.path.dirname(os.path.abspath(tm.__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (home, env.get("PYTHONPATH")) if p)

    script_files = {}
    for impl, text in scripts.items():
        script_files[impl] = os.path.join(log_dir, f"cold_{impl}.py")
        with open(script_files[impl], "w") as f:
            f.write(text)

    def cold_trial(impl):
        wall, cpu = _cold(script_files[impl], env)
        return {"cold_wall": wall, "cold_cpu": cpu}

    ctx.log("  cold")
    samples = interleave([i for i in impls if i in scripts], ctx.reps(9, 3), cold_trial, warmup=1,
                         on_error=lambda i, m: res.error(i, "cold", m), log=ctx.log)
    record(res, samples)

    res.metric("async_rate", f"async {ASYNC_N} x true, {ASYNC_IN_FLIGHT} in flight", "launch/s", "higher")
    res.metric("async_cpu", "async: CPU per launch", "ms", "lower")
    res.metric("async_children_cpu", "async: children's CPU per launch", "ms", "info")
    launches = {"torchmp": lambda: tm.run_async(["true"]), "stdlib": _stdlib_async, "floor": _floor_async}

    def async_trial(impl):
        rate, cpu, children = _async_batch(launches[impl])
        return {"async_rate": rate, "async_cpu": cpu, "async_children_cpu": children}

    ctx.log("  async")
    samples = interleave([i for i in impls if i in launches], ctx.reps(9, 3), async_trial, warmup=1,
                         on_error=lambda i, m: res.error(i, "async", m), log=ctx.log)
    record(res, samples)
    return res
