// _mha.c: the CPython binding of libmha (the extension module mha._mha).
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
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "mha.h"

// ---------------------------------------------------------------------------
// Errors

static PyObject *raise_status(mha_status st) {
    const char *msg = mha_last_error();
    if (!msg || !*msg) msg = mha_status_string(st);
    PyObject *type = PyExc_ValueError;
    if (st == MHA_ERR_NOMEM) type = PyExc_MemoryError;
    else if (st == MHA_ERR_IO) type = PyExc_OSError;
    else if (st == MHA_ERR_NOT_FOUND) type = PyExc_KeyError;
    else if (st == MHA_ERR_DTYPE) type = PyExc_TypeError;
    PyErr_SetString(type, msg);
    return NULL;
}

// ---------------------------------------------------------------------------
// Buffers held for the length of one call

#define MAX_HELD 24

typedef struct held {
    Py_buffer b[MAX_HELD];
    int n;
} held;

static void release_all(held *h) {
    for (int i = 0; i < h->n; i++) PyBuffer_Release(&h->b[i]);
    h->n = 0;
}

// What an argument may hold.
enum kind {
    K_FLOAT,  // F32, F64, F16, BF16 (inputs and outputs)
    K_MASK,   // BOOL, U8, F32, F64
};

// The mha dtype of a buffer format ("f", "<d", "=e", ...); -1 if none.
static int dtype_of_format(const char *fmt, Py_ssize_t itemsize) {
    if (!fmt) return MHA_U8;  // PyBUF_FORMAT not given: bytes
    if (*fmt == '@' || *fmt == '=' || *fmt == '<') fmt++;
    if (fmt[0] == '\0' || fmt[1] != '\0') return -1;
    switch (fmt[0]) {
    case 'f': return MHA_F32;
    case 'd': return MHA_F64;
    case 'e': return MHA_F16;
    case '?': return MHA_BOOL;
    case 'B': return MHA_U8;
    case 'i': return itemsize == 4 ? MHA_I32 : -1;
    case 'l':
    case 'q': return itemsize == 8 ? MHA_I64 : (itemsize == 4 ? MHA_I32 : -1);
    default: return -1;
    }
}

static const char *kind_expects(enum kind k) {
    return k == K_FLOAT ? "float32, float64, float16 or bfloat16"
                        : "bool, uint8, float32 or float64";
}

static bool kind_allows(enum kind k, int dt) {
    if (k == K_FLOAT) return dt == MHA_F32 || dt == MHA_F64 || dt == MHA_F16 || dt == MHA_BF16;
    return dt == MHA_BOOL || dt == MHA_U8 || dt == MHA_F32 || dt == MHA_F64;
}

// Acquires obj's buffer (writable when `writable`) into h and describes it
// as t. obj: a buffer exporter, or (exporter, mha dtype). Returns 0, or -1
// with an exception set (TypeError for dtypes, ValueError for layouts).
static int get_view(held *h, PyObject *obj, const char *name, enum kind k, bool writable,
                    mha_tensor *t) {
    int forced = -1;
    if (PyTuple_Check(obj) && PyTuple_GET_SIZE(obj) == 2) {
        forced = (int)PyLong_AsLong(PyTuple_GET_ITEM(obj, 1));
        if (forced == -1 && PyErr_Occurred()) return -1;
        obj = PyTuple_GET_ITEM(obj, 0);
    }
    if (!PyObject_CheckBuffer(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: expected an array (numpy or torch), got %.80s",
                     name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (h->n == MAX_HELD) {
        PyErr_SetString(PyExc_RuntimeError, "mha: too many arrays in one call");
        return -1;
    }
    Py_buffer *b = &h->b[h->n];
    int flags = PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, b, flags) < 0) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_Format(writable ? PyExc_ValueError : PyExc_TypeError,
                     "%s: cannot take its memory as a%s strided array (%S)", name,
                     writable ? " writable" : "", value ? value : Py_None);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        return -1;
    }
    h->n++;
    int dt = dtype_of_format(b->format, b->itemsize);
    if (forced >= 0) {
        if (forced >= MHA_DTYPE_COUNT ||
            (Py_ssize_t)mha_dtype_size((mha_dtype)forced) != b->itemsize) {
            PyErr_Format(PyExc_TypeError, "%s: cannot read %zd-byte elements as dtype %d",
                         name, b->itemsize, forced);
            return -1;
        }
        dt = forced;
    }
    if (dt < 0 || !kind_allows(k, dt)) {
        PyErr_Format(PyExc_TypeError, "%s: dtype %s is not supported (expected %s)", name,
                     dt < 0 ? (b->format ? b->format : "?") : mha_dtype_name((mha_dtype)dt),
                     kind_expects(k));
        return -1;
    }
    if (b->ndim > MHA_MAX_DIMS) {
        PyErr_Format(PyExc_ValueError, "%s: %d dims, at most %d", name, b->ndim, MHA_MAX_DIMS);
        return -1;
    }
    memset(t, 0, sizeof *t);
    t->data = b->buf;
    t->dtype = (mha_dtype)dt;
    t->ndim = b->ndim;
    for (int i = 0; i < b->ndim; i++) {
        t->shape[i] = b->shape[i];
        if (b->strides[i] % b->itemsize) {
            PyErr_Format(PyExc_ValueError,
                         "%s: stride %zd bytes of dim %d is not a multiple of the element "
                         "size %zd",
                         name, b->strides[i], i, b->itemsize);
            return -1;
        }
        t->stride[i] = b->strides[i] / b->itemsize;
    }
    return 0;
}

// As get_view for an optional input: None gives *out = NULL.
static int get_opt_view(held *h, PyObject *obj, const char *name, enum kind k, mha_tensor *t,
                        const mha_tensor **out) {
    *out = NULL;
    if (obj == Py_None) return 0;
    if (get_view(h, obj, name, k, false, t) < 0) return -1;
    *out = t;
    return 0;
}

// A contiguous vector of n elements of dtype dt (int64 or float32) from
// obj (None: *out = NULL). Its length must be n.
static int get_vector(held *h, PyObject *obj, const char *name, mha_dtype dt, int64_t n,
                      const void **out) {
    *out = NULL;
    if (obj == Py_None) return 0;
    if (h->n == MAX_HELD) {
        PyErr_SetString(PyExc_RuntimeError, "mha: too many arrays in one call");
        return -1;
    }
    Py_buffer *b = &h->b[h->n];
    if (PyObject_GetBuffer(obj, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: expected a contiguous %s array, got %.80s", name,
                     mha_dtype_name(dt), Py_TYPE(obj)->tp_name);
        return -1;
    }
    h->n++;
    if (dtype_of_format(b->format, b->itemsize) != (int)dt) {
        PyErr_Format(PyExc_TypeError, "%s: dtype %s is not supported (expected %s)", name,
                     b->format ? b->format : "?",
                     dt == MHA_I64   ? "int64"
                     : dt == MHA_I32 ? "int32"
                                     : "float32");
        return -1;
    }
    if (b->len / b->itemsize != n) {
        PyErr_Format(PyExc_ValueError, "%s: %zd elements, expected %lld", name,
                     b->len / b->itemsize, (long long)n);
        return -1;
    }
    *out = b->buf;
    return 0;
}

// An output of the given shape and dtype from alloc(shape, dtype), viewed
// as t (its buffer held in h). Returns the new reference, or NULL.
static PyObject *alloc_view(held *h, PyObject *alloc, const mha_shape *s, mha_dtype dt,
                            const char *name, mha_tensor *t) {
    PyObject *shape = PyTuple_New(s->ndim);
    if (!shape) return NULL;
    for (int i = 0; i < s->ndim; i++) {
        PyObject *d = PyLong_FromLongLong(s->dims[i]);
        if (!d) {
            Py_DECREF(shape);
            return NULL;
        }
        PyTuple_SET_ITEM(shape, i, d);
    }
    PyObject *obj = PyObject_CallFunction(alloc, "(Oi)", shape, (int)dt);
    Py_DECREF(shape);
    if (!obj) return NULL;
    PyObject *arg = obj;
    PyObject *pair = NULL;
    if (dt == MHA_BF16) {  // 2-byte integers read as bfloat16
        pair = Py_BuildValue("(Oi)", obj, (int)dt);
        if (!pair) {
            Py_DECREF(obj);
            return NULL;
        }
        arg = pair;
    }
    int rc = get_view(h, arg, name, K_FLOAT, true, t);
    Py_XDECREF(pair);
    if (rc < 0) {
        Py_DECREF(obj);
        return NULL;
    }
    for (int i = 0; i < s->ndim; i++)
        if (t->shape[i] != s->dims[i] || t->ndim != s->ndim) {
            PyErr_Format(PyExc_RuntimeError, "%s: alloc returned the wrong shape", name);
            Py_DECREF(obj);
            return NULL;
        }
    return obj;
}

static mha_shape shape_of(const mha_tensor *t) {
    mha_shape s;
    s.ndim = t->ndim;
    for (int i = 0; i < t->ndim; i++) s.dims[i] = t->shape[i];
    return s;
}

// ---------------------------------------------------------------------------
// Keyword options: a table of name -> typed destination

typedef struct kwopt {
    const char *name;
    char type;  // 'b' bool, 'L' int64, 'K' uint64, 'd' double, 'f' float, 'O' object
    void *dst;
} kwopt;

// Reads the keyword dict kw (may be NULL) into the table; an unknown
// keyword or a value of the wrong type is a TypeError naming it.
static int parse_opts(PyObject *kw, const kwopt *opts, int n, const char *fn) {
    if (!kw) return 0;
    PyObject *key, *val;
    Py_ssize_t pos = 0;
    while (PyDict_Next(kw, &pos, &key, &val)) {
        const char *k = PyUnicode_AsUTF8(key);
        if (!k) return -1;
        int i = 0;
        while (i < n && strcmp(opts[i].name, k)) i++;
        if (i == n) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%s'", fn, k);
            return -1;
        }
        switch (opts[i].type) {
        case 'b': {
            int v = PyObject_IsTrue(val);
            if (v < 0) return -1;
            *(bool *)opts[i].dst = v;
            break;
        }
        case 'L':
        case 'K': {
            if (!PyLong_Check(val)) {
                PyErr_Format(PyExc_TypeError, "%s(): %s must be an integer, got %.80s", fn, k,
                             Py_TYPE(val)->tp_name);
                return -1;
            }
            if (opts[i].type == 'L') {
                long long v = PyLong_AsLongLong(val);
                if (v == -1 && PyErr_Occurred()) return -1;
                *(int64_t *)opts[i].dst = v;
            } else {
                unsigned long long v = PyLong_AsUnsignedLongLongMask(val);
                if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
                *(uint64_t *)opts[i].dst = v;
            }
            break;
        }
        case 'd':
        case 'f': {
            double v = PyFloat_AsDouble(val);
            if (v == -1.0 && PyErr_Occurred()) return -1;
            if (opts[i].type == 'd') *(double *)opts[i].dst = v;
            else *(float *)opts[i].dst = (float)v;
            break;
        }
        default: *(PyObject **)opts[i].dst = val; break;
        }
    }
    return 0;
}

// A scale keyword: None keeps 1/sqrt(D) (0), a number is used as given.
static int custom_scale(PyObject *obj, double *scale) {
    if (obj == Py_None) return 0;
    *scale = PyFloat_AsDouble(obj);
    return *scale == -1.0 && PyErr_Occurred() ? -1 : 0;
}

// The attention options' keywords (mha_attn_opts), the same in every call
// that attends: the fields themselves, and the objects read after parsing
// (attn_kw_apply): scale (None: 1 / sqrt(D)), alibi_slopes and sinks
// (float32 vectors of H), window ((left, right), each None or an int:
// window_left / window_right at once).
typedef struct attn_kw {
    PyObject *scale, *alibi_slopes, *sinks, *window;
} attn_kw;
#define ATTN_KW(o, k)                                                                     \
    {"is_causal", 'b', &(o)->is_causal}, {"window_left", 'L', &(o)->window_left},         \
        {"window_right", 'L', &(o)->window_right}, {"window", 'O', &(k)->window},         \
        {"scale", 'O', &(k)->scale}, {"softcap", 'f', &(o)->softcap},                     \
        {"alibi", 'b', &(o)->alibi}, {"alibi_slopes", 'O', &(k)->alibi_slopes},           \
        {"sinks", 'O', &(k)->sinks}, {"sink_tokens", 'L', &(o)->sink_tokens},             \
        {"dropout_p", 'f', &(o)->dropout_p}, {"dropout_seed", 'K', &(o)->dropout_seed}, { \
        "dropout_offset", 'K', &(o)->dropout_offset                                       \
    }

static void attn_kw_init(attn_kw *k) {
    k->scale = k->alibi_slopes = k->sinks = k->window = Py_None;
}

// One side of window=(left, right): None is -1 (unbounded).
static int window_side(PyObject *v, int64_t *out, const char *fn) {
    if (v == Py_None) return *out = -1, 0;
    if (!PyLong_Check(v)) {
        PyErr_Format(PyExc_TypeError,
                     "%s(): window must be (left, right), each None or an int", fn);
        return -1;
    }
    long long x = PyLong_AsLongLong(v);
    if (x == -1 && PyErr_Occurred()) return -1;
    *out = x;
    return 0;
}

// Reads k's objects into o; H: the query heads (the vectors' length).
static int attn_kw_apply(held *h, const attn_kw *k, mha_attn_opts *o, int64_t H,
                         const char *fn) {
    if (custom_scale(k->scale, &o->scale) < 0) return -1;
    if (k->window != Py_None) {
        if (!PyTuple_Check(k->window) || PyTuple_GET_SIZE(k->window) != 2) {
            PyErr_Format(PyExc_TypeError, "%s(): window must be a tuple (left, right)", fn);
            return -1;
        }
        if (window_side(PyTuple_GET_ITEM(k->window, 0), &o->window_left, fn) < 0 ||
            window_side(PyTuple_GET_ITEM(k->window, 1), &o->window_right, fn) < 0)
            return -1;
    }
    const void *p;
    if (get_vector(h, k->alibi_slopes, "alibi_slopes", MHA_F32, H, &p) < 0) return -1;
    o->alibi_slopes = p;
    if (get_vector(h, k->sinks, "sinks", MHA_F32, H, &p) < 0) return -1;
    o->sinks = p;
    return 0;
}

// ---------------------------------------------------------------------------
// Module: an mha_module

typedef struct ModuleObject {
    PyObject_HEAD mha_module *m;
    Py_ssize_t readers;  // calls reading it with the GIL released
    Py_ssize_t views;    // live writable buffers of its parameters (Param)
    bool exposed;        // one lived since the last call that read it
} ModuleObject;

static PyTypeObject ModuleType;

static PyObject *wrap_module(mha_module *m) {
    ModuleObject *o = PyObject_New(ModuleObject, &ModuleType);
    if (!o) {
        mha_module_destroy(m);
        return NULL;
    }
    o->m = m;
    o->readers = 0;
    o->views = 0;
    o->exposed = false;
    return (PyObject *)o;
}

// Before a call that reads the module (GIL held): its parameters may have
// been written through a Param buffer (numpy arrays, torch tensors on its
// storage: torch's optimizers write there) since the last such call, so
// its packed weights are marked stale (mha_module_params_changed; safe
// while other threads' calls read it). Without a buffer alive or died
// since, nothing could have written it and the packed copy is kept.
static void module_sync(ModuleObject *o) {
    if (o->views > 0 || o->exposed) mha_module_params_changed(o->m);
    o->exposed = false;
}

static int module_idle(ModuleObject *o, const char *what) {
    if (o->readers == 0) return 0;
    PyErr_Format(PyExc_RuntimeError,
                 "mha module: cannot %s while %zd call(s) in other threads read it", what,
                 o->readers);
    return -1;
}

static int parse_dtype_name(const char *s, mha_dtype *out) {
    mha_status st = mha_dtype_from_name(out, s);
    if (st) {
        PyErr_Format(PyExc_TypeError, "unknown dtype '%s' (expected F32, BF16 or F16)", s);
        return -1;
    }
    return 0;
}

static PyObject *Module_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *kws[] = {
        "embed_dim",    "num_heads",     "kdim",        "vdim",    "bias",
        "add_bias_kv",  "add_zero_attn", "batch_first", "dropout", "num_kv_heads",
        "weight_dtype", "head_gate",     "out_dropout", NULL};
    long long E, H, kdim = 0, vdim = 0, hkv = 0;
    int bias = 1, bias_kv = 0, zero_attn = 0, batch_first = 0;
    double dropout = 0.0, out_dropout = 0.0;
    const char *wdt = "F32", *gate = "none";
    if (!PyArg_ParseTupleAndKeywords(args, kw, "LL|LLppppdLssd", kws, &E, &H, &kdim, &vdim,
                                     &bias, &bias_kv, &zero_attn, &batch_first, &dropout, &hkv,
                                     &wdt, &gate, &out_dropout))
        return NULL;
    mha_config c;
    mha_config_init(&c, E, H);
    c.kdim = kdim;
    c.vdim = vdim;
    c.bias = bias;
    c.add_bias_kv = bias_kv;
    c.add_zero_attn = zero_attn;
    c.batch_first = batch_first;
    c.dropout = (float)dropout;
    c.out_dropout = (float)out_dropout;
    c.num_kv_heads = hkv;
    if (!(dropout >= 0.0 && dropout < 1.0) || !(out_dropout >= 0.0 && out_dropout < 1.0)) {
        char msg[160];
        snprintf(msg, sizeof msg, "dropout %g, out_dropout %g: each must be in [0, 1)",
                 dropout, out_dropout);
        PyErr_SetString(PyExc_ValueError, msg);
        return NULL;
    }
    if (parse_dtype_name(wdt, &c.weight_dtype) < 0) return NULL;
    if (mha_head_gate_from_name(&c.head_gate, gate)) {
        PyErr_Format(PyExc_ValueError, "head_gate '%s': expected none, static or dynamic", gate);
        return NULL;
    }
    mha_module *m;
    mha_status st = mha_module_create(&m, &c);
    if (st) return raise_status(st);
    (void)type;
    return wrap_module(m);
}

static void Module_dealloc(ModuleObject *o) {
    mha_module_destroy(o->m);
    PyObject_Free(o);
}

static PyObject *Module_load(PyObject *cls, PyObject *args, PyObject *kw) {
    static char *kws[] = {"path",          "num_heads", "num_kv_heads", "batch_first",
                          "add_zero_attn", "dropout",   "weight_dtype", NULL};
    const char *path, *wdt = "F32";
    long long H = 0, hkv = 0;
    int batch_first = 0, zero_attn = 0;
    double dropout = 0.0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s|LLppds", kws, &path, &H, &hkv, &batch_first,
                                     &zero_attn, &dropout, &wdt))
        return NULL;
    mha_config base;
    memset(&base, 0, sizeof base);
    base.num_heads = H;
    base.num_kv_heads = hkv;
    base.batch_first = batch_first;
    base.add_zero_attn = zero_attn;
    base.dropout = (float)dropout;
    if (parse_dtype_name(wdt, &base.weight_dtype) < 0) return NULL;
    mha_st_file *f;
    mha_module *m = NULL;
    mha_status st;
    Py_BEGIN_ALLOW_THREADS st = mha_st_open(&f, path);
    if (!st) {
        st = mha_module_load(&m, f, &base);
        mha_st_close(f);
    }
    Py_END_ALLOW_THREADS if (st) return raise_status(st);
    (void)cls;
    return wrap_module(m);
}

static PyObject *Module_save(ModuleObject *o, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
    mha_status st;
    Py_BEGIN_ALLOW_THREADS st = mha_module_save(o->m, path);
    Py_END_ALLOW_THREADS if (st) return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *Module_init(ModuleObject *o, PyObject *args, PyObject *kw) {
    static char *kws[] = {"scheme", "gain", "std", "seed", NULL};
    mha_init_options opt;
    mha_init_options_init(&opt);
    const char *scheme = "xavier_uniform";
    unsigned long long seed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|sddK", kws, &scheme, &opt.gain, &opt.std,
                                     &seed))
        return NULL;
    opt.seed = seed;
    if (module_idle(o, "initialise it") < 0) return NULL;
    mha_status st = mha_init_scheme_from_name(&opt.scheme, scheme);
    if (!st) st = mha_module_init(o->m, &opt);
    if (st) return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *Module_params(ModuleObject *o, PyObject *unused) {
    int n = mha_module_num_params(o->m);
    PyObject *list = PyList_New(n);
    if (!list) return NULL;
    for (int i = 0; i < n; i++) {
        mha_param p;
        mha_status st = mha_module_param_at(&p, o->m, i);
        if (st) {
            Py_DECREF(list);
            return raise_status(st);
        }
        PyObject *shape = PyTuple_New(p.ndim);
        if (!shape) {
            Py_DECREF(list);
            return NULL;
        }
        for (int d = 0; d < p.ndim; d++)
            PyTuple_SET_ITEM(shape, d, PyLong_FromLongLong(p.shape[d]));
        PyObject *item = Py_BuildValue("(sNs)", p.name, shape, mha_dtype_name(p.dtype));
        if (!item) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, item);
    }
    return list;
}

// A parameter's storage as a writable buffer; keeps its module alive.
typedef struct ParamObject {
    PyObject_HEAD ModuleObject *owner;
    void *data;
    int ndim;
    Py_ssize_t shape[3], strides[3];
    Py_ssize_t itemsize, len;
    const char *format;
} ParamObject;

static PyTypeObject ParamType;

static int Param_getbuffer(ParamObject *p, Py_buffer *view, int flags) {
    if (PyBuffer_FillInfo(view, (PyObject *)p, p->data, p->len, 0, flags) < 0) return -1;
    view->itemsize = p->itemsize;
    view->ndim = p->ndim;
    view->format = (flags & PyBUF_FORMAT) ? (char *)p->format : NULL;
    view->shape = (flags & PyBUF_ND) ? p->shape : NULL;
    view->strides = (flags & PyBUF_STRIDES) ? p->strides : NULL;
    return 0;
}

static PyBufferProcs Param_as_buffer = {(getbufferproc)Param_getbuffer, NULL};

static void Param_dealloc(ParamObject *p) {
    if (p->owner) {  // (a write may have come after the module's last call)
        p->owner->views--;
        p->owner->exposed = true;
    }
    Py_XDECREF(p->owner);
    PyObject_Free(p);
}

static PyObject *Module_param(ModuleObject *o, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    mha_param p;
    mha_status st = mha_module_param(&p, o->m, name);
    if (st) return raise_status(st);
    ParamObject *b = PyObject_New(ParamObject, &ParamType);
    if (!b) return NULL;
    Py_INCREF(o);
    b->owner = o;
    o->views++;
    b->data = p.storage;
    b->ndim = p.ndim;
    b->itemsize = (Py_ssize_t)mha_dtype_size(p.dtype);
    b->format = p.dtype == MHA_F32 ? "f" : (p.dtype == MHA_F16 ? "e" : "H");
    Py_ssize_t stride = b->itemsize;
    for (int d = p.ndim - 1; d >= 0; d--) {
        b->shape[d] = p.shape[d];
        b->strides[d] = stride;
        stride *= p.shape[d];
    }
    b->len = (Py_ssize_t)p.numel * b->itemsize;
    return (PyObject *)b;
}

static PyObject *Module_config(ModuleObject *o, PyObject *unused) {
    const mha_config *c = mha_module_config(o->m);
    return Py_BuildValue("{s:L,s:L,s:L,s:L,s:O,s:O,s:O,s:O,s:d,s:d,s:L,s:s,s:s}", "embed_dim",
                         (long long)c->embed_dim, "num_heads", (long long)c->num_heads, "kdim",
                         (long long)c->kdim, "vdim", (long long)c->vdim, "bias",
                         c->bias ? Py_True : Py_False, "add_bias_kv",
                         c->add_bias_kv ? Py_True : Py_False, "add_zero_attn",
                         c->add_zero_attn ? Py_True : Py_False, "batch_first",
                         c->batch_first ? Py_True : Py_False, "dropout", (double)c->dropout,
                         "out_dropout", (double)c->out_dropout, "num_kv_heads",
                         (long long)c->num_kv_heads, "weight_dtype",
                         mha_dtype_name(c->weight_dtype), "head_gate",
                         mha_head_gate_name(c->head_gate));
}

// A module of the same configuration, every parameter zero (for gradients).
static PyObject *Module_like(ModuleObject *o, PyObject *unused) {
    mha_module *m;
    mha_status st = mha_module_create(&m, mha_module_config(o->m));
    if (st) return raise_status(st);
    return wrap_module(m);
}

static PyObject *Module_convert(ModuleObject *o, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    mha_dtype dt;
    if (parse_dtype_name(name, &dt) < 0) return NULL;
    mha_module *m;
    mha_status st = mha_module_convert(&m, o->m, dt);
    if (st) return raise_status(st);
    return wrap_module(m);
}

static PyObject *Module_prune_heads(ModuleObject *o, PyObject *args) {
    PyObject *seq;
    if (!PyArg_ParseTuple(args, "O", &seq)) return NULL;
    PyObject *fast = PySequence_Fast(seq, "prune_heads: expected a sequence of head indices");
    if (!fast) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    int64_t *heads = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *heads);
    if (!heads) {
        Py_DECREF(fast);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        heads[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (heads[i] == -1 && PyErr_Occurred()) {
            PyMem_Free(heads);
            Py_DECREF(fast);
            return NULL;
        }
    }
    Py_DECREF(fast);
    if (module_idle(o, "prune heads") < 0) {
        PyMem_Free(heads);
        return NULL;
    }
    mha_status st = mha_module_prune_heads(o->m, heads, (int64_t)n);
    PyMem_Free(heads);
    if (st) return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *Module_pruned_heads(ModuleObject *o, PyObject *unused) {
    int64_t H = mha_module_config(o->m)->num_heads;
    PyObject *list = PyList_New(0);
    for (int64_t h = 0; list && h < H; h++)
        if (mha_module_head_pruned(o->m, h)) {
            PyObject *v = PyLong_FromLongLong(h);
            if (!v || PyList_Append(list, v) < 0) Py_CLEAR(list);
            Py_XDECREF(v);
        }
    return list;
}

static PyMethodDef Module_methods[] = {
    {"load", (PyCFunction)(void (*)(void))Module_load, METH_VARARGS | METH_KEYWORDS | METH_CLASS,
     "load(path, num_heads=0, ...): a module from a safetensors file"},
    {"save", (PyCFunction)Module_save, METH_VARARGS, "save(path): safetensors"},
    {"init", (PyCFunction)(void (*)(void))Module_init, METH_VARARGS | METH_KEYWORDS,
     "init(scheme, gain, std, seed)"},
    {"params", (PyCFunction)Module_params, METH_NOARGS, "[(name, shape, dtype)]"},
    {"param", (PyCFunction)Module_param, METH_VARARGS, "param(name): a writable buffer"},
    {"config", (PyCFunction)Module_config, METH_NOARGS, "the resolved configuration"},
    {"like", (PyCFunction)Module_like, METH_NOARGS, "a zero module of the same configuration"},
    {"convert", (PyCFunction)Module_convert, METH_VARARGS, "convert(dtype): a copy"},
    {"prune_heads", (PyCFunction)Module_prune_heads, METH_VARARGS, "prune_heads(heads)"},
    {"pruned_heads", (PyCFunction)Module_pruned_heads, METH_NOARGS, "the pruned heads"},
    {NULL, NULL, 0, NULL}};

// ---------------------------------------------------------------------------
// Saved: an mha_saved (a training forward's state for the backward)

typedef struct SavedObject {
    PyObject_HEAD mha_saved *s;
} SavedObject;

static PyTypeObject SavedType;

static PyObject *Saved_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    if (!PyArg_ParseTuple(args, "")) return NULL;
    SavedObject *o = PyObject_New(SavedObject, type);
    if (!o) return NULL;
    mha_status st = mha_saved_create(&o->s);
    if (st) {
        o->s = NULL;
        Py_DECREF(o);
        return raise_status(st);
    }
    return (PyObject *)o;
}

static void Saved_dealloc(SavedObject *o) {
    mha_saved_destroy(o->s);
    PyObject_Free(o);
}

static PyObject *Saved_nbytes(SavedObject *o, void *unused) {
    return PyLong_FromSize_t(mha_saved_bytes(o->s));
}

static PyGetSetDef Saved_getset[] = {
    {"nbytes", (getter)Saved_nbytes, NULL, "bytes held", NULL}, {NULL, NULL, NULL, NULL, NULL}};

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
        mha_shape s = shape_of(t);
        PyObject *arr = alloc_view(&hd, c->alloc, &s, MHA_F32, "trace", &out);
        PyObject *r = NULL;
        if (arr) {
            copy_f32(out.data, t);
            release_all(&hd);
            r = PyObject_CallFunction(c->fn, "(sLLO)", step, (long long)b, (long long)h, arr);
        }
        release_all(&hd);
        Py_XDECREF(arr);
        if (!r) c->failed = true;  // the exception stays set until the end
        Py_XDECREF(r);
    }
    PyGILState_Release(g);
}

// ---------------------------------------------------------------------------
// CheckpointLayer: what a Hugging Face checkpoint's layer does beyond its
// parameters (mha_checkpoint_layer), for the forward options "checkpoint"

typedef struct CheckpointLayerObject {
    PyObject_HEAD mha_checkpoint_layer info;
} CheckpointLayerObject;

static PyTypeObject CheckpointLayerType;

static void CheckpointLayer_dealloc(CheckpointLayerObject *o) { PyObject_Free(o); }

static const char *scaling_name(mha_rope_scaling_type t) {
    switch (t) {
    case MHA_ROPE_SCALING_NONE: return "default";
    case MHA_ROPE_SCALING_LINEAR: return "linear";
    case MHA_ROPE_SCALING_DYNAMIC: return "dynamic";
    case MHA_ROPE_SCALING_YARN: return "yarn";
    case MHA_ROPE_SCALING_LLAMA3: return "llama3";
    }
    return "?";
}

// info() -> dict of the layer's options
static PyObject *CheckpointLayer_info(CheckpointLayerObject *o, PyObject *unused) {
    const mha_checkpoint_layer *i = &o->info;
    const mha_rope_scaling *s = &i->rope_scaling;
    return Py_BuildValue(
        "{s:s,s:L,s:O,s:L,s:i,s:d,s:L,s:{s:s,s:d,s:L,s:d,s:d,s:d,s:d,s:d,s:d,s:d,s:O},s:d,s:O,"
        "s:d}",
        "model_type", i->model_type, "layer", (long long)i->layer, "is_causal",
        i->opts.is_causal ? Py_True : Py_False, "window_left", (long long)i->opts.window_left,
        "rope_mode", (int)i->rope.mode, "rope_theta", i->rope.theta, "rope_dim",
        (long long)i->rope.dim, "rope_scaling", "type", scaling_name(s->type), "factor",
        s->factor, "original_max_position", (long long)s->original_max_position,
        "low_freq_factor", s->low_freq_factor, "high_freq_factor", s->high_freq_factor,
        "beta_fast", s->beta_fast, "beta_slow", s->beta_slow, "mscale", s->mscale,
        "mscale_all_dim", s->mscale_all_dim, "attention_factor", s->attention_factor,
        "truncate", s->truncate ? Py_True : Py_False, "softcap", (double)i->opts.softcap,
        "use_custom_scale", i->opts.scale != 0.0 ? Py_True : Py_False, "scale", i->opts.scale);
}

static PyMethodDef CheckpointLayer_methods[] = {
    {"info", (PyCFunction)CheckpointLayer_info, METH_NOARGS, "the layer's options (a dict)"},
    {NULL, NULL, 0, NULL}};

// load_checkpoint(dir, layer, weight_dtype="F32") -> (Module, CheckpointLayer)
static PyObject *py_load_checkpoint(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kws[] = {"dir", "layer", "weight_dtype", NULL};
    const char *dir, *wdt = "F32";
    long long layer = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s|Ls", kws, &dir, &layer, &wdt)) return NULL;
    mha_config base;
    mha_config_init(&base, 0, 0);
    base.batch_first = true;  // transformers' (N, L, E)
    if (parse_dtype_name(wdt, &base.weight_dtype) < 0) return NULL;
    CheckpointLayerObject *info = PyObject_New(CheckpointLayerObject, &CheckpointLayerType);
    if (!info) return NULL;
    mha_module *m = NULL;
    mha_status st;
    Py_BEGIN_ALLOW_THREADS st = mha_module_load_checkpoint(&m, &info->info, dir, layer, &base);
    Py_END_ALLOW_THREADS if (st) {
        Py_DECREF(info);
        return raise_status(st);
    }
    PyObject *mod = wrap_module(m);
    if (!mod) {
        Py_DECREF(info);
        return NULL;
    }
    return Py_BuildValue("(NN)", mod, (PyObject *)info);
}

// ---------------------------------------------------------------------------
// Forward arguments shared by forward, backward, diagnose, forward_cached

typedef struct fwd_call {
    mha_forward_args a;
    mha_tensor q, k, v, kpm, am;
    int64_t wh[2], wr[2];
    int64_t impl;
    PyObject *saved, *rope_start, *trace;
    attn_kw ak;
    PyObject *checkpoint, *rope_positions;  // a CheckpointLayer; int64 (N L)
    int64_t rope_mode;
    // diagnose's options
    mha_diag_options diag;
} fwd_call;

#define FWD_OPTS(c)                                                                       \
    ATTN_KW(&(c)->a.opts, &(c)->ak), {"need_weights", 'b', &(c)->a.need_weights},         \
        {"average_attn_weights", 'b', &(c)->a.average_attn_weights},                      \
        {"weights_head_begin", 'L', &(c)->wh[0]}, {"weights_head_end", 'L', &(c)->wh[1]}, \
        {"weights_row_begin", 'L', &(c)->wr[0]}, {"weights_row_end", 'L', &(c)->wr[1]},   \
        {"impl", 'L', &(c)->impl}, {"training", 'b', &(c)->a.training},                   \
        {"saved", 'O', &(c)->saved}, {"rope_mode", 'L', &(c)->rope_mode},                 \
        {"rope_theta", 'd', &(c)->a.rope.theta}, {"rope_dim", 'L', &(c)->a.rope.dim},     \
        {"rope_start", 'O', &(c)->rope_start}, {"checkpoint", 'O', &(c)->checkpoint},     \
        {"rope_positions", 'O', &(c)->rope_positions}, {                                  \
        "trace", 'O', &(c)->trace                                                         \
    }

static void fwd_call_init(fwd_call *c) {
    memset(c, 0, sizeof *c);
    mha_forward_args_init(&c->a);
    c->wh[0] = c->wr[0] = 0;
    c->wh[1] = c->wr[1] = -1;
    c->saved = c->rope_start = c->trace = Py_None;
    attn_kw_init(&c->ak);
    c->checkpoint = c->rope_positions = Py_None;
    mha_diag_options_init(&c->diag);
}

// The batch size of a forward's query (for rope_start's length).
static int64_t query_batch(const mha_module *m, const mha_tensor *q) {
    if (q->ndim != 3) return 1;
    return mha_module_config(m)->batch_first ? q->shape[0] : q->shape[1];
}

// Views of the inputs and the option objects into c->a.
static int fwd_views(held *h, fwd_call *c, ModuleObject *mod, PyObject *q, PyObject *k,
                     PyObject *v, PyObject *kpm, PyObject *am) {
    if (get_view(h, q, "query", K_FLOAT, false, &c->q) < 0) return -1;
    c->a.query = &c->q;
    if (k) {
        if (get_view(h, k, "key", K_FLOAT, false, &c->k) < 0) return -1;
        if (get_view(h, v, "value", K_FLOAT, false, &c->v) < 0) return -1;
        c->a.key = &c->k;
        c->a.value = &c->v;
    }
    if (get_opt_view(h, kpm, "key_padding_mask", K_MASK, &c->kpm, &c->a.key_padding_mask) < 0 ||
        get_opt_view(h, am, "attn_mask", K_MASK, &c->am, &c->a.attn_mask) < 0)
        return -1;
    const mha_config *cfg = mha_module_config(mod->m);
    const void *p;
    if (get_vector(h, c->rope_start, "rope_start", MHA_I64, query_batch(mod->m, &c->q), &p) < 0)
        return -1;
    c->a.rope_start = p;
    if (attn_kw_apply(h, &c->ak, &c->a.opts, cfg->num_heads, "forward") < 0) return -1;
    c->a.rope.mode = (mha_rope_mode)c->rope_mode;
    c->a.impl = (mha_impl)c->impl;
    c->a.weights_head_begin = c->wh[0];
    c->a.weights_head_end = c->wh[1];
    c->a.weights_row_begin = c->wr[0];
    c->a.weights_row_end = c->wr[1];
    if (c->saved != Py_None) {
        if (!PyObject_TypeCheck(c->saved, &SavedType)) {
            PyErr_SetString(PyExc_TypeError, "saved: expected an mha._mha.Saved");
            return -1;
        }
        c->a.save = ((SavedObject *)c->saved)->s;
    }
    // the token positions (N * L of them, L the query's length)
    const int64_t N = query_batch(mod->m, &c->q),
                  Lq = c->q.ndim == 3 ? c->q.shape[cfg->batch_first ? 1 : 0] : c->q.shape[0];
    if (get_vector(h, c->rope_positions, "rope_positions", MHA_I64, N * Lq, &p) < 0) return -1;
    c->a.rope_positions = p;
    // a checkpoint layer's options (after the others: they are the layer's)
    if (c->checkpoint != Py_None) {
        if (!PyObject_TypeCheck(c->checkpoint, &CheckpointLayerType)) {
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
static PyObject *finish(held *h, bool ok, mha_status st, PyObject **res, int n) {
    release_all(h);
    if (ok && st) raise_status(st);
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
        mha_shape s = shape_of(ins[i]);
        if (!(res[i] = alloc_view(h, alloc, &s, ins[i]->dtype, names[i], &td[i]))) return -1;
    }
    return 0;
}

static PyObject *py_forward(PyObject *self, PyObject *args, PyObject *kw) {
    ModuleObject *mod;
    PyObject *q, *k, *v, *kpm, *am, *alloc;
    if (!PyArg_ParseTuple(args, "O!OOOOOO", &ModuleType, &mod, &q, &k, &v, &kpm, &am, &alloc))
        return NULL;
    fwd_call c;
    fwd_call_init(&c);
    const kwopt opts[] = {FWD_OPTS(&c)};
    if (parse_opts(kw, opts, (int)(sizeof opts / sizeof *opts), "forward") < 0) return NULL;
    held h = {.n = 0};
    PyObject *res[2] = {NULL, NULL};
    trace_ctx tc = {c.trace, alloc, false};
    if (fwd_views(&h, &c, mod, q, k, v, kpm, am) < 0) return finish(&h, false, MHA_OK, res, 2);
    if (c.trace != Py_None) {
        c.a.trace = trace_trampoline;
        c.a.trace_user = &tc;
    }
    mha_shape os, ws;
    mha_tensor to, tw;
    mha_status st = mha_forward_shapes(&os, &ws, mod->m, &c.a);
    if (st) return finish(&h, true, st, res, 2);
    if (!(res[0] = alloc_view(&h, alloc, &os, c.q.dtype, "attn_output", &to)) ||
        (c.a.need_weights &&
         !(res[1] = alloc_view(&h, alloc, &ws, c.q.dtype, "attn_weights", &tw))))
        return finish(&h, false, MHA_OK, res, 2);
    module_sync(mod);
    mod->readers++;
    Py_BEGIN_ALLOW_THREADS st = mha_forward(&to, res[1] ? &tw : NULL, mod->m, &c.a);
    Py_END_ALLOW_THREADS mod->readers--;
    return finish(&h, !tc.failed, st, res, 2);  // a trace's exception wins
}

// backward(module, grads or None, q, k, v, kpm, am, grad_output, alloc,
//          want_q, want_k, want_v, **forward options) -> (dq, dk, dv)
static PyObject *py_backward(PyObject *self, PyObject *args, PyObject *kw) {
    ModuleObject *mod;
    PyObject *grads, *q, *k, *v, *kpm, *am, *gout, *alloc;
    int want[3];
    if (!PyArg_ParseTuple(args, "O!OOOOOOOOppp", &ModuleType, &mod, &grads, &q, &k, &v, &kpm,
                          &am, &gout, &alloc, &want[0], &want[1], &want[2]))
        return NULL;
    if (grads != Py_None &&
        (!PyObject_TypeCheck(grads, &ModuleType) || grads == (PyObject *)mod)) {
        PyErr_SetString(PyExc_TypeError,
                        "grads: expected None or an mha._mha.Module other than the module");
        return NULL;
    }
    ModuleObject *g = grads == Py_None ? NULL : (ModuleObject *)grads;
    fwd_call c;
    fwd_call_init(&c);
    const kwopt opts[] = {FWD_OPTS(&c)};
    if (parse_opts(kw, opts, (int)(sizeof opts / sizeof *opts), "backward") < 0) return NULL;
    held h = {.n = 0};
    PyObject *res[3] = {NULL, NULL, NULL};
    mha_tensor tg, td[3];
    if (fwd_views(&h, &c, mod, q, k, v, kpm, am) < 0) return finish(&h, false, MHA_OK, res, 3);
    const mha_tensor *ins[3] = {&c.q, c.a.key ? &c.k : &c.q, c.a.value ? &c.v : &c.q};
    if (c.trace != Py_None)
        PyErr_SetString(PyExc_ValueError, "backward: trace is a forward option");
    if (c.trace != Py_None || get_view(&h, gout, "grad_output", K_FLOAT, false, &tg) < 0 ||
        alloc_grads(&h, alloc, ins, want, res, td) < 0 ||
        (g && module_idle(g, "write gradients into it") < 0))
        return finish(&h, false, MHA_OK, res, 3);
    mha_status st;
    module_sync(mod);  // (g: mha_backward marks its packed weights stale itself)
    mod->readers++;
    if (g) g->readers++;
    Py_BEGIN_ALLOW_THREADS st = mha_backward(want[0] ? &td[0] : NULL, want[1] ? &td[1] : NULL,
                                             want[2] ? &td[2] : NULL, g ? g->m : NULL, mod->m,
                                             &c.a, &tg, false);
    Py_END_ALLOW_THREADS mod->readers--;
    if (g) g->readers--;
    return finish(&h, true, st, res, 3);
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
    attn_kw_init(&c->ak);
    c->impl = 0;
    c->need_weights = false;
    const kwopt opts[] = {ATTN_KW(&c->a.opts, &c->ak),
                          {"impl", 'L', &c->impl},
                          {"need_weights", 'b', &c->need_weights},
                          {"saved", 'O', &c->saved}};
    if (parse_opts(kw, opts, (int)(sizeof opts / sizeof *opts), fn) < 0) return -1;
    if (c->saved != Py_None) {  // a training forward's state (mha_sdpa_args.save)
        if (!PyObject_TypeCheck(c->saved, &SavedType)) {
            PyErr_SetString(PyExc_TypeError, "saved: expected an mha._mha.Saved");
            return -1;
        }
        c->a.save = ((SavedObject *)c->saved)->s;
    }
    c->a.impl = (mha_impl)c->impl;
    if (get_view(h, q, "query", K_FLOAT, false, &c->q) < 0 ||
        get_view(h, k, "key", K_FLOAT, false, &c->k) < 0 ||
        get_view(h, v, "value", K_FLOAT, false, &c->v) < 0 ||
        get_opt_view(h, am, "attn_mask", K_MASK, &c->am, &c->a.attn_mask) < 0 ||
        get_opt_view(h, kpm, "key_padding_mask", K_MASK, &c->kpm, &c->a.key_padding_mask) < 0)
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
    return attn_kw_apply(h, &c->ak, &c->a.opts, c->q.shape[1], fn);
}

// sdpa(q, k, v, attn_mask, key_padding_mask, alloc, **options) -> (out, weights)
static PyObject *py_sdpa(PyObject *self, PyObject *args, PyObject *kw) {
    PyObject *q, *k, *v, *am, *kpm, *alloc;
    if (!PyArg_ParseTuple(args, "OOOOOO", &q, &k, &v, &am, &kpm, &alloc)) return NULL;
    sdpa_call c;
    held h = {.n = 0};
    PyObject *res[2] = {NULL, NULL};
    mha_tensor to, tw;
    if (sdpa_views(&h, &c, q, k, v, am, kpm, kw, "sdpa") < 0)
        return finish(&h, false, MHA_OK, res, 2);
    mha_shape os = shape_of(&c.q), ws = os;
    os.dims[3] = c.v.shape[3];  // (B, H, L, Dv); the library checks the rest
    ws.dims[3] = c.k.shape[2];  // (B, H, L, S)
    if (!(res[0] = alloc_view(&h, alloc, &os, c.q.dtype, "out", &to)) ||
        (c.need_weights && !(res[1] = alloc_view(&h, alloc, &ws, c.q.dtype, "weights", &tw))))
        return finish(&h, false, MHA_OK, res, 2);
    mha_status st;
    Py_BEGIN_ALLOW_THREADS st = mha_sdpa(&to, res[1] ? &tw : NULL, &c.a);
    Py_END_ALLOW_THREADS return finish(&h, true, st, res, 2);
}

// sdpa_backward(q, k, v, attn_mask, key_padding_mask, dout, alloc,
//               **options) -> (dq, dk, dv)
static PyObject *py_sdpa_backward(PyObject *self, PyObject *args, PyObject *kw) {
    PyObject *q, *k, *v, *am, *kpm, *dout, *alloc;
    if (!PyArg_ParseTuple(args, "OOOOOOO", &q, &k, &v, &am, &kpm, &dout, &alloc)) return NULL;
    sdpa_call c;
    held h = {.n = 0};
    PyObject *res[3] = {NULL, NULL, NULL};
    mha_tensor tdo, td[3];
    if (sdpa_views(&h, &c, q, k, v, am, kpm, kw, "sdpa_backward") < 0 ||
        get_view(&h, dout, "grad_out", K_FLOAT, false, &tdo) < 0)
        return finish(&h, false, MHA_OK, res, 3);
    const mha_tensor *ins[3] = {&c.q, &c.k, &c.v};
    if (alloc_grads(&h, alloc, ins, NULL, res, td) < 0)
        return finish(&h, false, MHA_OK, res, 3);
    mha_status st;
    Py_BEGIN_ALLOW_THREADS st = mha_sdpa_backward(&td[0], &td[1], &td[2], &tdo, &c.a);
    Py_END_ALLOW_THREADS return finish(&h, true, st, res, 3);
}

// ---------------------------------------------------------------------------
// KVCache: an mha_kv_cache

typedef struct CacheObject {
    PyObject_HEAD mha_kv_cache *c;
    int64_t batch, num_kv_heads, v_head_dim;
    bool busy;  // a call is running on it with the GIL released
} CacheObject;

static PyTypeObject CacheType;

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
        return raise_status(st);
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
    if (get_view(&h, k, "k", K_FLOAT, false, &tk) < 0 ||
        get_view(&h, v, "v", K_FLOAT, false, &tv) < 0 ||
        get_vector(&h, counts, "counts", MHA_I64, o->batch, &cn) < 0 || cache_claim(o) < 0) {
        release_all(&h);
        return NULL;
    }
    mha_status st;
    Py_BEGIN_ALLOW_THREADS st = mha_kv_cache_append(o->c, &tk, &tv, cn);
    Py_END_ALLOW_THREADS o->busy = false;
    release_all(&h);
    if (st) return raise_status(st);
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
    attn_kw_init(&ak);
    const kwopt opts[] = {ATTN_KW(&a.opts, &ak), {"counts", 'O', &counts}};
    if (parse_opts(kw, opts, (int)(sizeof opts / sizeof *opts), "attend") < 0) return NULL;
    held h = {.n = 0};
    mha_tensor tq, to;
    const void *cn, *sl;
    PyObject *out = NULL;
    if (get_view(&h, q, "q", K_FLOAT, false, &tq) < 0) goto fail;
    if (tq.ndim != 4) {
        PyErr_Format(PyExc_ValueError, "attend: q must be (B, H, T, D), got %d dims", tq.ndim);
        goto fail;
    }
    if (get_vector(&h, counts, "counts", MHA_I64, o->batch, &cn) < 0 ||
        attn_kw_apply(&h, &ak, &a.opts, tq.shape[1], "attend") < 0)
        goto fail;
    mha_shape os = shape_of(&tq);
    os.dims[3] = o->v_head_dim;
    if (!(out = alloc_view(&h, alloc, &os, half_or_f32(tq.dtype), "out", &to))) goto fail;
    if (cache_claim(o) < 0) goto fail;
    mha_status st;
    Py_BEGIN_ALLOW_THREADS st = mha_kv_cache_attend(&to, &tq, o->c, &a, cn);
    Py_END_ALLOW_THREADS o->busy = false;
    return finish(&h, true, st, &out, 1);
fail:
    return finish(&h, false, MHA_OK, &out, 1);
}

static PyObject *Cache_truncate(CacheObject *o, PyObject *args) {
    long long b, len;
    if (!PyArg_ParseTuple(args, "LL", &b, &len)) return NULL;
    if (cache_claim(o) < 0) return NULL;
    mha_status st = mha_kv_cache_truncate(o->c, b, len);
    o->busy = false;
    if (st) return raise_status(st);
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
static PyObject *py_forward_cached(PyObject *self, PyObject *args, PyObject *kw) {
    ModuleObject *mod;
    CacheObject *cache;
    PyObject *q, *alloc;
    if (!PyArg_ParseTuple(args, "O!OO!O", &ModuleType, &mod, &q, &CacheType, &cache, &alloc))
        return NULL;
    fwd_call c;
    fwd_call_init(&c);
    const kwopt opts[] = {FWD_OPTS(&c)};
    if (parse_opts(kw, opts, (int)(sizeof opts / sizeof *opts), "forward_cached") < 0)
        return NULL;
    held h = {.n = 0};
    PyObject *out = NULL;
    mha_tensor to;
    if (fwd_views(&h, &c, mod, q, NULL, NULL, Py_None, Py_None) < 0) goto fail;
    mha_shape os = shape_of(&c.q);
    if (!(out = alloc_view(&h, alloc, &os, MHA_F32, "out", &to))) goto fail;
    if (cache_claim(cache) < 0) goto fail;
    mha_status st;
    module_sync(mod);
    mod->readers++;
    Py_BEGIN_ALLOW_THREADS st = mha_forward_cached(&to, mod->m, &c.a, cache->c);
    Py_END_ALLOW_THREADS mod->readers--;
    cache->busy = false;
    return finish(&h, true, st, &out, 1);
fail:
    return finish(&h, false, MHA_OK, &out, 1);
}

// ---------------------------------------------------------------------------
// PagedKVCache: an mha_paged_cache (the library refuses concurrent changes
// itself: no busy flag)

typedef struct PagedObject {
    PyObject_HEAD mha_paged_cache *c;
} PagedObject;

static PyTypeObject PagedType;

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
        return raise_status(st);
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
    if (st) return raise_status(st);
    return PyLong_FromLongLong(id);
}

static PyObject *Paged_fork(PagedObject *o, PyObject *args) {
    long long src;
    if (!PyArg_ParseTuple(args, "L", &src)) return NULL;
    int64_t id;
    mha_status st = mha_paged_cache_fork(o->c, src, &id);
    if (st) return raise_status(st);
    return PyLong_FromLongLong(id);
}

static PyObject *Paged_free(PagedObject *o, PyObject *args) {
    long long id;
    if (!PyArg_ParseTuple(args, "L", &id)) return NULL;
    mha_status st = mha_paged_cache_free(o->c, id);
    if (st) return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *Paged_truncate(PagedObject *o, PyObject *args) {
    long long id, len;
    if (!PyArg_ParseTuple(args, "LL", &id, &len)) return NULL;
    mha_status st = mha_paged_cache_truncate(o->c, id, len);
    if (st) return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *Paged_release(PagedObject *o, PyObject *args) {
    long long id, keep, pos;
    if (!PyArg_ParseTuple(args, "LLL", &id, &keep, &pos)) return NULL;
    mha_status st = mha_paged_cache_release(o->c, id, keep, pos);
    if (st) return raise_status(st);
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
    if (dtype_of_format(b.format, b.itemsize) != MHA_I32) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_TypeError, "add_prompt: tokens must be a contiguous int32 array");
        return NULL;
    }
    int64_t id, cached;
    mha_status st = mha_paged_cache_add_prompt(o->c, b.buf, (int64_t)(b.len / 4), &id, &cached);
    PyBuffer_Release(&b);
    if (st) return raise_status(st);
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
static PyObject *py_forward_paged(PyObject *self, PyObject *args, PyObject *kw) {
    ModuleObject *mod;
    PagedObject *cache;
    PyObject *q, *ids, *counts, *tokens, *alloc;
    if (!PyArg_ParseTuple(args, "O!OO!OOOO", &ModuleType, &mod, &q, &PagedType, &cache, &ids,
                          &counts, &tokens, &alloc))
        return NULL;
    fwd_call c;
    fwd_call_init(&c);
    const kwopt opts[] = {FWD_OPTS(&c)};
    if (parse_opts(kw, opts, (int)(sizeof opts / sizeof *opts), "forward_paged") < 0)
        return NULL;
    held h = {.n = 0};
    PyObject *out = NULL;
    mha_tensor to;
    const void *iv, *cv, *tv;
    if (fwd_views(&h, &c, mod, q, NULL, NULL, Py_None, Py_None) < 0) goto fail;
    const bool bf = mha_module_config(mod->m)->batch_first;
    const int64_t N = c.q.ndim == 3 ? c.q.shape[bf ? 0 : 1] : 1;
    const int64_t T = c.q.ndim == 3 ? c.q.shape[bf ? 1 : 0] : c.q.shape[0];
    if (get_vector(&h, ids, "ids", MHA_I64, N, &iv) < 0 ||
        get_vector(&h, counts, "counts", MHA_I64, N, &cv) < 0 ||
        get_vector(&h, tokens, "tokens", MHA_I32, N * T, &tv) < 0)
        goto fail;
    mha_shape os = shape_of(&c.q);
    if (!(out = alloc_view(&h, alloc, &os, MHA_F32, "out", &to))) goto fail;
    mha_status st;
    module_sync(mod);
    mod->readers++;
    Py_BEGIN_ALLOW_THREADS st = mha_forward_paged(&to, mod->m, &c.a, cache->c, iv, cv, tv);
    Py_END_ALLOW_THREADS mod->readers--;
    return finish(&h, true, st, &out, 1);
fail:
    return finish(&h, false, MHA_OK, &out, 1);
}

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
    if (!PyArg_ParseTuple(args, "O!OOOOO", &ModuleType, &mod, &q, &k, &v, &kpm, &am))
        return NULL;
    fwd_call c;
    fwd_call_init(&c);
    const kwopt opts[] = {FWD_OPTS(&c),
                          {"max_rows", 'L', &c.diag.max_rows},
                          {"dead_entropy", 'd', &c.diag.dead_entropy},
                          {"dead_output", 'd', &c.diag.dead_output},
                          {"rank_rtol", 'd', &c.diag.rank_rtol}};
    if (parse_opts(kw, opts, (int)(sizeof opts / sizeof *opts), "diagnose") < 0) return NULL;
    held h = {.n = 0};
    if (fwd_views(&h, &c, mod, q, k, v, kpm, am) < 0) {
        release_all(&h);
        return NULL;
    }
    mha_diag *d = NULL;
    mha_status st;
    mod->readers++;
    Py_BEGIN_ALLOW_THREADS st = mha_diag_create(&d, mod->m, &c.a, &c.diag);
    Py_END_ALLOW_THREADS mod->readers--;
    release_all(&h);
    if (st) return raise_status(st);
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
        return raise_status(st);
    }
    for (Py_ssize_t i = 0; !st && i < PySequence_Fast_GET_SIZE(fast); i++) {
        const char *name;
        PyObject *arr;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "sO", &name, &arr)) break;
        Py_buffer b;
        if (PyObject_GetBuffer(arr, &b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) break;
        int dt = dtype_of_format(b.format, b.itemsize);
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
    if (st) return raise_status(st);
    Py_RETURN_NONE;
}

static PyObject *py_load_tensors(PyObject *self, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
    mha_st_file *f;
    mha_status st;
    Py_BEGIN_ALLOW_THREADS st = mha_st_open(&f, path);
    Py_END_ALLOW_THREADS if (st) return raise_status(st);
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
        return raise_status(st);
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
    {"forward", (PyCFunction)(void (*)(void))py_forward, METH_VARARGS | METH_KEYWORDS,
     "forward(module, q, k, v, kpm, am, alloc, **options) -> (out, weights)"},
    {"backward", (PyCFunction)(void (*)(void))py_backward, METH_VARARGS | METH_KEYWORDS,
     "backward(module, grads, q, k, v, kpm, am, grad_output, alloc, wq, wk, wv, **options)"},
    {"sdpa", (PyCFunction)(void (*)(void))py_sdpa, METH_VARARGS | METH_KEYWORDS,
     "sdpa(q, k, v, attn_mask, key_padding_mask, alloc, **options) -> (out, weights)"},
    {"sdpa_backward", (PyCFunction)(void (*)(void))py_sdpa_backward,
     METH_VARARGS | METH_KEYWORDS,
     "sdpa_backward(q, k, v, attn_mask, key_padding_mask, dout, alloc, **options)"},
    {"forward_cached", (PyCFunction)(void (*)(void))py_forward_cached,
     METH_VARARGS | METH_KEYWORDS, "forward_cached(module, q, cache, alloc, **options)"},
    {"forward_paged", (PyCFunction)(void (*)(void))py_forward_paged,
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
    {"load_checkpoint", (PyCFunction)(void (*)(void))py_load_checkpoint,
     METH_VARARGS | METH_KEYWORDS,
     "load_checkpoint(dir, layer, weight_dtype) -> (Module, CheckpointLayer)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_mha",
                                       "libmha's C API for Python (see mha)", -1, functions};

PyMODINIT_FUNC PyInit__mha(void) {
    ModuleType = (PyTypeObject){PyVarObject_HEAD_INIT(NULL, 0).tp_name = "mha._mha.Module",
                                .tp_basicsize = sizeof(ModuleObject),
                                .tp_dealloc = (destructor)Module_dealloc,
                                .tp_flags = Py_TPFLAGS_DEFAULT,
                                .tp_doc = "an mha_module",
                                .tp_methods = Module_methods,
                                .tp_new = Module_new};
    ParamType = (PyTypeObject){PyVarObject_HEAD_INIT(NULL, 0).tp_name = "mha._mha.Param",
                               .tp_basicsize = sizeof(ParamObject),
                               .tp_dealloc = (destructor)Param_dealloc,
                               .tp_flags = Py_TPFLAGS_DEFAULT,
                               .tp_doc = "a parameter's storage (buffer protocol)",
                               .tp_as_buffer = &Param_as_buffer};
    SavedType = (PyTypeObject){PyVarObject_HEAD_INIT(NULL, 0).tp_name = "mha._mha.Saved",
                               .tp_basicsize = sizeof(SavedObject),
                               .tp_dealloc = (destructor)Saved_dealloc,
                               .tp_flags = Py_TPFLAGS_DEFAULT,
                               .tp_doc = "a training forward's saved state",
                               .tp_getset = Saved_getset,
                               .tp_new = Saved_new};
    CacheType = (PyTypeObject){PyVarObject_HEAD_INIT(NULL, 0).tp_name = "mha._mha.KVCache",
                               .tp_basicsize = sizeof(CacheObject),
                               .tp_dealloc = (destructor)Cache_dealloc,
                               .tp_flags = Py_TPFLAGS_DEFAULT,
                               .tp_doc = "an mha_kv_cache",
                               .tp_methods = Cache_methods,
                               .tp_getset = Cache_getset,
                               .tp_new = Cache_new};
    PagedType = (PyTypeObject){PyVarObject_HEAD_INIT(NULL, 0).tp_name = "mha._mha.PagedKVCache",
                               .tp_basicsize = sizeof(PagedObject),
                               .tp_dealloc = (destructor)Paged_dealloc,
                               .tp_flags = Py_TPFLAGS_DEFAULT,
                               .tp_doc = "an mha_paged_cache",
                               .tp_methods = Paged_methods,
                               .tp_getset = Paged_getset,
                               .tp_new = Paged_new};
    CheckpointLayerType = (PyTypeObject){
        PyVarObject_HEAD_INIT(NULL, 0).tp_name = "mha._mha.CheckpointLayer",
        .tp_basicsize = sizeof(CheckpointLayerObject),
        .tp_dealloc = (destructor)CheckpointLayer_dealloc,
        .tp_flags = Py_TPFLAGS_DEFAULT,
        .tp_doc = "a checkpoint layer's options (mha_checkpoint_layer)",
        .tp_methods = CheckpointLayer_methods};
    if (PyType_Ready(&ModuleType) < 0 || PyType_Ready(&ParamType) < 0 ||
        PyType_Ready(&SavedType) < 0 || PyType_Ready(&CacheType) < 0 ||
        PyType_Ready(&CheckpointLayerType) < 0 || PyType_Ready(&PagedType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    PyTypeObject *types[] = {&ModuleType, &ParamType,           &SavedType,
                             &CacheType,  &CheckpointLayerType, &PagedType};
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
