"""The technique registry: every memory technique memfit knows, as one object each.

A :class:`Technique` says everything the rest of memfit needs to know about one technique:
where its config lives in a :class:`~memfit.plan.Plan`, whether a plan turns it on, how to
apply it to a model (and so how to take it off), which engines can apply it and why the
others cannot, its ``--allow`` name when it changes what is trained, whether the OOM
fallback may swap it without rebuilding the optimizer, and, for the planner, the configs to
try and what each keeps in memory.

The built-in techniques are defined in their own modules (``memfit.strategies.*``,
``memfit.distributed.data``, ``memfit.optim.config``) and registered by :mod:`memfit.plan`,
which composes their configs; :func:`register` adds a user's own. Every consumer is a loop
over :func:`registered`: :func:`memfit.apply_plan` applies ``Plan.techniques()`` in order, the
OOM fallback swaps the swappable ones in place, the Hugging Face and Lightning integrations
ask each technique whether they can apply it, and the planner tries the configs of the
techniques the user allowed.

A user's technique, end to end, is the README's worked example ("The technique registry, and
your own technique"), which ``tests/test_techniques.py`` runs.

From the command line, a technique is registered by importing the module that registers it:
the module of a ``--model package.module:function`` spec, the modules named in the
``MEMFIT_TECHNIQUES`` environment variable (comma-separated), or a package's entry point in
the ``memfit.techniques`` group (its value is the module to import). They are imported the
first time the registry is read.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import MemfitError

__all__ = [
    "DEFAULT_ORDER",
    "ENGINES",
    "ApplyContext",
    "Technique",
    "TechniqueError",
    "apply_order",
    "get",
    "load_plugins",
    "register",
    "registered",
    "unregister",
]

#: The engines that apply plans: one process (``memfit.apply_plan``, the Trainer,
#: ``prepare()``), data parallel processes (DDP, FSDP2), tensor/pipeline layouts, the Hugging
#: Face Trainer and a lightning.Trainer.
ENGINES: tuple[str, ...] = ("single", "data", "layout", "hf", "lightning")

#: Where a user's technique goes in the apply order when it names none: after every model
#: transform (the built-ins' model transforms stand at 0-70: the KV cache off 0, LoRA 5, freezing
#: 10, the fused forwards 20 and 30, precision 40, checkpointing 50, the offloads 60 and 70),
#: before compile (90), the gradient buffer (100), data parallelism (110) and the optimizer
#: (120-122); the techniques of the step stand at 200 and above. Each built-in states its own
#: ``order`` in its module, which says why it stands there; :func:`apply_order` lists them.
DEFAULT_ORDER = 80


class TechniqueError(MemfitError, ValueError):
    """A technique is malformed, registered twice, or not registered."""


@dataclass
class ApplyContext:
    """What the techniques of one plan share while they are applied, in order.

    Attributes:
        plan: The plan being applied.
        engine: Who applies it (one of :data:`ENGINES`); a technique that the engine applies
            itself (Lightning's autocast, the Hugging Face Trainer's checkpointing) returns
            ``None`` from ``apply`` for it.
        info: What each technique did, for reports (``frozen``, ``checkpointed``...).
        keep_original_weights: bf16-pure keeps the original weights on the host.
        precision: The precision runtime (set by the precision technique; the optimizer
            technique reads it).
        parallel: The data-parallel handle (set by that technique; the optimizer reads it).
        optimizer: The optimizer the caller gave, then the one built (set by the optimizer
            technique).
        optimizer_given: Whether the caller gave the optimizer.
        dry_stand_in: What stands in for DDP in a dry run (see
            :func:`memfit.distributed.data.apply_data_parallel`): passed in by
            :mod:`memfit.apply`, where a parallel engine and a technique meet.
    """

    plan: Any
    engine: str = "single"
    info: dict[str, Any] = field(default_factory=dict)
    keep_original_weights: bool = False
    precision: Any = None
    parallel: Any = None
    optimizer: Any = None
    optimizer_given: bool = False
    dry_stand_in: Any = None


def _always(plan: Any) -> bool:
    return True


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class Technique:
    """One memory technique: its config's place in the plan and everything done with it.

    Attributes:
        name: Unique name; also the name of its handle in a ``TrainingSetup`` and its key in
            ``Plan.extra`` for a user's technique.
        plan_field: The :class:`~memfit.plan.Plan` field holding its config (a built-in's; a
            tuple of fields for a technique configured by several, whose config is then the
            tuple of their values); ``None`` for a user's technique, whose config is
            ``plan.extra[name]``.
        config_type: The config's class, which a mapping in ``Plan.extra`` is built into
            (a frozen dataclass that checks itself in ``__post_init__``); ``None`` keeps the
            value as given.
        order: Its place in the apply order (lower applies first and is removed last; each
            built-in's module states its own, see :func:`apply_order`).
        is_on: Whether a plan uses it (default: a built-in's field is truthy and not
            ``"none"``; a user's technique is on when ``plan.extra`` names it).
        apply: ``apply(model, ctx) -> handle | None``: apply the technique to ``model``
            (changed in place) and return what takes it off (a ``remove()`` method), or
            ``None`` when nothing on the model changed. ``None`` here: a technique of the
            step, which ``run_step`` applies from the plan's fields.
        info_key: The key ``apply`` reports under in ``TrainingSetup.info`` (dropped when
            the OOM fallback swaps the technique).
        engines: The engines that can apply it (:data:`ENGINES`; default: all but ``layout``,
            whose tensor/pipeline path builds only its own techniques).
        refusal: ``refusal(plan, engine) -> sentence | None``: why ``engine`` cannot apply
            this plan's config of the technique and what to do instead (default: for an
            engine outside ``engines``, a sentence naming the technique).
        label: ``label(plan) -> phrase``: how the plan names its config in a refusal
            (default: the plan field, or the technique's name).
        allow: The planner's ``--allow`` names the technique owns (name -> what it lets the
            planner do): options that change what is trained, tried only when allowed.
        forbid: The planner's ``--forbid`` names it owns (name -> what is ruled out):
            options on by default in the search that a user may rule out.
        swappable: Whether the OOM fallback may change this technique's config between two
            steps, keeping the optimizer and its state (a technique with ``apply`` is taken off
            and applied again in place): ``True``, or ``swappable(old_plan, new_plan)``.
        candidates: ``candidates(plan, workload) -> configs``: the configs the planner tries
            besides the plan's own, asked under a dry run's fake tensors (a hook may build
            the workload's model to see whether the technique applies). A built-in with this
            hook is one dimension of the search, like a user's technique (the hand-written
            dimensions of :mod:`memfit.planner.candidates` cover the others).
        memory_rank: ``memory_rank(config) -> number``: how much a config saves (higher
            saves more; off is 0), for the planner's dominance pruning (each user's technique
            is a dimension of its own). Without it the planner assumes the technique saves
            nothing, and prunes it wherever the same plan without it does not fit.
        summary: ``summary(config) -> phrase`` naming the config in a plan's one-line
            summary.
        parse: ``parse(value) -> config``: the canonical config of a built-in's field from
            the short forms a plan file may give (``true``, a string, a mapping); raises
            ``ValueError`` with one sentence for a value it does not take. ``Plan`` calls it
            when it is made, so the rest of memfit sees only canonical configs.
        recompute_flops: ``recompute_flops(plan, profile) -> FLOPs``: the forward FLOPs per
            sample the technique runs again in backward (checkpointing's blocks, the fused
            loss's head), which the step-time model adds at the matmul rate; ``profile`` is the
            workload's :class:`~memfit.estimate.cost.WorkloadProfile`.
        matmul_slowdown: ``matmul_slowdown(plan) -> factor``: how much longer the step's
            matmuls take under the technique (eager fp8's casts), for the step-time model.
        check: ``check(plan)``: the rules that tie this technique to others in one plan
            (``grad_buffer`` and the fused step, say); raises ``ValueError`` with one sentence
            naming the conflict and the fix. ``Plan.validate`` calls it for every built-in.
    """

    name: str
    plan_field: str | tuple[str, ...] | None = None
    config_type: type | None = None
    order: int = DEFAULT_ORDER
    is_on: Callable[[Any], bool] | None = None
    apply: Callable[[Any, ApplyContext], Any] | None = None
    info_key: str | None = None
    engines: frozenset[str] = frozenset(ENGINES) - {"layout"}
    refusal: Callable[[Any, str], str | None] | None = None
    label: Callable[[Any], str] | None = None
    allow: Mapping[str, str] = field(default_factory=dict)
    forbid: Mapping[str, str] = field(default_factory=dict)
    swappable: bool | Callable[[Any, Any], bool] = False
    candidates: Callable[[Any, Any], Sequence[Any]] | None = None
    memory_rank: Callable[[Any], float] | None = None
    summary: Callable[[Any], str] | None = None
    parse: Callable[[Any], Any] | None = None
    check: Callable[[Any], None] | None = None
    recompute_flops: Callable[[Any, Any], float] | None = None
    matmul_slowdown: Callable[[Any], float] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TechniqueError(f"a technique needs a non-empty name, got {self.name!r}")
        unknown = sorted(set(self.engines) - set(ENGINES))
        if unknown:
            raise TechniqueError(
                f"technique {self.name!r} names unknown engine {unknown[0]!r}; engines are "
                f"{', '.join(ENGINES)}"
            )
        if self.apply is not None and not callable(self.apply):
            raise TechniqueError(f"technique {self.name!r}: apply must be callable")

    # ------------------------------------------------------------------ reading a plan
    def config(self, plan: Any) -> Any:
        """This technique's config in ``plan`` (``None`` when a user's technique is absent)."""
        if isinstance(self.plan_field, tuple):
            return tuple(getattr(plan, f) for f in self.plan_field)
        if self.plan_field is not None:
            return getattr(plan, self.plan_field)
        return dict(getattr(plan, "extra", ())).get(self.name)

    @property
    def fields(self) -> tuple[str, ...]:
        """The plan fields this technique owns (``("extra",)`` for a user's technique)."""
        if self.plan_field is None:
            return ("extra",) if self.name not in _BUILTIN else ()
        return self.plan_field if isinstance(self.plan_field, tuple) else (self.plan_field,)

    def can_swap(self, old: Any, new: Any) -> bool:
        """Whether the OOM fallback may move from ``old``'s config to ``new``'s in place."""
        if callable(self.swappable):
            return bool(self.swappable(old, new))
        return bool(self.swappable)

    def on(self, plan: Any) -> bool:
        """Whether ``plan`` uses this technique."""
        if self.is_on is not None:
            return bool(self.is_on(plan))
        value = self.config(plan)
        if self.plan_field is None:
            return value is not None
        return value not in (None, False, "none", (), 0)

    def describe(self, plan: Any) -> str:
        """How ``plan`` names this technique's config (for refusals listing several)."""
        if self.label is not None:
            return self.label(plan)
        return " / ".join(self.fields) if self.plan_field is not None else self.name

    def refuses(self, plan: Any, engine: str) -> str | None:
        """Why ``engine`` cannot apply this technique as ``plan`` configures it (``None``:
        it can). Only asked of techniques the plan turns on."""
        if self.refusal is not None:
            reason = self.refusal(plan, engine)
            if reason is not None:
                return reason
        where = _ENGINE_NAMES.get(engine, engine)
        if engine not in self.engines:
            return f"technique {self.name!r} is not supported {where}; turn it off in the plan"
        optimizer_order = _REGISTRY["optimizer"].order if "optimizer" in _REGISTRY else 120
        if engine == "lightning" and self.apply is not None and self.order > optimizer_order:
            # Lightning's callback applies techniques up to the optimizer, which Lightning
            # builds through configure_optimizers.
            return (
                f"technique {self.name!r} applies after the optimizer (order {self.order}), "
                f"which the Lightning callback cannot do; give it an order below "
                f"{optimizer_order} or turn it off in the plan"
            )
        return None

    def coerce(self, value: Any) -> Any:
        """A user technique's config from ``Plan.extra``: a mapping becomes ``config_type``."""
        if self.config_type is None or isinstance(value, self.config_type):
            return value
        if isinstance(value, Mapping):
            # Lists (from JSON) become tuples, so the config stays hashable and equal to the
            # one it was written from.
            fields = {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}
            try:
                return self.config_type(**fields)
            except (TypeError, ValueError) as e:
                raise TechniqueError(f"technique {self.name!r}: bad config {dict(value)}: {e}") from None
        if value is True:
            return self.config_type()
        raise TechniqueError(
            f"technique {self.name!r} takes a {self.config_type.__name__} or a mapping of its "
            f"fields, got {value!r}"
        )


_ENGINE_NAMES = {
    "single": "by memfit.apply_plan",
    "data": "under data parallelism",
    "layout": "in a tensor/pipeline layout",
    "hf": "inside the Hugging Face Trainer",
    "lightning": "in a lightning.Trainer",
}

_REGISTRY: dict[str, Technique] = {}
_BUILTIN: set[str] = set()


def register(technique: Technique, *, replace: bool = False, builtin: bool = False) -> Technique:
    """Add ``technique`` to the registry (every consumer then loops over it).

    Args:
        technique: The technique.
        replace: Replace a registered technique of the same name (default: refuse).
        builtin: memfit's own (registered by :mod:`memfit.plan`); a built-in cannot be
            replaced by a user's.

    Returns:
        ``technique``, so a module can write ``TECHNIQUE = register(Technique(...))``.

    Raises:
        TechniqueError: when the name is taken (and ``replace`` is false), names a built-in,
            or its ``--allow`` name is another technique's.
    """
    if not isinstance(technique, Technique):
        raise TechniqueError(
            f"register() takes a memfit.techniques.Technique, got a {type(technique).__name__}"
        )
    name = technique.name
    if name in _BUILTIN and not builtin:
        raise TechniqueError(f"technique {name!r} is memfit's own and cannot be replaced")
    if name in _REGISTRY and not (replace or builtin):
        raise TechniqueError(
            f"a technique named {name!r} is already registered; pass replace=True to replace it"
        )
    for other in _REGISTRY.values():
        taken = (set(other.allow) | set(other.forbid)) & (
            set(technique.allow) | set(technique.forbid)
        )
        if taken and other.name != name:
            raise TechniqueError(
                f"planner name {sorted(taken)[0]!r} is already technique {other.name!r}'s"
            )
    if not builtin and technique.plan_field is not None:
        raise TechniqueError(
            f"technique {name!r}: a user's technique keeps its config in Plan.extra, so "
            "plan_field must be None"
        )
    _REGISTRY[name] = technique
    if builtin:
        _BUILTIN.add(name)
    return technique


def unregister(name: str) -> None:
    """Remove a user's technique (a built-in cannot be removed)."""
    if name in _BUILTIN:
        raise TechniqueError(f"technique {name!r} is memfit's own and cannot be removed")
    _REGISTRY.pop(name, None)


def get(name: str) -> Technique:
    """The registered technique called ``name``.

    Raises:
        TechniqueError: naming the registered techniques.
    """
    if name not in _REGISTRY:
        load_plugins()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise TechniqueError(
            f"no technique is registered as {name!r}; registered: {', '.join(sorted(_REGISTRY))}"
        ) from None


_PLUGINS_LOADED = False
#: The entry-point group of packages that register techniques.
ENTRY_POINT_GROUP = "memfit.techniques"


def load_plugins() -> None:
    """Import the modules that register users' techniques: those named in
    ``MEMFIT_TECHNIQUES`` (comma-separated) and the ``memfit.techniques`` entry points. Runs
    once per process (the first read of the registry calls it).

    Raises:
        TechniqueError: naming a module that cannot be imported.
    """
    global _PLUGINS_LOADED
    if _PLUGINS_LOADED:
        return
    _PLUGINS_LOADED = True  # before importing: a plugin reads the registry as it registers
    names = [n.strip() for n in os.environ.get("MEMFIT_TECHNIQUES", "").split(",") if n.strip()]
    from importlib.metadata import entry_points

    names += [ep.value.split(":")[0] for ep in entry_points(group=ENTRY_POINT_GROUP)]
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as e:
            _PLUGINS_LOADED = False  # say so again next time, not only once
            raise TechniqueError(
                f"technique module {name!r} (from MEMFIT_TECHNIQUES or a "
                f"{ENTRY_POINT_GROUP!r} entry point) cannot be imported: {e}"
            ) from None


def registered(*, builtin: bool | None = None) -> list[Technique]:
    """The registered techniques in apply order (``builtin``: only memfit's own when true,
    only users' when false; the plugins are loaded first unless only memfit's own are
    asked for)."""
    if builtin is not True:
        load_plugins()
    out = [
        t
        for t in _REGISTRY.values()
        if builtin is None or (t.name in _BUILTIN) == builtin
    ]
    return sorted(out, key=lambda t: t.order)


def apply_order(*, builtin: bool | None = None) -> dict[str, int]:
    """Each registered technique's name -> its place in the apply order, lowest first
    (``builtin`` as :func:`registered`)."""
    return {t.name: t.order for t in registered(builtin=builtin)}


def is_builtin(name: str) -> bool:
    """Whether ``name`` is one of memfit's own techniques."""
    return name in _BUILTIN


def allow_names(*, builtin: bool | None = None) -> dict[str, str]:
    """Every ``--allow`` name -> what it lets the planner do, in apply order (``builtin``
    as :func:`registered`)."""
    return {k: v for t in registered(builtin=builtin) for k, v in t.allow.items()}


def forbid_names(*, builtin: bool | None = None) -> dict[str, str]:
    """Every ``--forbid`` name -> what it rules out, in apply order (``builtin`` as
    :func:`registered`)."""
    return {k: v for t in registered(builtin=builtin) for k, v in t.forbid.items()}


def techniques_of(plan: Any) -> Iterator[tuple[Technique, Any]]:
    """``(technique, config)`` for every registered technique ``plan`` turns on, in apply
    order (what :meth:`memfit.plan.Plan.techniques` yields)."""
    for technique in registered():
        if technique.on(plan):
            yield technique, technique.config(plan)
