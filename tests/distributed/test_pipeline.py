"""Pipeline parallelism in two real processes (gloo, CPU): the unsplit model's numerics, and
each schedule's activation peak per stage as theory and the dry-run prediction say.

One spawn runs every model (tiny GPT-2 with tied embeddings, tiny Llama, an nn.Sequential
stack) under every schedule; the tests below read its results.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import memfit
from memfit.distributed.pipeline import (
    PipelineConfig,
    PipelineError,
    build_pipeline,
    build_stage,
    causal_lm_loss,
    microbatches_in_flight,
    run_pipeline_step,
)
from memfit.estimate.pipeline import _replay
from memfit.strategies.checkpointing import CheckpointConfig, apply_checkpointing

from .harness import run_ranks

P = 2  # pipeline degree: two processes
M = 4  # micro-batches
BATCH, SEQ, VOCAB = 8, 32, 97
FAMILIES = ("gpt2", "llama", "sequential")
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")


def _model(family: str) -> nn.Module:
    torch.manual_seed(0)
    if family == "sequential":
        return nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
                               for _ in range(8)])
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if family == "gpt2":  # ties lm_head to wte: a weight on the first and the last stage
        config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=4, n_head=4,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return GPT2LMHeadModel(config)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=SEQ)
    return LlamaForCausalLM(config)


def _batch(family: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if family == "sequential":
        return torch.randn(BATCH, 64, generator=g), torch.randn(BATCH, 64, generator=g)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return ids, ids


def _loss_fn(family: str):
    return _mse if family == "sequential" else causal_lm_loss


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def _reference(family: str) -> tuple[float, dict[str, torch.Tensor]]:
    """The unsplit model on the whole batch: loss and gradients."""
    model = _model(family)
    x, y = _batch(family)
    out = model(x)
    loss = _loss_fn(family)(getattr(out, "logits", out), y)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def _ranks(rank: int, world: int) -> dict:
    out: dict = {}
    for family in FAMILIES:
        x, y = _batch(family)
        for schedule in SCHEDULES:
            config = PipelineConfig(P, schedule, M)
            pipe = build_pipeline(_model(family), config, loss_fn=_loss_fn(family))
            loss = run_pipeline_step(pipe, x, y)
            grads = {}
            for stage in pipe.stages:
                for name, p in stage.named_parameters():
                    grads[stage.tied.get(name, name)] = p.grad.clone()
            # The second step, warm (the first one infers the shapes between stages), measured.
            for p in pipe.parameters():
                p.grad = None
            with memfit.track() as tracker:
                tracker.label(pipe.parameters(), "parameters")
                tracker.add_inputs((x, y))  # the micro-batches are views of these
                run_pipeline_step(pipe, x, y)
            report = tracker.report()
            out[family, schedule] = {
                "loss": float(loss),
                "grads": grads,
                "activation_peak": max(report.timeline["activations"]),
                "torch_in_flight": _replay(pipe.schedule.pipeline_order[rank], lambda s: 1),
            }
    out["checkpointed"] = _composed(rank, checkpoint=True)
    out["bf16"] = _composed(rank, checkpoint=False)
    # A batch that does not split into the micro-batches is refused before any message.
    pipe = build_pipeline(_model("sequential"), PipelineConfig(P, "1f1b", M), loss_fn=_mse)
    x, y = _batch("sequential")
    try:
        run_pipeline_step(pipe, x[:6], y[:6])
    except PipelineError as e:
        out["bad_batch"] = str(e)
    return out


def _composed(rank: int, checkpoint: bool) -> dict:
    """GPT-2 under 1F1B with memfit's full activation checkpointing on every stage's blocks,
    or under bf16 autocast: a stage is an ordinary module to both."""
    x, y = _batch("gpt2")
    pipe = build_pipeline(_model("gpt2"), PipelineConfig(P, "1f1b", M))
    precision = contextlib.nullcontext()
    if checkpoint:
        for stage in pipe.stages:
            apply_checkpointing(stage, CheckpointConfig("full", blocks=("transformer.h.*",)))
    else:
        precision = torch.autocast("cpu", dtype=torch.bfloat16)
    with precision:
        loss = run_pipeline_step(pipe, x, y)
    grads = {pipe.stages[0].tied.get(n, n): p.grad.clone()
             for n, p in pipe.stages[0].named_parameters()}
    for p in pipe.parameters():
        p.grad = None
    with memfit.track() as tracker, precision:
        tracker.label(pipe.parameters(), "parameters")
        tracker.add_inputs((x, y))
        run_pipeline_step(pipe, x, y)
    return {"loss": float(loss), "grads": grads,
            "activation_peak": max(tracker.report().timeline["activations"])}


@pytest.fixture(scope="session")  # built once, whatever order xdist runs tests in
def results() -> list[dict]:
    return run_ranks(_ranks, P, timeout=240)


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline_equals_unsplit_model(results, family, schedule):
    """Loss (mean over micro-batches) and every parameter's gradient equal the unsplit
    model's on the whole batch; a tied weight's copies both carry the summed gradient."""
    want_loss, want = _reference(family)
    got: dict[str, torch.Tensor] = {}
    for rank_out in results:
        r = rank_out[family, schedule]
        assert r["loss"] == pytest.approx(want_loss, rel=1e-5)
        for name, grad in r["grads"].items():
            if name in got:  # a tied copy: the same summed gradient as the first
                torch.testing.assert_close(grad, got[name], rtol=0, atol=0)
            got[name] = grad
    assert set(got) == set(want)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.distributed
@pytest.mark.parametrize("family", FAMILIES)
def test_gpipe_keeps_all_microbatches_1f1b_at_most_the_stages(results, family):
    """Measured by memfit's tracker on each rank: GPipe's first stage keeps M micro-batches'
    activations at once, 1F1B's at most p, so the peaks' ratio is M / p (2); on the last
    stage 1F1B keeps one, so the ratio is M (4). Within 5%: under 1F1B torch's pending send
    keeps one finished micro-batch's stage output (saved by its last op) alive a while
    longer, one hidden-sized tensor against a micro-batch's whole stage (3% here at most)."""
    for rank, expected in ((0, M / P), (1, M / 1)):
        gpipe = results[rank][family, "gpipe"]["activation_peak"]
        one_f = results[rank][family, "1f1b"]["activation_peak"]
        assert gpipe / one_f == pytest.approx(expected, rel=0.05), (rank, gpipe, one_f)


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_in_flight_theory_is_torch_schedule_order(results, schedule):
    v = PipelineConfig(P, schedule).local_stages
    for rank in range(P):
        got = results[rank]["gpt2", schedule]["torch_in_flight"]
        assert got == microbatches_in_flight(schedule, P, M, rank, v)


@pytest.mark.distributed
def test_composes_with_activation_checkpointing(results):
    """Checkpointed stages: the unsplit model's loss and gradients exactly as before, and
    stage 0 keeps at most its blocks' inputs per micro-batch in flight (2 x 2 hidden-sized
    tensors), far below the plain 1F1B peak."""
    want_loss, want = _reference("gpt2")
    r = results[0]["checkpointed"]
    assert r["loss"] == pytest.approx(want_loss, rel=1e-5)
    for name, grad in r["grads"].items():
        torch.testing.assert_close(grad, want[name], rtol=1e-5, atol=1e-5, msg=name)
    plain = results[0]["gpt2", "1f1b"]["activation_peak"]
    hidden = BATCH // M * SEQ * 32 * 4  # one block input per micro-batch
    assert 0 < r["activation_peak"] <= 2 * 2 * hidden + 1024 < plain / 10


@pytest.mark.distributed
def test_composes_with_bf16_autocast(results):
    """bf16 autocast around the step: the unsplit model under the same autocast gives the
    same loss and gradients to bf16's precision (micro-batches round differently from the
    whole batch), and the kept activations shrink."""
    model = _model("gpt2")
    x, y = _batch("gpt2")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = causal_lm_loss(model(x).logits, y)
    loss.backward()
    r = results[0]["bf16"]
    assert r["loss"] == pytest.approx(float(loss.detach()), rel=2e-2)
    for name, grad in r["grads"].items():
        want = dict(model.named_parameters())[name].grad
        assert (grad - want).norm() <= 5e-2 * want.norm() + 1e-6, name
    assert r["activation_peak"] < results[0]["gpt2", "1f1b"]["activation_peak"]


@pytest.mark.distributed
def test_indivisible_batch_is_refused(results):
    for rank_out in results:
        assert "does not split into 4 equal micro-batches" in rank_out["bad_batch"]


# ---------------------------------------------------------------------------- one process
@pytest.mark.parametrize("family", FAMILIES)
def test_stages_hold_the_model_s_own_modules_under_its_own_names(family):
    model = _model(family)
    config = PipelineConfig(2, "zero-bubble", 4)  # four stages; GPT-2's tie spans first-last
    stages = [build_stage(model, config, s) for s in range(config.num_stages)]
    params = dict(model.named_parameters())
    seen: dict[str, int] = {}
    for stage in stages:
        for name, p in stage.named_parameters():
            source = stage.tied.get(name, name)
            seen[source] = seen.get(source, 0) + 1
            if name in params and name not in stage.tied:
                assert p is params[name]  # the model's own tensor, not a copy
    assert set(seen) == set(params)
    tied = {n for n, count in seen.items() if count > 1}
    assert tied == ({"transformer.wte.weight"} if family == "gpt2" else set())
    # Run in sequence, the stages are the model.
    x, _ = _batch(family)
    h = x
    for stage in stages:
        h = stage(h)
    want = model(x)
    torch.testing.assert_close(h, getattr(want, "logits", want), rtol=0, atol=0)


def test_build_stage_refuses_what_it_cannot_split():
    with pytest.raises(PipelineError, match=r"write the model as an nn\.Sequential"):
        build_stage(nn.Linear(2, 2), PipelineConfig(2), 0)
    with pytest.raises(PipelineError, match="4 blocks cannot fill 8 pipeline stages"):
        build_stage(_model("gpt2"), PipelineConfig(4, "interleaved-1f1b", 4), 0)
    with pytest.raises(PipelineError, match="stage_index must be between 0 and 1"):
        build_stage(_model("sequential"), PipelineConfig(2), 2)
    with pytest.raises(PipelineError, match=r"e\.g\. \(4,\)"):
        build_stage(_model("sequential"), PipelineConfig(2, cuts=(9,)), 0)
