"""Shared settings for the training tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def _one_thread():
    # The models here are tiny: a second intra-op thread buys nothing, and on a busy
    # two-core machine the threads' spinning makes each op many times slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
