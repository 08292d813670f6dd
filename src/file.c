// file.c: the one way the library writes a file, so that a save never loses
// data. Every writer goes through here: mha_st_writer_save (and so
// mha_module_save and the Python binding's save / save_tensors) and
// mha_file_write, which the CLI uses for its other outputs.
//
// The recipe (POSIX: Linux, macOS):
//   1. a new temporary file in the target's directory, named
//      ".<name>.tmp.<pid>.<n>" (<name> the target's file name, cut to 200
//      bytes; <n> a per-process counter), created with
//      O_CREAT | O_EXCL | O_WRONLY and mode 0666 (so the umask applies:
//      the mode of any newly created file, not the old target's);
//   2. every byte written (pieces of at most 1 MiB, short writes and EINTR
//      continued), then fsync and close, each checked;
//   3. rename over the target (atomic: a reader sees the old file or the
//      new one, never a part of either);
//   4. fsync of the directory, so that the rename survives a crash.
// Any failure in 1-3 (no such directory, permission, the target a
// directory, ENOSPC, EIO, a failing fsync, close or rename) removes the
// temporary file, leaves the old target byte for byte as it was and returns
// MHA_ERR_IO naming the target and the OS error (strerror). A failure in 4
// is reported too, but the new file is then already in place (the message
// says so). A directory that cannot be opened for reading (write-only
// permission), or whose file system refuses fsync on a directory (EINVAL),
// skips step 4.
//
// What it deliberately does not do:
// - Follow a symbolic link: rename replaces the link itself by the new
//   regular file, and the file it pointed to is untouched (a "latest"
//   link to a checkpoint never overwrites that checkpoint).
// - Keep the old file's mode, owner, extended attributes or hard links (the
//   other names of a hard-linked target keep the old contents). A read-only
//   target in a writable directory is replaced, as rename allows.
// - Clean up after a process killed mid-write (SIGKILL, power loss): the
//   target is intact but the temporary file may remain. Its name starts
//   with "." and never equals the target's; such leftovers are safe to
//   delete when no save is running.
#include "file.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

// Names temporary files apart within this process (with O_EXCL, a name
// taken by another process or a leftover is skipped).
static atomic_uint_fast64_t g_tmp_counter;

enum { TMP_NAME_MAX = 200, PIECE = 1 << 20, TMP_TRIES = 1000 };

#ifdef MHA_FAULT_INJECTION
static atomic_int g_io_step, g_io_err;

void mha__fault_io_arm(mha__io_step step, int err) {
    atomic_store(&g_io_err, err);
    atomic_store(&g_io_step, (int)step);
}

// The armed errno when step is the armed one (then disarmed), else 0.
static int io_fault(mha__io_step step) {
    int want = (int)step;
    return atomic_compare_exchange_strong(&g_io_step, &want, 0) ? atomic_load(&g_io_err) : 0;
}
#else
#define io_fault(step) 0
#endif

// Writes all n bytes of p to fd. 0, or errno (EIO for a write of 0 bytes).
static int write_all(int fd, const unsigned char *p, size_t n) {
    while (n) {
        ssize_t w = write(fd, p, n < PIECE ? n : PIECE);
        if (w < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (w == 0) return EIO;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

// fsync of the directory dir (step 4). 0, or errno.
static int sync_dir(const char *dir) {
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return errno == EACCES ? 0 : errno;
    int err = io_fault(MHA__IO_DIR_FSYNC);
    if (!err && fsync(fd) != 0 && errno != EINVAL && errno != EROFS) err = errno;
    close(fd);
    return err;
}

mha_status mha__file_write_parts(const char *path, const mha__file_part *parts, int64_t nparts) {
    if (!path || nparts < 0 || (nparts > 0 && !parts))
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_file_write: NULL path or parts");
    for (int64_t i = 0; i < nparts; i++)
        if (parts[i].nbytes && !parts[i].data)
            return mha__fail(MHA_ERR_INVALID_ARG, "%s: piece %lld of %zu bytes has no data",
                             path, (long long)i, parts[i].nbytes);
    const char *slash = strrchr(path, '/');
    const char *name = slash ? slash + 1 : path;
    if (!*path) return mha__fail(MHA_ERR_IO, "\"\": cannot write: %s", strerror(ENOENT));
    struct stat sb;
    if (!*name || !strcmp(name, ".") || !strcmp(name, "..") ||
        (lstat(path, &sb) == 0 && S_ISDIR(sb.st_mode)))
        return mha__fail(MHA_ERR_IO, "%s: cannot write: %s", path, strerror(EISDIR));

    // "dir/" of the target (empty: the current directory), then the name
    const size_t dlen = slash ? (size_t)(slash - path) + 1 : 0;
    size_t nlen = strlen(name);
    if (nlen > TMP_NAME_MAX) nlen = TMP_NAME_MAX;
    const size_t cap = dlen + nlen + 64;
    char *tmp = mha__malloc(cap);
    char *dir = mha__malloc(dlen + 2);
    if (!tmp || !dir) {
        free(tmp);
        free(dir);
        return mha__fail(MHA_ERR_NOMEM, "%s: out of memory for the temporary file's name", path);
    }
    if (dlen == 0) memcpy(dir, ".", 2);
    else if (dlen == 1) memcpy(dir, "/", 2);
    else {
        memcpy(dir, path, dlen - 1);
        dir[dlen - 1] = '\0';
    }

    // 1. the temporary file
    int fd = -1, err = 0;
    for (int tries = 0; fd < 0 && tries < TMP_TRIES; tries++) {
        unsigned long long n = (unsigned long long)atomic_fetch_add(&g_tmp_counter, 1);
        snprintf(tmp, cap, "%.*s.%.*s.tmp.%ld.%llu", (int)dlen, path, (int)nlen, name,
                 (long)getpid(), n);
        err = io_fault(MHA__IO_OPEN);
        fd = err ? -1 : open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
        if (fd < 0 && !err) err = errno;
        if (fd < 0 && err != EEXIST && err != EINTR) break;
    }
    mha_status st = MHA_OK;
    if (fd < 0) {
        st = mha__fail(MHA_ERR_IO, "%s: cannot create a temporary file in %s: %s", path, dir,
                       strerror(err));
        goto done;
    }

    // 2. every byte, then fsync and close
    for (int64_t i = 0; !err && i < nparts; i++)
        if (!(i == nparts - 1 && (err = io_fault(MHA__IO_WRITE))))
            err = write_all(fd, parts[i].data, parts[i].nbytes);
    const char *what = "write failed";
    if (!err && ((err = io_fault(MHA__IO_FSYNC)) || (fsync(fd) != 0 && (err = errno))))
        what = "fsync failed";
    const int cerr = io_fault(MHA__IO_CLOSE);
    if ((close(fd) != 0 || cerr) && !err) err = cerr ? cerr : errno, what = "close failed";
    if (err) {
        unlink(tmp);
        st = mha__fail(MHA_ERR_IO, "%s: %s: %s (the old file, if any, is unchanged)", path,
                       what, strerror(err));
        goto done;
    }

    // 3. the rename, 4. the directory
    if ((err = io_fault(MHA__IO_RENAME)) || rename(tmp, path) != 0) {
        if (!err) err = errno;
        unlink(tmp);
        st = mha__fail(MHA_ERR_IO, "%s: cannot replace it with the temporary file %s: %s",
                       path, tmp, strerror(err));
        goto done;
    }
    if ((err = sync_dir(dir)))
        st = mha__fail(MHA_ERR_IO,
                       "%s: written and renamed into place, but the fsync of its directory "
                       "%s failed: %s (the new file may not survive a crash)",
                       path, dir, strerror(err));
done:
    free(tmp);
    free(dir);
    return st;
}

mha_status mha_file_write(const char *path, const void *data, size_t nbytes) {
    if (!path || (nbytes && !data))
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_file_write: NULL path or data");
    mha__file_part part = {data, nbytes};
    return mha__file_write_parts(path, &part, 1);
}
