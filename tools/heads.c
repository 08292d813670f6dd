// heads.c: `mha demo heads`. Trains the tiny transformer (tiny.h, the loop
// of train_loop.c) briefly on associative recall with causal attention and
// several heads, then looks at what each head learned:
//   - on held-out sequences, the attention mass each head puts on the
//     positions a known pattern names (previous token, itself, the first
//     token, an earlier copy of the current token, the token after such a
//     copy: the induction pattern), against what uniform attention over
//     the visible keys would put there;
//   - `mha inspect` on every layer (its module and the inputs it saw), so
//     DIR/layerL/ holds diagnostics.json, the heatmaps with the sequence's
//     tokens on the axes, the similarity matrix, the spectra and
//     report.html.
// It prints the numbers and the pattern that stands out per head; nothing
// here decides that heads must specialise.
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"
#include "cmd.h"
#include "train.h"

static const char *heads_help =
    "Usage: mha demo heads [--out DIR] [--steps N] [--heads H] [--pairs K]\n"
    "                      [--layers N] [--seed N] [--quiet]\n"
    "Trains the tiny transformer of `mha train` on associative recall\n"
    "(\"a3c7e1?c -> 7\") with causal attention, then shows which heads learned\n"
    "which pattern: the attention mass on the previous token, on itself, on\n"
    "the first token, on an earlier copy of the current token, and on the\n"
    "token after such a copy (induction), measured on held-out sequences\n"
    "against uniform attention. Writes `mha inspect`'s report per layer.\n"
    "  --out DIR     where the reports go (default heads_report)\n"
    "  --steps N     training steps (default 3000; about 12 s on 2 cores)\n"
    "  --heads H     heads per layer (default 4)\n"
    "  --pairs K     key/value pairs per sequence (default 2)\n"
    "  --layers N    blocks (default 2)\n"
    "  --seed N      seed (default 1)\n"
    "  --quiet       no training progress\n";

enum { NPAT = 5 };
static const char *pat_name[NPAT] = {"previous token", "itself", "first token", "same token",
                                     "induction"};
static const char *pat_long[NPAT] = {
    "previous token: position i - 1", "itself: position i",
    "first token: position 0 (from i >= 1)",
    "same token: an earlier position holding the same token",
    "induction: the position right after an earlier copy of the current token"};

// Marks in is[j] (j <= i) the keys pattern p names for query position i of
// tokens tok; returns how many (0: the pattern does not apply to this row).
static int pattern_keys(bool *is, int p, const int32_t *tok, int64_t i) {
    int n = 0;
    for (int64_t j = 0; j <= i; j++) {
        bool k = false;
        switch (p) {
        case 0: k = i >= 1 && j == i - 1; break;
        case 1: k = j == i; break;
        case 2: k = i >= 1 && j == 0; break;
        case 3: k = j < i && tok[j] == tok[i]; break;
        case 4: k = j >= 1 && j < i && tok[j - 1] == tok[i]; break;
        }
        is[j] = k;
        n += k;
    }
    return n;
}

// One character per token (tiny_task_render), as a label file for inspect.
// 0, or 1 after printing.
static int write_tokens(const char *path, const int32_t *tok, int64_t T) {
    char s[128], lines[256];
    tiny_task_render(s, sizeof s, tok, T);
    int64_t n = 0;
    for (int64_t t = 0; t < T && n + 2 <= (int64_t)sizeof lines; t++) {
        lines[n++] = s[t];
        lines[n++] = '\n';
    }
    mha_status st = mha_file_write(path, lines, (size_t)n);
    return st ? cli_fail("demo heads", st) : 0;
}

// Parses demo heads' options into o and *out. Returns -1 to go on, else
// the exit status.
static int heads_parse(train_opts *o, const char **out, int argc, char **argv) {
    static const struct option opts[] = {{"out", required_argument, 0, 'o'},
                                         {"steps", required_argument, 0, 'n'},
                                         {"heads", required_argument, 0, 'H'},
                                         {"pairs", required_argument, 0, 'K'},
                                         {"layers", required_argument, 0, 'L'},
                                         {"seed", required_argument, 0, 's'},
                                         {"quiet", no_argument, 0, 'q'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    const char *cmd = "demo heads";
    int c;
    opterr = 0;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'o': *out = optarg; break;
        case 'n':
            if (cli_int_option(&o->steps, cmd, "--steps", optarg, 1, INT64_MAX)) return 2;
            break;
        case 'H':
            if (cli_int_option(&o->heads, cmd, "--heads", optarg, 1, 64)) return 2;
            break;
        case 'K':
            if (cli_int_option(&o->pairs, cmd, "--pairs", optarg, 2, 26)) return 2;
            break;
        case 'L':
            if (cli_int_option(&o->layers, cmd, "--layers", optarg, 1, 8)) return 2;
            break;
        case 's':
            if (cli_int_option(&o->seed, cmd, "--seed", optarg, 0, INT64_MAX)) return 2;
            break;
        case 'q': o->quiet = true; break;
        case 'h': fputs(heads_help, stdout); return 0;
        default: return cli_bad_option(cmd, argv, opts);
        }
    }
    if (optind < argc) return cli_unexpected(cmd, argv[optind]);
    if (o->d_model % o->heads)
        return cli_usagef(cmd, "--heads %lld does not divide d_model %lld",
                          (long long)o->heads, (long long)o->d_model);
    return -1;
}

// Adds up, per layer, head and pattern, the attention mass of the B
// held-out sequences tok (B, T) on the pattern's keys, the uniform share
// and the rows: score (NL, H, NPAT, 3). w (H, T, T) and is (T) are scratch.
static mha_status heads_score(double *score, tiny_model *m, const int32_t *tok, float *w,
                              bool *is, int64_t T, int64_t B, int64_t H, int64_t NL) {
    mha_status st;
    for (int64_t l = 0; l < NL; l++)
        for (int64_t b = 0; b < B; b++) {
            int64_t Lq;
            if ((st = tiny_attention_weights(m, l, b, w, &Lq, NULL))) return st;
            const int32_t *tk = tok + b * T;
            for (int64_t h = 0; h < H; h++)
                for (int64_t qi = 0; qi < Lq; qi++) {
                    const int64_t i = T - Lq + qi;  // the query position
                    for (int p = 0; p < NPAT; p++) {
                        const int n = pattern_keys(is, p, tk, i);
                        if (!n) continue;
                        double mass = 0;
                        for (int64_t j = 0; j <= i; j++)
                            if (is[j]) mass += w[(h * Lq + qi) * T + j];
                        double *sc = score + ((l * H + h) * NPAT + p) * 3;
                        sc[0] += mass;
                        sc[1] += (double)n / (double)(i + 1);  // causal: keys 0..i
                        sc[2] += 1;
                    }
                }
        }
    return MHA_OK;
}

// Prints the table of heads_score's numbers, per layer a row per head with
// the pattern that stands out.
static void heads_print(const double *score, int64_t B, int64_t H, int64_t NL) {
    printf("\nAttention mass per head on %lld held-out sequences (in %%; in brackets what "
           "uniform attention over the visible keys would give); a pattern stands out "
           "when it has at least 40%% of the mass and twice the uniform share:\n",
           (long long)B);
    for (int p = 0; p < NPAT; p++) printf("  %s\n", pat_long[p]);
    for (int64_t l = 0; l < NL; l++) {
        printf("layer %lld%s\n", (long long)l,
               l == NL - 1 ? " (the classifier reads its last position only: its rows are "
                             "that one query)"
                           : " (every position)");
        printf("  %-5s", "head");
        for (int p = 0; p < NPAT; p++) printf(" %14.14s", pat_name[p]);
        printf("  what stands out\n");
        for (int64_t h = 0; h < H; h++) {
            printf("  %-5lld", (long long)h);
            int best = -1;
            double best_lift = 0;
            for (int p = 0; p < NPAT; p++) {
                const double *sc = score + ((l * H + h) * NPAT + p) * 3;
                if (sc[2] == 0) {
                    printf(" %14s", "-");
                    continue;
                }
                const double mass = sc[0] / sc[2], uni = sc[1] / sc[2];
                char cell[32];
                snprintf(cell, sizeof cell, "%.0f (%.0f)", 100 * mass, 100 * uni);
                printf(" %14s", cell);
                // stands out: at least 40% of the mass and twice uniform
                if (mass >= 0.4 && mass >= 2 * uni && mass - uni > best_lift)
                    best = p, best_lift = mass - uni;
            }
            printf("  %s\n", best >= 0 ? pat_name[best] : "no single pattern (spread out)");
        }
    }
}

// mha inspect per layer into out/layerL: the module, the inputs it saw
// (B' sequences), the first sequence's tokens (of tok (B, T), targets
// after them). w (H, T, T) is scratch. Returns 0, or 1 after printing.
static int heads_reports(tiny_model *m, const char *out, const int32_t *tok, float *w,
                         int64_t T, int64_t B, int64_t D, int64_t NL) {
    const char *cmd = "demo heads";
    mha_status st;
    if (mkdir(out, 0777) && errno != EEXIST) {
        fprintf(stderr, "mha demo heads: cannot create %s: %s\n", out, strerror(errno));
        return 1;
    }
    char tok_path[4096];
    snprintf(tok_path, sizeof tok_path, "%s/tokens.txt", out);
    if (write_tokens(tok_path, tok, T)) return 1;
    char ex[128];
    tiny_task_render(ex, sizeof ex, tok, T);
    printf("\nReports (mha inspect on each layer's attention with the inputs it saw on 64 "
           "held-out sequences; heatmaps of the first, %s -> %d):\n",
           ex, tok[B * T]);
    fflush(stdout);
    const int64_t NB = 64;
    for (int64_t l = 0; l < NL; l++) {
        char dir[4096], wpath[4200], xpath[4200];
        snprintf(dir, sizeof dir, "%s/layer%lld", out, (long long)l);
        if (mkdir(dir, 0777) && errno != EEXIST) {
            fprintf(stderr, "mha demo heads: cannot create %s: %s\n", dir, strerror(errno));
            return 1;
        }
        snprintf(wpath, sizeof wpath, "%s/weights.safetensors", dir);
        snprintf(xpath, sizeof xpath, "%s/inputs.safetensors", dir);
        int64_t Lq;
        const mha_module *mod;
        if ((st = tiny_attention_weights(m, l, 0, w, &Lq, &mod)) ||
            (st = mha_module_save(mod, wpath)))
            return cli_fail(cmd, st);
        mha_st_writer *wr = NULL;
        if ((st = mha_st_writer_create(&wr)) ||
            (st = mha_st_writer_add(wr, "query", MHA_F32, 3, (int64_t[]){NB, T, D},
                                    tiny_attention_input(m, l))) ||
            (st = mha_st_writer_save(wr, xpath))) {
            mha_st_writer_destroy(wr);
            return cli_fail(cmd, st);
        }
        mha_st_writer_destroy(wr);
        char *iargv[] = {"inspect", "--weights",     wpath,      "--inputs", xpath,    "--out",
                         dir,       "--batch-first", "--causal", "--tokens", tok_path, NULL};
        if (cmd_inspect(11, iargv)) return 1;
    }
    return 0;
}

int demo_heads(int argc, char **argv) {
    const char *cmd = "demo heads", *out = "heads_report";
    train_opts o;
    train_opts_default(&o);
    o.cmd = cmd;
    o.pairs = 2;
    o.heads = 4;
    o.causal = true;
    o.steps = 3000;
    o.eval_size = 500;
    int prc = heads_parse(&o, &out, argc, argv);
    if (prc >= 0) return prc;
    o.eval_every = o.steps / 5 > 0 ? o.steps / 5 : 1;
    printf("mha demo heads: train a %lld-layer, %lld-head tiny transformer on associative "
           "recall (causal attention), then look at what each head attends to\n",
           (long long)o.layers, (long long)o.heads);
    fflush(stdout);
    tiny_model *m = NULL;
    double acc = 0;
    if (train_run(&o, &m, &acc)) return 1;

    // Held-out sequences, a stream of their own.
    const int64_t T = tiny_task_seq_len(o.task, o.pairs), B = 200, H = o.heads, D = o.d_model,
                  NL = o.layers;
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)(B * T + B));
    float *w = malloc(sizeof(float) * (size_t)(H * T * T));
    bool *is = malloc((size_t)T);
    // per layer, head, pattern: mass sum, uniform sum, rows
    double *score = calloc((size_t)(NL * H * NPAT * 3), sizeof(double));
    int rc = 1;
    mha_status st;
    if (!tok || !w || !is || !score) {
        fprintf(stderr, "mha demo heads: out of memory\n");
        goto done;
    }
    tiny_rng r = {(uint64_t)o.seed * 0x9E3779B97F4A7C15ull + 0x4EAD5ull};
    tiny_task_sample(tok, tok + B * T, o.task, o.pairs, B, &r);
    if ((st = tiny_forward(m, NULL, tok, NULL, B, false, 0)) ||
        (st = heads_score(score, m, tok, w, is, T, B, H, NL))) {
        rc = cli_fail(cmd, st);
        goto done;
    }
    heads_print(score, B, H, NL);
    if (heads_reports(m, out, tok, w, T, B, D, NL)) goto done;
    if (NL > 0)
        printf("(the last layer is inspected with every row, causal, although training only "
               "used its last row)\n");
    printf("\nTrained to %.1f%% held-out accuracy (chance 10%%). Open %s/layer0/report.html "
           "and the others in a browser.\n",
           100 * acc, out);
    rc = 0;
done:
    free(tok);
    free(w);
    free(is);
    free(score);
    tiny_destroy(m);
    return rc;
}
