# Included by _core.pyx: settings of the launcher process itself -- the
# child subreaper flag, and fault signals that another process sent with
# kill(), told apart from real faults.

cdef extern from *:
    """
    #include <errno.h>
    #include <signal.h>
    #include <string.h>
    #if defined(__linux__) && !defined(TORCHMP_PORTABLE)
    #include <sys/prctl.h>
    #define TORCHMP_HAVE_SUBREAPER 1
    #endif

    static int torchmp_subreaper_set(int on)
    {
    #ifdef TORCHMP_HAVE_SUBREAPER
        return prctl(PR_SET_CHILD_SUBREAPER, (unsigned long)(on != 0), 0, 0, 0);
    #else
        (void)on;
        errno = ENOSYS;
        return -1;
    #endif
    }

    static int torchmp_subreaper_get(void)
    {
    #ifdef TORCHMP_HAVE_SUBREAPER
        int on = 0;
        if (prctl(PR_GET_CHILD_SUBREAPER, (unsigned long)&on, 0, 0, 0) != 0)
            return -1;
        return on != 0;
    #else
        return 0;
    #endif
    }

    /* A fault signal (SIGSEGV, SIGBUS, SIGFPE, SIGILL) comes from the kernel
     * when an instruction faults -- returning from a handler runs it again --
     * or from another process's kill(), which is a request like SIGTERM.
     * The trampoline hands a sent one (si_code <= 0: SI_USER, SI_QUEUE,
     * SI_TKILL, ...) to Python's handler for it, as if it had been caught
     * there; a real fault gets the disposition the launcher had before
     * (faulthandler's, or the default: a core dump), and the instruction
     * that faulted runs into it. */
    static struct sigaction torchmp_fault_previous[NSIG];

    static void torchmp_fault_trampoline(int sig, siginfo_t *si, void *context)
    {
        int saved = errno;
        (void)context;
        if (si != NULL && si->si_code <= 0) {
            (void)PyErr_SetInterruptEx(sig);
        } else {
            struct sigaction previous = torchmp_fault_previous[sig];
            if (!(previous.sa_flags & SA_SIGINFO) && previous.sa_handler == SIG_IGN)
                previous.sa_handler = SIG_DFL; /* an ignored fault would fault forever */
            (void)sigaction(sig, &previous, NULL);
        }
        errno = saved;
    }

    /* Before Python's handler is installed: what to fall back to. */
    static int torchmp_fault_save(int sig)
    {
        struct sigaction current;
        if (sig <= 0 || sig >= NSIG) {
            errno = EINVAL;
            return -1;
        }
        if (sigaction(sig, NULL, &current) != 0)
            return -1;
        if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == torchmp_fault_trampoline)
            return 0; /* routed already: what it falls back to stays */
        torchmp_fault_previous[sig] = current;
        return 0;
    }

    /* After Python's handler is installed: the trampoline in front of it. */
    static int torchmp_fault_route(int sig)
    {
        struct sigaction sa;
        memset(&sa, 0, sizeof(sa));
        sa.sa_sigaction = torchmp_fault_trampoline;
        sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
        sigemptyset(&sa.sa_mask);
        return sigaction(sig, &sa, NULL);
    }
    """
    int torchmp_subreaper_set(int on)
    int torchmp_subreaper_get()
    int torchmp_fault_save(int sig)
    int torchmp_fault_route(int sig)


def set_child_subreaper(bint on=True):
    """Make this process a child subreaper (``PR_SET_CHILD_SUBREAPER``), or
    not: an orphaned descendant is then re-parented to it rather than to
    pid 1.  Process-wide; OSError (ENOSYS) where there is no such setting."""
    check(torchmp_subreaper_set(on), b"prctl(PR_SET_CHILD_SUBREAPER)")


def is_child_subreaper():
    """Whether this process is a child subreaper."""
    return bool(check(torchmp_subreaper_get(), b"prctl(PR_GET_CHILD_SUBREAPER)"))


def route_sent_faults(int sig, handler):
    """Catch a fault signal (SIGSEGV, SIGBUS, SIGFPE, SIGILL) with the
    Python ``handler`` only when another process sent it (``kill``); a real
    fault of this process still gets the disposition it had before (the
    default: a core dump).  Main thread only, as ``signal.signal``."""
    import signal as _signal

    check(torchmp_fault_save(sig), b"sigaction")
    _signal.signal(sig, handler)
    check(torchmp_fault_route(sig), b"sigaction")
