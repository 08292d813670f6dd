#!/usr/bin/env python3
"""Serving: mha's paged cache against llama.cpp serving the same sequences.

The workload of `mha bench --serve` (bench/serve_common.py): N sequences
share a prompt of P tokens, then decode together (one step = one token for
every sequence still running), each stopping at its own length (uniform in
[G/4, G], seeded). Both sides run in this process, one after the other, on
the same number of threads:

- mha: one attention module (E, H heads, Hkv KV heads, RoPE neox, f32),
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
  its own stream only).

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

The KV cache is float32 on both sides (llama.cpp type_k = type_v =
GGML_TYPE_F32; mha's cache dtype f32); `--kv-dtype f16` makes both f16.
llama.cpp's memory is its KV buffer as it logs it ("KV buffer size"),
checked against n_ctx x layers x 2 x Hkv x d x bytes; it is allocated
whole at context creation (n_ctx = P + N G, rounded up to 256 by
llama.cpp: room for every sequence at its longest); mha's is its peak
blocks x block bytes. Flash attention: llama.cpp's auto (resolved at
context creation; the log line is printed), `--flash-attn on|off`.

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
    ap.add_argument("--kv-dtype", choices=["f32", "f16"], default="f32")
    ap.add_argument("--flash-attn", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--ubatch", type=int, default=512, help="llama.cpp's n_ubatch")


args = serve_common.parse(__doc__, extra_args)

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

# ---- mha (a short untimed warm-up on a throwaway cache first, as
# llama.cpp's own tools warm a context up before serving)
wc = m.make_paged_cache(num_blocks=4, block_size=args.block_size, dtype=args.kv_dtype)
m.forward_paged(wc, [wc.add_sequence()], [w.prompt[:8]], rope="neox")
del wc
r = serve_common.run_mha(m, w, kv_dtype=args.kv_dtype)
assert r.batch_sizes == sizes, (r.batch_sizes, sizes)

# ---- llama.cpp
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
cp = L.llama_context_default_params()
cp.n_ctx = n_ctx
cp.n_batch = max(P, N)
cp.n_ubatch = args.ubatch
cp.n_seq_max = N
cp.n_threads = cp.n_threads_batch = args.threads
cp.kv_unified = unified
cp.type_k = cp.type_v = L.GGML_TYPE_F32 if args.kv_dtype == "f32" else L.GGML_TYPE_F16
cp.flash_attn_type = {"auto": L.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": L.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                      "off": L.LLAMA_FLASH_ATTN_TYPE_DISABLED}[args.flash_attn]
cp.no_perf = False
ctx = L.llama_init_from_model(model, cp)
if not ctx:
    sys.exit("llama.cpp could not make the context:\n%s" % "".join(log_lines[-20:]))
mem = L.llama_get_memory(ctx)
n_ctx_real = L.llama_n_ctx(ctx)
assert L.llama_vocab_n_tokens(L.llama_model_get_vocab(model)) == V

batch = L.llama_batch_init(max(P, N), 0, 1)
b_tok = np.ctypeslib.as_array(batch.token, shape=(max(P, N),))
b_pos = np.ctypeslib.as_array(batch.pos, shape=(max(P, N),))
b_nseq = np.ctypeslib.as_array(batch.n_seq_id, shape=(max(P, N),))
b_out = np.ctypeslib.as_array(batch.logits, shape=(max(P, N),))
b_nseq[:] = 1


def decode(n, what):
    """One llama_decode of the batch's first n tokens, then its outputs
    (the logits of the tokens asked for: what a server samples from; this
    also synchronizes, which is where llama.cpp's own timer adds the call)."""
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
prefill_ll = time.perf_counter() - t0
assert L.llama_memory_seq_pos_max(mem, N - 1) == P - 1
L.llama_perf_context_reset(ctx)

live = list(range(N))
tokens_ll, sizes_ll = 0, []
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
    sizes_ll.append(n)
    tokens_ll += n
    keep = []
    for i in live:
        if s + 1 >= stops[i]:
            assert L.llama_memory_seq_pos_max(mem, i) == P + s, (i, s)
            L.llama_memory_seq_rm(mem, i, -1, -1)
        else:
            keep.append(i)
    live = keep
t_ll = time.perf_counter() - t0
perf = L.llama_perf_context(ctx)
assert sizes_ll == sizes, (sizes_ll, sizes)

logs = "".join(log_lines)
kv_mib = [float(x) for x in re.findall(r"KV buffer size =\s*([0-9.]+) MiB", logs)]
fa = sorted({ln.strip() for ln in log_lines
             if re.search(r"flash_attn *=|Flash Attention (enabled|not supported)", ln)})
kv_bytes = n_ctx_real * 1 * 2 * Hkv * d * (4 if args.kv_dtype == "f32" else 2)
sysinfo = L.llama_print_system_info().decode().strip()
L.llama_batch_free(batch)
L.llama_free(ctx)
L.llama_model_free(model)
shutil.rmtree(tmp)

print(f"serving: {w.describe(args.threads)}; KV {args.kv_dtype} on both sides")
print(f"mha {mha.__version__} ({mha.isa()}), block size {args.block_size}")
print(f"llama.cpp through llama-cpp-python {L.__version__}: {sysinfo}")
print(f"llama.cpp context: n_ctx {n_ctx_real}, n_seq_max {N}, kv_unified {unified}, "
      f"n_batch {max(P, N)}, n_ubatch {args.ubatch}, threads {args.threads}; model: 1 layer, "
      f"FFN {F_}, vocab {V}; flash attention: {' | '.join(fa) or 'no log line'}")
print("| | decode tokens/s | decode s | prefill ms | cache MiB |")
print("|---|---:|---:|---:|---:|")
print(f"| mha paged (forks share the prompt) | {r.tokens / r.decode_s:.0f} | {r.decode_s:.3f} | "
      f"{r.prefill_s * 1e3:.1f} | {r.mem_bytes / 2**20:.1f} (peak blocks) |")
print(f"| llama.cpp, {args.kv} KV, whole 1-layer model | {tokens_ll / t_ll:.0f} | {t_ll:.3f} | "
      f"{prefill_ll * 1e3:.1f} | {sum(kv_mib):.1f} (its KV buffer, allocated) |")
print(f"mha / llama.cpp tokens/s: {(r.tokens / r.decode_s) / (tokens_ll / t_ll):.2f}; "
      f"memory llama.cpp / mha: {sum(kv_mib) * 2**20 / r.mem_bytes:.1f}; "
      f"{tokens_ll} tokens in {len(sizes_ll)} steps on both sides (batch sizes checked)")
print(f"llama.cpp's own decode timer (llama_perf_context, the C++ side of the same steps): "
      f"{(perf.t_p_eval_ms + perf.t_eval_ms) / 1e3:.3f} s for {perf.n_p_eval + perf.n_eval} tokens; "
      f"KV buffer logged {kv_mib} MiB, n_ctx x 1 layer x 2 x Hkv x d x bytes = "
      f"{kv_bytes / 2**20:.2f} MiB")
assert r.tokens == tokens_ll
