// py_args.c: the extension's ground floor (_mha.h): library errors as
// exceptions, arrays as mha_tensor views of their buffers (held for the
// call), vectors, outputs from the caller's alloc, and the keyword options
// (the table parser and the attention options every attending call takes).
#include "_mha.h"

// ---------------------------------------------------------------------------
// Errors

PyObject *mha_py_raise_status(mha_status st) {
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


void mha_py_release_all(held *h) {
    for (int i = 0; i < h->n; i++) PyBuffer_Release(&h->b[i]);
    h->n = 0;
}


// The mha dtype of a buffer format ("f", "<d", "=e", ...); -1 if none.
int mha_py_dtype_of_format(const char *fmt, Py_ssize_t itemsize) {
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
int mha_py_get_view(held *h, PyObject *obj, const char *name, enum kind k, bool writable,
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
    int dt = mha_py_dtype_of_format(b->format, b->itemsize);
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

// As mha_py_get_view for an optional input: None gives *out = NULL.
int mha_py_get_opt_view(held *h, PyObject *obj, const char *name, enum kind k, mha_tensor *t,
                        const mha_tensor **out) {
    *out = NULL;
    if (obj == Py_None) return 0;
    if (mha_py_get_view(h, obj, name, k, false, t) < 0) return -1;
    *out = t;
    return 0;
}

// A contiguous vector of n elements of dtype dt (int64 or float32) from
// obj (None: *out = NULL). Its length must be n.
int mha_py_get_vector(held *h, PyObject *obj, const char *name, mha_dtype dt, int64_t n,
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
    if (mha_py_dtype_of_format(b->format, b->itemsize) != (int)dt) {
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
PyObject *mha_py_alloc_view(held *h, PyObject *alloc, const mha_shape *s, mha_dtype dt,
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
    int rc = mha_py_get_view(h, arg, name, K_FLOAT, true, t);
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

mha_shape mha_py_shape_of(const mha_tensor *t) {
    mha_shape s;
    s.ndim = t->ndim;
    for (int i = 0; i < t->ndim; i++) s.dims[i] = t->shape[i];
    return s;
}

// ---------------------------------------------------------------------------
// Keyword options: a table of name -> typed destination


// Reads the keyword dict kw (may be NULL) into the table; an unknown
// keyword or a value of the wrong type is a TypeError naming it.
int mha_py_parse_opts(PyObject *kw, const kwopt *opts, int n, const char *fn) {
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


void mha_py_attn_kw_init(attn_kw *k) { k->scale = k->alibi_slopes = k->sinks = Py_None; }

// Reads k's objects into o; H: the query heads (the vectors' length).
int mha_py_attn_kw_apply(held *h, const attn_kw *k, mha_attn_opts *o, int64_t H) {
    if (custom_scale(k->scale, &o->scale) < 0) return -1;
    const void *p;
    if (mha_py_get_vector(h, k->alibi_slopes, "alibi_slopes", MHA_F32, H, &p) < 0) return -1;
    o->alibi_slopes = p;
    if (mha_py_get_vector(h, k->sinks, "sinks", MHA_F32, H, &p) < 0) return -1;
    o->sinks = p;
    return 0;
}
