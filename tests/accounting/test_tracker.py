"""The tracker counts every category to the byte on models we can count by hand."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memfit
from memfit.accounting import CATEGORIES
from tests.models import F32, mlp, param_bytes

B, D_IN, D_HID, D_OUT = 4, 16, 32, 8


def _zeros(**nonzero: int) -> dict[str, int]:
    out = dict.fromkeys(CATEGORIES, 0)
    out.update(nonzero)
    return out


@pytest.fixture
def setup():
    torch.manual_seed(0)
    model = mlp(D_IN, D_HID, D_OUT)
    x, y = torch.randn(B, D_IN), torch.randn(B, D_OUT)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    return model, x, y, opt


def test_mlp_categories_by_hand(setup):
    model, x, y, opt = setup
    P = param_bytes(model)
    assert P == ((D_IN + 1) * D_HID + (D_HID + 1) * D_OUT) * F32
    inputs = (B * D_IN + B * D_OUT) * F32
    with memfit.track(model, opt) as tr:
        tr.add_inputs((x, y))
        assert tr.snapshot() == _zeros(parameters=P, inputs=inputs)

        loss = nn.functional.mse_loss(model(x), y)
        # Saved for backward: ReLU's output (B x D_HID, also Linear2's input) and the
        # prediction (B x D_OUT, MSE's input). Linear1's input x is saved too but is an input;
        # its output is freed once ReLU has run. The loss is a scalar view of MSE's
        # elementwise buffer, whose storage is the one temporary.
        activations = (B * D_HID + B * D_OUT) * F32
        loss_bytes = loss.untyped_storage().nbytes()
        assert tr.snapshot() == _zeros(
            parameters=P, inputs=inputs, activations=activations, temporaries=loss_bytes
        )

        loss.backward()
        # Backward frees every activation and leaves one gradient per parameter.
        assert tr.snapshot() == _zeros(
            parameters=P, gradients=P, inputs=inputs, temporaries=loss_bytes
        )

        opt.step()
        # AdamW: exp_avg and exp_avg_sq per parameter plus a float32 step counter per tensor.
        n_tensors = len(list(model.parameters()))
        state = 2 * P + n_tensors * F32
        assert tr.snapshot() == _zeros(
            parameters=P, gradients=P, optimizer_state=state, inputs=inputs, temporaries=loss_bytes
        )
        opt.zero_grad(set_to_none=True)
        assert tr.snapshot()["gradients"] == 0

    report = tr.report()
    # The peak is in the single-tensor AdamW update of the largest weight: its
    # `exp_avg_sq.sqrt()` and the division of that by the bias correction are alive together.
    largest = max(p.numel() for p in model.parameters()) * F32
    assert report.peak_phase == "optimizer"
    assert report.peak_by_category == _zeros(
        parameters=P,
        gradients=P,
        optimizer_state=state,
        inputs=inputs,
        temporaries=2 * largest + loss_bytes,
    )
    assert report.peak_bytes == sum(report.peak_by_category.values())


def test_views_count_once():
    base = torch.zeros(1000)
    with memfit.track() as tr:
        x = torch.ones(256, 4)
        views = [x.view(-1), x[1:], x.t(), x.reshape(4, 256)]
        assert tr.snapshot()["temporaries"] == 256 * 4 * F32
        del views
    assert tr.report().peak_bytes == 256 * 4 * F32
    assert base.sum() == 0


def test_frees_are_seen():
    with memfit.track() as tr:
        a = torch.ones(1024)
        b = a * 2
        del a
        c = b + 1
        del b, c
        assert tr.live_bytes == 0
    rep = tr.report()
    # Peak: two 4 KiB tensors alive at once (a and b, then b and c).
    assert rep.peak_bytes == 2 * 1024 * F32


def test_transformer_block_activations_match_saved_tensors():
    """Activations of a transformer block equal its saved tensors, counted independently.

    The independent count runs the same forward untracked, with a saved-tensors hook that
    records every saved storage that is neither a parameter nor the input.
    """
    torch.manual_seed(0)
    block = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0)
    x = torch.randn(6, 3, 32)
    excluded = {p.untyped_storage()._cdata for p in block.parameters()}
    excluded.add(x.untyped_storage()._cdata)
    saved: dict[int, int] = {}

    def pack(t):
        key = t.untyped_storage()._cdata
        if key not in excluded:
            saved[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        expected_out = block(x)
    del expected_out

    with memfit.track(block) as tr:
        tr.add_inputs(x)
        out = block(x)
        snap = tr.snapshot()
    # The output is saved by no one inside the block but is alive: it is the one temporary.
    assert snap["activations"] == sum(saved.values())
    assert snap["temporaries"] == out.untyped_storage().nbytes()
    assert snap["parameters"] == param_bytes(block)
    assert snap["inputs"] == x.numel() * F32


@pytest.mark.parametrize("user_hook", [False, True])
def test_activations_hidden_by_another_saved_tensors_hook(user_hook):
    """A saved-tensors hook of the user's (or checkpointing's) hides the tracker's; what the
    forward kept is still counted as activations once backward starts."""
    import contextlib

    torch.manual_seed(0)
    model = mlp(D_IN, D_HID, D_OUT)
    x, y = torch.randn(B, D_IN), torch.randn(B, D_OUT)
    seen = []
    hook = (
        torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        if user_hook
        else contextlib.nullcontext()
    )
    with memfit.track(model) as tr:
        tr.add_inputs((x, y))
        with hook:  # like a checkpointed block: the loss is computed outside it
            h = model[1](model[0](x))
            h.register_hook(lambda g: seen.append(tr.snapshot()))
            pred = model[2](h)
        loss = nn.functional.mse_loss(pred, y)
        del pred
        loss.backward()
    # When the hook on ReLU's output fires, Linear2's backward is done; ReLU's output is the
    # one activation left (its own backward needs it).
    assert seen[0]["activations"] == B * D_HID * F32


def test_buffers_and_pre_existing_gradients():
    bn = nn.BatchNorm1d(8)
    bn(torch.randn(4, 8)).sum().backward()  # gradients exist before tracking starts
    buffers = sum(b.untyped_storage().nbytes() for b in bn.buffers())
    with memfit.track(bn) as tr:
        snap = tr.snapshot()
    assert snap["buffers"] == buffers
    assert snap["gradients"] == param_bytes(bn)


def test_optimizer_in_backward_gradients_are_seen_before_they_are_freed():
    """A gradient freed by another post-accumulate hook is still counted as a gradient."""
    model = mlp()
    seen: list[tuple[int, int]] = []
    tracker: list[memfit.MemoryTracker] = []

    def free(p: torch.Tensor) -> None:
        seen.append((tracker[0].snapshot()["gradients"], p.numel() * F32))
        p.grad = None

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(free)  # registered before the tracker's hook
    with memfit.track(model) as tr:
        tracker.append(tr)
        model(torch.randn(2, 16)).sum().backward()
    # Each gradient is labelled when it is ready, before the other hook frees it.
    assert len(seen) == 4
    assert all(grads == size for grads, size in seen)
    assert all(p.grad is None for p in model.parameters())


def test_phases_modules_and_timeline(setup):
    model, x, y, opt = setup
    with memfit.track(model, opt) as tr:
        tr.add_inputs((x, y))
        for _ in range(2):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    rep = tr.report()
    assert set(rep.phase_peaks) == {"forward", "backward", "optimizer"}
    assert max(rep.phase_peaks.values()) == rep.peak_bytes
    assert 0 < rep.phase_peaks["forward"] <= rep.phase_peaks["optimizer"]
    assert {"0", "1", "2"} <= set(rep.by_module)
    for v in rep.by_module.values():
        assert v["peak"] == max(v["forward"], v["backward"]) <= rep.peak_bytes
    assert len(rep.step_peaks) == 2 and max(rep.step_peaks) == rep.peak_bytes
    tl = rep.timeline
    assert len(tl["op_index"]) == rep.num_ops + 1
    totals = [sum(tl[c][i] for c in CATEGORIES) for i in range(len(tl["op_index"]))]
    assert max(totals) == rep.peak_bytes
    assert tl["phase"][rep.peak_op_index] == "optimizer"


def test_cap_raises_out_of_memory_with_breakdown():
    with pytest.raises(torch.OutOfMemoryError, match=r"cap.*temporaries"), memfit.track(cap=10_000):
        keep = [torch.ones(1000) for _ in range(3)]
        del keep
    with memfit.track(cap=100_000) as tr:
        keep = [torch.ones(1000) for _ in range(3)]
    assert tr.report().peak_bytes == 3 * 1000 * F32
    del keep


def test_fake_tensors_are_counted_without_allocating():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        big = nn.Linear(8192, 8192)  # 256 MiB of weights, never allocated
        x = torch.randn(64, 8192)
        with memfit.track(big) as tr:
            tr.add_inputs(x)
            big(x).sum().backward()
    rep = tr.report()
    assert rep.peak_by_category["parameters"] == (8192 * 8192 + 8192) * F32
    assert rep.peak_by_category["gradients"] > 0


def test_cuda_cross_check_when_available():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine; the CPU and fake paths are tested above")
    from memfit import device

    model = mlp().cuda()
    x = torch.randn(64, 16, device="cuda")
    # The first matrix product allocates cuBLAS's workspace inside the caching allocator (32
    # MiB on Hopper), which is not a tensor: made before the baseline, it is in ``base``.
    model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    device.reset_peak_memory_stats("cuda")
    base = device.memory_allocated("cuda")
    with memfit.track(model) as tr:
        tr.add_inputs(x)
        model(x).sum().backward()
    rep = tr.report()
    allocator_peak = device.max_memory_allocated("cuda") - base + param_bytes(model) + x.nbytes
    # The caching allocator rounds each block up to 512 bytes: at most 511 bytes more per
    # storage alive at the peak.
    trace = tr.trace()
    at = trace.peak_event
    live = sum(
        1
        for b, d, t in zip(trace.birth, trace.death, trace.tier, strict=True)
        if t == 0 and b <= at and (d < 0 or d > at)
    )
    assert 0 <= allocator_peak - rep.peak_bytes <= 511 * live
    # The peak falls inside backward, before the first layer's gradients exist; by the end
    # every gradient is counted, as gradients.
    assert 0 < rep.peak_by_category["gradients"] <= param_bytes(model)
    assert rep.timeline["gradients"][-1] == param_bytes(model)


def test_storage_resized_in_place_is_freed_and_allocated_again():
    from memfit.accounting.tracker import storage_resized

    lin = torch.nn.Linear(64, 64, bias=False)  # 16 KiB of weight
    nbytes = 64 * 64 * 4
    with memfit.track(lin) as tracker:
        assert tracker.snapshot()["parameters"] == nbytes
        lin.weight.untyped_storage().resize_(0)
        storage_resized([lin.weight])
        assert tracker.snapshot()["parameters"] == 0
        lin.weight.untyped_storage().resize_(nbytes)
        storage_resized([lin.weight])
        assert tracker.snapshot()["parameters"] == nbytes
        lin.weight.untyped_storage().resize_(0)
        storage_resized([lin.weight])
        big = torch.empty(2 * nbytes, dtype=torch.uint8)  # the new peak, with no weight alive
        del big
    report = tracker.report()
    assert report.peak_bytes == 2 * nbytes
    assert report.peak_by_category["parameters"] == 0
    storage_resized([lin.weight])  # no tracker open: nothing to tell
