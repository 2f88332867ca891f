"""memfit's optimizers measure the same in dry runs (fake tensors) as in real runs."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import memfit
from memfit.optim import Adafactor, AdamW8bit


def _peak(make_opt, fake: bool) -> dict[str, int]:
    mode = FakeTensorMode() if fake else contextlib.nullcontext()
    with mode:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 64))
        opt = make_opt(model.parameters())
        x = torch.randn(16, 256)
        with memfit.track(model, opt) as tr:
            tr.add_inputs(x)
            for _ in range(2):
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
    return tr.report().peak_by_category


@pytest.mark.parametrize(
    "make_opt",
    [
        # Many chunks per tensor: a dry run steps only the first and last one.
        lambda ps: AdamW8bit(ps, chunk_size=4096),
        lambda ps: Adafactor(ps, lr=1e-3, relative_step=False, chunk_size=4096),
    ],
    ids=["adamw8bit", "adafactor"],
)
def test_dry_run_equals_real_run(make_opt):
    # The first real step builds the 8-bit code maps' lookup tables once per process; warm up
    # so both runs see the same process state.
    _peak(make_opt, fake=False)
    fake, real = _peak(make_opt, fake=True), _peak(make_opt, fake=False)
    # A real step also touches the code maps' lookup tables, built once per process and
    # shared by every optimizer (a few KiB, counted as "other"); a fake step makes its own.
    assert real.pop("other") <= 4096 and fake.pop("other") <= 4096
    assert fake == real
