// plot.c: PNG learning curves for `mha train --plot` and `mha train plot`,
// drawn with cairo (2D vector graphics; the PNG encoded by cairo in memory
// and written atomically by mha_file_write).
// Built only when CMake finds cairo (MHA_HAVE_CAIRO); otherwise plot_runs
// reports that plotting is not available. The core library never links
// cairo.
//
// Layout (1000 x 660): title; top panel the training loss per step on a
// log scale; bottom panel the accuracies (held-out eval solid, training
// dashed) with the 10% chance level; the legend in a column on the right,
// so it never covers a curve.
#include "plot.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef MHA_HAVE_CAIRO

bool plot_available(void) { return false; }

int plot_runs(const char *cmd, const char *out_png, const char *title, int n,
              const char *const *csv_paths, const char *const *labels) {
    (void)out_png, (void)title, (void)n, (void)csv_paths, (void)labels;
    fprintf(stderr, "mha %s: plotting needs cairo, and this mha was built without "
            "it (install libcairo2-dev and rebuild)\n", cmd);
    return 1;
}

#else

#include <cairo.h>
#include <fontconfig/fontconfig.h>

#include "mha.h"

cairo_status_t plot_membuf_write(void *closure, const unsigned char *data, unsigned int len) {
    plot_membuf *b = closure;
    if (b->n + len > b->cap) {
        size_t cap = b->cap ? b->cap : 65536;
        while (cap < b->n + len) cap *= 2;
        unsigned char *p = realloc(b->p, cap);
        if (!p) return CAIRO_STATUS_NO_MEMORY;
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, data, len);
    b->n += len;
    return CAIRO_STATUS_SUCCESS;
}

#define PLOT_PI 3.14159265358979323846

bool plot_available(void) { return true; }

void plot_release_fonts(void) {
    cairo_debug_reset_static_data();
    FcFini();
}

// One run's curve: n rows of (step, loss, train_acc, eval_acc).
typedef struct curve {
    int n;
    double *step, *loss, *tacc, *eacc;  // (n) each, one allocation at step
} curve;

// Splits a CSV line at commas in place; returns the number of fields.
static int split(char *line, char **f, int cap) {
    int k = 0;
    char *p = line;
    while (k < cap) {
        f[k++] = p;
        char *c = strchr(p, ',');
        if (!c) break;
        *c = '\0';
        p = c + 1;
    }
    for (int i = 0; i < k; i++) f[i][strcspn(f[i], "\r\n")] = '\0';
    return k;
}

// Reads a CSV written by `mha train --csv`. Returns 0, or 1 after printing.
static int read_curve(curve *cv, const char *cmd, const char *path) {
    memset(cv, 0, sizeof *cv);
    FILE *fp = fopen(path, "r");
    if (!fp) {
        fprintf(stderr, "mha %s: cannot open %s: %s\n", cmd, path, strerror(errno));
        return 1;
    }
    char line[1024];
    char *f[16];
    int col[4] = {-1, -1, -1, -1};
    static const char *want[4] = {"step", "loss", "train_acc", "eval_acc"};
    if (!fgets(line, sizeof line, fp)) {
        fprintf(stderr, "mha %s: %s is empty (expected a header step,loss,"
                "train_acc,eval_acc,...)\n", cmd, path);
        fclose(fp);
        return 1;
    }
    int nf = split(line, f, 16);
    for (int i = 0; i < nf; i++)
        for (int j = 0; j < 4; j++)
            if (!strcmp(f[i], want[j])) col[j] = i;
    for (int j = 0; j < 4; j++)
        if (col[j] < 0) {
            fprintf(stderr, "mha %s: %s: no column \"%s\" in the header (expected "
                    "step,loss,train_acc,eval_acc,...)\n", cmd, path, want[j]);
            fclose(fp);
            return 1;
        }
    int cap = 64;
    double *buf = malloc(sizeof(double) * 4 * (size_t)cap);
    int n = 0, lineno = 1;
    while (buf && fgets(line, sizeof line, fp)) {
        lineno++;
        if (line[0] == '\n' || line[0] == '\0') continue;
        if (n == cap) {
            double *nb = realloc(buf, sizeof(double) * 8 * (size_t)cap);
            if (!nb) break;
            buf = nb;
            cap *= 2;
        }
        nf = split(line, f, 16);
        for (int j = 0; j < 4; j++) {
            char *end;
            double v = col[j] < nf ? strtod(f[col[j]], &end) : NAN;
            if (col[j] >= nf || end == f[col[j]] || *end || !isfinite(v)) {
                fprintf(stderr, "mha %s: %s:%d: column \"%s\" is not a finite number\n",
                        cmd, path, lineno, want[j]);
                free(buf);
                fclose(fp);
                return 1;
            }
            buf[4 * n + j] = v;
        }
        n++;
    }
    fclose(fp);
    if (!buf) {
        fprintf(stderr, "mha %s: out of memory reading %s\n", cmd, path);
        return 1;
    }
    if (n == 0) {
        fprintf(stderr, "mha %s: %s has a header but no rows\n", cmd, path);
        free(buf);
        return 1;
    }
    // rows (n, 4) -> columns
    double *cols = malloc(sizeof(double) * 4 * (size_t)n);
    if (!cols) {
        free(buf);
        fprintf(stderr, "mha %s: out of memory reading %s\n", cmd, path);
        return 1;
    }
    for (int i = 0; i < n; i++)
        for (int j = 0; j < 4; j++) cols[j * n + i] = buf[4 * i + j];
    free(buf);
    cv->n = n;
    cv->step = cols;
    cv->loss = cols + n;
    cv->tacc = cols + 2 * n;
    cv->eacc = cols + 3 * n;
    return 0;
}

// Colour-blind-friendly palette (Okabe & Ito).
const double plot_palette[8][3] = {
    {0.00, 0.45, 0.70}, {0.84, 0.37, 0.00}, {0.00, 0.62, 0.45},
    {0.80, 0.47, 0.65}, {0.90, 0.62, 0.00}, {0.34, 0.71, 0.91},
    {0.35, 0.35, 0.35}, {0.60, 0.40, 0.20}};

typedef struct panel {
    double x0, y0, w, h;     // pixel rectangle of the plotting area
    double xmin, xmax;       // data range of x
    double ymin, ymax;       // data range of y (log10 when logy)
    bool logy;
} panel;

static double px(const panel *p, double x) {
    return p->x0 + (x - p->xmin) / (p->xmax - p->xmin) * p->w;
}

static double py(const panel *p, double y) {
    if (p->logy) y = log10(y > 1e-12 ? y : 1e-12);
    return p->y0 + p->h - (y - p->ymin) / (p->ymax - p->ymin) * p->h;
}

// The test hook of plot.h: appends the canvas size and the ink box of s,
// drawn at (x, y) (the current point of its cairo_show_text), in pixels.
static void record_label(cairo_t *cr, const cairo_text_extents_t *e, double x, double y,
                         const char *s) {
    static const char *path;
    static bool looked;
    if (!looked) {
        path = getenv("MHA_PLOT_LABELS");
        looked = true;
    }
    if (!path || !*path || e->width <= 0 || e->height <= 0) return;
    cairo_surface_t *sf = cairo_get_target(cr);
    if (cairo_surface_get_type(sf) != CAIRO_SURFACE_TYPE_IMAGE) return;
    // the box's corners through the current transformation (rotated text)
    double lo[2] = {INFINITY, INFINITY}, hi[2] = {-INFINITY, -INFINITY};
    for (int c = 0; c < 4; c++) {
        double u = x + e->x_bearing + (c & 1 ? e->width : 0);
        double v = y + e->y_bearing + (c & 2 ? e->height : 0);
        cairo_user_to_device(cr, &u, &v);
        lo[0] = fmin(lo[0], u), hi[0] = fmax(hi[0], u);
        lo[1] = fmin(lo[1], v), hi[1] = fmax(hi[1], v);
    }
    FILE *f = fopen(path, "a");
    if (!f) return;
    fprintf(f, "%d %d %.2f %.2f %.2f %.2f %s\n", cairo_image_surface_get_width(sf),
            cairo_image_surface_get_height(sf), lo[0], lo[1], hi[0], hi[1], s);
    fclose(f);
}

void plot_text(cairo_t *cr, double x, double y, const char *s, double ax, double ay) {
    cairo_text_extents_t e;
    cairo_text_extents(cr, s, &e);
    const double X = x - ax * e.width - e.x_bearing, Y = y + ay * e.height;
    record_label(cr, &e, X, Y, s);
    cairo_move_to(cr, X, Y);
    cairo_show_text(cr, s);
}

// A "nice" tick step (1, 2 or 5 times a power of ten) for about n ticks.
double plot_nice_step(double range, int n) {
    double raw = range / n, p = pow(10.0, floor(log10(raw))), r = raw / p;
    return (r < 1.5 ? 1 : r < 3.5 ? 2 : r < 7.5 ? 5 : 10) * p;
}

static void fmt_num(char *buf, size_t cap, double v) {
    snprintf(buf, cap, "%.10g", v);
}

// The nearest value of the 1, 2, 5, 10, 20, ... sequence at or above v
// (up) or at or below v (!up); v > 0.
static double nice125(double v, bool up) {
    double p = pow(10.0, floor(log10(v))), best = up ? 10 * p : p;
    static const double mult[4] = {1, 2, 5, 10};
    for (int j = 0; j < 4; j++) {
        double c = mult[j] * p;
        if (up && c >= v * (1 - 1e-9) && c < best) best = c;
        if (!up && c <= v * (1 + 1e-9) && c > best) best = c;
    }
    return best;
}

// Frame, grid, x ticks (steps) and the axis labels of a panel.
static void draw_frame(cairo_t *cr, const panel *p, const char *ylabel,
                       bool xlabels) {
    cairo_set_source_rgb(cr, 1, 1, 1);
    cairo_rectangle(cr, p->x0, p->y0, p->w, p->h);
    cairo_fill(cr);
    cairo_set_font_size(cr, 12);
    double xs = plot_nice_step(p->xmax - p->xmin, 8);
    for (double x = ceil(p->xmin / xs) * xs; x <= p->xmax + 1e-9; x += xs) {
        double X = px(p, x);
        cairo_set_source_rgb(cr, 0.88, 0.88, 0.88);
        cairo_set_line_width(cr, 1);
        cairo_move_to(cr, X, p->y0);
        cairo_line_to(cr, X, p->y0 + p->h);
        cairo_stroke(cr);
        cairo_set_source_rgb(cr, 0, 0, 0);
        cairo_move_to(cr, X, p->y0 + p->h);
        cairo_line_to(cr, X, p->y0 + p->h + 5);
        cairo_stroke(cr);
        if (xlabels) {
            char b[32];
            fmt_num(b, sizeof b, x);
            plot_text(cr, X, p->y0 + p->h + 9, b, 0.5, 1.0);
        }
    }
    cairo_set_source_rgb(cr, 0, 0, 0);
    cairo_set_font_size(cr, 13);
    if (xlabels) plot_text(cr, p->x0 + p->w / 2, p->y0 + p->h + 30, "step", 0.5, 1.0);
    cairo_save(cr);
    cairo_translate(cr, p->x0 - 58, p->y0 + p->h / 2);
    cairo_rotate(cr, -PLOT_PI / 2);
    plot_text(cr, 0, 0, ylabel, 0.5, 0.5);
    cairo_restore(cr);
}

static void draw_border(cairo_t *cr, const panel *p) {
    cairo_set_source_rgb(cr, 0, 0, 0);
    cairo_set_line_width(cr, 1.2);
    cairo_rectangle(cr, p->x0, p->y0, p->w, p->h);
    cairo_stroke(cr);
}

// A horizontal grid line with its tick label at y (data units).
static void y_tick(cairo_t *cr, const panel *p, double y, const char *label) {
    double Y = py(p, y);
    cairo_set_source_rgb(cr, 0.88, 0.88, 0.88);
    cairo_set_line_width(cr, 1);
    cairo_move_to(cr, p->x0, Y);
    cairo_line_to(cr, p->x0 + p->w, Y);
    cairo_stroke(cr);
    cairo_set_source_rgb(cr, 0, 0, 0);
    cairo_move_to(cr, p->x0 - 5, Y);
    cairo_line_to(cr, p->x0, Y);
    cairo_stroke(cr);
    cairo_set_font_size(cr, 12);
    plot_text(cr, p->x0 - 8, Y, label, 1.0, 0.5);
}

static void polyline(cairo_t *cr, const panel *p, const double *x,
                     const double *y, int n, double scale) {
    for (int i = 0; i < n; i++) {
        double X = px(p, x[i]), Y = py(p, y[i] * scale);
        if (i == 0) cairo_move_to(cr, X, Y);
        else cairo_line_to(cr, X, Y);
    }
    if (n == 1) {  // a single point: a small dot
        cairo_arc(cr, px(p, x[0]), py(p, y[0] * scale), 2.5, 0, 2 * PLOT_PI);
        cairo_fill(cr);
        return;
    }
    cairo_stroke(cr);
}

// A legend entry: a short line (solid, or with the dash pattern dash[2])
// and its label.
static void legend_line(cairo_t *cr, double x, double y, const double rgb[3],
                        const double *dash, const char *label) {
    cairo_set_source_rgb(cr, rgb[0], rgb[1], rgb[2]);
    cairo_set_line_width(cr, dash && dash[0] < 3 ? 1.5 : 2.5);
    cairo_set_dash(cr, dash, dash ? 2 : 0, 0);
    cairo_move_to(cr, x, y);
    cairo_line_to(cr, x + 28, y);
    cairo_stroke(cr);
    cairo_set_dash(cr, dash, 0, 0);
    cairo_set_source_rgb(cr, 0, 0, 0);
    cairo_set_font_size(cr, 12);
    plot_text(cr, x + 36, y, label, 0.0, 0.5);
}

// The dash patterns of the accuracy panel and its legend: the chance level
// dotted, the training accuracy dashed.
static const double chance_dot[2] = {2, 4}, train_dash[2] = {6, 4};

// The data ranges of the n curves: *xmax the last step, [*ylo, *yhi] the
// loss axis (log10).
static void curves_range(double *xmax_out, double *ylo_out, double *yhi_out, const curve *cv,
                         int n) {
    double xmax = 0, lmin = INFINITY, lmax = -INFINITY;
    for (int i = 0; i < n; i++)
        for (int k = 0; k < cv[i].n; k++) {
            xmax = fmax(xmax, cv[i].step[k]);
            if (cv[i].loss[k] > 0) {
                lmin = fmin(lmin, cv[i].loss[k]);
                lmax = fmax(lmax, cv[i].loss[k]);
            }
        }
    if (xmax <= 0) xmax = 1;
    if (!isfinite(lmin)) lmin = 0.1, lmax = 1;
    // y range (log10): the nearest 1-2-5 values below lmin and above lmax
    double ylo = log10(nice125(lmin, false)), yhi = log10(nice125(lmax, true));
    if (yhi - ylo < 0.3) yhi = ylo + 0.3;
    *xmax_out = xmax, *ylo_out = ylo, *yhi_out = yhi;
}

// The title: title, or "mha train:" and the labels.
static void draw_title(cairo_t *cr, const char *title, int n, const char *const *labels) {
    char tbuf[256];
    if (!title) {
        size_t k = (size_t)snprintf(tbuf, sizeof tbuf, "mha train:");
        for (int i = 0; i < n && k < sizeof tbuf; i++)
            k += (size_t)snprintf(tbuf + k, sizeof tbuf - k, "%s %s", i ? "," : "", labels[i]);
        title = tbuf;
    }
    cairo_set_source_rgb(cr, 0, 0, 0);
    cairo_select_font_face(cr, "DejaVu Sans", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_BOLD);
    cairo_set_font_size(cr, 17);
    plot_text(cr, 85 + 350, 16, title, 0.5, 1.0);
    cairo_select_font_face(cr, "DejaVu Sans", CAIRO_FONT_SLANT_NORMAL,
                           CAIRO_FONT_WEIGHT_NORMAL);
}

// The loss panel pl (log scale): decades, plus 2 and 5 when the range is
// short; a line per curve.
static void draw_loss_panel(cairo_t *cr, const panel *pl, const curve *cv, int n) {
    const double ylo = pl->ymin, yhi = pl->ymax;
    draw_frame(cr, pl, "training loss (log scale)", false);
    for (double e = floor(ylo); e <= yhi + 1e-9; e += 1) {
        static const double mult[3] = {1, 2, 5};
        for (int j = 0; j < 3; j++) {
            double v = mult[j] * pow(10.0, e);
            if (log10(v) > yhi + 1e-9 || log10(v) < ylo - 1e-9 ||
                (j && yhi - ylo > 3))
                continue;
            char b[32];
            snprintf(b, sizeof b, "%g", v);
            y_tick(cr, pl, v, b);
        }
    }
    cairo_save(cr);
    cairo_rectangle(cr, pl->x0, pl->y0, pl->w, pl->h);
    cairo_clip(cr);
    cairo_set_line_join(cr, CAIRO_LINE_JOIN_ROUND);
    for (int i = 0; i < n; i++) {
        const double *c = plot_palette[i % 8];
        cairo_set_source_rgb(cr, c[0], c[1], c[2]);
        cairo_set_line_width(cr, 2.0);
        polyline(cr, pl, cv[i].step, cv[i].loss, cv[i].n, 1.0);
    }
    cairo_restore(cr);
    draw_border(cr, pl);
}

// The accuracy panel pa, in percent: the chance level, per curve the
// training accuracy dashed and the held-out one solid.
static void draw_acc_panel(cairo_t *cr, const panel *pa, const curve *cv, int n) {
    draw_frame(cr, pa, "accuracy (%)", true);
    for (int v = 0; v <= 100; v += 20) {
        char b[16];
        snprintf(b, sizeof b, "%d", v);
        y_tick(cr, pa, v, b);
    }
    cairo_save(cr);
    cairo_rectangle(cr, pa->x0, pa->y0, pa->w, pa->h);
    cairo_clip(cr);
    cairo_set_source_rgb(cr, 0.4, 0.4, 0.4);
    cairo_set_line_width(cr, 1.2);
    cairo_set_dash(cr, chance_dot, 2, 0);
    cairo_move_to(cr, pa->x0, py(pa, 10));
    cairo_line_to(cr, pa->x0 + pa->w, py(pa, 10));
    cairo_stroke(cr);
    for (int i = 0; i < n; i++) {
        const double *c = plot_palette[i % 8];
        cairo_set_source_rgb(cr, c[0], c[1], c[2]);
        cairo_set_line_width(cr, 1.4);
        cairo_set_dash(cr, train_dash, 2, 0);
        polyline(cr, pa, cv[i].step, cv[i].tacc, cv[i].n, 100.0);
        cairo_set_dash(cr, train_dash, 0, 0);
        cairo_set_line_width(cr, 2.4);
        polyline(cr, pa, cv[i].step, cv[i].eacc, cv[i].n, 100.0);
    }
    cairo_restore(cr);
    draw_border(cr, pa);
}

// The legend column: the runs, then the accuracy panel's line styles.
static void draw_legend(cairo_t *cr, int n, const char *const *labels) {
    double lx = 805, ly = 60;
    cairo_set_source_rgb(cr, 0, 0, 0);
    cairo_select_font_face(cr, "DejaVu Sans", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_BOLD);
    cairo_set_font_size(cr, 13);
    plot_text(cr, lx, ly, "runs", 0.0, 0.5);
    cairo_select_font_face(cr, "DejaVu Sans", CAIRO_FONT_SLANT_NORMAL,
                           CAIRO_FONT_WEIGHT_NORMAL);
    ly += 24;
    for (int i = 0; i < n; i++, ly += 22) {
        char lb[40];
        snprintf(lb, sizeof lb, "%.22s%s", labels[i], strlen(labels[i]) > 22 ? "..." : "");
        legend_line(cr, lx, ly, plot_palette[i % 8], NULL, lb);
    }
    ly = 360;
    static const double grey[3] = {0.2, 0.2, 0.2};
    cairo_select_font_face(cr, "DejaVu Sans", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_BOLD);
    cairo_set_font_size(cr, 13);
    cairo_set_source_rgb(cr, 0, 0, 0);
    plot_text(cr, lx, ly, "accuracy", 0.0, 0.5);
    cairo_select_font_face(cr, "DejaVu Sans", CAIRO_FONT_SLANT_NORMAL,
                           CAIRO_FONT_WEIGHT_NORMAL);
    static const double grey2[3] = {0.4, 0.4, 0.4};
    legend_line(cr, lx, ly + 24, grey, NULL, "held-out eval");
    legend_line(cr, lx, ly + 46, grey, train_dash, "train (running)");
    legend_line(cr, lx, ly + 68, grey2, chance_dot, "chance (10%)");
    cairo_set_font_size(cr, 11);
    cairo_set_source_rgb(cr, 0.3, 0.3, 0.3);
    plot_text(cr, lx, ly + 94, "loss, train acc: mean over", 0.0, 0.5);
    plot_text(cr, lx, ly + 109, "the steps since the last point", 0.0, 0.5);
}

int plot_runs(const char *cmd, const char *out_png, const char *title, int n,
              const char *const *csv_paths, const char *const *labels) {
    if (n < 1 || n > 16) {
        fprintf(stderr, "mha %s: plot 1 to 16 runs (got %d)\n", cmd, n);
        return 1;
    }
    curve cv[16];
    memset(cv, 0, sizeof cv);
    int rc = 1;
    for (int i = 0; i < n; i++)
        if (read_curve(&cv[i], cmd, csv_paths[i])) goto done;
    double xmax, ylo, yhi;
    curves_range(&xmax, &ylo, &yhi, cv, n);

    const int W = 1000, H = 660;
    cairo_surface_t *sf = cairo_image_surface_create(CAIRO_FORMAT_RGB24, W, H);
    cairo_t *cr = cairo_create(sf);
    cairo_set_source_rgb(cr, 0.97, 0.97, 0.97);
    cairo_paint(cr);
    cairo_select_font_face(cr, "DejaVu Sans", CAIRO_FONT_SLANT_NORMAL,
                           CAIRO_FONT_WEIGHT_NORMAL);
    draw_title(cr, title, n, labels);
    panel pl = {85, 52, 700, 250, 0, xmax, ylo, yhi, true};
    panel pa = {85, 340, 700, 250, 0, xmax, 0, 100, false};
    draw_loss_panel(cr, &pl, cv, n);
    draw_acc_panel(cr, &pa, cv, n);
    draw_legend(cr, n, labels);

    cairo_destroy(cr);
    cairo_surface_flush(sf);
    // encoded in memory, then written as one file (mha_file_write: atomically)
    plot_membuf png = {0};
    cairo_status_t cs = cairo_surface_write_to_png_stream(sf, plot_membuf_write, &png);
    cairo_surface_destroy(sf);
    plot_release_fonts();
    if (cs != CAIRO_STATUS_SUCCESS) {
        fprintf(stderr, "mha %s: cannot encode %s: %s\n", cmd, out_png,
                cairo_status_to_string(cs));
        free(png.p);
        goto done;
    }
    mha_status st = mha_file_write(out_png, png.p, png.n);
    free(png.p);
    if (st) {
        fprintf(stderr, "mha %s: %s\n", cmd, mha_last_error());
        goto done;
    }
    rc = 0;
done:
    for (int i = 0; i < n; i++) free(cv[i].step);
    return rc;
}

#endif
