// flash.h: the fused attention of one (b, h): tiles of queries against
// tiles of keys with an online softmax (FlashAttention,
// https://arxiv.org/abs/2205.14135 and https://arxiv.org/abs/2307.08691),
// never storing the (L, S) score matrix. Float32, through the kernel table
// (kernels/kernels.h).
#ifndef MHA_FLASH_H
#define MHA_FLASH_H

#include "kernels/kernels.h"
#include "ref.h"

#define MHA__FLASH_BR 64   // query rows per tile
#define MHA__FLASH_BC 128  // keys per tile

typedef struct mha__flash_head {
    const float *q;  // (L, D), row stride q_rs
    const float *k;  // (S, D), row stride k_rs
    const float *v;  // (S, Dv), row stride v_rs
    int64_t q_rs, k_rs, v_rs;
    // keys appended after the S keys (add_bias_kv, add_zero_attn): never
    // masked; xk (nx, D), xv (nx, Dv), contiguous
    const float *xk, *xv;
    int64_t nx;
    float *o;  // (L, Dv), row stride o_rs: overwritten
    int64_t o_rs;
    float *lse;  // (L) or NULL: log-sum-exp of each row's scores (-inf for
                 // a fully masked row)
    int64_t L, S, D, Dv;
    float scale;
    const mha__mask *mask;     // over the S keys (s_masked = S)
    const mha__dropout *drop;  // NULL: none; its S is S + nx
    int64_t b, h;
} mha__flash_head;

// Floats of scratch one call of mha__flash_rows needs.
size_t mha__flash_scratch_floats(int64_t D, int64_t Dv);

// Rows [i0, i1) of the head (at most MHA__FLASH_BR of them): O and lse.
// A fully masked row gets O = 0 and lse = -inf.
void mha__flash_rows(const mha__kernels *kt, const mha__flash_head *a,
                     int64_t i0, int64_t i1, float *scratch);

// The attention weights of rows [i0, i1) recomputed from lse (after a
// forward): w (i, j) = exp(scale q_i k_j + mask - lse_i) [* dropout],
// written through w (rows i - i0, columns j < S + nx).
void mha__flash_weights(const mha__kernels *kt, const mha__flash_head *a,
                        int64_t i0, int64_t i1, mha__mat w, float *scratch);

#endif
