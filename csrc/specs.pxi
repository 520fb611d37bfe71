# Included by _core.pyx (one module; the split is by topic, as the C files):
# Python records -> C specs (rank, stream, filters) and the captured return
# value handed back without a copy.

def create_log(bytes path not None):
    """Create (or truncate) and check a worker's log file the way the core
    opens it when the rank starts (csrc/loop_streams.c), without keeping it
    open.  OSError as open(2) gives it; EINVAL, with wrong_type set on the
    exception, for a path that is neither a regular file nor a device."""
    cdef int wrong_type = 0
    cdef int saved = 0
    cdef const char *c_path = PyBytes_AS_STRING(path)
    with nogil:
        if torchmp_log_create(c_path, &wrong_type) != 0:
            saved = errno
    if saved:
        e = OSError(saved, strerror(saved).decode(), _os.fsdecode(path))
        e.wrong_type = bool(wrong_type)
        raise e


cdef int filters_fill(torchmp_filters *n, list filters, list keep) except -1:
    """A C view of filters (bytes kept alive by keep) for torchmp_group_new,
    which copies them."""
    cdef Py_ssize_t i, count = len(filters)
    n.count = 0
    n.data = <char **>calloc(count if count else 1, sizeof(char *))
    n.len = <size_t *>calloc(count if count else 1, sizeof(size_t))
    if n.data == NULL or n.len == NULL:
        raise MemoryError()
    for i in range(count):
        b = filters[i]
        if not isinstance(b, bytes):
            raise TypeError("filters must be bytes")
        keep.append(b)
        n.data[i] = PyBytes_AS_STRING(b)
        n.len[i] = <size_t>PyBytes_GET_SIZE(b)
        n.count += 1
    return 0


cdef void filters_clear(torchmp_filters *n) noexcept:
    free(n.data)
    free(n.len)
    n.data = NULL
    n.len = NULL
    n.count = 0


# Bounds on the ids a mask may hold: far above any machine (Linux allows 8192
# CPUs and 1024 nodes), far below a mask that would not fit in memory.
cdef enum:
    MAX_CPU_ID = 1 << 20
    MAX_NODE_ID = 1 << 15  # the kernel refuses node masks above PAGE_SIZE * 8 bits


cdef bytes bit_mask(object ids, Py_ssize_t limit, str what):
    """The kernel's bitmap layout (an array of unsigned long, bit n of the
    array set for each n in ids) in a bytes object."""
    cdef Py_ssize_t n, top = -1, nbytes
    cdef Py_ssize_t word_bits = 8 * sizeof(unsigned long)
    cdef unsigned long *words
    ids = tuple(ids)
    for n in ids:
        if not 0 <= n < limit:
            raise ValueError(f"{what} {n} is out of range 0..{limit - 1}")
        if n > top:
            top = n
    nbytes = (top // word_bits + 1) * <Py_ssize_t>sizeof(unsigned long)
    mask = PyBytes_FromStringAndSize(NULL, nbytes)
    words = <unsigned long *>PyBytes_AS_STRING(mask)
    memset(words, 0, <size_t>nbytes)
    for n in ids:
        words[n // word_bits] |= (<unsigned long>1) << (n % word_bits)
    return mask


cdef int binding_fill(torchmp_binding *b, object binding, list keep) except -1:
    """A Binding (cpus, mems: ids; empty leaves that setting inherited) or
    None -> the C masks, kept alive by keep."""
    memset(b, 0, sizeof(torchmp_binding))
    if binding is None:
        return 0
    cpus, mems = binding
    if cpus:
        mask = bit_mask(cpus, MAX_CPU_ID, "CPU")
        keep.append(mask)
        b.cpus = <const unsigned long *>PyBytes_AS_STRING(mask)
        b.cpus_size = <size_t>PyBytes_GET_SIZE(mask)
    if mems:
        mask = bit_mask(mems, MAX_NODE_ID, "NUMA node")
        keep.append(mask)
        b.mems = <const unsigned long *>PyBytes_AS_STRING(mask)
        b.mems_bits = <unsigned long>PyBytes_GET_SIZE(mask) * 8
    return 0


cdef char **cstring_array(list items, list keep) except NULL:
    """A NULL-terminated char* array over bytes objects kept alive by keep."""
    cdef Py_ssize_t i, count = len(items)
    cdef char **arr = <char **>calloc(count + 1, sizeof(char *))
    if arr == NULL:
        raise MemoryError()
    try:
        for i in range(count):
            b = items[i]
            if not isinstance(b, bytes):
                raise TypeError(f"expected bytes, got {type(b).__name__}")
            keep.append(b)
            arr[i] = PyBytes_AS_STRING(b)
    except BaseException:
        free(arr)
        raise
    return arr


cdef int stream_spec_fill(torchmp_stream_spec *s, object spec, list keep) except -1:
    """A StreamSpec (or a plain tuple of its first 4 to 10 fields) -> a C
    stream spec.  console: the launcher's fd 1 or 2, -1 for none, or a
    QueueConsole; log_path: bytes or None; backlog: the console bound; tail:
    how many of the last bytes to keep for Group.tail (0: none); open_log:
    the core opens log_path when the rank starts (fd must be -1); follow_log:
    a TEE one's log is followed, not piped, where it can be."""
    if not isinstance(spec, tuple) or not 4 <= len(spec) <= 10:
        raise TypeError(f"a stream spec is a StreamSpec, got {spec!r}")
    mode, fd, console, prefix = spec[:4]
    s.timestamps = bool(spec[4]) if len(spec) > 4 else 0
    log_path = spec[5] if len(spec) > 5 else None
    s.backlog_limit = <size_t>(spec[6] if len(spec) > 6 else DEFAULT_CONSOLE_BACKLOG)
    s.tail_bytes = <size_t>(spec[7] if len(spec) > 7 else 0)
    s.open_log = bool(spec[8]) if len(spec) > 8 else 0
    s.follow_log = bool(spec[9]) if len(spec) > 9 else 0
    s.mode = mode
    s.fd = fd
    s.sink = NULL
    if isinstance(console, QueueConsole):
        keep.append(console)
        s.sink = (<QueueConsole>console).c
        s.console = -1
    else:
        s.console = console
    if s.open_log and (log_path is None or fd != -1 or mode not in (TORCHMP_STREAM_FILE, TORCHMP_STREAM_TEE)):
        raise ValueError("open_log needs a FILE or TEE stream with a log_path and fd -1")
    if s.follow_log and (mode != TORCHMP_STREAM_TEE or not s.open_log):
        raise ValueError("follow_log needs a TEE stream with open_log")
    if log_path is None:
        s.log_path = NULL
    else:
        keep.append(log_path)
        s.log_path = PyBytes_AS_STRING(log_path)
    if prefix is None:
        s.prefix = NULL
        s.prefix_len = 0
    else:
        keep.append(prefix)
        s.prefix = PyBytes_AS_STRING(prefix)
        s.prefix_len = <size_t>PyBytes_GET_SIZE(prefix)
    return 0


cdef class CaptureBuffer:
    """Bytes the I/O thread read from a return channel, handed to Python
    without a copy: a read-only buffer over the native memory, freed with
    the object.  pickle.loads() reads it directly."""

    cdef char *data
    cdef Py_ssize_t size

    def __dealloc__(self):
        free(self.data)

    def __len__(self):
        return self.size

    def __bytes__(self):
        return PyBytes_FromStringAndSize(self.data, self.size)

    def __getbuffer__(self, Py_buffer *view, int flags):
        PyBuffer_FillInfo(view, self, self.data, self.size, 1, flags)

    def __releasebuffer__(self, Py_buffer *view):
        pass


class SpawnError(OSError):
    """Raised by Group.spawn when rank `rank` could not be started; ranks
    [0, rank) are running and must be terminated by the caller."""
