// test_parts.c: the head parts the distributed layer (src/mpi) is built
// on, in one process. For P = 1..4 parts of the KV heads:
//   exact: the parts' contexts (disjoint columns) put together and run
//     through mha__part_out_project give the fused forward's output bit for
//     bit; the parts' parameter gradients (disjoint, the rest exactly 0)
//     added give the fused backward's, and the projections' gradients put
//     together through mha__part_input_grads its input gradients, bit for
//     bit;
//   fast: the parts' partial outputs and partial input gradients added in
//     part order are within the tolerance of the fused results.
// Random configurations: packed or separate projections, grouped-query
// heads, gates, pruned heads, causal, key padding, RoPE, bias_kv.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "util.h"
#include "mha.h"
#include "part.h"


// layout: the checkpoint layouts too (head_dim != E / H, separate q/k/v,
// no out_proj.bias, a custom scale; their draws only then).
static void one_case(int id, bool layout) {
    const int64_t Hkv = irand(1, 4), G = irand(1, 3), H = Hkv * G, d = irand(2, 8) * 2,
                  E = layout ? irand(1, 40) : H * d, L = irand(1, 70), N = irand(1, 2),
                  Eq = H * d;
    const bool self = next() % 3 != 0, causal = next() & 1, kpm = next() % 3 == 0,
               rope = next() % 3 == 0, bkv = next() % 4 == 0;
    const int64_t S = self ? L : irand(1, 70);
    mha_config c;
    mha_config_init(&c, E, H);
    c.num_kv_heads = Hkv;
    c.head_dim = d;
    if (layout) c.separate_qkv = next() & 1, c.no_out_bias = next() & 1;
    c.head_gate = (mha_head_gate)(next() % 3);
    c.add_bias_kv = bkv;
    if (!self && next() % 2) c.kdim = irand(1, 20), c.vdim = irand(1, 20);
    mha_module *m = random_module(&c, (uint64_t)id);  // gates and biases non-trivial
    if (next() % 3 == 0) {
        const int64_t pr = irand(0, H - 1);
        CHECK_OK(mha_module_prune_heads(m, &pr, 1));
    }
    const int64_t kd = mha_module_config(m)->kdim, vd = mha_module_config(m)->vdim;
    test_inputs in;
    test_inputs_make(&in, L, S, N, E, kd, vd, 5);
    mha_forward_args a;
    test_inputs_args(&a, &in, self);
    a.opts.is_causal = causal;
    a.impl = MHA_IMPL_FUSED;
    if (kpm) a.key_padding_mask = &in.kpt;
    if (rope) mha_rope_init(&a.rope, MHA_ROPE_NEOX);
    if (layout && next() % 2) a.opts.scale = 0.3;
    const int64_t nqq = L * N * Eq;  // the context and dq (Rq, Eq)
    const int64_t nq = L * N * E, nk = S * N * kd, nv = S * N * vd, nkv = S * N * (Hkv * d);
    // the single-process fused results
    float *y = malloc(sizeof(float) * (size_t)nq), *gq = malloc(sizeof(float) * (size_t)nq),
          *gk = malloc(sizeof(float) * (size_t)nk), *gv = malloc(sizeof(float) * (size_t)nv);
    mha_tensor yt = mha_tensor_contiguous(y, MHA_F32, 3, (int64_t[]){L, N, E});
    mha_tensor gqt = mha_tensor_contiguous(gq, MHA_F32, 3, (int64_t[]){L, N, E}),
               gkt = mha_tensor_contiguous(gk, MHA_F32, 3, (int64_t[]){S, N, kd}),
               gvt = mha_tensor_contiguous(gv, MHA_F32, 3, (int64_t[]){S, N, vd});
    mha_module *g = NULL;
    CHECK_OK(mha_module_create(&g, mha_module_config(m)));
    CHECK_OK(mha_forward(&yt, NULL, m, &a));
    CHECK_OK(mha_backward(&gqt, self ? NULL : &gkt, self ? NULL : &gvt, g, m, &a, &in.gyt,
                          false));
    float *ctx = malloc(sizeof(float) * (size_t)nqq),
          *cr = malloc(sizeof(float) * (size_t)nqq), *yp = malloc(sizeof(float) * (size_t)nq),
          *ys = malloc(sizeof(float) * (size_t)nq), *dq = malloc(sizeof(float) * (size_t)nqq),
          *dk = malloc(sizeof(float) * (size_t)nkv), *dv = malloc(sizeof(float) * (size_t)nkv),
          *dqr = malloc(sizeof(float) * (size_t)nqq),
          *dkr = malloc(sizeof(float) * (size_t)nkv),
          *dvr = malloc(sizeof(float) * (size_t)nkv),
          *dz = malloc(sizeof(float) * (size_t)(L * N * H)),
          *dzr = malloc(sizeof(float) * (size_t)(L * N * H)),
          *x1 = malloc(sizeof(float) * (size_t)nq), *x2 = malloc(sizeof(float) * (size_t)nk),
          *x3 = malloc(sizeof(float) * (size_t)nv), *s1 = malloc(sizeof(float) * (size_t)nq),
          *s2 = malloc(sizeof(float) * (size_t)nk), *s3 = malloc(sizeof(float) * (size_t)nv);
    for (int64_t P = 1; P <= 4 && P <= Hkv; P++) {
        memset(ctx, 0, sizeof(float) * (size_t)nqq);
        memset(ys, 0, sizeof(float) * (size_t)nq);
        memset(dq, 0, sizeof(float) * (size_t)nqq);
        memset(dk, 0, sizeof(float) * (size_t)nkv);
        memset(dv, 0, sizeof(float) * (size_t)nkv);
        memset(dz, 0, sizeof(float) * (size_t)(L * N * H));
        memset(s1, 0, sizeof(float) * (size_t)nq);
        memset(s2, 0, sizeof(float) * (size_t)nk);
        memset(s3, 0, sizeof(float) * (size_t)nv);
        mha_module *gs = NULL, *gr = NULL;
        CHECK_OK(mha_module_create(&gs, mha_module_config(m)));
        CHECK_OK(mha_module_create(&gr, mha_module_config(m)));
        for (int i = 0; gs && i < mha_module_num_params(gs); i++) {
            mha_param p;
            CHECK_OK(mha_module_param_at(&p, gs, i));
            memset(p.data, 0, sizeof(float) * (size_t)p.numel);
        }
        for (int64_t r = 0; r < P; r++) {
            mha__part pt = {
                .g0 = Hkv * r / P, .g1 = Hkv * (r + 1) / P, .out.ctx = cr, .bias = r == 0};
            CHECK_OK(mha__part_forward(NULL, m, &a, &pt));
            for (int64_t i = 0; i < nqq; i++) ctx[i] += cr[i];  // disjoint columns
            pt.out.ctx = NULL;
            mha_tensor ypt = mha_tensor_contiguous(yp, MHA_F32, 3, (int64_t[]){L, N, E});
            CHECK_OK(mha__part_forward(&ypt, m, &a, &pt));
            for (int64_t i = 0; i < nq; i++) ys[i] += yp[i];
            pt.out.dq = dqr, pt.out.dk = dkr, pt.out.dv = dvr, pt.out.dz = dzr;
            mha_tensor t1 = mha_tensor_contiguous(x1, MHA_F32, 3, (int64_t[]){L, N, E}),
                       t2 = mha_tensor_contiguous(x2, MHA_F32, 3, (int64_t[]){S, N, kd}),
                       t3 = mha_tensor_contiguous(x3, MHA_F32, 3, (int64_t[]){S, N, vd});
            CHECK_OK(mha__part_backward(&t1, self ? NULL : &t2, self ? NULL : &t3, gr, m, &a,
                                        &in.gyt, &pt));
            for (int64_t i = 0; i < nqq; i++) dq[i] += dqr[i];
            for (int64_t i = 0; i < nq; i++) s1[i] += x1[i];
            for (int64_t i = 0; i < nkv; i++) dk[i] += dkr[i], dv[i] += dvr[i];
            if (c.head_gate == MHA_GATE_DYNAMIC)
                for (int64_t i = 0; i < L * N * H; i++) dz[i] += dzr[i];
            for (int64_t i = 0; !self && i < nk; i++) s2[i] += x2[i];
            for (int64_t i = 0; !self && i < nv; i++) s3[i] += x3[i];
            for (int i = 0; gs && gr && i < mha_module_num_params(gs); i++) {
                mha_param ps, prr;
                CHECK_OK(mha_module_param_at(&ps, gs, i));
                CHECK_OK(mha_module_param_at(&prr, gr, i));
                for (int64_t j = 0; j < ps.numel; j++) ps.data[j] += prr.data[j];
            }
        }
        char desc[200];
        snprintf(desc, sizeof desc,
                 "case %d P %lld (E %lld H %lld Hkv %lld L %lld S %lld N %lld "
                 "self %d causal %d kpm %d rope %d bkv %d gate %d d %lld sep %d nob %d)",
                 id, (long long)P, (long long)E, (long long)H, (long long)Hkv, (long long)L,
                 (long long)S, (long long)N, self, causal, kpm, rope, bkv, (int)c.head_gate,
                 (long long)d, c.separate_qkv, c.no_out_bias);
        mha_tensor yet = mha_tensor_contiguous(yp, MHA_F32, 3, (int64_t[]){L, N, E});
        CHECK_OK(mha__part_out_project(&yet, m, &a, ctx));
        CHECKF(!memcmp(yp, y, sizeof(float) * (size_t)nq), "%s: exact output differs", desc);
        double e = rel_err(y, ys, nq);
        CHECKF(e < 2e-5, "%s: fast output err %g", desc, e);
        for (int i = 0; gs && i < mha_module_num_params(gs); i++) {
            mha_param ps, pf;
            CHECK_OK(mha_module_param_at(&ps, gs, i));
            CHECK_OK(mha_module_param_at(&pf, g, i));
            CHECKF(!memcmp(ps.data, pf.data, sizeof(float) * (size_t)ps.numel),
                   "%s: grad %s differs (rel err %g)", desc, ps.name,
                   rel_err(pf.data, ps.data, ps.numel));
        }
        mha_tensor t1 = mha_tensor_contiguous(x1, MHA_F32, 3, (int64_t[]){L, N, E}),
                   t2 = mha_tensor_contiguous(x2, MHA_F32, 3, (int64_t[]){S, N, kd}),
                   t3 = mha_tensor_contiguous(x3, MHA_F32, 3, (int64_t[]){S, N, vd});
        CHECK_OK(mha__part_input_grads(&t1, self ? NULL : &t2, self ? NULL : &t3, m, &a, dq,
                                       dk, dv, dz, false));
        CHECKF(!memcmp(x1, gq, sizeof(float) * (size_t)nq),
               "%s: exact grad_query differs "
               "(rel err %g)",
               desc, rel_err(gq, x1, nq));
        if (!self) {
            CHECKF(!memcmp(x2, gk, sizeof(float) * (size_t)nk), "%s: exact grad_key differs",
                   desc);
            CHECKF(!memcmp(x3, gv, sizeof(float) * (size_t)nv), "%s: exact grad_value differs",
                   desc);
            e = fmax(rel_err(gk, s2, nk), rel_err(gv, s3, nv));
            CHECKF(e < 1e-4, "%s: fast grad_key/value err %g", desc, e);
        }
        e = rel_err(gq, s1, nq);
        CHECKF(e < 1e-4, "%s: fast grad_query err %g", desc, e);
        mha_module_destroy(gs);
        mha_module_destroy(gr);
    }
    test_inputs_free(&in);
    free(y), free(gq), free(gk), free(gv);
    free(ctx), free(cr), free(yp), free(ys), free(dq), free(dk), free(dv), free(dqr), free(dkr);
    free(dvr), free(dz), free(dzr), free(x1), free(x2), free(x3), free(s1), free(s2), free(s3);
    mha_module_destroy(g);
    mha_module_destroy(m);
}

int main(void) {
    seed_rng(4242);
    for (int id = 0; id < 40; id++) one_case(id, false);
    for (int id = 40; id < 70; id++) one_case(id, true);
    // a bad range
    mha_config c;
    mha_config_init(&c, 8, 2);
    mha_module *m = NULL;
    CHECK_OK(mha_module_create(&m, &c));
    float x[8] = {0}, cx[8];
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 2, (int64_t[]){1, 8});
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &xt;
    mha__part pt = {.g0 = 1, .g1 = 3, .out.ctx = cx};
    CHECK_FAILS(mha__part_forward(NULL, m, &a, &pt), MHA_ERR_INVALID_ARG);
    mha_module_destroy(m);
    return check_summary("test_parts");
}
