/*
 * Fork/exec of one worker.
 *
 * Everything the child needs (argv, envp, resolved path, fd plan) is prepared
 * by the caller before fork.  Between fork and exec the child makes only
 * async-signal-safe calls and touches no heap: with vfork it shares the
 * parent's memory.  A failure in the child is reported as a fixed {step,
 * errno} record, written once to a CLOEXEC pipe: an empty read in the parent
 * means exec succeeded (the pipe closed on exec).  A vfork child also stores
 * it in the parent's memory, where the parent finds it final (it runs again
 * only once the child has exec'd or exited); once a vfork child has shown
 * that it shares the parent's memory (it does not under valgrind, which runs
 * vfork as fork), launches make no pipe.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "torchmp.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#ifdef TORCHMP_HAVE_PDEATHSIG
#include <sys/prctl.h>
#endif
#if defined(TORCHMP_HAVE_CLOSE_RANGE) || defined(TORCHMP_HAVE_PROC_FD_DIR)
#include <sys/syscall.h>
#endif
/* Build hosts with kernel headers older than 5.9 (the manylinux images) do not
 * name it; the number is the same on every architecture (the unified table).
 * An older running kernel answers ENOSYS and the fallbacks below take over. */
#if defined(TORCHMP_HAVE_CLOSE_RANGE) && !defined(SYS_close_range)
#define SYS_close_range 436
#endif

static const char *const step_names[TORCHMP_STEP__COUNT] = {
    [TORCHMP_STEP_NONE] = "none",
    [TORCHMP_STEP_PIPE] = "creating the spawn error pipe",
    [TORCHMP_STEP_FORK] = "fork",
    [TORCHMP_STEP_SIGNALS] = "resetting signal dispositions",
    [TORCHMP_STEP_SETSID] = "setsid",
    [TORCHMP_STEP_PDEATHSIG] = "prctl(PR_SET_PDEATHSIG)",
    [TORCHMP_STEP_DUP_STDOUT] = "dup2 of stdout",
    [TORCHMP_STEP_DUP_STDERR] = "dup2 of stderr",
    [TORCHMP_STEP_CLOSE_FDS] = "closing inherited fds",
    [TORCHMP_STEP_EXEC] = "exec",
    [TORCHMP_STEP_PROTOCOL] = "reading the spawn error record",
    [TORCHMP_STEP_PIDFD] = "pidfd_open",
    [TORCHMP_STEP_STREAM] = "creating the tee pipe or return channel",
    [TORCHMP_STEP_DUP_FD] = "dup2 of the return channel or payload",
    [TORCHMP_STEP_AFFINITY] = "sched_setaffinity (CPU binding)",
    [TORCHMP_STEP_MEMPOLICY] = "set_mempolicy (memory binding)",
    [TORCHMP_STEP_CHDIR] = "chdir",
    [TORCHMP_STEP_KEEP_FDS] = "keeping pass_fds open",
};

int torchmp_pipe_cloexec(int fds[2])
{
#ifdef TORCHMP_HAVE_PIPE2
    return pipe2(fds, O_CLOEXEC);
#else
    int saved;
    if (pipe(fds) != 0)
        return -1;
    if (fcntl(fds[0], F_SETFD, FD_CLOEXEC) == 0 && fcntl(fds[1], F_SETFD, FD_CLOEXEC) == 0)
        return 0;
    saved = errno;
    close(fds[0]);
    close(fds[1]);
    errno = saved;
    return -1;
#endif
}

const char *torchmp_step_name(int step)
{
    if (step < 0 || step >= TORCHMP_STEP__COUNT || step_names[step] == NULL)
        return "unknown step";
    return step_names[step];
}

/* ---- child side: async-signal-safe only --------------------------------- */

/* A disposition the worker must not start with: a handler (it would run on
 * the launcher's memory in a vfork child), or SIGPIPE/SIGXFSZ ignored (what
 * CPython does for itself, not for its children). */
static int signal_needs_reset(int sig, const struct sigaction *old)
{
    if (old->sa_handler == SIG_DFL)
        return 0;
    return old->sa_handler != SIG_IGN || sig == SIGPIPE || sig == SIGXFSZ;
}

/* Where a child reports why it could not exec. */
typedef struct {
    int use_vfork;
    volatile torchmp_spawn_error *shared; /* vfork: the parent's record */
    volatile int *seen;                   /* vfork: set first thing, proof the memory is shared */
    int pipe_w;                           /* -1: none */
} child_report;

__attribute__((noreturn)) static void child_fail(const child_report *report, int step, int errnum)
{
    torchmp_spawn_error rec;
    const char *p = (const char *)&rec;
    size_t left = sizeof(rec);

    if (report->shared != NULL) {
        report->shared->errnum = errnum;
        report->shared->step = step;
    }
    if (report->pipe_w < 0)
        _exit(127);
    rec.step = step;
    rec.errnum = errnum;
    while (left > 0) {
        ssize_t n = write(report->pipe_w, p, left);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        p += n;
        left -= (size_t)n;
    }
    _exit(127);
}

/* Whether fd is among the sorted keep list. */
static int fd_kept(const int *keep, int nkeep, int fd)
{
    int lo = 0, hi = nkeep;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (keep[mid] == fd)
            return 1;
        if (keep[mid] < fd)
            lo = mid + 1;
        else
            hi = mid;
    }
    return 0;
}

/* Close every fd >= lowest except keep_fd (which may be -1) and the sorted
 * keep list (close_range over the gaps between them). */
static int child_close_fds(int lowest, int keep_fd, const int *keep, int nkeep, long max_fd)
{
#ifdef TORCHMP_HAVE_CLOSE_RANGE
    {
        int start = lowest, k = 0, rc = 0;
        for (;;) {
            int next = -1;
            while (k < nkeep && keep[k] < start)
                k++;
            if (k < nkeep)
                next = keep[k];
            if (keep_fd >= start && (next < 0 || keep_fd < next))
                next = keep_fd;
            if (next < 0) {
                rc = (int)syscall(SYS_close_range, (unsigned int)start, ~0U, 0);
                break;
            }
            if (next > start)
                rc = (int)syscall(SYS_close_range, (unsigned int)start, (unsigned int)next - 1, 0);
            if (rc != 0)
                break;
            start = next + 1;
        }
        if (rc == 0)
            return 0;
        if (errno != ENOSYS && errno != EINVAL)
            return -1;
        /* Old kernel: fall through to the slower ways. */
    }
#endif

#ifdef TORCHMP_HAVE_PROC_FD_DIR
    {
        /* Walk /proc/self/fd with the raw getdents64 syscall (opendir would
         * allocate).  The buffer is only a read window: the loop goes on
         * until the kernel reports the end of the directory. */
        int dirfd = open("/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (dirfd >= 0) {
            char buf[4096];
            long nread;
            while ((nread = syscall(SYS_getdents64, dirfd, buf, sizeof(buf))) > 0) {
                long off = 0;
                while (off < nread) {
                    /* struct linux_dirent64: ino(8) off(8) reclen(2) type(1) name */
                    unsigned short reclen;
                    const char *name = buf + off + 19;
                    int fd = 0;
                    memcpy(&reclen, buf + off + 16, sizeof(reclen));
                    if (name[0] >= '0' && name[0] <= '9') {
                        for (const char *c = name; *c >= '0' && *c <= '9'; c++)
                            fd = fd * 10 + (*c - '0');
                        if (fd >= lowest && fd != dirfd && fd != keep_fd && !fd_kept(keep, nkeep, fd))
                            close(fd);
                    }
                    off += reclen;
                }
            }
            close(dirfd);
            if (nread == 0)
                return 0;
        }
    }
#endif

    for (long fd = lowest; fd < max_fd; fd++) {
        if (fd != keep_fd && !fd_kept(keep, nkeep, (int)fd))
            close((int)fd);
    }
    return 0;
}

int torchmp_child_setup(const torchmp_spawn_args *a, int keep_fd, int close_others)
{
    int src[TORCHMP_CHILD_FDS];

    /* The new session's id is our pid (and our group's): no getpid(). */
    pid_t self = setsid();
    if (self < 0)
        return TORCHMP_STEP_SETSID;
    /* Our group in the keeper's table from now on: a launcher killed before
     * it learns our pid still takes the group -- and whatever we start --
     * with it.  (An atomic store to the shared table: async-signal-safe.) */
    if (a->keeper_slot != NULL)
        __atomic_store_n(a->keeper_slot, (int32_t)self, __ATOMIC_RELEASE);

#ifdef TORCHMP_HAVE_PDEATHSIG
    if (a->pdeathsig > 0) {
        if (prctl(PR_SET_PDEATHSIG, a->pdeathsig, 0, 0, 0) != 0)
            return TORCHMP_STEP_PDEATHSIG;
        /* The launcher may have died before prctl took effect: then nobody
         * would ever send the signal, so act on it now. */
        if (getppid() != a->parent_pid)
            _exit(128 + a->pdeathsig);
    }
#endif

    /* A source inside the target range could be clobbered by another
     * target's dup2: move it above the range first. */
    for (int i = 0; i < TORCHMP_CHILD_FDS; i++) {
        src[i] = a->child_fds[i];
        if (src[i] >= 0 && src[i] < TORCHMP_CHILD_FDS) {
            src[i] = fcntl(src[i], F_DUPFD_CLOEXEC, TORCHMP_CHILD_FDS);
            if (src[i] < 0)
                return i == 1 ? TORCHMP_STEP_DUP_STDOUT : i == 2 ? TORCHMP_STEP_DUP_STDERR : TORCHMP_STEP_DUP_FD;
        }
    }
    for (int i = 0; i < TORCHMP_CHILD_FDS; i++) {
        /* dup2 clears FD_CLOEXEC on the target: the worker keeps it. */
        if (src[i] >= 0 && dup2(src[i], i) < 0)
            return i == 1 ? TORCHMP_STEP_DUP_STDOUT : i == 2 ? TORCHMP_STEP_DUP_STDERR : TORCHMP_STEP_DUP_FD;
    }
    /* The copies moved above the range are in place now: a fork()ed worker
     * (close_others 0) must not keep them. */
    for (int i = 0; i < TORCHMP_CHILD_FDS; i++) {
        if (src[i] != a->child_fds[i])
            close(src[i]);
    }
    if (close_others) {
        /* Slots 3.. of the plan that were not asked for are closed too: those
         * above the last slot asked for with everything beyond them, in one
         * close_range (it is on the launcher's path: a vfork parent waits). */
        int unasked_from = TORCHMP_CHILD_FDS;
        while (unasked_from > 3 && src[unasked_from - 1] < 0)
            unasked_from--;
        for (int i = 3; i < unasked_from; i++) {
            if (src[i] < 0 && i != keep_fd && !fd_kept(a->keep_fds, a->nkeep, i))
                close(i);
        }
        if (child_close_fds(unasked_from, keep_fd, a->keep_fds, a->nkeep, a->max_fd) != 0)
            return TORCHMP_STEP_CLOSE_FDS;
    }
    /* pass_fds stay open across exec, at their own numbers. */
    for (int k = 0; k < a->nkeep; k++) {
        int flags = fcntl(a->keep_fds[k], F_GETFD);
        if (flags < 0 || ((flags & FD_CLOEXEC) && fcntl(a->keep_fds[k], F_SETFD, flags & ~FD_CLOEXEC) != 0))
            return TORCHMP_STEP_KEEP_FDS;
    }
    /* Last, with stderr in place: a forked worker's report of a refused
     * binding lands in its own log. */
    return torchmp_apply_binding(&a->binding);
}

__attribute__((noreturn, noinline)) static void child_exec(const torchmp_spawn_args *a, const child_report *report)
{
    sigset_t empty;
    struct sigaction dfl;
    char *const *envp;
    int step;

    /* Signals are blocked in the caller across fork.  A handler left armed
     * here could run in a vfork child on the parent's memory once we unblock,
     * so the signals the parent found caught (and SIGPIPE/SIGXFSZ, which
     * CPython ignores for itself, not for its children) go back to SIG_DFL.
     * For a batch the parent scans once instead of every child making ~128
     * sigaction calls; a single launch scans here, on the child's CPU. */
    if (report->seen != NULL)
        *report->seen = 1;
    memset(&dfl, 0, sizeof(dfl));
    dfl.sa_handler = SIG_DFL;
    for (int sig = 1; sig < NSIG; sig++) {
        int reset;
        if (a->scan_signals) {
            struct sigaction old;
            reset = sig != SIGKILL && sig != SIGSTOP && sigaction(sig, NULL, &old) == 0 &&
                    signal_needs_reset(sig, &old);
        } else {
            reset = sigismember(&a->reset_signals, sig) == 1;
        }
        if (reset && sigaction(sig, &dfl, NULL) != 0)
            child_fail(report, TORCHMP_STEP_SIGNALS, errno);
    }

    step = torchmp_child_setup(a, report->pipe_w, 1);
    if (step != 0)
        child_fail(report, step, errno);
    if (a->cwd != NULL && chdir(a->cwd) != 0)
        child_fail(report, TORCHMP_STEP_CHDIR, errno);

    sigemptyset(&empty);
    if (sigprocmask(SIG_SETMASK, &empty, NULL) != 0)
        child_fail(report, TORCHMP_STEP_SIGNALS, errno);

    envp = a->envp != NULL ? a->envp : environ;
    if (a->exec_paths != NULL) {
        int first = 0, last = ENOENT;
        for (char *const *p = a->exec_paths; *p != NULL; p++) {
            execve(*p, a->argv, envp);
            last = errno;
            if (last != ENOENT && last != ENOTDIR && first == 0)
                first = last;
        }
        child_fail(report, TORCHMP_STEP_EXEC, first != 0 ? first : last);
    }
    execve(a->path, a->argv, envp);
    child_fail(report, TORCHMP_STEP_EXEC, errno);
}

/* ---- parent side -------------------------------------------------------- */

void torchmp_signals_to_reset(sigset_t *out)
{
    sigemptyset(out);
    for (int sig = 1; sig < NSIG; sig++) {
        struct sigaction old;
        if (sig == SIGKILL || sig == SIGSTOP)
            continue;
        if (sigaction(sig, NULL, &old) != 0)
            continue; /* a signal number the C library reserves */
        if (signal_needs_reset(sig, &old))
            sigaddset(out, sig);
    }
}

/* Move fd above the child's fd plan so no dup2 in the child can clobber it. */
static int fd_above_stdio(int fd)
{
    int moved;
    if (fd >= TORCHMP_CHILD_FDS)
        return fd;
    moved = fcntl(fd, F_DUPFD_CLOEXEC, TORCHMP_CHILD_FDS);
    if (moved < 0)
        return -1;
    close(fd);
    return moved;
}

static void reap_quietly(pid_t pid)
{
    int status;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
        ;
}

/* Kept apart so that nothing of the caller's frame is live across vfork: the
 * child shares this stack until it execs or exits. */
__attribute__((noinline)) static pid_t fork_exec(const torchmp_spawn_args *a, const child_report *report)
{
    pid_t pid;
#ifdef TORCHMP_HAVE_VFORK
    if (report->use_vfork)
        pid = vfork();
    else
#endif
        pid = fork();
    if (pid == 0)
        child_exec(a, report);
    return pid;
}

/* Whether a vfork child shares this process's memory: -1 not known yet, 1
 * yes, 0 no (vfork run as fork, as valgrind does).  Until it is known to, a
 * vfork launch reports through a pipe too. */
static int vfork_shares_memory = -1;

int torchmp_spawn(const torchmp_spawn_args *a, pid_t *pid_out, torchmp_spawn_error *err)
{
    int errpipe[2];
    pid_t pid;
    torchmp_spawn_error rec;
    volatile torchmp_spawn_error *shared = &rec;
    volatile int seen = 0;
    size_t got = 0;
    child_report report;
    int use_pipe;

    err->step = TORCHMP_STEP_NONE;
    err->errnum = 0;
    shared->step = TORCHMP_STEP_NONE;
    shared->errnum = 0;
    report.use_vfork = 0;
#ifdef TORCHMP_HAVE_VFORK
    report.use_vfork = a->use_vfork;
#endif
    report.shared = report.use_vfork ? shared : NULL;
    report.seen = report.use_vfork ? &seen : NULL;
    report.pipe_w = -1;
    use_pipe = !report.use_vfork || __atomic_load_n(&vfork_shares_memory, __ATOMIC_RELAXED) != 1;

    if (use_pipe) {
        if (torchmp_pipe_cloexec(errpipe) != 0) {
            err->step = TORCHMP_STEP_PIPE;
            err->errnum = errno;
            return -1;
        }
        errpipe[0] = fd_above_stdio(errpipe[0]);
        errpipe[1] = fd_above_stdio(errpipe[1]);
        if (errpipe[0] < 0 || errpipe[1] < 0) {
            int saved = errno;
            if (errpipe[0] >= 0)
                close(errpipe[0]);
            if (errpipe[1] >= 0)
                close(errpipe[1]);
            err->step = TORCHMP_STEP_PIPE;
            err->errnum = saved;
            errno = saved;
            return -1;
        }
        report.pipe_w = errpipe[1];
    }

    pid = fork_exec(a, &report);
    if (pid < 0) {
        int saved = errno;
        if (use_pipe) {
            close(errpipe[0]);
            close(errpipe[1]);
        }
        err->step = TORCHMP_STEP_FORK;
        err->errnum = saved;
        errno = saved;
        return -1;
    }

    if (!use_pipe) {
        /* The vfork child has exec'd (nothing in the record) or exited. */
        if (shared->step == TORCHMP_STEP_NONE) {
            *pid_out = pid;
            return 0;
        }
        err->step = shared->step;
        err->errnum = shared->errnum;
        reap_quietly(pid);
        errno = err->errnum;
        return -1;
    }
    if (report.use_vfork)
        __atomic_store_n(&vfork_shares_memory, seen ? 1 : 0, __ATOMIC_RELAXED);
    close(errpipe[1]);

    /* Read to EOF: the child either exec'd (EOF, nothing read) or wrote one
     * record and exited. */
    while (got < sizeof(rec)) {
        ssize_t n = read(errpipe[0], (char *)&rec + got, sizeof(rec) - got);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        if (n == 0)
            break;
        got += (size_t)n;
    }
    close(errpipe[0]);

    if (got == 0) {
        *pid_out = pid;
        return 0;
    }
    reap_quietly(pid);
    if (got == sizeof(rec)) {
        *err = rec;
    } else {
        err->step = TORCHMP_STEP_PROTOCOL;
        err->errnum = EIO;
    }
    errno = err->errnum;
    return -1;
}

/* ---- forkserver requests ------------------------------------------------ */

int torchmp_forkserver_request(int sock, const char *msg, size_t len, const int *fds, int nfds,
                               int64_t timeout_ns, int64_t *reply)
{
    struct msghdr mh;
    struct iovec iov;
    union {
        char buf[CMSG_SPACE(8 * sizeof(int))];
        struct cmsghdr align;
    } control;
    unsigned char answer[8];
    size_t got = 0, sent = 0;
    ssize_t n;

    if (nfds < 0 || nfds > 8) {
        errno = EINVAL;
        return -1;
    }
    memset(&mh, 0, sizeof(mh));
    memset(&control, 0, sizeof(control));
    iov.iov_base = (void *)msg;
    iov.iov_len = len;
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    if (nfds > 0) {
        struct cmsghdr *cm;
        mh.msg_control = control.buf;
        mh.msg_controllen = CMSG_SPACE((size_t)nfds * sizeof(int));
        cm = CMSG_FIRSTHDR(&mh);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN((size_t)nfds * sizeof(int));
        memcpy(CMSG_DATA(cm), fds, (size_t)nfds * sizeof(int));
    }
    /* The fds ride with the first byte; the rest of a long message follows. */
    while (sent < len) {
        do {
            n = sendmsg(sock, &mh, MSG_NOSIGNAL);
        } while (n < 0 && errno == EINTR);
        if (n < 0)
            return -1;
        sent += (size_t)n;
        iov.iov_base = (char *)msg + sent;
        iov.iov_len = len - sent;
        mh.msg_control = NULL;
        mh.msg_controllen = 0;
    }
    while (got < sizeof(answer)) {
        int rc = torchmp_wait_readable(sock, -1, -1, timeout_ns);
        if (rc < 0 && errno == EINTR)
            continue; /* the caller holds its signals until the pid is recorded */
        if (rc < 0)
            return -1;
        if (rc == 0) {
            errno = ETIMEDOUT;
            return -1;
        }
        do {
            n = read(sock, answer + got, sizeof(answer) - got);
        } while (n < 0 && errno == EINTR);
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            continue;
        if (n <= 0) {
            if (n == 0)
                errno = EPIPE;
            return -1;
        }
        got += (size_t)n;
    }
    {
        uint64_t v = 0;
        for (int i = 7; i >= 0; i--)
            v = (v << 8) | answer[i]; /* little-endian on the wire */
        *reply = (int64_t)v;
    }
    return 0;
}
