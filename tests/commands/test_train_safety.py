"""``memfit train`` loses nothing and says why in one sentence: a checkpoint save on a full
disk, a given plan over the budget given, damaged weights and checkpoints found before any
work, resuming from the newest whole checkpoint or a named one, a resume that has no step
left."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memfit.cli import app
from memfit.train.checkpoint import list_checkpoints

runner = CliRunner()
TINY = ["--model", "gpt2-tiny", "--batch-size", "2", "--seq-len", "16", "--seed", "0"]


def _train(*args: str):
    return runner.invoke(app, ["train", *TINY, *args], env={"COLUMNS": "400"})


def _one_sentence(res, *needles: str) -> str:
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    assert "Traceback" not in res.output
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, res.output
    for needle in needles:
        assert needle in text, text
    return text


def _unwrapped(res) -> str:
    # The console wraps long lines where they reach its width (a path included): joined back.
    return res.output.replace("\n", "")


def _damage(folder):
    p = folder / "model.safetensors"
    data = bytearray(p.read_bytes())
    data[-1] ^= 0xFF
    p.write_bytes(bytes(data))


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.slow
def test_a_checkpoint_save_on_a_full_disk_is_one_sentence_and_keeps_the_last(tmp_path, monkeypatch):
    from safetensors import SafetensorError
    from safetensors import torch as st

    ck = tmp_path / "ck"
    real, calls = st.save_file, []

    def full_on_the_second_save(tensors, filename, *args, **kwargs):
        calls.append(filename)
        if "step-00000002" in str(filename):  # what safetensors raises on a full disk
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(st, "save_file", full_on_the_second_save)
    res = _train("--max-steps", "2", "--save-every", "1", "--checkpoint-dir", str(ck))
    _one_sentence(res, "could not write checkpoint step-00000002", "the disk is full",
                  "the previous checkpoint step-00000001 is intact")
    assert [p.name for p in list_checkpoints(ck)] == ["step-00000001"]
    assert sorted(p.name for p in ck.iterdir()) == ["step-00000001"]  # no temporary, no lock
    # ... and it is whole: the next run resumes from it.
    monkeypatch.setattr(st, "save_file", real)
    res = _train("--max-steps", "2", "--checkpoint-dir", str(ck), "--resume")
    assert res.exit_code == 0, res.output
    assert f"resuming from {ck / 'step-00000001'}" in _unwrapped(res)


@pytest.mark.slow
def test_a_given_plan_is_predicted_and_refused_over_the_budget_given(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"precision": {"mode": "fp32"}}))
    res = _train("--plan", str(plan), "--budget", "1MiB", "--max-steps", "1")
    _one_sentence(res, "the plan's predicted peak", "is over the budget of 1.00 MiB (--budget 1MiB)")
    assert "loss" not in res.output  # refused before training
    # Without a budget it is predicted and held to none.
    res = _train("--plan", str(plan), "--max-steps", "1")
    assert res.exit_code == 0, res.output
    line = next(x for x in res.output.splitlines() if x.startswith("plan (given)"))
    assert "predicted peak" in line and "no --budget given" in line and "48.00 MiB" not in line


@pytest.mark.slow
def test_resume_latest_good_and_resume_from(tmp_path):
    ck = tmp_path / "ck"
    assert _train("--max-steps", "2", "--save-every", "1", "--checkpoint-dir", str(ck)).exit_code == 0
    _damage(ck / "step-00000002")
    before = _files(ck / "step-00000001")
    text = _one_sentence(_train("--max-steps", "3", "--checkpoint-dir", str(ck), "--resume"),
                         "the latest checkpoint is damaged", "--resume latest-good",
                         f"--resume-from {ck / 'step-00000001'}")
    assert "tokens" not in text  # found before the text was read
    res = _train("--max-steps", "3", "--checkpoint-dir", str(ck), "--resume", "latest-good",
                 "--json", str(tmp_path / "r.json"))
    assert res.exit_code == 0, res.output
    out = _unwrapped(res)
    assert f"resuming from {ck / 'step-00000001'} (passed over the damaged step-00000002)" in out
    assert f"in 2 steps (2 to 3; resumed from {ck / 'step-00000001'})" in out
    data = json.loads((tmp_path / "r.json").read_text())
    assert (data["steps"], data["steps_run"]) == (3, 2)
    assert data["resumed_from"] == str(ck / "step-00000001")
    assert _files(ck / "step-00000001") == before  # read, never written
    # A named checkpoint; new checkpoints go to the folder holding it.
    res = _train("--max-steps", "2", "--resume-from", str(ck / "step-00000001"))
    assert res.exit_code == 0, res.output
    assert "in 1 steps (2 to 2;" in _unwrapped(res)


@pytest.mark.slow
def test_no_step_left_says_to_raise_max_steps(tmp_path):
    ck = tmp_path / "ck"
    assert _train("--max-steps", "1", "--checkpoint-dir", str(ck)).exit_code == 0
    _one_sentence(_train("--max-steps", "1", "--checkpoint-dir", str(ck), "--resume"),
                  "max_steps is 1", "raise --max-steps", "above 1")


def test_an_unknown_resume_word_is_one_sentence(tmp_path):
    _one_sentence(_train("--checkpoint-dir", str(tmp_path), "--resume", "newest"),
                  "resume must be true, false, 'latest' or 'latest-good'")


@pytest.mark.slow
def test_cut_weights_are_named_before_any_work(tmp_path):
    import transformers

    folder = tmp_path / "model"
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=300, n_positions=64)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    res = runner.invoke(app, ["train", "--model", str(folder), "--max-steps", "1", "--seq-len", "16"],
                        env={"COLUMNS": "400"})
    _one_sentence(res, f"weights file {str(weights)!r} is cut short", "download or copy it again")
    assert "tokens" not in res.output


@pytest.mark.slow
def test_a_sequence_longer_than_the_machine_can_hold_is_one_sentence(tmp_path):
    # byte-gpt's position table alone would be 1e9 x 128 floats (512 GB): torch's allocator
    # fails with a logged traceback if the model is ever built.
    (tmp_path / "text.txt").write_text(" ".join(["alpha", "beta", "gamma"] * 500))
    (tmp_path / "run.yaml").write_text("eval_fraction: 0\n")
    res = runner.invoke(app, ["train", "--config", str(tmp_path / "run.yaml"), "--data",
                              str(tmp_path / "text.txt"), "--seq-len", "1000000000",
                              "--max-steps", "1"], env={"COLUMNS": "400"})
    _one_sentence(res, "the run needs", "by its predicted peak", "in all; lower --seq-len")
