"""Which optimizer a plan builds, with which implementation switches."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..techniques import ENGINES, Technique
from .registry import get

__all__ = ["OptimizerConfig"]


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer, its learning rate and implementation switches.

    Attributes:
        name: A registered optimizer (:func:`memfit.optim.registry.names`: torch's, memfit's,
            the peers' 8-bit AdamWs when installed, or a user's own); the registry says what
            each keeps and costs (:func:`~memfit.optim.registry.get`). Any spelling it accepts
            (case, ``-`` and ``_`` ignored) is stored as the canonical name.
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
        # The canonical name, so a plan stores one spelling (a ValueError naming the known ones).
        object.__setattr__(self, "name", get(self.name).name)
        if not self.lr > 0:
            raise ValueError(f"learning rate must be > 0, got {self.lr!r}")

    def build(self, params: Iterable[torch.nn.Parameter] | Iterable[dict]) -> torch.optim.Optimizer:
        """Build the optimizer over ``params`` (a dry run's stand-in for a peer's)."""
        spec = get(self.name)
        kwargs: dict[str, Any] = {"lr": self.lr, **dict(self.kwargs)}
        if spec.foreach and self.foreach is not None:
            kwargs["foreach"] = self.foreach
        if spec.plan_settings is not None:
            kwargs = spec.plan_settings(kwargs)
        return spec.build(params, **kwargs)


class _AllowNames(Mapping[str, str]):
    """The optimizer registry's ``--allow`` names, read when asked (a user's optimizer
    registered later is included)."""

    def _names(self) -> dict[str, str]:
        from .registry import specs

        return {s.allow: s.allow_help or s.name for s in specs() if s.allow}

    def __getitem__(self, key: str) -> str:
        return self._names()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())


def _optimizer_summary(config: OptimizerConfig) -> str:
    return config.name + ("" if config.foreach is not False else " (foreach off)")


def _check(plan: Any) -> None:
    """Which ZeRO stages can shard the optimizer is the registry's (``Technique.check``): a
    peer's wrapper cannot be rebuilt or step DTensors; 1-bit Adam's communication hook is
    DDP's."""
    if plan.parallel.world_size == 1 and plan.parallel.zero_stage == 0:
        return
    problem = get(plan.optimizer.name).zero_problem(plan.parallel.zero_stage)
    if problem is not None:
        raise ValueError(problem)


#: The optimizer, built last (``memfit.apply``): it steps what the techniques before it left
#: trainable, in their dtypes, sharded or offloaded. Its ``--allow`` names are the optimizer
#: registry's (an optimizer that changes training needs consent to be switched to).
TECHNIQUE = Technique(
    name="optimizer",
    engines=frozenset(ENGINES),  # the tensor/pipeline path builds it too
    plan_field="optimizer",
    order=120,
    is_on=lambda plan: True,
    allow=_AllowNames(),
    forbid={"foreach-off": "turning the multi-tensor optimizer off"},
    summary=_optimizer_summary,
    check=_check,
)
