// ref.c: the reference attention, the oracle every fast path is checked
// against. It reads like the textbook: (1) scores = q k^T, (2) scale and add
// the masks, (3) softmax row by row, (4) weight the values. Plain loops, the
// full (L, S) score matrix, accumulation in double. No intrinsics, no tiles,
// no threads (the caller may run heads in parallel: each call only writes
// its own out/w rows).
#include <math.h>
#include <string.h>

#include "philox.h"
#include "ref.h"

// Sum of a(ra, i) * b(rb, i) over i < n, in double. Four partial sums,
// always combined in the same order, so the result depends only on the
// inputs.
static double dot(mha__mat a, int64_t ra, mha__mat b, int64_t rb, int64_t n) {
    double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += mha__ld(a, ra, i) * mha__ld(b, rb, i);
        s1 += mha__ld(a, ra, i + 1) * mha__ld(b, rb, i + 1);
        s2 += mha__ld(a, ra, i + 2) * mha__ld(b, rb, i + 2);
        s3 += mha__ld(a, ra, i + 3) * mha__ld(b, rb, i + 3);
    }
    for (; i < n; i++) s0 += mha__ld(a, ra, i) * mha__ld(b, rb, i);
    return (s0 + s1) + (s2 + s3);
}

void mha__ref_linear_row(mha__mat y, mha__mat x, const void *W, mha_dtype wdt, const float *b,
                         int64_t I, int64_t O) {
    const mha__mat w = mha__vmat((void *)W, wdt, I, 1);
    for (int64_t o = 0; o < O; o++) {
        double acc = dot(x, 0, w, o, I);
        if (b) acc += b[o];
        mha__st(y, 0, o, acc);
    }
}

double mha__ref_logit(const mha__mask *mk, double scaled, int64_t b, int64_t h, int64_t i,
                      int64_t j) {
    if (mk->softcap > 0.0f)
        scaled = (double)mk->softcap * mha__softcap_tanh64(scaled, (double)mk->softcap);
    return scaled + mha__mask_value(mk, b, h, i, j);
}

void mha__ref_softmax_row(double *row, int64_t S, double sink) {
    double mx = sink;  // (-inf without a sink)
    bool nan = isnan(sink);
    for (int64_t j = 0; j < S; j++) {
        if (isnan(row[j])) nan = true;
        else if (row[j] > mx) mx = row[j];
    }
    if (nan) {  // a NaN score makes the whole row NaN, as in PyTorch
        for (int64_t j = 0; j < S; j++) row[j] = NAN;
        return;
    }
    if (mx == -INFINITY) {
        for (int64_t j = 0; j < S; j++) row[j] = 0.0;
        return;
    }
    // the sink joins the denominator: exp(sink - mx) (0 without one)
    double sum = sink > -INFINITY ? exp(sink - mx) : 0.0;
    for (int64_t j = 0; j < S; j++) {
        row[j] = exp(row[j] - mx);
        sum += row[j];
    }
    for (int64_t j = 0; j < S; j++) row[j] /= sum;
}

// Query head h's sink logit, or -inf without sinks.
static double sink_of(const mha__mask *mk, int64_t h) {
    return mk->sinks ? (double)mk->sinks[h] : -INFINITY;
}

// Passes the (rows, cols) doubles of m (row stride ld) to the trace.
static void trace_doubles(const mha__trace *tr, const char *step, int64_t b, int64_t h,
                          const double *m, int64_t rows, int64_t cols, int64_t ld) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) tr->buf[r * cols + c] = (float)m[r * ld + c];
    int64_t shape[2] = {rows, cols};
    mha_tensor t = mha_tensor_contiguous(tr->buf, MHA_F32, 2, shape);
    tr->fn(tr->user, step, b, h, &t);
}

// Steps (1)-(3) of the forward for one (b, h): P (L, S) in P, row-major.
static void attention_probs(double *P, mha__mat q, mha__mat k, int64_t L, int64_t S, int64_t D,
                            double scale, const mha__mask *mk, int64_t b, int64_t h,
                            const mha__trace *tr) {
    // (1) scores (L, S) = q (L, D) k (S, D)^T
    for (int64_t i = 0; i < L; i++)
        for (int64_t j = 0; j < S; j++) P[i * S + j] = dot(q, i, k, j, D);
    if (tr) trace_doubles(tr, "scores", b, h, P, L, S, S);

    // (2) scale (and soft-cap), then add the masks (-inf for hidden keys,
    //     never 0) and ALiBi
    for (int64_t i = 0; i < L; i++)
        for (int64_t j = 0; j < S; j++)
            P[i * S + j] = mha__ref_logit(mk, scale * P[i * S + j], b, h, i, j);
    if (tr) trace_doubles(tr, "scaled_scores", b, h, P, L, S, S);

    // (3) softmax of each row: subtract the row max so exp never overflows;
    //     a row with every score -inf (all keys masked) becomes all 0. An
    //     attention sink joins each row's denominator (rows sum to < 1).
    for (int64_t i = 0; i < L; i++) mha__ref_softmax_row(P + i * S, S, sink_of(mk, h));
    if (tr) trace_doubles(tr, "weights", b, h, P, L, S, S);
}

// The dropout factor of weight (i, j): 0 (dropped) or 1 / (1 - p).
static double drop_factor(const mha__dropout *d, int64_t b, int64_t h, int64_t i, int64_t j) {
    uint64_t idx = (uint64_t)(((b * d->H + h) * d->L + i) * d->S + j);
    return mha__dropout_keep(d->seed, d->offset, MHA__DROPOUT_STREAM_ATTN_LO,
                             MHA__DROPOUT_STREAM_ATTN_HI, idx, d->p)
               ? 1.0 / (1.0 - (double)d->p)
               : 0.0;
}

// (3b) dropout after the softmax, in place on P (L, S).
static void apply_dropout(double *P, const mha__dropout *d, int64_t L, int64_t S, int64_t b,
                          int64_t h) {
    if (!d) return;
    for (int64_t i = 0; i < L; i++)
        for (int64_t j = 0; j < S; j++) P[i * S + j] *= drop_factor(d, b, h, i, j);
}

// out (L, Dv) = P (L, S) v (S, Dv), P row-major.
static void weigh_values(mha__mat out, const double *P, mha__mat v, int64_t L, int64_t S,
                         int64_t Dv) {
    for (int64_t i = 0; i < L; i++)
        for (int64_t c = 0; c < Dv; c++) {
            double acc = 0.0;
            for (int64_t j = 0; j < S; j++) acc += P[i * S + j] * mha__ld(v, j, c);
            mha__st(out, i, c, acc);
        }
}

void mha__ref_attention_head(mha__mat out, mha__mat w, mha__mat q, mha__mat k, mha__mat v,
                             int64_t L, int64_t S, int64_t D, int64_t Dv, double scale,
                             const mha__mask *mk, const mha__dropout *drop, int64_t b,
                             int64_t h, double *P, const mha__trace *tr) {
    attention_probs(P, q, k, L, S, D, scale, mk, b, h, tr);
    apply_dropout(P, drop, L, S, b, h);
    if (w.p)
        for (int64_t i = 0; i < L; i++)
            for (int64_t j = 0; j < S; j++) mha__st(w, i, j, P[i * S + j]);

    // (4) out (L, Dv) = P (L, S) v (S, Dv)
    weigh_values(out, P, v, L, S, Dv);
    if (tr) {
        for (int64_t i = 0; i < L; i++)
            for (int64_t c = 0; c < Dv; c++) tr->buf[i * Dv + c] = (float)mha__ld(out, i, c);
        int64_t shape[2] = {L, Dv};
        mha_tensor t = mha_tensor_contiguous(tr->buf, MHA_F32, 2, shape);
        tr->fn(tr->user, "context", b, h, &t);
    }
}

void mha__ref_attention_head_backward(mha__mat dq, mha__mat dk, mha__mat dv, mha__mat out,
                                      mha__mat dout, mha__mat q, mha__mat k, mha__mat v,
                                      int64_t L, int64_t S, int64_t D, int64_t Dv, double scale,
                                      const mha__mask *mk, const mha__dropout *drop, int64_t b,
                                      int64_t h, double *ws, double *dsink) {
    double *P = ws;           // (L, S): softmax, then P' after dropout
    double *dP = ws + L * S;  // (L, S): dP', then dP, then dS
    attention_probs(P, q, k, L, S, D, scale, mk, b, h, NULL);

    // dP' = dout v^T  (forward: out = P' v)
    for (int64_t i = 0; i < L; i++)
        for (int64_t j = 0; j < S; j++) dP[i * S + j] = dot(dout, i, v, j, Dv);
    // dP = dP' * keep / (1 - p)  (forward: P' = P * keep / (1 - p))
    if (drop)
        for (int64_t i = 0; i < L; i++)
            for (int64_t j = 0; j < S; j++) dP[i * S + j] *= drop_factor(drop, b, h, i, j);
    // dS = P * (dP - sum_j P dP)  (forward: P = softmax(S) row by row);
    // masked entries have P = 0, so dS = 0 there and on fully masked rows.
    // A sink is one more logit of the softmax whose value is 0 (its dP is
    // 0): dsink = sum_i P_sink,i (0 - rs_i), P_sink,i = 1 - sum_j P_ij
    // (0 exactly for a sink of -inf).
    const bool sink = mk->sinks && mk->sinks[h] > -INFINITY;
    double ds = 0.0;
    for (int64_t i = 0; i < L; i++) {
        double rs = 0.0, psum = 0.0;
        for (int64_t j = 0; j < S; j++)
            rs += P[i * S + j] * dP[i * S + j], psum += P[i * S + j];
        for (int64_t j = 0; j < S; j++) dP[i * S + j] = P[i * S + j] * (dP[i * S + j] - rs);
        if (sink) ds -= (1.0 - psum) * rs;
    }
    if (dsink) *dsink = ds;
    // soft cap: dS_raw = dS * (1 - tanh^2(s / cap)) for the raw scaled s
    if (mk->softcap > 0.0f)
        for (int64_t i = 0; i < L; i++)
            for (int64_t j = 0; j < S; j++) {
                const double t = mha__softcap_tanh64(scale * dot(q, i, k, j, D),
                                                     (double)mk->softcap);
                dP[i * S + j] *= 1.0 - t * t;
            }
    apply_dropout(P, drop, L, S, b, h);  // P' for dv and the forward output

    // dv (S, Dv) = P'^T dout  (forward: out = P' v)
    for (int64_t j = 0; j < S; j++)
        for (int64_t c = 0; c < Dv; c++) {
            double acc = 0.0;
            for (int64_t i = 0; i < L; i++) acc += P[i * S + j] * mha__ld(dout, i, c);
            mha__st(dv, j, c, acc);
        }
    if (out.p) weigh_values(out, P, v, L, S, Dv);
    // dq (L, D) = scale * dS k  (forward: S = scale * q k^T + mask)
    for (int64_t i = 0; i < L; i++)
        for (int64_t c = 0; c < D; c++) {
            double acc = 0.0;
            for (int64_t j = 0; j < S; j++) acc += dP[i * S + j] * mha__ld(k, j, c);
            mha__st(dq, i, c, scale * acc);
        }
    // dk (S, D) = scale * dS^T q
    for (int64_t j = 0; j < S; j++)
        for (int64_t c = 0; c < D; c++) {
            double acc = 0.0;
            for (int64_t i = 0; i < L; i++) acc += dP[i * S + j] * mha__ld(q, i, c);
            mha__st(dk, j, c, scale * acc);
        }
}
