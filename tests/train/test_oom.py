"""OOM step-down: the frontier, and redoing a step that ran out of memory without losing it."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

import memfit
from memfit.plan import Plan
from memfit.strategies.checkpointing import checkpointed_blocks
from memfit.strategies.compose import apply_plan
from memfit.train import Trainer
from memfit.train.oom import OOMFallback, step_down, switch_plan

from ._helpers import text_dataset, tiny_gpt2


# ---------------------------------------------------------------------------------- frontier
def test_step_down_frontier_keeps_the_effective_batch():
    plan, seen = Plan(), []
    while (plan := step_down(plan, 8)) is not None:
        seen.append((plan.micro_batch_size, plan.grad_accum_steps, plan.checkpointing.mode))
    assert seen == [
        (4, 2, "none"),
        (2, 4, "none"),
        (1, 8, "none"),
        (1, 8, "selective"),
        (1, 8, "full"),
    ]


def test_step_down_from_sqrt_goes_to_full_and_keeps_other_fields():
    plan = Plan(micro_batch_size=1, grad_accum_steps=4, checkpointing="sqrt", max_grad_norm=1.0)
    nxt = step_down(plan, 4)
    assert nxt.checkpointing.mode == "full"
    assert nxt.max_grad_norm == 1.0


def test_step_down_skips_accumulation_where_the_plan_forbids_it():
    # Exact clipping fused into backward cannot accumulate: go straight to checkpointing.
    plan = Plan(optimizer_in_backward=True, max_grad_norm=1.0, grad_clip_mode="exact")
    assert step_down(plan, 8).checkpointing.mode == "selective"
    assert step_down(plan, 8).grad_accum_steps == 1


def test_switch_plan_keeps_the_optimizer_and_rewraps_blocks():
    model = tiny_gpt2()
    setup = apply_plan(model, Plan())
    opt = setup.optimizer
    new, rebuilt = switch_plan(setup, Plan(micro_batch_size=2, grad_accum_steps=2, checkpointing="full"))
    assert not rebuilt and new.optimizer is opt and new.model is model
    assert checkpointed_blocks(model) == ["transformer.h.0", "transformer.h.1"]
    new, rebuilt = switch_plan(new, Plan(optimizer={"name": "sgd", "lr": 0.1}))
    assert rebuilt and type(new.optimizer) is torch.optim.SGD
    assert checkpointed_blocks(model) == []


# ---------------------------------------------------------------------------------- trainer
BATCH = 8


def _run(plan: Plan, *, cap=None, fallback_plans=None, steps=3):
    seen: collections.Counter = collections.Counter()
    trainer = Trainer(
        tiny_gpt2(),
        plan,
        text_dataset(),
        batch_size=BATCH,
        lr=1e-2,
        max_steps=steps,
        cap=cap,
        fallback_plans=fallback_plans,
        progress=False,
        on_step=lambda info: seen.update(info.indices),
    )
    return trainer, trainer.fit(), seen


@pytest.fixture(scope="module")
def calibration():
    """Measured peaks of the whole batch and of half micro-batches (no cap)."""
    _, full, seen_full = _run(Plan())
    half_trainer, half, _ = _run(Plan(micro_batch_size=4, grad_accum_steps=2))
    assert half.peak_bytes < full.peak_bytes
    return {
        "cap": (full.peak_bytes + half.peak_bytes) // 2,
        "seen": seen_full,
        "half_params": {n: p.detach().clone() for n, p in half_trainer.model.named_parameters()},
    }


def test_virtual_oom_steps_down_and_loses_no_sample(calibration):
    trainer, result, seen = _run(Plan(), cap=calibration["cap"])
    assert len(result.step_downs) == 1
    down = result.step_downs[0]
    assert down["step"] == 0 and "virtual cap" in down["error"]
    assert (trainer.plan.micro_batch_size, trainer.plan.grad_accum_steps) == (4, 2)
    assert result.plan["micro_batch_size"] == 4
    # The very samples, each as often, as the run that never ran out of memory.
    assert seen == calibration["seen"]
    # And the parameters of a run that used the smaller micro-batch from the start.
    for name, p in trainer.model.named_parameters():
        torch.testing.assert_close(p.detach(), calibration["half_params"][name], atol=1e-5, rtol=1e-5)


def test_explicit_fallback_plans_are_tried_first(calibration):
    frontier = [Plan(), Plan(micro_batch_size=2, grad_accum_steps=4)]  # the current one is skipped
    trainer, result, seen = _run(Plan(), cap=calibration["cap"], fallback_plans=frontier)
    assert [d["to_plan"]["micro_batch_size"] for d in result.step_downs] == [2]
    assert trainer.plan.micro_batch_size == 2
    assert seen == calibration["seen"]


# ---------------------------------------------------------------------------------- limits
def _sq_loss(out, batch):
    return out.pow(2).mean()


def test_oom_inside_the_optimizer_step_is_not_redone():
    torch.manual_seed(0)
    model = nn.Linear(256, 256)
    setup = apply_plan(model, Plan(optimizer={"name": "adamw", "foreach": False}), loss_fn=_sq_loss)
    runner = OOMFallback(setup, log=lambda m: None)
    weights = sum(p.numel() * 4 for p in model.parameters())
    # Weights and gradients fit; AdamW's first moment (created in the step) does not.
    cap = 2 * weights + 64 * 1024
    with memfit.track(model, setup.optimizer, cap=cap), pytest.raises(
        torch.OutOfMemoryError, match="cannot be redone exactly"
    ):
        runner.step(torch.randn(2, 256))
    assert runner.step_downs == []


def test_nothing_left_raises_after_the_whole_frontier():
    torch.manual_seed(0)
    model = nn.Linear(4, 65536)  # one sample's output alone is over the cap
    setup = apply_plan(model, Plan(), loss_fn=_sq_loss)
    logs: list[str] = []
    runner = OOMFallback(setup, log=logs.append)
    cap = sum(p.numel() * 4 for p in model.parameters()) + 64 * 1024
    with memfit.track(model, setup.optimizer, cap=cap), pytest.raises(
        torch.OutOfMemoryError, match="No smaller plan is left"
    ):
        runner.step(torch.randn(4, 4))
    assert [d.to_plan["micro_batch_size"] for d in runner.step_downs] == [2, 1]
    # A model without repeated blocks cannot be checkpointed: those plans are skipped, said so.
    assert any("cannot step down" in m for m in logs)


def test_fallbacks_that_keep_the_optimizer_come_first():
    sgd = Plan(optimizer={"name": "sgd"})
    swappable = Plan(micro_batch_size=2, grad_accum_steps=4)
    runner = OOMFallback(apply_plan(tiny_gpt2(), Plan()), fallback_plans=[sgd, swappable])
    assert runner.next_plan(8) == swappable
    assert runner.next_plan(8) == Plan(micro_batch_size=4, grad_accum_steps=2)  # step_down
    frugal = Plan(micro_batch_size=1, grad_accum_steps=8, checkpointing="full")
    assert runner.next_plan(8, after=frugal) == sgd  # only once step_down is exhausted
    assert runner.next_plan(8, after=frugal) is None


def test_a_fallback_with_another_optimizer_rebuilds_it_and_reattaches_the_schedule():
    # The most frugal plan step_down knows, then one that freezes the embeddings: switching to
    # it needs a new optimizer (over fewer parameters). SGD keeps the peak in forward/backward,
    # where a step can be redone.
    frugal = Plan(
        micro_batch_size=1, grad_accum_steps=8, checkpointing="full", optimizer={"name": "sgd"}
    )
    mixed = frugal.replace(freeze=("embeddings",))
    _, fp32_run, seen_fp32 = _run(frugal)
    _, mixed_run, _ = _run(mixed)
    assert mixed_run.peak_bytes < fp32_run.peak_bytes
    cap = (fp32_run.peak_bytes + mixed_run.peak_bytes) // 2
    trainer, result, seen = _run(frugal, cap=cap, fallback_plans=[mixed])
    assert [d["rebuilt"] for d in result.step_downs] == [True]
    assert trainer.plan.freeze == ("embeddings",)
    assert trainer.scheduler.optimizer is trainer.optimizer
    assert trainer.optimizer.param_groups[0]["initial_lr"] == 1e-2  # the run's lr
    assert seen == seen_fp32


def test_resume_keeps_the_stepped_down_plan(calibration, tmp_path):
    def trainer(resume: bool) -> Trainer:
        return Trainer(
            tiny_gpt2(),
            Plan(),
            text_dataset(),
            batch_size=BATCH,
            max_steps=2 if not resume else 3,
            cap=calibration["cap"],
            checkpoint_dir=tmp_path,
            resume=resume,
            progress=False,
        )

    first = trainer(False)
    assert first.fit().step_downs  # stepped down, then saved at the end
    again = trainer(True)
    result = again.fit()
    assert again.plan.micro_batch_size == 4 and result.step_downs == []  # no second OOM
    assert result.steps == 3
