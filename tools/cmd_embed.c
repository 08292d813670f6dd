// cmd_embed.c: `mha embed`, sentence embeddings of a sentence-transformers
// BERT model directory (all-MiniLM-L6-v2): the WordPiece tokenizer and the
// encoder of examples/embed (embed.h), attention through libmha's module.
// Writes a safetensors file; --time reports the in-process time per batch.
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cli.h"
#include "cmd.h"
#include "embed.h"

static const char *embed_help =
    "Usage: mha embed --model DIR [--sentences FILE | SENTENCE...] --out FILE [options]\n"
    "Sentence embeddings of a sentence-transformers BERT model directory\n"
    "(config.json, model.safetensors, vocab.txt, tokenizer_config.json,\n"
    "sentence_bert_config.json; e.g. all-MiniLM-L6-v2): BERT's WordPiece\n"
    "tokenizer, the encoder (attention through libmha), mean pooling over the\n"
    "tokens and L2 normalisation, as SentenceTransformer.encode(...,\n"
    "normalize_embeddings=True).\n"
    "  --model DIR         the model directory\n"
    "  --sentences FILE    one sentence a line (UTF-8; every line, empty ones\n"
    "                      included; \"-\" reads stdin); else the arguments\n"
    "  --out FILE          safetensors: \"embeddings\" (N, dim) F32, \"input_ids\"\n"
    "                      (N, Lmax) I64 (0 past each sentence's end) and\n"
    "                      \"attention_mask\" (N, Lmax) I64\n"
    "  --max-length N      tokens per sentence with [CLS] and [SEP], the rest cut\n"
    "                      (default: sentence_bert_config.json max_seq_length)\n"
    "  --batch-size B      sentences per forward (default 32), sorted by length\n"
    "  --time R            also embed everything R more times and print the\n"
    "                      median milliseconds per batch (tokenizing included)\n"
    "Invalid UTF-8 is refused, naming the line (or argument) and the byte.\n";

// Splits the file's bytes into lines (a last "\n" ends the last line).
static int read_lines(char **buf, char ***lines, size_t **lens, int64_t *n, const char *path) {
    FILE *f = strcmp(path, "-") ? fopen(path, "rb") : stdin;
    if (!f) {
        fprintf(stderr, "mha embed: %s: cannot open\n", path);
        return 1;
    }
    size_t len = 0, cap = 0;
    *buf = NULL;
    for (;;) {
        if (len + 65536 > cap) {
            cap = 2 * cap + 65536;
            char *nb = realloc(*buf, cap);
            if (!nb) break;
            *buf = nb;
        }
        size_t got = fread(*buf + len, 1, 65536, f);
        len += got;
        if (got < 65536) break;
    }
    int bad = ferror(f) || !*buf;
    if (f != stdin) fclose(f);
    if (bad) {
        fprintf(stderr, "mha embed: %s: read error or out of memory\n", path);
        return 1;
    }
    int64_t cnt = 0;
    for (size_t i = 0; i < len; i++) cnt += (*buf)[i] == '\n';
    if (len && (*buf)[len - 1] != '\n') cnt++;
    if (cnt == 0) {
        fprintf(stderr, "mha embed: %s: no sentences (empty file)\n", path);
        return 1;
    }
    *lines = malloc((size_t)cnt * sizeof **lines);
    *lens = malloc((size_t)cnt * sizeof **lens);
    if (!*lines || !*lens) {
        fprintf(stderr, "mha embed: out of memory for %lld lines\n", (long long)cnt);
        return 1;
    }
    size_t start = 0;
    int64_t k = 0;
    for (size_t i = 0; i <= len && k < cnt; i++)
        if (i == len || (*buf)[i] == '\n') {
            (*lines)[k] = *buf + start;
            (*lens)[k++] = i - start;
            start = i + 1;
        }
    *n = cnt;
    return 0;
}

static int write_result(const embed_result *r, const char *path, int64_t max_length) {
    mha_st_writer *w;
    mha_status st = mha_st_writer_create(&w);
    if (st) return cli_fail("embed", st);
    int64_t es[2] = {r->n, r->dim}, is[2] = {r->n, r->lmax};
    char ml[32];
    snprintf(ml, sizeof ml, "%lld", (long long)max_length);
    if (!st) st = mha_st_writer_add(w, "embeddings", MHA_F32, 2, es, r->embeddings);
    if (!st) st = mha_st_writer_add(w, "input_ids", MHA_I64, 2, is, r->input_ids);
    if (!st) st = mha_st_writer_add(w, "attention_mask", MHA_I64, 2, is, r->attention_mask);
    if (!st) st = mha_st_writer_set_metadata(w, "max_length", ml);
    if (!st) st = mha_st_writer_save(w, path);
    mha_st_writer_destroy(w);
    return st ? cli_fail("embed", st) : 0;
}

// The sentences given as arguments (no copy: texts point into argv).
// 0, or 1 after printing.
static int arg_sentences(char ***texts, size_t **lens, int64_t *n, int argc, char **argv) {
    *n = argc;
    *texts = malloc((size_t)argc * sizeof **texts);
    *lens = malloc((size_t)argc * sizeof **lens);
    if (!*texts || !*lens) {
        fputs("mha embed: out of memory\n", stderr);
        return 1;
    }
    for (int64_t i = 0; i < argc; i++) {
        (*texts)[i] = argv[i];
        (*lens)[i] = strlen(argv[i]);
    }
    return 0;
}

// --time R: everything embedded R more times (tokenizing included); prints
// the median milliseconds per batch. 0, or 1 after printing.
static int time_embed(const embed_pipeline *p, const char *const *texts, const size_t *lens,
                      int64_t n, int64_t batch, const char *unit, int64_t repeats) {
    int rc = 0;
    double *ms = malloc((size_t)repeats * sizeof *ms);
    int64_t batches = (n + batch - 1) / batch;
    for (int64_t k = 0; k < repeats && ms && !rc; k++) {
        embed_result rr;
        double t0 = cli_now();
        if (embed_sentences(&rr, p, texts, lens, n, batch, unit)) {
            fprintf(stderr, "mha embed: %s\n", embed_last_error());
            rc = 1;
        }
        ms[k] = (cli_now() - t0) * 1e3 / (double)batches;
        embed_result_free(&rr);
    }
    if (!ms) {
        fputs("mha embed: out of memory\n", stderr);
        rc = 1;
    }
    if (!rc) {
        qsort(ms, (size_t)repeats, sizeof *ms, cli_cmp_double);
        int threads = 1;
#ifdef _OPENMP
        threads = omp_get_max_threads();
#endif
        printf("mha embed: %lld sentences, %lld batch(es) of <= %lld, %d thread(s): "
               "median %.3f ms per batch (%lld repeats, min %.3f)\n",
               (long long)n, (long long)batches, (long long)batch, threads, ms[repeats / 2],
               (long long)repeats, ms[0]);
    }
    free(ms);
    return rc;
}

int cmd_embed(int argc, char **argv) {
    static const struct option opts[] = {{"model", required_argument, 0, 'm'},
                                         {"sentences", required_argument, 0, 's'},
                                         {"out", required_argument, 0, 'o'},
                                         {"max-length", required_argument, 0, 'L'},
                                         {"batch-size", required_argument, 0, 'b'},
                                         {"time", required_argument, 0, 't'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    const char *model = NULL, *file = NULL, *out = NULL;
    int64_t max_length = 0, batch = 32, repeats = 0;
    int c;
    opterr = 0;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'm': model = optarg; break;
        case 's': file = optarg; break;
        case 'o': out = optarg; break;
        case 'L':
            if (cli_parse_int(&max_length, optarg, 2, 1 << 20))
                return cli_usage("embed", "--max-length needs an integer >= 2");
            break;
        case 'b':
            if (cli_parse_int(&batch, optarg, 1, 1 << 20))
                return cli_usage("embed", "--batch-size needs a positive integer");
            break;
        case 't':
            if (cli_parse_int(&repeats, optarg, 1, 100000))
                return cli_usage("embed", "--time needs a positive integer");
            break;
        case 'h': fputs(embed_help, stdout); return 0;
        default: return cli_bad_option("embed", argv, opts);
        }
    }
    if (!model) return cli_usage("embed", "--model is required");
    if (!out && !repeats) return cli_usage("embed", "--out is required");
    if (file && optind < argc)
        return cli_usage("embed", "give --sentences FILE or sentences as arguments, not both");
    if (!file && optind >= argc)
        return cli_usage("embed", "no sentences (--sentences FILE or arguments)");

    char *buf = NULL, **texts = NULL;
    size_t *lens = NULL;
    int64_t n = 0;
    int rc = file ? read_lines(&buf, &texts, &lens, &n, file)
                  : arg_sentences(&texts, &lens, &n, argc - optind, argv + optind);
    embed_pipeline p = {0};
    embed_result r = {0};
    if (!rc && embed_pipeline_load(&p, model)) {
        fprintf(stderr, "mha embed: %s\n", embed_last_error());
        rc = 1;
    }
    if (!rc && max_length) {
        int64_t maxpos = embed_model_config(p.model)->max_position;
        if (max_length > maxpos) {
            fprintf(stderr,
                    "mha embed: --max-length %lld exceeds the model's "
                    "max_position_embeddings %lld\n",
                    (long long)max_length, (long long)maxpos);
            rc = 1;
        }
        p.max_length = max_length;
    }
    const char *unit = file ? "line" : "argument";
    if (!rc && embed_sentences(&r, &p, (const char *const *)texts, lens, n, batch, unit)) {
        fprintf(stderr, "mha embed: %s\n", embed_last_error());
        rc = 1;
    }
    if (!rc && out) rc = write_result(&r, out, p.max_length);
    if (!rc && repeats)
        rc = time_embed(&p, (const char *const *)texts, lens, n, batch, unit, repeats);
    embed_result_free(&r);
    embed_pipeline_free(&p);
    free(buf);
    free(texts);
    free(lens);
    return rc;
}
