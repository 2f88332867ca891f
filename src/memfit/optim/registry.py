"""Every optimizer memfit can build, one record each: what every other module knows of them.

A plan names its optimizer (``Plan(optimizer="adamw8bit")``); this registry turns the name into
an :class:`OptimizerSpec`, which says how to build it, how much state it keeps, what its step
costs, what the planner may do with it and how ZeRO can shard it. The cost models, the planner,
the plan's validation and the builders all read these records, so an optimizer is added (or a
user's own registered, :func:`register`) in one place.

Names are compared with case, ``-`` and ``_`` ignored (``"AdamW_8bit"`` is ``adamw8bit``,
``"onebitadam"`` is ``onebit-adam``); a plan stores the canonical name.

Example:
    >>> from memfit.optim import registry
    >>> registry.get("AdamW_8bit").name
    'adamw8bit'
    >>> registry.get("sgd").bytes_per_parameter({"momentum": 0.9})
    4.0
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..extras import MissingExtra
from . import state_size
from .adafactor import Adafactor
from .adamw8bit import AdamW8bit
from .lamb import Lamb
from .lars import Lars
from .onebit_adam import OneBitAdam
from .state_size import StateSize

__all__ = ["OptimizerSpec", "get", "names", "normalise", "register", "specs", "unregister"]

#: Bytes of the fp32 gradient copy the host step reads besides the optimizer's own traffic.
_HOST_GRADIENT_BYTES = 4.0


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """What memfit knows of one optimizer."""

    name: str
    """Canonical name: what a plan stores, what :func:`names` lists and errors name."""

    load: Callable[[], Callable[..., Optimizer]]
    """Returns the optimizer class (or factory taking ``(params, **settings)``). It imports
    on call, so a peer's library (bitsandbytes, torchao) is imported only when its optimizer
    is built, never by ``import memfit``."""

    state: StateSize
    """Its state's size: exact bytes after a step (:attr:`StateSize.exact`, checked against
    the real ``optimizer.state`` in ``tests/optim/test_registry.py``) and the estimators'
    bytes per parameter (:attr:`StateSize.per_parameter`)."""

    aliases: tuple[str, ...] = ()
    """Further names accepted for it (beyond the spellings the normalisation allows)."""

    package: str | None = None
    """The pip package :attr:`load` needs (a peer's), named when it is not installed;
    ``None`` for torch's and memfit's own."""

    stand_in: str | None = None
    """A registered optimizer with the same state layout that a dry run (fake tensors) and the
    planner's state probe build in its place, so plans are made without the peer's library:
    its exact state (bitsandbytes' shared code maps, torchao's per-tensor ones) is then not in
    the figures. ``None``: it is built itself."""

    stand_in_settings: Mapping[str, Any] = field(default_factory=dict)
    """Settings that give :attr:`stand_in` this optimizer's state layout."""

    plan_settings: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    """Adjusts a plan's keyword arguments (``lr`` always among them) before it is built, for
    an optimizer whose defaults assume no learning rate is given (Adafactor)."""

    foreach: bool = False
    """It has torch's multi-tensor (``foreach``) implementation: a plan's ``foreach`` is passed
    on, torch turns it on by default on CUDA, and it costs about one parameter-sized copy of
    temporaries at the step. ``False``: it loops over tensors (a launch overhead per op per
    tensor, :attr:`ops_per_tensor`) and a plan's ``foreach`` is moot."""

    fused: bool = False
    """The host step (optimizer offload) builds it with ``fused=True``, torch's fused CPU
    kernel, unless the plan picked an implementation: several times faster there than the
    per-tensor loop torch picks by default on the CPU (``benchmarks/bench_host_step.py``)."""

    step_bytes: float = 28.0
    """Bytes read and written per fp32 parameter by one step (AdamW: read p, g, m, v and
    write p, m, v); a step is memory-bound, so these over the bandwidth are its time, on the
    device and, with :meth:`host_step_bytes`, on the host."""

    ops_per_tensor: int = 10
    """Ops per parameter tensor when it loops over tensors (each a launch overhead), counted
    from its per-tensor update."""

    allow: str | None = None
    """The planner's ``--allow`` name that lets it switch a plan to this optimizer, which
    changes the training (``8bit``, ``factored``); ``None``: the planner never chooses it.
    The planner refuses ``--allow`` names it does not list (``memfit.planner.ALLOW``)."""
    allow_help: str = ""
    """What ``--allow`` of :attr:`allow` lets the planner do, for the CLI's help."""

    zero_stage1: bool = True
    """ZeRO stage 1 can shard it: ``ZeroRedundancyOptimizer`` rebuilds it on each rank from
    its class and settings over that rank's share of the parameters."""

    steps_dtensor: bool = True
    """It steps FSDP2's sharded parameters (DTensors, ZeRO stages 2 and 3), each rank its own
    shard."""

    zero_note: str = ""
    """Why the ZeRO stages it lacks (:attr:`zero_stage1`, :attr:`steps_dtensor`) cannot shard
    it and what to use instead: a clause of the plan's error (a generic one when empty)."""

    layout: bool = False
    """The tensor/pipeline path builds it over the ranks' DTensor shards (torch's own, whose
    update is elementwise)."""

    layer_wise: bool = False
    """It scales each tensor's update by a layer-wise trust ratio (LARS, LAMB): what a
    large-batch recipe (:class:`memfit.distributed.recipes.LargeBatchRecipe`) trains with."""

    def __post_init__(self) -> None:
        if not self.name or self.name != self.name.strip().lower():
            raise ValueError(f"an optimizer's name must be lower case and non-empty, got "
                             f"{self.name!r}")

    # ------------------------------------------------------------------ sizes and costs
    def state_bytes(
        self, params: Sequence[Tensor], settings: Mapping[str, Any] | None = None
    ) -> int:
        """Exact bytes of its state after a step over ``params`` built with ``settings``."""
        return int(self.state.exact(params, settings or {}))

    def bytes_per_parameter(
        self, settings: Mapping[str, Any] | None = None, dtype: torch.dtype = torch.float32
    ) -> float:
        """The estimators' state bytes per parameter of ``dtype`` built with ``settings``
        (the optimizer's keyword arguments)."""
        return float(self.state.per_parameter(settings or {}, dtype))

    def host_step_bytes(self) -> float:
        """Bytes the host step streams per parameter when the optimizer is offloaded: the
        step's own (fp32 masters and state, as on the device in fp32) and the gradients' fp32
        copy."""
        return self.step_bytes + _HOST_GRADIENT_BYTES

    @property
    def zero_stages(self) -> tuple[int, ...]:
        """The ZeRO stages that can shard it (0, replicated, always)."""
        return (0,) + ((1,) if self.zero_stage1 else ()) + ((2, 3) if self.steps_dtensor else ())

    def zero_problem(self, stage: int) -> str | None:
        """Why ZeRO ``stage`` cannot shard it (one sentence), or ``None`` when it can."""
        supported = self.zero_stages
        if stage in supported:
            return None
        why = self.zero_note or (
            "ZeroRedundancyOptimizer cannot rebuild it on each rank from its class and settings"
            if stage == 1
            else "it cannot step FSDP2's sharded parameters (DTensors)"
        )
        stages = "stage 0 only" if supported == (0,) else (
            "stages " + ", ".join(str(s) for s in supported))
        return (f"optimizer {self.name!r} cannot run at ZeRO stage {stage}: {why}; it supports "
                f"{stages}: use zero_stage {' or '.join(str(s) for s in supported)}")

    # ------------------------------------------------------------------ building
    def optimizer_class(self) -> Callable[..., Optimizer]:
        """The class :attr:`load` returns; a :class:`~memfit.extras.MissingExtra` (a
        ``ValueError`` too) naming the extra to install when a peer's library is missing."""
        try:
            return self.load()
        except ImportError:
            if self.package is None:
                raise
            raise self.missing() from None

    def missing(self) -> MissingExtra:
        """The error saying that :attr:`package` is missing, the extra that brings it and the
        stand-in to use instead."""
        instead = f" (or use memfit's {self.stand_in!r}, the same state layout)" if (
            self.stand_in) else ""
        return MissingExtra(self.package or self.name, f"optimizer {self.name!r}",
                            instead=instead)

    def build(self, params: Iterable[Any], **settings: Any) -> Optimizer:
        """The optimizer over ``params`` built with ``settings``; under fake tensors (a dry
        run), its :attr:`stand_in` when it has one.

        Args:
            params: Parameters or parameter groups, as for any torch optimizer.
            **settings: Keyword arguments of its constructor (``lr``, ...).
        """
        if self.stand_in is not None:
            from torch._guards import active_fake_mode

            if active_fake_mode() is not None:
                return get(self.stand_in).build(params, **{**self.stand_in_settings, **settings})
        return self.optimizer_class()(params, **settings)


# --------------------------------------------------------------------------- the registry
_SPECS: dict[str, OptimizerSpec] = {}
_BY_KEY: dict[str, str] = {}


def normalise(name: str) -> str:
    """The key names are compared by: lower case, ``-`` and ``_`` dropped."""
    return name.strip().lower().replace("-", "").replace("_", "")


def register(spec: OptimizerSpec) -> OptimizerSpec:
    """Add an optimizer (a user's own) so that plans can name it.

    Args:
        spec: Its record. Its name and aliases must not normalise to a registered one's.

    Returns:
        ``spec``.

    Raises:
        ValueError: when one of its names is taken (:func:`unregister` it first to replace).

    Example:
        >>> from memfit.optim import registry, state_size
        >>> spec = registry.register(registry.OptimizerSpec(
        ...     name="my-sgd", load=lambda: torch.optim.SGD, state=state_size.sgd))
        >>> registry.get("MY_SGD") is spec
        True
        >>> registry.unregister("my-sgd")
    """
    keys = {normalise(n) for n in (spec.name, *spec.aliases)}
    taken = sorted(_BY_KEY[k] for k in keys if k in _BY_KEY)
    if taken:
        raise ValueError(
            f"optimizer {spec.name!r} cannot be registered: its names are taken by "
            f"{', '.join(repr(t) for t in taken)}; unregister that first or pick another name"
        )
    _SPECS[spec.name] = spec
    _BY_KEY.update(dict.fromkeys(keys, spec.name))
    return spec


def unregister(name: str) -> None:
    """Remove a registered optimizer (any of its names); a ``ValueError`` if unknown."""
    spec = get(name)
    del _SPECS[spec.name]
    for key in [k for k, v in _BY_KEY.items() if v == spec.name]:
        del _BY_KEY[key]


def get(name: str) -> OptimizerSpec:
    """The record of the optimizer called ``name`` (any accepted spelling).

    Raises:
        ValueError: naming the known optimizers, when ``name`` is none of them.
    """
    canonical = _BY_KEY.get(normalise(name)) if isinstance(name, str) else None
    if canonical is None:
        known = ", ".join(repr(n) for n in _SPECS)
        raise ValueError(
            f"optimizer {name!r} is not known; use one of {known} (case, '-' and '_' are "
            "ignored), or register your own with memfit.optim.registry.register"
        )
    return _SPECS[canonical]


def names() -> tuple[str, ...]:
    """Canonical names of the registered optimizers, in registration order."""
    return tuple(_SPECS)


def specs() -> tuple[OptimizerSpec, ...]:
    """The registered optimizers' records, in registration order."""
    return tuple(_SPECS.values())


# --------------------------------------------------------------------------- memfit's own
def _loaded(cls: Callable[..., Optimizer]) -> Callable[[], Callable[..., Optimizer]]:
    # torch's and memfit's classes are imported with memfit.optim anyway.
    return lambda: cls


def _peer(module: str, cls_name: str) -> Callable[[], Callable[..., Optimizer]]:
    def load() -> Callable[..., Optimizer]:
        import importlib  # on call: a peer's library is imported only to build its optimizer

        return getattr(importlib.import_module(module), cls_name)

    return load


def _adafactor_plan_settings(kwargs: dict[str, Any]) -> dict[str, Any]:
    # The plan always names a learning rate, so Adafactor's own relative step size (which
    # needs lr=None) is off unless the kwargs ask for it explicitly.
    if kwargs.get("relative_step") is not False:
        if kwargs.get("relative_step"):
            kwargs["lr"] = None
        else:
            kwargs.setdefault("relative_step", False)
            kwargs.setdefault("scale_parameter", False)
    return kwargs


# Step bytes per fp32 parameter, read + written (see OptimizerSpec.step_bytes). SGD: read p, g
# (8) and write p (4), plus the momentum buffer when there is one (read and written: 8); 16
# sits between the two. Ops per tensor: counted from the kernels of torch's single-tensor
# implementations (torch/optim/adamw.py _single_tensor_adamw: weight decay mul_, lerp_, mul_,
# addcmul_, step counter, bias corrections, sqrt, div_, add_, addcdiv_ = 10) and of memfit's
# optimizers (quantise/dequantise and the factored statistics add their own).
_TORCH = {"foreach": True, "layout": True}
_PEER_8BIT = {
    "state": state_size.bnb_adamw8bit,
    "stand_in": "adamw8bit",
    "stand_in_settings": {"block_size": 256, "min_8bit_size": 4096},
    "step_bytes": 18.0,
    "zero_stage1": False,
    "steps_dtensor": False,
    "zero_note": "the peer's wrapper neither lets ZeroRedundancyOptimizer (stage 1) rebuild it "
    "from its class and settings nor steps FSDP2's sharded parameters (DTensors, stages 2 and "
    "3); memfit's adamw8bit, the same state layout, does both",
}

for _spec in (
    OptimizerSpec(name="adamw", load=_loaded(torch.optim.AdamW), state=state_size.adam, fused=True,
                  step_bytes=28.0, ops_per_tensor=10, **_TORCH),
    OptimizerSpec(name="adam", load=_loaded(torch.optim.Adam), state=state_size.adam, fused=True,
                  step_bytes=28.0, ops_per_tensor=10, **_TORCH),
    # torch's SGD has a fused CPU kernel too; the host step has not been measured with it.
    OptimizerSpec(name="sgd", load=_loaded(torch.optim.SGD), state=state_size.sgd, step_bytes=16.0,
                  ops_per_tensor=3, **_TORCH),
    OptimizerSpec(name="adamw8bit", load=_loaded(AdamW8bit),
                  state=state_size.adamw8bit, allow="8bit", allow_help="8-bit AdamW state",
                  step_bytes=18.0,  # 1-byte moments read and written, fp32 weights and gradient
                  ops_per_tensor=16),
    OptimizerSpec(name="adafactor", load=_loaded(Adafactor),
                  state=state_size.adafactor, allow="factored",
                  allow_help="Adafactor's factored state",
                  plan_settings=_adafactor_plan_settings,
                  step_bytes=20.0,  # update temporaries; row/column statistics are negligible
                  ops_per_tensor=16),
    OptimizerSpec(name="lamb", load=_loaded(Lamb), state=state_size.lamb,
                  step_bytes=36.0,  # a second pass for the trust ratio
                  ops_per_tensor=14, layer_wise=True),
    OptimizerSpec(name="lars", load=_loaded(Lars), state=state_size.lars,
                  step_bytes=20.0, ops_per_tensor=8, layer_wise=True),
    OptimizerSpec(name="onebit-adam", load=_loaded(OneBitAdam),
                  state=state_size.onebit_adam, step_bytes=28.0, ops_per_tensor=10,
                  zero_stage1=False, steps_dtensor=False,
                  zero_note="it compresses DDP's gradient all-reduce (a communication hook) "
                  "and steps every parameter on every process"),
    # Peers' 8-bit AdamWs, when their library is installed: memfit's AdamW8bit layout.
    OptimizerSpec(name="bnb-adamw8bit", load=_peer("bitsandbytes.optim", "AdamW8bit"),
                  package="bitsandbytes", **_PEER_8BIT),
    OptimizerSpec(name="bnb-paged-adamw8bit",
                  load=_peer("bitsandbytes.optim", "PagedAdamW8bit"),
                  package="bitsandbytes", **_PEER_8BIT),
    OptimizerSpec(name="torchao-adamw8bit", load=_peer("torchao.optim", "AdamW8bit"),
                  package="torchao", **{**_PEER_8BIT, "state": state_size.torchao_adamw8bit}),
):
    register(_spec)
del _spec
