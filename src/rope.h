// rope.h: RoPE and ALiBi maths (rope.c; base layer: it uses check, mask
// and view only).
#ifndef MHA_ROPE_H
#define MHA_ROPE_H

#include <stdbool.h>

#include "internal.h"
#include "mask.h"

// Heads for which a forward computes the default ALiBi slopes itself
// (more need alibi_slopes); rotated half-dims a forward supports.
#define MHA__ALIBI_MAX_DEFAULT 1024
#define MHA__ROPE_MAX_HALF 4096

// RoPE: the rotated dims of r for head dim d; inv_freq (dim / 2 doubles)
// for r and head dim d (unscaled); rotate one token's H heads (head h at
// x + h * hs, features contiguous) at position pos, in place, cos and sin
// multiplied by af (1: none; inverse: the transpose af R(-angle), the
// gradient of the forward rotation).
int64_t mha__rope_dim(const mha_rope *r, int64_t d);
void mha__rope_inv_freq(double *inv_freq, const mha_rope *r, int64_t d);
void mha__rope_token_f(float *x, int64_t hs, int64_t H, const mha_rope *r, int64_t d,
                       const double *inv_freq, double af, double pos, bool inverse);
void mha__rope_token_d(double *x, int64_t hs, int64_t H, const mha_rope *r, int64_t d,
                       const double *inv_freq, double af, double pos, bool inverse);
// RoPE scaling s (NULL or type NONE: none) for RoPE r with dim rotated
// dims: every field checked (MHA_ERR_INVALID_ARG naming it and its value).
mha_status mha__check_rope_scaling(const mha_rope_scaling *s, const mha_rope *r, int64_t dim);
// mha_rope_frequencies without the checks (r and s already checked): the
// call's inv_freq (dim / 2) and cos/sin factor, for head dim d and a call
// whose largest position + 1 is seq (dynamic NTK).
void mha__rope_freqs(double *inv_freq, double *attention_factor, const mha_rope *r,
                     const mha_rope_scaling *s, int64_t d, int64_t seq);
// The position of token t of batch element n of a forward whose query has
// L tokens: rope_positions[n L + t] when given, else rope_start[n] + t
// (rope_start NULL: t).
static inline int64_t mha__rope_pos(const mha_forward_args *a, int64_t L, int64_t n, int64_t t) {
    if (a->rope_positions) return a->rope_positions[n * L + t];
    return (a->rope_start ? a->rope_start[n] : 0) + t;
}
// The ALiBi paper's slopes for H heads.
void mha__alibi_slopes(float *slopes, int64_t H);
// A forward's RoPE (N batch elements, query length L, key length S, H
// heads of dim d: mode, dims, theta, rope_scaling, rope_positions or
// rope_start), ALiBi and soft cap arguments: checked; the soft cap and the
// slopes (a's, or the default ones computed into alibi_default,
// MHA__ALIBI_MAX_DEFAULT floats) set in mk; rope_seq: the call's largest
// RoPE position + 1 (0 without RoPE), what dynamic NTK scaling decides from.
mha_status mha__check_rope_alibi(mha__mask *mk, float *alibi_default, int64_t *rope_seq,
                                 const mha_forward_args *a, int64_t N, int64_t L, int64_t S,
                                 int64_t H, int64_t d);
// The ALiBi slopes o asks for over H query heads: o->alibi_slopes (each
// checked finite), the paper's computed into buf (MHA__ALIBI_MAX_DEFAULT
// floats) when only o->alibi is set, or NULL (none); and o->sinks, when
// given, checked (finite or -inf). who names the caller in messages.
mha_status mha__attn_logit_params(const float **slopes, float *buf, const mha_attn_opts *o,
                                  int64_t H, const char *who);

#endif
