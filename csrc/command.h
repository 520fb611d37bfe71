/*
 * torchmp native core: one command outside the worker groups (torchmp.run,
 * run_async), and the notifier through which the I/O thread wakes event
 * loops.  Included at the end of torchmp.h (it uses its spawn and group
 * types); include torchmp.h, not this file.
 */
#ifndef TORCHMP_COMMAND_H
#define TORCHMP_COMMAND_H

/* ---------------------------------------------------------------------------
 * notifier.c: how the I/O thread wakes an event loop.  One descriptor per
 * event loop (readable while notes wait), however many commands and groups
 * it watches; the notes say what happened to which (a token of the caller's).
 * Reference counted (atomically); post and take serialise internally.
 */
typedef struct torchmp_notifier torchmp_notifier;

enum torchmp_note_what {
    TORCHMP_NOTE_EXITED = 1,   /* a command's leader exited */
    TORCHMP_NOTE_DONE = 2,     /* a command's output is complete: the caller may reap it */
    TORCHMP_NOTE_CHANGED = 3   /* a watched group's state moved on (an exit, a close) */
};

typedef struct {
    uint64_t token;
    int what;
} torchmp_note;

/* NULL with errno. */
torchmp_notifier *torchmp_notifier_new(void);
torchmp_notifier *torchmp_notifier_ref(torchmp_notifier *n);
void torchmp_notifier_unref(torchmp_notifier *n);
/* Readable while notes wait. */
int torchmp_notifier_fd(const torchmp_notifier *n);
/* Queue a note and make the fd readable.  If the queue cannot grow, the
 * note is lost and *overflow of the next take is set: the caller then asks
 * every command and group it watches directly. */
void torchmp_notifier_post(torchmp_notifier *n, uint64_t token, int what);
/* Take the waiting notes (malloc'ed; *count of them, NULL if none) and make
 * the fd quiet again. */
torchmp_note *torchmp_notifier_take(torchmp_notifier *n, size_t *count, int *overflow);

/* Groups: also post TORCHMP_NOTE_CHANGED with token to n whenever the
 * group's change counter moves or it is interrupted (until unwatched, or the
 * group is freed); with TORCHMP_WAIT_DECIDED in flags, only once the result
 * is decided or on the interrupt (torchmp_group_wait's flags).  -1 with
 * errno (ENOMEM). */
int torchmp_group_watch(torchmp_group *g, torchmp_notifier *n, uint64_t token, int flags);
void torchmp_group_unwatch(torchmp_group *g, torchmp_notifier *n);

/* ---------------------------------------------------------------------------
 * command.c, loop_commands.c: one command outside the worker groups
 * (torchmp.run, run_async).  The calling thread forks and execs it with
 * torchmp_spawn, then waits for it itself (torchmp_command_wait: its pidfd and
 * output pipes in one ppoll) or hands it to the I/O thread
 * (torchmp_command_watch), which posts to a notifier.  Either way its output
 * is read into bounded captures, and its zombie is kept until the caller
 * reaps it, so its process group id stays the caller's to signal.
 */
typedef struct torchmp_command torchmp_command;

/* How a standard stream of the command is wired. */
enum torchmp_io {
    TORCHMP_IO_INHERIT = 0,    /* the launcher's own fd */
    TORCHMP_IO_FD = 1,         /* an fd of the caller's (dup2'ed) */
    TORCHMP_IO_PIPE = 2,       /* stdout/stderr: a pipe read into a capture */
    TORCHMP_IO_STDOUT = 3      /* stderr: wherever stdout goes */
};

typedef struct {
    torchmp_spawn_args args;   /* path or exec_paths, argv, envp, cwd, keep_fds */
    int io[3];                 /* TORCHMP_IO_* of stdin, stdout, stderr (stdin: INHERIT or FD) */
    int fd[3];                 /* TORCHMP_IO_FD: the caller's fd */
    size_t max_output;         /* bytes kept per captured stream; SIZE_MAX: all */
    int64_t drain_ns;          /* how long output is still read after the leader exited */
} torchmp_command_spec;

/* Bits of torchmp_command_info.state. */
enum {
    TORCHMP_CMD_EXITED = 1,    /* the leader exited: status and rusage are in */
    TORCHMP_CMD_DONE = 2,      /* exited, and its pipes are at EOF or past the drain time */
    TORCHMP_CMD_REAPED = 4,    /* the zombie is gone: its pid is never signalled again */
    TORCHMP_CMD_WATCHED = 8    /* the I/O thread watches it */
};

/* What torchmp_command_wait waits for. */
enum { TORCHMP_UNTIL_EXITED = 1, TORCHMP_UNTIL_DONE = 2 };

typedef struct {
    pid_t pid;
    int state;
    int wait_status;           /* raw, once exited */
    int status_lost;           /* reaped by somebody else: no status, no pin */
    int64_t start_mono_ns, exit_mono_ns;
    int64_t utime_ns, stime_ns, maxrss_kb;
} torchmp_command_info;

/* Start one command.  NULL with *err filled (errno = err->errnum) if it
 * could not be started; nothing is left open or running then. */
torchmp_command *torchmp_command_start(const torchmp_command_spec *spec, torchmp_spawn_error *err);
/* The caller lets go of its reference: a command not reaped yet is killed
 * (SIGKILL to its group) and reaped by the I/O thread once it has exited. */
void torchmp_command_release(torchmp_command *c);
/* Wait until `until` (TORCHMP_UNTIL_*) holds or timeout_ns pass (negative:
 * forever), reading the output meanwhile; a watched command is waited for on
 * its notifier, which must be the caller's alone.  1: holds; 0: timeout;
 * -1 with errno (EINTR: a signal, call again).  signal_fd (ignored if
 * negative): as for torchmp_group_wait, readable it ends the wait as EINTR. */
int torchmp_command_wait(torchmp_command *c, int64_t timeout_ns, int until, int signal_fd);
/* Hand the command to the I/O thread, which posts EXITED and DONE with
 * token to n (not waiting for the thread).  -1 with errno. */
int torchmp_command_watch(torchmp_command *c, torchmp_notifier *n, uint64_t token);
void torchmp_command_info_get(torchmp_command *c, torchmp_command_info *out);
/* Signal the command's process group while its leader's pid is pinned
 * (running, or an unreaped zombie). */
int torchmp_command_killpg(torchmp_command *c, int sig);
/* 1 while the leader runs or its process group has another living member. */
int torchmp_command_busy(torchmp_command *c);
/* Reap the zombie (after DONE; its pipes are closed).  -1 with errno: EBUSY
 * (not done yet). */
int torchmp_command_reap(torchmp_command *c);
/* The output captured from stdout (0) or stderr (1): the first bytes (head,
 * borrowed) and the last (tail, malloc'ed in order; NULL if none); *total is
 * what the stream carried, *lost_errno an allocation failure's errno.  Not
 * while the I/O thread watches it. */
int torchmp_command_output(torchmp_command *c, int which, const char **head, size_t *head_len, char **tail,
                           size_t *tail_len, uint64_t *total, int *lost_errno);

/* Whether vfork is to be used (TORCHMP_NO_VFORK), read once. */
int torchmp_vfork_enabled(void);
/* The I/O backend this process uses (or will), decided once without
 * starting the I/O thread: TORCHMP_BACKEND, then whether pidfds work. */
int torchmp_backend_choice(void);

#endif /* TORCHMP_COMMAND_H */
