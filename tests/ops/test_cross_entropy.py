"""chunked_cross_entropy: the unfused loss and gradients, without the logits' bytes.

Tolerances: fp32 results equal the unfused fp32 computation to 1e-5 (relative and absolute).
bf16 results are compared with an fp64 reference: each gradient's largest error is at most
twice the plain bf16 computation's own error, and within 1e-2 of the largest gradient entry.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import memfit
from memfit.ops import auto_chunk_size, chunked_cross_entropy, fused_linear_loss

TOL = {"rtol": 1e-5, "atol": 1e-5}


def reference(
    hidden,
    weight,
    labels,
    *,
    bias=None,
    ignore_index=-100,
    label_smoothing=0.0,
    z_loss=0.0,
    softcap=None,
    reduction="mean",
):
    """The unfused computation: full logits, upcast as Hugging Face does, torch's loss."""
    logits = F.linear(hidden, weight, bias)
    logits = logits.double() if logits.dtype == torch.float64 else logits.float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    flat = labels.reshape(-1)
    keep = flat != ignore_index
    loss = F.cross_entropy(
        logits.reshape(flat.numel(), -1),
        flat,
        reduction="none",
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
    )
    loss = loss + z_loss * logits.reshape(flat.numel(), -1).logsumexp(-1) ** 2 * keep
    if reduction == "none":
        return loss.view(labels.shape)
    return loss.sum() / keep.sum() if reduction == "mean" else loss.sum()


def _inputs(shape=(3, 5), hidden=16, vocab=37, dtype=torch.float32, seed=0, bias=True):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(*shape, hidden, generator=gen, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) * 0.3
    b = torch.randn(vocab, generator=gen, dtype=torch.float64) if bias else None
    labels = torch.randint(0, vocab, shape, generator=gen)
    labels.view(-1)[::4] = -100
    leaves = [t.to(dtype).requires_grad_() if t is not None else None for t in (h, w, b)]
    return (*leaves, labels)


def _loss_and_grads(fn, h, w, b, labels, grad_out=None, **kw):
    loss = fn(h, w, labels, bias=b, **kw)
    params = [t for t in (h, w, b) if t is not None]
    grads = torch.autograd.grad(loss, params, grad_out)
    return loss, grads


OPTIONS = [
    {},
    {"label_smoothing": 0.1},
    {"z_loss": 1e-2},
    {"softcap": 2.0},
    {"label_smoothing": 0.2, "z_loss": 1e-3, "softcap": 3.0},
    {"reduction": "sum"},
    {"reduction": "none"},
    {"reduction": "none", "label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 3.0},
    {"ignore_index": 5},
]


@pytest.mark.parametrize(
    "options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "plain"
)
@pytest.mark.parametrize("bias", [True, False])
def test_fp32_loss_and_grads_equal_unfused(options, bias):
    h, w, b, labels = _inputs(bias=bias)
    if "ignore_index" in options:
        labels = labels.masked_fill(labels == -100, options["ignore_index"])
    grad_out = torch.randn(labels.shape) if options.get("reduction") == "none" else None
    ref_loss, ref_grads = _loss_and_grads(reference, h, w, b, labels, grad_out, **options)
    for chunk in (1, 4, 15, 64):
        loss, grads = _loss_and_grads(
            chunked_cross_entropy, h, w, b, labels, grad_out, chunk_size=chunk, **options
        )
        assert loss.dtype == torch.float32 and loss.shape == ref_loss.shape
        torch.testing.assert_close(loss, ref_loss, **TOL)
        assert len(grads) == len(ref_grads)
        for got, want in zip(grads, ref_grads, strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("shape", [(7,), (2, 3, 4), (6, 1)])
def test_any_leading_shape(shape):
    h, w, b, labels = _inputs(shape=shape)
    ref_loss, ref_grads = _loss_and_grads(reference, h, w, b, labels)
    loss, grads = _loss_and_grads(chunked_cross_entropy, h, w, b, labels, chunk_size=5)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, **TOL)
    none = chunked_cross_entropy(h, w, labels, bias=b, reduction="none")
    assert none.shape == labels.shape


def test_non_contiguous_hidden():
    h, w, b, labels = _inputs(shape=(4, 6))
    ht = h.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()
    assert not ht.is_contiguous()
    ref_loss, ref_grads = _loss_and_grads(reference, ht, w, b, labels)
    loss, grads = _loss_and_grads(chunked_cross_entropy, ht, w, b, labels, chunk_size=3)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_all_ignored_matches_torch(reduction, label_smoothing):
    """Every label ignored: torch gives nan for the mean (0 / 0), 0 for the sum; zero grads."""
    h, w, b, labels = _inputs()
    labels = torch.full_like(labels, -100)
    kw = {"reduction": reduction, "label_smoothing": label_smoothing, "z_loss": 1e-2}
    loss, grads = _loss_and_grads(
        chunked_cross_entropy,
        h,
        w,
        b,
        labels,
        torch.ones(labels.shape) if reduction == "none" else None,
        chunk_size=4,
        **kw,
    )
    torch_loss = F.cross_entropy(
        torch.zeros(labels.numel(), 37),
        labels.view(-1),
        reduction=reduction,
        label_smoothing=label_smoothing,
    )
    if reduction == "mean":
        assert torch.isnan(loss) and torch.isnan(torch_loss)
    else:
        assert torch.equal(loss, torch.zeros_like(loss))
        assert torch.equal(torch_loss, torch.zeros_like(torch_loss))
    for g in grads:
        assert torch.equal(g, torch.zeros_like(g))


def test_tied_weight_gradient_accumulates():
    """A head sharing its weight with the embedding: both gradients land in one .grad."""
    torch.manual_seed(0)
    emb = nn.Embedding(37, 16)
    ids = torch.randint(0, 37, (3, 5))
    labels = torch.randint(0, 37, (3, 5))

    def step(loss_fn):
        emb.weight.grad = None
        hidden = torch.tanh(emb(ids))
        loss_fn(hidden, emb.weight, labels).backward()
        return emb.weight.grad.clone()

    want = step(lambda h, w, y: reference(h, w, y))
    got = step(lambda h, w, y: chunked_cross_entropy(h, w, y, chunk_size=4))
    torch.testing.assert_close(got, want, **TOL)
    # Both paths add to the embedding rows the ids used: the gradient is not the head's alone.
    head_only = torch.autograd.grad(
        reference(torch.tanh(emb(ids)).detach(), emb.weight, labels), emb.weight
    )[0]
    assert not torch.allclose(got, head_only)


def test_frozen_head_or_input_get_no_gradient():
    h, w, b, labels = _inputs()
    w.requires_grad_(False)
    b.requires_grad_(False)
    (gh,) = torch.autograd.grad(chunked_cross_entropy(h, w, labels, bias=b, chunk_size=4), h)
    (want,) = torch.autograd.grad(reference(h, w, labels, bias=b), h)
    torch.testing.assert_close(gh, want, **TOL)
    h2, w2, _, labels = _inputs(bias=False)
    h2.requires_grad_(False)
    (gw,) = torch.autograd.grad(chunked_cross_entropy(h2, w2, labels, chunk_size=4), w2)
    (want,) = torch.autograd.grad(reference(h2, w2, labels), w2)
    torch.testing.assert_close(gw, want, **TOL)


@pytest.mark.parametrize(
    "options", [{}, {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 5.0}], ids=["plain", "all"]
)
def test_bf16_error_within_twice_plain_bf16(options):
    """bf16 inputs, fp32 accumulation: no worse than the plain bf16 loss (both vs fp64
    arithmetic on the same inputs)."""
    h, w, b, labels = _inputs(shape=(256,), hidden=64, vocab=1000, dtype=torch.bfloat16)
    lp = [h, w, b]
    # The truth: fp64 arithmetic on the same (bf16-rounded) inputs.
    truth = _loss_and_grads(
        reference, *[t.detach().double().requires_grad_() for t in lp], labels, **options
    )
    plain = _loss_and_grads(reference, *lp, labels, **options)
    fused = _loss_and_grads(chunked_cross_entropy, *lp, labels, chunk_size=32, **options)
    assert fused[0].dtype == torch.float32
    # The loss: the same bf16 logits, reduced in fp32 on both paths.
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-5, atol=1e-5)
    for want, p, f in zip(truth[1], plain[1], fused[1], strict=True):
        assert f.dtype == torch.bfloat16
        scale = want.abs().max()
        plain_err = (p.double() - want).abs().max()
        fused_err = (f.double() - want).abs().max()
        assert fused_err <= 2 * plain_err
        assert fused_err <= 1e-2 * scale


def test_autocast_matches_plain_autocast():
    """Under CPU autocast the matmuls run in bf16 as F.linear's would; grads keep fp32."""
    h, w, b, labels = _inputs(shape=(64,), hidden=32, vocab=300)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss, ref_grads = _loss_and_grads(reference, h, w, b, labels)
        loss, grads = _loss_and_grads(chunked_cross_entropy, h, w, b, labels, chunk_size=16)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads, strict=True):
        assert got.dtype == torch.float32
        # The plain path rounds its gradients to bf16 in one matmul, the fused one per block.
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_fused_linear_loss_shift_and_num_items():
    """Hugging Face's causal-LM loss: position t predicts labels[t + 1]; sum / num_items."""
    torch.manual_seed(0)
    head = nn.Linear(16, 37)
    hidden = torch.randn(2, 6, 16, requires_grad=True)
    labels = torch.randint(0, 37, (2, 6))
    want = reference(hidden[:, :-1], head.weight, labels[:, 1:], bias=head.bias)
    got = fused_linear_loss(hidden, head, labels, shift=True, chunk_size=4)
    torch.testing.assert_close(got, want, **TOL)
    summed = reference(hidden[:, :-1], head.weight, labels[:, 1:], bias=head.bias, reduction="sum")
    got = fused_linear_loss(hidden, head, labels, shift=True, num_items_in_batch=torch.tensor(7))
    torch.testing.assert_close(got, summed / 7, **TOL)
    with pytest.raises(ValueError, match=r"nn\.Linear"):
        fused_linear_loss(hidden, nn.Identity(), labels)
    with pytest.raises(ValueError, match="sum reduction"):
        fused_linear_loss(hidden, head, labels, num_items_in_batch=3, reduction="mean")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"weight": torch.zeros(37, 8)}, "weight must have shape"),
        ({"labels": torch.zeros(3, dtype=torch.long)}, "labels must have shape"),
        ({"labels": torch.zeros(3, 5)}, "integer dtype"),
        ({"bias": torch.zeros(36)}, "bias must have shape"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"label_smoothing": 1.5}, "label_smoothing"),
        ({"z_loss": -1.0}, "z_loss"),
        ({"softcap": 0.0}, "softcap"),
        ({"reduction": "max"}, "reduction"),
        ({"weight": torch.zeros(37, 16, dtype=torch.float64)}, "share a dtype"),
    ],
)
def test_bad_input_is_one_sentence(kwargs, match):
    args = {
        "hidden": torch.zeros(3, 5, 16),
        "weight": torch.zeros(37, 16),
        "labels": torch.zeros(3, 5, dtype=torch.long),
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        chunked_cross_entropy(args.pop("hidden"), args.pop("weight"), args.pop("labels"), **args)


def test_auto_chunk_size():
    # llama-1b's head at 4096 tokens: fp32 chunk logits about the size of the fp32 hidden
    # states (4096 * 2048 / 128256 -> 66 tokens, 32 MiB).
    assert auto_chunk_size(4096, 2048, 128256) == 66
    # The 16 MiB floor: GPT-2 (768, 50257) at 1024 tokens -> 84 tokens, not 16.
    assert auto_chunk_size(1024, 768, 50257) == 84
    assert auto_chunk_size(10, 16, 37) == 10  # never more than the tokens
    assert auto_chunk_size(0, 16, 37) == 1


# ---------------------------------------------------------------------------------- memory
def _peak(fn, n, hidden, vocab, dtype=torch.float32):
    torch.manual_seed(0)
    h = torch.randn(n, hidden, dtype=dtype, requires_grad=True)
    w = torch.randn(vocab, hidden, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, vocab, (n,))
    with memfit.track(None) as tracker:
        fn(h, w, labels).backward()
    return tracker.report().peak_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tracker_shows_logits_gone(dtype):
    n, hidden, vocab, chunk = 512, 32, 4096, 32
    logits32 = n * vocab * 4
    chunk32 = chunk * vocab * 4
    plain = _peak(lambda h, w, y: reference(h, w, y), n, hidden, vocab, dtype)
    fused = _peak(
        lambda h, w, y: chunked_cross_entropy(h, w, y, chunk_size=chunk), n, hidden, vocab, dtype
    )
    # The fp32 logits and their gradient are gone, less one chunk of them.
    assert plain - fused >= 2 * logits32 - chunk32
    # What the fused step holds beyond its inputs and their gradients (h, w, dh, dw): one
    # chunk's fp32 logits, plus its low-precision copy in bf16, plus per-token vectors.
    item = torch.empty((), dtype=dtype).element_size()
    base = 2 * (n * hidden + vocab * hidden) * item
    working = chunk32 + (chunk * vocab * item if dtype != torch.float32 else 0)
    assert fused - base <= working + 64 * n + 2 * n * hidden * 4


def test_runs_under_fake_tensors_at_full_size():
    """A dry run at llama-1b's head size: no data-dependent op, and no logits in the peak."""
    n, hidden, vocab = 4096, 2048, 128256
    with FakeTensorMode():
        h = torch.empty(n, hidden, dtype=torch.bfloat16, requires_grad=True)
        w = torch.empty(vocab, hidden, dtype=torch.bfloat16, requires_grad=True)
        labels = torch.zeros(n, dtype=torch.long)
        with memfit.track(None) as tracker:
            chunked_cross_entropy(h, w, labels, chunk_size=64).backward()
    peak = tracker.report().peak_bytes
    params_and_grads = 2 * (n * hidden + vocab * hidden) * 2
    assert peak - params_and_grads < n * vocab * 4 // 16  # far below one copy of the logits
