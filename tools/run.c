// run.c: what `mha forward`, `mha backward` and `mha inspect` share (run.h):
// their help texts, their options, and loading the weights and inputs
// files into a run. Public API only.
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "run.h"

// Loads input `name` of file `path` if present. kind 0: float data (->
// fto: F32, BF16 or F16 in memory); kind 1: a mask (BOOL/U8 -> BOOL,
// float -> F32). Returns 0, or 1 after printing the error.
static int load_input(cli_tensor *out, bool *found, const mha_st_file *f, const char *cmd,
                      const char *path, const char *name, int kind, mha_dtype fto) {
    memset(out, 0, sizeof *out);
    *found = false;
    mha_st_tensor t;
    mha_status st = mha_st_find(&t, f, name);
    if (st == MHA_ERR_NOT_FOUND) return 0;
    if (st) return cli_fail(cmd, st);
    mha_dtype to = MHA_F32;
    bool is_float = t.dtype == MHA_F32 || t.dtype == MHA_F16 || t.dtype == MHA_BF16 ||
                    t.dtype == MHA_F64;
    if (kind == 1 && (t.dtype == MHA_BOOL || t.dtype == MHA_U8)) {
        to = MHA_BOOL;
    } else if (!is_float) {
        fprintf(stderr,
                "mha %s: %s: \"%s\" has dtype %s (expected F32, "
                "F16, BF16 or F64%s)\n",
                cmd, path, name, mha_dtype_name(t.dtype),
                kind == 1 ? ", or BOOL/U8 for a mask" : "");
        return 1;
    }
    size_t bytes = (size_t)t.numel * mha_dtype_size(to);
    out->buf = malloc(bytes ? bytes : 1);
    if (!out->buf) {
        fprintf(stderr, "mha %s: %s: out of memory for \"%s\" (%zu bytes)\n", cmd, path, name,
                bytes);
        return 1;
    }
    if ((st = mha_st_read(out->buf, bytes, to, &t))) return cli_fail(cmd, st);
    if (kind == 0 && fto != MHA_F32) {  // float32 -> bf16/f16, in place
        const float *src = out->buf;
        uint16_t *dst = out->buf;  // element i's 2 bytes lie before float i+1
        for (int64_t i = 0; i < t.numel; i++)
            dst[i] = fto == MHA_BF16 ? mha_f32_to_bf16(src[i]) : mha_f32_to_f16(src[i]);
        to = fto;
    }
    out->view = mha_tensor_contiguous(out->buf, to, t.ndim, t.shape);
    *found = true;
    return 0;
}

static const char *forward_help =
    "Usage: mha forward --weights W.safetensors --inputs X.safetensors\n"
    "                   --out Y.safetensors [options]\n"
    "Runs nn.MultiheadAttention's forward (PyTorch semantics).\n"
    "W: parameters under PyTorch's names; bias, kdim/vdim, add_bias_kv, the\n"
    "   head dim (out_proj.weight (E, H d)), separate q/k/v_proj_weight and\n"
    "   no out_proj.bias follow from which tensors are present.\n"
    "X: query (L, N, E) [(N, L, E) with --batch-first; (L, E) unbatched],\n"
    "   key (S, N, kdim), value (S, N, vdim) (both absent: self-attention,\n"
    "   key = value = query), optional key_padding_mask (N, S) and\n"
    "   attn_mask (L, S) or (N*H, L, S): BOOL/U8 (true = masked) or float\n"
    "   (added); optional position_ids (N, L) or (1, L) (L unbatched),\n"
    "   integers: the RoPE position of every token (transformers'\n"
    "   position_ids; self-attention or L == S).\n"
    "Y: attn_output, and with --need-weights attn_output_weights.\n"
    "  --num-heads H        heads (default: the weights' __metadata__)\n"
    "  --num-kv-heads K     key/value heads (default: the weights' __metadata__\n"
    "                       num_kv_heads, else from the K/V weight shapes)\n"
    "  --batch-first        (N, L, E) inputs and output\n"
    "  --causal             hide keys j > i\n"
    "  --window-left W      sliding window: hide keys j < i - W\n"
    "  --window-right W     sliding window: hide keys j > i + W\n"
    "  --add-zero-attn      append a zero key/value\n"
    "  --incremental        causal self-attention through a KV cache, token by\n"
    "                       token (mha_forward_cached): the result equals\n"
    "                       --causal's; --chunk N feeds N tokens per step\n"
    "                       (chunked prefill); --kv-dtype f32|bf16|f16|int8|int4\n"
    "                       the cache's storage\n"
    "  --dtype T            f32 (default), bf16 or f16: query/key/value and\n"
    "                       the outputs stored in T (computation in float32)\n"
    "  --weight-dtype T     f32 (default), bf16 or f16: the module keeps its\n"
    "                       weight matrices in T (loaded and rounded; half the\n"
    "                       memory; forward only)\n"
    "  --rope MODE          RoPE on q and k after the projections: neox\n"
    "                       (rotate_half) or interleaved\n"
    "  --rope-theta T       RoPE base (default 10000)\n"
    "  --rope-dim D         rotate only the first D features of each head\n"
    "  --rope-start P       position of the first token (default 0)\n"
    "  --rope-scaling TYPE  RoPE scaling as transformers' rope_type: linear,\n"
    "                       dynamic (NTK, from the call's largest position),\n"
    "                       yarn or llama3 (default: none), with:\n"
    "  --rope-factor F      its factor (default 1)\n"
    "  --rope-original-max N  original_max_position_embeddings (dynamic:\n"
    "                       max_position_embeddings); dynamic, yarn, llama3\n"
    "  --rope-low-freq-factor F, --rope-high-freq-factor F  llama3 (1, 4)\n"
    "  --rope-beta-fast F, --rope-beta-slow F  yarn (32, 1)\n"
    "  --rope-mscale F, --rope-mscale-all-dim F  yarn (unset)\n"
    "  --rope-attention-factor F  yarn's cos/sin factor (default: derived)\n"
    "  --rope-no-truncate   yarn: do not round the correction range\n"
    "  --alibi              ALiBi biases (the paper's slopes)\n"
    "  --softcap C          logit soft cap C tanh(s / C)\n"
    "  --scale S            the query scale (default 1 / sqrt(head dim); > 0)\n"
    "  --need-weights       also write attn_output_weights (mean over heads)\n"
    "  --no-average-weights per-head weights (N, H, L, S)\n"
    "  --weights-heads A:B  only heads [A, B) in the weights (averaged: their\n"
    "                       mean); B may be omitted (A: = to the last)\n"
    "  --weights-rows A:B   only query rows [A, B) in the weights\n"
    "  --impl NAME          auto (default), reference or fused\n"
    "  --dropout P          dropout on the attention weights (with --train)\n"
    "  --out-dropout P      dropout after the output projection (with --train)\n"
    "  --train              training mode: apply dropout (default: eval)\n"
    "  --seed N             dropout seed (Philox4x32-10 key; default 0)\n"
    "  --parallel SCHEME    across MPI ranks (run under mpirun): heads (head\n"
    "                       parallelism, bit-identical to one process),\n"
    "                       heads-fast (partial sums, MPI_Allreduce) or\n"
    "                       ulysses (each rank a block of the tokens,\n"
    "                       all-to-all; bit-identical) or ring (each rank two\n"
    "                       zigzag chunks of the tokens, key/value blocks\n"
    "                       around the ring; within tolerance); every rank\n"
    "                       reads the files, rank 0 writes the output\n"
    "  --dropout-offset N   dropout offset (Philox counter; default 0)\n"
    "A query row whose keys are all masked gets weights 0 and output\n"
    "out_proj.bias.\n";

static const char *checkpoint_help =
    "A Hugging Face checkpoint instead of --weights (mha forward, mha inspect):\n"
    "  --checkpoint DIR     config.json + model.safetensors (or the shards of\n"
    "                       model.safetensors.index.json): bert, gpt2, llama,\n"
    "                       mistral, qwen2, qwen3, gemma2, gpt_oss\n"
    "  --layer I            the layer whose attention runs (default 0); its\n"
    "                       causal mask, sliding window, RoPE (and scaling),\n"
    "                       soft cap and scale come from config.json\n"
    "  X then holds hidden_states (N, L, E), optional position_ids (N, L)\n"
    "  (integers: RoPE positions) and attention_mask (N, L) (1 = token, 0 =\n"
    "  padding: hidden as keys); Y holds attn_output (N, L, E), the attention\n"
    "  block's output before any residual or norm.\n";

static const char *backward_help =
    "Usage: mha backward --weights W.safetensors --inputs X.safetensors\n"
    "                    --grad-output G.safetensors --out grads.safetensors\n"
    "                    [the forward's options]\n"
    "Gradients of nn.MultiheadAttention's forward. G holds grad_attn_output\n"
    "(the shape of attn_output). The output holds attn_output, grad_query,\n"
    "grad_key, grad_value and grad_<name> for every parameter (e.g.\n"
    "grad_in_proj_weight, grad_out_proj.weight, grad_bias_k). When key and\n"
    "value are absent (self-attention) grad_query is the input's whole\n"
    "gradient (the sum of its parts through the query, key and value paths,\n"
    "as Python's MultiheadAttention.backward gives it) and there is no\n"
    "grad_key or grad_value. Dropout masks (--train) are regenerated from\n"
    "--seed and --dropout-offset, as in the forward with the same options.\n";

static const char *inspect_help =
    "Usage: mha inspect --weights W.safetensors --inputs X.safetensors --out DIR\n"
    "                   [options]\n"
    "Looks inside the heads (mha_diag_create, eval mode) and writes into DIR\n"
    "(created if needed):\n"
    "  diagnostics.json  per head: attention entropy (mean, min, normalised;\n"
    "                    nats), mean attended distance, logit max and std,\n"
    "                    output variance ratio, dead flag, numerical ranks and\n"
    "                    singular values of its W_Q/W_K/W_V/W_O slices; the\n"
    "                    head-similarity matrix (1 - JS divergence / ln 2); the\n"
    "                    first non-finite value; the rows examined\n"
    "  heads.png         each head's attention weights for one batch element\n"
    "                    (one colour scale for all heads; token labels)\n"
    "  similarity.png    the head-similarity matrix\n"
    "  spectra.png       singular values of the W_Q/W_K/W_V/W_O slices\n"
    "  report.html       one self-contained page: the pictures, every number,\n"
    "                    the inputs\n"
    "The pictures and report.html need an mha built with cairo (libcairo2-dev);\n"
    "without it only diagnostics.json is written.\n"
    "W, X and these options are as in mha forward (see mha forward --help):\n"
    "  --num-heads, --num-kv-heads, --batch-first, --causal, --window-left,\n"
    "  --window-right, --add-zero-attn, --dtype, --weight-dtype, --rope,\n"
    "  --rope-theta, --rope-dim, --rope-start, --rope-scaling and its\n"
    "  parameters, --alibi, --softcap, --scale (and the inputs' position_ids)\n"
    "Inspect's own:\n"
    "  --tokens FILE        one label per line for the positions (the query's,\n"
    "                       and the keys' in self-attention); positions past\n"
    "                       the last line are labelled by their index\n"
    "  --max-rows N         query rows examined per batch element, spread evenly\n"
    "                       (default 256; 0: every row)\n"
    "  --batch-index B      the batch element the heatmaps show (default 0)\n"
    "  --plot-len N         the heatmaps show query and key positions [0, N)\n"
    "                       (default 64)\n";

void run_free(run *r) {
    for (int64_t i = 0; i < r->ntokens; i++) free(r->tokens[i]);
    free(r->tokens);
    free(r->rope_starts);
    free(r->rope_positions);
    mha_st_writer_destroy(r->wr);
    for (int i = 0; i < r->nbufs; i++) free(r->bufs[i]);
    for (int i = 0; i < 5; i++) free(r->in[i].buf);
    mha_module_destroy(r->m);
    mha_st_close(r->gf);
    mha_st_close(r->xf);
    mha_st_close(r->wf);
}

// A zeroed float buffer of n elements owned by r (NULL after printing an
// error).
float *run_alloc(run *r, int64_t n) {
    float *p = calloc((size_t)(n > 0 ? n : 1), sizeof(float));
    if (!p) fprintf(stderr, "mha %s: out of memory for %lld floats\n", r->cmd, (long long)n);
    else r->bufs[r->nbufs++] = p;
    return p;
}

// The options of forward, backward and inspect (one table; run_parse
// refuses those of the other commands).
static const struct option run_opts[] = {{"weights", required_argument, 0, 'w'},
                                         {"inputs", required_argument, 0, 'x'},
                                         {"out", required_argument, 0, 'o'},
                                         {"num-heads", required_argument, 0, 'n'},
                                         {"batch-first", no_argument, 0, 'b'},
                                         {"causal", no_argument, 0, 'c'},
                                         {"add-zero-attn", no_argument, 0, 'z'},
                                         {"need-weights", no_argument, 0, 'W'},
                                         {"no-average-weights", no_argument, 0, 'A'},
                                         {"impl", required_argument, 0, 'i'},
                                         {"dropout", required_argument, 0, 'd'},
                                         {"out-dropout", required_argument, 0, 'D'},
                                         {"train", no_argument, 0, 't'},
                                         {"seed", required_argument, 0, 's'},
                                         {"dropout-offset", required_argument, 0, 'O'},
                                         {"grad-output", required_argument, 0, 'g'},
                                         {"help", no_argument, 0, 'h'},
                                         {"window-left", required_argument, 0, 'L'},
                                         {"window-right", required_argument, 0, 'R'},
                                         {"weights-heads", required_argument, 0, 'H'},
                                         {"weights-rows", required_argument, 0, 'r'},
                                         {"rope", required_argument, 0, 'P'},
                                         {"rope-theta", required_argument, 0, 'T'},
                                         {"rope-dim", required_argument, 0, 'E'},
                                         {"rope-start", required_argument, 0, 'X'},
                                         {"alibi", no_argument, 0, 'B'},
                                         {"softcap", required_argument, 0, 'C'},
                                         {"incremental", no_argument, 0, 'M'},
                                         {"chunk", required_argument, 0, 'K'},
                                         {"kv-dtype", required_argument, 0, 'Q'},
                                         {"dtype", required_argument, 0, 'Y'},
                                         {"num-kv-heads", required_argument, 0, 'G'},
                                         {"weight-dtype", required_argument, 0, 'j'},
                                         {"tokens", required_argument, 0, 'k'},
                                         {"max-rows", required_argument, 0, 'm'},
                                         {"batch-index", required_argument, 0, 'N'},
                                         {"plot-len", required_argument, 0, 'p'},
                                         {"parallel", required_argument, 0, 'Z'},
                                         {"checkpoint", required_argument, 0, 'a'},
                                         {"layer", required_argument, 0, 'l'},
                                         // RoPE scaling (values past the characters)
                                         {"rope-scaling", required_argument, 0, 0x100},
                                         {"rope-factor", required_argument, 0, 0x101},
                                         {"rope-original-max", required_argument, 0, 0x102},
                                         {"rope-low-freq-factor", required_argument, 0, 0x103},
                                         {"rope-high-freq-factor", required_argument, 0, 0x104},
                                         {"rope-beta-fast", required_argument, 0, 0x105},
                                         {"rope-beta-slow", required_argument, 0, 0x106},
                                         {"rope-mscale", required_argument, 0, 0x107},
                                         {"rope-mscale-all-dim", required_argument, 0, 0x108},
                                         {"rope-attention-factor", required_argument, 0, 0x109},
                                         {"rope-no-truncate", no_argument, 0, 0x10a},
                                         {"scale", required_argument, 0, 'F'},
                                         {0, 0, 0, 0}};

// One handler per group of options: each takes option c (its value in
// optarg) and returns -1 when it took it, the exit status when its value
// is bad, or RUN_NOT_MINE when c is not of its group.
enum { RUN_NOT_MINE = -2 };

// The files: --weights, --inputs, --out, --grad-output.
static int opt_files(run *r, bool backward, int c) {
    switch (c) {
    case 'w': r->wpath = optarg; break;
    case 'x': r->xpath = optarg; break;
    case 'o': r->ypath = optarg; break;
    case 'a':
        if (backward) return cli_usage(r->cmd, "--checkpoint is for mha forward and inspect");
        r->ckpt = optarg;
        break;
    case 'l':
        if (cli_parse_int(&r->layer, optarg, 0, INT64_MAX))
            return cli_usage(r->cmd, "--layer needs a non-negative integer");
        break;
    case 'g':
        if (!backward) return cli_usage(r->cmd, "--grad-output is for mha backward");
        r->gpath = optarg;
        break;
    default: return RUN_NOT_MINE;
    }
    return -1;
}

// The module's configuration (r->base): heads, layout, zero attention,
// dropout, the weights' dtype.
static int opt_module(run *r, int c) {
    const char *cmd = r->cmd;
    double f;
    switch (c) {
    case 'n':
        if (cli_parse_int(&r->base.num_heads, optarg, 1, INT64_MAX))
            return cli_usage(cmd, "--num-heads needs a positive integer");
        break;
    case 'G':
        if (cli_parse_int(&r->base.num_kv_heads, optarg, 1, INT64_MAX))
            return cli_usage(cmd, "--num-kv-heads needs a positive integer");
        break;
    case 'b': r->base.batch_first = true; break;
    case 'z': r->base.add_zero_attn = true; break;
    case 'd':
    case 'D':
        if (cli_parse_f64(&f, optarg) || !(f >= 0.0 && f < 1.0))
            return cli_usage(cmd, "--dropout and --out-dropout need P in [0, 1)");
        *(c == 'd' ? &r->base.dropout : &r->base.out_dropout) = (float)f;
        break;
    case 'j':
        if (cli_float_dtype(&r->base.weight_dtype, optarg))
            return cli_usage(cmd, "--weight-dtype needs f32, bf16 or f16");
        break;
    default: return RUN_NOT_MINE;
    }
    return -1;
}

// The call's arguments (r->a): masking, the weights output, the
// implementation, training and its dropout stream.
static int opt_call(run *r, int c, bool *no_avg) {
    const char *cmd = r->cmd;
    mha_status st;
    int64_t v;
    double f;
    switch (c) {
    case 'c': r->a.opts.is_causal = true; break;
    case 'W': r->a.need_weights = true; break;
    case 'A': *no_avg = true; break;
    case 'i':
        if ((st = mha_impl_from_name(&r->a.impl, optarg))) return cli_bad_value(cmd, st);
        break;
    case 't': r->a.training = true; break;
    case 'C':
        if (cli_parse_f64(&f, optarg) || !(f > 0.0))
            return cli_usage(cmd, "--softcap needs a positive number");
        r->a.opts.softcap = (float)f;
        break;
    case 'F':
        if (cli_parse_f64(&f, optarg) || !(f > 0.0) || !isfinite(f))
            return cli_usage(cmd, "--scale needs a positive finite number");
        r->a.opts.scale = f;
        break;
    case 'L':
    case 'R':
        if (cli_parse_int(&v, optarg, 0, INT64_MAX))
            return cli_usage(cmd,
                             "--window-left and --window-right need a non-negative integer");
        *(c == 'L' ? &r->a.opts.window_left : &r->a.opts.window_right) = v;
        break;
    case 'H':
    case 'r': {
        int64_t *b = c == 'H' ? &r->a.weights_head_begin : &r->a.weights_row_begin;
        int64_t *e = c == 'H' ? &r->a.weights_head_end : &r->a.weights_row_end;
        if (cli_parse_range(b, e, optarg))
            return cli_usage(cmd, "--weights-heads and --weights-rows need A:B "
                                  "(non-negative integers, B optional)");
        break;
    }
    case 's':
    case 'O':
        if (cli_parse_int(&v, optarg, 0, INT64_MAX))
            return cli_usage(cmd, "--seed and --dropout-offset need a non-negative integer");
        *(c == 's' ? &r->a.opts.dropout_seed : &r->a.opts.dropout_offset) = (uint64_t)v;
        break;
    default: return RUN_NOT_MINE;
    }
    return -1;
}

// Positions: RoPE and ALiBi.
static int opt_position(run *r, int c) {
    const char *cmd = r->cmd;
    mha_status st;
    int64_t v;
    double f;
    switch (c) {
    case 'P':
        if ((st = mha_rope_mode_from_name(&r->a.rope.mode, optarg)))
            return cli_bad_value(cmd, st);
        break;
    case 'T':
        if (cli_parse_f64(&f, optarg) || !(f > 0.0))
            return cli_usage(cmd, "--rope-theta needs a positive number");
        r->a.rope.theta = f;
        break;
    case 'E':
        if (cli_parse_int(&v, optarg, 1, INT64_MAX))
            return cli_usage(cmd, "--rope-dim needs a positive even integer");
        r->a.rope.dim = v;
        break;
    case 'X':
        if (cli_parse_int(&v, optarg, 0, INT64_MAX))
            return cli_usage(cmd, "--rope-start needs a non-negative integer");
        r->rope_start = v;
        break;
    case 'B': r->a.opts.alibi = true; break;
    case 0x100:
        if ((st = mha_rope_scaling_type_from_name(&r->rope_scaling.type, optarg)))
            return cli_bad_value(cmd, st);
        break;
    case 0x102:
        if (cli_parse_int(&v, optarg, 1, INT64_MAX))
            return cli_usage(cmd, "--rope-original-max needs a positive integer");
        r->rope_scaling.original_max_position = v;
        break;
    case 0x10a: r->rope_scaling.truncate = false; break;
    default: {
        if (c < 0x101 || c > 0x109) return RUN_NOT_MINE;
        // the numbers (checked by the library, which names the field)
        double *fields[] = {
            &r->rope_scaling.factor,          NULL,
            &r->rope_scaling.low_freq_factor, &r->rope_scaling.high_freq_factor,
            &r->rope_scaling.beta_fast,       &r->rope_scaling.beta_slow,
            &r->rope_scaling.mscale,          &r->rope_scaling.mscale_all_dim,
            &r->rope_scaling.attention_factor};
        static const char *msgs[] = {
            "--rope-factor needs a number",          NULL,
            "--rope-low-freq-factor needs a number", "--rope-high-freq-factor needs a number",
            "--rope-beta-fast needs a number",       "--rope-beta-slow needs a number",
            "--rope-mscale needs a number",          "--rope-mscale-all-dim needs a number",
            "--rope-attention-factor needs a number"};
        if (cli_parse_f64(&f, optarg)) return cli_usage(cmd, msgs[c - 0x101]);
        *fields[c - 0x101] = f;
        break;
    }
    }
    return -1;
}

// How the run goes: the tensors' dtype, through a KV cache (--incremental,
// --chunk, --kv-dtype), across MPI ranks (--parallel).
static int opt_how(run *r, int c) {
    const char *cmd = r->cmd;
    mha_status st;
    int64_t v;
    switch (c) {
    case 'M': r->incremental = true; break;
    case 'Y':
        if (cli_float_dtype(&r->dtype, optarg))
            return cli_usage(cmd, "--dtype needs f32, bf16 or f16");
        break;
    case 'Z':
#ifdef MHA_HAVE_MPI
        if ((st = mha_parallel_from_name(&r->par, optarg))) return cli_bad_value(cmd, st);
        r->parallel = true;
        break;
#else
        return cli_usage(cmd, "--parallel needs an mha built with MPI (install "
                              "libopenmpi-dev and rebuild)");
#endif
    case 'Q':
        if ((st = mha_kv_dtype_from_name(&r->kv_dtype, optarg))) return cli_bad_value(cmd, st);
        break;
    case 'K':
        if (cli_parse_int(&v, optarg, 1, INT64_MAX))
            return cli_usage(cmd, "--chunk needs a positive integer");
        r->chunk = v;
        break;
    default: return RUN_NOT_MINE;
    }
    return -1;
}

// mha inspect's own: --tokens, --max-rows, --batch-index, --plot-len.
static int opt_inspect(run *r, int c) {
    const char *cmd = r->cmd;
    switch (c) {
    case 'k': r->tokens_path = optarg; break;
    case 'm':
        if (cli_parse_int(&r->diag.max_rows, optarg, 0, INT64_MAX))
            return cli_usage(cmd, "--max-rows needs a non-negative integer (0: every row)");
        break;
    case 'N':
        if (cli_parse_int(&r->batch_index, optarg, 0, INT64_MAX))
            return cli_usage(cmd, "--batch-index needs a non-negative integer");
        break;
    case 'p':
        if (cli_parse_int(&r->plot_len, optarg, 1, INT64_MAX))
            return cli_usage(cmd, "--plot-len needs a positive integer");
        break;
    default: return RUN_NOT_MINE;
    }
    return -1;
}

// The checks across options once all are read. Returns -1 to go on, else
// the exit status.
static int run_check(run *r, bool backward, bool no_avg) {
    const char *cmd = r->cmd;
    if (r->ckpt && r->wpath)
        return cli_usage(cmd, "--checkpoint and --weights do not combine");
    if (r->ckpt && !r->xpath) return cli_usage(cmd, "--checkpoint needs --inputs and --out");
    if (r->ckpt) r->wpath = r->ckpt;  // (named in messages and reports)
    if (!r->wpath || !r->xpath || !r->ypath || (backward && !r->gpath))
        return cli_usage(cmd, backward ? "--weights, --inputs, --grad-output and "
                                         "--out are required"
                                       : "--weights, --inputs and --out are required");
    if (backward && r->incremental) return cli_usage(cmd, "--incremental is for mha forward");
    if (r->parallel && (r->incremental || r->a.need_weights))
        return cli_usage(cmd, "--parallel does not combine with --incremental or "
                              "--need-weights");
    if (no_avg && !r->a.need_weights)
        return cli_usage(cmd, "--no-average-weights needs --need-weights");
    r->a.average_attn_weights = !no_avg;
    return -1;
}

// Parses the options shared by forward and backward. Returns -1 to go on,
// else the exit status.
int run_parse(run *r, bool backward, int argc, char **argv) {
    // mha inspect's own options, and those of the forward it refuses (it
    // diagnoses in eval mode, computing its own weights)
    static const char inspect_only[] = "kmNp", not_inspect[] = "WAHrMKQitdDsOgZ";
    const bool inspect = !strcmp(r->cmd, "inspect");
    const char *cmd = r->cmd;
    mha_config_init(&r->base, 0, 0);
    mha_forward_args_init(&r->a);
    mha_rope_scaling_init(&r->rope_scaling, MHA_ROPE_SCALING_NONE);
    mha_diag_options_init(&r->diag);
    r->argc = argc;
    r->argv = argv;
    r->plot_len = 64;
    bool no_avg = false;
    int c, li = -1;
    opterr = 0;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", run_opts, &li)) != -1) {
        if (c != '?' && c != ':' && li >= 0 && c < 0x100 &&
            strchr(inspect ? not_inspect : inspect_only, c)) {
            char msg[96];
            snprintf(msg, sizeof msg,
                     inspect ? "--%s is not an option of mha inspect"
                             : "--%s is for mha inspect",
                     run_opts[li].name);
            return cli_usage(cmd, msg);
        }
        li = -1;
        if (c == 'h') {
            fputs(inspect ? inspect_help : backward ? backward_help : forward_help, stdout);
            if (!backward) fputs(checkpoint_help, stdout);
            return 0;
        }
        int rc = opt_files(r, backward, c);
        if (rc == RUN_NOT_MINE) rc = opt_module(r, c);
        if (rc == RUN_NOT_MINE) rc = opt_call(r, c, &no_avg);
        if (rc == RUN_NOT_MINE) rc = opt_position(r, c);
        if (rc == RUN_NOT_MINE) rc = opt_how(r, c);
        if (rc == RUN_NOT_MINE) rc = opt_inspect(r, c);
        if (rc == RUN_NOT_MINE) rc = cli_bad_option(cmd, argv, run_opts);
        if (rc != -1) return rc;
    }
    if (optind < argc) return cli_unexpected(cmd, argv[optind]);
    if (r->rope_scaling.type != MHA_ROPE_SCALING_NONE) r->a.rope_scaling = &r->rope_scaling;
    return run_check(r, backward, no_avg);
}

// The inputs' position_ids (integers >= 0; (N, L), (1, L) for every batch
// element, or (L) unbatched) as the (N, L) array r->a.rope_positions.
// Returns 0, or 1 after printing.
static int load_positions(run *r, const mha_st_tensor *t) {
    const mha_tensor *q = r->a.query;
    const int sd = q->ndim == 2 || !r->base.batch_first ? 0 : 1;
    const int64_t L = q->shape[sd], N = q->ndim == 3 ? q->shape[1 - sd] : 1;
    const bool ok = (t->ndim == 2 && (t->shape[0] == N || t->shape[0] == 1) &&
                     t->shape[1] == L) ||
                    (t->ndim == 1 && q->ndim == 2 && t->shape[0] == L);
    if (!ok) {
        fprintf(stderr, "mha %s: %s: position_ids must be (N, L) = (%lld, %lld) or (1, L)%s\n",
                r->cmd, r->xpath, (long long)N, (long long)L,
                q->ndim == 2 ? " or (L) for an unbatched query" : "");
        return 1;
    }
    double *p = malloc(sizeof(double) * (size_t)(t->numel + 1));
    r->rope_positions = malloc(sizeof(int64_t) * (size_t)(N * L + 1));
    if (!p || !r->rope_positions) {
        free(p);
        fprintf(stderr, "mha %s: out of memory\n", r->cmd);
        return 1;
    }
    mha_status st = mha_st_read(p, sizeof(double) * (size_t)t->numel, MHA_F64, t);
    if (st) {
        free(p);
        return cli_fail(r->cmd, st);
    }
    for (int64_t i = 0; i < N * L; i++) {
        const double v = p[t->numel == L ? i % L : i];
        if (!(v >= 0.0 && v < 9.0e15) || v != (double)(int64_t)v) {
            fprintf(stderr, "mha %s: %s: position_ids[%lld] = %g is not an integer >= 0\n",
                    r->cmd, r->xpath, (long long)i, v);
            free(p);
            return 1;
        }
        r->rope_positions[i] = (int64_t)v;
    }
    free(p);
    r->a.rope_positions = r->rope_positions;
    return 0;
}

// Returns 0 when every tensor of the inputs file r->xf is one of the n
// names, else 1 after printing the first other one: "unexpected tensor T
// (WHAT NAME, NAME, ...)".
static int only_inputs(run *r, const char *const *names, int n, const char *what) {
    for (int64_t i = 0; i < mha_st_num_tensors(r->xf); i++) {
        mha_st_tensor t;
        mha_status st = mha_st_tensor_at(&t, r->xf, i);
        if (st) return cli_fail(r->cmd, st);
        int j = 0;
        while (j < n && strcmp(t.name, names[j])) j++;
        if (j < n) continue;
        char qn[128], list[256] = "";
        for (j = 0; j < n; j++)
            snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", j ? ", " : "",
                     names[j]);
        fprintf(stderr, "mha %s: %s: unexpected tensor %s (%s %s)\n", r->cmd, r->xpath,
                mha_escape(qn, sizeof qn, t.name), what, list);
        return 1;
    }
    return 0;
}

// The inputs of a checkpoint's layer: hidden_states (N, L, E) as query,
// key and value; attention_mask (N, L) (nonzero = token) as the key
// padding mask; position_ids (N, L) as rope_positions. Returns 0, or 1
// after printing.
static int load_checkpoint_inputs(run *r) {
    const char *cmd = r->cmd, *xpath = r->xpath;
    static const char *names[3] = {"hidden_states", "position_ids", "attention_mask"};
    mha_status st;
    mha_st_tensor t[3];
    bool found[3];
    for (int i = 0; i < 3; i++) {
        st = mha_st_find(&t[i], r->xf, names[i]);
        found[i] = st == MHA_OK;
        if (st && st != MHA_ERR_NOT_FOUND) return cli_fail(cmd, st);
    }
    if (only_inputs(r, names, 3, "the inputs of a checkpoint layer are")) return 1;
    if (!found[0]) {
        fprintf(stderr, "mha %s: %s: no \"hidden_states\" tensor\n", cmd, xpath);
        return 1;
    }
    bool any;
    if (load_input(&r->in[0], &any, r->xf, cmd, xpath, names[0], 0, r->dtype)) return 1;
    const mha_tensor *q = &r->in[0].view;
    if (q->ndim != 3) {
        fprintf(stderr, "mha %s: %s: hidden_states has %d dims, expected (N, L, E)\n", cmd,
                xpath, q->ndim);
        return 1;
    }
    const int64_t N = q->shape[0], L = q->shape[1];
    for (int i = 1; i < 3; i++)
        if (found[i] && (t[i].ndim != 2 || t[i].shape[0] != N || t[i].shape[1] != L)) {
            char s1[64];
            snprintf(s1, sizeof s1, "(%lld, %lld)", (long long)N, (long long)L);
            fprintf(stderr, "mha %s: %s: %s must be (N, L) = %s like hidden_states\n", cmd,
                    xpath, names[i], s1);
            return 1;
        }
    r->a.query = r->a.key = r->a.value = q;
    if (found[2]) {  // attention_mask: 1 = token -> key_padding_mask: true = padding
        float *m = run_alloc(r, N * L);
        if (!m) return 1;
        if ((st = mha_st_read(m, sizeof(float) * (size_t)(N * L), MHA_F32, &t[2])))
            return cli_fail(cmd, st);
        unsigned char *kpm = (unsigned char *)m;  // byte i lies before float i
        for (int64_t i = 0; i < N * L; i++) kpm[i] = m[i] == 0.0f;
        r->in[3].view = mha_tensor_contiguous(kpm, MHA_BOOL, 2, (int64_t[]){N, L});
        r->a.key_padding_mask = &r->in[3].view;
    }
    if (found[1] && r->a.rope.mode != MHA_ROPE_NONE) {  // (only RoPE reads positions)
        if (t[1].dtype != MHA_I64 && t[1].dtype != MHA_I32) {
            fprintf(stderr, "mha %s: %s: position_ids has dtype %s (expected I64 or I32)\n",
                    cmd, xpath, mha_dtype_name(t[1].dtype));
            return 1;
        }
        if (load_positions(r, &t[1])) return 1;
    }
    return 0;
}

// Loads the module and the inputs into r->a. Returns 0, or 1 after printing.
int run_load(run *r) {
    // (the first five loaded here, position_ids by load_positions)
    static const char *names[6] = {"query",     "key",         "value", "key_padding_mask",
                                   "attn_mask", "position_ids"};
    const char *cmd = r->cmd, *xpath = r->xpath;
    mha_status st;
    if (r->ckpt) {
        r->base.batch_first = true;  // transformers' (N, L, E)
        if ((st = mha_module_load_checkpoint(&r->m, &r->ck, r->ckpt, r->layer, &r->base)) ||
            (st = mha_st_open(&r->xf, xpath)))
            return cli_fail(cmd, st);
        mha_checkpoint_layer_apply(&r->ck, &r->a);
        return load_checkpoint_inputs(r);
    }
    if ((st = mha_st_open(&r->wf, r->wpath)) ||
        (st = mha_module_load(&r->m, r->wf, &r->base)) || (st = mha_st_open(&r->xf, xpath)))
        return cli_fail(cmd, st);
    bool found[5];
    for (int i = 0; i < 5; i++)
        if (load_input(&r->in[i], &found[i], r->xf, cmd, xpath, names[i], i >= 3, r->dtype))
            return 1;
    if (only_inputs(r, names, 6, "inputs are")) return 1;
    if (!found[0]) {
        fprintf(stderr, "mha %s: %s: no \"query\" tensor\n", cmd, xpath);
        return 1;
    }
    if (found[1] != found[2]) {
        fprintf(stderr,
                "mha %s: %s: has \"%s\" but no \"%s\" (give both, or neither "
                "for self-attention)\n",
                cmd, xpath, found[1] ? "key" : "value", found[1] ? "value" : "key");
        return 1;
    }
    r->a.query = &r->in[0].view;
    r->a.key = found[1] ? &r->in[1].view : &r->in[0].view;
    r->a.value = found[2] ? &r->in[2].view : &r->in[0].view;
    r->a.key_padding_mask = found[3] ? &r->in[3].view : NULL;
    r->a.attn_mask = found[4] ? &r->in[4].view : NULL;
    if (r->rope_start) {  // the same start for every batch element
        const mha_tensor *q = r->a.query;
        const int64_t N = q->ndim == 3 ? q->shape[r->base.batch_first ? 0 : 1] : 1;
        r->rope_starts = malloc(sizeof(int64_t) * (size_t)N);
        if (!r->rope_starts) {
            fprintf(stderr, "mha %s: out of memory\n", cmd);
            return 1;
        }
        for (int64_t n = 0; n < N; n++) r->rope_starts[n] = r->rope_start;
        r->a.rope_start = r->rope_starts;
    }
    mha_st_tensor pt;
    if ((st = mha_st_find(&pt, r->xf, "position_ids")) == MHA_OK)
        return load_positions(r, &pt);
    if (st != MHA_ERR_NOT_FOUND) return cli_fail(cmd, st);
    return 0;
}

int64_t shape_numel(const mha_shape *s) {
    int64_t n = 1;
    for (int i = 0; i < s->ndim; i++) n *= s->dims[i];
    return n;
}
