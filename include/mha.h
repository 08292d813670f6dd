// mha.h: the one public header of libmha, multi-head attention in C11.
//
// What it is: PyTorch's nn.MultiheadAttention (same parameter names,
// layouts, masks and outputs), a scaled-dot-product entry point on already
// projected tensors, and a strict reader/writer of safetensors files.
//
// Conventions (read once, they hold everywhere):
//  - Every call that can fail returns mha_status: MHA_OK (0) or a negative
//    error. On error, mha_last_error() returns a one-line message on the
//    calling thread that names the problem and the values involved. Library
//    functions never exit, abort or print; an optional log callback
//    (mha_set_log_callback) receives the same messages.
//  - The caller owns every tensor it passes in. The library never frees what
//    it did not allocate, and never writes to inputs. Objects the library
//    owns are opaque handles: *_create / *_destroy; destroy accepts NULL.
//  - Arguments go outputs first, then inputs, then sizes.
//  - Dimensions and strides are int64_t, byte counts size_t. Strides are in
//    elements, not bytes. A stride of 0 broadcasts along that dimension
//    (only allowed where a declaration says so: masks).
//  - Shapes use PyTorch's letters: L target (query) length, S source (key)
//    length, N batch, E embed_dim, H num_heads, d = E / H head dim.
//  - Threads: any functions may run at once on different output objects; a
//    module and the inputs may be shared read-only by concurrent forwards
//    and backwards. Changing a module (init, pruning, an optimizer step,
//    writing parameters) must not overlap a call that reads it. Results are
//    bit-identical whatever the number of OpenMP threads. (A module's packed
//    weights, see mha_module_params_changed, are filled inside such calls
//    without a lock: the promise holds.)
//  - Versions: semantic versioning (MHA_VERSION_*, mha_version()). While
//    the major version is 0, a minor release may change the ABI: structs
//    only grow at their end (source compatible), but programs must be
//    recompiled against the new header.
//
// Fully masked rows (the one rule, in every path): a query row whose keys
// are all masked (every score is -inf after masks) gets attention weights 0
// and attention result 0 before the output projection, so the module's
// output there equals out_proj.bias. PyTorch returns NaN in some paths.
#ifndef MHA_H
#define MHA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MHA_VERSION_MAJOR 0
#define MHA_VERSION_MINOR 2
#define MHA_VERSION_PATCH 0

#if defined(_WIN32) && defined(MHA_SHARED_BUILD)
#define MHA_API __declspec(dllexport)
#elif defined(__GNUC__)
#define MHA_API __attribute__((visibility("default")))
#else
#define MHA_API
#endif

#if defined(__GNUC__)
#define MHA_NODISCARD __attribute__((warn_unused_result))
#else
#define MHA_NODISCARD
#endif

// "0.2.0"
MHA_API const char *mha_version(void);

// ---------------------------------------------------------------------------
// Status and errors

typedef enum mha_status {
    MHA_OK = 0,
    MHA_ERR_INVALID_ARG = -1,  // a NULL pointer, a bad value, bad option
    MHA_ERR_SHAPE = -2,        // shapes or dims inconsistent with each other
    MHA_ERR_NOMEM = -3,        // an allocation failed
    MHA_ERR_IO = -4,           // open/read/write of a file failed
    MHA_ERR_FORMAT = -5,       // a malformed file
    MHA_ERR_UNSUPPORTED = -6,  // valid, but not supported (impl, layout, ...)
    MHA_ERR_NOT_FOUND = -7,    // a named tensor or parameter is absent
    MHA_ERR_OVERFLOW = -8,     // sizes whose product overflows
    MHA_ERR_DTYPE = -9,        // an element type this call does not take
} mha_status;

// Short constant name of a status, e.g. "MHA_ERR_SHAPE".
MHA_API const char *mha_status_string(mha_status s);

// The message of the most recent failed call on this thread ("" if none).
// Valid until the next failing call on the same thread.
MHA_API const char *mha_last_error(void);

// What the calling thread's last successful mha_forward,
// mha_backward, mha_sdpa or mha_sdpa_backward ran: "reference", or
// "fused " and the SIMD kernel set ("fused avx512"; "fused amx": avx512
// with AMX tiles for bf16 products), followed by " bf16" where the
// products were computed in bf16 ("fused amx bf16", "fused avx512bf16
// bf16": see mha_sdpa_args);
// "" before any. Each of those calls (and mha_sdpa_varlen, the caches'
// mha_kv_cache_attend / mha_paged_cache_attend and mha_forward_cached /
// mha_forward_paged: "fused " and the kernels, their attention in
// float32) sets it when it succeeds; no other call changes it.
MHA_API const char *mha_last_impl(void);

// Writes s into buf (cap >= 16 bytes) as a quoted, printable, one-line
// string for messages: bytes outside printable ASCII, quotes and
// backslashes become \xNN; long strings are cut with "...". Returns buf.
MHA_API const char *mha_escape(char *buf, size_t cap, const char *s);

// Optional: every error message is also passed to fn (from the thread that
// hit it). fn = NULL removes the callback. Not thread-safe against
// concurrent calls of mha_set_log_callback itself.
typedef void (*mha_log_fn)(mha_status status, const char *message, void *user);
MHA_API void mha_set_log_callback(mha_log_fn fn, void *user);

// ---------------------------------------------------------------------------
// Element types and tensor views

typedef enum mha_dtype {
    MHA_F32 = 0,
    MHA_F16,
    MHA_BF16,
    MHA_BOOL,  // one byte, 0 or 1
    MHA_I64,
    MHA_I32,
    MHA_U8,
    MHA_F64,
    MHA_DTYPE_COUNT
} mha_dtype;

// Bytes per element (0 for an invalid dtype).
MHA_API size_t mha_dtype_size(mha_dtype t);
// safetensors name: "F32", "F16", "BF16", "BOOL", "I64", "I32", "U8", "F64".
MHA_API const char *mha_dtype_name(mha_dtype t);
// Inverse of mha_dtype_name; MHA_ERR_UNSUPPORTED for unknown names.
MHA_API MHA_NODISCARD mha_status mha_dtype_from_name(mha_dtype *out, const char *name);

#define MHA_MAX_DIMS 8

// A view of caller memory: element (i0, i1, ...) lives at
// data + (i0*stride[0] + i1*stride[1] + ...) * mha_dtype_size(dtype).
// The library never writes through an input view.
typedef struct mha_tensor {
    void *data;
    mha_dtype dtype;
    int ndim;
    int64_t shape[MHA_MAX_DIMS];
    int64_t stride[MHA_MAX_DIMS];  // in elements
} mha_tensor;

// A contiguous (row-major) view of data with the given shape.
MHA_API mha_tensor mha_tensor_contiguous(void *data, mha_dtype dtype, int ndim,
                                         const int64_t *shape);
// Number of elements (product of shape; 1 for ndim 0).
MHA_API int64_t mha_tensor_numel(const mha_tensor *t);

// IEEE half and bfloat16 conversions (round to nearest even).
MHA_API float mha_f16_to_f32(uint16_t h);
MHA_API uint16_t mha_f32_to_f16(float f);
MHA_API float mha_bf16_to_f32(uint16_t h);
MHA_API uint16_t mha_f32_to_bf16(float f);

// ---------------------------------------------------------------------------
// Implementations

typedef enum mha_impl {
    MHA_IMPL_AUTO = 0,       // fused for float32 inputs without a trace,
                             // else reference; the environment variable
                             // MHA_IMPL=reference|fused overrides it
    MHA_IMPL_REFERENCE = 1,  // plain loops, full score matrix, double: the
                             // oracle
    MHA_IMPL_FUSED = 2,      // tiled online-softmax attention (never stores
                             // the (L, S) scores), SIMD kernels chosen at
                             // run time, float32 (F32 views only)
} mha_impl;

// The SIMD kernels the fused path uses in this process: "amx" (avx512 with
// AMX-BF16 tiles for bf16 products; the default where Linux grants them),
// "avx512bf16" (avx512 computing bf16 with vdpbf16ps; the default on AMD
// Zen 4 and later, where it runs at twice the float32 FMA rate; on Intel's
// AVX512-BF16 cores it is no faster, so only MHA_ISA picks it there),
// "avx512", "avx2" or "scalar" (MHA_ISA=scalar|avx2|avx512|avx512bf16|amx
// forces one the CPU has).
MHA_API const char *mha_isa(void);
// 1 when this build has the SIMD kernels name ("scalar", "avx2", "avx512",
// "avx512bf16", "amx") and this CPU (and OS) can run them, else 0 (also for
// an unknown name or NULL): the ISAs MHA_ISA can choose here.
MHA_API int mha_isa_supported(const char *name);

// "auto", "reference" (also "ref"), "fused" -> value;
// MHA_ERR_UNSUPPORTED otherwise.
MHA_API MHA_NODISCARD mha_status mha_impl_from_name(mha_impl *out, const char *name);
MHA_API const char *mha_impl_name(mha_impl impl);

// ---------------------------------------------------------------------------
// The module: nn.MultiheadAttention

// Per-head gates on the heads' outputs, before W_O: head h's context
// ctx_h (L, d) becomes g_h * ctx_h. Trainable through mha_backward.
//   MHA_GATE_STATIC:  g_h = head_gate[h], a parameter "head_gate" (H),
//                     initialised to 1 (the ungated module)
//   MHA_GATE_DYNAMIC: g_{n,l,h} = sigmoid(x_q[n,l,:] . W_g[h,:] + b_g[h]),
//                     from the query input: parameters "gate_proj.weight"
//                     (H, E) and "gate_proj.bias" (H), initialised to 0
//                     (every gate 0.5 until trained); float32 always
// A head pruned with mha_module_prune_heads is skipped whatever its gate.
typedef enum mha_head_gate {
    MHA_GATE_NONE = 0,
    MHA_GATE_STATIC = 1,
    MHA_GATE_DYNAMIC = 2,
} mha_head_gate;
MHA_API const char *mha_head_gate_name(mha_head_gate g);  // "none", "static", "dynamic"
MHA_API MHA_NODISCARD mha_status mha_head_gate_from_name(mha_head_gate *out, const char *name);

// QK-norm (mha_config.qk_norm): RMSNorm of the projected q and k, after
// their biases and before RoPE, as Qwen3 and OLMo 2 do:
// x <- x / sqrt(mean(x^2) + eps) * w, the mean (in float32 or double, as
// the path computes) over
//   MHA_QK_NORM_HEAD: each head's d features; parameters "q_norm.weight"
//                     and "k_norm.weight", both (d) (Qwen3)
//   MHA_QK_NORM_ALL:  all of q's H d features and all of k's Hkv d;
//                     "q_norm.weight" (H d), "k_norm.weight" (Hkv d) (OLMo 2)
// The keys appended by add_bias_kv / add_zero_attn are not normalised.
// The weights start at 1 (mha_module_create, mha_module_init), as torch's
// RMSNorm. Paths: the reference and the fused forward and backward (both
// weights' gradients; a training forward's saved state keeps q and k
// before the norm), mha_forward_cached and mha_diag_create; the MPI layer
// refuses it (MHA_ERR_UNSUPPORTED: its parts project only their heads).
typedef enum mha_qk_norm {
    MHA_QK_NORM_NONE = 0,
    MHA_QK_NORM_HEAD = 1,
    MHA_QK_NORM_ALL = 2,
} mha_qk_norm;

typedef struct mha_config {
    int64_t embed_dim;        // E
    int64_t num_heads;        // H; must divide E (unless head_dim is set)
    int64_t kdim;             // features of key; 0 means E
    int64_t vdim;             // features of value; 0 means E
    bool bias;                // in_proj_bias and out_proj.bias (default true)
    bool add_bias_kv;         // learnable bias_k, bias_v appended as one key
    bool add_zero_attn;       // one zero key/value appended (after bias_kv)
    bool batch_first;         // query (N, L, E) instead of (L, N, E)
    float dropout;            // p in [0, 1): dropout on the attention weights
                              // after the softmax, before weighting V; only
                              // when mha_forward_args.training
    float out_dropout;        // p in [0, 1): dropout after the output
                              // projection (not in PyTorch's module); training
                              // only
    int64_t num_kv_heads;     // Hkv: heads of the keys and values; 0 means H;
                              // must divide H (grouped-query attention; 1:
                              // multi-query). Query head h reads KV head
                              // h / (H / Hkv); Ekv = Hkv * d. (Last, so the
                              // layout of the fields above is unchanged.)
    mha_dtype weight_dtype;   // storage of the weight matrices (in_proj_weight
                              // or q/k/v_proj_weight, out_proj.weight):
                              // MHA_F32 (the default, 0), MHA_BF16 or MHA_F16
                              // (half the memory; values rounded to nearest
                              // even; products and sums stay float32/float64,
                              // except: bf16 weights with bf16 query, key and
                              // value in a fused forward (with `save`: of a
                              // module without gates) on a CPU that computes
                              // bf16 (mha_isa() "amx" or "avx512bf16") round
                              // the projected q, k, v to bf16, compute the
                              // attention in bf16, as mha_sdpa does for bf16
                              // views, and round the context for W_O; its
                              // mha_backward computes every product with
                              // bf16 operands and float32 sums, as PyTorch's
                              // bf16 autograd (the gradients rounded to bf16
                              // once per product; mha_last_impl() ends in
                              // " bf16").
                              // Biases and bias_k/bias_v stay float32.
                              // mha_backward and a forward with `save` take
                              // half weights (widened exactly; the grads
                              // module's weight matrices, of any of the
                              // three dtypes, get the float32 sums rounded
                              // once); the optimizers refuse them
                              // (MHA_ERR_UNSUPPORTED): they update float32
                              // modules.
    mha_head_gate head_gate;  // per-head output gates (see mha_head_gate):
                              // MHA_GATE_NONE (the default, 0),
                              // MHA_GATE_STATIC or MHA_GATE_DYNAMIC
    // The layouts and options of real checkpoints (Hugging Face models;
    // every field's zero is the nn.MultiheadAttention behaviour):
    int64_t head_dim;     // d: 0 means E / H (then H must divide E); else
                          // q projects to Eq = H d features, k and v to
                          // Ekv = Hkv d, and out_proj.weight is (E, Eq)
                          // (Gemma, Qwen3: d is not E / H). The parameter
                          // shapes below read E + 2 Ekv as Eq + 2 Ekv and
                          // q_proj_weight (E, E) as (Eq, E).
    bool separate_qkv;    // q_proj_weight, k_proj_weight and v_proj_weight
                          // even when kdim == vdim == E (a checkpoint's
                          // separate matrices, kept as they are)
    bool no_out_bias;     // with bias: in_proj_bias but no out_proj.bias
                          // (Qwen2: biased q, k, v; unbiased o)
    mha_qk_norm qk_norm;  // RMSNorm of q and k before RoPE (see mha_qk_norm)
    float qk_norm_eps;    // its epsilon; 0 means 1e-6
    bool sinks;           // attention sinks (GPT-OSS): a parameter "sinks"
                          // (H), one learned logit per head that joins each
                          // row's softmax denominator and carries no value:
                          // p_ij = exp(s_ij - m) / (exp(sink_h - m) +
                          // sum_j exp(s_ij - m)), m the max over the row
                          // and the sink; the weights returned are p (rows
                          // sum to less than 1); trainable (mha_backward);
                          // mha_forward_cached applies them; the MPI layer
                          // refuses them and head_dim != E / H
                          // (MHA_ERR_UNSUPPORTED)
} mha_config;

// Defaults as nn.MultiheadAttention(embed_dim, num_heads): bias = true,
// everything else off, kdim = vdim = embed_dim.
MHA_API void mha_config_init(mha_config *cfg, int64_t embed_dim, int64_t num_heads);

typedef struct mha_module mha_module;
typedef struct mha_st_file mha_st_file;  // a safetensors file (see below)

// Allocates the module and its parameters (all zero). Checks the config:
// E > 0, H > 0, E % H == 0 (or head_dim > 0), 0 <= num_kv_heads (0: H) dividing H, kdim/vdim
// >= 0, 0 <= dropout, out_dropout < 1.
MHA_API MHA_NODISCARD mha_status mha_module_create(mha_module **out, const mha_config *cfg);
MHA_API void mha_module_destroy(mha_module *m);
// The config with kdim/vdim, num_kv_heads and head_dim resolved (never 0).
MHA_API const mha_config *mha_module_config(const mha_module *m);

// Parameters, with PyTorch's names and layouts (y = x W^T + b); Ekv =
// num_kv_heads * d (= E without grouped-query attention):
//   kdim == vdim == E: "in_proj_weight" (E + 2 Ekv, E), rows Q then K then V
//   otherwise:         "q_proj_weight" (E, E), "k_proj_weight" (Ekv, kdim),
//                      "v_proj_weight" (Ekv, vdim)
//   bias:              "in_proj_bias" (E + 2 Ekv), "out_proj.bias" (E)
//   always:            "out_proj.weight" (E, E)
//   add_bias_kv:       "bias_k" (1, 1, Ekv), "bias_v" (1, 1, Ekv)
//   MHA_GATE_STATIC:   "head_gate" (H)
//   MHA_GATE_DYNAMIC:  "gate_proj.weight" (H, E), "gate_proj.bias" (H)
//   qk_norm:           "q_norm.weight", "k_norm.weight" (see mha_qk_norm)
//   sinks:             "sinks" (H)
// (with head_dim set, read E + 2 Ekv as Eq + 2 Ekv, q_proj_weight as
// (Eq, E) and out_proj.weight as (E, Eq); separate_qkv gives the q/k/v
// matrices whatever kdim and vdim; no_out_bias drops out_proj.bias)
// Query head h uses features [h*d, (h+1)*d) of the projected Q; KV head
// g = h / (H / Hkv) features [g*d, (g+1)*d) of the projected K and V.
// storage points into the module (contiguous, 64-byte aligned, elements of
// dtype: MHA_F32, or for the weight matrices the config's weight_dtype) and
// may be read and written by the caller while no forward runs; data is the
// same pointer when dtype is MHA_F32, else NULL. Writing parameters: see
// mha_module_params_changed (the pointers from mha_module_param and
// mha_module_param_at may be written until the next call that reads the
// module; after that, call mha_module_params_changed once done writing).
typedef struct mha_param {
    const char *name;
    int ndim;
    int64_t shape[3];
    int64_t numel;
    float *data;
    mha_dtype dtype;  // (after data, so the layout above is unchanged)
    void *storage;
} mha_param;

MHA_API int mha_module_num_params(const mha_module *m);
// i in [0, mha_module_num_params()). Both calls hand out a writable pointer,
// so each counts as mha_module_params_changed(m) (a cheap mark: the next
// call that uses the packed weights fills them again; like it, safe while
// other threads' calls read m).
MHA_API MHA_NODISCARD mha_status mha_module_param_at(mha_param *out, const mha_module *m, int i);
// MHA_ERR_NOT_FOUND if the module has no parameter of that name.
MHA_API MHA_NODISCARD mha_status mha_module_param(mha_param *out, const mha_module *m,
                                                  const char *name);

// The packed weights. A module keeps a copy of each float32 projection
// weight (in_proj_weight, or q/k/v_proj_weight; out_proj.weight;
// gate_proj.weight) in the layout of the GEMM kernels the process uses, so
// that the fused forward, backward and mha_forward_cached multiply by it
// without packing the weight first on every call (the same bits as packing
// it: results never depend on whether the copy was used). The copy is
// allocated with the module (mha_module_create, _load, _convert, ...) and
// filled from the parameters by the first such call after they changed
// (a forward with the caller's workspace included: it still never
// allocates); a call that finds
// another thread filling it, or still reading an outdated copy, packs into
// its scratch as before (nobody waits). So the first call after a change
// packs the weights as every call did before, and the calls after it do
// not.
// Memory: about the float32 weight matrices' size again: for each matrix
// W (O, I), ceil(O / w) * w * I floats, w the kernels' panel width (16
// scalar and AVX2, 32 AVX-512). Weight matrices stored as BF16/F16 are
// kept in the same layout in their own type (the same size as the
// matrices: no float32 copy), widened as the kernels load them (the bits
// of the float32 layout, half the bytes read); with bf16 weights on a CPU
// that computes bf16 (mha_isa() "amx", "avx512bf16") also in the bf16
// products' layout (the same size again); a half module's float32
// gate_proj.weight is kept.
// The library marks the copy outdated itself whenever it changes
// parameters: mha_module_init, mha_optim_step (the modules registered
// with mha_optim_add_module; and zero_grad / clip_grad_norm their
// gradient modules), mha_backward (its grads module), loading and
// converting (new modules), and mha_module_param / mha_module_param_at
// (which hand out writable pointers: "get the pointer, write, forward" is
// safe). Head pruning changes no parameter. What remains the caller's duty:
// after writing parameter memory through a pointer obtained *before* a
// call that read the module (a forward, backward, cached decode ran since
// the pointer was obtained), or through tensors registered with
// mha_optim_add (rather than _add_module) by mha_optim_step, call
// mha_module_params_changed(m) before the next call that reads m;
// otherwise that call may use the outdated copy. m NULL: nothing. Safe to
// call from any thread at any time, even while other threads run calls on
// m (the writes themselves must still not overlap such calls).
MHA_API void mha_module_params_changed(mha_module *m);

// A copy of m whose weight matrices are stored as weight_dtype (MHA_F32,
// MHA_BF16, MHA_F16): float32 -> half rounds to nearest even, half ->
// float32 is exact, bf16 <-> f16 goes through float32. Everything else
// (config, biases) is copied as is.
MHA_API MHA_NODISCARD mha_status mha_module_convert(mha_module **out, const mha_module *m,
                                                    mha_dtype weight_dtype);

// Head pruning: the heads listed (n of them, each in [0, H), repeats
// allowed) are skipped from now on: their attention is not computed (no
// scores, no softmax, no weighting of V) and their context is zero, as if
// gated by 0; their attention weights (need_weights) are zero rows and the
// averaged weights are the mean over the live heads of the selected block.
// The projections still run (their rows are part of the packed GEMMs).
// mha_backward gives zero gradients through a pruned head. n = 0 (heads
// may be NULL) restores every head. Replaces the previous set; on error
// the set is unchanged. Saved as __metadata__ "pruned_heads" ("1,3").
// Under mha_forward_cached the pruned heads' context is zeroed but their
// attention is computed.
MHA_API MHA_NODISCARD mha_status mha_module_prune_heads(mha_module *m, const int64_t *heads,
                                                        int64_t n);
// Whether head h is pruned (false when h is out of range); and how many.
MHA_API bool mha_module_head_pruned(const mha_module *m, int64_t h);
MHA_API int64_t mha_module_num_pruned(const mha_module *m);

// Loading and saving parameters as safetensors, under PyTorch's
// state_dict names (so torch's `save_file(mha.state_dict(), ...)` loads).
// mha_module_load reads embed_dim, kdim, vdim, bias and add_bias_kv from
// which tensors are present and their shapes, and so the layouts of real
// checkpoints: head_dim = Eq / num_heads when out_proj.weight is (E, Eq)
// with Eq != E, separate_qkv when q/k/v_proj_weight come with kdim ==
// vdim == E, no_out_bias when in_proj_bias has no out_proj.bias, sinks
// when a "sinks" tensor is there (every
// shape is checked; a
// tensor that is not a parameter is an error); num_heads from
// base->num_heads, or, when that is 0, from the file's __metadata__
// "num_heads"; num_kv_heads from base->num_kv_heads, or, when that is 0,
// from __metadata__ "num_kv_heads", or, when absent, from the K/V shapes
// (Ekv / d); batch_first, add_zero_attn and dropout from base (NULL:
// defaults); weight_dtype from base (the weights are converted to it:
// a BF16 file into a BF16 module is copied exactly); head_gate from the
// tensors present ("head_gate": static, "gate_proj.weight" and
// "gate_proj.bias": dynamic); the pruned heads from __metadata__
// "pruned_heads"; qk_norm from "q_norm.weight" and "k_norm.weight" (both
// or neither): MHA_QK_NORM_HEAD when q_norm.weight is (d), else
// MHA_QK_NORM_ALL; qk_norm_eps from base (a file cannot carry it; 0:
// 1e-6). F32, F16, BF16 and F64 tensors are accepted.
MHA_API MHA_NODISCARD mha_status mha_module_load(mha_module **out, const mha_st_file *f,
                                                 const mha_config *base);
// Writes every parameter in its storage dtype (F32; the weight matrices
// as BF16/F16 in a module with half weights) and __metadata__ {"num_heads": "H"} (and
// "num_kv_heads" when it differs from num_heads, "pruned_heads" when any
// head is pruned).
MHA_API MHA_NODISCARD mha_status mha_module_save(const mha_module *m, const char *path);

// Weight initialisation, seeded and reproducible (same seed, same values on
// every machine; not bit-identical to torch's generator).
typedef enum mha_init_scheme {
    // PyTorch's defaults: xavier_uniform over the packed (E + 2 Ekv) x E
    // matrix with its own fans (or
    // each separate q/k/v matrix), out_proj.weight as nn.Linear
    // (kaiming_uniform a = sqrt(5), i.e. U(-1/sqrt(E), 1/sqrt(E))), zero
    // in_proj_bias and out_proj.bias, bias_k/bias_v xavier_normal.
    MHA_INIT_XAVIER_UNIFORM = 0,
    // The alternatives apply to every weight matrix (the in-projection(s),
    // out_proj.weight) and bias_k/bias_v; biases stay zero.
    MHA_INIT_XAVIER_NORMAL,  // N(0, gain^2 * 2 / (fan_in + fan_out))
    MHA_INIT_NORMAL,         // N(0, std^2)
    MHA_INIT_ORTHOGONAL,     // gain * (semi-)orthogonal, as torch's
    MHA_INIT_ZEROS,          // everything 0
} mha_init_scheme;

typedef struct mha_init_options {
    mha_init_scheme scheme;
    double gain;    // xavier_uniform (in-projection only), xavier_normal,
                    // orthogonal; default 1
    double std;     // normal; default 0.02
    uint64_t seed;  // default 0
} mha_init_options;

MHA_API void mha_init_options_init(mha_init_options *opt);
// "xavier_uniform", "xavier_normal", "normal", "orthogonal", "zeros".
MHA_API MHA_NODISCARD mha_status mha_init_scheme_from_name(mha_init_scheme *out,
                                                           const char *name);
// Overwrites every parameter; on error (out of memory included) none.
MHA_API MHA_NODISCARD mha_status mha_module_init(mha_module *m, const mha_init_options *opt);

// Forward arguments. Shapes (E = embed_dim, N batch, L target, S source):
//   query  (L, N, E), or (N, L, E) with batch_first, or unbatched (L, E)
//   key    (S, N, kdim) / (N, S, kdim) / (S, kdim)
//   value  (S, N, vdim) / (N, S, vdim) / (S, vdim)
//   key_padding_mask  optional, (N, S), or (S) when unbatched.
//       MHA_BOOL or MHA_U8: nonzero = ignore this key. MHA_F32/F64: added.
//   attn_mask  optional, (L, S) or (N*H, L, S) (index b*H + h), or for an
//       unbatched query (L, S) or (H, L, S).
//       MHA_BOOL or MHA_U8: nonzero = not allowed. MHA_F32/F64: added.
//   is_causal  hides keys j > i (no mask needs to be built); combines with
//       the masks above.
// Masks combine by addition after bool -> -inf. The keys appended by
// add_bias_kv and add_zero_attn are never masked.
// Floating tensors (inputs, outputs, gradients) are MHA_F32 or MHA_F64 views
// with any strides (no stride 0 for outputs). The reference computes in
// double throughout, so with MHA_F64 views the forward and backward are a
// float64 computation of float32 parameters (for gradient checks).
// Optional trace of every intermediate step (for teaching and debugging;
// `mha demo` prints them). Called in order from the calling thread, with a
// float32 view valid only during the call; b and h are -1 when the step is
// not per batch element / head. Steps, per forward:
//   "q", "k", "v"     projected inputs (N, L, E), (N, S', Ekv), (N, S', Ekv)
//                     (the keys/values appended by add_bias_kv and
//                     add_zero_attn included); head h is features
//                     [h*d, (h+1)*d) (of k, v: KV head h / (H / Hkv))
//   per (b, h): "scores" q k^T (L, S'); "scaled_scores" scale * q k^T + masks
//               (L, S'); "weights" softmax (L, S'); "context" (L, d)
//   "concat"          the heads' contexts merged back (N, L, E)
//   "output"          after the output projection (N, L, E)
// Tracing runs the forward on one thread.
typedef void (*mha_trace_fn)(void *user, const char *step, int64_t b, int64_t h,
                             const mha_tensor *t);

// ---------------------------------------------------------------------------
// Rotary position embeddings (RoPE), applied to projected q and k, after
// the projections and before attention (and before a KV cache):
//   inv_freq_i = theta^(-2i / dim), i < dim / 2; angle = position * inv_freq_i
//   MHA_ROPE_NEOX (rotate_half: GPT-NeoX, Hugging Face Llama): element c and
//     c + dim/2 of each head form pair i = c:
//       x_c' = x_c cos - x_{c+dim/2} sin;  x_{c+dim/2}' = x_{c+dim/2} cos + x_c sin
//   MHA_ROPE_INTERLEAVED (RoFormer, GPT-J): elements 2i and 2i + 1 pair up
//       x_2i' = x_2i cos - x_2i+1 sin;     x_2i+1' = x_2i+1 cos + x_2i sin
//   partial rotary: only the first dim features of each head (dim even,
//   0 = all of D); the rest pass through.
// Angles and their cos/sin are computed in double.
typedef enum mha_rope_mode {
    MHA_ROPE_NONE = 0,
    MHA_ROPE_NEOX = 1,
    MHA_ROPE_INTERLEAVED = 2
} mha_rope_mode;

typedef struct mha_rope {
    mha_rope_mode mode;
    double theta;  // default 10000
    int64_t dim;   // rotated features per head (even); 0: all
} mha_rope;

// RoPE scaling, as transformers' ROPE_INIT_FUNCTIONS compute it (the
// config's rope_scaling / rope_parameters). With dim the rotated features
// and inv_freq_i = theta^(-2i / dim), i < dim / 2:
//   MHA_ROPE_SCALING_LINEAR:  inv_freq_i / factor
//   MHA_ROPE_SCALING_DYNAMIC: dynamic NTK: for a call whose largest
//       position + 1 (seq) exceeds original_max_position, theta becomes
//       theta ((factor seq / original_max_position) - (factor - 1))^(dim /
//       (dim - 2)); unchanged otherwise (transformers keeps the largest
//       seq seen by the module; mha decides per call, which agrees while
//       the sequences only grow, as in decoding). original_max_position is
//       transformers' config.max_position_embeddings here; dim > 2.
//   MHA_ROPE_SCALING_YARN: inv_freq blended between inv_freq_i and
//       inv_freq_i / factor by the linear ramp between the correction dims
//       of beta_fast and beta_slow (floored / ceiled when truncate), and cos
//       and sin multiplied by attention_factor (0: 0.1 ln(factor) + 1, or
//       from mscale / mscale_all_dim when both are set)
//   MHA_ROPE_SCALING_LLAMA3: wavelengths 2 pi / inv_freq_i above
//       original_max_position / low_freq_factor divided by factor, below
//       original_max_position / high_freq_factor kept, smoothly blended
//       in between (0 < low_freq_factor < high_freq_factor)
// YaRN: beta_fast / beta_slow 0 mean the defaults 32 / 1 (as transformers'
// "or"); theta != 1. Every field is checked where its type uses it
// (MHA_ERR_INVALID_ARG naming the field and its value); fields a type does
// not use are ignored. The attention factor multiplies cos and sin of the
// rotated features only (partial rotary: the rest pass through unscaled),
// so the scores of rotated features scale by its square, as in
// transformers. A scaling other than NONE needs a RoPE mode: with
// MHA_ROPE_NONE it is refused (MHA_ERR_INVALID_ARG), not ignored.
typedef enum mha_rope_scaling_type {
    MHA_ROPE_SCALING_NONE = 0,
    MHA_ROPE_SCALING_LINEAR = 1,
    MHA_ROPE_SCALING_DYNAMIC = 2,
    MHA_ROPE_SCALING_YARN = 3,
    MHA_ROPE_SCALING_LLAMA3 = 4,
} mha_rope_scaling_type;

typedef struct mha_rope_scaling {
    mha_rope_scaling_type type;
    double factor;                  // > 0 (linear, dynamic, yarn, llama3)
    int64_t original_max_position;  // original_max_position_embeddings
                                    // (dynamic, yarn, llama3), > 0
    double low_freq_factor;         // llama3 (default 1)
    double high_freq_factor;        // llama3 (default 4)
    double beta_fast, beta_slow;    // yarn (defaults 32, 1)
    double mscale, mscale_all_dim;  // yarn (0: unset)
    double attention_factor;        // yarn (0: derived as above)
    bool truncate;                  // yarn (default true)
} mha_rope_scaling;

// Type and the defaults above (factor 1, original_max_position 0).
MHA_API void mha_rope_scaling_init(mha_rope_scaling *s, mha_rope_scaling_type type);
// "default"/"none", "linear", "dynamic", "yarn", "llama3" -> type;
// MHA_ERR_UNSUPPORTED (naming it) otherwise.
MHA_API MHA_NODISCARD mha_status mha_rope_scaling_type_from_name(mha_rope_scaling_type *out,
                                                                 const char *name);
// The frequencies a call uses: inv_freq (dim / 2 of them, dim = r->dim or
// head_dim when 0) and the factor cos and sin are multiplied by (1 unless
// YaRN), for a call whose positions are below seq (dynamic NTK). s may be
// NULL; r's mode is not used (its theta and dim are). Checks every field
// (MHA_ERR_INVALID_ARG naming it). Computed in double (transformers
// computes them in float32: they agree within float32 rounding).
MHA_API MHA_NODISCARD mha_status mha_rope_frequencies(double *inv_freq,
                                                      double *attention_factor,
                                                      const mha_rope *r,
                                                      const mha_rope_scaling *s,
                                                      int64_t head_dim, int64_t seq);

// ---------------------------------------------------------------------------
// Attention options: one struct, the same in every call that attends
// (mha_forward_args.opts, mha_sdpa_args.opts, mha_varlen_args.opts,
// mha_cache_attend_args.opts, mha_checkpoint_layer.opts). Start from
// mha_attn_opts_init; each call states which options it refuses (with
// MHA_ERR_INVALID_ARG naming the option) rather than ignoring them.
//
// The logit of query i and key j of head h, in this order:
//   s = scale (q_i . k_j)                  scale 0: 1 / sqrt(head dim)
//   s = softcap tanh(s / softcap)          softcap > 0 (Gemma 2)
//   s = s - slope_h |i - j|                ALiBi
//   s = -inf where a mask hides (i, j)     causal, window, the mask tensors
// then the softmax over the row (sinks[h], when given, joins its
// denominator), dropout on the weights, and the weights times V.
typedef struct mha_attn_opts {
    // Causal: query i sees keys j <= i (positions top-left aligned; the
    // caches align each query with its position in the sequence and are
    // always causal).
    bool is_causal;
    // Sliding-window (local) attention: query i sees keys j with
    // i - window_left <= j <= i + window_right; -1 (the default) leaves
    // that side unbounded. Combines with every other mask (with is_causal,
    // keys j > i stay hidden whatever window_right). Keys appended by
    // add_bias_kv / add_zero_attn are never masked. The fused paths skip
    // key tiles outside the band.
    int64_t window_left;
    int64_t window_right;
    // The query scale: 0 (the default) is 1 / sqrt(head dim); else > 0 and
    // finite (Gemma 2's query_pre_attn_scalar^-1/2, GPT-2's
    // 1 / (sqrt(d) (layer + 1))).
    double scale;
    // Logit soft-capping: s <- softcap * tanh(s / softcap) after the
    // scaling, before ALiBi and the masks (Gemma 2). 0: none.
    float softcap;
    // ALiBi: -slope_h * |i - j| added to the scores of query head h, with
    // slopes alibi_slopes (one per query head) or, when alibi is true and
    // alibi_slopes NULL, the ALiBi paper's geometric sequence
    // 2^(-8 (h + 1) / H) (interleaved as the paper does when H is not a
    // power of 2). Off when alibi is false and alibi_slopes NULL. Covers
    // the keys appended by add_bias_kv / add_zero_attn too (a logit, not a
    // mask).
    bool alibi;
    const float *alibi_slopes;
    // Attention sinks (GPT-OSS): sinks[h], one logit per query head that
    // joins each row's softmax denominator and carries no value (the
    // weights then sum to less than 1). NULL: none. The module calls take
    // the module's own parameter (mha_config.sinks) and refuse this.
    const float *sinks;
    // StreamingLLM (Xiao et al., "Efficient Streaming Language Models with
    // Attention Sinks"; the caches only, with window_left = w >= 0): the
    // first sink_tokens = k tokens of every sequence stay visible to every
    // query beside its window, at the positions the paper gives (those
    // within the cache: the tokens between the sinks and the window
    // evicted). A query at position p sees keys [0, min(k, p - w)) and
    // [p - w, p]; the sinks are seen as if at positions j + delta,
    // delta = max(0, p - w - k), so that they sit just before the window:
    // ALiBi takes that distance (and mha_forward_cached rotates the query
    // that scores them at position p - delta, as the paper's re-rotated
    // cache does). Pair it with mha_paged_cache_release(cache, id,
    // sink_tokens, length - window_left) after each call for bounded
    // memory. 0: off. Not with a sharded cache.
    int64_t sink_tokens;
    // Dropout on the attention weights (after the softmax, before V) with
    // inverted scaling 1/(1-p), p = dropout_p in [0, 1): mha_sdpa and its
    // backward. The module calls take the module's rate (mha_config.dropout,
    // when mha_forward_args.training) and refuse this; mha_sdpa_varlen and
    // the caches refuse it. The masks come from Philox4x32-10 keyed by
    // (dropout_seed, dropout_offset, element position): never stored,
    // regenerated by the backward, independent of the number of threads.
    // Advance dropout_offset between steps for fresh masks.
    float dropout_p;
    uint64_t dropout_seed;
    uint64_t dropout_offset;
} mha_attn_opts;

// Every option off: window_left = window_right = -1, the rest 0 / NULL.
MHA_API void mha_attn_opts_init(mha_attn_opts *o);

typedef struct mha_forward_args {
    const mha_tensor *query;
    const mha_tensor *key;
    const mha_tensor *value;
    const mha_tensor *key_padding_mask;  // NULL: none
    const mha_tensor *attn_mask;         // NULL: none
    // Causal, windows, scale, soft cap, ALiBi, StreamingLLM sink tokens
    // (mha_forward_cached, mha_forward_paged), the dropout seed and offset;
    // opts.sinks and opts.dropout_p are refused (the module's sinks and
    // dropout rate are its config's).
    mha_attn_opts opts;
    bool need_weights;          // write attn_output_weights
    bool average_attn_weights;  // mean over heads (default true)
    // A block of the weights only (long sequences: the full (H, L, S')
    // weights may not fit): heads [weights_head_begin, weights_head_end)
    // and query rows [weights_row_begin, weights_row_end); an end of -1
    // (the default) means H or L. The weights' shape becomes (N, Hs, Ls, S')
    // per head or (N, Ls, S') averaged, the mean over the selected heads
    // (Hs, Ls the block's sizes). The fused path computes only that block.
    int64_t weights_head_begin, weights_head_end;
    int64_t weights_row_begin, weights_row_end;
    // int8 attention weights: an MHA_U8 weights view stores each row
    // (every (n, [h,] i) over the S' keys) as round(w / scale) with
    // scale = max(row) / 255, written to weights_scale (contiguous floats,
    // the weights' shape without its last dim), so w ~ scale * u8 within
    // scale / 2: 4x less memory than float32 for inspecting long sequences.
    // Required (non-NULL) exactly when the weights view is MHA_U8.
    float *weights_scale;
    mha_impl impl;       // default MHA_IMPL_AUTO
    mha_trace_fn trace;  // NULL: no trace
    void *trace_user;
    // Training mode: dropout (config.dropout, config.out_dropout) is applied
    // with inverted scaling 1/(1-p), its masks keyed by opts.dropout_seed
    // and opts.dropout_offset; off (eval), the result is exactly the
    // no-dropout one. The attention weights returned with need_weights are
    // those after dropout, as in PyTorch.
    bool training;
    // Training without recomputation: a forward given a saved-state object
    // keeps what mha_backward needs (the Q/K/V projections, the context and
    // each row's softmax statistics); mha_backward with the same args then
    // skips re-running the forward. Results are bit-identical to the
    // recomputing backward. NULL (default): nothing kept. Only the fused
    // implementation keeps state (elsewhere the backward recomputes). The
    // caller must not change the module's parameters or the inputs between
    // the two calls (they are not copied). See mha_saved_create.
    struct mha_saved *save;
    // RoPE on q and k after their projections (mode MHA_ROPE_NONE, the
    // default: off); token t of batch element n has position
    // rope_start[n] + t (rope_start NULL: t). Keys appended by add_bias_kv /
    // add_zero_attn are not rotated.
    mha_rope rope;
    const int64_t *rope_start;
    // RoPE positions per token (transformers' position_ids): NULL, or
    // N * L of them, row-major (n, t) ((L) for an unbatched query); token t
    // of batch element n of the query, and of the key (which must then
    // have the query's length), has position rope_positions[n L + t]
    // (>= 0). Overrides rope_start. Under mha_forward_cached: the T new
    // tokens' positions (N * T), instead of len_n + t. A key of another
    // length (cross-attention) is refused (MHA_ERR_INVALID_ARG). Ignored,
    // as rope_start, when rope.mode is MHA_ROPE_NONE. Not available with
    // the sequence-parallel MPI schemes (Ulysses, ring).
    const int64_t *rope_positions;
    // RoPE frequency scaling (linear, dynamic NTK, YaRN, llama3): NULL or
    // a scaling of type MHA_ROPE_SCALING_NONE is none (see
    // mha_rope_scaling). Dynamic NTK takes the call's largest position + 1
    // (over the query and key tokens; mha_forward_cached: over the new
    // tokens); it is not available with the sequence-parallel MPI schemes,
    // whose ranks see a part of the positions.
    const struct mha_rope_scaling *rope_scaling;
    // Scratch memory: NULL (the default): the calling thread's kept block,
    // allocated when it does not fit; else at least
    // mha_forward_workspace_size() bytes (any alignment) of the caller's,
    // and mha_forward never allocates.
    void *workspace;
    size_t workspace_bytes;
} mha_forward_args;

MHA_API void mha_forward_args_init(mha_forward_args *a);

// The saved state of a training forward (mha_forward_args.save). One
// object holds one forward at a time (the next forward given it replaces
// it); it owns its memory, about (3 L + L) E floats per batch element plus
// 2 H L (with qk_norm, q and k before the norm too: 2 L E more), grown when needed and kept until mha_saved_destroy. A backward
// whose args do not match the forward that filled it (module, input views,
// masks, causal, window, training, dropout seed and offset) fails with
// MHA_ERR_INVALID_ARG rather than using stale state.
typedef struct mha_saved mha_saved;
MHA_API MHA_NODISCARD mha_status mha_saved_create(mha_saved **out);
MHA_API void mha_saved_destroy(mha_saved *s);
// Bytes the object holds now.
MHA_API size_t mha_saved_bytes(const mha_saved *s);

// Output shapes of a forward (after checking every argument):
//   attn_output: same layout as query: (L, N, E) / (N, L, E) / (L, E)
//   attn_output_weights (S' = S + add_bias_kv + add_zero_attn):
//       averaged (N, L, S'), per head (N, H, L, S'); unbatched drops N;
//       H and L are the selected block's sizes (weights_head_*, _row_*).
// Either output pointer may be NULL.
typedef struct mha_shape {
    int ndim;
    int64_t dims[MHA_MAX_DIMS];
} mha_shape;

MHA_API MHA_NODISCARD mha_status mha_forward_shapes(mha_shape *out_shape,
                                                    mha_shape *weights_shape,
                                                    const mha_module *m,
                                                    const mha_forward_args *a);

// Bytes of scratch memory mha_forward needs for these arguments (the size
// of mha_forward_args.workspace).
MHA_API MHA_NODISCARD mha_status mha_forward_workspace_size(size_t *bytes, const mha_module *m,
                                                            const mha_forward_args *a);

// Runs the forward. attn_output: a float view of the shape above (any
// strides), overwritten. attn_weights: NULL, or (when need_weights) a
// float view of the weights' shape, overwritten. Outputs must not overlap
// inputs. Scratch memory: one block, taken from one of the calling
// thread's kept blocks when that fits (at most twice the need), else
// allocated; on return a block of 1 MiB or more is kept for the thread's
// next mha_forward, mha_backward, mha_sdpa or mha_sdpa_backward (two per
// thread, the older one replaced: training's forward and backward each
// keep theirs; freed when the thread exits or by mha_release_scratch), so
// that repeated calls do not fault in and zero fresh pages each time (B 8,
// L 512, E 768: 20 of 110 ms). With args.workspace it never allocates.
MHA_API MHA_NODISCARD mha_status mha_forward(mha_tensor *attn_output, mha_tensor *attn_weights,
                                             const mha_module *m, const mha_forward_args *a);

// Frees the calling thread's kept scratch blocks (see mha_forward), if any.
MHA_API void mha_release_scratch(void);


// ---------------------------------------------------------------------------
// Backward
//
// Gradients of the forward run with the same module m and the same args a
// (masks, causal, training, dropout seed and offset: the dropout masks are
// regenerated, never stored). need_weights is ignored: only attn_output is
// differentiated.
//   grad_output: a float view, the shape of attn_output (any strides).
//   grad_query, grad_key, grad_value: NULL (not wanted) or float views
//     shaped as query, key, value. If key and value are the query itself
//     (self-attention), each still receives its own part: the input's
//     gradient is their sum.
//   grads: NULL (no parameter gradients) or a module of the same
//     configuration as m (e.g. mha_module_create(&g, mha_module_config(m)));
//     parameter i of grads receives d loss / d parameter i of m, under the
//     same names: in_proj_weight, in_proj_bias, out_proj.weight, ...
//     Its weight matrices may be stored as F32, BF16 or F16 whatever m's
//     weight_dtype: each gradient is summed in float32 (float64 on the
//     reference path) and rounded once into them (+=: onto the stored
//     value, widened).
//   accumulate: false: every output is overwritten (=); true: every output
//     is added to (+=), for gradient accumulation over micro-batches.
// Fully masked query rows get gradient 0 through the attention (their
// output is out_proj.bias, which still receives their gradient).
// Scratch: one block, kept for the thread's next call as mha_forward's.
MHA_API MHA_NODISCARD mha_status mha_backward(mha_tensor *grad_query, mha_tensor *grad_key,
                                              mha_tensor *grad_value, mha_module *grads,
                                              const mha_module *m, const mha_forward_args *a,
                                              const mha_tensor *grad_output, bool accumulate);

// ---------------------------------------------------------------------------
// Random numbers: Philox4x32-10 (Salmon et al., "Parallel random numbers:
// as easy as 1, 2, 3", SC 2011), the counter-based generator behind the
// dropout masks. out = philox(ctr, key), as Random123's philox4x32(ctr, key)
// with 10 rounds.
MHA_API void mha_philox4x32_10(uint32_t out[4], const uint32_t ctr[4], const uint32_t key[2]);

// ---------------------------------------------------------------------------
// Optimizers (PyTorch's torch.optim semantics)
//
// The caller owns parameters and gradients; the optimizer keeps its state
// (momentum buffer, Adam moments) for each registered tensor.

typedef enum mha_optim_kind {
    MHA_OPTIM_SGD = 0,  // SGD with momentum, dampening, nesterov, L2 decay
    MHA_OPTIM_ADAMW,    // AdamW: decoupled weight decay
} mha_optim_kind;

// Each kind ignores (and does not check) the other kind's fields.
typedef struct mha_optim_config {
    mha_optim_kind kind;
    double lr;            // SGD: 0.01; AdamW: 1e-3
    double weight_decay;  // SGD: 0 (added to the gradient); AdamW: 0.01
    double momentum;      // SGD: 0
    double dampening;     // SGD: 0
    bool nesterov;        // SGD: false (needs momentum > 0, dampening 0)
    double beta1, beta2;  // AdamW: 0.9, 0.999
    double eps;           // AdamW: 1e-8
} mha_optim_config;

// Defaults as above for the given kind.
MHA_API void mha_optim_config_init(mha_optim_config *c, mha_optim_kind kind);

typedef struct mha_optim mha_optim;

MHA_API MHA_NODISCARD mha_status mha_optim_create(mha_optim **out, const mha_optim_config *c);
MHA_API void mha_optim_destroy(mha_optim *o);
// Registers n floats of parameter and their gradient (caller memory, which
// must outlive the optimizer). Allocates the tensor's state. n == 0 is
// allowed; a parameter overlapping its gradient or any tensor already
// registered is MHA_ERR_INVALID_ARG. AdamW counts steps per tensor (a
// tensor added later starts at step 1, as in torch). An optimizer is not
// to be used from two threads at once.
MHA_API MHA_NODISCARD mha_status mha_optim_add(mha_optim *o, float *param, float *grad,
                                               int64_t n);
// Registers every parameter of m with the same-named one of grads.
MHA_API MHA_NODISCARD mha_status mha_optim_add_module(mha_optim *o, mha_module *m,
                                                      mha_module *grads);
MHA_API MHA_NODISCARD mha_status mha_optim_set_lr(mha_optim *o, double lr);
// One update of every registered parameter from its gradient.
MHA_API MHA_NODISCARD mha_status mha_optim_step(mha_optim *o);
// Sets every registered gradient to 0.
MHA_API void mha_optim_zero_grad(mha_optim *o);
// Clipping by global norm, as torch.nn.utils.clip_grad_norm_: the L2 norm
// of all registered gradients together (computed in double); every
// gradient is scaled by c = max_norm / (norm + 1e-6) when c < 1. A
// non-finite norm is returned as it is and nothing is scaled. max_norm must
// be >= 0 (+inf allowed). *total_norm (may be NULL) gets the norm before
// clipping.
MHA_API MHA_NODISCARD mha_status mha_optim_clip_grad_norm(mha_optim *o, double max_norm,
                                                          double *total_norm);

// ---------------------------------------------------------------------------
// Dense layers: nn.Linear's forward, y = x W^T + b
//
// A weight W (O, I) and an optional bias b (O) packed once, at create, into
// the layout of the GEMM that computes the module's projections, then
// applied to the rows of any number of inputs:
//   y[..., o] = sum_i x[..., i] W[o, i] + b[o]
// Numerics: float32 products and sums in the order of the fused path's
// projections (per output element, a chain of fused multiply-adds over
// i = 0, 1, ... in chunks of 256 added in order (AVX2, AVX-512), or one
// chain of rounded products and sums (scalar, MHA_ISA=scalar); then + b[o]):
// the same bits as the fused projections of a module holding the same
// weight and bias (e.g. out_proj), whatever the number of threads, the
// number of rows in a call or a row's place among them. ISAs may differ in
// the last bits. BF16/F16 weights are widened to float32 exactly. Against
// a float64 x W^T + b the error is float32's: within the tests' rule
// max(4 x a naive float32 dot product's error, 4e-6 (1 + max|y|)) (tests/test_dense.c).
typedef struct mha_linear mha_linear;

// weight (O, I): MHA_F32, MHA_BF16 or MHA_F16, any strides; bias (O):
// NULL (none) or MHA_F32, MHA_BF16 or MHA_F16, any stride. O or I may be 0
// (then y = b, or y is empty). Both are copied (packed; a half bias
// widened): the caller's memory is not read after the call. Errors:
// MHA_ERR_INVALID_ARG (out or weight NULL, data NULL), MHA_ERR_UNSUPPORTED
// (another dtype, e.g. F64), MHA_ERR_SHAPE (weight not 2-D, bias not (O)),
// MHA_ERR_OVERFLOW (the packed size), MHA_ERR_NOMEM; *out is NULL then.
// Threads: packs with OpenMP threads.
MHA_API MHA_NODISCARD mha_status mha_linear_create(mha_linear **out, const mha_tensor *weight,
                                                   const mha_tensor *bias);
// y (..., O) = x (..., I) W^T + b over every leading index (x of 1 to
// MHA_MAX_DIMS dims: (I) is one row; y the same leading dims), overwriting
// y. x and y MHA_F32; any strides: x's rows are read in place when they are
// evenly spaced with unit feature stride (else gathered first), y's
// written in place likewise (else staged and scattered, row by row in
// order). y must not overlap x, nor itself through a stride of 0. Errors:
// MHA_ERR_INVALID_ARG (a NULL argument or data, y overlapping x or
// itself), MHA_ERR_UNSUPPORTED (a dtype other than F32), MHA_ERR_SHAPE (x's
// last dim not I, y's shape not x's with O last), MHA_ERR_OVERFLOW,
// MHA_ERR_NOMEM (the scratch); y is then unchanged. Memory: allocates
// per-call scratch (the GEMM's packing buffers, and the gathered or staged
// rows) and frees it. Threads: OpenMP inside (the bits do not depend on
// their number); the layer is never written after create, so any number of
// threads may run forwards on one layer at once.
MHA_API MHA_NODISCARD mha_status mha_linear_forward(const mha_linear *l, mha_tensor *y,
                                                    const mha_tensor *x);
// Frees the layer (NULL: nothing).
MHA_API void mha_linear_destroy(mha_linear *l);

// ---------------------------------------------------------------------------
// Scaled dot-product attention on projected tensors
//
//   out = softmax(scale * q k^T + mask) v, per (b, h)
//   q (B, H, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv), out (B, H, L, Dv),
//   Hkv dividing H: grouped-query attention (Hkv = 1: multi-query), query
//   head h reading KV head h / (H / Hkv), as PyTorch (enable_gqa),
//   FlashAttention and ggml do;
//   weights (B, H, L, S) optional; all 4-D MHA_F32/F64/BF16/F16 views (each
//   its own), any strides.
//   attn_mask: NULL or a view of up to 4 dims, broadcast to (B, H, L, S)
//     as PyTorch broadcasts (right-aligned; a dim of size 1 or stride 0
//     broadcasts). MHA_BOOL/MHA_U8 nonzero = not allowed; MHA_F32 added.
//   key_padding_mask: NULL or (B, S); MHA_BOOL/MHA_U8 nonzero = ignore,
//     MHA_F32 added.
//   opts (mha_attn_opts): every option but sink_tokens, as described there;
//   opts.is_causal hides keys j > i (top-left aligned, as PyTorch);
//   opts.scale 0 (the default) is 1 / sqrt(D).
//   opts.dropout_p: p in [0, 1) (else MHA_ERR_INVALID_ARG naming it), default
//     0: dropout on the attention weights after the softmax, before v,
//     applied whenever p > 0 (sdpa is functional: no training flag, as
//     torch's scaled_dot_product_attention(dropout_p=...)). Weight
//     (b, h, i, j) of (B, H, L, S), h the query head, is kept (and scaled
//     by 1/(1-p)) as the module's attention dropout decides: with
//     idx = ((b H + h) L + i) S + j, r = word idx % 4 of
//     mha_philox4x32_10(ctr {lo, hi of idx / 4, lo, hi of dropout_offset},
//     key {lo, hi of dropout_seed}), kept iff (r >> 8) * 2^-24 >= p. The
//     mask is never stored: mha_sdpa_backward with the same args
//     regenerates it. weights (when asked) are the weights after dropout,
//     as the module returns them. The fused path and the reference keep the
//     same elements, for any number of threads.
// The fully-masked-row rule holds. impl: auto runs the fused path when q,
// k, v, out (and weights) are MHA_F32, MHA_BF16 or MHA_F16 with unit stride
// along the last dim, else the reference (F64 views; MHA_IMPL in the
// environment overrides auto); fused on other views is
// MHA_ERR_UNSUPPORTED. bf16 q, k and v compute in bf16 where the CPU
// multiplies bf16 faster than float32 (mha_isa() "amx": AMX tiles;
// "avx512bf16": vdpbf16ps on AMD Zen 4 and later;
// mha_last_impl() then ends in " bf16"), as PyTorch's CPU flash attention
// and FlashAttention do:
// S = scale (q k^T) and O += P v with bf16 operands and float32 sums, the
// softmax in float32, P rounded to bf16 (relative 2^-9) for P v; so the
// output's error against float64 on the same values is within 2^-8
// max|v| plus its own rounding. Other half views (and bf16 on CPUs
// without a bf16 unit) compute in float32: their rows are converted
// exactly as the tiles load them (no float32 copy of a tensor) and a half
// out is the float32 result rounded once (nearest even), so its error is
// half an ulp of its type plus the float32 path's. The backward of bf16
// q, k, v and dout computes in bf16 likewise (mha_sdpa_backward), other
// views in float32 on the converted rows. mha_last_impl() says which ran.
typedef struct mha_sdpa_args {
    const mha_tensor *q;
    const mha_tensor *k;
    const mha_tensor *v;
    const mha_tensor *attn_mask;
    const mha_tensor *key_padding_mask;
    // Every option but sink_tokens (a cache's): causal, windows, scale,
    // soft cap, ALiBi (slopes per query head), sinks (per query head),
    // dropout.
    mha_attn_opts opts;
    mha_impl impl;
    // Training: NULL (default), or a state object (mha_saved_create) the
    // fused mha_sdpa fills with the output and each query row's softmax
    // statistics in float32 (B H L (Dv + 2) floats, grown when needed), so
    // that mha_sdpa_backward with the same args (the same views, masks,
    // options) takes them instead of computing the forward's rows again:
    // the same bits, about a quarter less work. The reference path keeps
    // nothing (its backward recomputes); a state another call filled is
    // refused by the backward (MHA_ERR_INVALID_ARG), one whose forward
    // computed in the other precision (bf16 q, k, v with a float32 dout) is
    // passed over.
    mha_saved *save;
} mha_sdpa_args;

MHA_API void mha_sdpa_args_init(mha_sdpa_args *a);
MHA_API MHA_NODISCARD mha_status mha_sdpa(mha_tensor *out, mha_tensor *weights,
                                          const mha_sdpa_args *a);

// Backward of mha_sdpa with the same args a: from dout (B, H, L, Dv), the
// gradient of out, writes (overwrites) dq (B, H, L, D), dk (B, Hkv, S, D)
// and dv (B, Hkv, S, Dv); all three are required, float views of any
// strides. Grouped-query: KV head g's dk, dv sum its query heads' terms in
// increasing head order. Fully masked rows get zero gradients. Every option
// of mha_sdpa applies (masks, causal, windows, scale, GQA, dropout: the
// same keep mask, regenerated from dropout_seed and dropout_offset, so the
// gradients are those of the forward with that mask). impl: auto runs
// the fused path (FlashAttention-2's backward, the forward's rows taken
// from args.save or recomputed) when q, k, v, dout, dq, dk, dv are
// MHA_F32, MHA_BF16 or MHA_F16 (each its own) with unit stride along the
// last dim, else the reference (in double); MHA_IMPL overrides. Half tensors compute in
// float32 (rows converted as they load), bf16 q, k, v and dout in bf16
// where the CPU computes bf16 (bf16 products, float32 sums); each gradient
// is summed in float32 and rounded once into its tensor.
// dsinks: NULL (not wanted), or H floats (one per query head) that
// receive (overwritten) the gradient of opts.sinks, which must then be
// given (else MHA_ERR_INVALID_ARG naming both). A sink is one more logit
// of each row's softmax whose value is 0, so
//   dsinks[h] = -sum_{b, i} P_sink(b, h, i) Dsum(b, h, i),
//   P_sink = exp(sinks[h] - m_i) / l_i (m, l: the row's max and sum, the
//   sink included), Dsum_i = rowsum(dout_i * out_i) = sum_j P_ij dP_ij,
// summed in double per (b, h) over the rows, then over b in increasing
// order, and rounded once (both paths; float32 row stats on the fused one).
// Every gradient element is summed by one thread in a fixed order: the
// same bits for any number of threads. Scratch: one block, kept for the
// thread's next call as mha_forward's.
MHA_API MHA_NODISCARD mha_status mha_sdpa_backward(mha_tensor *dq, mha_tensor *dk,
                                                   mha_tensor *dv, float *dsinks,
                                                   const mha_tensor *dout,
                                                   const mha_sdpa_args *a);

MHA_API void mha_rope_init(mha_rope *r, mha_rope_mode mode);
// "neox" / "interleaved" / "none" -> mode (MHA_ERR_UNSUPPORTED otherwise).
MHA_API MHA_NODISCARD mha_status mha_rope_mode_from_name(mha_rope_mode *mode, const char *name);
// Rotates x (B, H, T, D), a float32 or float64 view (any strides), in
// place: element (b, h, t) has position start[b] + t (start NULL: t) or,
// when positions is not NULL, positions[b T + t] (>= 0; start is then
// ignored), with a scaling s (NULL: none). inverse: rotate by -angle (the
// gradient of the forward rotation, which is orthogonal). The frequencies are mha_rope_frequencies' for seq (dynamic NTK:
// the call's largest position + 1; 0: the largest position of x's tokens
// + 1), cos and sin multiplied by the attention factor (YaRN); inverse
// applies the transpose, factor R(-angle) (the gradient of the forward).
// A scaling of type other than NONE with mode MHA_ROPE_NONE is refused.
MHA_API MHA_NODISCARD mha_status mha_rope_apply(mha_tensor *x, const mha_rope *r,
                                                const struct mha_rope_scaling *s,
                                                const int64_t *start, const int64_t *positions,
                                                int64_t seq, bool inverse);

// ---------------------------------------------------------------------------
// Variable-length batches without padding (FlashAttention's cu_seqlens)
//
// The sequences of a batch packed one after another: q (Tq, H, D),
// k (Tk, Hkv, D), v (Tk, Hkv, Dv), out (Tq, H, Dv) (F32, BF16 or F16,
// each its own, unit stride along the head dim; half views as mha_sdpa's:
// bf16 q, k, v compute in bf16 where the CPU does, other half rows are
// converted as they load, a half out is rounded once; Hkv dividing H:
// grouped-query). Sequence b owns query
// rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) and key rows
// [cu_seqlens_k[b], cu_seqlens_k[b + 1]) (num_seqs + 1 offsets each,
// starting at 0 and ending at Tq / Tk) and attends within itself only; no
// work is spent on padding. is_causal and windows align each sequence's
// query i with its key i (top-left, as mha_sdpa). Fused path only.
typedef struct mha_varlen_args {
    const int64_t *cu_seqlens_q;
    const int64_t *cu_seqlens_k;
    int64_t num_seqs;
    // causal, windows, scale, soft cap, ALiBi, sinks; dropout and
    // sink_tokens are refused
    mha_attn_opts opts;
} mha_varlen_args;

MHA_API void mha_varlen_args_init(mha_varlen_args *a);
MHA_API MHA_NODISCARD mha_status mha_sdpa_varlen(mha_tensor *out, const mha_tensor *q,
                                                 const mha_tensor *k, const mha_tensor *v,
                                                 const mha_varlen_args *a);

// ---------------------------------------------------------------------------
// KV cache for incremental decoding (one per layer)
//
// Holds the projected (and rotated) keys and values of B sequences, per KV
// head: K (B, Hkv, capacity, D), V (B, Hkv, capacity, Dv), float32; each
// sequence b has its own length. Append the new tokens' K and V, then
// attend the new queries (one token, or a chunk: chunked prefill) to
// everything cached: the T_b queries of sequence b are its last T_b
// positions, len_b - T_b + t, and see keys j <= that position (causal
// within the chunk) and within the window if one is set. Appending past the
// capacity fails (MHA_ERR_INVALID_ARG naming the lengths) and changes
// nothing; truncate rolls a sequence back (speculative decoding).
// Decoding (at most 16 queries) splits the keys into fixed chunks (256 KiB
// of key rows: 512 to 8192 rows, by the storage type and head dim) spread
// over the threads and combines them in chunk order: the same bits for any
// number of threads.
typedef struct mha_kv_cache mha_kv_cache;

// Storage of the cached K and V: float32, bfloat16 or float16 (rounded to
// nearest even on append), int8 with one float scale per (sequence, head,
// token) row (symmetric: max|row| / 127), or int4 with one float scale per
// group of 32 elements of a row. Attention computes in float32: decode
// converts the rows in registers as it reads them, a longer chunk of
// queries (prefill) dequantises the rows once per chunk. The error against
// a float32 cache, tested: max|out - out_f32| <= 4 u (1 + max|s|) max|v|
// with u = 2^-8 (bf16), 2^-11 (f16), 1/127 (int8), s the scaled scores.
//
// int8 decode (head dim <= 8192), and int4 decode where the head dim is a
// multiple of 128, score in integers: each scaled query x =
// q / sqrt(D) (or the custom scale) is rounded once to int8 with one scale,
// s_x = max_c |x_c| / 127, x^_c = s_x round_even(x_c / s_x) (a query holding
// a NaN or an infinity scores NaN), and a key row's score is s_x s^K_j
// times the exact integer dot product of the two rows (int4: s_x times the
// sum over the groups in order of s^K_jg times the group's exact integer
// dot product; VNNI's vpdpbusd where the CPU has it; the same bits on
// every instruction set). On top of K's and V's rounding, the query's
// moves each score by at most
//   e_j = (s_x / 2) sum_c |k^_jc|   (k^ the stored key row)
// so the output by at most (exp(2 max_j e_j) - 1) max_j |v_jc| per
// element (tested, from the data). Prefill computes with the float32 query.
//
// int4: each row of n elements is cut into groups of 32 along the head dim
// (the last one shorter when 32 does not divide n); group g has the scale
// s_g = max|x_c| / 7 over its elements (1 if all are 0) and each element
// q_c = clamp(round(x_c / s_g), -7, 7) (a NaN element stores 0; a group
// holding an infinity reads back as NaN), 4-bit two's complement, two per
// byte: element 2i in the low nibble of byte i, 2i + 1 in the high one. A
// row takes ceil(n / 2) bytes (n odd: the last high nibble is unused, 0)
// and ceil(n / 32) scales. It reads back as x^_c = s_g q_c, so per element
//   |x_c - x^_c| <= s_g / 2 = max|group| / 14
// (up to float32 rounding: a relative 2^-21 of s_g). For an output of
// query x (scaled: x = q / sqrt(D)) over the visible keys j, with K's
// group scales s^K_jg and V's s^V_jg, this gives (tested, from the data):
//   |s^_j - s_j| <= e_j = sum_g (s^K_jg / 2) sum_{c in g} |x_c|
//   |out^_c - out_c| <= max_j s^V_j,g(c) / 2 + (exp(2 max_j e_j) - 1) max_j |v_jc|
// (the first term V's rounding, the second the softmax's relative change
// under scores moved by at most max_j e_j), plus float32 rounding: 4e-6 (1 + |out_c|)
// per element in the tests.
typedef enum mha_kv_dtype {
    MHA_KV_F32 = 0,
    MHA_KV_BF16 = 1,
    MHA_KV_F16 = 2,
    MHA_KV_INT8 = 3,
    MHA_KV_INT4 = 4
} mha_kv_dtype;

// "f32" / "bf16" / "f16" / "int8" / "int4" -> type (MHA_ERR_UNSUPPORTED otherwise),
// and back.
MHA_API MHA_NODISCARD mha_status mha_kv_dtype_from_name(mha_kv_dtype *dtype, const char *name);
MHA_API const char *mha_kv_dtype_name(mha_kv_dtype dtype);
// A cache of batch sequences, num_kv_heads heads of head_dim (K) and
// v_head_dim (V) elements, capacity tokens each, stored as dtype.
MHA_API MHA_NODISCARD mha_status mha_kv_cache_create(mha_kv_cache **out, int64_t batch,
                                                     int64_t num_kv_heads, int64_t head_dim,
                                                     int64_t v_head_dim, int64_t capacity,
                                                     mha_kv_dtype dtype);
// Bytes of K, V (and int8 / int4 scales) the cache holds at capacity.
MHA_API size_t mha_kv_cache_bytes(const mha_kv_cache *c);
MHA_API void mha_kv_cache_destroy(mha_kv_cache *c);
// Length of sequence b (-1 if b is out of range).
MHA_API int64_t mha_kv_cache_length(const mha_kv_cache *c, int64_t b);
MHA_API int64_t mha_kv_cache_capacity(const mha_kv_cache *c);
// Appends k (B, Hkv, T, D) and v (B, Hkv, T, Dv) (float32/float64 views,
// any strides): counts[b] tokens of sequence b (the first counts[b] of T;
// counts NULL: T each).
MHA_API MHA_NODISCARD mha_status mha_kv_cache_append(mha_kv_cache *c, const mha_tensor *k,
                                                     const mha_tensor *v,
                                                     const int64_t *counts);
// Sets sequence b's length to length (<= its current length); b = -1: all.
MHA_API MHA_NODISCARD mha_status mha_kv_cache_truncate(mha_kv_cache *c, int64_t b,
                                                       int64_t length);

typedef struct mha_cache_attend_args {
    // windows, scale, soft cap, ALiBi, sinks, StreamingLLM sink tokens
    // (causal by construction; dropout is refused)
    mha_attn_opts opts;
    // StreamingLLM with RoPE: the queries that score the sink tokens (each
    // query rotated at its position - delta, see mha_attn_opts.sink_tokens),
    // (B, H, T, D) as q; NULL: q itself.
    const mha_tensor *sink_q;
} mha_cache_attend_args;

MHA_API void mha_cache_attend_args_init(mha_cache_attend_args *a);
// out (B, H, T, Dv) = attention of q (B, H, T, D) (float32 views with unit
// stride along D; H a multiple of the cache's Hkv) over the cache: for
// sequence b, queries t < counts[b] (NULL: T) at positions
// len_b - counts[b] + t; rows t >= counts[b] get 0.
MHA_API MHA_NODISCARD mha_status mha_kv_cache_attend(mha_tensor *out, const mha_tensor *q,
                                                     const mha_kv_cache *c,
                                                     const mha_cache_attend_args *a,
                                                     const int64_t *counts);

// ---------------------------------------------------------------------------
// Paged KV cache (serving many sequences): a pool of num_blocks blocks of
// block_size tokens (K and V of every KV head, in the storage type; int8
// with one scale per row, int4 one per group of 32 of a row: see
// mha_kv_dtype; each row's scales kept after its elements, rounded up to 4
// bytes, so that a KV head's part of a block is one run of memory;
// mha_paged_cache_block_bytes counts that padding), per-sequence block
// tables, blocks shared by reference count. A fork shares its source's
// blocks; the first write into a shared block copies it (copy on write). A
// sequence's attention gives the bits of a contiguous cache (mha_kv_cache)
// holding the same tokens.
// Placement: a sequence's next block is the one after its last when that
// is free, else the middle of the longest run of free blocks (decode reads
// blocks that follow each other in memory in one pass).
// Every call checks and allocates all it needs first: a failed call
// (an exhausted pool included) changes nothing. Concurrency: attends may
// run at the same time; a call that changes the cache (add, fork, free,
// truncate, append) while another call uses it fails with
// MHA_ERR_INVALID_ARG and changes nothing. Sequence ids are opaque (a
// freed id stays unknown even when its slot is reused).
typedef struct mha_paged_cache mha_paged_cache;

// How the pool lays its blocks out (the results are the same bits either
// way; only the speed differs):
// - MHA_PAGED_HEAD_MAJOR (mha_paged_cache_create): a KV head's blocks side
//   by side, so a sequence's blocks taken in order are one stream per head
//   read in long passes. A block scattered in the pool is a small piece per
//   head (2-4 KiB at 16 tokens, d 64), and memory read in random pieces
//   that small runs at about 70-75% of its streaming speed.
// - MHA_PAGED_BLOCK_MAJOR: a block's KV heads side by side; decode reads a
//   sequence's heads together, block by block, so a block is one run of
//   memory (48 KiB of K at f32, 12 heads of 64, 16 tokens) wherever it
//   lies. For pools whose blocks end up scattered (a busy server's); its
//   shorter kernel calls cost a few percent where the blocks lie in order
//   (README: the decode table).
typedef enum mha_paged_layout {
    MHA_PAGED_HEAD_MAJOR = 0,
    MHA_PAGED_BLOCK_MAJOR = 1,
} mha_paged_layout;

// A pool of num_blocks blocks of block_size tokens, num_kv_heads heads of
// head_dim (K) and v_head_dim (V) elements, stored as dtype, laid out as
// layout (MHA_PAGED_HEAD_MAJOR unless the blocks end up scattered).
MHA_API MHA_NODISCARD mha_status mha_paged_cache_create(mha_paged_cache **out,
                                                        int64_t num_blocks, int64_t block_size,
                                                        int64_t num_kv_heads, int64_t head_dim,
                                                        int64_t v_head_dim, mha_kv_dtype dtype,
                                                        mha_paged_layout layout);
// The layout's name ("head-major", "block-major"; NULL: not a layout) and
// back (MHA_ERR_INVALID_ARG naming the name).
MHA_API const char *mha_paged_layout_name(mha_paged_layout layout);
MHA_API MHA_NODISCARD mha_status mha_paged_layout_from_name(mha_paged_layout *layout,
                                                            const char *name);
MHA_API void mha_paged_cache_destroy(mha_paged_cache *c);
// A new, empty sequence: its id.
MHA_API MHA_NODISCARD mha_status mha_paged_cache_add(mha_paged_cache *c, int64_t *id);
// A new sequence holding src's tokens (its blocks shared, none copied).
MHA_API MHA_NODISCARD mha_status mha_paged_cache_fork(mha_paged_cache *c, int64_t src,
                                                      int64_t *id);
// Frees sequence id (the blocks no other sequence holds return to the pool).
MHA_API MHA_NODISCARD mha_status mha_paged_cache_free(mha_paged_cache *c, int64_t id);
// Cuts sequence id back to length tokens (<= its length; rollback).
MHA_API MHA_NODISCARD mha_status mha_paged_cache_truncate(mha_paged_cache *c, int64_t id,
                                                          int64_t length);
// Bounded memory for a sliding window: frees sequence id's blocks that lie
// wholly within [ceil(keep / block_size) * block_size, pos) (none when that
// is empty): the tokens its window can no longer reach, keeping the blocks
// that hold the first keep tokens (StreamingLLM's sinks,
// mha_attn_opts.sink_tokens; 0: none kept). Its length and positions stay.
// The kept start must be the same in every call that frees blocks of a
// sequence (MHA_ERR_INVALID_ARG otherwise). An attend whose window or sinks
// would reach a released token fails (MHA_ERR_INVALID_ARG, naming the first
// kept token), and so does a truncation into the released tokens (other
// than to 0).
MHA_API MHA_NODISCARD mha_status mha_paged_cache_release(mha_paged_cache *c, int64_t id,
                                                         int64_t keep, int64_t pos);
// Tokens of sequence id (-1: no such sequence).
MHA_API int64_t mha_paged_cache_length(const mha_paged_cache *c, int64_t id);
// Blocks held by some sequence / free; bytes of one block.
MHA_API int64_t mha_paged_cache_blocks_in_use(const mha_paged_cache *c);
MHA_API int64_t mha_paged_cache_blocks_free(const mha_paged_cache *c);
MHA_API size_t mha_paged_cache_block_bytes(const mha_paged_cache *c);
// The pool's layout (MHA_PAGED_HEAD_MAJOR for a NULL cache).
MHA_API mha_paged_layout mha_paged_cache_layout(const mha_paged_cache *c);
// Appends k (n, Hkv, T, D) and v (n, Hkv, T, Dv) (float32/float64 views,
// any strides): counts[i] tokens (the first of T; NULL: T) to sequence
// ids[i], the n ids distinct. All or nothing: an exhausted pool fails with
// MHA_ERR_NOMEM naming the blocks needed and free.
// Prefix sharing: tokens NULL, or the new tokens' ids
// (tokens[i*T + t], the first counts[i] of row i): every block it fills
// whose tokens' ids are all known joins the cache's prefix index, keyed by
// its whole prefix. mha_paged_cache_add_prompt starts a new sequence for a
// prompt of n token ids with the longest run of indexed blocks holding the
// same first tokens (shared, not copied; at most n - 1 tokens, so that the
// last is left to compute): *cached tokens, whose K and V need not be
// computed again; append the others. The block holding the last token is
// shared too when it is indexed: appended with their ids, tokens that a
// shared, indexed last block holds already (after the same prefix) keep its
// rows (the given K and V are not written, and the block is not copied). A
// block leaves the index when no sequence holds it or its holder rewrites it.
MHA_API MHA_NODISCARD mha_status mha_paged_cache_append(
    mha_paged_cache *c, int64_t n, const int64_t *ids, const int64_t *counts,
    const mha_tensor *k, const mha_tensor *v, const int32_t *tokens);
MHA_API MHA_NODISCARD mha_status mha_paged_cache_add_prompt(mha_paged_cache *c,
                                                            const int32_t *tokens, int64_t n,
                                                            int64_t *id, int64_t *cached);
// As mha_kv_cache_attend, entry i of q (n, H, T, D) and out (n, H, T, Dv)
// being sequence ids[i]: queries t < counts[i] at positions
// length - counts[i] + t, causal over that sequence's tokens.
MHA_API MHA_NODISCARD mha_status mha_paged_cache_attend(mha_tensor *out, const mha_tensor *q,
                                                        mha_paged_cache *c, int64_t n,
                                                        const int64_t *ids,
                                                        const int64_t *counts,
                                                        const mha_cache_attend_args *a);

// The module's causal self-attention over the T new tokens of a->query
// ((T, N, E), or (N, T, E) with batch_first; float32), through the cache:
// project q, k, v; rotate q and k (a->rope, a->rope_scaling) at positions
// len_n + t (the cache's lengths before the call, rope_start ignored), or
// a->rope_positions (N T, the new tokens'); append k, v; attend
// to everything cached (a->opts' ALiBi, soft cap and windows apply); project
// the context into out (the query's shape). Running a sequence chunk by
// chunk (or token by token) gives the full causal forward's result (within
// float rounding). The cache needs batch N, the module's num_kv_heads,
// head dims the module's head_dim (a->opts.scale applies).
// Not available: masks, need_weights, dropout, add_bias_kv,
// add_zero_attn, kdim/vdim != E (MHA_ERR_UNSUPPORTED). On any error (out
// of memory included) the cache keeps the lengths it had.
MHA_API MHA_NODISCARD mha_status mha_forward_cached(mha_tensor *out, const mha_module *m,
                                                    const mha_forward_args *a,
                                                    mha_kv_cache *cache);
// mha_forward_cached over a paged cache (continuous batching): entry n of
// the query's batch is sequence ids[n] (distinct) with its first counts[n]
// of the T new tokens (NULL: all T; mixing prefill chunks and decode steps
// in one call), each at its own positions (its cached length on). Output
// rows of the tokens past counts[n] are 0. The cache's num_kv_heads and
// head dims must be the module's. As mha_forward_cached otherwise: on any
// error (an exhausted pool included) every sequence keeps the length it
// had.
// tokens: NULL, or the new tokens' ids (tokens[n*T + t], as
// mha_paged_cache_append takes them): the blocks they fill join the
// prefix index, so that mha_paged_cache_add_prompt finds them.
MHA_API MHA_NODISCARD mha_status mha_forward_paged(mha_tensor *out, const mha_module *m,
                                                   const mha_forward_args *a,
                                                   mha_paged_cache *cache, const int64_t *ids,
                                                   const int64_t *counts,
                                                   const int32_t *tokens);

// ---------------------------------------------------------------------------
// Diagnostics: looking inside the heads
//
// mha_diag_create recomputes, from a module and forward arguments (masks,
// causal, windows, RoPE, ALiBi and soft cap as the forward applies them;
// eval mode), each head's attention rows in double, one query row at a
// time (memory O(S) per head: long sequences work, with max_rows
// subsampling), and reports per head:
//   entropy_mean / entropy_min  attention entropy in nats over the rows
//                               examined (uniform over S keys: ln S)
//   entropy_norm                mean of entropy / ln(visible keys) over rows
//                               with more than one visible key (1: uniform)
//   mean_distance               mean over rows of sum_j p_ij |i - j| (small:
//                               local head; ~S/3: global)
//   logit_max, logit_std        of the scaled logits scale q.k (1 / sqrt(d)
//                               or the custom scale) over the
//                               rows examined and every key, before soft
//                               cap, ALiBi and masks (the overflow check)
//   output_var_ratio            variance over rows of the head's context
//                               (its share of the concat), per feature,
//                               over the variance of its values: ~0 when the
//                               output hardly depends on the query
//   dead                        entropy_norm >= dead_entropy (near-uniform
//                               attention) or output_var_ratio <=
//                               dead_output (near-constant output)
//   rank_q/k/v/o                numerical rank of the head's W_Q rows
//                               [h d, (h+1) d), of its KV head's W_K and
//                               W_V rows, and of W_O's columns [h d,
//                               (h+1) d): singular values > rtol * max, rtol
//                               = rank_rtol, or (0) max(rows, cols) times
//                               the storage's epsilon (numpy's rule); -1
//                               when mha was built without LAPACKE (CMake
//                               MHA_LAPACKE=OFF, or lapacke not found):
//                               then there are no singular values at all
//                               (mha_diag_spectrum below), and
//                               every other number is computed as usual
// and, between every pair of heads, similarity = 1 - JS(p_h1, p_h2) / ln 2
// averaged over the rows (Jensen-Shannon divergence of the two heads'
// attention rows: 1 = identical, symmetric, in [0, 1]); and the first
// non-finite value met, in the order parameters, query, key, value,
// projected q, k, v, scaled logits, with its location.
typedef struct mha_diag_options {
    int64_t max_rows;     // query rows examined per batch element, spread
                          // evenly (row r * L / max_rows); 0: every row.
                          // Default 256
    double dead_entropy;  // default 0.98
    double dead_output;   // default 1e-4
    double rank_rtol;     // default 0: max(rows, cols) * epsilon
} mha_diag_options;

typedef struct mha_head_diag {
    int64_t head;
    int64_t rows;  // rows examined with at least one visible key
    double entropy_mean, entropy_min, entropy_norm, mean_distance;
    double logit_max, logit_std, output_var_ratio;
    bool dead;
    int64_t rank_q, rank_k, rank_v, rank_o;
    // The head is pruned (mha_module_prune_heads): the forward skips it;
    // the numbers above describe what it would compute. Its gate (when the
    // module has them): head_gate[h], or for dynamic gates the mean of
    // sigmoid(x W_g[h]^T + b_g[h]) over every query row; 1 without gates.
    bool pruned;
    double gate_mean;
} mha_head_diag;

typedef struct mha_diag mha_diag;

MHA_API void mha_diag_options_init(mha_diag_options *o);
// o NULL: defaults. The forward arguments are checked as mha_forward checks
// them (outputs are not needed); need_weights, trace, save, impl and
// training are ignored. Non-finite values are a finding, not an error.
MHA_API MHA_NODISCARD mha_status mha_diag_create(mha_diag **out, const mha_module *m,
                                                 const mha_forward_args *a,
                                                 const mha_diag_options *o);
MHA_API void mha_diag_destroy(mha_diag *d);
MHA_API int64_t mha_diag_num_heads(const mha_diag *d);
// Rows examined over the whole batch.
MHA_API int64_t mha_diag_rows(const mha_diag *d);
// NULL when h is out of range.
MHA_API const mha_head_diag *mha_diag_head(const mha_diag *d, int64_t h);
// NaN when out of range, or when no row had visible keys in both heads.
MHA_API double mha_diag_similarity(const mha_diag *d, int64_t h1, int64_t h2);
// Singular values (descending) of head h's 'q', 'k', 'v' or 'o' slice;
// *n of them (d; zeros past min(d, features)). NULL (and *n = 0) for a bad
// argument; and for every head when mha was built without LAPACKE (its
// ranks are -1), with mha_last_error() then saying "singular values
// unavailable: mha was built without LAPACKE".
MHA_API const double *mha_diag_spectrum(const mha_diag *d, int64_t h, char which, int64_t *n);
// The first non-finite value, e.g. "query[2, 1, 5] = nan", or NULL.
MHA_API const char *mha_diag_nonfinite(const mha_diag *d);

// ---------------------------------------------------------------------------
// safetensors files
//
// Format: 8-byte little-endian header length n, n bytes of JSON header
// {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]},
//  ..., "__metadata__": {"key": "value", ...}}, then the data buffer.
// Offsets are relative to the data buffer. The reader checks everything:
// header length within the file and at most MHA_ST_MAX_HEADER bytes, a JSON
// object, known dtypes, shape x dtype size == end - begin without overflow,
// offsets in bounds, tensors contiguous and non-overlapping and covering the
// buffer, no duplicate names, names valid UTF-8, __metadata__ a string map.

#define MHA_ST_MAX_HEADER (100u * 1024u * 1024u)

typedef struct mha_st_tensor {
    const char *name;  // owned by the file
    mha_dtype dtype;
    int ndim;
    int64_t shape[MHA_MAX_DIMS];
    int64_t numel;
    const void *data;  // little-endian bytes; may be unaligned
    size_t nbytes;
} mha_st_tensor;

// Reads and validates the whole file. Errors name the file.
MHA_API MHA_NODISCARD mha_status mha_st_open(mha_st_file **out, const char *path);
// Same from memory (copied); label names the source in errors.
MHA_API MHA_NODISCARD mha_status mha_st_parse(mha_st_file **out, const void *bytes, size_t len,
                                              const char *label);
MHA_API void mha_st_close(mha_st_file *f);
// The path (or label) the file was opened with ("" for NULL).
MHA_API const char *mha_st_label(const mha_st_file *f);

// Tensors in file order of their data offsets.
MHA_API int64_t mha_st_num_tensors(const mha_st_file *f);
MHA_API MHA_NODISCARD mha_status mha_st_tensor_at(mha_st_tensor *out, const mha_st_file *f,
                                                  int64_t i);
// MHA_ERR_NOT_FOUND (with a message naming file and tensor) if absent.
MHA_API MHA_NODISCARD mha_status mha_st_find(mha_st_tensor *out, const mha_st_file *f,
                                             const char *name);
// __metadata__ entries; mha_st_metadata returns NULL when key is absent.
MHA_API int64_t mha_st_num_metadata(const mha_st_file *f);
MHA_API MHA_NODISCARD mha_status mha_st_metadata_at(const char **key, const char **value,
                                                    const mha_st_file *f, int64_t i);
MHA_API const char *mha_st_metadata(const mha_st_file *f, const char *key);

// Converts a tensor's elements to dtype `to` into dst (contiguous,
// dst_bytes >= numel * mha_dtype_size(to)). Allowed: any -> MHA_F32 or
// MHA_F64 (bool/integers as numbers), a float dtype -> MHA_BF16/MHA_F16
// (through float32, nearest even), MHA_BOOL/MHA_U8 -> MHA_BOOL/MHA_U8
// (nonzero -> 1), identical dtypes.
MHA_API MHA_NODISCARD mha_status mha_st_read(void *dst, size_t dst_bytes, mha_dtype to,
                                             const mha_st_tensor *t);

typedef struct mha_st_writer mha_st_writer;

MHA_API MHA_NODISCARD mha_status mha_st_writer_create(mha_st_writer **out);
MHA_API void mha_st_writer_destroy(mha_st_writer *w);
// Copies the data (numel * dtype size bytes, contiguous, native floats
// written little-endian). Duplicate names are an error.
MHA_API MHA_NODISCARD mha_status mha_st_writer_add(mha_st_writer *w, const char *name,
                                                   mha_dtype dtype, int ndim,
                                                   const int64_t *shape, const void *data);
// Adds or replaces a __metadata__ entry.
MHA_API MHA_NODISCARD mha_status mha_st_writer_set_metadata(mha_st_writer *w, const char *key,
                                                            const char *value);
// Writes the file (tensors in the order added; header padded with spaces
// to a multiple of 8 bytes), atomically as mha_file_write does.
MHA_API MHA_NODISCARD mha_status mha_st_writer_save(const mha_st_writer *w, const char *path);

// Writes nbytes of data as the new contents of path, atomically: into a new
// temporary file ".<name>.tmp.<pid>.<n>" in path's directory (mode 0666
// less the umask), fsync'ed, renamed over path, then the directory
// fsync'ed. Every file the library and the CLI write goes this way
// (mha_st_writer_save, mha_module_save). On an error (MHA_ERR_IO, the
// message naming path and the OS error: no such directory, permission,
// path a directory, no space left, a failing fsync or rename) the temporary
// file is removed and the old file at path is unchanged. A process killed
// while writing leaves the old file (or none) at path and may leave its
// temporary file behind. A symbolic link at path is replaced by the new
// file; the file it pointed to is untouched.
MHA_API MHA_NODISCARD mha_status mha_file_write(const char *path, const void *data,
                                                size_t nbytes);

// ---------------------------------------------------------------------------
// Hugging Face checkpoints: the attention of one layer of a real model
//
// A checkpoint directory holds config.json and either model.safetensors or
// the shards listed by model.safetensors.index.json (its weight_map; every
// shard path must stay inside the directory: no "..", no absolute paths, no
// symlink leading out of it). Architectures (config.json "model_type"):
// bert, gpt2, llama, mistral, qwen2, qwen3, gemma2, gpt_oss. A layer's
// tensors are found under the architecture's own names, with or without
// the usual prefixes ("bert.", "model.", "transformer."), and every shape is
// checked against the config; F32, F16 and BF16 tensors load (converted to
// the module's weight_dtype; separate q/k/v matrices are packed, exactly,
// into in_proj_weight). Errors name the file and the tensor. Shards are
// read when first needed, so a checkpoint is not to be used from two
// threads at once.
typedef struct mha_checkpoint mha_checkpoint;

// Opens dir: reads and checks config.json and the index (or the single
// file), opening the shards. Nothing outside dir is read.
MHA_API MHA_NODISCARD mha_status mha_checkpoint_open(mha_checkpoint **out, const char *dir);
MHA_API void mha_checkpoint_close(mha_checkpoint *c);
// config.json's "model_type" ("bert", ...) and num_hidden_layers (or n_layer).
MHA_API const char *mha_checkpoint_model_type(const mha_checkpoint *c);
MHA_API int64_t mha_checkpoint_num_layers(const mha_checkpoint *c);
// A tensor by its full name in the checkpoint (any shard); MHA_ERR_NOT_FOUND
// naming it otherwise. The view stays valid until mha_checkpoint_close.
MHA_API MHA_NODISCARD mha_status mha_checkpoint_find(mha_st_tensor *out,
                                                     const mha_checkpoint *c, const char *name);
// A number of config.json by key ("hidden_size", "layer_norm_eps", ...):
// MHA_ERR_NOT_FOUND when absent, MHA_ERR_FORMAT when not a number.
MHA_API MHA_NODISCARD mha_status mha_checkpoint_config_number(double *out,
                                                              const mha_checkpoint *c,
                                                              const char *key);

// What a layer's attention does beyond its parameters, from the config:
// apply it to a call's arguments with mha_checkpoint_layer_apply.
typedef struct mha_checkpoint_layer {
    char model_type[32];
    int64_t layer;  // the index loaded
    // is_causal (decoders: true; bert: false); window_left: the sliding
    // window of this layer (Mistral's sliding_window, Gemma 2's and
    // GPT-OSS's layer_types): query i sees keys i - W < j <= i, i.e.
    // window_left = W - 1 (-1: none); softcap: attn_logit_softcapping;
    // scale: query_pre_attn_scalar, GPT-2's scale_attn_by_inverse_layer_idx,
    // ... (0: 1 / sqrt(head_dim)). The rest as mha_attn_opts_init.
    mha_attn_opts opts;
    mha_rope rope;                  // mode NONE for bert and gpt2
    mha_rope_scaling rope_scaling;  // type NONE when unscaled
} mha_checkpoint_layer;

// Loads layer `layer` (0-based) of an open checkpoint: the module (with
// the architecture's layout: head_dim, separate q/k/v, biases, QK-norm,
// sinks, GQA) and, when info is not NULL, its options. base may be NULL;
// from it only batch_first (NULL: true, transformers' (N, L, E)) and
// weight_dtype are taken.
MHA_API MHA_NODISCARD mha_status mha_checkpoint_load_layer(mha_module **out,
                                                           mha_checkpoint_layer *info,
                                                           const mha_checkpoint *c,
                                                           int64_t layer,
                                                           const mha_config *base);
// mha_checkpoint_open + mha_checkpoint_load_layer + close.
MHA_API MHA_NODISCARD mha_status mha_module_load_checkpoint(mha_module **out,
                                                            mha_checkpoint_layer *info,
                                                            const char *dir, int64_t layer,
                                                            const mha_config *base);
// Sets a's is_causal, window_left (window_right -1), rope, rope_scaling
// (pointing into info, which must outlive the call), softcap and scale
// from info; the rest of a is left as it is.
MHA_API void mha_checkpoint_layer_apply(const mha_checkpoint_layer *info, mha_forward_args *a);

#ifdef __cplusplus
}
#endif

#endif  // MHA_H
