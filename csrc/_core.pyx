# cython: language_level=3, boundscheck=False, wraparound=False
"""torchmp._core: the compiled half of torchmp.

Thin wrappers over the C core in csrc/*.c: argument conversion, memory
ownership and errno -> OSError.  Policy (what to spawn, when to kill, how to
report) lives in torchmp/api.py.
"""
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE, PyBytes_FromStringAndSize
from cpython.exc cimport PyErr_CheckSignals
from libc.errno cimport errno, EINTR
from libc.stdint cimport int64_t, uint64_t
from cpython.buffer cimport PyBuffer_FillInfo
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memset, strerror
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC
from posix.unistd cimport getpid, fork, close as c_close, _exit, write as c_write

from ctorchmp cimport *

import os as _os

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
    """
    const char *TORCHMP_VERSION
    int TORCHMP_PORTABLE_BUILD

__version__ = TORCHMP_VERSION.decode()
# Whether collect_exit() reads a zombie's rusage without reaping it (Linux's
# waitid system call); elsewhere rusage comes only with the reap.
COLLECT_HAS_RUSAGE = not TORCHMP_PORTABLE_BUILD
PORTABLE_BUILD = bool(TORCHMP_PORTABLE_BUILD)

STREAM_INHERIT = TORCHMP_STREAM_INHERIT
STREAM_FILE = TORCHMP_STREAM_FILE
STREAM_TEE = TORCHMP_STREAM_TEE
STREAM_CAPTURE = TORCHMP_STREAM_CAPTURE  # the return channel's mode
FD_RETURN = TORCHMP_FD_RET  # the worker's fd of its return channel
FD_PAYLOAD = TORCHMP_FD_PAYLOAD

PROC_UNSTARTED = TORCHMP_PROC_UNSTARTED
PROC_RUNNING = TORCHMP_PROC_RUNNING
PROC_EXITED = TORCHMP_PROC_EXITED

STEP_EXEC = TORCHMP_STEP_EXEC
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


def child_setup(int stdout_fd, int stderr_fd, bint pdeathsig, int parent_pid):
    """In a freshly forked Python worker: new session, parent-death signal
    (with the parent-died race checked), stdout/stderr onto the given fds.
    Closes nothing else: the interpreter may own other fds."""
    cdef torchmp_spawn_args a
    cdef int step, j
    memset(&a, 0, sizeof(a))
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
    """If child pid has exited: (wait status, user ns, system ns, max RSS
    KiB), leaving the zombie in place (waitid WNOWAIT); None if it runs."""
    cdef int status = 0
    cdef int64_t ut = 0, st = 0, rss = 0
    cdef int r = torchmp_collect_exit(pid, &status, &ut, &st, &rss)
    check(r, b"waitid")
    return (status, ut, st, rss) if r else None


def keeper_pid():
    """The pid of this process's keeper (0 if none yet): the process that
    SIGKILLs every worker process group still open when this process dies."""
    return torchmp_keeper_pid()


def _forget_keeper_after_fork():
    # A forked child must not hold its parent's keeper pipe open: the keeper
    # would miss the parent's death for as long as the child lives.
    torchmp_keeper_forget()


_os.register_at_fork(after_in_child=_forget_keeper_after_fork)


def loop_fd_count():
    """How many fds the I/O thread holds (its own plus every watched one)."""
    return check(torchmp_loop_fd_count(), b"starting the torchmp I/O thread")


cdef int filters_fill(torchmp_filters *n, list filters, list keep) except -1:
    """A C view of filters (bytes kept alive by keep) for torchmp_group_new,
    which copies them."""
    cdef Py_ssize_t i, count = len(filters)
    n.count = 0
    n.data = <char **>calloc(count if count else 1, sizeof(char *))
    n.len = <size_t *>calloc(count if count else 1, sizeof(size_t))
    if n.data == NULL or n.len == NULL:
        raise MemoryError()
    for i in range(count):
        b = filters[i]
        if not isinstance(b, bytes):
            raise TypeError("filters must be bytes")
        keep.append(b)
        n.data[i] = PyBytes_AS_STRING(b)
        n.len[i] = <size_t>PyBytes_GET_SIZE(b)
        n.count += 1
    return 0


cdef void filters_clear(torchmp_filters *n) noexcept:
    free(n.data)
    free(n.len)
    n.data = NULL
    n.len = NULL
    n.count = 0


cdef char **cstring_array(list items, list keep) except NULL:
    """A NULL-terminated char* array over bytes objects kept alive by keep."""
    cdef Py_ssize_t i, count = len(items)
    cdef char **arr = <char **>calloc(count + 1, sizeof(char *))
    if arr == NULL:
        raise MemoryError()
    try:
        for i in range(count):
            b = items[i]
            if not isinstance(b, bytes):
                raise TypeError(f"expected bytes, got {type(b).__name__}")
            keep.append(b)
            arr[i] = PyBytes_AS_STRING(b)
    except BaseException:
        free(arr)
        raise
    return arr


cdef int stream_spec_fill(torchmp_stream_spec *s, object spec, list keep) except -1:
    """A StreamSpec (or a plain tuple of its first 4 to 8 fields) -> a C
    stream spec.  console: the launcher's fd 1 or 2, -1 for none, or a
    QueueConsole; log_path: bytes or None; backlog: the console bound; tail:
    how many of the last bytes to keep for Group.tail (0: none)."""
    if not isinstance(spec, tuple) or not 4 <= len(spec) <= 8:
        raise TypeError(f"a stream spec is a StreamSpec, got {spec!r}")
    mode, fd, console, prefix = spec[:4]
    s.timestamps = bool(spec[4]) if len(spec) > 4 else 0
    log_path = spec[5] if len(spec) > 5 else None
    s.backlog_limit = <size_t>(spec[6] if len(spec) > 6 else DEFAULT_CONSOLE_BACKLOG)
    s.tail_bytes = <size_t>(spec[7] if len(spec) > 7 else 0)
    s.mode = mode
    s.fd = fd
    s.sink = NULL
    if isinstance(console, QueueConsole):
        keep.append(console)
        s.sink = (<QueueConsole>console).c
        s.console = -1
    else:
        s.console = console
    if log_path is None:
        s.log_path = NULL
    else:
        keep.append(log_path)
        s.log_path = PyBytes_AS_STRING(log_path)
    if prefix is None:
        s.prefix = NULL
        s.prefix_len = 0
    else:
        keep.append(prefix)
        s.prefix = PyBytes_AS_STRING(prefix)
        s.prefix_len = <size_t>PyBytes_GET_SIZE(prefix)
    return 0


cdef class CaptureBuffer:
    """Bytes the I/O thread read from a return channel, handed to Python
    without a copy: a read-only buffer over the native memory, freed with
    the object.  pickle.loads() reads it directly."""

    cdef char *data
    cdef Py_ssize_t size

    def __dealloc__(self):
        free(self.data)

    def __len__(self):
        return self.size

    def __bytes__(self):
        return PyBytes_FromStringAndSize(self.data, self.size)

    def __getbuffer__(self, Py_buffer *view, int flags):
        PyBuffer_FillInfo(view, self, self.data, self.size, 1, flags)

    def __releasebuffer__(self, Py_buffer *view):
        pass


class SpawnError(OSError):
    """Raised by Group.spawn when rank `rank` could not be started; ranks
    [0, rank) are running and must be terminated by the caller."""


cdef class Group:
    """The native side of one PContext: its ranks, their streams and exits.

    Safe from any thread and from signal handlers: release() while other
    threads sit in wait() (or any call that drops the GIL) wakes them and
    frees the native group only once the last of them has left."""

    cdef torchmp_group *g
    cdef readonly int nprocs
    cdef readonly int started
    cdef int owner_pid
    # prepare(): ranks staged for fork_rank / a forkserver, and fork times.
    cdef torchmp_rank_spec *staged
    cdef int64_t *fork_ns
    cdef int nstaged
    # Workers started outside the I/O thread, recorded in C the moment their
    # pid is known (no Python handler can run in between), until adopted:
    # an interrupted launch can then still find and kill every one.
    # forked_by_forkserver[rank]: a forkserver's child (see adopt).
    cdef pid_t *forked_pid
    cdef bint *forked_by_forkserver
    # Calls that run without the GIL right now; release() waits for them.
    cdef int users
    cdef bint release_pending

    def __cinit__(self, int nprocs, list out_filters=None, int filtered_out_fd=-1,
                  list err_filters=None, int filtered_err_fd=-1):
        cdef torchmp_filters out_n, err_n
        cdef list keep = []
        memset(&out_n, 0, sizeof(out_n))
        memset(&err_n, 0, sizeof(err_n))
        self.g = NULL
        self.nprocs = nprocs
        self.started = 0
        self.owner_pid = getpid()
        self.forked_pid = <pid_t *>calloc(nprocs if nprocs > 0 else 1, sizeof(pid_t))
        self.forked_by_forkserver = <bint *>calloc(nprocs if nprocs > 0 else 1, sizeof(bint))
        if self.forked_pid == NULL or self.forked_by_forkserver == NULL:
            raise MemoryError()
        try:
            if out_filters is not None:
                filters_fill(&out_n, out_filters, keep)
            if err_filters is not None:
                filters_fill(&err_n, err_filters, keep)
            self.g = torchmp_group_new(
                nprocs,
                &out_n if out_filters is not None else NULL, filtered_out_fd,
                &err_n if err_filters is not None else NULL, filtered_err_fd)
            if self.g == NULL:
                check(-1, b"creating a worker group")
        finally:
            filters_clear(&out_n)
            filters_clear(&err_n)

    def __dealloc__(self):
        self._unstage()
        if self.g != NULL:
            torchmp_group_release(self.g)
            self.g = NULL
        free(self.forked_pid)
        free(self.forked_by_forkserver)

    def release(self):
        """Hand the group back to the I/O thread, which frees it (and its
        fds) once every rank is reaped and every stream closed.  Threads
        waiting on the group are woken; the native group goes once the last
        has left.  Later calls raise ValueError; release itself is
        idempotent."""
        if self.g == NULL or self.release_pending:
            return
        self._unstage()
        self.release_pending = True
        if getpid() == self.owner_pid:
            torchmp_group_interrupt(self.g)
        if self.users == 0:
            self._free_group()

    cdef void _free_group(self) noexcept:
        if self.g != NULL:
            torchmp_group_release(self.g)
            self.g = NULL

    cdef int _enter(self) except -1:
        """Before a call that drops the GIL: the group stays until _leave."""
        self._ours()
        self.users += 1
        return 0

    cdef void _leave(self) noexcept:
        self.users -= 1
        if self.users == 0 and self.release_pending:
            self._free_group()

    cdef int _ours(self) except -1:
        if self.g == NULL or self.release_pending:
            raise ValueError("worker group is closed")
        if getpid() != self.owner_pid:
            raise RuntimeError(
                "this torchmp context was created in a parent process; "
                "it cannot be used after fork")
        return 0

    def spawn(self, list specs):
        """Start ranks 0..len(specs)-1.

        Each spec is a RankSpec(path, argv, envp, out, err, ret, payload_fd):
        path bytes, argv/envp lists of bytes, out/err/ret StreamSpecs (ret:
        the return channel, STREAM_CAPTURE or STREAM_INHERIT for none);
        payload_fd (or -1) becomes the worker's fd FD_PAYLOAD.  Plain tuples
        of the same fields work too.
        Raises SpawnError (an OSError) with .rank and .step set for the first
        rank that could not be started.
        """
        cdef Py_ssize_t i, j, count = len(specs)
        cdef torchmp_rank_spec *cspecs = NULL
        cdef torchmp_spawn_error err
        cdef list keep = []
        cdef int started
        self._ours()
        if self.started:
            raise RuntimeError("worker group already started")
        if count > self.nprocs:
            raise ValueError(f"{count} specs for a group of {self.nprocs}")
        cspecs = <torchmp_rank_spec *>calloc(count if count else 1, sizeof(torchmp_rank_spec))
        if cspecs == NULL:
            raise MemoryError()
        try:
            for i in range(count):
                path, argv, envp, out, errspec, ret, payload_fd = specs[i]
                if not isinstance(path, bytes):
                    raise TypeError("path must be bytes")
                keep.append(path)
                cspecs[i].args.path = PyBytes_AS_STRING(path)
                cspecs[i].args.argv = cstring_array(argv, keep)
                cspecs[i].args.envp = cstring_array(envp, keep)
                for j in range(TORCHMP_CHILD_FDS):
                    cspecs[i].args.child_fds[j] = -1
                cspecs[i].args.child_fds[TORCHMP_FD_PAYLOAD] = payload_fd
                stream_spec_fill(&cspecs[i].out, out, keep)
                stream_spec_fill(&cspecs[i].err, errspec, keep)
                stream_spec_fill(&cspecs[i].ret, ret, keep)
            memset(&err, 0, sizeof(err))
            self._enter()
            try:
                with nogil:
                    started = torchmp_group_spawn(self.g, cspecs, <int>count, &err)
            finally:
                self._leave()
            if started < 0:
                check(-1, b"handing the spawn request to the I/O thread")
            self.started = started
            if started < count:
                exc = exec_error(err.step, err.errnum, _os.fsdecode(specs[started][0]))
                spawn_error = SpawnError(*exc.args)
                spawn_error.rank = started
                spawn_error.step = err.step
                spawn_error.errno_ = err.errnum
                spawn_error.cause = exc
                raise spawn_error
        finally:
            for i in range(count):
                free(<void *>cspecs[i].args.argv)
                free(<void *>cspecs[i].args.envp)
            free(cspecs)

    cdef void _close_worker_fds(self, int rank) noexcept:
        """Close this process's copies of rank's worker-side pipe ends (the
        C core's one rule: FILE targets are the caller's own)."""
        torchmp_rank_close_worker_fds(&self.staged[rank], self.staged[rank].args.child_fds)

    cdef void _unstage(self) noexcept:
        cdef int rank
        if self.staged == NULL:
            return
        if getpid() == self.owner_pid:  # a forked worker's copies are gone
            for rank in range(self.nstaged):
                self._close_worker_fds(rank)
        self._free_staging()

    cdef void _free_staging(self) noexcept:
        free(self.staged)
        free(self.fork_ns)
        self.staged = NULL
        self.fork_ns = NULL
        self.nstaged = 0

    def prepare(self, list specs):
        """Open the streams of ranks 0..len(specs)-1 for workers started
        outside the I/O thread (fork_rank, a forkserver), in one round trip.

        Each spec is (out, err, ret), three StreamSpecs (ret: the return
        channel).  Returns each rank's worker-side fds
        (stdout, stderr, return channel; -1 for none).  The pipe ends among
        them stay open here until fork_rank forks the rank or
        close_worker_fds(rank) is called; FILE targets are the caller's own
        fds, returned as given.
        """
        cdef Py_ssize_t i, count = len(specs)
        cdef torchmp_spawn_error err
        cdef list keep = []
        cdef int prepared, j
        self._ours()
        if self.staged != NULL or self.started:
            raise RuntimeError("worker group already prepared")
        if count > self.nprocs:
            raise ValueError(f"{count} specs for a group of {self.nprocs}")
        self.staged = <torchmp_rank_spec *>calloc(count if count else 1, sizeof(torchmp_rank_spec))
        self.fork_ns = <int64_t *>calloc(count if count else 1, sizeof(int64_t))
        try:
            if self.staged == NULL or self.fork_ns == NULL:
                raise MemoryError()
            for i in range(count):
                for j in range(TORCHMP_CHILD_FDS):
                    self.staged[i].args.child_fds[j] = -1
            for i in range(count):
                out, errspec, ret = specs[i]
                stream_spec_fill(&self.staged[i].out, out, keep)
                stream_spec_fill(&self.staged[i].err, errspec, keep)
                stream_spec_fill(&self.staged[i].ret, ret, keep)
            memset(&err, 0, sizeof(err))
            self._enter()
            try:
                with nogil:
                    prepared = torchmp_group_prepare(self.g, self.staged, <int>count, &err)
            finally:
                self._leave()
            if prepared < 0:
                check(-1, b"handing the prepare request to the I/O thread")
            if prepared < count:
                exc = exec_error(err.step, err.errnum, None)
                exc.rank = prepared
                raise exc
        except BaseException:
            # Nothing is left open (the loop undoes a partial prepare).
            self._free_staging()
            raise
        self.nstaged = <int>count
        for i in range(count):
            # The prefixes in keep are copied by the loop: drop the pointers.
            self.staged[i].out.prefix = NULL
            self.staged[i].err.prefix = NULL
            self.staged[i].ret.prefix = NULL
        return [(self.staged[i].args.child_fds[1], self.staged[i].args.child_fds[2],
                 self.staged[i].args.child_fds[3]) for i in range(count)]

    def close_worker_fds(self, int rank):
        """Close the pipe ends prepare() returned for rank (once its worker
        has them)."""
        if self.staged == NULL or not 0 <= rank < self.nstaged:
            raise ValueError(f"local rank {rank} is not prepared")
        self._close_worker_fds(rank)

    def fork_rank(self, int rank, bint pdeathsig, tuple default_signals=()):
        """fork() the calling (Python) thread for rank (after prepare),
        through CPython's before/after-fork hooks.

        Returns (0, ret_fd) in the child -- whose stdout/stderr are already
        redirected, in its own session -- and (pid, -1) in the parent, which
        must then adopt() the pid.  pdeathsig: arm PR_SET_PDEATHSIG (it fires
        when the *forking thread* exits, so only ask for it from a thread
        that outlives the workers).  default_signals: the launcher's handled
        signals, blocked across fork and reset to SIG_DFL in the child.
        """
        cdef torchmp_rank_spec *spec
        cdef torchmp_spawn_args setup
        cdef int saved, step, j, other, ret_fd, nsigs
        cdef int ends[TORCHMP_CHILD_FDS]
        cdef int sigs[64]
        cdef sigset_t blocked, old_mask, no_signals
        cdef timespec now
        cdef pid_t pid, parent = getpid()
        self._ours()
        if self.staged == NULL or not 0 <= rank < self.nstaged:
            raise ValueError(f"local rank {rank} is not prepared")
        if len(default_signals) > 64:
            raise ValueError("too many signals")
        spec = &self.staged[rank]
        # In a Python child the return channel stays where it is: fd 3 may
        # be something of the interpreter's.
        setup = spec.args
        ret_fd = setup.child_fds[TORCHMP_FD_RET]
        setup.child_fds[TORCHMP_FD_RET] = -1
        setup.parent_pid = parent
        setup.pdeathsig = SIGKILL if pdeathsig else 0

        for j in range(len(default_signals)):
            sigs[j] = default_signals[j]
        nsigs = len(default_signals)
        # The launcher's handlers (SignalException) must not run in the child
        # -- a SIGTERM there would unwind through the launcher's copied frames
        # -- nor swallow a signal sent to the new worker (CPython's fork hook
        # forgets tripped signals).  So they are blocked across fork, put
        # back to SIG_DFL in the child at the C level, then unblocked: a
        # SIGTERM sent meanwhile kills the child as it should.  The child
        # starts with an empty mask, as an exec'd worker does: a launcher
        # holding signals while it launches must not pass that on.
        sigemptyset(&blocked)
        for j in range(nsigs):
            sigaddset(&blocked, sigs[j])
        pthread_sigmask(SIG_BLOCK, &blocked, &old_mask)
        # A handler already due runs now, not inside CPython's fork hooks
        # (which drop what it raises, and may be left half done by it).
        try:
            PyErr_CheckSignals()
        except BaseException:
            pthread_sigmask(SIG_SETMASK, &old_mask, NULL)
            raise
        clock_gettime(CLOCK_MONOTONIC, &now)
        self.fork_ns[rank] = <int64_t>now.tv_sec * 1000000000 + now.tv_nsec
        PyOS_BeforeFork()
        pid = fork()
        saved = errno
        if pid == 0:
            torchmp_keeper_forget()
            for j in range(nsigs):
                c_signal(sigs[j], SIG_DFL)
            sigemptyset(&no_signals)
            pthread_sigmask(SIG_SETMASK, &no_signals, NULL)
            PyOS_AfterFork_Child()
            # The pipe ends of ranks still to be forked are not this worker's:
            # held here they would delay those ranks' EOFs.
            for other in range(self.nstaged):
                if other != rank:
                    self._close_worker_fds(other)
            step = torchmp_child_setup(&setup, -1, 0)
            if step != 0:
                saved = errno
                msg = f"torchmp: worker setup failed during {step_name(step)}: {strerror(saved).decode()}\n".encode()
                c_write(2, PyBytes_AS_STRING(msg), PyBytes_GET_SIZE(msg))
                _exit(127)
            # The redirect targets now live at fds 1 and 2: our copies go by
            # the one rule, but for the return channel, which stays where it is.
            for j in range(TORCHMP_CHILD_FDS):
                ends[j] = spec.args.child_fds[j]
            ends[TORCHMP_FD_RET] = -1
            torchmp_rank_close_worker_fds(spec, ends)
            self.owner_pid = -1  # this group belongs to the parent
            return 0, ret_fd
        if pid > 0:
            # Before anything that could run Python code: from here on an
            # interrupted launch knows this worker (adopt_forked).
            self.forked_pid[rank] = pid
            self.forked_by_forkserver[rank] = False
        PyOS_AfterFork_Parent()
        pthread_sigmask(SIG_SETMASK, &old_mask, NULL)
        if pid < 0:
            raise OSError(saved, f"fork: {strerror(saved).decode()}")
        self._close_worker_fds(rank)
        return pid, -1

    def adopt(self, list workers, bint by_forkserver):
        """Watch started workers: (rank, pid) pairs, in one round trip.
        by_forkserver: the pids are a forkserver's children, not ours: their
        exits arrive as a trailer on their return channels, and they are not
        ours to kill or reap.  If a worker cannot be watched, it and the ones
        after it in the list are killed and reaped (unless by_forkserver) and
        an OSError is raised with .rank set."""
        cdef Py_ssize_t i, count = len(workers)
        cdef int *ranks = NULL
        cdef pid_t *pids = NULL
        cdef int64_t *starts = NULL
        cdef torchmp_spawn_error err
        cdef int adopted, rank
        self._ours()
        if count == 0:
            return
        ranks = <int *>calloc(count, sizeof(int))
        pids = <pid_t *>calloc(count, sizeof(pid_t))
        starts = <int64_t *>calloc(count, sizeof(int64_t))
        try:
            if ranks == NULL or pids == NULL or starts == NULL:
                raise MemoryError()
            for i in range(count):
                rank, pid = workers[i]
                ranks[i] = rank
                pids[i] = pid
                # 0 (not forked here, e.g. by a forkserver): adopted now.
                starts[i] = self.fork_ns[rank] if 0 <= rank < self.nstaged else 0
            memset(&err, 0, sizeof(err))
            self._enter()
            try:
                with nogil:
                    adopted = torchmp_group_adopt(self.g, ranks, pids, starts, <int>count, by_forkserver, &err)
            finally:
                self._leave()
            if adopted < 0:
                check(-1, b"handing the adopt request to the I/O thread")
            for i in range(count):
                # Adopted, or (past a failure) killed and reaped by the loop.
                self.forked_pid[ranks[i]] = 0
            for i in range(adopted):
                self.started = max(self.started, ranks[i] + 1)
            if adopted < count:
                exc = exec_error(err.step, err.errnum, None)
                exc.rank = ranks[adopted]
                raise exc
        finally:
            free(ranks)
            free(pids)
            free(starts)

    def adopt_forked(self):
        """Adopt every worker fork_rank() or forkserver_fork() started that
        is not watched yet (an interrupted launch: so close() kills it)."""
        cdef int rank
        for by_forkserver in (False, True):
            pending = [(rank, self.forked_pid[rank]) for rank in range(self.nprocs)
                       if self.forked_pid[rank] > 0 and bool(self.forked_by_forkserver[rank]) == by_forkserver]
            if pending:
                self.adopt(pending, by_forkserver)

    def forkserver_fork(self, int rank, int sock_fd, bytes message not None, list fds, double timeout):
        """Send a fork request for rank to a forkserver and read its reply:
        the worker's pid (recorded for adopt_forked before this returns), or
        -errno of a failed fork.  OSError if the server is gone or silent."""
        cdef int cfds[8]
        cdef int nfds = len(fds), rc, err, j
        cdef int64_t reply = 0
        cdef int64_t timeout_ns = <int64_t>(timeout * 1e9)
        cdef const char *buf = PyBytes_AS_STRING(message)
        cdef size_t length = <size_t>PyBytes_GET_SIZE(message)
        self._ours()
        if not 0 <= rank < self.nprocs:
            raise ValueError(f"local rank {rank} is out of range")
        if nfds > 8:
            raise ValueError("too many fds")
        for j in range(nfds):
            cfds[j] = fds[j]
        self._enter()
        try:
            with nogil:
                rc = torchmp_forkserver_request(sock_fd, buf, length, cfds, nfds, timeout_ns, &reply)
                err = errno
                if rc == 0 and reply > 0:
                    self.forked_pid[rank] = <pid_t>reply
                    self.forked_by_forkserver[rank] = True
        finally:
            self._leave()
        if rc != 0:
            raise OSError(err, strerror(err).decode())
        return reply

    def drop_unstarted(self):
        """Close everything prepared for ranks that were never adopted."""
        self._ours()
        self._unstage()
        self._enter()
        try:
            with nogil:
                torchmp_group_drop_unstarted(self.g)
        finally:
            self._leave()

    def take_return(self, int rank):
        """The bytes rank wrote to its return channel so far (then forgotten)."""
        cdef size_t n = 0
        cdef char *data
        if self.g == NULL:
            raise ValueError("worker group is closed")
        cdef char *shrunk
        cdef CaptureBuffer buf
        data = torchmp_group_take_ret(self.g, rank, &n)
        if data == NULL:
            if errno != 0:
                raise MemoryError(f"the return value of local rank {rank} did not fit in memory")
            return b""
        if n == 0:  # a forkserver worker's channel held only its exit trailer
            free(data)
            return b""
        # The buffer grew by doubling: give back the slack (for a large
        # buffer glibc remaps pages rather than copying).
        shrunk = <char *>realloc(data, n)
        if shrunk != NULL:
            data = shrunk
        buf = CaptureBuffer.__new__(CaptureBuffer)
        buf.data = data
        buf.size = <Py_ssize_t>n
        return buf

    def version(self):
        """The group's change counter (it moves with every recorded exit)."""
        if self.g == NULL:
            raise ValueError("worker group is closed")
        return torchmp_group_snapshot(self.g, NULL, 0)

    def snapshot(self):
        """(version, [ProcInfo per rank]) taken atomically from the I/O thread."""
        cdef torchmp_proc_info *info
        cdef uint64_t version
        cdef int i
        if self.g == NULL:
            raise ValueError("worker group is closed")
        info = <torchmp_proc_info *>calloc(self.nprocs if self.nprocs else 1, sizeof(torchmp_proc_info))
        if info == NULL:
            raise MemoryError()
        try:
            version = torchmp_group_snapshot(self.g, info, self.nprocs)
            make = tuple.__new__
            cls = ProcInfo
            ranks = [
                make(cls, (info[i].state, info[i].pid, info[i].wait_status, info[i].start_mono_ns,
                           info[i].exit_mono_ns, info[i].exit_real_ns, info[i].utime_ns,
                           info[i].stime_ns, info[i].maxrss_kb, info[i].out_log_errno,
                           info[i].err_log_errno, bool(info[i].status_lost)))
                for i in range(self.nprocs)
            ]
        finally:
            free(info)
        return version, ranks

    def stream_state(self):
        """[(stdout_open, stderr_open, stdout_last_ns, stderr_last_ns)] per
        rank: whether each teed pipe is still drained, and the
        CLOCK_MONOTONIC time its last bytes came (0: none yet)."""
        cdef torchmp_stream_state *st
        cdef int i
        if self.g == NULL:
            raise ValueError("worker group is closed")
        st = <torchmp_stream_state *>calloc(self.nprocs if self.nprocs else 1, sizeof(torchmp_stream_state))
        if st == NULL:
            raise MemoryError()
        try:
            torchmp_group_stream_state(self.g, st, self.nprocs)
            return [(bool(st[i].open[0]), bool(st[i].open[1]), st[i].last_data_ns[0], st[i].last_data_ns[1])
                    for i in range(self.nprocs)]
        finally:
            free(st)

    def tail(self, int rank, int which=1, Py_ssize_t limit=1 << 20):
        """The last bytes (at most limit) stream which (0 stdout, 1 stderr)
        of rank carried, as kept by its spec's tail bound."""
        cdef char *buf
        cdef size_t n
        if self.g == NULL:
            raise ValueError("worker group is closed")
        if limit <= 0:
            return b""
        buf = <char *>malloc(<size_t>limit)
        if buf == NULL:
            raise MemoryError()
        try:
            n = torchmp_group_tail(self.g, rank, which, buf, <size_t>limit)
            return PyBytes_FromStringAndSize(buf, <Py_ssize_t>n)
        finally:
            free(buf)

    def wait(self, double timeout, uint64_t known_version):
        """Block (GIL released) until the group's change counter is no longer
        known_version (the version of the caller's last snapshot), the group
        is released, or timeout seconds pass (negative: forever).  Returns
        True for a change.  Signal handlers run while waiting, so
        SignalException can interrupt it; a handler may even close the
        context meanwhile (the wait then returns True)."""
        cdef int rc, err
        cdef int watch_exits = 1
        cdef int64_t wait_ns
        import time
        self._enter()
        try:
            deadline = None if timeout < 0 else time.monotonic() + timeout
            while True:
                if self.release_pending:
                    return True
                if deadline is None:
                    wait_ns = -1
                else:
                    remaining = deadline - time.monotonic()
                    wait_ns = <int64_t>(min(remaining, 1e9) * 1e9) if remaining > 0 else 0
                with nogil:
                    rc = torchmp_group_wait(self.g, wait_ns, known_version, &watch_exits)
                    err = errno
                if rc < 0 and err != EINTR:
                    raise OSError(err, strerror(err).decode())
                if rc > 0:
                    return True
                # A signal may have arrived while the wait did not sleep.
                PyErr_CheckSignals()
                if rc == 0 and (wait_ns == 0 or deadline is not None and time.monotonic() >= deadline):
                    return False
        finally:
            self._leave()

    def killpg(self, int sig):
        """Send sig to the process group of every rank whose group id is
        still pinned (its leader running, or a zombie not reaped yet)."""
        self._ours()
        check(torchmp_group_killpg(self.g, sig), b"killpg")

    def busy(self):
        """The ranks whose process group still has a living process: the
        leader, or anything left in the group after the leader exited."""
        cdef unsigned char *flags
        cdef int i, n
        self._ours()
        flags = <unsigned char *>calloc(self.nprocs if self.nprocs else 1, 1)
        if flags == NULL:
            raise MemoryError()
        try:
            n = torchmp_group_busy(self.g, flags)
            check(n, b"scanning the workers' process groups")
            return [i for i in range(self.nprocs) if flags[i]]
        finally:
            free(flags)

    def reap(self):
        """torchmp is done signalling: reap every exited rank's zombie.
        Returns the pids of forkserver workers, whose zombies the
        forkserver holds until it is told to let them go."""
        cdef pid_t *forkserver_pids
        cdef int i, n
        self._ours()
        forkserver_pids = <pid_t *>calloc(self.nprocs if self.nprocs else 1, sizeof(pid_t))
        if forkserver_pids == NULL:
            raise MemoryError()
        try:
            n = torchmp_group_reap(self.g, forkserver_pids, self.nprocs)
            check(n, b"reaping")
            return [forkserver_pids[i] for i in range(n)]
        finally:
            free(forkserver_pids)

    def finish_streams(self):
        """Drain buffered output, flush partial lines and close every tee
        pipe and log file of the group."""
        self._ours()
        self._enter()
        try:
            with nogil:
                torchmp_group_finish_streams(self.g)
        finally:
            self._leave()


DEFAULT_CONSOLE_BACKLOG = 4 * 1024 * 1024


# What Group.snapshot() says of one rank: a named tuple, so it reads by name
# (info.pid) and still unpacks and indexes like the tuple it was.  Built with
# tuple.__new__ (no Python-level __new__ per rank).
import collections as _collections
ProcInfo = _collections.namedtuple("ProcInfo", [
    "state",          # PROC_UNSTARTED, PROC_RUNNING or PROC_EXITED
    "pid",            # the worker's pid (0 before it started)
    "wait_status",    # the raw wait status once exited
    "start_mono_ns",  # CLOCK_MONOTONIC at start
    "exit_mono_ns",   # CLOCK_MONOTONIC when the exit was recorded
    "exit_real_ns",   # CLOCK_REALTIME when the exit was recorded
    "utime_ns",       # user CPU time
    "stime_ns",       # system CPU time
    "maxrss_kb",      # peak resident set, KiB
    "out_log_errno",  # first error writing the stdout log, 0 if none
    "err_log_errno",  # first error writing the stderr log, 0 if none
    "status_lost",    # another process reaped it, or its forkserver died
])
ProcInfo.__module__ = __name__

# What Group.spawn and Group.prepare take: how one stream of a rank is wired
# (stdout, stderr or the return channel), and one rank to exec.  Named
# tuples, so plain tuples of the same fields are accepted too.
StreamSpec = _collections.namedtuple("StreamSpec", [
    "mode",        # STREAM_INHERIT, STREAM_FILE, STREAM_TEE or STREAM_CAPTURE (the return channel)
    "fd",          # FILE: the file; TEE: the log file or -1
    "console",     # TEE: the launcher's fd 1 or 2, -1 for none, or a QueueConsole
    "prefix",      # TEE: the console prefix (bytes), or None
    "timestamps",  # TEE: a UTC time on every console line
    "log_path",    # TEE: the log file's path for the console's marker line (bytes), or None
    "backlog",     # TEE: the console backlog bound for this stream, bytes
    "tail",        # TEE: keep this many of the last bytes for Group.tail (0: none)
], defaults=(False, None, DEFAULT_CONSOLE_BACKLOG, 0))
StreamSpec.__module__ = __name__

RankSpec = _collections.namedtuple("RankSpec", [
    "path",        # the executable (bytes; PATH lookup done by the caller)
    "argv",        # [bytes]
    "envp",        # [b"K=V"]
    "out",         # StreamSpec of stdout
    "err",         # StreamSpec of stderr
    "ret",         # StreamSpec of the return channel (STREAM_CAPTURE, or STREAM_INHERIT: none)
    "payload_fd",  # becomes the worker's fd FD_PAYLOAD, or -1
])
RankSpec.__module__ = __name__

cdef class QueueConsole:
    """A console whose framed lines are taken by Python (for a sys.stdout /
    sys.stderr object that is not the process's own fd 1 / 2).  The I/O
    thread only appends to it: it never needs the GIL.  fileno() is readable
    while bytes wait; take() returns them (marker lines included)."""
    cdef torchmp_console *c

    def __cinit__(self):
        self.c = torchmp_console_new_queue()
        if self.c == NULL:
            check(-1, b"console")

    def __dealloc__(self):
        if self.c != NULL:
            torchmp_console_unref(self.c)
            self.c = NULL

    def fileno(self) -> int:
        return torchmp_console_notify_fd(self.c)

    def take(self) -> bytes:
        cdef size_t n = 0
        cdef char *data
        with nogil:
            data = torchmp_console_take(self.c, &n)
        if data == NULL:
            return b""
        try:
            return PyBytes_FromStringAndSize(data, <Py_ssize_t>n)
        finally:
            free(data)

    def pending(self) -> int:
        return torchmp_console_pending(self.c)


def consoles_pending(int fd=-1) -> int:
    """Bytes waiting for the launcher's fd 1 / fd 2 consoles (0: caught up);
    fd >= 0: only for the console of what fd refers to."""
    cdef size_t n
    with nogil:
        n = torchmp_consoles_pending(fd)
    return n


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
