"""``memfit train --model DIR``: a fine-tune of saved weights (a Hugging Face model folder),
checked against transformers' own loss; ``memfit profile/plan --model DIR`` read only its
config; bad folders fail with one sentence naming the file and exit code 2."""

from __future__ import annotations

import json
import random

import pytest
import torch
from typer.testing import CliRunner

from memfit.cli import app
from memfit.train.config import TrainConfig
from memfit.train.run import prepare_run
from tests.models import TINY_WORDS, save_tiny_llama

runner = CliRunner()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A sharded tiny Llama with its tokenizer, a JSONL file of text in its words, and plans."""
    root = tmp_path_factory.mktemp("pretrained")
    save_tiny_llama(root / "llama", shard=True)
    rng = random.Random(0)
    lines = [
        json.dumps({"text": " ".join(rng.choice(TINY_WORDS[:6]) for _ in range(30))})
        for _ in range(120)
    ]
    (root / "text.jsonl").write_text("\n".join(lines) + "\n")
    (root / "fp32.json").write_text(json.dumps({"micro_batch_size": 4}))
    (root / "bf16.json").write_text(json.dumps({"precision": "bf16-pure"}))
    return root


def _train(*args: str):
    return runner.invoke(app, ["train", *args])


def _transformers_eval_loss(folder, data, plan, dtype=torch.float32, tokenizer=None) -> float:
    """The loss transformers itself computes on the run's evaluation samples (one batch: the
    run holds back 2% of them), from the saved weights."""
    import transformers

    config = TrainConfig(model=str(folder), data=(str(data),), plan=str(plan), tokenizer=tokenizer)
    run = prepare_run(config)
    samples = [run.eval[i] for i in range(len(run.eval))]
    assert 0 < len(samples) <= 16  # one evaluation batch (the default batch size)
    batch = run.collate(samples)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    with torch.no_grad():
        return float(model(**batch).loss)


@pytest.mark.slow
def test_fine_tunes_saved_weights_from_their_loss(saved, tmp_path):
    out = tmp_path / "run.json"
    res = _train(
        "--model", str(saved / "llama"), "--data", str(saved / "text.jsonl"),
        "--plan", str(saved / "fp32.json"), "--max-steps", "8", "--json", str(out),
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    (step0, first), (last_step, last) = data["eval_losses"][0], data["eval_losses"][-1]
    assert step0 == 0 and last_step == 8
    expected = _transformers_eval_loss(saved / "llama", saved / "text.jsonl", saved / "fp32.json")
    # The same fp32 weights, batch and kernels: equal to float rounding of the averaging.
    assert first == pytest.approx(expected, rel=1e-6, abs=0)
    assert last < first - 0.1  # it learns the text's six words
    assert data["tokenizer"].startswith("PretrainedTokenizer(")  # the folder's own
    output = " ".join(res.output.split())
    assert "with the saved weights of" in output and "step 0: eval loss" in output
    assert f"eval loss {first:.4f} (the saved weights) -> {last:.4f} after step 8" in output


@pytest.mark.slow
def test_bf16_pure_loads_in_bf16_with_another_tokenizer_folder(saved, tmp_path, monkeypatch):
    import memfit.workload as workload_module

    # A model folder without a tokenizer, and the tokenizer's folder given apart.
    save_tiny_llama(tmp_path / "bare", tokenizer=False)
    loads = []
    real = workload_module.load_pretrained

    def recording(folder, cls, config, dtype, device=None):
        model = real(folder, cls, config, dtype, device)
        loads.append((dtype, {p.dtype for p in model.parameters()}))
        return model

    monkeypatch.setattr(workload_module, "load_pretrained", recording)
    out = tmp_path / "run.json"
    res = _train(
        "--model", str(tmp_path / "bare"), "--tokenizer", str(saved / "llama"),
        "--data", str(saved / "text.jsonl"), "--plan", str(saved / "bf16.json"),
        "--max-steps", "2", "--json", str(out),
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    # Loaded straight into bf16: the plan's dtype is asked for, and nothing else is made.
    assert loads == [(torch.bfloat16, {torch.bfloat16})]
    data = json.loads(out.read_text())
    assert data["tokenizer"] == f"PretrainedTokenizer({str(saved / 'llama')!r}, vocab_size=21)"
    expected = _transformers_eval_loss(
        tmp_path / "bare", saved / "text.jsonl", saved / "bf16.json", torch.bfloat16,
        tokenizer=str(saved / "llama"),
    )
    assert data["eval_losses"][0] == [0, pytest.approx(expected, rel=1e-3)]


def test_dry_runs_read_only_the_config(saved, tmp_path):
    folder = tmp_path / "llama"
    folder.mkdir()
    for f in (saved / "llama").iterdir():
        # Every weight file garbage, the index gone: only config.json is readable.
        if f.name.endswith(".safetensors"):
            (folder / f.name).write_bytes(b"not safetensors")
        elif f.name != "model.safetensors.index.json":
            (folder / f.name).write_bytes(f.read_bytes())
    js = tmp_path / "p.json"
    res = runner.invoke(app, [
        "profile", "--model", str(folder), "--batch-size", "2", "--seq-len", "16", "--dry-run",
        "--json", str(js),
    ])  # fmt: skip
    assert res.exit_code == 0, res.output
    params = sum(p.numel() for p in save_tiny_llama(tmp_path / "ref", tokenizer=False).parameters())
    assert json.loads(js.read_text())["num_parameters"] == params
    res = runner.invoke(app, [
        "plan", "--model", str(folder), "--batch-size", "2", "--seq-len", "16",
        "--budget", "1GiB", "--json", str(tmp_path / "plan.json"),
    ])  # fmt: skip
    assert res.exit_code == 0, res.output


def _one_sentence_error(res, *needles: str) -> None:
    assert res.exit_code == 2, res.output
    message = " ".join(res.output.split())
    assert message.startswith("error:"), message
    assert message.count(". ") == 0, message  # one sentence
    for needle in needles:
        assert needle in message, message
    assert "Traceback" not in res.output


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_bad_folders_exit_2_naming_the_file(saved, tmp_path):
    data = str(saved / "text.jsonl")
    plan = str(saved / "fp32.json")

    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((saved / "llama" / "config.json").read_text())
    res = _train("--model", str(no_weights), "--data", data, "--plan", plan)
    _one_sentence_error(res, "has no weights", "model.safetensors")

    bad_config = _copy(saved / "llama", tmp_path / "bad-config")
    (bad_config / "config.json").write_text('{"model_type": "llama", ')
    res = _train("--model", str(bad_config), "--data", data, "--plan", plan)
    _one_sentence_error(res, str(bad_config / "config.json"), "is not valid JSON")

    (bad_config / "config.json").write_text('{"model_type": "no-such-model"}')
    res = _train("--model", str(bad_config), "--data", data, "--plan", plan)
    _one_sentence_error(res, str(bad_config / "config.json"), "no-such-model")

    missing = _copy(saved / "llama", tmp_path / "missing-shard")
    gone = sorted(missing.glob("model-*.safetensors"))[2]
    gone.unlink()
    res = _train("--model", str(missing), "--data", data, "--plan", plan)
    _one_sentence_error(res, str(gone), "model.safetensors.index.json", "is missing")


def test_unreachable_hub_id_says_how_to_download(saved, monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    res = _train("--model", "memfit-tests/tiny-llama", "--data", str(saved / "text.jsonl"))
    _one_sentence_error(
        res, "hf download memfit-tests/tiny-llama --local-dir DIR", "pass --model DIR"
    )
    res = runner.invoke(app, ["plan", "--model", "memfit-tests/tiny-llama", "--budget", "1GiB"])
    _one_sentence_error(res, "huggingface-cli download memfit-tests/tiny-llama --local-dir DIR")


def test_launched_processes_get_the_model_data_and_tokenizer_flags(tmp_path):
    from memfit.commands.train import _argv

    argv = _argv({
        "model": "m", "tokenizer": "t", "data": [tmp_path / "a.jsonl", tmp_path / "b.txt"],
        "batch_size": 4, "seq_len": 32, "max_steps": 3, "resume": True,
    })  # fmt: skip
    assert argv == [
        "train", "--model", "m", "--tokenizer", "t", "--batch-size", "4", "--seq-len", "32",
        "--max-steps", "3", "--data", str(tmp_path / "a.jsonl"), "--data", str(tmp_path / "b.txt"),
        "--resume",
    ]  # fmt: skip
