"""Pipeline measurements without launching: block profiles on fake tensors against real runs,
balanced cuts from them, and the in-flight theory against torch's own schedule orders."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memfit
from memfit.distributed.pipeline import (
    PipelineConfig,
    causal_lm_loss,
    choose_cuts,
    microbatches_in_flight,
)
from memfit.estimate.pipeline import profile_blocks, schedule_in_flight


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=4,
                                      n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0))


def _ids(batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 97, (batch, 32), generator=torch.Generator().manual_seed(1))


def _real_activations(model: nn.Module, ids: torch.Tensor) -> int:
    """What the real forward and loss keep for backward, by memfit's tracker."""
    with memfit.track(model) as tracker:
        loss = causal_lm_loss(model(ids).logits, ids)
        kept = tracker.snapshot()["activations"]
    del loss
    return kept


def test_profile_matches_the_real_forward_block_by_block():
    model, ids = _gpt2(), _ids()
    profile = profile_blocks(model, ids, ids)
    total = (profile.first.activation_bytes + profile.last.activation_bytes
             + sum(b.activation_bytes for b in profile.blocks))
    assert total == _real_activations(model, ids)
    assert profile.block_names == tuple(f"transformer.h.{i}" for i in range(4))
    # Identical blocks cost the same; each holds its own parameters.
    assert len(set(profile.blocks)) == 1
    block = model.transformer.h[0]
    assert profile.blocks[0].state_bytes == sum(p.numel() * 4 for p in block.parameters())
    assert profile.blocks[0].compute > 0 and profile.last.compute > 0
    # The tied embedding is counted on the first stage (the last holds a copy).
    wte = model.transformer.wte.weight.numel() * 4
    assert profile.first.state_bytes == wte + model.transformer.wpe.weight.numel() * 4


def test_cuts_from_the_profile_balance_unequal_blocks():
    """Wide blocks first, narrow ones after: the balanced cut gives stage 0 fewer blocks."""
    torch.manual_seed(0)
    widths = [256, 256, 64, 64, 64, 64, 64, 64]
    model = nn.Sequential(*[nn.Sequential(nn.Linear(w, w), nn.GELU()) for w in widths[:2]],
                          nn.Linear(256, 64),
                          *[nn.Sequential(nn.Linear(w, w), nn.GELU()) for w in widths[2:]])
    x = torch.randn(8, 256)
    y = torch.randn(8, 64)
    profile = profile_blocks(model, x[:2], y[:2], loss_fn=nn.functional.mse_loss)
    cuts = choose_cuts(profile.blocks, 2, schedule="gpipe", microbatches=4,
                       first=profile.first, last=profile.last)
    assert cuts[0] < 5  # an even split would cut at 5 of 9
    stage_mem = []
    for s in range(2):
        part = profile.blocks[(0, cuts[0])[s]:(cuts[0], 9)[s]]
        stage_mem.append(sum(4 * b.state_bytes + 4 * b.activation_bytes for b in part))
    assert max(stage_mem) / min(stage_mem) < 2.5


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"])
@pytest.mark.parametrize("degree", [2, 3, 4])
def test_in_flight_theory_matches_torch_schedules(schedule, degree):
    """The closed forms against the order torch's own schedule objects will run (built in a
    fake process group), for several micro-batch counts."""
    for m in (degree, 2 * degree, 3 * degree):
        config = PipelineConfig(degree, schedule, m)
        want = [microbatches_in_flight(schedule, degree, m, r, config.local_stages)
                for r in range(degree)]
        assert schedule_in_flight(config) == want, m
