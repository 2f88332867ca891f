"""Fixtures for the optimizer tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_intra_op_thread() -> Iterator[None]:
    """Run each test with one torch thread, restoring the setting afterwards.

    The models here are tiny, so a second thread buys nothing, while on an oversubscribed
    machine every multi-threaded kernel can wait milliseconds for a descheduled thread, which
    made the suite ten times slower.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
