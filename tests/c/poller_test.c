/*
 * Direct tests of csrc/poller.c, one backend per run:
 *
 *   poller_test epoll|poll
 *
 * Built and run by tests/test_poller.py against csrc/poller.c alone (plain,
 * TORCHMP_PORTABLE and, where the compiler has them, ASan + UBSan builds).
 * Prints one "ok <case>" line per case that passed, a "FAIL" line per failed
 * check, and a summary; exits 0 only if every check passed.  A backend that
 * is not built in (epoll in a portable build) is checked to say ENOSYS, then
 * the run ends with "not built".
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "torchmp.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static int checks, failures;

#define CHECK(cond)                                                                                                    \
    do {                                                                                                               \
        int saved_errno_ = errno;                                                                                      \
        checks++;                                                                                                      \
        if (!(cond)) {                                                                                                 \
            failures++;                                                                                                \
            printf("FAIL %s:%d: %s (errno %d: %s)\n", __FILE__, __LINE__, #cond, saved_errno_,                         \
                   strerror(saved_errno_));                                                                            \
        }                                                                                                              \
        errno = saved_errno_;                                                                                          \
    } while (0)

/* A call expected to fail with -1 (or NULL) and a given errno. */
#define CHECK_FAILS(call, err)                                                                                         \
    do {                                                                                                               \
        int rc_;                                                                                                       \
        errno = 0;                                                                                                     \
        rc_ = (call);                                                                                                  \
        CHECK(rc_ == -1 && errno == (err));                                                                            \
    } while (0)

/* Setup the test cannot go on without (pipe, socketpair, ...). */
#define REQUIRE(cond)                                                                                                  \
    do {                                                                                                               \
        if (!(cond)) {                                                                                                 \
            printf("FAIL %s:%d: setup: %s (errno %d: %s)\n", __FILE__, __LINE__, #cond, errno, strerror(errno));       \
            exit(2);                                                                                                   \
        }                                                                                                              \
    } while (0)

static int backend;
static const char *backend_name;

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void make_pipe(int fds[2])
{
    REQUIRE(pipe(fds) == 0);
    for (int i = 0; i < 2; i++) {
        REQUIRE(fcntl(fds[i], F_SETFD, FD_CLOEXEC) == 0);
        REQUIRE(fcntl(fds[i], F_SETFL, O_NONBLOCK) == 0);
    }
}

static void close_pipe(int fds[2])
{
    for (int i = 0; i < 2; i++) {
        if (fds[i] >= 0) {
            REQUIRE(close(fds[i]) == 0);
            fds[i] = -1;
        }
    }
}

static void put_byte(int fd)
{
    REQUIRE(write(fd, "x", 1) == 1);
}

static void drain(int fd)
{
    char buf[65536];
    while (read(fd, buf, sizeof(buf)) > 0)
        ;
}

static torchmp_poller *new_poller(void)
{
    torchmp_poller *p = torchmp_poller_new(backend);
    REQUIRE(p != NULL);
    return p;
}

/* How many fds the process has open: none may leak. */
static int open_fd_count(void)
{
    struct rlimit rl;
    int n = 0;
    REQUIRE(getrlimit(RLIMIT_NOFILE, &rl) == 0);
    for (rlim_t fd = 0; fd < rl.rlim_cur && fd < 65536; fd++) {
        if (fcntl((int)fd, F_GETFD) >= 0)
            n++;
    }
    return n;
}

/* ---- cases --------------------------------------------------------------- */

static void case_new_and_free(void)
{
    torchmp_poller *p = new_poller();
    CHECK(torchmp_poller_fd_count(p) == 0);
    if (backend == TORCHMP_BACKEND_EPOLL) {
        int fd = torchmp_poller_fd(p);
        CHECK(fd >= 0 && (fcntl(fd, F_GETFD) & FD_CLOEXEC));
    } else {
        CHECK(torchmp_poller_fd(p) == -1);
    }
    torchmp_poller_free(p);
    torchmp_poller_free(NULL);

    errno = 0;
    CHECK(torchmp_poller_new(0) == NULL && errno == ENOSYS);
    errno = 0;
    CHECK(torchmp_poller_new(99) == NULL && errno == ENOSYS);
}

static void case_timeouts(void)
{
    torchmp_poller *p = new_poller();
    torchmp_event ev[4];
    int fds[2];
    int64_t t0;
    int n;

    /* Nothing watched: the timeout alone. */
    t0 = now_ns();
    n = torchmp_poller_wait(p, ev, 4, 0);
    CHECK(n == 0);
    CHECK(now_ns() - t0 < 500000000LL);
    t0 = now_ns();
    n = torchmp_poller_wait(p, ev, 4, 30);
    CHECK(n == 0);
    CHECK(now_ns() - t0 >= 29000000LL);

    /* Something watched that stays idle. */
    make_pipe(fds);
    CHECK(torchmp_poller_add(p, fds[0], &fds[0]) == 0);
    t0 = now_ns();
    n = torchmp_poller_wait(p, ev, 4, 50);
    CHECK(n == 0);
    CHECK(now_ns() - t0 >= 49000000LL);
    CHECK(now_ns() - t0 < 5000000000LL);
    CHECK(torchmp_poller_del(p, fds[0]) == 0);
    close_pipe(fds);

    /* max_events must be positive. */
    CHECK_FAILS(torchmp_poller_wait(p, ev, 0, 0), EINVAL);
    CHECK_FAILS(torchmp_poller_wait(p, ev, -1, 0), EINVAL);
    torchmp_poller_free(p);
}

static void case_pipe_readiness(void)
{
    torchmp_poller *p = new_poller();
    torchmp_event ev[4];
    int fds[2];
    int tag = 42;
    char c;

    make_pipe(fds);
    CHECK(torchmp_poller_add(p, fds[0], &tag) == 0);
    CHECK(torchmp_poller_fd_count(p) == 1);
    CHECK(torchmp_poller_wait(p, ev, 4, 0) == 0);

    put_byte(fds[1]);
    CHECK(torchmp_poller_wait(p, ev, 4, 0) == 1);
    CHECK(ev[0].ptr == &tag && ev[0].readable == 1);
    /* Level-triggered: still ready until read. */
    CHECK(torchmp_poller_wait(p, ev, 4, 1000) == 1);
    CHECK(ev[0].ptr == &tag && ev[0].readable == 1);
    CHECK(read(fds[0], &c, 1) == 1 && c == 'x');
    CHECK(torchmp_poller_wait(p, ev, 4, 0) == 0);

    /* A write end watched for reading is never ready for it. */
    CHECK(torchmp_poller_add(p, fds[1], &fds[1]) == 0);
    CHECK(torchmp_poller_wait(p, ev, 4, 0) == 0);

    CHECK(torchmp_poller_del(p, fds[0]) == 0);
    CHECK(torchmp_poller_del(p, fds[1]) == 0);
    CHECK(torchmp_poller_fd_count(p) == 0);
    /* Not watched any more: data there, no event. */
    put_byte(fds[1]);
    CHECK(torchmp_poller_wait(p, ev, 4, 0) == 0);
    close_pipe(fds);
    torchmp_poller_free(p);
}

struct delayed_write {
    int fd;
    int delay_ms;
};

static void *write_later(void *arg)
{
    struct delayed_write *d = arg;
    struct timespec ts = { 0, (long)d->delay_ms * 1000000L };
    nanosleep(&ts, NULL);
    put_byte(d->fd);
    return NULL;
}

static void case_wakes_on_data(void)
{
    torchmp_poller *p = new_poller();
    torchmp_event ev[4];
    int fds[2];
    pthread_t th;
    struct delayed_write d;
    int64_t t0;
    int n;

    make_pipe(fds);
    CHECK(torchmp_poller_add(p, fds[0], &fds[0]) == 0);
    d.fd = fds[1];
    d.delay_ms = 50;
    t0 = now_ns();
    REQUIRE(pthread_create(&th, NULL, write_later, &d) == 0);
    n = torchmp_poller_wait(p, ev, 4, -1); /* forever: only the write ends it */
    CHECK(n == 1 && ev[0].ptr == &fds[0]);
    CHECK(now_ns() - t0 >= 49000000LL);
    REQUIRE(pthread_join(th, NULL) == 0);
    CHECK(torchmp_poller_del(p, fds[0]) == 0);
    close_pipe(fds);
    torchmp_poller_free(p);
}

static void case_hangup(void)
{
    torchmp_poller *p = new_poller();
    torchmp_event ev[4];
    int fds[2];
    char buf[8];

    /* The writer goes away: readable (HUP) until read sees EOF. */
    make_pipe(fds);
    CHECK(torchmp_poller_add(p, fds[0], &fds[0]) == 0);
    put_byte(fds[1]);
    REQUIRE(close(fds[1]) == 0);
    fds[1] = -1;
    CHECK(torchmp_poller_wait(p, ev, 4, 1000) == 1 && ev[0].ptr == &fds[0] && ev[0].readable);
    CHECK(read(fds[0], buf, sizeof(buf)) == 1);
    CHECK(torchmp_poller_wait(p, ev, 4, 1000) == 1 && ev[0].ptr == &fds[0] && ev[0].readable);
    CHECK(read(fds[0], buf, sizeof(buf)) == 0);
    CHECK(torchmp_poller_del(p, fds[0]) == 0);
    close_pipe(fds);

    /* The reader goes away: a watched write end reports it (ERR). */
    make_pipe(fds);
    CHECK(torchmp_poller_add_writable(p, fds[1], &fds[1]) == 0);
    REQUIRE(close(fds[0]) == 0);
    fds[0] = -1;
    CHECK(torchmp_poller_wait(p, ev, 4, 1000) == 1 && ev[0].ptr == &fds[1] && ev[0].readable);
    CHECK(torchmp_poller_del(p, fds[1]) == 0);
    close_pipe(fds);

    /* A socket whose peer shut down its writing side. */
    {
        int sv[2];
        REQUIRE(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
        CHECK(torchmp_poller_add(p, sv[0], &sv[0]) == 0);
        CHECK(torchmp_poller_wait(p, ev, 4, 0) == 0);
        REQUIRE(shutdown(sv[1], SHUT_WR) == 0);
        CHECK(torchmp_poller_wait(p, ev, 4, 1000) == 1 && ev[0].ptr == &sv[0]);
        CHECK(torchmp_poller_del(p, sv[0]) == 0);
        REQUIRE(close(sv[0]) == 0 && close(sv[1]) == 0);
    }
    torchmp_poller_free(p);
}

static void case_writable(void)
{
    torchmp_poller *p = new_poller();
    torchmp_event ev[4];
    int fds[2];
    char chunk[4096];
    long filled = 0;
    ssize_t n;

    make_pipe(fds);
    CHECK(torchmp_poller_add_writable(p, fds[1], &fds[1]) == 0);
    CHECK(torchmp_poller_fd_count(p) == 1);
    CHECK(torchmp_poller_wait(p, ev, 4, 0) == 1 && ev[0].ptr == &fds[1] && ev[0].readable);

    /* Full: not writable any more. */
    memset(chunk, 'y', sizeof(chunk));
    while ((n = write(fds[1], chunk, sizeof(chunk))) > 0)
        filled += n;
    CHECK(n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK));
    CHECK(filled > 0);
    CHECK(torchmp_poller_wait(p, ev, 4, 0) == 0);

    /* Drained: writable again. */
    drain(fds[0]);
    CHECK(torchmp_poller_wait(p, ev, 4, 1000) == 1 && ev[0].ptr == &fds[1]);
    CHECK(torchmp_poller_del(p, fds[1]) == 0);
    close_pipe(fds);
    torchmp_poller_free(p);
}

/* There is no modify: del, then add the other way (what the loop does with
 * a console fd). */
static void case_modify(void)
{
    torchmp_poller *p = new_poller();
    torchmp_event ev[4];
    int sv[2];
    int as_reader = 1, as_writer = 2;

    REQUIRE(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    REQUIRE(fcntl(sv[0], F_SETFL, O_NONBLOCK) == 0);

    CHECK(torchmp_poller_add(p, sv[0], &as_reader) == 0);
    CHECK(torchmp_poller_wait(p, ev, 4, 0) == 0); /* nothing to read */

    CHECK(torchmp_poller_del(p, sv[0]) == 0);
    CHECK(torchmp_poller_add_writable(p, sv[0], &as_writer) == 0);
    CHECK(torchmp_poller_fd_count(p) == 1);
    CHECK(torchmp_poller_wait(p, ev, 4, 0) == 1 && ev[0].ptr == &as_writer);

    CHECK(torchmp_poller_del(p, sv[0]) == 0);
    CHECK(torchmp_poller_add(p, sv[0], &as_reader) == 0);
    CHECK(torchmp_poller_wait(p, ev, 4, 0) == 0);
    put_byte(sv[1]);
    CHECK(torchmp_poller_wait(p, ev, 4, 1000) == 1 && ev[0].ptr == &as_reader);
    CHECK(torchmp_poller_fd_count(p) == 1);

    CHECK(torchmp_poller_del(p, sv[0]) == 0);
    CHECK(torchmp_poller_fd_count(p) == 0);
    REQUIRE(close(sv[0]) == 0 && close(sv[1]) == 0);
    torchmp_poller_free(p);
}

static void case_errors(void)
{
    torchmp_poller *p = new_poller();
    torchmp_event ev[4];
    int fds[2];
    int tag;

    make_pipe(fds);
    {
        /* Two fd numbers that are not open now. */
        int bad_r, bad_w;
        int probe[2];
        make_pipe(probe);
        bad_r = probe[0];
        bad_w = probe[1];
        close_pipe(probe);

        /* Bad fds: refused, nothing counted. */
        CHECK_FAILS(torchmp_poller_add(p, -1, &tag), EBADF);
        CHECK_FAILS(torchmp_poller_add(p, bad_r, &tag), EBADF);
        CHECK_FAILS(torchmp_poller_add_writable(p, bad_w, &tag), EBADF);
        CHECK(torchmp_poller_fd_count(p) == 0);
    }

    /* Twice the same fd: refused, either way. */
    CHECK(torchmp_poller_add(p, fds[0], &tag) == 0);
    CHECK_FAILS(torchmp_poller_add(p, fds[0], &tag), EEXIST);
    CHECK_FAILS(torchmp_poller_add_writable(p, fds[0], &tag), EEXIST);
    CHECK(torchmp_poller_fd_count(p) == 1);

    /* del of what is not watched. */
    CHECK_FAILS(torchmp_poller_del(p, fds[1]), ENOENT);
    CHECK(torchmp_poller_del(p, fds[0]) == 0);
    CHECK_FAILS(torchmp_poller_del(p, fds[0]), ENOENT);
    CHECK(torchmp_poller_fd_count(p) == 0);

    /* After the failures the poller still works. */
    CHECK(torchmp_poller_add(p, fds[0], &tag) == 0);
    put_byte(fds[1]);
    CHECK(torchmp_poller_wait(p, ev, 4, 1000) == 1 && ev[0].ptr == &tag);
    CHECK(torchmp_poller_del(p, fds[0]) == 0);
    close_pipe(fds);

    /* A regular file: epoll cannot watch one (EPERM: the loop then pumps
     * such a console on a timer); poll() says it is always ready. */
    {
        char path[] = "/tmp/torchmp-poller-test-XXXXXX";
        int fd = mkstemp(path);
        REQUIRE(fd >= 0);
        REQUIRE(unlink(path) == 0);
        if (backend == TORCHMP_BACKEND_EPOLL) {
            CHECK_FAILS(torchmp_poller_add(p, fd, &tag), EPERM);
            CHECK_FAILS(torchmp_poller_add_writable(p, fd, &tag), EPERM);
            CHECK(torchmp_poller_fd_count(p) == 0);
        } else {
            CHECK(torchmp_poller_add_writable(p, fd, &tag) == 0);
            CHECK(torchmp_poller_wait(p, ev, 4, 0) == 1 && ev[0].ptr == &tag);
            CHECK(torchmp_poller_del(p, fd) == 0);
        }
        REQUIRE(close(fd) == 0);
    }
    torchmp_poller_free(p);
}

/* Wait (max_events at a time) until every fd whose tag is rem modulo mod
 * has been reported, checking that no other fd is and that no wait returns
 * more than it may; returns how many distinct fds were reported. */
static int collect(torchmp_poller *p, torchmp_event *ev, int max_events, int *seen, int ntags, int mod, int rem)
{
    int expected = 0, distinct = 0, cap;
    for (int k = 0; k < ntags; k++)
        expected += k % mod == rem;
    cap = max_events < TORCHMP_POLLER_MAX_EVENTS ? max_events : TORCHMP_POLLER_MAX_EVENTS;
    /* Level-triggered, fair: ceil(expected / cap) waits see every one. */
    for (int round = 0; round < (expected + cap - 1) / cap; round++) {
        int n = torchmp_poller_wait(p, ev, max_events, 1000);
        CHECK(n > 0 && n <= cap);
        for (int i = 0; i < n; i++) {
            int k = *(int *)ev[i].ptr;
            CHECK(k >= 0 && k < ntags && k % mod == rem && ev[i].readable);
            if (k >= 0 && k < ntags && !seen[k]) {
                seen[k] = 1;
                distinct++;
            }
        }
    }
    return distinct;
}

static void case_many_fds(void)
{
    torchmp_poller *p = new_poller();
    struct rlimit rl;
    int npipes, (*fds)[2], *tags, *seen;
    torchmp_event *ev;
    int n, ready, rounds;

    /* As many fds as the limit allows (up to 2000 pipe ends). */
    REQUIRE(getrlimit(RLIMIT_NOFILE, &rl) == 0);
    if (rl.rlim_cur < 4096 && rl.rlim_max > rl.rlim_cur) {
        rl.rlim_cur = rl.rlim_max < 4096 ? rl.rlim_max : 4096;
        (void)setrlimit(RLIMIT_NOFILE, &rl);
        REQUIRE(getrlimit(RLIMIT_NOFILE, &rl) == 0);
    }
    npipes = (int)((rl.rlim_cur - 64) / 2);
    if (npipes > 1000)
        npipes = 1000;
    REQUIRE(npipes >= 100);
    fds = calloc((size_t)npipes, sizeof(*fds));
    tags = calloc((size_t)npipes, sizeof(*tags));
    seen = calloc((size_t)npipes, sizeof(*seen));
    ev = calloc((size_t)npipes, sizeof(*ev));
    REQUIRE(fds != NULL && tags != NULL && seen != NULL && ev != NULL);

    for (int i = 0; i < npipes; i++) {
        make_pipe(fds[i]);
        tags[i] = i;
        CHECK(torchmp_poller_add(p, fds[i][0], &tags[i]) == 0);
    }
    CHECK(torchmp_poller_fd_count(p) == npipes);
    CHECK(torchmp_poller_wait(p, ev, npipes, 0) == 0);

    /* Every third pipe has data: exactly those come back, at most
     * TORCHMP_POLLER_MAX_EVENTS a wait. */
    for (int i = 0; i < npipes; i += 3)
        put_byte(fds[i][1]);
    ready = (npipes + 2) / 3;
    CHECK(collect(p, ev, npipes, seen, npipes, 3, 0) == ready);

    /* All ready, fewer slots than fds: over ceil(npipes / 64) waits every
     * fd gets its turn (none starves behind the first 64). */
    for (int i = 0; i < npipes; i++) {
        if (i % 3 != 0)
            put_byte(fds[i][1]);
    }
    memset(seen, 0, (size_t)npipes * sizeof(*seen));
    rounds = (npipes + 63) / 64;
    for (int r = 0; r < rounds; r++) {
        n = torchmp_poller_wait(p, ev, 64, 1000);
        CHECK(n == 64);
        for (int i = 0; i < n; i++)
            seen[*(int *)ev[i].ptr] = 1;
    }
    {
        int missed = 0;
        for (int i = 0; i < npipes; i++)
            missed += !seen[i];
        CHECK(missed == 0);
    }

    /* Remove every other one: only the rest is left, and reported. */
    for (int i = 0; i < npipes; i += 2)
        CHECK(torchmp_poller_del(p, fds[i][0]) == 0);
    CHECK(torchmp_poller_fd_count(p) == npipes / 2);
    memset(seen, 0, (size_t)npipes * sizeof(*seen));
    CHECK(collect(p, ev, npipes, seen, npipes, 2, 1) == npipes / 2);
    for (int i = 1; i < npipes; i += 2)
        CHECK(torchmp_poller_del(p, fds[i][0]) == 0);
    CHECK(torchmp_poller_fd_count(p) == 0);

    for (int i = 0; i < npipes; i++)
        close_pipe(fds[i]);
    free(fds);
    free(tags);
    free(seen);
    free(ev);
    torchmp_poller_free(p);
}

static void on_alarm(int sig)
{
    (void)sig;
}

/* A signal while waiting: no events, no error (EINTR is not a failure). */
static void case_interrupted(void)
{
    torchmp_poller *p = new_poller();
    torchmp_event ev[4];
    struct sigaction sa, old;
    struct itimerval it;
    int fds[2];
    int n;

    make_pipe(fds);
    CHECK(torchmp_poller_add(p, fds[0], &fds[0]) == 0);
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_alarm; /* no SA_RESTART */
    REQUIRE(sigaction(SIGALRM, &sa, &old) == 0);
    memset(&it, 0, sizeof(it));
    it.it_value.tv_usec = 30000;
    REQUIRE(setitimer(ITIMER_REAL, &it, NULL) == 0);
    errno = 0;
    n = torchmp_poller_wait(p, ev, 4, 5000);
    CHECK(n == 0);
    REQUIRE(sigaction(SIGALRM, &old, NULL) == 0);
    CHECK(torchmp_poller_del(p, fds[0]) == 0);
    close_pipe(fds);
    torchmp_poller_free(p);
}

/* The epoll fd is itself pollable: readable while an event is ready (the
 * loop nests the exits set this way, and waiting callers poll it). */
static void case_nested(void)
{
    torchmp_poller *p, *outer;
    torchmp_event ev[4];
    int fds[2];
    int pfd, tag = 7;

    if (backend != TORCHMP_BACKEND_EPOLL)
        return;
    p = new_poller();
    outer = new_poller();
    pfd = torchmp_poller_fd(p);
    make_pipe(fds);
    CHECK(torchmp_poller_add(p, fds[0], &fds[0]) == 0);
    CHECK(torchmp_poller_add(outer, pfd, &tag) == 0);
    CHECK(torchmp_wait_readable(pfd, -1, -1, 0) == 0);
    CHECK(torchmp_poller_wait(outer, ev, 4, 0) == 0);
    put_byte(fds[1]);
    CHECK(torchmp_wait_readable(pfd, -1, -1, 1000000000LL) == 1);
    CHECK(torchmp_poller_wait(outer, ev, 4, 1000) == 1 && ev[0].ptr == &tag);
    CHECK(torchmp_poller_wait(p, ev, 4, 0) == 1 && ev[0].ptr == &fds[0]);
    drain(fds[0]);
    CHECK(torchmp_wait_readable(pfd, -1, -1, 0) == 0);
    CHECK(torchmp_poller_del(outer, pfd) == 0);
    CHECK(torchmp_poller_del(p, fds[0]) == 0);
    close_pipe(fds);
    torchmp_poller_free(outer);
    torchmp_poller_free(p);
}

static void case_wait_readable(void)
{
    int a[2], b[2], c[2];
    int64_t t0;

    make_pipe(a);
    make_pipe(b);
    make_pipe(c);
    CHECK(torchmp_wait_readable(a[0], b[0], c[0], 0) == 0);
    t0 = now_ns();
    CHECK(torchmp_wait_readable(a[0], b[0], c[0], 20000000LL) == 0);
    CHECK(now_ns() - t0 >= 19000000LL);
    put_byte(b[1]);
    CHECK(torchmp_wait_readable(a[0], b[0], c[0], -1) == 2);
    CHECK(torchmp_wait_readable(a[0], -1, -1, 0) == 0); /* a negative other_fd or signal_fd is ignored */
    put_byte(a[1]);
    CHECK(torchmp_wait_readable(a[0], b[0], c[0], 0) == 3);
    CHECK(torchmp_wait_readable(a[0], -1, -1, 0) == 1);
    put_byte(c[1]);
    CHECK(torchmp_wait_readable(a[0], b[0], c[0], 0) == 7);
    CHECK(torchmp_wait_readable(-1, -1, c[0], -1) == 4);
    drain(a[0]);
    drain(b[0]);
    drain(c[0]);
    close_pipe(b);
    close_pipe(c);
    REQUIRE(close(a[1]) == 0);
    a[1] = -1;
    CHECK(torchmp_wait_readable(a[0], -1, -1, 1000000000LL) == 1); /* EOF counts */
    close_pipe(a);
}

int main(int argc, char **argv)
{
    int fds_before, fds_after;

    if (argc != 2 || (strcmp(argv[1], "epoll") != 0 && strcmp(argv[1], "poll") != 0)) {
        fprintf(stderr, "usage: %s epoll|poll\n", argv[0]);
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    backend_name = argv[1];
    backend = strcmp(argv[1], "epoll") == 0 ? TORCHMP_BACKEND_EPOLL : TORCHMP_BACKEND_POLL;
    signal(SIGPIPE, SIG_IGN);

    {
        torchmp_poller *probe;
        errno = 0;
        probe = torchmp_poller_new(backend);
        if (probe == NULL) {
            CHECK(errno == ENOSYS);
            printf("%s: not built (%s)\n", backend_name, strerror(errno));
            return failures ? 1 : 0;
        }
        torchmp_poller_free(probe);
    }

    fds_before = open_fd_count();
#define RUN(name)                                                                                                      \
    do {                                                                                                               \
        int before_ = failures;                                                                                        \
        name();                                                                                                        \
        if (failures == before_)                                                                                       \
            printf("ok %s\n", #name);                                                                                  \
    } while (0)
    RUN(case_new_and_free);
    RUN(case_timeouts);
    RUN(case_pipe_readiness);
    RUN(case_wakes_on_data);
    RUN(case_hangup);
    RUN(case_writable);
    RUN(case_modify);
    RUN(case_errors);
    RUN(case_many_fds);
    RUN(case_interrupted);
    RUN(case_nested);
    RUN(case_wait_readable);
    fds_after = open_fd_count();
    CHECK(fds_after == fds_before);

    printf("%s: %d checks, %d failed\n", backend_name, checks, failures);
    return failures ? 1 : 0;
}
