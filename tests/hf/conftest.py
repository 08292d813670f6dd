import os
import tempfile

import pytest


def pytest_addoption(parser):
    parser.addoption("--mha", default=os.environ.get("MHA_BIN", "build/mha"),
                     help="the mha executable")


@pytest.fixture(scope="session")
def mha_bin(request):
    return os.path.abspath(request.config.getoption("--mha"))


@pytest.fixture(scope="session")
def hf_tmp():
    with tempfile.TemporaryDirectory(prefix="mha-hf-") as d:
        yield d


_counts = {}


def pytest_runtest_logreport(report):
    # per architecture: passed / xfailed / failed (the setup and call phases)
    if "test_layer[" not in report.nodeid and "test_real_minilm[" not in report.nodeid:
        return
    if report.when != "call" and not (report.when == "setup" and report.outcome != "passed"):
        return
    if "test_real_minilm[" in report.nodeid:
        arch = "bert (all-MiniLM-L6-v2)"
    else:
        case = report.nodeid.split("[", 1)[1].split("-L", 1)[0]
        from test_hf_attention import CASES  # noqa: E402 (the case's model_type)
        arch = CASES[case][0]
    kind = "xfailed" if hasattr(report, "wasxfail") else report.outcome
    c = _counts.setdefault(arch, {})
    c[kind] = c.get(kind, 0) + 1


def pytest_terminal_summary(terminalreporter):
    if not _counts:
        return
    terminalreporter.write_line("per architecture:")
    for arch in sorted(_counts):
        c = _counts[arch]
        terminalreporter.write_line(
            f"  {arch:24s} passed {c.get('passed', 0):3d}  xfailed {c.get('xfailed', 0):3d}  "
            f"failed {c.get('failed', 0):3d}  skipped {c.get('skipped', 0):3d}")
