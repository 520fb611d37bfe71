/*
 * The keeper's life (what the keeper is and why: keeper.c): in a session of
 * its own, deaf to the signals aimed at the launcher's terminal, holding
 * nothing but the read end of the launcher's pipe, it waits for that pipe's
 * EOF -- the launcher's death, however it died -- then SIGKILLs every
 * process group still in the table and exits.
 *
 * Compiled into both the core (the keeper forked from the launcher) and the
 * torchmp/_keeper program (the keeper exec'd), where it may have no C
 * library at all: its system calls are keeper_sys.h's.  Async-signal-safe
 * calls only: a forked keeper comes from a launcher with any number of
 * threads.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "torchmp.h"
#include "keeper_sys.h"

static void close_all_but(int keep)
{
    if ((keep == 0 || ks_close_range(0, (unsigned int)keep - 1) == 0) && ks_close_range((unsigned int)keep + 1, ~0U) == 0)
        return;
    for (int fd = 0; fd < 65536; fd++) {
        if (fd != keep)
            (void)ks_close(fd);
    }
}

void torchmp_keeper_watch(int read_fd, const int32_t *table)
{
    char buf[64];

    (void)ks_ignore(SIGINT);
    (void)ks_ignore(SIGHUP);
    (void)ks_ignore(SIGTERM);
    (void)ks_ignore(SIGQUIT);
    (void)ks_ignore(SIGPIPE);
    (void)ks_unblock_all();
    (void)ks_setsid();
    (void)ks_set_name("torchmp-keeper");
    (void)ks_chdir("/");
    close_all_but(read_fd);

    for (;;) {
        long n = ks_read(read_fd, buf, sizeof(buf));
        if (n == 0)
            break;                 /* the launcher is gone */
        if (n < 0 && !ks_interrupted(n))
            break;
    }
    for (int i = 1; i < TORCHMP_KEEPER_SLOTS; i++) {
        int32_t pgid = __atomic_load_n(&table[i], __ATOMIC_ACQUIRE);
        if (pgid > 1)
            (void)ks_kill(-(long)pgid, SIGKILL);
    }
    TORCHMP_COVERAGE_FLUSH();
    ks_exit(0);
}
