"""Every technique comes off again: after ``remove()`` the model is a fresh one.

"Fresh" is checked on everything a technique may touch: module types and names, every
module's instance attributes and hook dicts (forward, backward, pre, with-kwargs, state-dict
hooks, an instance-level ``forward``), parameters (dtype, shape, ``requires_grad``, gradient,
tensor hooks, ties, values), buffers (dtype, values), state-dict keys and torch's global module
hooks. Values are compared bit for bit; bf16-pure without ``keep_original_weights`` gives back
the bf16 rounding of each weight, as documented.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from memfit.apply.compose import apply_plan
from memfit.plan import Plan
from memfit.strategies.checkpointing import CheckpointConfig, apply_checkpointing
from memfit.strategies.freezing import apply_freezing
from memfit.strategies.fused_step import optimizer_in_backward
from memfit.strategies.precision import (
    PrecisionConfig,
    apply_precision,
    unwrap_optimizer_bf16,
    wrap_optimizer_bf16,
)
from memfit.strategies.removable import Removable
from tests.train._helpers import tiny_gpt2

BATCH_IDS = torch.randint(0, 259, (2, 16), generator=torch.Generator().manual_seed(0))


def _batch() -> dict[str, torch.Tensor]:
    return {"input_ids": BATCH_IDS, "labels": BATCH_IDS}


# ---------------------------------------------------------------------------------- snapshot
def _name(hook: object) -> str:
    return getattr(hook, "__qualname__", type(hook).__qualname__)


def _hooks(table: object) -> object:
    if isinstance(table, dict):
        return tuple((type(v).__name__, _name(v)) for v in table.values())
    return repr(table)


def _global_hooks() -> tuple[int, ...]:
    mod = torch.nn.modules.module
    names = [n for n in dir(mod) if n.startswith("_global_") and n.endswith("hooks")]
    return tuple(len(getattr(mod, n)) for n in sorted(names))


def snapshot(model: nn.Module) -> dict[str, object]:
    """Everything but parameter and buffer values."""
    modules = []
    for name, m in model.named_modules(remove_duplicate=False):
        hooks = {k: _hooks(v) for k, v in m.__dict__.items() if "hook" in k}
        modules.append((name, type(m), sorted(m.__dict__), m.training, hooks))
    first_name: dict[int, str] = {}
    params = []
    for name, p in model.named_parameters(remove_duplicate=False):
        tied_to = first_name.setdefault(id(p), name)
        params.append(
            (
                name,
                type(p),
                p.dtype,
                tuple(p.shape),
                p.requires_grad,
                p.grad is None,
                tied_to,
                _hooks(dict(p._post_accumulate_grad_hooks or {})),
                _hooks(dict(p._backward_hooks or {})),
                sorted(p.__dict__),
            )
        )
    buffers = [(n, b.dtype, tuple(b.shape)) for n, b in model.named_buffers(remove_duplicate=False)]
    return {
        "modules": modules,
        "params": params,
        "buffers": buffers,
        "state_dict": list(model.state_dict()),
        "global_hooks": _global_hooks(),
    }


def assert_like_fresh(model: nn.Module, fresh: nn.Module, *, rounded: bool = False) -> None:
    """``model`` equals ``fresh`` in structure and values (``rounded``: bf16-rounded values)."""
    assert snapshot(model) == snapshot(fresh)
    for (name, p), (_, q) in zip(
        model.named_parameters(), fresh.named_parameters(), strict=True
    ):
        expected = q.detach().to(torch.bfloat16).to(q.dtype) if rounded else q.detach()
        assert torch.equal(p.detach(), expected), name
    for (name, b), (_, c) in zip(model.named_buffers(), fresh.named_buffers(), strict=True):
        expected = c.to(torch.bfloat16).to(c.dtype) if rounded and c.is_floating_point() else c
        assert torch.equal(b, expected), name


def _changed(model: nn.Module, fresh: nn.Module) -> bool:
    return snapshot(model) != snapshot(fresh)


# ---------------------------------------------------------------------------------- alone
def _freeze(model):
    return apply_freezing(model, ["embeddings", "transformer.h.0.*"])


def _checkpoint(mode):
    def apply(model):
        return apply_checkpointing(model, CheckpointConfig(mode, budget_bytes=1 << 16))

    return apply


def _fused(model):
    return optimizer_in_backward(model, lambda ps: torch.optim.SGD(ps, lr=0.1))


def _precision(mode, **kwargs):
    def apply(model):
        return apply_precision(model, PrecisionConfig(mode), **kwargs)

    return apply


TECHNIQUES = {
    "freeze": _freeze,
    "bf16-pure": _precision("bf16-pure"),
    "bf16-pure-kept": _precision("bf16-pure", keep_original_weights=True),
    "full": _checkpoint("full"),
    "selective": _checkpoint("selective"),
    "sqrt": _checkpoint("sqrt"),
    "budget": _checkpoint("budget"),
    "fused-step": _fused,
}
# Modes that leave the model alone (they act through their runtime): removing is a no-op.
NO_OP = {"fp32": _precision("fp32"), "bf16-mixed": _precision("bf16-mixed"),
         "fp16-mixed": _precision("fp16-mixed")}  # fmt: skip


@pytest.mark.parametrize("trained", [False, True], ids=["applied", "trained-without-step"])
@pytest.mark.parametrize("name", sorted(TECHNIQUES) + sorted(NO_OP))
def test_each_apply_returns_a_handle_that_restores_a_fresh_model(name, trained):
    model, fresh = tiny_gpt2(seed=0), tiny_gpt2(seed=0)
    handle = {**TECHNIQUES, **NO_OP}[name](model)
    assert isinstance(handle, Removable)
    # The technique did change the model (so this proves removal, not a no-op).
    assert _changed(model, fresh) == (name in TECHNIQUES)
    if trained:
        # A forward and backward through the technique; no optimizer step (values unchanged).
        if hasattr(handle, "autocast"):
            with handle.autocast():
                loss = model(**_batch()).loss
        else:
            loss = model(**_batch()).loss
        if name == "fused-step":
            handle.remove()  # the hooks step in backward: stop them, then backward by hand
        loss.float().backward()
        for p in model.parameters():
            p.grad = None
    handle.remove()
    handle.remove()  # idempotent
    assert_like_fresh(model, fresh, rounded=name == "bf16-pure")


def test_unfreezing_keeps_what_was_frozen_before():
    model = tiny_gpt2()
    model.transformer.ln_f.weight.requires_grad_(False)  # the user's own choice
    handle = apply_freezing(model, ["transformer.ln_f.*", "transformer.h.1.*"])
    assert "transformer.ln_f.weight" in handle.names
    handle.remove()
    assert not model.transformer.ln_f.weight.requires_grad
    assert all(p.requires_grad for p in model.transformer.h[1].parameters())


def test_bf16_optimizer_wrapper_comes_off_with_its_state_in_the_weights_dtype():
    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    runtime = apply_precision(model, PrecisionConfig("bf16-pure"))
    assert runtime.wrap_optimizer(opt) is opt and "step" in opt.__dict__
    model(torch.randn(2, 4)).float().sum().backward()
    opt.step()
    assert opt.state[model.weight]["exp_avg"].dtype == torch.bfloat16
    runtime.remove()
    # The class's step again, no rounding context, moments in the restored fp32.
    assert "step" not in opt.__dict__ and "_memfit_bf16" not in opt.__dict__
    assert model.weight.dtype == torch.float32
    assert {v.dtype for s in opt.state.values() for k, v in s.items() if k != "step"} == {
        torch.float32
    }
    model(torch.randn(2, 4)).sum().backward()
    opt.step()  # an ordinary fp32 AdamW step again
    # Wrapping a self-rounding optimizer remembers and restores its own setting.
    from memfit.optim.adafactor import Adafactor

    ada = Adafactor(nn.Linear(2, 2).parameters())
    assert wrap_optimizer_bf16(ada, stochastic_rounding=True).stochastic_rounding is True
    assert unwrap_optimizer_bf16(ada).stochastic_rounding is False


# ---------------------------------------------------------------------------------- plans
PLANS = {
    "freeze-body": Plan(freeze=("body",)),
    "freeze-embeddings": Plan(freeze=("embeddings",)),
    "bf16-pure": Plan(precision="bf16-pure"),
    "bf16-mixed": Plan(precision="bf16-mixed"),
    "fp16-mixed": Plan(precision="fp16-mixed"),
    "selective": Plan(checkpointing="selective"),
    "full": Plan(checkpointing="full"),
    "sqrt": Plan(checkpointing="sqrt"),
    "budget": Plan(checkpointing={"mode": "budget", "budget_bytes": 1 << 16}),
    "fused-step": Plan(optimizer_in_backward=True),
    "accumulation": Plan(micro_batch_size=1, grad_accum_steps=2, max_seq_len=8),
    "everything": Plan(precision="bf16-pure", optimizer="adafactor", optimizer_in_backward=True,
                       checkpointing="full", freeze=("embeddings",), max_grad_norm=1.0,
                       grad_clip_mode="approx"),
}  # fmt: skip


@pytest.mark.parametrize("keep", [False, True], ids=["default", "keep-original-weights"])
@pytest.mark.parametrize("name", sorted(PLANS))
def test_remove_takes_the_whole_plan_off(name, keep):
    model, fresh = tiny_gpt2(seed=0), tiny_gpt2(seed=0)
    plan = PLANS[name]
    setup = apply_plan(model, plan, keep_original_weights=keep)
    touches = bool(plan.freeze or plan.checkpointing.mode != "none"
                   or plan.optimizer_in_backward or plan.precision.mode == "bf16-pure")  # fmt: skip
    assert _changed(model, fresh) == touches
    setup.remove()
    assert_like_fresh(model, fresh, rounded=plan.precision.mode == "bf16-pure" and not keep)
    with pytest.raises(RuntimeError, match="plan was removed"):
        setup.step(_batch())


def test_after_training_remove_keeps_the_trained_values_and_restores_untouched_ones():
    # bf16-pure with frozen embeddings, trained two steps, then removed: every weight is fp32
    # again and holds its trained bf16 value exactly; with keep_original_weights every element
    # training left alone (the frozen embeddings, and updates that rounded away) has its
    # original fp32 bits.
    fresh = tiny_gpt2(seed=0)
    for keep in (False, True):
        model = tiny_gpt2(seed=0)
        plan = Plan(precision="bf16-pure", freeze=("embeddings",),
                    optimizer={"name": "sgd", "lr": 1.0})  # fmt: skip
        setup = apply_plan(model, plan, keep_original_weights=keep)
        assert setup.precision.kept_bytes == (
            sum(p.numel() * 4 for p in fresh.parameters()) if keep else 0
        )
        for _ in range(2):
            setup.step(_batch())
        trained = {n: p.detach().clone() for n, p in model.named_parameters()}
        setup.remove()
        assert setup.precision.kept_bytes == 0  # the originals are let go
        pairs = zip(model.named_parameters(), fresh.named_parameters(), strict=True)
        for (n, p), (_, q) in pairs:
            assert p.dtype == torch.float32 and p.requires_grad, n
            rounded = q.detach().to(torch.bfloat16)
            if "wte" in n or "wpe" in n:
                assert torch.equal(trained[n], rounded), n  # frozen: never changed
            else:
                assert not torch.equal(trained[n], rounded), n  # trained
            expected = trained[n].float()
            if keep:
                expected = torch.where(trained[n] == rounded, q.detach(), expected)
            assert torch.equal(p.detach(), expected), n


def test_keep_original_weights_holds_the_original_storage_on_the_cpu():
    model = nn.Linear(8, 8)
    ptr = model.weight.data_ptr()
    runtime = apply_precision(model, PrecisionConfig("bf16-pure"), keep_original_weights=True)
    assert runtime.kept_bytes == (64 + 8) * 4  # the fp32 weights and bias, no copy made
    assert any(t.data_ptr() == ptr for t in runtime._restore.kept.values())


def test_a_plan_that_cannot_apply_leaves_the_model_untouched():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    fresh = copy.deepcopy(model)
    # Freezing and bf16-pure apply, then checkpointing finds no repeated blocks.
    with pytest.raises(ValueError, match="no list of repeated blocks"):
        apply_plan(model, Plan(freeze=("0.*",), precision="bf16-pure", checkpointing="full"),
                   keep_original_weights=True)  # fmt: skip
    assert_like_fresh(model, fresh)


def test_remove_under_fake_tensors_puts_the_original_parameters_back():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        originals = list(model.parameters())
        setup = apply_plan(model, Plan(precision="bf16-pure"))
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        setup.remove()
        restored = list(model.parameters())
    assert all(a is b for a, b in zip(restored, originals, strict=True))
    assert all(p.dtype == torch.float32 for p in restored)
