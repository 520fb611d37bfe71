/*
 * Followed logs: a teed stream that costs the launcher no descriptor while
 * its rank runs.  The worker's stdout/stderr is its log file itself (as
 * without tee), and the loop shows what the worker adds to it: one inotify
 * fd for every followed log says which grew, and the loop opens the file by
 * path only to read the new bytes (from the offset it kept) and closes it
 * again.  The bytes then go the way a pipe's do (framing, console, held-back
 * catch-up from the same log, tail, filters), but for the log write: the
 * worker did it.  At the rank's exit the log is read to the size it has then
 * before the exit is recorded, so a wait() that returns has shown every line.
 *
 * Chosen by the caller (spec->follow_log) when a pipe and a log per stream
 * would not fit RLIMIT_NOFILE; a stream that cannot be followed (no inotify
 * in this build, not a regular file, not readable back, out of watches, the
 * same file followed already) is piped as usual.  Loop thread only.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "loop_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#ifdef TORCHMP_HAVE_INOTIFY
#include <sys/inotify.h>
#endif

/* Chunks read from one log per round (the others get their turn). */
#define FOLLOW_ROUNDS 4
/* Out of fds to read a log with: try again this much later. */
#define FOLLOW_RETRY_NS (10 * 1000000LL)
/* A file's size can end inside a write that is under way: the kernel copies
 * a write page by page (or folio by folio) and moves the size after each,
 * so a reader can see the first part of a line the worker wrote in one
 * write() while the writer is preempted, or waits for a page of its buffer
 * to fault in, before the rest.  Those intermediate sizes are multiples of
 * the page size (4096 divides every page and folio size), so a log read to
 * such a size may end inside a write: its partial line waits for the rest,
 * whose end inotify then reports (stream_hold in loop_streams.c).  A worker
 * idle after such a line -- one in 4096 of idle partial lines, more with
 * block-buffered output, whose flushes are page multiples -- has it shown
 * late. */
#define FOLLOW_WRITE_GRAIN 4096

#ifdef TORCHMP_HAVE_INOTIFY

/* ---- watch descriptor -> stream ----------------------------------------- */

static size_t map_slot(const torchmp_loop *L, int wd)
{
    return ((size_t)(unsigned)wd * 2654435761u) & (L->follow_map_cap - 1);
}

static stream *map_find(const torchmp_loop *L, int wd)
{
    if (L->follow_map_cap == 0)
        return NULL;
    for (size_t i = map_slot(L, wd);; i = (i + 1) & (L->follow_map_cap - 1)) {
        stream *s = L->follow_map[i];
        if (s == NULL || s->follow_wd == wd)
            return s;
    }
}

static int map_put(torchmp_loop *L, stream *s)
{
    size_t i;
    if ((L->follow_count + 1) * 2 > L->follow_map_cap) {
        size_t cap = L->follow_map_cap ? L->follow_map_cap * 2 : 64;
        stream **old = L->follow_map, **grown = calloc(cap, sizeof(*grown));
        size_t old_cap = L->follow_map_cap;
        if (grown == NULL)
            return -1;
        L->follow_map = grown;
        L->follow_map_cap = cap;
        for (size_t j = 0; j < old_cap; j++) {
            if (old[j] != NULL) {
                for (i = map_slot(L, old[j]->follow_wd); grown[i] != NULL; i = (i + 1) & (cap - 1))
                    ;
                grown[i] = old[j];
            }
        }
        free(old);
    }
    for (i = map_slot(L, s->follow_wd); L->follow_map[i] != NULL; i = (i + 1) & (L->follow_map_cap - 1))
        ;
    L->follow_map[i] = s;
    L->follow_count++;
    return 0;
}

static void map_remove(torchmp_loop *L, stream *s)
{
    size_t mask = L->follow_map_cap - 1, i, j;
    if (L->follow_map_cap == 0)
        return;
    for (i = map_slot(L, s->follow_wd); L->follow_map[i] != s; i = (i + 1) & mask) {
        if (L->follow_map[i] == NULL)
            return;
    }
    L->follow_map[i] = NULL;
    L->follow_count--;
    /* Move the entries after it that would not be found across the gap. */
    for (j = (i + 1) & mask; L->follow_map[j] != NULL; j = (j + 1) & mask) {
        size_t home = map_slot(L, L->follow_map[j]->follow_wd);
        if ((j > i && (home <= i || home > j)) || (j < i && home <= i && home > j)) {
            L->follow_map[i] = L->follow_map[j];
            L->follow_map[j] = NULL;
            i = j;
        }
    }
}

/* ---- the list of logs that grew ----------------------------------------- */

static void dirty_add(torchmp_loop *L, stream *s)
{
    torchmp_stream_list_append(&L->follow_dirty, s);
}

static void dirty_remove(torchmp_loop *L, stream *s)
{
    torchmp_stream_list_remove(&L->follow_dirty, s);
}

/* ---- reading ------------------------------------------------------------ */

/* Read s's log from follow_off: up to `until` (UINT64_MAX: to its end),
 * at most `rounds` chunks (0: no bound).  1: all read; 0: more left;
 * -1: out of fds (try later); -2: the log is gone or another file now
 * (nothing more can be shown). */
static int follow_read(torchmp_loop *L, stream *s, int rounds, int to_size)
{
    struct stat st;
    uint64_t until = UINT64_MAX;
    int fd = open(s->follow_path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK | O_NOFOLLOW);
    int done = 0, n_rounds = 0;
    if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE || errno == ENOMEM || errno == EINTR)
            return -1;
        return -2;
    }
    if (fstat(fd, &st) != 0 || st.st_dev != s->follow_dev || st.st_ino != s->follow_ino) {
        close(fd);
        return -2;
    }
    if (to_size)
        until = (uint64_t)st.st_size;
    while (s->following) {
        size_t want = READ_CHUNK;
        ssize_t n;
        if (s->follow_off >= until) {
            done = 1;
            break;
        }
        if (rounds > 0 && n_rounds++ == rounds)
            break;
        if (until - s->follow_off < want)
            want = (size_t)(until - s->follow_off);
        n = pread(fd, L->readbuf, want, (off_t)s->follow_off);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            done = 1; /* its end (or a read error: the next growth says) */
            break;
        }
        s->follow_off += (uint64_t)n;
        torchmp_loop_stream_consume(L, s, L->readbuf, (size_t)n);
    }
    close(fd);
    return done || !s->following;
}

/* The log cannot be read back any more (removed, replaced): what the worker
 * writes from now on is in whatever it writes to, not on the console. */
static void follow_lost(torchmp_loop *L, stream *s)
{
    dirty_remove(L, s);
}

void torchmp_loop_follow_pump(torchmp_loop *L)
{
    stream *s, *last;
    if (L->follow_dirty.head == NULL)
        return;
    if (L->follow_retry_ns != 0) {
        if (clock_ns(CLOCK_MONOTONIC) < L->follow_retry_ns)
            return;
        L->follow_retry_ns = 0;
    }
    last = L->follow_dirty.tail; /* the ones that go round again come after it */
    while ((s = L->follow_dirty.head) != NULL) {
        int r = follow_read(L, s, FOLLOW_ROUNDS, 0);
        if (r == -1) {
            L->follow_retry_ns = clock_ns(CLOCK_MONOTONIC) + FOLLOW_RETRY_NS;
            return;
        }
        dirty_remove(L, s);
        if (r == 0)
            dirty_add(L, s); /* more: its next turn comes after the others */
        if (s == last)
            break;
    }
}

void torchmp_loop_follow_drain(torchmp_loop *L, stream *s)
{
    int r;
    if (!s->following)
        return;
    r = follow_read(L, s, 0, 1);
    if (r == -1) {
        /* Out of fds: the lines come later (EMFILE from another part of
         * the launcher; the launch's budget leaves one for this). */
        dirty_add(L, s);
        if (L->follow_retry_ns == 0)
            L->follow_retry_ns = clock_ns(CLOCK_MONOTONIC) + FOLLOW_RETRY_NS;
        return;
    }
    if (r == -2)
        follow_lost(L, s);
    else
        dirty_remove(L, s); /* read to its end: a later growth marks it again */
}

void torchmp_loop_follow_event(torchmp_loop *L)
{
    /* inotify_event's alignment: the kernel writes whole records. */
    char buf[4096] __attribute__((aligned(__alignof__(struct inotify_event))));
    for (int round = 0; round < 16; round++) {
        ssize_t n = read(L->inotify_fd, buf, sizeof(buf));
        size_t at = 0;
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return; /* EAGAIN: all read */
        while (at + sizeof(struct inotify_event) <= (size_t)n) {
            const struct inotify_event *ev = (const struct inotify_event *)(buf + at);
            at += sizeof(*ev) + ev->len;
            if (ev->mask & IN_Q_OVERFLOW) {
                /* Events were lost: every followed log may have grown. */
                for (size_t i = 0; i < L->follow_map_cap; i++) {
                    if (L->follow_map[i] != NULL)
                        dirty_add(L, L->follow_map[i]);
                }
                continue;
            }
            if (ev->mask & IN_MODIFY) {
                stream *s = map_find(L, ev->wd);
                if (s != NULL)
                    dirty_add(L, s);
            }
        }
    }
}

int torchmp_loop_follow_mid_write(const stream *s, uint64_t *at)
{
    *at = s->follow_off;
    return s->following && s->follow_off % FOLLOW_WRITE_GRAIN == 0;
}

int torchmp_loop_follow_timeout_ms(torchmp_loop *L)
{
    int64_t left;
    if (L->follow_dirty.head == NULL)
        return -1;
    if (L->follow_retry_ns == 0)
        return 0;
    left = L->follow_retry_ns - clock_ns(CLOCK_MONOTONIC);
    return left <= 0 ? 0 : (int)((left + 999999) / 1000000);
}

/* ---- opening and closing ------------------------------------------------ */

static int inotify_ready(torchmp_loop *L)
{
    if (L->inotify_fd >= 0)
        return 0;
    L->inotify_fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (L->inotify_fd < 0)
        return -1;
    L->follow_kind = WATCH_FOLLOW;
    if (torchmp_poller_add(L->poller, L->inotify_fd, &L->follow_kind) != 0) {
        int saved = errno;
        close_fd(&L->inotify_fd);
        errno = saved;
        return -1;
    }
    return 0;
}

/* No log followed any more: the inotify fd goes too (a launcher that
 * follows nothing holds none). */
static void inotify_maybe_close(torchmp_loop *L)
{
    if (L->follow_count > 0 || L->inotify_fd < 0)
        return;
    (void)torchmp_poller_del(L->poller, L->inotify_fd);
    close_fd(&L->inotify_fd);
    free(L->follow_map);
    L->follow_map = NULL;
    L->follow_map_cap = 0;
}

/* The log, opened for the worker as open_log_path does, if it can be
 * followed: a regular file that can be read back by path.  -1 otherwise
 * (nothing left open). */
static int open_followable(const char *path, struct stat *st)
{
    struct stat rst;
    int fd = open(path, O_WRONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK | O_NOFOLLOW);
    int rfd, flags;
    if (fd < 0)
        return -1;
    if (fstat(fd, st) != 0 || !S_ISREG(st->st_mode))
        goto fail;
    flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0)
        goto fail;
    rfd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK | O_NOFOLLOW);
    if (rfd < 0)
        goto fail;
    if (fstat(rfd, &rst) != 0 || rst.st_dev != st->st_dev || rst.st_ino != st->st_ino) {
        close(rfd);
        goto fail;
    }
    close(rfd);
    return fd;
fail:
    close(fd);
    return -1;
}

int torchmp_loop_follow_open(torchmp_loop *L, stream *s, const torchmp_stream_spec *spec, int *child_fd)
{
    struct stat st;
    int fd, wd, saved;
    if (!spec->follow_log || spec->mode != TORCHMP_STREAM_TEE || !spec->open_log || spec->log_path == NULL)
        return 1;
    if (inotify_ready(L) != 0)
        return 1;
    fd = open_followable(spec->log_path, &st);
    if (fd < 0) {
        inotify_maybe_close(L);
        return 1;
    }
    wd = inotify_add_watch(L->inotify_fd, spec->log_path, IN_MODIFY | IN_DONT_FOLLOW);
    if (wd < 0 || map_find(L, wd) != NULL) {
        /* Out of watches, or the file is followed already (for another
         * stream: one watch for both would not say whose bytes came). */
        close(fd);
        inotify_maybe_close(L);
        return 1;
    }
    s->follow_wd = wd;
    s->follow_path = strdup(spec->log_path);
    if (s->follow_path == NULL || map_put(L, s) != 0)
        goto fail;
    s->following = 1;
    s->follow_dev = st.st_dev;
    s->follow_ino = st.st_ino;
    s->follow_off = 0;
    s->held_at = 0;
    s->held_until = 0;
    s->log_fd = -1;
    /* The worker's fd stands in for the log the feed reads back. */
    if (torchmp_loop_stream_tee_init(L, s, spec, fd) != 0)
        goto fail_mapped;
    pthread_mutex_lock(&L->mu);
    s->open = 1;
    pthread_mutex_unlock(&L->mu);
    s->proc->group->open_streams++;
    *child_fd = fd;
    return 0;

fail_mapped:
    saved = errno;
    map_remove(L, s);
    errno = saved;
fail:
    saved = errno;
    s->following = 0;
    (void)inotify_rm_watch(L->inotify_fd, wd);
    free(s->follow_path);
    s->follow_path = NULL;
    close(fd);
    torchmp_loop_stream_free(L, s);
    inotify_maybe_close(L);
    errno = saved;
    return -1;
}

void torchmp_loop_follow_close(torchmp_loop *L, stream *s)
{
    if (!s->following)
        return;
    dirty_remove(L, s);
    map_remove(L, s);
    (void)inotify_rm_watch(L->inotify_fd, s->follow_wd);
    s->following = 0;
    free(s->follow_path);
    s->follow_path = NULL;
    inotify_maybe_close(L);
}

#else /* !TORCHMP_HAVE_INOTIFY: every teed stream is piped */

int torchmp_loop_follow_open(torchmp_loop *L, stream *s, const torchmp_stream_spec *spec, int *child_fd)
{
    (void)L;
    (void)s;
    (void)spec;
    (void)child_fd;
    return 1;
}

void torchmp_loop_follow_event(torchmp_loop *L)
{
    (void)L;
}

void torchmp_loop_follow_pump(torchmp_loop *L)
{
    (void)L;
}

void torchmp_loop_follow_drain(torchmp_loop *L, stream *s)
{
    (void)L;
    (void)s;
}

void torchmp_loop_follow_close(torchmp_loop *L, stream *s)
{
    (void)L;
    (void)s;
}

int torchmp_loop_follow_mid_write(const stream *s, uint64_t *at)
{
    *at = 0; /* nothing is followed */
    (void)s;
    return 0;
}

int torchmp_loop_follow_timeout_ms(torchmp_loop *L)
{
    (void)L;
    return -1;
}

#endif
