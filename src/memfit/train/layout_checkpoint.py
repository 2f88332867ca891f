"""Checkpoints of a tensor/pipeline run (:mod:`memfit.train.layout_run`), sharded through
``torch.distributed.checkpoint``, that resume bit-exactly on the same layout.

Every rank writes its own modules' weights and optimizer state into one folder with
``torch.distributed.checkpoint`` (DCP): ``get_state_dict`` / ``set_state_dict`` of
``torch.distributed.checkpoint.state_dict`` turn a rank's stage (its DTensors under tensor
parallelism or FSDP2, plain tensors for a pipeline stage) and its optimizer into keyed state,
and DCP writes each tensor once (a DTensor's shards by their owners, a tensor several ranks
hold alike, such as a replicated norm weight, by one of them):

* the weights keep the model's own names (a stage keeps them: ``model.layers.1.mlp.up_proj.
  weight``), so the ranks' parts do not collide and together are the model's state dict;
  a rank holding several stages (interleaved schedules) keys each by ``stage{index}.``;
* the optimizer state is flattened per parameter (``flatten_optimizer_state_dict``), so each
  rank's ``param_groups`` are keyed by its own parameters' names rather than one shared list
  that DCP would keep one rank's copy of;
* the rest, as the other paths' checkpoints hold it (:func:`~memfit.train.checkpoint.
  save_sharded_checkpoint`): the step, every rank's RNG states, the LR schedule, the data
  position, the losses, the plan; written into a temporary folder with a manifest of every
  file's SHA-256, then renamed into place, so a crash leaves the whole checkpoint or none.

What torch does not do and this module adds: which module stands for a rank's stages, and the
check that a checkpoint is resumed under the layout that wrote it (DCP would reshard the
weights, but each rank's RNG and a stage's optimizer state belong to its place in the mesh).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from ..distributed.config import ParallelConfig
from .checkpoint import (
    STATE_FILE,
    latest_checkpoint,
    read_state,
    restore_rng_state,
    save_sharded_checkpoint,
)
from .manifest import MANIFEST_FILE, CheckpointError, read_manifest

__all__ = [
    "check_resumable",
    "check_resume_before_launch",
    "layout_name",
    "load_layout_checkpoint",
    "rank_module",
    "save_layout_checkpoint",
]


def rank_module(modules: list[nn.Module]) -> nn.Module:
    """The module that stands for a rank's ``modules`` in torch's state-dict API: its one
    stage (or whole model) itself, under the model's own names; several stages (an interleaved
    schedule) in a ``ModuleDict`` keyed by each stage's index (``stage2.``), which is unique
    across ranks."""
    if len(modules) == 1:
        return modules[0]
    return nn.ModuleDict({f"stage{getattr(m, 'stage_index', i)}": m
                          for i, m in enumerate(modules)})


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Per-parameter keys for the optimizer's param_groups: ranks hold different parameters.
    return StateDictOptions(flatten_optimizer_state_dict=True)


def write_layout_shards(folder: Path, modules: list[nn.Module], optimizer: Any) -> None:
    """Write this rank's ``modules`` and ``optimizer`` into ``folder`` (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(rank_module(modules), optimizer, options=_options())
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(folder))


def read_layout_shards(folder: Path, modules: list[nn.Module], optimizer: Any) -> None:
    """Load :func:`write_layout_shards`' folder into this rank's ``modules`` and ``optimizer``
    in place (a collective; an optimizer without state yet gets it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    module = rank_module(modules)
    msd, osd = get_state_dict(module, optimizer, options=_options())
    state = {"model": msd, "optimizer": osd}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(module, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"], options=_options())


#: The settings that decide which rank holds what: a resume must keep them.
_PLACEMENT = ("data", "tensor", "pipeline", "schedule", "microbatches", "zero_stage", "sequence",
              "cuts")


def _placement(parallel: ParallelConfig | dict[str, Any]) -> dict[str, Any]:
    values = parallel if isinstance(parallel, dict) else dataclasses.asdict(parallel)
    defaults = dataclasses.asdict(ParallelConfig())
    out = {k: values.get(k, defaults[k]) for k in _PLACEMENT}
    out["cuts"] = list(out["cuts"] or ())  # a tuple in the plan, a list once through JSON
    return out


def layout_name(parallel: ParallelConfig | dict[str, Any]) -> str:
    """A layout in words, as a refusal names it."""
    p = _placement(parallel)
    cuts = f", cuts {tuple(p['cuts'])}" if p["cuts"] else ""
    return (f"data {p['data']} x tensor {p['tensor']} x pipeline {p['pipeline']} "
            f"({p['schedule']}, {p['microbatches'] or 'default'} micro-batches, ZeRO "
            f"{p['zero_stage']}{cuts})")


def save_layout_checkpoint(
    directory: str | Path,
    step: int,
    modules: list[nn.Module],
    optimizer: Any,
    *,
    parallel: ParallelConfig,
    scheduler: Any = None,
    state: dict[str, Any] | None = None,
    keep: int | None = 3,
) -> Path:
    """Write a checkpoint of ``step`` from every rank of the layout (a collective).

    Args:
        directory: The run's checkpoint folder (``step-NNNNNNNN`` goes in it).
        step: Optimizer steps done.
        modules: This rank's modules (:attr:`~memfit.distributed.layout.Layout.modules`).
        optimizer: Its optimizer (one of torch's, over the modules' parameters).
        parallel: The layout's settings, stored to check a resume against.
        scheduler: The LR schedule (the same on every rank; process 0's is stored).
        state: More of the run's state, the same on every rank (data position, losses, plan).
        keep: Checkpoints kept (older ones are deleted); ``None`` keeps all.

    Returns:
        The checkpoint's folder.

    Raises:
        CheckpointError: when it cannot be written; earlier checkpoints are intact.
    """
    return save_sharded_checkpoint(
        directory, step, lambda tmp: write_layout_shards(tmp, modules, optimizer),
        scheduler=scheduler, keep=keep,
        state={**dict(state or {}), "layout": _placement(parallel)},
    )


def check_resumable(state: dict[str, Any], parallel: ParallelConfig, world_size: int) -> None:
    """Refuse a checkpoint written under another layout or number of processes.

    Args:
        state: The checkpoint's state (:func:`~memfit.train.checkpoint.read_state`).
        parallel: This run's layout.
        world_size: This run's processes.

    Raises:
        CheckpointError: one sentence naming both layouts and what to resume with.
    """
    where = state.get("path", "the checkpoint")
    saved = state.get("layout")
    if saved is None:
        raise CheckpointError(
            f"checkpoint {where!r} was not written by a tensor or pipeline run; resume it with "
            "the plan that wrote it")
    if _placement(saved) != _placement(parallel) or int(state.get("world_size", 1)) != world_size:
        raise CheckpointError(
            f"checkpoint {where!r} was written under the layout {layout_name(saved)} "
            f"on {state.get('world_size', 1)} processes and this run is "
            f"{layout_name(parallel)} on {world_size}; resume with the plan that wrote it")


def load_layout_checkpoint(
    path: str | Path,
    modules: list[nn.Module],
    optimizer: Any,
    *,
    parallel: ParallelConfig,
    scheduler: Any = None,
    restore_rng: bool = True,
    state: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Restore a checkpoint (or a run folder's latest) into this rank's ``modules``,
    ``optimizer`` and ``scheduler`` in place, and this rank's RNG states (a collective).

    Every file is checked against the manifest and the layout against ``parallel`` before
    anything is loaded; ``state``: :func:`~memfit.train.checkpoint.read_state`'s result for
    ``path``, when the caller already read (and verified) it.

    Returns:
        The run's state saved with it (``step``, ``data``, ``losses``, ... as given to
        :func:`save_layout_checkpoint`).

    Raises:
        FileNotFoundError: when there is no checkpoint at ``path``.
        CheckpointError: for a corrupt checkpoint or one of another layout.
    """
    if state is None:
        state = read_state(path)
    check_resumable(state, parallel, dist.get_world_size())
    try:
        read_layout_shards(Path(state["path"]), modules, optimizer)
    except (ValueError, RuntimeError, KeyError) as e:  # DCP's missing keys, shapes that differ
        raise CheckpointError(
            f"checkpoint {state['path']!r} does not match this run's model ({e}); resume with "
            "the model and plan that wrote it") from None
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    if restore_rng and state.get("rank_rng") is not None:
        restore_rng_state(state["rank_rng"][dist.get_rank()])
    return state


def check_resume_before_launch(
    directory: str | Path, parallel: ParallelConfig, max_steps: int
) -> None:
    """Refuse, before any process starts, a resume that cannot run: the checkpoint (or the
    run folder's latest) written under another layout, or already at ``max_steps``. Reads
    only the manifest and the state's JSON (no checksums: the load verifies every file).

    Raises:
        CheckpointError: one sentence naming what to change.
    """
    given = Path(directory)
    latest = given if (given / MANIFEST_FILE).is_file() else latest_checkpoint(given)
    if latest is None:
        return  # nothing to resume: the run starts from step 0, as the trainer's does
    step = int(read_manifest(latest).get("step", 0))
    try:
        state = json.loads((latest / STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {str(latest)!r} cannot be read ({e})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {str(latest)!r} holds no trainer state")
    check_resumable({**state, "path": str(latest)}, parallel, parallel.world_size)
    if step >= max_steps:
        raise CheckpointError(
            f"no step was run: the checkpoint {latest} is at step {step} and max_steps is "
            f"{max_steps}; raise --max-steps above {step} to train on")
