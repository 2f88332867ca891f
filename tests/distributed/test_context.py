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

from .harness import run_ranks

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
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=SEQ, attention_dropout=0.0)
    return LlamaForCausalLM(config).train()


def _batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _ranks(rank: int, world: int) -> dict:
    import memfit

    ids = _batch()
    out = {}
    for name, parallel in LAYOUTS.items():
        layout = build_layout(_model(), parallel, batch_size=BATCH)
        opt = torch.optim.AdamW(layout.parameters(), lr=1e-3)
        loss = layout.step(ids, ids)
        grads = layout.full_grads()
        opt.step()
        opt.zero_grad(set_to_none=True)
        with memfit.track(optimizer=opt) as tracker:  # the warm step
            tracker.label(layout.parameters(), "parameters")
            tracker.add_inputs((ids,))
            layout.step(ids, ids)
            opt.step()
        out[name] = {"loss": float(loss), "grads": grads, "coords": layout.coords,
                     "peak": tracker.report().peak_bytes}
        layout.context.remove()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_ranks, WORLD, timeout=300)


@pytest.fixture(scope="module")
def reference() -> tuple[float, dict[str, torch.Tensor]]:
    model = _model()
    ids = _batch()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return float(loss), {n: p.grad for n, p in model.named_parameters()}


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
        for n, g in want.items():
            torch.testing.assert_close(out["grads"][n], g, rtol=RTOL,
                                       atol=RTOL * float(g.abs().max()), msg=f"rank {r}: {n}")


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_prediction_matches_each_rank_s_measured_peak(results, name):
    """Each rank's peak over a warm step, measured by memfit's tracker, is within 3% of
    predict_layout's figure for it (the rank's own program on fake tensors in a fake process
    group: its chunk's activations and logits, the keys and values in flight)."""
    predicted = predict_layout(_model(), LAYOUTS[name], batch_size=BATCH, seq_len=SEQ)
    measured = [rank_out[name]["peak"] for rank_out in results]
    rows = "; ".join(f"rank {r}: measured {m} B, predicted {p} B ({(p - m) / m:+.2%})"
                     for r, (m, p) in enumerate(zip(measured, predicted.peak_bytes, strict=True)))
    for m, p in zip(measured, predicted.peak_bytes, strict=True):
        assert p == pytest.approx(m, rel=MEMORY_RTOL), f"{name}: {rows}"


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
    (ParallelConfig(context=2, pipeline=2), "is not composed with a pipeline"),
    (ParallelConfig(context=8, context_mode="all-to-all"),
     "does not divide the 4 attention heads of a tensor rank"),
    (ParallelConfig(context=4, tensor=2, context_mode="all-to-all"),
     "does not divide the 2 attention heads of a tensor rank"),
    (ParallelConfig(context=2, context_mode="sideways"), "context_mode 'sideways' is not known"),
])
def test_context_layouts_that_cannot_work_are_refused_before_launch(parallel, match):
    with pytest.raises(LayoutError, match=match):
        check_layout(_model(), parallel)
