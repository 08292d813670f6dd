// test_half_sdpa: mha_sdpa on bfloat16 and float16 views takes the fused
// path (auto), never the reference. bf16 q, k, v on a table that computes
// bf16 (amx; on the others forced, mha__flash_force_bf16) compute S and
// P v in bf16 with P rounded: their output is within the float32 bound
// plus 2^-8 max|v| (twice P's rounding) of float64, the weights within
// the float32 bound, and the same bits with 1, 2 and 8 threads. Other
// views compute in float32 what it computes for float32 views holding the
// same (converted) values:
//   - a half output is that float32 output rounded once (nearest even),
//     bit for bit; a float32 output from half inputs is it exactly; so are
//     the attention weights (half or float32);
//   - against the float64 reference on the same rounded inputs, the error
//     is the output's rounding (half an ulp of the half type) plus the
//     float32 path's own (4e-6 (1 + max|ref|));
//   - the same bits with 1, 2 and 8 threads;
//   - mha_sdpa_backward likewise: half dout, dq, dk, dv are the float32
//     path's gradients on the same values, rounded once; bf16 q, k, v and
//     dout where the forward computes in bf16: the bf16 backward (P' and
//     scale dS rounded to bf16 for the products), the same bits with 1, 2
//     and 8 threads, within a sanity bound of the float32 gradients (max
//     |diff| <= 2^-6 (1 + max|g|), relative RMS <= 2^-7; the accuracy rule,
//     error <= 2x PyTorch's bf16 backward, is checked by
//     tests/python/test_sdpa.py on the machines that compute in bf16);
//   - mha_last_impl() names the fused path for F32, BF16 and F16 views and
//     the reference for F64 ones, and an explicit reference stays one.
// Over causal, windows, key padding and float masks, GQA, D != Dv, dropout
// and mixed types (half q, float32 k, half out, ...).
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "check.h"
#include "flash.h"
#include "mha.h"
#include "util.h"

static uint16_t to_half(float x, mha_dtype dt) {
    return dt == MHA_BF16 ? mha_f32_to_bf16(x) : mha_f32_to_f16(x);
}
static float from_half(uint16_t h, mha_dtype dt) {
    return dt == MHA_BF16 ? mha_bf16_to_f32(h) : mha_f16_to_f32(h);
}

// A buffer of n elements of dt holding x (rounded to dt); x itself becomes
// the values the buffer holds (as float32).
static void *as_dtype(float *x, int64_t n, mha_dtype dt) {
    if (dt == MHA_F32) {
        float *p = malloc(sizeof(float) * (size_t)n);
        memcpy(p, x, sizeof(float) * (size_t)n);
        return p;
    }
    uint16_t *p = malloc(sizeof(uint16_t) * (size_t)n);
    for (int64_t i = 0; i < n; i++) {
        p[i] = to_half(x[i], dt);
        x[i] = from_half(p[i], dt);
    }
    return p;
}

static float elem(const void *p, mha_dtype dt, int64_t i) {
    return dt == MHA_F32 ? ((const float *)p)[i] : from_half(((const uint16_t *)p)[i], dt);
}

// The first i < n where got (of dt) is not f32[i] rounded once to dt
// (float32: not f32[i] itself), bit for bit; -1: none.
static int64_t first_unrounded(const void *got, mha_dtype dt, const float *f32, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float want = dt == MHA_F32 ? f32[i] : from_half(to_half(f32[i], dt), dt);
        const float g = elem(got, dt, i);
        if (memcmp(&want, &g, sizeof want) != 0) return i;
    }
    return -1;
}

static void set_threads(int n) {
#ifdef _OPENMP
    omp_set_num_threads(n);
#else
    (void)n;
#endif
}

typedef struct hcase {
    int64_t B, H, Hkv, L, S, D, Dv;
    bool causal, kpm, attn, dropout, weights;
    int64_t win;  // -1: none
    mha_dtype qd, kd, vd, od;
} hcase;

static const char *dn(mha_dtype d) { return mha_dtype_name(d); }

static bool g_bf_seen;      // a case computed in bf16 (printed once)
static double g_bwd_worst;  // the bf16 backward's error / bound, worst case

static void run_case(const hcase *c, int id) {
    const int64_t B = c->B, H = c->H, Hkv = c->Hkv, L = c->L, S = c->S, D = c->D, Dv = c->Dv;
    const int64_t nq = B * H * L * D, nk = B * Hkv * S * D, nv = B * Hkv * S * Dv,
                  no = B * H * L * Dv, nw = B * H * L * S;
    float *q = malloc(sizeof(float) * (size_t)nq), *k = malloc(sizeof(float) * (size_t)nk),
          *v = malloc(sizeof(float) * (size_t)nv);
    for (int64_t i = 0; i < nq; i++) q[i] = 2.0f * frand();
    for (int64_t i = 0; i < nk; i++) k[i] = 2.0f * frand();
    for (int64_t i = 0; i < nv; i++) v[i] = frand();
    void *qh = as_dtype(q, nq, c->qd), *kh = as_dtype(k, nk, c->kd),
         *vh = as_dtype(v, nv, c->vd);
    mha_tensor qt = mha_tensor_contiguous(qh, c->qd, 4, (int64_t[]){B, H, L, D});
    mha_tensor kt = mha_tensor_contiguous(kh, c->kd, 4, (int64_t[]){B, Hkv, S, D});
    mha_tensor vt = mha_tensor_contiguous(vh, c->vd, 4, (int64_t[]){B, Hkv, S, Dv});
    // the same values as float32 and float64 views
    mha_tensor q32 = mha_tensor_contiguous(q, MHA_F32, 4, (int64_t[]){B, H, L, D});
    mha_tensor k32 = mha_tensor_contiguous(k, MHA_F32, 4, (int64_t[]){B, Hkv, S, D});
    mha_tensor v32 = mha_tensor_contiguous(v, MHA_F32, 4, (int64_t[]){B, Hkv, S, Dv});
    double *q64 = malloc(sizeof(double) * (size_t)nq),
           *k64 = malloc(sizeof(double) * (size_t)nk),
           *v64 = malloc(sizeof(double) * (size_t)nv);
    for (int64_t i = 0; i < nq; i++) q64[i] = q[i];
    for (int64_t i = 0; i < nk; i++) k64[i] = k[i];
    for (int64_t i = 0; i < nv; i++) v64[i] = v[i];
    mha_tensor qd = mha_tensor_contiguous(q64, MHA_F64, 4, (int64_t[]){B, H, L, D});
    mha_tensor kd = mha_tensor_contiguous(k64, MHA_F64, 4, (int64_t[]){B, Hkv, S, D});
    mha_tensor vd = mha_tensor_contiguous(v64, MHA_F64, 4, (int64_t[]){B, Hkv, S, Dv});
    // masks
    uint8_t *kpm = malloc((size_t)(B * S));
    for (int64_t i = 0; i < B * S; i++) kpm[i] = (next() % 5) == 0;
    for (int64_t b = 0; b < B; b++) kpm[b * S] = 0;  // (no row left fully masked by it)
    float *am = malloc(sizeof(float) * (size_t)(L * S));
    for (int64_t i = 0; i < L * S; i++) am[i] = 0.5f * frand();
    mha_tensor kpmt = mha_tensor_contiguous(kpm, MHA_BOOL, 2, (int64_t[]){B, S});
    mha_tensor amt = mha_tensor_contiguous(am, MHA_F32, 2, (int64_t[]){L, S});
    mha_sdpa_args a;
    mha_sdpa_args_init(&a);
    a.opts.is_causal = c->causal;
    a.key_padding_mask = c->kpm ? &kpmt : NULL;
    a.attn_mask = c->attn ? &amt : NULL;
    a.opts.window_left = c->win;
    if (c->dropout) a.opts.dropout_p = 0.25f, a.opts.dropout_seed = 7 + (uint64_t)id;
    char desc[200];
    snprintf(desc, sizeof desc,
             "case %d (B %lld H %lld/%lld L %lld S %lld D %lld/%lld%s%s%s%s win %lld; q %s k %s "
             "v %s out %s)",
             id, (long long)B, (long long)H, (long long)Hkv, (long long)L, (long long)S,
             (long long)D, (long long)Dv, c->causal ? " causal" : "", c->kpm ? " kpm" : "",
             c->attn ? " attn_mask" : "", c->dropout ? " dropout" : "", (long long)c->win,
             dn(c->qd), dn(c->kd), dn(c->vd), dn(c->od));
    // 1. float32 views of the same values: the fused path's bits
    float *o32 = malloc(sizeof(float) * (size_t)no), *w32 = malloc(sizeof(float) * (size_t)nw);
    mha_tensor o32t = mha_tensor_contiguous(o32, MHA_F32, 4, (int64_t[]){B, H, L, Dv});
    mha_tensor w32t = mha_tensor_contiguous(w32, MHA_F32, 4, (int64_t[]){B, H, L, S});
    a.q = &q32, a.k = &k32, a.v = &v32;
    a.impl = MHA_IMPL_FUSED;
    CHECK_OK(mha_sdpa(&o32t, c->weights ? &w32t : NULL, &a));
    // 2. the half views, auto, with 1, 2 and 8 threads
    const size_t osz = c->od == MHA_F32 ? 4 : 2;
    void *oh[3], *wh[3];
    const int threads[3] = {1, 2, 8};
    a.q = &qt, a.k = &kt, a.v = &vt;
    a.impl = MHA_IMPL_AUTO;
    for (int r = 0; r < 3; r++) {
        set_threads(threads[r]);
        oh[r] = calloc((size_t)no, osz);
        wh[r] = calloc((size_t)nw, osz);
        mha_tensor ot = mha_tensor_contiguous(oh[r], c->od, 4, (int64_t[]){B, H, L, Dv});
        mha_tensor wt = mha_tensor_contiguous(wh[r], c->od, 4, (int64_t[]){B, H, L, S});
        CHECK_OK(mha_sdpa(&ot, c->weights ? &wt : NULL, &a));
        CHECKF(strncmp(mha_last_impl(), "fused ", 6) == 0, "%s: auto ran \"%s\", not fused",
               desc, mha_last_impl());
    }
    // bf16 q, k, v on a CPU that multiplies bf16: products in bf16 (P
    // rounded), so not the float32 path's bits; bounded below instead
    const bool bf = strstr(mha_last_impl(), " bf16") != NULL;
    CHECKF(!bf || (c->qd == MHA_BF16 && c->kd == MHA_BF16 && c->vd == MHA_BF16),
           "%s: \"%s\" computed in bf16 with other types", desc, mha_last_impl());
    if (bf && !g_bf_seen) printf("bf16 q, k, v: %s\n", mha_last_impl());
    g_bf_seen |= bf;
    set_threads(2);
    for (int r = 1; r < 3; r++) {
        CHECKF(memcmp(oh[0], oh[r], osz * (size_t)no) == 0,
               "%s: output bits differ at %d threads", desc, threads[r]);
        if (c->weights)
            CHECKF(memcmp(wh[0], wh[r], osz * (size_t)nw) == 0,
                   "%s: weights bits differ at %d threads", desc, threads[r]);
    }
    // the float32 path's bits, rounded once
    int64_t bad = bf ? -1 : first_unrounded(oh[0], c->od, o32, no);
    CHECKF(bad < 0, "%s: output %lld is not the float32 path's rounded: %a vs %a", desc,
           (long long)bad, bad < 0 ? 0.0 : (double)elem(oh[0], c->od, bad),
           bad < 0 ? 0.0 : (double)o32[bad]);
    if (c->weights && !bf) {
        bad = first_unrounded(wh[0], c->od, w32, nw);
        CHECKF(bad < 0, "%s: weight %lld is not the float32 path's rounded", desc,
               (long long)bad);
    }
    // 3. against the float64 reference on the same values (no dropout: the
    // reference's keep mask is the same, but keep the bound simple)
    if (!c->dropout) {
        double *o64 = malloc(sizeof(double) * (size_t)no);
        double *w64 = malloc(sizeof(double) * (size_t)nw);
        mha_tensor o64t = mha_tensor_contiguous(o64, MHA_F64, 4, (int64_t[]){B, H, L, Dv});
        mha_tensor w64t = mha_tensor_contiguous(w64, MHA_F64, 4, (int64_t[]){B, H, L, S});
        a.q = &qd, a.k = &kd, a.v = &vd;
        CHECK_OK(mha_sdpa(&o64t, c->weights ? &w64t : NULL, &a));
        CHECKF(strcmp(mha_last_impl(), "reference") == 0, "%s: F64 views ran \"%s\"", desc,
               mha_last_impl());
        double mref = 0, over = 0, worst = 0, vmax = 0;
        for (int64_t i = 0; i < no; i++) mref = fmax(mref, fabs(o64[i]));
        for (int64_t i = 0; i < nv; i++) vmax = fmax(vmax, fabs(v[i]));
        const double half_ulp = c->od == MHA_BF16 ? 0x1p-8 : c->od == MHA_F16 ? 0x1p-11 : 0.0;
        for (int64_t i = 0; i < no; i++) {
            const double e = fabs((double)elem(oh[0], c->od, i) - o64[i]);
            // the output's rounding (relative half ulp; subnormal f16: its
            // spacing) and the float32 path's own error; bf16 compute: P
            // rounded to bf16 (relative 2^-9 per weight: 2^-9 max|v|),
            // twice that
            const double bnd = half_ulp * fabs(o64[i]) + (c->od == MHA_F16 ? 0x1p-25 : 0.0) +
                               4e-6 * (1.0 + mref) + (bf ? 0x1p-8 * vmax : 0.0);
            over = fmax(over, e - bnd);
            worst = fmax(worst, e / bnd);
        }
        CHECKF(over <= 0.0, "%s: against float64 over its bound by %g (worst err/bound %g)",
               desc, over, worst);
        // bf16 compute: the weights are float32 softmaxes of its float32
        // scores (the output's rounding and float32's error)
        for (int64_t i = 0; bf && c->weights && i < nw; i++) {
            const double e = fabs((double)elem(wh[0], c->od, i) - w64[i]);
            const double bnd = half_ulp * w64[i] + (c->od == MHA_F16 ? 0x1p-25 : 0.0) + 4e-6;
            CHECKF(e <= bnd, "%s: weight %lld off float64 by %g > %g", desc, (long long)i, e,
                   bnd);
            if (e > bnd) break;
        }
        free(o64), free(w64);
    }
    // 4. the backward: half dout (out's type) and dq, dk, dv (q's, k's,
    // v's): the float32 path's gradients on the same values, each rounded
    // once; fused; the same bits with 1, 2 and 8 threads
    {
        float *g = malloc(sizeof(float) * (size_t)no);
        for (int64_t i = 0; i < no; i++) g[i] = frand();
        void *gh = as_dtype(g, no, c->od);
        mha_tensor gt = mha_tensor_contiguous(gh, c->od, 4, (int64_t[]){B, H, L, Dv});
        mha_tensor g32 = mha_tensor_contiguous(g, MHA_F32, 4, (int64_t[]){B, H, L, Dv});
        const int64_t n3[3] = {nq, nk, nv};
        const mha_dtype t3[3] = {c->qd, c->kd, c->vd};
        const char *nm[3] = {"dq", "dk", "dv"};
        float *f[3];
        void *hg[3][3];
        for (int j = 0; j < 3; j++) f[j] = malloc(sizeof(float) * (size_t)n3[j]);
        mha_tensor f0 = mha_tensor_contiguous(f[0], MHA_F32, 4, (int64_t[]){B, H, L, D});
        mha_tensor f1 = mha_tensor_contiguous(f[1], MHA_F32, 4, (int64_t[]){B, Hkv, S, D});
        mha_tensor f2 = mha_tensor_contiguous(f[2], MHA_F32, 4, (int64_t[]){B, Hkv, S, Dv});
        a.q = &q32, a.k = &k32, a.v = &v32;
        a.impl = MHA_IMPL_FUSED;
        CHECK_OK(mha_sdpa_backward(&f0, &f1, &f2, NULL, &g32, &a));
        a.q = &qt, a.k = &kt, a.v = &vt;
        a.impl = MHA_IMPL_AUTO;
        bool bbf = false;
        for (int r = 0; r < 3; r++) {
            set_threads(threads[r]);
            for (int j = 0; j < 3; j++)
                hg[r][j] = calloc((size_t)n3[j], t3[j] == MHA_F32 ? 4 : 2);
            mha_tensor h0 = mha_tensor_contiguous(hg[r][0], c->qd, 4, (int64_t[]){B, H, L, D});
            mha_tensor h1 = mha_tensor_contiguous(hg[r][1], c->kd, 4, (int64_t[]){B, Hkv, S, D});
            mha_tensor h2 = mha_tensor_contiguous(hg[r][2], c->vd, 4,
                                                  (int64_t[]){B, Hkv, S, Dv});
            CHECK_OK(mha_sdpa_backward(&h0, &h1, &h2, NULL, &gt, &a));
            CHECKF(strncmp(mha_last_impl(), "fused ", 6) == 0, "%s: backward ran \"%s\"", desc,
                   mha_last_impl());
            bbf = strstr(mha_last_impl(), " bf16") != NULL;
        }
        // the bf16 backward exactly where the forward computed in bf16 and
        // dout is bf16 too
        CHECKF(bbf == (bf && c->od == MHA_BF16), "%s: backward \"%s\" (forward bf16: %d)",
               desc, mha_last_impl(), (int)bf);
        set_threads(2);
        for (int j = 0; j < 3; j++) {
            const size_t bytes = (size_t)n3[j] * (t3[j] == MHA_F32 ? 4 : 2);
            for (int r = 1; r < 3; r++)
                CHECKF(memcmp(hg[0][j], hg[r][j], bytes) == 0,
                       "%s: %s bits differ at %d threads", desc, nm[j], threads[r]);
            if (bbf) {  // the bf16 backward: a sanity bound against float32's
                double gmax = 0, md = 0, num = 0, den = 0;
                for (int64_t i = 0; i < n3[j]; i++) {
                    const double x = elem(hg[0][j], t3[j], i), y = f[j][i];
                    gmax = fmax(gmax, fabs(y));
                    md = fmax(md, fabs(x - y));
                    num += (x - y) * (x - y), den += y * y;
                }
                const double rms = sqrt(num / (den > 0 ? den : 1));
                g_bwd_worst = fmax(g_bwd_worst, fmax(md / (0x1p-6 * (1 + gmax)), rms / 0x1p-7));
                CHECKF(md <= 0x1p-6 * (1 + gmax) && rms <= 0x1p-7,
                       "%s: bf16 %s off the float32 gradients: max %g (bound %g), relative RMS "
                       "%g (bound %g)",
                       desc, nm[j], md, 0x1p-6 * (1 + gmax), rms, 0x1p-7);
                continue;
            }
            const int64_t bj = first_unrounded(hg[0][j], t3[j], f[j], n3[j]);
            CHECKF(bj < 0, "%s: %s %lld is not the float32 path's rounded: %a vs %a", desc,
                   nm[j], (long long)bj, bj < 0 ? 0.0 : (double)elem(hg[0][j], t3[j], bj),
                   bj < 0 ? 0.0 : (double)f[j][bj]);
        }
        for (int j = 0; j < 3; j++) {
            free(f[j]);
            for (int r = 0; r < 3; r++) free(hg[r][j]);
        }
        free(g), free(gh);
    }
    // 5. an explicit reference stays the reference
    {
        a.q = &qt, a.k = &kt, a.v = &vt;
        a.impl = MHA_IMPL_REFERENCE;
        mha_tensor ot = mha_tensor_contiguous(oh[1], c->od, 4, (int64_t[]){B, H, L, Dv});
        CHECK_OK(mha_sdpa(&ot, NULL, &a));
        CHECKF(strcmp(mha_last_impl(), "reference") == 0, "%s: impl reference ran \"%s\"",
               desc, mha_last_impl());
    }
    for (int r = 0; r < 3; r++) free(oh[r]), free(wh[r]);
    free(q), free(k), free(v), free(qh), free(kh), free(vh), free(q64), free(k64), free(v64);
    free(kpm), free(am), free(o32), free(w32);
}

// The KV caches (contiguous, f32 and bf16 storage; paged) attended by bf16
// and f16 queries, out in q's type or float32, decode (T 1) and a prefill
// chunk (T 20): the float32 attend on the converted queries, its output
// rounded once into out, bit for bit; fused.
static void test_cache_half(void) {
    const int64_t B = 2, Hkv = 2, H = 4, D = 16, S = 40;
    float *k = malloc(sizeof(float) * (size_t)(B * Hkv * S * D)),
          *v = malloc(sizeof(float) * (size_t)(B * Hkv * S * D));
    for (int64_t i = 0; i < B * Hkv * S * D; i++) k[i] = frand(), v[i] = frand();
    mha_tensor kt = mha_tensor_contiguous(k, MHA_F32, 4, (int64_t[]){B, Hkv, S, D});
    mha_tensor vt = mha_tensor_contiguous(v, MHA_F32, 4, (int64_t[]){B, Hkv, S, D});
    int checks = 0;
    for (int store = 0; store < 3; store++) {  // f32, bf16 storage; paged (f32)
        mha_kv_cache *c = NULL;
        mha_paged_cache *pc = NULL;
        int64_t ids[2];
        if (store < 2) {
            CHECK_OK(mha_kv_cache_create(&c, B, Hkv, D, D, 64,
                                         store ? MHA_KV_BF16 : MHA_KV_F32));
            CHECK_OK(mha_kv_cache_append(c, &kt, &vt, NULL));
        } else {
            CHECK_OK(mha_paged_cache_create(&pc, 64, 8, Hkv, D, D, MHA_KV_F32,
                                            MHA_PAGED_HEAD_MAJOR));
            CHECK_OK(mha_paged_cache_add(pc, &ids[0]));
            CHECK_OK(mha_paged_cache_add(pc, &ids[1]));
            CHECK_OK(mha_paged_cache_append(pc, 2, ids, NULL, &kt, &vt, NULL));
        }
        for (int ti = 0; ti < 2; ti++) {
            const int64_t T = ti ? 20 : 1, n = B * H * T * D;
            float *q = malloc(sizeof(float) * (size_t)n),
                  *o = malloc(sizeof(float) * (size_t)n);
            for (int hi = 0; hi < 2; hi++) {
                const mha_dtype dt = hi ? MHA_F16 : MHA_BF16;
                for (int64_t i = 0; i < n; i++) q[i] = frand();
                void *qh = as_dtype(q, n, dt);  // q: the values qh holds
                for (int od = 0; od < 2; od++) {
                    const mha_dtype odt = od ? MHA_F32 : dt;
                    void *oh = calloc((size_t)n, od ? 4 : 2);
                    const int64_t sh[4] = {B, H, T, D};
                    mha_tensor qt = mha_tensor_contiguous(qh, dt, 4, sh),
                               ot = mha_tensor_contiguous(oh, odt, 4, sh),
                               qf = mha_tensor_contiguous(q, MHA_F32, 4, sh),
                               of = mha_tensor_contiguous(o, MHA_F32, 4, sh);
                    mha_sdpa_args none;  // (last_impl: something else first)
                    mha_sdpa_args_init(&none);
                    none.q = none.k = none.v = &qf;
                    none.impl = MHA_IMPL_REFERENCE;
                    mha_tensor o64 = mha_tensor_contiguous(o, MHA_F32, 4, sh);
                    CHECK_OK(mha_sdpa(&o64, NULL, &none));
                    if (c) {
                        CHECK_OK(mha_kv_cache_attend(&of, &qf, c, NULL, NULL));
                        CHECK_OK(mha_kv_cache_attend(&ot, &qt, c, NULL, NULL));
                    } else {
                        CHECK_OK(mha_paged_cache_attend(&of, &qf, pc, 2, ids, NULL, NULL));
                        CHECK_OK(mha_paged_cache_attend(&ot, &qt, pc, 2, ids, NULL, NULL));
                    }
                    CHECKF(strncmp(mha_last_impl(), "fused ", 6) == 0 &&
                               strcmp(mha_last_impl() + 6, mha_isa()) == 0,
                           "cache %d attend: last_impl \"%s\"", store, mha_last_impl());
                    const int64_t bad = first_unrounded(oh, odt, o, n);
                    CHECKF(bad < 0,
                           "cache %d T %lld q %s out %s: element %lld is not the "
                           "float32 attend's rounded",
                           store, (long long)T, dn(dt), dn(odt), (long long)bad);
                    checks++;
                    free(oh);
                }
                free(qh);
            }
            free(q), free(o);
        }
        mha_kv_cache_destroy(c);
        mha_paged_cache_destroy(pc);
    }
    free(k), free(v);
    printf("caches with bf16 / f16 queries: %d checks\n", checks);
}

// mha_sdpa_varlen on half views (and mixed with float32): each sequence's
// output is mha_sdpa's on that sequence's rows (strided 4-D views of the
// packed tensors) bit for bit, causal or not, with GQA; last_impl fused
// (" bf16" exactly where mha_sdpa's is).
static void test_varlen_half(void) {
    enum { NS = 3, H = 4, HKV = 2, D = 32 };
    const int64_t lq[NS] = {5, 70, 130}, lk[NS] = {7, 70, 200};
    int64_t cq[NS + 1] = {0}, ck[NS + 1] = {0};
    for (int b = 0; b < NS; b++) cq[b + 1] = cq[b] + lq[b], ck[b + 1] = ck[b] + lk[b];
    const int64_t Tq = cq[NS], Tk = ck[NS];
    const mha_dtype sets[3][4] = {{MHA_BF16, MHA_BF16, MHA_BF16, MHA_BF16},
                                  {MHA_F16, MHA_F16, MHA_F16, MHA_F16},
                                  {MHA_BF16, MHA_F32, MHA_BF16, MHA_F32}};
    int checks = 0;
    for (int si = 0; si < 3; si++)
        for (int causal = 0; causal < 2; causal++) {
            const mha_dtype qd = sets[si][0], kd = sets[si][1], vd = sets[si][2],
                            od = sets[si][3];
            float *q = malloc(sizeof(float) * (size_t)(Tq * H * D)),
                  *k = malloc(sizeof(float) * (size_t)(Tk * HKV * D)),
                  *v = malloc(sizeof(float) * (size_t)(Tk * HKV * D));
            for (int64_t i = 0; i < Tq * H * D; i++) q[i] = frand();
            for (int64_t i = 0; i < Tk * HKV * D; i++) k[i] = frand(), v[i] = frand();
            void *qh = as_dtype(q, Tq * H * D, qd), *kh = as_dtype(k, Tk * HKV * D, kd),
                 *vh = as_dtype(v, Tk * HKV * D, vd);
            const size_t osz = od == MHA_F32 ? 4 : 2;
            char *o1 = calloc((size_t)(Tq * H * D), osz),
                 *o2 = calloc((size_t)(Tq * H * D), osz);
            mha_tensor qt = mha_tensor_contiguous(qh, qd, 3, (int64_t[]){Tq, H, D});
            mha_tensor kt = mha_tensor_contiguous(kh, kd, 3, (int64_t[]){Tk, HKV, D});
            mha_tensor vt = mha_tensor_contiguous(vh, vd, 3, (int64_t[]){Tk, HKV, D});
            mha_tensor ot = mha_tensor_contiguous(o1, od, 3, (int64_t[]){Tq, H, D});
            mha_varlen_args va;
            mha_varlen_args_init(&va);
            va.cu_seqlens_q = cq, va.cu_seqlens_k = ck, va.num_seqs = NS;
            va.opts.is_causal = causal;
            CHECK_OK(mha_sdpa_varlen(&ot, &qt, &kt, &vt, &va));
            char impl[64];
            snprintf(impl, sizeof impl, "%s", mha_last_impl());
            for (int b = 0; b < NS; b++) {  // (1, H, l, D) views of sequence b's rows
#define SEQ_VIEW(base, dt, rows, heads, r0)                                               \
    (mha_tensor) {                                                                        \
        .data = (char *)(base) + (r0) * (heads)*D * (dt == MHA_F32 ? 4 : 2), .dtype = dt, \
        .ndim = 4, .shape = {1, heads, rows, D}, .stride = {                              \
            rows * heads * D,                                                             \
            D,                                                                            \
            heads * D,                                                                    \
            1                                                                             \
        }                                                                                 \
    }
                mha_tensor q4 = SEQ_VIEW(qh, qd, lq[b], H, cq[b]);
                mha_tensor k4 = SEQ_VIEW(kh, kd, lk[b], HKV, ck[b]);
                mha_tensor v4 = SEQ_VIEW(vh, vd, lk[b], HKV, ck[b]);
                mha_tensor o4 = SEQ_VIEW(o2, od, lq[b], H, cq[b]);
#undef SEQ_VIEW
                mha_sdpa_args a;
                mha_sdpa_args_init(&a);
                a.q = &q4, a.k = &k4, a.v = &v4;
                a.opts.is_causal = causal;
                CHECK_OK(mha_sdpa(&o4, NULL, &a));
                CHECKF(strcmp(impl, mha_last_impl()) == 0,
                       "varlen set %d: ran \"%s\", mha_sdpa \"%s\"", si, impl, mha_last_impl());
            }
            CHECKF(strncmp(impl, "fused ", 6) == 0, "varlen ran \"%s\"", impl);
            CHECKF(memcmp(o1, o2, osz * (size_t)(Tq * H * D)) == 0,
                   "varlen set %d causal %d: not mha_sdpa's bits per sequence", si, causal);
            checks++;
            free(q), free(k), free(v), free(qh), free(kh), free(vh), free(o1), free(o2);
        }
    printf("varlen on half views: %d checks\n", checks);
}

int main(void) {
    seed_rng(0x5eed4a1f);
    static const mha_dtype halves[2] = {MHA_BF16, MHA_F16};
    int id = 0;
    for (int hi = 0; hi < 2; hi++) {
        const mha_dtype h = halves[hi];
        const hcase cases[] = {
            {1, 2, 2, 5, 7, 8, 8, false, false, false, false, true, -1, h, h, h, h},
            {2, 4, 2, 70, 130, 16, 24, true, false, false, false, true, -1, h, h, h, h},
            {1, 3, 1, 64, 300, 32, 32, false, true, true, false, false, -1, h, h, h, MHA_F32},
            {2, 2, 2, 40, 40, 64, 64, true, true, false, false, true, 9, h, MHA_F32, h, h},
            {1, 4, 4, 129, 257, 20, 12, false, false, false, true, true, -1, h, h, MHA_F32, h},
            {1, 2, 1, 33, 200, 128, 64, false, false, true, false, false, -1, MHA_F32, h, h, h},
            // all h (bf16: the bf16 compute): masks and GQA, causal with a
            // window (key tiles cut by the band), odd D with dropout, D 128,
            // several query and key tiles
            {1, 3, 1, 64, 300, 32, 32, false, true, true, false, true, -1, h, h, h, h},
            {2, 2, 2, 100, 100, 64, 64, true, false, false, false, true, 9, h, h, h, h},
            {1, 4, 4, 129, 257, 20, 12, false, false, false, true, true, -1, h, h, h, h},
            {1, 2, 1, 33, 200, 128, 64, false, false, true, false, false, -1, h, h, h, MHA_F32},
            {1, 2, 2, 300, 290, 64, 64, true, false, false, false, false, -1, h, h, h, h},
        };
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_case(&cases[i], id++);
        // a table that computes bf16 in float32 (bf_fast false): its bf16
        // compute too (generic or vdpbf16ps gemm_bf16), forced, on the
        // all-bf16 cases
        if (h == MHA_BF16 && !g_bf_seen) {
            mha__flash_force_bf16(true);
            for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
                if (cases[i].qd == h && cases[i].kd == h && cases[i].vd == h)
                    run_case(&cases[i], id++);
            mha__flash_force_bf16(false);
            CHECKF(g_bf_seen, "forced bf16 compute did not run (%s)", mha_last_impl());
        }
    }
    // float32 views: auto is fused; float64: the reference
    {
        float x[2 * 3 * 4] = {0}, y[2 * 3 * 4];
        mha_tensor t = mha_tensor_contiguous(x, MHA_F32, 4, (int64_t[]){1, 2, 3, 4});
        mha_tensor o = mha_tensor_contiguous(y, MHA_F32, 4, (int64_t[]){1, 2, 3, 4});
        mha_sdpa_args a;
        mha_sdpa_args_init(&a);
        a.q = a.k = a.v = &t;
        CHECK_OK(mha_sdpa(&o, NULL, &a));
        CHECKF(strncmp(mha_last_impl(), "fused ", 6) == 0 &&
                   strcmp(mha_last_impl() + 6, mha_isa()) == 0,
               "F32 views ran \"%s\" (kernels %s)", mha_last_impl(), mha_isa());
    }
    test_cache_half();
    test_varlen_half();
    printf("test_half_sdpa: %d cases, bf16 and f16, kernels %s; bf16 backward worst error / "
           "bound %.3g\n",
           id, mha_isa(), g_bwd_worst);
    CHECKF(g_bwd_worst > 0, "the bf16 backward did not run (kernels %s)", mha_isa());
    return check_summary("test_half_sdpa");
}
