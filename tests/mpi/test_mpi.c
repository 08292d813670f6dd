// test_mpi.c: head and Ulysses parallelism over MPI (mha_mpi.h), run by ctest under
// mpiexec with 1, 2, 3 and 4 ranks. Every rank builds the same problems
// from the same seeds and computes the single-process fused results
// itself; then:
//   heads:      output and every gradient bit-identical to the fused path
//   ulysses:    the same, each rank holding a block of the tokens
//   ring:       each rank holding its zigzag chunks (seq-first and
//               batch-first views)
//   ring, heads-fast: output, input gradients and every parameter
//               gradient within the tolerance rule of the fused path, and
//               their error against the float64 reference at most 2x the
//               fused path's (+ a float32 ulp of the scale)
// over configurations with packed/separate projections, grouped-query
// heads, gates, a pruned head, causal and key-padding masks, RoPE, bias_kv,
// accumulate. A rank with a bad input makes every rank fail with that
// rank's message, and nobody hangs. Ends with "N passed, M failed" from
// rank 0 (counts over all ranks).
#include <math.h>
#include <signal.h>
#include <sys/time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../check.h"
#include "../util.h"
#include "mha.h"
#include "mha_mpi.h"

static int g_rank, g_P;

static double max_err(const float *a, const double *ref, int64_t n) {
    double e = 0;
    for (int64_t i = 0; i < n; i++) e = fmax(e, fabs((double)a[i] - ref[i]));
    return e;
}

// Between a whole (T, N, F) array and this rank's zigzag chunks laid out
// (Tr, N, F) or, batch-first, (N, Tr, F): to the local copy (out) or back.
static void chunks_xfer(float *whole_, float *loc, int64_t T, int64_t N, int64_t F,
                        const int64_t cs[2], const int64_t cl[2], bool bf, bool out) {
    const int64_t Tr = cl[0] + cl[1];
    (void)T;
    for (int c = 0; c < 2; c++)
        for (int64_t t = 0; t < cl[c]; t++)
            for (int64_t n = 0; n < N; n++) {
                const int64_t lt = (c ? cl[0] : 0) + t;
                float *w = whole_ + ((cs[c] + t) * N + n) * F,
                      *l = loc + (bf ? n * Tr + lt : lt * N + n) * F;
                memcpy(out ? l : w, out ? w : l, sizeof(float) * (size_t)F);
            }
}
static mha_tensor local_view(float *p, int64_t Tr, int64_t N, int64_t F, bool bf) {
    return bf ? mha_tensor_contiguous(p, MHA_F32, 3, (int64_t[]){N, Tr, F})
              : mha_tensor_contiguous(p, MHA_F32, 3, (int64_t[]){Tr, N, F});
}
// Every rank's chunks put together: (T, N, F) on every rank.
static float *whole(float *loc, int64_t T, int64_t N, int64_t F, const int64_t cs[2],
                    const int64_t cl[2], bool bf) {
    float *w = calloc((size_t)(T * N * F + 1), sizeof(float));
    chunks_xfer(w, loc, T, N, F, cs, cl, bf, false);
    MPI_Allreduce(MPI_IN_PLACE, w, (int)(T * N * F), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    return w;  // (each element has one owner)
}
// A distributed result (got) against the single process's (one) and the
// float64 reference: within the tolerance rule of the fused path, and its
// error vs float64 at most 2x the single process's (+ a float32 ulp of the
// scale).
static void compare(const char *desc, const char *what, const float *got, const float *one,
                    const double *ref, int64_t n) {
    const double scale = 1.0 + max_abs(one, n), e_got = max_err(got, ref, n),
                 e_one = max_err(one, ref, n);
    CHECKF(e_got <= 2.0 * e_one + 0x1p-23 * scale,
           "%s %s: error vs float64 %g, single process "
           "%g",
           desc, what, e_got, e_one);
    double e = 0;
    for (int64_t i = 0; i < n; i++) e = fmax(e, fabs((double)got[i] - one[i]));
    CHECKF(e <= 2e-5 * scale, "%s %s: vs the fused path %g (scale %g)", desc, what, e, scale);
}
// Every parameter gradient so (the reference's are float64 sums rounded to
// float32).
static void compare_grads(const char *desc, const mha_module *got, const mha_module *one,
                          const mha_module *ref) {
    for (int i = 0; got && one && ref && i < mha_module_num_params(got); i++) {
        mha_param p1, p2, p3;
        CHECK_OK(mha_module_param_at(&p1, got, i));
        CHECK_OK(mha_module_param_at(&p2, one, i));
        CHECK_OK(mha_module_param_at(&p3, ref, i));
        double *r = malloc(sizeof(double) * (size_t)(p3.numel + 1));
        for (int64_t j = 0; j < p3.numel; j++) r[j] = p3.data[j];
        char w[96];
        snprintf(w, sizeof w, "grad %s", p1.name);
        compare(desc, w, p1.data, p2.data, r, p1.numel);
        free(r);
    }
}

// Every parameter of m set to v (accumulate's starting gradients).
static void fill_params(mha_module *m, float v) {
    for (int i = 0; m && i < mha_module_num_params(m); i++) {
        mha_param p;
        CHECK_OK(mha_module_param_at(&p, m, i));
        for (int64_t j = 0; j < p.numel; j++) p.data[j] = v;
    }
}
// Every parameter gradient of a and b, bit for bit.
static void same_grads(const char *desc, const mha_module *a, const mha_module *b) {
    for (int i = 0; a && b && i < mha_module_num_params(a); i++) {
        mha_param p1, p2;
        CHECK_OK(mha_module_param_at(&p1, a, i));
        CHECK_OK(mha_module_param_at(&p2, b, i));
        CHECKF(!memcmp(p1.data, p2.data, sizeof(float) * (size_t)p1.numel),
               "%s: grad %s "
               "differs",
               desc, p1.name);
    }
}

// RoPE scalings the cases use: 0 none, 1 linear, 2 YaRN, 3 llama3, 4 dynamic.
static mha_rope_scaling rope_scaling_of(int k) {
    static const mha_rope_scaling_type t[5] = {MHA_ROPE_SCALING_NONE, MHA_ROPE_SCALING_LINEAR,
                                               MHA_ROPE_SCALING_YARN, MHA_ROPE_SCALING_LLAMA3,
                                               MHA_ROPE_SCALING_DYNAMIC};
    mha_rope_scaling s;
    mha_rope_scaling_init(&s, t[k]);
    s.factor = k == 1 ? 2.0 : 4.0;
    s.original_max_position = k == 4 ? 6 : 8;
    return s;
}

static void one_case(int id) {
    seed_rng(1000 + (uint64_t)id);  // the same problem on every rank
    const int64_t Hkv = irand(1, 5), G = irand(1, 2), H = Hkv * G, d = irand(2, 6) * 2,
                  E = H * d, L = irand(1, 48), N = irand(1, 2);
    const bool self = next() % 3 != 0, causal = next() & 1, kpm = next() % 3 == 0,
               rope = next() % 3 == 0, bkv = next() % 4 == 0, acc = next() % 4 == 0;
    const int64_t S = self ? L : irand(1, 48);
    mha_config c;
    mha_config_init(&c, E, H);
    c.num_kv_heads = Hkv;
    c.head_gate = (mha_head_gate)(next() % 3);
    c.add_bias_kv = bkv;
    if (!self && next() % 2) c.kdim = irand(1, 12), c.vdim = irand(1, 12);
    mha_module *m = random_module(&c, (uint64_t)id);
    if (next() % 4 == 0) {
        const int64_t pr = irand(0, H - 1);
        CHECK_OK(mha_module_prune_heads(m, &pr, 1));
    }
    const int64_t kd = mha_module_config(m)->kdim, vd = mha_module_config(m)->vdim;
    const int64_t nq = L * N * E, nk = S * N * kd, nv = S * N * vd;
    float *x[4];
    double *xd[4];
    const int64_t nx[4] = {nq, nk, nv, nq};
    for (int i = 0; i < 4; i++) {
        x[i] = malloc(sizeof(float) * (size_t)nx[i]);
        xd[i] = malloc(sizeof(double) * (size_t)nx[i]);
        for (int64_t j = 0; j < nx[i]; j++) xd[i][j] = x[i][j] = frand();
    }
    uint8_t kb[2 * 48];
    for (int i = 0; i < 2 * 48; i++) kb[i] = next() % 5 == 0;
    mha_tensor in[4], ind[4];
    const int64_t T[4] = {L, S, S, L}, F[4] = {E, kd, vd, E};
    for (int i = 0; i < 4; i++) {
        in[i] = mha_tensor_contiguous(x[i], MHA_F32, 3, (int64_t[]){T[i], N, F[i]});
        ind[i] = mha_tensor_contiguous(xd[i], MHA_F64, 3, (int64_t[]){T[i], N, F[i]});
    }
    mha_tensor kpt = mha_tensor_contiguous(kb, MHA_BOOL, 2, (int64_t[]){N, S});
    mha_forward_args a, ad;
    mha_forward_args_init(&a);
    a.query = &in[0];
    a.key = self ? &in[0] : &in[1];
    a.value = self ? &in[0] : &in[2];
    a.opts.is_causal = causal;
    a.impl = MHA_IMPL_FUSED;
    if (kpm) a.key_padding_mask = &kpt;
    if (rope) mha_rope_init(&a.rope, MHA_ROPE_NEOX);
    // RoPE scaled (by the case's id: none, linear, YaRN, llama3), which every
    // scheme applies as the single process does
    mha_rope_scaling rsc = rope_scaling_of(id % 4);
    if (rope && id % 4) a.rope_scaling = &rsc;
    ad = a;
    ad.query = &ind[0];
    ad.key = self ? &ind[0] : &ind[1];
    ad.value = self ? &ind[0] : &ind[2];
    ad.impl = MHA_IMPL_REFERENCE;
    // single process: fused (float32) and the float64 reference
    float *y = malloc(sizeof(float) * (size_t)nq), *yp = malloc(sizeof(float) * (size_t)nq);
    double *yd = malloc(sizeof(double) * (size_t)nq);
    mha_tensor yt = mha_tensor_contiguous(y, MHA_F32, 3, (int64_t[]){L, N, E}),
               ypt = mha_tensor_contiguous(yp, MHA_F32, 3, (int64_t[]){L, N, E}),
               ydt = mha_tensor_contiguous(yd, MHA_F64, 3, (int64_t[]){L, N, E});
    CHECK_OK(mha_forward(&yt, NULL, m, &a));
    CHECK_OK(mha_forward(&ydt, NULL, m, &ad));
    float *g1[3], *g2[3];
    mha_tensor t1[3], t2[3];
    for (int i = 0; i < 3; i++) {
        g1[i] = malloc(sizeof(float) * (size_t)nx[i]);
        g2[i] = malloc(sizeof(float) * (size_t)nx[i]);
        for (int64_t j = 0; j < nx[i]; j++) g1[i][j] = g2[i][j] = acc ? 0.25f : 0.0f;
        t1[i] = mha_tensor_contiguous(g1[i], MHA_F32, 3, (int64_t[]){T[i], N, F[i]});
        t2[i] = mha_tensor_contiguous(g2[i], MHA_F32, 3, (int64_t[]){T[i], N, F[i]});
    }
    mha_module *gm1 = NULL, *gm2 = NULL;
    CHECK_OK(mha_module_create(&gm1, mha_module_config(m)));
    CHECK_OK(mha_module_create(&gm2, mha_module_config(m)));
    if (acc) fill_params(gm1, 0.5f), fill_params(gm2, 0.5f);
    CHECK_OK(mha_backward(&t1[0], self ? NULL : &t1[1], self ? NULL : &t1[2], gm1, m, &a,
                          &in[3], acc));
    // the float64 reference's gradients (parameters: float64 sums rounded)
    double *gd[3];
    mha_tensor td[3];
    for (int i = 0; i < 3; i++) {
        gd[i] = malloc(sizeof(double) * (size_t)nx[i]);
        for (int64_t j = 0; j < nx[i]; j++) gd[i][j] = acc ? 0.25 : 0.0;
        td[i] = mha_tensor_contiguous(gd[i], MHA_F64, 3, (int64_t[]){T[i], N, F[i]});
    }
    mha_module *gmd = NULL;
    CHECK_OK(mha_module_create(&gmd, mha_module_config(m)));
    if (acc) fill_params(gmd, 0.5f);
    CHECK_OK(mha_backward(&td[0], self ? NULL : &td[1], self ? NULL : &td[2], gmd, m, &ad,
                          &ind[3], acc));
    char desc[200];
    snprintf(desc, sizeof desc,
             "case %d on %d ranks (E %lld H %lld Hkv %lld L %lld S %lld N %lld "
             "self %d causal %d kpm %d rope %d scaling %d bkv %d gate %d acc %d)",
             id, g_P, (long long)E, (long long)H, (long long)Hkv, (long long)L, (long long)S,
             (long long)N, self, causal, kpm, rope, rope ? id % 4 : 0, bkv, (int)c.head_gate,
             acc);
    // Ulysses: this rank's block of tokens (the even split), views into the
    // whole tensors; its slice of the output and the input gradients must
    // be the single-process bits
    if (rope && L != S) {  // RoPE positions of a cross-attention: refused
        mha_forward_args au = a;
        CHECK_FAILS(mha_mpi_forward(MPI_COMM_WORLD, MHA_PAR_ULYSSES, &ypt, m, &au, NULL),
                    MHA_ERR_UNSUPPORTED);
    } else {
        const int64_t l0 = L * g_rank / g_P, l1 = L * (g_rank + 1) / g_P,
                      s0 = S * g_rank / g_P, s1 = S * (g_rank + 1) / g_P;
        mha_tensor lq = mha_tensor_contiguous(x[0] + l0 * N * E, MHA_F32, 3,
                                              (int64_t[]){l1 - l0, N, E}),
                   lk = mha_tensor_contiguous(x[1] + s0 * N * kd, MHA_F32, 3,
                                              (int64_t[]){s1 - s0, N, kd}),
                   lv = mha_tensor_contiguous(x[2] + s0 * N * vd, MHA_F32, 3,
                                              (int64_t[]){s1 - s0, N, vd}),
                   lg = mha_tensor_contiguous(x[3] + l0 * N * E, MHA_F32, 3,
                                              (int64_t[]){l1 - l0, N, E}),
                   ly = mha_tensor_contiguous(yp + l0 * N * E, MHA_F32, 3,
                                              (int64_t[]){l1 - l0, N, E}),
                   lgq = mha_tensor_contiguous(g2[0] + l0 * N * E, MHA_F32, 3,
                                               (int64_t[]){l1 - l0, N, E}),
                   lgk = mha_tensor_contiguous(g2[1] + s0 * N * kd, MHA_F32, 3,
                                               (int64_t[]){s1 - s0, N, kd}),
                   lgv = mha_tensor_contiguous(g2[2] + s0 * N * vd, MHA_F32, 3,
                                               (int64_t[]){s1 - s0, N, vd});
        mha_forward_args au = a;
        au.query = &lq;
        au.key = self ? &lq : &lk;
        au.value = self ? &lq : &lv;
        for (int i = 0; i < 3; i++)
            for (int64_t jx = 0; jx < nx[i]; jx++) g2[i][jx] = acc ? 0.25f : 0.0f;
        if (acc) fill_params(gm2, 0.5f);
        CHECK_OK(mha_mpi_forward(MPI_COMM_WORLD, MHA_PAR_ULYSSES, &ly, m, &au, NULL));
        CHECK_OK(mha_mpi_backward(MPI_COMM_WORLD, MHA_PAR_ULYSSES, &lgq, self ? NULL : &lgk,
                                  self ? NULL : &lgv, gm2, m, &au, &lg, acc, NULL));
        CHECKF(!memcmp(y + l0 * N * E, yp + l0 * N * E,
                       sizeof(float) * (size_t)((l1 - l0) * N * E)),
               "%s ulysses: output slice differs", desc);
        CHECKF(!memcmp(g1[0] + l0 * N * E, g2[0] + l0 * N * E,
                       sizeof(float) * (size_t)((l1 - l0) * N * E)),
               "%s ulysses: grad_query slice differs", desc);
        if (!self) {
            CHECKF(!memcmp(g1[1] + s0 * N * kd, g2[1] + s0 * N * kd,
                           sizeof(float) * (size_t)((s1 - s0) * N * kd)),
                   "%s ulysses: grad_key slice differs", desc);
            CHECKF(!memcmp(g1[2] + s0 * N * vd, g2[2] + s0 * N * vd,
                           sizeof(float) * (size_t)((s1 - s0) * N * vd)),
                   "%s ulysses: grad_value slice differs", desc);
        }
        {
            char dg[260];
            snprintf(dg, sizeof dg, "%s ulysses", desc);
            same_grads(dg, gm1, gm2);
        }
    }
    // ring: this rank's zigzag chunks (local copies, batch-first for odd
    // cases); output and every gradient within the tolerance of the fused
    // path, errors vs float64 at most 2x the single process's
    if (!bkv && !(rope && L != S)) {
        const bool bf = id & 1;
        mha_module *mr = m;
        if (bf) {  // the same parameters, batch-first views
            mha_config cb = *mha_module_config(m);
            cb.batch_first = true;
            mr = NULL;
            CHECK_OK(mha_module_create(&mr, &cb));
            for (int i = 0; mr && i < mha_module_num_params(m); i++) {
                mha_param p1, p2;
                CHECK_OK(mha_module_param_at(&p1, m, i));
                CHECK_OK(mha_module_param_at(&p2, mr, i));
                memcpy(p2.data, p1.data, sizeof(float) * (size_t)p1.numel);
            }
            for (int64_t h = 0; mr && h < H; h++)
                if (mha_module_head_pruned(m, h)) CHECK_OK(mha_module_prune_heads(mr, &h, 1));
        }
        int64_t qs[2], ql[2], ks[2], kl[2];
        mha_mpi_ring_chunks(L, g_P, g_rank, qs, ql);
        mha_mpi_ring_chunks(S, g_P, g_rank, ks, kl);
        const int64_t Lr = ql[0] + ql[1], Sr = kl[0] + kl[1];
        const int64_t *cs[4] = {qs, ks, ks, qs}, *cl[4] = {ql, kl, kl, ql},
                      Tr[4] = {Lr, Sr, Sr, Lr};
        float *lx[4], *lg[3], *ly = malloc(sizeof(float) * (size_t)(Lr * N * E + 1));
        mha_tensor lt[4], lgt[3];
        for (int i = 0; i < 4; i++) {
            lx[i] = malloc(sizeof(float) * (size_t)(Tr[i] * N * F[i] + 1));
            chunks_xfer(x[i], lx[i], T[i], N, F[i], cs[i], cl[i], bf, true);
            lt[i] = local_view(lx[i], Tr[i], N, F[i], bf);
        }
        for (int i = 0; i < 3; i++) {
            lg[i] = malloc(sizeof(float) * (size_t)(Tr[i] * N * F[i] + 1));
            for (int64_t jx = 0; jx < Tr[i] * N * F[i]; jx++) lg[i][jx] = acc ? 0.25f : 0.0f;
            lgt[i] = local_view(lg[i], Tr[i], N, F[i], bf);
        }
        mha_tensor lyt = local_view(ly, Lr, N, E, bf);
        mha_forward_args ar = a;
        ar.query = &lt[0];
        ar.key = self ? &lt[0] : &lt[1];
        ar.value = self ? &lt[0] : &lt[2];
        mha_module *gm3 = NULL;
        CHECK_OK(mha_module_create(&gm3, mha_module_config(mr)));
        if (acc) fill_params(gm3, 0.5f);
        mha_mpi_stats ms;
        CHECK_OK(mha_mpi_forward(MPI_COMM_WORLD, MHA_PAR_RING, &lyt, mr, &ar, &ms));
        CHECK_OK(mha_mpi_backward(MPI_COMM_WORLD, MHA_PAR_RING, &lgt[0], self ? NULL : &lgt[1],
                                  self ? NULL : &lgt[2], gm3, mr, &ar, &lt[3], acc, &ms));
        // the whole output and input gradients (each element from its owner)
        float *yall = whole(ly, L, N, E, qs, ql, bf), *gall[3];
        for (int i = 0; i < 3; i++) gall[i] = whole(lg[i], T[i], N, F[i], cs[i], cl[i], bf);
        char dr[240];
        snprintf(dr, sizeof dr, "%s ring%s", desc, bf ? " (batch-first)" : "");
        compare(dr, "output", yall, y, yd, nq);
        for (int i = 0; i < (self ? 1 : 3); i++)
            compare(dr,
                    i == 0   ? "grad_query"
                    : i == 1 ? "grad_key"
                             : "grad_value",
                    gall[i], g1[i], gd[i], nx[i]);
        compare_grads(dr, gm3, gm1, gmd);
        // with a saved forward state: the same bits without recomputing
        mha_saved *sv = NULL;
        CHECK_OK(mha_saved_create(&sv));
        float *ly2 = malloc(sizeof(float) * (size_t)(Lr * N * E + 1)), *lg2[3];
        mha_tensor ly2t = local_view(ly2, Lr, N, E, bf), lg2t[3];
        for (int i = 0; i < 3; i++) {
            lg2[i] = malloc(sizeof(float) * (size_t)(Tr[i] * N * F[i] + 1));
            for (int64_t jx = 0; jx < Tr[i] * N * F[i]; jx++) lg2[i][jx] = acc ? 0.25f : 0.0f;
            lg2t[i] = local_view(lg2[i], Tr[i], N, F[i], bf);
        }
        mha_module *gm4 = NULL;
        CHECK_OK(mha_module_create(&gm4, mha_module_config(mr)));
        if (acc) fill_params(gm4, 0.5f);
        mha_forward_args as = ar;
        as.save = sv;
        as.training = true;
        CHECK_OK(mha_mpi_forward(MPI_COMM_WORLD, MHA_PAR_RING, &ly2t, mr, &as, NULL));
        CHECK_OK(mha_mpi_backward(MPI_COMM_WORLD, MHA_PAR_RING, &lg2t[0], self ? NULL : &lg2t[1],
                                  self ? NULL : &lg2t[2], gm4, mr, &as, &lt[3], acc, NULL));
        CHECKF(!memcmp(ly, ly2, sizeof(float) * (size_t)(Lr * N * E)),
               "%s saved: output differs", dr);
        for (int i = 0; i < (self ? 1 : 3); i++)
            CHECKF(!memcmp(lg[i], lg2[i], sizeof(float) * (size_t)(Tr[i] * N * F[i])),
                   "%s saved: input gradient %d differs", dr, i);
        {
            char dg[260];
            snprintf(dg, sizeof dg, "%s saved", dr);
            same_grads(dg, gm3, gm4);
        }
        // a state for other masks, or used by the single-process backward: refused
        as.opts.is_causal = !as.opts.is_causal;
        CHECK_FAILS(mha_mpi_backward(MPI_COMM_WORLD, MHA_PAR_RING, &lg2t[0], NULL, NULL, gm4,
                                     mr, &as, &lt[3], false, NULL),
                    MHA_ERR_INVALID_ARG);
        as.opts.is_causal = false;  // (what the ring's fused-path call saw: the guard must refuse)
        as.key_padding_mask = NULL;
        CHECK_FAILS(mha_backward(&lg2t[0], self ? NULL : &lg2t[1], self ? NULL : &lg2t[2], gm4,
                                 mr, &as, &lt[3], false),
                    MHA_ERR_INVALID_ARG);
        mha_saved_destroy(sv);
        mha_module_destroy(gm4);
        for (int i = 0; i < 3; i++) free(lg2[i]);
        free(ly2);
        for (int i = 0; i < 4; i++) free(lx[i]);
        for (int i = 0; i < 3; i++) free(lg[i]), free(gall[i]);
        free(ly), free(yall);
        mha_module_destroy(gm3);
        if (mr != m) mha_module_destroy(mr);
    }
    for (int s = 0; s < 2; s++) {
        const mha_parallel sch = s ? MHA_PAR_HEADS_FAST : MHA_PAR_HEADS;
        mha_mpi_stats ms;
        CHECK_OK(mha_mpi_forward(MPI_COMM_WORLD, sch, &ypt, m, &a, &ms));
        for (int i = 0; i < 3; i++)
            for (int64_t j = 0; j < nx[i]; j++) g2[i][j] = acc ? 0.25f : 0.0f;
        if (acc) fill_params(gm2, 0.5f);
        CHECK_OK(mha_mpi_backward(MPI_COMM_WORLD, sch, &t2[0], self ? NULL : &t2[1],
                                  self ? NULL : &t2[2], gm2, m, &a, &in[3], acc, &ms));
        if (!s) {
            CHECKF(!memcmp(y, yp, sizeof(float) * (size_t)nq), "%s heads: output differs", desc);
            for (int i = 0; i < (self ? 1 : 3); i++)
                CHECKF(!memcmp(g1[i], g2[i], sizeof(float) * (size_t)nx[i]),
                       "%s heads: input gradient %d differs", desc, i);
            {
                char dg[260];
                snprintf(dg, sizeof dg, "%s heads", desc);
                same_grads(dg, gm1, gm2);
            }
        } else {
            char df[240];
            snprintf(df, sizeof df, "%s heads-fast", desc);
            compare(df, "output", yp, y, yd, nq);
            for (int i = 0; i < (self ? 1 : 3); i++)
                compare(df,
                        i == 0   ? "grad_query"
                        : i == 1 ? "grad_key"
                                 : "grad_value",
                        g2[i], g1[i], gd[i], nx[i]);
            compare_grads(df, gm2, gm1, gmd);
        }
    }
    for (int i = 0; i < 4; i++) free(x[i]), free(xd[i]);
    for (int i = 0; i < 3; i++) free(g1[i]), free(g2[i]), free(gd[i]);
    mha_module_destroy(gmd);
    free(y), free(yp), free(yd);
    mha_module_destroy(gm1);
    mha_module_destroy(gm2);
    mha_module_destroy(m);
}

// rope_positions and dynamic NTK scaling: refused by the sequence-parallel
// schemes (a rank sees a part of the positions), the single process's bits
// under head parallelism.
static void test_rope_positions(int id) {
    seed_rng(9000 + (uint64_t)id);
    const int64_t H = 2 * irand(1, 2), d = 8, E = H * d, L = irand(4, 30), N = irand(1, 2);
    mha_config c;
    mha_config_init(&c, E, H);
    mha_module *m = random_module(&c, 31 + (uint64_t)id);
    const int64_t n = L * N * E;
    float *x = malloc(sizeof(float) * (size_t)n), *y = malloc(sizeof(float) * (size_t)n),
          *yp = malloc(sizeof(float) * (size_t)n), *gy = malloc(sizeof(float) * (size_t)n),
          *g1 = malloc(sizeof(float) * (size_t)n), *g2 = malloc(sizeof(float) * (size_t)n);
    int64_t *pos = malloc(sizeof(int64_t) * (size_t)(N * L));
    for (int64_t i = 0; i < n; i++) x[i] = frand(), gy[i] = frand();
    for (int64_t i = 0; i < N * L; i++) pos[i] = (int64_t)(next() % 40);
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){L, N, E}),
               yt = mha_tensor_contiguous(y, MHA_F32, 3, (int64_t[]){L, N, E}),
               ypt = mha_tensor_contiguous(yp, MHA_F32, 3, (int64_t[]){L, N, E}),
               gyt = mha_tensor_contiguous(gy, MHA_F32, 3, (int64_t[]){L, N, E}),
               g1t = mha_tensor_contiguous(g1, MHA_F32, 3, (int64_t[]){L, N, E}),
               g2t = mha_tensor_contiguous(g2, MHA_F32, 3, (int64_t[]){L, N, E});
    mha_rope_scaling s = rope_scaling_of(id % 2 ? 4 : 2);
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &xt;
    a.opts.is_causal = true;
    a.impl = MHA_IMPL_FUSED;
    mha_rope_init(&a.rope, MHA_ROPE_NEOX);
    a.rope_scaling = &s;
    if (id % 3 != 1) a.rope_positions = pos;  // (dynamic alone when not)
    CHECK_OK(mha_forward(&yt, NULL, m, &a));
    CHECK_OK(mha_backward(&g1t, NULL, NULL, NULL, m, &a, &gyt, false));
    const bool refused = a.rope_positions || s.type == MHA_ROPE_SCALING_DYNAMIC;
    for (int sch = 0; sch < 2; sch++) {  // (the ranks' own tokens do not matter: refused)
        const mha_parallel p = sch ? MHA_PAR_RING : MHA_PAR_ULYSSES;
        if (refused) {
            CHECK_FAILS(mha_mpi_forward(MPI_COMM_WORLD, p, &ypt, m, &a, NULL),
                        MHA_ERR_UNSUPPORTED);
            CHECK(strstr(mha_last_error(), "rope_positions") != NULL);
        }
    }
    CHECK_OK(mha_mpi_forward(MPI_COMM_WORLD, MHA_PAR_HEADS, &ypt, m, &a, NULL));
    CHECK_OK(mha_mpi_backward(MPI_COMM_WORLD, MHA_PAR_HEADS, &g2t, NULL, NULL, NULL, m, &a,
                              &gyt, false, NULL));
    CHECKF(!memcmp(y, yp, sizeof(float) * (size_t)n) &&
               !memcmp(g1, g2, sizeof(float) * (size_t)n),
           "rope positions %d on %d ranks (L %lld N %lld H %lld scaling %d positions %d): heads "
           "differ from the single process",
           id, g_P, (long long)L, (long long)N, (long long)H, (int)s.type,
           a.rope_positions != NULL);
    free(x), free(y), free(yp), free(gy), free(g1), free(g2), free(pos);
    mha_module_destroy(m);
}

// Sharded-KV decode: the sequence arrives in chunks of 1-20 tokens, chunk
// c's keys and values kept by rank c % P; the outputs put together must
// match the single-process causal forward (tolerance rule, error vs
// float64 at most 2x) and be the same bits on every rank.
static void test_sharded_decode(int id) {
    seed_rng(5000 + (uint64_t)id);
    const int64_t Hkv = irand(1, 3), G = irand(1, 2), H = Hkv * G, d = irand(2, 6) * 2,
                  E = H * d, L = irand(20, 70), N = irand(1, 2);
    const bool rope = id & 1, bf = id % 3 == 0, cap = id % 4 == 1;
    mha_config c;
    mha_config_init(&c, E, H);
    c.num_kv_heads = Hkv;
    c.batch_first = bf;
    c.head_gate = (mha_head_gate)(id % 3);
    mha_module *m = random_module(&c, 77 + (uint64_t)id);
    if (id % 5 == 2) {
        const int64_t pr = irand(0, H - 1);
        CHECK_OK(mha_module_prune_heads(m, &pr, 1));
    }
    const int64_t n = L * N * E;
    float *x = malloc(sizeof(float) * (size_t)n), *y = malloc(sizeof(float) * (size_t)n),
          *ys = calloc((size_t)n, sizeof(float)), *y0 = malloc(sizeof(float) * (size_t)n);
    double *xd = malloc(sizeof(double) * (size_t)n), *yd = malloc(sizeof(double) * (size_t)n);
    for (int64_t i = 0; i < n; i++) xd[i] = x[i] = frand();
    const int64_t sh[3] = {bf ? N : L, bf ? L : N, E};
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, sh),
               xdt = mha_tensor_contiguous(xd, MHA_F64, 3, sh),
               yt = mha_tensor_contiguous(y, MHA_F32, 3, sh),
               ydt = mha_tensor_contiguous(yd, MHA_F64, 3, sh);
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &xt;
    a.opts.is_causal = true;
    a.impl = MHA_IMPL_FUSED;
    if (rope) mha_rope_init(&a.rope, MHA_ROPE_NEOX);
    if (cap) a.opts.softcap = 4.0f;
    // RoPE with a scaling (linear, YaRN) and, for some, positions of their
    // own (every chunk given its slice)
    mha_rope_scaling rsc = rope_scaling_of(1 + id % 2);
    int64_t *pos = malloc(sizeof(int64_t) * (size_t)(N * L)),
            *pc = malloc(sizeof(int64_t) * (size_t)(N * L));
    for (int64_t b = 0; b < N; b++)
        for (int64_t t = 0; t < L; t++) pos[b * L + t] = t < 3 * b ? 1 : t - 3 * b + 2;
    const bool own_pos = rope && id % 4 == 1;
    if (rope && id % 3 != 2) a.rope_scaling = &rsc;
    if (own_pos) a.rope_positions = pos;
    mha_forward_args ad = a;
    ad.query = ad.key = ad.value = &xdt;
    ad.impl = MHA_IMPL_REFERENCE;
    CHECK_OK(mha_forward(&yt, NULL, m, &a));
    CHECK_OK(mha_forward(&ydt, NULL, m, &ad));
    mha_kv_cache *kc = NULL;
    CHECK_OK(mha_kv_cache_create(&kc, N, Hkv, d, d, L, MHA_KV_F32));
    int chunks = 0;
    for (int64_t t0 = 0; kc && t0 < L; chunks++) {
        const int64_t T = irand(1, 20), T1 = T < L - t0 ? T : L - t0;
        mha_tensor q = xt, o = yt;
        const int sd = bf ? 1 : 0;
        q.data = x + t0 * xt.stride[sd], o.data = ys + t0 * xt.stride[sd];
        q.shape[sd] = o.shape[sd] = T1;
        mha_forward_args ac = a;
        ac.query = ac.key = ac.value = &q;
        if (own_pos) {
            for (int64_t b = 0; b < N; b++)
                for (int64_t t = 0; t < T1; t++) pc[b * T1 + t] = pos[b * L + t0 + t];
            ac.rope_positions = pc;
        }
        mha_mpi_stats ms;
        CHECK_OK(mha_mpi_forward_cached(MPI_COMM_WORLD, &o, m, &ac, kc, chunks % g_P, &ms));
        t0 += T1;
    }
    char desc[200];
    snprintf(desc, sizeof desc,
             "sharded decode %d on %d ranks (E %lld H %lld Hkv %lld L %lld N "
             "%lld rope %d scaling %d positions %d bf %d softcap %d gate %d, %d chunks)",
             id, g_P, (long long)E, (long long)H, (long long)Hkv, (long long)L, (long long)N,
             rope, a.rope_scaling ? (int)rsc.type : 0, own_pos, bf, cap, (int)c.head_gate,
             chunks);
    compare(desc, "output", ys, y, yd, n);
    memcpy(y0, ys, sizeof(float) * (size_t)n);
    MPI_Bcast(y0, (int)n, MPI_FLOAT, 0, MPI_COMM_WORLD);
    CHECKF(!memcmp(y0, ys, sizeof(float) * (size_t)n),
           "%s: rank %d's output differs from rank "
           "0's",
           desc, g_rank);
    for (int64_t b = 0; kc && b < N; b++) {  // every token cached once, somewhere
        int64_t mine = mha_kv_cache_length(kc, b), tot = 0;
        MPI_Allreduce(&mine, &tot, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
        CHECKF(tot == L, "%s: %lld tokens cached in all, want %lld", desc, (long long)tot,
               (long long)L);
    }
    // errors: every rank fails alike; a full cache on the owner changes nothing
    mha_tensor q1 = xt;
    q1.shape[bf ? 1 : 0] = 1;
    float y1[64 * 2 * 12];
    mha_tensor o1 = mha_tensor_contiguous(y1, MHA_F32, 3, q1.shape);
    mha_forward_args a1 = a;
    a1.query = a1.key = a1.value = &q1;
    CHECK_FAILS(mha_mpi_forward_cached(MPI_COMM_WORLD, &o1, m, &a1, kc, g_P, NULL),
                MHA_ERR_INVALID_ARG);
    a1.opts.window_left = 3;
    CHECK_FAILS(mha_mpi_forward_cached(MPI_COMM_WORLD, &o1, m, &a1, kc, 0, NULL),
                MHA_ERR_UNSUPPORTED);
    a1.opts.window_left = -1;
    // the owner whose cache is full: rank 0 holds chunk 0's tokens at least
    const int full = 0;
    const int64_t before = mha_kv_cache_length(kc, 0);
    mha_kv_cache *small = NULL;
    CHECK_OK(mha_kv_cache_create(&small, N, Hkv, d, d, 1, MHA_KV_F32));
    mha_kv_cache *use = g_rank == full ? small : kc;
    CHECK_OK(mha_mpi_forward_cached(MPI_COMM_WORLD, &o1, m, &a1, use, full, NULL));  // fills it
    const mha_status st = mha_mpi_forward_cached(MPI_COMM_WORLD, &o1, m, &a1, use, full, NULL);
    CHECKF(st == MHA_ERR_INVALID_ARG, "%s: a full cache on rank %d: rank %d got %s (%s)", desc,
           full, g_rank, mha_status_string(st), mha_last_error());
    if (g_rank == full) CHECK(mha_kv_cache_length(small, 0) == 1);
    CHECK(mha_kv_cache_length(kc, 0) == before);
    mha_kv_cache_destroy(small);
    mha_kv_cache_destroy(kc);
    mha_module_destroy(m);
    free(x), free(y), free(ys), free(y0), free(xd), free(yd), free(pos), free(pc);
}

// Zigzag balancing: a causal ring forward and backward with chunks of 256
// tokens gives every rank the same number of score tiles, and each rank
// sends what the communication model says.
static void test_ring_balance(void) {
    mha_config c;
    mha_config_init(&c, 16, 2);
    mha_module *m = random_module(&c, 9), *g = NULL;
    CHECK_OK(mha_module_create(&g, &c));
    const int64_t L = 2 * (int64_t)g_P * 256, N = 1, E = 16;
    int64_t cs[2], cl[2];
    mha_mpi_ring_chunks(L, g_P, g_rank, cs, cl);
    const int64_t Lr = cl[0] + cl[1];
    float *x = malloc(sizeof(float) * (size_t)(3 * Lr * N * E));
    for (int64_t i = 0; i < 3 * Lr * N * E; i++) x[i] = frand();
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){Lr, N, E}),
               yt = mha_tensor_contiguous(x + Lr * N * E, MHA_F32, 3, (int64_t[]){Lr, N, E}),
               gt = mha_tensor_contiguous(x + 2 * Lr * N * E, MHA_F32, 3, (int64_t[]){Lr, N, E});
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &xt;
    a.opts.is_causal = true;
    for (int bwd = 0; bwd < 2; bwd++) {
        mha_mpi_stats ms;
        if (bwd)
            CHECK_OK(mha_mpi_backward(MPI_COMM_WORLD, MHA_PAR_RING, &yt, NULL, NULL, g, m, &a,
                                      &gt, false, &ms));
        else CHECK_OK(mha_mpi_forward(MPI_COMM_WORLD, MHA_PAR_RING, &yt, m, &a, &ms));
        int64_t lo = 0, hi = 0;
        MPI_Allreduce(&ms.tiles, &lo, 1, MPI_INT64_T, MPI_MIN, MPI_COMM_WORLD);
        MPI_Allreduce(&ms.tiles, &hi, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
        CHECKF(lo == hi && lo > 0,
               "ring %s on %d ranks: score tiles per rank from %lld to %lld",
               bwd ? "backward" : "forward", g_P, (long long)lo, (long long)hi);
        CHECKF(ms.bytes_sent == ms.bytes_model && (g_P == 1 || ms.bytes_sent > 0),
               "ring %s, rank %d: sent %.0f bytes, model %.0f", bwd ? "backward" : "forward",
               g_rank, ms.bytes_sent, ms.bytes_model);
    }
    free(x);
    mha_module_destroy(g);
    mha_module_destroy(m);
}

// Rank P-1 passes a query of the wrong width: every rank fails, with that
// rank's message, in every scheme (ring: the failure comes from the fused
// path on that rank, while the others wait in the ring's first exchange;
// also the backward, and a token count off the zigzag split).
static void test_failure(void) {
    mha_config c;
    mha_config_init(&c, 8, 2);
    mha_module *m = NULL, *g = NULL;
    CHECK_OK(mha_module_create(&m, &c));
    CHECK_OK(mha_module_create(&g, &c));
    static float x[4 * 9] = {0}, y[4 * 9];
    const mha_parallel sch[3] = {MHA_PAR_HEADS, MHA_PAR_ULYSSES, MHA_PAR_RING};
    for (int k = 0; k < 3 * 2 + (g_P > 1); k++) {  // (one rank: any length is its zigzag)
        const mha_parallel s = sch[k < 6 ? k / 2 : 2];
        const bool bwd = k < 6 && k % 2, zig = k == 6;
        const int64_t F = !zig && g_rank == g_P - 1 ? 9 : 8,
                      T = zig && g_rank == g_P - 1
                              ? 3
                              : 4;  // (4 tokens a rank: the zigzag split of 4 P)
        mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 2, (int64_t[]){T, F});
        mha_tensor yt = mha_tensor_contiguous(y, MHA_F32, 2, (int64_t[]){T, 8});
        mha_forward_args a;
        mha_forward_args_init(&a);
        a.query = a.key = a.value = &xt;
        a.opts.is_causal = true;
        if (getenv("MHA_TEST_TRACE")) fprintf(stderr, "rank %d: failure case %d\n", g_rank, k);
        const double t = MPI_Wtime();
        mha_status st = bwd ? mha_mpi_backward(MPI_COMM_WORLD, s, &xt, NULL, NULL, g, m, &a,
                                               &yt, false, NULL)
                            : mha_mpi_forward(MPI_COMM_WORLD, s, &yt, m, &a, NULL);
        if (getenv("MHA_TEST_TRACE"))
            fprintf(stderr, "rank %d: case %d -> %s: %s\n", g_rank, k, mha_status_string(st),
                    mha_last_error());
        CHECKF(st == MHA_ERR_SHAPE, "%s %s, bad input on rank %d: rank %d got %s (%s)",
               mha_parallel_name(s), bwd ? "backward" : "forward", g_P - 1, g_rank,
               mha_status_string(st), mha_last_error());
        char want[32];
        snprintf(want, sizeof want, "rank %d", g_P - 1);
        CHECKF(strstr(mha_last_error(), want) != NULL || g_rank == g_P - 1 || zig,
               "rank %d's message: %s", g_rank, mha_last_error());
        CHECKF(strstr(mha_last_error(), zig ? "zigzag" : "9") != NULL,
               "%s: the message names "
               "the problem: %s",
               mha_parallel_name(s), mha_last_error());
        CHECK(MPI_Wtime() - t < 10.0);
    }
    mha_module_destroy(g);
    mha_module_destroy(m);
}

// --kill: the last rank kills itself while the others are inside a
// collective call (heads); --kill ring: 0.3 s into a run of ring forwards
// and backwards, from a timer, while the others compute or wait in the
// ring's exchanges. mpiexec must end the job (tests/mpi/test_killed.sh
// checks that it does, promptly, with a message).
static void die(int sig) {
    (void)sig;
    raise(SIGKILL);
}

static int kill_mode(bool ring) {
    mha_config c;
    mha_config_init(&c, 64, 4);
    mha_module *m = NULL, *g = NULL;
    if (mha_module_create(&m, &c) || mha_module_create(&g, &c)) return 1;
    static float x[2048 * 64], y[2048 * 64], gy[2048 * 64];
    const int64_t T = ring ? 2048 : 512;
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 2, (int64_t[]){T, 64});
    mha_tensor yt = mha_tensor_contiguous(y, MHA_F32, 2, (int64_t[]){T, 64});
    mha_tensor gt = mha_tensor_contiguous(gy, MHA_F32, 2, (int64_t[]){T, 64});
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &xt;
    a.opts.is_causal = true;
    mha_status st = MHA_OK;
    if (ring) {
        if (g_rank == g_P - 1) {
            signal(SIGALRM, die);
            struct itimerval it = {{0, 0}, {0, 300000}};
            setitimer(ITIMER_REAL, &it, NULL);
        }
        for (int i = 0; i < 1000 && !st; i++) {  // (each rank: 2048 of its zigzag tokens)
            st = mha_mpi_forward(MPI_COMM_WORLD, MHA_PAR_RING, &yt, m, &a, NULL);
            if (!st)
                st = mha_mpi_backward(MPI_COMM_WORLD, MHA_PAR_RING, &yt, NULL, NULL, g, m, &a,
                                      &gt, false, NULL);
        }
    } else {
        if (g_rank == g_P - 1) raise(SIGKILL);
        st = mha_mpi_forward(MPI_COMM_WORLD, MHA_PAR_HEADS, &yt, m, &a, NULL);
    }
    printf("rank %d: returned %s (the job should have been ended)\n", g_rank,
           mha_status_string(st));
    mha_module_destroy(g);
    mha_module_destroy(m);
    MPI_Finalize();
    return 0;
}

// The checkpoint layouts across ranks: separate q/k/v with kdim = vdim = E,
// no out_proj.bias and a custom scale run (head parallelism: the single
// process's bits; the others within the tolerance); head_dim != E / H is
// refused (MHA_ERR_UNSUPPORTED naming head_dim) by every scheme and the
// sharded cache, on every rank alike; attention sinks are refused too.
static void test_layouts(void) {
    seed_rng(777);
    enum { E = 24, H = 4, L = 19, N = 2 };
    mha_config c;
    mha_config_init(&c, E, H);
    c.num_kv_heads = 2;
    c.separate_qkv = true;
    c.no_out_bias = true;
    mha_module *m = random_module(&c, 5);
    float x[L * N * E], gy[L * N * E], y1[L * N * E], y2[L * N * E], g1[L * N * E],
        g2[L * N * E];
    for (int i = 0; i < L * N * E; i++) x[i] = frand(), gy[i] = frand();
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){L, N, E}),
               gyt = mha_tensor_contiguous(gy, MHA_F32, 3, (int64_t[]){L, N, E}),
               y1t = mha_tensor_contiguous(y1, MHA_F32, 3, (int64_t[]){L, N, E}),
               y2t = mha_tensor_contiguous(y2, MHA_F32, 3, (int64_t[]){L, N, E}),
               g1t = mha_tensor_contiguous(g1, MHA_F32, 3, (int64_t[]){L, N, E}),
               g2t = mha_tensor_contiguous(g2, MHA_F32, 3, (int64_t[]){L, N, E});
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &xt;
    a.opts.is_causal = true;
    a.impl = MHA_IMPL_FUSED;
    a.opts.scale = 0.3;
    CHECK_OK(mha_forward(&y1t, NULL, m, &a));
    mha_module *gr1 = NULL, *gr2 = NULL;
    CHECK_OK(mha_module_create(&gr1, mha_module_config(m)));
    CHECK_OK(mha_module_create(&gr2, mha_module_config(m)));
    CHECK_OK(mha_backward(&g1t, NULL, NULL, gr1, m, &a, &gyt, false));
    CHECK_OK(mha_mpi_forward(MPI_COMM_WORLD, MHA_PAR_HEADS, &y2t, m, &a, NULL));
    CHECKF(!memcmp(y1, y2, sizeof y1), "layouts on %d ranks: heads forward differs", g_P);
    CHECK_OK(mha_mpi_backward(MPI_COMM_WORLD, MHA_PAR_HEADS, &g2t, NULL, NULL, gr2, m, &a,
                              &gyt, false, NULL));
    CHECKF(!memcmp(g1, g2, sizeof g1), "layouts on %d ranks: heads grad_query differs", g_P);
    same_grads("layouts (heads)", gr1, gr2);
    CHECK_OK(mha_mpi_forward(MPI_COMM_WORLD, MHA_PAR_HEADS_FAST, &y2t, m, &a, NULL));
    CHECKF(rel_err(y1, y2, L * N * E) < 2e-5, "layouts on %d ranks: heads-fast err %g", g_P,
           rel_err(y1, y2, L * N * E));
    mha_module_destroy(gr1), mha_module_destroy(gr2), mha_module_destroy(m);
    // head_dim != E / H: refused
    c.head_dim = 5;
    m = random_module(&c, 6);
    static const mha_parallel sch[4] = {MHA_PAR_HEADS, MHA_PAR_HEADS_FAST, MHA_PAR_ULYSSES,
                                        MHA_PAR_RING};
    for (int i = 0; i < 4; i++) {
        CHECK_FAILS(mha_mpi_forward(MPI_COMM_WORLD, sch[i], &y2t, m, &a, NULL),
                    MHA_ERR_UNSUPPORTED);
        CHECK(strstr(mha_last_error(), "head_dim") != NULL);
    }
    mha_kv_cache *kc = NULL;
    CHECK_OK(mha_kv_cache_create(&kc, N, 2, 5, 5, L, MHA_KV_F32));
    mha_forward_args ac = a;
    ac.opts.is_causal = false;
    CHECK_FAILS(mha_mpi_forward_cached(MPI_COMM_WORLD, &y2t, m, &ac, kc, 0, NULL),
                MHA_ERR_UNSUPPORTED);
    mha_kv_cache_destroy(kc);
    mha_module_destroy(m);
    // attention sinks: refused too
    c.head_dim = 0;
    c.sinks = true;
    m = random_module(&c, 7);
    CHECK_FAILS(mha_mpi_forward(MPI_COMM_WORLD, MHA_PAR_HEADS, &y2t, m, &a, NULL),
                MHA_ERR_UNSUPPORTED);
    CHECK(strstr(mha_last_error(), "sinks") != NULL);
    mha_module_destroy(m);
}

int main(int argc, char **argv) {
    int provided = 0;  // (OpenMP threads; only the main one calls MPI)
    MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_P);
    if (argc > 1 && !strcmp(argv[1], "--kill"))
        return kill_mode(argc > 2 && !strcmp(argv[2], "ring"));
    for (int id = 0; id < 40; id++) one_case(id);
    for (int id = 0; id < 12; id++) test_sharded_decode(id);
    for (int id = 0; id < 6; id++) test_rope_positions(id);
    test_ring_balance();
    test_failure();
    test_layouts();
    int counts[2] = {check_passed_, check_failed_}, total[2];
    MPI_Reduce(counts, total, 2, MPI_INT, MPI_SUM, 0, MPI_COMM_WORLD);
    int any = check_failed_ > 0, all_any = 0;
    MPI_Allreduce(&any, &all_any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (g_rank == 0)
        printf("test_mpi (%d ranks): %d passed, %d failed\n", g_P, total[0], total[1]);
    MPI_Finalize();
    return all_any ? 1 : 0;
}
