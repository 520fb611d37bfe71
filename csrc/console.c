/*
 * Consoles: where teed lines are shown, decoupled from the I/O thread.
 *
 * Why: the I/O thread drains every rank's pipes and writes every log file.  A
 * console write that blocks (a pipe nobody reads, a terminal stopped with
 * ^S, a stalled log shipper) would stop all of that, and with it the workers
 * (their pipes fill) and exit detection.  So a console is never written with
 * a call that can block.  What it cannot take now waits in a backlog, bounded
 * per source.  A source whose log file is complete does not lose lines past
 * the bound: the loop stops giving it lines and later catches it up from its
 * log (loop_consoles.c), so this file only keeps count of those bytes
 * (`behind`).  Other sources (no log file) have whole lines dropped from the
 * console past the bound and, once the console has caught up, one marker
 * line per source says how many (and where the complete log is, if any).
 *
 * Progress: a console that takes no byte for the stall time while something
 * waits for it is stalled.  When it takes bytes again, `resumed` tells the
 * loop to leave out (with a marker) the lines it had not given it yet.
 *
 * Kinds (how each reaches its target: console_target.c):
 *   fd     the launcher's fd 1 or 2 (or whatever file they refer to).  One
 *          console per target, found by identity (st_dev, st_ino): stdout and
 *          stderr on the same pipe share a backlog, so the remainder of a
 *          partly written line always goes out before anything else.
 *   queue  bytes for somebody else to take (a Python object such as a
 *          notebook's sys.stdout).  No fd: the taker sleeps on one
 *          process-wide condition (torchmp_queues_wait) that every queue
 *          console posts when bytes start to wait.
 *
 * A console whose writes fail for good (EPIPE: the reader is gone; EIO: the
 * terminal hung up; ENOSPC: a full file system) is switched off; nothing
 * else changes.  Failures other than a reader gone are kept for Python to
 * say once (torchmp_console_failure).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "console_internal.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* No progress for this long while bytes wait: the console is stalled. */
static int64_t stall_ns = 10LL * 1000 * 1000 * 1000;

/* Why the launcher's fd 1 / fd 2 consoles were switched off, when it was not
 * their reader going away; read (and cleared) by Python. */
static int std_failures[3];

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int waiting(const torchmp_console *c)
{
    return c->len > 0 || c->dropping || c->behind > 0;
}

/* Call with what waiting() was before bytes were queued or held back. */
static void note_waiting(torchmp_console *c, int was_waiting)
{
    if (!was_waiting && waiting(c))
        c->progress_ns = now_ns();
}

/* The target took n bytes; was_waiting: bytes were waiting for it before. */
static void note_shown(torchmp_console *c, size_t n, int was_waiting)
{
    int64_t now;
    if (n == 0)
        return;
    now = now_ns();
    /* Only lines held back can be left out: a stall matters to them. */
    if (was_waiting && c->behind > 0 && c->progress_ns != 0 && torchmp_consoles_stall() > 0 &&
        now - c->progress_ns >= torchmp_consoles_stall())
        c->resumed = 1;
    c->progress_ns = now;
    c->shown += n;
}

/* ---- writing without blocking ------------------------------------------ */

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

int torchmp_console_gone(int err)
{
    return err == EPIPE || err == EIO;
}

/* Switch the console off for good: no more writes, nothing kept.  The fd
 * stays open until the console is freed: the loop may be watching it, and
 * its number must not be reused under that watch. */
static void console_break(torchmp_console *c, int err)
{
    if (c->broken_errno == 0) {
        c->broken_errno = err != 0 ? err : EIO;
        if ((c->std_fd == 1 || c->std_fd == 2) && !torchmp_console_gone(c->broken_errno))
            __atomic_store_n(&std_failures[c->std_fd], c->broken_errno, __ATOMIC_RELAXED);
    }
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
        size_t cap = c->cap ? c->cap : c->cap_hint ? c->cap_hint : 64 * 1024;
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

static void record_drop(torchmp_console *c, const torchmp_console_source *src, uint64_t lines, uint64_t bytes)
{
    drop_record *d;
    if (bytes == 0)
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
    d->lines += lines;
    d->bytes += bytes;
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

/* One marker line into the backlog: how many lines of a source are not
 * shown, and where the complete log is. */
static void append_marker(torchmp_console *c, const char *prefix, size_t prefix_len, const char *log_path,
                          uint64_t lines, uint64_t bytes)
{
    char size[32];
    char *line = NULL;
    int n;
    format_size(size, sizeof(size), bytes);
    n = asprintf(&line, "%.*storchmp: %llu line%s (%s) not shown: the console fell behind%s%s\n", (int)prefix_len,
                 prefix != NULL ? prefix : "", (unsigned long long)lines, lines == 1 ? "" : "s", size,
                 log_path != NULL ? "; complete log: " : "", log_path != NULL ? log_path : "");
    if (n > 0)
        (void)backlog_append(c, line, (size_t)n);
    if (n >= 0)
        free(line);
}

/* The console caught up after dropping: one marker line per source that
 * lost lines, then back to normal. */
static void append_markers(torchmp_console *c)
{
    for (drop_record *d = c->drops; d != NULL; d = d->next)
        append_marker(c, d->prefix, strlen(d->prefix), d->log_path, d->lines, d->bytes);
    drops_free(c);
    c->dropping = 0;
}

/* Queue lines behind what waits already, whole lines within src's bound;
 * from the first line that does not fit, drop until the backlog empties.
 * A source the loop bounds itself (its log is the backlog) is queued whole. */
static void admit_lines(torchmp_console *c, const torchmp_console_source *src, const char *data, size_t len)
{
    if (c->dropping) {
        record_drop(c, src, count_lines(data, len), len);
        return;
    }
    if (src->bounded_by_caller || c->len + len <= src->limit) {
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
    record_drop(c, src, count_lines(data, len), len);
}

/* ---- public -------------------------------------------------------------- */

torchmp_console *torchmp_console_alloc(int mode)
{
    torchmp_console *c = calloc(1, sizeof(*c));
    int rc;
    if (c == NULL)
        return NULL;
    c->refs = 1;
    c->mode = mode;
    c->fd = -1;
    c->wake_fd = -1;
    rc = pthread_mutex_init(&c->mu, NULL);
    if (rc != 0) {
        free(c);
        errno = rc;
        return NULL;
    }
    return c;
}

torchmp_console *torchmp_console_new_queue(void)
{
    return torchmp_console_alloc(MODE_QUEUE);
}

void torchmp_console_destroy(torchmp_console *c)
{
    if (c->fd >= 0)
        close(c->fd);
    drops_free(c);
    free(c->buf);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

/* A queue console has bytes for its taker now (it had none before). */
static void queue_became_ready(torchmp_console *c, int was_ready)
{
    if (!was_ready && (c->len > 0 || c->dropping))
        torchmp_queues_post();
}

int torchmp_console_submit(torchmp_console *c, const torchmp_console_source *src, const char *data, size_t len)
{
    int was_waiting, still;
    pthread_mutex_lock(&c->mu);
    if (len == 0 || c->broken_errno != 0) {
        still = waiting(c);
        pthread_mutex_unlock(&c->mu);
        return still;
    }
    was_waiting = waiting(c);
    if (c->mode == MODE_QUEUE) {
        int was_ready = c->len > 0 || c->dropping;
        admit_lines(c, src, data, len);
        queue_became_ready(c, was_ready);
    } else if (c->len == 0 && !c->dropping) {
        ssize_t n = torchmp_console_write_some(c, data, len);
        if (n < 0) {
            console_break(c, errno);
        } else {
            note_shown(c, (size_t)n, was_waiting);
            if ((size_t)n < len) {
                /* The rest of a line that is on the console already must
                 * follow it whatever the bound: a torn line is worse than a
                 * late one. */
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
        }
    } else {
        admit_lines(c, src, data, len);
    }
    note_waiting(c, was_waiting);
    still = waiting(c);
    pthread_mutex_unlock(&c->mu);
    return still;
}

int torchmp_console_pump(torchmp_console *c)
{
    int still;
    pthread_mutex_lock(&c->mu);
    if (c->mode == MODE_QUEUE || c->broken_errno != 0) {
        still = c->broken_errno == 0 && waiting(c);
        pthread_mutex_unlock(&c->mu);
        return still;
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
        n = torchmp_console_write_some(c, c->buf + c->start, c->len);
        if (n < 0) {
            console_break(c, errno);
            break;
        }
        note_shown(c, (size_t)n, 1);
        c->start += (size_t)n;
        c->len -= (size_t)n;
        if (c->len > 0)
            break;
    }
    /* Bytes held back for the loop to give (behind) count as waiting for
     * the caller's accounting, but not for the fd's writability: 1 only
     * while the backlog has bytes the fd did not take. */
    still = c->broken_errno == 0 && (c->len > 0 || c->dropping);
    pthread_mutex_unlock(&c->mu);
    return still;
}

char *torchmp_console_take(torchmp_console *c, size_t *len)
{
    char *out = NULL;
    int ask_more = 0;
    *len = 0;
    pthread_mutex_lock(&c->mu);
    if (c->len == 0 && c->dropping)
        append_markers(c);
    if (c->len > 0) {
        /* The backlog itself is handed over (no copy); the next one starts
         * at the size this one reached. */
        if (c->start > 0)
            memmove(c->buf, c->buf + c->start, c->len);
        out = c->buf;
        *len = c->len;
        note_shown(c, c->len, 1);
        c->cap_hint = c->cap;
        c->buf = NULL;
        c->cap = c->start = c->len = 0;
        /* Caught up: the marker lines follow at the next take. */
        if (c->dropping)
            torchmp_queues_post();
        ask_more = c->behind > 0 && c->wake_fd >= 0;
    }
    pthread_mutex_unlock(&c->mu);
    if (ask_more)
        torchmp_loop_notify_post(c->wake_fd); /* the loop refills from the logs */
    return out;
}

size_t torchmp_console_room(torchmp_console *c, size_t limit)
{
    size_t room;
    pthread_mutex_lock(&c->mu);
    if (c->broken_errno != 0)
        room = SIZE_MAX; /* whatever is given is dropped at once */
    else if (c->dropping)
        room = 0;        /* the markers of other sources first */
    else
        room = c->len < limit ? limit - c->len : 0;
    pthread_mutex_unlock(&c->mu);
    return room;
}

void torchmp_console_hold(torchmp_console *c, int64_t delta, int wake_fd)
{
    int was_waiting;
    pthread_mutex_lock(&c->mu);
    was_waiting = waiting(c);
    if (delta < 0 && (uint64_t)(-delta) > c->behind)
        c->behind = 0;
    else
        c->behind += (uint64_t)delta;
    if (c->behind == 0)
        c->resumed = 0; /* nothing held back is left to leave out */
    if (wake_fd >= 0)
        c->wake_fd = wake_fd;
    note_waiting(c, was_waiting);
    pthread_mutex_unlock(&c->mu);
}

int torchmp_console_take_resumed(torchmp_console *c)
{
    int r;
    pthread_mutex_lock(&c->mu);
    r = c->resumed;
    c->resumed = 0;
    pthread_mutex_unlock(&c->mu);
    return r;
}

void torchmp_console_skipped(torchmp_console *c, const torchmp_console_source *src, uint64_t lines, uint64_t bytes)
{
    int was_ready;
    if (bytes == 0)
        return;
    pthread_mutex_lock(&c->mu);
    if (c->broken_errno == 0) {
        was_ready = c->len > 0 || c->dropping;
        append_marker(c, src->prefix, src->prefix_len, src->log_path, lines, bytes);
        if (c->mode == MODE_QUEUE)
            queue_became_ready(c, was_ready);
    }
    pthread_mutex_unlock(&c->mu);
}

int torchmp_console_fd(const torchmp_console *c)
{
    return c->fd;
}

size_t torchmp_console_pending(torchmp_console *c)
{
    size_t n;
    pthread_mutex_lock(&c->mu);
    n = c->broken_errno != 0 ? 0 : c->len + (size_t)c->behind + (c->dropping ? 1 : 0);
    pthread_mutex_unlock(&c->mu);
    return n;
}

uint64_t torchmp_console_shown(torchmp_console *c)
{
    uint64_t n;
    pthread_mutex_lock(&c->mu);
    n = c->shown;
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

int torchmp_console_is_queue(const torchmp_console *c)
{
    return c->mode == MODE_QUEUE;
}

void torchmp_consoles_set_stall(int64_t ns)
{
    __atomic_store_n(&stall_ns, ns, __ATOMIC_RELAXED);
}

int64_t torchmp_consoles_stall(void)
{
    return __atomic_load_n(&stall_ns, __ATOMIC_RELAXED);
}

int torchmp_console_failure(int std_fd)
{
    if (std_fd != 1 && std_fd != 2)
        return 0;
    return __atomic_exchange_n(&std_failures[std_fd], 0, __ATOMIC_RELAXED);
}

torchmp_console *torchmp_console_ref(torchmp_console *c)
{
    __atomic_add_fetch(&c->refs, 1, __ATOMIC_RELAXED);
    return c;
}

void torchmp_console_unref(torchmp_console *c)
{
    if (c != NULL && __atomic_sub_fetch(&c->refs, 1, __ATOMIC_ACQ_REL) == 0)
        torchmp_console_destroy(c);
}

int torchmp_console_shared(torchmp_console *c)
{
    return __atomic_load_n(&c->refs, __ATOMIC_ACQUIRE) > 1;
}
