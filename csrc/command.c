/*
 * One command outside the worker groups: what torchmp.run and run_async start.
 *
 * The calling thread forks and execs it with torchmp_spawn (the one spawner:
 * the same child code as every worker), then either waits for it itself --
 * its pidfd and its output pipes in one ppoll, the caller having released the
 * GIL -- or hands it to the I/O thread (loop_commands.c), which posts to a
 * notifier once it has exited and once its output is complete.  The same
 * functions here read its output and record its exit in both cases.
 *
 * Output goes into a bounded capture per stream: the first half of the bound
 * and a ring of the last half, so a command printing gigabytes costs the
 * launcher at most the bound (the caller says which part it shows).
 *
 * The leader's zombie is kept (waitid WNOWAIT, rusage included) until the
 * caller reaps it: until then its pid, and so its process group id, cannot
 * be recycled, and the caller may still signal the group safely.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "loop_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/wait.h>

#define SCRATCH 65536
#define HEAD_FIRST 4096

/* ---- bounded capture ---------------------------------------------------- */

static void capture_init(capture *cp, size_t limit)
{
    memset(cp, 0, sizeof(*cp));
    if (limit == SIZE_MAX) {
        cp->head_limit = SIZE_MAX;
    } else {
        cp->ring_cap = limit / 2;
        cp->head_limit = limit - cp->ring_cap;
    }
}

static void capture_free(capture *cp)
{
    free(cp->head);
    free(cp->ring);
    cp->head = cp->ring = NULL;
    cp->head_len = cp->head_cap = cp->ring_len = cp->ring_cap = cp->ring_end = 0;
}

/* Keep the last ring_cap bytes (data follows whatever the ring holds). */
static void ring_append(capture *cp, const char *data, size_t len)
{
    size_t first;
    if (cp->ring_cap == 0)
        return;
    if (cp->ring == NULL) {
        cp->ring = malloc(cp->ring_cap);
        if (cp->ring == NULL) {
            cp->lost_errno = ENOMEM;
            return;
        }
    }
    if (len >= cp->ring_cap) {
        memcpy(cp->ring, data + (len - cp->ring_cap), cp->ring_cap);
        cp->ring_len = cp->ring_cap;
        cp->ring_end = 0;
        return;
    }
    first = cp->ring_cap - cp->ring_end;
    if (first > len)
        first = len;
    memcpy(cp->ring + cp->ring_end, data, first);
    memcpy(cp->ring, data + first, len - first);
    cp->ring_end = (cp->ring_end + len) % cp->ring_cap;
    cp->ring_len = cp->ring_len + len > cp->ring_cap ? cp->ring_cap : cp->ring_len + len;
}

/* Room to read into the head directly (growing it up to its limit), or 0. */
static size_t head_room(capture *cp)
{
    size_t want, cap;
    char *grown;
    if (cp->head_len >= cp->head_limit || cp->lost_errno)
        return 0;
    if (cp->head_cap > cp->head_len)
        return cp->head_cap - cp->head_len;
    cap = cp->head_cap ? cp->head_cap * 2 : HEAD_FIRST;
    if (cap < cp->head_cap || cap > cp->head_limit)
        cap = cp->head_limit;
    want = cap;
    grown = realloc(cp->head, want);
    if (grown == NULL) {
        cp->lost_errno = ENOMEM;
        return 0;
    }
    cp->head = grown;
    cp->head_cap = want;
    return cp->head_cap - cp->head_len;
}

/* ---- shared with the loop thread ---------------------------------------- */

int torchmp_command_state(torchmp_command *c)
{
    return __atomic_load_n(&c->state, __ATOMIC_ACQUIRE);
}

void torchmp_command_set_state(torchmp_command *c, int bits)
{
    __atomic_or_fetch(&c->state, bits, __ATOMIC_RELEASE);
}

int torchmp_command_pump(torchmp_command *c, int w, char *scratch, size_t scratch_len)
{
    capture *cp = &c->cap[w];
    size_t room;
    ssize_t n;
    if (c->fd[w] < 0)
        return 0;
    room = head_room(cp);
    do {
        n = room > 0 ? read(c->fd[w], cp->head + cp->head_len, room) : read(c->fd[w], scratch, scratch_len);
    } while (n < 0 && errno == EINTR);
    if (n <= 0)
        return n == 0 ? 0 : -1;
    if (room > 0)
        cp->head_len += (size_t)n;
    else
        ring_append(cp, scratch, (size_t)n);
    cp->total += (uint64_t)n;
    return 1;
}

void torchmp_command_drain_buffered(torchmp_command *c, int w, char *scratch, size_t scratch_len)
{
    int avail = 0;
    if (c->fd[w] < 0 || ioctl(c->fd[w], FIONREAD, &avail) != 0)
        return;
    while (avail > 0) {
        uint64_t before = c->cap[w].total;
        if (torchmp_command_pump(c, w, scratch, scratch_len) != 1)
            return;
        avail -= (int)(c->cap[w].total - before);
    }
}

void torchmp_command_close_pipe(torchmp_command *c, int w)
{
    close_fd(&c->fd[w]);
}

/* Record the exit: r is what torchmp_collect_exit / torchmp_wait_exit said. */
static int record_exit(torchmp_command *c, int r, int status, int64_t ut, int64_t st, int64_t rss)
{
    if (r == 0)
        return 0;
    c->exit_ns = clock_ns(CLOCK_MONOTONIC);
    c->drain_until_ns = c->exit_ns + c->drain_ns;
    if (r < 0) {
        /* ECHILD: something else in this process reaped it (a waitpid(-1)):
         * the status is lost, and so is the pin on its pid. */
        c->status = 255 << 8;
        c->status_lost = 1;
        torchmp_command_set_state(c, TORCHMP_CMD_EXITED | TORCHMP_CMD_REAPED);
        return 1;
    }
    c->status = status;
    c->utime_ns = ut;
    c->stime_ns = st;
    c->maxrss_kb = rss;
    torchmp_command_set_state(c, TORCHMP_CMD_EXITED);
    return 1;
}

int torchmp_command_collect(torchmp_command *c)
{
    int status = 0, r;
    int64_t ut = 0, st = 0, rss = 0;
    if (torchmp_command_state(c) & TORCHMP_CMD_EXITED)
        return 1;
    r = torchmp_collect_exit(c->pid, &status, &ut, &st, &rss);
    return record_exit(c, r, status, ut, st, rss);
}

/* A pidfd, opened when first needed: a command waited for without a time
 * limit and with no output to read does without (one blocking waitid). */
static int command_pidfd(torchmp_command *c)
{
#ifdef TORCHMP_HAVE_PIDFD
    if (c->pidfd < 0 && torchmp_backend_choice() == TORCHMP_BACKEND_EPOLL)
        c->pidfd = (int)syscall(SYS_pidfd_open, c->pid, 0);
    return c->pidfd;
#else
    (void)c;
    errno = ENOSYS;
    return -1;
#endif
}

static void command_free(torchmp_command *c)
{
    close_fd(&c->pidfd);
    for (int w = 0; w < 2; w++) {
        close_fd(&c->fd[w]);
        capture_free(&c->cap[w]);
    }
    if (c->notifier != NULL)
        torchmp_notifier_unref(c->notifier);
    free(c);
}

void torchmp_command_unref(torchmp_command *c)
{
    if (c != NULL && __atomic_sub_fetch(&c->refs, 1, __ATOMIC_ACQ_REL) == 0)
        command_free(c);
}

/* ---- start -------------------------------------------------------------- */

int torchmp_vfork_enabled(void)
{
#ifdef TORCHMP_HAVE_VFORK
    static int enabled = -1;
    if (enabled < 0) {
        const char *no = getenv("TORCHMP_NO_VFORK");
        enabled = !(no != NULL && no[0] != '\0' && strcmp(no, "0") != 0);
    }
    return enabled;
#else
    return 0;
#endif
}

static long max_fd(void)
{
    static long cached;
    if (cached == 0) {
        long m = sysconf(_SC_OPEN_MAX);
        cached = m <= 0 || m > (1L << 20) ? 1L << 20 : m;
    }
    return cached;
}

torchmp_command *torchmp_command_start(const torchmp_command_spec *spec, torchmp_spawn_error *err)
{
    torchmp_command *c;
    torchmp_spawn_args a = spec->args;
    int pipes[2][2] = {{-1, -1}, {-1, -1}};
    sigset_t all, old;
    pid_t pid = -1;
    int rc, saved, slot;

    err->step = TORCHMP_STEP_NONE;
    err->errnum = 0;
    c = calloc(1, sizeof(*c));
    if (c == NULL) {
        err->step = TORCHMP_STEP_PIPE;
        err->errnum = ENOMEM;
        errno = ENOMEM;
        return NULL;
    }
    c->pid = -1;
    c->pidfd = -1;
    c->fd[0] = c->fd[1] = -1;
    c->refs = 1;
    c->drain_ns = spec->drain_ns;
    for (int w = 0; w < 2; w++)
        capture_init(&c->cap[w], spec->max_output);

    for (int i = 0; i < TORCHMP_CHILD_FDS; i++)
        a.child_fds[i] = -1;
    if (spec->io[0] == TORCHMP_IO_FD)
        a.child_fds[0] = spec->fd[0];
    for (int w = 0; w < 2; w++) {
        int io = spec->io[1 + w];
        if (io == TORCHMP_IO_PIPE) {
            if (torchmp_pipe_cloexec(pipes[w]) != 0 || fcntl(pipes[w][0], F_SETFL, O_NONBLOCK) != 0) {
                err->step = TORCHMP_STEP_STREAM;
                goto fail;
            }
            a.child_fds[1 + w] = pipes[w][1];
        } else if (io == TORCHMP_IO_FD) {
            a.child_fds[1 + w] = spec->fd[1 + w];
        } else if (io == TORCHMP_IO_STDOUT && w == 1) {
            a.child_fds[2] = a.child_fds[1] >= 0 ? a.child_fds[1] : 1;
        }
    }
    a.use_vfork = torchmp_vfork_enabled();
    a.parent_pid = torchmp_self_pid();
    a.max_fd = max_fd();
#ifdef TORCHMP_HAVE_PDEATHSIG
    /* Fires when the calling *thread* exits: it waits for the command (run),
     * or runs the event loop that does (run_async). */
    a.pdeathsig = SIGKILL;
#else
    a.pdeathsig = 0;
#endif
    a.scan_signals = 1;

    /* A vfork child shares this thread's memory: no handler may run in it
     * before exec, so every signal is held across the spawn. */
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    c->start_ns = clock_ns(CLOCK_MONOTONIC);
    rc = torchmp_keeper_spawn(&a, &pid, &slot, err);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    for (int w = 0; w < 2; w++)
        close_fd(&pipes[w][1]);
    if (rc != 0)
        goto fail_spawned;
    c->pid = pid;
    c->keeper_slot = slot;
    for (int w = 0; w < 2; w++)
        c->fd[w] = pipes[w][0];
    return c;

fail:
    err->errnum = errno;
fail_spawned:
    saved = err->errnum;
    for (int w = 0; w < 2; w++) {
        close_fd(&pipes[w][0]);
        close_fd(&pipes[w][1]);
        capture_free(&c->cap[w]);
    }
    free(c);
    errno = saved;
    return NULL;
}

/* ---- waiting in the calling thread -------------------------------------- */

static int reached(torchmp_command *c, int until)
{
    int st = torchmp_command_state(c);
    return until == TORCHMP_UNTIL_EXITED ? (st & TORCHMP_CMD_EXITED) != 0 : (st & TORCHMP_CMD_DONE) != 0;
}

/* Not watched by the loop: exited and no pipe left open (EOF, or drained
 * for drain_ns) is done.  Past the drain time, what a pipe holds is still
 * read: the command may have written it before it exited. */
static void direct_settle(torchmp_command *c, int64_t now, char *scratch, size_t scratch_len)
{
    if (!(torchmp_command_state(c) & TORCHMP_CMD_EXITED))
        return;
    for (int w = 0; w < 2; w++) {
        if (c->fd[w] >= 0 && now >= c->drain_until_ns) {
            torchmp_command_drain_buffered(c, w, scratch, scratch_len);
            torchmp_command_close_pipe(c, w);
        }
    }
    if (c->fd[0] < 0 && c->fd[1] < 0)
        torchmp_command_set_state(c, TORCHMP_CMD_DONE);
}

static int64_t min_wait(int64_t a, int64_t b)
{
    if (a < 0)
        return b;
    if (b < 0)
        return a;
    return a < b ? a : b;
}

static int direct_wait(torchmp_command *c, int64_t timeout_ns, int until, int signal_fd)
{
    char scratch[SCRATCH];
    int64_t start = clock_ns(CLOCK_MONOTONIC);
    for (;;) {
        struct pollfd pfd[4];
        int who[4], n = 0, rc, exited, signalled = 0;
        int64_t now = clock_ns(CLOCK_MONOTONIC), wait_ns;
        struct timespec ts;

        direct_settle(c, now, scratch, sizeof(scratch));
        if (reached(c, until))
            return 1;
        wait_ns = timeout_ns < 0 ? -1 : start + timeout_ns - now;
        if (timeout_ns >= 0 && wait_ns <= 0)
            return 0;
        exited = (torchmp_command_state(c) & TORCHMP_CMD_EXITED) != 0;
        if (!exited && wait_ns < 0 && c->fd[0] < 0 && c->fd[1] < 0 && signal_fd < 0) {
            /* Nothing to read, no time limit, no signal fd: one blocking waitid. */
            int status = 0;
            int64_t ut = 0, st = 0, rss = 0;
            rc = torchmp_wait_exit(c->pid, &status, &ut, &st, &rss);
            if (rc < 0 && errno == EINTR)
                return -1;
            (void)record_exit(c, rc, status, ut, st, rss);
            continue;
        }
        if (exited)
            wait_ns = min_wait(wait_ns, c->drain_until_ns - now);
        else if (command_pidfd(c) < 0)
            return -1;
        if (!exited) {
            pfd[n].fd = c->pidfd;
            pfd[n].events = POLLIN;
            who[n++] = -1;
        }
        for (int w = 0; w < 2; w++) {
            if (c->fd[w] >= 0) {
                pfd[n].fd = c->fd[w];
                pfd[n].events = POLLIN;
                who[n++] = w;
            }
        }
        if (signal_fd >= 0) {
            pfd[n].fd = signal_fd;
            pfd[n].events = POLLIN;
            who[n++] = -2;
        }
        ts.tv_sec = wait_ns / 1000000000LL;
        ts.tv_nsec = wait_ns % 1000000000LL;
        rc = ppoll(pfd, (nfds_t)n, wait_ns < 0 ? NULL : &ts, NULL);
        if (rc < 0)
            return -1; /* EINTR included: the caller runs its handlers */
        for (int i = 0; i < n && rc > 0; i++) {
            if (pfd[i].revents == 0)
                continue;
            if (who[i] == -2) {
                signalled = 1;
                continue;
            }
            if (who[i] < 0) {
                (void)torchmp_command_collect(c);
                continue;
            }
            /* A few reads per wake-up: a chatty command must not keep its
             * exit from being noticed. */
            for (int round = 0; round < 4; round++) {
                int got = torchmp_command_pump(c, who[i], scratch, sizeof(scratch));
                if (got == 0)
                    torchmp_command_close_pipe(c, who[i]);
                if (got != 1)
                    break;
            }
        }
        if (signalled) {
            errno = EINTR; /* the caller runs its handlers and calls again */
            return -1;
        }
    }
}

/* Watched by the loop: sleep on the notifier (the caller's alone) until the
 * loop has moved the state on. */
static int watched_wait(torchmp_command *c, int64_t timeout_ns, int until, int signal_fd)
{
    int64_t start = clock_ns(CLOCK_MONOTONIC);
    for (;;) {
        int64_t left;
        int rc;
        if (reached(c, until))
            return 1;
        left = timeout_ns < 0 ? -1 : start + timeout_ns - clock_ns(CLOCK_MONOTONIC);
        if (timeout_ns >= 0 && left <= 0)
            return 0;
        rc = torchmp_wait_readable(torchmp_notifier_fd(c->notifier), signal_fd, -1, left);
        if (rc < 0)
            return -1;
        if (rc & 1) {
            size_t count;
            int overflow;
            free(torchmp_notifier_take(c->notifier, &count, &overflow));
        }
        if (rc & 2) {
            errno = EINTR; /* the caller runs its handlers and calls again */
            return -1;
        }
    }
}

int torchmp_command_wait(torchmp_command *c, int64_t timeout_ns, int until, int signal_fd)
{
    if (torchmp_command_state(c) & TORCHMP_CMD_WATCHED) {
        if (c->notifier == NULL) {
            errno = EINVAL;
            return -1;
        }
        return watched_wait(c, timeout_ns, until, signal_fd);
    }
    if (torchmp_backend_choice() != TORCHMP_BACKEND_EPOLL) {
        errno = ENOSYS; /* no pidfd: only the I/O thread can see the exit */
        return -1;
    }
    return direct_wait(c, timeout_ns, until, signal_fd);
}

/* ---- signalling, reaping, results --------------------------------------- */

int torchmp_command_killpg(torchmp_command *c, int sig)
{
    int st = torchmp_command_state(c);
    if (st & TORCHMP_CMD_REAPED)
        return 0; /* its pid may be somebody else's by now */
    if (kill(-c->pid, sig) == 0)
        return 0;
    if (errno != ESRCH)
        return -1;
    /* Forked a moment ago, before its setsid(): the group does not exist yet. */
    if (!(st & TORCHMP_CMD_EXITED) && kill(c->pid, sig) != 0 && errno != ESRCH)
        return -1;
    return 0;
}

int torchmp_command_busy(torchmp_command *c)
{
    int st = torchmp_command_state(c);
    pid_t pgid = c->pid;
    unsigned char alive = 0;
    if (!(st & TORCHMP_CMD_EXITED))
        return 1;
    if (st & TORCHMP_CMD_REAPED)
        return 0;
    /* Without /proc (other systems) nothing else can be seen in the group. */
    if (torchmp_pgroups_alive(&pgid, 1, &alive) < 0)
        return 0;
    return alive;
}

#ifndef TORCHMP_HAVE_PIDFD
static int64_t timeval_ns(struct timeval tv)
{
    return (int64_t)tv.tv_sec * 1000000000LL + (int64_t)tv.tv_usec * 1000;
}
#endif

void torchmp_command_reap_once(torchmp_command *c)
{
    struct rusage ru;
    int status;
    pid_t r;
    if (__atomic_exchange_n(&c->reap_claimed, 1, __ATOMIC_SEQ_CST))
        return;
    if (!(torchmp_command_state(c) & TORCHMP_CMD_REAPED)) {
        memset(&ru, 0, sizeof(ru));
        do {
            r = wait4(c->pid, &status, WNOHANG, &ru);
        } while (r < 0 && errno == EINTR);
#ifndef TORCHMP_HAVE_PIDFD
        /* No rusage from waitid here: it comes with the reap. */
        if (r == c->pid) {
            c->utime_ns = timeval_ns(ru.ru_utime);
            c->stime_ns = timeval_ns(ru.ru_stime);
            c->maxrss_kb = ru.ru_maxrss;
        }
#else
        (void)r;
#endif
        torchmp_command_set_state(c, TORCHMP_CMD_REAPED);
    }
    torchmp_keeper_remove(c->keeper_slot);
    c->keeper_slot = 0;
}

int torchmp_command_reap(torchmp_command *c)
{
    if (!(torchmp_command_state(c) & TORCHMP_CMD_DONE)) {
        errno = EBUSY;
        return -1;
    }
    torchmp_command_reap_once(c);
    /* The caller's thread, after the command's life: the keeper's middle
     * process (started with the first command) is no zombie past this. */
    torchmp_keeper_settle(1);
    return 0;
}

void torchmp_command_info_get(torchmp_command *c, torchmp_command_info *out)
{
    int st = torchmp_command_state(c);
    memset(out, 0, sizeof(*out));
    out->pid = c->pid;
    out->state = st;
    out->start_mono_ns = c->start_ns;
    if (st & TORCHMP_CMD_EXITED) {
        out->wait_status = c->status;
        out->status_lost = c->status_lost;
        out->exit_mono_ns = c->exit_ns;
        out->utime_ns = c->utime_ns;
        out->stime_ns = c->stime_ns;
        out->maxrss_kb = c->maxrss_kb;
    }
}

int torchmp_command_output(torchmp_command *c, int which, const char **head, size_t *head_len, char **tail,
                           size_t *tail_len, uint64_t *total, int *lost_errno)
{
    int st = torchmp_command_state(c);
    capture *cp;
    if (which < 0 || which > 1) {
        errno = EINVAL;
        return -1;
    }
    if ((st & TORCHMP_CMD_WATCHED) && !(st & TORCHMP_CMD_DONE)) {
        errno = EBUSY;
        return -1;
    }
    cp = &c->cap[which];
    *head = cp->head;
    *head_len = cp->head_len;
    *tail = NULL;
    *tail_len = 0;
    *total = cp->total;
    *lost_errno = cp->lost_errno;
    if (cp->ring_len > 0) {
        size_t start = (cp->ring_end + cp->ring_cap - cp->ring_len) % cp->ring_cap;
        size_t first = cp->ring_cap - start < cp->ring_len ? cp->ring_cap - start : cp->ring_len;
        *tail = malloc(cp->ring_len);
        if (*tail == NULL)
            return -1;
        memcpy(*tail, cp->ring + start, first);
        memcpy(*tail + first, cp->ring, cp->ring_len - first);
        *tail_len = cp->ring_len;
    }
    return 0;
}

void torchmp_command_release(torchmp_command *c)
{
    int st;
    if (c == NULL)
        return;
    st = torchmp_command_state(c);
    if (!(st & TORCHMP_CMD_REAPED)) {
        /* Nobody will wait for it: stop what is left of it. */
        (void)torchmp_command_killpg(c, SIGKILL);
        if (st & TORCHMP_CMD_WATCHED) {
            /* The loop reaps it once done, unless it is done already. */
            __atomic_store_n(&c->orphan, 1, __ATOMIC_SEQ_CST);
            if (torchmp_command_state(c) & TORCHMP_CMD_DONE)
                torchmp_command_reap_once(c);
        } else if (st & TORCHMP_CMD_EXITED) {
            torchmp_command_reap_once(c);
        } else {
            __atomic_store_n(&c->orphan, 1, __ATOMIC_SEQ_CST);
            if (torchmp_command_watch(c, NULL, 0) != 0) {
                /* No I/O thread to hand it to: wait for the SIGKILLed leader. */
                int status;
                while (waitpid(c->pid, &status, 0) < 0 && errno == EINTR)
                    ;
                torchmp_command_set_state(c, TORCHMP_CMD_REAPED);
                torchmp_keeper_remove(c->keeper_slot);
                c->keeper_slot = 0;
            }
        }
    }
    torchmp_command_unref(c);
}
