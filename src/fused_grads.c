// fused_grads.c: the reductions of the fused backward's parameter and
// input gradients, float32: a weight's gradient dW = d^T X as one GEMM
// (half gradients summed in float32 and rounded once), a bias's column
// sums in double in a fixed order, and dX = d W stored (=, or +=) into a
// view's rows. Each output element is summed by one thread in a fixed
// order, whatever the threads. The drivers that call them are
// fused_bwd.c's (and part.c's); the bf16 compute's products are there too.
#include <stdlib.h>
#include <string.h>

#include "fused.h"
#include "fused_grads.h"
#include "linear.h"


// db (O) (+)= colsum(d (R, O), row stride ldd), each column summed in
// double over r in order by one thread: columns in groups of 64 (the
// independent sums vectorise) over nt threads.
void mha__col_sums(float *db, bool acc, const float *d, int64_t ldd, int64_t R, int64_t O,
                   int nt) {
    const int64_t groups = (O + 63) / 64;
#pragma omp parallel for schedule(dynamic, 1) num_threads(groups > 1 ? nt : 1)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t o0 = g * 64, w = O - o0 < 64 ? O - o0 : 64;
        double s[64] = {0};
        for (int64_t r = 0; r < R; r++) {
            const float *dr = d + r * ldd + o0;
            for (int64_t o = 0; o < w; o++) s[o] += dr[o];
        }
        for (int64_t o = 0; o < w; o++) mha__grad_store(db + o0 + o, s[o], acc);
    }
}

// dW (O, I) (+)= d^T X: d (R, O) row stride ldd, X (R, I) row stride ldx;
// db (O) (+)= colsum(d), summed in double over r in order. bp: packed X;
// gs: GEMM scratch. (d^T is read in place: gemm.h's _tn GEMM.) dW of
// dt F32, or BF16 / F16 (a half gradient module): summed in float32 in
// wf (O I floats; +=: from dW widened) and rounded once (nearest even).
void mha__grad_weight(const mha__kernels *kt, void *dW, mha_dtype dt, float *wf, float *db,
                      bool acc, const float *d, int64_t ldd, const float *X, int64_t ldx,
                      int64_t R, int64_t O, int64_t I, float *bp, float *gs, int nt) {
    const bool half = dt != MHA_F32;
    float *C = half ? wf : dW;
    const mha__mat hw = mha__vmat(dW, dt, 0, 1);
    if (half && acc)
#pragma omp parallel for schedule(static) num_threads(nt)
        for (int64_t o = 0; o < O; o++)
            for (int64_t i = 0; i < I; i++) wf[o * I + i] = (float)mha__ld(hw, 0, o * I + i);
    mha__gemm_pack_rows(kt, bp, X, ldx, R, I, nt);
    mha__gemm_rows_packed_tn(kt, C, I, d, ldd, bp, NULL, O, R, I, acc, nt, gs);
    if (half)
#pragma omp parallel for schedule(static) num_threads(nt)
        for (int64_t o = 0; o < O; o++)
            for (int64_t i = 0; i < I; i++) mha__st(hw, 0, o * I + i, wf[o * I + i]);
    if (db) mha__col_sums(db, acc, d, ldd, R, O, nt);
}

// The view's R rows (=, or += when acc) <- tmp (R, I) (the float32 sum of
// the stored value and tmp's: a float sum of two floats rounds as the
// double one; half: that sum rounded once), rows over nt threads.
void mha__grad_store_rows(mha_tensor *gx, bool acc, float *tmp, int64_t R, int64_t I, int nt) {
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t r = 0; r < R; r++) {
        const mha__mat row = mha__view_row(gx, r);
        float *t = tmp + r * I;
        if (acc && !row.f64)
            for (int64_t c0 = 0; c0 < I; c0 += 256) {  // (row.cs: the feature stride)
                const int64_t n = I - c0 < 256 ? I - c0 : 256;
                float cur[256];
                mha__mat part = row;
                part.p = (char *)row.p + c0 * row.cs * (int64_t)mha_dtype_size(gx->dtype);
                mha__ld_row(cur, part, n);
                for (int64_t i = 0; i < n; i++) t[c0 + i] += cur[i];
            }
        if (acc && row.f64)
            for (int64_t i = 0; i < I; i++) mha__st(row, 0, i, mha__ld(row, 0, i) + t[i]);
        else mha__st_row(row, t, I);
    }
}

// dX (view, rows in the view's order) (+)= d (R, O) W (O, I): straight
// into a float32 view of unit column stride when it overwrites; else
// through tmp (R, I) (a float sum of two floats rounds as the double one).
void mha__grad_input_rows(const mha__kernels *kt, mha_tensor *gx, bool acc, const float *d,
                          int64_t ldd, mha__wmat W, int64_t R, int64_t O, int64_t I,
                          float *tmp, float *bp, float *gs, int nt) {
    int64_t ldx;
    if (mha__rows_direct(gx, &ldx) && !acc) {
        mha__matmul_rows(kt, gx->data, ldx, d, ldd, W, I, R, O, I, bp, gs, nt);
        return;
    }
    mha__matmul_rows(kt, tmp, I, d, ldd, W, I, R, O, I, bp, gs, nt);
    mha__grad_store_rows(gx, acc, tmp, R, I, nt);
}
