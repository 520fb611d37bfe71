# The fork path of Group.fork_rank (group.pxi): fork() the calling Python
# thread for one prepared rank.  Apart from the class body only to keep each
# file readable; Group's fields are this function's as they are its methods'.


cdef object group_fork_rank(Group self, int rank, bint pdeathsig, tuple default_signals, object binding):
    cdef torchmp_rank_spec *spec
    cdef list keep = []
    cdef torchmp_spawn_args setup
    cdef int saved, step, j, other, return_fd, nsigs
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
    return_fd = setup.child_fds[TORCHMP_FD_RETURN]
    setup.child_fds[TORCHMP_FD_RETURN] = -1
    setup.parent_pid = parent
    setup.pdeathsig = SIGKILL if pdeathsig else 0
    binding_fill(&setup.binding, binding, keep)

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
        ends[TORCHMP_FD_RETURN] = -1
        torchmp_rank_close_worker_fds(spec, ends)
        self.owner_pid = -1  # this group belongs to the parent
        return Forked(0, return_fd)
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
    return Forked(pid, -1)
