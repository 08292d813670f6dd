// py_calls.c: the extension's computing calls: forward and backward of a
// Module, sdpa and sdpa_backward, with the arguments they share (fwd_call:
// the views of q, k, v and the masks, the forward options), the trace
// callback, and the end of a call (outputs returned or dropped). The GIL is
// released around each library call.
#include "_mha.h"

// ---------------------------------------------------------------------------
// The trace callback: each step copied into a new array and handed to a
// Python callable (the forward runs on the calling thread; the GIL is
// taken for the call).

typedef struct trace_ctx {
    PyObject *fn, *alloc;
    bool failed;  // the first exception is kept and raised after the call
} trace_ctx;

static void copy_f32(float *dst, const mha_tensor *t) {
    int64_t idx[MHA_MAX_DIMS] = {0};
    int64_t n = mha_tensor_numel(t);
    const float *src = t->data;
    for (int64_t e = 0; e < n; e++) {
        int64_t off = 0;
        for (int d = 0; d < t->ndim; d++) off += idx[d] * t->stride[d];
        dst[e] = src[off];
        for (int d = t->ndim - 1; d >= 0; d--) {
            if (++idx[d] < t->shape[d]) break;
            idx[d] = 0;
        }
    }
}

static void trace_trampoline(void *user, const char *step, int64_t b, int64_t h,
                             const mha_tensor *t) {
    trace_ctx *c = user;
    PyGILState_STATE g = PyGILState_Ensure();
    if (!c->failed) {
        held hd = {.n = 0};
        mha_tensor out;
        mha_shape s = mha_py_shape_of(t);
        PyObject *arr = mha_py_alloc_view(&hd, c->alloc, &s, MHA_F32, "trace", &out);
        PyObject *r = NULL;
        if (arr) {
            copy_f32(out.data, t);
            mha_py_release_all(&hd);
            r = PyObject_CallFunction(c->fn, "(sLLO)", step, (long long)b, (long long)h, arr);
        }
        mha_py_release_all(&hd);
        Py_XDECREF(arr);
        if (!r) c->failed = true;  // the exception stays set until the end
        Py_XDECREF(r);
    }
    PyGILState_Release(g);
}

// ---------------------------------------------------------------------------
// Forward arguments shared by forward, backward, diagnose, forward_cached


void mha_py_fwd_call_init(fwd_call *c) {
    memset(c, 0, sizeof *c);
    mha_forward_args_init(&c->a);
    c->wh[0] = c->wr[0] = 0;
    c->wh[1] = c->wr[1] = -1;
    c->saved = c->rope_start = c->trace = Py_None;
    mha_py_attn_kw_init(&c->ak);
    c->checkpoint = c->rope_positions = Py_None;
    mha_diag_options_init(&c->diag);
}

// The batch size of a forward's query (for rope_start's length).
static int64_t query_batch(const mha_module *m, const mha_tensor *q) {
    if (q->ndim != 3) return 1;
    return mha_module_config(m)->batch_first ? q->shape[0] : q->shape[1];
}

// Views of the inputs and the option objects into c->a.
int mha_py_fwd_views(held *h, fwd_call *c, ModuleObject *mod, PyObject *q, PyObject *k,
                     PyObject *v, PyObject *kpm, PyObject *am) {
    if (mha_py_get_view(h, q, "query", K_FLOAT, false, &c->q) < 0) return -1;
    c->a.query = &c->q;
    if (k) {
        if (mha_py_get_view(h, k, "key", K_FLOAT, false, &c->k) < 0) return -1;
        if (mha_py_get_view(h, v, "value", K_FLOAT, false, &c->v) < 0) return -1;
        c->a.key = &c->k;
        c->a.value = &c->v;
    }
    if (mha_py_get_opt_view(h, kpm, "key_padding_mask", K_MASK, &c->kpm,
                            &c->a.key_padding_mask) < 0 ||
        mha_py_get_opt_view(h, am, "attn_mask", K_MASK, &c->am, &c->a.attn_mask) < 0)
        return -1;
    const mha_config *cfg = mha_module_config(mod->m);
    const void *p;
    if (mha_py_get_vector(h, c->rope_start, "rope_start", MHA_I64, query_batch(mod->m, &c->q),
                          &p) < 0)
        return -1;
    c->a.rope_start = p;
    if (mha_py_attn_kw_apply(h, &c->ak, &c->a.opts, cfg->num_heads) < 0) return -1;
    c->a.rope.mode = (mha_rope_mode)c->rope_mode;
    c->a.impl = (mha_impl)c->impl;
    c->a.weights_head_begin = c->wh[0];
    c->a.weights_head_end = c->wh[1];
    c->a.weights_row_begin = c->wr[0];
    c->a.weights_row_end = c->wr[1];
    if (c->saved != Py_None) {
        if (!PyObject_TypeCheck(c->saved, &mha_py_saved_type)) {
            PyErr_SetString(PyExc_TypeError, "saved: expected an mha._mha.Saved");
            return -1;
        }
        c->a.save = ((SavedObject *)c->saved)->s;
    }
    // the token positions (N * L of them, L the query's length)
    const int64_t N = query_batch(mod->m, &c->q),
                  Lq = c->q.ndim == 3 ? c->q.shape[cfg->batch_first ? 1 : 0] : c->q.shape[0];
    if (mha_py_get_vector(h, c->rope_positions, "rope_positions", MHA_I64, N * Lq, &p) < 0)
        return -1;
    c->a.rope_positions = p;
    // a checkpoint layer's options (after the others: they are the layer's)
    if (c->checkpoint != Py_None) {
        if (!PyObject_TypeCheck(c->checkpoint, &mha_py_checkpoint_layer_type)) {
            PyErr_SetString(PyExc_TypeError, "checkpoint: expected an mha._mha.CheckpointLayer");
            return -1;
        }
        mha_checkpoint_layer_apply(&((CheckpointLayerObject *)c->checkpoint)->info, &c->a);
    }
    return 0;
}

// The end of a call that made the outputs res[0..n) (NULL: not wanted):
// releases the held buffers; when ok and st is MHA_OK returns res[0] (n
// 1) or a tuple of them (None for the NULL ones); otherwise (an exception
// set, or the library's error, raised here) drops them and returns NULL.
PyObject *mha_py_finish(held *h, bool ok, mha_status st, PyObject **res, int n) {
    mha_py_release_all(h);
    if (ok && st) mha_py_raise_status(st);
    PyObject *t = ok && !st && n > 1 ? PyTuple_New(n) : NULL;
    if (ok && !st && (n == 1 || t)) {
        if (n == 1) return res[0];
        for (int i = 0; i < n; i++) {
            if (!res[i]) {
                Py_INCREF(Py_None);
                res[i] = Py_None;
            }
            PyTuple_SET_ITEM(t, i, res[i]);
        }
        return t;
    }
    for (int i = 0; i < n; i++) Py_XDECREF(res[i]);
    return NULL;
}

// Gradient outputs shaped and typed as their inputs: res[i] and td[i] for
// each wanted i (want NULL: all three). Returns 0 or -1.
static int alloc_grads(held *h, PyObject *alloc, const mha_tensor *const ins[3],
                       const int *want, PyObject *res[3], mha_tensor td[3]) {
    static const char *names[3] = {"grad_query", "grad_key", "grad_value"};
    for (int i = 0; i < 3; i++) {
        if (want && !want[i]) continue;
        mha_shape s = mha_py_shape_of(ins[i]);
        if (!(res[i] = mha_py_alloc_view(h, alloc, &s, ins[i]->dtype, names[i], &td[i])))
            return -1;
    }
    return 0;
}

PyObject *mha_py_forward(PyObject *self, PyObject *args, PyObject *kw) {
    ModuleObject *mod;
    PyObject *q, *k, *v, *kpm, *am, *alloc;
    if (!PyArg_ParseTuple(args, "O!OOOOOO", &mha_py_module_type, &mod, &q, &k, &v, &kpm, &am,
                          &alloc))
        return NULL;
    fwd_call c;
    mha_py_fwd_call_init(&c);
    const kwopt opts[] = {FWD_OPTS(&c)};
    if (mha_py_parse_opts(kw, opts, (int)(sizeof opts / sizeof *opts), "forward") < 0)
        return NULL;
    held h = {.n = 0};
    PyObject *res[2] = {NULL, NULL};
    trace_ctx tc = {c.trace, alloc, false};
    if (mha_py_fwd_views(&h, &c, mod, q, k, v, kpm, am) < 0)
        return mha_py_finish(&h, false, MHA_OK, res, 2);
    if (c.trace != Py_None) {
        c.a.trace = trace_trampoline;
        c.a.trace_user = &tc;
    }
    mha_shape os, ws;
    mha_tensor to, tw;
    mha_status st = mha_forward_shapes(&os, &ws, mod->m, &c.a);
    if (st) return mha_py_finish(&h, true, st, res, 2);
    if (!(res[0] = mha_py_alloc_view(&h, alloc, &os, c.q.dtype, "attn_output", &to)) ||
        (c.a.need_weights &&
         !(res[1] = mha_py_alloc_view(&h, alloc, &ws, c.q.dtype, "attn_weights", &tw))))
        return mha_py_finish(&h, false, MHA_OK, res, 2);
    mha_py_module_sync(mod);
    mod->readers++;
    Py_BEGIN_ALLOW_THREADS st = mha_forward(&to, res[1] ? &tw : NULL, mod->m, &c.a);
    Py_END_ALLOW_THREADS mod->readers--;
    return mha_py_finish(&h, !tc.failed, st, res, 2);  // a trace's exception wins
}

// backward(module, grads or None, q, k, v, kpm, am, grad_output, alloc,
//          want_q, want_k, want_v, **forward options) -> (dq, dk, dv)
PyObject *mha_py_backward(PyObject *self, PyObject *args, PyObject *kw) {
    ModuleObject *mod;
    PyObject *grads, *q, *k, *v, *kpm, *am, *gout, *alloc;
    int want[3];
    if (!PyArg_ParseTuple(args, "O!OOOOOOOOppp", &mha_py_module_type, &mod, &grads, &q, &k, &v,
                          &kpm, &am, &gout, &alloc, &want[0], &want[1], &want[2]))
        return NULL;
    if (grads != Py_None &&
        (!PyObject_TypeCheck(grads, &mha_py_module_type) || grads == (PyObject *)mod)) {
        PyErr_SetString(PyExc_TypeError,
                        "grads: expected None or an mha._mha.Module other than the module");
        return NULL;
    }
    ModuleObject *g = grads == Py_None ? NULL : (ModuleObject *)grads;
    fwd_call c;
    mha_py_fwd_call_init(&c);
    const kwopt opts[] = {FWD_OPTS(&c)};
    if (mha_py_parse_opts(kw, opts, (int)(sizeof opts / sizeof *opts), "backward") < 0)
        return NULL;
    held h = {.n = 0};
    PyObject *res[3] = {NULL, NULL, NULL};
    mha_tensor tg, td[3];
    if (mha_py_fwd_views(&h, &c, mod, q, k, v, kpm, am) < 0)
        return mha_py_finish(&h, false, MHA_OK, res, 3);
    const mha_tensor *ins[3] = {&c.q, c.a.key ? &c.k : &c.q, c.a.value ? &c.v : &c.q};
    if (c.trace != Py_None)
        PyErr_SetString(PyExc_ValueError, "backward: trace is a forward option");
    if (c.trace != Py_None ||
        mha_py_get_view(&h, gout, "grad_output", K_FLOAT, false, &tg) < 0 ||
        alloc_grads(&h, alloc, ins, want, res, td) < 0 ||
        (g && mha_py_module_idle(g, "write gradients into it") < 0))
        return mha_py_finish(&h, false, MHA_OK, res, 3);
    mha_status st;
    mha_py_module_sync(mod);  // (g: mha_backward marks its packed weights stale itself)
    mod->readers++;
    if (g) g->readers++;
    Py_BEGIN_ALLOW_THREADS st = mha_backward(want[0] ? &td[0] : NULL, want[1] ? &td[1] : NULL,
                                             want[2] ? &td[2] : NULL, g ? g->m : NULL, mod->m,
                                             &c.a, &tg, false);
    Py_END_ALLOW_THREADS mod->readers--;
    if (g) g->readers--;
    return mha_py_finish(&h, true, st, res, 3);
}

// ---------------------------------------------------------------------------
// Scaled dot-product attention on (B, H, L, D) views

typedef struct sdpa_call {
    mha_sdpa_args a;
    mha_tensor q, k, v, am, kpm;
    PyObject *saved;
    attn_kw ak;
    int64_t impl;
    bool need_weights;
} sdpa_call;

static int sdpa_views(held *h, sdpa_call *c, PyObject *q, PyObject *k, PyObject *v,
                      PyObject *am, PyObject *kpm, PyObject *kw, const char *fn) {
    mha_sdpa_args_init(&c->a);
    c->saved = Py_None;
    mha_py_attn_kw_init(&c->ak);
    c->impl = 0;
    c->need_weights = false;
    const kwopt opts[] = {ATTN_KW(&c->a.opts, &c->ak),
                          {"impl", 'L', &c->impl},
                          {"need_weights", 'b', &c->need_weights},
                          {"saved", 'O', &c->saved}};
    if (mha_py_parse_opts(kw, opts, (int)(sizeof opts / sizeof *opts), fn) < 0) return -1;
    if (c->saved != Py_None) {  // a training forward's state (mha_sdpa_args.save)
        if (!PyObject_TypeCheck(c->saved, &mha_py_saved_type)) {
            PyErr_SetString(PyExc_TypeError, "saved: expected an mha._mha.Saved");
            return -1;
        }
        c->a.save = ((SavedObject *)c->saved)->s;
    }
    c->a.impl = (mha_impl)c->impl;
    if (mha_py_get_view(h, q, "query", K_FLOAT, false, &c->q) < 0 ||
        mha_py_get_view(h, k, "key", K_FLOAT, false, &c->k) < 0 ||
        mha_py_get_view(h, v, "value", K_FLOAT, false, &c->v) < 0 ||
        mha_py_get_opt_view(h, am, "attn_mask", K_MASK, &c->am, &c->a.attn_mask) < 0 ||
        mha_py_get_opt_view(h, kpm, "key_padding_mask", K_MASK, &c->kpm,
                            &c->a.key_padding_mask) < 0)
        return -1;
    c->a.q = &c->q;
    c->a.k = &c->k;
    c->a.v = &c->v;
    if (c->q.ndim != 4 || c->k.ndim != 4 || c->v.ndim != 4) {
        PyErr_Format(PyExc_ValueError,
                     "sdpa: query, key and value must be 4-D, got %d, %d, %d dims", c->q.ndim,
                     c->k.ndim, c->v.ndim);
        return -1;
    }
    return mha_py_attn_kw_apply(h, &c->ak, &c->a.opts, c->q.shape[1]);
}

// sdpa(q, k, v, attn_mask, key_padding_mask, alloc, **options) -> (out, weights)
PyObject *mha_py_sdpa(PyObject *self, PyObject *args, PyObject *kw) {
    PyObject *q, *k, *v, *am, *kpm, *alloc;
    if (!PyArg_ParseTuple(args, "OOOOOO", &q, &k, &v, &am, &kpm, &alloc)) return NULL;
    sdpa_call c;
    held h = {.n = 0};
    PyObject *res[2] = {NULL, NULL};
    mha_tensor to, tw;
    if (sdpa_views(&h, &c, q, k, v, am, kpm, kw, "sdpa") < 0)
        return mha_py_finish(&h, false, MHA_OK, res, 2);
    mha_shape os = mha_py_shape_of(&c.q), ws = os;
    os.dims[3] = c.v.shape[3];  // (B, H, L, Dv); the library checks the rest
    ws.dims[3] = c.k.shape[2];  // (B, H, L, S)
    if (!(res[0] = mha_py_alloc_view(&h, alloc, &os, c.q.dtype, "out", &to)) ||
        (c.need_weights &&
         !(res[1] = mha_py_alloc_view(&h, alloc, &ws, c.q.dtype, "weights", &tw))))
        return mha_py_finish(&h, false, MHA_OK, res, 2);
    mha_status st;
    Py_BEGIN_ALLOW_THREADS st = mha_sdpa(&to, res[1] ? &tw : NULL, &c.a);
    Py_END_ALLOW_THREADS return mha_py_finish(&h, true, st, res, 2);
}

// sdpa_backward(q, k, v, attn_mask, key_padding_mask, dout, alloc,
//               **options) -> (dq, dk, dv, dsinks); dsinks: the sinks'
// gradient (H float32) when the options have sinks, else None
PyObject *mha_py_sdpa_backward(PyObject *self, PyObject *args, PyObject *kw) {
    PyObject *q, *k, *v, *am, *kpm, *dout, *alloc;
    if (!PyArg_ParseTuple(args, "OOOOOOO", &q, &k, &v, &am, &kpm, &dout, &alloc)) return NULL;
    sdpa_call c;
    held h = {.n = 0};
    PyObject *res[4] = {NULL, NULL, NULL, NULL};
    mha_tensor tdo, td[3], tds;
    if (sdpa_views(&h, &c, q, k, v, am, kpm, kw, "sdpa_backward") < 0 ||
        mha_py_get_view(&h, dout, "grad_out", K_FLOAT, false, &tdo) < 0)
        return mha_py_finish(&h, false, MHA_OK, res, 4);
    const mha_tensor *ins[3] = {&c.q, &c.k, &c.v};
    const mha_shape hs = {1, {c.q.shape[1]}};  // (H): one per query head
    if (alloc_grads(&h, alloc, ins, NULL, res, td) < 0 ||
        (c.a.opts.sinks &&
         !(res[3] = mha_py_alloc_view(&h, alloc, &hs, MHA_F32, "grad_sinks", &tds))))
        return mha_py_finish(&h, false, MHA_OK, res, 4);
    float *dsinks = res[3] ? (float *)tds.data : NULL;
    mha_status st;
    Py_BEGIN_ALLOW_THREADS st = mha_sdpa_backward(&td[0], &td[1], &td[2], dsinks, &tdo, &c.a);
    Py_END_ALLOW_THREADS return mha_py_finish(&h, true, st, res, 4);
}
