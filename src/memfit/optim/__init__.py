"""Memory-light optimizers: drop-in ``torch.optim.Optimizer`` subclasses.

* :class:`AdamW8bit` -- AdamW with block-wise 8-bit moments (about 2 bytes of state per
  parameter instead of 8), plus :class:`StableEmbedding` for embeddings trained with it.
* :class:`Adafactor` -- factored second moment, O(n + m) state for an n x m matrix.
* :class:`Lamb` and :class:`Lars` -- layer-wise trust-ratio optimizers for large batches.
* :class:`OneBitAdam` -- Adam, then frozen variance (1-bit Adam's optimizer; its compressed
  communication is the DDP hook in :mod:`memfit.distributed.onebit`).

AdamW8bit, Adafactor, Lamb and Lars also step parameters sharded by FSDP2's ``fully_shard`` (DTensors), each rank its own
shard, with the unsharded result up to rounding; AdamW8bit's quantisation blocks start at each
shard's first element instead (:mod:`memfit.optim.sharding`).

:func:`build_optimizer` creates any of them (or torch's AdamW/Adam/SGD, or a peer's 8-bit
AdamW) by name, from :mod:`memfit.optim.registry`, which holds what memfit knows of each
optimizer (state size, step cost, sharding); :func:`state_bytes` measures how much memory an
optimizer's state takes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from . import registry
from .adafactor import Adafactor
from .adamw8bit import AdamW8bit, StableEmbedding
from .lamb import Lamb
from .lars import Lars
from .onebit_adam import OneBitAdam
from .registry import OptimizerSpec

__all__ = [
    "Adafactor",
    "AdamW8bit",
    "Lamb",
    "Lars",
    "OneBitAdam",
    "OptimizerSpec",
    "StableEmbedding",
    "build_optimizer",
    "registry",
    "state_bytes",
]


def build_optimizer(name: str, params: Iterable[Any], **kwargs: Any) -> Optimizer:
    """Create an optimizer by name.

    Args:
        name: A registered optimizer (:func:`memfit.optim.registry.names`: torch's, memfit's,
            the peers' 8-bit AdamWs, or a user's own). Case, ``-`` and ``_`` are ignored, so
            ``"AdamW_8bit"`` and ``"onebitadam"`` work too.
        params: Parameters or parameter groups, as for any torch optimizer.
        **kwargs: Passed to the optimizer's constructor (e.g. ``lr``).

    Returns:
        The optimizer.

    Raises:
        ValueError: If ``name`` is not a registered optimizer, or a peer's library is missing.

    Example:
        >>> model = torch.nn.Linear(4, 4)
        >>> opt = build_optimizer("adamw8bit", model.parameters(), lr=1e-3)
    """
    return registry.get(name).build(params, **kwargs)


def state_bytes(optimizer: Optimizer) -> int:
    """Bytes held by the tensors in ``optimizer.state``.

    Every storage is counted once, in full (a view shares its base's storage; scalar ``step``
    tensors count too).  Tensor subclasses that wrap other tensors (such as torchao's 8-bit
    optimizer state) are counted through their inner tensors.  Python numbers are ignored.

    Args:
        optimizer: Any ``torch.optim.Optimizer``.

    Returns:
        Total size in bytes.
    """
    seen: set[tuple[str, int]] = set()
    total = 0
    stack: list[Any] = list(optimizer.state.values())
    while stack:
        value = stack.pop()
        if isinstance(value, Tensor) and _is_wrapper_subclass(value):
            # e.g. torchao's quantised optimizer state: count the inner tensors it wraps.
            names, _ = value.__tensor_flatten__()  # type: ignore[attr-defined]
            stack.extend(getattr(value, name) for name in names)
        elif isinstance(value, Tensor):
            storage = value.untyped_storage()
            key = (str(value.device), _storage_key(storage))
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list | tuple):
            stack.extend(value)
    return total


def _is_wrapper_subclass(t: Tensor) -> bool:
    # Parameters and FakeTensors have real (or fake) storages of their own; traceable wrapper
    # subclasses expose their inner tensors through __tensor_flatten__ instead.
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return is_traceable_wrapper_subclass(t)


def _storage_key(storage: torch.UntypedStorage) -> int:
    # The address of the StorageImpl: shared by all views of a storage, and, unlike data_ptr(),
    # also defined (without warnings) for fake and meta tensors.
    return storage._cdata
