// _mha.c: the CPython binding of libmha (the extension module mha._mha):
// its functions table and init, diagnose, save_tensors / load_tensors; the
// rest in the files _mha.h lists.
// Public API only (include/mha.h); the Python layer (python/mha/__init__.py,
// mha/torch.py) builds on it.
//
// Arrays: any object exporting the buffer protocol (numpy arrays, torch's
// tensor.numpy() views, memoryviews) with any strides goes to the library
// as an mha_tensor view of the same memory: nothing is copied. A tuple
// (obj, dtype) reads obj's buffer as mha dtype `dtype` (same item size):
// bfloat16, which has no buffer format, comes as int16/uint16 memory.
// Outputs are allocated by the caller's `alloc(shape, dtype)` callable
// (numpy.empty or torch.empty behind it), which returns an object
// exporting a writable buffer; that object is what the call returns.
//
// The GIL is released while the library computes (Py_BEGIN_ALLOW_THREADS);
// the buffers are held (the exporters cannot resize or free them) until
// the call returns. Library errors become exceptions carrying mha's
// message: MHA_ERR_NOMEM MemoryError, MHA_ERR_IO OSError,
// MHA_ERR_NOT_FOUND KeyError, MHA_ERR_DTYPE TypeError, every other status
// ValueError. The
// binding checks what the library cannot see (an array's dtype kind, the
// lengths of per-batch and per-head vectors) before calling it.
#include "_mha.h"

// ---------------------------------------------------------------------------
// Diagnostics as a dict

static PyObject *spectrum_list(const mha_diag *d, int64_t h, char which) {
    int64_t n = 0;
    const double *s = mha_diag_spectrum(d, h, which, &n);
    PyObject *list = PyList_New(s ? n : 0);
    for (int64_t i = 0; list && s && i < n; i++)
        PyList_SET_ITEM(list, i, PyFloat_FromDouble(s[i]));
    return list;
}

static PyObject *head_dict(const mha_diag *d, int64_t h) {
    const mha_head_diag *x = mha_diag_head(d, h);
    PyObject *dict =
        Py_BuildValue("{s:L,s:L,s:d,s:d,s:d,s:d,s:d,s:d,s:d,s:O,s:L,s:L,s:L,s:L,s:O,s:d}",
                      "head", (long long)x->head, "rows", (long long)x->rows, "entropy_mean",
                      x->entropy_mean, "entropy_min", x->entropy_min, "entropy_norm",
                      x->entropy_norm, "mean_distance", x->mean_distance, "logit_max",
                      x->logit_max, "logit_std", x->logit_std, "output_var_ratio",
                      x->output_var_ratio, "dead", x->dead ? Py_True : Py_False, "rank_q",
                      (long long)x->rank_q, "rank_k", (long long)x->rank_k, "rank_v",
                      (long long)x->rank_v, "rank_o", (long long)x->rank_o, "pruned",
                      x->pruned ? Py_True : Py_False, "gate_mean", x->gate_mean);
    if (!dict) return NULL;
    PyObject *spec = PyDict_New();
    static const char which[4] = {'q', 'k', 'v', 'o'};
    for (int i = 0; spec && i < 4; i++) {
        PyObject *l = spectrum_list(d, h, which[i]);
        char key[2] = {which[i], 0};
        if (!l || PyDict_SetItemString(spec, key, l) < 0) Py_CLEAR(spec);
        Py_XDECREF(l);
    }
    PyErr_Clear();  // built without LAPACKE: empty spectra, not an error
    if (!spec || PyDict_SetItemString(dict, "singular_values", spec) < 0) Py_CLEAR(dict);
    Py_XDECREF(spec);
    return dict;
}

static PyObject *diag_dict(const mha_diag *d) {
    int64_t H = mha_diag_num_heads(d);
    PyObject *heads = PyList_New(H), *sim = PyList_New(H);
    for (int64_t h = 0; heads && sim && h < H; h++) {
        PyObject *row = PyList_New(H);
        for (int64_t g = 0; row && g < H; g++)
            PyList_SET_ITEM(row, g, PyFloat_FromDouble(mha_diag_similarity(d, h, g)));
        PyObject *hd = head_dict(d, h);
        if (!row || !hd) {
            Py_XDECREF(row);
            Py_XDECREF(hd);
            Py_CLEAR(heads);
            break;
        }
        PyList_SET_ITEM(sim, h, row);
        PyList_SET_ITEM(heads, h, hd);
    }
    const char *nf = mha_diag_nonfinite(d);
    PyObject *r = NULL;
    if (heads && sim)
        r = Py_BuildValue("{s:O,s:O,s:L,s:s}", "heads", heads, "similarity", sim, "rows",
                          (long long)mha_diag_rows(d), "nonfinite", nf);
    Py_XDECREF(heads);
    Py_XDECREF(sim);
    return r;
}

// diagnose(module, q, k, v, kpm, am, **forward and diagnostics options)
static PyObject *py_diagnose(PyObject *self, PyObject *args, PyObject *kw) {
    ModuleObject *mod;
    PyObject *q, *k, *v, *kpm, *am;
    if (!PyArg_ParseTuple(args, "O!OOOOO", &mha_py_module_type, &mod, &q, &k, &v, &kpm, &am))
        return NULL;
    fwd_call c;
    mha_py_fwd_call_init(&c);
    const kwopt opts[] = {FWD_OPTS(&c),
                          {"max_rows", 'L', &c.diag.max_rows},
                          {"dead_entropy", 'd', &c.diag.dead_entropy},
                          {"dead_output", 'd', &c.diag.dead_output},
                          {"rank_rtol", 'd', &c.diag.rank_rtol}};
    if (mha_py_parse_opts(kw, opts, (int)(sizeof opts / sizeof *opts), "diagnose") < 0)
        return NULL;
    held h = {.n = 0};
    if (mha_py_fwd_views(&h, &c, mod, q, k, v, kpm, am) < 0) {
        mha_py_release_all(&h);
        return NULL;
    }
    mha_diag *d = NULL;
    mha_status st;
    mod->readers++;
    Py_BEGIN_ALLOW_THREADS st = mha_diag_create(&d, mod->m, &c.a, &c.diag);
    Py_END_ALLOW_THREADS mod->readers--;
    mha_py_release_all(&h);
    if (st) return mha_py_raise_status(st);
    PyObject *r = diag_dict(d);
    mha_diag_destroy(d);
    return r;
}

// ---------------------------------------------------------------------------
// safetensors: save_tensors(path, [(name, array)], metadata) and
// load_tensors(path) -> ([(name, dtype, shape, bytes)], metadata)

static PyObject *py_save_tensors(PyObject *self, PyObject *args) {
    const char *path;
    PyObject *items, *meta;
    if (!PyArg_ParseTuple(args, "sOO!", &path, &items, &PyDict_Type, &meta)) return NULL;
    PyObject *fast = PySequence_Fast(items, "save_tensors: expected a list of (name, array)");
    if (!fast) return NULL;
    mha_st_writer *w;
    mha_status st = mha_st_writer_create(&w);
    if (st) {
        Py_DECREF(fast);
        return mha_py_raise_status(st);
    }
    for (Py_ssize_t i = 0; !st && i < PySequence_Fast_GET_SIZE(fast); i++) {
        const char *name;
        PyObject *arr;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "sO", &name, &arr)) break;
        Py_buffer b;
        if (PyObject_GetBuffer(arr, &b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) break;
        int dt = mha_py_dtype_of_format(b.format, b.itemsize);
        if (dt < 0) {
            PyErr_Format(PyExc_TypeError, "save_tensors: %s: dtype %s is not supported", name,
                         b.format ? b.format : "?");
            PyBuffer_Release(&b);
            break;
        }
        int64_t shape[MHA_MAX_DIMS];
        for (int d = 0; d < b.ndim && d < MHA_MAX_DIMS; d++) shape[d] = b.shape[d];
        if (b.ndim > MHA_MAX_DIMS) {
            PyErr_Format(PyExc_ValueError, "save_tensors: %s: %d dims", name, b.ndim);
            PyBuffer_Release(&b);
            break;
        }
        st = mha_st_writer_add(w, name, (mha_dtype)dt, b.ndim, shape, b.buf);
        PyBuffer_Release(&b);
    }
    Py_DECREF(fast);
    PyObject *key, *val;
    Py_ssize_t pos = 0;
    while (!st && !PyErr_Occurred() && PyDict_Next(meta, &pos, &key, &val)) {
        const char *k = PyUnicode_AsUTF8(key), *v = PyUnicode_AsUTF8(val);
        if (k && v) st = mha_st_writer_set_metadata(w, k, v);
    }
    if (!st && !PyErr_Occurred()) {
        Py_BEGIN_ALLOW_THREADS st = mha_st_writer_save(w, path);
        Py_END_ALLOW_THREADS
    }
    mha_st_writer_destroy(w);
    if (PyErr_Occurred()) return NULL;
    if (st) return mha_py_raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *py_load_tensors(PyObject *self, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
    mha_st_file *f;
    mha_status st;
    Py_BEGIN_ALLOW_THREADS st = mha_st_open(&f, path);
    Py_END_ALLOW_THREADS if (st) return mha_py_raise_status(st);
    int64_t n = mha_st_num_tensors(f), nm = mha_st_num_metadata(f);
    PyObject *list = PyList_New(n), *meta = PyDict_New();
    for (int64_t i = 0; list && meta && i < n; i++) {
        mha_st_tensor t;
        if ((st = mha_st_tensor_at(&t, f, i))) break;
        PyObject *shape = PyTuple_New(t.ndim);
        for (int d = 0; shape && d < t.ndim; d++)
            PyTuple_SET_ITEM(shape, d, PyLong_FromLongLong(t.shape[d]));
        PyObject *item = shape
                             ? Py_BuildValue("(ssNy#)", t.name, mha_dtype_name(t.dtype), shape,
                                             (const char *)t.data, (Py_ssize_t)t.nbytes)
                             : NULL;
        if (!item) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, i, item);
    }
    for (int64_t i = 0; !st && list && meta && i < nm; i++) {
        const char *k, *v;
        if ((st = mha_st_metadata_at(&k, &v, f, i))) break;
        PyObject *pv = PyUnicode_FromString(v);
        if (!pv || PyDict_SetItemString(meta, k, pv) < 0) Py_CLEAR(meta);
        Py_XDECREF(pv);
    }
    mha_st_close(f);
    if (st) {
        Py_XDECREF(list);
        Py_XDECREF(meta);
        return mha_py_raise_status(st);
    }
    if (!list || !meta) {
        Py_XDECREF(list);
        Py_XDECREF(meta);
        return NULL;
    }
    return Py_BuildValue("(NN)", list, meta);
}

// ---------------------------------------------------------------------------
// The module

static PyObject *py_isa(PyObject *self, PyObject *unused) {
    return PyUnicode_FromString(mha_isa());
}

static PyObject *py_last_impl(PyObject *self, PyObject *unused) {
    return PyUnicode_FromString(mha_last_impl());
}

static PyObject *py_release_scratch(PyObject *self, PyObject *unused) {
    mha_release_scratch();
    Py_RETURN_NONE;
}

static PyMethodDef functions[] = {
    {"forward", (PyCFunction)(void (*)(void))mha_py_forward, METH_VARARGS | METH_KEYWORDS,
     "forward(module, q, k, v, kpm, am, alloc, **options) -> (out, weights)"},
    {"backward", (PyCFunction)(void (*)(void))mha_py_backward, METH_VARARGS | METH_KEYWORDS,
     "backward(module, grads, q, k, v, kpm, am, grad_output, alloc, wq, wk, wv, **options)"},
    {"sdpa", (PyCFunction)(void (*)(void))mha_py_sdpa, METH_VARARGS | METH_KEYWORDS,
     "sdpa(q, k, v, attn_mask, key_padding_mask, alloc, **options) -> (out, weights)"},
    {"sdpa_backward", (PyCFunction)(void (*)(void))mha_py_sdpa_backward,
     METH_VARARGS | METH_KEYWORDS,
     "sdpa_backward(q, k, v, attn_mask, key_padding_mask, dout, alloc, **options) -> "
     "(dq, dk, dv, dsinks or None)"},
    {"forward_cached", (PyCFunction)(void (*)(void))mha_py_forward_cached,
     METH_VARARGS | METH_KEYWORDS, "forward_cached(module, q, cache, alloc, **options)"},
    {"forward_paged", (PyCFunction)(void (*)(void))mha_py_forward_paged,
     METH_VARARGS | METH_KEYWORDS,
     "forward_paged(module, q, cache, ids, counts, alloc, **options)"},
    {"diagnose", (PyCFunction)(void (*)(void))py_diagnose, METH_VARARGS | METH_KEYWORDS,
     "diagnose(module, q, k, v, kpm, am, **options) -> dict"},
    {"save_tensors", (PyCFunction)py_save_tensors, METH_VARARGS,
     "save_tensors(path, [(name, array)], metadata)"},
    {"load_tensors", (PyCFunction)py_load_tensors, METH_VARARGS,
     "load_tensors(path) -> ([(name, dtype, shape, bytes)], metadata)"},
    {"isa", (PyCFunction)py_isa, METH_NOARGS, "the SIMD kernels in use"},
    {"last_impl", (PyCFunction)py_last_impl, METH_NOARGS,
     "what this thread's last forward, backward, sdpa or sdpa_backward ran"},
    {"release_scratch", (PyCFunction)py_release_scratch, METH_NOARGS,
     "frees this thread's kept scratch block (mha_release_scratch)"},
    {"load_checkpoint", (PyCFunction)(void (*)(void))mha_py_load_checkpoint,
     METH_VARARGS | METH_KEYWORDS,
     "load_checkpoint(dir, layer, weight_dtype) -> (Module, CheckpointLayer)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_mha",
                                       "libmha's C API for Python (see mha)", -1, functions};

PyMODINIT_FUNC PyInit__mha(void) {
    if (PyType_Ready(&mha_py_module_type) < 0 || PyType_Ready(&mha_py_param_type) < 0 ||
        PyType_Ready(&mha_py_saved_type) < 0 || PyType_Ready(&mha_py_cache_type) < 0 ||
        PyType_Ready(&mha_py_checkpoint_layer_type) < 0 || PyType_Ready(&mha_py_paged_type) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    PyTypeObject *types[] = {&mha_py_module_type,
                             &mha_py_param_type,
                             &mha_py_saved_type,
                             &mha_py_cache_type,
                             &mha_py_checkpoint_layer_type,
                             &mha_py_paged_type};
    const char *names[] = {"Module",  "Param",           "Saved",
                           "KVCache", "CheckpointLayer", "PagedKVCache"};
    for (int i = 0; i < 6; i++) {
        Py_INCREF(types[i]);
        if (PyModule_AddObject(m, names[i], (PyObject *)types[i]) < 0) {
            Py_DECREF(types[i]);
            Py_DECREF(m);
            return NULL;
        }
    }
    if (PyModule_AddStringConstant(m, "version", mha_version()) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
