// main.c: the sentence-embedding example (build/embed_example).
//   embed_example MODEL_DIR SENTENCE [SENTENCE...]
// Embeds the sentences with all-MiniLM-L6-v2 (or another
// sentence-transformers BERT directory) and prints each one's token count
// and first dimensions, then the cosine similarity of every pair. The
// same pipeline as `mha embed` (embed.h), without the files.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "embed.h"

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s MODEL_DIR SENTENCE [SENTENCE...]\n", argv[0]);
        return 2;
    }
    int64_t n = argc - 2;
    size_t *lens = malloc((size_t)n * sizeof *lens);
    if (!lens) return 1;
    for (int64_t i = 0; i < n; i++) lens[i] = strlen(argv[2 + i]);
    embed_pipeline p;
    embed_result r;
    if (embed_pipeline_load(&p, argv[1]) ||
        embed_sentences(&r, &p, (const char *const *)argv + 2, lens, n, 32, "sentence")) {
        fprintf(stderr, "%s: %s\n", argv[0], embed_last_error());
        embed_pipeline_free(&p);
        free(lens);
        return 1;
    }
    for (int64_t i = 0; i < n; i++) {
        int64_t tokens = 0;
        for (int64_t t = 0; t < r.lmax; t++) tokens += r.attention_mask[i * r.lmax + t];
        printf("%lld: %lld tokens, embedding [%8.5f %8.5f %8.5f %8.5f ...]  \"%s\"\n",
               (long long)i, (long long)tokens, r.embeddings[i * r.dim],
               r.embeddings[i * r.dim + 1], r.embeddings[i * r.dim + 2],
               r.embeddings[i * r.dim + 3], argv[2 + i]);
    }
    if (n > 1) puts("cosine similarity (the embeddings have norm 1):");
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = i + 1; j < n; j++) {
            double dot = 0;
            for (int64_t k = 0; k < r.dim; k++)
                dot += (double)r.embeddings[i * r.dim + k] * r.embeddings[j * r.dim + k];
            printf("  %lld-%lld: %.4f\n", (long long)i, (long long)j, dot);
        }
    embed_result_free(&r);
    embed_pipeline_free(&p);
    free(lens);
    return 0;
}
