"""Gradient accumulation weights: numerics against the full batch, and activation memory."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import memfit
from memfit.strategies.accumulation import count_loss_terms, loss_weights
from memfit.workload import load_workload, split_batch


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def _accumulated_grads(model, batch, micro, loss_of, normalization, **kw) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    parts = split_batch(batch, micro)
    for part, w in zip(parts, loss_weights(parts, normalization, **kw), strict=True):
        (loss_of(model, part) * w).backward()
    return _grads(model)


def _full_grads(model, batch, loss_of) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss_of(model, batch).backward()
    return _grads(model)


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


# ---------------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_mean_with_unequal_micro_batches_equals_full_batch(dtype, tol):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).to(dtype)
    batch = {"x": torch.randn(10, 6, dtype=dtype), "y": torch.randn(10, 3, dtype=dtype)}

    def loss_of(m, b):
        return F.mse_loss(m(b["x"]), b["y"])

    # 10 samples in micro-batches of 4: sizes 4, 4, 2 (a plain average of the three losses
    # would over-weight the short one).
    assert loss_weights(split_batch(batch, 4), "mean") == [0.4, 0.4, 0.2]
    full = _full_grads(model, batch, loss_of)
    acc = _accumulated_grads(model, batch, 4, loss_of, "mean")
    assert _max_diff(full, acc) < tol


def _causal_lm_batch():
    model, batch = load_workload("gpt2-tiny", 4, 16).build()
    model.eval()  # no dropout: the micro-batch and full-batch forwards must be identical
    labels = batch["labels"]
    # Different numbers of ignored labels per row, including the first column (which the
    # causal shift drops anyway) and a row whose only ignored label is the first one.
    labels[0, :1] = -100
    labels[1, 10:] = -100
    labels[2, :3] = -100
    labels[3, 4:] = -100
    # Right padding where the labels are ignored in rows 1 and 3.
    mask = torch.ones_like(labels)
    mask[1, 10:] = 0
    mask[3, 4:] = 0
    batch["attention_mask"] = mask
    return model, batch


def _lm_loss(m, b):
    return m(**b).loss


@pytest.mark.parametrize("micro", [1, 3])
def test_tokens_equals_full_batch_for_causal_lm(micro):
    model, batch = _causal_lm_batch()
    full = _full_grads(model, batch, _lm_loss)
    acc = _accumulated_grads(model, batch, micro, _lm_loss, "tokens")
    assert _max_diff(full, acc) < 1e-6


def test_tokens_counts_shifted_labels():
    _, batch = _causal_lm_batch()
    parts = split_batch(batch, 1)
    # Shifted: labels[:, 1:] != -100 per row: 15, 9, 13, 3 (of 40).
    assert [count_loss_terms(p) for p in parts] == [15, 9, 13, 3]
    assert loss_weights(parts, "tokens") == pytest.approx([15 / 40, 9 / 40, 13 / 40, 3 / 40])
    # Unshifted counting (masked LMs) keeps column 0.
    assert [count_loss_terms(p, shift_labels=False) for p in parts] == [15, 10, 13, 4]


def test_mean_weights_are_wrong_for_padded_causal_lm():
    # The reason 'tokens' exists: sample weights do not give the full-batch gradient here.
    model, batch = _causal_lm_batch()
    full = _full_grads(model, batch, _lm_loss)
    acc = _accumulated_grads(model, batch, 1, _lm_loss, "mean")
    assert _max_diff(full, acc) > 1e-4


def test_count_loss_terms_kinds_of_labels():
    ids = torch.zeros(3, 5, dtype=torch.long)
    cls = torch.tensor([1, -100, 0])
    assert count_loss_terms({"input_ids": ids, "labels": cls}) == 2  # 1-D: no shift
    reg = torch.randn(3, 2)
    assert count_loss_terms({"input_ids": ids, "labels": reg}) == 3  # float: rows
    # Pre-shifted labels (Hugging Face's ``shift_labels``) are counted as they are.
    pre = torch.full((3, 5), 7)
    pre[:, -1] = -100
    assert count_loss_terms({"input_ids": ids, "labels": ids, "shift_labels": pre}) == 12
    # 2-D labels without input_ids of the same shape are not shifted unless asked.
    tok = torch.ones(3, 5, dtype=torch.long)
    assert count_loss_terms({"labels": tok}) == 15
    assert count_loss_terms({"labels": tok}, shift_labels=True) == 12
    assert count_loss_terms({"labels": tok}, ignore_index=1) == 0


def test_errors():
    with pytest.raises(ValueError, match=r"'mean' .* or 'tokens'"):
        loss_weights([torch.zeros(2)], "sum")
    with pytest.raises(ValueError, match="no 'labels'"):
        loss_weights([{"input_ids": torch.zeros(2, 3, dtype=torch.long)}], "tokens")
    with pytest.raises(ValueError, match="at least one"):
        loss_weights([], "mean")
    ids = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="undefined"):
        loss_weights([{"input_ids": ids, "labels": torch.full((2, 3), -100)}], "tokens")


def test_micro_batch_without_tokens_gets_zero_weight():
    ids = torch.zeros(2, 3, dtype=torch.long)
    empty = {"input_ids": ids, "labels": torch.full((2, 3), -100)}
    some = {"input_ids": ids, "labels": torch.ones(2, 3, dtype=torch.long)}
    assert loss_weights([empty, some], "tokens") == [0.0, 1.0]


def test_mean_accepts_tensor_and_tuple_batches():
    assert loss_weights([torch.zeros(3, 2), torch.zeros(1, 2)]) == [0.75, 0.25]
    assert loss_weights(
        [(torch.zeros(2, 4), torch.zeros(2)), (torch.zeros(2, 4), torch.zeros(2))]
    ) == [
        0.5,
        0.5,
    ]


# ---------------------------------------------------------------------------------- memory
def _activation_peak(model, batch, micro) -> int:
    with memfit.track(model) as tr:
        parts = split_batch(batch, micro)
        for part, w in zip(parts, loss_weights(parts, "tokens"), strict=True):
            (model(**part).loss * w).backward()
    model.zero_grad(set_to_none=True)
    return max(tr.report().timeline["activations"])


def test_activation_peak_scales_with_micro_batch():
    big, seq = 8, 32
    model, batch = load_workload("gpt2-tiny", big, seq).build()
    model.eval()
    full = _activation_peak(model, batch, big)
    for micro in (4, 1):
        peak = _activation_peak(model, batch, micro)
        # Every tensor a transformer saves for backward has the batch as its leading dimension,
        # except batch-independent ones (position ids, the causal mask) of at most seq x seq
        # float elements; micro-batches run one after the other, so the peak is one
        # micro-batch's activations: micro/big of the full batch's, give or take that constant.
        slack = 4 * seq * seq
        assert abs(peak - full * micro / big) <= slack, (micro, peak, full)
