"""A failed rank's last words as text: the bytes the I/O thread kept of its
stderr, or the end of its log file when nothing passed through torchmp;
and what a Python traceback in them says (the report's one-line reason).

Reading a traceback back from text is guesswork made careful.  The parser
here knows the three shapes Python prints -- a plain traceback (chained
ones: the last wins), an exception group's boxes (``asyncio.TaskGroup``,
trio's nurseries: the group is named with its first exception), and a
``SyntaxError`` of the main script (no header) -- and it does not trust
every unindented line after the frames: another thread or a child writing
to the same stderr can drop a line in between, so a line that reads like an
exception (``ValueError: ...``, ``pkg.mod.Failure``, ``KeyboardInterrupt``)
wins over one that does not::

    exception_headline('Traceback (most recent call last):\\n'
                       '  File "t.py", line 3, in <module>\\n'
                       'loss=0.25\\n'
                       'ValueError: boom\\n')           # 'ValueError: boom'
"""

from __future__ import annotations

import builtins
import os
import re
import stat

# --- the kept bytes as lines ------------------------------------------------------

#: How far back from the kept bytes the start of a cut line is looked for
#: in the log file: a longer line keeps only its end, which is dropped.
LINE_SEARCH_BYTES = 1 << 20


def _last_lines(data: bytes, lines: int, truncated: bool, first_line: bytes | None = None) -> str:
    """The last ``lines`` lines of data as text.  A first line cut by the
    byte bound (truncated) is replaced by first_line -- the start of that
    line, when it could be read back -- or else dropped."""
    if truncated:
        cut = data.find(b"\n")
        if first_line is not None:
            data = first_line + (data[cut:] if cut >= 0 else b"")
        else:
            data = data[cut + 1:] if cut >= 0 else b""
    text = data.decode("utf-8", errors="replace").replace("\r\n", "\n")
    kept = text.rstrip("\n").split("\n")[-lines:] if lines else []
    return "\n".join(line.rsplit("\r", 1)[-1] for line in kept).strip("\n")


def _open_regular(path: str) -> int | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def file_tail(path: str, nbytes: int) -> tuple[bytes, bool]:
    """The last nbytes of a file, and whether there was more before them."""
    fd = _open_regular(path)
    if fd is None:
        return b"", False
    try:
        size = os.lseek(fd, 0, os.SEEK_END)
        start = max(0, size - nbytes)
        return os.pread(fd, size - start, start), start > 0
    except OSError:
        return b"", False
    finally:
        os.close(fd)


def _cut_line(path: str, kept: bytes, per_line: int) -> bytes | None:
    """The whole first line of ``kept`` (bytes the byte bound cut out of
    the end of a stream) with its start read back from the stream's log
    file, kept to its first ``per_line`` bytes (then marked as cut); None if
    the file does not end with kept or the line starts too far back."""
    fd = _open_regular(path)
    if fd is None:
        return None
    try:
        size = os.fstat(fd).st_size
        if size < len(kept) or os.pread(fd, len(kept), size - len(kept)) != kept:
            return None
        end = size - len(kept)     # where the kept bytes start in the file
        start, pos = None, end
        while start is None and pos > 0 and end - pos < LINE_SEARCH_BYTES:
            n = min(1 << 16, pos)
            chunk = os.pread(fd, n, pos - n)
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                start = pos - n + newline + 1
            pos -= n
        if start is None:
            if pos > 0:
                return None
            start = 0
        nl = kept.find(b"\n")
        rest = kept if nl < 0 else kept[:nl]
        length = end - start + len(rest)
        if length <= per_line:
            return os.pread(fd, end - start, start) + rest
        head = os.pread(fd, min(per_line, end - start), start)
        head += rest[:per_line - len(head)]
        return head + f" [... {length - len(head)} bytes cut]".encode()
    except OSError:
        return None
    finally:
        os.close(fd)


def rank_tail(data: bytes, truncated: bool, path: str, lines: int, per_line: int) -> str:
    """A failed rank's last ``lines`` stderr lines as text, from the kept
    bytes; when the byte bound cut the first of them (a line longer than
    what is kept: an exception with a huge message), its start is read back
    from the log file ``path`` so that the exception's type stays."""
    first = _cut_line(path, data, per_line) if truncated and path else None
    return _last_lines(data, lines, truncated, first)


# --- Python tracebacks in text ----------------------------------------------------

_HEADER = "Traceback (most recent call last):"
_GROUP_HEADER = "Exception Group Traceback (most recent call last):"
_TOP_GROUP_HEADER = "  + " + _GROUP_HEADER
# "ValueError: boom", "pkg.mod.Failure", "KeyboardInterrupt", "ValueError:"
_EXCEPTION_LINE = re.compile(r"([^\W\d]\w*(?:\.[^\W\d]\w*)*)(?::(?: |$)|$)")
_EXCEPTION_SUFFIXES = ("Error", "Exception", "Exit", "Interrupt", "Warning", "Group", "Iteration")
# A separator of an exception group's sub-exceptions, at any depth: "+-+---- 1 ----"
# opens the first, "+---- 2 ----" the next, "+-------" closes them.
_FIRST_SUB = re.compile(r"( *)\+-\+-")
_SEPARATOR = re.compile(r" +\+-")
_BOX_LINE = re.compile(r" +[|+]")


def _reads_like_exception(name: str) -> bool:
    last = name.rsplit(".", 1)[-1]
    if last.endswith(_EXCEPTION_SUFFIXES):
        return True
    obj = getattr(builtins, last, None)
    return isinstance(obj, type) and issubclass(obj, BaseException)


def _pick(candidates: list[str]) -> str | None:
    """The exception line among unindented lines: the first that reads like
    one, else the first shaped like one, else the first."""
    shaped = None
    for line in candidates:
        m = _EXCEPTION_LINE.match(line)
        if m:
            if _reads_like_exception(m.group(1)):
                return line
            shaped = shaped or line
    return shaped or (candidates[0] if candidates else None)


def _plain_exception(lines: list[str], bare: bool = False) -> str | None:
    """The exception line of a plain traceback (lines without box marks):
    after the last header and the last frame.  Without a header, a frame is
    needed (a SyntaxError of the main script) unless bare (a sub-exception
    of a group may be its exception line alone)."""
    start = max((i for i, line in enumerate(lines) if line in (_HEADER, _GROUP_HEADER)), default=-1)
    body = lines[start + 1:]
    last_frame = max((i for i, line in enumerate(body) if line.startswith('  File "')), default=-1)
    if start < 0 and last_frame < 0 and not bare:
        return None
    return _pick([line for line in body[last_frame + 1:] if line and not line[0].isspace()])


def _boxed(lines: list[str]) -> tuple[str | None, str | None]:
    """(its own exception line, its first leaf exception line) of one
    traceback in an exception group's boxes, its box marks at column 2
    ("  | ..." and "  + ...", sub-exceptions two columns further in)."""
    content: list[str] = []
    i = 0
    while i < len(lines) and not lines[i].startswith("  +-+"):
        line = lines[i]
        if line.startswith(("  | ", "  + ")):
            content.append(line[4:])
        elif line in ("  |", "  +"):
            content.append("")
        # else: a line someone else wrote in between, or a deeper box
        i += 1
    own = _plain_exception(content, bare=True)
    if i == len(lines):
        return own, own  # not a group: a leaf
    first: list[str] = []
    for line in lines[i + 1:]:
        if line.startswith("    +-") and not line.startswith("    +-+"):
            break  # the next sibling, or the end of the sub-exceptions
        if line.startswith("    "):
            first.append(line[2:])
    return own, _boxed(first)[1]


def _group_headline(group: str | None, leaf: str | None) -> str | None:
    if group is None:
        return None if leaf is None else f"{leaf} (in an exception group)"
    return group if leaf is None or leaf == group else f"{group}, first: {leaf}"


def _partial_group(lines: list[str]) -> tuple[str | None, str | None]:
    """(the group's line, its first exception) of an exception group whose
    header the tail lost: read as a whole group from the outermost first
    sub-exception that is still there; else (None, the first line in the
    boxes that reads like an exception)."""
    for line in lines:
        m = _FIRST_SUB.match(line)
        if m:
            shift = len(m.group(1)) - 2
            return _boxed([line[shift:] for line in lines if line.startswith(" " * shift)])
    contents = [re.sub(r"^ *[|+] ?", "", line) for line in lines if _BOX_LINE.match(line)]
    return None, _pick([c for c in contents if c and not c[0].isspace() and _EXCEPTION_LINE.match(c)])


def _last_traceback(text: str) -> tuple[list[str], bool] | None:
    """The lines of the last traceback in text, from its header, and
    whether it is an exception group; None if there is no header."""
    lines = text.replace("\r\n", "\n").split("\n")
    for i in range(len(lines) - 1, -1, -1):
        if lines[i] == _HEADER:
            return lines[i:], False
        if lines[i] == _TOP_GROUP_HEADER:
            return lines[i:], True
    return None


def exception_headline(text: str) -> str | None:
    """The one-line reason a Python traceback in ``text`` (a rank's stderr
    tail) gives: the exception line of the last traceback; for an
    exception group, the group's line and its first exception
    (``ExceptionGroup: ... (2 sub-exceptions), first: ValueError: boom``);
    None if text holds no traceback."""
    found = _last_traceback(text)
    if found is not None:
        lines, is_group = found
        if is_group:
            return _group_headline(*_boxed(lines))
        return _plain_exception(lines)
    lines = text.replace("\r\n", "\n").split("\n")
    if any(_SEPARATOR.match(line) for line in lines):
        headline = _group_headline(*_partial_group(lines))
        if headline is not None:
            return headline
    return _plain_exception(lines)


def python_traceback(text: str) -> str | None:
    """The last Python traceback in ``text`` (a rank's stderr tail), from
    its header (an exception group's boxes included) to the end, or None if
    there is none with an exception line."""
    found = _last_traceback(text)
    if found is None:
        return None
    lines, is_group = found
    line = _group_headline(*_boxed(lines)) if is_group else _plain_exception(lines)
    return None if line is None else "\n".join(lines).rstrip()
