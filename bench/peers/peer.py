"""peer.py: one peer's side of bench/peers (run by run.py, one process per
peer, inside that peer's virtual environment).

    VENV/bin/python bench/peers/peer.py PEER < cases.json > results.jsonl

PEER is torch, ort, openvino or ggml. stdin holds a JSON list of cases (see
run.py: kind module/core/decode, B, L, S, H, Hkv, d, causal, backward,
warmup, min_repeat, max_repeat, budget_s). For each case this process
builds the same inputs (float32, seeded) for mha (the Python package,
imported from PYTHONPATH) and for every operator of the peer that can run
the case, checks that their outputs agree, then times them in alternation:
each round runs mha once and then each peer operator once, so the ratios
come from one process and one stretch of time. It prints one JSON object
per line: per case, the mha median and per operator the peer's median,
the largest |peer - mha| of the output (and of the input gradient with
backward), or why the operator could not run.

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


def make_inputs(c, seed=0):
    """Canonical float32 inputs of a case.

    core/decode: q (B, H, L, d), k and v (B, Hkv, S, d);
    module: x (B, L, E) with the weights of nn.MultiheadAttention
    (in_proj_weight (3E, E), in_proj_bias (3E), out_proj.weight (E, E),
    out_proj.bias (E)) and, for backward, the output gradient g (B, L, E)."""
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
    canonical output (and input gradient with backward)."""
    import mha

    causal = bool(c["causal"])
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


def sdpa_fwd_bwd(torch, sdpa, inp, causal, gqa):
    """A call of sdpa (torch's or mha.torch's) forward + backward on copies
    of inp's q, k, v that require grad: (output, the query's gradient)."""
    q, k, v = (torch.from_numpy(inp[n]).clone().requires_grad_(True) for n in "qkv")
    g = torch.from_numpy(inp["g"])

    def run():
        for t in (q, k, v):
            t.grad = None
        y = sdpa(q, k, v, is_causal=causal, enable_gqa=gqa)
        y.backward(g)
        return y.detach().numpy(), q.grad.numpy()

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
        torch = self.torch
        F = torch.nn.functional
        causal = bool(c["causal"])
        if c["kind"] == "module":
            E, H = c["H"] * c["d"], c["H"]
            m = torch.nn.MultiheadAttention(E, H, batch_first=True)
            m.load_state_dict({k: torch.from_numpy(v) for k, v in inp["w"].items()})
            mask = causal_mask_torch(c) if causal else None
            x = torch.from_numpy(inp["x"])
            if c["backward"]:
                x = x.clone().requires_grad_(True)
                g = torch.from_numpy(inp["g"])

                def run():
                    m.zero_grad(set_to_none=True)
                    x.grad = None
                    y, _ = m(x, x, x, need_weights=False, attn_mask=mask, is_causal=causal)
                    y.backward(g)
                    return y.detach().numpy(), x.grad.numpy()

                yield "nn.MultiheadAttention", (lambda run=run: run), lambda r: r
                return
            m.eval()

            def run():
                with torch.inference_mode():
                    return m(x, x, x, need_weights=False, attn_mask=mask,
                             is_causal=causal)[0].numpy()

            yield "nn.MultiheadAttention", (lambda run=run: run), lambda r: (r,)
            return
        gqa = c["Hkv"] != c["H"]
        # decode: one query over the whole cache, no mask (the query is the
        # last position)
        causal = causal and c["kind"] != "decode"
        if c["backward"]:
            run = sdpa_fwd_bwd(torch, F.scaled_dot_product_attention, inp, causal, gqa)
            yield "F.scaled_dot_product_attention", (lambda run=run: run), lambda r: r
            return
        q, k, v = (torch.from_numpy(inp[n]) for n in "qkv")

        def run():
            with torch.inference_mode():
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                      enable_gqa=gqa).numpy()

        yield "F.scaled_dot_product_attention", (lambda run=run: run), lambda r: (r,)


# ---------------------------------------------------------------------------
# ONNX Runtime: com.microsoft contrib operators and ONNX's Attention


class OrtPeer:
    name = "ort"

    def __init__(self, threads):
        import onnx
        import onnxruntime as ort

        self.onnx, self.ort, self.threads = onnx, ort, threads
        self.version = "onnxruntime %s, onnx %s" % (ort.__version__, onnx.__version__)

    def session(self, nodes, inputs, outputs, inits=(), opset=23):
        onnx, ort = self.onnx, self.ort
        h, T = onnx.helper, onnx.TensorProto
        g = h.make_graph(nodes, "peer",
                         [h.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                         [h.make_tensor_value_info(n, T.FLOAT, None) for n in outputs],
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
        if c["backward"]:
            yield "InferenceSession", ("inference only (gradients need the separate "
                                      "onnxruntime-training build)"), None
            return
        onnx = self.onnx
        h, T = onnx.helper, onnx.TensorProto
        F32 = T.FLOAT
        B, L, S, H, Hkv, d = c["B"], c["L"], c["S"], c["H"], c["Hkv"], c["d"]
        causal = int(bool(c["causal"]) and c["kind"] != "decode")
        if c["kind"] == "module":
            E = H * d
            w = inp["w"]
            inits = [onnx.numpy_helper.from_array(np.ascontiguousarray(w["in_proj_weight"].T), "w"),
                     onnx.numpy_helper.from_array(w["in_proj_bias"], "b"),
                     onnx.numpy_helper.from_array(np.ascontiguousarray(w["out_proj.weight"].T),
                                                  "wo"),
                     onnx.numpy_helper.from_array(w["out_proj.bias"], "bo")]
            nodes = [h.make_node("Attention", ["x", "w", "b"], ["a"], domain="com.microsoft",
                                 num_heads=H, unidirectional=causal),
                     h.make_node("MatMul", ["a", "wo"], ["ao"]),
                     h.make_node("Add", ["ao", "bo"], ["y"])]
            x = inp["x"]

            def build():
                s = self.session(nodes, [("x", F32, [B, L, E])], ["y"], inits)
                return lambda: s.run(None, {"x": x})[0]

            yield "com.microsoft.Attention + MatMul", build, lambda r: (r,)
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
                shapes = [("q", F32, [B, L, H * d]), ("k", F32, [B, H, S, d]),
                          ("v", F32, [B, H, S, d])]
            else:
                feeds = {"q": q3, "k": k3, "v": v3}
                shapes = [("q", F32, [B, L, H * d]), ("k", F32, [B, S, H * d]),
                          ("v", F32, [B, S, H * d])]
            node = h.make_node("MultiHeadAttention", ["q", "k", "v"], ["y"],
                               domain="com.microsoft", num_heads=H, unidirectional=causal)

            def build_mha(node=node, shapes=shapes, feeds=feeds):
                s = self.session([node], shapes, ["y"])
                return lambda: s.run(["y"], feeds)[0]

            yield "com.microsoft.MultiHeadAttention", build_mha, from_bsnh
        # GroupQueryAttention: prefill (no past), or decode with the cache as
        # past_key/past_value sharing one buffer with present_key/value (the
        # way ORT runs it for LLMs: the op writes the new token's k, v at
        # row S - 1 of the buffer in place and attends to all S rows)
        i32 = T.INT32
        sl, tl = np.full((B,), S - 1, np.int32), np.array([S], np.int32)
        if c["kind"] == "decode":
            shapes = [("q", F32, [B, 1, H * d]), ("k", F32, [B, 1, Hkv * d]),
                      ("v", F32, [B, 1, Hkv * d]), ("pk", F32, [B, Hkv, S, d]),
                      ("pv", F32, [B, Hkv, S, d]), ("sl", i32, [B]), ("tl", i32, [1])]
            gnode = h.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "sl", "tl"],
                                ["y", "pko", "pvo"], domain="com.microsoft", num_heads=H,
                                kv_num_heads=Hkv)

            def build_gqa():
                ort = self.ort
                s = self.session([gnode], shapes, ["y", "pko", "pvo"])
                kb = ort.OrtValue.ortvalue_from_numpy(k4.copy())
                vb = ort.OrtValue.ortvalue_from_numpy(v4.copy())
                io = s.io_binding()
                io.bind_cpu_input("q", q3)
                io.bind_cpu_input("k", bsnh(k4[:, :, S - 1:]))
                io.bind_cpu_input("v", bsnh(v4[:, :, S - 1:]))
                io.bind_ortvalue_input("pk", kb)
                io.bind_ortvalue_input("pv", vb)
                io.bind_cpu_input("sl", sl)
                io.bind_cpu_input("tl", tl)
                y = ort.OrtValue.ortvalue_from_shape_and_type([B, 1, H * d], np.float32)
                io.bind_ortvalue_output("y", y)
                io.bind_ortvalue_output("pko", kb)
                io.bind_ortvalue_output("pvo", vb)

                def run():
                    s.run_with_iobinding(io)
                    return y.numpy()

                return run

            yield "com.microsoft.GroupQueryAttention (shared KV buffer)", build_gqa, from_bsnh
        else:
            feeds = {"q": q3, "k": k3, "v": v3, "sl": sl, "tl": tl}
            shapes = [("q", F32, [B, L, H * d]), ("k", F32, [B, S, Hkv * d]),
                      ("v", F32, [B, S, Hkv * d]), ("sl", i32, [B]), ("tl", i32, [1])]
            # causal=0: bidirectional
            gnode = h.make_node("GroupQueryAttention", ["q", "k", "v", "", "", "sl", "tl"],
                                ["y", "pko", "pvo"], domain="com.microsoft", num_heads=H,
                                kv_num_heads=Hkv, causal=causal)

            def build_gqa():
                s = self.session([gnode], shapes, ["y", "pko", "pvo"])
                return lambda: s.run(["y"], feeds)[0]

            yield "com.microsoft.GroupQueryAttention", build_gqa, from_bsnh
        # ONNX's own Attention (opset 23): 4D (B, H, L, d) inputs, GQA by
        # kv heads dividing q heads
        anode = h.make_node("Attention", ["q", "k", "v"], ["y"], is_causal=causal)
        feeds4 = {"q": q4, "k": k4, "v": v4}
        shapes4 = [("q", F32, [B, H, L, d]), ("k", F32, [B, Hkv, S, d]),
                   ("v", F32, [B, Hkv, S, d])]

        def build_att():
            s = self.session([anode], shapes4, ["y"])
            return lambda: s.run(["y"], feeds4)[0]

        yield "Attention (ONNX opset 23)", build_att, lambda r: (r,)


# ---------------------------------------------------------------------------
# OpenVINO: the ScaledDotProductAttention op (opset13) in a built model


class OpenVinoPeer:
    name = "openvino"

    def __init__(self, threads):
        import openvino as ov

        self.ov, self.threads = ov, threads
        self.core = ov.Core()
        self.version = "openvino " + ov.__version__.split("-")[0]

    def compile(self, outputs, params):
        ov = self.ov
        model = ov.Model(outputs, params, "peer")
        cfg = {"INFERENCE_NUM_THREADS": self.threads, "NUM_STREAMS": 1,
               "INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY",
               "ENABLE_HYPER_THREADING": False}
        return self.core.compile_model(model, "CPU", cfg)

    def ops(self, c, inp):
        if c["backward"]:
            yield "ScaledDotProductAttention", "inference only: OpenVINO has no backward", None
            return
        import openvino.opset13 as op

        B, L, S, H, Hkv, d = c["B"], c["L"], c["S"], c["H"], c["Hkv"], c["d"]
        causal = bool(c["causal"]) and c["kind"] != "decode"
        if c["kind"] == "module":
            E = H * d
            w = inp["w"]
            x = op.parameter([B, L, E], np.float32, name="x")
            qkv = op.add(op.matmul(x, op.constant(w["in_proj_weight"]), False, True),
                         op.constant(w["in_proj_bias"]))
            qkv = op.transpose(op.reshape(qkv, op.constant(np.array([B, L, 3, H, d])), False),
                               op.constant(np.array([2, 0, 3, 1, 4])))  # (3, B, H, L, d)
            q, k, v = op.split(qkv, op.constant(np.int64(0)), 3).outputs()
            sq = lambda t: op.squeeze(t, op.constant(np.array([0])))
            a = op.scaled_dot_product_attention(sq(q), sq(k), sq(v), causal=causal)
            a = op.reshape(op.transpose(a, op.constant(np.array([0, 2, 1, 3]))),
                           op.constant(np.array([B, L, E])), False)
            y = op.add(op.matmul(a, op.constant(w["out_proj.weight"]), False, True),
                       op.constant(w["out_proj.bias"]))
            xin = inp["x"]

            def build():
                cm = self.compile([y], [x])
                req = cm.create_infer_request()
                return lambda: req.infer([xin], share_inputs=True)[0]

            yield "MatMul + ScaledDotProductAttention + MatMul", build, lambda r: (r,)
            return
        feeds = [inp["q"], inp["k"], inp["v"]]

        def graphs():
            """(name, output, params) of each way to say the case in ops."""
            q = op.parameter([B, H, L, d], np.float32, name="q")
            k = op.parameter([B, Hkv, S, d], np.float32, name="k")
            v = op.parameter([B, Hkv, S, d], np.float32, name="v")
            if H == Hkv:
                yield ("ScaledDotProductAttention",
                       op.scaled_dot_product_attention(q, k, v, causal=causal), [q, k, v])
                return
            # GQA: q as (B, Hkv, G, L, d) against k, v (B, Hkv, 1, S, d),
            # broadcast by the op (no copy of k, v)
            G = H // Hkv
            q5 = op.reshape(q, op.constant(np.array([B, Hkv, G, L, d])), False)
            k5 = op.unsqueeze(k, op.constant(np.array([2])))
            v5 = op.unsqueeze(v, op.constant(np.array([2])))
            a = op.scaled_dot_product_attention(q5, k5, v5, causal=causal)
            a = op.reshape(a, op.constant(np.array([B, H, L, d])), False)
            yield "ScaledDotProductAttention (5D broadcast GQA)", a, [q, k, v]
            if c["kind"] == "decode":
                return  # repeating the whole cache per step: not a decode
            # or k, v repeated to H heads in the graph, then the 4D op
            rep = lambda t: op.reshape(
                op.broadcast(op.unsqueeze(t, op.constant(np.array([2]))),
                             op.constant(np.array([B, Hkv, G, S, d]))),
                op.constant(np.array([B, H, S, d])), False)
            q = op.parameter([B, H, L, d], np.float32, name="q")
            k = op.parameter([B, Hkv, S, d], np.float32, name="k")
            v = op.parameter([B, Hkv, S, d], np.float32, name="v")
            yield ("ScaledDotProductAttention (k, v repeated to %d heads)" % H,
                   op.scaled_dot_product_attention(q, rep(k), rep(v), causal=causal), [q, k, v])

        for name, a, params in graphs():
            def build(a=a, params=params):
                cm = self.compile([a], params)
                req = cm.create_infer_request()
                return lambda: req.infer(feeds, share_inputs=True)[0]

            yield name, build, lambda r: (r,)


# ---------------------------------------------------------------------------
# ggml: ggml_flash_attn_ext on the CPU backend (ggml-python's bindings)


class GgmlPeer:
    name = "ggml"

    def __init__(self, threads):
        import ggml

        self.g, self.threads = ggml, threads
        isa = [n for n in ("avx2", "avx512") if getattr(ggml, "ggml_cpu_has_" + n)()]
        self.version = "ggml-python %s (%s)" % (getattr(ggml, "__version__", "?"),
                                                "+".join(isa) or "no avx2")
        self.keep = []

    def ops(self, c, inp):
        if c["backward"]:
            yield "ggml_flash_attn_ext", ("no backward: ggml_flash_attn_back aborts "
                                         "(\"TODO: adapt to ggml_flash_attn_ext() changes\")"), None
            return
        if c["kind"] == "module":
            yield "ggml_flash_attn_ext", "attention core only (no module op in ggml)", None
            return
        g = self.g
        B, L, S, H, Hkv, d = c["B"], c["L"], c["S"], c["H"], c["Hkv"], c["d"]
        causal = bool(c["causal"]) and c["kind"] != "decode"

        def build():
            nbytes = 4 * (2 * B * H * L * d + 2 * B * Hkv * S * d) + (2 * L * S if causal else 0)
            params = g.ggml_init_params(mem_size=nbytes + 64 * g.ggml_tensor_overhead()
                                        + g.ggml_graph_overhead() + (16 << 20),
                                        mem_buffer=None, no_alloc=False)
            ctx = g.ggml_init(params)
            if not ctx:
                raise MemoryError("ggml_init: no context")
            t4 = lambda typ, a, b_, c_, d_: g.ggml_new_tensor_4d(ctx, typ, a, b_, c_, d_)
            # ggml's ne order is numpy's reversed: q (B, H, L, d) is [d, L, H, B]
            tq = t4(g.GGML_TYPE_F32, d, L, H, B)
            tk = t4(g.GGML_TYPE_F32, d, S, Hkv, B)
            tv = t4(g.GGML_TYPE_F32, d, S, Hkv, B)
            for t, n in ((tq, "q"), (tk, "k"), (tv, "v")):
                view(g, t, inp[n].shape, np.float32)[...] = inp[n]
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

        yield ("ggml_flash_attn_ext (f32 K/V)", build,
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
    cand = list(peer.ops(c, inp))
    ops, rows = [], [{"op": n} for n, _, _ in cand]  # rows in the peer's order
    res = {"id": c["id"], "peer": peer.name, "version": peer.version, "ops": rows}
    if all(isinstance(b, str) for _, b, _ in cand):
        for r, (_, b, _) in zip(rows, cand):
            r["skip"] = b
        return res
    mrun, mout = mha_op(c, inp)
    ref = [np.array(a) for a in mout(mrun())]
    for row, (name, build, out) in zip(rows, cand):
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
        mrun()
        for _, run, _ in ops:
            run()
    # rounds: mha then each operator; as many as fit the time budget
    # (between min_repeat and max_repeat)
    tm, tp = [], [[] for _ in ops]
    t_start = time.perf_counter()
    while True:
        tm.append(timed(mrun)[0])
        for i, (_, run, _) in enumerate(ops):
            tp[i].append(timed(run)[0])
        n = len(tm)
        if n >= c["max_repeat"]:
            break
        if n >= c["min_repeat"] and time.perf_counter() - t_start >= c["budget_s"]:
            break
    res["repeat"] = len(tm)
    res["mha_ms"] = statistics.median(tm)
    for (row, _, diff), t in zip(ops, tp):
        row.update({"ms": statistics.median(t), "max_abs_diff": diff})
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("peer", choices=sorted(PEERS))
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
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
