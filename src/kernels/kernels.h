// kernels.h: the one kernel contract of the fused path. Every slot has a
// portable C version (generic.c, always built); ISA files (avx2*.c,
// avx512*.c) overwrite the slots they do better. The table is filled once
// (cpu.c): generic first, then the best ISA the CPU supports, or the one
// MHA_ISA=scalar|avx2|avx512|amx names.
//
// Contract, for every kernel:
//  - float32, row-major tiles given by pointer + row stride (in elements);
//    no alignment is required; the kernel handles any M, N, K >= 0
//    (partial tiles included) itself.
//  - "overwrite" kernels never read their output first (NaN in it is
//    harmless); "accumulate" kernels add to it.
//  - kernels trust their arguments (checked once, by the entry points and
//    the planner) and never allocate, print or use threads.
//  - the order of every sum is fixed by the kernel and the shape alone, so
//    results never depend on the number of threads or on the caller.
#ifndef MHA_KERNELS_H
#define MHA_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

// The longest row dot_rows_i8 takes: |sum (a + 128) x| <= 255 * 127 * D
// stays within int32 (the VNNI form's biased sum) with room to spare.
#define MHA__I8_DMAX 8192

typedef struct mha__kernels {
    const char *isa;  // "scalar", "avx2", "avx512", "avx512bf16" (avx512 computing
                      // bf16 with vdpbf16ps), "amx" (avx512 + AMX-BF16 tiles)

    // gemm_nn: C (M, N) = A (M, K) B (K, N)             overwrite
    //   (B row-major: the "packed" operand, e.g. K^T or W^T)
    void (*gemm_nn)(float *C, int64_t ldc, const float *A, int64_t lda, const float *B,
                    int64_t ldb, int64_t M, int64_t N, int64_t K);
    // gemm_nn_acc: C (M, N) += A (M, K) B (K, N)        accumulate
    void (*gemm_nn_acc)(float *C, int64_t ldc, const float *A, int64_t lda, const float *B,
                        int64_t ldb, int64_t M, int64_t N, int64_t K);
    // gemm_tn_acc: C (M, N) += A^T B, where A is stored (K, M) row-major
    //   with row stride lda (so element (i, k) of the logical left operand
    //   is A[k*lda + i]), B (K, N) row-major with row stride ldb.
    //                                                   accumulate
    //   Bit-identical, on every table, to gemm_nn_acc(C, ldc, T, M, B, ldb,
    //   M, N, K) with T (M, K) the transpose of A (T[i*K + k] = A[k*lda + i]):
    //   the same per-element sum order (gemm_nn_acc's k chunks, each summed
    //   from 0 in increasing k and added to C; scalar: C += a*b in increasing
    //   k), without the transposed copy. Used by the flash backward for
    //   dV += P^T dO and dK += dS^T Q.
    void (*gemm_tn_acc)(float *C, int64_t ldc, const float *A, int64_t lda, const float *B,
                        int64_t ldb, int64_t M, int64_t N, int64_t K);
    // softmax_update: one row x (n) of scaled, masked scores, the row's
    // running max *m and sum *l (online softmax):
    //   m' = max(*m, max_j x_j); x_j <- exp(x_j - m')
    //   *l <- *l * exp(*m - m') + sum_j x_j;  *m <- m'
    // returns alpha = exp(*m_old - m') (1 when m' = -inf: nothing seen
    // yet). -inf entries become 0.
    float (*softmax_update)(float *x, int64_t n, float *m, float *l);
    // softmax_rows: softmax_update on each of R rows of x (row stride ldx,
    // n columns) with their m[r], l[r]; alpha[r] gets each row's return
    // value. Bit-identical to R calls of softmax_update (the ISA versions
    // interleave rows to hide the reductions' latency).
    void (*softmax_rows)(float *x, int64_t ldx, int64_t R, int64_t n, float *m, float *l,
                         float *alpha);
    // dot_rows: s[j] = sum_c A[j*lda + c] x[c] for j < n, c < D   overwrite
    //   (decode: one query against cached key rows, read once each)
    void (*dot_rows)(float *s, const float *A, int64_t lda, const float *x, int64_t n,
                     int64_t D);
    // cvt_bf16 / cvt_f16: dst[i] = src[i] as float32 (exact), i < n
    // cvt_i8: dst[i] = scale * src[i]                          overwrite
    //   (reduced-precision KV caches, dequantised a chunk at a time)
    void (*cvt_bf16)(float *dst, const uint16_t *src, int64_t n);
    void (*cvt_f16)(float *dst, const uint16_t *src, int64_t n);
    void (*cvt_i8)(float *dst, const int8_t *src, int64_t n, float scale);
    // cvt_i4: dst[c] = scales[c / 32] * q_c (rounded to float32), c < n,
    //   q_c the 4-bit two's complement nibble c of src (element 2i in the
    //   low nibble of byte i, 2i + 1 in the high one: kvcache.c's int4 row)
    //   (bit-identical on every table)                   overwrite
    void (*cvt_i4)(float *dst, const uint8_t *src, int64_t n, const float *scales);
    // Decode over a cache's rows in place (reduced precision without a
    // float32 copy):
    // dot_rows_q: s[j] = scale_j * sum_c A(j, c) x[c] for j < n, c < D
    // axpy_rows_q: o[c] += sum_j p[j] scale_j A(j, c) for c < Dv (j in order)
    // A rows of lda elements of type kind: 0 float32, 1 bf16, 2 f16, 3 int8
    // (scale_j = scales[j * sld]; 1 for the others, scales may be NULL), 4
    // int4: lda even, row j at byte j * lda / 2, A(j, c) = fl(s * q) with q
    // its nibble c (as cvt_i4 reads it) and s = scales[j * sld + c / 32]
    // (its group's scale; scale_j = 1). sld: the floats from one row's
    // scales to the next's (1, or ceil(D / 32), for scales in an array of
    // their own; more for scales kept in each row after its elements, as
    // the paged cache's are); no byte past a row's
    // ceil(D / 2) (ceil(Dv / 2)) is read (D odd: the last byte's high
    // nibble is read and weighs 0); a table may apply s to each element
    // (fl(s q)), to partial sums over elements of one group (dot) or to
    // the row's weight (axpy: fl(p[j] s) q): the same values, other
    // roundings. Each
    // s[j] depends on row j and x alone (the same bits whatever n and the
    // row's place in the call), and axpy's sum runs over the rows in order:
    // a range split into pieces gives the bits of one call. The ISA
    // versions prefetch the rows ahead of those they read (decode streams
    // the cache from memory) and, while they run, the pfb bytes at pf (the
    // rows the caller reads next, elsewhere: a paged cache's next block;
    // NULL, 0: none), a step at a time. pf never changes a result.
    void (*dot_rows_q)(float *s, const void *A, int64_t lda, int kind, const float *scales,
                       int64_t sld, const float *x, int64_t n, int64_t D, const void *pf,
                       size_t pfb);
    void (*axpy_rows_q)(float *o, const float *p, const void *A, int64_t lda, int kind,
                        const float *scales, int64_t sld, int64_t n, int64_t Dv,
                        const void *pf, size_t pfb);
    // The same for the ng queries of a GQA group over the same rows, each row
    // read once for all of them (decode: the cache streams from memory once
    // per group, not once per query head):
    // dot_rows_qg: s[g*lds + j] = scale_j sum_c A(j, c) X[g*ldx + c]
    // axpy_rows_qg: O[g*ldo + c] += sum_j P[g*ldp + j] scale_j A(j, c)
    //   (j in order), for g < ng. Bit-identical, on every table, to ng calls
    //   of that table's dot_rows_q / axpy_rows_q on query g's rows.
    void (*dot_rows_qg)(float *s, int64_t lds, const void *A, int64_t lda, int kind,
                        const float *scales, int64_t sld, const float *X, int64_t ldx,
                        int64_t ng, int64_t n, int64_t D, const void *pf, size_t pfb);
    void (*axpy_rows_qg)(float *O, int64_t ldo, const float *P, int64_t ldp, const void *A,
                         int64_t lda, int kind, const float *scales, int64_t sld, int64_t ng,
                         int64_t n, int64_t Dv, const void *pf, size_t pfb);
    // dot_rows_i8: the scores of int8 rows against int8-quantised queries
    // (decode over an int8 cache; kvcache.c quantises each query once,
    // mha__quantize_i8): for g < ng, j < n,
    //   s[g*lds + j] = fl(fl(scales[j*sld] * xs[g*ldxs]) * fl(t)),
    //   t = sum_{c < D} A[j*lda + c] Xq[g*ldx + c]
    // with t an exact integer (D <= MHA__I8_DMAX: no int32 overflow in any
    // table's form of the sum), so every table gives the same bits. Xq:
    // ng rows of ldx bytes, ldx >= D rounded up to 64, the bytes from D on
    // zero (tables may read them). No byte of A past a row's D is read.
    // Prefetching as dot_rows_q's (pf never changes a result).
    void (*dot_rows_i8)(float *s, int64_t lds, const int8_t *A, int64_t lda,
                        const float *scales, int64_t sld, const int8_t *Xq, int64_t ldx,
                        const float *xs, int64_t ldxs, int64_t ng, int64_t n, int64_t D,
                        const void *pf, size_t pfb);
    // dot_rows_i4: the scores of int4 rows (kind 4's layout: row j at byte
    // j * rb, element 2i in the low nibble of byte i, 2i + 1 in the high
    // one, q its 4-bit two's complement; its group b's scale scales[j*sld
    // + b], groups of 32) against int8-quantised queries (as dot_rows_i8's,
    // split: per 128 elements the even ones' 64 bytes, then the odd ones'):
    // for g < ng, j < n,
    //   t_b = sum_{c in group b} q_jc x_gc           (exact)
    //   u = 0; u = fl(u + fl(scales[j*sld + b] * fl(t_b))) for b in order
    //   s[g*lds + j] = fl(xs[g*ldxs] * u)
    // D a multiple of 128. The same bits on every table. Prefetching as
    // dot_rows_q's.
    void (*dot_rows_i4)(float *s, int64_t lds, const uint8_t *A, int64_t rb,
                        const float *scales, int64_t sld, const int8_t *Xq, int64_t ldx,
                        const float *xs, int64_t ldxs, int64_t ng, int64_t n, int64_t D,
                        const void *pf, size_t pfb);
    // scale_row: y (n) *= a
    void (*scale_row)(float *y, int64_t n, float a);
    // transpose: dst[c*ldd + r] = src[r*lds + c] for r < rows, c < cols
    //   (a copy: exact on every table)                overwrite
    //   (the flash tiles' K^T and V^T, packed once per thread and head)
    void (*transpose)(float *dst, int64_t ldd, const float *src, int64_t lds, int64_t rows,
                      int64_t cols);
    // exp_shift: x_j <- exp(x_j - c) for j < n; -inf gives 0; c = -inf
    // (a fully masked row) gives 0 everywhere.
    void (*exp_shift)(float *x, int64_t n, float c);
    // The flash backward's row passes over a (R, n) tile, row stride ld:
    // exp_scale_rows: row r <- exp_shift(row, n, st[2r]), then
    //   scale_row(row, n, st[2r + 1]) (P = exp(s - m) / l from the
    //   forward's (m, 1/l) pairs): bit-identical, on every table, to those
    //   two calls of the same table.                   overwrite (in place)
    void (*exp_scale_rows)(float *x, int64_t ld, int64_t R, int64_t n, const float *st);
    // dot_acc_rows: sum[r] += sum_j a[r*ld + j] b[r*ld + j]    accumulate
    //   in one order on every table (bit-identical everywhere): 16 partial
    //   sums from 0, p_u = p_u + a_j b_j (the product rounded, then the
    //   sum: no FMA) for j = u mod 16 in increasing j; then
    //   t = ((0 + p_0) + p_1) ... + p_15; sum[r] = sum[r] + t.
    void (*dot_acc_rows)(float *sum, const float *a, const float *b, int64_t ld, int64_t R,
                         int64_t n);
    // dsoftmax_rows: d[r*ld + j] = p[r*ld + j] * (d[r*ld + j] - ds[r])
    //   (the softmax backward dS = P (dP - Dsum)); bit-identical on every
    //   table.                                         overwrite (in place)
    void (*dsoftmax_rows)(float *d, const float *p, int64_t ld, int64_t R, int64_t n,
                          const float *ds);

    // ---- Packed-B GEMM (the projections; threaded driver in gemm.c) ----
    // B (K, N) is packed once into pk_nr-wide column panels, each
    // contiguous along k and zero-padded past N:
    //   Bp[(p*K + k)*pk_nr + j] = B(k, p*pk_nr + j)   (0 if p*pk_nr + j >= N)
    // i.e. ceil(N / pk_nr) * pk_nr * K floats (mha__gemm_packed_b_floats).
    // Panel p starts at Bp + p*pk_nr*K, so the packed form of the columns
    // [p*pk_nr, N) is that pointer, with the same K: callers slice column
    // ranges (and pack them) by panel. The format is per ISA: pack and
    // multiply with the same table.
    int64_t pk_nr;     // panel width (columns)
    int64_t pk_mr;     // micro-tile rows (a row split at a multiple of it wastes nothing)
    int64_t pk_kc;     // k chunk of the sum order (see gemm_packed); 0: one chunk, all of K
    int64_t pk_apack;  // floats of the A-pack scratch one gemm_packed call needs
    // pack_b: Bp <- B (K, N) with B(k, n) = B[k*sk + n*sn] (any strides:
    //   sk = ldb, sn = 1 for a row-major B; sk = 1, sn = I for B = W^T of a
    //   PyTorch weight W (O, I), which replaces a transpose).
    void (*pack_b)(float *Bp, const float *B, int64_t sk, int64_t sn, int64_t K, int64_t N);
    // gemm_packed: C (M, N) = [C +] A (M, K) Bp + bias      (bias may be NULL)
    //   A row-major, row stride lda; the ISA kernels copy it block by block
    //   (rows x k chunk) into apack, pk_apack floats of caller scratch that
    //   nothing else uses during the call (scalar: unused, may be NULL).
    //   Bp: from pack_b of the same table (or a panel-aligned slice of it:
    //   columns [p*pk_nr, ...) are Bp + p*pk_nr*K with the same K). C must
    //   not overlap A, Bp or apack; its padding (columns >= N) is never
    //   touched, and in overwrite mode it is never read.
    //   Sum order, per element, fixed by K alone (never by M, N, the row
    //   or the column): with chunks c = [c*kc, min((c+1)*kc, K)), kc = pk_kc
    //   (pk_kc = 0: kc = K),
    //     S_c = fma chain over k increasing in chunk c, from 0
    //     C = S_0 (overwrite) or C + S_0 (accumulate); C = C + S_c, c >= 1;
    //     then C = C + bias[j]
    //   (K = 0: C = 0 or C, then + bias). AVX2/AVX-512 use kc = 256 as the
    //   gemm_nn slots do, so overwrite + bias is bit-identical to gemm_nn
    //   followed by C += bias; scalar uses kc = K and a*b + c unfused, as
    //   its gemm_nn does. Row r of C depends on row r of A only: any row
    //   split over threads gives the same bits.
    void (*gemm_packed)(float *C, int64_t ldc, const float *A, int64_t lda, const float *Bp,
                        const float *bias, int64_t M, int64_t N, int64_t K, bool accumulate,
                        float *apack);
    // gemm_packed_tn: C (M, N) = [C +] A^T Bp + bias, A stored transposed:
    //   (K, M) row-major with row stride lda, element (i, k) of the left
    //   operand at A[k*lda + i] (the weight gradient dW = dY^T X without a
    //   copy of dY^T). Bit-identical, on every table, to gemm_packed on the
    //   transposed copy T (M, K), T[i*K + k] = A[k*lda + i]: only the A copy
    //   differs. Otherwise as gemm_packed (C must not overlap A, Bp, apack).
    void (*gemm_packed_tn)(float *C, int64_t ldc, const float *A, int64_t lda, const float *Bp,
                           const float *bias, int64_t M, int64_t N, int64_t K, bool accumulate,
                           float *apack);
    // gemm_packed_bh: gemm_packed with Bp's elements stored as bf16 (kind
    //   1) or f16 (kind 2): uint16_t in pack_b's element order (gemm.h,
    //   mha__gemm_pack_wt_bh), each widened as it loads (exact): the same
    //   bits, on every table, as gemm_packed on the float32 Bp of the
    //   widened values, reading half its bytes (half weights' projections).
    void (*gemm_packed_bh)(float *C, int64_t ldc, const float *A, int64_t lda,
                           const uint16_t *Bp, int kind, const float *bias, int64_t M,
                           int64_t N, int64_t K, bool accumulate, float *apack);

    // ---- bf16 compute (the flash forward over bf16 q, k, v) ----
    // FlashAttention's convention, as PyTorch's CPU flash kernel does it:
    // S = scale (Q K^T) and O += P V with bf16 operands and float32 sums,
    // the online softmax in float32, P rounded to bf16 (round_bf16) for PV.
    // Operands never hold subnormals: the packers and round_bf16 flush them
    // to signed zero, as vdpbf16ps and AMX read them (DAZ).
    // bf_kpad: A's rows and Bp hold the summed dimension K padded with
    //   zeros to Kp = a multiple of it (2: vdpbf16ps pairs; AMX: 32, a
    //   tile's depth).
    // bf_mpad: gemm_bf16 may read A's rows up to M rounded up to a multiple
    //   of it (1; AMX 16: whole tiles; rows past M feed discarded sums only).
    // bf_fast: this table's bf16 compute is faster than its float32 path on
    //   converted rows (amx; avx512bf16, vdpbf16ps on AMD Zen 4 at twice
    //   the FMA rate); else the flash forward converts bf16 rows to
    //   float32 and computes in float32 (the others: see their fillers),
    //   unless a test forces bf16 compute (mha__flash_force_bf16).
    // bf_exact: gemm_bf16 gives the generic version's bits (the order
    //   below) wherever no product a_k b_k is below 2^-126 (float32's
    //   normal range) without being 0; false (AMX): the tile unit's own
    //   accumulation order. Every table, every input: |C - exact| <=
    //   Kp 2^-23 sum_k |a_k b_k| + Kp 2^-126 (+ the rounding of alpha s),
    //   tested in test_kernels; the same shapes give the same bits,
    //   whatever the thread count.
    int64_t bf_kpad, bf_mpad;
    bool bf_fast, bf_exact;
    // round_bf16: dst[i] = src[i] as bf16: a subnormal src[i] becomes
    //   signed zero, NaN a quiet NaN (its high half, quiet bit set), every
    //   other value rounded to nearest even (vcvtneps2bf16's rule).
    //   Bit-identical on every table.                   overwrite
    void (*round_bf16)(uint16_t *dst, const float *src, int64_t n);
    // softmax_rows_bf16: the online softmax of a bf16 compute's tile and
    //   its P for P v in one sweep, with an exp of its own (P is rounded
    //   to bf16, 2^-9, after it). For each of R rows of x (row stride ldx,
    //   n columns; x is only read), with y_j = scale x_j (one product):
    //     M = max(m[r], max_j y_j), NaN y_j skipped; M = -inf (nothing
    //     visible yet): p_j = 0, alpha[r] = 1, m[r], l[r] kept, unless a
    //     y_j is NaN: then M = NaN;
    //     e_j = fexp(y_j - M) (the rounded product, as M's: the largest
    //     gets exactly 0, where the exact product's fma(scale, x_j, -M)
    //     would be off by up to half an ulp of M, a large number for
    //     large scores: exp of it overflows or vanishes);
    //     p[r*ldp + j] = round_bf16(e_j);
    //     s = sum_j e_j in 16 partial sums (j mod 16) from 0, in increasing
    //     j, then added pairwise: lane u + lane u + 8, then + 4, + 2, + 1;
    //     alpha[r] = fexp(m[r] - M); l[r] = l[r] alpha[r] + s; m[r] = M;
    //   fexp(z) = 0 for z < -87 (so no subnormal results; exp(-87) =
    //   1.6e-38); NaN for NaN; else t = z log2(e) (one product), k =
    //   rint(t), f = t - k (exact), q = 2^f by a degree-5 polynomial with
    //   q(0) = 1 exactly (Horner, fma; relative error 1.6e-7 on [-1/2, 1/2])
    //   and q 2^k. Bit-identical on every table.
    void (*softmax_rows_bf16)(const float *x, int64_t ldx, int64_t R, int64_t n, float scale,
                              float *m, float *l, float *alpha, uint16_t *p, int64_t ldp);
    // pack_bf16: Bp <- B (K, N) of bf16 elements, B(k, n) = B[k*sk + n*sn],
    //   pairs of k interleaved (the "VNNI" layout vdpbf16ps and AMX tiles
    //   read): with Np = roundup(N, 16) and Kp = roundup(K, bf_kpad),
    //     Bp[((k / 2) Np + n) 2 + k % 2] = B(k, n), subnormals flushed to
    //     signed zero; 0 for k >= K or n >= N
    //   Kp Np elements. Bit-identical on every table with the same bf_kpad.
    void (*pack_bf16)(uint16_t *Bp, const uint16_t *B, int64_t sk, int64_t sn, int64_t K,
                      int64_t N);
    // gemm_bf16: C (M, N) = alpha A Bp (acc false: C never read) or
    //   C += A Bp (acc true: alpha unused). A (M, Kp) bf16 row-major, row
    //   stride lda >= Kp, zero in columns [K, Kp), no subnormals; Bp from
    //   this table's pack_bf16 of nb >= N columns (the first
    //   N are used) and at least K rows. Per element, exact
    //   tables: s = 0 (or C); for pairs p = 0 .. Kp/2 - 1 in order
    //     s = ftz(fma(a_2p+1, b_2p+1, s)); s = ftz(fma(a_2p, b_2p, s))
    //   (vdpbf16ps: each product exact, one rounding per add, nearest even,
    //   a subnormal sum flushed to signed zero; products below 2^-126 are
    //   the hardware's own, bounded above); then C = alpha s (one float32
    //   product) or C = s. Row r of C depends on row r of A only.
    void (*gemm_bf16)(float *C, int64_t ldc, const uint16_t *A, int64_t lda, const uint16_t *Bp,
                      int64_t nb, int64_t M, int64_t N, int64_t K, float alpha, bool acc);
} mha__kernels;

// The table chosen for this process (filled on first use, thread-safe).
const mha__kernels *mha__kernels_get(void);
// A table by ISA name ("scalar", "avx2", "avx512", "avx512bf16", "amx"); NULL if this build or
// this CPU lacks it. For tests, which compare every ISA with scalar.
const mha__kernels *mha__kernels_for(const char *isa);

// The portable dot_rows_q and axpy_rows_q (generic.c), for an ISA version
// that handles some kinds itself and hands them the others.
void mha__dot_rows_q_generic(float *s, const void *A, int64_t lda, int kind,
                             const float *scales, int64_t sld, const float *x, int64_t n,
                             int64_t D, const void *pf, size_t pfb);
void mha__axpy_rows_q_generic(float *o, const float *p, const void *A, int64_t lda, int kind,
                              const float *scales, int64_t sld, int64_t n, int64_t Dv,
                              const void *pf, size_t pfb);

// The portable round_bf16 and softmax_rows_bf16 (the same bits on every
// table).
void mha__round_bf16_generic(uint16_t *dst, const float *src, int64_t n);
void mha__softmax_rows_bf16_generic(const float *x, int64_t ldx, int64_t R, int64_t n,
                                    float scale, float *m, float *l, float *alpha, uint16_t *p,
                                    int64_t ldp);
// The portable pack_bf16 for a table whose bf_kpad is kpad.
void mha__pack_bf16_generic(uint16_t *Bp, const uint16_t *B, int64_t sk, int64_t sn, int64_t K,
                            int64_t N, int64_t kpad);

// The AVX-512 pack_bf16 (avx512bf16.c), for the avx512 and amx tables.
void mha__pack_bf16_avx512(uint16_t *Bp, const uint16_t *B, int64_t sk, int64_t sn, int64_t K,
                           int64_t N, int64_t kpad);

// Per-ISA fillers: each overwrites the slots it implements.
void mha__kernels_fill_generic(mha__kernels *k);
void mha__kernels_fill_avx2(mha__kernels *k);
// The decode slots of the avx2 and avx512 tables (avx2_decode.c,
// avx512_decode.c), which their fillers above and below call.
void mha__kernels_fill_avx2_decode(mha__kernels *k);
void mha__kernels_fill_avx512_decode(mha__kernels *k);
// dot_rows_i4's formula for one row a (its scales sc) and one split query
// x (scale xs): the generic version's, and the ISA versions' tail rows.
// Group b is bytes 16 b .. 16 b + 15 of the row; byte i's low nibble is
// element 2i (the query's even elements, from its 128-element slab's
// start), its high one 2i + 1 (the odd ones, 64 on).
static inline float mha__dot_row_i4(const uint8_t *a, const float *sc, const int8_t *x,
                                    int64_t D, float xs) {
    float u = 0.0f;
    for (int64_t b = 0; 32 * b < D; b++) {
        const uint8_t *ab = a + 16 * b;
        const int8_t *xe = x + (b / 4) * 128 + 16 * (b % 4), *xo = xe + 64;
        int32_t t = 0;
        for (int k = 0; k < 16; k++)
            t += (((ab[k] & 15) ^ 8) - 8) * xe[k] + (((ab[k] >> 4) ^ 8) - 8) * xo[k];
        const float p = sc[b] * (float)t;
        u = u + p;
    }
    return xs * u;
}
// avx2_decode.c's dot_rows_i8 and dot_rows_i4, also the avx512 table's
void mha__dot_rows_i8_avx2(float *s, int64_t lds, const int8_t *A, int64_t lda,
                           const float *scales, int64_t sld, const int8_t *Xq, int64_t ldx,
                           const float *xs, int64_t ldxs, int64_t ng, int64_t n, int64_t D,
                           const void *pf, size_t pfb);
void mha__dot_rows_i4_avx2(float *s, int64_t lds, const uint8_t *A, int64_t rb,
                           const float *scales, int64_t sld, const int8_t *Xq, int64_t ldx,
                           const float *xs, int64_t ldxs, int64_t ng, int64_t n, int64_t D,
                           const void *pf, size_t pfb);
void mha__kernels_fill_avx512(mha__kernels *k);
// The bf16 slots with vdpbf16ps (avx512bf16.c) and AMX tiles (amx.c), on top
// of the avx512 table, where the CPU (and, for AMX, Linux) allows them.
void mha__kernels_fill_avx512bf16(mha__kernels *k);
void mha__kernels_fill_amx(mha__kernels *k);

// Elements (uint16_t) of pack_bf16's output for B (K, N) with the table's
// bf_kpad.
static inline int64_t mha__bf16_packed_elems(int64_t K, int64_t N, int64_t kpad) {
    return (K + kpad - 1) / kpad * kpad * ((N + 15) / 16 * 16);
}

// Whether a row of scores holds a NaN. The softmax kernels ask it only when
// the row's max is -inf (nothing visible): a NaN score must make the row NaN,
// as in the reference, not count as masked (max instructions drop NaNs in an
// ISA-dependent way).
static inline bool mha__row_has_nan(const float *x, int64_t n) {
    for (int64_t j = 0; j < n; j++)
        if (x[j] != x[j]) return true;
    return false;
}

#endif
