"""Activation checkpointing: gradients equal the unchecked model's, recompute FLOPs, memory.

Memory is measured with the tracker. What a checkpointed model keeps is split by the tracker
into two categories: tensors autograd saves through the ordinary saved-tensor hooks
(``activations``: the blocks' inputs that checkpoint keeps) and tensors held otherwise
(``temporaries``: the matmul outputs the selective policy caches, and everything recomputed in
backward). "Activation memory" below is therefore ``activations + temporaries``: right after
the forward (what the graph keeps) and its highest value over the step (which adds the one
block, or segment, being recomputed).

Every expectation is computed from shapes. The plain block (``Block``) keeps, per token, in
fp32 on CPU: its input (D floats), the LayerNorm output (D) and statistics (2), the first
Linear's output (4D), the GELU output (4D) and the dropout mask (D, a float tensor on CPU):
``11 D + 2`` floats.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import weakref

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

import memfit
from memfit.strategies.checkpointing import (
    CheckpointConfig,
    apply_checkpointing,
    checkpointed_blocks,
    measure_saved_bytes,
    remove_checkpointing,
    selective_policy,
)
from memfit.workload import load_workload

F32 = 4
B, S, D = 4, 16, 32  # the plain stack's batch, sequence and width
HIDDEN = B * S * D * F32  # one hidden state: what a checkpointed block keeps
BLOCK = B * S * (11 * D + 2) * F32  # what an unchecked block keeps (see the module docstring)
MODES = ("full", "selective", "sqrt", "budget")


class Block(nn.Module):
    """Pre-norm MLP block with dropout and a residual."""

    def __init__(self, d: int = D, p: float = 0.1) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln(x)))))


class Stack(nn.Module):
    """Token embedding, ``n`` identical blocks in a ModuleList; returns a scalar loss."""

    def __init__(self, n: int = 4, d: int = D) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, ids: torch.Tensor | None = None, x: torch.Tensor | None = None) -> torch.Tensor:
        h = self.emb(ids) if x is None else x
        for block in self.blocks:
            h = block(h)
        return h.square().mean()


def _stack(n: int = 4, seed: int = 0) -> Stack:
    torch.manual_seed(seed)
    return Stack(n)


def _ids() -> torch.Tensor:
    return torch.randint(0, 50, (B, S), generator=torch.Generator().manual_seed(1))


def _x() -> torch.Tensor:
    return torch.randn(B, S, D, generator=torch.Generator().manual_seed(2))


def _config(mode: str, budget: int | None = None) -> CheckpointConfig:
    if mode == "budget" and budget is None:
        budget = 1  # below anything: every block is checkpointed
    return CheckpointConfig(mode=mode, budget_bytes=budget)


def _grads(model: nn.Module, batch: dict, seed: int = 123) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    out = model(**batch)
    loss = out.loss if hasattr(out, "loss") else out
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _assert_same_grads(ref: dict, got: dict) -> None:
    assert ref.keys() == got.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def gpt2():
    return load_workload("gpt2-tiny", 2, 16).build()


@pytest.fixture(scope="module")
def bert():
    return load_workload("bert-tiny", 2, 16).build()


@pytest.fixture(scope="module")
def t5():
    # An encoder-decoder whose decoder builds a KV cache by default (use_cache on) and hands it
    # to its blocks: as ``cache=`` since transformers 5.24.
    import transformers

    torch.manual_seed(0)
    config = transformers.T5Config(d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2,
                                   vocab_size=256, decoder_start_token_id=0, pad_token_id=0)
    assert config.use_cache
    ids = torch.randint(1, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    return transformers.T5ForConditionalGeneration(config), {"input_ids": ids, "labels": ids}


@pytest.fixture(scope="module")
def llama():
    # A decoder with a KV cache on by default and attention dropout (the preset has none).
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=256, attention_dropout=0.1)
    assert config.use_cache
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(4))
    return transformers.LlamaForCausalLM(config), {"input_ids": ids, "labels": ids}


# ---------------------------------------------------------------------------------- numerics
_REFERENCE: dict[str, tuple] = {}


def _reference(which: str, request: pytest.FixtureRequest) -> tuple:
    """(model, batch, gradients of the unchecked model), computed once per model."""
    if which not in _REFERENCE:
        if which == "stack":
            model, batch = _stack(4), {"ids": _ids()}
        else:
            model, batch = request.getfixturevalue(which)
        model = copy.deepcopy(model).train()
        ref = _grads(model, batch)
        # Dropout is on and matters: another seed gives other gradients.
        other = _grads(model, batch, seed=321)
        assert any(not torch.equal(ref[n], other[n]) for n in ref)
        _REFERENCE[which] = (model, batch, ref)
    return _REFERENCE[which]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("which", ["gpt2", "bert", "t5", "llama", "stack"])
def test_gradients_equal_unchecked_with_dropout(which, mode, request):
    model, batch, ref = _reference(which, request)
    model = copy.deepcopy(model)
    names = apply_checkpointing(model, _config(mode)).names
    # Non-reentrant checkpoint restores the RNG state for the recomputation: same masks, same
    # gradients (bit for bit here; the tolerance only guards against kernel reordering).
    _assert_same_grads(ref, _grads(model, batch))
    assert names  # (budget mode fills the list at the first forward)


@pytest.mark.parametrize("mode", MODES)
def test_frozen_embeddings_inputs_need_no_grad(gpt2, mode):
    model, batch = copy.deepcopy(gpt2)
    for p in (model.transformer.wte.weight, model.transformer.wpe.weight):
        p.requires_grad_(False)  # the LM head is tied to wte: it is frozen too
    ref = _grads(model, batch)
    apply_checkpointing(model, _config(mode))
    seen = []
    hook = model.transformer.h[0].register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    got = _grads(model, batch)
    hook.remove()
    assert not seen[0].requires_grad  # the first block's input needs no gradient
    _assert_same_grads(ref, got)
    assert "transformer.h.0.attn.c_attn.weight" in got


def test_frozen_first_blocks_of_plain_stack():
    model = _stack(4)
    for p in [*model.emb.parameters(), *model.blocks[0].parameters()]:
        p.requires_grad_(False)
    batch = {"ids": _ids()}
    ref = _grads(model, batch)
    apply_checkpointing(model, CheckpointConfig("full"))
    _assert_same_grads(ref, _grads(model, batch))


def test_no_grad_and_eval_run_the_plain_forward():
    model = _stack(3)
    apply_checkpointing(model, CheckpointConfig("full"))
    model.eval()
    with torch.no_grad():
        a = model(_ids())
    remove_checkpointing(model)
    with torch.no_grad():
        b = model(_ids())
    assert torch.equal(a, b)


# ---------------------------------------------------------------------------------- FLOPs
def _flops(model: nn.Module, batch: dict) -> int:
    with FlopCounterMode(display=False) as counter:
        out = model(**batch)
        (out.loss if hasattr(out, "loss") else out).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def test_recompute_flops_plain_stack():
    n = 4
    batch = {"ids": _ids()}
    base = _flops(_stack(n), batch)
    extra = {}
    for mode in ("full", "selective", "sqrt"):
        model = _stack(n)
        apply_checkpointing(model, CheckpointConfig(mode))
        extra[mode] = _flops(model, batch) - base
    # One forward of the blocks: two Linears of 2 * tokens * D * 4D FLOPs each, per block.
    block_forward = n * 2 * (2 * B * S * D * 4 * D)
    assert extra["full"] == block_forward
    assert extra["sqrt"] == block_forward
    assert base == 3 * block_forward  # forward + backward (twice the forward)
    # Selective keeps every matmul output: no matmul is recomputed.
    assert extra["selective"] == 0


def test_recompute_flops_gpt2(gpt2):
    model, batch = gpt2
    base = _flops(copy.deepcopy(model), batch)
    # The blocks' forward FLOPs, from the counter's per-module breakdown of a plain forward.
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(**batch)
    per_module = counter.get_flop_counts()
    blocks = sum(
        sum(per_module[k].values()) for k in per_module if k.rsplit(".", 1)[-1] in ("0", "1")
    )
    assert blocks > 0
    extra = {}
    for mode in ("full", "selective"):
        m = copy.deepcopy(model)
        apply_checkpointing(m, CheckpointConfig(mode))
        extra[mode] = _flops(m, batch) - base
    assert extra["full"] == blocks  # exactly one more forward of the blocks
    assert extra["selective"] < 0.1 * extra["full"]  # matmuls and attention are kept


def test_selective_policy_saves_matmuls_only():
    aten = torch.ops.aten
    save, recompute = selective_policy(None, aten.mm.default), selective_policy(None, aten.gelu.default)
    assert save.name == "MUST_SAVE"
    assert selective_policy(None, aten.addmm.default).name == "MUST_SAVE"
    assert selective_policy(None, aten.bmm.default).name == "MUST_SAVE"
    assert recompute.name == "PREFER_RECOMPUTE"


# ---------------------------------------------------------------------------------- memory
def _activation_memory(model: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """(activation bytes kept after the forward, highest activation bytes over the step)."""
    with memfit.track(model) as tracker:
        loss = model(x=x)
        now = tracker.snapshot()
        loss.backward()
    model.zero_grad(set_to_none=True)
    timeline = tracker.report().timeline
    highest = max(a + t for a, t in zip(timeline["activations"], timeline["temporaries"], strict=True))
    return now["activations"] + now["temporaries"], highest


def _measured(n: int, mode: str, budget: int | None = None) -> tuple[int, int]:
    model = _stack(n)
    if mode != "none":
        apply_checkpointing(model, _config(mode, budget))
    return _activation_memory(model, _x())


def test_block_bytes_match_the_analytic_count():
    assert measure_saved_bytes(Block(), _x().requires_grad_()) == BLOCK


@pytest.mark.parametrize("fake", [True, False], ids=["fake", "real"])
def test_measuring_a_block_keeps_no_reference_to_its_input(fake):
    # Budget mode measures a block on the very input it is about to run on; in a dry run that
    # input is the run's own fake tensor, and a real input whose block reads a value is
    # measured for real. An op that saves its own output (tanh, as in GPT-2's GELU) must not
    # leave the measured graph alive, the product keeping the input it saved.
    class Saving(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not fake and not bool(x.sum() != 0):  # a value read: fake tensors cannot follow
                return x
            return torch.tanh(x * x)

    with FakeTensorMode() if fake else contextlib.nullcontext():
        leaf = torch.ones(B, S, D, requires_grad=True)
        x = leaf * 2  # a hidden state: not a leaf, part of the run's graph
        assert measure_saved_bytes(Saving(), x) == 2 * HIDDEN  # x (for the product), tanh's
        freed = weakref.ref(x)
        del x
        gc.collect()
        assert freed() is None


def test_full_keeps_block_inputs_plus_one_block():
    n = 8
    none_kept, none_peak = _measured(n, "none")
    full_kept, full_peak = _measured(n, "full")
    # Unchecked: every block's activations, the first block's input being the model input
    # (counted as "inputs") and the hidden state the loss keeps taking its place; and the
    # loss itself, an fp32 scalar.
    assert none_kept == n * BLOCK + F32
    # Full: the input of each block (the first's is the model input) plus the hidden state
    # the loss keeps: n hidden states.
    assert full_kept == n * HIDDEN + F32
    # The peak is in the last block's backward, its fc2's: the loss's hidden state is freed,
    # and the last block's recomputation (a BLOCK, its input being the one kept) and the
    # gradients then live come to BLOCK + 4 hidden states (the loss's gradient: one more
    # scalar).
    assert full_peak == full_kept - HIDDEN + BLOCK + 4 * HIDDEN + F32
    # Unchecked, the same backward holds the same gradients, over activations all kept.
    assert none_peak == none_kept - HIDDEN + 5 * HIDDEN + F32
    assert full_peak < none_peak / 3


def test_selective_is_between_none_and_full():
    n = 8
    none_kept, none_peak = _measured(n, "none")
    sel_kept, sel_peak = _measured(n, "selective")
    full_kept, full_peak = _measured(n, "full")
    assert full_kept < sel_kept < none_kept
    assert full_peak < sel_peak < none_peak
    # Per token and block it keeps the input (D; the first's is the model input, the loss's
    # hidden state taking its place) and both Linear outputs (4D + D); and the loss.
    assert sel_kept == n * B * S * 6 * D * F32 + F32



def test_alternate_matmuls_keeps_every_other_mm_of_a_block():
    # torchtitan's per-op policy: a block's 1st, 3rd ... mm outputs are kept, the 2nd, 4th ...
    # recomputed, the count restarting at each block (bias-free Linears run as aten.mm).
    n = 4
    model = _stack(n)
    for block in model.modules():
        if isinstance(block, Block):
            block.fc1.bias = block.fc2.bias = None
    apply_checkpointing(model, CheckpointConfig("selective", policy="alternate-matmuls"))
    kept, _ = _activation_memory(model, _x())
    # Per token and block: the input (D) and fc1's output (4D); fc2's is recomputed.
    assert kept == n * B * S * 5 * D * F32 + F32
    with pytest.raises(ValueError, match="policy 'every-op' is not known"):
        CheckpointConfig("selective", policy="every-op")
    with pytest.raises(ValueError, match="mode 'full' takes none"):
        CheckpointConfig("full", policy="alternate-matmuls")
    plan = memfit.Plan.from_dict({"checkpointing": {"mode": "selective",
                                                    "policy": "alternate-matmuls"}})
    assert memfit.Plan.from_dict(plan.to_dict()) == plan

def test_sqrt_scales_with_the_square_root_of_depth():
    kept, peak, none_peak = {}, {}, {}
    for n in (4, 16):
        kept[n], peak[n] = _measured(n, "sqrt")
        none_peak[n] = _measured(n, "none")[1]
        segments = math.ceil(n / math.ceil(math.sqrt(n)))
        # After the forward: one hidden state per segment (the first segment's input is the
        # model input; the loss keeps one).
        assert kept[n] == segments * HIDDEN + F32
        # At the peak: those, plus the last segment (sqrt(n) blocks) being recomputed and
        # the gradients of its last block's backward, as in full mode's peak.
        size = math.ceil(math.sqrt(n))
        assert n % size == 0  # the last segment is a whole one
        assert peak[n] == kept[n] - HIDDEN + size * BLOCK + 4 * HIDDEN + F32
    # 4x the depth: ~2x the activation memory (sqrt), against ~4x unchecked.
    assert 1.6 <= peak[16] / peak[4] <= 2.4
    assert none_peak[16] / none_peak[4] > 3.5


@pytest.mark.parametrize("blocks_kept", [0, 3, 16])
def test_budget_keeps_activations_under_budget(blocks_kept):
    n = 16
    # A budget with room for `blocks_kept` unchecked blocks, the rest keeping their inputs.
    budget = blocks_kept * BLOCK + (n - blocks_kept) * HIDDEN + HIDDEN // 2
    model = _stack(n)
    names = apply_checkpointing(model, CheckpointConfig("budget", budget_bytes=budget)).names
    assert names == []  # decided at the first forward, from the real input shapes
    kept, peak = _activation_memory(model, _x())
    # Decided in forward order: the first blocks stay whole while the rest still fit.
    assert checkpointed_blocks(model) == [f"blocks.{i}" for i in range(blocks_kept, n)]
    assert names == checkpointed_blocks(model)  # the returned list follows the decisions
    # The blocks' kept activations (the first block's input is the model input, the loss's
    # hidden state taking its place; and the loss), which fit.
    assert kept == blocks_kept * BLOCK + (n - blocks_kept) * HIDDEN + F32
    assert kept - HIDDEN <= budget
    # The peak, in the last block's backward, is full mode's (see
    # test_full_keeps_block_inputs_plus_one_block): the last block's recomputation comes
    # on top when it is checkpointed.
    recomputed = BLOCK - HIDDEN if blocks_kept < n else 0
    assert peak == kept - HIDDEN + recomputed + 5 * HIDDEN + F32
    if blocks_kept:
        # The fewest blocks: one more kept block would not fit.
        assert (blocks_kept + 1) * BLOCK + (n - blocks_kept - 1) * HIDDEN > budget


def test_budget_follows_the_batch_shape():
    n = 8
    budget = 4 * BLOCK + 4 * HIDDEN
    model = _stack(n)
    apply_checkpointing(model, CheckpointConfig("budget", budget_bytes=budget))
    model(x=_x()).backward()
    short = len(checkpointed_blocks(model))
    model(x=torch.randn(B, 2 * S, D)).backward()  # twice the tokens: more blocks checkpointed
    assert len(checkpointed_blocks(model)) > short


def test_budget_with_an_estimator():
    calls = []

    def estimator(name, block, args, kwargs):
        calls.append(name)
        return 10**9 if name == "blocks.2" else 0

    model = _stack(4)
    apply_checkpointing(model, CheckpointConfig("budget", budget_bytes=10**6), estimator=estimator)
    ref = _grads(_stack(4), {"x": _x().requires_grad_()})
    got = _grads(model, {"x": _x().requires_grad_()})
    _assert_same_grads(ref, got)
    assert calls == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert checkpointed_blocks(model) == ["blocks.2"]


# ---------------------------------------------------------------------------------- wrapping
def test_patterns_select_blocks_and_unknown_pattern_fails():
    model = _stack(4)
    names = apply_checkpointing(model, CheckpointConfig("full", blocks=("blocks.[13]",))).names
    assert names == ["blocks.1", "blocks.3"]
    remove_checkpointing(model)
    # A pattern matching a block and its children keeps the outermost (no nested checkpoints).
    names = apply_checkpointing(model, CheckpointConfig("full", blocks=("blocks.0", "blocks.0.*"))).names
    assert names == ["blocks.0"]
    remove_checkpointing(model)
    with pytest.raises(ValueError, match=r"pattern 'encoder\.\*' matches no module of Stack"):
        apply_checkpointing(model, CheckpointConfig("full", blocks=("blocks.*", "encoder.*")))
    assert checkpointed_blocks(model) == []
    with pytest.raises(ValueError, match="no list of repeated blocks"):
        apply_checkpointing(nn.Linear(3, 3), CheckpointConfig("full"))


def test_apply_twice_and_remove():
    model = _stack(3)
    cfg = CheckpointConfig("full")
    names = apply_checkpointing(model, cfg).names
    wrapper = model.blocks[0].forward
    # The same config again: a no-op, nothing wrapped twice.
    assert apply_checkpointing(model, cfg).names == names
    assert model.blocks[0].forward is wrapper
    with pytest.raises(RuntimeError, match="already checkpointed"):
        apply_checkpointing(model, CheckpointConfig("selective"))
    assert remove_checkpointing(model) == names
    assert "forward" not in model.blocks[0].__dict__  # the class's forward again
    assert remove_checkpointing(model) == []
    assert apply_checkpointing(model, CheckpointConfig("selective")).names == names
    with pytest.raises(RuntimeError, match="remove_checkpointing"):
        apply_checkpointing(model, CheckpointConfig("none"))
    remove_checkpointing(model)
    assert apply_checkpointing(model, CheckpointConfig("none")).names == []


def test_the_kv_cache_is_off_while_checkpointed_and_back_on_after(t5):
    model, batch = copy.deepcopy(t5)
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
    on = [c for c in configs.values() if c.use_cache]
    assert len(on) >= 2  # the model's and its decoder's own (the encoder's is off)
    handle = apply_checkpointing(model, CheckpointConfig("full"))
    assert not any(c.use_cache for c in configs.values())
    model(**batch).loss.backward()
    handle.remove()
    assert [c for c in configs.values() if c.use_cache] == on


def test_a_cache_under_any_keyword_is_dropped(monkeypatch):
    from transformers.cache_utils import DynamicCache

    from memfit.strategies import checkpointing

    seen = []

    class CacheBlock(Block):
        def forward(self, x: torch.Tensor, *, kv_store: object = None) -> torch.Tensor:
            seen.append(kv_store)
            return super().forward(x)

    class CacheStack(Stack):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            cache = DynamicCache()
            for block in self.blocks:
                x = block(x, kv_store=cache)
            return x.square().mean()

    torch.manual_seed(0)
    model = CacheStack(2)
    model.blocks = nn.ModuleList(CacheBlock() for _ in range(2))
    apply_checkpointing(model, CheckpointConfig("full"))
    monkeypatch.setattr(checkpointing, "_WARNED", set())
    with pytest.warns(UserWarning, match="cache arguments are dropped"):
        model(_x()).backward()
    assert seen and all(s is None for s in seen)


def test_deepcopy_of_a_checkpointed_model_is_independent():
    model = _stack(3)
    apply_checkpointing(model, CheckpointConfig("full"))
    twin = copy.deepcopy(model)
    assert twin.blocks[0].forward.module is twin.blocks[0]
    twin(x=_x().requires_grad_()).backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is not None for p in twin.blocks.parameters())


def test_sqrt_falls_back_when_the_loop_transforms_the_hidden_state(monkeypatch):
    from memfit.strategies import checkpointing

    class Scaled(Stack):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x) * 0.5  # the next block does not get the block's output itself
            return x.square().mean()

    torch.manual_seed(0)
    model = Scaled(4).train()  # with dropout: the blocks that run twice draw the same masks
    ref = _grads(model, {"x": _x()})
    apply_checkpointing(model, CheckpointConfig("sqrt"))
    monkeypatch.setattr(checkpointing, "_WARNED", set())
    with pytest.warns(UserWarning, match="not called with the previous block's output"):
        got = _grads(model, {"x": _x()})
    # The chained outputs were discarded: each such block computed from its real input.
    _assert_same_grads(ref, got)


def test_transformers_own_checkpointing_is_refused(gpt2):
    model = copy.deepcopy(gpt2[0])
    model.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="gradient_checkpointing_disable"):
        apply_checkpointing(model, CheckpointConfig("full"))


@pytest.mark.parametrize("mode", MODES)
def test_under_fake_tensors(mode):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model, batch = load_workload("gpt2-tiny", 2, 16).build()
        apply_checkpointing(model, _config(mode, 10**6))
        model(**batch).loss.backward()
        assert model.transformer.h[0].attn.c_attn.weight.grad is not None
