// tasks.c: seeded synthetic tasks for the tiny transformer (see tiny.h for
// the vocabulary and the two tasks), drawn with the model's random generator
// (tiny_rng, tiny.c). Not a general data loader.
#include <stdio.h>
#include <string.h>

#include "tiny.h"

int64_t tiny_task_seq_len(tiny_task_kind kind, int64_t K) {
    return kind == TINY_TASK_RECALL ? 2 * K + 2 : 2 * K + 3;
}

// One example: K distinct keys (a partial Fisher-Yates shuffle of the 26
// letters), K values uniform in 0..9, then the query part.
static void sample_one(int32_t *tok, int32_t *target, tiny_task_kind kind,
                       int64_t K, tiny_rng *r) {
    int32_t letters[26];
    for (int i = 0; i < 26; i++) letters[i] = 10 + i;
    int32_t vals[26];
    for (int64_t i = 0; i < K; i++) {
        int64_t j = i + tiny_rng_below(r, 26 - i);
        int32_t t = letters[i];
        letters[i] = letters[j];
        letters[j] = t;
        vals[i] = (int32_t)tiny_rng_below(r, 10);
        tok[2 * i] = letters[i];
        tok[2 * i + 1] = vals[i];
    }
    if (kind == TINY_TASK_RECALL) {
        int64_t q = tiny_rng_below(r, K);
        tok[2 * K] = TINY_TOK_QUERY;
        tok[2 * K + 1] = letters[q];
        *target = vals[q];
    } else {
        int64_t qa = tiny_rng_below(r, K);
        int64_t qb = tiny_rng_below(r, K - 1);
        if (qb >= qa) qb++;  // qb != qa
        tok[2 * K] = TINY_TOK_SEP;
        tok[2 * K + 1] = letters[qa];
        tok[2 * K + 2] = letters[qb];
        *target = (vals[qa] + vals[qb]) % 10;
    }
}

void tiny_task_sample(int32_t *tokens, int32_t *targets, tiny_task_kind kind,
                      int64_t K, int64_t B, tiny_rng *r) {
    int64_t T = tiny_task_seq_len(kind, K);
    for (int64_t b = 0; b < B; b++)
        sample_one(tokens + b * T, targets + b, kind, K, r);
}

void tiny_task_render(char *buf, size_t cap, const int32_t *tokens, int64_t T) {
    size_t n = 0;
    for (int64_t t = 0; t < T && n + 1 < cap; t++) {
        int32_t k = tokens[t];
        buf[n++] = k < 10 ? (char)('0' + k) : k < 36 ? (char)('a' + k - 10)
                   : k == TINY_TOK_QUERY ? '?' : '|';
    }
    if (cap) buf[n < cap ? n : cap - 1] = '\0';
}

int tiny_task_from_name(const char *name) {
    if (!strcmp(name, "recall")) return TINY_TASK_RECALL;
    if (!strcmp(name, "tworel")) return TINY_TASK_TWOREL;
    return -1;
}

const char *tiny_task_name(tiny_task_kind kind) {
    return kind == TINY_TASK_RECALL ? "recall" : "tworel";
}
