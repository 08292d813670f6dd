// linear.h: the fused path's building blocks (fast layer, linear.c): row
// matrices laid out as their views, the projection GEMMs (X W^T + b over
// rows, PyTorch weights packed on the way, half weights widened), the head
// gates, RoPE on q/k rows, the keys appended by add_bias_kv/add_zero_attn.
// The fused forward and backward, the cached decode and the distributed
// parts are made of these.
#ifndef MHA_LINEAR_H
#define MHA_LINEAR_H

#include <string.h>

#include "flash.h"
#include "gemm.h"
#include "plan.h"

// The batch element n and position t of row r of a query-shaped view.
static inline void mha__row_nt(const fwd_plan *p, bool seq_first, const mha_tensor *t,
                               int64_t r, int64_t *n, int64_t *pos) {
    const int64_t d1 = t->ndim == 3 ? t->shape[1] : 1, i0 = r / d1, i1 = r % d1;
    *n = p->unbatched ? 0 : (seq_first ? i1 : i0);
    *pos = p->unbatched ? r : (seq_first ? i0 : i1);
}

// The keys appended by add_bias_kv / add_zero_attn, per KV head: extra
// (H, nx, d) for k (bias_k slice, then zeros), then (H, nx, d) for v; H
// the number of KV heads.
void mha__fill_extra(float *extra, const mha_module *m, int64_t H, int64_t nx, int64_t d);

// A weight matrix in its storage: elements of dt (F32, BF16, F16); wh:
// the widening scratch of half ones (mha__gemm_pack_half_tmp_floats); pk:
// the module's packed weights held by the call (mha__packs_acquire), or
// NULL.
typedef struct mha__wmat {
    const void *p;
    mha_dtype dt;
    float *wh;
    const mha__packs *pk;
} mha__wmat;

static inline mha__wmat mha__wmat_f32(const float *W, const mha__packs *pk) {
    return (mha__wmat){W, MHA_F32, NULL, pk};
}

// C (R, O) = X (R, I) W^T + b for a PyTorch weight W (O, I): W's packed
// form from the module's packed weights (W.pk) when they hold it, else W
// packed into Wp (mha__gemm_packed_b_floats(kt, I, O) floats; half weights
// widened on the way); then the packed GEMM (gemm.h), rows over nt threads
// with gs as its scratch. The two give the same bits (the same layout).
// (Packing even for one row keeps every row's sum order that of the packed
// kernel: a token's projection does not depend on how many rows share the
// call.)
void mha__linear_rows(const mha__kernels *kt, float *C, int64_t ldc, const float *X,
                      int64_t ldx, mha__wmat W, const float *b, int64_t R, int64_t I,
                      int64_t O, float *Wp, float *gs, int nt);

// bf16 compute (a module forward with bf16 weights on bf16 inputs,
// fused_fwd.c): C (R, O) = X (R, I) W^T + b with X's rows, float32 values
// that are bf16 already (gathered from bf16 inputs), rounded to bf16 in
// place (row r at (uint16_t *)X + 2 r ldx, zero-padded to the table's
// bf_kpad), W (O, I) bf16 in its packed form from the module's copy pk
// (mha__packs_find_bf16), else packed by pack_bf16 into Wp (wp_floats
// floats of scratch), then gemm_bf16 over rows split among nt threads (row r
// depends on row r alone) and column panels, + b. Returns false, touching
// nothing, where the shapes do not fit (I < 32, or Wp too small): the
// caller takes the float32 path.
bool mha__linear_rows_bf16(const mha__kernels *kt, float *C, int64_t ldc, float *X, int64_t ldx,
                           const uint16_t *W, const mha__packs *pk, const float *b, int64_t R,
                           int64_t I, int64_t O, float *Wp, size_t wp_floats, int nt);
// Its product on rows that are bf16 already: X (R, I) bf16 rows of stride
// lda (zero-padded to bf_kpad), W from pk or packed into Wp
// (mha__bf16_packed_elems(I, O, bf_kpad) elements), + b.
void mha__linear_bf16_rows(const mha__kernels *kt, float *C, int64_t ldc, const uint16_t *X,
                           int64_t lda, const uint16_t *W, const mha__packs *pk, const float *b,
                           int64_t R, int64_t I, int64_t O, uint16_t *Wp, int nt);

// bf16 operands of gemm_bf16 (kernels.h) from float32 rows, and the
// threaded bf16 GEMM over rows (the bf16 compute of the module's forward
// and backward). Rounding is round_bf16's; Kp = w rounded up to the
// table's bf_kpad, its extra columns zero.
// In place: rows [0, R) of the float32 matrix at base (row stride ld
// floats), columns [0, w), become bf16 (element (r, c) the uint16_t at
// (uint16_t *)base + 2 r ld + c, the row zero-padded to Kp; needs 2 Kp <=
// 4 ld). A chunk is read before it is written (the bf16 half of a row
// trails its float32 half).
void mha__bf16_rows_in_place(const mha__kernels *kt, float *base, int64_t ld, int64_t R,
                             int64_t w, int nt);
// dst (R, Kp), row stride ldd >= Kp <- src (R, w), row stride ld.
void mha__bf16_rows(const mha__kernels *kt, uint16_t *dst, int64_t ldd, const float *src,
                    int64_t ld, int64_t R, int64_t w, int nt);
// dst (w, Rp) <- src (R, w)^T (row stride ld), Rp = R rounded up to
// bf_kpad, row stride ldd >= Rp: a left operand A^T (the weight gradients'
// d^T).
void mha__bf16_transpose(const mha__kernels *kt, uint16_t *dst, int64_t ldd, const float *src,
                         int64_t ld, int64_t R, int64_t w, int nt);
// Bp <- pack_bf16 of the bf16 B (K, N), B(k, n) = B[k*sk + n*sn], slices of
// K over nt threads (the same Bp; mha__bf16_packed_elems(K, N, bf_kpad)
// elements).
void mha__bf16_pack(const mha__kernels *kt, uint16_t *Bp, const uint16_t *B, int64_t sk,
                    int64_t sn, int64_t K, int64_t N, int nt);
// C (R, N) = A (R, K) Bp (acc: C +=) by gemm_bf16: A bf16 rows of row
// stride lda (zero in columns [K, Kp)), Bp from mha__bf16_pack of exactly N
// columns; blocks of 64 rows over nt threads (row r depends on row r
// alone: the same bits for any nt).
void mha__gemm_bf16_rows(const mha__kernels *kt, float *C, int64_t ldc, const uint16_t *A,
                         int64_t lda, const uint16_t *Bp, int64_t R, int64_t K, int64_t N,
                         bool acc, int nt);

// The module's weight matrix at p (one of m->w_*, or rows of one), with
// scratch wh and the packed weights pk (or NULL).
static inline mha__wmat mha__wmat_of(const mha_module *m, const void *p, float *wh,
                                     const mha__packs *pk) {
    return (mha__wmat){p, m->wdt, wh, pk};
}

// The gates of a gated module's R query rows X (R, E), gate (R, H):
// head_gate[h] (static) or sigmoid(X W_g^T + b_g) (dynamic; W_g from pk,
// or packed into Wp, mha__gemm_packed_b_floats(kt, E, H) floats); and gctx
// (R, Eq) = each head's ctx (R, Eq) times its gate.
void mha__gate_rows(const mha__kernels *kt, float *gate, float *gctx, const float *ctx,
                    const mha_module *m, const mha__packs *pk, const float *X, int64_t ldx,
                    int64_t R, float *Wp, float *gs, int nt);

// Zeroes rows [i0, i1) of head column block [c0, c0 + d) of a row matrix.
static inline void mha__zero_head_rows(float *row0, int64_t rs, int64_t i0, int64_t i1,
                                       int64_t d) {
    for (int64_t i = i0; i < i1; i++) memset(row0 + i * rs, 0, (size_t)d * sizeof(float));
}

// C (R, N) = A (R, K) B (K, N) for a row-major B (row stride ldb) of
// float32, bf16 or f16 elements (B.dt; half ones widened through B.wh,
// mha__gemm_pack_half_tmp_floats(kt, K, nt) floats), packed into Bp first.
void mha__matmul_rows(const mha__kernels *kt, float *C, int64_t ldc, const float *A,
                      int64_t lda, mha__wmat B, int64_t ldb, int64_t R, int64_t K, int64_t N,
                      float *Bp, float *gs, int nt);

// Head (b, h) rows of a row matrix laid out as its view: first row and
// row stride.
typedef struct mha__rowmap {
    float *base;
    int64_t ld;      // row stride of the matrix
    bool seq_first;  // rows are (t, n) (else (n, t))
    int64_t N, T;
} mha__rowmap;

static inline float *mha__head_row0(const mha__rowmap *rm, int64_t b, int64_t col) {
    return rm->base + (rm->seq_first ? b : b * rm->T) * rm->ld + col;
}
static inline int64_t mha__head_rs(const mha__rowmap *rm) {
    return rm->seq_first ? rm->N * rm->ld : rm->ld;
}

// Query head h of batch element b of a module call as a flash head: its q
// rows (qm), its KV head's k and v rows (km, vm) and appended keys (extra:
// mha__fill_extra's layout, NULL when the plan has none), its output rows
// (om), its softmax statistics (stats (N H, L, 2) or NULL), the plan's
// scale (1/sqrt(d) or the custom one), mask and dropout. Callers set what else they need.
mha__flash_head mha__plan_head(const fwd_plan *p, const mha__rowmap *qm, const mha__rowmap *km,
                               const mha__rowmap *vm, const mha__rowmap *om,
                               const float *extra, float *stats, int64_t b, int64_t h);
// A flash head of mha__plan_head over q, k, v rows rounded to bf16 in
// place (mha__bf16_rows_in_place; packed: the three are the packed qkv
// rows of self-attention, rounded as one matrix at qm's base): its q, k, v
// pointers and row strides in uint16_t elements, q_half = k_half = v_half
// = 1.
void mha__head_to_bf16(mha__flash_head *fh, const mha__rowmap *qm, const mha__rowmap *km,
                       const mha__rowmap *vm, bool packed);

// QK-norm (mha_config.qk_norm) in place on R rows of x (row stride ld, W
// features each): every group of gs features (d, or W) x <- x /
// sqrt(mean(x^2) + eps) * w (w (gs)); the mean summed in double.
void mha__qk_norm_rows(float *x, int64_t ld, int64_t R, int64_t W, int64_t gs, const float *w,
                       double eps, int nt);
// Its backward on the same R rows: x (row stride ldx) the forward's input
// (before the norm), dx (row stride ldd) the gradient of its output in, of
// its input out; dw (gs) the weight's gradient, summed in double over the
// rows and groups in order, each column by one thread (acc: added to; NULL:
// not wanted); rr (R W / gs doubles) scratch. With r = 1 / sqrt(mean(x^2) +
// eps), u = x r, y = u w:  dw += dy u;  dx = r (dy w - u mean(dy w u)).
void mha__qk_norm_rows_bwd(float *dx, int64_t ldd, const float *x, int64_t ldx, int64_t R,
                           int64_t W, int64_t gs, const float *w, double eps, float *dw,
                           bool acc, double *rr, int nt);

// The fused path's QK-norm: q (Rq rows of qm) and k (Rk rows of km) in
// place, each group of d features (MHA_QK_NORM_HEAD) or the whole row;
// their values before the norm first copied to keep (q (Rq, Eq), then k
// (Rk, Ekv)) unless it is NULL.
void mha__fused_qk_norm(const fwd_plan *p, const mha_module *m, const mha__rowmap *qm,
                        const mha__rowmap *km, int64_t Rq, int64_t Rk, float *keep);

// RoPE on the first T tokens of each batch element of a q or k row matrix
// (all H heads of a token contiguous: p->H for q, p->Hkv for k), or its
// inverse (gradients: the transpose). Token t of batch element n is at
// position rope_positions[n L + t], else rope_start[n] + pos[t] (pos NULL:
// t); the frequencies and cos/sin factor of a->rope_scaling.
void mha__rope_rows(const fwd_plan *p, const mha_forward_args *a, const mha__rowmap *rm,
                    int64_t T, int64_t H, bool inverse, const int64_t *pos);

// The (query tile, key tile) pairs whose scores rows [i0, i1) of a head
// compute (the key tiles flash.c visits).
int64_t mha__key_tiles(const mha__flash_head *fh, int64_t i0, int64_t i1);

#endif
