"""A PipeDream rank's peak, predicted by running its own program on fake tensors.

The asynchronous schedules (:mod:`memfit.distributed.pipedream`) keep weight versions whose
number changes over the step, and step the optimizer inside it, so the replay of torch's
schedule orders (:mod:`memfit.estimate.layout`) does not describe them. Instead the rank's
:class:`~memfit.distributed.pipedream.PipeDreamStage` runs its whole drained step, every
micro-batch, through :func:`~memfit.distributed.pipedream.run_schedule` on fake tensors, with a
stand-in for the point-to-point messages that makes each received tensor where the real
schedule receives it: the same versions stashed and freed at the same actions, the same
per-micro-batch updates. One step first, untracked (the optimizer's state, 2BW's stale
version), then the warm step under memfit's tracker, whose peak is the rank's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..accounting import track
from ..distributed.pipedream import PipeDreamStage, run_schedule
from ..distributed.pipeline import PipelineConfig, build_stage, causal_lm_loss
from .pipeline import _fake

__all__ = ["pipedream_rank_peak"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _FakeLinks:
    """The messages' stand-in: receives are the buffers the schedule made, sends vanish; the
    previous stage's output is ``(micro-batch, seq_len, hidden)`` in the parameters' dtype."""

    prev = next = None

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.shape, self.dtype = shape, dtype

    def exchange(self, sends: list[Any], recvs: list[Any]) -> None:
        pass

    def send_meta(self, out: torch.Tensor) -> None:
        pass

    def recv_meta(self) -> tuple[tuple[int, ...], torch.dtype]:
        return self.shape, self.dtype


def pipedream_rank_peak(build_model: Callable[[], nn.Module], config: PipelineConfig,
                        rank: int, microbatch: int, seq_len: int,
                        make_optimizer: Callable[[list[nn.Parameter]], Any],
                        loss_fn: LossFn | None = None) -> tuple[int, dict[str, int]]:
    """Pipeline rank ``rank``'s peak over a warm PipeDream step, and its bytes by category
    then.

    Args:
        build_model: Builds the model (inside the open fake mode) that ``config`` cuts.
        config: The pipeline (``schedule``, ``microbatches``, ``cuts``, ``vertical_sync``).
        rank: The pipeline rank.
        microbatch: Samples per micro-batch.
        seq_len: Tokens per sample.
        make_optimizer: The optimizer over the stage's parameters.
        loss_fn: The last stage's loss (default: the causal LM's).
    """
    m = config.num_microbatches
    with _fake():
        model = build_model()
        stage = build_stage(model, config, rank)
        del model
        params = list(stage.parameters())
        opt = make_optimizer(params)
        pd = PipeDreamStage(stage, config.schedule, config.degree, rank, config.vertical_sync,
                            loss_fn or causal_lm_loss)
        pd.optimizer = opt
        hidden = stage.hf_config.hidden_size
        dtype = next((p.dtype for p in params if p.is_floating_point()), torch.float32)
        links = _FakeLinks((microbatch, seq_len, hidden), dtype)
        # The batch: input ids on the first stage, labels on the last (one tensor each).
        ids = torch.empty((microbatch * m, seq_len), dtype=torch.long) if pd.is_first else None
        labels = torch.empty((microbatch * m, seq_len), dtype=torch.long) if pd.is_last \
            else None
        run_schedule(pd, links, m, ids, labels, [])
        with track(None, opt) as tracker:
            tracker.label(params, "parameters")
            tracker.add_inputs((ids, labels))
            run_schedule(pd, links, m, ids, labels, [])
        report = tracker.report()
    return report.peak_bytes, dict(report.peak_by_category)
