/*
 * Worker groups (one per PContext): creation and freeing, the commands that
 * spawn, prepare, adopt and finish a group's ranks (the caller's entry
 * point, and the loop-thread side that runs it), and what Python reads of a
 * group: rank states, stream states, return channels and tails.  Exits,
 * waiting and signalling are in loop_reap.c.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "loop_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

/* ---- spawning ----------------------------------------------------------- */

static const torchmp_stream_spec *rank_stream_spec(const torchmp_rank_spec *spec, int which)
{
    return which == STREAM_OUT ? &spec->out : which == STREAM_ERR ? &spec->err : &spec->return_channel;
}

void torchmp_rank_close_worker_fds(const torchmp_rank_spec *spec, int *child_fds)
{
    for (int w = 0; w < STREAM_COUNT; w++) {
        const torchmp_stream_spec *s = rank_stream_spec(spec, w);
        if (s->mode == TORCHMP_STREAM_TEE || s->mode == TORCHMP_STREAM_RETURN
            || (s->mode == TORCHMP_STREAM_FILE && s->open_log))
            close_fd(&child_fds[1 + w]);
        child_fds[1 + w] = -1; /* FILE given as an fd: the caller's own, left open */
    }
}

void torchmp_loop_rank_streams_abort(torchmp_loop *L, torchmp_proc *p)
{
    for (int w = 0; w < STREAM_COUNT; w++) {
        torchmp_loop_stream_close(L, &p->streams[w]);
        torchmp_loop_stream_free(L, &p->streams[w]);
    }
}

/* Open stdout, stderr and the return channel of a rank on the loop side and
 * put the worker's ends in child_fds[1..3]. */
static int rank_streams_open(torchmp_loop *L, torchmp_proc *p, const torchmp_rank_spec *spec, int *child_fds,
                             torchmp_spawn_error *err)
{
    for (int w = 0; w < STREAM_COUNT; w++) {
        if (torchmp_loop_stream_open(L, p, w, rank_stream_spec(spec, w), &child_fds[1 + w]) != 0) {
            err->step = TORCHMP_STEP_STREAM;
            err->errnum = errno;
            torchmp_rank_close_worker_fds(spec, child_fds);
            torchmp_loop_rank_streams_abort(L, p);
            errno = err->errnum;
            return -1;
        }
    }
    return 0;
}

/* Start one rank: its streams, the spawn, the watch.  here: in the calling
 * thread (torchmp_group_spawn), not the loop thread. */
static int do_spawn_one(torchmp_loop *L, torchmp_group *g, int rank, torchmp_rank_spec *spec,
                        torchmp_spawn_error *err, int here)
{
    torchmp_proc *p = &g->procs[rank];
    torchmp_spawn_args a = spec->args;
    pid_t pid;
    int64_t start;
    int rc, slot;

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
    rc = torchmp_keeper_spawn(&a, &pid, &slot, err);
    torchmp_rank_close_worker_fds(spec, a.child_fds);
    if (rc != 0) {
        torchmp_loop_rank_streams_abort(L, p);
        return -1;
    }
    p->keeper_slot = slot;
#ifdef TORCHMP_HAVE_PIDFD
    if (here) {
        rc = torchmp_loop_rank_adopt_here(L, p, pid, start, err);
        if (rc != 0)
            torchmp_loop_rank_streams_abort(L, p);
    } else
#else
    (void)here;
#endif
        rc = torchmp_loop_rank_adopt(L, p, pid, 0, start, err);
    if (rc != 0 && p->keeper_slot > 0) {
        /* Not watched (killed and reaped): its group is gone. */
        torchmp_keeper_remove(p->keeper_slot);
        p->keeper_slot = 0;
    }
    return rc;
}

static void group_link(torchmp_loop *L, torchmp_group *g)
{
    if (!g->linked) {
        g->next = L->groups;
        L->groups = g;
        g->linked = 1;
    }
}

/* Which signal dispositions the children put back to SIG_DFL: a batch's
 * are found once here; one rank's child finds them itself, on its own CPU
 * (as CPython's child does), sparing the launcher 64 sigaction calls. */
static void plan_signal_resets(torchmp_rank_spec *specs, int count)
{
    sigset_t reset;
    if (count == 1) {
        specs[0].args.scan_signals = 1;
        return;
    }
    torchmp_signals_to_reset(&reset);
    for (int i = 0; i < count; i++)
        specs[i].args.reset_signals = reset;
}

int torchmp_loop_do_spawn(torchmp_loop *L, command *c)
{
    group_link(L, c->group);
    plan_signal_resets(c->specs, c->count);
    for (int i = 0; i < c->count; i++) {
        if (do_spawn_one(L, c->group, i, &c->specs[i], &c->err, 0) != 0)
            return i;
    }
    return c->count;
}

void torchmp_loop_do_finish(torchmp_loop *L, torchmp_group *g)
{
    for (int i = 0; i < g->nprocs; i++) {
        for (int w = 0; w < STREAM_COUNT; w++) {
            stream *s = &g->procs[i].streams[w];
            if (s->fd >= 0 || s->following) {
                torchmp_loop_stream_drain_buffered(L, s);
                torchmp_loop_stream_close(L, s);
            }
        }
    }
}

/* ---- groups ------------------------------------------------------------- */

static void filters_free(torchmp_filters *n)
{
    for (size_t i = 0; i < n->count; i++)
        free(n->data[i]);
    free(n->data);
    free(n->len);
    n->data = NULL;
    n->len = NULL;
    n->count = 0;
}

static int filters_copy(torchmp_filters *dst, const torchmp_filters *src)
{
    dst->count = 0;
    dst->data = calloc(src->count ? src->count : 1, sizeof(char *));
    dst->len = calloc(src->count ? src->count : 1, sizeof(size_t));
    if (dst->data == NULL || dst->len == NULL) {
        filters_free(dst);
        errno = ENOMEM;
        return -1;
    }
    for (size_t i = 0; i < src->count; i++) {
        dst->data[i] = malloc(src->len[i] ? src->len[i] : 1);
        if (dst->data[i] == NULL) {
            filters_free(dst);
            errno = ENOMEM;
            return -1;
        }
        memcpy(dst->data[i], src->data[i], src->len[i]);
        dst->len[i] = src->len[i];
        dst->count++;
    }
    return 0;
}

/* Groups allocated and not freed yet, in this process (a forked child starts
 * from its parent's count: its copies of them are never freed). */
static int groups_alive;

int torchmp_groups_alive(void)
{
    return __atomic_load_n(&groups_alive, __ATOMIC_RELAXED);
}

void torchmp_loop_group_free(torchmp_group *g)
{
    __atomic_sub_fetch(&groups_alive, 1, __ATOMIC_RELAXED);
    /* (procs is NULL when torchmp_group_new could not allocate it) */
    for (int i = 0; g->procs != NULL && i < g->nprocs; i++) {
        torchmp_proc *p = &g->procs[i];
        close_fd(&p->pidfd);
        for (int w = 0; w < STREAM_COUNT; w++) {
            close_fd(&p->streams[w].fd);
            close_fd(&p->streams[w].log_fd);
            torchmp_loop_follow_close(g->loop, &p->streams[w]);
            torchmp_loop_stream_free(g->loop, &p->streams[w]);
        }
    }
    for (int w = 0; w < 2; w++) {
        close_fd(&g->filtered_fd[w]);
        if (g->has_filters[w])
            filters_free(&g->filters[w]);
    }
    while (g->watchers != NULL) {
        group_watcher *w = g->watchers;
        g->watchers = w->next;
        torchmp_notifier_unref(w->notifier);
        free(w);
    }
    free(g->procs);
    free(g);
}

/* A released group whose ranks have all exited: its followed logs are read
 * to their end and let go (a pipe stays until its last writer closes it; a
 * log has no such end). */
static void group_unfollow(torchmp_loop *L, torchmp_group *g)
{
    for (int i = 0; i < g->nprocs; i++) {
        for (int w = STREAM_OUT; w <= STREAM_ERR; w++) {
            stream *s = &g->procs[i].streams[w];
            if (s->following) {
                torchmp_loop_stream_drain_buffered(L, s);
                torchmp_loop_stream_close(L, s);
            }
        }
    }
}

/* Free released groups with nothing left to watch.  Runs after a batch of
 * events, so no event of the batch can point into a freed group. */
void torchmp_loop_collect_groups(torchmp_loop *L)
{
    torchmp_group **link = &L->groups;
    while (*link != NULL) {
        torchmp_group *g = *link;
        int running = __atomic_load_n(&g->running, __ATOMIC_ACQUIRE);
        if (g->released && running == 0 && g->open_streams > 0)
            group_unfollow(L, g);
        if (g->released && running == 0 && g->open_streams == 0) {
            *link = g->next;
            torchmp_loop_group_free(g);
        } else {
            link = &g->next;
        }
    }
}

/* A released group that never went through the loop thread: spawned by
 * the caller's thread (torchmp_group_spawn), it joins L->groups now and is
 * freed with the others once its exits are recorded; never spawned, there is
 * nothing to watch. */
void torchmp_loop_group_release_unlinked(torchmp_loop *L, torchmp_group *g)
{
    for (int i = 0; i < g->nprocs; i++) {
        if (g->procs[i].info.state != TORCHMP_PROC_UNSTARTED) {
            group_link(L, g);
            return;
        }
    }
    torchmp_loop_group_free(g);
}

/* Open the streams of ranks [0, count) for workers forked outside the loop.
 * All or nothing: on a failure at rank k, whatever was opened is closed again
 * and k is returned. */
int torchmp_loop_do_prepare(torchmp_loop *L, command *c)
{
    torchmp_group *g = c->group;
    group_link(L, g);
    for (int i = 0; i < c->count; i++) {
        if (rank_streams_open(L, &g->procs[i], &c->specs[i], c->specs[i].args.child_fds, &c->err) != 0) {
            for (int j = 0; j < i; j++) {
                torchmp_rank_close_worker_fds(&c->specs[j], c->specs[j].args.child_fds);
                torchmp_loop_rank_streams_abort(L, &g->procs[j]);
            }
            return i;
        }
    }
    return c->count;
}

/* Watch forked workers.  If one cannot be watched, it and every worker after
 * it in the batch are killed and reaped (they are our children), and the
 * index of the first is returned. */
int torchmp_loop_do_adopt(torchmp_loop *L, command *c)
{
    torchmp_group *g = c->group;
    int64_t now = clock_ns(CLOCK_MONOTONIC);
    for (int i = 0; i < c->count; i++) {
        int64_t start = c->start_ns != NULL && c->start_ns[i] != 0 ? c->start_ns[i] : now;
        if (torchmp_loop_rank_adopt(L, &g->procs[c->ranks[i]], c->pids[i], c->by_forkserver, start, &c->err) == 0)
            continue;
        for (int j = i + 1; j < c->count; j++) {
            if (!c->by_forkserver) {
                int status;
                kill(c->pids[j], SIGKILL);
                while (waitpid(c->pids[j], &status, 0) < 0 && errno == EINTR)
                    ;
            }
            torchmp_loop_rank_streams_abort(L, &g->procs[c->ranks[j]]);
        }
        return i;
    }
    return c->count;
}

/* ---- public API --------------------------------------------------------- */

torchmp_group *torchmp_group_new(int nprocs,
                                 const torchmp_filters *out_filters, int filtered_out_fd,
                                 const torchmp_filters *err_filters, int filtered_err_fd)
{
    torchmp_loop *L = torchmp_loop_get();
    torchmp_group *g;
    const torchmp_filters *filters[2] = {out_filters, err_filters};
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
    __atomic_add_fetch(&groups_alive, 1, __ATOMIC_RELAXED);
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
        if (filters[w] != NULL) {
            if (filters_copy(&g->filters[w], filters[w]) != 0)
                goto fail;
            g->has_filters[w] = 1;
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
    torchmp_loop_group_free(g);
    errno = saved;
    return NULL;
}

int torchmp_loop_group_is_ours(torchmp_group *g)
{
    if (g->loop->owner_pid != torchmp_self_pid()) {
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
            if (mode == TORCHMP_STREAM_TEE || mode == TORCHMP_STREAM_RETURN)
                g->has_pipes = 1;
        }
    }
}

/* SPAWN and PREPARE: a command over ranks [0, count), all still unstarted. */
static int ranks_command(torchmp_group *g, int type, torchmp_rank_spec *specs, int count, torchmp_spawn_error *err)
{
    command c;
    if (!torchmp_loop_group_is_ours(g))
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
    torchmp_loop_submit(g->loop, &c, 1);
    *err = c.err;
    return c.result;
}

/* Whether ranks [0, count) can be spawned in the calling thread rather than
 * handed to the loop thread: a round trip between two threads costs two
 * wake-ups, each a cross-CPU one when the loop thread sleeps on another CPU
 * (on a VM: an idle virtual CPU to wake), and that is most of a small
 * launch.  Only where nothing of the loop's is touched but what is safe from
 * another thread: epoll's exits set (epoll_ctl), the rank's state under mu,
 * the keeper's table (lock-free).  So: the epoll backend (a pidfd per rank),
 * no stream the loop drains (tee pipes, return channels: loop-owned), and
 * the process's main thread -- PR_SET_PDEATHSIG fires when the spawning
 * *thread* exits, and only the main thread lives as long as the process
 * (the loop thread does too: the other callers go through it). */
static int spawn_here_ok(torchmp_group *g, const torchmp_rank_spec *specs, int count)
{
#ifdef TORCHMP_HAVE_PIDFD
    if (g->loop->backend != TORCHMP_BACKEND_EPOLL || syscall(SYS_gettid) != torchmp_self_pid())
        return 0;
    for (int i = 0; i < count; i++) {
        for (int w = 0; w < STREAM_COUNT; w++) {
            int mode = rank_stream_spec(&specs[i], w)->mode;
            if (mode == TORCHMP_STREAM_TEE || mode == TORCHMP_STREAM_RETURN)
                return 0;
        }
    }
    return 1;
#else
    (void)g;
    (void)specs;
    (void)count;
    return 0;
#endif
}

/* The loop thread's torchmp_loop_do_spawn, run by the caller.  Every signal
 * is held across each spawn: a vfork child shares this thread's memory, and
 * a handler (Python's among them) must not run in it before exec. */
static int spawn_here(torchmp_group *g, torchmp_rank_spec *specs, int count, torchmp_spawn_error *err)
{
    sigset_t all, old;
    int i;

    plan_signal_resets(specs, count);
    sigfillset(&all);
    for (i = 0; i < count; i++) {
        int rc;
        if (pthread_sigmask(SIG_SETMASK, &all, &old) != 0) {
            err->step = TORCHMP_STEP_SIGNALS;
            err->errnum = errno;
            break;
        }
        rc = do_spawn_one(g->loop, g, i, &specs[i], err, 1);
        {
            int saved = errno;
            (void)pthread_sigmask(SIG_SETMASK, &old, NULL);
            errno = saved;
        }
        if (rc != 0)
            break;
    }
    return i;
}

int torchmp_group_spawn(torchmp_group *g, torchmp_rank_spec *specs, int count, torchmp_spawn_error *err)
{
    if (torchmp_loop_group_is_ours(g) && count >= 0 && count <= g->nprocs && spawn_here_ok(g, specs, count)) {
        for (int i = 0; i < count; i++) {
            if (g->procs[i].info.state != TORCHMP_PROC_UNSTARTED) {
                errno = EBUSY;
                return -1;
            }
        }
        note_pipes(g, specs, count);
        g->spawned_here = 1;
        return spawn_here(g, specs, count, err);
    }
    return ranks_command(g, CMD_SPAWN, specs, count, err);
}

int torchmp_group_prepare(torchmp_group *g, torchmp_rank_spec *specs, int count, torchmp_spawn_error *err)
{
    return ranks_command(g, CMD_PREPARE, specs, count, err);
}

int torchmp_group_adopt(torchmp_group *g, const int *ranks, const pid_t *pids, const int64_t *start_ns, int count,
                        int by_forkserver, torchmp_spawn_error *err)
{
    command c;
    if (!torchmp_loop_group_is_ours(g))
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
    c.by_forkserver = by_forkserver;
    torchmp_loop_submit(g->loop, &c, 1);
    *err = c.err;
    return c.result;
}

int torchmp_group_drop_unstarted(torchmp_group *g)
{
    command c;
    int i;
    if (!torchmp_loop_group_is_ours(g))
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
    torchmp_loop_submit(g->loop, &c, 1);
    return 0;
}

char *torchmp_group_take_return(torchmp_group *g, int rank, size_t *len)
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
    if (s->ret_errno != 0) {
        errno = s->ret_errno;
        pthread_mutex_unlock(&L->mu);
        return NULL;
    }
    data = s->ret_buf;
    *len = s->ret_len;
    s->ret_buf = NULL;
    s->ret_len = s->ret_cap = 0;
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
    if (!torchmp_loop_group_is_ours(g)) {
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
    int ours = torchmp_loop_group_is_ours(g);
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
    int ours = torchmp_loop_group_is_ours(g);
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

int torchmp_group_has_pipes(const torchmp_group *g)
{
    return g->has_pipes;
}

int torchmp_group_finish_streams(torchmp_group *g)
{
    command c;
    if (!torchmp_loop_group_is_ours(g))
        return -1;
    if (!g->has_pipes)
        return 0; /* nothing to drain: spare the round trip */
    memset(&c, 0, sizeof(c));
    c.type = CMD_FINISH;
    c.group = g;
    torchmp_loop_submit(g->loop, &c, 1);
    return 0;
}

/* Whether the loop has nothing to do for a released group but free it: its
 * ranks were spawned in the caller's thread (no stream is the loop's), every
 * one has exited (its pidfd closed before the state said so) and been reaped
 * (no zombie), and no event loop watches it.  Caller holds mu. */
static int release_is_only_freeing_locked(const torchmp_group *g)
{
    if (!g->spawned_here || g->watchers != NULL)
        return 0;
    for (int i = 0; i < g->nprocs; i++) {
        const torchmp_proc *p = &g->procs[i];
        if (p->info.state != TORCHMP_PROC_EXITED || p->unreaped)
            return 0;
    }
    return 1;
}

void torchmp_group_release(torchmp_group *g)
{
    command *c;
    int only_freeing;
    if (!torchmp_loop_group_is_ours(g))
        return; /* the parent's loop owns it; leave it alone */
    c = calloc(1, sizeof(*c));
    if (c == NULL) {
        /* Cannot hand it over: leaking the group is the only safe choice. */
        return;
    }
    c->type = CMD_RELEASE;
    c->group = g;
    pthread_mutex_lock(&g->loop->mu);
    only_freeing = release_is_only_freeing_locked(g);
    pthread_mutex_unlock(&g->loop->mu);
    /* Freeing memory can wait for the loop's next wake-up (the next launch's
     * exit, or any command): a wake-up of its own was one of the I/O thread's
     * two for a launch of one binary. */
    if (only_freeing)
        torchmp_loop_queue_quietly(g->loop, c, g->nprocs);
    else
        torchmp_loop_submit(g->loop, c, 0);
}
