// run.h: one `mha forward`, `mha backward` or `mha inspect` run: its
// options, its files and everything loaded from them (run.c parses and
// loads; cmd_run.c runs the forward and backward, cmd_inspect.c the
// diagnostics). Public API only.
#ifndef MHA_RUN_H
#define MHA_RUN_H

#include <stdbool.h>
#include <stdint.h>

#include "mha.h"
#ifdef MHA_HAVE_MPI
#include "mha_mpi.h"
#endif

// A tensor read from a file into float32 (or bool) memory we own.
typedef struct cli_tensor {
    mha_tensor view;
    void *buf;
} cli_tensor;

// One `mha forward` / `mha backward` run: options, files, and everything
// loaded from them. Freed by run_free.
typedef struct run {
    const char *cmd;
    const char *wpath, *xpath, *ypath, *gpath;
    mha_config base;
    mha_forward_args a;
    bool incremental;  // --incremental: through a KV cache
    bool parallel;     // --parallel: over MPI ranks (mha_mpi.h)
#ifdef MHA_HAVE_MPI
    mha_parallel par;
#endif
    mha_kv_dtype kv_dtype;  // --kv-dtype: the cache's storage
    mha_dtype dtype;        // --dtype: inputs and outputs in memory (F32, BF16, F16)
    int64_t chunk;          // --chunk: tokens per step (default 1)
    int64_t rope_start;     // --rope-start, for every batch element
    int64_t *rope_starts;   // ... as the per-element array the API takes
    // --checkpoint DIR --layer I: a Hugging Face checkpoint's layer (the
    // inputs then hold hidden_states, position_ids, attention_mask)
    const char *ckpt;
    int64_t layer;
    mha_checkpoint_layer ck;
    mha_rope_scaling rope_scaling;  // --rope-scaling and its parameters
    int64_t *rope_positions;        // the inputs' position_ids (N, L), or NULL
    mha_st_file *wf, *xf, *gf;
    mha_module *m;
    cli_tensor in[5];
    float *bufs[8];  // outputs we allocate
    int nbufs;
    mha_st_writer *wr;
    // mha inspect
    int argc;
    char **argv;
    mha_diag_options diag;  // --max-rows
    const char *tokens_path;
    char **tokens;  // (ntokens) the tokens file's lines
    int64_t ntokens;
    int64_t batch_index, plot_len;
} run;

// Frees everything r holds (not r itself).
void run_free(run *r);
// A zeroed float buffer of n elements owned by r (NULL after printing an
// error).
float *run_alloc(run *r, int64_t n);
// Parses the options of r->cmd ("forward", "backward" with backward true,
// or "inspect") into r. Returns -1 to go on, else the exit status.
int run_parse(run *r, bool backward, int argc, char **argv);
// Loads the module and the inputs into r->a. Returns 0, or 1 after printing.
int run_load(run *r);
// The element count of a shape.
int64_t shape_numel(const mha_shape *s);

#endif
