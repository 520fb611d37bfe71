/*
 * Notifiers: how the I/O thread wakes an event loop (asyncio's add_reader,
 * trio's wait_readable).  One descriptor per event loop, whatever the number
 * of commands and groups it watches, so a loop with hundreds of commands in
 * flight costs no thread and no descriptor per command.  The thread queues a
 * note {token, what} and makes the descriptor readable; the loop takes every
 * note at once, which makes the descriptor quiet again.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "loop_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

struct torchmp_notifier {
    int refs;                  /* atomic */
    int wake_r, wake_w;        /* an eventfd (both the same), or a pipe */
    pthread_mutex_t mu;
    torchmp_note *notes;       /* mu */
    size_t count, cap;         /* mu */
    int overflow;              /* mu: a note was lost (no memory) */
    int posted;                /* mu: the descriptor is readable */
};

torchmp_notifier *torchmp_notifier_new(void)
{
    torchmp_notifier *n = calloc(1, sizeof(*n));
    int saved;
    if (n == NULL)
        return NULL;
    n->refs = 1;
    n->wake_r = n->wake_w = -1;
    if (torchmp_loop_notify_open(&n->wake_r, &n->wake_w) != 0)
        goto fail;
    if ((errno = pthread_mutex_init(&n->mu, NULL)) != 0) {
        saved = errno;
        torchmp_loop_notify_close(&n->wake_r, &n->wake_w);
        errno = saved;
        goto fail;
    }
    return n;
fail:
    saved = errno;
    free(n);
    errno = saved;
    return NULL;
}

torchmp_notifier *torchmp_notifier_ref(torchmp_notifier *n)
{
    __atomic_add_fetch(&n->refs, 1, __ATOMIC_RELAXED);
    return n;
}

void torchmp_notifier_unref(torchmp_notifier *n)
{
    if (n == NULL || __atomic_sub_fetch(&n->refs, 1, __ATOMIC_ACQ_REL) != 0)
        return;
    pthread_mutex_destroy(&n->mu);
    torchmp_loop_notify_close(&n->wake_r, &n->wake_w);
    free(n->notes);
    free(n);
}

int torchmp_notifier_fd(const torchmp_notifier *n)
{
    return n->wake_r;
}

void torchmp_notifier_post(torchmp_notifier *n, uint64_t token, int what)
{
    pthread_mutex_lock(&n->mu);
    if (n->count == n->cap) {
        size_t cap = n->cap ? n->cap * 2 : 16;
        torchmp_note *grown = realloc(n->notes, cap * sizeof(*grown));
        if (grown != NULL) {
            n->notes = grown;
            n->cap = cap;
        }
    }
    if (n->count < n->cap) {
        n->notes[n->count].token = token;
        n->notes[n->count].what = what;
        n->count++;
    } else {
        n->overflow = 1;
    }
    if (!n->posted) {
        n->posted = 1;
        torchmp_loop_notify_post(n->wake_w);
    }
    pthread_mutex_unlock(&n->mu);
}

torchmp_note *torchmp_notifier_take(torchmp_notifier *n, size_t *count, int *overflow)
{
    torchmp_note *notes;
    char buf[64];
    pthread_mutex_lock(&n->mu);
    notes = n->notes;
    *count = n->count;
    *overflow = n->overflow;
    n->notes = NULL;
    n->count = n->cap = 0;
    n->overflow = 0;
    if (n->posted) {
        /* Quiet again before the lock is let go: a note posted after this
         * makes it readable anew. */
        while (read(n->wake_r, buf, sizeof(buf)) > 0)
            ;
        n->posted = 0;
    }
    pthread_mutex_unlock(&n->mu);
    if (*count == 0) {
        free(notes);
        return NULL;
    }
    return notes;
}
