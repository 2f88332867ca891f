"""Data parallelism and ZeRO stages 0-3: two real processes give single-process numerics."""

from __future__ import annotations

import pytest
import torch

from memfit import Plan
from memfit.apply.compose import apply_plan
from memfit.distributed.data import local_batch

from ..models import Stack
from .harness import run_ranks

STEPS = 3
GLOBAL_BATCH = 8


def _batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        {"x": torch.randn(GLOBAL_BATCH, 12, generator=g), "y": torch.randn(GLOBAL_BATCH, 5, generator=g)}
        for _ in range(STEPS)
    ]


def _train(plan: Plan) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Stack()
    setup = apply_plan(model, plan)
    losses = [float(setup.step(b)) for b in _batches()]
    params = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        params[name] = full.detach().clone()
    return losses, params


def _plan(stage: int, **kw) -> Plan:
    return Plan(parallel={"data": 2, "zero_stage": stage}, **kw)


CASES = [(stage, accum) for stage in (0, 1, 2, 3) for accum in (1, 2)]


def _all_cases(rank: int, world: int) -> list:
    # One spawn for every case: starting processes costs more than the cases themselves.
    return [_train(_plan(stage, grad_accum_steps=accum, max_grad_norm=0.5)) for stage, accum in CASES]


@pytest.mark.distributed
def test_every_stage_equals_one_process():
    results = run_ranks(_all_cases, 2, timeout=300)
    for i, (stage, accum) in enumerate(CASES):
        plan = _plan(stage, grad_accum_steps=accum, max_grad_norm=0.5)
        want_losses, want = _train(plan.replace(parallel={}))
        for rank, per_case in enumerate(results):
            losses, params = per_case[i]
            where = f"stage {stage}, accumulation {accum}, rank {rank}"
            assert losses == pytest.approx(want_losses, rel=1e-5, abs=1e-6), where
            for name, value in want.items():
                torch.testing.assert_close(
                    params[name], value, rtol=1e-5, atol=1e-6, msg=f"{name} ({where})"
                )


def test_local_batch_splits_evenly_and_refuses_otherwise():
    batch = {"x": torch.arange(8).reshape(8, 1)}
    parts = [local_batch(batch, r, 4)["x"].flatten().tolist() for r in range(4)]
    assert parts == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match="multiple of 3"):
        local_batch(batch, 0, 3)


def test_plan_refuses_data_parallel_with_what_it_cannot_do():
    from memfit.plan import PlanError

    with pytest.raises(PlanError, match="optimizer_in_backward"):
        _plan(0, optimizer_in_backward=True)
    with pytest.raises(PlanError, match=r"'bnb-adamw8bit'.*stage 0"):
        Plan(parallel={"data": 2, "zero_stage": 3}, optimizer="bnb-adamw8bit")
    with pytest.raises(PlanError, match="zero_stage must be 0, 1, 2 or 3"):
        Plan(parallel={"data": 2, "zero_stage": 4})
    with pytest.raises(PlanError, match="bf16-pure"):
        _plan(0, precision="bf16-pure")
    with pytest.raises(PlanError, match="'tokens'"):
        _plan(2, loss_normalization="tokens")


def _zero1_keeps_settings(rank: int, world: int) -> tuple:
    model = Stack()
    plan = _plan(1, optimizer={"name": "adafactor", "lr": 1e-3,
                               "kwargs": {"stochastic_rounding": True, "chunk_size": 4096}})
    opt = apply_plan(model, plan).optimizer
    local = opt.optim
    return type(local).__name__, local.stochastic_rounding, local.chunk_size


@pytest.mark.distributed
def test_zero1_rebuilds_the_optimizer_with_all_its_settings():
    for name, rounding, chunk in run_ranks(_zero1_keeps_settings, 2, timeout=120):
        assert (name, rounding, chunk) == ("Adafactor", True, 4096)


def test_apply_outside_a_process_group_says_how_to_launch():
    with pytest.raises(ValueError, match="--nproc-per-node 2"):
        apply_plan(Stack(), _plan(0))
