"""Checkpoints: tied weights in safetensors, crash safety, pruning, bit-exact resume."""

from __future__ import annotations

import shutil

import pytest
import torch

from memfit.plan import Plan
from memfit.train import Trainer
from memfit.train import checkpoint as ckpt
from memfit.train.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)

from ._helpers import params, text_dataset, tiny_gpt2


def _trained(seed: int = 0):
    model = tiny_gpt2(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 259, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def test_tied_weights_round_trip(tmp_path):
    model, opt = _trained()
    assert model.lm_head.weight is model.transformer.wte.weight  # GPT-2 ties them
    path = save_checkpoint(tmp_path, 1, model, opt)
    fresh = tiny_gpt2(seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    state = load_checkpoint(path, fresh, fresh_opt)
    assert state["step"] == 1
    for name, p in model.state_dict().items():
        assert torch.equal(p, fresh.state_dict()[name]), name
    assert fresh.lm_head.weight is fresh.transformer.wte.weight  # still tied after loading
    for a, b in zip(opt.state.values(), fresh_opt.state.values(), strict=True):
        assert torch.equal(a["exp_avg"], b["exp_avg"])


def test_keeps_the_last_k_and_finds_the_latest(tmp_path):
    model, opt = _trained()
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, model, opt, keep=3)
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "step-00000003",
        "step-00000004",
        "step-00000005",
    ]
    assert latest_checkpoint(tmp_path).name == "step-00000005"
    save_checkpoint(tmp_path, 5, model, opt, keep=3)  # re-saving a step replaces it
    assert len(list_checkpoints(tmp_path)) == 3
    assert latest_checkpoint(tmp_path / "none") is None


def test_crash_mid_write_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    model, opt = _trained()
    save_checkpoint(tmp_path, 1, model, opt)
    before = params(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    real_write = ckpt.write_manifest

    def crashing_write(folder, step, extra=None):
        # The data files are written, then the process "dies" while writing the manifest.
        (folder / "manifest.json").write_text('{"half a')
        raise KeyboardInterrupt("simulated crash")

    monkeypatch.setattr(ckpt, "write_manifest", crashing_write)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, model, opt)
    assert real_write is not crashing_write
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path).name == "step-00000001"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    fresh = tiny_gpt2(seed=1)
    load_checkpoint(tmp_path, fresh)  # the run folder: its latest complete checkpoint
    for name, p in fresh.named_parameters():
        assert torch.equal(p, before[name]), name


def test_a_killed_write_is_ignored_and_cleaned_up(tmp_path):
    model, opt = _trained()
    save_checkpoint(tmp_path, 1, model, opt)
    # What kill -9 in the middle of a write leaves: a temporary folder with partial files.
    leftover = tmp_path / ".tmp-step-00000002-999999-deadbeef"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"\x00" * 10)
    assert latest_checkpoint(tmp_path).name == "step-00000001"
    save_checkpoint(tmp_path, 2, model, opt)
    assert not leftover.exists()
    assert latest_checkpoint(tmp_path).name == "step-00000002"


def test_missing_checkpoint_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_checkpoint(tmp_path, tiny_gpt2())


def _trainer(checkpoint_dir, *, resume=False, seed=0, plan=None, max_steps=6, every=3,
             warmup=2):  # fmt: skip
    return Trainer(
        tiny_gpt2(seed=seed, dropout=0.1),  # dropout: the RNG state must be restored too
        plan or Plan(micro_batch_size=2, grad_accum_steps=2),
        text_dataset(),
        batch_size=4,
        lr=1e-2,
        warmup_steps=warmup,
        max_steps=max_steps,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=every,
        keep_checkpoints=5,
        resume=resume,
        seed=0,
        progress=False,
    )


def test_resume_is_bit_exact(tmp_path):
    run = tmp_path / "run"
    full = _trainer(run)
    result = full.fit()
    assert result.steps == 6
    # Resume from the step-3 checkpoint in a fresh folder, with a differently initialised model.
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(run / "step-00000003", resumed_dir / "step-00000003")
    resumed = _trainer(resumed_dir, resume=True, seed=123)
    again = resumed.fit()
    assert again.steps == 6
    assert again.losses[:3] == result.losses[:3]  # carried over from the checkpoint
    assert again.losses[3:] == result.losses[3:]  # recomputed bit for bit
    for (name, a), b in zip(full.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert resumed.scheduler.get_last_lr() == full.scheduler.get_last_lr()


@pytest.mark.parametrize(
    "plan",
    [
        {"optimizer": {"name": "adamw8bit"}},
        {"optimizer": {"name": "adafactor"}},
        {"optimizer_in_backward": True, "max_grad_norm": 1.0, "grad_clip_mode": "approx"},
        {"precision": {"mode": "fp16-mixed"}},
        {"offload": {"optimizer": "host", "pin_memory": False}},
        {"offload": {"optimizer": "host"}, "optimizer_in_backward": True},
    ],
    ids=["8bit", "factored", "in-backward", "fp16-scaler", "offload", "offload-in-backward"],
)
def test_every_optimizer_state_resumes_bit_exactly_without_pickle(tmp_path, plan):
    def trainer(folder, resume=False, seed=0):
        return _trainer(folder, resume=resume, seed=seed, plan=Plan.from_dict(plan), max_steps=4,
                        every=2, warmup=1)  # fmt: skip

    full = trainer(tmp_path / "run")
    result = full.fit()
    assert not list((tmp_path / "run").rglob("*.pt"))  # nothing pickled
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(tmp_path / "run" / "step-00000002", resumed_dir / "step-00000002")
    again = trainer(resumed_dir, resume=True, seed=7).fit()
    assert again.losses == result.losses
    assert again.params_sha256 == result.params_sha256


def test_params_sha256_is_the_hash_of_the_parameter_bytes():
    import hashlib

    from memfit.train.manifest import params_sha256

    model = tiny_gpt2()
    h = hashlib.sha256()
    for _, p in model.named_parameters():
        h.update(p.detach().numpy().tobytes())
    assert params_sha256(model) == h.hexdigest()
    with torch.no_grad():  # one ulp of one weight changes it
        w = model.transformer.h[0].mlp.c_fc.weight
        w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(1.0))
    assert params_sha256(model) != h.hexdigest()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_an_offloaded_optimizer_state_resumes_bit_exactly(tmp_path, tier):
    # Through apply_plan and the checkpoint functions directly (the Trainer's run is above).
    # The disk tier's state_dict reads its files into the host tier's format.
    from memfit.apply.compose import apply_plan

    disk = tmp_path / "disk"
    disk.mkdir()
    plan = Plan.from_dict(
        {"offload": {"optimizer": tier, "pin_memory": False, "disk_dir": str(disk)}}
    )
    ids = torch.randint(0, 259, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}

    def setup(seed):
        model = tiny_gpt2(seed)
        return model, apply_plan(model, plan, loss_fn=lambda out, b: out.loss)

    model, a = setup(0)
    for _ in range(2):
        a.step(batch)
    path = save_checkpoint(tmp_path / "ck", 2, model, a.optimizer)
    assert not list((tmp_path / "ck").rglob("*.pt"))
    fresh, b = setup(5)
    load_checkpoint(path, fresh, b.optimizer)
    assert a.step(batch).item() == b.step(batch).item()
    for (name, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q), name
