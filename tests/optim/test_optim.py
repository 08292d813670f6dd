#!/usr/bin/python3
"""test_optim.py: libmha's optimizers against torch.optim (PyTorch 1.13).

Loads the shared library with ctypes and runs the same float32 parameters
and the same random gradients through libmha and through
  torch.optim.SGD     plain, momentum, dampening, nesterov, weight decay
  torch.optim.AdamW   several lr / betas / eps / weight_decay, lr changes
  torch.nn.utils.clip_grad_norm_   norms above and below max_norm
for --steps steps (default 20), comparing after every step.

Tolerance, per step and tensor, float32:
    max|ours - torch| <= 1e-6 * (1 + max|torch|)
libmha applies torch's float32 operations in torch's order (fused
multiply-adds where torch's AVX2/AVX-512 kernels fuse), so on such a CPU
most elements agree to the bit (the count is printed). With torch's
non-vectorised kernels (ATEN_CPU_CAPABILITY=default) each operation may
round differently by half an ulp: a few ulps of |p| per step, about 1e-7
relative after 20 steps, well inside the bound. clip_grad_norm_ computes the
norm in float32 in torch and in double here: the norms are compared with a
relative 1e-5 (float32 summation of up to a few thousand squares), the
clipped gradients with the rule above.

Also: misuse through ctypes (bad lr, betas, eps, nesterov without momentum,
overlapping tensors, mismatched modules) returns a negative status with a
message; mha_optim_add_module pairs parameters by name.

Usage:
  /usr/bin/python3 tests/optim/test_optim.py --lib build/libmha.so [-v]

Prints one line per case and ends with "N passed, M failed"; exits 1 when
anything failed or torch cannot be imported.
"""

import argparse
import ctypes as C
import math
import os
import sys

try:
    import numpy as np
    import torch
except Exception as exc:  # pragma: no cover - environment problem
    print("test_optim: cannot import torch/numpy (%s: %s); run this test "
          "with a Python that has PyTorch, e.g. Debian's /usr/bin/python3 "
          "with python3-torch" % (type(exc).__name__, exc))
    print("0 passed, 1 failed")
    sys.exit(1)

MHA_OK = 0
MHA_OPTIM_SGD = 0
MHA_OPTIM_ADAMW = 1


# The structs of mha.h, field for field (enum = int, bool = _Bool).
class OptimConfig(C.Structure):
    _fields_ = [
        ("kind", C.c_int),
        ("lr", C.c_double),
        ("weight_decay", C.c_double),
        ("momentum", C.c_double),
        ("dampening", C.c_double),
        ("nesterov", C.c_bool),
        ("beta1", C.c_double),
        ("beta2", C.c_double),
        ("eps", C.c_double),
    ]


class Param(C.Structure):
    _fields_ = [
        ("name", C.c_char_p),
        ("ndim", C.c_int),
        ("shape", C.c_int64 * 3),
        ("numel", C.c_int64),
        ("data", C.POINTER(C.c_float)),
        ("dtype", C.c_int),
        ("storage", C.c_void_p),
    ]


FLOATP = C.POINTER(C.c_float)


def load(path):
    lib = C.CDLL(path)
    sig = {
        "mha_optim_config_init": (None, [C.c_void_p, C.c_int]),
        "mha_optim_create": (C.c_int, [C.POINTER(C.c_void_p),
                                           C.POINTER(OptimConfig)]),
        "mha_optim_destroy": (None, [C.c_void_p]),
        "mha_optim_add": (C.c_int, [C.c_void_p, FLOATP, FLOATP,
                                        C.c_int64]),
        "mha_optim_add_module": (C.c_int, [C.c_void_p, C.c_void_p,
                                               C.c_void_p]),
        "mha_optim_set_lr": (C.c_int, [C.c_void_p, C.c_double]),
        "mha_optim_step": (C.c_int, [C.c_void_p]),
        "mha_optim_zero_grad": (None, [C.c_void_p]),
        "mha_optim_clip_grad_norm": (C.c_int, [C.c_void_p, C.c_double,
                                                   C.POINTER(C.c_double)]),
        "mha_last_error": (C.c_char_p, []),
        "mha_config_init": (None, [C.c_void_p, C.c_int64, C.c_int64]),
        "mha_module_create": (C.c_int, [C.POINTER(C.c_void_p), C.c_void_p]),
        "mha_module_destroy": (None, [C.c_void_p]),
        "mha_module_num_params": (C.c_int, [C.c_void_p]),
        "mha_module_param_at": (C.c_int, [C.POINTER(Param), C.c_void_p,
                                          C.c_int]),
    }
    for name, (res, args) in sig.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args
    return lib


class Tally:
    def __init__(self, verbose):
        self.passed = 0
        self.failed = 0
        self.verbose = verbose

    def case(self, name, ok, detail=""):
        if ok:
            self.passed += 1
        else:
            self.failed += 1
        print("%-4s %s%s" % ("ok" if ok else "FAIL", name,
                             ("  " + detail) if detail else ""))


def fptr(a):
    return a.ctypes.data_as(FLOATP)


def make_config(lib, kind, **kw):
    c = OptimConfig()
    lib.mha_optim_config_init(C.byref(c), kind)
    for k, v in kw.items():
        setattr(c, k, v)
    return c


class Ours:
    """A libmha optimizer over numpy float32 arrays (kept alive here)."""

    def __init__(self, lib, cfg, params, grads):
        self.lib = lib
        self.h = C.c_void_p()
        st = lib.mha_optim_create(C.byref(self.h), C.byref(cfg))
        if st != MHA_OK:
            raise RuntimeError("mha_optim_create -> %d: %s"
                               % (st, lib.mha_last_error().decode()))
        self.params, self.grads = params, grads
        for p, g in zip(params, grads):
            st = lib.mha_optim_add(self.h, fptr(p), fptr(g), p.size)
            if st != MHA_OK:
                raise RuntimeError("mha_optim_add -> %d: %s"
                                   % (st, lib.mha_last_error().decode()))

    def step(self):
        st = self.lib.mha_optim_step(self.h)
        if st != MHA_OK:
            raise RuntimeError("mha_optim_step -> %d" % st)

    def close(self):
        self.lib.mha_optim_destroy(self.h)
        self.h = None


SHAPES = [(7, 5), (13,), (3, 4, 2), (1000,), (64, 33)]


def compare(pt, ours):
    """(ok, worst ratio err/bound, bit-identical elements, total)."""
    worst = 0.0
    same = total = 0
    for t, o in zip(pt, ours):
        ref = t.detach().numpy()
        err = float(np.max(np.abs(ref.astype(np.float64) - o)))
        bound = 1e-6 * (1.0 + float(np.max(np.abs(ref))))
        worst = max(worst, err / bound)
        same += int(np.sum(ref.view(np.uint32) == o.view(np.uint32)))
        total += ref.size
    return worst <= 1.0, worst, same, total


def run_optim_case(lib, tally, name, kind, torch_cls, torch_kw, ours_kw,
                   steps, seed, lr_change=None, clip=None):
    rng = np.random.default_rng(seed)
    p0 = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    pt = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in p0]
    ours_p = [p.copy() for p in p0]
    ours_g = [np.zeros_like(p) for p in p0]
    opt = torch_cls(pt, **torch_kw)
    ours = Ours(lib, make_config(lib, kind, **ours_kw), ours_p, ours_g)
    ok = True
    worst = 0.0
    same = total = 0
    detail = ""
    try:
        for step in range(steps):
            if lr_change and step == lr_change[0]:
                for grp in opt.param_groups:
                    grp["lr"] = lr_change[1]
                st = lib.mha_optim_set_lr(ours.h, lr_change[1])
                if st != MHA_OK:
                    ok, detail = False, "set_lr -> %d" % st
                    break
            scale = 1.0 + 3.0 * rng.random()
            for t, g in zip(pt, ours_g):
                gi = (scale * rng.standard_normal(g.shape)).astype(np.float32)
                g[...] = gi
                t.grad = torch.from_numpy(gi.copy())
            if clip is not None:
                tn = float(torch.nn.utils.clip_grad_norm_(pt, clip))
                on = C.c_double(-1.0)
                st = lib.mha_optim_clip_grad_norm(ours.h, clip,
                                                      C.byref(on))
                if st != MHA_OK or abs(on.value - tn) > 1e-5 * tn:
                    ok = False
                    detail = "step %d: clip status %d norm %r vs torch %r" % (
                        step, st, on.value, tn)
                    break
                gok, gw, _, _ = compare([t.grad for t in pt], ours_g)
                if not gok:
                    ok = False
                    detail = "step %d: clipped grads err/bound %.3g" % (step,
                                                                        gw)
                    break
            opt.step()
            ours.step()
            sok, sw, s_same, s_total = compare(pt, ours_p)
            worst = max(worst, sw)
            same += s_same
            total += s_total
            if not sok:
                ok = False
                detail = "step %d: err/bound %.3g" % (step, sw)
                break
    finally:
        ours.close()
    if ok:
        detail = "%d steps, worst err/bound %.3g, bit-identical %.2f%%" % (
            steps, worst, 100.0 * same / max(total, 1))
    tally.case(name, ok, detail)


def optim_cases(lib, tally, steps):
    sgd = torch.optim.SGD
    sgd_cases = [
        ("sgd plain lr=0.1", dict(lr=0.1)),
        ("sgd lr=0 (no change)", dict(lr=0.0)),
        ("sgd momentum=0.9", dict(lr=0.05, momentum=0.9)),
        ("sgd momentum=0.9 dampening=0.5",
         dict(lr=0.05, momentum=0.9, dampening=0.5)),
        ("sgd momentum=0.5 dampening=1", dict(lr=0.1, momentum=0.5,
                                              dampening=1.0)),
        ("sgd nesterov momentum=0.9", dict(lr=0.05, momentum=0.9,
                                           nesterov=True)),
        ("sgd weight_decay=0.01", dict(lr=0.1, weight_decay=0.01)),
        ("sgd weight_decay=0.1 momentum=0.8",
         dict(lr=0.02, momentum=0.8, weight_decay=0.1)),
        ("sgd nesterov weight_decay=1e-3 momentum=0.99",
         dict(lr=0.01, momentum=0.99, nesterov=True, weight_decay=1e-3)),
    ]
    for i, (name, kw) in enumerate(sgd_cases):
        ours_kw = dict(kw)
        run_optim_case(lib, tally, name, MHA_OPTIM_SGD, sgd, kw, ours_kw,
                       steps, 100 + i)
    run_optim_case(lib, tally, "sgd momentum=0.9 lr 0.1 -> 0.01 at step 10",
                   MHA_OPTIM_SGD, sgd, dict(lr=0.1, momentum=0.9),
                   dict(lr=0.1, momentum=0.9), steps, 150,
                   lr_change=(10, 0.01))

    adamw = torch.optim.AdamW
    adam_cases = [
        ("adamw defaults", dict(), dict()),
        ("adamw lr=1e-2 betas=(0.8,0.99) eps=1e-6 wd=0.1",
         dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
         dict(lr=1e-2, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1)),
        ("adamw lr=3e-4 betas=(0.95,0.98) wd=0",
         dict(lr=3e-4, betas=(0.95, 0.98), weight_decay=0.0),
         dict(lr=3e-4, beta1=0.95, beta2=0.98, weight_decay=0.0)),
        ("adamw lr=0.1 betas=(0,0.5) eps=1e-3 wd=1",
         dict(lr=0.1, betas=(0.0, 0.5), eps=1e-3, weight_decay=1.0),
         dict(lr=0.1, beta1=0.0, beta2=0.5, eps=1e-3, weight_decay=1.0)),
        ("adamw lr=1e-3 betas=(0.9,0.9999) eps=0 wd=0.05",
         dict(lr=1e-3, betas=(0.9, 0.9999), eps=0.0, weight_decay=0.05),
         dict(lr=1e-3, beta1=0.9, beta2=0.9999, eps=0.0, weight_decay=0.05)),
    ]
    for i, (name, tkw, okw) in enumerate(adam_cases):
        run_optim_case(lib, tally, name, MHA_OPTIM_ADAMW, adamw, tkw, okw,
                       steps, 200 + i)
    run_optim_case(lib, tally, "adamw lr 1e-2 -> 1e-3 at step 10",
                   MHA_OPTIM_ADAMW, adamw, dict(lr=1e-2), dict(lr=1e-2),
                   steps, 250, lr_change=(10, 1e-3))
    # A training loop: clip, then step.
    run_optim_case(lib, tally, "adamw + clip_grad_norm 5 each step",
                   MHA_OPTIM_ADAMW, adamw, dict(lr=1e-2), dict(lr=1e-2),
                   steps, 260, clip=5.0)
    run_optim_case(lib, tally, "sgd momentum + clip_grad_norm 50 each step",
                   MHA_OPTIM_SGD, sgd, dict(lr=0.01, momentum=0.9),
                   dict(lr=0.01, momentum=0.9), steps, 261, clip=50.0)


def clip_cases(lib, tally):
    rng = np.random.default_rng(7)
    shapes = [(5, 3), (17,), (2, 2, 2), (300,)]
    for max_norm, scale in [(1.0, 1.0), (1e3, 1.0), (10.0, 0.1),
                            (0.5, 5.0), (0.0, 1.0), (math.inf, 1.0)]:
        gs = [(scale * rng.standard_normal(s)).astype(np.float32)
              for s in shapes]
        ps = [np.zeros_like(g) for g in gs]
        pt = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
        for t, g in zip(pt, gs):
            t.grad = torch.from_numpy(g.copy())
        tn = float(torch.nn.utils.clip_grad_norm_(pt, max_norm))
        ours = Ours(lib, make_config(lib, MHA_OPTIM_SGD), ps, gs)
        on = C.c_double(-1.0)
        st = lib.mha_optim_clip_grad_norm(ours.h, max_norm, C.byref(on))
        ours.close()
        gok, gw, _, _ = compare([t.grad for t in pt], gs)
        clipped = tn > max_norm
        ok = st == MHA_OK and abs(on.value - tn) <= 1e-5 * tn and gok
        tally.case("clip_grad_norm max_norm=%g norm=%.4g (%s)"
                   % (max_norm, tn, "clipped" if clipped else "unchanged"),
                   ok, "norm %.9g vs torch %.9g, grads err/bound %.3g"
                   % (on.value, tn, gw))

    # No tensors: norm 0.
    ours = Ours(lib, make_config(lib, MHA_OPTIM_SGD), [], [])
    on = C.c_double(-1.0)
    st = lib.mha_optim_clip_grad_norm(ours.h, 1.0, C.byref(on))
    ours.close()
    tally.case("clip_grad_norm with no tensors: norm 0",
               st == MHA_OK and on.value == 0.0)

    # Non-finite norm (documented: gradients untouched, status OK).
    g = np.array([1.0, np.inf, 2.0], dtype=np.float32)
    g2 = np.array([3.0, 4.0], dtype=np.float32)
    ps = [np.zeros_like(g), np.zeros_like(g2)]
    before = [g.copy(), g2.copy()]
    ours = Ours(lib, make_config(lib, MHA_OPTIM_SGD), ps, [g, g2])
    on = C.c_double(-1.0)
    st = lib.mha_optim_clip_grad_norm(ours.h, 1.0, C.byref(on))
    ours.close()
    tally.case("clip_grad_norm with an inf gradient: norm inf, untouched",
               st == MHA_OK and math.isinf(on.value)
               and np.array_equal(g, before[0])
               and np.array_equal(g2, before[1]))

    # NULL total_norm is allowed.
    g = np.full(4, 10.0, dtype=np.float32)
    p = np.zeros(4, dtype=np.float32)
    ours = Ours(lib, make_config(lib, MHA_OPTIM_SGD), [p], [g])
    st = lib.mha_optim_clip_grad_norm(ours.h, 1.0, None)
    ours.close()
    tally.case("clip_grad_norm with total_norm NULL",
               st == MHA_OK and abs(float(np.linalg.norm(g)) - 1.0) < 1e-5)


def zero_grad_case(lib, tally):
    p = [np.ones(5, dtype=np.float32), np.ones(3, dtype=np.float32)]
    g = [np.full(5, 2.0, dtype=np.float32), np.full(3, -1.0, dtype=np.float32)]
    ours = Ours(lib, make_config(lib, MHA_OPTIM_SGD), p, g)
    lib.mha_optim_zero_grad(ours.h)
    ours.close()
    tally.case("zero_grad sets every gradient to 0",
               all(not np.any(x) for x in g)
               and all(np.all(x == 1.0) for x in p))


def layout_case(lib, tally):
    """mha_optim_config_init writes exactly sizeof(OptimConfig) bytes with
    the defaults at the offsets ctypes expects."""
    size = C.sizeof(OptimConfig)
    ok = True
    for kind, lr, wd in [(MHA_OPTIM_SGD, 0.01, 0.0),
                         (MHA_OPTIM_ADAMW, 1e-3, 0.01)]:
        buf = (C.c_ubyte * (size + 64))(*([0xA5] * (size + 64)))
        lib.mha_optim_config_init(buf, kind)
        c = OptimConfig.from_buffer(buf)
        tail_untouched = all(b == 0xA5 for b in buf[size:])
        ok &= (tail_untouched and c.kind == kind and c.lr == lr
               and c.weight_decay == wd and c.momentum == 0.0
               and c.dampening == 0.0 and c.nesterov is False
               and c.beta1 == 0.9 and c.beta2 == 0.999 and c.eps == 1e-8)
    tally.case("mha_optim_config layout (%d bytes) and defaults" % size, ok)


def expect_fail(lib, tally, name, st, want_in_msg=None):
    msg = lib.mha_last_error().decode(errors="replace")
    ok = st < 0 and msg != "" and (want_in_msg is None or want_in_msg in msg)
    tally.case("error: " + name, ok, "status %d: %s" % (st, msg))


def error_cases(lib, tally):
    def create(kind, **kw):
        h = C.c_void_p(1234)
        st = lib.mha_optim_create(C.byref(h), C.byref(
            make_config(lib, kind, **kw)))
        if st == MHA_OK:
            lib.mha_optim_destroy(h)
        elif h.value is not None:
            return 99  # *out must be NULL on failure
        return st

    S, A = MHA_OPTIM_SGD, MHA_OPTIM_ADAMW
    expect_fail(lib, tally, "sgd lr=-1", create(S, lr=-1.0), "-1")
    expect_fail(lib, tally, "sgd lr=nan", create(S, lr=math.nan), "lr")
    expect_fail(lib, tally, "adamw lr=inf", create(A, lr=math.inf), "lr")
    expect_fail(lib, tally, "sgd momentum=-0.1", create(S, momentum=-0.1),
                "momentum")
    expect_fail(lib, tally, "sgd weight_decay=-1",
                create(S, weight_decay=-1.0), "weight_decay")
    expect_fail(lib, tally, "sgd dampening=nan",
                create(S, momentum=0.9, dampening=math.nan), "dampening")
    expect_fail(lib, tally, "sgd nesterov without momentum",
                create(S, nesterov=True), "nesterov")
    expect_fail(lib, tally, "sgd nesterov with dampening 0.1",
                create(S, nesterov=True, momentum=0.9, dampening=0.1),
                "dampening 0.1")
    expect_fail(lib, tally, "adamw beta1=1", create(A, beta1=1.0), "beta1")
    expect_fail(lib, tally, "adamw beta2=-0.1", create(A, beta2=-0.1),
                "beta2")
    expect_fail(lib, tally, "adamw eps=-1e-8", create(A, eps=-1e-8), "eps")
    expect_fail(lib, tally, "adamw weight_decay=-0.01",
                create(A, weight_decay=-0.01), "weight_decay")
    expect_fail(lib, tally, "unknown kind 7", create(7), "kind 7")
    expect_fail(lib, tally, "create with NULL config",
                lib.mha_optim_create(C.byref(C.c_void_p()), None))
    # What torch accepts, libmha accepts (SGD ignores betas/eps; AdamW
    # ignores momentum and nesterov).
    tally.case("sgd ignores AdamW fields, adamw ignores SGD fields",
               create(S, beta1=5.0, eps=-1.0) == MHA_OK
               and create(A, nesterov=True, momentum=-1.0) == MHA_OK)

    h = C.c_void_p()
    st = lib.mha_optim_create(C.byref(h), C.byref(make_config(lib, S)))
    if st != MHA_OK:
        tally.case("create SGD for error cases", False)
        return
    p = np.zeros(8, dtype=np.float32)
    g = np.zeros(8, dtype=np.float32)
    expect_fail(lib, tally, "set_lr(-0.5)",
                lib.mha_optim_set_lr(h, -0.5), "-0.5")
    expect_fail(lib, tally, "set_lr(inf)",
                lib.mha_optim_set_lr(h, math.inf), "lr")
    expect_fail(lib, tally, "add NULL param",
                lib.mha_optim_add(h, None, fptr(g), 8), "NULL")
    expect_fail(lib, tally, "add n=-1",
                lib.mha_optim_add(h, fptr(p), fptr(g), -1), "-1")
    expect_fail(lib, tally, "add param == grad",
                lib.mha_optim_add(h, fptr(p), fptr(p), 8), "overlap")
    pv = p[4:]  # overlaps p[0:8]
    tally.case("add first tensor",
               lib.mha_optim_add(h, fptr(p), fptr(g), 8) == MHA_OK)
    g2 = np.zeros(4, dtype=np.float32)
    expect_fail(lib, tally, "add a tensor overlapping a registered one",
                lib.mha_optim_add(h, fptr(pv), fptr(g2), 4), "overlap")
    expect_fail(lib, tally, "clip max_norm=-1",
                lib.mha_optim_clip_grad_norm(h, -1.0, None), "max_norm")
    expect_fail(lib, tally, "clip max_norm=nan",
                lib.mha_optim_clip_grad_norm(h, math.nan, None),
                "max_norm")
    expect_fail(lib, tally, "step NULL", lib.mha_optim_step(None))
    lib.mha_optim_destroy(h)
    lib.mha_optim_destroy(None)  # accepted
    lib.mha_optim_zero_grad(None)  # accepted


def module_params(lib, m):
    out = {}
    for i in range(lib.mha_module_num_params(m)):
        prm = Param()
        if lib.mha_module_param_at(C.byref(prm), m, i) != MHA_OK:
            raise RuntimeError("mha_module_param_at failed")
        arr = np.ctypeslib.as_array(prm.data, shape=(prm.numel,))
        out[prm.name.decode()] = arr
    return out


def new_module(lib, e, h, kdim=0):
    cfg = C.create_string_buffer(256)  # >= sizeof(mha_config)
    lib.mha_config_init(cfg, e, h)
    if kdim:
        # kdim is the third int64 of mha_config (embed_dim, num_heads, kdim)
        C.c_int64.from_buffer(cfg, 16).value = kdim
    m = C.c_void_p()
    st = lib.mha_module_create(C.byref(m), cfg)
    if st != MHA_OK:
        raise RuntimeError("mha_module_create -> %d: %s"
                           % (st, lib.mha_last_error().decode()))
    return m


def module_cases(lib, tally):
    rng = np.random.default_rng(3)
    m = new_module(lib, 8, 2)
    gm = new_module(lib, 8, 2)
    pm, pg = module_params(lib, m), module_params(lib, gm)
    for name in pm:
        pm[name][...] = rng.standard_normal(pm[name].size)
        pg[name][...] = rng.standard_normal(pg[name].size)
    before = {k: v.copy() for k, v in pm.items()}
    h = C.c_void_p()
    cfg = make_config(lib, MHA_OPTIM_SGD, lr=0.5)
    ok = lib.mha_optim_create(C.byref(h), C.byref(cfg)) == MHA_OK
    ok = ok and lib.mha_optim_add_module(h, m, gm) == MHA_OK
    ok = ok and lib.mha_optim_step(h) == MHA_OK
    for name in pm:
        want = (before[name] + np.float32(-0.5) * pg[name]).astype(np.float32)
        ok = ok and np.array_equal(pm[name], want)
    tally.case("add_module: SGD step updates every parameter of the module "
               "from the same-named gradient (%s)" % ", ".join(sorted(pm)), ok)

    other = new_module(lib, 16, 2)
    expect_fail(lib, tally, "add_module with grads of E=16 for E=8",
                lib.mha_optim_add_module(h, m, other), "elements")
    sep = new_module(lib, 8, 2, kdim=4)
    expect_fail(lib, tally, "add_module with grads of another layout "
                "(separate q/k/v)", lib.mha_optim_add_module(h, m, sep),
                "parameters")
    expect_fail(lib, tally, "add_module(m, m)",
                lib.mha_optim_add_module(h, m, m), "own")
    expect_fail(lib, tally, "add_module twice (already registered)",
                lib.mha_optim_add_module(h, m, gm), "overlap")
    # A failed add_module registers nothing: one more step moves each
    # parameter exactly once more.
    now = {k: v.copy() for k, v in pm.items()}
    ok = lib.mha_optim_step(h) == MHA_OK
    for name in pm:
        want = (now[name] + np.float32(-0.5) * pg[name]).astype(np.float32)
        ok = ok and np.array_equal(pm[name], want)
    tally.case("failed add_module calls leave the registration unchanged", ok)
    lib.mha_optim_destroy(h)
    for x in (m, gm, other, sep):
        lib.mha_module_destroy(x)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", required=True, help="path to libmha.so")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    try:
        lib = load(args.lib)
    except (OSError, AttributeError) as exc:
        print("test_optim: cannot load %r: %s" % (args.lib, exc))
        print("0 passed, 1 failed")
        return 1
    tally = Tally(args.verbose)
    print("torch %s, ATEN_CPU_CAPABILITY=%s" % (
        torch.__version__, os.environ.get("ATEN_CPU_CAPABILITY", "(unset)")))
    layout_case(lib, tally)
    optim_cases(lib, tally, args.steps)
    clip_cases(lib, tally)
    zero_grad_case(lib, tally)
    error_cases(lib, tally)
    module_cases(lib, tally)
    print("%d passed, %d failed" % (tally.passed, tally.failed))
    return 1 if tally.failed else 0


if __name__ == "__main__":
    sys.exit(main())
