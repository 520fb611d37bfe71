/*
 * Console line framing.  Each complete line goes out as prefix + line, and a
 * whole chunk of lines in one write from a scratch buffer; the I/O thread is
 * the only writer, so lines from different ranks never interleave inside a
 * line.  Bytes pass through untouched: no
 * decoding, no re-encoding, NULs and invalid UTF-8 included.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "torchmp.h"

#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/uio.h>
#include <unistd.h>

#ifndef IOV_MAX
#define IOV_MAX 1024
#endif


static int wait_writable(int fd)
{
    struct pollfd p;
    p.fd = fd;
    p.events = POLLOUT;
    p.revents = 0;
    for (;;) {
        int r = poll(&p, 1, -1);
        if (r > 0)
            return 0;
        if (r < 0 && errno != EINTR)
            return -1;
    }
}

int torchmp_write_all(int fd, const char *buf, size_t len)
{
    while (len > 0) {
        ssize_t n = write(fd, buf, len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                /* Someone made the fd non-blocking: wait rather than drop. */
                if (wait_writable(fd) != 0)
                    return -1;
                continue;
            }
            return -1;
        }
        buf += n;
        len -= (size_t)n;
    }
    return 0;
}

/* writev all of iov[0..cnt), resuming after partial writes. */
static int writev_all(int fd, struct iovec *iov, int cnt)
{
    while (cnt > 0) {
        ssize_t n = writev(fd, iov, cnt);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                if (wait_writable(fd) != 0)
                    return -1;
                continue;
            }
            return -1;
        }
        while (cnt > 0 && (size_t)n >= iov->iov_len) {
            n -= (ssize_t)iov->iov_len;
            iov++;
            cnt--;
        }
        if (cnt > 0) {
            iov->iov_base = (char *)iov->iov_base + n;
            iov->iov_len -= (size_t)n;
        }
    }
    return 0;
}

/* Framed lines bound for one fd, assembled in a scratch buffer so that a
 * chunk of many short lines costs one write(), not one iovec pair a line. */
typedef struct {
    char *buf;
    size_t len;
    size_t cap;
    int *fd;          /* shared slot: set to -1 when the sink breaks */
    int *errnum;
} batch;

static void batch_fail(batch *b)
{
    /* EPIPE on a closed console, EBADF, ENOSPC: stop writing to this sink;
     * the log files are written separately and stay complete. */
    if (b->errnum != NULL && *b->errnum == 0)
        *b->errnum = errno;
    *b->fd = -1;
}

static void batch_flush(batch *b)
{
    if (b->len > 0 && b->fd != NULL && *b->fd >= 0 && torchmp_write_all(*b->fd, b->buf, b->len) != 0)
        batch_fail(b);
    b->len = 0;
}

static const char newline = '\n';

static void batch_line(batch *b, const torchmp_framer *f, const char *ts, size_t ts_len, const char *line,
                       size_t len, int add_newline)
{
    size_t need = f->prefix_len + ts_len + len + (add_newline ? 1 : 0);
    if (b->fd == NULL || *b->fd < 0)
        return;
    if (b->len + need > b->cap)
        batch_flush(b);
    if (need > b->cap) {
        /* Longer than the scratch buffer (or there is none): one writev. */
        struct iovec iov[4];
        int cnt = 0;
        if (f->prefix_len > 0) {
            iov[cnt].iov_base = (void *)f->prefix;
            iov[cnt++].iov_len = f->prefix_len;
        }
        if (ts_len > 0) {
            iov[cnt].iov_base = (void *)ts;
            iov[cnt++].iov_len = ts_len;
        }
        iov[cnt].iov_base = (void *)line;
        iov[cnt++].iov_len = len;
        if (add_newline) {
            iov[cnt].iov_base = (void *)&newline;
            iov[cnt++].iov_len = 1;
        }
        if (writev_all(*b->fd, iov, cnt) != 0)
            batch_fail(b);
        return;
    }
    memcpy(b->buf + b->len, f->prefix, f->prefix_len);
    memcpy(b->buf + b->len + f->prefix_len, ts, ts_len);
    memcpy(b->buf + b->len + f->prefix_len + ts_len, line, len);
    if (add_newline)
        b->buf[b->len + need - 1] = '\n';
    b->len += need;
}

static int line_matches(const torchmp_needles *nd, const char *line, size_t len)
{
    for (size_t i = 0; i < nd->count; i++) {
        if (nd->len[i] == 0 || memmem(line, len, nd->data[i], nd->len[i]) != NULL)
            return 1;
    }
    return 0;
}

typedef struct {
    batch console;
    batch filtered;
    const torchmp_needles *needles;
    char ts[40];               /* "2026-11-29T09:54:05.123Z ": lines of one chunk share it */
    size_t ts_len;
} emitter;

static size_t format_timestamp(char *out, size_t cap)
{
    struct timespec now;
    struct tm tm;
    size_t n;
    int wrote;
    if (clock_gettime(CLOCK_REALTIME, &now) != 0 || gmtime_r(&now.tv_sec, &tm) == NULL)
        return 0;
    n = strftime(out, cap, "%Y-%m-%dT%H:%M:%S", &tm);
    if (n == 0)
        return 0;
    wrote = snprintf(out + n, cap - n, ".%03ldZ ", now.tv_nsec / 1000000L);
    if (wrote < 0 || (size_t)wrote >= cap - n)
        return 0;
    return n + (size_t)wrote;
}

static void emitter_init(emitter *e, const torchmp_line_sinks *s)
{
    e->console.buf = s->console_buf;
    e->console.cap = s->console_buf != NULL ? s->scratch_cap : 0;
    e->console.len = 0;
    e->console.fd = s->console_fd;
    e->console.errnum = s->console_errno;
    e->filtered.buf = s->filtered_buf;
    e->filtered.cap = s->filtered_buf != NULL ? s->scratch_cap : 0;
    e->filtered.len = 0;
    e->filtered.fd = s->needles != NULL ? s->filtered_fd : NULL;
    e->ts_len = 0;
    e->filtered.errnum = s->filtered_errno;
    e->needles = s->needles;
}

static void emit(emitter *e, const torchmp_framer *f, const char *line, size_t len, int add_newline)
{
    if (f->timestamps && e->ts_len == 0)
        e->ts_len = format_timestamp(e->ts, sizeof(e->ts));
    batch_line(&e->console, f, e->ts, e->ts_len, line, len, add_newline);
    if (e->needles != NULL && e->filtered.fd != NULL && *e->filtered.fd >= 0 &&
        line_matches(e->needles, line, len))
        batch_line(&e->filtered, f, e->ts, e->ts_len, line, len, add_newline);
}

static void emitter_flush(emitter *e)
{
    batch_flush(&e->console);
    batch_flush(&e->filtered);
}

void torchmp_framer_init(torchmp_framer *f, const char *prefix, size_t prefix_len, size_t max_line)
{
    f->prefix = prefix;
    f->prefix_len = prefix_len;
    f->timestamps = 0;
    f->partial = NULL;
    f->partial_len = 0;
    f->partial_cap = 0;
    f->max_line = max_line > 0 ? max_line : 1;
}

void torchmp_framer_free(torchmp_framer *f)
{
    free(f->partial);
    f->partial = NULL;
    f->partial_len = 0;
    f->partial_cap = 0;
}

static int partial_append(torchmp_framer *f, const char *data, size_t len)
{
    if (f->partial_len + len > f->partial_cap) {
        size_t cap = f->partial_cap ? f->partial_cap : 256;
        char *grown;
        while (cap < f->partial_len + len)
            cap *= 2;
        grown = realloc(f->partial, cap);
        if (grown == NULL)
            return -1;
        f->partial = grown;
        f->partial_cap = cap;
    }
    memcpy(f->partial + f->partial_len, data, len);
    f->partial_len += len;
    return 0;
}

/* One line's content (without its newline) as console lines of at most
 * max_line bytes: a fixed rule, so the console does not depend on where the
 * reads happened to split the stream. */
static void emit_content(emitter *e, const torchmp_framer *f, const char *s, size_t n)
{
    while (n > f->max_line) {
        emit(e, f, s, f->max_line, 1);
        s += f->max_line;
        n -= f->max_line;
    }
    emit(e, f, s, n, 1);
}

/* Add to the unterminated tail; if memory runs out, send the tail and the
 * bytes out as lines of their own rather than lose them. */
static int tail_append(emitter *e, torchmp_framer *f, const char *data, size_t len)
{
    if (partial_append(f, data, len) == 0)
        return 0;
    if (f->partial_len > 0)
        emit(e, f, f->partial, f->partial_len, 1);
    f->partial_len = 0;
    emit_content(e, f, data, len);
    return -1;
}

int torchmp_framer_feed(torchmp_framer *f, const char *data, size_t len, const torchmp_line_sinks *sinks)
{
    emitter e;
    const char *p = data;
    const char *end = data + len;
    int rc = 0;

    emitter_init(&e, sinks);
    if ((e.console.fd == NULL || *e.console.fd < 0) &&
        (e.filtered.fd == NULL || *e.filtered.fd < 0)) {
        f->partial_len = 0; /* nobody reads the framed form */
        return 0;
    }

    /* Invariant: the tail never holds more than max_line bytes. */
    while (p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        size_t seg;
        if (nl == NULL)
            break;
        seg = (size_t)(nl - p);
        if (f->partial_len == 0) {
            emit_content(&e, f, p, seg);
        } else if (f->partial_len + seg <= f->max_line) {
            /* The line started in an earlier chunk: complete it in the tail
             * buffer so it is one contiguous piece (filters need that). */
            if (tail_append(&e, f, p, seg) == 0)
                emit(&e, f, f->partial, f->partial_len, 1);
            else
                rc = -1;
            f->partial_len = 0;
        } else {
            size_t fill = f->max_line - f->partial_len;
            if (tail_append(&e, f, p, fill) == 0) {
                emit(&e, f, f->partial, f->partial_len, 1);
                emit_content(&e, f, p + fill, seg - fill);
            } else {
                emit_content(&e, f, p + fill, seg - fill);
                rc = -1;
            }
            f->partial_len = 0;
        }
        p = nl + 1;
    }

    if (p < end) {
        size_t rest = (size_t)(end - p);
        if (f->partial_len + rest > f->max_line) {
            /* Full pieces go out as soon as more bytes follow them. */
            size_t fill = f->max_line - f->partial_len;
            if (tail_append(&e, f, p, fill) == 0)
                emit(&e, f, f->partial, f->partial_len, 1);
            else
                rc = -1;
            f->partial_len = 0;
            p += fill;
            rest -= fill;
            while (rest > f->max_line) {
                emit(&e, f, p, f->max_line, 1);
                p += f->max_line;
                rest -= f->max_line;
            }
        }
        if (rest > 0 && tail_append(&e, f, p, rest) != 0)
            rc = -1;
    }
    emitter_flush(&e);
    if (rc != 0)
        errno = ENOMEM;
    return rc;
}

void torchmp_framer_flush(torchmp_framer *f, const torchmp_line_sinks *sinks)
{
    emitter e;
    if (f->partial_len == 0)
        return;
    emitter_init(&e, sinks);
    emit(&e, f, f->partial, f->partial_len, 1);
    emitter_flush(&e);
    f->partial_len = 0;
}
