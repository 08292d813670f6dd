// fused_grads.h: the fused backward's gradient reductions (fused_grads.c),
// shared by the module backward's drivers (fused_bwd.c). Internal to the
// fast path. acc: += instead of =.
#ifndef MHA_FUSED_GRADS_H
#define MHA_FUSED_GRADS_H

#include <stdbool.h>
#include <stdint.h>

#include "linear.h"

// *p (+)= v, rounded to float once.
static inline void mha__grad_store(float *p, double v, bool acc) {
    *p = acc ? *p + (float)v : (float)v;
}

// db (O) (+)= colsum(d (R, O), row stride ldd), each column summed in
// double over r in order by one thread.
void mha__col_sums(float *db, bool acc, const float *d, int64_t ldd, int64_t R, int64_t O,
                   int nt);

// dW (O, I) of dt (+)= d^T X and db (O) (+)= colsum(d); bp: packed X; gs:
// GEMM scratch; wf: O I floats for a half dW (fused_grads.c).
void mha__grad_weight(const mha__kernels *kt, void *dW, mha_dtype dt, float *wf, float *db,
                      bool acc, const float *d, int64_t ldd, const float *X, int64_t ldx,
                      int64_t R, int64_t O, int64_t I, float *bp, float *gs, int nt);

// The view's R rows (=, or += when acc) <- tmp (R, I), rows over nt
// threads (fused_grads.c).
void mha__grad_store_rows(mha_tensor *gx, bool acc, float *tmp, int64_t R, int64_t I, int nt);

#endif
