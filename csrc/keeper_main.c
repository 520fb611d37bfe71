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
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "torchmp.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

int main(void)
{
    struct stat st;
    int32_t *table;
    pid_t keeper;

    /* Started by something other than torchmp: nothing to watch. */
    if (fstat(TORCHMP_KEEPER_PIPE_FD, &st) != 0 || !S_ISFIFO(st.st_mode) ||
        fstat(TORCHMP_KEEPER_TABLE_FD, &st) != 0 || (size_t)st.st_size != TORCHMP_KEEPER_TABLE_BYTES)
        return 2;
    table = mmap(NULL, TORCHMP_KEEPER_TABLE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, TORCHMP_KEEPER_TABLE_FD, 0);
    if (table == MAP_FAILED)
        return 1;
    (void)close(TORCHMP_KEEPER_TABLE_FD); /* the mapping stays */
    keeper = fork();
    if (keeper == 0)
        torchmp_keeper_watch(TORCHMP_KEEPER_PIPE_FD, table);
    if (keeper < 0)
        return 1;
    __atomic_store_n(&table[0], (int32_t)keeper, __ATOMIC_RELEASE);
    return 0;
}
