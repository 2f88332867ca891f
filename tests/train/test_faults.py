"""Fault injection: non-finite gradients and losses, out of memory in each phase, a full disk,
corrupt checkpoints, SIGTERM, data changed between save and resume, state that would need
pickle. Each fault ends in a clear sentence or is survived, and no good checkpoint is lost."""

from __future__ import annotations

import errno
import json
import os
import signal

import pytest
import torch

from memfit.plan import Plan
from memfit.train import Trainer, TrainingDiverged
from memfit.train import checkpoint as ckpt
from memfit.train.callbacks import Callback
from memfit.train.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, read_state
from memfit.train.config import TrainConfig
from memfit.train.data import TextDataset
from memfit.train.manifest import CheckpointError, file_sha256
from memfit.train.tokenizer import ByteTokenizer

from ._helpers import params, text_dataset, tiny_gpt2


def _trainer(tmp_path, plan=None, *, model=None, data=None, config=None, **kw):
    settings = dict(
        batch_size=4,
        lr=1e-2,
        warmup_steps=1,
        max_steps=5,
        checkpoint_dir=tmp_path / "run",
        checkpoint_every=1,
        keep_checkpoints=10,
        seed=0,
        progress=False,
    )
    settings.update(kw)
    return Trainer(
        model if model is not None else tiny_gpt2(),
        plan or Plan(),
        data if data is not None else text_dataset(),
        config=config,
        **settings,
    )


class AtStep(Callback):
    """Calls ``fn(trainer)`` as step ``step`` begins (1-based), through the step context."""

    def __init__(self, step, fn):
        self.step, self.fn = step, fn

    def step_context(self, trainer, batch):
        import contextlib

        if trainer.step_count + 1 == self.step:
            self.fn(trainer)
        return contextlib.nullcontext()


# ---------------------------------------------------------------------------------- non-finite
def test_inf_gradients_with_a_scaler_skip_the_step_and_training_goes_on(tmp_path):
    model = tiny_gpt2()
    poison = {"on": False}
    # Every gradient of the embedding becomes inf during step 3's backward.
    model.transformer.wte.weight.register_hook(lambda g: g * float("inf") if poison["on"] else g)
    before: dict = {}

    def arm(trainer):
        poison["on"] = True
        before.update(params(trainer.model))

    class Disarm(Callback):
        def on_step_end(self, trainer, info):
            if info.step == 3:
                poison["on"] = False
                after = params(trainer.model)
                assert all(torch.equal(after[n], before[n]) for n in before)  # skipped

    plan = Plan(precision={"mode": "fp16-mixed"})
    trainer = _trainer(tmp_path, plan, model=model, callbacks=[AtStep(3, arm), Disarm()])
    result = trainer.fit()
    scaler = trainer.setup.precision.scaler
    assert result.steps == 5 and scaler.skipped_steps == 1
    assert scaler.scale == plan.precision.init_scale * plan.precision.backoff_factor
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert torch.isfinite(torch.tensor(result.losses[3:])).all()
    assert read_state(latest_checkpoint(tmp_path / "run"))["scaler"]["skipped_steps"] == 1


def test_a_nan_loss_without_a_scaler_stops_naming_step_and_batch(tmp_path):
    calls = {"n": 0}

    def loss_fn(out, batch):
        calls["n"] += 1
        return out.loss * float("nan") if calls["n"] == 3 else out.loss

    trainer = _trainer(tmp_path, loss_fn=loss_fn)
    good = None

    class Remember(Callback):
        def on_step_end(self, trainer, info):
            nonlocal good
            good = params(trainer.model)

    trainer.callbacks.append(Remember())
    with pytest.raises(TrainingDiverged) as e:
        trainer.fit()
    message = str(e.value)
    assert "nan at step 3 (samples [" in message and "step-00000002" in message
    assert "\n" not in message
    # The last good checkpoint is kept and holds the weights of step 2.
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step-00000001", "step-00000002"]
    fresh = tiny_gpt2(seed=3)
    load_checkpoint(tmp_path / "run", fresh)
    assert all(torch.equal(p, good[n]) for n, p in fresh.named_parameters())


# ---------------------------------------------------------------------------------- memory
def _oom(*args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory (injected).")


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_oom_in_forward_or_backward_steps_down_and_redoes_the_step(tmp_path, phase):
    model = tiny_gpt2()
    armed = {"on": False}

    def fire(*args):
        if armed["on"]:
            armed["on"] = False
            _oom()

    if phase == "forward":
        model.transformer.h[0].register_forward_pre_hook(fire)
    else:
        model.transformer.h[0].register_full_backward_pre_hook(fire)
    seen: list[list[int]] = []

    class Seen(Callback):
        def on_step_end(self, trainer, info):
            seen.append(info.indices)

    trainer = _trainer(
        tmp_path, model=model, callbacks=[AtStep(2, lambda t: armed.update(on=True)), Seen()]
    )
    result = trainer.fit()
    assert result.steps == 5 and len(result.step_downs) == 1
    assert result.step_downs[0]["step"] == 1 and "injected" in result.step_downs[0]["error"]
    assert trainer.plan.micro_batch_size == 2  # half the batch, accumulated twice
    reference = _trainer(tmp_path / "ref")
    reference.fit()
    assert seen == [list(i) for i in _indices(reference, 5)]  # no sample lost or repeated


def _indices(trainer, n):
    trainer.stream.load_state_dict({"epoch": 0, "position": 0})
    return [trainer.stream.next_batch()[0] for _ in range(n)]


def test_oom_in_the_optimizer_step_is_a_clear_error_and_the_checkpoint_stays(tmp_path):
    def arm(trainer):
        trainer.optimizer.register_step_pre_hook(_oom)

    trainer = _trainer(tmp_path, callbacks=[AtStep(3, arm)])
    with pytest.raises(torch.OutOfMemoryError, match="cannot be redone exactly"):
        trainer.fit()
    assert latest_checkpoint(tmp_path / "run").name == "step-00000002"
    read_state(tmp_path / "run")  # complete and verified


# ---------------------------------------------------------------------------------- disk
def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model = tiny_gpt2()
    ckpt.save_checkpoint(tmp_path, 1, model)
    from safetensors import torch as st

    real = st.save_file

    def full(tensors, filename, *a, **k):
        with open(filename, "wb") as f:
            f.write(b"\0" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)

    monkeypatch.setattr(st, "save_file", full)
    with pytest.raises(CheckpointError) as e:
        ckpt.save_checkpoint(tmp_path, 2, model)
    monkeypatch.setattr(st, "save_file", real)
    assert str(e.value) == (
        f"could not write checkpoint step-00000002 in {str(tmp_path)!r}: the disk is full; "
        "the previous checkpoint step-00000001 is intact"
    )
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000001"]
    load_checkpoint(tmp_path, tiny_gpt2(seed=4))


# ---------------------------------------------------------------------------------- corrupt
@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "manifest"])
def test_a_corrupt_checkpoint_is_refused_and_nothing_is_loaded(tmp_path, damage):
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters())
    path = ckpt.save_checkpoint(tmp_path, 1, model, opt)
    target = path / ("manifest.json" if damage == "manifest" else "model.safetensors")
    data = bytearray(target.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(bytes(data[:-10]))
    elif damage == "delete":
        target.unlink()
    else:
        target.write_text("{not json")
    fresh = tiny_gpt2(seed=9)
    untouched = params(fresh)
    expected = {"flip": "is corrupt", "truncate": "is corrupt", "delete": "is missing"}
    with pytest.raises(CheckpointError, match=expected.get(damage, "unreadable manifest")):
        load_checkpoint(path, fresh)
    assert all(torch.equal(p, untouched[n]) for n, p in fresh.named_parameters())


def test_a_pickle_checkpoint_of_older_memfit_is_refused(tmp_path):
    old = tmp_path / "step-00000001"
    old.mkdir()
    (old / "state.pt").write_bytes(b"pickle")
    with pytest.raises(CheckpointError, match="older memfit format that used pickle"):
        read_state(tmp_path)


def test_state_that_would_need_pickle_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(CheckpointError, match="a object is neither a tensor nor plain JSON"):
        ckpt.save_checkpoint(tmp_path, 1, tiny_gpt2(), state={"extra": {"thing": object()}})
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------- signals
def test_sigterm_saves_a_checkpoint_and_ends_the_run_cleanly(tmp_path):
    trainer = _trainer(
        tmp_path,
        checkpoint_every=None,  # only the signal makes it save mid-run
        callbacks=[AtStep(3, lambda t: os.kill(os.getpid(), signal.SIGTERM))],
    )
    previous = signal.getsignal(signal.SIGTERM)
    result = trainer.fit()
    assert result.stopped_by == "SIGTERM" and result.steps == 3
    assert result.checkpoint.endswith("step-00000003")
    assert read_state(result.checkpoint)["step"] == 3
    assert signal.getsignal(signal.SIGTERM) is previous  # the handler is put back


# ---------------------------------------------------------------------------------- data
def test_a_data_file_changed_between_save_and_resume_is_named(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 80)
    config = TrainConfig(data=(str(text),))

    def data():
        return TextDataset(text.read_text(), ByteTokenizer(), 32)

    _trainer(tmp_path, data=data(), config=config, max_steps=2).fit()
    assert read_state(tmp_path / "run")["data_files"] == {str(text): file_sha256(text)}
    text.write_text(text.read_text() + "# one more line\n")
    resumed = _trainer(tmp_path, data=data(), config=config, max_steps=4, resume=True)
    with pytest.raises(CheckpointError) as e:
        resumed.fit()
    assert str(e.value) == (
        f"data file {str(text)!r} changed since the checkpoint was saved; resume with the same "
        "data or start a new run"
    )


def test_the_manifest_lists_every_file_with_its_checksum(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 7, tiny_gpt2())
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 7
    assert sorted(manifest["files"]) == ["model.safetensors", "state.json", "state.safetensors"]
    for name, meta in manifest["files"].items():
        assert meta["sha256"] == file_sha256(path / name)
        assert meta["bytes"] == (path / name).stat().st_size
