// fused.h: the fused path's drivers (fast layer: fused_fwd.c, fused_bwd.c)
// and the hooks they offer a caller that runs only part of a call (the
// distributed layer, through part.c): a range of heads, projections given
// or taken, the attention step replaced, a progress callback between tiles.
// The drivers read these hooks and know nothing else of their caller.
#ifndef MHA_FUSED_H
#define MHA_FUSED_H

#include "linear.h"
#include "plan.h"

struct mha__attn_io;

// The hooks the fused drivers offer a caller that runs only a part of a
// call (the distributed layer, through part.c). Each is off when zeroed.

// What a part hands back instead of finishing the call. Forward, with
// ctx (Rq, E): the ungated context is written there (the range's columns;
// the rest zero) and the forward stops before W_O. Backward: dq, dk, dv
// (when non-NULL: (Rq, E), (Rk, Ekv), (Rk, Ekv)) get the projections'
// gradients (the range's columns, the rest 0); dz (Rq, H), with dynamic
// gates, the gates' logit gradients.
typedef struct mha__part_out {
    float *ctx;
    float *dq, *dk, *dv, *dz;
} mha__part_out;

// Sequence parallelism (the forward). With q_out: stop after the
// projections (of the range; RoPE applied at the views' positions) and copy
// them out: q_out (Rq, E), k_out, v_out (Rk, Ekv), rows as the views'. With
// q_in: skip the projections and RoPE and attend with these instead (rows
// as the plan's views, whose data are then not read: only their shapes
// count); the context goes to out.ctx.
typedef struct mha__part_proj {
    float *q_out, *k_out, *v_out;
    const float *q_in, *k_in, *v_in;
} mha__part_proj;

// Ring attention, one block of keys: q_off, the queries' position minus
// the keys' (causal, window and ALiBi see global positions); the whole
// key_padding_mask and the block's first key in it (the args carry none);
// stats (N, H, L, 2): each row's max and 1/sum, as flash.h. The block's
// attention backward (mha__part_attn_backward, proj.q_in/k_in/v_in as the
// forward's) also reads o_in, do_in (Rq, E), the whole attention's context
// and its gradient, and dsum_in (N, H, L), rowsum(do_in * o_in) per head;
// out.dq, dk, dv are overwritten with this block's terms.
typedef struct mha__part_block {
    int64_t q_off;
    const mha_tensor *kpm_full;
    int64_t kpm_off;
    float *stats;
    const float *o_in, *do_in, *dsum_in;
} mha__part_block;

// Ring attention, the whole call on a rank's tokens: fn replaces the
// attention step (mha__part_forward: called once to fill io->ctx;
// mha__part_backward: once so, then again with io->dctx to fill dq, dk,
// dv); the rest (projections, RoPE, gates, W_O, every gradient) is the
// fused path's. rope_pos (the view's T tokens): token t's position is
// rope_start[n] + rope_pos[t] (NULL: t).
typedef struct mha__part_attn {
    mha_status (*fn)(void *arg, const struct mha__attn_io *io);
    void *arg;
    const int64_t *rope_pos;
} mha__part_attn;

// Between tiles, on the calling thread (OpenMP thread 0): fn(arg) (ring
// attention drives its messages from there); tiles, when non-NULL: += the
// (query tile, key tile) pairs whose scores the attention computed
// (mha__part_forward, mha__part_attn_backward).
typedef struct mha__part_progress {
    void (*fn)(void *arg);
    void *arg;
    int64_t *tiles;
} mha__part_progress;

// A part of a call: the KV heads [g0, g1) and their query heads (every
// other head is skipped as if pruned: zero context), and the hooks above.
// Forward: only the range's Q/K/V projections and attention; without
// out.ctx, the output is the range's share ctx_range W_O[:, range]^T (+
// out_proj.bias only when bias). Backward: the range's share of every
// gradient (the other heads' rows and columns exactly 0; out_proj.bias's
// only when bias; grad_query/key/value the range's share dq W_Q[range] +
// ...).
typedef struct mha__part {
    int64_t g0, g1;
    bool bias;
    mha__part_out out;
    mha__part_proj proj;
    mha__part_block block;
    mha__part_attn attn;
    mha__part_progress progress;
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

// The fused forward of plan p into out (and weights when asked), ws the
// plan's scratch (p->f_*, 64-byte aligned); pt: a part's hooks (above),
// NULL for a whole call.
mha_status mha__fused_forward(const fwd_plan *p, mha_tensor *out, mha_tensor *weights,
                              const mha_module *m, const mha_forward_args *a, char *ws,
                              const mha__part *pt);
// Its last step alone, from a context ctx (Rq, E; gated in place).
void mha__fused_out_project(const fwd_plan *p, mha_tensor *out, const mha_module *m,
                            const mha_forward_args *a, float *ctx, char *ws);
// The fused scaled-dot-product attention: F32 views with unit last stride
// (checked by the caller), mask over (b, h, i, j), attention dropout drop
// (NULL: none; over (B, H, L, S), h the query head). Allocates its scratch.
// Whether mha__fused_forward (no part) computes in bf16: a module with
// bf16 weight matrices, bf16 query, key and value, no appended keys, when
// it saves its state one that trains in bf16 (mha__fused_train_bf16_module),
// on a table that computes bf16.
bool mha__fused_forward_bf16(const mha_module *m, const mha_forward_args *a);
// Whether mha__fused_backward (no part) computes in bf16: the forward's
// conditions and a module that trains in bf16 (a saved state from such a
// forward holds bf16 rows; one from another forward is refused).
bool mha__fused_backward_bf16(const mha_module *m, const mha_forward_args *a);
// Its module part: no gates, every projection width (E, kdim, vdim, Eq)
// at least 32 (mha__linear_rows_bf16's bf16 shapes).
bool mha__fused_train_bf16_module(const mha_module *m);
// Whether mha__fused_sdpa on these views computes its products in bf16
// (mha__flash_bf16).
bool mha__fused_sdpa_bf16(const mha_tensor *q, const mha_tensor *k, const mha_tensor *v);
// sv: NULL, or a state sized by mha__saved_prepare_sdpa: each head's O
// rows (float32, before any rounding into out) and row stats go there, and
// it is marked valid (bf16: whether the heads computed in bf16).
mha_status mha__fused_sdpa(mha_tensor *out, mha_tensor *weights, const mha_tensor *q,
                           const mha_tensor *k, const mha_tensor *v, const mha__mask *mk,
                           const mha__dropout *drop, double scale, mha_saved *sv);
// Whether mha__fused_sdpa_backward computes its products in bf16: bf16 q,
// k, v and dout on a table that computes bf16 (flash.h,
// mha__flash_bwd_head_bf16); dq, dk, dv of any type.
bool mha__fused_sdpa_backward_bf16(const mha_tensor *q, const mha_tensor *k,
                                   const mha_tensor *v, const mha_tensor *dout);
// The fused backward of mha__fused_sdpa: dq (B, H, L, D), dk (B, Hkv, S,
// D), dv (B, Hkv, S, Dv) written from dout (B, H, L, Dv), drop the
// forward's; F32 views with unit last stride (checked by the caller).
// dsinks: NULL, or (H) written with the gradient of mk->sinks (given).
// Allocates its scratch. sv: NULL, or this call's forward's valid state
// (checked by the caller): its O and row stats replace the forward's rows
// when it computed in this backward's precision (the same bits).
mha_status mha__fused_sdpa_backward(mha_tensor *dq, mha_tensor *dk, mha_tensor *dv,
                                    float *dsinks, const mha_tensor *dout, const mha_tensor *q,
                                    const mha_tensor *k, const mha_tensor *v,
                                    const mha__mask *mk, const mha__dropout *drop,
                                    double scale, const mha_saved *sv);
// The fused backward (allocates its own scratch); pt as for the forward.
mha_status mha__fused_backward(const fwd_plan *p, mha_tensor *gq, mha_tensor *gk,
                               mha_tensor *gv, mha_module *grads, const mha_module *m,
                               const mha_forward_args *a, const mha_tensor *gout,
                               bool accumulate, const mha__part *pt);
// dX (view, rows in the view's order) (+)= d (R, O) W (O, I) (the fused
// backward's input gradients; tmp R * I floats, bp packed W, gs GEMM
// scratch).
void mha__grad_input_rows(const mha__kernels *kt, mha_tensor *gx, bool acc, const float *d,
                          int64_t ldd, mha__wmat W, int64_t R, int64_t O, int64_t I,
                          float *tmp, float *bp, float *gs, int nt);

#endif
