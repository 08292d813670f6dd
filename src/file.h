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

#endif
