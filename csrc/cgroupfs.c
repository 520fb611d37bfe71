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

#ifdef __linux__
#include <sys/stat.h>
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
