// internal.h: helpers shared by the library's source files. Not installed.
//
// Error reporting: every failing path calls mha__fail(status, fmt, ...),
// which formats the thread's last-error message, calls the log callback and
// returns status, so the idiom is `return mha__fail(MHA_ERR_SHAPE, "...")`.
#ifndef MHA_INTERNAL_H
#define MHA_INTERNAL_H

#include <stdint.h>
#include <stddef.h>

#include "mha.h"

#if defined(__GNUC__)
#define MHA__PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define MHA__PRINTF(a, b)
#endif

// Sets the thread's last error, logs it, returns status.
mha_status mha__fail(mha_status status, const char *fmt, ...) MHA__PRINTF(2, 3);

// Checked arithmetic on sizes: return 0 and set *out on success, 1 on
// overflow (out untouched).
int mha__mul_overflow_i64(int64_t a, int64_t b, int64_t *out);
int mha__mul_overflow_size(size_t a, size_t b, size_t *out);
int mha__add_overflow_size(size_t a, size_t b, size_t *out);

// 64-byte aligned allocation (NULL on failure or size 0 -> non-NULL).
void *mha__alloc(size_t bytes);
void mha__free(void *p);

// Formats a shape as "(2, 3, 4)" into buf.
const char *mha__shape_str(char *buf, size_t cap, int ndim,
                           const int64_t *shape);

#endif  // MHA_INTERNAL_H
