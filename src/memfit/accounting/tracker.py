"""Dispatch-level accounting of training memory by category.

The tracker is a :class:`~torch.utils._python_dispatch.TorchDispatchMode`: every ATen operation
passes through it, and each output storage it has not seen before is recorded with its size and
the operation index at which it appeared. A weak reference to the storage tells the tracker the
moment it is freed. Nothing is scanned per operation, so the cost stays a few microseconds per op
and the same code counts real CPU tensors, CUDA tensors and fake tensors alike.

A storage gets one category for its whole life: the most specific role it ever plays. It starts
as a temporary (an op output) or ``other`` (a pre-existing tensor), and is promoted when the
tracker learns more: saved for backward (``activations``), assigned as ``.grad``
(``gradients``), found in an optimizer's state (``optimizer_state``). Categories are resolved
when the report is built, so the peak breakdown is right even when a storage's role is learned
after the peak (a gradient is born as an op output before autograd assigns it).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from ..errors import MemfitStateError, MemfitTypeError, describe
from .arguments import checked_cap, checked_device, checked_optimizers
from .tiers import DEVICE, HOST, HOST_PINNED, in_host_tier, is_marked_host, marked_category
from .trace import CATEGORIES, PHASES, AllocationTrace

__all__ = ["CATEGORIES", "PHASES", "MemoryTracker", "label_open", "storage_resized", "track"]

# Trackers now open (a storage resized in place is news to each of them).
_OPEN: list[MemoryTracker] = []

_RANK = {name: i for i, name in enumerate(CATEGORIES)}
_PARAM, _BUF, _GRAD, _OPT, _STASH, _INPUT, _ACT, _TEMP, _OTHER = range(len(CATEGORIES))

_FWD, _BWD, _OPTPHASE, _OTHERPHASE = range(len(PHASES))


class _ModuleEvents:
    """Open/close events of module forward and backward, as op-index intervals."""

    def __init__(self) -> None:
        # (qualified name, kind 'forward'|'backward', start op index, end op index or None)
        self.intervals: list[list[Any]] = []
        self.open_forward: list[int] = []  # indices into intervals, a stack
        self.open_backward: dict[str, int] = {}


class MemoryTracker(TorchDispatchMode):
    """Record every storage on the compute device and attribute its bytes to a category.

    Use :func:`track` rather than constructing this directly.

    Args:
        model: The model being trained; its parameters and buffers are counted from the start,
            its modules are named in ``by_module``, its forward marks the forward phase.
        optimizer: An optimizer (or an iterable of them) whose existing state is counted from
            the start. Optimizer steps are recognised for any optimizer through PyTorch's global
            step hooks.
        device: The compute device whose storages count. Defaults to the model's device, else
            CPU. Storages elsewhere (host memory of a GPU run) are recorded under the ``host``
            tier and excluded from the device peak.
        cap: If set, raise :class:`torch.OutOfMemoryError` as soon as live device bytes exceed
            it, with the category breakdown in the message (a virtual memory limit).
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        optimizer: Any = None,
        *,
        device: torch.device | str | None = None,
        cap: int | str | None = None,
    ) -> None:
        # Checked before anything is set up (issue 37): a wrong argument is one sentence here
        # rather than an AttributeError when the block opens, or nothing at all.
        if model is not None and not isinstance(model, nn.Module):
            raise MemfitTypeError(f"model must be an nn.Module or None, got {describe(model)}")
        super().__init__()
        self.model = model
        self.optimizers: list[Any] = checked_optimizers(_as_list(optimizer))
        if device is None:
            device = _model_device(model)
        self.device = checked_device(device)
        self._dev_type = self.device.type
        self.cap = checked_cap(cap)
        self._entered = False  # report() before the block has run has nothing to report
        # Storage records, as parallel lists (cheaper to append than objects).
        self._nbytes: list[int] = []
        self._birth: list[int] = []
        self._death: list[int] = []
        self._cat: list[int] = []
        self._tier: list[int] = []  # DEVICE, HOST, HOST_PINNED (see .tiers)
        self._disk: dict[str, int] = {}  # bytes on disk per category, now
        self._disk_peak = 0
        self._disk_at_peak: dict[str, int] = {}
        self._key: list[int] = []  # storage _cdata, to forget it when freed
        self._live: dict[int, int] = {}  # storage _cdata -> record index
        self._refs: dict[weakref.ref, int] = {}
        self._ref_of: dict[int, weakref.ref] = {}  # storage _cdata -> its weak reference
        # Running state. ``_seq`` counts allocation and free events: births and deaths are stamped
        # with it so that the live set at any instant (the peak above all) is exactly known.
        self._seq = 0
        self._peak_seq = 0
        self._op = 0
        self._total = 0
        self._peak = 0
        self._peak_op = 0
        self._func: Any = None  # the op being dispatched, named in the report at the peak
        self._peak_func: Any = None
        self._phase = _OTHERPHASE
        self._in_optimizer = 0
        self._in_backward = False
        self._hidden: list[int] = []  # temporaries made while another saved-tensor hook ruled
        self.timeline_seq: list[int] = [0]  # event count at the end of each op
        self.timeline_phase: list[int] = [_OTHERPHASE]
        self.op_names: dict[int, str] = {}
        self.step_boundaries: list[int] = []
        self._events = _ModuleEvents()
        self._names: dict[int, str] = {}
        self._hooks: list[Any] = []
        self._saved_hooks: Any = None
        self._closed = True
        self._report: Any = None
        self._pack_fn = self._pack  # one bound method, to recognise our hook on the stack
        #: Qualified name of the innermost module whose forward raised, if one did.
        self.failed_module: str | None = None
        #: Stretches of events recorded for replay in dry runs (see :mod:`.replay`).
        self.replays: dict[Any, Any] = {}
        self._birth_funcs: list[Any] | None = None  # the op of each birth, while recording
        self._changes = 0  # promotions of known storages and disk writes (see .replay)

    # ------------------------------------------------------------------ storage records
    def _register(self, t: torch.Tensor, cat: int, promote: bool = True) -> int | None:
        """Record ``t``'s storage if new (with category ``cat``); return its record index.

        A storage already known takes ``cat`` if it is more specific than its own, unless
        ``promote`` is false (an op's output that is a view of a known storage is no news).
        A wrapper subclass (a DTensor shard of FSDP2) holds its memory in its inner tensors,
        which are recorded instead (its own "storage" would claim the global size).
        """
        if is_traceable_wrapper_subclass(t):
            inner, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
            idx = None
            for name in inner:
                part = getattr(t, name)
                if isinstance(part, torch.Tensor):
                    idx = self._register(part, cat, promote)
            return idx
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return None  # sparse, nested or other storage-less tensors
        key = st._cdata
        idx = self._live.get(key)
        if idx is not None:
            if promote and cat < self._cat[idx]:
                self._cat[idx] = cat
                self._changes += 1
            return idx
        if t.is_meta:
            return None  # a real meta tensor holds no memory (fake tensors report is_meta False)
        if t.device.type != self._dev_type or in_host_tier() or is_marked_host(st):
            tier = HOST_PINNED if _is_pinned(t) else HOST
            marked = marked_category(st)
            if marked is not None:
                cat = min(cat, _RANK[marked])
        else:
            tier = DEVICE
        return self._record(st, key, st.nbytes(), cat, tier)

    def _record(self, st: Any, key: int, nbytes: int, cat: int, tier: int) -> int:
        """Append a record for a storage born now (``st`` is ``None`` for a replayed one,
        which :meth:`_end` ends)."""
        idx = len(self._nbytes)
        self._seq += 1
        self._nbytes.append(nbytes)
        self._birth.append(self._seq)
        self._death.append(-1)
        self._cat.append(cat)
        self._tier.append(tier)
        self._key.append(key)
        if st is not None:
            self._live[key] = idx
            ref = weakref.ref(st, self._on_free)
            self._refs[ref] = idx
            self._ref_of[key] = ref
        if self._birth_funcs is not None:
            self._birth_funcs.append(self._func)
        if tier == 0:
            self._total += nbytes
            if self._total > self._peak:
                self._peak = self._total
                self._peak_seq = self._seq
                self._peak_op = self._op
                self._peak_func = self._func
            if self.cap is not None and self._total > self.cap:
                self._raise_oom(nbytes)
        return idx

    def _on_free(self, ref: weakref.ref) -> None:
        idx = self._refs.pop(ref, None)
        if idx is None or self._closed:
            return
        self._seq += 1
        self._death[idx] = self._seq
        # The storage's address may be reused from now on, so forget it.
        key = self._key[idx]
        if self._live.get(key) == idx:
            del self._live[key]
            self._ref_of.pop(key, None)
        if self._tier[idx] == 0:
            self._total -= self._nbytes[idx]

    def _end(self, idx: int) -> None:
        """End record ``idx`` now (a replayed storage's death, see :mod:`.replay`)."""
        self._seq += 1
        self._death[idx] = self._seq
        if self._tier[idx] == 0:
            self._total -= self._nbytes[idx]

    def _resized(self, t: torch.Tensor) -> None:
        """``t``'s storage was resized in place (``untyped_storage().resize_``, which no
        dispatched op shows): its old record dies now and a record of its new size is born,
        with the same category and tier."""
        if self._closed:
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return
        key = st._cdata
        idx = self._live.get(key)
        if idx is None:
            self._register(t, _PARAM if isinstance(t, nn.Parameter) else _OTHER)
            return
        nbytes = st.nbytes()
        if nbytes == self._nbytes[idx]:
            return
        ref = self._ref_of.get(key)
        self._seq += 1
        self._death[idx] = self._seq
        if self._tier[idx] == 0:
            self._total -= self._nbytes[idx]
        if ref is not None:
            self._refs.pop(ref, None)
        del self._live[key]
        self._record(st, key, nbytes, self._cat[idx], self._tier[idx])

    def account_disk(self, nbytes: int, category: str) -> None:
        """Note that ``nbytes`` of ``category`` now live on disk (negative: removed from it).

        Disk bytes are files, not storages; a technique that writes them (the disk tier of
        offload) reports them here, and the report's ``peak_by_tier["disk"]`` is their peak.
        """
        if category not in CATEGORIES:
            raise ValueError(
                f"category {category!r} is not known; use one of {', '.join(CATEGORIES)}"
            )
        self._disk[category] = self._disk.get(category, 0) + int(nbytes)
        self._changes += 1
        total = sum(self._disk.values())
        if total > self._disk_peak:
            self._disk_peak = total
            self._disk_at_peak = dict(self._disk)

    def label(self, tensors: Any, category: str) -> None:
        """Attribute the storages of ``tensors`` (any nesting of tensors) to ``category``.

        Strategies use this to tell the tracker what their tensors are (for example the state
        tensors of an optimizer the tracker was not given). A storage keeps the most specific
        category it was ever given.
        """
        cat = _RANK[category]
        for t in _iter_tensors(tensors):
            self._register(t, cat)

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func in _METADATA_OPS:
            # Tensor subclasses (fake tensors) answer .device and friends through dispatch; these
            # allocate nothing and may be called from inside the tracker itself. A fake
            # tensor's device is answered here as FakeTensor itself answers it (autograd asks
            # for it several times per op: re-dispatching would cost a dry run ~5%).
            if func is _PRIM_DEVICE and type(args[0]) is FakeTensor:
                t = args[0]
                return _META if t.fake_mode.in_kernel_invocation else t.fake_device
            return func(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        self._op += 1
        self._func = func
        # Pre-existing tensors the tracker has not met are recorded as "other" on first use.
        for a in args:
            if type(a) is torch.Tensor or isinstance(a, torch.Tensor):
                self._see_input(a)
            elif isinstance(a, (list, tuple)):
                for x in a:
                    if isinstance(x, torch.Tensor):
                        self._see_input(x)
        first_new = len(self._nbytes)
        if isinstance(out, torch.Tensor):
            self._register(out, _TEMP, False)
        elif isinstance(out, (list, tuple)):
            for x in out:
                if isinstance(x, torch.Tensor):
                    self._register(x, _TEMP, False)
                elif isinstance(x, (list, tuple)):
                    for y in x:
                        if isinstance(y, torch.Tensor):
                            self._register(y, _TEMP, False)
        phase = self._current_phase()
        if len(self._nbytes) > first_new and not self._in_backward:
            top = _top_saved_hooks(False)
            if top is not None and top[0] is not self._pack_fn:
                self._hidden.extend(range(first_new, len(self._nbytes)))
        self.timeline_seq.append(self._seq)
        self.timeline_phase.append(phase)
        return out

    def _see_input(self, t: torch.Tensor) -> None:
        try:
            key = t.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError, TypeError):
            return
        if key not in self._live:
            self._register(t, _OTHER)

    def _current_phase(self) -> int:
        in_backward = torch._C._current_graph_task_id() != -1
        if in_backward != self._in_backward:
            # Modules whose inputs need no gradient never see their backward end: close them
            # when the backward pass is over.
            self._in_backward = in_backward
            if in_backward:
                self._forward_leftovers_are_activations()
            else:
                self._close_backward()
        if self._in_optimizer:
            return _OPTPHASE
        if in_backward:
            return _BWD
        return self._phase

    def _forward_leftovers_are_activations(self) -> None:
        # What the forward made and is still alive when backward starts is kept for backward.
        # Saved-tensor hooks see most of it, but not what an inner hook hides: activation
        # checkpointing's selective cache, a user's own saved_tensors_hooks.
        # So a temporary made while another saved-tensors hook hid the tracker's, and still
        # alive when backward starts, was kept for backward.
        cat, live = self._cat, self._live
        for idx in self._hidden:
            if cat[idx] == _TEMP and live.get(self._key[idx]) == idx:
                cat[idx] = _ACT
        self._hidden.clear()

    def _raise_oom(self, nbytes: int) -> None:
        from ..units import format_bytes

        now = self.snapshot()
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in now.items() if v)
        raise torch.OutOfMemoryError(
            f"memfit virtual cap exceeded: allocating {format_bytes(nbytes)} brought live device "
            f"memory to {format_bytes(self._total)}, over the cap of {format_bytes(self.cap or 0)} "
            f"({parts})."
        )

    # ------------------------------------------------------------------ hooks
    def _install(self) -> None:
        model = self.model
        if model is not None:
            self._names = {id(m): name for name, m in model.named_modules()}
            for p in model.parameters():
                self._register(p, _PARAM)
                if p.grad is not None:
                    self._register(p.grad, _GRAD)
            for b in model.buffers():
                self._register(b, _BUF)
            for p in model.parameters():
                if p.requires_grad:
                    self._hook_grad(p)
            self._hooks.append(model.register_forward_pre_hook(self._root_pre, with_kwargs=True))
        for opt in self.optimizers:
            self._label_optimizer(opt, existing=True)
        mod = nn.modules.module
        self._hooks.append(mod.register_module_forward_pre_hook(self._fwd_pre))
        self._hooks.append(mod.register_module_forward_hook(self._fwd_post, always_call=True))
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        self._hooks.append(register_optimizer_step_pre_hook(self._opt_pre))
        self._hooks.append(register_optimizer_step_post_hook(self._opt_post))
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack_fn, _unpack)
        self._saved_hooks.__enter__()

    def _uninstall(self) -> None:
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _hook_grad(self, p: torch.Tensor) -> None:
        handle = p.register_post_accumulate_grad_hook(self._grad_ready)
        # Run before any other post-accumulate hook: an optimizer fused into backward frees the
        # gradient in its own hook, and the tracker must see the gradient first.
        # The hooks are called in the order of the underlying dict (PyDict_Next), which
        # OrderedDict.move_to_end does not change: re-insert the others after ours instead.
        hooks = getattr(p, "_post_accumulate_grad_hooks", None)
        if hooks is not None and handle.id in hooks:
            for key in [k for k in hooks if k != handle.id]:
                hooks[key] = hooks.pop(key)
        self._hooks.append(handle)

    def _grad_ready(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self._register(p.grad, _GRAD)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._register(t, _ACT)
        # A detached alias (same storage) rather than the tensor itself: returning a saved
        # output as is makes a reference cycle through autograd's graph, and a forward that
        # never reaches backward (an out-of-memory step) could then never be freed.
        return t.detach()

    def _root_pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        # The model's forward starts a forward phase; the tensors it is given are inputs.
        self._phase = _FWD
        self.label((args, kwargs), "inputs")

    def _fwd_pre(self, module: nn.Module, args: Any) -> None:
        name = self._names.get(id(module))
        if name is None:
            if self.model is not None:
                return
            name = type(module).__name__
        if self.model is None and not self._events.open_forward:
            # Without a model, any outermost module's forward starts a forward phase.
            self._phase = _FWD
            self.label(args, "inputs")
        ev = self._events
        ev.open_forward.append(len(ev.intervals))
        ev.intervals.append([name, "forward", self._op + 1, None])
        if torch.is_grad_enabled():
            tensors = [a for a in _iter_tensors(args) if a.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, lambda grads, n=name: self._bwd_end(n), mode="any"
                )

    def _fwd_post(self, module: nn.Module, args: Any, output: Any) -> None:
        name = self._names.get(id(module))
        if name is None:
            if self.model is not None:
                return
            name = type(module).__name__
        ev = self._events
        if ev.open_forward:
            ev.intervals[ev.open_forward.pop()][3] = self._op
        if output is None and sys.exc_info()[1] is not None and self.failed_module is None:
            # Called on the way out of a forward that raised (always_call): the innermost
            # module's hook runs first, so this names where the error happened.
            self.failed_module = name
        if torch.is_grad_enabled():
            tensors = [o for o in _iter_tensors(output) if o.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, lambda grads, n=name: self._bwd_start(n), mode="any"
                )

    def _bwd_start(self, name: str) -> None:
        ev = self._events
        if name not in ev.open_backward:
            ev.open_backward[name] = len(ev.intervals)
            ev.intervals.append([name, "backward", self._op + 1, None])

    def _bwd_end(self, name: str) -> None:
        idx = self._events.open_backward.pop(name, None)
        if idx is not None:
            self._events.intervals[idx][3] = self._op

    def _close_backward(self) -> None:
        ev = self._events
        for idx in ev.open_backward.values():
            ev.intervals[idx][3] = self._op
        ev.open_backward.clear()

    def _opt_pre(self, opt: Any, args: Any, kwargs: Any) -> None:
        self._in_optimizer += 1

    def _opt_post(self, opt: Any, args: Any, kwargs: Any) -> None:
        self._in_optimizer -= 1
        self._label_optimizer(opt)
        if not self._in_optimizer and torch._C._current_graph_task_id() == -1:
            self._close_backward()
            self._phase = _OTHERPHASE
            self.step_boundaries.append(self._op)

    def _label_optimizer(self, opt: Any, existing: bool = False) -> None:
        state = getattr(opt, "state", None)
        if state is None:
            return
        for s in state.values():
            if isinstance(s, dict):
                for v in s.values():
                    if isinstance(v, torch.Tensor):
                        self._register(v, _OPT)

    # ------------------------------------------------------------------ public
    def add_inputs(self, batch: Any) -> None:
        """Count the tensors of ``batch`` as inputs from now on (call before the step)."""
        self.label(batch, "inputs")

    def mark_step(self) -> None:
        """Mark the end of a training step (done automatically after each optimizer step)."""
        self._close_backward()
        self._phase = _OTHERPHASE
        self.step_boundaries.append(self._op)

    @property
    def num_ops(self) -> int:
        """Operations dispatched so far."""
        return self._op

    @property
    def current_module(self) -> str | None:
        """Qualified name of the innermost module whose forward is running (``None``: none)."""
        ev = self._events
        return ev.intervals[ev.open_forward[-1]][0] if ev.open_forward else None

    @property
    def event_stamp(self) -> int:
        """The allocation/free event counter now: marks a moment in the run, to read live
        bytes between two moments off :meth:`trace` (its births and deaths share it)."""
        return self._seq

    @property
    def live_bytes(self) -> int:
        """Bytes of live storages on the compute device right now."""
        return self._total

    @property
    def peak_bytes(self) -> int:
        """Highest live bytes seen so far."""
        return self._peak

    def snapshot(self) -> dict[str, int]:
        """Live bytes on the compute device right now, by category."""
        out = dict.fromkeys(CATEGORIES, 0)
        nb, cat, tier = self._nbytes, self._cat, self._tier
        for idx in self._live.values():
            if tier[idx] == 0:
                out[CATEGORIES[cat[idx]]] += nb[idx]
        return out

    def __enter__(self) -> MemoryTracker:
        self._entered = True
        self._closed = False
        self._install()
        super().__enter__()
        _OPEN.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if self in _OPEN:
            _OPEN.remove(self)
        self._uninstall()
        self._close_backward()
        ev = self._events
        while ev.open_forward:
            ev.intervals[ev.open_forward.pop()][3] = self._op
        self._closed = True
        # Storages still alive at the end live to the last op; drop the weak references so
        # nothing calls back into a finished tracker.
        self._refs.clear()
        self._ref_of.clear()
        self._live.clear()
        self._report = None

    def trace(self) -> AllocationTrace:
        """The allocation trace recorded so far (sizes, births, deaths, tiers, categories)."""
        return AllocationTrace(
            nbytes=tuple(self._nbytes),
            birth=tuple(self._birth),
            death=tuple(self._death),
            tier=tuple(self._tier),
            category=tuple(self._cat),
            num_events=self._seq,
            op_end_event=tuple(self.timeline_seq),
            op_phase=tuple(self.timeline_phase),
            module_intervals=tuple(
                (name, kind, start, end) for name, kind, start, end in self._events.intervals
            ),
            step_boundaries=tuple(self.step_boundaries),
            peak_bytes=self._peak,
            peak_event=self._peak_seq,
            peak_op=None if self._peak_func is None else str(self._peak_func),
            device=str(self.device),
            disk_peak_bytes=self._disk_peak,
            disk_at_peak=tuple(sorted(self._disk_at_peak.items())),
        )

    def report(self) -> Any:
        """Build the :class:`~memfit.accounting.report.MemoryReport` of what was recorded.

        Inside the block: what was recorded so far. Before the block ever opened it raises
        :class:`~memfit.errors.MemfitStateError`.
        """
        from .report import build_report

        if not self._entered:
            raise MemfitStateError(
                "report() was called before the tracker's block ran, so nothing was recorded; "
                "call it after `with memfit.track(model, optimizer) as tracker:` (or inside it)"
            )
        if self._report is None or not self._closed:
            self._report = build_report(self.trace())
        return self._report


def track(
    model: nn.Module | None = None,
    optimizer: Any = None,
    *,
    device: torch.device | str | None = None,
    cap: int | str | None = None,
) -> MemoryTracker:
    """Track training memory by category while the returned context manager is open.

    Example::

        with memfit.track(model, optimizer) as tracker:
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        print(tracker.report().table())

    Args:
        model: The model; its parameters and buffers count from the start.
        optimizer: The optimizer(s); existing state counts from the start.
        device: Compute device whose storages count (default: the model's device).
        cap: Virtual memory cap: bytes (an int >= 0) or a size string such as ``"4GiB"``;
            exceeding it raises ``torch.OutOfMemoryError``.

    Returns:
        The tracker; call ``tracker.report()`` after the block for a ``MemoryReport``.

    Raises:
        MemfitTypeError: for a model that is not an ``nn.Module``, an optimizer that is not
            one (``"adam"``: build the optimizer first), a cap or device of another kind.
        MemfitValueError: for a negative or malformed cap, or a device torch does not know.
    """
    return MemoryTracker(model, optimizer, device=device, cap=cap)


def storage_resized(tensors: Iterable[torch.Tensor]) -> None:
    """Tell every open tracker that the storages of ``tensors`` were resized in place.

    ``untyped_storage().resize_`` frees or allocates a storage's memory without any dispatched
    operation, so a tracker cannot see it by itself; a technique that releases memory this way
    (parameter offload) calls this after each resize, and the tracker ends the storage's old
    record and starts one of its new size.
    """
    if not _OPEN:
        return
    items = list(tensors)
    for tracker in list(_OPEN):
        for t in items:
            tracker._resized(t)


def label_open(tensors: Any, category: str) -> None:
    """Attribute the storages of ``tensors`` to ``category`` in every open tracker (see
    :meth:`MemoryTracker.label`): for a technique's own buffers, which no tracker is handed."""
    for tracker in list(_OPEN):
        tracker.label(tensors, category)


_top_saved_hooks = torch._C._autograd._top_saved_tensors_default_hooks

_PRIM_DEVICE = torch.ops.prim.device.default
_METADATA_OPS = frozenset({_PRIM_DEVICE, torch.ops.prim.layout.default})
_META = torch.device("meta")


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _as_list(obj: Any) -> list[Any]:
    if obj is None:
        return []
    if isinstance(obj, (list, tuple)):
        return list(obj)
    optimizers = getattr(obj, "optimizers", None)  # e.g. an optimizer-in-backward handle
    if isinstance(optimizers, (list, tuple)):
        return list(optimizers)
    return [obj]


def _model_device(model: nn.Module | None) -> torch.device:
    if model is not None:
        for p in model.parameters():
            return p.device
    return torch.device("cpu")


def _iter_tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _iter_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _iter_tensors(v)
    else:
        # Model outputs (ModelOutput is a dict; dataclasses expose their fields).
        fields = getattr(obj, "__dataclass_fields__", None)
        if fields:
            for name in fields:
                yield from _iter_tensors(getattr(obj, name, None))


def _is_pinned(t: torch.Tensor) -> bool:
    """Whether ``t``'s host memory is page-locked (False for fake and device tensors)."""
    if t.device.type != "cpu":
        return False
    try:
        return bool(t.is_pinned())
    except (RuntimeError, NotImplementedError):
        return False
