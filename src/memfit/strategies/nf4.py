"""QLoRA's 4-bit NormalFloat base layers: torchao's ``NF4Tensor``, dequantised in chunks.

The format is torchao's (``torchao.quantization.quantize_.workflows.nf4``): 4-bit NF4 codes,
two per byte, one 8-bit scale per block of :data:`BLOCK` weights, the scales double-quantised
(one factor per :data:`SCALER_BLOCK` scales, around their mean). It is made of ordinary tensors
and ATen ops, so it runs on CPU and under ``FakeTensorMode`` (see :mod:`memfit.strategies.lora`
for why torchao and not bitsandbytes).

torchao's own dequantisation (``NF4Tensor.get_original_weight``) widens every code to int64
before looking it up: for a 4096 x 14336 weight that is 940 MB of index temporaries per forward
and per backward, more than the layer's 4-bit weight eight times over. :func:`dequantize`
computes the same values (the same ops, in the same dtype: equal to the bit) a chunk of
:data:`CHUNK` codes at a time into one output of the compute dtype, so the temporaries are the
dequantised weight (2 bytes per weight in bf16, freed after its matmul) and one chunk's indices.
:class:`NF4Linear` uses it in forward and backward, keeping nothing but the 4-bit weight for
backward.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..accounting import replay
from ..device import is_fake

__all__ = [
    "BLOCK",
    "CHUNK",
    "SCALER_BLOCK",
    "SEP",
    "NF4Embedding",
    "NF4Linear",
    "dequantize",
    "has_nf4",
    "load_state_tensors",
    "nf4_module",
    "quantize",
    "state_tensors",
]

#: Weights per NF4 block (one 8-bit scale each): QLoRA's.
BLOCK = 64
#: Block scales per block of the double quantisation (one factor each): QLoRA's.
SCALER_BLOCK = 256
#: Bytes of 4-bit codes dequantised at once (each byte's two codes become int64 indices, so a
#: chunk's temporaries are about 32 bytes per byte here: 32 MiB).
CHUNK = 1 << 20


def nf4_module() -> Any:
    """torchao's NF4 module.

    Raises:
        ImportError: naming the extra to install.
    """
    from ..extras import import_extra

    # torchao missing: one sentence naming the extra (peft's, which brings torchao too).
    import_extra("torchao", "QLoRA (lora quantize_base 'nf4', --allow qlora)", "peft")
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError:
        try:  # older torchao kept it here
            from torchao.dtypes import nf4tensor as nf4_tensor
        except ImportError:
            nf4_tensor = None
    if nf4_tensor is None:
        raise ImportError(
            "QLoRA (lora quantize_base 'nf4') needs torchao's NF4 tensor, which this torchao "
            "lacks; install memfit's extra: pip install -U 'memfit[peft]' (it brings torchao)"
        ) from None
    return nf4_tensor


def quantize(weight: torch.Tensor) -> Any:
    """``weight`` as a torchao ``NF4Tensor`` (blocks of :data:`BLOCK`, scales double-quantised
    in blocks of :data:`SCALER_BLOCK`, or of the largest divisor of the scale count below it
    for a small layer, which torchao needs whole). ``weight.numel()`` must be a multiple of
    :data:`BLOCK`."""
    n_blocks = weight.numel() // BLOCK
    scaler = math.gcd(n_blocks, SCALER_BLOCK)
    module = nf4_module()
    weight = weight.detach().contiguous()
    if is_fake(weight) and not _tracked():
        return _shapes_only(module, weight, scaler)
    return module.to_nf4(weight, BLOCK, scaler)


def _tracked() -> bool:
    """Whether a memory tracker is open (then quantising's temporaries are counted)."""
    from ..accounting.tracker import _OPEN

    return bool(_OPEN)


def _shapes_only(module: Any, weight: torch.Tensor, scaler: int) -> Any:
    """torchao's ``to_nf4`` of a fake ``weight`` without finding each weight's nearest code.

    On fake tensors the codes have no values, and finding them is most of quantising: torchao
    compares every weight with the 16 levels a chunk at a time, which for an 8B model's
    embedding table and layers was 40% of a QLoRA dry run (each dry run builds and quantises
    its model again). The codes' tensor is the one torchao returns (``uint8``, two codes a
    byte, contiguous, a storage of its own); the scales are torchao's own double
    quantisation. Only untracked (a dry run quantises before its tracker opens, which then
    counts the 4-bit weight as a parameter): inside a tracker, quantising's temporaries count.
    """
    cls = module.NF4Tensor
    convert = cls.__dict__["convert_to_norm_float_weight"]

    def codes(input_tensor: torch.Tensor, n_blocks: int, block_size: int, nf4: Any) -> Any:
        return torch.empty(input_tensor.numel() // 2, dtype=torch.uint8, device=input_tensor.device)

    cls.convert_to_norm_float_weight = staticmethod(codes)
    try:
        return module.to_nf4(weight, BLOCK, scaler)
    finally:
        cls.convert_to_norm_float_weight = convert


def dequantize(t: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The weight ``t`` (an ``NF4Tensor``) stands for, in ``dtype`` (default its own), equal to
    torchao's ``t.get_original_weight().to(dtype)``, computed :data:`CHUNK` bytes of codes at a
    time."""
    scalers = t.dequantize_scalers(t.quantized_scalers, t.quantization_factor, t.scaler_block_size)
    data = t.quantized_data
    half = t.block_size // 2  # bytes per block
    out = torch.empty(data.numel(), 2, dtype=t.dtype, device=data.device)
    step = max(half, CHUNK // half * half)  # whole blocks per chunk
    fake = is_fake(data)
    for lo in range(0, data.numel(), step):
        hi = min(lo + step, data.numel())
        if fake:
            _dry_chunk(t, data, scalers, out, lo, hi, half)
        else:
            _chunk(t, data, scalers, out, lo, hi, half)
    weight = out.view(t.shape)
    return weight if dtype is None or dtype == t.dtype else weight.to(dtype)


def _chunk(
    t: Any, data: torch.Tensor, scalers: torch.Tensor, out: torch.Tensor, lo: int, hi: int, half: int
) -> None:
    """Dequantise codes ``lo:hi`` of ``t`` into ``out`` (its temporaries die here)."""
    codes = data[lo:hi]
    scale = scalers[lo // half : hi // half].unsqueeze(-1).expand(-1, half).reshape(-1)
    # torchao's arithmetic, op for op: the code's value in the table, times its block's
    # scale, in the tensor's dtype; the high nibble is the first of each pair.
    out[lo:hi, 0] = t.nf4[(codes >> 4).to(torch.long)] * scale
    out[lo:hi, 1] = t.nf4[(codes & 0b1111).to(torch.long)] * scale


def _dry_chunk(
    t: Any, data: torch.Tensor, scalers: torch.Tensor, out: torch.Tensor, lo: int, hi: int, half: int
) -> None:
    """:func:`_chunk` on fake tensors, replayed into the tracker when an identical chunk was
    dispatched earlier in the step (:mod:`memfit.accounting.replay`).

    A chunk's temporaries (its codes widened to indices, the looked-up values, the scales)
    are all born and freed inside it, and their sizes follow from the chunk's length and the
    dtypes alone: an 8B model's 4096 x 14336 weight is 28 equal chunks, dequantised in every
    forward, recomputation and backward of every block. The replay records the same births
    and deaths in the same order, so the report (peaks, phases, the caching allocator's
    reserved bytes) is the one dispatching would give; only the dispatch is saved.
    """
    key = (
        "nf4-dequantize-chunk",
        hi - lo,
        half,
        t.nf4.dtype,
        tuple(t.nf4.shape),
        scalers.dtype,
        out.dtype,
        data.dtype,
        data.device.type,
    )
    rec = replay.begin(key)
    if rec is None:
        _chunk(t, data, scalers, out, lo, hi, half)
        return
    if rec.replay():
        return
    try:
        _chunk(t, data, scalers, out, lo, hi, half)
    except BaseException:
        rec.abandon()
        raise
    rec.finish()


class _LinearNF4(torch.autograd.Function):
    """``x @ W.T`` with ``W`` 4-bit: dequantised in forward and again in backward, so only the
    4-bit weight is kept for backward (the base is frozen: no weight gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.weight = weight
        return torch.nn.functional.linear(x, dequantize(weight, x.dtype))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad @ dequantize(ctx.weight, grad.dtype), None


class NF4Linear(nn.Module):
    """A frozen linear layer whose weight is 4-bit NF4 (QLoRA's base layer).

    Attributes:
        weight: The ``NF4Tensor`` (a parameter that does not require grad).
        bias: The bias, kept in its dtype and frozen (``None`` when the layer had none).
        in_features: Input width (as ``nn.Linear``'s, which peft's adapters read).
        out_features: Output width.
    """

    def __init__(self, weight: Any, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Autocast does not see into the autograd function: give it the dtype autocast would
        # run a linear layer in, so the matmul is the half-precision one of the plain layer.
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        y = _LinearNF4.apply(x, self.weight)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nf4"


# ---------------------------------------------------------------------------- checkpoints
#: The tensors an ``NF4Tensor`` is made of, each stored under ``<parameter>.<SEP><name>`` in a
#: checkpoint (safetensors stores plain tensors only).
_INNER = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")
SEP = "nf4."


def has_nf4(model: nn.Module) -> bool:
    """Whether ``model`` has a 4-bit NF4 weight (without importing torchao when it has none)."""
    return any(isinstance(m, (NF4Linear, NF4Embedding)) for m in model.modules())


def state_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state as plain tensors for safetensors: each NF4 weight as the tensors it is
    made of (stored as they are: a checkpoint keeps the 4-bit base, never re-quantises it), a
    tensor shared by several names (tied weights) once, under its first name."""
    nf4 = nf4_module()
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        if isinstance(t, nf4.NF4Tensor):
            for attr in _INNER:
                out[f"{name}.{SEP}{attr}"] = getattr(t, attr).detach().contiguous()
        else:
            out[name] = t.detach().contiguous()
    return out


def load_state_tensors(
    model: nn.Module, tensors: dict[str, torch.Tensor]
) -> tuple[list[str], list[str]]:
    """Copy :func:`state_tensors`' output into ``model`` in place.

    Returns:
        The names ``model`` has that ``tensors`` lacks, and those ``tensors`` has that
        ``model`` lacks (nothing is loaded when either is not empty).
    """
    nf4 = nf4_module()
    state = model.state_dict(keep_vars=True)
    pairs: list[tuple[torch.Tensor, str]] = []
    missing: list[str] = []
    seen: set[int] = set()
    for name, t in state.items():
        if id(t) in seen:
            continue  # a tied name: loaded with the first
        seen.add(id(t))
        keys = (
            [(getattr(t, a), f"{name}.{SEP}{a}") for a in _INNER]
            if isinstance(t, nf4.NF4Tensor)
            else [(t, name)]
        )
        for target, key in keys:
            (pairs.append((target, key)) if key in tensors else missing.append(key))
    unexpected = sorted(set(tensors) - {key for _, key in pairs})
    if missing or unexpected:
        return missing, unexpected
    with torch.no_grad():
        for target, key in pairs:
            target.copy_(tensors[key])
    return [], []


class NF4Embedding(nn.Module):
    """A frozen embedding table in 4-bit NF4 (``LoraConfig.quantize_embeddings``).

    A lookup dequantises only the rows it reads (each row is whole blocks when the width is a
    multiple of :data:`BLOCK`), with torchao's arithmetic: the values equal the rows of
    :func:`dequantize`'s table. Memory: 0.5 bytes per weight plus the scales instead of 2 (bf16)
    or 4; a lookup's temporaries are its rows' codes and values.

    Attributes:
        weight: The ``NF4Tensor`` (a parameter that does not require grad).
        padding_idx: As ``nn.Embedding``'s (only read by code that inspects it).
    """

    def __init__(self, weight: Any, padding_idx: int | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.padding_idx = padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = self.weight
        width, half = self.embedding_dim, t.block_size // 2
        blocks = width // t.block_size  # blocks per row
        rows = ids.reshape(-1)
        codes = t.quantized_data.view(self.num_embeddings, width // 2)[rows]
        scalers = t.quantized_scalers.view(self.num_embeddings, blocks)[rows]
        index = rows.unsqueeze(-1) * blocks + torch.arange(blocks, device=rows.device)
        factor = t.quantization_factor[index // t.scaler_block_size]
        # torchao's dequantize_scalers, element for element.
        scale = (scalers / factor).to(t.dtype) + t.scaler_mean
        scale = scale.unsqueeze(-1).expand(-1, -1, half).reshape(rows.numel(), width // 2)
        first = t.nf4[(codes >> 4).to(torch.long)] * scale
        second = t.nf4[(codes & 0b1111).to(torch.long)] * scale
        return torch.stack([first, second], dim=-1).reshape(*ids.shape, width)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, nf4"
