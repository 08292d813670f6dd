"""The README's Python example runs as printed."""

import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))


def test_readme_python_example(tmp_path, monkeypatch):
    text = open(os.path.join(HERE, "..", "..", "README.md"), encoding="utf-8").read()
    section = text[text.index("## Python"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    env = {}
    exec(compile(code, "README.md (Python)", "exec"), env)
    assert env["out"].shape == (2, 128, 768) and env["o"].shape == (2, 12, 128, 64)
    assert env["y"].shape == (2, 16, 768) and len(env["d"]["heads"]) == 12
    assert (tmp_path / "inspect-out" / "diagnostics.json").exists()
    assert env["qt"].grad is not None
