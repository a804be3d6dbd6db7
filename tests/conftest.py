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
