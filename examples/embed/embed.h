// embed.h: sentences in, sentence embeddings out (examples/embed/embed.c):
// the tokenizer (tokenizer.h) and the encoder (bert.h) of a
// sentence-transformers model directory, over batches, as
// SentenceTransformer.encode(..., normalize_embeddings=True) runs them.
#ifndef EMBED_EMBED_H
#define EMBED_EMBED_H

#include <stddef.h>
#include <stdint.h>

#include "bert.h"
#include "error.h"
#include "tokenizer.h"

typedef struct embed_pipeline {
    embed_tokenizer *tok;
    embed_model *model;
    int64_t max_length;  // sentence_bert_config.json max_seq_length (else 512),
                         // at most max_position_embeddings
} embed_pipeline;

// Loads the tokenizer, the model and max_length from dir.
int embed_pipeline_load(embed_pipeline *p, const char *dir);
void embed_pipeline_free(embed_pipeline *p);

// The result of embed_sentences: malloc'd, freed by embed_result_free.
typedef struct embed_result {
    int64_t n, dim, lmax;     // sentences, embedding size, longest token count
    float *embeddings;        // (n, dim)
    int64_t *input_ids;       // (n, lmax), 0 ([PAD]) past each sentence's end
    int64_t *attention_mask;  // (n, lmax), 1 for a token, 0 for padding
} embed_result;

// Embeds n sentences (texts[i]: lens[i] bytes of UTF-8), batch_size at a
// time: sorted by token count (longest first, as sentence-transformers
// does), each batch padded to its own longest; the result in input order.
// Errors name the sentence as "<unit> <i + 1>" (unit e.g. "line").
int embed_sentences(embed_result *r, const embed_pipeline *p, const char *const *texts,
                    const size_t *lens, int64_t n, int64_t batch_size, const char *unit);
void embed_result_free(embed_result *r);

#endif
