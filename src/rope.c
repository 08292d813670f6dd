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

// (M_PI is not C11)
#define ROPE_PI 3.14159265358979323846


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

// ---------------------------------------------------------------------------
// RoPE scaling: transformers' ROPE_INIT_FUNCTIONS (modeling_rope_utils.py:
// _compute_linear_scaling_rope_parameters, _compute_dynamic_ntk_parameters,
// _compute_yarn_parameters, _compute_llama3_parameters), in double where
// transformers computes the frequencies in float32.

void mha_rope_scaling_init(mha_rope_scaling *s, mha_rope_scaling_type type) {
    if (!s) return;
    memset(s, 0, sizeof *s);
    s->type = type;
    s->factor = 1.0;
    s->original_max_position = 0;
    s->low_freq_factor = 1.0;
    s->high_freq_factor = 4.0;
    s->beta_fast = 32.0;
    s->beta_slow = 1.0;
    s->truncate = true;
}

static const char *scaling_name(mha_rope_scaling_type t) {
    switch (t) {
    case MHA_ROPE_SCALING_NONE: return "none";
    case MHA_ROPE_SCALING_LINEAR: return "linear";
    case MHA_ROPE_SCALING_DYNAMIC: return "dynamic";
    case MHA_ROPE_SCALING_YARN: return "yarn";
    case MHA_ROPE_SCALING_LLAMA3: return "llama3";
    }
    return "unknown";
}

mha_status mha_rope_scaling_type_from_name(mha_rope_scaling_type *out, const char *name) {
    if (!out || !name)
        return mha__fail(MHA_ERR_INVALID_ARG, "rope scaling type: NULL argument");
    if (!strcmp(name, "default") || !strcmp(name, "none")) *out = MHA_ROPE_SCALING_NONE;
    else if (!strcmp(name, "linear")) *out = MHA_ROPE_SCALING_LINEAR;
    else if (!strcmp(name, "dynamic")) *out = MHA_ROPE_SCALING_DYNAMIC;
    else if (!strcmp(name, "yarn")) *out = MHA_ROPE_SCALING_YARN;
    else if (!strcmp(name, "llama3")) *out = MHA_ROPE_SCALING_LLAMA3;
    else {
        char e[64];
        return mha__fail(MHA_ERR_UNSUPPORTED,
                         "rope scaling type %s: expected default (none), linear, dynamic, "
                         "yarn or llama3",
                         mha_escape(e, sizeof e, name));
    }
    return MHA_OK;
}

// YaRN's mscale (get_mscale): 0.1 m ln(scale) + 1, 1 for scale <= 1.
static double yarn_mscale(double scale, double m) {
    return scale <= 1.0 ? 1.0 : 0.1 * m * log(scale) + 1.0;
}

// YaRN's cos/sin factor: attention_factor, or from mscale / mscale_all_dim
// when both are set (non-zero), else 0.1 ln(factor) + 1.
static double yarn_attention_factor(const mha_rope_scaling *s) {
    if (s->attention_factor != 0.0) return s->attention_factor;
    if (s->mscale != 0.0 && s->mscale_all_dim != 0.0)
        return yarn_mscale(s->factor, s->mscale) / yarn_mscale(s->factor, s->mscale_all_dim);
    return yarn_mscale(s->factor, 1.0);
}

mha_status mha__check_rope_scaling(const mha_rope_scaling *s, const mha_rope *r, int64_t dim) {
    if (!s || s->type == MHA_ROPE_SCALING_NONE) return MHA_OK;
    const char *tn = scaling_name(s->type);
    if (s->type < MHA_ROPE_SCALING_NONE || s->type > MHA_ROPE_SCALING_LLAMA3)
        return mha__fail(MHA_ERR_INVALID_ARG, "rope_scaling: unknown type %d", (int)s->type);
    if (!(s->factor > 0.0) || !isfinite(s->factor))
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "rope_scaling (%s): factor must be positive and finite, got %g", tn,
                         s->factor);
    if (s->type != MHA_ROPE_SCALING_LINEAR && s->original_max_position <= 0)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "rope_scaling (%s): original_max_position must be positive, got %lld",
                         tn, (long long)s->original_max_position);
    if (s->type == MHA_ROPE_SCALING_DYNAMIC && dim <= 2)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "rope_scaling (dynamic): needs more than 2 rotated dims (its exponent "
                         "is dim / (dim - 2)), got dim %lld",
                         (long long)dim);
    if (s->type == MHA_ROPE_SCALING_LLAMA3 &&
        (!(s->low_freq_factor > 0.0) || !isfinite(s->high_freq_factor) ||
         !(s->low_freq_factor < s->high_freq_factor)))
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "rope_scaling (llama3): needs 0 < low_freq_factor < high_freq_factor "
                         "(finite), got low_freq_factor %g, high_freq_factor %g",
                         s->low_freq_factor, s->high_freq_factor);
    if (s->type == MHA_ROPE_SCALING_YARN) {
        const double v[5] = {s->beta_fast, s->beta_slow, s->mscale, s->mscale_all_dim,
                             s->attention_factor};
        static const char *names[5] = {"beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                                       "attention_factor"};
        for (int i = 0; i < 5; i++)
            if (!isfinite(v[i]) || ((i < 2 || i == 4) && v[i] < 0.0))
                return mha__fail(MHA_ERR_INVALID_ARG,
                                 "rope_scaling (yarn): %s must be finite%s, got %g", names[i],
                                 i < 2 || i == 4 ? " and >= 0 (0: the default)" : "", v[i]);
        if (r->theta == 1.0)
            return mha__fail(MHA_ERR_INVALID_ARG,
                             "rope_scaling (yarn): needs theta != 1 (its correction dims divide "
                             "by ln theta)");
        const double af = yarn_attention_factor(s);
        if (!(af > 0.0) || !isfinite(af))
            return mha__fail(MHA_ERR_INVALID_ARG,
                             "rope_scaling (yarn): the attention factor %g (factor %g, mscale "
                             "%g, mscale_all_dim %g) must be positive and finite",
                             af, s->factor, s->mscale, s->mscale_all_dim);
    }
    return MHA_OK;
}

// YaRN's correction dim (find_correction_dim): the dim whose wavelength
// makes nrot rotations over the original length.
static double yarn_corr_dim(double nrot, double dim, double theta, double orig) {
    return dim * log(orig / (nrot * 2.0 * ROPE_PI)) / (2.0 * log(theta));
}

void mha__rope_freqs(double *inv_freq, double *attention_factor, const mha_rope *r,
                     const mha_rope_scaling *s, int64_t d, int64_t seq) {
    const int64_t dim = mha__rope_dim(r, d), half = dim / 2;
    const mha_rope_scaling_type type = s ? s->type : MHA_ROPE_SCALING_NONE;
    *attention_factor = 1.0;
    if (type == MHA_ROPE_SCALING_DYNAMIC) {
        // base' = base ((factor seq / orig) - (factor - 1))^(dim / (dim - 2)),
        // seq = max(seq, orig)
        const double orig = (double)s->original_max_position;
        const double sl = seq > s->original_max_position ? (double)seq : orig;
        const double base = r->theta * pow(s->factor * sl / orig - (s->factor - 1.0),
                                           (double)dim / (double)(dim - 2));
        for (int64_t i = 0; i < half; i++)
            inv_freq[i] = pow(base, -2.0 * (double)i / (double)dim);
        return;
    }
    mha__rope_inv_freq(inv_freq, r, d);
    if (type == MHA_ROPE_SCALING_LINEAR) {
        for (int64_t i = 0; i < half; i++) inv_freq[i] /= s->factor;
    } else if (type == MHA_ROPE_SCALING_YARN) {
        // inv = inv_i / factor (1 - e_i) + inv_i e_i, e_i = 1 - ramp_i: the
        // linear ramp between the correction dims of beta_fast and beta_slow
        const double bf = s->beta_fast != 0.0 ? s->beta_fast : 32.0,
                     bs = s->beta_slow != 0.0 ? s->beta_slow : 1.0,
                     orig = (double)s->original_max_position;
        double lo = yarn_corr_dim(bf, (double)dim, r->theta, orig),
               hi = yarn_corr_dim(bs, (double)dim, r->theta, orig);
        if (s->truncate) lo = floor(lo), hi = ceil(hi);
        if (lo < 0.0) lo = 0.0;
        if (hi > (double)(dim - 1)) hi = (double)(dim - 1);
        if (lo == hi) hi += 0.001;  // (transformers' guard against a singularity)
        for (int64_t i = 0; i < half; i++) {
            double ramp = ((double)i - lo) / (hi - lo);
            ramp = ramp < 0.0 ? 0.0 : ramp > 1.0 ? 1.0 : ramp;
            const double e = 1.0 - ramp;
            inv_freq[i] = inv_freq[i] / s->factor * (1.0 - e) + inv_freq[i] * e;
        }
        *attention_factor = yarn_attention_factor(s);
    } else if (type == MHA_ROPE_SCALING_LLAMA3) {
        // wavelength 2 pi / inv: below orig / high_freq_factor kept, above
        // orig / low_freq_factor divided by factor, blended in between
        const double orig = (double)s->original_max_position, lw = orig / s->low_freq_factor,
                     hw = orig / s->high_freq_factor;
        for (int64_t i = 0; i < half; i++) {
            const double f = inv_freq[i], wl = 2.0 * ROPE_PI / f;
            if (wl > lw) inv_freq[i] = f / s->factor;
            else if (!(wl < hw)) {
                const double sm = (orig / wl - s->low_freq_factor) /
                                  (s->high_freq_factor - s->low_freq_factor);
                inv_freq[i] = (1.0 - sm) * f / s->factor + sm * f;
            }
        }
    }
}

// The RoPE itself: mode, rotated dims (at most the head dim d), theta.
static mha_status check_rope(const mha_rope *r, int64_t d) {
    if (r->mode != MHA_ROPE_NONE && r->mode != MHA_ROPE_NEOX && r->mode != MHA_ROPE_INTERLEAVED)
        return mha__fail(MHA_ERR_INVALID_ARG, "rope: unknown mode %d", (int)r->mode);
    const int64_t dim = mha__rope_dim(r, d);
    if (dim <= 0 || dim > d || dim % 2 != 0)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "rope: rotated dims %lld must be even, positive and at most the head "
                         "dim %lld",
                         (long long)dim, (long long)d);
    if (!(r->theta > 0.0) || !isfinite(r->theta))
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "rope: theta must be positive and finite, got %g", r->theta);
    return MHA_OK;
}

mha_status mha_rope_frequencies(double *inv_freq, double *attention_factor, const mha_rope *r,
                                const mha_rope_scaling *s, int64_t head_dim, int64_t seq) {
    if (!inv_freq || !attention_factor || !r)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_rope_frequencies: NULL argument");
    if (head_dim <= 0)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "mha_rope_frequencies: head_dim must be positive, got %lld",
                         (long long)head_dim);
    if (seq < 0)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "mha_rope_frequencies: seq must be >= 0, got %lld", (long long)seq);
    mha_status st;
    if ((st = check_rope(r, head_dim)) ||
        (st = mha__check_rope_scaling(s, r, mha__rope_dim(r, head_dim))))
        return st;
    mha__rope_freqs(inv_freq, attention_factor, r, s, head_dim, seq);
    return MHA_OK;
}

#define ROPE_TOKEN(NAME, T)                                                        \
    void NAME(T *x, int64_t hs, int64_t H, const mha_rope *r, int64_t d,           \
              const double *inv_freq, double af, double pos, bool inverse) {       \
        const int64_t half = mha__rope_dim(r, d) / 2;                              \
        const bool neox = r->mode == MHA_ROPE_NEOX;                                \
        for (int64_t i = 0; i < half; i++) {                                       \
            const double ang = pos * inv_freq[i];                                  \
            double c = cos(ang), s = inverse ? -sin(ang) : sin(ang);               \
            if (af != 1.0) c *= af, s *= af;                                       \
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

mha_status mha_rope_apply(mha_tensor *x, const mha_rope *r, const mha_rope_scaling *sc,
                          const int64_t *start, const int64_t *positions, int64_t seq,
                          bool inverse) {
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
    if (r->mode == MHA_ROPE_NONE) {
        if (sc && sc->type != MHA_ROPE_SCALING_NONE)
            return mha__fail(MHA_ERR_INVALID_ARG,
                             "rope: a rope_scaling (type %s) needs a RoPE mode, got none",
                             scaling_name(sc->type));
        return MHA_OK;
    }
    if (dim < 0 || dim > D || dim % 2 != 0)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "rope: rotated dims %lld must be even and at most the head dim %lld",
                         (long long)r->dim, (long long)D);
    if (!(r->theta > 0.0) || !isfinite(r->theta))
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "rope: theta must be positive and finite, got %g", r->theta);
    if ((st = mha__check_rope_scaling(sc, r, dim))) return st;
    if (seq < 0)
        return mha__fail(MHA_ERR_INVALID_ARG, "rope: seq must be >= 0, got %lld",
                         (long long)seq);
    int64_t maxpos = -1;  // the largest position + 1 here (dynamic NTK's seq when 0)
    for (int64_t b = 0; b < B; b++) {
        if (positions) {
            for (int64_t t = 0; t < T; t++) {
                const int64_t v = positions[b * T + t];
                if (v < 0)
                    return mha__fail(MHA_ERR_INVALID_ARG,
                                     "rope: positions[%lld] = %lld is negative",
                                     (long long)(b * T + t), (long long)v);
                if (v > maxpos) maxpos = v;
            }
        } else if (start && start[b] < 0) {
            return mha__fail(MHA_ERR_INVALID_ARG, "rope: start[%lld] = %lld is negative",
                             (long long)b, (long long)start[b]);
        } else if (T > 0) {
            const int64_t s0 = start ? start[b] : 0;
            if (s0 > INT64_MAX - T)
                return mha__fail(MHA_ERR_INVALID_ARG, "rope: start[%lld] = %lld overflows",
                                 (long long)b, (long long)s0);
            if (s0 + T - 1 > maxpos) maxpos = s0 + T - 1;
        }
    }
    const int64_t half = dim / 2;
    const bool f64 = x->dtype == MHA_F64;
    double *inv = mha__malloc(sizeof(double) * (size_t)(half > 0 ? half : 1)), af;
    if (!inv)
        return mha__fail(MHA_ERR_NOMEM, "rope: out of memory for %lld frequencies",
                         (long long)half);
    mha__rope_freqs(inv, &af, r, sc, D, seq > 0 ? seq : maxpos + 1);
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++) {
            const double pos = (double)(positions ? positions[b * T + t]
                                                  : (start ? start[b] : 0) + t);
            for (int64_t i = 0; i < half; i++) {
                const double ang = pos * inv[i];
                double c = cos(ang), s = inverse ? -sin(ang) : sin(ang);
                if (af != 1.0) c *= af, s *= af;
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

mha_status mha__check_rope_alibi(mha__mask *mk, float *alibi_default, int64_t *rope_seq,
                                 const mha_forward_args *a, int64_t N, int64_t L, int64_t S,
                                 int64_t H, int64_t d) {
    const mha_rope *r = &a->rope;
    const mha_rope_scaling *sc = a->rope_scaling;
    *rope_seq = 0;
    if (r->mode == MHA_ROPE_NONE && sc && sc->type != MHA_ROPE_SCALING_NONE)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "rope_scaling (type %s) given without RoPE (rope.mode is none)",
                         scaling_name(sc->type));
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
        mha_status st = mha__check_rope_scaling(sc, r, dim);
        if (st) return st;
        // the call's largest position + 1 (dynamic NTK decides from it)
        int64_t maxpos = -1;
        if (a->rope_positions) {
            if (S != L)
                return mha__fail(MHA_ERR_INVALID_ARG,
                                 "rope_positions: the key must have the query's length "
                                 "(cross-attention: L %lld, S %lld); use rope_start",
                                 (long long)L, (long long)S);
            for (int64_t i = 0; i < N * L; i++) {
                const int64_t v = a->rope_positions[i];
                if (v < 0)
                    return mha__fail(MHA_ERR_INVALID_ARG,
                                     "rope_positions[%lld] = %lld < 0 (token %lld of batch "
                                     "element %lld)",
                                     (long long)i, (long long)v, (long long)(i % L),
                                     (long long)(i / L));
                if (v > maxpos) maxpos = v;
            }
        } else {
            const int64_t T = L > S ? L : S;
            for (int64_t n = 0; n < N; n++) {
                const int64_t s0 = a->rope_start ? a->rope_start[n] : 0;
                if (s0 < 0)
                    return mha__fail(MHA_ERR_INVALID_ARG, "rope: rope_start[%lld] = %lld < 0",
                                     (long long)n, (long long)s0);
                if (s0 > INT64_MAX - T)
                    return mha__fail(MHA_ERR_INVALID_ARG,
                                     "rope: rope_start[%lld] = %lld overflows", (long long)n,
                                     (long long)s0);
                if (T > 0 && s0 + T - 1 > maxpos) maxpos = s0 + T - 1;
            }
        }
        *rope_seq = maxpos + 1;
    }
    mk->softcap = a->opts.softcap;
    return mha__attn_logit_params(&mk->alibi, alibi_default, &a->opts, H, "mha_forward");
}

mha_status mha__attn_logit_params(const float **slopes, float *buf, const mha_attn_opts *o,
                                  int64_t H, const char *who) {
    *slopes = NULL;
    if (o->alibi_slopes) {
        for (int64_t h = 0; h < H; h++)
            if (!isfinite(o->alibi_slopes[h]))
                return mha__fail(MHA_ERR_INVALID_ARG, "%s: alibi_slopes[%lld] is not finite",
                                 who, (long long)h);
        *slopes = o->alibi_slopes;
    } else if (o->alibi) {
        if (H > MHA__ALIBI_MAX_DEFAULT)
            return mha__fail(MHA_ERR_UNSUPPORTED,
                             "%s: alibi: %lld heads; pass alibi_slopes for more than %d", who,
                             (long long)H, MHA__ALIBI_MAX_DEFAULT);
        mha__alibi_slopes(buf, H);
        *slopes = buf;
    }
    if (o->sinks)
        for (int64_t h = 0; h < H; h++)
            if (isnan(o->sinks[h]) || o->sinks[h] == INFINITY)
                return mha__fail(MHA_ERR_INVALID_ARG,
                                 "%s: sinks[%lld] is %g (expected finite, or -inf: none)", who,
                                 (long long)h, (double)o->sinks[h]);
    return MHA_OK;
}
