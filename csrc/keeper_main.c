/*
 * torchmp/_keeper: the program the keeper is exec'd from (keeper.c says
 * why a keeper, keeper_watch.c what it does).
 *
 * Exec'd rather than forked from the launcher: a fork copies the launcher's
 * page tables (milliseconds in a launcher with torch imported, paid in the
 * launcher's own CPU on its first launch), an exec'd program starts from
 * nothing.  The launcher starts it with the pipe's read end on fd 3 and the
 * memfd holding the table on fd 4.  It forks once more, so that the keeper
 * is nobody's child but pid 1's (or the nearest subreaper's), writes the
 * keeper's pid into slot 0 and exits: 0 once the keeper runs, 1 if anything
 * failed (the launcher then forks a keeper of its own).
 *
 * On x86-64 Linux it is built without a C library (keeper_sys.h says why),
 * with its own entry point.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "torchmp.h"
#include "keeper_sys.h"

/* The middle's work; its exit status. */
static int keeper_middle(void)
{
    int32_t *table;
    long keeper;

    /* Started by something other than torchmp: nothing to watch. */
    if (!ks_is_pipe(TORCHMP_KEEPER_PIPE_FD) || ks_fd_size(TORCHMP_KEEPER_TABLE_FD) != (long)TORCHMP_KEEPER_TABLE_BYTES)
        return 2;
    table = ks_map_shared(TORCHMP_KEEPER_TABLE_FD, TORCHMP_KEEPER_TABLE_BYTES);
    if (table == NULL)
        return 1;
    (void)ks_close(TORCHMP_KEEPER_TABLE_FD); /* the mapping stays */
    keeper = ks_fork();
    if (keeper == 0)
        torchmp_keeper_watch(TORCHMP_KEEPER_PIPE_FD, table);
    if (keeper < 0)
        return 1;
    __atomic_store_n(&table[0], (int32_t)keeper, __ATOMIC_RELEASE);
    return 0;
}

#ifdef TORCHMP_KEEPER_FREESTANDING
/* No C library: the entry point is ours.  (Nothing here makes the compiler
 * call memset or memcpy on its own; if it ever does, the link fails and
 * setup.py builds the program with the C library instead.) */
__attribute__((noreturn, used)) void torchmp_keeper_entry(void);
__attribute__((noreturn, used)) void torchmp_keeper_entry(void) { ks_exit(keeper_middle()); }

/* The kernel enters with the stack pointer 16-byte aligned; the call pushes
 * the return address, as the ABI expects at a function's entry. */
__asm__(".text\n"
        ".globl _start\n"
        ".type _start, @function\n"
        "_start:\n"
        "    xor %ebp, %ebp\n"
        "    and $-16, %rsp\n"
        "    call torchmp_keeper_entry\n"
        "    hlt\n");
#else
int main(void) { return keeper_middle(); }
#endif
