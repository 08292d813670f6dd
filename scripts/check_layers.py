#!/usr/bin/env python3
"""check_layers.py [ROOT]: the layer check (docs/architecture.md).

Reads the layer table of docs/architecture.md (the rows between the
`<!-- layers -->` and `<!-- /layers -->` markers: | layer | name | files |)
and fails, naming file, line and target, on
  - a source file of src/, tools/, python/ or examples/ the table does not
    place,
  - an #include "..." of a file in a higher layer,
  - a call (or use of a macro or inline function) of something defined in
    a file of a higher layer,
  - a cycle between files (within a layer too: arrows point one way).
The public headers (include/) may be included by everything. Comments and
string literals are ignored. Exit status 0 when the house is one-way.
"""
import fnmatch
import os
import re
import sys

ROOT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                       os.path.join(os.path.dirname(__file__), ".."))
TABLE = os.path.join(ROOT, "docs", "architecture.md")
SCOPES = ("src", "tools", "python", "examples")


def read_table():
    text = open(TABLE, encoding="utf-8").read()
    m = re.search(r"<!-- layers -->(.*?)<!-- /layers -->", text, re.S)
    if not m:
        sys.exit(f"{TABLE}: no <!-- layers --> ... <!-- /layers --> table")
    rows = []
    for line in m.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not re.fullmatch(r"\d+", cells[0]):
            continue
        globs = [g.strip("` ") for g in cells[2].split(",") if g.strip("` ")]
        rows.append((int(cells[0]), cells[1], globs))
    if not rows:
        sys.exit(f"{TABLE}: the layer table is empty")
    return rows


def source_files():
    out = []
    for scope in SCOPES:
        for dirpath, _, names in os.walk(os.path.join(ROOT, scope)):
            for n in names:
                if n.endswith((".c", ".h")):
                    out.append(os.path.relpath(os.path.join(dirpath, n), ROOT))
    return sorted(out)


def layer_of(path, rows):
    for layer, name, globs in rows:
        for g in globs:
            if fnmatch.fnmatchcase(path, g):
                return layer, name
    return None


def strip(text):
    """Comments and string/char literals blanked (newlines kept)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(c + re.sub(r"[^\n]", " ", text[i + 1:j]) + c)
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


DEF_FN = re.compile(r"^(?!static\b)(?:[A-Za-z_][\w\s\*]*?[\s\*])?((?:mha|cli|tiny|plot|train|bench|cmd|run|demo|inspect|embed)_\w+)\s*\(([^;{]*?)\)\s*\{",
                    re.M | re.S)
DEF_INLINE = re.compile(r"^static\s+inline\b[^;{(]*?\b(\w+)\s*\(", re.M)
DEF_MACRO = re.compile(r"^\s*#\s*define\s+(MHA_\w+|mha_\w+)\b", re.M)
DEF_TYPE = re.compile(r"^typedef\s+(?:struct|enum)\s+\w*\s*\{.*?\}\s*(\w+)\s*;", re.M | re.S)
DEF_ROPE_MACRO = re.compile(r"^[A-Z_]+\((mha_\w+),", re.M)
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
IDENT = re.compile(r"\b(mha_\w+|MHA_\w+|cli_\w+|tiny_\w+|plot_\w+|train_\w+|bench_\w+|cmd_\w+|run_\w+|demo_\w+|inspect_\w+|embed_\w+)\b")
# A prototype at the start of a line of a header: declares, does not use.
PROTO = re.compile(r"^(?!static\b|typedef\b|return\b|#)[A-Za-z_][\w \t\*]*?\b(\w+)\s*\(", re.M)


def main():
    rows = read_table()
    files = source_files()
    problems = []
    layers = {}
    for f in files:
        lay = layer_of(f, rows)
        if lay is None:
            problems.append(f"{f}: not in the layer table of docs/architecture.md")
        else:
            layers[f] = lay
    texts = {f: strip(open(os.path.join(ROOT, f), encoding="utf-8").read()) for f in files}
    # where each name is defined (non-static functions, inline functions and
    # macros of headers, typedef'd structs); the first definition wins
    defined = {}
    for f in files:
        t = texts[f]
        names = [m.group(1) for m in DEF_FN.finditer(t)]
        names += [m.group(1) for m in DEF_ROPE_MACRO.finditer(t)]
        if f.endswith(".h"):
            names += [m.group(1) for m in DEF_INLINE.finditer(t)]
            names += [m.group(1) for m in DEF_MACRO.finditer(t)]
            names += [m.group(1) for m in DEF_TYPE.finditer(t)]
        for nm in names:
            defined.setdefault(nm, f)
    edges = {f: {} for f in files}  # f -> {g: first "line: what"}
    for f in files:
        if f not in layers:
            continue
        t = texts[f]
        raw = open(os.path.join(ROOT, f), encoding="utf-8").read()
        lineno = lambda pos: t.count("\n", 0, pos) + 1
        for m in INCLUDE.finditer(raw):
            inc = os.path.normpath(os.path.join(os.path.dirname(f), m.group(1)))
            if not os.path.exists(os.path.join(ROOT, inc)):
                alt = os.path.normpath(os.path.join(os.path.dirname(f).split(os.sep)[0], m.group(1)))
                inc = alt if os.path.exists(os.path.join(ROOT, alt)) else inc
            if inc.startswith("include" + os.sep) or inc not in layers:
                continue  # public headers, system headers
            if inc != f:
                edges[f].setdefault(inc, f"{raw.count(chr(10), 0, m.start()) + 1}: #include \"{m.group(1)}\"")
        own_defs = {nm for nm, g in defined.items() if g == f}
        protos = {m.start(1) for m in PROTO.finditer(t)} if f.endswith(".h") else set()
        for m in IDENT.finditer(t):
            if m.start(1) in protos:
                continue
            nm = m.group(1)
            g = defined.get(nm)
            if g is None or g == f or nm in own_defs:
                continue
            edges[f].setdefault(g, f"{lineno(m.start())}: {nm}")
    # upward edges
    for f, tos in edges.items():
        for g, where in tos.items():
            if g not in layers:
                continue
            lf, nf = layers[f]
            lg, ng = layers[g]
            if lg > lf:
                problems.append(f"{f}:{where} reaches up from layer {lf} ({nf}) "
                                f"to {g}, layer {lg} ({ng})")
    # cycles (Tarjan's strongly connected components)
    index, low, stack, on, sccs, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in edges:
        if v not in index:
            visit(v)
    for comp in sccs:
        detail = "; ".join(f"{a} -> {b} ({edges[a][b]})" for a in comp for b in comp
                           if b in edges[a])
        problems.append("cycle between " + ", ".join(comp) + ": " + detail)
    nedges = sum(len(v) for v in edges.values())
    if problems:
        for p in problems:
            print("layers:", p)
        print(f"layer check: FAILED, {len(problems)} problem(s) ({len(files)} files, "
              f"{nedges} edges)")
        return 1
    print(f"layer check: ok ({len(files)} files in {len(rows)} layers, {nedges} edges, "
          "every one pointing down or sideways, no cycle)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
