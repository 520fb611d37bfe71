# Declarations of the C core (csrc/torchmp.h) for Cython.  Kept apart from
# the logic in _core.pyx, uvloop style.
from libc.stdint cimport int32_t, int64_t, uint64_t
from posix.types cimport pid_t


cdef extern from "torchmp.h" nogil:
    enum:
        TORCHMP_STEP_NONE
        TORCHMP_STEP_EXEC
        TORCHMP_STEP_AFFINITY
        TORCHMP_STEP_MEMPOLICY
        TORCHMP_STEP_CHDIR
        TORCHMP_STEP__COUNT

    ctypedef struct torchmp_spawn_error:
        int32_t step
        int32_t errnum

    enum:
        TORCHMP_CHILD_FDS
        TORCHMP_FD_RETURN
        TORCHMP_FD_PAYLOAD

    ctypedef struct torchmp_binding:
        const unsigned long *cpus
        size_t cpus_size
        const unsigned long *mems
        unsigned long mems_bits

    ctypedef struct torchmp_spawn_args:
        const char *path
        char *const *exec_paths
        char *const *argv
        char *const *envp
        const char *cwd
        int child_fds[5]
        const int *keep_fds
        int nkeep
        int use_vfork
        int pdeathsig
        pid_t parent_pid
        long max_fd
        torchmp_binding binding

    const char *torchmp_step_name(int step)
    int torchmp_child_setup(const torchmp_spawn_args *a, int keep_fd, int close_others)
    int torchmp_forkserver_request(int sock, const char *msg, size_t len, const int *fds, int nfds,
                                   int64_t timeout_ns, int64_t *reply)

    ctypedef struct torchmp_filters:
        size_t count
        char **data
        size_t *len

    ctypedef struct torchmp_console:
        pass

    enum:
        TORCHMP_DEFAULT_CONSOLE_BACKLOG

    ctypedef struct torchmp_console_source:
        uint64_t id
        const char *prefix
        size_t prefix_len
        const char *log_path
        size_t limit
        int bounded_by_caller

    torchmp_console *torchmp_console_open_fd(int fd)
    torchmp_console *torchmp_console_new_queue()
    torchmp_console *torchmp_console_ref(torchmp_console *c)
    void torchmp_console_unref(torchmp_console *c)
    int torchmp_console_submit(torchmp_console *c, const torchmp_console_source *src, const char *data, size_t len)
    int torchmp_console_pump(torchmp_console *c)
    char *torchmp_console_take(torchmp_console *c, size_t *len)
    size_t torchmp_console_pending(torchmp_console *c)
    uint64_t torchmp_console_shown(torchmp_console *c)
    int torchmp_console_broken(torchmp_console *c)
    size_t torchmp_consoles_pending(int fd)
    uint64_t torchmp_consoles_shown(int fd)
    int torchmp_say(torchmp_console *queue, int fd, const char *data, size_t len)
    int torchmp_loop_exists()
    int torchmp_groups_alive()
    void torchmp_consoles_set_stall(int64_t ns)
    int torchmp_console_gone(int err)
    int torchmp_console_failure(int std_fd)
    void torchmp_queues_post()
    uint64_t torchmp_queues_generation()
    int torchmp_queues_wait(uint64_t seen, int64_t timeout_ns)
    void torchmp_queues_after_fork()

    ctypedef struct torchmp_framer:
        int timestamps
        int64_t deadline_ns

    ctypedef struct torchmp_line_sinks:
        char *console_buf
        char *filtered_buf
        size_t scratch_cap
        torchmp_console *console
        const torchmp_console_source *source
        int console_waiting
        int *filtered_fd
        const torchmp_filters *filters
        int *filtered_errno
        int64_t realtime_ns
        int mid_write

    void torchmp_framer_init(torchmp_framer *f, const char *prefix, size_t prefix_len, size_t max_line)
    void torchmp_framer_free(torchmp_framer *f)
    int torchmp_framer_feed(torchmp_framer *f, const char *data, size_t len, int64_t now_ns,
                            torchmp_line_sinks *sinks)
    void torchmp_framer_tick(torchmp_framer *f, int64_t now_ns, torchmp_line_sinks *sinks)
    void torchmp_framer_flush(torchmp_framer *f, torchmp_line_sinks *sinks)

    enum:
        TORCHMP_BACKEND_EPOLL
        TORCHMP_BACKEND_POLL

    enum:
        TORCHMP_STREAM_INHERIT
        TORCHMP_STREAM_FILE
        TORCHMP_STREAM_TEE
        TORCHMP_STREAM_RETURN

    ctypedef struct torchmp_stream_spec:
        int mode
        int fd
        int console
        torchmp_console *sink
        const char *prefix
        size_t prefix_len
        int timestamps
        const char *log_path
        size_t backlog_limit
        size_t tail_bytes
        int open_log
        int follow_log

    ctypedef struct torchmp_rank_spec:
        torchmp_spawn_args args
        torchmp_stream_spec out
        torchmp_stream_spec err
        torchmp_stream_spec return_channel

    void torchmp_rank_close_worker_fds(const torchmp_rank_spec *spec, int *child_fds)

    const char *TORCHMP_EXIT_TRAILER_MAGIC
    ctypedef struct torchmp_exit_trailer:
        char magic[8]
        int64_t wait_status
        int64_t utime_ns
        int64_t stime_ns
        int64_t maxrss_kb

    enum:
        TORCHMP_PROC_UNSTARTED
        TORCHMP_PROC_RUNNING
        TORCHMP_PROC_EXITED

    ctypedef struct torchmp_proc_info:
        int state
        pid_t pid
        int wait_status
        int64_t start_mono_ns
        int64_t exit_mono_ns
        int64_t exit_real_ns
        int64_t utime_ns
        int64_t stime_ns
        int64_t maxrss_kb
        int out_log_errno
        int err_log_errno
        int status_lost

    ctypedef struct torchmp_group:
        pass

    int torchmp_loop_backend()
    int torchmp_children_reaped_at_exit()
    torchmp_group *torchmp_group_new(int nprocs,
                                     const torchmp_filters *out_filters, int filtered_out_fd,
                                     const torchmp_filters *err_filters, int filtered_err_fd)
    int torchmp_group_spawn(torchmp_group *g, torchmp_rank_spec *specs, int count, torchmp_spawn_error *err)
    int torchmp_group_prepare(torchmp_group *g, torchmp_rank_spec *specs, int count, torchmp_spawn_error *err)
    int torchmp_group_adopt(torchmp_group *g, const int *ranks, const pid_t *pids, const int64_t *start_ns,
                            int count, int by_forkserver, torchmp_spawn_error *err)
    int torchmp_group_drop_unstarted(torchmp_group *g)
    char *torchmp_group_take_return(torchmp_group *g, int rank, size_t *len)
    uint64_t torchmp_group_snapshot(torchmp_group *g, torchmp_proc_info *out, int n)
    ctypedef struct torchmp_stream_state:
        int open[2]
        int64_t last_data_ns[2]
    void torchmp_group_stream_state(torchmp_group *g, torchmp_stream_state *out, int n)
    size_t torchmp_group_tail(torchmp_group *g, int rank, int which, char *buf, size_t cap)
    int torchmp_group_wait(torchmp_group *g, int64_t timeout_ns, uint64_t known_version, int *watch_exits,
                           int signal_fd, int flags) nogil
    int torchmp_group_decided(torchmp_group *g, int fail_fast, uint64_t *version, int *left)
    enum:
        TORCHMP_WAIT_DECIDED
        TORCHMP_WAIT_FAIL_FAST
    void torchmp_group_interrupt(torchmp_group *g)
    int torchmp_group_killpg(torchmp_group *g, int sig)
    int torchmp_group_signal(torchmp_group *g, int sig, const unsigned char *which, int only_running,
                             unsigned char *sent)
    int torchmp_group_busy(torchmp_group *g, unsigned char *busy)
    int torchmp_group_quiet(torchmp_group *g, int unless_killed)
    int torchmp_group_reap(torchmp_group *g, pid_t *forkserver_pids, int cap)
    int torchmp_collect_exit(pid_t pid, int *status, int64_t *utime_ns, int64_t *stime_ns, int64_t *maxrss_kb)
    int torchmp_keeper_set_helper(const char *path)
    int torchmp_keeper_start()
    void torchmp_keeper_forget()
    pid_t torchmp_keeper_pid()
    void torchmp_keeper_settle(int block) nogil
    int torchmp_pgroups_alive(const pid_t *pgids, int n, unsigned char *alive)
    int torchmp_group_finish_streams(torchmp_group *g)
    int torchmp_group_has_pipes(const torchmp_group *g)
    void torchmp_group_release(torchmp_group *g)

    # notifier.c
    ctypedef struct torchmp_notifier:
        pass
    enum:
        TORCHMP_NOTE_EXITED
        TORCHMP_NOTE_DONE
        TORCHMP_NOTE_CHANGED
    ctypedef struct torchmp_note:
        uint64_t token
        int what
    torchmp_notifier *torchmp_notifier_new()
    void torchmp_notifier_unref(torchmp_notifier *n)
    int torchmp_notifier_fd(const torchmp_notifier *n)
    torchmp_note *torchmp_notifier_take(torchmp_notifier *n, size_t *count, int *overflow)
    int torchmp_group_watch(torchmp_group *g, torchmp_notifier *n, uint64_t token, int flags)
    void torchmp_group_unwatch(torchmp_group *g, torchmp_notifier *n)

    # command.c, loop_commands.c
    ctypedef struct torchmp_command:
        pass
    enum:
        TORCHMP_IO_INHERIT
        TORCHMP_IO_FD
        TORCHMP_IO_PIPE
        TORCHMP_IO_STDOUT
    ctypedef struct torchmp_command_spec:
        torchmp_spawn_args args
        int io[3]
        int fd[3]
        size_t max_output
        int64_t drain_ns
    enum:
        TORCHMP_CMD_EXITED
        TORCHMP_CMD_DONE
        TORCHMP_CMD_REAPED
        TORCHMP_CMD_WATCHED
    enum:
        TORCHMP_UNTIL_EXITED
        TORCHMP_UNTIL_DONE
    ctypedef struct torchmp_command_info:
        pid_t pid
        int state
        int wait_status
        int status_lost
        int64_t start_mono_ns
        int64_t exit_mono_ns
        int64_t utime_ns
        int64_t stime_ns
        int64_t maxrss_kb
    torchmp_command *torchmp_command_start(const torchmp_command_spec *spec, torchmp_spawn_error *err)
    void torchmp_command_release(torchmp_command *c)
    int torchmp_command_wait(torchmp_command *c, int64_t timeout_ns, int until, int signal_fd)
    int torchmp_command_watch(torchmp_command *c, torchmp_notifier *n, uint64_t token)
    void torchmp_command_info_get(torchmp_command *c, torchmp_command_info *out)
    int torchmp_command_killpg(torchmp_command *c, int sig)
    int torchmp_command_busy(torchmp_command *c)
    int torchmp_command_reap(torchmp_command *c)
    int torchmp_command_output(torchmp_command *c, int which, const char **head, size_t *head_len, char **tail,
                               size_t *tail_len, uint64_t *total, int *lost_errno)
    int torchmp_backend_choice()
    void torchmp_procscan_init()
    int torchmp_open_fd_count()
    int torchmp_fd_room(int n)
    pid_t torchmp_self_pid()
    int torchmp_log_create(const char *path, int *wrong_type)
    int torchmp_cgroup_root_version(const char *path)
    int TORCHMP_KEPT_FILES
    Py_ssize_t torchmp_read_kept(int slot, const char *path, char *buf, size_t size)
    int torchmp_drop_kept_files()
    void torchmp_forget_kept_files_after_fork()
