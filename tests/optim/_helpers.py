"""Small models, a training loop and a state_dict round-trip check shared by the optim tests."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable

import torch
from torch import nn
from torch.optim import Optimizer


def regression_task(
    seed: int = 0, d_in: int = 32, d_hidden: int = 160, d_out: int = 8, n: int = 64
) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """An MLP (first weight has d_in * d_hidden = 5120 elements: above the 8-bit threshold) and
    a learnable regression target."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(d_in, d_hidden), nn.Tanh(), nn.Linear(d_hidden, d_out))
    x = torch.randn(n, d_in)
    teacher = nn.Linear(d_in, d_out)
    with torch.no_grad():
        y = teacher(x) + 0.1 * torch.randn(n, d_out)
    return model, x, y


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x).float(), y)


def train(
    model: nn.Module, opt: Optimizer, x: torch.Tensor, y: torch.Tensor, steps: int
) -> list[float]:
    """Full-batch training; returns the loss before each step."""
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@torch.no_grad()
def max_abs_diff(a: nn.Module, b: nn.Module) -> float:
    return max(
        (p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


@torch.no_grad()
def relative_deviation(model: nn.Module, reference: nn.Module, start: nn.Module) -> float:
    """||model - reference|| / ||reference - start|| over all parameters (trajectory error)."""
    num = sum(
        ((p - q).double() ** 2).sum()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    )
    den = sum(
        ((p - q).double() ** 2).sum()
        for p, q in zip(reference.parameters(), start.parameters(), strict=True)
    )
    return float((num / den).sqrt())


def assert_state_dict_roundtrip(
    make_opt: Callable[[nn.Module], Optimizer],
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    steps_before: int = 4,
    steps_after: int = 4,
) -> Optimizer:
    """Train, save model + optimizer through torch.save, restore into fresh objects, continue
    both runs and require bit-identical parameters.  Returns the restored optimizer."""
    opt = make_opt(model)
    train(model, opt, x, y, steps_before)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)

    restored_model = copy.deepcopy(model)
    with torch.no_grad():
        for p in restored_model.parameters():
            p.add_(1.0)  # make sure the load really overwrites everything
    restored_model.load_state_dict(saved["model"])
    restored_opt = make_opt(restored_model)
    restored_opt.load_state_dict(saved["opt"])

    for key, value in opt.state_dict()["state"].items():
        for name, tensor in value.items():
            if isinstance(tensor, torch.Tensor):
                got = restored_opt.state_dict()["state"][key][name]
                assert got.dtype == tensor.dtype, (name, got.dtype, tensor.dtype)

    train(model, opt, x, y, steps_after)
    train(restored_model, restored_opt, x, y, steps_after)
    for p, q in zip(model.parameters(), restored_model.parameters(), strict=True):
        assert torch.equal(p, q)
    return restored_opt
