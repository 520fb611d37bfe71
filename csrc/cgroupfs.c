/*
 * The OOM watch's cgroup files: whether a directory is the root of a
 * cgroup hierarchy, and the two files read at every launch (below).
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
#ifndef _GNU_SOURCE
#define _GNU_SOURCE  /* dup3 */
#endif
#include "torchmp.h"

#include <errno.h>
#include <string.h>

#ifdef __linux__
#include <fcntl.h>
#include <limits.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#define CGROUP_V1_MAGIC 0x27e0eb      /* CGROUP_SUPER_MAGIC, linux/magic.h */
#define CGROUP_V2_MAGIC 0x63677270    /* CGROUP2_SUPER_MAGIC */
#define PROC_MAGIC 0x9fa0             /* PROC_SUPER_MAGIC */
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
 * The OOM watch's files, read through descriptors kept open.
 *
 * Every launch reads /proc/self/cgroup (has the launcher moved?) and its
 * memory cgroup's counter of OOM kills.  Opening them is most of the cost:
 * a path walk through /proc or the cgroup file system; the OOM baseline
 * of a one-rank launch took 39 us with them opened each time, 22 through
 * kept descriptors.  Both are seq_files, which a pread at offset 0 builds
 * anew.
 *
 * A kept descriptor is checked before each read (one fstat): the number
 * may have been closed behind our back and reused for another file.  The
 * file of a cgroup removed meanwhile fails the read (ENODEV), and the path
 * is opened again, whatever is there by then.  In a child forked with the
 * descriptors, /proc/self/cgroup would still be the parent's: the child
 * closes them (an at-fork handler, and the pid check here for forks that
 * do not run it) and opens its own.  Only the kernel's files are kept
 * (proc, cgroup): a regular file in their place (a test's) is read and
 * closed as before.  A file is kept from its second read on: a process
 * that launches once (torchmp run) holds no more descriptors than before.
 * Callers hold the GIL: one at a time, so no lock.
 */
#ifdef __linux__
struct kept_file {
    int fd;              /* -1: none */
    pid_t pid;           /* the process that opened it (or read path once) */
    dev_t dev;
    ino_t ino;
    char path[PATH_MAX];
};

static struct kept_file kept_files[TORCHMP_KEPT_FILES] = {
    {.fd = -1}, {.fd = -1},
};

/* Whether k's descriptor still is the file it kept (not a reused number). */
static int kept_is_ours(const struct kept_file *k, struct stat *st)
{
    return fstat(k->fd, st) == 0 && st->st_dev == k->dev && st->st_ino == k->ino;
}

/* Whether fd is a file the kernel builds (proc, cgroup v1 or v2). */
static int kernel_file(int fd)
{
    struct statfs fs;
    return fstatfs(fd, &fs) == 0 &&
           (fs.f_type == PROC_MAGIC || fs.f_type == CGROUP_V1_MAGIC || fs.f_type == CGROUP_V2_MAGIC);
}

/* Whether this process read path through slot k before. */
static int seen_before(const struct kept_file *k, const char *path)
{
    return k->pid == torchmp_self_pid() && strcmp(k->path, path) == 0;
}

/* Close k's descriptor if it still is ours; 1 if it was closed. */
static int kept_drop(struct kept_file *k)
{
    struct stat st;
    int closed = k->fd >= 0 && kept_is_ours(k, &st);
    if (closed)
        close(k->fd);
    k->fd = -1;
    return closed;
}

/* pread the whole of fd (at most size bytes); -1 with errno. */
static ssize_t read_whole(int fd, char *buf, size_t size)
{
    ssize_t n;
    do {
        n = pread(fd, buf, size, 0);
    } while (n < 0 && errno == EINTR);
    return n;
}
#endif

ssize_t torchmp_read_kept(int slot, const char *path, char *buf, size_t size)
{
#ifdef __linux__
    struct kept_file *k;
    struct stat st;
    size_t len = strlen(path);
    ssize_t n;
    int fd, saved, keepable;

    if (slot < 0 || slot >= TORCHMP_KEPT_FILES || len >= sizeof(k->path)) {
        errno = EINVAL;
        return -1;
    }
    k = &kept_files[slot];
    if (k->fd >= 0) {
        if (!kept_is_ours(k, &st)) {
            k->fd = -1;  /* closed behind our back, the number reused: not ours to close */
        } else if (k->pid != torchmp_self_pid()) {
            close(k->fd);  /* a forked child's copy of its parent's */
            k->fd = -1;
        } else if (st.st_nlink != 0 && strcmp(k->path, path) == 0) {
            n = read_whole(k->fd, buf, size);
            if (n >= 0)
                return n;
            /* (ENODEV: the cgroup was removed.)  Opened again below, on the
             * same number. */
        }
    }
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    keepable = fstat(fd, &st) == 0 && kernel_file(fd);
    if (!keepable || (k->fd < 0 && !seen_before(k, path))) {
        /* Not kept: a regular file in its place (a test's), or the first
         * read of this path by this process.  The slot keeps what it had. */
        if (keepable && k->fd < 0) {
            k->pid = torchmp_self_pid();
            memcpy(k->path, path, len + 1);
        }
        n = read_whole(fd, buf, size);
        saved = errno;
        close(fd);
        errno = saved;
        return n;
    }
    if (k->fd >= 0) {
        /* Another file for the slot: on the same descriptor number, so that
         * the set of descriptors the process holds stays the same. */
        if (dup3(fd, k->fd, O_CLOEXEC) < 0) {
            saved = errno;
            close(fd);
            kept_drop(k);
            errno = saved;
            return -1;
        }
        close(fd);
        fd = k->fd;
    }
    k->fd = fd;
    k->pid = torchmp_self_pid();
    k->dev = st.st_dev;
    k->ino = st.st_ino;
    memcpy(k->path, path, len + 1);
    n = read_whole(fd, buf, size);
    if (n < 0) {
        saved = errno;
        kept_drop(k);
        errno = saved;
    }
    return n;
#else
    (void)slot; (void)path; (void)buf; (void)size;
    errno = ENOSYS;
    return -1;
#endif
}

int torchmp_drop_kept_files(void)
{
    int dropped = 0;
#ifdef __linux__
    for (int i = 0; i < TORCHMP_KEPT_FILES; i++) {
        dropped += kept_drop(&kept_files[i]);
    }
#endif
    return dropped;
}

void torchmp_forget_kept_files_after_fork(void)
{
#ifdef __linux__
    /* In the child, just forked: the numbers are still the inherited copies. */
    for (int i = 0; i < TORCHMP_KEPT_FILES; i++) {
        if (kept_files[i].fd >= 0)
            close(kept_files[i].fd);
        kept_files[i].fd = -1;
    }
#endif
}
