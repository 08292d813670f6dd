"""Bad inputs of every kind raise the right exception with mha's message;
each case runs in a fresh interpreter, so that a crash fails its test."""

import pytest

from conftest import run_isolated

PRELUDE = """
import numpy as np, mha
m = mha.MultiheadAttention(16, 4).eval()
x = np.zeros((5, 2, 16), np.float32)
q4 = np.zeros((1, 2, 5, 8), np.float32)
"""

TORCH_PRELUDE = """
import torch, mha.torch as mt
m = mt.MultiheadAttention(16, 4)
x = torch.zeros(5, 2, 16)
q4 = torch.zeros(1, 2, 5, 8)
"""

# (id, prelude, statement, exception, part of the message)
CASES = [
    # dtypes
    ("int_query", PRELUDE, "m(x.astype(np.int32))", "TypeError", "dtype"),
    ("int64_key", PRELUDE, "m(x, x.astype(np.int64), x)", "TypeError", "key"),
    ("complex", PRELUDE, "m(x.astype(np.complex64))", "TypeError", "dtype"),
    ("int_mask", PRELUDE, "m(x, attn_mask=np.zeros((5, 5), np.int64))", "TypeError",
     "attn_mask"),
    ("string_query", PRELUDE, "m('abc')", "TypeError", "query"),
    ("object_array", PRELUDE, "m(np.array([None] * 80).reshape(5, 1, 16))", "TypeError", "query"),
    ("sdpa_int", PRELUDE, "mha.scaled_dot_product_attention(q4.astype(np.int16), q4, q4)",
     "TypeError", "dtype"),
    ("sdpa_int_mask", PRELUDE,
     "mha.scaled_dot_product_attention(q4, q4, q4, attn_mask=np.zeros((5, 5), np.int32))",
     "TypeError", "attn_mask"),
    ("weight_dtype", PRELUDE, "mha.MultiheadAttention(16, 4, weight_dtype='int8')", "TypeError",
     "dtype"),
    ("torch_int", TORCH_PRELUDE, "m(x.long(), x.long(), x.long())", "TypeError", "dtype"),
    ("torch_complex", TORCH_PRELUDE, "m(x.cfloat(), x.cfloat(), x.cfloat())", "TypeError",
     "dtype"),
    ("torch_meta", TORCH_PRELUDE, "m(x.to('meta'), x.to('meta'), x.to('meta'))", "TypeError",
     "CPU"),
    ("torch_dtype_arg", "import torch, mha.torch as mt",
     "mt.MultiheadAttention(16, 4, dtype=torch.float64)", "TypeError", "float32"),
    ("torch_double_params", TORCH_PRELUDE, "m.double(); m(x, x, x)", "TypeError", "float32"),
    # shapes
    ("wrong_ndim", PRELUDE, "m(x[None])", "ValueError", "dims"),
    ("one_dim", PRELUDE, "m(x[0, 0])", "ValueError", "query"),
    ("embed_mismatch", PRELUDE, "m(x[:, :, :8])", "ValueError", "embed_dim"),
    ("batch_mismatch", PRELUDE, "m(x, x[:, :1], x[:, :1])", "ValueError", "batch"),
    ("kv_length_mismatch", PRELUDE, "m(x, x, x[:3])", "ValueError", "value"),
    ("kpm_shape", PRELUDE, "m(x, key_padding_mask=np.zeros((3, 5), bool))", "ValueError",
     "key_padding_mask"),
    ("attn_mask_shape", PRELUDE, "m(x, attn_mask=np.zeros((4, 5), bool))", "ValueError",
     "attn_mask"),
    ("attn_mask_3d_shape", PRELUDE, "m(x, attn_mask=np.zeros((3, 5, 5), bool))", "ValueError",
     "attn_mask"),
    ("key_without_value", PRELUDE, "m(x, x)", "ValueError", "value"),
    ("too_many_dims", PRELUDE, "m(np.zeros((1,) * 9, np.float32))", "ValueError", "dims"),
    ("sdpa_heads", PRELUDE, "mha.scaled_dot_product_attention(q4, q4[:, :1].repeat(3, 1), q4)",
     "ValueError", ""),
    ("sdpa_gqa", PRELUDE, "mha.scaled_dot_product_attention(np.zeros((1, 3, 5, 8), "
     "np.float32), q4, q4, enable_gqa=True)", "ValueError", "multiple"),
    ("sdpa_feature", PRELUDE, "mha.scaled_dot_product_attention(q4, q4[..., :4], q4[..., :4])",
     "ValueError", "last dim"),
    ("sdpa_mask_shape", PRELUDE,
     "mha.scaled_dot_product_attention(q4, q4, q4, attn_mask=np.zeros((3, 5), bool))",
     "ValueError", "attn_mask"),
    ("sdpa_1d", PRELUDE, "mha.scaled_dot_product_attention(q4[0, 0, 0], q4, q4)", "ValueError",
     "2 dims"),
    ("sdpa_lead_broadcast", PRELUDE,
     "mha.scaled_dot_product_attention(np.zeros((2, 1, 5, 8), np.float32), "
     "np.zeros((3, 1, 5, 8), np.float32), np.zeros((3, 1, 5, 8), np.float32))", "ValueError",
     "broadcast"),
    ("huge_broadcast", PRELUDE,
     "mha.scaled_dot_product_attention(np.broadcast_to(np.float32(1), (1 << 30, 1 << 30, 5, 8)),"
     " q4, q4)", "MemoryError|ValueError", ""),
    ("torch_shape", TORCH_PRELUDE, "m(x[:, :, :8], x, x)", "ValueError", "embed_dim"),
    ("torch_mask_grad", TORCH_PRELUDE,
     "mt.scaled_dot_product_attention(q4, q4, q4, attn_mask=torch.zeros(5, 5, "
     "requires_grad=True))", "ValueError", "grad"),
    # values
    ("embed_not_divisible", "import mha", "mha.MultiheadAttention(10, 4)", "ValueError",
     "embed_dim"),
    ("zero_heads", "import mha", "mha.MultiheadAttention(16, 0)", "ValueError", "num_heads"),
    ("float_heads", "import mha", "mha.MultiheadAttention(16, 4.5)", "TypeError", "num_heads"),
    ("kv_heads", "import mha", "mha.MultiheadAttention(16, 4, num_kv_heads=3)", "ValueError",
     "num_kv_heads"),
    ("dropout_nan", "import mha", "mha.MultiheadAttention(16, 4, dropout=float('nan'))",
     "ValueError", "dropout"),
    ("dropout_one", "import mha", "mha.MultiheadAttention(16, 4, dropout=1.0)", "ValueError",
     "dropout"),
    ("softcap_nan", PRELUDE, "m(x, softcap=float('nan'))", "ValueError", "softcap"),
    ("softcap_negative", PRELUDE, "m(x, softcap=-1.0)", "ValueError", "softcap"),
    ("window_bad", PRELUDE, "m(x, window=-3)", "ValueError", "window"),
    ("scale_nan", PRELUDE, "mha.scaled_dot_product_attention(q4, q4, q4, scale=float('nan'))",
     "ValueError", "scale"),
    ("sdpa_dropout_p", PRELUDE, "mha.scaled_dot_product_attention(q4, q4, q4, dropout_p=1.5)",
     "ValueError", "dropout_p"),
    ("impl_name", PRELUDE, "m(x, impl='fast')", "ValueError", "impl"),
    ("fused_f64", PRELUDE, "m(x.astype(np.float64), impl='fused')", "TypeError", "F32"),
    ("rope_mode", PRELUDE, "m(x, rope='spiral')", "ValueError", "rope"),
    ("rope_start_len", PRELUDE, "m(x, rope='neox', rope_start=[0, 1, 2])", "ValueError",
     "rope_start"),
    ("alibi_len", PRELUDE, "m(x, alibi=[0.5, 0.25])", "ValueError", "alibi_slopes"),
    ("weights_block", PRELUDE, "m(x, weights_heads=(3, 9))", "ValueError", "head"),
    ("unknown_keyword", PRELUDE, "m(x, colour='red')", "TypeError", "colour"),
    ("prune_range", PRELUDE, "m.prune_heads([7])", "ValueError", "7"),
    # state_dict and files
    ("state_missing", PRELUDE, "d = m.state_dict(); del d['in_proj_bias']; m.load_state_dict(d)",
     "ValueError", "in_proj_bias"),
    ("state_unexpected", PRELUDE, "d = m.state_dict(); d['extra'] = d['in_proj_bias']; "
     "m.load_state_dict(d)", "ValueError", "extra"),
    ("state_shape", PRELUDE, "d = m.state_dict(); d['in_proj_weight'] = d['in_proj_weight'][:8];"
     " m.load_state_dict(d)", "ValueError", "in_proj_weight"),
    ("state_dtype", PRELUDE, "d = m.state_dict(); d['out_proj.bias'] = np.zeros(16, np.int32); "
     "m.load_state_dict(d)", "TypeError", "out_proj.bias"),
    ("torch_state_shape", TORCH_PRELUDE, "d = m.state_dict(); d['in_proj_weight'] = "
     "torch.zeros(3, 3); m.load_state_dict(d)", "RuntimeError", "in_proj_weight"),
    ("load_missing_file", "import mha", "mha.MultiheadAttention.load('/nonexistent.safetensors')",
     "OSError", "nonexistent"),
    ("load_garbage", "import mha, tempfile, os\nf = tempfile.mktemp()\nopen(f, 'wb').write(b'\\xff' * 64)",
     "mha.MultiheadAttention.load(f)", "ValueError", ""),
    ("param_name", PRELUDE, "m._m.param('nope')", "KeyError", "nope"),
    # the cache
    ("cache_full", "import numpy as np, mha\nc = mha.KVCache(1, 1, 4, capacity=2)\n"
     "k = np.zeros((1, 1, 2, 4), np.float32)\nc.append(k, k)", "c.append(k, k)", "ValueError",
     ""),
    ("cache_dtype", "import mha", "mha.KVCache(1, 1, 4, capacity=2, dtype='int3')", "TypeError",
     "int3"),
    ("cache_counts", "import numpy as np, mha\nc = mha.KVCache(2, 1, 4, capacity=2)\n"
     "k = np.zeros((2, 1, 1, 4), np.float32)", "c.append(k, k, counts=[1])", "ValueError",
     "counts"),
    ("cache_heads", "import numpy as np, mha\nc = mha.KVCache(1, 2, 4, capacity=2)",
     "c.append(np.zeros((1, 1, 1, 4), np.float32), np.zeros((1, 1, 1, 4), np.float32))",
     "ValueError", ""),
    ("cache_length_index", "import mha\nc = mha.KVCache(1, 1, 4, capacity=2)", "c.length(3)",
     "IndexError", "3"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(case):
    _, prelude, stmt, exc, text = case
    code = prelude + "\n" + """
try:
    %s
    print("NO EXCEPTION")
except Exception as e:
    print("RAISED", type(e).__name__)
    print(str(e))
""" % stmt
    rc, out, err = run_isolated(code)
    assert rc == 0, "the interpreter died (rc %d): %s" % (rc, err[-2000:])
    lines = out.strip().splitlines()
    assert lines and lines[0].startswith("RAISED"), out + err
    got = lines[0].split()[1]
    assert got in exc.split("|"), "expected %s, got %s: %s" % (exc, got, out)
    assert text in out, "message %r lacks %r" % (out, text)


# A keyword a call does not take is reported under the public call the
# user made (it named the internal forward_kwargs()).
UNKNOWN_KEYWORD = [
    ("forward", PRELUDE, "m(x, colour='red')", "mha.MultiheadAttention.forward()"),
    ("backward", PRELUDE, "m.backward(x, x, colour='red')", "mha.MultiheadAttention.backward()"),
    ("forward_cached", PRELUDE, "m.forward_cached(x[:1], m.make_cache(2, 8), colour='red')",
     "mha.MultiheadAttention.forward_cached()"),
    ("forward_paged", PRELUDE + "pc = m.make_paged_cache(num_blocks=4, block_size=4)\n"
     "a = pc.add_sequence()", "m.forward_paged(pc, [a], [x[:, 0]], colour='red')",
     "mha.MultiheadAttention.forward_paged()"),
    ("diagnose", PRELUDE, "mha.diagnose(m, x, colour='red')", "mha.diagnose()"),
    ("torch_init", "import mha.torch as mt", "mt.MultiheadAttention(16, 4, colour='red')",
     "mha.torch.MultiheadAttention()"),
    ("torch_forward", TORCH_PRELUDE, "m(x, x, x, colour='red')",
     "mha.torch.MultiheadAttention.forward()"),
]


@pytest.mark.parametrize("case", UNKNOWN_KEYWORD, ids=[c[0] for c in UNKNOWN_KEYWORD])
def test_unknown_keyword_names_the_call(case):
    _, prelude, stmt, call = case
    code = prelude + "\n" + """
try:
    %s
    print("NO EXCEPTION")
except TypeError as e:
    print("RAISED", e)
""" % stmt
    rc, out, err = run_isolated(code)
    assert rc == 0, "the interpreter died (rc %d): %s" % (rc, err[-2000:])
    assert out.startswith("RAISED"), out + err
    assert call in out and "'colour'" in out, out
    assert "forward_kwargs" not in out, out
    assert "rope" in out, "the message lists the extras: %s" % out


def test_torch_missing_says_how_to_install():
    """mha.torch without PyTorch (hidden by an import hook): an ImportError
    that says how to add it (the extra, PyTorch's CPU index, Debian's
    package); the numpy API still imports."""
    code = """
import importlib.abc, sys

class HideTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError("No module named %r" % name, name=name)
        return None

sys.meta_path.insert(0, HideTorch())
import mha
print("numpy API", mha.__version__)
try:
    import mha.torch
    print("NO EXCEPTION")
except ImportError as e:
    print("RAISED", e)
"""
    rc, out, err = run_isolated(code)
    assert rc == 0, "the interpreter died (rc %d): %s" % (rc, err[-2000:])
    lines = out.strip().splitlines()
    assert lines[0].startswith("numpy API"), out + err
    assert lines[1].startswith("RAISED"), out + err
    for part in ("No module named 'torch'", "pip install 'mha[torch]'",
                 "--extra-index-url https://download.pytorch.org/whl/cpu",
                 "--system-site-packages"):
        assert part in lines[1], "message %r lacks %r" % (lines[1], part)


def test_one_version():
    """pyproject.toml, CMakeLists.txt's project() and mha.h's macros name the
    version mha.__version__ (the library's mha_version()) reports."""
    import os
    import re
    import mha
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    read = lambda p: open(os.path.join(root, p), encoding="utf-8").read()
    py = re.search(r'^version = "([^"]+)"', read("pyproject.toml"), re.M).group(1)
    cm = re.search(r"project\(mha VERSION ([0-9.]+)", read("CMakeLists.txt")).group(1)
    h = ".".join(re.search(r"#define MHA_VERSION_%s (\d+)" % k, read("include/mha.h")).group(1)
                 for k in ("MAJOR", "MINOR", "PATCH"))
    assert py == cm == h == mha.__version__, (py, cm, h, mha.__version__)
