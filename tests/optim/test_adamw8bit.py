"""AdamW8bit against a dequantise -> fp32 AdamW -> requantise reference, torch AdamW and
bitsandbytes; state layout and size; state_dict round trips; StableEmbedding."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from memfit.optim import AdamW8bit, StableEmbedding
from memfit.optim.adamw8bit import KEEP_32BIT_ATTR
from memfit.optim.quantization import (
    SIGNED_MAP,
    UNSIGNED_MAP,
    dequantize_blockwise,
    quantize_blockwise,
)
from tests.optim._helpers import (
    assert_state_dict_roundtrip,
    loss_fn,
    max_abs_diff,
    regression_task,
    relative_deviation,
    train,
)

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 1e-2


class ReferenceAdamW8bit:
    """Straightforward 8-bit AdamW built on the public helpers: per parameter and step,
    dequantise both moments, run the fp32 AdamW update of torch.optim.AdamW, requantise."""

    def __init__(self, params, min_8bit_size: int, block_size: int = 256) -> None:
        self.params = list(params)
        self.min_8bit_size = min_8bit_size
        self.block_size = block_size
        self.state: dict[int, dict] = {}
        self.t = 0

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        beta1, beta2 = BETAS
        for p in self.params:
            g = p.grad
            quantised = p.numel() >= self.min_8bit_size
            st = self.state.setdefault(id(p), {})
            if not st:
                zeros = torch.zeros_like(p)
                if quantised:
                    st["m"] = quantize_blockwise(zeros, SIGNED_MAP, self.block_size)
                    st["v"] = quantize_blockwise(zeros, UNSIGNED_MAP, self.block_size)
                else:
                    st["m"], st["v"] = zeros.clone(), zeros.clone()
            if quantised:
                m = dequantize_blockwise(*st["m"], SIGNED_MAP, self.block_size)
                v = dequantize_blockwise(*st["v"], UNSIGNED_MAP, self.block_size)
            else:
                m, v = st["m"], st["v"]
            p.mul_(1 - LR * WD)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (v.sqrt() / math.sqrt(1 - beta2**self.t)).add_(EPS)
            p.addcdiv_(m, denom, value=-LR / (1 - beta1**self.t))
            if quantised:
                st["m"] = quantize_blockwise(m, SIGNED_MAP, self.block_size)
                st["v"] = quantize_blockwise(v, UNSIGNED_MAP, self.block_size)


def _model_with_odd_shapes() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    # 5120-element weight (20 blocks), a 1000 x 7 weight whose size is not a multiple of the
    # block size (partial last block), and small biases that stay fp32.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 160), nn.Tanh(), nn.Linear(160, 1000), nn.Tanh())
    model.append(nn.Linear(1000, 7))
    x, y = torch.randn(16, 32), torch.randn(16, 7)
    return model, x, y


@pytest.mark.parametrize("chunk_size", [1 << 18, 1024])
def test_matches_dequantize_update_requantize_reference(chunk_size: int) -> None:
    model, x, y = _model_with_odd_shapes()
    ref_model = copy.deepcopy(model)
    opt = AdamW8bit(
        model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, chunk_size=chunk_size
    )
    ref = ReferenceAdamW8bit(ref_model.parameters(), min_8bit_size=4096)
    for _ in range(10):
        for m, o in ((model, opt), (ref_model, ref)):
            m.zero_grad()
            loss_fn(m, x, y).backward()
            o.step()
        # Tight tolerance: identical math, only the chunking differs (a 1-ulp difference can
        # at most flip one code to its neighbour).
        for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        state = opt.state[p]
        if p.numel() >= 4096:
            codes, absmax = ref.state[id(q)]["m"]
            same = (state["exp_avg_codes"][: p.numel()] == codes.flatten()).float().mean()
            assert same > 0.999
            torch.testing.assert_close(state["exp_avg_absmax"], absmax, rtol=1e-5, atol=1e-9)
        else:
            assert state["exp_avg"].dtype == torch.float32


def test_tracks_torch_adamw() -> None:
    model, x, y = regression_task()
    start = copy.deepcopy(model)
    ours, theirs = copy.deepcopy(model), copy.deepcopy(model)
    opt = AdamW8bit(ours.parameters(), lr=LR, weight_decay=WD)
    ref = torch.optim.AdamW(theirs.parameters(), lr=LR, weight_decay=WD)
    assert opt.state == {}  # lazily initialised
    losses = train(ours, opt, x, y, 20)
    ref_losses = train(theirs, ref, x, y, 20)
    assert "exp_avg_codes" in opt.state[ours[0].weight]  # the 5120-element weight is 8-bit
    # Loose tolerance: quantisation noise, but the trajectories stay close...
    assert relative_deviation(ours, theirs, start) < 0.1
    assert max_abs_diff(ours, theirs) < 0.05
    # ...and the loss falls the same way.
    assert losses[-1] < 0.3 * losses[0]
    assert losses[-1] == pytest.approx(ref_losses[-1], rel=0.1)


def test_small_tensors_are_fp32_and_bit_identical_to_torch() -> None:
    model, x, y = regression_task()
    twin = copy.deepcopy(model)
    opt = AdamW8bit(model.parameters(), lr=LR, min_8bit_size=10**9)
    ref = torch.optim.AdamW(twin.parameters(), lr=LR, foreach=False)
    train(model, opt, x, y, 5)
    train(twin, ref, x, y, 5)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}
        assert opt.state[p]["exp_avg"].dtype == torch.float32
        assert torch.equal(p, q)


def test_state_bytes_per_parameter_for_large_tensor() -> None:
    p = nn.Parameter(torch.randn(1000, 1000))
    opt = AdamW8bit([p])
    p.grad = torch.randn_like(p)
    opt.step()
    state = opt.state[p]
    nbytes = sum(v.nbytes for v in state.values() if isinstance(v, torch.Tensor))
    assert state["exp_avg_codes"].dtype == state["exp_avg_sq_codes"].dtype == torch.uint8
    assert state["exp_avg_absmax"].dtype == torch.float32
    assert nbytes / p.numel() <= 2.1
    assert nbytes / p.numel() == pytest.approx(2 + 8 / 256, abs=0.002)


def test_keep_32bit_by_name_pattern_tensor_and_flag() -> None:
    model = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 128), nn.Linear(128, 64))
    flagged = model[2].weight
    setattr(flagged, KEEP_32BIT_ATTR, True)
    opt = AdamW8bit(model.named_parameters(), min_8bit_size=1024, keep_32bit=["0.*"])
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    assert "exp_avg" in opt.state[model[0].weight]  # name pattern
    assert "exp_avg_codes" in opt.state[model[1].weight]
    assert "exp_avg" in opt.state[flagged]  # attribute flag
    model2 = nn.Linear(64, 128)
    opt2 = AdamW8bit(model2.parameters(), min_8bit_size=1024, keep_32bit=[model2.weight])
    model2(torch.randn(2, 64)).sum().backward()
    opt2.step()
    assert "exp_avg" in opt2.state[model2.weight]  # tensor identity
    with pytest.raises(ValueError, match="named"):
        AdamW8bit(model.parameters(), keep_32bit=["0.weight"])


def test_grad_none_is_skipped_and_sparse_grad_rejected() -> None:
    a, b = nn.Parameter(torch.randn(5000)), nn.Parameter(torch.randn(10))
    opt = AdamW8bit([a, b])
    a.grad = torch.randn_like(a)
    before = b.detach().clone()
    opt.step()
    assert b not in opt.state and torch.equal(b, before)
    emb = nn.Embedding(10, 4, sparse=True)
    opt = AdamW8bit(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


def test_bf16_parameters() -> None:
    model, x, y = regression_task()
    start = copy.deepcopy(model)
    reference = copy.deepcopy(model)
    model = model.to(torch.bfloat16)
    opt = AdamW8bit(model.parameters(), lr=LR)
    ref_opt = AdamW8bit(reference.parameters(), lr=LR)
    train(model, opt, x.bfloat16(), y, 10)
    train(reference, ref_opt, x, y, 10)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    state = opt.state[model[0].weight]
    assert state["exp_avg_codes"].dtype == torch.uint8
    assert state["exp_avg_absmax"].dtype == torch.float32
    assert opt.state[model[0].bias]["exp_avg"].dtype == torch.float32  # fp32 math and state
    assert relative_deviation(model.float(), reference, start) < 0.15


def test_non_contiguous_parameter() -> None:
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(128, 80).t())  # a transposed, non-contiguous parameter
    q = nn.Parameter(p.detach().contiguous())
    assert not p.is_contiguous()
    opt, ref = AdamW8bit([p], min_8bit_size=1024), AdamW8bit([q], min_8bit_size=1024)
    for _ in range(3):
        g = torch.randn(80, 128)
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    # Blocks run over the logical (row-major) order either way: identical results.
    assert torch.equal(p, q)
    assert not p.is_contiguous()


def test_closure_returns_loss() -> None:
    model, x, y = regression_task()
    opt = AdamW8bit(model.parameters())

    def closure():
        opt.zero_grad()
        loss = loss_fn(model, x, y)
        loss.backward()
        return loss

    assert isinstance(opt.step(closure), torch.Tensor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_roundtrip_is_bit_identical(dtype: torch.dtype) -> None:
    model, x, y = _model_with_odd_shapes()
    model = model.to(dtype)
    restored = assert_state_dict_roundtrip(
        lambda m: AdamW8bit(m.parameters(), lr=LR, chunk_size=2048), model, x.to(dtype), y
    )
    state = restored.state[next(iter(restored.param_groups[0]["params"]))]
    assert state["exp_avg_codes"].dtype == torch.uint8
    assert state["exp_avg_absmax"].dtype == torch.float32


def test_roughly_agrees_with_bitsandbytes() -> None:
    bnb = pytest.importorskip(
        "bitsandbytes", reason="bitsandbytes is not installed: no comparison with its AdamW8bit"
    )
    model, x, y = regression_task()
    start = copy.deepcopy(model)
    ours, theirs, fp32 = (copy.deepcopy(model) for _ in range(3))
    train(ours, AdamW8bit(ours.parameters(), lr=LR, min_8bit_size=4096), x, y, 20)
    bnb_opt = bnb.optim.AdamW8bit(theirs.parameters(), lr=LR, weight_decay=WD, min_8bit_size=4096)
    train(theirs, bnb_opt, x, y, 20)
    train(fp32, torch.optim.AdamW(fp32.parameters(), lr=LR, weight_decay=WD), x, y, 20)
    ours_dev = relative_deviation(ours, fp32, start)
    bnb_dev = relative_deviation(theirs, fp32, start)
    # Both 8-bit optimizers stay near fp32 AdamW, ours at least about as near as bitsandbytes.
    assert bnb_dev < 0.15 and ours_dev < 0.15
    assert ours_dev < 1.5 * bnb_dev + 0.01
    assert relative_deviation(ours, theirs, start) < 0.2
    assert loss_fn(ours, x, y).item() == pytest.approx(loss_fn(theirs, x, y).item(), rel=0.15)


def test_stable_embedding() -> None:
    torch.manual_seed(0)
    emb = StableEmbedding(1000, 64, padding_idx=0)
    bound = math.sqrt(6.0 / (1000 + 64))
    assert emb.weight.abs().max() <= bound
    assert torch.equal(emb.weight[0], torch.zeros(64))
    assert getattr(emb.weight, KEEP_32BIT_ATTR)
    out = emb(torch.tensor([[1, 2, 3], [4, 5, 6]]))
    assert out.shape == (2, 3, 64)
    torch.testing.assert_close(out.mean(-1), torch.zeros(2, 3), atol=1e-5, rtol=0)
    # Unit variance up to the layer norm's eps (1e-5 against a variance of about 2e-3).
    torch.testing.assert_close(out.var(-1, unbiased=False), torch.ones(2, 3), atol=0.01, rtol=0)
    emb = emb.to(torch.bfloat16)
    assert getattr(emb.weight, KEEP_32BIT_ATTR)
    out = emb(torch.tensor([1, 2]))
    assert out.dtype == torch.bfloat16
    opt = AdamW8bit(emb.parameters())
    out.float().pow(2).sum().backward()
    opt.step()
    assert opt.state[emb.weight]["exp_avg"].dtype == torch.float32  # 64000 elements, yet 32-bit
