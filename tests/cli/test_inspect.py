#!/usr/bin/python3
"""test_inspect.py: `mha inspect` writes DIR/diagnostics.json with the
documented fields; known answers through the CLI: a head whose W_Q rows are
zero attends uniformly (entropy ln S, dead, rank_q 0; built without LAPACKE:
every rank -1 and no singular values); a NaN in the query is
reported with its location. With cairo: heads.png, similarity.png and
spectra.png are PNGs of sane size, report.html embeds exactly those three
(base64 data: URIs decoding to the same bytes), has a row per head with its
numbers, and escapes token text; without cairo, the command says so and
still succeeds. Options: --tokens (a missing file names it), --batch-index
(out of range refused), --max-rows (rows_examined), forward-only options
refused.

Usage: /usr/bin/python3 tests/cli/test_inspect.py --mha build/mha --tmp DIR
Ends with "N passed, M failed"; exits 1 when anything failed.
"""
import argparse
import base64
import html
import json
import math
import os
import re
import struct
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                "conformance"))
import conformance as conf  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PICTURES = ["heads.png", "similarity.png", "spectra.png"]


def png_size(data):
    """(width, height) from a PNG's IHDR, or None when data is not a PNG."""
    if len(data) < 24 or data[:8] != PNG_MAGIC or data[12:16] != b"IHDR":
        return None
    return struct.unpack(">II", data[16:24])


FIELDS = ["head", "entropy_mean", "entropy_min", "mean_distance", "dead", "rank_q", "rank_k",
          "rank_v", "rank_o", "logit_max", "logit_std"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mha", required=True)
    ap.add_argument("--tmp", required=True)
    args = ap.parse_args()
    os.makedirs(args.tmp, exist_ok=True)
    passed = failed = 0

    def check(ok, what):
        nonlocal passed, failed
        if ok:
            passed += 1
        else:
            failed += 1
            print("FAIL " + what)

    E, H, L, d = 32, 4, 9, 8
    rng = np.random.default_rng(3)
    w = {"in_proj_weight": (rng.standard_normal((3 * E, E)) * 0.3).astype(np.float32),
         "in_proj_bias": np.zeros(3 * E, np.float32),
         "out_proj.weight": (rng.standard_normal((E, E)) * 0.2).astype(np.float32),
         "out_proj.bias": np.zeros(E, np.float32)}
    w["in_proj_weight"][:d] = 0  # head 0: W_Q rows zero -> uniform attention
    wp = os.path.join(args.tmp, "w.safetensors")
    conf.st_save(wp, list(w.items()))
    x = rng.standard_normal((L, 1, E)).astype(np.float32)
    xp = os.path.join(args.tmp, "x.safetensors")
    conf.st_save(xp, [("query", x)])
    out = os.path.join(args.tmp, "inspect")
    for name in PICTURES + ["report.html", "diagnostics.json"]:
        if os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    tokens = ["<b>&", "quick", "brown", "fox"]  # fewer lines than L: the rest by index
    tp = os.path.join(args.tmp, "tokens.txt")
    with open(tp, "w") as f:
        f.write("\n".join(tokens) + "\n")
    base = [args.mha, "inspect", "--weights", wp, "--inputs", xp, "--num-heads", str(H)]
    p = subprocess.run(base + ["--out", out, "--tokens", tp], capture_output=True, text=True)
    check(p.returncode == 0, "mha inspect rc %d: %s" % (p.returncode, p.stderr.strip()))
    js = json.load(open(os.path.join(out, "diagnostics.json")))
    heads = js["heads"]
    check(len(heads) == H, "%d heads" % len(heads))
    check(all(all(f in h for f in FIELDS) for h in heads), "documented fields present")
    sim = js["similarity"]
    check(len(sim) == H and all(len(r) == H for r in sim), "similarity is H x H")
    check(all(abs(sim[i][i] - 1) < 1e-12 for i in range(H)), "similarity diagonal 1")
    h0 = heads[0]
    check(abs(h0["entropy_mean"] - math.log(L)) < 1e-9,
          "uniform head entropy %r vs ln S %r" % (h0["entropy_mean"], math.log(L)))
    if all(h["rank_" + w] == -1 and h["singular_" + w] == [] for h in heads for w in "qkvo"):
        print("ranks: this mha was built without LAPACKE (ranks -1, no singular values)")
        check(h0["dead"] is True, "uniform head dead")
    else:
        check(h0["dead"] is True and h0["rank_q"] == 0, "uniform head dead, rank_q 0")
        check(all(h["rank_k"] == d and h["rank_v"] == d for h in heads), "full K/V ranks")
    check(js["nonfinite"] is None, "no non-finite value reported")

    check(js["rows_examined"] == L, "rows_examined %r == L" % js["rows_examined"])

    # pictures and report.html, when this mha has cairo
    if "need cairo" in p.stderr:
        print("pictures: this mha was built without cairo (checking that it said so)")
        check(not any(os.path.exists(os.path.join(out, n)) for n in PICTURES + ["report.html"]),
              "no pictures without cairo")
    else:
        pngs = {}
        for name in PICTURES:
            path = os.path.join(out, name)
            check(os.path.exists(path), "%s written" % name)
            if not os.path.exists(path):
                continue
            data = open(path, "rb").read()
            size = png_size(data)
            check(size is not None and 300 <= size[0] <= 8000 and 200 <= size[1] <= 8000,
                  "%s is a PNG of sane size: %r" % (name, size))
            check(("wrote " + path) in p.stdout, "%s reported on stdout" % name)
            pngs[name] = data
        rp = os.path.join(out, "report.html")
        check(os.path.exists(rp), "report.html written")
        page = open(rp, encoding="utf-8").read() if os.path.exists(rp) else ""
        imgs = re.findall(r'<img [^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
        check(len(imgs) == 3, "report embeds 3 PNGs (found %d)" % len(imgs))
        decoded = [base64.b64decode(b) for b in imgs]
        check(all(png_size(d) is not None for d in decoded), "embedded images decode to PNGs")
        check(decoded == [pngs.get(n) for n in PICTURES],
              "embedded images are heads, similarity, spectra as written")
        for h in range(H):
            m = re.search(r'<tr id="head-%d"[^>]*>(.*?)</tr>' % h, page)
            check(m is not None, "report has a row for head %d" % h)
            if m:  # the row's cells: the head's numbers from diagnostics.json
                cells = re.findall(r"<td>(.*?)</td>", m.group(1))
                want = ["%.5g" % heads[h]["entropy_mean"], str(heads[h]["rank_q"]),
                        "yes" if heads[h]["dead"] else "no"]
                check(all(w in cells for w in want), "head %d row %r has %r" % (h, cells, want))
        m0 = re.search(r'<tr id="head-0"([^>]*)>', page)
        check(m0 is not None and 'class="dead"' in m0.group(1), "dead head 0 highlighted")
        check(html.escape("<b>&") in page and "<b>&" not in page,
              "token text escaped (&lt;b&gt;&amp;)")
        check(html.escape(wp) in page and html.escape(xp) in page, "input paths listed")
        check("Non-finite values: none" in page, "non-finite report (none)")
        check("%d query rows examined" % L in page, "rows examined in the report")

    # options: --max-rows, --batch-index, --tokens, forward-only options
    p = subprocess.run(base + ["--out", out, "--max-rows", "3"], capture_output=True, text=True)
    js = json.load(open(os.path.join(out, "diagnostics.json")))
    check(p.returncode == 0 and js["rows_examined"] == 3 and
          all(h["rows"] == 3 for h in js["heads"]),
          "--max-rows 3: rows_examined %r" % js["rows_examined"])
    missing = os.path.join(args.tmp, "no-such-tokens.txt")
    p = subprocess.run(base + ["--out", out, "--tokens", missing], capture_output=True, text=True)
    check(p.returncode == 1 and missing in p.stderr and "tokens file" in p.stderr,
          "missing tokens file: rc %d %r" % (p.returncode, p.stderr))
    p = subprocess.run(base + ["--out", out, "--batch-index", "1"], capture_output=True, text=True)
    check(p.returncode == 2 and "--batch-index 1 is out of range" in p.stderr and
          "1 batch element" in p.stderr, "--batch-index 1 of 1: rc %d %r" % (p.returncode, p.stderr))
    for bad in (["--need-weights"], ["--incremental"], ["--train"], ["--weights-rows", "0:2"]):
        p = subprocess.run(base + ["--out", out] + bad, capture_output=True, text=True)
        check(p.returncode == 2 and ("%s is not an option of mha inspect" % bad[0]) in p.stderr,
              "%s refused: rc %d %r" % (bad[0], p.returncode, p.stderr))
    p = subprocess.run([args.mha, "forward", "--weights", wp, "--inputs", xp, "--out",
                        os.path.join(args.tmp, "y.safetensors"), "--tokens", tp],
                       capture_output=True, text=True)
    check(p.returncode == 2 and "--tokens is for mha inspect" in p.stderr,
          "forward refuses --tokens: %r" % p.stderr)
    p = subprocess.run([args.mha, "inspect", "--help"], capture_output=True, text=True)
    check(p.returncode == 0 and all(o in p.stdout for o in
                                    ["--tokens", "--max-rows", "--batch-index", "--plot-len",
                                     "report.html"]), "inspect --help lists its options")

    x[4, 0, 11] = np.nan
    conf.st_save(xp, [("query", x)])
    p = subprocess.run([args.mha, "inspect", "--weights", wp, "--inputs", xp, "--out", out,
                        "--num-heads", str(H)], capture_output=True, text=True)
    js = json.load(open(os.path.join(out, "diagnostics.json")))
    nf = js["nonfinite"] or ""
    check(p.returncode == 0 and nf.startswith("query[4, 0, 11] = nan"), "NaN reported: %r" % nf)
    print("%d passed, %d failed" % (passed, failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
