"""Fused pointwise chains: the same values and gradients as eager, fewer saved bytes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import memfit
from memfit.ops.pointwise import ACTIVATIONS, bias_dropout_add, gated_activation, rms_norm


def _grads(fn, *inputs):
    inputs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*inputs)
    out.backward(torch.ones_like(out) * torch.linspace(-1, 1, out.numel()).reshape(out.shape))
    return out.detach(), [x.grad for x in inputs]


@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
def test_gated_activation_equals_eager(act):
    torch.manual_seed(0)
    gate, up = torch.randn(4, 8, 16), torch.randn(4, 8, 16)
    eager_fn = ACTIVATIONS[act][0]
    out, grads = _grads(lambda g, u: gated_activation(g, u, act), gate, up)
    ref, ref_grads = _grads(lambda g, u: eager_fn(g) * u, gate, up)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_gated_activation_bf16_within_eager_error():
    torch.manual_seed(0)
    gate, up = torch.randn(64, 32), torch.randn(64, 32)
    _, exact = _grads(lambda g, u: F.silu(g) * u, gate.double(), up.double())
    _, fused = _grads(gated_activation, gate.bfloat16(), up.bfloat16())
    _, eager = _grads(lambda g, u: F.silu(g) * u, gate.bfloat16(), up.bfloat16())
    for f, e, x in zip(fused, eager, exact, strict=True):
        # No worse than eager bf16 (the fused backward computes in fp32), to a small margin.
        assert (f.double() - x).abs().max() <= 1.1 * (e.double() - x).abs().max() + 1e-3


def _llama_norm(x, w, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _gemma_norm(x, w, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + w.float())).type_as(x)


@pytest.mark.parametrize("style", ["llama", "gemma"])
def test_rms_norm_equals_eager(style):
    torch.manual_seed(0)
    x, w = torch.randn(3, 5, 32), torch.randn(32)
    if style == "llama":
        fused = lambda x, w: rms_norm(x, w, 1e-6)  # noqa: E731
        eager = lambda x, w: _llama_norm(x, w, 1e-6)  # noqa: E731
    else:
        fused = lambda x, w: rms_norm(x, w, 1e-6, offset=1.0, cast_before_weight=False)  # noqa: E731
        eager = lambda x, w: _gemma_norm(x, w, 1e-6)  # noqa: E731
    out, grads = _grads(fused, x, w)
    ref, ref_grads = _grads(eager, x, w)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_bias_dropout_add_matches_the_mask_it_drew():
    torch.manual_seed(0)
    x, b, r = torch.randn(6, 16), torch.randn(16), torch.randn(6, 16)
    out, (gx, gb, gr) = _grads(lambda x, b, r: bias_dropout_add(x, b, r, 0.25), x, b, r)
    keep = (out - r) != 0  # where the mask kept (x + b is never exactly 0 here)
    torch.testing.assert_close(out, r + (x + b) * keep / 0.75)
    weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    torch.testing.assert_close(gx, weights * keep / 0.75)
    torch.testing.assert_close(gb, (weights * keep / 0.75).sum(0))
    torch.testing.assert_close(gr, weights)
    torch.testing.assert_close(bias_dropout_add(x, b, r, 0.25, training=False), r + (x + b))
    with pytest.raises(ValueError, match="dropout probability must be at least 0 and below 1"):
        bias_dropout_add(x, b, r, 1.0)


def _saved_bytes(fn, *inputs):
    """Bytes alive after forward that are not the inputs or the output: what backward keeps."""
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    with memfit.track() as tracker:
        out = fn(*inputs)
        kept = tracker.snapshot()
    return sum(kept.values()) - out.numel() * out.element_size(), out


def test_fused_chains_save_what_they_claim():
    n, width = 64, 128
    x, y, w = torch.randn(n, width), torch.randn(n, width), torch.randn(width)
    act = n * width * 4  # one fp32 activation
    eager, _ = _saved_bytes(lambda g, u: F.silu(g) * u, x, y)
    fused, _ = _saved_bytes(gated_activation, x, y)
    assert eager - fused == act  # act(gate) is not kept
    eager, _ = _saved_bytes(lambda x, w: _llama_norm(x, w, 1e-6), x, w)
    fused, _ = _saved_bytes(lambda x, w: rms_norm(x, w, 1e-6), x, w)
    assert eager - fused == act  # the normalised rows are not kept (fp32: no copy to save)
    eager, _ = _saved_bytes(lambda x, w: _llama_norm(x, w, 1e-6), x.bfloat16(), w.bfloat16())
    fused, _ = _saved_bytes(lambda x, w: rms_norm(x, w, 1e-6), x.bfloat16(), w.bfloat16())
    assert eager - fused == act + act // 2  # bf16: neither the fp32 copy nor the bf16 rows
    eager, _ = _saved_bytes(lambda x, r: r + F.dropout(x, 0.1), x, y)
    fused, _ = _saved_bytes(lambda x, r: bias_dropout_add(x, None, r, 0.1), x, y)
    assert eager - fused == n * width * 3  # a bool mask, not an fp32 one
