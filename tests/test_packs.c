// test_packs.c: the module's packed weights (mha_module_params_changed,
// src/packs.c) are never used stale. For each way the parameters change
// (an optimizer step, zero_grad, clip_grad_norm, a write through
// mha_module_param / mha_module_param_at, a write through an old pointer
// followed by mha_module_params_changed, mha_module_init, loading,
// converting, pruning, mha_backward (fused and reference) writing a grads
// module), after the packed copy was filled by a forward: the next fused
// forward (self-attention or attention over keys and values of their own,
// and cross-attention), fused backward (input and parameter gradients) and
// cached decode equal a fresh module's with those parameters, bit for bit.
// And that the copy is in use: a write through an old pointer without the
// notification is not seen by the fused forward (the documented caller's
// duty), and is once notified. Module kinds: packed in_proj_weight (E a
// multiple of both panel widths, so cross-attention slices the copy; and E
// = 24, which does not), separate q/k/v with kdim != vdim, grouped-query
// heads with a dynamic gate and a pruned head, separate_qkv with a
// head_dim, BF16 weights with a dynamic gate (only the gate is kept
// packed), and BF16 weights without gates, whose forward on bf16 inputs
// computes in bf16 where the table does (mha_last_impl() " bf16": the
// copy holds the bf16-packed in_proj_weight, or q/k/v_proj_weight, and
// out_proj.weight).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "util.h"
#include "mha.h"

enum { L = 5, S = 7, N = 2, T = 6 };

// What a module computes, as floats appended to one buffer.
typedef struct outputs {
    float *f;
    int64_t n, cap;
} outputs;

static void put(outputs *o, const float *x, int64_t n) {
    if (o->n + n > o->cap) {
        o->cap = 2 * (o->n + n) + 64;
        o->f = realloc(o->f, sizeof(float) * (size_t)o->cap);
        if (!o->f) abort();
    }
    memcpy(o->f + o->n, x, sizeof(float) * (size_t)n);
    o->n += n;
}

static bool same(const outputs *a, const outputs *b) {
    return a->n == b->n && a->n > 0 && !memcmp(a->f, b->f, sizeof(float) * (size_t)a->n);
}

static float *floats(int64_t n) {
    float *x = calloc((size_t)(n > 0 ? n : 1), sizeof(float));
    if (!x) abort();
    return x;
}

// The inputs every run uses (fixed per module kind).
typedef struct inputs {
    float *x, *k, *v, *gy;
    int64_t E, kd, vd;
} inputs;

static void inputs_make(inputs *in, const mha_config *c) {
    in->E = c->embed_dim;
    in->kd = c->kdim ? c->kdim : c->embed_dim;
    in->vd = c->vdim ? c->vdim : c->embed_dim;
    const int64_t nx = (L > T ? L : T) * N * in->E;
    in->x = floats(nx), in->gy = floats(nx);
    in->k = floats(S * N * in->kd), in->v = floats(S * N * in->vd);
    for (int64_t i = 0; i < nx; i++) in->x[i] = frand(), in->gy[i] = frand();
    for (int64_t i = 0; i < S * N * in->kd; i++) in->k[i] = frand();
    for (int64_t i = 0; i < S * N * in->vd; i++) in->v[i] = frand();
}

static void inputs_free(inputs *in) { free(in->x), free(in->k), free(in->v), free(in->gy); }

// The views of the inputs: x (L, N, E), k (S, N, kd), v (S, N, vd).
typedef struct views {
    mha_tensor x, k, v;
} views;

static views views_of(const inputs *in) {
    return (views){mha_tensor_contiguous(in->x, MHA_F32, 3, (int64_t[]){L, N, in->E}),
                   mha_tensor_contiguous(in->k, MHA_F32, 3, (int64_t[]){S, N, in->kd}),
                   mha_tensor_contiguous(in->v, MHA_F32, 3, (int64_t[]){S, N, in->vd})};
}

// The fused forward's arguments: causal self-attention, or (kdim or vdim
// not E) attention over k and v.
static mha_forward_args main_args(const inputs *in, const views *vw) {
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.impl = MHA_IMPL_FUSED;
    a.query = &vw->x;
    if (in->kd == in->E && in->vd == in->E) {
        a.key = a.value = &vw->x;
        a.opts.is_causal = true;
    } else {
        a.key = &vw->k, a.value = &vw->v;
    }
    return a;
}

// The fused forward of main_args on bf16 views of the inputs (rounded),
// into o (the bf16 output as floats); whether it computed in bf16.
static bool run_forward_bf16(outputs *o, const mha_module *m, const inputs *in) {
    const int64_t E = in->E, nx = L * N * E, nk = S * N * in->kd, nv = S * N * in->vd;
    uint16_t *x = calloc((size_t)(nx + nk + nv + nx), sizeof(uint16_t));
    if (!x) abort();
    uint16_t *k = x + nx, *v = k + nk, *y = v + nv;
    for (int64_t i = 0; i < nx; i++) x[i] = mha_f32_to_bf16(in->x[i]);
    for (int64_t i = 0; i < nk; i++) k[i] = mha_f32_to_bf16(in->k[i]);
    for (int64_t i = 0; i < nv; i++) v[i] = mha_f32_to_bf16(in->v[i]);
    const views vw = {mha_tensor_contiguous(x, MHA_BF16, 3, (int64_t[]){L, N, E}),
                      mha_tensor_contiguous(k, MHA_BF16, 3, (int64_t[]){S, N, in->kd}),
                      mha_tensor_contiguous(v, MHA_BF16, 3, (int64_t[]){S, N, in->vd})};
    mha_tensor yt = mha_tensor_contiguous(y, MHA_BF16, 3, (int64_t[]){L, N, E});
    mha_forward_args a = main_args(in, &vw);
    CHECK_OK(mha_forward(&yt, NULL, m, &a));
    const bool bf = strstr(mha_last_impl(), " bf16") != NULL;
    float *f = floats(nx);
    for (int64_t i = 0; i < nx; i++) f[i] = mha_bf16_to_f32(y[i]);
    put(o, f, nx);
    free(f), free(x);
    return bf;
}

// The fused forward of main_args into o (and, bf16 weights, on bf16 views).
static void run_forward(outputs *o, const mha_module *m, const inputs *in) {
    const int64_t E = in->E;
    float *y = floats(L * N * E);
    const views vw = views_of(in);
    mha_tensor yt = mha_tensor_contiguous(y, MHA_F32, 3, (int64_t[]){L, N, E});
    mha_forward_args a = main_args(in, &vw);
    CHECK_OK(mha_forward(&yt, NULL, m, &a));
    put(o, y, L * N * E);
    free(y);
    if (mha_module_config(m)->weight_dtype == MHA_BF16) run_forward_bf16(o, m, in);
}

// Everything the module computes on the inputs, fused: the main_args
// forward; the cross-attention forward (key and value of their own); the
// main_args backward (float32 weights: input and parameter gradients); the cached
// decode of T tokens one at a time then all T again in one chunk (kdim =
// vdim = E, no add_bias_kv).
static void run_all(outputs *o, const mha_module *m, const inputs *in) {
    const mha_config *c = mha_module_config(m);
    const int64_t E = in->E, Hkv = c->num_kv_heads, d = c->head_dim;
    run_forward(o, m, in);
    // cross-attention
    float *y = floats(L * N * E);
    const views vw = views_of(in);
    mha_tensor yt = mha_tensor_contiguous(y, MHA_F32, 3, (int64_t[]){L, N, E});
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = &vw.x, a.key = &vw.k, a.value = &vw.v;
    a.impl = MHA_IMPL_FUSED;
    CHECK_OK(mha_forward(&yt, NULL, m, &a));
    put(o, y, L * N * E);
    // backward of main_args
    if (c->weight_dtype == MHA_F32) {
        mha_module *g = NULL;
        CHECK_OK(mha_module_create(&g, c));
        float *gx = floats(L * N * E);
        mha_tensor gxt = mha_tensor_contiguous(gx, MHA_F32, 3, (int64_t[]){L, N, E});
        mha_tensor gyt = mha_tensor_contiguous(in->gy, MHA_F32, 3, (int64_t[]){L, N, E});
        a = main_args(in, &vw);
        if (g) CHECK_OK(mha_backward(&gxt, NULL, NULL, g, m, &a, &gyt, false));
        put(o, gx, L * N * E);
        for (int i = 0; g && i < mha_module_num_params(g); i++) {
            mha_param p;
            CHECK_OK(mha_module_param_at(&p, g, i));
            put(o, p.data, p.numel);
        }
        mha_module_destroy(g);
        free(gx);
    }
    // cached decode: token by token, then the T tokens as one chunk
    if (in->kd == E && in->vd == E && !c->add_bias_kv) {
        {  // (last_impl: "reference" first, so the decode's own is seen)
            float z[4] = {0};
            mha_tensor zt = mha_tensor_contiguous(z, MHA_F32, 4, (int64_t[]){1, 1, 1, 4});
            mha_sdpa_args sa;
            mha_sdpa_args_init(&sa);
            sa.q = sa.k = sa.v = &zt;
            sa.impl = MHA_IMPL_REFERENCE;
            float y1[4];
            mha_tensor yt1 = mha_tensor_contiguous(y1, MHA_F32, 4, (int64_t[]){1, 1, 1, 4});
            CHECK_OK(mha_sdpa(&yt1, NULL, &sa));
        }
        mha_kv_cache *kc = NULL;
        CHECK_OK(mha_kv_cache_create(&kc, N, Hkv, d, d, 2 * T, MHA_KV_F32));
        float *yd = floats(T * N * E);
        for (int t = 0; kc && t < T; t++) {
            mha_tensor qc = mha_tensor_contiguous(in->x + t * N * E, MHA_F32, 3,
                                                  (int64_t[]){1, N, E});
            mha_tensor oc = mha_tensor_contiguous(yd + t * N * E, MHA_F32, 3,
                                                  (int64_t[]){1, N, E});
            mha_forward_args ac;
            mha_forward_args_init(&ac);
            ac.query = ac.key = ac.value = &qc;
            CHECK_OK(mha_forward_cached(&oc, m, &ac, kc));
            CHECKF(strncmp(mha_last_impl(), "fused ", 6) == 0,
                   "mha_forward_cached: last_impl \"%s\"", mha_last_impl());
        }
        put(o, yd, T * N * E);
        mha_tensor qc = mha_tensor_contiguous(in->x, MHA_F32, 3, (int64_t[]){T, N, E});
        mha_tensor oc = mha_tensor_contiguous(yd, MHA_F32, 3, (int64_t[]){T, N, E});
        mha_forward_args ac;
        mha_forward_args_init(&ac);
        ac.query = ac.key = ac.value = &qc;
        if (kc) CHECK_OK(mha_forward_cached(&oc, m, &ac, kc));
        put(o, yd, T * N * E);
        mha_kv_cache_destroy(kc);
        free(yd);
    }
    free(y);
}

// A new module with m's config, parameters (copied byte for byte) and
// pruned heads: its packed copy is filled from scratch.
static mha_module *fresh(const mha_module *m) {
    const mha_config *c = mha_module_config(m);
    mha_module *f = NULL;
    CHECK_OK(mha_module_create(&f, c));
    if (!f) return NULL;
    for (int i = 0; i < mha_module_num_params(m); i++) {
        mha_param p, q;
        CHECK_OK(mha_module_param_at(&p, m, i));
        CHECK_OK(mha_module_param_at(&q, f, i));
        memcpy(q.storage, p.storage, (size_t)p.numel * mha_dtype_size(p.dtype));
    }
    int64_t heads[64], n = 0;
    for (int64_t h = 0; h < c->num_heads && n < 64; h++)
        if (mha_module_head_pruned(m, h)) heads[n++] = h;
    CHECK_OK(mha_module_prune_heads(f, heads, n));
    return f;
}

// After a change named `what`: m computes what a fresh copy does.
static void check_fresh(const char *kind, const char *what, const mha_module *m,
                        const inputs *in) {
    outputs a = {0}, b = {0};
    run_all(&a, m, in);  // (first: reading m's parameters would mark its copy stale)
    mha_module *f = fresh(m);
    if (f) run_all(&b, f, in);
    CHECKF(same(&a, &b),
           "%s, after %s: the module's results differ from a fresh copy's (%lld "
           "and %lld floats)",
           kind, what, (long long)a.n, (long long)b.n);
    mha_module_destroy(f);
    // m's copy filled again (fresh() read its parameters), for the next change
    a.n = 0;
    run_forward(&a, m, in);
    free(a.f), free(b.f);
}

// Every element of every parameter: x <- x + delta (f32), or rounded back
// to bf16 (bf16 weights).
static void nudge(mha_module *m, const char *name, float delta) {
    mha_param p;
    CHECK_OK(mha_module_param(&p, m, name));
    uint16_t *h = p.storage;
    for (int64_t j = 0; j < p.numel; j++)
        if (p.dtype == MHA_F32) p.data[j] += delta * (float)(1 + j % 3);
        else if (p.dtype == MHA_BF16)
            h[j] = mha_f32_to_bf16(mha_bf16_to_f32(h[j]) + delta * (float)(1 + j % 3));
}

// The name of a weight matrix of m the forward multiplies by (kept
// packed): the gate's for a gated half module.
static const char *packed_weight(const mha_module *m) {
    mha_param p;
    const mha_config *c = mha_module_config(m);
    if (c->weight_dtype != MHA_F32 && c->head_gate == MHA_GATE_DYNAMIC)
        return "gate_proj.weight";
    if (mha_module_param(&p, m, "in_proj_weight") == MHA_OK) return "in_proj_weight";
    return "q_proj_weight";
}

static void one_kind(const char *kind, const mha_config *c, bool prune) {
    inputs in;
    inputs_make(&in, c);
    mha_module *m = random_module(c, 11);
    if (!m) return;
    if (prune) {
        const int64_t h = 1;
        CHECK_OK(mha_module_prune_heads(m, &h, 1));
    }
    const bool f32 = c->weight_dtype == MHA_F32;
    outputs o = {0};
    run_all(&o, m, &in);  // (fills the packed copy)
    check_fresh(kind, "creation and a first run", m, &in);

    // 1. a write through mha_module_param after a forward
    nudge(m, packed_weight(m), 0.01f);
    check_fresh(kind, "a write through mha_module_param", m, &in);
    {  // and through mha_module_param_at (every parameter)
        for (int i = 0; i < mha_module_num_params(m); i++) {
            mha_param p;
            CHECK_OK(mha_module_param_at(&p, m, i));
            if (p.dtype == MHA_F32)
                for (int64_t j = 0; j < p.numel; j++) p.data[j] *= 0.99f;
        }
        check_fresh(kind, "a write through mha_module_param_at", m, &in);
    }

    // 2. a write through an old pointer: not seen until
    //    mha_module_params_changed (the copy is in use), seen after it
    {
        // (bf16 weights without gates: the forward on bf16 inputs, where it
        // computes in bf16; the float32 compute packs half weights per call)
        mha_param p;
        CHECK_OK(mha_module_param(&p, m, packed_weight(m)));
        const bool bf = !f32 && p.dtype == MHA_BF16;
        outputs before = {0}, stale = {0}, after = {0};
        bool in_bf16 = true;
        if (bf) in_bf16 = run_forward_bf16(&before, m, &in);  // (fills the copy)
        else run_forward(&before, m, &in);
        uint16_t *h = p.storage;
        for (int64_t j = 0; j < p.numel; j++)
            if (bf) h[j] = mha_f32_to_bf16(0.05f - mha_bf16_to_f32(h[j]));
            else p.data[j] = -p.data[j] + 0.05f;
        if (bf) run_forward_bf16(&stale, m, &in);
        else run_forward(&stale, m, &in);
        if (in_bf16)
            CHECKF(same(&before, &stale),
                   "%s: a write through an old pointer without mha_module_params_changed is "
                   "seen by the fused forward: the packed copy is not in use",
                   kind);
        else
            printf("%s: kernels %s compute bf16 in float32 (no bf16 copy to check in use)\n",
                   kind, mha_isa());
        mha_module_params_changed(m);
        if (bf) run_forward_bf16(&after, m, &in);
        else run_forward(&after, m, &in);
        CHECKF(!same(&before, &after), "%s: mha_module_params_changed: the write is not seen",
               kind);
        free(before.f), free(stale.f), free(after.f);
        check_fresh(kind, "a write through an old pointer and mha_module_params_changed", m,
                    &in);
    }

    // 3. mha_module_init (another seed)
    {
        mha_init_options io;
        mha_init_options_init(&io);
        io.seed = 99;
        CHECK_OK(mha_module_init(m, &io));
        check_fresh(kind, "mha_module_init", m, &in);
        nudge(m, packed_weight(m), 0.02f);  // (gates: not trivial again)
        run_all(&o, m, &in);
    }

    // 4. pruning (no parameter changes; the forward skips the head)
    {
        const int64_t h = 0;
        CHECK_OK(mha_module_prune_heads(m, &h, 1));
        check_fresh(kind, "mha_module_prune_heads", m, &in);
        CHECK_OK(mha_module_prune_heads(m, NULL, 0));
        if (prune) {
            const int64_t h1 = 1;
            CHECK_OK(mha_module_prune_heads(m, &h1, 1));
        }
        check_fresh(kind, "mha_module_prune_heads restored", m, &in);
    }

    // 5. converting, both ways: the new module equals a fresh one, and so
    //    does m after the new one ran
    {
        mha_module *cv = NULL;
        CHECK_OK(mha_module_convert(&cv, m, f32 ? MHA_BF16 : MHA_F32));
        if (cv) {
            run_all(&o, cv, &in);
            check_fresh(kind, "mha_module_convert", cv, &in);
            mha_module *back = NULL;
            CHECK_OK(mha_module_convert(&back, cv, c->weight_dtype));
            if (back) check_fresh(kind, "mha_module_convert and back", back, &in);
            mha_module_destroy(back);
        }
        mha_module_destroy(cv);
        check_fresh(kind, "another module's conversion", m, &in);
    }

    // 6. save and load (the loaded module, then m written over by it)
    {
        const char *dir = getenv("MHA_TEST_TMPDIR");
        char path[512], name[64];
        snprintf(name, sizeof name, "%s", kind);
        for (char *q = name; *q; q++)
            if (*q == ' ') *q = '_';
        snprintf(path, sizeof path, "%s/test_packs_%s.safetensors", dir ? dir : "/tmp", name);
        nudge(m, packed_weight(m), 0.03f);
        CHECK_OK(mha_module_save(m, path));
        mha_st_file *fl = NULL;
        CHECK_OK(mha_st_open(&fl, path));
        mha_module *ld = NULL;
        mha_config base = *c;
        if (fl) CHECK_OK(mha_module_load(&ld, fl, &base));
        mha_st_close(fl);
        if (ld) {
            outputs a = {0}, b = {0};
            run_all(&a, ld, &in);
            run_all(&b, m, &in);
            CHECKF(same(&a, &b), "%s: the loaded module differs from the saved one", kind);
            check_fresh(kind, "mha_module_load", ld, &in);
            free(a.f), free(b.f);
        }
        mha_module_destroy(ld);
        remove(path);
    }

    // 7. the optimizers (float32 weights): steps of SGD and AdamW on
    //    mha_backward's gradients; the grads module written by mha_backward,
    //    zero_grad and clip_grad_norm, used as a module itself
    if (f32) {
        mha_module *g = NULL;
        CHECK_OK(mha_module_create(&g, c));
        const int64_t E = in.E;
        float *gx = floats(L * N * E);
        const views vw = views_of(&in);
        mha_tensor gyt = mha_tensor_contiguous(in.gy, MHA_F32, 3, (int64_t[]){L, N, E});
        mha_tensor gxt = mha_tensor_contiguous(gx, MHA_F32, 3, (int64_t[]){L, N, E});
        mha_forward_args a = main_args(&in, &vw);
        for (int kind_o = 0; g && kind_o < 2; kind_o++) {
            mha_optim_config oc;
            mha_optim_config_init(&oc, kind_o ? MHA_OPTIM_ADAMW : MHA_OPTIM_SGD);
            oc.lr = 0.05;
            mha_optim *opt = NULL;
            CHECK_OK(mha_optim_create(&opt, &oc));
            if (opt) CHECK_OK(mha_optim_add_module(opt, m, g));
            for (int step = 0; opt && step < 2; step++) {
                run_all(&o, m, &in);      // (the copy filled)
                run_forward(&o, g, &in);  // (g's copy filled)
                CHECK_OK(mha_backward(&gxt, NULL, NULL, g, m, &a, &gyt, false));
                check_fresh(kind, "mha_backward writing the grads module", g, &in);
                a.impl = MHA_IMPL_REFERENCE;  // (the reference backward writes it too)
                CHECK_OK(mha_backward(&gxt, NULL, NULL, g, m, &a, &gyt, false));
                a.impl = MHA_IMPL_FUSED;
                check_fresh(kind, "the reference mha_backward writing the grads module", g, &in);
                CHECK_OK(mha_optim_clip_grad_norm(opt, 1e-3, NULL));
                check_fresh(kind, "mha_optim_clip_grad_norm (grads module)", g, &in);
                CHECK_OK(mha_optim_step(opt));
                check_fresh(kind, kind_o ? "an AdamW step" : "an SGD step", m, &in);
                run_forward(&o, g, &in);
                mha_optim_zero_grad(opt);
                check_fresh(kind, "mha_optim_zero_grad (grads module)", g, &in);
            }
            mha_optim_destroy(opt);
        }
        free(gx);
        mha_module_destroy(g);
    }
    printf("%s: checked\n", kind);
    free(o.f);
    mha_module_destroy(m);
    inputs_free(&in);
}

int main(void) {
    seed_rng(2024);
    mha_config c;
    mha_config_init(&c, 32, 4);  // packed, E a multiple of 16 and 32
    one_kind("packed E 32", &c, false);
    mha_config_init(&c, 24, 3);  // packed, cross-attention rows not panel aligned
    c.add_bias_kv = true;
    one_kind("packed E 24 bias_kv", &c, false);
    mha_config_init(&c, 32, 4);  // separate q/k/v, kdim != vdim
    c.kdim = 20, c.vdim = 12;
    one_kind("separate kdim 20 vdim 12", &c, false);
    mha_config_init(&c, 32, 4);  // grouped-query, dynamic gate, a pruned head
    c.num_kv_heads = 2, c.head_gate = MHA_GATE_DYNAMIC;
    one_kind("gqa dynamic gate pruned", &c, true);
    mha_config_init(&c, 32, 4);  // separate_qkv with a head_dim
    c.separate_qkv = true, c.head_dim = 16, c.num_kv_heads = 2;
    one_kind("separate_qkv head_dim 16", &c, false);
    mha_config_init(&c, 32, 4);  // BF16 weights, dynamic gate (kept packed)
    c.weight_dtype = MHA_BF16, c.head_gate = MHA_GATE_DYNAMIC;
    one_kind("bf16 dynamic gate", &c, false);
    mha_config_init(&c, 32, 4);  // BF16 weights: the bf16 compute's copy
    c.weight_dtype = MHA_BF16;
    one_kind("bf16 packed", &c, false);
    mha_config_init(&c, 32, 4);  // and of separate q/k/v (kdim, vdim of their own)
    c.weight_dtype = MHA_BF16, c.kdim = 40, c.vdim = 36;
    one_kind("bf16 separate kdim 40 vdim 36", &c, false);
    return check_summary("test_packs");
}
