"""The Plan: which memory techniques a training run uses, as plain data.

A :class:`Plan` composes one small frozen config per concern (checkpointing, precision,
optimizer, sequence shaping, offload). It is validated when built, so an impossible combination
fails here with a sentence saying why and what to use instead, never deep inside a step. It
serialises to and from JSON and YAML.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .distributed import data as _data_parallel
from .distributed.config import ParallelConfig
from .errors import MemfitError, describe
from .optim import config as _optimizer
from .optim.config import OptimizerConfig
from .outputs import write_text
from .strategies import (
    accumulation,
    activation_offload,
    checkpointing,
    compiling,
    freezing,
    fused_loss,
    fused_pointwise,
    fused_step,
    grad_buffer,
    kv_cache,
    lora,
    loss_scaling,
    optimizer_offload,
    parameter_offload,
    precision,
    sequence,
)
from .strategies.checkpointing import CheckpointConfig
from .strategies.compiling import COMPILE_BACKENDS
from .strategies.fused_loss import FusedLossConfig
from .strategies.lora import LoraConfig
from .strategies.offload import OffloadConfig
from .strategies.precision import PrecisionConfig
from .strategies.sequence import SequenceConfig
from .techniques import (
    Technique,
    TechniqueError,
    get,
    is_builtin,
    register,
    registered,
    techniques_of,
)

__all__ = ["BUILTIN_TECHNIQUES", "COMPILE_BACKENDS", "Plan", "PlanError"]

#: memfit's own techniques (each defined in its own module, registered here, where their
#: configs meet): adding a technique is its module plus one line here.
BUILTIN_TECHNIQUES: tuple[Technique, ...] = (
    kv_cache.TECHNIQUE,
    lora.TECHNIQUE,
    freezing.TECHNIQUE,
    fused_pointwise.TECHNIQUE,
    fused_loss.TECHNIQUE,
    precision.TECHNIQUE,
    checkpointing.TECHNIQUE,
    parameter_offload.TECHNIQUE,
    activation_offload.TECHNIQUE,
    compiling.TECHNIQUE,
    grad_buffer.TECHNIQUE,
    _data_parallel.TECHNIQUE,
    _optimizer.TECHNIQUE,
    fused_step.TECHNIQUE,
    optimizer_offload.TECHNIQUE,
    accumulation.ACCUMULATION,
    accumulation.LOSS_NORMALIZATION,
    sequence.MAX_SEQ_LEN,
    sequence.SEQUENCE,
    loss_scaling.CLIPPING,
)
for _technique in BUILTIN_TECHNIQUES:
    register(_technique, builtin=True)




class PlanError(MemfitError, ValueError):
    """A plan is malformed or combines techniques that cannot work together."""


@dataclass(frozen=True)
class Plan:
    """How to train: every memory technique memfit applies, in one serialisable value.

    Attributes:
        micro_batch_size: Samples per forward/backward. ``None`` is the whole batch divided by
            ``grad_accum_steps``. Activation memory scales with it; smaller micro-batches cost
            kernel efficiency.
        grad_accum_steps: Micro-batches accumulated per optimizer step. Same gradient as the
            full batch (the loss is normalised), activations of one micro-batch only; compute
            the same but less parallel.
        loss_normalization: ``mean`` averages micro-batch losses (right when every micro-batch
            has the same number of loss terms); ``tokens`` weights each micro-batch by its
            count of label tokens that are not ``-100``, so padded causal-LM batches give
            exactly the full-batch gradient. No memory cost.
        checkpointing: Activation checkpointing (see :class:`CheckpointConfig`).
        precision: Numeric precision (see :class:`PrecisionConfig`).
        optimizer: Optimizer and its switches (see :class:`OptimizerConfig`).
        optimizer_in_backward: Step each parameter as soon as its gradient is ready and free
            the gradient: gradients never all exist at once (saves nearly all gradient
            memory); the step runs inside backward, so no extra compute.
        max_grad_norm: Clip gradients to this global norm (``None``: no clipping).
        grad_clip_mode: With ``optimizer_in_backward`` and clipping: ``exact`` runs a first
            backward that only measures the norm (about +1 backward of compute, no gradient
            memory); ``approx`` clips with the previous step's norm (no extra compute).
        freeze: Parameters to freeze: ``fnmatch`` patterns over parameter names, or
            ``embeddings``, ``body`` (all but the task head) or ``blocks:K`` (the first K
            repeated blocks). Frozen parameters have no gradient and no optimizer state.
        max_seq_len: Truncate sequences to this many tokens (``None``: unchanged). Activation
            memory is linear in it (quadratic for eager attention).
        sequence: Padding and batching of sequences (see :class:`SequenceConfig`).
        offload: Offload to host or disk (``None``: off; ``"host"`` is short for the
            optimizer on the host): see :class:`~memfit.strategies.offload.OffloadConfig`.
        fused_pointwise: Replace transformers' RMSNorms and gated MLPs (SwiGLU, GeGLU) by
            single autograd nodes (:mod:`memfit.ops.pointwise`) that keep only their inputs for
            backward: per layer, about one activation of the hidden width per norm and one of
            the MLP width less (more in bf16), for a few elementwise passes recomputed in
            backward. Same arithmetic: gradients equal to rounding.
        compile: ``torch.compile`` the model: ``true`` (inductor) or a backend name from
            :data:`COMPILE_BACKENDS`. Its min-cut partitioner keeps fewer activations for
            backward (recomputing pointwise results) and fused kernels drop temporaries; a dry
            run cannot see either, so the saving is measured once for real at a small size
            (:mod:`memfit.strategies.compiling`). Costs compile time at the first steps.
        fused_loss: Compute a Hugging Face causal LM's loss from the last hidden states with
            :func:`memfit.ops.chunked_cross_entropy` (see
            :func:`~memfit.strategies.fused_loss.apply_fused_loss`): the fp32 logits and their
            gradient (tokens x vocabulary x 4 bytes each) never exist, one chunk of them does.
            Costs one more matmul pass of the output head in backward (each chunk's logits are
            recomputed). ``None`` (or ``false``) is off; ``true`` is
            :class:`~memfit.strategies.fused_loss.FusedLossConfig` with an automatic chunk
            size; a mapping sets ``chunk_size`` and ``training_only``. Gradients equal the plain
            loss's to rounding. Custom models: :func:`memfit.ops.fused_linear_loss`.
        grad_buffer: Keep every gradient in one pre-allocated contiguous buffer per dtype
            (each ``.grad`` a view into it, ZeRO-R's contiguous gradients; see
            :mod:`memfit.strategies.grad_buffer`): a step allocates no gradient tensor, so
            gradients cannot fragment the allocator (many small rounded blocks spread over
            segments become one block). Memory: the gradient bytes (plus at most
            ``ALIGN_BYTES`` per parameter of padding) are held for the whole run, so the
            forward holds up to the gradient bytes more than plain training, whose
            ``zero_grad(set_to_none=True)`` frees them between steps. Time: one fill of the
            buffer per step; no extra compute. Same numerics. Refused with
            ``optimizer_in_backward`` and with optimizer offload, which free or move each
            gradient as soon as it is ready.
        parallel: Data, tensor, pipeline and context parallelism and ZeRO (see
            :class:`~memfit.distributed.config.ParallelConfig`).
        lora: Low-rank adapters on a frozen base, LoRA or (``quantize_base: nf4``) QLoRA
            (see :class:`~memfit.strategies.lora.LoraConfig`; needs ``memfit[peft]``):
            the base keeps no gradient and no optimizer state, the adapters are small.
            ``None``: off (and left out of the plan's JSON).
        extra: The configs of techniques registered with :func:`memfit.techniques.register`
            (a mapping of technique name to its config, or to a mapping of the config's
            fields); what each costs is its own docstring's. Stored as sorted
            ``(name, config)`` pairs; serialised only when not empty.
    """

    micro_batch_size: int | None = None
    grad_accum_steps: int = 1
    loss_normalization: str = "mean"
    checkpointing: CheckpointConfig = field(default_factory=CheckpointConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    optimizer_in_backward: bool = False
    max_grad_norm: float | None = None
    grad_clip_mode: str = "exact"
    freeze: tuple[str, ...] = ()
    max_seq_len: int | None = None
    sequence: SequenceConfig = field(default_factory=SequenceConfig)
    offload: OffloadConfig | None = None
    fused_pointwise: bool = False
    fused_loss: FusedLossConfig | None = None
    compile: bool | str = False
    grad_buffer: bool = False
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoraConfig | None = None
    extra: Any = ()

    def __post_init__(self) -> None:
        # Accept short forms (strings, dicts, lists) and store the canonical configs.
        coerce = object.__setattr__
        coerce(self, "checkpointing", _coerce(CheckpointConfig, self.checkpointing, "mode"))
        coerce(self, "precision", _coerce(PrecisionConfig, self.precision, "mode"))
        coerce(self, "optimizer", _coerce(OptimizerConfig, self.optimizer, "name"))
        coerce(self, "sequence", _coerce(SequenceConfig, self.sequence, None))
        if isinstance(self.parallel, int) and not isinstance(self.parallel, bool):
            coerce(self, "parallel", ParallelConfig(data=self.parallel))
        coerce(self, "parallel", _coerce(ParallelConfig, self.parallel, None))
        if self.offload is not None:
            # "host" is short for the optimizer on the host (ZeRO-Offload).
            offload = {"optimizer": self.offload} if isinstance(self.offload, str) else self.offload
            coerce(self, "offload", _coerce(OffloadConfig, offload, None))
        if isinstance(self.freeze, str):
            coerce(self, "freeze", (self.freeze,) if self.freeze else ())
        if not isinstance(self.freeze, (list, tuple)) or not all(
            isinstance(f, str) for f in self.freeze
        ):
            raise PlanError(
                "freeze must be a pattern or a list of patterns (fnmatch over parameter names, "
                f"'embeddings', 'body' or 'blocks:K'), got {describe(self.freeze)}"
            )
        coerce(self, "freeze", tuple(self.freeze))
        coerce(self, "extra", _extra(self.extra))
        for technique in BUILTIN_TECHNIQUES:
            # Each technique turns its field's short forms into its canonical config.
            if technique.parse is not None and isinstance(technique.plan_field, str):
                field_ = technique.plan_field
                try:
                    coerce(self, field_, technique.parse(getattr(self, field_)))
                except ValueError as e:
                    raise PlanError(str(e)) from None
        cb = self.checkpointing
        if cb.blocks is not None and not isinstance(cb.blocks, tuple):
            blocks = (cb.blocks,) if isinstance(cb.blocks, str) else tuple(cb.blocks)
            coerce(self, "checkpointing", dataclasses.replace(cb, blocks=blocks))
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Check the plan; raise :class:`PlanError` naming the problem and the fix."""
        self._validate_parallel()
        for technique in BUILTIN_TECHNIQUES:
            # Each technique's own rules, and those tying it to others, live with it.
            if technique.check is not None:
                try:
                    technique.check(self)
                except ValueError as e:
                    raise PlanError(str(e)) from None

    def _validate_parallel(self) -> None:
        par = self.parallel
        problems = par.problems()
        if problems:
            raise PlanError(problems[0])
        if par.pipeline > 1 and (self.micro_batch_size is not None or self.grad_accum_steps > 1):
            raise PlanError(
                "a pipeline splits each step into its own micro-batches (parallel microbatches), "
                "which replace gradient accumulation; leave micro_batch_size unset and "
                "grad_accum_steps 1"
            )
        if par.partition_activations and self.checkpointing.mode not in ("full", "selective"):
            raise PlanError(
                "parallel partition_activations splits the block inputs that activation "
                "checkpointing keeps and needs checkpointing 'full' or 'selective'; set "
                "checkpointing, or partition_activations false"
            )
        if par.splits_model and par.zero_stage == 1:
            raise PlanError(
                "zero_stage 1 (ZeroRedundancyOptimizer) is not composed with tensor or pipeline "
                "parallelism, nor with context parallelism; use zero_stage 0 (gradients "
                "all-reduced) or 2 or 3 (FSDP2)"
            )
        # What each technique cannot do on several processes is its own check's.

    def techniques(self) -> list[tuple[Technique, Any]]:
        """``(technique, config)`` for every registered technique this plan turns on, in
        apply order (:mod:`memfit.techniques`)."""
        return list(techniques_of(self))

    # ------------------------------------------------------------------ derived
    @property
    def compile_backend(self) -> str | None:
        """The ``torch.compile`` backend the plan asks for (``None``: not compiled)."""
        if self.compile is True:
            return "inductor"
        return self.compile or None

    def micro_batch_for(self, batch_size: int) -> int:
        """Samples per micro-batch for an effective batch of ``batch_size``."""
        if self.micro_batch_size is not None:
            return self.micro_batch_size
        return max(1, -(-batch_size // self.grad_accum_steps))

    def replace(self, **changes: Any) -> Plan:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def over_processes(self, world_size: int) -> Plan:
        """This plan for ``world_size`` processes: a plan for one process spreads its data
        dimension over all of them (its ZeRO stage kept); a plan for that many is itself.

        Raises:
            PlanError: the plan is for another number of processes (one sentence, which a
                command completes with its own flag).
        """
        data = self.parallel.data
        if data == world_size:
            return self
        if data != 1:
            raise PlanError(
                f"the plan is for {data} processes but {world_size} were started"
            )
        return self.replace(parallel=dataclasses.replace(self.parallel, data=world_size))

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        """Plain data: sub-configs become dicts, tuples lists, ``offload`` ``None`` when off,
        ``extra`` (users' techniques) only when not empty."""
        data = _plain(dataclasses.asdict(self))
        extra = data.pop("extra")
        if data["lora"] is None:
            del data["lora"]  # off: plans without adapters keep the JSON they had
        if extra:
            data["extra"] = {name: config for name, config in extra}
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """Build a plan from :meth:`to_dict` output (short forms accepted).

        Raises:
            PlanError: on an unknown key (naming the keys that exist) or a bad value.
        """
        if not isinstance(data, Mapping):
            raise PlanError(f"a plan must be a mapping of fields, got {type(data).__name__}")
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = [k for k in data if k not in known]
        if unknown:
            raise PlanError(
                f"plan has unknown key {unknown[0]!r}; known keys are {', '.join(known)}"
            )
        try:
            return cls(**dict(data))
        except TypeError as e:
            raise PlanError(f"plan is malformed: {e}") from None

    def to_json(self, path: str | Path | None = None) -> str:
        """The plan as JSON; also written to ``path`` when given (atomically)."""
        text = json.dumps(self.to_dict(), indent=2) + "\n"
        if path is not None:
            write_text(path, text)
        return text

    def to_yaml(self, path: str | Path | None = None) -> str:
        """The plan as YAML; also written to ``path`` when given."""
        import yaml

        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            write_text(path, text)
        return text

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan from a JSON or YAML file (or a JSON file written by ``memfit plan``,
        whose plan sits under the ``plan`` key).

        Raises:
            PlanError: when the file is missing, unparsable or not a plan.
        """
        p = Path(path)
        if not p.is_file():
            raise PlanError(f"plan file {str(p)!r} does not exist")
        text = p.read_text()
        try:
            if p.suffix.lower() in (".yaml", ".yml"):
                import yaml

                data = yaml.safe_load(text)
            else:
                data = json.loads(text)
        except Exception as e:
            raise PlanError(f"plan file {str(p)!r} cannot be parsed ({e})") from None
        if isinstance(data, Mapping) and isinstance(data.get("plan"), Mapping):
            data = data["plan"]
        if data is None:
            raise PlanError(f"plan file {str(p)!r} is empty")
        return cls.from_dict(data)

    def summary(self) -> str:
        """One line naming the techniques that are on."""
        return ", ".join(self.summary_parts())

    def summary_parts(self) -> list[str]:
        """The techniques that are on, one phrase each (the optimizer always counts as one)."""
        parts = []
        if self.grad_accum_steps > 1 or self.micro_batch_size is not None:
            mb = self.micro_batch_size if self.micro_batch_size is not None else "auto"
            parts.append(f"micro-batch {mb} x {self.grad_accum_steps}")
        if self.checkpointing.mode != "none":
            parts.append(f"checkpointing {self.checkpointing.mode}")
        if self.precision.mode != "fp32":
            parts.append(self.precision.mode)
        parts.append(
            self.optimizer.name + ("" if self.optimizer.foreach is not False else " (foreach off)")
        )
        if self.optimizer_in_backward:
            parts.append("optimizer step in backward")
        if self.max_grad_norm is not None:
            parts.append(f"clip {self.max_grad_norm} ({self.grad_clip_mode})")
        if self.lora is not None:
            parts.append(self.lora.summary())
        if self.freeze:
            parts.append("freeze " + ",".join(self.freeze))
        if self.max_seq_len is not None:
            parts.append(f"max length {self.max_seq_len}")
        if self.offload is not None:
            parts.append(self.offload.summary())
        if self.fused_pointwise:
            parts.append("fused pointwise")
        if self.fused_loss is not None:
            chunk = self.fused_loss.chunk_size
            parts.append("fused loss" + (f" (chunks of {chunk} tokens)" if chunk else ""))
        if self.grad_buffer:
            parts.append("contiguous gradient buffer")
        par = self.parallel
        if par.splits_model:
            layout = f"data {par.data} x tensor {par.tensor} x pipeline {par.pipeline}"
            if par.context > 1:
                layout += f" x context {par.context} ({par.context_mode})"
            if par.pipeline > 1:
                m = par.microbatches if par.microbatches is not None else 2 * par.pipeline
                cut = f", cut at blocks {', '.join(map(str, par.cuts))}" if par.cuts else ""
                sync = ", vertical sync" if par.vertical_sync else ""
                layout += f" ({par.schedule}{sync}, {m} micro-batches{cut})"
            if par.sequence:
                layout += ", sequence parallel"
            if par.partition_activations:
                where = " on the host" if par.partition_offload else ""
                layout += f", checkpoints partitioned{where} (ZeRO-R)"
            if par.expert > 1:
                layout += f", experts split over {par.expert}"
            if par.zero_stage:
                layout += f", ZeRO stage {par.zero_stage}"
            parts.append(layout)
        elif par.data > 1 or par.zero_stage:
            experts = f", experts split over {par.expert}" if par.expert > 1 else ""
            parts.append(f"{par.data} processes, ZeRO stage {par.zero_stage}{experts}")
        if self.compile_backend is not None:
            parts.append(
                "compiled" if self.compile_backend == "inductor" else f"compiled ({self.compile_backend})"
            )
        for technique, config in self.techniques():
            if not is_builtin(technique.name):
                parts.append(technique.summary(config) if technique.summary else technique.name)
        return parts


def _coerce(cls: type, value: Any, short_field: str | None) -> Any:
    if isinstance(value, cls):
        return value
    if isinstance(value, str) and short_field is not None:
        try:
            return cls(**{short_field: value})
        except ValueError as e:
            raise PlanError(str(e)) from None
    if isinstance(value, Mapping):
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = [k for k in value if k not in names]
        if unknown:
            raise PlanError(
                f"{cls.__name__} has no field {unknown[0]!r}; its fields are {', '.join(sorted(names))}"
            )
        data = dict(value)
        for k, v in data.items():
            if isinstance(v, list):
                data[k] = tuple(v)
        try:
            return cls(**data)
        except ValueError as e:
            raise PlanError(str(e)) from None
    raise PlanError(f"{cls.__name__} cannot be made from {value!r}")


def _extra(value: Any) -> tuple[tuple[str, Any], ...]:
    """The canonical ``extra``: sorted ``(name, config)`` pairs of registered user techniques."""
    if value is None:
        return ()
    items = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = [(name, config) for name, config in items]
    except (TypeError, ValueError):
        raise PlanError(
            f"extra must map registered technique names to their configs, got {value!r}"
        ) from None
    names = [name for name, _ in pairs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise PlanError(f"extra names technique {twice[0]!r} twice; give each technique once")
    out = []
    for name, config in pairs:
        try:
            technique = get(name)
        except TechniqueError:
            users = [t.name for t in registered(builtin=False)]
            raise PlanError(
                f"extra names technique {name!r}, which is not registered; registered with "
                f"memfit.techniques.register: {', '.join(users) if users else 'none'}"
            ) from None
        if is_builtin(name):
            raise PlanError(
                f"extra holds the configs of users' techniques; {name!r} is memfit's own, "
                f"set it with its own plan field"
            )
        try:
            out.append((name, technique.coerce(config)))
        except TechniqueError as e:
            raise PlanError(str(e)) from None
    return tuple(sorted(out, key=lambda pair: pair[0]))


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj
