"""The contiguous gradient buffer: gradients are views into one flat buffer that backward
writes in place; training equals the plain run exactly; the tracker sees no gradient
allocation after the first step; the allocator model reserves less for many small
gradients."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import memfit
from memfit import Plan, PlanError
from memfit.accounting.allocator import SMALL_BUFFER, replay_records, round_size
from memfit.accounting.trace import CATEGORIES
from memfit.apply.compose import apply_plan
from memfit.strategies.grad_buffer import ALIGN_BYTES, apply_grad_buffer

F32 = 4
GRADIENTS = CATEGORIES.index("gradients")


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 64)
        self.b = torch.nn.Linear(64, 63)  # odd sizes: the buffer pads them to ALIGN_BYTES
        self.c = torch.nn.Linear(63, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.b(torch.nn.functional.gelu(self.a(x))))
        return ((self.c(h) - y) ** 2).mean()


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


# ---------------------------------------------------------------------------- mechanics
def test_backward_accumulates_into_the_views_in_place():
    torch.manual_seed(0)
    model = Net()
    handle = apply_grad_buffer(model)
    (buffer,) = handle.buffers.values()
    padded = sum(-(-p.numel() // (ALIGN_BYTES // F32)) * (ALIGN_BYTES // F32)
                 for p in model.parameters())  # fmt: skip
    assert buffer.numel() == padded and handle.nbytes == padded * F32
    assert padded > sum(p.numel() for p in model.parameters())  # 63-wide tensors were padded
    opt = torch.optim.AdamW(model.parameters())
    for step in range(2):
        for micro in range(2):  # accumulation: the second backward adds into the same views
            model(*_batch(2 * step + micro)).backward()
            for p, v in zip(handle.params, handle.views, strict=True):
                assert p.grad is v and _storage(p.grad) == _storage(buffer)
                assert p.grad.data_ptr() % ALIGN_BYTES == 0
        opt.step()
        opt.zero_grad(set_to_none=True)  # drops the views ...
        assert all(p.grad is None for p in model.parameters())
    with torch.no_grad():
        model(*_batch(9))  # ... a forward without gradients leaves them dropped
    assert all(p.grad is None for p in model.parameters())
    model(*_batch(9))  # ... the next forward with gradients re-attaches them, zeroed
    assert all(p.grad is v for p, v in zip(handle.params, handle.views, strict=True))
    assert not buffer.any()


def test_gradients_equal_the_plain_backward_and_zero_grad_keeps_the_views():
    torch.manual_seed(0)
    plain = Net()
    model = copy.deepcopy(plain)
    handle = apply_grad_buffer(model)
    for seed in range(2):
        plain(*_batch(seed)).backward()
        model(*_batch(seed)).backward()
        for p, q in zip(plain.parameters(), model.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)
        plain.zero_grad(set_to_none=True)
        handle.zero_grad()
        assert all(p.grad is v for p, v in zip(handle.params, handle.views, strict=True))
        assert all(not b.any() for b in handle.buffers.values())


def test_strided_parameter_gets_a_view_with_its_layout():
    model = torch.nn.Linear(8, 4)
    model.weight = torch.nn.Parameter(torch.randn(8, 4).t())  # dense, not contiguous
    handle = apply_grad_buffer(model)
    assert model.weight.grad.stride() == model.weight.stride()
    model(torch.randn(3, 8)).sum().backward()
    assert model.weight.grad is handle.views[0]
    assert model.weight.grad.stride() == (1, 4)


def test_frozen_parameters_and_dtypes():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).bfloat16())
    model[0].weight.requires_grad_(False)
    handle = apply_grad_buffer(model)
    assert model[0].weight.grad is None and len(handle.params) == 3
    assert {dtype for dtype, _ in handle.buffers} == {torch.float32, torch.bfloat16}
    assert handle.buffers[(torch.bfloat16, torch.device("cpu"))].numel() == 16 + 8  # 4 + pad


def test_remove_restores_plain_gradients():
    torch.manual_seed(0)
    model = Net()
    handle = apply_grad_buffer(model)
    model(*_batch(0)).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    handle.remove()
    handle.remove()  # idempotent
    for p, g in zip(model.parameters(), grads, strict=True):
        assert torch.equal(p.grad, g) and p.grad._base is None  # its own storage now
    model.zero_grad(set_to_none=True)
    model(*_batch(1))
    assert all(p.grad is None for p in model.parameters())  # the re-attach hook is gone
    assert not handle.buffers and not handle.views


def test_no_trainable_parameter_is_refused():
    model = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no"):
        apply_grad_buffer(model)


# ---------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("accum", [1, 4])
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_parameters_equal_the_plain_run(accum, precision):
    torch.manual_seed(0)
    plain_model = Net()
    model = copy.deepcopy(plain_model)
    common = dict(grad_accum_steps=accum, max_grad_norm=0.5, precision=precision)
    plain = apply_plan(plain_model, Plan(**common))
    buffered = apply_plan(model, Plan(**common, grad_buffer=True))
    assert buffered.info["grad_buffer_bytes"] > 0
    for step in range(4):
        plain.step(_batch(step))
        buffered.step(_batch(step))
    # The same ops in the same order (the first micro-batch adds into zeros: exact): equal.
    for p, q in zip(plain_model.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0)
    buffered.remove()
    assert all(p.grad is None for p in model.parameters())


class Branchy(torch.nn.Module):
    """A model with a head that the loss never reaches."""

    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(4, 4)
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x).square().mean()


def test_a_parameter_backward_never_reaches_is_not_stepped():
    # With a zero view as .grad, AdamW would decay the weight and move it by its moments; the
    # buffer hides such views from the step so that the run equals the plain one.
    torch.manual_seed(0)
    plain_model = Branchy()
    model = copy.deepcopy(plain_model)
    before = [p.clone() for p in model.unused.parameters()]
    opt = {"name": "adamw", "kwargs": {"weight_decay": 0.1}}
    plain = apply_plan(plain_model, Plan(optimizer=opt))
    buffered = apply_plan(model, Plan(optimizer=opt, grad_buffer=True))
    for step in range(3):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step))
        plain.step(x)
        buffered.step(x)
    for p, b in zip(model.unused.parameters(), before, strict=True):
        assert torch.equal(p, b)
    for p, q in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)


# ---------------------------------------------------------------------------- memory
def _tracked(model: torch.nn.Module, plan: Plan, batches: list) -> memfit.MemoryTracker:
    setup = apply_plan(model, plan)
    with memfit.track(model, setup.optimizer) as tracker:
        for batch in batches:
            setup.step(batch)
    return tracker


@pytest.mark.parametrize("accum", [1, 4])
def test_no_gradient_allocation_after_the_first_step(accum):
    steps = 3
    counts = {}
    for buffered in (False, True):
        torch.manual_seed(0)
        plan = Plan(grad_accum_steps=accum, max_grad_norm=1.0, grad_buffer=buffered)
        trace = _tracked(Net(), plan, [_batch(s) for s in range(steps)]).trace()
        assert len(trace.step_boundaries) == steps
        first_step_end = trace.op_end_event[trace.step_boundaries[0]]
        grads = [i for i, c in enumerate(trace.category) if c == GRADIENTS]
        later = [i for i in grads if trace.birth[i] > first_step_end]
        counts[buffered] = (len(grads), len(later))
    n_params = len(list(Net().parameters()))
    # Plain: each step's first micro-batch makes one gradient per parameter (the later ones
    # add into it). Buffer: one storage, made once, none after.
    assert counts[False] == (n_params * steps, n_params * (steps - 1))
    assert counts[True] == (1, 0)


class Square(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).square().mean()


def test_peak_when_the_buffer_meets_a_new_gradient():
    # One weight W, SGD (its step allocates nothing): the peak is W's backward, when the new
    # gradient of W exists. Plain training keeps that tensor as W.grad; the buffer run holds
    # the buffer too while the new gradient is added into it: exactly one W more.
    peaks = {}
    for buffered in (False, True):
        torch.manual_seed(0)
        model = Square(torch.nn.Linear(256, 64, bias=False))
        plan = Plan(optimizer="sgd", grad_buffer=buffered)
        batches = [torch.randn(8, 256) for _ in range(2)]
        tracker = _tracked(model, plan, batches)
        peaks[buffered] = tracker.trace().peak_bytes
    assert peaks[True] - peaks[False] == 256 * 64 * F32


class ManySmall(torch.nn.Module):
    """``n`` parameters of 4 floats (16 bytes): each is a 512-byte block of the allocator."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(4)) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((p * x[i]).sum() for i, p in enumerate(self.ps))


def test_reserved_bytes_of_many_small_gradients():
    # 2048 parameters of 16 bytes: the allocator rounds each to a 512-byte block, so the
    # parameters fill half a 2 MiB small-pool segment and their gradients the other half;
    # the batch and the step's small temporaries need a second segment. The buffer is one
    # block of 2048 x 16 bytes = 32 KiB, beside the parameters in the first segment, with
    # room to spare for the rest: one segment fewer.
    n = 2048
    assert n * 2 * round_size(16) == SMALL_BUFFER
    replays, peaks = {}, {}
    for buffered in (False, True):
        torch.manual_seed(0)
        batches = [torch.randn(n, 4)]
        trace = _tracked(ManySmall(n), Plan(optimizer="sgd", grad_buffer=buffered), batches).trace()
        replays[buffered] = replay_records(trace.nbytes, trace.birth, trace.death, trace.tier)
        peaks[buffered] = trace.peak_bytes
    plain, buffered = replays[False], replays[True]
    assert plain.peak_reserved_bytes - buffered.peak_reserved_bytes == SMALL_BUFFER
    # Allocated (rounded) bytes: the gradients' n blocks of 512 B become one 32 KiB block,
    # plus one new 16-byte gradient (a 512-byte block) being added into the buffer at the
    # peak, which the plain run keeps as the gradient itself.
    saved = n * round_size(16) - round_size(n * 16)
    assert plain.peak_allocated_bytes - buffered.peak_allocated_bytes == saved - round_size(16)
    # Tensor bytes: the same, but for that one new gradient.
    assert peaks[True] - peaks[False] == 16


# ---------------------------------------------------------------------------- the plan
def test_plan_round_trip_and_summary(tmp_path):
    plan = Plan(grad_buffer=True, grad_accum_steps=2, max_grad_norm=1.0)
    assert plan.to_dict()["grad_buffer"] is True
    assert Plan.from_dict(json.loads(plan.to_json())) == plan
    path = tmp_path / "plan.yaml"
    plan.to_yaml(path)
    assert Plan.load(path) == plan
    assert "contiguous gradient buffer" in plan.summary()
    assert Plan().to_dict()["grad_buffer"] is False
    old = Plan().to_dict()
    del old["grad_buffer"]  # a plan written before the field existed
    assert Plan.from_dict(old).grad_buffer is False


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"optimizer_in_backward": True}, "optimizer_in_backward"),
        ({"offload": "host"}, "optimizer offload"),
        ({"offload": {"optimizer": "host", "bucket_bytes": 1 << 20}}, "bucket_bytes"),
    ],
)
def test_plan_refuses_combinations(fields, words):
    with pytest.raises(PlanError, match=words):
        Plan(grad_buffer=True, **fields)


def test_plan_refuses_a_non_bool():
    with pytest.raises(PlanError, match="grad_buffer must be true or false"):
        Plan.from_dict({"grad_buffer": "yes"})


def test_offload_bucket_size_is_the_plan_setting():
    # The bucket size comes from the plan, whatever the model's size.
    from memfit.strategies.optimizer_offload import HostOffloadOptimizer

    for width in (8, 64):
        model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(4)))
        setup = apply_plan(model, Plan(offload={"optimizer": "host", "bucket_bytes": 4096}))
        assert isinstance(setup.optimizer, HostOffloadOptimizer)
        params = setup.optimizer.params
        for bucket in setup.optimizer.buckets:
            nbytes = sum(params[i].numel() * params[i].element_size() for i in bucket)
            assert nbytes <= 4096 or len(bucket) == 1
        setup.remove()


def test_a_handle_nobody_removed_is_collected():
    import gc
    import weakref

    model = Net()
    ref = weakref.ref(apply_grad_buffer(model))
    del model
    gc.collect()
    assert ref() is None  # the global optimizer hook does not keep it (and its model) alive
    opt = torch.optim.SGD(Net().parameters())
    opt.step()  # its dead hook does nothing


def test_existing_and_tied_gradients():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False))
    model[1].weight = model[0].weight  # tied: one parameter, one view
    model(torch.randn(2, 4)).sum().backward()
    before = model[0].weight.grad.clone()
    handle = apply_grad_buffer(model)
    assert len(handle.views) == 1 and handle.nbytes == 16 * F32
    assert model[0].weight.grad is handle.views[0] and torch.equal(handle.views[0], before)
