"""``memfit train`` with a tensor / pipeline plan (:mod:`memfit.train.layout_run`): four real
processes train llama-tiny like one process on the whole batch, every rank's peak measured and
predicted; two keep checkpoints, evaluate and plot their memory; what the layout path does not
do is refused before anything starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memfit import Plan
from memfit.train import TrainConfig
from memfit.train.layout_run import LayoutRunError, check_layout_run, is_layout_plan

from ..distributed.harness import assert_rank_peaks

CONFIG = """\
model: llama-tiny
data: [data.txt]
batch_size: 8
seq_len: 32
eval_fraction: 0
track_every: 1000
lr: 0.003
warmup_steps: 1
schedule: constant
"""
TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(400))
STEPS = "3"
#: The split runs sum in another order (tensor-parallel all-reduces, micro-batch means, the
#: vocabulary-sharded loss); three fp32 AdamW steps stay within this of one process's losses.
TOL = 1e-4
TP2_PP2 = {"tensor": 2, "pipeline": 2, "microbatches": 2}
DP2_PP2 = {"data": 2, "pipeline": 2, "microbatches": 2}


@pytest.fixture(scope="session")  # built once, whatever order xdist runs tests in
def workdir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("layout_run")
    (d / "data.txt").write_text(TEXT)
    (d / "run.yaml").write_text(CONFIG)
    Plan(parallel=TP2_PP2).to_json(d / "tp2pp2.json")
    Plan(parallel=DP2_PP2).to_json(d / "dp2pp2.json")
    Plan(parallel={"pipeline": 2, "microbatches": 2}).to_json(d / "pp2.json")
    Plan().to_json(d / "one.json")
    Plan(parallel=TP2_PP2, precision="bf16-mixed").to_json(d / "tp2pp2_bf16.json")
    Plan(precision="bf16-mixed").to_json(d / "one_bf16.json")
    Plan(parallel=TP2_PP2, checkpointing="full").to_json(d / "tp2pp2_ckpt.json")
    Plan(parallel={**TP2_PP2, "partition_activations": True},
         checkpointing="full").to_json(d / "tp2pp2_zeror.json")
    Plan(parallel={"context": 2}).to_json(d / "cp2.json")
    Plan(parallel={**TP2_PP2, "sequence": True}).to_json(d / "tp2pp2_sp.json")
    Plan(parallel={"context": 2, "pipeline": 2, "microbatches": 2}).to_json(d / "cp2pp2.json")
    return d


def _memfit(workdir: Path, *args: str, launcher: list[str] | None = None,
            timeout: float = 240) -> subprocess.CompletedProcess:
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [*(launcher or [sys.executable, "-m", "memfit"]), "train", "--config", "run.yaml",
           "--max-steps", STEPS, "--seed", "5", *args]
    return subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _here(workdir: Path, name: str, plan: str) -> dict:
    """The same ``memfit train`` command on one process, run in this one (typer's runner):
    the split runs start fresh interpreters, the reference needs none."""
    from typer.testing import CliRunner

    from memfit.cli import app

    res = CliRunner().invoke(app, [
        "train", "--config", str(workdir / "run.yaml"), "--max-steps", STEPS, "--seed", "5",
        "--plan", str(workdir / plan), "--json", str(workdir / f"{name}_out.json")])
    assert res.exit_code == 0, res.output[-3000:]
    return json.loads((workdir / f"{name}_out.json").read_text())


@pytest.fixture(scope="session")  # built once, whatever order xdist runs tests in
def one_process(workdir: Path) -> dict:
    """The plain plan on one process: the reference every split run must reproduce."""
    return _here(workdir, "one", "one.json")


def _run(workdir: Path, name: str, *args: str) -> dict:
    run = _memfit(workdir, *args, "--json", f"{name}_out.json")
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((workdir / f"{name}_out.json").read_text())


@pytest.fixture(scope="session")  # built once, whatever order xdist runs tests in
def tp2pp2(workdir: Path) -> dict:
    return _run(workdir, "tp2pp2", "--nproc-per-node", "4", "--plan", "tp2pp2.json")


@pytest.mark.distributed
@pytest.mark.slow
def test_tensor_x_pipeline_trains_like_one_process(tp2pp2: dict, one_process: dict):
    """``--nproc-per-node 4`` with a tensor 2 x pipeline 2 plan: exit 0; every step's loss
    equals one process's on the same seed, data and plan without the split, within 1e-4 (the
    same weights, batches and AdamW updates: only the order of sums differs); four measured
    peaks, each within 10% of predict_layout's figure for its rank (the prediction is a warm
    step; the measurement also covers the first, which makes the optimizer state)."""
    got = tp2pp2
    assert got["world_size"] == 4 and got["steps"] == int(STEPS)
    assert got["plan"]["parallel"]["tensor"] == 2 and got["plan"]["parallel"]["pipeline"] == 2
    assert got["losses"] == pytest.approx(one_process["losses"], abs=TOL)
    assert got["final_loss"] == pytest.approx(one_process["final_loss"], abs=TOL)
    assert got["final_loss"] < got["first_loss"]
    measured, predicted = got["per_rank_peak_bytes"], got["predicted_rank_peak_bytes"]
    assert len(measured) == len(predicted) == 4 and all(m > 0 for m in measured)
    assert_rank_peaks(measured, predicted, 0.10)
    # Each tensor-parallel pair holds half of a stage: less than one process holds it all.
    assert max(measured) < one_process["peak_bytes"]


@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_with_data_replicas_trains_like_one_process(workdir: Path, one_process: dict):
    """``torchrun --nproc-per-node 4 -m memfit train`` with a data 2 x pipeline 2 plan: each
    replica trains on its half of every global batch and the loss (averaged over the
    replicas) equals one process's on the whole batch within 1e-4; each rank's peak is
    within 10% of its prediction for half the batch per replica (a replica that trained on
    the whole batch would hold twice the activations)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "4", "-m", "memfit"]
    run = _memfit(workdir, "--plan", "dp2pp2.json", "--json", "dp2pp2_out.json",
                  launcher=launcher)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads((workdir / "dp2pp2_out.json").read_text())
    assert got["world_size"] == 4 and len(got["per_rank_peak_bytes"]) == 4
    assert got["losses"] == pytest.approx(one_process["losses"], abs=TOL)
    measured, predicted = got["per_rank_peak_bytes"], got["predicted_rank_peak_bytes"]
    assert_rank_peaks(measured, predicted, 0.10)


@pytest.mark.distributed
@pytest.mark.slow
def test_bf16_mixed_runs_the_schedule_under_autocast(workdir: Path, tp2pp2: dict):
    """A bf16-mixed tensor 2 x pipeline 2 plan: the losses equal one bf16-mixed process's
    within 1e-3 (bf16 matmul outputs keep 8 bits, rounded differently in split sums), and
    every rank's peak is below its fp32 peak (activations kept in bf16)."""
    got = _run(workdir, "tp2pp2_bf16", "--nproc-per-node", "4", "--plan", "tp2pp2_bf16.json")
    one = _here(workdir, "one_bf16", "one_bf16.json")
    assert got["losses"] == pytest.approx(one["losses"], abs=1e-3)
    assert "predicted_rank_peak_bytes" not in got  # predict_layout models fp32 only
    for bf16, fp32 in zip(got["per_rank_peak_bytes"], tp2pp2["per_rank_peak_bytes"],
                          strict=True):
        assert bf16 < fp32


@pytest.mark.distributed
@pytest.mark.slow
def test_activation_checkpointing_applies_to_every_stage(workdir: Path, tp2pp2: dict,
                                                          one_process: dict):
    """A tensor 2 x pipeline 2 plan with full checkpointing: the same losses as one process
    (recomputation changes no value: dropout is off), every rank's peak below the plain
    split run's (a stage's blocks keep their inputs only), and predicted (predict_layout with
    the plan's checkpointing) as closely as the plain run's."""
    got = _run(workdir, "tp2pp2_ckpt", "--nproc-per-node", "4", "--plan", "tp2pp2_ckpt.json")
    assert got["losses"] == pytest.approx(one_process["losses"], abs=TOL)
    for ckpt, plain in zip(got["per_rank_peak_bytes"], tp2pp2["per_rank_peak_bytes"],
                           strict=True):
        assert ckpt < plain
    measured, predicted = got["per_rank_peak_bytes"], got["predicted_rank_peak_bytes"]
    assert_rank_peaks(measured, predicted, 0.10)


@pytest.mark.distributed
@pytest.mark.slow
def test_partitioned_checkpoints_train_through_memfit_train(workdir: Path, one_process: dict):
    """The same plan with ``partition_activations`` (ZeRO-R): the same losses as one process,
    and each rank's peak predicted (the inputs at half) as closely as the others'."""
    got = _run(workdir, "tp2pp2_zeror", "--nproc-per-node", "4", "--plan",
               "tp2pp2_zeror.json")
    assert got["losses"] == pytest.approx(one_process["losses"], abs=TOL)
    measured, predicted = got["per_rank_peak_bytes"], got["predicted_rank_peak_bytes"]
    assert_rank_peaks(measured, predicted, 0.10)


@pytest.mark.subprocess
@pytest.mark.distributed
@pytest.mark.slow
def test_checkpoints_evaluation_and_plots_of_a_pipeline_run(workdir: Path):
    """``--nproc-per-node 2`` with a pipeline-2 plan, ``--checkpoint-dir --save-every 1
    --keep 2 --plot``, evaluating every 2 steps: exit 0; the JSON has the held-out losses at
    steps 2 and 3 (the last), every rank's memory report (its peak the rank's measured peak)
    and the last checkpoint; the two newest checkpoints are kept, each with its manifest;
    each process drew its own plot. Resuming at ``max_steps`` already reached is one
    sentence and exit 2."""
    (workdir / "run_eval.yaml").write_text(
        CONFIG.replace("eval_fraction: 0", "eval_fraction: 0.05\neval_every: 2"))
    args = ("--config", "run_eval.yaml", "--nproc-per-node", "2", "--plan", "pp2.json",
            "--checkpoint-dir", "ck", "--save-every", "1", "--keep", "2")
    run = _memfit(workdir, *args, "--plot", "mem.png", "--json", "pp2_out.json")
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads((workdir / "pp2_out.json").read_text())
    assert [s for s, _ in got["eval_losses"]] == [2, 3]
    assert all(loss == loss for _, loss in got["eval_losses"])  # not NaN
    reports = got["per_rank_memory_reports"]
    assert [r["peak_bytes"] for r in reports] == got["per_rank_peak_bytes"]
    assert [r["rank"] for r in reports] == [0, 1]
    assert got["memory_report"]["peak_bytes"] == got["peak_bytes"]
    kept = sorted(p.name for p in (workdir / "ck").iterdir())
    assert kept == ["step-00000002", "step-00000003"]
    assert got["checkpoint"].endswith("step-00000003")
    assert (workdir / "ck" / "step-00000003" / "manifest.json").is_file()
    for rank in (0, 1):
        assert (workdir / f"mem-rank{rank}.png").stat().st_size > 0
    again = _memfit(workdir, *args, "--resume", timeout=120)
    assert again.returncode == 2, again.stderr[-3000:]
    assert "max_steps is 3; raise --max-steps" in again.stderr
    assert "Traceback" not in again.stderr


def test_checkpoints_of_a_ddp_replicated_layout_are_refused_before_launch(workdir: Path):
    """data 2 x tensor 2 at ZeRO 0 (DDP over the tensor-parallel shards) with
    ``--checkpoint-dir``: one sentence and exit 2 before any process starts (in this process,
    typer's runner), and no checkpoint folder."""
    from typer.testing import CliRunner

    from memfit.cli import app

    plan = {"parallel": {"data": 2, "tensor": 2}}
    (workdir / "dp2tp2.json").write_text(json.dumps({"plan": plan}))
    run = CliRunner().invoke(app, [
        "train", "--config", str(workdir / "run.yaml"), "--nproc-per-node", "4", "--plan",
        str(workdir / "dp2tp2.json"), "--checkpoint-dir", str(workdir / "ck-ddp")])
    assert run.exit_code == 2, run.output[-3000:]
    assert "has no checkpoints yet" in run.output and "Traceback" not in run.output
    assert not (workdir / "ck-ddp").exists()


@pytest.mark.distributed
@pytest.mark.slow
def test_sequence_parallelism_under_a_pipeline_trains_like_one_process(
        workdir: Path, tp2pp2: dict, one_process: dict):
    """A tensor 2 x pipeline 2 plan with sequence parallelism (the stages pass their local
    16 of 32 tokens): every step's loss equals one process's within 1e-4; each rank's measured
    peak is within 10% of predict_layout's figure (as the plain split run's test) and below
    the same layout's without sequence parallelism."""
    got = _run(workdir, "tp2pp2_sp", "--nproc-per-node", "4", "--plan", "tp2pp2_sp.json")
    assert got["plan"]["parallel"]["sequence"] is True
    assert got["losses"] == pytest.approx(one_process["losses"], abs=TOL)
    measured, predicted = got["per_rank_peak_bytes"], got["predicted_rank_peak_bytes"]
    assert_rank_peaks(measured, predicted, 0.10)
    for sp, plain in zip(measured, tp2pp2["per_rank_peak_bytes"], strict=True):
        assert sp < plain


@pytest.mark.distributed
@pytest.mark.slow
def test_context_parallelism_under_a_pipeline_trains_like_one_process(workdir: Path,
                                                                       one_process: dict):
    """``--nproc-per-node 4`` with a context 2 x pipeline 2 plan (each stage runs its rank's
    16 of 32 tokens): every step's loss equals one process's within 1e-4, and each rank's
    measured peak is within 3% of predict_layout's figure."""
    got = _run(workdir, "cp2pp2", "--nproc-per-node", "4", "--plan", "cp2pp2.json")
    assert got["plan"]["parallel"]["context"] == 2 and got["plan"]["parallel"]["pipeline"] == 2
    assert got["losses"] == pytest.approx(one_process["losses"], abs=TOL)
    measured, predicted = got["per_rank_peak_bytes"], got["predicted_rank_peak_bytes"]
    assert_rank_peaks(measured, predicted, 0.03)


# --------------------------------------------------------------------------- one process
@pytest.mark.distributed
@pytest.mark.slow
def test_context_parallelism_trains_like_one_process(workdir: Path, one_process: dict):
    """``--nproc-per-node 2`` with a context 2 plan (ring attention; each sample's 32 tokens
    cut in two): every step's loss equals one process's within 1e-4, and each rank's measured
    peak is within 3% of predict_layout's figure and below the one process's peak."""
    got = _run(workdir, "cp2", "--nproc-per-node", "2", "--plan", "cp2.json")
    assert got["world_size"] == 2 and got["plan"]["parallel"]["context"] == 2
    assert got["losses"] == pytest.approx(one_process["losses"], abs=TOL)
    measured, predicted = got["per_rank_peak_bytes"], got["predicted_rank_peak_bytes"]
    assert_rank_peaks(measured, predicted, 0.03)
    assert max(measured) < one_process["peak_bytes"]


def _config(**kw) -> TrainConfig:
    return TrainConfig(model="llama-tiny", batch_size=8, seq_len=32, nproc_per_node=4, **kw)


def test_is_layout_plan():
    assert is_layout_plan(Plan(parallel=TP2_PP2)) and is_layout_plan(Plan(parallel={"tensor": 4}))
    assert not is_layout_plan(Plan(parallel={"data": 4})) and not is_layout_plan(None)


@pytest.mark.parametrize(("plan", "config", "match"), [
    (Plan(parallel=TP2_PP2), {"cap": "1GiB"}, "--cap is not applied"),
    (Plan(parallel=TP2_PP2, optimizer="adamw8bit"), {}, "not optimizer 'adamw8bit'"),
    (Plan(parallel=TP2_PP2, checkpointing="sqrt", precision="fp16-mixed"), {},
     "ignore the plan's precision 'fp16-mixed', checkpointing 'sqrt'; remove them"),
    (Plan(parallel={"tensor": 4}), {}, "tensor-parallel degree 4 does not divide"),
    (Plan(parallel={"data": 2, "tensor": 2, "microbatches": 3}), {},
     "a batch of 8 does not split into data 2 x microbatches 3"),
    (Plan(parallel={**TP2_PP2, "cuts": [2]}), {},
     r"pipeline cuts \(2,\) must be 1 strictly increasing block indices between 1 and 1"),
])
def test_what_the_layout_path_does_not_do_is_refused_in_one_sentence(plan, config, match):
    with pytest.raises(ValueError, match=match):
        check_layout_run(_config(**config), plan)


def test_a_plain_tensor_x_pipeline_plan_passes_the_checks():
    check_layout_run(_config(), Plan(parallel=TP2_PP2))
    check_layout_run(_config(), Plan(parallel={**TP2_PP2, "cuts": [1]}))  # llama-tiny: 2 blocks
    # Checkpoints, resume and evaluation are the layout path's too.
    check_layout_run(_config(checkpoint_dir="ck", checkpoint_every=2, resume=True,
                             eval_every=5), Plan(parallel=TP2_PP2))
    with pytest.raises(LayoutRunError):
        check_layout_run(_config(), Plan(parallel=TP2_PP2, compile=True))
