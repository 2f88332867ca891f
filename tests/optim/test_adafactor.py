"""Adafactor against transformers.optimization.Adafactor, step by step, in several settings."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from memfit.optim import Adafactor, state_bytes
from tests.optim._helpers import assert_state_dict_roundtrip, loss_fn, regression_task, train

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from transformers.optimization import Adafactor as HFAdafactor

# Same math; ours folds eps1 into the means, clipping into the step size and keeps the step
# size as a tensor (no host sync), which changes the last bits of some results.
RTOL, ATOL = 1e-5, 1e-7


class ConvNet(nn.Module):
    """Has a 4-D conv weight (factored over the last two dims), matrices and vectors."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)
        self.fc = nn.Linear(4 * 4 * 4, 8)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.conv(x)).flatten(1)) * self.scale


SETTINGS = {
    "defaults": {},
    "relative_step_off": {"lr": 1e-2, "relative_step": False},
    "beta1": {"beta1": 0.9},
    "beta1_fixed_lr_no_scale": {
        "lr": 1e-2,
        "relative_step": False,
        "beta1": 0.9,
        "scale_parameter": False,
    },
    "warmup_init": {"warmup_init": True},
    "weight_decay_clip": {"weight_decay": 0.1, "clip_threshold": 0.5, "decay_rate": -0.5},
}


@pytest.mark.parametrize("setting", list(SETTINGS), ids=list(SETTINGS))
def test_matches_transformers_step_by_step(setting: str) -> None:
    kwargs = SETTINGS[setting]
    torch.manual_seed(0)
    model = ConvNet()
    twin = copy.deepcopy(model)
    x, y = torch.randn(8, 2, 6, 6), torch.randn(8, 8)
    ours = Adafactor(model.parameters(), **kwargs)
    theirs = HFAdafactor(twin.parameters(), **kwargs)
    for _ in range(10):
        for m, opt in ((model, ours), (twin, theirs)):
            opt.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        for key, value in theirs.state[q].items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(ours.state[p][key], value, rtol=RTOL, atol=1e-9)
            else:
                assert ours.state[p][key] == value


def test_factored_state_is_rows_plus_columns() -> None:
    w = nn.Parameter(torch.randn(256, 512))
    b = nn.Parameter(torch.randn(512))
    opt = Adafactor([w, b])
    w.grad, b.grad = torch.randn_like(w), torch.randn_like(b)
    opt.step()
    assert opt.state[w]["exp_avg_sq_row"].shape == (256,)
    assert opt.state[w]["exp_avg_sq_col"].shape == (512,)
    assert "exp_avg_sq" not in opt.state[w] and "exp_avg" not in opt.state[w]
    assert opt.state[b]["exp_avg_sq"].shape == (512,)
    # rows + cols + vector second moment + two RMS scalars, all fp32
    assert state_bytes(opt) == 4 * (256 + 512 + 512 + 2)


def test_bf16_parameters_use_fp32_state() -> None:
    model, x, y = regression_task()
    reference = copy.deepcopy(model)
    model = model.to(torch.bfloat16)
    opt = Adafactor(model.parameters(), beta1=0.9)
    losses = train(model, opt, x.bfloat16(), y, 10)
    train(reference, Adafactor(reference.parameters(), beta1=0.9), x, y, 10)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert opt.state[model[0].weight]["exp_avg_sq_row"].dtype == torch.float32
    assert opt.state[model[0].weight]["exp_avg"].dtype == torch.float32
    assert losses[-1] < losses[0]
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.float(), q, rtol=0.02, atol=0.02)


def test_argument_validation_like_transformers() -> None:
    params = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="both lr and relative_step=True"):
        Adafactor(params, lr=1e-3, relative_step=True)
    with pytest.raises(ValueError, match="warmup_init"):
        Adafactor(params, lr=1e-3, relative_step=False, warmup_init=True)


def test_grad_none_and_sparse() -> None:
    a, b = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4))
    opt = Adafactor([a, b])
    a.grad = torch.randn_like(a)
    opt.step()
    assert b not in opt.state
    emb = nn.Embedding(10, 4, sparse=True)
    opt = Adafactor(emb.parameters())
    emb(torch.tensor([1])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


def test_works_with_transformers_adafactor_schedule() -> None:
    from transformers.optimization import AdafactorSchedule

    model, x, y = regression_task()
    opt = Adafactor(model.parameters())
    schedule = AdafactorSchedule(opt)
    train(model, opt, x, y, 3)
    schedule.step()
    (lr,) = {float(v) for v in schedule.get_lr()}
    rms = float(opt.state[model[0].weight]["RMS"])
    assert lr == pytest.approx(max(1e-3, rms) * 1e-2)


@pytest.mark.parametrize("beta1", [None, 0.9])
def test_state_dict_roundtrip(beta1: float | None) -> None:
    model, x, y = regression_task()
    assert_state_dict_roundtrip(lambda m: Adafactor(m.parameters(), beta1=beta1), model, x, y)
    assert loss_fn(model, x, y).item() > 0



def test_given_lr_is_a_fixed_step_size_like_torch() -> None:
    """``Adafactor(params, lr=...)`` works (torch's convention): relative_step is off, and the
    result equals spelling ``relative_step=False`` out; without lr the relative step is on."""
    torch.manual_seed(0)
    a = nn.Parameter(torch.randn(4, 3))
    b = nn.Parameter(a.detach().clone())
    short = Adafactor([a], lr=1e-2)
    spelled = Adafactor([b], lr=1e-2, relative_step=False)
    assert short.defaults["relative_step"] is False
    assert Adafactor([nn.Parameter(torch.zeros(2))]).defaults["relative_step"] is True
    for _ in range(3):
        for p, opt in ((a, short), (b, spelled)):
            p.grad = torch.ones_like(p)
            opt.step()
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(a, torch.zeros_like(a))
