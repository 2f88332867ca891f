"""Model folders' saved weights: checked file by file, loaded straight into a dtype, and a hub
id's one-sentence advice where the hub cannot be reached."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.weights import (
    WeightsError,
    check_weights,
    has_tokenizer,
    hub_folder,
    is_hub_id,
    is_model_folder,
    load_pretrained,
    model_class,
)
from tests.models import save_tiny_llama


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    single, sharded = root / "single", root / "sharded"
    model = save_tiny_llama(single, tokenizer=False)
    save_tiny_llama(sharded, shard=True)
    return single, sharded, model


def test_what_a_spec_is(folders, tmp_path):
    single, sharded, _ = folders
    assert is_model_folder(single) and is_model_folder(sharded)
    assert not is_model_folder(tmp_path) and not is_model_folder(single / "config.json")
    assert has_tokenizer(sharded) and not has_tokenizer(single)
    assert is_hub_id("meta-llama/Llama-3.1-8B") and is_hub_id("Qwen/Qwen2.5-7B")
    assert not is_hub_id(str(single))  # a path that exists
    assert not is_hub_id("llama-1b") and not is_hub_id("pkg.mod:fn")
    assert not is_hub_id("a/b/c") and not is_hub_id("dir/config.json")


def test_check_weights_finds_every_shard(folders):
    single, sharded, _ = folders
    assert [p.name for p in check_weights(single)] == ["model.safetensors"]
    shards = check_weights(sharded)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(shards) > 1 and {p.name for p in shards} == set(index["weight_map"].values())


def _one_sentence(error: Exception, *needles: str) -> None:
    message = str(error)
    assert "\n" not in message and message.count(". ") == 0, message
    for needle in needles:
        assert needle in message, message


def test_missing_weights_are_named(tmp_path, folders):
    _, sharded, _ = folders
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((sharded / "config.json").read_text())
    with pytest.raises(WeightsError) as e:
        check_weights(empty)
    _one_sentence(e.value, "has no weights", "model.safetensors")

    (empty / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(WeightsError) as e:
        check_weights(empty)
    _one_sentence(e.value, "pytorch_model.bin", "safe_serialization=True")

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in sharded.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    gone = sorted(broken.glob("model-*.safetensors"))[1]
    gone.unlink()
    with pytest.raises(WeightsError) as e:
        check_weights(broken)
    _one_sentence(e.value, str(gone), "model.safetensors.index.json", "is missing")

    (broken / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(WeightsError) as e:
        check_weights(broken)
    _one_sentence(e.value, "model.safetensors.index.json", "is not a safetensors index")


class _Float32Bytes(TorchDispatchMode):
    """Counts the bytes of every float32 tensor an operation makes (off the meta device)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and not t.is_meta:
                self.bytes += t.numel() * 4
        return out


def test_a_bf16_checkpoint_loads_without_the_model_in_fp32(folders, tmp_path, monkeypatch):
    import transformers

    saved = folders[2]
    saved_bf16 = transformers.LlamaForCausalLM(saved.config)
    saved_bf16.load_state_dict(saved.state_dict())
    saved_bf16.to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="100KB")
    # Every tensor converted on this thread (transformers otherwise reads them in a pool of
    # threads, which a dispatch mode, being per thread, does not see).
    monkeypatch.setenv("HF_DEACTIVATE_ASYNC_LOAD", "1")
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    with _Float32Bytes() as counted:
        model = load_pretrained(tmp_path, model_class(config), config, torch.bfloat16)
    fp32_model = sum(p.numel() * 4 for p in saved.parameters())
    # Built on the meta device and loaded straight into bf16: the float32 made is the rotary
    # tables (a few hundred bytes), never the model. Building it on the host first, or
    # loading in fp32 and casting after, makes all of its 0.4 MB: this fails then.
    assert counted.bytes < fp32_model / 100, (counted.bytes, fp32_model)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with _Float32Bytes() as counted:
        load_pretrained(tmp_path, model_class(config), config, torch.float32)
    assert counted.bytes > fp32_model / 5  # the check sees an upcast when there is one


@pytest.mark.parametrize("which", [0, 1], ids=["single", "sharded"])
def test_an_fp32_checkpoint_loads_in_bf16_tied(folders, which):
    import transformers

    folder = folders[which]
    saved = folders[2]  # the sharded copy was saved from the same seed: the same values
    config = transformers.AutoConfig.from_pretrained(folder)
    model = load_pretrained(folder, model_class(config), config, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied stays tied
    for name, p in saved.state_dict().items():
        assert torch.equal(model.state_dict()[name], p.to(torch.bfloat16)), name


def test_fp32_loads_the_saved_values_exactly(folders):
    import transformers

    single, _, saved = folders
    config = transformers.AutoConfig.from_pretrained(single)
    model = load_pretrained(single, model_class(config), config, torch.float32)
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in saved.state_dict().items())


def test_untied_checkpoint_loads_both_matrices(tmp_path):
    import transformers

    saved = save_tiny_llama(tmp_path / "m", tokenizer=False, tie=False)
    config = transformers.AutoConfig.from_pretrained(tmp_path / "m")
    model = load_pretrained(tmp_path / "m", model_class(config), config, torch.float32)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, saved.lm_head.weight)


def test_corrupt_shard_is_named(tmp_path, folders):
    import transformers

    _, sharded, _ = folders
    for f in sharded.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    bad = sorted(tmp_path.glob("model-*.safetensors"))[0]
    bad.write_bytes(b"\x00garbage" * 10)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    with pytest.raises(WeightsError) as e:
        load_pretrained(tmp_path, model_class(config), config, torch.float32)
    _one_sentence(e.value, str(bad), "not a readable safetensors file")


def test_checkpoint_of_another_model_is_refused(tmp_path):
    import transformers

    save_tiny_llama(tmp_path, tokenizer=False)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    config.num_hidden_layers = 3  # the checkpoint has two layers' tensors
    with pytest.raises(WeightsError) as e:
        load_pretrained(tmp_path, model_class(config), config, torch.float32)
    _one_sentence(e.value, "lack", "model.layers.2.", "does not match its config.json")


def test_unreachable_hub_says_how_to_download(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(WeightsError) as e:
        hub_folder("memfit-tests/no-such-model", weights=False)
    _one_sentence(
        e.value,
        "cannot be reached",
        "hf download memfit-tests/no-such-model --local-dir DIR",
        "huggingface-cli download memfit-tests/no-such-model --local-dir DIR",
        "pass --model DIR",
    )
