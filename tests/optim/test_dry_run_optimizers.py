"""memfit's optimizers measure the same in dry runs (fake tensors) as in real runs."""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import memfit
from memfit.optim import Adafactor, AdamW8bit


def _report(make_opt, fake: bool, widths=(256, 512, 64), batch: int = 16):
    """Two steps of a stack of linear layers of ``widths``, tracked (on fake tensors or real)."""
    mode = FakeTensorMode() if fake else contextlib.nullcontext()
    with mode:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            *[torch.nn.Linear(a, b) for a, b in itertools.pairwise(widths)]
        )
        opt = make_opt(model.parameters())
        x = torch.randn(batch, widths[0])
        with memfit.track(model, opt) as tr:
            tr.add_inputs(x)
            for _ in range(2):
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
    return tr.report()


def _peak(make_opt, fake: bool) -> dict[str, int]:
    return _report(make_opt, fake).peak_by_category


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


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: AdamW8bit(ps, chunk_size=4096),
        lambda ps: Adafactor(ps, lr=1e-3, relative_step=False),
        lambda ps: Adafactor(ps, lr=1e-3, relative_step=False, beta1=0.9, chunk_size=4096),
    ],
    ids=["adamw8bit", "adafactor", "adafactor-momentum-chunked"],
)
def test_dry_run_replays_repeated_updates_and_still_equals_the_real_run(make_opt, monkeypatch):
    # Eight layers of one shape: a dry run dispatches the first update of each kind per step
    # and replays the rest (memfit.accounting.replay); the report is the real run's.
    from memfit.accounting import replay

    replayed = []
    real_replay = replay.Recording.replay

    def counting(self):
        done = real_replay(self)
        replayed.append(done)
        return done

    monkeypatch.setattr(replay.Recording, "replay", counting)

    def run(fake: bool):
        return _report(make_opt, fake, widths=(128,) * 9)

    run(False)  # builds the 8-bit code maps' tables once per process
    real = run(False)
    assert not replayed  # real tensors are always updated
    fake = run(True)
    assert sum(replayed) >= 2 * 2 * 6  # per step: 8 weights and 8 biases, 2 kinds recorded
    real_cats, fake_cats = dict(real.peak_by_category), dict(fake.peak_by_category)
    assert real_cats.pop("other") <= 4096 and fake_cats.pop("other") <= 4096
    assert fake_cats == real_cats
    # Against a dry run that dispatches every update: the same trace, op for op.
    monkeypatch.setattr(replay, "begin", lambda key: None)
    dispatched = run(True)
    assert fake.num_ops == dispatched.num_ops
    assert fake.timeline == dispatched.timeline
