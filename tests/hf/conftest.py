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
