"""Confirmation at full depth: built from the shallow runs' traces where it can be, and equal
to the full-depth dry run."""

from __future__ import annotations

import warnings

import pytest

import memfit
from memfit.estimate.compose import confirm_peak, predict_peak


def _figures(p):
    return (p.peak_bytes, p.by_category, p.phase_peaks, p.peak_phase, p.host_bytes,
            p.device_total_bytes)  # fmt: skip


@pytest.fixture(scope="module")
def workload():
    return memfit.load_workload("gpt2-tiny", 8, 32).with_depth(6)


@pytest.mark.parametrize(
    "plan",
    [
        memfit.Plan(micro_batch_size=2, checkpointing="selective", optimizer="adafactor"),
        memfit.Plan(precision="bf16-mixed", optimizer="adamw8bit", offload={"activations": True}),
    ],
    ids=["accumulation", "activation offload"],
)
def test_confirmation_built_from_the_shallow_traces_equals_the_full_dry_run(workload, plan):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        composed = predict_peak(workload, plan)
        confirmed = confirm_peak(workload, plan, composed)
        full = predict_peak(workload, plan, compose=False)
    assert set(composed.extra["traces"]) == {2, 3}
    assert confirmed.method == "extended"
    assert full.method == "dry-run"
    assert _figures(confirmed) == _figures(full)


def test_a_caching_allocator_target_is_confirmed_by_a_dry_run(workload):
    # Which allocation each free releases decides the allocator's layout; traces built from
    # shallow ones do not carry it.
    plan = memfit.Plan(micro_batch_size=2)
    composed = predict_peak(workload, plan, device="h100")
    confirmed = confirm_peak(workload, plan, composed, device="h100")
    assert confirmed.method == "dry-run"
    assert _figures(confirmed) == _figures(predict_peak(workload, plan, compose=False, device="h100"))


def test_without_a_composed_prediction_the_full_depth_is_dry_run(workload):
    assert confirm_peak(workload, memfit.Plan()).method == "dry-run"


@pytest.mark.parametrize(
    "plan",
    [
        memfit.Plan(micro_batch_size=2, checkpointing="selective", optimizer="adafactor"),
        memfit.Plan(precision="bf16-mixed", optimizer_in_backward=True),
    ],
    ids=["accumulation", "step in backward"],
)
def test_first_forward_floor_is_the_full_depth_run_up_to_its_first_forward(workload, plan):
    from memfit.estimate.compose import _by_phase, _reduced, first_forward_peak

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        floor = first_forward_peak(workload, plan)
        small, small_plan, scale = _reduced(workload, plan)
        stopped = memfit.dry_run(small, small_plan, stop="forward")
        full = predict_peak(workload, plan, compose=False)
    forward = _by_phase(stopped, scale)["forward"]
    assert floor == {c: round(v) for c, v in forward.items()}
    assert sum(floor.values()) <= full.peak_bytes


def test_a_stopped_run_ends_with_the_first_forward():
    workload = memfit.load_workload("gpt2-tiny", 2, 16)
    full = memfit.dry_run(workload, memfit.Plan())
    stopped = memfit.dry_run(workload, memfit.Plan(), stop="forward")
    assert stopped.meta["stopped"] == "forward"
    assert 0 < stopped.num_ops < full.num_ops
    assert stopped.phase_peaks["forward"] > 0
    assert stopped.phase_peaks["backward"] == stopped.phase_peaks["optimizer"] == 0
    with pytest.raises(ValueError, match="stop must be"):
        memfit.dry_run(workload, memfit.Plan(), stop="backward")


def test_a_run_over_the_budget_stops_at_the_first_forward_that_shows_it(workload):
    from memfit.estimate.compose import _by_phase, _reduced

    plan = memfit.Plan(micro_batch_size=2, optimizer="adafactor")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = predict_peak(workload, plan)
        small, small_plan, scale = _reduced(workload, plan)

        def full_depth_until(k):  # the full-depth run stopped at its k-th forward's end
            seen = []
            report = memfit.dry_run(
                small, small_plan, at_forward_end=lambda t: seen.append(1) or len(seen) > k
            )
            return max(sum(c.values()) for c in _by_phase(report, scale).values() if c)

        prefixes = [full_depth_until(k) for k in range(4)]
        budget = (prefixes[0] + prefixes[-1]) // 2  # passed after the first forward
        floor = predict_peak(workload, plan, budget_bytes=budget)
    assert floor.method == "at-least"
    first_over = next(p for p in prefixes if p > budget)
    assert abs(floor.peak_bytes - first_over) <= 8  # each category rounded
    assert budget < floor.peak_bytes <= full.peak_bytes
    # A budget the run never passes changes nothing.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        same = predict_peak(workload, plan, budget_bytes=full.peak_bytes)
    assert same.method == "composed" and _figures(same) == _figures(full)


def test_a_depth_3_run_watched_with_marks_handed_in_stops_where_predict_peak_would(workload):
    # The planner's worker watches its depth-3 run with the depth-2 run's marks, made in the
    # planner's process and appended to its own watch: it stops where predict_peak's own
    # watch stops, with the same floor.
    from memfit.estimate.compose import budget_watch, floor_prediction, shallow_report
    from memfit.targets import get_device

    plan = memfit.Plan(micro_batch_size=2, optimizer="adafactor")
    target = get_device("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = predict_peak(workload, plan)
        budget = full.peak_bytes * 3 // 4
        alone = predict_peak(workload, plan, budget_bytes=budget)
        assert alone.method == "at-least"
        here = budget_watch(workload, plan, target, budget)
        shallow_report(workload, plan, 2, at_forward_end=here.mark)
        assert len(here.marks) == 4  # one per forward (2 steps x 2 micro-batches)
        there = budget_watch(workload, plan, target, budget)
        there.marks.extend(here.marks)
        stopped = shallow_report(workload, plan, 3, at_forward_end=there.check)
    assert stopped.meta["stopped"] and there.floor is not None
    got = floor_prediction(there.floor, target, there.stopped_at)
    assert _figures(got) == _figures(alone) and got.method == "at-least"
    assert got.extra == alone.extra  # (the forward it stopped at)
    # Without marks the check lets the run go on: no budget, or a plan with no watch.
    assert budget_watch(workload, plan, target, None) is None
    assert budget_watch(workload, plan.replace(checkpointing="sqrt"), target, budget) is None


@pytest.mark.parametrize("device", ["cpu", "a100"])
def test_known_shallow_reports_give_the_same_prediction(workload, device, monkeypatch):
    # The planner's worker runs the depth-3 run while the planner runs depth 2: handed in as
    # known reports, the prediction (and the confirmation built from its traces) is the one
    # made in one process, and the known depths are not run again.
    from memfit.estimate import compose
    from memfit.estimate.compose import composes, shallow_report

    plan = memfit.Plan(micro_batch_size=2, checkpointing="selective", optimizer="adafactor")
    assert composes(workload, plan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        alone = predict_peak(workload, plan, device=device)
        known = {3: shallow_report(workload, plan, 3, device=device)}
        here = []
        run = compose.dry_run
        monkeypatch.setattr(
            compose, "dry_run", lambda wl, *a, **k: here.append(wl.depth) or run(wl, *a, **k)
        )
        helped = predict_peak(workload, plan, device=device, known_reports=known)
        assert here == [2]  # depth 3 was known
        known[2] = shallow_report(workload, plan, 2, device=device)
        here.clear()
        both = predict_peak(workload, plan, device=device, budget_bytes=1, known_reports=known)
        assert here == []  # (known reports are not watched again)
        monkeypatch.undo()
    assert _figures(helped) == _figures(alone) == _figures(both)
    assert helped.reserved_bytes == alone.reserved_bytes
    if device == "cpu":
        assert _figures(confirm_peak(workload, plan, helped)) == _figures(
            confirm_peak(workload, plan, alone)
        )
    assert not composes(workload, plan.replace(checkpointing="sqrt"))
