// ref.h: the reference implementation (the oracle): plain loops, the full
// score matrix, everything computed in double. Inputs and outputs may be
// float32 or float64 views; with float64 views the whole forward and
// backward are a float64 computation (what the finite-difference gradient
// checks use). Kernels here trust their arguments: every check happens
// once, in the entry points and the planner (plan.c).
#ifndef MHA_REF_H
#define MHA_REF_H

#include "internal.h"
#include "mask.h"
#include "philox.h"
#include "plan.h"
#include "view.h"

// Score (b, h, i, j) from its scaled q.k: the soft cap, then the masks and
// ALiBi (mha__mask_value). The reference's step (2), element by element.
double mha__ref_logit(const mha__mask *mk, double scaled, int64_t b, int64_t h, int64_t i,
                      int64_t j);
// Softmax of one row of S scores in place, the reference's step (3): the
// row max subtracted; every score -inf (all keys masked) gives all 0; a
// NaN score makes the whole row NaN (as PyTorch).
void mha__ref_softmax_row(double *row, int64_t S);

// Attention of one (b, h):
//   scores (L, S) = scale * q (L, D) k (S, D)^T + mask(b, h, ., .)
//   P = softmax(scores) row by row (row max subtracted; a row whose every
//       score is -inf gets P = 0: the fully-masked-row rule)
//   out (L, Dv) = P v (S, Dv);  w (L, S) = P when w.p != NULL
//   with dropout: P <- P * keep / (1 - p) before weighting v; w gets the
//   dropped-out P (as PyTorch returns it)
// scores_ws: L*S doubles of scratch.
// tr: NULL, or a trace: the steps "scores", "scaled_scores", "weights",
// "context" are passed to tr->fn as float views of tr->buf (L*max(S, Dv)
// floats).
typedef struct mha__trace {
    mha_trace_fn fn;
    void *user;
    float *buf;
} mha__trace;

void mha__ref_attention_head(mha__mat out, mha__mat w, mha__mat q, mha__mat k, mha__mat v,
                             int64_t L, int64_t S, int64_t D, int64_t Dv, double scale,
                             const mha__mask *mk, const mha__dropout *drop, int64_t b,
                             int64_t h, double *scores_ws, const mha__trace *tr);

// Backward of mha__ref_attention_head for one (b, h), recomputing P from q,
// k and the masks (and the dropout mask from its seed):
//   dP' (L, S) = dout (L, Dv) v^T           (P' = P after dropout)
//   dv (S, Dv) = P'^T dout
//   dP = dP' * keep / (1 - p)
//   dS = P * (dP - rowsum(dP * P))          (softmax backward; 0 where P = 0)
//   dq (L, D) = scale * dS k;  dk (S, D) = scale * dS^T q
// dq, dk, dv are overwritten. out (if out.p) receives the recomputed
// forward result P' v. ws: 2*L*S doubles of scratch.
void mha__ref_attention_head_backward(mha__mat dq, mha__mat dk, mha__mat dv, mha__mat out,
                                      mha__mat dout, mha__mat q, mha__mat k, mha__mat v,
                                      int64_t L, int64_t S, int64_t D, int64_t Dv, double scale,
                                      const mha__mask *mk, const mha__dropout *drop, int64_t b,
                                      int64_t h, double *ws);

// y(0, o) = sum_i x(0, i) * W[o][i] + (b ? b[o] : 0) for o < O: row 0 of
// y and x; W (O, I) row-major, elements of wdt (F32, BF16 or F16).
void mha__ref_linear_row(mha__mat y, mha__mat x, const void *W, mha_dtype wdt, const float *b,
                         int64_t I, int64_t O);

// ---------------------------------------------------------------------------
// The module-level reference (ref_module.c), in double, on a finished plan.

// Step 1 of the forward: q (N, L, E), k and v (N, Sp, Ekv) from the inputs,
// with bias_k/bias_v and the zero key/value appended (and RoPE applied).
void mha__project_qkv(const fwd_plan *p, const mha_module *m, const mha_forward_args *a,
                      double *q, double *k, double *v);
// The head gates of a gated module, (N, L, H) in double: g[(n L + t) H + h]
// (static: head_gate[h]; dynamic: sigmoid(x_q[t, n, :] W_g[h, :] + b_g[h])).
void mha__gates_d(const fwd_plan *p, const mha_module *m, const mha_forward_args *a, double *g);
// RoPE on the reference's q (N, L, E) and k (N, Sp, Ekv) (keys t < S), or its
// transpose (inverse: the gradients).
void mha__rope_qk_d(const fwd_plan *p, const mha_forward_args *a, double *q, double *k,
                    bool inverse);
// The forward into out (and weights when asked), ws the plan's scratch
// (p->r, 64-byte aligned).
void mha__ref_forward(const fwd_plan *p, mha_tensor *out, mha_tensor *weights,
                      const mha_module *m, const mha_forward_args *a, char *ws);
// The backward (every gradient; = or += by accumulate); allocates its
// scratch.
mha_status mha__ref_backward(const fwd_plan *p, mha_tensor *gq, mha_tensor *gk, mha_tensor *gv,
                             mha_module *grads, const mha_module *m, const mha_forward_args *a,
                             const mha_tensor *gout, bool accumulate);

#endif
