// mha: the command-line tool. Uses the public API only (include/mha.h).
//
//   mha init     write freshly initialised parameters
//   mha forward  run the module on tensors from a safetensors file
//   mha backward its gradients for every input and parameter
//   mha inspect  per-head diagnostics (mha_diagnose) as DIR/diagnostics.json,
//                pictures and report.html (inspect_plot.c)
//   mha train    train a tiny transformer on a synthetic task (train.c)
//   mha demo     a guided walk through one small example, then BERT-base
//   mha info     version, implementations, threads
//
// Errors go to stderr as one line "mha <command>: <message>"; the exit
// status is 1 on failure and 2 on a usage error.
#include <errno.h>
#include <getopt.h>
#include <stdarg.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cli.h"
#include "cmd.h"
#include "run.h"
#ifdef MHA_HAVE_MPI
#include "mha_mpi.h"
#endif
#include "inspect_plot.h"

// ---------------------------------------------------------------------------
// mha info

static int cmd_info(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--help") == 0) {
        puts("Usage: mha info\nPrints the version, implementations and threads.");
        return 0;
    }
    printf("mha %s\n", mha_version());
    printf("implementations: reference (plain loops in double, the oracle), fused (tiled,\n"
           "  SIMD kernels: %s); auto -> fused (reference for a trace or float64)\n", mha_isa());
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
    if (!strcmp(cmd, "backward")) return cmd_backward(argc - 1, argv + 1);
    if (!strcmp(cmd, "inspect")) return cmd_inspect(argc - 1, argv + 1);
    if (!strcmp(cmd, "train")) return cmd_train(argc - 1, argv + 1);
    if (!strcmp(cmd, "demo")) return cmd_demo(argc - 1, argv + 1);
    if (!strcmp(cmd, "bench")) return cmd_bench(argc - 1, argv + 1);
    if (!strcmp(cmd, "info")) return cmd_info(argc - 1, argv + 1);
    fprintf(stderr, "mha: unknown command \"%s\" (see mha --help)\n", cmd);
    return 2;
}
