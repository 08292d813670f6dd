// plan.h: what forward.c and backward.c share: argument checks, the
// forward's plan (dims, strides, masks, scratch layout) and the input
// projections.
#ifndef MHA_PLAN_H
#define MHA_PLAN_H

#include "check.h"
#include "kernels/kernels.h"
#include "module.h"
#include "mask.h"
#include "philox.h"
#include "rope.h"
#include "view.h"

// A part of the heads, for the distributed layer (src/mpi): the KV heads
// [g0, g1) and their query heads; every other head is skipped as if pruned
// (zero context). Forward: only the range's Q/K/V projections and
// attention; with ctx (Rq, E), the ungated context is written there (the
// range's columns; the rest zero) and the forward stops before W_O; without,
// the output is the range's share ctx_range W_O[:, range]^T (+
// out_proj.bias only when bias). Backward: the range's share of every
// gradient (the other heads' rows and columns exactly 0; out_proj.bias's
// only when bias; grad_query/key/value the range's share dq W_Q[range] +
// ...); dq, dk, dv (when non-NULL: (Rq, E), (Rk, Ekv), (Rk, Ekv)) get the
// projections' gradients (the range's columns, the rest 0).
struct mha__attn_io;
typedef struct mha__part {
    int64_t g0, g1;
    float *ctx;
    bool bias;
    float *dq, *dk, *dv;
    float *dz;  // backward, dynamic gates: (Rq, H) the gates' logit gradients
    // Forward, sequence parallelism: with q_out, stop after the projections
    // (of the range; RoPE applied at the views' positions) and copy them out:
    // q_out (Rq, E), k_out, v_out (Rk, Ekv), rows as the views'. With q_in,
    // skip the projections and RoPE and attend with these instead (rows as
    // the plan's views, whose data are then not read: only their shapes
    // count); the context goes to ctx.
    float *q_out, *k_out, *v_out;
    const float *q_in, *k_in, *v_in;
    // Ring attention (a block of keys): the queries' position minus the
    // keys' (causal, window and ALiBi see global positions); the whole
    // key_padding_mask and the block's first key in it (the args carry
    // none); stats (N, H, L, 2): each row's max and 1/sum, as flash.h.
    int64_t q_off;
    const mha_tensor *kpm_full;
    int64_t kpm_off;
    float *stats;
    // Ring attention, the whole call on a rank's tokens: attn replaces the
    // attention step (mha__part_forward: called once to fill io->ctx;
    // mha__part_backward: once so, then again with io->dctx to fill dq,
    // dk, dv), the rest (projections, RoPE, gates, W_O, every gradient) is
    // the fused path's. rope_pos (the view's T tokens): token t's position
    // is rope_start[n] + rope_pos[t] (NULL: t).
    mha_status (*attn)(void *arg, const struct mha__attn_io *io);
    void *attn_arg;
    const int64_t *rope_pos;
    // Between tiles, on the calling thread (OpenMP thread 0; NULL: none):
    // ring attention drives its messages from there.
    void (*progress)(void *arg);
    void *progress_arg;
    // When non-NULL: += the (query tile, key tile) pairs whose scores the
    // attention computed (mha__part_forward, mha__part_attn_backward).
    int64_t *tiles;
    // mha__part_attn_backward (a block of keys, q_in/k_in/v_in as the
    // forward's): o_in, do_in (Rq, E) the whole attention's context and its
    // gradient, stats (as above) its rows' max and 1/sum, dsum_in (N, H, L)
    // rowsum(do_in * o_in) per head; dq (Rq, E), dk, dv (Rk, Ekv) are
    // overwritten with this block's terms.
    const float *o_in, *do_in, *dsum_in;
} mha__part;

// What a part's attn callback sees: row matrices laid out as the views
// ((t, n) rows when seq_first, else (n, t)); q (N L rows, stride ldq), k
// and v (N S rows, stride ldk) after RoPE; ctx (N L, E). Backward: dctx
// given; dq, dk, dv to write (strides ldq, ldk; before the inverse RoPE).
typedef struct mha__attn_io {
    int64_t N, L, S;
    bool seq_first;
    const float *q, *k, *v;
    int64_t ldq, ldk;
    float *ctx;
    const float *dctx;
    float *dq, *dk, *dv;
    // With a saved state (mha_forward_args.save): N H L 2 floats it keeps,
    // the forward's to fill with what the backward needs (the backward then
    // gets q, k, v, ctx and these from the state, without a forward call).
    float *stats;
} mha__attn_io;

typedef struct fwd_plan {
    int64_t L, S, Sp, N, E, H, d, kdim, vdim;  // Sp = S + appended keys
    int64_t Hkv, Ekv;  // KV heads (dividing H) and their width Hkv * d
    bool unbatched;
    // element strides of query/key/value as (seq, batch, feature)
    int64_t qs[3], ks[3], vs[3];
    mha__mask mask;
    mha__dropout drop;       // attention dropout (drop.p > 0 when active)
    float out_p;             // output dropout p (0: none)
    mha_shape out_shape, w_shape;
    // ALiBi slopes (mask.alibi points here or at the caller's)
    float alibi_default[MHA__ALIBI_MAX_DEFAULT];
    // the weights block: heads [wh0, wh1), rows [wr0, wr1); w_block when it
    // is not everything
    int64_t wh0, wh1, wr0, wr1;
    bool w_block;
    // scratch layout, byte offsets into one block (64-byte aligned pieces)
    size_t off_q, off_k, off_v, off_ctx, off_headw, off_scores, off_trace, off_gate;
    size_t ws_bytes;
    int nthreads;
    const mha__part *part;  // NULL: every head
    // the fused path (fused.c): its own scratch layout
    bool fused;
    bool self_packed;            // one GEMM over the packed in_proj_weight
    bool q_direct, k_direct, v_direct, out_direct;  // views usable as rows
    size_t f_xq, f_xk, f_xv, f_wt, f_wo, f_qkv, f_k, f_v, f_ctx, f_extra,
        f_lse, f_headw, f_out, f_scratch, f_gs, f_wtmp, f_wh, f_gate, f_gctx, f_wg;
} fwd_plan;

// Whether query head h runs in this plan (not pruned, in the part); the
// first such head of KV head g (G query heads each), or -1.
static inline bool mha__plan_head_live(const fwd_plan *p, const mha_module *m, int64_t h) {
    const int64_t g = h / (p->H / p->Hkv);
    return mha__head_live(m, h) && (!p->part || (g >= p->part->g0 && g < p->part->g1));
}
static inline int64_t mha__plan_group_first_live(const fwd_plan *p, const mha_module *m,
                                                 int64_t g, int64_t G) {
    if (p->part && (g < p->part->g0 || g >= p->part->g1)) return -1;
    return mha__group_first_live(m, g, G);
}

// The distributed layer's entry points (fused path, float32; fused.c).
mha_status mha__part_forward(mha_tensor *out, const mha_module *m, const mha_forward_args *a,
                             const mha__part *part);
mha_status mha__part_backward(mha_tensor *gq, mha_tensor *gk, mha_tensor *gv, mha_module *grads,
                              const mha_module *m, const mha_forward_args *a,
                              const mha_tensor *gout, const mha__part *part);
// The input gradients from the full projection gradients (what the
// single-process fused backward computes from them, bit for bit):
// grad_query = dq W_Q (+ dz W_g with dynamic gates), grad_key = dk W_K,
// grad_value = dv W_V; each output may be NULL; accumulate: added to them
// (in the backward's order).
mha_status mha__part_input_grads(mha_tensor *gq, mha_tensor *gk, mha_tensor *gv,
                                 const mha_module *m, const mha_forward_args *a,
                                 const float *dq, const float *dk, const float *dv,
                                 const float *dz, bool accumulate);
// The rest of the forward from a full context ctx (Rq, E, ungated): the
// gates, W_O and the output dropout, into out (what the single-process
// fused forward computes from its context, bit for bit).
mha_status mha__part_out_project(mha_tensor *out, const mha_module *m,
                                 const mha_forward_args *a, const float *ctx);

// The backward of one block's attention (ring attention; the part's
// o_in, do_in, stats, dsum_in, q_in, k_in, v_in; dq, dk, dv written).
mha_status mha__part_attn_backward(const mha_module *m, const mha_forward_args *a,
                                   const mha__part *part);
// The plan of a part (fused path, no weights, saved state or trace; a2 the
// args it runs with; the range, q_off and the block's mask columns set).
mha_status mha__part_plan(fwd_plan *p, mha_forward_args *a2, const mha_module *m,
                          const mha_forward_args *a, const mha__part *part);

// The state a training forward keeps (mha_forward_args.save). Layout of
// buf (floats): the projections as the fused backward lays them out
// (self_packed: (Rq, E + 2 Ekv); else q (Rq, E), k (Rk, Ekv), v (Rk, Ekv)),
// then the context (Rq, E), then the row stats (N H L, 2).
typedef struct mha__saved_key {
    const mha_module *m;
    mha_tensor q, k, v, kpm, am;  // zeroed when absent
    bool causal, training;
    int64_t window_left, window_right;
    uint64_t seed, offset;
    // what shapes the saved q, k (RoPE) and the row stats (ALiBi, soft cap)
    mha_rope_mode rope_mode;
    double rope_theta;
    int64_t rope_dim;
    const int64_t *rope_start;
    bool alibi;
    const float *alibi_slopes;
    float softcap;
} mha__saved_key;

struct mha_saved {
    float *buf;
    size_t cap;   // floats
    bool valid;   // filled by a fused forward
    mha__saved_key key;
    size_t n_qkv, n_ctx, n_lse;
    // Set by the distributed layer (ring attention) after its forward: the
    // whole call's key (the masks its fused-path call does not see). Such a
    // state (its row stats in that layer's layout) serves only that layer's
    // backward; mha__saved_prepare clears it.
    bool outer_valid;
    mha__saved_key outer;
};

void mha__saved_key_of(mha__saved_key *k, const mha_module *m, const mha_forward_args *a);
// Sizes the saved state for plan p (may allocate). valid = false until the
// forward has filled it.
mha_status mha__saved_prepare(mha_saved *s, const fwd_plan *p, const mha_module *m,
                              const mha_forward_args *a);

// mha_kv_cache_attend with the queries q_shift positions later (q_shift >=
// T: every cached key visible; the check that each sequence holds its
// queries skipped when q_shift > 0) and, when stats is non-NULL, each
// row's max and 1/sum into stats (B, H, T, 2) ((-inf, 0): nothing
// visible): a shard's part of a sharded cache (mha_mpi.h).
mha_status mha__kv_cache_attend_ex(mha_tensor *out, const mha_tensor *q, const mha_kv_cache *c,
                                   const mha_cache_attend_args *args, const int64_t *counts,
                                   int64_t q_shift, float *stats);
// A cache's batch, KV heads and head dims.
void mha__kv_cache_dims(const mha_kv_cache *c, int64_t *B, int64_t *Hkv, int64_t *D,
                        int64_t *Dv);

// Checks every forward argument and fills the plan.
mha_status mha__plan_forward(fwd_plan *p, const mha_module *m,
                             const mha_forward_args *a);
// The fused path: checks what it needs (F32 views, no trace) and lays out
// its scratch (p->ws_bytes).
mha_status mha__fused_plan(fwd_plan *p, const mha_module *m,
                           const mha_forward_args *a);
// The widening scratch of a module with half weights (floats; the GEMM's
// packing of a half weight matrix, nt threads).
size_t mha__half_weight_floats(const mha__kernels *kt, const mha_module *m, int nt);
mha_status mha__fused_forward(const fwd_plan *p, mha_tensor *out, mha_tensor *weights,
                        const mha_module *m, const mha_forward_args *a, char *ws);
// Its last step alone, from a context ctx (Rq, E; gated in place).
void mha__fused_out_project(const fwd_plan *p, mha_tensor *out, const mha_module *m,
                            const mha_forward_args *a, float *ctx, char *ws);
// The fused scaled-dot-product attention: F32 views with unit last stride
// (checked by the caller), mask over (b, h, i, j). Allocates its scratch.
mha_status mha__fused_sdpa(mha_tensor *out, mha_tensor *weights, const mha_tensor *q,
                           const mha_tensor *k, const mha_tensor *v, const mha__mask *mk,
                           double scale);
// The fused backward (allocates its own scratch).
mha_status mha__fused_backward(const fwd_plan *p, mha_tensor *gq, mha_tensor *gk,
                               mha_tensor *gv, mha_module *grads, const mha_module *m,
                               const mha_forward_args *a, const mha_tensor *gout,
                               bool accumulate);

// The dropout descriptor for the heads: NULL unless attention dropout is
// active.
static inline const mha__dropout *mha__plan_drop(const fwd_plan *p) {
    return p->drop.p > 0.0f ? &p->drop : NULL;
}

#endif
