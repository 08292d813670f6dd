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

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__GNUC__)
#define MHA__PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define MHA__PRINTF(a, b)
#endif

// Sets the thread's last error, logs it, returns status.
mha_status mha__fail(mha_status status, const char *fmt, ...) MHA__PRINTF(2, 3);

// Records what a successful entry point ran (mha_last_impl): the fused
// path with the kernels isa (mha_isa()), or the reference (isa unused).
void mha__set_impl(bool fused, const char *isa, bool bf16);

// Checked arithmetic on sizes: return 0 and set *out on success, 1 on
// overflow (out untouched).
int mha__mul_overflow_i64(int64_t a, int64_t b, int64_t *out);
int mha__mul_overflow_size(size_t a, size_t b, size_t *out);
int mha__add_overflow_size(size_t a, size_t b, size_t *out);

// Every heap allocation of the library goes through these (error.c), so a
// test build can make any one of them fail. mha__malloc, mha__calloc and
// mha__realloc behave as malloc, calloc and realloc (free the result with
// free); mha__alloc is 64-byte aligned (NULL on failure, size 0 ->
// non-NULL), freed with mha__free.
void *mha__malloc(size_t bytes);
void *mha__calloc(size_t n, size_t size);
void *mha__realloc(void *p, size_t bytes);
void *mha__alloc(size_t bytes);
void mha__free(void *p);
// A call's scratch block (64-byte aligned, as mha__alloc), given back with
// mha__scratch_free(p, the same bytes): a block of 1 MiB or more is kept
// for the calling thread's next calls (two per thread, the older replaced
// by a newer one), which take one when it fits and is at most twice the
// need, so that repeated calls (training: a forward and a backward in
// turn) do not map, fault in and zero fresh pages each time. The kept
// blocks are freed when the thread exits or calls mha_release_scratch.
void *mha__scratch_alloc(size_t bytes);
void mha__scratch_free(void *p, size_t bytes);

#ifdef MHA_FAULT_INJECTION
// Test builds only (CMake -DMHA_FAULT_INJECTION=ON). mha__fault_arm(n, 0)
// makes the n-th allocation from now fail (n >= 1; 0 disarms), and with
// sticky != 0 every later one too; it resets both counters.
// mha__fault_count: allocations attempted since arming; mha__fault_failures:
// how many of them were made to fail; mha__fault_site(i): the return
// address of the i-th (0-based, the first 4096) allocation since arming,
// i.e. the library's line that called, NULL past them.
void mha__fault_arm(long n, int sticky);
long mha__fault_count(void);
long mha__fault_failures(void);
const void *mha__fault_site(long i);
#endif

// Formats a shape as "(2, 3, 4)" into buf.
const char *mha__shape_str(char *buf, size_t cap, int ndim, const int64_t *shape);

// Threads and tiles.
//
// Number of threads a parallel region may use (1 without OpenMP).
static inline int mha__max_threads(void) {
#ifdef _OPENMP
    int n = omp_get_max_threads();
    return n > 0 ? n : 1;
#else
    return 1;
#endif
}

// Below this many multiply-adds a forward or backward runs on one thread.
#define MHA__PAR_MIN_WORK 262144.0

// The calling thread's number in its OpenMP team (0 without OpenMP).
static inline int mha__thread_id(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

// End of the tile [i0, i0 + size) clipped to n.
static inline int64_t mha__tile_end(int64_t i0, int64_t size, int64_t n) {
    return i0 + size < n ? i0 + size : n;
}

// Rows of a (d0, F) or (d0, d1, F) view: the product of all but its last
// dim (0 for a 0-dim one).
static inline int64_t mha__rows_of(const mha_tensor *t) {
    int64_t r = t->ndim ? 1 : 0;
    for (int i = 0; i + 1 < t->ndim; i++) r *= t->shape[i];
    return r;
}

#endif  // MHA_INTERNAL_H
