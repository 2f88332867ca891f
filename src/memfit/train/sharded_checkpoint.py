"""Sharded checkpoints of a data-parallel run, through ``torch.distributed.checkpoint``.

Every process writes its own part into one folder: the model's weights (DDP's replicated
ones once, FSDP2's shards each by its owner) and torch optimizers' state through
``torch.distributed.checkpoint`` (DCP) with ``get_state_dict``/``set_state_dict``, which also
build an empty optimizer's state before loading into it. What DCP cannot take, this module
writes as one safetensors file per rank (:func:`save_rank_state`): the state of an optimizer
that is not torch's (memfit's 8-bit or factored optimizers keep each shard's state as plain
local tensors, which DCP would wrongly deduplicate as replicated) and a
``ZeroRedundancyOptimizer``'s partition. Such a checkpoint resumes on the same number of
processes; one of torch's optimizers under FSDP2 resumes on any number (DCP reshards).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

__all__ = ["load_sharded", "save_sharded"]


def _rank_file(folder: Path, rank: int) -> Path:
    return folder / f"optimizer-rank{rank:05d}.safetensors"


def _by_dcp(optimizer: Any) -> bool:
    """Whether DCP can save the optimizer's state (one of torch's own, not ZeRO-1's)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    inner = getattr(optimizer, "optimizer", optimizer)  # a precision wrapper's optimizer
    return not isinstance(inner, ZeroRedundancyOptimizer) and type(inner).__module__.startswith(
        "torch.optim"
    )


def save_sharded(folder: Path, model: nn.Module, optimizer: Any) -> None:
    """Write ``model`` and ``optimizer`` into ``folder`` from every process (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is not None and _by_dcp(optimizer):
        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(folder))
        return
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(folder))
    if optimizer is not None:
        save_rank_state(folder, _local(optimizer).state_dict())


def load_sharded(folder: Path, model: nn.Module, optimizer: Any) -> None:
    """Restore ``model`` and ``optimizer`` from :func:`save_sharded`'s folder (a collective).

    Raises:
        ValueError: when the checkpoint was written by another number of processes and holds
            per-rank optimizer state.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    if optimizer is not None and _by_dcp(optimizer):
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optimizer": osd}
        dcp.load(state, checkpoint_id=str(folder))
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        return
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=str(folder))
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        _local(optimizer).load_state_dict(load_rank_state(folder))


def _local(optimizer: Any) -> Any:
    """The optimizer whose state this rank holds (ZeRO-1's partition optimizer)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    inner = getattr(optimizer, "optimizer", optimizer)
    return inner.optim if isinstance(inner, ZeroRedundancyOptimizer) else optimizer


def save_rank_state(folder: Path, state: dict[str, Any]) -> None:
    """Write this rank's ``state`` (tensors and JSON data) as one safetensors file; its
    non-tensor data in the file's metadata (nothing pickled)."""
    from safetensors.torch import save_file

    from .manifest import flatten

    tree, tensors = flatten(state)
    save_file(
        tensors, str(_rank_file(folder, dist.get_rank())), metadata={"tree": json.dumps(tree)}
    )


def load_rank_state(folder: Path) -> dict[str, Any]:
    """This rank's state written by :func:`save_rank_state`."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from .manifest import unflatten

    path = _rank_file(folder, dist.get_rank())
    if not path.is_file():
        raise ValueError(
            f"checkpoint {str(folder)!r} has no optimizer state for process "
            f"{dist.get_rank()}: it was written by another number of processes; resume with "
            "as many processes as the run that saved it"
        )
    with safe_open(str(path), framework="pt") as f:
        tree = json.loads((f.metadata() or {})["tree"])
    return unflatten(tree, load_file(str(path)))
