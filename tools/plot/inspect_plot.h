// inspect_plot.h: the pictures and the HTML report of `mha inspect`
// (tools/plot/inspect_plot.c). tools/cmd_inspect.c computes every number;
// this part only draws and writes them.
#ifndef MHA_INSPECT_PLOT_H
#define MHA_INSPECT_PLOT_H

#include <stdbool.h>
#include <stdint.h>

#include <cjson/cJSON.h>

// What `mha inspect` hands over.
typedef struct inspect_report {
    // DIR/diagnostics.json as written: "heads" (an object per head, scalar
    // fields and singular_q/k/v/o arrays), "similarity" (H x H), "nonfinite"
    // (string or null), "rows_examined". NaN numbers stay NaN in memory.
    const cJSON *diag;
    // Per-head attention weights of one batch element for the heatmaps:
    // attn (H, rows, cols), contiguous: query positions [0, rows) of L,
    // keys [0, cols) of S (S counts the keys add_bias_kv / add_zero_attn
    // append).
    const float *attn;
    int64_t H, rows, cols, L, S;
    int64_t batch, batch_size;  // the element shown, of N
    const char *const *qlabels;  // (rows) axis labels of the query positions
    const char *const *klabels;  // (cols) ... of the keys
    // The report's "inputs" table: ninfo (name, value) pairs, plain text.
    int ninfo;
    const char *const *info_name, *const *info_value;
    // The tokens file's labels (ntokens of them; 0: none given).
    int64_t ntokens;
    const char *const *tokens;
} inspect_report;

// True when this mha draws pictures (built with cairo and glib).
bool inspect_pictures_available(void);

// Writes DIR/heads.png, similarity.png, spectra.png and report.html, and
// prints a line per file on stdout. Without cairo, prints on stderr that the
// pictures need it and returns 0. Returns 0, or 1 after printing
// "mha <cmd>: ..." on stderr.
int inspect_write_pictures(const char *cmd, const char *dir, const inspect_report *r);

#endif
