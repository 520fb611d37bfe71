# Included by _core.pyx: Group, the native side of one PContext.

cdef enum:
    # Up to this many ranks, a snapshot's records and the reap's pids are
    # copied to the stack, not to the heap: the close and the snapshot after
    # the last exit run cold, and allocate only what they hand out.
    SMALL_GROUP = 16

cdef inline int decided_flags(bint until_decided, bint fail_fast) noexcept:
    """torchmp_group_wait's and torchmp_group_watch's flags for a waiter
    that wants the deciding change only (0: every change)."""
    if not until_decided:
        return 0
    return TORCHMP_WAIT_DECIDED | (TORCHMP_WAIT_FAIL_FAST if fail_fast else 0)


cdef inline bint same_proc_info(const torchmp_proc_info *a, const torchmp_proc_info *b) noexcept:
    """Whether two copies of a rank's record say the same (field by field:
    the struct's padding is not part of it)."""
    return (a.state == b.state and a.pid == b.pid and a.wait_status == b.wait_status
            and a.start_mono_ns == b.start_mono_ns and a.exit_mono_ns == b.exit_mono_ns
            and a.exit_real_ns == b.exit_real_ns and a.utime_ns == b.utime_ns and a.stime_ns == b.stime_ns
            and a.maxrss_kb == b.maxrss_kb and a.out_log_errno == b.out_log_errno
            and a.err_log_errno == b.err_log_errno and a.status_lost == b.status_lost)


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
    # The last snapshot's records, C and Python: a rank whose record has not
    # changed since is handed out as the same ProcInfo, so a snapshot after
    # the last exit makes one record, not one per rank (that snapshot runs
    # between the exit and wait()'s return; docs/profiles.md).
    cdef torchmp_proc_info *seen
    cdef list seen_infos

    def __cinit__(self, int nprocs, list out_filters=None, int filtered_out_fd=-1,
                  list err_filters=None, int filtered_err_fd=-1):
        cdef torchmp_filters out_n, err_n
        cdef list keep = []
        memset(&out_n, 0, sizeof(out_n))
        memset(&err_n, 0, sizeof(err_n))
        self.g = NULL
        self.nprocs = nprocs
        self.started = 0
        self.owner_pid = self_pid()
        self.forked_pid = <pid_t *>calloc(nprocs if nprocs > 0 else 1, sizeof(pid_t))
        self.forked_by_forkserver = <bint *>calloc(nprocs if nprocs > 0 else 1, sizeof(bint))
        self.seen = <torchmp_proc_info *>calloc(nprocs if nprocs > 0 else 1, sizeof(torchmp_proc_info))
        if self.forked_pid == NULL or self.forked_by_forkserver == NULL or self.seen == NULL:
            raise MemoryError()
        self.seen_infos = [None] * nprocs if nprocs > 0 else []
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
        free(self.seen)

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
        if self_pid() == self.owner_pid:
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
        if self_pid() != self.owner_pid:
            raise RuntimeError(
                "this torchmp context was created in a parent process; "
                "it cannot be used after fork")
        return 0

    def spawn(self, list specs):
        """Start ranks 0..len(specs)-1.

        Each spec is a RankSpec(path, argv, envp, out, err, return_channel,
        payload_fd, binding): path bytes, argv/envp lists of bytes,
        out/err/return_channel StreamSpecs (the last STREAM_RETURN or
        STREAM_INHERIT for none); payload_fd (or -1) becomes the worker's fd
        FD_PAYLOAD; binding a Binding or None.  Plain tuples of the same
        fields work too (binding may be left out).
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
                spec = specs[i]
                path, argv, envp, out, errspec, return_channel, payload_fd = spec[:7]
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
                stream_spec_fill(&cspecs[i].return_channel, return_channel, keep)
                binding_fill(&cspecs[i].args.binding, spec[7] if len(spec) > 7 else None, keep)
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
        if self_pid() == self.owner_pid:  # a forked worker's copies are gone
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

        Each spec is (out, err, return_channel), three StreamSpecs.  Returns
        each rank's worker-side fds, a WorkerFds (-1 for none).  The pipe ends among
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
                out, errspec, return_channel = specs[i]
                stream_spec_fill(&self.staged[i].out, out, keep)
                stream_spec_fill(&self.staged[i].err, errspec, keep)
                stream_spec_fill(&self.staged[i].return_channel, return_channel, keep)
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
            self.staged[i].return_channel.prefix = NULL
        return [WorkerFds(self.staged[i].args.child_fds[1], self.staged[i].args.child_fds[2],
                          self.staged[i].args.child_fds[3]) for i in range(count)]

    def close_worker_fds(self, int rank):
        """Close the pipe ends prepare() returned for rank (once its worker
        has them)."""
        if self.staged == NULL or not 0 <= rank < self.nstaged:
            raise ValueError(f"local rank {rank} is not prepared")
        self._close_worker_fds(rank)

    def fork_rank(self, int rank, bint pdeathsig, tuple default_signals=(), binding=None):
        """fork() the calling (Python) thread for rank (after prepare),
        through CPython's before/after-fork hooks.

        Returns Forked(0, return_fd) in the child -- whose stdout/stderr are already
        redirected, in its own session -- and Forked(pid, -1) in the parent, which
        must then adopt() the pid.  pdeathsig: arm PR_SET_PDEATHSIG (it fires
        when the *forking thread* exits, so only ask for it from a thread
        that outlives the workers).  default_signals: the launcher's handled
        signals, blocked across fork and reset to SIG_DFL in the child.
        binding: a Binding (or None) applied in the child before it returns.
        """
        return group_fork_rank(self, rank, pdeathsig, default_signals, binding)

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

    cdef bint _any_forked(self):
        """Whether adopt_forked() has anything to adopt."""
        cdef int rank
        for rank in range(self.nprocs):
            if self.forked_pid[rank] > 0:
                return True
        return False

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
        """Close everything prepared for ranks that were never started.

        A worker forked already but not adopted yet (a launch interrupted
        right after the fork) is adopted first: with its streams closed, a
        forkserver's worker would look exited (its return channel ended
        without an exit trailer) and never be signalled."""
        self._ours()
        self.adopt_forked()
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
        data = torchmp_group_take_return(self.g, rank, &n)
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
        if self.g == NULL:
            raise ValueError("worker group is closed")
        return self._snapshot()

    cdef torchmp_proc_info *_infos(self, uint64_t *version) except NULL:
        """The ranks' records, taken atomically (the caller frees them)."""
        cdef torchmp_proc_info *info
        info = <torchmp_proc_info *>calloc(self.nprocs if self.nprocs else 1, sizeof(torchmp_proc_info))
        if info == NULL:
            raise MemoryError()
        version[0] = torchmp_group_snapshot(self.g, info, self.nprocs)
        return info

    cdef tuple _snapshot(self):
        cdef uint64_t version
        cdef int i
        # (A small group's records are copied to the stack: the snapshot
        # after the last exit allocates nothing but what it hands out.)
        cdef torchmp_proc_info small[SMALL_GROUP]
        cdef torchmp_proc_info *info
        if self.nprocs <= SMALL_GROUP:
            info = small
            version = torchmp_group_snapshot(self.g, info, self.nprocs)
        else:
            info = self._infos(&version)
        cdef list seen_infos = self.seen_infos
        cdef list ranks = []
        try:
            make = tuple.__new__
            cls = ProcInfo
            for i in range(self.nprocs):
                record = seen_infos[i]
                if record is None or not same_proc_info(&info[i], &self.seen[i]):
                    record = make(cls, (info[i].state, info[i].pid, info[i].wait_status, info[i].start_mono_ns,
                                        info[i].exit_mono_ns, info[i].exit_real_ns, info[i].utime_ns,
                                        info[i].stime_ns, info[i].maxrss_kb, info[i].out_log_errno,
                                        info[i].err_log_errno, bool(info[i].status_lost)))
                    seen_infos[i] = record
                    self.seen[i] = info[i]
                ranks.append(record)
        finally:
            if info != small:
                free(info)
        return version, ranks

    def stream_state(self):
        """[StreamState] per rank: whether each teed pipe is still drained,
        and the CLOCK_MONOTONIC time its last bytes came (0: none yet)."""
        cdef torchmp_stream_state *st
        cdef int i
        if self.g == NULL:
            raise ValueError("worker group is closed")
        st = <torchmp_stream_state *>calloc(self.nprocs if self.nprocs else 1, sizeof(torchmp_stream_state))
        if st == NULL:
            raise MemoryError()
        try:
            torchmp_group_stream_state(self.g, st, self.nprocs)
            return [StreamState(bool(st[i].open[0]), bool(st[i].open[1]), st[i].last_data_ns[0],
                                st[i].last_data_ns[1])
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

    def wait(self, double timeout, uint64_t known_version, bint until_decided=False, bint fail_fast=True):
        """Block (GIL released) until the group's change counter is no longer
        known_version (the version of the caller's last snapshot), the group
        is released, or timeout seconds pass (negative: forever).  Returns
        WAIT_CHANGED (1) for a change, 0 for a timeout.  Signal handlers run
        while waiting, so SignalException can interrupt it; a handler may
        even close the context meanwhile (the wait then returns
        WAIT_CHANGED).

        until_decided: a change counts only once every rank has exited, or
        (fail_fast) one has exited with a status other than 0 -- what a
        context's wait() decides on -- so the caller is not woken to look at
        each exit before the deciding one; and, for a wait begun with more,
        once one rank is left, for the caller to take in the exits so far
        while that rank runs.  A change the core found deciding returns
        WAIT_DECIDED (2): the caller, woken cold after the last exit, need
        not ask decided() again; WAIT_CHANGED leaves it to decided()."""
        cdef int rc, err
        cdef int watch_exits = 1
        cdef int signal_fd = -1
        cdef bint decided = False
        # The core sleeps through the exits that decide nothing, and says
        # after each wake-up whether they decided (_moved_undecided).
        cdef int flags = decided_flags(until_decided, fail_fast)
        cdef int64_t wait_ns
        import time
        self._enter()
        try:
            deadline = None if timeout < 0 else time.monotonic() + timeout
            # (csrc/signal_wake.pxi) Then the handlers of signals that came
            # before the watch began; those after it wake the sleep below.
            signal_fd = signal_wake_begin()
            PyErr_CheckSignals()
            while True:
                if self.release_pending:
                    return WAIT_CHANGED
                if deadline is None:
                    wait_ns = -1
                else:
                    remaining = deadline - time.monotonic()
                    wait_ns = <int64_t>(min(remaining, 1e9) * 1e9) if remaining > 0 else 0
                wait_ns = signal_wake_slice_ns(signal_fd, wait_ns)
                with nogil:
                    rc = torchmp_group_wait(self.g, wait_ns, known_version, &watch_exits, signal_fd, flags)
                    err = errno
                if rc < 0 and err != EINTR:
                    raise OSError(err, strerror(err).decode())
                if rc > 0:
                    if not until_decided or self.release_pending:
                        return WAIT_CHANGED
                    if not self._moved_undecided(&known_version, fail_fast, &decided):
                        return WAIT_DECIDED if decided else WAIT_CHANGED
                if rc < 0:
                    signal_wake_empty(signal_fd, None)
                # A signal may have arrived while the wait did not sleep.
                PyErr_CheckSignals()
                if rc == 0 and (wait_ns == 0 or deadline is not None and time.monotonic() >= deadline):
                    return 0
        finally:
            signal_wake_end(signal_fd)
            self._leave()

    cdef bint _moved_undecided(self, uint64_t *known_version, bint fail_fast, bint *decided):
        """After a change: whether it only recorded exits that decide
        nothing and leave more than one rank running (then *known_version is
        the new counter, to wait on).  A wake with the counter unmoved (an
        interrupt), or with one rank left, is for the caller; *decided says
        whether the exits recorded decide the result."""
        cdef uint64_t version = 0
        cdef int left = 0
        decided[0] = torchmp_group_decided(self.g, fail_fast, &version, &left) != 0
        if decided[0] or version == known_version[0] or left <= 1:
            return False
        known_version[0] = version
        return True

    def decided(self, bint fail_fast=True):
        """Whether the exits recorded so far decide a context's result:
        every rank exited, or (fail_fast) one exited with a status other
        than 0 -- the rule wait(until_decided=True) sleeps on, so that a
        woken wait() need not take a snapshot to apply it again."""
        cdef uint64_t version = 0
        cdef int left = 0
        if self.g == NULL:
            raise ValueError("worker group is closed")
        return bool(torchmp_group_decided(self.g, fail_fast, &version, &left))

    def left(self):
        """How many ranks have not exited (as recorded so far)."""
        cdef uint64_t version = 0
        cdef int left = 0
        if self.g == NULL:
            raise ValueError("worker group is closed")
        torchmp_group_decided(self.g, False, &version, &left)
        return left

    def watch(self, Notifier notifier not None, uint64_t token, bint until_decided=False, bint fail_fast=True):
        """Post NOTE_CHANGED with token to notifier whenever the change
        counter moves or the group is released (until unwatch).
        until_decided (and fail_fast): only once the result is decided, as
        for wait()."""
        self._ours()
        check(torchmp_group_watch(self.g, notifier.ptr(), token, decided_flags(until_decided, fail_fast)),
              b"watching the group")

    def unwatch(self, Notifier notifier not None):
        if self.g != NULL and notifier.n != NULL:
            torchmp_group_unwatch(self.g, notifier.n)

    def killpg(self, int sig):
        """Send sig to the process group of every rank whose group id is
        still pinned (its leader running, or a zombie not reaped yet)."""
        self._ours()
        check(torchmp_group_killpg(self.g, sig), b"killpg")

    def send_signal(self, int sig, ranks=None):
        """Send sig to the process groups of ranks (an iterable of local
        ranks; None: every rank whose leader still runs), each only while its
        group id is pinned (leader running, or its zombie not reaped yet).
        Returns the ranks whose groups got it.  OSError for the first failed
        kill (the other ranks were still signalled)."""
        cdef unsigned char *which = NULL
        cdef unsigned char *sent = NULL
        cdef int i, n
        self._ours()
        which = <unsigned char *>calloc(self.nprocs if self.nprocs else 1, 1)
        sent = <unsigned char *>calloc(self.nprocs if self.nprocs else 1, 1)
        try:
            if which == NULL or sent == NULL:
                raise MemoryError()
            if ranks is not None:
                for i in ranks:
                    if not 0 <= i < self.nprocs:
                        raise ValueError(f"local rank {i} is out of range 0..{self.nprocs - 1}")
                    which[i] = 1
            n = torchmp_group_signal(self.g, sig, which if ranks is not None else NULL, ranks is None, sent)
            check(n, b"kill")
            return [i for i in range(self.nprocs) if sent[i]]
        finally:
            free(which)
            free(sent)

    def busy(self):
        """The ranks whose process group still has a living process: the
        leader, or anything left in the group after the leader exited."""
        self._ours()
        return self._busy()

    cdef list _busy(self):
        cdef unsigned char *flags
        cdef int i, n
        flags = <unsigned char *>calloc(self.nprocs if self.nprocs else 1, 1)
        if flags == NULL:
            raise MemoryError()
        try:
            n = torchmp_group_busy(self.g, flags)
            check(n, b"scanning the workers' process groups")
            if n == 0:
                return []
            return [i for i in range(self.nprocs) if flags[i]]
        finally:
            free(flags)

    def reap(self):
        """torchmp is done signalling: reap every exited rank's zombie.
        Returns the pids of forkserver workers, whose zombies the
        forkserver holds until it is told to let them go."""
        self._ours()
        return self._reap()

    cdef list _reap(self):
        cdef pid_t small[SMALL_GROUP]
        cdef pid_t *forkserver_pids = small
        cdef int i, n
        if self.nprocs > SMALL_GROUP:
            forkserver_pids = <pid_t *>calloc(self.nprocs, sizeof(pid_t))
            if forkserver_pids == NULL:
                raise MemoryError()
        try:
            n = torchmp_group_reap(self.g, forkserver_pids, self.nprocs)
            check(n, b"reaping")
            return [forkserver_pids[i] for i in range(n)]
        finally:
            if forkserver_pids != small:
                free(forkserver_pids)

    def finish_streams(self):
        """Drain buffered output, flush partial lines and close every tee
        pipe and log file of the group."""
        self._ours()
        self._finish_streams()

    cdef int _finish_streams(self) except -1:
        if not torchmp_group_has_pipes(self.g):
            return 0  # nothing to drain: no reason to drop the GIL
        self._enter()
        try:
            with nogil:
                torchmp_group_finish_streams(self.g)
        finally:
            self._leave()
        return 0

    def close_quiet(self, bint unless_killed=False):
        """close() of a group with nothing left to stop, in one call: if
        every rank has exited and left nothing alive in its process group
        (after adopting what an interrupted launch forked), reap the
        zombies, finish every stream and return (the forkserver pids to
        let go, the final snapshot) -- adopt_forked(), busy(), reap(),
        finish_streams() and snapshot() in that order, without a trip
        through Python between them: this is the path from the deciding
        exit to wait()'s return.  None, with nothing done, if anything is
        still alive, or (unless_killed) a rank died of SIGKILL, whose zombie
        must pin its pid until the caller has asked the OOM killer."""
        self._ours()
        if self._any_forked():
            self.adopt_forked()  # (what torchmp._launch.adopt_interrupted asks for)
        if not check(torchmp_group_quiet(self.g, unless_killed), b"scanning the workers' process groups"):
            return None
        forkserver_pids = self._reap()
        self._finish_streams()
        return forkserver_pids, self._snapshot()
