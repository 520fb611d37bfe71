/*
 * What console.c (the backlog, its bound, markers, progress) and
 * console_target.c (reaching the target without blocking; the takers of
 * queue consoles) share.  Included by those two files only.
 */
#ifndef TORCHMP_CONSOLE_INTERNAL_H
#define TORCHMP_CONSOLE_INTERNAL_H

#include "torchmp.h"

#include <pthread.h>
#include <stdint.h>
#include <sys/types.h>

enum console_mode {
    MODE_PLAIN = 1,       /* writes never wait on a reader */
    MODE_NONBLOCK = 2,    /* a private O_NONBLOCK description */
    MODE_SOCKET = 3,      /* send(MSG_DONTWAIT) */
    MODE_GUARDED = 4,     /* poll before small writes */
    MODE_QUEUE = 5        /* taken by the owner */
};

typedef struct drop_record {
    uint64_t source_id;
    char *prefix;
    char *log_path;           /* NULL: no log file */
    uint64_t lines;
    uint64_t bytes;
    struct drop_record *next;
} drop_record;

struct torchmp_console {
    int mode;
    int fd;                   /* fd kinds: the private fd; -1 once switched off */
    int std_fd;               /* fd kinds: the launcher's fd it was opened for */
    int broken_errno;         /* why it was switched off */
    dev_t dev;                /* identity of the target */
    ino_t ino;
    pthread_mutex_t mu;       /* a queue console is shared with its taker */
    char *buf;                /* backlog: bytes [start, start + len) of buf */
    size_t start, len, cap;
    size_t cap_hint;          /* queue: the size the last backlog taken had */
    int dropping;             /* past a bound: drop lines until the backlog empties */
    drop_record *drops;
    uint64_t behind;          /* bytes the loop holds back for this console (logs) */
    uint64_t shown;           /* bytes the target took, ever */
    int64_t progress_ns;      /* last bytes taken, or when bytes began to wait */
    int resumed;              /* took bytes after a stall (the loop clears it) */
    int wake_fd;              /* queue: the loop's wake fd, to ask for more */
    int refs;                 /* atomic: streams, the loop's registry, a Python handle */
};

/* console.c */
torchmp_console *torchmp_console_alloc(int mode);
void torchmp_console_destroy(torchmp_console *c);

/* console_target.c: write some of buf without waiting: the number of bytes
 * written (0: the console cannot take more now), or -1 with errno when it
 * is broken. */
ssize_t torchmp_console_write_some(torchmp_console *c, const char *buf, size_t len);

#endif /* TORCHMP_CONSOLE_INTERNAL_H */
