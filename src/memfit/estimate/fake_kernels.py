"""Fake-tensor kernels that follow the real kernels' capabilities, for dry runs.

A dry run computes shapes with each operator's fake (meta) implementation. Where that is
stricter than the kernel a real run would use, the dry run would fail on a model the real run
trains, so :func:`real_kernel_rules` installs, for the duration of a dry run only, fake
implementations that do what the real kernel does:

* ``aten._grouped_mm`` (mixture-of-experts layers in transformers route their experts through
  it): its meta implementation follows the CUDA kernel and accepts bf16 only; the CPU kernel
  also takes fp32 and fp16 and returns a contiguous output of the inputs' dtype. The output's
  shape rules are the meta implementation's own (``_create_grouped_mm_output_tensor``).
* ``aten.native_layer_norm_backward``: its meta implementation (a decomposition) gives the
  input's gradient the strides of the output's gradient; the CPU and CUDA kernels allocate it
  contiguous (``empty_like`` of the contiguous input, ``LEGACY_CONTIGUOUS_MEMORY_FORMAT``).
  A transposed gradient arriving at a LayerNorm (Swin's stages hand their output on
  permuted) then made every later ``view`` of it a copy in the dry run only. Fake tensors try
  an op's Python decomposition before these rules, so the decomposition is set aside while
  the rule is installed (outside fake tensors, the op then runs as itself: same values).
* The normalisations that save statistics for backward (``native_layer_norm``,
  ``native_group_norm`` and the batch norms): on CPU, a bf16 or fp16 input with fp32 affine
  weights or running statistics (what autocast leaves a norm with) gets fp32 mean and rstd
  from the real kernel (ATen's ``is_mixed_type``), while the meta implementation gives them the
  input's dtype: half the bytes a real run keeps for every norm of the model.
  :class:`~memfit.estimate.fast_fake.DryFakeTensorMode` corrects the result (the batch norms
  have no meta kernel, so no rule here would see them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .values import DryRunValues, _is_dynamic, dynamic_shape_rule

__all__ = ["dry_tensors", "real_kernel_rules"]

aten = torch.ops.aten


def _grouped_mm(
    fake_mode: Any,
    func: Any,
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> Any:
    if mat_a.dtype == torch.bfloat16 and mat_b.dtype == torch.bfloat16:
        return NotImplemented  # the meta implementation covers it
    from torch._meta_registrations import _create_grouped_mm_output_tensor
    from torch._subclasses.fake_impls import in_kernel_invocation_manager
    from torch._subclasses.fake_tensor import FakeTensor

    device = mat_a.device
    torch._check(mat_a.dtype == mat_b.dtype, lambda: "grouped_mm: inputs of one dtype")
    with in_kernel_invocation_manager(fake_mode):
        out = _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)
        out = torch.empty(out.shape, dtype=out.dtype, device="meta")  # contiguous, as on CPU
    return FakeTensor(fake_mode, out, device)


def _layer_norm_backward(
    fake_mode: Any,
    func: Any,
    grad_out: torch.Tensor,
    input: torch.Tensor,
    normalized_shape: Any,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    output_mask: Any,
) -> Any:
    from torch._subclasses.fake_impls import in_kernel_invocation_manager
    from torch._subclasses.fake_tensor import FakeTensor

    # As layer_norm_backward_cpu / _cuda: each gradient asked for is a contiguous tensor like
    # the (contiguous) input, weight or bias it belongs to.
    likes = (input, weight, bias)
    devices = [t.device if t is not None else None for t in likes]
    outs: list[Any] = []
    with in_kernel_invocation_manager(fake_mode):
        for wanted, like, device in zip(output_mask, likes, devices, strict=True):
            if not wanted or like is None:
                outs.append(None)
                continue
            grad = torch.empty(like.shape, dtype=like.dtype, device="meta")
            outs.append(FakeTensor(fake_mode, grad, device))
    return tuple(outs)


_RULES = (
    (lambda func: func is aten.native_layer_norm_backward.default, _layer_norm_backward),
    (lambda func: func is aten._grouped_mm.default, _grouped_mm),
    # Data-dependent shapes and values: replayed from constants or by the stated policy
    # (:mod:`memfit.estimate.values`); without an open DryRunValues, fake tensors' own rules.
    (_is_dynamic, dynamic_shape_rule),
)


#: Ops whose rule above replaces the Python decomposition fake tensors would otherwise take.
_UNDECOMPOSED = (aten.native_layer_norm_backward.default,)


def _same_module_to(original: Any) -> Any:
    """``nn.Module.to`` that returns the module untouched when nothing would change.

    A real ``module.to(dtype)`` to the dtype the module already has sets each parameter's
    ``.data`` to itself, which costs nothing. On fake parameters ``Module._apply`` swaps the
    tensors instead, which fails once autograd holds a parameter (a model that casts its router
    to its own dtype inside ``forward``, as Switch Transformers does). Dry runs skip the no-op.
    """

    def to(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if memory_format is None:
            tensors = [*self.parameters(), *self.buffers()]
            same = all(
                (device is None or t.device == device)
                and (dtype is None or not (t.is_floating_point() or t.is_complex()) or t.dtype == dtype)
                for t in tensors
            )
            if same:
                return self
        return original(self, *args, **kwargs)

    return to


@contextlib.contextmanager
def real_kernel_rules() -> Iterator[None]:
    """Install the fake implementations above while a dry run is open, then remove them."""
    from torch._decomp import decomposition_table
    from torch._subclasses.fake_impls import op_implementations_checks

    original_to = torch.nn.Module.to
    torch.nn.Module.to = _same_module_to(original_to)  # type: ignore[method-assign]
    set_aside = {op: decomposition_table.pop(op) for op in _UNDECOMPOSED if op in decomposition_table}

    added = [rule for rule in _RULES if rule not in op_implementations_checks]
    # Checked in order: ours go first, ahead of any broader rule.
    for rule in reversed(added):
        op_implementations_checks.insert(0, rule)
    try:
        yield
    finally:
        torch.nn.Module.to = original_to  # type: ignore[method-assign]
        decomposition_table.update(set_aside)
        for rule in added:
            if rule in op_implementations_checks:
                op_implementations_checks.remove(rule)


@contextlib.contextmanager
def dry_tensors(
    *, expert_load: float = 1.0, where: Callable[[], str | None] | None = None
) -> Iterator[DryRunValues]:
    """Fake tensors as every dry run uses them: the fake kernels above and the values and
    data-dependent policies of :mod:`memfit.estimate.values`."""
    from .fast_fake import DryFakeTensorMode

    values = DryRunValues(expert_load=expert_load, where=where)
    with real_kernel_rules(), DryFakeTensorMode(allow_non_fake_inputs=True), values:
        yield values
