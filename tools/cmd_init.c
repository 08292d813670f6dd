// cmd_init.c: `mha init`, freshly initialised nn.MultiheadAttention
// parameters written as a safetensors file under PyTorch's names. Public
// API only.
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "cmd.h"

static const char *init_help =
    "Usage: mha init --embed-dim E --num-heads H --out W.safetensors [options]\n"
    "Writes freshly initialised nn.MultiheadAttention parameters under\n"
    "PyTorch's names (in_proj_weight, in_proj_bias, out_proj.weight, ...)\n"
    "with __metadata__ num_heads (and num_kv_heads when it is not H).\n"
    "  --embed-dim E      model dimension (divisible by H unless --head-dim)\n"
    "  --num-heads H      number of heads\n"
    "  --num-kv-heads K   key/value heads, dividing H (grouped-query attention;\n"
    "                     default H): K/V weights of K * d rows\n"
    "  --head-dim D       per-head dim d (default E / H): q projects to H * D\n"
    "                     features, out_proj.weight is (E, H * D)\n"
    "  --kdim K, --vdim V key / value feature sizes (default E; when either\n"
    "                     differs, q/k/v_proj_weight are written separately)\n"
    "  --separate-qkv     q/k/v_proj_weight even when kdim = vdim = E\n"
    "  --no-bias          no in_proj_bias / out_proj.bias\n"
    "  --no-out-bias      in_proj_bias but no out_proj.bias\n"
    "  --add-bias-kv      add bias_k and bias_v\n"
    "  --init SCHEME      xavier_uniform (PyTorch's default), xavier_normal,\n"
    "                     normal, orthogonal, zeros\n"
    "  --gain G           gain for xavier_* and orthogonal (default 1)\n"
    "  --std S            std for normal (default 0.02)\n"
    "  --seed N           random seed (default 0)\n"
    "  --weight-dtype T   f32 (default), bf16 or f16: the weight matrices\n"
    "                     written in T (rounded, nearest even); biases F32\n"
    "  --head-gate G      none (default), static (\"head_gate\" (H), ones) or\n"
    "                     dynamic (\"gate_proj.weight\" (H, E) and\n"
    "                     \"gate_proj.bias\" (H), zeros: every gate 0.5)\n"
    "  --qk-norm N        none (default), head (\"q_norm.weight\", \"k_norm.weight\"\n"
    "                     (D) each: RMSNorm of each head's q and k, Qwen3) or\n"
    "                     all ((H * D), (K * D): over all features, OLMo 2);\n"
    "                     weights 1; eps 1e-6 (a file cannot carry it)\n"
    "  --prune-heads LIST heads to skip, comma-separated (__metadata__\n"
    "                     pruned_heads; mha forward/inspect honour it)\n"
    "  --out FILE         output safetensors file\n";

static const struct option init_opts[] = {{"embed-dim", required_argument, 0, 'e'},
                                          {"num-heads", required_argument, 0, 'n'},
                                          {"kdim", required_argument, 0, 'k'},
                                          {"vdim", required_argument, 0, 'v'},
                                          {"no-bias", no_argument, 0, 'B'},
                                          {"add-bias-kv", no_argument, 0, 'K'},
                                          {"init", required_argument, 0, 'i'},
                                          {"gain", required_argument, 0, 'g'},
                                          {"std", required_argument, 0, 's'},
                                          {"seed", required_argument, 0, 'S'},
                                          {"out", required_argument, 0, 'o'},
                                          {"help", no_argument, 0, 'h'},
                                          {"num-kv-heads", required_argument, 0, 'G'},
                                          {"weight-dtype", required_argument, 0, 'W'},
                                          {"head-gate", required_argument, 0, 'T'},
                                          {"prune-heads", required_argument, 0, 'P'},
                                          {"head-dim", required_argument, 0, 'd'},
                                          {"separate-qkv", no_argument, 0, 'Q'},
                                          {"no-out-bias", no_argument, 0, 'O'},
                                          {"qk-norm", required_argument, 0, 'N'},
                                          {0, 0, 0, 0}};

// Reads the options into cfg, io, *out and *prune (the --prune-heads
// list). Returns -1 to go on, else the exit status (0 after --help).
static int init_parse(int argc, char **argv, mha_config *cfg, mha_init_options *io,
                      const char **out, const char **prune) {
    int64_t seed = 0;
    int c;
    opterr = 0;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", init_opts, NULL)) != -1) {
        mha_status st;
        switch (c) {
        case 'e':
            if (cli_int_option(&cfg->embed_dim, "init", "--embed-dim", optarg, 1, INT64_MAX))
                return 2;
            break;
        case 'n':
            if (cli_int_option(&cfg->num_heads, "init", "--num-heads", optarg, 1, INT64_MAX))
                return 2;
            break;
        case 'G':
            if (cli_int_option(&cfg->num_kv_heads, "init", "--num-kv-heads", optarg, 1,
                               INT64_MAX))
                return 2;
            break;
        case 'k':  // (0: E, as the default)
            if (cli_int_option(&cfg->kdim, "init", "--kdim", optarg, 0, INT64_MAX)) return 2;
            break;
        case 'v':
            if (cli_int_option(&cfg->vdim, "init", "--vdim", optarg, 0, INT64_MAX)) return 2;
            break;
        case 'B': cfg->bias = false; break;
        case 'd':
            if (cli_int_option(&cfg->head_dim, "init", "--head-dim", optarg, 1, INT64_MAX))
                return 2;
            break;
        case 'Q': cfg->separate_qkv = true; break;
        case 'O': cfg->no_out_bias = true; break;
        case 'K': cfg->add_bias_kv = true; break;
        case 'i':
            if ((st = mha_init_scheme_from_name(&io->scheme, optarg)))
                return cli_bad_value("init", st);
            break;
        case 'g':
            if (cli_parse_f64(&io->gain, optarg))
                return cli_usage("init", "--gain needs a number");
            break;
        case 's':
            if (cli_parse_f64(&io->std, optarg))
                return cli_usage("init", "--std needs a number");
            break;
        case 'S':
            if (cli_parse_int(&seed, optarg, 0, INT64_MAX))
                return cli_usage("init", "--seed needs a non-negative integer");
            io->seed = (uint64_t)seed;
            break;
        case 'o': *out = optarg; break;
        case 'W':
            if (cli_float_dtype(&cfg->weight_dtype, optarg))
                return cli_usage("init", "--weight-dtype needs f32, bf16 or f16");
            break;
        case 'T':
            if ((st = mha_head_gate_from_name(&cfg->head_gate, optarg)))
                return cli_bad_value("init", st);
            break;
        case 'P': *prune = optarg; break;
        case 'N':
            if (!strcmp(optarg, "none")) cfg->qk_norm = MHA_QK_NORM_NONE;
            else if (!strcmp(optarg, "head")) cfg->qk_norm = MHA_QK_NORM_HEAD;
            else if (!strcmp(optarg, "all")) cfg->qk_norm = MHA_QK_NORM_ALL;
            else return cli_usage("init", "--qk-norm needs none, head or all");
            break;
        case 'h': fputs(init_help, stdout); return 0;
        default: return cli_bad_option("init", argv, init_opts);
        }
    }
    if (optind < argc) return cli_unexpected("init", argv[optind]);
    if (!*out) return cli_usage("init", "--out is required");
    if (cfg->embed_dim == 0) return cli_usage("init", "--embed-dim is required");
    if (cfg->num_heads == 0) return cli_usage("init", "--num-heads is required");
    return -1;
}

// "1,3": the heads to prune, into heads (at most 64). Returns how many, or
// -1 when the list is not comma-separated integers.
static int64_t parse_heads(int64_t *heads, const char *list) {
    int64_t n = 0;
    for (const char *p = list;;) {
        char *end;
        errno = 0;
        long long h = strtoll(p, &end, 10);
        if (errno || end == p || (*end && *end != ',') || n == 64) return -1;
        heads[n++] = h;
        if (!*end) return n;
        p = end + 1;
    }
}

int cmd_init(int argc, char **argv) {
    const char *prune = NULL, *out = NULL;
    mha_config cfg;
    mha_config_init(&cfg, 0, 0);
    mha_init_options io;
    mha_init_options_init(&io);
    int rc = init_parse(argc, argv, &cfg, &io, &out, &prune);
    if (rc >= 0) return rc;
    // Up to the save, every input is an option: the library's refusal of
    // one (E not divisible by H, a gain, a pruned head) is a usage error.
    mha_module *m;
    mha_status st = mha_module_create(&m, &cfg);
    if (st) return st == MHA_ERR_NOMEM ? cli_fail("init", st) : cli_bad_value("init", st);
    st = mha_module_init(m, &io);
    if (!st && prune) {  // "1,3": heads to prune
        int64_t heads[64], n = parse_heads(heads, prune);
        if (n < 0) {
            mha_module_destroy(m);
            return cli_usage("init", "--prune-heads needs comma-separated head "
                                     "indices (at most 64)");
        }
        st = mha_module_prune_heads(m, heads, n);
    }
    if (st) {
        mha_module_destroy(m);
        return st == MHA_ERR_NOMEM ? cli_fail("init", st) : cli_bad_value("init", st);
    }
    st = mha_module_save(m, out);
    mha_module_destroy(m);
    return st ? cli_fail("init", st) : 0;
}
