// fuzz_forward.c: libFuzzer target for the path from tensor files to a
// validated forward call, as `mha forward` takes it: a weights file through
// mha_module_load, an inputs file read as the CLI reads it (tools/mha.c
// run_load / load_input), then mha_forward with both implementations, with
// and without the attention weights, and (on request) mha_forward_cached.
//
// Input layout (all of it fuzzed; tests/fuzz/make_corpus.py writes seeds):
//   [0]  flags: 1 batch_first, 2 is_causal, 4 add_zero_attn, 8 per-head
//        weights (average_attn_weights off), 0x30 input dtype (0/3 F32,
//        1 BF16, 2 F16), 0x40 ALiBi, 0x80 soft cap 5
//   [1]  num_heads given to mha_module_load (0: the file's __metadata__)
//   [2]  flags: 0x03 weight_dtype (0/3 F32, 1 BF16, 2 F16), 0x0c RoPE
//        (0/3 none, 1 NeoX, 2 interleaved), 0x10 sliding window, 0x20
//        weights block, 0x40 training with dropout 0.25 / out_dropout 0.125,
//        0x80 U8 attention weights (with their scales)
//   [3]  window: left = low nibble, right = high nibble (15: unbounded)
//   [4]  weights block: heads [b & 3, end), rows [(b >> 2) & 3, end); end
//        -1 unless b & 0x10 (then begin + 1)
//   [5]  flags: 1 run mha_forward_cached too (the query's L tokens in
//        chunks of max(L / 2, 1)), 0x06 its cache dtype (F32, BF16, F16,
//        INT8); 0x08 the fused run through
//        mha_forward with an exactly sized, misaligned workspace; 0x10
//        int4 for the INT8 cache; 0x20 a training step (run_backward)
//   [6..7] dropout seed
//   [8..11] W, little-endian: bytes of the weights file (clamped)
//   [12 .. 12+W) the weights file; the rest: the inputs file, with tensors
//        query, key, value (float dtypes), key_padding_mask, attn_mask
//        (BOOL/U8 read as BOOL, floats as F32); key and value both absent:
//        self-attention.
// Any error status but MHA_ERR_NOMEM is fine (sizes are bounded, so NOMEM
// means the library sized something from a value the data does not back);
// crashes, sanitizer reports, leaks and hangs are findings. Sizes are bounded before anything runs: every dimension
// counts as at least 1 (so a zero-sized dim cannot hide a huge one), and a
// problem whose projection + attention work exceeds MAX_WORK multiply-adds
// or whose outputs exceed MAX_ELEMS elements is skipped.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mha.h"

#define MAX_ELEMS 1000000.0
#define MAX_WORK 4000000.0

// Sizes here are bounded and allocations do not fail, so MHA_ERR_NOMEM from
// the library means it asked for memory the inputs do not justify.
static void require_not_nomem(mha_status st, const char *what) {
    if (st != MHA_ERR_NOMEM) return;
    fprintf(stderr, "fuzz_forward: %s returned MHA_ERR_NOMEM on bounded sizes: %s\n", what,
            mha_last_error());
    abort();
}

typedef struct input {
    mha_tensor view;
    void *buf;
    int found;
} input;

static double max1(int64_t x) { return x > 1 ? (double)x : 1.0; }

// Elements of a shape with every dim counted as at least 1.
static double span(int ndim, const int64_t *dims) {
    double s = 1.0;
    for (int i = 0; i < ndim; i++) s *= max1(dims[i]);
    return s;
}

// Reads input `name` like the CLI's load_input: kind 0 float data (into
// `fto`), kind 1 a mask (BOOL/U8 -> BOOL, float -> F32). 0: absent or
// loaded; 1: rejected.
static int load_input(input *out, const mha_st_file *f, const char *name, int kind,
                      mha_dtype fto) {
    memset(out, 0, sizeof *out);
    mha_st_tensor t;
    mha_status st = mha_st_find(&t, f, name);
    if (st == MHA_ERR_NOT_FOUND) return 0;
    if (st) return 1;
    const int is_float = t.dtype == MHA_F32 || t.dtype == MHA_F16 || t.dtype == MHA_BF16 ||
                         t.dtype == MHA_F64;
    mha_dtype to = kind == 0 ? fto : MHA_F32;
    if (kind == 1 && (t.dtype == MHA_BOOL || t.dtype == MHA_U8)) to = MHA_BOOL;
    else if (!is_float) return 1;
    if (span(t.ndim, t.shape) > MAX_ELEMS) return 1;
    const size_t bytes = (size_t)t.numel * mha_dtype_size(to);
    out->buf = malloc(bytes ? bytes : 1);
    if (!out->buf) return 1;
    if (mha_st_read(out->buf, bytes, to, &t)) return 1;
    out->view = mha_tensor_contiguous(out->buf, to, t.ndim, t.shape);
    out->found = 1;
    return 0;
}

// An output buffer of exactly numel elements of dtype (at least 1 byte).
static void *alloc_out(mha_tensor *view, mha_dtype dtype, const mha_shape *s) {
    int64_t n = 1;
    for (int i = 0; i < s->ndim; i++) n *= s->dims[i];
    void *p = malloc(n ? (size_t)n * mha_dtype_size(dtype) : 1);
    if (p) *view = mha_tensor_contiguous(p, dtype, s->ndim, s->dims);
    return p;
}

// One forward with impl and need_weights; with a caller workspace when ex.
static void run_forward(const mha_module *m, mha_forward_args a, mha_impl impl,
                        bool need_weights, bool ex, mha_dtype odt, bool u8_weights) {
    a.impl = impl;
    a.need_weights = need_weights;
    mha_shape os, ws;
    if (mha_forward_shapes(&os, &ws, m, &a)) return;
    if (span(os.ndim, os.dims) > MAX_ELEMS || span(ws.ndim, ws.dims) > MAX_ELEMS) return;
    mha_tensor ot, wt;
    float *scales = NULL;
    void *obuf = alloc_out(&ot, odt, &os), *wbuf = NULL;
    if (need_weights) {
        wbuf = alloc_out(&wt, u8_weights ? MHA_U8 : odt, &ws);
        if (u8_weights) {  // one scale per row: the weights' shape less its last dim
            mha_shape ss = ws;
            ss.ndim--;
            mha_tensor sv;
            scales = alloc_out(&sv, MHA_F32, &ss);
            a.weights_scale = scales;
        }
    }
    if (obuf && (!need_weights || wbuf) && (!u8_weights || !need_weights || scales)) {
        mha_status st;
        if (ex) {
            size_t bytes = 0;
            st = mha_forward_workspace_size(&bytes, m, &a);
            if (st == MHA_OK) {
                // exactly `bytes`, starting one byte past an aligned block
                char *ws_block = malloc(bytes + 1);
                if (ws_block) {
                    a.workspace = ws_block + 1, a.workspace_bytes = bytes;
                    st = mha_forward(&ot, need_weights ? &wt : NULL, m, &a);
                    a.workspace = NULL, a.workspace_bytes = 0;
                    free(ws_block);
                }
            }
        } else {
            st = mha_forward(&ot, need_weights ? &wt : NULL, m, &a);
        }
        require_not_nomem(st, ex ? "mha_forward (workspace)" : "mha_forward");
    }
    free(obuf);
    free(wbuf);
    free(scales);
}

// Causal self-attention through a KV cache, the query in chunks of L / 2.
static void run_cached(const mha_module *m, const mha_forward_args *a0, mha_dtype odt,
                       mha_kv_dtype kvd) {
    const mha_tensor *q = a0->query;
    if (a0->key != q || q->ndim < 2 || q->ndim > 3) return;
    const mha_config *c = mha_module_config(m);
    const int sd = q->ndim == 2 || !c->batch_first ? 0 : 1;
    const int64_t L = q->shape[sd], N = q->ndim == 3 ? q->shape[1 - sd] : 1;
    const int64_t d = c->embed_dim / c->num_heads;
    mha_shape os = {q->ndim, {0}};
    for (int i = 0; i < q->ndim; i++) os.dims[i] = q->shape[i];
    if (span(os.ndim, os.dims) > MAX_ELEMS) return;
    mha_tensor ot;
    void *obuf = alloc_out(&ot, odt, &os);
    mha_kv_cache *cache = NULL;
    if (obuf &&
        mha_kv_cache_create(&cache, N, c->num_kv_heads, d, d, L > 0 ? L : 1, kvd) == MHA_OK) {
        const int64_t half = L / 2 > 0 ? L / 2 : 1;
        for (int64_t t0 = 0; t0 < L; t0 += half) {
            const int64_t n = L - t0 < half ? L - t0 : half;
            mha_tensor qc = *q, oc = ot;  // tokens [t0, t0 + n)
            qc.data = (char *)q->data + t0 * q->stride[sd] * (int64_t)mha_dtype_size(q->dtype);
            oc.data = (char *)ot.data + t0 * ot.stride[sd] * (int64_t)mha_dtype_size(ot.dtype);
            qc.shape[sd] = oc.shape[sd] = n;
            mha_forward_args a = *a0;
            a.query = a.key = a.value = &qc;
            mha_status st = mha_forward_cached(&oc, m, &a, cache);
            require_not_nomem(st, "mha_forward_cached");
            if (st) break;
        }
    }
    mha_kv_cache_destroy(cache);
    free(obuf);
}

// A training step: the forward with a saved state (impl), then
// mha_backward from it and without it, into gradients of the inputs'
// dtype and a gradient module like m (its weight matrices in m's
// storage: the half-weight and bf16 training paths).
static void run_backward(const mha_module *m, mha_forward_args a, mha_impl impl, mha_dtype odt) {
    a.impl = impl;
    a.need_weights = false;
    mha_shape os, ws;
    if (mha_forward_shapes(&os, &ws, m, &a)) return;
    if (span(os.ndim, os.dims) > MAX_ELEMS) return;
    const mha_tensor *ins[3] = {a.query, a.key, a.value};
    mha_tensor ot, got, gt[3];
    void *obuf = alloc_out(&ot, odt, &os), *gobuf = alloc_out(&got, odt, &os), *gbuf[3] = {0};
    bool ok = obuf && gobuf;
    if (gobuf) {  // (finite in every dtype: 0.0115 as F32 and BF16, 1.06 as F16)
        int64_t n = 1;
        for (int i = 0; i < os.ndim; i++) n *= os.dims[i];
        memset(gobuf, 0x3c, (size_t)n * mha_dtype_size(odt));
    }
    for (int i = 0; i < 3 && ok; i++) {
        mha_shape is = {ins[i]->ndim, {0}};
        for (int j = 0; j < ins[i]->ndim; j++) is.dims[j] = ins[i]->shape[j];
        ok = span(is.ndim, is.dims) <= MAX_ELEMS && (gbuf[i] = alloc_out(&gt[i], odt, &is));
    }
    mha_saved *sv = NULL;
    mha_module *g = NULL;
    if (ok && mha_saved_create(&sv) == MHA_OK &&
        mha_module_convert(&g, m, mha_module_config(m)->weight_dtype) == MHA_OK) {
        a.save = sv;
        mha_status st = mha_forward(&ot, NULL, m, &a);
        require_not_nomem(st, "mha_forward (save)");
        for (int r = 0; r < 2 && st == MHA_OK; r++) {  // from the state, then recomputed
            mha_forward_args ab = a;
            if (r) ab.save = NULL;
            mha_status bs = mha_backward(&gt[0], &gt[1], &gt[2], g, m, &ab, &got, r == 1);
            require_not_nomem(bs, "mha_backward");
        }
    }
    mha_module_destroy(g);
    mha_saved_destroy(sv);
    free(obuf), free(gobuf);
    for (int i = 0; i < 3; i++) free(gbuf[i]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 12) return 0;
    const uint8_t c0 = data[0], heads = data[1], c2 = data[2], win = data[3], blk = data[4],
                  c5 = data[5];
    size_t wlen = (size_t)data[8] | (size_t)data[9] << 8 | (size_t)data[10] << 16 |
                  (size_t)data[11] << 24;
    const uint8_t *rest = data + 12;
    const size_t rest_len = size - 12;
    if (wlen > rest_len) wlen = rest_len;
    static const mha_dtype dts[4] = {MHA_F32, MHA_BF16, MHA_F16, MHA_F32};
    const mha_dtype in_dt = dts[(c0 >> 4) & 3];

    mha_config base;
    mha_config_init(&base, 0, heads);
    base.batch_first = c0 & 1;
    base.add_zero_attn = (c0 >> 2) & 1;
    base.weight_dtype = dts[c2 & 3];
    const bool training = (c2 >> 6) & 1;
    if (training) {
        base.dropout = 0.25f;
        base.out_dropout = 0.125f;
    }

    mha_st_file *wf = NULL, *xf = NULL;
    mha_module *m = NULL;
    input in[5];
    memset(in, 0, sizeof in);
    mha_status st = mha_st_parse(&wf, rest, wlen, "weights.safetensors");
    require_not_nomem(st, "mha_st_parse (weights)");
    if (st) goto done;
    st = mha_module_load(&m, wf, &base);
    require_not_nomem(st, "mha_module_load");
    if (st) goto done;
    st = mha_st_parse(&xf, rest + wlen, rest_len - wlen, "inputs.safetensors");
    require_not_nomem(st, "mha_st_parse (inputs)");
    if (st) goto done;

    static const char *names[5] = {"query", "key", "value", "key_padding_mask", "attn_mask"};
    for (int i = 0; i < 5; i++)
        if (load_input(&in[i], xf, names[i], i >= 3, in_dt)) goto done;
    for (int64_t i = 0; i < mha_st_num_tensors(xf); i++) {
        mha_st_tensor t;
        if (mha_st_tensor_at(&t, xf, i)) goto done;
        bool known = false;
        for (int j = 0; j < 5; j++) known |= strcmp(t.name, names[j]) == 0;
        if (!known) goto done;  // as the CLI: unexpected tensor
    }
    if (!in[0].found || in[1].found != in[2].found) goto done;

    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = &in[0].view;
    a.key = in[1].found ? &in[1].view : a.query;
    a.value = in[2].found ? &in[2].view : a.query;
    a.key_padding_mask = in[3].found ? &in[3].view : NULL;
    a.attn_mask = in[4].found ? &in[4].view : NULL;
    a.opts.is_causal = (c0 >> 1) & 1;
    a.average_attn_weights = !((c0 >> 3) & 1);
    a.opts.alibi = (c0 >> 6) & 1;
    a.opts.softcap = (c0 >> 7) ? 5.0f : 0.0f;
    static const mha_rope_mode ropes[4] = {MHA_ROPE_NONE, MHA_ROPE_NEOX, MHA_ROPE_INTERLEAVED,
                                           MHA_ROPE_NONE};
    mha_rope_init(&a.rope, ropes[(c2 >> 2) & 3]);
    if ((c2 >> 4) & 1) {
        a.opts.window_left = (win & 15) == 15 ? -1 : win & 15;
        a.opts.window_right = (win >> 4) == 15 ? -1 : win >> 4;
    }
    if ((c2 >> 5) & 1) {
        a.weights_head_begin = blk & 3;
        a.weights_row_begin = (blk >> 2) & 3;
        if (blk & 0x10) {
            a.weights_head_end = a.weights_head_begin + 1;
            a.weights_row_end = a.weights_row_begin + 1;
        }
    }
    a.training = training;
    a.opts.dropout_seed = (uint64_t)data[6] | (uint64_t)data[7] << 8;
    const bool u8_weights = (c2 >> 7) & 1;

    // The work bound: projections and attention with every dim >= 1.
    const mha_config *c = mha_module_config(m);
    const mha_tensor *q = a.query, *k = a.key;
    if (q->ndim == 2 || q->ndim == 3) {
        const int sd = q->ndim == 2 || !c->batch_first ? 0 : 1;
        const double L = max1(q->shape[sd]), N = q->ndim == 3 ? max1(q->shape[1 - sd]) : 1.0;
        const double S = k->ndim == q->ndim ? max1(k->shape[sd]) + 2.0 : 1.0;
        const double E = (double)c->embed_dim, H = (double)c->num_heads, d = E / H,
                     Ekv = (double)c->num_kv_heads * d;
        const double work = N * (L * E * (2.0 * E + H) +
                                 S * Ekv * (double)(c->kdim + c->vdim) + 2.0 * H * L * S * d);
        if (work > MAX_WORK || N * H * L * S > MAX_ELEMS) goto done;
    }

    for (int w = 0; w < 2; w++) {
        run_forward(m, a, MHA_IMPL_REFERENCE, w, false, in_dt, u8_weights);
        run_forward(m, a, MHA_IMPL_FUSED, w, (c5 >> 3) & 1, in_dt, u8_weights);
    }
    if ((c5 >> 5) & 1) {  // a training step, both implementations
        run_backward(m, a, MHA_IMPL_REFERENCE, in_dt);
        run_backward(m, a, MHA_IMPL_FUSED, in_dt);
    }
    if (c5 & 1) {
        static const mha_kv_dtype kvs[4] = {MHA_KV_F32, MHA_KV_BF16, MHA_KV_F16, MHA_KV_INT8};
        mha_kv_dtype kd = kvs[(c5 >> 1) & 3];
        if (kd == MHA_KV_INT8 && (c5 >> 4) & 1) kd = MHA_KV_INT4;  // (bit 4: int4 for int8)
        run_cached(m, &a, in_dt, kd);
    }

done:
    for (int i = 0; i < 5; i++) free(in[i].buf);
    mha_module_destroy(m);
    mha_st_close(wf);
    mha_st_close(xf);
    return 0;
}
