"""Block-wise 8-bit quantisation: code books, nearest rounding, block isolation, edge cases."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.optim.quantization import (
    SIGNED_MAP,
    UNSIGNED_MAP,
    Minifloat8,
    dequantize_blockwise,
    dynamic_tree_map,
    quantize_blockwise,
)

MAPS = [SIGNED_MAP, UNSIGNED_MAP, Minifloat8(signed=True, exponent_bits=4, mantissa_bits=3)]


@pytest.mark.parametrize("fmt", MAPS, ids=repr)
def test_minifloat_table_shape_and_range(fmt: Minifloat8) -> None:
    table = fmt.table()
    assert table.shape == (256,) and table.dtype == torch.float32
    assert table[0] == 0.0
    assert table[fmt.max_magnitude_code] == 1.0
    assert table.abs().max() == 1.0
    magnitudes = table[1 : fmt.max_magnitude_code + 1]
    assert torch.all(magnitudes[1:] > magnitudes[:-1]), "magnitude codes must be increasing"
    assert magnitudes[0] == pytest.approx(fmt.smallest_positive)
    if fmt.signed:
        assert torch.equal(table[128:], -table[:128])


@pytest.mark.parametrize("fmt", MAPS, ids=repr)
def test_encode_is_nearest_code(fmt: Minifloat8) -> None:
    torch.manual_seed(0)
    low = -1.0 if fmt.signed else 0.0
    # Uniform values plus log-uniform small ones, so every binade is exercised.
    x = torch.cat([torch.rand(20_000) * (1 - low) + low, 10 ** (-6 * torch.rand(20_000))])
    if fmt.signed:
        x[-10_000:] *= -1
    above = x.abs() >= fmt.smallest_positive  # below it the flush/no-flush rules apply
    table = fmt.table()
    codes = fmt.encode(x)
    dist = (x[:, None] - table[None, :]).abs()
    chosen = dist.gather(1, codes.long()[:, None]).squeeze(1)
    assert torch.equal(chosen[above], dist.min(dim=1).values[above])
    assert torch.equal(fmt.decode(codes), table[codes.long()])


def test_relative_precision_of_default_maps() -> None:
    torch.manual_seed(0)
    for fmt in (SIGNED_MAP, UNSIGNED_MAP):
        x = 10 ** (-2 * torch.rand(100_000))  # 0.01 .. 1, inside both ranges
        rel = (fmt.decode(fmt.encode(x)) - x).abs() / x
        assert rel.max() <= 1 / 32 + 1e-6  # half a step of a 4-bit mantissa
        assert rel.mean() < 0.015


def test_small_values_flush_or_stay_positive() -> None:
    tiny = torch.tensor([0.0, 1e-30, 1e-9, SIGNED_MAP.smallest_positive / 4])
    assert SIGNED_MAP.encode(tiny).tolist() == [0, 0, 0, 0]
    assert SIGNED_MAP.decode(SIGNED_MAP.encode(-tiny)).abs().max() == 0.0
    # A positive second moment never becomes zero (that would divide by eps in Adam).
    tiny_u = torch.tensor([0.0, 1e-30, 1e-9, UNSIGNED_MAP.smallest_positive / 4])
    assert UNSIGNED_MAP.encode(tiny_u).tolist() == [0, 1, 1, 1]
    assert UNSIGNED_MAP.encode(torch.tensor([-0.5, 2.0])).tolist() == [0, 255]


def test_minifloat_needs_eight_bits() -> None:
    with pytest.raises(ValueError, match="8 bits"):
        Minifloat8(signed=True, exponent_bits=4, mantissa_bits=4)


def test_dynamic_tree_map() -> None:
    for signed in (True, False):
        code = dynamic_tree_map(signed)
        assert code.shape == (256,)
        assert torch.all(code[1:] > code[:-1]), "sorted and without duplicates"
        assert code.max() == 1.0 and (0.0 in code.tolist())
        assert code.min() == (-code[-2] if signed else 0.0)
        # Seven decades of dynamic range below 1.
        assert code[code > 0].min() < 1e-6


@pytest.mark.parametrize(
    "code", [SIGNED_MAP, dynamic_tree_map(True)], ids=["minifloat", "dynamic_tree"]
)
@pytest.mark.parametrize("shape", [(1000, 37), (256,), (3, 5), (4096,)])
def test_roundtrip_shapes_and_error(code, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    x = torch.randn(shape)
    codes, absmax = quantize_blockwise(x, code, block_size=256)
    assert codes.shape == x.shape and codes.dtype == torch.uint8
    n_blocks = -(-x.numel() // 256)
    assert absmax.shape == (n_blocks,) and absmax.dtype == torch.float32
    flat = torch.nn.functional.pad(x.flatten(), (0, n_blocks * 256 - x.numel()))
    torch.testing.assert_close(absmax, flat.view(n_blocks, 256).abs().amax(1), rtol=0, atol=0)
    y = dequantize_blockwise(codes, absmax, code, block_size=256)
    assert y.shape == x.shape
    # Each block's maximum is exact; elsewhere the error is below 3.2 % of the block maximum
    # (half a step at the top binade / top decade).
    bound = absmax.repeat_interleave(256)[: x.numel()].view(shape)
    assert torch.all((y - x).abs() <= 0.032 * bound)
    if isinstance(code, Minifloat8):  # +-1.0 are codes, so block maxima are exact
        top = x.abs().flatten().argmax()
        assert torch.equal(y.flatten()[top], x.flatten()[top])


def test_unsigned_roundtrip_relative_error() -> None:
    torch.manual_seed(0)
    x = torch.randn(10_000).square()  # like Adam's second moment
    codes, absmax = quantize_blockwise(x, UNSIGNED_MAP)
    y = dequantize_blockwise(codes, absmax, UNSIGNED_MAP)
    big = x > 1e-4 * absmax.repeat_interleave(256)[: x.numel()]
    assert ((y - x).abs() / x)[big].max() <= 1 / 32 + 1e-6
    assert torch.all(y[x > 0] > 0)


def test_blocks_are_independent() -> None:
    torch.manual_seed(0)
    x = torch.randn(1024) * 1e-3
    clean_codes, clean_absmax = quantize_blockwise(x)
    x_outlier = x.clone()
    x_outlier[5] = 1e3  # lands in block 0 only
    codes, absmax = quantize_blockwise(x_outlier)
    assert torch.equal(codes[256:], clean_codes[256:])
    assert torch.equal(absmax[1:], clean_absmax[1:])


def test_zero_blocks_and_low_precision_input() -> None:
    x = torch.zeros(300)
    codes, absmax = quantize_blockwise(x, UNSIGNED_MAP)
    y = dequantize_blockwise(codes, absmax, UNSIGNED_MAP)
    assert torch.equal(y, x) and not torch.isnan(y).any()
    xb = torch.randn(512, dtype=torch.bfloat16)
    codes, absmax = quantize_blockwise(xb)
    yb = dequantize_blockwise(codes, absmax, dtype=torch.bfloat16)
    assert yb.dtype == torch.bfloat16
    # Values under 0.0044 * absmax (about 0.016 here) flush to zero: hence the atol.
    torch.testing.assert_close(yb.float(), xb.float(), rtol=0.04, atol=0.02)


def test_bad_absmax_length() -> None:
    codes, absmax = quantize_blockwise(torch.randn(600))
    with pytest.raises(ValueError, match="absmax"):
        dequantize_blockwise(codes, absmax[:-1])


def test_runs_under_fake_tensor_mode() -> None:
    with FakeTensorMode():
        x = torch.randn(1000)
        for code in (SIGNED_MAP, UNSIGNED_MAP, dynamic_tree_map(True)):
            codes, absmax = quantize_blockwise(x.abs() if code is UNSIGNED_MAP else x, code)
            y = dequantize_blockwise(codes, absmax, code)
            assert codes.dtype == torch.uint8 and absmax.shape == (4,) and y.shape == (1000,)
    # The fake run must not leave fake tables behind for real tensors.
    codes, absmax = quantize_blockwise(torch.ones(4))
    assert dequantize_blockwise(codes, absmax).tolist() == [1.0] * 4
