"""Checkpoints, resume, evaluation and the memory report of ``memfit train`` with a tensor or
pipeline plan (:mod:`memfit.train.layout_run`), on two real gloo processes: a run cut in half,
checkpointed and resumed ends bit for bit where the straight run ends."""

from __future__ import annotations

import itertools
import json
import os
import signal

import pytest
import torch

from memfit import Plan
from memfit.train import TrainConfig
from memfit.train.layout_checkpoint import (
    _placement,
    check_resumable,
    check_resume_before_launch,
    layout_name,
    rank_module,
)
from memfit.train.layout_memory import rank_plot_path
from memfit.train.manifest import CheckpointError, write_manifest

from ..distributed.harness import run_ranks

TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(60))
#: Two ranks, one dimension each: a pipeline of two stages, and a tensor-parallel pair.
LAYOUTS = {
    "pipeline2": {"pipeline": 2, "microbatches": 2},
    "tensor2": {"tensor": 2},
}


def _config(data: str, plan: Plan, **kw) -> TrainConfig:
    kw.setdefault("eval_every", 2)
    return TrainConfig(model="llama-tiny", data=(data,), plan=plan, batch_size=4, seq_len=16,
                       eval_fraction=0.05, lr=0.003, warmup_steps=1, schedule="constant",
                       track_every=1000, seed=5, **kw)


def _local_params(result_modules) -> dict[str, torch.Tensor]:
    """This rank's parameters as plain tensors (a DTensor's shard), under their names."""
    module = rank_module(result_modules)
    return {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
            for n, p in module.named_parameters()}


def _straight_then_halves(rank: int, world: int, parallel: dict, folder: str, data: str,
                          png: str) -> dict:
    from memfit.train import layout_run
    from memfit.train.run import prepare_run

    plan = Plan(parallel=parallel)
    evals = _eval_against_unsplit(_config(data, plan, max_steps=4), plan)
    kept: dict[str, list] = {}
    real = layout_run._LayoutLoop

    class Keep(real):  # the loop's modules, to compare the parameters after each run
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            kept.setdefault("modules", []).append(self.layout.modules)

    layout_run._LayoutLoop = Keep
    try:
        # Evaluated after every step: evaluation between steps must not change training.
        straight = layout_run.train_layout(
            prepare_run(_config(data, plan, max_steps=4, eval_every=1), world_size=1), plan,
            progress=False, report_png=png)
        first = layout_run.train_layout(
            prepare_run(_config(data, plan, max_steps=2, checkpoint_dir=folder), world_size=1),
            plan, progress=False)
        resumed = layout_run.train_layout(
            prepare_run(_config(data, plan, max_steps=4, checkpoint_dir=folder, resume=True),
                        world_size=1), plan, progress=False)
        # A SIGTERM to rank 1 during its second step: every rank stops after it, saved.
        real_step = Keep.step

        def step(self):
            out = real_step(self)
            if rank == 1 and self.step_count == 2:
                os.kill(os.getpid(), signal.SIGTERM)
            return out

        Keep.step = step
        stopped = layout_run.train_layout(
            prepare_run(_config(data, plan, max_steps=4, checkpoint_dir=folder + "-sigterm"),
                        world_size=1), plan, progress=False)
    finally:
        layout_run._LayoutLoop = real
    a, c = _local_params(kept["modules"][0]), _local_params(kept["modules"][2])
    report = straight.report
    # The memory the rank's parameters hold: each storage once, whole (a shard of an uneven
    # split may sit in a storage larger than its elements).
    storages = {}
    for m in kept["modules"][0]:
        for p in m.parameters():
            t = p.to_local() if hasattr(p, "to_local") else p
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    local_param_bytes = sum(storages.values())
    return {
        "straight": (straight.losses, straight.eval_losses, straight.steps),
        "resumed": (resumed.losses, resumed.eval_losses, resumed.steps),
        "first": (first.losses, first.checkpoint),
        "resumed_checkpoint": resumed.checkpoint,
        "params_equal": {n: torch.equal(a[n], c[n]) for n in a},
        "params_moved": any(not torch.equal(a[n], b)
                            for n, b in _local_params(kept["modules"][1]).items()),
        "report_peak": int(report.peak_bytes),
        "peak": straight.peak_bytes,
        "per_rank_peaks": straight.per_rank_peak_bytes,
        "report_params": int(report.peak_by_category["parameters"]),
        "local_param_bytes": local_param_bytes,
        "rank_reports": [r["peak_bytes"] for r in straight.rank_reports],
        "report_rank": report.meta["rank"],
        "eval": evals,
        "stopped": (stopped.steps, stopped.stopped_by, stopped.checkpoint, stopped.losses),
        "eval_batches": straight.eval_batches,
    }


def _eval_against_unsplit(config: TrainConfig, plan: Plan) -> tuple[float, float, int]:
    """The held-out loss of the seeded model: unsplit (:func:`evaluate`, one process's way)
    and through this rank's layout; and the held-out samples."""
    from memfit.distributed.layout import LayoutStepper, build_layout
    from memfit.train.callbacks.evaluation import evaluate
    from memfit.train.layout_eval import eval_batches, evaluate_layout
    from memfit.train.run import prepare_run
    from memfit.train.streams import map_style_batches

    run = prepare_run(config, world_size=1)
    w = run.workload
    whole, _ = w.build(seed=config.seed)
    one = evaluate(whole, map_style_batches(run.eval, w.batch_size, run.collate))
    model, _ = w.build(seed=config.seed)
    layout = build_layout(model, plan.parallel, batch_size=w.batch_size)
    split = evaluate_layout(layout, eval_batches(run.eval, w.batch_size, run.collate, w.seq_len),
                            local_batch=LayoutStepper(layout, None).local_batch)
    # A stop asked before the second batch (as a signal to any rank is: every rank gets the
    # same answer): the loss of the first batch alone, as the unsplit model has it.
    asked: list[int] = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) > 1

    first = evaluate(whole, itertools.islice(map_style_batches(run.eval, w.batch_size,
                                                               run.collate), 1))
    cut = evaluate_layout(layout, eval_batches(run.eval, w.batch_size, run.collate, w.seq_len),
                          local_batch=LayoutStepper(layout, None).local_batch, stop=stop)
    return one, split, len(run.eval), (first, cut, len(asked))


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def ranks(request, tmp_path_factory) -> tuple[list[dict], object]:
    """Each layout's two ranks, run once for the tests below (a spawn costs seconds)."""
    folder = tmp_path_factory.mktemp(request.param)
    data = folder / "data.txt"
    data.write_text(TEXT)
    out = run_ranks(_straight_then_halves, 2, LAYOUTS[request.param], str(folder / "ck"),
                    str(data), str(folder / "mem.png"), timeout=300)
    return out, folder


@pytest.mark.distributed
@pytest.mark.slow
def test_a_layout_run_resumes_bit_for_bit(ranks):
    """Four steps straight (evaluated after each), and two steps + checkpoint + resume + two
    steps (evaluated every two), on two gloo processes (a pipeline of two stages; a
    tensor-parallel pair): the same losses, the same held-out losses at steps 2 and 4, and
    every rank's parameters equal bit for bit (``torch.equal``); so neither a resume nor an
    evaluation between steps changes training. The checkpoint folders hold DCP's index and
    the manifest, and no temporary folder is left."""
    out, folder = ranks
    for rank, got in enumerate(out):
        losses, evals, steps = got["straight"]
        assert steps == 4 and len(losses) == 4 and [s for s, _ in evals] == [1, 2, 3, 4]
        # Exact floats.
        assert got["resumed"] == (losses, [e for e in evals if e[0] in (2, 4)], 4), f"rank {rank}"
        assert got["first"][0] == losses[:2]
        assert got["first"][1].endswith("step-00000002")
        assert got["resumed_checkpoint"].endswith("step-00000004")
        assert got["params_moved"]  # the second half trained: a test that can fail
        assert all(got["params_equal"].values()), got["params_equal"]
    assert out[0]["straight"][:2] == out[1]["straight"][:2]  # every rank reports the same
    ck = folder / "ck" / "step-00000004"
    assert {"manifest.json", ".metadata", "state.json"} <= {p.name for p in ck.iterdir()}
    assert not [p for p in (folder / "ck").iterdir() if p.name.startswith(".tmp")]


@pytest.mark.distributed
@pytest.mark.slow
def test_a_sigterm_to_one_process_stops_every_process_with_a_checkpoint(ranks):
    """A SIGTERM to rank 1 in step 2 of 4 (a pre-emption): both ranks stop after step 2,
    having saved it, as the Trainer does; the steps run are the straight run's."""
    out, _ = ranks
    for rank, got in enumerate(out):
        steps, by, checkpoint, losses = got["stopped"]
        assert steps == 2 and checkpoint.endswith("-sigterm/step-00000002")
        assert by == ("SIGTERM" if rank == 1 else "SIGTERM (another process)")
        assert losses == got["straight"][0][:2]


@pytest.mark.distributed
@pytest.mark.slow
def test_every_rank_reports_its_memory(ranks):
    """Every rank's memory report is its tracked peak (the one its result and the gathered
    figures give), its parameters at the peak are exactly the bytes of the parameters it holds
    (each storage once), and each rank drew its own plot beside ``--plot``'s path."""
    out, folder = ranks
    for rank, got in enumerate(out):
        assert got["report_peak"] == got["peak"] == got["per_rank_peaks"][rank] > 0
        assert got["report_params"] == got["local_param_bytes"]
        assert got["rank_reports"] == got["per_rank_peaks"] and got["report_rank"] == rank
        assert rank_plot_path(folder / "mem.png", rank).stat().st_size > 0


@pytest.mark.distributed
@pytest.mark.slow
def test_evaluation_equals_the_unsplit_models(ranks):
    """The held-out loss through the layout (the pipeline's forward-only schedule; the tensor
    pair's vocabulary-sharded loss), with the last batch padded to the step's shape, equals
    the unsplit model's :func:`evaluate` on the same samples within 1e-5 (fp32 sums in
    another order), on every rank."""
    out, _ = ranks
    for got in out:
        one, split, samples, _ = got["eval"]
        assert samples % 4  # the last batch is short: padded to the step's shape
        assert one == one  # a real loss, not NaN
        assert split == pytest.approx(one, abs=1e-5)
        # Every evaluation read the whole (small) held-out split: below eval_max_batches.
        assert got["eval_batches"] == [(s, -(-samples // 4)) for s in (1, 2, 3, 4)]


@pytest.mark.distributed
@pytest.mark.slow
def test_a_stop_ends_a_layout_evaluation_before_its_next_batch(ranks):
    """``evaluate_layout(stop=...)``, asked before each batch (the loop passes an
    ``any_rank`` of the stop flag): true before the second batch, the loss is the first
    batch's alone, as the unsplit model has it."""
    out, _ = ranks
    for got in out:
        first, cut, asked = got["eval"][3]
        assert asked == 2
        assert cut == pytest.approx(first, abs=1e-5)
        assert cut != pytest.approx(got["eval"][0], abs=1e-6)  # not the whole split's loss


# --------------------------------------------------------------------------- one process
def test_a_checkpoint_of_another_layout_is_refused_in_one_sentence():
    plan = Plan(parallel=LAYOUTS["tensor2"])
    state = {"path": "ck/step-00000002", "world_size": 2,
             "layout": _placement(Plan(parallel=LAYOUTS["pipeline2"]).parallel)}
    check_resumable(state, Plan(parallel=LAYOUTS["pipeline2"]).parallel, 2)
    with pytest.raises(CheckpointError, match=r"written under the layout data 1 x tensor 1 x "
                       r"pipeline 2 .* on 2 processes and this run is data 1 x tensor 2 x "
                       r"pipeline 1 .* on 2; resume with the plan that wrote it"):
        check_resumable(state, plan.parallel, 2)
    # Cuts place the blocks: a checkpoint of other cuts is another layout (JSON keeps lists).
    cut = Plan(parallel={**LAYOUTS["pipeline2"], "cuts": [1]}).parallel
    saved = json.loads(json.dumps({**state, "layout": _placement(cut)}))
    check_resumable(saved, cut, 2)
    with pytest.raises(CheckpointError, match=r"cuts \(1,\)"):
        check_resumable(saved, Plan(parallel=LAYOUTS["pipeline2"]).parallel, 2)
    with pytest.raises(CheckpointError, match="not written by a tensor or pipeline run"):
        check_resumable({"path": "x", "world_size": 2}, plan.parallel, 2)


def test_a_resume_is_checked_before_launch(tmp_path):
    """The latest checkpoint's layout and step are read before any process starts (no
    checksums): another layout, or no step left, is one sentence."""
    pp2, tp2 = Plan(parallel=LAYOUTS["pipeline2"]).parallel, Plan(parallel=LAYOUTS["tensor2"]).parallel
    ck = tmp_path / "step-00000002"
    ck.mkdir()
    (ck / "state.json").write_text(json.dumps({"step": 2, "world_size": 2,
                                               "layout": _placement(pp2)}))
    write_manifest(ck, 2)
    check_resume_before_launch(tmp_path, pp2, 3)
    check_resume_before_launch(tmp_path / "empty", tp2, 3)  # nothing to resume: from step 0
    with pytest.raises(CheckpointError, match="at step 2 and max_steps is 2; raise --max-steps"):
        check_resume_before_launch(tmp_path, pp2, 2)
    with pytest.raises(CheckpointError, match="written under the layout data 1 x tensor 1 x"):
        check_resume_before_launch(tmp_path, tp2, 3)


def test_layout_name_and_rank_plot_paths(tmp_path):
    assert layout_name(Plan(parallel=LAYOUTS["pipeline2"]).parallel).startswith(
        "data 1 x tensor 1 x pipeline 2 (1f1b, 2 micro-batches")
    assert rank_plot_path(tmp_path / "mem.png", 3) == tmp_path / "mem-rank3.png"


def test_a_rank_with_several_stages_keys_each_by_its_index():
    class Stage(torch.nn.Linear):
        def __init__(self, index):
            super().__init__(2, 2)
            self.stage_index = index

    one = Stage(0)
    assert rank_module([one]) is one
    both = rank_module([Stage(0), Stage(2)])
    assert sorted(n for n, _ in both.named_parameters()) == [
        "stage0.bias", "stage0.weight", "stage2.bias", "stage2.weight"]
