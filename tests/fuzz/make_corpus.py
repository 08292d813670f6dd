#!/usr/bin/python3
"""Writes the fuzzers' seed corpora: tests/fuzz/corpus/<target>/seed-*.

    tests/fuzz/make_corpus.py [--out DIR]     (default: tests/fuzz/corpus)

Python 3 standard library only; the output is the same on every run (fixed
values, no randomness), so the committed seeds can be checked with
`git diff` after running it. Only seed-* files are written (after removing
the old ones); regress-* files (inputs that once crashed, kept as found) are
left alone.

safetensors/ (fuzz_safetensors: the reader on arbitrary bytes):
  valid files: every module layout below, the input files, every dtype, a
  0-d scalar, zero-size tensors, metadata only, an empty header, escaped
  and non-ASCII names; and one malformed file per class: empty / short
  file, header length huge, beyond the file or over the limit, offsets
  beyond the file, overlapping data_offsets, a gap, begin > end, dims whose
  product overflows int64, shape x dtype size overflowing size_t, negative,
  fractional, too large and non-numeric dims, too many dims, non-UTF-8
  names (raw bytes, overlong, surrogates), duplicate names, __metadata__
  of the wrong type (array, number, string, null, object of objects),
  non-string metadata values, duplicate metadata keys, trailing bytes,
  unknown dtypes, missing / unknown / repeated entry keys, a non-object
  header, invalid JSON, junk after the JSON, a byte-order mark, a control
  byte, \\u0000 in a name, deep nesting.

checkpoint/ (fuzz_checkpoint: config.json and the index of a Hugging Face
checkpoint, beside fixed shard files): every architecture's config, single
file, index, shards in a subdirectory, RoPE scaling spellings; and shard
paths with "..", absolute, a symlink out, missing, not safetensors, lacking
its tensor; configs and indexes that are not JSON, of wrong types, with
unknown model_type / rope_type / layer type, shapes the tensors disagree
with.

forward/ (fuzz_forward: weights + inputs files to mha_forward; layout in
tests/fuzz/fuzz_forward.c): 12 control bytes (flags, num_heads, window,
weights block, cached path, seed, W) + a weights file of W bytes + an
inputs file. Modules: packed; separate kdim/vdim; bias_kv without biases;
GQA with num_kv_heads metadata and without (from the shapes); MQA; static
head_gate; dynamic gate_proj.*; pruned_heads metadata; BF16 / F16 / F64
weight files. Inputs: self- and cross-attention, batched, batch-first and
unbatched, BOOL/U8/float masks (key_padding_mask, attn_mask (L, S) and
(N*H, L, S)), F16/BF16/F64 inputs, zero-length sequences. Plus malformed
modules and inputs (bad metadata values, shapes that disagree, unknown
tensors, integer dtypes, missing tensors).
"""
import argparse
import json
import math
import os
import struct

# ---------------------------------------------------------------------------
# Encoding

DTYPE_SIZE = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "BOOL": 1, "U8": 1,
              "I32": 4, "I64": 8}


def values(n, seed, scale=0.5):
    """n deterministic values in (-scale, scale) (a fixed linear recurrence)."""
    out, x = [], (seed * 2654435761 + 12345) % 2**32
    for _ in range(n):
        x = (1103515245 * x + 12345) % 2**31
        out.append(scale * (2.0 * x / 2**31 - 1.0))
    return out


def bf16_bits(v):
    (u,) = struct.unpack("<I", struct.pack("<f", v))
    if math.isnan(v):
        return 0x7FC0
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def encode(dtype, vals):
    n = len(vals)
    if dtype == "F32":
        return struct.pack("<%df" % n, *vals)
    if dtype == "F64":
        return struct.pack("<%dd" % n, *vals)
    if dtype == "F16":
        return struct.pack("<%de" % n, *vals)
    if dtype == "BF16":
        return struct.pack("<%dH" % n, *[bf16_bits(v) for v in vals])
    if dtype in ("BOOL", "U8"):
        return bytes(int(v) & 0xFF for v in vals)
    if dtype == "I32":
        return struct.pack("<%di" % n, *[int(v) for v in vals])
    if dtype == "I64":
        return struct.pack("<%dq" % n, *[int(v) for v in vals])
    raise ValueError(dtype)


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def tensor(name, shape, dtype="F32", seed=0, vals=None):
    if vals is None:
        vals = values(numel(shape), seed + len(name))
    return (name, dtype, list(shape), encode(dtype, vals))


def st_file(tensors, meta=None, meta_first=True):
    """A valid safetensors image: tensors in order, header padded to 8."""
    header = {}
    if meta is not None and meta_first:
        header["__metadata__"] = meta
    off = 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [off, off + len(data)]}
        off += len(data)
    if meta is not None and not meta_first:
        header["__metadata__"] = meta
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(t[3] for t in tensors)


def raw(header, data=b"", hlen=None):
    """An image from a literal header (str or bytes) and data bytes."""
    if isinstance(header, str):
        header = header.encode()
    n = len(header) if hlen is None else hlen
    return struct.pack("<Q", n) + header + data


# ---------------------------------------------------------------------------
# Modules (state_dict names; E = 4, H = 2 unless said otherwise)

def module(E=4, H=2, kdim=None, vdim=None, bias=True, bias_kv=False, hkv=None,
           gate=None, dtype="F32", meta=True, pruned=None, seed=1):
    d = E // H
    ekv = (hkv or H) * d
    ts = []
    if kdim is None and vdim is None:
        ts.append(tensor("in_proj_weight", (E + 2 * ekv, E), dtype, seed))
    else:
        ts.append(tensor("q_proj_weight", (E, E), dtype, seed))
        ts.append(tensor("k_proj_weight", (ekv, kdim or E), dtype, seed + 1))
        ts.append(tensor("v_proj_weight", (ekv, vdim or E), dtype, seed + 2))
    if bias:
        ts.append(tensor("in_proj_bias", (E + 2 * ekv,), "F32", seed + 3))
    if bias_kv:
        ts.append(tensor("bias_k", (1, 1, ekv), "F32", seed + 4))
        ts.append(tensor("bias_v", (1, 1, ekv), "F32", seed + 5))
    ts.append(tensor("out_proj.weight", (E, E), dtype, seed + 6))
    if bias:
        ts.append(tensor("out_proj.bias", (E,), "F32", seed + 7))
    if gate == "static":
        ts.append(tensor("head_gate", (H,), "F32", seed + 8))
    elif gate == "dynamic":
        ts.append(tensor("gate_proj.weight", (H, E), "F32", seed + 9))
        ts.append(tensor("gate_proj.bias", (H,), "F32", seed + 10))
    md = None
    if meta:
        md = {"num_heads": str(H)}
        if hkv and hkv != H:
            md["num_kv_heads"] = str(hkv)
        if pruned is not None:
            md["pruned_heads"] = pruned
    return ts, md


def module_file(**kw):
    ts, md = module(**kw)
    return st_file(ts, md)


def inputs(L=3, N=2, S=None, E=4, kdim=None, vdim=None, batch_first=False,
           unbatched=False, dtype="F32", kpm=None, attn=None, H=2, seed=20):
    """query (and key/value when S is given); masks: kpm/attn a dtype name;
    attn may be "F32-3d" / "BOOL-3d" for the (N*H, L, S) form."""
    def shp(T, F):
        if unbatched:
            return (T, F)
        return (N, T, F) if batch_first else (T, N, F)
    ts = [tensor("query", shp(L, E), dtype, seed)]
    S_eff = L
    if S is not None:
        ts.append(tensor("key", shp(S, kdim or E), dtype, seed + 1))
        ts.append(tensor("value", shp(S, vdim or E), dtype, seed + 2))
        S_eff = S
    if kpm:
        shape = (S_eff,) if unbatched else (N, S_eff)
        vals = [1 if (i % 3 == 2) else 0 for i in range(numel(shape))]
        if kpm in ("F32", "F64"):
            vals = [-math.inf if v else 0.0 for v in vals]
        ts.append(tensor("key_padding_mask", shape, kpm, vals=vals))
    if attn:
        dt, _, three = attn.partition("-")
        shape = ((H if unbatched else N * H), L, S_eff) if three else (L, S_eff)
        n = numel(shape)
        if dt in ("BOOL", "U8"):
            vals = [1 if (i % 4 == 3) else 0 for i in range(n)]
        else:
            vals = values(n, seed + 5, 2.0)
        ts.append(tensor("attn_mask", shape, dt, vals=vals))
    return st_file(ts)


# ---------------------------------------------------------------------------
# fuzz_forward seeds

def control(flags0=0, heads=0, flags2=0, window=0xFF, block=0, flags5=0, seed=0):
    return bytes([flags0, heads, flags2, window, block, flags5, seed & 0xFF,
                  (seed >> 8) & 0xFF])


def fwd(ctrl, weights, inp):
    return ctrl + struct.pack("<I", len(weights)) + weights + inp


BF16_IN, F16_IN = 0x10, 0x20


def forward_seeds():
    s = {}
    packed = module_file()
    sep = module_file(kdim=3, vdim=5)
    s["packed-self"] = fwd(control(), packed, inputs())
    s["packed-cross-masks"] = fwd(control(flags0=0x08), packed,
                                  inputs(S=5, kpm="BOOL", attn="F32"))
    s["packed-causal-cached"] = fwd(control(flags0=0x02, flags5=0x01), packed,
                                    inputs(L=4))
    s["packed-cached-int8-chunks"] = fwd(control(flags5=0x07), packed, inputs(L=5))
    s["packed-cached-int4-chunks"] = fwd(control(flags5=0x17), packed, inputs(L=5))
    # training steps (flags5 0x20): float32; half weights (float32 compute);
    # bf16 weights and inputs 32 wide (the bf16 training compute), dropout
    s["packed-training-step"] = fwd(control(flags0=0x02, flags5=0x20), packed, inputs())
    s["packed-training-step-f16-weights"] = fwd(control(flags2=0x02, flags5=0x20), packed,
                                                inputs(S=3))
    s["bf16-training-step-e32"] = fwd(
        control(flags0=BF16_IN, flags2=0x41, flags5=0x20, seed=3),
        module_file(E=32, H=2), inputs(E=32, dtype="BF16"))
    s["packed-batch-first-window"] = fwd(
        control(flags0=0x01, flags2=0x10, window=0x21), packed,
        inputs(batch_first=True, S=4, attn="U8-3d"))
    s["packed-unbatched-alibi-softcap"] = fwd(
        control(flags0=0xC0), packed, inputs(unbatched=True, attn="BOOL"))
    s["packed-f16-inputs-rope"] = fwd(control(flags0=F16_IN, flags2=0x04), packed,
                                      inputs(dtype="F16"))
    s["packed-bf16-inputs-interleaved"] = fwd(
        control(flags0=BF16_IN, flags2=0x08), packed, inputs(dtype="BF16", S=2))
    s["packed-f64-inputs"] = fwd(control(), packed, inputs(dtype="F64", kpm="F64"))
    s["packed-training-dropout"] = fwd(control(flags2=0x40, seed=7), packed,
                                       inputs(S=6, kpm="U8"))
    s["packed-weights-block-u8"] = fwd(control(flags0=0x08, flags2=0xA0, block=0x15),
                                       packed, inputs(L=4, S=3))
    s["packed-ex-workspace"] = fwd(control(flags5=0x08), packed, inputs(S=3))
    s["packed-bf16-weights"] = fwd(control(flags2=0x01), packed, inputs())
    s["packed-f16-weights-zero-attn"] = fwd(control(flags0=0x04, flags2=0x02),
                                            packed, inputs(S=3))
    s["packed-zero-length"] = fwd(control(), packed, inputs(L=0, S=0))
    s["packed-zero-batch"] = fwd(control(), packed, inputs(N=0))
    # a training step on nothing: the saved state's buffer is empty (it was
    # NULL, and the forward offset from it)
    s["packed-training-zero-length"] = fwd(control(flags5=0x20), packed, inputs(L=0, S=0))
    s["packed-training-zero-batch"] = fwd(control(flags5=0x20), packed, inputs(N=0))
    s["cross-training-zero-length"] = fwd(control(flags5=0x20), sep,
                                          inputs(L=0, S=0, kdim=3, vdim=5))
    s["heads-from-control"] = fwd(control(heads=4), module_file(meta=False),
                                  inputs())
    s["separate-kdim-vdim"] = fwd(control(), sep, inputs(S=4, kdim=3, vdim=5,
                                                          kpm="BOOL"))
    s["bias-kv"] = fwd(control(flags0=0x04), module_file(bias=False, bias_kv=True),
                       inputs(S=3))
    s["gqa-meta"] = fwd(control(flags0=0x08), module_file(E=8, H=4, hkv=2),
                        inputs(E=8, H=4, S=3, attn="F32-3d"))
    s["gqa-from-shapes"] = fwd(control(), st_file(*_no_kv_meta(E=8, H=4, hkv=2)),
                               inputs(E=8, H=4))
    s["mqa-separate"] = fwd(control(flags5=0x01), module_file(E=8, H=4, hkv=1,
                                                              kdim=8, vdim=6),
                            inputs(E=8, H=4, S=2, kdim=8, vdim=6))
    s["gate-static"] = fwd(control(), module_file(gate="static"), inputs())
    s["gate-dynamic"] = fwd(control(flags0=0x08), module_file(gate="dynamic"),
                            inputs(S=3))
    s["pruned-heads"] = fwd(control(flags0=0x08), module_file(pruned="1"),
                            inputs())
    s["pruned-gqa"] = fwd(control(), module_file(E=8, H=4, hkv=2, pruned="0,2"),
                          inputs(E=8, H=4))
    s["f64-weights-file"] = fwd(control(), module_file(dtype="F64"), inputs())
    s["bf16-weights-file"] = fwd(control(flags2=0x01), module_file(dtype="BF16"),
                                 inputs())
    # Malformed modules.
    ts, md = module()
    s["bad-num-heads-zero"] = fwd(control(), st_file(ts, {"num_heads": "0"}), inputs())
    s["bad-num-heads-text"] = fwd(control(), st_file(ts, {"num_heads": "two"}),
                                  inputs())
    s["bad-num-heads-huge"] = fwd(control(), st_file(ts, {
        "num_heads": "99999999999999999999"}), inputs())
    s["bad-num-heads-not-dividing"] = fwd(control(), st_file(ts, {"num_heads": "3"}),
                                          inputs())
    s["bad-num-kv-heads"] = fwd(control(), st_file(ts, {"num_heads": "2",
                                                        "num_kv_heads": "3"}),
                                inputs())
    for name, val in (("range", "2"), ("empty-item", "1,,0"), ("too-many", "0,0,0"),
                      ("sign", "-1"), ("space", "0, 1")):
        s["bad-pruned-" + name] = fwd(control(), st_file(ts, {"num_heads": "2",
                                                              "pruned_heads": val}),
                                      inputs())
    s["bad-unknown-tensor"] = fwd(control(), st_file(
        ts + [tensor("extra", (2,))], md), inputs())
    s["bad-int-weights"] = fwd(control(), st_file(
        [tensor("in_proj_weight", (12, 4), "I32", vals=[1] * 48)] + ts[1:], md),
        inputs())
    s["bad-no-out-proj"] = fwd(control(), st_file(ts[:2] + ts[3:], md), inputs())
    s["bad-in-proj-shape"] = fwd(control(), st_file(
        [tensor("in_proj_weight", (10, 4))] + ts[1:], md), inputs())
    s["bad-both-packed-and-separate"] = fwd(control(), st_file(
        ts + [tensor("q_proj_weight", (4, 4))], md), inputs())
    s["bad-gates-mixed"] = fwd(control(), st_file(
        ts + [tensor("head_gate", (2,)), tensor("gate_proj.weight", (2, 4))], md),
        inputs())
    # Malformed inputs.
    s["bad-query-4d"] = fwd(control(), packed, st_file([tensor("query", (1, 3, 2, 4))]))
    s["bad-key-without-value"] = fwd(control(), packed, st_file(
        [tensor("query", (3, 2, 4)), tensor("key", (3, 2, 4))]))
    s["bad-mask-i64"] = fwd(control(), packed, st_file(
        [tensor("query", (3, 2, 4)), tensor("attn_mask", (3, 3), "I64", vals=[0] * 9)]))
    s["bad-mask-shape"] = fwd(control(), packed, inputs(attn="F32-3d", H=3))
    s["bad-kpm-shape"] = fwd(control(), packed, st_file(
        [tensor("query", (3, 2, 4)), tensor("key_padding_mask", (3, 2), "BOOL",
                                            vals=[0] * 6)]))
    s["bad-feature-dim"] = fwd(control(), packed, inputs(E=5))
    s["bad-batch-mismatch"] = fwd(control(), packed, st_file(
        [tensor("query", (3, 2, 4)), tensor("key", (3, 1, 4)), tensor("value", (3, 1, 4))]))
    s["bad-unknown-input"] = fwd(control(), packed, st_file(
        [tensor("query", (3, 2, 4)), tensor("queries", (1,))]))
    s["bad-no-query"] = fwd(control(), packed, st_file([tensor("key", (3, 2, 4))]))
    s["bad-weights-truncated"] = fwd(control(), packed[:-7], inputs())
    return s


def _no_kv_meta(**kw):
    ts, md = module(**kw)
    md.pop("num_kv_heads", None)
    return ts, md


# ---------------------------------------------------------------------------
# fuzz_safetensors seeds

def safetensors_seeds():
    s = {}
    s["ok-module-packed"] = module_file()
    s["ok-module-separate"] = module_file(kdim=3, vdim=5)
    s["ok-module-bias-kv"] = module_file(bias=False, bias_kv=True)
    s["ok-module-gqa"] = module_file(E=8, H=4, hkv=2, pruned="1,3")
    s["ok-module-gates"] = module_file(gate="dynamic")
    s["ok-module-bf16"] = module_file(dtype="BF16", gate="static")
    s["ok-inputs-masks"] = inputs(S=5, kpm="BOOL", attn="F32-3d")
    s["ok-inputs-f16"] = inputs(dtype="F16", unbatched=True, kpm="U8")
    s["ok-all-dtypes"] = st_file(
        [tensor("f32", (2, 3)), tensor("f16", (3,), "F16"), tensor("bf16", (2, 2), "BF16"),
         tensor("f64", (2,), "F64"), tensor("bool", (4,), "BOOL", vals=[0, 1, 2, 255]),
         tensor("u8", (3,), "U8", vals=[0, 7, 255]),
         tensor("i32", (2,), "I32", vals=[-2**31, 2**31 - 1]),
         tensor("i64", (2,), "I64", vals=[-2**63, 2**63 - 1])],
        {"format": "pt", "num_heads": "2"}, meta_first=False)
    s["ok-specials"] = st_file([tensor("special", (6,), "F32", vals=[
        math.inf, -math.inf, math.nan, 3.4e38, -0.0, 1e-45]),
        tensor("special16", (4,), "F16", vals=[math.inf, 65504.0, 6e-8, math.nan])])
    s["ok-scalar"] = st_file([tensor("scalar", (), "F32", vals=[42.0])])
    s["ok-zero-size"] = st_file([tensor("empty0", (0, 3)), tensor("a", (2,)),
                                 tensor("empty1", (4, 0, 2**40), "F64"),
                                 tensor("empty2", (0,), "BOOL", vals=[])])
    s["ok-metadata-only"] = st_file([], {"num_heads": "4", "pruned_heads": "",
                                         "caf\u00e9": "\u65e5\u672c"})
    s["ok-empty-header"] = raw("{}      ")
    s["ok-names"] = st_file([tensor("caf\u00e9 \"q\" \\ \t", (1,)),
                             tensor("\U0001F600", (1,))])
    s["ok-padded"] = raw('{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}\t\n\r  ',
                         b"\x01\x02")
    s["ok-exponent-ints"] = raw(
        '{"a":{"dtype":"U8","shape":[2.0e0],"data_offsets":[0,2E0]}}', b"\x01\x02")

    one = '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    s["bad-empty-file"] = b""
    s["bad-short-file"] = b"\x10\x00\x00\x00\x00\x00\x00"
    s["bad-header-len-huge"] = raw(one, bytes(8), hlen=2**64 - 1)
    s["bad-header-len-beyond-file"] = raw(one, bytes(8), hlen=4096)
    s["bad-header-len-over-limit"] = raw(one, bytes(8), hlen=100 * 1024 * 1024 + 1)
    s["bad-header-len-short"] = raw(one, bytes(8), hlen=20)
    s["bad-offsets-beyond-file"] = raw(
        '{"a":{"dtype":"F32","shape":[100],"data_offsets":[0,400]}}', bytes(16))
    s["bad-offsets-overlap"] = raw(
        '{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},'
        '"b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}}', bytes(24))
    s["bad-offsets-gap"] = raw(
        '{"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}', bytes(12))
    s["bad-offsets-begin-after-end"] = raw(
        '{"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}}', bytes(8))
    s["bad-offsets-three"] = raw(
        '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}}', bytes(8))
    s["bad-offsets-negative"] = raw(
        '{"a":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}}', bytes(8))
    s["bad-dims-overflow-int64"] = raw(
        '{"a":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],'
        '"data_offsets":[0,0]}}')
    s["bad-dims-overflow-bytes"] = raw(
        '{"a":{"dtype":"F64","shape":[2147483648,2147483648],"data_offsets":[0,0]}}')
    s["bad-dims-2p53"] = raw(
        '{"a":{"dtype":"U8","shape":[9007199254740992],"data_offsets":[0,0]}}')
    s["bad-dims-negative"] = raw(
        '{"a":{"dtype":"F32","shape":[-1,2],"data_offsets":[0,8]}}', bytes(8))
    s["bad-dims-fraction"] = raw(
        '{"a":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}}', bytes(8))
    s["bad-dims-string"] = raw(
        '{"a":{"dtype":"F32","shape":["2"],"data_offsets":[0,8]}}', bytes(8))
    s["bad-dims-1e300"] = raw(
        '{"a":{"dtype":"F32","shape":[1e300],"data_offsets":[0,8]}}', bytes(8))
    s["bad-dims-nine"] = raw(
        '{"a":{"dtype":"U8","shape":[1,1,1,1,1,1,1,1,1],"data_offsets":[0,1]}}', b"\x00")
    s["bad-shape-not-array"] = raw(
        '{"a":{"dtype":"F32","shape":2,"data_offsets":[0,8]}}', bytes(8))
    s["bad-size-mismatch"] = raw(
        '{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}', bytes(8))
    s["bad-name-invalid-utf8"] = raw(
        b'{"\xff\xfe":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\x00")
    s["bad-name-overlong"] = raw(
        b'{"\xc0\xaf":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\x00")
    s["bad-name-surrogate"] = raw(
        b'{"\xed\xa0\x80":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\x00")
    s["bad-name-escaped-surrogate"] = raw(
        '{"\\udc00":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\x00")
    s["bad-name-nul-escape"] = raw(
        '{"a\\u0000b":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\x00")
    s["bad-name-empty"] = raw(
        '{"":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\x00")
    s["bad-name-duplicate"] = raw(
        '{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
        '"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}', b"\x00\x01")
    for kind, val in (("array", '["num_heads","2"]'), ("number", "2"),
                      ("string", '"num_heads=2"'), ("null", "null"),
                      ("object-of-objects", '{"num_heads":{"v":"2"}}')):
        s["bad-metadata-" + kind] = raw('{"__metadata__":%s}' % val)
    for kind, val in (("number", "2"), ("null", "null"), ("bool", "true"),
                      ("array", '["2"]')):
        s["bad-metadata-value-" + kind] = raw('{"__metadata__":{"num_heads":%s}}' % val)
    s["bad-metadata-twice"] = raw('{"__metadata__":{},"__metadata__":{}}')
    s["bad-metadata-key-twice"] = raw('{"__metadata__":{"k":"1","k":"2"}}')
    s["bad-metadata-invalid-utf8"] = raw(b'{"__metadata__":{"k":"\xff"}}')
    s["bad-trailing-bytes"] = raw(one, bytes(12))
    s["bad-missing-bytes"] = raw(one, bytes(4))
    s["bad-dtype-unknown"] = raw(
        '{"a":{"dtype":"F8_E4M3","shape":[1],"data_offsets":[0,1]}}', b"\x00")
    s["bad-dtype-lowercase"] = raw(
        '{"a":{"dtype":"f32","shape":[1],"data_offsets":[0,4]}}', bytes(4))
    s["bad-dtype-number"] = raw(
        '{"a":{"dtype":0,"shape":[1],"data_offsets":[0,4]}}', bytes(4))
    s["bad-entry-missing-key"] = raw('{"a":{"dtype":"F32","shape":[1]}}', bytes(4))
    s["bad-entry-unknown-key"] = raw(
        '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}}', bytes(4))
    s["bad-entry-key-twice"] = raw(
        '{"a":{"dtype":"F32","dtype":"F32","shape":[1],"data_offsets":[0,4]}}', bytes(4))
    s["bad-entry-not-object"] = raw('{"a":[0,4]}', bytes(4))
    s["bad-header-array"] = raw("[]      ")
    s["bad-header-number"] = raw("12345678")
    s["bad-header-invalid-json"] = raw('{"a":   ')
    s["bad-header-junk-after"] = raw("{} x    ")
    s["bad-header-bom"] = raw(b"\xef\xbb\xbf{}     ")
    s["bad-header-control-byte"] = raw(b'{"a\x01":{"dtype":"U8","shape":[1],'
                                       b'"data_offsets":[0,1]}}', b"\x00")
    s["bad-header-deep-nesting"] = raw('{"__metadata__":{"k":' + "[" * 2000 + "]" * 2000 +
                                       "}}")
    return s


def checkpoint_seeds():
    """fuzz_checkpoint: flags byte, config.json, 0, index, 0, model file
    (layout in tests/fuzz/fuzz_checkpoint.c; its fixed shards a, b, g, e,
    bad, link and sub/a .safetensors)."""
    def ck(flags, config, index=None, model=b""):
        c = config if isinstance(config, bytes) else json.dumps(config).encode()
        i = b"" if index is None else (index if isinstance(index, bytes) else
                                       json.dumps(index).encode())
        return bytes([flags | (0x10 if index is not None else 0)]) + c + b"\0" + i + b"\0" + model

    llama = {"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2,
             "num_key_value_heads": 1, "num_hidden_layers": 2}
    q = "model.layers.%d.self_attn.%s_proj.%s"
    both = {q % (l, p, w): ("a" if l == 0 else "b") + ".safetensors"
            for l in (0, 1) for p in "qkvo" for w in ("weight",)}
    both.update({q % (1, p, "bias"): "b.safetensors" for p in "qkvo"})
    s = {}
    s["llama-single"] = ck(0, llama)
    s["llama-single-bf16-layer1"] = ck(0x41, llama)
    s["llama-index"] = ck(0, llama, {"metadata": {}, "weight_map": both})
    s["llama-index-layer1-bias"] = ck(1, dict(llama, attention_bias=True), {"weight_map": both})
    s["llama-sub"] = ck(0, llama, {"weight_map": {q % (0, p, "weight"): "sub/a.safetensors"
                                                  for p in "qkvo"}})
    s["llama-rope-scaling"] = ck(0, dict(llama, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                              "low_freq_factor": 1.0,
                                                              "high_freq_factor": 4.0,
                                                              "original_max_position_embeddings": 32}))
    s["llama-rope-parameters-yarn"] = ck(0, dict(llama, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "truncate": False}))
    s["llama-rope-type-old"] = ck(0, dict(llama, rope_theta=500.0,
                                          rope_scaling={"type": "dynamic", "factor": 2.0}))
    s["mistral"] = ck(0, dict(llama, model_type="mistral", sliding_window=4))
    s["qwen2"] = ck(1, dict(llama, model_type="qwen2", use_sliding_window=True,
                            sliding_window=3, max_window_layers=1), {"weight_map": both})
    s["qwen3"] = ck(0, dict(llama, model_type="qwen3", head_dim=4, rms_norm_eps=1e-6))
    s["gemma2"] = ck(0, dict(llama, model_type="gemma2", head_dim=4, query_pre_attn_scalar=4,
                             sliding_window=6, layer_types=["sliding_attention",
                                                            "full_attention"]))
    s["gpt-oss"] = ck(0, dict(llama, model_type="gpt_oss", head_dim=4, sliding_window=4))
    gpt2 = {"model_type": "gpt2", "n_embd": 8, "n_head": 2, "n_layer": 1}
    gmap = {"h.0.attn.%s.%s" % (a, w): "g.safetensors" for a in ("c_attn", "c_proj")
            for w in ("weight", "bias")}
    s["gpt2"] = ck(0, gpt2, {"weight_map": gmap})
    s["gpt2-inverse-layer"] = ck(0, dict(gpt2, scale_attn_by_inverse_layer_idx=True,
                                         scale_attn_weights=False), {"weight_map": gmap})
    bert = {"model_type": "bert", "hidden_size": 8, "num_attention_heads": 2,
            "num_hidden_layers": 1, "position_embedding_type": "absolute"}
    emap = {"encoder.layer.0.attention.%s.%s" % (a, w): "e.safetensors"
            for a in ("self.query", "self.key", "self.value", "output.dense")
            for w in ("weight", "bias")}
    s["bert"] = ck(0, bert, {"weight_map": emap})
    one = lambda f: {"weight_map": {q % (0, "q", "weight"): f}}  # noqa: E731
    s["bad-shard-dotdot"] = ck(0, llama, one("../outside.safetensors"))
    s["bad-shard-absolute"] = ck(0, llama, one("/etc/passwd"))
    s["bad-shard-symlink-out"] = ck(0, llama, one("link.safetensors"))
    s["bad-shard-missing"] = ck(0, llama, one("nothing.safetensors"))
    s["bad-shard-not-safetensors"] = ck(0, llama, one("bad.safetensors"))
    s["bad-shard-lacks-tensor"] = ck(0, llama, one("b.safetensors"))
    s["bad-index-not-json"] = ck(0, llama, b"{\"weight_map\": ")
    s["bad-index-map-array"] = ck(0, llama, {"weight_map": ["a.safetensors"]})
    s["bad-index-value-number"] = ck(0, llama, {"weight_map": {"x": 1}})
    s["bad-config-not-json"] = ck(0, b"{model_type: llama}")
    s["bad-config-array"] = ck(0, b"[]")
    s["bad-config-unknown-type"] = ck(0, {"model_type": "t5"})
    s["bad-config-types"] = ck(0, dict(llama, hidden_size="8", attention_bias=1))
    s["bad-config-heads"] = ck(0, dict(llama, num_key_value_heads=3))
    s["bad-config-layer-types"] = ck(0, dict(llama, model_type="gemma2",
                                            layer_types=["chunked_attention", 3]))
    s["bad-config-rope-type"] = ck(0, dict(llama, rope_parameters={"rope_type": "longrope"}))
    s["bad-config-shapes"] = ck(0, dict(llama, hidden_size=16))
    s["bad-model-file"] = ck(0x20, llama, None, b"\x08\0\0\0\0\0\0\0{}      ")
    return s


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(here, "corpus"))
    args = ap.parse_args()
    for target, seeds in (("safetensors", safetensors_seeds()),
                          ("forward", forward_seeds()),
                          ("checkpoint", checkpoint_seeds())):
        d = os.path.join(args.out, target)
        os.makedirs(d, exist_ok=True)
        for name in os.listdir(d):
            if name.startswith("seed-"):
                os.remove(os.path.join(d, name))
        total = 0
        for name, data in sorted(seeds.items()):
            with open(os.path.join(d, "seed-" + name), "wb") as f:
                f.write(data)
            total += len(data)
        print("%s: %d seeds, %d bytes" % (d, len(seeds), total))


if __name__ == "__main__":
    main()
