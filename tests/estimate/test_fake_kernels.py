"""Fake kernels of dry runs: the outputs' layout is the real kernel's, so later views agree."""

from __future__ import annotations

import pytest
import torch
from torch._decomp import decomposition_table
from torch._subclasses.fake_tensor import FakeTensor

from memfit.estimate.fake_kernels import dry_tensors

aten = torch.ops.aten
B, S, D = 2, 16, 8


def _layer_norm_grads(grad_out, x, mask, affine=True):
    w, b = (torch.ones(D), torch.zeros(D)) if affine else (None, None)
    _, mean, rstd = aten.native_layer_norm(x, [D], w, b, 1e-5)
    return aten.native_layer_norm_backward(grad_out, x, [D], mean, rstd, w, b, mask)


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("x_layout", ["contiguous", "transposed"])
def test_layer_norm_backward_gives_the_real_kernels_layout(x_layout, affine):
    # Swin hands each stage's output on permuted, so a LayerNorm's output gradient arrives
    # transposed; the real kernel's input gradient is contiguous all the same.
    def make(layout):
        t = torch.randn(B, D, S) if layout == "transposed" else torch.randn(B, S, D)
        return t.transpose(1, 2) if layout == "transposed" else t

    mask = [True, affine, affine]
    real = _layer_norm_grads(make("transposed"), make(x_layout), mask, affine)
    with dry_tensors():
        fake = _layer_norm_grads(make("transposed"), make(x_layout), mask, affine)
    for r, f in zip(real, fake, strict=True):
        if r is None:
            assert f is None
            continue
        assert isinstance(f, FakeTensor)
        assert (f.shape, f.stride(), f.dtype) == (r.shape, r.stride(), r.dtype)


def test_the_decomposition_set_aside_comes_back():
    op = aten.native_layer_norm_backward.default
    before = decomposition_table.get(op)
    with dry_tensors():
        assert op not in decomposition_table
    assert decomposition_table.get(op) is before
