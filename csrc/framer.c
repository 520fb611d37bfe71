/*
 * Console line framing (the rules are in torchmp.h).  Each line goes out as
 * prefix + line + newline, a chunk of lines as one piece assembled in a
 * scratch buffer, to a console (console.c), which takes whole lines only, so
 * lines from different ranks never interleave inside a line.  Bytes pass
 * through untouched: no decoding, no re-encoding, NULs and invalid UTF-8
 * included; only what a carriage return overwrites is left out.
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

/* Framed lines bound for one sink, assembled in a scratch buffer so that a
 * chunk of many short lines costs one write, not one a line. */
typedef struct {
    char *buf;
    size_t len;
    size_t cap;
} batch;

typedef struct {
    batch console;
    batch filtered;
    torchmp_line_sinks *sinks;
    char ts[40];               /* "2026-11-29T09:54:05.123Z ": lines of one chunk share it */
    size_t ts_len;
} emitter;

static void console_submit(emitter *e, const char *buf, size_t len)
{
    torchmp_line_sinks *s = e->sinks;
    if (torchmp_console_submit(s->console, s->source, buf, len))
        s->console_waiting = 1;
}

static void filtered_write(emitter *e, const char *buf, size_t len)
{
    torchmp_line_sinks *s = e->sinks;
    if (torchmp_write_all(*s->filtered_fd, buf, len) != 0) {
        /* ENOSPC and friends: stop writing the filtered copy; the log files
         * are written separately and stay complete. */
        if (s->filtered_errno != NULL && *s->filtered_errno == 0)
            *s->filtered_errno = errno;
        close(*s->filtered_fd);
        *s->filtered_fd = -1;
    }
}

static int console_on(const emitter *e)
{
    return e->sinks->console != NULL;
}

static int filtered_on(const emitter *e)
{
    const torchmp_line_sinks *s = e->sinks;
    return s->filters != NULL && s->filtered_fd != NULL && *s->filtered_fd >= 0;
}

static void emitter_flush(emitter *e)
{
    if (e->console.len > 0 && console_on(e))
        console_submit(e, e->console.buf, e->console.len);
    e->console.len = 0;
    if (e->filtered.len > 0 && filtered_on(e))
        filtered_write(e, e->filtered.buf, e->filtered.len);
    e->filtered.len = 0;
}

static const char newline = '\n';

/* prefix + timestamp + line + newline into one place. */
static void line_copy(char *out, const torchmp_framer *f, const emitter *e, const char *line, size_t len)
{
    memcpy(out, f->prefix, f->prefix_len);
    memcpy(out + f->prefix_len, e->ts, e->ts_len);
    memcpy(out + f->prefix_len + e->ts_len, line, len);
    out[f->prefix_len + e->ts_len + len] = newline;
}

static void batch_line(emitter *e, batch *b, int is_console, const torchmp_framer *f, const char *line, size_t len)
{
    size_t need = f->prefix_len + e->ts_len + len + 1;
    if (b->len + need > b->cap)
        emitter_flush(e);
    if (need > b->cap) {
        /* Longer than the scratch buffer: a piece of its own, still whole. */
        char *own = malloc(need);
        if (own == NULL)
            return; /* the console misses a line; the log file has it */
        line_copy(own, f, e, line, len);
        if (is_console)
            console_submit(e, own, need);
        else if (filtered_on(e))
            filtered_write(e, own, need);
        free(own);
        return;
    }
    line_copy(b->buf + b->len, f, e, line, len);
    b->len += need;
}

static int line_matches(const torchmp_filters *filters, const char *line, size_t len)
{
    for (size_t i = 0; i < filters->count; i++) {
        if (filters->len[i] == 0 || memmem(line, len, filters->data[i], filters->len[i]) != NULL)
            return 1;
    }
    return 0;
}

/* realtime_ns: when the line arrived (0: now). */
static size_t format_timestamp(char *out, size_t cap, int64_t realtime_ns)
{
    struct timespec now;
    struct tm tm;
    size_t n;
    int wrote;
    if (realtime_ns > 0) {
        now.tv_sec = (time_t)(realtime_ns / 1000000000LL);
        now.tv_nsec = (long)(realtime_ns % 1000000000LL);
    } else if (clock_gettime(CLOCK_REALTIME, &now) != 0) {
        return 0;
    }
    if (gmtime_r(&now.tv_sec, &tm) == NULL)
        return 0;
    n = strftime(out, cap, "%Y-%m-%dT%H:%M:%S", &tm);
    if (n == 0)
        return 0;
    wrote = snprintf(out + n, cap - n, ".%03ldZ ", now.tv_nsec / 1000000L);
    if (wrote < 0 || (size_t)wrote >= cap - n)
        return 0;
    return n + (size_t)wrote;
}

static void emitter_init(emitter *e, torchmp_line_sinks *s)
{
    e->sinks = s;
    e->console.buf = s->console_buf;
    e->console.cap = s->console_buf != NULL ? s->scratch_cap : 0;
    e->console.len = 0;
    e->filtered.buf = s->filtered_buf;
    e->filtered.cap = s->filtered_buf != NULL ? s->scratch_cap : 0;
    e->filtered.len = 0;
    e->ts_len = 0;
}

static void emit(emitter *e, const torchmp_framer *f, const char *line, size_t len)
{
    if (f->timestamps && e->ts_len == 0)
        e->ts_len = format_timestamp(e->ts, sizeof(e->ts), e->sinks->realtime_ns);
    if (console_on(e))
        batch_line(e, &e->console, 1, f, line, len);
    if (filtered_on(e) && line_matches(e->sinks->filters, line, len))
        batch_line(e, &e->filtered, 0, f, line, len);
}

void torchmp_framer_init(torchmp_framer *f, const char *prefix, size_t prefix_len, size_t max_line)
{
    memset(f, 0, sizeof(*f));
    f->prefix = prefix;
    f->prefix_len = prefix_len;
    f->max_line = max_line > 0 ? max_line : 1;
}

void torchmp_framer_free(torchmp_framer *f)
{
    free(f->partial);
    f->partial = NULL;
    f->partial_len = 0;
    f->partial_cap = 0;
}

static void tail_clear(torchmp_framer *f)
{
    f->partial_len = 0;
    f->piece_len = 0;
    f->partial_since_ns = 0;
    f->progress = 0;
    f->progress_dirty = 0;
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

/* End of the bytes that count for what a piece shows: a run of trailing
 * carriage returns (a CRLF line end) overwrites nothing. */
static size_t shown_end(const char *s, size_t n)
{
    while (n > 0 && s[n - 1] == '\r')
        n--;
    return n;
}

/* What a terminal shows of a piece: what follows its last carriage return
 * that something follows. */
static const char *overwritten_start(const char *s, size_t n)
{
    size_t end = shown_end(s, n);
    const char *cr = end > 0 ? memrchr(s, '\r', end) : NULL;
    return cr != NULL ? cr + 1 : s;
}

static void emit_piece(emitter *e, const torchmp_framer *f, const char *s, size_t n, int has_cr)
{
    if (has_cr) {
        const char *start = overwritten_start(s, n);
        n -= (size_t)(start - s);
        s = start;
    }
    emit(e, f, s, n);
}

/* A complete line straight from the chunk: pieces of max_line bytes (a
 * fixed rule, so the console does not depend on where the reads split the
 * stream), each as a terminal would show it. */
static void emit_line(emitter *e, const torchmp_framer *f, const char *s, size_t n, int has_cr)
{
    while (n > f->max_line) {
        emit_piece(e, f, s, f->max_line, has_cr);
        s += f->max_line;
        n -= f->max_line;
    }
    emit_piece(e, f, s, n, has_cr);
}

/* The current piece (the tail) is complete. */
static void tail_emit(emitter *e, torchmp_framer *f)
{
    emit_piece(e, f, f->partial, f->partial_len, 1);
    tail_clear(f);
}

/* A progress tail keeps only its current state: from its last carriage
 * return that something follows.  Whether it has one: *is_progress. */
static void progress_trim(torchmp_framer *f)
{
    const char *start = overwritten_start(f->partial, f->partial_len);
    if (start > f->partial) {
        size_t cut = (size_t)(start - f->partial) - 1; /* keep the \r itself */
        memmove(f->partial, f->partial + cut, f->partial_len - cut);
        f->partial_len -= cut;
        f->progress = 1;
    }
}

/* Bytes of the current line, no newline among them: into the tail, a
 * piece of max_line raw bytes at a time. */
static int tail_add(emitter *e, torchmp_framer *f, const char *p, size_t n, int64_t now_ns, int has_cr)
{
    int rc = 0;
    while (n > 0) {
        size_t take;
        if (f->piece_len == f->max_line)
            tail_emit(e, f); /* full, and more bytes follow */
        take = f->max_line - f->piece_len;
        if (take > n)
            take = n;
        if (f->piece_len == 0)
            f->partial_since_ns = now_ns;
        if (partial_append(f, p, take) != 0) {
            /* No memory: show what there is rather than lose it. */
            if (f->partial_len > 0)
                emit(e, f, f->partial, f->partial_len);
            emit(e, f, p, take);
            tail_clear(f);
            rc = -1;
        } else {
            f->piece_len += take;
            if (shown_end(p, take) > 0)
                f->progress_dirty = 1;
            if (has_cr)
                progress_trim(f);
        }
        p += take;
        n -= take;
    }
    return rc;
}

/* The current state of a progress tail: after its last carriage return,
 * without the trailing ones. */
static void progress_state(const torchmp_framer *f, const char **out, size_t *n)
{
    size_t end = shown_end(f->partial, f->partial_len);
    *out = overwritten_start(f->partial, f->partial_len);
    *n = end - (size_t)(*out - f->partial);
}

static uint64_t state_hash(const char *s, size_t n)
{
    uint64_t h = 1469598103934665603ULL; /* FNV-1a */
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= 1099511628211ULL;
    }
    return h ^ (uint64_t)n;
}

/* Whether the progress state of the tail is the one on the console already
 * (a bar redrawn unchanged, as tqdm does before its newline). */
static int state_on_console(const torchmp_framer *f)
{
    const char *state;
    size_t n;
    if (!f->progress || !f->shown_valid)
        return 0;
    progress_state(f, &state, &n);
    return state_hash(state, n) == f->shown_hash;
}

static void show_due(emitter *e, torchmp_framer *f, int64_t now_ns)
{
    if (f->partial_len == 0 || now_ns - f->partial_since_ns < TORCHMP_PARTIAL_IDLE_NS)
        return;
    if (!f->progress && f->partial[f->partial_len - 1] == '\r') {
        /* No newline followed the carriage return in time: not a CRLF but a
         * bar that ends its updates with \r ("10%\r", "20%\r"). */
        f->progress = 1;
        f->progress_dirty = 1;
    }
    if (f->progress) {
        const char *state;
        size_t n;
        if (!f->progress_dirty)
            return;
        if (f->progress_shown_ns != 0 && now_ns - f->progress_shown_ns < TORCHMP_PROGRESS_INTERVAL_NS)
            return;
        progress_state(f, &state, &n);
        if (n > 0 && !state_on_console(f)) {
            emit(e, f, state, n);
            f->progress_shown_ns = now_ns;
            f->shown_hash = state_hash(state, n);
            f->shown_valid = 1;
        }
        f->progress_dirty = 0;
    } else {
        /* A partial line: shown now, its continuation on a line of its own. */
        tail_emit(e, f);
        f->continued = 1;
    }
}

static void set_deadline(torchmp_framer *f)
{
    int64_t d;
    if (f->partial_len == 0 || (f->progress && !f->progress_dirty)) {
        f->deadline_ns = 0;
        return;
    }
    d = f->partial_since_ns + TORCHMP_PARTIAL_IDLE_NS;
    if (f->progress && f->progress_shown_ns != 0 && f->progress_shown_ns + TORCHMP_PROGRESS_INTERVAL_NS > d)
        d = f->progress_shown_ns + TORCHMP_PROGRESS_INTERVAL_NS;
    f->deadline_ns = d;
}

int torchmp_framer_feed(torchmp_framer *f, const char *data, size_t len, int64_t now_ns, torchmp_line_sinks *sinks)
{
    emitter e;
    const char *p = data;
    const char *end = data + len;
    int rc = 0;
    int has_cr;

    emitter_init(&e, sinks);
    if (!console_on(&e) && !filtered_on(&e)) {
        tail_clear(f); /* nobody reads the framed form */
        f->deadline_ns = 0;
        return 0;
    }
    /* Carriage returns are rare: without one in sight the rules are plain. */
    has_cr = memchr(data, '\r', len) != NULL || (f->partial_len > 0 && f->partial[f->partial_len - 1] == '\r');

    while (p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        if (nl == NULL) {
            if (tail_add(&e, f, p, (size_t)(end - p), now_ns, has_cr) != 0)
                rc = -1;
            break;
        }
        if (f->piece_len == 0) {
            /* A newline alone after a partial line that is on the console
             * already ends that line: no empty line for it. */
            if (!f->continued || shown_end(p, (size_t)(nl - p)) > 0)
                emit_line(&e, f, p, (size_t)(nl - p), has_cr);
        } else {
            /* The line started in an earlier chunk: complete it in the tail
             * buffer so each piece is contiguous (filters need that). */
            if (tail_add(&e, f, p, (size_t)(nl - p), now_ns, has_cr) != 0)
                rc = -1;
            /* A progress bar whose final state is on the console already is
             * not shown twice. */
            if (f->piece_len > 0 && !state_on_console(f))
                tail_emit(&e, f);
        }
        tail_clear(f);
        f->continued = 0;
        f->shown_valid = 0;
        p = nl + 1;
    }
    if (!sinks->mid_write)
        show_due(&e, f, now_ns);
    set_deadline(f);
    emitter_flush(&e);
    if (rc != 0)
        errno = ENOMEM;
    return rc;
}

void torchmp_framer_tick(torchmp_framer *f, int64_t now_ns, torchmp_line_sinks *sinks)
{
    emitter e;
    emitter_init(&e, sinks);
    if (!console_on(&e) && !filtered_on(&e)) {
        tail_clear(f);
    } else {
        show_due(&e, f, now_ns);
        emitter_flush(&e);
    }
    set_deadline(f);
}

void torchmp_framer_discard(torchmp_framer *f)
{
    tail_clear(f);
    f->continued = 0;
    f->shown_valid = 0;
    f->deadline_ns = 0;
}

void torchmp_framer_flush(torchmp_framer *f, torchmp_line_sinks *sinks)
{
    emitter e;
    emitter_init(&e, sinks);
    if (f->piece_len > 0 && (console_on(&e) || filtered_on(&e))) {
        if (!state_on_console(f))
            tail_emit(&e, f);
        emitter_flush(&e);
    }
    tail_clear(f);
    f->continued = 0;
    f->shown_valid = 0;
    f->deadline_ns = 0;
}
