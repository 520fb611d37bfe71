# Included by _core.pyx: one command outside the worker groups (torchmp.run,
# run_async; csrc/command.c) and the notifier an event loop is woken through.

# A standard stream of a command that is not one of the caller's fds.
IO_INHERIT = -1   # the launcher's own
IO_PIPE = -2      # stdout/stderr: read into a capture
IO_STDOUT = -3    # stderr: wherever stdout goes

CMD_EXITED = TORCHMP_CMD_EXITED
CMD_DONE = TORCHMP_CMD_DONE
CMD_REAPED = TORCHMP_CMD_REAPED
CMD_WATCHED = TORCHMP_CMD_WATCHED
UNTIL_EXITED = TORCHMP_UNTIL_EXITED
UNTIL_DONE = TORCHMP_UNTIL_DONE
NOTE_EXITED = TORCHMP_NOTE_EXITED
NOTE_DONE = TORCHMP_NOTE_DONE
NOTE_CHANGED = TORCHMP_NOTE_CHANGED

STEP_CHDIR = TORCHMP_STEP_CHDIR


# What Command.info() says of a command (a record, like ProcInfo).
class CommandInfo(_Record):
    __slots__ = ()
    _fields = __match_args__ = ("pid", "state", "wait_status", "status_lost", "start_mono_ns",
                                "exit_mono_ns", "utime_ns", "stime_ns", "maxrss_kb")
    pid = _field(0, "the leader's pid")
    state = _field(1, "CMD_* bits")
    wait_status = _field(2, "the raw wait status once exited")
    status_lost = _field(3, "reaped by something else: no status")
    start_mono_ns = _field(4, "CLOCK_MONOTONIC at start")
    exit_mono_ns = _field(5, "CLOCK_MONOTONIC when the exit was seen")
    utime_ns = _field(6, "user CPU time")
    stime_ns = _field(7, "system CPU time")
    maxrss_kb = _field(8, "peak resident set, KiB")

    def __new__(cls, pid, state, wait_status, status_lost, start_mono_ns, exit_mono_ns, utime_ns,
                stime_ns, maxrss_kb):
        return tuple.__new__(cls, (pid, state, wait_status, status_lost, start_mono_ns, exit_mono_ns,
                                   utime_ns, stime_ns, maxrss_kb))


# Per process: the keeper that kills every command's group if this process
# dies, and the /proc scans' cached fd (a forked child sets up its own).
cdef pid_t _commands_pid = 0


def children_reaped_at_exit():
    """Whether the kernel reaps this process's children at their exit, with
    their status (SIGCHLD ignored: SIG_IGN, or SA_NOCLDWAIT): then no exit
    status can be collected.  The disposition itself, which Python's
    signal.getsignal does not see change outside Python."""
    return bool(torchmp_children_reaped_at_exit())


def check_exit_statuses_collectable():
    """ChildProcessError (ECHILD) if the kernel would reap this process's
    children at their exit, status and all (SIGCHLD ignored, set or
    inherited): no exit of what a launch starts could be told, so every
    launch path (contexts, run, run_async) refuses before anything starts."""
    if torchmp_children_reaped_at_exit():
        raise ChildProcessError(
            ECHILD,
            "SIGCHLD is ignored in this process (SIG_IGN, set or inherited): the kernel would reap every "
            "child at its exit and its exit status would be lost; call signal.signal(signal.SIGCHLD, "
            "signal.SIG_DFL) before starting processes")


def backend_choice():
    """'epoll' or 'poll': the I/O backend this process uses, decided without
    starting the I/O thread.  With 'epoll' a command can be waited for in
    the calling thread (Command.wait); with 'poll' only the I/O thread sees
    its exit (Command.watch)."""
    return "epoll" if torchmp_backend_choice() == TORCHMP_BACKEND_EPOLL else "poll"


cdef class Notifier:
    """How the I/O thread wakes an event loop: fileno() is readable while
    notes wait; take() returns them ((token, what) pairs, what one of
    NOTE_*) and whether any were lost (no memory: ask every watched command
    and group directly)."""

    cdef torchmp_notifier *n

    def __cinit__(self):
        self.n = torchmp_notifier_new()
        if self.n == NULL:
            check(-1, b"creating a notifier")

    def __dealloc__(self):
        if self.n != NULL:
            torchmp_notifier_unref(self.n)
            self.n = NULL

    cdef torchmp_notifier *ptr(self) except NULL:
        if self.n == NULL:
            raise ValueError("notifier is closed")
        return self.n

    def fileno(self) -> int:
        return torchmp_notifier_fd(self.ptr())

    def close(self):
        """Let go of the descriptor (commands and groups still watched hold
        the notifier until they let go of it)."""
        if self.n != NULL:
            torchmp_notifier_unref(self.n)
            self.n = NULL

    def take(self):
        cdef size_t count = 0, i
        cdef int overflow = 0
        cdef torchmp_note *notes
        notes = torchmp_notifier_take(self.ptr(), &count, &overflow)
        try:
            return [(notes[i].token, notes[i].what) for i in range(count)], bool(overflow)
        finally:
            free(notes)


cdef char **exec_candidates(bytes name, bytes search_path) except NULL:
    """The PATH search's candidates (os.get_exec_path order, an empty entry
    meaning the bare name), NULL-terminated, in one allocation."""
    cdef list dirs = search_path.split(b":")
    cdef Py_ssize_t i, n = len(dirs), total = 0, nlen = len(name), dlen
    cdef char **arr
    cdef char *p
    cdef bytes d
    for d in dirs:
        total += len(d) + 1 + nlen + 1
    arr = <char **>malloc((n + 1) * sizeof(char *) + <size_t>total)
    if arr == NULL:
        raise MemoryError()
    p = <char *>(arr + n + 1)
    for i in range(n):
        d = dirs[i]
        dlen = len(d)
        arr[i] = p
        if dlen:
            memcpy(p, PyBytes_AS_STRING(d), <size_t>dlen)
            p += dlen
            if d[dlen - 1] != 47:  # '/'
                p[0] = 47
                p += 1
        memcpy(p, PyBytes_AS_STRING(name), <size_t>nlen)
        p += nlen
        p[0] = 0
        p += 1
    arr[n] = NULL
    return arr


def find_in_path(bytes name not None, bytes search_path not None):
    """(found, denied): the first PATH entry (search_path, PATH's value)
    holding an executable file ``name``, else None; and the first entry
    holding a ``name`` that is a directory or not executable, else None.
    An empty entry means the current directory and is returned as ``./name``.

    The loop in C: the launch of one binary spent more on this search, done
    with os.stat and os.path.join, than on anything else before the spawn."""
    cdef char **candidates = exec_candidates(name, search_path)
    cdef char **c
    cdef char *found = NULL
    cdef char *denied = NULL
    cdef stat_t st
    try:
        c = candidates
        while c[0] != NULL:
            if c_stat(c[0], &st) == 0:
                if not S_ISDIR(st.st_mode) and access(c[0], X_OK) == 0:
                    found = c[0]
                    break
                if denied == NULL:
                    denied = c[0]
            c += 1
        return _as_path(found), _as_path(denied)
    finally:
        free(candidates)


cdef object _as_path(const char *candidate):
    if candidate == NULL:
        return None
    if memchr(candidate, 47, strlen(candidate)) == NULL:  # an empty PATH entry
        return b"./" + <bytes>candidate
    return <bytes>candidate


cdef inline int64_t time_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec


cdef class Command:
    """One started command (start_command).  Until reap() its zombie pins its
    pid and process group id; dropping the object without reaping kills
    what is left of it (SIGKILL to its group) and has the I/O thread reap it."""

    cdef torchmp_command *c
    cdef Notifier notifier

    def __dealloc__(self):
        if self.c != NULL:
            torchmp_command_release(self.c)
            self.c = NULL

    cdef int _ok(self) except -1:
        if self.c == NULL:
            raise ValueError("command is closed")
        return 0

    def close(self):
        """Let go of the command now (see the class doc)."""
        if self.c != NULL:
            torchmp_command_release(self.c)
            self.c = NULL

    @property
    def pid(self) -> int:
        cdef torchmp_command_info i
        self._ok()
        torchmp_command_info_get(self.c, &i)
        return i.pid

    @property
    def state(self) -> int:
        cdef torchmp_command_info i
        self._ok()
        torchmp_command_info_get(self.c, &i)
        return i.state

    def info(self):
        cdef torchmp_command_info i
        self._ok()
        torchmp_command_info_get(self.c, &i)
        return tuple.__new__(CommandInfo, (i.pid, i.state, i.wait_status, bool(i.status_lost), i.start_mono_ns,
                                           i.exit_mono_ns, i.utime_ns, i.stime_ns, i.maxrss_kb))

    def watch(self, Notifier notifier not None, uint64_t token):
        """Hand the command to the I/O thread, which posts NOTE_EXITED and
        NOTE_DONE with token to notifier."""
        self._ok()
        check(torchmp_command_watch(self.c, notifier.ptr(), token), b"handing the command to the I/O thread")
        self.notifier = notifier

    def wait(self, double timeout, int until):
        """Wait (GIL released) until UNTIL_EXITED or UNTIL_DONE holds or
        timeout seconds pass (negative: forever); True if it holds.  Reads
        the output meanwhile.  Signal handlers run while it waits."""
        cdef int rc, err
        cdef int signal_fd
        cdef int64_t left_ns, wait_ns
        self._ok()
        # Already there (the drain wait of a command without pipes): no
        # system call, not even the signal watch's.
        rc = torchmp_command_wait(self.c, 0, until, -1)
        if rc == 1 or rc == 0 and timeout == 0:
            return rc == 1
        # The keeper started with this process's first command: its start
        # ends while the command runs, not before the command was spawned.
        with nogil:
            torchmp_keeper_settle(1)
        deadline = None if timeout < 0 else time_ns() + <int64_t>(timeout * 1e9)
        # (csrc/signal_wake.pxi, as in Group.wait)
        signal_fd = signal_wake_begin()
        try:
            PyErr_CheckSignals()
            while True:
                left_ns = -1 if deadline is None else max(0, deadline - time_ns())
                wait_ns = signal_wake_slice_ns(signal_fd, left_ns)
                with nogil:
                    rc = torchmp_command_wait(self.c, wait_ns, until, signal_fd)
                    err = errno
                if rc == 1 or rc == 0 and wait_ns == left_ns:
                    return rc == 1
                if rc < 0 and err != EINTR:
                    raise OSError(err, f"waiting for the command: {strerror(err).decode()}")
                if rc < 0:
                    signal_wake_empty(signal_fd, None)
                PyErr_CheckSignals()
        finally:
            signal_wake_end(signal_fd)

    def killpg(self, int sig):
        """Signal the command's process group while its pid is pinned."""
        self._ok()
        check(torchmp_command_killpg(self.c, sig), b"killpg")

    def busy(self) -> bool:
        """The leader runs, or its process group still has a living member."""
        self._ok()
        return torchmp_command_busy(self.c) == 1

    def reap(self):
        """Reap the zombie (once DONE): its pid is never signalled again."""
        self._ok()
        check(torchmp_command_reap(self.c), b"reaping the command")

    def output(self, int which):
        """(head, tail, total, lost_errno) of stdout (0) or stderr (1): the
        first bytes kept, the last bytes kept after them (b"" if nothing was
        left out between them... or nothing came after the head), how many
        bytes the stream carried, and ENOMEM if some could not be kept."""
        cdef const char *head = NULL
        cdef char *tail = NULL
        cdef size_t head_len = 0, tail_len = 0
        cdef uint64_t total = 0
        cdef int lost = 0
        self._ok()
        check(torchmp_command_output(self.c, which, &head, &head_len, &tail, &tail_len, &total, &lost),
              b"reading the command's output")
        try:
            return (PyBytes_FromStringAndSize(head, <Py_ssize_t>head_len) if head_len else b"",
                    PyBytes_FromStringAndSize(tail, <Py_ssize_t>tail_len) if tail_len else b"",
                    total, lost)
        finally:
            free(tail)


def start_command(bytes program not None, list argv not None, list envp, bytes search_path, bytes cwd,
                  int stdin, int stdout, int stderr, tuple pass_fds not None, Py_ssize_t max_output,
                  double drain, filename, cwd_name):
    """Fork and exec one command from the calling thread (GIL released over
    the spawn), in its own session, with a parent-death signal.

    program: a path, or a name looked up in search_path (PATH's value) when
    that is not None, each candidate tried by the child in order; argv and
    envp (None: this process's environment) as bytes; cwd (or None); stdin
    an fd or IO_INHERIT; stdout an fd, IO_INHERIT or IO_PIPE; stderr also
    IO_STDOUT; pass_fds sorted; max_output bytes kept per captured stream
    (negative: all); drain seconds of reading after the leader exited.
    An exec failure raises OSError(errno, strerror, filename) (the matching
    subclass), a failed chdir OSError(errno, strerror, cwd_name).
    """
    global _commands_pid
    cdef torchmp_command_spec spec
    cdef torchmp_spawn_error err
    cdef torchmp_command *c = NULL
    cdef char **cargv = NULL
    cdef char **cenvp = NULL
    cdef char **candidates = NULL
    cdef int *keep = NULL
    cdef Py_ssize_t i, nkeep = len(pass_fds)
    cdef list hold = []
    cdef Command command
    if self_pid() != _commands_pid:
        torchmp_keeper_start()  # once per process (settled by wait); without it, PDEATHSIG still kills the leader
        torchmp_procscan_init()
        _commands_pid = self_pid()
    memset(&spec, 0, sizeof(spec))
    memset(&err, 0, sizeof(err))
    try:
        cargv = cstring_array(argv, hold)
        spec.args.argv = cargv
        if envp is not None:
            cenvp = cstring_array(envp, hold)
            spec.args.envp = cenvp
        spec.args.path = PyBytes_AS_STRING(program)
        if search_path is not None:
            candidates = exec_candidates(program, search_path)
            spec.args.exec_paths = candidates
        if cwd is not None:
            spec.args.cwd = PyBytes_AS_STRING(cwd)
        if nkeep:
            keep = <int *>malloc(<size_t>nkeep * sizeof(int))
            if keep == NULL:
                raise MemoryError()
            for i in range(nkeep):
                keep[i] = pass_fds[i]
            spec.args.keep_fds = keep
            spec.args.nkeep = <int>nkeep
        spec.io[0] = TORCHMP_IO_FD if stdin >= 0 else TORCHMP_IO_INHERIT
        spec.fd[0] = stdin
        for i, want in ((1, stdout), (2, stderr)):
            spec.fd[i] = want
            if want >= 0:
                spec.io[i] = TORCHMP_IO_FD
            elif want == IO_PIPE:
                spec.io[i] = TORCHMP_IO_PIPE
            elif want == IO_STDOUT and i == 2:
                spec.io[i] = TORCHMP_IO_STDOUT
            else:
                spec.io[i] = TORCHMP_IO_INHERIT
        spec.max_output = <size_t>max_output if max_output >= 0 else <size_t>-1
        spec.drain_ns = <int64_t>(drain * 1e9)
        with nogil:
            c = torchmp_command_start(&spec, &err)
    finally:
        free(cargv)
        free(cenvp)
        free(candidates)
        free(keep)
    if c == NULL:
        # No wait or reap will come to settle the keeper's start: its middle
        # process is no zombie of this process past the error.
        with nogil:
            torchmp_keeper_settle(1)
        if err.step == TORCHMP_STEP_EXEC and err.errnum > 0:
            raise OSError(err.errnum, strerror(err.errnum).decode(), filename)
        if err.step == TORCHMP_STEP_CHDIR and err.errnum > 0:
            raise OSError(err.errnum, strerror(err.errnum).decode(), cwd_name)
        raise exec_error(err.step, err.errnum, None)
    command = Command.__new__(Command)
    command.c = c
    return command
