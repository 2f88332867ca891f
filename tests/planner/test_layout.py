"""The 3-D planner (memfit.planner.layout) and its pricing (memfit.estimate.layout_cost):
layouts, their checks, their prices, the answer."""

from __future__ import annotations

import dataclasses

import pytest

from memfit.distributed.config import ParallelConfig
from memfit.estimate.layout_cost import (
    estimate_layout,
    layout_problems,
    model_shape,
    rank_coordinates,
)
from memfit.plan import Plan
from memfit.planner.layout import plan_layout
from memfit.planner.result import NothingFits
from memfit.targets import get_device
from memfit.workload import WorkloadError, load_workload

TINY = load_workload("llama-tiny", 8, 32)  # 2 layers, 4 heads, 2 key-value heads, MLP 176
DEEP = TINY.with_depth(4)


def _estimate(par: ParallelConfig, *, workload=DEEP, ckpt: bool = False, m: int | None = None):
    return estimate_layout(
        model_shape(workload), par, batch_size=workload.batch_size, seq_len=workload.seq_len,
        checkpointing=ckpt, device=get_device("a100"), precision="bf16-mixed",
        optimizer="adamw", gpus_per_node=8, microbatches=m,
    )


def test_shapes_are_read_from_the_config():
    shape = model_shape(TINY)
    assert (shape.family, shape.layers, shape.hidden) == ("llama", 2, 64)
    assert (shape.heads, shape.kv_heads, shape.mlp, shape.vocab) == (4, 2, 176, 1000)


def test_tensor_parallelism_divides_the_parameters_but_not_the_norms():
    one = _estimate(ParallelConfig())
    two = _estimate(ParallelConfig(tensor=2))
    ratio = two.by_category["parameters"] / one.by_category["parameters"]
    # Every matrix halves; the norms' weights (replicated) keep the ratio just above 1/2.
    assert 0.5 < ratio < 0.52
    assert two.parts["tensor"] > 0 and one.parts["tensor"] == 0


def test_gpipe_keeps_every_micro_batch_and_1f1b_the_stages_in_flight():
    base = ParallelConfig(pipeline=2, microbatches=4)
    gpipe = _estimate(dataclasses.replace(base, schedule="gpipe"))
    ofob = _estimate(dataclasses.replace(base, schedule="1f1b"))
    # Stage 0: GPipe keeps all 4 micro-batches, 1F1B the 2 stages' worth.
    assert gpipe.stages[0]["activations"] == 2 * ofob.stages[0]["activations"]
    # The last stage: GPipe 4, 1F1B 1.
    assert gpipe.stages[1]["activations"] == 4 * ofob.stages[1]["activations"]
    assert gpipe.rank_peak_bytes[0] > ofob.rank_peak_bytes[0]
    assert gpipe.step_seconds == pytest.approx(ofob.step_seconds)  # the same bubble


def test_more_micro_batches_shrink_the_bubble():
    two = _estimate(ParallelConfig(pipeline=2, microbatches=2))
    eight = _estimate(ParallelConfig(pipeline=2, microbatches=8))
    assert eight.parts["bubble"] / eight.parts["compute"] < two.parts["bubble"] / two.parts["compute"]


def test_checkpointing_keeps_block_inputs_only_and_recomputes():
    plain = _estimate(ParallelConfig(pipeline=2, microbatches=2))
    ckpt = _estimate(ParallelConfig(pipeline=2, microbatches=2), ckpt=True)
    assert ckpt.stages[0]["activations"] < plain.stages[0]["activations"]
    assert ckpt.parts["compute"] > plain.parts["compute"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_shard_the_state_over_the_replicas(stage: int):
    zero = _estimate(ParallelConfig(data=4, zero_stage=0))
    sharded = _estimate(ParallelConfig(data=4, zero_stage=stage))
    assert sharded.by_category["optimizer_state"] == pytest.approx(
        zero.by_category["optimizer_state"] / 4, rel=1e-6
    )
    assert (sharded.by_category["gradients"] < zero.by_category["gradients"]) == (stage >= 2)


def test_ranks_are_numbered_stage_then_replica_then_shard():
    par = ParallelConfig(data=2, tensor=2, pipeline=2)
    coords = [rank_coordinates(r, par) for r in range(8)]
    assert coords[0] == {"stage": 0, "replica": 0, "chunk": 0, "shard": 0}
    assert coords[1] == {"stage": 0, "replica": 0, "chunk": 0, "shard": 1}
    assert coords[2] == {"stage": 0, "replica": 1, "chunk": 0, "shard": 0}
    assert coords[7] == {"stage": 1, "replica": 1, "chunk": 0, "shard": 1}
    # Context chunks sit between the replicas and the tensor shards.
    four = ParallelConfig(data=2, tensor=2, context=2)
    assert [tuple(rank_coordinates(r, four).values()) for r in (1, 2, 5, 7)] == [
        (0, 0, 0, 1), (0, 0, 1, 0), (0, 1, 0, 1), (0, 1, 1, 1)]
    est = _estimate(dataclasses.replace(par, microbatches=2), workload=DEEP, m=None)
    # The stages differ (embeddings, head, in-flight micro-batches); ranks of a stage agree.
    assert len(set(est.rank_peak_bytes[:4])) == 1 and len(set(est.rank_peak_bytes[4:])) == 1


@pytest.mark.parametrize(
    ("par", "says"),
    [
        (ParallelConfig(tensor=3), "tensor parallelism of 3 does not divide the 4 attention heads"),
        (ParallelConfig(tensor=4), "does not divide the 2 key-value heads"),
        (ParallelConfig(pipeline=5, microbatches=8), "4 blocks cannot fill 5 pipeline stages"),
        (ParallelConfig(pipeline=2, microbatches=2, cuts=(4,)), "pipeline cuts (4,) must be 1"),
        (ParallelConfig(pipeline=2, microbatches=1), "needs at least as many micro-batches"),
        (ParallelConfig(pipeline=2, schedule="interleaved-1f1b", microbatches=3), "multiple of the pipeline degree"),
        (ParallelConfig(data=3), "does not split into 3 replicas"),
    ],
)
def test_bad_layouts_say_what_would_work(par: ParallelConfig, says: str):
    problems = layout_problems(model_shape(DEEP), par, DEEP.batch_size, gpus_per_node=8)
    assert problems and says in " ".join(problems)


def test_tensor_parallelism_stays_in_a_node():
    problems = layout_problems(model_shape(DEEP), ParallelConfig(tensor=2), 8, gpus_per_node=1)
    assert "does not fit in a node of 1 devices" in problems[0]


def test_the_answer_lists_every_rank_and_fits():
    budget = 3 << 20
    result = plan_layout(DEEP, budget, 4, 2, confirm=False)
    assert result.fits and len(result.rank_peak_bytes) == 4
    assert max(result.rank_peak_bytes) <= budget
    par = result.plan.parallel
    assert par.data * par.tensor * par.pipeline == 4 and par.tensor <= 2
    data = result.to_dict()
    assert data["predicted_rank_peak_bytes"] == result.rank_peak_bytes
    assert {"data", "tensor", "pipeline", "schedule", "zero_stage"} <= set(data["plan"]["parallel"])
    assert [r["rank"] for r in data["ranks"]] == [0, 1, 2, 3]
    # The winner is the fastest fitting layout the search priced.
    fitting = [c for c in result.layouts if c.fits]
    assert result.layout_candidate.step_seconds == min(c.step_seconds for c in fitting)
    assert "next best layout" in result.explanation


def test_a_plan_s_own_degrees_are_kept_or_refused():
    base = Plan(parallel={"tensor": 2, "pipeline": 2, "microbatches": 2})
    result = plan_layout(DEEP, 1 << 30, 4, 4, base=base, confirm=False)
    par = result.plan.parallel
    assert (par.data, par.tensor, par.pipeline, par.microbatches) == (1, 2, 2, 2)
    with pytest.raises(ValueError, match="is 8 processes but --world-size is 4"):
        plan_layout(DEEP, 1 << 30, 4, 4, base=Plan(parallel={"data": 2, "tensor": 2, "pipeline": 2}),
                    confirm=False)
    with pytest.raises(ValueError, match="does not divide the 4 attention heads"):
        plan_layout(DEEP, 1 << 30, 6, 6, base=Plan(parallel={"tensor": 3}), confirm=False)


def test_nothing_fits_names_the_closest_layout():
    with pytest.raises(NothingFits, match="no layout of 4 processes fits"):
        plan_layout(DEEP, 1 << 10, 4, 2, confirm=False)


def test_node_size_and_model_are_checked():
    with pytest.raises(ValueError, match="--gpus-per-node 3 does not divide --world-size 4"):
        plan_layout(DEEP, 1 << 30, 4, 3, confirm=False)
    with pytest.raises(WorkloadError, match="Llama, Mixtral and GPT-2 layouts"):
        plan_layout(load_workload("bert-tiny", 8, 32), 1 << 30, 4, 2, confirm=False)


def test_plans_with_degrees_fail_fast_where_they_cannot_run():
    with pytest.raises(ValueError, match="replace gradient accumulation"):
        Plan(parallel={"pipeline": 2}, grad_accum_steps=2)
    with pytest.raises(ValueError, match=r"zero_stage 1 .* is not composed with tensor or pipeline"):
        Plan(parallel={"pipeline": 2, "data": 2, "zero_stage": 1})
    Plan(parallel={"pipeline": 2, "data": 2, "zero_stage": 3})  # FSDP2 per stage


@pytest.mark.slow
def test_llama_70b_on_64_gpus_fits_every_rank():
    result = plan_layout("llama-70b", "h100", 64, 8)
    assert result.fits and len(result.rank_peak_bytes) == 64
    budget = get_device("h100")
    assert max(result.rank_peak_bytes) <= budget.budget_bytes
    assert result.plan.parallel.tensor <= 8


def test_context_parallelism_cuts_a_rank_s_activations_and_costs_traffic():
    """Two context ranks each hold half of every sample's tokens: a block's activations and
    the last stage's logits halve (within 5%: autocast's bf16 weight copies, saved for
    backward, do not shrink), the parameters stay whole without ZeRO, and the ring's
    key-value traffic is priced."""
    long = load_workload("llama-tiny", 2, 2048).with_depth(4)
    one = _estimate(ParallelConfig(), workload=long)
    two = _estimate(ParallelConfig(context=2), workload=long)
    assert two.by_category["activations"] == pytest.approx(one.by_category["activations"] / 2,
                                                           rel=0.05)
    assert two.by_category["parameters"] == one.by_category["parameters"]
    assert two.parts["context"] > 0 and one.parts["context"] == 0
    sharded = _estimate(ParallelConfig(context=2, zero_stage=3), workload=long)
    assert sharded.by_category["optimizer_state"] == pytest.approx(
        one.by_category["optimizer_state"] / 2, rel=1e-6)


def test_context_parallelism_is_not_searched_when_a_layout_without_it_fits():
    """The tiny model at a short sequence fits 4 ranks without context parallelism: no
    context-parallel layout is priced, since its key-value traffic buys nothing."""
    result = plan_layout(TINY, "1GiB", 4, 4, confirm=False)
    assert result.plan.parallel.context == 1
    assert all(c.parallel.context == 1 for c in result.layouts)


@pytest.mark.slow
def test_a_128k_token_sample_of_llama_8b_trains_by_context_parallelism():
    """memfit plan --model llama-8b --batch-size 1 --seq-len 131072 --world-size 8
    --gpus-per-node 8 --budget h100: no data x tensor x pipeline layout fits a sample of 128k
    tokens, and the answer cuts it over context ranks, every rank within the budget; ZeRO-R's
    partitioned checkpoints, the last resort, are not weighed since a context layout fits."""
    result = plan_layout("llama-8b", "h100", 8, 8, batch_size=1, seq_len=131072)
    par = result.plan.parallel
    assert result.fits and par.context > 1 and par.world_size == 8
    assert max(result.rank_peak_bytes) <= result.budget_bytes
    assert not any(c.fits for c in result.layouts if c.parallel.context == 1)
    assert not any(c.parallel.partition_activations for c in result.layouts)


@pytest.mark.slow
def test_a_fixed_tensor_layout_that_does_not_fit_gets_partitioned_checkpoints():
    """The same sample with the user's layout, tensor 8: with whole checkpoints no rank fits
    an H100, and with ZeRO-R's partitioned checkpoints (each block's checkpointed input, the
    dominant term at 128k tokens, at 1/8 per rank) every rank does."""
    base = Plan(parallel={"tensor": 8})
    result = plan_layout("llama-8b", "h100", 8, 8, batch_size=1, seq_len=131072, base=base)
    par = result.plan.parallel
    assert result.fits and max(result.rank_peak_bytes) <= result.budget_bytes
    assert par.tensor == 8 and par.partition_activations
    assert not any(c.fits for c in result.layouts if not c.parallel.partition_activations)
    assert result.plan.checkpointing.mode == "full"
    assert Plan.from_dict(result.plan.to_dict()) == result.plan  # a valid plan, as saved


def test_the_cli_prints_the_layout_and_writes_every_rank(tmp_path):
    import json

    from typer.testing import CliRunner

    from memfit.cli import app

    out = tmp_path / "plan.json"
    args = ["plan", "--model", "llama-tiny", "--batch-size", "8", "--seq-len", "32", "--budget",
            "3MiB", "--world-size", "4", "--gpus-per-node", "2", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "Layouts weighed" in result.output and "per stage:" in result.output
    data = json.loads(out.read_text())
    assert len(data["predicted_rank_peak_bytes"]) == 4
    assert {"stage", "replica", "shard", "predicted_step_seconds"} <= set(data["ranks"][0])
    assert data["layout"]["step_seconds"] > 0 and data["layout"]["alternatives"]
    bad = CliRunner().invoke(app, [*args[:-2], "--gpus-per-node", "3"])
    assert bad.exit_code == 2 and "does not divide --world-size 4" in bad.output


# --------------------------------------------------------------------- the search's options
@pytest.mark.parametrize("allow", ["offload", "8bit", "factored", "bf16-pure", "freeze",
                                   "shorter-seq"])
def test_an_allowed_technique_is_refused_not_ignored(allow):
    with pytest.raises(ValueError, match=f"--allow {allow} is not searched with --gpus-per-node"):
        plan_layout(DEEP, 1 << 30, 4, 2, allow=[allow], confirm=False)
    plan_layout(DEEP, 1 << 30, 4, 2, allow=["", " "], confirm=False)  # nothing allowed: fine


def test_the_search_s_other_options_are_checked_or_refused():
    with pytest.raises(ValueError, match="--allow value 'teleportation' does not exist"):
        plan_layout(DEEP, 1 << 30, 4, 2, allow=["teleportation"], confirm=False)
    with pytest.raises(ValueError, match="--forbid value 'teleportation' does not exist"):
        plan_layout(DEEP, 1 << 30, 4, 2, forbid=["teleportation"], confirm=False)
    with pytest.raises(ValueError, match="--disk-dir is where offload puts state on disk"):
        plan_layout(DEEP, 1 << 30, 4, 2, disk_dir="/tmp", confirm=False)
    with pytest.raises(ValueError, match="--jobs must be a whole number >= 1"):
        plan_layout(DEEP, 1 << 30, 4, 2, jobs=0, confirm=False)
    with pytest.raises(ValueError):
        plan_layout(DEEP, 1 << 30, 4, 2, host_budget="lots", confirm=False)
    # Honoured as they are: no layout uses host memory; the pricing runs in this process.
    assert plan_layout(DEEP, 1 << 30, 4, 2, host_budget="1GiB", jobs=1, confirm=False).fits


def test_an_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="allow_offload"):
        plan_layout(DEEP, 1 << 30, 4, 2, allow_offload=True, confirm=False)
    from memfit.planner import plan

    with pytest.raises(TypeError, match="allow_offload"):
        plan(DEEP, 1 << 30, world_size=4, gpus_per_node=2, allow_offload=True)


def test_forbidden_techniques_are_left_out_of_the_layouts():
    free = plan_layout(DEEP, 1 << 30, 4, 2, confirm=False)  # every setting is priced
    assert any(c.checkpointing for c in free.layouts)
    assert any(c.microbatches > 1 and c.parallel.pipeline == 1 for c in free.layouts)
    result = plan_layout(DEEP, 1 << 30, 4, 2, forbid=["checkpointing", "accumulation"],
                         confirm=False)  # fmt: skip
    assert not any(c.checkpointing for c in result.layouts)
    assert not any(c.microbatches > 1 and c.parallel.pipeline == 1 for c in result.layouts)
    assert any(c.parallel.pipeline > 1 for c in result.layouts)  # a pipeline's micro-batches stay
    gpu = plan_layout(DEEP, "a100", 4, 2, confirm=False)
    assert gpu.plan.precision.mode == "bf16-mixed"
    kept = plan_layout(DEEP, "a100", 4, 2, forbid=["mixed-precision"], confirm=False)
    assert kept.plan.precision.mode == "fp32"


def test_the_cli_refuses_allow_offload_with_a_layout():
    from typer.testing import CliRunner

    from memfit.cli import app

    args = ["plan", "--model", "llama-tiny", "--batch-size", "8", "--seq-len", "32", "--budget",
            "1GiB", "--world-size", "8", "--gpus-per-node", "8", "--allow", "offload"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "1000", "NO_COLOR": "1"})
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(
        "error: --allow offload is not searched with --gpus-per-node"
    )


# --------------------------------------------------------------------- uneven and balanced cuts
def _spread(peaks: list[int]) -> float:
    return max(peaks) / min(peaks) - 1


def test_balanced_cuts_even_llama_70b_s_stage_peaks():
    """llama-70b over data 1 x tensor 8 x pipeline 8 (zero-bubble, 8 micro-batches, the
    README's winner at 8 x 128): an even split leaves the last rank (16 chunk micro-batches in
    flight) a quarter above the second; the memory-balanced cuts bring every rank within 10%
    of the others, and the fastest split's largest rank is no larger than the even split's."""
    from memfit.estimate.layout_cost import balanced_cuts

    workload = load_workload("llama-70b", 8, 128)
    shape = model_shape(workload)
    par = ParallelConfig(tensor=8, pipeline=8, schedule="zero-bubble", microbatches=8)
    kw = dict(batch_size=8, seq_len=128, checkpointing=False, device=get_device("h100"),
              precision="bf16-mixed", optimizer="adamw")
    cuts = balanced_cuts(shape, par, **kw)
    priced = {name: estimate_layout(shape, dataclasses.replace(par, cuts=c), gpus_per_node=8, **kw)
              for name, c in {**cuts, "even": ()}.items()}
    peaks = {name: c.rank_peak_bytes[::8] for name, c in priced.items()}  # one rank per stage
    assert _spread(peaks["even"]) > 0.2
    assert _spread(peaks["memory"]) < 0.10
    assert max(peaks["memory"]) < max(peaks["even"])
    assert max(peaks["time"]) <= max(peaks["even"])
    assert priced["time"].step_seconds <= priced["even"].step_seconds
    for c in cuts.values():  # 15 cuts: two stages per rank, each holding a block at least
        assert len(c) == 15 and all(a < b for a, b in zip((0, *c), (*c, 80), strict=True))


@pytest.mark.slow
def test_the_planner_s_llama_70b_plan_has_stage_peaks_within_10_percent():
    result = plan_layout("llama-70b", "h100", 64, 8, batch_size=8, seq_len=128)
    par = result.plan.parallel
    assert par.pipeline > 1 and par.cuts  # the planner's cuts are in the plan
    per = par.data * par.tensor
    stages = [result.rank_peak_bytes[s * per] for s in range(par.pipeline)]
    assert _spread(stages) < 0.10
    assert result.to_dict()["plan"]["parallel"]["cuts"] == list(par.cuts)


def test_the_planner_keeps_a_plan_s_own_cuts_and_prices_uneven_stages():
    """A plan that names its cuts is priced with them: three blocks on the first stage of
    four make its rank the largest."""
    base = Plan(parallel={"pipeline": 2, "microbatches": 2, "cuts": [3]})
    result = plan_layout(DEEP, "1GiB", 2, 2, base=base, confirm=False)
    assert result.plan.parallel.cuts == (3,)
    even = _estimate(ParallelConfig(pipeline=2, microbatches=2))
    cut = _estimate(ParallelConfig(pipeline=2, microbatches=2, cuts=(3,)))
    assert cut.rank_peak_bytes[0] > even.rank_peak_bytes[0]
    assert cut.stage_busy_seconds[0] > even.stage_busy_seconds[0]


LLAMA_405B = load_workload("llama-3.1-405b", 256, 8192)


@pytest.mark.parametrize(("schedule", "sizes"), [
    ("1f1b", [15, 16, 16, 16, 16, 16, 16, 15]),
    ("interleaved-1f1b", [7] + [8] * 14 + [7]),
])
def test_torchtitan_s_405b_layout_is_accepted_and_cut_as_torchtitan_cuts_it(schedule, sizes):
    """Llama 3.1 405B's 126 blocks over torchtitan's data 8 x tensor 8 x pipeline 8 (local
    batch 32 x 8192, 8 micro-batches): accepted, and the even split gives the stages the
    blocks torchtitan's generate_split_points gives them (the remainder to the middle stages),
    one stage per rank under 1F1B and two under interleaved 1F1B."""
    from memfit.distributed.layout import pipeline_config

    par = ParallelConfig(data=8, tensor=8, pipeline=8, zero_stage=2, schedule=schedule,
                         microbatches=8)
    shape = model_shape(LLAMA_405B)
    assert shape.layers == 126
    assert layout_problems(shape, par, 256, gpus_per_node=8) == []
    cfg = pipeline_config(par)
    assert [len(cfg.stage_blocks(126, s)) for s in range(cfg.num_stages)] == sizes
    cand = _estimate(par, workload=LLAMA_405B, ckpt=True)
    assert len(cand.rank_peak_bytes) == 512


@pytest.mark.parametrize(("cuts", "says"), [
    ([3, 1], "parallel cuts [3, 1] must be one block index >= 1"),
    ([2], "pipeline cuts (2,) must be 1 strictly increasing block indices between 1 and 1"),
])
def test_the_cli_refuses_cuts_that_cannot_work_in_one_sentence(tmp_path, cuts, says):
    import json

    from typer.testing import CliRunner

    from memfit.cli import app

    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"parallel": {"pipeline": 2, "microbatches": 2, "cuts": cuts}}))
    args = ["plan", "--model", "llama-tiny", "--batch-size", "8", "--seq-len",
            "32", "--budget", "1GiB", "--world-size", "2", "--gpus-per-node", "2", "--plan",
            str(plan)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert says in " ".join(result.output.split()) and "Traceback" not in result.output
