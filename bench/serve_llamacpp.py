#!/usr/bin/env python3
"""Serving: mha's paged cache against llama.cpp serving the same sequences.

The workload of `mha bench --serve` (bench/serve_common.py): N sequences
share a prompt of P tokens, then decode together (one step = one token for
every sequence still running), each stopping at its own length (uniform in
[G/4, G], seeded). Both sides run in this process, one after the other, on
the same number of threads:

- mha: one attention module (E, H heads, Hkv KV heads, RoPE neox, f32
  weights),
  `MultiheadAttention.forward_paged` over a `PagedKVCache` (the prompt
  prefilled once in chunks of 512, then forked: its blocks shared; a
  finished sequence's blocks freed), serve_common.run_mha;
- llama.cpp (llama-cpp-python's ctypes bindings of llama.h, the low-level
  API) serving a random-weight one-layer model written here as GGUF: one
  context with n_seq_max = N and a unified KV cache (kv_unified), the
  prompt decoded once into sequence 0 (one llama_decode, n_ubatch 512) and
  given to the others with llama_memory_seq_cp (in a unified cache that
  only tags the prompt's cells with the other sequences: no copy), then per
  step one llama_batch holding one token per running sequence (its own
  seq_id and position, an output requested for each: a server samples
  every sequence's next token), one llama_decode, and every finished
  sequence removed with llama_memory_seq_rm. `--kv split` runs it instead
  with one KV stream per sequence (kv_unified false: seq_cp copies the
  prompt's K/V into each stream, a copy llama.cpp defers to the next
  llama_decode, i.e. into the first step's time; each token attends to
  its own stream only; n_ctx = N (P + G)).

The GGUF model (general.architecture "llama", f32 tensors, written with
gguf's GGUFWriter into a temporary directory, deleted at the end):
  block_count 1, embedding_length E, attention.head_count H,
  head_count_kv Hkv, rope.dimension_count E/H, rope.freq_base 10000,
  layer_norm_rms_epsilon 1e-5, context_length n_ctx, feed_forward_length
  --ffn (default 64), vocab_size --vocab (default 256), tokenizer.ggml.model
  "none" (no tokenizer: llama.cpp takes token ids, not embeddings, so the
  sequences are fed random ids from the tiny vocab, drawn from a stream of
  their own; mha is fed the float inputs of serve_common);
  token_embd (V, E) N(0, 1); blk.0.attn_norm, blk.0.ffn_norm and
  output_norm ones; blk.0.attn_qkv.weight/.bias and blk.0.attn_output
  .weight/.bias = mha's in_proj_weight, in_proj_bias, out_proj.weight,
  out_proj.bias (the same projections, fused QKV with biases); blk.0
  ffn_gate/ffn_up (F, E), ffn_down (E, F) and output (V, E) N(0, 0.02).
What llama.cpp computes per token beyond mha's module: the token
embedding lookup (get_rows), two RMS norms + the final one, the residual
adds, the SwiGLU FFN (3 E F multiply-adds: 147k at F 64, against the
module's 4 E^2 = 2.36M projection multiply-adds), and the LM head (E V:
197k at V 256) with the logits copied out; its RoPE is llama's (ggml's
"normal" mode, adjacent pairs; the GGUF converter permutes wq/wk so that
it equals the neox rotation HF computes), the same work as mha's neox. No
time is subtracted: the figures are whole llama_decode steps with this
extra work in them. The first step's outputs are not compared (different
models); instead every step's batch size is checked against the workload's
(and mha's), and each sequence's last position in llama.cpp's memory
(llama_memory_seq_pos_max) against its stop before it is removed.

KV dtype and flash attention: `--llama f32/off,f32/on,f16/on` (the
default) runs llama.cpp three times, in contexts of their own on the same
model: KV cache f32 (type_k = type_v = GGML_TYPE_F32) with flash attention
off (kq, softmax, kqv as f32 matrix products) and on, and f16 (llama.cpp's
default cache type) with flash attention on. "auto" is accepted too (the
table then shows what llama.cpp resolved it to: enabled, here). Over an
f32 cache, the llama.cpp that llama-cpp-python 0.3.36 vendors casts every
cached K and V a step attends to to f16 before its flash attention
(ggml_cast in build_attn_mha; `--profile-ops` shows the two CPY nodes).
mha runs once per KV dtype named (its paged cache in f32, f16), and each
llama.cpp row's ratio is against mha at the same KV dtype.
llama.cpp's memory is its KV buffer as it logs it ("KV buffer size"),
checked against n_ctx x layers x 2 x Hkv x d x bytes; it is allocated
whole at context creation (n_ctx = P + N G, rounded up to 256 by
llama.cpp: room for every sequence at its longest); mha's is its peak
blocks x block bytes. `--rounds R` (default 3) runs all of it R times
over, in turn (mha, llama.cpp's configurations, mha, ...): each row shows
its round with the shortest decode and every round's decode time is
printed (the machine this was written on is shared: a round that another
process slowed shows as an outlier there). `--profile-ops` reruns each llama.cpp configuration
with ggml's eval callback on every node and reports its time by op and
the attention's share (of the node time of that perturbed run: each node
is then computed alone; see the comment at the code).

Run with the venv that bench/peers/setup_llamacpp.sh makes (llama-cpp-python
0.3.36 built from source for this CPU, gguf, numpy, and this tree's mha):
    /opt/mha-venvs/llamacpp/bin/python bench/serve_llamacpp.py"""

import ctypes
import os
import re
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_common  # noqa: E402


def extra_args(ap):
    ap.add_argument("--ffn", type=int, default=64, help="llama.cpp model's feed_forward_length")
    ap.add_argument("--vocab", type=int, default=256, help="llama.cpp model's vocabulary size")
    ap.add_argument("--kv", choices=["unified", "split"], default="unified",
                    help="llama.cpp's KV cache: one unified buffer, or a stream per sequence")
    ap.add_argument("--llama", default="f32/off,f32/on,f16/on",
                    help="llama.cpp's runs, KV-DTYPE/FLASH-ATTN each (f32|f16 / off|on|auto); "
                         "mha runs once per KV dtype named")
    ap.add_argument("--rounds", type=int, default=3,
                    help="run everything this many times over, in turn; report each row's fastest")
    ap.add_argument("--ubatch", type=int, default=512, help="llama.cpp's n_ubatch")
    ap.add_argument("--profile-ops", action="store_true",
                    help="then each llama.cpp run once more, op by op: its time by ggml op")


args = serve_common.parse(__doc__, extra_args)
configs = [tuple(c.split("/")) for c in args.llama.split(",")]
for c in configs:
    if len(c) != 2 or c[0] not in ("f32", "f16") or c[1] not in ("off", "on", "auto"):
        sys.exit("--llama: %r is not KV-DTYPE/FLASH-ATTN (f32|f16 / off|on|auto)" % "/".join(c))
kv_dtypes = sorted({c[0] for c in configs}, reverse=True)  # f32 first

import numpy as np  # noqa: E402
import gguf  # noqa: E402
import llama_cpp as L  # noqa: E402

import mha  # noqa: E402

w = serve_common.Workload(args)
N, P, G, E, H, Hkv, d, stops = w.N, w.P, w.G, w.E, w.H, w.Hkv, w.d, w.stops
m = mha.MultiheadAttention(E, H, num_kv_heads=Hkv, batch_first=True)
sd = {k: np.asarray(v, dtype=np.float32) for k, v in m.state_dict().items()}
w.make_inputs()
sizes = w.batch_sizes()
tok_rng = np.random.default_rng([args.seed, 1])  # llama.cpp's token ids: their own stream
prompt_ids = tok_rng.integers(0, args.vocab, size=P, dtype=np.int32)
step_ids = tok_rng.integers(0, args.vocab, size=(G, N), dtype=np.int32)


def serve_mha(kv_dtype):
    """mha's side (a short untimed warm-up on a throwaway cache first, as
    llama.cpp's own tools warm a context up before serving)."""
    wc = m.make_paged_cache(num_blocks=4, block_size=args.block_size, dtype=kv_dtype)
    m.forward_paged(wc, [wc.add_sequence()], [w.prompt[:8]], rope="neox")
    del wc
    r = serve_common.run_mha(m, w, kv_dtype=kv_dtype)
    assert r.batch_sizes == sizes, (r.batch_sizes, sizes)
    return r


# ---- llama.cpp: the model
log_lines = []


@L.llama_log_callback
def _log(level, text, user):
    log_lines.append(text.decode(errors="replace"))


L.llama_log_set(_log, ctypes.c_void_p(0))
L.llama_backend_init()

unified = args.kv == "unified"
n_ctx = P + N * G if unified else N * (P + G)
tmp = tempfile.mkdtemp(prefix="serve_llamacpp-")
path = os.path.join(tmp, "random-1layer.gguf")
g = np.random.default_rng([args.seed, 2])
F_, V = args.ffn, args.vocab
wr = gguf.GGUFWriter(path, "llama")
wr.add_name("random 1-layer llama (bench/serve_llamacpp.py)")
wr.add_context_length(n_ctx)
wr.add_embedding_length(E)
wr.add_block_count(1)
wr.add_feed_forward_length(F_)
wr.add_head_count(H)
wr.add_head_count_kv(Hkv)
wr.add_rope_dimension_count(d)
wr.add_rope_freq_base(10000.0)
wr.add_layer_norm_rms_eps(1e-5)
wr.add_vocab_size(V)
wr.add_tokenizer_model("none")
wr.add_file_type(gguf.LlamaFileType.ALL_F32)
f32 = np.float32
tensors = {
    "token_embd.weight": g.standard_normal((V, E), dtype=f32),
    "output_norm.weight": np.ones(E, f32),
    "output.weight": 0.02 * g.standard_normal((V, E), dtype=f32),
    "blk.0.attn_norm.weight": np.ones(E, f32),
    "blk.0.attn_qkv.weight": sd["in_proj_weight"],
    "blk.0.attn_qkv.bias": sd["in_proj_bias"],
    "blk.0.attn_output.weight": sd["out_proj.weight"],
    "blk.0.attn_output.bias": sd["out_proj.bias"],
    "blk.0.ffn_norm.weight": np.ones(E, f32),
    "blk.0.ffn_gate.weight": 0.02 * g.standard_normal((F_, E), dtype=f32),
    "blk.0.ffn_up.weight": 0.02 * g.standard_normal((F_, E), dtype=f32),
    "blk.0.ffn_down.weight": 0.02 * g.standard_normal((E, F_), dtype=f32),
}
assert tensors["blk.0.attn_qkv.weight"].shape == (E + 2 * Hkv * d, E)
for name, t in tensors.items():
    wr.add_tensor(name, np.ascontiguousarray(t, dtype=f32))
wr.write_header_to_file()
wr.write_kv_data_to_file()
wr.write_tensors_to_file()
wr.close()

mp = L.llama_model_default_params()
mp.n_gpu_layers = 0
model = L.llama_model_load_from_file(path.encode(), mp)
if not model:
    sys.exit("llama.cpp could not load %s:\n%s" % (path, "".join(log_lines[-20:])))
assert L.llama_vocab_n_tokens(L.llama_model_get_vocab(model)) == V


class LlamaRun:
    """Results of serve_llama: times in seconds."""


def serve_llama(kv_dtype, flash, cb_eval=None):
    """The workload through one llama.cpp context (made here, freed at the
    end) with its KV cache in kv_dtype and flash attention off/on/auto;
    cb_eval: ggml's per-node callback (the op-by-op profile)."""
    cp = L.llama_context_default_params()
    cp.n_ctx = n_ctx
    cp.n_batch = max(P, N)
    cp.n_ubatch = args.ubatch
    cp.n_seq_max = N
    cp.n_threads = cp.n_threads_batch = args.threads
    cp.kv_unified = unified
    cp.type_k = cp.type_v = L.GGML_TYPE_F32 if kv_dtype == "f32" else L.GGML_TYPE_F16
    cp.flash_attn_type = {"auto": L.LLAMA_FLASH_ATTN_TYPE_AUTO,
                          "on": L.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                          "off": L.LLAMA_FLASH_ATTN_TYPE_DISABLED}[flash]
    cp.no_perf = False
    if cb_eval is not None:
        cp.cb_eval = cb_eval
    log0 = len(log_lines)
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        sys.exit("llama.cpp could not make the context:\n%s" % "".join(log_lines[-20:]))
    o = LlamaRun()
    logs = "".join(log_lines[log0:])
    o.kv_mib = sum(float(x) for x in re.findall(r"KV buffer size =\s*([0-9.]+) MiB", logs))
    o.fa = flash if flash != "auto" else "auto: " + "/".join(
        re.findall(r"Flash Attention (enabled|not supported)", logs))
    mem = L.llama_get_memory(ctx)
    o.n_ctx = L.llama_n_ctx(ctx)
    nb = max(P, N)
    batch = L.llama_batch_init(nb, 0, 1)
    b_tok = np.ctypeslib.as_array(batch.token, shape=(nb,))
    b_pos = np.ctypeslib.as_array(batch.pos, shape=(nb,))
    b_nseq = np.ctypeslib.as_array(batch.n_seq_id, shape=(nb,))
    b_out = np.ctypeslib.as_array(batch.logits, shape=(nb,))
    b_nseq[:] = 1

    def decode(n, what):
        """One llama_decode of the batch's first n tokens, then its outputs
        (the logits of the tokens asked for: what a server samples from;
        this also synchronizes, where llama.cpp's own timer adds the call)."""
        batch.n_tokens = n
        rc = L.llama_decode(ctx, batch)
        if rc != 0:
            sys.exit("llama_decode (%s, %d tokens) returned %d:\n%s"
                     % (what, n, rc, "".join(log_lines[-20:])))
        return L.llama_get_logits(ctx)

    # warm-up (untimed, as llama.cpp's common_init does): one token, then cleared
    b_tok[0], b_pos[0], b_out[0] = 0, 0, 1
    batch.seq_id[0][0] = 0
    decode(1, "warm-up")
    L.llama_memory_clear(mem, True)

    t0 = time.perf_counter()
    b_tok[:P] = prompt_ids
    b_pos[:P] = np.arange(P, dtype=np.int32)
    b_out[:P] = 0
    b_out[P - 1] = 1
    for i in range(P):
        batch.seq_id[i][0] = 0
    decode(P, "prefill")
    for i in range(1, N):
        L.llama_memory_seq_cp(mem, 0, i, -1, -1)
    o.prefill_s = time.perf_counter() - t0
    assert L.llama_memory_seq_pos_max(mem, N - 1) == P - 1
    L.llama_perf_context_reset(ctx)
    if cb_eval is not None:
        profile.clear()

    live = list(range(N))
    o.tokens, o.sizes = 0, []
    t0 = time.perf_counter()
    for s in range(G):
        if not live:
            break
        n = len(live)
        b_tok[:n] = step_ids[s, live]
        b_pos[:n] = P + s
        b_out[:n] = 1
        for j, i in enumerate(live):
            batch.seq_id[j][0] = i
        logits = decode(n, "step %d" % s)
        if s == 0:  # one row per sequence, finite (different models: not compared with mha's)
            assert np.isfinite(np.ctypeslib.as_array(logits, shape=(n, V))).all()
        o.sizes.append(n)
        o.tokens += n
        keep = []
        for i in live:
            if s + 1 >= stops[i]:
                assert L.llama_memory_seq_pos_max(mem, i) == P + s, (i, s)
                L.llama_memory_seq_rm(mem, i, -1, -1)
            else:
                keep.append(i)
        live = keep
    o.decode_s = time.perf_counter() - t0
    perf = L.llama_perf_context(ctx)
    o.own_s, o.own_tokens = (perf.t_p_eval_ms + perf.t_eval_ms) / 1e3, perf.n_p_eval + perf.n_eval
    assert o.sizes == sizes, (o.sizes, sizes)
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    return o


# ---- the runs: per KV dtype, mha then each llama.cpp configuration
load0 = os.getloadavg()
# (--rounds R: all of it R times over, in turn; each row shows its round
# with the shortest decode, and every round's decode seconds are listed)
rounds_mha = {kvd: [] for kvd in kv_dtypes}
rounds_ll = {c: [] for c in configs}
for _ in range(args.rounds):
    for kvd in kv_dtypes:
        rounds_mha[kvd].append(serve_mha(kvd))
        for c in configs:
            if c[0] == kvd:
                rounds_ll[c].append(serve_llama(*c))
res_mha = {k: min(v, key=lambda o: o.decode_s) for k, v in rounds_mha.items()}
res_ll = [(c, min(rounds_ll[c], key=lambda o: o.decode_s)) for c in configs]

# ---- llama.cpp again, op by op (--profile-ops): ggml's eval callback asks
# for every node, so the scheduler computes each node alone and returns to
# the callback after it; a node's time = from the callback's return after
# the node before to its call after this one (the first node of each graph,
# the token embedding lookup, is not timed). The nodes no longer share one
# compute call, so the sum is above the whole-step time: shares, not times.
profile, profiles = {}, []
if args.profile_ops:
    gb = ctypes.CDLL(os.path.join(os.path.dirname(L.__file__), "lib", "libggml-base.so"))
    for fn in (gb.ggml_op_desc, gb.ggml_get_name):
        fn.restype, fn.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    last = [None]

    @L.ggml_backend_sched_eval_callback
    def _node(t, ask, user):
        if ask:
            return True
        now = time.perf_counter()
        if last[0] is not None:
            key = (gb.ggml_op_desc(t).decode(), re.sub(r"-\d+$", "", gb.ggml_get_name(t).decode()))
            profile[key] = profile.get(key, 0.0) + now - last[0]
        last[0] = time.perf_counter()
        return True

    _decode = L.llama_decode

    def _timed_decode(c, b):  # the first node of each graph: untimed
        last[0] = None
        return _decode(c, b)

    L.llama_decode = _timed_decode
    for c, _ in res_ll:
        o = serve_llama(*c, cb_eval=_node)
        profiles.append((c, o, dict(profile)))
    L.llama_decode = _decode
sysinfo = L.llama_print_system_info().decode().strip()
L.llama_model_free(model)
shutil.rmtree(tmp)

print(f"serving: {w.describe(args.threads)}; load average before the runs "
      f"{load0[0]:.2f}, after {os.getloadavg()[0]:.2f}")
print(f"mha {mha.__version__} ({mha.isa()}), paged cache, block size {args.block_size}")
print(f"llama.cpp through llama-cpp-python {L.__version__}: {sysinfo}")
print(f"llama.cpp context: n_ctx {res_ll[0][1].n_ctx}, n_seq_max {N}, kv_unified {unified}, "
      f"n_batch {max(P, N)}, n_ubatch {args.ubatch}, threads {args.threads}; model: 1 layer "
      f"(attention with mha's weights + RMS norms + SwiGLU FFN {F_} + LM head over {V} tokens)")
print("| | KV | flash attn | decode tokens/s | decode s | prefill ms | cache MiB "
      "| mha / this tokens/s |")
print("|---|---|---|---:|---:|---:|---:|---:|")
for kvd in kv_dtypes:
    r = res_mha[kvd]
    print(f"| mha paged (forks share the prompt) | {kvd} | - | {r.tokens / r.decode_s:.0f} | "
          f"{r.decode_s:.3f} | {r.prefill_s * 1e3:.1f} | {r.mem_bytes / 2**20:.1f} (peak blocks) "
          f"| |")
for (kvd, fl), o in res_ll:
    r = res_mha[kvd]
    print(f"| llama.cpp, {args.kv} KV, whole 1-layer model | {kvd} | {o.fa} | "
          f"{o.tokens / o.decode_s:.0f} | {o.decode_s:.3f} | {o.prefill_s * 1e3:.1f} | "
          f"{o.kv_mib:.1f} (KV buffer, allocated) | "
          f"{(r.tokens / r.decode_s) / (o.tokens / o.decode_s):.2f} |")
print(f"decode s in each of the {args.rounds} rounds (the table: the shortest): " + "; ".join(
    [f"mha {k}: " + " ".join(f"{o.decode_s:.3f}" for o in v) for k, v in rounds_mha.items()]
    + [f"llama.cpp {'/'.join(c)}: " + " ".join(f"{o.decode_s:.3f}" for o in v)
       for c, v in rounds_ll.items()]))
r = res_mha[kv_dtypes[0]]
print(f"{r.tokens} tokens in {len(sizes)} steps on every row (batch sizes checked per step); "
      f"mha's prefill: chunks of 512, llama.cpp's: one llama_decode (n_ubatch {args.ubatch}) + "
      f"{N - 1} llama_memory_seq_cp")
for (kvd, fl), o in res_ll:
    kv_bytes = o.n_ctx * 1 * 2 * Hkv * d * (4 if kvd == "f32" else 2)
    print(f"llama.cpp {kvd}/{fl}: its own decode timer (llama_perf_context, the C++ side of the "
          f"same steps) {o.own_s:.3f} s for {o.own_tokens} tokens; KV buffer logged {o.kv_mib:.2f} "
          f"MiB = n_ctx x 1 layer x 2 x Hkv x d x bytes {kv_bytes / 2**20:.2f} MiB; memory "
          f"llama.cpp / mha {o.kv_mib * 2**20 / res_mha[kvd].mem_bytes:.1f}")
    assert o.tokens == r.tokens


def attention_op(op, name):
    """The attention proper in llama.cpp's graph: flash attention, or
    kq / softmax / kqv (+ the copy of its output) without; and the casts
    of the cached K/V to f16 that flash attention does over an f32 cache."""
    return (op in ("FLASH_ATTN_EXT", "SOFT_MAX") or (op == "MUL_MAT" and name in ("kq", "kqv"))
            or (op in ("CPY", "CONT") and (name.startswith("cache_") or name == "kqv_out")))


for (kvd, fl), o, prof in profiles:
    tot = sum(prof.values())
    att = sum(t for (op, name), t in prof.items() if attention_op(op, name))
    top = sorted(prof.items(), key=lambda kv: -kv[1])
    print(f"llama.cpp {kvd}/{fl} op by op (--profile-ops, a second run: {o.decode_s:.3f} s decode, "
          f"{tot:.3f} s in the timed nodes): attention {att:.3f} s = {100 * att / tot:.0f}% of "
          f"node time; the nodes over 2%: " + ", ".join(
              f"{op} {name} {100 * t / tot:.0f}%" for (op, name), t in top if t >= 0.02 * tot))
