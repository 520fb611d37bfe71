"""Property-based tests (hypothesis): parsers, input shapes, prefixes and the
console line framer.

* ``Std.from_str`` round-trips every valid setting and rejects junk with
  ``ValueError`` only; ``to_map`` matches a reference model or raises
  ``ValueError``/``TypeError``.
* The shapes of ``args``/``envs``: any value is either accepted or rejected
  with ``ValueError``/``TypeError`` before a directory or a process exists.
* Prefixes: any ``str`` reaches the console as its file-system encoding.
* The framer (``torchmp._core.frame``, the code the I/O thread runs): the
  console bytes do not depend on how the stream was cut into reads, and
  match a pure-Python model of the framing rules (model_framer).

Example counts are set per test (``@settings``); ``pytest
--hypothesis-show-statistics`` prints what ran.
"""
from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

import psutil
import pytest
from hypothesis import HealthCheck, event, example, given, settings, strategies as st

import torchmp
from torchmp import DefaultLogsSpecs, Std, SubprocessContext, _core, to_map

from workers import functions as fw


def fuzz(max_examples: int, fixtures: bool = False) -> settings:
    """Moderate example counts, no deadline (the machine is shared), no
    example database (each run explores afresh; failures print a reproducer)."""
    checks = [HealthCheck.too_slow] + ([HealthCheck.function_scoped_fixture] if fixtures else [])
    return settings(max_examples=max_examples, deadline=None, database=None, suppress_health_check=checks)


# --- Std.from_str ---------------------------------------------------------------

_WS = st.text(alphabet=" \t\n\r\x0b\x0c", max_size=3)
_STD = st.sampled_from(list(Std))


def _reference_from_str(text: str):
    """The documented grammar: one digit 0-3, or rank:value pairs with ASCII
    digit ranks and unique ranks; surrounding whitespace ignored."""
    t = text.strip()
    if re.fullmatch(r"[0-3]", t, re.ASCII):
        return Std(int(t))
    if not re.fullmatch(r"[0-9]+:[0-3](,[0-9]+:[0-3])*", t, re.ASCII):
        return ValueError
    out = {}
    for item in t.split(","):
        r, v = item.split(":")
        try:
            rank = int(r)
        except ValueError:  # more digits than int() takes
            return ValueError
        if rank in out:
            return ValueError
        out[rank] = Std(int(v))
    return out


@fuzz(300)
@given(value=_STD, pre=_WS, post=_WS)
def test_std_from_str_round_trips_a_single_value(value, pre, post):
    assert Std.from_str(f"{pre}{int(value)}{post}") is value


@fuzz(300)
@given(mapping=st.dictionaries(st.integers(0, 10**6), _STD, min_size=1, max_size=8), pre=_WS, post=_WS,
       zeros=st.integers(0, 2))
def test_std_from_str_round_trips_a_mapping(mapping, pre, post, zeros):
    text = ",".join(f"{'0' * zeros}{rank}:{int(v)}" for rank, v in mapping.items())
    parsed = Std.from_str(pre + text + post)
    assert parsed == mapping and all(type(v) is Std for v in parsed.values())
    # and back again
    assert Std.from_str(",".join(f"{r}:{int(v)}" for r, v in parsed.items())) == mapping


_STD_JUNK = st.one_of(
    st.text(max_size=20),
    st.text(alphabet="0123456789:, \t-+x\u0663\uff11", max_size=16),
    st.lists(st.tuples(st.integers(-3, 20), st.integers(-1, 5)), max_size=5).map(
        lambda items: ",".join(f"{r}:{v}" for r, v in items)),
)


@fuzz(500)
@given(text=_STD_JUNK)
@example("0:1,0:2").via("duplicate rank")
@example("\u0663").via("a non-ASCII digit")
@example("0:3,").via("trailing comma")
@example("1" * 5000 + ":1").via("more digits than int() takes")
def test_std_from_str_parses_exactly_the_grammar_and_raises_only_value_error(text):
    expected = _reference_from_str(text)
    if expected is ValueError:
        with pytest.raises(ValueError):
            Std.from_str(text)
    else:
        assert Std.from_str(text) == expected


@fuzz(100)
@given(value=st.one_of(st.none(), st.integers(), st.binary(max_size=4), st.floats(), st.lists(st.text(max_size=2))))
def test_std_from_str_rejects_non_str_with_type_error(value):
    with pytest.raises(TypeError):
        Std.from_str(value)


# --- to_map -------------------------------------------------------------------------

_ANY_VALUE = st.one_of(_STD, st.integers(-2, 6), st.booleans(), st.text(max_size=2), st.none(),
                       st.floats(allow_nan=False, max_value=5, min_value=-1))
_ANY_KEY = st.one_of(st.integers(-2, 12), st.booleans(), st.text(max_size=2), st.none())


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _reference_to_map(val, n):
    if not _is_int(n) or n < 0:
        return "error"

    def std(v):
        if not _is_int(v) or not 0 <= v <= 3:
            raise LookupError
        return Std(v)

    try:
        if isinstance(val, Mapping):
            if not all(_is_int(k) and k >= 0 for k in val):
                return "error"
            m = {k: std(v) for k, v in val.items()}
            return {r: m.get(r, Std.NONE) for r in range(n)}
        return dict.fromkeys(range(n), std(val))
    except LookupError:
        return "error"


@fuzz(500)
@given(val=st.one_of(_ANY_VALUE, st.dictionaries(_ANY_KEY, _ANY_VALUE, max_size=6)),
       n=st.one_of(st.integers(-2, 12), st.booleans(), st.none(), st.just(3.0)))
def test_to_map_matches_the_reference_or_raises_value_or_type_error(val, n):
    expected = _reference_to_map(val, n)
    if expected == "error":
        with pytest.raises((ValueError, TypeError)):
            to_map(val, n)
    else:
        got = to_map(val, n)
        assert got == expected and all(type(v) is Std for v in got.values())


# --- the shapes of args and envs ----------------------------------------------------------

def _weighted(*choices):
    """one_of with explicit weights: (weight, strategy) pairs."""
    table = [strategy for weight, strategy in choices for _ in range(weight)]
    return st.integers(0, len(table) - 1).flatmap(lambda i: table[i])


_ARG_ATOM = st.one_of(st.text(max_size=6), st.integers(), st.floats(allow_nan=False), st.none(), st.binary(max_size=4))
_GOOD_ARGS = st.one_of(st.tuples(), st.lists(_ARG_ATOM, max_size=3).map(tuple), st.text(max_size=6))
_ARG_VALUE = _weighted(
    (12, _GOOD_ARGS),
    (1, st.lists(_ARG_ATOM, max_size=3)),
    (1, st.one_of(st.binary(max_size=4), st.none())),
    (1, st.one_of(st.integers(), st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
                  st.sampled_from([("a\0b",), "\0", (1.5, "x\0")]))),
)
_GOOD_ENV = st.dictionaries(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="=\0"),
                                    min_size=1, max_size=5), st.text(max_size=5) | st.integers(), max_size=3)
_ENV_KEY = st.one_of(st.text(max_size=5), st.binary(max_size=4), st.integers(0, 3), st.none(),
                     st.sampled_from(["A=B", "K\0", "", "PATH", "TORCHELASTIC_ERROR_FILE", "\u00e9t\u00e9"]))
_ENV_VAL = st.one_of(st.text(max_size=5), st.binary(max_size=4), st.integers(), st.none(), st.floats(allow_nan=False),
                     st.sampled_from(["a\0b", "", "x=y", "\udcff", b"\0"]))
_ENV = _weighted((12, _GOOD_ENV), (2, st.dictionaries(_ENV_KEY, _ENV_VAL, max_size=3)),
                 (1, st.one_of(st.none(), st.text(max_size=3), st.lists(st.text(max_size=2), max_size=2))))
_EXTRA_KEYS = st.one_of(st.integers(-2, 8), st.text(max_size=1), st.booleans())


def _rank_maps(values, extra_keys=_EXTRA_KEYS):
    """Mostly well-keyed {0..n-1} dicts, sometimes with a missing/extra/odd key,
    sometimes not a dict at all."""
    well_keyed = st.lists(values, min_size=0, max_size=4).map(lambda vs: dict(enumerate(vs)))
    damaged = st.tuples(well_keyed, st.lists(st.tuples(extra_keys, values), max_size=2), st.integers(-1, 4)).map(
        lambda t: {**{k: v for k, v in t[0].items() if k != t[2]}, **dict(t[1])})
    return _weighted((8, well_keyed), (2, damaged),
                     (1, st.one_of(st.lists(values, max_size=3), st.none(), st.text(max_size=2))))


@st.composite
def _args_and_envs(draw):
    """args, and envs of the same length most of the time."""
    args = draw(_rank_maps(_ARG_VALUE))
    if draw(st.integers(0, 3)) and isinstance(args, dict):
        envs = draw(_weighted((1, st.none()), (4, st.lists(_ENV, min_size=len(args), max_size=len(args)).map(
            lambda es: dict(enumerate(es))))))
    else:
        envs = draw(_rank_maps(_ENV))
    return args, envs


def _expect_args(args, binary: bool):
    """Normalized args, or None if they must be rejected."""
    if not isinstance(args, Mapping) or set(args) != set(range(len(args))) or not all(_is_int(k) for k in args):
        return None
    out = {}
    for rank in range(len(args)):
        v = args[rank]
        if isinstance(v, (str, bytes)):
            v = (v,)
        elif v is None:
            v = ()
        else:
            try:
                v = tuple(v)
            except TypeError:
                return None
        if binary:
            for a in v:
                if (b"\0" if isinstance(a, bytes) else "\0") in (a if isinstance(a, (str, bytes)) else str(a)):
                    return None
        out[rank] = v
    return out


def _env_item_ok(k, v) -> bool:
    try:
        kb = os.fsencode(k) if isinstance(k, str) else k if isinstance(k, bytes) else None
        if kb is None or not kb or b"=" in kb or b"\0" in kb:
            return False
        vb = v if isinstance(v, bytes) else os.fsencode(v if isinstance(v, str) else str(v))
        return b"\0" not in vb
    except UnicodeError:
        return False


def _expect_envs_ok(envs, n: int) -> bool:
    if envs is None:
        return True
    if not isinstance(envs, Mapping) or set(envs) != set(range(n)) or not all(_is_int(k) for k in envs):
        return False
    return all(isinstance(e, dict) and all(_env_item_ok(k, v) for k, v in e.items()) for e in envs.values())


TRUE = shutil.which("true")  # absolute: no PATH lookup (envs may set PATH)


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.fixture(scope="module")
def shapes_root(tmp_path_factory):
    return tmp_path_factory.mktemp("shapes")


@fuzz(300, fixtures=True)
@given(args_envs=_args_and_envs(), kind=st.sampled_from(["binary", "function"]),
       name=_weighted((12, st.text(max_size=4)), (1, st.one_of(st.none(), st.integers()))))
def test_args_and_envs_shapes_are_accepted_or_rejected_before_anything_starts(shapes_root, args_envs, kind, name):
    args, envs = args_envs
    log_dir = shapes_root / "logs"
    shutil.rmtree(log_dir, ignore_errors=True)
    specs = DefaultLogsSpecs(log_dir=str(log_dir))
    before_tree = _tree(log_dir)
    children_before = len(psutil.Process().children())
    entry = TRUE if kind == "binary" else fw.return_arg
    expected_args = _expect_args(args, kind == "binary")
    valid = (isinstance(name, str) and expected_args is not None
             and _expect_envs_ok(envs, len(expected_args)))
    try:
        if kind == "binary":
            ctx = SubprocessContext(name, entry, args, envs, specs)
        else:
            ctx = torchmp.MultiprocessContext(name, entry, args, envs, "spawn", specs)
    except (ValueError, TypeError) as e:
        event(f"rejected: {type(e).__name__}")
        assert not valid, f"valid input rejected: {e!r}"
        assert _tree(log_dir) == before_tree, "a rejected launch created files"
        # The same through start_processes: rejected before anything starts.
        with pytest.raises((ValueError, TypeError)):
            torchmp.start_processes(name, entry, args, envs, specs)
        assert _tree(log_dir) == before_tree, "a rejected launch created files"
    else:
        event(f"accepted: {kind}")
        assert valid, "invalid input accepted"
        assert ctx.nprocs == len(expected_args) and ctx.args == expected_args
        assert all("TORCHELASTIC_ERROR_FILE" in ctx.envs[r] for r in range(ctx.nprocs))
        assert ctx.pids() == {}
        ctx.close()
    assert len(psutil.Process().children()) == children_before


# Found by this suite (the worker silently got the argument cut at the NUL);
# fixed in 73725f8.
def test_a_bytes_argument_with_nul_is_rejected(tmp_path):
    specs = DefaultLogsSpecs(log_dir=str(tmp_path / "l"))
    with pytest.raises(ValueError, match="NUL"):
        ctx = SubprocessContext("t", "echo", {0: (b"a\0b",)}, {0: {}}, specs)
        ctx.close()


_ENV_TEXT = st.text(st.sampled_from(["A", "\u00e9", "=", "\0", "\udcff", "\U0001f680", " "]), max_size=4)


@fuzz(400)
@given(key=_ENV_TEXT, value=_ENV_TEXT)
def test_an_env_item_is_encoded_as_os_fsencode_or_rejected(key, value):
    # The model: os.fsencode of both, a name that is non-empty without '=' or
    # NUL, a value without NUL.  (The str/str fast path must agree with it,
    # error message included.)
    from torchmp._inputs import encode_env_item
    try:
        kb, vb = os.fsencode(key), os.fsencode(value)
    except UnicodeEncodeError:
        kb = vb = None
    valid = kb is not None and kb and b"=" not in kb and b"\0" not in kb and b"\0" not in vb
    if valid:
        assert encode_env_item(3, key, value) == (kb, vb)
        assert encode_env_item(3, kb, vb) == (kb, vb)
    else:
        with pytest.raises((ValueError, UnicodeEncodeError)) as info:
            encode_env_item(3, key, value)
        if kb is not None:
            assert str(info.value).startswith("envs[3]"), info.value
            assert ("name" in str(info.value)) == (not kb or b"=" in kb or b"\0" in kb)


# --- prefixes ------------------------------------------------------------------------

def _frame(prefix: bytes, chunks, max_line=256 * 1024, scratch=4096) -> bytes:
    fd = os.memfd_create("framed", os.MFD_CLOEXEC)
    try:
        _core.frame(fd, prefix, list(chunks), max_line, scratch)
        size = os.lseek(fd, 0, os.SEEK_CUR)
        return os.pread(fd, size, 0) if size else b""
    finally:
        os.close(fd)


_PREFIX_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12) | st.sampled_from(
    ["", "[\u8bad\u7ec3 0]:", "\U0001f680 ", "\x00nul", "\udcff\udcfe", "%s{0}", "\r", "a\nb"])


@fuzz(300)
@given(prefix=_PREFIX_TEXT, lines=st.lists(st.binary(max_size=30).map(lambda b: b.replace(b"\n", b"")), max_size=5))
def test_any_str_prefix_reaches_the_console_as_its_fs_encoding(prefix, lines):
    pb = os.fsencode(prefix)
    data = b"".join(line + b"\n" for line in lines)
    out = _frame(pb, [data])
    assert out == b"".join(pb + model_shown(line) + b"\n" for line in lines)
    if lines:
        assert os.fsdecode(out[:len(pb)]) == prefix


@fuzz(40, fixtures=True)
@given(prefix=_PREFIX_TEXT, name=st.text(st.characters(blacklist_categories=("Cs",)), max_size=6))
def test_prefixes_and_names_through_a_real_launch(tmp_path_factory, capfdbinary, prefix, name):
    log_dir = tmp_path_factory.mktemp("prefix")
    capfdbinary.readouterr()
    specs = DefaultLogsSpecs(log_dir=str(log_dir), tee=Std.OUT)
    ctx = torchmp.start_processes(name, "sh", {0: ("-c", "echo one; printf two"), 1: ("-c", "echo three")},
                                  {0: {}, 1: {}}, specs, log_line_prefixes={0: prefix})
    result = ctx.wait(30)
    ctx.close()
    out, _ = capfdbinary.readouterr()
    assert result is not None and not result.is_failed()
    pb = os.fsencode(prefix)
    default = os.fsencode(f"[{name}1]:")
    expected = {pb + b"one\n" + pb + b"two\n", default + b"three\n"}
    if b"\n" not in pb + default:
        lines = [line + b"\n" for line in out.split(b"\n")[:-1]]
        # Each rank's lines are whole; ranks may interleave between lines.
        assert sorted(lines) == sorted([pb + b"one\n", pb + b"two\n", default + b"three\n"])
    else:
        assert len(out) == sum(map(len, expected))
    assert Path(result.stdouts[0]).read_bytes() == b"one\ntwo"


def test_a_prefix_that_cannot_be_encoded_is_rejected_and_leaves_nothing(tmp_path):
    specs = DefaultLogsSpecs(log_dir=str(tmp_path), tee=Std.OUT)
    with pytest.raises(ValueError):
        torchmp.start_processes("t", "true", {0: ()}, {0: {}}, specs, log_line_prefixes={0: "\ud800"})


# --- the line framer -------------------------------------------------------------------

def model_shown(piece: bytes) -> bytes:
    """What a terminal shows of a piece: what follows its last carriage
    return that something follows (a trailing run, as in CRLF, is kept)."""
    end = len(piece.rstrip(b"\r"))
    cr = piece.rfind(b"\r", 0, end)
    return piece[cr + 1:] if cr >= 0 else piece


def model_lines(prefix: bytes, data: bytes) -> bytes:
    """Framing when no line is longer than max_line: prefix + each line as a
    terminal shows it, a newline added to an unterminated last line.  Any
    read boundaries (and no time passing: partial lines wait for the end)."""
    if not data:
        return b""
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    return b"".join(prefix + model_shown(line) + b"\n" for line in lines)


def model_framer(prefix: bytes, data: bytes, max_line: int) -> bytes:
    """The framing rules, read boundaries aside: each line's content (without
    its newline; an unterminated last line included) goes out as console
    lines of max_line bytes, the last one 1..max_line bytes (an empty line
    as one empty console line), each as prefix + what a terminal shows of
    the piece + newline.  With no
    line longer than max_line this is model_lines."""
    max_line = max(max_line, 1)
    if not data:
        return b""
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    out = []
    for line in lines:
        pieces = [line[i:i + max_line] for i in range(0, len(line), max_line)] or [b""]
        out.extend(prefix + model_shown(piece) + b"\n" for piece in pieces)
    return b"".join(out)


_PIECES = st.one_of(
    st.binary(max_size=24),
    st.sampled_from([b"\n", b"\n\n", b"\r\n", b"\r", b"\0", b"\0\n", b"\xff\xfe", b"caf\xe9", b"\xf0\x28\x8c\x28",
                     b"\xe2\x82", b"\xac\n"]),
    st.builds(lambda n, c: c * n, st.integers(0, 200), st.sampled_from([b"a", b"\n", b"\0", b"ab\n"])),
)
_DATA = st.lists(_PIECES, max_size=12).map(b"".join)
_SCRATCH = st.one_of(st.just(0), st.integers(1, 48), st.sampled_from([4096, 1 << 16]))
_PREFIX = st.one_of(st.just(b""), st.binary(max_size=8),
                    st.sampled_from([b"[trainer0]:", b"\xe8\xae\xad ", b"p" * 100]))


@st.composite
def _chunked(draw, data_strategy=_DATA):
    data = draw(data_strategy)
    cuts = sorted(draw(st.sets(st.integers(0, len(data)), max_size=12)))
    bounds = [0] + cuts + [len(data)]
    chunks = [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    if draw(st.booleans()):
        chunks.insert(draw(st.integers(0, len(chunks))), b"")  # empty reads happen too
    return data, chunks


def _longest_line(data: bytes) -> int:
    return max((len(part) for part in data.split(b"\n")), default=0)


@fuzz(600)
@given(dc=_chunked(), prefix=_PREFIX, scratch=_SCRATCH, slack=st.one_of(st.integers(0, 8), st.none()))
def test_framer_output_does_not_depend_on_read_boundaries(dc, prefix, scratch, slack):
    data, chunks = dc
    # Every line within max_line: then the framing is plain prefix + line.
    max_line = 256 * 1024 if slack is None else _longest_line(data) + slack
    expected = model_lines(prefix, data)
    assert _frame(prefix, chunks, max_line, scratch) == expected
    assert _frame(prefix, [data], max_line, scratch) == expected
    assert _frame(prefix, [bytes([b]) for b in data], max_line, scratch) == expected


# Found by this suite: lines longer than max_line were cut where the reads
# happened to end (a complete line stayed whole however long; an over-long
# tail was flushed at the read boundary), so the console depended on pipe
# timing.  Fixed in 73725f8 (cut every max_line bytes, as model_framer says).
@fuzz(600)
@given(dc=_chunked(), prefix=_PREFIX, scratch=_SCRATCH, max_line=st.integers(0, 48))
@example(dc=(b"a" * 25 + b"\n", [b"aaaaa"] * 5 + [b"\n"]), prefix=b">", scratch=0, max_line=16)
def test_framer_matches_the_model_for_any_lines_and_reads(dc, prefix, scratch, max_line):
    data, chunks = dc
    expected = model_framer(prefix, data, max_line)
    assert _frame(prefix, [data], max_line, scratch) == expected
    out = _frame(prefix, chunks, max_line, scratch)
    assert out == expected


@fuzz(600)
@given(dc=_chunked(_DATA.map(lambda d: d.replace(b"\r", b""))), prefix=_PREFIX.filter(lambda p: b"\n" not in p),
       scratch=_SCRATCH, max_line=st.integers(0, 48))
def test_framer_output_is_the_input_cut_into_prefixed_lines(dc, prefix, scratch, max_line):
    """Whatever the splitting rule: every console line is prefix + a piece of
    the input, and the pieces with the added newlines dropped are the input.
    (Carriage returns overwrite: the model tests above cover them.)"""
    data, chunks = dc
    out = _frame(prefix, chunks, max_line, scratch)
    pieces = out.split(b"\n")
    assert pieces[-1] == b""
    assert all(piece.startswith(prefix) for piece in pieces[:-1])
    body = [piece[len(prefix):] for piece in pieces[:-1]]
    assert len(body) >= data.count(b"\n") and _reinsert_check(data, body)


def _reinsert_check(data: bytes, body: list[bytes]) -> bool:
    """data is body joined with a newline after each piece, some of which were added."""
    pos = 0
    for piece in body:
        if data[pos:pos + len(piece)] != piece:
            return False
        pos += len(piece)
        if data[pos:pos + 1] == b"\n":
            pos += 1
    return pos == len(data)


def test_overlong_lines_do_not_depend_on_read_boundaries():
    data = b"a" * 25 + b"\n" + b"b" * 40
    whole = _frame(b">", [data], 16)
    assert _frame(b">", [data[i:i + 5] for i in range(0, len(data), 5)], 16) == whole
    assert _frame(b">", [bytes([c]) for c in data], 16) == whole
    assert whole == model_framer(b">", data, 16)


# Found by this suite (a str chunk or a None prefix was read as bytes: its
# object header went to the console); fixed in 73725f8.
@pytest.mark.parametrize("prefix, chunks", [(b">", ["abc\n"]), (None, [b"abc\n"])])
def test_frame_rejects_what_is_not_bytes(prefix, chunks):
    with pytest.raises(TypeError):
        _frame(prefix, chunks)


# The real I/O thread: a worker writes the same bytes in random pieces; log
# file exact, console framed as the model says (lines within max_line).
#
# The model has no time in it: a partial line shown because it sat idle for
# TORCHMP_PARTIAL_IDLE_NS is a documented split the model does not draw.  The
# I/O thread reads waiting bytes before it looks at a deadline, so such a
# split needs the writer itself to pause that long between the start of one
# write and the end of the next.  The writer times each such window on its own
# clock; an attempt in which the machine paused it near that long is not the
# case this test checks, and is run again.

_WRITE_PIECES = """
import os, sys, time
data = bytes.fromhex(sys.argv[1])
cuts = [int(c) for c in sys.argv[2].split(",") if c]
bounds = [0] + cuts + [len(data)]
windows = []
started = None
for a, b in zip(bounds, bounds[1:]):
    before = time.monotonic()
    os.write(1, data[a:b])
    if started is not None:
        windows.append(time.monotonic() - started)
    started = before
    time.sleep(0.001)
with open(sys.argv[3], "w") as f:
    f.write(",".join(map(repr, windows)))
"""

_IDLE_FLUSH_S = 0.1  # TORCHMP_PARTIAL_IDLE_NS


def _a_partial_line_could_have_idled(data: bytes, cuts: list[int], windows_file: Path) -> bool:
    windows = [float(w) for w in windows_file.read_text().split(",") if w]
    assert len(windows) == len(cuts)
    return any(w > 0.8 * _IDLE_FLUSH_S and cut > 0 and not data[:cut].endswith(b"\n")
               for cut, w in zip(cuts, windows, strict=True))


@fuzz(25, fixtures=True)
@given(dc=_chunked(st.lists(_PIECES, min_size=1, max_size=8).map(b"".join)))
def test_tee_console_and_log_through_the_io_thread(tmp_path_factory, capfdbinary, dc):
    data, chunks = dc
    cuts = []
    pos = 0
    for c in chunks[:-1]:
        pos += len(c)
        cuts.append(pos)
    for _attempt in range(5):
        log_dir = tmp_path_factory.mktemp("tee")
        windows_file = log_dir.parent / (log_dir.name + ".windows")
        capfdbinary.readouterr()
        specs = DefaultLogsSpecs(log_dir=str(log_dir), tee=Std.OUT)
        ctx = torchmp.start_processes("w", sys.executable,
                                      {0: ("-c", _WRITE_PIECES, data.hex(), ",".join(map(str, cuts)),
                                           str(windows_file))},
                                      {0: {}}, specs)
        result = ctx.wait(30)
        ctx.close()
        out, _ = capfdbinary.readouterr()
        assert result is not None and not result.is_failed()
        assert Path(result.stdouts[0]).read_bytes() == data
        if not _a_partial_line_could_have_idled(data, cuts, windows_file):
            break
    else:
        pytest.fail("the writer paused near the idle-flush time with a partial line pending in 5 attempts")
    assert out == model_lines(b"[w0]:", data)
