/*
 * Readiness backends for the I/O thread: epoll on Linux, poll() elsewhere (or
 * when forced with TORCHMP_BACKEND=poll).  Both are level-triggered and follow
 * the stdlib selectors contract: HUP and ERR count as readable (the reader
 * then sees 0 or an error), EINTR returns no events.  The two answer the
 * same errors (see torchmp.h); tests/c/poller_test.c checks both.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "torchmp.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifdef TORCHMP_HAVE_EPOLL
#include <sys/epoll.h>
#endif

typedef struct {
    int fd;
    short events;             /* POLLIN or POLLOUT */
    void *ptr;
} watch_slot;

struct torchmp_poller {
    int backend;
    int epfd;                 /* epoll backend */
    int count;                /* registered fds */
    /* poll backend: registered fds, and the pollfd array rebuilt per wait */
    watch_slot *slots;
    int slots_cap;
    struct pollfd *pfds;
    int pfds_cap;
    int next;                 /* where the next scan starts: more ready fds than
                               * max_events take turns, as epoll's do */
};

torchmp_poller *torchmp_poller_new(int backend)
{
    torchmp_poller *p = calloc(1, sizeof(*p));
    if (p == NULL)
        return NULL;
    p->backend = backend;
    p->epfd = -1;
#ifdef TORCHMP_HAVE_EPOLL
    if (backend == TORCHMP_BACKEND_EPOLL) {
        p->epfd = epoll_create1(EPOLL_CLOEXEC);
        if (p->epfd < 0) {
            int saved = errno;
            free(p);
            errno = saved;
            return NULL;
        }
        return p;
    }
#endif
    if (backend != TORCHMP_BACKEND_POLL) {
        free(p);
        errno = ENOSYS;
        return NULL;
    }
    return p;
}

void torchmp_poller_free(torchmp_poller *p)
{
    if (p == NULL)
        return;
    if (p->epfd >= 0)
        close(p->epfd);
    free(p->slots);
    free(p->pfds);
    free(p);
}

static int poller_add(torchmp_poller *p, int fd, void *ptr, int writable)
{
#ifdef TORCHMP_HAVE_EPOLL
    if (p->backend == TORCHMP_BACKEND_EPOLL) {
        struct epoll_event ev;
        memset(&ev, 0, sizeof(ev));
        ev.events = writable ? EPOLLOUT : EPOLLIN;
        ev.data.ptr = ptr;
        if (epoll_ctl(p->epfd, EPOLL_CTL_ADD, fd, &ev) != 0)
            return -1;
        /* (atomic: the exits set gains ranks from a spawning caller thread
         * while the loop thread removes the ones that exited) */
        __atomic_add_fetch(&p->count, 1, __ATOMIC_RELAXED);
        return 0;
    }
#endif
    /* What epoll_ctl would refuse: a closed fd, one already registered. */
    if (fd < 0 || fcntl(fd, F_GETFD) < 0) {
        errno = EBADF;
        return -1;
    }
    for (int i = 0; i < p->count; i++) {
        if (p->slots[i].fd == fd) {
            errno = EEXIST;
            return -1;
        }
    }
    if (p->count == p->slots_cap) {
        int cap = p->slots_cap ? p->slots_cap * 2 : 64;
        watch_slot *grown = realloc(p->slots, (size_t)cap * sizeof(*grown));
        if (grown == NULL)
            return -1;
        p->slots = grown;
        p->slots_cap = cap;
    }
    p->slots[p->count].fd = fd;
    p->slots[p->count].events = writable ? POLLOUT : POLLIN;
    p->slots[p->count].ptr = ptr;
    p->count++;
    return 0;
}

int torchmp_poller_add(torchmp_poller *p, int fd, void *ptr)
{
    return poller_add(p, fd, ptr, 0);
}

int torchmp_poller_add_writable(torchmp_poller *p, int fd, void *ptr)
{
    return poller_add(p, fd, ptr, 1);
}

int torchmp_poller_del(torchmp_poller *p, int fd)
{
#ifdef TORCHMP_HAVE_EPOLL
    if (p->backend == TORCHMP_BACKEND_EPOLL) {
        /* A non-NULL event pointer keeps pre-2.6.9 kernels happy. */
        struct epoll_event ev;
        memset(&ev, 0, sizeof(ev));
        if (epoll_ctl(p->epfd, EPOLL_CTL_DEL, fd, &ev) != 0)
            return -1;
        __atomic_sub_fetch(&p->count, 1, __ATOMIC_RELAXED);
        return 0;
    }
#endif
    for (int i = 0; i < p->count; i++) {
        if (p->slots[i].fd == fd) {
            p->slots[i] = p->slots[p->count - 1];
            p->count--;
            return 0;
        }
    }
    errno = ENOENT;
    return -1;
}

int torchmp_poller_fd_count(const torchmp_poller *p)
{
    return p->count;
}

int torchmp_poller_fd(const torchmp_poller *p)
{
    return p->epfd;
}

int torchmp_poller_wait(torchmp_poller *p, torchmp_event *events, int max_events, int timeout_ms)
{
    if (max_events <= 0) {
        errno = EINVAL;
        return -1;
    }
    if (max_events > TORCHMP_POLLER_MAX_EVENTS)
        max_events = TORCHMP_POLLER_MAX_EVENTS;
#ifdef TORCHMP_HAVE_EPOLL
    if (p->backend == TORCHMP_BACKEND_EPOLL) {
        struct epoll_event evs[TORCHMP_POLLER_MAX_EVENTS];
        int n = epoll_wait(p->epfd, evs, max_events, timeout_ms);
        if (n < 0)
            return errno == EINTR ? 0 : -1;
        for (int i = 0; i < n; i++) {
            events[i].ptr = evs[i].data.ptr;
            events[i].readable = (evs[i].events & (EPOLLIN | EPOLLOUT | EPOLLHUP | EPOLLERR)) != 0;
        }
        return n;
    }
#endif
    {
        int n, out = 0, start, last = -1;
        if (p->count > p->pfds_cap) {
            struct pollfd *grown = realloc(p->pfds, (size_t)p->slots_cap * sizeof(*grown));
            if (grown == NULL)
                return -1;
            p->pfds = grown;
            p->pfds_cap = p->slots_cap;
        }
        for (int i = 0; i < p->count; i++) {
            p->pfds[i].fd = p->slots[i].fd;
            p->pfds[i].events = p->slots[i].events;
            p->pfds[i].revents = 0;
        }
        n = poll(p->pfds, (nfds_t)p->count, timeout_ms);
        if (n < 0)
            return errno == EINTR ? 0 : -1;
        start = p->count > 0 ? p->next % p->count : 0;
        for (int k = 0; k < p->count && out < max_events; k++) {
            int i = (start + k) % p->count;
            if (p->pfds[i].revents & (POLLIN | POLLOUT | POLLHUP | POLLERR | POLLNVAL)) {
                events[out].ptr = p->slots[i].ptr;
                events[out].readable = 1;
                out++;
                last = i;
            }
        }
        /* Cut short by max_events: the next wait starts after the last fd
         * reported, so every ready fd gets its turn. */
        if (out == max_events && last >= 0)
            p->next = last + 1;
        return out;
    }
}

int torchmp_wait_readable(int fd, int other_fd, int signal_fd, int64_t timeout_ns)
{
    struct pollfd p[3];
    int rc;
    for (int i = 0; i < 3; i++) {
        p[i].fd = i == 0 ? fd : i == 1 ? other_fd : signal_fd; /* poll() skips a negative fd */
        p[i].events = POLLIN;
        p[i].revents = 0;
    }
#ifdef TORCHMP_HAVE_PPOLL
    if (timeout_ns >= 0) {
        struct timespec ts;
        ts.tv_sec = (time_t)(timeout_ns / 1000000000);
        ts.tv_nsec = (long)(timeout_ns % 1000000000);
        rc = ppoll(p, 3, &ts, NULL);
    } else {
        rc = ppoll(p, 3, NULL, NULL);
    }
#else
    if (timeout_ns < 0) {
        rc = poll(p, 3, -1);
    } else {
        /* Round up, as selectors do: never wake just before the deadline. */
        int64_t ms = (timeout_ns + 999999) / 1000000;
        rc = poll(p, 3, ms > INT32_MAX ? INT32_MAX : (int)ms);
    }
#endif
    if (rc <= 0)
        return rc;
    return (p[0].revents != 0 ? 1 : 0) | (p[1].revents != 0 ? 2 : 0) | (p[2].revents != 0 ? 4 : 0);
}
