// inspect_plot.c: the pictures and the HTML report of `mha inspect`, drawn
// with cairo (PNGs by cairo's own writer, kept in memory so that the report
// can embed them; base64 by glib). Built only with cairo and glib
// (MHA_HAVE_CAIRO, MHA_HAVE_GLIB); otherwise inspect_write_pictures says that
// the pictures need them. Nothing here computes attention: every number
// comes from tools/cmd_inspect.c, as inspect_report (inspect_plot.h)
// describes. Each file is written whole by mha_file_write (atomically: an
// old file of the same name survives a failed write).
//
//   heads.png       a grid of per-head heatmaps (query rows x key columns),
//                   one viridis scale for every head with its colour bar,
//                   token labels (every k-th when crowded, so none overlap),
//                   each panel titled with its head, entropy_mean and DEAD
//   similarity.png  the H x H head-similarity matrix (scale 0 to 1), the
//                   values printed in the cells when they fit
//   spectra.png     singular values of the heads' W_Q, W_K, W_V slices and
//                   W_O columns, four panels on one log scale, a line per
//                   head; zeros (and values below the axis) marked x on the
//                   axis floor
//   report.html     one self-contained page: the pictures as data: URIs, the
//                   per-head numbers (every field of diagnostics.json), the
//                   similarity and singular values, the non-finite report,
//                   the inputs; all text HTML-escaped
#include "inspect_plot.h"

#include <stdio.h>

#if !(defined(MHA_HAVE_CAIRO) && defined(MHA_HAVE_GLIB))

bool inspect_pictures_available(void) { return false; }

int inspect_write_pictures(const char *cmd, const char *dir, const inspect_report *r) {
    (void)dir, (void)r;
    fprintf(stderr, "mha %s: the pictures and report.html need cairo and glib, and this "
            "mha was built without them (install libcairo2-dev and rebuild); "
            "diagnostics.json is written\n", cmd);
    return 0;
}

#else

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <glib.h>

#include "mha.h"
#include "plot.h"

#define INSPECT_PI 3.14159265358979323846

bool inspect_pictures_available(void) { return true; }

// ---------------------------------------------------------------------------
// Small pieces: PNG bytes in memory, fonts, labels, the colormap

typedef plot_membuf membuf;

static void font(cairo_t *cr, double size, bool bold) {
    cairo_select_font_face(cr, "DejaVu Sans", CAIRO_FONT_SLANT_NORMAL,
                           bold ? CAIRO_FONT_WEIGHT_BOLD : CAIRO_FONT_WEIGHT_NORMAL);
    cairo_set_font_size(cr, size);
}

static double text_width(cairo_t *cr, const char *s) {
    cairo_text_extents_t e;
    cairo_text_extents(cr, s, &e);
    return e.x_advance;
}

// A white w x h canvas (w, h at least 1) with the default font.
static cairo_t *canvas_create(double w, double h) {
    cairo_surface_t *sf = cairo_image_surface_create(CAIRO_FORMAT_RGB24, (int)ceil(fmax(w, 1)),
                                                     (int)ceil(fmax(h, 1)));
    cairo_t *cr = cairo_create(sf);
    cairo_surface_destroy(sf);  // cr holds its own reference
    cairo_set_source_rgb(cr, 1, 1, 1);
    cairo_paint(cr);
    font(cr, 12, false);
    return cr;
}

// Encodes the canvas as PNG into png and destroys it.
static cairo_status_t canvas_finish(cairo_t *cr, membuf *png) {
    cairo_status_t st = cairo_status(cr);
    cairo_surface_t *sf = cairo_get_target(cr);
    cairo_surface_flush(sf);
    if (st == CAIRO_STATUS_SUCCESS) st = cairo_surface_write_to_png_stream(sf, plot_membuf_write, png);
    cairo_destroy(cr);
    return st;
}

// s as valid UTF-8 (invalid bytes -> U+FFFD, control characters -> space),
// cut to at most max code points with "…" marking the cut; max <= 0: whole.
static void label_fit(char *out, size_t cap, const char *s, int max) {
    char *v = g_utf8_make_valid(s ? s : "", -1);
    size_t k = 0;
    int n = 0;
    const char *p = v;
    for (; *p && (max <= 0 || n < max); n++) {
        const char *next = g_utf8_next_char(p);
        size_t len = (size_t)(next - p);
        if (k + len + 4 > cap) break;  // room for "…" and the NUL
        if ((unsigned char)*p < 0x20 || *p == 0x7f) out[k++] = ' ';
        else memcpy(out + k, p, len), k += len;
        p = next;
    }
    if (*p && k + 4 <= cap) memcpy(out + k, "\xe2\x80\xa6", 3), k += 3;
    out[k] = '\0';
    g_free(v);
}

// viridis (matplotlib), 11 anchors at t = 0, 0.1, ..., 1, interpolated in
// sRGB: perceptually uniform enough for a colour bar to be read.
static const double viridis[11][3] = {
    {0.267004, 0.004874, 0.329415}, {0.282623, 0.140926, 0.457517},
    {0.253935, 0.265254, 0.529983}, {0.206756, 0.371758, 0.553117},
    {0.163625, 0.471133, 0.558148}, {0.127568, 0.566949, 0.550556},
    {0.134692, 0.658636, 0.517649}, {0.266941, 0.748751, 0.440573},
    {0.477504, 0.821444, 0.318195}, {0.741388, 0.873449, 0.149561},
    {0.993248, 0.906157, 0.143936}};

// Colour of t in [0, 1] (clamped); NaN: light grey.
static void colormap(double t, double rgb[3]) {
    if (isnan(t)) {
        rgb[0] = rgb[1] = rgb[2] = 0.8;
        return;
    }
    double x = fmin(fmax(t, 0.0), 1.0) * 10;
    int i = x >= 10 ? 9 : (int)x;
    double f = x - i;
    for (int c = 0; c < 3; c++) rgb[c] = viridis[i][c] + f * (viridis[i + 1][c] - viridis[i][c]);
}

// Black or white text, whichever reads on rgb.
static void ink_on(cairo_t *cr, const double rgb[3]) {
    double lum = 0.2126 * rgb[0] + 0.7152 * rgb[1] + 0.0722 * rgb[2];
    if (lum > 0.45) cairo_set_source_rgb(cr, 0, 0, 0);
    else cairo_set_source_rgb(cr, 1, 1, 1);
}

// Label spacing: every k-th of items `cell` pixels apart so that text
// `need` pixels tall never overlaps.
static int64_t label_every(double cell, double need) {
    int64_t k = (int64_t)ceil(need / cell);
    return k < 1 ? 1 : k;
}

// Draws v (rows x cols, row stride cols) through the colormap at v / vmax
// into the rectangle (x0, y0, w, h): a cols x rows image scaled by cairo
// (nearest pixel when enlarged, filtered when reduced).
static void draw_values(cairo_t *cr, const float *v, int64_t rows, int64_t cols, double vmax,
                        double x0, double y0, double w, double h) {
    if (rows < 1 || cols < 1) return;
    cairo_surface_t *img = cairo_image_surface_create(CAIRO_FORMAT_RGB24, (int)cols, (int)rows);
    unsigned char *px = cairo_image_surface_get_data(img);
    if (!px) {
        cairo_surface_destroy(img);
        return;
    }
    cairo_surface_flush(img);
    const int stride = cairo_image_surface_get_stride(img);
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++) {
            double rgb[3];
            colormap(v[i * cols + j] / vmax, rgb);
            uint32_t p = (uint32_t)lround(rgb[0] * 255) << 16 |
                         (uint32_t)lround(rgb[1] * 255) << 8 | (uint32_t)lround(rgb[2] * 255);
            memcpy(px + i * stride + 4 * j, &p, 4);
        }
    cairo_surface_mark_dirty(img);
    cairo_save(cr);
    cairo_rectangle(cr, x0, y0, w, h);
    cairo_clip(cr);
    cairo_translate(cr, x0, y0);
    cairo_scale(cr, w / (double)cols, h / (double)rows);
    cairo_set_source_surface(cr, img, 0, 0);
    cairo_pattern_t *pat = cairo_get_source(cr);
    cairo_pattern_set_filter(pat, w >= (double)cols && h >= (double)rows ? CAIRO_FILTER_NEAREST
                                                                         : CAIRO_FILTER_GOOD);
    cairo_pattern_set_extend(pat, CAIRO_EXTEND_PAD);
    cairo_paint(cr);
    cairo_restore(cr);
    cairo_surface_destroy(img);
}

static void stroke_rect(cairo_t *cr, double x, double y, double w, double h, double grey) {
    cairo_set_source_rgb(cr, grey, grey, grey);
    cairo_set_line_width(cr, 1);
    cairo_rectangle(cr, x, y, w, h);
    cairo_stroke(cr);
}

static void line(cairo_t *cr, double x0, double y0, double x1, double y1) {
    cairo_move_to(cr, x0, y0);
    cairo_line_to(cr, x1, y1);
    cairo_stroke(cr);
}

// Text rotated a quarter turn counter-clockwise (read bottom to top),
// anchored as plot_text anchors it in its own frame.
static void text_up(cairo_t *cr, double x, double y, const char *s, double ax, double ay) {
    cairo_save(cr);
    cairo_translate(cr, x, y);
    cairo_rotate(cr, -INSPECT_PI / 2);
    plot_text(cr, 0, 0, s, ax, ay);
    cairo_restore(cr);
}

// A vertical colour bar w x h at (x, y) for values [vmin, vmax] with tick
// labels on its right and the caption, rotated, beyond them.
static void colour_bar(cairo_t *cr, double x, double y, double w, double h, double vmin,
                       double vmax, const char *caption) {
    const int n = (int)h;
    for (int k = 0; k < n; k++) {
        double rgb[3];
        colormap((k + 0.5) / n, rgb);
        cairo_set_source_rgb(cr, rgb[0], rgb[1], rgb[2]);
        cairo_rectangle(cr, x, y + h - k - 1.5, w, 1.5);
        cairo_fill(cr);
    }
    stroke_rect(cr, x, y, w, h, 0.2);
    font(cr, 11, false);
    const double step = plot_nice_step(vmax - vmin, 5);
    double lw = 0;
    for (int64_t i = (int64_t)ceil(vmin / step - 1e-9); i * step <= vmax * (1 + 1e-9); i++) {
        double v = i * step, Y = y + h - (v - vmin) / (vmax - vmin) * h;
        char b[32];
        snprintf(b, sizeof b, "%g", v);
        cairo_set_source_rgb(cr, 0, 0, 0);
        line(cr, x + w, Y, x + w + 4, Y);
        plot_text(cr, x + w + 7, Y, b, 0.0, 0.5);
        lw = fmax(lw, text_width(cr, b));
    }
    font(cr, 12, false);
    text_up(cr, x + w + 7 + lw + 10, y + h / 2, caption, 0.5, 1.0);
}

static const cJSON *jget(const cJSON *o, const char *key) {
    return cJSON_GetObjectItemCaseSensitive(o, key);
}

static double jnum(const cJSON *o, const char *key) {
    const cJSON *v = jget(o, key);
    return cJSON_IsNumber(v) ? v->valuedouble : NAN;
}

// ---------------------------------------------------------------------------
// heads.png

static cairo_status_t heads_png(membuf *png, const inspect_report *r) {
    const int64_t H = r->H, R = r->rows, C = r->cols, n = R > C ? R : C;
    const cJSON *heads = jget(r->diag, "heads");
    // each heatmap fits a square of `side` pixels; whole pixels per cell
    // when they are at least 2
    const double side = H <= 4 ? 380 : H <= 16 ? 320 : 260;
    double cell = fmin(side / (double)(n > 0 ? n : 1), 36);
    if (cell >= 2) cell = floor(cell);
    const double pw = (double)C * cell, ph = (double)R * cell, fs = 10;
    const int64_t k = label_every(cell, 1.3 * fs);
    const int maxch = 14;  // label characters

    // measure the labels and titles
    cairo_t *cr = canvas_create(1, 1);
    char lab[128], title[128];
    double lwy = 0, lwx = 0, tw = 0;
    font(cr, fs, false);
    for (int64_t i = 0; i < R; i += k) {
        label_fit(lab, sizeof lab, r->qlabels[i], maxch);
        lwy = fmax(lwy, text_width(cr, lab));
    }
    for (int64_t j = 0; j < C; j += k) {
        label_fit(lab, sizeof lab, r->klabels[j], maxch);
        lwx = fmax(lwx, text_width(cr, lab));
    }
    font(cr, 12, true);
    const double dead_w = text_width(cr, "  PRUNED");
    for (int64_t h = 0; h < H; h++) {
        snprintf(title, sizeof title, "head %lld: entropy %.2f nats", (long long)h,
                 jnum(cJSON_GetArrayItem(heads, (int)h), "entropy_mean"));
        tw = fmax(tw, text_width(cr, title) + dead_w);
    }
    char t1[256], t2[256], t3[256];
    snprintf(t1, sizeof t1, "Attention weights per head: batch element %lld of %lld",
             (long long)r->batch, (long long)r->batch_size);
    if (R < r->L || C < r->S)
        snprintf(t2, sizeof t2, "rows: query positions 0\xe2\x80\x93%lld of %lld;  columns: "
                 "key positions 0\xe2\x80\x93%lld of %lld", (long long)R - 1, (long long)r->L,
                 (long long)C - 1, (long long)r->S);
    else
        snprintf(t2, sizeof t2, "rows: all %lld query positions;  columns: all %lld keys",
                 (long long)r->L, (long long)r->S);
    // one colour scale: 0 to the largest weight shown, rounded up to a tick
    double wmax = 0;
    for (int64_t i = 0; i < H * R * C; i++)
        if (isfinite(r->attn[i]) && r->attn[i] > wmax) wmax = r->attn[i];
    double vmax = 1;
    if (wmax > 0) {
        const double step = plot_nice_step(wmax, 5);
        vmax = fmin(ceil(wmax / step - 1e-6) * step, 1);
    }
    snprintf(t3, sizeof t3, "colour: attention weight on one scale for every head, 0 to %g "
             "(largest shown: %.3g); entropy: mean over the rows examined", vmax, wmax);
    font(cr, 17, true);
    double title_w = text_width(cr, t1);
    font(cr, 12, false);
    title_w = fmax(title_w, fmax(text_width(cr, t2), text_width(cr, t3)));
    cairo_destroy(cr);

    // layout: a grid of panel cells, the colour bar on the right
    const int64_t ncol = H <= 3 ? H : (int64_t)ceil(sqrt((double)H));
    const int64_t nrow = (H + ncol - 1) / ncol;
    const double lm = 22 + lwy + 8;             // caption, labels, ticks
    const double pcw = lm + fmax(pw, tw) + 30;  // a panel cell
    const double pch = 26 + ph + 8 + lwx + 26 + 14;
    const double top = 92, left = 20;
    const double bar_h = fmin(fmax(nrow * pch - 80, 260), 440);
    const double W = fmax(left + ncol * pcw + 120, title_w + 40);
    const double Hh = fmax(top + nrow * pch, top + 30 + bar_h + 20) + 8;
    cr = canvas_create(W, Hh);
    cairo_set_source_rgb(cr, 0, 0, 0);
    font(cr, 17, true);
    plot_text(cr, left, 30, t1, 0, 0);
    font(cr, 12, false);
    plot_text(cr, left, 54, t2, 0, 0);
    plot_text(cr, left, 74, t3, 0, 0);

    for (int64_t h = 0; h < H; h++) {
        const int64_t col = h % ncol, row = h / ncol;
        const double x0 = left + col * pcw + lm, y0 = top + row * pch + 26;
        const cJSON *hd = cJSON_GetArrayItem(heads, (int)h);
        snprintf(title, sizeof title, "head %lld: entropy %.2f nats", (long long)h,
                 jnum(hd, "entropy_mean"));
        cairo_set_source_rgb(cr, 0, 0, 0);
        font(cr, 12, true);
        plot_text(cr, x0, y0 - 8, title, 0, 0);
        // a pruned head (its weights are zero: the forward skips it), else
        // a dead one
        const bool pruned = cJSON_IsTrue(jget(hd, "pruned"));
        if (pruned || cJSON_IsTrue(jget(hd, "dead"))) {
            cairo_set_source_rgb(cr, 0.8, 0.1, 0.1);
            plot_text(cr, x0 + text_width(cr, title) + text_width(cr, "  "), y0 - 8,
                      pruned ? "PRUNED" : "DEAD", 0, 0);
        }
        draw_values(cr, r->attn + h * R * C, R, C, vmax, x0, y0, pw, ph);
        stroke_rect(cr, x0, y0, pw, ph, 0.3);
        cairo_set_source_rgb(cr, 0, 0, 0);
        font(cr, fs, false);
        for (int64_t i = 0; i < R; i += k) {
            double yc = y0 + (i + 0.5) * cell;
            label_fit(lab, sizeof lab, r->qlabels[i], maxch);
            line(cr, x0 - 3, yc, x0, yc);
            plot_text(cr, x0 - 5, yc, lab, 1.0, 0.5);
        }
        for (int64_t j = 0; j < C; j += k) {
            double xc = x0 + (j + 0.5) * cell;
            label_fit(lab, sizeof lab, r->klabels[j], maxch);
            line(cr, xc, y0 + ph, xc, y0 + ph + 3);
            text_up(cr, xc, y0 + ph + 5, lab, 1.0, 0.5);
        }
        font(cr, 11, false);
        cairo_set_source_rgb(cr, 0.3, 0.3, 0.3);
        if (col == 0) text_up(cr, x0 - lm + 4, y0 + ph / 2, "query position", 0.5, 1.0);
        if (h + ncol >= H) plot_text(cr, x0 + pw / 2, y0 + ph + 8 + lwx + 6, "key position", 0.5, 1.0);
    }
    colour_bar(cr, left + ncol * pcw + 4, top + 30, 16, bar_h, 0, vmax,
               "attention weight (all heads)");
    return canvas_finish(cr, png);
}

// ---------------------------------------------------------------------------
// similarity.png

static cairo_status_t similarity_png(membuf *png, const inspect_report *r) {
    const int64_t H = r->H;
    const cJSON *sim = jget(r->diag, "similarity");
    const double cell = floor(fmin(fmax(560.0 / (double)(H > 0 ? H : 1), 12), 64));
    const bool values = cell >= 34;
    char lab[32], t1[160], t2[200];
    snprintf(t1, sizeof t1, "Head similarity: 1 \xe2\x88\x92 JS divergence / ln 2");
    snprintf(t2, sizeof t2, "of the heads' attention rows, averaged over the %.0f rows "
             "examined; 1 = identical attention, 0 = disjoint",
             jnum(r->diag, "rows_examined"));
    cairo_t *cr = canvas_create(1, 1);
    font(cr, 11, false);
    snprintf(lab, sizeof lab, "%lld", (long long)(H - 1));
    const double lw = text_width(cr, lab);
    font(cr, 17, true);
    double title_w = text_width(cr, t1);
    font(cr, 12, false);
    title_w = fmax(title_w, text_width(cr, t2));
    cairo_destroy(cr);
    const int64_t kl = label_every(cell, fmax(14, lw + 8));
    const double left = 50 + lw + 10, top = 100, g = (double)H * cell;
    const double bar_h = fmax(g, 240);
    const double W = fmax(left + g + 130, title_w + 40), Hh = top + fmax(g, bar_h) + 70;
    cr = canvas_create(W, Hh);
    cairo_set_source_rgb(cr, 0, 0, 0);
    font(cr, 17, true);
    plot_text(cr, 20, 30, t1, 0, 0);
    font(cr, 12, false);
    plot_text(cr, 20, 54, t2, 0, 0);
    font(cr, values ? fmin(13, cell * 0.3) : 10, false);
    for (int64_t i = 0; i < H; i++)
        for (int64_t j = 0; j < H; j++) {
            const cJSON *v = cJSON_GetArrayItem(cJSON_GetArrayItem(sim, (int)i), (int)j);
            double s = cJSON_IsNumber(v) ? v->valuedouble : NAN, rgb[3];
            colormap(s, rgb);
            cairo_set_source_rgb(cr, rgb[0], rgb[1], rgb[2]);
            cairo_rectangle(cr, left + j * cell, top + i * cell, cell, cell);
            cairo_fill(cr);
            if (!values) continue;
            char b[16];
            if (isnan(s)) snprintf(b, sizeof b, "n/a");
            else snprintf(b, sizeof b, "%.2f", s);
            ink_on(cr, rgb);
            plot_text(cr, left + (j + 0.5) * cell, top + (i + 0.5) * cell, b, 0.5, 0.5);
        }
    stroke_rect(cr, left, top, g, g, 0.3);
    cairo_set_source_rgb(cr, 0, 0, 0);
    font(cr, 11, false);
    for (int64_t i = 0; i < H; i += kl) {
        snprintf(lab, sizeof lab, "%lld", (long long)i);
        plot_text(cr, left - 6, top + (i + 0.5) * cell, lab, 1.0, 0.5);
        plot_text(cr, left + (i + 0.5) * cell, top + g + 6, lab, 0.5, 1.0);
    }
    font(cr, 12, false);
    cairo_set_source_rgb(cr, 0.3, 0.3, 0.3);
    text_up(cr, left - 14 - lw, top + g / 2, "head", 0.5, 0.0);
    plot_text(cr, left + g / 2, top + g + 26, "head", 0.5, 1.0);
    colour_bar(cr, left + g + 24, top, 16, bar_h, 0, 1, "similarity (1 = identical)");
    return canvas_finish(cr, png);
}

// ---------------------------------------------------------------------------
// spectra.png

static const char *const spec_key[4] = {"singular_q", "singular_k", "singular_v", "singular_o"};
static const char *const spec_title[4] = {
    "W_Q: the head's rows (d \xc3\x97 E)", "W_K: its KV head's rows (d \xc3\x97 kdim)",
    "W_V: its KV head's rows (d \xc3\x97 vdim)", "W_O: the head's columns (E \xc3\x97 d)"};

// The line style of head h: a palette colour, dashes after the 8th head.
static void head_style(cairo_t *cr, int64_t h) {
    static const double dashes[4][4] = {{0}, {7, 3}, {2, 3}, {8, 3, 2, 3}};
    static const int ndash[4] = {0, 2, 2, 4};
    const double *c = plot_palette[h % 8];
    const int s = (int)(h / 8 % 4);
    cairo_set_source_rgb(cr, c[0], c[1], c[2]);
    cairo_set_line_width(cr, 1.8);
    cairo_set_dash(cr, dashes[s], ndash[s], 0);
}

static void x_marker(cairo_t *cr, double x, double y) {
    cairo_set_dash(cr, NULL, 0, 0);
    line(cr, x - 4, y - 4, x + 4, y + 4);
    line(cr, x - 4, y + 4, x + 4, y - 4);
}

// The axes spectra.png's four panels share: one log range [ylo, yhi]
// (log10) for the values above zero_tol, those at or below it in a band zb
// pixels high under the log axis (when there are any: zeros), indices
// 1..nmax on [xlo, xhi]; a panel is pw x ph pixels.
typedef struct spec_axes {
    double zero_tol, ylo, yhi, xlo, xhi;
    int nmax;
    bool zeros;
    double pw, ph, zb;
} spec_axes;

// The range of spectra.png: the decades around the values above zero_tol
// = 1e-12 max (below it a value is zero to the SVD's precision), at most
// 16 decades; those at or below it go in a band marked 0 under the log
// axis.
static void spectra_range(spec_axes *ax, const cJSON *heads) {
    double vmax = 0, vmin = INFINITY;
    int nmax = 1;
    const cJSON *hd;
    cJSON_ArrayForEach(hd, heads) for (int w = 0; w < 4; w++) {
        const cJSON *arr = jget(hd, spec_key[w]), *v;
        if (cJSON_GetArraySize(arr) > nmax) nmax = cJSON_GetArraySize(arr);
        cJSON_ArrayForEach(v, arr) if (cJSON_IsNumber(v) && isfinite(v->valuedouble))
            vmax = fmax(vmax, v->valuedouble);
    }
    const double zero_tol = vmax * 1e-12;
    bool zeros = false;
    cJSON_ArrayForEach(hd, heads) for (int w = 0; w < 4; w++) {
        const cJSON *v;
        cJSON_ArrayForEach(v, jget(hd, spec_key[w])) {
            double s = cJSON_IsNumber(v) ? v->valuedouble : NAN;
            if (s > zero_tol) vmin = fmin(vmin, s);
            else zeros = true;
        }
    }
    double yhi = vmax > 0 ? ceil(log10(vmax)) : 0;
    double ylo = isfinite(vmin) ? floor(log10(vmin)) : yhi - 1;
    if (yhi - ylo < 1) ylo = yhi - 1;
    if (yhi - ylo > 16) ylo = yhi - 16;
    ax->zero_tol = zero_tol, ax->ylo = ylo, ax->yhi = yhi;
    ax->xlo = 0.5, ax->xhi = nmax + 0.5;
    ax->nmax = nmax;
    ax->zeros = zeros;
}

// Panel w (W_Q, W_K, W_V, W_O) at (x0, y0): the grid, the zero band, the
// index ticks, a line per head of the H heads, the frame and the titles.
static void spectra_panel(cairo_t *cr, const spec_axes *ax, const cJSON *heads, int64_t H,
                          int w, double x0, double y0) {
    const double zero_tol = ax->zero_tol, ylo = ax->ylo, yhi = ax->yhi, xlo = ax->xlo,
                 xhi = ax->xhi, pw = ax->pw, ph = ax->ph, zb = ax->zb;
    const int nmax = ax->nmax;
    const bool zeros = ax->zeros;
    char b[32];
    const double lh = ph - zb;  // the log axis' height
#define SX(x) (x0 + ((x) - xlo) / (xhi - xlo) * pw)
#define SY(v) ((v) > zero_tol ? y0 + lh - (fmax(log10(v), ylo) - ylo) / (yhi - ylo) * lh \
                              : y0 + ph - zb / 2)
    cairo_set_dash(cr, NULL, 0, 0);
    // grid: decades, and 2 and 5 when the range is short
    font(cr, 11, false);
    for (double e = ylo; e <= yhi + 1e-9; e += 1)
        for (int m = 1; m <= 5; m += m == 1 ? 1 : 3) {
            double v = m * pow(10, e);
            if (log10(v) > yhi + 1e-9 || (m > 1 && yhi - ylo > 3)) continue;
            double Y = SY(v), g = m == 1 ? 0.82 : 0.92;
            cairo_set_source_rgb(cr, g, g, g);
            line(cr, x0, Y, x0 + pw, Y);
            cairo_set_source_rgb(cr, 0, 0, 0);
            snprintf(b, sizeof b, "%g", v);
            plot_text(cr, x0 - 6, Y, b, 1.0, 0.5);
        }
    if (zeros) {
        cairo_set_source_rgb(cr, 0.95, 0.95, 0.95);
        cairo_rectangle(cr, x0, y0 + lh, pw, zb);
        cairo_fill(cr);
        cairo_set_source_rgb(cr, 0.5, 0.5, 0.5);
        line(cr, x0, y0 + lh, x0 + pw, y0 + lh);
        cairo_set_source_rgb(cr, 0, 0, 0);
        plot_text(cr, x0 - 6, y0 + ph - zb / 2, "0", 1.0, 0.5);
    }
    const double xs = fmax(1, round(plot_nice_step(nmax, 8)));
    for (double x = 1; x <= nmax; x += xs) {
        cairo_set_source_rgb(cr, 0, 0, 0);
        line(cr, SX(x), y0 + ph, SX(x), y0 + ph + 4);
        snprintf(b, sizeof b, "%g", x);
        plot_text(cr, SX(x), y0 + ph + 7, b, 0.5, 1.0);
    }
    cairo_save(cr);
    cairo_rectangle(cr, x0 - 6, y0 - 6, pw + 12, ph + 12);
    cairo_clip(cr);
    for (int64_t h = 0; h < H; h++) {
        const cJSON *arr = jget(cJSON_GetArrayItem(heads, (int)h), spec_key[w]);
        const int cnt = cJSON_GetArraySize(arr);
        head_style(cr, h);
        for (int i = 0; i < cnt; i++) {
            double v = cJSON_GetArrayItem(arr, i)->valuedouble;
            if (i == 0) cairo_move_to(cr, SX(i + 1), SY(v));
            else cairo_line_to(cr, SX(i + 1), SY(v));
        }
        cairo_stroke(cr);
        for (int i = 0; i < cnt; i++) {
            double v = cJSON_GetArrayItem(arr, i)->valuedouble;
            if (!(v > zero_tol)) {
                x_marker(cr, SX(i + 1), SY(v));
            } else if (cnt <= 32) {
                cairo_arc(cr, SX(i + 1), SY(v), 2.2, 0, 2 * INSPECT_PI);
                cairo_fill(cr);
            }
        }
    }
    cairo_restore(cr);
    cairo_set_dash(cr, NULL, 0, 0);
    stroke_rect(cr, x0, y0, pw, ph, 0.2);
    cairo_set_source_rgb(cr, 0, 0, 0);
    font(cr, 13, true);
    plot_text(cr, x0, y0 - 10, spec_title[w], 0, 0);
    font(cr, 11, false);
    cairo_set_source_rgb(cr, 0.3, 0.3, 0.3);
    plot_text(cr, x0 + pw / 2, y0 + ph + 26, "index (largest first)", 0.5, 1.0);
    text_up(cr, x0 - 62, y0 + ph / 2, "singular value", 0.5, 1.0);
#undef SX
#undef SY
}

// The legend at (legend_x, top): the H heads' line styles, in columns of
// lrows.
static void spectra_legend(cairo_t *cr, int64_t H, double legend_x, double top,
                           int64_t lrows) {
    char b[32];
    cairo_set_source_rgb(cr, 0, 0, 0);
    font(cr, 13, true);
    plot_text(cr, legend_x, top - 4, "heads", 0, 0);
    font(cr, 11, false);
    for (int64_t h = 0; h < H; h++) {
        const double x = legend_x + (double)(h / lrows) * 110, y = top + 16 + (double)(h % lrows) * 20;
        head_style(cr, h);
        line(cr, x, y, x + 28, y);
        cairo_set_dash(cr, NULL, 0, 0);
        cairo_set_source_rgb(cr, 0, 0, 0);
        snprintf(b, sizeof b, "head %lld", (long long)h);
        plot_text(cr, x + 34, y, b, 0, 0.5);
    }
}

static cairo_status_t spectra_png(membuf *png, const inspect_report *r) {
    const int64_t H = r->H;
    const cJSON *heads = jget(r->diag, "heads");
    spec_axes ax;
    spectra_range(&ax, heads);
    const double pw = 440, ph = 260, left = 90, top = 96, gx = 100, gy = 96;
    const bool zeros = ax.zeros;
    ax.pw = pw, ax.ph = ph;
    ax.zb = zeros ? 30 : 0;  // the zero band at the bottom of a panel
    const int64_t lcols = H > 20 ? 2 : 1, lrows = (H + lcols - 1) / lcols;
    const double legend_x = left + 2 * pw + gx + 30, W = legend_x + lcols * 110 + 20;
    // (below the lower panels: their tick labels, and at + 26 the 11-point
    // "index (largest first)", top-anchored: about 12 pixels high)
    const double Hh = fmax(top + 2 * ph + gy + 26 + 12 + 12, top + 40 + lrows * 20 + 90);
    cairo_t *cr = canvas_create(W, Hh);
    cairo_set_source_rgb(cr, 0, 0, 0);
    font(cr, 17, true);
    plot_text(cr, 20, 30, "Singular values of each head's projection slices", 0, 0);
    font(cr, 12, false);
    plot_text(cr, 20, 54, zeros ? "log scale, largest first; \xc3\x97 in the band marked 0: a "
              "zero singular value (the slice is rank-deficient)" : "log scale, largest first",
              0, 0);
    for (int w = 0; w < 4; w++) {
        const double x0 = left + (w % 2) * (pw + gx), y0 = top + (w / 2) * (ph + gy);
        spectra_panel(cr, &ax, heads, H, w, x0, y0);
    }
    spectra_legend(cr, H, legend_x, top, lrows);
    return canvas_finish(cr, png);
}

// ---------------------------------------------------------------------------
// report.html

// s HTML-escaped (as valid UTF-8).
static void html_text(FILE *f, const char *s) {
    char *v = g_utf8_make_valid(s ? s : "", -1);
    for (const char *p = v; *p; p++) switch (*p) {
        case '&': fputs("&amp;", f); break;
        case '<': fputs("&lt;", f); break;
        case '>': fputs("&gt;", f); break;
        case '"': fputs("&quot;", f); break;
        case '\'': fputs("&#39;", f); break;
        default: fputc(*p, f);
        }
    g_free(v);
}

static void html_num(FILE *f, const cJSON *v) {
    if (cJSON_IsBool(v)) fputs(cJSON_IsTrue(v) ? "yes" : "no", f);
    else if (!cJSON_IsNumber(v) || isnan(v->valuedouble)) fputs("n/a", f);
    else if (v->valuedouble == floor(v->valuedouble) && fabs(v->valuedouble) < 1e15)
        fprintf(f, "%.0f", v->valuedouble);
    else fprintf(f, "%.5g", v->valuedouble);
}

static void html_img(FILE *f, const membuf *png, const char *alt) {
    gchar *b64 = g_base64_encode(png->p, png->n);
    fprintf(f, "<img alt=\"%s\" src=\"data:image/png;base64,%s\">\n", alt, b64);
    g_free(b64);
}

// What each per-head field means (diagnostics.json's names).
static const char *const field_doc[][2] = {
    {"head", "head index"},
    {"entropy_mean", "attention entropy in nats, mean over the rows examined (uniform over S keys: ln S)"},
    {"entropy_min", "the smallest row entropy"},
    {"entropy_norm", "mean of entropy / ln(visible keys): 1 = uniform"},
    {"mean_distance", "mean of sum_j p_ij |i - j|: small for a local head"},
    {"dead", "entropy_norm &ge; 0.98 (near-uniform) or output_var_ratio &le; 1e-4 (near-constant output)"},
    {"rank_q", "numerical rank of the head's W_Q rows (rank_k, rank_v: its KV head's W_K, W_V rows; rank_o: W_O's columns)"},
    {"logit_max", "largest scaled logit q&middot;k/&radic;d (before soft cap, ALiBi, masks)"},
    {"logit_std", "standard deviation of the scaled logits"},
    {"output_var_ratio", "variance of the head's output over its values' variance (~0: the output hardly depends on the query)"},
    {"rows", "rows examined with at least one visible key"},
    {"pruned", "the head is pruned (mha_module_prune_heads): the forward skips it, its weights are zero; the numbers above are what it would compute"},
    {"gate_mean", "its gate: head_gate[h] (static) or the mean of sigmoid(x W_g[h] + b_g[h]) over the query rows (dynamic); 1 without gates"}};

static void report_heads_table(FILE *f, const cJSON *heads) {
    const cJSON *first = cJSON_GetArrayItem(heads, 0), *x, *hd;
    fputs("<table>\n<tr>", f);
    cJSON_ArrayForEach(x, first) if (!cJSON_IsArray(x)) {
        fputs("<th>", f);
        html_text(f, x->string);
        fputs("</th>", f);
    }
    fputs("</tr>\n", f);
    int64_t h = 0;
    cJSON_ArrayForEach(hd, heads) {
        fprintf(f, "<tr id=\"head-%lld\"%s>", (long long)h++,
                cJSON_IsTrue(jget(hd, "dead")) ? " class=\"dead\"" : "");
        cJSON_ArrayForEach(x, hd) if (!cJSON_IsArray(x)) {
            fputs("<td>", f);
            html_num(f, x);
            fputs("</td>", f);
        }
        fputs("</tr>\n", f);
    }
    fputs("</table>\n<dl>\n", f);
    for (size_t i = 0; i < sizeof field_doc / sizeof field_doc[0]; i++)
        fprintf(f, "<dt>%s</dt><dd>%s</dd>\n", field_doc[i][0], field_doc[i][1]);
    fputs("</dl>\n", f);
}

static void report_similarity_table(FILE *f, const cJSON *sim) {
    const cJSON *row, *v;
    int64_t i = 0;
    fputs("<details><summary>the numbers</summary><div class=\"wide\"><table>\n<tr><th></th>", f);
    cJSON_ArrayForEach(row, sim) fprintf(f, "<th>head %lld</th>", (long long)i++);
    fputs("</tr>\n", f);
    i = 0;
    cJSON_ArrayForEach(row, sim) {
        fprintf(f, "<tr><th>head %lld</th>", (long long)i++);
        cJSON_ArrayForEach(v, row) {
            if (cJSON_IsNumber(v) && !isnan(v->valuedouble)) fprintf(f, "<td>%.4f</td>", v->valuedouble);
            else fputs("<td>n/a</td>", f);
        }
        fputs("</tr>\n", f);
    }
    fputs("</table></div></details>\n", f);
}

static void report_spectra_tables(FILE *f, const cJSON *heads) {
    fputs("<details><summary>the numbers</summary><div class=\"wide\">\n", f);
    for (int w = 0; w < 4; w++) {
        const cJSON *hd, *v;
        fprintf(f, "<h3>%s</h3>\n<table>\n", spec_key[w]);
        int64_t h = 0;
        cJSON_ArrayForEach(hd, heads) {
            fprintf(f, "<tr><th>head %lld</th>", (long long)h++);
            cJSON_ArrayForEach(v, jget(hd, spec_key[w])) fprintf(f, "<td>%.4g</td>", v->valuedouble);
            fputs("</tr>\n", f);
        }
        fputs("</table>\n", f);
    }
    fputs("</div></details>\n", f);
}

static int write_report(FILE *f, const inspect_report *r, const membuf png[3]) {
    const cJSON *heads = jget(r->diag, "heads"), *nf = jget(r->diag, "nonfinite"), *hd;
    fputs("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n"
          "<title>mha inspect report</title>\n<style>\n"
          "body{font-family:\"DejaVu Sans\",Verdana,sans-serif;margin:24px auto;"
          "max-width:1500px;padding:0 16px;color:#222}\n"
          "table{border-collapse:collapse;font-size:13px;margin:8px 0}\n"
          "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}\n"
          "th{background:#f0f0f0}\ntable.info td,table.info th{text-align:left}\n"
          "tr.dead td{background:#fde0dc}\n"
          "img{max-width:100%;height:auto;border:1px solid #ddd;margin:8px 0}\n"
          ".bad{color:#b00000;font-weight:bold}\n.wide{overflow-x:auto}\n"
          "dl{font-size:13px}dt{font-weight:bold;float:left;clear:left;width:150px}"
          "dd{margin:0 0 4px 160px}\n"
          ".tok{display:inline-block;border:1px solid #ddd;margin:2px;padding:1px 4px;"
          "font-family:monospace;white-space:pre}.tok small{color:#888;margin-right:4px}\n"
          "</style></head><body>\n<h1>mha inspect</h1>\n", f);

    fprintf(f, "<h2>Summary</h2>\n<p>%lld heads; %.0f query rows examined (all batch "
            "elements together). Dead heads: ", (long long)r->H, jnum(r->diag, "rows_examined"));
    int64_t h = 0, ndead = 0;
    cJSON_ArrayForEach(hd, heads) {
        if (cJSON_IsTrue(jget(hd, "dead")))
            fprintf(f, "%shead %lld", ndead++ ? ", " : "", (long long)h);
        h++;
    }
    fputs(ndead ? ".</p>\n<p>" : "none.</p>\n<p>", f);
    if (cJSON_IsString(nf)) {
        fputs("<span class=\"bad\">Non-finite value: ", f);
        html_text(f, nf->valuestring);
        fputs("</span> (the first met, in the order parameters, query, key, value, "
              "projected q, k, v, scaled logits)</p>\n", f);
    } else {
        fputs("Non-finite values: none.</p>\n", f);
    }

    fputs("<h2>Inputs</h2>\n<table class=\"info\">\n", f);
    for (int i = 0; i < r->ninfo; i++) {
        fputs("<tr><th>", f);
        html_text(f, r->info_name[i]);
        fputs("</th><td>", f);
        html_text(f, r->info_value[i]);
        fputs("</td></tr>\n", f);
    }
    fputs("</table>\n<h2>Per-head numbers</h2>\n", f);
    report_heads_table(f, heads);

    fputs("<h2>Attention weights</h2>\n", f);
    html_img(f, &png[0], "per-head attention heatmaps");
    fputs("<h2>Head similarity</h2>\n", f);
    html_img(f, &png[1], "head similarity matrix");
    report_similarity_table(f, jget(r->diag, "similarity"));
    fputs("<h2>Singular values</h2>\n", f);
    html_img(f, &png[2], "singular value spectra");
    report_spectra_tables(f, heads);

    if (r->ntokens) {
        fprintf(f, "<h2>Tokens</h2>\n<details><summary>%lld labels</summary><p>\n",
                (long long)r->ntokens);
        for (int64_t i = 0; i < r->ntokens; i++) {
            fprintf(f, "<span class=\"tok\"><small>%lld</small>", (long long)i);
            html_text(f, r->tokens[i]);
            fputs("</span>\n", f);
        }
        fputs("</p></details>\n", f);
    }
    fputs("</body></html>\n", f);
    return ferror(f) ? 1 : 0;
}

// ---------------------------------------------------------------------------

// data as the new contents of path (mha_file_write: atomically). 0, or 1
// after printing.
static int write_file(const char *cmd, const char *path, const void *data, size_t n) {
    mha_status st = mha_file_write(path, data, n);
    if (st) {
        fprintf(stderr, "mha %s: %s\n", cmd, mha_last_error());
        return 1;
    }
    printf("wrote %s\n", path);
    return 0;
}

int inspect_write_pictures(const char *cmd, const char *dir, const inspect_report *r) {
    static const char *const names[3] = {"heads.png", "similarity.png", "spectra.png"};
    membuf png[3];
    memset(png, 0, sizeof png);
    char path[4096];
    int rc = 1;
    cairo_status_t st = heads_png(&png[0], r);
    if (st == CAIRO_STATUS_SUCCESS) st = similarity_png(&png[1], r);
    if (st == CAIRO_STATUS_SUCCESS) st = spectra_png(&png[2], r);
    plot_release_fonts();
    if (st != CAIRO_STATUS_SUCCESS) {
        fprintf(stderr, "mha %s: cannot draw the pictures: %s\n", cmd, cairo_status_to_string(st));
        goto done;
    }
    for (int i = 0; i < 3; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        if (write_file(cmd, path, png[i].p, png[i].n)) goto done;
    }
    // the report composed in memory, then written as one file
    snprintf(path, sizeof path, "%s/report.html", dir);
    char *html = NULL;
    size_t html_n = 0;
    FILE *f = open_memstream(&html, &html_n);
    int bad = !f || write_report(f, r, png);
    if (f && fclose(f)) bad = 1;
    if (bad) fprintf(stderr, "mha %s: out of memory composing %s\n", cmd, path);
    else bad = write_file(cmd, path, html, html_n);
    free(html);
    if (bad) goto done;
    rc = 0;
done:
    for (int i = 0; i < 3; i++) free(png[i].p);
    return rc;
}

#endif
