"""OOM step-down: the frontier, and redoing a step that ran out of memory without losing it."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

import memfit
from memfit.apply.compose import apply_plan
from memfit.plan import Plan
from memfit.strategies.checkpointing import checkpointed_blocks
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


def _lm_batch():
    ids = torch.randint(0, 259, (2, 16), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def test_stepping_down_from_bf16_pure_restores_fp32_weights_and_drops_its_rounding():
    # Before, a step-down re-applied plans to the same model: the weights stayed bf16 and the
    # input-cast hook stayed on; the new optimizer stepped fp32 math on bf16 weights without
    # stochastic rounding. Freezing was never lifted.
    model = tiny_gpt2(seed=0)
    setup = apply_plan(model, Plan(precision="bf16-pure", freeze=("embeddings",)))
    old_optimizer = setup.optimizer
    assert "_memfit_bf16" in old_optimizer.__dict__
    setup.step(_lm_batch())
    trained = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    new, rebuilt = switch_plan(setup, Plan(precision="bf16-mixed"))
    assert rebuilt and new.optimizer is not old_optimizer
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(p.requires_grad for p in model.parameters())  # freezing lifted
    assert len(model._forward_pre_hooks) == 0 and "_memfit_bf16_inputs" not in model.__dict__
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), trained[n]), n  # the trained values, carried over
    # The new optimizer is a plain fp32 AdamW: its own step, no rounding context.
    assert "step" not in new.optimizer.__dict__ and "_memfit_bf16" not in new.optimizer.__dict__
    assert "_memfit_bf16" not in old_optimizer.__dict__  # the old one was unwrapped too
    new.step(_lm_batch())
    assert {s["exp_avg"].dtype for s in new.optimizer.state.values()} == {torch.float32}
    with pytest.raises(RuntimeError, match="plan was removed"):
        setup.step(_lm_batch())


def test_switching_keeps_a_callers_optimizer_with_its_state_in_the_new_dtype():
    model = tiny_gpt2(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prepared = memfit.prepare(model, Plan(precision="bf16-pure"), optimizer=opt)
    prepared.step(_lm_batch())
    assert opt.state[model.lm_head.weight]["exp_avg"].dtype == torch.bfloat16
    new, rebuilt = switch_plan(prepared.setup, Plan(precision="bf16-mixed", checkpointing="full"))
    assert not rebuilt and new.optimizer is opt and new.optimizer_given
    assert "step" not in opt.__dict__  # unwrapped: torch's own AdamW.step
    assert {s["exp_avg"].dtype for s in opt.state.values()} == {torch.float32}
    assert {int(s["step"]) for s in opt.state.values()} == {1}  # the state carried over
    new.step(_lm_batch())
    assert {int(s["step"]) for s in opt.state.values()} == {2}


def test_switches_that_leave_the_weights_alone_keep_the_optimizer():
    model = tiny_gpt2()
    setup = apply_plan(model, Plan(checkpointing="selective"))
    opt = setup.optimizer
    for plan in (
        Plan(checkpointing="selective", precision="bf16-mixed"),
        Plan(checkpointing="full", precision="fp16-mixed", max_grad_norm=1.0),
        Plan(max_seq_len=8, loss_normalization="tokens", sequence={"group_by_length": True}),
    ):
        setup, rebuilt = switch_plan(setup, plan)
        assert not rebuilt and setup.optimizer is opt and setup.plan == plan
        assert type(setup.precision).__name__ == {
            "fp32": "PrecisionRuntime", "bf16-mixed": "MixedRuntime",
            "fp16-mixed": "Fp16MixedRuntime"}[plan.precision.mode]  # fmt: skip
        assert setup.stepper.max_grad_norm == plan.max_grad_norm
        assert checkpointed_blocks(model) == (
            [] if plan.checkpointing.mode == "none" else ["transformer.h.0", "transformer.h.1"]
        )
        setup.step(_lm_batch())
    # The handles moved with the switches: removing the last setup takes everything off.
    setup.remove()
    assert "forward" not in model.transformer.h[0].__dict__
    assert "_memfit_checkpointing" not in model.__dict__


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
