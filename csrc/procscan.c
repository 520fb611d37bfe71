/*
 * Which process groups still have a living member.
 *
 * close() must give a rank's whole process group (not only its leader) the
 * grace period.  Once the leader has exited, torchmp keeps it as a zombie so
 * that its pid -- and so the group id -- cannot be recycled while torchmp may
 * still signal the group.  But a zombie is still a member of its group:
 * kill(-pgid, 0) succeeds for a group that holds nothing else, so it cannot
 * say whether the group has emptied.  The kernel has no per-group member
 * count, so one pass over /proc answers it for every group at once.
 *
 * The pass looks at processes younger than the oldest leader only: every
 * other member of a group was created after its leader, so its pid is
 * larger -- unless the pid counter wrapped around since.  When few pids were
 * handed out since (a short job), each is asked for directly instead of
 * listing /proc.  A wrap that
 * left the counter below that leader is seen (ns_last_pid) and the whole of
 * /proc is read; one full cycle of the pid space within a rank's life would
 * hide the members that got the small pids (they then get no grace period,
 * only the final SIGKILL).  Each process costs one getpgid(); only members
 * have their stat file read (to leave zombies out): reading every process's
 * stat would cost about 7 us a process.
 *
 * torchmp_pgroup_surely_empty asks the same of one group at its leader's
 * exit, and answers only when that is cheap and certain (loop_reap.c reaps
 * such a leader at once).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "torchmp.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <unistd.h>
#include <poll.h>
#include <sys/resource.h>
#ifdef TORCHMP_HAVE_PROC_FD_DIR
#include <sys/syscall.h>
#endif

/* Pids handed out since the oldest leader up to which asking each one
 * beats listing /proc. */
#define DIRECT_SCAN_MAX 4096

static int pid_cmp(const void *a, const void *b)
{
    pid_t x = *(const pid_t *)a, y = *(const pid_t *)b;
    return x < y ? -1 : x > y;
}

/* The state letter and process group of <dirfd>/<name>/stat (dirfd: /proc,
 * or AT_FDCWD with an absolute name); 0, or -1 when the process is gone or
 * the file does not parse. */
static int read_stat(int dirfd, const char *name, char *state, pid_t *pgrp)
{
    char path[64], buf[512];
    const char *p;
    ssize_t n;
    long ppid, pg;
    int fd;

    if (snprintf(path, sizeof(path), "%s/stat", name) >= (int)sizeof(path))
        return -1;
    fd = openat(dirfd, path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    do {
        n = read(fd, buf, sizeof(buf) - 1);
    } while (n < 0 && errno == EINTR);
    close(fd);
    if (n <= 0)
        return -1;
    buf[n] = '\0';
    /* "pid (comm) S ppid pgrp ...": comm may hold spaces and parentheses,
     * so parse from the last ')'. */
    p = strrchr(buf, ')');
    if (p == NULL || sscanf(p + 1, " %c %ld %ld", state, &ppid, &pg) != 3)
        return -1;
    *pgrp = (pid_t)pg;
    return 0;
}

int torchmp_open_fd_count(void)
{
#ifdef TORCHMP_HAVE_PROC_FD_DIR
    /* The raw getdents64 of /proc/self/fd: no names built, the listing's own
     * fd left out. */
    char buf[8192];
    long nread;
    int n = 0, dirfd = open("/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dirfd < 0)
        return -1;
    while ((nread = syscall(SYS_getdents64, dirfd, buf, sizeof(buf))) > 0) {
        long off = 0;
        while (off < nread) {
            unsigned short reclen;
            memcpy(&reclen, buf + off + 16, sizeof(reclen));
            if (buf[off + 19] >= '0' && buf[off + 19] <= '9')
                n++;
            off += reclen;
        }
    }
    if (nread < 0) {
        int saved = errno;
        close(dirfd);
        errno = saved;
        return -1;
    }
    close(dirfd);
    return n - 1;
#else
    errno = ENOSYS;
    return -1;
#endif
}

int torchmp_fd_room(int n)
{
    /* Without counting what is open (a walk of /proc/self/fd: a path walk
     * and a getdents64 that formats every entry): if the n numbers just
     * below the soft limit are all free, n more descriptors fit, since the
     * kernel hands out the lowest free number.  One poll of those numbers
     * says so: POLLNVAL for each that is not open, past the end of the fd
     * table too.  (An O_PATH descriptor among them looks free to poll: that
     * launch meets EMFILE half-way instead, tears down what it started and
     * says so, as when another thread took the room meanwhile.) */
    struct pollfd fds[TORCHMP_FD_ROOM_MAX];
    struct rlimit lim;
    int i, rc;

    if (n <= 0)
        return 1;
    if (getrlimit(RLIMIT_NOFILE, &lim) != 0)
        return -1;
    if (lim.rlim_cur == RLIM_INFINITY)
        return 1;
    if (n > TORCHMP_FD_ROOM_MAX || (rlim_t)n > lim.rlim_cur)
        return 0;
    for (i = 0; i < n; i++) {
        fds[i].fd = (int)(lim.rlim_cur - (rlim_t)n) + i;
        fds[i].events = 0;
        fds[i].revents = 0;
    }
    do {
        rc = poll(fds, (nfds_t)n, 0);
    } while (rc < 0 && errno == EINTR);
    if (rc < 0)
        return -1;
    for (i = 0; i < n; i++) {
        if (!(fds[i].revents & POLLNVAL))
            return 0;
    }
    return 1;
}

int torchmp_pid_exited(pid_t pid)
{
    char name[32], state;
    pid_t pgrp;
    if (kill(pid, 0) != 0 && errno == ESRCH)
        return 1;
    snprintf(name, sizeof(name), "/proc/%d", (int)pid);
    if (read_stat(AT_FDCWD, name, &state, &pgrp) != 0)
        return errno == ENOENT || errno == ESRCH;
    return state == 'Z' || state == 'X';
}

/* /proc/sys/kernel/ns_last_pid, opened once (torchmp_procscan_init): a
 * pread of it is a third of an open + read + close. */
static int last_pid_fd = -1;

void torchmp_procscan_init(void)
{
    if (last_pid_fd < 0)
        last_pid_fd = open("/proc/sys/kernel/ns_last_pid", O_RDONLY | O_CLOEXEC);
}

/* The pid the kernel handed out last in our pid namespace, or -1. */
static long last_pid(void)
{
    char buf[32];
    ssize_t n;
    int fd = last_pid_fd;
    int own = 0;
    if (fd < 0) {
        fd = open("/proc/sys/kernel/ns_last_pid", O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            return -1;
        own = 1;
    }
    do {
        n = pread(fd, buf, sizeof(buf) - 1, 0);
    } while (n < 0 && errno == EINTR);
    if (own)
        close(fd);
    if (n <= 0)
        return -1;
    buf[n] = '\0';
    return strtol(buf, NULL, 10);
}

/* Whether pid is a living member of one of the groups (sorted: pgids in
 * order); marks alive[] and returns how many groups it newly showed alive.
 * getpgid() is one cheap system call; the stat file (which the kernel
 * formats field by field) is read only for members, to leave out zombies. */
static int check_member(pid_t pid, int dirfd, const char *name, const pid_t *pgids, const pid_t *sorted, int n,
                        unsigned char *alive)
{
    char path[32], state;
    pid_t pgrp = getpgid(pid);
    int found = 0;
    if (pgrp <= 0)
        return 0;                  /* gone (or exited meanwhile) */
    if (pid == pgrp || bsearch(&pgrp, sorted, (size_t)n, sizeof(pid_t), pid_cmp) == NULL)
        return 0;                  /* not a member; or the leader, a zombie the caller holds */
    if (name == NULL) {
        snprintf(path, sizeof(path), "/proc/%d", (int)pid);
        name = path;
    }
    if (read_stat(dirfd, name, &state, &pgrp) != 0 || state == 'Z' || state == 'X')
        return 0;
    for (int i = 0; i < n; i++) {
        if (pgids[i] == pgrp && !alive[i]) {
            alive[i] = 1;
            found++;
        }
    }
    return found;
}

int torchmp_pgroups_alive(const pid_t *pgids, int n, unsigned char *alive)
{
    pid_t *sorted;
    DIR *dir;
    struct dirent *de;
    pid_t oldest;
    long last_seen;
    int found = 0;

    for (int i = 0; i < n; i++)
        alive[i] = 0;
    if (n == 0)
        return 0;
    sorted = malloc((size_t)n * sizeof(pid_t));
    if (sorted == NULL)
        return -1;
    memcpy(sorted, pgids, (size_t)n * sizeof(pid_t));
    qsort(sorted, (size_t)n, sizeof(pid_t), pid_cmp);
    last_seen = last_pid();
    oldest = last_seen >= (long)sorted[0] ? sorted[0] : 0; /* 0: wrapped (or unknown), read all */
    if (oldest > 0 && last_seen - (long)oldest <= DIRECT_SCAN_MAX) {
        /* Few pids were handed out since the oldest leader: ask each of
         * them directly, no directory listing (whose entries for new
         * processes the kernel builds on first sight: 4x the cost). */
        for (long pid = (long)oldest + 1; pid <= last_seen; pid++)
            found += check_member((pid_t)pid, AT_FDCWD, NULL, pgids, sorted, n, alive);
        free(sorted);
        return found;
    }
    dir = opendir("/proc");
    if (dir == NULL) {
        int saved = errno;
        free(sorted);
        errno = saved;
        return -1;
    }
    while ((de = readdir(dir)) != NULL) {
        if (de->d_name[0] < '1' || de->d_name[0] > '9')
            continue;
        if (oldest > 0 && strtol(de->d_name, NULL, 10) <= (long)oldest)
            continue;              /* older than every leader: in none of the groups */
        found += check_member((pid_t)strtol(de->d_name, NULL, 10), dirfd(dir), de->d_name, pgids, sorted, n,
                              alive);
    }
    closedir(dir);
    free(sorted);
    return found;
}

int torchmp_pgroup_surely_empty(pid_t pgid, long span)
{
    long last = last_pid(), again;
    unsigned char alive = 0;
    int saved = errno;

    if (pgid <= 1 || last < (long)pgid || last - (long)pgid > span)
        return 0;
    /* No pid handed out since the leader's (which its zombie still holds,
     * so the counter cannot have come round to it): nothing can have joined
     * its group, and nothing left in it can fork. */
    if (last == (long)pgid) {
        errno = saved;
        return 1;
    }
    for (long pid = (long)pgid + 1; pid <= last; pid++) {
        if (check_member((pid_t)pid, AT_FDCWD, NULL, &pgid, &pgid, 1, &alive) > 0) {
            errno = saved;
            return 0;
        }
    }
    /* A member the pass had not reached yet may have forked and exited
     * meanwhile, its child getting a pid past `last`: only if no pid was
     * handed out during the pass did it see every member there was.  (What
     * it cannot see coming: a process of the rank's session that had left
     * the group with setpgid() and joins it again.  While outside, it had
     * escaped the group, where close() does not look for it either.) */
    again = last_pid();
    errno = saved;
    return again == last;
}
