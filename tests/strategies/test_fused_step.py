"""Optimizer in backward: same parameters as the unfused optimizer, and far fewer gradients."""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

import memfit
import memfit.optim as mo
from memfit.strategies.accumulation import loss_weights
from memfit.strategies.freezing import apply_freezing
from memfit.strategies.fused_step import OptimizerInBackward, optimizer_in_backward
from memfit.workload import load_workload, split_batch

STEPS = 4

FACTORIES: dict[str, Callable] = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "adamw8bit": lambda ps: mo.AdamW8bit(ps, lr=1e-2),
    "adafactor": lambda ps: mo.Adafactor(ps),
    "lamb": lambda ps: mo.Lamb(ps, lr=1e-2),
    "lars": lambda ps: mo.Lars(ps, lr=0.05, momentum=0.9),
}


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )


def _data(n: int = STEPS, batch: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(batch, 8, generator=g), torch.randn(batch, 4, generator=g)) for _ in range(n)
    ]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # Scaled up so that gradient norms are well above the clipping thresholds used below.
    return 10 * F.mse_loss(model(x), y)


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max(
        (p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


def _total_norm(model: nn.Module) -> torch.Tensor:
    return torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])


# ---------------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("name", list(FACTORIES))
def test_matches_unfused_optimizer(name):
    factory = FACTORIES[name]
    ref, fused = _mlp(), _mlp()
    opt = factory(list(ref.parameters()))
    handle = optimizer_in_backward(fused, factory)
    for x, y in _data():
        _loss(ref, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        handle.backward(_loss(fused, x, y))
        # Already stepped: no gradient is left anywhere.
        assert all(p.grad is None for p in fused.parameters())
    assert _max_diff(ref, fused) < 1e-6
    assert len(handle.optimizers) == len(list(fused.parameters()))


def test_bare_loss_backward_steps_too():
    ref, fused = _mlp(), _mlp()
    opt = FACTORIES["adamw"](list(ref.parameters()))
    handle = optimizer_in_backward(fused, FACTORIES["adamw"])
    for x, y in _data():
        _loss(ref, x, y).backward()
        opt.step()
        opt.zero_grad()
        _loss(fused, x, y).backward()
        handle.step()  # a no-op, so loops written for an ordinary optimizer run unchanged
        handle.zero_grad()
    assert _max_diff(ref, fused) < 1e-6


@pytest.mark.parametrize(
    "make_scheduler",
    [
        lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
        lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=STEPS),
    ],
    ids=["StepLR", "LambdaLR", "OneCycleLR"],
)
def test_lr_scheduler_on_the_handle(make_scheduler):
    ref, fused = _mlp(), _mlp()
    opt = FACTORIES["adamw"](list(ref.parameters()))
    handle = optimizer_in_backward(fused, FACTORIES["adamw"])
    ref_sched, sched = make_scheduler(opt), make_scheduler(handle)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        for x, y in _data():
            _loss(ref, x, y).backward()
            opt.step()
            opt.zero_grad()
            ref_sched.step()
            handle.backward(_loss(fused, x, y))
            sched.step()
            # The scheduler reaches every per-parameter optimizer.
            lrs = {g["lr"] for o in handle.optimizers for g in o.param_groups}
            assert lrs == {opt.param_groups[0]["lr"]}
    assert _max_diff(ref, fused) < 1e-6


@pytest.mark.parametrize("explicit_last", [False, True])
def test_accumulation_matches_unfused_accumulation(explicit_last):
    ref, fused = _mlp(), _mlp()
    opt = FACTORIES["adamw"](list(ref.parameters()))
    handle = optimizer_in_backward(fused, FACTORIES["adamw"], grad_accum_steps=3)
    for x, y in _data(batch=10):
        parts = split_batch((x, y), 4)  # 4 + 4 + 2 samples
        weights = loss_weights(parts, "mean")
        for part, w in zip(parts, weights, strict=True):
            (_loss(ref, *part) * w).backward()
        opt.step()
        opt.zero_grad()
        for i, (part, w) in enumerate(zip(parts, weights, strict=True)):
            last = i == len(parts) - 1 if explicit_last else None
            handle.backward(_loss(fused, *part) * w, last=last)
            # Earlier micro-batches accumulate as usual; the last one steps and frees.
            assert all((p.grad is None) == (i == len(parts) - 1) for p in fused.parameters())
    assert _max_diff(ref, fused) < 1e-6


class _Branchy(nn.Module):
    """``extra`` is used only when the input says so: it can miss the last micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.main = nn.Linear(4, 2)
        self.extra = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        out = self.main(x)
        return out + self.extra(x) if use_extra else out


def test_parameter_without_gradient_in_the_last_micro_batch_still_steps():
    ref, fused = _Branchy(), _Branchy()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    handle = optimizer_in_backward(
        fused, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), grad_accum_steps=2
    )
    for x, _ in _data():
        xs = x[:, :4]
        for m in (ref, fused):
            loss1, loss2 = m(xs, True).pow(2).mean() / 2, m(xs, False).pow(2).mean() / 2
            if m is ref:
                loss1.backward()
                loss2.backward()
                opt.step()
                opt.zero_grad()
            else:
                handle.backward(loss1)
                handle.backward(loss2)
    assert all(p.grad is None for p in fused.parameters())
    assert _max_diff(ref, fused) < 1e-6


def test_exact_clipping_equals_clip_grad_norm():
    factory = FACTORIES["sgd-momentum"]  # SGD: clipping changes the update (Adam's barely)
    ref, fused = _mlp(), _mlp()
    opt = factory(list(ref.parameters()))
    handle = optimizer_in_backward(fused, factory, max_grad_norm=0.5, clip_mode="exact")
    for x, y in _data():
        _loss(ref, x, y).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        assert norm > 0.5  # clipping is active
        opt.step()
        opt.zero_grad()
        handle.backward(_loss(fused, x, y))
        assert handle.last_norm is not None
        assert abs(handle.last_norm.item() - norm.item()) < 1e-5 * norm.item()
    assert _max_diff(ref, fused) < 1e-6


class _Checkpointed(nn.Module):
    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = _mlp()
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inner[0](x)
        return checkpoint(self.inner[1:], h, use_reentrant=self.use_reentrant)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_exact_clipping_with_activation_checkpointing(use_reentrant):
    # The norm-only backward keeps the graph for the real one; checkpointed segments recompute
    # in both (reentrant checkpointing refuses backward(inputs=...): measured over the graph).
    factory = FACTORIES["sgd-momentum"]
    ref, fused = _Checkpointed(use_reentrant), _Checkpointed(use_reentrant)
    opt = factory(list(ref.parameters()))
    handle = optimizer_in_backward(fused, factory, max_grad_norm=0.5)
    for x, y in _data():
        _loss(ref, x, y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        handle.backward(_loss(fused, x, y))
    assert _max_diff(ref, fused) < 1e-6


@pytest.mark.parametrize("accum", [1, 2])
def test_approx_clipping_uses_the_previous_norm(accum):
    factory = FACTORIES["sgd-momentum"]
    max_norm = 0.5
    ref, fused = _mlp(), _mlp()
    opt = factory(list(ref.parameters()))
    handle = optimizer_in_backward(
        fused, factory, max_grad_norm=max_norm, clip_mode="approx", grad_accum_steps=accum
    )
    previous = None
    for x, y in _data(STEPS + 1):
        parts = split_batch((x, y), 6 // accum)
        for part in parts:
            (_loss(ref, *part) / accum).backward()
        norm = _total_norm(ref)
        # The documented semantics: step t uses step t-1's unclipped norm. The first step has
        # none: measured exactly when not accumulating, unclipped when accumulating.
        used = previous if previous is not None else (norm if accum == 1 else None)
        if used is not None:
            coef = torch.clamp(max_norm / (used + 1e-6), max=1.0)
            assert coef < 1  # clipping is active
            for p in ref.parameters():
                p.grad.mul_(coef)
        previous = norm
        opt.step()
        opt.zero_grad()
        for part in parts:
            handle.backward(_loss(fused, *part) / accum)
        assert abs(handle.last_norm.item() - norm.item()) < 1e-5 * norm.item()
    assert _max_diff(ref, fused) < 1e-6


def test_begin_and_end_step_drive_a_loop_that_runs_backward_itself():
    """A loop that calls ``loss.backward()`` itself (the Hugging Face Trainer) steps through
    the public ``begin_step`` / ``end_step`` exactly as ``handle.backward`` does: the same
    parameters, the same ``last_norm`` (approx clipping, two micro-batches)."""
    factory = FACTORIES["sgd-momentum"]
    ours, theirs = _mlp(), _mlp()
    kwargs = {"max_grad_norm": 0.5, "clip_mode": "approx", "grad_accum_steps": 2}
    handle = optimizer_in_backward(ours, factory, **kwargs)
    outside = optimizer_in_backward(theirs, factory, **kwargs)
    for x, y in _data(STEPS):
        parts = split_batch((x, y), 3)
        for i, part in enumerate(parts):
            handle.backward(_loss(ours, *part) / 2)
            outside.begin_step(last=i == len(parts) - 1)
            (_loss(theirs, *part) / 2).backward()
        outside.end_step()
        assert all(p.grad is None for p in theirs.parameters())
        assert torch.equal(handle.last_norm, outside.last_norm)
    assert _max_diff(ours, theirs) == 0


@pytest.mark.parametrize("accum", [1, 2])
def test_track_grad_norm_without_clipping(accum):
    """No clipping, ``track_grad_norm``: after each step ``last_norm`` is the global norm of the
    accumulated gradient an unfused run holds before its step (a loop's logged grad norm)."""
    factory = FACTORIES["adamw"]
    ref, fused = _mlp(), _mlp()
    opt = factory(list(ref.parameters()))
    handle = optimizer_in_backward(fused, factory, grad_accum_steps=accum, track_grad_norm=True)
    assert handle.last_norm is None
    for x, y in _data():
        parts = split_batch((x, y), 6 // accum)
        for part in parts:
            (_loss(ref, *part) / accum).backward()
        norm = _total_norm(ref)
        opt.step()
        opt.zero_grad()
        for part in parts:
            handle.backward(_loss(fused, *part) / accum)
        torch.testing.assert_close(handle.last_norm, norm, rtol=1e-5, atol=0)
    assert _max_diff(ref, fused) < 1e-6


def _train(model, handle, sched, data, accum):
    for x, y in data:
        for part in split_batch((x, y), 6 // accum):
            handle.backward(_loss(model, *part) / accum)
        sched.step()


def test_state_dict_round_trip_continues_exactly():
    accum = 2

    def build(model):
        handle = optimizer_in_backward(
            model, FACTORIES["adamw"], grad_accum_steps=accum, max_grad_norm=0.5, clip_mode="approx"
        )
        return handle, torch.optim.lr_scheduler.StepLR(handle, step_size=1, gamma=0.7)

    data = _data(4)
    model = _mlp()
    handle, sched = build(model)
    _train(model, handle, sched, data[:2], accum)
    buf = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "opt": handle.state_dict(), "sched": sched.state_dict()}, buf
    )
    _train(model, handle, sched, data[2:], accum)  # uninterrupted

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)
    resumed = _mlp(seed=123)
    resumed.load_state_dict(ckpt["model"])
    handle2, sched2 = build(resumed)
    handle2.load_state_dict(ckpt["opt"])
    sched2.load_state_dict(ckpt["sched"])
    _train(resumed, handle2, sched2, data[2:], accum)
    assert all(
        torch.equal(p, q) for p, q in zip(model.parameters(), resumed.parameters(), strict=True)
    )
    assert list(handle.state_dict()["optimizers"]) == [n for n, _ in model.named_parameters()]


def test_load_state_dict_checks_parameter_names():
    handle = optimizer_in_backward(_mlp(), FACTORIES["adamw"])
    state = handle.state_dict()
    other = nn.Sequential(nn.Linear(8, 4))
    with pytest.raises(ValueError, match=r"unexpected 2\.weight, 2\.bias"):
        optimizer_in_backward(other, FACTORIES["adamw"]).load_state_dict(state)
    with pytest.raises(ValueError, match="not an optimizer_in_backward state dict"):
        handle.load_state_dict(torch.optim.SGD(_mlp().parameters(), lr=1).state_dict())


def test_remove_restores_ordinary_backward():
    ref, fused = _mlp(), _mlp()
    opt = FACTORIES["adamw"](list(ref.parameters()))
    handle = optimizer_in_backward(fused, FACTORIES["adamw"])
    data = _data()
    for i, (x, y) in enumerate(data):
        _loss(ref, x, y).backward()
        opt.step()
        opt.zero_grad()
        if i == 2:
            handle.remove()
        loss = _loss(fused, x, y)
        if i < 2:
            handle.backward(loss)
            continue
        before = [p.detach().clone() for p in fused.parameters()]
        loss.backward()
        # No hook: the gradient stays and nothing moved until step().
        assert all(p.grad is not None for p in fused.parameters())
        assert all(torch.equal(p, b) for p, b in zip(fused.parameters(), before, strict=True))
        handle.step()
        handle.zero_grad()
        assert all(p.grad is None for p in fused.parameters())
    assert _max_diff(ref, fused) < 1e-6


def test_frozen_parameters_are_skipped():
    model = _mlp()
    apply_freezing(model, ["0.*"])
    frozen = [p.detach().clone() for p in model[0].parameters()]
    handle = optimizer_in_backward(model, FACTORIES["adamw"])
    assert handle.names == ["2.weight", "2.bias", "4.weight", "4.bias"]
    for x, y in _data():
        handle.backward(_loss(model, x, y))
    assert all(torch.equal(p, f) for p, f in zip(model[0].parameters(), frozen, strict=True))
    assert all(p.grad is None for p in model.parameters())


def test_handle_is_an_optimizer_with_merged_state():
    model = _mlp()
    handle = optimizer_in_backward(model, FACTORIES["adamw"])
    assert isinstance(handle, torch.optim.Optimizer) and isinstance(handle, OptimizerInBackward)
    assert len(handle.state) == 0
    x, y = _data(1)[0]
    handle.backward(_loss(model, x, y))
    assert len(handle.state) == len(handle.params)
    assert set(handle.state[model[0].weight]) == {"step", "exp_avg", "exp_avg_sq"}
    assert len(handle.param_groups) == len(handle.params)
    with pytest.raises(NotImplementedError):
        handle.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})


def test_errors():
    model = _mlp()
    adamw = FACTORIES["adamw"]
    with pytest.raises(ValueError, match=r"'exact' .* or 'approx'"):
        optimizer_in_backward(model, adamw, max_grad_norm=1.0, clip_mode="previous")
    with pytest.raises(ValueError, match="clip_mode='approx'"):
        optimizer_in_backward(model, adamw, max_grad_norm=1.0, grad_accum_steps=2)
    with pytest.raises(ValueError, match="grad_accum_steps"):
        optimizer_in_backward(model, adamw, grad_accum_steps=0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        optimizer_in_backward(model, adamw, max_grad_norm=0.0)
    frozen = _mlp()
    frozen.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        optimizer_in_backward(frozen, adamw)
    with pytest.raises(TypeError, match="without 'step'"):
        optimizer_in_backward(model, lambda ps: object())
    x, y = _data(1)[0]
    for kwargs in ({"max_grad_norm": 1.0}, {"grad_accum_steps": 2}):
        m = _mlp()
        handle = optimizer_in_backward(m, adamw, **kwargs)
        with pytest.raises(RuntimeError, match=r"call handle\.backward\(loss\)"):
            _loss(m, x, y).backward()
        handle.remove()
    m = _mlp()
    handle = optimizer_in_backward(m, adamw, max_grad_norm=1.0)
    m[0].weight.grad = torch.zeros_like(m[0].weight)
    with pytest.raises(ValueError, match="zero_grad"):
        handle.backward(_loss(m, x, y))
    with pytest.raises(ValueError, match="no closure"):
        handle.step(lambda: 0.0)


# ---------------------------------------------------------------------------------- memory
def _gradient_peak(model: nn.Module, run: Callable[[], None], optimizer=None) -> int:
    with memfit.track(model, optimizer) as tr:
        run()
    # The most gradient bytes alive at any moment.
    return max(tr.report().timeline["gradients"])


def _bucket_bytes(model: nn.Module) -> int:
    # The gradients one backward node produces together: a module's own parameters (addmm's
    # backward returns a Linear's weight and bias gradients at once).
    return max(
        sum(p.numel() * p.element_size() for p in m.parameters(recurse=False) if p.requires_grad)
        for m in model.modules()
    )


@pytest.mark.parametrize("clip", [None, "exact", "approx"])
def test_fused_gradient_peak_is_one_bucket(clip):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 8)
    )
    x = torch.randn(4, 64)
    total = sum(p.numel() * 4 for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def unfused():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    kwargs = {} if clip is None else {"max_grad_norm": 1e-3, "clip_mode": clip}
    handle = optimizer_in_backward(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), **kwargs)

    def fused():
        for _ in range(2):
            handle.backward(model(x).square().mean())

    fused_peak = _gradient_peak(model, fused, handle)
    handle.remove()
    unfused_peak = _gradient_peak(model, unfused, opt)
    assert unfused_peak == total  # every gradient at once
    largest = max(p.numel() * 4 for p in model.parameters())
    bucket = _bucket_bytes(model)
    assert bucket == largest + 512 * 4  # the 256x512 weight and its bias
    assert 0 < fused_peak <= bucket < unfused_peak


def test_fused_gradient_peak_on_gpt2_with_tied_head():
    model, batch = load_workload("gpt2-tiny", 2, 16).build()
    handle = optimizer_in_backward(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    peak = _gradient_peak(model, lambda: handle.backward(model(**batch).loss), handle)
    handle.remove()
    total = sum(p.numel() * 4 for p in model.parameters())
    wte = model.transformer.wte.weight.numel() * 4
    # The token embedding is used twice (input embedding, tied LM head): autograd holds its
    # first partial gradient until the second arrives. Besides it, one bucket at most.
    assert wte <= peak <= wte + _bucket_bytes(model)
    assert peak < total / 2
