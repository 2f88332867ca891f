"""Freezing: which parameters each spec selects, numerics of the rest, memory at the peak."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import memfit
from memfit.blocks import find_blocks
from memfit.strategies.freezing import apply_freezing, resolve_freeze
from memfit.workload import load_workload


@pytest.fixture(scope="module")
def gpt2():
    return load_workload("gpt2-tiny", 2, 8).build()


@pytest.fixture(scope="module")
def bert():
    return load_workload("bert-tiny", 2, 8).build()


def _trainable(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


class Stack(nn.Module):
    """An embedding, three identical blocks in a ModuleList and an unnamed output layer."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(3))
        self.out = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x).mean(1)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


# ---------------------------------------------------------------------------------- selection
def test_find_blocks_on_transformers(gpt2, bert):
    assert [n for n, _ in find_blocks(gpt2[0])] == ["transformer.h.0", "transformer.h.1"]
    assert [n for n, _ in find_blocks(bert[0])] == ["bert.encoder.layer.0", "bert.encoder.layer.1"]
    assert [n for n, _ in find_blocks(Stack())] == ["blocks.0", "blocks.1", "blocks.2"]
    assert find_blocks(nn.Linear(3, 3)) == []
    # A Sequential with other modules around its blocks still yields the blocks.
    seq = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.ReLU())
    assert [n for n, _ in find_blocks(seq)] == ["1", "2"]


def test_embeddings(gpt2, bert):
    names = resolve_freeze(bert[0], ["embeddings"])
    assert names == [n for n, _ in bert[0].named_parameters() if n.startswith("bert.embeddings.")]
    # GPT-2's embeddings are named wte/wpe: found as nn.Embedding modules. The LM head is tied
    # to wte (one tensor, listed once).
    assert resolve_freeze(gpt2[0], ["embeddings"]) == [
        "transformer.wte.weight",
        "transformer.wpe.weight",
    ]


def test_body_keeps_only_the_head(bert, gpt2):
    model = copy.deepcopy(bert[0])
    frozen = apply_freezing(model, ["body"]).names
    assert _trainable(model) == ["classifier.weight", "classifier.bias"]
    assert "bert.pooler.dense.weight" in frozen  # the pooler is body
    # GPT-2's head is tied to the token embedding: that tensor is the head, so it trains.
    model = copy.deepcopy(gpt2[0])
    apply_freezing(model, "body")
    assert _trainable(model) == ["transformer.wte.weight"]
    # Untied Llama: only lm_head trains.
    llama, _ = load_workload("llama-tiny", 1, 4).build()
    apply_freezing(llama, ["body"])
    assert _trainable(llama) == ["lm_head.weight"]


def test_body_of_a_plain_module_trains_its_last_child():
    model = Stack()
    apply_freezing(model, ["body"])
    assert _trainable(model) == ["out.weight", "out.bias"]
    with pytest.raises(ValueError, match="needs a task head"):
        apply_freezing(nn.Linear(2, 2), ["body"])
    # All head: nothing left to freeze.
    with pytest.raises(ValueError, match="selects nothing"):
        apply_freezing(nn.Sequential(nn.Linear(2, 2)), ["body"])


def test_blocks(gpt2):
    model = copy.deepcopy(gpt2[0])
    frozen = apply_freezing(model, ["blocks:1"]).names
    assert frozen == [n for n, _ in model.named_parameters() if n.startswith("transformer.h.0.")]
    with pytest.raises(ValueError, match="asks for 3 blocks but the model has 2"):
        resolve_freeze(model, ["blocks:3"])
    for bad in ("blocks:0", "blocks:x", "blocks:"):
        with pytest.raises(ValueError, match="malformed"):
            resolve_freeze(model, [bad])
    with pytest.raises(ValueError, match="no repeated blocks"):
        resolve_freeze(nn.Linear(2, 2), ["blocks:1"])


def test_patterns(bert, gpt2):
    model = bert[0]
    biases = resolve_freeze(model, ["*.bias"])
    assert biases and all(n.endswith(".bias") for n in biases)
    # A module name selects everything below it.
    assert resolve_freeze(model, ["bert.embeddings"]) == resolve_freeze(model, ["embeddings"])
    # A tied parameter answers to each of its names.
    assert resolve_freeze(gpt2[0], ["lm_head.weight"]) == ["transformer.wte.weight"]
    # Specs combine as a union, listed once, in model order.
    both = resolve_freeze(model, ["classifier.*", "*.bias"])
    assert both == [
        n for n, _ in model.named_parameters() if n in set(biases) | {"classifier.weight"}
    ]


def test_nothing_matched_lists_what_exists(bert):
    with pytest.raises(
        ValueError, match=r"matches no parameter .* bert\.embeddings\.word_embeddings"
    ):
        resolve_freeze(bert[0], ["encoder.*"])


def test_frozen_params_lose_their_gradient():
    model = Stack()
    model(torch.tensor([[1, 2]])).sum().backward()
    apply_freezing(model, ["emb.*"])
    assert model.emb.weight.grad is None and not model.emb.weight.requires_grad


# ---------------------------------------------------------------------------------- numerics
def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 3) -> None:
    torch.manual_seed(1)
    for _ in range(steps):
        x = torch.randint(0, 10, (4, 3))
        y = torch.randn(4, 2)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("specs", [["blocks:2"], ["embeddings", "out.bias"], ["body"]])
def test_trainable_numerics_unchanged(specs):
    torch.manual_seed(0)
    frozen_model = Stack()
    reference = copy.deepcopy(frozen_model)
    before = copy.deepcopy(frozen_model.state_dict())
    names = apply_freezing(frozen_model, specs).names
    # As compose does: the optimizer gets the parameters that still require gradients.
    opt = torch.optim.AdamW([p for p in frozen_model.parameters() if p.requires_grad], lr=1e-2)
    _train(frozen_model, opt)
    # Reference: nothing frozen, the same parameters simply left out of the optimizer.
    ref_params = dict(reference.named_parameters())
    ref_opt = torch.optim.AdamW([p for n, p in ref_params.items() if n not in names], lr=1e-2)
    _train(reference, ref_opt)
    for n, p in frozen_model.named_parameters():
        if n in names:
            assert p.grad is None and torch.equal(p, before[n])
        else:
            assert (p - ref_params[n]).abs().max().item() < 1e-6
    assert not any(p in opt.state for n, p in frozen_model.named_parameters() if n in names)


def test_optimizer_built_over_all_parameters_keeps_no_state_for_frozen():
    torch.manual_seed(0)
    model = Stack()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    names = apply_freezing(model, ["blocks:3"]).names
    _train(model, opt)
    params = dict(model.named_parameters())
    assert {id(p) for p in opt.state} == {id(p) for n, p in params.items() if n not in names}


# ---------------------------------------------------------------------------------- memory
def test_peak_gradients_and_state_are_those_of_the_trainable_parameters():
    torch.manual_seed(0)
    # Wide layers, a batch of 2: the optimizer step (all gradients and state alive, plus its
    # temporaries) is the peak, not the activations.
    model = nn.Sequential(
        nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 64)
    )
    names = apply_freezing(model, ["0.*", "2.weight"]).names
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3, foreach=False)
    x, y = torch.randn(2, 128), torch.randn(2, 64)

    def step():
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # the state exists from the first step on
    with memfit.track(model, opt) as tr:
        step()
    rep = tr.report()
    assert rep.peak_phase == "optimizer"
    grad_bytes = sum(p.numel() * p.element_size() for p in trainable)
    # AdamW: exp_avg and exp_avg_sq of each trainable parameter, plus a float32 step scalar.
    state_bytes = 2 * grad_bytes + 4 * len(trainable)
    assert rep.peak_by_category["gradients"] == grad_bytes
    assert rep.peak_by_category["optimizer_state"] == state_bytes
    frozen_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if n in names)
    assert frozen_bytes > grad_bytes  # most of the model is frozen: the saving is real
