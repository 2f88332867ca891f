"""Mixed and reduced precision: autocast, loss scaling, bf16 weights with stochastic rounding.

:func:`apply_precision` returns a :class:`PrecisionRuntime`, one small class per mode, all with
the same five methods, so the training loop never asks which mode it is in (a null object:
``fp32`` is the base class, which does nothing special):

=============  ===================  =======================  ==============================
mode           ``autocast()``       ``backward`` / ``step``  weights, grads, Adam state
=============  ===================  =======================  ==============================
fp32           nothing              plain                    4 + 4 + 8 bytes per parameter
bf16-mixed     ``torch.autocast``   plain                    4 + 4 + 8 (activations halved)
fp16-mixed     ``torch.autocast``   dynamic loss scaling     4 + 4 + 8 (activations halved)
bf16-pure      nothing              stochastic rounding      2 + 2 + 4
fp8            ``torch.autocast``   plain                    4 + 4 + 8 (float8 linears)
=============  ===================  =======================  ==============================

``fp8`` is ``bf16-mixed`` with torchao's float8 linears (:mod:`memfit.strategies.fp8`).

``bf16-pure`` casts the model to bf16 and wraps the optimizer so each update is computed in
fp32 and written back to the bf16 weights with stochastic rounding (unbiased: an update far
below half a bf16 ulp still moves the weight on average, where round-to-nearest drops it).

The runtime is also the handle of what :func:`apply_precision` changed:
:meth:`PrecisionRuntime.remove` takes it off again. For ``bf16-pure`` that means:

* every parameter and buffer gets its original dtype back, holding its *current* value
  converted (a model trained in bf16 comes back in fp32 with its trained values, exactly:
  every bf16 value is an fp32 value);
* a weight that was not a bf16 value to begin with was rounded to bf16 when cast, and that
  rounding cannot be undone from the bf16 value alone (relative error at most 2**-9). Weights
  loaded from a bf16 checkpoint, as most published LLM weights are, come back bit for bit.
  With ``keep_original_weights=True`` the original tensors are kept (on the host) and every
  element that training did not change comes back bit for bit, even right after the cast;
  that costs their size in host memory, which on a CPU-only run is the memory bf16-pure saves,
  so it is off by default;
* the input-cast hook goes, and every optimizer the runtime wrapped for the bf16 step is
  unwrapped: its own ``step`` again, its stochastic-rounding generators dropped, its per-element
  state (Adam's moments) converted to the parameters' restored dtype.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from ..optim.config import OptimizerConfig
from ..optim.rounding import stochastic_round_to_bf16
from ..techniques import ENGINES, ApplyContext, Technique
from .loss_scaling import DynamicLossScaler, clip_gradients, optimizer_params

__all__ = [
    "PRECISION_MODES",
    "Bf16PureRuntime",
    "DynamicLossScaler",
    "Fp8Runtime",
    "Fp16MixedRuntime",
    "MixedRuntime",
    "PrecisionConfig",
    "PrecisionRuntime",
    "apply_precision",
    "cast_module",
    "stochastic_round_to_bf16",
    "unwrap_optimizer_bf16",
    "weights_dtype",
    "wrap_optimizer_bf16",
]

PrecisionMode = Literal["fp32", "bf16-mixed", "fp16-mixed", "bf16-pure", "fp8"]
#: The precision modes, from full fp32 to bf16 weights, and float8 matmuls.
PRECISION_MODES: tuple[str, ...] = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-pure", "fp8")


@dataclass(frozen=True)
class PrecisionConfig:
    """Numeric precision of weights, activations and optimizer math.

    Attributes:
        mode: ``fp32`` everything in float32. ``bf16-mixed`` / ``fp16-mixed``: fp32 weights,
            matmuls under autocast; activations saved for backward are half-size (roughly
            halves activation memory, no saving on weights, gradients or state).
            ``bf16-pure``: weights, gradients and optimizer math in bf16: halves parameters,
            gradients and (for Adam-like state) state, with stochastic rounding so small
            updates are not lost. ``fp8``: ``bf16-mixed`` (fp32 master weights, gradients and
            state, bf16 autocast) with every linear whose dimensions are multiples of 16, but
            the output head, computing in float8 through torchao (its default tensorwise
            recipe; needs ``memfit[fp8]`` and a GPU of compute capability 8.9 or newer, or a
            CPU whose PyTorch has float8 matmuls). Memory: as ``bf16-mixed``, less the bf16
            weight copies autocast saves for backward (the float8 linears save the fp32
            weight itself and their bf16 input, and cast both again in backward). Time: eager
            float8 is slower than bf16 (2.5x per step, measured on an H200), since the
            casts are separate kernels; ``compile`` fuses them. Numerics change (float8
            rounding of matmul inputs), so the planner tries it only with ``--allow fp8``.
        stochastic_rounding: For ``bf16-pure``: round updated weights stochastically (unbiased)
            instead of to nearest; costs one random draw per element per step.
        init_scale: For ``fp16-mixed``: the initial dynamic loss scale.
        growth_interval: For ``fp16-mixed``: steps without overflow before the scale doubles.
        backoff_factor: For ``fp16-mixed``: scale multiplier after an overflow (step skipped).
        growth_factor: For ``fp16-mixed``: scale multiplier after ``growth_interval`` good steps.
    """

    mode: PrecisionMode = "fp32"
    stochastic_rounding: bool = True
    init_scale: float = 2.0**16
    growth_interval: int = 2000
    backoff_factor: float = 0.5
    growth_factor: float = 2.0

    def __post_init__(self) -> None:
        if self.mode not in PRECISION_MODES:
            raise ValueError(
                f"precision {self.mode!r} is not known; use one of {', '.join(PRECISION_MODES)}"
            )


def weights_dtype(mode: str) -> torch.dtype:
    """The dtype precision ``mode`` keeps the weights in: bf16 for ``bf16-pure``, else fp32
    (the mixed modes keep fp32 master weights and autocast the matmuls).

    Saved weights load straight into it (:meth:`memfit.workload.Workload.build`), so a
    bf16-pure fine-tune never holds the model in fp32, and an fp32 one upcasts a bf16
    checkpoint tensor by tensor.
    """
    return torch.bfloat16 if mode == "bf16-pure" else torch.float32


# ---------------------------------------------------------------------------------- runtimes
class PrecisionRuntime:
    """How a training step runs in one precision; this base class is plain fp32.

    Every mode implements the same methods, so the loop is the same for all::

        with runtime.autocast():
            loss = loss_fn(model(**batch), batch)
        runtime.backward(loss)
        runtime.step(optimizer, max_grad_norm=1.0)

    Args:
        device_type: The model's device type (``cpu``, ``cuda``, ...).
    """

    mode: str = "fp32"

    def __init__(self, device_type: str = "cpu") -> None:
        self.device_type = device_type

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The context the forward (and loss) runs under."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss``."""
        loss.backward()

    def step(self, optimizer: Any, max_grad_norm: float | None = None, model: Any = None) -> bool:
        """Clip (if ``max_grad_norm``) and step ``optimizer``.

        Args:
            optimizer: The optimizer; its parameters' gradients are clipped.
            max_grad_norm: Clip the global gradient norm to this (``None``: no clipping).
            model: Unused by the built-in modes (for runtimes that need the model).

        Returns:
            Whether the optimizer stepped.
        """
        clip_gradients(optimizer_params(optimizer), max_grad_norm)
        optimizer.step()
        return True

    def optimizer_config(self, cfg: OptimizerConfig) -> OptimizerConfig:
        """The optimizer config this mode needs (unchanged in every built-in mode)."""
        return cfg

    def wrap_optimizer(self, optimizer: Any) -> Any:
        """The optimizer this mode steps (unchanged unless the mode needs it)."""
        return optimizer

    def remove(self) -> None:
        """Undo what :func:`apply_precision` did to the model (nothing, in this mode)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(mode={self.mode!r}, device_type={self.device_type!r})"


class MixedRuntime(PrecisionRuntime):
    """``bf16-mixed``: fp32 weights, the forward under ``torch.autocast`` in ``dtype``."""

    mode = "bf16-mixed"

    def __init__(self, device_type: str = "cpu", dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__(device_type)
        self.dtype = dtype

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)


class Fp16MixedRuntime(MixedRuntime):
    """``fp16-mixed``: autocast to fp16 and a :class:`DynamicLossScaler`."""

    mode = "fp16-mixed"

    def __init__(self, device_type: str = "cpu", scaler: DynamicLossScaler | None = None) -> None:
        super().__init__(device_type, torch.float16)
        self.scaler = scaler or DynamicLossScaler()

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale_loss(loss).backward()

    def step(self, optimizer: Any, max_grad_norm: float | None = None, model: Any = None) -> bool:
        return self.scaler.step(optimizer, max_grad_norm)


class Fp8Runtime(MixedRuntime):
    """``fp8``: bf16 autocast around torchao's float8 linears (:mod:`memfit.strategies.fp8`).

    Args:
        device_type: The model's device type.
        conversion: What was converted (:func:`memfit.strategies.fp8.apply_fp8`).
    """

    mode = "fp8"

    def __init__(self, device_type: str = "cpu", conversion: Any = None) -> None:
        super().__init__(device_type, torch.bfloat16)
        self.conversion = conversion

    @property
    def converted(self) -> list[str]:
        """Qualified names of the linears computing in float8 (empty after :meth:`remove`)."""
        return self.conversion.converted if self.conversion is not None else []

    def remove(self) -> None:
        """Put the original ``nn.Linear`` modules back (same module and parameter objects)."""
        conversion, self.conversion = self.conversion, None
        if conversion is not None:
            conversion.undo()


class Bf16PureRuntime(PrecisionRuntime):
    """``bf16-pure``: bf16 weights and gradients, fp32 update math, stochastic write-back.

    Args:
        device_type: The model's device type.
        stochastic_rounding: Write updated weights back with :func:`stochastic_round_to_bf16`
            (else round to nearest, which drops updates below half an ulp).
        seed: Seed of the rounding's own generator (the global RNG, which dropout uses, is
            left alone). Default: derived from ``torch.initial_seed()``.
        chunk_numel: Parameters per fp32 chunk of the step (see :func:`wrap_optimizer_bf16`).
        restore: What :meth:`remove` puts back (set by :func:`apply_precision`).
    """

    mode = "bf16-pure"

    def __init__(
        self,
        device_type: str = "cpu",
        stochastic_rounding: bool = True,
        seed: int | None = None,
        chunk_numel: int = 1 << 20,
        restore: _Restore | None = None,
    ) -> None:
        super().__init__(device_type)
        self.stochastic_rounding = stochastic_rounding
        self.seed = seed
        self.chunk_numel = chunk_numel
        self._restore = restore
        self._wrapped: dict[int, Any] = {}  # optimizers this runtime wrapped, to unwrap

    def wrap_optimizer(self, optimizer: Any) -> Any:
        fresh = getattr(optimizer, "_memfit_bf16", None) is None
        wrapped = wrap_optimizer_bf16(
            optimizer,
            stochastic_rounding=self.stochastic_rounding,
            seed=self.seed,
            chunk_numel=self.chunk_numel,
        )
        if fresh:
            self._wrapped[id(wrapped)] = wrapped
        return wrapped

    @property
    def kept_bytes(self) -> int:
        """Host bytes held for an exact :meth:`remove` (``keep_original_weights``); 0 without
        it and after removal. On the CPU these are the original storages themselves."""
        if self._restore is None:
            return 0
        return sum(t.untyped_storage().nbytes() for t in self._restore.kept.values())

    def remove(self) -> None:
        """Restore dtypes (current values), drop the input-cast hook, unwrap the optimizers
        this runtime wrapped (see the module docstring for what comes back exactly)."""
        restore, self._restore = self._restore, None
        if restore is not None:
            restore.undo()
        wrapped, self._wrapped = self._wrapped, {}
        for optimizer in wrapped.values():
            unwrap_optimizer_bf16(optimizer)

    def step(self, optimizer: Any, max_grad_norm: float | None = None, model: Any = None) -> bool:
        # An optimizer built by the caller may not be wrapped yet (wrapping is idempotent).
        # A handle over per-parameter optimizers (``optimizers``) is left alone: its
        # optimizers are wrapped one by one where they are built.
        if hasattr(optimizer, "param_groups") and not hasattr(optimizer, "optimizers"):
            optimizer = self.wrap_optimizer(optimizer)
        return super().step(optimizer, max_grad_norm, model)


# ---------------------------------------------------------------------------------- bf16 step
def wrap_optimizer_bf16(
    optimizer: torch.optim.Optimizer,
    *,
    stochastic_rounding: bool = True,
    seed: int | None = None,
    chunk_numel: int = 1 << 20,
) -> torch.optim.Optimizer:
    """Make ``optimizer`` compute in fp32 and write bf16 weights back stochastically rounded.

    Works with any ``torch.optim.Optimizer`` whose parameters are bf16: its ``step`` is
    replaced, on this instance only, by one that walks the parameters in chunks of at most
    ``chunk_numel`` elements (a larger tensor is a chunk by itself). For each chunk it

    1. gives the chunk's parameters fp32 copies of their weights, gradients and of the state
       tensors shaped like them (Adam's moments),
    2. runs the optimizer's own step, which sees only the chunk (the other gradients are
       hidden for that call, and optimizers skip parameters without a gradient),
    3. writes weights and those state tensors back to bf16, stochastically rounded.

    Memory per parameter between steps: weights 2 bytes, gradients 2, state 2 per moment
    (AdamW: 4); scalar state such as ``step`` and state of other shapes (factored statistics)
    stays as the optimizer made it. During the step, one chunk at a time is fp32: at most
    ``chunk_numel`` x (4 + 4 + 4 per moment) bytes on top. Global and per-instance step hooks
    run once per ``step()``, as usual. A closure, if given, is evaluated once before the
    chunks. Wrapping twice is a no-op.

    Args:
        optimizer: The optimizer (over bf16 parameters; others are stepped as they are).
        stochastic_rounding: Stochastic (default) or round-to-nearest write-back.
        seed: Seed of the rounding generator (default: from ``torch.initial_seed()``).
        chunk_numel: Elements per fp32 chunk; ``0`` steps one parameter at a time.

    Returns:
        The same optimizer object (so schedulers and ``isinstance`` checks keep working).
    """
    if getattr(optimizer, "_memfit_bf16", None) is not None:
        return optimizer
    if getattr(optimizer, "handles_low_precision", False):
        # The optimizer updates bf16 weights itself, in fp32 chunks, and rounds as told: no
        # fp32 shadow needed (memfit's Adafactor, whose factored statistics span whole rows
        # and columns, cannot be stepped one chunk at a time from outside).
        optimizer._memfit_bf16 = _LowPrecision(  # type: ignore[attr-defined]
            getattr(optimizer, "stochastic_rounding", False)
        )
        optimizer.stochastic_rounding = stochastic_rounding  # type: ignore[attr-defined]
        return optimizer
    cls_step = type(optimizer).step
    # Optimizer.__init__ wraps the class's step once with the hook runner; call what it wraps
    # per chunk, and run the hooks once around the whole step.
    raw_step = cls_step.__wrapped__ if getattr(cls_step, "hooked", False) else cls_step
    ctx = _Bf16StepContext(raw_step, stochastic_rounding, seed, chunk_numel)
    optimizer._memfit_bf16 = ctx  # type: ignore[attr-defined]
    hooked = torch.optim.Optimizer.profile_hook_step(_bf16_step)
    optimizer.step = types.MethodType(hooked, optimizer)  # type: ignore[method-assign]
    return optimizer


def unwrap_optimizer_bf16(optimizer: Any) -> Any:
    """Undo :func:`wrap_optimizer_bf16`: the optimizer's own ``step`` again, its rounding
    generators dropped, and its per-element state converted to its parameters' dtype (call it
    after the parameters got their dtype back). A no-op on an optimizer that is not wrapped.

    Returns:
        The same optimizer.
    """
    ctx = optimizer.__dict__.pop("_memfit_bf16", None)
    if ctx is None:
        return optimizer
    if isinstance(ctx, _LowPrecision):
        optimizer.stochastic_rounding = ctx.previous
        return optimizer
    optimizer.__dict__.pop("step", None)  # the instance's step: the class's shows again
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for k, v in list(state.items()):
                if isinstance(v, torch.Tensor) and _moment_like(v, p) and v.dtype != p.dtype:
                    state[k] = v.to(p.dtype)
    return optimizer


@dataclass
class _LowPrecision:
    """Marks an optimizer that rounds bf16 itself; keeps its setting from before."""

    previous: bool


class _Restore:
    """What ``bf16-pure`` changed on a model, to put back (:meth:`Bf16PureRuntime.remove`).

    Every floating parameter and buffer slot (module table, key, original tensor, its dtype)
    and, with ``keep``, the original values on the host.
    """

    def __init__(self, model: nn.Module, keep: bool) -> None:
        self.model = model
        self.slots: list[tuple[dict[str, Any], str, torch.Tensor, torch.dtype]] = []
        self.kept: dict[int, torch.Tensor] = {}
        for mod in model.modules():
            for table in (mod._parameters, mod._buffers):
                for key, t in table.items():
                    if t is None or not t.is_floating_point() or t.dtype == torch.bfloat16:
                        continue
                    self.slots.append((table, key, t, t.dtype))
                    if keep and id(t) not in self.kept:
                        # On the CPU this is the original storage itself (no copy); from an
                        # accelerator a host copy, so the device keeps bf16-pure's saving.
                        self.kept[id(t)] = t.detach().to("cpu")
        self.hook: Any = None

    def undo(self) -> None:
        if self.hook is not None:
            self.hook.remove()
            self.hook = None
        self.model.__dict__.pop("_memfit_bf16_inputs", None)
        done: set[int] = set()
        for table, key, original, dtype in self.slots:
            current = table.get(key)
            if current is None:
                continue
            if id(original) not in done:
                done.add(id(original))
                _put_back(original, current.detach(), dtype, self.kept.get(id(original)))
            # Under fake tensors cast_module replaced the objects: the originals go back.
            table[key] = original
        self.slots, self.kept = [], {}


def _put_back(
    original: torch.Tensor, value: torch.Tensor, dtype: torch.dtype, kept: torch.Tensor | None
) -> None:
    restored = value.to(dtype)
    if kept is not None:
        kept = kept.to(value.device)
        # Elements training left alone are still the bf16 rounding of the original: those
        # get the original back bit for bit; the others their current value.
        restored = torch.where(value == kept.to(value.dtype), kept, restored)
    if restored.dtype != original.dtype and isinstance(original, nn.Parameter):
        original.grad = None  # a gradient must have its parameter's dtype
    original.data = restored


class _Bf16StepContext:
    def __init__(self, raw_step: Any, stochastic: bool, seed: int | None, chunk_numel: int) -> None:
        self.raw_step = raw_step
        self.stochastic = stochastic
        self.seed = seed if seed is not None else (torch.initial_seed() + 0x5EED) % (2**63)
        self.chunk_numel = chunk_numel
        self.generators: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator | None:
        if not self.stochastic:
            return None
        gen = self.generators.get(device)
        if gen is None:
            try:
                gen = torch.Generator(device=device)
            except RuntimeError:  # a device without generators (meta): use the global one
                return None
            gen.manual_seed(self.seed)
            self.generators[device] = gen
        return gen

    def to_bf16(self, x: torch.Tensor) -> torch.Tensor:
        if self.stochastic:
            return stochastic_round_to_bf16(x, self.generator(x.device))
        return x.to(torch.bfloat16)


def _bf16_step(self: torch.optim.Optimizer, closure: Any = None) -> Any:
    ctx: _Bf16StepContext = self._memfit_bf16  # type: ignore[attr-defined]
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
    low = [p for p in params if p.dtype == torch.bfloat16]
    if len(low) < len(params):
        # Parameters not in bf16 are stepped by the optimizer as they are, all at once.
        with _only(self, [p for p in params if p.dtype != torch.bfloat16]):
            ctx.raw_step(self)
    for chunk in _chunks(low, ctx.chunk_numel):
        with _only(self, chunk), _fp32_view(self, chunk, ctx):
            ctx.raw_step(self)
    return loss


def _chunks(params: list[torch.Tensor], limit: int) -> Iterator[list[torch.Tensor]]:
    chunk: list[torch.Tensor] = []
    size = 0
    for p in params:
        if chunk and size + p.numel() > limit:
            yield chunk
            chunk, size = [], 0
        chunk.append(p)
        size += p.numel()
    if chunk:
        yield chunk


@contextlib.contextmanager
def _only(optimizer: torch.optim.Optimizer, chunk: list[torch.Tensor]) -> Iterator[None]:
    """Hide the gradients of every parameter outside ``chunk`` (optimizers skip those)."""
    keep = {id(p) for p in chunk}
    hidden = []
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) not in keep and p.grad is not None:
                hidden.append((p, p.grad))
                p.grad = None
    try:
        yield
    finally:
        for p, grad in hidden:
            p.grad = grad


@contextlib.contextmanager
def _fp32_view(
    optimizer: torch.optim.Optimizer, chunk: list[torch.Tensor], ctx: _Bf16StepContext
) -> Iterator[None]:
    """Give ``chunk`` fp32 weights, gradients and state; write them back to bf16 after."""
    saved = []
    for p in chunk:
        weight16, grad16 = p.data, p.grad
        state = optimizer.state.get(p, {})
        moments = [
            k
            for k, v in state.items()
            if isinstance(v, torch.Tensor) and v.is_floating_point() and _moment_like(v, p)
        ]
        for k in moments:
            state[k] = state[k].float()
        p.grad = None  # a gradient must match its parameter's dtype: swap the data first
        p.data = weight16.float()
        p.grad = grad16.float()
        saved.append((p, weight16, grad16))
    try:
        yield
    finally:
        for p, weight16, grad16 in saved:
            weight16.copy_(ctx.to_bf16(p.data))
            p.grad = None
            p.data = weight16
            p.grad = grad16
            state = optimizer.state.get(p, {})
            for k, v in list(state.items()):
                # Moments created during this step (first step) are fp32 too: store in bf16.
                if isinstance(v, torch.Tensor) and v.dtype == torch.float32 and _moment_like(v, p):
                    state[k] = ctx.to_bf16(v)


def _moment_like(v: torch.Tensor, p: torch.Tensor) -> bool:
    # State shaped like its parameter is per-element (a moment): store it in bf16. A scalar
    # parameter is skipped, since its ``step`` counter would look the same and must stay exact.
    return p.dim() > 0 and v.shape == p.shape


# ---------------------------------------------------------------------------------- casting
def cast_module(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast ``module``'s floating parameters and buffers to ``dtype`` in place.

    ``module.to(dtype)``, except under ``FakeTensorMode`` (and with other tensor subclasses),
    where ``Module._apply`` refuses to swap parameters ("Couldn't swap"): then each parameter
    and buffer is replaced one by one (same ``requires_grad``; tied weights stay tied).

    Returns:
        ``module``.
    """
    try:
        return module.to(dtype)
    except RuntimeError as e:
        if "swap" not in str(e):
            raise
    done: dict[int, Any] = {}
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if id(p) not in done and (p is None or not p.is_floating_point() or p.dtype == dtype):
                continue  # (a tied parameter met again is already cast: replaced below too)
            if id(p) not in done:
                done[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
                # The replaced object lets go of its old storage (a caller may keep the object
                # to put it back), as module.to(dtype) frees it in a real run.
                p.data = done[id(p)].data
            mod._parameters[name] = done[id(p)]
        for name, b in list(mod._buffers.items()):
            if id(b) not in done and (b is None or not b.is_floating_point() or b.dtype == dtype):
                continue
            if id(b) not in done:
                done[id(b)] = b.to(dtype)
                b.data = done[id(b)]
            mod._buffers[name] = done[id(b)]
    return module


def _cast_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    # Floating inputs (features, inputs_embeds) must match bf16 weights; ids and masks of
    # integer dtype are left alone. torch's pytree walks the containers it knows (dicts,
    # lists, tuples, named tuples, Hugging Face model outputs); other objects (a KV cache)
    # are leaves and pass unchanged.
    def cast(x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16) if x.is_floating_point() else x

    return tree_map_only(torch.Tensor, cast, (args, kwargs))


def _device_type(model: nn.Module) -> str:
    for p in model.parameters():
        return p.device.type
    for b in model.buffers():
        return b.device.type
    return "cpu"


def apply_precision(
    model: nn.Module, config: PrecisionConfig, *, keep_original_weights: bool = False
) -> PrecisionRuntime:
    """Set ``model`` up for ``config.mode`` and return the runtime that drives its steps.

    Only ``bf16-pure`` and ``fp8`` change the model. ``bf16-pure``: its floating parameters
    and buffers are cast to bf16 (:func:`cast_module`), and a forward pre-hook casts floating
    inputs to bf16 (integer inputs such as token ids are untouched). ``fp8``: its eligible
    linears become torchao's float8 linears (:func:`memfit.strategies.fp8.apply_fp8`). The
    other modes act through the runtime alone.
    The runtime's :meth:`~PrecisionRuntime.remove` undoes it (see the module docstring for
    which values come back exactly).

    Args:
        model: The model (its device picks the autocast device type).
        config: The precision config.
        keep_original_weights: For ``bf16-pure``: keep the original floating tensors on the
            host, so that ``remove()`` gives back, bit for bit, every element that training did
            not change (all of them right after this call). Costs their size in host memory.

    Returns:
        The :class:`PrecisionRuntime` for the mode (also the handle that undoes it).

    Raises:
        ValueError: for an unknown mode.
    """
    factory = _RUNTIMES.get(config.mode)
    if factory is None:
        raise ValueError(
            f"precision {config.mode!r} is not known; use one of {', '.join(_RUNTIMES)}"
        )
    return factory(model, config, keep_original_weights)


def _fp32(model: nn.Module, config: PrecisionConfig, keep: bool) -> PrecisionRuntime:
    return PrecisionRuntime(_device_type(model))


def _bf16_mixed(model: nn.Module, config: PrecisionConfig, keep: bool) -> PrecisionRuntime:
    return MixedRuntime(_device_type(model), torch.bfloat16)


def _fp16_mixed(model: nn.Module, config: PrecisionConfig, keep: bool) -> PrecisionRuntime:
    scaler = DynamicLossScaler(
        init_scale=config.init_scale,
        growth_factor=config.growth_factor,
        backoff_factor=config.backoff_factor,
        growth_interval=config.growth_interval,
    )
    return Fp16MixedRuntime(_device_type(model), scaler)


def _bf16_pure(model: nn.Module, config: PrecisionConfig, keep: bool) -> PrecisionRuntime:
    if model.__dict__.get("_memfit_bf16_inputs") is not None:
        raise RuntimeError(
            f"{type(model).__name__} is already in bf16-pure precision; call remove() on the "
            "runtime apply_precision returned before applying precision again"
        )
    restore = _Restore(model, keep)
    cast_module(model, torch.bfloat16)
    restore.hook = model.register_forward_pre_hook(_cast_inputs, with_kwargs=True)
    model.__dict__["_memfit_bf16_inputs"] = restore.hook
    return Bf16PureRuntime(
        _device_type(model), stochastic_rounding=config.stochastic_rounding, restore=restore
    )


def _fp8(model: nn.Module, config: PrecisionConfig, keep: bool) -> PrecisionRuntime:
    from .fp8 import apply_fp8

    return Fp8Runtime(_device_type(model), apply_fp8(model))


_RUNTIMES = {
    "fp32": _fp32,
    "bf16-mixed": _bf16_mixed,
    "fp16-mixed": _fp16_mixed,
    "bf16-pure": _bf16_pure,
    "fp8": _fp8,
}


def _apply_technique(model: nn.Module, ctx: ApplyContext) -> PrecisionRuntime | None:
    mode = ctx.plan.precision.mode
    if ctx.engine == "lightning" and mode != "bf16-pure":
        return None  # Lightning's own precision plugin autocasts; nothing on the model
    runtime = apply_precision(
        model, ctx.plan.precision, keep_original_weights=ctx.keep_original_weights
    )
    ctx.precision = runtime
    return runtime


_FP32_WEIGHTS = frozenset({"fp32", "bf16-mixed", "fp16-mixed"})


def _swappable(old: Any, new: Any) -> bool:
    # Precisions that keep fp32 weights differ only in the runtime (autocast, loss scaling),
    # so the optimizer and its state carry over between them.
    return {old.precision.mode, new.precision.mode} <= _FP32_WEIGHTS


def _layout_refusal(plan: Any, engine: str) -> str | None:
    if engine == "layout" and plan.precision.mode not in ("fp32", "bf16-mixed"):
        return f"precision {plan.precision.mode!r} is not built by a tensor/pipeline layout"
    if engine in ("hf", "lightning") and plan.precision.mode == "fp8":
        # Their own precision settings autocast but know nothing of the float8 linears.
        return (
            "precision 'fp8' is applied by memfit's own loop (memfit train, apply_plan), not "
            "through the Hugging Face Trainer's or Lightning's precision settings; use "
            "bf16-mixed there"
        )
    return None


#: Precision applies after the fused forwards and before checkpointing, which then wraps
#: blocks of the final dtypes. Always on: fp32 is a precision too (its runtime is a no-op).
def _matmul_slowdown(plan: Any) -> float:
    """Eager fp8's measured slowdown of the matmuls (its casts); 1 otherwise."""
    from .fp8 import FP8_EAGER_SLOWDOWN

    if plan.precision.mode == "fp8" and plan.compile_backend is None:
        return FP8_EAGER_SLOWDOWN
    return 1.0


TECHNIQUE = Technique(
    name="precision",
    engines=frozenset(ENGINES),  # the tensor/pipeline path builds it too
    plan_field="precision",
    order=40,
    is_on=lambda plan: True,
    apply=_apply_technique,
    refusal=_layout_refusal,
    label=lambda plan: f"precision {plan.precision.mode!r}",
    swappable=_swappable,
    allow={
        "bf16-pure": "bf16 weights and optimizer math with stochastic rounding",
        "fp8": "float8 matmuls in the linears (torchao; GPUs of compute capability 8.9+)",
    },
    forbid={"mixed-precision": "bf16/fp16 autocast"},
    summary=lambda config: config.mode,
    matmul_slowdown=_matmul_slowdown,
)
