// _mha.h: what the C files of the extension mha._mha share (private to
// python/src; see _mha.c for the binding's rules): the buffers one call
// holds, the keyword tables, the objects' structs and types, and the
// helpers each file offers the files above it. The files, bottom up:
// py_args.c (errors, buffers as views, keyword options), py_module.c
// (Module, Param, Saved, CheckpointLayer, load_checkpoint), py_calls.c
// (forward, backward, sdpa, sdpa_backward and their shared arguments),
// py_caches.c (KVCache, PagedKVCache, forward_cached, forward_paged),
// _mha.c (diagnose, save/load_tensors, the module's functions and init).
// Nothing here is exported from the extension: hidden visibility.
#ifndef MHA_PY_MHA_H
#define MHA_PY_MHA_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "mha.h"

#if defined(__GNUC__)
#pragma GCC visibility push(hidden)
#endif

// ---------------------------------------------------------------------------
// Buffers held for the length of one call (py_args.c)

#define MAX_HELD 24

typedef struct held {
    Py_buffer b[MAX_HELD];
    int n;
} held;

// What an argument may hold.
enum kind {
    K_FLOAT,  // F32, F64, F16, BF16 (inputs and outputs)
    K_MASK,   // BOOL, U8, F32, F64
};

// ---------------------------------------------------------------------------
// Keyword options: a table of name -> typed destination (py_args.c)

typedef struct kwopt {
    const char *name;
    char type;  // 'b' bool, 'L' int64, 'K' uint64, 'd' double, 'f' float, 'O' object
    void *dst;
} kwopt;

// The attention options' keywords (mha_attn_opts), the same in every call
// that attends: the fields themselves, and the objects read after parsing
// (mha_py_attn_kw_apply): scale (None: 1 / sqrt(D)), alibi_slopes and sinks
// (float32 vectors of H). (window=W or (left, right): the Python layer's
// window_bounds turns it into window_left / window_right.)
typedef struct attn_kw {
    PyObject *scale, *alibi_slopes, *sinks;
} attn_kw;
#define ATTN_KW(o, k)                                                                 \
    {"is_causal", 'b', &(o)->is_causal}, {"window_left", 'L', &(o)->window_left},     \
        {"window_right", 'L', &(o)->window_right}, {"scale", 'O', &(k)->scale},       \
        {"softcap", 'f', &(o)->softcap}, {"alibi", 'b', &(o)->alibi},                 \
        {"alibi_slopes", 'O', &(k)->alibi_slopes}, {"sinks", 'O', &(k)->sinks},       \
        {"sink_tokens", 'L', &(o)->sink_tokens}, {"dropout_p", 'f', &(o)->dropout_p}, \
        {"dropout_seed", 'K', &(o)->dropout_seed}, {                                  \
        "dropout_offset", 'K', &(o)->dropout_offset                                   \
    }


// ---------------------------------------------------------------------------
// The objects (py_module.c)

typedef struct ModuleObject {
    PyObject_HEAD mha_module *m;
    Py_ssize_t readers;  // calls reading it with the GIL released
    Py_ssize_t views;    // live writable buffers of its parameters (Param)
    bool exposed;        // one lived since the last call that read it
} ModuleObject;

typedef struct SavedObject {
    PyObject_HEAD mha_saved *s;
} SavedObject;

typedef struct CheckpointLayerObject {
    PyObject_HEAD mha_checkpoint_layer info;
} CheckpointLayerObject;

// ---------------------------------------------------------------------------
// Forward arguments shared by forward, backward, diagnose, forward_cached,
// forward_paged (py_calls.c)

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

// The types (each defined in its file; readied and added by _mha.c)
extern PyTypeObject mha_py_module_type, mha_py_param_type, mha_py_saved_type,
    mha_py_checkpoint_layer_type;                          // py_module.c
extern PyTypeObject mha_py_cache_type, mha_py_paged_type;  // py_caches.c

// py_args.c
// A library status as an exception carrying mha_last_error(); returns NULL.
PyObject *mha_py_raise_status(mha_status st);
void mha_py_release_all(held *h);
// The mha dtype of a buffer format ("f", "<d", "=e", ...); -1 if none.
int mha_py_dtype_of_format(const char *fmt, Py_ssize_t itemsize);
// Acquires obj's buffer (writable when `writable`) into h and describes it
// as t. obj: a buffer exporter, or (exporter, mha dtype). Returns 0, or -1
// with an exception set (TypeError for dtypes, ValueError for layouts).
int mha_py_get_view(held *h, PyObject *obj, const char *name, enum kind k, bool writable,
                    mha_tensor *t);
// As mha_py_get_view for an optional input: None gives *out = NULL.
int mha_py_get_opt_view(held *h, PyObject *obj, const char *name, enum kind k, mha_tensor *t,
                        const mha_tensor **out);
// A contiguous vector of n elements of dtype dt (int64 or float32) from
// obj (None: *out = NULL). Its length must be n.
int mha_py_get_vector(held *h, PyObject *obj, const char *name, mha_dtype dt, int64_t n,
                      const void **out);
// An output of the given shape and dtype from alloc(shape, dtype), viewed
// as t (its buffer held in h). Returns the new reference, or NULL.
PyObject *mha_py_alloc_view(held *h, PyObject *alloc, const mha_shape *s, mha_dtype dt,
                            const char *name, mha_tensor *t);
mha_shape mha_py_shape_of(const mha_tensor *t);
// Reads the keyword dict kw (may be NULL) into the table; an unknown
// keyword or a value of the wrong type is a TypeError naming it.
int mha_py_parse_opts(PyObject *kw, const kwopt *opts, int n, const char *fn);
void mha_py_attn_kw_init(attn_kw *k);
// Reads k's objects into o; H: the query heads (the vectors' length).
int mha_py_attn_kw_apply(held *h, const attn_kw *k, mha_attn_opts *o, int64_t H);

// py_module.c
// Before a call that reads the module (GIL held): its parameters may have
// been written through a Param buffer (numpy arrays, torch tensors on its
// storage: torch's optimizers write there) since the last such call, so
// its packed weights are marked stale (mha_module_params_changed; safe
// while other threads' calls read it). Without a buffer alive or died
// since, nothing could have written it and the packed copy is kept.
void mha_py_module_sync(ModuleObject *o);
int mha_py_module_idle(ModuleObject *o, const char *what);
// load_checkpoint(dir, layer, weight_dtype="F32") -> (Module, CheckpointLayer)
PyObject *mha_py_load_checkpoint(PyObject *self, PyObject *args, PyObject *kw);

// py_calls.c
void mha_py_fwd_call_init(fwd_call *c);
// Views of the inputs and the option objects into c->a.
int mha_py_fwd_views(held *h, fwd_call *c, ModuleObject *mod, PyObject *q, PyObject *k,
                     PyObject *v, PyObject *kpm, PyObject *am);
// The end of a call that made the outputs res[0..n) (NULL: not wanted):
// releases the held buffers; when ok and st is MHA_OK returns res[0] (n
// 1) or a tuple of them (None for the NULL ones); otherwise (an exception
// set, or the library's error, raised here) drops them and returns NULL.
PyObject *mha_py_finish(held *h, bool ok, mha_status st, PyObject **res, int n);
PyObject *mha_py_forward(PyObject *self, PyObject *args, PyObject *kw);
// backward(module, grads or None, q, k, v, kpm, am, grad_output, alloc,
//          want_q, want_k, want_v, **forward options) -> (dq, dk, dv)
PyObject *mha_py_backward(PyObject *self, PyObject *args, PyObject *kw);
// sdpa(q, k, v, attn_mask, key_padding_mask, alloc, **options) -> (out, weights)
PyObject *mha_py_sdpa(PyObject *self, PyObject *args, PyObject *kw);
// sdpa_backward(q, k, v, attn_mask, key_padding_mask, dout, alloc,
//               **options) -> (dq, dk, dv, dsinks or None)
PyObject *mha_py_sdpa_backward(PyObject *self, PyObject *args, PyObject *kw);

// py_caches.c
// forward_cached(module, query, cache, alloc, **options) -> out
PyObject *mha_py_forward_cached(PyObject *self, PyObject *args, PyObject *kw);
// forward_paged(module, query, cache, ids, counts, tokens, alloc, **options)
// -> out (tokens: int32 (N, T) ids, or None)
PyObject *mha_py_forward_paged(PyObject *self, PyObject *args, PyObject *kw);

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif

#endif
