// train.h: the training loop of the tiny transformer (train_loop.c), run
// by `mha train` (train.c) and `mha demo heads` (heads.c).
#ifndef MHA_TRAIN_H
#define MHA_TRAIN_H

#include <stdbool.h>
#include <stdint.h>

#include "tiny.h"

typedef struct train_opts {
    tiny_task_kind task;
    int64_t pairs, heads, d_model, layers, d_ff, steps, batch, warmup;
    int64_t eval_every, eval_size, seed;
    mha_optim_kind optim;
    double lr, weight_decay, clip, dropout;
    bool lr_set, wd_set, cosine, causal, quiet;
    const char *csv;  // the learning curve (NULL: none)
    const char *cmd;  // for messages: "train" (default when NULL)
} train_opts;

// mha train's defaults: recall, 4 pairs, 8 heads, d_model 64, 2 layers,
// 3000 steps of batch 32, AdamW lr 3e-3 (warmup 100, cosine), clip 1.
void train_opts_default(train_opts *o);

// Trains (progress on stderr unless quiet, the summary line on stdout).
// With keep, the trained model is handed to the caller (*keep; destroy
// with tiny_destroy) and its final eval accuracy goes to *eval_acc (may be
// NULL). Returns 0, or 1 after printing.
int train_run(const train_opts *o, tiny_model **keep, double *eval_acc);

#endif
