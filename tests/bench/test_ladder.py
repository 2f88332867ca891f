"""The ladder: a small run whose rows must order as the techniques claim."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memfit.bench.ladder import ladder_markdown, run_ladder
from memfit.cli import app


@pytest.fixture(scope="session")  # built once, whatever order xdist runs tests in
def rows():
    result = run_ladder(
        "bert-tiny", batch_size=4, seq_len=32, short_seq=16, compute_steps=1, device="h100"
    )
    return {row.name: row for row in result}


@pytest.mark.subprocess
@pytest.mark.slow
def test_rows_order_as_the_techniques_claim(rows):
    base = rows["baseline"]
    cats = {name: row.peak_by_category for name, row in rows.items()}
    assert base.compute_ratio == 1.0 and base.predicted_compute_ratio == 1.0
    # Adafactor's factored state is far below AdamW's two moments.
    assert cats["+ Adafactor"]["optimizer_state"] < cats["+ gradient checkpointing"][
        "optimizer_state"
    ] / 10
    # Freezing the body leaves only the classifier's gradients.
    assert cats["+ freeze body"]["gradients"] < cats["+ Adafactor"]["gradients"] / 100
    # bf16-pure halves the parameters exactly.
    assert 2 * cats["baseline + bf16-pure"]["parameters"] == cats["baseline"]["parameters"]
    # 8-bit AdamW keeps about a quarter of AdamW's state.
    ratio = cats["accumulation + 8-bit AdamW"]["optimizer_state"] / cats["baseline"][
        "optimizer_state"
    ]
    assert 0.2 < ratio < 0.35
    # Compiling keeps fewer activations (measured for real; here the peak is at the step, where
    # none are kept, so it cannot rise); BERT has nothing fused pointwise.
    assert rows["baseline + compiled"].peak_bytes <= rows["baseline"].peak_bytes
    assert "baseline + fused pointwise" not in rows
    # A shorter sequence cannot raise the peak.
    assert rows["+ max length 64"].peak_bytes <= rows["+ freeze body"].peak_bytes
    # Recomputation costs time in the cost model.
    assert (
        rows["+ gradient checkpointing"].predicted_compute_ratio
        > rows["+ gradient accumulation"].predicted_compute_ratio
    )
    for row in rows.values():
        assert row.target_device == "h100"
        assert row.device_total_bytes >= row.peak_reserved_bytes >= row.peak_bytes
        assert row.peak_bytes == sum(row.peak_by_category.values())
    table = ladder_markdown(list(rows.values()))
    assert "reserved" in table and "compute (h100, model)" in table


def test_ladder_command(tmp_path):
    out = tmp_path / "ladder.json"
    result = CliRunner().invoke(
        app,
        ["bench", "ladder", "--model", "bert-tiny", "-b", "2", "-l", "16", "--device", "t4",
         "--only", "baseline + fp16-mixed", "--json", str(out)],
    )  # (every rung, the compiled one included, runs in the rows fixture above)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert [row["name"] for row in data] == ["baseline", "baseline + fp16-mixed"]
    # A T4 has no bf16: the ladder's bf16 rungs are not among its rungs (named in the refusal).
    refused = CliRunner().invoke(
        app, ["bench", "ladder", "--model", "bert-tiny", "--device", "t4", "--only",
              "best full fine-tune"],
    )
    assert refused.exit_code == 2 and "baseline + fp16-mixed" in refused.output
    assert "bf16" not in refused.output.split("its rungs are", 1)[1]
    assert {"peak_bytes", "peak_reserved_bytes", "device_total_bytes", "compute_ratio",
            "predicted_compute_ratio", "target_device"} <= set(data[0])
    assert {row["target_device"] for row in data} == {"t4"}


def test_ladder_command_refuses_an_unknown_device():
    result = CliRunner().invoke(app, ["bench", "ladder", "--device", "v100"])
    assert result.exit_code == 2
    assert "not known" in result.output


# ---------------------------------------------------------------------------------- fused loss
LOGITS_HEAVY = {
    "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 32768,
    "n_positions": 128, "n_embd": 32, "n_layer": 2, "n_head": 2, "use_cache": False,
    "bos_token_id": 0, "eos_token_id": 0,
}  # fmt: skip


def test_fused_loss_rungs_of_a_causal_lm(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LOGITS_HEAVY))
    fused = ["baseline + fused loss", "best full fine-tune + fused loss"]
    result = run_ladder(str(path), batch_size=4, seq_len=128, compute_seq=8,
                        compute_steps=1, device="cpu", only=fused)  # fmt: skip
    rows = {row.name: row for row in result}
    assert list(rows) == ["baseline", *fused]
    logits32 = 4 * 128 * 32768 * 4  # 64 MiB; their gradient as much
    chunk32 = 128 * 32768 * 4  # the automatic chunk: 128 tokens (16 MiB of fp32 logits)
    assert rows["baseline"].logits_bytes == 2 * logits32
    assert rows["baseline + fused loss"].logits_bytes == 2 * chunk32
    saved = rows["baseline"].peak_bytes - rows["baseline + fused loss"].peak_bytes
    assert saved >= 2 * logits32 - chunk32
    table = ladder_markdown(result)
    assert "fp32 logits + grad (share)" in table and "| 128.00 MiB (" in table
    with pytest.raises(ValueError, match="no rung 'baseline \\+ compile'"):
        run_ladder(str(path), batch_size=4, seq_len=128, only=["baseline + compile"])


def test_no_fused_loss_rungs_for_a_classifier():
    from memfit.bench.ladder import ladder_plans

    assert not any("fused loss" in name for name, _ in ladder_plans())
    names = [name for name, _ in ladder_plans(causal_lm=True)]
    at = names.index("baseline + fused loss")
    assert names[at : at + 2] == ["baseline + fused loss", "best full fine-tune + fused loss"]
