// test_save_atomic.c: saves never lose data (the atomic writer of
// src/file.c, under mha_st_writer_save, mha_module_save and mha_file_write).
//
//   killed: a child process writing a large file (64 MiB of tensor data;
//     a module of embed_dim 2048 through mha_module_save) is stopped once
//     its temporary file is partly written (checked: it holds fewer bytes
//     than the data), then SIGKILLed. The target is then exactly the old
//     file (or absent when there was none); the killed child's temporary
//     file, which nothing can remove, is there under its own name
//     (".<name>.tmp.<pid>.<n>"), never the target's; the next save works.
//   errors: a nonexistent directory, a target that is a directory, an
//     unwritable directory (as root: in a child that dropped to uid 65534)
//     give MHA_ERR_IO with a message naming the path and the OS error, and
//     leave nothing behind.
//   behaviour: a symbolic link at the target is replaced by the new file
//     (the file it pointed to is untouched); the mode is 0666 less the
//     umask; concurrent saves to one target leave one complete file.
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "mha.h"
#include "save_util.h"

static char g_dir[512];

static const char *in_dir(char *buf, size_t cap, const char *sub, const char *name) {
    snprintf(buf, cap, "%s/%s%s%s", g_dir, sub, *sub ? "/" : "", name);
    return buf;
}

static void make_dir(const char *sub) {
    char p[600];
    in_dir(p, sizeof p, sub, "");
    if (mkdir(p, 0755) != 0 && errno != EEXIST) perror(p);
}

// ---------------------------------------------------------------------------
// Killed mid-write

// What a child saves: `size` floats of seed 9 (st writer) or a module of
// embed_dim `size` (mha_module_save).
typedef mha_status (*save_fn)(const char *path, int64_t size);

static mha_status save_big_tensor(const char *path, int64_t n) {
    return save_tensor(path, n, 9);
}

static mha_status save_big_module(const char *path, int64_t E) {
    mha_config c;
    mha_config_init(&c, E, 8);
    mha_module *m = NULL;
    mha_status st = mha_module_create(&m, &c);
    if (!st) st = mha_module_save(m, path);
    mha_module_destroy(m);
    return st;
}

// Forks a child running fn(path, size), waits for its temporary file in dir
// to hold more than 0 bytes, stops the child, and kills it. Returns 1 when
// the stopped child's temporary file held fewer than data_bytes bytes (so it
// was killed mid-write), 0 when it got further (or finished), -1 on a
// failure of the test itself; *pid_out the child's pid.
static int kill_mid_write(const char *dir, const char *name, save_fn fn, int64_t size,
                          size_t data_bytes, pid_t *pid_out) {
    char path[700];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) _exit(fn(path, size) == MHA_OK ? 0 : 1);
    *pid_out = pid;
    char tmp[300], tpath[1100];
    int caught = 0, ws = 0, ntmp, reaped = 0;
    off_t seen = 0, at_stop = -1;
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long polls = 0;; polls++) {
        dir_count(dir, name, &ntmp, tmp, sizeof tmp);
        struct stat sb;
        snprintf(tpath, sizeof tpath, "%s/%s", dir, tmp);
        if (ntmp && stat(tpath, &sb) == 0 && sb.st_size > 0) {
            seen = sb.st_size;
            kill(pid, SIGSTOP);
            if (waitpid(pid, &ws, WUNTRACED) == pid) {
                if (WIFSTOPPED(ws)) {
                    at_stop = stat(tpath, &sb) == 0 ? sb.st_size : -1;
                    caught = at_stop > 0 && (size_t)at_stop < data_bytes;
                } else {
                    reaped = 1;  // it finished before the stop
                }
            }
            break;
        }
        if (waitpid(pid, &ws, WNOHANG) == pid) {  // finished first
            reaped = 1;
            break;
        }
        clock_gettime(CLOCK_MONOTONIC, &t);
        if (t.tv_sec - t0.tv_sec > 120) break;  // (then a failure below)
        if (polls % 1000 == 999) nanosleep(&(struct timespec){0, 100000}, NULL);
    }
    kill(pid, SIGKILL);
    if (!reaped) {
        waitpid(pid, &ws, 0);
        CHECKF(WIFSIGNALED(ws) && WTERMSIG(ws) == SIGKILL, "child %ld: not killed (status %d)",
               (long)pid, ws);
    }
    printf("    child %ld: temporary file seen at %lld bytes, %lld when stopped (of %zu "
           "bytes of data): %s\n",
           (long)pid, (long long)seen, (long long)at_stop, data_bytes,
           caught ? "killed mid-write" : "not caught mid-write");
    return caught;
}

// The kill case in a fresh subdirectory sub: with an old file written by
// fn(path, old_size) (or none when old_size is 0), a child writing
// fn(path, size) is killed mid-write (tries larger sizes if it was too
// fast); then the target is the old file, the leftover is the child's own.
static void kill_case(const char *what, const char *sub, save_fn fn, int64_t old_size,
                      int64_t size, size_t data_bytes) {
    make_dir(sub);
    char dir[600], path[700];
    in_dir(dir, sizeof dir, sub, "");
    dir[strlen(dir) - 1] = '\0';  // no trailing slash
    const char *name = "model.safetensors";
    snprintf(path, sizeof path, "%s/%s", dir, name);
    unsigned char *old = NULL;
    size_t old_n = 0;
    if (old_size) {
        CHECK_OK(fn(path, old_size));
        old = read_all(path, &old_n);
        CHECK(old != NULL);
    }
    printf("  %s: old target %s (%zu bytes)\n", what, old_size ? "present" : "absent", old_n);
    int caught = 0;
    pid_t pid = 0;
    for (int attempt = 0; attempt < 4 && !caught; attempt++) {
        caught = kill_mid_write(dir, name, fn, size, data_bytes, &pid);
        if (caught < 0) break;
        if (caught) break;
        // too fast: the target is still old or complete and new; clean up, grow
        char tmp[300], tpath[1100];
        int ntmp;
        while (dir_count(dir, name, &ntmp, tmp, sizeof tmp) >= 0 && ntmp) {
            snprintf(tpath, sizeof tpath, "%s/%s", dir, tmp);
            unlink(tpath);
        }
        if (old_size) {
            CHECK_OK(fn(path, old_size));
            free(old);
            old = read_all(path, &old_n);
        } else {
            unlink(path);
        }
        size = fn == save_big_module ? size * 3 / 2 : size * 2;
        data_bytes = fn == save_big_module ? data_bytes * 9 / 4 : data_bytes * 2;
    }
    CHECKF(caught == 1, "%s: the child was never stopped mid-write", what);
    // the target: the old bytes, or still absent
    struct stat sb;
    if (old_size) CHECKF(same_bytes(path, old, old_n), "%s: the old target changed", what);
    else CHECKF(lstat(path, &sb) != 0 && errno == ENOENT, "%s: a target appeared", what);
    // the leftover: the killed child's temporary file, under its own name
    char tmp[300], want[400];
    int ntmp, n = dir_count(dir, name, &ntmp, tmp, sizeof tmp);
    snprintf(want, sizeof want, ".%s.tmp.%ld.", name, (long)pid);
    printf("    after the kill: %d entries; leftover \"%s\"\n", n, tmp);
    CHECKF(ntmp == 1 && n == (old_size ? 2 : 1), "%s: %d entries, %d temporary", what, n, ntmp);
    CHECKF(strcmp(tmp, name) != 0 && strncmp(tmp, want, strlen(want)) == 0,
           "%s: leftover \"%s\" (want a name starting \"%s\")", what, tmp, want);
    char tpath[1100];
    snprintf(tpath, sizeof tpath, "%s/%s", dir, tmp);
    unlink(tpath);
    // the next save works and leaves nothing else
    CHECK_OK(fn(path, old_size ? old_size : 4));
    n = dir_count(dir, name, &ntmp, NULL, 0);
    CHECKF(n == 1 && ntmp == 0, "%s: after the next save %d entries, %d temporary", what, n,
           ntmp);
    unlink(path);
    free(old);
}

static void test_killed(void) {
    printf("killed mid-write:\n");
    const int64_t n = 16 << 20;  // 64 MiB of F32
    kill_case("st writer, old target", "kill_old", save_big_tensor, 1000, n, 4 * (size_t)n);
    kill_case("st writer, no target", "kill_none", save_big_tensor, 0, n, 4 * (size_t)n);
    // E 2048: in_proj 3 E^2 + out_proj E^2 floats = 64 MiB
    const int64_t E = 2048;
    kill_case("mha_module_save, old target", "kill_module", save_big_module, 8, E,
              4 * (size_t)(4 * E * E));
    // the old module still loads as itself
    char path[700];
    in_dir(path, sizeof path, "kill_module", "small.safetensors");
    CHECK_OK(save_big_module(path, 8));
    mha_st_file *f = NULL;
    mha_module *m = NULL;
    CHECK_OK(mha_st_open(&f, path));
    if (f) CHECK_OK(mha_module_load(&m, f, NULL));
    CHECK(m && mha_module_config(m)->embed_dim == 8);
    mha_module_destroy(m);
    mha_st_close(f);
    unlink(path);
}

// ---------------------------------------------------------------------------
// Errors

static void expect_io(const char *what, mha_status st, const char *path, const char *oserr) {
    printf("  %s: %s: %s\n", what, mha_status_string(st), mha_last_error());
    CHECKF(st == MHA_ERR_IO, "%s: %s", what, mha_status_string(st));
    CHECKF(error_names(path, oserr), "%s: the message does not name %s and \"%s\": %s", what,
           path, oserr, mha_last_error());
}

static void test_errors(void) {
    printf("errors:\n");
    make_dir("err");
    char dir[600], path[700];
    in_dir(dir, sizeof dir, "err", "");
    int ntmp, n0 = dir_count(dir, NULL, &ntmp, NULL, 0);

    in_dir(path, sizeof path, "err", "nowhere/x.safetensors");
    expect_io("nonexistent directory", save_tensor(path, 10, 1), path,
              "No such file or directory");
    expect_io("nonexistent directory (mha_file_write)", mha_file_write(path, "x", 1), path,
              "No such file or directory");

    in_dir(path, sizeof path, "err", "adir");
    make_dir("err/adir");
    expect_io("target is a directory", save_tensor(path, 10, 1), path, "Is a directory");
    char mpath[800];
    mha_config c;
    mha_config_init(&c, 8, 2);
    mha_module *m = NULL;
    CHECK_OK(mha_module_create(&m, &c));
    expect_io("target is a directory (mha_module_save)", mha_module_save(m, path), path,
              "Is a directory");
    snprintf(mpath, sizeof mpath, "%s/", path);
    expect_io("path ends in /", save_tensor(mpath, 10, 1), mpath, "Is a directory");
    int na, n_adir = dir_count(path, NULL, &na, NULL, 0);
    CHECKF(n_adir == 0, "the target directory got %d entries", n_adir);
    expect_io("empty path", mha_file_write("", "x", 1), "", "No such file or directory");

    // unwritable: a 0555 directory holding an old file
    make_dir("err/ro");
    in_dir(path, sizeof path, "err/ro", "old.safetensors");
    CHECK_OK(save_tensor(path, 10, 1));
    size_t old_n;
    unsigned char *old = read_all(path, &old_n);
    in_dir(mpath, sizeof mpath, "err", "ro");
    CHECK(chmod(mpath, 0555) == 0);
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        // root writes anywhere: drop to nobody first
        if (geteuid() == 0 && (setgid(65534) != 0 || setuid(65534) != 0)) _exit(77);
        struct stat sb;
        if (stat(path, &sb) != 0) _exit(3);  // the directory must be reachable
        mha_status st = save_tensor(path, 10, 2);
        int named = error_names(path, "Permission denied");
        printf("  unwritable directory (uid %ld): %s: %s\n", (long)getuid(),
               mha_status_string(st), mha_last_error());
        mha_status st2 = mha_module_save(m, path);
        int named2 = error_names(path, "Permission denied");
        fflush(stdout);
        _exit(st == MHA_ERR_IO && named && st2 == MHA_ERR_IO && named2 ? 0 : 4);
    }
    int ws = 0;
    waitpid(pid, &ws, 0);
    const char *ci = getenv("CI");
    if (WIFEXITED(ws) && WEXITSTATUS(ws) == 77 && !(ci && strcmp(ci, "true") == 0))
        printf("  unwritable directory: skipped (cannot drop root privileges)\n");
    else if (WIFEXITED(ws) && WEXITSTATUS(ws) == 77)
        CHECKF(0, "unwritable directory: cannot drop root privileges (a skip: under CI=true, "
                  "a failure)");
    else
        CHECKF(WIFEXITED(ws) && WEXITSTATUS(ws) == 0,
               "unwritable directory: the child's checks failed (status %d)", ws);
    CHECK(same_bytes(path, old, old_n));
    int nro = dir_count(mpath, NULL, &ntmp, NULL, 0);
    CHECKF(nro == 1, "the unwritable directory holds %d entries", nro);
    chmod(mpath, 0755);
    free(old);
    mha_module_destroy(m);

    CHECK_FAILS(mha_file_write(NULL, "x", 1), MHA_ERR_INVALID_ARG);
    CHECK_FAILS(mha_file_write(path, NULL, 1), MHA_ERR_INVALID_ARG);
    int n1 = dir_count(dir, NULL, &ntmp, NULL, 0);
    CHECKF(n1 == n0 + 2, "err/: %d entries, want %d (adir, ro)", n1, n0 + 2);
}

// ---------------------------------------------------------------------------
// Symbolic links, mode, concurrent saves

static void test_behaviour(void) {
    printf("behaviour:\n");
    make_dir("beh");
    char real[700], link[700];
    in_dir(real, sizeof real, "beh", "real.safetensors");
    in_dir(link, sizeof link, "beh", "link.safetensors");
    CHECK_OK(save_tensor(real, 100, 1));
    size_t real_n;
    unsigned char *real_b = read_all(real, &real_n);
    unlink(link);
    CHECK(symlink("real.safetensors", link) == 0);
    CHECK_OK(save_tensor(link, 50, 2));
    struct stat sb;
    CHECKF(lstat(link, &sb) == 0 && S_ISREG(sb.st_mode),
           "the link was not replaced by a regular file");
    CHECK(reads_back(link, 50, 2));
    CHECKF(same_bytes(real, real_b, real_n), "the link's old target changed");
    printf("  symlink: replaced by the new file, the file it pointed to unchanged\n");
    free(real_b);

    // mode: 0666 less the umask (also when replacing a file of another mode)
    mode_t um = umask(077);
    CHECK(chmod(real, 0640) == 0);
    CHECK_OK(mha_file_write(real, "abc", 3));
    CHECKF(stat(real, &sb) == 0 && (sb.st_mode & 0777) == 0600, "mode %o under umask 077",
           (unsigned)(sb.st_mode & 0777));
    umask(022);
    CHECK_OK(mha_file_write(real, "", 0));
    CHECKF(stat(real, &sb) == 0 && (sb.st_mode & 0777) == 0644 && sb.st_size == 0,
           "mode %o under umask 022, size %lld", (unsigned)(sb.st_mode & 0777),
           (long long)sb.st_size);
    umask(um);
    CHECK(same_bytes(real, (const unsigned char *)"", 0));

    // 4 processes x 5 saves of distinct seeds to one target: one complete file
    char path[700];
    in_dir(path, sizeof path, "beh", "shared.safetensors");
    fflush(NULL);
    pid_t pids[4];
    for (int p = 0; p < 4; p++) {
        pids[p] = fork();
        if (pids[p] == 0) {
            int bad = 0;
            for (int k = 0; k < 5; k++) bad |= save_tensor(path, 20000, 100 + 10 * p + k) != 0;
            _exit(bad);
        }
    }
    int all_ok = 1;
    for (int p = 0; p < 4; p++) {
        int ws = 0;
        waitpid(pids[p], &ws, 0);
        all_ok &= WIFEXITED(ws) && WEXITSTATUS(ws) == 0;
    }
    CHECK(all_ok);
    int which = -1;
    for (int p = 0; p < 4; p++)
        for (int k = 0; k < 5; k++)
            if (reads_back(path, 20000, 100 + 10 * p + k)) which = 10 * p + k;
    CHECKF(which >= 0, "after concurrent saves the target is none of the files written");
    char bdir[600];
    in_dir(bdir, sizeof bdir, "beh", "");
    int ntmp, n = dir_count(bdir, "shared.safetensors", &ntmp, NULL, 0);
    CHECKF(n == 3 && ntmp == 0, "beh/: %d entries, %d temporary", n, ntmp);
    printf("  concurrent saves: the target is writer %d's file %d, no temporary left\n",
           which / 10, which % 10);
}

int main(void) {
    const char *base = getenv("MHA_TEST_TMPDIR");
    snprintf(g_dir, sizeof g_dir, "%s/save_atomic_XXXXXX", base ? base : "/tmp");
    if (!mkdtemp(g_dir)) {
        perror("test_save_atomic: mkdtemp");
        return 1;
    }
    chmod(g_dir, 0755);  // reachable by the unprivileged child of test_errors
    test_errors();
    test_behaviour();
    test_killed();
    int rc = check_summary("test_save_atomic");
    if (!rc) {  // the scratch directory, when everything passed
        char cmd[700];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
        if (system(cmd) != 0) fprintf(stderr, "cannot remove %s\n", g_dir);
    }
    return rc;
}
