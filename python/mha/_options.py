"""Options shared by the numpy API (mha) and the PyTorch API (mha.torch):
mha's keyword extras turned into the C binding's keywords, and the shape
bookkeeping of scaled_dot_product_attention's leading dimensions."""

import math
import numbers

# mha_dtype codes (include/mha.h)
F32, F16, BF16, BOOL, I64, I32, U8, F64 = range(8)

_IMPL = {"auto": 0, "reference": 1, "ref": 1, "fused": 2}
_ROPE = {None: 0, "none": 0, "neox": 1, "interleaved": 2}


def impl_code(impl):
    try:
        return _IMPL[impl]
    except (KeyError, TypeError):
        raise ValueError("impl %r: expected 'auto', 'reference' or 'fused'" % (impl,)) from None


def window_bounds(window, window_left, window_right):
    """(left, right) from window=W (both sides), window=(left, right) or the
    two keywords; None and -1 mean unbounded."""
    if window is not None:
        if window_left != -1 or window_right != -1:
            raise ValueError("give window or window_left/window_right, not both")
        if isinstance(window, tuple):
            if len(window) != 2:
                raise ValueError("window: expected W or (left, right), got %r" % (window,))
            window_left, window_right = window
        else:
            window_left = window_right = window
    out = []
    for name, v in (("window_left", window_left), ("window_right", window_right)):
        if v is None:
            v = -1
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError("%s must be an integer, got %r" % (name, v))
        out.append(int(v))
    return out


def _block(name, block):
    if block is None:
        return -1, -1
    if not (isinstance(block, tuple) and len(block) == 2):
        raise ValueError("%s: expected (begin, end), got %r" % (name, block))
    b, e = block
    return int(b), -1 if e is None else int(e)


def real(name, v):
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError("%s must be a real number, got %r" % (name, v))
    return float(v)


def causal_hint(is_causal, attn_mask, key_padding_mask, need_weights):
    """(is_causal, attn_mask) as torch.nn.MultiheadAttention uses them:
    with both given, is_causal is a hint that attn_mask is the causal mask,
    and PyTorch 2 keeps one of the two: is_causal (the mask dropped) when
    there is no key_padding_mask and no weights are asked for, else the
    mask (the hint dropped). (is_causal alone, which PyTorch refuses, stays
    mha's causal mask.)"""
    if not is_causal or attn_mask is None:
        return is_causal, attn_mask
    if key_padding_mask is None and not need_weights:
        return True, None
    return False, attn_mask


# The keyword extras of the forward calls (forward_kwargs), as a message
# lists them.
EXTRAS = ("rope", "rope_theta", "rope_dim", "rope_start", "alibi", "softcap", "window",
          "window_left", "window_right", "weights_heads", "weights_rows", "impl", "trace",
          "sink_tokens")


def forward_kwargs(caller, *, is_causal=False, need_weights=False, average_attn_weights=True,
                   rope=None, rope_theta=10000.0, rope_dim=0, rope_start=None, alibi=False,
                   softcap=0.0, window=None, window_left=-1, window_right=-1,
                   weights_heads=None, weights_rows=None, impl="auto", trace=None,
                   sink_tokens=0, as_int64=None, as_float32=None, **unknown):
    """The C binding's forward keywords from the public extras of the call
    caller (its public name, e.g. "MultiheadAttention.forward()", which a
    keyword it does not take is reported under). as_int64 / as_float32 turn
    rope_start / alibi slopes into contiguous arrays (numpy or torch, as the
    caller's API)."""
    if unknown:
        raise TypeError("%s got an unexpected keyword argument %r (its extras: %s)"
                        % (caller, sorted(unknown)[0], ", ".join(EXTRAS)))
    kw = {}
    if is_causal:
        kw["is_causal"] = True
    if need_weights:
        kw["need_weights"] = True
        if not average_attn_weights:
            kw["average_attn_weights"] = False
    wl, wr = window_bounds(window, window_left, window_right)
    if wl != -1:
        kw["window_left"] = wl
    if wr != -1:
        kw["window_right"] = wr
    for name, block, keys in (("weights_heads", weights_heads, ("weights_head_begin",
                                                                   "weights_head_end")),
                              ("weights_rows", weights_rows, ("weights_row_begin",
                                                              "weights_row_end"))):
        if block is not None:
            kw[keys[0]], kw[keys[1]] = _block(name, block)
    if impl != "auto":
        kw["impl"] = impl_code(impl)
    if rope is not None:
        if rope not in _ROPE:
            raise ValueError("rope %r: expected None, 'neox' or 'interleaved'" % (rope,))
        kw["rope_mode"] = _ROPE[rope]
        kw["rope_theta"] = real("rope_theta", rope_theta)
        kw["rope_dim"] = int(rope_dim)
        if rope_start is not None:
            kw["rope_start"] = as_int64(rope_start)
    elif rope_start is not None:
        raise ValueError("rope_start is given but rope is None")
    if alibi is not False and alibi is not None:
        kw["alibi"] = True
        if alibi is not True:
            kw["alibi_slopes"] = as_float32(alibi)
    softcap = real("softcap", softcap)
    if softcap != 0.0:
        kw["softcap"] = softcap
    if sink_tokens:
        kw["sink_tokens"] = int(sink_tokens)
    if trace is not None:
        if not callable(trace):
            raise TypeError("trace must be callable(step, b, h, array)")
        kw["trace"] = trace
    return kw


def sdpa_kwargs(*, is_causal=False, scale=None, window=None, window_left=-1, window_right=-1,
                impl="auto", need_weights=False, dropout_p=0.0, softcap=0.0, alibi_slopes=None,
                sinks=None, as_float32=None):
    """The C binding's sdpa keywords; as_float32 turns the per-head vectors
    (alibi_slopes, sinks) into contiguous float32 arrays."""
    kw = {}
    if is_causal:
        kw["is_causal"] = True
    if scale is not None:
        kw["scale"] = real("scale", scale)
    wl, wr = window_bounds(window, window_left, window_right)
    if wl != -1:
        kw["window_left"] = wl
    if wr != -1:
        kw["window_right"] = wr
    if impl != "auto":
        kw["impl"] = impl_code(impl)
    if need_weights:
        kw["need_weights"] = True
    p = real("dropout_p", dropout_p)
    if not (0.0 <= p < 1.0):
        raise ValueError("dropout_p must be in [0, 1), got %r" % (dropout_p,))
    if p > 0.0:
        kw["dropout_p"] = p
    softcap = real("softcap", softcap)
    if softcap != 0.0:
        kw["softcap"] = softcap
    if alibi_slopes is not None:
        kw["alibi_slopes"] = as_float32(alibi_slopes, "alibi_slopes")
    if sinks is not None:
        kw["sinks"] = as_float32(sinks, "sinks")
    return kw


def sdpa_layout(qs, ks, vs, enable_gqa):
    """From the shapes of query (..., Hq, L, E), key (..., Hkv, S, E) and
    value (..., Hkv, S, Ev): (lead, Hq, Hkv, q_heads) where lead is the
    broadcast of the leading dims and q_heads the head count the query is
    expanded to (Hq, or Hkv when a one-head query broadcasts over the keys'
    heads, as torch's matmul broadcasting does)."""
    for name, s in (("query", qs), ("key", ks), ("value", vs)):
        if len(s) < 2:
            raise ValueError("%s: expected at least 2 dims (L, E), got shape %s" % (name, tuple(s)))
    if len(ks) != len(vs) or tuple(ks[:-1]) != tuple(vs[:-1]):
        raise ValueError("key %s and value %s must agree on every dim but the last"
                         % (tuple(ks), tuple(vs)))
    if qs[-1] != ks[-1]:
        raise ValueError("query's last dim %d differs from key's %d" % (qs[-1], ks[-1]))

    def split(s):
        return tuple(s[:-3]), (s[-3] if len(s) >= 3 else 1)

    ql, hq = split(qs)
    kl, hkv = split(ks)
    lead = _broadcast(ql, kl, qs, ks)
    q_heads = hq
    if hq != hkv:
        if enable_gqa:
            if hkv == 0 or hq % hkv:
                raise ValueError("enable_gqa: the query's %d heads are not a multiple of the "
                                 "key's %d" % (hq, hkv))
        elif hkv == 1:
            pass  # one KV head broadcast over the query heads (multi-query)
        elif hq == 1:
            q_heads = hkv  # one query head broadcast over the KV heads
        else:
            raise ValueError("query has %d heads, key %d: they must match, or one be 1 "
                             "(broadcast), or pass enable_gqa=True" % (hq, hkv))
    return lead, hq, hkv, q_heads


def _broadcast(a, b, qs, ks):
    n = max(len(a), len(b))
    a = (1,) * (n - len(a)) + a
    b = (1,) * (n - len(b)) + b
    out = []
    for x, y in zip(a, b):
        if x != y and x != 1 and y != 1:
            raise ValueError("the leading dims of query %s and key %s do not broadcast"
                             % (tuple(qs), tuple(ks)))
        out.append(max(x, y))
    return tuple(out)


def numel(shape):
    return int(math.prod(shape))
