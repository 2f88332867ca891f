"""LoRA and QLoRA: the config, the targets, numerics against peft and torchao, memory, dry runs
equal to real runs, saved adapters, removal, and the bad inputs."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import memfit
from memfit.apply.compose import apply_plan
from memfit.plan import Plan, PlanError
from memfit.strategies import nf4 as nf4_mod
from memfit.strategies.lora import LoraConfig, apply_lora, resolve_targets, save_adapter
from memfit.workload import load_workload

peft = pytest.importorskip("peft")
pytest.importorskip("torchao")

from tests.estimate.zoo import ZOO  # noqa: E402


def _config_workload(tmp_path, family: str, batch: int = 2, seq: int = 16):
    body = ZOO[family][1]
    path = tmp_path / f"{family}.json"
    path.write_text(json.dumps(body))
    return load_workload(str(path), batch, seq)


@pytest.fixture
def llama():
    torch.manual_seed(0)
    return load_workload("llama-tiny", 2, 16)


def _trainable(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


# ---------------------------------------------------------------------------- config
def test_plan_lora_round_trips_and_is_left_out_when_off():
    plain = Plan()
    assert "lora" not in plain.to_dict()
    assert Plan.from_dict(json.loads(plain.to_json())) == plain
    plan = Plan(lora={"rank": 8, "alpha": 16, "dropout": 0.1, "target_modules": ["q_proj", "v_proj"],
                      "quantize_base": "nf4"})
    data = json.loads(plan.to_json())
    assert data["lora"] == {"rank": 8, "alpha": 16, "dropout": 0.1,
                            "target_modules": ["q_proj", "v_proj"], "use_dora": False,
                            "quantize_base": "nf4", "quantize_embeddings": False}
    assert Plan.from_dict(data) == plan
    assert Plan.from_dict(json.loads(Plan(lora=True).to_json())).lora == LoraConfig()
    assert Plan(lora=None).lora is None and Plan(lora=False).lora is None
    assert "QLoRA (nf4) r8" in plan.summary()


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"rank": 0}, "rank"),
        ({"dropout": 1.0}, "dropout"),
        ({"alpha": -1}, "alpha"),
        ({"quantize_base": "int4"}, "nf4"),
        ({"target_modules": []}, "target_modules"),
        ({"use_dora": True, "quantize_base": "nf4"}, "DoRA"),
    ],
)
def test_bad_lora_configs_are_refused_with_a_sentence(fields, words):
    with pytest.raises(PlanError, match=words):
        Plan(lora=fields)


# ---------------------------------------------------------------------------- targets
def test_targets_all_linear_attention_and_names(llama):
    model = llama.build_model()
    all_linear = resolve_targets(model, LoraConfig())
    assert "lm_head" not in all_linear and len(all_linear) == 2 * 7
    attention = resolve_targets(model, LoraConfig(target_modules="attention"))
    assert [n.rpartition(".")[2] for n in attention[:4]] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert len(attention) == 8
    named = resolve_targets(model, LoraConfig(target_modules=("q_proj", "model.layers.1.mlp.*")))
    assert len(named) == 2 + 3


def test_targets_that_match_nothing_list_the_linear_layers(llama):
    model = llama.build_model()
    with pytest.raises(ValueError) as e:
        apply_lora(model, LoraConfig(target_modules=("query",)))
    message = str(e.value)
    assert "'query' matches no linear layer" in message
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert name in message
    assert _trainable(model) == [n for n, _ in model.named_parameters()]  # left unchanged


def test_qlora_without_torchao_names_the_extra(llama, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_torchao(name, *args, **kwargs):
        if name.startswith("torchao"):
            raise ImportError("No module named 'torchao'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchao)
    model = llama.build_model()
    with pytest.raises(ImportError, match=r"memfit\[peft\]"):
        apply_lora(model, LoraConfig(quantize_base="nf4"))


def test_lora_without_peft_names_the_extra(llama, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(ImportError, match=r"memfit\[peft\]"):
        apply_lora(llama.build_model(), LoraConfig())


# ---------------------------------------------------------------------------- numerics
def test_lora_forward_equals_the_base_at_init(llama):
    model, batch = llama.build()
    with torch.no_grad():
        before = model(**batch).logits
        handle = apply_lora(model, LoraConfig(rank=4))
        after = model(**batch).logits
    assert torch.equal(before, after)  # B starts at zero
    assert set(_trainable(model)) == {n for n, _ in model.named_parameters() if "lora_" in n}
    handle.remove()


def _randomize_adapters(model: nn.Module, seed: int = 3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def test_lora_step_gradients_equal_a_reference_peft_model(llama):
    model, batch = llama.build()
    reference = peft.get_peft_model(
        copy.deepcopy(model),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0),
    )
    apply_lora(model, LoraConfig(rank=4, alpha=8))
    _randomize_adapters(model)
    _randomize_adapters(reference)
    model(**batch).loss.backward()
    reference(**batch).loss.backward()
    ours = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    theirs = {n.removeprefix("base_model.model."): p.grad
              for n, p in reference.named_parameters() if p.requires_grad}
    assert ours.keys() == theirs.keys() and len(ours) == 2 * 2 * 7
    for name, grad in ours.items():
        torch.testing.assert_close(grad, theirs[name], rtol=0, atol=0)
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)


def test_dequantised_base_matches_torchaos_reference_dequantisation(monkeypatch):
    torch.manual_seed(0)
    for shape, dtype in (((176, 64), torch.float32), ((128, 512), torch.bfloat16)):
        w = torch.randn(shape, dtype=dtype)
        q = nf4_mod.quantize(w)
        assert q.quantized_data.dtype == torch.uint8 and q.quantized_data.numel() == w.numel() // 2
        monkeypatch.setattr(nf4_mod, "CHUNK", 256)  # several chunks
        assert torch.equal(nf4_mod.dequantize(q), q.get_original_weight())
        monkeypatch.undo()


def test_qlora_step_gradients_equal_a_reference_on_the_dequantised_weights(llama):
    model, batch = llama.build()
    reference = copy.deepcopy(model)
    handle = apply_lora(model, LoraConfig(rank=4, quantize_base="nf4"))
    # The reference: the same model with each adapted weight replaced by its dequantisation,
    # under plain LoRA with the same adapters.
    with torch.no_grad():
        for name in handle.targets:
            weight = nf4_mod.dequantize(model.get_submodule(name).base_layer.weight)
            reference.get_submodule(name).weight.copy_(weight)
    apply_lora(reference, LoraConfig(rank=4))
    _randomize_adapters(model)
    _randomize_adapters(reference)
    loss = model(**batch).loss
    ref_loss = reference(**batch).loss
    torch.testing.assert_close(loss, ref_loss)
    loss.backward()
    ref_loss.backward()
    theirs = dict(reference.named_parameters())
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert len(grads) == 2 * 2 * 7
    for name, grad in grads.items():
        torch.testing.assert_close(grad, theirs[name].grad, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- memory
def test_frozen_base_has_no_gradients_or_optimizer_state(llama):
    model, batch = llama.build()
    setup = apply_plan(model, Plan(lora={"rank": 4}))
    setup.step(batch)
    adapters = {id(p) for n, p in model.named_parameters() if "lora_" in n}
    for name, p in model.named_parameters():
        if id(p) not in adapters:
            assert p.grad is None and not p.requires_grad, name
    assert {id(p) for p in setup.optimizer.state} == adapters


def test_adapter_optimizer_state_is_params_times_state_bytes():
    plan = Plan(lora={"rank": 4})
    report = memfit.measure("llama-tiny", plan, batch_size=2, seq_len=16, steps=2)
    model = load_workload("llama-tiny", 2, 16).build_model()
    handle = apply_lora(model, plan.lora)
    adapters = handle.adapter_parameters()
    n = sum(p.numel() for p in adapters)
    # AdamW: two fp32 moments per adapter weight, and a 4-byte step count per tensor.
    assert report.peak_by_category["optimizer_state"] == 8 * n + 4 * len(adapters)


def _nf4_bytes(numel: int, itemsize: int) -> int:
    blocks = numel // nf4_mod.BLOCK
    scaler = __import__("math").gcd(blocks, nf4_mod.SCALER_BLOCK)
    # 4-bit codes, an 8-bit scale per block, a factor per block of scales, the scales' mean and
    # torchao's 16-entry code table, the last three in the weight's dtype. (With a single block
    # of scales, torchao's factor is a view that keeps the storage of one factor per scale.)
    factors = blocks // scaler if blocks > scaler else scaler
    return numel // 2 + blocks + (factors + 1 + 16) * itemsize


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_qlora_base_costs_half_a_byte_per_weight_plus_its_scales(precision):
    plan = Plan(lora={"rank": 4, "quantize_base": "nf4"}, precision=precision)
    report = memfit.measure("llama-tiny", plan, batch_size=2, seq_len=16, steps=1)
    model = load_workload("llama-tiny", 2, 16).build_model()
    targets = resolve_targets(model, plan.lora)
    itemsize = 4 if precision == "fp32" else 2
    quantized = [model.get_submodule(t).weight.numel() for t in targets]
    rest = sum(p.numel() for n, p in model.named_parameters()
               if n.removesuffix(".weight") not in targets) * itemsize
    handle = apply_lora(load_workload("llama-tiny", 2, 16).build_model(), plan.lora)
    adapters = sum(p.numel() for p in handle.adapter_parameters()) * 4
    expected = rest + adapters + sum(_nf4_bytes(n, itemsize) for n in quantized)
    assert report.peak_by_category["parameters"] == expected


# ---------------------------------------------------------------------------- dry = real
@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt_neox"])
@pytest.mark.parametrize("lora", [{"rank": 4}, {"rank": 4, "quantize_base": "nf4"},
                                  {"rank": 4, "dropout": 0.1, "target_modules": "attention"}],
                         ids=["lora", "qlora", "attention-dropout"])
def test_dry_run_equals_real_run(tmp_path, family, lora):
    workload = _config_workload(tmp_path, family)
    for plan in (Plan(lora=lora), Plan(lora=lora, precision="bf16-mixed", checkpointing="full")):
        real = memfit.measure(workload, plan, steps=2)
        dry = memfit.dry_run(workload, plan, steps=2)
        assert dry.peak_by_category == real.peak_by_category, plan.summary()
        assert dry.phase_peaks == real.phase_peaks


def test_dry_run_equals_real_run_on_llama_tiny_qlora():
    plan = Plan(lora={"rank": 4, "quantize_base": "nf4"}, precision="bf16-mixed")
    real = memfit.measure("llama-tiny", plan, batch_size=2, seq_len=16, steps=2)
    dry = memfit.dry_run("llama-tiny", plan, batch_size=2, seq_len=16, steps=2)
    assert dry.peak_by_category == real.peak_by_category


# ---------------------------------------------------------------------------- saving, removal
@pytest.mark.parametrize("quantize", [None, "nf4"])
def test_saved_adapter_loads_with_peft_from_pretrained(llama, tmp_path, quantize):
    model, batch = llama.build()
    base = copy.deepcopy(model)
    handle = apply_lora(model, LoraConfig(rank=4, quantize_base=quantize))
    _randomize_adapters(model)
    out = save_adapter(model, tmp_path / "adapter")
    assert (out / "adapter_model.safetensors").is_file() and (out / "adapter_config.json").is_file()
    loaded = peft.PeftModel.from_pretrained(base, str(out))
    ours = {n: p for n, p in model.named_parameters() if "lora_" in n}
    theirs = {n.removeprefix("base_model.model."): p
              for n, p in loaded.named_parameters() if "lora_" in n}
    assert ours.keys() == theirs.keys()
    for name, p in ours.items():
        assert torch.equal(p, theirs[name]), name
    if quantize is None:
        with torch.no_grad():
            torch.testing.assert_close(model(**batch).logits, loaded(**batch).logits)
    handle.remove()


@pytest.mark.parametrize("plan", [Plan(lora={"rank": 4}),
                                  Plan(lora={"rank": 4}, precision="bf16-mixed"),
                                  Plan(lora={"rank": 4, "quantize_base": "nf4"})],
                         ids=["lora", "lora-bf16-mixed", "qlora"])
def test_remove_gives_the_model_back(llama, plan):
    model, batch = llama.build()
    before = {n: (p.dtype, p.requires_grad, p.detach().clone()) for n, p in model.named_parameters()}
    modules = [type(m) for m in model.modules()]
    setup = apply_plan(model, plan)
    setup.step(batch)
    setup.remove()
    assert [type(m) for m in model.modules()] == modules
    assert not hasattr(model, "peft_config")
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for name, (dtype, requires_grad, value) in before.items():
        p = after[name]
        assert (p.dtype, p.requires_grad) == (dtype, requires_grad), name
        if plan.lora.quantize_base is None and plan.precision.mode == "fp32":
            assert torch.equal(p, value), name  # the base never trained


def test_lora_trains(llama):
    model, batch = llama.build()
    setup = apply_plan(model, Plan(lora={"rank": 4, "quantize_base": "nf4"},
                                   optimizer={"name": "adamw", "lr": 1e-2}))
    losses = [float(setup.step(batch)) for _ in range(5)]
    assert losses[-1] < losses[0]


# ---------------------------------------------------------------------------- the trainer
@pytest.mark.slow
@pytest.mark.parametrize("quantize", [None, "nf4"], ids=["lora", "qlora"])
def test_trainer_checkpoints_hold_the_adapter_and_resume_bit_exactly(tmp_path, quantize):
    import shutil

    from memfit.train import Trainer
    from tests.train._helpers import text_dataset, tiny_gpt2

    plan = Plan(lora={"rank": 4, "quantize_base": quantize})

    def trainer(folder, resume=False):
        return Trainer(tiny_gpt2(seed=0), plan, text_dataset(), batch_size=4, lr=1e-2,
                       max_steps=4, checkpoint_dir=folder, checkpoint_every=2, resume=resume,
                       seed=0, progress=False)

    run = tmp_path / "run"
    full = trainer(run)
    result = full.fit()
    step2 = run / "step-00000002"
    assert (step2 / "adapter_model.safetensors").is_file()
    loaded = peft.PeftModel.from_pretrained(tiny_gpt2(seed=0), str(run / "step-00000004"))
    ours = {n: p for n, p in full.model.named_parameters() if "lora_" in n}
    theirs = {n.removeprefix("base_model.model."): p
              for n, p in loaded.named_parameters() if "lora_" in n}
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(p, theirs[n]) for n, p in ours.items())
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(step2, resumed_dir / step2.name)
    again = trainer(resumed_dir, resume=True).fit()
    assert again.losses == result.losses


def test_oom_fallback_rebuilding_the_plan_keeps_what_the_adapters_learnt(llama):
    from memfit.train.oom import switch_plan

    model, batch = llama.build()
    setup = apply_plan(model, Plan(lora={"rank": 4}, optimizer={"name": "adamw", "lr": 1e-2}))
    setup.step(batch)
    learnt = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    assert any(p.abs().sum() > 0 for n, p in learnt.items() if "lora_B" in n)
    new, rebuilt = switch_plan(setup, setup.plan.replace(optimizer="adafactor"))
    assert rebuilt
    now = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert now.keys() == learnt.keys()
    assert all(torch.equal(now[n], v) for n, v in learnt.items())
    new.step(batch)


def test_four_bit_embeddings_equal_the_dequantised_table_and_come_off(llama):
    model, batch = llama.build()
    table = model.get_input_embeddings().weight.detach().clone()
    handle = apply_lora(model, LoraConfig(rank=4, quantize_base="nf4", quantize_embeddings=True))
    embedding = model.get_input_embeddings()
    assert isinstance(embedding, nf4_mod.NF4Embedding)
    ids = batch["input_ids"]
    assert torch.equal(embedding(ids), nf4_mod.dequantize(embedding.weight)[ids])
    assert torch.equal(nf4_mod.dequantize(embedding.weight), embedding.weight.get_original_weight())
    model(**batch).loss.backward()  # trains through it
    handle.remove()
    back = model.get_input_embeddings()
    assert type(back) is nn.Embedding and back.weight.shape == table.shape
    assert back.weight.requires_grad


def test_dry_run_equals_real_run_with_four_bit_embeddings():
    plan = Plan(lora={"rank": 4, "quantize_base": "nf4", "quantize_embeddings": True},
                precision="bf16-mixed", checkpointing="full")
    real = memfit.measure("llama-tiny", plan, batch_size=2, seq_len=16, steps=2)
    dry = memfit.dry_run("llama-tiny", plan, batch_size=2, seq_len=16, steps=2)
    assert dry.peak_by_category == real.peak_by_category
    assert dry.phase_peaks == real.phase_peaks


def test_quantize_embeddings_needs_a_four_bit_base():
    with pytest.raises(PlanError, match="quantize_embeddings"):
        Plan(lora={"quantize_embeddings": True})
