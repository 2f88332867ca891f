"""The checks :func:`memfit.track` (and :class:`MemoryTracker`) runs on its arguments before
anything is set up (issue 37): a string where the optimizer goes, a negative cap or a cap as a
size string were accepted silently, a string where the model goes failed later with an
``AttributeError``."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import MemfitTypeError, MemfitValueError, describe
from ..units import parse_size

__all__ = ["checked_cap", "checked_device", "checked_optimizers"]


def checked_optimizers(items: list[Any]) -> list[Any]:
    """``items`` (the optimizers given, as a list), each checked to be an optimizer."""
    for opt in items:
        # Duck-typed optimizers (wrappers such as accelerate's) have param_groups too.
        if not isinstance(opt, torch.optim.Optimizer) and not hasattr(opt, "param_groups"):
            raise MemfitTypeError(
                "optimizer must be a torch.optim.Optimizer (built on the model's parameters), "
                f"a list of them, an optimizer-in-backward handle or None, got {describe(opt)}"
            )
    return items


def checked_device(device: Any) -> torch.device:
    """``device`` as a ``torch.device``; a kind or name torch does not take is refused."""
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise MemfitTypeError(
            f"device must be a torch.device, a device string such as 'cpu' or 'cuda:0', or None, "
            f"got {describe(device)}"
        )
    try:
        return torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise MemfitValueError(
            f"device {device!r} is not a device torch knows; use e.g. 'cpu', 'cuda' or 'cuda:0'"
        ) from None


def checked_cap(cap: Any) -> int | None:
    """The cap in bytes: ``None``, an int >= 0 or a size (``"4GiB"``, :func:`parse_size`)."""
    if cap is None:
        return None
    if isinstance(cap, int) and not isinstance(cap, bool):
        if cap < 0:
            raise MemfitValueError(
                f"cap must be a number of bytes >= 0 or a size such as 4GiB, got {cap}"
            )
        return cap
    if isinstance(cap, (str, float)):
        try:
            return parse_size(cap)
        except MemfitValueError as e:
            raise MemfitValueError(f"cap: {e}") from None
    raise MemfitTypeError(
        f"cap must be a number of bytes >= 0, a size such as 4GiB, or None, got {describe(cap)}"
    )
