// gemm.h: the threaded packed-B GEMM of the projections, over the kernel
// table's pack_b / gemm_packed (kernels/kernels.h has the contract and the
// sum order). Typical use, for C (R, O) = X (R, I) W^T + b with a PyTorch
// weight W (O, I):
//   float *Bp = ...mha__gemm_packed_b_floats(kt, I, O) floats...;
//   float *sc = ...mha__gemm_scratch_floats(kt, nt) floats...;
//   mha__gemm_pack_wt(kt, Bp, W, O, I, nt);
//   mha__gemm_rows_packed(kt, C, ldc, X, ldx, Bp, b, R, I, O, false, nt, sc);
// Results are bit-identical for every nt and every row split; with the
// AVX2/AVX-512 tables they are also bit-identical to gemm_nn followed by
// C += b (the path this replaces).
#ifndef MHA_GEMM_H
#define MHA_GEMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/kernels.h"

// Floats of the packed form of a (K, N) B for table kt.
size_t mha__gemm_packed_b_floats(const mha__kernels *kt, int64_t K, int64_t N);
// Floats of the scratch mha__gemm_rows_packed needs for nt threads (all of
// them together: nt slices of mha__gemm_thread_scratch_floats).
size_t mha__gemm_thread_scratch_floats(const mha__kernels *kt);
size_t mha__gemm_scratch_floats(const mha__kernels *kt, int nt);

// Bp <- B (K, N), B(k, n) = B[k*sk + n*sn], column panels over nt threads.
void mha__gemm_pack_b(const mha__kernels *kt, float *Bp, const float *B, int64_t sk,
                      int64_t sn, int64_t K, int64_t N, int nt);
// Bp <- W^T for a row-major W (O, I): B (K = I, N = O). Replaces
// transpose(WT, W, O, I).
void mha__gemm_pack_wt(const mha__kernels *kt, float *Bp, const float *W, int64_t O, int64_t I,
                       int nt);
// Bp <- W^T for a row-major W (O, I) of bf16 (kind 1) or f16 (kind 2)
// elements: the same Bp as mha__gemm_pack_wt of W widened to float32 (the
// widening is exact), a panel at a time through tmp
// (mha__gemm_pack_half_tmp_floats(kt, I, nt) floats).
size_t mha__gemm_pack_half_tmp_floats(const mha__kernels *kt, int64_t I, int nt);
void mha__gemm_pack_wt_half(const mha__kernels *kt, float *Bp, const uint16_t *W, int kind,
                            int64_t O, int64_t I, int nt, float *tmp);
// The same packing kept in the half type: Bp <- W^T for a row-major W (O,
// I) of bf16 or f16 elements, in pack_b's layout (kernels.h) element for
// element (the values of mha__gemm_pack_wt_half's float32 Bp, in W's
// type), for mha__gemm_rows_packed_bh.
void mha__gemm_pack_wt_bh(const mha__kernels *kt, uint16_t *Bp, const uint16_t *W, int64_t O,
                          int64_t I, int nt);
// Bp <- a row-major B (K, N) of row stride ldb.
void mha__gemm_pack_rows(const mha__kernels *kt, float *Bp, const float *B, int64_t ldb,
                         int64_t K, int64_t N, int nt);
// The same for a B of bf16 (kind 1) or f16 (kind 2) elements: the Bp of
// B widened to float32, a column panel at a time through tmp
// (mha__gemm_pack_half_tmp_floats(kt, K, nt) floats).
void mha__gemm_pack_rows_half(const mha__kernels *kt, float *Bp, const uint16_t *B, int kind,
                              int64_t ldb, int64_t K, int64_t N, int nt, float *tmp);

// C (R, N) = [C +] X (R, K) B (K, N) + bias (bias may be NULL), B packed by
// the same kt; X and C row-major with row strides ldx, ldc (C must not
// overlap X or Bp). Rows (and, when there are few, column panels) split
// over nt OpenMP threads; scratch: mha__gemm_scratch_floats(kt, nt) floats.
void mha__gemm_rows_packed(const mha__kernels *kt, float *C, int64_t ldc, const float *X,
                           int64_t ldx, const float *Bp, const float *bias, int64_t R,
                           int64_t K, int64_t N, bool accumulate, int nt,
                           float *thread_scratch);
// The same with a Bp of mha__gemm_pack_wt_bh (bf16 or f16 elements,
// widened as they load: the bits of mha__gemm_rows_packed on the float32
// Bp, half the bytes read).
void mha__gemm_rows_packed_bh(const mha__kernels *kt, float *C, int64_t ldc, const float *X,
                              int64_t ldx, const uint16_t *Bp, int kind, const float *bias,
                              int64_t R, int64_t K, int64_t N, bool accumulate, int nt,
                              float *thread_scratch);
// The same with X stored transposed: XT (K, R) row-major, row stride ldx
// (C = XT^T B, e.g. a weight gradient dW = dY^T X with XT = dY); the same
// bits as mha__gemm_rows_packed on the transposed copy.
void mha__gemm_rows_packed_tn(const mha__kernels *kt, float *C, int64_t ldc, const float *XT,
                              int64_t ldx, const float *Bp, const float *bias, int64_t R,
                              int64_t K, int64_t N, bool accumulate, int nt,
                              float *thread_scratch);

#endif
