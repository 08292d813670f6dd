// test_fused.c: the fused forward (MHA_IMPL_FUSED) against the reference on
// random configurations (layouts, strided views, masks, causal, appended
// keys, dropout, need_weights), and bit-identical results with 1, 2 and 8
// threads. ctest runs it once per ISA (MHA_ISA=scalar|avx2|avx512).
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "check.h"
#include "mha.h"

static uint64_t g_rng = 2024;
static uint64_t next(void) {
    g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
    return g_rng >> 11;
}
static float frand(void) { return (float)((double)next() * 0x1p-53 * 2.0 - 1.0); }
static int64_t irand(int64_t lo, int64_t hi) { return lo + (int64_t)(next() % (uint64_t)(hi - lo + 1)); }

static double max_abs(const float *x, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; i++) m = fmax(m, fabs(x[i]));
    return m;
}

// One random configuration: fused vs reference. Returns the error ratio.
static void one_case(int id) {
    const int64_t H = irand(1, 4), d = irand(1, 24), E = H * d;
    const int64_t L = irand(1, 150), S = irand(1, 150), N = irand(1, 3);
    const bool bf = next() & 1, unb = next() % 4 == 0, bkv = next() % 3 == 0,
               zero = next() % 3 == 0, causal = next() & 1, drop = next() % 4 == 0,
               need = next() & 1, avg = next() & 1, strided = next() % 3 == 0;
    const int am_kind = (int)(next() % 3), kpm_kind = (int)(next() % 3);
    mha_config c;
    mha_config_init(&c, E, H);
    c.batch_first = bf;
    c.add_bias_kv = bkv;
    c.add_zero_attn = zero;
    c.dropout = drop ? 0.25f : 0.0f;
    if (next() % 3 == 0) c.kdim = irand(1, 20);
    mha_module *m = NULL;
    CHECK_OK(mha_module_create(&m, &c));
    mha_init_options io;
    mha_init_options_default(&io);
    io.seed = (uint64_t)id;
    CHECK_OK(mha_module_init(m, &io));
    const int64_t kd = mha_module_config(m)->kdim, nb = unb ? 1 : N;
    const int64_t pad = strided ? 3 : 0;  // extra features: a strided view
    float *q = malloc(sizeof(float) * (size_t)(L * nb * (E + pad)));
    float *k = malloc(sizeof(float) * (size_t)(S * nb * (kd + pad)));
    float *v = malloc(sizeof(float) * (size_t)(S * nb * (E + pad)));
    for (int64_t i = 0; i < L * nb * (E + pad); i++) q[i] = frand();
    for (int64_t i = 0; i < S * nb * (kd + pad); i++) k[i] = frand();
    for (int64_t i = 0; i < S * nb * (E + pad); i++) v[i] = frand();
    bool self = !strided && kd == E && S == L && next() % 2 == 0;
    if (self) memcpy(k, q, sizeof(float) * (size_t)(L * nb * E));
    mha_tensor qt, kt, vt;
    #define VIEW(t, p, T, F)                                                          \
        do {                                                                          \
            int64_t sh3[3] = {bf ? nb : T, bf ? T : nb, F};                           \
            int64_t sh2[2] = {T, F};                                                  \
            t = unb ? mha_tensor_contiguous(p, MHA_F32, 2, sh2)                       \
                    : mha_tensor_contiguous(p, MHA_F32, 3, sh3);                      \
            if (pad) {  /* rows of F + pad floats, the first F used */               \
                if (unb) t.stride[0] = F + pad;                                       \
                else { t.stride[1] = F + pad; t.stride[0] = sh3[1] * (F + pad); }     \
            }                                                                         \
        } while (0)
    VIEW(qt, q, L, E);
    VIEW(kt, self ? q : k, S, kd);
    VIEW(vt, self ? q : v, S, E);
    const int64_t Sp = S + bkv + zero;
    uint8_t *bm = malloc((size_t)(nb * H * L * S));
    float *fm = malloc(sizeof(float) * (size_t)(nb * H * L * S));
    uint8_t *bk = malloc((size_t)(nb * S));
    for (int64_t i = 0; i < nb * H * L * S; i++) {
        bm[i] = next() % 5 == 0;
        fm[i] = next() % 7 == 0 ? -INFINITY : frand();
    }
    for (int64_t i = 0; i < nb * S; i++) bk[i] = next() % 4 == 0;
    mha_tensor amt, kpt;
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = &qt;
    a.key = &kt;
    a.value = &vt;
    a.is_causal = causal;
    a.need_weights = need;
    a.average_attn_weights = avg;
    a.training = drop;
    a.dropout_seed = (uint64_t)id * 7919;
    if (am_kind) {
        amt = next() & 1 ? mha_tensor_contiguous(am_kind == 1 ? (void *)bm : (void *)fm,
                                                 am_kind == 1 ? MHA_BOOL : MHA_F32, 2,
                                                 (int64_t[]){L, S})
                         : mha_tensor_contiguous(am_kind == 1 ? (void *)bm : (void *)fm,
                                                 am_kind == 1 ? MHA_BOOL : MHA_F32, 3,
                                                 (int64_t[]){nb * H, L, S});
        a.attn_mask = &amt;
    }
    if (kpm_kind) {
        kpt = unb ? mha_tensor_contiguous(kpm_kind == 1 ? (void *)bk : (void *)fm,
                                          kpm_kind == 1 ? MHA_BOOL : MHA_F32, 1, (int64_t[]){S})
                  : mha_tensor_contiguous(kpm_kind == 1 ? (void *)bk : (void *)fm,
                                          kpm_kind == 1 ? MHA_BOOL : MHA_F32, 2,
                                          (int64_t[]){nb, S});
        a.key_padding_mask = &kpt;
    }
    mha_shape os, wsh;
    CHECK_OK(mha_forward_shapes(&os, &wsh, m, &a));
    int64_t on = 1, wn = 1;
    for (int i = 0; i < os.ndim; i++) on *= os.dims[i];
    for (int i = 0; i < wsh.ndim; i++) wn *= wsh.dims[i];
    float *y1 = malloc(sizeof(float) * (size_t)on), *y2 = malloc(sizeof(float) * (size_t)on);
    float *w1 = malloc(sizeof(float) * (size_t)wn), *w2 = malloc(sizeof(float) * (size_t)wn);
    mha_tensor y1t = mha_tensor_contiguous(y1, MHA_F32, os.ndim, os.dims);
    mha_tensor y2t = mha_tensor_contiguous(y2, MHA_F32, os.ndim, os.dims);
    mha_tensor w1t = mha_tensor_contiguous(w1, MHA_F32, wsh.ndim, wsh.dims);
    mha_tensor w2t = mha_tensor_contiguous(w2, MHA_F32, wsh.ndim, wsh.dims);
    a.impl = MHA_IMPL_REFERENCE;
    CHECK_OK(mha_forward(&y1t, need ? &w1t : NULL, m, &a));
    a.impl = MHA_IMPL_FUSED;
    CHECK_OK(mha_forward(&y2t, need ? &w2t : NULL, m, &a));
    double e = 0;
    for (int64_t i = 0; i < on; i++) e = fmax(e, fabs((double)y1[i] - y2[i]));
    double tol = 2e-5 * (1 + max_abs(y1, on));
    CHECKF(e <= tol, "case %d (E %lld H %lld L %lld S %lld N %lld bf %d unb %d bkv %d zero %d "
           "causal %d drop %d am %d kpm %d strided %d self %d): output err %g tol %g", id,
           (long long)E, (long long)H, (long long)L, (long long)S, (long long)N, bf, unb, bkv,
           zero, causal, drop, am_kind, kpm_kind, strided, self, e, tol);
    if (need) {
        double ew = 0;
        for (int64_t i = 0; i < wn; i++) ew = fmax(ew, fabs((double)w1[i] - w2[i]));
        double wtol = 2e-5 * (1 + max_abs(w1, wn));
        CHECKF(ew <= wtol, "case %d: weights err %g tol %g", id, ew, wtol);
    }
    (void)Sp;
    free(q); free(k); free(v); free(bm); free(fm); free(bk);
    free(y1); free(y2); free(w1); free(w2);
    mha_module_destroy(m);
}

// 1, 2 and 8 threads: bit-identical output, weights and gradients.
static void test_threads(void) {
    enum { E = 96, H = 4, L = 200, N = 2 };
    mha_config c;
    mha_config_init(&c, E, H);
    mha_module *m = NULL;
    CHECK_OK(mha_module_create(&m, &c));
    mha_init_options io;
    mha_init_options_default(&io);
    CHECK_OK(mha_module_init(m, &io));
    static float x[L * N * E], y[3][L * N * E], w[3][N * L * L];
    for (int i = 0; i < L * N * E; i++) x[i] = frand();
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){L, N, E});
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &xt;
    a.is_causal = true;
    a.need_weights = true;
    a.impl = MHA_IMPL_FUSED;
    const int threads[3] = {1, 2, 8};
    static float gx[3][L * N * E];
    mha_module *g[3];
    for (int r = 0; r < 3; r++) {
#ifdef _OPENMP
        omp_set_num_threads(threads[r]);
#endif
        mha_tensor yt = mha_tensor_contiguous(y[r], MHA_F32, 3, (int64_t[]){L, N, E});
        mha_tensor wt = mha_tensor_contiguous(w[r], MHA_F32, 3, (int64_t[]){N, L, L});
        mha_tensor gt = mha_tensor_contiguous(gx[r], MHA_F32, 3, (int64_t[]){L, N, E});
        CHECK_OK(mha_forward(&yt, &wt, m, &a));
        CHECK_OK(mha_module_create(&g[r], mha_module_config(m)));
        CHECK_OK(mha_backward(&gt, NULL, NULL, g[r], m, &a, &xt, false));  // dY = x
    }
    for (int r = 1; r < 3; r++) {
        CHECKF(memcmp(y[0], y[r], sizeof y[0]) == 0, "fused output: 1 vs %d threads", threads[r]);
        CHECKF(memcmp(w[0], w[r], sizeof w[0]) == 0, "fused weights: 1 vs %d threads", threads[r]);
        CHECKF(memcmp(gx[0], gx[r], sizeof gx[0]) == 0, "fused grad_query: 1 vs %d threads",
               threads[r]);
        for (int i = 0; i < mha_module_num_params(g[0]); i++) {
            mha_param p0, pr;
            CHECK_OK(mha_module_param_at(&p0, g[0], i));
            CHECK_OK(mha_module_param_at(&pr, g[r], i));
            CHECKF(memcmp(p0.data, pr.data, (size_t)p0.numel * 4) == 0,
                   "fused grad %s: 1 vs %d threads", p0.name, threads[r]);
        }
    }
    for (int r = 0; r < 3; r++) mha_module_destroy(g[r]);
#ifdef _OPENMP
    omp_set_num_threads(2);
#endif
    mha_module_destroy(m);
}

int main(void) {
    for (int i = 0; i < 300; i++) one_case(i);
    test_threads();
    printf("ISA: %s\n", mha_isa());
    return check_summary("test_fused");
}
