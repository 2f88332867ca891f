"""Peers' 8-bit optimizers in plans: built when installed, a clear sentence when not, and
memfit's AdamW8bit (the same state layout) standing in for them in a dry run."""

from __future__ import annotations

import importlib
import importlib.util
import json

import pytest
import torch

import memfit
from memfit.optim import AdamW8bit, state_bytes
from memfit.optim import registry as optim_registry
from memfit.optim.config import OptimizerConfig
from memfit.planner.candidates import state_bytes_per_parameter

CONFIG = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64,
          "n_layer": 2, "n_head": 2, "vocab_size": 256, "n_positions": 64}  # fmt: skip


#: The peers' optimizers: those whose class comes from a package of their own.
PEERS = {s.name: s.package for s in optim_registry.specs() if s.package is not None}


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


@pytest.mark.parametrize("name", sorted(PEERS))
def test_a_missing_library_is_one_sentence(monkeypatch, name):
    package = PEERS[name]
    real = importlib.import_module

    def missing(mod, *args, **kwargs):
        if mod.split(".")[0] == package:
            raise ImportError(mod)
        return real(mod, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", missing)
    with pytest.raises(ValueError, match=f"needs {package}, which is not installed here"):
        OptimizerConfig(name=name).build([torch.nn.Parameter(torch.zeros(4))])


@pytest.mark.parametrize("name", sorted(PEERS))
def test_plans_name_them_and_the_planner_knows_their_state(name):
    plan = memfit.Plan(optimizer={"name": name, "lr": 1e-3})
    assert memfit.Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    # The layout of memfit's 8-bit AdamW: 2 bytes of codes per element plus an fp32 maximum
    # per 256 elements, on the 256 x 256 probe; the bias keeps 8 bytes of fp32 moments.
    weight, bias = 256 * 256, 256
    want = (2 * weight + 2 * 4 * weight // 256 + 8 * bias) / (weight + bias)
    assert state_bytes_per_parameter(OptimizerConfig(name=name)) == pytest.approx(want, abs=0.01)


@pytest.mark.parametrize("name", sorted(PEERS))
def test_dry_run_stands_in_with_memfits_layout(tmp_path, name):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    peer = memfit.dry_run(str(path), memfit.Plan(optimizer=name), batch_size=2, seq_len=16)
    ours = memfit.dry_run(str(path), memfit.Plan(optimizer={"name": "adamw8bit",
                                                            "kwargs": {"min_8bit_size": 4096}}),
                          batch_size=2, seq_len=16)  # fmt: skip
    assert peer.peak_by_category == ours.peak_by_category


@pytest.mark.parametrize(
    "name",
    [
        # torchao's 8-bit AdamW compiles its step: inductor starts the C++ compiler.
        pytest.param(n, marks=pytest.mark.subprocess) if n.startswith("torchao") else n
        for n in sorted(PEERS)
    ],
)
def test_the_real_peer_steps_with_the_state_it_claims(name):
    package = PEERS[name]
    if not _installed(package):
        pytest.skip(f"{package} is not installed (pip install memfit[bench])")
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(512, 256))
    w.grad = torch.randn_like(w)
    before = w.detach().clone()
    opt = OptimizerConfig(name=name).build([w])
    assert type(opt).__module__.startswith(package)
    opt.step()
    assert not torch.equal(w, before)
    ref = torch.nn.Parameter(before.clone())
    ref.grad = w.grad.clone()
    ours = AdamW8bit([ref], block_size=256, min_8bit_size=4096)
    ours.step()
    # Within the peers' small extras (bitsandbytes' 1 KiB code maps, step counters).
    assert state_bytes(opt) == pytest.approx(state_bytes(ours), rel=0.02)
