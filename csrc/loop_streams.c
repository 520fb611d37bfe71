/*
 * The loop's streams: a worker's stdout/stderr teed from a pipe into its log
 * file, its console (a feed: loop_consoles.c) and the filtered copy (framed
 * lines, framer.c), or its return channel read into memory; the last bytes
 * kept for failure reports.  Loop thread, except what `mu` guards for
 * Python.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "loop_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- streams ------------------------------------------------------------ */

/* The earliest deadline of the stream's framers (0: none). */
static int64_t stream_deadline(const stream *s)
{
    int64_t d = s->framer.deadline_ns;
    int64_t c = s->feed != NULL ? torchmp_loop_feed_deadline(s->feed) : 0;
    if (d == 0 || (c != 0 && c < d))
        d = c;
    return d;
}

#define LINK(list, s) ((stream_link *)((char *)(s) + (list)->link))

void torchmp_stream_list_append(stream_list *list, stream *s)
{
    stream_link *link = LINK(list, s);
    if (link->on)
        return;
    link->on = 1;
    link->next = NULL;
    link->prev = list->tail;
    if (list->tail != NULL)
        LINK(list, list->tail)->next = s;
    else
        list->head = s;
    list->tail = s;
}

void torchmp_stream_list_remove(stream_list *list, stream *s)
{
    stream_link *link = LINK(list, s);
    if (!link->on)
        return;
    if (link->prev != NULL)
        LINK(list, link->prev)->next = link->next;
    else
        list->head = link->next;
    if (link->next != NULL)
        LINK(list, link->next)->prev = link->prev;
    else
        list->tail = link->prev;
    link->on = 0;
    link->prev = link->next = NULL;
}

void torchmp_loop_stream_rearm(torchmp_loop *L, stream *s)
{
    int64_t d = stream_deadline(s);
    if (d == 0) {
        torchmp_stream_list_remove(&L->timed, s);
        return;
    }
    torchmp_stream_list_append(&L->timed, s);
    if (L->next_deadline_ns == 0 || d < L->next_deadline_ns)
        L->next_deadline_ns = d;
}

/* The filtered copy's framing (console: none, that is the feed's). */
static int filtered(const stream *s)
{
    return s->proc->group->has_filters[s->which] && s->proc->group->filtered_fd[s->which] >= 0;
}

static torchmp_line_sinks filtered_sinks(stream *s)
{
    torchmp_group *g = s->proc->group;
    torchmp_line_sinks sinks;
    memset(&sinks, 0, sizeof(sinks));
    sinks.filtered_buf = g->loop->filtered_scratch;
    sinks.scratch_cap = SCRATCH_SIZE;
    sinks.filtered_fd = &g->filtered_fd[s->which];
    sinks.filtered_errno = &g->filtered_errno[s->which];
    sinks.filters = &g->filters[s->which];
    return sinks;
}

static void ret_append(torchmp_loop *L, stream *s, const char *data, size_t len)
{
    pthread_mutex_lock(&L->mu);
    if (s->ret_errno == 0 && s->ret_len + len > s->ret_cap) {
        size_t cap = s->ret_cap ? s->ret_cap : 4096;
        char *grown;
        while (cap < s->ret_len + len)
            cap *= 2;
        grown = realloc(s->ret_buf, cap);
        if (grown == NULL) {
            s->ret_errno = ENOMEM; /* Python reports a return value that did not fit */
        } else {
            s->ret_buf = grown;
            s->ret_cap = cap;
        }
    }
    if (s->ret_errno == 0) {
        memcpy(s->ret_buf + s->ret_len, data, len);
        s->ret_len += len;
    }
    pthread_mutex_unlock(&L->mu);
}

/* Keep the last tail_cap bytes: a failed rank's last words for its report,
 * without reading the log file back.  Caller holds mu. */
static void tail_append_locked(stream *s, const char *data, size_t len)
{
    size_t first;
    if (len >= s->tail_cap) {
        memcpy(s->tail, data + (len - s->tail_cap), s->tail_cap);
        s->tail_len = s->tail_cap;
        s->tail_end = 0;
        return;
    }
    first = s->tail_cap - s->tail_end;
    if (first > len)
        first = len;
    memcpy(s->tail + s->tail_end, data, first);
    memcpy(s->tail, data + first, len - first);
    s->tail_end = (s->tail_end + len) % s->tail_cap;
    s->tail_len = s->tail_len + len > s->tail_cap ? s->tail_cap : s->tail_len + len;
}

/* A pipe shows a reader part of one write() only once the write has filled
 * it: the kernel copies a write under the pipe's lock and lets go of the
 * lock only to wait for room.  A writer stopped there (SIGSTOP, a debugger)
 * or starved of CPU on a loaded machine has the first part of its line read
 * and the rest still to write.  So a read that emptied a full pipe may end
 * inside a write. */
static int pipe_mid_write(const stream *s, uint64_t *at)
{
    *at = s->pipe_read;
    return s->pipe_last_read_full;
}

/* Whether the bytes of s read so far may end inside a write under way;
 * *at: where. */
static int stream_mid_write(const stream *s, uint64_t *at)
{
    return s->following ? torchmp_loop_follow_mid_write(s, at) : pipe_mid_write(s, at);
}

/* Whether a read of n bytes emptied a full pipe: within an eighth of its
 * capacity, at least a page (a page of each write may be part full,
 * and small writes each take a page).  Only reads of a page or more can be:
 * the capacity is asked for then (a user over its pipe pages gets two-page
 * pipes; a worker may set it) and kept (stream_maybe_grow keeps it up to
 * date). */
static int pipe_read_was_full(stream *s, size_t n)
{
    /* The first read after the pipe grew may hold bytes the writer put in
     * before, filling it at its old size; later reads are of the new. */
    size_t size = s->pipe_size, margin;
    if (s->pipe_size_next != 0) {
        s->pipe_size = s->pipe_size_next;
        s->pipe_size_next = 0;
    }
    if (n < 4096)
        return 0;
    if (size == 0) {
#ifdef F_GETPIPE_SZ
        int asked = fcntl(s->fd, F_GETPIPE_SZ);
        size = asked > 0 ? (size_t)asked : DEFAULT_PIPE_SIZE;
#else
        size = DEFAULT_PIPE_SIZE;
#endif
        s->pipe_size = size;
    }
    margin = size / 8 > 4096 ? size / 8 : 4096;
    return n + margin >= size;
}

void torchmp_loop_stream_consume(torchmp_loop *L, stream *s, const char *data, size_t len)
{
    int64_t now;
    uint64_t at;
    int mid_write;
    if (s->which == STREAM_RET) {
        ret_append(L, s, data, len);
        if (s->proc->by_forkserver)
            torchmp_loop_proc_forkserver_exit(L, s->proc, 0);
        return;
    }
    if (s->log_fd >= 0 && torchmp_write_all(s->log_fd, data, len) != 0) {
        /* ENOSPC and friends: keep draining the pipe (the worker must not
         * block) and keep the console going; Python reports log_errno. */
        s->log_errno = errno;
        close_fd(&s->log_fd);
    }
    now = clock_ns(CLOCK_MONOTONIC);
    pthread_mutex_lock(&L->mu);
    s->last_data_ns = now;
    if (s->tail != NULL)
        tail_append_locked(s, data, len);
    pthread_mutex_unlock(&L->mu);
    /* A due partial line these bytes may end inside a write under way is
     * left to the timer, where stream_hold decides. */
    mid_write = stream_mid_write(s, &at);
    if (filtered(s)) {
        torchmp_line_sinks sinks = filtered_sinks(s);
        sinks.mid_write = mid_write;
        (void)torchmp_framer_feed(&s->framer, data, len, now, &sinks);
    }
    if (s->feed != NULL)
        torchmp_loop_feed_push(L, s->feed, data, len, now, s->log_fd >= 0 || s->following, mid_write);
    torchmp_loop_stream_rearm(L, s);
}

static void stream_flush_partial(torchmp_loop *L, stream *s)
{
    if (s->which == STREAM_RET)
        return;
    if (filtered(s)) {
        torchmp_line_sinks sinks = filtered_sinks(s);
        torchmp_framer_flush(&s->framer, &sinks);
    }
    if (s->feed != NULL)
        torchmp_loop_feed_flush(L, s->feed);
    torchmp_stream_list_remove(&L->timed, s);
}

/* How long in all a due partial line that may end inside a write under way
 * waits for the rest, rather than TORCHMP_PARTIAL_IDLE_NS: a worker idle
 * after such a line (a prompt after a burst that filled the pipe, the
 * last of a block-buffered flush to a followed log) has it shown this
 * late. */
#define MID_WRITE_HOLD_NS (1000 * 1000000LL)

/* Whether s's due partial line must wait because its bytes may end inside
 * one write() the kernel has copied only in part: 1, with *until the time
 * to look again; 0: show it now.  The time since the line became due at
 * this place counts; new bytes start it again. */
static int stream_hold(stream *s, int64_t now, int64_t *until)
{
    uint64_t at;
    if (!stream_mid_write(s, &at))
        return 0;
    if (s->held_at != at) {
        s->held_at = at;
        s->held_until = now + MID_WRITE_HOLD_NS - TORCHMP_PARTIAL_IDLE_NS;
    }
    if (now >= s->held_until)
        return 0;
    *until = s->held_until;
    return 1;
}

/* The framers whose time has come: idle partial lines, progress states. */
void torchmp_loop_streams_tick(torchmp_loop *L)
{
    int64_t now = clock_ns(CLOCK_MONOTONIC);
    stream *s, *next;
    if (L->next_deadline_ns == 0 || now < L->next_deadline_ns)
        return;
    L->next_deadline_ns = 0;
    for (s = L->timed.head; s != NULL; s = next) {
        int64_t d;
        int avail = 0;
        next = s->timed.next;
        if ((s->fd >= 0 && ioctl(s->fd, FIONREAD, &avail) == 0 && avail > 0) || s->follow_dirty.on) {
            /* Bytes wait in the pipe: the worker was not idle, the loop was
             * busy.  They are read first (the fd is readable, or the log
             * is on the list of grown ones: the next round comes at once),
             * as if the loop had kept up. */
            d = stream_deadline(s);
            if (d != 0 && (L->next_deadline_ns == 0 || d < L->next_deadline_ns))
                L->next_deadline_ns = d;
            continue;
        }
        d = stream_deadline(s);
        if (d != 0 && d <= now && stream_hold(s, now, &d)) {
            /* The bytes read so far may end inside a write under way. */
            if (L->next_deadline_ns == 0 || d < L->next_deadline_ns)
                L->next_deadline_ns = d;
            continue;
        }
        if (s->framer.deadline_ns != 0 && s->framer.deadline_ns <= now) {
            torchmp_line_sinks sinks = filtered_sinks(s);
            torchmp_framer_tick(&s->framer, now, &sinks);
        }
        d = s->feed != NULL ? torchmp_loop_feed_deadline(s->feed) : 0;
        if (d != 0 && d <= now)
            torchmp_loop_feed_tick(L, s->feed, now);
        d = stream_deadline(s);
        if (d == 0)
            torchmp_stream_list_remove(&L->timed, s);
        else if (L->next_deadline_ns == 0 || d < L->next_deadline_ns)
            L->next_deadline_ns = d;
    }
}

/* poller timeout until the next framer deadline (-1: none). */
int torchmp_loop_streams_timeout_ms(torchmp_loop *L)
{
    int64_t left;
    if (L->next_deadline_ns == 0)
        return -1;
    left = L->next_deadline_ns - clock_ns(CLOCK_MONOTONIC);
    if (left <= 0)
        return 0;
    return (int)((left + 999999) / 1000000);
}


static void stream_maybe_grow(torchmp_loop *L, stream *s, size_t just_read)
{
#ifdef F_SETPIPE_SZ
    int got;
    if (s->pipe_grown != 0 || just_read < DEFAULT_PIPE_SIZE || L->pipe_budget < BUSY_PIPE_SIZE)
        return;
    got = fcntl(s->fd, F_SETPIPE_SZ, BUSY_PIPE_SIZE);
    if (got > DEFAULT_PIPE_SIZE) {
        s->pipe_size_next = (size_t)got;
        s->pipe_grown = got - DEFAULT_PIPE_SIZE;
        L->pipe_budget -= s->pipe_grown;
    } else {
        s->pipe_grown = -1; /* EPERM past the user's limit: keep the default */
    }
#else
    (void)L;
    (void)s;
    (void)just_read;
#endif
}

void torchmp_loop_stream_close(torchmp_loop *L, stream *s)
{
    torchmp_proc *p = s->proc;
    if (s->fd < 0 && !s->following)
        return;
    if (s->pipe_grown > 0) {
        L->pipe_budget += s->pipe_grown;
        s->pipe_grown = 0;
    }
    stream_flush_partial(L, s);
    if (s->fd >= 0)
        (void)torchmp_poller_del(L->poller, s->fd);
    close_fd(&s->fd);
    close_fd(&s->log_fd);
    torchmp_loop_follow_close(L, s);
    pthread_mutex_lock(&L->mu);
    s->open = 0;
    pthread_mutex_unlock(&L->mu);
    p->group->open_streams--;
    if (s->which == STREAM_RET && p->by_forkserver && p->info.state == TORCHMP_PROC_RUNNING && !p->exiting)
        torchmp_loop_proc_forkserver_exit(L, p, 1);
}

/* Read what is there.  limit < 0: until EAGAIN or EOF (at most a few chunks,
 * so one busy rank cannot starve the others); limit >= 0: exactly the bytes
 * that were buffered when the worker exited -- a grandchild that keeps
 * writing cannot delay the exit report. */
void torchmp_loop_stream_pump(torchmp_loop *L, stream *s, long limit)
{
    int rounds = 0;
    while (s->fd >= 0) {
        size_t want = READ_CHUNK;
        ssize_t n;
        if (limit >= 0) {
            if (limit == 0)
                return;
            if ((size_t)limit < want)
                want = (size_t)limit;
        } else if (rounds++ == 4) {
            return;
        }
        n = read(s->fd, L->readbuf, want);
        if (n > 0) {
            s->pipe_read += (uint64_t)n;
            s->pipe_last_read_full = pipe_read_was_full(s, (size_t)n);
            stream_maybe_grow(L, s, (size_t)n);
            torchmp_loop_stream_consume(L, s, L->readbuf, (size_t)n);
            if (limit >= 0)
                limit -= n;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return;
        torchmp_loop_stream_close(L, s); /* EOF or a read error */
        return;
    }
}

void torchmp_loop_stream_drain_buffered(torchmp_loop *L, stream *s)
{
    int avail = 0;
    if (s->following) {
        torchmp_loop_follow_drain(L, s);
        stream_flush_partial(L, s);
        return;
    }
    if (s->fd < 0)
        return;
    if (ioctl(s->fd, FIONREAD, &avail) != 0)
        avail = READ_CHUNK;
    torchmp_loop_stream_pump(L, s, avail);
    if (s->fd >= 0)
        stream_flush_partial(L, s);
}

void torchmp_loop_stream_free(torchmp_loop *L, stream *s)
{
    torchmp_stream_list_remove(&L->timed, s);
    torchmp_framer_free(&s->framer);
    if (s->feed != NULL) {
        torchmp_loop_feed_release(L, s->feed);
        s->feed = NULL;
    }
    free(s->prefix);
    s->prefix = NULL;
    free(s->ret_buf);
    s->ret_buf = NULL;
    free(s->tail);
    s->tail = NULL;
    s->tail_cap = s->tail_len = s->tail_end = 0;
    s->ret_len = s->ret_cap = 0;
}

/* A worker's log file, opened (and with O_CREAT | O_TRUNC created or
 * truncated) by path: never through a symlink, never blocking on a FIFO, a
 * regular file or a device only (*wrong_type set when it is something else,
 * errno then EINVAL).  Left non-blocking. */
static int open_log_checked(const char *path, int create, int *wrong_type)
{
    struct stat st;
    int saved;
    int fd = open(path, O_WRONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK | O_NOFOLLOW | (create ? O_CREAT | O_TRUNC : 0),
                  0666);
    *wrong_type = 0;
    if (fd < 0)
        return -1;
    if (fstat(fd, &st) != 0)
        goto fail;
    if (!S_ISREG(st.st_mode) && !S_ISCHR(st.st_mode)) {
        *wrong_type = 1;
        errno = EINVAL;
        goto fail;
    }
    return fd;
fail:
    saved = errno;
    close(fd);
    errno = saved;
    return -1;
}

int torchmp_log_create(const char *path, int *wrong_type)
{
    int fd = open_log_checked(path, 1, wrong_type);
    if (fd < 0)
        return -1;
    if (close(fd) != 0 && errno != EINTR)
        return -1;
    return 0;
}

/* A worker's log file, opened by path only when its rank starts (the caller
 * created, truncated and checked it before the launch with
 * torchmp_log_create): a launch of many ranks holds no fd for the logs of
 * ranks not started yet.  Blocking: the worker writes it. */
static int open_log_path(const char *path)
{
    int flags, saved, wrong_type;
    int fd = open_log_checked(path, 0, &wrong_type);
    if (fd < 0)
        return -1;
    flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
        saved = errno;
        close(fd);
        errno = saved;
        return -1;
    }
    return fd;
}

/* A teed stream's framing, console feed (which reads feed_fd back) and
 * stderr tail, as its spec asks: the same for a piped and a followed
 * stream.  On failure (errno set) the caller frees the stream. */
int torchmp_loop_stream_tee_init(torchmp_loop *L, stream *s, const torchmp_stream_spec *spec, int feed_fd)
{
    s->prefix = malloc(spec->prefix_len + 1);
    if (s->prefix == NULL)
        return -1;
    if (spec->prefix_len > 0)
        memcpy(s->prefix, spec->prefix, spec->prefix_len);
    s->prefix[spec->prefix_len] = '\0';
    torchmp_framer_init(&s->framer, s->prefix, spec->prefix_len, MAX_LINE);
    s->framer.timestamps = spec->timestamps;
    if (spec->sink != NULL || spec->console == 1 || spec->console == 2) {
        s->feed = torchmp_loop_feed_open(L, s, spec, feed_fd);
        if (s->feed == NULL)
            return -1;
    }
    if (spec->tail_bytes > 0) {
        s->tail = malloc(spec->tail_bytes);
        if (s->tail == NULL)
            return -1;
        s->tail_cap = spec->tail_bytes;
    }
    return 0;
}

int torchmp_loop_stream_open(torchmp_loop *L, torchmp_proc *p, int which, const torchmp_stream_spec *spec,
                             int *child_fd)
{
    stream *s = &p->streams[which];
    int pfd[2];

    *child_fd = -1;
    if (spec->mode == TORCHMP_STREAM_FILE) {
        if (!spec->open_log) {
            *child_fd = spec->fd;
            return 0;
        }
        if (spec->log_path == NULL) {
            errno = EINVAL;
            return -1;
        }
        *child_fd = open_log_path(spec->log_path);
        return *child_fd < 0 ? -1 : 0;
    }
    if (spec->mode != TORCHMP_STREAM_TEE && spec->mode != TORCHMP_STREAM_RETURN)
        return 0;
    if (spec->follow_log) {
        int r = torchmp_loop_follow_open(L, s, spec, child_fd);
        if (r <= 0)
            return r; /* followed, or failed; 1: piped after all */
    }

    if (torchmp_pipe_cloexec(pfd) != 0)
        return -1;
    if (fcntl(pfd[0], F_SETFL, O_NONBLOCK) != 0)
        goto fail;
    if (spec->mode == TORCHMP_STREAM_TEE) {
        if (spec->open_log && spec->log_path != NULL) {
            s->log_fd = open_log_path(spec->log_path);
            if (s->log_fd < 0)
                goto fail;
        } else if (spec->fd >= 0) {
            s->log_fd = fcntl(spec->fd, F_DUPFD_CLOEXEC, 3);
            if (s->log_fd < 0)
                goto fail;
        }
        if (torchmp_loop_stream_tee_init(L, s, spec, s->log_fd) != 0)
            goto fail;
    }
    if (torchmp_poller_add(L->poller, pfd[0], s) != 0)
        goto fail;
    s->fd = pfd[0];
    pthread_mutex_lock(&L->mu);
    s->open = 1;
    pthread_mutex_unlock(&L->mu);
    p->group->open_streams++;
    *child_fd = pfd[1];
    return 0;

fail:
    {
        int saved = errno;
        close(pfd[0]);
        close(pfd[1]);
        close_fd(&s->log_fd);
        torchmp_loop_stream_free(L, s);
        errno = saved;
        return -1;
    }
}
