"""mha.torch: mha for PyTorch, through torch.autograd.

    mha.torch.MultiheadAttention(embed_dim, num_heads, ...)   # a torch.nn.Module
    mha.torch.scaled_dot_product_attention(q, k, v, ...)       # as F.scaled_dot_product_attention

MultiheadAttention has the constructor, parameters (same names, shapes and
initialisation as torch.nn.MultiheadAttention, drawn from torch's generator),
state_dict and forward (the 2.x signature, is_causal included) of PyTorch's
module; its forward and backward run mha's fused C kernels (float32) or its
float64 reference (float64 inputs), with gradients for query, key, value and
every parameter. Dropout in training mode uses mha's Philox generator seeded
from torch's, so torch.manual_seed makes runs repeatable. The parameters are
views of the C module's storage (no copy per call); if they are replaced
(e.g. param.data = ...), the next forward copies them back in.

Works with PyTorch 1.13 (Debian's python3-torch) and 2.x, on CPU tensors.
The attention weights (need_weights=True) are returned but not
differentiated; an attn_mask that requires grad is refused.
"""

import math
import os

import numpy as np

try:
    import torch
    from torch import nn
except ImportError as exc:  # the numpy API (mha) works without it
    raise ImportError(
        "mha.torch needs PyTorch, which this Python cannot import (%s). Add it to the mha "
        "installed here with: pip install 'mha[torch]' --extra-index-url "
        "https://download.pytorch.org/whl/cpu (PyTorch's CPU build, about 200 MB; without "
        "the index, PyPI's Linux build with CUDA, several GB). Or Debian's python3-torch, in "
        "a venv made by /usr/bin/python3 -m venv --system-site-packages" % exc) from exc

from . import _mha
from ._options import BF16, causal_hint, forward_kwargs, sdpa_kwargs, sdpa_layout
import mha as _np_api

__all__ = ["MultiheadAttention", "scaled_dot_product_attention", "from_pretrained",
           "CheckpointAttention"]


# ---------------------------------------------------------------------------
# tensors in and out (no copies)

_alloc = _np_api._alloc  # outputs: numpy arrays, wrapped by _t without a copy


def _t(a):
    if a is None:
        return None
    t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if a.dtype == np.int16 else t


def _param_tensor(a):
    """A C module's parameter (the binding's array) as a tensor sharing its
    memory: float32, float16, or bf16 storage (uint16) viewed as bfloat16."""
    a = np.asarray(a)
    if a.dtype == np.uint16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _np(t, name):
    """A CPU tensor as the binding's argument, sharing its memory."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError("%s: expected a torch.Tensor, got %s" % (name, type(t).__name__))
    if t.device.type != "cpu":
        raise TypeError("%s: mha runs on CPU tensors, got one on %s" % (name, t.device))
    if t.layout != torch.strided:
        raise TypeError("%s: expected a dense (strided) tensor, got layout %s" % (name, t.layout))
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return (t.view(torch.int16).numpy(), BF16)
    if t.dtype.is_complex:
        raise TypeError("%s: dtype %s is not supported (expected float32, float64, float16 or "
                        "bfloat16)" % (name, t.dtype))
    return t.resolve_neg().numpy() if t.is_neg() else t.numpy()


def _grad_out(g):
    # an expanded gradient (stride 0, e.g. from .sum()) is made contiguous:
    # the library's inputs are views with real strides
    return g.contiguous() if any(s == 0 for s in g.stride()) and g.numel() > 1 else g


def _mask(m, name):
    if m is None:
        return None
    if m.requires_grad and torch.is_grad_enabled():
        raise ValueError("%s requires grad: mha gives masks no gradient (detach it)" % name)
    if m.dtype in (torch.float16, torch.bfloat16):
        m = m.float()
    return _np(m, name)


def _host(x):
    """A tensor as a numpy array (half tensors as float32: numpy has no
    bfloat16 of its own), anything else as it is."""
    if not isinstance(x, torch.Tensor):
        return x
    x = x.detach().cpu()
    return (x.float() if x.dtype in (torch.float16, torch.bfloat16) else x).numpy()


def _int64(x):
    return _np_api._int64(_host(x))


def _float32(x, name="alibi slopes"):
    return _np_api._float32(_host(x), name)


def _qkv(query, key, value, k_is_q, v_is_k):
    """The inputs as the binding's arguments; a tensor passed again gives the
    same array (self-attention: the library's packed projection)."""
    q = _np(query, "query")
    k = q if k_is_q else _np(key, "key")
    v = k if v_is_k else _np(value, "value")
    return q, k, v


def _seed():
    """A dropout seed drawn from torch's default generator."""
    return int(torch.empty((), dtype=torch.int64).random_())


def _outputs(ctx, out, w):
    """A Function's (out, weights) as tensors; the weights are returned but
    not differentiated."""
    out, w = _t(out), _t(w)
    if w is not None:
        ctx.mark_non_differentiable(w)
    return out, w


# ---------------------------------------------------------------------------
# autograd: the module

def _saved_take(owner):
    """A saved-state object for a training forward: one a backward gave back
    to this module (its buffer already mapped: no fresh pages to fault in
    and zero), or a new one."""
    pool = owner.__dict__.setdefault("_mha_saved_pool", [])
    return pool.pop() if pool else _mha.Saved()


def _saved_give(owner, saved):
    """Back to owner's pool after its backward (two kept at most)."""
    pool = owner.__dict__.setdefault("_mha_saved_pool", [])
    if saved is not None and len(pool) < 2:
        pool.append(saved)


class _MHAFunction(torch.autograd.Function):
    """forward(ctx, owner, call, query, key, value, *params) -> (out, weights)"""

    @staticmethod
    def forward(ctx, owner, call, query, key, value, *params):
        cmod = call.get("cmod", owner._cmod)
        q, k, v = _qkv(query, key, value, key is query, value is key)
        kw = call["kw"]
        saved = None
        if call["grad"] and query.dtype != torch.float64:
            saved = _saved_take(owner)  # the fused forward keeps what the backward needs
            kw = dict(kw, saved=saved)
        out, w = _mha.forward(cmod, q, k, v, call["kpm"], call["am"], _alloc, **kw)
        ctx.owner, ctx.call, ctx.saved = owner, call, saved
        ctx.self_attn = (key is query, value is key)
        ctx.save_for_backward(query, key, value, *params)
        return _outputs(ctx, out, w)

    @staticmethod
    def backward(ctx, grad_out, grad_w):
        query, key, value, *params = ctx.saved_tensors
        need = ctx.needs_input_grad
        call = ctx.call
        cmod = call.get("cmod", ctx.owner._cmod)
        if grad_out is None:
            return (None,) * len(need)
        q, k, v = _qkv(query, key, value, *ctx.self_attn)
        # (the parameters' own module's like: under autocast, float32
        # gradients of the half copy's weights)
        grads = ctx.owner._cmod.like() if any(need[5:]) else None
        kw = call["kw"] if ctx.saved is None else dict(call["kw"], saved=ctx.saved)
        kw.pop("need_weights", None)
        kw.pop("average_attn_weights", None)
        dq, dk, dv = _mha.backward(cmod, grads, q, k, v, call["kpm"], call["am"],
                                   _np(_grad_out(grad_out), "grad_output"), _alloc, need[2],
                                   need[3], need[4], **kw)
        pgrads = [None] * len(params)
        if grads is not None:
            for i, name in enumerate(call["names"]):
                if need[5 + i]:
                    pgrads[i] = _param_tensor(grads.param(name))
        _saved_give(ctx.owner, ctx.saved)
        ctx.saved = None
        return (None, None, _t(dq), _t(dk), _t(dv), *pgrads)


class _Holder(nn.Module):
    """A submodule that only holds parameters (out_proj, gate_proj)."""

    def forward(self, *args):  # pragma: no cover - never called
        raise RuntimeError("a parameter holder, not a layer")


class MultiheadAttention(nn.Module):
    """torch.nn.MultiheadAttention, computed by mha.

    MultiheadAttention(embed_dim, num_heads, dropout=0.0, bias=True,
        add_bias_kv=False, add_zero_attn=False, kdim=None, vdim=None,
        batch_first=False, device=None, dtype=None, *, num_kv_heads=None,
        impl="auto", **extras)

    forward(query, key, value, key_padding_mask=None, need_weights=True,
            attn_mask=None, average_attn_weights=True, is_causal=False,
            **extras) -> (attn_output, attn_weights or None)

    num_kv_heads < num_heads: grouped-query attention. extras (at
    construction: defaults for every call; per call: override): rope,
    rope_theta, rope_dim, rope_start, alibi, softcap, window,
    window_left/right, weights_heads, weights_rows, impl.
    """

    __constants__ = ["batch_first"]

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False,
                 add_zero_attn=False, kdim=None, vdim=None, batch_first=False, device=None,
                 dtype=None, *, num_kv_heads=None, **extras):
        super().__init__()
        if device is not None and torch.device(device).type != "cpu":
            raise TypeError("mha.torch.MultiheadAttention runs on the CPU, got device %s"
                            % device)
        if dtype is not None and dtype not in self._HALF:
            raise TypeError("mha.torch.MultiheadAttention: dtype %s (float32, bfloat16 or "
                            "float16)" % dtype)
        np_mod = _np_api.MultiheadAttention(embed_dim, num_heads, dropout, bias, add_bias_kv,
                                            add_zero_attn, kdim, vdim, batch_first,
                                            num_kv_heads)
        self._adopt(np_mod, extras)
        self._reset_parameters()
        if dtype is not None and dtype != torch.float32:
            self.to(dtype)

    @classmethod
    def _from_cmod(cls, cmod):
        """A module around an existing C module, its parameters as they are
        (a checkpoint's)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._adopt(_np_api.MultiheadAttention(0, 0, _module=cmod), {})
        return self

    def _adopt(self, np_mod, extras):
        self._cmod = np_mod._m
        self.embed_dim, self.kdim, self.vdim = np_mod.embed_dim, np_mod.kdim, np_mod.vdim
        self.num_heads, self.num_kv_heads = np_mod.num_heads, np_mod.num_kv_heads
        self.head_dim = np_mod.head_dim
        self.dropout = np_mod.dropout
        self.batch_first = np_mod.batch_first
        self.add_zero_attn = np_mod.add_zero_attn
        # False keeps torch's fused encoder fast paths (which would read these
        # weights and run torch's own kernels) from bypassing this forward.
        self._qkv_same_embed_dim = False
        self._mha_same_dims = np_mod._qkv_same_embed_dim
        forward_kwargs("mha.torch.MultiheadAttention()", as_int64=_int64, as_float32=_float32,
                       **extras)  # checked now
        self._extras = dict(extras)
        self._bind()

    # -- parameters: views of the C module's storage ----------------------
    def _bind(self):
        names = [n for n, _, _ in self._cmod.params()]
        self._names = names
        self._views = self._storage_views()
        for n in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight",
                  "in_proj_bias", "bias_k", "bias_v"):
            if n not in names:
                self.register_parameter(n, None)
        if not hasattr(self, "out_proj"):
            self.out_proj = _Holder()
        for n in names:
            owner, leaf = self._owner(n)
            owner.register_parameter(leaf, nn.Parameter(self._views[n]))
        if "out_proj.bias" not in names:
            self.out_proj.register_parameter("bias", None)

    def _storage_views(self):
        """Torch views of the C module's parameters: float32, or the weight
        matrices in the module's half storage (bfloat16 through int16)."""
        views = {}
        for n in self._names:
            views[n] = _param_tensor(self._cmod.param(n))
        return views

    _HALF = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}

    def _weight_storage(self):
        """The weight matrices' dtype the parameters ask for (after
        .to(torch.bfloat16), .half(), .float()): the C module is converted
        to it (biases stay float32 in it, copied from the parameters)."""
        ws = {n: self._param(n).dtype for n in self._names if n.endswith("weight")}
        kinds = set(ws.values())
        if len(kinds) != 1 or next(iter(kinds)) not in self._HALF:
            raise TypeError("mha.torch.MultiheadAttention computes with float32, bfloat16 or "
                            "float16 weight matrices, all of one dtype; got %s"
                            % ", ".join("%s %s" % (n, str(d).replace("torch.", ""))
                                        for n, d in ws.items()))
        return next(iter(kinds))

    def _owner(self, name):
        if "." not in name:
            return self, name
        sub, leaf = name.split(".", 1)
        if not hasattr(self, sub):
            setattr(self, sub, _Holder())
        return getattr(self, sub), leaf

    def _param(self, name):
        owner, leaf = self._owner(name)
        return getattr(owner, leaf)

    def _reset_parameters(self):
        """torch.nn.MultiheadAttention's initialisation, in its order (the
        out_proj Linear's own init first), from torch's generator."""
        with torch.no_grad():
            w = self._param("out_proj.weight")
            nn.init.kaiming_uniform_(w, a=math.sqrt(5))
            if self.out_proj.bias is not None:
                bound = 1 / math.sqrt(w.shape[1])
                nn.init.uniform_(self.out_proj.bias, -bound, bound)
            if self._mha_same_dims:
                nn.init.xavier_uniform_(self.in_proj_weight)
            else:
                nn.init.xavier_uniform_(self.q_proj_weight)
                nn.init.xavier_uniform_(self.k_proj_weight)
                nn.init.xavier_uniform_(self.v_proj_weight)
            if self.in_proj_bias is not None:
                nn.init.constant_(self.in_proj_bias, 0.0)
                nn.init.constant_(self.out_proj.bias, 0.0)
            if self.bias_k is not None:
                nn.init.xavier_normal_(self.bias_k)
                nn.init.xavier_normal_(self.bias_v)

    def _mha_sync(self):
        """The C module, with every parameter's current value in it (a
        replaced parameter is copied back in and re-bound to the storage).
        Weight matrices in bfloat16 or float16 (module.to(torch.bfloat16),
        .half()) make the C module store them so (converted once, then
        bound as here); biases of another dtype than float32 are copied into
        its float32 biases at each call (exactly: a widening)."""
        want = self._weight_storage()
        if self._views[next(n for n in self._names if n.endswith("weight"))].dtype != want:
            self._cmod = self._cmod.convert(self._HALF[want])
            self._views = self._storage_views()
        for n in self._names:
            p, view = self._param(n), self._views[n]
            if p.data_ptr() == view.data_ptr() and p.dtype == view.dtype and \
                    p.shape == view.shape and p.is_contiguous():
                continue
            if p.dtype not in self._HALF:
                raise TypeError("mha.torch.MultiheadAttention: %s is %s (float32, bfloat16 "
                                "or float16)" % (n, p.dtype))
            if p.shape != view.shape:
                raise ValueError("%s: shape %s, the module's is %s"
                                 % (n, tuple(p.shape), tuple(view.shape)))
            with torch.no_grad():
                view.copy_(p.detach())
            if p.dtype == view.dtype:
                p.data = view
        return self._cmod

    def __getstate__(self):
        state = self.__dict__.copy()
        for k in ("_cmod", "_views", "_mha_saved_pool"):
            state.pop(k, None)
        state["_mha_config"] = self._cmod.config()
        return state

    def __setstate__(self, state):
        c = state.pop("_mha_config")
        self.__dict__.update(state)
        self._cmod = _mha.Module(c["embed_dim"], c["num_heads"], kdim=c["kdim"], vdim=c["vdim"],
                                 bias=c["bias"], add_bias_kv=c["add_bias_kv"],
                                 add_zero_attn=c["add_zero_attn"],
                                 batch_first=c["batch_first"], dropout=c["dropout"],
                                 num_kv_heads=c["num_kv_heads"], head_gate=c["head_gate"])
        self._views = {n: torch.from_numpy(np.asarray(self._cmod.param(n)))
                       for n in self._names}  # filled from the parameters by _mha_sync

    def extra_repr(self):
        return "embed_dim=%d, num_heads=%d, num_kv_heads=%d, batch_first=%s, dropout=%g" % (
            self.embed_dim, self.num_heads, self.num_kv_heads, self.batch_first, self.dropout)

    def save(self, path):
        """The parameters as safetensors (PyTorch's names)."""
        self._mha_sync().save(str(path))

    def forward(self, query, key=None, value=None, key_padding_mask=None, need_weights=True,
                attn_mask=None, average_attn_weights=True, is_causal=False, **extras):
        if key is None and value is None:
            key = value = query
        elif key is None or value is None:
            raise ValueError("give both key and value, or neither (self-attention)")
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor):
                raise TypeError("%s: expected a torch.Tensor, got %s" % (name, type(t).__name__))
        cmod = self._mha_sync()
        ac = _autocast_dtype()
        autocast = (ac is not None and query.dtype == torch.float32 and
                    self._views[next(n for n in self._names
                                     if n.endswith("weight"))].dtype == torch.float32)
        if autocast:
            # torch.autocast("cpu", dtype=ac): as torch's module under it, the
            # projections and attention in ac: a copy of the module with its
            # weight matrices in ac (biases float32), the inputs cast to ac
            # (self-attention stays self-attention); float32 gradients for
            # the float32 parameters and inputs
            cmod = cmod.convert(self._HALF[ac])
            q_ = query.to(ac)
            k_ = q_ if key is query else key.to(ac)
            v_ = k_ if value is key else (q_ if value is query else value.to(ac))
            query, key, value = q_, k_, v_
        opts = dict(self._extras, **extras)
        is_causal, attn_mask = causal_hint(is_causal, attn_mask, key_padding_mask, need_weights)
        kw = forward_kwargs("mha.torch.MultiheadAttention.forward()", is_causal=is_causal,
                            need_weights=need_weights,
                            average_attn_weights=average_attn_weights, as_int64=_int64,
                            as_float32=_float32, **opts)
        if self.training and self.dropout > 0.0:
            kw.update(training=True, dropout_seed=_seed())
        params = [self._param(n) for n in self._names]
        grad = torch.is_grad_enabled() and (
            query.requires_grad or key.requires_grad or value.requires_grad or
            any(p.requires_grad for p in params))
        call = {"kw": kw, "kpm": _mask(key_padding_mask, "key_padding_mask"),
                "am": _mask(attn_mask, "attn_mask"), "grad": grad, "names": self._names}
        if autocast:
            call["cmod"] = cmod
        if not grad:  # no graph: straight to the library
            q, k, v = _qkv(query, key, value, key is query, value is key)
            out, w = _mha.forward(cmod, q, k, v, call["kpm"], call["am"], _alloc, **kw)
            return _t(out), _t(w)
        return _MHAFunction.apply(self, call, query, key, value, *params)


# ---------------------------------------------------------------------------
# Hugging Face checkpoints

class CheckpointAttention(nn.Module):
    """The attention of one layer of a Hugging Face checkpoint, as a
    torch.nn.Module with autograd (mha.CheckpointAttention's counterpart).

    CheckpointAttention(path, layer=0, dtype=None)
    forward(hidden_states, position_ids=None, attention_mask=None, *,
            impl="auto") -> attn_output

    hidden_states (N, L, E) float32 (or float64: the reference); the
    parameters (.attn, a MultiheadAttention: in_proj_weight with the q, k, v
    rows packed, out_proj, ...) and hidden_states get gradients.
    dtype: the weight matrices' storage, torch.float32 (None, the default),
    torch.bfloat16 or torch.float16, or "auto": config.json's torch_dtype
    (float32 when absent); half weights load as stored (no float32 copy)
    and take hidden_states of that dtype, as MultiheadAttention(...).to(dtype)
    does (gradients in that dtype).
    """

    def __init__(self, path, layer=0, dtype=None):
        super().__init__()
        if isinstance(layer, bool) or int(layer) != layer or layer < 0:
            raise ValueError("layer must be a non-negative integer, got %r" % (layer,))
        if dtype == "auto":
            dtype = _config_dtype(path)
        names = {None: "F32", torch.float32: "F32", torch.bfloat16: "BF16",
                 torch.float16: "F16"}
        if dtype not in names:
            raise TypeError("dtype: torch.float32, torch.bfloat16, torch.float16 or 'auto', "
                            "got %r" % (dtype,))
        cmod, info = _mha.load_checkpoint(str(path), int(layer), names[dtype])
        self.attn = MultiheadAttention._from_cmod(cmod)
        self._layer = info
        self.config = info.info()

    def extra_repr(self):
        return "model_type=%s, layer=%d" % (self.config["model_type"], self.config["layer"])

    def forward(self, hidden_states, position_ids=None, attention_mask=None, *, impl="auto"):
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError("hidden_states: expected a torch.Tensor, got %s"
                            % type(hidden_states).__name__)
        if hidden_states.dim() != 3:
            raise ValueError("hidden_states: expected (N, L, E), got shape %s"
                             % (tuple(hidden_states.shape),))
        n, l = hidden_states.shape[0], hidden_states.shape[1]
        attn = self.attn
        cmod = attn._mha_sync()
        kw = forward_kwargs("mha.torch.CheckpointAttention.forward()", impl=impl)
        kw["checkpoint"] = self._layer
        kw.update(_np_api._positions(_host(position_ids), n, l, self.config["rope_mode"]))
        kpm = _np_api._padding(_host(attention_mask), n, l)
        params = [attn._param(nm) for nm in attn._names]
        grad = torch.is_grad_enabled() and (hidden_states.requires_grad or
                                            any(p.requires_grad for p in params))
        call = {"kw": kw, "kpm": kpm, "am": None, "grad": grad, "names": attn._names}
        if not grad:
            q = _np(hidden_states, "hidden_states")
            out, _ = _mha.forward(cmod, q, q, q, kpm, None, _alloc, **kw)
            return _t(out)
        out, _ = _MHAFunction.apply(attn, call, hidden_states, hidden_states, hidden_states,
                                    *params)
        return out


def _config_dtype(path):
    """config.json's torch_dtype (or dtype) as a torch dtype: bfloat16,
    float16, else float32."""
    import json
    try:
        with open(os.path.join(str(path), "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return torch.float32  # (the load names the problem)
    name = cfg.get("torch_dtype", cfg.get("dtype")) if isinstance(cfg, dict) else None
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(name, torch.float32)


def from_pretrained(path, layer=0, dtype=None):
    """The attention of layer `layer` of the Hugging Face checkpoint in
    directory `path`, as a torch.nn.Module (CheckpointAttention); dtype as
    there."""
    return CheckpointAttention(path, layer, dtype)


# ---------------------------------------------------------------------------
# autograd: scaled dot-product attention on (B, H, L, D) tensors

class _SDPAFunction(torch.autograd.Function):
    # sinks: the caller's tensor (one logit per query head) or None, an input
    # only so that autograd gives it its gradient; kw holds its float32 copy
    @staticmethod
    def forward(ctx, q, k, v, sinks, mask, kw):
        out, w = _mha.sdpa(_np(q, "query"), _np(k, "key"), _np(v, "value"), mask, None, _alloc,
                           **kw)
        ctx.mask, ctx.kw = mask, dict(kw)
        ctx.kw.pop("need_weights", None)
        ctx.sinks_meta = None if sinks is None else (sinks.shape, sinks.dtype)
        ctx.save_for_backward(q, k, v)
        return _outputs(ctx, out, w)

    @staticmethod
    def backward(ctx, grad_out, grad_w):
        q, k, v = ctx.saved_tensors
        if grad_out is None:
            return None, None, None, None, None, None
        dq, dk, dv, ds = _mha.sdpa_backward(_np(q, "query"), _np(k, "key"), _np(v, "value"),
                                            ctx.mask, None,
                                            _np(_grad_out(grad_out), "grad_out"), _alloc,
                                            **ctx.kw)
        dsinks = None
        if ctx.sinks_meta is not None and ctx.needs_input_grad[3]:
            shape, dtype = ctx.sinks_meta  # (the float32 gradient in the sinks' dtype)
            dsinks = _t(ds).to(dtype).reshape(shape)
        return _t(dq), _t(dk), _t(dv), dsinks, None, None


def _collapse(x, lead, tail):
    return x.expand(lead + tail).reshape((int(np.prod(lead, dtype=np.int64)),) + tail)


def _autocast_dtype():
    """The dtype torch.autocast("cpu", ...) computes its lower-precision ops
    in where it is on here, else None."""
    if hasattr(torch, "get_autocast_dtype"):  # PyTorch 2.4+
        on, dt = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
    else:  # PyTorch 1.13
        on, dt = torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()
    return dt if on and dt in (torch.bfloat16, torch.float16) else None


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, *,
                                 return_weights=False, window=None, window_left=-1,
                                 window_right=-1, softcap=0.0, alibi_slopes=None, sinks=None,
                                 impl="auto"):
    """torch.nn.functional.scaled_dot_product_attention computed by mha,
    differentiable in query, key and value (autograd).

    Any leading dims (broadcast); a bool attn_mask's True takes part, a float
    mask is added; is_causal is top-left for L != S; enable_gqa lets the
    key's heads divide the query's. dropout_p > 0 draws its Philox seed
    from torch's generator. Under torch.autocast("cpu", dtype=...) float32
    query, key and value are cast to that dtype first, as torch's own
    scaled_dot_product_attention is (the output in it; the gradients flow
    back through the cast). Extras: return_weights (also the weights, not
    differentiated), window ((left, right), None unbounded) or window_left /
    window_right, softcap, alibi_slopes (one per query head), sinks (one
    logit per query head joining each row's softmax denominator;
    differentiated when it is a tensor that requires grad), impl."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError("%s: expected a torch.Tensor, got %s" % (name, type(t).__name__))
    ac = _autocast_dtype()
    if ac is not None:
        query, key, value = (x.to(ac) if x.dtype == torch.float32 else x
                             for x in (query, key, value))
    lead, hq, hkv, q_heads = sdpa_layout(tuple(query.shape), tuple(key.shape),
                                         tuple(value.shape), enable_gqa)
    L, S = query.shape[-2], key.shape[-2]
    q3, k3, v3 = (x if x.dim() >= 3 else x.unsqueeze(0) for x in (query, key, value))
    q4 = _collapse(q3, lead, (q_heads,) + tuple(q3.shape[-2:]))
    k4 = _collapse(k3, lead, tuple(k3.shape[-3:]))
    v4 = _collapse(v3, lead, tuple(v3.shape[-3:]))
    mask = None
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError("attn_mask: expected a torch.Tensor, got %s"
                            % type(attn_mask).__name__)
        m = attn_mask
        if m.dtype == torch.bool:
            m = ~m  # torch: True takes part; mha: nonzero is masked out
        elif not m.dtype.is_floating_point:
            raise TypeError("attn_mask: dtype %s is not supported (bool or float)" % m.dtype)
        if m.dim() > 4 or len(lead) > 1:
            try:
                m = _collapse(m, lead, (q_heads, L, S))
            except RuntimeError:
                raise ValueError("attn_mask: shape %s does not broadcast to %s"
                                 % (tuple(attn_mask.shape), lead + (q_heads, L, S))) from None
        mask = _mask(m, "attn_mask")
    kw = sdpa_kwargs(is_causal=is_causal, scale=scale, window=window, window_left=window_left,
                     window_right=window_right, impl=impl, need_weights=return_weights,
                     dropout_p=dropout_p, softcap=softcap, alibi_slopes=alibi_slopes,
                     sinks=sinks, as_float32=_float32)
    if "dropout_p" in kw:
        kw["dropout_seed"] = _seed()
    st = sinks if isinstance(sinks, torch.Tensor) else None  # (autograd's input)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (q4, k4, v4, st)):
        kw["saved"] = _mha.Saved()  # the forward keeps its rows for the backward
    out, w = _SDPAFunction.apply(q4, k4, v4, st, mask, kw)
    out_shape = (lead + (q_heads, L, value.shape[-1]))[-max(query.dim(), key.dim()):]
    out = out.reshape(out_shape)
    if return_weights:
        return out, w.reshape(out_shape[:-1] + (S,))
    return out
