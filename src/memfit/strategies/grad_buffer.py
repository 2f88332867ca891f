"""ZeRO-R's contiguous gradients: every ``.grad`` a view into one pre-allocated flat buffer.

:func:`apply_grad_buffer` allocates, per dtype and device, one flat buffer holding the
gradients of all trainable parameters (in registration order, each start aligned to
:data:`ALIGN_BYTES`), and points each parameter's ``.grad`` at its slice. Autograd's
``AccumulateGrad`` adds into an existing ``.grad`` in place (``grad += new``, when the
gradient is not itself differentiated, i.e. without ``create_graph``), so backward writes the
gradients into the buffer and a training step allocates no gradient tensor: no
gradient-sized blocks are freed and allocated again each step, so the caching allocator's
gradient memory cannot fragment. What a backward op returns before it is added (one
gradient's bytes at a time) is still a temporary, as in the plain computation.

Cost: the buffer lives for the whole run. Plain training with ``zero_grad(set_to_none=True)``
frees the gradients after each step, so during the forward (and early backward) a run with the
buffer holds up to the gradient bytes more; at the optimizer step both hold every gradient.
Time: one fill of the buffer per step (instead of nothing), no extra compute.

**Zeroing.** A torch optimizer's ``zero_grad(set_to_none=True)`` (what
:class:`~memfit.apply.stepper.PlainStepper` calls) sets every ``.grad`` to ``None``,
which drops the views. The handle therefore re-attaches them before the next forward (a
forward pre-hook on the model, only when gradients are enabled): a parameter whose ``.grad``
is ``None`` gets its view back, zeroed (one fill per buffer when all were dropped). A loop of
one's own may instead call :meth:`GradBufferHandle.zero_grad` (zero the buffers in place, keep
the views) or, when its backward does not go through ``model(...)``,
:meth:`GradBufferHandle.attach` before backward. A ``.grad`` that is neither ``None`` nor the
view (assigned by hand) is left alone.

**Parameters without a gradient.** A parameter that backward does not reach has a zero view
as ``.grad``, where plain training would have ``None``, and a torch optimizer skips only
``None``. So that AdamW's weight decay and moments do not move such a parameter, a global
optimizer step pre-hook sets ``.grad`` back to ``None`` for every buffered parameter of the
stepping optimizer that no backward reached since its view was attached (tracked with
post-accumulate-grad hooks). Numerics therefore equal plain training exactly.

Not combined (the plan refuses them): ``optimizer_in_backward`` (it frees each gradient after
its update, so gradients never all exist and a buffer would only hold memory) and optimizer
offload (gradients leave the device in ``bucket_bytes`` buckets; holding them all on the
device would undo its saving).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from ..techniques import ApplyContext, Technique

__all__ = ["ALIGN_BYTES", "GradBufferHandle", "apply_grad_buffer"]

#: Each view starts at a multiple of this many bytes of its buffer, so vectorised kernels
#: (16-byte loads and stores on CUDA) see aligned gradients.
ALIGN_BYTES = 16


def _aligned(numel: int, element_size: int) -> int:
    """``numel`` rounded up to whole :data:`ALIGN_BYTES` (in elements)."""
    step = max(1, ALIGN_BYTES // element_size)
    return -(-numel // step) * step


def _view(flat: torch.Tensor, offset: int, p: torch.Tensor) -> torch.Tensor:
    """The slice of ``flat`` at ``offset`` shaped like ``p``, with ``p``'s strides when ``p``
    is dense and non-overlapping (autograd's layout contract for gradients), else
    contiguous."""
    n = p.numel()
    if p.is_contiguous() or not _dense(p):
        return flat[offset : offset + n].view(p.shape)
    return flat.as_strided(p.shape, p.stride(), flat.storage_offset() + offset)


def _dense(p: torch.Tensor) -> bool:
    """Whether ``p``'s strides cover exactly ``numel`` elements without overlap."""
    dims = sorted((s, n) for s, n in zip(p.stride(), p.shape, strict=True) if n > 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


class GradBufferHandle:
    """The gradient buffers of :func:`apply_grad_buffer`; :meth:`remove` restores plain
    gradients.

    Attributes:
        buffers: ``(dtype, device) -> flat buffer``, one per dtype and device of the trainable
            parameters.
        params: The buffered parameters, in registration order.
        views: Each parameter's view into its buffer (same order as ``params``).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        # model.parameters() yields a tied parameter once: it gets one view.
        self.params: list[nn.Parameter] = [p for p in model.parameters() if p.requires_grad]
        sizes: dict[tuple[torch.dtype, torch.device], int] = {}
        offsets: list[int] = []
        for p in self.params:
            key = (p.dtype, p.device)
            offsets.append(sizes.get(key, 0))
            sizes[key] = offsets[-1] + _aligned(p.numel(), p.element_size())
        self.buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {
            key: torch.zeros(n, dtype=key[0], device=key[1]) for key, n in sizes.items()
        }
        self.views: list[torch.Tensor] = [
            _view(self.buffers[(p.dtype, p.device)], off, p)
            for p, off in zip(self.params, offsets, strict=True)
        ]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._touched = [False] * len(self.params)
        # Gradients the parameters already had are kept: copied into their views.
        for i, (p, v) in enumerate(zip(self.params, self.views, strict=True)):
            if p.grad is not None:
                v.copy_(p.grad)
                self._touched[i] = True
            p.grad = v
        self._hooks: list[Any] = [model.register_forward_pre_hook(self._before_forward)]
        for i, p in enumerate(self.params):
            self._hooks.append(p.register_post_accumulate_grad_hook(self._reached(i)))
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        # A global hook: held weakly, so that a handle (and its model) nobody removed can
        # still be collected; it then does nothing.
        self._hooks.append(register_optimizer_step_pre_hook(_weak_step_hook(self)))
        self.removed = False

    # ------------------------------------------------------------------ public
    @property
    def nbytes(self) -> int:
        """Bytes of all buffers (the gradients plus alignment padding)."""
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def reallocate(self) -> None:
        """Move every gradient into new buffers (values kept), then let the old ones go: for
        a moment both exist. That is what DDP does once, at the first forward after the first
        synchronised backward, when it rebuilds its buckets in the order gradients became
        ready; memfit's dry run of DDP, which this buffer stands in for, calls it there."""
        old = self.buffers
        self.buffers = {key: b.clone() for key, b in old.items()}
        for i, p in enumerate(self.params):
            view = _view(self.buffers[(p.dtype, p.device)], self.views[i].storage_offset(), p)
            if p.grad is self.views[i]:
                p.grad = view
            self.views[i] = view
        del old

    def attach(self) -> int:
        """Point every buffered parameter whose ``.grad`` is ``None`` at its view, zeroed.

        Returns:
            How many views were attached.
        """
        missing = [i for i, p in enumerate(self.params) if p.grad is None]
        if not missing:
            return 0
        if len(missing) == len(self.params):
            for b in self.buffers.values():  # one fill per buffer instead of one per view
                b.zero_()
        else:
            for i in missing:
                self.views[i].zero_()
        for i in missing:
            self.params[i].grad = self.views[i]
            self._touched[i] = False
        return len(missing)

    def zero_grad(self) -> None:
        """Zero the buffers in place and (re-)attach every view: the gradient memory stays."""
        for b in self.buffers.values():
            b.zero_()
        for i, (p, v) in enumerate(zip(self.params, self.views, strict=True)):
            if p.grad is None or p.grad is v:
                p.grad = v
                self._touched[i] = False

    def remove(self) -> None:
        """Give every parameter a plain gradient again: a gradient backward has written is
        copied out of the buffer; a view no backward reached (zeros) becomes ``None``. Drops
        the hooks and the buffers. Idempotent."""
        if self.removed:
            return
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for i, (p, v) in enumerate(zip(self.params, self.views, strict=True)):
            if p.grad is v:
                p.grad = v.clone() if self._touched[i] else None
        self.views.clear()
        self.buffers.clear()
        self.removed = True

    # ------------------------------------------------------------------ hooks
    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            self.attach()

    def _reached(self, i: int) -> Any:
        # The hook holds the flags, not the handle: autograd keeps tensor hooks from C++,
        # where the garbage collector cannot see a cycle back to the model.
        touched = self._touched

        def hook(p: torch.Tensor) -> None:
            touched[i] = True

        return hook

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # A torch optimizer skips a parameter whose grad is None, not one whose grad is zero:
        # hide the views no backward reached so that the step equals plain training's.
        index = self._index
        for group in getattr(optimizer, "param_groups", ()):
            for p in group["params"]:
                i = index.get(id(p))
                if i is not None and not self._touched[i] and p.grad is self.views[i]:
                    p.grad = None


def _weak_step_hook(handle: GradBufferHandle) -> Any:
    ref = weakref.ref(handle)

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        live = ref()
        if live is not None:
            live._before_step(optimizer, args, kwargs)

    return hook


def apply_grad_buffer(model: nn.Module, config: Any = True) -> GradBufferHandle:
    """Keep the gradients of ``model``'s trainable parameters in contiguous buffers.

    Apply it after everything that changes parameters' dtypes or ``requires_grad``
    (freezing, precision): the buffers are laid out from the parameters as they are now.

    Args:
        model: The model; its trainable parameters get ``.grad`` views at once (existing
            gradients are copied into the buffer).
        config: The plan's ``grad_buffer`` setting (``True``); present so every technique's
            ``apply`` has the same shape.

    Returns:
        The :class:`GradBufferHandle`.

    Raises:
        ValueError: when the model has no trainable parameter.
    """
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("grad_buffer needs trainable parameters; this model has none")
    return GradBufferHandle(model)


def _apply_technique(model: nn.Module, ctx: ApplyContext) -> GradBufferHandle:
    handle = apply_grad_buffer(model, ctx.plan.grad_buffer)
    ctx.info["grad_buffer_bytes"] = handle.nbytes
    return handle


def _refusal(plan: Any, engine: str) -> str | None:
    if engine == "lightning":
        return (
            "grad_buffer is not applied by the Lightning callback (Lightning's loop owns the "
            "optimizer step and zero_grad, which the buffer must follow); set grad_buffer false"
        )
    return None


#: After precision and freezing: it sees the final dtypes and the trainable set. Not in a
#: lightning.Trainer, whose optimizer loop memfit's callback does not wrap.
def check_grad_buffer(plan: Any) -> None:
    """The plan rules of ``grad_buffer`` (``Technique.check``).

    Raises:
        ValueError: one sentence, for a value that is not a bool, or a buffer beside the fused
            step or optimizer offload (each frees or moves gradients as they land, so a
            buffer of all of them would only add memory).
    """
    if not isinstance(plan.grad_buffer, bool):
        raise ValueError(f"grad_buffer must be true or false, got {plan.grad_buffer!r}")
    if not plan.grad_buffer:
        return
    if plan.parallel.world_size > 1 or plan.parallel.zero_stage:
        raise ValueError(
            "grad_buffer cannot be combined with data parallelism: DDP already keeps "
            "gradients as views into its contiguous buckets and FSDP2 shards them; set "
            "grad_buffer false"
        )
    if plan.optimizer_in_backward:
        raise ValueError(
            "grad_buffer cannot be combined with optimizer_in_backward: the fused step frees "
            "each gradient after its update, so a buffer of all gradients would only add "
            "memory; set one of them false"
        )
    if plan.offload is not None and plan.offload.optimizer is not None:
        raise ValueError(
            "grad_buffer cannot be combined with optimizer offload: gradients leave the "
            "device in offload bucket_bytes buckets, and a device buffer of all of them "
            "would undo that saving; set grad_buffer false"
        )


TECHNIQUE = Technique(
    name="grad_buffer",
    plan_field="grad_buffer",
    order=100,
    apply=_apply_technique,
    info_key="grad_buffer_bytes",
    engines=frozenset({"single", "hf"}),
    refusal=_refusal,
    summary=lambda _: "contiguous gradient buffer",
    check=check_grad_buffer,
)
