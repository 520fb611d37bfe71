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
 * This file: the thread and the command queue Python talks to it through,
 * the wake-up channels and SIGCHLD handler, loop creation (once per process,
 * again in a forked child), and the loop-wide public calls.  The rest of the
 * loop is in loop_streams.c, loop_reap.c and loop_groups.c (loop_internal.h).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "loop_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

#ifdef TORCHMP_HAVE_EVENTFD
#include <sys/eventfd.h>
#endif
#ifdef __linux__
#include <sys/prctl.h>
#endif

#define MAX_EVENTS 256

/* This process's pid, kept current across fork() by an atfork handler.  The
 * launcher checks that it is the process that owns a loop, a group or the
 * keeper's table about twenty times a launch, and getpid() is a system call
 * each time.  Only for the launcher's side: a vfork child runs no atfork
 * handler and must call getpid() itself. */
static pid_t self_pid;
static int self_pid_tracked;
static pthread_once_t self_pid_once = PTHREAD_ONCE_INIT;

static void self_pid_after_fork(void)
{
    self_pid = getpid();
}

static void self_pid_init(void)
{
    self_pid = getpid();
    self_pid_tracked = pthread_atfork(NULL, NULL, self_pid_after_fork) == 0;
}

pid_t torchmp_self_pid(void)
{
    if (pthread_once(&self_pid_once, self_pid_init) != 0 || !self_pid_tracked)
        return getpid();
    return self_pid;
}

static torchmp_loop *the_loop;

/* ---- wake-up channels --------------------------------------------------- */

/* A wakeup channel: an eventfd, or a non-blocking pipe where there is none. */
int torchmp_loop_notify_open(int *r, int *w)
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

void torchmp_loop_notify_close(int *r, int *w)
{
    if (*w != *r)
        close_fd(w);
    close_fd(r);
    *w = -1;
}

/* Async-signal-safe: also called from the SIGCHLD handler. */
void torchmp_loop_notify_post(int w)
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
        torchmp_loop_notify_post(fd);
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
    struct sigaction sa, current;
    /* A forked child inherits the parent's handler, this one, and the chain
     * it saved then: installing again would save ourselves as the handler
     * to chain to, and the first SIGCHLD would loop forever.  Only the
     * wake-up channel is the child's own. */
    if (sigaction(SIGCHLD, NULL, &current) == 0 && (current.sa_flags & SA_SIGINFO) &&
        current.sa_sigaction == on_sigchld) {
        sigchld_wake_fd = wake_fd;
        return 0;
    }
    memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = on_sigchld;
    sa.sa_flags = SA_SIGINFO | SA_RESTART | SA_NOCLDSTOP;
    sigemptyset(&sa.sa_mask);
    sigchld_wake_fd = wake_fd;
    return sigaction(SIGCHLD, &sa, &previous_sigchld);
}

int torchmp_children_reaped_at_exit(void)
{
    struct sigaction current;
    if (sigaction(SIGCHLD, NULL, &current) != 0)
        return 0;
    return (!(current.sa_flags & SA_SIGINFO) && current.sa_handler == SIG_IGN) ||
           (current.sa_flags & SA_NOCLDWAIT) != 0;
}

/* The poll backend learns of exits from SIGCHLD, and the program can take
 * that from it: a SIGCHLD handler installed after torchmp's replaces it
 * (signal.signal, an asyncio child watcher), and a SIGCHLD blocked in every
 * thread that could take it stays pending.  A wait would then never end, and
 * torchmp.run would report a timeout for a command that exited long before.
 * So while an exit is awaited the loop looks once a second whether SIGCHLD
 * is taken (two system calls: is its handler still installed, is the signal
 * pending); from a look that finds it taken, it scans for exits itself and
 * looks again after 0.1 s, until SIGCHLD is its own again.  An exit is then
 * seen at most 0.1 s late, or a second for the first one after the program
 * took SIGCHLD while exits were awaited; an untaken SIGCHLD costs one wake-up
 * a second.  The handler is not put back: the program chose its own
 * (SIG_IGN even reaps for it). */
#define EXIT_LOOK_NS (1000 * 1000000LL)
#define EXIT_LOOK_TAKEN_NS (100 * 1000000LL)

static int sigchld_taken(void)
{
    struct sigaction current;
    sigset_t pending;
    if (sigaction(SIGCHLD, NULL, &current) != 0 || !(current.sa_flags & SA_SIGINFO) ||
        current.sa_sigaction != on_sigchld)
        return 1;
    /* This thread blocks every signal: pending here, SIGCHLD is either its
     * own (never: nothing sends to this thread) or the process's, which no
     * thread takes. */
    return sigpending(&pending) != 0 || sigismember(&pending, SIGCHLD) == 1;
}

/* Poller timeout until the next look (-1: none, nothing is awaited),
 * arming the looks while an exit is awaited. */
static int exit_look_timeout_ms(torchmp_loop *L)
{
    int64_t now, left;
    if (L->backend != TORCHMP_BACKEND_POLL)
        return -1;
    if (!torchmp_loop_ranks_awaited(L) && !torchmp_loop_commands_awaited(L)) {
        L->exit_look_ns = 0;
        return -1;
    }
    now = clock_ns(CLOCK_MONOTONIC);
    if (L->exit_look_ns == 0)
        L->exit_look_ns = now + (sigchld_taken() ? EXIT_LOOK_TAKEN_NS : EXIT_LOOK_NS);
    left = L->exit_look_ns - now;
    return left <= 0 ? 0 : (int)((left + 999999) / 1000000);
}

static void exit_look_if_due(torchmp_loop *L)
{
    int64_t now;
    if (L->exit_look_ns == 0)
        return;
    now = clock_ns(CLOCK_MONOTONIC);
    if (now < L->exit_look_ns)
        return;
    if (!sigchld_taken()) {
        L->exit_look_ns = now + EXIT_LOOK_NS;
        return;
    }
    L->exit_look_ns = now + EXIT_LOOK_TAKEN_NS;
    (void)torchmp_loop_reap_scan(L);
    (void)torchmp_loop_commands_scan(L);
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
            c->result = torchmp_loop_do_spawn(L, c);
            break;
        case CMD_FINISH:
            torchmp_loop_do_finish(L, c->group);
            c->result = 0;
            break;
        case CMD_PREPARE:
            c->result = torchmp_loop_do_prepare(L, c);
            break;
        case CMD_ADOPT:
            c->result = torchmp_loop_do_adopt(L, c);
            break;
        case CMD_SAY:
            c->result = torchmp_loop_do_say(L, c);
            c->err.errnum = c->result < 0 ? errno : 0;
            break;
        case CMD_DROP_UNSTARTED:
            for (int i = 0; i < c->group->nprocs; i++) {
                if (c->group->procs[i].info.state == TORCHMP_PROC_UNSTARTED)
                    torchmp_loop_rank_streams_abort(L, &c->group->procs[i]);
            }
            c->result = 0;
            break;
        case CMD_WATCH_COMMAND:
            /* The message lives in the command, which the loop now holds a
             * reference to; nobody waits for it. */
            torchmp_loop_command_add(L, c->cmd);
            continue;
        case CMD_RELEASE:
            /* Python signals the group no more: let its zombies go.  Under mu,
             * with the reaping: an exit recorded meanwhile by a waiting caller
             * (a group spawned in place) either sees the flag or is seen here. */
            pthread_mutex_lock(&L->mu);
            c->group->released = 1;
            for (int i = 0; i < c->group->nprocs; i++) {
                if (c->group->procs[i].info.state == TORCHMP_PROC_EXITED)
                    torchmp_loop_proc_reap_locked(&c->group->procs[i]);
            }
            pthread_mutex_unlock(&L->mu);
            if (!c->group->linked)
                torchmp_loop_group_release_unlinked(L, c->group);
            free(c);
            continue; /* nobody waits for a release */
        }
        pthread_mutex_lock(&L->mu);
        __atomic_store_n(&c->done, 1, __ATOMIC_RELEASE);
        pthread_cond_broadcast(&L->cmd_done);
        pthread_mutex_unlock(&L->mu);
    }
}

static void *loop_main(void *arg)
{
    torchmp_loop *L = arg;
    torchmp_event events[MAX_EVENTS];
    torchmp_event exit_events[MAX_EVENTS];

#ifdef __linux__
    /* Named by itself, first thing: pthread_setname_np from the creating
     * thread opens and writes /proc/self/task/TID/comm, 40 us of the
     * launcher's first launch here, where this prctl is under one.  (Until
     * the thread has first run, ps -L shows it under the launcher's name.) */
    (void)prctl(PR_SET_NAME, (unsigned long)"torchmp-io", 0, 0, 0);
#endif
    for (;;) {
        int timeout = torchmp_loop_streams_timeout_ms(L);
        int commands_timeout = torchmp_loop_commands_timeout_ms(L);
        int follow_timeout = torchmp_loop_follow_timeout_ms(L);
        int look_timeout = exit_look_timeout_ms(L);
        int n;
        if (commands_timeout >= 0 && (timeout < 0 || commands_timeout < timeout))
            timeout = commands_timeout;
        if (look_timeout >= 0 && (timeout < 0 || look_timeout < timeout))
            timeout = look_timeout;
        if (follow_timeout >= 0 && (timeout < 0 || follow_timeout < timeout))
            timeout = follow_timeout;
        if (L->consoles_polled && (timeout < 0 || timeout > 10))
            timeout = 10;
        if (L->catch_up_more)
            timeout = 0;
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
                if (L->backend == TORCHMP_BACKEND_POLL) {
                    (void)torchmp_loop_reap_scan(L);
                    (void)torchmp_loop_commands_scan(L);
                }
            } else if (kind == WATCH_STREAM) {
                stream *s = events[i].ptr;
                if (s->fd >= 0)
                    torchmp_loop_stream_pump(L, s, -1);
            } else if (kind == WATCH_CONSOLE) {
                torchmp_loop_console_entry_writable(L, events[i].ptr);
            } else if (kind == WATCH_COMMAND) {
                torchmp_loop_command_event(L, events[i].ptr);
            } else if (kind == WATCH_FOLLOW) {
                torchmp_loop_follow_event(L);
            } else if (kind == WATCH_EXITS) {
                /* Level-triggered: exits beyond MAX_EVENTS show up next round. */
                int m = torchmp_poller_wait(L->exits, exit_events, MAX_EVENTS, 0);
                for (int j = 0; j < m; j++)
                    torchmp_loop_proc_exit_event(L, exit_events[j].ptr);
            }
        }
        /* Whatever woke the loop: what was queued to wait for a wake-up. */
        if (__atomic_exchange_n(&L->quiet_queued, 0, __ATOMIC_ACQ_REL))
            run_commands(L);
        exit_look_if_due(L);
        torchmp_loop_follow_pump(L);
        torchmp_loop_streams_tick(L);
        torchmp_loop_commands_tick(L);
        if (L->consoles_polled)
            L->consoles_polled = torchmp_loop_consoles_poll(L);
        if (L->held_feeds > 0 || L->said_entries > 0)
            torchmp_loop_catch_up(L);
        torchmp_loop_collect_groups(L);
        torchmp_loop_commands_collect(L);
    }
    return NULL;
}

static int choose_backend(void)
{
    const char *forced = getenv("TORCHMP_BACKEND");
    if (forced != NULL && strcmp(forced, "poll") == 0)
        return TORCHMP_BACKEND_POLL;
#if defined(TORCHMP_HAVE_EPOLL) && defined(TORCHMP_HAVE_PIDFD)
    /* pidfd_open arrived in Linux 5.3.  Probed with an invalid pid, which
     * a kernel that has the call refuses with EINVAL before it makes
     * anything: a real pidfd and its close cost 20 us of the first launch
     * here.  ENOSYS (an older kernel) and EPERM (a seccomp filter) leave
     * the poll backend.  (An emulation that hands out a descriptor for it
     * anyway has the call: the descriptor is closed.) */
    {
        int saved = errno;
        long fd = syscall(SYS_pidfd_open, 0, 0);
        int has_it = fd >= 0 || errno == EINVAL;
        if (fd >= 0)
            close((int)fd);
        errno = saved;
        if (has_it)
            return TORCHMP_BACKEND_EPOLL;
    }
#endif
    return TORCHMP_BACKEND_POLL;
}

int torchmp_backend_choice(void)
{
    /* Once per process (a forked child inherits the answer, which holds
     * there too); the GIL serialises the first calls. */
    static int choice;
    if (choice == 0)
        choice = choose_backend();
    return choice;
}

static torchmp_loop *loop_create(void)
{
    torchmp_loop *L = calloc(1, sizeof(*L));
    sigset_t all, old;
    int saved;

    if (L == NULL)
        return NULL;
    L->kind = WATCH_CONTROL;
    L->exits_kind = WATCH_EXITS;
    L->owner_pid = torchmp_self_pid();
    L->wake_r = L->wake_w = -1;
    L->inotify_fd = -1;
    L->timed = STREAM_LIST_INIT(timed);
    L->follow_dirty = STREAM_LIST_INIT(follow_dirty);
    L->backend = torchmp_backend_choice();
    L->pipe_budget = PIPE_GROWTH_BUDGET;
    L->max_fd = sysconf(_SC_OPEN_MAX);
    if (L->max_fd <= 0 || L->max_fd > (1L << 20))
        L->max_fd = 1L << 20;
    L->use_vfork = torchmp_vfork_enabled();

    L->readbuf = malloc(READ_CHUNK);
    L->console_scratch = malloc(SCRATCH_SIZE);
    L->filtered_scratch = malloc(SCRATCH_SIZE);
    if (L->readbuf == NULL || L->console_scratch == NULL || L->filtered_scratch == NULL)
        goto fail;
    /* Before the I/O thread exists: one thread fewer to fork.  Without a
     * keeper (fork failed) workers still die with the launcher by PDEATHSIG;
     * only their own children would be left. */
    (void)torchmp_keeper_start(); /* settled below, once the I/O thread runs */
    torchmp_procscan_init();
    if (torchmp_loop_notify_open(&L->wake_r, &L->wake_w) != 0)
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
    pthread_detach(L->thread);
    /* Ready before the first rank: a context's launcher may only ever poll
     * (wait(0)), and nothing else would learn that the start failed.  The
     * keeper's program started above while this thread made the loop.
     * (Left to finish while the first ranks start, as torchmp.run's command
     * does, it made 4 redirected ranks of `cat` 3-5 % slower to finish here,
     * when the program was linked with the C library.) */
    torchmp_keeper_settle(1);
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
    torchmp_loop_notify_close(&L->wake_r, &L->wake_w);
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
torchmp_loop *torchmp_loop_get(void)
{
    if (the_loop != NULL && the_loop->owner_pid == torchmp_self_pid())
        return the_loop;
    the_loop = loop_create();
    return the_loop;
}

int torchmp_loop_exists(void)
{
    return the_loop != NULL && the_loop->owner_pid == torchmp_self_pid();
}

int torchmp_loop_backend(void)
{
    torchmp_loop *L = torchmp_loop_get();
    return L == NULL ? -1 : L->backend;
}

/* The launcher's consoles (not Python's queues) of what fd refers to (all
 * if fd < 0): bytes waiting, or bytes taken so far. */
static uint64_t consoles_sum(int fd, int shown)
{
    torchmp_loop *L = the_loop;
    uint64_t n = 0;
    if (L == NULL || L->owner_pid != torchmp_self_pid())
        return 0;
    pthread_mutex_lock(&L->mu);
    for (console_entry *e = L->consoles; e != NULL; e = e->next) {
        if (torchmp_console_is_queue(e->console) || (fd >= 0 && !torchmp_console_same_target(e->console, fd)))
            continue;
        n += shown ? torchmp_console_shown(e->console) : torchmp_console_pending(e->console);
    }
    pthread_mutex_unlock(&L->mu);
    return n;
}

size_t torchmp_consoles_pending(int fd)
{
    return (size_t)consoles_sum(fd, 0);
}

uint64_t torchmp_consoles_shown(int fd)
{
    return consoles_sum(fd, 1);
}

int torchmp_say(torchmp_console *queue, int fd, const char *data, size_t len)
{
    torchmp_loop *L = torchmp_loop_get();
    command c;
    if (L == NULL)
        return -1;
    if (queue == NULL && fd != 1 && fd != 2) {
        errno = EINVAL;
        return -1;
    }
    memset(&c, 0, sizeof(c));
    c.type = CMD_SAY;
    c.console = queue;
    c.console_fd = fd;
    c.data = data;
    c.len = len;
    torchmp_loop_submit(L, &c, 1);
    if (c.result < 0)
        errno = c.err.errnum;
    return c.result;
}

#define SUBMIT_SPIN_NS 200000

static void queue_command(torchmp_loop *L, command *c)
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
}

/* What may wait for the loop's next wake-up: groups of that many ranks in
 * all (about 1 KiB a rank), then the loop is woken to free them. */
#define QUIET_QUEUE_MAX 64

/* Queue a command for the loop's next wake-up, whatever wakes it: for work
 * that may wait (a release with nothing left to watch), of weight ranks.
 * An exit the caller collects first may not wake the loop at all, so the
 * queue is bounded. */
void torchmp_loop_queue_quietly(torchmp_loop *L, command *c, int weight)
{
    queue_command(L, c);
    if (__atomic_add_fetch(&L->quiet_queued, weight > 0 ? weight : 1, __ATOMIC_ACQ_REL) > QUIET_QUEUE_MAX)
        torchmp_loop_notify_post(L->wake_w);
}

/* Queue a command and wait for the loop to run it (unless it is a release). */
int torchmp_loop_submit(torchmp_loop *L, command *c, int wait_done)
{
    queue_command(L, c);
    torchmp_loop_notify_post(L->wake_w);
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
