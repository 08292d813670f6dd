// plot.h: PNG plots of training curves (tools/plot.c, drawn with cairo).
#ifndef MHA_PLOT_H
#define MHA_PLOT_H

#include <stdbool.h>

// True when the CLI was built with cairo (MHA_HAVE_CAIRO).
bool plot_available(void);

// Reads each CSV (columns step, loss, train_acc, eval_acc, tokens_per_s,
// in any order, header first) and draws one PNG: the training loss (log
// scale) above, the accuracies (eval solid, train dashed) below, one colour
// per run with labels[i] in the legends. title may be NULL. Returns 0, or 1
// after printing "mha <cmd>: ..." on stderr.
int plot_runs(const char *cmd, const char *out_png, const char *title, int n,
              const char *const *csv_paths, const char *const *labels);

#endif
