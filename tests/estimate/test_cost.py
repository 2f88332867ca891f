"""The cost model, term by term, on hand-made profiles whose every term is computed here."""

from __future__ import annotations

import pytest

from memfit.estimate.cost import WorkloadProfile, step_cost
from memfit.estimate.depth import extrapolate
from memfit.plan import Plan
from memfit.targets import DeviceProfile

PROFILE = WorkloadProfile(
    fwd_flops_per_sample=1e12,
    bwd_flops_per_sample=2e12,
    block_fwd_flops_per_sample=0.8e12,
    act_bytes_per_sample=1e9,
    ops_per_micro_batch=1000,
    block_ops=600,
    num_parameters=100_000_000,
    num_tensors=200,
    seq_len=128,
)
DEVICE = DeviceProfile(
    name="test",
    memory_bytes=80 * 2**30,
    flops={"fp32": 1e14, "bf16": 4e14, "fp16": 4e14},
    mem_bandwidth=2e12,
    host_bandwidth=5e10,
    launch_overhead=1e-5,
    half_tokens=128.0,
)
B = 8


def _eff(micro: int) -> float:
    tokens = micro * PROFILE.seq_len
    return tokens / (tokens + DEVICE.half_tokens)


def test_extrapolation_is_linear_in_depth():
    assert extrapolate(10.0, 13.0, 2) == 10.0
    assert extrapolate(10.0, 13.0, 24) == 10.0 + 22 * 3.0


def test_matmul_term_with_and_without_recomputation():
    plain = step_cost(PROFILE, Plan(), DEVICE, batch_size=B)
    assert plain.matmul == pytest.approx(B * 3e12 / (1e14 * _eff(B)))
    full = step_cost(PROFILE, Plan(checkpointing="full"), DEVICE, batch_size=B)
    assert full.matmul == pytest.approx(B * 3.8e12 / (1e14 * _eff(B)))  # + the blocks' forward
    selective = step_cost(PROFILE, Plan(checkpointing="selective"), DEVICE, batch_size=B)
    assert selective.matmul == pytest.approx(plain.matmul)  # keeps the matmul outputs
    mixed = step_cost(PROFILE, Plan(precision="bf16-mixed"), DEVICE, batch_size=B)
    assert mixed.matmul == pytest.approx(plain.matmul / 4)  # the bf16 rate


def test_micro_batches_derate_matmuls_and_multiply_launches():
    accum = step_cost(PROFILE, Plan(micro_batch_size=1, grad_accum_steps=8), DEVICE, batch_size=B)
    assert accum.matmul == pytest.approx(B * 3e12 / (1e14 * _eff(1)))
    assert accum.launch == pytest.approx(8 * 1000 * 1e-5)
    full = step_cost(PROFILE, Plan(checkpointing="full"), DEVICE, batch_size=B)
    assert full.launch == pytest.approx((1000 + 600) * 1e-5)  # the recomputed blocks' ops


def test_pointwise_traffic():
    plain = step_cost(PROFILE, Plan(), DEVICE, batch_size=B)
    assert plain.pointwise == pytest.approx(2 * B * 1e9 / 2e12)  # written, then read
    ckpt = step_cost(PROFILE, Plan(checkpointing="full"), DEVICE, batch_size=B)
    assert ckpt.pointwise == pytest.approx(3 * B * 1e9 / 2e12)  # and written again
    mixed = step_cost(PROFILE, Plan(precision="bf16-mixed"), DEVICE, batch_size=B)
    assert mixed.pointwise == pytest.approx(plain.pointwise / 2)  # half-size activations


def test_optimizer_term():
    foreach = step_cost(PROFILE, Plan(optimizer={"name": "adamw", "foreach": True}), DEVICE,
                        batch_size=B)
    assert foreach.optimizer == pytest.approx(1e8 * 28 / 2e12)  # bytes at bandwidth only
    looped = step_cost(PROFILE, Plan(optimizer={"name": "adamw", "foreach": False}), DEVICE,
                       batch_size=B)
    assert looped.optimizer == pytest.approx(1e8 * 28 / 2e12 + 200 * 10 * 1e-5)
    frozen = step_cost(PROFILE, Plan(optimizer={"name": "adamw", "foreach": True}), DEVICE,
                       batch_size=B, trainable_fraction=0.25)
    assert frozen.optimizer == pytest.approx(foreach.optimizer / 4)


def test_exact_clipping_in_backward_costs_one_more_backward():
    plan = Plan(optimizer_in_backward=True, max_grad_norm=1.0)
    cost = step_cost(PROFILE, plan, DEVICE, batch_size=B)
    assert cost.extra_backward == pytest.approx(B * 2e12 / (1e14 * _eff(B)) + B * 1e9 / 2e12)
    approx = step_cost(PROFILE, plan.replace(grad_clip_mode="approx"), DEVICE, batch_size=B)
    assert approx.extra_backward == 0.0
    assert cost.total == pytest.approx(
        cost.matmul + cost.pointwise + cost.launch + cost.optimizer + cost.extra_backward
    )


def test_the_deeper_half_measured_elsewhere_gives_the_same_profile():
    # The planner's worker measures the deeper shallow depth while the planner measures the
    # other: the profile is the one measured in one process (and when the other process has
    # nothing, this one measures both).
    from memfit.estimate import cost
    from memfit.workload import load_workload

    workload = load_workload("gpt2-tiny", 2, 16).with_depth(6)
    alone = cost._profile(workload, None)
    asked = []

    def deeper():
        asked.append(True)
        return cost.deeper_half(workload)

    assert cost._profile(workload, deeper) == alone and asked
    assert cost._profile(workload, lambda: None) == alone
    assert cost.deeper_half(load_workload("gpt2-tiny", 2, 16).with_depth(2)) is None


def _comm(plan: Plan, device: DeviceProfile = DEVICE, **kw) -> float:
    return step_cost(PROFILE, plan, device, batch_size=B, **kw).communication


def test_one_process_has_no_communication_and_the_same_total():
    one = step_cost(PROFILE, Plan(), DEVICE, batch_size=B)
    assert one.communication == one.bubble == 0.0
    assert one.total == pytest.approx(sum(v for k, v in one.to_dict().items() if k != "total"))


def test_the_gradient_reduction_shows_beyond_the_backward_it_overlaps():
    """2 (N - 1) / N of the fp32 gradients per rank; ZeRO 1 and 2 move as much as DDP
    (reduce-scatter, then the parameters' all-gather), ZeRO 3 half as much again."""
    from memfit.estimate.cost import DP_OVERLAP

    slow = DeviceProfile(**{**DEVICE.__dict__, "host_bandwidth": 1e8})
    backward = 2e12 * B / (1e14 * _eff(B))
    volume = 4 * 100_000_000 * 2 * 3 / 4
    stages = [_comm(Plan(parallel={"data": 4, "zero_stage": z}), slow) for z in range(4)]
    assert stages[0] == pytest.approx(volume / 1e8 - DP_OVERLAP * backward)
    assert stages[0] == stages[1] == stages[2] < stages[3]
    assert stages[3] == pytest.approx(1.5 * volume / 1e8 - DP_OVERLAP * backward)
    # Within a node at intra_node_bandwidth, across nodes at network_bandwidth.
    links = DeviceProfile(**{**slow.__dict__, "intra_node_bandwidth": 1e9,
                             "network_bandwidth": 1e7})
    plan = Plan(parallel={"data": 4})
    assert _comm(plan, links, gpus_per_node=4) < _comm(plan, links, gpus_per_node=2)
