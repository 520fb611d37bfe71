/*
 * The keeper: a tiny process that outlives the launcher by a moment and
 * kills every worker process group the launcher had not closed.
 *
 * Why a process: PR_SET_PDEATHSIG reaches only the launcher's direct
 * children (the ranks' leaders); a rank's own children (the `python` under
 * `sh -c`, a data-loader helper) would be left running under pid 1 when the
 * launcher is SIGKILLed or crashes.  Nothing inside a dead process can act,
 * so one process per launcher watches it from outside.
 *
 * How: the launcher and the keeper share one MAP_SHARED table of
 * process-group ids.  A spawned rank's or command's group is in it from the
 * child's setsid() on: torchmp_keeper_spawn reserves a slot before the spawn
 * and the child writes its pid there before exec (spawn.c), so a launcher
 * killed before it learns the pid still takes the group with it.  Forked and
 * forkserver workers are added once they are watched.  A group leaves the
 * table once torchmp has sent it its last signal and reaped its leader.  The
 * keeper holds the read end of a pipe whose only write end is the
 * launcher's; the pipe's EOF is the launcher's death, however it died.  The
 * keeper then SIGKILLs every group still in the table and exits.
 *
 * How it starts: exec'd from the small torchmp/_keeper program
 * (keeper_main.c; on x86-64 without a C library, keeper_sys.h), with the
 * table in a memfd both map.  A fork of the
 * launcher would copy its page tables: milliseconds of the launcher's own CPU
 * on its first launch, more with torch imported.  Where that program cannot
 * be run (not built: the portable build; a file system mounted noexec; no
 * memfd), the launcher forks the keeper itself, as before, with the table in
 * an anonymous shared mapping.  Either way the keeper is the grandchild of the
 * launcher whose middle process exits at once (its parent is pid 1 or the
 * nearest subreaper, not the launcher), so it never shows up among the
 * launcher's children, is never reaped by it and never delivers a SIGCHLD to
 * it.  It is in a session of its own, so a Ctrl-C or a hangup aimed at the
 * launcher's terminal does not take it down first (keeper_watch.c).  Between
 * fork and its exit a forked keeper makes only async-signal-safe calls: the
 * launcher may have any number of threads.
 *
 * The exec'd middle is not waited for at start: its dynamic loading, the
 * fork and its exit took longer than a short first command, and the
 * launcher's first torchmp.run used to wait for all of it before spawning.
 * Once posix_spawn has returned the middle has exec'd, holding the pipe's
 * read end and the table: if the launcher dies from then on, the keeper it
 * forks finds the EOF and the groups registered meanwhile.  The middle is
 * reaped by torchmp_keeper_settle: a context's launcher settles before its
 * first rank starts (loop_thread.c), torchmp.run while its first command
 * runs (command.pxi), anyone asking for the keeper's pid first; a group
 * leaving the table reaps it without waiting.  If it ended without a
 * keeper, one is forked then to watch the same table.  The price is in that
 * case only (a program that runs but fails, e.g. its dynamic loader): from
 * the first command's spawn until that fork, the command's group is covered
 * by its leader's PDEATHSIG alone, where a synchronous start would have
 * forked the fallback before the spawn.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "torchmp.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>
#ifdef TORCHMP_HAVE_KEEPER_EXEC
#include <spawn.h>
#include <sys/syscall.h>
#ifndef MFD_CLOEXEC
#define MFD_CLOEXEC 0x0001U
#endif
extern char **environ;
#endif

#define KEEPER_SLOTS TORCHMP_KEEPER_SLOTS
#define TABLE_BYTES TORCHMP_KEEPER_TABLE_BYTES

static int32_t *keeper_table;      /* 256 KiB, touched only as far as it is used */
static int keeper_write_fd = -1;
static pid_t keeper_owner;         /* the process whose keeper this is */
static int keeper_hint = 1;        /* where the next free-slot search starts */
static char *keeper_helper;        /* torchmp/_keeper; NULL: fork the keeper */
/* The exec'd keeper's middle process while nobody has reaped it (0: none);
 * settle_mu serializes reaping it. */
static pid_t keeper_middle;
static pthread_mutex_t settle_mu = PTHREAD_MUTEX_INITIALIZER;
/* The write end of a pipe a keeper may still watch after its middle died
 * of a signal before saying so: kept open, or that keeper would take the
 * launcher for dead. */
static int keeper_spare_fd = -1;

int torchmp_keeper_set_helper(const char *path)
{
    char *copy = NULL;
    if (path != NULL && path[0] != '\0') {
        copy = strdup(path);
        if (copy == NULL)
            return -1;
    }
    free(keeper_helper);
    keeper_helper = copy;
    return 0;
}

/* Wait for the keeper's middle process, which exits as soon as the keeper
 * runs: 0 if the keeper's pid is in slot 0. */
static int middle_done(pid_t middle, const int32_t *table)
{
    int status;
    while (waitpid(middle, &status, 0) < 0) {
        if (errno != EINTR)
            return -1;
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || __atomic_load_n(&table[0], __ATOMIC_ACQUIRE) <= 0) {
        errno = EAGAIN;
        return -1;
    }
    return 0;
}

#ifdef TORCHMP_HAVE_KEEPER_EXEC
/* The keeper exec'd from torchmp/_keeper: the table in a memfd, the pipe's
 * read end and the memfd on the fds the program expects.  0 with *table_out,
 * the pipe's write end and the middle process (not waited for), or -1 with
 * errno (the caller forks instead). */
static int start_exec(int32_t **table_out, int *write_fd, pid_t *middle_out)
{
    posix_spawn_file_actions_t actions;
    posix_spawnattr_t attr;
    sigset_t none, defaults;
    char *argv[] = {"torchmp-keeper", NULL};
    int32_t *table = MAP_FAILED;
    int memfd, p[2] = {-1, -1}, high[2] = {-1, -1}, rc, saved;
    pid_t middle;

    if (keeper_helper == NULL) {
        errno = ENOENT;
        return -1;
    }
#ifdef SYS_memfd_create
    memfd = (int)syscall(SYS_memfd_create, "torchmp-keeper", MFD_CLOEXEC);
#else
    memfd = -1; /* kernel headers older than memfd (3.17) */
    errno = ENOSYS;
#endif
    if (memfd < 0)
        return -1;
    if (ftruncate(memfd, (off_t)TABLE_BYTES) != 0)
        goto fail;
    table = mmap(NULL, TABLE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, memfd, 0);
    if (table == MAP_FAILED)
        goto fail;
    if (torchmp_pipe_cloexec(p) != 0)
        goto fail;
    /* Above the fds the program expects, so that each dup2 below moves an
     * fd (a dup2 onto itself would keep its close-on-exec flag). */
    high[0] = fcntl(p[0], F_DUPFD_CLOEXEC, TORCHMP_KEEPER_TABLE_FD + 1);
    high[1] = fcntl(memfd, F_DUPFD_CLOEXEC, TORCHMP_KEEPER_TABLE_FD + 1);
    if (high[0] < 0 || high[1] < 0)
        goto fail;
    if ((rc = posix_spawn_file_actions_init(&actions)) != 0) {
        errno = rc;
        goto fail;
    }
    if ((rc = posix_spawnattr_init(&attr)) != 0) {
        posix_spawn_file_actions_destroy(&actions);
        errno = rc;
        goto fail;
    }
    sigemptyset(&none);
    sigemptyset(&defaults);
    sigaddset(&defaults, SIGCHLD);
    sigaddset(&defaults, SIGPIPE);
    rc = posix_spawn_file_actions_adddup2(&actions, high[0], TORCHMP_KEEPER_PIPE_FD);
    if (rc == 0)
        rc = posix_spawn_file_actions_adddup2(&actions, high[1], TORCHMP_KEEPER_TABLE_FD);
    if (rc == 0)
        rc = posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
    if (rc == 0)
        rc = posix_spawnattr_setsigmask(&attr, &none);
    if (rc == 0)
        rc = posix_spawnattr_setsigdefault(&attr, &defaults);
    if (rc == 0)
        rc = posix_spawn(&middle, keeper_helper, &actions, &attr, argv, environ);
    posix_spawn_file_actions_destroy(&actions);
    posix_spawnattr_destroy(&attr);
    if (rc != 0) {
        errno = rc;
        goto fail;
    }
    close(p[0]);
    close(high[0]);
    close(high[1]);
    close(memfd);
    *table_out = table;
    *write_fd = p[1];
    *middle_out = middle;
    return 0;

fail:
    saved = errno;
    for (int i = 0; i < 2; i++) {
        if (p[i] >= 0)
            close(p[i]);
        if (high[i] >= 0)
            close(high[i]);
    }
    if (table != MAP_FAILED)
        munmap(table, TABLE_BYTES);
    close(memfd);
    errno = saved;
    return -1;
}
#endif

/* The keeper forked from the launcher: where the program cannot be exec'd,
 * the table in a new anonymous shared mapping (*table_inout NULL); when an
 * exec'd keeper's middle died without one, watching its table. */
static int start_fork(int32_t **table_inout, int *write_fd)
{
    int p[2];
    pid_t child;
    int32_t *table = *table_inout;
    int mapped = table == NULL;

    if (mapped) {
        table = mmap(NULL, TABLE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (table == MAP_FAILED)
            return -1;
    }
    if (torchmp_pipe_cloexec(p) != 0) {
        int saved = errno;
        if (mapped)
            munmap(table, TABLE_BYTES);
        errno = saved;
        return -1;
    }
    child = fork();
    if (child < 0) {
        int saved = errno;
        close(p[0]);
        close(p[1]);
        if (mapped)
            munmap(table, TABLE_BYTES);
        errno = saved;
        return -1;
    }
    if (child == 0) {
        pid_t keeper;
        (void)close(p[1]);
        keeper = fork();
        if (keeper == 0)
            torchmp_keeper_watch(p[0], table);
        __atomic_store_n(&table[0], keeper > 0 ? (int32_t)keeper : -1, __ATOMIC_RELEASE);
        _exit(keeper > 0 ? 0 : 1);
    }
    close(p[0]);
    if (middle_done(child, table) != 0) {
        int saved = errno;
        close(p[1]);
        if (mapped)
            munmap(table, TABLE_BYTES);
        errno = saved;
        return -1;
    }
    *table_inout = table;
    *write_fd = p[1];
    return 0;
}

int torchmp_keeper_start(void)
{
    int32_t *table = NULL;
    int write_fd = -1;
    pid_t middle = 0;

    if (keeper_table != NULL && keeper_owner == torchmp_self_pid())
        return 0;
    /* Inherited across fork from a parent launcher: that keeper watches the
     * parent, and our copy of its pipe would hide the parent's death. */
    torchmp_keeper_forget();
#ifdef TORCHMP_HAVE_KEEPER_EXEC
    if (start_exec(&table, &write_fd, &middle) != 0)
#endif
    {
        table = NULL;
        if (start_fork(&table, &write_fd) != 0)
            return -1;
    }
    keeper_table = table;
    keeper_write_fd = write_fd;
    keeper_owner = torchmp_self_pid();
    keeper_hint = 1;
    __atomic_store_n(&keeper_middle, middle, __ATOMIC_RELEASE);
    return 0;
}

/* The exec'd keeper's middle ended and no keeper's pid is in slot 0: fork a
 * keeper that watches the same table through a new pipe.  no_keeper: the
 * middle exited by itself (it returns non-zero only before or without
 * forking), so nothing reads the old pipe.  Otherwise (killed by a signal,
 * or reaped by someone else) a keeper it forked may be running unannounced:
 * its pipe stays open.  Without a new keeper (the fork failed), the old pipe
 * stays too: PDEATHSIG still kills the leaders. */
static void keeper_replace(int no_keeper)
{
    int32_t *table = keeper_table;
    int write_fd, old_fd = keeper_write_fd;

    if (start_fork(&table, &write_fd) != 0)
        return;
    keeper_write_fd = write_fd;
    if (no_keeper)
        (void)close(old_fd);
    else
        keeper_spare_fd = old_fd; /* once: a forked keeper's start is waited for */
}

void torchmp_keeper_settle(int block)
{
    int saved = errno, status = 0;
    pid_t middle, r;

    if (__atomic_load_n(&keeper_middle, __ATOMIC_ACQUIRE) <= 0 || keeper_owner != torchmp_self_pid())
        return;
    if ((block ? pthread_mutex_lock(&settle_mu) : pthread_mutex_trylock(&settle_mu)) != 0)
        return;
    middle = __atomic_load_n(&keeper_middle, __ATOMIC_ACQUIRE);
    if (middle > 0) {
        do {
            r = waitpid(middle, &status, block ? 0 : WNOHANG);
        } while (r < 0 && errno == EINTR);
        if (r != 0) { /* reaped, or somebody else's waitpid(-1) was first (ECHILD) */
            if (__atomic_load_n(&keeper_table[0], __ATOMIC_ACQUIRE) <= 0)
                keeper_replace(r == middle && WIFEXITED(status));
            __atomic_store_n(&keeper_middle, 0, __ATOMIC_RELEASE);
        }
    }
    pthread_mutex_unlock(&settle_mu);
    errno = saved;
}

void torchmp_keeper_forget(void)
{
    /* Async-signal-safe: a forked child calls it.  The table mapping is left
     * alone (unmapping is not needed for correctness, and the child may be
     * a worker that never touches it). */
    if (keeper_owner != torchmp_self_pid() && keeper_write_fd >= 0) {
        (void)close(keeper_write_fd);
        keeper_write_fd = -1;
        keeper_table = NULL;
        keeper_middle = 0; /* the parent's child, not ours */
        /* Another thread of the parent may have held it, waiting for its
         * middle, at the fork: the copy would stay locked for good. */
        settle_mu = (pthread_mutex_t)PTHREAD_MUTEX_INITIALIZER;
        if (keeper_spare_fd >= 0) {
            (void)close(keeper_spare_fd);
            keeper_spare_fd = -1;
        }
    }
}

pid_t torchmp_keeper_pid(void)
{
    if (keeper_table == NULL || keeper_owner != torchmp_self_pid())
        return 0;
    torchmp_keeper_settle(1);
    return (pid_t)__atomic_load_n(&keeper_table[0], __ATOMIC_ACQUIRE);
}

/* Any thread may add and remove (the I/O thread for ranks, callers of
 * torchmp.run for their commands): a slot is claimed with a compare-and-swap,
 * and the search hint is only a hint. */
static int keeper_claim(int32_t value)
{
    int hint;
    if (keeper_table == NULL || keeper_owner != torchmp_self_pid())
        return 0;
    hint = __atomic_load_n(&keeper_hint, __ATOMIC_RELAXED);
    for (int n = 0; n < KEEPER_SLOTS - 1; n++) {
        int i = hint + n;
        int32_t free_slot = 0;
        if (i >= KEEPER_SLOTS)
            i -= KEEPER_SLOTS - 1;
        if (__atomic_compare_exchange_n(&keeper_table[i], &free_slot, value, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_RELAXED)) {
            __atomic_store_n(&keeper_hint, i + 1 < KEEPER_SLOTS ? i + 1 : 1, __ATOMIC_RELAXED);
            return i;
        }
    }
    return 0; /* full: this group is covered by PDEATHSIG on its leader only */
}

int torchmp_keeper_add(pid_t pgid)
{
    return pgid > 1 ? keeper_claim((int32_t)pgid) : 0;
}

/* Taken, holding 1 (which the keeper skips: no group has that id) until the
 * child writes its pid there. */
static int keeper_reserve(void)
{
    return keeper_claim(1);
}

static int32_t *keeper_slot_addr(int slot)
{
    if (keeper_table == NULL || keeper_owner != torchmp_self_pid() || slot <= 0 || slot >= KEEPER_SLOTS)
        return NULL;
    return &keeper_table[slot];
}

static void keeper_fill(int slot, pid_t pgid)
{
    int32_t *at = keeper_slot_addr(slot);
    if (at != NULL && pgid > 1)
        __atomic_store_n(at, (int32_t)pgid, __ATOMIC_RELEASE);
}

/* The one owner of a slot across a spawn: reserved before it, its address
 * handed to the child (which writes its pid there right after setsid(),
 * spawn.c), filled again once the spawn returned, freed if it failed (the
 * child, if any, has been reaped by then). */
int torchmp_keeper_spawn(torchmp_spawn_args *a, pid_t *pid_out, int *slot_out, torchmp_spawn_error *err)
{
    int slot = keeper_reserve();
    int rc;

    a->keeper_slot = keeper_slot_addr(slot);
    rc = torchmp_spawn(a, pid_out, err);
    a->keeper_slot = NULL;
    if (rc != 0) {
        torchmp_keeper_remove(slot);
        slot = 0;
    } else {
        keeper_fill(slot, *pid_out);
    }
    *slot_out = slot;
    return rc;
}

void torchmp_keeper_remove(int slot)
{
    if (keeper_table == NULL || keeper_owner != torchmp_self_pid() || slot <= 0 || slot >= KEEPER_SLOTS)
        return;
    __atomic_store_n(&keeper_table[slot], 0, __ATOMIC_RELEASE);
    if (slot < __atomic_load_n(&keeper_hint, __ATOMIC_RELAXED))
        __atomic_store_n(&keeper_hint, slot, __ATOMIC_RELAXED);
    torchmp_keeper_settle(0); /* by now the middle has long exited, as a rule */
}
