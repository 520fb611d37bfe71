/*
 * The keeper's life (what the keeper is and why: keeper.c): in a session of
 * its own, deaf to the signals aimed at the launcher's terminal, holding
 * nothing but the read end of the launcher's pipe, it waits for that pipe's
 * EOF -- the launcher's death, however it died -- then SIGKILLs every
 * process group still in the table and exits.
 *
 * Compiled into both the core (the keeper forked from the launcher) and the
 * torchmp/_keeper program (the keeper exec'd).  Async-signal-safe calls
 * only: a forked keeper comes from a launcher with any number of threads.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "torchmp.h"

#include <errno.h>
#include <signal.h>
#include <string.h>
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

static void close_all_but(int keep)
{
#ifdef TORCHMP_HAVE_CLOSE_RANGE
    if ((keep == 0 || syscall(SYS_close_range, 0, keep - 1, 0) == 0) &&
        syscall(SYS_close_range, keep + 1, ~0U, 0) == 0)
        return;
#endif
    for (int fd = 0; fd < 65536; fd++) {
        if (fd != keep)
            (void)close(fd);
    }
}

void torchmp_keeper_watch(int read_fd, const int32_t *table)
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
    close_all_but(read_fd);

    for (;;) {
        ssize_t n = read(read_fd, buf, sizeof(buf));
        if (n == 0)
            break;                 /* the launcher is gone */
        if (n < 0 && errno != EINTR && errno != EAGAIN)
            break;
    }
    for (int i = 1; i < TORCHMP_KEEPER_SLOTS; i++) {
        int32_t pgid = __atomic_load_n(&table[i], __ATOMIC_ACQUIRE);
        if (pgid > 1)
            (void)kill(-pgid, SIGKILL);
    }
    TORCHMP_COVERAGE_FLUSH();
    _exit(0);
}
