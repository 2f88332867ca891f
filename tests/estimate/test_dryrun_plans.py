"""Dry run = real run under every plan mode, category by category."""

from __future__ import annotations

import pytest

import memfit
from memfit.plan import Plan

PLANS = {
    "accumulation": Plan(grad_accum_steps=2),
    "tokens": Plan(grad_accum_steps=2, loss_normalization="tokens"),
    "full": Plan(checkpointing="full"),
    "selective": Plan(checkpointing="selective"),
    "sqrt": Plan(checkpointing="sqrt"),
    "budget": Plan(checkpointing={"mode": "budget", "budget_bytes": 64 * 1024}),
    "bf16-mixed": Plan(precision="bf16-mixed"),
    "fp16-mixed": Plan(precision="fp16-mixed"),
    "bf16-pure": Plan(precision="bf16-pure"),
    "adafactor": Plan(optimizer="adafactor"),
    "lamb": Plan(optimizer="lamb"),
    "lars": Plan(optimizer="lars"),
    "sgd": Plan(optimizer="sgd"),
    "foreach": Plan(optimizer={"name": "adamw", "foreach": True}),
    "fused-step": Plan(optimizer_in_backward=True),
    "fused-exact-clip": Plan(optimizer_in_backward=True, max_grad_norm=1.0),
    "fused-approx-clip": Plan(optimizer_in_backward=True, max_grad_norm=1.0,
                              grad_clip_mode="approx"),
    "clip": Plan(max_grad_norm=1.0),
    "freeze-body": Plan(freeze=("body",)),
    "freeze-embeddings": Plan(freeze=("embeddings",)),
    "max-seq-len": Plan(max_seq_len=16),
    "best": Plan(precision="bf16-pure", optimizer="adafactor", optimizer_in_backward=True,
                 checkpointing="full"),
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_dry_run_equals_real_run_under_plan(name):
    plan = PLANS[name]
    real = memfit.measure("gpt2-tiny", plan, batch_size=4, seq_len=32, steps=2)
    dry = memfit.dry_run("gpt2-tiny", plan, batch_size=4, seq_len=32, steps=2)
    assert dry.peak_by_category == real.peak_by_category
    assert dry.phase_peaks == real.phase_peaks


def test_dry_run_equals_real_run_with_8bit_adamw():
    plan = Plan(optimizer="adamw8bit")
    memfit.measure("gpt2-tiny", plan, batch_size=4, seq_len=32, steps=1)  # build code maps
    real = memfit.measure("gpt2-tiny", plan, batch_size=4, seq_len=32, steps=2)
    dry = memfit.dry_run("gpt2-tiny", plan, batch_size=4, seq_len=32, steps=2)
    # A real step reads the 8-bit code maps' lookup tables, built once per process and shared
    # by every optimizer ("other", a few KiB); a fake step makes its own (see
    # tests/optim/test_dry_run_optimizers.py). Everything else is identical.
    real_cats, dry_cats = dict(real.peak_by_category), dict(dry.peak_by_category)
    assert real_cats.pop("other") <= 4096 and dry_cats.pop("other") <= 4096
    assert real_cats == dry_cats


@pytest.mark.parametrize(
    "plan",
    [
        Plan(optimizer="adafactor", grad_accum_steps=2),
        Plan(optimizer="adamw8bit", precision="bf16-mixed"),
        Plan(precision="bf16-pure", optimizer="adafactor", optimizer_in_backward=True),
    ],
    ids=["adafactor-accum", "adamw8bit-bf16-mixed", "adafactor-fused-step"],
)
def test_replayed_optimizer_updates_leave_the_report_as_dispatching_them(plan, monkeypatch):
    # memfit.accounting.replay: a dry run replays repeated parameter updates instead of
    # dispatching them; every figure of the report, the GPU allocator's reserved peak included,
    # is what dispatching them all gives.
    from memfit.accounting import replay

    done: list[bool] = []
    real_replay = replay.Recording.replay

    def counting(self):
        done.append(real_replay(self))
        return done[-1]

    monkeypatch.setattr(replay.Recording, "replay", counting)
    replayed = memfit.dry_run("gpt2-tiny", plan, batch_size=4, seq_len=32, device="h100")
    assert sum(done) > 0  # some updates were replayed
    monkeypatch.setattr(replay, "begin", lambda key: None)
    dispatched = memfit.dry_run("gpt2-tiny", plan, batch_size=4, seq_len=32, device="h100")
    assert replayed.peak_reserved_bytes == dispatched.peak_reserved_bytes
    assert replayed.peak_by_category == dispatched.peak_by_category
    assert replayed.phase_peaks == dispatched.phase_peaks
    assert replayed.num_ops == dispatched.num_ops
    assert replayed.timeline == dispatched.timeline
    assert replayed.by_module == dispatched.by_module
