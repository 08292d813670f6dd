// test_save_full.c: saves into a full file system (the atomic writer of
// src/file.c). A 1 MiB tmpfs is mounted in a private mount namespace (root
// or CAP_SYS_ADMIN needed: otherwise the test says "skipped" and exits 77,
// which ctest reports as skipped); on it, a small valid file is the
// target, and
//   - a save larger than the free space fails with MHA_ERR_IO, the message
//     naming the target and "No space left on device", the target's bytes
//     unchanged and no temporary file left (mha_st_writer_save,
//     mha_module_save, mha_file_write);
//   - a save that needs room for the old and the new file at once (the
//     cost of replacing atomically) fails the same way;
//   - a save that fits succeeds and reads back equal, no temporary left.
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifdef __linux__
#include <sched.h>
#include <sys/mount.h>
#endif

#include "check.h"
#include "mha.h"
#include "save_util.h"

#define FS_BYTES (1 << 20)

static char g_dir[512];

// The target and the directory hold exactly the old file: its bytes and
// nothing else (no temporary file).
static void expect_intact(const char *what, const char *path, const unsigned char *old,
                          size_t old_n) {
    int ntmp;
    int n = dir_count(g_dir, "target.safetensors", &ntmp, NULL, 0);
    CHECKF(same_bytes(path, old, old_n), "%s: the old target changed", what);
    CHECKF(n == 1 && ntmp == 0, "%s: %d entries, %d temporary files left in %s", what, n, ntmp,
           g_dir);
}

static void run_cases(void) {
    char path[600];
    snprintf(path, sizeof path, "%s/target.safetensors", g_dir);

    // the old target: a small valid file
    CHECK_OK(save_tensor(path, 256, 1));
    CHECK(reads_back(path, 256, 1));
    size_t old_n;
    unsigned char *old = read_all(path, &old_n);
    CHECK(old != NULL && old_n > 1024);
    printf("  old target: %zu bytes on a %d-byte tmpfs\n", old_n, FS_BYTES);

    // larger than the whole file system
    mha_status st = save_tensor(path, 2 * FS_BYTES / 4, 2);
    printf("  save of %d bytes: %s: %s\n", 2 * FS_BYTES, mha_status_string(st),
           mha_last_error());
    CHECK(st == MHA_ERR_IO);
    CHECKF(error_names(path, "No space left on device"), "message: %s", mha_last_error());
    expect_intact("too large (st writer)", path, old, old_n);

    // the same through mha_module_save: a module of 3 * 512^2 + 512^2 floats (4 MiB)
    mha_config c;
    mha_config_init(&c, 512, 8);
    mha_module *m = NULL;
    CHECK_OK(mha_module_create(&m, &c));
    st = m ? mha_module_save(m, path) : MHA_ERR_INVALID_ARG;
    printf("  mha_module_save of E 512: %s: %s\n", mha_status_string(st), mha_last_error());
    CHECK(st == MHA_ERR_IO);
    CHECKF(error_names(path, "No space left on device"), "message: %s", mha_last_error());
    expect_intact("too large (module)", path, old, old_n);
    mha_module_destroy(m);

    // and mha_file_write
    unsigned char *big = calloc(1, 3 * FS_BYTES / 2);
    CHECK(big != NULL);
    st = big ? mha_file_write(path, big, 3 * FS_BYTES / 2) : MHA_ERR_NOMEM;
    CHECK(st == MHA_ERR_IO);
    CHECKF(error_names(path, "No space left on device"), "message: %s", mha_last_error());
    expect_intact("too large (mha_file_write)", path, old, old_n);

    // an old target of 60% of the space: a new one of 60% fits alone, not
    // beside the old one, which must survive
    const int64_t n60 = (int64_t)(0.6 * FS_BYTES / 4);
    CHECK_OK(save_tensor(path, n60, 3));
    free(old);
    old = read_all(path, &old_n);
    st = save_tensor(path, n60, 4);
    printf("  old %zu bytes, new as large: %s: %s\n", old_n, mha_status_string(st),
           mha_last_error());
    CHECK(st == MHA_ERR_IO);
    CHECKF(error_names(path, "No space left on device"), "message: %s", mha_last_error());
    expect_intact("old and new do not fit together", path, old, old_n);
    CHECK(reads_back(path, n60, 3));

    // a save that fits replaces the target
    const int64_t nfit = FS_BYTES / 4 / 4;  // a quarter of the space
    CHECK_OK(save_tensor(path, nfit, 5));
    CHECK(reads_back(path, nfit, 5));
    int ntmp, n = dir_count(g_dir, "target.safetensors", &ntmp, NULL, 0);
    CHECKF(n == 1 && ntmp == 0, "after the save that fits: %d entries, %d temporary", n, ntmp);
    // and another on top of it
    CHECK_OK(save_tensor(path, nfit, 6));
    CHECK(reads_back(path, nfit, 6));
    n = dir_count(g_dir, "target.safetensors", &ntmp, NULL, 0);
    CHECKF(n == 1 && ntmp == 0, "after the second save: %d entries, %d temporary", n, ntmp);
    free(big);
    free(old);
}

int main(void) {
#ifndef __linux__
    printf("test_save_full: skipped: needs Linux (tmpfs in a mount namespace)\n");
    return 77;
#else
    const char *base = getenv("MHA_TEST_TMPDIR");
    snprintf(g_dir, sizeof g_dir, "%s/save_full_XXXXXX", base ? base : "/tmp");
    if (!mkdtemp(g_dir)) {
        perror("test_save_full: mkdtemp");
        return 1;
    }
    // a private mount namespace (the mount disappears with the process);
    // if that is refused, a plain mount (removed below)
    int ns = unshare(CLONE_NEWNS) == 0 &&
             mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) == 0;
    char opts[64];
    snprintf(opts, sizeof opts, "size=%d,mode=0755", FS_BYTES);
    if (mount("tmpfs", g_dir, "tmpfs", MS_NOSUID | MS_NODEV, opts) != 0) {
        printf("test_save_full: skipped: cannot mount a tmpfs on %s: %s (needs root or "
               "CAP_SYS_ADMIN)\n",
               g_dir, strerror(errno));
        rmdir(g_dir);
        return 77;
    }
    printf("test_save_full: tmpfs (%s) on %s%s\n", opts, g_dir,
           ns ? " in a private mount namespace" : "");
    run_cases();
    if (umount(g_dir) != 0) fprintf(stderr, "umount %s: %s\n", g_dir, strerror(errno));
    rmdir(g_dir);
    return check_summary("test_save_full");
#endif
}
