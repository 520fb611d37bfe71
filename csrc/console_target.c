/*
 * How a console reaches its target without blocking (what a console is, and
 * its backlog: console.c), and where the takers of queue consoles sleep.
 *
 * An fd console writes, by what the target is:
 *   regular file, /dev/null   plain writes (they do not wait on a reader);
 *   pipe, FIFO, terminal      a private open file description of the same
 *                             object (/proc/self/fd/N) made O_NONBLOCK, so the
 *                             flag never leaks to the launcher's own fd or to
 *                             workers that share it;
 *   socket                    send(MSG_DONTWAIT);
 *   otherwise                 poll(POLLOUT, 0) before each write of at most
 *                             PIPE_BUF bytes (a write that small into a pipe
 *                             with room does not block).
 * Pipes and terminals (the last three kinds) take whole lines: each write
 * ends at a line end and is at most PIPE_BUF bytes where the lines allow
 * (line_chunk), so a write into a pipe is atomic: when the pipe is full it
 * fails whole instead of leaving half a line, which a launcher that exits
 * while its console is stalled, or another writer of the same pipe (a
 * worker that shares the launcher's stderr, the launcher's own messages),
 * would leave torn for good.
 * Queue consoles have no fd: their takers sleep on one process-wide
 * condition that a queue console posts when bytes start to wait in it.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "console_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#ifndef MSG_NOSIGNAL
#define MSG_NOSIGNAL 0
#endif

/* How many of buf's len bytes to write at once to a pipe or terminal: all of
 * them when they fit in PIPE_BUF, else up to the last line end within
 * PIPE_BUF.  A line longer than PIPE_BUF cannot be written atomically; it
 * goes in one write up to its end (what the target does not take waits in
 * the backlog, as the rest of a line already on the console). */
static size_t line_chunk(const char *buf, size_t len)
{
    const char *nl;
    if (len <= PIPE_BUF)
        return len;
    nl = memrchr(buf, '\n', PIPE_BUF);
    if (nl != NULL)
        return (size_t)(nl + 1 - buf);
    nl = memchr(buf + PIPE_BUF, '\n', len - PIPE_BUF);
    return nl != NULL ? (size_t)(nl + 1 - buf) : len;
}

/* (console_internal.h) */
ssize_t torchmp_console_write_some(torchmp_console *c, const char *buf, size_t len)
{
    size_t done = 0;
    while (done < len) {
        ssize_t n;
        size_t want = len - done;
        switch (c->mode) {
        case MODE_SOCKET:
            n = send(c->fd, buf + done, want, MSG_DONTWAIT | MSG_NOSIGNAL);
            break;
        case MODE_GUARDED: {
            struct pollfd p;
            int r;
            p.fd = c->fd;
            p.events = POLLOUT;
            p.revents = 0;
            r = poll(&p, 1, 0);
            if (r < 0 && errno == EINTR)
                continue;
            if (r < 0)
                return -1;
            if (r == 0)
                return (ssize_t)done;
            if (p.revents & (POLLERR | POLLNVAL)) {
                errno = (p.revents & POLLNVAL) ? EBADF : EPIPE;
                return -1;
            }
            want = line_chunk(buf + done, want);
            n = write(c->fd, buf + done, want);
            break;
        }
        case MODE_NONBLOCK:
            want = line_chunk(buf + done, want);
            n = write(c->fd, buf + done, want);
            break;
        default:
            n = write(c->fd, buf + done, want);
            break;
        }
        if (n > 0) {
            done += (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return (ssize_t)done;
        if (n == 0)
            errno = EIO;
        return -1;
    }
    return (ssize_t)done;
}

/* A private, non-blocking open file description of what fd refers to. */
static int reopen_nonblocking(int fd)
{
#ifdef __linux__
    char path[64];
    snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
    return open(path, O_WRONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
#else
    (void)fd;
    errno = ENOSYS;
    return -1;
#endif
}

torchmp_console *torchmp_console_open_fd(int fd)
{
    struct stat st;
    torchmp_console *c;
    if (fstat(fd, &st) != 0)
        return NULL;
    c = torchmp_console_alloc(MODE_PLAIN);
    if (c == NULL)
        return NULL;
    c->std_fd = fd;
    c->dev = st.st_dev;
    c->ino = st.st_ino;
    if (S_ISREG(st.st_mode) || S_ISBLK(st.st_mode) || (S_ISCHR(st.st_mode) && !isatty(fd))) {
        c->mode = MODE_PLAIN;
    } else if (S_ISSOCK(st.st_mode)) {
        c->mode = MODE_SOCKET;
    } else {
        /* pipe, FIFO, terminal */
        c->fd = reopen_nonblocking(fd);
        if (c->fd >= 0) {
            c->mode = MODE_NONBLOCK;
            return c;
        }
        if (errno == ENXIO && S_ISFIFO(st.st_mode)) {
            /* No reader left: the console is closed already. */
            c->broken_errno = EPIPE;
            return c;
        }
        c->mode = MODE_GUARDED;
    }
    c->fd = fcntl(fd, F_DUPFD_CLOEXEC, 3);
    if (c->fd < 0) {
        int saved = errno;
        torchmp_console_destroy(c);
        errno = saved;
        return NULL;
    }
    return c;
}

int torchmp_console_same_target(const torchmp_console *c, int fd)
{
    struct stat st;
    if (c->mode == MODE_QUEUE || fstat(fd, &st) != 0)
        return 0;
    return st.st_dev == c->dev && st.st_ino == c->ino;
}

/* ---- the takers of queue consoles ---------------------------------------- */

static pthread_mutex_t queues_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t queues_cond = PTHREAD_COND_INITIALIZER;
static uint64_t queues_generation;

void torchmp_queues_post(void)
{
    pthread_mutex_lock(&queues_mu);
    queues_generation++;
    pthread_cond_broadcast(&queues_cond);
    pthread_mutex_unlock(&queues_mu);
}

uint64_t torchmp_queues_generation(void)
{
    uint64_t g;
    pthread_mutex_lock(&queues_mu);
    g = queues_generation;
    pthread_mutex_unlock(&queues_mu);
    return g;
}

int torchmp_queues_wait(uint64_t seen, int64_t timeout_ns)
{
    struct timespec until;
    int rc = 0, changed;
    if (timeout_ns >= 0) {
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += (time_t)(timeout_ns / 1000000000LL);
        until.tv_nsec += (long)(timeout_ns % 1000000000LL);
        if (until.tv_nsec >= 1000000000L) {
            until.tv_sec++;
            until.tv_nsec -= 1000000000L;
        }
    }
    pthread_mutex_lock(&queues_mu);
    while (queues_generation == seen && rc != ETIMEDOUT) {
        if (timeout_ns >= 0)
            rc = pthread_cond_timedwait(&queues_cond, &queues_mu, &until);
        else
            rc = pthread_cond_wait(&queues_cond, &queues_mu);
    }
    changed = queues_generation != seen;
    pthread_mutex_unlock(&queues_mu);
    return changed;
}

void torchmp_queues_after_fork(void)
{
    /* In a forked child: the parent's threads are gone, and one of them may
     * have held these. */
    static const pthread_mutex_t fresh_mu = PTHREAD_MUTEX_INITIALIZER;
    static const pthread_cond_t fresh_cond = PTHREAD_COND_INITIALIZER;
    memcpy(&queues_mu, &fresh_mu, sizeof(queues_mu));
    memcpy(&queues_cond, &fresh_cond, sizeof(queues_cond));
}
