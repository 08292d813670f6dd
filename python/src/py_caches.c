// py_caches.c: the extension's KV caches: KVCache (an mha_kv_cache: append,
// attend, truncate, length) and PagedKVCache (an mha_paged_cache: add,
// fork, free, truncate, release, add_prompt), with forward_cached and
// forward_paged (a Module's forward against a cache).
#include "_mha.h"

// ---------------------------------------------------------------------------
// KVCache: an mha_kv_cache

typedef struct CacheObject {
    PyObject_HEAD mha_kv_cache *c;
    int64_t batch, num_kv_heads, v_head_dim;
    bool busy;  // a call is running on it with the GIL released
} CacheObject;

static PyObject *Cache_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *kws[] = {"batch",    "num_kv_heads", "head_dim", "v_head_dim",
                          "capacity", "dtype",        NULL};
    long long B, Hkv, D, Dv = 0, cap;
    const char *dtype = "f32";
    if (!PyArg_ParseTupleAndKeywords(args, kw, "LLLLL|s", kws, &B, &Hkv, &D, &Dv, &cap, &dtype))
        return NULL;
    mha_kv_dtype dt;
    if (mha_kv_dtype_from_name(&dt, dtype)) {
        PyErr_Format(PyExc_TypeError,
                     "KVCache dtype '%s': expected f32, bf16, f16, int8 or int4", dtype);
        return NULL;
    }
    CacheObject *o = PyObject_New(CacheObject, type);
    if (!o) return NULL;
    o->busy = false;
    o->batch = B;
    o->num_kv_heads = Hkv;
    o->v_head_dim = Dv ? Dv : D;
    mha_status st = mha_kv_cache_create(&o->c, B, Hkv, D, Dv, cap, dt);
    if (st) {
        o->c = NULL;
        Py_DECREF(o);
        return mha_py_raise_status(st);
    }
    return (PyObject *)o;
}

static void Cache_dealloc(CacheObject *o) {
    mha_kv_cache_destroy(o->c);
    PyObject_Free(o);
}

static int cache_claim(CacheObject *o) {
    if (!o->busy) {
        o->busy = true;
        return 0;
    }
    PyErr_SetString(PyExc_RuntimeError, "mha.KVCache: in use by another thread");
    return -1;
}

static PyObject *Cache_append(CacheObject *o, PyObject *args, PyObject *kw) {
    static char *kws[] = {"k", "v", "counts", NULL};
    PyObject *k, *v, *counts = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|O", kws, &k, &v, &counts)) return NULL;
    held h = {.n = 0};
    mha_tensor tk, tv;
    const void *cn;
    if (mha_py_get_view(&h, k, "k", K_FLOAT, false, &tk) < 0 ||
        mha_py_get_view(&h, v, "v", K_FLOAT, false, &tv) < 0 ||
        mha_py_get_vector(&h, counts, "counts", MHA_I64, o->batch, &cn) < 0 ||
        cache_claim(o) < 0) {
        mha_py_release_all(&h);
        return NULL;
    }
    mha_status st;
    Py_BEGIN_ALLOW_THREADS st = mha_kv_cache_append(o->c, &tk, &tv, cn);
    Py_END_ALLOW_THREADS o->busy = false;
    mha_py_release_all(&h);
    if (st) return mha_py_raise_status(st);
    Py_RETURN_NONE;
}

// An output's element type for inputs of type dt: bf16 and f16 keep theirs,
// the rest float32.
static mha_dtype half_or_f32(mha_dtype dt) {
    return dt == MHA_BF16 || dt == MHA_F16 ? dt : MHA_F32;
}

static PyObject *Cache_attend(CacheObject *o, PyObject *args, PyObject *kw) {
    PyObject *q, *alloc;
    if (!PyArg_ParseTuple(args, "OO", &q, &alloc)) return NULL;
    mha_cache_attend_args a;
    mha_cache_attend_args_init(&a);
    PyObject *counts = Py_None;
    attn_kw ak;
    mha_py_attn_kw_init(&ak);
    const kwopt opts[] = {ATTN_KW(&a.opts, &ak), {"counts", 'O', &counts}};
    if (mha_py_parse_opts(kw, opts, (int)(sizeof opts / sizeof *opts), "attend") < 0)
        return NULL;
    held h = {.n = 0};
    mha_tensor tq, to;
    const void *cn;
    PyObject *out = NULL;
    if (mha_py_get_view(&h, q, "q", K_FLOAT, false, &tq) < 0) goto fail;
    if (tq.ndim != 4) {
        PyErr_Format(PyExc_ValueError, "attend: q must be (B, H, T, D), got %d dims", tq.ndim);
        goto fail;
    }
    if (mha_py_get_vector(&h, counts, "counts", MHA_I64, o->batch, &cn) < 0 ||
        mha_py_attn_kw_apply(&h, &ak, &a.opts, tq.shape[1]) < 0)
        goto fail;
    mha_shape os = mha_py_shape_of(&tq);
    os.dims[3] = o->v_head_dim;
    if (!(out = mha_py_alloc_view(&h, alloc, &os, half_or_f32(tq.dtype), "out", &to)))
        goto fail;
    if (cache_claim(o) < 0) goto fail;
    mha_status st;
    Py_BEGIN_ALLOW_THREADS st = mha_kv_cache_attend(&to, &tq, o->c, &a, cn);
    Py_END_ALLOW_THREADS o->busy = false;
    return mha_py_finish(&h, true, st, &out, 1);
fail:
    return mha_py_finish(&h, false, MHA_OK, &out, 1);
}

static PyObject *Cache_truncate(CacheObject *o, PyObject *args) {
    long long b, len;
    if (!PyArg_ParseTuple(args, "LL", &b, &len)) return NULL;
    if (cache_claim(o) < 0) return NULL;
    mha_status st = mha_kv_cache_truncate(o->c, b, len);
    o->busy = false;
    if (st) return mha_py_raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *Cache_length(CacheObject *o, PyObject *args) {
    long long b;
    if (!PyArg_ParseTuple(args, "L", &b)) return NULL;
    int64_t n = mha_kv_cache_length(o->c, b);
    if (n < 0) {
        PyErr_Format(PyExc_IndexError, "KVCache.length: sequence %lld out of range [0, %lld)",
                     b, (long long)o->batch);
        return NULL;
    }
    return PyLong_FromLongLong(n);
}

static PyObject *Cache_capacity(CacheObject *o, void *unused) {
    return PyLong_FromLongLong(mha_kv_cache_capacity(o->c));
}

static PyObject *Cache_nbytes(CacheObject *o, void *unused) {
    return PyLong_FromSize_t(mha_kv_cache_bytes(o->c));
}

static PyMethodDef Cache_methods[] = {
    {"append", (PyCFunction)(void (*)(void))Cache_append, METH_VARARGS | METH_KEYWORDS,
     "append(k, v, counts=None)"},
    {"attend", (PyCFunction)(void (*)(void))Cache_attend, METH_VARARGS | METH_KEYWORDS,
     "attend(q, alloc, **options) -> out"},
    {"truncate", (PyCFunction)Cache_truncate, METH_VARARGS, "truncate(b, length); b -1: all"},
    {"length", (PyCFunction)Cache_length, METH_VARARGS, "length(b)"},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef Cache_getset[] = {
    {"capacity", (getter)Cache_capacity, NULL, "tokens per sequence", NULL},
    {"nbytes", (getter)Cache_nbytes, NULL, "bytes of K and V at capacity", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

// forward_cached(module, query, cache, alloc, **options) -> out
PyObject *mha_py_forward_cached(PyObject *self, PyObject *args, PyObject *kw) {
    ModuleObject *mod;
    CacheObject *cache;
    PyObject *q, *alloc;
    if (!PyArg_ParseTuple(args, "O!OO!O", &mha_py_module_type, &mod, &q, &mha_py_cache_type,
                          &cache, &alloc))
        return NULL;
    fwd_call c;
    mha_py_fwd_call_init(&c);
    const kwopt opts[] = {FWD_OPTS(&c)};
    if (mha_py_parse_opts(kw, opts, (int)(sizeof opts / sizeof *opts), "forward_cached") < 0)
        return NULL;
    held h = {.n = 0};
    PyObject *out = NULL;
    mha_tensor to;
    if (mha_py_fwd_views(&h, &c, mod, q, NULL, NULL, Py_None, Py_None) < 0) goto fail;
    mha_shape os = mha_py_shape_of(&c.q);
    if (!(out = mha_py_alloc_view(&h, alloc, &os, MHA_F32, "out", &to))) goto fail;
    if (cache_claim(cache) < 0) goto fail;
    mha_status st;
    mha_py_module_sync(mod);
    mod->readers++;
    Py_BEGIN_ALLOW_THREADS st = mha_forward_cached(&to, mod->m, &c.a, cache->c);
    Py_END_ALLOW_THREADS mod->readers--;
    cache->busy = false;
    return mha_py_finish(&h, true, st, &out, 1);
fail:
    return mha_py_finish(&h, false, MHA_OK, &out, 1);
}

// ---------------------------------------------------------------------------
// PagedKVCache: an mha_paged_cache (the library refuses concurrent changes
// itself: no busy flag)

typedef struct PagedObject {
    PyObject_HEAD mha_paged_cache *c;
} PagedObject;

static PyObject *Paged_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *kws[] = {"num_blocks", "block_size", "num_kv_heads", "head_dim",
                          "v_head_dim", "dtype",      "layout",       NULL};
    long long nb, bs, Hkv, D, Dv = 0;
    const char *dtype = "f32", *layout = "head-major";
    if (!PyArg_ParseTupleAndKeywords(args, kw, "LLLL|Lss", kws, &nb, &bs, &Hkv, &D, &Dv,
                                     &dtype, &layout))
        return NULL;
    mha_kv_dtype dt;
    if (mha_kv_dtype_from_name(&dt, dtype)) {
        PyErr_Format(PyExc_TypeError,
                     "PagedKVCache dtype '%s': expected f32, bf16, f16, int8 or int4", dtype);
        return NULL;
    }
    mha_paged_layout lay;
    if (mha_paged_layout_from_name(&lay, layout)) {
        PyErr_Format(PyExc_ValueError,
                     "PagedKVCache layout '%s': expected 'head-major' or 'block-major'",
                     layout);
        return NULL;
    }
    PagedObject *o = PyObject_New(PagedObject, type);
    if (!o) return NULL;
    mha_status st = mha_paged_cache_create(&o->c, nb, bs, Hkv, D, Dv ? Dv : D, dt, lay);
    if (st) {
        o->c = NULL;
        Py_DECREF(o);
        return mha_py_raise_status(st);
    }
    return (PyObject *)o;
}

static void Paged_dealloc(PagedObject *o) {
    mha_paged_cache_destroy(o->c);
    PyObject_Free(o);
}

static PyObject *Paged_add(PagedObject *o, PyObject *unused) {
    int64_t id;
    mha_status st = mha_paged_cache_add(o->c, &id);
    if (st) return mha_py_raise_status(st);
    return PyLong_FromLongLong(id);
}

static PyObject *Paged_fork(PagedObject *o, PyObject *args) {
    long long src;
    if (!PyArg_ParseTuple(args, "L", &src)) return NULL;
    int64_t id;
    mha_status st = mha_paged_cache_fork(o->c, src, &id);
    if (st) return mha_py_raise_status(st);
    return PyLong_FromLongLong(id);
}

static PyObject *Paged_free(PagedObject *o, PyObject *args) {
    long long id;
    if (!PyArg_ParseTuple(args, "L", &id)) return NULL;
    mha_status st = mha_paged_cache_free(o->c, id);
    if (st) return mha_py_raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *Paged_truncate(PagedObject *o, PyObject *args) {
    long long id, len;
    if (!PyArg_ParseTuple(args, "LL", &id, &len)) return NULL;
    mha_status st = mha_paged_cache_truncate(o->c, id, len);
    if (st) return mha_py_raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *Paged_release(PagedObject *o, PyObject *args) {
    long long id, keep, pos;
    if (!PyArg_ParseTuple(args, "LLL", &id, &keep, &pos)) return NULL;
    mha_status st = mha_paged_cache_release(o->c, id, keep, pos);
    if (st) return mha_py_raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *Paged_length(PagedObject *o, PyObject *args) {
    long long id;
    if (!PyArg_ParseTuple(args, "L", &id)) return NULL;
    const int64_t n = mha_paged_cache_length(o->c, id);
    if (n < 0) {
        PyErr_Format(PyExc_KeyError, "PagedKVCache: no sequence %lld (never added, or freed)",
                     id);
        return NULL;
    }
    return PyLong_FromLongLong(n);
}

static PyObject *Paged_add_prompt(PagedObject *o, PyObject *args) {
    PyObject *tokens;
    if (!PyArg_ParseTuple(args, "O", &tokens)) return NULL;
    Py_buffer b;
    if (PyObject_GetBuffer(tokens, &b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    if (mha_py_dtype_of_format(b.format, b.itemsize) != MHA_I32) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_TypeError, "add_prompt: tokens must be a contiguous int32 array");
        return NULL;
    }
    int64_t id, cached;
    mha_status st = mha_paged_cache_add_prompt(o->c, b.buf, (int64_t)(b.len / 4), &id, &cached);
    PyBuffer_Release(&b);
    if (st) return mha_py_raise_status(st);
    return Py_BuildValue("(LL)", (long long)id, (long long)cached);
}

static PyObject *Paged_blocks_in_use(PagedObject *o, PyObject *unused) {
    return PyLong_FromLongLong(mha_paged_cache_blocks_in_use(o->c));
}

static PyObject *Paged_blocks_free(PagedObject *o, PyObject *unused) {
    return PyLong_FromLongLong(mha_paged_cache_blocks_free(o->c));
}

static PyObject *Paged_block_bytes(PagedObject *o, void *unused) {
    return PyLong_FromSize_t(mha_paged_cache_block_bytes(o->c));
}

static PyMethodDef Paged_methods[] = {
    {"add_sequence", (PyCFunction)Paged_add, METH_NOARGS, "add_sequence() -> id"},
    {"add_prompt", (PyCFunction)Paged_add_prompt, METH_VARARGS,
     "add_prompt(tokens int32) -> (id, cached)"},
    {"fork", (PyCFunction)Paged_fork, METH_VARARGS, "fork(id) -> id"},
    {"free", (PyCFunction)Paged_free, METH_VARARGS, "free(id)"},
    {"truncate", (PyCFunction)Paged_truncate, METH_VARARGS, "truncate(id, length)"},
    {"release", (PyCFunction)Paged_release, METH_VARARGS, "release(id, keep, pos)"},
    {"length", (PyCFunction)Paged_length, METH_VARARGS, "length(id)"},
    {"blocks_in_use", (PyCFunction)Paged_blocks_in_use, METH_NOARGS, "blocks_in_use()"},
    {"blocks_free", (PyCFunction)Paged_blocks_free, METH_NOARGS, "blocks_free()"},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef Paged_getset[] = {
    {"block_bytes", (getter)Paged_block_bytes, NULL, "bytes of one block", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

// forward_paged(module, query, cache, ids, counts, tokens, alloc, **options)
// -> out (tokens: int32 (N, T) ids, or None)
PyObject *mha_py_forward_paged(PyObject *self, PyObject *args, PyObject *kw) {
    ModuleObject *mod;
    PagedObject *cache;
    PyObject *q, *ids, *counts, *tokens, *alloc;
    if (!PyArg_ParseTuple(args, "O!OO!OOOO", &mha_py_module_type, &mod, &q, &mha_py_paged_type,
                          &cache, &ids, &counts, &tokens, &alloc))
        return NULL;
    fwd_call c;
    mha_py_fwd_call_init(&c);
    const kwopt opts[] = {FWD_OPTS(&c)};
    if (mha_py_parse_opts(kw, opts, (int)(sizeof opts / sizeof *opts), "forward_paged") < 0)
        return NULL;
    held h = {.n = 0};
    PyObject *out = NULL;
    mha_tensor to;
    const void *iv, *cv, *tv;
    if (mha_py_fwd_views(&h, &c, mod, q, NULL, NULL, Py_None, Py_None) < 0) goto fail;
    const bool bf = mha_module_config(mod->m)->batch_first;
    const int64_t N = c.q.ndim == 3 ? c.q.shape[bf ? 0 : 1] : 1;
    const int64_t T = c.q.ndim == 3 ? c.q.shape[bf ? 1 : 0] : c.q.shape[0];
    if (mha_py_get_vector(&h, ids, "ids", MHA_I64, N, &iv) < 0 ||
        mha_py_get_vector(&h, counts, "counts", MHA_I64, N, &cv) < 0 ||
        mha_py_get_vector(&h, tokens, "tokens", MHA_I32, N * T, &tv) < 0)
        goto fail;
    mha_shape os = mha_py_shape_of(&c.q);
    if (!(out = mha_py_alloc_view(&h, alloc, &os, MHA_F32, "out", &to))) goto fail;
    mha_status st;
    mha_py_module_sync(mod);
    mod->readers++;
    Py_BEGIN_ALLOW_THREADS st = mha_forward_paged(&to, mod->m, &c.a, cache->c, iv, cv, tv);
    Py_END_ALLOW_THREADS mod->readers--;
    return mha_py_finish(&h, true, st, &out, 1);
fail:
    return mha_py_finish(&h, false, MHA_OK, &out, 1);
}

PyTypeObject mha_py_cache_type = {PyVarObject_HEAD_INIT(NULL, 0).tp_name = "mha._mha.KVCache",
                                  .tp_basicsize = sizeof(CacheObject),
                                  .tp_dealloc = (destructor)Cache_dealloc,
                                  .tp_flags = Py_TPFLAGS_DEFAULT,
                                  .tp_doc = "an mha_kv_cache",
                                  .tp_methods = Cache_methods,
                                  .tp_getset = Cache_getset,
                                  .tp_new = Cache_new};

PyTypeObject mha_py_paged_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "mha._mha.PagedKVCache",
    .tp_basicsize = sizeof(PagedObject),
    .tp_dealloc = (destructor)Paged_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "an mha_paged_cache",
    .tp_methods = Paged_methods,
    .tp_getset = Paged_getset,
    .tp_new = Paged_new};
