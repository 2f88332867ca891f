"""Every technique comes off again: after ``TrainingSetup.remove()`` the model is a fresh one."""

from __future__ import annotations

import pytest
import torch

from memfit.plan import Plan
from memfit.strategies.compose import apply_plan
from memfit.train.oom import switch_plan
from tests.train._helpers import tiny_gpt2

PLANS = {
    "freeze-body": Plan(freeze=("body",)),
    "freeze-embeddings": Plan(freeze=("embeddings",)),
    "bf16-pure": Plan(precision="bf16-pure"),
    "bf16-mixed": Plan(precision="bf16-mixed"),
    "selective": Plan(checkpointing="selective"),
    "full": Plan(checkpointing="full"),
    "sqrt": Plan(checkpointing="sqrt"),
    "fused-step": Plan(optimizer_in_backward=True),
    "everything": Plan(precision="bf16-pure", optimizer="adafactor", optimizer_in_backward=True,
                       checkpointing="full", freeze=("embeddings",)),
}  # fmt: skip


def _hooks(module: torch.nn.Module) -> tuple[int, ...]:
    return (
        len(module._forward_hooks),
        len(module._forward_pre_hooks),
        len(module._backward_hooks),
        len(module._backward_pre_hooks),
        "forward" in module.__dict__,  # an instance-level forward: a wrapper
    )


def assert_like_fresh(model: torch.nn.Module, fresh: torch.nn.Module, *, exact: bool) -> None:
    assert [type(m) for m in model.modules()] == [type(m) for m in fresh.modules()]
    assert [_hooks(m) for m in model.modules()] == [_hooks(m) for m in fresh.modules()]
    assert model.state_dict().keys() == fresh.state_dict().keys()
    params, fresh_params = dict(model.named_parameters()), dict(fresh.named_parameters())
    assert params.keys() == fresh_params.keys()
    for name, p in params.items():
        q = fresh_params[name]
        assert (p.dtype, p.requires_grad, p.shape) == (q.dtype, q.requires_grad, q.shape), name
        assert not getattr(p, "_post_accumulate_grad_hooks", None), name
        # Values are untouched, but bf16-pure rounded them on the way (no fp32 copy is kept:
        # that would cost the memory bf16-pure saves).
        expected = q if exact else q.to(torch.bfloat16).to(q.dtype)
        torch.testing.assert_close(p.detach(), expected.detach(), rtol=0, atol=0)
    for (name, b), (_, c) in zip(model.named_buffers(), fresh.named_buffers(), strict=True):
        assert b.dtype == c.dtype, name


@pytest.mark.parametrize("name", sorted(PLANS))
def test_remove_restores_a_fresh_model(name):
    model, fresh = tiny_gpt2(seed=0), tiny_gpt2(seed=0)
    setup = apply_plan(model, PLANS[name])
    assert PLANS[name] == Plan(precision="bf16-mixed") or _hooks_or_flags_changed(model, fresh)
    setup.remove()
    assert_like_fresh(model, fresh, exact=PLANS[name].precision.mode != "bf16-pure")


def _hooks_or_flags_changed(model, fresh) -> bool:
    """The plan did change the model (so the test above proves removal, not a no-op)."""
    hooks = [_hooks(m) for m in model.modules()] != [_hooks(m) for m in fresh.modules()]
    grads = [p.requires_grad for p in model.parameters()] != [
        p.requires_grad for p in fresh.parameters()
    ]
    dtypes = [p.dtype for p in model.parameters()] != [p.dtype for p in fresh.parameters()]
    param_hooks = any(getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters())
    return hooks or grads or dtypes or param_hooks


def test_stepping_down_from_bf16_pure_restores_fp32_weights_and_drops_its_hooks():
    model = tiny_gpt2(seed=0)
    setup = apply_plan(model, Plan(precision="bf16-pure", freeze=("embeddings",)))
    batch = {"input_ids": torch.randint(0, 259, (2, 16))}
    batch["labels"] = batch["input_ids"]
    setup.step(batch)
    trained = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    new, rebuilt = switch_plan(setup, Plan(precision="bf16-mixed"))
    assert rebuilt
    # Before, the weights stayed bf16 and the input-cast hook stayed on; freezing stayed too.
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(p.requires_grad for p in model.parameters())
    assert len(model._forward_pre_hooks) == 0
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), trained[n], rtol=0, atol=0)  # trained values kept
    loss = new.step(batch)  # and the new plan trains
    assert torch.isfinite(loss)
