"""Sharded checkpoints of two real processes: saved, loaded into fresh models and optimizers,
training goes on exactly as if it never stopped, at each ZeRO stage."""

from __future__ import annotations

import pytest
import torch

from memfit import Plan
from memfit.strategies.compose import apply_plan
from memfit.train.checkpoint import load_checkpoint, save_checkpoint

from ..distributed.harness import run_ranks
from ..models import Stack

STAGES = (0, 1, 3)


def _batch(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return {"x": torch.randn(8, 12, generator=g), "y": torch.randn(8, 5, generator=g)}


def _setup(stage: int, optimizer: str):
    torch.manual_seed(0)
    model = Stack()
    plan = Plan(parallel={"data": 2, "zero_stage": stage}, optimizer=optimizer)
    return model, apply_plan(model, plan)


def _save_then_resume(rank: int, world: int, folder: str) -> dict:
    out = {}
    for stage in STAGES:
        for optimizer in ("adamw", "adamw8bit"):
            model, setup = _setup(stage, optimizer)
            for i in range(2):
                setup.step(_batch(i))
            path = save_checkpoint(f"{folder}/{stage}-{optimizer}", 2, model, setup.optimizer)
            straight = [float(setup.step(_batch(i))) for i in (2, 3)]
            model2, setup2 = _setup(stage, optimizer)
            state = load_checkpoint(path, model2, setup2.optimizer)
            resumed = [float(setup2.step(_batch(i))) for i in (2, 3)]
            out[(stage, optimizer)] = (straight, resumed, state["world_size"])
    return out


@pytest.mark.distributed
def test_a_sharded_checkpoint_resumes_exactly_at_every_stage(tmp_path):
    for per_rank in run_ranks(_save_then_resume, 2, str(tmp_path), timeout=300):
        for case, (straight, resumed, world) in per_rank.items():
            assert world == 2, case
            assert resumed == straight, case
    files = {p.name for p in (tmp_path / "1-adamw" / "step-00000002").iterdir()}
    assert {"optimizer-rank00000.safetensors", "optimizer-rank00001.safetensors"} <= files
    assert "manifest.json" in files and ".metadata" in files  # DCP's index
