"""The Python examples of README.md and docs/python.md run as printed."""

import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")


def python_blocks(path, start=None):
    text = open(os.path.join(ROOT, path), encoding="utf-8").read()
    if start is not None:
        text = text[text.index(start):]
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_readme_python_example(tmp_path, monkeypatch):
    (code,) = python_blocks("README.md")
    monkeypatch.chdir(tmp_path)
    env = {}
    exec(compile(code, "README.md (Python)", "exec"), env)
    assert env["out"].shape == (2, 16, 64) and env["weights"].shape == (2, 16, 16)
    assert env["xt"].grad is not None and env["xt"].grad.shape == (2, 16, 64)


def test_docs_python_example(tmp_path, monkeypatch):
    code = python_blocks("docs/python.md", "## Python")[0]
    monkeypatch.chdir(tmp_path)
    env = {}
    exec(compile(code, "docs/python.md (Python)", "exec"), env)
    assert env["out"].shape == (2, 128, 768) and env["o"].shape == (2, 12, 128, 64)
    assert env["y"].shape == (2, 16, 768) and len(env["d"]["heads"]) == 12
    assert (tmp_path / "inspect-out" / "diagnostics.json").exists()
    assert env["qt"].grad is not None
