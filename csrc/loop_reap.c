/*
 * A rank's exit: how the loop learns of it (a pidfd in the exits set, a
 * SIGCHLD scan on the poll backend, a forkserver's trailer), records it and
 * wakes the callers waiting for it; and the zombie that pins the rank's
 * process group id until torchmp lets it go, which is when signalling the
 * group stops being safe.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "loop_internal.h"

#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/time.h>
#include <sys/wait.h>

/* ---- exits -------------------------------------------------------------- */

/* Whether the exits recorded so far decide a context's result: every rank
 * exited, or (fail_fast) one failed.  Caller holds mu. */
static int group_result_decided_locked(const torchmp_group *g, int fail_fast)
{
    return g->exited == g->nprocs || (fail_fast && g->failed > 0);
}

/* Whether a change is one that a waiter or watcher sleeping through the
 * exits that decide nothing (TORCHMP_WAIT_DECIDED) wakes for: the result is
 * decided, or the wait was interrupted.  Caller holds mu. */
static int group_decided_locked(const torchmp_group *g, int fail_fast)
{
    return g->interrupted || group_result_decided_locked(g, fail_fast);
}

int torchmp_group_decided(torchmp_group *g, int fail_fast, uint64_t *version, int *left)
{
    torchmp_loop *L = g->loop;
    int decided;
    pthread_mutex_lock(&L->mu);
    decided = group_result_decided_locked(g, fail_fast);
    *version = g->version;
    *left = g->nprocs - g->exited;
    pthread_mutex_unlock(&L->mu);
    return decided;
}

/* A waiter sleeping through the exits that decide nothing also wakes once
 * when one rank is left: its caller takes in the exits so far while that
 * rank runs, and waits again, watching the rank's exit itself where it can
 * (woken by the exit, it records it without a hop through the I/O thread).
 * Caller holds mu. */
static int waiter_woken_locked(const torchmp_group *g, const group_waiter *w)
{
    return !w->until_decided || group_decided_locked(g, w->fail_fast) ||
           (w->wakes_at_one_left && g->nprocs - g->exited == 1);
}

/* Wake the callers sleeping in torchmp_group_wait, and post to the event
 * loops watching the group, that want this change.  A waiter whose own
 * thread made the change is not posted to: it is recording an exit it was
 * woken by, and looks at the group once that is done (torchmp_group_wait).
 * Caller holds mu. */
static void group_notify_locked(torchmp_group *g)
{
    pthread_t self = pthread_self();
    for (group_waiter *w = g->waiters; w != NULL; w = w->next) {
        if (waiter_woken_locked(g, w) && !pthread_equal(w->thread, self))
            torchmp_loop_notify_post(w->wake_w);
    }
    for (group_watcher *w = g->watchers; w != NULL; w = w->next) {
        if (!w->until_decided || group_decided_locked(g, w->fail_fast))
            torchmp_notifier_post(w->notifier, w->token, TORCHMP_NOTE_CHANGED);
    }
}

static int64_t timeval_ns(struct timeval tv)
{
    return (int64_t)tv.tv_sec * 1000000000LL + (int64_t)tv.tv_usec * 1000;
}

/* A rank that exited by itself and left nothing in its process group is
 * reaped at once, in a context of up to this many ranks: nothing can be
 * signalled through that group any more, so its zombie pins nothing worth
 * keeping, and close() -- on the way from the last exit to wait()'s return --
 * has one scan and one reap less to do for it.  Larger contexts leave it to
 * close()'s one pass for all their groups. */
#define EARLY_REAP_MAX_RANKS 8
/* At most this many pids handed out since the rank started: the look is a
 * few dozen getpgid() calls, never a listing of /proc. */
#define EARLY_REAP_SPAN 64

/* Whether a rank's exit lets it be reaped before close() (see above): it
 * exited (a signal's death is kept pinned: a SIGKILL torchmp did not send is
 * explained from what the zombie pins, torchmp._oom), it is our child, and
 * its context is small.  Caller holds mu. */
static int proc_early_reap_wanted_locked(const torchmp_proc *p, int status, int status_lost)
{
    return p->unreaped && !p->by_forkserver && !status_lost && WIFEXITED(status) &&
           p->group->nprocs <= EARLY_REAP_MAX_RANKS;
}

static void proc_early_reap(torchmp_loop *L, torchmp_proc *p)
{
    if (torchmp_pgroup_surely_empty(p->info.pid, EARLY_REAP_SPAN) != 1)
        return;
    pthread_mutex_lock(&L->mu);
    if (p->unreaped) /* (close() may have reaped it meanwhile) */
        torchmp_loop_proc_reap_locked(p);
    pthread_mutex_unlock(&L->mu);
}

/* Record a rank's exit: first everything the worker wrote before it exited
 * goes out, then the state flips and Python is woken.  unreaped: the zombie
 * is still there (see torchmp_proc.unreaped). */
static void proc_record_exit(torchmp_loop *L, torchmp_proc *p, int status, int64_t utime_ns, int64_t stime_ns,
                             int64_t maxrss_kb, int status_lost, int unreaped)
{
    int64_t now_mono = clock_ns(CLOCK_MONOTONIC);
    int64_t now_real = clock_ns(CLOCK_REALTIME);
    int early_reap;

    p->exiting = 1;
    for (int w = 0; w < STREAM_COUNT; w++)
        torchmp_loop_stream_drain_buffered(L, &p->streams[w]);
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
    p->group->exited++;
    if (status != 0)
        p->group->failed++;
    /* Nobody will signal this group again: a released group's exits, or a
     * pid whose zombie is already gone (it may be recycled at any time). */
    if (p->group->released || !unreaped)
        torchmp_loop_proc_reap_locked(p);
    early_reap = proc_early_reap_wanted_locked(p, status, status_lost);
    p->group->version++;
    group_notify_locked(p->group);
    pthread_mutex_unlock(&L->mu);
    p->exiting = 0;
    /* After the wake-up: the waiter builds its result meanwhile. */
    if (early_reap)
        proc_early_reap(L, p);
    /* The last touch of p: a released group with no rank running may be
     * freed by the loop thread from here on (a group spawned in place can
     * have its exits recorded by a waiting caller).  Atomic: a caller-thread
     * spawn counts its ranks in as they start. */
    __atomic_sub_fetch(&p->group->running, 1, __ATOMIC_ACQ_REL);
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

/* waitid(P_PID, pid, WEXITED | WNOWAIT [| WNOHANG]) with the zombie's
 * rusage: Linux's system call takes a fifth argument that libc's wrapper
 * hides, and fills it (self + waited-for children, as wait4 would) without
 * reaping. */
static int waitid_keep(pid_t pid, siginfo_t *si, struct rusage *ru, int nohang)
{
    int flags = WEXITED | WNOWAIT | (nohang ? WNOHANG : 0);
#ifdef TORCHMP_HAVE_PIDFD
    return (int)syscall(SYS_waitid, P_PID, (id_t)pid, si, flags, ru);
#else
    (void)ru; /* filled in when the zombie is reaped (torchmp_loop_proc_reap_locked) */
    return waitid(P_PID, (id_t)pid, si, flags);
#endif
}

static int collect(pid_t pid, int nohang, int *status, int64_t *utime_ns, int64_t *stime_ns, int64_t *maxrss_kb)
{
    struct rusage ru;
    siginfo_t si;
    int r;

    memset(&ru, 0, sizeof(ru));
    memset(&si, 0, sizeof(si));
    do {
        r = waitid_keep(pid, &si, &ru, nohang);
    } while (r < 0 && errno == EINTR && nohang);
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

int torchmp_collect_exit(pid_t pid, int *status, int64_t *utime_ns, int64_t *stime_ns, int64_t *maxrss_kb)
{
    return collect(pid, 1, status, utime_ns, stime_ns, maxrss_kb);
}

int torchmp_wait_exit(pid_t pid, int *status, int64_t *utime_ns, int64_t *stime_ns, int64_t *maxrss_kb)
{
    return collect(pid, 0, status, utime_ns, stime_ns, maxrss_kb);
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

/* proc_try_collect by whichever thread gets there first: the loop thread
 * (the rank's pidfd fired, or a SIGCHLD scan), or a caller waiting for a
 * group spawned in place, woken by the same exit (torchmp_group_wait).  The
 * other finds the rank claimed or already EXITED and leaves it alone.  Such a
 * group has no stream the loop drains, so recording its exit from either
 * thread touches only what is safe there (see torchmp_group_spawn). */
static int proc_collect_claimed(torchmp_loop *L, torchmp_proc *p)
{
    int expected = 0;
    if (!__atomic_compare_exchange_n(&p->collecting, &expected, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        return 0;
    /* Once it is recorded the claim stays: nobody collects it again, and its
     * group may be freed (see proc_record_exit), so p is not touched. */
    if (__atomic_load_n(&p->info.state, __ATOMIC_ACQUIRE) != TORCHMP_PROC_RUNNING)
        return 0;
    if (proc_try_collect(L, p))
        return 1;
    __atomic_store_n(&p->collecting, 0, __ATOMIC_RELEASE); /* still running */
    return 0;
}

/* Let the zombie go: after this the pid and the process group id may be
 * recycled, so nothing may signal them again.  A forkserver's worker is
 * the forkserver's to reap: Python tells it (torchmp_group_reap).  Caller
 * holds mu. */
void torchmp_loop_proc_reap_locked(torchmp_proc *p)
{
    torchmp_keeper_remove(p->keeper_slot);
    p->keeper_slot = 0;
    if (!p->unreaped)
        return;
    p->unreaped = 0;
    if (!p->by_forkserver) {
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
 * trailer the forkserver appends to the worker's return channel once the
 * worker has exited.  The exit is recorded when the trailer is there and the
 * worker is gone (its pidfd fired: a grandchild it forked may keep the
 * channel open), or at the channel's EOF.  EOF without a trailer means the
 * forkserver died. */
void torchmp_loop_proc_forkserver_exit(torchmp_loop *L, torchmp_proc *p, int at_eof)
{
    stream *s = &p->streams[STREAM_RET];
    torchmp_exit_trailer t;
    int found = 0;

    if (p->exiting || p->info.state != TORCHMP_PROC_RUNNING)
        return;
    /* Bytes that merely look like a trailer count only once the worker is
     * gone (the forkserver writes the trailer once it has exited).  Without
     * a pidfd (poll backend) ask whether the pid is gone or a zombie. */
    if (!at_eof && !p->pid_gone && !torchmp_pid_exited(p->info.pid))
        return;
    pthread_mutex_lock(&L->mu);
    if (s->ret_len >= sizeof(t) &&
        memcmp(s->ret_buf + s->ret_len - sizeof(t), TORCHMP_EXIT_TRAILER_MAGIC, 8) == 0) {
        memcpy(&t, s->ret_buf + s->ret_len - sizeof(t), sizeof(t));
        s->ret_len -= sizeof(t);
        found = 1;
    }
    pthread_mutex_unlock(&L->mu);
    if (found)
        proc_record_exit(L, p, (int)t.wait_status, t.utime_ns, t.stime_ns, t.maxrss_kb, 0, 1);
    else if (at_eof)
        proc_record_exit(L, p, SIGKILL, 0, 0, 0, 1, 0);
}

/* Whether a rank's exit may still be found by a scan: some group has a
 * rank running (a forkserver's worker too, which the scan leaves to the
 * forkserver: counting them apart would cost a pass over the ranks on every
 * round of the loop). */
int torchmp_loop_ranks_awaited(const torchmp_loop *L)
{
    for (const torchmp_group *g = L->groups; g != NULL; g = g->next) {
        if (__atomic_load_n(&g->running, __ATOMIC_ACQUIRE) > 0)
            return 1;
    }
    return 0;
}

/* Records the exits found; how many. */
int torchmp_loop_reap_scan(torchmp_loop *L)
{
    int found = 0;
    for (torchmp_group *g = L->groups; g != NULL; g = g->next) {
        for (int i = 0; i < g->nprocs && g->running > 0; i++) {
            if (g->procs[i].info.state == TORCHMP_PROC_RUNNING && !g->procs[i].by_forkserver)
                found += proc_collect_claimed(L, &g->procs[i]);
        }
    }
    return found;
}

/* ---- watching ----------------------------------------------------------- */

/* Start watching a forked worker.  On failure the worker is killed and
 * reaped, and the rank's streams are closed. */
/* A started rank becomes RUNNING: seen by Python's snapshots, covered by
 * the keeper, counted in its group. */
static void proc_mark_running(torchmp_loop *L, torchmp_proc *p, pid_t pid, int64_t start)
{
    pthread_mutex_lock(&L->mu);
    p->info.pid = pid;
    p->info.state = TORCHMP_PROC_RUNNING;
    p->info.start_mono_ns = start;
    if (p->keeper_slot == 0) /* a spawned rank's is filled already (torchmp_keeper_spawn) */
        p->keeper_slot = torchmp_keeper_add(pid);
    pthread_mutex_unlock(&L->mu);
    __atomic_add_fetch(&p->group->running, 1, __ATOMIC_ACQ_REL);
}

int torchmp_loop_rank_adopt(torchmp_loop *L, torchmp_proc *p, pid_t pid, int by_forkserver, int64_t start,
                            torchmp_spawn_error *err)
{
    p->by_forkserver = by_forkserver;
#ifdef TORCHMP_HAVE_PIDFD
    if (L->backend == TORCHMP_BACKEND_EPOLL) {
        p->pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
        if (p->pidfd >= 0 && torchmp_poller_add(L->exits, p->pidfd, p) != 0)
            close_fd(&p->pidfd);
        if (p->pidfd < 0 && by_forkserver) {
            /* Not our child, so nothing to kill or reap here: a worker that
             * is already gone (ESRCH) has its trailer on the way; otherwise
             * its exit shows as the trailer plus kill(pid, 0) == ESRCH. */
            p->pid_gone = errno == ESRCH;
        } else if (p->pidfd < 0) {
            int status;
            err->step = TORCHMP_STEP_PIDFD;
            err->errnum = errno;
            kill(pid, SIGKILL);
            while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
                ;
            torchmp_loop_rank_streams_abort(L, p);
            errno = err->errnum;
            return -1;
        }
    }
#endif
    proc_mark_running(L, p, pid, start);
    if (by_forkserver) {
        /* The worker may have run to completion before we got here: its
         * trailer (or even its channel's EOF) may be in already. */
        torchmp_loop_proc_forkserver_exit(L, p, p->streams[STREAM_RET].fd < 0);
    }
    return 0;
}

#ifdef TORCHMP_HAVE_PIDFD
/* torchmp_loop_rank_adopt for a rank spawned in the calling thread
 * (torchmp_group_spawn): the rank is RUNNING before its pidfd joins the exits
 * set, so the loop thread never sees an exit event for a rank it does not
 * know is running.  If it cannot be watched, it is killed and reaped here and
 * stays unstarted. */
int torchmp_loop_rank_adopt_here(torchmp_loop *L, torchmp_proc *p, pid_t pid, int64_t start,
                                 torchmp_spawn_error *err)
{
    int status;
    int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);

    if (pidfd >= 0) {
        p->pidfd = pidfd;
        proc_mark_running(L, p, pid, start);
        if (torchmp_poller_add(L->exits, pidfd, p) == 0)
            return 0;
        err->errnum = errno;
        pthread_mutex_lock(&L->mu);
        torchmp_keeper_remove(p->keeper_slot);
        p->keeper_slot = 0;
        p->info.state = TORCHMP_PROC_UNSTARTED;
        p->info.pid = 0;
        pthread_mutex_unlock(&L->mu);
        __atomic_sub_fetch(&p->group->running, 1, __ATOMIC_ACQ_REL);
        close_fd(&p->pidfd);
    } else {
        err->errnum = errno;
    }
    err->step = TORCHMP_STEP_PIDFD;
    kill(pid, SIGKILL);
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
        ;
    errno = err->errnum;
    return -1;
}
#endif

/* A worker's pidfd fired. */
void torchmp_loop_proc_exit_event(torchmp_loop *L, torchmp_proc *p)
{
    if (!p->by_forkserver) {
        (void)proc_collect_claimed(L, p);
        return;
    }
    if (p->info.state != TORCHMP_PROC_RUNNING || p->pidfd < 0)
        return;
    {
        /* Not ours to reap: wait for the forkserver's trailer. */
        (void)torchmp_poller_del(L->exits, p->pidfd);
        close_fd(&p->pidfd);
        p->pid_gone = 1;
        torchmp_loop_stream_pump(L, &p->streams[STREAM_RET], -1);
        torchmp_loop_proc_forkserver_exit(L, p, 0);
    }
}

/* ---- waiting ------------------------------------------------------------ */

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

int torchmp_group_watch(torchmp_group *g, torchmp_notifier *n, uint64_t token, int flags)
{
    torchmp_loop *L = g->loop;
    group_watcher *w = calloc(1, sizeof(*w));
    if (w == NULL)
        return -1;
    w->notifier = torchmp_notifier_ref(n);
    w->token = token;
    w->until_decided = (flags & TORCHMP_WAIT_DECIDED) != 0;
    w->fail_fast = (flags & TORCHMP_WAIT_FAIL_FAST) != 0;
    pthread_mutex_lock(&L->mu);
    w->next = g->watchers;
    g->watchers = w;
    pthread_mutex_unlock(&L->mu);
    return 0;
}

void torchmp_group_unwatch(torchmp_group *g, torchmp_notifier *n)
{
    torchmp_loop *L = g->loop;
    group_watcher *gone = NULL;
    pthread_mutex_lock(&L->mu);
    for (group_watcher **link = &g->watchers; *link != NULL; link = &(*link)->next) {
        if ((*link)->notifier == n) {
            gone = *link;
            *link = gone->next;
            break;
        }
    }
    pthread_mutex_unlock(&L->mu);
    if (gone != NULL) {
        torchmp_notifier_unref(gone->notifier);
        free(gone);
    }
}

int torchmp_group_wait(torchmp_group *g, int64_t timeout_ns, uint64_t known_version, int *watch_exits,
                       int signal_fd, int flags)
{
    torchmp_loop *L = g->loop;
    int exits_fd = -1;
    int64_t start = 0, now, until;
    group_waiter me;
    int rc, changed, signalled = 0;

    pthread_mutex_lock(&L->mu);
    if (group_changed_locked(g, known_version)) {
        pthread_mutex_unlock(&L->mu);
        return 1;
    }
    pthread_mutex_unlock(&L->mu);
    if (torchmp_loop_notify_open(&me.wake_r, &me.wake_w) != 0)
        return -1;
    me.until_decided = (flags & TORCHMP_WAIT_DECIDED) != 0;
    me.fail_fast = (flags & TORCHMP_WAIT_FAIL_FAST) != 0;
    me.can_watch_exits = *watch_exits && L->exits != NULL;
    me.watches_exits = 0;
    me.wakes_at_one_left = 0;
    me.thread = pthread_self();
    pthread_mutex_lock(&L->mu);
    changed = group_changed_locked(g, known_version);
    if (!changed) {
        /* Watching every exit costs a wake-up each (and a race with this
         * thread, which records it too); until the result is decided, only
         * the last rank's exit is worth it. */
        me.watches_exits = me.can_watch_exits && (!me.until_decided || g->nprocs - g->exited <= 1);
        me.wakes_at_one_left = me.until_decided && g->nprocs - g->exited > 1;
        me.next = g->waiters;
        g->waiters = &me;
    }
    pthread_mutex_unlock(&L->mu);
    if (!changed && me.watches_exits) {
        exits_fd = torchmp_poller_fd(L->exits);
        start = clock_ns(CLOCK_MONOTONIC);
    }
    if (changed) {
        torchmp_loop_notify_close(&me.wake_r, &me.wake_w);
        return 1;
    }

    rc = torchmp_wait_readable(me.wake_r, exits_fd, signal_fd, timeout_ns);
    if (rc > 0 && (rc & 4)) {
        signalled = 1; /* the caller runs the handlers, then waits again */
        rc &= ~4;
    }
    if (rc > 0 && !(rc & 1) && g->spawned_here) {
        /* Some worker exited: if it is one of ours, record it here rather
         * than wait for the loop thread to wake, record it and wake us. */
        for (int i = 0; i < g->nprocs; i++)
            (void)proc_collect_claimed(L, &g->procs[i]);
        pthread_mutex_lock(&L->mu);
        changed = group_changed_locked(g, known_version);
        pthread_mutex_unlock(&L->mu);
        if (changed)
            rc = 1; /* as if woken by the notify fd: no spin below */
    }
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
            rc = torchmp_wait_readable(me.wake_r, -1, -1, 0);
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
        torchmp_loop_notify_close(&me.wake_r, &me.wake_w);
        errno = saved;
    }
    if (changed)
        return 1;
    if (signalled) {
        errno = EINTR;
        return -1;
    }
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

/* ---- signalling and reaping --------------------------------------------- */

/* Whether torchmp may still signal rank p's process group: its leader is
 * running, or is a zombie nobody has reaped.  Caller holds mu. */
static int proc_pinned_locked(const torchmp_proc *p)
{
    return p->info.pid > 0 &&
           (p->info.state == TORCHMP_PROC_RUNNING || (p->info.state == TORCHMP_PROC_EXITED && p->unreaped));
}

/* Send sig to pinned rank p's process group.  The worker calls setsid(), so
 * its pid is its process group.  A worker forked a moment ago may not have
 * got there yet: then the group does not exist, and the signal goes to the
 * worker itself.  Returns 0 (sent; a zombie leader counts, it still holds
 * the group), ESRCH (no such group or process) or another errno.  Caller holds mu, so no reap can
 * slip in between the pinning check and the kill. */
static int proc_signal_group_locked(const torchmp_proc *p, int sig)
{
    pid_t pid = p->info.pid;
    if (kill(-pid, sig) == 0)
        return 0;
    if (errno != ESRCH || p->info.state != TORCHMP_PROC_RUNNING)
        return errno;
    return kill(pid, sig) == 0 ? 0 : errno;
}

int torchmp_group_killpg(torchmp_group *g, int sig)
{
    return torchmp_group_signal(g, sig, NULL, 0, NULL) < 0 ? -1 : 0;
}

int torchmp_group_signal(torchmp_group *g, int sig, const unsigned char *which, int only_running,
                         unsigned char *sent)
{
    torchmp_loop *L = g->loop;
    int first_errno = 0, count = 0;
    if (!torchmp_loop_group_is_ours(g))
        return -1;
    pthread_mutex_lock(&L->mu);
    for (int i = 0; i < g->nprocs; i++) {
        torchmp_proc *p = &g->procs[i];
        int err;
        if (sent != NULL)
            sent[i] = 0;
        if ((which != NULL && !which[i]) || !proc_pinned_locked(p) ||
            (only_running && p->info.state != TORCHMP_PROC_RUNNING))
            continue;
        err = proc_signal_group_locked(p, sig);
        if (err != 0 && err != ESRCH && first_errno == 0)
            first_errno = err;
        if (err == 0) {
            count++;
            if (sent != NULL)
                sent[i] = 1;
        }
    }
    pthread_mutex_unlock(&L->mu);
    if (first_errno != 0) {
        errno = first_errno;
        return -1;
    }
    return count;
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

/* The pinned groups of a context up to this size are looked at from the
 * stack: the quiet close of a small context allocates nothing (it runs on
 * the path from the last exit to wait()'s return, where each step is cold). */
#define QUIET_STACK_RANKS 16

int torchmp_group_quiet(torchmp_group *g, int unless_killed)
{
    torchmp_loop *L = g->loop;
    pid_t stack_pgids[QUIET_STACK_RANKS];
    unsigned char stack_alive[QUIET_STACK_RANKS];
    pid_t *pgids = stack_pgids;
    unsigned char *alive = stack_alive;
    int n = 0, quiet = 1;

    if (g->nprocs > QUIET_STACK_RANKS) {
        pgids = malloc((size_t)g->nprocs * sizeof(pid_t));
        alive = malloc((size_t)g->nprocs);
        if (pgids == NULL || alive == NULL) {
            free(pgids);
            free(alive);
            errno = ENOMEM;
            return -1;
        }
    }
    pthread_mutex_lock(&L->mu);
    for (int i = 0; i < g->nprocs; i++) {
        const torchmp_proc *p = &g->procs[i];
        if (p->info.state == TORCHMP_PROC_RUNNING ||
            (unless_killed && p->info.state == TORCHMP_PROC_EXITED && WIFSIGNALED(p->info.wait_status) &&
             WTERMSIG(p->info.wait_status) == SIGKILL)) {
            quiet = 0;
            break;
        }
        if (proc_pinned_locked(p))
            pgids[n++] = p->info.pid;
    }
    pthread_mutex_unlock(&L->mu);
    /* A group whose leader is a zombie: anything else still alive in it
     * (as torchmp_group_busy looks; without /proc the answer is "no"). */
    if (quiet && n > 0 && torchmp_pgroups_alive(pgids, n, alive) > 0)
        quiet = 0;
    if (pgids != stack_pgids) {
        free(pgids);
        free(alive);
    }
    return quiet;
}

int torchmp_group_reap(torchmp_group *g, pid_t *forkserver_pids, int cap)
{
    torchmp_loop *L = g->loop;
    int n = 0;
    if (!torchmp_loop_group_is_ours(g))
        return -1;
    pthread_mutex_lock(&L->mu);
    for (int i = 0; i < g->nprocs; i++) {
        torchmp_proc *p = &g->procs[i];
        if (p->info.state != TORCHMP_PROC_EXITED || !p->unreaped)
            continue;
        if (p->by_forkserver && n < cap)
            forkserver_pids[n++] = p->info.pid;
        torchmp_loop_proc_reap_locked(p);
    }
    pthread_mutex_unlock(&L->mu);
    return n;
}
