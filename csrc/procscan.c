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

static int pid_cmp(const void *a, const void *b)
{
    pid_t x = *(const pid_t *)a, y = *(const pid_t *)b;
    return x < y ? -1 : x > y;
}

/* The state letter and process group of /proc/<name>/stat; 0, or -1 when
 * the process is gone or the file does not parse. */
static int read_stat(const char *name, char *state, pid_t *pgrp)
{
    char path[64], buf[512];
    const char *p;
    ssize_t n;
    long ppid, pg;
    int fd;

    if (snprintf(path, sizeof(path), "/proc/%s/stat", name) >= (int)sizeof(path))
        return -1;
    fd = open(path, O_RDONLY | O_CLOEXEC);
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

int torchmp_pid_exited(pid_t pid)
{
    char name[24], state;
    pid_t pgrp;
    if (kill(pid, 0) != 0 && errno == ESRCH)
        return 1;
    snprintf(name, sizeof(name), "%d", (int)pid);
    if (read_stat(name, &state, &pgrp) != 0)
        return errno == ENOENT || errno == ESRCH;
    return state == 'Z' || state == 'X';
}

int torchmp_pgroups_alive(const pid_t *pgids, int n, unsigned char *alive)
{
    pid_t *sorted;
    DIR *dir;
    struct dirent *de;
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
    dir = opendir("/proc");
    if (dir == NULL) {
        int saved = errno;
        free(sorted);
        errno = saved;
        return -1;
    }
    while ((de = readdir(dir)) != NULL) {
        char state;
        pid_t pgrp;
        pid_t *hit;
        if (de->d_name[0] < '1' || de->d_name[0] > '9')
            continue;
        if (read_stat(de->d_name, &state, &pgrp) != 0)
            continue;              /* exited meanwhile */
        if (state == 'Z' || state == 'X')
            continue;
        hit = bsearch(&pgrp, sorted, (size_t)n, sizeof(pid_t), pid_cmp);
        if (hit == NULL)
            continue;
        for (int i = 0; i < n; i++) {
            if (pgids[i] == pgrp && !alive[i]) {
                alive[i] = 1;
                found++;
            }
        }
    }
    closedir(dir);
    free(sorted);
    return found;
}
