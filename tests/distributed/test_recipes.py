"""Large-batch recipes: the scaled learning rate and warm-up, the schedule, the optimizer, the
refusals, two processes on a global batch, and LAMB at 8x the batch keeping AdamW's loss."""

from __future__ import annotations

import math

import pytest
import torch

from memfit import Plan
from memfit.apply.compose import apply_plan
from memfit.distributed.recipes import (
    LargeBatchRecipe,
    ScaledSchedule,
    build_optimizer,
    build_scheduler,
    lr_lambda,
    optimizer_config,
    scale_for_batch,
)
from memfit.optim import Lamb, Lars

from ..models import Stack
from .harness import run_ranks


def _recipe(**kw) -> LargeBatchRecipe:
    return LargeBatchRecipe(**{"base_lr": 0.1, "base_batch_size": 32, "warmup_steps": 80, **kw})


# ----------------------------------------------------------------------------- scaling


@pytest.mark.parametrize(
    ("scaling", "batch", "want_lr"),
    [
        ("linear", 256, 0.8),
        ("linear", 48, 0.15),  # not a multiple of the base batch
        ("linear", 16, 0.05),  # smaller than the base: scaled down
        ("sqrt", 256, 0.1 * math.sqrt(8)),
        ("sqrt", 128, 0.2),
        ("sqrt", 32, 0.1),
    ],
)
def test_lr_scales_linearly_or_by_the_square_root(scaling, batch, want_lr):
    lr, _ = scale_for_batch(_recipe(scaling=scaling), batch)
    assert lr == pytest.approx(want_lr, rel=1e-12)


def test_warmup_steps_keep_the_samples_of_the_base_batch():
    # 80 steps of 32 samples = 2560 samples: 10 steps of 256, 26.7 -> 27 steps of 96.
    assert scale_for_batch(_recipe(), 256) == ScaledSchedule(lr=pytest.approx(0.1 * 8**0.5), warmup_steps=10)
    assert scale_for_batch(_recipe(), 96).warmup_steps == 27
    assert scale_for_batch(_recipe(), 32).warmup_steps == 80
    assert scale_for_batch(_recipe(), 16).warmup_steps == 160
    # A tiny warm-up never rounds away at a huge batch; none stays none.
    assert scale_for_batch(_recipe(warmup_steps=1), 4096).warmup_steps == 1
    assert scale_for_batch(_recipe(warmup_steps=0), 4096).warmup_steps == 0


def test_warmup_epochs_are_samples_of_an_epoch():
    recipe = _recipe(warmup_steps=None, warmup_epochs=0.1)
    # 0.1 epoch of 2560 samples = 256 samples: exactly one step of 256 (no rounding up).
    assert scale_for_batch(recipe, 256, samples_per_epoch=2560).warmup_steps == 1
    assert scale_for_batch(recipe, 32, samples_per_epoch=2560).warmup_steps == 8
    assert scale_for_batch(recipe, 100, samples_per_epoch=2560).warmup_steps == 3


# ----------------------------------------------------------------------------- schedule


def test_lr_lambda_warms_up_then_decays():
    recipe = _recipe(warmup_steps=16, schedule="poly", power=2.0)
    # At 128 samples a step: 16 * 32 / 128 = 4 warm-up steps, then 8 steps of decay.
    factor = lr_lambda(recipe, 128, total_steps=12)
    got = [factor(s) for s in range(13)]
    want = [0.25, 0.5, 0.75, 1.0] + [(1 - k / 8) ** 2 for k in range(9)]
    assert got == pytest.approx(want, abs=1e-12)


def test_scheduler_drives_the_optimizer_lr_step_by_step():
    recipe = _recipe(scaling="linear", warmup_steps=8, schedule="cosine", optimizer="lars")
    param = torch.nn.Parameter(torch.ones(3, 3))
    opt = build_optimizer(recipe, [param], 64)
    sched = build_scheduler(opt, recipe, 64, total_steps=6)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        param.grad = torch.ones_like(param)
        opt.step()
        sched.step()
    # Peak 0.2 (linear x2), 4 warm-up steps, then 2 steps of a half cosine over 2 steps.
    want = [0.05, 0.1, 0.15, 0.2, 0.2, 0.2 * 0.5 * (1 + math.cos(math.pi / 2))]
    assert lrs == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize(("name", "cls"), [("lamb", Lamb), ("lars", Lars), ("adamw", torch.optim.AdamW)])
def test_build_optimizer_has_the_scaled_lr_and_the_recipe_settings(name, cls):
    recipe = _recipe(optimizer=name, weight_decay=0.05, optimizer_kwargs={"eps": 1e-7} if name != "lars" else {"eta": 0.002})
    opt = build_optimizer(recipe, torch.nn.Linear(2, 2).parameters(), 512)
    assert type(opt) is cls
    group = opt.param_groups[0]
    assert group["lr"] == pytest.approx(0.4)  # sqrt(512 / 32) = 4
    assert group["weight_decay"] == 0.05
    assert group["eps" if name != "lars" else "eta"] == (1e-7 if name != "lars" else 0.002)
    config = optimizer_config(recipe, 512)
    assert (config.name, config.lr, config.kwargs["weight_decay"]) == (name, pytest.approx(0.4), 0.05)


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"optimizer": "sgd"}, "optimizer 'sgd' is not known; use one of lamb, lars, adamw"),
        ({"scaling": "log"}, "scaling 'log' is not known; use one of linear, sqrt"),
        ({"schedule": "step"}, "schedule 'step' is not known"),
        ({"base_lr": 0.0}, "base_lr must be a number > 0, got 0.0"),
        ({"base_lr": float("nan")}, "base_lr must be a number > 0"),
        ({"base_batch_size": 0}, "base_batch_size must be a whole number >= 1, got 0"),
        ({"base_batch_size": 32.0}, "base_batch_size must be a whole number >= 1, got 32.0"),
        ({"warmup_steps": -1}, "warmup_steps must be a whole number >= 0, got -1"),
        ({"warmup_steps": None, "warmup_epochs": -0.5}, "warmup_epochs must be a number >= 0"),
        ({"warmup_epochs": 1.0}, "give exactly one of warmup_steps and warmup_epochs"),
        ({"warmup_steps": None}, "give exactly one of warmup_steps and warmup_epochs"),
        ({"power": 0}, "power must be a number > 0, got 0"),
        ({"weight_decay": -0.1}, "weight_decay must be a number >= 0, got -0.1"),
        ({"optimizer_kwargs": {"lr": 1.0}}, "optimizer_kwargs must not set lr"),
    ],
)
def test_bad_recipe_is_refused_in_one_sentence(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        _recipe(**kwargs)


@pytest.mark.parametrize("batch", [0, -8, 2.5, True])
def test_bad_batch_is_refused(batch):
    with pytest.raises(ValueError, match="batch_size must be a whole number >= 1"):
        scale_for_batch(_recipe(), batch)


def test_warmup_epochs_need_the_epoch_size():
    recipe = _recipe(warmup_steps=None, warmup_epochs=1.0)
    with pytest.raises(ValueError, match="samples_per_epoch is needed"):
        scale_for_batch(recipe, 64)
    with pytest.raises(ValueError, match="samples_per_epoch must be a whole number >= 1, got 0"):
        scale_for_batch(recipe, 64, samples_per_epoch=0)
    with pytest.raises(ValueError, match="total_steps must be a whole number >= 1, got 0"):
        lr_lambda(_recipe(), 64, total_steps=0)


# ----------------------------------------------------------------------------- data parallel

GLOBAL_BATCH = 8
STEPS = 4


def _train_with_recipe(parallel: dict) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    recipe = _recipe(optimizer="lamb", base_lr=0.01, base_batch_size=2, warmup_steps=4)
    plan = Plan(optimizer=optimizer_config(recipe, GLOBAL_BATCH), parallel=parallel)
    torch.manual_seed(0)
    model = Stack()
    setup = apply_plan(model, plan)
    sched = build_scheduler(setup.optimizer, recipe, GLOBAL_BATCH, total_steps=STEPS)
    g = torch.Generator().manual_seed(1)
    losses, lrs = [], []
    for _ in range(STEPS):
        batch = {"x": torch.randn(GLOBAL_BATCH, 12, generator=g),
                 "y": torch.randn(GLOBAL_BATCH, 5, generator=g)}
        lrs.append(setup.optimizer.param_groups[0]["lr"])
        losses.append(float(setup.step(batch)))
        sched.step()
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for n, p in model.named_parameters()}
    return losses, lrs, params


def _rank(rank: int, world: int, stage: int):
    return _train_with_recipe({"data": world, "zero_stage": stage})


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [0, 2])
def test_two_processes_follow_the_recipe_like_one_on_the_global_batch(stage):
    results = run_ranks(_rank, 2, stage, timeout=180)
    want_losses, want_lrs, want = _train_with_recipe({})
    # Global batch 8 from base 2: lr 0.01 * sqrt(4) = 0.02; 4 * 2 / 8 = 1 warm-up step.
    assert want_lrs[:2] == pytest.approx([0.02, 0.02])
    for losses, lrs, params in results:
        assert lrs == pytest.approx(want_lrs, rel=1e-12)
        assert losses == pytest.approx(want_losses, rel=1e-5, abs=1e-6)
        for name, value in want.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=name)


# ----------------------------------------------------------------------------- the claim

BASE_CLAIM_BATCH = 16


def _teacher_task(samples: int, held_out: int) -> tuple[torch.Tensor, ...]:
    # 16-d Gaussian inputs, 10 classes given by a random tanh teacher (as the benchmark's).
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples + held_out, 16, generator=g)
    w1 = torch.randn(16, 32, generator=g) / 4
    w2 = torch.randn(32, 10, generator=g) / math.sqrt(32)
    y = (torch.tanh(x @ w1) @ w2).argmax(1)
    return x[:samples], y[:samples], x[samples:], y[samples:]


def _fit(recipe: LargeBatchRecipe, batch: int, epochs: int, data) -> tuple[float, float]:
    x, y, x_test, y_test = data
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                torch.nn.ReLU(), torch.nn.Linear(64, 10))
    steps = len(x) // batch
    opt = build_optimizer(recipe, model.parameters(), batch, samples_per_epoch=len(x))
    sched = build_scheduler(opt, recipe, batch, total_steps=steps * epochs,
                            samples_per_epoch=len(x))
    order = torch.Generator().manual_seed(2)
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=order)
        for i in range(steps):
            idx = perm[i * batch:(i + 1) * batch]
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    with torch.no_grad():
        ce = torch.nn.functional.cross_entropy
        return ce(model(x), y).item(), ce(model(x_test), y_test).item()


def test_lamb_at_8x_the_batch_keeps_adamws_loss_in_the_same_epochs():
    data = _teacher_task(8192, 2048)
    base, epochs = BASE_CLAIM_BATCH, 4

    def recipe(optimizer: str, base_batch: int) -> LargeBatchRecipe:
        return LargeBatchRecipe(optimizer=optimizer, base_lr=3e-3, base_batch_size=base_batch,
                                scaling="linear", warmup_epochs=0.5, schedule="cosine")

    adamw_train, adamw_test = _fit(recipe("adamw", base), base, epochs, data)
    lamb_train, lamb_test = _fit(recipe("lamb", base), 8 * base, epochs, data)
    # 8x fewer steps, the same epochs: within 2% of AdamW's held-out loss, 5% of its training
    # loss (benchmarks/results/large_batch.md has the full-size grid).
    assert lamb_test <= 1.02 * adamw_test, (lamb_test, adamw_test)
    assert lamb_train <= 1.05 * adamw_train, (lamb_train, adamw_train)
    # The recipe's scaling is what does it: the same LAMB at 8x the batch with the base lr
    # unscaled (as if 3e-3 had been tuned at the large batch) stays far behind.
    unscaled_train, _ = _fit(recipe("lamb", 8 * base), 8 * base, epochs, data)
    assert unscaled_train > 1.5 * adamw_train, (unscaled_train, adamw_train)
