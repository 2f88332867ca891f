"""Activation offload as a plan setting (``offload: {activations: true}``) through apply_plan.

Numerics: the same parameters after two steps as the plain plan (the bytes travel unchanged,
so exactly equal). Memory: the tracker's device-tier activations fall, the host tier holds
what moved, and a dry run predicts both tiers as the real run measures them.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import memfit
from memfit.apply.compose import apply_plan

CONFIG = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64,
          "n_layer": 2, "n_head": 2, "vocab_size": 256, "n_positions": 64,
          "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0}  # fmt: skip
OFF = {"activations": True, "activation_min_bytes": 0}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG))


def _ids(seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def _train(plan: memfit.Plan) -> tuple[list[torch.Tensor], memfit.MemoryReport]:
    model = _model()
    setup = apply_plan(model, plan)
    with memfit.track(model, setup.optimizer) as tracker:
        for step in range(2):
            setup.step(_ids(step))
    params = [p.detach().clone() for p in model.parameters()]
    setup.remove()
    return params, tracker.report()


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_plan_parameters_equal_and_device_activations_fall(checkpointing):
    base = memfit.Plan(checkpointing=checkpointing, grad_accum_steps=2)
    ref, plain = _train(base)
    got, offloaded = _train(base.replace(offload=OFF))
    for r, g in zip(ref, got, strict=True):
        torch.testing.assert_close(g, r, rtol=0, atol=0)
    dev_plain = plain.peak_by_tier_category["device"]["activations"]
    dev_off = offloaded.peak_by_tier_category["device"]["activations"]
    host = offloaded.peak_by_tier_category["host"]["activations"]
    assert plain.peak_by_tier["host"] == 0
    assert host > 0
    # What left the device is on the host; the device keeps at most what it kept before
    # minus the host copies of the forward's tail (restored one storage at a time).
    assert dev_off < dev_plain
    assert offloaded.peak_by_tier["device"] < plain.peak_by_tier["device"]


def test_dry_run_predicts_both_tiers(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    plan = memfit.Plan(offload=OFF)
    real = memfit.measure(str(path), plan, batch_size=2, seq_len=16)
    dry = memfit.dry_run(str(path), plan, batch_size=2, seq_len=16)
    assert real.peak_by_tier["host"] > 0
    assert dry.peak_by_tier == real.peak_by_tier
    assert dry.peak_by_category == real.peak_by_category


def test_plan_json_round_trip_and_compile_refused():
    plan = memfit.Plan(offload={"activations": True, "optimizer": "host"})
    data = plan.to_dict()
    assert data["offload"]["activations"] is True and data["offload"]["optimizer"] == "host"
    assert data["offload"]["parameters"] is None and "disk_dir" in data["offload"]
    assert memfit.Plan.from_dict(json.loads(json.dumps(data))) == plan
    with pytest.raises(memfit.PlanError, match="activation offload cannot be combined with compile"):
        memfit.Plan(offload=OFF, compile=True)
