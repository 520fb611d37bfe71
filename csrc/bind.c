/*
 * Where a worker runs: its CPU affinity and its memory policy, set in the
 * child between fork and exec (or before a forked worker's function runs),
 * so the worker's first instruction already runs there and every thread it
 * makes inherits it.  No numactl, no extra exec: two raw system calls on
 * masks the parent built.  Async-signal-safe; touches no heap.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "torchmp.h"

#include <errno.h>

#ifdef TORCHMP_HAVE_BINDING
#include <sys/syscall.h>
#include <unistd.h>

/* <numaif.h> (libnuma's header) is not needed for one constant: the value
 * is fixed by the kernel's ABI. */
#define TORCHMP_MPOL_BIND 2
#endif

int torchmp_apply_binding(const torchmp_binding *b)
{
    if (b->cpus == NULL && b->mems == NULL)
        return 0;
#ifdef TORCHMP_HAVE_BINDING
    /* pid 0: the calling thread, which is the whole child (fork copies one
     * thread; a vfork child is a task of its own). */
    if (b->cpus != NULL && syscall(SYS_sched_setaffinity, 0, b->cpus_size, b->cpus) != 0)
        return TORCHMP_STEP_AFFINITY;
    /* The kernel reads maxnode - 1 bits (a historical off-by-one that
     * libnuma compensates for the same way). */
    if (b->mems != NULL && syscall(SYS_set_mempolicy, TORCHMP_MPOL_BIND, b->mems, b->mems_bits + 1) != 0)
        return TORCHMP_STEP_MEMPOLICY;
    return 0;
#else
    errno = ENOSYS;
    return b->cpus != NULL ? TORCHMP_STEP_AFFINITY : TORCHMP_STEP_MEMPOLICY;
#endif
}
