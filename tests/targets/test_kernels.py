"""Kernel emulation: CPU execution that keeps what a CUDA target's kernels keep."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memfit.targets import DEVICES, KernelEmulation, get_device, sdpa_backend

H100, A100, T4 = DEVICES["h100"], DEVICES["a100"], DEVICES["t4"]
RTX4090 = DEVICES["rtx4090"]


def _qkv(b=2, h=4, lq=16, lk=16, d=8, dtype=torch.float32, hk=None):
    torch.manual_seed(0)
    q = torch.randn(b, h, lq, d, dtype=dtype, requires_grad=True)
    k = torch.randn(b, hk or h, lk, d, dtype=dtype, requires_grad=True)
    v = torch.randn(b, hk or h, lk, d, dtype=dtype, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize(
    ("profile", "dtype", "kw", "expected"),
    [
        (H100, torch.bfloat16, {}, "flash"),
        (H100, torch.float16, {"is_causal": True}, "flash"),
        (H100, torch.float32, {}, "efficient"),  # flash takes 16-bit inputs only
        (H100, torch.bfloat16, {"attn_mask": torch.zeros(16, 16)}, "efficient"),  # no masks
        (T4, torch.float16, {}, "efficient"),  # flash needs sm80
        (T4, torch.bfloat16, {}, "math"),  # no bf16 kernels before sm80
        (H100, torch.float64, {}, "math"),
    ],
)
def test_backend_choice_follows_cuda_dispatch(profile, dtype, kw, expected):
    q, k, v = _qkv(dtype=dtype)
    assert sdpa_backend(profile, q, k, v, **kw) == expected


def test_backend_choice_head_dims():
    # Flash: equal head dims up to 256. Efficient on sm80: divisible by 8 in 16-bit, 4 in fp32.
    q, k, v = _qkv(d=264, dtype=torch.bfloat16)
    assert sdpa_backend(H100, q, k, v) == "efficient"
    q, k, v = _qkv(d=12, dtype=torch.float32)
    assert sdpa_backend(H100, q, k, v) == "efficient"
    q, k, v = _qkv(d=10, dtype=torch.float32)
    assert sdpa_backend(H100, q, k, v) == "math"
    # Flash backward with head dim > 192 is refused on sm89 (RTX 4090), not on sm90.
    q, k, v = _qkv(d=200, dtype=torch.bfloat16)
    assert sdpa_backend(H100, q, k, v) == "flash"
    assert sdpa_backend(RTX4090, q, k, v) == "efficient"
    # Causal attention with fewer queries than keys is not flash's.
    q, k, v = _qkv(lq=8, lk=16, dtype=torch.bfloat16)
    assert sdpa_backend(H100, q, k, v, is_causal=True) == "efficient"


def test_grouped_query_heads_are_flash_or_math():
    # Flash takes grouped-query heads; the memory-efficient kernel does not
    # (check_batch_size_and_num_heads_dense<false>), so fp32 GQA falls to math.
    q, k, v = _qkv(hk=2, dtype=torch.bfloat16)
    assert q.shape[1] != k.shape[1]
    assert sdpa_backend(H100, q, k, v, is_causal=True) == "flash"
    q, k, v = _qkv(hk=2, dtype=torch.float32)
    assert sdpa_backend(H100, q, k, v, is_causal=True) == "math"
    q, k, v = _qkv(dtype=torch.float32)
    assert sdpa_backend(H100, q, k, v, is_causal=True) == "efficient"


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"is_causal": True},
        {"attn_mask": "float"},
        {"attn_mask": "bool"},
        {"enable_gqa": True},
        {"scale": 0.3},
    ],
)
@pytest.mark.parametrize("profile", [H100, T4])
def test_emulated_attention_equals_plain_attention(kw, profile):
    kw = dict(kw)
    hk = 2 if kw.get("enable_gqa") else None
    q, k, v = _qkv(hk=hk)
    if kw.get("attn_mask") == "float":
        kw["attn_mask"] = torch.randn(16, 16)
    elif kw.get("attn_mask") == "bool":
        kw["attn_mask"] = torch.rand(16, 16) > 0.3
    ref = F.scaled_dot_product_attention(q, k, v, **kw)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    with KernelEmulation(profile) as emu:
        out = F.scaled_dot_product_attention(q, k, v, **kw)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert sum(emu.backends.values()) == 1
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


def _saved_bytes(fn, *args):
    """Bytes of the distinct storages autograd saves for backward while running ``fn``."""
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, sum(seen.values())


def test_fused_attention_saves_no_probabilities():
    b, h, n, d = 2, 4, 64, 8
    # q, k, v as views of one projection, as in GPT-2 (so they are one saved storage).
    x = torch.randn(b, n, 3 * h * d, dtype=torch.bfloat16, requires_grad=True)
    qkv = x.view(b, n, 3, h, d).permute(2, 0, 3, 1, 4)

    def attend():
        return F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], dropout_p=0.1)

    with KernelEmulation(H100):
        _, fused = _saved_bytes(attend)
    # Flash keeps q/k/v (one storage: 3*B*H*L*D bf16), the output (B*H*L*D bf16), the fp32
    # log-sum-exp (B*H*L) and the two-int64 RNG state of its dropout.
    assert fused == 3 * b * h * n * d * 2 + b * h * n * d * 2 + b * h * n * 4 + 16
    # The CPU's math path with dropout keeps the L x L probabilities and the dropout mask too.
    _, cpu = _saved_bytes(attend)
    assert cpu >= fused + 2 * b * h * n * n * 2


def test_efficient_attention_pads_its_log_sum_exp():
    b, h, n, d = 1, 2, 40, 8
    q, k, v = _qkv(b=b, h=h, lq=n, lk=n, d=d)  # fp32: the efficient kernel
    with KernelEmulation(H100) as emu:
        _, saved = _saved_bytes(F.scaled_dot_product_attention, q, k, v)
    assert emu.backends["efficient"] == 1
    # q, k, v and the output (fp32) plus a log-sum-exp padded to 64 = ceil(40 / 32) * 32.
    assert saved == 4 * b * h * n * d * 4 + b * h * 64 * 4


def test_dropout_keeps_a_bool_mask_on_cuda_targets():
    x = torch.randn(64, 32, requires_grad=True)
    _, cpu = _saved_bytes(F.dropout, x, 0.1, True)
    with KernelEmulation(H100):
        torch.manual_seed(0)
        out, cuda = _saved_bytes(F.dropout, x, 0.1, True)
    assert cpu == x.numel() * 4  # the CPU keeps a float noise tensor
    assert cuda == x.numel() * 1  # CUDA's fused dropout keeps a bool mask
    kept = out != 0
    torch.testing.assert_close(out[kept], x[kept] / 0.9)
    with KernelEmulation(H100):  # evaluation mode and p = 0 are untouched
        torch.testing.assert_close(F.dropout(x, 0.1, False), x)


def test_cuda_autocast_rules():
    x = torch.randn(4, 8, 16)
    w = torch.randn(16, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cpu_ln = F.layer_norm(F.linear(x, w), (16,))
        with KernelEmulation(H100):
            h = F.linear(x, w)
            ln = F.layer_norm(h, (16,))
            sm = F.softmax(h, dim=-1)
            total = h.sum()
            e = torch.exp(h)
            ce = F.cross_entropy(h.view(-1, 16), torch.arange(32) % 16)
            kept = F.softmax(h, dim=-1, dtype=torch.bfloat16)
    assert h.dtype == torch.bfloat16  # linear: lower precision on both devices
    assert cpu_ln.dtype == torch.bfloat16  # the CPU keeps layer norm in bf16...
    assert ln.dtype == torch.float32  # ...CUDA runs it in fp32
    assert sm.dtype == total.dtype == e.dtype == torch.float32
    assert kept.dtype == torch.bfloat16  # an explicit dtype wins
    ref = F.cross_entropy(h.float().view(-1, 16), torch.arange(32) % 16)
    torch.testing.assert_close(ce, ref, rtol=1e-5, atol=1e-5)
    # Outside autocast nothing is cast.
    with KernelEmulation(H100):
        assert F.layer_norm(x.bfloat16(), (16,)).dtype == torch.bfloat16


def test_emulation_is_for_cuda_targets_only():
    with pytest.raises(ValueError, match="CUDA targets"):
        KernelEmulation(get_device("cpu"))


def test_emulation_under_fake_tensors_matches_real():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memfit.accounting import track

    def run():
        q, k, v = _qkv(lq=32, lk=32, dtype=torch.bfloat16)
        with track() as tracker, KernelEmulation(H100):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.sum().backward()
        return tracker.report().peak_bytes

    real = run()
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = run()
    assert fake == real > 0
