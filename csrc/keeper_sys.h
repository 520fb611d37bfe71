/*
 * The system calls of the keeper (keeper_watch.c) and of the program it is
 * exec'd from (keeper_main.c), in one place, two ways:
 *
 * - through the C library: the keeper forked from the launcher (compiled
 *   into the core), and torchmp/_keeper where it cannot be built otherwise;
 * - as bare system calls, with TORCHMP_KEEPER_FREESTANDING (setup.py, on
 *   x86-64 Linux): torchmp/_keeper is then a static program without a C
 *   library.  A launcher's first launch waits for that program to start,
 *   fork the keeper and exit.  Dynamically linked, its start was the
 *   loader's: mapping libc and glibc's probing of the CPU's caches, which
 *   traps to the hypervisor on a VM.  Here that start took a fresh process's
 *   loop start from 1.29 ms to 0.68 ms (docs/profiles.md).
 *
 * Every call returns what the kernel returns: >= 0, or -errno (the C
 * library's wrappers are made to do the same).  Nothing here touches errno,
 * which a freestanding program does not have.
 */
#ifndef TORCHMP_KEEPER_SYS_H
#define TORCHMP_KEEPER_SYS_H

#include <stddef.h>
#include <stdint.h>

#ifdef TORCHMP_KEEPER_FREESTANDING

#if !defined(__x86_64__) || !defined(__linux__)
#error "the freestanding keeper is written for x86-64 Linux"
#endif

/* x86-64 Linux system call numbers (arch/x86/entry/syscalls/syscall_64.tbl). */
#define KS_NR_READ 0
#define KS_NR_CLOSE 3
#define KS_NR_LSEEK 8
#define KS_NR_MMAP 9
#define KS_NR_RT_SIGACTION 13
#define KS_NR_RT_SIGPROCMASK 14
#define KS_NR_CLONE 56
#define KS_NR_EXIT 60
#define KS_NR_KILL 62
#define KS_NR_CHDIR 80
#define KS_NR_SETSID 112
#define KS_NR_PRCTL 157
#define KS_NR_EXIT_GROUP 231
#define KS_NR_CLOSE_RANGE 436

static inline long ks_syscall6(long nr, long a, long b, long c, long d, long e, long f)
{
    long ret;
    register long r10 __asm__("r10") = d;
    register long r8 __asm__("r8") = e;
    register long r9 __asm__("r9") = f;
    __asm__ volatile("syscall"
                     : "=a"(ret)
                     : "a"(nr), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8), "r"(r9)
                     : "rcx", "r11", "memory");
    return ret;
}

#define ks_syscall(nr, a, b, c) ks_syscall6((nr), (long)(a), (long)(b), (long)(c), 0, 0, 0)

/* The kernel's struct sigaction on x86-64: handler, flags, restorer, mask. */
struct ks_sigaction {
    void (*handler)(int);
    unsigned long flags;
    void (*restorer)(void);
    uint64_t mask;
};

static inline long ks_read(int fd, void *buf, size_t len) { return ks_syscall(KS_NR_READ, fd, buf, len); }
static inline long ks_close(int fd) { return ks_syscall(KS_NR_CLOSE, fd, 0, 0); }
static inline long ks_kill(long pid, int sig) { return ks_syscall(KS_NR_KILL, pid, sig, 0); }
static inline long ks_setsid(void) { return ks_syscall(KS_NR_SETSID, 0, 0, 0); }
static inline long ks_chdir(const char *path) { return ks_syscall(KS_NR_CHDIR, path, 0, 0); }
static inline long ks_set_name(const char *name) { return ks_syscall(KS_NR_PRCTL, 15 /* PR_SET_NAME */, name, 0); }
static inline long ks_close_range(unsigned int first, unsigned int last)
{
    return ks_syscall(KS_NR_CLOSE_RANGE, first, last, 0);
}
/* SIG_IGN for sig (no handler: no restorer needed). */
static inline long ks_ignore(int sig)
{
    struct ks_sigaction ign = {(void (*)(int))1, 0, 0, 0};
    return ks_syscall6(KS_NR_RT_SIGACTION, sig, (long)&ign, 0, sizeof(ign.mask), 0, 0);
}
static inline long ks_unblock_all(void)
{
    uint64_t none = 0;
    return ks_syscall6(KS_NR_RT_SIGPROCMASK, 2 /* SIG_SETMASK */, (long)&none, 0, sizeof(none), 0, 0);
}
/* fork(): a clone that shares nothing and reports SIGCHLD. */
static inline long ks_fork(void) { return ks_syscall6(KS_NR_CLONE, 17 /* SIGCHLD */, 0, 0, 0, 0, 0); }
static inline long ks_fd_size(int fd) { return ks_syscall(KS_NR_LSEEK, fd, 0, 2 /* SEEK_END */); }
/* Whether fd is a pipe (or FIFO, or socket): the ones lseek() refuses. */
static inline int ks_is_pipe(int fd) { return ks_syscall(KS_NR_LSEEK, fd, 0, 1 /* SEEK_CUR */) == -29 /* ESPIPE */; }
static inline void *ks_map_shared(int fd, size_t len)
{
    long p = ks_syscall6(KS_NR_MMAP, 0, (long)len, 3 /* PROT_READ|PROT_WRITE */, 1 /* MAP_SHARED */, fd, 0);
    return p < 0 && p > -4096 ? NULL : (void *)p;
}
static inline long ks_interrupted(long ret) { return ret == -4 /* EINTR */ || ret == -11 /* EAGAIN */; }
__attribute__((noreturn)) static inline void ks_exit(int code)
{
    for (;;)
        (void)ks_syscall(KS_NR_EXIT_GROUP, code, 0, 0);
}

#else /* through the C library */

/* (The includer defines _GNU_SOURCE first, and includes torchmp.h for
 * the TORCHMP_HAVE_* of this build: the portable one has neither prctl nor
 * close_range.) */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#ifdef TORCHMP_HAVE_PDEATHSIG
#include <sys/prctl.h>
#endif
#ifdef TORCHMP_HAVE_CLOSE_RANGE
#include <sys/syscall.h>
#ifndef SYS_close_range
#define SYS_close_range 436
#endif
#endif

static inline long ks_ret(long ret) { return ret < 0 ? -errno : ret; }
static inline long ks_read(int fd, void *buf, size_t len) { return ks_ret(read(fd, buf, len)); }
static inline long ks_close(int fd) { return ks_ret(close(fd)); }
static inline long ks_kill(long pid, int sig) { return ks_ret(kill((pid_t)pid, sig)); }
static inline long ks_setsid(void) { return ks_ret(setsid()); }
static inline long ks_chdir(const char *path) { return ks_ret(chdir(path)); }
static inline long ks_set_name(const char *name)
{
#ifdef TORCHMP_HAVE_PDEATHSIG
    return ks_ret(prctl(PR_SET_NAME, (unsigned long)name, 0, 0, 0));
#else
    (void)name;
    return -ENOSYS;
#endif
}
static inline long ks_close_range(unsigned int first, unsigned int last)
{
#ifdef TORCHMP_HAVE_CLOSE_RANGE
    return ks_ret(syscall(SYS_close_range, first, last, 0));
#else
    (void)first;
    (void)last;
    return -ENOSYS;
#endif
}
static inline long ks_ignore(int sig)
{
    struct sigaction ign;
    memset(&ign, 0, sizeof(ign));
    ign.sa_handler = SIG_IGN;
    sigemptyset(&ign.sa_mask);
    return ks_ret(sigaction(sig, &ign, NULL));
}
static inline long ks_unblock_all(void)
{
    sigset_t none;
    sigemptyset(&none);
    return ks_ret(sigprocmask(SIG_SETMASK, &none, NULL));
}
static inline long ks_fork(void) { return ks_ret(fork()); }
static inline long ks_fd_size(int fd) { return ks_ret((long)lseek(fd, 0, SEEK_END)); }
static inline int ks_is_pipe(int fd) { return lseek(fd, 0, SEEK_CUR) < 0 && errno == ESPIPE; }
static inline void *ks_map_shared(int fd, size_t len)
{
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    return p == MAP_FAILED ? NULL : p;
}
static inline long ks_interrupted(long ret) { return ret == -EINTR || ret == -EAGAIN; }
__attribute__((noreturn)) static inline void ks_exit(int code) { _exit(code); }

#endif /* TORCHMP_KEEPER_FREESTANDING */
#endif /* TORCHMP_KEEPER_SYS_H */
