/*
 * The loop's consoles (console.c): one entry per console the loop writes
 * to -- the launcher's fd 1 or 2 (one per target, shared by every stream
 * teed there) or a queue console of Python's -- its writability watch, and
 * torchmp's own lines (logging, reports), a source of the same console.
 * How each stream's lines get to a console, held back and caught up from
 * its log when the console falls behind, is loop_feeds.c.
 *
 * torchmp's own lines: when streams of the console are held back, they wait
 * until each of those has caught up to what it had logged when the lines
 * came, so they come out in order with the workers' lines, never inside
 * one.
 *
 * Loop thread only, but for what console.c serialises.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "loop_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

/* ---- console entries ---------------------------------------------------- */

static console_entry *entry_new(torchmp_loop *L, torchmp_console *c)
{
    console_entry *e = calloc(1, sizeof(*e));
    if (e == NULL)
        return NULL;
    e->kind = WATCH_CONSOLE;
    e->console = c;
    e->users = 1;
    e->own.id = ++L->stream_serial;
    e->own.prefix = "";
    /* torchmp's own lines fit beyond the workers' bound (see feed_open). */
    e->own.limit = TORCHMP_DEFAULT_CONSOLE_BACKLOG + OWN_LINES_LIMIT;
    if (torchmp_console_is_queue(c))
        torchmp_console_hold(c, 0, L->wake_w); /* its taker asks for more through it */
    pthread_mutex_lock(&L->mu);
    e->next = L->consoles;
    L->consoles = e;
    pthread_mutex_unlock(&L->mu);
    return e;
}

/* The console for what the launcher's fd refers to now (one per target), or
 * NULL with errno. */
console_entry *torchmp_loop_entry_for_fd(torchmp_loop *L, int fd)
{
    console_entry *e;
    torchmp_console *c;
    for (e = L->consoles; e != NULL; e = e->next) {
        if (torchmp_console_same_target(e->console, fd)) {
            e->users++;
            return e;
        }
    }
    c = torchmp_console_open_fd(fd);
    if (c == NULL)
        return NULL;
    e = entry_new(L, c);
    if (e == NULL) {
        torchmp_console_unref(c);
        errno = ENOMEM;
    }
    return e;
}

/* The entry of a queue console of Python's (referenced while it exists). */
console_entry *torchmp_loop_entry_for_queue(torchmp_loop *L, torchmp_console *c)
{
    console_entry *e;
    for (e = L->consoles; e != NULL; e = e->next) {
        if (e->console == c) {
            e->users++;
            return e;
        }
    }
    e = entry_new(L, torchmp_console_ref(c));
    if (e == NULL) {
        torchmp_console_unref(c);
        errno = ENOMEM;
    }
    return e;
}

/* Free an entry nobody uses once it has nothing left to show. */
void torchmp_loop_entry_maybe_free(torchmp_loop *L, console_entry *e)
{
    console_entry **link;
    if (e->users > 0 || e->watched || e->nheld > 0 || e->said_head != NULL)
        return;
    pthread_mutex_lock(&L->mu);
    for (link = &L->consoles; *link != NULL; link = &(*link)->next) {
        if (*link == e) {
            *link = e->next;
            break;
        }
    }
    pthread_mutex_unlock(&L->mu);
    torchmp_console_unref(e->console);
    free(e);
}

/* Bytes wait in the console's backlog: write the rest when its fd takes
 * more. */
static void entry_watch(torchmp_loop *L, console_entry *e)
{
    int fd;
    if (e->watched || torchmp_console_is_queue(e->console))
        return;
    fd = torchmp_console_fd(e->console);
    if (fd >= 0 && torchmp_poller_add_writable(L->poller, fd, e) == 0) {
        e->watched = 1;
        e->watched_fd = fd;
        return;
    }
    /* A target epoll cannot watch (a regular file someone made
     * non-blocking), or no memory: retry on a short timer instead. */
    e->watched = -1;
    L->consoles_polled = 1;
}

static void entry_unwatch(torchmp_loop *L, console_entry *e)
{
    /* By the number it was registered with (a broken console keeps its fd
     * open until it is freed, so the number is still this watch's). */
    if (e->watched == 1)
        (void)torchmp_poller_del(L->poller, e->watched_fd);
    e->watched = 0;
}

/* Pump the consoles that could not be watched; 1 while any still waits. */
int torchmp_loop_consoles_poll(torchmp_loop *L)
{
    int left = 0;
    console_entry *e, *next;
    for (e = L->consoles; e != NULL; e = next) {
        next = e->next;
        if (e->watched == -1) {
            torchmp_loop_console_entry_writable(L, e);
            left = 1;
        }
    }
    return left;
}

void torchmp_loop_console_entry_writable(torchmp_loop *L, console_entry *e)
{
    if (torchmp_console_pump(e->console))
        return;
    entry_unwatch(L, e);
    /* Room again: the held-back feeds are given more at the end of this
     * round (torchmp_loop_catch_up). */
    torchmp_loop_entry_maybe_free(L, e);
}

/* The console took what it was given, or keeps some for its fd. */
void torchmp_loop_entry_after_submit(torchmp_loop *L, console_entry *e, int waiting)
{
    if (waiting && torchmp_console_pump(e->console))
        entry_watch(L, e);
}

/* Whether torchmp's own lines may go out: every feed they wait for has
 * reached what it had logged when they came. */
static int said_due(const console_entry *e, const said *m)
{
    for (int i = 0; i < m->nwait; i++) {
        for (const feed *f = e->held_head; f != NULL; f = f->next_held) {
            if (f->source.id == m->wait[i].id && f->framed < m->wait[i].logged)
                return 0;
        }
    }
    return 1;
}

void torchmp_loop_said_release(torchmp_loop *L, console_entry *e)
{
    while (e->said_head != NULL && said_due(e, e->said_head)) {
        said *m = e->said_head;
        int waiting;
        e->said_head = m->next;
        e->said_bytes -= m->len;
        if (e->said_head == NULL) {
            e->said_tail = NULL;
            L->said_entries--;
        }
        torchmp_console_hold(e->console, -(int64_t)m->len, -1);
        waiting = torchmp_console_submit(e->console, &e->own, m->data, m->len);
        torchmp_loop_entry_after_submit(L, e, waiting);
        free(m->wait);
        free(m);
    }
}

/* ---- torchmp's own lines ------------------------------------------------ */

int torchmp_loop_do_say(torchmp_loop *L, command *c)
{
    console_entry *e = c->console != NULL ? torchmp_loop_entry_for_queue(L, c->console) : torchmp_loop_entry_for_fd(L, c->console_fd);
    said *m;
    int shown = 1;
    if (e == NULL)
        return -1;
    if (e->nheld == 0 && e->said_head == NULL) {
        int waiting = torchmp_console_submit(e->console, &e->own, c->data, c->len);
        torchmp_loop_entry_after_submit(L, e, waiting);
    } else {
        m = malloc(sizeof(*m) + c->len);
        if (m != NULL && e->nheld > 0) {
            m->wait = calloc((size_t)e->nheld, sizeof(*m->wait));
            if (m->wait == NULL) {
                free(m);
                m = NULL;
            }
        }
        if (m == NULL || e->said_bytes + c->len > OWN_LINES_LIMIT) {
            shown = 0; /* memory or the bound: these lines are not shown */
            if (m != NULL)
                free(m->wait);
            free(m);
        } else {
            int i = 0;
            m->next = NULL;
            m->len = c->len;
            memcpy(m->data, c->data, c->len);
            for (feed *f = e->held_head; f != NULL; f = f->next_held, i++) {
                m->wait[i].id = f->source.id;
                m->wait[i].logged = f->logged;
            }
            m->nwait = i;
            if (e->said_tail != NULL)
                e->said_tail->next = m;
            else
                e->said_head = m;
            e->said_tail = m;
            e->said_bytes += m->len;
            L->said_entries += e->said_head == m;
            torchmp_console_hold(e->console, (int64_t)m->len, -1);
        }
    }
    e->users--;
    torchmp_loop_entry_maybe_free(L, e);
    return shown;
}
