"""Values in a dry run: constants computed for real, the routing policy, the upper bound."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from memfit.estimate.fake_kernels import real_kernel_rules
from memfit.estimate.values import DryRunValues


def _dry(**kwargs):
    class Ctx:
        def __enter__(self):
            self.stack = [real_kernel_rules(), FakeTensorMode(allow_non_fake_inputs=True),
                          DryRunValues(**kwargs)]  # fmt: skip
            return [c.__enter__() for c in self.stack][-1]

        def __exit__(self, *exc):
            for c in reversed(self.stack):
                c.__exit__(*exc)

    return Ctx()


def test_constants_have_real_values_and_fake_tensors():
    with _dry() as values:
        rates = torch.linspace(0, 0.3, 4)
        assert isinstance(rates, FakeTensor)
        assert rates.tolist() == pytest.approx([0.0, 0.1, 0.2, 0.3])
        assert [r.item() for r in rates.split(1)] == pytest.approx([0.0, 0.1, 0.2, 0.3])
        odd = torch.arange(10)[torch.arange(10) % 2 == 1]
        assert isinstance(odd, FakeTensor) and odd.shape == (5,) and odd.tolist() == [1, 3, 5, 7, 9]
        assert f"{torch.tensor(3)}" == "3"
        assert values.summary() == []


def test_a_value_of_activations_is_not_invented():
    from torch._subclasses.fake_tensor import DataDependentOutputException

    with _dry():
        x = torch.randn(4)  # random: no value
        with pytest.raises(DataDependentOutputException):
            x.sum().item()
        c = torch.ones(4)
        c.add_(x)  # a constant written from a value without one loses its value
        with pytest.raises(DataDependentOutputException):
            c.sum().item()


@pytest.mark.parametrize("experts, k, tokens", [(4, 2, 32), (8, 2, 30), (4, 1, 16)])
def test_balanced_routing_gives_every_expert_its_share(experts, k, tokens):
    with _dry() as values:
        scores = torch.randn(tokens, experts)
        _, chosen = torch.topk(scores, k, dim=-1)
        counts = torch.bincount(chosen.flatten(), minlength=experts).tolist()
        rows = [set(r) for r in chosen.tolist()]
    assert sum(counts) == tokens * k and max(counts) - min(counts) <= 1
    assert all(len(r) == k for r in rows)  # no expert twice for one token
    (use,) = values.summary()
    assert use["op"] == "routing" and use["policy"].startswith("balanced")


def test_expert_load_overloads_expert_zero():
    tokens, experts, k = 64, 8, 2
    with _dry(expert_load=3):
        _, chosen = torch.randn(tokens, experts).topk(k)
        counts = torch.bincount(chosen.flatten(), minlength=experts).tolist()
        where = [torch.where(chosen == e)[0].shape[0] for e in range(experts)]
        rows = [set(r) for r in chosen.tolist()]
    assert all(len(r) == k for r in rows)
    share = tokens * k / experts
    assert counts[0] >= 3 * share and counts == where


def test_argmax_router_and_top1():
    with _dry():
        index = torch.argmax(torch.randn(2, 8, 4).softmax(-1), dim=-1)
        mask = torch.nn.functional.one_hot(index, num_classes=4)
        hit = torch.greater(mask.sum(dim=(0, 1)), 0).nonzero()
        assert hit.shape == (4, 1)


def test_upper_bound_for_data_dependent_shapes_of_activations():
    with _dry() as values:
        h = torch.randn(3, 5)
        assert torch.nonzero(h > 0).shape == (15, 2)
        assert torch.masked_select(h, h > 0).shape == (15,)
    assert {u["op"] for u in values.summary()} == {"aten.nonzero", "aten.masked_select"}


def test_bad_expert_load_is_one_sentence():
    for bad in (0.5, float("nan"), "2"):
        with pytest.raises(ValueError, match="expert_load must be a number >= 1"):
            DryRunValues(expert_load=bad)


def test_transformers_sees_fake_tensors_again_afterwards():
    from transformers.utils import import_utils

    original = import_utils.is_fake_tensor
    with _dry():
        assert import_utils.is_fake_tensor is not original
        assert not import_utils.is_fake_tensor(torch.ones(2))  # a constant: values known
        assert import_utils.is_fake_tensor(torch.randn(2))
    assert import_utils.is_fake_tensor is original


def test_a_write_through_an_alias_makes_the_value_unknown():
    from torch._subclasses.fake_tensor import DataDependentOutputException

    with _dry():
        fake = torch.randn(2)
        for write in (
            lambda x: x[:2].copy_(fake),
            lambda x: torch.add(fake, 1, out=x[:2]),
            lambda x: torch._foreach_add_([x], [fake.sum().expand(4)]),
        ):
            x = torch.zeros(4)
            assert x.tolist() == [0, 0, 0, 0]
            write(x)
            with pytest.raises(DataDependentOutputException):
                x.tolist()


def test_unique_over_a_dimension_takes_the_rows_as_upper_bound():
    with _dry():
        x = torch.randn(5, 3)
        out, inverse, counts = torch.unique(x, dim=0, return_inverse=True, return_counts=True)
        assert (out.shape, inverse.shape, counts.shape) == ((5, 3), (5,), (5,))


def test_a_top_k_outside_a_router_is_not_routing():
    with _dry(where=lambda: "classifier") as values:
        _, chosen = torch.randn(8, 4).topk(2)
        assert chosen not in values.shadows
    with _dry(where=lambda: "model.layers.0.mlp.gate") as values:
        _, chosen = torch.randn(8, 4).topk(2)
        assert chosen in values.shadows


def test_computing_a_shadow_saves_nothing_for_backward():
    # A parameter built from a constant has a shadow (Swin's relative-position table, indexed
    # by a constant index). Computing an op's shadow must not reach autograd: the tracker's
    # saved-tensor hook would count the real shadows it saves, which a real run does not have.
    saved: list[torch.Tensor] = []
    with _dry() as values:
        table = torch.nn.Parameter(torch.zeros(8, 2))
        index = torch.arange(4)
        assert table in values.shadows and index in values.shadows
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            bias = table[index]
        assert bias in values.shadows  # still a known value
    assert saved and all(isinstance(t, FakeTensor) for t in saved)


class _Switch(torch.nn.Module):
    """A Switch-Transformers-style expert layer: the experts hit are found with ``nonzero``
    and each is looked up by the string ``f"expert_{idx}"``, a value of the routing."""

    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(8, 4)
        self.experts = torch.nn.ModuleDict({f"expert_{i}": torch.nn.Linear(8, 8) for i in range(4)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen = self.router(x).argmax(dim=-1)
        mask = torch.nn.functional.one_hot(chosen, 4).permute(1, 0)
        out = torch.zeros_like(x)
        for idx in torch.greater(mask.sum(-1), 0).nonzero():
            (tokens,) = torch.where(mask[idx[0]])
            out = out.index_add(0, tokens, self.experts[f"expert_{idx[0]}"](x[tokens]))
        return x + out


@pytest.mark.parametrize("mode", ["full", "selective", "sqrt"])
def test_a_checkpointed_recomputation_sees_the_routing(mode):
    # backward() runs inside DryRunValues' own handler, where a mode is off: the blocks'
    # recomputation must still find the routing's values (and, in selective mode, the same
    # calls of nonzero as the forward, though fake tensors refuse each once).
    from memfit.strategies.checkpointing import CheckpointConfig, apply_checkpointing

    with _dry() as values:
        model = torch.nn.Sequential(*[_Switch() for _ in range(4)])
        apply_checkpointing(model, CheckpointConfig(mode=mode))
        x = torch.randn(6, 8, requires_grad=True)
        model(x).sum().backward()
        assert x.grad is not None and x.grad.shape == (6, 8)
        assert {u["op"] for u in values.summary()} == {"routing"}


def test_a_real_draw_leaves_the_global_generator_as_it_was():
    # LayerDrop's torch.rand([]) is drawn for real in a dry run (its value is compared at once);
    # a dry run between training steps must not change what those steps draw.
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with _dry():
        draw = torch.rand([])
        assert 0.0 <= float(draw) < 1.0
    assert torch.equal(torch.get_rng_state(), before)
