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
=============  ===================  =======================  ==============================

``bf16-pure`` casts the model to bf16 and wraps the optimizer so each update is computed in
fp32 and written back to the bf16 weights with stochastic rounding (unbiased: an update far
below half a bf16 ulp still moves the weight on average, where round-to-nearest drops it).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from ..device import is_fake
from ..optim.rounding import stochastic_round_to_bf16
from .optimizer import OptimizerConfig

__all__ = [
    "Bf16PureRuntime",
    "DynamicLossScaler",
    "Fp16MixedRuntime",
    "MixedRuntime",
    "PrecisionConfig",
    "PrecisionRuntime",
    "apply_precision",
    "cast_module",
    "remove_precision",
    "stochastic_round_to_bf16",
    "wrap_optimizer_bf16",
]

PrecisionMode = Literal["fp32", "bf16-mixed", "fp16-mixed", "bf16-pure"]


@dataclass(frozen=True)
class PrecisionConfig:
    """Numeric precision of weights, activations and optimizer math.

    Attributes:
        mode: ``fp32`` everything in float32. ``bf16-mixed`` / ``fp16-mixed``: fp32 weights,
            matmuls under autocast; activations saved for backward are half-size (roughly
            halves activation memory, no saving on weights, gradients or state).
            ``bf16-pure``: weights, gradients and optimizer math in bf16: halves parameters,
            gradients and (for Adam-like state) state, with stochastic rounding so small
            updates are not lost.
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


# ---------------------------------------------------------------------------------- scaler
class DynamicLossScaler:
    """Dynamic loss scaling for fp16 training, usable on its own.

    Multiply the loss by :attr:`scale` before backward so small gradients do not flush to
    zero in fp16; before the step, divide the gradients by it and check them: any inf/NaN means
    the scale was too high, so the step is skipped and the scale multiplied by
    ``backoff_factor``; after ``growth_interval`` consecutive good steps the scale is
    multiplied by ``growth_factor``.

    Why not ``torch.amp.GradScaler``: its step reads the overflow flag's value
    (``found_inf.item()``), which a dry run's fake tensors do not have, so a plan with fp16
    could not be dry-run; and clipping must happen between unscaling and the step, which
    GradScaler leaves to the caller. This scaler uses the same fused ATen kernels
    (``_amp_foreach_non_finite_check_and_unscale_``) and follows GradScaler's growth and
    backoff rules, with clipping built in.

    Example::

        scaler = DynamicLossScaler()
        scaler.scale_loss(loss).backward()
        stepped = scaler.step(optimizer, max_grad_norm=1.0)

    Args:
        init_scale: The first scale.
        growth_factor: Scale multiplier after ``growth_interval`` good steps (> 1).
        backoff_factor: Scale multiplier after an overflow (in (0, 1)).
        growth_interval: Consecutive good steps before growing.
        min_scale: The scale never goes below this.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 2.0**-24,
    ) -> None:
        if not init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {init_scale!r}")
        if not growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor!r}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
        if not (isinstance(growth_interval, int) and growth_interval >= 1):
            raise ValueError(
                f"growth_interval must be a whole number >= 1, got {growth_interval!r}"
            )
        self.scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.min_scale = float(min_scale)
        self.good_steps = 0
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` (call ``.backward()`` on the result)."""
        return loss * self.scale

    def unscale_(self, params: Iterable[torch.Tensor]) -> bool:
        """Divide the gradients of ``params`` by the scale in place.

        Returns:
            Whether any gradient holds an inf or NaN.
        """
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return False
        inv = 1.0 / self.scale
        found = False
        for group in _by_device_dtype(grads):
            flag = torch.zeros((), dtype=torch.float32, device=group[0].device)
            try:
                # The fused op GradScaler uses: one kernel unscales and checks every tensor.
                torch._amp_foreach_non_finite_check_and_unscale_(
                    group, flag, torch.full((), inv, dtype=torch.float32, device=flag.device)
                )
            except (RuntimeError, NotImplementedError):
                for g in group:
                    g.mul_(inv)
                    flag += (~torch.isfinite(g)).any()
            if is_fake(flag):
                # A dry run has no values: it steps as if the gradients were finite, which is
                # the memory path that matters (a skipped step allocates less).
                continue
            found = found or bool(flag.item())
        return found

    def update(self, found_inf: bool) -> None:
        """Back off after an overflow; grow after ``growth_interval`` good steps in a row."""
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def step(self, optimizer: Any, max_grad_norm: float | None = None) -> bool:
        """Unscale, check, clip and step ``optimizer``, then update the scale.

        Returns:
            Whether the optimizer stepped (``False``: gradients overflowed, step skipped).
        """
        params = _optimizer_params(optimizer)
        found_inf = self.unscale_(params)
        if not found_inf:
            _clip(params, max_grad_norm)
            optimizer.step()
        self.update(found_inf)
        return not found_inf

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state, for checkpoints."""
        return {
            "scale": self.scale,
            "good_steps": self.good_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


def _by_device_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[tuple[Any, Any], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


def _optimizer_params(optimizer: Any) -> list[torch.Tensor]:
    groups = getattr(optimizer, "param_groups", None)
    if groups is None:
        # An optimizer-in-backward handle or similar: its optimizers' parameters.
        return [p for opt in getattr(optimizer, "optimizers", ()) for p in _optimizer_params(opt)]
    return [p for g in groups for p in g["params"]]


def _clip(params: list[torch.Tensor], max_grad_norm: float | None) -> None:
    if max_grad_norm is None:
        return
    with_grad = [p for p in params if p.grad is not None]
    if with_grad:
        torch.nn.utils.clip_grad_norm_(with_grad, max_grad_norm)


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
        _clip(_optimizer_params(optimizer), max_grad_norm)
        optimizer.step()
        return True

    def optimizer_config(self, cfg: OptimizerConfig) -> OptimizerConfig:
        """The optimizer config this mode needs (unchanged in every built-in mode)."""
        return cfg

    def wrap_optimizer(self, optimizer: Any) -> Any:
        """The optimizer this mode steps (unchanged unless the mode needs it)."""
        return optimizer

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


class Bf16PureRuntime(PrecisionRuntime):
    """``bf16-pure``: bf16 weights and gradients, fp32 update math, stochastic write-back.

    Args:
        device_type: The model's device type.
        stochastic_rounding: Write updated weights back with :func:`stochastic_round_to_bf16`
            (else round to nearest, which drops updates below half an ulp).
        seed: Seed of the rounding's own generator (the global RNG, which dropout uses, is
            left alone). Default: derived from ``torch.initial_seed()``.
        chunk_numel: Parameters per fp32 chunk of the step (see :func:`wrap_optimizer_bf16`).
    """

    mode = "bf16-pure"

    def __init__(
        self,
        device_type: str = "cpu",
        stochastic_rounding: bool = True,
        seed: int | None = None,
        chunk_numel: int = 1 << 20,
    ) -> None:
        super().__init__(device_type)
        self.stochastic_rounding = stochastic_rounding
        self.seed = seed
        self.chunk_numel = chunk_numel

    def wrap_optimizer(self, optimizer: Any) -> Any:
        return wrap_optimizer_bf16(
            optimizer,
            stochastic_rounding=self.stochastic_rounding,
            seed=self.seed,
            chunk_numel=self.chunk_numel,
        )

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
            if p is None or not p.is_floating_point() or p.dtype == dtype:
                continue
            if id(p) not in done:
                done[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
            mod._parameters[name] = done[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is None or not b.is_floating_point() or b.dtype == dtype:
                continue
            if id(b) not in done:
                done[id(b)] = b.to(dtype)
            mod._buffers[name] = done[id(b)]
    return module


def _cast_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    # Floating inputs (features, inputs_embeds) must match bf16 weights; ids and masks of
    # integer dtype are left alone.
    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.bfloat16:
            return x.to(torch.bfloat16)
        if isinstance(x, (list, tuple)) and type(x) in (list, tuple):
            return type(x)(cast(v) for v in x)
        if isinstance(x, dict):
            return {k: cast(v) for k, v in x.items()}
        return x

    return cast(args), cast(kwargs)


def _device_type(model: nn.Module) -> str:
    for p in model.parameters():
        return p.device.type
    for b in model.buffers():
        return b.device.type
    return "cpu"


def apply_precision(model: nn.Module, config: PrecisionConfig) -> PrecisionRuntime:
    """Set ``model`` up for ``config.mode`` and return the runtime that drives its steps.

    Only ``bf16-pure`` changes the model: its floating parameters and buffers are cast to
    bf16 (:func:`cast_module`), and a forward pre-hook casts floating inputs to bf16 (integer
    inputs such as token ids are untouched). The other modes act through the runtime alone.

    Args:
        model: The model (its device picks the autocast device type).
        config: The precision config.

    Returns:
        The :class:`PrecisionRuntime` for the mode.

    Raises:
        ValueError: for an unknown mode.
    """
    factory = _RUNTIMES.get(config.mode)
    if factory is None:
        raise ValueError(
            f"precision {config.mode!r} is not known; use one of {', '.join(_RUNTIMES)}"
        )
    return factory(model, config)


def _fp32(model: nn.Module, config: PrecisionConfig) -> PrecisionRuntime:
    return PrecisionRuntime(_device_type(model))


def _bf16_mixed(model: nn.Module, config: PrecisionConfig) -> PrecisionRuntime:
    return MixedRuntime(_device_type(model), torch.bfloat16)


def _fp16_mixed(model: nn.Module, config: PrecisionConfig) -> PrecisionRuntime:
    scaler = DynamicLossScaler(
        init_scale=config.init_scale,
        growth_factor=config.growth_factor,
        backoff_factor=config.backoff_factor,
        growth_interval=config.growth_interval,
    )
    return Fp16MixedRuntime(_device_type(model), scaler)


def _bf16_pure(model: nn.Module, config: PrecisionConfig) -> PrecisionRuntime:
    cast_module(model, torch.bfloat16)
    if model.__dict__.get("_memfit_bf16_inputs") is None:
        handle = model.register_forward_pre_hook(_cast_inputs, with_kwargs=True)
        model.__dict__["_memfit_bf16_inputs"] = handle
    return Bf16PureRuntime(_device_type(model), stochastic_rounding=config.stochastic_rounding)


def remove_precision(model: nn.Module, dtypes: dict[str, torch.dtype]) -> None:
    """Undo :func:`apply_precision` on ``model``: the input-cast hook goes and every parameter
    and buffer gets back the dtype ``dtypes`` names (by qualified name), its current values
    converted (a model trained in bf16 comes back in fp32 with its trained values)."""
    handle = model.__dict__.pop("_memfit_bf16_inputs", None)
    if handle is not None:
        handle.remove()
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    for name, t in named.items():
        dtype = dtypes.get(name)
        if dtype is not None and t.dtype != dtype:
            t.data = t.data.to(dtype)
            if isinstance(t, nn.Parameter):
                t.grad = None


_RUNTIMES = {
    "fp32": _fp32,
    "bf16-mixed": _bf16_mixed,
    "fp16-mixed": _fp16_mixed,
    "bf16-pure": _bf16_pure,
}
