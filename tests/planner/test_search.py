"""The planner: its pick against exhaustive search, composition accuracy, clear failures."""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

import memfit
from memfit.cli import app
from memfit.estimate.compose import _reduced, predict_peak
from memfit.planner import NothingFits, plan
from memfit.planner.candidates import space_pairs as _space
from memfit.planner.costing import TIE_BAND
from memfit.targets import DEVICES, parse_budget
from memfit.units import GiB

# The A100's speed for a deterministic cost model, with the memory of the CPU these tests run
# on (no caching allocator, no CUDA context): budgets here are in tensor bytes, and the winner
# is executed for real under a virtual cap.
A100_SPEED = dataclasses.replace(
    DEVICES["a100"], name="a100-speed", kind="cpu", context_bytes=0, workspace_bytes=0
)

# A GPT-2 with six blocks, small enough to run for real: deep enough to be composed from
# depth-2 and depth-3 profiles.
CONFIG = {
    "model_type": "gpt2",
    "architectures": ["GPT2LMHeadModel"],
    "n_embd": 64,
    "n_layer": 6,
    "n_head": 2,
    "vocab_size": 512,
    "n_positions": 128,
    "bos_token_id": 0,
    "eos_token_id": 0,
}


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_text(json.dumps(CONFIG))
    return memfit.load_workload(str(path), 8, 64)


@pytest.mark.parametrize(
    "p",
    [
        memfit.Plan(),
        memfit.Plan(grad_accum_steps=4),
        memfit.Plan(checkpointing="full", precision="bf16-mixed"),
        memfit.Plan(checkpointing="selective", optimizer_in_backward=True),
        memfit.Plan(grad_accum_steps=2, optimizer="adafactor", precision="bf16-pure"),
    ],
    ids=["plain", "accum", "full-bf16", "selective-fused", "accum-adafactor-pure"],
)
def test_composed_prediction_matches_a_full_dry_run(workload, p):
    pred = predict_peak(workload, p)
    assert pred.method == "composed"
    full = memfit.dry_run(workload, p, steps=2)
    # Composed from depths 2 and 3 (two micro-batches at most): equal to the byte.
    assert pred.peak_bytes == full.peak_bytes
    assert pred.by_category == dict(full.peak_by_category)


def test_reduced_accumulation_run_matches_the_full_one(workload):
    p = memfit.Plan(grad_accum_steps=8)
    small_wl, small_plan, scale = _reduced(workload, p)
    assert small_plan.grad_accum_steps == 2 and small_wl.batch_size == 2
    small = memfit.dry_run(small_wl, small_plan)
    full = memfit.dry_run(workload, p)
    by_cat = dict(small.peak_by_category)
    by_cat["inputs"] = round(by_cat["inputs"] * scale)
    assert abs(sum(by_cat.values()) - full.peak_bytes) <= 0.01 * full.peak_bytes


FORBID = ("foreach-off", "mixed-precision")  # keeps the exhaustive space small


def _cost_and_peaks(workload, result):
    """Exhaustive search: the memory of every candidate in the space, by the same predictor."""
    from memfit.estimate.cost import profile_workload, step_cost

    device = A100_SPEED
    assert result.device == device.name
    profile = profile_workload(workload)
    # On a GPU profile the planner plans for torch's GPU default, foreach AdamW.
    base = memfit.Plan(optimizer={"name": "adamw", "foreach": True})
    rows = []
    for p, _ in _space(workload, base, (), FORBID, device):
        t = step_cost(profile, p, device, batch_size=workload.batch_size).total
        rows.append((t, predict_peak(workload, p).peak_bytes, p))
    return rows


@pytest.mark.slow
def test_pick_is_the_fastest_that_fits_by_exhaustive_search_and_runs_under_the_cap(workload):
    plain = memfit.dry_run(workload, memfit.Plan()).peak_bytes
    budget = int(plain * 0.6)
    result = plan(workload, budget, device=A100_SPEED, forbid=FORBID)
    assert result.fits and result.predicted_peak_bytes <= budget
    rows = _cost_and_peaks(workload, result)
    chosen = next(t for t, _, p in rows if p == result.plan)
    # Every candidate faster than the pick by more than the cost model's tie band must be over
    # the budget: by the composed prediction, or, where that says it fits, by a full dry run.
    faster = [(peak, p) for t, peak, p in rows if t * TIE_BAND < chosen]
    for peak, p in faster:
        if peak <= budget:
            assert memfit.dry_run(workload, p).peak_bytes > budget, p.summary()
    # Executed for real under a virtual cap of the budget, it fits, and measures within 5%.
    real = memfit.measure(workload, result.plan, steps=2, cap=budget)
    assert real.peak_bytes <= budget
    assert abs(real.peak_bytes - result.predicted_peak_bytes) <= 0.05 * real.peak_bytes


def test_plan_fits_a_small_budget_and_turns_techniques_on(workload):
    plain = memfit.dry_run(workload, memfit.Plan()).peak_bytes
    result = plan(workload, int(plain * 0.6), device=A100_SPEED)
    assert result.fits
    assert result.plan != memfit.Plan()
    assert result.frontier[0] == result.plan
    d = result.to_dict()
    for key in (
        "fits",
        "plan",
        "predicted_peak_bytes",
        "predicted_peak_by_category",
        "predicted_step_time_ratio",
        "candidates",
    ):
        assert key in d
    real = memfit.measure(workload, result.plan, steps=2, cap=int(plain * 0.6))
    assert abs(real.peak_bytes - result.predicted_peak_bytes) <= 0.05 * real.peak_bytes


def test_nothing_fits_names_the_smallest_peak(workload):
    with pytest.raises(NothingFits) as info:
        plan(workload, 1000, device=A100_SPEED)
    msg = str(info.value)
    assert "smallest peak reachable" in msg and "--allow" in msg
    assert info.value.result.predicted_peak_bytes > 1000


def test_budgets():
    assert parse_budget("4GiB") == (4 * GiB, None)
    assert parse_budget("4096MiB")[0] == 4 * GiB
    size, dev = parse_budget("t4")
    # A named device budgets its whole memory: the planner fits the device total into it
    # (allocator reserve, CUDA context and workspaces included).
    assert dev is DEVICES["t4"] and size == dev.memory_bytes
    for bad, match in (("lots", "not understood"), ("0", "positive"), ("-2GiB", "not understood")):
        with pytest.raises(ValueError, match=match):
            parse_budget(bad)


def test_allow_and_forbid_are_checked(workload):
    with pytest.raises(ValueError, match="--allow value 'quantum'"):
        plan(workload, "1GiB", allow=["quantum"])
    with pytest.raises(ValueError, match="--forbid value"):
        plan(workload, "1GiB", forbid=["everything"])


runner = CliRunner()


def test_cli_plan_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    js = tmp_path / "plan.json"
    res = runner.invoke(
        app,
        [
            "plan",
            "--model",
            str(path),
            "-b",
            "8",
            "-l",
            "64",
            "--budget",
            "800MiB",
            "--device",
            "a100",
            "--json",
            str(js),
            "--save",
            str(tmp_path / "p.yaml"),
        ],
    )
    assert res.exit_code == 0, res.output
    data = json.loads(js.read_text())
    # On an A100 the device total is fitted: allocator reserve plus CUDA context.
    a100 = DEVICES["a100"]
    assert data["fits"] is True and data["target_device"] == "a100"
    assert data["predicted_device_total_bytes"] < data["predicted_device_total_upper_bytes"]
    assert data["predicted_device_total_upper_bytes"] <= 800 * 2**20
    assert data["predicted_device_total_bytes"] == (
        data["predicted_peak_reserved_bytes"] + a100.context_bytes + a100.workspaces_bytes
    )
    assert data["predicted_peak_reserved_bytes"] >= data["predicted_peak_bytes"]
    loaded = memfit.Plan.load(tmp_path / "p.yaml")
    assert loaded.to_dict() == data["plan"]
    # The saved plan applies in `memfit profile --plan`.
    res = runner.invoke(
        app,
        ["profile", "--model", str(path), "-b", "8", "-l", "64", "--dry-run", "--plan", str(js)],
    )
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--budget", "0"], "positive"),
        (["--budget", "4 parsecs"], "not understood"),
        (["--budget", "1GiB", "--allow", "magic"], "does not exist"),
        (["--budget", "1KiB"], "Nothing fits"),
        (["--model", "bert-huge", "--budget", "1GiB"], "names nothing"),
    ],
)
def test_cli_plan_bad_input(args, match):
    if "--model" not in args:
        args = ["--model", "gpt2-tiny", *args]
    res = runner.invoke(app, ["plan", "-b", "4", "-l", "16", "--device", "a100", *args])
    assert res.exit_code == 2, res.output
    assert match in res.output and "Traceback" not in res.output


@pytest.mark.slow
def test_composition_goes_one_deeper_when_the_shallowest_run_peaks_elsewhere():
    """With the step in backward, GPT-2's depth-2 optimizer phase peaks at the (large) tied
    embedding's step while deeper runs peak with the last blocks' activations alive: (2, 3)
    is not in the linear regime, (3, 4) is, and composing from it equals the full dry run."""
    from memfit.estimate.compose import _by_phase, _compose_phases

    workload = memfit.load_workload("gpt2", 8, 128)
    p = memfit.Plan(optimizer_in_backward=True)
    small, small_plan, scale = _reduced(workload, p)
    shallow = [
        _by_phase(memfit.dry_run(workload.with_depth(d).replace(batch_size=small.batch_size),
                                 small_plan, steps=2), scale)
        for d in (2, 3)
    ]  # fmt: skip
    assert _compose_phases([2, 3], shallow, [0] * workload.depth) == {}  # the premise
    composed = predict_peak(workload, p)
    full = predict_peak(workload, p, compose=False)
    assert composed.method == "composed"
    assert composed.by_category == full.by_category
    assert composed.peak_bytes == full.peak_bytes


def test_a_candidate_over_the_budget_by_its_first_forward_is_ruled_out_with_a_floor():
    from memfit.planner.predict import predict as predict_candidate
    from memfit.planner.predict import probe
    from memfit.planner.result import Candidate

    workload = memfit.load_workload("gpt2-tiny", 8, 32).with_depth(6)
    p = memfit.Plan(precision="bf16-mixed")
    target = memfit.targets.get_device("cpu")
    full = Candidate(plan=p, rank=(0,), step_time=1.0)
    predict_candidate(full, workload, target, budget_bytes=2**40)
    floored = Candidate(plan=p, rank=(0,), step_time=1.0)
    assert probe(floored, workload, target, budget_bytes=1024)
    assert floored.at_least and floored.fits is False
    assert 0 < floored.device_total_bytes <= full.device_total_bytes
    # A budget the first forward does not pass decides nothing.
    undecided = Candidate(plan=p, rank=(0,), step_time=1.0)
    assert not probe(undecided, workload, target, budget_bytes=floored.device_total_bytes)
    assert undecided.fits is None and not undecided.at_least
    # A prediction watched against that budget stops at the same point with the same floor,
    # and counts as one (with its worker, the planner makes no floor first).
    stopped = Candidate(plan=p, rank=(0,), step_time=1.0)
    assert not predict_candidate(stopped, workload, target, budget_bytes=1024)
    assert stopped.at_least and stopped.probed
    assert stopped.by_category == floored.by_category
    assert stopped.device_total_bytes == floored.device_total_bytes
    # Stopped later, it is a misfit found by a prediction, not a floor.
    later = Candidate(plan=p, rank=(0,), step_time=1.0)
    budget = (floored.device_total_bytes + full.device_total_bytes) // 2
    assert not predict_candidate(later, workload, target, budget_bytes=budget)
    assert later.at_least and not later.probed
