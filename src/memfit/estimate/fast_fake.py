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
(:func:`~memfit.estimate.fake_kernels.cpu_norm_stats`), a correction the cache then keeps.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._prims_common import suggest_memory_format
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from .fake_kernels import NORMS, cpu_norm_stats

__all__ = ["DryFakeTensorMode"]

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


class _Slow(Exception):
    """An argument the fast key does not handle: torch's own code builds the key."""


class DryFakeTensorMode(FakeTensorMode):
    """A :class:`FakeTensorMode` whose dispatch-cache key is built faster for plain tensors."""

    def _dispatch_impl(  # type: ignore[override]
        self, func: Any, types: Any, args: Any, kwargs: Any
    ) -> Any:
        out = super()._dispatch_impl(func, types, args, kwargs)
        if func in NORMS:
            out = cpu_norm_stats(self, func, args, kwargs, out)
        return out

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
