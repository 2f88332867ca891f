"""The planner and the cost model know the fused loss: on by default, ruled out by ``--forbid
fused-loss``, picked when only it fits, charged one more head matmul."""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

import memfit
from memfit.cli import app
from memfit.estimate.cost import profile_workload, step_cost
from memfit.planner import NothingFits, plan
from memfit.planner.candidates import RANK_DIMENSIONS, space_pairs
from memfit.strategies.fused_loss import FusedLossConfig, fused_loss_applies
from memfit.targets import DEVICES
from memfit.workload import load_workload

# Everything else on by default is ruled out, so the fused loss is the only way to fit.
OTHERS = ("accumulation", "checkpointing", "mixed-precision", "fused-step", "foreach-off")
# A GPT-2 whose fp32 logits (512 tokens x 32768 x 4 = 64 MiB, as much again for their
# gradient) dwarf its 1.1M parameters: plain peak 211 MiB, fused 40 MiB (dry runs).
CONFIG = {
    "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 32768,
    "n_positions": 128, "n_embd": 32, "n_layer": 2, "n_head": 2, "use_cache": False,
    "bos_token_id": 0, "eos_token_id": 0,
}  # fmt: skip
DIM = RANK_DIMENSIONS.index("fused_loss")


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    path = tmp_path_factory.mktemp("fused") / "config.json"
    path.write_text(json.dumps(CONFIG))
    return str(path)


@pytest.fixture(scope="module")
def budget(spec):
    """Halfway between the fused and the plain peak: only the fused loss fits."""
    workload = load_workload(spec, 4, 128)
    plain = memfit.dry_run(workload, memfit.Plan()).peak_bytes
    fused = memfit.dry_run(workload, memfit.Plan(fused_loss=True)).peak_bytes
    assert plain - fused >= 2 * 64 * 2**20  # fp32 logits and gradient, less one chunk, and more
    return (plain + fused) // 2


def test_fused_loss_is_a_search_dimension_ranked_leaner_and_on_by_default(spec):
    workload = load_workload(spec, 4, 128)
    pairs = space_pairs(workload, memfit.Plan(), (), OTHERS, DEVICES["h100"])
    assert [(p.fused_loss, r[DIM]) for p, r in pairs] == [(None, 0), (FusedLossConfig(), 1)]
    forbidden = space_pairs(workload, memfit.Plan(), (), (*OTHERS, "fused-loss"), DEVICES["h100"])
    assert [p.fused_loss for p, _ in forbidden] == [None]


def test_a_model_the_fused_loss_cannot_take_gets_no_fused_candidates():
    bert = load_workload("bert-tiny", 2, 16)
    assert not fused_loss_applies(bert)
    pairs = space_pairs(bert, memfit.Plan(), (), OTHERS, DEVICES["h100"])
    assert [p.fused_loss for p, _ in pairs] == [None]
    assert fused_loss_applies(load_workload("gpt2-tiny", 2, 16))


def test_planner_picks_the_fused_loss_on_a_budget_only_it_fits(spec, budget):
    workload = load_workload(spec, 4, 128)
    result = plan(workload, budget, forbid=OTHERS, device="cpu")
    assert result.fits and result.predicted_device_total_bytes <= budget
    assert result.plan == memfit.Plan(optimizer=result.plan.optimizer, fused_loss=True)
    with pytest.raises(NothingFits):
        plan(workload, budget, forbid=(*OTHERS, "fused-loss"), device="cpu")


def test_cli_forbid_fused_loss(spec, budget, tmp_path):
    runner = CliRunner()
    base = ["plan", "--model", spec, "-b", "4", "-l", "128", "--budget", f"{budget}B",
            "--device", "cpu", "--forbid", ",".join(OTHERS)]  # fmt: skip
    out = tmp_path / "plan.json"
    res = runner.invoke(app, [*base, "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["plan"]["fused_loss"] == {
        "chunk_size": None, "training_only": True,
    }  # fmt: skip
    base[-1] += ",fused-loss"
    res = runner.invoke(app, base)
    assert res.exit_code != 0 and "smallest peak reachable" in res.output
    assert "fused-loss" in runner.invoke(app, ["plan", "--help"]).output


def test_cost_model_charges_one_more_head_forward():
    workload = load_workload("gpt2-tiny", 4, 32)
    profile = profile_workload(workload)
    # gpt2-tiny: hidden 64, vocabulary 1000, 32 tokens a sample; 2 FLOPs a multiply-add.
    assert profile.head_fwd_flops_per_sample == 2 * 32 * 64 * 1000
    device = DEVICES["h100"]
    plain = step_cost(profile, memfit.Plan(), device, batch_size=4)
    fused = step_cost(profile, memfit.Plan(fused_loss=True), device, batch_size=4)
    tokens = 4 * 32
    rate = device.flops["fp32"] * device.matmul_efficiency * tokens / (tokens + device.half_tokens)
    assert fused.matmul - plain.matmul == pytest.approx(4 * 2 * 32 * 64 * 1000 / rate, rel=1e-9)
    assert dataclasses.replace(fused, matmul=plain.matmul) == plain  # nothing else changes
