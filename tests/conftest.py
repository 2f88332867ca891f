"""Settings shared by the whole suite."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    # The models in the tests are tiny: a second intra-op thread buys nothing, and on a busy
    # two-core machine its spinning makes each op many times slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
