// mha: the command-line tool. Uses the public API only (include/mha.h).
//
//   mha init     write freshly initialised parameters
//   mha forward  run the module on tensors from a safetensors file
//   mha demo     a guided walk through one small example, then BERT-base
//   mha info     version, implementations, threads
//
// Errors go to stderr as one line "mha <command>: <message>"; the exit
// status is 1 on failure and 2 on a usage error.
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cli.h"

int cli_fail(const char *cmd, mha_status st) {
    fprintf(stderr, "mha %s: %s\n", cmd,
            mha_last_error()[0] ? mha_last_error() : mha_status_string(st));
    return 1;
}

double cli_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int usage_error(const char *cmd, const char *msg) {
    fprintf(stderr, "mha %s: %s (see mha %s --help)\n", cmd, msg, cmd);
    return 2;
}

// Strict integer / float option parsing.
static int parse_i64(const char *s, int64_t *out) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end) return -1;
    *out = v;
    return 0;
}

static int parse_f64(const char *s, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end) return -1;
    *out = v;
    return 0;
}

// ---------------------------------------------------------------------------
// mha init

static const char *init_help =
    "Usage: mha init --embed-dim E --num-heads H --out W.safetensors [options]\n"
    "Writes freshly initialised nn.MultiheadAttention parameters under\n"
    "PyTorch's names (in_proj_weight, in_proj_bias, out_proj.weight, ...)\n"
    "with __metadata__ num_heads.\n"
    "  --embed-dim E      model dimension (divisible by H)\n"
    "  --num-heads H      number of heads\n"
    "  --kdim K, --vdim V key / value feature sizes (default E; when either\n"
    "                     differs, q/k/v_proj_weight are written separately)\n"
    "  --no-bias          no in_proj_bias / out_proj.bias\n"
    "  --add-bias-kv      add bias_k and bias_v\n"
    "  --init SCHEME      xavier_uniform (PyTorch's default), xavier_normal,\n"
    "                     normal, orthogonal, zeros\n"
    "  --gain G           gain for xavier_* and orthogonal (default 1)\n"
    "  --std S            std for normal (default 0.02)\n"
    "  --seed N           random seed (default 0)\n"
    "  --out FILE         output safetensors file\n";

static int cmd_init(int argc, char **argv) {
    static const struct option opts[] = {
        {"embed-dim", required_argument, 0, 'e'}, {"num-heads", required_argument, 0, 'n'},
        {"kdim", required_argument, 0, 'k'},      {"vdim", required_argument, 0, 'v'},
        {"no-bias", no_argument, 0, 'B'},         {"add-bias-kv", no_argument, 0, 'K'},
        {"init", required_argument, 0, 'i'},      {"gain", required_argument, 0, 'g'},
        {"std", required_argument, 0, 's'},       {"seed", required_argument, 0, 'S'},
        {"out", required_argument, 0, 'o'},       {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    mha_config cfg;
    mha_config_init(&cfg, 0, 0);
    mha_init_options io;
    mha_init_options_default(&io);
    const char *out = NULL;
    int64_t seed = 0;
    int c;
    opterr = 0;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        mha_status st;
        switch (c) {
        case 'e': if (parse_i64(optarg, &cfg.embed_dim)) return usage_error("init", "--embed-dim needs an integer"); break;
        case 'n': if (parse_i64(optarg, &cfg.num_heads)) return usage_error("init", "--num-heads needs an integer"); break;
        case 'k': if (parse_i64(optarg, &cfg.kdim)) return usage_error("init", "--kdim needs an integer"); break;
        case 'v': if (parse_i64(optarg, &cfg.vdim)) return usage_error("init", "--vdim needs an integer"); break;
        case 'B': cfg.bias = false; break;
        case 'K': cfg.add_bias_kv = true; break;
        case 'i':
            if ((st = mha_init_scheme_from_name(&io.scheme, optarg))) return cli_fail("init", st);
            break;
        case 'g': if (parse_f64(optarg, &io.gain)) return usage_error("init", "--gain needs a number"); break;
        case 's': if (parse_f64(optarg, &io.std)) return usage_error("init", "--std needs a number"); break;
        case 'S':
            if (parse_i64(optarg, &seed) || seed < 0) return usage_error("init", "--seed needs a non-negative integer");
            io.seed = (uint64_t)seed;
            break;
        case 'o': out = optarg; break;
        case 'h': fputs(init_help, stdout); return 0;
        default: return usage_error("init", "unknown or incomplete option");
        }
    }
    if (optind < argc) return usage_error("init", "unexpected argument");
    if (!out) return usage_error("init", "--out is required");
    if (cfg.embed_dim == 0 || cfg.num_heads == 0)
        return usage_error("init", "--embed-dim and --num-heads are required");
    mha_module *m;
    mha_status st = mha_module_create(&m, &cfg);
    if (st) return cli_fail("init", st);
    st = mha_module_init(m, &io);
    if (!st) st = mha_module_save(m, out);
    mha_module_destroy(m);
    return st ? cli_fail("init", st) : 0;
}

// ---------------------------------------------------------------------------
// mha forward

static const char *forward_help =
    "Usage: mha forward --weights W.safetensors --inputs X.safetensors\n"
    "                   --out Y.safetensors [options]\n"
    "Runs nn.MultiheadAttention's forward (PyTorch semantics).\n"
    "W: parameters under PyTorch's names; bias, kdim/vdim and add_bias_kv\n"
    "   follow from which tensors are present.\n"
    "X: query (L, N, E) [(N, L, E) with --batch-first; (L, E) unbatched],\n"
    "   key (S, N, kdim), value (S, N, vdim) (both absent: self-attention,\n"
    "   key = value = query), optional key_padding_mask (N, S) and\n"
    "   attn_mask (L, S) or (N*H, L, S): BOOL/U8 (true = masked) or float\n"
    "   (added).\n"
    "Y: attn_output, and with --need-weights attn_output_weights.\n"
    "  --num-heads H        heads (default: the weights' __metadata__)\n"
    "  --batch-first        (N, L, E) inputs and output\n"
    "  --causal             hide keys j > i\n"
    "  --add-zero-attn      append a zero key/value\n"
    "  --need-weights       also write attn_output_weights (mean over heads)\n"
    "  --no-average-weights per-head weights (N, H, L, S)\n"
    "  --impl NAME          auto (default) or reference\n"
    "A query row whose keys are all masked gets weights 0 and output\n"
    "out_proj.bias.\n";

// A tensor read from a file into float32 (or bool) memory we own.
typedef struct cli_tensor {
    mha_tensor view;
    void *buf;
} cli_tensor;

// Loads input `name` of file `path` if present. kind 0: float data (-> F32);
// kind 1: a mask (BOOL/U8 -> BOOL, float -> F32). Returns 0, or 1 after
// printing the error.
static int load_input(cli_tensor *out, bool *found, const mha_st_file *f,
                      const char *path, const char *name, int kind) {
    memset(out, 0, sizeof *out);
    *found = false;
    mha_st_tensor t;
    mha_status st = mha_st_find(&t, f, name);
    if (st == MHA_ERR_NOT_FOUND) return 0;
    if (st) return cli_fail("forward", st);
    mha_dtype to = MHA_F32;
    bool is_float = t.dtype == MHA_F32 || t.dtype == MHA_F16 ||
                    t.dtype == MHA_BF16 || t.dtype == MHA_F64;
    if (kind == 1 && (t.dtype == MHA_BOOL || t.dtype == MHA_U8)) {
        to = MHA_BOOL;
    } else if (!is_float) {
        fprintf(stderr, "mha forward: %s: \"%s\" has dtype %s (expected F32, "
                "F16, BF16 or F64%s)\n", path, name, mha_dtype_name(t.dtype),
                kind == 1 ? ", or BOOL/U8 for a mask" : "");
        return 1;
    }
    size_t bytes = (size_t)t.numel * mha_dtype_size(to);
    out->buf = malloc(bytes ? bytes : 1);
    if (!out->buf) {
        fprintf(stderr, "mha forward: %s: out of memory for \"%s\" (%zu bytes)\n",
                path, name, bytes);
        return 1;
    }
    if ((st = mha_st_read(out->buf, bytes, to, &t))) return cli_fail("forward", st);
    out->view = mha_tensor_contiguous(out->buf, to, t.ndim, t.shape);
    *found = true;
    return 0;
}

static int cmd_forward(int argc, char **argv) {
    static const struct option opts[] = {
        {"weights", required_argument, 0, 'w'},   {"inputs", required_argument, 0, 'x'},
        {"out", required_argument, 0, 'o'},       {"num-heads", required_argument, 0, 'n'},
        {"batch-first", no_argument, 0, 'b'},     {"causal", no_argument, 0, 'c'},
        {"add-zero-attn", no_argument, 0, 'z'},   {"need-weights", no_argument, 0, 'W'},
        {"no-average-weights", no_argument, 0, 'A'}, {"impl", required_argument, 0, 'i'},
        {"help", no_argument, 0, 'h'},            {0, 0, 0, 0}};
    const char *wpath = NULL, *xpath = NULL, *ypath = NULL;
    mha_config base;
    mha_config_init(&base, 0, 0);
    mha_forward_args a;
    mha_forward_args_init(&a);
    bool no_avg = false;
    int c;
    opterr = 0;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        mha_status st;
        switch (c) {
        case 'w': wpath = optarg; break;
        case 'x': xpath = optarg; break;
        case 'o': ypath = optarg; break;
        case 'n':
            if (parse_i64(optarg, &base.num_heads) || base.num_heads <= 0)
                return usage_error("forward", "--num-heads needs a positive integer");
            break;
        case 'b': base.batch_first = true; break;
        case 'c': a.is_causal = true; break;
        case 'z': base.add_zero_attn = true; break;
        case 'W': a.need_weights = true; break;
        case 'A': no_avg = true; break;
        case 'i':
            if ((st = mha_impl_from_name(&a.impl, optarg))) return cli_fail("forward", st);
            break;
        case 'h': fputs(forward_help, stdout); return 0;
        default: return usage_error("forward", "unknown or incomplete option");
        }
    }
    if (optind < argc) return usage_error("forward", "unexpected argument");
    if (!wpath || !xpath || !ypath)
        return usage_error("forward", "--weights, --inputs and --out are required");
    if (no_avg && !a.need_weights)
        return usage_error("forward", "--no-average-weights needs --need-weights");
    a.average_attn_weights = !no_avg;

    int rc = 1;
    mha_st_file *wf = NULL, *xf = NULL;
    mha_module *m = NULL;
    cli_tensor in[5];
    memset(in, 0, sizeof in);
    float *yo = NULL, *yw = NULL;
    mha_st_writer *wr = NULL;
    mha_status st;
    if ((st = mha_st_open(&wf, wpath))) goto fail;
    if ((st = mha_module_load(&m, wf, &base))) goto fail;
    if ((st = mha_st_open(&xf, xpath))) goto fail;
    static const char *names[5] = {"query", "key", "value", "key_padding_mask",
                                   "attn_mask"};
    bool found[5];
    for (int i = 0; i < 5; i++)
        if (load_input(&in[i], &found[i], xf, xpath, names[i], i >= 3)) goto cleanup;
    for (int64_t i = 0; i < mha_st_num_tensors(xf); i++) {
        mha_st_tensor t;
        if ((st = mha_st_tensor_at(&t, xf, i))) goto fail;
        bool known = false;
        for (int j = 0; j < 5; j++) known |= strcmp(t.name, names[j]) == 0;
        if (!known) {
            char qn[128];
            fprintf(stderr, "mha forward: %s: unexpected tensor %s (inputs are "
                    "query, key, value, key_padding_mask, attn_mask)\n", xpath,
                    mha_escape(qn, sizeof qn, t.name));
            goto cleanup;
        }
    }
    if (!found[0]) {
        fprintf(stderr, "mha forward: %s: no \"query\" tensor\n", xpath);
        goto cleanup;
    }
    if (found[1] != found[2]) {
        fprintf(stderr, "mha forward: %s: has \"%s\" but no \"%s\" (give both, or "
                "neither for self-attention)\n", xpath, found[1] ? "key" : "value",
                found[1] ? "value" : "key");
        goto cleanup;
    }
    a.query = &in[0].view;
    a.key = found[1] ? &in[1].view : &in[0].view;
    a.value = found[2] ? &in[2].view : &in[0].view;
    a.key_padding_mask = found[3] ? &in[3].view : NULL;
    a.attn_mask = found[4] ? &in[4].view : NULL;
    mha_shape os, wsh;
    if ((st = mha_forward_shapes(&os, &wsh, m, &a))) goto fail;
    int64_t on = 1, wn = 1;
    for (int i = 0; i < os.ndim; i++) on *= os.dims[i];
    for (int i = 0; i < wsh.ndim; i++) wn *= wsh.dims[i];
    yo = malloc((size_t)(on ? on : 1) * sizeof(float));
    yw = a.need_weights ? malloc((size_t)(wn ? wn : 1) * sizeof(float)) : NULL;
    if (!yo || (a.need_weights && !yw)) {
        fprintf(stderr, "mha forward: out of memory for the outputs\n");
        goto cleanup;
    }
    mha_tensor ot = mha_tensor_contiguous(yo, MHA_F32, os.ndim, os.dims);
    mha_tensor wt = mha_tensor_contiguous(yw, MHA_F32, wsh.ndim, wsh.dims);
    if ((st = mha_forward(&ot, a.need_weights ? &wt : NULL, m, &a))) goto fail;
    if ((st = mha_st_writer_create(&wr))) goto fail;
    if ((st = mha_st_writer_add(wr, "attn_output", MHA_F32, os.ndim, os.dims, yo))) goto fail;
    if (a.need_weights &&
        (st = mha_st_writer_add(wr, "attn_output_weights", MHA_F32, wsh.ndim, wsh.dims, yw)))
        goto fail;
    if ((st = mha_st_writer_save(wr, ypath))) goto fail;
    rc = 0;
    goto cleanup;
fail:
    rc = cli_fail("forward", st);
cleanup:
    mha_st_writer_destroy(wr);
    free(yo);
    free(yw);
    for (int i = 0; i < 5; i++) free(in[i].buf);
    mha_module_destroy(m);
    mha_st_close(xf);
    mha_st_close(wf);
    return rc;
}

// ---------------------------------------------------------------------------
// mha info

static int cmd_info(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--help") == 0) {
        puts("Usage: mha info\nPrints the version, implementations and threads.");
        return 0;
    }
    printf("mha %s\n", mha_version());
    printf("implementations: reference (plain loops, the oracle); auto -> reference\n");
#ifdef _OPENMP
    printf("threads: %d (OpenMP; set OMP_NUM_THREADS)\n", omp_get_max_threads());
#else
    printf("threads: 1 (built without OpenMP)\n");
#endif
    return 0;
}

static const char *main_help =
    "Usage: mha <command> [options]   (mha <command> --help for details)\n"
    "Multi-head attention with PyTorch nn.MultiheadAttention semantics.\n"
    "Commands:\n"
    "  demo      a guided walk through multi-head attention, step by step\n"
    "  init      write freshly initialised parameters (safetensors)\n"
    "  forward   run the module on tensors from a safetensors file\n"
    "  info      version, implementations, threads\n"
    "  version   print the version\n";

int main(int argc, char **argv) {
    if (argc < 2) {
        fputs(main_help, stderr);
        return 2;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "--help") || !strcmp(cmd, "-h") || !strcmp(cmd, "help")) {
        fputs(main_help, stdout);
        return 0;
    }
    if (!strcmp(cmd, "version") || !strcmp(cmd, "--version")) {
        printf("mha %s\n", mha_version());
        return 0;
    }
    if (!strcmp(cmd, "init")) return cmd_init(argc - 1, argv + 1);
    if (!strcmp(cmd, "forward")) return cmd_forward(argc - 1, argv + 1);
    if (!strcmp(cmd, "demo")) return cmd_demo(argc - 1, argv + 1);
    if (!strcmp(cmd, "info")) return cmd_info(argc - 1, argv + 1);
    fprintf(stderr, "mha: unknown command \"%s\" (see mha --help)\n", cmd);
    return 2;
}
