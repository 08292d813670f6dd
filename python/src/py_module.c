// py_module.c: the extension's objects that own library state: Module (an
// mha_module: new, load, save, init, params, param, config, like, convert,
// prune_heads), Param (a parameter's storage as a writable buffer), Saved
// (an mha_saved), CheckpointLayer and load_checkpoint (a Hugging Face
// checkpoint's layer). The calls that use them are py_calls.c's.
#include "_mha.h"

// ---------------------------------------------------------------------------
// Module: an mha_module


static PyObject *wrap_module(mha_module *m) {
    ModuleObject *o = PyObject_New(ModuleObject, &mha_py_module_type);
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
void mha_py_module_sync(ModuleObject *o) {
    if (o->views > 0 || o->exposed) mha_module_params_changed(o->m);
    o->exposed = false;
}

int mha_py_module_idle(ModuleObject *o, const char *what) {
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
    if (st) return mha_py_raise_status(st);
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
    Py_END_ALLOW_THREADS if (st) return mha_py_raise_status(st);
    (void)cls;
    return wrap_module(m);
}

static PyObject *Module_save(ModuleObject *o, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
    mha_status st;
    Py_BEGIN_ALLOW_THREADS st = mha_module_save(o->m, path);
    Py_END_ALLOW_THREADS if (st) return mha_py_raise_status(st);
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
    if (mha_py_module_idle(o, "initialise it") < 0) return NULL;
    mha_status st = mha_init_scheme_from_name(&opt.scheme, scheme);
    if (!st) st = mha_module_init(o->m, &opt);
    if (st) return mha_py_raise_status(st);
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
            return mha_py_raise_status(st);
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
    if (st) return mha_py_raise_status(st);
    ParamObject *b = PyObject_New(ParamObject, &mha_py_param_type);
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
    if (st) return mha_py_raise_status(st);
    return wrap_module(m);
}

static PyObject *Module_convert(ModuleObject *o, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    mha_dtype dt;
    if (parse_dtype_name(name, &dt) < 0) return NULL;
    mha_module *m;
    mha_status st = mha_module_convert(&m, o->m, dt);
    if (st) return mha_py_raise_status(st);
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
    if (mha_py_module_idle(o, "prune heads") < 0) {
        PyMem_Free(heads);
        return NULL;
    }
    mha_status st = mha_module_prune_heads(o->m, heads, (int64_t)n);
    PyMem_Free(heads);
    if (st) return mha_py_raise_status(st);
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


static PyObject *Saved_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    if (!PyArg_ParseTuple(args, "")) return NULL;
    SavedObject *o = PyObject_New(SavedObject, type);
    if (!o) return NULL;
    mha_status st = mha_saved_create(&o->s);
    if (st) {
        o->s = NULL;
        Py_DECREF(o);
        return mha_py_raise_status(st);
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

PyTypeObject mha_py_module_type = {PyVarObject_HEAD_INIT(NULL, 0).tp_name = "mha._mha.Module",
                                   .tp_basicsize = sizeof(ModuleObject),
                                   .tp_dealloc = (destructor)Module_dealloc,
                                   .tp_flags = Py_TPFLAGS_DEFAULT,
                                   .tp_doc = "an mha_module",
                                   .tp_methods = Module_methods,
                                   .tp_new = Module_new};

PyTypeObject mha_py_param_type = {PyVarObject_HEAD_INIT(NULL, 0).tp_name = "mha._mha.Param",
                                  .tp_basicsize = sizeof(ParamObject),
                                  .tp_dealloc = (destructor)Param_dealloc,
                                  .tp_flags = Py_TPFLAGS_DEFAULT,
                                  .tp_doc = "a parameter's storage (buffer protocol)",
                                  .tp_as_buffer = &Param_as_buffer};

PyTypeObject mha_py_saved_type = {PyVarObject_HEAD_INIT(NULL, 0).tp_name = "mha._mha.Saved",
                                  .tp_basicsize = sizeof(SavedObject),
                                  .tp_dealloc = (destructor)Saved_dealloc,
                                  .tp_flags = Py_TPFLAGS_DEFAULT,
                                  .tp_doc = "a training forward's saved state",
                                  .tp_getset = Saved_getset,
                                  .tp_new = Saved_new};
// ---------------------------------------------------------------------------
// CheckpointLayer: what a Hugging Face checkpoint's layer does beyond its
// parameters (mha_checkpoint_layer), for the forward options "checkpoint"


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
        "{s:s,s:L,s:O,s:L,s:i,s:d,s:L,s:{s:s,s:d,s:L,s:d,s:d,s:d,s:d,s:d,s:d,s:d,s:O},s:d,s:d}",
        "model_type", i->model_type, "layer", (long long)i->layer, "is_causal",
        i->opts.is_causal ? Py_True : Py_False, "window_left", (long long)i->opts.window_left,
        "rope_mode", (int)i->rope.mode, "rope_theta", i->rope.theta, "rope_dim",
        (long long)i->rope.dim, "rope_scaling", "type", scaling_name(s->type), "factor",
        s->factor, "original_max_position", (long long)s->original_max_position,
        "low_freq_factor", s->low_freq_factor, "high_freq_factor", s->high_freq_factor,
        "beta_fast", s->beta_fast, "beta_slow", s->beta_slow, "mscale", s->mscale,
        "mscale_all_dim", s->mscale_all_dim, "attention_factor", s->attention_factor,
        "truncate", s->truncate ? Py_True : Py_False, "softcap", (double)i->opts.softcap,
        "scale", i->opts.scale);
}

static PyMethodDef CheckpointLayer_methods[] = {
    {"info", (PyCFunction)CheckpointLayer_info, METH_NOARGS, "the layer's options (a dict)"},
    {NULL, NULL, 0, NULL}};

// load_checkpoint(dir, layer, weight_dtype="F32") -> (Module, CheckpointLayer)
PyObject *mha_py_load_checkpoint(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kws[] = {"dir", "layer", "weight_dtype", NULL};
    const char *dir, *wdt = "F32";
    long long layer = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s|Ls", kws, &dir, &layer, &wdt)) return NULL;
    mha_config base;
    mha_config_init(&base, 0, 0);
    base.batch_first = true;  // transformers' (N, L, E)
    if (parse_dtype_name(wdt, &base.weight_dtype) < 0) return NULL;
    CheckpointLayerObject *info = PyObject_New(CheckpointLayerObject,
                                               &mha_py_checkpoint_layer_type);
    if (!info) return NULL;
    mha_module *m = NULL;
    mha_status st;
    Py_BEGIN_ALLOW_THREADS st = mha_module_load_checkpoint(&m, &info->info, dir, layer, &base);
    Py_END_ALLOW_THREADS if (st) {
        Py_DECREF(info);
        return mha_py_raise_status(st);
    }
    PyObject *mod = wrap_module(m);
    if (!mod) {
        Py_DECREF(info);
        return NULL;
    }
    return Py_BuildValue("(NN)", mod, (PyObject *)info);
}

PyTypeObject mha_py_checkpoint_layer_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "mha._mha.CheckpointLayer",
    .tp_basicsize = sizeof(CheckpointLayerObject),
    .tp_dealloc = (destructor)CheckpointLayer_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "a checkpoint layer's options (mha_checkpoint_layer)",
    .tp_methods = CheckpointLayer_methods};
