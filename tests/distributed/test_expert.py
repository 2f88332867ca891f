"""Expert parallelism: two real gloo processes (data 2 x expert 2) on a tiny Mixtral give the
single-process loss and gradients, and each rank's tracked peak its dry-run prediction."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from memfit import Plan
from memfit.distributed.config import ParallelConfig

from .harness import assert_rank_peaks, run_ranks, token_batch

BATCH, SEQ, VOCAB, EXPERTS = 4, 16, 128, 4
CONFIG = dict(model_type="mixtral", architectures=["MixtralForCausalLM"], hidden_size=32,
              intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
              num_local_experts=EXPERTS, num_experts_per_tok=2, router_jitter_noise=0.0,
              attention_dropout=0.0)  # fmt: skip
PARALLEL = ParallelConfig(data=2, expert=2)
#: ZeRO stages whose numerics are checked: DDP, and FSDP2 (the experts over their replicas).
STAGES = (0, 2, 3)
#: Gradients gathered against the unsplit model's: only the order of sums may differ.
RTOL = 1e-5
#: The dry run's peak against the tracked one, per rank.
MEMORY_RTOL = 0.03


def _model() -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    fields = {k: v for k, v in CONFIG.items() if k not in ("model_type", "architectures")}
    return MixtralForCausalLM(MixtralConfig(**fields)).train()


def _batch() -> torch.Tensor:
    return token_batch(BATCH, SEQ, VOCAB)


def _grads(rank: int, world: int) -> list[tuple[float, dict]]:
    """For each ZeRO stage of :data:`STAGES`: one step's loss (averaged over the ranks) and
    this rank's gradients, whole (its own experts' under their whole-model names)."""
    import dataclasses

    from memfit.distributed.data import apply_data_parallel, local_batch, mean_over_ranks

    out = []
    for stage in STAGES:
        model = _model()
        handle = apply_data_parallel(model, dataclasses.replace(PARALLEL, zero_stage=stage))
        ids = local_batch(_batch(), rank, world)
        loss = handle.module(input_ids=ids, labels=ids).loss
        handle.before_backward(True)
        loss.backward()
        handle.after_backward(True)
        grads = {}
        for n, p in model.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[n] = g.detach().clone()
        share = EXPERTS // PARALLEL.expert
        first = rank % PARALLEL.expert * share
        out.append((float(mean_over_ranks(loss)), {"grads": grads,
                                                   "experts": (first, first + share)}))
    return out


def _peak(rank: int, world: int, path: str, plan: dict) -> int:
    """This rank's tracked peak over three real steps of ``plan``."""
    from memfit.estimate.dryrun import measure

    report = measure(path, Plan.from_dict(plan), batch_size=BATCH, seq_len=SEQ, steps=3)
    return int(report.peak_bytes)


@pytest.fixture(scope="module")
def config_path(tmp_path_factory) -> str:
    path = Path(tmp_path_factory.mktemp("mixtral")) / "config.json"
    path.write_text(json.dumps(CONFIG))
    return str(path)


@pytest.mark.distributed
@pytest.mark.slow
def test_expert_parallel_equals_one_process():
    """The loss and every gradient equal the unsplit model's on the whole batch to 1e-5
    (relative to each gradient's largest entry): the replicated parameters' from every rank,
    each expert's from the rank that holds it."""
    results = run_ranks(_grads, 2, timeout=300)
    model = _model()
    ids = _batch()
    want_loss = model(input_ids=ids, labels=ids).loss
    want_loss.backward()
    want = {n: p.grad for n, p in model.named_parameters()}
    for rank, per_stage in enumerate(results):
        for stage, (loss, out) in zip(STAGES, per_stage, strict=True):
            where = f"rank {rank}, ZeRO stage {stage}"
            assert loss == pytest.approx(float(want_loss.detach()), rel=RTOL), where
            lo, hi = out["experts"]
            for name, g in want.items():
                if ".experts." in name:
                    g = g[lo:hi]  # this rank's experts
                torch.testing.assert_close(out["grads"][name], g, rtol=RTOL,
                                           atol=RTOL * float(g.abs().max()),
                                           msg=f"{name} ({where})")


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2])
def test_each_rank_s_peak_matches_its_prediction(config_path, stage):
    """Each rank's peak over three training steps, tracked by memfit (parameters, DDP's
    buckets or FSDP2's shards, the dispatched tokens, activations, optimizer state), is within
    3% of predict_ranks's dry run of that rank in a fake process group."""
    from memfit.estimate.distributed import predict_ranks

    plan = Plan(parallel=ParallelConfig(data=2, expert=2, zero_stage=stage))
    measured = run_ranks(_peak, 2, config_path, plan.to_dict(), timeout=300)
    predicted = predict_ranks(config_path, plan, batch_size=BATCH, seq_len=SEQ).peak_bytes
    assert_rank_peaks(measured, predicted, MEMORY_RTOL)


LAYOUT = ParallelConfig(data=2, pipeline=2, expert=2, microbatches=2)


def _layout_grads(rank: int, world: int) -> dict:
    """One step of a data 2 x pipeline 2 x expert 2 layout: its loss and this rank's stage's
    gradients (its experts' among them)."""
    import memfit
    from memfit.distributed.layout import build_layout

    layout = build_layout(_model(), LAYOUT, batch_size=BATCH)
    d = layout.coords["dp"]
    share = BATCH // LAYOUT.data
    ids = _batch()[d * share:(d + 1) * share]
    opt = torch.optim.AdamW(layout.parameters(), lr=1e-3)
    loss = layout.step(ids, ids)
    grads = layout.full_grads()
    opt.step()
    opt.zero_grad(set_to_none=True)
    # A warm step, tracked (as tests/distributed/test_layout.py measures a layout).
    with memfit.track(optimizer=opt) as tracker:
        tracker.label(layout.parameters(), "parameters")
        tracker.add_inputs((ids,))
        layout.step(ids, ids)
        opt.step()
    share = EXPERTS // LAYOUT.expert
    first = d % LAYOUT.expert * share
    return {"loss": float(loss), "grads": grads, "experts": (first, first + share),
            "peak": tracker.report().peak_bytes}


@pytest.fixture(scope="module")
def layout_results() -> list[dict]:
    return run_ranks(_layout_grads, 4, timeout=400)


@pytest.mark.distributed
@pytest.mark.slow
def test_expert_parallel_under_a_pipeline_equals_one_process(layout_results):
    """Expert groups carved from each stage's replicas (data 2 x pipeline 2 x expert 2, four
    processes): the loss and every gradient equal the unsplit model's to 1e-5."""
    results = layout_results
    model = _model()
    ids = _batch()
    want_loss = model(input_ids=ids, labels=ids).loss
    want_loss.backward()
    want = {n: p.grad for n, p in model.named_parameters()}
    seen = set()
    for rank, out in enumerate(results):
        assert out["loss"] == pytest.approx(float(want_loss.detach()), rel=RTOL), rank
        lo, hi = out["experts"]
        for name, got in out["grads"].items():
            g = want[name][lo:hi] if ".experts." in name else want[name]
            seen.add(name)
            torch.testing.assert_close(got, g, rtol=RTOL, atol=RTOL * float(g.abs().max()),
                                       msg=f"{name} (rank {rank})")
    assert seen == set(want)


@pytest.mark.distributed
@pytest.mark.slow
def test_layout_prediction_matches_each_rank_s_peak(layout_results):
    """Each rank's tracked peak over a warm step of the expert-split pipeline is within 3% of
    predict_layout's dry run of its role (computed here without any process group), and
    the split is what makes it smaller than the unsplit experts' prediction."""
    import dataclasses

    from memfit.estimate.layout import predict_layout

    predicted = predict_layout(_model(), LAYOUT, batch_size=BATCH, seq_len=SEQ).peak_bytes
    whole = predict_layout(_model(), dataclasses.replace(LAYOUT, expert=1), batch_size=BATCH,
                           seq_len=SEQ).peak_bytes
    measured = [out["peak"] for out in layout_results]
    assert_rank_peaks(measured, predicted, MEMORY_RTOL)
    assert all(p < w for p, w in zip(predicted, whole, strict=True))


def _train(plan: dict) -> dict[str, torch.Tensor]:
    """Two AdamW steps of ``plan`` through apply_plan (the stepper's local batch, its
    accumulation and the experts' synchronisation on the last micro-batch), the parameters
    after them."""
    from memfit.apply.compose import apply_plan

    model = _model()
    setup = apply_plan(model, Plan.from_dict(plan))
    g = torch.Generator().manual_seed(2)
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        setup.step({"input_ids": ids, "labels": ids})
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().clone()
    return out


def _train_ranks(rank: int, world: int, plan: dict) -> tuple[int, dict[str, torch.Tensor]]:
    return rank % PARALLEL.expert, _train(plan)


@pytest.mark.distributed
@pytest.mark.slow
def test_training_with_accumulation_equals_one_process():
    """Two steps of two accumulated micro-batches through apply_plan (data 2 x expert 2,
    ZeRO 0) leave every parameter as one process on the whole batch does, to 1e-5."""
    plan = Plan(parallel=PARALLEL, grad_accum_steps=2)
    results = run_ranks(_train_ranks, 2, plan.to_dict(), timeout=300)
    want = _train(plan.replace(parallel={}).to_dict())
    share = EXPERTS // PARALLEL.expert
    for rank, (index, got) in enumerate(results):
        for name, w in want.items():
            if ".experts." in name:
                w = w[index * share:(index + 1) * share]
            torch.testing.assert_close(got[name], w, rtol=RTOL, atol=RTOL * float(w.abs().max()),
                                       msg=f"{name} (rank {rank})")
