/*
 * How each teed stream's lines get to its console (loop_consoles.c): a
 * feed frames them, or holds them back and catches the console up later.
 *
 * The log is the backlog.  A console that cannot take a stream's lines now
 * (its backlog is at the stream's bound) does not make the loop drop them:
 * the stream is held back -- its bytes still go to its log file, unframed --
 * and once the console has room again, the held bytes are read back from the
 * log (by path, a piece at a time: no fd is kept for it) and framed exactly
 * as they would have been live: with their arrival times, and with the live
 * path's timer runs recorded where they would have happened (so partial
 * lines, progress bars and timestamps come out the same).  Memory stays within the
 * bound whatever the console's pace; the workers, the logs, exits and
 * close() never wait for it; a live console gets every line, whole and in
 * order, exactly once.  While one stream of a console is held back, every
 * stream of it is, so they catch up in turn.
 *
 * What is left out: a console that took nothing for the stall time while
 * lines waited for it (torchmp_consoles_stall) has, when it takes bytes
 * again, the whole lines it was not given yet left out, with one marker line
 * per stream naming its complete log.  Streams without a usable log (none, a
 * device, one that failed to write) keep the console's own bound: past it,
 * lines are dropped with a marker.
 *
 * Loop thread only, but for what console.c serialises.
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

/* Arrival records kept per held-back feed before neighbours are merged. */
#define MAX_ARRIVALS 1024
/* Arrivals closer than this share a record (timestamps show milliseconds). */
#define ARRIVAL_GRAIN_NS 1000000LL
/* Bytes read back from logs per console per loop round (the pipes, exits and
 * commands get their turn in between). */
#define CATCH_UP_ROUND (4 * 1024 * 1024)
/* The widest timestamp the framer puts after a prefix. */
#define TIMESTAMP_MAX 32

/* ---- framing ------------------------------------------------------------ */

static torchmp_line_sinks feed_sinks(torchmp_loop *L, feed *f, int64_t realtime_ns)
{
    torchmp_line_sinks sinks;
    memset(&sinks, 0, sizeof(sinks));
    sinks.console_buf = L->console_scratch;
    sinks.scratch_cap = SCRATCH_SIZE;
    sinks.console = f->entry->console;
    sinks.source = &f->source;
    sinks.realtime_ns = realtime_ns;
    return sinks;
}

static void frame(torchmp_loop *L, feed *f, const char *data, size_t len, int64_t now, int64_t realtime_ns,
                  int mid_write)
{
    torchmp_line_sinks sinks = feed_sinks(L, f, realtime_ns);
    sinks.mid_write = mid_write;
    (void)torchmp_framer_feed(&f->framer, data, len, now, &sinks);
    torchmp_loop_entry_after_submit(L, f->entry, sinks.console_waiting);
}

static void frame_tick(torchmp_loop *L, feed *f, int64_t now, int64_t realtime_ns)
{
    torchmp_line_sinks sinks = feed_sinks(L, f, realtime_ns);
    torchmp_framer_tick(&f->framer, now, &sinks);
    torchmp_loop_entry_after_submit(L, f->entry, sinks.console_waiting);
}

static void frame_flush(torchmp_loop *L, feed *f, int64_t realtime_ns)
{
    torchmp_line_sinks sinks = feed_sinks(L, f, realtime_ns);
    torchmp_framer_flush(&f->framer, &sinks);
    torchmp_loop_entry_after_submit(L, f->entry, sinks.console_waiting);
}

static uint64_t count_newlines(const char *p, size_t len)
{
    uint64_t n = 0;
    const char *end = p + len;
    while ((p = memchr(p, '\n', (size_t)(end - p))) != NULL) {
        n++;
        p++;
    }
    return n;
}

/* Raw bytes whose framed form surely fits in `room` (a line as short as a
 * newline grows by the prefix and timestamp), and a piece worth a call. */
static size_t piece_for(const feed *f, size_t room)
{
    size_t grow = 1 + f->source.prefix_len + (f->framer.timestamps ? TIMESTAMP_MAX : 0);
    size_t n = room / grow;
    if (n < 4096)
        n = 4096;
    if (n > READ_CHUNK)
        n = READ_CHUNK;
    return n;
}

/* ---- holding back ------------------------------------------------------- */

/* Every two neighbours become one (at the first one's time), but never
 * across a tick: where the live path would have shown a partial line. */
static void arrivals_merge(feed *f)
{
    size_t from = f->arrivals_first, to = 0, end = f->arrivals_first + f->arrivals_len;
    while (from < end) {
        arrival a = f->arrivals[from++];
        if (a.tick_ns == 0 && from < end) {
            a.end = f->arrivals[from].end;
            a.tick_ns = f->arrivals[from].tick_ns;
            a.mid_write = f->arrivals[from].mid_write;
            from++;
        }
        f->arrivals[to++] = a;
    }
    f->arrivals_first = 0;
    f->arrivals_len = to;
    f->arrival_grain_ns *= 2; /* later arrivals are kept coarser */
}

/* Bytes of a held feed up to log offset `end` came at mono/real. */
static void arrival_add(feed *f, uint64_t end, int64_t mono, int64_t real, int mid_write)
{
    arrival *a;
    if (f->arrivals_len > 0) {
        a = &f->arrivals[f->arrivals_first + f->arrivals_len - 1];
        if (a->tick_ns == 0 && mono - a->mono_ns < f->arrival_grain_ns) {
            a->end = end;
            a->mid_write = mid_write;
            return;
        }
    }
    if (f->arrivals_first + f->arrivals_len == f->arrivals_cap) {
        if (f->arrivals_first > 0) {
            memmove(f->arrivals, f->arrivals + f->arrivals_first, f->arrivals_len * sizeof(arrival));
            f->arrivals_first = 0;
        } else if (f->arrivals_cap < MAX_ARRIVALS) {
            size_t cap = f->arrivals_cap ? f->arrivals_cap * 2 : 16;
            arrival *grown = realloc(f->arrivals, cap * sizeof(arrival));
            if (grown != NULL) {
                f->arrivals = grown;
                f->arrivals_cap = cap;
            }
        }
        if (f->arrivals_first + f->arrivals_len == f->arrivals_cap)
            arrivals_merge(f); /* full, or no memory */
        if (f->arrivals_len == f->arrivals_cap) {
            /* Nothing merged (a tick after every record): the newest
             * record takes these bytes too. */
            f->arrivals[f->arrivals_len - 1].end = end;
            f->arrivals[f->arrivals_len - 1].mid_write = mid_write;
            return;
        }
    }
    a = &f->arrivals[f->arrivals_first + f->arrivals_len++];
    a->end = end;
    a->mono_ns = mono;
    a->real_ns = real;
    a->tick_ns = 0;
    a->mid_write = mid_write;
}

static void held_add(torchmp_loop *L, feed *f)
{
    console_entry *e = f->entry;
    f->held = 1;
    f->next_held = NULL;
    if (e->held_tail != NULL)
        e->held_tail->next_held = f;
    else
        e->held_head = f;
    e->held_tail = f;
    e->nheld++;
    L->held_feeds++;
    /* The framer has no timer while held; the live path's ticks are kept
     * with the arrivals instead (held_tick), starting from its state. */
    f->framer.deadline_ns = 0;
    f->held_since_ns = f->framer.partial_len > 0 ? f->framer.partial_since_ns : 0;
    f->held_cr = f->framer.progress;
    f->held_dirty = f->framer.partial_len > 0 && (!f->framer.progress || f->framer.progress_dirty);
    f->last_tick_ns = f->framer.progress_shown_ns;
}

static void held_remove(torchmp_loop *L, feed *f)
{
    console_entry *e = f->entry;
    feed **link, *prev = NULL;
    for (link = &e->held_head; *link != NULL; prev = *link, link = &(*link)->next_held) {
        if (*link == f) {
            *link = f->next_held;
            if (e->held_tail == f)
                e->held_tail = prev;
            break;
        }
    }
    f->held = 0;
    f->next_held = NULL;
    f->arrivals_first = f->arrivals_len = 0;
    f->arrival_grain_ns = ARRIVAL_GRAIN_NS;
    e->nheld--;
    L->held_feeds--;
}

/* Leave out the whole lines the console was not given yet: one marker line
 * for them; what follows the last newline (the start of a line) stays held. */
static void feed_skip(torchmp_loop *L, feed *f)
{
    uint64_t bytes, lines = f->held_newlines;
    if (f->line_end <= f->framed)
        return; /* not one whole line held */
    bytes = f->line_end - f->framed + f->framer.partial_len;
    torchmp_framer_discard(&f->framer);
    torchmp_console_hold(f->entry->console, -(int64_t)(f->line_end - f->framed), -1);
    f->framed = f->line_end;
    f->held_newlines = 0;
    while (f->arrivals_len > 0 && f->arrivals[f->arrivals_first].end <= f->framed) {
        f->arrivals_first++;
        f->arrivals_len--;
    }
    torchmp_console_skipped(f->entry->console, &f->source, lines, bytes);
    torchmp_loop_entry_after_submit(L, f->entry, 1);
}

/* The log cannot give the held bytes back (removed, replaced, a write
 * failed): they are left out, with a marker, and the feed goes on without
 * its log (the console's own bound).  A line they end in the middle is left
 * out whole: its rest is skipped when it comes. */
static void feed_lose_log(torchmp_loop *L, feed *f)
{
    uint64_t bytes, lines;
    f->log_ok = 0;
    f->source.bounded_by_caller = 0;
    if (!f->held)
        return;
    bytes = f->logged - f->framed + f->framer.partial_len;
    lines = f->held_newlines;
    if (f->logged > f->line_end || (f->logged == f->framed && f->framer.partial_len > 0)) {
        lines++;
        f->skip_line = 1;
    }
    torchmp_framer_discard(&f->framer);
    torchmp_console_hold(f->entry->console, -(int64_t)(f->logged - f->framed), -1);
    f->framed = f->logged;
    f->held_newlines = 0;
    f->flush_at = 0;
    held_remove(L, f);
    torchmp_console_skipped(f->entry->console, &f->source, lines, bytes);
    torchmp_loop_entry_after_submit(L, f->entry, 1);
}

static void feed_free(torchmp_loop *L, feed *f)
{
    console_entry *e = f->entry;
    if (f->held) {
        torchmp_console_hold(e->console, -(int64_t)(f->logged - f->framed), -1);
        held_remove(L, f);
    }
    torchmp_framer_free(&f->framer);
    free(f->arrivals);
    free(f->prefix);
    free(f->log_path);
    free(f);
    e->users--;
    torchmp_loop_entry_maybe_free(L, e);
}

/* ---- feeds -------------------------------------------------------------- */

/* Whether the log can stand in for the console's backlog: a regular file
 * written at the offset this stream alone moves (no O_APPEND), readable by
 * path, and not shared with the rank's other stream. */
static void feed_check_log(feed *f, stream *s, int log_fd)
{
    struct stat st;
    int flags;
    off_t at;
    torchmp_proc *p = s->proc;
    if (log_fd < 0 || f->log_path == NULL || fstat(log_fd, &st) != 0 || !S_ISREG(st.st_mode))
        return;
    flags = fcntl(log_fd, F_GETFL);
    if (flags < 0 || (flags & O_APPEND))
        return;
    at = lseek(log_fd, 0, SEEK_CUR);
    if (at < 0)
        return;
    for (int w = STREAM_OUT; w <= STREAM_ERR; w++) {
        feed *other = p->streams[w].feed;
        if (&p->streams[w] != s && other != NULL && other->log_ok && other->log_dev == st.st_dev &&
            other->log_ino == st.st_ino) {
            other->log_ok = 0; /* one file for both: offsets are not a stream's own */
            other->source.bounded_by_caller = 0;
            return;
        }
    }
    f->log_ok = 1;
    f->log_dev = st.st_dev;
    f->log_ino = st.st_ino;
    f->logged = f->framed = f->line_end = (uint64_t)at;
}

feed *torchmp_loop_feed_open(torchmp_loop *L, stream *s, const torchmp_stream_spec *spec, int log_fd)
{
    feed *f = calloc(1, sizeof(*f));
    int saved;
    if (f == NULL)
        return NULL;
    f->stream = s;
    f->arrival_grain_ns = ARRIVAL_GRAIN_NS;
    f->prefix = malloc(spec->prefix_len + 1);
    if (f->prefix == NULL)
        goto fail;
    if (spec->prefix_len > 0)
        memcpy(f->prefix, spec->prefix, spec->prefix_len);
    f->prefix[spec->prefix_len] = '\0';
    if (spec->log_path != NULL) {
        f->log_path = strdup(spec->log_path);
        if (f->log_path == NULL)
            goto fail;
    }
    torchmp_framer_init(&f->framer, f->prefix, spec->prefix_len, MAX_LINE);
    f->framer.timestamps = spec->timestamps;
    f->entry = spec->sink != NULL ? torchmp_loop_entry_for_queue(L, spec->sink) : torchmp_loop_entry_for_fd(L, spec->console);
    if (f->entry == NULL)
        goto fail;
    f->source.id = ++L->stream_serial;
    f->source.prefix = f->prefix;
    f->source.prefix_len = spec->prefix_len;
    f->source.log_path = f->log_path;
    f->source.limit = spec->backlog_limit;
    if (spec->backlog_limit + OWN_LINES_LIMIT > f->entry->own.limit)
        f->entry->own.limit = spec->backlog_limit + OWN_LINES_LIMIT;
    feed_check_log(f, s, log_fd);
    f->source.bounded_by_caller = f->log_ok;
    return f;
fail:
    saved = errno;
    free(f->prefix);
    free(f->log_path);
    free(f);
    errno = saved;
    return NULL;
}

/* A held feed's unterminated line: when the live path's timer would show
 * it (its oldest byte is TORCHMP_PARTIAL_IDLE_NS old; a progress bar's new
 * state at most once per TORCHMP_PROGRESS_INTERVAL_NS), 0 if not. */
static int64_t held_deadline(const feed *f)
{
    int64_t d;
    if (!f->held_dirty || f->held_since_ns == 0 || f->logged == f->line_end)
        return 0;
    d = f->held_since_ns + TORCHMP_PARTIAL_IDLE_NS;
    if (f->held_cr && f->last_tick_ns != 0 && f->last_tick_ns + TORCHMP_PROGRESS_INTERVAL_NS > d)
        d = f->last_tick_ns + TORCHMP_PROGRESS_INTERVAL_NS;
    return d;
}

/* What the live path's timer would do now is done to the held bytes when
 * they are caught up: a tick after the bytes that came so far.  It is
 * recorded only where the loop saw no more bytes of the stream first, as
 * the live path reads before it ticks (a launcher that was busy or
 * descheduled does not cut a worker's line in two). */
static void held_tick(feed *f, int64_t now)
{
    if (f->arrivals_len == 0)
        return;
    f->arrivals[f->arrivals_first + f->arrivals_len - 1].tick_ns = now;
    f->last_tick_ns = now;
    f->held_dirty = 0;
    if (!f->held_cr)
        f->held_since_ns = 0; /* shown; what follows starts a new line */
}

int64_t torchmp_loop_feed_deadline(const feed *f)
{
    return f->held ? held_deadline(f) : f->framer.deadline_ns;
}

void torchmp_loop_feed_tick(torchmp_loop *L, feed *f, int64_t now)
{
    if (f->held)
        held_tick(f, now);
    else
        frame_tick(L, f, now, 0);
}

void torchmp_loop_feed_push(torchmp_loop *L, feed *f, const char *data, size_t len, int64_t now, int logged_ok,
                            int mid_write)
{
    const char *nl;
    if (f->log_ok && !logged_ok)
        feed_lose_log(L, f); /* the log misses these bytes: it is the backlog no more */
    if (f->skip_line) {
        /* The rest of a line that was left out: it would show torn. */
        nl = memchr(data, '\n', len);
        if (nl == NULL)
            return;
        f->skip_line = 0;
        len -= (size_t)(nl + 1 - data);
        data = nl + 1;
    }
    if (!f->log_ok) {
        frame(L, f, data, len, now, 0, mid_write);
        return;
    }
    f->logged += len;
    nl = memrchr(data, '\n', len);
    if (nl != NULL)
        f->line_end = f->logged - (size_t)(data + len - nl - 1);
    /* While any stream of the console is held back, all are: they catch up
     * in turn, not the live ones first. */
    if (!f->held && f->entry->nheld == 0) {
        while (len > 0) {
            size_t room = torchmp_console_room(f->entry->console, f->source.limit);
            size_t piece;
            if (room == 0)
                break;
            piece = piece_for(f, room);
            if (piece > len)
                piece = len;
            /* A piece the rest of these bytes follow is no place to show a
             * partial line at. */
            frame(L, f, data, piece, now, 0, piece < len || mid_write);
            f->framed += piece;
            data += piece;
            len -= piece;
        }
        if (len == 0)
            return;
    }
    if (!f->held) {
        held_add(L, f);
        if (f->stream != NULL)
            torchmp_loop_stream_rearm(L, f->stream);
    }
    f->held_newlines += count_newlines(data, len);
    arrival_add(f, f->logged, now, clock_ns(CLOCK_REALTIME), mid_write);
    /* The unterminated line the live path's timer would be watching. */
    nl = memrchr(data, '\n', len);
    if (nl != NULL) {
        size_t after = (size_t)(data + len - nl - 1);
        f->held_since_ns = after > 0 ? now : 0;
        f->held_cr = after > 0 && memchr(nl + 1, '\r', after) != NULL;
        f->last_tick_ns = 0;
    } else {
        if (f->held_since_ns == 0)
            f->held_since_ns = now;
        f->held_cr = f->held_cr || memchr(data, '\r', len) != NULL;
    }
    f->held_dirty = 1;
    torchmp_console_hold(f->entry->console, (int64_t)len, -1);
}

void torchmp_loop_feed_flush(torchmp_loop *L, feed *f)
{
    if (f->held) {
        f->flush_at = f->logged;
        f->flush_real_ns = clock_ns(CLOCK_REALTIME);
    } else {
        frame_flush(L, f, 0);
    }
}

void torchmp_loop_feed_release(torchmp_loop *L, feed *f)
{
    f->stream = NULL;
    if (f->held && torchmp_console_broken(f->entry->console) == 0)
        return; /* an orphan: freed once caught up */
    feed_free(L, f);
}

/* ---- catching up -------------------------------------------------------- */

/* Read log bytes [at, at + want) of f into buf: 0, or -1 if the log is not
 * the one written any more (or cannot be read). */
static int log_read(const feed *f, char *buf, uint64_t at, size_t want)
{
    struct stat st;
    size_t got = 0;
    int fd = open(f->log_path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    if (fd < 0)
        return -1;
    if (fstat(fd, &st) != 0 || st.st_dev != f->log_dev || st.st_ino != f->log_ino) {
        close(fd);
        return -1;
    }
    while (got < want) {
        ssize_t n = pread(fd, buf + got, want - got, (off_t)(at + got));
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        got += (size_t)n;
    }
    close(fd);
    return got == want ? 0 : -1;
}

/* Frame the next held bytes of f, as many as `room` surely takes, at the
 * times they arrived; the bytes framed. */
static size_t catch_up_piece(torchmp_loop *L, feed *f, size_t room)
{
    size_t want = piece_for(f, room);
    uint64_t end = f->flush_at > f->framed ? f->flush_at : f->logged;
    const char *p, *stop;
    if (want > end - f->framed)
        want = (size_t)(end - f->framed);
    if (log_read(f, L->readbuf, f->framed, want) != 0) {
        feed_lose_log(L, f);
        return 0;
    }
    p = L->readbuf;
    stop = p + want;
    while (p < stop) {
        size_t n = (size_t)(stop - p);
        int64_t mono = clock_ns(CLOCK_MONOTONIC), real = 0;
        arrival *a = f->arrivals_len > 0 ? &f->arrivals[f->arrivals_first] : NULL;
        int mid_write = f->framed + n < end; /* the rest of the held bytes follow */
        if (a != NULL) {
            if (a->end - f->framed < n)
                n = (size_t)(a->end - f->framed);
            mono = a->mono_ns;
            real = a->real_ns;
            /* As the live path framed them: the arrival whole, and at its
             * end as the read that brought it ended. */
            mid_write = f->framed + n < a->end || a->mid_write;
        }
        f->held_newlines -= count_newlines(p, n);
        frame(L, f, p, n, mono, real, mid_write);
        f->framed += n;
        p += n;
        if (a != NULL && a->end <= f->framed) {
            /* What the live path's timer did after these bytes. */
            if (a->tick_ns != 0)
                frame_tick(L, f, a->tick_ns, real + (a->tick_ns - mono));
            f->arrivals_first++;
            f->arrivals_len--;
        }
    }
    torchmp_console_hold(f->entry->console, -(int64_t)want, -1);
    if (f->flush_at != 0 && f->framed == f->flush_at) {
        f->flush_at = 0;
        frame_flush(L, f, f->flush_real_ns);
    }
    return want;
}

/* f has given the console everything it logged. */
static void feed_caught_up(torchmp_loop *L, feed *f)
{
    held_remove(L, f);
    if (f->flush_at != 0) {
        f->flush_at = 0;
        frame_flush(L, f, f->flush_real_ns);
    }
    if (f->stream == NULL)
        feed_free(L, f);
    else
        torchmp_loop_stream_rearm(L, f->stream); /* its partial line's timer */
}

static void entry_catch_up(torchmp_loop *L, console_entry *e)
{
    torchmp_console *c = e->console;
    size_t budget = CATCH_UP_ROUND;
    if (torchmp_console_broken(c) != 0) {
        /* Nothing will be shown any more: let the held feeds go. */
        while (e->held_head != NULL) {
            feed *f = e->held_head;
            torchmp_console_hold(c, -(int64_t)(f->logged - f->framed), -1);
            f->framed = f->logged;
            f->flush_at = 0;
            feed_caught_up(L, f);
        }
        torchmp_loop_said_release(L, e);
        return;
    }
    if (torchmp_console_take_resumed(c)) {
        for (feed *f = e->held_head; f != NULL; f = f->next_held)
            feed_skip(L, f);
    }
    while (e->held_head != NULL) {
        feed *f = e->held_head;
        size_t room = torchmp_console_room(c, f->source.limit);
        if (room == 0)
            break;
        if (budget == 0) {
            L->catch_up_more = 1;
            break;
        }
        if (f->framed < f->logged) {
            size_t n = catch_up_piece(L, f, room);
            budget = n < budget ? budget - n : 0;
        }
        if (!f->held)
            continue; /* its log was lost */
        if (f->framed == f->logged) {
            feed_caught_up(L, f);
        } else if (e->nheld > 1) {
            /* Its turn is over: to the end of the line. */
            e->held_head = f->next_held;
            f->next_held = NULL;
            e->held_tail->next_held = f;
            e->held_tail = f;
        }
    }
    torchmp_loop_said_release(L, e);
}

void torchmp_loop_catch_up(torchmp_loop *L)
{
    console_entry *e, *next;
    L->catch_up_more = 0;
    for (e = L->consoles; e != NULL; e = next) {
        next = e->next;
        if (e->nheld > 0 || e->said_head != NULL) {
            e->users++; /* not freed under our feet */
            entry_catch_up(L, e);
            e->users--;
            torchmp_loop_entry_maybe_free(L, e);
        }
    }
}

