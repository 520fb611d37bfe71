"""Tests for torchmp.logs_specs: Std, to_map, LogsDest and the two LogsSpecs layouts.

The parity tests at the end compare against torch when it is importable.
"""

from __future__ import annotations

import dataclasses
import doctest
import os
import re
import subprocess
import sys
import tempfile
import typing

import pytest

from torchmp import _inputs, logs_specs
from torchmp.logs_specs import (
    DefaultLogsSpecs,
    LegacyLogsSpecs,
    LogsDest,
    LogsSpecs,
    RankMappingError,
    Std,
    to_map,
    validate_full_rank,
)

ERR_ENV = "TORCHELASTIC_ERROR_FILE"
SYNTAX = (
    "expected a single value 0-3 (e.g. '3') or comma-separated <local_rank>:<value> "
    "pairs with value 0-3 (e.g. '0:3,1:0'); 0=NONE, 1=OUT, 2=ERR, 3=ALL"
)


def tree(root) -> list[str]:
    """Every path under root, relative, sorted; directories end with '/'."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for d in dirnames:
            out.append(os.path.normpath(os.path.join(rel, d)) + "/")
        for f in filenames:
            out.append(os.path.normpath(os.path.join(rel, f)))
    return sorted(out)


def only_child(path) -> str:
    entries = os.listdir(path)
    assert len(entries) == 1, entries
    return os.path.join(path, entries[0])


# --------------------------------------------------------------------------- module


def test_public_names_and_doctests():
    assert sorted(logs_specs.__all__) == [
        "DefaultLogsSpecs",
        "LegacyLogsSpecs",
        "LogsDest",
        "LogsSpecs",
        "RankMappingError",
        "Std",
        "to_map",
        "validate_full_rank",
    ]
    for name in logs_specs.__all__:
        assert getattr(logs_specs, name).__doc__, name
    result = doctest.testmod(logs_specs, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 20
    assert result.failed == 0
    # validate_full_rank and RankMappingError live with the other input checks.
    result = doctest.testmod(_inputs, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 2
    assert result.failed == 0


def test_module_does_not_import_torch():
    with open(logs_specs.__file__) as f:
        assert "import torch" not in f.read().replace("import torchmp", "")
    code = "import sys, torchmp.logs_specs; sys.exit('torch' in sys.modules)"
    root = os.path.dirname(os.path.dirname(os.path.abspath(logs_specs.__file__)))
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, timeout=30)
    assert proc.returncode == 0


# --------------------------------------------------------------------------- Std


def test_std_members():
    assert [(m.name, int(m)) for m in (Std.NONE, Std.OUT, Std.ERR, Std.ALL)] == [
        ("NONE", 0), ("OUT", 1), ("ERR", 2), ("ALL", 3)
    ]
    assert Std.OUT | Std.ERR is Std.ALL
    assert Std.ALL & Std.ERR is Std.ERR


@pytest.mark.parametrize(
    "text, expected",
    [
        ("0", Std.NONE),
        ("1", Std.OUT),
        ("2", Std.ERR),
        ("3", Std.ALL),
        (" 3\n", Std.ALL),
        ("0:3", {0: Std.ALL}),
        ("0:3,1:0,2:1,3:2", {0: Std.ALL, 1: Std.NONE, 2: Std.OUT, 3: Std.ERR}),
        ("10:1,2:3", {10: Std.OUT, 2: Std.ALL}),
        ("007:2", {7: Std.ERR}),
    ],
)
def test_std_from_str_good(text, expected):
    got = Std.from_str(text)
    assert got == expected
    if isinstance(expected, dict):
        assert list(got) == list(expected)  # order of the input is kept
        assert all(type(v) is Std for v in got.values())
    else:
        assert type(got) is Std


@pytest.mark.parametrize(
    "text",
    [
        "", " ", "4", "-1", "03", "a", "ALL", "1.0", "0x1", "+1",
        "0:4", "0:", ":1", "0:1,", ",0:1", "0:1,,1:2", "0;1", "0:1 1:2",
        "0:1, 1:2", "0 : 1", "0:1:2", "-1:1", "\uff13", "\u0663", "\u0663:1",
    ],
)
def test_std_from_str_bad(text):
    with pytest.raises(ValueError) as info:
        Std.from_str(text)
    assert str(info.value) == f"invalid Std setting {text!r}: {SYNTAX}"


def test_std_from_str_duplicate_rank():
    with pytest.raises(ValueError) as info:
        Std.from_str("0:3,1:0,01:1")
    assert str(info.value) == (
        "invalid Std setting '0:3,1:0,01:1': local rank 1 is given more than once"
    )


@pytest.mark.parametrize("value", [3, None, b"3", Std.ALL])
def test_std_from_str_not_a_str(value):
    with pytest.raises(TypeError, match="Std.from_str expects a str"):
        Std.from_str(value)


# --------------------------------------------------------------------------- to_map


def test_to_map_single_value():
    assert to_map(Std.OUT, 3) == {0: Std.OUT, 1: Std.OUT, 2: Std.OUT}
    assert to_map(2, 2) == {0: Std.ERR, 1: Std.ERR}
    assert all(type(v) is Std for v in to_map(2, 2).values())
    assert to_map(Std.ALL, 0) == {}


def test_to_map_mapping():
    src = {1: Std.OUT, 3: 2, 7: Std.ALL}
    got = to_map(src, 4)
    assert got == {0: Std.NONE, 1: Std.OUT, 2: Std.NONE, 3: Std.ERR}
    assert list(got) == [0, 1, 2, 3]
    assert all(type(v) is Std for v in got.values())
    assert src == {1: Std.OUT, 3: 2, 7: Std.ALL}  # input untouched
    assert to_map({}, 2) == {0: Std.NONE, 1: Std.NONE}


@pytest.mark.parametrize(
    "value, exc, message",
    [
        (4, ValueError, "val_or_map must be a Std or an int 0..3, got 4"),
        (-1, ValueError, "val_or_map must be a Std or an int 0..3, got -1"),
        (True, TypeError, "val_or_map must be a Std, an int 0..3 or a dict of local "
         "rank to Std, got bool True"),
        ("3", TypeError, "val_or_map must be a Std, an int 0..3 or a dict of local "
         "rank to Std, got str '3' (parse strings with Std.from_str)"),
        (None, TypeError, "val_or_map must be a Std, an int 0..3 or a dict of local "
         "rank to Std, got NoneType None"),
        ({0: 5}, ValueError, "val_or_map[0] must be a Std or an int 0..3, got 5"),
        ({0: "1"}, TypeError, "val_or_map[0] must be a Std or an int 0..3, got str '1'"),
        ({-1: 1}, ValueError, "val_or_map: local rank keys must be >= 0, got -1"),
        ({"0": 1}, TypeError, "val_or_map: local rank keys must be ints, got str '0'"),
    ],
)
def test_to_map_bad(value, exc, message):
    with pytest.raises(exc) as info:
        to_map(value, 2)
    assert type(info.value) is exc
    assert str(info.value) == message


def test_to_map_bad_world_size():
    with pytest.raises(ValueError, match="local_world_size must be >= 0, got -1"):
        to_map(Std.ALL, -1)
    with pytest.raises(TypeError, match="local_world_size must be an int"):
        to_map(Std.ALL, 2.0)


# --------------------------------------------------------------------------- validate_full_rank


def test_rank_mapping_error_is_value_and_runtime_error():
    assert issubclass(RankMappingError, ValueError)
    assert issubclass(RankMappingError, RuntimeError)


def test_validate_full_rank_ok():
    assert validate_full_rank({1: "b", 0: "a"}, 2, "args") is None
    assert validate_full_rank({}, 0, "args") is None


@pytest.mark.parametrize(
    "d, nprocs, message",
    [
        ({0: {}, "a": {}}, 2,
         "envs: missing local ranks [1]; unexpected keys ['a'] (expected keys 0..1 "
         "for nprocs=2)"),
        ({0: {}}, 3, "envs: missing local ranks [1, 2] (expected keys 0..2 for nprocs=3)"),
        ({0: {}, 1: {}, 5: {}, -1: {}}, 2,
         "envs: unexpected keys [-1, 5] (expected keys 0..1 for nprocs=2)"),
        ({0: {}, True: {}}, 2,
         "envs: missing local ranks [1]; unexpected keys [True] (expected keys 0..1 "
         "for nprocs=2)"),
        ({"1": {}, 0: {}, 1.0: {}}, 2,
         "envs: missing local ranks [1]; unexpected keys [1.0, '1'] (expected keys "
         "0..1 for nprocs=2)"),
        ({0: {}}, 0, "envs: unexpected keys [0] (expected no keys for nprocs=0)"),
        # As many int keys as ranks, but not 0..n-1: the fast path's bounds.
        ({1: {}, 2: {}}, 2, "envs: missing local ranks [0]; unexpected keys [2] (expected keys 0..1 for nprocs=2)"),
        ({-1: {}, 0: {}}, 2, "envs: missing local ranks [1]; unexpected keys [-1] (expected keys 0..1 for nprocs=2)"),
        ({True: {}}, 1, "envs: missing local ranks [0]; unexpected keys [True] (expected keys 0..0 for nprocs=1)"),
        ([{}, {}], 2,
         "envs: expected a dict keyed by local rank (keys 0..1 for nprocs=2), got list"),
    ],
)
def test_validate_full_rank_messages(d, nprocs, message):
    with pytest.raises(RankMappingError) as info:
        validate_full_rank(d, nprocs, "envs")
    assert str(info.value) == message


def test_validate_full_rank_catchable_as_torch_types():
    with pytest.raises(RuntimeError):
        validate_full_rank({}, 1, "args")
    with pytest.raises(ValueError):
        validate_full_rank({}, 1, "args")


def test_validate_full_rank_bad_nprocs():
    with pytest.raises(ValueError, match="nprocs must be >= 0"):
        validate_full_rank({}, -1, "args")
    with pytest.raises(TypeError, match="nprocs must be an int"):
        validate_full_rank({}, "2", "args")


# --------------------------------------------------------------------------- LogsDest / LogsSpecs


def test_logs_dest_fields_and_defaults():
    names = [f.name for f in dataclasses.fields(LogsDest)]
    assert names == [
        "stdouts", "stderrs", "tee_stdouts", "tee_stderrs", "error_files",
        "filtered_stdout", "filtered_stderr",
    ]
    a, b = LogsDest(), LogsDest()
    assert a == b and a.stdouts == {} and a.filtered_stdout == ""
    a.stdouts[0] = "x"
    assert b.stdouts == {}  # no shared default


def test_logs_specs_is_abstract():
    with pytest.raises(TypeError):
        LogsSpecs()

    class Mine(LogsSpecs):
        def reify(self, envs):
            return LogsDest(error_files={r: "" for r in envs})

        @property
        def root_log_dir(self):
            return str(self._root_log_dir)

    m = Mine("/x", Std.OUT, {0: Std.ERR}, {1})
    assert m.root_log_dir == "/x"
    assert (m._redirects, m._tee, m._local_ranks_filter) == (Std.OUT, {0: Std.ERR}, {1})
    assert m.reify({0: {}}).error_files == {0: ""}


# --------------------------------------------------------------------------- DefaultLogsSpecs


def envs_for(n, run_id="job", restart="0"):
    envs = {r: {"LOCAL_RANK": str(r)} for r in range(n)}
    if n:
        envs[0].update(TORCHELASTIC_RUN_ID=run_id, TORCHELASTIC_RESTART_COUNT=restart)
    return envs


def test_default_creates_log_dir_in_init(tmp_path):
    log_dir = tmp_path / "a" / "b"
    specs = DefaultLogsSpecs(log_dir)
    assert log_dir.is_dir() and os.listdir(log_dir) == []
    assert specs.root_log_dir == str(log_dir)


def test_default_none_log_dir_is_a_temp_dir(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    specs = DefaultLogsSpecs()
    assert os.path.dirname(specs.root_log_dir) == str(tmp_path)
    assert os.path.basename(specs.root_log_dir).startswith("torchelastic_")
    assert os.path.isdir(specs.root_log_dir)


def test_default_log_dir_is_a_file(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(NotADirectoryError, match=f"log_dir: {f} is a file"):
        DefaultLogsSpecs(f)


def test_default_log_dir_that_is_neither_file_nor_directory(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(NotADirectoryError, match=f"log_dir: {fifo} is not a directory"):
        DefaultLogsSpecs(fifo)
    # A missing one is made, parents too; a path through a file cannot be.
    DefaultLogsSpecs(tmp_path / "a" / "b")
    assert (tmp_path / "a" / "b").is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        DefaultLogsSpecs(tmp_path / "file" / "logs")


@pytest.mark.parametrize(
    "kwargs, exc, message",
    [
        ({"redirects": 4}, ValueError, "redirects must be a Std or an int 0..3, got 4"),
        ({"tee": "3"}, TypeError, "tee must be a Std, an int 0..3 or a dict of local "
         "rank to Std, got str '3' (parse strings with Std.from_str)"),
        ({"tee": {0: 9}}, ValueError, "tee[0] must be a Std or an int 0..3, got 9"),
        ({"redirects": {"0": 1}}, TypeError,
         "redirects: local rank keys must be ints, got str '0'"),
        ({"local_ranks_filter": "01"}, TypeError,
         "local_ranks_filter must be a set (or other iterable) of ints, got str '01'"),
        ({"local_ranks_filter": 1}, TypeError,
         "local_ranks_filter must be a set (or other iterable) of ints, got int 1"),
        ({"local_ranks_filter": {0, -2}}, ValueError,
         "local_ranks_filter: local rank keys must be >= 0, got -2"),
        ({"local_ranks_filter": [0.0]}, TypeError,
         "local_ranks_filter: local rank keys must be ints, got float 0.0"),
    ],
)
def test_default_bad_arguments_create_nothing(tmp_path, kwargs, exc, message):
    log_dir = tmp_path / "logs"
    with pytest.raises(exc) as info:
        DefaultLogsSpecs(log_dir, **kwargs)
    assert str(info.value) == message
    assert not log_dir.exists()


def test_default_bad_log_dir_type():
    with pytest.raises(TypeError, match="log_dir must be a str or os.PathLike path"):
        DefaultLogsSpecs(3)
    with pytest.raises(TypeError, match="log_dir must be a str path, got bytes"):
        DefaultLogsSpecs(b"/tmp")


def test_default_layout_redirect_all(tmp_path):
    envs = envs_for(2, run_id="myrun", restart="3")
    dest = DefaultLogsSpecs(tmp_path, redirects=Std.ALL).reify(envs)
    run_dir = only_child(tmp_path)
    assert os.path.basename(run_dir).startswith("myrun_")
    att = os.path.join(run_dir, "attempt_3")
    assert tree(tmp_path) == sorted(
        [os.path.basename(run_dir) + "/"]
        + [os.path.join(os.path.basename(run_dir), p)
           for p in ("attempt_3/", "attempt_3/0/", "attempt_3/1/")]
    )
    assert dest == LogsDest(
        stdouts={r: os.path.join(att, str(r), "stdout.log") for r in range(2)},
        stderrs={r: os.path.join(att, str(r), "stderr.log") for r in range(2)},
        tee_stdouts={},
        tee_stderrs={},
        error_files={r: os.path.join(att, str(r), "error.json") for r in range(2)},
        filtered_stdout=os.path.join(att, "filtered_stdout.log"),
        filtered_stderr=os.path.join(att, "filtered_stderr.log"),
    )
    assert [envs[r][ERR_ENV] for r in range(2)] == [dest.error_files[0], dest.error_files[1]]
    assert envs[1]["LOCAL_RANK"] == "1"  # other variables kept


def test_default_layout_mixed_redirect_and_tee(tmp_path):
    envs = envs_for(3)
    specs = DefaultLogsSpecs(tmp_path, redirects={0: Std.OUT}, tee={1: Std.ERR, 2: Std.ALL})
    dest = specs.reify(envs)
    att = os.path.join(only_child(tmp_path), "attempt_0")
    p = lambda r, n: os.path.join(att, str(r), n)  # noqa: E731
    # tee implies redirect
    assert dest.stdouts == {0: p(0, "stdout.log"), 1: "", 2: p(2, "stdout.log")}
    assert dest.stderrs == {0: "", 1: p(1, "stderr.log"), 2: p(2, "stderr.log")}
    assert dest.tee_stdouts == {2: p(2, "stdout.log")}
    assert dest.tee_stderrs == {1: p(1, "stderr.log"), 2: p(2, "stderr.log")}
    assert dest.error_files == {r: p(r, "error.json") for r in range(3)}
    assert {r: envs[r][ERR_ENV] for r in range(3)} == dest.error_files


def test_default_defaults_without_env_vars(tmp_path):
    dest = DefaultLogsSpecs(tmp_path).reify({0: {}})
    run_dir = only_child(tmp_path)
    assert os.path.basename(run_dir).startswith("test_run_id_")
    assert dest.error_files == {0: os.path.join(run_dir, "attempt_0", "0", "error.json")}
    assert dest.stdouts == {0: ""} and dest.stderrs == {0: ""}


def test_default_run_dir_reused_and_attempt_dir_wiped(tmp_path):
    specs = DefaultLogsSpecs(tmp_path, redirects=Std.OUT)
    d0 = specs.reify(envs_for(1, restart="0"))
    run_dir = only_child(tmp_path)
    with open(d0.stdouts[0], "w") as f:
        f.write("old")
    d1 = specs.reify(envs_for(2, restart="1"))
    assert only_child(tmp_path) == run_dir
    assert d1.stdouts[1] == os.path.join(run_dir, "attempt_1", "1", "stdout.log")
    assert sorted(os.listdir(run_dir)) == ["attempt_0", "attempt_1"]
    specs.reify(envs_for(1, restart="0"))  # same attempt again: wiped, re-created
    assert os.listdir(os.path.join(run_dir, "attempt_0")) == ["0"]
    assert os.listdir(os.path.join(run_dir, "attempt_0", "0")) == []


def test_run_dir_named_and_made_as_mkdtemp_makes_it(tmp_path, monkeypatch):
    """The run directory: "{run_id}_" and 8 characters of tempfile's
    alphabet, mode 0o700 (umask aside), a new name while one is taken, and a
    path as absolute as tempfile.mkdtemp's on this Python."""
    old = os.umask(0)
    try:
        path = logs_specs._make_unique_dir(str(tmp_path), "job_")
    finally:
        os.umask(old)
    name = os.path.basename(path)
    assert re.fullmatch(r"job_[a-z0-9_]{8}", name), name
    assert os.stat(path).st_mode & 0o777 == 0o700
    # The same random bytes twice: the second call's first name is taken.
    draws = iter([b"\x00" * 8, b"\x00" * 8, b"\x01" * 8])
    monkeypatch.setattr(os, "urandom", lambda n: next(draws))
    first = logs_specs._make_unique_dir(str(tmp_path), "r_")
    second = logs_specs._make_unique_dir(str(tmp_path), "r_")
    assert os.path.basename(first) == "r_aaaaaaaa" and os.path.basename(second) == "r_bbbbbbbb"
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    os.mkdir("rel")
    ours = logs_specs._make_unique_dir("rel", "x_")
    theirs = tempfile.mkdtemp(prefix="x_", dir="rel")
    assert os.path.isabs(ours) == os.path.isabs(theirs)
    assert os.path.dirname(ours) == os.path.dirname(theirs)


def test_default_local_ranks_filter(tmp_path):
    envs = envs_for(3)
    specs = DefaultLogsSpecs(
        tmp_path, redirects={2: Std.OUT}, tee={0: Std.ALL, 1: Std.ALL},
        local_ranks_filter={0},
    )
    dest = specs.reify(envs)
    att = os.path.join(only_child(tmp_path), "attempt_0")
    p = lambda r, n: os.path.join(att, str(r), n)  # noqa: E731
    # rank 0: teed; rank 1: teed but filtered -> files only; rank 2: redirected
    # stdout kept in its file, console stderr silenced.
    assert dest.stdouts == {0: p(0, "stdout.log"), 1: p(1, "stdout.log"), 2: p(2, "stdout.log")}
    assert dest.stderrs == {0: p(0, "stderr.log"), 1: p(1, "stderr.log"), 2: os.devnull}
    assert dest.tee_stdouts == {0: p(0, "stdout.log")}
    assert dest.tee_stderrs == {0: p(0, "stderr.log")}
    assert dest.error_files == {r: p(r, "error.json") for r in range(3)}


def test_default_local_ranks_filter_console_streams(tmp_path):
    dest = DefaultLogsSpecs(tmp_path, local_ranks_filter=iter([1])).reify(envs_for(2))
    assert dest.stdouts == {0: os.devnull, 1: ""}
    assert dest.stderrs == {0: os.devnull, 1: ""}


def test_default_empty_filter_means_no_filter(tmp_path):
    dest = DefaultLogsSpecs(tmp_path, local_ranks_filter=set()).reify(envs_for(2))
    assert dest.stdouts == {0: "", 1: ""}


def test_default_devnull(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    specs = DefaultLogsSpecs(os.devnull, redirects=Std.ALL, tee=Std.OUT)
    assert specs.root_log_dir == os.devnull
    envs = envs_for(2)
    dest = specs.reify(envs)
    assert os.listdir(tmp_path) == []
    assert dest == LogsDest(
        stdouts={0: "", 1: ""},
        stderrs={0: "", 1: ""},
        tee_stdouts={0: os.devnull, 1: os.devnull},
        tee_stderrs={0: os.devnull, 1: os.devnull},
        error_files={0: os.devnull, 1: os.devnull},
        filtered_stdout=os.devnull,
        filtered_stderr=os.devnull,
    )
    assert envs[0][ERR_ENV] == "" and envs[1][ERR_ENV] == ""


def test_default_devnull_with_filter():
    dest = DefaultLogsSpecs(os.devnull, local_ranks_filter={1}).reify(envs_for(2))
    assert dest.stdouts == {0: os.devnull, 1: ""}
    assert dest.stderrs == {0: os.devnull, 1: ""}
    assert dest.tee_stdouts == {1: os.devnull}
    assert dest.error_files == {0: os.devnull, 1: os.devnull}


def test_default_empty_envs(tmp_path):
    dest = DefaultLogsSpecs(tmp_path, redirects=Std.ALL).reify({})
    assert dest.stdouts == {} and dest.error_files == {}
    run_dir = only_child(tmp_path)
    assert os.path.basename(run_dir).startswith("test_run_id_")
    assert dest.filtered_stdout == os.path.join(run_dir, "attempt_0", "filtered_stdout.log")


def test_default_bad_envs_create_nothing(tmp_path):
    specs = DefaultLogsSpecs(tmp_path, redirects=Std.ALL)
    with pytest.raises(RankMappingError, match=r"envs: missing local ranks \[0\]"):
        specs.reify({1: {}})
    with pytest.raises(RankMappingError, match=r"envs\[1\]: expected a dict"):
        specs.reify({0: {}, 1: None})
    assert os.listdir(tmp_path) == []


def test_default_repr_and_eq(tmp_path):
    a = DefaultLogsSpecs(tmp_path, redirects=3, tee={1: 1}, local_ranks_filter=[0, 1])
    b = DefaultLogsSpecs(str(tmp_path), redirects=Std.ALL, tee={1: Std.OUT},
                         local_ranks_filter={1, 0})
    c = DefaultLogsSpecs(tmp_path, redirects=Std.ALL, tee={1: Std.ERR})
    assert a == b and a != c and a != "x"
    assert repr(a) == (
        f"DefaultLogsSpecs(root_log_dir={tmp_path}, redirects=3, "
        "tee={1: <Std.OUT: 1>}, local_ranks_filter={0, 1})"
    )
    assert type(a._redirects) is Std and type(a._tee[1]) is Std


def test_default_stores_a_copy_of_mappings(tmp_path):
    tee = {0: Std.OUT}
    specs = DefaultLogsSpecs(tmp_path, tee=tee)
    tee[1] = Std.ALL
    assert specs.reify(envs_for(2)).tee_stdouts.keys() == {0}


# --------------------------------------------------------------------------- LegacyLogsSpecs


def test_legacy_layout_and_creation(tmp_path):
    log_dir = tmp_path / "x" / "logs"
    specs = LegacyLogsSpecs(log_dir, redirects={0: Std.ERR}, tee={1: Std.OUT})
    assert specs.root_log_dir == str(log_dir)
    assert not (tmp_path / "x").exists()  # constructor creates nothing
    envs = {0: {"A": "1"}, 1: {}}
    dest = specs.reify(envs)
    assert tree(tmp_path) == ["x/", "x/logs/", "x/logs/0/", "x/logs/1/"]
    p = lambda r, n: os.path.join(str(log_dir), str(r), n)  # noqa: E731
    assert dest == LogsDest(
        stdouts={0: "", 1: p(1, "stdout.log")},  # tee implies redirect
        stderrs={0: p(0, "stderr.log"), 1: ""},
        tee_stdouts={1: p(1, "stdout.log")},
        tee_stderrs={},
        error_files={0: p(0, "error.json"), 1: p(1, "error.json")},
        filtered_stdout=os.path.join(str(log_dir), "filtered_stdout.log"),
        filtered_stderr=os.path.join(str(log_dir), "filtered_stderr.log"),
    )
    assert envs == {0: {"A": "1", ERR_ENV: p(0, "error.json")}, 1: {ERR_ENV: p(1, "error.json")}}


def test_legacy_existing_empty_dir(tmp_path):
    dest = LegacyLogsSpecs(tmp_path, redirects=Std.ALL, tee=Std.ALL).reify({0: {}})
    assert tree(tmp_path) == ["0/"]
    assert dest.tee_stdouts == {0: str(tmp_path / "0" / "stdout.log")}
    assert dest.tee_stderrs == {0: str(tmp_path / "0" / "stderr.log")}


def test_legacy_validate_has_no_side_effects(tmp_path):
    specs = LegacyLogsSpecs(tmp_path / "a" / "b", redirects=Std.ALL)
    specs.validate()
    specs.validate()
    assert os.listdir(tmp_path) == []


def test_legacy_log_dir_is_a_file(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    specs = LegacyLogsSpecs(f)
    for call in (specs.validate, lambda: specs.reify({0: {}})):
        with pytest.raises(NotADirectoryError) as info:
            call()
        assert str(info.value) == f"log_dir {str(f)!r} is a file"
    assert f.read_text() == "x"


def test_legacy_log_dir_under_a_file(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    specs = LegacyLogsSpecs(f / "logs")
    with pytest.raises(NotADirectoryError) as info:
        specs.validate()
    assert str(info.value) == (
        f"log_dir {str(f / 'logs')!r} cannot be created: {str(f)!r} is not a directory"
    )


def test_legacy_log_dir_dangling_symlink(tmp_path):
    (tmp_path / "link").symlink_to(tmp_path / "missing")
    with pytest.raises(NotADirectoryError, match="is a broken symbolic link"):
        LegacyLogsSpecs(tmp_path / "link").validate()


def test_legacy_log_dir_not_empty(tmp_path):
    (tmp_path / "old").mkdir()
    specs = LegacyLogsSpecs(tmp_path)
    for call in (specs.validate, lambda: specs.reify({0: {}})):
        with pytest.raises(RuntimeError) as info:
            call()
        assert str(info.value) == (
            f"log_dir {str(tmp_path)!r} is not empty (it contains 'old'); the 1.9 "
            "form of start_processes needs a missing or empty directory"
        )
    assert os.listdir(tmp_path) == ["old"]


def test_legacy_not_empty_lists_at_most_three(tmp_path):
    for name in "abcde":
        (tmp_path / name).write_text("")
    with pytest.raises(RuntimeError, match=r"contains '\w', '\w', '\w', \.\.\.\)"):
        LegacyLogsSpecs(tmp_path).validate()


def test_legacy_is_one_shot(tmp_path):
    specs = LegacyLogsSpecs(tmp_path / "logs")
    specs.reify({0: {}})
    with pytest.raises(RuntimeError, match="is not empty"):
        specs.reify({0: {}})


def test_legacy_bad_envs_create_nothing(tmp_path):
    specs = LegacyLogsSpecs(tmp_path / "logs")
    with pytest.raises(RankMappingError) as info:
        specs.reify({0: {}, 2: {}})
    assert str(info.value) == (
        "envs: missing local ranks [1]; unexpected keys [2] (expected keys 0..1 for "
        "nprocs=2)"
    )
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "args, exc, message",
    [
        ((None,), TypeError, "log_dir is required (a str path), got None"),
        (("",), ValueError, "log_dir must be a non-empty path, got ''"),
        (("/x", 7), ValueError, "redirects must be a Std or an int 0..3, got 7"),
        (("/x", 0, [1]), TypeError, "tee must be a Std, an int 0..3 or a dict of "
         "local rank to Std, got list [1]"),
    ],
)
def test_legacy_bad_arguments(args, exc, message):
    with pytest.raises(exc) as info:
        LegacyLogsSpecs(*args)
    assert str(info.value) == message


def test_legacy_repr_and_eq(tmp_path):
    a = LegacyLogsSpecs(tmp_path, 3, {0: 1})
    assert a == LegacyLogsSpecs(str(tmp_path), Std.ALL, {0: Std.OUT})
    assert a != LegacyLogsSpecs(tmp_path, Std.ALL)
    assert repr(a) == (
        f"LegacyLogsSpecs(log_dir={str(tmp_path)!r}, redirects=<Std.ALL: 3>, "
        "tee={0: <Std.OUT: 1>})"
    )
    assert isinstance(a, LogsSpecs)


# --------------------------------------------------------------------------- parity with torch


@pytest.fixture(scope="module")
def tapi():
    return pytest.importorskip("torch.distributed.elastic.multiprocessing.api")


def relative_dest(dest, root):
    """LogsDest as a dict with every path made relative to root ('' kept)."""
    def rel(p):
        if p in ("", os.devnull):
            return p
        return os.path.relpath(p, root)

    out = {}
    for f in dataclasses.fields(dest):
        v = getattr(dest, f.name)
        out[f.name] = {k: rel(p) for k, p in v.items()} if isinstance(v, dict) else rel(v)
    return out


COMBOS = [
    ({}, 2),
    ({"redirects": "ALL"}, 3),
    ({"tee": "ALL"}, 2),
    ({"redirects": {0: "OUT"}, "tee": {1: "ERR", 2: "ALL"}}, 3),
    ({"redirects": "ERR", "tee": "OUT", "local_ranks_filter": {0, 2}}, 4),
    ({"redirects": {3: "OUT"}, "local_ranks_filter": {1}}, 4),
    ({"tee": {0: "ALL", 9: "ALL"}, "local_ranks_filter": set()}, 2),
    ({"redirects": "ALL"}, 0),
]


def build(std_cls, kwargs):
    def conv(v):
        if isinstance(v, dict):
            return {k: std_cls[s] for k, s in v.items()}
        return std_cls[v]

    return {k: (conv(v) if k in ("redirects", "tee") else v) for k, v in kwargs.items()}


@pytest.mark.parametrize("kwargs, n", COMBOS)
def test_parity_default_logs_specs(tapi, tmp_path, kwargs, n):
    results = []
    for name, mod in (("ours", logs_specs), ("torch", tapi)):
        root = tmp_path / name
        specs = mod.DefaultLogsSpecs(str(root), **build(mod.Std, kwargs))
        envs = {r: {} for r in range(n)}
        if n:
            envs[0].update(TORCHELASTIC_RUN_ID="rid", TORCHELASTIC_RESTART_COUNT="2")
        dest = specs.reify(envs)
        run_dir = only_child(root)
        assert os.path.basename(run_dir).startswith("rid_" if n else "test_run_id_")
        envs_rel = {r: os.path.relpath(e[ERR_ENV], run_dir) for r, e in envs.items()}
        results.append((relative_dest(dest, run_dir), envs_rel, tree(run_dir)))
    assert results[0] == results[1]


@pytest.mark.parametrize("kwargs", [{}, {"redirects": "ALL", "tee": {1: "OUT"}}])
def test_parity_default_devnull(tapi, kwargs):
    ours = logs_specs.DefaultLogsSpecs(os.devnull, **build(logs_specs.Std, kwargs))
    theirs = tapi.DefaultLogsSpecs(os.devnull, **build(tapi.Std, kwargs))
    envs_o, envs_t = {0: {}, 1: {}}, {0: {}, 1: {}}
    do, dt = ours.reify(envs_o), theirs.reify(envs_t)
    assert envs_o == envs_t
    # Deliberate difference: torch's filtered paths are "/dev/null/filtered_*.log".
    assert dataclasses.replace(do, filtered_stdout="", filtered_stderr="") == LogsDest(
        **{f.name: getattr(dt, f.name) for f in dataclasses.fields(dt)
           if not f.name.startswith("filtered_")}
    )
    assert (do.filtered_stdout, do.filtered_stderr) == (os.devnull, os.devnull)


def test_parity_repr_and_root_log_dir(tapi, tmp_path):
    ours = logs_specs.DefaultLogsSpecs(tmp_path, redirects=logs_specs.Std.ALL,
                                       tee={0: logs_specs.Std.OUT}, local_ranks_filter={0})
    theirs = tapi.DefaultLogsSpecs(str(tmp_path), redirects=tapi.Std.ALL,
                                   tee={0: tapi.Std.OUT}, local_ranks_filter={0})
    assert repr(ours) == repr(theirs)
    assert ours.root_log_dir == theirs.root_log_dir


def test_parity_logs_dest_fields(tapi):
    assert [f.name for f in dataclasses.fields(LogsDest)] == [
        f.name for f in dataclasses.fields(tapi.LogsDest)
    ]
    assert typing.get_type_hints(LogsDest) == typing.get_type_hints(tapi.LogsDest)
    assert LogsDest() == LogsDest(**dataclasses.asdict(tapi.LogsDest()))


TORCH_ACCEPTS = [
    "0", "1", "2", "3", "3\n", "0:0", "9:3", "0:3,1:0,2:1,3:2", "5:1,0:2",
    "0:1,1:1,2:1,3:1,4:1,5:1,6:1,7:1,8:1,9:1",
]
TORCH_REJECTS = ["", "4", "a", "0:4", "0:1,", ":1", "0;1", "0:1, 1:2", "03", "-0"]


@pytest.mark.parametrize("text", TORCH_ACCEPTS)
def test_parity_from_str_accepted(tapi, text):
    ours, theirs = Std.from_str(text), tapi.Std.from_str(text)
    if isinstance(theirs, dict):
        assert {k: int(v) for k, v in ours.items()} == {k: int(v) for k, v in theirs.items()}
        assert list(ours) == list(theirs)
    else:
        assert int(ours) == int(theirs) and ours.name == theirs.name


@pytest.mark.parametrize("text", TORCH_REJECTS)
def test_parity_from_str_rejected(tapi, text):
    with pytest.raises(ValueError):
        tapi.Std.from_str(text)
    with pytest.raises(ValueError):
        Std.from_str(text)


def test_parity_to_map(tapi):
    for val, n in [("OUT", 3), ({1: "ALL", 4: "ERR"}, 3), ({}, 2)]:
        ours = to_map(build(Std, {"tee": val})["tee"], n)
        theirs = tapi.to_map(build(tapi.Std, {"tee": val})["tee"], n)
        assert {k: int(v) for k, v in ours.items()} == {k: int(v) for k, v in theirs.items()}


def test_parity_validate_full_rank_raises_where_torch_does(tapi):
    cases = [({0: 1}, 2), ({0: 1, 1: 1, 2: 1}, 2), ({1: 1}, 1), ({0: 1, 1: 1}, 2), ({}, 0)]
    for d, n in cases:
        try:
            tapi._validate_full_rank(d, n, "x")
            torch_ok = True
        except RuntimeError:
            torch_ok = False
        try:
            validate_full_rank(d, n, "x")
            ours_ok = True
        except RuntimeError:
            ours_ok = False
        assert ours_ok == torch_ok, (d, n)


def test_torch_std_values_accepted(tapi, tmp_path):
    specs = DefaultLogsSpecs(tmp_path, redirects=tapi.Std.ALL, tee={0: tapi.Std.OUT})
    assert specs == DefaultLogsSpecs(tmp_path, redirects=Std.ALL, tee={0: Std.OUT})
    assert to_map(tapi.Std.ERR, 1) == {0: Std.ERR}
