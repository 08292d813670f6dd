#!/usr/bin/env python3
"""The README's `mha train` example learns its task: run exactly as printed
(the line of README.md's CLI section that starts `build/mha train --task`,
with this build's mha), it reaches >= 95% held-out accuracy and writes its
CSV and PNG. (The example was `--task recall --heads 4`: 59.5%.)

Usage: test_readme_train.py --mha PATH/TO/mha --readme README.md --tmp TMPDIR
Exits 0 when it passes, 1 otherwise. Python 3 standard library only.
"""

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mha", required=True)
    ap.add_argument("--readme", required=True)
    ap.add_argument("--tmp", required=True)
    a = ap.parse_args()
    with open(a.readme, encoding="utf-8") as f:
        lines = [l.strip() for l in f if l.strip().startswith("build/mha train --task")]
    if len(lines) != 1:
        print("FAIL  README.md has %d lines starting 'build/mha train --task' (expected 1)"
              % len(lines))
        return 1
    argv = shlex.split(lines[0].split("#")[0])
    tmp = os.path.abspath(a.tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    print("README: %s" % lines[0])
    t0 = time.time()
    p = subprocess.run([os.path.abspath(a.mha)] + argv[1:], cwd=tmp, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, timeout=900)
    secs = time.time() - t0
    out = p.stdout.decode(errors="replace")
    problems = []
    if p.returncode:
        problems.append("exit status %d: %s" % (p.returncode, p.stderr.decode()[-500:]))
    m = re.search(r"eval accuracy ([0-9.]+)%", out)
    acc = float(m.group(1)) if m else None
    if acc is None:
        problems.append("no 'eval accuracy' in its summary: %r" % out[-500:])
    elif acc < 95.0:
        problems.append("held-out accuracy %.2f%% < 95%%" % acc)
    for opt in ("--csv", "--plot"):
        if opt in argv:
            path = os.path.join(tmp, argv[argv.index(opt) + 1])
            if not os.path.isfile(path) or os.path.getsize(path) == 0:
                problems.append("%s %s not written" % (opt, path))
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    if problems:
        print("FAIL  %s [%.1f s]" % ("; ".join(problems), secs))
        return 1
    print("ok    %s [%.1f s]" % (summary, secs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
