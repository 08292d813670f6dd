// demo.c: `mha demo`, a guided walk through multi-head attention.
//
// Part 1 follows one small example (seq_len 3, d_model 12, 3 heads, d_k 4)
// through every step of the library's forward, printing the numbers the
// library computed (through the forward's trace callback), one line of
// explanation per step. Part 2 shows masks: causal, key padding, and a fully
// masked row. Part 3 times the same module at BERT-base size.
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cli.h"
#include "cmd.h"

#define T 3    // tokens
#define DM 12  // d_model
#define NH 3   // heads
#define DK 4   // d_k = d_model / heads

static const char *g_tokens[T] = {"the", "cat", "sat"};

// Element (r, c) of a 2-D or (1, r, c) 3-D float view.
static float at(const mha_tensor *t, int64_t r, int64_t c) {
    const float *p = t->data;
    int o = t->ndim - 2;
    return p[r * t->stride[o] + c * t->stride[o + 1]];
}

// Prints rows [0, rows) and columns [c0, c0 + cols) of a view, one row per
// line, labelled with the tokens.
static void print_mat(const mha_tensor *t, int64_t rows, int64_t c0, int64_t cols,
                      const char *indent) {
    for (int64_t r = 0; r < rows; r++) {
        printf("%s%-4s [", indent, r < T ? g_tokens[r] : "");
        for (int64_t c = 0; c < cols; c++) {
            float v = at(t, r, c0 + c);
            if (isinf(v)) printf(" %7s", v < 0 ? "-inf" : "inf");
            else printf(" %7.4f", (double)v);
        }
        printf(" ]\n");
    }
}

typedef struct demo_state {
    bool verbose;  // print every step (part 1) or only weights (part 2)
    int64_t keys;  // S' (number of keys)
} demo_state;

static void trace_step(void *user, const char *step, int64_t b, int64_t h, const mha_tensor *t) {
    demo_state *ds = user;
    (void)b;
    int64_t rows = t->shape[t->ndim - 2], cols = t->shape[t->ndim - 1];
    if (!ds->verbose) {
        if (!strcmp(step, "weights")) {
            printf("  head %lld attention weights (rows: queries, columns: keys "
                   "the/cat/sat):\n",
                   (long long)h);
            print_mat(t, rows, 0, cols, "    ");
        }
        return;
    }
    if (!strcmp(step, "q") || !strcmp(step, "k") || !strcmp(step, "v")) {
        char up = (char)(step[0] - 'a' + 'A');
        printf("\nStep 1%c. %c = X W_%s^T + b_%s: project every token to d_model = %d "
               "features (one GEMM over the packed in_proj_weight)\n",
               step[0] == 'q'   ? 'a'
               : step[0] == 'k' ? 'b'
                                : 'c',
               up, step, step, DM);
        print_mat(t, rows, 0, cols, "  ");
        printf("  Split into %d heads of d_k = %d: head h is features [4h, 4h+4) "
               "(a reshape (3, 12) -> (3, heads, 4) -> (heads, 3, 4), no copy):\n",
               NH, DK);
        for (int hh = 0; hh < NH; hh++) {
            printf("  head %d %c:\n", hh, up);
            print_mat(t, rows, hh * DK, DK, "    ");
        }
        return;
    }
    if (!strcmp(step, "scores")) {
        printf("\n---- head %lld ----\n", (long long)h);
        printf("Step 2. raw scores Q_h K_h^T (%lld x %lld): how well each query "
               "matches each key\n",
               (long long)rows, (long long)cols);
    } else if (!strcmp(step, "scaled_scores")) {
        printf("Step 3. scaled scores: divided by sqrt(d_k) = %.0f so their variance "
               "stays near 1 (masks would be added here, as -inf)\n",
               sqrt((double)DK));
    } else if (!strcmp(step, "weights")) {
        printf("Step 4. softmax row by row (row max subtracted first): each row is "
               "a probability distribution over the keys\n");
        print_mat(t, rows, 0, cols, "  ");
        for (int64_t r = 0; r < rows; r++) {
            double sum = 0;
            int64_t best = 0;
            for (int64_t c = 0; c < cols; c++) {
                sum += at(t, r, c);
                if (at(t, r, c) > at(t, r, best)) best = c;
            }
            printf("    row \"%s\": sums to %.4f, attends most to \"%s\" (%.2f)\n",
                   g_tokens[r], sum, g_tokens[best], (double)at(t, r, best));
        }
        return;
    } else if (!strcmp(step, "context")) {
        printf("Step 5. head context = weights V_h (%lld x %lld): each token's "
               "weighted mix of the values\n",
               (long long)rows, (long long)cols);
    } else if (!strcmp(step, "concat")) {
        printf("\nStep 6. concatenate the heads' contexts back to (3, 12) (the "
               "inverse reshape): features [4h, 4h+4) come from head h\n");
    } else if (!strcmp(step, "output")) {
        printf("\nStep 7. output = concat W_O^T + b_O: W_O mixes what the heads "
               "found into one d_model vector per token\n");
    }
    print_mat(t, rows, 0, cols, "  ");
}

// Readable parameters: multiples of 0.2 in [-0.6, 0.6] from a fixed
// pattern; biases 0 except out_proj.bias = 0.05.
static mha_status fill_readable(mha_module *m) {
    for (int i = 0; i < mha_module_num_params(m); i++) {
        mha_param p;
        mha_status st = mha_module_param_at(&p, m, i);
        if (st) return st;
        bool is_bias = strstr(p.name, "bias") != NULL;
        for (int64_t j = 0; j < p.numel; j++) {
            int64_t r = j / DM, c = j % DM;
            p.data[j] = is_bias ? 0.0f : 0.2f * (float)(((r * 5 + c * 3 + 1) % 7) - 3);
        }
        if (!strcmp(p.name, "out_proj.bias"))
            for (int64_t j = 0; j < p.numel; j++) p.data[j] = 0.05f;
    }
    return MHA_OK;
}

static int run_small(mha_module *m, const float *x, const mha_tensor *kpm,
                     const mha_tensor *amask, bool causal, bool verbose, float *out, float *w) {
    int64_t xs[2] = {T, DM}, ws[2] = {T, T};
    mha_tensor xt = mha_tensor_contiguous((void *)x, MHA_F32, 2, xs);
    mha_tensor ot = mha_tensor_contiguous(out, MHA_F32, 2, xs);
    mha_tensor wt = mha_tensor_contiguous(w, MHA_F32, 2, ws);
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &xt;
    a.key_padding_mask = kpm;
    a.attn_mask = amask;
    a.opts.is_causal = causal;
    a.need_weights = true;
    demo_state ds = {verbose, T};
    a.trace = trace_step;
    a.trace_user = &ds;
    mha_status st = mha_forward(&ot, &wt, m, &a);
    return st ? cli_fail("demo", st) : 0;
}

static int run_bert(int64_t N, int64_t L) {
    const int64_t E = 768, H = 12;
    printf("\n== Part 3: the same module at BERT-base size ==\n");
    printf("d_model %lld, %lld heads (d_k %lld), %lld tokens, batch %lld, "
           "PyTorch's default initialisation (seed 0), random inputs.\n",
           (long long)E, (long long)H, (long long)(E / H), (long long)L, (long long)N);
    mha_config cfg;
    mha_config_init(&cfg, E, H);
    cfg.batch_first = true;
    mha_module *m = NULL;
    mha_status st = mha_module_create(&m, &cfg);
    if (st) return cli_fail("demo", st);
    mha_init_options io;
    mha_init_options_init(&io);
    if ((st = mha_module_init(m, &io))) {
        mha_module_destroy(m);
        return cli_fail("demo", st);
    }
    size_t n = (size_t)(N * L * E);
    float *x = malloc(n * sizeof *x), *y = malloc(n * sizeof *y);
    if (!x || !y) {
        free(x);
        free(y);
        mha_module_destroy(m);
        fprintf(stderr, "mha demo: out of memory\n");
        return 1;
    }
    uint64_t s = 42;
    for (size_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        x[i] = (float)((double)(s >> 11) * 0x1p-53 * 2.0 - 1.0);
    }
    int64_t shape[3] = {N, L, E};
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, shape);
    mha_tensor yt = mha_tensor_contiguous(y, MHA_F32, 3, shape);
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &xt;
    double flops = 4.0 * 2.0 * (double)N * L * E * E  // Q, K, V, output projections
                   + 2.0 * 2.0 * (double)N * H * L * L * (E / H);  // QK^T and PV
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    // The fused path (tiled, SIMD), then the reference (the oracle), on the
    // same inputs: their largest difference is printed too.
    const mha_impl impls[2] = {MHA_IMPL_FUSED, MHA_IMPL_REFERENCE};
    float *y_fused = malloc(n * sizeof *y_fused);
    if (!y_fused) {
        free(x);
        free(y);
        mha_module_destroy(m);
        fprintf(stderr, "mha demo: out of memory\n");
        return 1;
    }
    for (int i = 0; i < 2; i++) {
        a.impl = impls[i];
        double t0 = cli_now();
        st = mha_forward(&yt, NULL, m, &a);
        double t1 = cli_now();
        if (st) {
            free(x);
            free(y);
            free(y_fused);
            mha_module_destroy(m);
            return cli_fail("demo", st);
        }
        double sum = 0;
        for (size_t j = 0; j < n; j++) sum += fabs(y[j]);
        printf("forward, %-9s (%s, %d threads): %8.1f ms for %.1f GFLOP = %6.2f GFLOP/s; "
               "mean |output| %.6f\n",
               mha_impl_name(impls[i]), impls[i] == MHA_IMPL_FUSED ? mha_isa() : "double",
               threads, (t1 - t0) * 1e3, flops * 1e-9, flops * 1e-9 / (t1 - t0),
               sum / (double)n);
        if (i == 0) memcpy(y_fused, y, n * sizeof *y);
    }
    double diff = 0;
    for (size_t j = 0; j < n; j++) diff = fmax(diff, fabs((double)y[j] - y_fused[j]));
    printf("largest |fused - reference| over the %zu outputs: %.3g\n", n, diff);
    printf("(One timed run each, on a possibly shared machine. The reference path is the\n"
           "readable oracle: plain loops in double, the full score matrix; the fused path\n"
           "never stores that matrix.)\n");
    free(y_fused);
    free(x);
    free(y);
    mha_module_destroy(m);
    return 0;
}

static const char *demo_help =
    "Usage: mha demo [--no-bert] [--batch N] [--tokens L]\n"
    "       mha demo heads [options]   (train a tiny model, show what its heads\n"
    "                                   learned; mha demo heads --help)\n"
    "A guided walk through multi-head attention: one small example (3 tokens,\n"
    "d_model 12, 3 heads) step by step, mask examples, then the module at\n"
    "BERT-base size (d_model 768, 12 heads, 512 tokens, batch 8) timed.\n"
    "  --no-bert     skip the timed BERT-base part\n"
    "  --batch N     batch of the BERT-base part (default 8)\n"
    "  --tokens L    tokens of the BERT-base part (default 512)\n";

// Reads the options into *bert, *batch and *tokens. Returns -1 to go on,
// else the exit status (0 after --help).
static int demo_parse(int argc, char **argv, bool *bert, long *batch, long *tokens) {
    static const struct option opts[] = {{"no-bert", no_argument, 0, 'n'},
                                         {"batch", required_argument, 0, 'b'},
                                         {"tokens", required_argument, 0, 't'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    int c;
    opterr = 0;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        char *end;
        switch (c) {
        case 'n': *bert = false; break;
        case 'b':
            *batch = strtol(optarg, &end, 10);
            if (*end || *batch <= 0) {
                fprintf(stderr, "mha demo: --batch needs a positive integer\n");
                return 2;
            }
            break;
        case 't':
            *tokens = strtol(optarg, &end, 10);
            if (*end || *tokens <= 0) {
                fprintf(stderr, "mha demo: --tokens needs a positive integer\n");
                return 2;
            }
            break;
        case 'h': fputs(demo_help, stdout); return 0;
        default: return cli_bad_option("demo", argv, opts);
        }
    }
    if (optind < argc) return cli_unexpected("demo", argv[optind]);
    return -1;
}

// Part 1: the input x (T, DM) and W_Q shown, then one forward traced step
// by step, and the weights it returns. 0, or 1 after printing.
static int demo_part1(mha_module *m, const float *x) {
    int64_t xs[2] = {T, DM};
    mha_tensor xt = mha_tensor_contiguous((void *)x, MHA_F32, 2, xs);
    printf("Input X (3 tokens x 12 features), self-attention (query = key = value = X):\n");
    print_mat(&xt, T, 0, DM, "  ");
    mha_param wq;
    mha_status st;
    if ((st = mha_module_param(&wq, m, "in_proj_weight"))) return cli_fail("demo", st);
    int64_t ws[2] = {3 * DM, DM};
    mha_tensor wt = mha_tensor_contiguous(wq.data, MHA_F32, 2, ws);
    printf("W_Q (first 4 of its 12 rows; in_proj_weight rows 0-11 are W_Q, "
           "12-23 W_K, 24-35 W_V; biases 0, out_proj.bias 0.05):\n");
    for (int r = 0; r < 4; r++) {
        printf("  [");
        for (int j = 0; j < DM; j++) printf(" %5.2f", (double)at(&wt, r, j));
        printf(" ]\n");
    }
    float out[T * DM], w[T * T];
    int rc = run_small(m, x, NULL, NULL, false, true, out, w);
    if (rc) return rc;
    printf("\nThe weights returned to the caller (need_weights, averaged over the "
           "%d heads), so you can look at them:\n",
           NH);
    int64_t w2[2] = {T, T};
    mha_tensor wv = mha_tensor_contiguous(w, MHA_F32, 2, w2);
    print_mat(&wv, T, 0, T, "  ");
    return 0;
}

// Part 2: the masks (causal, key padding, a fully masked row) on the same
// input. 0, or 1 after printing.
static int demo_part2(mha_module *m, const float *x) {
    float out[T * DM], w[T * T];
    printf("\n== Part 2: masks (applied to the scaled scores before the softmax, "
           "as -inf, never 0) ==\n");
    printf("\n-- Causal mask: token i may not see tokens j > i (a decoder must "
           "not peek at the future) --\n");
    int rc = run_small(m, x, NULL, NULL, true, false, out, w);
    if (rc) return rc;
    printf("  Above the diagonal every weight is exactly 0; \"the\" can only "
           "attend to itself (weight 1).\n");

    printf("\n-- Key padding mask: \"sat\" is padding (key_padding_mask = "
           "[false, false, true]) --\n");
    uint8_t kpm[T] = {0, 0, 1};
    int64_t ks[1] = {T};
    mha_tensor kt = mha_tensor_contiguous(kpm, MHA_BOOL, 1, ks);
    rc = run_small(m, x, &kt, NULL, false, false, out, w);
    if (rc) return rc;
    printf("  The \"sat\" column is exactly 0 in every head; the other weights "
           "renormalise to sum to 1.\n");

    printf("\n-- A fully masked row: attn_mask hides every key from \"cat\" --\n");
    uint8_t am[T * T] = {0, 0, 0, 1, 1, 1, 0, 0, 0};
    int64_t as[2] = {T, T};
    mha_tensor at_ = mha_tensor_contiguous(am, MHA_BOOL, 2, as);
    rc = run_small(m, x, NULL, &at_, false, false, out, w);
    if (rc) return rc;
    printf("  mha's rule: a row with no visible key gets weights 0 and attention "
           "result 0, so its output is out_proj.bias:\n");
    printf("  output of \"cat\": [");
    for (int j = 0; j < DM; j++) printf(" %.4f", (double)out[1 * DM + j]);
    printf(" ]\n  (PyTorch returns NaN here in some paths and 0 in others.)\n");
    return 0;
}

int cmd_demo(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "heads") == 0) return demo_heads(argc - 1, argv + 1);
    bool bert = true;
    long batch = 8, tokens = 512;
    int rc = demo_parse(argc, argv, &bert, &batch, &tokens);
    if (rc >= 0) return rc;

    printf("mha %s: multi-head attention, step by step\n", mha_version());
    printf("==============================================\n");
    printf("Attention lets every token look at every other token and take a "
           "weighted mix of what it finds.\n"
           "Multi-head attention does this %d times in parallel, each head in "
           "its own d_k = d_model / heads dimensional subspace.\n",
           NH);
    printf("\n== Part 1: one small example (seq_len %d, d_model %d, %d heads, "
           "d_k %d) ==\n",
           T, DM, NH, DK);

    mha_config cfg;
    mha_config_init(&cfg, DM, NH);
    mha_module *m = NULL;
    mha_status st = mha_module_create(&m, &cfg);
    if (st) return cli_fail("demo", st);
    if ((st = fill_readable(m))) {
        mha_module_destroy(m);
        return cli_fail("demo", st);
    }
    // Inputs: small integers, one row per token.
    float x[T * DM];
    for (int t = 0; t < T; t++)
        for (int j = 0; j < DM; j++) x[t * DM + j] = (float)(((t + 1) * (j + 2)) % 4 - 1);
    rc = demo_part1(m, x);
    if (!rc) rc = demo_part2(m, x);
    if (!rc && bert) rc = run_bert(batch, tokens);
    mha_module_destroy(m);
    return rc;
}
