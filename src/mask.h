// mask.h: the one masking rule (base layer), shared by the reference, the
// flash tiles, the KV cache and the diagnostics: what mask the scores of
// (b, h, i, j) get from the attention mask, the key padding mask, causal
// and window bounds and ALiBi. Depends on internal.h only.
#ifndef MHA_MASK_H
#define MHA_MASK_H

#include <math.h>
#include <stdbool.h>

#include "internal.h"

// The logit rule of mha_attn_opts (mha.h), written once for the reference,
// the flash tiles and the decode kernels: after the scaling, the soft cap
// s <- cap * t with t = tanh(s / cap) (its derivative 1 - t^2), in float32
// and float64; then ALiBi's bias -slope |p - j| for a query at position p
// and key j; then the masks (mha__mask_value).
static inline float mha__softcap_tanh(float s, float cap) { return tanhf(s / cap); }
static inline double mha__softcap_tanh64(double s, double cap) { return tanh(s / cap); }
static inline double mha__alibi_bias(float slope, int64_t p, int64_t j) {
    const int64_t d = p - j;
    return -(double)slope * (double)(d < 0 ? -d : d);
}

// A mask over scores (b, h, i, j), the sum of up to three parts:
//  - attn: element at attn + b*attn_s[0] + h*attn_s[1] + i*attn_s[2] +
//    j*attn_s[3] (stride 0 broadcasts); bool/u8 nonzero -> -inf, f32/f64
//    added
//  - kpm: element at kpm + b*kpm_s[0] + j*kpm_s[1]; same dtype rule
//  - causal: -inf where j > i
//  - sliding window: -inf where j < i - win_left (win_left >= 0) or
//    j > i + win_right (win_right >= 0); -1: unbounded on that side
//  causal and window compare key j with the query's position i + q_off
//  (q_off > 0: the queries are the last rows of a longer sequence, as in
//  cached decoding; 0 for the module forward)
// Columns j >= s_masked are never masked (keys appended by add_bias_kv and
// add_zero_attn).
typedef struct mha__mask {
    const void *attn;
    mha_dtype attn_dtype;
    int64_t attn_s[4];
    const void *kpm;
    mha_dtype kpm_dtype;
    int64_t kpm_s[2];
    bool causal;
    int64_t win_left, win_right;
    int64_t q_off;
    // ALiBi: -alibi[h] * |i + q_off - j| added (NULL: none); both this and
    // the soft cap cover the appended keys too (they are logits, not masks)
    const float *alibi;
    // logit soft-capping: s <- softcap * tanh(s / softcap) on the scaled
    // scores, before any bias or mask (0: none)
    float softcap;
    int64_t s_masked;
    // attention sinks: sinks[h], one logit of query head h that joins every
    // row's softmax denominator and carries no value (NULL: none); it
    // changes no score (the mask value above does not include it)
    const float *sinks;
} mha__mask;

// The keys [*lo, *hi) of [0, S) that causal and window masks leave to row
// i (position i + q_off); empty when *lo >= *hi. Other masks apply inside.
void mha__mask_band(const mha__mask *mk, int64_t i, int64_t S, int64_t *lo, int64_t *hi);

// The additive mask value at (b, h, i, j): 0, -inf or the float sum (ALiBi
// included).
double mha__mask_value(const mha__mask *mk, int64_t b, int64_t h, int64_t i, int64_t j);

#endif
