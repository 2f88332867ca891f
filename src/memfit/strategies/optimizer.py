"""Which optimizer a plan builds, with which implementation switches."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["OPTIMIZER_NAMES", "OptimizerConfig"]

#: Optimizer names a plan accepts (torch's own first, then memfit's memory-light ones).
OPTIMIZER_NAMES: tuple[str, ...] = ("adamw", "adam", "sgd", "adamw8bit", "adafactor", "lamb", "lars")


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer, its learning rate and implementation switches.

    Attributes:
        name: ``adamw`` / ``adam`` (8 bytes of state per parameter), ``sgd`` (4 with momentum,
            0 without), ``adamw8bit`` (about 2.03: block-wise quantised moments), ``adafactor``
            (factored second moment: O(n+m) per matrix, well under 1 byte per parameter),
            ``lamb`` / ``lars`` (layer-wise trust ratio for large batches; 8 / 4 bytes).
        lr: Learning rate.
        foreach: torch's multi-tensor implementation. ``None`` is torch's default (on where
            supported): fastest, but it materialises intermediates for all parameters at once,
            about one extra copy of the parameters at the step; ``False`` loops per tensor.
        kwargs: Further keyword arguments for the optimizer (betas, weight_decay, ...).
    """

    name: str = "adamw"
    lr: float = 1e-3
    foreach: bool | None = None
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZER_NAMES:
            raise ValueError(
                f"optimizer {self.name!r} is not known; use one of {', '.join(OPTIMIZER_NAMES)}"
            )
        if not self.lr > 0:
            raise ValueError(f"learning rate must be > 0, got {self.lr!r}")

    def build(self, params: Iterable[torch.nn.Parameter] | Iterable[dict]) -> torch.optim.Optimizer:
        """Build the optimizer over ``params``."""
        kwargs: dict[str, Any] = {"lr": self.lr, **dict(self.kwargs)}
        if self.name in ("adamw", "adam", "sgd"):
            cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}
            if self.foreach is not None:
                kwargs["foreach"] = self.foreach
            return cls[self.name](params, **kwargs)
        if self.name == "adafactor" and kwargs.get("relative_step") is not False:
            # The plan always names a learning rate, so Adafactor's own relative step size
            # (which needs lr=None) is off unless the kwargs ask for it explicitly.
            if kwargs.get("relative_step"):
                kwargs["lr"] = None
            else:
                kwargs.setdefault("relative_step", False)
                kwargs.setdefault("scale_parameter", False)
        from ..optim import build_optimizer

        return build_optimizer(self.name, params, **kwargs)
