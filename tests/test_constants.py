"""Constants and layouts that the C core and the Python layer must agree on.

Each fact lives in one place and the other side reads it from there, or this
file ties the two copies together: the worker's fd numbers (C's spawn plan,
torchmp._launch.worker), the forkserver's exit trailer (C's torchmp_exit_trailer,
torchmp._launch.forkserver's struct) and the named records Group.spawn /
Group.prepare take.  (The setup steps a spawn error names: test_spawn.py's
test_exec_error_decoder_names_setup_steps.)
"""
from __future__ import annotations

import os
import pickle
import re
import struct
import subprocess
import sys
import time

import pytest

from torchmp import _core
from torchmp._launch import forkserver as _forkserver, worker as _worker

from helpers import TORCHMP_PATH

# --------------------------------------------------------------------------- helpers


def run_group(specs: list[_core.RankSpec]) -> tuple[list[_core.ProcInfo], list[bytes]]:
    """Spawn specs in a native group, wait for every rank to exit; the ranks'
    final states and what each wrote to its return channel."""
    group = _core.Group(len(specs))
    try:
        group.spawn(specs)
        deadline = time.monotonic() + 30
        while True:
            version, ranks = group.snapshot()
            if all(info.state == _core.PROC_EXITED for info in ranks):
                break
            assert time.monotonic() < deadline, ranks
            group.wait(1.0, version)
        group.finish_streams()
        return ranks, [bytes(group.take_return(rank)) for rank in range(len(specs))]
    finally:
        try:
            group.killpg(9)
        except OSError:
            pass
        group.reap()
        group.finish_streams()
        group.release()


INHERIT = _core.StreamSpec(_core.STREAM_INHERIT, -1, -1, None)
RETURN_CHANNEL = _core.StreamSpec(_core.STREAM_RETURN, -1, -1, None)


def sh(script: str, payload_fd: int = -1, ret: _core.StreamSpec = RETURN_CHANNEL) -> _core.RankSpec:
    return _core.RankSpec(b"/bin/sh", [b"sh", b"-c", script.encode()], [b"PATH=/usr/bin:/bin"],
                          INHERIT, INHERIT, ret, payload_fd)


# --------------------------------------------------------------------------- the worker's fds


def test_worker_fd_numbers_come_from_the_core() -> None:
    assert (_worker.FD_RETURN, _worker.FD_PAYLOAD) == (_core.FD_RETURN, _core.FD_PAYLOAD)
    assert len({0, 1, 2, _core.FD_RETURN, _core.FD_PAYLOAD}) == 5


def test_worker_fds_are_where_the_core_puts_them(tmp_path) -> None:
    # An exec'd worker finds its payload at FD_PAYLOAD and its return channel
    # at FD_RETURN: the numbers Python uses are the C spawn plan's.
    payload = tmp_path / "payload"
    payload.write_bytes(b"the payload\n")
    fd = os.open(payload, os.O_RDONLY | os.O_CLOEXEC)
    try:
        ranks, returned = run_group([
            sh(f"cat <&{_core.FD_PAYLOAD} >&{_core.FD_RETURN}", payload_fd=fd),
            # nothing asked for: neither fd is open in the worker
            sh(f"ls /proc/$$/fd > /dev/null; [ ! -e /proc/$$/fd/{_core.FD_RETURN} ] && "
               f"[ ! -e /proc/$$/fd/{_core.FD_PAYLOAD} ]", ret=INHERIT),
        ])
    finally:
        os.close(fd)
    assert [info.wait_status for info in ranks] == [0, 0], ranks
    assert returned == [b"the payload\n", b""]


def test_worker_module_stays_import_light() -> None:
    # _worker reads the fd numbers from _core, which `import torchmp` loads
    # anyway: a spawned worker imports nothing else of torchmp.
    code = ("import sys; import torchmp._launch.worker; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('torchmp'))))")
    env = dict(os.environ, PYTHONPATH=TORCHMP_PATH)
    # cwd "/": `-c` puts the cwd first on sys.path, and a source checkout
    # there (CI runs from one) would shadow the torchmp under test.
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd="/", timeout=60, check=True).stdout.split()
    assert out == ["torchmp", "torchmp._core", "torchmp._launch", "torchmp._launch.worker"], out


# --------------------------------------------------------------------------- the exit trailer


def _python_fields() -> list[tuple[int, int]]:
    """(offset, size) of each field of _forkserver's trailer struct."""
    fmt = _forkserver._TRAILER.format
    order = fmt[0] if fmt[0] in "<>!=@" else "@"
    fields, offset = [], 0
    for count, code in re.findall(r"(\d*)([a-zA-Z?])", fmt.lstrip("<>!=@")):
        n = int(count or 1)
        # "8s" is one field of 8 bytes; "2q" two fields
        for size in ([n * struct.calcsize(order + code)] if code in "sp" else [struct.calcsize(order + code)] * n):
            fields.append((offset, size))
            offset += size
    assert offset == _forkserver._TRAILER.size  # no padding in the Python layout
    return fields


def test_exit_trailer_layout_matches_the_c_struct() -> None:
    c_fields = _core.exit_trailer_fields()
    assert [name for name, _, _ in c_fields] == ["magic", "wait_status", "utime_ns", "stime_ns", "maxrss_kb"]
    assert _python_fields() == [(offset, size) for _, offset, size in c_fields]
    assert _forkserver._TRAILER.size == _core.EXIT_TRAILER_SIZE
    assert _forkserver._TRAILER_MAGIC == _core.EXIT_TRAILER_MAGIC.encode("ascii")
    assert len(_forkserver._TRAILER_MAGIC) == dict((n, s) for n, _, s in c_fields)["magic"]


def test_exit_trailer_written_by_python_reads_back_in_c_order() -> None:
    # What the forkserver writes, read field by field the way the C core
    # does (its offsets, native byte order): the same values come out.
    values = {"wait_status": 0x0300, "utime_ns": 123456789012, "stime_ns": -2, "maxrss_kb": 1 << 40}
    blob = _forkserver._trailer(values["wait_status"], values["utime_ns"], values["stime_ns"],
                                values["maxrss_kb"])
    assert len(blob) == _core.EXIT_TRAILER_SIZE
    for name, offset, size in _core.exit_trailer_fields():
        raw = blob[offset:offset + size]
        if name == "magic":
            assert raw.decode("ascii") == _core.EXIT_TRAILER_MAGIC
        else:
            assert int.from_bytes(raw, sys.byteorder, signed=True) == values[name], name


# --------------------------------------------------------------------------- spawn records


def test_stream_spec_defaults() -> None:
    spec = _core.StreamSpec(_core.STREAM_TEE, -1, 1, b"[p]")
    assert spec == (_core.STREAM_TEE, -1, 1, b"[p]", False, None, _core.DEFAULT_CONSOLE_BACKLOG, 0, False, False)
    assert _core.StreamSpec.__module__ == _core.RankSpec.__module__ == _core.ProcInfo.__module__ == "torchmp._core"
    assert len({_core.STREAM_INHERIT, _core.STREAM_FILE, _core.STREAM_TEE, _core.STREAM_RETURN}) == 4


RECORDS = [_core.ProcInfo, _core.ExitRecord, _core.StreamState, _core.WorkerFds, _core.Forked,
           _core.StreamSpec, _core.RankSpec, _core.Binding, _core.CommandInfo]


@pytest.mark.parametrize("record", RECORDS, ids=lambda cls: cls.__name__)
def test_the_records_keep_what_a_namedtuple_offers(record) -> None:
    # Written out as classes (a namedtuple compiles source at import), they
    # keep the surface code reads them by.
    fields = record._fields
    values = tuple(range(len(fields)))
    by_name = record(**dict(zip(fields, values, strict=True)))
    assert by_name == record(*values) == record._make(values) == values
    assert type(by_name) is record and record.__module__ == "torchmp._core"
    assert [getattr(by_name, name) for name in fields] == list(values)
    assert by_name._asdict() == dict(zip(fields, values, strict=True))
    assert by_name._replace(**{fields[-1]: "x"}) == values[:-1] + ("x",)
    shown = ", ".join(f"{name}={value!r}" for name, value in zip(fields, values, strict=True))
    assert repr(by_name) == f"{record.__name__}({shown})"
    assert pickle.loads(pickle.dumps(by_name)) == by_name and type(pickle.loads(pickle.dumps(by_name))) is record
    assert record.__match_args__ == fields
    assert set(record._field_defaults) <= set(fields)
    assert record(*values[:len(fields) - len(record._field_defaults)]) == (
        values[:len(fields) - len(record._field_defaults)] + tuple(record._field_defaults.values()))
    with pytest.raises(AttributeError):
        setattr(by_name, fields[0], 1)
    with pytest.raises(TypeError):
        record._make(values + (0,))
    with pytest.raises(ValueError, match="unexpected field"):
        by_name._replace(no_such_field=1)
    with pytest.raises(TypeError):
        record(*values[:-1 - len(record._field_defaults)])
    if sys.version_info >= (3, 13):
        import copy
        assert copy.replace(by_name, **{fields[0]: "y"}) == ("y",) + values[1:]


def test_spawn_takes_records_and_plain_tuples(tmp_path) -> None:
    log = tmp_path / "out.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        to_file = _core.StreamSpec(_core.STREAM_FILE, fd, -1, None)
        plain = tuple(sh("echo plain >&3"))
        ranks, returned = run_group([
            sh("echo record; echo ret >&3")._replace(out=to_file),
            plain,
        ])
    finally:
        os.close(fd)
    assert [info.wait_status for info in ranks] == [0, 0], ranks
    assert returned == [b"ret\n", b"plain\n"]
    assert log.read_bytes() == b"record\n"


@pytest.mark.parametrize("bad", [(_core.STREAM_INHERIT, -1, -1), tuple(INHERIT) + (False, None, 1, 0, "x"),
                                 [_core.STREAM_INHERIT, -1, -1, None]])
def test_malformed_stream_spec_is_refused(bad) -> None:
    group = _core.Group(1)
    try:
        with pytest.raises(TypeError, match="StreamSpec"):
            group.spawn([sh("exit 0")._replace(out=bad)])
        assert group.started == 0
    finally:
        group.release()
