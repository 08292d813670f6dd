#!/usr/bin/env python3
"""CLI error handling: malformed safetensors files and inconsistent inputs.

Runs the `mha` binary on broken inputs and checks that every failure is a
clean one: exit status > 0 that is not a signal (nor a shell's 128+N), a
stderr of exactly one non-empty line starting with "mha", and no output file
left behind. Positive controls (valid files, exit 0, outputs of the right
shape) prove the harness itself works.

Each malformed-file class is fed both as --weights and as --inputs. Files are
written with the small safetensors writer below (struct + json), so a defect
can be placed exactly. Standard library only.

Usage: test_cli_errors.py --mha PATH/TO/mha --tmp TMPDIR
Prints one line per case, then "N passed, M failed"; exits 1 on any failure.
"""

import argparse
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys

# ---------------------------------------------------------------------------
# A tiny safetensors writer / reader.

DTYPES = {"F32": ("<f", 4), "F64": ("<d", 8), "I64": ("<q", 8),
          "I32": ("<i", 4), "U8": ("<B", 1), "BOOL": ("<B", 1),
          "F16": ("<e", 2)}


def pack(dtype, values):
    fmt, _ = DTYPES[dtype]
    return b"".join(struct.pack(fmt, v) for v in values)


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def tensor(name, shape, dtype="F32", values=None, seed=0):
    """A tensor record: name (str or raw bytes), dtype, shape, data bytes."""
    n = numel(shape)
    if values is None:
        if dtype in ("F32", "F64", "F16"):
            values = [math.sin(0.7 * (i + 1) + seed) * 0.5 for i in range(n)]
        else:
            values = [(i + seed) % 2 for i in range(n)]
    return {"name": name, "dtype": dtype, "shape": list(shape),
            "data": pack(dtype, values)}


def to_json_bytes(value):
    if isinstance(value, bytes):  # raw JSON text, placed as is
        return value
    return json.dumps(value, separators=(",", ":")).encode()


def build(tensors, metadata=None, *, offsets=None, extra_data=b"",
          data_cut=0, header_len=None, header=None, pad=True):
    """Serializes tensors (laid out in order) into safetensors bytes.

    Each tensor dict may carry overrides: "entry" (raw JSON bytes for the
    whole entry), "shape_json", "dtype_json", "offsets_json" (JSON values or
    raw bytes), "extra" (dict of extra keys). offsets: explicit
    [begin, end] per tensor. header: raw header bytes replacing the JSON.
    header_len: the length field to write (default: the real one).
    """
    data = b"".join(t["data"] for t in tensors) + extra_data
    if data_cut:
        data = data[:-data_cut]
    if header is None:
        parts = []
        if metadata is not None:
            parts.append(b'"__metadata__":' + to_json_bytes(metadata))
        at = 0
        for i, t in enumerate(tensors):
            name = t["name"]
            name_json = (b'"' + name + b'"' if isinstance(name, bytes)
                         else to_json_bytes(name))
            if "entry" in t:
                entry = to_json_bytes(t["entry"])
            else:
                begin, end = at, at + len(t["data"])
                if offsets is not None:
                    begin, end = offsets[i]
                dtype = t.get("dtype_json", t["dtype"])
                shape = t.get("shape_json", t["shape"])
                fields = [
                    b'"dtype":' + to_json_bytes(dtype),
                    b'"shape":' + to_json_bytes(shape),
                    b'"data_offsets":' + to_json_bytes(
                        t.get("offsets_json", [begin, end])),
                ]
                for k, v in t.get("extra", {}).items():
                    fields.append(to_json_bytes(k) + b":" + to_json_bytes(v))
                entry = b"{" + b",".join(fields) + b"}"
            at += len(t["data"])
            parts.append(name_json + b":" + entry)
        header = b"{" + b",".join(parts) + b"}"
    if pad:
        header += b" " * (-len(header) % 8)
    n = len(header) if header_len is None else header_len
    return struct.pack("<Q", n) + header + data


def read_st(path):
    """Minimal reader for checking the CLI's outputs: {name: (dtype, shape,
    values)}, metadata."""
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    hdr = json.loads(raw[8:8 + n])
    base = 8 + n
    meta = hdr.pop("__metadata__", {})
    out = {}
    for name, e in hdr.items():
        fmt, size = DTYPES[e["dtype"]]
        b, en = e["data_offsets"]
        buf = raw[base + b:base + en]
        vals = [struct.unpack(fmt, buf[i:i + size])[0]
                for i in range(0, len(buf), size)]
        out[name] = (e["dtype"], e["shape"], vals)
    return out, meta


def write(path, blob):
    with open(path, "wb") as f:
        f.write(blob)
    return path


# ---------------------------------------------------------------------------
# Harness

class Runner:
    def __init__(self, mha, tmp):
        self.mha = mha
        self.tmp = tmp
        self.passed = 0
        self.failed = 0
        self.count = 0

    def path(self, name):
        return os.path.join(self.tmp, name)

    def run(self, args):
        try:
            p = subprocess.run([self.mha] + args, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, timeout=120)
        except subprocess.TimeoutExpired:
            return None
        return p

    def report(self, name, problems):
        if problems:
            self.failed += 1
            print("FAIL %s: %s" % (name, "; ".join(problems)))
        else:
            self.passed += 1
            print("PASS %s" % name)
        sys.stdout.flush()

    def expect_error(self, name, args, out=None):
        """args must fail cleanly; out (if given) must not exist after."""
        if out and os.path.exists(out):
            os.remove(out)
        p = self.run(args)
        problems = []
        if p is None:
            self.report(name, ["timed out"])
            return
        rc = p.returncode
        err = p.stderr.decode("utf-8", "replace")
        if rc < 0:
            problems.append("killed by signal %d" % -rc)
        elif rc == 0:
            problems.append("exit status 0")
        elif rc >= 128:
            problems.append("exit status %d (>= 128)" % rc)
        line = err[:-1] if err.endswith("\n") else err
        if not line.strip():
            problems.append("empty stderr")
        elif "\n" in line:
            problems.append("stderr has %d lines: %r"
                            % (line.count("\n") + 1, err[:300]))
        elif not line.startswith("mha"):
            problems.append("stderr does not start with 'mha': %r"
                            % line[:200])
        if out and os.path.exists(out):
            problems.append("output file %s left behind" % out)
        if not problems:
            name = "%s  [rc %d] %s" % (name, rc, line[:160])
        self.report(name, problems)

    def expect_status(self, name, args, status, needles=()):
        """args must exit with exactly status (2: a usage error, 1: a
        failure while running) and one stderr line starting with "mha"
        that contains every needle (the option, the value)."""
        p = self.run(args)
        if p is None:
            self.report(name, ["timed out"])
            return
        err = p.stderr.decode("utf-8", "replace").strip()
        problems = []
        if p.returncode != status:
            problems.append("exit status %d, expected %d" % (p.returncode, status))
        if "\n" in err or not err.startswith("mha"):
            problems.append("stderr is not one line starting with 'mha'")
        for needle in needles:
            if needle not in err:
                problems.append("stderr does not name %r" % needle)
        if problems:
            problems.append("stderr %r" % err[:300])
        else:
            name = "%s  [rc %d] %s" % (name, p.returncode, err[:160])
        self.report(name, problems)

    def expect_ok(self, name, args, check=None):
        p = self.run(args)
        problems = []
        if p is None:
            problems.append("timed out")
        elif p.returncode != 0:
            problems.append("exit status %d, stderr %r"
                            % (p.returncode,
                               p.stderr.decode("utf-8", "replace")[:300]))
        elif check:
            try:
                problems += check()
            except Exception as e:  # a broken output is a failure, not a crash
                problems.append("checking the output: %r" % (e,))
        self.report(name, problems)


# ---------------------------------------------------------------------------
# Malformed-file classes: name -> function(tensors, metadata) -> bytes, where
# tensors is a valid set (at least two, the first of >= 2 elements).

def malformed_classes():
    def dup(tensors, meta):
        ts = [dict(t) for t in tensors]
        ts[1]["name"] = ts[0]["name"]
        return build(ts, meta)

    def with_first(**override):
        def f(tensors, meta):
            ts = [dict(t) for t in tensors]
            ts[0].update(override)
            return build(ts, meta)
        return f

    def offsets(fn):
        def f(tensors, meta):
            offs, at = [], 0
            for t in tensors:
                offs.append([at, at + len(t["data"])])
                at += len(t["data"])
            fn(offs)
            return build(tensors, meta, offsets=offs)
        return f

    def overlap(o):
        o[1][0] -= 4
        o[1][1] -= 4

    def gap(o):
        o[1][0] += 4
        o[1][1] += 4

    def past_end(o):
        o[-1][0] += 4
        o[-1][1] += 4

    def swapped(o):
        o[0][0], o[0][1] = o[0][1], o[0][0]

    def real_len(tensors, meta):
        return len(build(tensors, meta)) - 8 - sum(len(t["data"])
                                                   for t in tensors)

    return [
        ("empty file", lambda t, m: b""),
        ("shorter than 8 bytes", lambda t, m: b"\x10\x00\x00"),
        ("only the length field", lambda t, m: struct.pack("<Q", 0)),
        ("not safetensors (text)", lambda t, m: b"hello, world\n" * 4),
        ("truncated data", lambda t, m: build(t, m, data_cut=3)),
        ("truncated in the header",
         lambda t, m: build(t, m)[:8 + real_len(t, m) // 2]),
        ("header length larger than file",
         lambda t, m: build(t, m, header_len=real_len(t, m) + 4096)),
        ("header length 2^63",
         lambda t, m: build(t, m, header_len=1 << 63)),
        ("header length above 100 MiB cap",
         lambda t, m: build(t, m, header_len=100 * 1024 * 1024 + 8)),
        ("header shorter than the JSON",
         lambda t, m: build(t, m, header_len=real_len(t, m) - 8)),
        ("header not JSON",
         lambda t, m: build(t, m, header=b"{this is not json}")),
        ("header a JSON array", lambda t, m: build(t, m, header=b"[1,2,3]")),
        ("garbage after the JSON",
         lambda t, m: build(t, m, header=b"{} trailing")),
        ("NUL byte in the header", lambda t, m: build(t, m, header=b"{}\0")),
        ("unknown dtype", with_first(dtype_json="F8")),
        ("dtype not a string", with_first(dtype_json=4)),
        ("entry not an object", with_first(entry=[1, 2])),
        ("shape not an array", with_first(shape_json=6)),
        ("negative dim", with_first(shape_json=[-2, 3])),
        ("fractional dim", with_first(shape_json=[1.5, 4])),
        ("too many dims", with_first(shape_json=[1] * 9)),
        ("dim beyond 2^53", with_first(shape_json=[2 ** 60, 0])),
        ("data_offsets wrong length", with_first(offsets_json=[0])),
        ("data_offsets not integers", with_first(offsets_json=[0, "8"])),
        ("data_offsets begin > end", offsets(swapped)),
        ("offsets past the end", offsets(past_end)),
        ("overlapping tensors", offsets(overlap)),
        ("gap between tensors", offsets(gap)),
        ("trailing data bytes", lambda t, m: build(t, m, extra_data=b"\0" * 8)),
        ("shape/size mismatch", with_first(shape_json=[1])),
        ("dims overflow int64",
         with_first(shape_json=[4294967296, 4294967296, 16])),
        ("dims overflow with a zero dim",
         with_first(shape_json=[4294967296, 0, 4294967296])),
        ("duplicate names", dup),
        ("invalid UTF-8 name", with_first(name=b"bad\xff")),
        ("overlong UTF-8 name", with_first(name=b"\xc0\xafx")),
        ("surrogate in name", with_first(name=b"\xed\xa0\x80")),
        ("empty name", with_first(name="")),
        ("newline in a name", with_first(name="a\nb")),
        ("extra key in entry", with_first(extra={"layout": "row"})),
        ("missing key in entry", with_first(entry={"dtype": "F32"})),
        ("__metadata__ not an object",
         lambda t, m: build(t, b'"num_heads=2"')),
        ("__metadata__ non-string value",
         lambda t, m: build(t, {"num_heads": 2})),
        ("__metadata__ twice",
         lambda t, m: build(t, b'{"num_heads":"2"},"__metadata__":{}')),
    ]


# ---------------------------------------------------------------------------
# The cases

E, H, L, S, N = 8, 2, 3, 4, 2


def weight_tensors(E=E, seed=0):
    return [
        tensor("in_proj_weight", (3 * E, E), seed=seed),
        tensor("in_proj_bias", (3 * E,), seed=seed + 1),
        tensor("out_proj.weight", (E, E), seed=seed + 2),
        tensor("out_proj.bias", (E,), seed=seed + 3),
    ]


def input_tensors(q=(L, N, E), k=(S, N, E), v=(S, N, E), extra=()):
    ts = []
    if q is not None:
        ts.append(tensor("query", q, seed=10))
    if k is not None:
        ts.append(tensor("key", k, seed=20))
    if v is not None:
        ts.append(tensor("value", v, seed=30))
    return ts + list(extra)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mha", required=True, help="path to the mha binary")
    ap.add_argument("--tmp", required=True, help="scratch directory")
    args = ap.parse_args()
    if not os.access(args.mha, os.X_OK):
        print("cannot execute %s" % args.mha)
        print("0 passed, 1 failed")
        return 1
    tmp = os.path.join(args.tmp, "cli_errors")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    r = Runner(os.path.abspath(args.mha), tmp)
    P = r.path

    # ---- positive controls -------------------------------------------------
    W = P("w_init.safetensors")
    W_py = write(P("w_py.safetensors"), build(weight_tensors()))  # no metadata
    W_meta = write(P("w_meta.safetensors"),
                   build(weight_tensors(), {"num_heads": str(H)}))
    X = write(P("x.safetensors"), build(input_tensors()))
    Y = P("y.safetensors")

    def check_init():
        t, meta = read_st(W)
        want = {"in_proj_weight": [3 * E, E], "in_proj_bias": [3 * E],
                "out_proj.weight": [E, E], "out_proj.bias": [E]}
        problems = []
        if meta.get("num_heads") != str(H):
            problems.append("metadata %r" % (meta,))
        for name, shape in want.items():
            if name not in t or t[name][1] != shape:
                problems.append("%s: %r" % (name, t.get(name, (None, None))[1]))
        return problems

    r.expect_ok("control: mha init",
                ["init", "--embed-dim", str(E), "--num-heads", str(H),
                 "--out", W], check_init)
    if not os.path.exists(W):  # keep going with the Python-written weights
        shutil.copy(W_meta, W)

    def check_out(shape, wshape=None):
        def check():
            t, _ = read_st(Y)
            problems = []
            if t.get("attn_output", (0, None))[1] != list(shape):
                problems.append("attn_output shape %r, want %r"
                                % (t.get("attn_output", (0, None))[1], shape))
            elif not all(math.isfinite(v) for v in t["attn_output"][2]):
                problems.append("attn_output not finite")
            if wshape is not None and t.get(
                    "attn_output_weights", (0, None))[1] != list(wshape):
                problems.append("attn_output_weights shape %r, want %r"
                                % (t.get("attn_output_weights", (0, None))[1],
                                   wshape))
            return problems
        return check

    fwd = ["forward", "--out", Y]
    r.expect_ok("control: forward (init weights)",
                fwd + ["--weights", W, "--inputs", X],
                check_out((L, N, E)))
    r.expect_ok("control: forward --need-weights",
                fwd + ["--weights", W, "--inputs", X, "--need-weights"],
                check_out((L, N, E), (N, L, S)))
    r.expect_ok("control: forward --need-weights --no-average-weights",
                fwd + ["--weights", W, "--inputs", X, "--need-weights",
                       "--no-average-weights"],
                check_out((L, N, E), (N, H, L, S)))
    r.expect_ok("control: python-written weights + --num-heads",
                fwd + ["--weights", W_py, "--inputs", X, "--num-heads", "2"],
                check_out((L, N, E)))
    r.expect_ok("control: python-written weights with metadata",
                fwd + ["--weights", W_meta, "--inputs", X,
                       "--impl", "reference"],
                check_out((L, N, E)))
    X_self = write(P("x_self.safetensors"),
                   build(input_tensors(k=None, v=None)))
    r.expect_ok("control: self-attention (query only)",
                fwd + ["--weights", W, "--inputs", X_self, "--causal"],
                check_out((L, N, E)))
    X_masks = write(P("x_masks.safetensors"), build(input_tensors(extra=[
        tensor("key_padding_mask", (N, S), "BOOL", [0, 0, 0, 1, 0, 1, 0, 0]),
        tensor("attn_mask", (L, S), "F32", [0.0] * (L * S))])))
    r.expect_ok("control: masks (N, S) BOOL and (L, S) F32",
                fwd + ["--weights", W, "--inputs", X_masks],
                check_out((L, N, E)))
    X_mask3 = write(P("x_mask3.safetensors"), build(input_tensors(extra=[
        tensor("attn_mask", (N * H, L, S), "BOOL")])))
    r.expect_ok("control: attn_mask (N*H, L, S)",
                fwd + ["--weights", W, "--inputs", X_mask3],
                check_out((L, N, E)))
    X_bf = write(P("x_bf.safetensors"),
                 build(input_tensors((N, L, E), (N, S, E), (N, S, E))))
    r.expect_ok("control: --batch-first",
                fwd + ["--weights", W, "--inputs", X_bf, "--batch-first"],
                check_out((N, L, E)))
    X_ub = write(P("x_ub.safetensors"),
                 build(input_tensors((L, E), (S, E), (S, E))))
    r.expect_ok("control: unbatched",
                fwd + ["--weights", W, "--inputs", X_ub, "--need-weights"],
                check_out((L, E), (L, S)))

    # ---- malformed files, as --weights and as --inputs ----------------------
    classes = malformed_classes()
    good_inputs = input_tensors()
    for i, (name, make) in enumerate(classes):
        wbad = write(P("bad_w_%02d.safetensors" % i),
                     make(weight_tensors(), {"num_heads": str(H)}))
        r.expect_error("weights: " + name,
                       fwd + ["--weights", wbad, "--inputs", X], Y)
        xbad = write(P("bad_x_%02d.safetensors" % i), make(good_inputs, None))
        r.expect_error("inputs: " + name,
                       fwd + ["--weights", W, "--inputs", xbad], Y)
    missing = P("does_not_exist.safetensors")
    r.expect_error("weights: missing file",
                   fwd + ["--weights", missing, "--inputs", X], Y)
    r.expect_error("inputs: missing file",
                   fwd + ["--weights", W, "--inputs", missing], Y)
    r.expect_error("weights: a directory",
                   fwd + ["--weights", tmp, "--inputs", X], Y)
    r.expect_error("inputs: a directory",
                   fwd + ["--weights", W, "--inputs", tmp], Y)

    # ---- inconsistent inputs ----------------------------------------------
    def bad_inputs(name, tensors, extra_args=(), weights=None):
        path = write(P("inc_%03d.safetensors" % r.count), build(tensors))
        r.count += 1
        r.expect_error(name, fwd + ["--weights", weights or W, "--inputs",
                                    path] + list(extra_args), Y)

    bad_inputs("query embed dim 7 != embed_dim 8",
               input_tensors(q=(L, N, E - 1)))
    bad_inputs("query embed dim 16 != embed_dim 8 (self-attention)",
               input_tensors(q=(L, N, 2 * E), k=None, v=None))
    bad_inputs("batch mismatch between query and key",
               input_tensors(k=(S, N + 1, E), v=(S, N + 1, E)))
    bad_inputs("batch mismatch with --batch-first",
               input_tensors((N, L, E), (N + 1, S, E), (N + 1, S, E)),
               ["--batch-first"])
    bad_inputs("key/value length mismatch",
               input_tensors(v=(S + 1, N, E)))
    bad_inputs("key feature dim != kdim", input_tensors(k=(S, N, E - 2)))
    bad_inputs("value feature dim != vdim", input_tensors(v=(S, N, E + 1)))
    bad_inputs("query 4-D", input_tensors(q=(1, L, N, E)))
    bad_inputs("query 1-D", input_tensors(q=(E,), k=None, v=None))
    bad_inputs("query batched, key unbatched",
               input_tensors(k=(S, E), v=(S, E)))
    bad_inputs("key_padding_mask (N, S+1)", input_tensors(extra=[
        tensor("key_padding_mask", (N, S + 1), "BOOL")]))
    bad_inputs("key_padding_mask (N+1, S)", input_tensors(extra=[
        tensor("key_padding_mask", (N + 1, S), "BOOL")]))
    bad_inputs("key_padding_mask (S) for a batched query", input_tensors(
        extra=[tensor("key_padding_mask", (S,), "BOOL")]))
    bad_inputs("key_padding_mask dtype I32", input_tensors(extra=[
        tensor("key_padding_mask", (N, S), "I32")]))
    bad_inputs("attn_mask (L, S+1)", input_tensors(extra=[
        tensor("attn_mask", (L, S + 1), "BOOL")]))
    bad_inputs("attn_mask (L+1, S) F32", input_tensors(extra=[
        tensor("attn_mask", (L + 1, S), "F32")]))
    bad_inputs("attn_mask 3-D with first dim != N*H", input_tensors(extra=[
        tensor("attn_mask", (N * H + 1, L, S), "BOOL")]))
    bad_inputs("attn_mask 3-D (N, L, S)", input_tensors(extra=[
        tensor("attn_mask", (N, L, S), "BOOL")]))
    bad_inputs("attn_mask 4-D", input_tensors(extra=[
        tensor("attn_mask", (N, H, L, S), "BOOL")]))
    bad_inputs("attn_mask 1-D", input_tensors(extra=[
        tensor("attn_mask", (S,), "BOOL")]))
    bad_inputs("--num-heads 3 does not divide embed_dim 8", input_tensors(),
               ["--num-heads", "3"])
    bad_inputs("--num-heads 16 > embed_dim 8", input_tensors(),
               ["--num-heads", "16"])
    bad_inputs("missing query tensor", input_tensors(q=None))
    bad_inputs("key without value", input_tensors(v=None))
    bad_inputs("value without key", input_tensors(k=None))
    bad_inputs("empty inputs file", [])
    bad_inputs("query dtype I64", [tensor("query", (L, N, E), "I64")])
    bad_inputs("unexpected input tensor", input_tensors(extra=[
        tensor("querry", (L, N, E))]))
    bad_inputs("unexpected input tensor named with a newline",
               input_tensors(extra=[tensor("x\ny", (1,))]))
    bad_inputs("num_heads missing everywhere", input_tensors(),
               weights=W_py)
    # RoPE scaling and position_ids
    r.expect_ok("control: position_ids (N, L) I64, --rope-scaling yarn",
                fwd + ["--weights", W, "--inputs", write(P("x_pos.safetensors"), build(
                    input_tensors(k=None, v=None, extra=[
                        tensor("position_ids", (N, L), "I64", [0, 1, 2, 1, 1, 0])]))),
                       "--rope", "neox", "--rope-scaling", "yarn", "--rope-factor", "4",
                       "--rope-original-max", "2", "--causal"],
                check_out((L, N, E)))
    rope = ["--rope", "neox"]
    bad_inputs("--rope-scaling longrope", input_tensors(),
               rope + ["--rope-scaling", "longrope"])
    bad_inputs("--rope-scaling without --rope", input_tensors(),
               ["--rope-scaling", "linear", "--rope-factor", "2"])
    bad_inputs("--rope-factor 0", input_tensors(),
               rope + ["--rope-scaling", "linear", "--rope-factor", "0"])
    bad_inputs("--rope-factor not a number", input_tensors(),
               rope + ["--rope-scaling", "linear", "--rope-factor", "x"])
    bad_inputs("dynamic without --rope-original-max", input_tensors(),
               rope + ["--rope-scaling", "dynamic", "--rope-factor", "2"])
    bad_inputs("--rope-original-max 0", input_tensors(),
               rope + ["--rope-scaling", "yarn", "--rope-original-max", "0"])
    bad_inputs("llama3 low >= high freq factor", input_tensors(),
               rope + ["--rope-scaling", "llama3", "--rope-original-max", "8",
                       "--rope-low-freq-factor", "4"])
    bad_inputs("yarn --rope-beta-fast -1", input_tensors(),
               rope + ["--rope-scaling", "yarn", "--rope-original-max", "8",
                       "--rope-beta-fast", "-1"])
    bad_inputs("position_ids (N, L+1)", input_tensors(k=None, v=None, extra=[
        tensor("position_ids", (N, L + 1), "I64")]), rope)
    bad_inputs("position_ids negative", input_tensors(k=None, v=None, extra=[
        tensor("position_ids", (N, L), "I64", [0, 1, -2, 0, 1, 2])]), rope)
    bad_inputs("position_ids not integers", input_tensors(k=None, v=None, extra=[
        tensor("position_ids", (N, L), "F32", [0, 1, 2.5, 0, 1, 2])]), rope)
    bad_inputs("position_ids with cross-attention (S != L)", input_tensors(extra=[
        tensor("position_ids", (N, L), "I64", [0, 1, 2, 0, 1, 2])]), rope)
    bad_inputs("unknown --impl", input_tensors(), ["--impl", "fast"])
    bad_inputs("--impl empty", input_tensors(), ["--impl", ""])

    # Weights that parse but do not describe a module.
    def bad_weights(name, tensors, meta={"num_heads": str(H)}, args=()):
        path = write(P("badmod_%03d.safetensors" % r.count),
                     build(tensors, meta))
        r.count += 1
        r.expect_error(name, fwd + ["--weights", path, "--inputs", X]
                       + list(args), Y)

    wt = weight_tensors()
    bad_weights("weights: in_proj_weight (3E, E-1)",
                [tensor("in_proj_weight", (3 * E, E - 1))] + wt[1:])
    bad_weights("weights: in_proj_bias wrong length",
                [wt[0], tensor("in_proj_bias", (3 * E - 1,))] + wt[2:])
    bad_weights("weights: no out_proj.weight", wt[:2] + wt[3:])
    bad_weights("weights: no parameters at all", [])
    bad_weights("weights: num_heads metadata not a number", wt,
                {"num_heads": "two"})
    bad_weights("weights: num_heads metadata 3 does not divide 8", wt,
                {"num_heads": "3"})
    bad_weights("weights: num_heads metadata 0", wt, {"num_heads": "0"})
    bad_weights("weights: num_heads metadata -2", wt, {"num_heads": "-2"})
    bad_weights("weights: in_proj_weight is I32",
                [tensor("in_proj_weight", (3 * E, E), "I32")] + wt[1:])

    # ---- command-line misuse -------------------------------------------
    r.expect_error("usage: --no-average-weights without --need-weights",
                   fwd + ["--weights", W, "--inputs", X,
                          "--no-average-weights"], Y)
    r.expect_error("usage: --num-heads 0",
                   fwd + ["--weights", W, "--inputs", X, "--num-heads", "0"],
                   Y)
    r.expect_error("usage: --num-heads abc",
                   fwd + ["--weights", W, "--inputs", X, "--num-heads",
                          "abc"], Y)
    r.expect_error("usage: missing --out",
                   ["forward", "--weights", W, "--inputs", X])
    r.expect_error("usage: missing --inputs", fwd + ["--weights", W], Y)
    r.expect_error("usage: unknown option",
                   fwd + ["--weights", W, "--inputs", X, "--bogus"], Y)
    r.expect_error("usage: stray argument",
                   fwd + ["--weights", W, "--inputs", X, "extra"], Y)
    r.expect_error("usage: unknown command", ["frobnicate"])
    r.expect_error("bench: --module without --decode",
                   ["bench", "--module", "--embed-dim", "8", "--num-heads", "2", "--seq", "2"])
    r.expect_error("bench: --decode --module --prune-heads 3 of 2 heads",
                   ["bench", "--decode", "--module", "--embed-dim", "8", "--num-heads", "2",
                    "--kv-len", "4", "--prune-heads", "3"])
    r.expect_error("bench: --decode --module --parallel kv",
                   ["bench", "--decode", "--module", "--embed-dim", "8", "--num-heads", "2",
                    "--kv-len", "4", "--parallel", "kv"])
    r.expect_error("--out in a missing directory",
                   ["forward", "--weights", W, "--inputs", X, "--out",
                    P("no_such_dir/y.safetensors")])
    Wi = P("w_bad_init.safetensors")
    init = ["init", "--out", Wi]
    r.expect_error("init: --num-heads 3 does not divide --embed-dim 8",
                   init + ["--embed-dim", "8", "--num-heads", "3"], Wi)
    r.expect_error("init: --embed-dim -8",
                   init + ["--embed-dim", "-8", "--num-heads", "2"], Wi)
    r.expect_error("init: unknown --init",
                   init + ["--embed-dim", "8", "--num-heads", "2", "--init",
                           "bogus"], Wi)
    r.expect_error("init: missing --num-heads", init + ["--embed-dim", "8"],
                   Wi)
    r.expect_error("init: --kdim -1",
                   init + ["--embed-dim", "8", "--num-heads", "2", "--kdim",
                           "-1"], Wi)

    # ---- the exit status convention: 2 a usage error, 1 a failure while
    # running, the same in every command; an unknown option is named ------
    helps = r.run(["--help"])
    cmds = []
    in_cmds = False
    for line in helps.stdout.decode().splitlines():
        if line.startswith("Commands:"):
            in_cmds = True
        m = re.match(r"^  ([a-z][a-z0-9-]*)\s", line)
        if in_cmds and m:
            cmds.append(m.group(1))
    r.report("usage: mha --help lists the commands (%s)" % " ".join(cmds),
             [] if {"init", "forward", "bench"} <= set(cmds) else ["commands %r" % cmds])
    for cmd in cmds + ["demo heads", "train plot"]:
        argv = cmd.split()
        r.expect_status("usage: mha %s --bogus-option" % cmd, argv + ["--bogus-option"], 2,
                        ['"--bogus-option"'])
        r.expect_status("usage: mha %s --bogus=1" % cmd, argv + ["--bogus=1"], 2,
                        ['"--bogus=1"'])
    # an option without its value, per command
    for argv, opt in ((["init"], "--embed-dim"), (["forward"], "--weights"),
                      (["backward"], "--grad-output"), (["inspect"], "--max-rows"),
                      (["train"], "--steps"), (["train", "plot"], "--out"),
                      (["demo"], "--batch"), (["demo", "heads"], "--heads"),
                      (["bench"], "--seq"), (["embed"], "--model")):
        r.expect_status("usage: mha %s %s (no value)" % (" ".join(argv), opt), argv + [opt], 2,
                        [opt + " needs a value"])
    r.expect_status("usage: a flag given a value", ["init", "--no-bias=1"], 2,
                    ["--no-bias takes no value"])
    r.expect_status("usage: an ambiguous abbreviation", ["init", "--num", "2"], 2,
                    ['"--num"', "--num-heads", "--num-kv-heads"])
    r.expect_status("usage: a short option", ["init", "-x"], 2, ['"-x"'])
    r.expect_status("usage: init --num-heads 0 names the value",
                    init + ["--embed-dim", "8", "--num-heads", "0"], 2, ["--num-heads", '"0"'])
    r.expect_status("usage: init --embed-dim abc", init + ["--embed-dim", "abc", "--num-heads",
                                                           "2"], 2, ["--embed-dim", '"abc"'])
    r.expect_status("usage: init without --num-heads", init + ["--embed-dim", "8"], 2,
                    ["--num-heads is required"])
    r.expect_status("usage: init --num-heads 3 of --embed-dim 8",
                    init + ["--embed-dim", "8", "--num-heads", "3"], 2, ["8", "3"])
    r.expect_status("usage: a stray argument named",
                    init + ["--embed-dim", "8", "--num-heads", "2", "stray"], 2, ['"stray"'])
    r.expect_status("usage: mha version stray", ["version", "stray"], 2, ['"stray"'])
    r.expect_status("usage: mha info stray", ["info", "stray"], 2, ['"stray"'])
    # a name the library's parser refuses is a usage error in every command
    # (init --init exited 1, bench --impl 2)
    r.expect_status("usage: init --init bogus", init + ["--embed-dim", "8", "--num-heads", "2",
                                                        "--init", "bogus"], 2, ['"bogus"'])
    r.expect_status("usage: init --head-gate bogus", init + ["--embed-dim", "8", "--num-heads",
                                                             "2", "--head-gate", "bogus"], 2,
                    ['"bogus"'])
    r.expect_status("usage: forward --impl bogus", fwd + ["--weights", W, "--inputs", X,
                                                          "--impl", "bogus"], 2, ['"bogus"'])
    r.expect_status("usage: forward --rope bogus", fwd + ["--weights", W, "--inputs", X,
                                                          "--rope", "bogus"], 2, ['"bogus"'])
    r.expect_status("usage: forward --kv-dtype bogus", fwd + ["--weights", W, "--inputs", X,
                                                              "--kv-dtype", "bogus"], 2,
                    ['"bogus"'])
    r.expect_status("usage: bench --impl bogus", ["bench", "--seq", "4", "--embed-dim", "8",
                                                  "--num-heads", "2", "--impl", "bogus"], 2,
                    ['"bogus"'])
    r.expect_status("usage: bench --parallel bogus", ["bench", "--seq", "4", "--embed-dim", "8",
                                                      "--num-heads", "2", "--parallel",
                                                      "bogus"], 2, ["--parallel"])
    # failures while running: 1
    missing = P("no_such_file.safetensors")
    r.expect_status("runtime: forward, a missing --weights file",
                    fwd + ["--weights", missing, "--inputs", X], 1, [missing])
    r.expect_status("runtime: backward, a missing --inputs file",
                    ["backward", "--weights", W, "--inputs", missing, "--grad-output", X,
                     "--out", Y], 1, [missing])
    r.expect_status("runtime: inspect, a missing --inputs file",
                    ["inspect", "--weights", W, "--inputs", missing, "--out", P("insp")], 1,
                    [missing])
    r.expect_status("runtime: init --out in a missing directory",
                    ["init", "--embed-dim", "8", "--num-heads", "2", "--out",
                     P("no_such_dir/w.safetensors")], 1, ["no_such_dir"])
    r.expect_status("runtime: train plot, a missing CSV",
                    ["train", "plot", "--out", P("p.png"), P("no_such.csv")], 1, ["no_such.csv"])
    r.expect_status("runtime: embed, a missing model directory",
                    ["embed", "--model", P("no_such_model"), "--out", P("e.safetensors"), "hi"],
                    1, ["no_such_model"])

    # ---- Hugging Face checkpoints (--checkpoint DIR --layer I) --------------
    ck = P("ck_llama")
    os.makedirs(ck)
    with open(os.path.join(ck, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "hidden_size": E, "num_attention_heads": H,
                   "num_key_value_heads": 1, "num_hidden_layers": 1}, f)
    d = E // H
    write(os.path.join(ck, "model.safetensors"), build([
        tensor("model.layers.0.self_attn.q_proj.weight", (E, E)),
        tensor("model.layers.0.self_attn.k_proj.weight", (d, E), seed=1),
        tensor("model.layers.0.self_attn.v_proj.weight", (d, E), seed=2),
        tensor("model.layers.0.self_attn.o_proj.weight", (E, E), seed=3)]))
    hs = tensor("hidden_states", (N, L, E))
    pos = tensor("position_ids", (N, L), "I64", [0, 1, 2, 5, 6, 7])
    am = tensor("attention_mask", (N, L), "I64", [1, 1, 1, 1, 1, 0])
    X_ck = write(P("x_ck.safetensors"), build([hs, pos, am]))
    X_ck0 = write(P("x_ck0.safetensors"), build([hs]))
    ckf = fwd + ["--checkpoint", ck, "--layer", "0"]
    r.expect_ok("control: forward --checkpoint (positions, attention_mask)",
                ckf + ["--inputs", X_ck], check_out((N, L, E)))
    r.expect_ok("control: forward --checkpoint --incremental",
                ckf + ["--inputs", X_ck0, "--incremental"], check_out((N, L, E)))
    r.expect_ok("control: inspect --checkpoint",
                ["inspect", "--checkpoint", ck, "--inputs", X_ck, "--out", P("ck_inspect")])

    def bad_ck(name, tensors, extra_args=(), layer="0", dir_=None):
        path = write(P("ck_%03d.safetensors" % r.count), build(tensors))
        r.count += 1
        r.expect_error("checkpoint: " + name,
                       fwd + ["--checkpoint", dir_ or ck, "--layer", layer, "--inputs",
                              path] + list(extra_args), Y)

    bad_ck("no hidden_states", [pos])
    bad_ck("hidden_states (L, E)", [tensor("hidden_states", (L, E))])
    bad_ck("hidden_states of the wrong E", [tensor("hidden_states", (N, L, E + 2))])
    bad_ck("position_ids (N, L + 1)", [hs, tensor("position_ids", (N, L + 1), "I64")])
    bad_ck("position_ids float", [hs, tensor("position_ids", (N, L), "F32")])
    bad_ck("attention_mask (L, N)", [hs, tensor("attention_mask", (L, N), "I64")])
    bad_ck("an unexpected input tensor", [hs, tensor("query", (N, L, E))])
    bad_ck("layer out of range", [hs], layer="1")
    bad_ck("--incremental with attention_mask", [hs, am], ["--incremental"])
    bad_ck("--checkpoint with --weights", [hs], ["--weights", W])
    bad_ck("a missing directory", [hs], dir_=P("no_such_checkpoint"))
    bad_ck("a directory without config.json", [hs], dir_=tmp)
    r.expect_error("checkpoint: --checkpoint is not for backward",
                   ["backward", "--checkpoint", ck, "--inputs", X_ck0, "--grad-output", X,
                    "--out", Y], Y)
    r.expect_error("checkpoint: --layer -1", ckf[:-1] + ["-1", "--inputs", X_ck0], Y)

    print("%d passed, %d failed" % (r.passed, r.failed))
    return 1 if r.failed else 0


if __name__ == "__main__":
    sys.exit(main())
