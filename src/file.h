// file.h: the one way the library writes a file (file.c): atomically,
// through a temporary file renamed over the target. Internal: the public
// form is mha_file_write in mha.h.
#ifndef MHA_FILE_H
#define MHA_FILE_H

#include "internal.h"

// One piece of the file's contents, written in order.
typedef struct mha__file_part {
    const void *data;
    size_t nbytes;
} mha__file_part;

// Writes parts[0..nparts) one after the other as the new contents of path,
// atomically (file.c says how). MHA_OK, or MHA_ERR_IO with a message naming
// path and the OS error; on an error the old file at path is as it was
// (except when only the final directory sync failed: the message says so).
mha_status mha__file_write_parts(const char *path, const mha__file_part *parts, int64_t nparts);

// The steps of a save, for the fault injection below.
typedef enum mha__io_step {
    MHA__IO_OPEN = 1,  // the temporary file's open
    MHA__IO_WRITE,     // a write (of the last piece, after the others)
    MHA__IO_FSYNC,
    MHA__IO_CLOSE,
    MHA__IO_RENAME,
    MHA__IO_DIR_FSYNC  // after the rename
} mha__io_step;

#ifdef MHA_FAULT_INJECTION
// Test builds only (CMake -DMHA_FAULT_INJECTION=ON; tests/alloc): the next
// save fails at `step` as if its system call had set errno to err, once
// (step 0 disarms).
void mha__fault_io_arm(mha__io_step step, int err);
#endif

#endif
