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
 * How: the launcher and the keeper share one anonymous MAP_SHARED table of
 * process-group ids (the launcher's I/O thread adds a rank's group when it
 * starts watching the rank and removes it once torchmp has sent that group
 * its last signal and reaped its leader).  The keeper holds the read end of
 * a pipe whose only write end is the launcher's; the pipe's EOF is the
 * launcher's death, however it died.  The keeper then SIGKILLs every group
 * still in the table and exits.
 *
 * The keeper is double-forked (its parent is pid 1 or the nearest
 * subreaper, not the launcher), so it never shows up among the launcher's
 * children, is never reaped by it and never delivers a SIGCHLD to it.  It is
 * in a session of its own, so a Ctrl-C or a hangup aimed at the launcher's
 * terminal does not take it down first.  Between fork and its exit it makes
 * only async-signal-safe calls: the launcher may have any number of threads.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "torchmp.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>
#ifdef TORCHMP_HAVE_PDEATHSIG
#include <sys/prctl.h>
#endif
#ifdef TORCHMP_HAVE_CLOSE_RANGE
#include <sys/syscall.h>
#ifndef SYS_close_range
#define SYS_close_range 436
#endif
#endif

/* Slot 0 holds the keeper's pid (written by the intermediate child); slots
 * 1.. hold process-group ids, 0 for a free slot.  256 KiB of address space,
 * touched only as far as it is used. */
#define KEEPER_SLOTS 65536

static int32_t *keeper_table;
static int keeper_write_fd = -1;
static pid_t keeper_owner;         /* the process whose keeper this is */
static int keeper_hint = 1;        /* where the next free-slot search starts */

static void keeper_close_from(int lowfd, int keep)
{
#ifdef TORCHMP_HAVE_CLOSE_RANGE
    if (keep > lowfd && syscall(SYS_close_range, lowfd, keep - 1, 0) == 0 &&
        syscall(SYS_close_range, keep + 1, ~0U, 0) == 0)
        return;
#endif
    for (int fd = lowfd; fd < 65536; fd++) {
        if (fd != keep)
            (void)close(fd);
    }
}

/* The keeper's whole life.  Async-signal-safe calls only. */
static void keeper_main(int read_fd)
{
    char buf[64];
    sigset_t none;
    struct sigaction ign;

    memset(&ign, 0, sizeof(ign));
    ign.sa_handler = SIG_IGN;
    sigemptyset(&ign.sa_mask);
    (void)sigaction(SIGINT, &ign, NULL);
    (void)sigaction(SIGHUP, &ign, NULL);
    (void)sigaction(SIGTERM, &ign, NULL);
    (void)sigaction(SIGQUIT, &ign, NULL);
    (void)sigaction(SIGPIPE, &ign, NULL);
    sigemptyset(&none);
    (void)sigprocmask(SIG_SETMASK, &none, NULL);
    (void)setsid();
#ifdef TORCHMP_HAVE_PDEATHSIG
    (void)prctl(PR_SET_NAME, (unsigned long)"torchmp-keeper", 0, 0, 0);
#endif
    (void)chdir("/");
    keeper_close_from(0, read_fd);

    for (;;) {
        ssize_t n = read(read_fd, buf, sizeof(buf));
        if (n == 0)
            break;                 /* the launcher is gone */
        if (n < 0 && errno != EINTR && errno != EAGAIN)
            break;
    }
    for (int i = 1; i < KEEPER_SLOTS; i++) {
        int32_t pgid = __atomic_load_n(&keeper_table[i], __ATOMIC_ACQUIRE);
        if (pgid > 1)
            (void)kill(-pgid, SIGKILL);
    }
    TORCHMP_COVERAGE_FLUSH();
    _exit(0);
}

int torchmp_keeper_start(void)
{
    int p[2];
    pid_t child;
    int status;
    int32_t *table;

    if (keeper_table != NULL && keeper_owner == getpid())
        return 0;
    /* Inherited across fork from a parent launcher: that keeper watches the
     * parent, and our copy of its pipe would hide the parent's death. */
    torchmp_keeper_forget();

    table = mmap(NULL, KEEPER_SLOTS * sizeof(int32_t), PROT_READ | PROT_WRITE,
                 MAP_SHARED | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (table == MAP_FAILED)
        return -1;
    if (torchmp_pipe_cloexec(p) != 0) {
        int saved = errno;
        munmap(table, KEEPER_SLOTS * sizeof(int32_t));
        errno = saved;
        return -1;
    }
    child = fork();
    if (child < 0) {
        int saved = errno;
        close(p[0]);
        close(p[1]);
        munmap(table, KEEPER_SLOTS * sizeof(int32_t));
        errno = saved;
        return -1;
    }
    if (child == 0) {
        pid_t keeper;
        (void)close(p[1]);
        keeper = fork();
        if (keeper == 0) {
            keeper_table = table;
            keeper_main(p[0]);
        }
        __atomic_store_n(&table[0], keeper > 0 ? (int32_t)keeper : -1, __ATOMIC_RELEASE);
        _exit(keeper > 0 ? 0 : 1);
    }
    close(p[0]);
    while (waitpid(child, &status, 0) < 0) {
        if (errno != EINTR) {
            status = -1;
            break;
        }
    }
    if (status != 0 || __atomic_load_n(&table[0], __ATOMIC_ACQUIRE) <= 0) {
        close(p[1]);
        munmap(table, KEEPER_SLOTS * sizeof(int32_t));
        errno = EAGAIN;
        return -1;
    }
    keeper_table = table;
    keeper_write_fd = p[1];
    keeper_owner = getpid();
    keeper_hint = 1;
    return 0;
}

void torchmp_keeper_forget(void)
{
    /* Async-signal-safe: a forked child calls it.  The table mapping is left
     * alone (unmapping is not needed for correctness, and the child may be
     * a worker that never touches it). */
    if (keeper_owner != getpid() && keeper_write_fd >= 0) {
        (void)close(keeper_write_fd);
        keeper_write_fd = -1;
        keeper_table = NULL;
    }
}

pid_t torchmp_keeper_pid(void)
{
    if (keeper_table == NULL || keeper_owner != getpid())
        return 0;
    return (pid_t)__atomic_load_n(&keeper_table[0], __ATOMIC_ACQUIRE);
}

/* Any thread may add and remove (the I/O thread for ranks, callers of
 * torchmp.run for their commands): a slot is claimed with a compare-and-swap,
 * and the search hint is only a hint. */
int torchmp_keeper_add(pid_t pgid)
{
    int hint;
    if (keeper_table == NULL || keeper_owner != getpid() || pgid <= 1)
        return 0;
    hint = __atomic_load_n(&keeper_hint, __ATOMIC_RELAXED);
    for (int n = 0; n < KEEPER_SLOTS - 1; n++) {
        int i = hint + n;
        int32_t free_slot = 0;
        if (i >= KEEPER_SLOTS)
            i -= KEEPER_SLOTS - 1;
        if (__atomic_compare_exchange_n(&keeper_table[i], &free_slot, (int32_t)pgid, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_RELAXED)) {
            __atomic_store_n(&keeper_hint, i + 1 < KEEPER_SLOTS ? i + 1 : 1, __ATOMIC_RELAXED);
            return i;
        }
    }
    return 0; /* full: this group is covered by PDEATHSIG on its leader only */
}

void torchmp_keeper_remove(int slot)
{
    if (keeper_table == NULL || keeper_owner != getpid() || slot <= 0 || slot >= KEEPER_SLOTS)
        return;
    __atomic_store_n(&keeper_table[slot], 0, __ATOMIC_RELEASE);
    if (slot < __atomic_load_n(&keeper_hint, __ATOMIC_RELAXED))
        __atomic_store_n(&keeper_hint, slot, __ATOMIC_RELAXED);
}
