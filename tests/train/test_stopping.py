"""The one stop flag (memfit.train.stopping): SIGTERM and SIGINT set it, every long loop of a run
reads it (training steps, each evaluation batch, data preparation), a second signal interrupts
at once; and the evaluation bound (``eval_max_batches``) that keeps a huge held-out split from
making an evaluation endless (issue 37)."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from memfit.plan import Plan
from memfit.train import TrainConfig, Trainer
from memfit.train.checkpoint import list_checkpoints
from memfit.train.config import DEFAULT_EVAL_BATCHES, ConfigError
from memfit.train.data import TextDataset
from memfit.train.stopping import STOP, StopRequested, catch_signals, exit_code
from memfit.train.tokenizer import ByteTokenizer

from ._helpers import text_dataset, tiny_gpt2


class CountingSamples(torch.utils.data.Dataset):
    """``n`` samples of 8 tokens made on demand (a million costs nothing until read); counts
    the samples read, and calls ``at(i)`` before making sample ``i`` when given."""

    def __init__(self, n: int, at=None) -> None:
        self.n, self.at, self.read = n, at, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self.at is not None:
            self.at(i)
        self.read += 1
        ids = (torch.arange(8) + i) % 250
        return {"input_ids": ids, "labels": ids.clone()}


def _trainer(tmp_path, eval_data, **kw) -> Trainer:
    settings = dict(batch_size=4, max_steps=2, warmup_steps=1, seed=0, progress=False,
                    checkpoint_dir=tmp_path / "run")
    settings.update(kw)
    return Trainer(tiny_gpt2(), Plan(), text_dataset(), eval_data=eval_data, **settings)


# ---------------------------------------------------------------------------------- the flag
def test_first_signal_sets_the_flag_second_interrupts_and_handlers_are_put_back():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with catch_signals() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGINT)  # a first Ctrl-C: no KeyboardInterrupt
        assert stop.signal_name == "SIGINT" and exit_code(stop.signum) == 130
        with pytest.raises(StopRequested) as info:
            stop.check()
        assert info.value.code == 130
        with pytest.raises(KeyboardInterrupt) as hard:
            os.kill(os.getpid(), signal.SIGTERM)  # a second signal: at once
        assert hard.value.code == 143  # the signal that ended the process
    assert {s: signal.getsignal(s) for s in before} == before
    assert not STOP.requested  # a later run (or dataset) is not stopped by this one's signal


def test_under_a_launcher_a_repeated_signal_is_the_same_stop():
    with catch_signals(second_interrupts=False) as stop:
        os.kill(os.getpid(), signal.SIGINT)  # from the terminal
        os.kill(os.getpid(), signal.SIGINT)  # forwarded by the launcher: no interrupt
        assert stop.signal_name == "SIGINT"
    with catch_signals() as stop, pytest.raises(KeyboardInterrupt):  # the default again
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)


def test_nested_blocks_keep_what_the_outer_one_caught_and_a_new_run_starts_clear():
    with catch_signals():
        os.kill(os.getpid(), signal.SIGTERM)
        with catch_signals() as inner:  # the trainer's block inside a command's
            assert inner.signal_name == "SIGTERM"
    with catch_signals() as fresh:
        assert not fresh.requested


# ---------------------------------------------------------------------------------- training
def test_sigint_stops_training_like_sigterm_with_a_checkpoint(tmp_path):
    trainer = _trainer(tmp_path, None, max_steps=6)
    real, calls = trainer.stream.next_batch, []

    def next_batch():
        calls.append(1)
        if len(calls) == 2:  # Ctrl-C while the second step's batch is made
            os.kill(os.getpid(), signal.SIGINT)
        return real()

    trainer.stream.next_batch = next_batch
    result = trainer.fit()
    assert result.stopped_by == "SIGINT" and result.steps == 2  # the step in flight finishes
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step-00000002"]


def test_sigterm_during_evaluation_stops_it_within_one_batch_and_saves(tmp_path):
    batch_size, signal_at = 4, 3  # SIGTERM while the third evaluation batch is made

    def at(i):
        if i == (signal_at - 1) * batch_size:
            os.kill(os.getpid(), signal.SIGTERM)

    held_out = CountingSamples(10_000, at)
    trainer = _trainer(tmp_path, held_out, eval_every=1, eval_max_batches=0, max_steps=5)
    result = trainer.fit()
    assert result.stopped_by == "SIGTERM" and result.steps == 1
    # The batch being made when the signal came is the last one evaluated.
    assert result.eval_batches == [(1, signal_at)]
    assert held_out.read == signal_at * batch_size
    assert result.eval_losses == []  # a cut evaluation's mean is over an arbitrary part
    assert result.checkpoint is not None and result.checkpoint.endswith("step-00000001")


# ---------------------------------------------------------------------------------- bound
def test_default_evaluation_of_a_million_held_out_samples_is_bounded(tmp_path):
    held_out = CountingSamples(1_000_000)
    trainer = _trainer(tmp_path, held_out, max_steps=1, checkpoint_dir=None)
    assert trainer.config.eval_max_batches is None  # the default, not a test setting
    result = trainer.fit()
    assert result.eval_batches == [(1, DEFAULT_EVAL_BATCHES)]
    assert held_out.read == DEFAULT_EVAL_BATCHES * 4  # read, not only reported
    assert len(result.eval_losses) == 1


def test_eval_max_batches_bounds_and_zero_reads_the_whole_split(tmp_path):
    held_out = CountingSamples(22)  # 6 batches of 4, the last one short
    result = _trainer(tmp_path, held_out, max_steps=1, eval_max_batches=2,
                      checkpoint_dir=None).fit()
    assert result.eval_batches == [(1, 2)] and held_out.read == 8
    held_out = CountingSamples(22)
    result = _trainer(tmp_path, held_out, max_steps=1, eval_max_batches=0,
                      checkpoint_dir=None).fit()
    assert result.eval_batches == [(1, 6)] and held_out.read == 22


def test_eval_max_batches_setting():
    assert TrainConfig().eval_batch_limit == DEFAULT_EVAL_BATCHES
    assert TrainConfig(eval_max_batches=0).eval_batch_limit is None
    assert TrainConfig.from_dict({"eval_max_batches": 3}).eval_batch_limit == 3
    with pytest.raises(ConfigError, match="eval_max_batches must be a whole number >= 0, got -1"):
        TrainConfig(eval_max_batches=-1)


def test_the_plan_line_says_the_evaluation_bound():
    from memfit.commands.train import eval_line

    line = eval_line(TrainConfig(eval_every=50), 1_000_000, 16)
    assert line == (
        "eval: 16 of 62,500 batches (256 of 1,000,000 held-out samples) every 50 steps and "
        "after the last"
    )
    assert eval_line(TrainConfig(eval_max_batches=0), 30, 16).startswith("eval: 2 of 2 batches")


# ---------------------------------------------------------------------------------- data
def test_a_signal_stops_tokenising_before_the_next_document():
    seen = []

    class Tokenizer(ByteTokenizer):
        def encode(self, text):
            seen.append(text)
            if len(seen) == 3:
                os.kill(os.getpid(), signal.SIGTERM)
            return super().encode(text)

    with catch_signals(), pytest.raises(StopRequested) as info:
        TextDataset([f"document {i}" for i in range(1000)], Tokenizer(), 16)
    assert info.value.code == 143 and len(seen) == 3


def test_a_signal_before_training_starts_raises_stop_requested(tmp_path):
    trainer = _trainer(tmp_path, None)
    with catch_signals():
        STOP.request(signal.SIGTERM)  # came while the run was prepared
        with pytest.raises(StopRequested):
            trainer.fit()
    assert trainer.step_count == 0 and not list((tmp_path / "run").glob("step-*"))
