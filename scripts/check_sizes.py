#!/usr/bin/env python3
"""check_sizes.py ROOT: the house's size rules for the code that ships
(src/, tools/, python/src/, examples/; the tests are exempt): no file
over 900 lines, no function over 120 lines but the validators named in
VALIDATORS (a check of many independent fields reads best as one list).
Fails naming each file or function, its length and the limit. Python's
standard library only; ctest `sizes` (label quick) runs it."""
import os
import re
import sys

from check_layers import strip as blank  # comments and literals blanked, newlines kept

MAX_FILE = 900
MAX_FUNC = 120
DIRS = ("src", "tools", "python/src", "examples")
# name -> why it may be longer than MAX_FUNC
VALIDATORS = {
    "mha__st_check_entry": "a safetensors header entry's fields, each checked and named",
}


NAME = re.compile(r"([A-Za-z_]\w*)\s*\($")


def functions(text):
    """(name, first line, length in lines) of each function definition:
    a brace at depth 0 opened after a parenthesised signature."""
    s = blank(text)
    depth, start, name, out = 0, None, None, []
    i = 0
    while i < len(s):
        c = s[i]
        if c == "{":
            if depth == 0:
                head = s[:i].rstrip()
                if head.endswith(")") and not re.search(r"=\s*$", head):
                    # the name before the signature's parenthesis
                    k, d = len(head) - 1, 0
                    while k >= 0:
                        if head[k] == ")":
                            d += 1
                        elif head[k] == "(":
                            d -= 1
                            if d == 0:
                                break
                        k -= 1
                    m = NAME.search(head[:k + 1])
                    if m and m.group(1) not in ("if", "for", "while", "switch"):
                        name, start = m.group(1), s.count("\n", 0, i) + 1
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0 and start is not None:
                end = s.count("\n", 0, i) + 1
                out.append((name, start, end - start + 1))
                start = name = None
        i += 1
    return out


def main(root):
    bad = []

    for d in DIRS:
        for dirpath, _, files in os.walk(os.path.join(root, d)):
            for f in sorted(files):
                if not f.endswith((".c", ".h")):
                    continue
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, root)
                with open(path, encoding="utf-8") as fh:
                    text = fh.read()
                n = text.count("\n")
                if n > MAX_FILE:
                    bad.append("%s: %d lines (at most %d)" % (rel, n, MAX_FILE))
                for name, line, length in functions(text):
                    if length > MAX_FUNC and name not in VALIDATORS:
                        bad.append("%s:%d: function %s: %d lines (at most %d)"
                                   % (rel, line, name, length, MAX_FUNC))
    for b in bad:
        print(b)
    print("%d over the limits" % len(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
