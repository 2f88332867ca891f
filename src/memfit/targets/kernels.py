"""Emulate a CUDA GPU's kernels on the CPU, so dry runs keep what a GPU run would keep.

A dry run executes on CPU (fake) tensors, so PyTorch dispatches the CPU's kernels. Where a
GPU's kernels keep different tensors for backward, the dry run's memory would follow the CPU.
We cannot fake a CUDA device instead (on a CPU-only build autograd aborts on ``cuda`` fake
tensors), so :class:`KernelEmulation`, a :class:`~torch.overrides.TorchFunctionMode`, replaces
the few calls whose memory differs by CPU computations that allocate and save what the GPU's
kernels would:

* **Attention.** ``scaled_dot_product_attention`` picks its backend as PyTorch's CUDA
  dispatcher would for the target (:func:`sdpa_backend`, following
  ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``: ``can_use_flash_attention``,
  ``can_use_mem_efficient_attention``, ``select_sdp_backend``). The fused backends keep the
  output and a batch x heads x L log-sum-exp, never the L x L probabilities; the emulation
  computes with the CPU's fused kernel and saves exactly those tensors, plus the GPU backward's
  own fp32 workspaces (flash attention's ``softmax_d`` and ``dq_accum``; see ``mha_bwd`` in
  ``flash_attn/flash_api.cpp``). Where the GPU would fall back to the math path, so does the
  emulation (``_scaled_dot_product_attention_math``), dropout included.
* **Dropout.** On CUDA, ``dropout`` runs the fused ``native_dropout`` and keeps a 1-byte bool
  mask; on CPU it multiplies by a noise tensor of the input's dtype (4 bytes in fp32). The
  emulation calls ``native_dropout``.
* **Autocast.** CUDA's autocast policy differs from the CPU's (``ATen/autocast_mode.h``,
  ``AT_FORALL_FP32`` and friends, against ``autocast_mode.cpp``'s ``AutocastCPU`` list): on a GPU
  ``layer_norm``, ``rms_norm``, ``exp``, ``pow``, ``rsqrt``... run in fp32 and ``softmax``,
  ``log_softmax``, ``sum``, ``cumsum``... return fp32; ``cross_entropy`` is not cast whole to
  fp32 (its ``log_softmax`` returns fp32 from a bf16 input). Inside CPU autocast, the
  emulation applies the CUDA rules to those ops; the rest (``linear``, ``matmul``, ``bmm``...
  in bf16 with the weight-cast cache) the two devices share, and CPU autocast does it.

What the emulation does not change: values (attention dropout is not applied by the emulated
fused kernels, whose randomness lives inside the GPU kernel; a real run under emulation trains
without attention dropout), kernels' private scratch memory that never passes through
PyTorch's allocator, and every op whose memory is the same on both devices.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .profiles import DeviceProfile

__all__ = ["KernelEmulation", "cuda_emulation_active", "emulate", "sdpa_backend"]

_LOW = (torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------- attention
def sdpa_backend(
    profile: DeviceProfile,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
) -> str:
    """The attention backend PyTorch's CUDA dispatcher would pick on ``profile``.

    Returns ``"flash"``, ``"efficient"`` or ``"math"`` (cuDNN attention, first on Hopper with
    a recent cuDNN, keeps the same tensors as flash attention: output plus fp32 statistics;
    it is modelled as flash). The checks follow ``sdp_utils.cpp``, for dense 4-D inputs
    with the default priority order (flash, memory-efficient, math).
    """
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "math"  # check_tensor_shapes: fused kernels take 4-D inputs only
    cc = profile.compute_capability or (0, 0)
    d_q, d_k, d_v = query.shape[-1], key.shape[-1], value.shape[-1]
    lq, lk = query.shape[-2], key.shape[-2]
    dtype = query.dtype
    if min(lq, lk) == 0:
        return "math"  # check_nonzero_sequence_lengths_dense
    gqa_ok = query.shape[1] % key.shape[1] == 0 and key.shape[1] == value.shape[1]
    # can_use_flash_attention
    if (
        attn_mask is None  # check_for_attn_mask
        and d_q == d_k == d_v
        and d_q <= 256  # check_head_dim_size_flash
        and (8, 0) <= cc <= (12, 1)  # check_flash_attention_hardware_support
        and dtype in _LOW  # check_dtypes_low_precision
        and not (is_causal and lq != lk)  # check_flash_causal_non_square_seqlens
        and not (d_q > 192 and cc in ((8, 6), (8, 9), (12, 0)))
        and gqa_ok
    ):
        return "flash"
    # can_use_mem_efficient_attention: its dense constraints instantiate
    # check_batch_size_and_num_heads_dense<false>, so grouped-query heads (fewer key/value
    # heads than query heads, enable_gqa) are not its: fp32 GQA attention (Llama 3 in fp32)
    # runs the math kernel, which saves the attention weights. Measured on an H200: a dry
    # run that took efficient here under-predicted llama-1b's fp32 peak by 9%
    # (benchmarks/results/gpu_h200.md).
    is_half = dtype in _LOW
    tensor_cores = cc >= (8, 0) or (cc >= (7, 0) and is_half)
    alignment = 4 if cc >= (8, 0) else 1  # minimum_gemm_alignment
    if tensor_cores:
        alignment = max(alignment, 128 // (16 if is_half else 32))
    dtypes = (torch.float16, torch.float32, torch.bfloat16) if cc >= (8, 0) else (
        torch.float16,
        torch.float32,
    )
    if (
        cc >= (5, 0)
        and d_q == d_k
        and d_q % alignment == 0
        and d_v % alignment == 0
        and dtype in dtypes
        and query.shape[1] == key.shape[1] == value.shape[1]
    ):
        return "efficient"
    return "math"


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


class _FusedAttention(torch.autograd.Function):
    """Attention as a GPU's fused kernel keeps it: output and log-sum-exp saved, nothing L x L.

    Computed with the CPU's flash kernel (``_scaled_dot_product_flash_attention_for_cpu``),
    whose saved tensors have the GPU kernels' sizes; the flash backend's and the efficient
    backend's differences (padded log-sum-exp, RNG state, backward workspaces) are allocated
    where the GPU allocates them.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None,
        dropout_p: float,
        is_causal: bool,
        scale: float | None,
        backend: str,
    ) -> torch.Tensor:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale
        )
        b, h, lq = query.shape[0], query.shape[1], query.shape[2]
        extra: list[torch.Tensor] = []
        if backend == "efficient":
            # The efficient kernel pads its log-sum-exp to a multiple of 32 queries
            # (meta__scaled_dot_product_efficient_attention).
            padded = lse.new_empty(b, h, _round_up(lq, 32))
            padded[..., :lq].copy_(lse)
            lse = padded
        elif dropout_p > 0:
            # Flash attention with dropout keeps its Philox RNG state (two int64) for backward.
            extra.append(torch.empty(2, dtype=torch.int64, device=query.device))
        tensors = [query, key, value, out, lse, *extra]
        if attn_mask is not None:
            tensors.append(attn_mask)
        ctx.save_for_backward(*tensors)
        ctx.has_mask = attn_mask is not None
        ctx.meta = (is_causal, scale, backend, lq)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        saved = ctx.saved_tensors
        query, key, value, out, lse = saved[:5]
        attn_mask = saved[-1] if ctx.has_mask else None
        is_causal, scale, backend, lq = ctx.meta
        if backend == "efficient":
            lse = lse[..., :lq]
        b, h, d = query.shape[0], query.shape[1], query.shape[-1]
        work: list[torch.Tensor] = []
        if backend == "flash":
            # mha_bwd allocates softmax_d (B, H, Lq rounded to 128) and dq_accum
            # (B, Lq rounded to 128, H, D rounded to 32 or 64) in fp32 before its kernel runs.
            lq_r = _round_up(lq, 128)
            d_r = _round_up(d, 32 if d <= 128 else 64)
            work.append(torch.empty(b, h, lq_r, dtype=torch.float32, device=query.device))
            work.append(torch.empty(b, lq_r, h, d_r, dtype=torch.float32, device=query.device))
        else:
            # The efficient backward keeps a (B, H, Lq) fp32 delta = rowsum(dO * O).
            work.append(torch.empty(b, h, lq, dtype=torch.float32, device=query.device))
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out.contiguous(),
            query,
            key,
            value,
            out,
            lse.contiguous(),
            0.0,
            is_causal,
            attn_mask=attn_mask,
            scale=scale,
        )
        del work
        return grads[0], grads[1], grads[2], None, None, None, None, None


def _sdpa_args(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> tuple[Any, ...]:
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


# ---------------------------------------------------------------------------------- autocast
# CUDA autocast's fp32 ops that CPU autocast leaves in the input dtype (ATen/autocast_mode.h,
# AT_FORALL_FP32, against the AutocastCPU registrations in ATen/autocast_mode.cpp).
_CUDA_FP32 = frozenset(
    {
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
        "reciprocal", "rsqrt", "sinh", "tan", "pow", "__pow__", "__rpow__", "softplus",
        "layer_norm", "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm",
        "nuclear_norm", "cosine_similarity", "dist", "pdist", "renorm", "logsumexp",
    }
)  # fmt: skip
# AT_FORALL_FP32_SET_OPT_DTYPE: run in fp32 (output fp32) unless a dtype is given.
_CUDA_FP32_SET_DTYPE = frozenset(
    {"prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm",
     "linalg_matrix_norm", "sum"}
)  # fmt: skip
# AT_FORALL_LOWER_PRECISION_FP ops that CPU autocast does not cast.
_CUDA_LOWER = frozenset({"einsum", "mv", "addmv", "addr", "chain_matmul", "linalg_multi_dot"})
_AUTOCAST_NAMES = _CUDA_FP32 | _CUDA_FP32_SET_DTYPE | _CUDA_LOWER


def _cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and obj.dtype != torch.float64 and obj.dtype != dtype:
            return obj.to(dtype)
        return obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_floats(x, dtype) for x in obj)
    return obj


def _first_tensor(args: tuple[Any, ...]) -> torch.Tensor | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    return None


class KernelEmulation(TorchFunctionMode):
    """A torch-function mode that makes CPU execution keep a CUDA target's tensors.

    Args:
        profile: The CUDA target (``profile.is_cuda``).

    Attributes:
        backends: How many attention calls took each backend (``flash``, ``efficient``,
            ``math``), for reports.
    """

    def __init__(self, profile: DeviceProfile) -> None:
        super().__init__()
        if not profile.is_cuda:
            raise ValueError(f"kernel emulation is for CUDA targets; {profile.name!r} is not one")
        self.profile = profile
        self.backends: dict[str, int] = {"flash": 0, "efficient": 0, "math": 0}
        self._handlers: dict[str, Callable[..., Any]] = {
            "scaled_dot_product_attention": self._attention,
            "dropout": self._dropout,
            "cross_entropy": self._cross_entropy,
        }

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        handler = self._handlers.get(name)
        if handler is not None:
            return handler(func, args, kwargs)
        if name == "backward":
            return self._backward(func, args, kwargs)
        if name in _AUTOCAST_NAMES and torch.is_autocast_enabled("cpu"):
            return self._autocast(name, func, args, kwargs)
        return func(*args, **kwargs)

    # -------------------------------------------------------------- handlers
    def _backward(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # A mode is suspended while it handles a call, and backward runs checkpointing's
        # recomputation, which must take the same kernels as the forward did. Calling
        # backward again under the mode would dispatch back here, so run autograd's engine
        # directly, with the mode on, after torch.autograd.backward's own preparation.
        from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
        from torch.autograd.graph import _engine_run_backward

        if func is torch.Tensor.backward:
            names = ("tensors", "grad_tensors", "retain_graph", "create_graph", "inputs")
        else:
            names = ("tensors", "grad_tensors", "retain_graph", "create_graph", "grad_variables",
                     "inputs")  # fmt: skip
        bound = dict(zip(names, args, strict=False)) | kwargs
        if "gradient" in bound:
            bound["grad_tensors"] = bound.pop("gradient")
        tensors = bound["tensors"]
        tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
        inputs = bound.get("inputs")
        inputs = () if inputs is None else (
            (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        )
        create_graph = bool(bound.get("create_graph", False))
        retain_graph = bound.get("retain_graph")
        with self:
            grads = _tensor_or_tensors_to_tuple(bound.get("grad_tensors"), len(tensors))
            grads = _make_grads(tensors, grads, is_grads_batched=False)
            _engine_run_backward(
                tensors,
                grads,
                create_graph if retain_graph is None else retain_graph,
                create_graph,
                inputs,
                allow_unreachable=True,
                accumulate_grad=True,
            )

    def _attention(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        q, k, v, mask, dropout_p, is_causal, scale, enable_gqa = _sdpa_args(*args, **kwargs)
        if torch.is_autocast_enabled("cpu"):
            # On CUDA scaled_dot_product_attention is in autocast's lower-precision list.
            low = torch.get_autocast_dtype("cpu")
            q, k, v, mask = (_cast_floats(t, low) for t in (q, k, v, mask))
        if q.shape[1] != k.shape[1] and not enable_gqa:
            return func(*args, **kwargs)  # the real call raises its own shape error
        backend = sdpa_backend(self.profile, q, k, v, mask, is_causal)
        if backend != "math" and mask is not None and mask.dtype == torch.bool:
            # The CPU kernel takes additive masks; the GPU converts a bool mask the same way.
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(
                ~mask, -math.inf
            )
        self.backends[backend] += 1
        with torch.autocast("cpu", enabled=False):
            if backend == "math":
                out, _ = torch.ops.aten._scaled_dot_product_attention_math(
                    q, k, v, mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
                )
                return out
            return _FusedAttention.apply(q, k, v, mask, float(dropout_p), is_causal, scale, backend)

    def _dropout(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        names = ("input", "p", "training", "inplace")
        bound = dict(zip(names, args, strict=False)) | kwargs
        x, p = bound["input"], float(bound.get("p", 0.5))
        if not bound.get("training", True) or bound.get("inplace", False) or not 0 < p < 1:
            return func(*args, **kwargs)
        if not isinstance(x, torch.Tensor) or x.numel() == 0:
            return func(*args, **kwargs)
        # CUDA's fused dropout (at::dropout's is_fused_kernel_acceptable): a bool mask is kept.
        return torch.native_dropout(x, p, True)[0]

    def _cross_entropy(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        names = ("input", "target", "weight", "size_average", "ignore_index", "reduce",
                 "reduction", "label_smoothing")  # fmt: skip
        bound = dict(zip(names, args, strict=False)) | kwargs
        x = bound["input"]
        plain = (
            torch.is_autocast_enabled("cpu")
            and isinstance(x, torch.Tensor)
            and x.dtype in _LOW
            and not bound.get("label_smoothing")
            and bound.get("size_average") is None
            and bound.get("reduce") is None
            and bound["target"].dtype in (torch.int64, torch.int32)
        )
        if not plain:
            return func(*args, **kwargs)
        # CUDA autocast leaves cross_entropy_loss alone; inside it, log_softmax returns fp32
        # from the low-precision logits (no fp32 copy of the logits, as the CPU makes).
        with torch.autocast("cpu", enabled=False):
            logp = F.log_softmax(x, dim=1 if x.dim() > 1 else 0, dtype=torch.float32)
            return F.nll_loss(
                logp,
                bound["target"],
                weight=_cast_floats(bound.get("weight"), torch.float32),
                ignore_index=bound.get("ignore_index", -100),
                reduction=bound.get("reduction", "mean"),
            )

    def _autocast(
        self, name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if name in _CUDA_FP32:
            args, kwargs = _cast_floats(args, torch.float32), {
                k: _cast_floats(v, torch.float32) for k, v in kwargs.items()
            }
        elif name in _CUDA_LOWER:
            low = torch.get_autocast_dtype("cpu")
            args = _cast_floats(args, low)
            kwargs = {k: _cast_floats(v, low) for k, v in kwargs.items()}
        else:
            first = _first_tensor(args) if args else kwargs.get("input")
            if (
                isinstance(first, torch.Tensor)
                and first.is_floating_point()
                and first.dtype != torch.float64
                and kwargs.get("dtype") is None
                and _dtype_not_positional(name, args)
            ):
                kwargs = {**kwargs, "dtype": torch.float32}
        with torch.autocast("cpu", enabled=False):
            return func(*args, **kwargs)


def _dtype_not_positional(name: str, args: tuple[Any, ...]) -> bool:
    # softmax(input, dim, _stacklevel, dtype) and Tensor.softmax(dim, dtype): a dtype given
    # positionally is kept; so are integer-typed reductions.
    return not any(isinstance(a, torch.dtype) for a in args)


def cuda_emulation_active() -> bool:
    """Whether a :class:`KernelEmulation` is active here (a CUDA target's kernels emulated on
    the CPU); ``False`` inside one of its own handlers, which run with the mode suspended."""
    from torch.overrides import _get_current_function_mode_stack

    return any(isinstance(m, KernelEmulation) for m in _get_current_function_mode_stack())


def emulate(profile: DeviceProfile) -> Any:
    """The context that makes execution keep ``profile``'s tensors: a :class:`KernelEmulation`
    for CUDA targets, nothing for the CPU (it is what runs)."""
    import contextlib

    if profile.is_cuda:
        return KernelEmulation(profile)
    return contextlib.nullcontext()
