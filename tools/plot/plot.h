// plot.h: PNG plots of training curves (tools/plot/plot.c, drawn with
// cairo), and the drawing helpers the inspect pictures share
// (tools/plot/inspect_plot.c).
#ifndef MHA_PLOT_H
#define MHA_PLOT_H

#include <stdbool.h>
#include <stddef.h>

// True when the CLI was built with cairo (MHA_HAVE_CAIRO).
bool plot_available(void);

// Reads each CSV (columns step, loss, train_acc, eval_acc, tokens_per_s,
// in any order, header first) and draws one PNG: the training loss (log
// scale) above, the accuracies (eval solid, train dashed) below, one colour
// per run with labels[i] in the legends. title may be NULL. Returns 0, or 1
// after printing "mha <cmd>: ..." on stderr.
int plot_runs(const char *cmd, const char *out_png, const char *title, int n,
              const char *const *csv_paths, const char *const *labels);

#ifdef MHA_HAVE_CAIRO
#include <cairo.h>

// Okabe & Ito's colour-blind-friendly palette.
extern const double plot_palette[8][3];
// Draws s with its ink box anchored at (x, y): ax 0 / 0.5 / 1 puts x at the
// left / centre / right, ay 0 puts the baseline at y, 1 the top (about).
// Every label of every picture is drawn here. Test hook: with the
// environment variable MHA_PLOT_LABELS=FILE, each call appends a line
// "W H x0 y0 x1 y1 TEXT" to FILE: the canvas' size and the text's ink box
// in its pixels (tests/cli/test_plot_labels.py checks it lies inside).
void plot_text(cairo_t *cr, double x, double y, const char *s, double ax,
               double ay);
// A "nice" tick step (1, 2 or 5 times a power of ten) for about n ticks.
double plot_nice_step(double range, int n);
// Releases cairo's and fontconfig's font caches once no cairo object is
// left, so leak checkers (ASan) see a clean exit.
void plot_release_fonts(void);

// Bytes in memory (p from malloc, n used of cap; all 0 to start, free(p)
// after), such as an encoded PNG.
typedef struct plot_membuf {
    unsigned char *p;
    size_t n, cap;
} plot_membuf;
// cairo's write function (cairo_surface_write_to_png_stream) appending to
// the plot_membuf given as closure.
cairo_status_t plot_membuf_write(void *closure, const unsigned char *data, unsigned int len);
#endif

#endif
