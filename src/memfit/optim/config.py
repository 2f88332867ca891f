"""Which optimizer a plan builds, with which implementation switches."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..techniques import BUILTIN_ORDER, Technique

__all__ = ["OPTIMIZER_NAMES", "PEER_OPTIMIZERS", "OptimizerConfig"]

#: Peers' 8-bit optimizers a plan may name when their library is installed: name -> (package
#: to install, module, class). Their state has memfit's AdamW8bit layout (8-bit codes, an fp32
#: maximum per 256-element block, fp32 state for tensors under 4096 elements), so a dry run,
#: which needs no peer library, builds memfit's AdamW8bit in their place (bitsandbytes' two
#: 1 KiB code maps per tensor and the peers' step temporaries are not modelled).
PEER_OPTIMIZERS: dict[str, tuple[str, str, str]] = {
    "bnb-adamw8bit": ("bitsandbytes", "bitsandbytes.optim", "AdamW8bit"),
    "bnb-paged-adamw8bit": ("bitsandbytes", "bitsandbytes.optim", "PagedAdamW8bit"),
    "torchao-adamw8bit": ("torchao", "torchao.optim", "AdamW8bit"),
}

#: Optimizer names a plan accepts (torch's own first, then memfit's memory-light ones, then
#: the peers').
OPTIMIZER_NAMES: tuple[str, ...] = (
    "adamw", "adam", "sgd", "adamw8bit", "adafactor", "lamb", "lars", "onebit-adam",
    *PEER_OPTIMIZERS,
)  # fmt: skip


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer, its learning rate and implementation switches.

    Attributes:
        name: ``adamw`` / ``adam`` (8 bytes of state per parameter), ``sgd`` (4 with momentum,
            0 without), ``adamw8bit`` (about 2.03: block-wise quantised moments), ``adafactor``
            (factored second moment: O(n+m) per matrix, well under 1 byte per parameter),
            ``lamb`` / ``lars`` (layer-wise trust ratio for large batches; 8 / 4 bytes);
            ``onebit-adam`` (Adam, then frozen variance: 1-bit Adam's optimizer, 8 bytes; its
            compressed communication is :func:`memfit.distributed.onebit.register_onebit_adam`);
            ``bnb-adamw8bit``, ``bnb-paged-adamw8bit`` (bitsandbytes) and
            ``torchao-adamw8bit`` (torchao) when installed (about 2.03, as ``adamw8bit``).
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
        if self.name in PEER_OPTIMIZERS:
            return _build_peer(self.name, params, kwargs)
        from . import build_optimizer

        return build_optimizer(self.name, params, **kwargs)


def _build_peer(name: str, params: Any, kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    """A peer's optimizer; memfit's AdamW8bit with the same state layout in a dry run."""
    import importlib

    from torch._guards import active_fake_mode

    if active_fake_mode() is not None:
        from .adamw8bit import AdamW8bit

        return AdamW8bit(params, block_size=256, min_8bit_size=4096, **kwargs)
    package, module, cls = PEER_OPTIMIZERS[name]
    try:
        found = importlib.import_module(module)
    except ImportError:
        raise ValueError(
            f"optimizer {name!r} needs {package}, which is not installed here: pip install "
            f"{package} (or use memfit's 'adamw8bit', the same state layout)"
        ) from None
    return getattr(found, cls)(params, **kwargs)


def _optimizer_summary(config: OptimizerConfig) -> str:
    return config.name + ("" if config.foreach is not False else " (foreach off)")


#: The optimizer, built last (``memfit.apply``): it steps what the techniques before it left
#: trainable, in their dtypes, sharded or offloaded.
TECHNIQUE = Technique(
    name="optimizer",
    plan_field="optimizer",
    order=BUILTIN_ORDER["optimizer"],
    is_on=lambda plan: True,
    allow={
        "8bit": "8-bit AdamW state",
        "factored": "Adafactor's factored state",
    },
    forbid={"foreach-off": "turning the multi-tensor optimizer off"},
    summary=_optimizer_summary,
)
