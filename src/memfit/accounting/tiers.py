"""Memory tiers: where a byte lives, ``device``, ``host`` or ``disk``.

The tracker records every storage with its tier. A storage on the compute device is in the
``device`` tier, one elsewhere (host memory of a GPU run) in the ``host`` tier, pinned or
pageable, which reports keep apart. On a machine whose compute device *is* the host (CPU
training, every test here), what an offload technique moves is host memory all the same: it
allocates inside :func:`host_tier`, and the tracker puts those storages in the ``host`` tier.
So the offload logic and its accounting run, and are tested, without a GPU. ``disk`` bytes are
files, not storages: a technique that writes them reports them with
:meth:`memfit.accounting.MemoryTracker.account_disk`.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "DEVICE",
    "DISK",
    "HOST",
    "HOST_PINNED",
    "TIERS",
    "host_tier",
    "in_host_tier",
    "is_marked_host",
    "mark_host",
    "marked_category",
]

#: Tier codes in a trace. ``HOST_PINNED`` is host memory that is page-locked (fast copies to
#: and from a GPU, and never swapped); reports count it in ``host`` and also apart.
DEVICE, HOST, HOST_PINNED, DISK = 0, 1, 2, 3

#: The tier names a report uses (``peak_by_tier`` keys).
TIERS: tuple[str, ...] = ("device", "host", "disk")

_local = threading.local()


@contextlib.contextmanager
def host_tier() -> Iterator[None]:
    """Storages allocated inside this context are host memory, whatever their device type.

    Offload techniques wrap their host pools in it, so that on a CPU-only machine their
    buffers are accounted as the ``host`` tier rather than as device memory.
    """
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def in_host_tier() -> bool:
    """Whether allocations now are host memory (inside :func:`host_tier`)."""
    return getattr(_local, "depth", 0) > 0


# Storages marked as host memory, by the address of their StorageImpl; an entry goes when its
# storage is freed (the weak reference's callback).
_MARKED: dict[int, weakref.ref] = {}
_CATEGORY: dict[int, str] = {}  # the category a marked storage was given, if any


def mark_host(tensors: Any, category: str | None = None) -> None:
    """Mark the storages of ``tensors`` (a tensor or an iterable of them) as host memory for
    good: a tracker opened later still counts them in the ``host`` tier. Offload techniques mark
    the buffers they keep between steps (masters, state); allocations made while a tracker runs
    only need :func:`host_tier`. ``category`` (a tracker category, ``"parameters"``) is what
    a tracker opened later counts them as, when it knows nothing more specific."""
    items = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    for t in items:
        if not isinstance(t, torch.Tensor):
            continue
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in _MARKED:
            _MARKED[key] = weakref.ref(storage, lambda _ref, key=key: _forget(key))
        if category is not None:
            _CATEGORY[key] = category


def _forget(key: int) -> None:
    _MARKED.pop(key, None)
    _CATEGORY.pop(key, None)


def is_marked_host(storage: Any) -> bool:
    """Whether ``storage`` was marked with :func:`mark_host` (and is still alive)."""
    ref = _MARKED.get(storage._cdata)
    return ref is not None and ref() is storage


def marked_category(storage: Any) -> str | None:
    """The category ``storage`` was marked with (:func:`mark_host`), else ``None``."""
    return _CATEGORY.get(storage._cdata) if is_marked_host(storage) else None
