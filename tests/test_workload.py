"""Workload SPECs: presets, HF config files, package.module:function, and clear errors."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.workload import (
    PRESETS,
    WorkloadError,
    call_model,
    load_workload,
    loss_from_output,
    split_batch,
)


@pytest.mark.parametrize(
    ("name", "low", "high"),
    [
        ("bert-base", 105e6, 115e6),
        ("bert-large", 320e6, 330e6),
        ("gpt2", 120e6, 130e6),
        ("gpt2-medium", 350e6, 360e6),
        ("llama-1b", 1.15e9, 1.3e9),
        ("llama-8b", 8.02e9, 8.04e9),  # Llama-3.1-8B: 8,030,261,248
        ("llama-70b", 70.5e9, 70.6e9),  # Llama-3.1-70B: 70,553,706,496
        ("llama-3.1-405b", 405.8e9, 405.9e9),  # Llama-3.1-405B: 405,853,388,800
    ],
)
def test_presets_build_at_full_size_on_fake_tensors(name, low, high):
    with FakeTensorMode():
        model, batch = load_workload(name, 2, 16).build()
        n = sum(p.numel() for p in model.parameters())
        assert low <= n <= high
        assert batch["input_ids"].shape == (2, 16)


def test_bert_large_matches_macbert_large_dimensions():
    with FakeTensorMode():
        model, batch = load_workload("bert-large", 2, 8).build()
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads) == (24, 1024, 16)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.num_labels) == (4096, 21128, 2)
    assert batch["labels"].shape == (2,)


@pytest.mark.parametrize("name", ["bert-tiny", "gpt2-tiny", "llama-tiny"])
def test_tiny_presets_give_a_loss(name):
    wl = load_workload(name, 2, 8)
    model, batch = wl.build()
    loss = wl.loss_fn(call_model(model, batch), batch)
    assert loss.dim() == 0 and torch.isfinite(loss)


def test_config_json_path(tmp_path):
    cfg = {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "n_embd": 32,
        "n_layer": 1,
        "n_head": 2,
        "vocab_size": 100,
        "n_positions": 64,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    wl = load_workload(str(path), 2, 8)
    model, batch = wl.build()
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert wl.loss_fn(call_model(model, batch), batch).dim() == 0


def test_function_spec_dict_and_tensor_batches():
    wl = load_workload("tests.models:mlp_workload", 4, 1)
    model, batch = wl.build()
    assert batch["x"].shape == (4, 16)
    assert wl.loss_fn(call_model(model, batch), batch).dim() == 0
    wl = load_workload("tests.models:conv_workload", 2, 8)
    model, batch = wl.build()
    assert isinstance(batch, torch.Tensor)
    assert wl.loss_fn(call_model(model, batch), batch).dim() == 0


_VIT_MODULE = """
    import torch
    from transformers import ViTConfig, ViTForImageClassification


    def vit(batch_size, seq_len):
        config = ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, image_size=32, patch_size=8, num_labels=10)
        model = ViTForImageClassification(config)  # its init samples truncated normals
        batch = {"pixel_values": torch.randn(batch_size, 3, 32, 32),
                 "labels": torch.randint(0, 10, (batch_size,))}
        return model, batch
"""


def test_a_function_whose_initialisers_read_samples_dry_runs_from_the_cli(tmp_path, monkeypatch):
    # The README's way to profile a custom model: `--model package.module:function`. torch's
    # trunc_normal_ reads the values it samples; building on fake tensors must not.
    from typer.testing import CliRunner

    from memfit.cli import app

    (tmp_path / "memfit_user_vit.py").write_text(textwrap.dedent(_VIT_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    reports = {}
    for mode in ("real", "dry"):
        path = tmp_path / f"{mode}.json"
        args = ["profile", "--model", "memfit_user_vit:vit", "--batch-size", "2", "--steps", "2",
                "--json", str(path)] + (["--dry-run"] if mode == "dry" else [])  # fmt: skip
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        reports[mode] = json.loads(path.read_text())
    real, dry = reports["real"], reports["dry"]
    assert dry["dry_run"] and not real["dry_run"]
    assert dry["num_parameters"] == real["num_parameters"]
    assert dry["peak_by_category"] == real["peak_by_category"]
    assert dry["phase_peaks"] == real["phase_peaks"]


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("no-such-preset", "names nothing"),
        ("tests.models:nope", "has no function"),
        ("no_such_pkg.mod:fn", "cannot be imported"),
        ("/no/such/config.json", "does not exist"),
    ],
)
def test_bad_specs(spec, match):
    with pytest.raises(WorkloadError, match=match):
        load_workload(spec, 2, 8)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("tests.models:returns_model_only", r"must return a \(model, batch\) tuple"),
        ("tests.models:returns_bad_batch", "batch must be a dict"),
    ],
)
def test_functions_returning_the_wrong_thing(spec, match):
    with pytest.raises(WorkloadError, match=match):
        load_workload(spec, 2, 8).build()


def test_bad_sizes_and_missing_loss():
    with pytest.raises(WorkloadError, match="batch size"):
        load_workload("gpt2-tiny", 0, 8)
    with pytest.raises(WorkloadError, match="sequence length"):
        load_workload("gpt2-tiny", 2, 0)
    with pytest.raises(WorkloadError, match="has no loss"):
        loss_from_output(torch.randn(3, 4))


def test_presets_extend_their_position_table_for_longer_sequences():
    # gpt2-tiny has 256 positions; asking for 300 tokens grows the table (300 x 64 weights).
    short_model, _ = load_workload("gpt2-tiny", 1, 8).build()
    model, batch = load_workload("gpt2-tiny", 1, 300).build()
    assert model.config.n_positions == 300
    assert batch["input_ids"].shape == (1, 300)
    extra = sum(p.numel() for p in model.parameters()) - sum(
        p.numel() for p in short_model.parameters()
    )
    assert extra == (300 - 256) * 64


def test_config_files_refuse_sequences_longer_than_their_positions(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "gpt2", "n_positions": 32, "n_embd": 16, "n_layer": 1, '
                    '"n_head": 2, "vocab_size": 50}')
    with pytest.raises(WorkloadError, match="longer than"):
        load_workload(str(path), 2, 33)


def test_split_batch():
    batch = {"x": torch.arange(10).reshape(5, 2), "flag": torch.tensor(1)}
    parts = split_batch(batch, 2)
    assert [p["x"].shape[0] for p in parts] == [2, 2, 1]
    assert torch.equal(torch.cat([p["x"] for p in parts]), batch["x"])


def test_every_preset_is_documented():
    assert all(p.about for p in PRESETS.values())


@pytest.mark.parametrize(
    ("name", "billions"),
    # The published parameter counts of the three models' config.json.
    [("llama-3.1-8b", 8.030), ("qwen2.5-7b", 7.616), ("mistral-7b", 7.248)],
)
def test_the_fine_tuning_presets_have_the_published_sizes(name, billions):
    workload = load_workload(name, 1, 16)
    with torch.device("meta"):
        model = workload.build_model()
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=5e-4)


# ---------------------------------------------------------------------------------- model folders
def test_a_model_folder_builds_from_its_config_and_loads_its_weights_on_request(tmp_path):
    from tests.models import save_tiny_llama

    saved = save_tiny_llama(tmp_path, shard=True, tokenizer=False, seed=1)
    wl = load_workload(str(tmp_path), 2, 8)
    assert wl.weights == str(tmp_path) and wl.load_model is not None
    assert "saved weights" in wl.description and wl.depth == 2
    random_model, _ = wl.build(seed=0)  # what a real profile measures: random weights
    assert not torch.equal(random_model.lm_head.weight, saved.lm_head.weight)
    loaded, batch = wl.build(seed=0, pretrained=True, dtype=torch.bfloat16)
    assert loaded.training and loaded.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(loaded.lm_head.weight, saved.lm_head.weight.to(torch.bfloat16))
    assert wl.loss_fn(call_model(loaded, batch), batch).dim() == 0
    # Shallow copies (the planner's composition) are dry-run models with no weights of their own.
    assert wl.with_depth(1).load_model is None
    # A config.json path still means random weights.
    assert load_workload(str(tmp_path / "config.json"), 2, 8).weights is None


def test_a_dry_run_of_a_model_folder_never_opens_its_weights(tmp_path):
    from memfit.estimate import dry_run
    from tests.models import save_tiny_llama

    save_tiny_llama(tmp_path, tokenizer=False)
    (tmp_path / "model.safetensors").write_bytes(b"garbage, not safetensors")
    wl = load_workload(str(tmp_path), 2, 8)
    with FakeTensorMode():  # pretrained=True is ignored on fake tensors
        model, _ = wl.build(pretrained=True)
    assert sum(p.numel() for p in model.parameters()) > 0
    assert dry_run(wl, steps=1).peak_bytes > 0
    with pytest.raises(WorkloadError, match="is not a readable safetensors file"):
        wl.build(pretrained=True)


def test_model_folder_errors_name_the_file(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"')
    with pytest.raises(WorkloadError, match=r"config.json' is not valid JSON"):
        load_workload(str(tmp_path), 2, 8)
    (tmp_path / "config.json").write_text('{"model_type": "no-such-type"}')
    with pytest.raises(WorkloadError) as e:
        load_workload(str(tmp_path), 2, 8)
    assert "'no-such-type'" in str(e.value) and len(str(e.value)) < 400  # not transformers' list
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 64}))
    with pytest.raises(WorkloadError, match="has no weights"):
        load_workload(str(tmp_path), 2, 8).build(pretrained=True)


def test_an_unreachable_hub_id_says_how_to_download_it(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(WorkloadError, match=r"--local-dir DIR.*then pass --model DIR"):
        load_workload("meta-llama/Llama-3.1-8B", 2, 8)


def test_a_hub_id_fetches_the_config_for_a_dry_run_and_the_weights_to_train(monkeypatch, tmp_path):
    import fnmatch
    import shutil

    import huggingface_hub

    from tests.models import save_tiny_llama

    saved = save_tiny_llama(tmp_path / "hub", shard=True)
    fetched: list[list[str]] = []

    def snapshot_download(repo_id, allow_patterns=None, **kwargs):
        # The hub, played by a folder: copies the files the patterns match, as the cache would.
        assert repo_id == "memfit-tests/tiny-llama"
        fetched.append([f.name for f in sorted((tmp_path / "hub").iterdir())
                        if any(fnmatch.fnmatch(f.name, p) for p in allow_patterns)])
        cache = tmp_path / f"cache{len(fetched)}"
        cache.mkdir()
        for name in fetched[-1]:
            shutil.copy(tmp_path / "hub" / name, cache / name)
        return str(cache)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    wl = load_workload("memfit-tests/tiny-llama", 2, 8)
    assert wl.name == wl.weights == "memfit-tests/tiny-llama"
    assert not any(name.endswith(".safetensors") for name in fetched[0])  # the config alone
    assert "config.json" in fetched[0] and "tokenizer.json" in fetched[0]
    model, _ = wl.build(pretrained=True)
    assert sum(name.endswith(".safetensors") for name in fetched[1]) == 5  # every shard
    assert torch.equal(model.lm_head.weight, saved.lm_head.weight)
