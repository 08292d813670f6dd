// dense.c: mha_linear, the public dense layer y = x W^T + b (nn.Linear's
// forward) on the packed GEMM of the projections (gemm.h). Create checks
// the weight and bias once and packs W^T into the kernel table's panels
// (half weights widened exactly); forward checks the views, takes x's
// rows in place when they are evenly spaced with unit feature stride (else
// gathers them), runs mha__gemm_rows_packed into y's rows (or a staging
// block scattered into any other y view) with per-call scratch.
//
// What it deliberately does not do: float64 or half inputs and outputs,
// a backward, an activation; the layer is immutable once created, so
// concurrent forwards share it.
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "gemm.h"
#include "view.h"

struct mha_linear {
    const mha__kernels *kt;  // the process's table: the packing is its format
    int64_t in, out;         // I, O
    float *wp;               // W^T (I, O) packed: mha__gemm_packed_b_floats(kt, I, O)
    float *bias;             // (O), or NULL; carved after wp in one block
    void *block;             // mha__alloc'ed: wp, then bias
};

// Threads for a GEMM of `work` multiply-adds (the bits do not depend on it).
static int threads_for(double work) {
    return work < MHA__PAR_MIN_WORK ? 1 : mha__max_threads();
}

// F32, BF16 or F16 (the weight's and bias's dtypes), name in messages.
static mha_status check_param(const mha_tensor *t, const char *name, int ndim) {
    if ((unsigned)t->dtype < MHA_DTYPE_COUNT && t->dtype != MHA_F32 && t->dtype != MHA_BF16 &&
        t->dtype != MHA_F16)
        return mha__fail(MHA_ERR_DTYPE,
                         "linear: %s: dtype %s is not supported (expected F32, BF16 or F16; "
                         "round float64 parameters to float32 first)",
                         name, mha_dtype_name(t->dtype));
    mha_status st = mha__check_float(t, name);
    if (st) return st;
    if (t->ndim != ndim) {
        char s[160];
        return mha__fail(MHA_ERR_SHAPE, "linear: %s: expected %d dim%s %s, got shape %s", name,
                         ndim, ndim == 1 ? "" : "s", ndim == 1 ? "(O)" : "(O, I)",
                         mha__shape_str(s, sizeof s, t->ndim, t->shape));
    }
    return MHA_OK;
}

// Packs W^T of a weight view into l->wp (F32: any strides, straight from
// the view; half, contiguous: mha__gemm_pack_wt_half; half, strided:
// widened into a contiguous copy first). The same packed floats either way.
static mha_status pack_weight(mha_linear *l, const mha_tensor *w) {
    const mha__kernels *kt = l->kt;
    const int64_t O = l->out, I = l->in;
    if (O == 0 || I == 0) return MHA_OK;
    const int nt = threads_for((double)O * (double)I);
    if (w->dtype == MHA_F32) {
        // B (K = I, N = O), B(i, o) = W(o, i) = W[o s0 + i s1]
        mha__gemm_pack_b(kt, l->wp, w->data, w->stride[1], w->stride[0], I, O, nt);
        return MHA_OK;
    }
    const bool rows = (w->stride[1] == 1 || I == 1) && (w->stride[0] == I || O == 1);
    size_t floats = rows ? mha__gemm_pack_half_tmp_floats(kt, I, nt) : (size_t)(O * I), bytes;
    if (mha__mul_overflow_size(floats, sizeof(float), &bytes))
        return mha__fail(MHA_ERR_OVERFLOW,
                         "linear: widening a (%lld, %lld) %s weight: the "
                         "scratch size overflows",
                         (long long)O, (long long)I, mha_dtype_name(w->dtype));
    float *tmp = mha__alloc(bytes);
    if (!tmp)
        return mha__fail(MHA_ERR_NOMEM,
                         "linear: out of memory widening a (%lld, %lld) %s weight (%zu bytes)",
                         (long long)O, (long long)I, mha_dtype_name(w->dtype), bytes);
    if (rows) {
        mha__gemm_pack_wt_half(kt, l->wp, w->data, w->dtype == MHA_BF16 ? 1 : 2, O, I, nt, tmp);
    } else {
        const mha__mat wm = mha__vmat(w->data, w->dtype, w->stride[0], w->stride[1]);
        for (int64_t o = 0; o < O; o++)
            for (int64_t i = 0; i < I; i++) tmp[o * I + i] = (float)mha__ld(wm, o, i);
        mha__gemm_pack_wt(kt, l->wp, tmp, O, I, nt);
    }
    mha__free(tmp);
    return MHA_OK;
}

mha_status mha_linear_create(mha_linear **out, const mha_tensor *weight,
                             const mha_tensor *bias) {
    if (!out) return mha__fail(MHA_ERR_INVALID_ARG, "linear: out is NULL");
    *out = NULL;
    if (!weight) return mha__fail(MHA_ERR_INVALID_ARG, "linear: weight is NULL");
    mha_status st = check_param(weight, "weight", 2);
    if (st) return st;
    const int64_t O = weight->shape[0], I = weight->shape[1];
    if (bias) {
        if ((st = check_param(bias, "bias", 1))) return st;
        if (bias->shape[0] != O)
            return mha__fail(MHA_ERR_SHAPE,
                             "linear: bias has %lld elements, the weight (%lld, %lld) has "
                             "%lld outputs",
                             (long long)bias->shape[0], (long long)O, (long long)I,
                             (long long)O);
    }
    const mha__kernels *kt = mha__kernels_get();
    // the block: wp (the padded panels), then the bias; sizes checked
    // against overflow before mha__gemm_packed_b_floats multiplies them
    const int64_t Op = (O + kt->pk_nr - 1) / kt->pk_nr * kt->pk_nr;
    int64_t wp_floats;
    size_t total = 0, off_wp, off_b;
    if (mha__mul_overflow_i64(Op, I, &wp_floats) ||
        mha__carve(&total, &off_wp, wp_floats, sizeof(float)) ||
        mha__carve(&total, &off_b, bias ? O : 0, sizeof(float)))
        return mha__fail(MHA_ERR_OVERFLOW,
                         "linear: the packed (%lld, %lld) weight's size overflows",
                         (long long)O, (long long)I);
    mha_linear *l = mha__calloc(1, sizeof *l);
    void *block = l ? mha__alloc(total) : NULL;
    if (!block) {
        mha__free(block);
        free(l);
        return mha__fail(MHA_ERR_NOMEM,
                         "linear: out of memory for the packed (%lld, %lld) weight (%zu bytes)",
                         (long long)O, (long long)I, total);
    }
    *l = (mha_linear){.kt = kt,
                      .in = I,
                      .out = O,
                      .wp = (float *)((char *)block + off_wp),
                      .bias = bias ? (float *)((char *)block + off_b) : NULL,
                      .block = block};
    if (bias) {
        const mha__mat bm = mha__vmat(bias->data, bias->dtype, 0, bias->stride[0]);
        for (int64_t o = 0; o < O; o++) l->bias[o] = (float)mha__ld(bm, 0, o);
    }
    if ((st = pack_weight(l, weight))) {
        mha_linear_destroy(l);
        return st;
    }
    *out = l;
    return MHA_OK;
}

void mha_linear_destroy(mha_linear *l) {
    if (!l) return;
    mha__free(l->block);
    free(l);
}

// Element offset of row r (the leading indices of a (..., F) view, row-
// major) from t->data.
static int64_t row_offset(const mha_tensor *t, int64_t r) {
    int64_t off = 0;
    for (int d = t->ndim - 2; d >= 0; d--) {
        off += (r % t->shape[d]) * t->stride[d];
        r /= t->shape[d];
    }
    return off;
}

// Are the rows of a (..., F) float32 view evenly spaced, at least F apart
// (no two overlap), with unit feature stride? Then row r is at data + r *
// *ld.
static bool rows_direct(const mha_tensor *t, int64_t *ld) {
    const int nd = t->ndim;
    const int64_t F = t->shape[nd - 1];
    if (F > 1 && t->stride[nd - 1] != 1) return false;
    int64_t step = F, next = 0;  // F: at most one row; next: the next dim's step
    bool first = true;
    for (int d = nd - 2; d >= 0; d--) {
        if (t->shape[d] == 1) continue;
        if (first) step = t->stride[d], first = false;
        else if (t->stride[d] != next) return false;
        next = t->stride[d] * t->shape[d];
    }
    if (step < F) return false;
    *ld = step;
    return true;
}

// The checks of a forward: views, dtypes, shapes, overlap.
static mha_status check_forward(const mha_linear *l, const mha_tensor *y, const mha_tensor *x) {
    if (!l) return mha__fail(MHA_ERR_INVALID_ARG, "linear: the layer is NULL");
    if (!y) return mha__fail(MHA_ERR_INVALID_ARG, "linear: y is NULL");
    if (!x) return mha__fail(MHA_ERR_INVALID_ARG, "linear: x is NULL");
    for (int k = 0; k < 2; k++) {  // a known dtype but not F32: say so first
        const mha_dtype dt = k ? y->dtype : x->dtype;
        if ((unsigned)dt < MHA_DTYPE_COUNT && dt != MHA_F32)
            return mha__fail(MHA_ERR_DTYPE,
                             "linear: %s is %s: x and y must be F32 (the weight may be half)",
                             k ? "y" : "x", mha_dtype_name(dt));
    }
    mha_status st;
    if ((st = mha__check_float(x, "x")) || (st = mha__check_float(y, "y"))) return st;
    char s1[160], s2[160], s3[160];
    if (x->ndim < 1)
        return mha__fail(MHA_ERR_SHAPE, "linear: x has 0 dims: expected (..., %lld)",
                         (long long)l->in);
    if (x->shape[x->ndim - 1] != l->in)
        return mha__fail(MHA_ERR_SHAPE,
                         "linear: x %s has %lld features, the layer's weight (%lld, %lld) "
                         "takes %lld",
                         mha__shape_str(s1, sizeof s1, x->ndim, x->shape),
                         (long long)x->shape[x->ndim - 1], (long long)l->out, (long long)l->in,
                         (long long)l->in);
    int64_t want[MHA_MAX_DIMS];
    memcpy(want, x->shape, sizeof want);
    want[x->ndim - 1] = l->out;
    bool same = y->ndim == x->ndim;
    for (int d = 0; same && d < x->ndim; d++) same = y->shape[d] == want[d];
    if (!same)
        return mha__fail(MHA_ERR_SHAPE,
                         "linear: y has shape %s, expected %s (x %s, %lld outputs)",
                         mha__shape_str(s1, sizeof s1, y->ndim, y->shape),
                         mha__shape_str(s2, sizeof s2, x->ndim, want),
                         mha__shape_str(s3, sizeof s3, x->ndim, x->shape), (long long)l->out);
    for (int d = 0; d < y->ndim; d++)
        if (y->stride[d] == 0 && y->shape[d] > 1)
            return mha__fail(MHA_ERR_INVALID_ARG,
                             "linear: y has stride 0 along dim %d of size %lld: its elements "
                             "would overlap",
                             d, (long long)y->shape[d]);
    return mha__check_no_overlap(y, "linear: y", x, "x");
}

mha_status mha_linear_forward(const mha_linear *l, mha_tensor *y, const mha_tensor *x) {
    mha_status st = check_forward(l, y, x);
    if (st) return st;
    const int64_t I = l->in, O = l->out, R = mha__rows_of(x);
    if (R == 0 || O == 0) return MHA_OK;
    const mha__kernels *kt = l->kt;
    const int nt = threads_for((double)R * (double)I * (double)O);
    int64_t ldx, ldy;
    const bool x_direct = rows_direct(x, &ldx), y_direct = rows_direct(y, &ldy);
    // scratch: the GEMM's per-thread A packs, x's rows gathered (R, I),
    // y's rows staged (R, O)
    size_t total = 0, off_gs, off_x, off_y;
    if (mha__carve(&total, &off_gs, (int64_t)mha__gemm_scratch_floats(kt, nt), sizeof(float)) ||
        mha__carve(&total, &off_x, x_direct ? 0 : R * I, sizeof(float)) ||
        mha__carve(&total, &off_y, y_direct ? 0 : R * O, sizeof(float)))
        return mha__fail(MHA_ERR_OVERFLOW, "linear: the scratch of %lld rows overflows",
                         (long long)R);
    char *ws = mha__alloc(total);
    if (!ws)
        return mha__fail(MHA_ERR_NOMEM,
                         "linear: out of memory for the scratch of %lld rows (%zu bytes)",
                         (long long)R, total);
    const float *X = x->data;
    if (!x_direct) {
        float *xg = (float *)(ws + off_x);
        const int64_t fs = x->stride[x->ndim - 1];
#pragma omp parallel for schedule(static) num_threads(nt)
        for (int64_t r = 0; r < R; r++) {
            const float *xr = (const float *)x->data + row_offset(x, r);
            for (int64_t i = 0; i < I; i++) xg[r * I + i] = xr[i * fs];
        }
        X = xg, ldx = I;
    }
    float *Y = y_direct ? y->data : (float *)(ws + off_y);
    if (!y_direct) ldy = O;
    mha__gemm_rows_packed(kt, Y, ldy, X, ldx, l->wp, l->bias, R, I, O, false, nt,
                          (float *)(ws + off_gs));
    if (!y_direct) {  // one thread, rows in order: a view whose rows overlap
                      // gets the same bits every time
        const int64_t fs = y->stride[y->ndim - 1];
        for (int64_t r = 0; r < R; r++) {
            float *yr = (float *)y->data + row_offset(y, r);
            for (int64_t o = 0; o < O; o++) yr[o * fs] = Y[r * O + o];
        }
    }
    mha__free(ws);
    return MHA_OK;
}
