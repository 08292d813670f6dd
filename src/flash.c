// flash.c: the fused attention driver for one (b, h) and a tile of query
// rows. For each tile of keys:
//   S (br, bc) = (scale q) k^T          gemm over a packed k^T tile
//   S += masks                          (-inf; causal by column bound)
//   online softmax per row: m, l, and alpha = exp(m_old - m_new)
//   O = alpha O + P v                   (P after dropout, when training)
// then O /= l and lse = m + log(l). Tiles entirely above the causal
// diagonal are skipped. Extra memory: the scratch below, O(BR*BC + D*BC).
#include <math.h>
#include <string.h>

#include "flash.h"
#include "philox.h"

// Scratch layout (floats): qs (BR, D) | kt (D, BC) | s (BR, BC) | m, l (BR)
size_t mha__flash_scratch_floats(int64_t D, int64_t Dv) {
    (void)Dv;
    return (size_t)(MHA__FLASH_BR * D + D * MHA__FLASH_BC +
                    MHA__FLASH_BR * MHA__FLASH_BC + 2 * MHA__FLASH_BR);
}

// kt (D, n) = rows [j0, j0 + n) of the keys (main, or extra when j0 >= S)
static void pack_kt(float *kt, const mha__flash_head *a, int64_t j0, int64_t n) {
    for (int64_t j = 0; j < n; j++) {
        int64_t jj = j0 + j;
        const float *kr = jj < a->S ? a->k + jj * a->k_rs : a->xk + (jj - a->S) * a->D;
        for (int64_t c = 0; c < a->D; c++) kt[c * n + j] = kr[c];
    }
}

// S (br, n) = qs kt + masks for rows [i0, i0 + br) and keys [j0, j0 + n).
static void scores(const mha__kernels *kt, const mha__flash_head *a, float *s,
                   const float *qs, float *ktile, int64_t i0, int64_t br,
                   int64_t j0, int64_t n) {
    pack_kt(ktile, a, j0, n);
    kt->gemm_nn(s, n, qs, a->D, ktile, n, br, n, a->D);
    if (j0 >= a->S) return;  // appended keys are never masked
    const mha__mask *mk = a->mask;
    if (mk->attn || mk->kpm) {
        for (int64_t r = 0; r < br; r++)
            for (int64_t j = 0; j < n; j++)
                s[r * n + j] += (float)mha__mask_value(mk, a->b, a->h, i0 + r, j0 + j);
    } else if (mk->causal) {
        for (int64_t r = 0; r < br; r++)
            for (int64_t j = i0 + r + 1 - j0; j < n; j++)
                if (j >= 0) s[r * n + j] = -INFINITY;
    }
}

// Key tiles: [0, S) in BC steps (causal: up to the last visible key), then
// the nx appended keys as one more tile.
static int64_t key_end(const mha__flash_head *a, int64_t i1) {
    return a->mask->causal && i1 < a->S ? i1 : a->S;
}

static void drop_row(const mha__flash_head *a, float *row, int64_t i, int64_t j0,
                     int64_t n) {
    const mha__dropout *d = a->drop;
    const float f = 1.0f / (1.0f - d->p);
    uint64_t base = (uint64_t)(((a->b * d->H + a->h) * d->L + i) * d->S + j0);
    for (int64_t j = 0; j < n; j++)
        row[j] *= mha__dropout_keep(d->seed, d->offset, MHA__DROPOUT_STREAM_ATTN_LO,
                                    MHA__DROPOUT_STREAM_ATTN_HI, base + (uint64_t)j, d->p)
                      ? f
                      : 0.0f;
}

void mha__flash_rows(const mha__kernels *kt, const mha__flash_head *a,
                     int64_t i0, int64_t i1, float *scratch) {
    const int64_t br = i1 - i0, D = a->D, Dv = a->Dv;
    float *qs = scratch, *ktile = qs + MHA__FLASH_BR * D,
          *s = ktile + D * MHA__FLASH_BC, *m = s + MHA__FLASH_BR * MHA__FLASH_BC,
          *l = m + MHA__FLASH_BR;
    for (int64_t r = 0; r < br; r++) {
        for (int64_t c = 0; c < D; c++) qs[r * D + c] = a->scale * a->q[(i0 + r) * a->q_rs + c];
        for (int64_t c = 0; c < Dv; c++) a->o[(i0 + r) * a->o_rs + c] = 0.0f;
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    const int64_t send = key_end(a, i1), total = a->S + a->nx;
    for (int64_t j0 = 0; j0 < total;) {
        if (j0 >= send && j0 < a->S) j0 = a->S;  // causal: skip hidden tiles
        if (j0 >= total) break;
        int64_t n = j0 < a->S ? (send - j0 < MHA__FLASH_BC ? send - j0 : MHA__FLASH_BC)
                              : a->nx;
        scores(kt, a, s, qs, ktile, i0, br, j0, n);
        for (int64_t r = 0; r < br; r++) {
            float alpha = kt->softmax_update(s + r * n, n, &m[r], &l[r]);
            if (alpha != 1.0f) kt->scale_row(a->o + (i0 + r) * a->o_rs, Dv, alpha);
            if (a->drop) drop_row(a, s + r * n, i0 + r, j0, n);
        }
        const float *vb = j0 < a->S ? a->v + j0 * a->v_rs : a->xv;
        kt->gemm_nn_acc(a->o + i0 * a->o_rs, a->o_rs, s, n, vb,
                        j0 < a->S ? a->v_rs : Dv, br, Dv, n);
        j0 += n;
    }
    for (int64_t r = 0; r < br; r++) {
        float *o = a->o + (i0 + r) * a->o_rs;
        if (l[r] > 0.0f) {
            kt->scale_row(o, Dv, 1.0f / l[r]);
        } else if (!(l[r] == 0.0f)) {  // NaN: keep it
        } else {  // every key masked: the fully-masked-row rule
            for (int64_t c = 0; c < Dv; c++) o[c] = 0.0f;
        }
        if (a->lse) a->lse[i0 + r] = l[r] > 0.0f ? m[r] + logf(l[r]) : (l[r] == 0.0f ? -INFINITY : NAN);
    }
}

void mha__flash_weights(const mha__kernels *kt, const mha__flash_head *a,
                        int64_t i0, int64_t i1, mha__mat w, float *scratch) {
    const int64_t br = i1 - i0, D = a->D, total = a->S + a->nx;
    float *qs = scratch, *ktile = qs + MHA__FLASH_BR * D, *s = ktile + D * MHA__FLASH_BC;
    for (int64_t r = 0; r < br; r++)
        for (int64_t c = 0; c < D; c++) qs[r * D + c] = a->scale * a->q[(i0 + r) * a->q_rs + c];
    for (int64_t j0 = 0; j0 < total;) {
        int64_t n = j0 < a->S ? (a->S - j0 < MHA__FLASH_BC ? a->S - j0 : MHA__FLASH_BC) : a->nx;
        scores(kt, a, s, qs, ktile, i0, br, j0, n);
        for (int64_t r = 0; r < br; r++) {
            float lse = a->lse[i0 + r], *row = s + r * n;
            for (int64_t j = 0; j < n; j++)
                row[j] = lse == -INFINITY ? 0.0f : expf(row[j] - lse);
            if (a->drop) drop_row(a, row, i0 + r, j0, n);
            for (int64_t j = 0; j < n; j++) mha__st(w, r, j0 + j, row[j]);
        }
        j0 += n;
    }
}
