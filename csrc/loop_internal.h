/*
 * The I/O loop's private header: the structs the loop_*.c files share and
 * the functions one of them calls in another.  Included by loop_*.c only
 * (first, after _GNU_SOURCE); the loop's public API is in torchmp.h.
 *
 *   loop_streams.c  tee pipes and return channels (open, read, log, keep
 *                   the return channel's bytes, tail, close)
 *   loop_follow.c   teed logs followed instead of piped (one inotify fd,
 *                   each log opened only to read what it gained)
 *   loop_feeds.c    how a stream's lines get to its console: framing,
 *                   holding them back from a console that fell behind and
 *                   catching it up from the log
 *   loop_consoles.c the consoles they are shown on (one entry each, its
 *                   writability watch) and torchmp's own lines
 *   loop_reap.c     a rank's exit: watched (pidfd, SIGCHLD scan, forkserver
 *                   trailer), recorded, waited for, reaped; signalling the
 *                   process groups that exits pin
 *   loop_groups.c   groups: new/free, spawn/prepare/adopt/drop/finish/release
 *                   as commands for the thread, and what Python reads of them
 *   loop_thread.c   the thread: wake-up channels, SIGCHLD, the command queue,
 *                   the poller loop, loop creation (again after a fork)
 *   loop_commands.c torchmp.run's commands the thread watches (command.c has
 *                   the rest of a command: it is started and may be waited
 *                   for outside the thread too)
 *
 * Locking: `mu` guards the command queue and every field Python reads (the
 * rank states).  Streams and the group list belong to the loop thread alone.
 * The GIL serialises the Python-side entry points, including loop creation.
 *
 * What one file calls in another is named torchmp_loop_*; everything else
 * stays static in its file.
 */
#ifndef TORCHMP_LOOP_INTERNAL_H
#define TORCHMP_LOOP_INTERNAL_H

#include "torchmp.h"

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

#ifdef TORCHMP_HAVE_PIDFD
#include <sys/syscall.h>
/* Build hosts with kernel headers older than 5.3 (the manylinux images) do not
 * name it; the number is the same on every architecture (the unified table). */
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#endif

#define READ_CHUNK (1024 * 1024)
#define SCRATCH_SIZE (256 * 1024)
/* A stream that fills its default 64 KiB pipe gets a 1 MiB one, so a chatty
 * worker blocks (and context-switches) 16 times less often.  Pipe memory is
 * a per-user resource (fs/pipe-user-pages-soft: past it, new pipes of every
 * program of the user shrink to one page), so the total is capped. */
#define DEFAULT_PIPE_SIZE (64 * 1024)
#define BUSY_PIPE_SIZE (1024 * 1024)
#define PIPE_GROWTH_BUDGET (16L * 1024 * 1024)
#define MAX_LINE (256 * 1024)
/* Bytes of torchmp's own lines that may wait for held-back feeds, and that
 * a console takes beyond the workers' bound. */
#define OWN_LINES_LIMIT (1024 * 1024)

/* What a watch in the I/O thread's set is: the first int of its pointer.  The
 * pidfds in the exits set point at their torchmp_proc directly. */
enum watch_kind { WATCH_CONTROL = 1, WATCH_STREAM = 2, WATCH_EXITS = 3, WATCH_CONSOLE = 4, WATCH_COMMAND = 5,
                  WATCH_FOLLOW = 6 };

/* A console the loop writes to (console.c): the launcher's fd 1 or 2, one
 * per target and shared by every stream teed there, or a queue console of
 * Python's.  The loop holds back the lines of streams whose console fell
 * behind and catches them up from their logs (loop_consoles.c). */
typedef struct console_entry {
    int kind;                  /* WATCH_CONSOLE: first member, for dispatch */
    torchmp_console *console;
    int users;                 /* feeds writing to it, and the command using it */
    int watched;               /* 1: in the poller for writability (bytes wait);
                                * -1: pumped on a timer instead; 0: idle */
    int watched_fd;            /* the fd registered (the console may close it) */
    struct feed *held_head, *held_tail;   /* feeds held back, in turn */
    int nheld;
    struct said *said_head, *said_tail;   /* torchmp's own lines waiting for them */
    size_t said_bytes;
    torchmp_console_source own;           /* torchmp's own lines, as a source */
    struct console_entry *next;
} console_entry;

/* When bytes of a held-back feed arrived: up to log offset `end`; whether
 * they may end inside a write under way (the live path would have left a due
 * partial line to its timer); and whether that timer would have run after
 * them, and when. */
typedef struct arrival {
    uint64_t end;
    int64_t mono_ns, real_ns;
    int64_t tick_ns;           /* 0: no tick */
    int mid_write;
} arrival;

/* A teed stream as its console sees it: its framing, and -- while the
 * console cannot take its lines -- where in its log the console is.  Owned
 * by its stream; outlives it while lines are held back (an orphan, owned by
 * its console entry's held list). */
typedef struct feed {
    console_entry *entry;
    torchmp_console_source source;        /* prefix and log_path point below */
    char *prefix;
    char *log_path;
    torchmp_framer framer;
    /* The log is the backlog (log_ok): every byte of the stream is in it, at
     * log offsets [.., logged), and it can be read back by path. */
    int log_ok;
    dev_t log_dev;
    ino_t log_ino;
    uint64_t logged;           /* log offset after the stream's last byte */
    uint64_t framed;           /* log offset of the first byte not framed (< logged: held) */
    uint64_t line_end;         /* log offset after the last newline logged */
    uint64_t held_newlines;    /* newlines in [framed, logged) */
    arrival *arrivals;         /* while held: when the bytes after `framed` came */
    size_t arrivals_first, arrivals_len, arrivals_cap;
    int64_t arrival_grain_ns;  /* arrivals closer than this share an entry */
    /* the held bytes' unterminated line, as the live path's timer sees it */
    int64_t held_since_ns;     /* its oldest byte's arrival (0: none, or shown) */
    int held_cr;               /* it holds a \r: a progress bar */
    int held_dirty;            /* bytes came since the last tick */
    int64_t last_tick_ns;
    int held;                  /* on the entry's held list */
    uint64_t flush_at;         /* held: show the tail once framed reaches it (0: no) */
    int64_t flush_real_ns;     /* when that was asked */
    int skip_line;             /* the start of the current line was left out */
    struct stream *stream;     /* NULL once orphaned */
    struct feed *next_held;
} feed;

/* torchmp's own lines for a console with held-back feeds: shown once each
 * of those feeds has reached what it had logged when the lines came. */
typedef struct said {
    struct said *next;
    size_t len;
    int nwait;
    struct { uint64_t id, logged; } *wait;
    char data[];
} said;

typedef struct torchmp_proc torchmp_proc;

/* A stream's place on one of the loop's lists of streams (the timed ones,
 * the followed ones whose log grew; loop thread only): intrusive, so joining
 * and leaving allocate nothing and cost O(1) (loop_streams.c). */
typedef struct stream_link {
    struct stream *prev, *next;
    int on;                    /* on the list */
} stream_link;

typedef struct stream_list {
    struct stream *head, *tail;
    size_t link;               /* offsetof(stream, the member that is its stream_link) */
} stream_list;

typedef struct stream {
    int kind;                  /* WATCH_STREAM: first member, for dispatch */
    int fd;                    /* pipe read end; -1 when not teed or closed */
    int log_fd;                /* -1: none, or switched off after an error */
    int log_errno;
    int which;                 /* STREAM_OUT, STREAM_ERR or STREAM_RET */
    char *prefix;
    torchmp_framer framer;     /* the filtered copy's framing (filters only) */
    feed *feed;                /* TEE with a console */
    stream_link timed;         /* on L->timed while a framer has a deadline */
    /* STREAM_RET, the return channel: the bytes read so far (mu: Python
     * takes them) */
    char *ret_buf;
    size_t ret_len, ret_cap;
    int ret_errno;
    int pipe_grown;            /* bytes of pipe capacity taken from the budget; -1: gave up */
    /* The pipe's capacity, once a read was a page or more (0: not asked);
     * pipe_size_next: what it was grown to, from the read after next on
     * (the next read may hold bytes written before it grew). */
    size_t pipe_size, pipe_size_next;
    uint64_t pipe_read;        /* bytes read from the pipe so far */
    int pipe_last_read_full;   /* the last read emptied a full pipe */
    /* A due partial line that may end inside a write under way waits
     * (loop_streams.c's stream_hold): where in the stream, and until when. */
    uint64_t held_at;
    int64_t held_until;
    /* mu: what failure reports and hang reports read from other threads */
    int open;                  /* the pipe is being drained */
    int64_t last_data_ns;      /* when bytes last came, 0: never */
    char *tail;                /* ring of the last tail_cap bytes (NULL: none kept) */
    size_t tail_cap, tail_len, tail_end;  /* tail_end: where the next byte goes */
    torchmp_proc *proc;
    /* A followed log (loop_follow.c): the worker writes it, the loop reads
     * what it added (by path, from follow_off) when inotify says it grew. */
    int following;             /* 1 while followed (fd is -1) */
    int follow_wd;             /* its inotify watch */
    char *follow_path;
    dev_t follow_dev;
    ino_t follow_ino;
    uint64_t follow_off;       /* bytes read so far */
    stream_link follow_dirty;  /* on L->follow_dirty: bytes may wait */
} stream;

/* The list's ends start empty; link names the member (timed, follow_dirty). */
#define STREAM_LIST_INIT(member) ((stream_list){NULL, NULL, offsetof(stream, member)})

enum { STREAM_OUT = 0, STREAM_ERR = 1, STREAM_RET = 2, STREAM_COUNT = 3 };

struct torchmp_proc {
    int rank;
    int pidfd;
    int by_forkserver;         /* a forkserver's child, not ours: not ours to kill
                                * or reap, its exit comes as a trailer on its
                                * return channel */
    int pid_gone;              /* by_forkserver: its pidfd fired, the trailer
                                * is on its way */
    int exiting;               /* proc_record_exit is running for it */
    int collecting;            /* atomic: a thread is collecting its exit (the
                                * loop thread, or the caller waiting for a group
                                * spawned in place) */
    /* fields below `mu` guards */
    /* Exited but not reaped yet: the zombie (ours, or the forkserver's until
     * Python releases it) pins the pid and so the process group id, which
     * therefore cannot belong to anybody else while torchmp may signal it. */
    int unreaped;
    int keeper_slot;           /* the group's slot in the keeper's table, 0: none */
    torchmp_proc_info info;
    stream streams[STREAM_COUNT];
    torchmp_group *group;
};

struct torchmp_group {
    struct torchmp_loop *loop;
    int nprocs;
    torchmp_proc *procs;
    torchmp_filters filters[2];
    int has_filters[2];
    int filtered_fd[2];
    int filtered_errno[2];
    int console_fd[2];         /* 1 and 2, or -1 once broken for this group */
    int console_errno[2];
    /* Callers sleeping in torchmp_group_wait, each on a wake fd of its own:
     * a shared fd drained by one waiter could hide an exit from another. */
    struct group_waiter *waiters;  /* mu */
    struct group_watcher *watchers;  /* mu: event loops to post to as well */
    int interrupted;           /* mu: torchmp_group_interrupt was called */
    int has_pipes;             /* caller thread: some stream is a pipe the loop drains */
    int spawned_here;          /* caller thread, before any wait: its ranks were
                                * spawned in the caller's thread, and a caller
                                * waiting for them collects their exits itself */
    uint64_t version;          /* mu */
    int exited;                /* mu: ranks whose exit is recorded */
    int failed;                /* mu: of those, the ones whose status is not 0 */
    int released;              /* loop thread */
    int running;               /* atomic: loop thread, and a caller-thread spawn */
    int open_streams;          /* loop thread */
    int linked;                /* loop thread: on L->groups (a caller-thread spawn's group: at release) */
    torchmp_group *next;
};

typedef struct group_waiter {
    int wake_r, wake_w;
    int until_decided;         /* TORCHMP_WAIT_DECIDED: see torchmp_group_wait */
    int fail_fast;             /* TORCHMP_WAIT_FAIL_FAST */
    int can_watch_exits;       /* could poll the exits set itself (a pidfd per rank) */
    int watches_exits;         /* does */
    int wakes_at_one_left;     /* until_decided, begun with more than one rank left:
                                * also woken when one is left */
    pthread_t thread;          /* the waiting thread: an exit it records itself
                                * needs no wake-up sent to it */
    struct group_waiter *next;
} group_waiter;

/* An event loop watching a group (torchmp_group_watch). */
typedef struct group_watcher {
    torchmp_notifier *notifier;
    uint64_t token;
    int until_decided;         /* TORCHMP_WAIT_DECIDED */
    int fail_fast;             /* TORCHMP_WAIT_FAIL_FAST */
    struct group_watcher *next;
} group_watcher;

enum cmd_type {
    CMD_SPAWN = 1, CMD_FINISH = 2, CMD_RELEASE = 3, CMD_PREPARE = 4, CMD_ADOPT = 5, CMD_DROP_UNSTARTED = 6,
    CMD_SAY = 7, CMD_WATCH_COMMAND = 8
};

typedef struct command {
    int type;
    torchmp_group *group;
    struct torchmp_command *cmd;  /* WATCH_COMMAND */
    torchmp_rank_spec *specs;  /* SPAWN, PREPARE */
    int count;
    const int *ranks;          /* ADOPT */
    const pid_t *pids;         /* ADOPT */
    const int64_t *start_ns;   /* ADOPT: CLOCK_MONOTONIC at fork, or NULL for now */
    int by_forkserver;         /* ADOPT */
    torchmp_console *console;  /* SAY: a queue console, or NULL for ... */
    int console_fd;            /* SAY: ... the console of what the launcher's fd is */
    const char *data;          /* SAY */
    size_t len;                /* SAY */
    torchmp_spawn_error err;
    int result;
    int done;
    struct command *next;
} command;

typedef struct torchmp_loop {
    int kind;                  /* WATCH_CONTROL: the wake fd's watch */
    pid_t owner_pid;
    int backend;
    torchmp_poller *poller;
    /* epoll backend: the workers' pidfds, in an epoll set of their own that
     * sits in `poller`.  Waiting callers watch it too, so an exit wakes them
     * together with this thread rather than one wake-up after it. */
    torchmp_poller *exits;
    int exits_kind;            /* WATCH_EXITS: the exits set's watch */
    int wake_r, wake_w;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cmd_done;
    command *cmd_head, *cmd_tail;
    int quiet_queued;          /* atomic: the ranks of the releases queued without a wake-up,
                                * run at the next one */
    torchmp_group *groups;
    char *readbuf;
    long pipe_budget;          /* pipe capacity we may still add to busy streams */
    char *console_scratch;     /* framed console lines are assembled here */
    char *filtered_scratch;
    /* consoles (list changes under mu: Python reads the backlogs) */
    console_entry *consoles;
    int held_feeds;            /* feeds held back, on every console */
    int said_entries;          /* consoles with torchmp's own lines waiting */
    int catch_up_more;         /* catching up was cut short: poll again at once */
    /* streams whose framer has a deadline, and the earliest (a lower bound
     * once streams leave the list: waking early costs one pass) */
    stream_list timed;
    int64_t next_deadline_ns;
    uint64_t stream_serial;
    int consoles_polled;       /* some console waits on a timer, not the poller */
    int use_vfork;
    long max_fd;
    struct torchmp_command *commands;  /* loop thread: the commands it watches */
    struct torchmp_command *commands_done;  /* loop thread: done, let go of after the batch */
    /* followed logs (loop_follow.c): one inotify fd while any is followed */
    int follow_kind;           /* WATCH_FOLLOW: the inotify fd's watch */
    int inotify_fd;
    stream **follow_map;       /* open addressing by watch descriptor */
    size_t follow_map_cap, follow_count;
    stream_list follow_dirty;  /* followed logs that may have bytes to read, in turn */
    int64_t follow_retry_ns;   /* out of fds: read again then (0: not waiting) */
    /* poll backend, while an exit is awaited: the next look at whether the
     * program took SIGCHLD (0: not armed; loop_thread.c) */
    int64_t exit_look_ns;
} torchmp_loop;

/* ---- commands (command.c, loop_commands.c) ------------------------------ */

/* A stream's output, bounded: the first head_limit bytes, then a ring of
 * the last ring_cap bytes after them.  total counts everything read. */
typedef struct {
    char *head;
    size_t head_len, head_cap, head_limit;
    char *ring;
    size_t ring_cap, ring_len, ring_end;  /* ring_end: where the next byte goes */
    uint64_t total;
    int lost_errno;            /* ENOMEM: bytes that should have been kept were not */
} capture;

/* One fd of a command in the loop's poller: which = 0 (its pidfd), 1 or 2
 * (its stdout / stderr pipe). */
typedef struct command_watch {
    int kind;                  /* WATCH_COMMAND: first member, for dispatch */
    int which;
    struct torchmp_command *cmd;
} command_watch;

struct torchmp_command {
    pid_t pid;
    int pidfd;                 /* -1: none (poll backend, portable build) */
    int fd[2];                 /* read ends of the stdout / stderr pipes; -1: none or closed */
    capture cap[2];
    int64_t drain_ns;
    int64_t start_ns, exit_ns, drain_until_ns;
    int status;
    int status_lost;
    int64_t utime_ns, stime_ns, maxrss_kb;
    int keeper_slot;           /* in the keeper's table, 0: none */
    int state;                 /* TORCHMP_CMD_* bits (atomic: read by any thread) */
    int refs;                  /* atomic: the caller's, and the loop's while it watches */
    /* set before the loop watches it, then the loop's */
    torchmp_notifier *notifier;
    uint64_t token;
    int orphan;                /* atomic: nobody waits any more; the loop reaps it */
    int reap_claimed;          /* atomic: whoever sets it first reaps the zombie (exactly once) */
    int loop_linked;           /* loop thread: on L->commands */
    command_watch watch[3];
    command msg;               /* the WATCH_COMMAND hand-over (the loop's reference keeps it) */
    struct torchmp_command *next, *prev;  /* L->commands */
};

/* ---- small helpers ------------------------------------------------------ */

static inline int64_t clock_ns(clockid_t clk)
{
    struct timespec ts;
    clock_gettime(clk, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline void close_fd(int *fd)
{
    if (*fd >= 0) {
        close(*fd);
        *fd = -1;
    }
}

/* ---- loop_thread.c ------------------------------------------------------ */

/* The loop of this process, created on first use (NULL with errno). */
torchmp_loop *torchmp_loop_get(void);
int torchmp_loop_submit(torchmp_loop *L, command *c, int wait_done);
void torchmp_loop_queue_quietly(torchmp_loop *L, command *c, int weight);
int torchmp_loop_notify_open(int *r, int *w);
void torchmp_loop_notify_close(int *r, int *w);

/* ---- loop_streams.c ----------------------------------------------------- */

int torchmp_loop_stream_open(torchmp_loop *L, torchmp_proc *p, int which, const torchmp_stream_spec *spec,
                             int *child_fd);
void torchmp_loop_stream_pump(torchmp_loop *L, stream *s, long limit);
void torchmp_loop_stream_drain_buffered(torchmp_loop *L, stream *s);
void torchmp_loop_stream_close(torchmp_loop *L, stream *s);
void torchmp_loop_stream_free(torchmp_loop *L, stream *s);
int torchmp_loop_stream_tee_init(torchmp_loop *L, stream *s, const torchmp_stream_spec *spec, int feed_fd);
/* Join (at the tail; no-op if on it) or leave one of the loop's stream lists. */
void torchmp_stream_list_append(stream_list *list, stream *s);
void torchmp_stream_list_remove(stream_list *list, stream *s);
void torchmp_loop_streams_tick(torchmp_loop *L);
int torchmp_loop_streams_timeout_ms(torchmp_loop *L);
/* A framer of s may have a deadline now: (re)arm its timer. */
void torchmp_loop_stream_rearm(torchmp_loop *L, stream *s);

/* ---- loop_follow.c ----------------------------------------------------- */

/* Follow a teed stream's log instead of piping it (spec->follow_log): the
 * worker's end (the log, opened for writing) in *child_fd.  0: followed;
 * 1: cannot be followed (nothing opened: use a pipe); -1 with errno. */
int torchmp_loop_follow_open(torchmp_loop *L, stream *s, const torchmp_stream_spec *spec, int *child_fd);
/* The inotify fd is readable. */
void torchmp_loop_follow_event(torchmp_loop *L);
/* Read what the logs that grew have now (a few chunks each a round). */
void torchmp_loop_follow_pump(torchmp_loop *L);
/* Read the log to the size it has now (the worker exited). */
void torchmp_loop_follow_drain(torchmp_loop *L, stream *s);
void torchmp_loop_follow_close(torchmp_loop *L, stream *s);
/* Whether the followed log's bytes so far may end inside a write under
 * way; *at: where (its follow_off). */
int torchmp_loop_follow_mid_write(const stream *s, uint64_t *at);
/* poller timeout for followed logs (-1: none). */
int torchmp_loop_follow_timeout_ms(torchmp_loop *L);
/* The bytes read from a log (or a pipe): to the console, tail, filters. */
void torchmp_loop_stream_consume(torchmp_loop *L, stream *s, const char *data, size_t len);

/* ---- loop_feeds.c -------------------------------------------------------- */

/* The feed of a teed stream with a console (spec->sink or spec->console),
 * log_fd its log (or -1); NULL with errno. */
feed *torchmp_loop_feed_open(torchmp_loop *L, stream *s, const torchmp_stream_spec *spec, int log_fd);
/* Bytes of the stream that arrived at now (already in its log if
 * logged_ok): framed for the console, or held back.  mid_write: they may
 * end inside a write under way (torchmp_line_sinks.mid_write). */
void torchmp_loop_feed_push(torchmp_loop *L, feed *f, const char *data, size_t len, int64_t now, int logged_ok,
                            int mid_write);
/* When the feed's timer has work (0: none), and that work. */
int64_t torchmp_loop_feed_deadline(const feed *f);
void torchmp_loop_feed_tick(torchmp_loop *L, feed *f, int64_t now);
/* Show the unterminated tail (now, or once caught up to here); the stream
 * is freed (the feed goes too, or lives on while held). */
void torchmp_loop_feed_flush(torchmp_loop *L, feed *f);
void torchmp_loop_feed_release(torchmp_loop *L, feed *f);
/* Give held-back feeds what their consoles have room for now. */
void torchmp_loop_catch_up(torchmp_loop *L);

/* ---- loop_consoles.c ---------------------------------------------------- */

/* The entry of the console for what the launcher's fd refers to now, or of
 * a queue console (a use taken: torchmp_loop_entry_maybe_free when done);
 * NULL with errno. */
console_entry *torchmp_loop_entry_for_fd(torchmp_loop *L, int fd);
console_entry *torchmp_loop_entry_for_queue(torchmp_loop *L, torchmp_console *c);
/* Free an entry nobody uses once it has nothing left to show. */
void torchmp_loop_entry_maybe_free(torchmp_loop *L, console_entry *e);
/* After a submit that returned `waiting`: pump, and watch the fd if needed. */
void torchmp_loop_entry_after_submit(torchmp_loop *L, console_entry *e, int waiting);
/* torchmp's own lines whose turn has come (their held feeds caught up). */
void torchmp_loop_said_release(torchmp_loop *L, console_entry *e);
int torchmp_loop_do_say(torchmp_loop *L, command *c);
void torchmp_loop_console_entry_writable(torchmp_loop *L, console_entry *e);
int torchmp_loop_consoles_poll(torchmp_loop *L);

/* ---- loop_reap.c -------------------------------------------------------- */

int torchmp_loop_rank_adopt(torchmp_loop *L, torchmp_proc *p, pid_t pid, int by_forkserver, int64_t start,
                            torchmp_spawn_error *err);
#ifdef TORCHMP_HAVE_PIDFD
int torchmp_loop_rank_adopt_here(torchmp_loop *L, torchmp_proc *p, pid_t pid, int64_t start,
                                 torchmp_spawn_error *err);
#endif
void torchmp_loop_proc_exit_event(torchmp_loop *L, torchmp_proc *p);
void torchmp_loop_proc_forkserver_exit(torchmp_loop *L, torchmp_proc *p, int at_eof);
int torchmp_loop_reap_scan(torchmp_loop *L);
int torchmp_loop_ranks_awaited(const torchmp_loop *L);
void torchmp_loop_proc_reap_locked(torchmp_proc *p);

/* ---- command.c (shared with the loop thread) ----------------------------- */

/* Read what the pipe has now into its capture; 1 bytes read, 0 EOF (the
 * pipe is still open: the caller closes it), -1 nothing (EAGAIN) or an error. */
int torchmp_command_pump(torchmp_command *c, int w, char *scratch, size_t scratch_len);
/* Record the exit if the leader has exited (1), else 0. */
int torchmp_command_collect(torchmp_command *c);
/* Read what the pipe holds now, no more (a writer cannot make it last). */
void torchmp_command_drain_buffered(torchmp_command *c, int w, char *scratch, size_t scratch_len);
/* Close stdout / stderr's read end. */
void torchmp_command_close_pipe(torchmp_command *c, int w);
void torchmp_command_set_state(torchmp_command *c, int bits);
int torchmp_command_state(torchmp_command *c);
/* Reap the exited leader's zombie unless somebody already did or is doing
 * it (exactly once, whichever thread gets there first). */
void torchmp_command_reap_once(torchmp_command *c);
void torchmp_command_unref(torchmp_command *c);

/* ---- loop_commands.c ---------------------------------------------------- */

void torchmp_loop_command_add(torchmp_loop *L, torchmp_command *c);
void torchmp_loop_command_event(torchmp_loop *L, command_watch *w);
int torchmp_loop_commands_scan(torchmp_loop *L);
int torchmp_loop_commands_awaited(torchmp_loop *L);
void torchmp_loop_commands_tick(torchmp_loop *L);
void torchmp_loop_commands_collect(torchmp_loop *L);
int torchmp_loop_commands_timeout_ms(torchmp_loop *L);

/* ---- loop_groups.c ------------------------------------------------------ */

int torchmp_loop_do_spawn(torchmp_loop *L, command *c);
int torchmp_loop_do_prepare(torchmp_loop *L, command *c);
int torchmp_loop_do_adopt(torchmp_loop *L, command *c);
void torchmp_loop_do_finish(torchmp_loop *L, torchmp_group *g);
void torchmp_loop_rank_streams_abort(torchmp_loop *L, torchmp_proc *p);
void torchmp_loop_group_free(torchmp_group *g);
void torchmp_loop_group_release_unlinked(torchmp_loop *L, torchmp_group *g);
void torchmp_loop_collect_groups(torchmp_loop *L);
int torchmp_loop_group_is_ours(torchmp_group *g);

#endif /* TORCHMP_LOOP_INTERNAL_H */
