"""A plan's activation checkpointing on a tensor x pipeline layout's modules:
:func:`checkpoint_layout_modules`.

The layout (:func:`~memfit.distributed.layout.build_layout`) and memfit's checkpointing
(:mod:`memfit.strategies.checkpointing`) know nothing of each other; the trainer
(:mod:`memfit.train.layout_run`) and the per-rank prediction (:mod:`memfit.estimate.layout`)
meet them here, so both checkpoint a rank's modules the same way: each stage's own blocks
(a stage keeps the model's block names), and with ``parallel.partition_activations`` ZeRO-R's
partitioned checkpoints over the tensor-parallel group (:mod:`memfit.distributed.partition`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from torch import nn

from ..distributed.config import ParallelConfig
from ..distributed.partition import apply_partitioned_checkpointing
from ..distributed.pipeline import model_blocks
from ..strategies.checkpointing import CheckpointConfig, apply_checkpointing

__all__ = ["checkpoint_layout_modules"]


def checkpoint_layout_modules(modules: Iterable[nn.Module], checkpointing: CheckpointConfig,
                              parallel: ParallelConfig, mesh_tp: Any = None) -> list[Any]:
    """Checkpoint each of a rank's layout ``modules`` (its pipeline stages, or the whole model)
    as ``checkpointing`` says, and partition the checkpointed inputs over ``mesh_tp`` when
    ``parallel.partition_activations``.

    Args:
        modules: The rank's modules, split already (tensor parallelism, FSDP2), not yet
            wrapped by DDP.
        checkpointing: The plan's checkpointing (``none`` changes nothing).
        parallel: The layout (its ``partition_activations`` and ``partition_offload``).
        mesh_tp: The tensor-parallel mesh (``mesh["tp"]``) or group; needed with
            ``partition_activations``.

    Returns:
        The handles (each has ``remove()``), checkpointing's first for each module.
    """
    handles: list[Any] = []
    if checkpointing.mode == "none":
        return handles
    for module in modules:
        blocks = tuple(getattr(module, "block_names", ())) or _model_blocks(module) \
            or checkpointing.blocks
        handles.append(apply_checkpointing(module, dataclasses.replace(checkpointing,
                                                                       blocks=blocks)))
        if parallel.partition_activations:
            if mesh_tp is None:
                raise ValueError("partitioned activation checkpoints need the tensor-parallel "
                                 "mesh (mesh['tp'])")
            handles.append(apply_partitioned_checkpointing(
                module, mesh_tp, offload=parallel.partition_offload))
    return handles


def _model_blocks(module: nn.Module) -> tuple[str, ...]:
    """A whole model's blocks, by name, as the pipeline would cut it (found at any depth,
    one block included, where checkpointing's own search wants a repeated list)."""
    try:
        return tuple(name for name, _ in model_blocks(module))
    except ValueError:
        return ()
