// tiny.h: the mha_tiny library (tools/tiny/): a tiny transformer classifier
// built on libmha's attention, for `mha train`, `mha demo heads` and
// tests/test_tiny.c. Public libmha API only; no printing, no pictures.
//
//   tokens (B, T) -> x = wte[tok] + wpe[t]                       (B, T, D)
//   n_layers pre-LN blocks:
//     x = x + MHA(LN1(x))          libmha: mha_forward / mha_backward
//     x = x + W2 GELU(W1 LN2(x) + b1) + b2                        (F = d_ff)
//   logits = Wc LNf(x[:, T-1]) + bc                               (B, V)
//   loss = mean over the batch of -log softmax(logits)[target]
//
// The classifier reads only the last position (the query token), so the last
// block computes its attention query, its residual and its MLP for that one
// row (the keys and values still come from every position): the same numbers
// as running it on every row and keeping the last one, for less work.
//
// The layers other than attention have their forward and backward here
// (plain loops on float pointers + dims, outputs first, shapes in comments;
// every backward quotes the forward line it differentiates). GELU is the
// tanh approximation (GPT-2, torch's approximate="tanh").
//
// Gradients: the parameter gradients of our own layers ACCUMULATE (+=), as
// in llm.c; tiny_zero_grad (or mha_optim_zero_grad) clears them. The
// attention modules' gradients are written by mha_backward with
// accumulate = false (=), once per step.
//
// Subnormal floats: once attention gets sharp, gradients for keys whose
// weight underflowed are ~1e-40 and turn subnormal, and every multiply with
// a subnormal is ~100x slower on x86 (measured: 25k -> 2k tokens/s in the
// middle of a run). Long training runs should set flush-to-zero and
// denormals-are-zero (as `mha train` does); nothing here changes the
// floating-point environment.
//
// What it deliberately does not do: padding, variable lengths, generation,
// saving checkpoints.
#ifndef MHA_TINY_H
#define MHA_TINY_H

#include <stdbool.h>
#include <stdint.h>

#include "mha.h"

// ---------------------------------------------------------------------------
// Layers (exposed for the gradient checks in tests/test_tiny.c)

// out = (inp - mean) / sqrt(var + 1e-5) * w + b over the last dim C.
// out, inp (N, C); mean, rstd (N) saved for the backward; w, b (C).
void tiny_layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                            const float *w, const float *b, int64_t N, int64_t C);
// dinp, dw, db += gradients (accumulate).
void tiny_layernorm_backward(float *dinp, float *dw, float *db, const float *dout,
                             const float *inp, const float *w, const float *mean,
                             const float *rstd, int64_t N, int64_t C);

// out = inp W^T + b (nn.Linear). out (N, OC), inp (N, IC), W (OC, IC),
// b (OC) or NULL.
void tiny_linear_forward(float *out, const float *inp, const float *W, const float *b,
                         int64_t N, int64_t IC, int64_t OC);
// dinp (N, IC), dW (OC, IC), db (OC) += gradients; dinp or db may be NULL.
void tiny_linear_backward(float *dinp, float *dW, float *db, const float *dout,
                          const float *inp, const float *W, int64_t N, int64_t IC, int64_t OC);

// out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), elementwise, n.
void tiny_gelu_forward(float *out, const float *inp, int64_t n);
// dinp += dout * gelu'(inp).
void tiny_gelu_backward(float *dinp, const float *inp, const float *dout, int64_t n);

// out[b, t] = wte[tokens[b, t]] + wpe[t]. out (B, T, C), tokens (B, T),
// wte (V, C), wpe (>= T, C).
void tiny_embedding_forward(float *out, const int32_t *tokens, const float *wte,
                            const float *wpe, int64_t B, int64_t T, int64_t C);
// dwte, dwpe += gradients.
void tiny_embedding_backward(float *dwte, float *dwpe, const float *dout,
                             const int32_t *tokens, int64_t B, int64_t T, int64_t C);

// Softmax cross-entropy. probs (B, V) = softmax(logits); losses (B) =
// -log probs[b, targets[b]]. Returns the mean loss (accumulated in double).
double tiny_crossentropy_forward(float *probs, float *losses, const float *logits,
                                 const int32_t *targets, int64_t B, int64_t V);
// dlogits = (probs - onehot(targets)) * scale (overwrite; scale = 1/B for
// the mean loss).
void tiny_crossentropy_backward(float *dlogits, const float *probs, const int32_t *targets,
                                float scale, int64_t B, int64_t V);

// ---------------------------------------------------------------------------
// The model

typedef struct tiny_config {
    int64_t vocab;     // V
    int64_t seq_len;   // T
    int64_t d_model;   // D (E of the attention)
    int64_t n_heads;   // H (divides D)
    int64_t n_layers;  // blocks, >= 1
    int64_t d_ff;      // F, MLP hidden width; 0 means 4 D
    float dropout;     // attention-weight dropout p (training only)
    bool causal;       // causal self-attention in all but the last block
    uint64_t seed;     // initialisation (and dropout masks)
} tiny_config;

typedef struct tiny_model tiny_model;

// One named parameter tensor with its gradient.
typedef struct tiny_tensor {
    char name[48];
    float *param;
    float *grad;
    int64_t n;
} tiny_tensor;

// Allocates the model for batches of up to max_batch sequences and
// initialises it from cfg->seed: embeddings N(0, 1), LayerNorms 1 / 0, MLP
// and classifier weights U(-1/sqrt(fan_in), 1/sqrt(fan_in)) with zero
// biases, attention libmha's default (xavier_uniform). Statuses: as
// mha_module_create, MHA_ERR_INVALID_ARG for a non-positive size.
mha_status tiny_create(tiny_model **out, const tiny_config *cfg, int64_t max_batch);
void tiny_destroy(tiny_model *m);
const tiny_config *tiny_get_config(const tiny_model *m);

// Every parameter tensor: our own (wte, wpe, ln*, fc*, proj*, head*) and the
// attention modules' (l0.attn.in_proj_weight, ...). n_tensors gets the count.
// The param pointers may be written; after a forward, writes to the
// attention modules' tensors need tiny_params_changed before the next
// forward (the modules keep packed copies of their weights:
// mha_module_params_changed). Steps of the optimizer tiny_optimizer_register
// set up need nothing.
const tiny_tensor *tiny_tensors(const tiny_model *m, int *n_tensors);
// The attention modules' parameters were written through tiny_tensors.
void tiny_params_changed(tiny_model *m);
int64_t tiny_num_params(const tiny_model *m);

// Forward on B <= max_batch sequences. tokens (B, T) in [0, V); targets (B)
// or NULL (then *loss is not written; loss may be NULL). training: dropout
// on (when cfg.dropout > 0) with masks from (seed, dropout_offset).
mha_status tiny_forward(tiny_model *m, float *loss, const int32_t *tokens,
                        const int32_t *targets, int64_t B, bool training,
                        uint64_t dropout_offset);
// Backward of the last forward (which must have had targets). Accumulates
// into the gradients of our own layers, overwrites the attention grads.
mha_status tiny_backward(tiny_model *m);
void tiny_zero_grad(tiny_model *m);
// logits (B, V) of the last forward.
const float *tiny_logits(const tiny_model *m);
// pred (B): argmax of the last forward's logits.
void tiny_predict(const tiny_model *m, int32_t *pred);

// Layer l's attention of sequence b (< the last forward's B), per head:
// w (H, Lq, T) for its query rows [T - Lq, T) (Lq = T but in the last
// block, whose one row is the query token), recomputed from that
// forward's LayerNorm output without dropout. *lq gets Lq; mod (may be
// NULL) the layer's attention module.
mha_status tiny_attention_weights(const tiny_model *m, int64_t l, int64_t b, float *w,
                                  int64_t *lq, const mha_module **mod);

// Layer l's LayerNorm output of the last forward, (B, T, D): its
// attention's key and value (and query rows); NULL for a bad l.
const float *tiny_attention_input(const tiny_model *m, int64_t l);

// Registers every parameter with its gradient in o.
mha_status tiny_optimizer_register(tiny_model *m, mha_optim *o);

// ---------------------------------------------------------------------------
// Random numbers (tiny.c): the generator of the model's initialisation, which
// the tasks draw their examples with too

typedef struct tiny_rng {
    uint64_t s;
} tiny_rng;

uint64_t tiny_rng_next(tiny_rng *r);             // splitmix64
double tiny_rng_uniform(tiny_rng *r);            // [0, 1)
double tiny_rng_normal(tiny_rng *r);             // N(0, 1)
int64_t tiny_rng_below(tiny_rng *r, int64_t n);  // [0, n)

// ---------------------------------------------------------------------------
// Synthetic tasks (tasks.c)
//
// Vocabulary: digits 0..9 are tokens 0..9, letters a..z tokens 10..35,
// '?' 36, '|' 37. V = 38.
//   recall: "k1 v1 k2 v2 ... kK vK ? q" with K distinct letter keys, each
//     followed by a digit value; q is one of the keys; target = its value.
//     T = 2K + 2.
//   tworel: "k1 v1 ... kK vK | qa qb" with qa != qb two of the keys;
//     target = (value(qa) + value(qb)) mod 10. The answer needs two
//     relations at once (qa -> its value, qb -> its value), read from two
//     different positions. T = 2K + 3.

typedef enum tiny_task_kind { TINY_TASK_RECALL = 0, TINY_TASK_TWOREL } tiny_task_kind;

#define TINY_VOCAB 38
#define TINY_TOK_QUERY 36
#define TINY_TOK_SEP 37

// Sequence length of a task with K pairs.
int64_t tiny_task_seq_len(tiny_task_kind kind, int64_t K);
// Fills tokens (B, T) and targets (B) with B fresh examples.
void tiny_task_sample(int32_t *tokens, int32_t *targets, tiny_task_kind kind, int64_t K,
                      int64_t B, tiny_rng *r);
// "a3c7e1?c" style rendering of one sequence into buf.
void tiny_task_render(char *buf, size_t cap, const int32_t *tokens, int64_t T);
// "recall"/"tworel" -> kind; -1 if unknown.
int tiny_task_from_name(const char *name);
const char *tiny_task_name(tiny_task_kind kind);

#endif
