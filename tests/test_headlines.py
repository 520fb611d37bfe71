"""The one-line reason a failed rank's stderr gives (torchmp/_tails.py's
traceback parser, ProcessFailure.headline and the report built on it).

A table of stderr tails as Python prints them -- plain, chained, SyntaxError,
KeyboardInterrupt, exception groups (asyncio.TaskGroup, trio, nested, cut
above their header), a line someone else wrote in between, an exception
line longer than the kept tail, binary garbage -- and what each must give;
then real failing ranks: an asyncio.TaskGroup, a child writing into the
traceback, an exception line longer than the tail.
"""
from __future__ import annotations

import re
import sys
import textwrap

import pytest

from helpers import launch, python_worker
from torchmp import Std
from torchmp._tails import exception_headline, python_traceback
from torchmp.errors import ChildFailedError, ProcessFailure, last_words

TO_ENABLE = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"

PLAIN = '''\
loading
Traceback (most recent call last):
  File "train.py", line 9, in <module>
    main()
  File "train.py", line 5, in main
    raise ValueError("boom")
ValueError: boom'''

CHAINED = '''\
Traceback (most recent call last):
  File "<string>", line 4, in f
KeyError: 'k'

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "<string>", line 7, in <module>
  File "<string>", line 6, in f
RuntimeError: lookup failed'''

SYNTAX_MAIN = '''\
  File "/job/train.py", line 1
    x = (
        ^
SyntaxError: '(' was never closed'''

SYNTAX_IMPORTED = '''\
Traceback (most recent call last):
  File "/job/train.py", line 1, in <module>
    import model
  File "/job/model.py", line 3
    def f(:
          ^
SyntaxError: invalid syntax'''

KEYBOARD_INTERRUPT = '''\
Traceback (most recent call last):
  File "train.py", line 1, in <module>
    time.sleep(100)
KeyboardInterrupt'''

RECURSION = '''\
Traceback (most recent call last):
  File "<string>", line 2, in <module>
  File "<string>", line 1, in f
  File "<string>", line 1, in f
  [Previous line repeated 996 more times]
RecursionError: maximum recursion depth exceeded'''

NOTES = '''\
Traceback (most recent call last):
  File "<string>", line 4, in <module>
ValueError: first line
second line
a note: KeyError: not this'''

THREAD = '''\
Exception in thread Thread-1 (f):
Traceback (most recent call last):
  File "/usr/lib/python3.11/threading.py", line 1045, in _bootstrap_inner
    self.run()
  File "<string>", line 4, in f
ValueError: in thread'''

TASKGROUP = '''\
  + Exception Group Traceback (most recent call last):
  |   File "/job/train.py", line 10, in <module>
  |     asyncio.run(main())
  |   File "/usr/lib/python3.11/asyncio/runners.py", line 190, in run
  |     return runner.run(main)
  |            ^^^^^^^^^^^^^^^^
  |   File "/job/train.py", line 7, in main
  |     async with asyncio.TaskGroup() as tg:
  |   File "/usr/lib/python3.11/asyncio/taskgroups.py", line 145, in __aexit__
  |     raise me from None
  | ExceptionGroup: unhandled errors in a TaskGroup (2 sub-exceptions)
  +-+---------------- 1 ----------------
    | Traceback (most recent call last):
    |   File "/job/train.py", line 3, in f
    |     raise ValueError("boom")
    | ValueError: boom
    +---------------- 2 ----------------
    | Traceback (most recent call last):
    |   File "/job/train.py", line 5, in g
    |     raise KeyError("k")
    | KeyError: 'k'
    +------------------------------------'''

TRIO = '''\
  + Exception Group Traceback (most recent call last):
  |   File "/job/t.py", line 7, in <module>
  |     trio.run(main)
  |   File "/venv/lib/python3.11/site-packages/trio/_core/_run.py", line 1117, in __aexit__
  |     raise combined_error_from_nursery
  | ExceptionGroup: Exceptions from Trio nursery (1 sub-exception)
  +-+---------------- 1 ----------------
    | Traceback (most recent call last):
    |   File "/job/t.py", line 3, in f
    |     raise ValueError("trio boom")
    | ValueError: trio boom
    +------------------------------------'''

# A group of a group (whose first exception was raised while handling
# another) and an exception without a traceback; notes on the inner group.
NESTED = '''\
  + Exception Group Traceback (most recent call last):
  |   File "/job/eg.py", line 17, in <module>
  |     raise ExceptionGroup("outer", [e, OSError(2, "nope")])
  | ExceptionGroup: outer (2 sub-exceptions)
  +-+---------------- 1 ----------------
    | Exception Group Traceback (most recent call last):
    |   File "/job/eg.py", line 12, in inner
    |     raise ExceptionGroup("inner", errs)
    | ExceptionGroup: inner (2 sub-exceptions)
    | a note on the inner group
    +-+---------------- 1 ----------------
      | Traceback (most recent call last):
      |   File "/job/eg.py", line 3, in leaf
      |     {}["x"]
      |     ~~^^^^^
      | KeyError: 'x'
      |\x20
      | During handling of the above exception, another exception occurred:
      |\x20
      | Traceback (most recent call last):
      |   File "/job/eg.py", line 5, in leaf
      |     raise ValueError("inner boom")
      | ValueError: inner boom
      +---------------- 2 ----------------
      | TypeError: t
      +------------------------------------
    +---------------- 2 ----------------
    | FileNotFoundError: [Errno 2] nope
    +------------------------------------'''

# Lines someone else wrote into the traceback (a thread, a child process).
FOREIGN_IN_FRAMES = PLAIN.replace('    main()\n', '    main()\nepoch 3: loss=0.25\n')
FOREIGN_BEFORE_EXCEPTION = PLAIN.replace("ValueError: boom", "WARNING: disk almost full\nValueError: boom")
FOREIGN_AFTER_EXCEPTION = PLAIN + "\n[rank1] shutting down"
FOREIGN_IN_GROUP = TASKGROUP.replace("    | ValueError: boom\n", "INFO: step 7\n    | ValueError: boom\n")

# An exception line longer than the kept tail, its start read back from
# the log file (what rank_tail makes of it).
LONG = "ValueError: " + "x" * 388 + " [... 9612 bytes cut]"

BINARY = b"\x00\xff\xfe garbage \x89PNG\r\n\x1a\nmore \xc3\x28 bytes".decode("utf-8", errors="replace")


def last(text: str, n: int) -> str:
    return "\n".join(text.split("\n")[-n:])


HEADLINES = [
    ("plain", PLAIN, "ValueError: boom"),
    ("chained", CHAINED, "RuntimeError: lookup failed"),
    ("syntax-error-main", SYNTAX_MAIN, "SyntaxError: '(' was never closed"),
    ("syntax-error-imported", SYNTAX_IMPORTED, "SyntaxError: invalid syntax"),
    ("keyboard-interrupt", KEYBOARD_INTERRUPT, "KeyboardInterrupt"),
    ("recursion", RECURSION, "RecursionError: maximum recursion depth exceeded"),
    ("message-lines-and-notes", NOTES, "ValueError: first line"),
    ("thread", THREAD, "ValueError: in thread"),
    ("taskgroup", TASKGROUP,
     "ExceptionGroup: unhandled errors in a TaskGroup (2 sub-exceptions), first: ValueError: boom"),
    ("trio", TRIO, "ExceptionGroup: Exceptions from Trio nursery (1 sub-exception), first: ValueError: trio boom"),
    ("nested-group", NESTED, "ExceptionGroup: outer (2 sub-exceptions), first: ValueError: inner boom"),
    ("group-after-plain", CHAINED + "\n\nDuring handling of the above exception, another exception occurred:\n\n"
     + TRIO, "ExceptionGroup: Exceptions from Trio nursery (1 sub-exception), first: ValueError: trio boom"),
    ("plain-after-group", TRIO + "\n\nDuring handling of the above exception, another exception occurred:\n\n"
     + CHAINED, "RuntimeError: lookup failed"),
    # The tail cut above the group's header: what is left names what it can.
    ("group-header-cut", last(TASKGROUP, 13),
     "ExceptionGroup: unhandled errors in a TaskGroup (2 sub-exceptions), first: ValueError: boom"),
    ("group-cut-to-its-first-exception", last(TASKGROUP, 9), "ValueError: boom (in an exception group)"),
    ("foreign-line-in-frames", FOREIGN_IN_FRAMES, "ValueError: boom"),
    ("foreign-line-before-exception", FOREIGN_BEFORE_EXCEPTION, "ValueError: boom"),
    ("foreign-line-after-exception", FOREIGN_AFTER_EXCEPTION, "ValueError: boom"),
    ("foreign-line-in-group", FOREIGN_IN_GROUP,
     "ExceptionGroup: unhandled errors in a TaskGroup (2 sub-exceptions), first: ValueError: boom"),
    ("custom-exception", PLAIN.replace("ValueError: boom", "mylib.errors.Boom: config missing"),
     "mylib.errors.Boom: config missing"),
    ("windows-line-ends", PLAIN.replace("\n", "\r\n"), "ValueError: boom"),
    ("long-exception-line", LONG, None),
    ("no-traceback", "loading\nconfig file missing", None),
    ("header-without-exception", 'Traceback (most recent call last):\n  File "x"', None),
    ("binary-garbage", BINARY, None),
    ("empty", "", None),
]


@pytest.mark.parametrize("text, expected", [case[1:] for case in HEADLINES], ids=[case[0] for case in HEADLINES])
def test_exception_headline(text: str, expected: str | None) -> None:
    assert exception_headline(text) == expected


# What a rank that failed with exit code 1 and no error file reports.
FAILURE_HEADLINES = [
    *[(name, text, expected) for name, text, expected in HEADLINES if expected is not None],
    ("long-exception-line", LONG, LONG),
    ("no-traceback", "loading\nconfig file missing", "config file missing"),
    ("header-without-exception", 'Traceback (most recent call last):\n  File "x"', '  File "x"'),
    ("binary-garbage", BINARY, BINARY.rsplit("\n", 1)[-1]),
]


@pytest.mark.parametrize("tail, expected", [case[1:] for case in FAILURE_HEADLINES],
                         ids=[case[0] for case in FAILURE_HEADLINES])
def test_failure_headline(tail: str, expected: str) -> None:
    failure = ProcessFailure(0, 10, 1, "/nonexistent", stderr_tail=tail)
    assert failure.headline == expected
    assert failure.message == TO_ENABLE  # torch's field, unchanged
    assert TO_ENABLE not in str(ChildFailedError("job", {0: failure}))


@pytest.mark.parametrize("text", [PLAIN, CHAINED, KEYBOARD_INTERRUPT, TASKGROUP, TRIO, NESTED, FOREIGN_IN_FRAMES],
                         ids=["plain", "chained", "keyboard-interrupt", "taskgroup", "trio", "nested", "foreign"])
def test_python_traceback_is_the_last_one_whole(text: str) -> None:
    tb = python_traceback("some output\n" + text + "\n")
    header = "  + Exception Group Traceback" if text.startswith("  +") else "Traceback (most recent call last):"
    assert tb is not None and tb.startswith(header) and text.endswith(tb)
    failure = ProcessFailure(0, 10, 1, "/nonexistent", stderr_tail=text)
    assert last_words(failure) == tb


def test_no_traceback_without_an_exception_line() -> None:
    for text in (SYNTAX_MAIN, "loading", 'Traceback (most recent call last):\n  File "x"', BINARY, last(TASKGROUP, 9)):
        assert python_traceback(text) is None


# ---------------------------------------------------------------------------
# Real failing ranks


def run_rank(tmp_path, code: str, tee: Std = Std.ALL, redirects: Std = Std.NONE) -> ProcessFailure:
    entry, args = python_worker(code)
    ctx = launch(entry, {0: args}, log_dir=tmp_path, tee=tee, redirects=redirects)
    try:
        result = ctx.wait(60)
    finally:
        ctx.close()
    assert result is not None and list(result.failures) == [0]
    return result.failures[0]


def test_taskgroup_rank(tmp_path):
    failure = run_rank(tmp_path, """
        import asyncio
        async def fail():
            raise ValueError("boom")
        async def idle():
            await asyncio.sleep(30)
        async def main():
            async with asyncio.TaskGroup() as tg:
                tg.create_task(idle())
                tg.create_task(fail())
        asyncio.run(main())
    """)
    assert failure.exitcode == 1 and failure.error_file == "<N/A>"
    assert failure.headline == (
        "ExceptionGroup: unhandled errors in a TaskGroup (1 sub-exception), first: ValueError: boom")
    report = str(ChildFailedError("job", {0: failure}))
    assert "  traceback :   + Exception Group Traceback (most recent call last):\n" in report
    assert "      | ValueError: boom\n" in report and TO_ENABLE not in report


def test_child_writing_into_the_traceback(tmp_path):
    # The rank prints its traceback itself, in two pieces, and a child
    # process writes a line to the same stderr in between: foreign bytes
    # in the middle of the traceback, as a helper process would.
    failure = run_rank(tmp_path, """
        import subprocess, sys, traceback
        def hook(kind, value, tb):
            lines = traceback.format_exception(kind, value, tb)
            sys.stderr.write("".join(lines[:-1]))
            sys.stderr.flush()
            subprocess.run(["sh", "-c", "echo 'data loader 3: epoch done' >&2"])
            sys.stderr.write(lines[-1])
            sys.stderr.flush()
        sys.excepthook = hook
        def main():
            raise KeyError("batch_size")
        main()
    """)
    assert failure.stderr_tail.split("\n")[-2:] == ["data loader 3: epoch done", "KeyError: 'batch_size'"]
    assert failure.headline == "KeyError: 'batch_size'"


@pytest.mark.parametrize("redirects, tee", [(Std.NONE, Std.ALL), (Std.ERR, Std.NONE)],
                         ids=["teed", "redirected"])
def test_exception_line_longer_than_the_tail(tmp_path, redirects, tee):
    # 20 lines keep 8000 bytes: a 10012-byte exception line is cut; its
    # start comes back from the log file, with the type.
    failure = run_rank(tmp_path, """
        def main():
            raise ValueError("x" * 10000)
        main()
    """, tee=tee, redirects=redirects)
    assert failure.exitcode == 1
    assert failure.stderr_tail == "ValueError: " + "x" * 388 + " [... 9612 bytes cut]"
    assert failure.headline == failure.stderr_tail
    report = str(ChildFailedError("job", {0: failure}))
    assert TO_ENABLE not in report and "  traceback : ValueError: xxx" in report


def test_cut_line_without_its_start_is_dropped(tmp_path):
    # Past LINE_SEARCH_BYTES of one line the start is not looked for: the
    # cut line is dropped (and the torch hint comes back) rather than shown
    # without its beginning.
    failure = run_rank(tmp_path, """
        import os, sys
        os.write(2, b"ValueError: " + b"x" * (2 << 20) + b"\\n")
        sys.exit(1)
    """)
    assert failure.stderr_tail == "" and failure.headline == TO_ENABLE


def test_torchmp_run_summary_names_the_group(tmp_path):
    import subprocess
    from helpers import launcher_env
    script = tmp_path / "tg.py"
    script.write_text(textwrap.dedent("""\
        import asyncio
        async def fail():
            raise ValueError("boom")
        async def main():
            async with asyncio.TaskGroup() as tg:
                tg.create_task(fail())
        asyncio.run(main())
    """))
    done = subprocess.run([sys.executable, "-m", "torchmp", "run", "-n", "1", "--log-dir", str(tmp_path / "logs"),
                           "--", sys.executable, str(script)], cwd=tmp_path, env=launcher_env(),
                          capture_output=True, text=True, timeout=60, start_new_session=True)
    assert done.returncode == 1, done.stderr
    row = next(line for line in done.stderr.splitlines() if re.match(r"\s*0\s+\d+\s+1\s", line))
    assert row.split("  ")[-1].startswith(
        "root cause: ExceptionGroup: unhandled errors in a TaskGroup (1 sub-exception), first: ValueEr"), row
