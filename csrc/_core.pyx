# cython: language_level=3, boundscheck=False, wraparound=False
# cython: binding=False, embedsignature.format=clinic
# (binding=False: the functions and methods are the C API's builtins, made by
# the type and module set-up, not one Cython function object and code object
# each when the module is imported: a fresh interpreter's import of the core
# takes about 0.1 ms less.  The clinic format gives them the
# __text_signature__ that inspect.signature reads.)
"""torchmp._core: the compiled half of torchmp.

Thin wrappers over the C core in csrc/*.c: argument conversion, memory
ownership and errno -> OSError.  Policy (what to spawn, when to kill, how to
report) lives in torchmp/api.py.
"""
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE, PyBytes_FromStringAndSize
from cpython.exc cimport PyErr_CheckSignals
from libc.errno cimport errno, EINTR, ECHILD
from libc.stdint cimport int64_t, uint64_t
from cpython.buffer cimport PyBuffer_FillInfo, PyBuffer_Release, PyObject_GetBuffer, PyBUF_SIMPLE
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memchr, memcpy, memset, strerror, strlen
from posix.stat cimport stat as c_stat, struct_stat as stat_t, S_ISDIR
from posix.resource cimport getrlimit, rlimit, RLIMIT_NOFILE, RLIM_INFINITY
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC
from posix.unistd cimport getpid, fork, close as c_close, _exit, read as c_read, write as c_write, access, X_OK

from ctorchmp cimport *

cdef extern from "Python.h":
    bytes PyUnicode_EncodeFSDefault(object text)  # os.fsencode of a str, in C

import os as _os

cdef inline pid_t self_pid() noexcept nogil:
    # (csrc/loop_thread.c: no system call per check that this process owns
    # a group, about twenty a launch)
    return torchmp_self_pid()


cdef extern from "Python.h":
    void PyOS_BeforeFork()
    void PyOS_AfterFork_Parent()
    void PyOS_AfterFork_Child()

cdef extern from "<signal.h>" nogil:
    enum:
        SIGKILL
    ctypedef void (*sighandler_t)(int)
    sighandler_t SIG_DFL
    sighandler_t c_signal "signal"(int signum, sighandler_t handler)
    ctypedef struct sigset_t:
        pass
    int sigemptyset(sigset_t *s)
    int sigaddset(sigset_t *s, int signum)
    enum:
        SIG_BLOCK
        SIG_SETMASK

cdef extern from "<pthread.h>" nogil:
    int pthread_sigmask(int how, const sigset_t *s, sigset_t *old)

cdef extern from *:
    """
    #ifndef TORCHMP_VERSION
    #error "TORCHMP_VERSION must be defined by setup.py"
    #endif
    #ifdef TORCHMP_PORTABLE
    #define TORCHMP_PORTABLE_BUILD 1
    #else
    #define TORCHMP_PORTABLE_BUILD 0
    #endif
    #ifdef TORCHMP_HAVE_BINDING
    #define TORCHMP_BINDING_BUILD 1
    #else
    #define TORCHMP_BINDING_BUILD 0
    #endif
    #ifdef TORCHMP_HAVE_INOTIFY
    #define TORCHMP_FOLLOW_BUILD 1
    #else
    #define TORCHMP_FOLLOW_BUILD 0
    #endif
    #ifdef TORCHMP_KEEPER_WITHOUT_LIBC
    #define TORCHMP_KEEPER_WITHOUT_LIBC_BUILD 1
    #else
    #define TORCHMP_KEEPER_WITHOUT_LIBC_BUILD 0
    #endif
    """
    const char *TORCHMP_VERSION
    int TORCHMP_PORTABLE_BUILD
    int TORCHMP_BINDING_BUILD
    int TORCHMP_FOLLOW_BUILD
    int TORCHMP_KEEPER_WITHOUT_LIBC_BUILD

__version__ = TORCHMP_VERSION.decode()
# Whether collect_exit() reads a zombie's rusage without reaping it (Linux's
# waitid system call); elsewhere rusage comes only with the reap.
COLLECT_HAS_RUSAGE = not TORCHMP_PORTABLE_BUILD
PORTABLE_BUILD = bool(TORCHMP_PORTABLE_BUILD)
# Whether torchmp/_keeper was meant to be built without a C library
# (setup.py: x86-64 Linux, not under the sanitizers or gcov).
KEEPER_WITHOUT_LIBC = bool(TORCHMP_KEEPER_WITHOUT_LIBC_BUILD)
# Whether a worker can be bound to CPUs / memory nodes (Binding).
HAVE_BINDING = bool(TORCHMP_BINDING_BUILD)
# Whether a teed stream's log can be followed (StreamSpec.follow_log: one
# inotify fd for all, none per stream) rather than piped.
HAVE_FOLLOW = bool(TORCHMP_FOLLOW_BUILD)

# Plain ints, not IntEnum classes: making an enum class costs a fresh
# interpreter's import about 0.1 ms, which an agent starting a new
# interpreter per command pays each time (docs/profiles.md).
# How a stream of a rank is wired (StreamSpec.mode):
STREAM_INHERIT = TORCHMP_STREAM_INHERIT  # the launcher's own fd
STREAM_FILE = TORCHMP_STREAM_FILE        # a log file, nothing in between
STREAM_TEE = TORCHMP_STREAM_TEE          # a pipe the I/O thread copies to the log and a console
STREAM_RETURN = TORCHMP_STREAM_RETURN    # the return channel of a function worker
FD_RETURN = TORCHMP_FD_RETURN  # the worker's fd of its return channel
FD_PAYLOAD = TORCHMP_FD_PAYLOAD

# Where a rank is (ProcInfo.state):
PROC_UNSTARTED = TORCHMP_PROC_UNSTARTED
PROC_RUNNING = TORCHMP_PROC_RUNNING
PROC_EXITED = TORCHMP_PROC_EXITED

# Group.wait()'s answers after a wake-up (0: the timeout passed).
WAIT_CHANGED = 1
WAIT_DECIDED = 2

STEP_EXEC = TORCHMP_STEP_EXEC
STEP_AFFINITY = TORCHMP_STEP_AFFINITY
STEP_MEMPOLICY = TORCHMP_STEP_MEMPOLICY
# Setup steps are 1 .. STEP_COUNT - 1 (0: none): a loop over them sees a new one.
STEP_COUNT = TORCHMP_STEP__COUNT

# The exit trailer a forkserver appends to a worker's return channel (C's
# torchmp_exit_trailer; torchmp/_forkserver.py writes it): its magic and
# size here, its fields' offsets from exit_trailer_fields().
EXIT_TRAILER_MAGIC = TORCHMP_EXIT_TRAILER_MAGIC.decode("ascii")
EXIT_TRAILER_SIZE = sizeof(torchmp_exit_trailer)


def exit_trailer_fields():
    """((name, offset, size), ...) of the exit trailer's fields, in
    order, as the C compiler laid them out."""
    cdef torchmp_exit_trailer t
    cdef char *base = <char *>&t
    return (
        ("magic", <char *>&t.magic - base, sizeof(t.magic)),
        ("wait_status", <char *>&t.wait_status - base, sizeof(t.wait_status)),
        ("utime_ns", <char *>&t.utime_ns - base, sizeof(t.utime_ns)),
        ("stime_ns", <char *>&t.stime_ns - base, sizeof(t.stime_ns)),
        ("maxrss_kb", <char *>&t.maxrss_kb - base, sizeof(t.maxrss_kb)),
    )


cdef extern from "<stdio.h>" nogil:
    ctypedef struct FILE
    FILE *stdout
    FILE *stderr
    int fflush(FILE *stream)

cdef extern from "<unistd.h>" nogil:
    int dup2(int oldfd, int newfd)

cdef extern from "<fcntl.h>" nogil:
    int fcntl(int fd, int cmd, ...)
    int F_DUPFD_CLOEXEC


def redirect_fd(int std_fd, int target_fd):
    """Point std_fd (1 or 2) at target_fd after flushing C stdio; returns a
    CLOEXEC duplicate of the old std_fd for restore_fd."""
    cdef int saved
    if std_fd != 1 and std_fd != 2:
        raise ValueError(f"std_fd must be 1 or 2, got {std_fd}")
    fflush(stdout if std_fd == 1 else stderr)
    saved = fcntl(std_fd, F_DUPFD_CLOEXEC, 3)
    check(saved, b"dup of the standard stream")
    if dup2(target_fd, std_fd) < 0:
        err = errno
        c_close(saved)
        raise OSError(err, f"dup2 onto fd {std_fd}: {strerror(err).decode()}")
    return saved


def restore_fd(int std_fd, int saved_fd):
    """Undo redirect_fd: flush C stdio, put saved_fd back on std_fd, close it."""
    cdef int rc, err
    fflush(stdout if std_fd == 1 else stderr)
    rc = dup2(saved_fd, std_fd)
    err = errno
    c_close(saved_fd)
    if rc < 0:
        raise OSError(err, f"restoring fd {std_fd}: {strerror(err).decode()}")


def child_setup(int stdout_fd, int stderr_fd, bint pdeathsig, int parent_pid, binding=None):
    """In a freshly forked Python worker: new session, parent-death signal
    (with the parent-died race checked), binding (a Binding, or None),
    stdout/stderr onto the given fds.  Closes nothing else: the interpreter
    may own other fds."""
    cdef torchmp_spawn_args a
    cdef int step, j
    cdef list keep = []
    memset(&a, 0, sizeof(a))
    binding_fill(&a.binding, binding, keep)
    for j in range(TORCHMP_CHILD_FDS):
        a.child_fds[j] = -1
    a.child_fds[1] = stdout_fd
    a.child_fds[2] = stderr_fd
    a.pdeathsig = SIGKILL if pdeathsig else 0
    a.parent_pid = parent_pid
    step = torchmp_child_setup(&a, -1, 0)
    if step != 0:
        raise exec_error(step, errno, None)


cdef int check(int rc, const char *what) except -1:
    """One errno checker for every call site (pyzmq checkrc style): reads
    errno first, before anything else can change it."""
    cdef int err
    if rc < 0:
        err = errno
        raise OSError(err, f"{what.decode()}: {strerror(err).decode()}")
    return rc


def step_name(int step):
    """Name of a spawn step, as used in spawn error messages."""
    return torchmp_step_name(step).decode()


def exec_error(int step, int errnum, path):
    """Turn a {step, errno} spawn error record from a worker into the right
    exception.

    An exec failure becomes OSError(errno, strerror, path), which selects
    FileNotFoundError, PermissionError, ... like subprocess does.  Failures
    in the other setup steps name the step instead of the path.
    """
    if errnum <= 0:
        return OSError(f"worker setup failed during {step_name(step)} (no errno reported)")
    msg = strerror(errnum).decode()
    if step == TORCHMP_STEP_EXEC:
        return OSError(errnum, msg, path)
    return OSError(errnum, f"{msg} (worker setup step: {step_name(step)})")


def backend():
    """'epoll' or 'poll': the readiness backend of this process's I/O thread."""
    cdef int b = torchmp_loop_backend()
    check(b, b"starting the torchmp I/O thread")
    return "epoll" if b == TORCHMP_BACKEND_EPOLL else "poll"


def collect_exit(pid_t pid):
    """If child pid has exited: its ExitRecord, leaving the zombie in place
    (waitid WNOWAIT); None if it runs."""
    cdef int status = 0
    cdef int64_t ut = 0, st = 0, rss = 0
    cdef int r = torchmp_collect_exit(pid, &status, &ut, &st, &rss)
    check(r, b"waitid")
    return ExitRecord(status, ut, st, rss) if r else None


def keeper_pid():
    """The pid of this process's keeper (0 if none yet): the process that
    SIGKILLs every worker process group still open when this process dies.
    Waits for the keeper's start to finish if it has not yet."""
    with nogil:
        torchmp_keeper_settle(1)
    return torchmp_keeper_pid()


def _set_keeper_helper():
    # The program the keeper is exec'd from: torchmp/_keeper next to this
    # module, or TORCHMP_KEEPER_HELPER ("": none, the launcher forks its
    # keeper; a program that cannot be run has the same effect).
    path = _os.environ.get("TORCHMP_KEEPER_HELPER")
    if path is None:
        path = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "_keeper")
    check(torchmp_keeper_set_helper(_os.fsencode(path)), b"keeper helper")


_set_keeper_helper()


def _forget_keeper_after_fork():
    # A forked child must not hold its parent's keeper pipe open: the keeper
    # would miss the parent's death for as long as the child lives.
    torchmp_keeper_forget()
    # Nor its kept /proc/self/cgroup, which is the parent's.
    torchmp_forget_kept_files_after_fork()


_os.register_at_fork(after_in_child=_forget_keeper_after_fork)


def open_fd_count():
    """How many fds this process has open (OSError where /proc cannot say)."""
    return check(torchmp_open_fd_count(), b"counting /proc/self/fd")


def fd_room(int n):
    """True if ``n`` more fds surely fit under the soft RLIMIT_NOFILE without
    counting the open ones: it is unlimited, or the ``n`` numbers just below
    it are free (one poll; csrc/procscan.c).  False: count them."""
    return check(torchmp_fd_room(n), b"poll of the highest fd numbers") == 1


def read_kept(int slot, path not None):
    """The whole of a small kernel file, through a descriptor kept open in
    ``slot`` (0 or 1) from one call to the next (csrc/cgroupfs.c); None if
    it has more than 4 KiB (read it the plain way).  OSError as open() and
    read() raise it, naming ``path``."""
    # (os.fsencode's own encoding, without its Python-level call: two reads
    # of every launch come here.)
    cdef bytes p = PyUnicode_EncodeFSDefault(path) if type(path) is str else _os.fsencode(path)
    cdef char buf[4096]
    cdef Py_ssize_t n = torchmp_read_kept(slot, p, buf, sizeof(buf))
    cdef int err
    if n < 0:
        err = errno
        raise OSError(err, strerror(err).decode(), path)
    if <size_t>n == sizeof(buf):
        return None
    return PyBytes_FromStringAndSize(buf, n)


def drop_kept_files():
    """Close the descriptors :func:`read_kept` keeps; how many it closed."""
    return torchmp_drop_kept_files()


def cgroup_root_version(path not None):
    """1 or 2 if ``path`` is the root directory of a whole cgroup v1 or v2
    hierarchy (not a mounted subtree of one), else 0 (csrc/cgroupfs.c)."""
    cdef bytes p = _os.fsencode(path)
    return torchmp_cgroup_root_version(p)


def nofile_limits():
    """RLIMIT_NOFILE as (soft, hard), -1 for no limit (RLIM_INFINITY).  Every
    launch asks; reading it here spares a program's first launch importing
    resource (a search of sys.path and a dlopen)."""
    cdef rlimit lim
    check(getrlimit(RLIMIT_NOFILE, &lim), b"getrlimit(RLIMIT_NOFILE)")
    return (-1 if lim.rlim_cur == RLIM_INFINITY else <long long>lim.rlim_cur,
            -1 if lim.rlim_max == RLIM_INFINITY else <long long>lim.rlim_max)


include "signal_wake.pxi"
include "specs.pxi"
include "group.pxi"
include "fork.pxi"
include "process.pxi"


DEFAULT_CONSOLE_BACKLOG = TORCHMP_DEFAULT_CONSOLE_BACKLOG


# The core's records: tuples with named fields, as collections.namedtuple
# makes them (the same _fields, _make, _replace, _asdict, repr, pickling and
# keyword construction), written out as classes.  namedtuple compiles each
# class's __new__ from source when it is made: nine of them cost a fresh
# interpreter 0.8 ms of `import torchmp`, these 0.1 ms (docs/profiles.md).
from _collections import _tuplegetter as _field  # namedtuple's own field accessor


class _Record(tuple):
    __slots__ = ()
    _fields = ()
    _field_defaults = {}

    @classmethod
    def _make(cls, iterable):
        result = tuple.__new__(cls, iterable)
        if len(result) != len(cls._fields):
            raise TypeError(f"Expected {len(cls._fields)} arguments, got {len(result)}")
        return result

    def _replace(self, **changes):
        result = self._make([changes.pop(name, value) for name, value in zip(self._fields, self)])
        if changes:
            raise ValueError(f"Got unexpected field names: {list(changes)!r}")
        return result

    __replace__ = _replace  # copy.replace (Python 3.13)

    def _asdict(self):
        return dict(zip(self._fields, self))

    def __repr__(self):
        return type(self).__name__ + "(" + ", ".join(
            [f"{name}={value!r}" for name, value in zip(self._fields, self)]) + ")"

    def __getnewargs__(self):
        return tuple(self)


# What Group.snapshot() says of one rank: it reads by name (info.pid) and
# still unpacks and indexes like the tuple it was.  Built with tuple.__new__
# (no Python-level __new__ per rank).
class ProcInfo(_Record):
    __slots__ = ()
    _fields = __match_args__ = (
        "state", "pid", "wait_status", "start_mono_ns", "exit_mono_ns", "exit_real_ns",
        "utime_ns", "stime_ns", "maxrss_kb", "out_log_errno", "err_log_errno", "status_lost")
    state = _field(0, "PROC_UNSTARTED, PROC_RUNNING or PROC_EXITED")
    pid = _field(1, "the worker's pid (0 before it started)")
    wait_status = _field(2, "the raw wait status once exited")
    start_mono_ns = _field(3, "CLOCK_MONOTONIC at start")
    exit_mono_ns = _field(4, "CLOCK_MONOTONIC when the exit was recorded")
    exit_real_ns = _field(5, "CLOCK_REALTIME when the exit was recorded")
    utime_ns = _field(6, "user CPU time")
    stime_ns = _field(7, "system CPU time")
    maxrss_kb = _field(8, "peak resident set, KiB")
    out_log_errno = _field(9, "first error writing the stdout log, 0 if none")
    err_log_errno = _field(10, "first error writing the stderr log, 0 if none")
    status_lost = _field(11, "another process reaped it, or its forkserver died")

    def __new__(cls, state, pid, wait_status, start_mono_ns, exit_mono_ns, exit_real_ns,
                utime_ns, stime_ns, maxrss_kb, out_log_errno, err_log_errno, status_lost):
        return tuple.__new__(cls, (state, pid, wait_status, start_mono_ns, exit_mono_ns, exit_real_ns,
                                   utime_ns, stime_ns, maxrss_kb, out_log_errno, err_log_errno, status_lost))


# The small records the core's calls return, named for the same reason.
class ExitRecord(_Record):  # collect_exit
    __slots__ = ()
    _fields = __match_args__ = ("wait_status", "utime_ns", "stime_ns", "maxrss_kb")
    wait_status = _field(0, "the raw wait status")
    utime_ns = _field(1, "user CPU time")
    stime_ns = _field(2, "system CPU time")
    maxrss_kb = _field(3, "peak resident set, KiB")

    def __new__(cls, wait_status, utime_ns, stime_ns, maxrss_kb):
        return tuple.__new__(cls, (wait_status, utime_ns, stime_ns, maxrss_kb))


class StreamState(_Record):  # Group.stream_state, per rank
    __slots__ = ()
    _fields = __match_args__ = ("stdout_open", "stderr_open", "stdout_last_ns", "stderr_last_ns")
    stdout_open = _field(0, "whether the teed stdout pipe is still drained")
    stderr_open = _field(1, "whether the teed stderr pipe is still drained")
    stdout_last_ns = _field(2, "CLOCK_MONOTONIC of stdout's last bytes (0: none yet)")
    stderr_last_ns = _field(3, "CLOCK_MONOTONIC of stderr's last bytes (0: none yet)")

    def __new__(cls, stdout_open, stderr_open, stdout_last_ns, stderr_last_ns):
        return tuple.__new__(cls, (stdout_open, stderr_open, stdout_last_ns, stderr_last_ns))


class WorkerFds(_Record):  # Group.prepare, per rank; -1: none
    __slots__ = ()
    _fields = __match_args__ = ("stdout", "stderr", "return_channel")
    stdout = _field(0, "the worker's stdout fd, -1: none")
    stderr = _field(1, "the worker's stderr fd, -1: none")
    return_channel = _field(2, "the worker's return channel fd, -1: none")

    def __new__(cls, stdout, stderr, return_channel):
        return tuple.__new__(cls, (stdout, stderr, return_channel))


class Forked(_Record):  # Group.fork_rank
    __slots__ = ()
    _fields = __match_args__ = ("pid", "return_fd")
    pid = _field(0, "the worker's pid in the parent, 0 in the worker")
    return_fd = _field(1, "the worker's return channel in the worker, -1 in the parent")

    def __new__(cls, pid, return_fd):
        return tuple.__new__(cls, (pid, return_fd))


# What Group.spawn and Group.prepare take: how one stream of a rank is wired
# (stdout, stderr or the return channel), and one rank to exec.  Plain
# tuples of the same fields are accepted too.
class StreamSpec(_Record):
    __slots__ = ()
    _fields = __match_args__ = ("mode", "fd", "console", "prefix", "timestamps", "log_path", "backlog",
                                "tail", "open_log", "follow_log")
    _field_defaults = {"timestamps": False, "log_path": None, "backlog": DEFAULT_CONSOLE_BACKLOG,
                       "tail": 0, "open_log": False, "follow_log": False}
    mode = _field(0, "STREAM_INHERIT, STREAM_FILE, STREAM_TEE or STREAM_RETURN (the return channel)")
    fd = _field(1, "FILE: the file; TEE: the log file or -1")
    console = _field(2, "TEE: the launcher's fd 1 or 2, -1 for none, or a QueueConsole")
    prefix = _field(3, "TEE: the console prefix (bytes), or None")
    timestamps = _field(4, "TEE: a UTC time on every console line")
    log_path = _field(5, "TEE: the log file's path for the console's marker line (bytes), or None")
    backlog = _field(6, "TEE: the console backlog bound for this stream, bytes")
    tail = _field(7, "TEE: keep this many of the last bytes for Group.tail (0: none)")
    # FILE, TEE: the core opens log_path (created and checked by the caller)
    # only when the rank starts, and a FILE one is closed once the worker has
    # it: a launch holds no fd for the logs of ranks it has not reached.
    open_log = _field(8, "FILE, TEE: the core opens log_path when the rank starts")
    # TEE with open_log: the worker writes its log itself and the I/O thread
    # follows the file to the console (no fd per stream while the rank runs);
    # piped where it cannot be followed (see HAVE_FOLLOW).
    follow_log = _field(9, "TEE with open_log: the I/O thread follows the worker's log file")

    def __new__(cls, mode, fd, console, prefix, timestamps=False, log_path=None,
                backlog=DEFAULT_CONSOLE_BACKLOG, tail=0, open_log=False, follow_log=False):
        return tuple.__new__(cls, (mode, fd, console, prefix, timestamps, log_path, backlog, tail,
                                   open_log, follow_log))


class RankSpec(_Record):
    __slots__ = ()
    _fields = __match_args__ = ("path", "argv", "envp", "out", "err", "return_channel", "payload_fd",
                                "binding")
    _field_defaults = {"binding": None}
    path = _field(0, "the executable (bytes; PATH lookup done by the caller)")
    argv = _field(1, "[bytes]")
    envp = _field(2, "[b'K=V']")
    out = _field(3, "StreamSpec of stdout")
    err = _field(4, "StreamSpec of stderr")
    return_channel = _field(5, "StreamSpec of the return channel (STREAM_RETURN, or STREAM_INHERIT: none)")
    payload_fd = _field(6, "becomes the worker's fd FD_PAYLOAD, or -1")
    binding = _field(7, "a Binding, or None: the worker runs where the launcher may")

    def __new__(cls, path, argv, envp, out, err, return_channel, payload_fd, binding=None):
        return tuple.__new__(cls, (path, argv, envp, out, err, return_channel, payload_fd, binding))


# Where a worker runs, applied in the child before exec (or before a forked
# worker's function runs): sched_setaffinity to cpus, and set_mempolicy
# (MPOL_BIND) to the nodes in mems.  An empty field leaves that setting as
# the launcher's.
class Binding(_Record):
    __slots__ = ()
    _fields = __match_args__ = ("cpus", "mems")
    cpus = _field(0, "CPU ids (sorted tuple)")
    mems = _field(1, "NUMA node ids (sorted tuple); () for no memory policy")

    def __new__(cls, cpus, mems):
        return tuple.__new__(cls, (cpus, mems))


include "command.pxi"


cdef class QueueConsole:
    """A console whose framed lines are taken by Python (for a sys.stdout /
    sys.stderr object that is not the process's own fd 1 / 2).  The I/O
    thread only appends to it: it never needs the GIL.  It holds no fd: its
    taker sleeps in queues_wait() until some queue console has bytes.
    take() returns what waits (marker lines included)."""
    cdef torchmp_console *c

    def __cinit__(self):
        self.c = torchmp_console_new_queue()
        if self.c == NULL:
            check(-1, b"console")

    def __dealloc__(self):
        if self.c != NULL:
            torchmp_console_unref(self.c)
            self.c = NULL

    def take(self):
        """What waits, as a CaptureBuffer (the native memory, no copy), or
        b"" if nothing does."""
        cdef size_t n = 0
        cdef char *data
        cdef CaptureBuffer buf
        with nogil:
            data = torchmp_console_take(self.c, &n)
        if data == NULL:
            return b""
        buf = CaptureBuffer.__new__(CaptureBuffer)
        buf.data = data
        buf.size = <Py_ssize_t>n
        return buf

    def pending(self) -> int:
        """Bytes waiting, held-back ones included (0: caught up)."""
        return torchmp_console_pending(self.c)

    def say(self, bytes data not None) -> bool:
        """torchmp's own whole lines, after the workers' lines logged before
        them; False if left out (the bound)."""
        return _say(self.c, -1, data)


cdef object _say(torchmp_console *queue, int fd, bytes data):
    cdef int rc
    cdef const char *buf = PyBytes_AS_STRING(data)
    cdef size_t n = <size_t>PyBytes_GET_SIZE(data)
    if n == 0:
        return True
    with nogil:
        rc = torchmp_say(queue, fd, buf, n)
    check(rc, b"console")
    return rc > 0


cdef extern from "<string.h>" nogil:
    void *memrchr(const void *s, int c, size_t n)


def line_cuts(data, Py_ssize_t piece):
    """Where to cut data (whole lines; bytes or a CaptureBuffer) into pieces
    of at most ``piece`` bytes: the end offset of each piece (a line longer
    than that is a piece of its own; the last offset is len(data))."""
    # The buffer protocol itself, not a typed memoryview: one memoryview
    # argument makes Cython build its whole memoryview support (four types)
    # at every import of the module.
    cdef Py_buffer view
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        return _line_cuts(<const unsigned char *>view.buf, view.len, piece)
    finally:
        PyBuffer_Release(&view)


cdef list _line_cuts(const unsigned char *base, Py_ssize_t n, Py_ssize_t piece):
    cdef Py_ssize_t start = 0, end
    cdef const unsigned char *nl
    cdef list cuts = []
    if piece < 1:
        piece = 1
    while start < n:
        end = start + piece
        if end >= n:
            end = n
        else:
            nl = <const unsigned char *>memrchr(base + start, 10, <size_t>(end - start))
            if nl != NULL:
                end = nl - base + 1
            else:  # one line longer than a piece: to its end
                nl = <const unsigned char *>memchr(base + end, 10, <size_t>(n - end))
                end = nl - base + 1 if nl != NULL else n
        cuts.append(end)
        start = end
    return cuts


def console_say(int fd, bytes data not None) -> bool:
    """torchmp's own whole lines to the console of what the launcher's fd (1
    or 2) refers to: never blocking, after the workers' lines logged before
    them.  False if left out (the bound)."""
    return _say(NULL, fd, data)


def loop_exists() -> bool:
    """Whether this process has its I/O thread (its consoles) already."""
    return bool(torchmp_loop_exists())


def groups_alive() -> int:
    """How many native groups this process holds: a context's, until the
    I/O thread frees it some time after close() released it."""
    return torchmp_groups_alive()


def consoles_pending(int fd=-1) -> int:
    """Bytes waiting for the launcher's fd 1 / fd 2 consoles, held-back ones
    included (0: caught up); fd >= 0: only for the console of what fd
    refers to."""
    # (The GIL stays held: the count takes the loop's mutex only, which no
    # thread holds while it waits for the GIL; this is on the path from the
    # last exit to wait()'s return.)
    return torchmp_consoles_pending(fd)


def consoles_shown(int fd=-1) -> int:
    """Bytes the launcher's fd 1 / fd 2 consoles took so far (their
    progress); fd >= 0: only the console of what fd refers to."""
    cdef uint64_t n
    with nogil:
        n = torchmp_consoles_shown(fd)
    return n


def set_console_stall(double seconds):
    """A console that takes nothing for this long while lines wait for it is
    stalled: the lines it was not given yet are left out once it takes bytes
    again (<= 0: never)."""
    torchmp_consoles_set_stall(<int64_t>(seconds * 1e9) if seconds > 0 else 0)


def console_gone(int err) -> bool:
    """Whether a write error (an errno) means the console's reader went
    away: it is dropped, not a failure."""
    return torchmp_console_gone(err) != 0


def console_failure(int std_fd) -> int:
    """The errno that switched the console of the launcher's fd (1 or 2)
    off since the last call, unless its reader went away; 0 if none."""
    return torchmp_console_failure(std_fd)


def queues_generation() -> int:
    """A counter that moves whenever a queue console gets bytes for its
    taker (or queues_post() is called)."""
    return torchmp_queues_generation()


def queues_wait(uint64_t seen, double timeout=-1.0) -> bool:
    """Sleep (GIL released) until queues_generation() is no longer seen, or
    timeout seconds (negative: none); True if it moved."""
    cdef int64_t ns = <int64_t>(timeout * 1e9) if timeout >= 0 else -1
    cdef int moved
    with nogil:
        moved = torchmp_queues_wait(seen, ns)
    return bool(moved)


def queues_post():
    """Wake the takers sleeping in queues_wait()."""
    torchmp_queues_post()


def _queues_after_fork():
    torchmp_queues_after_fork()


_os.register_at_fork(after_in_child=_queues_after_fork)


def frame(int fd, bytes prefix not None, list chunks, Py_ssize_t max_line=256 * 1024, Py_ssize_t scratch=4096,
          bint timestamps=False, Py_ssize_t backlog=DEFAULT_CONSOLE_BACKLOG, bytes log_path=None):
    """Run the console line framer over chunks, showing the lines on fd.

    For tests: the framer and console the I/O thread use, fed by hand.
    chunks holds bytes (fed at the current time) and numbers (seconds: the
    test's clock moves on by that much and the time rules run); scratch is
    the size of the line-assembly buffer (0 for none).  Returns the bytes
    still waiting in the console's backlog (fd did not take them).
    """
    cdef torchmp_framer f
    cdef torchmp_line_sinks sinks
    cdef torchmp_console_source source
    cdef torchmp_console *console
    cdef int filtered = -1
    cdef int filtered_errno = 0
    cdef int64_t now = 1000000000
    cdef int broken
    memset(&sinks, 0, sizeof(sinks))
    memset(&source, 0, sizeof(source))
    for chunk in chunks:
        if not isinstance(chunk, (bytes, int, float)):
            raise TypeError(f"chunks must be bytes or seconds, got {type(chunk).__name__}")
    console = torchmp_console_open_fd(fd)
    if console == NULL:
        check(-1, b"console")
    scratch_buf = bytearray(scratch)
    if scratch > 0:
        sinks.console_buf = <char *>scratch_buf
        sinks.scratch_cap = <size_t>scratch
    source.id = 1
    source.prefix = PyBytes_AS_STRING(prefix)
    source.prefix_len = <size_t>PyBytes_GET_SIZE(prefix)
    source.log_path = PyBytes_AS_STRING(log_path) if log_path is not None else NULL
    source.limit = <size_t>backlog
    sinks.console = console
    sinks.source = &source
    sinks.filtered_fd = &filtered
    sinks.filtered_errno = &filtered_errno
    sinks.filters = NULL
    torchmp_framer_init(&f, PyBytes_AS_STRING(prefix), <size_t>PyBytes_GET_SIZE(prefix), <size_t>max_line)
    f.timestamps = timestamps
    try:
        for chunk in chunks:
            if isinstance(chunk, bytes):
                if torchmp_framer_feed(&f, PyBytes_AS_STRING(chunk), <size_t>PyBytes_GET_SIZE(chunk), now,
                                       &sinks) != 0:
                    check(-1, b"framing")
            else:
                now += <int64_t>(chunk * 1e9)
                torchmp_framer_tick(&f, now, &sinks)
        torchmp_framer_flush(&f, &sinks)
        torchmp_console_pump(console)
        broken = torchmp_console_broken(console)
        if broken:
            raise OSError(broken, strerror(broken).decode())
        return torchmp_console_pending(console)
    finally:
        torchmp_framer_free(&f)
        torchmp_console_unref(console)
