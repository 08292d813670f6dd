// mask.c: the mask rule of mask.h, element by element (the reference and
// the diagnostics call it per score; the flash tiles per masked tile).
#include <math.h>

#include "mask.h"

// One mask element as an additive value.
static double mask_elem(const void *base, mha_dtype dt, int64_t off) {
    if (dt == MHA_F32) return ((const float *)base)[off];
    if (dt == MHA_F64) return ((const double *)base)[off];
    return ((const uint8_t *)base)[off] ? -INFINITY : 0.0;
}

void mha__mask_band(const mha__mask *mk, int64_t i, int64_t S, int64_t *lo, int64_t *hi) {
    const int64_t p = i + mk->q_off;  // the query's position
    int64_t l = 0, h = S;
    if (mk->win_left >= 0 && p - mk->win_left > l) l = p - mk->win_left;
    if (mk->causal && p + 1 < h) h = p + 1;
    if (mk->win_right >= 0 && p + mk->win_right + 1 < h) h = p + mk->win_right + 1;
    *lo = l;
    *hi = h < 0 ? 0 : h;
}

double mha__mask_value(const mha__mask *mk, int64_t b, int64_t h, int64_t i, int64_t j) {
    double v = 0.0;
    if (mk->alibi) v = mha__alibi_bias(mk->alibi[h], i + mk->q_off, j);
    if (j >= mk->s_masked) return v;
    const int64_t p = i + mk->q_off;  // the query's position
    if (mk->causal && j > p) v = -INFINITY;
    if (mk->win_left >= 0 && j < p - mk->win_left) v = -INFINITY;
    if (mk->win_right >= 0 && j > p + mk->win_right) v = -INFINITY;
    if (mk->attn)
        v += mask_elem(mk->attn, mk->attn_dtype,
                       b * mk->attn_s[0] + h * mk->attn_s[1] + i * mk->attn_s[2] +
                           j * mk->attn_s[3]);
    if (mk->kpm) v += mask_elem(mk->kpm, mk->kpm_dtype, b * mk->kpm_s[0] + j * mk->kpm_s[1]);
    return v;
}

void mha_attn_opts_init(mha_attn_opts *o) {
    if (!o) return;
    *o = (mha_attn_opts){0};
    o->window_left = -1;
    o->window_right = -1;
}
