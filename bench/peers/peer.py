"""peer.py: one peer's side of bench/peers (run by run.py, one process per
peer, inside that peer's virtual environment).

    VENV/bin/python bench/peers/peer.py PEER < cases.json > results.jsonl

PEER is torch, ort, openvino or ggml. stdin holds a JSON list of cases (see
run.py: kind module/core/decode, B, L, S, H, Hkv, d, causal, backward,
dtype f32/bf16, warmup, min_repeat, max_repeat, budget_s). For each case
this process builds the same inputs (float32, seeded; a bf16 case rounds
them to bfloat16 values first) for mha (the Python package, imported from
PYTHONPATH) and for every operator of the peer that can run the case,
checks that their outputs agree, then times them in alternation: each
round runs mha once and then each peer operator once, so the ratios come
from one process and one stretch of time. It prints one JSON object per
line: per case, the mha median (or why mha cannot run the case yet) and
per operator its precision tag, the peer's median, the largest
|peer - mha| of the output (and of the input gradient with backward), or
why the operator could not run.

    VENV/bin/python bench/peers/peer.py gemm   # (torch2) the GEMM reference

prints the rate of torch.matmul on 2048 x 2048 x 2048 float32 and bfloat16
matrices on the same threads (run.py's reference for the bf16 rows).

Threads: the caller sets OMP_NUM_THREADS (mha) and --threads; every peer
is pinned to the same count (torch.set_num_threads, ORT
intra_op_num_threads, OpenVINO INFERENCE_NUM_THREADS, ggml n_threads).
Nothing here downloads anything.
"""

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback

import numpy as np


def log(msg):
    sys.stderr.write("peer.py: %s\n" % msg)
    sys.stderr.flush()


# ---------------------------------------------------------------------------
# inputs shared by mha and the peer


def bf16_bits(a):
    """float32 -> bfloat16 bits (uint16), rounded to nearest even (numpy
    alone: the ggml and OpenVINO venvs have no bfloat16 dtype)."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
            >> np.uint32(16)).astype(np.uint16)


def bf16_float(bits):
    """bfloat16 bits (any 16-bit integer array) -> float32, exactly."""
    return (np.asarray(bits).view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def bf16_round(a):
    """a rounded to bfloat16 values, kept as float32 (exact in bf16)."""
    return bf16_float(bf16_bits(a))


def make_inputs(c, seed=0):
    """Canonical float32 inputs of a case.

    core/decode: q (B, H, L, d), k and v (B, Hkv, S, d);
    module: x (B, L, E) with the weights of nn.MultiheadAttention
    (in_proj_weight (3E, E), in_proj_bias (3E), out_proj.weight (E, E),
    out_proj.bias (E)) and, for backward, the output gradient g (B, L, E).
    A bf16 case rounds every array to bfloat16 values (still float32
    arrays), so that each library's bf16 copy of them is exact."""
    inp = make_inputs_f32(c, seed)
    if c.get("dtype", "f32") == "bf16":
        inp = {n: ({w: bf16_round(a) for w, a in v.items()} if isinstance(v, dict)
                   else bf16_round(v)) for n, v in inp.items()}
    return inp


def make_inputs_f32(c, seed):
    rng = np.random.default_rng(seed)
    B, L, S, H, Hkv, d = c["B"], c["L"], c["S"], c["H"], c["Hkv"], c["d"]
    f = lambda *sh: rng.standard_normal(sh, dtype=np.float32)
    if c["kind"] == "module":
        E = H * d
        a = math.sqrt(6.0 / (E + E))  # xavier_uniform bound of a (E, E) block
        w = {
            "in_proj_weight": rng.uniform(-a, a, (3 * E, E)).astype(np.float32),
            "in_proj_bias": (0.02 * f(3 * E)),
            "out_proj.weight": rng.uniform(-a, a, (E, E)).astype(np.float32),
            "out_proj.bias": (0.02 * f(E)),
        }
        return {"x": f(B, L, E), "w": w, "g": f(B, L, E)}
    return {"q": f(B, H, L, d), "k": f(B, Hkv, S, d), "v": f(B, Hkv, S, d),
            "g": f(B, H, L, d)}


# ---------------------------------------------------------------------------
# mha's side


def mha_op(c, inp):
    """(run, output) for mha: run() computes, output(r) gives the
    canonical output (and input gradient with backward); or a string
    saying why mha cannot run the case yet (a bf16 module)."""
    import mha

    causal = bool(c["causal"])
    if c.get("dtype", "f32") == "bf16":
        return mha_op_bf16(c, inp)
    if c["kind"] == "module":
        E, H = c["H"] * c["d"], c["H"]
        if c["backward"]:
            import torch
            import mha.torch as mt

            m = mt.MultiheadAttention(E, H, batch_first=True)
            m.load_state_dict({k: torch.from_numpy(v) for k, v in inp["w"].items()})
            x = torch.from_numpy(inp["x"]).requires_grad_(True)
            g = torch.from_numpy(inp["g"])

            def run():
                m.zero_grad(set_to_none=True)
                x.grad = None
                y, _ = m(x, x, x, need_weights=False, is_causal=causal,
                         attn_mask=causal_mask_torch(c) if causal else None)
                y.backward(g)
                return y.detach().numpy(), x.grad.numpy()

            return run, lambda r: r
        m = mha.MultiheadAttention(E, H, batch_first=True)
        m.load_state_dict(inp["w"])
        m.eval()
        x = inp["x"]
        return (lambda: m(x, need_weights=False, is_causal=causal)[0]), (lambda r: (r,))
    if c["kind"] == "decode":
        B, Hkv, S, d = c["B"], c["Hkv"], c["S"], c["d"]
        cache = mha.KVCache(B, Hkv, d, capacity=S)
        cache.append(inp["k"], inp["v"])
        q = inp["q"]
        return (lambda: cache.attend(q)), (lambda r: (r,))
    gqa = c["Hkv"] != c["H"]
    if c["backward"]:
        import torch
        import mha.torch as mt

        return sdpa_fwd_bwd(torch, mt.scaled_dot_product_attention, inp, causal, gqa), \
            lambda r: r
    q, k, v = inp["q"], inp["k"], inp["v"]
    return (lambda: mha.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                     enable_gqa=gqa)), (lambda r: (r,))


def mha_op_bf16(c, inp):
    """mha in bfloat16 where it has it today: scaled dot-product attention
    on bf16 q, k, v (the fused path), forward and forward + backward
    (mha.torch, autograd); the module's forward with bf16 weight matrices
    on bf16 inputs, and its forward + backward (mha.torch's module
    .to(bfloat16), autograd: gradients in bf16);
    decode through a KVCache storing K and V as bf16 (float32 query)."""
    import mha

    causal = bool(c["causal"])
    if c["kind"] == "module":
        if c["backward"]:  # mha.torch's module .to(bfloat16), autograd
            import torch
            import mha.torch as mt

            E, H = c["H"] * c["d"], c["H"]
            m = mt.MultiheadAttention(E, H, batch_first=True)
            m.load_state_dict({k: torch.from_numpy(v) for k, v in inp["w"].items()})
            m.to(torch.bfloat16)
            x = torch.from_numpy(inp["x"]).to(torch.bfloat16).requires_grad_(True)
            g = torch.from_numpy(inp["g"]).to(torch.bfloat16)
            mk = causal_mask_torch(c).to(torch.bfloat16) if causal else None

            def run():
                m.zero_grad(set_to_none=True)
                x.grad = None
                y, _ = m(x, x, x, need_weights=False, is_causal=causal, attn_mask=mk)
                y.backward(g)
                return y.detach().float().numpy(), x.grad.float().numpy()

            return run, lambda r: r
        from mha import _mha
        from mha._options import BF16, forward_kwargs

        E, H = c["H"] * c["d"], c["H"]
        m32 = mha.MultiheadAttention(E, H, batch_first=True)
        m32.load_state_dict(inp["w"])
        m = m32.to("bf16")  # the weight matrices stored as bf16 (biases float32)
        x = (bf16_bits(inp["x"]).view(np.int16), BF16)  # the numpy API's bf16 form
        kw = forward_kwargs("bench peer", is_causal=causal, need_weights=False)
        return (lambda: _mha.forward(m._m, x, x, x, None, None, mha._alloc, **kw)[0]), \
            (lambda r: (bf16_float(r),))
    if c["kind"] == "decode":
        B, Hkv, S, d = c["B"], c["Hkv"], c["S"], c["d"]
        cache = mha.KVCache(B, Hkv, d, capacity=S, dtype="bf16")
        cache.append(inp["k"], inp["v"])
        q = inp["q"]
        return (lambda: cache.attend(q)), (lambda r: (r,))
    gqa = c["Hkv"] != c["H"]
    try:
        import torch
        import mha.torch as mt
    except ImportError:
        torch = None
    if c["backward"] and torch is not None:
        return sdpa_fwd_bwd(torch, mt.scaled_dot_product_attention, inp, causal, gqa,
                            dtype=torch.bfloat16), lambda r: r
    if torch is not None:  # the public API: mha.torch on bf16 tensors
        q, k, v = (torch.from_numpy(inp[n]).to(torch.bfloat16) for n in "qkv")

        def run():
            with torch.inference_mode():
                return mt.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                       enable_gqa=gqa)

        return run, lambda r: (r.float().numpy(),)
    # no torch in this process (ort, openvino, ggml), and mha's numpy API
    # refuses bfloat16 today: the binding on the bf16 bits (an int16 view),
    # the very call mha.torch.scaled_dot_product_attention makes
    from mha import _mha
    from mha._options import BF16, sdpa_kwargs

    args = [(bf16_bits(inp[n]).view(np.int16), BF16) for n in "qkv"]
    kw = sdpa_kwargs(is_causal=causal)
    return (lambda: _mha.sdpa(*args, None, None, mha._alloc, **kw)[0]), \
        (lambda r: (bf16_float(r),))


def sdpa_fwd_bwd(torch, sdpa, inp, causal, gqa, dtype=None, autocast=False):
    """A call of sdpa (torch's or mha.torch's) forward + backward on copies
    of inp's q, k, v that require grad: (output, the query's gradient), as
    float32 arrays. dtype: the tensors' (default float32); autocast: the
    forward under torch.autocast("cpu", bfloat16) (float32 tensors)."""
    dtype = dtype or torch.float32
    q, k, v = (torch.from_numpy(inp[n]).to(dtype).clone().requires_grad_(True) for n in "qkv")
    g = torch.from_numpy(inp["g"]).to(torch.bfloat16 if autocast else dtype)

    def run():
        for t in (q, k, v):
            t.grad = None
        if autocast:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = sdpa(q, k, v, is_causal=causal, enable_gqa=gqa)
        else:
            y = sdpa(q, k, v, is_causal=causal, enable_gqa=gqa)
        y.backward(g.to(y.dtype))
        return y.detach().float().numpy(), q.grad.float().numpy()

    return run


def causal_mask_torch(c):
    import torch

    L, S = c["L"], c["S"]
    return torch.triu(torch.full((L, S), float("-inf")), diagonal=1)


# ---------------------------------------------------------------------------
# PyTorch: nn.MultiheadAttention and F.scaled_dot_product_attention


class TorchPeer:
    name = "torch"

    def __init__(self, threads):
        import torch

        torch.set_num_threads(threads)
        self.torch = torch
        self.version = "torch " + torch.__version__

    def ops(self, c, inp):
        """(precision, name, build, output) of each operator: float32 in
        an f32 case; in a bf16 case bf16 tensors (a module converted with
        .to(torch.bfloat16)) and, with backward, float32 tensors and
        module under torch.autocast("cpu", dtype=torch.bfloat16)."""
        torch = self.torch
        F = torch.nn.functional
        bf16 = c.get("dtype", "f32") == "bf16"
        dt = torch.bfloat16 if bf16 else torch.float32
        prec = "bf16" if bf16 else "f32"
        causal = bool(c["causal"])
        if c["kind"] == "module":
            E, H = c["H"] * c["d"], c["H"]

            def module(dtype):
                m = torch.nn.MultiheadAttention(E, H, batch_first=True)
                m.load_state_dict({k: torch.from_numpy(v) for k, v in inp["w"].items()})
                return m.to(dtype)

            mask = causal_mask_torch(c) if causal else None
            if c["backward"]:
                def fwd_bwd(dtype, autocast):
                    m = module(dtype)
                    mk = None if mask is None else mask.to(dtype)
                    x = torch.from_numpy(inp["x"]).to(dtype).clone().requires_grad_(True)
                    g = torch.from_numpy(inp["g"]).to(torch.bfloat16 if autocast else dtype)

                    def run():
                        m.zero_grad(set_to_none=True)
                        x.grad = None
                        if autocast:
                            with torch.autocast("cpu", dtype=torch.bfloat16):
                                y, _ = m(x, x, x, need_weights=False, attn_mask=mk,
                                         is_causal=causal)
                        else:
                            y, _ = m(x, x, x, need_weights=False, attn_mask=mk,
                                     is_causal=causal)
                        y.backward(g.to(y.dtype))
                        return y.detach().float().numpy(), x.grad.float().numpy()

                    return run

                name = "nn.MultiheadAttention" + (" .to(bfloat16)" if bf16 else "")
                yield prec, name, (lambda: fwd_bwd(dt, False)), lambda r: r
                if bf16:
                    yield ("autocast bf16", "nn.MultiheadAttention (float32) under autocast",
                           (lambda: fwd_bwd(torch.float32, True)), lambda r: r)
                return
            m = module(dt).eval()
            mk = None if mask is None else mask.to(dt)
            x = torch.from_numpy(inp["x"]).to(dt)

            def run():
                with torch.inference_mode():
                    return m(x, x, x, need_weights=False, attn_mask=mk,
                             is_causal=causal)[0].float().numpy()

            yield (prec, "nn.MultiheadAttention" + (" .to(bfloat16)" if bf16 else ""),
                   (lambda run=run: run), lambda r: (r,))
            return
        gqa = c["Hkv"] != c["H"]
        # decode: one query over the whole cache, no mask (the query is the
        # last position)
        causal = causal and c["kind"] != "decode"
        name = "F.scaled_dot_product_attention" + (" (bf16 tensors)" if bf16 else "")
        if c["backward"]:
            yield prec, name, (lambda: sdpa_fwd_bwd(torch, F.scaled_dot_product_attention, inp,
                                                    causal, gqa, dtype=dt)), lambda r: r
            if bf16:
                yield ("autocast bf16", "F.scaled_dot_product_attention (float32) under autocast",
                       (lambda: sdpa_fwd_bwd(torch, F.scaled_dot_product_attention, inp, causal,
                                             gqa, autocast=True)), lambda r: r)
            return
        q, k, v = (torch.from_numpy(inp[n]).to(dt) for n in "qkv")

        def run():
            with torch.inference_mode():
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                      enable_gqa=gqa).float().numpy()

        yield prec, name, (lambda run=run: run), lambda r: (r,)


# ---------------------------------------------------------------------------
# ONNX Runtime: com.microsoft contrib operators and ONNX's Attention


class OrtPeer:
    name = "ort"

    def __init__(self, threads):
        import onnx
        import onnxruntime as ort

        self.onnx, self.ort, self.threads = onnx, ort, threads
        self.version = "onnxruntime %s, onnx %s" % (ort.__version__, onnx.__version__)

    def session(self, nodes, inputs, outputs, inits=(), et=None, opset=23):
        onnx, ort = self.onnx, self.ort
        h, T = onnx.helper, onnx.TensorProto
        g = h.make_graph(nodes, "peer",
                         [h.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                         [h.make_tensor_value_info(n, et or T.FLOAT, None) for n in outputs],
                         initializer=list(inits))
        model = h.make_model(g, opset_imports=[h.make_opsetid("", opset),
                                               h.make_opsetid("com.microsoft", 1)])
        model.ir_version = 10
        so = ort.SessionOptions()
        so.intra_op_num_threads = self.threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        return ort.InferenceSession(model.SerializeToString(), so,
                                    providers=["CPUExecutionProvider"])

    def ops(self, c, inp):
        """Each operator in float32, or in a bf16 case the same graphs in
        BFLOAT16 (ml_dtypes arrays): ORT's CPU provider has no bf16 kernel
        of these operators in this version, so those rows say what ORT
        answered (the session is made first, the inputs cast after)."""
        bf16 = c.get("dtype", "f32") == "bf16"
        prec = "bf16" if bf16 else "f32"
        if c["backward"]:
            yield prec, "InferenceSession", ("inference only (gradients need the separate "
                                             "onnxruntime-training build)"), None
            return
        onnx = self.onnx
        h, T = onnx.helper, onnx.TensorProto
        ET = T.BFLOAT16 if bf16 else T.FLOAT  # the element type of the graphs
        if bf16:
            import ml_dtypes

            cv = lambda a: a.astype(ml_dtypes.bfloat16) if a.dtype == np.float32 else a
        else:
            cv = lambda a: a
        cvd = lambda feeds: {n: cv(a) for n, a in feeds.items()}
        sess = lambda *a, **k: self.session(*a, et=ET, **k)
        B, L, S, H, Hkv, d = c["B"], c["L"], c["S"], c["H"], c["Hkv"], c["d"]
        causal = int(bool(c["causal"]) and c["kind"] != "decode")
        if c["kind"] == "module":
            E = H * d
            w = inp["w"]
            nodes = [h.make_node("Attention", ["x", "w", "b"], ["a"], domain="com.microsoft",
                                 num_heads=H, unidirectional=causal),
                     h.make_node("MatMul", ["a", "wo"], ["ao"]),
                     h.make_node("Add", ["ao", "bo"], ["y"])]
            x = inp["x"]

            def build():
                fa = lambda a, n: onnx.numpy_helper.from_array(cv(np.ascontiguousarray(a)), n)
                inits = [fa(w["in_proj_weight"].T, "w"), fa(w["in_proj_bias"], "b"),
                         fa(w["out_proj.weight"].T, "wo"), fa(w["out_proj.bias"], "bo")]
                s = sess(nodes, [("x", ET, [B, L, E])], ["y"], inits)
                xc = cv(x)
                return lambda: s.run(None, {"x": xc})[0]

            yield prec, "com.microsoft.Attention + MatMul", build, lambda r: (r,)
            return
        # BSNH (B, L, H*d) inputs of the contrib operators
        bsnh = lambda a: np.ascontiguousarray(a.transpose(0, 2, 1, 3).reshape(
            a.shape[0], a.shape[2], -1))
        from_bsnh = lambda r: (r.reshape(B, L, H, d).transpose(0, 2, 1, 3),)
        q3 = bsnh(inp["q"])
        if c["kind"] != "decode":
            k3, v3 = bsnh(inp["k"]), bsnh(inp["v"])
        q4, k4, v4 = inp["q"], inp["k"], inp["v"]
        if H == Hkv:
            # decode: the cache as 4D BNSH key/value (no copy into BSNH)
            if c["kind"] == "decode":
                feeds = {"q": q3, "k": k4, "v": v4}
                shapes = [("q", ET, [B, L, H * d]), ("k", ET, [B, H, S, d]),
                          ("v", ET, [B, H, S, d])]
            else:
                feeds = {"q": q3, "k": k3, "v": v3}
                shapes = [("q", ET, [B, L, H * d]), ("k", ET, [B, S, H * d]),
                          ("v", ET, [B, S, H * d])]
            node = h.make_node("MultiHeadAttention", ["q", "k", "v"], ["y"],
                               domain="com.microsoft", num_heads=H, unidirectional=causal)

            def build_mha(node=node, shapes=shapes, feeds=feeds):
                s = sess([node], shapes, ["y"])
                fc = cvd(feeds)
                return lambda: s.run(["y"], fc)[0]

            yield prec, "com.microsoft.MultiHeadAttention", build_mha, from_bsnh
        # GroupQueryAttention: prefill (no past), or decode with the cache as
        # past_key/past_value sharing one buffer with present_key/value (the
        # way ORT runs it for LLMs: the op writes the new token's k, v at
        # row S - 1 of the buffer in place and attends to all S rows)
        i32 = T.INT32
        sl, tl = np.full((B,), S - 1, np.int32), np.array([S], np.int32)
        if c["kind"] == "decode":
            shapes = [("q", ET, [B, 1, H * d]), ("k", ET, [B, 1, Hkv * d]),
                      ("v", ET, [B, 1, Hkv * d]), ("pk", ET, [B, Hkv, S, d]),
                      ("pv", ET, [B, Hkv, S, d]), ("sl", i32, [B]), ("tl", i32, [1])]
            gnode = h.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "sl", "tl"],
                                ["y", "pko", "pvo"], domain="com.microsoft", num_heads=H,
                                kv_num_heads=Hkv)

            def build_gqa():
                ort = self.ort
                s = sess([gnode], shapes, ["y", "pko", "pvo"])
                kb = ort.OrtValue.ortvalue_from_numpy(cv(k4.copy()))
                vb = ort.OrtValue.ortvalue_from_numpy(cv(v4.copy()))
                io = s.io_binding()
                io.bind_cpu_input("q", cv(q3))
                io.bind_cpu_input("k", cv(bsnh(k4[:, :, S - 1:])))
                io.bind_cpu_input("v", cv(bsnh(v4[:, :, S - 1:])))
                io.bind_ortvalue_input("pk", kb)
                io.bind_ortvalue_input("pv", vb)
                io.bind_cpu_input("sl", sl)
                io.bind_cpu_input("tl", tl)
                y = ort.OrtValue.ortvalue_from_shape_and_type([B, 1, H * d],
                                                              cv(q3[:1, :1, :1]).dtype)
                io.bind_ortvalue_output("y", y)
                io.bind_ortvalue_output("pko", kb)
                io.bind_ortvalue_output("pvo", vb)

                def run():
                    s.run_with_iobinding(io)
                    return y.numpy()

                return run

            yield (prec, "com.microsoft.GroupQueryAttention (shared KV buffer)", build_gqa,
                   from_bsnh)
        else:
            feeds = {"q": q3, "k": k3, "v": v3, "sl": sl, "tl": tl}
            shapes = [("q", ET, [B, L, H * d]), ("k", ET, [B, S, Hkv * d]),
                      ("v", ET, [B, S, Hkv * d]), ("sl", i32, [B]), ("tl", i32, [1])]
            # causal=0: bidirectional
            gnode = h.make_node("GroupQueryAttention", ["q", "k", "v", "", "", "sl", "tl"],
                                ["y", "pko", "pvo"], domain="com.microsoft", num_heads=H,
                                kv_num_heads=Hkv, causal=causal)

            def build_gqa():
                s = sess([gnode], shapes, ["y", "pko", "pvo"])
                fc = cvd(feeds)
                return lambda: s.run(["y"], fc)[0]

            yield prec, "com.microsoft.GroupQueryAttention", build_gqa, from_bsnh
        # ONNX's own Attention (opset 23): 4D (B, H, L, d) inputs, GQA by
        # kv heads dividing q heads
        anode = h.make_node("Attention", ["q", "k", "v"], ["y"], is_causal=causal)
        feeds4 = {"q": q4, "k": k4, "v": v4}
        shapes4 = [("q", ET, [B, H, L, d]), ("k", ET, [B, Hkv, S, d]),
                   ("v", ET, [B, Hkv, S, d])]

        def build_att():
            s = sess([anode], shapes4, ["y"])
            fc = cvd(feeds4)
            return lambda: s.run(["y"], fc)[0]

        yield prec, "Attention (ONNX opset 23)", build_att, lambda r: (r,)


# ---------------------------------------------------------------------------
# OpenVINO: the ScaledDotProductAttention op (opset13) in a built model


class OpenVinoPeer:
    name = "openvino"

    def __init__(self, threads):
        import openvino as ov

        self.ov, self.threads = ov, threads
        self.core = ov.Core()
        # what the CPU plugin computes in when not told (bf16 on a CPU with
        # AVX512-BF16 or AMX, f32 elsewhere)
        self.default_prec = self.core.get_property("CPU", "INFERENCE_PRECISION_HINT") \
            .get_type_name()
        self.version = "openvino %s (CPU plugin default inference precision: %s)" % (
            ov.__version__.split("-")[0], self.default_prec)

    def compile(self, outputs, params, precision):
        """precision: the INFERENCE_PRECISION_HINT ('f32', 'bf16'), or None:
        the plugin's default."""
        ov = self.ov
        model = ov.Model(outputs, params, "peer")
        cfg = {"INFERENCE_NUM_THREADS": self.threads, "NUM_STREAMS": 1,
               "PERFORMANCE_HINT": "LATENCY", "ENABLE_HYPER_THREADING": False}
        if precision:
            cfg["INFERENCE_PRECISION_HINT"] = precision
        return self.core.compile_model(model, "CPU", cfg)

    def precisions(self, c):
        """(tag, hint, what the op's name adds) of each compiled variant: an
        f32 case forces f32 (else the plugin may compute in bf16); a bf16
        case runs the plugin's default and bf16 forced."""
        if c.get("dtype", "f32") == "bf16":
            return [("default", None, " [default: %s]" % self.default_prec),
                    ("bf16", "bf16", " [inference_precision bf16]")]
        return [("f32", "f32", "")]

    def ops(self, c, inp):
        """Models with float32 inputs and outputs (a bf16 case's inputs are
        bf16 values), compiled once per precision variant."""
        if c["backward"]:
            tags = "/".join(t for t, _, _ in self.precisions(c))
            yield tags, "ScaledDotProductAttention", "inference only: OpenVINO has no backward", \
                None
            return
        import openvino.opset13 as op

        B, L, S, H, Hkv, d = c["B"], c["L"], c["S"], c["H"], c["Hkv"], c["d"]
        causal = bool(c["causal"]) and c["kind"] != "decode"
        if c["kind"] == "module":
            E = H * d
            w = inp["w"]

            def graph():
                x = op.parameter([B, L, E], np.float32, name="x")
                qkv = op.add(op.matmul(x, op.constant(w["in_proj_weight"]), False, True),
                             op.constant(w["in_proj_bias"]))
                qkv = op.transpose(op.reshape(qkv, op.constant(np.array([B, L, 3, H, d])),
                                              False),
                                   op.constant(np.array([2, 0, 3, 1, 4])))  # (3, B, H, L, d)
                q, k, v = op.split(qkv, op.constant(np.int64(0)), 3).outputs()
                sq = lambda t: op.squeeze(t, op.constant(np.array([0])))
                a = op.scaled_dot_product_attention(sq(q), sq(k), sq(v), causal=causal)
                a = op.reshape(op.transpose(a, op.constant(np.array([0, 2, 1, 3]))),
                               op.constant(np.array([B, L, E])), False)
                y = op.add(op.matmul(a, op.constant(w["out_proj.weight"]), False, True),
                           op.constant(w["out_proj.bias"]))
                return [y], [x]

            xin = inp["x"]
            for tag, hint, what in self.precisions(c):
                def build(hint=hint):
                    cm = self.compile(*graph(), hint)
                    req = cm.create_infer_request()
                    return lambda: req.infer([xin], share_inputs=True)[0]

                yield tag, "MatMul + ScaledDotProductAttention + MatMul" + what, build, \
                    lambda r: (r,)
            return
        feeds = [inp["q"], inp["k"], inp["v"]]

        def params():
            return [op.parameter([B, H, L, d], np.float32, name="q"),
                    op.parameter([B, Hkv, S, d], np.float32, name="k"),
                    op.parameter([B, Hkv, S, d], np.float32, name="v")]

        def sdpa4():
            q, k, v = ps = params()
            return [op.scaled_dot_product_attention(q, k, v, causal=causal)], ps

        G = H // Hkv

        def sdpa5():
            # GQA: q as (B, Hkv, G, L, d) against k, v (B, Hkv, 1, S, d),
            # broadcast by the op (no copy of k, v)
            q, k, v = ps = params()
            q5 = op.reshape(q, op.constant(np.array([B, Hkv, G, L, d])), False)
            k5 = op.unsqueeze(k, op.constant(np.array([2])))
            v5 = op.unsqueeze(v, op.constant(np.array([2])))
            a = op.scaled_dot_product_attention(q5, k5, v5, causal=causal)
            return [op.reshape(a, op.constant(np.array([B, H, L, d])), False)], ps

        def sdpa_rep():
            # or k, v repeated to H heads in the graph, then the 4D op
            rep = lambda t: op.reshape(
                op.broadcast(op.unsqueeze(t, op.constant(np.array([2]))),
                             op.constant(np.array([B, Hkv, G, S, d]))),
                op.constant(np.array([B, H, S, d])), False)
            q, k, v = ps = params()
            return [op.scaled_dot_product_attention(q, rep(k), rep(v), causal=causal)], ps

        if H == Hkv:
            graphs = [("ScaledDotProductAttention", sdpa4)]
        else:
            graphs = [("ScaledDotProductAttention (5D broadcast GQA)", sdpa5)]
            if c["kind"] != "decode":  # repeating the whole cache per step: not a decode
                graphs.append(("ScaledDotProductAttention (k, v repeated to %d heads)" % H,
                               sdpa_rep))
        for name, graph in graphs:
            for tag, hint, what in self.precisions(c):
                def build(graph=graph, hint=hint):
                    cm = self.compile(*graph(), hint)
                    req = cm.create_infer_request()
                    return lambda: req.infer(feeds, share_inputs=True)[0]

                yield tag, name + what, build, lambda r: (r,)


# ---------------------------------------------------------------------------
# ggml: ggml_flash_attn_ext on the CPU backend (ggml-python's bindings)


class GgmlPeer:
    name = "ggml"

    def __init__(self, threads):
        import ggml

        self.g, self.threads = ggml, threads
        isa = [n for n in ("avx2", "avx512", "avx512_bf16")
               if getattr(ggml, "ggml_cpu_has_" + n)()]
        self.version = "ggml-python %s (%s)" % (getattr(ggml, "__version__", "?"),
                                                "+".join(isa) or "no avx2")
        self.keep = []

    def ops(self, c, inp):
        """ggml_flash_attn_ext with Q in f32 (its CPU kernel converts Q to
        K's type for the dot products) and K, V in f32 (an f32 case), or in
        f16 (llama.cpp's usual KV cache) and bf16 (a bf16 case)."""
        kv_types = ["f16", "bf16"] if c.get("dtype", "f32") == "bf16" else ["f32"]
        tags = "/".join(kv_types)
        if c["backward"]:
            yield tags, "ggml_flash_attn_ext", (
                "no backward: ggml_flash_attn_back aborts "
                "(\"TODO: adapt to ggml_flash_attn_ext() changes\")"), None
            return
        if c["kind"] == "module":
            yield tags, "ggml_flash_attn_ext", "attention core only (no module op in ggml)", None
            return
        g = self.g
        B, L, S, H, Hkv, d = c["B"], c["L"], c["S"], c["H"], c["Hkv"], c["d"]
        causal = bool(c["causal"]) and c["kind"] != "decode"
        gtype = {"f32": g.GGML_TYPE_F32, "f16": g.GGML_TYPE_F16, "bf16": g.GGML_TYPE_BF16}
        # each K/V type: its element size, numpy view dtype and conversion
        fill = {"f32": (4, np.float32, lambda a: a),
                "f16": (2, np.float16, lambda a: a.astype(np.float16)),
                "bf16": (2, np.uint16, bf16_bits)}

        def build(kvt):
            esz, vdt, conv = fill[kvt]
            nbytes = (4 * 2 * B * H * L * d + esz * 2 * B * Hkv * S * d
                      + (2 * L * S if causal else 0))
            params = g.ggml_init_params(mem_size=nbytes + 64 * g.ggml_tensor_overhead()
                                        + g.ggml_graph_overhead() + (16 << 20),
                                        mem_buffer=None, no_alloc=False)
            ctx = g.ggml_init(params)
            if not ctx:
                raise MemoryError("ggml_init: no context")
            t4 = lambda typ, a, b_, c_, d_: g.ggml_new_tensor_4d(ctx, typ, a, b_, c_, d_)
            # ggml's ne order is numpy's reversed: q (B, H, L, d) is [d, L, H, B]
            tq = t4(g.GGML_TYPE_F32, d, L, H, B)
            tk = t4(gtype[kvt], d, S, Hkv, B)
            tv = t4(gtype[kvt], d, S, Hkv, B)
            view(g, tq, inp["q"].shape, np.float32)[...] = inp["q"]
            for t, n in ((tk, "k"), (tv, "v")):
                view(g, t, inp[n].shape, vdt)[...] = conv(inp[n])
            tm = None
            if causal:  # F16 mask [S, L]: 0 where key j <= query i, -inf above
                tm = t4(g.GGML_TYPE_F16, S, L, 1, 1)
                m = np.triu(np.full((L, S), -np.inf, np.float16), k=1)
                view(g, tm, (L, S), np.float16)[...] = m
            out = g.ggml_flash_attn_ext(ctx, tq, tk, tv, tm, 1.0 / math.sqrt(d), 0.0, 0.0)
            g.ggml_flash_attn_ext_set_prec(out, g.GGML_PREC_F32)
            gf = g.ggml_new_graph(ctx)
            g.ggml_build_forward_expand(gf, out)
            plan = g.ggml_graph_plan(gf, self.threads, None)
            work = np.empty(max(int(plan.work_size), 1), np.uint8)
            import ctypes

            plan.work_data = work.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
            res = view(g, out, (B, L, H, d), np.float32)  # permuted
            self.keep.append((ctx, work, plan))  # freed by done()

            def run():
                st = g.ggml_graph_compute(gf, ctypes.byref(plan))
                if st != 0:
                    raise RuntimeError("ggml_graph_compute: status %d" % st)
                return res

            return run

        for t in kv_types:
            yield (t, "ggml_flash_attn_ext (%s K/V)" % t, (lambda t=t: build(t)),
                   lambda r: (np.asarray(r).transpose(0, 2, 1, 3),))

    def done(self):
        """Frees the contexts of the case that ended."""
        for ctx, _, _ in self.keep:
            self.g.ggml_free(ctx)
        self.keep = []


def view(g, t, shape, dtype):
    """The data of the contiguous ggml tensor t as a numpy array of shape."""
    import ctypes

    n = int(np.prod(shape))
    assert g.ggml_nelements(t) == n and g.ggml_is_contiguous(t)
    buf = (ctypes.c_uint8 * (n * np.dtype(dtype).itemsize)).from_address(g.ggml_get_data(t))
    return np.frombuffer(buf, dtype).reshape(shape)


PEERS = {"torch": TorchPeer, "ort": OrtPeer, "openvino": OpenVinoPeer, "ggml": GgmlPeer}


# ---------------------------------------------------------------------------
# timing


GAP_S = 0.005  # idle time before each timed call: no peer's pool still spinning


def timed(f):
    time.sleep(GAP_S)
    t0 = time.perf_counter()
    r = f()
    return (time.perf_counter() - t0) * 1e3, r


def maxdiff(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return "shape %s vs %s" % (a.shape, b.shape)
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def run_case(peer, c):
    inp = make_inputs(c)
    cand = list(peer.ops(c, inp))  # (precision tag, name, build or why not, output)
    ops, rows = [], [{"op": n, "prec": p} for p, n, _, _ in cand]  # in the peer's order
    res = {"id": c["id"], "peer": peer.name, "version": peer.version, "ops": rows}
    if all(isinstance(b, str) for _, _, b, _ in cand):
        for r, (_, _, b, _) in zip(rows, cand):
            r["skip"] = b
        return res
    m = mha_op(c, inp)
    if isinstance(m, str):
        # mha cannot run this case yet: the peer is timed alone, and its
        # output is held against mha's float32 answer on the same values
        res["mha_na"] = m
        mrun = None
        rrun, rout = mha_op(dict(c, dtype="f32"), inp)
        ref = [np.array(a) for a in rout(rrun())]
    else:
        mrun, mout = m
        ref = [np.array(a) for a in mout(mrun())]
    for row, (_, name, build, out) in zip(rows, cand):
        if isinstance(build, str):
            row["skip"] = build
            continue
        try:
            run = build()
            got = out(run())
            diff = [maxdiff(a, b) for a, b in zip(got, ref)]
            ops.append((row, run, diff))
        except Exception as exc:  # the peer cannot run it: say why
            msg = ("%s: %s" % (type(exc).__name__, exc)).splitlines()[0][:300]
            row["skip"] = msg
            log("%s %s: %s" % (c["id"], name, msg))
            if os.environ.get("PEER_DEBUG"):
                traceback.print_exc()
    if not ops:
        return res
    for _ in range(c["warmup"]):
        if mrun:
            mrun()
        for _, run, _ in ops:
            run()
    # rounds: mha then each operator; as many as fit the time budget
    # (between min_repeat and max_repeat)
    tm, tp = [], [[] for _ in ops]
    t_start = time.perf_counter()
    n = 0
    while True:
        if mrun:
            tm.append(timed(mrun)[0])
        for i, (_, run, _) in enumerate(ops):
            tp[i].append(timed(run)[0])
        n += 1
        if n >= c["max_repeat"]:
            break
        if n >= c["min_repeat"] and time.perf_counter() - t_start >= c["budget_s"]:
            break
    res["repeat"] = n
    res["mha_ms"] = statistics.median(tm) if tm else None
    for (row, _, diff), t in zip(ops, tp):
        row.update({"ms": statistics.median(t), "max_abs_diff": diff})
    return res


def gemm(threads, n=2048, min_repeat=5, budget_s=1.0):
    """torch.matmul on n x n x n float32 and bfloat16 matrices (random,
    seeded) on `threads` threads: one JSON line, per dtype the median ms
    and GFLOP/s (2 n^3 FLOPs), after two untimed calls."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    out = {"n": n, "threads": threads, "torch": torch.__version__}
    for name, dt in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)
        with torch.inference_mode():
            f = lambda: torch.matmul(a, b)
            for _ in range(2):
                f()
            ts, t0 = [], time.perf_counter()
            while len(ts) < min_repeat or (time.perf_counter() - t0 < budget_s and len(ts) < 50):
                ts.append(timed(f)[0])
        ms = statistics.median(ts)
        out[name] = {"ms": ms, "gflops": 2.0 * n ** 3 / (ms * 1e-3) * 1e-9, "repeat": len(ts)}
    print(json.dumps(out), flush=True)
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("peer", choices=sorted(PEERS) + ["gemm"])
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if a.peer == "gemm":
        return gemm(a.threads)
    cases = json.load(sys.stdin)
    try:
        peer = PEERS[a.peer](a.threads)
    except Exception as exc:
        print(json.dumps({"peer": a.peer, "error": "%s: %s" % (type(exc).__name__, exc)}))
        return 1
    import mha

    print(json.dumps({"peer": a.peer, "version": peer.version, "mha": mha.__version__,
                      "mha_isa": mha.isa(), "threads": a.threads}), flush=True)
    for c in cases:
        try:
            r = run_case(peer, c)
        except Exception as exc:
            r = {"id": c["id"], "peer": a.peer, "error": "%s: %s" % (type(exc).__name__, exc)}
            if os.environ.get("PEER_DEBUG"):
                traceback.print_exc()
        if hasattr(peer, "done"):
            peer.done()
        print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
