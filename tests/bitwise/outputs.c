// outputs.c: a fixed, seeded set of library calls whose every output is
// hashed (FNV-1a 64 over the bytes), one line per call: the fingerprint a
// behaviour-preserving change must keep bit for bit (tests/bitwise/run.sh
// runs it before and after and compares). Public API only, so the same
// source builds against any version of the library.
//
// Covered: mha_forward (reference, fused, auto; every module option and
// forward argument, input and weight dtypes, strided views, weights blocks
// and int8 weights, dropout), mha_backward (both implementations, saved
// state, accumulate), mha_sdpa, mha_sdpa_varlen, mha_rope_apply, the KV
// cache (every storage type, chunked appends, truncate) and
// mha_forward_cached, mha_diag_create, the optimizers.
//
// Status codes are hashed with the outputs; error messages are not (a
// change may word them better).
//
//   outputs [--cases N] [--write-inputs DIR]
// --write-inputs also writes safetensors inputs for run.sh's CLI runs.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mha.h"

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint64_t next(void) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return rng >> 11;
}
static float frand(void) { return (float)((double)next() * 0x1p-53 * 2.0 - 1.0); }
static int64_t irand(int64_t lo, int64_t hi) {
    return lo + (int64_t)(next() % (uint64_t)(hi - lo + 1));
}
static int coin(int percent) { return (int)(next() % 100) < percent; }

typedef struct hash {
    uint64_t h;
} hash;
static void hinit(hash *h) { h->h = 1469598103934665603ull; }
static void hbytes(hash *h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h->h = (h->h ^ b[i]) * 1099511628211ull;
}
static void hint(hash *h, int64_t v) { hbytes(h, &v, sizeof v); }

static void emit(const char *what, int64_t i, const char *tag, mha_status st, const hash *h) {
    printf("%s %lld %s status %d hash %016llx\n", what, (long long)i, tag, (int)st,
           (unsigned long long)h->h);
}

// A buffer of n floats, contiguous.
static float *fbuf(int64_t n) {
    float *p = calloc((size_t)(n > 0 ? n : 1), sizeof(float));
    if (!p) exit(1);
    return p;
}
static void fill(float *p, int64_t n) {
    for (int64_t i = 0; i < n; i++) p[i] = frand();
}

// An input view of logical shape dims (ndim), dtype dt, with the last dim
// padded by `pad` elements (a strided view); the values drawn uniformly in
// [-1, 1) and stored in dt. Returns the buffer (free it).
static void *make_input(mha_tensor *t, mha_dtype dt, int ndim, const int64_t *dims,
                        int64_t pad) {
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= dims[i];
    const int64_t last = ndim ? dims[ndim - 1] : 1, rows = last ? n / last : 0;
    const int64_t ld = last + pad, total = rows * ld + 1;
    const size_t es = mha_dtype_size(dt);
    unsigned char *buf = calloc((size_t)total, es);
    if (!buf) exit(1);
    for (int64_t i = 0; i < total; i++) {
        const float x = frand();
        if (dt == MHA_F32) ((float *)buf)[i] = x;
        else if (dt == MHA_F64) ((double *)buf)[i] = (double)x;
        else if (dt == MHA_BF16) ((uint16_t *)buf)[i] = mha_f32_to_bf16(x);
        else if (dt == MHA_F16) ((uint16_t *)buf)[i] = mha_f32_to_f16(x);
    }
    memset(t, 0, sizeof *t);
    t->data = buf;
    t->dtype = dt;
    t->ndim = ndim;
    int64_t s = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        t->shape[i] = dims[i];
        t->stride[i] = s;
        s *= i == ndim - 1 ? ld : dims[i];
    }
    return buf;
}

static void hparams(hash *h, const mha_module *m) {
    for (int i = 0; i < mha_module_num_params(m); i++) {
        mha_param p;
        if (mha_module_param_at(&p, m, i) || !p.data) continue;
        hbytes(h, p.data, sizeof(float) * (size_t)p.numel);
    }
}

static void randomize_params(mha_module *m) {
    for (int i = 0; i < mha_module_num_params(m); i++) {
        mha_param p;
        if (mha_module_param_at(&p, m, i) || !p.data) continue;
        if (p.ndim == 1 || strstr(p.name, "gate"))
            for (int64_t j = 0; j < p.numel; j++) p.data[j] = 0.5f * frand();
    }
}

static const mha_dtype in_dtypes[4] = {MHA_F32, MHA_F32, MHA_BF16, MHA_F64};

// ---------------------------------------------------------------------------
// The module: forward and backward on random configurations

typedef struct mcase {
    mha_config c;
    int64_t L, S, N;
    bool self, unbatched;
    mha_dtype qdt;
    int64_t pad;
    int kpm_kind, am_kind;  // 0 none, 1 bool, 2 float; am: 3 3-D bool
    mha_forward_args a;
    int64_t prune[2];
    int nprune;
    int64_t rope_start[8];
    float slopes[16];
} mcase;

static void draw_case(mcase *k) {
    memset(k, 0, sizeof *k);
    static const int64_t hs[] = {1, 2, 3, 4, 6, 8};
    const int64_t H = hs[irand(0, 5)], d = coin(15) ? 16 : irand(1, 9);
    mha_config_init(&k->c, H * d, H);
    int64_t divs[8], nd = 0;
    for (int64_t g = 1; g <= H; g++)
        if (H % g == 0) divs[nd++] = g;
    if (coin(35)) k->c.num_kv_heads = divs[irand(0, nd - 1)];
    k->self = coin(50);
    if (!k->self && coin(30)) k->c.kdim = irand(1, 12), k->c.vdim = irand(1, 12);
    k->c.bias = !coin(20);
    k->c.add_bias_kv = coin(20);
    k->c.add_zero_attn = coin(15);
    k->c.batch_first = coin(40);
    k->c.head_gate = (mha_head_gate)irand(0, 2);
    if (coin(15)) k->c.weight_dtype = coin(50) ? MHA_BF16 : MHA_F16;
    if (coin(25)) k->c.dropout = 0.2f;
    if (coin(15)) k->c.out_dropout = 0.1f;
    k->L = coin(15) ? irand(60, 140) : irand(1, 24);
    k->S = k->self ? k->L : (coin(15) ? irand(60, 140) : irand(1, 24));
    k->N = irand(1, 3);
    k->unbatched = coin(12);
    if (k->unbatched) k->N = 1;
    k->qdt = in_dtypes[irand(0, 3)];
    k->pad = coin(20) ? irand(1, 3) : 0;
    k->kpm_kind = (int)irand(0, 2);
    k->am_kind = coin(50) ? 0 : (int)irand(1, 3);
    if (k->unbatched && k->am_kind == 3) k->am_kind = 1;
    mha_forward_args *a = &k->a;
    mha_forward_args_init(a);
    a->opts.is_causal = coin(30);
    if (coin(20)) a->opts.window_left = irand(0, 6);
    if (coin(15)) a->opts.window_right = irand(0, 6);
    a->need_weights = coin(40);
    a->average_attn_weights = coin(60);
    if (a->need_weights && coin(25)) {
        a->weights_head_begin = irand(0, H - 1);
        a->weights_head_end = irand(a->weights_head_begin + 1, H);
        a->weights_row_begin = irand(0, k->L - 1);
        a->weights_row_end = coin(50) ? -1 : irand(a->weights_row_begin, k->L);
    }
    a->training = coin(30);
    a->opts.dropout_seed = next() % 1000;
    a->opts.dropout_offset = next() % 1000;
    if (coin(25)) {
        mha_rope_init(&a->rope, coin(50) ? MHA_ROPE_NEOX : MHA_ROPE_INTERLEAVED);
        if (d >= 4 && coin(40)) a->rope.dim = 2 * irand(1, d / 2);
        if (coin(30)) a->rope.theta = 500.0;
        if (coin(40)) {
            for (int i = 0; i < 8; i++) k->rope_start[i] = irand(0, 9);
            a->rope_start = k->rope_start;
        }
    }
    if (coin(15)) {
        a->opts.alibi = true;
        if (coin(40)) {
            for (int i = 0; i < 16; i++) k->slopes[i] = 0.3f * frand();
            a->opts.alibi_slopes = k->slopes;
        }
    }
    if (coin(15)) a->opts.softcap = 2.5f;
    k->nprune = coin(15) ? (int)irand(1, H > 1 ? 2 : 1) : 0;
    for (int i = 0; i < k->nprune; i++) k->prune[i] = irand(0, H - 1);
}

typedef struct mrun {
    mha_module *m;
    mha_tensor q, kk, v, kpm, am;
    void *qb, *kb, *vb, *kpmb, *amb;
    int64_t qdims[3], kdims[3], vdims[3];
    int nd;
} mrun;

static mha_status setup(mrun *r, mcase *k) {
    memset(r, 0, sizeof *r);
    mha_status st = mha_module_create(&r->m, &k->c);
    if (st) return st;
    mha_init_options io;
    mha_init_options_init(&io);
    io.seed = next() % 100000;
    if ((st = mha_module_init(r->m, &io))) return st;
    if (k->c.weight_dtype == MHA_F32) randomize_params(r->m);
    if (k->nprune && (st = mha_module_prune_heads(r->m, k->prune, k->nprune))) return st;
    const mha_config *c = mha_module_config(r->m);
    const int64_t E = c->embed_dim, kd = c->kdim ? c->kdim : E, vd = c->vdim ? c->vdim : E;
    r->nd = k->unbatched ? 2 : 3;
    int64_t *qd = r->qdims, *kd3 = r->kdims, *vd3 = r->vdims;
    if (k->unbatched) {
        qd[0] = k->L, qd[1] = E, kd3[0] = k->S, kd3[1] = kd, vd3[0] = k->S, vd3[1] = vd;
    } else if (k->c.batch_first) {
        qd[0] = k->N, qd[1] = k->L, qd[2] = E;
        kd3[0] = k->N, kd3[1] = k->S, kd3[2] = kd;
        vd3[0] = k->N, vd3[1] = k->S, vd3[2] = vd;
    } else {
        qd[0] = k->L, qd[1] = k->N, qd[2] = E;
        kd3[0] = k->S, kd3[1] = k->N, kd3[2] = kd;
        vd3[0] = k->S, vd3[1] = k->N, vd3[2] = vd;
    }
    r->qb = make_input(&r->q, k->qdt, r->nd, qd, k->pad);
    if (k->self) {
        r->kk = r->q, r->v = r->q;
    } else {
        r->kb = make_input(&r->kk, k->qdt, r->nd, kd3, k->pad);
        r->vb = make_input(&r->v, k->qdt, r->nd, vd3, k->pad);
    }
    mha_forward_args *a = &k->a;
    a->query = &r->q, a->key = &r->kk, a->value = &r->v;
    const int64_t S = k->S, N = k->N;
    if (k->kpm_kind) {
        const mha_dtype dt = k->kpm_kind == 1 ? MHA_BOOL : MHA_F32;
        const int64_t dims[2] = {N, S};
        r->kpmb = calloc((size_t)(N * S + 1), mha_dtype_size(dt));
        for (int64_t i = 0; i < N * S; i++) {
            if (dt == MHA_BOOL) ((uint8_t *)r->kpmb)[i] = coin(20);
            else ((float *)r->kpmb)[i] = coin(20) ? -INFINITY : 0.3f * frand();
        }
        r->kpm = mha_tensor_contiguous(r->kpmb, dt, k->unbatched ? 1 : 2,
                                       k->unbatched ? dims + 1 : dims);
        a->key_padding_mask = &r->kpm;
    }
    if (k->am_kind) {
        const mha_dtype dt = k->am_kind == 2 ? MHA_F32 : MHA_BOOL;
        const int64_t Sp = S + k->c.add_bias_kv + k->c.add_zero_attn;
        (void)Sp;
        const int64_t NH = N * c->num_heads;
        const int64_t d3[3] = {NH, k->L, S};
        const int nd = k->am_kind == 3 ? 3 : 2;
        const int64_t n = (nd == 3 ? NH : 1) * k->L * S;
        r->amb = calloc((size_t)(n + 1), mha_dtype_size(dt));
        for (int64_t i = 0; i < n; i++) {
            if (dt == MHA_BOOL) ((uint8_t *)r->amb)[i] = coin(15);
            else ((float *)r->amb)[i] = coin(10) ? -INFINITY : 0.5f * frand();
        }
        r->am = mha_tensor_contiguous(r->amb, dt, nd, nd == 3 ? d3 : d3 + 1);
        a->attn_mask = &r->am;
    }
    return MHA_OK;
}

static void teardown(mrun *r) {
    mha_module_destroy(r->m);
    free(r->qb), free(r->kb), free(r->vb), free(r->kpmb), free(r->amb);
}

static void module_case(int64_t i) {
    mcase k;
    draw_case(&k);
    mrun r;
    mha_status st = setup(&r, &k);
    hash h;
    if (st) {
        hinit(&h);
        emit("module-setup", i, "-", st, &h);
        teardown(&r);
        return;
    }
    mha_shape os, ws;
    mha_forward_args *a = &k.a;
    static const mha_impl impls[3] = {MHA_IMPL_REFERENCE, MHA_IMPL_FUSED, MHA_IMPL_AUTO};
    static const char *names[3] = {"reference", "fused", "auto"};
    bool u8 = a->need_weights && coin(15);
    for (int ii = 0; ii < 3; ii++) {
        a->impl = impls[ii];
        hinit(&h);
        st = mha_forward_shapes(&os, &ws, r.m, a);
        if (!st) {
            int64_t no = 1, nw = 1;
            for (int j = 0; j < os.ndim; j++) no *= os.dims[j];
            for (int j = 0; j < ws.ndim; j++) nw *= ws.dims[j];
            float *out = fbuf(no), *w = fbuf(nw), *sc = fbuf(nw);
            mha_tensor ot = mha_tensor_contiguous(out, MHA_F32, os.ndim, os.dims);
            mha_tensor wt = mha_tensor_contiguous(w, u8 ? MHA_U8 : MHA_F32, ws.ndim, ws.dims);
            a->weights_scale = u8 ? sc : NULL;
            st = mha_forward(&ot, a->need_weights ? &wt : NULL, r.m, a);
            if (!st) {
                hbytes(&h, out, sizeof(float) * (size_t)no);
                if (a->need_weights)
                    hbytes(&h, w, (u8 ? 1 : sizeof(float)) * (size_t)nw),
                        hbytes(&h, sc,
                               u8 ? sizeof(float) * (size_t)(nw / ws.dims[ws.ndim - 1]) : 0);
            }
            free(out), free(w), free(sc);
        }
        emit("forward", i, names[ii], st, &h);
    }
    a->weights_scale = NULL;
    // backward: both implementations, the fused one also from a saved state
    // and accumulating
    const int64_t nq = mha_tensor_numel(&r.q), nk = mha_tensor_numel(&r.kk),
                  nv = mha_tensor_numel(&r.v);
    st = mha_forward_shapes(&os, &ws, r.m, a);
    if (st) return teardown(&r);
    int64_t no = 1;
    for (int j = 0; j < os.ndim; j++) no *= os.dims[j];
    float *gy = fbuf(no);
    fill(gy, no);
    mha_tensor gyt = mha_tensor_contiguous(gy, MHA_F32, os.ndim, os.dims);
    for (int mode = 0; mode < 4; mode++) {
        a->impl = mode == 0 ? MHA_IMPL_REFERENCE : MHA_IMPL_FUSED;
        a->need_weights = false;
        float *gq = fbuf(nq), *gk = fbuf(nk), *gv = fbuf(nv);
        mha_tensor gqt = mha_tensor_contiguous(gq, MHA_F32, r.nd, r.qdims);
        mha_tensor gkt = mha_tensor_contiguous(gk, MHA_F32, r.nd, r.kdims);
        mha_tensor gvt = mha_tensor_contiguous(gv, MHA_F32, r.nd, r.vdims);
        mha_module *g = NULL;
        hinit(&h);
        st = mha_module_create(&g, mha_module_config(r.m));
        mha_saved *sv = NULL;
        if (!st && mode == 2) {  // saved forward state
            st = mha_saved_create(&sv);
            float *out = fbuf(no);
            mha_tensor ot = mha_tensor_contiguous(out, MHA_F32, os.ndim, os.dims);
            a->save = sv;
            if (!st) st = mha_forward(&ot, NULL, r.m, a);
            if (!st) hbytes(&h, out, sizeof(float) * (size_t)no);
            free(out);
        }
        if (!st) {
            if (mode == 3) {  // accumulate onto non-zero outputs
                fill(gq, nq), fill(gk, nk), fill(gv, nv);
                for (int pi = 0; pi < mha_module_num_params(g); pi++) {
                    mha_param p;
                    if (!mha_module_param_at(&p, g, pi) && p.data) fill(p.data, p.numel);
                }
            }
            st = mha_backward(&gqt, k.self ? NULL : &gkt, k.self ? NULL : &gvt, g, r.m, a,
                              &gyt, mode == 3);
        }
        a->save = NULL;
        if (!st) {
            hbytes(&h, gq, sizeof(float) * (size_t)nq);
            if (!k.self)
                hbytes(&h, gk, sizeof(float) * (size_t)nk),
                    hbytes(&h, gv, sizeof(float) * (size_t)nv);
            hparams(&h, g);
        }
        static const char *bn[4] = {"reference", "fused", "fused-saved", "fused-accumulate"};
        emit("backward", i, bn[mode], st, &h);
        mha_saved_destroy(sv);
        mha_module_destroy(g);
        free(gq), free(gk), free(gv);
    }
    free(gy);
    teardown(&r);
}

// ---------------------------------------------------------------------------
// Scaled dot-product attention, varlen, RoPE

static void sdpa_case(int64_t i) {
    const int64_t B = irand(1, 2), Hkv = irand(1, 3), H = Hkv * irand(1, 3);
    const int64_t L = coin(20) ? irand(60, 130) : irand(1, 20),
                  S = coin(20) ? irand(60, 130) : irand(1, 20);
    const int64_t D = irand(1, 17), Dv = coin(70) ? D : irand(1, 17);
    const mha_dtype dt = coin(75) ? MHA_F32 : MHA_F64;
    const int64_t pad = coin(20) ? 2 : 0;
    mha_tensor q, k, v, am, kpm;
    void *qb = make_input(&q, dt, 4, (int64_t[]){B, H, L, D}, pad);
    void *kb = make_input(&k, dt, 4, (int64_t[]){B, Hkv, S, D}, pad);
    void *vb = make_input(&v, dt, 4, (int64_t[]){B, Hkv, S, Dv}, pad);
    mha_sdpa_args a;
    mha_sdpa_args_init(&a);
    a.q = &q, a.k = &k, a.v = &v;
    a.opts.is_causal = coin(30);
    if (coin(20)) a.opts.window_left = irand(0, 5);
    if (coin(20)) a.opts.window_right = irand(0, 5);
    if (coin(20)) a.opts.scale = 0.3;
    uint8_t *amb = NULL, *kpmb = NULL;
    if (coin(40)) {
        amb = calloc((size_t)(L * S), 1);
        for (int64_t j = 0; j < L * S; j++) amb[j] = coin(15);
        am = mha_tensor_contiguous(amb, MHA_BOOL, 2, (int64_t[]){L, S});
        a.attn_mask = &am;
    }
    if (coin(30)) {
        kpmb = calloc((size_t)(B * S), 1);
        for (int64_t j = 0; j < B * S; j++) kpmb[j] = coin(15);
        kpm = mha_tensor_contiguous(kpmb, MHA_BOOL, 2, (int64_t[]){B, S});
        a.key_padding_mask = &kpm;
    }
    const bool want_w = coin(40);
    static const mha_impl impls[3] = {MHA_IMPL_REFERENCE, MHA_IMPL_FUSED, MHA_IMPL_AUTO};
    static const char *names[3] = {"reference", "fused", "auto"};
    for (int ii = 0; ii < 3; ii++) {
        a.impl = impls[ii];
        float *o = fbuf(B * H * L * Dv), *w = fbuf(B * H * L * S);
        mha_tensor ot = mha_tensor_contiguous(o, MHA_F32, 4, (int64_t[]){B, H, L, Dv});
        mha_tensor wt = mha_tensor_contiguous(w, MHA_F32, 4, (int64_t[]){B, H, L, S});
        hash h;
        hinit(&h);
        mha_status st = mha_sdpa(&ot, want_w ? &wt : NULL, &a);
        if (!st)
            hbytes(&h, o, sizeof(float) * (size_t)(B * H * L * Dv)),
                hbytes(&h, w, want_w ? sizeof(float) * (size_t)(B * H * L * S) : 0);
        emit("sdpa", i, names[ii], st, &h);
        free(o), free(w);
    }
    free(qb), free(kb), free(vb), free(amb), free(kpmb);
}

static void varlen_case(int64_t i) {
    const int64_t nseq = irand(1, 4), Hkv = irand(1, 2), H = Hkv * irand(1, 3),
                  D = irand(1, 16), Dv = coin(70) ? D : irand(1, 16);
    int64_t cq[5] = {0}, ck[5] = {0};
    for (int64_t b = 0; b < nseq; b++) {
        cq[b + 1] = cq[b] + (coin(20) ? irand(40, 90) : irand(0, 12));
        ck[b + 1] = ck[b] + (coin(20) ? irand(40, 90) : irand(1, 12));
    }
    const int64_t Tq = cq[nseq], Tk = ck[nseq];
    float *q = fbuf(Tq * H * D), *k = fbuf(Tk * Hkv * D), *v = fbuf(Tk * Hkv * Dv),
          *o = fbuf(Tq * H * Dv);
    fill(q, Tq * H * D), fill(k, Tk * Hkv * D), fill(v, Tk * Hkv * Dv);
    mha_tensor qt = mha_tensor_contiguous(q, MHA_F32, 3, (int64_t[]){Tq, H, D});
    mha_tensor kt = mha_tensor_contiguous(k, MHA_F32, 3, (int64_t[]){Tk, Hkv, D});
    mha_tensor vt = mha_tensor_contiguous(v, MHA_F32, 3, (int64_t[]){Tk, Hkv, Dv});
    mha_tensor ot = mha_tensor_contiguous(o, MHA_F32, 3, (int64_t[]){Tq, H, Dv});
    mha_varlen_args a;
    mha_varlen_args_init(&a);
    a.cu_seqlens_q = cq, a.cu_seqlens_k = ck, a.num_seqs = nseq;
    a.opts.is_causal = coin(40);
    if (coin(20)) a.opts.window_left = irand(0, 5);
    if (coin(20)) a.opts.softcap = 3.0f;
    float slopes[8];
    for (int j = 0; j < 8; j++) slopes[j] = 0.2f * frand();
    if (coin(20)) a.opts.alibi_slopes = slopes;
    if (coin(20)) a.opts.scale = 0.25;
    hash h;
    hinit(&h);
    mha_status st = mha_sdpa_varlen(&ot, &qt, &kt, &vt, &a);
    if (!st) hbytes(&h, o, sizeof(float) * (size_t)(Tq * H * Dv));
    emit("varlen", i, "-", st, &h);
    free(q), free(k), free(v), free(o);
}

static void rope_case(int64_t i) {
    const int64_t B = irand(1, 2), H = irand(1, 3), T = irand(1, 20), D = 2 * irand(1, 8);
    const mha_dtype dt = coin(70) ? MHA_F32 : MHA_F64;
    mha_tensor x;
    void *b = make_input(&x, dt, 4, (int64_t[]){B, H, T, D}, coin(30) ? 1 : 0);
    mha_rope r;
    mha_rope_init(&r, coin(50) ? MHA_ROPE_NEOX : MHA_ROPE_INTERLEAVED);
    if (coin(40)) r.dim = 2 * irand(1, D / 2);
    int64_t start[2] = {irand(0, 50), irand(0, 50)};
    hash h;
    hinit(&h);
    mha_status st = mha_rope_apply(&x, &r, NULL, coin(50) ? start : NULL, NULL, 0, coin(30));
    size_t n = (size_t)(B * H * T * (D + 1) + 1) * mha_dtype_size(dt);
    (void)n;
    if (!st) {
        for (int64_t e = 0; e < B * H * T; e++)
            hbytes(&h, (char *)b + (size_t)(e * x.stride[2]) * mha_dtype_size(dt),
                   (size_t)D * mha_dtype_size(dt));
    }
    emit("rope", i, "-", st, &h);
    free(b);
}

// ---------------------------------------------------------------------------
// KV cache and cached decoding

static void cache_case(int64_t i) {
    const int64_t B = irand(1, 3), Hkv = irand(1, 2), H = Hkv * irand(1, 3), D = irand(1, 16),
                  Dv = coin(70) ? D : irand(1, 16), cap = irand(40, 1200);
    const mha_kv_dtype kdt = (mha_kv_dtype)irand(0, 3);
    mha_kv_cache *c = NULL;
    hash h;
    hinit(&h);
    mha_status st = mha_kv_cache_create(&c, B, Hkv, D, Dv, cap, kdt);
    mha_cache_attend_args ca;
    mha_cache_attend_args_init(&ca);
    if (coin(20)) ca.opts.window_left = irand(0, 30);
    if (coin(20)) ca.opts.softcap = 4.0f;
    float slopes[8];
    for (int j = 0; j < 8; j++) slopes[j] = 0.1f * frand();
    if (coin(20)) ca.opts.alibi_slopes = slopes;
    for (int step = 0; !st && step < 5; step++) {
        const int64_t T = coin(40) ? irand(17, 300) : irand(1, 16);
        float *k = fbuf(B * Hkv * T * D), *v = fbuf(B * Hkv * T * Dv),
              *q = fbuf(B * H * T * D), *o = fbuf(B * H * T * Dv);
        fill(k, B * Hkv * T * D), fill(v, B * Hkv * T * Dv), fill(q, B * H * T * D);
        int64_t counts[3];
        for (int64_t b = 0; b < B; b++) counts[b] = coin(30) ? irand(0, T) : T;
        mha_tensor kt = mha_tensor_contiguous(k, MHA_F32, 4, (int64_t[]){B, Hkv, T, D});
        mha_tensor vt = mha_tensor_contiguous(v, MHA_F32, 4, (int64_t[]){B, Hkv, T, Dv});
        mha_tensor qt = mha_tensor_contiguous(q, MHA_F32, 4, (int64_t[]){B, H, T, D});
        mha_tensor ot = mha_tensor_contiguous(o, MHA_F32, 4, (int64_t[]){B, H, T, Dv});
        st = mha_kv_cache_append(c, &kt, &vt, counts);
        hint(&h, st);
        if (!st) {
            st = mha_kv_cache_attend(&ot, &qt, c, &ca, counts);
            hint(&h, st);
            if (!st) hbytes(&h, o, sizeof(float) * (size_t)(B * H * T * Dv));
        }
        if (st == MHA_ERR_INVALID_ARG) st = MHA_OK;  // (full: the next step tries smaller)
        if (coin(20))
            st = mha_kv_cache_truncate(c, -1, mha_kv_cache_length(c, 0) / 2), hint(&h, st);
        free(k), free(v), free(q), free(o);
    }
    emit("kv-cache", i, mha_kv_dtype_name(kdt), st, &h);
    mha_kv_cache_destroy(c);
}

static void cached_case(int64_t i) {
    static const int64_t hs[] = {1, 2, 4};
    const int64_t H = hs[irand(0, 2)], d = 2 * irand(1, 5), E = H * d, N = irand(1, 2);
    mha_config cfg;
    mha_config_init(&cfg, E, H);
    if (coin(40)) cfg.num_kv_heads = H > 1 ? H / 2 : 1;
    cfg.batch_first = coin(40);
    cfg.head_gate = (mha_head_gate)irand(0, 2);
    if (coin(20)) cfg.weight_dtype = MHA_BF16;
    mha_module *m = NULL;
    hash h;
    hinit(&h);
    mha_status st = mha_module_create(&m, &cfg);
    mha_init_options io;
    mha_init_options_init(&io);
    io.seed = (uint64_t)i;
    if (!st) st = mha_module_init(m, &io);
    if (!st && cfg.weight_dtype == MHA_F32) randomize_params(m);
    mha_kv_cache *c = NULL;
    const mha_kv_dtype kdt = coin(70) ? MHA_KV_F32 : (mha_kv_dtype)irand(1, 3);
    if (!st)
        st = mha_kv_cache_create(&c, N, mha_module_config(m)->num_kv_heads, d, d, 400, kdt);
    mha_forward_args a;
    mha_forward_args_init(&a);
    if (coin(40)) mha_rope_init(&a.rope, coin(50) ? MHA_ROPE_NEOX : MHA_ROPE_INTERLEAVED);
    if (coin(20)) a.opts.alibi = true;
    if (coin(20)) a.opts.softcap = 3.0f;
    if (coin(20)) a.opts.window_left = irand(0, 20);
    for (int step = 0; !st && step < 6; step++) {
        const int64_t T = coin(30) ? irand(17, 60) : irand(1, 4);
        float *x = fbuf(T * N * E), *y = fbuf(T * N * E);
        fill(x, T * N * E);
        const int64_t dims[3] = {cfg.batch_first ? N : T, cfg.batch_first ? T : N, E};
        mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, dims);
        mha_tensor yt = mha_tensor_contiguous(y, MHA_F32, 3, dims);
        a.query = a.key = a.value = &xt;
        st = mha_forward_cached(&yt, m, &a, c);
        if (!st) hbytes(&h, y, sizeof(float) * (size_t)(T * N * E));
        free(x), free(y);
    }
    emit("forward-cached", i, mha_kv_dtype_name(kdt), st, &h);
    mha_kv_cache_destroy(c);
    mha_module_destroy(m);
}

// ---------------------------------------------------------------------------
// Diagnostics and optimizers

static void diag_case(int64_t i) {
    mcase k;
    draw_case(&k);
    k.c.weight_dtype = MHA_F32;
    k.c.dropout = k.c.out_dropout = 0.0f;
    if (k.qdt != MHA_F64) k.qdt = MHA_F32;
    k.a.training = false;
    mrun r;
    hash h;
    hinit(&h);
    mha_status st = setup(&r, &k);
    mha_diag *dg = NULL;
    mha_diag_options o;
    mha_diag_options_init(&o);
    if (coin(40)) o.max_rows = irand(1, 10);
    if (!st) st = mha_diag_create(&dg, r.m, &k.a, &o);
    if (!st) {
        const int64_t H = mha_diag_num_heads(dg);
        hint(&h, mha_diag_rows(dg));
        for (int64_t hh = 0; hh < H; hh++) {
            const mha_head_diag *d = mha_diag_head(dg, hh);
            const double v[] = {d->entropy_mean,     d->entropy_min, d->entropy_norm,
                                d->mean_distance,    d->logit_max,   d->logit_std,
                                d->output_var_ratio, d->gate_mean};
            hbytes(&h, v, sizeof v);
            const int64_t iv[] = {d->head,   d->rows,   d->dead,   d->rank_q,
                                  d->rank_k, d->rank_v, d->rank_o, d->pruned};
            hbytes(&h, iv, sizeof iv);
            for (int64_t h2 = 0; h2 < H; h2++) {
                const double s = mha_diag_similarity(dg, hh, h2);
                hbytes(&h, &s, sizeof s);
            }
            for (int w = 0; w < 4; w++) {
                static const char which[4] = {'q', 'k', 'v', 'o'};
                int64_t n = 0;
                const double *sp = mha_diag_spectrum(dg, hh, which[w], &n);
                if (sp) hbytes(&h, sp, sizeof(double) * (size_t)n);
            }
        }
        const char *nf = mha_diag_nonfinite(dg);
        if (nf) hbytes(&h, nf, strlen(nf));
    }
    emit("diagnose", i, "-", st, &h);
    mha_diag_destroy(dg);
    teardown(&r);
}

static void optim_case(int64_t i) {
    mha_config cfg;
    mha_config_init(&cfg, 8, 2);
    cfg.add_bias_kv = coin(50);
    mha_module *m = NULL, *g = NULL;
    mha_optim *op = NULL;
    hash h;
    hinit(&h);
    mha_status st = mha_module_create(&m, &cfg);
    mha_init_options io;
    mha_init_options_init(&io);
    io.seed = (uint64_t)i;
    if (!st) st = mha_module_init(m, &io);
    if (!st) st = mha_module_create(&g, &cfg);
    mha_optim_config oc;
    mha_optim_config_init(&oc, i % 2 ? MHA_OPTIM_ADAMW : MHA_OPTIM_SGD);
    if (!st) st = mha_optim_create(&op, &oc);
    if (!st) st = mha_optim_add_module(op, m, g);
    float x[5 * 2 * 8], gy[5 * 2 * 8], y[5 * 2 * 8];
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){5, 2, 8});
    mha_tensor gt = mha_tensor_contiguous(gy, MHA_F32, 3, (int64_t[]){5, 2, 8});
    mha_tensor yt = mha_tensor_contiguous(y, MHA_F32, 3, (int64_t[]){5, 2, 8});
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &xt;
    for (int s = 0; !st && s < 3; s++) {
        fill(x, 80), fill(gy, 80);
        mha_optim_zero_grad(op);
        st = mha_forward(&yt, NULL, m, &a);
        if (!st) st = mha_backward(NULL, NULL, NULL, g, m, &a, &gt, false);
        double norm = 0;
        if (!st) st = mha_optim_clip_grad_norm(op, 1.0, &norm);
        hbytes(&h, &norm, sizeof norm);
        if (!st) st = mha_optim_step(op);
    }
    if (!st) hparams(&h, m);
    emit("optim", i, i % 2 ? "adamw" : "sgd", st, &h);
    mha_optim_destroy(op);
    mha_module_destroy(m);
    mha_module_destroy(g);
}

// ---------------------------------------------------------------------------
// Inputs for the CLI runs (run.sh): x.safetensors (query, key, value,
// key_padding_mask) and g.safetensors (grad_attn_output), seq-first.

static int write_inputs(const char *dir) {
    const int64_t L = 37, S = 29, N = 2, E = 24;
    char path[512];
    mha_st_writer *w = NULL;
    float *q = fbuf(L * N * E), *k = fbuf(S * N * E), *v = fbuf(S * N * E),
          *g = fbuf(L * N * E), *s = fbuf(L * N * E), *gs = fbuf(L * N * E);
    fill(q, L * N * E), fill(k, S * N * E), fill(v, S * N * E), fill(g, L * N * E);
    fill(s, L * N * E), fill(gs, L * N * E);
    uint8_t kpm[2 * 29];
    for (int i = 0; i < N * S; i++) kpm[i] = coin(15);
    int rc = 0;
    rc |= mha_st_writer_create(&w) != MHA_OK;
    rc |= mha_st_writer_add(w, "query", MHA_F32, 3, (int64_t[]){L, N, E}, q) != MHA_OK;
    rc |= mha_st_writer_add(w, "key", MHA_F32, 3, (int64_t[]){S, N, E}, k) != MHA_OK;
    rc |= mha_st_writer_add(w, "value", MHA_F32, 3, (int64_t[]){S, N, E}, v) != MHA_OK;
    rc |= mha_st_writer_add(w, "key_padding_mask", MHA_BOOL, 2, (int64_t[]){N, S}, kpm) !=
          MHA_OK;
    snprintf(path, sizeof path, "%s/x.safetensors", dir);
    rc |= mha_st_writer_save(w, path) != MHA_OK;
    mha_st_writer_destroy(w);
    // self-attention inputs (query only) and their output gradient
    rc |= mha_st_writer_create(&w) != MHA_OK;
    rc |= mha_st_writer_add(w, "query", MHA_F32, 3, (int64_t[]){L, N, E}, s) != MHA_OK;
    snprintf(path, sizeof path, "%s/self.safetensors", dir);
    rc |= mha_st_writer_save(w, path) != MHA_OK;
    mha_st_writer_destroy(w);
    rc |= mha_st_writer_create(&w) != MHA_OK;
    rc |= mha_st_writer_add(w, "grad_attn_output", MHA_F32, 3, (int64_t[]){L, N, E}, g) !=
          MHA_OK;
    snprintf(path, sizeof path, "%s/g.safetensors", dir);
    rc |= mha_st_writer_save(w, path) != MHA_OK;
    mha_st_writer_destroy(w);
    free(q), free(k), free(v), free(g), free(s), free(gs);
    if (rc)
        fprintf(stderr, "outputs: writing the inputs into %s failed: %s\n", dir,
                mha_last_error());
    return rc;
}

int main(int argc, char **argv) {
    int64_t cases = 120;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--cases") && i + 1 < argc) cases = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--write-inputs") && i + 1 < argc)
            return write_inputs(argv[++i]);
        else {
            fprintf(stderr, "usage: outputs [--cases N] [--write-inputs DIR]\n");
            return 2;
        }
    }
    for (int64_t i = 0; i < cases; i++) module_case(i);
    for (int64_t i = 0; i < cases; i++) sdpa_case(i);
    for (int64_t i = 0; i < cases / 2; i++) varlen_case(i);
    for (int64_t i = 0; i < cases / 4; i++) rope_case(i);
    for (int64_t i = 0; i < cases / 2; i++) cache_case(i);
    for (int64_t i = 0; i < cases / 2; i++) cached_case(i);
    for (int64_t i = 0; i < cases / 4; i++) diag_case(i);
    for (int64_t i = 0; i < 6; i++) optim_case(i);
    return 0;
}
