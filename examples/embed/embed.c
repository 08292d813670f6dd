// embed.c: the sentence-embedding pipeline (embed.h).
#include "embed.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// sentence_bert_config.json's max_seq_length, or 0 when the file is absent.
static int read_max_length(int64_t *out, const char *dir) {
    *out = 0;
    char path[4096];
    snprintf(path, sizeof path, "%s/sentence_bert_config.json", dir);
    FILE *f = fopen(path, "rb");
    if (!f) return 0;
    char buf[4096];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    cJSON *j = cJSON_ParseWithLength(buf, n);
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, "max_seq_length");
    int rc = 0;
    if (!cJSON_IsObject(j)) rc = embed_fail("%s: not a JSON object", path);
    else if (v && (!cJSON_IsNumber(v) || v->valuedouble < 2 || v->valuedouble > 1e6))
        rc = embed_fail("%s: max_seq_length is not a number >= 2", path);
    else if (v) *out = (int64_t)v->valuedouble;
    cJSON_Delete(j);
    return rc;
}

int embed_pipeline_load(embed_pipeline *p, const char *dir) {
    memset(p, 0, sizeof *p);
    if (embed_tokenizer_load(&p->tok, dir) || embed_model_load(&p->model, dir) ||
        read_max_length(&p->max_length, dir)) {
        embed_pipeline_free(p);
        return -1;
    }
    int64_t maxpos = embed_model_config(p->model)->max_position;
    if (!p->max_length) p->max_length = 512;
    if (p->max_length > maxpos) p->max_length = maxpos;
    if (embed_tokenizer_vocab_size(p->tok) > embed_model_config(p->model)->vocab_size) {
        embed_fail("%s: vocab.txt has %lld tokens, config.json vocab_size %lld", dir,
                   (long long)embed_tokenizer_vocab_size(p->tok),
                   (long long)embed_model_config(p->model)->vocab_size);
        embed_pipeline_free(p);
        return -1;
    }
    return 0;
}

void embed_pipeline_free(embed_pipeline *p) {
    embed_tokenizer_destroy(p->tok);
    embed_model_destroy(p->model);
    memset(p, 0, sizeof *p);
}

void embed_result_free(embed_result *r) {
    free(r->embeddings);
    free(r->input_ids);
    free(r->attention_mask);
    memset(r, 0, sizeof *r);
}

static const int64_t *sort_counts;
static int by_count_desc(const void *a, const void *b) {  // stable by index
    int64_t i = *(const int64_t *)a, j = *(const int64_t *)b;
    if (sort_counts[i] != sort_counts[j]) return sort_counts[i] > sort_counts[j] ? -1 : 1;
    return i < j ? -1 : i > j;
}

int embed_sentences(embed_result *r, const embed_pipeline *p, const char *const *texts,
                    const size_t *lens, int64_t n, int64_t batch_size, const char *unit) {
    memset(r, 0, sizeof *r);
    if (n < 1 || batch_size < 1)
        return embed_fail("%lld sentences in batches of %lld: both must be positive",
                          (long long)n, (long long)batch_size);
    int64_t ml = p->max_length, E = embed_model_config(p->model)->hidden_size;
    int64_t *all = malloc((size_t)(n * ml) * sizeof *all);  // (n, ml) ids
    int64_t *count = malloc((size_t)n * sizeof *count),
            *order = malloc((size_t)n * sizeof *order);
    int64_t *bids = malloc((size_t)(batch_size * ml) * sizeof *bids);
    int64_t *bmask = malloc((size_t)(batch_size * ml) * sizeof *bmask);
    float *bemb = malloc((size_t)(batch_size * E) * sizeof *bemb);
    int rc = 0;
    if (!all || !count || !order || !bids || !bmask || !bemb) {
        rc = embed_fail("out of memory for %lld sentences", (long long)n);
        goto done;
    }
    for (int64_t i = 0; i < n && !rc; i++) {
        if (embed_tokenize(all + i * ml, &count[i], p->tok, texts[i], lens[i], ml)) {
            char why[512];  // (embed_fail must not read its own buffer)
            snprintf(why, sizeof why, "%s", embed_last_error());
            rc = embed_fail("%s %lld: %s", unit, (long long)(i + 1), why);
        }
        if (count[i] > r->lmax) r->lmax = count[i];
        order[i] = i;
    }
    if (rc) goto done;
    r->n = n;
    r->dim = E;
    r->embeddings = malloc((size_t)(n * E) * sizeof(float));
    r->input_ids = calloc((size_t)(n * r->lmax), sizeof(int64_t));
    r->attention_mask = calloc((size_t)(n * r->lmax), sizeof(int64_t));
    if (!r->embeddings || !r->input_ids || !r->attention_mask) {
        rc = embed_fail("out of memory for %lld embeddings", (long long)n);
        goto done;
    }
    for (int64_t i = 0; i < n; i++)
        for (int64_t t = 0; t < count[i]; t++) {
            r->input_ids[i * r->lmax + t] = all[i * ml + t];
            r->attention_mask[i * r->lmax + t] = 1;
        }
    sort_counts = count;
    qsort(order, (size_t)n, sizeof *order, by_count_desc);
    for (int64_t b0 = 0; b0 < n && !rc; b0 += batch_size) {
        int64_t nb = n - b0 < batch_size ? n - b0 : batch_size, L = count[order[b0]];
        for (int64_t k = 0; k < nb; k++) {
            int64_t i = order[b0 + k];
            for (int64_t t = 0; t < L; t++) {
                bool tok = t < count[i];
                bids[k * L + t] = tok ? all[i * ml + t] : 0;
                bmask[k * L + t] = tok;
            }
        }
        rc = embed_model_encode(bemb, p->model, bids, bmask, nb, L);
        for (int64_t k = 0; k < nb && !rc; k++)
            memcpy(r->embeddings + order[b0 + k] * E, bemb + k * E, (size_t)E * sizeof(float));
    }
done:
    if (rc) embed_result_free(r);
    free(all);
    free(count);
    free(order);
    free(bids);
    free(bmask);
    free(bemb);
    return rc;
}
