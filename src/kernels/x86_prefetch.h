// x86_prefetch.h: the decode kernels' prefetching, shared by the AVX2 and
// AVX-512 tables (avx2_decode.c, avx512_decode.c); include after
// <immintrin.h>.
//
// Decode streams the cache's rows from memory: each kernel prefetches the
// rows about PF_BYTES ahead of the ones it reads (prefetch_ahead_at: a
// table's own distance, as avx512_decode.c's for bf16 and f16 rows) (the
// hardware prefetchers stop at page boundaries and ramp up again on every
// chunk the threads take in turn; measured on the Xeon: the 256k-token
// decode 30% faster), and spreads the caller's next rows (pf) over its
// steps.
//
// Into L2 (PF_HINT: prefetcht1), not L1: a prefetch into L1 holds one of
// the core's few line fill buffers until its line arrives from memory,
// and the kernel's own loads then wait for a free one. Measured on a
// Sapphire Rapids Xeon, 262144 tokens, 12 heads d 64, 2 threads, runs
// taking turns: AVX-512 f32 57.8 -> 55.2 ms (91% -> 95% of the read
// bandwidth), bf16 32.8 -> 30.1 (80% -> 87%, with avx512_decode.c's 4096
// bytes ahead); the AVX2 table on the same machine f32 66.2 -> 62.0, bf16
// 50.1 -> 39.5; int4 and the scattered blocks the same or a little faster.
#ifndef MHA_X86_PREFETCH_H
#define MHA_X86_PREFETCH_H

#include <stddef.h>
#include <stdint.h>

#define PF_BYTES 12288
#define PF_HINT _MM_HINT_T1
// Rows of rb bytes about dist bytes ahead: dist / rb rounded to a power
// of two's quotient (a shift: no integer division in the loops, where the
// compiler may not hoist one out of a conditional call; rb a power of two,
// as a row of 64 or 128 elements is, gives the exact quotient).
static inline int64_t pf_rows_at(size_t rb, size_t dist) {
    if (rb >= dist) return 1;
    return (int64_t)(dist >> (63 - __builtin_clzll((unsigned long long)rb)));
}

static inline int64_t pf_rows(size_t rb) { return pf_rows_at(rb, PF_BYTES); }

// Rows j .. j + nr - 1 of rb bytes each, dist bytes ahead, if they exist.
static inline __attribute__((always_inline)) void prefetch_ahead_at(const void *A, size_t rb,
                                                                    size_t dist, int64_t j,
                                                                    int64_t nr, int64_t n) {
    const int64_t ahead = pf_rows_at(rb, dist);
    if (j + ahead + nr > n) return;
    const char *p = (const char *)A + (size_t)(j + ahead) * rb;
    for (size_t b = 0; b < (size_t)nr * rb; b += 64) _mm_prefetch(p + b, PF_HINT);
}

// The same PF_BYTES ahead.
static inline __attribute__((always_inline)) void prefetch_ahead(const void *A, size_t rb,
                                                                 int64_t j, int64_t nr,
                                                                 int64_t n) {
    prefetch_ahead_at(A, rb, PF_BYTES, j, nr, n);
}

// The caller's next rows (pfb bytes at pf, elsewhere: a paged cache's next
// block), prefetched a step at a time while the call reads its own rows
// (spread over the call: a burst would stall on the line fill buffers).
typedef struct pf_spread {
    const char *p, *e;
    size_t step;
} pf_spread;

// (per step: pfb over steps rounded down to a power of two, a shift: a
// decode over 16-token blocks makes hundreds of thousands of calls a step,
// where a division each was measurable)
static inline pf_spread pf_begin(const void *pf, size_t pfb, int64_t steps) {
    const size_t per =
        (pfb >> (steps > 1 ? 63 - __builtin_clzll((unsigned long long)steps) : 0)) + 64;
    return (pf_spread){pf, pf ? (const char *)pf + pfb : NULL, per & ~(size_t)63};
}

static inline __attribute__((always_inline)) void pf_step(pf_spread *f) {
    for (size_t b = 0; b < f->step && f->p < f->e; b += 64, f->p += 64)
        _mm_prefetch(f->p, PF_HINT);
}

static inline void pf_rest(pf_spread *f) {
    for (; f->p < f->e; f->p += 64) _mm_prefetch(f->p, PF_HINT);
}

// Whether a decode call's int8 / int4 scales lie in its rows (each row's
// after its elements, as the paged cache keeps them: the rows' look-ahead
// brings them) rather than in an array of their own.
static inline int scales_in_rows(const void *A, size_t rb, const float *scales) {
    const uintptr_t a = (uintptr_t)A, s = (uintptr_t)scales;
    return s >= a && s < a + rb;
}

// The int8 scales of rows j .. j + 3, sld floats apart (kernels.h).
static inline __attribute__((always_inline)) __m128 scales4(const float *scales, int64_t j,
                                                            int64_t sld) {
    if (sld == 1) return _mm_loadu_ps(scales + j);
    return _mm_setr_ps(scales[j * sld], scales[(j + 1) * sld], scales[(j + 2) * sld],
                       scales[(j + 3) * sld]);
}

// The bytes of an element of kind (0 f32, 1 bf16, 2 f16, 3 int8).
static inline size_t kind_size(int kind) { return kind == 0 ? 4 : kind == 3 ? 1 : 2; }

#endif
