"""Shared helpers of the Python suite (pytest; run by scripts/python_tests.sh
under PyTorch 1.13 and 2.x).

The tolerance rule, per output tensor, against a float64 reference:
    max|ours - ref64| <= max(4 * max|torch32 - ref64|, 4e-6 * (1 + max|ref64|))
where torch32 is PyTorch's own float32 computation of the same thing. The
worst err/tol over every assert_close of the session is reported at its end
("python: worst error/bound R (TEST, NAME)").
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2") or 2))

HAS_SDPA = hasattr(torch.nn.functional, "scaled_dot_product_attention")
TORCH2 = int(torch.__version__.split(".")[0]) >= 2


# The floor of the rule: FLOOR * (1 + max|ref64|).
FLOOR = 4e-6

# The worst err/tol of the session: [ratio, test id, tensor name].
_WORST = [0.0, None, None]


def tol(t32, ref64):
    ref64 = torch.as_tensor(ref64).double()
    terr = (torch.as_tensor(t32).double() - ref64).abs().max().item() if ref64.numel() else 0.0
    big = ref64.abs().max().item() if ref64.numel() else 0.0
    return max(4 * terr, FLOOR * (1 + big))


def assert_close(name, ours, t32, ref64):
    """The tolerance rule; returns (err, tol) for the caller's record."""
    ours = torch.as_tensor(ours).double()
    ref64 = torch.as_tensor(ref64).double()
    assert ours.shape == ref64.shape, "%s: shape %s, expected %s" % (name, tuple(ours.shape),
                                                                      tuple(ref64.shape))
    err = (ours - ref64).abs().max().item() if ref64.numel() else 0.0
    t = tol(t32, ref64)
    ratio = err / t if err == err else float("inf")  # t >= FLOOR; NaN: inf
    if _WORST[1] is None or ratio > _WORST[0]:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        _WORST[:] = [ratio, test, name]
    assert err <= t, "%s: max|ours - ref64| = %.3g > tol %.3g" % (name, err, t)
    return err, t


def run_isolated(code, timeout=120):
    """Runs code in a fresh interpreter (so a crash fails the test, not the
    suite) and returns (returncode, stdout, stderr)."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, timeout=timeout)
    return r.returncode, r.stdout, r.stderr


def sdpa_ref(q, k, v, mask=None, causal=False, scale=None, gqa=False):
    """softmax(scale q k^T + mask) v in the inputs' dtype, written out (PyTorch
    1.13 has no scaled_dot_product_attention). mask: bool (True takes part)
    or float (added), broadcast to the scores. Fully masked rows -> 0 (mha's
    rule)."""
    L, S, E = q.shape[-2], k.shape[-2], q.shape[-1]
    if gqa and q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        r = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(r, dim=-3)
        v = v.repeat_interleave(r, dim=-3)
    s = (q @ k.transpose(-2, -1)) * (1 / E ** 0.5 if scale is None else scale)
    if causal:
        s = s.masked_fill(torch.ones(L, S, dtype=torch.bool).triu(1), float("-inf"))
    if mask is not None:
        if mask.dtype == torch.bool:
            s = s.masked_fill(~mask, float("-inf"))
        else:
            s = s + mask.to(s.dtype)
    dead = torch.isinf(s).all(-1, keepdim=True) & (s < 0).all(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(dead, 0.0), -1).masked_fill(dead, 0.0)
    return p @ v


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def pytest_terminal_summary(terminalreporter):
    if _WORST[1] is not None:
        terminalreporter.write_line("python: worst error/bound %.3g (%s, %s)" % tuple(_WORST))
