"""``prepare``: whole-batch steps and the accumulate-aware loop, against a plain reference."""

from __future__ import annotations

import pytest
import torch

from memfit.plan import Plan
from memfit.train import prepare
from memfit.workload import split_batch

from ._helpers import params, tiny_gpt2

LR = 0.5
# SGD: the update is linear in the gradient, so float-rounding differences between
# micro-batched and whole-batch gradients stay at rounding size (Adam divides them by
# sqrt(v), which magnifies them for near-zero gradients).
OPT = {"name": "sgd", "lr": LR}


def _batch(n: int = 8, seq: int = 16) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 259, (n, seq), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


def _reference(steps: int = 2) -> dict[str, torch.Tensor]:
    """A plain loop: the whole batch, SGD, fp32."""
    model = tiny_gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(steps):
        model(**_batch()).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return params(model)


def _close(model, expected) -> None:
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], atol=1e-5, rtol=1e-5)


def test_step_micro_batches_like_the_whole_batch():
    prepared = prepare(tiny_gpt2(), plan=Plan(micro_batch_size=2, grad_accum_steps=4, optimizer=OPT))
    for _ in range(2):
        loss = prepared.step(_batch())
        assert loss.dim() == 0 and not loss.requires_grad
    _close(prepared.model, _reference())


def test_prepare_uses_my_optimizer():
    model = tiny_gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    prepared = prepare(model, Plan(grad_accum_steps=2), optimizer=opt)
    assert prepared.optimizer is opt
    for _ in range(2):
        prepared.step(_batch())
    _close(model, _reference())


@pytest.mark.parametrize("fused", [False, True], ids=["optimizer", "optimizer-in-backward"])
def test_accumulate_steps_every_grad_accum_steps(fused):
    plan = Plan(grad_accum_steps=4, optimizer=OPT, optimizer_in_backward=fused)
    prepared = prepare(tiny_gpt2(), plan=plan)
    start = params(prepared.model)
    syncs = []
    for step in range(2):
        for i, micro in enumerate(split_batch(_batch(), 2)):
            syncs.append(prepared.sync_gradients)
            with prepared.accumulate():
                with prepared.autocast():
                    loss = prepared.model(**micro).loss
                prepared.backward(loss)
            if step == 0 and i < 3:
                # Mid-accumulation nothing has stepped yet.
                assert all(torch.equal(p, start[n]) for n, p in prepared.model.named_parameters())
    assert syncs == [False, False, False, True] * 2
    assert prepared.setup.steps_done == 2
    assert all(p.grad is None for p in prepared.model.parameters())  # cleared after each step
    _close(prepared.model, _reference())


def test_a_failed_micro_batch_is_not_counted():
    prepared = prepare(tiny_gpt2(), plan=Plan(grad_accum_steps=2))
    with pytest.raises(RuntimeError, match="boom"), prepared.accumulate():
        raise RuntimeError("boom")
    assert prepared.sync_gradients is False  # still waiting for the first of two
    with pytest.raises(RuntimeError, match="nested"), prepared.accumulate(), prepared.accumulate():
        pass


def test_prepare_takes_the_plan_second_like_apply_plan():
    import torch

    model = tiny_gpt2()
    plan = Plan(grad_accum_steps=2)
    assert prepare(model, plan).plan == plan  # once silently taken as the optimizer
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"takes a memfit\.Plan second"):
        prepare(model, opt)
    with pytest.raises(TypeError, match=r"optimizer= got a memfit\.Plan"):
        prepare(model, optimizer=plan)
