#!/usr/bin/env python3
"""f16_accumulation.py: why mha's float16 attention converts on load and sums
in float32 instead of using AVX512-FP16's vfmadd*ph (which sums in float16).

One head (L 1024, d 64, float16 inputs from a fixed seed) computed two ways
and compared with float64 attention over the same rounded inputs:
  - float32 sums (mha's f16 path and PyTorch's CPU float16 SDPA);
  - float16 sums, as an FP16-FMA kernel would do them: QK^T accumulated
    over d in float16, P rounded to float16 and PV accumulated over the keys
    in float16 (softmax itself in float32).
The project's accuracy rule allows a half path at most 2x PyTorch's error on
the same call. Measured on 2026-12-07 (numpy 2.4.6): float32 sums 6.28e-05,
float16 sums 2.64e-03 (42x).

    /opt/mha-venvs/torch2/bin/python bench/f16_accumulation.py
"""
import numpy as np

rng = np.random.default_rng(0)
L, d = 1024, 64
q, k, v = [rng.standard_normal((L, d)).astype(np.float16) for _ in range(3)]
Q, K, V = [x.astype(np.float64) for x in (q, k, v)]
S = Q @ K.T / np.sqrt(d)
P = np.exp(S - S.max(1, keepdims=True))
ref = (P / P.sum(1, keepdims=True)) @ V


def f32_sums():
    s = (q.astype(np.float32) @ k.astype(np.float32).T) / np.float32(np.sqrt(d))
    p = np.exp(s - s.max(1, keepdims=True))
    return ((p @ v.astype(np.float32)) / p.sum(1, keepdims=True)).astype(np.float16)


def f16_sums():
    qs = (q.astype(np.float32) / np.float32(np.sqrt(d))).astype(np.float16)
    s = np.zeros((L, L), np.float16)
    for c in range(d):
        s = (s + np.outer(qs[:, c], k[:, c]).astype(np.float16)).astype(np.float16)
    s = s.astype(np.float32)
    p = np.exp(s - s.max(1, keepdims=True))
    l = p.sum(1, keepdims=True)
    p16 = p.astype(np.float16)
    o = np.zeros((L, d), np.float16)
    for j in range(L):
        o = (o + (p16[:, j:j + 1] * v[j:j + 1, :]).astype(np.float16)).astype(np.float16)
    return (o.astype(np.float32) / l).astype(np.float16)


e32 = np.abs(f32_sums().astype(np.float64) - ref).max()
e16 = np.abs(f16_sums().astype(np.float64) - ref).max()
print(f"max error against float64: float32 sums {e32:.3g}, float16 sums {e16:.3g} "
      f"({e16 / e32:.0f}x)")
