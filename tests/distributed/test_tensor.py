"""Tensor parallelism, 2-way in two real processes (gloo, CPU): HF Llama, GPT-2 and BERT give the
unsplit model's loss and gradients, with and without sequence parallelism; the parallel loss
never holds full-vocabulary logits on a rank and sequence parallelism holds fewer activations
(both measured by memfit's tracker); bad degrees are refused before launch.

Each multi-process test reads the results of one module-scoped run of the ranks (processes
are the expensive part), so every case is still its own test.
"""

from __future__ import annotations

import fnmatch

import pytest
import torch

from memfit.distributed.tensor import (
    TensorParallelConfig,
    apply_tensor_parallel,
    check_tensor_parallel,
    tp_plan_for,
)

from ..models import mlp
from .harness import run_ranks

KINDS = ("llama", "gpt2", "bert")
TOL = {"rtol": 1e-5, "atol": 1e-5}
F32 = 4


def _config(kind: str, vocab: int = 64, dropout: float = 0.0):
    import transformers as T

    if kind == "llama":
        return T.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=64)
    if kind == "gpt2":
        # An odd vocabulary, like GPT-2's 50257: sharded unevenly (32 + 31 rows).
        return T.GPT2Config(vocab_size=vocab - 1, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                            resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=0.0,
                            bos_token_id=0, eos_token_id=0)
    return T.BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=48, max_position_embeddings=64,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)


def _build(kind: str, **kw) -> torch.nn.Module:
    """A tiny random model, the same weights on every rank (seeded)."""
    import transformers as T

    torch.manual_seed(0)
    cfg = _config(kind, **kw)
    cfg._attn_implementation = "eager"
    cls = {"llama": T.LlamaForCausalLM, "gpt2": T.GPT2LMHeadModel,
           "bert": T.BertForSequenceClassification}[kind]
    return cls(cfg).train()


def _batch(vocab: int, seq: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    # 7 tokens: an odd sequence, sharded unevenly under sequence parallelism.
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab - 1, (2, seq), generator=g), torch.tensor([0, 2])


def _step(model, handle, kind, ids, y) -> float:
    """Forward and backward of one batch; the loss."""
    if kind == "bert":
        loss = model(input_ids=ids, labels=y).loss
        loss.backward()
    else:
        loss = handle.causal_lm_loss(model(input_ids=ids).logits, ids)
        handle.backward(loss)
    return float(loss.detach())


def _numerics_rank(rank: int, world: int) -> dict:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    out = {}
    for kind in KINDS:
        ids, y = _batch(64)
        ref = _build(kind)
        # The reference is the unsplit model's own loss (HF's, with its shift) and gradients.
        ref_loss = ref(input_ids=ids, labels=y if kind == "bert" else ids).loss
        ref_loss.backward()
        want = {n: p.grad for n, p in ref.named_parameters()}
        for sp in (False, True):
            model = _build(kind)
            handle = apply_tensor_parallel(model, TensorParallelConfig(world, sequence_parallel=sp))
            split = [p for p in model.parameters() if isinstance(p, DTensor)
                     and p.to_local().numel() < p.numel()]
            loss = _step(model, handle, kind, ids, y)
            # Weights whole again, in the original names and layouts (GPT-2's Conv1D).
            state = handle.full_state_dict()
            same = all(torch.equal(state[n], p) for n, p in ref.named_parameters())
            out[kind, sp] = (loss, float(ref_loss), handle.full_grads(), want, len(split), same)
    # Another model, through a plan given by hand.
    torch.manual_seed(0)
    ref, model = mlp(), mlp()
    model.load_state_dict(ref.state_dict())
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(2))
    ref(x).square().mean().backward()
    handle = apply_tensor_parallel(model, world, plan={"0": ColwiseParallel(), "2": RowwiseParallel()})
    model(x).square().mean().backward()
    out["custom"] = (handle.full_grads(), {n: p.grad for n, p in ref.named_parameters()})
    return out


@pytest.fixture(scope="session")  # built once, whatever order xdist runs tests in
def numerics() -> dict:
    return run_ranks(_numerics_rank, 2, timeout=240)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("kind", KINDS)
def test_two_way_equals_unsplit_model(numerics, kind: str, sp: bool):
    for rank_out in numerics:
        loss, ref_loss, grads, want, n_split, same_weights = rank_out[kind, sp]
        assert n_split >= 4 * 2, "the blocks' projections were not split"
        assert same_weights, "full_state_dict is not the unsplit model's"
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert grads.keys() == want.keys()
        for name, g in grads.items():
            torch.testing.assert_close(g, want[name], **TOL, msg=name)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_plan_given_by_hand_splits_another_model(numerics):
    for rank_out in numerics:
        grads, want = rank_out["custom"]
        assert grads.keys() == want.keys()
        for name, g in grads.items():
            torch.testing.assert_close(g, want[name], **TOL, msg=name)


# --------------------------------------------------------------------------- memory
VOCAB = 4096  # logits (64 tokens x 4096 x 4 B = 1 MiB) outweigh any weight (4096 x 32 x 4 B)
TOKENS = 2 * 32


def _measure(model, handle, ids) -> dict:
    import memfit
    from memfit.accounting.trace import CATEGORIES

    with memfit.track(model) as tracker:
        loss = handle.causal_lm_loss(model(input_ids=ids).logits, ids)
        handle.backward(loss)
    t = tracker.trace()
    act = CATEGORIES.index("activations")
    device = [i for i, tier in enumerate(t.tier) if tier == 0]
    return {
        "largest": max(t.nbytes[i] for i in device),
        "peak": t.peak_bytes,
        # Every storage saved for backward, each once: the activations at the forward's end.
        "saved": sum(t.nbytes[i] for i in device if t.category[i] == act),
    }


def _memory_rank(rank: int, world: int) -> dict:
    out = {}
    ids = torch.randint(0, VOCAB, (2, TOKENS // 2), generator=torch.Generator().manual_seed(1))
    for sp, lp in [(False, True), (False, False), (True, True)]:
        model = _build("llama", vocab=VOCAB)
        handle = apply_tensor_parallel(
            model, TensorParallelConfig(world, sequence_parallel=sp, loss_parallel=lp))
        out["llama", sp, lp] = _measure(model, handle, ids)
    # Few tokens: the embedding table is the largest thing there is.
    model = _build("llama", vocab=VOCAB)
    out["few tokens"] = _measure(model, apply_tensor_parallel(model, world), ids[:, :4])
    for sp in (False, True):
        model = _build("gpt2", vocab=256, dropout=0.1)
        handle = apply_tensor_parallel(model, TensorParallelConfig(world, sequence_parallel=sp))
        out["gpt2", sp, True] = _measure(model, handle, ids % 255)
    return out


@pytest.fixture(scope="session")  # built once, whatever order xdist runs tests in
def memory() -> dict:
    return run_ranks(_memory_rank, 2, timeout=240)


@pytest.mark.distributed
@pytest.mark.slow
def test_parallel_loss_never_holds_full_vocabulary_logits(memory):
    logits = TOKENS * VOCAB * F32
    for m in memory:
        parallel, gathered = m["llama", False, True], m["llama", False, False]
        # The gathered path shows the tracker sees full logits when they exist...
        assert gathered["largest"] >= logits
        # ...and with the parallel loss no single storage on a rank is that large.
        assert parallel["largest"] < logits
        assert gathered["peak"] - parallel["peak"] >= logits // 2


@pytest.mark.distributed
@pytest.mark.slow
def test_vocabulary_parallel_embedding_gradient_is_born_shard_sized(memory):
    # torch's RowwiseParallel embedding computes the whole table's gradient on every rank in
    # backward (DTensor has no masked strategy for it); the local lookup does not.
    table = VOCAB * 32 * F32
    for m in memory:
        assert m["few tokens"]["largest"] <= table // 2


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_sequence_parallel_saves_norm_and_dropout_activations(memory, kind: str):
    hidden, layers = 32, 2
    norms = 2 * layers + 1  # two per block and the final one
    dropouts = 2 * layers + 1 if kind == "gpt2" else 0  # two per block and the embeddings'
    # Each norm saves at least its fp32 input and each dropout its one-byte mask: sequence
    # parallelism keeps half of each on a rank.
    claimed = (norms * F32 + dropouts) * TOKENS * hidden // 2
    for m in memory:
        without, with_sp = m[kind, False, True], m[kind, True, True]
        assert without["saved"] - with_sp["saved"] >= claimed


# --------------------------------------------------------------------------- 2-D with FSDP2
def _two_d_rank(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ids, _ = _batch(64, seq=8)
    ids = torch.cat([ids, ids.flip(0)])  # 4 sequences, 2 per data-parallel rank
    dp = mesh["dp"].get_local_rank()
    local = ids[2 * dp: 2 * dp + 2]
    out = {}
    # Llama with sequence parallelism; GPT-2 for its converted layers and tied embedding.
    for kind, sp in (("llama", True), ("gpt2", False)):
        ref = _build(kind)
        ref(input_ids=ids, labels=ids).loss.backward()
        model = _build(kind)
        handle = apply_tensor_parallel(model, TensorParallelConfig(2, sequence_parallel=sp),
                                       mesh["tp"])
        for block in (model.model.layers if kind == "llama" else model.transformer.h):
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        handle.backward(handle.causal_lm_loss(model(input_ids=local).logits, local))
        out[kind] = (handle.full_grads(), {n: p.grad for n, p in ref.named_parameters()})
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_two_d_with_fsdp2_equals_unsplit_model():
    for rank_out in run_ranks(_two_d_rank, 4, timeout=300):
        for kind, (grads, want) in rank_out.items():
            assert grads.keys() == want.keys()
            for name, g in grads.items():
                torch.testing.assert_close(g, want[name], **TOL, msg=f"{kind}: {name}")


# --------------------------------------------------------------------------- bad input
def test_degree_that_does_not_divide_heads_is_refused_naming_what_works():
    cfg = _config("llama")  # 4 heads, 2 key-value heads, MLP 48
    with pytest.raises(ValueError, match=r"degree 4 does not divide the 2 key-value heads; "
                                         r"degrees that divide .* are 1, 2\.$"):
        check_tensor_parallel(cfg, 4)
    with pytest.raises(ValueError, match=r"degree 3 does not divide the 4 attention heads and "
                                         r"the 2 key-value heads; .* are 1, 2\."):
        check_tensor_parallel(cfg, 3)
    check_tensor_parallel(cfg, 2)


def test_mlp_width_is_checked_and_an_odd_vocabulary_is_not():
    cfg = _config("bert")
    cfg.intermediate_size = 50
    with pytest.raises(ValueError, match=r"does not divide the 50 MLP width; .* are 1, 2"):
        check_tensor_parallel(cfg, 4)
    check_tensor_parallel(_config("gpt2"), 2)  # vocabulary 63: sharded unevenly
    with pytest.raises(ValueError, match="more than the 63 vocabulary rows"):
        check_tensor_parallel(_config("gpt2"), 64)


def test_settings_and_launch_are_checked_before_any_split():
    assert TensorParallelConfig(0).problems() == [
        "tensor-parallel degree must be a whole number >= 1, got 0"]
    with pytest.raises(ValueError, match="--nproc-per-node 2"):
        apply_tensor_parallel(_build("llama"), 2)
    with pytest.raises(ValueError, match=r"no tensor-parallel plan for Sequential .* plan="):
        tp_plan_for(mlp())
    with pytest.raises(ValueError, match="does not divide the 4 attention heads"):
        apply_tensor_parallel(_build("gpt2"), 8)


def test_plans_name_every_projection_of_the_built_in_models():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    for kind in KINDS:
        model = _build(kind)
        plan = tp_plan_for(model)
        names = [n for n, _ in model.named_modules()]
        for pattern in plan:
            assert fnmatch.filter(names, pattern), f"{kind}: {pattern} matches no module"
        kinds = {type(s) for s in plan.values()}
        assert ColwiseParallel in kinds and RowwiseParallel in kinds
