/*
 * Fork/exec of one worker.
 *
 * Everything the child needs (argv, envp, resolved path, fd plan) is prepared
 * by the caller before fork.  Between fork and exec the child makes only
 * async-signal-safe calls and touches no heap: with vfork it shares the
 * parent's memory.  A failure in the child is written once to a CLOEXEC pipe
 * as a fixed {step, errno} record; an empty read in the parent means exec
 * succeeded (the pipe closed on exec).
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
#include <sys/wait.h>
#include <unistd.h>

#ifdef TORCHMP_HAVE_PDEATHSIG
#include <sys/prctl.h>
#endif
#if defined(TORCHMP_HAVE_CLOSE_RANGE) || defined(TORCHMP_HAVE_PROC_FD_DIR)
#include <sys/syscall.h>
#endif

static const char *const step_names[TORCHMP_STEP__COUNT] = {
    [TORCHMP_STEP_NONE] = "none",
    [TORCHMP_STEP_PIPE] = "creating the exec error pipe",
    [TORCHMP_STEP_FORK] = "fork",
    [TORCHMP_STEP_SIGNALS] = "resetting signal dispositions",
    [TORCHMP_STEP_SETSID] = "setsid",
    [TORCHMP_STEP_PDEATHSIG] = "prctl(PR_SET_PDEATHSIG)",
    [TORCHMP_STEP_DUP_STDOUT] = "dup2 of stdout",
    [TORCHMP_STEP_DUP_STDERR] = "dup2 of stderr",
    [TORCHMP_STEP_CLOSE_FDS] = "closing inherited fds",
    [TORCHMP_STEP_EXEC] = "exec",
    [TORCHMP_STEP_PROTOCOL] = "reading the exec error record",
    [TORCHMP_STEP_CHDIR] = "chdir",
    [TORCHMP_STEP_PIDFD] = "pidfd_open",
    [TORCHMP_STEP_STREAM] = "creating the tee pipe",
};

const char *torchmp_step_name(int step)
{
    if (step < 0 || step >= TORCHMP_STEP__COUNT || step_names[step] == NULL)
        return "unknown step";
    return step_names[step];
}

/* ---- child side: async-signal-safe only --------------------------------- */

__attribute__((noreturn)) static void child_fail(int errpipe, int step, int errnum)
{
    torchmp_exec_error rec;
    const char *p = (const char *)&rec;
    size_t left = sizeof(rec);

    rec.step = step;
    rec.errnum = errnum;
    while (left > 0) {
        ssize_t n = write(errpipe, p, left);
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

/* Close every fd >= 3 except keep_a and keep_b (either may be -1). */
static int child_close_fds(int keep_a, int keep_b, long max_fd)
{
    int lo = keep_a < keep_b ? keep_a : keep_b;
    int hi = keep_a < keep_b ? keep_b : keep_a;
    int keep[2];
    int nkeep = 0;

    if (lo >= 3)
        keep[nkeep++] = lo;
    if (hi >= 3 && hi != lo)
        keep[nkeep++] = hi;

#ifdef TORCHMP_HAVE_CLOSE_RANGE
    {
        unsigned int start = 3;
        int ok = 1;
        for (int i = 0; i < nkeep && ok; i++) {
            if ((unsigned int)keep[i] > start &&
                syscall(SYS_close_range, start, (unsigned int)keep[i] - 1, 0) != 0)
                ok = 0;
            start = (unsigned int)keep[i] + 1;
        }
        if (ok && syscall(SYS_close_range, start, ~0U, 0) == 0)
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
                        if (fd >= 3 && fd != dirfd && fd != keep_a && fd != keep_b)
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

    for (long fd = 3; fd < max_fd; fd++) {
        if (fd != keep_a && fd != keep_b)
            close((int)fd);
    }
    return 0;
}

__attribute__((noreturn, noinline)) static void child_exec(const torchmp_spawn_args *a, int errpipe)
{
    int out = a->stdout_fd;
    int err = a->stderr_fd;
    sigset_t empty;
    struct sigaction dfl;

    /* Signals are blocked in the caller across fork.  A handler left armed
     * here could run in a vfork child on the parent's memory once we unblock,
     * so every caught signal goes back to SIG_DFL (exec would reset them
     * anyway).  SIGPIPE and SIGXFSZ are ignored by CPython, not by choice of
     * the user: restore them like subprocess does. */
    memset(&dfl, 0, sizeof(dfl));
    dfl.sa_handler = SIG_DFL;
    for (int sig = 1; sig < NSIG; sig++) {
        struct sigaction old;
        if (sig == SIGKILL || sig == SIGSTOP)
            continue;
        if (sigaction(sig, NULL, &old) != 0)
            continue; /* a signal number the C library reserves */
        if (old.sa_handler == SIG_DFL)
            continue;
        if (old.sa_handler == SIG_IGN && sig != SIGPIPE && sig != SIGXFSZ)
            continue;
        if (sigaction(sig, &dfl, NULL) != 0)
            child_fail(errpipe, TORCHMP_STEP_SIGNALS, errno);
    }

    if (setsid() < 0)
        child_fail(errpipe, TORCHMP_STEP_SETSID, errno);

#ifdef TORCHMP_HAVE_PDEATHSIG
    if (a->pdeathsig > 0) {
        if (prctl(PR_SET_PDEATHSIG, a->pdeathsig, 0, 0, 0) != 0)
            child_fail(errpipe, TORCHMP_STEP_PDEATHSIG, errno);
        /* The launcher may have died before prctl took effect: then nobody
         * would ever send the signal, so act on it now. */
        if (getppid() != a->parent_pid)
            _exit(128 + a->pdeathsig);
    }
#endif

    if (a->cwd != NULL && chdir(a->cwd) != 0)
        child_fail(errpipe, TORCHMP_STEP_CHDIR, errno);

    /* A source in 0..2 could be clobbered by the other dup2: move it up. */
    if (out >= 0 && out < 3) {
        out = fcntl(out, F_DUPFD_CLOEXEC, 3);
        if (out < 0)
            child_fail(errpipe, TORCHMP_STEP_DUP_STDOUT, errno);
    }
    if (err >= 0 && err < 3) {
        err = fcntl(err, F_DUPFD_CLOEXEC, 3);
        if (err < 0)
            child_fail(errpipe, TORCHMP_STEP_DUP_STDERR, errno);
    }
    if (out >= 0 && dup2(out, 1) < 0)
        child_fail(errpipe, TORCHMP_STEP_DUP_STDOUT, errno);
    if (err >= 0 && dup2(err, 2) < 0)
        child_fail(errpipe, TORCHMP_STEP_DUP_STDERR, errno);

    if (a->keep_fd >= 3) {
        int flags = fcntl(a->keep_fd, F_GETFD);
        if (flags < 0 || fcntl(a->keep_fd, F_SETFD, flags & ~FD_CLOEXEC) < 0)
            child_fail(errpipe, TORCHMP_STEP_CLOSE_FDS, errno);
    }
    if (child_close_fds(errpipe, a->keep_fd, a->max_fd) != 0)
        child_fail(errpipe, TORCHMP_STEP_CLOSE_FDS, errno);

    sigemptyset(&empty);
    if (sigprocmask(SIG_SETMASK, &empty, NULL) != 0)
        child_fail(errpipe, TORCHMP_STEP_SIGNALS, errno);

    execve(a->path, a->argv, a->envp);
    child_fail(errpipe, TORCHMP_STEP_EXEC, errno);
}

/* ---- parent side -------------------------------------------------------- */

/* Move fd to >= 3 so the child's dup2 onto 0..2 cannot clobber it. */
static int fd_above_stdio(int fd)
{
    int moved;
    if (fd >= 3)
        return fd;
    moved = fcntl(fd, F_DUPFD_CLOEXEC, 3);
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
__attribute__((noinline)) static pid_t fork_exec(const torchmp_spawn_args *a, int errpipe_w)
{
    pid_t pid;
#ifdef TORCHMP_HAVE_VFORK
    if (a->use_vfork)
        pid = vfork();
    else
#endif
        pid = fork();
    if (pid == 0)
        child_exec(a, errpipe_w);
    return pid;
}

int torchmp_spawn(const torchmp_spawn_args *a, pid_t *pid_out, torchmp_exec_error *err)
{
    int errpipe[2];
    pid_t pid;
    torchmp_exec_error rec;
    size_t got = 0;

    err->step = TORCHMP_STEP_NONE;
    err->errnum = 0;

    if (pipe2(errpipe, O_CLOEXEC) != 0) {
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

    pid = fork_exec(a, errpipe[1]);
    if (pid < 0) {
        int saved = errno;
        close(errpipe[0]);
        close(errpipe[1]);
        err->step = TORCHMP_STEP_FORK;
        err->errnum = saved;
        errno = saved;
        return -1;
    }
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
