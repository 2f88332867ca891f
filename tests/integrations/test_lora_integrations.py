"""LoRA and QLoRA plans in the Hugging Face Trainer and a lightning.Trainer: a model with
adapters is a normal model to them (CPU, tiny random GPT-2)."""

from __future__ import annotations

import pytest
import torch

from memfit import Plan

pytest.importorskip("peft")
pytest.importorskip("torchao")
pytest.importorskip("accelerate")

PLANS = [Plan(lora={"rank": 4}, optimizer={"name": "adamw", "lr": 1e-2}),
         Plan(lora={"rank": 4, "quantize_base": "nf4"}, optimizer={"name": "adamw", "lr": 1e-2},
              checkpointing="full")]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("plan", PLANS, ids=["lora", "qlora"])
def test_hf_trainer_trains_only_the_adapters(tmp_path, plan):
    from transformers import Trainer

    from memfit.integrations import hf
    from tests.integrations.test_hf import _args, _Data, tiny_gpt2

    model = tiny_gpt2()
    args, optimizers, callbacks = hf.apply(plan, model, _args(tmp_path, num_train_epochs=4))
    # (A 4-bit weight is left out: torchao's clone quantises anew, in its default blocks.)
    before = {n: p.detach().clone() for n, p in model.named_parameters()
              if "lora_" not in n and not hasattr(p, "quantized_data")}
    trainer = Trainer(model=model, args=args, optimizers=optimizers, callbacks=callbacks,
                      train_dataset=_Data())  # fmt: skip
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert sum(losses[-3:]) < sum(losses[:3])
    for name, p in model.named_parameters():
        if name in before and p.dtype == before[name].dtype:
            assert torch.equal(p, before[name]), name  # the base never moves
    assert {id(p) for p in optimizers[0].state} == {
        id(p) for n, p in model.named_parameters() if "lora_" in n
    }


@pytest.mark.slow
@pytest.mark.parametrize("plan", PLANS, ids=["lora", "qlora"])
def test_lightning_trains_the_adapters_and_takes_them_off(plan):
    pytest.importorskip("lightning")
    from tests.integrations.test_lightning import batches, fit, tiny_gpt2

    torch.manual_seed(0)
    model = tiny_gpt2()
    names = [n for n, _ in model.named_parameters()]
    module, cb, _ = fit(model, plan, batches(4, 2) * 5)
    assert sum(module.losses[-4:]) < sum(module.losses[:4])
    assert cb.info["lora"] and cb.handles == []
    assert [n for n, _ in model.named_parameters()] == names  # adapters unloaded at the end
