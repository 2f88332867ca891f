"""The sharding helpers on plain tensors: the plain computation, no process group involved.

Their DTensor side is tested in two real processes by ``test_sharded_optimizers.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from memfit.optim import Adafactor, AdamW8bit, Lamb, Lars
from memfit.optim.sharding import all_reduce_sum_, is_sharded, local_tensor, norms


@pytest.fixture
def no_collectives(monkeypatch):
    """Any all_reduce fails the test: plain tensors must never reach torch.distributed."""

    def refuse(*args, **kwargs):
        raise AssertionError("all_reduce called for a plain tensor")

    monkeypatch.setattr(dist, "all_reduce", refuse)


def test_plain_tensors_are_their_own_local_part_and_never_reduced(no_collectives):
    t = torch.randn(5, 3)
    assert local_tensor(t) is t
    assert not is_sharded(t) and not is_sharded(t, [0])
    partial = torch.randn(3)
    before = partial.clone()
    assert all_reduce_sum_(partial, t) is partial
    assert torch.equal(partial, before)


def test_norms_of_plain_tensors_are_vector_norms(no_collectives):
    a, b = torch.randn(7, 4), torch.randn(7, 4)
    got = norms(a, a, b)
    assert len(got) == 2
    assert torch.equal(got[0], torch.linalg.vector_norm(a))
    assert torch.equal(got[1], torch.linalg.vector_norm(b))


def test_optimizers_step_plain_parameters_without_collectives(no_collectives):
    # Single-process training must not need (or touch) a process group.
    for cls in (AdamW8bit, Lamb, Lars, Adafactor):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(65, 64))
        b = torch.nn.Parameter(torch.randn(65))
        before = w.detach().clone()
        opt = cls([w, b], lr=1e-2)
        w.grad, b.grad = torch.randn_like(w), torch.randn_like(b)
        opt.step()
        assert not torch.equal(w, before), cls.__name__
