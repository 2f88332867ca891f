"""The shared warm-up-then-decay formula: values at known steps, and the Trainer uses it."""

from __future__ import annotations

import math

import pytest

from memfit.optim.schedule import LR_SCHEDULES, lr_factor
from memfit.train import schedule as train_schedule


@pytest.mark.parametrize(
    ("schedule", "want"),
    [
        # warm-up 2 steps, then 8 steps of decay (max_steps=10): steps 0..10.
        ("constant", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
        ("linear", [0.5, 1.0, 1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125, 0.0]),
        ("poly", [0.5, 1.0, 1.0, 0.875**2, 0.75**2, 0.625**2, 0.25, 0.375**2, 0.0625,
                  0.125**2, 0.0]),
        ("cosine", [0.5, 1.0] + [0.5 * (1 + math.cos(math.pi * k / 8)) for k in range(9)]),
    ],
)
def test_values_at_known_steps(schedule, want):
    got = [
        lr_factor(s, schedule=schedule, warmup_steps=2, max_steps=10, power=2.0)
        for s in range(11)
    ]
    assert got == pytest.approx(want, abs=1e-12)


def test_poly_power_one_is_linear_and_past_the_end_stays_at_zero():
    kw = {"warmup_steps": 3, "max_steps": 20}
    for step in range(25):
        assert lr_factor(step, schedule="poly", power=1.0, **kw) == pytest.approx(
            lr_factor(step, schedule="linear", **kw), abs=1e-12
        )
    assert lr_factor(50, schedule="cosine", **kw) == pytest.approx(0.0, abs=1e-12)


def test_no_warmup_starts_at_the_peak():
    assert lr_factor(0, schedule="cosine", warmup_steps=0, max_steps=10) == 1.0


def test_unknown_schedule_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="schedule 'step' is not known; use one of cosine"):
        lr_factor(5, schedule="step", warmup_steps=0, max_steps=10)
    assert set(LR_SCHEDULES) >= {"cosine", "linear", "constant", "poly"}


def test_the_trainer_schedules_with_this_formula():
    assert train_schedule.lr_factor is lr_factor
