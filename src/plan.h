// plan.h: the planner's product (plan.c): what one forward or backward
// call will do, decided once from the module and the arguments: dims and
// strides, the mask, dropout, output shapes, the weights block, threads,
// the implementation and its scratch layout; and the saved state a
// training forward keeps for its backward (saved.c). Plan layer: base,
// kernels (for the GEMM and flash sizes) and the module only.
#ifndef MHA_PLAN_H
#define MHA_PLAN_H

#include "check.h"
#include "kernels/kernels.h"
#include "mask.h"
#include "module.h"
#include "philox.h"
#include "rope.h"
#include "view.h"

// The reference forward's scratch: byte offsets of its pieces in the one
// block (64-byte aligned; laid out once, by the planner), in double unless
// said.
typedef struct mha__ref_layout {
    size_t q;       // (N, L, Eq)
    size_t k, v;    // (N, Sp, Ekv)
    size_t ctx;     // (N, L, Eq)
    size_t headw;   // (N, H, L, Sp) every head's weights, to average or to
                    // write a block of (else none)
    size_t scores;  // per thread one (L, Sp) score block
    size_t trace;   // float32: the trace's copies (L * max(Sp, d), or a whole
                    // (N, Sp, Ekv) / (N, L, Eq) / (N, L, E) one)
    size_t gate;    // gated: (N, L, H)
} mha__ref_layout;

// The fused forward's scratch: byte offsets of its pieces in the one block
// (64-byte aligned; laid out once, by mha__fused_plan). Rq, Rk: the rows of
// the query and key views; sizes in floats.
typedef struct mha__fused_layout {
    size_t xq, xk, xv;  // the gathered input rows (Rq, E), (Rk, kdim), (Rk, vdim),
                        // when a view cannot be read in place
    size_t wt;          // the packed projection weights: in_proj_weight^T, or
                        // W_q^T, W_k^T, W_v^T one after the other
    size_t wo, wg;      // the packed W_o^T (Eq, E); W_g^T (dynamic gates)
    size_t gs;          // the GEMM's per-thread scratch
    size_t qkv, k, v;   // the projections: (Rq, Eq + 2 Ekv) packed, else q (Rq, Eq)
                        // here and k, v (Rk, Ekv)
    size_t ctx;         // the context (Rq, Eq)
    size_t extra;       // the appended keys per KV head: (Hkv, nx, d) for k, then v
    size_t lse;         // each row's (max, 1/sum) (N, H, L, 2), for the weights
    size_t headw;       // the selected heads' weights, to average (N, Hs, Ls, Sp)
    size_t wtmp;        // int8 weights: per thread a float tile (64, Sp)
    size_t out;         // the output rows (Rq, E) when the view is not row-direct
    size_t scratch;     // per thread the flash scratch
    size_t wh;          // half weights: the widening scratch
    size_t gate, gctx;  // gated: the gates (Rq, H); with a saved state, the gated
                        // context (Rq, Eq) (the state keeps the ungated one)
} mha__fused_layout;

typedef struct fwd_plan {
    int64_t L, S, Sp, N, E, H, d, kdim, vdim;  // Sp = S + appended keys
    int64_t Hkv, Ekv;                          // KV heads (dividing H) and their width Hkv * d
    int64_t Eq;                                // the queries' width H d (E unless head_dim)
    double scale;                              // the query scale: custom, or 1 / sqrt(d)
    bool unbatched;
    // element strides of query/key/value as (seq, batch, feature)
    int64_t qs[3], ks[3], vs[3];
    mha__mask mask;
    mha__dropout drop;  // attention dropout (drop.p > 0 when active)
    float out_p;        // output dropout p (0: none)
    mha_shape out_shape, w_shape;
    // ALiBi slopes (mask.alibi points here or at the caller's)
    float alibi_default[MHA__ALIBI_MAX_DEFAULT];
    // RoPE: the call's largest position + 1 (dynamic NTK scaling's seq)
    int64_t rope_seq;
    // the weights block: heads [wh0, wh1), rows [wr0, wr1); w_block when it
    // is not everything
    int64_t wh0, wh1, wr0, wr1;
    bool w_block;
    // the reference's scratch layout (its pieces in one block)
    mha__ref_layout r;
    size_t ws_bytes;
    int nthreads;
    // the KV heads [g0, g1) it runs (and their query heads): [0, Hkv) unless
    // a distributed part's range
    int64_t g0, g1;
    // the fused path (fused_fwd.c, fused_bwd.c): its own scratch layout
    bool fused;
    bool self_packed;                               // one GEMM over the packed in_proj_weight
    bool q_direct, k_direct, v_direct, out_direct;  // views usable as rows
    mha__fused_layout f;
} fwd_plan;

// Whether query head h runs in this plan (not pruned, in the part); the
// first such head of KV head g (G query heads each), or -1.
static inline bool mha__plan_head_live(const fwd_plan *p, const mha_module *m, int64_t h) {
    const int64_t g = h / (p->H / p->Hkv);
    return mha__head_live(m, h) && g >= p->g0 && g < p->g1;
}
static inline int64_t mha__plan_group_first_live(const fwd_plan *p, const mha_module *m,
                                                 int64_t g, int64_t G) {
    if (g < p->g0 || g >= p->g1) return -1;
    return mha__group_first_live(m, g, G);
}


// Checks every forward argument and fills the plan.
mha_status mha__plan_forward(fwd_plan *p, const mha_module *m, const mha_forward_args *a);
// The fused path: checks what it needs (F32 views, no trace) and lays out
// its scratch (p->ws_bytes).
mha_status mha__fused_plan(fwd_plan *p, const mha_module *m, const mha_forward_args *a);
// MHA_ERR_UNSUPPORTED for a part of a call (the distributed layer's hooks,
// pt != NULL) of a module with qk_norm: a part projects only its heads'
// columns, and the norm over all features needs every head's; the whole
// call (pt NULL) applies it.
mha_status mha__fused_part_qk_norm(const mha_module *m, const void *pt);
// The widening scratch of a module with half weights (floats; the GEMM's
// packing of a half weight matrix, nt threads).
size_t mha__half_weight_floats(const mha__kernels *kt, const mha_module *m, int nt);
// The output views of a planned forward (attn_output, and the weights when
// asked: shape, dtype, int8 scales, no aliasing with the inputs).
mha_status mha__check_forward_outputs(const fwd_plan *p, mha_tensor *out, mha_tensor *weights,
                                      const mha_forward_args *a);
// A backward's gradient views and gradient module against the plan of its
// forward (shapes, configuration, no aliasing).
mha_status mha__check_backward(const fwd_plan *p, mha_tensor *gq, mha_tensor *gk,
                               mha_tensor *gv, const mha_module *grads, const mha_module *m,
                               const mha_forward_args *a, const mha_tensor *gout);
// The dropout descriptor for the heads: NULL unless attention dropout is
// active.
static inline const mha__dropout *mha__plan_drop(const fwd_plan *p) {
    return p->drop.p > 0.0f ? &p->drop : NULL;
}

// The saved state of a training forward (mha_forward_args.save): the key
// of the forward it belongs to, and one buffer: the projections as the
// backward lays them out (mha__qkv_floats, after the norm and RoPE), then
// the context (Rq, Eq), then the row stats (N H L, 2), then (qk_norm) q
// (Rq, Eq) and k (Rk, Ekv) before the norm.
typedef struct mha__saved_key {
    const mha_module *m;
    mha_tensor q, k, v, kpm, am;  // zeroed when absent
    bool causal, training;
    int64_t window_left, window_right;
    uint64_t seed, offset;
    // what shapes the saved q, k (RoPE) and the row stats (ALiBi, soft cap,
    // the scale)
    mha_rope_mode rope_mode;
    double rope_theta;
    int64_t rope_dim;
    const int64_t *rope_start;
    const int64_t *rope_positions;
    mha_rope_scaling rope_scaling;  // type NONE when none (fields set one by one)
    bool alibi;
    const float *alibi_slopes;
    float softcap;
    const float *sinks;  // (mha_sdpa's; a module's are its parameter)
    float dropout_p;     // (mha_sdpa's; a module's is in its config)
    double scale;
} mha__saved_key;

struct mha_saved {
    float *buf;
    size_t cap;  // floats
    bool valid;  // filled by a fused forward
    mha__saved_key key;
    size_t n_qkv, n_ctx, n_lse;
    size_t n_xqk;  // qk_norm: q (Rq, Eq) and k (Rk, Ekv) before the norm; else 0
    // Set by the distributed layer (ring attention) after its forward: the
    // whole call's key (the masks its fused-path call does not see). Such a
    // state (its row stats in that layer's layout) serves only that layer's
    // backward; mha__saved_prepare clears it.
    bool outer_valid;
    mha__saved_key outer;
    // The forward computed in bf16 (fused.h, mha__fused_train_bf16): q, k, v
    // and the context rows hold bf16 in place (linear.h,
    // mha__bf16_rows_in_place).
    bool bf16;
};

void mha__saved_key_of(mha__saved_key *k, const mha_module *m, const mha_forward_args *a);
// mha_sdpa's key (m NULL) and sizing: O (B, H, L, Dv) in n_ctx, the row
// stats (B, H, L, 2) in n_lse; valid = false until the fused sdpa has
// filled it.
void mha__saved_key_of_sdpa(mha__saved_key *k, const mha_sdpa_args *a);
mha_status mha__saved_prepare_sdpa(mha_saved *s, const mha_sdpa_args *a, int64_t B, int64_t H,
                                   int64_t L, int64_t Dv);
// Sizes the saved state for plan p (may allocate). valid = false until the
// forward has filled it.
mha_status mha__saved_prepare(mha_saved *s, const fwd_plan *p, const mha_module *m,
                              const mha_forward_args *a);

// mha_kv_cache_attend with the queries q_shift positions later (q_shift >=

// Floats of the projections as the fused backward (and the saved state)
// lay them out: (Rq, Eq + 2 Ekv) packed, else q (Rq, Eq), k and v (Rk, Ekv).
size_t mha__qkv_floats(const fwd_plan *p, int64_t Rq, int64_t Rk);
// Floats of q (Rq, Eq) and k (Rk, Ekv) before the QK-norm, which the
// saved state and the fused backward keep (0 without qk_norm).
size_t mha__xqk_floats(const fwd_plan *p, const mha_module *m, int64_t Rq, int64_t Rk);
// Two saved keys are the same forward's (both filled by mha__saved_key_of).
bool mha__saved_key_equal(const mha__saved_key *x, const mha__saved_key *y);

#endif
