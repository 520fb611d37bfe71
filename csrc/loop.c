/*
 * The process-wide I/O thread.
 *
 * Why one thread per process (not per context): no extra threads whatever the
 * number of contexts or ranks; and every worker is forked from this thread,
 * which lives as long as the process, because PR_SET_PDEATHSIG fires when the
 * *forking thread* exits -- forking from a short-lived caller thread would
 * kill the workers when that thread ends.
 *
 * The thread blocks every signal (so the launcher's Python handlers run on
 * the main thread, and vfork is safe here) and waits on one readiness set:
 * a control fd (commands from Python), each teed pipe, and with the epoll
 * backend a pidfd per worker (in a nested epoll set that waiting callers
 * watch as well).  With the poll backend, exits arrive as a SIGCHLD whose
 * handler writes to the control fd.
 *
 * Locking: `mu` guards the command queue and every field Python reads (the
 * rank states).  Streams and the group list belong to the loop thread alone.
 * The GIL serialises the Python-side entry points, including loop creation.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "torchmp.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifdef TORCHMP_HAVE_EVENTFD
#include <sys/eventfd.h>
#endif
#ifdef TORCHMP_HAVE_PIDFD
#include <sys/syscall.h>
/* Build hosts with kernel headers older than 5.3 (the manylinux images) do not
 * name it; the number is the same on every architecture (the unified table). */
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#endif

#define READ_CHUNK (1024 * 1024)
#define SCRATCH_SIZE (256 * 1024)
/* A stream that fills its default 64 KiB pipe gets a 1 MiB one, so a chatty
 * worker blocks (and context-switches) 16 times less often.  Pipe memory is
 * a per-user resource (fs/pipe-user-pages-soft: past it, new pipes of every
 * program of the user shrink to one page), so the total is capped. */
#define DEFAULT_PIPE_SIZE (64 * 1024)
#define BUSY_PIPE_SIZE (1024 * 1024)
#define PIPE_GROWTH_BUDGET (16L * 1024 * 1024)
#define MAX_LINE (256 * 1024)
#define MAX_EVENTS 256

/* What a watch in the I/O thread's set is: the first int of its pointer.  The
 * pidfds in the exits set point at their torchmp_proc directly. */
enum watch_kind { WATCH_CONTROL = 1, WATCH_STREAM = 2, WATCH_EXITS = 3, WATCH_CONSOLE = 4 };

/* A console the loop writes to the launcher's fd 1 or 2 through (console.c),
 * one per target, shared by every stream teed there. */
typedef struct console_entry {
    int kind;                  /* WATCH_CONSOLE: first member, for dispatch */
    torchmp_console *console;
    int users;                 /* streams writing to it */
    int watched;               /* 1: in the poller for writability (bytes wait);
                                * -1: pumped on a timer instead; 0: idle */
    int watched_fd;            /* the fd registered (the console may close it) */
    struct console_entry *next;
} console_entry;

typedef struct torchmp_proc torchmp_proc;

typedef struct stream {
    int kind;                  /* WATCH_STREAM: first member, for dispatch */
    int fd;                    /* pipe read end; -1 when not teed or closed */
    int log_fd;                /* -1: none, or switched off after an error */
    int log_errno;
    int which;                 /* STREAM_OUT, STREAM_ERR or STREAM_RET */
    char *prefix;
    torchmp_framer framer;
    /* TEE with a console: where the lines are shown, and what they are for
     * the console's bound and marker line */
    torchmp_console *console;
    console_entry *console_entry;      /* fd consoles: the loop's entry */
    torchmp_console_source source;
    char *log_path;
    /* on L->timed while the framer has a deadline (loop thread) */
    struct stream *timed_prev, *timed_next;
    int timed;
    /* STREAM_RET: the bytes read so far (mu: Python takes them) */
    char *capture;
    size_t capture_len, capture_cap;
    int capture_errno;
    int pipe_grown;            /* bytes of pipe capacity taken from the budget; -1: gave up */
    /* mu: what failure reports and hang reports read from other threads */
    int open;                  /* the pipe is being drained */
    int64_t last_data_ns;      /* when bytes last came, 0: never */
    char *tail;                /* ring of the last tail_cap bytes (NULL: none kept) */
    size_t tail_cap, tail_len, tail_end;  /* tail_end: where the next byte goes */
    torchmp_proc *proc;
} stream;

enum { STREAM_OUT = 0, STREAM_ERR = 1, STREAM_RET = 2, STREAM_COUNT = 3 };

struct torchmp_proc {
    int rank;
    int pidfd;
    int foreign;               /* a forkserver's child: exits come as a trailer */
    int foreign_gone;          /* its pidfd fired: the trailer is on its way */
    int exiting;               /* proc_record_exit is running for it */
    /* fields below `mu` guards */
    /* Exited but not reaped yet: the zombie (ours, or the forkserver's until
     * Python releases it) pins the pid and so the process group id, which
     * therefore cannot belong to anybody else while torchmp may signal it. */
    int unreaped;
    int keeper_slot;           /* the group's slot in the keeper's table, 0: none */
    torchmp_proc_info info;
    stream streams[STREAM_COUNT];
    torchmp_group *group;
};

struct torchmp_group {
    struct torchmp_loop *loop;
    int nprocs;
    torchmp_proc *procs;
    torchmp_needles needles[2];
    int has_needles[2];
    int filtered_fd[2];
    int filtered_errno[2];
    int console_fd[2];         /* 1 and 2, or -1 once broken for this group */
    int console_errno[2];
    /* Callers sleeping in torchmp_group_wait, each on a wake fd of its own:
     * a shared fd drained by one waiter could hide an exit from another. */
    struct group_waiter *waiters;  /* mu */
    int interrupted;           /* mu: torchmp_group_interrupt was called */
    int has_pipes;             /* caller thread: some stream is a pipe the loop drains */
    uint64_t version;          /* mu */
    int released;              /* loop thread */
    int running;               /* loop thread */
    int open_streams;          /* loop thread */
    int linked;                /* loop thread: on L->groups */
    torchmp_group *next;
};

typedef struct group_waiter {
    int wake_r, wake_w;
    struct group_waiter *next;
} group_waiter;

enum cmd_type {
    CMD_SPAWN = 1, CMD_FINISH = 2, CMD_RELEASE = 3, CMD_PREPARE = 4, CMD_ADOPT = 5, CMD_DROP_UNSTARTED = 6
};

typedef struct command {
    int type;
    torchmp_group *group;
    torchmp_rank_spec *specs;  /* SPAWN, PREPARE */
    int count;
    const int *ranks;          /* ADOPT */
    const pid_t *pids;         /* ADOPT */
    const int64_t *start_ns;   /* ADOPT: CLOCK_MONOTONIC at fork, or NULL for now */
    int foreign;               /* ADOPT */
    torchmp_exec_error err;
    int result;
    int done;
    struct command *next;
} command;

typedef struct torchmp_loop {
    int kind;                  /* WATCH_CONTROL: the wake fd's watch */
    pid_t owner_pid;
    int backend;
    torchmp_poller *poller;
    /* epoll backend: the workers' pidfds, in an epoll set of their own that
     * sits in `poller`.  Waiting callers watch it too, so an exit wakes them
     * together with this thread rather than one wake-up after it. */
    torchmp_poller *exits;
    int exits_kind;            /* WATCH_EXITS: the exits set's watch */
    int wake_r, wake_w;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cmd_done;
    command *cmd_head, *cmd_tail;
    torchmp_group *groups;
    char *readbuf;
    long pipe_budget;          /* pipe capacity we may still add to busy streams */
    char *console_scratch;     /* framed console lines are assembled here */
    char *filtered_scratch;
    /* fd consoles (list changes under mu: Python reads the backlogs) */
    console_entry *consoles;
    /* streams whose framer has a deadline, and the earliest (a lower bound
     * once streams leave the list: waking early costs one pass) */
    struct stream *timed;
    int64_t next_deadline_ns;
    uint64_t stream_serial;
    int consoles_polled;       /* some console waits on a timer, not the poller */
    int use_vfork;
    long max_fd;
} torchmp_loop;

static torchmp_loop *the_loop;

/* ---- small helpers ------------------------------------------------------ */

static int64_t clock_ns(clockid_t clk)
{
    struct timespec ts;
    clock_gettime(clk, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void close_fd(int *fd)
{
    if (*fd >= 0) {
        close(*fd);
        *fd = -1;
    }
}

/* A wakeup channel: an eventfd, or a non-blocking pipe where there is none. */
static int notify_open(int *r, int *w)
{
#ifdef TORCHMP_HAVE_EVENTFD
    int fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (fd < 0)
        return -1;
    *r = *w = fd;
    return 0;
#else
    int p[2];
    if (pipe(p) != 0)
        return -1;
    for (int i = 0; i < 2; i++) {
        int fl = fcntl(p[i], F_GETFL);
        if (fl < 0 || fcntl(p[i], F_SETFL, fl | O_NONBLOCK) != 0 ||
            fcntl(p[i], F_SETFD, FD_CLOEXEC) != 0) {
            int saved = errno;
            close(p[0]);
            close(p[1]);
            errno = saved;
            return -1;
        }
    }
    *r = p[0];
    *w = p[1];
    return 0;
#endif
}

static void notify_close(int *r, int *w)
{
    if (*w != *r)
        close_fd(w);
    close_fd(r);
    *w = -1;
}

/* Async-signal-safe: also called from the SIGCHLD handler. */
static void notify_post(int w)
{
    int saved = errno;
#ifdef TORCHMP_HAVE_EVENTFD
    uint64_t one = 1;
    ssize_t n = write(w, &one, sizeof(one));
#else
    char one = 1;
    ssize_t n = write(w, &one, 1);
#endif
    (void)n; /* EAGAIN: already signalled, which is all we need */
    errno = saved;
}

static void notify_drain(int r)
{
    char buf[64];
    while (read(r, buf, sizeof(buf)) > 0)
        ;
}

/* ---- SIGCHLD for the poll backend --------------------------------------- */

static struct sigaction previous_sigchld;
static volatile int sigchld_wake_fd = -1;

static void on_sigchld(int sig, siginfo_t *info, void *ctx)
{
    int fd = sigchld_wake_fd;
    if (fd >= 0)
        notify_post(fd);
    /* Chain to whatever handler was there before us. */
    if (previous_sigchld.sa_flags & SA_SIGINFO) {
        if (previous_sigchld.sa_sigaction != NULL)
            previous_sigchld.sa_sigaction(sig, info, ctx);
    } else if (previous_sigchld.sa_handler != SIG_DFL && previous_sigchld.sa_handler != SIG_IGN &&
               previous_sigchld.sa_handler != NULL) {
        previous_sigchld.sa_handler(sig);
    }
}

static int install_sigchld(int wake_fd)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = on_sigchld;
    sa.sa_flags = SA_SIGINFO | SA_RESTART | SA_NOCLDSTOP;
    sigemptyset(&sa.sa_mask);
    sigchld_wake_fd = wake_fd;
    return sigaction(SIGCHLD, &sa, &previous_sigchld);
}

/* ---- consoles ----------------------------------------------------------- */

/* The console for what the launcher's fd refers to now (one per target), or
 * NULL with errno.  Loop thread. */
static console_entry *console_entry_for_fd(torchmp_loop *L, int fd)
{
    console_entry *e;
    for (e = L->consoles; e != NULL; e = e->next) {
        if (torchmp_console_same_target(e->console, fd)) {
            e->users++;
            return e;
        }
    }
    e = calloc(1, sizeof(*e));
    if (e == NULL)
        return NULL;
    e->kind = WATCH_CONSOLE;
    e->console = torchmp_console_open_fd(fd);
    if (e->console == NULL) {
        int saved = errno;
        free(e);
        errno = saved;
        return NULL;
    }
    e->users = 1;
    pthread_mutex_lock(&L->mu);
    e->next = L->consoles;
    L->consoles = e;
    pthread_mutex_unlock(&L->mu);
    return e;
}

/* Free an fd console nobody writes to once it has nothing left to show. */
static void console_entry_maybe_free(torchmp_loop *L, console_entry *e)
{
    console_entry **link;
    if (e->users > 0 || e->watched)
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

/* Bytes wait in the console: write the rest when its fd takes more. */
static void console_entry_watch(torchmp_loop *L, console_entry *e)
{
    int fd;
    if (e->watched)
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

static void console_entry_writable(torchmp_loop *L, console_entry *e);

/* Pump the consoles that could not be watched; 1 while any still waits. */
static int consoles_poll(torchmp_loop *L)
{
    int left = 0;
    console_entry *e, *next;
    for (e = L->consoles; e != NULL; e = next) {
        next = e->next;
        if (e->watched == -1) {
            console_entry_writable(L, e);
            left = 1;
        }
    }
    return left;
}

static void console_entry_writable(torchmp_loop *L, console_entry *e)
{
    if (torchmp_console_pump(e->console))
        return;
    /* By the number it was registered with: a console that broke closed
     * its fd already (epoll dropped it then; the poll backend has not). */
    if (e->watched == 1)
        (void)torchmp_poller_del(L->poller, e->watched_fd);
    e->watched = 0;
    console_entry_maybe_free(L, e);
}

/* ---- streams ------------------------------------------------------------ */

static void timed_add(torchmp_loop *L, stream *s)
{
    int64_t d = s->framer.deadline_ns;
    if (d == 0)
        return;
    if (!s->timed) {
        s->timed = 1;
        s->timed_prev = NULL;
        s->timed_next = L->timed;
        if (L->timed != NULL)
            L->timed->timed_prev = s;
        L->timed = s;
    }
    if (L->next_deadline_ns == 0 || d < L->next_deadline_ns)
        L->next_deadline_ns = d;
}

static void timed_remove(torchmp_loop *L, stream *s)
{
    if (!s->timed)
        return;
    if (s->timed_prev != NULL)
        s->timed_prev->timed_next = s->timed_next;
    else
        L->timed = s->timed_next;
    if (s->timed_next != NULL)
        s->timed_next->timed_prev = s->timed_prev;
    s->timed = 0;
    s->timed_prev = s->timed_next = NULL;
}

static torchmp_line_sinks stream_sinks(stream *s)
{
    torchmp_group *g = s->proc->group;
    torchmp_line_sinks sinks;
    sinks.console_buf = g->loop->console_scratch;
    sinks.filtered_buf = g->loop->filtered_scratch;
    sinks.scratch_cap = SCRATCH_SIZE;
    sinks.console = s->console;
    sinks.source = &s->source;
    sinks.console_waiting = 0;
    sinks.filtered_fd = &g->filtered_fd[s->which];
    sinks.filtered_errno = &g->filtered_errno[s->which];
    sinks.needles = g->has_needles[s->which] ? &g->needles[s->which] : NULL;
    return sinks;
}

/* After the framer ran: arm its timer, and the console's writability. */
static void stream_after_frame(torchmp_loop *L, stream *s, const torchmp_line_sinks *sinks)
{
    if (s->framer.deadline_ns != 0)
        timed_add(L, s);
    else
        timed_remove(L, s);
    if (sinks->console_waiting && s->console_entry != NULL)
        console_entry_watch(L, s->console_entry);
}

static void proc_foreign_exit(torchmp_loop *L, torchmp_proc *p, int at_eof);

static void capture_append(torchmp_loop *L, stream *s, const char *data, size_t len)
{
    pthread_mutex_lock(&L->mu);
    if (s->capture_errno == 0 && s->capture_len + len > s->capture_cap) {
        size_t cap = s->capture_cap ? s->capture_cap : 4096;
        char *grown;
        while (cap < s->capture_len + len)
            cap *= 2;
        grown = realloc(s->capture, cap);
        if (grown == NULL) {
            s->capture_errno = ENOMEM; /* reported as a failed return value */
        } else {
            s->capture = grown;
            s->capture_cap = cap;
        }
    }
    if (s->capture_errno == 0) {
        memcpy(s->capture + s->capture_len, data, len);
        s->capture_len += len;
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

static void stream_consume(torchmp_loop *L, stream *s, const char *data, size_t len)
{
    torchmp_line_sinks sinks;
    int64_t now;
    if (s->which == STREAM_RET) {
        capture_append(L, s, data, len);
        if (s->proc->foreign)
            proc_foreign_exit(L, s->proc, 0);
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
    sinks = stream_sinks(s);
    (void)torchmp_framer_feed(&s->framer, data, len, now, &sinks);
    stream_after_frame(L, s, &sinks);
}

static void stream_flush_partial(torchmp_loop *L, stream *s)
{
    torchmp_line_sinks sinks;
    if (s->which == STREAM_RET)
        return;
    sinks = stream_sinks(s);
    torchmp_framer_flush(&s->framer, &sinks);
    stream_after_frame(L, s, &sinks);
}

/* The framers whose time has come: idle partial lines, progress states. */
static void streams_tick(torchmp_loop *L)
{
    int64_t now = clock_ns(CLOCK_MONOTONIC);
    stream *s, *next;
    if (L->next_deadline_ns == 0 || now < L->next_deadline_ns)
        return;
    L->next_deadline_ns = 0;
    for (s = L->timed; s != NULL; s = next) {
        next = s->timed_next;
        if (s->framer.deadline_ns != 0 && s->framer.deadline_ns <= now) {
            torchmp_line_sinks sinks = stream_sinks(s);
            torchmp_framer_tick(&s->framer, now, &sinks);
            if (sinks.console_waiting && s->console_entry != NULL)
                console_entry_watch(L, s->console_entry);
        }
        if (s->framer.deadline_ns == 0)
            timed_remove(L, s);
        else if (L->next_deadline_ns == 0 || s->framer.deadline_ns < L->next_deadline_ns)
            L->next_deadline_ns = s->framer.deadline_ns;
    }
}

/* poller timeout until the next framer deadline (-1: none). */
static int streams_timeout_ms(torchmp_loop *L)
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

static void stream_close(torchmp_loop *L, stream *s)
{
    torchmp_proc *p = s->proc;
    if (s->fd < 0)
        return;
    if (s->pipe_grown > 0) {
        L->pipe_budget += s->pipe_grown;
        s->pipe_grown = 0;
    }
    stream_flush_partial(L, s);
    (void)torchmp_poller_del(L->poller, s->fd);
    close_fd(&s->fd);
    close_fd(&s->log_fd);
    pthread_mutex_lock(&L->mu);
    s->open = 0;
    pthread_mutex_unlock(&L->mu);
    p->group->open_streams--;
    if (s->which == STREAM_RET && p->foreign && p->info.state == TORCHMP_PROC_RUNNING && !p->exiting)
        proc_foreign_exit(L, p, 1);
}

/* Read what is there.  limit < 0: until EAGAIN or EOF (at most a few chunks,
 * so one busy rank cannot starve the others); limit >= 0: exactly the bytes
 * that were buffered when the worker exited -- a grandchild that keeps
 * writing cannot delay the exit report. */
static void stream_pump(torchmp_loop *L, stream *s, long limit)
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
            stream_maybe_grow(L, s, (size_t)n);
            stream_consume(L, s, L->readbuf, (size_t)n);
            if (limit >= 0)
                limit -= n;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return;
        stream_close(L, s); /* EOF or a read error */
        return;
    }
}

static void stream_drain_buffered(torchmp_loop *L, stream *s)
{
    int avail = 0;
    if (s->fd < 0)
        return;
    if (ioctl(s->fd, FIONREAD, &avail) != 0)
        avail = READ_CHUNK;
    stream_pump(L, s, avail);
    if (s->fd >= 0)
        stream_flush_partial(L, s);
}

static void stream_free(torchmp_loop *L, stream *s)
{
    timed_remove(L, s);
    torchmp_framer_free(&s->framer);
    if (s->console_entry != NULL) {
        s->console_entry->users--;
        console_entry_maybe_free(L, s->console_entry);
        s->console_entry = NULL;
    } else {
        torchmp_console_unref(s->console);
    }
    s->console = NULL;
    free(s->log_path);
    s->log_path = NULL;
    free(s->prefix);
    s->prefix = NULL;
    free(s->capture);
    s->capture = NULL;
    free(s->tail);
    s->tail = NULL;
    s->tail_cap = s->tail_len = s->tail_end = 0;
    s->capture_len = s->capture_cap = 0;
}

/* ---- exits -------------------------------------------------------------- */

/* Wake every caller sleeping in torchmp_group_wait.  Caller holds mu. */
static void group_notify_locked(torchmp_group *g)
{
    for (group_waiter *w = g->waiters; w != NULL; w = w->next)
        notify_post(w->wake_w);
}

static int64_t timeval_ns(struct timeval tv)
{
    return (int64_t)tv.tv_sec * 1000000000LL + (int64_t)tv.tv_usec * 1000;
}

static void proc_reap_locked(torchmp_proc *p);

/* Record a rank's exit: first everything the worker wrote before it exited
 * goes out, then the state flips and Python is woken.  unreaped: the zombie
 * is still there (see torchmp_proc.unreaped). */
static void proc_record_exit(torchmp_loop *L, torchmp_proc *p, int status, int64_t utime_ns, int64_t stime_ns,
                             int64_t maxrss_kb, int status_lost, int unreaped)
{
    int64_t now_mono = clock_ns(CLOCK_MONOTONIC);
    int64_t now_real = clock_ns(CLOCK_REALTIME);

    p->exiting = 1;
    for (int w = 0; w < STREAM_COUNT; w++)
        stream_drain_buffered(L, &p->streams[w]);
    if (p->pidfd >= 0) {
        (void)torchmp_poller_del(L->exits, p->pidfd);
        close_fd(&p->pidfd);
    }
    pthread_mutex_lock(&L->mu);
    p->info.state = TORCHMP_PROC_EXITED;
    p->info.wait_status = status;
    p->info.status_lost = status_lost;
    p->info.exit_mono_ns = now_mono;
    p->info.exit_real_ns = now_real;
    p->info.utime_ns = utime_ns;
    p->info.stime_ns = stime_ns;
    p->info.maxrss_kb = maxrss_kb;
    p->info.out_log_errno = p->streams[STREAM_OUT].log_errno;
    p->info.err_log_errno = p->streams[STREAM_ERR].log_errno;
    p->unreaped = unreaped;
    /* Nobody will signal this group again: a released group's exits, or a
     * pid whose zombie is already gone (it may be recycled at any time). */
    if (p->group->released || !unreaped)
        proc_reap_locked(p);
    p->group->version++;
    group_notify_locked(p->group);
    pthread_mutex_unlock(&L->mu);
    p->group->running--;
    p->exiting = 0;
}

/* The exit status of a worker in wait(2)'s encoding, from waitid's. */
static int siginfo_wait_status(const siginfo_t *si)
{
    switch (si->si_code) {
    case CLD_EXITED:
        return (si->si_status & 0xff) << 8;
    case CLD_KILLED:
        return si->si_status & 0x7f;
    case CLD_DUMPED:
        return (si->si_status & 0x7f) | 0x80;
    default:
        return 255 << 8;
    }
}

/* waitid(P_PID, pid, WEXITED | WNOHANG | WNOWAIT) with the zombie's rusage:
 * Linux's system call takes a fifth argument that libc's wrapper hides, and
 * fills it (self + waited-for children, as wait4 would) without reaping. */
static int waitid_keep(pid_t pid, siginfo_t *si, struct rusage *ru)
{
#ifdef TORCHMP_HAVE_PIDFD
    return (int)syscall(SYS_waitid, P_PID, (id_t)pid, si, WEXITED | WNOHANG | WNOWAIT, ru);
#else
    (void)ru; /* filled in when the zombie is reaped (proc_reap_locked) */
    return waitid(P_PID, (id_t)pid, si, WEXITED | WNOHANG | WNOWAIT);
#endif
}

int torchmp_collect_exit(pid_t pid, int *status, int64_t *utime_ns, int64_t *stime_ns, int64_t *maxrss_kb)
{
    struct rusage ru;
    siginfo_t si;
    int r;

    memset(&ru, 0, sizeof(ru));
    memset(&si, 0, sizeof(si));
    do {
        r = waitid_keep(pid, &si, &ru);
    } while (r < 0 && errno == EINTR);
    if (r < 0)
        return -1;
    if (si.si_pid == 0)
        return 0;
    *status = siginfo_wait_status(&si);
    *utime_ns = timeval_ns(ru.ru_utime);
    *stime_ns = timeval_ns(ru.ru_stime);
    *maxrss_kb = ru.ru_maxrss;
    return 1;
}

/* Record pid's exit if it has exited, keeping the zombie.  Returns 1 when
 * recorded, 0 if still running. */
static int proc_try_collect(torchmp_loop *L, torchmp_proc *p)
{
    int status = 0;
    int64_t utime = 0, stime = 0, maxrss = 0;
    int r = torchmp_collect_exit(p->info.pid, &status, &utime, &stime, &maxrss);

    if (r < 0) {
        /* ECHILD: somebody else in this process reaped our worker (a
         * waitpid(-1) elsewhere).  The status is lost, and so is the pin. */
        proc_record_exit(L, p, 255 << 8, 0, 0, 0, 1, 0);
        return 1;
    }
    if (r == 0)
        return 0;
    proc_record_exit(L, p, status, utime, stime, maxrss, 0, 1);
    return 1;
}

/* Let the zombie go: after this the pid and the process group id may be
 * recycled, so nothing may signal them again.  A forkserver's worker is
 * the forkserver's to reap: Python tells it (torchmp_group_reap).  Caller
 * holds mu. */
static void proc_reap_locked(torchmp_proc *p)
{
    torchmp_keeper_remove(p->keeper_slot);
    p->keeper_slot = 0;
    if (!p->unreaped)
        return;
    p->unreaped = 0;
    if (!p->foreign) {
        struct rusage ru;
        int status;
        pid_t r;
        memset(&ru, 0, sizeof(ru));
        do {
            r = wait4(p->info.pid, &status, WNOHANG, &ru);
        } while (r < 0 && errno == EINTR);
#ifndef TORCHMP_HAVE_PIDFD
        if (r == p->info.pid) {
            p->info.utime_ns = timeval_ns(ru.ru_utime);
            p->info.stime_ns = timeval_ns(ru.ru_stime);
            p->info.maxrss_kb = ru.ru_maxrss;
        }
#else
        (void)r;
#endif
    }
}

/* A forkserver worker is not our child: its exit status arrives as a
 * trailer the forkserver appends to the worker's return channel once it has
 * reaped the worker.  The exit is recorded when the trailer is there and the
 * worker is gone (its pidfd fired: a grandchild it forked may keep the
 * channel open), or at the channel's EOF.  EOF without a trailer means the
 * forkserver died. */
static void proc_foreign_exit(torchmp_loop *L, torchmp_proc *p, int at_eof)
{
    stream *s = &p->streams[STREAM_RET];
    torchmp_exit_trailer t;
    int found = 0;

    if (p->exiting || p->info.state != TORCHMP_PROC_RUNNING)
        return;
    /* Bytes that merely look like a trailer count only once the worker is
     * gone (the forkserver writes the trailer once it has exited).  Without
     * a pidfd (poll backend) ask whether the pid is gone or a zombie. */
    if (!at_eof && !p->foreign_gone && !torchmp_pid_exited(p->info.pid))
        return;
    pthread_mutex_lock(&L->mu);
    if (s->capture_len >= sizeof(t) &&
        memcmp(s->capture + s->capture_len - sizeof(t), TORCHMP_EXIT_TRAILER_MAGIC, 8) == 0) {
        memcpy(&t, s->capture + s->capture_len - sizeof(t), sizeof(t));
        s->capture_len -= sizeof(t);
        found = 1;
    }
    pthread_mutex_unlock(&L->mu);
    if (found)
        proc_record_exit(L, p, (int)t.wait_status, t.utime_ns, t.stime_ns, t.maxrss_kb, 0, 1);
    else if (at_eof)
        proc_record_exit(L, p, SIGKILL, 0, 0, 0, 1, 0);
}

static void reap_scan(torchmp_loop *L)
{
    for (torchmp_group *g = L->groups; g != NULL; g = g->next) {
        for (int i = 0; i < g->nprocs && g->running > 0; i++) {
            if (g->procs[i].info.state == TORCHMP_PROC_RUNNING && !g->procs[i].foreign)
                (void)proc_try_collect(L, &g->procs[i]);
        }
    }
}

/* ---- spawning ----------------------------------------------------------- */

static int stream_open(torchmp_loop *L, torchmp_proc *p, int which, const torchmp_stream_spec *spec,
                       int *child_fd)
{
    stream *s = &p->streams[which];
    int pfd[2];

    *child_fd = -1;
    if (spec->mode == TORCHMP_STREAM_FILE) {
        *child_fd = spec->fd;
        return 0;
    }
    if (spec->mode != TORCHMP_STREAM_TEE && spec->mode != TORCHMP_STREAM_CAPTURE)
        return 0;

    if (torchmp_pipe_cloexec(pfd) != 0)
        return -1;
    if (fcntl(pfd[0], F_SETFL, O_NONBLOCK) != 0)
        goto fail;
    if (spec->mode == TORCHMP_STREAM_TEE) {
        if (spec->fd >= 0) {
            s->log_fd = fcntl(spec->fd, F_DUPFD_CLOEXEC, 3);
            if (s->log_fd < 0)
                goto fail;
        }
        s->prefix = malloc(spec->prefix_len + 1);
        if (s->prefix == NULL)
            goto fail;
        if (spec->prefix_len > 0)
            memcpy(s->prefix, spec->prefix, spec->prefix_len);
        s->prefix[spec->prefix_len] = '\0';
        torchmp_framer_init(&s->framer, s->prefix, spec->prefix_len, MAX_LINE);
        s->framer.timestamps = spec->timestamps;
        if (spec->log_path != NULL) {
            s->log_path = strdup(spec->log_path);
            if (s->log_path == NULL)
                goto fail;
        }
        if (spec->sink != NULL) {
            s->console = torchmp_console_ref(spec->sink);
        } else if (spec->console == 1 || spec->console == 2) {
            s->console_entry = console_entry_for_fd(L, spec->console);
            if (s->console_entry == NULL)
                goto fail;
            s->console = s->console_entry->console;
        }
        s->source.id = ++L->stream_serial;
        s->source.prefix = s->prefix;
        s->source.prefix_len = spec->prefix_len;
        s->source.log_path = s->log_path;
        s->source.limit = spec->backlog_limit;
        if (spec->tail_bytes > 0) {
            s->tail = malloc(spec->tail_bytes);
            if (s->tail == NULL)
                goto fail;
            s->tail_cap = spec->tail_bytes;
        }
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
        stream_free(L, s);
        errno = saved;
        return -1;
    }
}

static const torchmp_stream_spec *rank_stream_spec(const torchmp_rank_spec *spec, int which)
{
    return which == STREAM_OUT ? &spec->out : which == STREAM_ERR ? &spec->err : &spec->ret;
}

/* The launcher's copies of the pipe ends the worker writes to. */
static void rank_child_ends_close(const torchmp_rank_spec *spec, int *child_fds)
{
    for (int w = 0; w < STREAM_COUNT; w++) {
        int mode = rank_stream_spec(spec, w)->mode;
        if (mode == TORCHMP_STREAM_TEE || mode == TORCHMP_STREAM_CAPTURE)
            close_fd(&child_fds[1 + w]);
    }
}

static void rank_streams_abort(torchmp_loop *L, torchmp_proc *p)
{
    for (int w = 0; w < STREAM_COUNT; w++) {
        stream_close(L, &p->streams[w]);
        stream_free(L, &p->streams[w]);
    }
}

/* Open stdout, stderr and the return channel of a rank on the loop side and
 * put the worker's ends in child_fds[1..3]. */
static int rank_streams_open(torchmp_loop *L, torchmp_proc *p, const torchmp_rank_spec *spec, int *child_fds,
                             torchmp_exec_error *err)
{
    for (int w = 0; w < STREAM_COUNT; w++) {
        if (stream_open(L, p, w, rank_stream_spec(spec, w), &child_fds[1 + w]) != 0) {
            err->step = TORCHMP_STEP_STREAM;
            err->errnum = errno;
            rank_child_ends_close(spec, child_fds);
            rank_streams_abort(L, p);
            errno = err->errnum;
            return -1;
        }
    }
    return 0;
}

/* Start watching a forked worker.  On failure the worker is killed and
 * reaped, and the rank's streams are closed. */
static int rank_adopt(torchmp_loop *L, torchmp_proc *p, pid_t pid, int foreign, int64_t start,
                      torchmp_exec_error *err)
{
    p->foreign = foreign;
#ifdef TORCHMP_HAVE_PIDFD
    if (L->backend == TORCHMP_BACKEND_EPOLL) {
        p->pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
        if (p->pidfd >= 0 && torchmp_poller_add(L->exits, p->pidfd, p) != 0)
            close_fd(&p->pidfd);
        if (p->pidfd < 0 && foreign) {
            /* Not our child, so nothing to kill or reap here: a worker that
             * is already gone (ESRCH) has its trailer on the way; otherwise
             * its exit shows as the trailer plus kill(pid, 0) == ESRCH. */
            p->foreign_gone = errno == ESRCH;
        } else if (p->pidfd < 0) {
            int status;
            err->step = TORCHMP_STEP_PIDFD;
            err->errnum = errno;
            kill(pid, SIGKILL);
            while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
                ;
            rank_streams_abort(L, p);
            errno = err->errnum;
            return -1;
        }
    }
#endif
    pthread_mutex_lock(&L->mu);
    p->info.pid = pid;
    p->info.state = TORCHMP_PROC_RUNNING;
    p->info.start_mono_ns = start;
    p->keeper_slot = torchmp_keeper_add(pid);
    pthread_mutex_unlock(&L->mu);
    p->group->running++;
    if (foreign) {
        /* The worker may have run to completion before we got here: its
         * trailer (or even its channel's EOF) may be in already. */
        proc_foreign_exit(L, p, p->streams[STREAM_RET].fd < 0);
    }
    return 0;
}

static int do_spawn_one(torchmp_loop *L, torchmp_group *g, int rank, torchmp_rank_spec *spec,
                        torchmp_exec_error *err)
{
    torchmp_proc *p = &g->procs[rank];
    torchmp_spawn_args a = spec->args;
    pid_t pid;
    int64_t start;
    int rc;

    if (p->info.state != TORCHMP_PROC_UNSTARTED) {
        err->step = TORCHMP_STEP_FORK;
        err->errnum = EBUSY;
        return -1;
    }
    if (rank_streams_open(L, p, spec, a.child_fds, err) != 0)
        return -1;
    a.use_vfork = L->use_vfork;
    a.parent_pid = L->owner_pid;
    a.max_fd = L->max_fd;
#ifdef TORCHMP_HAVE_PDEATHSIG
    a.pdeathsig = SIGKILL;
#else
    a.pdeathsig = 0;
#endif

    start = clock_ns(CLOCK_MONOTONIC);
    rc = torchmp_spawn(&a, &pid, err);
    rank_child_ends_close(spec, a.child_fds);
    if (rc != 0) {
        rank_streams_abort(L, p);
        return -1;
    }
    return rank_adopt(L, p, pid, 0, start, err);
}

static void group_link(torchmp_loop *L, torchmp_group *g)
{
    if (!g->linked) {
        g->next = L->groups;
        L->groups = g;
        g->linked = 1;
    }
}

static int do_spawn(torchmp_loop *L, command *c)
{
    sigset_t reset;
    group_link(L, c->group);
    torchmp_signals_to_reset(&reset);
    for (int i = 0; i < c->count; i++) {
        c->specs[i].args.reset_signals = reset;
        if (do_spawn_one(L, c->group, i, &c->specs[i], &c->err) != 0)
            return i;
    }
    return c->count;
}

static void do_finish(torchmp_loop *L, torchmp_group *g)
{
    for (int i = 0; i < g->nprocs; i++) {
        for (int w = 0; w < STREAM_COUNT; w++) {
            stream *s = &g->procs[i].streams[w];
            if (s->fd >= 0) {
                stream_drain_buffered(L, s);
                stream_close(L, s);
            }
        }
    }
}

/* ---- groups ------------------------------------------------------------- */

static void needles_free(torchmp_needles *n)
{
    for (size_t i = 0; i < n->count; i++)
        free(n->data[i]);
    free(n->data);
    free(n->len);
    n->data = NULL;
    n->len = NULL;
    n->count = 0;
}

static int needles_copy(torchmp_needles *dst, const torchmp_needles *src)
{
    dst->count = 0;
    dst->data = calloc(src->count ? src->count : 1, sizeof(char *));
    dst->len = calloc(src->count ? src->count : 1, sizeof(size_t));
    if (dst->data == NULL || dst->len == NULL) {
        needles_free(dst);
        errno = ENOMEM;
        return -1;
    }
    for (size_t i = 0; i < src->count; i++) {
        dst->data[i] = malloc(src->len[i] ? src->len[i] : 1);
        if (dst->data[i] == NULL) {
            needles_free(dst);
            errno = ENOMEM;
            return -1;
        }
        memcpy(dst->data[i], src->data[i], src->len[i]);
        dst->len[i] = src->len[i];
        dst->count++;
    }
    return 0;
}

static void group_free(torchmp_group *g)
{
    for (int i = 0; i < g->nprocs; i++) {
        torchmp_proc *p = &g->procs[i];
        close_fd(&p->pidfd);
        for (int w = 0; w < STREAM_COUNT; w++) {
            close_fd(&p->streams[w].fd);
            close_fd(&p->streams[w].log_fd);
            stream_free(g->loop, &p->streams[w]);
        }
    }
    for (int w = 0; w < 2; w++) {
        close_fd(&g->filtered_fd[w]);
        if (g->has_needles[w])
            needles_free(&g->needles[w]);
    }
    free(g->procs);
    free(g);
}

/* Free released groups with nothing left to watch.  Runs after a batch of
 * events, so no event of the batch can point into a freed group. */
static void collect_groups(torchmp_loop *L)
{
    torchmp_group **link = &L->groups;
    while (*link != NULL) {
        torchmp_group *g = *link;
        if (g->released && g->running == 0 && g->open_streams == 0) {
            *link = g->next;
            group_free(g);
        } else {
            link = &g->next;
        }
    }
}

/* Open the streams of ranks [0, count) for workers forked outside the loop.
 * All or nothing: on a failure at rank k, whatever was opened is closed again
 * and k is returned. */
static int do_prepare(torchmp_loop *L, command *c)
{
    torchmp_group *g = c->group;
    group_link(L, g);
    for (int i = 0; i < c->count; i++) {
        if (rank_streams_open(L, &g->procs[i], &c->specs[i], c->specs[i].args.child_fds, &c->err) != 0) {
            for (int j = 0; j < i; j++) {
                rank_child_ends_close(&c->specs[j], c->specs[j].args.child_fds);
                rank_streams_abort(L, &g->procs[j]);
            }
            return i;
        }
    }
    return c->count;
}

/* Watch forked workers.  If one cannot be watched, it and every worker after
 * it in the batch are killed and reaped (they are our children), and the
 * index of the first is returned. */
static int do_adopt(torchmp_loop *L, command *c)
{
    torchmp_group *g = c->group;
    int64_t now = clock_ns(CLOCK_MONOTONIC);
    for (int i = 0; i < c->count; i++) {
        int64_t start = c->start_ns != NULL && c->start_ns[i] != 0 ? c->start_ns[i] : now;
        if (rank_adopt(L, &g->procs[c->ranks[i]], c->pids[i], c->foreign, start, &c->err) == 0)
            continue;
        for (int j = i + 1; j < c->count; j++) {
            if (!c->foreign) {
                int status;
                kill(c->pids[j], SIGKILL);
                while (waitpid(c->pids[j], &status, 0) < 0 && errno == EINTR)
                    ;
            }
            rank_streams_abort(L, &g->procs[c->ranks[j]]);
        }
        return i;
    }
    return c->count;
}

/* ---- the thread --------------------------------------------------------- */

static void run_commands(torchmp_loop *L)
{
    for (;;) {
        command *c;
        pthread_mutex_lock(&L->mu);
        c = L->cmd_head;
        if (c != NULL) {
            L->cmd_head = c->next;
            if (L->cmd_head == NULL)
                L->cmd_tail = NULL;
        }
        pthread_mutex_unlock(&L->mu);
        if (c == NULL)
            return;

        switch (c->type) {
        case CMD_SPAWN:
            c->result = do_spawn(L, c);
            break;
        case CMD_FINISH:
            do_finish(L, c->group);
            c->result = 0;
            break;
        case CMD_PREPARE:
            c->result = do_prepare(L, c);
            break;
        case CMD_ADOPT:
            c->result = do_adopt(L, c);
            break;
        case CMD_DROP_UNSTARTED:
            for (int i = 0; i < c->group->nprocs; i++) {
                if (c->group->procs[i].info.state == TORCHMP_PROC_UNSTARTED)
                    rank_streams_abort(L, &c->group->procs[i]);
            }
            c->result = 0;
            break;
        case CMD_RELEASE:
            c->group->released = 1;
            /* Python signals the group no more: let its zombies go. */
            pthread_mutex_lock(&L->mu);
            for (int i = 0; i < c->group->nprocs; i++) {
                if (c->group->procs[i].info.state == TORCHMP_PROC_EXITED)
                    proc_reap_locked(&c->group->procs[i]);
            }
            pthread_mutex_unlock(&L->mu);
            if (!c->group->linked)
                group_free(c->group); /* never spawned: nothing to watch */
            free(c);
            continue; /* nobody waits for a release */
        }
        pthread_mutex_lock(&L->mu);
        __atomic_store_n(&c->done, 1, __ATOMIC_RELEASE);
        pthread_cond_broadcast(&L->cmd_done);
        pthread_mutex_unlock(&L->mu);
    }
}

/* A worker's pidfd fired. */
static void proc_exit_event(torchmp_loop *L, torchmp_proc *p)
{
    if (p->info.state != TORCHMP_PROC_RUNNING || p->pidfd < 0)
        return;
    if (p->foreign) {
        /* Not ours to reap: wait for the forkserver's trailer. */
        (void)torchmp_poller_del(L->exits, p->pidfd);
        close_fd(&p->pidfd);
        p->foreign_gone = 1;
        stream_pump(L, &p->streams[STREAM_RET], -1);
        proc_foreign_exit(L, p, 0);
    } else {
        (void)proc_try_collect(L, p);
    }
}

static void *loop_main(void *arg)
{
    torchmp_loop *L = arg;
    torchmp_event events[MAX_EVENTS];
    torchmp_event exit_events[MAX_EVENTS];

    for (;;) {
        int timeout = streams_timeout_ms(L);
        int n;
        if (L->consoles_polled && (timeout < 0 || timeout > 10))
            timeout = 10;
        n = torchmp_poller_wait(L->poller, events, MAX_EVENTS, timeout);
        if (n < 0) {
            /* EBADF/EINVAL would mean our own bookkeeping broke; ENOMEM is
             * transient.  Never spin hot. */
            struct timespec ts = {0, 1000000};
            nanosleep(&ts, NULL);
            continue;
        }
        for (int i = 0; i < n; i++) {
            int kind = *(int *)events[i].ptr;
            if (kind == WATCH_CONTROL) {
                notify_drain(L->wake_r);
                run_commands(L);
                /* After the commands: a worker adopted just now may already
                 * have exited, its SIGCHLD spent on this very wake-up. */
                if (L->backend == TORCHMP_BACKEND_POLL)
                    reap_scan(L);
            } else if (kind == WATCH_STREAM) {
                stream *s = events[i].ptr;
                if (s->fd >= 0)
                    stream_pump(L, s, -1);
            } else if (kind == WATCH_CONSOLE) {
                console_entry_writable(L, events[i].ptr);
            } else if (kind == WATCH_EXITS) {
                /* Level-triggered: exits beyond MAX_EVENTS show up next round. */
                int m = torchmp_poller_wait(L->exits, exit_events, MAX_EVENTS, 0);
                for (int j = 0; j < m; j++)
                    proc_exit_event(L, exit_events[j].ptr);
            }
        }
        streams_tick(L);
        if (L->consoles_polled)
            L->consoles_polled = consoles_poll(L);
        collect_groups(L);
    }
    return NULL;
}

static int choose_backend(void)
{
    const char *forced = getenv("TORCHMP_BACKEND");
    if (forced != NULL && strcmp(forced, "poll") == 0)
        return TORCHMP_BACKEND_POLL;
#if defined(TORCHMP_HAVE_EPOLL) && defined(TORCHMP_HAVE_PIDFD)
    {
        /* pidfd_open arrived in Linux 5.3: probe it on ourselves. */
        int fd = (int)syscall(SYS_pidfd_open, getpid(), 0);
        if (fd >= 0) {
            close(fd);
            return TORCHMP_BACKEND_EPOLL;
        }
    }
#endif
    return TORCHMP_BACKEND_POLL;
}

static torchmp_loop *loop_create(void)
{
    torchmp_loop *L = calloc(1, sizeof(*L));
    sigset_t all, old;
    const char *no_vfork;
    int saved;

    if (L == NULL)
        return NULL;
    L->kind = WATCH_CONTROL;
    L->exits_kind = WATCH_EXITS;
    L->owner_pid = getpid();
    L->wake_r = L->wake_w = -1;
    L->backend = choose_backend();
    L->pipe_budget = PIPE_GROWTH_BUDGET;
    L->max_fd = sysconf(_SC_OPEN_MAX);
    if (L->max_fd <= 0 || L->max_fd > (1L << 20))
        L->max_fd = 1L << 20;
    no_vfork = getenv("TORCHMP_NO_VFORK");
#ifdef TORCHMP_HAVE_VFORK
    L->use_vfork = !(no_vfork != NULL && no_vfork[0] != '\0' && strcmp(no_vfork, "0") != 0);
#else
    (void)no_vfork;
    L->use_vfork = 0;
#endif

    L->readbuf = malloc(READ_CHUNK);
    L->console_scratch = malloc(SCRATCH_SIZE);
    L->filtered_scratch = malloc(SCRATCH_SIZE);
    if (L->readbuf == NULL || L->console_scratch == NULL || L->filtered_scratch == NULL)
        goto fail;
    /* Before the I/O thread exists: one thread fewer to fork.  Without a
     * keeper (fork failed) workers still die with the launcher by PDEATHSIG;
     * only their own children would be left. */
    (void)torchmp_keeper_start();
    torchmp_procscan_init();
    if (notify_open(&L->wake_r, &L->wake_w) != 0)
        goto fail;
    L->poller = torchmp_poller_new(L->backend);
    if (L->poller == NULL)
        goto fail;
    if (torchmp_poller_add(L->poller, L->wake_r, L) != 0)
        goto fail;
    if (L->backend == TORCHMP_BACKEND_EPOLL) {
        L->exits = torchmp_poller_new(TORCHMP_BACKEND_EPOLL);
        if (L->exits == NULL ||
            torchmp_poller_add(L->poller, torchmp_poller_fd(L->exits), &L->exits_kind) != 0)
            goto fail;
    }
    if (pthread_mutex_init(&L->mu, NULL) != 0)
        goto fail;
    if (pthread_cond_init(&L->cmd_done, NULL) != 0) {
        pthread_mutex_destroy(&L->mu);
        goto fail;
    }
    if (L->backend == TORCHMP_BACKEND_POLL && install_sigchld(L->wake_w) != 0)
        goto fail_sync;

    /* The thread starts with every signal blocked. */
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    saved = pthread_create(&L->thread, NULL, loop_main, L);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (saved != 0) {
        errno = saved;
        goto fail_sync;
    }
#ifdef __linux__
    pthread_setname_np(L->thread, "torchmp-io");
#endif
    pthread_detach(L->thread);
    return L;

fail_sync:
    saved = errno;
    pthread_cond_destroy(&L->cmd_done);
    pthread_mutex_destroy(&L->mu);
    errno = saved;
fail:
    saved = errno;
    if (L->backend == TORCHMP_BACKEND_POLL && sigchld_wake_fd == L->wake_w && L->wake_w >= 0) {
        sigaction(SIGCHLD, &previous_sigchld, NULL);
        sigchld_wake_fd = -1;
    }
    torchmp_poller_free(L->exits);
    torchmp_poller_free(L->poller);
    notify_close(&L->wake_r, &L->wake_w);
    free(L->readbuf);
    free(L->console_scratch);
    free(L->filtered_scratch);
    free(L);
    errno = saved;
    return NULL;
}

/* The loop of this process.  After a fork the child has no I/O thread: it
 * gets a loop of its own, and the parent's state (whose mutex may have been
 * held by a thread that no longer exists) is abandoned, not touched. */
static torchmp_loop *loop_get(void)
{
    if (the_loop != NULL && the_loop->owner_pid == getpid())
        return the_loop;
    the_loop = loop_create();
    return the_loop;
}

int torchmp_loop_backend(void)
{
    torchmp_loop *L = loop_get();
    return L == NULL ? -1 : L->backend;
}

int torchmp_loop_fd_count(void)
{
    torchmp_loop *L = loop_get();
    if (L == NULL)
        return -1;
    /* The fds in the poller (the exits set's epoll fd and consoles waiting
     * to write among them), the pidfds in the exits set, the poller's own
     * epoll fd, the consoles not in the poller. */
    int n = torchmp_poller_fd_count(L->poller) + (L->exits != NULL ? torchmp_poller_fd_count(L->exits) : 0) +
            (L->backend == TORCHMP_BACKEND_EPOLL ? 1 : 0) + (L->wake_w != L->wake_r ? 1 : 0);
    pthread_mutex_lock(&L->mu);
    for (console_entry *e = L->consoles; e != NULL; e = e->next) {
        if (e->watched != 1 && torchmp_console_fd(e->console) >= 0)
            n++;
    }
    pthread_mutex_unlock(&L->mu);
    return n;
}

size_t torchmp_consoles_pending(int fd)
{
    torchmp_loop *L = the_loop;
    size_t n = 0;
    if (L == NULL || L->owner_pid != getpid())
        return 0;
    pthread_mutex_lock(&L->mu);
    for (console_entry *e = L->consoles; e != NULL; e = e->next) {
        if (fd < 0 || torchmp_console_same_target(e->console, fd))
            n += torchmp_console_pending(e->console);
    }
    pthread_mutex_unlock(&L->mu);
    return n;
}

#define SUBMIT_SPIN_NS 200000

/* Queue a command and wait for the loop to run it (unless it is a release). */
static int submit(torchmp_loop *L, command *c, int wait_done)
{
    c->next = NULL;
    c->done = 0;
    pthread_mutex_lock(&L->mu);
    if (L->cmd_tail != NULL)
        L->cmd_tail->next = c;
    else
        L->cmd_head = c;
    L->cmd_tail = c;
    pthread_mutex_unlock(&L->mu);
    notify_post(L->wake_w);
    if (!wait_done)
        return 0;
    /* Most commands take the loop tens of microseconds: polling that long
     * saves a futex sleep and wake-up that cost as much again (a 70 us round
     * trip becomes 18 us).  It must yield, not spin: the scheduler tends to
     * wake the loop thread on this very CPU. */
    {
        int64_t spin_until = clock_ns(CLOCK_MONOTONIC) + SUBMIT_SPIN_NS;
        while (!__atomic_load_n(&c->done, __ATOMIC_ACQUIRE) && clock_ns(CLOCK_MONOTONIC) < spin_until)
            sched_yield();
        if (__atomic_load_n(&c->done, __ATOMIC_ACQUIRE)) {
            /* The loop may still hold mu from setting done: c lives on our
             * stack, so wait for it to let go before returning. */
            pthread_mutex_lock(&L->mu);
            pthread_mutex_unlock(&L->mu);
            return 0;
        }
    }
    pthread_mutex_lock(&L->mu);
    while (!c->done)
        pthread_cond_wait(&L->cmd_done, &L->mu);
    pthread_mutex_unlock(&L->mu);
    return 0;
}

/* ---- public API --------------------------------------------------------- */

torchmp_group *torchmp_group_new(int nprocs,
                                 const torchmp_needles *out_needles, int filtered_out_fd,
                                 const torchmp_needles *err_needles, int filtered_err_fd)
{
    torchmp_loop *L = loop_get();
    torchmp_group *g;
    const torchmp_needles *needles[2] = {out_needles, err_needles};
    int filtered[2] = {filtered_out_fd, filtered_err_fd};
    int saved;

    if (L == NULL)
        return NULL;
    if (nprocs < 0) {
        errno = EINVAL;
        return NULL;
    }
    g = calloc(1, sizeof(*g));
    if (g == NULL)
        return NULL;
    g->loop = L;
    g->nprocs = nprocs;
    g->filtered_fd[0] = g->filtered_fd[1] = -1;
    g->console_fd[0] = 1;
    g->console_fd[1] = 2;
    g->procs = calloc(nprocs > 0 ? (size_t)nprocs : 1, sizeof(torchmp_proc));
    if (g->procs == NULL)
        goto fail;
    for (int i = 0; i < nprocs; i++) {
        torchmp_proc *p = &g->procs[i];
        p->rank = i;
        p->pidfd = -1;
        p->group = g;
        p->info.state = TORCHMP_PROC_UNSTARTED;
        for (int w = 0; w < STREAM_COUNT; w++) {
            p->streams[w].kind = WATCH_STREAM;
            p->streams[w].fd = -1;
            p->streams[w].log_fd = -1;
            p->streams[w].which = w;
            p->streams[w].proc = p;
            torchmp_framer_init(&p->streams[w].framer, NULL, 0, MAX_LINE);
        }
    }
    for (int w = 0; w < 2; w++) {
        if (needles[w] != NULL) {
            if (needles_copy(&g->needles[w], needles[w]) != 0)
                goto fail;
            g->has_needles[w] = 1;
        }
        if (filtered[w] >= 0) {
            g->filtered_fd[w] = fcntl(filtered[w], F_DUPFD_CLOEXEC, 3);
            if (g->filtered_fd[w] < 0)
                goto fail;
        }
    }

    /* The loop thread links the group into its list with the first spawn;
     * the group list is loop-thread state. */
    return g;

fail:
    saved = errno;
    group_free(g);
    errno = saved;
    return NULL;
}

static int group_is_ours(torchmp_group *g)
{
    if (g->loop->owner_pid != getpid()) {
        errno = ECHILD; /* a group inherited across fork belongs to the parent */
        return 0;
    }
    return 1;
}

static void note_pipes(torchmp_group *g, const torchmp_rank_spec *specs, int count)
{
    for (int i = 0; i < count; i++) {
        for (int w = 0; w < STREAM_COUNT; w++) {
            int mode = rank_stream_spec(&specs[i], w)->mode;
            if (mode == TORCHMP_STREAM_TEE || mode == TORCHMP_STREAM_CAPTURE)
                g->has_pipes = 1;
        }
    }
}

/* SPAWN and PREPARE: a command over ranks [0, count), all still unstarted. */
static int ranks_command(torchmp_group *g, int type, torchmp_rank_spec *specs, int count, torchmp_exec_error *err)
{
    command c;
    if (!group_is_ours(g))
        return -1;
    if (count < 0 || count > g->nprocs) {
        errno = EINVAL;
        return -1;
    }
    for (int i = 0; i < count; i++) {
        if (g->procs[i].info.state != TORCHMP_PROC_UNSTARTED) {
            errno = EBUSY;
            return -1;
        }
    }
    note_pipes(g, specs, count);
    memset(&c, 0, sizeof(c));
    c.type = type;
    c.group = g;
    c.specs = specs;
    c.count = count;
    submit(g->loop, &c, 1);
    *err = c.err;
    return c.result;
}

int torchmp_group_spawn(torchmp_group *g, torchmp_rank_spec *specs, int count, torchmp_exec_error *err)
{
    return ranks_command(g, CMD_SPAWN, specs, count, err);
}

int torchmp_group_prepare(torchmp_group *g, torchmp_rank_spec *specs, int count, torchmp_exec_error *err)
{
    return ranks_command(g, CMD_PREPARE, specs, count, err);
}

int torchmp_group_adopt(torchmp_group *g, const int *ranks, const pid_t *pids, const int64_t *start_ns, int count,
                        int foreign, torchmp_exec_error *err)
{
    command c;
    if (!group_is_ours(g))
        return -1;
    if (count < 0) {
        errno = EINVAL;
        return -1;
    }
    for (int i = 0; i < count; i++) {
        if (ranks[i] < 0 || ranks[i] >= g->nprocs || g->procs[ranks[i]].info.state != TORCHMP_PROC_UNSTARTED) {
            errno = EINVAL;
            return -1;
        }
    }
    memset(&c, 0, sizeof(c));
    c.type = CMD_ADOPT;
    c.group = g;
    c.ranks = ranks;
    c.pids = pids;
    c.start_ns = start_ns;
    c.count = count;
    c.foreign = foreign;
    submit(g->loop, &c, 1);
    *err = c.err;
    return c.result;
}

int torchmp_group_drop_unstarted(torchmp_group *g)
{
    command c;
    int i;
    if (!group_is_ours(g))
        return -1;
    for (i = 0; i < g->nprocs; i++) {
        if (g->procs[i].info.state == TORCHMP_PROC_UNSTARTED)
            break;
    }
    if (i == g->nprocs)
        return 0; /* every rank was adopted: nothing to drop, spare the round trip */
    memset(&c, 0, sizeof(c));
    c.type = CMD_DROP_UNSTARTED;
    c.group = g;
    submit(g->loop, &c, 1);
    return 0;
}

char *torchmp_group_take_capture(torchmp_group *g, int rank, size_t *len)
{
    torchmp_loop *L = g->loop;
    stream *s;
    char *data;
    *len = 0;
    if (rank < 0 || rank >= g->nprocs) {
        errno = EINVAL;
        return NULL;
    }
    s = &g->procs[rank].streams[STREAM_RET];
    pthread_mutex_lock(&L->mu);
    if (s->capture_errno != 0) {
        errno = s->capture_errno;
        pthread_mutex_unlock(&L->mu);
        return NULL;
    }
    data = s->capture;
    *len = s->capture_len;
    s->capture = NULL;
    s->capture_len = s->capture_cap = 0;
    pthread_mutex_unlock(&L->mu);
    errno = 0;
    return data;
}

uint64_t torchmp_group_snapshot(torchmp_group *g, torchmp_proc_info *out, int n)
{
    uint64_t version;
    torchmp_loop *L = g->loop;
    if (n > g->nprocs)
        n = g->nprocs;
    if (!group_is_ours(g)) {
        for (int i = 0; i < n; i++)
            out[i] = g->procs[i].info;
        return g->version;
    }
    pthread_mutex_lock(&L->mu);
    for (int i = 0; i < n; i++)
        out[i] = g->procs[i].info;
    version = g->version;
    pthread_mutex_unlock(&L->mu);
    return version;
}

void torchmp_group_stream_state(torchmp_group *g, torchmp_stream_state *out, int n)
{
    torchmp_loop *L = g->loop;
    int ours = group_is_ours(g);
    if (n > g->nprocs)
        n = g->nprocs;
    if (ours)
        pthread_mutex_lock(&L->mu);
    for (int i = 0; i < n; i++) {
        for (int w = STREAM_OUT; w <= STREAM_ERR; w++) {
            out[i].open[w] = g->procs[i].streams[w].open;
            out[i].last_data_ns[w] = g->procs[i].streams[w].last_data_ns;
        }
    }
    if (ours)
        pthread_mutex_unlock(&L->mu);
}

size_t torchmp_group_tail(torchmp_group *g, int rank, int which, char *buf, size_t cap)
{
    torchmp_loop *L = g->loop;
    int ours = group_is_ours(g);
    size_t n = 0, start;
    stream *s;
    if (rank < 0 || rank >= g->nprocs || (which != STREAM_OUT && which != STREAM_ERR))
        return 0;
    s = &g->procs[rank].streams[which];
    if (ours)
        pthread_mutex_lock(&L->mu);
    if (s->tail != NULL) {
        n = s->tail_len < cap ? s->tail_len : cap;
        /* the newest n bytes end at tail_end */
        start = (s->tail_end + s->tail_cap - n) % s->tail_cap;
        for (size_t i = 0; i < n; i++)
            buf[i] = s->tail[(start + i) % s->tail_cap];
    }
    if (ours)
        pthread_mutex_unlock(&L->mu);
    return n;
}

/* How long a waiting caller woken by a worker's exit polls for the I/O
 * thread to record it.  Woken together, the I/O thread needs a few tens of
 * microseconds; past this the caller sleeps on the notify fd alone. */
#define EXIT_SPIN_NS 500000

/* Whether a waiter that last saw `known` has something new.  Caller holds mu. */
static int group_changed_locked(torchmp_group *g, uint64_t known)
{
    return g->version != known || g->interrupted;
}

static void waiter_unlink_locked(torchmp_group *g, group_waiter *me)
{
    for (group_waiter **link = &g->waiters; *link != NULL; link = &(*link)->next) {
        if (*link == me) {
            *link = me->next;
            return;
        }
    }
}

int torchmp_group_wait(torchmp_group *g, int64_t timeout_ns, uint64_t known_version, int *watch_exits)
{
    torchmp_loop *L = g->loop;
    int exits_fd = *watch_exits && L->exits != NULL ? torchmp_poller_fd(L->exits) : -1;
    int64_t start = exits_fd >= 0 ? clock_ns(CLOCK_MONOTONIC) : 0;
    int64_t now, until;
    group_waiter me;
    int rc, changed;

    pthread_mutex_lock(&L->mu);
    if (group_changed_locked(g, known_version)) {
        pthread_mutex_unlock(&L->mu);
        return 1;
    }
    pthread_mutex_unlock(&L->mu);
    if (notify_open(&me.wake_r, &me.wake_w) != 0)
        return -1;
    pthread_mutex_lock(&L->mu);
    changed = group_changed_locked(g, known_version);
    if (!changed) {
        me.next = g->waiters;
        g->waiters = &me;
    }
    pthread_mutex_unlock(&L->mu);
    if (changed) {
        notify_close(&me.wake_r, &me.wake_w);
        return 1;
    }

    rc = torchmp_wait_readable(me.wake_r, exits_fd, timeout_ns);
    if (rc > 0 && !(rc & 1)) {
        /* Some worker exited (maybe of another group): the I/O thread, woken
         * at the same moment, is recording it.  Yield to it rather than
         * sleep: a second wake-up costs as much as the whole record. */
        now = clock_ns(CLOCK_MONOTONIC);
        until = now + EXIT_SPIN_NS;
        if (timeout_ns >= 0 && start + timeout_ns < until)
            until = start + timeout_ns;
        rc = 0;
        while (now < until) {
            sched_yield();
            rc = torchmp_wait_readable(me.wake_r, -1, 0);
            if (rc != 0)
                break;
            now = clock_ns(CLOCK_MONOTONIC);
        }
        /* Not ours, or still on its way (a forkserver worker's trailer, a
         * busy I/O thread).  The exits set stays readable until the I/O
         * thread has been through it: watching it again this call would
         * spin. */
        if (rc == 0)
            *watch_exits = 0;
    }
    {
        int saved = errno;
        pthread_mutex_lock(&L->mu);
        waiter_unlink_locked(g, &me);
        changed = group_changed_locked(g, known_version);
        pthread_mutex_unlock(&L->mu);
        notify_close(&me.wake_r, &me.wake_w);
        errno = saved;
    }
    if (changed)
        return 1;
    return rc < 0 ? -1 : 0;
}

void torchmp_group_interrupt(torchmp_group *g)
{
    torchmp_loop *L = g->loop;
    pthread_mutex_lock(&L->mu);
    g->interrupted = 1;
    group_notify_locked(g);
    pthread_mutex_unlock(&L->mu);
}

/* Whether torchmp may still signal rank p's process group: its leader is
 * running, or is a zombie nobody has reaped.  Caller holds mu. */
static int proc_pinned_locked(const torchmp_proc *p)
{
    return p->info.pid > 0 &&
           (p->info.state == TORCHMP_PROC_RUNNING || (p->info.state == TORCHMP_PROC_EXITED && p->unreaped));
}

int torchmp_group_killpg(torchmp_group *g, int sig)
{
    torchmp_loop *L = g->loop;
    int first_errno = 0;
    if (!group_is_ours(g))
        return -1;
    /* Under mu, so no reap can slip in between the pinning check and the
     * kill: a group id is signalled only while its leader's pid is ours. */
    pthread_mutex_lock(&L->mu);
    for (int i = 0; i < g->nprocs; i++) {
        torchmp_proc *p = &g->procs[i];
        pid_t pid = p->info.pid;
        if (!proc_pinned_locked(p))
            continue;
        /* The worker calls setsid(), so its pid is its process group.  A
         * worker forked a moment ago may not have got there yet: then the
         * group does not exist, and the signal goes to the worker itself. */
        if (kill(-pid, sig) != 0) {
            int err = errno;
            if (err == ESRCH && p->info.state == TORCHMP_PROC_RUNNING && kill(pid, sig) != 0)
                err = errno;
            else if (err == ESRCH)
                err = 0;
            if (err != 0 && err != ESRCH && first_errno == 0)
                first_errno = err;
        }
    }
    pthread_mutex_unlock(&L->mu);
    if (first_errno != 0) {
        errno = first_errno;
        return -1;
    }
    return 0;
}

int torchmp_group_busy(torchmp_group *g, unsigned char *busy)
{
    torchmp_loop *L = g->loop;
    pid_t *pgids;
    int *ranks;
    unsigned char *alive;
    int n = 0, count = 0;

    pgids = malloc(((size_t)g->nprocs + 1) * sizeof(pid_t));
    ranks = malloc(((size_t)g->nprocs + 1) * sizeof(int));
    alive = malloc((size_t)g->nprocs + 1);
    if (pgids == NULL || ranks == NULL || alive == NULL) {
        free(pgids);
        free(ranks);
        free(alive);
        errno = ENOMEM;
        return -1;
    }
    pthread_mutex_lock(&L->mu);
    for (int i = 0; i < g->nprocs; i++) {
        torchmp_proc *p = &g->procs[i];
        busy[i] = p->info.state == TORCHMP_PROC_RUNNING;
        count += busy[i];
        if (!busy[i] && proc_pinned_locked(p)) {
            pgids[n] = p->info.pid;
            ranks[n++] = i;
        }
    }
    pthread_mutex_unlock(&L->mu);
    /* A group whose leader is a zombie: does anything else still live in
     * it?  Without /proc (other systems) the answer is "no": the grace
     * period then covers the leaders only. */
    if (n > 0 && torchmp_pgroups_alive(pgids, n, alive) > 0) {
        for (int j = 0; j < n; j++) {
            busy[ranks[j]] = alive[j];
            count += alive[j];
        }
    }
    free(pgids);
    free(ranks);
    free(alive);
    return count;
}

int torchmp_group_reap(torchmp_group *g, pid_t *foreign, int cap)
{
    torchmp_loop *L = g->loop;
    int n = 0;
    if (!group_is_ours(g))
        return -1;
    pthread_mutex_lock(&L->mu);
    for (int i = 0; i < g->nprocs; i++) {
        torchmp_proc *p = &g->procs[i];
        if (p->info.state != TORCHMP_PROC_EXITED || !p->unreaped)
            continue;
        if (p->foreign && n < cap)
            foreign[n++] = p->info.pid;
        proc_reap_locked(p);
    }
    pthread_mutex_unlock(&L->mu);
    return n;
}

int torchmp_group_finish_streams(torchmp_group *g)
{
    command c;
    if (!group_is_ours(g))
        return -1;
    if (!g->has_pipes)
        return 0; /* nothing to drain: spare the round trip */
    memset(&c, 0, sizeof(c));
    c.type = CMD_FINISH;
    c.group = g;
    submit(g->loop, &c, 1);
    return 0;
}

void torchmp_group_release(torchmp_group *g)
{
    command *c;
    if (!group_is_ours(g))
        return; /* the parent's loop owns it; leave it alone */
    c = calloc(1, sizeof(*c));
    if (c == NULL) {
        /* Cannot hand it over: leaking the group is the only safe choice. */
        return;
    }
    c->type = CMD_RELEASE;
    c->group = g;
    submit(g->loop, c, 0);
}
