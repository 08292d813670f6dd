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
COLUMNS = ("prefill", "padded", "incremental", "backward")


def _column(nodeid):
    """The table's column of a test (None: not counted)."""
    if "test_real_minilm[" in nodeid:
        return "padded"
    if "test_cached[" in nodeid:
        return "incremental"
    if "test_backward[" in nodeid:
        return "backward"
    if "test_layer[" in nodeid:
        mode = nodeid.rsplit("-", 1)[1].rstrip("]")
        return {"full": "prefill", "right": "padded", "left": "padded"}.get(mode, "incremental")
    return None


def pytest_runtest_logreport(report):
    # per architecture and column: passed / xfailed / failed (the setup and
    # call phases)
    col = _column(report.nodeid)
    if col is None:
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
    c = _counts.setdefault(arch, {}).setdefault(col, {})
    c[kind] = c.get(kind, 0) + 1


def _cell(c):
    s = "%d/%d/%d" % (c.get("passed", 0), c.get("xfailed", 0), c.get("failed", 0))
    return s + (" (%d skipped)" % c["skipped"] if c.get("skipped") else "")


def pytest_terminal_summary(terminalreporter):
    if not _counts:
        return
    w = terminalreporter.write_line
    w("per architecture, passed/xfailed/failed:")
    w("  %-24s" % "architecture" + "".join("%-13s" % col for col in COLUMNS))
    total = {}
    for arch in sorted(_counts):
        row = _counts[arch]
        w("  %-24s" % arch + "".join("%-13s" % _cell(row.get(col, {})) if col in row
                                     else "%-13s" % "-" for col in COLUMNS))
        for col, c in row.items():
            t = total.setdefault(col, {})
            for k, v in c.items():
                t[k] = t.get(k, 0) + v
    w("  %-24s" % "all" + "".join("%-13s" % _cell(total.get(col, {})) for col in COLUMNS))
