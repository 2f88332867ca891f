"""Megatron's sequence parallelism under a pipeline, in four real processes (gloo, CPU).

Tensor 2 x pipeline 2 with ``sequence=True``: the stages pass their local ``seq / 2`` tokens
(plain tensors), re-wrapped as sequence-sharded DTensors by the next stage
(:class:`~memfit.distributed.pipeline.StageModule`). One spawn of four ranks builds a tiny
Llama (fp32, no dropout) under the 1F1B, GPipe and interleaved 1F1B schedules with sequence
parallelism and, for comparison, 1F1B without it; each runs a step whose loss and gradients are compared with
the unsplit model's, then a warm step measured by memfit's tracker, compared with
:func:`~memfit.estimate.layout.predict_layout`. torch's pipeline stage's receive buffers (the
activations in, the gradients of the outputs) are read off the stage's receive metadata
(torch 2.15 keeps no buffer between steps) and compared with and without sequence parallelism.
"""

from __future__ import annotations

import math

import pytest
import torch

from memfit.distributed.config import ParallelConfig
from memfit.distributed.layout import LayoutError, build_layout, check_layout, layout_coords
from memfit.estimate.layout import predict_layout

from .harness import (
    assert_rank_peaks,
    assert_ranks_equal_reference,
    receive_shapes,
    run_ranks,
    step_then_track,
    tiny_llama,
    token_batch,
    unsplit_reference,
)

WORLD = 4
BATCH, SEQ, VOCAB = 4, 16, 256
LAYOUTS = {
    "tp2 x pp2, sequence, 1f1b": ParallelConfig(tensor=2, pipeline=2, sequence=True,
                                                schedule="1f1b", microbatches=2),
    "tp2 x pp2, sequence, gpipe": ParallelConfig(tensor=2, pipeline=2, sequence=True,
                                                 schedule="gpipe", microbatches=2),
    "tp2 x pp2, sequence, interleaved": ParallelConfig(
        tensor=2, pipeline=2, sequence=True, schedule="interleaved-1f1b", microbatches=2),
}
#: The same layout without sequence parallelism, for the buffers' and activations' sizes.
PLAIN = "tp2 x pp2, 1f1b"
RUNS = {**LAYOUTS, PLAIN: ParallelConfig(tensor=2, pipeline=2, schedule="1f1b", microbatches=2)}
#: Gradients gathered whole against the unsplit model's: only the order of the sums differs.
RTOL = 1e-5
#: Predicted against measured per-rank peaks.
PEAK_RTOL = 0.03


def _model(layers: int = 4) -> torch.nn.Module:
    return tiny_llama(VOCAB, SEQ, layers)


def _batch() -> torch.Tensor:
    return token_batch(BATCH, SEQ, VOCAB)


def _buffers(layout) -> dict[str, int]:
    """Bytes of torch's pipeline stage's receive buffers on this rank: activations received
    from the previous stage, gradients received from the next, over all micro-batches."""
    out = {"activations": 0, "gradients": 0}
    for kind, shape, dtype in receive_shapes(layout):
        out[kind] += math.prod(shape) * dtype.itemsize
    return out


def _ranks(rank: int, world: int) -> dict:
    ids = _batch()
    out = {}
    for name, parallel in RUNS.items():
        layout = build_layout(_model(), parallel, batch_size=BATCH)
        run = step_then_track(layout, ids)
        out[name] = {"loss": run["loss"], "grads": run["grads"], "coords": layout.coords,
                     "peak": run["peak"], "buffers": _buffers(layout)}
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_ranks, WORLD, timeout=400)


@pytest.fixture(scope="module")
def reference() -> tuple[float, dict[str, torch.Tensor]]:
    return unsplit_reference(_model(), _batch())


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sequence_parallel_pipeline_equals_unsplit_model(results, reference, name):
    """The loss and every gradient (gathered whole over the tensor ranks, collected from both
    stages) equal the unsplit model's on the whole batch to 1e-5 (relative to each gradient's
    largest entry)."""
    assert_ranks_equal_reference(results, name, LAYOUTS[name], reference, RTOL)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_prediction_matches_each_rank_s_measured_peak(results, name):
    """Each rank's tracked peak over a warm step is within 3% of predict_layout's figure for
    that rank (which runs the same stage program on fake tensors)."""
    predicted = predict_layout(_model(), LAYOUTS[name], batch_size=BATCH, seq_len=SEQ)
    measured = [rank_out[name]["peak"] for rank_out in results]
    assert_rank_peaks(measured, predicted.peak_bytes, PEAK_RTOL, f"{name}: ")


@pytest.mark.distributed
@pytest.mark.slow
def test_stages_pass_the_local_sequence_shard(results):
    """torch's pipeline stage sized its receive buffers from the tensors the stages passed:
    with sequence parallelism the second stage's activation buffers and the first stage's
    gradient buffers are exactly half those without it (seq / 2 tokens), and every rank's
    measured peak is lower."""
    sp = LAYOUTS["tp2 x pp2, sequence, 1f1b"]
    for r, rank_out in enumerate(results):
        with_sp, without = rank_out["tp2 x pp2, sequence, 1f1b"], rank_out[PLAIN]
        kind = "activations" if layout_coords(r, sp)["pp"] == 1 else "gradients"
        assert without["buffers"][kind] > 0
        assert with_sp["buffers"][kind] * 2 == without["buffers"][kind], (r, kind)
        assert with_sp["peak"] < without["peak"], r


# --------------------------------------------------------------------------- one process
def test_predicted_buffers_and_activations_shrink_with_sequence_parallelism():
    """Predicted on fake tensors: the pipeline's receive buffers (in the static bytes where
    torch keeps them, up to 2.14) drop by half (seq / 2 tokens per buffer) and each stage's
    kept activations drop too (on torch 2.15 the input's buffer among them)."""
    from memfit.estimate.pipeline_terms import receive_buffers_kept

    kw = dict(batch_size=BATCH, seq_len=SEQ)
    plain = predict_layout(_model(), RUNS[PLAIN], **kw)
    split = predict_layout(_model(), LAYOUTS["tp2 x pp2, sequence, 1f1b"], **kw)
    mb, m, hidden = BATCH // 2, 2, 64
    buffers = m * mb * SEQ * hidden * 4  # one stage's receive buffers, fp32, whole sequence
    for r in (0, 1):
        static = plain.roles[r].static - split.roles[r].static
        assert static == (buffers // 2 if receive_buffers_kept() else 0), r
        assert split.roles[r].forward_kept[r] < plain.roles[r].forward_kept[r], r
        assert split.peak_bytes[2 * r] < plain.peak_bytes[2 * r], r


def test_sequence_parallel_pipeline_needs_the_sequence_to_split_evenly():
    parallel = LAYOUTS["tp2 x pp2, sequence, 1f1b"]
    with pytest.raises(LayoutError, match="sequence of 15 must be a multiple of tensor 2"):
        check_layout(_model(), parallel, seq_len=15)
    check_layout(_model(), parallel, seq_len=16)


def test_the_analytic_model_prices_what_sequence_parallelism_saves_as_predict_layout_does(
        tmp_path):
    """The planner's analytic model (estimate/layout_cost.py) and predict_layout (the stage
    programs on fake tensors) agree, within 2% per stage, on what sequence parallelism saves
    under tp2 x pp2: the receive buffers, and the in-flight micro-batches' norms and stage
    outputs."""
    from memfit.estimate.layout_cost import estimate_layout, model_shape
    from memfit.estimate.pipeline_terms import receive_buffers_kept
    from memfit.targets import get_device
    from memfit.workload import load_workload

    _model().config.to_json_file(tmp_path / "config.json")
    shape = model_shape(load_workload(str(tmp_path / "config.json"), BATCH, SEQ))
    kw = dict(batch_size=BATCH, seq_len=SEQ)
    sp = LAYOUTS["tp2 x pp2, sequence, 1f1b"]
    analytic = [estimate_layout(shape, par, **kw, checkpointing=False,
                                device=get_device("cpu"), precision="fp32", optimizer="adamw",
                                gpus_per_node=WORLD) for par in (RUNS[PLAIN], sp)]
    fake = [predict_layout(_model(), par, **kw) for par in (RUNS[PLAIN], sp)]
    for r in (0, 1):
        plain, split = (a.stages[r] for a in analytic)
        # (torch 2.15 makes the buffers per receive: the input's is among the activations)
        kinds = ("activations", "pipeline_buffers") if receive_buffers_kept() else ("activations",)
        saved = {k: plain[k] - split.get(k, 0) for k in kinds}
        kept = fake[0].roles[r].forward_kept[r] - fake[1].roles[r].forward_kept[r]
        want = {"activations": kept * fake[0].in_flight[r],
                "pipeline_buffers": fake[0].roles[r].static - fake[1].roles[r].static}
        for k in saved:
            assert want[k] > 0
            assert saved[k] == pytest.approx(want[k], rel=0.02), (r, k, saved, want)


def test_405b_under_torchtitan_s_layout_keeps_an_eighth_of_the_block_inputs():
    """The analytic model at Llama 3.1 405B over data 8 x tensor 8 x pipeline 8 (1F1B, 8
    micro-batches, full checkpointing): with sequence parallelism the first stage's in-flight
    activations (its 15 checkpointed block inputs and its output per micro-batch, beside the
    embedding's few bytes) and its receive buffers are an eighth of those without it."""
    from memfit.estimate.layout_cost import estimate_layout, model_shape
    from memfit.estimate.pipeline_terms import receive_buffers_kept
    from memfit.targets import get_device
    from memfit.workload import load_workload

    shape = model_shape(load_workload("llama-3.1-405b", 256, 8192))
    got = []
    for sequence in (False, True):
        par = ParallelConfig(data=8, tensor=8, pipeline=8, zero_stage=2, microbatches=8,
                             sequence=sequence)
        got.append(estimate_layout(shape, par, batch_size=256, seq_len=8192,
                                   checkpointing=True, device=get_device("h100"),
                                   precision="bf16-mixed", optimizer="adamw",
                                   gpus_per_node=8).stages[0])
    plain, split = got
    assert 7.9 < plain["activations"] / split["activations"] <= 8
    if receive_buffers_kept():
        assert plain["pipeline_buffers"] == 8 * split["pipeline_buffers"] > 0
    else:  # torch 2.15 makes them per receive: the input's is with the activations above
        assert "pipeline_buffers" not in plain and "pipeline_buffers" not in split


def test_the_planner_keeps_a_plan_s_sequence_parallelism_under_a_pipeline(tmp_path):
    """``memfit plan`` with a tensor 2 x pipeline 2 plan that sets ``sequence``: the answer
    keeps it (no refusal), and its rank peaks, dry-run in each rank's program, are
    predict_layout's for that layout and below the same plan's without sequence
    parallelism."""
    from memfit.plan import Plan
    from memfit.planner.layout import plan_layout
    from memfit.workload import load_workload

    _model().config.to_json_file(tmp_path / "config.json")
    workload = load_workload(str(tmp_path / "config.json"), BATCH, SEQ)
    peaks = {}
    for name in ("tp2 x pp2, sequence, 1f1b", PLAIN):
        result = plan_layout(workload, "1GiB", WORLD, WORLD, base=Plan(parallel=RUNS[name]))
        par = result.plan.parallel
        assert (par.tensor, par.pipeline, par.sequence) == (2, 2, RUNS[name].sequence)
        peaks[name] = result.rank_peak_bytes
    want = predict_layout(_model(), LAYOUTS["tp2 x pp2, sequence, 1f1b"], batch_size=BATCH,
                          seq_len=SEQ).peak_bytes
    assert peaks["tp2 x pp2, sequence, 1f1b"] == want
    assert all(s < p for s, p in zip(peaks["tp2 x pp2, sequence, 1f1b"], peaks[PLAIN],
                                     strict=True))
