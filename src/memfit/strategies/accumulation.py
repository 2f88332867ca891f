"""Gradient accumulation: the weights that make micro-batch losses add up to the full batch's.

A batch of ``N`` samples split into micro-batches gives the same gradient as the whole batch
when each micro-batch's loss is multiplied by the right weight before its backward. Activations
then exist for one micro-batch at a time (memory scales with the micro-batch size) at the same
total compute, less parallel.

The right weight depends on what the loss averages over. A loss that is a mean over the
micro-batch's ``n_i`` terms is ``S_i / n_i``, where ``S_i`` is the sum of its terms; the full
batch's loss is ``S / n`` with ``S = sum S_i`` and ``n = sum n_i``. So ``w_i = n_i / n`` gives
``sum w_i * loss_i = S / n`` exactly, whatever the micro-batch sizes. Only the count of terms
differs between normalisations:

* ``mean``: the terms are samples (``n_i`` is the micro-batch size);
* ``tokens``: the terms are the label tokens that reach the loss (a causal LM averages over
  its non-ignored, shifted labels, so a micro-batch with more padding has fewer terms).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..techniques import Technique
from ..workload import Batch, batch_size_of

__all__ = ["count_loss_terms", "loss_weights"]

_NORMALIZATIONS = ("mean", "tokens")


def loss_weights(
    micro_batches: Sequence[Batch],
    normalization: str = "mean",
    *,
    ignore_index: int = -100,
    shift_labels: bool | None = None,
) -> list[float]:
    """Weights for micro-batch losses so that their weighted sum is the full-batch loss.

    Multiply micro-batch ``i``'s (mean-reduced) loss by ``weights[i]`` before its backward; the
    accumulated gradient then equals the full batch's gradient (up to float rounding).

    Args:
        micro_batches: The micro-batches of one optimizer step (e.g. from
            :func:`~memfit.workload.split_batch`).
        normalization: ``"mean"``: ``w_i = n_i / N`` with ``n_i`` samples in micro-batch ``i``
            and ``N`` in all, so unequal sizes (a short last micro-batch) still give the
            full-batch mean. ``"tokens"``: ``w_i = t_i / T`` with ``t_i`` the number of label
            entries that contribute to the loss in micro-batch ``i`` and ``T`` the total; see
            :func:`count_loss_terms` for exactly what is counted.
        ignore_index: Label value the loss ignores (Hugging Face and ``cross_entropy`` use
            ``-100``).
        shift_labels: For ``"tokens"``: whether the model drops the first label of each row
            (causal LMs predict token ``j+1`` from tokens ``..j``, so Hugging Face compares
            ``logits[:, :-1]`` with ``labels[:, 1:]``). ``None`` decides per batch: shift when
            the labels are 2-D with the shape of ``input_ids`` (causal-LM style). Masked LMs
            have labels of that shape too but do not shift: pass ``False`` for them.

    Returns:
        One float per micro-batch; they sum to 1. A micro-batch without any loss term gets
        weight 0 (its own mean loss is NaN: skip its backward).

    Raises:
        ValueError: for an unknown normalisation, no micro-batches, or ``"tokens"`` when the
            batches hold no labels or no label counts at all.
    """
    if normalization not in _NORMALIZATIONS:
        raise ValueError(
            f"loss normalization {normalization!r} is not known; use 'mean' (weight by samples) "
            "or 'tokens' (weight by label tokens that reach the loss)"
        )
    if len(micro_batches) == 0:
        raise ValueError("loss_weights needs at least one micro-batch")
    if normalization == "mean":
        counts = [batch_size_of(b) for b in micro_batches]
    else:
        counts = [
            count_loss_terms(b, ignore_index=ignore_index, shift_labels=shift_labels)
            for b in micro_batches
        ]
    total = sum(counts)
    if total == 0:
        raise ValueError(
            "no micro-batch has a label that reaches the loss (every label is "
            f"{ignore_index}); the full-batch loss is undefined, so skip this batch"
        )
    return [c / total for c in counts]


def count_loss_terms(
    batch: Batch, *, ignore_index: int = -100, shift_labels: bool | None = None
) -> int:
    """How many terms a mean-reduced loss over ``batch`` averages over.

    * A batch with a ``shift_labels`` tensor (Hugging Face's pre-shifted labels): its entries
      that are not ``ignore_index``.
    * Integer ``labels`` of 2 or more dimensions (token labels): entries that are not
      ``ignore_index``, after dropping column 0 when shifting (``labels[:, 1:]``; see
      :func:`loss_weights` for when it shifts).
    * Integer ``labels`` of 1 dimension (sequence classification): labels that are not
      ``ignore_index`` (``cross_entropy`` ignores those too), normally the number of samples.
    * Float ``labels`` (regression, multi-label) or no ``labels``: the number of samples (rows),
      since every row then has the same number of loss terms.

    Args:
        batch: One micro-batch (a dict of model keyword arguments, a tensor or a tuple).
        ignore_index: Label value the loss ignores.
        shift_labels: ``True``/``False`` to force or forbid the causal shift; ``None``: auto.

    Raises:
        ValueError: when the batch has no ``labels`` (token counting needs them).
    """
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    pre_shifted = batch.get("shift_labels") if isinstance(batch, Mapping) else None
    if isinstance(pre_shifted, torch.Tensor):
        return _count(pre_shifted, ignore_index)
    if not isinstance(labels, torch.Tensor):
        raise ValueError(
            "loss normalization 'tokens' counts label tokens, but the batch has no 'labels' "
            "tensor; pass labels in the batch or use loss_normalization 'mean'"
        )
    if labels.is_floating_point() or labels.is_complex():
        return int(labels.shape[0]) if labels.dim() > 0 else 1
    if labels.dim() <= 1:
        return _count(labels, ignore_index)
    if shift_labels is None:
        ids = batch.get("input_ids")
        shift_labels = (
            isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape == labels.shape
        )
    if shift_labels:
        labels = labels[:, 1:]
    return _count(labels, ignore_index)


def _count(labels: torch.Tensor, ignore_index: int) -> int:
    """Entries of ``labels`` that are not ``ignore_index``.

    A dry run's labels are fake tensors without values: there every entry counts. The weights
    only scale each micro-batch's loss, so the memory a dry run measures is the same.
    """
    from ..device import is_fake

    if is_fake(labels):
        return int(labels.numel())
    return int((labels != ignore_index).sum().item())


def _accumulation_summary(config: tuple[int | None, int]) -> str:
    micro, steps = config
    return f"micro-batch {micro if micro is not None else 'auto'} x {steps}"


def _check_accumulation(plan: Any) -> None:
    """The micro-batch size and the accumulation steps (``Technique.check``)."""
    if plan.micro_batch_size is not None and (
        not isinstance(plan.micro_batch_size, int) or plan.micro_batch_size < 1
    ):
        raise ValueError(
            f"micro_batch_size must be a whole number >= 1 or null, got {plan.micro_batch_size!r}"
        )
    if not isinstance(plan.grad_accum_steps, int) or plan.grad_accum_steps < 1:
        raise ValueError(
            f"grad_accum_steps must be a whole number >= 1, got {plan.grad_accum_steps!r}"
        )


#: Micro-batches with weighted losses, run by the step (``run_step``); a pipeline's own
#: micro-batches replace it in a tensor/pipeline layout.
ACCUMULATION = Technique(
    name="accumulation",
    plan_field=("micro_batch_size", "grad_accum_steps"),
    order=200,
    is_on=lambda plan: plan.micro_batch_size is not None or plan.grad_accum_steps > 1,
    engines=frozenset({"single", "data", "hf", "lightning"}),
    label=lambda plan: "micro_batch_size / grad_accum_steps (parallel microbatches does this)",
    swappable=True,
    forbid={"accumulation": "gradient accumulation (micro-batches)"},
    summary=_accumulation_summary,
    check=_check_accumulation,
)


def _normalization_refusal(plan: Any, engine: str) -> str | None:
    if engine == "hf":
        return (
            "loss_normalization 'tokens' is the Trainer's own behaviour for causal LMs "
            "(num_items_in_batch); set it to 'mean' in the plan"
        )
    if engine == "lightning":
        return (
            "loss_normalization 'tokens' is not supported in a lightning.Trainer, which divides "
            "each micro-batch loss by accumulate_grad_batches; use 'mean'"
        )
    return None


def _check_normalization(plan: Any) -> None:
    """The loss normalization's modes (``Technique.check``)."""
    if plan.loss_normalization not in ("mean", "tokens"):
        raise ValueError(
            f"loss_normalization {plan.loss_normalization!r} is not known; use 'mean' or 'tokens'"
        )
    if plan.loss_normalization == "tokens" and (
        plan.parallel.world_size > 1 or plan.parallel.zero_stage
    ):
        raise ValueError(
            "loss_normalization 'tokens' cannot be combined with data parallelism yet: each "
            "process would weight by its own token count, not the whole batch's; use 'mean'"
        )


#: Weighting micro-batch losses by their label tokens instead of their samples.
LOSS_NORMALIZATION = Technique(
    name="loss_normalization",
    plan_field="loss_normalization",
    order=201,
    is_on=lambda plan: plan.loss_normalization != "mean",
    engines=frozenset({"single", "data"}),
    refusal=_normalization_refusal,
    label=lambda plan: f"loss_normalization {plan.loss_normalization!r}",
    swappable=True,
    check=_check_normalization,
)
