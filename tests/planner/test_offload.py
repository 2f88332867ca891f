"""The planner's offload dimension: what ``--allow offload`` opens, how it ranks and costs."""

from __future__ import annotations

import dataclasses

import pytest

import memfit
from memfit.estimate.cost import profile_workload, step_cost
from memfit.planner.candidates import RANK_DIMENSIONS, generate, offload_options, options
from memfit.strategies.offload import OffloadConfig
from memfit.targets.profiles import get_device
from memfit.workload import load_workload

WORKLOAD = load_workload("gpt2-tiny", 4, 32)


def _keys(offloads):
    return {None if o is None else (o.optimizer, o.activations, o.parameters) for o in offloads}


def test_allow_offload_opens_optimizer_parameters_and_activations_alone_and_together():
    assert _keys(offload_options(None)) == {
        None, ("host", False, None), (None, True, None), ("host", True, None),
        ("host", False, "host"), ("host", True, "host"),
    }  # fmt: skip
    # With a disk directory the optimizer may go to disk (parameters stream from host masters).
    disk = _keys(offload_options(None, "/tmp")) - _keys(offload_options(None))
    assert disk == {("disk", False, None), ("disk", True, None)}
    # A base offload keeps its own settings in every variant.
    base = OffloadConfig(activations=True, bucket_bytes=1 << 20, activation_min_bytes=4096)
    variants = [o for o in offload_options(base) if o is not None]
    assert {o.bucket_bytes for o in variants} == {1 << 20}
    assert {o.activation_min_bytes for o in variants} == {4096}
    # The optimizer on the host keeps gradients there across micro-batches.
    assert all(o.gradients_on_host for o in variants if o.optimizer)


def test_offload_ranks_one_dimension_each():
    device = get_device("cpu")
    space = options(WORKLOAD, memfit.Plan(), ["offload"], [], device)
    assert len(space.offloads) == 6
    pairs = generate(WORKLOAD, memfit.Plan(), space, device=device)
    opt, act, par = (RANK_DIMENSIONS.index(f"offload_{k}")
                     for k in ("optimizer", "activations", "parameters"))  # fmt: skip
    for plan, rank in pairs:
        assert len(rank) == len(RANK_DIMENSIONS)
        off = plan.offload
        assert rank[opt] == int(off is not None and off.optimizer is not None)
        assert rank[act] == int(off is not None and off.activations)
        assert rank[par] == int(off is not None and off.parameters is not None)


def test_activation_offload_costs_the_trips_beyond_the_compute_they_overlap():
    profile = profile_workload(WORKLOAD)
    fast = get_device("h100")
    plan = memfit.Plan(offload={"activations": True})
    plain = step_cost(profile, memfit.Plan(), fast, batch_size=4)
    # An infinitely fast link hides the trips under forward's and backward's compute.
    hidden = dataclasses.replace(fast, host_bandwidth=float("inf"))
    assert step_cost(profile, plan, hidden, batch_size=4).offload == 0.0
    # A slow link shows them: each trip (every kept fp32 activation byte) less the compute
    # of the pass it overlaps, forward plus backward being all the matmul time here.
    slow = dataclasses.replace(fast, host_bandwidth=1e3)
    trip = profile.act_bytes_per_sample * 4 / slow.host_bandwidth
    got = step_cost(profile, plan, slow, batch_size=4)
    assert abs(got.offload - (2 * trip - plain.matmul)) <= 1e-9 * got.offload
    assert got.total > plain.total


def test_the_step_in_backward_overlaps_the_host_step_with_backward():
    profile = profile_workload(WORKLOAD)
    device = get_device("h100")
    off = {"optimizer": "host"}
    after = step_cost(profile, memfit.Plan(offload=off), device, batch_size=4)
    during = step_cost(
        profile, memfit.Plan(offload=off, optimizer_in_backward=True), device, batch_size=4
    )
    # After backward: the trip down beyond backward, the host step and the trip up in a row.
    # During: the slowest of the three beside backward.
    params = profile.num_parameters
    down = up = params * 4 / device.host_bandwidth
    host = params * (28 + 4) / device.host_mem_bandwidth
    assert during.matmul == after.matmul
    assert after.offload == pytest.approx(max(0.0, down - _bwd(profile, device)) + up + host)
    assert during.offload == pytest.approx(max(0.0, max(down, host, up) - _bwd(profile, device)))
    assert during.total < after.total


def _bwd(profile, device) -> float:
    """Backward's matmul seconds of the 4-sample fp32 step (as the cost model rates them)."""
    tokens = 4 * profile.seq_len
    rate = device.flops["fp32"] * device.matmul_efficiency * tokens / (tokens + device.half_tokens)
    return profile.bwd_flops_per_sample * 4 / rate


def test_the_explanation_says_what_moved_where_and_what_it_costs():
    from memfit.planner.explain import why_it_won
    from memfit.planner.result import Candidate

    plan = memfit.Plan(offload={"optimizer": "host", "activations": True, "gradients_on_host": True})
    winner = Candidate(plan=plan, rank=(), step_time=0.2, fits=True, device_total_bytes=1 << 30,
                       cost_terms={"offload": 0.05})  # fmt: skip
    text = why_it_won(winner, [winner], 2 << 30, get_device("h100"))
    assert "Moved off the device" in text
    assert "optimizer state live on the host" in text and "every micro-batch's" in text
    assert "tensors saved for backward wait in host memory" in text
    assert "50.0 ms per step" in text and "25% of the step" in text
    plain = Candidate(plan=memfit.Plan(), rank=(), step_time=0.1, fits=True, device_total_bytes=1)
    assert "Moved off" not in why_it_won(plain, [plain], 2, get_device("h100"))


@pytest.mark.slow
def test_a_host_budget_rules_out_the_offload_it_cannot_hold(tmp_path):
    from memfit.planner import NothingFits, plan

    forbid = ("accumulation", "checkpointing", "mixed-precision", "fused-step", "foreach-off",
              "fused-loss")  # fmt: skip
    budget = int(memfit.dry_run(WORKLOAD, memfit.Plan()).peak_bytes * 0.95)
    roomy = plan(WORKLOAD, budget, allow=["offload"], forbid=forbid, device="cpu",
                 host_budget="1GiB")  # fmt: skip
    assert roomy.fits and roomy.plan.offload is not None
    assert 0 < roomy.predicted_host_bytes <= 1 << 30
    assert roomy.to_dict()["predicted_host_bytes"] == roomy.predicted_host_bytes
    # Only offload fits the device, and no offload fits 1 KiB of host memory.
    with pytest.raises(NothingFits, match=r"fit the device but not the host budget of 1\.00 KiB"):
        plan(WORKLOAD, budget, allow=["offload"], forbid=forbid, device="cpu", host_budget="1KiB")
    with pytest.raises(ValueError, match="add --allow offload"):
        plan(WORKLOAD, budget, forbid=forbid, device="cpu", disk_dir=str(tmp_path))
    with pytest.raises(ValueError, match="not an existing directory"):
        plan(WORKLOAD, budget, allow=["offload"], device="cpu", disk_dir=str(tmp_path / "x"))


@pytest.mark.slow
def test_a_host_budget_between_the_tiers_picks_the_disk(tmp_path):
    from memfit.planner import plan

    forbid = ("accumulation", "checkpointing", "mixed-precision", "fused-step", "foreach-off",
              "fused-loss")  # fmt: skip
    budget = int(memfit.dry_run(WORKLOAD, memfit.Plan()).peak_bytes * 0.95)
    on_host = memfit.dry_run(WORKLOAD, memfit.Plan(offload={"optimizer": "host", "gradients_on_host": True}))
    on_disk = memfit.dry_run(WORKLOAD, memfit.Plan(
        offload={"optimizer": "disk", "gradients_on_host": True, "disk_dir": str(tmp_path)}))  # fmt: skip
    assert on_disk.peak_by_tier["host"] < on_host.peak_by_tier["host"]
    between = (on_disk.peak_by_tier["host"] + on_host.peak_by_tier["host"]) // 2
    result = plan(WORKLOAD, budget, allow=["offload"], forbid=forbid, device="cpu",
                  host_budget=between, disk_dir=str(tmp_path))  # fmt: skip
    assert result.fits and result.plan.offload.optimizer == "disk"
    assert result.predicted_host_bytes <= between


def test_parameter_offload_costs_two_fetches_per_micro_batch_beyond_the_compute():
    profile = profile_workload(WORKLOAD)
    slow = dataclasses.replace(get_device("h100"), host_bandwidth=1e3, host_mem_bandwidth=1e30)
    off = {"optimizer": "host"}
    without = step_cost(profile, memfit.Plan(offload=off), slow, batch_size=4)
    with_params = step_cost(profile, memfit.Plan(offload={**off, "parameters": "host"}), slow,
                            batch_size=4)  # fmt: skip
    fetch = profile.num_parameters * 4 / slow.host_bandwidth
    # One micro-batch: a fetch before forward and one before backward, less the compute they
    # overlap (forward plus backward being all the matmul time).
    assert with_params.offload - without.offload == pytest.approx(2 * fetch - without.matmul)
