"""Tensor x pipeline (x data) parallelism in four real processes (gloo, CPU), and every rank's
peak predicted without launching.

One spawn of four ranks builds a tiny Llama (fp32, no dropout) under four layouts: 2-way
tensor x 2-stage pipeline with the 1F1B and the GPipe schedule, 2-way data x 2-stage pipeline,
2-way data x 2-way tensor with two accumulated micro-batches, and 2-way data x 2-way tensor
with sequence parallelism (all ZeRO 0: torch's DDP); each runs a step whose loss and gradients
are compared with the unsplit model's, then a warm step (forward, backward, optimizer step)
measured by memfit's tracker, compared with
:func:`~memfit.estimate.layout.predict_layout`.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator

import pytest
import torch

import memfit
from memfit.distributed.config import ParallelConfig
from memfit.distributed.layout import LayoutError, build_layout, check_layout
from memfit.estimate.layout import predict_layout

from .harness import (
    assert_rank_peaks,
    assert_ranks_equal_reference,
    run_ranks,
    step_then_track,
    tiny_llama,
    token_batch,
    unsplit_reference,
)

WORLD = 4
BATCH, SEQ, VOCAB = 4, 16, 256
LAYOUTS = {
    "tp2 x pp2, 1f1b": ParallelConfig(tensor=2, pipeline=2, schedule="1f1b", microbatches=2),
    "tp2 x pp2, gpipe": ParallelConfig(tensor=2, pipeline=2, schedule="gpipe", microbatches=2),
    "dp2 x pp2, 1f1b": ParallelConfig(data=2, pipeline=2, schedule="1f1b", microbatches=2),
    "dp2 x tp2, 2 micro-batches": ParallelConfig(data=2, tensor=2, microbatches=2),
    # Megatron's sequence parallelism: the norms and residual stream split along the sequence.
    "dp2 x tp2, sequence": ParallelConfig(data=2, tensor=2, sequence=True),
}
#: Gradients gathered whole against the unsplit model's: only the order of the sums differs.
RTOL = 1e-5


def _model(layers: int = 4) -> torch.nn.Module:
    return tiny_llama(VOCAB, SEQ, layers)


def _batch() -> torch.Tensor:
    return token_batch(BATCH, SEQ, VOCAB)


@contextlib.contextmanager
def _all_reduce_sizes(sizes: list[int]) -> Iterator[None]:
    """Record the element count of every tensor ``torch.distributed.all_reduce`` is called
    with inside."""
    import torch.distributed as dist

    real = dist.all_reduce

    def spy(tensor, *args, **kwargs):
        sizes.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    dist.all_reduce = spy
    try:
        yield
    finally:
        dist.all_reduce = real


def _ranks(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel


    ids = _batch()
    out = {}
    for name, parallel in LAYOUTS.items():
        layout = build_layout(_model(), parallel, batch_size=BATCH)
        d = layout.coords["dp"]
        share = BATCH // parallel.data
        local = ids[d * share:(d + 1) * share]  # this replica's samples
        # The warm step records the size of every tensor all_reduce is called with (DDP's
        # buckets do not go through it: its C++ reducer calls the process group itself).
        reduced: list[int] = []
        run = step_then_track(layout, local, functools.partial(_all_reduce_sizes, reduced))
        if layout.pipeline is not None:  # what torch's PipelineStage runs
            schedule = layout.pipeline.schedule
            runs = [s.submod for s in getattr(schedule, "_stages", None) or [schedule._stage]]
        else:  # what the accumulation loop runs
            runs = layout.replicas.ddps if layout.replicas is not None else layout.modules
        # The storages the gradients live in (DDP's buckets, under DDP), and their bytes.
        held = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
                for p in layout.parameters()} if layout.replicas is not None else {}
        out[name] = {"loss": run["loss"], "grads": run["grads"], "coords": layout.coords,
                     "peak": run["peak"], "reduced": reduced,
                     "ddp": [isinstance(m, DistributedDataParallel) for m in runs],
                     "grad_storage_bytes": sum(held.values()),
                     "param_bytes": sum(p.numel() * p.element_size()
                                        for p in layout.parameters())}
    return out


@pytest.fixture(scope="session")  # built once, whatever order xdist runs tests in
def results() -> list[dict]:
    return run_ranks(_ranks, WORLD, timeout=400)


@pytest.fixture(scope="session")  # built once, whatever order xdist runs tests in
def reference() -> tuple[float, dict[str, torch.Tensor]]:
    return unsplit_reference(_model(), _batch())


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_equals_unsplit_model(results, reference, name):
    """The loss (mean over micro-batches and replicas) and every gradient, gathered whole
    over the tensor-parallel ranks and collected from the stages, equal the unsplit model's on
    the whole batch to 1e-5 (relative to each gradient's largest entry)."""
    assert_ranks_equal_reference(results, name, LAYOUTS[name], reference, RTOL)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_data_replicas_are_torch_s_ddp_without_a_hand_written_gradient_all_reduce(results,
                                                                                  name):
    """With ``data > 1`` (ZeRO 0) what runs each stage is DDP (torch's pipeline stage or the
    accumulation loop calls it), and a warm step calls ``all_reduce`` only on scalars (the
    reported loss): no gradient goes through a hand-written all-reduce. Without data
    parallelism nothing is wrapped. After two steps (the first rebuilt DDP's buckets, the
    second followed ``zero_grad(set_to_none=True)``) the gradients are views of DDP's buckets,
    which hold exactly the gradients' bytes: no second copy."""
    data = LAYOUTS[name].data > 1
    for rank_out in results:
        out = rank_out[name]
        assert out["ddp"] and all(d == data for d in out["ddp"]), out["ddp"]
        assert all(n == 1 for n in out["reduced"]), out["reduced"]
        if data:
            assert out["reduced"], "the loss is averaged over the replicas"
            assert out["grad_storage_bytes"] == out["param_bytes"]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_prediction_matches_each_rank_s_measured_peak(results, name):
    """Each rank's peak over a warm step (measured by memfit's tracker: parameters, optimizer
    state, the pipeline's buffers, in-flight activations, gradients) is within 3% of
    predict_layout's figure for that rank, computed here without any process group."""
    predicted = predict_layout(_model(), LAYOUTS[name], batch_size=BATCH, seq_len=SEQ)
    measured = [rank_out[name]["peak"] for rank_out in results]
    assert_rank_peaks(measured, predicted.peak_bytes, 0.03, f"{name}: ")


# --------------------------------------------------------------------------- one process
def test_gpipe_keeps_more_in_flight_than_1f1b_and_tensor_halves_the_blocks():
    """Predicted on fake tensors: with 4 micro-batches over 2 stages the first stage keeps 4
    in flight under GPipe and 2 under 1F1B, so its peak is higher by more than one
    micro-batch's activations (two, less the gradients that 1F1B's peak, in its steady state,
    already holds and GPipe's, in its first backward, does not); 2-way tensor parallelism halves a stage's parameters (blocks, embedding and
    head split; only the norms' few weights replicated)."""
    kw = dict(batch_size=8, seq_len=SEQ)
    gpipe = predict_layout(_model(), ParallelConfig(tensor=2, pipeline=2, schedule="gpipe",
                                                    microbatches=4), **kw)
    one_f = predict_layout(_model(), ParallelConfig(tensor=2, pipeline=2, schedule="1f1b",
                                                    microbatches=4), **kw)
    assert (gpipe.in_flight[0], one_f.in_flight[0]) == (4, 2)
    kept = gpipe.roles[0].forward_kept[0]
    grads = gpipe.roles[0].gradient_bytes
    assert kept < gpipe.peak_bytes[0] - one_f.peak_bytes[0] <= 2 * kept - grads + kept // 10
    whole = predict_layout(_model(), ParallelConfig(pipeline=2, microbatches=4), **kw)
    for stage in (0, 1):
        ratio = one_f.roles[stage].parameter_bytes / whole.roles[stage].parameter_bytes
        assert 0.5 <= ratio < 0.51, (stage, ratio)
    # Ranks in rank order: the two tensor-parallel ranks of a stage predict alike.
    assert one_f.peak_bytes[0] == one_f.peak_bytes[1] and one_f.peak_bytes[2] == one_f.peak_bytes[3]


def test_sequence_parallelism_halves_what_the_norms_keep():
    """Predicted on fake tensors: under 2-way tensor parallelism, Megatron's sequence
    parallelism keeps half of what each RMSNorm saves for backward (its input and its
    normalised output, two hidden-sized fp32 tensors per norm: two norms per block and the
    final one), and nothing else changes; the peak drops by as much."""
    kw = dict(batch_size=8, seq_len=SEQ)
    plain = predict_layout(_model(), ParallelConfig(tensor=2), **kw)
    split = predict_layout(_model(), ParallelConfig(tensor=2, sequence=True), **kw)
    hidden = 8 * SEQ * 64 * 4  # one fp32 batch x sequence x hidden tensor
    norms = 4 * 2 + 1
    saved = plain.roles[0].forward_kept[0] - split.roles[0].forward_kept[0]
    assert norms * hidden <= saved < (norms + 0.5) * hidden  # (+ their small rsqrt vectors)
    assert plain.peak_bytes[0] - split.peak_bytes[0] == saved
    assert split.roles[0].parameter_bytes == plain.roles[0].parameter_bytes


def test_sequence_parallelism_needs_tensor_parallelism():
    """Refused without tensor parallelism; with it, taken with or without a pipeline (the
    stages pass their local shards: tests/distributed/test_sequence_pipeline.py)."""
    with pytest.raises(ValueError, match="needs tensor > 1"):
        memfit.Plan(parallel=ParallelConfig(data=2, sequence=True))
    for pipeline in (1, 2):
        plan = memfit.Plan(parallel=ParallelConfig(tensor=2, pipeline=pipeline, sequence=True))
        assert memfit.Plan.from_dict(plan.to_dict()) == plan


def test_deep_stages_extrapolate_from_one_and_two_blocks():
    """A stage of six blocks predicted from runs at one and two blocks equals the run of all
    six (identical blocks add identical bytes), within 1%."""
    import memfit.estimate.layout as est

    parallel = ParallelConfig(tensor=2, pipeline=2, schedule="1f1b", microbatches=2)
    kw = dict(batch_size=BATCH, seq_len=SEQ)
    composed = predict_layout(_model(12), parallel, **kw)
    saved, est.EXACT_BLOCKS = est.EXACT_BLOCKS, 100
    try:
        whole = predict_layout(_model(12), parallel, **kw)
    finally:
        est.EXACT_BLOCKS = saved
    for c, w in zip(composed.peak_bytes, whole.peak_bytes, strict=True):
        assert c == pytest.approx(w, rel=0.01)


@pytest.mark.slow
def test_llama_70b_predicts_in_seconds():
    """llama-70b (80 layers, hidden 8192) over tensor 8 x pipeline 4 x data 2: 64 ranks
    predicted on fake tensors, no memory, in well under 30 s."""
    start = time.perf_counter()
    parallel = ParallelConfig(tensor=8, pipeline=4, data=2, schedule="1f1b", microbatches=8)
    prediction = predict_layout("llama-70b", parallel, batch_size=16, seq_len=2048)
    assert time.perf_counter() - start < 30
    assert len(prediction.peak_bytes) == 64
    # 1F1B: the first stage keeps the most micro-batches in flight, the last one.
    assert [prediction.in_flight[r] for r in range(4)] == [4, 3, 2, 1]
    # Each rank holds about 1/32 of the 70.6B parameters (fp32) plus its share of the head
    # or embedding; with AdamW's two moments, three copies at least.
    share = 70.6e9 * 4 / 32
    for role in prediction.roles.values():
        assert 0.9 * share < role.parameter_bytes < 1.15 * share
    assert min(prediction.peak_bytes) > 3 * 0.9 * share


@pytest.mark.parametrize(("parallel", "world", "batch", "match"), [
    (ParallelConfig(tensor=2, pipeline=2), 8, None,
     "needs 4 processes but 8 were launched"),
    (ParallelConfig(tensor=3), None, None,
     "tensor-parallel degree 3 does not divide the 4 attention heads and the 2 key-value"),
    (ParallelConfig(pipeline=8, schedule="gpipe"), None, None,
     "4 blocks cannot fill 8 pipeline stages"),
    (ParallelConfig(pipeline=2, microbatches=2, cuts=(4,)), None, None,
     r"pipeline cuts \(4,\) must be 1 strictly increasing block indices between 1 and 3"),
    (ParallelConfig(pipeline=2, schedule="1f1b", microbatches=1), None, None,
     r"use microbatches >= 2 or the gpipe schedule"),
    (ParallelConfig(data=2, pipeline=2, microbatches=4), None, 4,
     "a batch of 4 does not split into data 2 x microbatches 4 = 8 equal micro-batches"),
    (ParallelConfig(data=2, tensor=2, zero_stage=1), None, None,
     "zero_stage 1 .* use zero_stage 0"),
])
def test_layouts_that_cannot_work_are_refused_before_launch(parallel, world, batch, match):
    with pytest.raises(LayoutError, match=match):
        check_layout(_model(), parallel, batch_size=batch, world_size=world)


def test_build_layout_without_a_process_group_says_how_to_launch():
    with pytest.raises(LayoutError, match="torchrun --nproc-per-node 4"):
        build_layout(_model(), ParallelConfig(tensor=2, pipeline=2))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", ["tp2 x pp2, 1f1b", "tp2 x pp2, gpipe"])
def test_the_planner_s_rank_peaks_match_the_measured_ones(results, name, tmp_path):
    """What ``memfit plan --world-size 4 --gpus-per-node 4`` answers for this layout (the plan
    naming its degrees) lists each rank's peak within 5% of the rank's measured peak."""
    from memfit.plan import Plan
    from memfit.planner.layout import plan_layout
    from memfit.workload import load_workload

    _model().config.to_json_file(tmp_path / "config.json")
    workload = load_workload(str(tmp_path / "config.json"), BATCH, SEQ)
    result = plan_layout(workload, "1GiB", WORLD, WORLD, base=Plan(parallel=LAYOUTS[name]))
    par = result.plan.parallel
    assert (par.data, par.tensor, par.pipeline, par.schedule) == (1, 2, 2, LAYOUTS[name].schedule)
    assert "every rank dry-run in its own program" in result.explanation
    measured = [rank_out[name]["peak"] for rank_out in results]
    for rank, (m, p) in enumerate(zip(measured, result.rank_peak_bytes, strict=True)):
        assert p == pytest.approx(m, rel=0.03), f"rank {rank}: measured {m}, planned {p}"
