"""Fake tensors for dry runs, with a faster dispatch-cache key.

:class:`~torch._subclasses.fake_tensor.FakeTensorMode` caches the output metadata of every op
it runs, keyed by the op and its arguments' metadata. Building that key is general Python code
(symbolic sizes, sparse layouts, subgraph arguments, ...) and costs a dry run about a third of
its dispatch time. A dry run's tensors are plain: dense, strided, of concrete sizes, made by
this mode. :class:`DryFakeTensorMode` builds the key for such arguments directly, element for
element the list torch's own code builds (so the cache sees the same keys and hits and misses
alike), and hands any other argument list to torch's code unchanged.

What torch lacks here: a fast path for the common case of its cache key. The one other
difference: the saved statistics of a mixed-type norm on CPU take the real kernel's dtype
(:func:`cpu_norm_stats`), a correction the cache then keeps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._prims_common import suggest_memory_format
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, _BypassDispatchCache

__all__ = ["NORMS", "UNCACHED", "DryFakeTensorMode", "cpu_norm_stats"]

_SCALARS = frozenset(
    (
        int,
        float,
        bool,
        str,
        type(None),
        torch.dtype,
        torch.device,
        torch.layout,
        torch.memory_format,
    )
)


#: The normalisations whose outputs 1 and 2 are the saved mean and rstd (or invstd).
NORMS = frozenset(
    (
        torch.ops.aten.native_layer_norm.default,
        torch.ops.aten.native_group_norm.default,
        torch.ops.aten.native_batch_norm.default,
        torch.ops.aten._native_batch_norm_legit.default,
        torch.ops.aten._native_batch_norm_legit.no_stats,
        torch.ops.aten._native_batch_norm_legit_no_training.default,
        torch.ops.aten._native_batch_norm_legit_functional.default,
        torch.ops.aten._batch_norm_with_update.default,
        torch.ops.aten._batch_norm_no_update.default,
    )
)
#: Ops whose dry-run result differs from a plain fake mode's (:data:`NORMS`, corrected by
#: :func:`cpu_norm_stats`; the layer norm backward, by
#: :func:`memfit.estimate.fake_kernels.real_kernel_rules`): kept out of the shared cache.
UNCACHED = NORMS | {torch.ops.aten.native_layer_norm_backward.default}
#: The arguments whose dtype decides a mixed-type norm on CPU.
_NORM_PARAMS = ("weight", "bias", "running_mean", "running_var")


def cpu_norm_stats(fake_mode: Any, func: Any, args: Any, kwargs: Any, out: Any) -> Any:
    """``out`` of a norm in :data:`NORMS`, with the saved mean and rstd the CPU kernel makes.

    Applied to the fake implementation's result (the batch norms have no meta kernel: fake
    tensors run their Python decomposition, which ``op_implementations_checks`` rules
    never see). Anything but a mixed-type norm on CPU is returned unchanged.
    """
    names = [a.name for a in func._schema.arguments]
    bound = dict(zip(names, args, strict=False)) | dict(kwargs)
    x = bound["input"]
    if x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float16):
        return out  # elsewhere the meta implementations are the reference (they follow CUDA)
    params = (bound.get(n) for n in _NORM_PARAMS)
    if not any(isinstance(p, torch.Tensor) and p.dtype != x.dtype for p in params):
        return out  # not mixed: the stats take the input's dtype, as in the meta
    from torch._subclasses.fake_impls import in_kernel_invocation_manager

    outs = list(out)
    device = outs[1].device  # read outside the kernel invocation, where it would say meta
    with in_kernel_invocation_manager(fake_mode):
        for i in (1, 2):
            meta = torch.empty_strided(
                outs[i].shape, outs[i].stride(), dtype=torch.float32, device="meta"
            )
            outs[i] = FakeTensor(fake_mode, meta, device)
    return tuple(outs)


class _Slow(Exception):
    """An argument the fast key does not handle: torch's own code builds the key."""


class DryFakeTensorMode(FakeTensorMode):
    """A :class:`FakeTensorMode` whose dispatch-cache key is built faster for plain tensors.

    Args:
        poll: Called every 64 ops this mode dispatches, cached ones included (it may raise to
            stop the run): a dry run's chance to stop in backward too, where no module's
            forward starts. ``None``: nothing is called.
        **kwargs: :class:`FakeTensorMode`'s.
    """

    def __init__(self, *, poll: Callable[[], None] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._poll = poll
        self._polled_ops = 0
        if poll is not None:
            # Only a polled mode pays for the extra call on every op.
            self.dispatch = self._polled_dispatch  # type: ignore[method-assign]

    def _polled_dispatch(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        assert self._poll is not None
        self._polled_ops += 1
        if not self._polled_ops & 63:
            self._poll()
        return FakeTensorMode.dispatch(self, func, types, args, kwargs or {})

    def _dispatch_impl(  # type: ignore[override]
        self, func: Any, types: Any, args: Any, kwargs: Any
    ) -> Any:
        out = super()._dispatch_impl(func, types, args, kwargs)
        if func in NORMS:
            out = cpu_norm_stats(self, func, args, kwargs, out)
        return out

    def _cache_key(self, state: Any, func: Any, args: Any, kwargs: Any) -> Any:  # type: ignore[override]
        # torch keeps one dispatch cache for every fake mode, keyed without the mode: a result
        # this mode corrects (norm statistics, the layer norm backward's layout under
        # real_kernel_rules) must neither be read from a plain fake mode's entries nor left
        # for one to read. Those few ops are never cached here.
        if func in UNCACHED:
            raise _BypassDispatchCache("memfit dry run: corrected op")
        return super()._cache_key(state, func, args, kwargs)

    def _prep_args_for_hash(  # type: ignore[override]
        self, result: list[object], args: Any, state: Any, id_hashed_objects: list[object]
    ) -> None:
        kind = type(args)
        if kind is tuple or kind is list or kind is dict:
            out: list[object] = []
            try:
                if kind is dict:
                    # torch's order: the dict's type and length, then its keys, then its values.
                    out.append(dict)
                    out.append(f"length_{len(args)}")
                    for arg in args:
                        self._fast_arg(out, arg)
                    for arg in args.values():
                        self._fast_arg(out, arg)
                else:
                    self._fast_args(out, args)
            except _Slow:
                pass
            else:
                result.extend(out)
                return
        super()._prep_args_for_hash(result, args, state, id_hashed_objects)

    def _fast_args(self, out: list[object], args: tuple[Any, ...] | list[Any]) -> None:
        out.append(type(args))
        out.append(f"length_{len(args)}")
        for arg in args:
            self._fast_arg(out, arg)

    def _fast_arg(self, out: list[object], arg: Any) -> None:
        kind = type(arg)
        if kind is FakeTensor:
            self._fast_tensor(out, arg)
        elif kind in _SCALARS:
            out.append(kind)
            out.append(arg)
        elif kind is tuple or kind is list or kind is torch.Size:
            self._fast_args(out, arg)
        else:
            raise _Slow

    def _fast_tensor(self, out: list[object], t: FakeTensor) -> None:
        # The fields of torch's TensorMetadata, flattened in its order (see
        # torch._subclasses.fake_tensor.extract_tensor_metadata and _flatten_into).
        if (
            t.fake_mode is not self
            or t.constant is not None
            or t.layout is not torch.strided
            or t._has_symbolic_sizes_strides
        ):
            raise _Slow
        shape = t.shape
        stride = t.stride()
        memory_format: torch.memory_format | None = suggest_memory_format(t)
        if not t.is_contiguous(memory_format=memory_format):
            memory_format = None
        append = out.append
        append(t.dtype)
        append(torch.Size)
        append(f"length_{len(shape)}")
        for d in shape:
            append(int)
            append(d)
        append(tuple)
        append(f"length_{len(stride)}")
        for s in stride:
            append(int)
            append(s)
        out.extend(
            (
                t.device,
                torch.strided,
                memory_format,
                t.storage_offset(),
                t.untyped_storage().nbytes(),
                t.requires_grad,
                t.is_quantized,
                t.is_conj(),
                t.is_neg(),
                t.is_inference(),
                False,  # is_sparse
                None,  # is_coalesced
                None,  # dense_dim
                None,  # sparse_dim
            )
        )
