"""Candidate generation: every plan the search may consider, with its memory rank.

The space is the product of the techniques' options (micro-batch sizes, checkpointing modes,
precisions, optimizers, the fused step, ``foreach``, freezing, shorter sequences, the fused
loss), starting
from the user's plan and limited by ``--allow`` and ``--forbid``.

Each candidate carries a rank vector, one entry per dimension, for dominance pruning: a
candidate that ranks at most as high as a known misfit in every dimension keeps at least as
much memory and cannot fit. A rank is never an option's place in a list (the lists start from
the user's plan, whatever it is); it is computed from what the option keeps:

* micro-batch and sequence length: the samples and tokens held at once;
* checkpointing: what a mode keeps for backward (``full`` keeps only block inputs,
  ``selective`` the matmul outputs, ``none`` everything);
* precision: two dimensions, the bytes kept per parameter and per activation element
  (:data:`PRECISION_BYTES`): autocast halves activations but adds half-precision copies of the
  weights, so fp32 and mixed precision are incomparable, and bf16-pure beats both;
* optimizer: the state bytes per parameter, measured by building the optimizer on a probe
  (:func:`state_bytes_per_parameter`);
* the fused step (only without accumulation, where it frees the gradients), ``foreach`` off;
* freezing: the share of parameters that still train, measured on fake tensors;
* LoRA (``--allow lora``, ``--allow qlora``): off, adapters on attention only or on every
  linear layer, each over a 4-bit base with ``qlora``; the rank is the user's
  (``lora_rank``), the rest is searched. Ranked by :data:`memfit.strategies.lora.TECHNIQUE`'s
  ``memory_rank`` (a 4-bit base saves most, then fewer adapted layers);
* every other technique, memfit's own (the fused loss) or a user's: one dimension each, the
  configs its ``candidates`` hook offers (asked under fake tensors, so a hook may build the
  model to see whether it applies), ranked by its ``memory_rank``. A built-in with such hooks
  is searched unless one of its ``--forbid`` names is given (the fused loss: on keeps one
  chunk of logits, off all of them; it changes no numerics beyond rounding and costs one more
  head matmul in backward, so the search takes it when the plain loss does not fit or is tied
  in the cost model); a user's is tried as :func:`extra_options` says.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import check_names as _check_names
from ..optim import registry as optim_registry
from ..optim.config import OptimizerConfig
from ..plan import Plan
from ..strategies.fp8 import fp8_problem as _fp8_problem
from ..strategies.lora import TECHNIQUE as _LORA
from ..strategies.lora import LoraConfig
from ..strategies.offload import OffloadConfig
from ..techniques import allow_names as _allow_names
from ..techniques import forbid_names as _forbid_names
from ..techniques import get as _technique
from ..techniques import registered as _registered
from ..workload import Workload

__all__ = [
    "ALLOW",
    "FORBID",
    "PRECISION_BYTES",
    "RANK_DIMENSIONS",
    "Space",
    "allow_names",
    "check_names",
    "dominated",
    "forbid_names",
    "generate",
    "maximal",
    "micro_batches",
    "options",
    "ordinal",
    "space_pairs",
    "state_bytes_per_parameter",
    "technique_options",
    "trainable_fractions",
]


#: Techniques that change what is trained or how (only used when allowed): memfit's own, as
#: the technique registry names them (:func:`allow_names` adds users' techniques).
ALLOW: dict[str, str] = _allow_names(builtin=True)
#: Techniques on by default that a user may rule out (memfit's own; :func:`forbid_names`).
FORBID: dict[str, str] = _forbid_names(builtin=True)


def allow_names() -> dict[str, str]:
    """Every ``--allow`` name the registry knows now (users' techniques included)."""
    return _allow_names()


def forbid_names() -> dict[str, str]:
    """Every ``--forbid`` name the registry knows now (users' techniques included)."""
    return _forbid_names()


#: The dimensions of a rank vector, in order.
RANK_DIMENSIONS: tuple[str, ...] = (
    "micro_batch",
    "checkpointing",
    "precision_parameters",
    "precision_activations",
    "optimizer_state",
    "fused_step",
    "per_tensor_step",
    "freezing",
    "sequence",
    # memfit's own techniques searched through their hooks (the fused loss), in apply order.
    *(t.name for t in _registered(builtin=True) if t.candidates is not None),
    "offload_optimizer",
    "offload_activations",
    "offload_parameters",
    "lora",
)
# After these, one dimension per user's technique in the search (memfit.techniques.register),
# in name order: its ``memory_rank`` per config, off ranking 0.

#: Bytes a precision mode keeps (per parameter: weights, gradients and, under autocast, the
#: half-precision weight copies its matmuls save for backward; per activation element). From
#: the dtypes each mode stores: fp32 4 + 4 per parameter and 4 per activation; autocast 4 + 4
#: + 2 and 2; bf16-pure 2 + 2 and 2. Measured: a GPT-2 with the step fused into backward peaks
#: higher under bf16-mixed than under fp32 when its activations are small (the copies win).
PRECISION_BYTES: dict[str, tuple[int, int]] = {
    "fp32": (8, 4),
    "bf16-mixed": (10, 2),
    "fp16-mixed": (10, 2),
    "bf16-pure": (4, 2),
    # fp8 (torchao's float8 linears under bf16 autocast): fp32 weights and gradients and no
    # half-precision weight copies (the float8 linears save the fp32 weight itself); bf16
    # activations, plus the casts' temporaries (abs, scaled and clamped copies of one linear's
    # input or gradient at a time), counted as one more byte: fp8 then ranks below fp32 in
    # both dimensions, and neither it nor autocast prunes the other.
    "fp8": (8, 3),
}
# What a checkpointing mode keeps for backward, in its order of size (not measured: each
# mode's kept set contains the next one's): everything, the matmul outputs, block inputs.
_CHECKPOINT_KEEPS = {"none": 2, "selective": 1, "full": 0}


def check_names(values: Any, known: Mapping[str, str], flag: str) -> tuple[str, ...]:
    """The stripped, non-empty names of ``values`` (a string, comma-separated as on the CLI,
    or a list of them); an unknown one is a ``ValueError`` sentence
    (:func:`memfit.errors.check_names`)."""
    return _check_names(values, known, flag)


def micro_batches(batch_size: int) -> list[int]:
    """Micro-batch sizes tried: the batch, halved (rounding up) down to 1, largest first."""
    sizes = []
    m = batch_size
    while m >= 1:
        sizes.append(m)
        if m == 1:
            break
        m = m // 2 if m % 2 == 0 else -(-m // 2)
    return sorted(set(sizes), reverse=True)


def ordinal(keeps: Mapping[Hashable, float]) -> dict[Hashable, int]:
    """Rank options by what they keep: the one keeping most ranks 0; equal keeps, equal ranks."""
    levels = sorted(set(keeps.values()), reverse=True)
    return {option: levels.index(kept) for option, kept in keeps.items()}


_STATE_BYTES: dict[tuple[str, str], float] = {}


def state_bytes_per_parameter(config: OptimizerConfig) -> float:
    """Optimizer state bytes per fp32 parameter, measured once per optimizer and arguments.

    The optimizer is built from ``config`` on a small probe, stepped once, and its state
    measured (:func:`memfit.optim.state_bytes`): 8 for AdamW, about 2.1 for 8-bit AdamW,
    well under 1 for Adafactor, 0 or 4 for SGD depending on its momentum.

    Raises:
        ValueError: when the optimizer does not accept the config's arguments.
    """
    key = (config.name, repr(sorted(dict(config.kwargs).items())))
    if key not in _STATE_BYTES:
        _STATE_BYTES[key] = _measure_state_bytes(config)
    return _STATE_BYTES[key]


def _measure_state_bytes(config: OptimizerConfig) -> float:
    import torch

    from ..optim import state_bytes

    # A probe shaped like a transformer's parameters: one weight matrix large enough for the
    # 8-bit optimizer to quantise (its threshold is 4096 elements) and one bias vector.
    params = [torch.nn.Parameter(torch.zeros(256, 256)), torch.nn.Parameter(torch.zeros(256))]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    try:
        # A peer's 8-bit optimizer is probed through its stand-in with the same layout; its
        # library need not be installed where the plan is made.
        spec = optim_registry.get(config.name)
        probe = (
            OptimizerConfig(name=spec.stand_in, kwargs=dict(spec.stand_in_settings))
            if spec.stand_in is not None
            else OptimizerConfig(name=config.name, kwargs=dict(config.kwargs))
        )
        optimizer = probe.build(params)
        optimizer.step()
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"optimizer {config.name!r} cannot be built with the plan's arguments "
            f"{dict(config.kwargs)}: {e}"
        ) from None
    return state_bytes(optimizer) / sum(p.numel() for p in params)


@dataclass(frozen=True)
class Space:
    """The options of each dimension the search combines."""

    micros: tuple[int, ...]
    checkpointing: tuple[str, ...]
    precisions: tuple[str, ...]
    optimizers: tuple[OptimizerConfig, ...]
    fused: tuple[bool, ...]
    foreach: tuple[bool | None, ...]
    freezes: tuple[tuple[str, ...], ...]
    seq_lens: tuple[int | None, ...]
    # memfit's own techniques searched through their hooks: (name, configs) each.
    techniques: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    offloads: tuple[OffloadConfig | None, ...] = (None,)
    pure_allowed: bool = False  # bf16-pure on its own (not only beside host masters)
    extras: tuple[tuple[tuple[str, Any], ...], ...] = ((),)  # users' techniques' configs
    loras: tuple[LoraConfig | None, ...] = (None,)


def options(
    workload: Workload,
    base: Plan,
    allow: Sequence[str],
    forbid: Sequence[str],
    device: Any,
    freezes: Sequence[tuple[str, ...]] | None = None,
    *,
    disk_dir: str | None = None,
    lora_rank: int = 16,
) -> Space:
    """The options of every dimension, from ``base`` and the allowed and forbidden names.

    ``freezes`` are the freezing choices that apply to the model (default: the base plan's,
    plus the embeddings and the body when ``freeze`` is allowed). memfit's own techniques with
    ``candidates`` hooks add theirs (:func:`technique_options`). LoRA's candidates, when
    allowed, have rank ``lora_rank`` (:func:`lora_options`).
    """
    batch = workload.batch_size
    micros = micro_batches(batch) if "accumulation" not in forbid else [base.micro_batch_for(batch)]
    ckpts = ["none"]
    if "checkpointing" not in forbid:
        ckpts.append("selective")
        if "full-checkpointing" not in forbid:
            ckpts.append("full")
    mixed = "bf16-mixed" if device.supports_bf16 else "fp16-mixed"
    precisions = [base.precision.mode]
    if "mixed-precision" not in forbid:
        precisions.append(mixed)
    if "bf16-pure" in allow:
        precisions.append("bf16-pure")
    if "fp8" in allow and _fp8_problem(device) is None:
        precisions.append("fp8")  # only where the target has float8 matmuls (sm89+)
    optimizers = [base.optimizer]
    for spec in optim_registry.specs():
        if spec.allow is not None and spec.allow in allow:
            # Another optimizer gets the base's learning rate, not its (foreign) arguments.
            optimizers.append(OptimizerConfig(name=spec.name, lr=base.optimizer.lr))
    if freezes is None:
        freezes = [tuple(base.freeze)] + ([("embeddings",), ("body",)] if "freeze" in allow else [])
    seqs: list[int | None] = [base.max_seq_len]
    if "shorter-seq" in allow:
        length = base.max_seq_len or workload.seq_len
        seqs += [max(1, length // 2), max(1, length // 4)]
    offloads: list[OffloadConfig | None] = [base.offload]
    if "offload" in allow:
        offloads = offload_options(base.offload, disk_dir)
        # With the fp32 masters on the host the device may keep bf16 weights: ZeRO-Offload's
        # mixed precision (exact fp32 updates), not bf16-pure's rounding, so no consent needed.
        if device.supports_bf16 and any(o is not None and o.optimizer for o in offloads):
            precisions.append("bf16-pure")
    return Space(
        micros=tuple(micros),
        checkpointing=_unique(ckpts),
        precisions=_unique(precisions),
        optimizers=_unique(optimizers, key=lambda o: o.name),
        fused=(False, True) if "fused-step" not in forbid else (False,),
        foreach=_unique([base.optimizer.foreach] + ([False] if "foreach-off" not in forbid else [])),
        freezes=_unique(tuple(f) for f in freezes),
        seq_lens=_unique(seqs, key=lambda s: s or workload.seq_len),
        techniques=technique_options(workload, base, forbid),
        offloads=_unique(offloads, key=_offload_key),
        pure_allowed="bf16-pure" in allow,
        extras=extra_options(workload, base, allow, forbid),
        loras=lora_options(base, allow, lora_rank),
    )


def lora_options(base: Plan, allow: Sequence[str], rank: int = 16) -> tuple[LoraConfig | None, ...]:
    """LoRA's choices: the base plan's, then (when allowed) adapters of rank ``rank`` on
    every linear layer and on attention only, over the base's dtype (``lora``) and over a
    4-bit base (``qlora``). Alpha, dropout and DoRA are the base plan's when it has LoRA on.
    The rank is the user's: it changes what is trained, not only memory."""
    out: list[LoraConfig | None] = [base.lora]
    template = base.lora or LoraConfig(rank=rank)
    kinds = [q for name, q in (("lora", None), ("qlora", "nf4")) if name in allow]
    for quantize in kinds:
        for targets in ("all-linear", "attention"):
            out.append(
                dataclasses.replace(
                    template,
                    rank=rank,
                    target_modules=targets,
                    quantize_base=quantize,
                    quantize_embeddings=False,
                )
            )
    if "qlora" in allow and not template.use_dora:
        # The most frugal: the input embedding in 4 bits too.
        out.append(
            dataclasses.replace(
                template, rank=rank, target_modules="all-linear", quantize_base="nf4",
                quantize_embeddings=True,
            )
        )
    return _unique(out)


def technique_options(
    workload: Workload, base: Plan, forbid: Sequence[str]
) -> tuple[tuple[str, tuple[Any, ...]], ...]:
    """The configs of memfit's own techniques that the search varies through their hooks
    (``candidates``, ``memory_rank``): the base plan's and the hook's, or only off when one of
    the technique's ``--forbid`` names is given. The hooks run under fake tensors."""
    from ..estimate.fake_kernels import dry_tensors

    out = []
    for technique in _registered(builtin=True):
        if technique.candidates is None:
            continue
        if any(f in forbid for f in technique.forbid):
            out.append((technique.name, (_OFF[technique.plan_field],)))
            continue
        with dry_tensors():
            offered = technique.candidates(base, workload)
        out.append((technique.name, _unique([technique.config(base), *offered])))
    return tuple(out)


#: Each plan field's "off" (its default).
_OFF: dict[str, Any] = {
    f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    for f in dataclasses.fields(Plan)
}


def extra_options(
    workload: Workload, base: Plan, allow: Sequence[str], forbid: Sequence[str]
) -> tuple[tuple[tuple[str, Any], ...], ...]:
    """The combinations of users' techniques (:func:`memfit.techniques.register`) to try:
    the base plan's, and each technique off or at each of its candidate configs. A
    technique with ``--allow`` names is tried only when one is allowed; one without is tried
    unless one of its ``--forbid`` names is given."""
    base_extra = dict(base.extra)
    dims: list[list[tuple[str, Any] | None]] = []
    for technique in _registered(builtin=False):
        choices: list[tuple[str, Any] | None] = []
        if technique.name in base_extra:
            choices.append((technique.name, base_extra[technique.name]))
        choices.append(None)
        wanted = (
            any(a in allow for a in technique.allow)
            if technique.allow
            else not any(f in forbid for f in technique.forbid)
        )
        if wanted and technique.candidates is not None:
            choices += [(technique.name, c) for c in technique.candidates(base, workload)]
        dims.append(_unique(choices))
    combos = [
        tuple(sorted((pair for pair in combo if pair is not None), key=lambda p: p[0]))
        for combo in itertools.product(*dims)
    ]
    return _unique(combos) or ((),)


def _extra_ranks(
    extras: Sequence[tuple[tuple[str, Any], ...]],
) -> tuple[tuple[str, dict[Any, int]], ...]:
    """One rank table per user's technique in ``extras``: each config (``None``: off, which
    saves nothing) ranked by the technique's ``memory_rank`` (none given: it saves nothing).
    Separate dimensions: two techniques' savings are not comparable."""
    configs: dict[str, set[Any]] = {}
    for combo in extras:
        for name, config in combo:
            configs.setdefault(name, set()).add(config)
    tables = []
    for name in sorted(configs):
        technique = _technique(name)
        rank = technique.memory_rank or (lambda config: 0.0)
        saves: dict[Any, float] = {None: 0.0}
        saves.update({c: float(rank(c)) for c in configs[name]})
        tables.append((name, ordinal({c: -v for c, v in saves.items()})))
    return tuple(tables)


def _technique_ranks(technique: Any, choices: Sequence[Any]) -> dict[Any, int]:
    """A built-in's rank table over its configs: off (its field's default) saves nothing,
    the others what its ``memory_rank`` says."""
    off = _OFF[technique.plan_field]
    rank = technique.memory_rank or (lambda config: 0.0)
    return ordinal({c: 0.0 if c == off else -float(rank(c)) for c in choices})


def _unique(items: Iterable[Any], key: Any = None) -> tuple[Any, ...]:
    seen: set[Any] = set()
    out = []
    for item in items:
        k = key(item) if key else item
        if k not in seen:
            seen.add(k)
            out.append(item)
    return tuple(out)


@dataclass(frozen=True)
class _Ranks:
    """Each dimension's rank table (:func:`ordinal` over what its options keep)."""

    micro: dict[Any, int]
    ckpt: dict[Any, int]
    param: dict[Any, int]
    act: dict[Any, int]
    state: dict[Any, int]
    freeze: dict[Any, int]
    seq: dict[Any, int]
    techniques: tuple[dict[Any, int], ...]  # per technique of Space.techniques
    opt_off: dict[Any, int]
    act_off: dict[Any, int]
    par_off: dict[Any, int]
    extra: tuple[tuple[str, dict[Any, int]], ...]  # per user's technique: config -> rank
    lora: dict[Any, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(
        cls, workload: Workload, space: Space, trainable: Mapping[tuple[str, ...], float]
    ) -> _Ranks:
        offloads = space.offloads
        return cls(
            micro=ordinal({m: m for m in space.micros}),
            ckpt=ordinal({c: _CHECKPOINT_KEEPS[c] for c in space.checkpointing}),
            param=ordinal({p: PRECISION_BYTES[p][0] for p in space.precisions}),
            act=ordinal({p: PRECISION_BYTES[p][1] for p in space.precisions}),
            state=ordinal({o.name: state_bytes_per_parameter(o) for o in space.optimizers}),
            freeze=ordinal({f: trainable.get(f, 1.0) for f in space.freezes}),
            seq=ordinal({s: s or workload.seq_len for s in space.seq_lens}),
            techniques=tuple(
                _technique_ranks(_technique(name), choices) for name, choices in space.techniques
            ),
            # Optimizer offload keeps no state and at most a bucket of gradients on the
            # device; activation offload keeps only what is too small to move. One rank
            # dimension each.
            opt_off=ordinal({_moves_optimizer(o): -int(_moves_optimizer(o)) for o in offloads}),
            act_off=ordinal(
                {_moves_activations(o): -int(_moves_activations(o)) for o in offloads}
            ),
            par_off=ordinal(
                {_moves_parameters(o): -int(_moves_parameters(o)) for o in offloads}
            ),
            extra=_extra_ranks(space.extras),
            lora=ordinal({c: -_LORA.memory_rank(c) for c in space.loras}),
        )

    def vector(
        self, m: int, ck: str, pr: str, opt: str, fu: bool, loops: bool, fz: Any, sq: Any,
        te: tuple[Any, ...], of: Any, ex: Any, lo: Any = None,
    ) -> tuple[int, ...]:
        """The rank vector of one combination, in :data:`RANK_DIMENSIONS`' order."""
        return (
            self.micro[m],
            self.ckpt[ck],
            self.param[pr],
            self.act[pr],
            self.state[opt],
            int(fu),  # the fused step frees gradients (it only exists without accumulation)
            int(loops),
            self.freeze[fz],
            self.seq[sq],
            *(table[c] for table, c in zip(self.techniques, te, strict=True)),
            self.opt_off[_moves_optimizer(of)],
            self.act_off[_moves_activations(of)],
            self.par_off[_moves_parameters(of)],
            self.lora.get(lo, 0),
            *(table[dict(ex).get(name)] for name, table in self.extra),
        )


def generate(
    workload: Workload,
    base: Plan,
    space: Space,
    trainable: Mapping[tuple[str, ...], float] | None = None,
    *,
    device: Any,
) -> list[tuple[Plan, tuple[int, ...]]]:
    """Every valid combination of ``space``'s options, with its memory rank vector.

    Args:
        workload: The workload at its full batch and sequence length.
        base: The user's plan (its settings are kept where the space does not vary them).
        space: The options (:func:`options`).
        trainable: Share of parameters that train under each freezing choice (measured by
            :func:`trainable_fractions`); ranks freezing choices (all 1.0 without it).
        device: The target: torch's optimizers loop per tensor by default except on CUDA.

    Returns:
        ``(plan, rank)`` pairs; a higher rank keeps less memory in that dimension.
    """
    batch = workload.batch_size
    ranks = _Ranks.of(workload, space, trainable or {})
    consented_pure = base.precision.mode == "bf16-pure" or space.pure_allowed
    base_foreach = base.optimizer.foreach
    cuda = bool(getattr(device, "is_cuda", False))

    out = []
    names = [name for name, _ in space.techniques]
    fields = {name: _technique(name).plan_field for name in names}
    for m, ck, pr, opt, fu, fe, fz, sq, te, of, ex, lo in itertools.product(
        space.micros,
        space.checkpointing,
        space.precisions,
        space.optimizers,
        space.fused,
        space.foreach,
        space.freezes,
        space.seq_lens,
        list(itertools.product(*(choices for _, choices in space.techniques))),
        space.offloads,
        space.extras,
        space.loras,
    ):
        if pr == "bf16-pure" and not consented_pure and not _moves_optimizer(of):
            continue  # bf16 weights without consent only with their fp32 masters on the host
        accum = -(-batch // m)
        foreach_off = fe is False and base_foreach is not False
        # A step that loops per tensor has no parameter-sized multi-tensor temporaries: the
        # foreach switch turned off, memfit's optimizers, and torch's default off CUDA.
        has_foreach = optim_registry.get(opt.name).foreach
        loops = fe is False or not has_foreach or (fe is None and not cuda)
        if fu and (foreach_off or (accum > 1 and not _moves_optimizer(of))):
            # In backward the step runs per tensor anyway (foreach is moot), and accumulated
            # gradients must persist across micro-batches, so fusing saves nothing then (with
            # the optimizer on the host it still overlaps the host step with backward).
            continue
        if foreach_off and not has_foreach:
            continue  # memfit's optimizers loop per tensor: foreach off is the same plan
        if fu and pr == "fp16-mixed":
            continue  # the loss scaler must see every gradient before any step
        try:
            plan = base.replace(
                micro_batch_size=m if accum > 1 else None,
                grad_accum_steps=accum,
                checkpointing=base.checkpointing if ck == base.checkpointing.mode else ck,
                precision=base.precision if pr == base.precision.mode else pr,
                optimizer=OptimizerConfig(
                    name=opt.name, lr=opt.lr, foreach=fe, kwargs=dict(opt.kwargs)
                ),
                optimizer_in_backward=fu,
                grad_clip_mode=(
                    "approx"
                    if fu and (accum > 1 or _moves_optimizer(of))
                    else base.grad_clip_mode
                ),
                freeze=fz,
                max_seq_len=sq,
                offload=of,
                extra=ex,
                lora=lo,
                **{fields[name]: config for name, config in zip(names, te, strict=True)},
            )
        except ValueError:
            continue  # an impossible combination: the Plan says so
        rank = ranks.vector(m, ck, pr, opt.name, fu, loops, fz, sq, te, of, ex, lo)
        out.append((plan, rank))
    return out


def offload_options(
    base: OffloadConfig | None, disk_dir: str | None = None
) -> list[OffloadConfig | None]:
    """The offload choices ``--allow offload`` opens: the base's, plus the optimizer on the host
    (gradients leaving the device every micro-batch: under accumulation the device then never
    holds a whole gradient), or on disk in ``disk_dir`` when one is given; with the optimizer
    on the host, the blocks' parameters streamed from it; and activations on the host; alone
    and together. The base's other settings (bucket size, thresholds, host bound) are kept."""
    template = base or OffloadConfig(optimizer="host")
    if disk_dir is not None:
        template = dataclasses.replace(template, disk_dir=disk_dir)
    optimizers = [None if base is None else base.optimizer, "host"]
    if template.disk_dir:
        optimizers.append("disk")
    activations = [False if base is None else base.activations, True]
    parameters = [None if base is None else base.parameters, "host"]
    out: list[OffloadConfig | None] = [base]
    for opt, act, par in itertools.product(optimizers, activations, parameters):
        if opt is None and not act and par is None:
            out.append(None)
            continue
        if par is not None and opt != "host":
            continue  # parameters stream from the host optimizer's masters
        out.append(
            dataclasses.replace(
                template,
                optimizer=opt,
                activations=act,
                parameters=par,
                gradients_on_host=opt is not None
                and (template.gradients_on_host or base is None or base.optimizer is None),
            )
        )
    return out


def _offload_key(offload: OffloadConfig | None) -> tuple[Any, ...] | None:
    if offload is None:
        return None
    return (offload.optimizer, offload.activations, offload.parameters)


def _moves_optimizer(offload: OffloadConfig | None) -> bool:
    return offload is not None and offload.optimizer is not None


def _moves_activations(offload: OffloadConfig | None) -> bool:
    return offload is not None and offload.activations


def _moves_parameters(offload: OffloadConfig | None) -> bool:
    return offload is not None and offload.parameters is not None


def dominated(rank: Sequence[int], misfits: Iterable[Sequence[int]]) -> bool:
    """Whether ``rank`` is at most a known misfit's rank in every dimension."""
    return any(all(r <= f for r, f in zip(rank, bad, strict=True)) for bad in misfits)


def maximal(ranks: Sequence[Sequence[int]]) -> list[int]:
    """Indices of the ranks no other rank dominates (the most frugal candidates).

    Every rank is dominated by (at most) one of these, so if none of them fits, nothing fits.
    Equal ranks keep the first. Ordered by the sum of their ranks, largest first.
    """
    order = sorted(range(len(ranks)), key=lambda i: -sum(ranks[i]))
    kept: list[int] = []
    for i in order:
        r = ranks[i]
        if not any(all(a <= b for a, b in zip(r, ranks[k], strict=True)) for k in kept):
            kept.append(i)
    return kept


def trainable_fractions(
    workload: Workload, specs: Iterable[tuple[str, ...]]
) -> dict[tuple[str, ...], float]:
    """Share of parameters that still train under each freezing choice (on fake tensors).

    A choice the model cannot take (``ValueError`` from freezing) is left out.
    """
    from ..estimate.fake_kernels import dry_tensors
    from ..strategies.freezing import apply_freezing

    out: dict[tuple[str, ...], float] = {}
    for spec in specs:
        if not spec:
            out[spec] = 1.0
            continue
        try:
            with dry_tensors():
                model = workload.build_model()
                total = sum(p.numel() for p in model.parameters())
                apply_freezing(model, spec)
                out[spec] = sum(p.numel() for p in model.parameters() if p.requires_grad) / total
        except ValueError:
            continue
    return out


def space_pairs(
    workload: Workload,
    base: Plan,
    allow: Sequence[str],
    forbid: Sequence[str],
    device: Any,
    *,
    lora_rank: int = 16,
) -> list[tuple[Plan, tuple[int, ...]]]:
    """:func:`options` then :func:`generate`: every candidate plan with its rank vector.

    The planner's own sequence, for tests and tools that enumerate the space; freezing
    choices are measured (:func:`trainable_fractions`) when ``freeze`` is allowed.
    """
    space = options(workload, base, allow, forbid, device, lora_rank=lora_rank)
    trainable = trainable_fractions(workload, space.freezes) if "freeze" in allow else None
    if trainable is not None:
        space = options(
            workload, base, allow, forbid, device, freezes=list(trainable), lora_rank=lora_rank
        )
    return generate(workload, base, space, trainable, device=device)
