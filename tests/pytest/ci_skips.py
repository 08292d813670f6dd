"""pytest plugin (-p ci_skips, with tests/pytest on PYTHONPATH): under CI=true a
skipped test or module fails the run, naming its reason, unless the reason
is one of BY_DESIGN: a case that does not apply to this interpreter by
the project's design (not a dependency the install step failed to
provide). Outside CI a skip stays a skip. Either way the run ends with one
line: the skips, by design or not.

scripts/python-tests.sh (tests/python) and tests/hf/run.sh load it."""
import os
import re

try:
    import torch

    _TORCH1 = int(torch.__version__.split(".")[0]) < 2
except Exception:  # (no torch: nothing is by design)
    _TORCH1 = False

# (pattern of the skip reason, why it is by design, applies here)
BY_DESIGN = [
    (r"is PyTorch 2's", "a PyTorch 2 feature: the torch2 venv runs it", True),
    (r"PyTorch 1\.13 has no", "a PyTorch 2 feature: the torch2 venv runs it", True),
    (r"could not import 'ml_dtypes'",
     "ml_dtypes (numpy's bfloat16) is pinned in the torch2 venv; torch1 has Debian's numpy",
     _TORCH1),
    (r"could not import 'transformers'",
     "transformers 5 needs PyTorch 2: the torch1 venv has none, the torch2 venv runs it",
     _TORCH1),
]

_skips = []  # (nodeid, reason)


def _reason(report):
    r = report.longrepr
    if isinstance(r, tuple) and len(r) == 3:
        return str(r[2]).removeprefix("Skipped: ")
    return str(r)


def _record(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        _skips.append((report.nodeid, _reason(report)))


def pytest_runtest_logreport(report):
    _record(report)


def pytest_collectreport(report):
    _record(report)


def _by_design(reason):
    for pat, why, applies in BY_DESIGN:
        if applies and re.search(pat, reason):
            return why
    return None


def _not_by_design():
    return [(n, r) for n, r in _skips if _by_design(r) is None]


def pytest_sessionfinish(session, exitstatus):
    ci = os.environ.get("CI") == "true"
    if ci and _not_by_design() and session.exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter):
    w = terminalreporter.write_line
    ci = os.environ.get("CI") == "true"
    bad = _not_by_design()
    designed = len(_skips) - len(bad)
    for n, r in bad:
        w(("FAILED (skipped under CI=true): " if ci else "skipped: ") + f"{n or '(module)'}: {r}")
    w(f"skips: {len(bad)} not by design{' (each a failure under CI=true)' if bad and ci else ''}, "
      f"{designed} by design")
    whys = {}
    for _, r in _skips:
        why = _by_design(r)
        if why is not None:
            whys[why] = whys.get(why, 0) + 1
    for why, k in whys.items():
        w(f"  by design ({k}): {why}")
