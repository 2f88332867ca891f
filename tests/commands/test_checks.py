"""``--data`` in ``memfit plan`` and ``memfit profile``: the plan and the profile are made for
the longest batch the data makes, with its length percentiles printed; bad data is one
sentence and exit code 2."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

import memfit.workload
from memfit.cli import app

from ..train._helpers import chat_tokenizer_dir

runner = CliRunner()


def _chat_jsonl(path, n: int = 12, long_index: int = 7):
    """Chat records whose longest is well over 3x the mean length."""
    rows = []
    for i in range(n):
        words = 40 if i == long_index else 2
        rows.append({"messages": [
            {"role": "user", "content": "what is two plus two"},
            {"role": "assistant", "content": " ".join(["it is four"] * words)},
        ]})  # fmt: skip
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture
def planned_lengths(monkeypatch):
    """The sequence lengths the command's workloads were built with."""
    seen: list[int] = []
    real = memfit.workload.load_workload

    def spy(spec, batch_size=8, seq_len=128):
        seen.append(seq_len)
        return real(spec, batch_size, seq_len)

    monkeypatch.setattr(memfit.workload, "load_workload", spy)
    return seen


def _lengths(tok, data) -> list[int]:
    from memfit.train.chat import build_dataset
    from memfit.train.tokenizer import load_tokenizer

    return build_dataset([data], load_tokenizer(tok), 1024).lengths


def test_plan_is_made_for_the_longest_record(tmp_path, planned_lengths):
    tok = chat_tokenizer_dir(tmp_path / "tok")
    data = _chat_jsonl(tmp_path / "chat.jsonl")
    lengths = _lengths(tok, data)
    assert max(lengths) >= 3 * sum(lengths) / len(lengths)
    out = tmp_path / "plan.json"
    res = runner.invoke(app, [
        "plan", "--model", "gpt2-tiny", "--budget", "1GiB", "--batch-size", "4", "--seq-len", "512",
        "--data", str(data), "--tokenizer", str(tok), "--json", str(out),
    ], env={"COLUMNS": "1000"})  # fmt: skip
    assert res.exit_code == 0, res.output
    assert planned_lengths == [max(lengths)]
    assert f"max {max(lengths)} tokens" in res.output and "p50" in res.output and "p99" in res.output
    assert f"Worst batch: 4 x {max(lengths)} tokens, any batch holding sample 7" in res.output
    assert "line 8" in res.output
    report = json.loads(out.read_text())["data_lengths"]
    assert report["max"] == max(lengths) and report["worst_batch"] == [4, max(lengths)]


def test_plan_cuts_to_seq_len_and_says_how_many(tmp_path, planned_lengths):
    tok = chat_tokenizer_dir(tmp_path / "tok")
    data = _chat_jsonl(tmp_path / "chat.jsonl")
    res = runner.invoke(app, [
        "plan", "--model", "gpt2-tiny", "--budget", "1GiB", "--batch-size", "4", "--seq-len", "40",
        "--data", str(data), "--tokenizer", str(tok),
    ], env={"COLUMNS": "1000"})  # fmt: skip
    assert res.exit_code == 0, res.output
    assert planned_lengths == [40] and "1 truncated to 40 tokens" in res.output


def test_profile_dry_runs_the_worst_batch(tmp_path, planned_lengths):
    tok = chat_tokenizer_dir(tmp_path / "tok")
    data = _chat_jsonl(tmp_path / "chat.jsonl")
    longest = max(_lengths(tok, data))
    res = runner.invoke(app, [
        "profile", "--model", "gpt2-tiny", "--dry-run", "--batch-size", "2", "--seq-len", "512",
        "--data", str(data), "--tokenizer", str(tok),
    ], env={"COLUMNS": "1000"})  # fmt: skip
    assert res.exit_code == 0, res.output
    assert planned_lengths == [longest] and f"Worst batch: 2 x {longest} tokens" in res.output


@pytest.mark.parametrize("command", ["plan", "profile"])
def test_a_chat_record_without_its_fields_is_its_line_and_exit_2(tmp_path, command):
    tok = chat_tokenizer_dir(tmp_path / "tok")
    data = _chat_jsonl(tmp_path / "chat.jsonl", n=3)
    data.write_text(data.read_text() + json.dumps({"prompt": "no messages"}) + "\n")
    base = ["--model", "gpt2-tiny"] + (["--budget", "1GiB"] if command == "plan" else ["--dry-run"])
    res = runner.invoke(app, [command, *base, "--data", str(data), "--tokenizer", str(tok)],
                        env={"COLUMNS": "1000"})  # fmt: skip
    assert res.exit_code == 2, res.output
    message = " ".join(res.output.split())
    assert message.startswith("error:") and "Traceback" not in res.output
    assert f"data file {str(data)!r} line 4 is not a chat record" in message
    assert len([ln for ln in res.output.splitlines() if ln.startswith("error:")]) == 1


def test_chat_data_and_the_byte_tokenizer_is_one_sentence(tmp_path):
    data = _chat_jsonl(tmp_path / "chat.jsonl", n=2)
    res = runner.invoke(app, ["plan", "--model", "gpt2-tiny", "--budget", "1GiB", "--data", str(data)],
                        env={"COLUMNS": "1000"})  # fmt: skip
    assert res.exit_code == 2 and "has no chat template" in res.output, res.output


def test_a_model_folders_own_tokenizer_counts_the_data(tmp_path):
    # A model folder's tokenizer (here with a chat template) counts --data as `memfit train`
    # tokenizes it, without --tokenizer; the byte tokenizer has no chat template.
    from memfit.commands.checks import data_lengths

    folder = chat_tokenizer_dir(tmp_path / "model")
    data = [_chat_jsonl(tmp_path / "chat.jsonl")]
    with_folder = data_lengths(data, None, "text", 2, 256, model=str(folder))
    explicit = data_lengths(data, folder, "text", 2, 256)
    assert with_folder.max == explicit.max > 0
    with pytest.raises(typer.Exit):
        data_lengths(data, None, "text", 2, 256, model="gpt2-tiny")  # a preset: bytes, no template
