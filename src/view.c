// view.c: the view helpers of view.h that are not inline: gathering a
// view's rows, comparing views, (seq, batch, feature) strides, the scratch
// carving, and the attention-weights row writer (float or int8).
#include <math.h>

#include "view.h"

void mha__gather_rows(float *dst, const mha_tensor *t) {
    const int64_t F = t->shape[t->ndim - 1], R = mha__rows_of(t);
    for (int64_t r = 0; r < R; r++) {
        mha__mat row = mha__view_row(t, r);
        mha__ld_row(dst + r * F, row, F);
    }
}

bool mha__same_view(const mha_tensor *a, const mha_tensor *b) {
    if (a == b) return true;
    if (a->data != b->data || a->ndim != b->ndim || a->dtype != b->dtype) return false;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i] || a->stride[i] != b->stride[i]) return false;
    return true;
}

void mha__seq_batch_feat(int64_t s[3], const mha_tensor *t, bool batch_first) {
    if (t->ndim == 2) {
        s[0] = t->stride[0];
        s[1] = 0;
        s[2] = t->stride[1];
    } else if (batch_first) {
        s[0] = t->stride[1];
        s[1] = t->stride[0];
        s[2] = t->stride[2];
    } else {
        s[0] = t->stride[0];
        s[1] = t->stride[1];
        s[2] = t->stride[2];
    }
}

int mha__carve(size_t *total, size_t *off, int64_t n, size_t size) {
    size_t bytes;
    if (mha__mul_overflow_size((size_t)n, size, &bytes)) return 1;
    bytes = (bytes + 63) & ~(size_t)63;
    *off = *total;
    return mha__add_overflow_size(*total, bytes, total);
}

void mha__weights_row_out(const mha_tensor *w, float *scales, int64_t row_index,
                          int64_t elem_off, const double *rowd, const float *rowf, int64_t n) {
    const int64_t cs = w->stride[w->ndim - 1];
    if (w->dtype == MHA_U8) {  // int8 weights: one scale per row
        double mx = 0.0;
        for (int64_t j = 0; j < n; j++) {
            const double x = rowd ? rowd[j] : (double)rowf[j];
            mx = x > mx ? x : mx;
        }
        const float sc = (float)(mx / 255.0);
        uint8_t *dst = (uint8_t *)w->data + elem_off;
        for (int64_t j = 0; j < n; j++) {
            const double x = rowd ? rowd[j] : (double)rowf[j];
            double qv = sc > 0.0f ? nearbyint(x / (double)sc) : 0.0;
            // a NaN weight gives 0 (converting NaN to uint8_t is undefined)
            qv = qv > 0.0 ? (qv > 255.0 ? 255.0 : qv) : 0.0;
            dst[j * cs] = (uint8_t)qv;
        }
        scales[row_index] = sc;
        return;
    }
    const mha__mat m = mha__vmat((char *)w->data + elem_off * (int64_t)mha_dtype_size(w->dtype),
                                 w->dtype, 0, cs);
    for (int64_t j = 0; j < n; j++) mha__st(m, 0, j, rowd ? rowd[j] : (double)rowf[j]);
}
