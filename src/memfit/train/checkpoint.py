"""Crash-safe training checkpoints that resume bit-exactly.

A checkpoint is a folder ``step-00000100`` holding

* ``model.safetensors``: the weights (``safetensors.torch.save_model``, which stores a tensor
  shared by two names, such as GPT-2's ``lm_head.weight`` tied to ``wte.weight``, once and
  re-ties it on load; plain ``save_file`` refuses shared tensors);
* ``state.json`` and ``state.safetensors``: the optimizer's ``state_dict`` (any optimizer's:
  8-bit, factored, an optimizer-in-backward handle's, an offloaded one's), the step, every RNG
  state (Python, NumPy, torch CPU and accelerator), the scheduler's state, the plan and the
  data position, plus whatever the caller adds; tensors in the safetensors file, everything
  else in the JSON (:mod:`memfit.train.manifest`). Nothing is pickled, so loading runs no code;
* ``manifest.json``: each file's size and SHA-256, written last. A checkpoint whose files do
  not match it is refused (:class:`~memfit.train.manifest.CheckpointError`) before anything is
  loaded, so a corrupt checkpoint is never half-loaded.

Crash safety: everything is written (and fsynced) into a hidden temporary folder that is then
renamed into place with :func:`os.replace`, which is atomic. A crash at any moment leaves either
the complete new checkpoint or none, never half of one; the previous checkpoints are untouched
and :func:`latest_checkpoint` ignores unfinished temporary folders.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .lock import process_alive
from .manifest import MANIFEST_FILE, CheckpointError, flatten, unflatten, verify, write_manifest

__all__ = [
    "CheckpointError",
    "adopt_checkpoints",
    "checkpoint_state",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "read_state",
    "restore_rng_state",
    "rng_state",
    "save_checkpoint",
    "save_sharded_checkpoint",
]

_NAME = re.compile(r"^step-(\d+)$")
MODEL_FILE = "model.safetensors"
STATE_FILE = "state.json"
TENSORS_FILE = "state.safetensors"


# ---------------------------------------------------------------------------------- RNG
def rng_state() -> dict[str, Any]:
    """Every random generator training may draw from: Python, NumPy, torch CPU, accelerator."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    accel = _accelerator_module()
    if accel is not None:
        state["accelerator"] = accel.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Restore :func:`rng_state` output (generators it does not mention are left alone)."""
    if "python" in state:
        random.setstate(state["python"])
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    accel = _accelerator_module()
    if accel is not None and "accelerator" in state:
        accel.set_rng_state_all(state["accelerator"])


def _accelerator_module() -> Any:
    # The device-agnostic route to the accelerator's module (CUDA, XPU, ...), if there is one.
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return None if acc is None else torch.get_device_module(acc)


# ---------------------------------------------------------------------------------- listing
def list_checkpoints(directory: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoints in ``directory``, oldest step first (temporary folders excluded)."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The checkpoint of the highest step in ``directory``, or ``None``."""
    found = list_checkpoints(directory)
    return found[-1] if found else None


# ---------------------------------------------------------------------------------- save
def _checkpoint_folder(directory: str | Path, step: int, keep: int | None) -> tuple[Path, Path]:
    """The checkpoint folder (made) and the step's final path in it.

    Raises:
        ValueError: for a ``keep`` below 1.
        CheckpointError: when the folder cannot be made.
    """
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1 or None, got {keep!r}")
    root = Path(directory)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create the checkpoint folder {str(root)!r} ({e.strerror})") from None
    return root, root / f"step-{int(step):08d}"


def save_checkpoint(
    directory: str | os.PathLike[str],
    step: int,
    model: nn.Module,
    optimizer: Any = None,
    *,
    scheduler: Any = None,
    state: Mapping[str, Any] | None = None,
    keep: int | None = 3,
) -> Path:
    """Write a checkpoint of ``step`` atomically and keep only the last ``keep``.

    Args:
        directory: Folder of the run's checkpoints (created if needed).
        step: Optimizer steps done; names the checkpoint ``step-{step:08d}``.
        model: The model (weights go to safetensors; tied weights are stored once).
        optimizer: The optimizer or optimizer-in-backward handle, or ``None``.
        scheduler: An LR scheduler, or ``None``.
        state: More trainer state to store (plan dict, data position, ...): tensors and plain
            JSON data (dicts, lists, tuples, numbers, strings, ``None``).
        keep: Checkpoints to keep (older ones are deleted after the new one is in place);
            ``None`` keeps all.

    Returns:
        The checkpoint's folder.

    Raises:
        CheckpointError: for state that is neither tensors nor JSON data, or a write that
            fails (a full disk); the previous checkpoints are left as they were.
    """
    root, final = _checkpoint_folder(directory, step, keep)
    if _world() > 1:
        from .sharded_checkpoint import save_sharded

        return _save_sharded(root, final, int(step), lambda tmp: save_sharded(tmp, model, optimizer),
                             scheduler, state, keep)
    tmp = root / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    # Flattened before anything is written: state that cannot be stored fails here.
    tree, tensors = checkpoint_state(int(step), optimizer, scheduler, state)
    from safetensors import SafetensorError

    try:
        tmp.mkdir()
        _write(tmp, int(step), model, tree, tensors)
        if final.exists():
            # Re-saving a step (a resumed run): move the old one aside first, since a rename
            # cannot replace a non-empty folder; it is deleted once the new one is in place.
            old = root / f".old-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(root)
    except (OSError, SafetensorError) as e:
        # safetensors raises its own error for a failed write (its message carries the OS
        # error's code), where Python's writers raise OSError.
        shutil.rmtree(tmp, ignore_errors=True)
        why = _write_cause(e)
        before = latest_checkpoint(root)
        kept = f"; the previous checkpoint {before.name} is intact" if before else ""
        raise CheckpointError(f"could not write checkpoint {final.name} in {str(root)!r}: {why}{kept}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _WRITTEN.add(final.resolve())
    _prune(root, keep)
    return final


def adopt_checkpoints(directory: str | os.PathLike[str]) -> None:
    """Count the checkpoints now in ``directory`` as this run's own, so that pruning may
    delete them (a resumed run continues the run that wrote them)."""
    _WRITTEN.update(p.resolve() for p in list_checkpoints(directory))


def checkpoint_state(
    step: int, optimizer: Any = None, scheduler: Any = None, state: Mapping[str, Any] | None = None
) -> tuple[Any, dict[str, torch.Tensor]]:
    """The trainer state a single-process checkpoint stores, split for writing: the JSON tree
    and its tensors (:func:`~memfit.train.manifest.flatten`).

    This is where saving costs memory beyond the training state: the optimizer's
    ``state_dict`` references its tensors, and flattening copies each (and every RNG state) to
    the host, contiguous. On the CPU those copies sit beside the state until the checkpoint is
    written; on a GPU they are host memory. Writing the files afterwards (safetensors) reads
    the weights through NumPy, which no tensor operation shows.

    Raises:
        CheckpointError: for state that is neither tensors nor JSON data.
    """
    trainer_state = {
        "step": int(step),
        "rng": _rng_to_store(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        **dict(state or {}),
    }
    return flatten(trainer_state)


def _rng_to_store() -> dict[str, Any]:
    """:func:`rng_state`; in a dry run of a job (fake tensors), fake tensors of its tensors'
    shapes: torch's generators hand out real tensors, which fake tensors' conversion would copy
    once more than the real save does."""
    from torch._guards import active_fake_mode
    from torch.utils._pytree import tree_map_only

    state = rng_state()
    if active_fake_mode() is None:
        return state
    return tree_map_only(torch.Tensor, lambda t: torch.empty(t.shape, dtype=t.dtype), state)


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def save_sharded_checkpoint(
    directory: str | os.PathLike[str],
    step: int,
    write_shards: Callable[[Path], None],
    *,
    scheduler: Any = None,
    state: Mapping[str, Any] | None = None,
    keep: int | None = 3,
) -> Path:
    """Write a checkpoint of ``step`` from every process of the open process group (a
    collective), atomically, keeping the last ``keep``: ``write_shards(folder)`` writes each
    process's weights and optimizer state into the temporary folder (through
    ``torch.distributed.checkpoint``), then process 0 adds the trainer state (``state``, the
    scheduler, every process's RNG), the manifest, and renames the folder into place.

    Raises:
        CheckpointError: for a write that fails; the previous checkpoints are left as they were.
    """
    root, final = _checkpoint_folder(directory, step, keep)
    return _save_sharded(root, final, int(step), write_shards, scheduler, state, keep)


def _save_sharded(
    root: Path,
    final: Path,
    step: int,
    write_shards: Callable[[Path], None],
    scheduler: Any,
    state: Mapping[str, Any] | None,
    keep: int | None,
) -> Path:
    """A checkpoint of a run on several processes (every process calls it): the weights and
    optimizer state sharded by ``write_shards`` (:mod:`memfit.train.sharded_checkpoint`,
    :mod:`memfit.train.layout_checkpoint`), the trainer state and every process's RNG written
    by process 0, then the manifest and the atomic rename."""
    import torch.distributed as dist
    from safetensors import SafetensorError
    from torch.distributed.checkpoint.api import CheckpointException

    rank = dist.get_rank()
    tmp = root / f".tmp-{final.name}-sharded"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    rngs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rngs, rng_state())
    try:
        write_shards(tmp)
        dist.barrier()
        if rank == 0:
            trainer_state = {
                "step": step,
                "rng": rngs[0],
                "rank_rng": rngs,
                "world_size": len(rngs),
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "optimizer": None,  # in the sharded files
                **dict(state or {}),
            }
            tree, tensors = flatten(trainer_state)
            _write(tmp, step, None, tree, tensors)  # the weights are in the sharded files
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(root)
            _WRITTEN.add(final.resolve())
            _prune(root, keep)
    except (OSError, CheckpointException, SafetensorError) as e:
        # DCP gathers the processes' write errors into a CheckpointException.
        why = _write_cause(e)
        raise CheckpointError(f"could not write checkpoint {final.name} in {str(root)!r}: {why}") from None
    finally:
        dist.barrier()
    return final


def _write(
    tmp: Path, step: int, model: nn.Module | None, tree: Any, tensors: dict[str, torch.Tensor]
) -> None:
    from safetensors.torch import save_file, save_model

    if model is not None:
        from ..strategies import nf4
        from ..strategies.lora import find_lora, save_adapter

        if find_lora(model):
            # LoRA's adapters in peft's own format: the checkpoint folder is also an adapter
            # folder that PeftModel.from_pretrained loads.
            save_adapter(model, tmp)
        if nf4.has_nf4(model):
            save_file(nf4.state_tensors(model), str(tmp / MODEL_FILE))  # QLoRA's 4-bit base
        else:
            save_model(model, str(tmp / MODEL_FILE))
    save_file(tensors, str(tmp / TENSORS_FILE))
    (tmp / STATE_FILE).write_text(json.dumps(tree, allow_nan=False) + "\n")
    # The manifest last: its checksums cover the files as written.
    write_manifest(tmp, step)
    for f in tmp.iterdir():
        _fsync_file(f)
    _fsync_dir(tmp)


def _write_cause(error: BaseException) -> str:
    """Why a checkpoint write failed, in words: an :class:`OSError`'s, or the OS error that
    safetensors' or DCP's own error carries in its message (``Os { code: 28, ... }``)."""
    code = getattr(error, "errno", None)
    if code is None:
        m = re.search(r"(?:code: |Errno |os error )(\d+)", str(error))
        code = int(m.group(1)) if m else None
    if code == errno.ENOSPC or "StorageFull" in str(error):
        return "the disk is full"
    if code == errno.EDQUOT:
        return "the disk quota is exceeded"
    if code is not None:
        return os.strerror(code).lower()
    return getattr(error, "strerror", None) or str(error)


#: Checkpoints this process wrote (or resumed from): the only ones pruning may delete, so a
#: run never deletes another's (an earlier run's in the same folder, which it did not resume).
_WRITTEN: set[Path] = set()
_LEFTOVER = re.compile(r"^\.(?:tmp|old)-step-\d+-(\d+)-[0-9a-f]+$")


def _prune(root: Path, keep: int | None) -> None:
    if keep is not None:
        ours = [p for p in list_checkpoints(root) if p.resolve() in _WRITTEN]
        for old in ours[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    # Leftovers of writes that crashed (a kill -9 skips the cleanup above): only those of a
    # process that no longer runs, never a save in progress.
    for p in root.iterdir():
        m = _LEFTOVER.match(p.name)
        if m and int(m.group(1)) != os.getpid() and not process_alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    # Makes the rename itself durable; not every platform can open a folder.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------- load
def _resolve(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    if (p / MANIFEST_FILE).is_file() or (_NAME.match(p.name) and p.is_dir()):
        return p
    latest = latest_checkpoint(p)
    if latest is None:
        raise FileNotFoundError(
            f"no checkpoint at {str(p)!r}; give a step-NNNNNNNN folder or the run folder holding them"
        )
    return latest


def _load_sharded(
    p: Path, model: nn.Module, optimizer: Any, scheduler: Any, restore_rng: bool, state: dict
) -> dict[str, Any]:
    import torch.distributed as dist

    from .sharded_checkpoint import load_sharded

    saved, now = int(state.get("world_size", 1)), _world()
    if saved != now:
        raise CheckpointError(
            f"checkpoint {str(p)!r} was written by {saved} process(es) and this run has {now}; "
            f"resume with --nproc-per-node {saved}"
        )
    try:
        load_sharded(p, model, optimizer)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    if restore_rng and state.get("rank_rng") is not None:
        restore_rng_state(state["rank_rng"][dist.get_rank()])
    return state


def read_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The trainer state of a checkpoint (or of a run folder's latest), touching nothing else.

    Every file is checked against the manifest first.

    Raises:
        FileNotFoundError: when there is no checkpoint at ``path``.
        CheckpointError: for a corrupt, incomplete or old-format checkpoint.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = _resolve(path)
    verify(p)
    try:
        tree = json.loads((p / STATE_FILE).read_text())
        tensors = load_file(str(p / TENSORS_FILE))
    except (OSError, ValueError, SafetensorError) as e:
        raise CheckpointError(f"checkpoint {str(p)!r} cannot be read ({e})") from None
    state = unflatten(tree, tensors)
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointError(f"checkpoint {str(p)!r} holds no trainer state")
    state["path"] = str(p)
    return state


def load_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: Any = None,
    *,
    scheduler: Any = None,
    restore_rng: bool = True,
    state: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Restore a checkpoint into ``model`` (and ``optimizer``, ``scheduler``) in place.

    Args:
        path: A checkpoint folder, or a run folder (its latest checkpoint is used).
        model: The model, built the same way as the saved one.
        optimizer: The optimizer to restore, or ``None`` to skip it.
        scheduler: The LR scheduler to restore, or ``None``.
        restore_rng: Also restore every RNG state (needed for a bit-exact continuation).
        state: :func:`read_state`'s result for ``path``, when the caller already read (and
            verified) it.

    Returns:
        The trainer state saved with it (``step``, ``rng``, ``scheduler``, ``optimizer`` and
        the caller's keys).

    Raises:
        FileNotFoundError: when there is no checkpoint at ``path``.
        CheckpointError: (a ``ValueError``) for a corrupt checkpoint, or weights that do not
            match the model; nothing is loaded then.
    """
    from safetensors.torch import load_model

    if state is None:
        state = read_state(path)
    p = Path(state["path"])
    if state.get("world_size", 1) > 1 or _world() > 1:
        return _load_sharded(p, model, optimizer, scheduler, restore_rng, state)
    device = next((t.device for t in model.parameters()), torch.device("cpu"))
    from ..strategies import nf4

    if nf4.has_nf4(model):
        from safetensors.torch import load_file

        weights = load_file(str(p / MODEL_FILE), device=str(device))
        missing, unexpected = nf4.load_state_tensors(model, weights)
    else:
        missing, unexpected = load_model(model, str(p / MODEL_FILE), strict=False, device=str(device))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {str(p)!r} does not match the model (missing {sorted(missing)[:4]}, "
            f"unexpected {sorted(unexpected)[:4]}); build the model the same way as the run that "
            "saved it"
        )
    if optimizer is not None and state.get("optimizer") is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    if restore_rng and state.get("rng") is not None:
        restore_rng_state(state["rng"])
    return state
