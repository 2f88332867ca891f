"""Sharded checkpoints of two real processes: saved, loaded into fresh models and optimizers,
training goes on exactly as if it never stopped, at each ZeRO stage."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from memfit import Plan
from memfit.apply.compose import apply_plan
from memfit.train.checkpoint import load_checkpoint, save_checkpoint

from ..distributed.harness import run_ranks
from ..models import Stack

STAGES = (0, 1, 2, 3)


def _batch(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return {"x": torch.randn(8, 12, generator=g), "y": torch.randn(8, 5, generator=g)}


def _setup(stage: int, optimizer: str):
    torch.manual_seed(0)
    model = Stack()
    plan = Plan(parallel={"data": 2, "zero_stage": stage}, optimizer=optimizer)
    return model, apply_plan(model, plan)


def _local(value: Any) -> Any:
    """``value`` with every tensor as this rank's plain local tensor (a DTensor's shard)."""
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_local(v) for v in value]
    if isinstance(value, torch.Tensor):
        return (value.to_local() if hasattr(value, "to_local") else value).detach().clone()
    return value


def _training_state(model: torch.nn.Module, optimizer: Any) -> dict:
    """This rank's parameters (whole) and optimizer state (its shard, ZeRO-1's partition)."""
    from memfit.train.sharded_checkpoint import _local as local_optimizer

    params = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in model.named_parameters()
    }
    return {"params": params, "optimizer": _local(local_optimizer(optimizer).state_dict())}


def _assert_same(a: Any, b: Any, where: str) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}/{i}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, where


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
            # Bit for bit after two more steps: the weights and every optimizer state tensor.
            _assert_same(
                _training_state(model, setup.optimizer),
                _training_state(model2, setup2.optimizer),
                f"stage {stage}, {optimizer}, rank {rank}",
            )
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
