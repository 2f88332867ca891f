"""build_optimizer, state_bytes, and behaviour shared by every memfit optimizer: a step under
FakeTensorMode and exact state_dict round trips."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from memfit.optim import (
    Adafactor,
    AdamW8bit,
    Lamb,
    Lars,
    OneBitAdam,
    StableEmbedding,
    build_optimizer,
    state_bytes,
)
from tests.optim._helpers import assert_state_dict_roundtrip, regression_task

MEMFIT = {
    "adamw8bit": {"lr": 1e-2, "min_8bit_size": 1024},
    "adafactor": {"beta1": 0.9},
    "lamb": {"lr": 1e-2, "weight_decay": 0.01},
    "lars": {"lr": 1.0, "eta": 0.02},
    "onebitadam": {"lr": 1e-2, "warmup_steps": 1},  # the later steps past the warm-up
}


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("adamw", torch.optim.AdamW),
        ("adam", torch.optim.Adam),
        ("sgd", torch.optim.SGD),
        ("adamw8bit", AdamW8bit),
        ("AdamW_8bit", AdamW8bit),
        ("adafactor", Adafactor),
        ("lamb", Lamb),
        ("LARS", Lars),
        ("onebit-adam", OneBitAdam),
    ],
)
def test_build_optimizer(name: str, cls: type) -> None:
    model = nn.Linear(4, 4)
    kwargs = {} if cls is Adafactor else {"lr": 0.5}
    opt = build_optimizer(name, model.parameters(), **kwargs)
    assert type(opt) is cls
    if kwargs:
        assert opt.param_groups[0]["lr"] == 0.5


def test_build_optimizer_unknown_name_lists_accepted() -> None:
    # The registry's sentence (memfit.optim.registry.get), one for every way to name one.
    with pytest.raises(ValueError, match="optimizer 'rmsprop' is not known") as info:
        build_optimizer("rmsprop", nn.Linear(2, 2).parameters())
    for name in ("adamw", "adam", "sgd", "adamw8bit", "adafactor", "lamb", "lars", "onebit-adam"):
        assert repr(name) in str(info.value)


def test_state_bytes_counts_each_storage_once() -> None:
    model = nn.Linear(100, 10)  # 1010 parameters
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    assert state_bytes(opt) == 0
    model(torch.randn(2, 100)).sum().backward()
    opt.step()
    # exp_avg + exp_avg_sq (fp32) and a 4-byte step tensor per parameter
    assert state_bytes(opt) == 8 * 1010 + 2 * 4
    base = torch.zeros(64)
    opt.state[model.weight]["extra"] = [base[:10], base[10:], {"again": base}]
    assert state_bytes(opt) == 8 * 1010 + 2 * 4 + 64 * 4
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    sgd.step()
    assert state_bytes(sgd) == 0


def test_state_bytes_orders_the_optimizers() -> None:
    sizes = {}
    for name in ("adamw", "adamw8bit", "adafactor"):
        torch.manual_seed(0)
        model = nn.Linear(512, 512)
        opt = build_optimizer(name, model.parameters())
        model(torch.randn(2, 512)).sum().backward()
        opt.step()
        sizes[name] = state_bytes(opt) / sum(p.numel() for p in model.parameters())
    assert sizes["adamw"] == pytest.approx(8.0, abs=0.01)
    assert sizes["adamw8bit"] < 2.1
    assert sizes["adafactor"] < 0.03  # (rows + cols + bias) * 4 bytes / 262656


@pytest.mark.parametrize("name", list(MEMFIT))
def test_step_under_fake_tensor_mode(name: str) -> None:
    with FakeTensorMode():
        model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 4))
        emb = StableEmbedding(50, 64)
        params = list(model.parameters()) + list(emb.parameters())
        opt = build_optimizer(name, params, **MEMFIT[name])
        for _ in range(2):  # the second step runs on existing state
            opt.zero_grad()
            model(emb(torch.randint(0, 50, (8,)))).pow(2).mean().backward()
            opt.step()
        weight = model[0].weight
        assert isinstance(weight, FakeTensor)
        assert all(
            isinstance(v, FakeTensor) for v in opt.state[weight].values() if torch.is_tensor(v)
        )
        assert state_bytes(opt) > 0
    if name == "adamw8bit":
        assert "exp_avg_codes" in opt.state[weight]  # really took the quantised path
        assert "exp_avg" in opt.state[emb.weight]


@pytest.mark.parametrize("name", list(MEMFIT))
def test_state_dict_roundtrip_every_optimizer(name: str) -> None:
    model, x, y = regression_task()
    assert_state_dict_roundtrip(
        lambda m: build_optimizer(name, m.parameters(), **MEMFIT[name]), model, x, y
    )
