"""ZeRO-R's partitioned activation checkpoints (``parallel.partition_activations``, with
``partition_offload``) under tensor parallelism, on real gloo processes, and memfit's per-rank
prediction of checkpointed layouts (``predict_layout(..., checkpointing=...)``).

One spawn of two ranks trains a tiny Llama (fp32, no dropout) 2-way tensor-parallel under full
checkpointing three ways (plain, partitioned, partitioned with offload) and under selective
checkpointing two (plain, partitioned); one spawn of four ranks does full checkpointing plain
and partitioned over tensor 2 x pipeline 2 (1F1B). Each runs a first step whose
loss and gradients are compared with the unsplit, unchecked model's, then a warm step measured
by memfit's tracker, compared with :func:`~memfit.estimate.layout.predict_layout`.
"""

from __future__ import annotations

import pytest
import torch

import memfit
from memfit.distributed.config import ParallelConfig
from memfit.estimate.layout import predict_layout
from memfit.strategies.checkpointing import CheckpointConfig

from .harness import (
    assert_gradients_close,
    assert_rank_peaks,
    collectives_released_in_order,
    receive_buffers,
    run_ranks,
    step_then_track,
    tiny_llama,
    token_batch,
)

BATCH, SEQ, VOCAB, HIDDEN, LAYERS = 4, 256, 256, 64, 4
FULL = CheckpointConfig(mode="full")
SELECTIVE = CheckpointConfig(mode="selective")
TP2 = {
    "checkpointed": ParallelConfig(tensor=2),
    "partitioned": ParallelConfig(tensor=2, partition_activations=True),
    "partitioned, offload": ParallelConfig(tensor=2, partition_activations=True,
                                           partition_offload=True),
    # Selective checkpointing keeps the matmul outputs too; the block input is partitioned.
    "selective": ParallelConfig(tensor=2),
    "selective, partitioned": ParallelConfig(tensor=2, partition_activations=True),
}
TP2_PP2 = {
    "checkpointed": ParallelConfig(tensor=2, pipeline=2, schedule="1f1b", microbatches=2),
    "partitioned": ParallelConfig(tensor=2, pipeline=2, schedule="1f1b", microbatches=2,
                                  partition_activations=True),
    # The same four processes as data 2 x tensor 2 (DDP over the replicas).
    "data 2 x tensor 2, partitioned": ParallelConfig(data=2, tensor=2,
                                                     partition_activations=True),
}
#: Gradients gathered whole against the unsplit model's: only the order of the sums differs.
RTOL = 1e-5
#: A rank's measured peak against its prediction.
PEAK_RTOL = 0.03


def _checkpointing(name: str) -> CheckpointConfig:
    """The checkpointing of the layout called ``name``."""
    return SELECTIVE if name.startswith("selective") else FULL


def _model(layers: int = LAYERS, seq: int = SEQ) -> torch.nn.Module:
    return tiny_llama(VOCAB, seq, layers, hidden=HIDDEN)


def _batch(seq: int = SEQ) -> torch.Tensor:
    return token_batch(BATCH, seq, VOCAB)


def _ranks(rank: int, world: int, layouts: dict[str, ParallelConfig], seq: int) -> dict:
    from memfit.apply.layout import checkpoint_layout_modules
    from memfit.distributed.layout import build_layout

    out = {}
    for name, parallel in layouts.items():
        layout = build_layout(_model(seq=seq), parallel, batch_size=BATCH)
        share = BATCH // parallel.data  # this replica's samples
        ids = _batch(seq)[layout.coords["dp"] * share:(layout.coords["dp"] + 1) * share]
        handles = checkpoint_layout_modules(layout.modules, _checkpointing(name), parallel,
                                            layout.mesh["tp"])
        run = step_then_track(layout, ids)
        report = min(run["report"], _track_again(layout, ids, run["optimizer"]),
                     key=lambda r: r.peak_bytes)
        counters = [h.counters for h in handles if hasattr(h, "counters")]
        out[name] = {
            "loss": run["loss"], "grads": run["grads"], "peak": report.peak_bytes,
            # What the forward left on the device for backward, and the host tier's peak.
            "at_backward": _live_at_backward(report),
            "host": report.peak_by_tier.get("host", 0),
            "kept": sum(c.kept_bytes for c in counters),
            "whole": sum(c.whole_bytes for c in counters),
            "gathered": sum(c.gathered for c in counters),
        }
    return out


def _track_again(layout, ids: torch.Tensor, opt) -> memfit.MemoryReport:
    """One more warm step under memfit's tracker, as ``step_then_track``'s. The tests take the
    lower of the two peaks: now and then a rank's peak is higher by a block input or so, in
    any layout, partitioned or not (a tensor that gloo's worker thread lets go of late, we
    believe: DTensor's functional all-reduces, which ``collectives_released_in_order`` cannot
    reach); the program's own memory is the lower figure."""
    opt.zero_grad(set_to_none=True)
    with collectives_released_in_order(), memfit.track(optimizer=opt) as tracker:
        tracker.label(layout.parameters(), "parameters")
        tracker.label(receive_buffers(layout), "other")
        tracker.add_inputs((ids,))
        layout.step(ids, ids)
        opt.step()
    return tracker.report()


def _live_at_backward(report) -> int:
    """Live device bytes at the warm step's first backward operation: the static bytes and
    everything the forward kept (the checkpointed inputs among them)."""
    timeline = report.timeline
    first = timeline["phase"].index("backward")
    return sum(v[first] for k, v in timeline.items() if k not in ("op_index", "phase"))


@pytest.fixture(scope="module")
def tp2() -> list[dict]:
    return run_ranks(_ranks, 2, TP2, SEQ, timeout=300)


@pytest.fixture(scope="module")
def tp2_pp2() -> list[dict]:
    return run_ranks(_ranks, 4, TP2_PP2, SEQ, timeout=400)


def _reference(seq: int) -> tuple[float, dict[str, torch.Tensor]]:
    """The unsplit model, no checkpointing, one process: the loss and gradients."""
    model = _model(seq=seq)
    ids = _batch(seq)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}


def _runs(request, which: str) -> tuple[list[dict], dict[str, ParallelConfig], int]:
    layouts, seq = {"tp2": (TP2, SEQ), "tp2_pp2": (TP2_PP2, SEQ)}[which]
    return request.getfixturevalue(which), layouts, seq


CASES = [("tp2", n) for n in TP2] + [("tp2_pp2", n) for n in TP2_PP2]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(("which", "name"), CASES)
def test_losses_and_gradients_equal_the_unsplit_model(request, which, name):
    """The loss and every gradient (gathered whole over the tensor ranks, collected from the
    stages) equal the unsplit, unchecked model's to 1e-5 (relative to each gradient's largest
    entry): partitioning changes where the checkpointed inputs wait, not their values."""
    results, _, seq = _runs(request, which)
    want_loss, want = _reference(seq)
    got: dict[str, torch.Tensor] = {}
    for out in results:
        assert out[name]["loss"] == pytest.approx(want_loss, rel=RTOL)
        got.update(out[name]["grads"])
    assert set(got) == set(want)
    assert_gradients_close(got, want, RTOL, f"{which}, {name}: ")


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(("which", "name"), CASES)
def test_each_rank_s_peak_is_predicted_within_3_percent(request, which, name):
    """Each rank's warm-step peak (memfit's tracker) within 3% of predict_layout's figure for
    that rank, computed without a process group, with the same checkpointing."""
    results, layouts, seq = _runs(request, which)
    predicted = predict_layout(_model(seq=seq), layouts[name], batch_size=BATCH, seq_len=seq,
                               checkpointing=_checkpointing(name))
    measured = [out[name]["peak"] for out in results]
    assert_rank_peaks(measured, predicted.peak_bytes, PEAK_RTOL, f"{which}, {name}: ")


@pytest.mark.distributed
@pytest.mark.slow
def test_checkpointed_inputs_per_rank_drop_by_the_tensor_degree(tp2):
    """Measured on each rank: every block's checkpointed input is kept as half (tensor 2), so
    what the forward leaves on the device for backward drops by half the whole inputs, as
    predicted (the forward's kept bytes, predicted without and with partitioning), under full
    and selective checkpointing; with offload the whole inputs leave the device and their
    halves are the host tier's. Each
    block's input is all-gathered once per backward. The rank's peak drops too, measured and
    predicted alike (the first blocks' inputs wait as halves while the last ones recompute)."""
    kw = dict(batch_size=BATCH, seq_len=SEQ)
    predicted = {n: predict_layout(_model(), p, checkpointing=_checkpointing(n), **kw)
                 for n, p in TP2.items()}
    kept = {n: p.roles[0].forward_kept[0] for n, p in predicted.items()}
    block_input = BATCH * SEQ * HIDDEN * 4  # one fp32 hidden-state tensor
    whole = LAYERS * block_input  # one step's checkpointed inputs
    assert kept["checkpointed"] - kept["partitioned"] == whole // 2
    assert kept["checkpointed"] - kept["partitioned, offload"] == whole
    assert kept["selective"] - kept["selective, partitioned"] == whole // 2
    for r, out in enumerate(tp2):
        plain, part, off = out["checkpointed"], out["partitioned"], out["partitioned, offload"]
        sel, sel_part = out["selective"], out["selective, partitioned"]
        assert sel["at_backward"] - sel_part["at_backward"] == whole // 2
        # The counters are over the three steps (the first and the two tracked warm ones).
        assert part["whole"] == 3 * whole and part["kept"] == 3 * whole // 2
        assert part["gathered"] == off["gathered"] == 3 * LAYERS
        assert plain["at_backward"] - part["at_backward"] == whole // 2
        assert plain["at_backward"] - off["at_backward"] == whole
        assert off["host"] >= whole // 2 > plain["host"]
        for name in ("partitioned", "partitioned, offload"):
            assert out[name]["peak"] < plain["peak"]
            assert predicted[name].peak_bytes[r] < predicted["checkpointed"].peak_bytes[r]


# --------------------------------------------------------------------------- one process
@pytest.mark.slow
def test_prediction_prices_the_partitioned_inputs_at_one_over_tensor():
    """On fake tensors: under tensor 2 the forward keeps each block's input at half with
    partitioning and at nothing on the device with offload, and 1F1B's first pipeline stage,
    whose first block's input is its own embedding's output, likewise; the last stage's first
    block reads its receive buffer, which the stage keeps whole anyway (not partitioned)."""
    kw = dict(batch_size=8, seq_len=16, checkpointing="full")
    half = 8 * 16 * HIDDEN * 4 // 2
    plain = predict_layout(_model(), ParallelConfig(tensor=2), **kw).roles[0].forward_kept[0]
    part = predict_layout(_model(), TP2["partitioned"], **kw).roles[0].forward_kept[0]
    off = predict_layout(_model(), TP2["partitioned, offload"], **kw).roles[0].forward_kept[0]
    assert plain - part == LAYERS * half and plain - off == 2 * LAYERS * half
    piped = {n: predict_layout(_model(), TP2_PP2[n], **kw) for n in ("checkpointed",
                                                                    "partitioned")}
    mb_half = half // 2  # two micro-batches
    kept = {n: (p.roles[0].forward_kept[0], p.roles[1].forward_kept[1]) for n, p in piped.items()}
    assert kept["checkpointed"][0] - kept["partitioned"][0] == 2 * mb_half
    assert kept["checkpointed"][1] - kept["partitioned"][1] == mb_half


def test_checkpointing_is_predicted_below_no_checkpointing():
    """predict_layout takes the checkpointing: full keeps less than none on every rank."""
    kw = dict(batch_size=8, seq_len=16)
    par = ParallelConfig(tensor=2)
    none = predict_layout(_model(), par, **kw)
    full = predict_layout(_model(), par, checkpointing="full", **kw)
    assert full.roles[0].forward_kept[0] < none.roles[0].forward_kept[0] / 2
    assert all(f < n for f, n in zip(full.peak_bytes, none.peak_bytes, strict=True))


@pytest.mark.parametrize(("plan", "match"), [
    ({"parallel": {"tensor": 2, "partition_activations": True}},
     "partition_activations splits the block inputs that activation checkpointing keeps and "
     "needs checkpointing 'full' or 'selective'"),
    ({"parallel": {"partition_activations": True}, "checkpointing": "full"},
     "needs tensor > 1"),
    ({"parallel": {"tensor": 2, "sequence": True, "partition_activations": True},
      "checkpointing": "full"},
     "has nothing to split with sequence true"),
    ({"parallel": {"tensor": 2, "partition_offload": True}, "checkpointing": "full"},
     "partition_offload .* needs partition_activations true"),
    ({"parallel": {"tensor": 2, "partition_activations": "yes"}, "checkpointing": "full"},
     "partition_activations must be true or false"),
])
def test_bad_partition_settings_are_one_sentence(plan, match):
    with pytest.raises(memfit.PlanError, match=match):
        memfit.Plan.from_dict(plan)


def test_a_partitioned_plan_loads_and_round_trips():
    plan = memfit.Plan.from_dict({"parallel": {"tensor": 2, "partition_activations": True},
                                  "checkpointing": "full"})
    assert plan.parallel.partition_activations and not plan.parallel.partition_offload
    assert memfit.Plan.from_dict(plan.to_dict()) == plan
    offload = plan.replace(parallel=ParallelConfig(tensor=2, partition_activations=True,
                                                   partition_offload=True))
    assert memfit.Plan.from_dict(offload.to_dict()) == offload


def test_memfit_train_predicts_the_ranks_of_a_checkpointed_layout(tmp_path):
    """What ``memfit train`` prints beside each rank's measured peak: for a checkpointed and a
    partitioned layout plan, predict_layout's figures with the plan's checkpointing (it
    used to give none for a checkpointed plan)."""
    from types import SimpleNamespace

    from memfit.train.layout_run import predict_rank_peaks
    from memfit.workload import load_workload

    _model(seq=16).config.to_json_file(tmp_path / "config.json")
    run = SimpleNamespace(workload=load_workload(str(tmp_path / "config.json"), 8, 16))
    for parallel in (TP2["checkpointed"], TP2["partitioned"]):
        plan = memfit.Plan(parallel=parallel, checkpointing="full")
        want = predict_layout(_model(seq=16), parallel, batch_size=8, seq_len=16,
                              checkpointing=FULL).peak_bytes
        assert predict_rank_peaks(run, plan) == want


def test_the_planner_s_model_prices_the_inputs_at_one_over_tensor(tmp_path):
    """The 3-D planner's per-rank model (estimate_layout) with partitioned checkpoints:
    each block's kept input at 1/t per rank (none on the device with offload), one block's
    input whole again during its recomputation, and one all-gather per block and micro-batch
    more in the tensor-parallel communication; so the peak drops and the step slows."""
    from memfit.estimate.layout_cost import estimate_layout, model_shape
    from memfit.targets import get_device
    from memfit.workload import load_workload

    _model(seq=SEQ).config.to_json_file(tmp_path / "config.json")
    workload = load_workload(str(tmp_path / "config.json"), 8, SEQ)
    kw = dict(batch_size=8, seq_len=SEQ, checkpointing=True, device=get_device("h100"),
              precision="fp32", optimizer="adamw", gpus_per_node=8)
    shape = model_shape(workload)
    priced = {n: estimate_layout(shape, TP2[n], **kw)
              for n in ("checkpointed", "partitioned", "partitioned, offload")}
    block_input = 8 * SEQ * HIDDEN * 4
    acts = {n: c.by_category["activations"] for n, c in priced.items()}
    work = {n: c.by_category["temporaries"] for n, c in priced.items()}
    assert acts["checkpointed"] - acts["partitioned"] == LAYERS * block_input // 2
    assert acts["checkpointed"] - acts["partitioned, offload"] == LAYERS * block_input
    assert work["partitioned"] - work["checkpointed"] == block_input // 2
    assert work["partitioned, offload"] - work["checkpointed"] == block_input
    plain, part = priced["checkpointed"], priced["partitioned"]
    assert part.max_peak_bytes < plain.max_peak_bytes
    assert part.parts["tensor"] > plain.parts["tensor"] and part.step_seconds > plain.step_seconds
