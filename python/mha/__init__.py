"""mha: multi-head attention from libmha, for numpy (this module) and
PyTorch (mha.torch).

The same names and semantics as PyTorch:

    mha.MultiheadAttention(embed_dim, num_heads, ...)   # nn.MultiheadAttention
    mha.scaled_dot_product_attention(q, k, v, ...)       # F.scaled_dot_product_attention
    mha.KVCache(batch, num_kv_heads, head_dim, ...)      # incremental decoding
    mha.PagedKVCache(num_blocks, block_size, ...)        # serving: forks, continuous batching
    mha.diagnose(module, query, ...)                     # per-head diagnostics

Arrays of float32, float64, float16 (and bfloat16 through ml_dtypes) with
any strides go to the C library without a copy; outputs are new numpy
arrays in the query's dtype. float32 runs mha's fused kernels, float64 its
float64 reference (the oracle). Errors carry the library's message:
ValueError (shapes, values), TypeError (dtypes), MemoryError, OSError,
KeyError (a missing parameter name). The GIL is released while the library
computes, so threads sharing a module run in parallel.

Differences from PyTorch, by design: a query row whose keys are all masked
gets weights 0 and output out_proj.bias (PyTorch gives NaN in some paths);
weights are initialised by mha's seeded generator (same distributions, not
torch's random stream).
"""

import collections
import numbers
import os
import shutil
import subprocess
import tempfile
import types

import numpy as np

from . import _mha
from ._options import (BF16, F16, F32, F64, causal_hint, forward_kwargs, real, sdpa_kwargs,
                       sdpa_layout, numel)

__version__ = _mha.version
__all__ = ["MultiheadAttention", "scaled_dot_product_attention", "KVCache", "PagedKVCache",
           "diagnose",
           "save_tensors", "load_tensors", "isa", "from_pretrained", "CheckpointAttention",
           "__version__"]

try:  # numpy has no bfloat16; ml_dtypes (from jax) adds one
    import ml_dtypes as _ml_dtypes
    _BF16 = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - optional
    _BF16 = None

_NP_OF = {F32: np.float32, F64: np.float64, F16: np.float16, BF16: np.int16}


def isa():
    """The SIMD kernels in use: 'amx' (AVX-512 with AMX tiles for bf16),
    'avx512bf16' (AVX-512 computing bf16 with vdpbf16ps: AMD Zen 4 and
    later), 'avx512', 'avx2' or 'scalar' (mha_isa)."""
    return _mha.isa()


def release_scratch():
    """Frees the calling thread's kept scratch blocks: forward, backward and
    sdpa keep their last two (1 MiB or more) for the next calls instead of
    faulting in fresh pages each time (mha_release_scratch)."""
    _mha.release_scratch()


def last_impl():
    """What this thread's last successful forward, backward, sdpa or
    sdpa_backward ran: 'reference', or 'fused ' and the SIMD kernels
    ('fused avx512'), then ' bf16' where the products were bf16 ('fused
    avx512bf16 bf16'); '' before any (mha_last_impl)."""
    return _mha.last_impl()


# ---------------------------------------------------------------------------
# arrays in and out

def _alloc(shape, dt):
    return np.empty(shape, _NP_OF[dt])


def _result(a):
    """An output of the binding as the user sees it (bfloat16 stays bfloat16)."""
    if a is not None and a.dtype == np.int16 and _BF16 is not None:
        return a.view(_BF16)
    return a


def _arr(x, name):
    """x as something the binding takes without a copy: a numpy array, or
    (int16 view, BF16) for bfloat16."""
    if x is None:
        return None
    if not isinstance(x, np.ndarray):
        if isinstance(x, (bool, numbers.Number, str, bytes)) and not isinstance(x, np.generic):
            raise TypeError("%s: expected an array, got %s" % (name, type(x).__name__))
        x = np.asarray(x)
    if _BF16 is not None and x.dtype == _BF16:
        return (x.view(np.int16), BF16)
    return x


def _mask(x, name):
    """A mask as the binding takes it: bool, uint8, float32 or float64
    (float16 and bfloat16 masks are widened to float32)."""
    if x is None:
        return None
    x = _arr(x, name)
    if isinstance(x, tuple):
        return x[0].view(_BF16).astype(np.float32)
    if x.dtype == np.float16:
        return x.astype(np.float32)
    return x


def _int64(x, name="rope_start"):
    a = np.ascontiguousarray(x)
    if a.dtype.kind not in "iu":
        raise TypeError("%s: expected integers, got dtype %s" % (name, a.dtype))
    return a.astype(np.int64, copy=False)


def _float32(x, name="alibi slopes"):
    a = np.ascontiguousarray(x)
    if a.dtype.kind != "f":
        raise TypeError("%s: expected floats, got dtype %s" % (name, a.dtype))
    return a.astype(np.float32, copy=False)


# ---------------------------------------------------------------------------
# safetensors

def save_tensors(path, tensors, metadata=None):
    """Writes {name: array} as a safetensors file (mha's writer)."""
    items = [(str(k), np.ascontiguousarray(v)) for k, v in tensors.items()]
    _mha.save_tensors(os.fspath(path), items, {str(k): str(v) for k, v in (metadata or {}).items()})


def load_tensors(path):
    """({name: array}, metadata) of a safetensors file, every field checked
    by mha's reader."""
    items, meta = _mha.load_tensors(os.fspath(path))
    np_of = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "BF16": np.int16,
             "BOOL": np.bool_, "I64": np.int64, "I32": np.int32, "U8": np.uint8}
    out = collections.OrderedDict()
    for name, dt, shape, data in items:
        a = np.frombuffer(data, dtype=np.dtype(np_of[dt]).newbyteorder("<")).reshape(shape)
        a = a.astype(a.dtype.newbyteorder("="))
        out[name] = a.view(_BF16) if dt == "BF16" and _BF16 is not None else a
    return out, meta


class _hybridmethod:
    """A method that is a classmethod when called on the class and an
    instance method on an instance (load: a new module, or into this one)."""

    def __init__(self, fcls, finst):
        self.fcls, self.finst = fcls, finst

    def __get__(self, obj, cls):
        if obj is None:
            return types.MethodType(self.fcls, cls)
        return types.MethodType(self.finst, obj)


# ---------------------------------------------------------------------------
# the module

Gradients = collections.namedtuple("Gradients", "query key value params")


def _check_int(name, v, lo=1):
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError("%s must be an integer, got %r" % (name, v))
    if v < lo:
        raise ValueError("%s must be >= %d, got %d" % (name, lo, v))
    return int(v)


def _half_view(a, weight_dtype):
    """A parameter array of a module whose weight matrices are stored as
    weight_dtype: bf16 storage (uint16) viewed as ml_dtypes.bfloat16 where
    ml_dtypes is installed."""
    if weight_dtype == "bf16" and a.dtype == np.uint16 and _BF16 is not None:
        return a.view(_BF16)
    return a


class MultiheadAttention:
    """torch.nn.MultiheadAttention on numpy arrays (mha's C module behind it).

    MultiheadAttention(embed_dim, num_heads, dropout=0.0, bias=True,
        add_bias_kv=False, add_zero_attn=False, kdim=None, vdim=None,
        batch_first=False, num_kv_heads=None, *, weight_dtype="f32",
        head_gate=None, init="xavier_uniform", seed=0)

    Parameters live in the C module under PyTorch's names (state_dict);
    num_kv_heads < num_heads gives grouped-query attention; weight_dtype
    "bf16"/"f16" stores the weight matrices in half (backward gives their
    gradients in that dtype; the optimizers take float32 modules);
    head_gate "static"/"dynamic" adds per-head output gates. Like a torch
    module it starts in training mode (dropout active when dropout > 0):
    call eval() for inference.
    """

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False,
                 add_zero_attn=False, kdim=None, vdim=None, batch_first=False,
                 num_kv_heads=None, *, weight_dtype="f32", head_gate=None,
                 init="xavier_uniform", seed=0, _module=None):
        if _module is None:
            embed_dim = _check_int("embed_dim", embed_dim)
            num_heads = _check_int("num_heads", num_heads)
            kdim = 0 if kdim is None else _check_int("kdim", kdim)
            vdim = 0 if vdim is None else _check_int("vdim", vdim)
            hkv = 0 if num_kv_heads is None else _check_int("num_kv_heads", num_kv_heads)
            dropout = real("dropout", dropout)
            _module = _mha.Module(embed_dim, num_heads, kdim=kdim, vdim=vdim, bias=bool(bias),
                                  add_bias_kv=bool(add_bias_kv),
                                  add_zero_attn=bool(add_zero_attn),
                                  batch_first=bool(batch_first), dropout=dropout,
                                  num_kv_heads=hkv, weight_dtype=str(weight_dtype).upper(),
                                  head_gate=head_gate or "none")
            _module.init(scheme=init, seed=int(seed))
        self._m = _module
        c = _module.config()
        self.embed_dim, self.num_heads = c["embed_dim"], c["num_heads"]
        self.kdim, self.vdim = c["kdim"], c["vdim"]
        self.num_kv_heads = c["num_kv_heads"]
        # the head dims as the parameters have them (a config's head_dim may
        # differ from E / H: a checkpoint's; the binding's config omits it)
        shapes = {n: tuple(sh) for n, sh, _ in _module.params()}
        h, hkv = self.num_heads, self.num_kv_heads
        if "q_proj_weight" in shapes:
            self.head_dim = shapes["q_proj_weight"][0] // h
        elif "in_proj_weight" in shapes:
            self.head_dim = shapes["in_proj_weight"][0] // (h + 2 * hkv)
        else:
            self.head_dim = self.embed_dim // h
        ow = shapes.get("out_proj.weight")
        self.v_head_dim = ow[1] // h if ow else self.head_dim
        self.batch_first = c["batch_first"]
        self.dropout = c["dropout"]
        self.add_zero_attn = c["add_zero_attn"]
        self.weight_dtype = c["weight_dtype"].lower()
        self._qkv_same_embed_dim = self.kdim == self.embed_dim and self.vdim == self.embed_dim
        self.training = True
        self._rng = np.random.default_rng(seed)
        self.last_dropout_seed = None

    # -- torch.nn.Module's bits -------------------------------------------
    def train(self, mode=True):
        self.training = bool(mode)
        return self

    def eval(self):
        return self.train(False)

    def __repr__(self):
        return ("MultiheadAttention(embed_dim=%d, num_heads=%d, num_kv_heads=%d, kdim=%d, "
                "vdim=%d, batch_first=%s, dropout=%g)" % (
                    self.embed_dim, self.num_heads, self.num_kv_heads, self.kdim, self.vdim,
                    self.batch_first, self.dropout))

    def _view(self, name):
        return _half_view(np.asarray(self._m.param(name)), self.weight_dtype)

    def named_parameters(self):
        """(name, array) pairs; the arrays are views of the module's storage
        (writing them changes the module)."""
        return [(n, self._view(n)) for n, _, _ in self._m.params()]

    def state_dict(self):
        """PyTorch's parameter names -> copies of the parameters."""
        return collections.OrderedDict((n, np.array(a)) for n, a in self.named_parameters())

    def load_state_dict(self, state_dict, strict=True):
        """Copies state_dict's arrays into the parameters. Every shape and
        dtype is checked before anything is written. strict: the keys must
        be exactly the parameters' names. Returns (missing, unexpected)."""
        names = {n: (shape, dt) for n, shape, dt in self._m.params()}
        missing = [n for n in names if n not in state_dict]
        unexpected = [k for k in state_dict if k not in names]
        errors = []
        if strict and (missing or unexpected):
            if missing:
                errors.append("missing key(s): %s" % ", ".join(missing))
            if unexpected:
                errors.append("unexpected key(s): %s" % ", ".join(map(str, unexpected)))
        staged = []
        for n, (shape, _) in names.items():
            if n not in state_dict:
                continue
            v = state_dict[n]
            if hasattr(v, "detach"):  # a torch tensor
                v = v.detach().cpu().float().numpy()
            v = np.asarray(v)
            if v.dtype.kind != "f":
                raise TypeError("load_state_dict: %s has dtype %s (expected a float dtype)"
                                % (n, v.dtype))
            if tuple(v.shape) != tuple(shape):
                errors.append("size mismatch for %s: got shape %s, the module's is %s"
                              % (n, tuple(v.shape), tuple(shape)))
                continue
            staged.append((n, v))
        if errors:
            raise ValueError("Error(s) in loading state_dict for MultiheadAttention: "
                             + "; ".join(errors))
        for n, v in staged:
            dst = self._view(n)
            if dst.dtype == np.float32:
                np.copyto(dst, v.astype(np.float32, copy=False))
            else:  # half weights: through a module of that storage
                raise TypeError("load_state_dict: the module stores %s as %s; load into a "
                                "float32 module, then .to(%r)" % (n, self.weight_dtype,
                                                                    self.weight_dtype))
        return missing, unexpected

    def _load_cls(cls, path, num_heads=None, *, batch_first=False, add_zero_attn=False,
                  dropout=0.0, num_kv_heads=None, weight_dtype="f32"):
        """MultiheadAttention.load(path, ...): a new module from a
        safetensors file of PyTorch's state_dict names (num_heads from the
        file's __metadata__ when not given)."""
        m = _mha.Module.load(os.fspath(path), num_heads=num_heads or 0,
                             num_kv_heads=num_kv_heads or 0, batch_first=bool(batch_first),
                             add_zero_attn=bool(add_zero_attn), dropout=real("dropout", dropout),
                             weight_dtype=str(weight_dtype).upper())
        return cls(0, 0, _module=m)

    def _load_inst(self, path):
        """module.load(path): this module's parameters from a safetensors
        file (same configuration)."""
        other = type(self).load(path, self.num_heads, batch_first=self.batch_first,
                                add_zero_attn=self.add_zero_attn, dropout=self.dropout,
                                num_kv_heads=self.num_kv_heads)
        mine = [(n, s) for n, s, _ in self._m.params()]
        theirs = [(n, s) for n, s, _ in other._m.params()]
        if mine != theirs:
            raise ValueError("load: %s holds parameters %s; this module has %s"
                             % (path, theirs, mine))
        self.load_state_dict(other.state_dict())
        return self

    load = _hybridmethod(_load_cls, _load_inst)

    def save(self, path):
        """Writes the parameters as safetensors (PyTorch's names,
        __metadata__ num_heads)."""
        self._m.save(os.fspath(path))

    def to(self, weight_dtype):
        """A copy whose weight matrices are stored as 'f32', 'bf16' or 'f16'."""
        m = MultiheadAttention(0, 0, _module=self._m.convert(str(weight_dtype).upper()))
        m.training = self.training
        return m

    def prune_heads(self, heads):
        """Skips these heads from now on (their context is zero)."""
        self._m.prune_heads([int(h) for h in heads])

    @property
    def pruned_heads(self):
        return self._m.pruned_heads()

    # -- forward and backward -------------------------------------------------
    def _inputs(self, query, key, value, key_padding_mask, attn_mask):
        q = _arr(query, "query")
        if key is None and value is None:
            k = v = q
        elif key is None or value is None:
            raise ValueError("give both key and value, or neither (self-attention)")
        else:
            k, v = _arr(key, "key"), _arr(value, "value")
        return q, k, v, _mask(key_padding_mask, "key_padding_mask"), _mask(attn_mask,
                                                                            "attn_mask")

    def _drop(self, dropout_seed):
        kw = {}
        if self.training and self.dropout > 0.0:
            if dropout_seed is None:
                dropout_seed = int(self._rng.integers(0, 2**63 - 1))
            self.last_dropout_seed = dropout_seed
            kw = {"training": True, "dropout_seed": int(dropout_seed)}
        return kw

    def __call__(self, query, key=None, value=None, key_padding_mask=None, need_weights=True,
                 attn_mask=None, average_attn_weights=True, is_causal=False, *,
                 dropout_seed=None, **extras):
        """(attn_output, attn_weights or None), as torch.nn.MultiheadAttention.

        key/value None: self-attention. Extras: rope ('neox' or
        'interleaved'), rope_theta, rope_dim, rope_start; alibi (True, or
        per-head slopes); softcap; window (W or (left, right)) or
        window_left/window_right; weights_heads=(a, b),
        weights_rows=(a, b) (a block of the weights); impl ('auto',
        'reference', 'fused'); trace(step, b, h, array) called with every
        intermediate step (reference path); dropout_seed (training)."""
        is_causal, attn_mask = causal_hint(is_causal, attn_mask, key_padding_mask, need_weights)
        q, k, v, kpm, am = self._inputs(query, key, value, key_padding_mask, attn_mask)
        kw = forward_kwargs("mha.MultiheadAttention.forward()", is_causal=is_causal,
                            need_weights=need_weights,
                            average_attn_weights=average_attn_weights, as_int64=_int64,
                            as_float32=_float32, **extras)
        kw.update(self._drop(dropout_seed))
        out, w = _mha.forward(self._m, q, k, v, kpm, am, _alloc, **kw)
        return _result(out), _result(w)

    forward = __call__

    def backward(self, grad_output, query, key=None, value=None, key_padding_mask=None,
                 attn_mask=None, is_causal=False, *, dropout_seed=None, params=True, **extras):
        """Gradients of the forward with the same arguments: a Gradients
        tuple (query, key, value, params) with params {name: array}; with
        key and value None (self-attention) query is the input's whole
        gradient and key, value are None. In
        training mode with dropout, the forward's mask is regenerated from
        dropout_seed (default: the last forward's)."""
        is_causal, attn_mask = causal_hint(is_causal, attn_mask, key_padding_mask, False)
        q, k, v, kpm, am = self._inputs(query, key, value, key_padding_mask, attn_mask)
        kw = forward_kwargs("mha.MultiheadAttention.backward()", is_causal=is_causal,
                            as_int64=_int64, as_float32=_float32, **extras)
        if self.training and self.dropout > 0.0:
            seed = self.last_dropout_seed if dropout_seed is None else dropout_seed
            if seed is None:
                raise ValueError("backward in training mode with dropout needs the forward's "
                                 "dropout_seed (no forward ran)")
            kw.update({"training": True, "dropout_seed": int(seed)})
        grads = self._m.like() if params else None
        dq, dk, dv = _mha.backward(self._m, grads, q, k, v, kpm, am,
                                   _arr(grad_output, "grad_output"), _alloc, True, True, True,
                                   **kw)
        if key is None:  # self-attention: the input's gradient is the sum of its three parts
            dq += dk
            dq += dv
            dk = dv = None
        pg = None
        if grads is not None:  # (in the parameters' dtypes: bf16 as _view shows it)
            pg = collections.OrderedDict(
                (n, _half_view(np.asarray(grads.param(n)), self.weight_dtype))
                for n, _, _ in grads.params())
        return Gradients(_result(dq), _result(dk), _result(dv), pg)

    def forward_cached(self, query, cache, **extras):
        """Causal self-attention of the new tokens query ((T, N, E), or
        (N, T, E) batch_first; float32) through a KVCache: their keys and
        values are appended, and they attend to everything cached."""
        if not isinstance(cache, KVCache):
            raise TypeError("cache: expected an mha.KVCache")
        kw = forward_kwargs("mha.MultiheadAttention.forward_cached()", as_int64=_int64,
                            as_float32=_float32, **extras)
        return _mha.forward_cached(self._m, _arr(query, "query"), cache._c, _alloc, **kw)

    def make_cache(self, batch, capacity, dtype="f32"):
        """A KVCache for this module (batch sequences, capacity tokens)."""
        return KVCache(batch, self.num_kv_heads, self.head_dim, self.v_head_dim,
                       capacity=capacity, dtype=dtype)

    def make_paged_cache(self, num_blocks, block_size, dtype="f32", layout="head-major"):
        """A PagedKVCache for this module (num_blocks blocks of block_size tokens)."""
        return PagedKVCache(num_blocks, block_size, self.num_kv_heads, self.head_dim,
                            self.v_head_dim, dtype=dtype, layout=layout)

    def forward_paged(self, cache, ids, chunks, tokens=None, **extras):
        """Continuous batching through a PagedKVCache: chunks[i] is the new
        tokens (L_i, E) (float32) of sequence ids[i]; their keys and values
        are appended and each attends causally over its sequence's whole
        history, at its own positions. Returns the list of outputs (L_i, E).
        tokens[i] (optional): the L_i token ids of chunks[i]; the blocks
        they fill join the cache's prefix index (PagedKVCache.add_prompt).
        All or nothing: an exhausted pool raises and no sequence changes.
        StreamingLLM: sink_tokens=k with window_left=w keeps the first k
        tokens visible beside the window, at the paper's positions; pair it
        with cache.release(id, length - w, keep=k) for bounded memory."""
        if not isinstance(cache, PagedKVCache):
            raise TypeError("cache: expected an mha.PagedKVCache")
        ids = [int(i) for i in ids]
        chunks = [np.asarray(c, dtype=np.float32) for c in chunks]
        if len(ids) != len(chunks) or not ids:
            raise ValueError("forward_paged: %d ids for %d chunks (at least one each)"
                             % (len(ids), len(chunks)))
        for i, c in enumerate(chunks):
            if c.ndim != 2 or c.shape[1] != self.embed_dim:
                raise ValueError("forward_paged: chunks[%d] has shape %s, expected (L, %d)"
                                 % (i, c.shape, self.embed_dim))
        n, T = len(chunks), max(c.shape[0] for c in chunks)
        q = np.zeros((n, T, self.embed_dim) if self.batch_first else (T, n, self.embed_dim),
                     dtype=np.float32)
        for i, c in enumerate(chunks):
            if self.batch_first:
                q[i, :c.shape[0]] = c
            else:
                q[:c.shape[0], i] = c
        tk = None
        if tokens is not None:
            if len(tokens) != n:
                raise ValueError("forward_paged: %d token lists for %d chunks" % (len(tokens), n))
            tk = np.zeros((n, T), dtype=np.int32)
            for i, t in enumerate(tokens):
                t = np.asarray(t, dtype=np.int32).ravel()
                if t.shape[0] != chunks[i].shape[0]:
                    raise ValueError("forward_paged: tokens[%d] has %d ids for %d rows"
                                     % (i, t.shape[0], chunks[i].shape[0]))
                tk[i, :t.shape[0]] = t
        kw = forward_kwargs("mha.MultiheadAttention.forward_paged()", as_int64=_int64,
                            as_float32=_float32, **extras)
        out = _mha.forward_paged(self._m, q, cache._c, np.asarray(ids, dtype=np.int64),
                                 np.asarray([c.shape[0] for c in chunks], dtype=np.int64),
                                 tk, _alloc, **kw)
        return [np.array(out[i, :c.shape[0]] if self.batch_first else out[:c.shape[0], i])
                for i, c in enumerate(chunks)]


# ---------------------------------------------------------------------------
# Hugging Face checkpoints

def _positions(position_ids, n, l, rope_mode):
    """position_ids (N, L) as the binding's keywords: rope_start when every
    row counts up by one from a start >= 0, else rope_positions; nothing
    when the layer has no RoPE (only RoPE reads positions)."""
    if position_ids is None or rope_mode == 0:
        return {}
    p = _int64(position_ids, "position_ids")
    if p.shape != (n, l):
        raise ValueError("position_ids: shape %s, expected (N, L) = (%d, %d) like "
                         "hidden_states" % (p.shape, n, l))
    start = p[:, :1] if l else np.zeros((n, 1), np.int64)
    if (start >= 0).all() and (p == start + np.arange(l, dtype=np.int64)).all():
        return {"rope_start": np.ascontiguousarray(start[:, 0])}
    return {"rope_positions": np.ascontiguousarray(p.reshape(-1))}


def _padding(attention_mask, n, l):
    """transformers' attention_mask (N, L), 1 = token, as a key padding mask
    (True = padding)."""
    if attention_mask is None:
        return None
    m = np.asarray(attention_mask)
    if m.shape != (n, l):
        raise ValueError("attention_mask: shape %s, expected (N, L) = (%d, %d) like "
                         "hidden_states" % (m.shape, n, l))
    return np.ascontiguousarray(m == 0)


class CheckpointAttention:
    """The attention of one layer of a Hugging Face checkpoint (bert, gpt2,
    llama, mistral, qwen2, qwen3, gemma2, gpt_oss), loaded under the
    architecture's own tensor names (mha_checkpoint_load_layer).

    CheckpointAttention(path, layer=0, *, weight_dtype="f32")
    __call__(hidden_states, position_ids=None, attention_mask=None, *,
             impl="auto") -> attn_output
    make_cache(batch, capacity); forward_cached(hidden_states, cache,
             position_ids=None) -> attn_output of the new tokens (no padding)

    hidden_states (N, L, E); position_ids (N, L) integers (RoPE positions,
    transformers' position_ids); attention_mask (N, L), 1 = token, 0 =
    padding (hidden as a key). The output is the attention block's (before
    any residual or norm): BERT's attention.output.dense, the decoders'
    self_attn. The layer's causal mask, sliding window, RoPE (and its
    scaling), soft cap and scale come from config.json (.config). .module is
    the MultiheadAttention holding the parameters.
    """

    def __init__(self, path, layer=0, *, weight_dtype="f32"):
        m, info = _mha.load_checkpoint(os.fspath(path), _check_int("layer", layer, 0),
                                       weight_dtype=str(weight_dtype).upper())
        self.module = MultiheadAttention(0, 0, _module=m).eval()
        self._layer = info
        self.config = info.info()

    def __repr__(self):
        return "CheckpointAttention(%s, layer %d: %r)" % (self.config["model_type"],
                                                         self.config["layer"], self.module)

    def __call__(self, hidden_states, position_ids=None, attention_mask=None, *,
                 impl="auto"):
        q = _arr(hidden_states, "hidden_states")
        shape = q[0].shape if isinstance(q, tuple) else q.shape
        if len(shape) != 3:
            raise ValueError("hidden_states: expected (N, L, E), got shape %s" % (shape,))
        n, l = shape[0], shape[1]
        kw = forward_kwargs("mha.CheckpointAttention.__call__()", impl=impl)
        kw["checkpoint"] = self._layer
        kw.update(_positions(position_ids, n, l, self.config["rope_mode"]))
        kpm = _padding(attention_mask, n, l)
        out, _ = _mha.forward(self.module._m, q, q, q, kpm, None, _alloc, **kw)
        return _result(out)

    forward = __call__

    def make_cache(self, batch, capacity, dtype="f32"):
        """A KVCache for this layer (batch sequences, capacity tokens)."""
        return self.module.make_cache(batch, capacity, dtype)

    def forward_cached(self, hidden_states, cache, position_ids=None):
        """Incremental decoding: the new tokens hidden_states (N, T, E)
        appended to `cache` (make_cache), attending causally to everything
        cached, with the layer's window, RoPE (position_ids (N, T): the new
        tokens' positions; None: the cache's length onwards), soft cap and
        scale. No padding (the cached path takes no masks)."""
        if not isinstance(cache, KVCache):
            raise TypeError("cache: expected an mha.KVCache")
        q = _arr(hidden_states, "hidden_states")
        shape = q[0].shape if isinstance(q, tuple) else q.shape
        if len(shape) != 3:
            raise ValueError("hidden_states: expected (N, T, E), got shape %s" % (shape,))
        kw = {"checkpoint": self._layer}
        pk = _positions(position_ids, shape[0], shape[1], self.config["rope_mode"])
        if "rope_start" in pk:  # (the cached path reads rope_positions only)
            pk = {"rope_positions": np.ascontiguousarray(
                (pk["rope_start"][:, None] + np.arange(shape[1], dtype=np.int64)).reshape(-1))}
        kw.update(pk)
        return _result(_mha.forward_cached(self.module._m, q, cache._c, _alloc, **kw))


def from_pretrained(path, layer=0, *, weight_dtype="f32"):
    """The attention of layer `layer` of the Hugging Face checkpoint in
    directory `path`: a CheckpointAttention (call it on hidden_states,
    position_ids, attention_mask)."""
    return CheckpointAttention(path, layer, weight_dtype=weight_dtype)


# ---------------------------------------------------------------------------
# scaled dot-product attention

def _collapse(x, lead, tail):
    """x (..., tail) broadcast to lead + tail and viewed as (B,) + tail
    (a copy only when broadcast dims cannot be merged)."""
    x = np.broadcast_to(x, lead + tail)
    return x.reshape((numel(lead),) + tail)


def _sdpa_prepare(query, key, value, attn_mask, enable_gqa):
    q, k, v = _arr(query, "query"), _arr(key, "key"), _arr(value, "value")
    # bfloat16 (ml_dtypes) arrives as (int16 view, BF16): the shapes are the
    # view's, the tag goes back on after the reshapes below
    tags = [a[1] if isinstance(a, tuple) else None for a in (q, k, v)]
    q, k, v = (a[0] if isinstance(a, tuple) else a for a in (q, k, v))
    lead, hq, hkv, q_heads = sdpa_layout(q.shape, k.shape, v.shape, enable_gqa)
    L, S = q.shape[-2], k.shape[-2]
    q3, k3, v3 = (x if x.ndim >= 3 else x[None] for x in (q, k, v))
    q4 = _collapse(q3, lead, (q_heads,) + q3.shape[-2:])
    k4 = _collapse(k3, lead, k3.shape[-3:])
    v4 = _collapse(v3, lead, v3.shape[-3:])
    m = None
    if attn_mask is not None:
        m = np.asarray(attn_mask)
        if m.dtype == np.bool_:
            m = ~m  # torch: True takes part; mha: nonzero is masked out
        elif m.dtype.kind == "f":
            if m.dtype not in (np.float32, np.float64):
                m = m.astype(np.float32)
        else:
            raise TypeError("attn_mask: dtype %s is not supported (bool or float)" % m.dtype)
        if m.ndim > 4 or len(lead) > 1:
            try:
                m = _collapse(m, lead, (q_heads, L, S))
            except ValueError:
                raise ValueError("attn_mask: shape %s does not broadcast to %s"
                                 % (m.shape, lead + (q_heads, L, S))) from None
    out_shape = (lead + (q_heads, L, v.shape[-1]))[-max(q.ndim, k.ndim):]
    q4, k4, v4 = (x if t is None else (x, t) for x, t in zip((q4, k4, v4), tags))
    return q4, k4, v4, m, out_shape


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, *,
                                 dropout_seed=None, return_weights=False, window=None,
                                 window_left=-1, window_right=-1, softcap=0.0,
                                 alibi_slopes=None, sinks=None, impl="auto"):
    """torch.nn.functional.scaled_dot_product_attention on numpy arrays.

    query (..., Hq, L, E), key (..., Hkv, S, E), value (..., Hkv, S, Ev):
    any leading dims (broadcast); a bool attn_mask's True means take part,
    a float mask is added; is_causal hides keys j > i (top-left for
    L != S); scale default 1/sqrt(E); enable_gqa lets Hkv divide Hq.
    Extras: return_weights (also the (..., Hq, L, S) weights), window
    ((left, right): query i sees keys i - left .. i + right, None
    unbounded) or window_left/window_right, softcap (scores s become
    softcap * tanh(s / softcap)), alibi_slopes (Hq of them: -slope |i - j|
    added), sinks (Hq logits that join each row's softmax denominator),
    impl, dropout_seed (with dropout_p > 0)."""
    q4, k4, v4, m, out_shape = _sdpa_prepare(query, key, value, attn_mask, enable_gqa)
    kw = sdpa_kwargs(is_causal=is_causal, scale=scale, window=window, window_left=window_left,
                     window_right=window_right, impl=impl, need_weights=return_weights,
                     dropout_p=dropout_p, softcap=softcap, alibi_slopes=alibi_slopes,
                     sinks=sinks, as_float32=_float32)
    if "dropout_p" in kw:
        kw["dropout_seed"] = int(np.random.default_rng().integers(0, 2**63 - 1)
                                 if dropout_seed is None else dropout_seed)
    out, w = _mha.sdpa(q4, k4, v4, m, None, _alloc, **kw)
    out = _result(out.reshape(out_shape))
    if return_weights:
        S = (k4[0] if isinstance(k4, tuple) else k4).shape[-2]
        return out, _result(w.reshape(out_shape[:-1] + (S,)))
    return out


# ---------------------------------------------------------------------------
# KV cache

class KVCache:
    """Keys and values of `batch` sequences for incremental decoding:
    K (batch, num_kv_heads, capacity, head_dim), V (..., v_head_dim),
    stored as 'f32', 'bf16', 'f16', 'int8' or 'int4' (groups of 32 with
    one scale each: see mha.h's mha_kv_dtype for the error bound).
    append(k, v) adds tokens
    ((B, Hkv, T, D) arrays), attend(q) attends (B, H, T, D) queries (the
    last T positions of each sequence, causal) to everything cached;
    MultiheadAttention.forward_cached runs a whole module through it."""

    def __init__(self, batch, num_kv_heads, head_dim, v_head_dim=None, *, capacity,
                 dtype="f32"):
        self.batch = _check_int("batch", batch)
        self.num_kv_heads = _check_int("num_kv_heads", num_kv_heads)
        self.head_dim = _check_int("head_dim", head_dim)
        self.v_head_dim = self.head_dim if v_head_dim is None else _check_int("v_head_dim",
                                                                              v_head_dim)
        self.dtype = dtype
        self._c = _mha.KVCache(self.batch, self.num_kv_heads, self.head_dim, self.v_head_dim,
                               _check_int("capacity", capacity), str(dtype))

    @property
    def capacity(self):
        return self._c.capacity

    @property
    def nbytes(self):
        return self._c.nbytes

    def length(self, b=None):
        """Sequence b's length, or every sequence's as a list."""
        if b is None:
            return [self._c.length(i) for i in range(self.batch)]
        return self._c.length(int(b))

    def _counts(self, counts):
        return None if counts is None else _int64(counts, "counts")

    def append(self, k, v, counts=None):
        """Appends k (B, Hkv, T, D) and v (B, Hkv, T, Dv); counts[b] tokens
        of sequence b (default: all T). A full cache refuses (ValueError)
        and keeps its lengths."""
        self._c.append(_arr(k, "k"), _arr(v, "v"), self._counts(counts))

    def attend(self, q, counts=None, *, scale=None, window=None, window_left=-1,
               window_right=-1, alibi=False, alibi_slopes=None, softcap=0.0, sinks=None,
               sink_tokens=0):
        """(B, H, T, Dv) attention of q (B, H, T, D) over the cache: float32, or
        bfloat16 / float16 (computed in float32, the output in q's dtype).
        The options of scaled_dot_product_attention (alibi=True: the ALiBi
        paper's slopes; alibi_slopes, sinks: one per query head), and
        sink_tokens=k with a window_left: StreamingLLM's first k tokens kept
        visible beside the window."""
        from ._options import window_bounds
        wl, wr = window_bounds(window, window_left, window_right)
        kw = {"window_left": wl, "window_right": wr, "softcap": real("softcap", softcap)}
        if scale is not None:
            kw["scale"] = real("scale", scale)
        if counts is not None:
            kw["counts"] = self._counts(counts)
        if alibi:
            kw["alibi"] = True
        if alibi_slopes is not None:
            kw["alibi_slopes"] = _float32(alibi_slopes, "alibi_slopes")
        if sinks is not None:
            kw["sinks"] = _float32(sinks, "sinks")
        if sink_tokens:
            kw["sink_tokens"] = int(sink_tokens)
        return _result(self._c.attend(_arr(q, "q"), _alloc, **kw))

    def truncate(self, length, b=None):
        """Rolls sequence b (None: every sequence) back to length tokens."""
        self._c.truncate(-1 if b is None else int(b), int(length))


class PagedKVCache:
    """A paged KV cache for serving many sequences: num_blocks blocks of
    block_size tokens (K and V of num_kv_heads heads, stored as 'f32',
    'bf16', 'f16', 'int8' or 'int4'), per-sequence block tables, blocks shared by
    forks (copy on write). MultiheadAttention.forward_paged runs a module
    through it. A sequence attends exactly as a KVCache holding the same
    tokens would. layout: 'head-major' (a KV head's blocks side by side:
    long passes where a sequence's blocks lie in order) or 'block-major' (a
    block's KV heads side by side, read together: faster where the blocks
    end up scattered over the pool); the same results either way."""

    def __init__(self, num_blocks, block_size, num_kv_heads, head_dim, v_head_dim=None, *,
                 dtype="f32", layout="head-major"):
        self.num_blocks = _check_int("num_blocks", num_blocks)
        self.block_size = _check_int("block_size", block_size)
        self.num_kv_heads = _check_int("num_kv_heads", num_kv_heads)
        self.head_dim = _check_int("head_dim", head_dim)
        self.v_head_dim = self.head_dim if v_head_dim is None else _check_int("v_head_dim",
                                                                              v_head_dim)
        self.dtype = dtype
        self.layout = layout
        self._c = _mha.PagedKVCache(self.num_blocks, self.block_size, self.num_kv_heads,
                                    self.head_dim, self.v_head_dim, str(dtype), str(layout))

    def add_sequence(self):
        """A new, empty sequence: its id."""
        return self._c.add_sequence()

    def add_prompt(self, tokens):
        """A new sequence for a prompt of token ids: it starts with the
        longest run of indexed blocks holding the same first tokens (shared;
        at most all but the last token). Returns (id, cached): the tokens
        from `cached` on still need their keys and values (forward_paged
        with their ids). When the blocks hold the whole prompt, the last
        one is shared too: forward_paged with the last token's id computes
        its output and keeps the block's keys and values (no block taken)."""
        return self._c.add_prompt(np.ascontiguousarray(tokens, dtype=np.int32))

    def fork(self, id):
        """A new sequence holding sequence id's tokens (no block copied)."""
        return self._c.fork(int(id))

    def free(self, id):
        """Frees sequence id (its blocks no one else holds return to the pool)."""
        self._c.free(int(id))

    def truncate(self, id, length):
        """Rolls sequence id back to length tokens."""
        self._c.truncate(int(id), int(length))

    def release(self, id, pos, keep=0):
        """Bounded memory: frees sequence id's blocks that lie wholly in
        [ceil(keep / block_size) * block_size, pos) (a sliding window: keep
        0, pos = length - window; StreamingLLM: keep = its sink_tokens, the
        blocks of the first keep tokens stay). Its length and positions stay;
        an attention that would see a released token raises ValueError."""
        self._c.release(int(id), int(keep), int(pos))

    def length(self, id):
        """Sequence id's tokens (KeyError: no such sequence)."""
        return self._c.length(int(id))

    def blocks_in_use(self):
        return self._c.blocks_in_use()

    def blocks_free(self):
        return self._c.blocks_free()

    @property
    def block_bytes(self):
        return self._c.block_bytes


# ---------------------------------------------------------------------------
# diagnostics

def _cli():
    here = os.path.join(os.path.dirname(__file__), "bin", "mha")
    return here if os.path.exists(here) else shutil.which("mha")


def diagnose(module, query, key=None, value=None, key_padding_mask=None, attn_mask=None,
             is_causal=False, *, max_rows=256, dead_entropy=0.98, dead_output=1e-4,
             rank_rtol=0.0, report=None, tokens=None, **extras):
    """Per-head diagnostics (mha_diag_create, eval mode) as a dict: "heads"
    (per head: entropy_mean/min/norm, mean_distance, logit_max/std,
    output_var_ratio, dead, rank_q/k/v/o, singular_values, pruned,
    gate_mean), "similarity" (H x H, 1 - JS/ln 2), "rows", "nonfinite".
    module: mha.MultiheadAttention or mha.torch.MultiheadAttention.
    report=DIR also writes `mha inspect`'s report there (diagnostics.json,
    pictures, report.html), from the same module and inputs; tokens: labels
    for the positions. Extras as MultiheadAttention.__call__."""
    m, to_np = _module_of(module)
    q = to_np(query)
    k = q if key is None else to_np(key)
    v = q if value is None else to_np(value)
    kpm = None if key_padding_mask is None else to_np(key_padding_mask)
    am = None if attn_mask is None else to_np(attn_mask)
    kw = forward_kwargs("mha.diagnose()", is_causal=is_causal, as_int64=_int64,
                        as_float32=_float32, **extras)
    kw.update({"max_rows": int(max_rows), "dead_entropy": real("dead_entropy", dead_entropy),
               "dead_output": real("dead_output", dead_output),
               "rank_rtol": real("rank_rtol", rank_rtol)})
    d = _mha.diagnose(m, _arr(q, "query"), _arr(k, "key"), _arr(v, "value"),
                      _mask(kpm, "key_padding_mask"), _mask(am, "attn_mask"), **kw)
    if report is not None:
        _report(m, report, q, k, v, kpm, am, is_causal, max_rows, tokens, extras)
        d["report"] = os.fspath(report)
    return d


def _module_of(module):
    if isinstance(module, MultiheadAttention):
        return module._m, np.asarray
    sync = getattr(module, "_mha_sync", None)  # mha.torch.MultiheadAttention
    if sync is not None:
        return sync(), lambda t: t.detach().cpu().numpy() if hasattr(t, "detach") else t
    raise TypeError("diagnose: expected an mha.MultiheadAttention or "
                    "mha.torch.MultiheadAttention, got %s" % type(module).__name__)


def _report(m, out_dir, q, k, v, kpm, am, is_causal, max_rows, tokens, extras):
    cli = _cli()
    if cli is None:
        raise OSError("diagnose(report=...): the mha command is not installed with the package")
    with tempfile.TemporaryDirectory() as tmp:
        wpath, xpath = os.path.join(tmp, "w.safetensors"), os.path.join(tmp, "x.safetensors")
        m.save(wpath)
        tensors = {"query": q, "key": k, "value": v}
        if kpm is not None:
            tensors["key_padding_mask"] = np.asarray(kpm)
        if am is not None:
            tensors["attn_mask"] = np.asarray(am)
        save_tensors(xpath, {n: np.asarray(a) for n, a in tensors.items()})
        cfg = m.config()
        cmd = [cli, "inspect", "--weights", wpath, "--inputs", xpath, "--out",
               os.fspath(out_dir), "--num-heads", str(cfg["num_heads"]),
               "--max-rows", str(int(max_rows))]
        if cfg["batch_first"]:
            cmd.append("--batch-first")
        if cfg["add_zero_attn"]:
            cmd.append("--add-zero-attn")
        if is_causal:
            cmd.append("--causal")
        if tokens is not None:
            tpath = os.path.join(tmp, "tokens.txt")
            with open(tpath, "w", encoding="utf-8") as f:
                f.write("\n".join(str(t) for t in tokens) + "\n")
            cmd += ["--tokens", tpath]
        for key, flag in (("window_left", "--window-left"), ("window_right", "--window-right"),
                          ("rope", "--rope"), ("rope_theta", "--rope-theta"),
                          ("rope_dim", "--rope-dim"), ("softcap", "--softcap")):
            if extras.get(key) is not None:
                cmd += [flag, str(extras[key])]
        if extras.get("alibi") is True:
            cmd.append("--alibi")
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise ValueError("diagnose(report=...): mha inspect failed: %s"
                             % (r.stderr.strip() or r.stdout.strip()))
