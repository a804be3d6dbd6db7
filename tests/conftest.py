import os

import pytest
import torch

# Keep tests independent of each other's compiled-code caches and deterministic.
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under ``pytest -n N --dist loadgroup`` (``make test``), keep each test file on one worker
    (its module fixtures and caches are built once) unless a test names its own ``xdist_group``
    (the model zoo groups by architecture). Runs before xdist's own hook, which reads the groups."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
