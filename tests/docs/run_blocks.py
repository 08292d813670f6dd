#!/usr/bin/env python3
"""Runs every fenced code block of README.md and docs/*.md.

A block's info string names its language and, after it, how it runs:

  ```sh        bash -e -o pipefail in the page's scratch folder
  ```python    the page's Python blocks, in order, in one interpreter
               (a later block sees an earlier block's names)
  ```c         a whole program (it has `int main`), or a fragment run as
               the body of `int main(void)` with <mha.h> and the C
               library's usual headers; compiled with -std=c11 -Wall
               -Werror against this build's libmha; must exit 0 and
               write nothing to stderr
  ```text      not code: output, a usage synopsis, a layout; not run
  ```sh ci     install and build steps: .ci/run runs these itself on a
               fresh machine, in the repository (`--ci` below), so this
               test leaves them to it
  ```sh network  needs a host this machine cannot reach (PyTorch's CPU
               wheel index); listed, with the reason, as not run here

A page's blocks run in document order in one scratch folder, so a block
may use a file an earlier one wrote. In that folder `build` is this
build and the repository's top-level entries are linked; `python3` on
PATH is --python's. A block without a language, or with any other, fails.
Every relative link of the pages must reach a file (and its heading), and
no page may name a commit hash.

Usage:
  run_blocks.py --build DIR --python PY [--tmp DIR] [PAGE...]
      runs the blocks (every page when none is named); exit 0 when all pass
  run_blocks.py --ci
      runs the `sh ci` blocks of README.md in the repository root, in
      order (what .ci/run does); exit status of the first that fails
"""

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
LANGS = {"sh", "python", "c", "text"}
TAGS = {"sh": {"", "ci", "network"}, "python": {""}, "c": {""}, "text": {""}}
TIMEOUT = 300  # seconds per block
# Commands that install or build: a block that runs one must say `sh ci`
# (the test would otherwise change this machine or this build under it)
INSTALLS = re.compile(r"(^|[;&|(]\s*|\bsudo\s+)(apt-get|apt|pip3?|make|cmake|scripts/install-deps\.sh|"
                      r"scripts/python-venvs\.sh|\S*/pip)\b|python3? -m (pip|venv)\b", re.M)

# The Python side: reads one JSON request per line ({"code", "name"}),
# runs it in one namespace, answers "ok" or the traceback on its own copy
# of stdout (the blocks' own output goes to stderr, captured).
DRIVER = r"""
import json, os, sys, traceback
proto = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr
ns = {"__name__": "__main__"}
for line in sys.stdin:
    req = json.loads(line)
    try:
        exec(compile(req["code"], req["name"], "exec"), ns)
        answer = "ok"
    except BaseException:
        answer = traceback.format_exc()
    sys.stderr.flush()
    proto.write(json.dumps(answer) + "\n")
    proto.flush()
"""

C_HEADERS = ("mha.h", "stdio.h", "stdlib.h", "string.h", "math.h", "stdint.h", "stdbool.h")


def pages(names):
    if names:
        return [os.path.relpath(os.path.abspath(n), ROOT) for n in names]
    return ["README.md"] + sorted(
        os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))


def blocks(page):
    """[(line, lang, tag, code)] of the page's fenced blocks."""
    out, cur = [], None
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            m = re.match(r"^(\s*)```(.*)$", line.rstrip("\n"))
            if cur is None and m:
                info = m.group(2).split()
                cur = [n, info[0] if info else "", " ".join(info[1:]), [], len(m.group(1))]
            elif cur is not None and m and not m.group(2).strip():
                out.append((cur[0], cur[1], cur[2], "".join(cur[3])))
                cur = None
            elif cur is not None:
                ind = cur[4]
                cur[3].append(line[ind:] if line[:ind].strip() == "" else line)
    if cur is not None:
        out.append((cur[0], cur[1], "unclosed", "".join(cur[3])))
    return out


def slug(heading):
    """GitHub's anchor of a heading."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def anchors(page):
    text = re.sub(r"```.*?```", "", open(os.path.join(ROOT, page), encoding="utf-8").read(),
                  flags=re.S)
    return {slug(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}


def check_links(page):
    """The page's relative links whose file or heading is missing."""
    bad = []
    text = re.sub(r"```.*?```", "", open(os.path.join(ROOT, page), encoding="utf-8").read(),
                  flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(os.path.join(ROOT, dest)):
            bad.append("%s: a link to %s, which does not exist" % (page, target))
        elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
            bad.append("%s: a link to %s, whose heading is not in %s" % (page, target, dest))
    return bad


def check_hashes(page):
    """Commit hashes in the page's text: documentation states what is, not
    when it changed (CHANGELOG.md and git keep the history)."""
    text = re.sub(r"```.*?```", "", open(os.path.join(ROOT, page), encoding="utf-8").read(),
                  flags=re.S)
    return ["%s: %r looks like a commit hash" % (page, h)
            for h in re.findall(r"(?<![\w.#/-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b",
                                text)]


def scratch_folder(tmp, page, build):
    d = os.path.join(tmp, page.replace("/", "_").replace(".md", ""))
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    for e in os.listdir(ROOT):
        if e in ("build", ".git") or e.startswith("build-"):
            continue
        os.symlink(os.path.join(ROOT, e), os.path.join(d, e))
    os.symlink(build, os.path.join(d, "build"))
    return d


def run_sh(code, cwd, env):
    p = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", code], cwd=cwd, env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=TIMEOUT)
    return p.returncode == 0, p.stdout.decode(errors="replace")


def run_c(code, cwd, env, build, name):
    if not re.search(r"\bint\s+main\s*\(", code):
        code = ("".join("#include <%s>\n" % h for h in C_HEADERS) +
                "int main(void) {\n#line 1 \"%s\"\n%s\nreturn 0;\n}\n" % (name, code))
    src = os.path.join(cwd, "block.c")
    exe = os.path.join(cwd, "block")
    with open(src, "w", encoding="utf-8") as f:
        f.write(code)
    cc = os.environ.get("CC", "cc")
    p = subprocess.run([cc, "-std=c11", "-Wall", "-Werror", "-I", os.path.join(ROOT, "include"),
                        src, "-o", exe, "-L", build, "-lmha", "-lm", "-Wl,-rpath," + build],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=TIMEOUT)
    if p.returncode:
        return False, "compile failed:\n" + p.stdout.decode(errors="replace")
    p = subprocess.run([exe], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       timeout=TIMEOUT)
    err = p.stderr.decode(errors="replace")
    out = p.stdout.decode(errors="replace") + err
    if p.returncode or err:
        return False, "exit status %d, stderr %r:\n%s" % (p.returncode, err[-300:], out)
    return True, out


class Python:
    """One interpreter per page (started at its first Python block)."""

    def __init__(self, python, cwd, env):
        self.log = open(os.path.join(cwd, ".python-blocks.log"), "w+b")
        self.p = subprocess.Popen([python, "-c", DRIVER], cwd=cwd, env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)

    def run(self, code, name):
        start = self.log.seek(0, 2)
        self.p.stdin.write((json.dumps({"code": code, "name": name}) + "\n").encode())
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        self.log.seek(start)
        out = self.log.read().decode(errors="replace")
        if not line:
            return False, "the interpreter exited (status %s):\n%s" % (self.p.wait(), out)
        answer = json.loads(line)
        return answer == "ok", out if answer == "ok" else out + answer

    def close(self):
        self.p.stdin.close()
        self.p.wait()
        self.log.close()


def check_page(page, a, env, counts):
    """Runs one page's blocks; returns the list of failures."""
    bad = []
    found = blocks(page)
    if not found:
        return bad
    cwd = scratch_folder(a.tmp, page, a.build)
    py = None
    try:
        for line, lang, tag, code in found:
            name = "%s:%d" % (page, line)
            if lang not in LANGS or tag not in TAGS[lang]:
                bad.append("%s: a block must be ```sh, ```python, ```c or ```text (with ci or "
                           "network after sh); this one is ```%s" % (name, (lang + " " + tag).strip()))
                continue
            if lang == "text":
                counts["text"] += 1
                continue
            if tag == "ci":
                counts["ci"] += 1
                print("ci     %s (run by .ci/run)" % name)
                continue
            if tag == "network":
                counts["network"] += 1
                print("NOT RUN %s: needs the network beyond this machine's reach" % name)
                continue
            if lang == "sh" and INSTALLS.search(code):
                bad.append("%s: a block that installs or builds (%r) must be ```sh ci"
                           % (name, INSTALLS.search(code).group(0).strip()))
                continue
            t0 = time.time()
            try:
                if lang == "sh":
                    ok, out = run_sh(code, cwd, env)
                elif lang == "c":
                    ok, out = run_c(code, cwd, env, a.build, name)
                else:
                    py = py or Python(a.python, cwd, env)
                    ok, out = py.run(code, name)
            except subprocess.TimeoutExpired:
                ok, out = False, "timed out after %d s" % TIMEOUT
            counts[lang] += 1
            print("%s %-6s %s [%.1f s]" % ("ok  " if ok else "FAIL", lang, name, time.time() - t0))
            if not ok:
                bad.append("%s (%s):\n%s" % (name, lang, out[-3000:]))
    finally:
        if py:
            py.close()
    return bad


def run_ci_blocks():
    for page in pages([]):
        for line, lang, tag, code in blocks(page):
            if lang == "sh" and tag == "ci":
                print("== %s:%d\n%s" % (page, line, code), flush=True)
                rc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", code], cwd=ROOT).returncode
                if rc:
                    print("FAIL %s:%d: exit status %d" % (page, line, rc))
                    return rc
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build")
    ap.add_argument("--python")
    ap.add_argument("--tmp")
    ap.add_argument("--ci", action="store_true")
    ap.add_argument("pages", nargs="*")
    a = ap.parse_args()
    if a.ci:
        return run_ci_blocks()
    if not a.build or not a.python:
        ap.error("--build and --python are required")
    a.build = os.path.abspath(a.build)
    a.tmp = os.path.abspath(a.tmp or os.path.join(a.build, "docs_blocks_tmp"))
    if not os.access(a.python, os.X_OK):
        print("docs blocks: no Python interpreter at %s (scripts/python-venvs.sh makes it): "
              "skipped" % a.python)
        return 77
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(os.path.abspath(a.python)) + os.pathsep + env.get("PATH", "")
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", PYTHONDONTWRITEBYTECODE="1")
    counts = dict(sh=0, python=0, c=0, text=0, ci=0, network=0)
    bad = []
    for page in pages(a.pages):
        bad += check_links(page)
        bad += check_hashes(page)
        bad += check_page(page, a, env, counts)
    print("docs blocks: %d sh, %d python, %d c run; %d text (not code); %d ci (run by .ci/run); "
          "%d network (not run here); %d failed"
          % (counts["sh"], counts["python"], counts["c"], counts["text"], counts["ci"],
             counts["network"], len(bad)))
    for b in bad:
        print("FAIL " + b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
