/* LD_PRELOAD shim for `mke2fs -d`: e2fsprogs 1.47.0 copies each file's atime and ctime into
 * the image, and a ctime cannot be set from user space. Clamping every time that stat reports
 * to SOURCE_DATE_EPOCH makes the populated filesystem independent of when files were unpacked. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/stat.h>

static time_t sde(void) {
    const char *s = getenv("SOURCE_DATE_EPOCH");
    return s ? (time_t)strtoll(s, NULL, 10) : 0;
}

static void clamp(struct stat *st) {
    time_t t = sde();
    if (!t) return;
    st->st_atim.tv_sec = t; st->st_atim.tv_nsec = 0;
    st->st_ctim.tv_sec = t; st->st_ctim.tv_nsec = 0;
    if (st->st_mtim.tv_sec > t) { st->st_mtim.tv_sec = t; }
    st->st_mtim.tv_nsec = 0;
}

#define WRAP(name, argdecl, args, statp)                           \
    int name argdecl {                                             \
        static int (*real) argdecl;                                \
        if (!real) real = dlsym(RTLD_NEXT, #name);                 \
        int rc = real args;                                        \
        if (rc == 0) clamp(statp);                                 \
        return rc;                                                 \
    }

WRAP(stat, (const char *p, struct stat *st), (p, st), st)
WRAP(lstat, (const char *p, struct stat *st), (p, st), st)
WRAP(fstat, (int fd, struct stat *st), (fd, st), st)
/* On x86_64 struct stat64 has the layout of struct stat. */
WRAP(stat64, (const char *p, struct stat64 *st), (p, st), (struct stat *)st)
WRAP(lstat64, (const char *p, struct stat64 *st), (p, st), (struct stat *)st)
WRAP(fstat64, (int fd, struct stat64 *st), (fd, st), (struct stat *)st)
