// rope.c: position encodings (base layer). RoPE (Su et al., RoFormer,
// https://arxiv.org/abs/2104.09864; NeoX's half-split and GPT-J's
// interleaved pairs): the public mha_rope_* calls on (B, H, T, D) views and
// the per-token rotation the reference (double) and the fused path (float)
// apply to their q and k rows; ALiBi (Press et al.,
// https://arxiv.org/abs/2108.12409): the default slopes; and the check of a
// forward's RoPE/ALiBi/soft-cap arguments into its mask.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "rope.h"
#include "view.h"


void mha_rope_init(mha_rope *r, mha_rope_mode mode) {
    if (!r) return;
    r->mode = mode;
    r->theta = 10000.0;
    r->dim = 0;
}

mha_status mha_rope_mode_from_name(mha_rope_mode *mode, const char *name) {
    if (!mode || !name) return mha__fail(MHA_ERR_INVALID_ARG, "rope mode: NULL argument");
    if (strcmp(name, "none") == 0) *mode = MHA_ROPE_NONE;
    else if (strcmp(name, "neox") == 0) *mode = MHA_ROPE_NEOX;
    else if (strcmp(name, "interleaved") == 0) *mode = MHA_ROPE_INTERLEAVED;
    else {
        char e[64];
        return mha__fail(MHA_ERR_UNSUPPORTED,
                         "rope mode %s: expected neox, interleaved or none",
                         mha_escape(e, sizeof e, name));
    }
    return MHA_OK;
}

int64_t mha__rope_dim(const mha_rope *r, int64_t d) { return r->dim == 0 ? d : r->dim; }

void mha__rope_inv_freq(double *inv_freq, const mha_rope *r, int64_t d) {
    const int64_t dim = mha__rope_dim(r, d);
    for (int64_t i = 0; i < dim / 2; i++)
        inv_freq[i] = pow(r->theta, -2.0 * (double)i / (double)dim);
}

#define ROPE_TOKEN(NAME, T)                                                        \
    void NAME(T *x, int64_t hs, int64_t H, const mha_rope *r, int64_t d,           \
              const double *inv_freq, double pos, bool inverse) {                  \
        const int64_t half = mha__rope_dim(r, d) / 2;                              \
        const bool neox = r->mode == MHA_ROPE_NEOX;                                \
        for (int64_t i = 0; i < half; i++) {                                       \
            const double ang = pos * inv_freq[i], c = cos(ang);                    \
            const double s = inverse ? -sin(ang) : sin(ang);                       \
            const int64_t c0 = neox ? i : 2 * i, c1 = neox ? i + half : 2 * i + 1; \
            for (int64_t h = 0; h < H; h++) {                                      \
                T *y = x + h * hs;                                                 \
                const double a = y[c0], e = y[c1];                                 \
                y[c0] = (T)(a * c - e * s);                                        \
                y[c1] = (T)(e * c + a * s);                                        \
            }                                                                      \
        }                                                                          \
    }
ROPE_TOKEN(mha__rope_token_f, float)
ROPE_TOKEN(mha__rope_token_d, double)

// The ALiBi paper's slopes (Press et al., and BLOOM's implementation): for a
// power of 2, 2^(-8 (h + 1) / H); otherwise those of the closest lower power
// of 2 n, then every other slope of 2n.
void mha__alibi_slopes(float *slopes, int64_t H) {
    int64_t n = 1;
    while (n * 2 <= H) n *= 2;
    for (int64_t h = 0; h < n; h++)
        slopes[h] = (float)pow(2.0, -8.0 * (double)(h + 1) / (double)n);
    for (int64_t h = n, i = 0; h < H; h++, i += 2)
        slopes[h] = (float)pow(2.0, -8.0 * (double)(i + 1) / (double)(2 * n));
}

mha_status mha_rope_apply(mha_tensor *x, const mha_rope *r, const int64_t *start, bool inverse) {
    if (!x || !r) return mha__fail(MHA_ERR_INVALID_ARG, "mha_rope_apply: NULL argument");
    mha_status st = mha__check_float(x, "x");
    if (st) return st;
    if (x->ndim != 4) {
        char s[160];
        return mha__fail(MHA_ERR_SHAPE, "rope: x must be (B, H, T, D), got %s",
                         mha__shape_str(s, sizeof s, x->ndim, x->shape));
    }
    if (r->mode != MHA_ROPE_NONE && r->mode != MHA_ROPE_NEOX && r->mode != MHA_ROPE_INTERLEAVED)
        return mha__fail(MHA_ERR_INVALID_ARG, "rope: unknown mode %d", (int)r->mode);
    const int64_t B = x->shape[0], H = x->shape[1], T = x->shape[2], D = x->shape[3];
    const int64_t dim = r->dim == 0 ? D : r->dim;
    if (r->mode == MHA_ROPE_NONE) return MHA_OK;
    if (dim < 0 || dim > D || dim % 2 != 0)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "rope: rotated dims %lld must be even and at most the head dim %lld",
                         (long long)r->dim, (long long)D);
    if (!(r->theta > 0.0) || !isfinite(r->theta))
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "rope: theta must be positive and finite, got %g", r->theta);
    if (start)
        for (int64_t b = 0; b < B; b++)
            if (start[b] < 0)
                return mha__fail(MHA_ERR_INVALID_ARG, "rope: start[%lld] = %lld is negative",
                                 (long long)b, (long long)start[b]);
    const int64_t half = dim / 2;
    const bool f64 = x->dtype == MHA_F64;
    double *inv = mha__malloc(sizeof(double) * (size_t)(half > 0 ? half : 1));
    if (!inv)
        return mha__fail(MHA_ERR_NOMEM, "rope: out of memory for %lld frequencies",
                         (long long)half);
    mha__rope_inv_freq(inv, r, D);
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++) {
            const double pos = (double)((start ? start[b] : 0) + t);
            for (int64_t i = 0; i < half; i++) {
                const double ang = pos * inv[i];
                const double c = cos(ang), s = inverse ? -sin(ang) : sin(ang);
                const int64_t c0 = r->mode == MHA_ROPE_NEOX ? i : 2 * i,
                              c1 = r->mode == MHA_ROPE_NEOX ? i + half : 2 * i + 1;
                for (int64_t h = 0; h < H; h++) {
                    const int64_t base = b * x->stride[0] + h * x->stride[1] + t * x->stride[2];
                    const int64_t o0 = base + c0 * x->stride[3], o1 = base + c1 * x->stride[3];
                    if (f64) {
                        double *p = x->data, a = p[o0], e = p[o1];
                        p[o0] = a * c - e * s;
                        p[o1] = e * c + a * s;
                    } else {  // float32, bfloat16 or float16 elements
                        const mha__mat xm = mha__vmat(x->data, x->dtype, 0, 1);
                        const double a = mha__ld(xm, 0, o0), e = mha__ld(xm, 0, o1);
                        mha__st(xm, 0, o0, (float)(a * c - e * s));
                        mha__st(xm, 0, o1, (float)(e * c + a * s));
                    }
                }
            }
        }
    free(inv);
    return MHA_OK;
}

mha_status mha__check_rope_alibi(mha__mask *mk, float *alibi_default,
                                 const mha_forward_args *a, int64_t N, int64_t H, int64_t d) {
    const mha_rope *r = &a->rope;
    if (r->mode != MHA_ROPE_NONE) {
        if (r->mode != MHA_ROPE_NEOX && r->mode != MHA_ROPE_INTERLEAVED)
            return mha__fail(MHA_ERR_INVALID_ARG, "rope: unknown mode %d", (int)r->mode);
        const int64_t dim = r->dim == 0 ? d : r->dim;
        if (dim <= 0 || dim > d || dim % 2 != 0 || dim / 2 > MHA__ROPE_MAX_HALF)
            return mha__fail(MHA_ERR_INVALID_ARG,
                             "rope: rotated dims %lld must be even, positive and at most "
                             "the head dim %lld",
                             (long long)dim, (long long)d);
        if (!(r->theta > 0.0) || !isfinite(r->theta))
            return mha__fail(MHA_ERR_INVALID_ARG,
                             "rope: theta must be positive and finite, got %g", r->theta);
        if (a->rope_start)
            for (int64_t n = 0; n < N; n++)
                if (a->rope_start[n] < 0)
                    return mha__fail(MHA_ERR_INVALID_ARG, "rope: rope_start[%lld] = %lld < 0",
                                     (long long)n, (long long)a->rope_start[n]);
    }
    mk->softcap = a->softcap;
    mk->alibi = NULL;
    if (a->alibi) {
        if (a->alibi_slopes) {
            for (int64_t h = 0; h < H; h++)
                if (!isfinite(a->alibi_slopes[h]))
                    return mha__fail(MHA_ERR_INVALID_ARG, "alibi_slopes[%lld] is not finite",
                                     (long long)h);
            mk->alibi = a->alibi_slopes;
        } else {
            if (H > MHA__ALIBI_MAX_DEFAULT)
                return mha__fail(MHA_ERR_UNSUPPORTED,
                                 "alibi: %lld heads; pass alibi_slopes for more than %d",
                                 (long long)H, MHA__ALIBI_MAX_DEFAULT);
            mha__alibi_slopes(alibi_default, H);
            mk->alibi = alibi_default;
        }
    }
    return MHA_OK;
}
