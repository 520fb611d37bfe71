/*
 * The commands the I/O thread watches (run_async, and torchmp.run where there
 * is no pidfd to wait on): their pidfds and output pipes sit in the thread's
 * poller; with the poll backend their exits are found by the SIGCHLD scan.
 * The thread posts EXITED when the leader has exited and DONE once the output
 * is complete (the pipes at EOF, or drain_ns after the exit: a grandchild
 * holding a pipe cannot hold the command back), then lets go of it.  The
 * caller reaps it; an orphan (its caller gone) is reaped and freed here.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "loop_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <sys/wait.h>

static void post(torchmp_command *c, int what)
{
    if (c->notifier != NULL)
        torchmp_notifier_post(c->notifier, c->token, what);
}

static void pipe_close(torchmp_loop *L, torchmp_command *c, int w)
{
    if (c->fd[w] < 0)
        return;
    (void)torchmp_poller_del(L->poller, c->fd[w]);
    torchmp_command_close_pipe(c, w);
}

static void unlink_command(torchmp_loop *L, torchmp_command *c)
{
    c->loop_linked = 0;
    if (c->prev != NULL)
        c->prev->next = c->next;
    else
        L->commands = c->next;
    if (c->next != NULL)
        c->next->prev = c->prev;
    c->next = c->prev = NULL;
}

/* Exited, and no pipe left: done.  The loop lets go of it once the batch
 * of events is over (torchmp_loop_commands_collect): another event of the
 * batch may point into it. */
static void maybe_done(torchmp_loop *L, torchmp_command *c)
{
    if (!c->loop_linked || !(torchmp_command_state(c) & TORCHMP_CMD_EXITED) || c->fd[0] >= 0 || c->fd[1] >= 0)
        return;
    unlink_command(L, c);
    torchmp_command_set_state(c, TORCHMP_CMD_DONE);
    if (__atomic_load_n(&c->orphan, __ATOMIC_SEQ_CST))
        torchmp_command_reap_once(c);
    else
        post(c, TORCHMP_NOTE_DONE);
    c->next = L->commands_done;
    L->commands_done = c;
}

void torchmp_loop_commands_collect(torchmp_loop *L)
{
    while (L->commands_done != NULL) {
        torchmp_command *c = L->commands_done;
        L->commands_done = c->next;
        c->next = NULL;
        torchmp_command_unref(c);
    }
}

/* A few reads: one busy command must not starve the loop's other work. */
static void pump(torchmp_loop *L, torchmp_command *c, int w)
{
    for (int round = 0; round < 4 && c->fd[w] >= 0; round++) {
        int got = torchmp_command_pump(c, w, L->readbuf, READ_CHUNK);
        if (got == 0)
            pipe_close(L, c, w);
        if (got != 1)
            return;
    }
}

static void on_exited(torchmp_loop *L, torchmp_command *c)
{
    if (c->pidfd >= 0) {
        (void)torchmp_poller_del(L->poller, c->pidfd);
        close_fd(&c->pidfd);
    }
    /* What the command wrote before it exited goes with the exit. */
    for (int w = 0; w < 2; w++)
        pump(L, c, w);
    if (!__atomic_load_n(&c->orphan, __ATOMIC_ACQUIRE))
        post(c, TORCHMP_NOTE_EXITED);
    maybe_done(L, c);
}

void torchmp_loop_command_add(torchmp_loop *L, torchmp_command *c)
{
    c->next = L->commands;
    c->prev = NULL;
    if (L->commands != NULL)
        L->commands->prev = c;
    L->commands = c;
    c->loop_linked = 1;
    for (int i = 0; i < 3; i++) {
        c->watch[i].kind = WATCH_COMMAND;
        c->watch[i].which = i;
        c->watch[i].cmd = c;
    }
    for (int w = 0; w < 2; w++) {
        if (c->fd[w] < 0)
            continue;
        /* An orphan's output has no reader; a pipe that cannot be watched
         * (no memory) loses its output rather than the command. */
        if (__atomic_load_n(&c->orphan, __ATOMIC_ACQUIRE) ||
            torchmp_poller_add(L->poller, c->fd[w], &c->watch[1 + w]) != 0)
            torchmp_command_close_pipe(c, w);
    }
    if (c->pidfd >= 0 && torchmp_poller_add(L->poller, c->pidfd, &c->watch[0]) != 0) {
        /* Cannot watch the exit (no memory): end the command now rather
         * than never notice it ending. */
        siginfo_t si;
        (void)torchmp_command_killpg(c, SIGKILL);
        while (waitid(P_PID, (id_t)c->pid, &si, WEXITED | WNOWAIT) < 0 && errno == EINTR)
            ;
    }
    /* It may have exited before it got here (its SIGCHLD spent already). */
    if (torchmp_command_collect(c))
        on_exited(L, c);
}

void torchmp_loop_command_event(torchmp_loop *L, command_watch *w)
{
    torchmp_command *c = w->cmd;
    if (w->which == 0) {
        if (c->pidfd >= 0 && torchmp_command_collect(c))
            on_exited(L, c);
        return;
    }
    pump(L, c, w->which - 1);
    maybe_done(L, c);
}

/* Records the exits found; how many. */
int torchmp_loop_commands_scan(torchmp_loop *L)
{
    torchmp_command *c, *next;
    int found = 0;
    for (c = L->commands; c != NULL; c = next) {
        next = c->next;
        if (c->pidfd < 0 && !(torchmp_command_state(c) & TORCHMP_CMD_EXITED) && torchmp_command_collect(c)) {
            on_exited(L, c);
            found++;
        }
    }
    return found;
}

/* Whether a watched command's exit is still to be found by a scan. */
int torchmp_loop_commands_awaited(torchmp_loop *L)
{
    for (torchmp_command *c = L->commands; c != NULL; c = c->next) {
        if (c->pidfd < 0 && !(torchmp_command_state(c) & TORCHMP_CMD_EXITED))
            return 1;
    }
    return 0;
}

void torchmp_loop_commands_tick(torchmp_loop *L)
{
    int64_t now;
    torchmp_command *c, *next;
    if (L->commands == NULL)
        return;
    now = clock_ns(CLOCK_MONOTONIC);
    for (c = L->commands; c != NULL; c = next) {
        next = c->next;
        if ((torchmp_command_state(c) & TORCHMP_CMD_EXITED) && now >= c->drain_until_ns) {
            for (int w = 0; w < 2; w++) {
                torchmp_command_drain_buffered(c, w, L->readbuf, READ_CHUNK);
                pipe_close(L, c, w);
            }
            maybe_done(L, c);
        }
    }
}

int torchmp_loop_commands_timeout_ms(torchmp_loop *L)
{
    int64_t next = 0, left;
    for (torchmp_command *c = L->commands; c != NULL; c = c->next) {
        if ((torchmp_command_state(c) & TORCHMP_CMD_EXITED) && (next == 0 || c->drain_until_ns < next))
            next = c->drain_until_ns;
    }
    if (next == 0)
        return -1;
    left = next - clock_ns(CLOCK_MONOTONIC);
    return left <= 0 ? 0 : (int)((left + 999999) / 1000000);
}

int torchmp_command_watch(torchmp_command *c, torchmp_notifier *n, uint64_t token)
{
    torchmp_loop *L = torchmp_loop_get();
    if (L == NULL)
        return -1;
    if (torchmp_command_state(c) & TORCHMP_CMD_WATCHED) {
        errno = EBUSY;
        return -1;
    }
    c->notifier = n != NULL ? torchmp_notifier_ref(n) : NULL;
    c->token = token;
    /* The I/O backend decides who can see the exit: a pidfd in the loop's
     * poller, or (poll backend) the loop's SIGCHLD scan. */
#ifdef TORCHMP_HAVE_PIDFD
    if (L->backend == TORCHMP_BACKEND_EPOLL && c->pidfd < 0 &&
        !(torchmp_command_state(c) & TORCHMP_CMD_EXITED)) {
        c->pidfd = (int)syscall(SYS_pidfd_open, c->pid, 0);
        if (c->pidfd < 0)
            return -1;
    }
#endif
    if (L->backend != TORCHMP_BACKEND_EPOLL)
        close_fd(&c->pidfd);
    __atomic_add_fetch(&c->refs, 1, __ATOMIC_ACQ_REL);
    torchmp_command_set_state(c, TORCHMP_CMD_WATCHED);
    c->msg.type = CMD_WATCH_COMMAND;
    c->msg.cmd = c;
    return torchmp_loop_submit(L, &c->msg, 0);
}
