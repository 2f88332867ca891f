"""The planner and LoRA/QLoRA: consent (``--allow lora,qlora``), the user's rank, the ranks
for dominance, and the sentence that names ``qlora`` when nothing else fits."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import memfit
from memfit.plan import Plan
from memfit.planner import NothingFits
from memfit.planner.candidates import RANK_DIMENSIONS, lora_options, space_pairs
from memfit.strategies.lora import LoraConfig
from memfit.targets import get_device
from memfit.units import parse_size
from memfit.workload import load_workload

pytest.importorskip("peft")
pytest.importorskip("torchao")

#: Where a tiny Llama's full fine-tune cannot fit and its QLoRA can (CPU, batch 2 x 16).
BUDGET = "1.2MiB"


def test_lora_is_tried_only_when_allowed_at_the_users_rank():
    assert lora_options(Plan(), ()) == (None,)
    lora = lora_options(Plan(), ("lora",), rank=8)
    assert lora == (None, LoraConfig(rank=8), LoraConfig(rank=8, target_modules="attention"))
    both = lora_options(Plan(), ("lora", "qlora"), rank=8)
    assert {c.quantize_base for c in both if c is not None} == {None, "nf4"}
    # The base plan's LoRA comes first; its alpha, dropout and DoRA are kept.
    base = Plan(lora={"rank": 4, "alpha": 8, "dropout": 0.1})
    kept = lora_options(base, ("qlora",), rank=4)
    assert kept[0] == base.lora and all(c.alpha == 8 and c.dropout == 0.1 for c in kept)


def test_candidates_rank_a_four_bit_base_as_saving_most():
    workload = load_workload("llama-tiny", 2, 16)
    pairs = space_pairs(workload, Plan(), ("lora", "qlora"), ("accumulation", "checkpointing",
                        "mixed-precision", "fused-step", "foreach-off", "fused-loss"),
                        get_device("cpu"), lora_rank=4)  # fmt: skip
    dim = RANK_DIMENSIONS.index("lora")
    rank = {p.lora: r[dim] for p, r in pairs}
    assert all(len(r) == len(RANK_DIMENSIONS) for _, r in pairs)
    full, lora = rank[None], rank[LoraConfig(rank=4)]
    qlora = rank[LoraConfig(rank=4, quantize_base="nf4")]
    qlora_attention = rank[LoraConfig(rank=4, target_modules="attention", quantize_base="nf4")]
    assert full < lora < qlora_attention < qlora


@pytest.mark.parametrize("allow", [["lora", "qlora"], ["qlora"]])
def test_plan_with_lora_allowed_fits_where_a_full_fine_tune_cannot(allow):
    result = memfit.plan("llama-tiny", BUDGET, batch_size=2, seq_len=16, device="cpu", jobs=1,
                         allow=allow, lora_rank=4)  # fmt: skip
    assert result.plan.lora is not None and result.plan.lora.rank == 4
    if allow == ["qlora"]:
        assert result.plan.lora.quantize_base == "nf4"
    assert result.predicted_peak_bytes <= parse_size(BUDGET)


def test_plain_lora_wins_a_tie_with_qlora():
    # Both fit a large budget and cost alike on a tiny model: QLoRA counts as two techniques.
    result = memfit.plan("llama-tiny", "1GiB", batch_size=2, seq_len=16, device="cpu", jobs=1,
                         allow=["lora", "qlora"], lora_rank=4)  # fmt: skip
    assert result.plan.lora is not None and result.plan.lora.quantize_base is None


@pytest.mark.slow
def test_nothing_fits_names_qlora_when_it_would():
    with pytest.raises(NothingFits) as e:
        memfit.plan("llama-tiny", BUDGET, batch_size=2, seq_len=16, device="cpu", jobs=1)
    assert "It would fit with qlora (--allow qlora" in str(e.value)


@pytest.mark.subprocess
def test_cli_takes_allow_qlora_and_the_rank(tmp_path):
    saved = tmp_path / "plan.json"
    args = ["--model", "llama-tiny", "--batch-size", "2", "--seq-len", "16", "--jobs", "1",
            "--device", "cpu", "--budget", BUDGET, "--allow", "qlora", "--lora-rank", "4",
            "--save", str(saved)]  # fmt: skip
    res = subprocess.run([sys.executable, "-m", "memfit", "plan", *args],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr
    lora = json.loads(saved.read_text())["lora"]
    assert lora["rank"] == 4 and lora["quantize_base"] == "nf4"
    assert Plan.load(saved).lora == LoraConfig(**{**lora, "target_modules": lora["target_modules"]})
