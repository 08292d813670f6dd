// linear.c: the fused path's building blocks that are not inline
// (linear.h).
#include <math.h>
#include <string.h>

#include "linear.h"

// The keys appended by add_bias_kv / add_zero_attn, per KV head: extra
// (H, nx, d) for k (bias_k slice, then zeros), then (H, nx, d) for v; H
// the number of KV heads.
void mha__fill_extra(float *extra, const mha_module *m, int64_t H, int64_t nx, int64_t d) {
    for (int64_t h = 0; h < H; h++)
        for (int64_t x = 0; x < nx; x++)
            for (int64_t c = 0; c < d; c++) {
                bool bias_row = m->cfg.add_bias_kv && x == 0;
                extra[(h * nx + x) * d + c] = bias_row ? m->bias_k[h * d + c] : 0.0f;
                extra[(H * nx + h * nx + x) * d + c] = bias_row ? m->bias_v[h * d + c] : 0.0f;
            }
}

// C (R, O) = X (R, I) W^T + b (linear.h): W's packed form from the
// module's copy, else packed into Wp now.
void mha__linear_rows(const mha__kernels *kt, float *C, int64_t ldc, const float *X,
                      int64_t ldx, mha__wmat W, const float *b, int64_t R, int64_t I,
                      int64_t O, float *Wp, float *gs, int nt) {
    const uint16_t *Bh = W.dt != MHA_F32 ? mha__packs_find_bh(W.pk, W.p, O, I) : NULL;
    if (Bh) {  // half weights kept packed in their type: widened as they load
        mha__gemm_rows_packed_bh(kt, C, ldc, X, ldx, Bh, W.dt == MHA_BF16 ? 1 : 2, b, R, I, O,
                                 false, nt, gs);
        return;
    }
    const float *Bp = W.dt == MHA_F32 ? mha__packs_find(W.pk, W.p, O, I) : NULL;
    if (!Bp) {
        if (W.dt == MHA_F32) mha__gemm_pack_wt(kt, Wp, W.p, O, I, nt);
        else mha__gemm_pack_wt_half(kt, Wp, W.p, W.dt == MHA_BF16 ? 1 : 2, O, I, nt, W.wh);
        Bp = Wp;
    }
    mha__gemm_rows_packed(kt, C, ldc, X, ldx, Bp, b, R, I, O, false, nt, gs);
}

void mha__bf16_rows_in_place(const mha__kernels *kt, float *base, int64_t ld, int64_t R,
                             int64_t w, int nt) {
    const int64_t kp = kt->bf_kpad, Kp = (w + kp - 1) / kp * kp;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t r = 0; r < R; r++) {
        char *row = (char *)(base + r * ld);
        for (int64_t c0 = 0; c0 < w; c0 += 64) {
            float f[64];
            uint16_t h[64];
            const int64_t n = w - c0 < 64 ? w - c0 : 64;
            memcpy(f, row + 4 * c0, sizeof(float) * (size_t)n);
            kt->round_bf16(h, f, n);
            memcpy(row + 2 * c0, h, sizeof(uint16_t) * (size_t)n);
        }
        memset(row + 2 * w, 0, 2 * (size_t)(Kp - w));
    }
}

void mha__bf16_rows(const mha__kernels *kt, uint16_t *dst, int64_t ldd, const float *src,
                    int64_t ld, int64_t R, int64_t w, int nt) {
    const int64_t kp = kt->bf_kpad, Kp = (w + kp - 1) / kp * kp;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t r = 0; r < R; r++) {
        kt->round_bf16(dst + r * ldd, src + r * ld, w);
        memset(dst + r * ldd + w, 0, 2 * (size_t)(Kp - w));
    }
}

void mha__bf16_transpose(const mha__kernels *kt, uint16_t *dst, int64_t ldd, const float *src,
                         int64_t ld, int64_t R, int64_t w, int nt) {
    const int64_t kp = kt->bf_kpad, Rp = (R + kp - 1) / kp * kp;
    enum { T = 64 };
    const int64_t cb = (w + T - 1) / T;
    // blocks of T columns of src (rows of dst), each through a float32
    // (T, T) tile transposed by the table's kernel (exact), then its rows
    // rounded
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t b = 0; b < cb; b++) {
        const int64_t c0 = b * T, nc = w - c0 < T ? w - c0 : T;
        float t[T * T];
        for (int64_t r0 = 0; r0 < R; r0 += T) {
            const int64_t nr = R - r0 < T ? R - r0 : T;
            kt->transpose(t, T, src + r0 * ld + c0, ld, nr, nc);
            for (int64_t c = 0; c < nc; c++)
                kt->round_bf16(dst + (c0 + c) * ldd + r0, t + c * T, nr);
        }
        for (int64_t c = 0; c < nc; c++)
            memset(dst + (c0 + c) * ldd + R, 0, 2 * (size_t)(Rp - R));
    }
}

void mha__bf16_pack(const mha__kernels *kt, uint16_t *Bp, const uint16_t *B, int64_t sk,
                    int64_t sn, int64_t K, int64_t N, int nt) {
    // slices of K (whole bf_kpad blocks, 256 rows) over the threads: a
    // slice from row k0 is pack_bf16's output from element k0 Np
    const int64_t kp = kt->bf_kpad, Np = (N + 15) / 16 * 16, KS = (256 + kp - 1) / kp * kp;
    const int64_t ns = (K + KS - 1) / KS;
#pragma omp parallel for schedule(static) num_threads(ns > 1 ? nt : 1)
    for (int64_t i = 0; i < ns; i++) {
        const int64_t k0 = i * KS, n = K - k0 < KS ? K - k0 : KS;
        kt->pack_bf16(Bp + k0 * Np, B + k0 * sk, sk, sn, n, N);
    }
}

void mha__gemm_bf16_rows(const mha__kernels *kt, float *C, int64_t ldc, const uint16_t *A,
                         int64_t lda, const uint16_t *Bp, int64_t R, int64_t K, int64_t N,
                         bool acc, int nt) {
    const int64_t kp = kt->bf_kpad, Kp = (K + kp - 1) / kp * kp, mp = kt->bf_mpad;
    const int64_t Rw = R / mp * mp, Np = (N + 15) / 16 * 16;  // rows in whole bf_mpad blocks
    enum { PANEL = 256, KC = 256 };
    const int64_t blocks = (Rw + 63) / 64;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t blk = 0; blk < blocks; blk++) {  // 64 rows (or the rest of Rw)
        const int64_t r0 = blk * 64, m = Rw - r0 < 64 ? Rw - r0 : 64;
        for (int64_t j0 = 0; j0 < N; j0 += PANEL)
            kt->gemm_bf16(C + r0 * ldc + j0, ldc, A + r0 * lda, lda, Bp + 2 * j0, N, m,
                          N - j0 < PANEL ? N - j0 : PANEL, K, 1.0f, acc);
    }
    if (Rw < R) {  // the last rows, fewer than bf_mpad: a padded copy, k in chunks
        uint16_t t[16 * KC];
        for (int64_t k0 = 0; k0 < Kp; k0 += KC) {
            const int64_t kc = Kp - k0 < KC ? Kp - k0 : KC;
            memset(t, 0, sizeof t);
            for (int64_t r = Rw; r < R; r++)
                memcpy(t + (r - Rw) * KC, A + r * lda + k0, 2 * (size_t)kc);
            kt->gemm_bf16(C + Rw * ldc, ldc, t, KC, Bp + k0 / 2 * Np * 2, N, R - Rw, N, kc,
                          1.0f, acc || k0 > 0);
        }
    }
}

void mha__head_to_bf16(mha__flash_head *fh, const mha__rowmap *qm, const mha__rowmap *km,
                       const mha__rowmap *vm, bool packed) {
    const mha__rowmap *rm[3] = {qm, km, vm};
    const void **ptr[3] = {(const void **)&fh->q, (const void **)&fh->k, (const void **)&fh->v};
    int64_t *rs[3] = {&fh->q_rs, &fh->k_rs, &fh->v_rs};
    for (int i = 0; i < 3; i++) {
        const float *base = packed ? qm->base : rm[i]->base;  // the rounded matrix
        const int64_t ld = rm[i]->ld;
        const int64_t e = (const float *)*ptr[i] - base;  // float index of (row0, col)
        const int64_t row = e / ld, col = e % ld;
        *ptr[i] = (const uint16_t *)(const void *)base + 2 * row * ld + col;
        *rs[i] *= 2;
    }
    fh->q_half = fh->k_half = fh->v_half = 1;
}

bool mha__linear_rows_bf16(const mha__kernels *kt, float *C, int64_t ldc, float *X, int64_t ldx,
                           const uint16_t *W, const mha__packs *pk, const float *b, int64_t R,
                           int64_t I, int64_t O, float *Wp, size_t wp_floats, int nt) {
    const int64_t kp = kt->bf_kpad, Kp = (I + kp - 1) / kp * kp;
    const uint16_t *Bp = mha__packs_find_bf16(pk, W, O, I);
    if (I < 32 || 2 * Kp > 4 * ldx ||
        (!Bp && (size_t)mha__bf16_packed_elems(I, O, kp) > 2 * wp_floats))
        return false;
    // X's rows to bf16 in place, zero-padded to Kp
    mha__bf16_rows_in_place(kt, X, ldx, R, I, nt);
    mha__linear_bf16_rows(kt, C, ldc, (const uint16_t *)(const void *)X, 2 * ldx, W, pk, b, R,
                          I, O, (uint16_t *)(void *)Wp, nt);
    return true;
}

void mha__linear_bf16_rows(const mha__kernels *kt, float *C, int64_t ldc, const uint16_t *X,
                           int64_t lda, const uint16_t *W, const mha__packs *pk, const float *b,
                           int64_t R, int64_t I, int64_t O, uint16_t *Wp, int nt) {
    const uint16_t *Bp = mha__packs_find_bf16(pk, W, O, I);
    if (!Bp) {
        mha__bf16_pack(kt, Wp, W, 1, I, I, O, nt);  // B (I, O) = W^T
        Bp = Wp;
    }
    mha__gemm_bf16_rows(kt, C, ldc, X, lda, Bp, R, I, O, false, nt);
    if (b)
#pragma omp parallel for schedule(static) num_threads(nt)
        for (int64_t r = 0; r < R; r++)
            for (int64_t j = 0; j < O; j++) C[r * ldc + j] += b[j];
}

// The gates of a gated module's R query rows X (R, E), gate (R, H):
// head_gate[h] (static) or sigmoid(X W_g^T + b_g) (dynamic; W_g from pk,
// or packed into Wp, mha__gemm_packed_b_floats(kt, E, H) floats); and gctx
// (R, Eq) = each head's ctx (R, Eq) times its gate.
void mha__gate_rows(const mha__kernels *kt, float *gate, float *gctx, const float *ctx,
                    const mha_module *m, const mha__packs *pk, const float *X, int64_t ldx,
                    int64_t R, float *Wp, float *gs, int nt) {
    const int64_t E = m->cfg.embed_dim, Eq = m->q_dim, H = m->cfg.num_heads, d = m->head_dim;
    if (m->cfg.head_gate == MHA_GATE_DYNAMIC) {
        mha__linear_rows(kt, gate, H, X, ldx, mha__wmat_f32(m->gate_weight, pk), m->gate_bias,
                         R, E, H, Wp, gs, nt);
        for (int64_t i = 0; i < R * H; i++)
            gate[i] = (float)(1.0 / (1.0 + exp(-(double)gate[i])));
    } else {
        for (int64_t r = 0; r < R; r++)
            memcpy(gate + r * H, m->head_gate, (size_t)H * sizeof(float));
    }
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t r = 0; r < R; r++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t c = 0; c < d; c++)
                gctx[r * Eq + h * d + c] = ctx[r * Eq + h * d + c] * gate[r * H + h];
}

// C (R, N) = A (R, K) B (K, N) for a row-major B (row stride ldb), packed
// into Bp first.
void mha__matmul_rows(const mha__kernels *kt, float *C, int64_t ldc, const float *A,
                      int64_t lda, mha__wmat B, int64_t ldb, int64_t R, int64_t K, int64_t N,
                      float *Bp, float *gs, int nt) {
    if (B.dt == MHA_F32) mha__gemm_pack_rows(kt, Bp, B.p, ldb, K, N, nt);
    else mha__gemm_pack_rows_half(kt, Bp, B.p, B.dt == MHA_BF16 ? 1 : 2, ldb, K, N, nt, B.wh);
    mha__gemm_rows_packed(kt, C, ldc, A, lda, Bp, NULL, R, K, N, false, nt, gs);
}

// 1 / sqrt(mean(x^2) + eps) over the gs features of xg, summed in double.
static double inv_rms(const float *xg, int64_t gs, double eps) {
    double ms = 0.0;
    for (int64_t c = 0; c < gs; c++) ms += (double)xg[c] * (double)xg[c];
    return 1.0 / sqrt(ms / (double)gs + eps);
}

void mha__qk_norm_rows(float *x, int64_t ld, int64_t R, int64_t W, int64_t gs, const float *w,
                       double eps, int nt) {
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t r = 0; r < R; r++)
        for (int64_t g0 = 0; g0 < W; g0 += gs) {
            float *xg = x + r * ld + g0;
            const double rr = inv_rms(xg, gs, eps);
            for (int64_t c = 0; c < gs; c++)
                xg[c] = (float)((double)xg[c] * rr * (double)w[c]);
        }
}

void mha__qk_norm_rows_bwd(float *dx, int64_t ldd, const float *x, int64_t ldx, int64_t R,
                           int64_t W, int64_t gs, const float *w, double eps, float *dw,
                           bool acc, double *rr, int nt) {
    const int64_t ng = W / gs;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t r = 0; r < R; r++)  // each group's 1 / rms
        for (int64_t g = 0; g < ng; g++)
            rr[r * ng + g] = inv_rms(x + r * ldx + g * gs, gs, eps);
    if (dw) {  // dw[c] = sum over rows r, groups g of dy u, columns in blocks of 16
        const int64_t blocks = (gs + 15) / 16;
#pragma omp parallel for schedule(dynamic, 1) num_threads(blocks > 1 ? nt : 1)
        for (int64_t bl = 0; bl < blocks; bl++) {
            const int64_t c0 = bl * 16, n = gs - c0 < 16 ? gs - c0 : 16;
            double s[16] = {0};
            for (int64_t r = 0; r < R; r++)
                for (int64_t g = 0; g < ng; g++) {
                    const float *xg = x + r * ldx + g * gs + c0,
                                *dg = dx + r * ldd + g * gs + c0;
                    const double rg = rr[r * ng + g];
                    for (int64_t c = 0; c < n; c++)
                        s[c] += (double)dg[c] * ((double)xg[c] * rg);
                }
            for (int64_t c = 0; c < n; c++)
                dw[c0 + c] = acc ? dw[c0 + c] + (float)s[c] : (float)s[c];
        }
    }
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t r = 0; r < R; r++)
        for (int64_t g = 0; g < ng; g++) {
            const float *xg = x + r * ldx + g * gs;
            float *dg = dx + r * ldd + g * gs;
            const double rg = rr[r * ng + g];
            double s = 0.0;
            for (int64_t c = 0; c < gs; c++)
                s += (double)dg[c] * (double)w[c] * ((double)xg[c] * rg);
            s /= (double)gs;
            for (int64_t c = 0; c < gs; c++)
                dg[c] = (float)(rg * ((double)dg[c] * (double)w[c] - (double)xg[c] * rg * s));
        }
}

void mha__fused_qk_norm(const fwd_plan *p, const mha_module *m, const mha__rowmap *qm,
                        const mha__rowmap *km, int64_t Rq, int64_t Rk, float *keep) {
    const int64_t Eq = p->Eq, Ekv = p->Ekv;
    const bool head = m->cfg.qk_norm == MHA_QK_NORM_HEAD;
    const double eps = mha__qk_norm_eps(m);
    if (keep) {
        for (int64_t r = 0; r < Rq; r++)
            memcpy(keep + r * Eq, qm->base + r * qm->ld, sizeof(float) * (size_t)Eq);
        for (int64_t r = 0; r < Rk; r++)
            memcpy(keep + Rq * Eq + r * Ekv, km->base + r * km->ld, sizeof(float) * (size_t)Ekv);
    }
    mha__qk_norm_rows(qm->base, qm->ld, Rq, Eq, head ? p->d : Eq, m->q_norm, eps, p->nthreads);
    mha__qk_norm_rows(km->base, km->ld, Rk, Ekv, head ? p->d : Ekv, m->k_norm, eps, p->nthreads);
}

// RoPE on the first T tokens of each batch element of a q or k row matrix
// (all H heads of a token contiguous: p->H for q, p->Hkv for k), or its
// inverse (gradients).
void mha__rope_rows(const fwd_plan *p, const mha_forward_args *a, const mha__rowmap *rm,
                    int64_t T, int64_t H, bool inverse, const int64_t *pos) {
    if (a->rope.mode == MHA_ROPE_NONE) return;
    double inv[MHA__ROPE_MAX_HALF], af;
    mha__rope_freqs(inv, &af, &a->rope, a->rope_scaling, p->d, p->rope_seq);
#pragma omp parallel for schedule(static) num_threads(p->nthreads)
    for (int64_t n = 0; n < p->N; n++) {
        const int64_t s0 = a->rope_start ? a->rope_start[n] : 0;
        float *row0 = mha__head_row0(rm, n, 0);
        for (int64_t t = 0; t < T; t++) {
            // rope_positions (the same for q and k: T == p->L), else
            // rope_start[n] + pos[t]
            const int64_t ps = a->rope_positions ? a->rope_positions[n * p->L + t]
                                                 : s0 + (pos ? pos[t] : t);
            mha__rope_token_f(row0 + t * mha__head_rs(rm), p->d, H, &a->rope, p->d, inv, af,
                              (double)ps, inverse);
        }
    }
}


// The (query tile, key tile) pairs whose scores rows [i0, i1) of a head
// compute (the key tiles flash.c visits).
int64_t mha__key_tiles(const mha__flash_head *fh, int64_t i0, int64_t i1) {
    int64_t lo, hi;
    mha__flash_key_range(fh, i0, i1, &lo, &hi);
    return (lo < hi ? (hi - 1) / MHA__FLASH_BC - lo / MHA__FLASH_BC + 1 : 0) + (fh->nx > 0);
}

mha__flash_head mha__plan_head(const fwd_plan *p, const mha__rowmap *qm, const mha__rowmap *km,
                               const mha__rowmap *vm, const mha__rowmap *om,
                               const float *extra, float *stats, int64_t b, int64_t h) {
    const int64_t d = p->d, g = h / (p->H / p->Hkv), nx = extra ? p->Sp - p->S : 0;
    return (mha__flash_head){
        .q = mha__head_row0(qm, b, h * d),
        .q_rs = mha__head_rs(qm),
        .k = mha__head_row0(km, b, g * d),
        .k_rs = mha__head_rs(km),
        .v = mha__head_row0(vm, b, g * d),
        .v_rs = mha__head_rs(vm),
        .xk = extra ? extra + g * nx * d : NULL,
        .xv = extra ? extra + (p->Hkv + g) * nx * d : NULL,
        .nx = nx,
        .o = mha__head_row0(om, b, h * d),
        .o_rs = mha__head_rs(om),
        .stats = stats ? stats + 2 * (b * p->H + h) * p->L : NULL,
        .L = p->L,
        .S = p->S,
        .D = d,
        .Dv = d,
        .scale = (float)p->scale,
        .mask = &p->mask,
        .drop = mha__plan_drop(p),
        .b = b,
        .h = h,
    };
}
