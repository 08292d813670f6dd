// mha: the command-line tool. Uses the public API only (include/mha.h).
// This file only dispatches: main looks the command up in its table and
// runs it (cmd.h); the help, `mha version` and `mha info` are here.
//
//   mha init     write freshly initialised parameters (cmd_init.c)
//   mha forward  run the module on tensors from a safetensors file
//   mha backward its gradients for every input and parameter (both
//                cmd_run.c, on the options and files of run.c)
//   mha inspect  per-head diagnostics (mha_diag_create) as DIR/diagnostics.json,
//                pictures and report.html (cmd_inspect.c, plot/)
//   mha train    train a tiny transformer on a synthetic task (train.c,
//                train_loop.c, tiny/)
//   mha demo     a guided walk through one small example, then BERT-base
//                (demo.c; mha demo heads: heads.c)
//   mha bench    time the module or the core, a decode step, a serving
//                workload (bench.c and its parts, bench.h)
//   mha embed    sentence embeddings of a BERT model directory
//                (all-MiniLM-L6-v2; cmd_embed.c, examples/embed/)
//   mha info     version, implementations, threads
//
// The calls go one way, down: mha.c -> the commands (cmd_*.c, train.c,
// demo.c, bench.c; demo.c -> heads.c -> cmd_inspect.c) -> what commands
// share (run.c, train_loop.c, bench_peak.c, bench_mpi.c) -> cli.c, tiny/
// (the mha_tiny library) and plot/ (the pictures, cairo). No file calls
// back up.
//
// Errors go to stderr as one line "mha <command>: <message>"; the exit
// status is 2 on a usage error (an unknown or incomplete option, named; a
// bad value; a missing or unexpected argument), 1 on a failure while
// running (cli.h), the same in every command.
#include <stdio.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cli.h"
#include "cmd.h"
#include "mha.h"

// ---------------------------------------------------------------------------
// mha info

static int cmd_info(int argc, char **argv) {
    static const char *isas[] = {"scalar", "avx2", "avx512", "avx512bf16", "amx"};
    if (argc > 1 && strcmp(argv[1], "--help") == 0) {
        puts("Usage: mha info [--isas]\nPrints the version, implementations, SIMD kernels and "
             "threads.\n  --isas   print only the SIMD kernels this build and CPU can run, "
             "one line\n           (the names MHA_ISA takes here)");
        return 0;
    }
    if (argc > 1 && strcmp(argv[1], "--isas") == 0) {
        const char *sep = "";
        for (int i = 0; i < (int)(sizeof isas / sizeof isas[0]); i++)
            if (mha_isa_supported(isas[i])) {
                printf("%s%s", sep, isas[i]);
                sep = " ";
            }
        putchar('\n');
        return 0;
    }
    if (argc > 1) {
        char q[96];
        return cli_usagef("info",
                          argv[1][0] == '-' ? "unknown option %s" : "unexpected argument %s",
                          mha_escape(q, sizeof q, argv[1]));
    }
    printf("mha %s\n", mha_version());
    printf("implementations: reference (plain loops in double, the oracle), fused (tiled,\n"
           "  SIMD kernels: %s); auto -> fused (reference for a trace or float64)\n",
           mha_isa());
    printf("SIMD kernels this build and CPU can run (MHA_ISA):");
    for (int i = 0; i < (int)(sizeof isas / sizeof isas[0]); i++)
        if (mha_isa_supported(isas[i])) printf(" %s", isas[i]);
    putchar('\n');
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
    "  backward  gradients of the forward for every input and parameter\n"
    "  inspect   per-head diagnostics into DIR: diagnostics.json, heatmaps,\n"
    "            head similarity, weight spectra (PNG) and report.html\n"
    "  train     train a tiny transformer on a synthetic task\n"
    "  bench     time the module or the attention core (GFLOP/s, peak)\n"
    "  embed     sentence embeddings of a BERT model (all-MiniLM-L6-v2)\n"
    "  info      version, implementations, threads\n"
    "  version   print the version\n";

// The commands main runs, argv[0] their name (cmd.h).
static const struct command {
    const char *name;
    int (*run)(int argc, char **argv);
} commands[] = {
    {"init", cmd_init},       {"forward", cmd_forward}, {"backward", cmd_backward},
    {"inspect", cmd_inspect}, {"train", cmd_train},     {"demo", cmd_demo},
    {"bench", cmd_bench},     {"info", cmd_info},       {"embed", cmd_embed},
};

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
        if (argc == 3 && !strcmp(argv[2], "--help")) {
            puts("Usage: mha version\nPrints the version.");
            return 0;
        }
        if (argc > 2) {
            char q[96];
            return cli_usagef("version", "unexpected argument %s",
                              mha_escape(q, sizeof q, argv[2]));
        }
        printf("mha %s\n", mha_version());
        return 0;
    }
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        if (!strcmp(cmd, commands[i].name)) return commands[i].run(argc - 1, argv + 1);
    fprintf(stderr, "mha: unknown command \"%s\" (see mha --help)\n", cmd);
    return 2;
}
