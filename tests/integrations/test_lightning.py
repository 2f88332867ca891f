"""The Lightning integration: a stock ``lightning.Trainer`` trains under a plan, and its
tracked peak is the dry run's prediction."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import memfit
from memfit import Plan, PlanError
from memfit.workload import Workload

L = pytest.importorskip("lightning")
transformers = pytest.importorskip("transformers")

from memfit.integrations.lightning import MemfitCallback, trainer_kwargs  # noqa: E402

BATCH, SEQ, VOCAB = 4, 16, 64


def tiny_gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    cfg._attn_implementation = "eager"
    return transformers.GPT2LMHeadModel(cfg)


def batches(n: int, size: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    # A learnable pattern (each sequence repeats one short motif) so the loss falls fast.
    out = []
    for _ in range(n):
        motif = torch.randint(0, VOCAB, (size, 4), generator=g)
        ids = motif.repeat(1, SEQ // 4)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


class _Fresh(torch.utils.data.Dataset):
    def __init__(self, makers):
        self.makers = makers

    def __len__(self):
        return len(self.makers)

    def __getitem__(self, i):
        return self.makers[i]()


class Module(L.LightningModule):
    def __init__(self, model: nn.Module, callback) -> None:
        super().__init__()
        self.model = model
        self.callback = callback
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return self.callback.configure_optimizers(self)


def fit(model, plan, data, tmp_path=None, **extra):
    cb = MemfitCallback(plan, report_dir=None if tmp_path is None else tmp_path / "report")
    module = Module(model, cb)
    trainer = L.Trainer(
        max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", devices=1,
        callbacks=[cb], **{**trainer_kwargs(plan), **extra},
    )
    # batch_size=None: the batches are already made (each one a micro-batch); cloned on
    # access, as a real loader makes new tensors, so a used batch dies after its step.
    fresh = [lambda b=b: {k: v.clone() for k, v in b.items()} for b in data]
    loader = torch.utils.data.DataLoader(_Fresh(fresh), batch_size=None)
    trainer.fit(module, train_dataloaders=loader)
    return module, cb, trainer


def test_trainer_kwargs_carry_plan_fields():
    plan = Plan(grad_accum_steps=3, precision="bf16-mixed", max_grad_norm=0.5)
    assert trainer_kwargs(plan) == {
        "accumulate_grad_batches": 3, "precision": "bf16-mixed",
        "gradient_clip_val": 0.5, "gradient_clip_algorithm": "norm",
    }
    assert trainer_kwargs(Plan())["precision"] == "32-true"
    assert trainer_kwargs(Plan(precision="fp16-mixed"))["precision"] == "16-mixed"


@pytest.mark.parametrize(
    ("plan", "words"),
    [
        (Plan(offload="host"), "offload"),
        (Plan(compile=True), "compile"),
        (Plan(max_seq_len=8), "max_seq_len"),
        (Plan(loss_normalization="tokens"), "tokens"),
    ],
)
def test_unsupported_fields_are_refused(plan, words):
    with pytest.raises(PlanError, match=words):
        MemfitCallback(plan)


def test_trainer_that_differs_from_plan_is_refused():
    plan = Plan(grad_accum_steps=2)
    with pytest.raises(PlanError, match="accumulate_grad_batches=1"):
        fit(tiny_gpt2(), plan, batches(2, 2), accumulate_grad_batches=1)


def test_micro_batch_size_is_checked_against_the_loader():
    with pytest.raises(PlanError, match="micro_batch_size is 3"):
        fit(tiny_gpt2(), Plan(micro_batch_size=3), batches(1, 2))


def test_loss_falls_and_plan_is_removed_at_the_end(tmp_path):
    torch.manual_seed(0)
    model = tiny_gpt2()
    plan = Plan(grad_accum_steps=2, checkpointing="full", freeze=("transformer.wpe.*",),
                max_grad_norm=1.0, optimizer={"name": "adamw", "lr": 1e-2})
    module, cb, trainer = fit(model, plan, batches(4, 2) * 10, tmp_path)
    first, last = sum(module.losses[:4]) / 4, sum(module.losses[-4:]) / 4
    assert last < 0.7 * first
    assert trainer.global_step == 20
    # Every technique reached the model, and came off at the end.
    assert cb.info["frozen"] == ["transformer.wpe.weight"]
    assert len(cb.info["checkpointed"]) == 2
    assert cb.handles == []
    assert all(p.requires_grad for p in model.parameters())
    assert memfit.strategies.checkpointing.checkpointed_blocks(model) == []
    report = json.loads((tmp_path / "report" / "memory_report.json").read_text())
    assert report["peak_bytes"] == cb.report.peak_bytes > 0
    assert (tmp_path / "report" / "memory_report.png").stat().st_size > 0


def test_params_equal_a_plain_torch_loop():
    """Accumulation 2, clipping by norm 0.1 (binding), AdamW: Lightning plus the callback gives
    the parameters a hand-written loop gives, to float32 rounding."""
    torch.manual_seed(0)
    model = tiny_gpt2()
    ref = copy.deepcopy(model)
    plan = Plan(grad_accum_steps=2, max_grad_norm=0.1, optimizer={"name": "adamw", "lr": 1e-2})
    data = batches(8, 2)
    fit(model, plan, data)

    opt = plan.optimizer.build([p for p in ref.parameters()])
    for i in range(0, len(data), 2):
        for b in data[i : i + 2]:
            (ref(**b).loss / 2).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        opt.step()
        opt.zero_grad(set_to_none=True)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "plan",
    [
        Plan(),
        Plan(grad_accum_steps=2, checkpointing="full", freeze=("transformer.wte.*",)),
        Plan(precision="bf16-pure"),
    ],
    ids=["plain", "accum-ckpt-freeze", "bf16-pure"],
)
def test_tracked_peak_matches_dry_run(plan):
    mb = plan.micro_batch_for(BATCH)

    def make_batch(model, bs, sl):
        return batches(1, bs)[0]

    workload = Workload(name="tiny-gpt2", batch_size=BATCH, seq_len=SEQ,
                        build_model=tiny_gpt2, make_batch=make_batch)
    pred = memfit.dry_run(workload, plan, steps=2)
    torch.manual_seed(0)
    _, cb, _ = fit(tiny_gpt2(), plan, batches(2 * plan.grad_accum_steps, mb))
    got = cb.report
    assert abs(got.peak_bytes - pred.peak_bytes) <= 0.05 * pred.peak_bytes
    # At the peak the same weights, gradients, optimizer state and activations are alive...
    for cat in ("parameters", "gradients", "optimizer_state", "activations"):
        assert got.peak_by_category[cat] == pred.peak_by_category[cat], cat
    # ...but inputs differ: the dry run holds the whole effective batch (micro-batches are
    # slices of it), Lightning only the current micro-batch (int64 ids and labels: 2 tensors x
    # 8 bytes per token); what Lightning itself allocates (the prefetched batch before it is
    # labelled, the logged loss) counts as "other" and stays within the 5%.
    assert pred.peak_by_category["inputs"] == 2 * BATCH * SEQ * 8
    assert got.peak_by_category["inputs"] == 2 * mb * SEQ * 8


def test_precision_and_optimizer_reach_the_trainer():
    """bf16-mixed is Lightning's autocast (logits come out bf16 inside training_step); the
    plan's memfit optimizer is the one Lightning steps; the memory is logged every step."""
    plan = Plan(precision="bf16-mixed", optimizer={"name": "adafactor", "lr": 1e-2})
    seen = []
    torch.manual_seed(0)
    model = tiny_gpt2()
    model.register_forward_hook(lambda m, a, out: seen.append(out.logits.dtype))
    _, cb, trainer = fit(model, plan, batches(2, 2))
    assert str(trainer.precision) == "bf16-mixed"
    assert seen == [torch.bfloat16, torch.bfloat16]
    assert type(trainer.optimizers[0]).__name__ == "Adafactor"
    assert type(trainer.optimizers[0]).__module__.startswith("memfit.")
    logged = float(trainer.callback_metrics["memfit/peak_bytes"])
    assert 0 < logged <= cb.report.peak_bytes


@pytest.mark.subprocess
@pytest.mark.slow  # a fresh interpreter importing torch and lightning: about 5 s
def test_lightning_is_imported_only_for_the_callback():
    import subprocess
    import sys

    code = (
        "import sys, memfit, memfit.integrations.lightning as m; "
        "assert 'lightning' not in sys.modules; m.trainer_kwargs(memfit.Plan()); "
        "assert 'lightning' not in sys.modules; cb = m.MemfitCallback(memfit.Plan()); "
        "import lightning; assert isinstance(cb, lightning.Callback)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


class FusedModule(Module):
    def __init__(self, model, callback):
        super().__init__(model, callback)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.losses.append(float(loss.detach()))
        self.callback.backward(self, loss)


def fit_fused(model, plan, data, **extra):
    cb = MemfitCallback(plan)
    module = FusedModule(model, cb)
    fresh = [lambda b=b: {k: v.clone() for k, v in b.items()} for b in data]
    trainer = L.Trainer(**{
        "max_epochs": 1, "logger": False, "enable_checkpointing": False,
        "enable_progress_bar": False, "enable_model_summary": False, "accelerator": "cpu",
        "devices": 1, "callbacks": [cb], **trainer_kwargs(plan), **extra,
    })
    trainer.fit(module, torch.utils.data.DataLoader(_Fresh(fresh), batch_size=None))
    return module, cb, trainer


def test_fused_step_needs_manual_optimization():
    with pytest.raises(PlanError, match="manual optimization"):
        fit(tiny_gpt2(), Plan(optimizer_in_backward=True), batches(1, 2))


def test_fused_step_equals_the_plain_loop():
    """Manual optimization with the step in backward, accumulation 2: the same parameters as
    a plain torch loop (accumulate, step, zero), to float32 rounding."""
    torch.manual_seed(0)
    model = tiny_gpt2()
    ref = copy.deepcopy(model)
    plan = Plan(grad_accum_steps=2, optimizer_in_backward=True,
                optimizer={"name": "adamw", "lr": 1e-2})
    assert trainer_kwargs(plan)["accumulate_grad_batches"] == 1
    data = batches(8, 2)
    _, cb, trainer = fit_fused(model, plan, data)
    assert trainer.global_step == 4
    assert cb.handles == []
    opt = plan.replace(optimizer_in_backward=False).optimizer.build(list(ref.parameters()))
    for i in range(0, len(data), 2):
        for b in data[i : i + 2]:
            (ref(**b).loss / 2).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_fused_step_peak_matches_dry_run():
    plan = Plan(optimizer_in_backward=True)
    workload = Workload(name="tiny-gpt2", batch_size=BATCH, seq_len=SEQ,
                        build_model=tiny_gpt2, make_batch=lambda m, bs, sl: batches(1, bs)[0])
    pred = memfit.dry_run(workload, plan, steps=2)
    torch.manual_seed(0)
    _, cb, _ = fit_fused(tiny_gpt2(), plan, batches(2, BATCH))
    got = cb.report
    assert abs(got.peak_bytes - pred.peak_bytes) <= 0.05 * pred.peak_bytes
    for cat in ("parameters", "gradients", "optimizer_state", "activations"):
        assert got.peak_by_category[cat] == pred.peak_by_category[cat], cat


class _RecordingLogger(L.pytorch.loggers.Logger):
    """Stands for a real logger (TensorBoard, W&B): the metrics each log_metrics call gets."""

    name, version = "recording", 0

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, float]] = []

    def log_metrics(self, metrics, step=None):
        self.rows.append(dict(metrics))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


@pytest.mark.parametrize(
    ("accum", "max_norm"), [(2, None), (1, 0.1)], ids=["accum-no-clip", "exact-clip"]
)
def test_fused_step_logs_figures_and_the_true_grad_norm(accum, max_norm):
    """The fused step frees gradients inside backward, so nothing after it can measure their
    norm; memfit logs it as memfit/grad_norm beside its memory figures, and each step's value
    is the unclipped norm of a plain loop's accumulated gradient (get_total_norm) on the same
    batches, to float32 rounding. All reach the logger, logged_metrics and callback_metrics."""
    torch.manual_seed(0)
    model = tiny_gpt2()
    ref = copy.deepcopy(model)
    sgd = {"name": "sgd", "lr": 0.1, "kwargs": {"momentum": 0.9}}
    plan = Plan(grad_accum_steps=accum, optimizer_in_backward=True, max_grad_norm=max_norm,
                optimizer=sgd)
    data = batches(8, 2)
    logger = _RecordingLogger()
    _, _, trainer = fit_fused(model, plan, data, logger=logger, log_every_n_steps=1)

    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    want = []
    for i in range(0, len(data), accum):
        for b in data[i : i + accum]:
            (ref(**b).loss / accum).backward()
        want.append(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]))
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
    want = torch.stack(want)
    if max_norm is not None:
        assert (want > max_norm).all()  # clipping binds at every step
    # Manual optimization logs every batch; the last micro-batch of each step has its norm
    # (Lightning repeats a value logged on_step in later rows until it is logged again).
    assert len(logger.rows) == len(data)
    logged = torch.tensor([r["memfit/grad_norm"] for r in logger.rows[accum - 1 :: accum]])
    assert len(logged) == len(want) == len(data) // accum
    torch.testing.assert_close(logged, want, rtol=1e-5, atol=0)
    assert all(r["memfit/peak_bytes"] >= r["memfit/live_bytes"] > 0 for r in logger.rows)
    for metrics in (trainer.logged_metrics, trainer.callback_metrics):
        assert float(metrics["memfit/grad_norm"]) == logged[-1]
        assert float(metrics["memfit/peak_bytes"]) == logger.rows[-1]["memfit/peak_bytes"]
