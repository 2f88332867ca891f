"""Optimizer offload (ZeRO-Offload on one device): master weights, state and step on the host.

:class:`HostOffloadOptimizer` keeps an fp32 master copy of every trainable parameter in host
memory and builds the plan's optimizer (any ``torch.optim.Optimizer``: torch's AdamW, memfit's
AdamW8bit, Adafactor, ...) over the masters, so its state is allocated on the host too. The
device keeps the parameters in the training dtype and, at any moment, at most one bucket of
gradients waiting to leave:

* each parameter's post-accumulate-grad hook marks it ready; when every parameter of a bucket
  (``bucket_bytes`` of gradients, a constant independent of model size, filled in reverse
  registration order) is ready, the bucket's gradients are copied to the host and dropped on the device, while the
  rest of backward goes on. Without ``gradients_on_host`` this happens in the last micro-batch
  (gradients accumulate on the device until then); with it, in every micro-batch, and the host
  accumulates.
* :meth:`HostOffloadOptimizer.step` clips on the host (the global norm over the host
  gradients), steps the host optimizer, and copies the updated masters back into the device
  parameters (cast to their dtype) before the next forward.

With ``step_in_backward`` (the plan's ``optimizer_in_backward``), the host steps each bucket
as soon as its gradients have landed in the last micro-batch, and its updated weights go back
while the rest of backward runs (ZeRO-Offload's and torchao's overlap of the host step with
the device's backward): ``step`` then only steps what got no gradient in the last backward.
On CUDA a bucket whose copies are still queued waits (a gradient hook never blocks the host
on the device, which would drain the device's queue), and the end of backward steps the
waiting buckets in order, each as soon as its copies have run, while the device works
through the backward queued behind them.
Autograd accumulates a parameter's gradient once per backward, after every node that uses
the parameter has run, so copying the new value in cannot change this backward. Clipping
then uses the previous step's global norm (``grad_clip_mode: approx``, as the in-device fused
step); exact clipping would need every gradient before the first bucket steps.

What torch lacks: FSDP2's ``CPUOffloadPolicy`` offloads parameters, gradients and the step
together and needs a process group; torchao's ``CPUOffloadOptimizer`` offloads the step of a
torch optimizer but keeps no low-precision device copy with an fp32 host master, has no
accumulation on the host, and knows nothing of memfit's accounting. Host buffers are allocated
inside :func:`memfit.accounting.host_tier`, so the tracker reports them as host memory even
when the compute device is the CPU.

On CUDA the copies are non-blocking into pinned buffers (:mod:`memfit.device`); on the CPU they
are plain copies.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ..accounting.tiers import host_tier, mark_host
from ..optim.registry import get as optimizer_spec
from ..stepping import BaseStepper
from ..techniques import Technique
from .offload import OffloadConfig, host_copy_of, offload_refusal

__all__ = ["HostOffloadOptimizer", "OffloadStepper", "host_optimizer_builder"]


def host_optimizer_builder(config: Any) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    """How the host step builds the plan's optimizer (an ``OptimizerConfig``): one with a
    fused CPU kernel (the registry's ``fused``: torch's AdamW and Adam) takes it (one pass
    over each tensor, several times faster than the per-tensor loop torch picks by default on
    the CPU) unless the plan chose ``foreach`` or an implementation in its kwargs; every other
    optimizer is built as configured."""
    kwargs = dict(config.kwargs)
    if optimizer_spec(config.name).fused and config.foreach is None and not (
        {"fused", "foreach"} & set(kwargs)
    ):
        import dataclasses

        return dataclasses.replace(config, kwargs={**kwargs, "fused": True}).build
    return config.build


class HostOffloadOptimizer:
    """The plan's optimizer, stepping fp32 host masters of the device parameters.

    Args:
        params: The trainable parameters (on the compute device, any floating dtype).
        build: Builds the optimizer over a list of host master tensors.
        config: The offload settings (``bucket_bytes``, ``gradients_on_host``, ``pin_memory``).
        step_in_backward: Step each bucket on the host during the last backward.
        max_grad_norm: With ``step_in_backward``: clip each step's gradients with the
            previous step's global norm (``None``: no clipping).

    Attributes:
        optimizer: The host optimizer (over :attr:`masters`).
        masters: fp32 host copies of the parameters, in order.
        buckets: Parameter indices per gradient bucket.
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        build: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
        config: OffloadConfig,
        *,
        step_in_backward: bool = False,
        max_grad_norm: float | None = None,
    ) -> None:
        from ..device import host_buffer

        self.params = list(params)
        self.config = config
        with host_tier(), torch.no_grad():
            self.masters = [self._master(p, host_buffer) for p in self.params]
        mark_host(self.masters)
        self.optimizer = build(self.masters)
        self.buckets = _buckets(self.params, config.bucket_bytes)
        self._bucket_of = {i: b for b, members in enumerate(self.buckets) for i in members}
        self._pending = [len(m) for m in self.buckets]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._offloading = True  # whether this backward moves gradients (last micro-batch)
        self._hooks = [p.register_post_accumulate_grad_hook(self._ready) for p in self.params]
        self.transfers = 0  # gradient buckets moved (for tests and reports)
        self.step_in_backward = step_in_backward
        self.max_grad_norm = max_grad_norm
        self._last = False  # whether this backward is the step's last (buckets step in it)
        self._stepped: set[int] = set()  # buckets stepped (or queued to step) in this backward
        # Buckets whose gradients are on their way to the host, with the event that marks
        # their copies (``None``: landed already), in the order they step.
        self._waiting: list[tuple[int, Any]] = []
        # With clipping: this step's squared gradient norm, gathered bucket by bucket, and the
        # coefficient from the previous step's norm (tensors: nothing reads a value, so a dry
        # run of fake tensors goes through).
        self._sq_norm: torch.Tensor | None = None
        self._coef: torch.Tensor | None = None
        self.last_norm: torch.Tensor | None = None  # the previous step's global gradient norm

    def _master(self, p: nn.Parameter, host_buffer: Callable[..., torch.Tensor]) -> torch.Tensor:
        # A parameter streamed by parameter offload has its values in a host copy (its device
        # storage may be released): an fp32 host copy is the master itself, so the step
        # updates what the next fetch reads; another dtype is copied from.
        copy = host_copy_of(p)
        if copy is not None and copy.dtype == torch.float32:
            return copy
        source = p.detach() if copy is None else copy
        return host_buffer(p.shape, torch.float32, pin=self.config.pin_memory).copy_(source)

    # ------------------------------------------------------------------ optimizer face
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The host optimizer's groups (an LR scheduler attached here drives the host step)."""
        return self.optimizer.param_groups

    @property
    def state(self) -> dict[Any, Any]:
        """The host optimizer's state, each master included (the tracker labels it as state)."""
        out: dict[Any, Any] = {}
        for m in self.masters:
            out[m] = {"master": m, **self.optimizer.state.get(m, {})}
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the host gradients (and any device gradient not moved yet)."""
        for p, m in zip(self.params, self.masters, strict=True):
            p.grad = None
            m.grad = None
        self._pending = [len(m) for m in self.buckets]

    def state_dict(self) -> dict[str, Any]:
        """The host optimizer's state and the masters."""
        return {"optimizer": self.optimizer.state_dict(), "masters": [m.clone() for m in self.masters]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; the device parameters take the restored masters."""
        self.optimizer.load_state_dict(state["optimizer"])
        with torch.no_grad():
            for m, saved in zip(self.masters, state["masters"], strict=True):
                m.copy_(saved)
        self._push()

    # ------------------------------------------------------------------ gradients
    def begin_backward(self, last: bool) -> None:
        """Set whether the coming backward moves its gradients (the last micro-batch, or every
        one with ``gradients_on_host``)."""
        self._offloading = last or self.config.gradients_on_host
        self._last = last
        self._stepped = set()
        self._waiting = []
        self._pending = [len(m) for m in self.buckets]

    def _ready(self, p: torch.Tensor) -> None:
        if not self._offloading:
            return
        b = self._bucket_of[self._index[id(p)]]
        self._pending[b] -= 1
        if self._pending[b] == 0:
            self._move(b)

    def end_backward(self) -> None:
        """Move the buckets some of whose parameters got no gradient this backward."""
        if not self._offloading:
            return
        for b, left in enumerate(self._pending):
            if 0 < left < len(self.buckets[b]):
                self._move(b)
        self._pending = [len(m) for m in self.buckets]
        if self.step_in_backward and self._last:
            # Buckets with gradients from earlier micro-batches only (host accumulation).
            for b in range(len(self.buckets)):
                if b not in self._stepped and any(
                    self.masters[i].grad is not None for i in self.buckets[b]
                ):
                    self._stepped.add(b)
                    self._waiting.append((b, None))
            self._step_ready(block=True)
            self._finish_step()

    def _move(self, b: int) -> None:
        from ..device import copy_to_host

        with host_tier(), torch.no_grad():
            for i in self.buckets[b]:
                p, m = self.params[i], self.masters[i]
                if p.grad is None:
                    continue
                if m.grad is None:
                    m.grad = copy_to_host(p.grad, torch.float32, pin=self.config.pin_memory)
                    mark_host(m.grad)
                else:
                    m.grad.add_(p.grad.to("cpu", torch.float32))
                p.grad = None
        self.transfers += 1
        if self.step_in_backward and self._last:
            from ..device import current_event

            self._stepped.add(b)
            self._waiting.append((b, current_event(self.params[self.buckets[b][0]].device)))
            self._step_ready(block=False)

    def _step_ready(self, *, block: bool) -> None:
        """Step the waiting buckets, in order, whose gradients have landed on the host; with
        ``block``, all of them, each as soon as its copies are done.

        On CUDA the gradient copies are non-blocking: the host may read a bucket only once
        its copies have run, which also orders its step after the previous step's copies up of
        those masters. Waiting in the gradient hook for the bucket just queued would drain the
        device's queue and leave it idle while the host steps; so a hook steps only buckets
        already landed, and the end of backward waits for the rest one by one, each host step
        running while the device works through the backward still queued behind it. Off CUDA
        every bucket has landed at once (no event): it steps in its hook."""
        from ..device import event_done, wait_event

        while self._waiting:
            b, event = self._waiting[0]
            if not event_done(event):
                if not block:
                    return
                wait_event(event)
            self._waiting.pop(0)
            self._step_bucket(b)

    def _step_bucket(self, b: int) -> None:
        """Step bucket ``b``'s masters alone (the others' gradients hidden meanwhile) and send
        their new values to the device."""
        members = set(self.buckets[b])
        mine = [self.masters[i] for i in self.buckets[b] if self.masters[i].grad is not None]
        with torch.no_grad():
            for m in mine:
                if self.max_grad_norm is None:
                    continue
                sq = torch.linalg.vector_norm(m.grad, 2).square()
                self._sq_norm = sq if self._sq_norm is None else self._sq_norm + sq
                if self._coef is not None:
                    m.grad.mul_(self._coef)
        hidden = {
            i: self.masters[i].grad
            for i in range(len(self.masters))
            if i not in members and self.masters[i].grad is not None
        }
        for i in hidden:
            self.masters[i].grad = None
        try:
            with host_tier():
                self.optimizer.step()
        finally:
            for i, g in hidden.items():
                self.masters[i].grad = g
        for m in mine:
            m.grad = None
        self._push(self.buckets[b])

    def _finish_step(self) -> None:
        """The step's norm is known: the next step's clip coefficient (as clip_grad_norm_)."""
        if self._sq_norm is not None and self.max_grad_norm is not None:
            norm = self._sq_norm.sqrt()
            self.last_norm = norm
            # The same operations as torch.nn.utils.clip_grad_norm_.
            self._coef = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
        self._sq_norm = None
        mark_host(v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v))

    def scale_grads(self, factor: float) -> None:
        """Multiply the step's gradients (on the host) by ``factor``."""
        with torch.no_grad():
            for m in self.masters:
                if m.grad is not None:
                    m.grad.mul_(factor)

    # ------------------------------------------------------------------ the step
    def step(self, max_grad_norm: float | None = None) -> None:
        """Clip on the host, step the host optimizer, copy the masters back to the device."""
        from ..device import synchronize

        if self.step_in_backward:
            return  # every bucket stepped in the last backward (end_backward)
        if self.params:
            synchronize(self.params[0].device)  # the non-blocking gradient copies have landed
        grads = [m.grad for m in self.masters if m.grad is not None]
        with host_tier():
            if max_grad_norm is not None and grads:
                torch.nn.utils.clip_grad_norm_(
                    [m for m in self.masters if m.grad is not None], max_grad_norm
                )
            self.optimizer.step()
        # State made in the first step: host memory for any tracker opened later too.
        mark_host(v for s in self.optimizer.state.values() for v in s.values())
        self._push()

    def _push(self, indices: list[int] | None = None) -> None:
        """Send the updated masters (of parameters ``indices``, default all) to the device.

        A parameter streamed by parameter offload gets them in its host copy instead: its
        device storage may be released, and the next fetch reads the host copy."""
        with torch.no_grad():
            for i in range(len(self.params)) if indices is None else indices:
                p, m = self.params[i], self.masters[i]
                copy = host_copy_of(p)
                if copy is None:
                    p.copy_(m.to(p.device, p.dtype, non_blocking=True))
                elif copy is not m:
                    copy.copy_(m)  # parameter offload fetches it from there

    def remove(self) -> None:
        """Take the gradient hooks off the parameters (idempotent)."""
        hooks, self._hooks = self._hooks, []
        for h in hooks:
            h.remove()

    def make_stepper(self, precision: Any, model: nn.Module, max_grad_norm: float | None) -> Any:
        """The :class:`OffloadStepper` for this optimizer."""
        return OffloadStepper(self, precision, max_grad_norm)


class OffloadStepper(BaseStepper):
    """The Stepper of optimizer offload: backward moves gradients, step runs on the host.

    Args:
        optimizer: The :class:`HostOffloadOptimizer`.
        precision: The precision runtime (its backward; offload refuses fp16 loss scaling).
        max_grad_norm: Clip to this global norm on the host (``None``: no clipping).
    """

    def __init__(self, optimizer: HostOffloadOptimizer, precision: Any, max_grad_norm: float | None) -> None:
        self.optimizer = optimizer
        self.precision = precision
        self.max_grad_norm = max_grad_norm

    def backward(self, loss: torch.Tensor, *, last: bool) -> None:
        self.optimizer.begin_backward(last)
        self.precision.backward(loss)
        self.optimizer.end_backward()

    def step(self) -> None:
        self.optimizer.step(self.max_grad_norm)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def divide_grads(self, divide_by: float) -> None:
        """Divide the step's gradients (on the host) by ``divide_by``."""
        self.optimizer.scale_grads(1.0 / divide_by)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])


def _buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[list[int]]:
    """Parameter indices whose gradients fill at most ``bucket_bytes`` each (a larger
    parameter is a bucket of its own), taken from the last parameter to the first: the order
    in which backward usually produces gradients (as DDP builds its buckets), so that a bucket
    fills up soon after its first gradient arrives. Indices ascend within a bucket."""
    buckets: list[list[int]] = []
    size = 0
    for i in reversed(range(len(params))):
        p = params[i]
        nbytes = p.numel() * p.element_size()
        if buckets and size + nbytes <= bucket_bytes:
            buckets[-1].insert(0, i)
            size += nbytes
        else:
            buckets.append([i])
            size = nbytes
    return buckets


def _check(plan: Any) -> None:
    """The rules tying the host or disk step to the loss scaler, the fused step and exact
    clipping (``Technique.check``)."""
    off = plan.offload
    if off is None or off.optimizer is None:
        return
    if plan.precision.mode == "fp16-mixed":
        raise ValueError(
            "optimizer offload cannot be combined with fp16-mixed: the loss scaler "
            "checks device gradients that offload has moved; use bf16-mixed or bf16-pure"
        )
    if off.optimizer == "disk" and plan.optimizer_in_backward:
        raise ValueError(
            "optimizer offload to 'disk' steps after backward, group by group; set "
            "optimizer_in_backward false (or use optimizer 'host', which steps in backward)"
        )
    if (
        plan.optimizer_in_backward
        and plan.max_grad_norm is not None
        and plan.grad_clip_mode == "exact"
    ):
        raise ValueError(
            "optimizer offload with optimizer_in_backward steps each bucket on the host "
            "as its gradients land, before the global norm is known; use "
            "grad_clip_mode 'approx' (the previous step's norm) or set max_grad_norm null"
        )
    if plan.parallel.world_size > 1 or plan.parallel.zero_stage:
        raise ValueError(
            "optimizer and parameter offload cannot be combined with data parallelism yet "
            "(their gradient hooks would run before the gradients are averaged across "
            "processes); keep offload activations only, or use one process"
        )


#: The optimizer on the host (ZeRO-Offload) or on disk (ZeRO-Infinity): built in place of the
#: device optimizer when the plan's optimizer is built (``memfit.apply``), so nothing of its
#: own is applied to the model.
TECHNIQUE = Technique(
    name="optimizer_offload",
    plan_field="offload",
    order=122,
    is_on=lambda plan: plan.offload is not None and plan.offload.optimizer is not None,
    engines=frozenset({"single"}),
    refusal=offload_refusal,
    label=lambda plan: "offload",
    allow={
        "offload": "the optimizer (fp32 master weights and state) on the host, stepping "
        "there, block parameters streamed from the host, and tensors saved for backward in "
        "host memory"
    },
    summary=lambda config: config.summary(),
    check=_check,
)
