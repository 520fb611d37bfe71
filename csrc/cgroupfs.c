/*
 * Whether a directory is the root of a cgroup hierarchy.
 *
 * The OOM watch (torchmp/_oom.py) needs the file that counts the OOM kills
 * of the launcher's memory cgroup: the cgroup's path comes from
 * /proc/self/cgroup, and where its hierarchy is mounted from the mount
 * table.  The kernel builds /proc/self/mountinfo on every read, and the
 * first read in a process cost 100-200 us here: a tenth of a fresh
 * launcher's first launch.  Where the hierarchy is mounted whole at its
 * usual place (/sys/fs/cgroup/memory for v1, /sys/fs/cgroup for v2), a
 * statfs and a stat say so, and the table is not needed.
 *
 * "Whole" is what makes the shortcut right: a container without a cgroup
 * namespace sees a bind mount of part of the hierarchy there, under which
 * the paths of /proc/self/cgroup do not resolve.  kernfs gives a
 * hierarchy's root directory inode 1 (the first id it hands out), and any
 * other directory a larger one, so a mounted subtree is told apart.  Any
 * doubt (another kernel numbering its inodes differently, an error) answers
 * 0, and the caller reads the table.
 */
#include "torchmp.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#ifdef __linux__
#include <sys/vfs.h>

#define CGROUP_V1_MAGIC 0x27e0eb      /* CGROUP_SUPER_MAGIC, linux/magic.h */
#define CGROUP_V2_MAGIC 0x63677270    /* CGROUP2_SUPER_MAGIC */
#endif

int torchmp_cgroup_root_version(const char *path)
{
#ifdef __linux__
    struct statfs fs;
    struct stat st;
    if (statfs(path, &fs) != 0 || stat(path, &st) != 0)
        return 0;
    if (!S_ISDIR(st.st_mode) || st.st_ino != 1)
        return 0;
    if (fs.f_type == CGROUP_V1_MAGIC)
        return 1;
    if (fs.f_type == CGROUP_V2_MAGIC)
        return 2;
#else
    (void)path;
#endif
    return 0;
}

/*
 * The two small files every launch reads for the OOM watch -- /proc/self/cgroup
 * and the memory cgroup's counter -- are kept open and re-read with pread.
 * Opening is most of a read's cost (a path walk; for /proc/self, the pid's
 * directory).  Measured here: a read of /proc/self/cgroup went from 7.5 us
 * to 3.1, one of the counter from 6.6 us to 0.8.
 *
 * A kept fd is read only while it is still the file that was opened:
 *   - this process's: a forked child's copy named its parent ("self" was
 *     resolved at open), so the child opens its own and closes the copy;
 *   - the same inode: a program that closed every fd it did not know about
 *     (a daemon) may have given the number to another file, which must be
 *     neither read nor closed;
 *   - the same path: the launcher was moved to another cgroup.
 * Callers hold the GIL, which serialises them: no lock (and nothing a fork
 * could leave held).
 */
#define KEPT_SLOTS 2

typedef struct {
    int fd;
    pid_t pid;
    dev_t dev;
    ino_t ino;
    char *path;
} kept_file;

static kept_file kept[KEPT_SLOTS] = {{-1, 0, 0, 0, NULL}, {-1, 0, 0, 0, NULL}};

/* Whether slot k may be read for path in process me; forgets (and closes,
 * when it is surely ours) an fd that may not. */
static int kept_usable(kept_file *k, const char *path, pid_t me)
{
    struct stat st;
    if (k->fd < 0)
        return 0;
    if (fstat(k->fd, &st) != 0 || st.st_dev != k->dev || st.st_ino != k->ino) {
        k->fd = -1; /* closed behind our back: the number is not ours to close */
        return 0;
    }
    if (k->pid != me || strcmp(k->path, path) != 0) {
        (void)close(k->fd);
        k->fd = -1;
        return 0;
    }
    return 1;
}

static int kept_open(kept_file *k, const char *path, pid_t me)
{
    struct stat st;
    char *copy;
    int fd, saved;

    copy = strdup(path);
    if (copy == NULL)
        return -1;
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        goto fail;
    if (fstat(fd, &st) != 0)
        goto fail;
    free(k->path);
    k->path = copy;
    k->fd = fd;
    k->pid = me;
    k->dev = st.st_dev;
    k->ino = st.st_ino;
    return 0;
fail:
    saved = errno;
    if (fd >= 0)
        (void)close(fd);
    free(copy);
    errno = saved;
    return -1;
}

ssize_t torchmp_kept_read(int slot, const char *path, char *buf, size_t cap)
{
    kept_file *k;
    pid_t me = torchmp_self_pid();
    size_t got = 0;

    if (slot < 0 || slot >= KEPT_SLOTS || path == NULL || cap == 0) {
        errno = EINVAL;
        return -1;
    }
    k = &kept[slot];
    if (!kept_usable(k, path, me) && kept_open(k, path, me) != 0)
        return -1;
    /* Each pread from offset 0 makes the kernel format the file afresh. */
    for (;;) {
        ssize_t n = pread(k->fd, buf + got, cap - got, (off_t)got);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        if (n == 0)
            return (ssize_t)got;
        got += (size_t)n;
        if (got == cap) {
            errno = EFBIG;
            return -1;
        }
    }
}
