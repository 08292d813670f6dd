// view.h: tensor views as the library's loops read and write them (base
// layer): mha__mat, a 2-D strided view of float, double, bfloat16 or
// float16 elements with per-element loads and stores in double; the rows of
// a (d0, [d1,] F) view; the scratch-layout carving helper. Depends on
// internal.h only.
#ifndef MHA_VIEW_H
#define MHA_VIEW_H

#include <stdbool.h>
#include <string.h>

#include "internal.h"

// A 2-D strided view of float, double, bfloat16 or float16 elements:
// element (r, c) at p[r*rs + c*cs]. half: 0 (float or double by f64),
// 1 bfloat16, 2 float16 (stores round the value to float32 first, then to
// the half type, nearest even).
typedef struct mha__mat {
    void *p;
    bool f64;
    int64_t rs, cs;
    uint8_t half;
} mha__mat;

static inline double mha__ld(mha__mat m, int64_t r, int64_t c) {
    int64_t o = r * m.rs + c * m.cs;
    if (m.half)
        return m.half == 1 ? (double)mha_bf16_to_f32(((const uint16_t *)m.p)[o])
                           : (double)mha_f16_to_f32(((const uint16_t *)m.p)[o]);
    return m.f64 ? ((const double *)m.p)[o] : (double)((const float *)m.p)[o];
}

static inline void mha__st(mha__mat m, int64_t r, int64_t c, double v) {
    int64_t o = r * m.rs + c * m.cs;
    if (m.half)
        ((uint16_t *)m.p)[o] = m.half == 1 ? mha_f32_to_bf16((float)v)
                                           : mha_f32_to_f16((float)v);
    else if (m.f64) ((double *)m.p)[o] = v;
    else ((float *)m.p)[o] = (float)v;
}

// n elements of a 1-row view (row 0 of m) as float32 into dst, and n
// float32 values stored into it: the same values as mha__ld / mha__st
// element by element (a half store rounds once, nearest even), with loops
// the compiler vectorizes where the row is contiguous.
static inline void mha__ld_row(float *dst, mha__mat m, int64_t n) {
    if (m.cs == 1 && !m.half && !m.f64) {
        memcpy(dst, m.p, sizeof(float) * (size_t)n);
    } else if (m.cs == 1 && m.half == 1) {
        const uint16_t *h = (const uint16_t *)m.p;
        for (int64_t i = 0; i < n; i++) {
            const uint32_t u = (uint32_t)h[i] << 16;
            memcpy(dst + i, &u, sizeof u);
        }
    } else {
        for (int64_t i = 0; i < n; i++) dst[i] = (float)mha__ld(m, 0, i);
    }
}

static inline void mha__st_row(mha__mat m, const float *src, int64_t n) {
    if (m.cs == 1 && !m.half && !m.f64) {
        memcpy(m.p, src, sizeof(float) * (size_t)n);
    } else if (m.cs == 1 && m.half == 1) {
        uint16_t *h = (uint16_t *)m.p;
        for (int64_t i = 0; i < n; i++) {  // mha_f32_to_bf16
            uint32_t u;
            memcpy(&u, src + i, sizeof u);
            const uint32_t r = u + 0x7fffu + ((u >> 16) & 1u);
            h[i] = (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x40)
                                                   : (uint16_t)(r >> 16);
        }
    } else {
        for (int64_t i = 0; i < n; i++) mha__st(m, 0, i, src[i]);
    }
}

// mha__mat's half of an element type: 1 bfloat16, 2 float16, else 0 (the
// flash head's q_half ... o_half use the same numbers).
static inline uint8_t mha__half_of(mha_dtype dt) {
    return dt == MHA_BF16 ? 1 : dt == MHA_F16 ? 2 : 0;
}

// The view of a tensor's elements from p (already offset) of type dt.
static inline mha__mat mha__vmat(void *p, mha_dtype dt, int64_t rs, int64_t cs) {
    mha__mat m = {p, dt == MHA_F64, rs, cs, mha__half_of(dt)};
    return m;
}

// A row-major double matrix with row stride ld, as a view.
static inline mha__mat mha__dmat(double *p, int64_t ld) {
    mha__mat m = {p, true, ld, 1, 0};
    return m;
}

// A view's element (i0, i1[, i2]) address and type as a 1-row mat whose
// columns follow dim `col`.
static inline mha__mat mha__view_at(const mha_tensor *t, int64_t off, int col) {
    mha__mat m = mha__vmat((char *)t->data + off * (int64_t)mha_dtype_size(t->dtype), t->dtype,
                           0, t->stride[col]);
    return m;
}

// Row r (= i0*d1 + i1) of a 2-D/3-D view, as a 1-row mat.
static inline mha__mat mha__view_row(const mha_tensor *t, int64_t r) {
    const int64_t d1 = t->ndim == 3 ? t->shape[1] : 1, s1 = t->ndim == 3 ? t->stride[1] : 0;
    return mha__vmat((char *)t->data + ((r / d1) * t->stride[0] + (r % d1) * s1) *
                                           (int64_t)mha_dtype_size(t->dtype),
                     t->dtype, 0, t->stride[t->ndim - 1]);
}

// Does a 2-D/3-D float view have evenly spaced rows (d0*d1 of them) with
// unit feature stride? Then row r = i0*d1 + i1 is at data + r*ld.
static inline bool mha__rows_direct(const mha_tensor *t, int64_t *ld) {
    if (t->dtype != MHA_F32 || t->stride[t->ndim - 1] != 1) return false;
    if (t->ndim == 2) {
        *ld = t->stride[0];
        return true;
    }
    if (t->shape[1] <= 1 || t->stride[0] == t->shape[1] * t->stride[1]) {
        *ld = t->stride[1];
        if (t->shape[1] <= 1) *ld = t->stride[0];
        return true;
    }
    return false;
}

// Copies a view's rows into dst (mha__rows_of(t), F) contiguous float32.
void mha__gather_rows(float *dst, const mha_tensor *t);
// The same tensor (data, dtype, shape and strides)?
bool mha__same_view(const mha_tensor *a, const mha_tensor *b);
// (seq, batch, feature) element strides of a (S, N, F) / (N, S, F) / (S, F)
// view.
void mha__seq_batch_feat(int64_t s[3], const mha_tensor *t, bool batch_first);
// Adds n items of `size` bytes to the scratch layout at *total, setting
// *off to their offset; pieces are 64-byte aligned. Returns 1 on overflow.
int mha__carve(size_t *total, size_t *off, int64_t n, size_t size);
// Writes one row of attention weights (n values from rowd or rowf) at
// element offset elem_off of w along its last dim: converted to w's float
// type, or, for an MHA_U8 view, quantised with scales[row_index] =
// max / 255 (mha_forward_args.weights_scale).
void mha__weights_row_out(const mha_tensor *w, float *scales, int64_t row_index,
                          int64_t elem_off, const double *rowd, const float *rowf, int64_t n);

#endif
