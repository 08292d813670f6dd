// kernels.h: the one kernel contract of the fused path. Every slot has a
// portable C version (generic.c, always built); ISA files (avx2.c,
// avx512.c) overwrite the slots they do better. The table is filled once
// (cpu.c): generic first, then the best ISA the CPU supports, or the one
// MHA_ISA=scalar|avx2|avx512 names.
//
// Contract, for every kernel:
//  - float32, row-major tiles given by pointer + row stride (in elements);
//    no alignment is required; the kernel handles any M, N, K >= 0
//    (partial tiles included) itself.
//  - "overwrite" kernels never read their output first (NaN in it is
//    harmless); "accumulate" kernels add to it.
//  - kernels trust their arguments (checked once, in forward.c) and never
//    allocate, print or use threads.
//  - the order of every sum is fixed by the kernel and the shape alone, so
//    results never depend on the number of threads or on the caller.
#ifndef MHA_KERNELS_H
#define MHA_KERNELS_H

#include <stdint.h>

typedef struct mha__kernels {
    const char *isa;  // "scalar", "avx2", "avx512"

    // gemm_nn: C (M, N) = A (M, K) B (K, N)             overwrite
    //   (B row-major: the "packed" operand, e.g. K^T or W^T)
    void (*gemm_nn)(float *C, int64_t ldc, const float *A, int64_t lda,
                    const float *B, int64_t ldb, int64_t M, int64_t N,
                    int64_t K);
    // gemm_nn_acc: C (M, N) += A (M, K) B (K, N)        accumulate
    void (*gemm_nn_acc)(float *C, int64_t ldc, const float *A, int64_t lda,
                        const float *B, int64_t ldb, int64_t M, int64_t N,
                        int64_t K);
    // softmax_update: one row x (n) of scaled, masked scores, the row's
    // running max *m and sum *l (online softmax):
    //   m' = max(*m, max_j x_j); x_j <- exp(x_j - m')
    //   *l <- *l * exp(*m - m') + sum_j x_j;  *m <- m'
    // returns alpha = exp(*m_old - m') (1 when m' = -inf: nothing seen
    // yet). -inf entries become 0.
    float (*softmax_update)(float *x, int64_t n, float *m, float *l);
    // scale_row: y (n) *= a
    void (*scale_row)(float *y, int64_t n, float a);
    // exp_shift: x_j <- exp(x_j - c) for j < n; -inf gives 0; c = -inf
    // (a fully masked row) gives 0 everywhere.
    void (*exp_shift)(float *x, int64_t n, float c);
} mha__kernels;

// The table chosen for this process (filled on first use, thread-safe).
const mha__kernels *mha__kernels_get(void);
// A table by ISA name ("scalar", "avx2", "avx512"); NULL if this build or
// this CPU lacks it. For tests, which compare every ISA with scalar.
const mha__kernels *mha__kernels_for(const char *isa);

// Per-ISA fillers: each overwrites the slots it implements.
void mha__kernels_fill_generic(mha__kernels *k);
void mha__kernels_fill_avx2(mha__kernels *k);
void mha__kernels_fill_avx512(mha__kernels *k);

#endif
