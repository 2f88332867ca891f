"""Context parallelism under a pipeline, in four real processes (gloo, CPU).

Context 2 x pipeline 2: every stage runs its rank's chunk of each sample (the first stage cuts
the ids, every stage places the chunk's global positions), the ring attention runs within each
stage's context group, and the stages pass ``seq / 2`` tokens. One spawn of four ranks builds a
tiny Llama (fp32, no dropout) under the 1F1B, GPipe and interleaved 1F1B schedules with
context parallelism and, for comparison, a plain 2-stage pipeline of the same ranks' batch
(data 2 x pipeline 2: each rank also trains half of the samples' tokens); each runs a step whose loss and gradients are
compared with the unsplit model's, then a warm step measured by memfit's tracker, compared
with :func:`~memfit.estimate.layout.predict_layout`.
"""

from __future__ import annotations

import pytest
import torch

from memfit.distributed.config import ParallelConfig
from memfit.distributed.layout import build_layout, layout_coords
from memfit.estimate.layout import predict_layout

from .harness import (
    assert_rank_peaks,
    assert_ranks_equal_reference,
    receive_shapes,
    run_ranks,
    step_then_track,
    unsplit_reference,
)
from .test_sequence_pipeline import BATCH, SEQ, WORLD, _batch, _buffers, _model

LAYOUTS = {
    "cp2 x pp2, 1f1b": ParallelConfig(context=2, pipeline=2, schedule="1f1b", microbatches=2),
    "cp2 x pp2, gpipe": ParallelConfig(context=2, pipeline=2, schedule="gpipe", microbatches=2),
    "cp2 x pp2, interleaved": ParallelConfig(context=2, pipeline=2,
                                             schedule="interleaved-1f1b", microbatches=2),
}
#: The same ranks as a data 2 x pipeline 2 layout: whole samples, half of them each.
PLAIN = "dp2 x pp2, 1f1b"
RUNS = {**LAYOUTS, PLAIN: ParallelConfig(data=2, pipeline=2, schedule="1f1b", microbatches=2)}
#: Gradients gathered whole against the unsplit model's: the order of sums and the ring's
#: online softmax differ.
RTOL = 1e-5
#: Predicted against measured per-rank peaks.
PEAK_RTOL = 0.03


def _ranks(rank: int, world: int) -> dict:
    ids = _batch()
    out = {}
    for name, parallel in RUNS.items():
        layout = build_layout(_model(), parallel, batch_size=BATCH)
        share = BATCH // parallel.data
        d = layout.coords["dp"]
        run = step_then_track(layout, ids[d * share:(d + 1) * share])
        tokens = {shape[1] for _, shape, _ in receive_shapes(layout)}
        out[name] = {"loss": run["loss"], "grads": run["grads"], "coords": layout.coords,
                     "peak": run["peak"], "buffers": _buffers(layout), "tokens": tokens}
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
def test_context_parallel_pipeline_equals_unsplit_model(results, reference, name):
    """The loss (averaged over the context ranks) and every gradient (averaged over them by
    DDP, collected from both stages) equal the unsplit model's on the whole batch to 1e-5
    (relative to each gradient's largest entry)."""
    assert_ranks_equal_reference(results, name, LAYOUTS[name], reference, RTOL)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_prediction_matches_each_rank_s_measured_peak(results, name):
    """Each rank's tracked peak over a warm step is within 3% of predict_layout's figure."""
    predicted = predict_layout(_model(), LAYOUTS[name], batch_size=BATCH, seq_len=SEQ)
    measured = [rank_out[name]["peak"] for rank_out in results]
    assert_rank_peaks(measured, predicted.peak_bytes, PEAK_RTOL, f"{name}: ")


@pytest.mark.distributed
@pytest.mark.slow
def test_stages_pass_the_rank_s_chunk(results):
    """torch's receive buffers hold the chunk: half the sequence's tokens (the plain
    pipeline's hold all of them), and the plain pipeline, which gives each rank half the
    samples whole, has exactly the same buffer bytes per rank."""
    for r, rank_out in enumerate(results):
        assert rank_out["cp2 x pp2, 1f1b"]["tokens"] == {SEQ // 2}
        assert rank_out[PLAIN]["tokens"] == {SEQ}
        kind = "activations" if layout_coords(r, RUNS[PLAIN])["pp"] == 1 else "gradients"
        cp, plain = rank_out["cp2 x pp2, 1f1b"]["buffers"][kind], rank_out[PLAIN]["buffers"][kind]
        assert plain > 0 and cp == plain, (r, kind, cp, plain)
