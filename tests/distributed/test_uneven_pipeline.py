"""Pipelines whose stages do not divide the blocks, in three real processes (gloo, CPU).

A tiny Llama of four blocks is cut into three stages two ways: the default split (the odd
block to the middle stage: 1 + 2 + 1) under 1F1B, and the plan's own ``parallel.cuts``
(``(2, 3)``: 2 + 1 + 1) under GPipe. Each runs a step whose loss and gradients are compared
with the unsplit model's, then a warm step measured by memfit's tracker on every rank and
compared with :func:`~memfit.estimate.layout.predict_layout`, which cuts the same way.
"""

from __future__ import annotations

import pytest
import torch

from memfit.distributed.config import ParallelConfig
from memfit.distributed.layout import build_layout
from memfit.estimate.layout import predict_layout

from .harness import (
    assert_gradients_close,
    assert_rank_peaks,
    run_ranks,
    step_then_track,
    unsplit_reference,
)
from .test_layout import RTOL, SEQ, VOCAB, _model

WORLD = 3
BATCH = 6
LAYOUTS = {
    "pp3, default cuts, 1f1b": ParallelConfig(pipeline=3, schedule="1f1b", microbatches=3),
    "pp3, cuts (2, 3), gpipe": ParallelConfig(pipeline=3, schedule="gpipe", microbatches=3,
                                              cuts=(2, 3)),
}
#: The blocks each stage holds under each layout (what the test checks the cut gave).
BLOCKS = {"pp3, default cuts, 1f1b": [1, 2, 1], "pp3, cuts (2, 3), gpipe": [2, 1, 1]}


def _batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))


def _ranks(rank: int, world: int) -> dict:
    ids = _batch()
    out = {}
    for name, parallel in LAYOUTS.items():
        layout = build_layout(_model(), parallel, batch_size=BATCH)
        run = step_then_track(layout, ids)
        out[name] = {"loss": run["loss"], "grads": run["grads"],
                     "blocks": sum(len(m.block_names) for m in layout.modules),
                     "peak": run["peak"]}
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
def test_uneven_stages_equal_the_unsplit_model(results, reference, name):
    """Each stage holds the blocks its cut gives it, and the loss and every gradient equal the
    unsplit model's on the whole batch to 1e-5 (relative to each gradient's largest entry)."""
    assert [r[name]["blocks"] for r in results] == BLOCKS[name]
    want_loss, want = reference
    got: dict[str, torch.Tensor] = {}
    for rank_out in results:
        assert rank_out[name]["loss"] == pytest.approx(want_loss, rel=RTOL)
        got.update(rank_out[name]["grads"])
    assert set(got) == set(want)
    assert_gradients_close(got, want, RTOL)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_uneven_stages_peaks_match_the_prediction(results, name):
    """Each rank's measured peak over a warm step is within 3% (test_layout.py's tolerance)
    of predict_layout's figure for it, the prediction cutting the blocks as the run did."""
    predicted = predict_layout(_model(), LAYOUTS[name], batch_size=BATCH, seq_len=SEQ)
    measured = [rank_out[name]["peak"] for rank_out in results]
    assert_rank_peaks(measured, predicted.peak_bytes, 0.03, f"{name}: ")
