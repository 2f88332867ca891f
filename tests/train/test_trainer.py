"""The Trainer: falling loss, data kinds, schedules, evaluation, progress and the report."""

from __future__ import annotations

import io
import math

import pytest
import torch

from memfit.plan import Plan
from memfit.train import Trainer
from memfit.train.data import collate, train_eval_split
from memfit.train.trainer import build_scheduler, evaluate, lr_factor
from memfit.workload import load_workload

from ._helpers import text_dataset, tiny_gpt2


def test_loss_falls_on_a_tiny_model():
    train, held = train_eval_split(text_dataset(), 0.1)
    trainer = Trainer(
        tiny_gpt2(),
        Plan(micro_batch_size=4, grad_accum_steps=2),
        train,
        eval_data=held,
        batch_size=8,
        lr=1e-2,
        warmup_steps=3,
        max_steps=25,
        eval_every=10,
        progress=False,
    )
    result = trainer.fit()
    assert result.steps == 25 and len(result.losses) == 25
    assert result.first_loss > 5.0  # about ln(259): nothing learnt yet
    assert result.final_loss < result.first_loss - 1.5
    assert [s for s, _ in result.eval_losses] == [10, 20, 25]
    assert result.eval_losses[-1][1] < result.eval_losses[0][1]
    assert result.peak_bytes == result.report.peak_bytes > 0
    assert result.report.peak_by_category["activations"] > 0
    assert result.tokens == 25 * 8 * 32
    assert result.plan["micro_batch_size"] == 4
    assert result.step_downs == []
    data = result.to_dict()
    assert data["first_loss"] == result.first_loss and "peak_by_category" in data


def test_workload_without_data_trains_on_its_own_batches():
    workload = load_workload("gpt2-tiny", batch_size=2, seq_len=16)
    result = Trainer(workload, max_steps=2, progress=False).fit()
    assert result.steps == 2 and all(math.isfinite(x) for x in result.losses)


def test_iterable_of_batches():
    ds = text_dataset()
    batches = [collate([ds[i] for i in range(j, j + 4)]) for j in range(0, 12, 4)]
    trainer = Trainer(tiny_gpt2(), None, torch.utils.data.DataLoader(batches, batch_size=None), max_steps=5, progress=False)
    assert trainer.fit().steps == 5  # three batches, re-iterated


def test_lr_schedule_shapes():
    kw = dict(warmup_steps=2, max_steps=10)
    assert [lr_factor(s, schedule="constant", **kw) for s in (0, 1, 5)] == [0.5, 1.0, 1.0]
    assert lr_factor(2, schedule="cosine", **kw) == pytest.approx(1.0)
    assert lr_factor(6, schedule="cosine", **kw) == pytest.approx(0.5)
    assert lr_factor(6, schedule="linear", **kw) == pytest.approx(0.5)
    assert lr_factor(10, schedule="linear", **kw) == 0.0
    with pytest.raises(ValueError, match="schedule"):
        build_scheduler(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), "step")


@pytest.mark.parametrize(
    ("fused", "offload"),
    [(False, None), (True, None), (False, "host"), (True, "host")],
    ids=["optimizer", "optimizer-in-backward", "offload", "offload-in-backward"],
)
def test_lr_override_and_schedule_reach_the_optimizer(fused, offload):
    lrs = []
    trainer = Trainer(
        tiny_gpt2(),
        Plan(optimizer_in_backward=fused, offload=offload),
        text_dataset(),
        batch_size=4,
        lr=0.02,
        schedule="linear",
        warmup_steps=0,
        max_steps=4,
        progress=False,
        on_step=lambda info: lrs.append(trainer.optimizer.param_groups[0]["lr"]),
    )
    trainer.fit()
    assert trainer.plan.optimizer.lr == 0.02
    assert lrs == pytest.approx([0.015, 0.01, 0.005, 0.0])
    if fused and offload is None:
        inner = trainer.optimizer.optimizers[0].param_groups[0]["lr"]
        assert inner == pytest.approx(0.0)
    if offload is not None:  # the host optimizer is the one scheduled
        assert trainer.optimizer.optimizer.param_groups[0]["lr"] == pytest.approx(0.0)


def test_progress_prints_the_memory_table_and_writes_the_plot(tmp_path):
    from rich.console import Console

    buffer = io.StringIO()
    png = tmp_path / "memory.png"
    Trainer(
        tiny_gpt2(),
        None,
        text_dataset(),
        batch_size=4,
        max_steps=2,
        console=Console(file=buffer, width=120),
        report_png=png,
    ).fit()
    text = buffer.getvalue()
    assert "optimizer_state" in text and "Peak by phase" in text
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_evaluate_weights_by_label_tokens():
    model = tiny_gpt2()
    ds = text_dataset()
    batch = collate([ds[0], ds[1]])
    whole = evaluate(model, [batch])
    halves = evaluate(model, [batch], micro_batch_size=1)
    assert halves == pytest.approx(whole, rel=1e-5)
    assert model.training  # restored after evaluation


def test_bad_arguments():
    with pytest.raises(ValueError, match="schedule"):
        Trainer(tiny_gpt2(), None, text_dataset(), schedule="step")
    with pytest.raises(ValueError, match="max_steps"):
        Trainer(tiny_gpt2(), None, text_dataset(), max_steps=0)
    with pytest.raises(ValueError, match="needs train_data"):
        Trainer(tiny_gpt2())
    with pytest.raises(TypeError, match=r"Workload or a torch\.nn\.Module"):
        Trainer("gpt2-tiny")
