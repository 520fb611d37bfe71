"""Where each worker's stdout, stderr and error file go.

This module is pure Python and has no side effects at import. It holds the
stream-selection flag :class:`Std`, the value object :class:`LogsDest`, the
abstract :class:`LogsSpecs` and two concrete layouts:

=========================  ==========================================================
class                      layout produced by ``reify(envs)``
=========================  ==========================================================
:class:`DefaultLogsSpecs`  ``{log_dir}/{run_id}_<random>/attempt_{restart}/{rank}/``
                           (the torch 2.x layout, used by ``torchrun``)
:class:`LegacyLogsSpecs`   ``{log_dir}/{rank}/`` (the torch 1.9 ``start_processes``
                           form that takes ``log_dir, redirects, tee``)
=========================  ==========================================================

Each rank directory may hold ``stdout.log``, ``stderr.log`` and ``error.json``;
``reify`` stores the error file's path in ``envs[rank]["TORCHELASTIC_ERROR_FILE"]``.

Example:

>>> import os, shutil, tempfile
>>> root = tempfile.mkdtemp()
>>> specs = DefaultLogsSpecs(log_dir=root, redirects=Std.ERR, tee={1: Std.OUT})
>>> envs = {0: {"TORCHELASTIC_RUN_ID": "job"}, 1: {}}
>>> dest = specs.reify(envs)
>>> os.path.relpath(dest.stderrs[0], root).split(os.sep)[1:]
['attempt_0', '0', 'stderr.log']
>>> dest.stdouts[0], dest.tee_stdouts == {1: dest.stdouts[1]}
('', True)
>>> envs[1]["TORCHELASTIC_ERROR_FILE"] == dest.error_files[1]
True
>>> shutil.rmtree(root)

Error types: malformed ``Std`` strings, out-of-range values and bad rank keys raise
``ValueError``; values of the wrong type raise ``TypeError``; a rank mapping of the
wrong shape (missing or extra local ranks) raises :class:`RankMappingError`, which is
both a ``ValueError`` and a ``RuntimeError`` (torch raises ``RuntimeError``); a
``log_dir`` that is not a directory raises ``NotADirectoryError``.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import stat
import sys
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import IntFlag
from typing import Union

from torchmp._inputs import (
    RankMappingError,
    as_log_dir,
    as_rank,
    as_ranks_filter,
    check_envs,
    is_int,
    validate_full_rank,
)
from torchmp._signals import is_interrupt

__all__ = [
    "DefaultLogsSpecs",
    "LegacyLogsSpecs",
    "LogsDest",
    "LogsSpecs",
    "RankMappingError",
    "Std",
    "to_map",
    "validate_full_rank",
]

logger = logging.getLogger(__name__)

#: Name of the environment variable through which a worker learns its error file.
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"

# The stream goes to the launcher's console (stdouts/stderrs value in LogsDest).
_CONSOLE = ""

_STD_SYNTAX = (
    "a single value 0-3 (e.g. '3') or comma-separated <local_rank>:<value> pairs "
    "with value 0-3 (e.g. '0:3,1:0'); 0=NONE, 1=OUT, 2=ERR, 3=ALL"
)
# ASCII digits only: str.isdigit()/\d would also take e.g. Arabic-Indic digits.
_VALUE_RE = re.compile(r"[0-3]")
_MAPPING_RE = re.compile(r"[0-9]+:[0-3](?:,[0-9]+:[0-3])*")


class Std(IntFlag):
    """Which standard streams of a worker a setting applies to.

    >>> Std.OUT | Std.ERR
    <Std.ALL: 3>
    >>> bool(Std.ALL & Std.ERR), bool(Std.OUT & Std.ERR)
    (True, False)
    """

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = OUT | ERR

    @classmethod
    def from_str(cls, vm: str) -> Std | dict[int, Std]:
        """Parse a command-line style setting.

        A single digit applies to every local rank; ``rank:value`` pairs apply per
        rank (ranks may have several digits). Surrounding whitespace is ignored.

        >>> Std.from_str("1")
        <Std.OUT: 1>
        >>> Std.from_str("0:3,1:0,10:2")
        {0: <Std.ALL: 3>, 1: <Std.NONE: 0>, 10: <Std.ERR: 2>}
        >>> Std.from_str("4")
        Traceback (most recent call last):
          ...
        ValueError: invalid Std setting '4': expected a single value 0-3 (e.g. '3') or comma-separated <local_rank>:<value> pairs with value 0-3 (e.g. '0:3,1:0'); 0=NONE, 1=OUT, 2=ERR, 3=ALL
        >>> Std.from_str("0:1,0:2")
        Traceback (most recent call last):
          ...
        ValueError: invalid Std setting '0:1,0:2': local rank 0 is given more than once
        """  # noqa: E501 (a doctest: the error message in full)
        if not isinstance(vm, str):
            raise TypeError(
                f"Std.from_str expects a str, got {type(vm).__name__} {vm!r}"
            )
        text = vm.strip()
        if _VALUE_RE.fullmatch(text):
            return cls(int(text))
        if not _MAPPING_RE.fullmatch(text):
            raise ValueError(f"invalid Std setting {vm!r}: expected {_STD_SYNTAX}")
        mapping: dict[int, Std] = {}
        for item in text.split(","):
            rank_s, value_s = item.split(":")
            rank = int(rank_s)
            if rank in mapping:
                raise ValueError(
                    f"invalid Std setting {vm!r}: local rank {rank} is given more "
                    "than once"
                )
            mapping[rank] = cls(int(value_s))
        return mapping


# Union[...], not X | Y (noqa UP007): this is a runtime object, not an
# annotation, and Union keeps it (and its repr) as it was.
#: What ``redirects``/``tee`` accept: one value for all ranks, or a per-rank mapping.
StdSetting = Union[Std, int, Mapping[int, Union[Std, int]]]  # noqa: UP007


def _as_std(value: object, what: str) -> Std:
    """Convert a ``Std`` or an int 0..3 (including torch's ``Std``) to ``Std``."""
    if not is_int(value):
        raise TypeError(
            f"{what} must be a Std or an int 0..3, got {type(value).__name__} "
            f"{value!r}"
        )
    return _std_in_range(value, what)


def _std_in_range(value: int, what: str) -> Std:
    if not 0 <= value <= 3:
        raise ValueError(f"{what} must be a Std or an int 0..3, got {value!r}")
    return Std(int(value))


def _as_std_setting(value: object, what: str) -> Std | dict[int, Std]:
    """Validate a ``redirects``/``tee`` argument; return it as ``Std`` or a new dict."""
    if type(value) is Std and 0 <= value <= 3:
        return value  # the common case, on every DefaultLogsSpecs and reify
    if isinstance(value, Mapping):
        return {
            as_rank(k, what): _as_std(v, f"{what}[{k!r}]") for k, v in value.items()
        }
    if isinstance(value, str):
        raise TypeError(
            f"{what} must be a Std, an int 0..3 or a dict of local rank to Std, got "
            f"str {value!r} (parse strings with Std.from_str)"
        )
    if not is_int(value):
        raise TypeError(
            f"{what} must be a Std, an int 0..3 or a dict of local rank to Std, got "
            f"{type(value).__name__} {value!r}"
        )
    return _as_std(value, what)


def to_map(
    val_or_map: Std | int | Mapping[int, Std | int], local_world_size: int
) -> dict[int, Std]:
    """Expand a ``Std`` setting into an explicit ``{local_rank: Std}`` dict.

    A single value (``Std`` or int 0..3) applies to every rank. In a mapping,
    ranks that are absent get ``Std.NONE`` and ranks ``>= local_world_size`` are
    ignored (as in torch).

    >>> to_map(Std.OUT, 2)
    {0: <Std.OUT: 1>, 1: <Std.OUT: 1>}
    >>> to_map({1: 2, 5: Std.ALL}, 3)
    {0: <Std.NONE: 0>, 1: <Std.ERR: 2>, 2: <Std.NONE: 0>}
    """
    if not is_int(local_world_size):
        raise TypeError(
            "local_world_size must be an int, got "
            f"{type(local_world_size).__name__} {local_world_size!r}"
        )
    if local_world_size < 0:
        raise ValueError(f"local_world_size must be >= 0, got {local_world_size}")
    setting = _as_std_setting(val_or_map, "val_or_map")
    if isinstance(setting, dict):
        return {rank: setting.get(rank, Std.NONE) for rank in range(local_world_size)}
    return dict.fromkeys(range(local_world_size), setting)


@dataclass
class LogsDest:
    """For each kind of log, the destination path per local rank.

    In ``stdouts``/``stderrs`` an empty string means "the launcher's console".
    ``tee_stdouts``/``tee_stderrs`` hold the ranks whose file is also copied to
    the console. ``filtered_stdout``/``filtered_stderr`` receive the teed lines that
    match ``duplicate_stdout_filters``/``duplicate_stderr_filters``.

    >>> LogsDest(stdouts={0: "/tmp/0/stdout.log"}).stderrs
    {}
    """

    stdouts: dict[int, str] = field(default_factory=dict)
    stderrs: dict[int, str] = field(default_factory=dict)
    tee_stdouts: dict[int, str] = field(default_factory=dict)
    tee_stderrs: dict[int, str] = field(default_factory=dict)
    error_files: dict[int, str] = field(default_factory=dict)
    filtered_stdout: str = field(default_factory=str)
    filtered_stderr: str = field(default_factory=str)


class LogsSpecs(ABC):
    """How the streams of each worker are redirected, teed and filtered.

    :param log_dir: base directory for the logs.
    :param redirects: streams written to files; one ``Std`` for all ranks or
        a ``{local_rank: Std}`` mapping.
    :param tee: streams written to files *and* copied to the console (same
        forms).
    :param local_ranks_filter: if non-empty, only these ranks' output reaches
        the console.

    The base class stores its arguments as given, like torch's, so that
    third-party subclasses behave the same with either library. Subclasses
    implement :meth:`reify` and :attr:`root_log_dir`.
    """

    def __init__(
        self,
        log_dir: str | None = None,
        redirects: Std | dict[int, Std] = Std.NONE,
        tee: Std | dict[int, Std] = Std.NONE,
        local_ranks_filter: set[int] | None = None,
    ) -> None:
        self._root_log_dir = log_dir
        self._redirects = redirects
        self._tee = tee
        self._local_ranks_filter = local_ranks_filter

    @abstractmethod
    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """Build the log destinations for ranks ``0..len(envs)-1``.

        May create directories and may update ``envs`` in place (e.g. to set
        ``TORCHELASTIC_ERROR_FILE``).
        """

    @property
    @abstractmethod
    def root_log_dir(self) -> str:
        """The base log directory."""


# tempfile's alphabet for the 8 random characters of a name, as a table that
# maps each random byte to one of them (bytes.translate: no Python loop).
_NAME_CHARS = b"abcdefghijklmnopqrstuvwxyz0123456789_"
_NAME_TABLE = bytes(_NAME_CHARS[b % len(_NAME_CHARS)] for b in range(256))
# tempfile.mkdtemp returns an absolute path from Python 3.12 on.
_MKDTEMP_ABSOLUTE = sys.version_info >= (3, 12)


def _make_unique_dir(base: str, prefix: str) -> str:
    """``tempfile.mkdtemp(prefix=prefix, dir=base)``: a new directory
    ``prefix`` + 8 random characters of tempfile's alphabet, mode 0o700, a
    new name while one exists, the same audit event and the same path
    returned; without mkdtemp's generic handling of its arguments (str or
    bytes, defaults, the temp dir: seven Python calls, as long as the mkdir
    itself, on every launch).  The characters come from os.urandom, so a
    forked launcher never repeats its parent's names."""
    for _ in range(tempfile.TMP_MAX):
        path = os.path.join(base, prefix + os.urandom(8).translate(_NAME_TABLE).decode("ascii"))
        sys.audit("tempfile.mkdtemp", path)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue
        return os.path.abspath(path) if _MKDTEMP_ABSOLUTE else path
    raise FileExistsError(errno.EEXIST, "No usable temporary directory name found")


def _merge_tee(redirects: dict[int, Std], tee: dict[int, Std]) -> dict[int, int]:
    # A teed stream is first written to its file, so tee implies redirect.
    # (As plain ints: Std's operators are Python calls, on every launch.)
    return {rank: int(redirects[rank]) | int(tee[rank]) for rank in redirects}


def _remove_tree(path: str) -> None:
    """Remove an earlier attempt's directory, if any.  Not torch's
    ``shutil.rmtree(ignore_errors=True)``: its catch-all would swallow a
    handled signal's SignalException raised inside it.  What cannot be
    removed makes the ``makedirs`` after this fail, naming the path."""
    try:
        shutil.rmtree(path)
    except OSError as e:
        # An error the signal caused where it landed (rmtree's finally
        # closing a descriptor a second time: EBADF) stands for the signal.
        cause = e.__context__
        while cause is not None and not is_interrupt(cause):
            cause = cause.__context__
        if cause is not None:
            raise cause from None


class DefaultLogsSpecs(LogsSpecs):
    """The torch 2.x layout, one directory per run, attempt and rank.

    ``reify(envs)`` writes under
    ``{log_dir}/{TORCHELASTIC_RUN_ID}_<random>/attempt_{TORCHELASTIC_RESTART_COUNT}/``
    (both variables read from ``envs[0]``, defaulting to ``test_run_id`` and
    ``0``); the run directory is chosen on the first call and reused by later
    attempts; an attempt directory is wiped and re-created. Each rank gets
    ``{rank}/error.json`` and, for redirected streams, ``{rank}/stdout.log`` /
    ``{rank}/stderr.log``. Teeing a stream implies redirecting it.

    ``log_dir``: created here if missing (``NotADirectoryError`` if it exists and
    is not a directory); ``None`` or ``""`` means a fresh temporary directory;
    ``os.devnull`` means "write no log files": every stream stays on the console
    and ``TORCHELASTIC_ERROR_FILE`` is set to ``""`` (as in torch).

    ``local_ranks_filter``: ranks outside a non-empty filter are not teed, and
    their streams that are not redirected go to ``os.devnull``. An empty filter
    means no filtering (as in torch).

    >>> import tempfile, shutil
    >>> root = tempfile.mkdtemp()
    >>> specs = DefaultLogsSpecs(root, redirects=Std.ALL, local_ranks_filter={0})
    >>> dest = specs.reify({0: {}, 1: {}})
    >>> dest.stdouts[1].split(os.sep)[-3:]
    ['attempt_0', '1', 'stdout.log']
    >>> dest.tee_stdouts
    {}
    >>> shutil.rmtree(root)
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str] | None = None,
        redirects: StdSetting = Std.NONE,
        tee: StdSetting = Std.NONE,
        local_ranks_filter: Iterable[int] | None = None,
    ) -> None:
        # Validate everything before touching the file system.
        redirects_ = _as_std_setting(redirects, "redirects")
        tee_ = _as_std_setting(tee, "tee")
        filter_ = as_ranks_filter(local_ranks_filter)
        path = None if log_dir is None else as_log_dir(log_dir)
        if path != os.devnull:
            if not path:
                path = tempfile.mkdtemp(prefix="torchelastic_")
            else:
                # One stat, not exists + isfile + isdir: a launcher that makes
                # specs per launch pays for each.
                try:
                    mode = os.stat(path).st_mode
                except (FileNotFoundError, NotADirectoryError):
                    os.makedirs(path, exist_ok=True)
                else:
                    if stat.S_ISREG(mode):
                        raise NotADirectoryError(f"log_dir: {path} is a file")
                    if not stat.S_ISDIR(mode):
                        raise NotADirectoryError(f"log_dir: {path} is not a directory")
        super().__init__(path, redirects_, tee_, filter_)
        self._run_log_dir: str | None = None
        self._attempt_dir: str | None = None

    @property
    def root_log_dir(self) -> str:
        return str(self._root_log_dir)

    @property
    def attempt_dir(self) -> str | None:
        """The directory of the attempt the last :meth:`reify` laid out
        (``<log_dir>/<run>/attempt_<n>``), None before it or with no files
        (``log_dir`` os.devnull)."""
        return self._attempt_dir

    def _make_run_log_dir(self, run_id: str) -> str:
        base = self._root_log_dir or tempfile.mkdtemp(prefix="torchelastic_")
        try:
            run_dir = _make_unique_dir(base, f"{run_id}_")
        except FileNotFoundError:  # log_dir was removed since __init__
            os.makedirs(base, exist_ok=True)
            run_dir = _make_unique_dir(base, f"{run_id}_")
        if logger.isEnabledFor(logging.INFO):
            logger.info("log directory set to: %s", run_dir)
        return run_dir

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """Create the attempt's directories and return where each stream goes.

        Layout (``<run>`` is ``{run_id}_<random>``)::

            <log_dir>/<run>/attempt_<n>/<rank>/stdout.log   (if redirected or teed)
            <log_dir>/<run>/attempt_<n>/<rank>/stderr.log   (if redirected or teed)
            <log_dir>/<run>/attempt_<n>/<rank>/error.json
            <log_dir>/<run>/attempt_<n>/filtered_stdout.log (path only)
            <log_dir>/<run>/attempt_<n>/filtered_stderr.log (path only)

        Sets ``envs[rank]["TORCHELASTIC_ERROR_FILE"]`` for every rank. ``envs`` must
        be keyed by exactly ``0..len(envs)-1`` (:class:`RankMappingError` otherwise,
        raised before anything is created).
        """
        nprocs = check_envs(envs)
        if nprocs == 0:
            logger.warning("Empty envs map provided when defining logging destinations.")
        first_env: Mapping[str, str] = envs[0] if nprocs else {}
        run_id = first_env.get("TORCHELASTIC_RUN_ID", "test_run_id")
        restart_count = first_env.get("TORCHELASTIC_RESTART_COUNT", "0")

        tee = to_map(self._tee, nprocs)
        redirected_bits = _merge_tee(to_map(self._redirects, nprocs), tee)
        rank_filter = self._local_ranks_filter

        stdouts = dict.fromkeys(range(nprocs), _CONSOLE)
        stderrs = dict.fromkeys(range(nprocs), _CONSOLE)
        tee_stdouts: dict[int, str] = {}
        tee_stderrs: dict[int, str] = {}
        error_files: dict[int, str] = {}

        if self._root_log_dir == os.devnull:
            # No files at all. torch keeps every stream on the console and points
            # the tee tails at os.devnull; we do the same, but still honour the
            # ranks filter and use os.devnull for the filtered-lines files (torch
            # gives "/dev/null/filtered_stdout.log", which cannot be opened).
            for rank in range(nprocs):
                if rank_filter and rank not in rank_filter:
                    stdouts[rank] = os.devnull
                    stderrs[rank] = os.devnull
                else:
                    tee_stdouts[rank] = os.devnull
                    tee_stderrs[rank] = os.devnull
                error_files[rank] = os.devnull
                envs[rank][ERROR_FILE_ENV] = ""
            return LogsDest(
                stdouts, stderrs, tee_stdouts, tee_stderrs, error_files,
                os.devnull, os.devnull,
            )

        fresh = not self._run_log_dir
        if fresh:
            self._run_log_dir = self._make_run_log_dir(run_id)
        assert self._run_log_dir is not None
        # (Joined by hand, here and below, as os.path.join would: the run
        # directory never ends with a separator, and these names never
        # start with one.)
        attempt_dir = self._run_log_dir + os.sep + f"attempt_{restart_count}"
        if fresh:
            os.mkdir(attempt_dir)  # in a directory made just now: nothing to clear
        else:
            _remove_tree(attempt_dir)
            os.makedirs(attempt_dir)
        self._attempt_dir = attempt_dir

        # Plain ints and string concatenation: this loop runs once per rank
        # on every launch, and Std's enum operators cost more than the mkdir.
        out_bit, err_bit = int(Std.OUT), int(Std.ERR)
        log_info = logger.isEnabledFor(logging.INFO)
        prefix = attempt_dir + os.sep
        for rank in range(nprocs):
            rank_dir = prefix + str(rank)
            os.mkdir(rank_dir)
            redirected, teed = redirected_bits[rank], int(tee[rank])
            if redirected & out_bit:
                stdouts[rank] = rank_dir + os.sep + "stdout.log"
            if redirected & err_bit:
                stderrs[rank] = rank_dir + os.sep + "stderr.log"
            if rank_filter and rank not in rank_filter:
                # Keep the files, but nothing of this rank reaches the console.
                if stdouts[rank] == _CONSOLE:
                    stdouts[rank] = os.devnull
                if stderrs[rank] == _CONSOLE:
                    stderrs[rank] = os.devnull
            else:
                if teed & out_bit:
                    tee_stdouts[rank] = stdouts[rank]
                if teed & err_bit:
                    tee_stderrs[rank] = stderrs[rank]
            error_file = rank_dir + os.sep + "error.json"
            error_files[rank] = error_file
            if log_info:
                logger.info("Setting worker%s reply file to: %s", rank, error_file)
            envs[rank][ERROR_FILE_ENV] = error_file

        return LogsDest(
            stdouts,
            stderrs,
            tee_stdouts,
            tee_stderrs,
            error_files,
            attempt_dir + os.sep + "filtered_stdout.log",
            attempt_dir + os.sep + "filtered_stderr.log",
        )

    def __repr__(self) -> str:
        return (
            f"DefaultLogsSpecs(root_log_dir={self._root_log_dir}, "
            f"redirects={self._redirects}, tee={self._tee}, "
            f"local_ranks_filter={self._local_ranks_filter})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DefaultLogsSpecs):
            return NotImplemented
        return (
            self._root_log_dir == other._root_log_dir
            and self._redirects == other._redirects
            and self._tee == other._tee
            and self._local_ranks_filter == other._local_ranks_filter
        )

    # Mutable and compared by value: unhashable, as a dataclass with eq.
    # (typeshed declares __hash__ a method, so None needs the ignore.)
    __hash__ = None  # type: ignore[assignment]


class LegacyLogsSpecs(LogsSpecs):
    """The torch 1.9 layout: ``{log_dir}/{local_rank}/{stdout.log,stderr.log,error.json}``.

    Used by the 1.9 form ``start_processes(name, entrypoint, args, envs, log_dir,
    start_method, redirects, tee)``. ``log_dir`` must be missing (it is created)
    or an empty directory. The constructor only checks its arguments' types and
    touches nothing; :meth:`validate` checks the directory without changing
    anything, so a launcher can fail before starting any process; :meth:`reify`
    validates again, then creates the directories. A ``LegacyLogsSpecs`` is
    therefore good for one launch: afterwards its directory is no longer empty.

    >>> import tempfile, shutil
    >>> root = tempfile.mkdtemp()
    >>> specs = LegacyLogsSpecs(os.path.join(root, "logs"), tee=Std.OUT)
    >>> specs.validate()  # nothing is created
    >>> os.listdir(root)
    []
    >>> dest = specs.reify({0: {}})
    >>> os.path.relpath(dest.tee_stdouts[0], root).split(os.sep)
    ['logs', '0', 'stdout.log']
    >>> specs.validate()  # doctest: +ELLIPSIS
    Traceback (most recent call last):
      ...
    RuntimeError: log_dir ... is not empty (it contains '0'); the 1.9 form of start_processes needs a missing or empty directory
    >>> shutil.rmtree(root)
    """  # noqa: E501 (a doctest: the error message in full)

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        redirects: StdSetting = Std.NONE,
        tee: StdSetting = Std.NONE,
    ) -> None:
        if log_dir is None:
            raise TypeError("log_dir is required (a str path), got None")
        path = as_log_dir(log_dir)
        if not path:
            raise ValueError("log_dir must be a non-empty path, got ''")
        super().__init__(
            path,
            _as_std_setting(redirects, "redirects"),
            _as_std_setting(tee, "tee"),
            None,
        )

    @property
    def root_log_dir(self) -> str:
        return str(self._root_log_dir)

    def validate(self) -> None:
        """Check that ``log_dir`` is missing or an empty directory. No side effects.

        Raises ``NotADirectoryError`` if ``log_dir`` (or the nearest existing
        ancestor of a missing ``log_dir``) is not a directory, and ``RuntimeError``
        if ``log_dir`` is a directory that is not empty.
        """
        path = str(self._root_log_dir)
        if os.path.isdir(path):
            with os.scandir(path) as it:
                names = sorted(entry.name for _, entry in zip(range(4), it, strict=False))
            if names:
                shown = ", ".join(repr(n) for n in names[:3])
                more = ", ..." if len(names) > 3 else ""
                raise RuntimeError(
                    f"log_dir {path!r} is not empty (it contains {shown}{more}); the "
                    "1.9 form of start_processes needs a missing or empty directory"
                )
            return
        if os.path.lexists(path):
            kind = "a file" if os.path.isfile(path) else (
                "a broken symbolic link" if os.path.islink(path) else "not a directory"
            )
            raise NotADirectoryError(f"log_dir {path!r} is {kind}")
        # Missing: it will be created, so its nearest existing ancestor must be
        # a directory (a path such as "some_file/logs" can never be created).
        ancestor = os.path.dirname(os.path.abspath(path))
        while not os.path.lexists(ancestor):
            ancestor = os.path.dirname(ancestor)
        if not os.path.isdir(ancestor):
            raise NotADirectoryError(
                f"log_dir {path!r} cannot be created: {ancestor!r} is not a directory"
            )

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """Validate, create ``log_dir/<rank>`` for every rank and return the paths.

        Sets ``envs[rank]["TORCHELASTIC_ERROR_FILE"]`` to ``{log_dir}/{rank}/error.json``.
        The filtered-lines files (not part of 1.9) are put at
        ``{log_dir}/filtered_stdout.log`` / ``filtered_stderr.log``.
        """
        nprocs = check_envs(envs)
        self.validate()
        log_dir = str(self._root_log_dir)
        os.makedirs(log_dir, exist_ok=True)

        tee = to_map(self._tee, nprocs)
        redirected = _merge_tee(to_map(self._redirects, nprocs), tee)

        dest = LogsDest(
            stdouts=dict.fromkeys(range(nprocs), _CONSOLE),
            stderrs=dict.fromkeys(range(nprocs), _CONSOLE),
            filtered_stdout=os.path.join(log_dir, "filtered_stdout.log"),
            filtered_stderr=os.path.join(log_dir, "filtered_stderr.log"),
        )
        for rank in range(nprocs):
            rank_dir = os.path.join(log_dir, str(rank))
            os.mkdir(rank_dir)
            if redirected[rank] & Std.OUT:
                dest.stdouts[rank] = os.path.join(rank_dir, "stdout.log")
            if redirected[rank] & Std.ERR:
                dest.stderrs[rank] = os.path.join(rank_dir, "stderr.log")
            if tee[rank] & Std.OUT:
                dest.tee_stdouts[rank] = dest.stdouts[rank]
            if tee[rank] & Std.ERR:
                dest.tee_stderrs[rank] = dest.stderrs[rank]
            error_file = os.path.join(rank_dir, "error.json")
            dest.error_files[rank] = error_file
            logger.info("Setting worker%s reply file to: %s", rank, error_file)
            envs[rank][ERROR_FILE_ENV] = error_file
        return dest

    def __repr__(self) -> str:
        return (
            f"LegacyLogsSpecs(log_dir={self._root_log_dir!r}, "
            f"redirects={self._redirects!r}, tee={self._tee!r})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LegacyLogsSpecs):
            return NotImplemented
        return (
            self._root_log_dir == other._root_log_dir
            and self._redirects == other._redirects
            and self._tee == other._tee
        )

    # Mutable and compared by value: unhashable, as a dataclass with eq.
    # (typeshed declares __hash__ a method, so None needs the ignore.)
    __hash__ = None  # type: ignore[assignment]
