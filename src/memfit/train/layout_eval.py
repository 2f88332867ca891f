"""Evaluation of a tensor/pipeline run (:mod:`memfit.train.layout_run`): the mean held-out
loss without gradients, weighted as the single-process :func:`~memfit.train.callbacks.evaluate`
weights it (by label tokens), through the layout's own forward.

* With a pipeline, torch's schedule runs forwards only (``schedule.eval``, which
  torch.distributed.pipelining has: the stages pass activations as in training, the last
  stage's loss function gives each micro-batch's loss, no backward); the last stage's sums
  reach every rank by a broadcast over the pipeline group.
* Without one, this rank's module runs each micro-batch forward under ``torch.no_grad``.
* Under tensor parallelism the loss runs on vocabulary-sharded logits inside
  ``loss_parallel``, as in training; with data replicas each evaluates its share of every
  batch and the sums are all-reduced over the ``dp`` dimension.

What this module adds to torch: batches of the training step's shape. A pipeline's stages
exchange buffers of the shape its first step had, so every evaluation batch is padded to the
global batch and sequence length with label ``-100`` rows and columns, which count for
nothing (the loss is a mean over labels that are not ``-100``, and causal attention lets no
real token see a padded one): the loss equals the unsplit model's on the same samples.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..distributed.layout import Layout
from ..workload import Batch
from .streams import map_style_batches

__all__ = ["eval_batches", "evaluate_layout"]

IGNORE = -100


def eval_batches(
    data: Any, batch_size: int, collate_fn: Callable[[list[Any]], Batch], seq_len: int
) -> Iterator[dict[str, torch.Tensor]]:
    """``data``'s samples in order, ``batch_size`` at a time, each batch as ``input_ids`` and
    ``labels`` padded to ``batch_size`` rows and ``seq_len`` columns (or the batch's own
    width, when wider): padded places hold input id 0 and label ``-100``."""
    for batch in map_style_batches(data, batch_size, collate_fn):
        ids = batch["input_ids"] if isinstance(batch, dict) else batch
        labels = batch.get("labels", ids) if isinstance(batch, dict) else ids
        rows, width = ids.shape[0], max(seq_len, ids.shape[1])
        full_ids = torch.zeros((batch_size, width), dtype=ids.dtype)
        full_labels = torch.full((batch_size, width), IGNORE, dtype=labels.dtype)
        full_ids[:rows, : ids.shape[1]] = ids
        full_labels[:rows, : labels.shape[1]] = labels
        yield {"input_ids": full_ids, "labels": full_labels}


def _terms(labels: torch.Tensor) -> int:
    """Loss terms of a causal LM's micro-batch: labels past the first position that count."""
    return int((labels[:, 1:] != IGNORE).sum())


def _plain(loss: torch.Tensor) -> float:
    loss = loss.detach()
    return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)


def evaluate_layout(
    layout: Layout,
    batches: Iterable[Batch],
    *,
    local_batch: Callable[[Batch], Batch],
    autocast: Callable[[], Any] | None = None,
    stop: Callable[[], bool] | None = None,
) -> float:
    """Mean loss of the layout's model over ``batches`` without gradients (a collective:
    every rank calls it with the same batches, and every rank gets the same value).

    Args:
        layout: This rank's layout; its modules are put in eval mode for the pass and back
            after.
        batches: Global batches (:func:`eval_batches`: the training batch's shape).
        local_batch: Turns a global batch into this replica's share on the device
            (:meth:`~memfit.distributed.layout.LayoutStepper.local_batch`).
        autocast: The precision's autocast factory (``None``: fp32).
        stop: Asked before each batch (by every rank: it must give every rank the same
            answer, e.g. an ``any_rank`` of the stop flag); ``True`` ends the pass there.

    Returns:
        The loss per label token (NaN when no batch had one).
    """
    modules = layout.modules
    was = [m.training for m in modules]
    for m in modules:
        m.eval()
    total, weight = 0.0, 0
    try:
        with torch.no_grad(), layout.loss_context():
            for batch in batches:
                if stop is not None and stop():
                    break
                share = local_batch(batch)
                with autocast() if autocast is not None else contextlib.nullcontext():
                    t, w = _share_loss(layout, share["input_ids"], share["labels"])
                total, weight = total + t, weight + w
    finally:
        for m, mode in zip(modules, was, strict=True):
            m.train(mode)
    return _reduce(layout, total, weight)


def _share_loss(layout: Layout, ids: torch.Tensor, labels: torch.Tensor) -> tuple[float, int]:
    """The summed loss and its weight over one replica's share (on the last stage; zeros on
    the other pipeline ranks, which :func:`_reduce` replaces by the broadcast)."""
    m = layout.microbatches
    parts = list(labels.chunk(m))
    if layout.pipeline is not None:
        pipe = layout.pipeline
        losses: list[torch.Tensor] = []
        args = (ids,) if pipe.has_first else ()
        kwargs: dict[str, Any] = {"return_outputs": False}
        if pipe.has_last:
            kwargs.update(target=labels, losses=losses)
        pipe.schedule.eval(*args, **kwargs)
        values = [_plain(x) for x in losses]
    else:
        module = layout.modules[0]
        values = []
        for x, y in zip(ids.chunk(m), parts, strict=True):
            out = module(x)
            values.append(_plain(layout.loss_fn(getattr(out, "logits", out), y)))
    total, weight = 0.0, 0
    for value, y in zip(values, parts, strict=False):  # no values off the last stage
        n = _terms(y)
        if n:  # an all-padding micro-batch's mean is NaN and weighs nothing
            total += value * n
            weight += n
    return total, weight


def _reduce(layout: Layout, total: float, weight: int) -> float:
    device = next((p.device for p in layout.parameters()), torch.device("cpu"))
    sums = torch.tensor([total, float(weight)], dtype=torch.float64, device=device)
    if layout.pipeline is not None:
        pipe = layout.pipeline
        last = pipe.config.rank_of_stage(pipe.config.num_stages - 1)
        src = dist.get_global_rank(pipe.group, last) if pipe.group is not None else last
        dist.broadcast(sums, src=src, group=pipe.group)
    if layout.parallel.data > 1:
        dist.all_reduce(sums, group=layout.mesh["dp"].get_group())
    total, weight = float(sums[0]), float(sums[1])
    return total / weight if weight else float("nan")
