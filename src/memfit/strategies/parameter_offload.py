"""Parameter offload (ZeRO-Infinity on one device): block parameters live on the host.

:func:`apply_parameter_offload` copies the parameters of the model's repeated blocks
(:func:`~memfit.blocks.find_blocks`) into host buffers and releases their device
memory. Each parameter keeps its identity (the ``nn.Parameter`` object and its storage
object): releasing resizes the storage to zero bytes (``untyped_storage().resize_(0)``) and
fetching resizes it back and copies the host values in. So every reference autograd keeps to a
weight (saved for backward, directly or through a saved-tensor hook's alias of its storage)
sees the values again when backward needs them, and optimizers, state dicts and hooks still
find the same tensors.

When a block runs:

* forward: a forward pre-hook fetches the block and prefetches the next one; a forward hook
  releases the block afterwards;
* backward: a gradient hook on the block's outputs (it fires when their gradients are ready,
  before any of the block's backward runs) fetches the block and prefetches the one before it;
  a gradient hook on the block's inputs (all their gradients computed) releases it, and a
  callback at the end of backward releases whatever is still fetched (blocks whose inputs need
  no gradient never fire their input hook).

Starting a block also releases every other fetched block except the one prefetched for it,
so the device holds at most two blocks' parameters (plus the parameters outside the blocks:
embeddings, final norm, head, which stay on the device, as do parameters shared between a
block and anything else, and parameters that do not own their whole storage). With activation
checkpointing the recomputation runs inside the block's backward, after its fetch.

On CUDA the prefetch copies on a side stream (:mod:`memfit.device`): the storage is allocated
on the compute stream, the copy stream waits for the compute stream's work so far, copies
without blocking from pinned memory, and the block's start makes the compute stream wait for
the copy. On the CPU (and under fake tensors) the copies are synchronous but happen at the same
moments, so the tracker measures the same device bytes a GPU run holds. A resize is invisible
to dispatch, so each one is reported to open trackers
(:func:`memfit.accounting.tracker.storage_resized`); the host buffers are allocated inside
:func:`~memfit.accounting.tiers.host_tier` and marked as host memory.

Gradients: without optimizer offload, each offloaded parameter's gradient leaves the device as
soon as it is accumulated (a post-accumulate-grad hook) and accumulates on its host copy's
``.grad``; no device gradient of a block persists. With optimizer offload
(``config.optimizer``), gradients are left to it (it moves them in buckets), and it steps the
host copy itself: :func:`~memfit.strategies.offload.host_copy_of` gives the optimizer the host
copy (the fp32 master when the parameters are fp32), so updated weights land where the next
fetch reads them.

Caveat: a block is released when its inputs' gradients are computed. A block whose backward
needs a parameter's value in a node that does not lead to its inputs (a product of two
parameters only, say) could run that node after the release; transformer blocks have none.

What PyTorch's own FSDP2 lacks for this. ``fully_shard(block,
offload_policy=CPUOffloadPolicy())`` on every block and the root does the same streaming (with
prefetching), and it does run on a one-process gloo group on the CPU (checked with torch 2.13:
forward and backward go through, the gradients land on the CPU). But it needs an initialised
process group, which a single-process trainer does not own; it turns every parameter into a
``DTensor`` and swaps the module classes, so memfit's optimizers (8-bit states, Adafactor's
factored rows), precision wrappers and checkpoints meet DTensors, and the model cannot be given
back (memfit's techniques are removable); with the policy the optimizer state and step always
go to the host together with the parameters, over FSDP's own parameter layout (no bucketed
gradient moves or host accumulation across micro-batches as in memfit's optimizer offload); it
has no disk tier; and its host buffers are not marked as host memory, so on a CPU-only machine
memfit's tracker counts them as device bytes. So this module streams the parameters itself, on
the same idea (storages resized to zero between uses, as FSDP2 does with its unsharded
parameters).

Under fake tensors (a dry run) storage resizes work the same, so the planner can measure the
device saving.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

# The module itself, not the top package (memfit/__init__), nor its names: a test stands in for
# CUDA by replacing device functions, which calls through ``dev.`` then reach.
import memfit.device as dev

from ..accounting.tiers import host_tier, mark_host
from ..accounting.tracker import label_open, storage_resized
from ..blocks import find_blocks
from ..techniques import ApplyContext, Technique
from .offload import OffloadConfig, offload_refusal, set_host_copy

__all__ = ["ParameterOffloadHandle", "apply_parameter_offload"]

_ATTR = "_memfit_parameter_offload"


class _Block:
    """One block's offloaded parameters and their host copies."""

    def __init__(self, name: str, module: nn.Module, params: list[nn.Parameter]) -> None:
        self.name = name
        self.module = module
        self.params = params
        self.host: list[torch.Tensor] = []
        self.fetched = True  # the parameters start on the device
        self.event: Any = None  # the prefetch's copy event (CUDA)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)


class ParameterOffloadHandle:
    """Parameter offload applied to a model; :meth:`remove` puts the parameters back.

    Attributes:
        blocks: Qualified names of the blocks whose parameters stream.
        offloaded_bytes: Bytes of parameters kept on the host.
        kept: Qualified names of block parameters that stay on the device (shared with
            another module, or not owning their whole storage).
        fetches: Block fetches so far (prefetches included), for tests and reports.
    """

    def __init__(self, model: nn.Module, config: OffloadConfig) -> None:
        self.model = model
        self.config = config
        self._blocks = _offloadable(model)
        self.blocks = [b.name for b in self._blocks]
        self.kept: list[str] = []
        self.fetches = 0
        self._hooks: list[Any] = []
        self._device: torch.device | None = None
        self._stream: Any = None
        self._callback_task = -1  # the backward whose end callback is queued
        self._move_grads = config.optimizer is None
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        shared = _shared(model, self._blocks)
        for block in self._blocks:
            own = [p for p in block.params if id(p) not in shared and _owns_storage(p)]
            ids = {id(p) for p in own}
            self.kept += [names[id(p)] for p in block.params if id(p) not in ids]
            block.params = own
        self.offloaded_bytes = sum(b.nbytes for b in self._blocks)
        params = [p for b in self._blocks for p in b.params]
        # Fake tensors (a dry run) get no stream and no pinning: no real memory behind them.
        self._pin = config.pin_memory and not (params and dev.is_fake(params[0]))
        if params:
            self._device = params[0].device
            self._stream = dev.copy_stream(self._device) if self._pin else None
        with host_tier(), torch.no_grad():
            for block in self._blocks:
                block.host = [
                    dev.host_buffer(p.shape, p.dtype, pin=self._pin).copy_(p.detach())
                    for p in block.params
                ]
                mark_host(block.host, category="parameters")
                label_open(block.host, "parameters")
                for p, h in zip(block.params, block.host, strict=True):
                    set_host_copy(p, h)
        for block in self._blocks:
            self._release(block)
        for i, block in enumerate(self._blocks):
            m = block.module
            self._hooks.append(m.register_forward_pre_hook(
                lambda mod, args, kwargs, i=i: self._pre_forward(i, args, kwargs),
                with_kwargs=True))  # fmt: skip
            self._hooks.append(m.register_forward_hook(
                lambda mod, args, out, i=i: self._post_forward(i, out), always_call=True))  # fmt: skip
        for i, block in enumerate(self._blocks):
            m = block.module
            self._hooks.append(m.register_state_dict_post_hook(
                lambda mod, sd, prefix, meta, i=i: self._state_dict(i, mod, sd, prefix)))
            self._hooks.append(m.register_load_state_dict_pre_hook(
                lambda mod, *args, i=i: self._begin_load(i)))
            self._hooks.append(m.register_load_state_dict_post_hook(
                lambda mod, keys, i=i: self._end_load(i)))  # fmt: skip
        if self._move_grads:
            for block in self._blocks:
                for p, h in zip(block.params, block.host, strict=True):
                    if p.requires_grad:
                        self._hooks.append(p.register_post_accumulate_grad_hook(
                            lambda p, h=h: self._grad_to_host(p, h)))  # fmt: skip
        setattr(model, _ATTR, self)

    # ------------------------------------------------------------------ fetch and release
    def _fetch(self, i: int) -> None:
        """Bring block ``i``'s parameters to the device (on the copy stream on CUDA)."""
        block = self._blocks[i]
        if block.fetched:
            return
        with torch.no_grad():
            for p in block.params:
                p.untyped_storage().resize_(p.numel() * p.element_size())
            storage_resized(block.params)
            dev.stream_ready(self._stream, self._device)  # freed memory reused only when free
            with dev.on_stream(self._stream):
                for p, h in zip(block.params, block.host, strict=True):
                    # Through .data: a copy that does not bump the version autograd checks.
                    p.data.copy_(h, non_blocking=self._stream is not None)
            block.event = dev.record_event(self._stream)
        block.fetched = True
        self.fetches += 1

    def _release(self, i_or_block: int | _Block) -> None:
        block = self._blocks[i_or_block] if isinstance(i_or_block, int) else i_or_block
        if not block.fetched:
            return
        self._ready(block)  # a prefetch must land before its memory can be given back
        for p in block.params:
            p.untyped_storage().resize_(0)
        storage_resized(block.params)
        block.fetched = False

    def _ready(self, block: _Block) -> None:
        if block.event is not None:
            dev.wait_for(block.event, self._device)  # type: ignore[arg-type]
            block.event = None

    def _begin(self, i: int, following: int | None) -> None:
        """Block ``i`` is about to run; ``following`` runs after it (prefetched now)."""
        keep = {i, following}
        for j, block in enumerate(self._blocks):
            if j not in keep:
                self._release(block)
        self._fetch(i)
        self._ready(self._blocks[i])
        if following is not None:
            self._fetch(following)

    # ------------------------------------------------------------------ hooks
    def _pre_forward(self, i: int, args: Any, kwargs: Any) -> None:
        self._begin(i, i + 1 if i + 1 < len(self._blocks) else None)
        if torch.is_grad_enabled():
            inputs = [t for t in tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor) and t.requires_grad]  # fmt: skip
            if inputs:
                torch.autograd.graph.register_multi_grad_hook(
                    inputs, lambda grads, i=i: self._release(i), mode="all"
                )

    def _post_forward(self, i: int, output: Any) -> None:
        self._release(i)
        if torch.is_grad_enabled():
            outputs = [t for t in tree_leaves(output)
                       if isinstance(t, torch.Tensor) and t.requires_grad]  # fmt: skip
            if outputs:
                torch.autograd.graph.register_multi_grad_hook(
                    outputs, lambda grads, i=i: self._pre_backward(i), mode="any"
                )

    def _pre_backward(self, i: int) -> None:
        task = torch._C._current_graph_task_id()
        if task != self._callback_task:
            # Once per backward (a backward that raised never ran its callback: the next
            # backward has another task id and queues its own).
            self._callback_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self._begin(i, i - 1 if i > 0 else None)

    def _end_backward(self) -> None:
        self._callback_task = -1
        for block in self._blocks:
            self._release(block)

    def _state_dict(self, i: int, module: nn.Module, state: dict, prefix: str) -> None:
        # A released parameter has no values on the device: a state dict gets the host copy
        # (a CPU tensor; loading it into a model on the device copies it there).
        offloaded = {id(p): h for p, h in zip(self._blocks[i].params, self._blocks[i].host,
                                             strict=True)}  # fmt: skip
        for name, p in module.named_parameters():
            if id(p) in offloaded and prefix + name in state:
                state[prefix + name] = offloaded[id(p)]

    def _begin_load(self, i: int) -> None:
        self._fetch(i)  # load_state_dict copies into the device parameters
        self._ready(self._blocks[i])

    def _end_load(self, i: int) -> None:
        block = self._blocks[i]
        with torch.no_grad():
            for p, h in zip(block.params, block.host, strict=True):
                h.copy_(p.detach())
        self._release(block)

    def _grad_to_host(self, p: torch.Tensor, h: torch.Tensor) -> None:
        grad = p.grad
        if grad is None:
            return
        with host_tier(), torch.no_grad():
            if h.grad is None:
                h.grad = dev.copy_to_host(grad, h.dtype, pin=self._pin)
                mark_host(h.grad, category="gradients")
                label_open(h.grad, "gradients")
            else:
                dev.synchronize(grad.device)
                h.grad.add_(grad.to("cpu", h.dtype))
        p.grad = None

    # ------------------------------------------------------------------ public
    def host_grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """The host gradient accumulated for offloaded parameter ``p`` (``None``: none yet, or
        ``p`` is not offloaded; its gradient is then ``p.grad``)."""
        for block in self._blocks:
            for q, h in zip(block.params, block.host, strict=True):
                if q is p:
                    dev.synchronize(q.device)
                    return h.grad
        return None

    def zero_grad(self) -> None:
        """Drop the host gradients."""
        for block in self._blocks:
            for h in block.host:
                h.grad = None

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every parameter on the device inside the block (to save or edit a state dict); what
        the block writes into the parameters is copied back to the host copies on exit."""
        for i in range(len(self._blocks)):
            self._fetch(i)
            self._ready(self._blocks[i])
        try:
            yield
        finally:
            with torch.no_grad():
                for block in self._blocks:
                    for p, h in zip(block.params, block.host, strict=True):
                        h.copy_(p.detach())
                    self._release(block)

    def remove(self) -> None:
        """Take the hooks off, copy the host values back into the device parameters (and any
        host gradients into ``.grad``); idempotent."""
        hooks, self._hooks = self._hooks, []
        if not hooks:
            return
        for h in hooks:
            h.remove()
        for i, block in enumerate(self._blocks):
            self._fetch(i)
            self._ready(block)
            for p, h in zip(block.params, block.host, strict=True):
                if h.grad is not None:
                    p.grad = h.grad.to(p.device, p.dtype)
                set_host_copy(p, None)
            block.host = []
        dev.synchronize(self._device or "cpu")
        if getattr(self.model, _ATTR, None) is self:
            delattr(self.model, _ATTR)


def apply_parameter_offload(model: nn.Module, config: OffloadConfig) -> ParameterOffloadHandle:
    """Keep the parameters of ``model``'s repeated blocks on the host, streamed per block.

    Apply after precision (the host copies take the training dtype), checkpointing and
    activation offload, and before the optimizer is built (optimizer offload steps the host
    copies). See the module docstring for what moves when.

    Args:
        model: The model, its parameters on the compute device.
        config: The offload settings; ``parameters`` must be ``"host"`` (``pin_memory`` also
            turns on the CUDA copy stream; ``optimizer`` set leaves gradients to optimizer
            offload).

    Returns:
        The :class:`ParameterOffloadHandle`; its ``remove()`` puts the parameters back.

    Raises:
        ValueError: when ``config.parameters`` is not ``"host"``, the model has no repeated
            blocks, or parameter offload is already applied to it.
    """
    if config.parameters != "host":
        raise ValueError(
            f"apply_parameter_offload needs offload parameters 'host', got {config.parameters!r}"
        )
    if getattr(model, _ATTR, None) is not None:
        raise ValueError("parameter offload is already applied to this model; remove it first")
    if not find_blocks(model):
        raise ValueError(
            "parameter offload streams the model's repeated blocks (a ModuleList or Sequential "
            "of two or more alike modules with parameters), and this model has none"
        )
    return ParameterOffloadHandle(model, config)


def _offloadable(model: nn.Module) -> list[_Block]:
    blocks = []
    for name, module in find_blocks(model):
        unique = {id(p): p for p in module.parameters()}
        blocks.append(_Block(name, module, list(unique.values())))
    return blocks


def _shared(model: nn.Module, blocks: list[_Block]) -> set[int]:
    """Ids of block parameters that some other module (another block, or one outside the
    blocks) also holds: those stay on the device."""
    owner: dict[int, int] = {}
    shared: set[int] = set()
    block_of = {id(b.module): k for k, b in enumerate(blocks)}
    inside = {id(m): block_of[id(b.module)] for b in blocks for m in b.module.modules()}
    for m in model.modules():
        where = inside.get(id(m), -1)
        for p in m.parameters(recurse=False):
            if owner.setdefault(id(p), where) != where:
                shared.add(id(p))
    return shared


def _owns_storage(p: torch.Tensor) -> bool:
    """Whether ``p`` is its storage's only tensor, contiguous from its start (resizing the
    storage then touches nothing else)."""
    return (
        p.is_contiguous()
        and p.storage_offset() == 0
        and p.untyped_storage().nbytes() == p.numel() * p.element_size()
    )


def _apply_technique(model: nn.Module, ctx: ApplyContext) -> ParameterOffloadHandle:
    handle = apply_parameter_offload(model, ctx.plan.offload)
    ctx.info["parameter_offload"] = handle.blocks
    return handle


def _check(plan: Any) -> None:
    """Streaming parameters needs the host optimizer's masters and no compile
    (``Technique.check``)."""
    off = plan.offload
    if off is None or off.parameters is None:
        return
    if off.optimizer is None:
        raise ValueError(
            "offload parameters needs optimizer offload too (optimizer 'host'): the step "
            "updates the parameters' host copies"
        )
    if off.optimizer == "disk":
        raise ValueError(
            "offload parameters streams blocks from the optimizer's host masters, which the "
            "disk tier keeps in files; use optimizer 'host' with parameters 'host'"
        )
    if plan.compile_backend is not None:
        raise ValueError(
            "parameter offload cannot be combined with compile: its storage resizes run in "
            "hooks torch.compile does not trace; set compile false"
        )


#: After precision (the host copies take the training dtype) and checkpointing (the
#: recomputation runs inside a block's backward, after its fetch); refused with compile.
TECHNIQUE = Technique(
    name="parameter_offload",
    plan_field="offload",
    order=60,
    is_on=lambda plan: plan.offload is not None and plan.offload.parameters is not None,
    apply=_apply_technique,
    info_key="parameter_offload",
    engines=frozenset({"single"}),
    refusal=offload_refusal,
    label=lambda plan: "offload",
    check=_check,
)
