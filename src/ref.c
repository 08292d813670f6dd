// ref.c: the reference attention, the oracle every fast path is checked
// against. It reads like the textbook: (1) scores = q k^T, (2) scale and add
// the masks, (3) softmax row by row, (4) weight the values. Plain loops, the
// full (L, S) score matrix, accumulation in double. No intrinsics, no tiles,
// no threads (the caller may run heads in parallel: each call only writes
// its own out/w rows).
#include <math.h>
#include <string.h>

#include "ref.h"

// Sum of x[i*xs] * y[i] in double. Four partial sums, always combined in the
// same order, so the result never depends on anything but the inputs.
static double dot(const float *x, int64_t xs, const float *y, int64_t ys,
                  int64_t n) {
    double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += (double)x[i * xs] * y[i * ys];
        s1 += (double)x[(i + 1) * xs] * y[(i + 1) * ys];
        s2 += (double)x[(i + 2) * xs] * y[(i + 2) * ys];
        s3 += (double)x[(i + 3) * xs] * y[(i + 3) * ys];
    }
    for (; i < n; i++) s0 += (double)x[i * xs] * y[i * ys];
    return (s0 + s1) + (s2 + s3);
}

void mha__ref_linear_row(float *y, int64_t ys, const float *x, int64_t xs,
                         const float *W, const float *b, int64_t I, int64_t O) {
    for (int64_t o = 0; o < O; o++) {
        double acc = dot(x, xs, W + o * I, 1, I);
        if (b) acc += b[o];
        y[o * ys] = (float)acc;
    }
}

// One mask element as an additive value.
static float mask_elem(const void *base, mha_dtype dt, int64_t off) {
    if (dt == MHA_F32) return ((const float *)base)[off];
    return ((const uint8_t *)base)[off] ? -INFINITY : 0.0f;
}

float mha__mask_value(const mha__mask *mk, int64_t b, int64_t h, int64_t i,
                      int64_t j) {
    if (j >= mk->s_masked) return 0.0f;
    float v = 0.0f;
    if (mk->causal && j > i) v = -INFINITY;
    if (mk->attn)
        v += mask_elem(mk->attn, mk->attn_dtype,
                       b * mk->attn_s[0] + h * mk->attn_s[1] +
                           i * mk->attn_s[2] + j * mk->attn_s[3]);
    if (mk->kpm)
        v += mask_elem(mk->kpm, mk->kpm_dtype, b * mk->kpm_s[0] + j * mk->kpm_s[1]);
    return v;
}

// Passes the (rows, cols) doubles of m (row stride ld) to the trace.
static void trace_doubles(const mha__trace *tr, const char *step, int64_t b,
                          int64_t h, const double *m, int64_t rows,
                          int64_t cols, int64_t ld) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++)
            tr->buf[r * cols + c] = (float)m[r * ld + c];
    int64_t shape[2] = {rows, cols};
    mha_tensor t = mha_tensor_contiguous(tr->buf, MHA_F32, 2, shape);
    tr->fn(tr->user, step, b, h, &t);
}

void mha__ref_attention_head(mha__mat out, mha__mat w, mha__mat q, mha__mat k,
                             mha__mat v, int64_t L, int64_t S, int64_t D,
                             int64_t Dv, double scale, const mha__mask *mk,
                             int64_t b, int64_t h, double *scores,
                             const mha__trace *tr) {
    // (1) scores (L, S) = q (L, D) k (S, D)^T
    for (int64_t i = 0; i < L; i++)
        for (int64_t j = 0; j < S; j++)
            scores[i * S + j] = dot(q.p + i * q.rs, q.cs, k.p + j * k.rs, k.cs, D);
    if (tr) trace_doubles(tr, "scores", b, h, scores, L, S, S);

    // (2) scale, then add the masks (-inf for hidden keys, never 0)
    for (int64_t i = 0; i < L; i++)
        for (int64_t j = 0; j < S; j++)
            scores[i * S + j] = scale * scores[i * S + j] +
                                (double)mha__mask_value(mk, b, h, i, j);
    if (tr) trace_doubles(tr, "scaled_scores", b, h, scores, L, S, S);

    // (3) softmax of each row: subtract the row max so exp never overflows;
    //     a row with every score -inf (all keys masked) becomes all 0.
    for (int64_t i = 0; i < L; i++) {
        double *row = scores + i * S;
        double mx = -INFINITY;
        bool nan = false;
        for (int64_t j = 0; j < S; j++) {
            if (isnan(row[j])) nan = true;
            else if (row[j] > mx) mx = row[j];
        }
        if (nan) {  // a NaN score makes the whole row NaN, as in PyTorch
            for (int64_t j = 0; j < S; j++) row[j] = NAN;
            continue;
        }
        if (mx == -INFINITY) {
            for (int64_t j = 0; j < S; j++) row[j] = 0.0;
            continue;
        }
        double sum = 0.0;
        for (int64_t j = 0; j < S; j++) {
            row[j] = exp(row[j] - mx);
            sum += row[j];
        }
        for (int64_t j = 0; j < S; j++) row[j] /= sum;
    }
    if (tr) trace_doubles(tr, "weights", b, h, scores, L, S, S);
    if (w.p)
        for (int64_t i = 0; i < L; i++)
            for (int64_t j = 0; j < S; j++)
                w.p[i * w.rs + j * w.cs] = (float)scores[i * S + j];

    // (4) out (L, Dv) = P (L, S) v (S, Dv)
    for (int64_t i = 0; i < L; i++) {
        const double *p = scores + i * S;
        for (int64_t c = 0; c < Dv; c++) {
            double acc = 0.0;
            for (int64_t j = 0; j < S; j++) acc += p[j] * v.p[j * v.rs + c * v.cs];
            out.p[i * out.rs + c * out.cs] = (float)acc;
        }
    }
    if (tr) {
        for (int64_t i = 0; i < L; i++)
            for (int64_t c = 0; c < Dv; c++)
                tr->buf[i * Dv + c] = out.p[i * out.rs + c * out.cs];
        int64_t shape[2] = {L, Dv};
        mha_tensor t = mha_tensor_contiguous(tr->buf, MHA_F32, 2, shape);
        tr->fn(tr->user, "context", b, h, &t);
    }
}
