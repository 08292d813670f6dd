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
// for r and head dim d; rotate one token's H heads (head h at x + h * hs,
// features contiguous) at position pos, in place (inverse: by -angle).
int64_t mha__rope_dim(const mha_rope *r, int64_t d);
void mha__rope_inv_freq(double *inv_freq, const mha_rope *r, int64_t d);
void mha__rope_token_f(float *x, int64_t hs, int64_t H, const mha_rope *r, int64_t d,
                       const double *inv_freq, double pos, bool inverse);
void mha__rope_token_d(double *x, int64_t hs, int64_t H, const mha_rope *r, int64_t d,
                       const double *inv_freq, double pos, bool inverse);
// The ALiBi paper's slopes for H heads.
void mha__alibi_slopes(float *slopes, int64_t H);
// A forward's RoPE (N batch elements, H heads of dim d), ALiBi and soft cap
// arguments: checked, and the soft cap and the slopes (a's, or the default
// ones computed into alibi_default, MHA__ALIBI_MAX_DEFAULT floats) set in mk.
mha_status mha__check_rope_alibi(mha__mask *mk, float *alibi_default,
                                 const mha_forward_args *a, int64_t N, int64_t H, int64_t d);

#endif
