// flash.h: the fused attention of one (b, h): tiles of queries against
// tiles of keys with an online softmax (FlashAttention,
// https://arxiv.org/abs/2205.14135 and https://arxiv.org/abs/2307.08691),
// never storing the (L, S) score matrix. Float32, through the kernel table
// (kernels/kernels.h).
#ifndef MHA_FLASH_H
#define MHA_FLASH_H

#include "kernels/kernels.h"
#include "mask.h"
#include "philox.h"
#include "view.h"

#define MHA__FLASH_BR 64   // query rows per tile
#define MHA__FLASH_BC 128  // keys per tile

typedef struct mha__flash_head {
    const float *q;  // (L, D), row stride q_rs
    const float *k;  // (S, D), row stride k_rs
    const float *v;  // (S, Dv), row stride v_rs
    int64_t q_rs, k_rs, v_rs;
    // keys appended after the S keys (add_bias_kv, add_zero_attn): never
    // masked; xk (nx, D), xv (nx, Dv), contiguous
    const float *xk, *xv;
    int64_t nx;
    float *o;  // (L, Dv), row stride o_rs: overwritten by the forward, read by
               // the backward (Dsum)
    int64_t o_rs;
    float *stats;  // (L, 2) or NULL: each row's score max m and 1/l (l the
                   // sum of exp(s - m)), so P = exp(s - m) / l is
                   // recomputed with the forward's own rounding; (-inf, 0)
                   // for a fully masked row. With an attention sink
                   // (mask->sinks[h]) m and l include it: (sink, 1) for a
                   // fully masked row
    int64_t L, S, D, Dv;
    // The element types of q, k, v (the head's S keys; xk, xv are float32)
    // and o, in the forward (mha__flash_rows, mha__flash_weights) only: 0
    // float32; 1 bfloat16, 2 float16, where the pointer then points at
    // uint16_t elements (cast) and the row strides count them. bf16 q, k,
    // v compute in bf16 where mha__flash_bf16 says so: S = scale (q k^T)
    // and O += P v with float32 sums, P rounded to bf16 (FlashAttention's
    // convention, PyTorch's CPU flash kernel's too). Otherwise half rows
    // are converted to float32 exactly as they are loaded (the table's
    // cvt_bf16 / cvt_f16): the bits of the float32 head on the converted
    // inputs. Either way o's rows accumulate in float32 scratch and are
    // rounded (nearest even) once, as they are stored. The backward
    // computes in float32 (half rows converted, o float32) whatever the
    // forward did.
    uint8_t q_half, k_half, v_half, o_half;
    float scale;
    const mha__mask *mask;     // over the S keys (s_masked = S)
    const mha__dropout *drop;  // NULL: none; its S is S + nx
    int64_t b, h;
    // Backward: Dsum given (rowsum(dO * O) of the whole softmax, e.g. when
    // the backward runs one block of keys at a time) and only read;
    // otherwise written by pass B / the head's backward from dO and o, the
    // forward's context of the head (read, not written, by the backward).
    bool dsum_fixed;
    // Compute in float32 even where mha__flash_bf16 would pick bf16 (the
    // backward's own forward rows: the P the float32 backward recomputes).
    bool f32_compute;
    // Called between key tiles by mha__flash_bwd_head (NULL: none): a
    // caller's progress callback (e.g. to drive its messages).
    void (*progress)(void *arg);
    void *progress_arg;
} mha__flash_head;

// Whether the forward of head a computes in bf16 on table kt (kernels.h,
// bf16 compute): q, k and v bf16, no appended float32 keys, and a table
// whose bf16 products are faster than its float32 path (bf_fast).
// Otherwise half rows are converted to float32 as they load.
bool mha__flash_bf16(const mha__kernels *kt, const mha__flash_head *a);
// Whether table kt computes bf16 heads in bf16 (bf_fast, or forced).
bool mha__flash_bf16_table(const mha__kernels *kt);
// Tests: bf16 compute on every table (its generic or vdpbf16ps gemm_bf16),
// not only where bf_fast; off by default.
void mha__flash_force_bf16(bool on);

// Per-thread scratch. It caches the head's K^T (and, in the backward, V^T)
// tile by tile, packed once per thread and head instead of once per
// (query tile, key tile): O((S + nx) (D + Dv)) floats plus O(BR BC).
// mha__flash_scratch_reset must be called on a thread's scratch before
// the first use in a call (the cache is keyed by the head's pointers).
// backward: room for the V^T cache as well (the forward does not use it).
size_t mha__flash_scratch_floats(int64_t D, int64_t Dv, int64_t S, int64_t nx, bool backward);
void mha__flash_scratch_reset(float *scratch);

// The keys [0, S) that causal and window masks leave to rows [i0, i1):
// [*lo, *hi) (empty when *lo >= *hi). Other masks apply inside.
void mha__flash_key_range(const mha__flash_head *a, int64_t i0, int64_t i1, int64_t *lo,
                          int64_t *hi);

// Rows [i0, i1) of the head (at most MHA__FLASH_BR of them): O and stats.
// A fully masked row gets O = 0.
void mha__flash_rows(const mha__kernels *kt, const mha__flash_head *a, int64_t i0, int64_t i1,
                     float *scratch);

// The attention weights of rows [i0, i1) recomputed from stats (after a
// forward): w (i, j) = exp(scale q_i k_j + mask - m_i) / l_i [* dropout],
// written through w (rows i - i0, columns j < S + nx); keys outside the
// causal/window band get 0 without being computed.
void mha__flash_weights(const mha__kernels *kt, const mha__flash_head *a, int64_t i0,
                        int64_t i1, mha__mat w, float *scratch);


// ---------------------------------------------------------------------------
// Backward: FlashAttention-2's (https://arxiv.org/abs/2307.08691, alg. 2),
// one sweep per (query tile, key tile) with nothing of the (L, S) matrices
// kept beyond the (BR, BC) tiles in use. dO (L, Dv) is the context's
// gradient, stats from the forward, and
//   Dsum_i = rowsum(dO_i * O_i)   (= sum_j P_ij dP_ij; dropout included,
//                                  as O = P' v), computed up front from the
//                                  forward's context O = a->o (or given)
// then per tile pair, recomputed and used at once:
//   S = scale q k^T + mask;  P = exp(S - m) / l;  P' = P * drop
//   dv += P'^T dO;  dP = (dO v^T) * drop;  dS = P (dP - Dsum)
//   dk += scale dS^T q;  dq += scale dS k
// No sum's order depends on the threads: every dk, dv row is summed by its
// key tile's owner, every dq row by its query tile's, in increasing tile
// order.
//
// Dsum from O is not the sum of the very (rounded) P dP products the dS
// use: a row's dS carry ~2^-24 |dO| |v| of its rounding, which swamps them
// where the row is near one-hot (dS ~ (1 - max P) |dP|; PyTorch's math
// path, Dsum = sum_j P dP, cancels there). So a query tile with a row whose
// largest weight 1/l exceeds 1 - MHA__FLASH_SAT takes Dsum = sum_j P dP
// (the same tiles, a sweep of 2 GEMMs more per tile pair, nothing stored):
// a one-hot row then gets dS = 0 exactly, dropout or not. A fully masked
// row (P = 0, O = 0, Dsum = 0) gets dS = 0 exactly either way: zero dq and
// no share of dk, dv.
#define MHA__FLASH_SAT 0x1p-10f

// Pass A: keys [j0, j0 + n) (j0 a multiple of MHA__FLASH_BC, n <=
// MHA__FLASH_BC, or the nx appended keys when j0 == S): dk (n, D) and dv
// (n, Dv), overwritten (acc false) or added to (acc true: grouped-query
// attention, the KV head's later query heads, in increasing order). Reads
// Dsum of every row the keys see.
void mha__flash_bwd_kv(const mha__kernels *kt, const mha__flash_head *a, const float *dO,
                       int64_t do_rs, const float *Dsum, int64_t j0, int64_t n, float *dk,
                       int64_t dk_rs, float *dv, int64_t dv_rs, bool acc, float *scratch);

// Pass B: rows [i0, i1) (at most MHA__FLASH_BR): Dsum[i0, i1) (written
// from dO and O unless dsum_fixed) and dq (i1 - i0, D), overwritten. Runs
// before pass A when pass A reads the Dsum it writes.
void mha__flash_bwd_q(const mha__kernels *kt, const mha__flash_head *a, const float *dO,
                      int64_t do_rs, float *Dsum, int64_t i0, int64_t i1, float *dq,
                      int64_t dq_rs, float *scratch);

// The whole backward of one head by one thread: Dsum of every query tile
// first (unless dsum_fixed), then FlashAttention-2's loop order, key tile
// outer (its dk, dv rows and K^T, V^T, K tiles stay in cache) and query
// tile inner (q, dO, dq rows stream by), each tile pair's P' and dS used
// for dq += dS k, dk += dS^T q, dv += P'^T dO at once, so S and dP are
// computed once per tile pair (5 GEMMs per tile pair instead of 7). Writes
// Dsum (L) (unless dsum_fixed), dq (L, D), dk, dv (S, D / Dv) and the
// appended keys' dxk, dxv (nx, D / Dv, contiguous), all overwritten (dk,
// dv, dxk, dxv added to with acc: grouped-query attention, a KV head's
// query heads one after the other in increasing order). progress is called
// after each key tile. Bit-identical to pass B + pass A: the same tile
// pairs with the same widths; every dq element receives the same terms in
// the same (key tile) order as in pass B, every dk, dv element in the same
// (query heads, then query tiles, increasing) order as in pass A.
void mha__flash_bwd_head(const mha__kernels *kt, const mha__flash_head *a, const float *dO,
                         int64_t do_rs, float *Dsum, float *dq, int64_t dq_rs, float *dk,
                         int64_t dk_rs, float *dv, int64_t dv_rs, float *dxk, float *dxv,
                         bool acc, float *scratch);

// The same in bf16 (a head that mha__flash_bf16 computes in bf16: bf16 q,
// k, v, no appended keys, f32_compute false; its forward rows, O and
// stats, from the bf16 forward): per tile pair S = scale (q k^T) and dP =
// dO v^T with bf16 operands and float32 sums, P, dS in float32 as above,
// then scale dS and P' rounded to bf16 (FlashAttention's convention) for
// dq += (scale dS) k, dk += (scale dS)^T q and dv += P'^T dO, summed in
// float32 (gemm_bf16) into dq (L, D), dk, dv (S, D / Dv): the same tile
// pairs as mha__flash_bwd_head and every element's terms in its order, so
// the same bits whatever the threads; the loop runs query tiles outer
// (each tile's q and dO rows staged and packed once; the key tiles' packed
// K, V from the head's cache) and calls progress after each query tile. dO: the float32 rows (Dsum from O), dO16 the same rows in bf16
// (row stride d16_rs) for the products.
void mha__flash_bwd_head_bf16(const mha__kernels *kt, const mha__flash_head *a, const float *dO,
                              int64_t do_rs, const uint16_t *dO16, int64_t d16_rs, float *Dsum,
                              float *dq, int64_t dq_rs, float *dk, int64_t dk_rs, float *dv,
                              int64_t dv_rs, bool acc, float *scratch);

#endif
