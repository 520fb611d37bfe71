/*
 * Consoles: where teed lines are shown, decoupled from the I/O thread.
 *
 * Why: the I/O thread drains every rank's pipes and writes every log file.  A
 * console write that blocks (a pipe nobody reads, a terminal stopped with
 * ^S, a stalled log shipper) would stop all of that, and with it the workers
 * (their pipes fill) and exit detection.  So a console is never written with
 * a call that can block.  What it cannot take now waits in a backlog, bounded
 * per source; past the bound whole lines are dropped from the console only
 * (the log file has them) and, once the console has caught up, one marker
 * line per source says how many and where the complete log is.
 *
 * Kinds:
 *   fd     the launcher's fd 1 or 2 (or whatever file they refer to).  One
 *          console per target, found by identity (st_dev, st_ino): stdout and
 *          stderr on the same pipe share a backlog, so the remainder of a
 *          partly written line always goes out before anything else.
 *   queue  bytes for somebody else to take (a Python object such as a
 *          notebook's sys.stdout): readable notify fd while bytes wait.
 *
 * How an fd console avoids blocking, by what the target is:
 *   regular file, /dev/null   plain writes (they do not wait on a reader);
 *   pipe, FIFO, terminal      a private open file description of the same
 *                             object (/proc/self/fd/N) made O_NONBLOCK, so the
 *                             flag never leaks to the launcher's own fd or to
 *                             workers that share it;
 *   socket                    send(MSG_DONTWAIT);
 *   otherwise                 poll(POLLOUT, 0) before each write of at most
 *                             PIPE_BUF bytes (a write that small into a pipe
 *                             with room does not block).
 * A console whose writes fail for good (EPIPE: the reader is gone; EIO: the
 * terminal hung up) is switched off; nothing else changes.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "torchmp.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#ifdef TORCHMP_HAVE_EVENTFD
#include <sys/eventfd.h>
#endif
#ifndef MSG_NOSIGNAL
#define MSG_NOSIGNAL 0
#endif

enum console_mode {
    MODE_PLAIN = 1,       /* writes never wait on a reader */
    MODE_NONBLOCK = 2,    /* a private O_NONBLOCK description */
    MODE_SOCKET = 3,      /* send(MSG_DONTWAIT) */
    MODE_GUARDED = 4,     /* poll before small writes */
    MODE_QUEUE = 5        /* taken by the owner */
};

typedef struct drop_record {
    uint64_t source_id;
    char *prefix;
    char *log_path;           /* NULL: no log file */
    uint64_t lines;
    uint64_t bytes;
    struct drop_record *next;
} drop_record;

struct torchmp_console {
    int mode;
    int fd;                   /* fd kinds: the private fd; -1 once switched off */
    int broken_errno;         /* why it was switched off */
    dev_t dev;                /* identity of the target */
    ino_t ino;
    pthread_mutex_t mu;       /* a queue console is shared with its taker */
    char *buf;                /* backlog: bytes [start, start + len) of buf */
    size_t start, len, cap;
    int dropping;             /* past a bound: drop lines until the backlog empties */
    drop_record *drops;
    int notify_r, notify_w;   /* queue: readable while bytes wait */
    int refs;                 /* atomic: streams, the loop's registry, a Python handle */
};

static void console_destroy(torchmp_console *c);

/* ---- writing without blocking ------------------------------------------ */

/* Write some of buf without waiting: the number of bytes written (0: the
 * console cannot take more now), or -1 with errno when it is broken. */
static ssize_t write_some(torchmp_console *c, const char *buf, size_t len)
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
            if (want > PIPE_BUF)
                want = PIPE_BUF;
            n = write(c->fd, buf + done, want);
            break;
        }
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

static void drops_free(torchmp_console *c)
{
    drop_record *d = c->drops;
    while (d != NULL) {
        drop_record *next = d->next;
        free(d->prefix);
        free(d->log_path);
        free(d);
        d = next;
    }
    c->drops = NULL;
}

/* Switch the console off for good: no more writes, nothing kept.  The fd
 * stays open until the console is freed: the loop may be watching it, and
 * its number must not be reused under that watch. */
static void console_break(torchmp_console *c, int err)
{
    if (c->broken_errno == 0)
        c->broken_errno = err != 0 ? err : EIO;
    c->start = c->len = 0;
    c->dropping = 0;
    drops_free(c);
}

/* ---- the backlog --------------------------------------------------------- */

static int backlog_reserve(torchmp_console *c, size_t more)
{
    size_t need = c->len + more;
    if (c->start > 0 && c->start + need > c->cap) {
        memmove(c->buf, c->buf + c->start, c->len);
        c->start = 0;
    }
    if (need > c->cap) {
        size_t cap = c->cap ? c->cap : 64 * 1024;
        char *grown;
        while (cap < need)
            cap *= 2;
        grown = realloc(c->buf, cap);
        if (grown == NULL)
            return -1;
        c->buf = grown;
        c->cap = cap;
    }
    return 0;
}

static int backlog_append(torchmp_console *c, const char *data, size_t len)
{
    if (len == 0)
        return 0;
    if (backlog_reserve(c, len) != 0)
        return -1;
    memcpy(c->buf + c->start + c->len, data, len);
    c->len += len;
    return 0;
}

/* The backlog emptied: give back a large buffer (a stall once should not
 * cost its memory for the rest of the run). */
static void backlog_emptied(torchmp_console *c)
{
    c->start = 0;
    if (c->cap > 1024 * 1024) {
        free(c->buf);
        c->buf = NULL;
        c->cap = 0;
    }
}

static size_t count_lines(const char *p, size_t len)
{
    size_t n = 0;
    const char *end = p + len;
    while (p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        n++;
        if (nl == NULL)
            break;
        p = nl + 1;
    }
    return n;
}

static void record_drop(torchmp_console *c, const torchmp_console_source *src, const char *data, size_t len)
{
    drop_record *d;
    if (len == 0)
        return;
    for (d = c->drops; d != NULL; d = d->next) {
        if (d->source_id == src->id)
            break;
    }
    if (d == NULL) {
        d = calloc(1, sizeof(*d));
        if (d == NULL)
            return; /* the marker is lost, not the log */
        d->source_id = src->id;
        d->prefix = strndup(src->prefix != NULL ? src->prefix : "", src->prefix_len);
        d->log_path = src->log_path != NULL ? strdup(src->log_path) : NULL;
        if (d->prefix == NULL || (src->log_path != NULL && d->log_path == NULL)) {
            free(d->prefix);
            free(d->log_path);
            free(d);
            return;
        }
        /* Append: markers come out in the order the sources fell behind. */
        {
            drop_record **tail = &c->drops;
            while (*tail != NULL)
                tail = &(*tail)->next;
            *tail = d;
        }
    }
    d->lines += count_lines(data, len);
    d->bytes += len;
}

static void format_size(char *out, size_t cap, uint64_t bytes)
{
    if (bytes >= 10ULL * 1024 * 1024)
        snprintf(out, cap, "%llu MiB", (unsigned long long)(bytes >> 20));
    else if (bytes >= 10ULL * 1024)
        snprintf(out, cap, "%llu KiB", (unsigned long long)(bytes >> 10));
    else
        snprintf(out, cap, "%llu bytes", (unsigned long long)bytes);
}

/* The console caught up after dropping: one marker line per source that
 * lost lines, then back to normal. */
static void append_markers(torchmp_console *c)
{
    for (drop_record *d = c->drops; d != NULL; d = d->next) {
        char size[32];
        char *line = NULL;
        int n;
        format_size(size, sizeof(size), d->bytes);
        if (d->log_path != NULL)
            n = asprintf(&line, "%storchmp: %llu line%s (%s) not shown: the console fell behind; complete log: %s\n",
                         d->prefix, (unsigned long long)d->lines, d->lines == 1 ? "" : "s", size, d->log_path);
        else
            n = asprintf(&line, "%storchmp: %llu line%s (%s) not shown: the console fell behind\n",
                         d->prefix, (unsigned long long)d->lines, d->lines == 1 ? "" : "s", size);
        if (n > 0)
            (void)backlog_append(c, line, (size_t)n);
        if (n >= 0)
            free(line);
    }
    drops_free(c);
    c->dropping = 0;
}

/* Queue lines behind what waits already, whole lines within src's bound;
 * from the first line that does not fit, drop until the backlog empties. */
static void admit_lines(torchmp_console *c, const torchmp_console_source *src, const char *data, size_t len)
{
    if (c->dropping) {
        record_drop(c, src, data, len);
        return;
    }
    if (c->len + len <= src->limit) {
        if (backlog_append(c, data, len) == 0)
            return;
    } else {
        const char *p = data;
        const char *end = data + len;
        while (p < end) {
            const char *nl = memchr(p, '\n', (size_t)(end - p));
            size_t line = nl != NULL ? (size_t)(nl + 1 - p) : (size_t)(end - p);
            if (c->len + line > src->limit || backlog_append(c, p, line) != 0)
                break;
            p += line;
        }
        data = p;
        len = (size_t)(end - p);
        if (len == 0)
            return;
    }
    c->dropping = 1;
    record_drop(c, src, data, len);
}

static void queue_notify(torchmp_console *c)
{
    int saved = errno;
#ifdef TORCHMP_HAVE_EVENTFD
    uint64_t one = 1;
    ssize_t n = write(c->notify_w, &one, sizeof(one));
#else
    char one = 1;
    ssize_t n = write(c->notify_w, &one, 1);
#endif
    (void)n; /* EAGAIN: already readable */
    errno = saved;
}

static void queue_unnotify(torchmp_console *c)
{
    char buf[64];
    while (read(c->notify_r, buf, sizeof(buf)) > 0)
        ;
}

/* ---- public -------------------------------------------------------------- */

static torchmp_console *console_alloc(int mode)
{
    torchmp_console *c = calloc(1, sizeof(*c));
    int rc;
    if (c == NULL)
        return NULL;
    c->refs = 1;
    c->mode = mode;
    c->fd = -1;
    c->notify_r = c->notify_w = -1;
    rc = pthread_mutex_init(&c->mu, NULL);
    if (rc != 0) {
        free(c);
        errno = rc;
        return NULL;
    }
    return c;
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
    c = console_alloc(MODE_PLAIN);
    if (c == NULL)
        return NULL;
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
        console_destroy(c);
        errno = saved;
        return NULL;
    }
    return c;
}

torchmp_console *torchmp_console_new_queue(void)
{
    torchmp_console *c = console_alloc(MODE_QUEUE);
    if (c == NULL)
        return NULL;
#ifdef TORCHMP_HAVE_EVENTFD
    c->notify_r = c->notify_w = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (c->notify_r < 0)
        goto fail;
#else
    {
        int p[2];
        if (torchmp_pipe_cloexec(p) != 0)
            goto fail;
        c->notify_r = p[0];
        c->notify_w = p[1];
        if (fcntl(p[0], F_SETFL, O_NONBLOCK) != 0 || fcntl(p[1], F_SETFL, O_NONBLOCK) != 0)
            goto fail;
    }
#endif
    return c;
fail:
    {
        int saved = errno;
        console_destroy(c);
        errno = saved;
        return NULL;
    }
}

static void console_destroy(torchmp_console *c)
{
    if (c->fd >= 0)
        close(c->fd);
    if (c->notify_w >= 0 && c->notify_w != c->notify_r)
        close(c->notify_w);
    if (c->notify_r >= 0)
        close(c->notify_r);
    drops_free(c);
    free(c->buf);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

int torchmp_console_submit(torchmp_console *c, const torchmp_console_source *src, const char *data, size_t len)
{
    int waiting;
    if (len == 0)
        return c->len > 0;
    pthread_mutex_lock(&c->mu);
    if (c->broken_errno != 0) {
        pthread_mutex_unlock(&c->mu);
        return 0;
    }
    if (c->mode == MODE_QUEUE) {
        int was_idle = c->len == 0 && !c->dropping;
        admit_lines(c, src, data, len);
        if (was_idle && (c->len > 0 || c->dropping))
            queue_notify(c);
    } else if (c->len == 0 && !c->dropping) {
        ssize_t n = write_some(c, data, len);
        if (n < 0) {
            console_break(c, errno);
        } else if ((size_t)n < len) {
            /* The rest of a line that is on the console already must follow
             * it whatever the bound: a torn line is worse than a late one. */
            const char *rest = data + n;
            size_t left = len - (size_t)n;
            if (n > 0 && rest[-1] != '\n') {
                const char *nl = memchr(rest, '\n', left);
                size_t tail = nl != NULL ? (size_t)(nl + 1 - rest) : left;
                if (backlog_append(c, rest, tail) != 0) {
                    console_break(c, ENOMEM);
                    pthread_mutex_unlock(&c->mu);
                    return 0;
                }
                rest += tail;
                left -= tail;
            }
            if (left > 0)
                admit_lines(c, src, rest, left);
        }
    } else {
        admit_lines(c, src, data, len);
    }
    waiting = c->len > 0 || c->dropping;
    pthread_mutex_unlock(&c->mu);
    return waiting;
}

int torchmp_console_pump(torchmp_console *c)
{
    int waiting;
    pthread_mutex_lock(&c->mu);
    if (c->mode == MODE_QUEUE || c->broken_errno != 0) {
        pthread_mutex_unlock(&c->mu);
        return 0;
    }
    for (;;) {
        ssize_t n;
        if (c->len == 0) {
            backlog_emptied(c);
            if (!c->dropping)
                break;
            append_markers(c);
            continue;
        }
        n = write_some(c, c->buf + c->start, c->len);
        if (n < 0) {
            console_break(c, errno);
            break;
        }
        c->start += (size_t)n;
        c->len -= (size_t)n;
        if (c->len > 0)
            break;
    }
    waiting = c->len > 0 || c->dropping;
    pthread_mutex_unlock(&c->mu);
    return waiting;
}

char *torchmp_console_take(torchmp_console *c, size_t *len)
{
    char *out = NULL;
    *len = 0;
    pthread_mutex_lock(&c->mu);
    queue_unnotify(c);
    if (c->len == 0 && c->dropping)
        append_markers(c);
    if (c->len > 0) {
        out = malloc(c->len);
        if (out != NULL) {
            memcpy(out, c->buf + c->start, c->len);
            *len = c->len;
            c->len = 0;
            backlog_emptied(c);
            /* Caught up: the marker lines follow at the next take. */
            if (c->dropping)
                queue_notify(c);
        }
    }
    pthread_mutex_unlock(&c->mu);
    return out;
}

int torchmp_console_notify_fd(const torchmp_console *c)
{
    return c->notify_r;
}

int torchmp_console_fd(const torchmp_console *c)
{
    return c->fd;
}

size_t torchmp_console_pending(torchmp_console *c)
{
    size_t n;
    pthread_mutex_lock(&c->mu);
    n = c->len + (c->dropping ? 1 : 0);
    pthread_mutex_unlock(&c->mu);
    return n;
}

int torchmp_console_broken(torchmp_console *c)
{
    int e;
    pthread_mutex_lock(&c->mu);
    e = c->broken_errno;
    pthread_mutex_unlock(&c->mu);
    return e;
}

int torchmp_console_same_target(const torchmp_console *c, int fd)
{
    struct stat st;
    if (c->mode == MODE_QUEUE || fstat(fd, &st) != 0)
        return 0;
    return st.st_dev == c->dev && st.st_ino == c->ino;
}

torchmp_console *torchmp_console_ref(torchmp_console *c)
{
    __atomic_add_fetch(&c->refs, 1, __ATOMIC_RELAXED);
    return c;
}

void torchmp_console_unref(torchmp_console *c)
{
    if (c != NULL && __atomic_sub_fetch(&c->refs, 1, __ATOMIC_ACQ_REL) == 0)
        console_destroy(c);
}

int torchmp_console_shared(torchmp_console *c)
{
    return __atomic_load_n(&c->refs, __ATOMIC_ACQUIRE) > 1;
}
