"""Context parallelism in real processes (gloo, CPU): a tiny Llama's samples cut into chunks,
ring attention and all-to-all (Ulysses) attention, against the unsplit model and against
:func:`~memfit.estimate.layout.predict_layout`.

One spawn of two ranks runs each mode under :func:`~memfit.distributed.layout.build_layout`:
a step whose loss and gradients are compared with the unsplit model's on the whole batch, then
a warm step (forward, backward, optimizer step) measured by memfit's tracker, compared with the
rank's predicted peak.
"""

from __future__ import annotations

import pytest
import torch

from memfit.distributed.config import ParallelConfig
from memfit.distributed.layout import LayoutError, build_layout, check_layout, layout_coords
from memfit.estimate.layout import predict_layout

from .harness import (
    assert_gradients_close,
    assert_rank_peaks,
    run_ranks,
    step_then_track,
    tiny_llama,
    token_batch,
    unsplit_reference,
)

WORLD = 2
BATCH, SEQ, VOCAB = 2, 128, 256
LAYOUTS = {
    "context 2, ring": ParallelConfig(context=2),
    "context 2, all-to-all": ParallelConfig(context=2, context_mode="all-to-all"),
}
#: Gradients against the unsplit model's: the attention's softmax is merged from blocks (ring)
#: and sums run in another order, so they agree to fp32 rounding, not bit for bit.
RTOL = 1e-5
#: A rank's measured peak against its prediction.
MEMORY_RTOL = 0.03


def _model() -> torch.nn.Module:
    return tiny_llama(VOCAB, SEQ, 2)


def _batch() -> torch.Tensor:
    return token_batch(BATCH, SEQ, VOCAB)


def _ranks(rank: int, world: int) -> dict:
    ids = _batch()
    out = {}
    for name, parallel in LAYOUTS.items():
        layout = build_layout(_model(), parallel, batch_size=BATCH)
        run = step_then_track(layout, ids)
        out[name] = {"loss": run["loss"], "grads": run["grads"], "coords": layout.coords,
                     "peak": run["peak"]}
        layout.context.remove()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_ranks, WORLD, timeout=300)


@pytest.fixture(scope="module")
def reference() -> tuple[float, dict[str, torch.Tensor]]:
    return unsplit_reference(_model(), _batch())


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_equals_unsplit_model(results, reference, name):
    """Each rank's reported loss (the mean over every token of the whole samples) and its
    gradients (averaged over the context ranks) equal the unsplit model's to 1e-5 (relative
    to each gradient's largest entry)."""
    want_loss, want = reference
    for r, rank_out in enumerate(results):
        out = rank_out[name]
        assert out["coords"] == layout_coords(r, LAYOUTS[name])
        assert out["coords"]["cp"] == r
        assert out["loss"] == pytest.approx(want_loss, rel=RTOL)
        assert set(out["grads"]) == set(want)
        assert_gradients_close(out["grads"], want, RTOL, f"rank {r}: ")


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_prediction_matches_each_rank_s_measured_peak(results, name):
    """Each rank's peak over a warm step, measured by memfit's tracker, is within 3% of
    predict_layout's figure for it (the rank's own program on fake tensors in a fake process
    group: its chunk's activations and logits, the keys and values in flight)."""
    predicted = predict_layout(_model(), LAYOUTS[name], batch_size=BATCH, seq_len=SEQ)
    measured = [rank_out[name]["peak"] for rank_out in results]
    assert_rank_peaks(measured, predicted.peak_bytes, MEMORY_RTOL, f"{name}: ")


# --------------------------------------------------------------------------- one process
@pytest.mark.parametrize("mode", ["ring", "all-to-all"])
def test_a_rank_keeps_half_the_activations_of_the_unsplit_model(mode):
    """Predicted on fake tensors: what a forward keeps for backward on one of two context
    ranks is half (within 10%: the ring's saved log-sum-exp and a chunk's rounding) of what
    the unsplit model keeps, and its parameters are the whole model's."""
    one = predict_layout(_model(), ParallelConfig(), batch_size=BATCH, seq_len=SEQ).roles[0]
    two = predict_layout(_model(), ParallelConfig(context=2, context_mode=mode),
                         batch_size=BATCH, seq_len=SEQ).roles[0]
    assert two.forward_kept[0] == pytest.approx(one.forward_kept[0] / 2, rel=0.1)
    assert two.parameter_bytes == one.parameter_bytes


@pytest.mark.parametrize(("parallel", "match"), [
    (ParallelConfig(context=2, pipeline=2, schedule="pipedream"),
     "tensor, context and expert 1"),
    (ParallelConfig(context=8, context_mode="all-to-all"),
     "does not divide the 4 attention heads of a tensor rank"),
    (ParallelConfig(context=4, tensor=2, context_mode="all-to-all"),
     "does not divide the 2 attention heads of a tensor rank"),
    (ParallelConfig(context=2, context_mode="sideways"), "context_mode 'sideways' is not known"),
    (ParallelConfig(context=3), "context parallelism of 3 does not divide the sequence of 128 "
                                "tokens into equal chunks; use a sequence length that is a "
                                "multiple of 3"),
])
def test_context_layouts_that_cannot_work_are_refused_before_launch(parallel, match):
    with pytest.raises(LayoutError, match=match):
        check_layout(_model(), parallel, seq_len=SEQ)


# --------------------------------------------------------------------------- four processes
FOUR = {
    "tensor 2 x context 2": ParallelConfig(tensor=2, context=2),
    "data 2 x context 2, ZeRO 3": ParallelConfig(data=2, context=2, zero_stage=3),
}


def _four_ranks(rank: int, world: int) -> dict:
    ids = _batch()
    out = {}
    for name, parallel in FOUR.items():
        layout = build_layout(_model(), parallel, batch_size=BATCH)
        d = layout.coords["dp"]
        share = BATCH // parallel.data
        local = ids[d * share:(d + 1) * share]  # this replica's samples
        run = step_then_track(layout, local)
        out[name] = {"loss": run["loss"], "grads": run["grads"], "peak": run["peak"]}
    return out


@pytest.fixture(scope="module")
def four() -> list[dict]:
    return run_ranks(_four_ranks, 4, timeout=400)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", list(FOUR))
def test_context_composes_with_tensor_and_data_parallelism(four, reference, name):
    """Context parallelism beside tensor parallelism (vocabulary-parallel loss on the chunk's
    logits) and beside data parallelism with FSDP2 sharding over data x context: every rank's
    loss and whole gradients equal the unsplit model's to 1e-5."""
    want_loss, want = reference
    for r, rank_out in enumerate(four):
        out = rank_out[name]
        assert out["loss"] == pytest.approx(want_loss, rel=RTOL)
        assert_gradients_close(out["grads"], want, RTOL, f"rank {r}: ")


@pytest.mark.distributed
@pytest.mark.slow
def test_tensor_x_context_ranks_peak_as_predicted(four):
    """Each rank of tensor 2 x context 2 peaks within 3% of predict_layout's figure."""
    name = "tensor 2 x context 2"
    predicted = predict_layout(_model(), FOUR[name], batch_size=BATCH, seq_len=SEQ)
    for r, (rank_out, p) in enumerate(zip(four, predicted.peak_bytes, strict=True)):
        m = rank_out[name]["peak"]
        assert p == pytest.approx(m, rel=MEMORY_RTOL), f"rank {r}: measured {m}, predicted {p}"


def test_a_plan_s_context_degree_round_trips_and_bad_ones_are_one_sentence():
    """``parallel.context`` and ``context_mode`` survive the plan's JSON; a bad degree or mode
    is refused with one sentence naming the field."""
    import json

    from memfit.plan import Plan, PlanError

    plan = Plan(parallel={"context": 4, "context_mode": "all-to-all", "tensor": 2})
    back = Plan.from_dict(json.loads(plan.to_json()))
    assert back == plan and back.parallel.context == 4
    assert back.parallel.world_size == 8
    assert "context 4 (all-to-all)" in plan.summary()
    with pytest.raises(PlanError, match=r"^parallel context must be a whole number >= 1, got 0$"):
        Plan(parallel={"context": 0})
    with pytest.raises(PlanError, match=r"^parallel context_mode 'ulysses' is not known; use "
                                        r"one of ring, all-to-all$"):
        Plan(parallel={"context": 2, "context_mode": "ulysses"})
