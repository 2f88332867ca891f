"""Activation offload: tensors saved for backward wait in host memory instead of on the device.

:func:`apply_activation_offload` puts a :class:`torch.autograd.graph.saved_tensors_hooks` around
the model's forward (entered by a forward pre-hook, left by a forward hook that also runs when
the forward raises, so the hooks never outlive the call). Each tensor autograd saves is then

* kept on the device as it is, when it is a parameter or buffer of the model, an input of the
  forward (the caller holds those anyway, so a host copy would free nothing), or when its
  storage is smaller than ``activation_min_bytes`` (a transfer of a few bytes costs more in
  latency than it saves);
* kept on the device too when its storage would take the host copies past ``host_bytes``;
* otherwise copied, whole storage at once, into a host buffer (page-locked on CUDA when
  ``pin_memory``), and autograd keeps only that buffer: the device storage is freed as soon as
  the forward's own references to it are gone. A storage is moved once per forward however
  often it is saved, and views of it share the copy.

In backward, the first unpack of a moved storage copies it back into a fresh device buffer,
which every tensor saved from that storage shares while any of them is alive; the host buffer
is freed with the autograd graph (after backward, unless ``retain_graph``).

On CUDA the copy back runs one block ahead on a side stream: when backward first needs a
tensor saved in block *i*, the storages saved in the block before it are copied back on the
copy stream while block *i*'s backward computes, so the device holds at most one extra block
of restored activations. On the CPU (every test here) there is no second stream and no
prefetch: each storage is copied back when backward first needs it, unless a CUDA target's
kernels are emulated (a dry run or measurement for a GPU, :mod:`memfit.targets.kernels`):
then the same copies are made one block ahead, synchronously, so the report counts the block
copied back ahead as the GPU holds it. Tensors saved from another device than the model's
(a CPU tensor in a CUDA model) and empty storages stay as they are. Blocks are the model's
repeated blocks (:func:`~memfit.blocks.find_blocks`); without any, copies are made
on demand.

With activation checkpointing (apply it first, then activation offload) autograd saves only
what the checkpointed blocks keep, their inputs, plus the tensors of the unchecked parts; those
are what move. The recomputation in backward runs outside the hooks and stays on the device.

Under fake tensors (a dry run) the same happens to fake storages, so a dry run with the
tracker shows the device saving and the host bytes that a real run would.

A storage that something besides autograd still holds when the forward returns (a tensor the
model returns, the keyword arguments a checkpointed block keeps for its recomputation) is
copied all the same but stays on the device; :class:`OffloadCounters` reports those bytes
(``last_forward_held_bytes``).

On a CPU-only machine, the host buffers are allocated inside
:func:`~memfit.accounting.tiers.host_tier`, so the tracker reports them as the ``host`` tier,
and the device copies made in backward are ordinary (``device`` tier) allocations: the tracker
shows device bytes freed in forward and allocated again in backward, as on a GPU.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

# The module itself, not the top package (memfit/__init__), nor its names: a test stands in for
# CUDA by replacing device functions, which calls through ``dev.`` then reach.
import memfit.device as dev

from ..accounting.tiers import host_tier
from ..blocks import find_blocks
from ..targets.kernels import cuda_emulation_active
from ..techniques import ApplyContext, Technique
from .offload import OffloadConfig, offload_refusal

__all__ = ["ActivationOffloadHandle", "OffloadCounters", "apply_activation_offload"]

_ATTR = "_memfit_activation_offload"


@dataclass
class OffloadCounters:
    """What activation offload did, counted over every forward since apply (or a reset).

    Each storage is counted once per forward, however many tensors are saved from it.

    Attributes:
        offloaded_bytes: Bytes copied to host memory.
        offloaded_storages: Storages copied to host memory.
        kept_small_bytes: Bytes kept on the device because their storage was smaller than
            ``activation_min_bytes``.
        kept_over_bound_bytes: Bytes kept on the device because moving them would have taken
            the host copies past ``host_bytes``.
        restored_bytes: Bytes copied back to the device in backward (a storage whose device
            copy was freed between two uses, or a graph run backward twice, counts again).
        last_forward_offloaded_bytes: ``offloaded_bytes`` of the latest forward alone.
        last_forward_held_bytes: Of those, the bytes whose device storage something else still
            held when the forward returned (a tensor the model returns, a checkpointed block's
            keyword arguments): copied all the same, but the device keeps them until that
            holder lets go. The latest forward's device saving is
            ``last_forward_offloaded_bytes - last_forward_held_bytes``.
        host_peak_bytes: Most host bytes held at once.
    """

    offloaded_bytes: int = 0
    offloaded_storages: int = 0
    kept_small_bytes: int = 0
    kept_over_bound_bytes: int = 0
    restored_bytes: int = 0
    last_forward_offloaded_bytes: int = 0
    last_forward_held_bytes: int = 0
    host_peak_bytes: int = 0


class _Pool:
    """Host bytes held now by one handle's copies (updated when a copy is freed)."""

    def __init__(self, counters: OffloadCounters) -> None:
        self.live = 0
        self.counters = counters

    def add(self, nbytes: int) -> None:
        self.live += nbytes
        self.counters.host_peak_bytes = max(self.counters.host_peak_bytes, self.live)


class _Forward:
    """One forward's bookkeeping: the storages already seen, and its copies by block.

    Entries refer to it, and it refers to them weakly, so it lives as long as its graph does.
    """

    def __init__(self) -> None:
        # storage key -> (weak ref to the device storage, its version, entry or None (kept))
        self.seen: dict[int, tuple[weakref.ref, int, _HostCopy | None]] = {}
        self.groups: dict[int, list[weakref.ref]] = {}
        self.prefetched: set[int] = set()
        self.group = 0
        # Copies back run one block ahead as on a CUDA device, synchronously: a CUDA target's
        # kernels are emulated on the CPU (a dry run for a GPU), so its peak counts the block
        # copied back ahead as the GPU's does.
        self.emulated = False


class _HostCopy:
    """One storage's bytes in host memory, and its device copy while backward uses it."""

    __slots__ = ("__weakref__", "device", "event", "fwd", "group", "held", "host", "nbytes",
                 "pool", "prefetched", "restored", "waiting")

    def __init__(self, host: torch.Tensor, device: torch.device, pool: _Pool, fwd: _Forward,
                 group: int) -> None:
        self.host = host
        self.nbytes = host.numel()
        self.device = device
        self.pool = pool
        self.fwd = fwd
        self.group = group
        self.restored: weakref.ref | None = None  # the device copy (flat bytes), while alive
        self.prefetched: torch.Tensor | None = None  # copied back ahead, not used yet
        self.event: Any = None
        # Saved tensors of this storage that backward has not unpacked yet: while there are
        # any, the device copy is held (one copy back serves every use, e.g. a ReLU output
        # read by the next layer's backward and then by the ReLU's own).
        self.waiting = 0
        self.held: torch.Tensor | None = None
        pool.add(self.nbytes)

    def __del__(self) -> None:
        self.pool.live -= self.nbytes

    def device_copy(self) -> torch.Tensor | None:
        return self.restored() if self.restored is not None else None

    def done_one(self) -> None:
        """One saved tensor was unpacked (or freed unused): let go of the device copy after
        the last."""
        self.waiting -= 1
        if self.waiting <= 0:
            self.held = None


class _Saved:
    """What autograd holds for a moved tensor: its host copy and how to view it."""

    __slots__ = ("dtype", "entry", "offset", "pending", "size", "stride")

    def __init__(self, entry: _HostCopy, t: torch.Tensor) -> None:
        self.entry = entry
        self.dtype = t.dtype
        self.size = tuple(t.shape)
        self.stride = tuple(t.stride())
        self.offset = t.storage_offset()
        self.pending = True
        entry.waiting += 1

    def used(self) -> None:
        if self.pending:
            self.pending = False
            self.entry.done_one()

    def __del__(self) -> None:
        self.used()


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None  # sparse, nested and other storage-less tensors


def _movable(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes can be copied as they are: a plain dense tensor (or a dry run's
    fake one). Tensor subclasses (quantised weights, distributed tensors) and meta tensors
    stay where they are."""
    if t.is_meta or t.layout != torch.strided or t.is_quantized:
        return False
    return type(t) is torch.Tensor or dev.is_fake(t)


def _bytes_of(storage: torch.UntypedStorage, t: torch.Tensor) -> torch.Tensor:
    """The whole storage as a flat byte tensor on its device (a view of ``t``: ``set_`` would
    do too, but under fake tensors it keeps the storage alive)."""
    flat = t.as_strided((storage.nbytes() // t.element_size(),), (1,), 0)
    return flat.view(torch.uint8)


class _Offloader:
    """The hooks of one :func:`apply_activation_offload` call."""

    def __init__(self, model: nn.Module, config: OffloadConfig, counters: OffloadCounters) -> None:
        self.model = model
        self.config = config
        self.counters = counters
        self.pool = _Pool(counters)
        self.fwd = _Forward()
        self.skip: set[int] = set()
        self.depth = 0
        self.ctx: Any = None
        self.stream: Any = None  # the copy stream (CUDA only), made at the first copy
        self.stream_device: torch.device | None = None  # the device it copies to
        self.streamless: set[torch.device] = set()  # devices without streams (the CPU)
        self.device_type: str | None = None  # the compute device's (its parameters')

    # ------------------------------------------------------------------ model hooks
    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.depth += 1
        if self.depth > 1 or not torch.is_grad_enabled():
            return
        self.fwd = _Forward()
        self.counters.last_forward_offloaded_bytes = 0
        self.counters.last_forward_held_bytes = 0
        # Parameters, buffers and inputs stay alive anyway: a host copy would free nothing.
        held = [*module.parameters(), *module.buffers()]
        self.device_type = held[0].device.type if held else None
        held += [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        self.skip = {st._cdata for st in map(_storage, held) if st is not None}
        self.fwd.emulated = cuda_emulation_active()
        ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        ctx.__enter__()
        self.ctx = ctx

    def leave(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self.depth == 0:
            return  # an earlier pre-hook raised before ours ran
        self.depth -= 1
        if self.depth == 0:
            self.close()

    def close(self) -> None:
        ctx, self.ctx = self.ctx, None
        self.skip = set()
        for ref, _, entry in self.fwd.seen.values():
            if entry is not None and ref() is not None:
                self.counters.last_forward_held_bytes += entry.nbytes
        self.fwd.seen.clear()  # frees nothing but bookkeeping: no strong refs to storages
        if ctx is not None:
            ctx.__exit__(None, None, None)

    def block_boundary(self, *_: Any) -> None:
        self.fwd.group += 1

    # ------------------------------------------------------------------ saved tensors
    def pack(self, t: torch.Tensor) -> Any:
        st = _storage(t)
        if st is None or not _movable(t):
            return t.detach()
        key = st._cdata
        if key in self.skip or st.nbytes() == 0:
            return t.detach()  # held anyway, or nothing to move
        if self.device_type is not None and t.device.type != self.device_type:
            return t.detach()  # off the compute device already (a CPU tensor in a CUDA model)
        fwd = self.fwd
        seen = fwd.seen.get(key)
        # The same storage (alive, unchanged since) was seen in this forward: share its fate.
        if seen is not None and seen[0]() is st and seen[1] == t._version:
            entry = seen[2]
            return t.detach() if entry is None else self._saved(entry, t)
        nbytes = st.nbytes()
        entry = None
        bound = self.config.host_bytes
        if nbytes % t.element_size():
            pass  # not whole elements of t's dtype (a reinterpreted storage): kept, uncounted
        elif nbytes < self.config.activation_min_bytes:
            self.counters.kept_small_bytes += nbytes
        elif bound is not None and self.pool.live + nbytes > bound:
            self.counters.kept_over_bound_bytes += nbytes
        else:
            entry = self._to_host(t, st, nbytes)
        fwd.seen[key] = (weakref.ref(st), t._version, entry)
        return t.detach() if entry is None else self._saved(entry, t)

    def _to_host(self, t: torch.Tensor, st: torch.UntypedStorage, nbytes: int) -> _HostCopy:
        real = not dev.is_fake(t)  # a dry run's fake tensors: no streams, no pinning
        if real and self.stream is None and t.device not in self.streamless:
            self.stream = dev.copy_stream(t.device)  # None off CUDA
            if self.stream is None:
                self.streamless.add(t.device)
            else:
                self.stream_device = t.device
        with torch.no_grad():
            with host_tier():
                host = dev.empty_host(nbytes, pin=self.config.pin_memory and t.is_cuda and real)
            # Non-blocking from the compute stream: the copy is queued before anything that
            # could reuse the device storage once it is freed.
            host.copy_(_bytes_of(st, t), non_blocking=host.is_pinned())
        fwd = self.fwd
        entry = _HostCopy(host, t.device, self.pool, fwd, fwd.group)
        fwd.groups.setdefault(fwd.group, []).append(weakref.ref(entry))
        self.counters.offloaded_bytes += nbytes
        self.counters.offloaded_storages += 1
        self.counters.last_forward_offloaded_bytes += nbytes
        return entry

    @staticmethod
    def _saved(entry: _HostCopy, t: torch.Tensor) -> _Saved:
        return _Saved(entry, t)

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        entry = packed.entry
        buf = self._restore(entry)
        entry.held = buf
        packed.used()
        with torch.no_grad():
            return buf.view(packed.dtype).as_strided(packed.size, packed.stride, packed.offset)

    def _restore(self, entry: _HostCopy) -> torch.Tensor:
        """The storage's bytes on the device, as a flat byte tensor (copied back if needed)."""
        buf = entry.device_copy()
        if buf is not None:
            return buf
        if (self.stream is not None and entry.device == self.stream_device) or entry.fwd.emulated:
            self._prefetch_before(entry)
        buf = entry.prefetched
        if buf is not None:
            entry.prefetched = None
            dev.wait_for(entry.event, entry.device)
            dev.record_stream(buf, entry.device)
        else:
            with torch.no_grad():
                buf = torch.empty(entry.nbytes, dtype=torch.uint8, device=entry.device)
                buf.copy_(entry.host, non_blocking=entry.host.is_pinned())
            self.counters.restored_bytes += entry.nbytes
        # Weakly: the copy lives as long as the tensors handed to autograd (views of it) do.
        entry.restored = weakref.ref(buf)
        return buf

    def _prefetch_before(self, entry: _HostCopy) -> None:
        """Copy back, on the copy stream, the storages of the nearest earlier block that has
        any: backward needs them next (CUDA only)."""
        fwd = entry.fwd
        group = next((g for g in range(entry.group - 1, -1, -1) if g in fwd.groups), None)
        if group is None or group in fwd.prefetched:
            return
        fwd.prefetched.add(group)
        todo = [e for e in (r() for r in fwd.groups[group]) if e is not None]
        todo = [e for e in todo
                if e.device == entry.device and e.device_copy() is None and e.prefetched is None]  # fmt: skip
        if not todo:
            return
        # The copy stream starts after what the compute stream has queued so far.
        dev.stream_ready(self.stream, entry.device)
        with torch.no_grad(), dev.on_stream(self.stream):
            for e in todo:
                e.prefetched = torch.empty(e.nbytes, dtype=torch.uint8, device=e.device)
                e.prefetched.copy_(e.host, non_blocking=True)
                self.counters.restored_bytes += e.nbytes
        event = dev.record_event(self.stream)
        for e in todo:
            e.event = event


class ActivationOffloadHandle:
    """Activation offload applied to a model, its counters, and how to take it off.

    Attributes:
        model: The model.
        config: The offload config it was applied with.
        counters: What was moved and kept (:class:`OffloadCounters`).
        blocks: Qualified names of the blocks whose boundaries drive the CUDA prefetch.
    """

    def __init__(self, model: nn.Module, config: OffloadConfig,
                 offloader: _Offloader | None, hooks: list[Any], blocks: list[str]) -> None:
        self.model = model
        self.config = config
        self.counters = offloader.counters if offloader is not None else OffloadCounters()
        self.blocks = blocks
        self._offloader = offloader
        self._hooks = hooks

    @property
    def host_bytes_live(self) -> int:
        """Host bytes the copies hold now (freed with their autograd graphs)."""
        return self._offloader.pool.live if self._offloader is not None else 0

    @property
    def offloaded_bytes(self) -> int:
        """Bytes copied to host memory since apply (or the last :meth:`reset_counters`)."""
        return self.counters.offloaded_bytes

    @property
    def kept_bytes(self) -> int:
        """Bytes of saved tensors kept on the device (below the size threshold or past the
        host bound) since apply or the last reset; parameters, buffers and inputs not
        counted."""
        return self.counters.kept_small_bytes + self.counters.kept_over_bound_bytes

    def reset_counters(self) -> None:
        """Set every counter to zero (``host_peak_bytes`` to the bytes held now)."""
        c = self.counters
        for name in OffloadCounters.__dataclass_fields__:
            setattr(c, name, 0)
        c.host_peak_bytes = self.host_bytes_live

    def remove(self) -> None:
        """Take the hooks off the model (idempotent). Graphs built before keep their host
        copies until their backward runs or they are freed."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._offloader is not None:
            self._offloader.close()
            if self.model.__dict__.get(_ATTR) is self:
                del self.model.__dict__[_ATTR]
            self._offloader = None

    def __repr__(self) -> str:
        c = self.counters
        return (f"ActivationOffloadHandle(offloaded={c.offloaded_bytes}, "
                f"kept={self.kept_bytes}, host_live={self.host_bytes_live})")


def apply_activation_offload(model: nn.Module, config: OffloadConfig) -> ActivationOffloadHandle:
    """Move ``model``'s saved activations to host memory during forward, back in backward.

    Saves, on the device, the bytes of every saved storage that moves (the device keeps only
    what the forward itself still holds, the tensors below ``activation_min_bytes`` and those
    past ``host_bytes``). Costs two transfers per moved byte (down in forward, up in backward)
    and as many host bytes. On CUDA the transfers down are queued on the compute stream (its
    host buffers pinned when ``config.pin_memory``), the transfers up run one block ahead on a
    copy stream; on the CPU they are synchronous copies.

    ``config.host_bytes`` bounds the host bytes held at once by this model's copies, over every
    graph still waiting for its backward (several, when micro-batches' graphs overlap). Past
    it, saved storages stay on the device: since forward runs in order, these are the last
    ones saved (the layers nearest the loss, which backward needs first), and each costs its
    full size in device memory. The bound never makes the host hold more than it says.

    Apply it after activation checkpointing: then only what the checkpointed blocks keep (their
    inputs) and the unchecked parts' activations move. Under ``torch.no_grad()`` nothing is
    saved and nothing moves. Calling it again with the same config returns a handle on the
    same hooks; with another config it raises.

    Args:
        model: The model; its forward is the span during which saved tensors are offloaded.
        config: ``activations``, ``activation_min_bytes``, ``host_bytes`` and ``pin_memory``
            are used; with ``activations`` false nothing changes (a handle that does nothing).

    Returns:
        The :class:`ActivationOffloadHandle`; ``remove()`` takes the hooks off again.

    Raises:
        RuntimeError: when the model already has activation offload with another config.
    """
    existing: ActivationOffloadHandle | None = model.__dict__.get(_ATTR)
    if existing is not None:
        if existing.config == config:
            return existing
        raise RuntimeError(
            f"{type(model).__name__} already has activation offload with another config; call "
            "remove() on the handle apply_activation_offload returned before applying another"
        )
    if not config.activations:
        return ActivationOffloadHandle(model, config, None, [], [])
    offloader = _Offloader(model, config, OffloadCounters())
    hooks = [
        model.register_forward_pre_hook(offloader.enter, with_kwargs=True),
        # always_call: the hooks context is left even when the forward raises.
        model.register_forward_hook(offloader.leave, with_kwargs=True, always_call=True),
    ]
    blocks = find_blocks(model)
    for _, block in blocks:
        hooks.append(block.register_forward_pre_hook(offloader.block_boundary))
        hooks.append(block.register_forward_hook(offloader.block_boundary, always_call=True))
    handle = ActivationOffloadHandle(model, config, offloader, hooks, [n for n, _ in blocks])
    model.__dict__[_ATTR] = handle
    return handle


def _apply_technique(model: nn.Module, ctx: ApplyContext) -> ActivationOffloadHandle:
    handle = apply_activation_offload(model, ctx.plan.offload)
    ctx.info["activation_offload"] = handle
    return handle


def _check(plan: Any) -> None:
    """Activation offload's hooks are not traced by compile (``Technique.check``)."""
    off = plan.offload
    if off is not None and off.activations and plan.compile_backend is not None:
        raise ValueError(
            "activation offload cannot be combined with compile: the saved-tensor hooks "
            "that move activations to the host are not traced by torch.compile; set "
            "compile false or offload activations false"
        )


#: After checkpointing, so that only what the checkpointed blocks keep (their boundaries)
#: moves to the host; it keeps parameters as they are.
TECHNIQUE = Technique(
    name="activation_offload",
    plan_field="offload",
    order=70,
    is_on=lambda plan: plan.offload is not None and bool(plan.offload.activations),
    apply=_apply_technique,
    info_key="activation_offload",
    engines=frozenset({"single", "data"}),
    refusal=offload_refusal,
    label=lambda plan: "offload",
    check=_check,
)
