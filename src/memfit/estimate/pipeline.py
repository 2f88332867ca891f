"""Pipeline parallelism measured without launching: per-block profiles and the schedules'
micro-batches in flight.

Everything runs in one process on fake tensors (nothing allocated), under memfit's tracker:

* :func:`profile_blocks`: one micro-batch through the whole model; per block, the bytes its
  forward keeps for backward (the tracker's ``activations`` before and after it), its
  parameter bytes and its forward FLOPs (``torch.utils.flop_counter``); the embeddings (before
  the first block) and the head with the loss (after the last) apart.
* :func:`schedule_in_flight`: the micro-batches each rank keeps in flight, read off torch's own
  schedule objects built in a fake process group, which checks the closed form
  (:func:`~memfit.distributed.pipeline_plan.microbatches_in_flight`, what
  :mod:`memfit.estimate.layout_cost` counts with) against what torch will run.

Each rank's whole program under a schedule is predicted by
:func:`memfit.estimate.layout.predict_layout` (:class:`memfit.estimate.predictor.Layout`),
which replays the same schedule orders.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..accounting import track
from ..distributed.config import PIPEDREAM_SCHEDULES, PIPELINE_SCHEDULES
from ..distributed.pipeline import (
    BlockCost,
    PipelineConfig,
    build_stage,
    causal_lm_loss,
    check_pipeline,
    model_blocks,
)
from .distributed import fake_process_group

__all__ = ["PipelineProfile", "profile_blocks", "schedule_in_flight"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class PipelineProfile:
    """One micro-batch's costs, block by block.

    Attributes:
        blocks: One :class:`BlockCost` per block, in order.
        first: What comes before the first block (the embeddings).
        last: What comes after the last block (final norm, head and loss).
        block_names: The blocks' qualified names.
    """

    blocks: tuple[BlockCost, ...]
    first: BlockCost
    last: BlockCost
    block_names: tuple[str, ...]


@contextlib.contextmanager
def _fake() -> Iterator[Any]:
    """A fake-tensor mode as memfit's dry runs open it: the real kernels' rules, and the value
    shadows that let transformers take the real run's path (SDPA's ``is_causal``, no mask)."""
    from .fake_kernels import real_kernel_rules
    from .fast_fake import DryFakeTensorMode
    from .values import DryRunValues

    mode = DryFakeTensorMode(allow_non_fake_inputs=True)
    with real_kernel_rules(), mode, DryRunValues():
        yield mode


def _fake_state(module: nn.Module, mode: Any) -> dict[str, torch.Tensor]:
    """Fake copies of ``module``'s parameters and buffers, by name (no memory)."""
    out = {}
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        fake = mode.from_tensor(t)
        if isinstance(t, nn.Parameter):
            fake.requires_grad_(t.requires_grad)
        out[name] = fake
    return out


def _like(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A tensor of ``t``'s shape and dtype, created in the open fake mode.

    ``empty``, not ``zeros``: the dry run's value shadows follow ``zeros`` for real, and a
    shadow that required gradients would record a real autograd graph of its own.
    """
    x = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    return x.requires_grad_(requires_grad and x.is_floating_point())


def _default_loss(model: nn.Module, loss_fn: LossFn | None) -> LossFn | None:
    if loss_fn is not None:
        return loss_fn
    return None if isinstance(model, nn.Sequential) else causal_lm_loss


def profile_blocks(model: nn.Module, example_input: torch.Tensor,
                   example_target: torch.Tensor | None = None, *,
                   loss_fn: LossFn | None = None) -> PipelineProfile:
    """Profile one micro-batch's forward through ``model`` block by block, on fake tensors.

    Args:
        model: A model :func:`~memfit.distributed.pipeline.build_stage` can split (real or
            built under fake tensors).
        example_input: One micro-batch of inputs (input ids for a causal LM); only its shape
            and dtype are used.
        example_target: Its targets (labels), for the loss's cost; ``None`` leaves the loss out.
        loss_fn: The loss (default for causal LMs: their shifted cross-entropy).

    Returns:
        The :class:`PipelineProfile`: activation bytes kept for backward, parameter bytes
        and compute (3 x forward FLOPs: a backward costs about twice its forward) per block.
    """
    from torch.utils.flop_counter import FlopCounterMode

    blocks = model_blocks(model)
    loss_fn = _default_loss(model, loss_fn)
    marks: list[tuple[int, float]] = []  # (activations, flops) at each block boundary

    with _fake() as mode:
        state = _fake_state(model, mode)
        x = _like(example_input, requires_grad=False)
        y = _like(example_target, False) if example_target is not None else None
        with track(None) as tracker, FlopCounterMode(display=False) as flops:
            tracker.label(list(state.values()), "parameters")
            tracker.label((x, y), "inputs")

            def mark(*_: Any) -> None:
                marks.append((tracker.snapshot()["activations"], flops.get_total_flops()))

            hooks = []
            for _, block in blocks:
                hooks.append(block.register_forward_pre_hook(mark))
                hooks.append(block.register_forward_hook(mark))
            try:
                out = torch.func.functional_call(model, state, (x,))
                out = getattr(out, "logits", out)
                # Held until measured: its saved tensors count while the loss's graph lives.
                loss = loss_fn(out, y) if loss_fn is not None and y is not None else None
                end = (tracker.snapshot()["activations"], flops.get_total_flops())
                del loss
            finally:
                for h in hooks:
                    h.remove()

    costs = []
    for i, (_, block) in enumerate(blocks):
        (a0, f0), (a1, f1) = marks[2 * i], marks[2 * i + 1]
        costs.append(BlockCost(_param_bytes(block), a1 - a0, 3.0 * (f1 - f0)))
    in_blocks = {id(p) for _, b in blocks for p in b.parameters()}
    outside = [p for p in model.parameters() if id(p) not in in_blocks]
    first_ids = _first_params(model, blocks)
    first_bytes = sum(_nbytes(p) for p in outside if id(p) in first_ids)
    last_bytes = sum(_nbytes(p) for p in outside if id(p) not in first_ids)
    a_first, f_first = marks[0]
    a_last, f_last = marks[2 * len(blocks) - 1]
    return PipelineProfile(
        blocks=tuple(costs),
        first=BlockCost(first_bytes, a_first, 3.0 * f_first),
        last=BlockCost(last_bytes, end[0] - a_last, 3.0 * (end[1] - f_last)),
        block_names=tuple(name for name, _ in blocks),
    )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _param_bytes(module: nn.Module) -> int:
    return sum(_nbytes(p) for p in module.parameters())


def _first_params(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> set[int]:
    """Parameters the first stage holds besides its blocks (the embeddings); a weight tied
    to the head counts there (the last stage holds a copy, counted with the head too)."""
    config = PipelineConfig(degree=2, cuts=(len(blocks) - 1,)) if len(blocks) > 1 else None
    if config is None:
        return set()
    stage = build_stage(model, config, 0)
    in_blocks = {id(p) for b in stage.blocks() for p in b.parameters()}
    return {id(p) for p in stage.parameters() if id(p) not in in_blocks}


def schedule_in_flight(config: PipelineConfig) -> list[int]:
    """Per rank, the most micro-batches (chunks) in flight in the order torch's own schedule
    will run, read off its ``pipeline_order`` built in a fake process group (nothing runs).

    A forward opens a micro-batch on a stage; its full backward, or its input-gradient
    backward in zero-bubble schedules, closes it.

    Raises:
        RuntimeError: when this process is already in a process group.
    """
    if config.schedule in PIPEDREAM_SCHEDULES:  # memfit's own 1F1B order, not torch's
        from ..distributed.pipedream import one_f_one_b

        return [_replay([_Action(k, 0) for k, _ in one_f_one_b(config.degree,
                                                              config.num_microbatches, r)],
                        lambda s: 1) for r in range(config.degree)]
    orders = _schedule_orders(config)
    return [_replay(orders[rank], lambda s: 1) for rank in range(config.degree)]


@dataclasses.dataclass(frozen=True)
class _Action:
    """An action in the shape of torch's (its ``computation_type`` and ``stage_index``)."""

    computation_type: str
    stage_index: int


def _schedule_orders(config: PipelineConfig) -> dict[int, list[Any]]:
    """Every rank's actions in torch's schedule for ``config`` (built as rank 0 in a fake
    process group: each schedule computes every rank's order)."""
    import dataclasses

    from torch.distributed import pipelining

    config = dataclasses.replace(config, cuts=None)
    check_pipeline(config.num_stages, config)
    with fake_process_group(config.degree, 0):
        stages = [pipelining.PipelineStage(nn.Identity(), s, config.num_stages,
                                           torch.device("cpu"))
                  for s in config.stage_indices(0)]
        cls = getattr(pipelining, PIPELINE_SCHEDULES[config.schedule])
        single = config.schedule in ("gpipe", "1f1b")
        schedule = cls(stages[0] if single else stages, config.num_microbatches,
                       loss_fn=causal_lm_loss)
        return dict(schedule.pipeline_order)


def _replay(actions: list[Any], nbytes: Callable[[int], int]) -> int:
    """The peak of a rank's kept activations over its actions: a forward adds its stage's
    ``nbytes(stage)``, a full or input-gradient backward removes them."""
    live = peak = 0
    for action in actions:
        if action is None:
            continue
        kind = str(action.computation_type).rsplit(".", 1)[-1]
        if kind in ("FORWARD", "F"):
            live += nbytes(action.stage_index)
        elif kind in ("FULL_BACKWARD", "B", "BACKWARD_INPUT", "I"):
            live -= nbytes(action.stage_index)
        peak = max(peak, live)
    return peak
