"""memfit plans inside the stock Hugging Face Trainer (CPU, tiny random GPT-2)."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from memfit import Plan  # noqa: E402
from memfit.integrations import hf  # noqa: E402

VOCAB, SEQ, N = 64, 16, 32


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


class _Data(torch.utils.data.Dataset):
    """A learnable sequence: token t+1 = token t + 1 (mod VOCAB)."""

    def __init__(self, n: int = N) -> None:
        g = torch.Generator().manual_seed(1)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        self.ids = (start + torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _args(tmp_path, **kw) -> TrainingArguments:
    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no",
                per_device_train_batch_size=8, num_train_epochs=1, logging_steps=1,
                learning_rate=1e-2, lr_scheduler_type="constant", seed=0,
                dataloader_drop_last=True, disable_tqdm=True)
    base.update(kw)
    return TrainingArguments(**base)


class _Recorder(transformers.TrainerCallback):
    """Stands for a reporter (TensorBoard, W&B): what on_log hands it."""

    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def _train(model, plan, tmp_path, epochs=1, **kw):
    args, optimizers, callbacks = hf.apply(plan, model, _args(tmp_path, num_train_epochs=epochs,
                                                                **kw))
    recorder = _Recorder()
    # The recorder goes first, as the Trainer's reporters do; memfit's callback must still
    # reach it with its numbers.
    trainer = Trainer(model=model, args=args, optimizers=optimizers,
                      callbacks=[recorder, *callbacks], train_dataset=_Data())
    trainer.train()
    trainer.recorder = recorder
    return trainer, callbacks[0]


def test_loss_falls_and_report_written(tmp_path):
    plan = Plan(optimizer={"name": "adamw", "lr": 1e-2}, checkpointing="selective")
    trainer, cb = _train(tiny_gpt2(), plan, tmp_path, epochs=4)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 16
    assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3
    logged = [h for h in trainer.recorder.logs if "memfit/peak_bytes" in h]
    assert len(logged) == 16
    assert logged and all(h["memfit/peak_bytes"] > 0 for h in logged)
    assert (tmp_path / "memfit_report.json").exists()
    assert cb.report.peak_bytes == max(h["memfit/peak_bytes"] for h in logged)


def test_plan_fields_reach_training_args(tmp_path):
    plan = Plan(micro_batch_size=4, grad_accum_steps=2, precision="bf16-mixed",
                checkpointing="full", max_grad_norm=1.0, sequence={"group_by_length": True},
                freeze=("transformer.wte.*",), optimizer={"name": "adafactor", "lr": 1e-2})
    model = tiny_gpt2()
    args, (opt, sched), cbs = hf.apply(plan, model, _args(tmp_path))
    assert args.gradient_accumulation_steps == 2
    assert args.per_device_train_batch_size == 4
    assert args.bf16 and not args.fp16
    assert args.activation_checkpointing
    assert args.activation_checkpointing_kwargs == {"use_reentrant": False}
    assert args.max_grad_norm == 1.0
    assert args.train_sampling_strategy == "group_by_length"
    assert not model.transformer.wte.weight.requires_grad
    assert type(opt).__name__ == "Adafactor" and sched is None
    assert all(p.requires_grad for g in opt.param_groups for p in g["params"])
    assert isinstance(cbs[0], hf.MemfitCallback)


def _plain_loop(model, steps_batches, lr, accum, max_norm):
    """The reference: plain torch, micro-batch mean losses / accum, clip, AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for micro in steps_batches:
        for ids in micro:
            (model(input_ids=ids, labels=ids).loss / accum).backward()
        if max_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("fused", [False, True])
def test_accumulation_numerics_match_plain_loop(tmp_path, fused):
    # Accumulation 2 over micro-batches of 4; the fused step with approx clipping is compared
    # with a clip threshold no step reaches (approx clips with the previous norm).
    max_norm = 1e6 if fused else 0.5
    plan = Plan(micro_batch_size=4, grad_accum_steps=2, optimizer={"name": "adamw", "lr": 1e-3},
                optimizer_in_backward=fused, max_grad_norm=max_norm,
                grad_clip_mode="approx" if fused else "exact")
    model = tiny_gpt2()
    ref = copy.deepcopy(model)
    seen: list[torch.Tensor] = []  # the micro-batches in the Trainer's order, replayed below
    model.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["input_ids"].clone()) if m.training else None,
        with_kwargs=True,
    )
    _train(model, plan, tmp_path, per_device_train_batch_size=4)
    assert len(seen) == N // 4
    _plain_loop(ref, [seen[i:i + 2] for i in range(0, len(seen), 2)], 1e-3, 2, max_norm)
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=n)
