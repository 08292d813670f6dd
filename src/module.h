// module.h: the module struct (model layer): its configuration and its
// parameters as named pointers into one block, read by every layer above.
#ifndef MHA_MODULE_H
#define MHA_MODULE_H

#include "internal.h"
#include "kernels/kernels.h"

#define MHA__MAX_PARAMS 16  // (q, k, v, biases, bias_k/v, out, gates, sinks, norms)

struct mha_module {
    mha_config cfg;    // kdim/vdim resolved
    bool packed;       // in_proj_weight (kdim == vdim == E, not separate_qkv)
    int64_t head_dim;  // d: cfg.head_dim, or E / H
    int64_t q_dim;     // Eq = H d (E unless head_dim is set)
    int64_t kv_dim;    // Ekv = num_kv_heads * d (Eq without GQA)
    int nparams;
    mha_param params[MHA__MAX_PARAMS];
    void *block;  // one allocation holding every parameter
    // The weight matrices in their storage dtype wdt (cfg.weight_dtype):
    // w_in (Eq + 2 Ekv, E) when packed (w_q, w_k, w_v its rows), else
    // w_q (Eq, E), w_k (Ekv, kdim), w_v (Ekv, vdim); w_out (E, Eq).
    mha_dtype wdt;
    void *w_in, *w_q, *w_k, *w_v, *w_out;
    // Named float32 pointers into block (NULL when absent; the weight
    // matrices' are NULL unless wdt is MHA_F32):
    float *in_proj_weight;                  // (Eq + 2 Ekv, E) when packed
    float *q_weight, *k_weight, *v_weight;  // (Eq, E), (Ekv, kdim), (Ekv, vdim);
                                            // rows of in_proj_weight if packed
    float *in_proj_bias;                    // (Eq + 2 Ekv): Q, K, V biases
    float *bias_k, *bias_v;                 // (Ekv)
    float *out_weight;                      // (E, Eq)
    float *out_bias;                        // (E); NULL with no_out_bias
    float *head_gate;                       // (H), MHA_GATE_STATIC
    float *gate_weight, *gate_bias;         // (H, E), (H), MHA_GATE_DYNAMIC
    float *sinks;                           // (H), cfg.sinks
    float *q_norm, *k_norm;                 // qk_norm: (d), (d) per head, or
                                            // (Eq), (Ekv) over all features
    bool *pruned;                           // (H): head h skipped
    int64_t npruned;
    struct mha__packs *packs;  // the packed weights (packs.c), or NULL
};

// The packed projection weights (packs.c): every float32 weight matrix of
// the projections (in_proj_weight or q/k/v_proj_weight, out_proj.weight,
// gate_proj.weight) as mha__gemm_pack_wt lays it out for the process's
// kernel table, and, bf16 weights on a table that computes bf16 (bf_fast),
// the bf16 matrices of that compute as pack_bf16 lays them out, and half
// weights (bf16, f16) as mha__gemm_pack_wt_bh lays them out (the float32
// compute's packing in their type); filled by
// the first call that wants it after a change, so that calls multiply by
// it without packing first (the same bits).
typedef struct mha__packs mha__packs;

// At mha_module_create, after the parameters are bound: allocates the
// packed copy (m->packs; NULL when nothing is kept), stale.
mha_status mha__packs_create(mha_module *m);
void mha__packs_destroy(mha__packs *pk);
// Bytes the packed copy takes (0: none).
size_t mha__packs_bytes(const mha_module *m);
// The parameters changed (or may change): the copy is not used again until
// it is filled anew. Any thread, any time (one atomic operation).
void mha__packs_stale(const mha_module *m);
// The packed copy for reading during one call (kt: the call's kernel
// table; nt: threads to fill it with when it is stale), or NULL: pack per
// call (another table, or another thread filling it or still reading the
// stale one). Never blocks; a non-NULL result must be given
// back with mha__packs_release once the call no longer reads it.
const mha__packs *mha__packs_acquire(const mha_module *m, const mha__kernels *kt, int nt);
void mha__packs_release(const mha__packs *pk);  // (NULL: nothing)
// The packed form of rows [r0, r0 + O) of a packed weight, w pointing at
// row r0 of it (I columns), when r0 is a multiple of the panel width
// (kernels.h: a panel-aligned slice); else NULL (pk NULL included).
const float *mha__packs_find(const mha__packs *pk, const void *w, int64_t O, int64_t I);
// The same for a half weight in its type (mha__gemm_pack_wt_bh's form).
const uint16_t *mha__packs_find_bh(const mha__packs *pk, const void *w, int64_t O, int64_t I);
// The pack_bf16 form of the whole bf16 weight w (O, I), or NULL (pk NULL,
// or not kept).
const uint16_t *mha__packs_find_bf16(const mha__packs *pk, const void *w, int64_t O, int64_t I);

// The qk_norm epsilon: cfg.qk_norm_eps, 0 meaning 1e-6.
static inline double mha__qk_norm_eps(const mha_module *m) {
    return m->cfg.qk_norm_eps > 0.0f ? (double)m->cfg.qk_norm_eps : 1e-6;
}

static inline bool mha__head_live(const mha_module *m, int64_t h) { return !m->pruned[h]; }

// The first live query head of KV head g (G query heads each), or -1.
static inline int64_t mha__group_first_live(const mha_module *m, int64_t g, int64_t G) {
    for (int64_t h = g * G; h < (g + 1) * G; h++)
        if (!m->pruned[h]) return h;
    return -1;
}

// Live heads among [h0, h1).
static inline int64_t mha__live_in(const mha_module *m, int64_t h0, int64_t h1) {
    int64_t n = 0;
    for (int64_t h = h0; h < h1; h++) n += !m->pruned[h];
    return n;
}

// Whether the heads' contexts are scaled before W_O (gates or pruning).
static inline bool mha__module_gated(const mha_module *m) {
    return m->cfg.head_gate != MHA_GATE_NONE;
}

// The widest input of the projections: max(E, kdim, vdim, Eq) (Eq: the
// output projection's).
static inline int64_t mha__module_max_in(const mha_module *m) {
    int64_t I = m->cfg.embed_dim;
    if (m->q_dim > I) I = m->q_dim;
    if (m->cfg.kdim > I) I = m->cfg.kdim;
    if (m->cfg.vdim > I) I = m->cfg.vdim;
    return I;
}

// q_norm.weight, k_norm.weight <- 1 (qk_norm; nothing otherwise).
void mha__qk_norm_reset(mha_module *m);

// dst's parameters <- src's (same config but for weight_dtype), converted
// to dst's storage.
void mha__copy_params(mha_module *dst, const mha_module *src);

// MHA_ERR_UNSUPPORTED naming `what` when m's weights are not float32
// (the optimizers, the distributed backward).
mha_status mha__require_f32_weights(const mha_module *m, const char *what);

#endif
