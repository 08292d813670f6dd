// flash.c: the fused attention driver for one (b, h) and a tile of query
// rows. For each tile of keys:
//   S (br, bc) = (scale q) k^T          gemm over a packed k^T tile
//   S += masks                          (-inf; causal by column bound)
//   online softmax per row: m, l, and alpha = exp(m_old - m_new)
//   O = alpha O + P v                   (P after dropout, when training)
// then O /= l; m and 1/l are kept for the weights and the backward. Tiles entirely above the causal
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
        if (a->stats) {
            a->stats[2 * (i0 + r)] = m[r];
            a->stats[2 * (i0 + r) + 1] = l[r] == 0.0f ? 0.0f : 1.0f / l[r];
        }
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
            float *row = s + r * n;
            kt->exp_shift(row, n, a->stats[2 * (i0 + r)]);
            kt->scale_row(row, n, a->stats[2 * (i0 + r) + 1]);
            if (a->drop) drop_row(a, row, i0 + r, j0, n);
            for (int64_t j = 0; j < n; j++) mha__st(w, r, j0 + j, row[j]);
        }
        j0 += n;
    }
}

// ---------------------------------------------------------------------------
// Backward

// Scratch (floats): qs (BR, D) | kt (D, BC) | vt (Dv, BC) | s (BR, BC) |
// dp (BR, BC) | tr (BC, BR)
size_t mha__flash_bwd_scratch_floats(int64_t D, int64_t Dv) {
    return (size_t)(MHA__FLASH_BR * D + D * MHA__FLASH_BC + Dv * MHA__FLASH_BC +
                    3 * MHA__FLASH_BR * MHA__FLASH_BC);
}

// vt (Dv, n) = value rows [j0, j0 + n), transposed
static void pack_vt(float *vt, const mha__flash_head *a, int64_t j0, int64_t n) {
    for (int64_t j = 0; j < n; j++) {
        int64_t jj = j0 + j;
        const float *vr = jj < a->S ? a->v + jj * a->v_rs : a->xv + (jj - a->S) * a->Dv;
        for (int64_t c = 0; c < a->Dv; c++) vt[c * n + j] = vr[c];
    }
}

// For query rows [i0, i0 + br) and keys [j0, j0 + n): s <- P and
// dp <- dP = (dO v^T) * drop, recomputed from q, k, v and the stats. The same tile
// always gives the same bits (same kernels, same shapes), which the
// softmax backward below relies on.
static void bwd_tile(const mha__kernels *kt, const mha__flash_head *a,
                     const float *dO, int64_t do_rs, int64_t i0, int64_t br, int64_t j0,
                     int64_t n, float *qs, float *ktile, float *vtile, float *s, float *dp) {
    const int64_t D = a->D;
    for (int64_t r = 0; r < br; r++)
        for (int64_t c = 0; c < D; c++) qs[r * D + c] = a->scale * a->q[(i0 + r) * a->q_rs + c];
    scores(kt, a, s, qs, ktile, i0, br, j0, n);  // S = scale q k^T + mask
    for (int64_t r = 0; r < br; r++) {  // P = exp(S - m) / l
        kt->exp_shift(s + r * n, n, a->stats[2 * (i0 + r)]);
        kt->scale_row(s + r * n, n, a->stats[2 * (i0 + r) + 1]);
    }
    pack_vt(vtile, a, j0, n);
    kt->gemm_nn(dp, n, dO + i0 * do_rs, do_rs, vtile, n, br, n, a->Dv);  // dP' = dO v^T
    if (a->drop)  // dP = dP' * drop (the factor is 0 or 1/(1-p))
        for (int64_t r = 0; r < br; r++) drop_row(a, dp + r * n, i0 + r, j0, n);
}

// dp <- dS = P (dP - Dsum) row by row; then s <- P' = P * drop.
static void softmax_bwd(const mha__flash_head *a, const float *Dsum, int64_t i0,
                        int64_t br, int64_t j0, int64_t n, float *s, float *dp) {
    for (int64_t r = 0; r < br; r++) {
        float *pr = s + r * n, *dr = dp + r * n;
        const float dsum = Dsum[i0 + r];
        for (int64_t j = 0; j < n; j++) dr[j] = pr[j] * (dr[j] - dsum);
        if (a->drop) drop_row(a, pr, i0 + r, j0, n);
    }
}

// The query tiles that can see keys [j0, ...): causal hides rows i < j0.
static int64_t first_row(const mha__flash_head *a, int64_t j0) {
    if (!a->mask->causal || j0 >= a->S) return 0;
    return (j0 / MHA__FLASH_BR) * MHA__FLASH_BR;
}

void mha__flash_bwd_kv(const mha__kernels *kt, const mha__flash_head *a,
                       const float *dO, int64_t do_rs, const float *Dsum,
                       int64_t j0, int64_t n, float *dk, int64_t dk_rs,
                       float *dv, int64_t dv_rs, float *scratch) {
    const int64_t D = a->D, Dv = a->Dv;
    float *qs = scratch, *ktile = qs + MHA__FLASH_BR * D, *vtile = ktile + D * MHA__FLASH_BC,
          *s = vtile + Dv * MHA__FLASH_BC, *dp = s + MHA__FLASH_BR * MHA__FLASH_BC,
          *tr = dp + MHA__FLASH_BR * MHA__FLASH_BC;
    for (int64_t j = 0; j < n; j++) {
        for (int64_t c = 0; c < D; c++) dk[j * dk_rs + c] = 0.0f;
        for (int64_t c = 0; c < Dv; c++) dv[j * dv_rs + c] = 0.0f;
    }
    for (int64_t i0 = first_row(a, j0); i0 < a->L; i0 += MHA__FLASH_BR) {
        int64_t br = a->L - i0 < MHA__FLASH_BR ? a->L - i0 : MHA__FLASH_BR;
        bwd_tile(kt, a, dO, do_rs, i0, br, j0, n, qs, ktile, vtile, s, dp);
        softmax_bwd(a, Dsum, i0, br, j0, n, s, dp);
        // dv (n, Dv) += P'^T (n, br) dO (br, Dv)
        for (int64_t r = 0; r < br; r++)
            for (int64_t j = 0; j < n; j++) tr[j * br + r] = s[r * n + j];
        kt->gemm_nn_acc(dv, dv_rs, tr, br, dO + i0 * do_rs, do_rs, n, Dv, br);
        // dk (n, D) += dS^T (n, br) (scale q) (br, D)
        for (int64_t r = 0; r < br; r++)
            for (int64_t j = 0; j < n; j++) tr[j * br + r] = dp[r * n + j];
        kt->gemm_nn_acc(dk, dk_rs, tr, br, qs, D, n, D, br);
    }
}

void mha__flash_bwd_q(const mha__kernels *kt, const mha__flash_head *a,
                      const float *dO, int64_t do_rs, float *Dsum, int64_t i0,
                      int64_t i1, float *dq, int64_t dq_rs, float *scratch) {
    const int64_t D = a->D, Dv = a->Dv, br = i1 - i0, total = a->S + a->nx;
    float *qs = scratch, *ktile = qs + MHA__FLASH_BR * D, *vtile = ktile + D * MHA__FLASH_BC,
          *s = vtile + Dv * MHA__FLASH_BC, *dp = s + MHA__FLASH_BR * MHA__FLASH_BC;
    const int64_t send = key_end(a, i1);
    // Two sweeps over the key tiles: first Dsum_i = sum_j P_ij dP_ij from the
    // very tiles the dS use (so a one-hot row gets dS = 0 exactly, as the
    // textbook formula does), then dS and dq.
    for (int sweep = 0; sweep < 2; sweep++) {
        if (sweep == 0)
            for (int64_t r = 0; r < br; r++) Dsum[i0 + r] = 0.0f;
        else
            for (int64_t r = 0; r < br; r++)
                for (int64_t c = 0; c < D; c++) dq[r * dq_rs + c] = 0.0f;
        for (int64_t j0 = 0; j0 < total;) {
            if (j0 >= send && j0 < a->S) j0 = a->S;
            if (j0 >= total) break;
            int64_t n = j0 < a->S ? (send - j0 < MHA__FLASH_BC ? send - j0 : MHA__FLASH_BC) : a->nx;
            bwd_tile(kt, a, dO, do_rs, i0, br, j0, n, qs, ktile, vtile, s, dp);
            if (sweep == 0) {
                for (int64_t r = 0; r < br; r++) {
                    float acc = 0.0f;
                    for (int64_t j = 0; j < n; j++) acc += s[r * n + j] * dp[r * n + j];
                    Dsum[i0 + r] += acc;
                }
            } else {
                softmax_bwd(a, Dsum, i0, br, j0, n, s, dp);
                // dq (br, D) += dS (br, n) k (n, D), then * scale below
                const float *kb = j0 < a->S ? a->k + j0 * a->k_rs : a->xk;
                kt->gemm_nn_acc(dq, dq_rs, dp, n, kb, j0 < a->S ? a->k_rs : D, br, D, n);
            }
            j0 += n;
        }
    }
    for (int64_t r = 0; r < br; r++) kt->scale_row(dq + r * dq_rs, D, a->scale);
}
