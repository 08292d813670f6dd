// bert.h: a BERT encoder with mean pooling and L2 normalisation, the
// sentence embeddings of sentence-transformers' all-MiniLM-L6-v2
// (examples/embed/bert.c). Attention is libmha's module (mha_forward with
// a key padding mask) and the feed-forward's dense layers libmha's
// mha_linear; the rest (embeddings, LayerNorm, exact GELU, pooling) is
// here, float32 throughout.
//
//   x = LayerNorm(word[id] + token_type[0] + position[t])          (N, L, E)
//   per layer:
//     a = MHA(x, x, x, key_padding_mask = !mask)   Q/K/V -> in_proj,
//                                                  attention.output.dense ->
//                                                  out_proj
//     x = LayerNorm(a + x)
//     x = LayerNorm(GELU(x W1^T + b1) W2^T + b2 + x)    GELU(u) = u/2 (1 +
//                                                       erf(u / sqrt 2))
//   e = sum_t mask[t] x[t] / max(sum_t mask[t], 1e-9);  e /= max(|e|, 1e-12)
//
// What it does not do: token types other than 0, relative positions,
// other activations, other poolings (CLS, max), training.
#ifndef EMBED_BERT_H
#define EMBED_BERT_H

#include <stdint.h>

#include "error.h"

// config.json's numbers (BertModel).
typedef struct embed_bert_config {
    int64_t vocab_size, hidden_size, num_layers, num_heads, intermediate_size;
    int64_t max_position, type_vocab_size;
    double layer_norm_eps;
} embed_bert_config;

typedef struct embed_model embed_model;

// Reads dir/config.json (model_type "bert", hidden_act "gelu",
// position_embedding_type "absolute") and the weights, dir/model.safetensors
// or its shards (names with or without the "bert." prefix; F32, F16 or
// BF16), checking every shape against the config.
int embed_model_load(embed_model **out, const char *dir);
void embed_model_destroy(embed_model *m);
const embed_bert_config *embed_model_config(const embed_model *m);

// out (N, E) <- the normalised mean-pooled embeddings of N sequences of L
// token ids (ids (N, L), row-major; each in [0, vocab_size)); mask (N, L):
// 1 for a token, 0 for padding (at least one 1 a row; positions are
// 0 .. L - 1 whatever the mask, as transformers' default position_ids).
// L <= max_position. Threads: OpenMP; the result does not depend on
// their number.
int embed_model_encode(float *out, const embed_model *m, const int64_t *ids,
                       const int64_t *mask, int64_t N, int64_t L);

#endif
