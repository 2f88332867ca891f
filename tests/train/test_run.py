"""``prepare_run`` on chat data: the workload planned is the worst batch, not the mean one."""

from __future__ import annotations

import json

import torch

from memfit.plan import Plan
from memfit.train.config import TrainConfig
from memfit.train.run import prepare_run

from ._helpers import chat_tokenizer_dir


def _chat_file(path, long_index: int = 5, n: int = 12):
    rows = []
    for i in range(n):
        words = 30 if i == long_index else 2  # the longest record is several times the mean
        rows.append({"messages": [
            {"role": "user", "content": " ".join(["two plus two"] * 2)},
            {"role": "assistant", "content": " ".join(["it is four"] * words)},
        ]})  # fmt: skip
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_the_run_plans_for_the_longest_sample(tmp_path):
    tok = chat_tokenizer_dir(tmp_path / "tok")
    data = _chat_file(tmp_path / "chat.jsonl")
    config = TrainConfig(data=str(data), tokenizer=str(tok), seq_len=256, batch_size=4,
                         plan=Plan(), eval_fraction=0.0, max_steps=1)  # fmt: skip
    run = prepare_run(config)
    lengths = run.dataset.lengths
    assert max(lengths) >= 3 * (sum(lengths) / len(lengths))
    assert run.workload.seq_len == max(lengths) == run.lengths.max
    assert run.workload.batch_size == 4 and run.lengths.worst_batch == (4, max(lengths))
    assert run.lengths.longest == 5 and run.lengths.longest_where.endswith("line 6")
    # A batch pads to its own longest sample, never past the planned length.
    batch = run.collate([run.train[i] for i in range(4)])
    assert batch["input_ids"].shape[1] <= run.workload.seq_len
    assert (batch["labels"][batch["attention_mask"] == 0] == -100).all()
    # Cut to a shorter seq_len: the plan is made for the cut length, the cut is counted.
    short = prepare_run(config.replace(seq_len=32))
    assert short.workload.seq_len == 32 and short.lengths.truncated == 1


def test_one_step_on_chat_data_learns_only_the_answers(tmp_path):
    tok = chat_tokenizer_dir(tmp_path / "tok")
    data = _chat_file(tmp_path / "chat.jsonl")
    config = TrainConfig(data=str(data), tokenizer=str(tok), seq_len=256, batch_size=4,
                         plan=Plan(), eval_fraction=0.0, max_steps=2, warmup_steps=0)  # fmt: skip
    result = prepare_run(config).trainer(progress=False).fit()
    assert result.steps == 2 and torch.isfinite(torch.tensor(result.final_loss))
