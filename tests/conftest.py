import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN_DIR = os.path.join(HERE, "data", "golden")


@pytest.fixture(scope="session", autouse=True)
def _cosytrt_cache(tmp_path_factory):
    """One user-cache folder for the whole test session (the tiny model is created there once)."""
    if "COSYTRT_CACHE" not in os.environ:
        os.environ["COSYTRT_CACHE"] = str(tmp_path_factory.mktemp("cosytrt_cache"))
    yield


@pytest.fixture(scope="session")
def golden_dir():
    return GOLDEN_DIR
