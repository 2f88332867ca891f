"""Property-based tests of the block-wise 8-bit quantiser: ``dequantise(quantise(x))`` stays
within the code book's error bound for any sizes, block sizes and values, including all-zero
blocks, odd sizes and partial blocks; a non-finite value spoils only its own block.

The bound, for a value ``x`` in a block of absolute maximum ``m`` (``s``: the code book's
smallest positive value, ``b``: its mantissa bits): nearest rounding in a float format with
``b`` mantissa bits is within ``2**-(b+1)`` relative, and values below ``s * m`` round to 0 or
``s * m``, so ``|err| <= |x| * 2**-(b+1) + s * m`` (plus fp32 rounding of the scaling).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memfit.optim.quantization import (
    SIGNED_MAP,
    UNSIGNED_MAP,
    dequantize_blockwise,
    dynamic_tree_map,
    quantize_blockwise,
)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FINITE = st.floats(-(2.0**100), 2.0**100, allow_nan=False, allow_subnormal=False, width=32)
TINY = torch.finfo(torch.float32).tiny


def _round_trip(x: torch.Tensor, code, block: int) -> torch.Tensor:
    codes, absmax = quantize_blockwise(x, code, block)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert absmax.shape == (math.ceil(x.numel() / block),)
    return dequantize_blockwise(codes, absmax, code, block)


def _block_max(x: torch.Tensor, block: int) -> torch.Tensor:
    """Each element's block absolute maximum."""
    flat = x.reshape(-1).abs()
    pad = (-flat.numel()) % block
    m = torch.nn.functional.pad(flat, (0, pad)).view(-1, block).amax(dim=1)
    return m.repeat_interleave(block)[: flat.numel()].view(x.shape)


def _bound(x: torch.Tensor, code, block: int) -> torch.Tensor:
    m = _block_max(x, block)
    rel = 2.0 ** -(code.mantissa_bits + 1)
    return x.abs() * rel * (1 + 1e-6) + m * (code.smallest_positive * (1 + 1e-6) + 1e-7)


values = st.lists(FINITE, min_size=1, max_size=700)
blocks = st.sampled_from([1, 2, 3, 7, 64, 255, 256])


@SETTINGS
@given(data=values, block=blocks)
def test_signed_round_trip_is_within_the_bound(data, block):
    x = torch.tensor(data, dtype=torch.float32)
    out = _round_trip(x, SIGNED_MAP, block)
    assert ((out - x).abs() <= _bound(x, SIGNED_MAP, block)).all()


@SETTINGS
@given(data=values, block=blocks)
def test_unsigned_round_trip_is_within_the_bound(data, block):
    x = torch.tensor(data, dtype=torch.float32).abs()
    out = _round_trip(x, UNSIGNED_MAP, block)
    assert (out >= 0).all()
    assert ((out - x).abs() <= _bound(x, UNSIGNED_MAP, block)).all()
    # Unsigned codes never turn a positive second moment into an exact zero, even where
    # x / absmax underflows fp32 (values span 2**-126 .. 2**100 here).
    assert (out[x > 0] > 0).all()


@SETTINGS
@given(data=values, block=blocks)
def test_dynamic_tree_map_rounds_to_the_nearest_code(data, block):
    code = dynamic_tree_map()
    x = torch.tensor(data, dtype=torch.float32)
    out = _round_trip(x, code, block)
    half_gap = (code[1:] - code[:-1]).max().item() / 2
    assert ((out - x).abs() <= _block_max(x, block) * (half_gap + 1e-6)).all()


@SETTINGS
@given(n=st.integers(1, 600), block=blocks, shape2=st.booleans())
def test_all_zero_blocks_stay_exactly_zero(n, block, shape2):
    x = torch.zeros(n, 2) if shape2 else torch.zeros(n)
    codes, absmax = quantize_blockwise(x, SIGNED_MAP, block)
    assert (absmax == 0).all()
    out = dequantize_blockwise(codes, absmax, SIGNED_MAP, block)
    assert torch.equal(out, x) and not out.isnan().any()


@SETTINGS
@given(
    data=st.lists(FINITE, min_size=4, max_size=300),
    block=st.sampled_from([2, 3, 16]),
    where=st.integers(0, 10_000),
    bad=st.sampled_from([math.inf, -math.inf, math.nan]),
)
def test_a_non_finite_value_spoils_only_its_own_block(data, block, where, bad):
    x = torch.tensor(data, dtype=torch.float32)
    i = where % x.numel()
    x[i] = bad
    out = _round_trip(x, SIGNED_MAP, block)
    mine = torch.arange(x.numel()) // block == i // block
    assert not torch.isfinite(out[mine]).all()  # the fault shows; it is not hidden
    others = ~mine
    clean = x.clone()
    clean[i] = 0.0
    assert ((out[others] - x[others]).abs() <= _bound(clean, SIGNED_MAP, block)[others]).all()


@pytest.mark.parametrize("code", [SIGNED_MAP, UNSIGNED_MAP], ids=["signed", "unsigned"])
def test_float16_and_bfloat16_inputs_round_trip_within_the_bound(code):
    torch.manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(1000).to(dtype)
        x = x.abs() if not code.signed else x
        out = _round_trip(x, code, 64)
        ref = x.float()
        assert ((out - ref).abs() <= _bound(ref, code, 64)).all()


def test_empty_tensors_round_trip():
    x = torch.empty(0)
    assert _round_trip(x, SIGNED_MAP, 256).numel() == 0


def test_denormal_blocks_keep_their_relative_precision():
    x = torch.tensor([1e-40, -3e-41, 5e-41, 2e-40])
    out = _round_trip(x, SIGNED_MAP, 4)
    assert ((out - x).abs() <= _bound(x, SIGNED_MAP, 4)).all()


def test_denormal_blocks_stay_within_their_absmax():
    x = torch.tensor([1e-40, -3e-41, 5e-41, 2e-40, 1.0, 0.5, -0.25, 0.125])
    out = _round_trip(x, SIGNED_MAP, 4)
    assert torch.isfinite(out).all()
    assert ((out[:4] - x[:4]).abs() <= 2e-40).all()
    assert ((out[4:] - x[4:]).abs() <= _bound(x[4:], SIGNED_MAP, 4)).all()


def test_unsigned_keeps_positive_values_positive_at_extreme_ratios():
    x = torch.tensor([1427247831449600.0, 1e-30])
    assert (_round_trip(x, UNSIGNED_MAP, 2) > 0).all()


# Denormal magnitudes (and a few small normal ones): 2**-149 .. 2**-120, either sign.
DENORMAL = st.builds(
    lambda k, e, neg: (-1.0 if neg else 1.0) * k * 2.0**e,
    st.integers(1, 2**10 - 1),
    st.integers(-149, -130),
    st.booleans(),
)


@SETTINGS
@given(data=st.lists(DENORMAL, min_size=1, max_size=300), block=blocks)
@pytest.mark.parametrize("code", [SIGNED_MAP, UNSIGNED_MAP], ids=["signed", "unsigned"])
def test_denormal_values_round_trip_within_the_bound(code, data, block):
    x = torch.tensor(data, dtype=torch.float32)
    x = x.abs() if not code.signed else x
    out = _round_trip(x, code, block)
    # Half a denormal step on top: the decoded value is itself an fp32 denormal.
    assert ((out - x).abs() <= _bound(x, code, block) + 2.0**-150).all()
    if not code.signed:
        assert (out[x > 0] > 0).all()
