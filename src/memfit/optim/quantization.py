"""Block-wise dynamic 8-bit quantisation for optimizer state.

This follows the recipe of *8-bit Optimizers via Block-wise Quantization* (Dettmers et al.,
2022): a tensor is cut into blocks of ``block_size`` consecutive elements, every block is
normalised by its own absolute maximum (kept in fp32), and the normalised values in ``[-1, 1]``
are rounded to the nearest entry of a 256-entry *non-linear* code book.  Block-wise
normalisation confines an outlier's damage to its own block, and a non-linear code book gives
both small and large values a useful relative precision.

Two kinds of code book are supported:

* :class:`Minifloat8` (the default, used by :class:`memfit.optim.AdamW8bit`): a tiny
  floating-point format whose largest code is exactly ``1.0``.  Because it *is* a float format,
  encoding is closed-form integer arithmetic on the fp32 bit pattern (no search), which keeps
  quantisation at a few element-wise kernels and makes it cheap on CPU.
  :data:`SIGNED_MAP` (sign + 3 exponent + 4 mantissa bits, values from about 4.4e-3 to 1) is
  for signed state such as Adam's first moment, :data:`UNSIGNED_MAP` (4 exponent + 4 mantissa
  bits, no sign, about 1.7e-5 to 1) for non-negative state such as the second moment, whose
  square-root is what matters and whose range is therefore twice as wide in decades.  Both
  round to within 3 % (relative) of the value, about 1 % on average.  In Adam simulations they
  tracked fp32 AdamW at least as closely as the dynamic tree map below.
* A plain sorted tensor of 256 values, e.g. :func:`dynamic_tree_map`, the paper's dynamic tree
  code.  Rounding then uses ``torch.bucketize`` on the mid-points between entries: exact nearest
  rounding for any code book, but a binary search per element, so it is several times slower.

Promises of :func:`quantize_blockwise` / :func:`dequantize_blockwise` (and of the optimizer's
:func:`quantize_blocks_` / :func:`dequantize_blocks`):

* With a :class:`Minifloat8` map, a value ``x`` in a block of absolute maximum ``m``
  decodes to within ``|x| * 2**-(mantissa_bits + 1) + smallest_positive * m`` of itself (plus
  fp32 rounding) for blocks of any finite magnitude, denormal ones (``m < 2**-126``) included:
  each value is *divided* by its block's maximum, a correctly rounded quotient of magnitude at
  most 1, where a multiplication by ``1 / m`` would overflow (``1 / m`` is not finite in fp32
  for ``m < 2**-128``).  A decoded denormal is itself rounded to fp32's denormal grid
  (``2**-149`` apart).
* With an unsigned :class:`Minifloat8`, a positive value never decodes to zero, however small
  its ratio to the block maximum (even below fp32's smallest denormal).
* All-zero blocks decode to exact zeros; a non-finite value spoils only its own block.
* Empty tensors round-trip to empty tensors (no codes, no block maxima).

All functions are pure PyTorch, device agnostic and free of data-dependent Python control flow,
so they also run under ``FakeTensorMode``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

import torch
from torch import Tensor

__all__ = [
    "SIGNED_MAP",
    "UNSIGNED_MAP",
    "CodeMap",
    "Minifloat8",
    "dequantize_blocks",
    "dequantize_blockwise",
    "dynamic_tree_map",
    "quantize_blocks_",
    "quantize_blockwise",
]


def _is_fake(t: Tensor) -> bool:
    """Whether ``t`` is a FakeTensor (its values must never be cached or inspected)."""
    try:
        from torch._subclasses.fake_tensor import FakeTensor
    except ImportError:  # pragma: no cover - very old torch
        return False
    return isinstance(t, FakeTensor)


@dataclass(frozen=True)
class Minifloat8:
    """An 8-bit mini-float code book whose largest magnitude is exactly 1.0.

    A code byte ``c`` holds an optional sign bit (bit 7 when ``signed``) and a magnitude
    ``k = c & (2**(exponent_bits + mantissa_bits) - 1)``.  Magnitude 0 is zero; any other ``k``
    is the fp32 number whose bit pattern is ``(k + offset) << (23 - mantissa_bits)``, i.e. the
    codes are consecutive fp32 values truncated to ``mantissa_bits`` of mantissa, with ``offset``
    chosen so that the largest ``k`` is 1.0.  Rounding to the nearest code is then "add half a
    code step to the bit pattern and shift", which is exact nearest rounding (ties away from zero)
    everywhere above the smallest code.

    Below the smallest positive code, signed maps flush to zero (harmless for a first moment)
    while unsigned maps round *up* to the smallest positive code and keep only exact zeros (and
    negative inputs, which are out of contract) at zero: a second moment that is wrongly zero
    would make Adam divide by ``eps`` and explode.  Block-wise quantisation keeps that promise
    for positive values whose ratio to the block maximum underflows fp32 to zero (see
    :func:`quantize_blocks_`).

    Attributes:
        signed: Whether bit 7 is a sign bit.
        exponent_bits: Number of exponent bits (sets the dynamic range: ``2**exponent_bits``
            binades below 1.0).
        mantissa_bits: Number of mantissa bits (sets the relative precision, ``2**-mantissa_bits``
            per binade).
    """

    signed: bool
    exponent_bits: int = 4
    mantissa_bits: int = 3

    def __post_init__(self) -> None:
        if self.exponent_bits + self.mantissa_bits + int(self.signed) != 8:
            raise ValueError("a Minifloat8 must use exactly 8 bits (sign + exponent + mantissa)")
        if not 1 <= self.exponent_bits <= 7 or self.mantissa_bits < 0:
            raise ValueError("exponent_bits must be in [1, 7] and mantissa_bits >= 0")

    @property
    def max_magnitude_code(self) -> int:
        """Largest magnitude code (the code of 1.0)."""
        return (1 << (self.exponent_bits + self.mantissa_bits)) - 1

    @property
    def _shift(self) -> int:
        return 23 - self.mantissa_bits

    @property
    def _offset(self) -> int:
        # (max_code + offset) << shift must be the bit pattern of 1.0, i.e. 127 << 23.
        return (127 << self.mantissa_bits) - self.max_magnitude_code

    @property
    def smallest_positive(self) -> float:
        """Smallest positive value the code book represents."""
        bits = (1 + self._offset) << self._shift
        return torch.tensor(bits, dtype=torch.int32).view(torch.float32).item()

    def encode(self, x: Tensor) -> Tensor:
        """Round normalised fp32 values to code bytes.

        Args:
            x: fp32 tensor with values in ``[-1, 1]`` (``[0, 1]`` for unsigned maps). Values
                outside saturate to the extreme codes.

        Returns:
            uint8 tensor of the same shape.
        """
        return self._encode_int32(x).to(torch.uint8)

    def _encode_int32(self, x: Tensor, unscaled: Tensor | None = None) -> Tensor:
        # The codes as int32 in [0, 255]: callers that copy into a uint8 buffer skip a cast.
        # ``unscaled`` (fp32, x's shape): the values before normalisation.  Unsigned maps lift
        # its positive entries to code 1, also where x / absmax underflowed to 0.
        bits = x.to(torch.float32).contiguous().view(torch.int32)
        # Subtracting (offset << shift) re-bases the bit pattern so that the code step is one
        # unit after the shift; adding half a step first makes the truncating shift round to
        # nearest.  Folding both into one constant saves a full pass over the data.
        bias = (self._offset << self._shift) - (1 << (self._shift - 1))
        top = self.max_magnitude_code
        if self.signed:
            mag = torch.bitwise_and(bits, 0x7FFFFFFF)
            mag.sub_(bias).bitwise_right_shift_(self._shift).clamp_(0, top)
            # Arithmetic shift keeps the sign in bit 7 of the low byte.
            sign = torch.bitwise_right_shift(bits, 24).bitwise_and_(0x80)
            return mag.bitwise_or_(sign)
        code = torch.sub(bits, bias).bitwise_right_shift_(self._shift)
        # max(code, min(bits, 1)) lifts every positive input to at least code 1 (no flush to
        # zero) while exact zeros and negative inputs stay at or below 0 before the clamp.  The
        # sign test reads the unscaled bits where given: they are positive exactly where the
        # value is, and the same one pass over memory as reading x's.
        sign_bits = bits if unscaled is None else unscaled.view(torch.int32)
        code = torch.maximum(code, sign_bits.clamp(max=1))
        return code.clamp_(0, top)

    def table(self, device: torch.device | str | None = None) -> Tensor:
        """The 256 decoded values, indexed by code byte (not sorted for signed maps)."""
        return _minifloat_table(self, torch.device(device) if device is not None else None)

    def decode(self, codes: Tensor) -> Tensor:
        """Decode code bytes to fp32 values in ``[-1, 1]``."""
        if _is_fake(codes):
            # A cached real table cannot mix with fake tensors; build a throw-away fake one.
            with codes.fake_mode:  # type: ignore[attr-defined]
                table = _build_minifloat_table(self).to(codes.device)
        else:
            table = self.table(codes.device)
        # A 256-entry gather is a cheap, vectorised decode (int32 indices are the fast path).
        return table.index_select(0, codes.reshape(-1).to(torch.int32)).view(codes.shape)


#: Signed map for first moments: sign, 3 exponent bits, 4 mantissa bits (about 4.4e-3 .. 1).
SIGNED_MAP = Minifloat8(signed=True, exponent_bits=3, mantissa_bits=4)
#: Unsigned map for second moments: 4 exponent bits, 4 mantissa bits (about 1.7e-5 .. 1).
UNSIGNED_MAP = Minifloat8(signed=False, exponent_bits=4, mantissa_bits=4)

#: A code book: a :class:`Minifloat8` or a sorted 1-D tensor of 256 values in ``[-1, 1]``.
CodeMap: TypeAlias = Minifloat8 | Tensor

_TABLE_CACHE: dict[tuple[Minifloat8, str], Tensor] = {}


def _build_minifloat_table(fmt: Minifloat8) -> Tensor:
    codes = torch.arange(256, dtype=torch.int32)
    top = fmt.max_magnitude_code
    mag = codes & top
    bits = ((mag + fmt._offset) << fmt._shift) * (mag != 0)
    if fmt.signed:
        bits = bits | ((codes & 0x80) << 24)
    else:
        # Bytes above the largest code never come out of encode(); saturate them to 1.0.
        bits = torch.where(codes > top, torch.tensor(127 << 23, dtype=torch.int32), bits)
    return bits.view(torch.float32)


def _minifloat_table(fmt: Minifloat8, device: torch.device | None) -> Tensor:
    key = (fmt, str(device))
    table = _TABLE_CACHE.get(key)
    if table is None:
        table = _build_minifloat_table(fmt)
        if _is_fake(table):
            # Created under an active FakeTensorMode: usable now, never cached for real runs.
            return table.to(device) if device is not None else table
        if device is not None:
            table = table.to(device)
        _TABLE_CACHE[key] = table
    return table


def dynamic_tree_map(signed: bool = True) -> Tensor:
    """The dynamic tree code book of Dettmers (2016), as a sorted tensor of 256 values.

    After the sign bit, the number of leading zero bits ``e`` selects the decade
    ``10**-e`` and the bits after the first one-bit (the indicator) are a linear fraction
    inside ``[0.1, 1]`` of that decade.  Large magnitudes therefore get many fraction bits and
    tiny ones few, spanning seven decades.  Each fraction is represented by the centre of its
    interval.  Zero and ``1.0`` complete the book to 256 entries.

    Args:
        signed: Build the signed book (one bit less for the fraction, mirrored around zero) or
            the unsigned one.

    Returns:
        fp32 tensor of shape ``(256,)`` sorted ascending.
    """
    payload_bits = 7 if signed else 8
    decades = 7
    values: list[float] = []
    for e in range(decades):
        fraction_bits = payload_bits - 1 - e
        n = 1 << fraction_bits
        step = 0.9 / n
        values.extend(10.0**-e * (0.1 + step * (k + 0.5)) for k in range(n))
    magnitudes = sorted(values)
    book = [0.0, 1.0, *magnitudes]
    if signed:
        book.extend(-v for v in magnitudes)
    if len(book) != 256:  # pragma: no cover - construction invariant
        raise AssertionError(f"dynamic tree map has {len(book)} entries")
    return torch.tensor(sorted(book), dtype=torch.float32)


def _num_blocks(n: int, block_size: int) -> int:
    return -(-n // block_size)


def _as_blocks(flat: Tensor, block_size: int) -> Tensor:
    """View a 1-D tensor as ``(blocks, block_size)``, zero-padding a partial last block."""
    rem = flat.numel() % block_size
    if rem:
        # Zero padding changes neither a block's absmax nor its codes (0 encodes to 0).
        flat = torch.nn.functional.pad(flat, (0, block_size - rem))
    return flat.view(-1, block_size)


def _encode(scaled: Tensor, code: CodeMap) -> Tensor:
    if isinstance(code, Minifloat8):
        return code.encode(scaled)
    code = code.to(device=scaled.device, dtype=torch.float32)
    midpoints = (code[1:] + code[:-1]) * 0.5
    return torch.bucketize(scaled, midpoints, out_int32=True).to(torch.uint8)


def _decode(q: Tensor, code: CodeMap) -> Tensor:
    if isinstance(code, Minifloat8):
        return code.decode(q)
    code = code.to(device=q.device, dtype=torch.float32)
    return code.index_select(0, q.reshape(-1).to(torch.int32)).view(q.shape)


def _divisor(absmax: Tensor) -> Tensor:
    """Each block's maximum as a ``(blocks, 1)`` divisor, with 1 for all-zero blocks (0 / 0)."""
    m = absmax.view(-1, 1)
    # Not a clamp to a tiny floor: with denormals flushed (torch.set_flush_denormal) a
    # denormal floor reads as 0 again.  A NaN maximum stays NaN: its block shows the fault.
    return torch.where(m == 0, 1.0, m)


def quantize_blocks_(blocks: Tensor, code: CodeMap, codes_out: Tensor, absmax_out: Tensor) -> None:
    """Quantise whole blocks into preallocated outputs (the optimizer's hot path).

    :func:`quantize_blockwise` runs exactly these operations, so a reference built on the
    public helpers reproduces the optimizer's codes bit for bit.

    Each block is divided by its maximum rather than multiplied by its reciprocal: the
    reciprocal of a denormal maximum overflows (or, clamped, costs the block all relative
    precision), the quotient never does, and it is correctly rounded, at the same cost (one
    memory-bound pass).  Unsigned :class:`Minifloat8` maps lift every positive input to a
    positive code, read from ``blocks`` itself, since the quotient may underflow to zero.

    Args:
        blocks: fp32 tensor of shape ``(num_blocks, block_size)``.
        code: Code book.
        codes_out: uint8 tensor with ``blocks.numel()`` elements, overwritten.
        absmax_out: fp32 tensor with ``num_blocks`` elements, overwritten.
    """
    if isinstance(code, Minifloat8) and not code.signed:
        # Non-negative data by contract: skip the abs pass (the clamp guards bad input).
        torch.amax(blocks, dim=1, out=absmax_out.view(-1)).clamp_(min=0.0)
    else:
        torch.amax(blocks.abs(), dim=1, out=absmax_out.view(-1))
    scaled = blocks / _divisor(absmax_out)
    if isinstance(code, Minifloat8):
        unscaled = None if code.signed else blocks
        codes_out.view(-1).copy_(code._encode_int32(scaled, unscaled).view(-1))
    else:
        codes_out.view(-1).copy_(_encode(scaled, code).view(-1))


def dequantize_blocks(codes: Tensor, absmax: Tensor, code: CodeMap) -> Tensor:
    """Decode whole blocks: uint8 ``codes`` of ``absmax.numel() * block_size`` elements.

    Returns:
        fp32 tensor of shape ``(num_blocks, block_size)`` (a fresh tensor, safe to update).
    """
    blocks = absmax.numel()
    # Explicit width: with no blocks, view(0, -1) is ambiguous and raises.
    width = codes.numel() // blocks if blocks else 0
    values = _decode(codes.reshape(-1), code).view(blocks, width)
    return values.mul_(absmax.unsqueeze(1))


def quantize_blockwise(
    x: Tensor, code: CodeMap = SIGNED_MAP, block_size: int = 256
) -> tuple[Tensor, Tensor]:
    """Quantise ``x`` block-wise to 8-bit codes.

    The flattened tensor is split into blocks of ``block_size`` elements (the last one may be
    partial), each block is divided by its absolute maximum and rounded to ``code``.

    Args:
        x: Tensor of any floating dtype and shape.
        code: Code book: :data:`SIGNED_MAP` (default), :data:`UNSIGNED_MAP` (for non-negative
            data), any :class:`Minifloat8`, or a sorted tensor of 256 values such as
            :func:`dynamic_tree_map`.
        block_size: Elements per block.

    Returns:
        ``(codes, absmax)``: uint8 codes with the shape of ``x`` and fp32 per-block maxima of
        shape ``(ceil(numel / block_size),)``.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    flat = x.detach().reshape(-1).to(torch.float32)
    blocks = _as_blocks(flat, block_size)
    codes = torch.empty(blocks.numel(), dtype=torch.uint8, device=x.device)
    absmax = torch.empty(blocks.shape[0], dtype=torch.float32, device=x.device)
    quantize_blocks_(blocks, code, codes, absmax)
    return codes[: flat.numel()].view(x.shape), absmax


def dequantize_blockwise(
    codes: Tensor,
    absmax: Tensor,
    code: CodeMap = SIGNED_MAP,
    block_size: int = 256,
    *,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Invert :func:`quantize_blockwise`.

    Args:
        codes: uint8 codes (any shape; blocks run over the flattened tensor).
        absmax: fp32 per-block maxima, ``ceil(codes.numel() / block_size)`` of them.
        code: The code book used for quantisation.
        block_size: Elements per block.
        dtype: Output dtype.

    Returns:
        Tensor with the shape of ``codes`` and dtype ``dtype``.
    """
    n = codes.numel()
    if absmax.numel() != _num_blocks(n, block_size):
        raise ValueError(
            f"absmax has {absmax.numel()} entries, expected {_num_blocks(n, block_size)} "
            f"for {n} codes in blocks of {block_size}"
        )
    flat = codes.reshape(-1)
    rem = n % block_size
    if rem:
        flat = torch.nn.functional.pad(flat, (0, block_size - rem))
    values = dequantize_blocks(flat, absmax.to(torch.float32), code).view(-1)[:n]
    return values.view(codes.shape).to(dtype)
