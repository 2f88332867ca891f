"""Dry runs of memfit's optimizers: each kind of parameter update dispatched once a step.

On fake tensors an update computes nothing and allocates by shapes alone, so after the first
update of each kind in a training step, the others with the same key are replayed into the
tracker (:mod:`memfit.accounting.replay`): the planner's full-depth dry runs step every
matrix of every block, and most of that dispatch is repeated. Real tensors are always updated.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from torch import Tensor

from ..accounting import replay
from ..device import is_fake

__all__ = ["next_step", "run_update"]


def next_step(state: dict[str, Any]) -> None:
    """Count a replayed update's step (an update that counts its own steps)."""
    state["step"] += 1


def _meta(t: Any) -> Hashable:
    if isinstance(t, Tensor):
        # What an update's allocations can depend on: copies follow dtype, size and layout.
        return (type(t).__name__, t.dtype, tuple(t.shape), t.is_contiguous(), t.device.type)
    if isinstance(t, (int, float, bool, str, type(None))):
        return (type(t).__name__, t)
    if isinstance(t, (tuple, list)):
        return tuple(_meta(x) for x in t)
    return ("object", id(t))  # anything else matches only itself


def _group_key(group: dict[str, Any]) -> Hashable:
    return tuple(sorted((k, _meta(v)) for k, v in group.items() if k != "params"))


def run_update(
    optimizer: Any,
    group: dict[str, Any],
    key: Hashable,
    tensors: tuple[Tensor, ...],
    state: dict[str, Any],
    update: Callable[..., None],
    args: tuple[Any, ...],
    on_replay: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """Run ``update`` (one parameter's update), or replay an identical one in a dry run.

    Args:
        optimizer: The optimizer (its type is part of the key).
        group: The parameter's group (its settings are part of the key: an optimizer per
            parameter, as the fused step makes, still shares its updates' recordings).
        key: What else the update's allocations depend on (the optimizer's own settings).
        tensors: The tensors it reads (parameter, gradient, ...): their shapes, dtypes and
            contiguity are part of the key. Replay applies only when the first is fake.
        state: The parameter's state before the update (tensors by shape, scalars by value).
        update: Dispatches the update, called with ``args``.
        args: ``update``'s arguments.
        on_replay: What the update does besides dispatching (a step counter), called with
            ``state`` instead of ``update`` when the update is replayed.
    """
    rec = None
    if tensors and is_fake(tensors[0]):
        state_key = tuple(sorted((k, _meta(v)) for k, v in state.items()))
        rec = replay.begin(
            (
                type(optimizer).__name__,
                _group_key(group),
                key,
                tuple(_meta(t) for t in tensors),
                state_key,
            )
        )
    if rec is None:
        update(*args)
        return
    if rec.replay():
        if on_replay is not None:
            on_replay(state)
        return
    try:
        update(*args)
    except BaseException:
        rec.abandon()
        raise
    rec.finish()
