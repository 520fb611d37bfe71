/*
 * torchmp native core: one header for the C files in csrc/.
 *
 *   spawn.c   fork/vfork + exec of one worker, errors back through a CLOEXEC pipe
 *   bind.c    a worker's CPU affinity and memory policy, set in the child
 *   framer.c  per-stream line framing for the console (prefix + whole lines)
 *   console.c consoles that never block the I/O thread (bounded backlog, drops)
 *   poller.c  epoll (Linux) or poll() readiness backends behind one interface
 *   loop_*.c  the process-wide I/O thread and worker groups, behind the
 *             private loop_internal.h: loop_thread.c (the thread, commands),
 *             loop_streams.c (tee pipes, consoles), loop_reap.c (exits,
 *             pidfds, reaping), loop_groups.c (groups: spawn, prepare, adopt)
 *   command.c one command outside the groups (torchmp.run), declared in
 *             command.h with notifier.c (one descriptor per event loop) and
 *             loop_commands.c (the I/O thread's side of a command)
 *   keeper.c  the process that kills the workers' groups if the launcher dies:
 *             the launcher's side (its table, starting it); keeper_watch.c
 *             its life, shared with keeper_main.c, the small program
 *             (torchmp/_keeper) it is exec'd from
 *   procscan.c which process groups still have a living member (/proc)
 *
 * Conventions (psutil style): functions return 0 / a value on success and -1
 * with errno set on failure; policy lives in Python (torchmp/api.py); the
 * Cython module (_core.pyx) turns errno into OSError.
 */
#ifndef TORCHMP_H
#define TORCHMP_H

#include <stddef.h>
#include <stdint.h>
#include <signal.h>
#include <sys/types.h>

/* ---------------------------------------------------------------------------
 * Platform features.  TORCHMP_PORTABLE switches every Linux-only facility off
 * so CI can prove the fallback paths compile and work on Linux too.
 */
#if defined(__linux__) && !defined(TORCHMP_PORTABLE)
#define TORCHMP_HAVE_EPOLL 1
#define TORCHMP_HAVE_EVENTFD 1
#define TORCHMP_HAVE_PIDFD 1
#define TORCHMP_HAVE_PDEATHSIG 1
#define TORCHMP_HAVE_CLOSE_RANGE 1
#define TORCHMP_HAVE_VFORK 1
#define TORCHMP_HAVE_PROC_FD_DIR 1
#define TORCHMP_HAVE_PIPE2 1
#define TORCHMP_HAVE_PPOLL 1
#define TORCHMP_HAVE_BINDING 1     /* sched_setaffinity, set_mempolicy */
#define TORCHMP_HAVE_INOTIFY 1     /* teed logs followed without an fd each (loop_follow.c) */
#define TORCHMP_HAVE_KEEPER_EXEC 1 /* the keeper exec'd from torchmp/_keeper (memfd table) */
#endif

/* Line-coverage builds (setup.py TORCHMP_COVERAGE=1, used by .ci/coverage):
 * a process that leaves by _exit() writes no gcov counters, so the keeper
 * flushes its own before it does.  Nothing at all in other builds. */
#ifdef TORCHMP_COVERAGE
void __gcov_dump(void);
#define TORCHMP_COVERAGE_FLUSH() __gcov_dump()
#else
#define TORCHMP_COVERAGE_FLUSH() ((void)0)
#endif

/* ---------------------------------------------------------------------------
 * spawn.c
 */

/* Where a worker's setup failed: in the parent, or in the child between fork
 * and exec.  Travels from the child in a torchmp_spawn_error record, which
 * only ever goes from a child to the parent of the same build, so the values
 * need not stay stable across versions: keep them dense, with
 * TORCHMP_STEP__COUNT last (Python iterates over 1 .. STEP_COUNT - 1). */
enum torchmp_spawn_step {
    TORCHMP_STEP_NONE = 0,
    TORCHMP_STEP_PIPE = 1,        /* parent: spawn error pipe */
    TORCHMP_STEP_FORK = 2,        /* parent: fork/vfork */
    TORCHMP_STEP_SIGNALS = 3,     /* child: reset dispositions / mask */
    TORCHMP_STEP_SETSID = 4,
    TORCHMP_STEP_PDEATHSIG = 5,
    TORCHMP_STEP_DUP_STDOUT = 6,
    TORCHMP_STEP_DUP_STDERR = 7,
    TORCHMP_STEP_CLOSE_FDS = 8,
    TORCHMP_STEP_EXEC = 9,
    TORCHMP_STEP_PROTOCOL = 10,   /* parent: short record from the child */
    TORCHMP_STEP_PIDFD = 11,      /* parent: pidfd_open after a good exec */
    TORCHMP_STEP_STREAM = 12,     /* parent: tee pipe or return channel for the worker */
    TORCHMP_STEP_DUP_FD = 13,     /* child: dup2 of the return channel / payload fds */
    TORCHMP_STEP_AFFINITY = 14,   /* child: sched_setaffinity */
    TORCHMP_STEP_MEMPOLICY = 15,  /* child: set_mempolicy */
    TORCHMP_STEP_CHDIR = 16,      /* child: chdir to the command's cwd */
    TORCHMP_STEP_KEEP_FDS = 17,   /* child: making the pass_fds inheritable */
    TORCHMP_STEP__COUNT
};

/* The fixed-size record a child writes once to the spawn error pipe before
 * _exit: which step failed (any of them, exec or not) and its errno. */
typedef struct {
    int32_t step;
    int32_t errnum;
} torchmp_spawn_error;

/* The fds a worker starts with: 0..2 are stdio, 3 the return channel of a
 * function worker, 4 its payload.  Everything else is closed. */
#define TORCHMP_CHILD_FDS 5
#define TORCHMP_FD_RETURN 3
#define TORCHMP_FD_PAYLOAD 4

/* Where a worker runs, as masks built by the parent (the kernel's layout:
 * arrays of unsigned long, bit n of the array is CPU / node n).  A NULL
 * mask leaves that setting as inherited. */
typedef struct {
    const unsigned long *cpus;    /* sched_setaffinity mask */
    size_t cpus_size;             /* bytes */
    const unsigned long *mems;    /* set_mempolicy(MPOL_BIND) node mask */
    unsigned long mems_bits;      /* bits in mems */
} torchmp_binding;

/* Apply b to the calling thread (the whole of a freshly forked child).
 * Raw system calls only: async-signal-safe.  0, or the failing step
 * (TORCHMP_STEP_AFFINITY / _MEMPOLICY) with errno set; ENOSYS where the
 * build has no binding (TORCHMP_HAVE_BINDING unset). */
int torchmp_apply_binding(const torchmp_binding *b);

typedef struct {
    const char *path;          /* resolved executable (PATH lookup done by the caller) */
    /* Or, if not NULL, the candidates of a PATH search (NULL-terminated), tried
     * in order by the child as CPython's does: the first exec that works
     * wins; the error reported is the first one that is not ENOENT/ENOTDIR. */
    char *const *exec_paths;
    char *const *argv;         /* NULL-terminated, built before fork */
    char *const *envp;         /* NULL-terminated, built before fork; NULL: the launcher's environ */
    const char *cwd;           /* chdir here before exec; NULL: the launcher's */
    /* child_fds[i]: the launcher fd that becomes fd i in the worker; -1 means
     * inherit for 0..2 and closed for the others. */
    int child_fds[TORCHMP_CHILD_FDS];
    const int *keep_fds;       /* sorted, distinct: fds the worker keeps, inheritable (pass_fds) */
    int nkeep;
    int use_vfork;             /* safe only when every signal is blocked in the caller */
    sigset_t reset_signals;    /* dispositions the child resets to SIG_DFL (torchmp_signals_to_reset) */
    int scan_signals;          /* or: the child finds them itself (one launch: on its own CPU) */
    int pdeathsig;             /* 0: none */
    pid_t parent_pid;          /* getpid() of the launcher, for the PDEATHSIG race check */
    long max_fd;               /* bound for the brute-force close fallback */
    torchmp_binding binding;   /* CPU affinity / memory policy; zeroed: inherited */
    /* The keeper's table slot reserved for this worker's group
     * (torchmp_keeper_spawn): the child writes its pid there before exec,
     * so the group is covered from before it can have a second process.
     * NULL: none. */
    int32_t *keeper_slot;
} torchmp_spawn_args;

/* Start one worker.  0 and *pid_out on success (the child has exec'd); -1 with
 * *err filled on failure (the child, if any, has been reaped).  Never raises
 * a signal in the caller; errno is also set to err->errnum. */
int torchmp_spawn(const torchmp_spawn_args *args, pid_t *pid_out, torchmp_spawn_error *err);

/* The signals a worker must reset before exec: caught ones, and SIGPIPE /
 * SIGXFSZ if ignored.  Called by the parent before a batch of spawns. */
void torchmp_signals_to_reset(sigset_t *out);

/* pipe2(fds, O_CLOEXEC); where there is no pipe2 (macOS, the portable build),
 * pipe then FD_CLOEXEC on both ends, which is not atomic: a fork elsewhere in
 * the process in between may inherit the pair.  0, or -1 with errno. */
int torchmp_pipe_cloexec(int fds[2]);

/* Send one request to a forkserver over the Unix socket sock (nfds <= 8 fds
 * attached) and read its 8-byte little-endian reply into *reply, waiting at
 * most timeout_ns for it.  In C so that no Python signal handler can run
 * between the reply's arrival and the caller recording the pid.  0, or -1
 * with errno (ETIMEDOUT: no reply in time; EPIPE: the server is gone). */
int torchmp_forkserver_request(int sock, const char *msg, size_t len, const int *fds, int nfds,
                               int64_t timeout_ns, int64_t *reply);

/* Human-readable name of a spawn step, for exception messages. */
const char *torchmp_step_name(int step);

/* The part of the child's work that a fork()ed function worker shares with
 * an exec'd one: new session, parent-death signal (with the parent-died
 * race checked), fd plan, close the rest, binding.  Returns the failing step (errno
 * set) or 0.  Async-signal-safe. */
int torchmp_child_setup(const torchmp_spawn_args *a, int keep_fd, int close_others);

/* ---------------------------------------------------------------------------
 * console.c, console_target.c: a place teed lines are shown that never
 * blocks the I/O thread.  Whole lines only; what the console cannot take now
 * waits in a backlog bounded per source.  A source the caller bounds itself
 * (the loop, which holds back the lines of a stream whose log is complete and
 * catches them up from the log later) is queued whole; for other sources,
 * past the bound whole lines are dropped from the console (never from the
 * log) until the backlog has drained, when one marker line per source says
 * how many and where the complete log is.  Reference counted (atomically);
 * every function but ref/unref serialises internally.
 */
typedef struct torchmp_console torchmp_console;

/* The default bound of a stream's lines in a console's backlog. */
#define TORCHMP_DEFAULT_CONSOLE_BACKLOG (4 * 1024 * 1024)

/* Who lines come from, for the bound and the marker line. */
typedef struct {
    uint64_t id;               /* unique per stream */
    const char *prefix;        /* the stream's console prefix */
    size_t prefix_len;
    const char *log_path;      /* the complete log, or NULL */
    size_t limit;              /* backlog bound for this source's lines, bytes */
    int bounded_by_caller;     /* queue whatever comes: the caller keeps the bound */
} torchmp_console_source;

/* A console writing to what fd refers to now (fd itself is not kept: a
 * private dup or reopened description is).  NULL with errno. */
torchmp_console *torchmp_console_open_fd(int fd);
/* A console whose lines are taken by its owner (torchmp_console_take), who
 * sleeps in torchmp_queues_wait.  NULL with errno. */
torchmp_console *torchmp_console_new_queue(void);
torchmp_console *torchmp_console_ref(torchmp_console *c);
void torchmp_console_unref(torchmp_console *c);
/* More than one reference is held. */
int torchmp_console_shared(torchmp_console *c);
/* Show data (whole lines from src) or queue / drop them.  Returns 1 while
 * bytes wait (held back ones included). */
int torchmp_console_submit(torchmp_console *c, const torchmp_console_source *src, const char *data, size_t len);
/* Write what the backlog holds, without blocking; 1 while some of it waits
 * for the fd to take more. */
int torchmp_console_pump(torchmp_console *c);
/* A queue console's waiting bytes (malloc'ed; NULL and *len = 0: none).
 * Asks the loop for more (wake_fd) while bytes are held back for it. */
char *torchmp_console_take(torchmp_console *c, size_t *len);
/* The fd the console writes to (poll it for POLLOUT), -1 if none. */
int torchmp_console_fd(const torchmp_console *c);
/* Bytes waiting, held back ones included (plus one while marker lines are
 * due); 0 once the console is switched off. */
size_t torchmp_console_pending(torchmp_console *c);
/* Bytes the target has taken so far (its progress). */
uint64_t torchmp_console_shown(torchmp_console *c);
/* The errno that switched the console off, 0 while it works. */
int torchmp_console_broken(torchmp_console *c);
int torchmp_console_is_queue(const torchmp_console *c);
/* Whether fd refers to the target this (fd) console writes to. */
int torchmp_console_same_target(const torchmp_console *c, int fd);

/* For the loop, which holds lines back and catches them up from logs:
 * how many bytes of a source with this bound the backlog can take now (0
 * while other sources' marker lines are due, SIZE_MAX once switched off);
 * the bytes held back for the console changed by delta (wake_fd >= 0: the
 * fd a queue console's take posts to ask for more); whether the console
 * took bytes again after a stall (cleared by the call: the held-back lines
 * are then left out); a marker line for lines left out. */
size_t torchmp_console_room(torchmp_console *c, size_t limit);
void torchmp_console_hold(torchmp_console *c, int64_t delta, int wake_fd);
int torchmp_console_take_resumed(torchmp_console *c);
void torchmp_console_skipped(torchmp_console *c, const torchmp_console_source *src, uint64_t lines, uint64_t bytes);

/* A console that takes nothing for this long while bytes wait for it is
 * stalled (default 10 s; <= 0: never). */
void torchmp_consoles_set_stall(int64_t ns);
int64_t torchmp_consoles_stall(void);
/* Whether a write error means the console's reader went away (EPIPE: the
 * reader of a pipe; EIO: a terminal whose master side was closed): such a
 * console is dropped, not a failure.  The one errno set for it; Python asks
 * through _core.console_gone. */
int torchmp_console_gone(int err);
/* Why the console of the launcher's fd 1 or 2 was switched off (ENOSPC,
 * ...), unless its reader went away (EPIPE, EIO); 0 if not.  Read once. */
int torchmp_console_failure(int std_fd);

/* The takers of queue consoles: a counter that moves whenever a queue
 * console gets bytes for its taker (or torchmp_queues_post is called), and a
 * wait (timeout_ns < 0: none) until it is no longer `seen`; 1 if it moved. */
void torchmp_queues_post(void);
uint64_t torchmp_queues_generation(void);
int torchmp_queues_wait(uint64_t seen, int64_t timeout_ns);
/* In a forked child, before any of the above. */
void torchmp_queues_after_fork(void);

/* Wake a loop's wake-up channel (async-signal-safe; loop_thread.c). */
void torchmp_loop_notify_post(int w);

/* ---------------------------------------------------------------------------
 * framer.c: console line framing for one stream.
 *
 * Complete lines go out as prefix + line + newline, each line whole, so lines
 * of different ranks never tear into each other.  What has no newline yet:
 *   - a plain partial line ("Loading...", a "(Pdb) " prompt) goes out as a
 *     line of its own once its oldest byte is TORCHMP_PARTIAL_IDLE_NS old;
 *     its continuation starts a new console line;
 *   - a line holding a carriage return is a progress bar: what follows its
 *     last \r is its current state, shown once it is TORCHMP_PARTIAL_IDLE_NS
 *     old and then at most once per TORCHMP_PROGRESS_INTERVAL_NS per
 *     stream, and the line's final state always;
 *   - a line is cut into pieces of max_line raw bytes (memory stays bounded
 *     whatever the stream), each shown as a terminal would show it: what
 *     follows its last carriage return (trailing ones, as in CRLF, kept);
 *   - torchmp_framer_flush sends the rest at the end of the stream.
 * Times are CLOCK_MONOTONIC nanoseconds passed in by the caller (never 0), so
 * the rules can be tested with a clock of the test's own.
 */
#define TORCHMP_PARTIAL_IDLE_NS (100LL * 1000 * 1000)
#define TORCHMP_PROGRESS_INTERVAL_NS (1000LL * 1000 * 1000)

/* The filters of a stream's filtered copy (duplicate_*_filters): a line
 * goes to the filtered file if it contains any of them (an empty one
 * matches every line). */
typedef struct torchmp_filters {
    size_t count;
    char **data;
    size_t *len;
} torchmp_filters;

typedef struct torchmp_framer {
    const char *prefix;        /* borrowed from the stream */
    size_t prefix_len;
    char *partial;             /* unterminated tail: what counts of the current piece */
    size_t partial_len;
    size_t partial_cap;
    size_t piece_len;          /* raw bytes of the line's current piece (>= partial_len) */
    size_t max_line;
    int timestamps;            /* a UTC time after the prefix of every line */
    int64_t partial_since_ns;  /* arrival of the tail's oldest byte (0: empty tail) */
    int progress;              /* the tail holds a \r: a progress bar */
    int progress_dirty;        /* its current state has not been shown */
    int64_t progress_shown_ns; /* last progress state shown (0: never) */
    uint64_t shown_hash;       /* that state, hashed, while shown_valid (this line) */
    int shown_valid;
    int continued;             /* this line's start is on the console (idle flush) */
    int64_t deadline_ns;       /* out: when torchmp_framer_tick has work (0: never) */
} torchmp_framer;

/* Where framed lines go.  The filtered sink is a file: an fd of -1 is
 * skipped, a write that fails switches it off (fd -1) and keeps the errno. */
typedef struct torchmp_line_sinks {
    char *console_buf;                 /* scratch buffers of scratch_cap bytes (NULL: none) */
    char *filtered_buf;
    size_t scratch_cap;
    torchmp_console *console;          /* NULL: no console copy */
    const torchmp_console_source *source;
    int console_waiting;               /* out: the console has a backlog to pump */
    int *filtered_fd;                  /* NULL or shared per context */
    const torchmp_filters *filters;    /* NULL: no filtered copy */
    int *filtered_errno;
    int64_t realtime_ns;               /* the lines' arrival for timestamps (0: now) */
    /* The bytes fed may end inside a write the worker has not finished, or
     * more of the same arrival follows at once: a due partial line is not
     * shown at feed time but left to the caller's timer, which knows when
     * the rest is past waiting for. */
    int mid_write;
} torchmp_line_sinks;

void torchmp_framer_init(torchmp_framer *f, const char *prefix, size_t prefix_len, size_t max_line);
void torchmp_framer_free(torchmp_framer *f);
/* Frame one chunk that arrived at now_ns; -1 with errno ENOMEM if the tail
 * buffer cannot grow (the chunk is then shown unframed rather than lost). */
int torchmp_framer_feed(torchmp_framer *f, const char *data, size_t len, int64_t now_ns, torchmp_line_sinks *sinks);
/* Show what the time rules say is due at now_ns (see deadline_ns). */
void torchmp_framer_tick(torchmp_framer *f, int64_t now_ns, torchmp_line_sinks *sinks);
/* The end of the stream: show the unterminated tail, if any. */
void torchmp_framer_flush(torchmp_framer *f, torchmp_line_sinks *sinks);
/* Forget the unterminated tail (its bytes are left out). */
void torchmp_framer_discard(torchmp_framer *f);

/* write(2) all of buf, retrying EINTR/partial writes and waiting out EAGAIN.
 * 0 or -1 with errno. */
int torchmp_write_all(int fd, const char *buf, size_t len);

/* ---------------------------------------------------------------------------
 * poller.c
 */
typedef struct torchmp_poller torchmp_poller;

typedef struct {
    void *ptr;
    int readable;      /* POLLIN/EPOLLIN, or HUP/ERR: read until 0 or EAGAIN */
} torchmp_event;

enum torchmp_backend { TORCHMP_BACKEND_EPOLL = 1, TORCHMP_BACKEND_POLL = 2 };

/* A poller of that backend; NULL with errno (ENOSYS: not built in). */
torchmp_poller *torchmp_poller_new(int backend);
void torchmp_poller_free(torchmp_poller *p);
/* Watch fd for readability (HUP/ERR count too) until torchmp_poller_del;
 * ptr comes back in its events.  0, or -1 with errno: EBADF (not an open
 * fd), EEXIST (already watched), ENOMEM; epoll also refuses what it cannot
 * watch (EPERM: a regular file), which poll() reports ready at once. */
int torchmp_poller_add(torchmp_poller *p, int fd, void *ptr);
/* Watch fd for writability (HUP/ERR count too) until torchmp_poller_del. */
int torchmp_poller_add_writable(torchmp_poller *p, int fd, void *ptr);
/* Stop watching fd (to watch it the other way, del then add again).  Call it
 * before closing fd.  0, or -1 with errno ENOENT (not watched). */
int torchmp_poller_del(torchmp_poller *p, int fd);
/* Wait up to timeout_ms (negative: forever); returns the number of events,
 * at most max_events and at most TORCHMP_POLLER_MAX_EVENTS (0 on EINTR or
 * timeout), or -1 with errno (EINVAL: max_events < 1).  More ready fds than
 * that take turns over the following waits. */
#define TORCHMP_POLLER_MAX_EVENTS 256
int torchmp_poller_wait(torchmp_poller *p, torchmp_event *events, int max_events, int timeout_ms);
/* How many fds are watched. */
int torchmp_poller_fd_count(const torchmp_poller *p);
/* The epoll fd (pollable: readable while an event is ready); -1 for poll(). */
int torchmp_poller_fd(const torchmp_poller *p);

/* Wait until fd, other_fd or signal_fd (each ignored if negative) is
 * readable or timeout_ns pass (negative: forever), to the microsecond where
 * the platform allows (ppoll) rather than poll()'s whole milliseconds, which
 * would overshoot a close() timeout.  Returns 0 on timeout, else bit 0 set if
 * fd is readable, bit 1 if other_fd is and bit 2 if signal_fd is; -1 with
 * errno (EINTR included). */
int torchmp_wait_readable(int fd, int other_fd, int signal_fd, int64_t timeout_ns);

/* ---------------------------------------------------------------------------
 * loop_*.c: the I/O thread and worker groups (one group per PContext).
 */
typedef struct torchmp_group torchmp_group;

enum torchmp_stream_mode {
    TORCHMP_STREAM_INHERIT = 0,    /* the launcher's own fd */
    TORCHMP_STREAM_FILE = 1,       /* dup2 of an open file: no loop involvement */
    TORCHMP_STREAM_TEE = 2,        /* a pipe drained by the loop into log + console */
    TORCHMP_STREAM_RETURN = 3     /* the return channel: a pipe drained by the loop into memory */
};

typedef struct {
    int mode;
    int fd;                    /* FILE: the file; TEE: the log file or -1 (borrowed, dup'ed) */
    int console;               /* TEE: the launcher's fd 1 or 2, or -1 (see sink) */
    torchmp_console *sink;     /* TEE: a console of the caller's instead (referenced) */
    const char *prefix;        /* TEE: console prefix (copied) */
    size_t prefix_len;
    int timestamps;            /* TEE: a time on every console line */
    const char *log_path;      /* TEE: named by the console's marker line (copied; NULL: none) */
    size_t backlog_limit;      /* TEE: console backlog bound for this stream, bytes */
    size_t tail_bytes;         /* TEE: keep the last this many bytes for failure reports (0: none) */
    int open_log;              /* FILE, TEE: fd is -1 and log_path is opened when the rank's streams
                                * open (created and checked by the caller before); a FILE one is
                                * closed again once the worker has it, so a launch holds none */
    int follow_log;            /* TEE with open_log: the worker writes its log itself and the loop
                                * follows the file to the console (one inotify fd for them all)
                                * instead of holding a pipe and the log per stream; a pipe where
                                * that cannot be (no inotify, not a regular file, ...) */
} torchmp_stream_spec;

/* Create (or truncate) a worker's log file as an open_log stream will open
 * it: never through a symlink, never blocking on a FIFO, a regular file or
 * a device only (*wrong_type = 1, errno EINVAL, when it is something
 * else).  Closed again.  0, or -1 with errno (loop_streams.c). */
int torchmp_log_create(const char *path, int *wrong_type);

typedef struct {
    torchmp_spawn_args args;   /* child_fds[1..3] are filled in by the loop */
    torchmp_stream_spec out;
    torchmp_stream_spec err;
    torchmp_stream_spec return_channel;  /* RETURN, or INHERIT (none) */
} torchmp_rank_spec;

/* The one rule for who owns a rank's worker-side stream fds, child_fds[1..3]
 * (the worker's stdout, stderr, return channel) as the loop fills them in:
 * the write ends of pipes the loop opened (TEE, RETURN) are the launcher's
 * copies, closed here once the worker has its own (or will never start),
 * else the pipe never sees EOF; FILE targets are the caller's own fds and
 * stay open.  Every slot 1..3 is -1 afterwards.  Only close(2): safe in a
 * forked child. */
void torchmp_rank_close_worker_fds(const torchmp_rank_spec *spec, int *child_fds);

enum torchmp_proc_state {
    TORCHMP_PROC_UNSTARTED = 0,
    TORCHMP_PROC_RUNNING = 1,
    TORCHMP_PROC_EXITED = 2
};

/* What Python reads about one rank (a copy taken under the loop mutex). */
typedef struct {
    int state;
    pid_t pid;
    int wait_status;           /* raw status from wait4 */
    int64_t start_mono_ns;
    int64_t exit_mono_ns;
    int64_t exit_real_ns;
    int64_t utime_ns;
    int64_t stime_ns;
    int64_t maxrss_kb;
    int out_log_errno;         /* first failure writing the log file, 0 if none */
    int err_log_errno;
    int status_lost;           /* reaped elsewhere, or its forkserver died */
} torchmp_proc_info;

/* Which backend the process-wide loop uses (starting it if needed), or -1. */
int torchmp_loop_backend(void);

/* Whether the kernel reaps this process's children at their exit, status
 * and all: SIGCHLD's disposition is SIG_IGN, or has SA_NOCLDWAIT. */
int torchmp_children_reaped_at_exit(void);

/* A group of nprocs ranks.  The filters are copied.  filtered_*_fd are dup'ed
 * (-1: none).  NULL with errno on failure. */
torchmp_group *torchmp_group_new(int nprocs,
                                 const torchmp_filters *out_filters, int filtered_out_fd,
                                 const torchmp_filters *err_filters, int filtered_err_fd);

/* Spawn ranks [0, count) on the loop thread.  Returns the number started; on
 * a failure at rank k returns k with *err filled.  -1 with errno if the loop
 * could not take the request at all. */
int torchmp_group_spawn(torchmp_group *g, torchmp_rank_spec *specs, int count, torchmp_spawn_error *err);

/* Workers forked outside the loop (from Python, or by a forkserver), in one
 * loop round trip per step rather than per rank:
 *
 * prepare opens the streams of ranks [0, count) and returns the worker-side
 * fds in specs[i].args.child_fds (pipe ends the caller closes once the worker
 * has them).  Returns count, or k with *err filled if rank k failed, in which
 * case nothing stays open; -1 with errno if the request was refused.
 *
 * adopt starts watching pids[i] as ranks[i], started at start_ns[i]
 * (CLOCK_MONOTONIC; start_ns NULL or an entry 0: now).  by_forkserver: the
 * pids are a forkserver's children, not ours: their exits arrive as a trailer
 * on their return channels, and they are not ours to kill or reap.  Returns
 * count, or k with *err filled: workers k.. are then killed and reaped
 * (unless by_forkserver) and their streams closed.
 *
 * drop_unstarted closes the streams of every rank never adopted. */
int torchmp_group_prepare(torchmp_group *g, torchmp_rank_spec *specs, int count, torchmp_spawn_error *err);
int torchmp_group_adopt(torchmp_group *g, const int *ranks, const pid_t *pids, const int64_t *start_ns, int count,
                        int by_forkserver, torchmp_spawn_error *err);
int torchmp_group_drop_unstarted(torchmp_group *g);

/* The record a forkserver appends to a worker's return channel once the
 * worker has exited (it is the forkserver's child, not ours).  Native byte
 * order, no padding: torchmp/_forkserver.py packs it with struct, and
 * tests/test_constants.py checks that against this layout (_core exports
 * its size and offsets). */
#define TORCHMP_EXIT_TRAILER_MAGIC "tmpEXIT1"
typedef struct {
    char magic[8];
    int64_t wait_status;
    int64_t utime_ns;
    int64_t stime_ns;
    int64_t maxrss_kb;
} torchmp_exit_trailer;

/* Take the bytes a rank wrote to its return channel (malloc'ed; the caller
 * frees).  *len = 0 and NULL when there are none. */
char *torchmp_group_take_return(torchmp_group *g, int rank, size_t *len);

/* Copy the per-rank state; returns the group's change counter. */
uint64_t torchmp_group_snapshot(torchmp_group *g, torchmp_proc_info *out, int n);

/* What the loop knows of one rank's teed streams (index 0 stdout, 1 stderr),
 * a copy taken under the loop mutex. */
typedef struct {
    int open[2];               /* the pipe is still being drained */
    int64_t last_data_ns[2];   /* CLOCK_MONOTONIC of the last bytes read, 0: none yet */
} torchmp_stream_state;

/* Fill out[0..n) (n is clamped to nprocs). */
void torchmp_group_stream_state(torchmp_group *g, torchmp_stream_state *out, int n);

/* Copy the last bytes stream `which` (0 stdout, 1 stderr) of `rank` carried,
 * oldest first, into buf (at most cap bytes); returns how many. */
size_t torchmp_group_tail(torchmp_group *g, int rank, int which, char *buf, size_t cap);

/* torchmp_group_wait's flags. */
enum {
    /* Sleep through the exits that decide nothing: woken once every rank has
     * exited, or (with TORCHMP_WAIT_FAIL_FAST) one exited with a status
     * other than 0 -- what a context's wait() decides on -- or, for a wait
     * begun with more, when one rank is left (its caller takes in the exits
     * so far, then waits again, watching that rank's exit directly).  Other
     * changes still end the wait if they happened before it began. */
    TORCHMP_WAIT_DECIDED = 1,
    TORCHMP_WAIT_FAIL_FAST = 2
};

/* Sleep until the group's change counter differs from known_version (the
 * one of the caller's last snapshot), torchmp_group_interrupt is called, or
 * timeout_ns pass (negative: forever).  Returns 1 for a change, 0 otherwise
 * (it may return 0 early: compare the clock), -1 with errno (EINTR: a
 * signal; call again).  Any number of threads may wait at once.
 * *watch_exits starts at 1 for each wait and is cleared when watching the
 * workers' exits directly stops paying off; keep it across the calls of one
 * wait.  signal_fd (ignored if negative) is watched too: the fd a signal's
 * arrival is written to, whichever thread took it (CPython's wake-up fd);
 * readable, it ends the wait as EINTR does.  flags: TORCHMP_WAIT_*. */
int torchmp_group_wait(torchmp_group *g, int64_t timeout_ns, uint64_t known_version, int *watch_exits,
                       int signal_fd, int flags);
/* Whether the exits recorded so far decide a context's result (the rule of
 * TORCHMP_WAIT_DECIDED, without the interrupt); *version: the change counter
 * they were read at; *left: the ranks whose exit is not recorded yet. */
int torchmp_group_decided(torchmp_group *g, int fail_fast, uint64_t *version, int *left);
/* Whether child pid has exited, without reaping it: 1 with its wait(2)-style
 * status and rusage filled in (on Linux; zeros elsewhere), 0 if it runs,
 * -1 with errno (ECHILD: not a child, or reaped by somebody else). */
int torchmp_collect_exit(pid_t pid, int *status, int64_t *utime_ns, int64_t *stime_ns, int64_t *maxrss_kb);
/* The same, waiting for the exit: 1, or -1 with errno (EINTR: a signal). */
int torchmp_wait_exit(pid_t pid, int *status, int64_t *utime_ns, int64_t *stime_ns, int64_t *maxrss_kb);

/* Wake every waiter for good (the group is being closed). */
void torchmp_group_interrupt(torchmp_group *g);

/* Signal the process group of every rank whose group id is still pinned: its
 * leader runs, or is a zombie torchmp has not reaped.  A reaped leader's
 * group is never signalled: its id may belong to somebody else by then. */
int torchmp_group_killpg(torchmp_group *g, int sig);
/* The same for the ranks with which[rank] set (NULL: every rank), only those
 * whose leader still runs if only_running; sent[rank] (if not NULL) says
 * which groups got it.  Returns how many, or -1 with errno (the first error;
 * the other ranks were still signalled). */
int torchmp_group_signal(torchmp_group *g, int sig, const unsigned char *which, int only_running,
                         unsigned char *sent);

/* busy[rank] = 1 if rank's process group still has a living process (its
 * leader, or -- the leader exited -- anything else in it).  Returns the
 * number of busy ranks, or -1 with errno. */
int torchmp_group_busy(torchmp_group *g, unsigned char *busy);

/* Whether close() has nothing to stop: 1 when no rank runs and nothing
 * lives on in an exited rank's process group, and (unless_killed) no rank
 * died of SIGKILL; else 0.  torchmp_group_busy and the records' look in
 * one, with no allocation for a small group. */
int torchmp_group_quiet(torchmp_group *g, int unless_killed);

/* torchmp will not signal the group again: reap every exited rank's zombie.
 * Forkserver workers are the forkserver's to reap: up to cap of their pids
 * go to forkserver_pids[] for the caller to hand back; returns their count. */
int torchmp_group_reap(torchmp_group *g, pid_t *forkserver_pids, int cap);

/* Drain what is readable now, flush partial lines and close every stream of
 * the group (grandchildren holding a pipe no longer keep it alive). */
int torchmp_group_finish_streams(torchmp_group *g);

/* Whether finishing the group's streams has anything to do (a stream is a
 * pipe the I/O thread reads): if not, torchmp_group_finish_streams returns
 * at once, and its caller need not let other threads run meanwhile. */
int torchmp_group_has_pipes(const torchmp_group *g);

/* Python no longer references the group; the loop frees it once every rank
 * is reaped and every stream is closed. */
void torchmp_group_release(torchmp_group *g);

/* Whether this process has its I/O thread (started by its first group). */
int torchmp_loop_exists(void);

/* How many groups this process has allocated and not freed yet. */
int torchmp_groups_alive(void);

/* Bytes still waiting for the launcher's fd 1 / fd 2 consoles, held-back
 * ones included (plus one per console whose marker lines are due): 0 once
 * every console caught up; and the bytes they took so far (their progress).
 * fd >= 0: only the console of what fd refers to. */
size_t torchmp_consoles_pending(int fd);
uint64_t torchmp_consoles_shown(int fd);

/* torchmp's own whole lines, to the console of what the launcher's fd (1 or
 * 2) refers to, or to a queue console: written without blocking, after the
 * lines of the workers logged before them.  1 if queued or shown, 0 if left
 * out (the bound), -1 with errno. */
int torchmp_say(torchmp_console *queue, int fd, const char *data, size_t len);

/* ---------------------------------------------------------------------------
 * keeper.c: one process per launcher that SIGKILLs the registered process
 * groups when the launcher dies (the EOF of a pipe only the launcher holds).
 */
/* Slot 0 holds the keeper's pid; slots 1.. hold process-group ids, 0 for a
 * free slot. */
#define TORCHMP_KEEPER_SLOTS 65536
#define TORCHMP_KEEPER_TABLE_BYTES (TORCHMP_KEEPER_SLOTS * sizeof(int32_t))
/* The fds torchmp/_keeper is started with: the read end of the pipe whose
 * EOF is the launcher's death, and the memfd that holds the table. */
#define TORCHMP_KEEPER_PIPE_FD 3
#define TORCHMP_KEEPER_TABLE_FD 4
/* The program to exec the keeper from (NULL: fork it from the launcher);
 * set once at import, before any thread of torchmp's runs. */
int torchmp_keeper_set_helper(const char *path);
int torchmp_keeper_start(void);          /* once per process; 0 or -1 with errno */
void torchmp_keeper_forget(void);        /* in a forked child: let go of the parent's keeper */
pid_t torchmp_keeper_pid(void);          /* 0 if none; settles the start first */
/* Reap the exec'd keeper's middle process if it has exited (block: wait for
 * it), forking a keeper if it left none.  Any thread; keeps errno. */
void torchmp_keeper_settle(int block);
int torchmp_keeper_add(pid_t pgid);      /* a slot (0: not covered); any thread */
/* torchmp_spawn with the child's group in the keeper's table from its
 * setsid() on (the child writes its pid into a slot reserved for it).
 * *slot_out: that slot once the spawn succeeded, 0 if not covered (table
 * full, no keeper) or the spawn failed. */
int torchmp_keeper_spawn(torchmp_spawn_args *a, pid_t *pid_out, int *slot_out, torchmp_spawn_error *err);
void torchmp_keeper_remove(int slot);
/* keeper_watch.c: the keeper's whole life, in a process of its own: waits
 * for the EOF on read_fd, SIGKILLs every group in table, _exits.
 * Async-signal-safe calls only (it may run in a fork of a threaded
 * launcher). */
void torchmp_keeper_watch(int read_fd, const int32_t *table) __attribute__((noreturn));

/* ---------------------------------------------------------------------------
 * procscan.c
 */
/* alive[i] = 1 if a process other than a zombie has process group pgids[i],
 * whose leader (pid pgids[i]) the caller holds as a zombie; one pass over
 * /proc.  Returns how many are alive, -1 with errno. */
int torchmp_pgroups_alive(const pid_t *pgids, int n, unsigned char *alive);
/* 1 if the group of leader pgid (a zombie the caller holds) surely has no
 * other living member, told cheaply: at most span pids were handed out since
 * the leader, and none while looking.  0 otherwise (a member lives, or it
 * would take a longer look: leave the group to torchmp_pgroups_alive).
 * Keeps errno. */
int torchmp_pgroup_surely_empty(pid_t pgid, long span);
/* 1 if pid is gone or a zombie (for workers that are not our children). */
int torchmp_pid_exited(pid_t pid);
/* How many fds this process has open (/proc/self/fd), -1 with errno. */
int torchmp_open_fd_count(void);
/* 1 if n more fds surely fit under the soft RLIMIT_NOFILE without counting
 * the open ones (it is unlimited, or the n numbers below it are free: one
 * poll), 0 if that cannot be told so (count them), -1 with errno. */
#define TORCHMP_FD_ROOM_MAX 256
int torchmp_fd_room(int n);
/* Open what the scans read every time (once per process; errors ignored). */
void torchmp_procscan_init(void);

/* This process's pid without a system call (kept current across fork() by
 * an atfork handler; loop_thread.c).  Not in a vfork child: getpid() there. */
pid_t torchmp_self_pid(void);

/* ---------------------------------------------------------------------------
 * cgroupfs.c
 */
/* 1 or 2 if path is the root directory of a whole cgroup v1 or v2 hierarchy
 * (not a mounted subtree of one), 0 if it is not or cannot be told. */
int torchmp_cgroup_root_version(const char *path);
/* The OOM watch's small files (/proc/self/cgroup, the memory cgroup's
 * counter), each in its slot, read whole through a descriptor kept open
 * across calls: at most size bytes from offset 0, -1 with errno.  Call with
 * the GIL held (one caller at a time). */
#define TORCHMP_KEPT_FILES 2
ssize_t torchmp_read_kept(int slot, const char *path, char *buf, size_t size);
/* Close the kept descriptors (an fd budget that needs them); how many. */
int torchmp_drop_kept_files(void);
/* In a child just forked: close the inherited copies. */
void torchmp_forget_kept_files_after_fork(void);

/* notifier.c, command.c, loop_commands.c: one command outside the worker
 * groups (torchmp.run), and how event loops are woken. */
#include "command.h"

#endif /* TORCHMP_H */
