"""The Plan: its dict keys, JSON/YAML round trips, and fail-fast validation."""

from __future__ import annotations

import json

import pytest

from memfit import Plan, PlanError


def test_dict_has_the_documented_keys_and_nulls():
    d = Plan().to_dict()
    for key in (
        "micro_batch_size",
        "grad_accum_steps",
        "checkpointing",
        "precision",
        "optimizer",
        "optimizer_in_backward",
        "freeze",
        "max_seq_len",
        "offload",
    ):
        assert key in d
    assert d["freeze"] == [] and d["max_seq_len"] is None and d["offload"] is None


def test_short_forms_and_round_trips(tmp_path):
    plan = Plan(
        micro_batch_size=2,
        grad_accum_steps=4,
        checkpointing="selective",
        precision="bf16-mixed",
        optimizer={"name": "adamw8bit", "lr": 3e-4},
        freeze=["embeddings"],
        max_seq_len=64,
    )
    assert plan.checkpointing.mode == "selective" and plan.freeze == ("embeddings",)
    assert Plan.from_dict(plan.to_dict()) == plan
    plan.to_json(tmp_path / "p.json")
    plan.to_yaml(tmp_path / "p.yaml")
    assert Plan.load(tmp_path / "p.json") == plan
    assert Plan.load(tmp_path / "p.yaml") == plan
    assert "micro-batch 2 x 4" in plan.summary() and "max length 64" in plan.summary()


def test_offload_config_round_trips_and_refuses_bad_values(tmp_path):
    plan = Plan(offload={"optimizer": "host", "activations": True})
    assert plan.offload.optimizer == "host" and plan.offload.activations
    assert Plan.from_dict(json.loads(plan.to_json())) == plan
    assert Plan(offload="host").offload.optimizer == "host"
    data = plan.to_dict()["offload"]
    assert {"optimizer", "parameters", "activations", "disk_dir"} <= set(data)
    for bad, match in [
        ({"optimizer": "gpu"}, "offload optimizer must be null, 'host' or 'disk'"),
        ({"optimizer": "disk"}, "needs disk_dir"),
        ({"parameters": "disk", "optimizer": "host", "disk_dir": str(tmp_path)},
         "offload parameters to 'disk' is not available yet"),
        ({"parameters": "host"}, "offload parameters needs optimizer offload"),
        ({}, "offload moves nothing"),
        ({"optimizer": "host", "bucket_bytes": 0}, "bucket_bytes must be"),
        ({"activations": True, "host_bytes": 10}, "host_bytes must be at least"),
        ({"optimizer_state": True}, "has no field 'optimizer_state'"),
    ]:
        with pytest.raises(PlanError, match=match):
            Plan(offload=bad)
    with pytest.raises(PlanError, match="cannot be combined with fp16-mixed"):
        Plan(offload="host", precision="fp16-mixed")
    assert Plan(offload=None).to_dict()["offload"] is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"grad_accum_steps": 0}, "grad_accum_steps"),
        ({"micro_batch_size": -1}, "micro_batch_size"),
        ({"checkpointing": "sometimes"}, "checkpointing mode"),
        ({"checkpointing": "budget"}, "budget_bytes"),
        ({"precision": "fp4"}, "precision"),  # fp8 is a mode (torchao float8)
        ({"optimizer": "adamax"}, "optimizer 'adamax' is not known"),
        ({"optimizer_in_backward": True, "precision": "fp16-mixed"}, "bf16"),
        (
            {"optimizer_in_backward": True, "max_grad_norm": 1.0, "grad_accum_steps": 2},
            "approx",
        ),
        ({"grad_clip_mode": "roughly"}, "grad_clip_mode"),
        ({"max_seq_len": 0}, "max_seq_len"),
    ],
)
def test_impossible_plans_fail_when_built(kwargs, match):
    with pytest.raises(PlanError, match=match):
        Plan(**kwargs)


def test_unknown_keys_name_the_known_ones(tmp_path):
    with pytest.raises(PlanError, match=r"unknown key 'grad_acum_steps'.*grad_accum_steps"):
        Plan.from_dict({"grad_acum_steps": 2})
    with pytest.raises(PlanError, match="has no field 'modes'"):
        Plan.from_dict({"checkpointing": {"modes": "full"}})
    bad = tmp_path / "bad.yaml"
    bad.write_text("grad_accum_steps: [unclosed\n")
    with pytest.raises(PlanError, match="cannot be parsed"):
        Plan.load(bad)
    with pytest.raises(PlanError, match="does not exist"):
        Plan.load(tmp_path / "missing.json")


def test_plan_json_written_by_memfit_plan_is_accepted(tmp_path):
    import json

    path = tmp_path / "answer.json"
    path.write_text(json.dumps({"fits": True, "plan": Plan(grad_accum_steps=2).to_dict()}))
    assert Plan.load(path).grad_accum_steps == 2


def test_memfit_plan_is_the_planner_and_names_the_plan_class():
    import importlib

    import memfit

    importlib.import_module("memfit.plan")  # importing the submodule must not rebind the name
    assert callable(memfit.plan) and memfit.plan.__module__ == "memfit"
    assert memfit.plan.Plan is memfit.Plan is Plan
    assert memfit.plan.PlanError is PlanError


def test_a_plan_spreads_over_processes_once():
    one = Plan(optimizer="adamw")
    four = one.over_processes(4)
    assert four.parallel.data == 4 and four.replace(parallel=one.parallel) == one
    assert four.over_processes(4) is four
    staged = Plan(parallel={"zero_stage": 2}).over_processes(8)
    assert (staged.parallel.data, staged.parallel.zero_stage) == (8, 2)
    with pytest.raises(PlanError, match="the plan is for 4 processes but 2 were started"):
        four.over_processes(2)


def test_pipeline_cuts_round_trip_and_name_the_stages(tmp_path):
    plan = Plan(parallel={"tensor": 8, "pipeline": 4, "cuts": [30, 62, 94]})
    assert plan.parallel.cuts == (30, 62, 94)
    assert json.loads(plan.to_json())["parallel"]["cuts"] == [30, 62, 94]
    assert Plan.from_dict(json.loads(plan.to_json())) == plan
    plan.to_yaml(tmp_path / "p.yaml")
    assert Plan.load(tmp_path / "p.yaml") == plan
    assert "cut at blocks 30, 62, 94" in plan.summary()
    assert Plan().to_dict()["parallel"]["cuts"] == []  # even: the default
    # Two stages per rank: an interleaved pipeline of 2 ranks has 4 stages, 3 cuts.
    assert Plan(parallel={"pipeline": 2, "schedule": "interleaved-1f1b", "microbatches": 4,
                          "cuts": [2, 4, 6]}).parallel.num_stages == 4


@pytest.mark.parametrize(("cuts", "match"), [
    ([3, 2, 5], r"parallel cuts \[3, 2, 5\] must be 3 strictly increasing block indices >= 1"),
    ([0, 2, 5], r"must be 3 strictly increasing"),
    ([2, 5], r"must be 3 strictly increasing block indices >= 1 \(the first block of each"),
    ([2, "x", 5], r"must be 3 strictly increasing"),
    ("2,5,7", r"parallel cuts must be a tuple of block indices \(a list in JSON\) or empty"),
])
def test_bad_cuts_are_refused_in_one_sentence(cuts, match):
    with pytest.raises(PlanError, match=match):
        Plan(parallel={"pipeline": 4, "cuts": cuts})


def test_cuts_without_a_pipeline_are_refused():
    with pytest.raises(PlanError, match=r"parallel cuts \[2\] need a pipeline"):
        Plan(parallel={"cuts": [2]})
