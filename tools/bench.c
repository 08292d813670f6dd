// bench.c: `mha bench`: the help, the options (read and checked here) and
// the dispatch to the benchmark they ask for: the module or the attention
// core, forward (+ backward) (bench_module.c), a decode step
// (bench_decode.c), a serving workload (bench_serve.c) or, under mpirun,
// --parallel (bench_mpi.c). The reports: bench_report.c; what the timings
// are held against (the peak FLOPs, the read bandwidth): bench_peak.c.
//
// What it deliberately does not do: any comparison with PyTorch
// (bench/bench_torch.py and bench/compare.sh do that from the --json
// lines).
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "bench.h"
#include "cli.h"
#include "cmd.h"
#ifdef MHA_HAVE_MPI
#include "mha_mpi.h"
#endif

static const char *bench_help =
    "Usage: mha bench --batch B --seq L [--kv-seq S] --embed-dim E\n"
    "                 --num-heads H [options]\n"
    "Times nn.MultiheadAttention's forward (projections included;\n"
    "batch_first (B, L, E) inputs, self-attention unless --kv-seq differs\n"
    "from --seq, no need_weights) or, with --core, the attention core alone\n"
    "(mha_sdpa on contiguous (B, H, L, d) / (B, H, S, d) tensors, d = E/H).\n"
    "Prints the median time, GFLOP/s (dense count, stated), the fraction of\n"
    "this machine's fp32 FMA peak (measured here, on the same threads; with\n"
    "--dtype bf16 its bf16 dot peak instead, AMX tdpbf16ps or vdpbf16ps,\n"
    "where the CPU has one) and the process's max RSS.\n"
    "The peak and the read bandwidth are probes: short trials repeated until\n"
    "their best settles (within 1.5%, bounded), each thread's work on its own\n"
    "CPU time; the bandwidth the best of three read kernels (plain, software\n"
    "prefetch, non-temporal loads) over a buffer on huge pages. A fraction\n"
    "above 100% is printed capped with a \"probe disturbed\" warning (JSON:\n"
    "the *_fraction capped, *_fraction_raw, *_probe_disturbed).\n"
    "  --batch B          batch size (default 1)\n"
    "  --seq L            query length\n"
    "  --kv-seq S         key/value length (default L)\n"
    "  --embed-dim E      model dimension\n"
    "  --num-heads H      heads (must divide E)\n"
    "  --causal           hide keys j > i (FLOPs still counted dense)\n"
    "  --window W         sliding window: query i sees keys [i - W, i + W]\n"
    "                     ([i - W, i] with --causal); FLOPs still counted\n"
    "                     dense, the visible fraction is printed\n"
    "  --backward         time forward + backward (mha_backward: gradients\n"
    "                     of the inputs and of every parameter; with --core,\n"
    "                     mha_sdpa + mha_sdpa_backward: dq, dk, dv)\n"
    "  --core             the attention core alone (mha_sdpa)\n"
    "  --decode           one decode step instead: --seq (default 1) new\n"
    "                     queries per head against a KV cache of --kv-len N\n"
    "                     tokens (mha_kv_cache_attend; no projections), with\n"
    "                     --num-kv-heads K (default: --num-heads); prints the\n"
    "                     K and V bytes read per second against this machine's\n"
    "                     read bandwidth measured in the same process;\n"
    "                     --kv-dtype f32|bf16|f16|int8|int4 the cache's storage\n"
    "  --serve            a serving workload instead: --sequences N (default\n"
    "                     32) sequences sharing a prompt of --seq P tokens\n"
    "                     (default 2048), prefilled once and forked, then\n"
    "                     decoding together through a paged KV cache\n"
    "                     (mha_forward_paged, one call per step for every\n"
    "                     running sequence), each up to --gen G new tokens\n"
    "                     (default 256; stops uniform in [G/4, G]), blocks of\n"
    "                     --block-size tokens (default 16), --kv-dtype,\n"
    "                     --num-kv-heads; prints tokens/s, the step time\n"
    "                     against the bytes it reads over the read bandwidth,\n"
    "                     and the cache's memory against one contiguous cache\n"
    "                     per sequence\n"
    "  --block-size B     with --decode: a paged KV cache of B-token blocks\n"
    "                     (mha_paged_cache_attend) instead of a contiguous one\n"
    "  --pool-order O     with --block-size: scattered (default: a pool of\n"
    "                     twice the blocks, half of them held by other\n"
    "                     sequences at random, as a busy server's: the cache's\n"
    "                     blocks in short runs at random places) or sequential\n"
    "                     (a pool of the cache's blocks alone)\n"
    "  --pool-layout L    with --block-size (--decode, --serve): head-major\n"
    "                     (default: a KV head's blocks side by side) or\n"
    "                     block-major (a block's KV heads side by side, read\n"
    "                     heads together; mha_paged_layout)\n"
    "  --module           with --decode: the module's decode step instead\n"
    "                     (mha_forward_cached: the q, k, v projections, the\n"
    "                     append, attention over the cache, W_O), --seq new\n"
    "                     tokens per sequence, the cache cut back to --kv-len\n"
    "                     after each step (untimed); prints the bytes a step\n"
    "                     must read (the weights in their storage dtype + K\n"
    "                     and V) per token and against the read bandwidth;\n"
    "                     takes --weight-dtype, --head-gate, --prune-heads\n"
    "  --weight-dtype T   f32, bf16 or f16: the module's weight matrices\n"
    "                     stored in T (mha_config.weight_dtype); default:\n"
    "                     --dtype's for a module forward (+ backward),\n"
    "                     else f32\n"
    "  --dtype T          f32 (default), bf16 or f16: query/key/value and\n"
    "                     the output stored in T (module: and the\n"
    "                     gradients of output and inputs; --core: q, k, v,\n"
    "                     out and the gradients)\n"
    "  --prune-heads K    prune the last K heads (mha_module_prune_heads: their\n"
    "                     attention is skipped; module forward/backward)\n"
    "  --head-gate G      none (default), static or dynamic per-head gates\n"
    "  --parallel SCHEME  under mpirun: heads, heads-fast, ulysses or ring\n"
    "                     across the ranks (mha_mpi.h): the slowest rank's\n"
    "                     time, and per rank the time inside MPI (ring: and\n"
    "                     waiting for its messages), bytes sent against the\n"
    "                     scheme's model, score tiles (ring), the work\n"
    "                     imbalance. --parallel kv --decode: a decode step\n"
    "                     over a KV cache of --kv-len tokens sharded across\n"
    "                     the ranks (mha_mpi_forward_cached)\n"
    "  --no-save          with --backward: no saved forward state\n"
    "                     (mha_forward_args.save, mha_sdpa_args.save), so\n"
    "                     the backward re-runs the forward (default: the\n"
    "                     forward keeps it)\n"
    "  --threads T        OpenMP threads (default: OMP_NUM_THREADS or all)\n"
    "  --impl NAME        auto (default), reference or fused\n"
    "  --isa NAME         force the fused kernels' ISA: scalar, avx2, avx512\n"
    "                     (sets MHA_ISA; an ISA the CPU lacks is ignored)\n"
    "  --repeat N         timed runs (default 5)\n"
    "  --warmup N         untimed runs first (default 1)\n"
    "  --workspace        allocate the forward's scratch once\n"
    "                     (mha_forward_args.workspace) instead of per call\n"
    "  --seed N           seed of the random inputs and weights (default 0)\n"
    "  --json             one JSON object per line instead of the text block\n"
    "FLOP count (dense, kdim = vdim = E): module forward = 2BLE^2 (Q proj)\n"
    "+ 2BS(2E)E (K, V proj) + 2BLE^2 (out proj) + 4BLSE (QK^T and PV); core\n"
    "= 4BLSE. Causal runs are counted as dense. --backward counts the\n"
    "backward as 2x the forward (3x the forward in all).\n"
    "The implementation that ran (impl_ran, backward_impl) is found by a probe\n"
    "on a tiny problem: its output compared bit for bit with the reference's\n"
    "and the fused path's.\n";

#define BENCH_MAX_REPEAT 100000

static int bench_usage(const char *msg) { return cli_usage("bench", msg); }

// ---------------------------------------------------------------------------
// Options

// Every option its own value: two that shared one ('Y': --dtype and
// --pool-layout) both went to the first handler that takes it
// (tests/cli/test_cli_options.py runs every documented option).
static const struct option bench_long_opts[] = {{"batch", required_argument, 0, 'b'},
                                                {"seq", required_argument, 0, 'l'},
                                                {"kv-seq", required_argument, 0, 's'},
                                                {"embed-dim", required_argument, 0, 'e'},
                                                {"num-heads", required_argument, 0, 'n'},
                                                {"causal", no_argument, 0, 'c'},
                                                {"window", required_argument, 0, 'w'},
                                                {"backward", no_argument, 0, 'B'},
                                                {"core", no_argument, 0, 'C'},
                                                {"threads", required_argument, 0, 't'},
                                                {"no-save", no_argument, 0, 'N'},
                                                {"decode", no_argument, 0, 'D'},
                                                {"kv-len", required_argument, 0, 'K'},
                                                {"num-kv-heads", required_argument, 0, 'G'},
                                                {"kv-dtype", required_argument, 0, 'T'},
                                                {"weight-dtype", required_argument, 0, 'X'},
                                                {"dtype", required_argument, 0, 'Y'},
                                                {"prune-heads", required_argument, 0, 'P'},
                                                {"head-gate", required_argument, 0, 'g'},
                                                {"parallel", required_argument, 0, 'Z'},
                                                {"impl", required_argument, 0, 'i'},
                                                {"isa", required_argument, 0, 'I'},
                                                {"repeat", required_argument, 0, 'r'},
                                                {"json", no_argument, 0, 'j'},
                                                {"workspace", no_argument, 0, 'W'},
                                                {"seed", required_argument, 0, 'S'},
                                                {"warmup", required_argument, 0, 'u'},
                                                {"help", no_argument, 0, 'h'},
                                                {"module", no_argument, 0, 'M'},
                                                {"serve", no_argument, 0, 'V'},
                                                {"sequences", required_argument, 0, 'q'},
                                                {"gen", required_argument, 0, 'Q'},
                                                {"block-size", required_argument, 0, 'k'},
                                                {"pool-order", required_argument, 0, 'O'},
                                                {"pool-layout", required_argument, 0, 'L'},
                                                {0, 0, 0, 0}};

// One handler per group of options: each takes option c (its value in
// optarg) and returns -1 when it took it, the exit status when its value
// is bad, or BENCH_NOT_MINE when c is not of its group.
enum { BENCH_NOT_MINE = -2 };

// The problem's sizes and masking: --batch, --seq, --kv-seq, --embed-dim,
// --num-heads, --causal, --window, --kv-len, --num-kv-heads.
static int bench_opt_problem(bench_opts *o, int c) {
    const int64_t big = (int64_t)1 << 31;
    switch (c) {
    case 'b':
        if (cli_parse_int(&o->B, optarg, 1, big))
            return bench_usage("--batch needs a positive integer");
        break;
    case 'l':
        if (cli_parse_int(&o->L, optarg, 1, big))
            return bench_usage("--seq needs a positive integer");
        break;
    case 's':
        if (cli_parse_int(&o->S, optarg, 1, big))
            return bench_usage("--kv-seq needs a positive integer");
        break;
    case 'e':
        if (cli_parse_int(&o->E, optarg, 1, big))
            return bench_usage("--embed-dim needs a positive integer");
        break;
    case 'n':
        if (cli_parse_int(&o->H, optarg, 1, big))
            return bench_usage("--num-heads needs a positive integer");
        break;
    case 'c': o->causal = true; break;
    case 'w':
        if (cli_parse_int(&o->window, optarg, 1, big))
            return bench_usage("--window needs a positive integer");
        break;
    case 'K':
        if (cli_parse_int(&o->kv_len, optarg, 1, big))
            return bench_usage("--kv-len needs a positive integer");
        break;
    case 'G':
        if (cli_parse_int(&o->kv_heads, optarg, 1, big))
            return bench_usage("--num-kv-heads needs a positive integer");
        break;
    case 'q':
        if (cli_parse_int(&o->sequences, optarg, 1, 1 << 20))
            return bench_usage("--sequences needs a positive integer");
        break;
    case 'Q':
        if (cli_parse_int(&o->gen, optarg, 1, big))
            return bench_usage("--gen needs a positive integer");
        break;
    case 'k':
        if (cli_parse_int(&o->block, optarg, 1, 1 << 20))
            return bench_usage("--block-size needs a positive integer");
        break;
    case 'O':
        if (strcmp(optarg, "sequential") && strcmp(optarg, "scattered"))
            return bench_usage("--pool-order needs sequential or scattered");
        o->contiguous_pool = strcmp(optarg, "sequential") == 0;
        break;
    case 'L':
        if (mha_paged_layout_from_name(&o->layout, optarg))
            return bench_usage("--pool-layout needs head-major or block-major");
        break;
    default: return BENCH_NOT_MINE;
    }
    return -1;
}

// What is timed: --backward, --core, --no-save, --decode, --module,
// --kv-dtype, --weight-dtype, --dtype, --parallel, --prune-heads,
// --head-gate, --workspace.
static int bench_opt_what(bench_opts *o, int c) {
    const int64_t big = (int64_t)1 << 31;
    switch (c) {
    case 'B': o->backward = true; break;
    case 'C': o->core = true; break;
    case 'N': o->no_save = true; break;
    case 'D': o->decode = true; break;
    case 'M': o->module = true; break;
    case 'V': o->serve = true; break;
    case 'T':
        if (mha_kv_dtype_from_name(&o->kv_dtype, optarg))
            return bench_usage("--kv-dtype needs f32, bf16, f16, int8 or int4");
        break;
    case 'X':
    case 'Y': {
        if (c == 'X') o->wdtype_set = true;
        if (cli_float_dtype(c == 'X' ? &o->wdtype : &o->dtype, optarg))
            return bench_usage(c == 'X' ? "--weight-dtype needs f32, bf16 or f16"
                                        : "--dtype needs f32, bf16 or f16");
        break;
    }
    case 'Z': {
#ifdef MHA_HAVE_MPI
        // a scheme of mha_mpi.h or kv (--decode): checked now, a bad name
        // is a usage error
        mha_parallel par;
        if (strcmp(optarg, "kv") && mha_parallel_from_name(&par, optarg)) {
            char q[80];
            return cli_usagef("bench",
                              "unknown --parallel %s (available: heads, heads-fast, ulysses, "
                              "ring; kv with --decode)",
                              mha_escape(q, sizeof q, optarg));
        }
        o->parallel = optarg;
        break;
#else
        return bench_usage("--parallel needs an mha built with MPI (install libopenmpi-dev "
                           "and rebuild)");
#endif
    }
    case 'P':
        if (cli_parse_int(&o->prune, optarg, 0, big))
            return bench_usage("--prune-heads needs a non-negative integer");
        break;
    case 'g':
        if (mha_head_gate_from_name(&o->gate, optarg))
            return bench_usage("--head-gate needs none, static or dynamic");
        break;
    case 'W': o->workspace = true; break;
    default: return BENCH_NOT_MINE;
    }
    return -1;
}

// How it runs: --threads, --impl, --isa, --repeat, --warmup, --json,
// --seed.
static int bench_opt_how(bench_opts *o, int c) {
    int64_t v;
    switch (c) {
    case 't':
        if (cli_parse_int(&v, optarg, 1, 4096))
            return bench_usage("--threads needs an integer in [1, 4096]");
        o->threads = (int)v;
        break;
    case 'i':
        if (mha_impl_from_name(&o->impl, optarg)) {
            char q[80];
            fprintf(stderr,
                    "mha bench: unknown --impl %s (available: auto, reference, fused)\n",
                    mha_escape(q, sizeof q, optarg));
            return 2;
        }
        break;
    case 'I':
        if (strcmp(optarg, "scalar") && strcmp(optarg, "avx2") && strcmp(optarg, "avx512")) {
            char q[80];
            fprintf(stderr, "mha bench: unknown --isa %s (available: scalar, avx2, avx512)\n",
                    mha_escape(q, sizeof q, optarg));
            return 2;
        }
        o->isa = optarg;
        break;
    case 'r':
        if (cli_parse_int(&o->repeat, optarg, 1, BENCH_MAX_REPEAT))
            return bench_usage("--repeat needs an integer in [1, 100000]");
        break;
    case 'u':
        if (cli_parse_int(&o->warmup, optarg, 0, BENCH_MAX_REPEAT))
            return bench_usage("--warmup needs an integer in [0, 100000]");
        break;
    case 'j': o->json = true; break;
    case 'S':
        if (cli_parse_int(&v, optarg, 0, INT64_MAX))
            return bench_usage("--seed needs a non-negative integer");
        o->seed = (uint64_t)v;
        break;
    default: return BENCH_NOT_MINE;
    }
    return -1;
}

// The checks across options once all are read (and the defaults that
// follow from others). Returns -1 to go on, else the exit status.
static int bench_check(bench_opts *o) {
    if (o->module && !o->decode) return bench_usage("--module goes with --decode");
    if (!o->serve && (o->sequences || o->gen))
        return bench_usage("--sequences and --gen go with --serve");
    if (o->block && !o->serve && (!o->decode || o->module))
        return bench_usage("--block-size goes with --serve or --decode (not --module)");
    if (o->serve) {
        if (o->decode || o->core || o->backward || o->parallel || o->prune || o->gate)
            return bench_usage("--serve times its own workload (no --decode, --core, "
                               "--backward, --parallel, --prune-heads, --head-gate)");
        if (!o->E || !o->H) return bench_usage("--serve needs --embed-dim and --num-heads");
        if (!o->kv_heads) o->kv_heads = o->H;
        if (o->E % o->H || o->H % o->kv_heads)
            return bench_usage("--serve: --num-heads must divide --embed-dim and "
                               "--num-kv-heads must divide --num-heads");
        if (!o->L) o->L = 2048;
        if (!o->sequences) o->sequences = 32;
        if (!o->gen) o->gen = 256;
        if (!o->block) o->block = 16;
        if (o->gen < 2) return bench_usage("--serve: --gen must be at least 2");
        return -1;
    }
    if ((o->core || (o->decode && !o->module)) && (o->prune || o->gate))
        return bench_usage(
            "--prune-heads and --head-gate are for the module, not --core or --decode");
    if (o->decode) {
        if (!o->kv_len || !o->E || !o->H)
            return bench_usage("--decode needs --kv-len, --embed-dim and --num-heads");
        if (!o->kv_heads) o->kv_heads = o->H;
        if (o->E % o->H || o->H % o->kv_heads)
            return bench_usage("--decode: --num-heads must divide --embed-dim and "
                               "--num-kv-heads must divide --num-heads");
        if (!o->L) o->L = 1;
        if (o->prune > o->H) return bench_usage("--prune-heads is more than --num-heads");
        return -1;
    }
    if (!o->L || !o->E || !o->H)
        return bench_usage("--seq, --embed-dim and --num-heads are required");
    if (!o->S) o->S = o->L;
    if (o->E % o->H) {
        fprintf(stderr, "mha bench: --embed-dim %lld is not divisible by --num-heads %lld\n",
                (long long)o->E, (long long)o->H);
        return 2;
    }
    if (o->core && o->workspace)
        return bench_usage("--workspace is for the module, not --core");
    if (o->prune > o->H) {
        fprintf(stderr, "mha bench: --prune-heads %lld is more than --num-heads %lld\n",
                (long long)o->prune, (long long)o->H);
        return 2;
    }
    // Every tensor has at most max(L, S) * B * E floats; keep that within
    // what int64_t and size_t hold.
    int64_t n;
    if (__builtin_mul_overflow(o->B, o->L > o->S ? o->L : o->S, &n) ||
        __builtin_mul_overflow(n, o->E, &n) || n > ((int64_t)1 << 40)) {
        fprintf(stderr, "mha bench: batch x seq x embed_dim is too large\n");
        return 2;
    }
    return -1;
}

static int bench_parse(bench_opts *o, int argc, char **argv) {
    memset(o, 0, sizeof *o);
    o->B = 1;
    o->repeat = 5;
    o->warmup = 1;
    o->impl = MHA_IMPL_AUTO;
    int c;
    opterr = 0;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", bench_long_opts, NULL)) != -1) {
        if (c == 'h') {
            fputs(bench_help, stdout);
            return 0;
        }
        int rc = bench_opt_problem(o, c);
        if (rc == BENCH_NOT_MINE) rc = bench_opt_what(o, c);
        if (rc == BENCH_NOT_MINE) rc = bench_opt_how(o, c);
        if (rc == BENCH_NOT_MINE) rc = cli_bad_option("bench", argv, bench_long_opts);
        if (rc != -1) return rc;
    }
    if (optind < argc) return cli_unexpected("bench", argv[optind]);
    // the module in --dtype (as torch's module.to(dtype)): its weight
    // matrices follow --dtype unless given (forward and backward)
    if (!o->wdtype_set && !o->decode && !o->serve) o->wdtype = o->dtype;
    return bench_check(o);
}

int cmd_bench(int argc, char **argv) {
    bench_opts o;
    int rc = bench_parse(&o, argc, argv);
    if (rc >= 0) return rc;
    // Before any library call: the kernel table is chosen once per process.
    if (o.isa && setenv("MHA_ISA", o.isa, 1)) {
        fprintf(stderr, "mha bench: cannot set MHA_ISA\n");
        return 1;
    }
    if (o.parallel && o.module)
        return bench_usage("--module times one process (no --parallel)");
    if (o.parallel) {
        const bool kv = !strcmp(o.parallel, "kv");
        if (kv != o.decode)
            return bench_usage("--parallel kv goes with --decode (a decode step over a sharded "
                               "KV cache), and --decode with --parallel kv only");
        if (o.core || (!kv && o.S != o.L) || o.prune || o.gate || o.workspace)
            return bench_usage("--parallel times the module's self-attention (no --core, "
                               "--kv-seq, --prune-heads, --head-gate, --workspace)");
#ifdef _OPENMP
        if (o.threads) omp_set_num_threads(o.threads);
#endif
        return bench_parallel(o.parallel, o.B, o.L, o.E, o.H, o.kv_heads ? o.kv_heads : o.H,
                              o.causal, o.backward, o.repeat, o.warmup, o.seed, o.json,
                              kv ? o.kv_len : 0);
    }
    int threads = 1;
#ifdef _OPENMP
    if (o.threads) omp_set_num_threads(o.threads);
    threads = omp_get_max_threads();
#else
    if (o.threads > 1)
        fprintf(stderr, "mha bench: built without OpenMP: --threads %d ignored, 1 thread\n",
                o.threads);
#endif
    const char *isa = mha_isa();
    if (o.serve) {
        const bench_serve_opts so = {o.sequences, o.L,        o.gen,   o.E,
                                     o.H,         o.kv_heads, o.block, o.kv_dtype,
                                     o.layout,    o.seed,     o.json,  threads};
        return bench_serve(&so);
    }
    if (o.decode)
        return o.module ? bench_decode_module(&o, threads) : bench_decode(&o, threads);
    return bench_module(&o, threads, isa);
}
