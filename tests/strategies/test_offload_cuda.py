"""The offload techniques on a CUDA device: pinned host buffers, the copy stream and
non-blocking copies train exactly like the plain plan on the same device, also while the device
runs far behind the host (so a host that read a copy before it landed would read garbage), and
parameter offload lowers the allocator's peak by the streamed blocks' bytes.

Skipped without a CUDA device (the CPU-only machines and CI); run them on a GPU machine. On the
CPU the same code takes synchronous copies, which the other offload tests cover.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import memfit
from memfit import device as dev
from memfit.apply.compose import apply_plan

pytestmark = pytest.mark.skipif(not dev.cuda_available(), reason="needs a CUDA device")

N_LAYER = 6


def _cuda() -> torch.device:
    return torch.device("cuda", 0)


def _gpt2() -> transformers.GPT2LMHeadModel:
    config = transformers.GPT2Config(n_embd=64, n_layer=N_LAYER, n_head=2, vocab_size=256,
                                     n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _batch(seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(seed))
    ids = ids.to(_cuda())
    return {"input_ids": ids, "labels": ids}


def _lag(model: torch.nn.Module) -> list:
    """Queue a few milliseconds of device work whenever a gradient is accumulated (before
    offload's own hooks, registered later, run): the device falls far behind the host."""
    x = torch.randn(1024, 1024, device=_cuda())

    def busy(_: torch.Tensor) -> None:
        y = x
        for _ in range(4):
            y = torch.tanh(y @ x)  # queued, never waited for

    return [p.register_post_accumulate_grad_hook(busy) for p in model.parameters()]


ONE_BUCKET = 1 << 16  # several buckets, stepped one by one in backward
VARIANTS = {
    "optimizer": dict(offload={"optimizer": "host"}),
    "optimizer-in-backward": dict(
        offload={"optimizer": "host", "bucket_bytes": ONE_BUCKET}, optimizer_in_backward=True
    ),
    "gradients-on-host": dict(
        offload={"optimizer": "host", "gradients_on_host": True}, grad_accum_steps=2
    ),
    "optimizer+parameters": dict(offload={"optimizer": "host", "parameters": "host"}),
    "optimizer+parameters-in-backward": dict(
        offload={"optimizer": "host", "parameters": "host", "bucket_bytes": ONE_BUCKET},
        optimizer_in_backward=True,
    ),
    "disk": dict(offload={"optimizer": "disk", "disk_dir": "TMP"}),
    "activations": dict(offload={"activations": True, "activation_min_bytes": 0}),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_trains_like_the_plain_plan_on_the_device(name, tmp_path):
    kwargs = copy.deepcopy(VARIANTS[name])
    if kwargs["offload"].get("disk_dir") == "TMP":
        kwargs["offload"]["disk_dir"] = str(tmp_path)
    plain = {"grad_accum_steps": kwargs.get("grad_accum_steps", 1)}
    reference, model = _gpt2().to(_cuda()), _gpt2().to(_cuda())
    _lag(reference)
    _lag(model)
    ref = apply_plan(reference, memfit.Plan(**plain))
    got = apply_plan(model, memfit.Plan(**kwargs))
    for step in range(3):
        expected = ref.step(_batch(step))
        torch.testing.assert_close(got.step(_batch(step)), expected, rtol=0, atol=1e-5)
    if kwargs["offload"].get("optimizer") == "host":
        assert all(m.is_pinned() for m in got.optimizer.masters)
    if name == "activations":
        counters = got.info["activation_offload"].counters
        assert counters.offloaded_bytes > 0 and counters.restored_bytes > 0
    got.remove()
    for (n, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.device.type == "cuda"
        # The host step is torch's fused CPU AdamW, the plain one the foreach CUDA AdamW: the
        # same update, rounded in another order.
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5, msg=n)


def test_parameter_offload_lowers_the_allocators_peak_by_the_streamed_blocks():
    peaks = {}
    for name, offload in (("alone", {"optimizer": "host"}),
                          ("streamed", {"optimizer": "host", "parameters": "host"})):  # fmt: skip
        model = _gpt2().to(_cuda())
        block = sum(p.numel() * p.element_size() for p in model.transformer.h[0].parameters())
        setup = apply_plan(model, memfit.Plan(offload=offload))
        dev.synchronize(_cuda())
        dev.reset_peak_memory_stats(_cuda())
        for step in range(2):
            setup.step(_batch(step))
        dev.synchronize(_cuda())
        peaks[name] = dev.max_memory_allocated(_cuda())
        setup.remove()
        del model, setup
        dev.empty_cache()
    # Two blocks at most are on the device at once; the others' parameters never are.
    assert peaks["alone"] - peaks["streamed"] >= (N_LAYER - 2) * block
