"""The planner and ``precision: fp8``: tried only with ``--allow fp8`` on targets with float8
matmuls (compute capability 8.9+, or this CPU); an fp8 base plan elsewhere is refused with one
sentence (exit 2 from the CLI); the cost model charges eager fp8's measured slowdown."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memfit.cli import app
from memfit.estimate.cost import FP8_EAGER_SLOWDOWN, profile_workload, step_cost
from memfit.plan import Plan
from memfit.planner.candidates import options, space_pairs
from memfit.planner.search import plan
from memfit.targets import get_device
from memfit.workload import load_workload

pytest.importorskip("torchao.float8")
WORKLOAD = load_workload("llama-tiny", 2, 32)
FORBID = ("accumulation", "checkpointing", "fused-step", "foreach-off", "fused-loss")
runner = CliRunner()
ENV = {"COLUMNS": "1000", "NO_COLOR": "1"}


@pytest.mark.parametrize(
    ("device", "tried"),
    [("h100", True), ("h200", True), ("rtx4090", True), ("cpu", True), ("a100", False),
     ("t4", False)],
)
def test_fp8_is_an_option_only_where_allowed_and_supported(device, tried):
    target = get_device(device)
    allowed = options(WORKLOAD, Plan(), ["fp8"], FORBID, target)
    assert ("fp8" in allowed.precisions) is tried
    assert "fp8" not in options(WORKLOAD, Plan(), [], FORBID, target).precisions


def test_fp8_ranks_below_fp32_and_apart_from_autocast():
    ranks = {
        p.precision.mode: rank[2:4]
        for p, rank in space_pairs(WORKLOAD, Plan(), ["fp8"], FORBID, get_device("h100"))
        if not p.optimizer_in_backward
    }
    # (weights and gradients, activations): higher keeps less.
    assert ranks["fp8"][0] > ranks["bf16-mixed"][0] and ranks["fp8"][1] < ranks["bf16-mixed"][1]
    assert all(a >= b for a, b in zip(ranks["fp8"], ranks["fp32"], strict=True))


def test_cost_model_charges_eager_fp8_on_the_matmuls():
    profile = profile_workload(WORKLOAD)
    h100 = get_device("h100")
    fp8 = step_cost(profile, Plan(precision="fp8"), h100, batch_size=2)
    bf16 = step_cost(profile, Plan(precision="bf16-mixed"), h100, batch_size=2)
    assert fp8.matmul == pytest.approx(bf16.matmul * FP8_EAGER_SLOWDOWN)
    compiled = step_cost(profile, Plan(precision="fp8", compile=True), h100, batch_size=2)
    assert compiled.matmul == pytest.approx(
        step_cost(profile, Plan(precision="bf16-mixed", compile=True), h100, batch_size=2).matmul
    )


def test_search_on_a100_never_picks_fp8():
    result = plan(WORKLOAD, "a100", allow=["fp8"], device="a100", forbid=FORBID)
    assert result.plan.precision.mode != "fp8"
    assert all(c.plan.precision.mode != "fp8" for c in result.candidates)


def test_fp8_base_plan_on_t4_is_refused():
    with pytest.raises(ValueError, match=r"^t4 \(compute capability 7\.5\) has no float8"):
        plan(WORKLOAD, "t4", base=Plan(precision="fp8"), device="t4")


def test_cli_plan_with_fp8_on_t4_exits_2_with_one_sentence(tmp_path):
    saved = tmp_path / "plan.json"
    saved.write_text(json.dumps({"precision": "fp8"}))
    for command in (["plan", "--budget", "t4"], ["profile", "--dry-run", "--device", "t4"]):
        args = [*command, "--model", "llama-tiny", "-b", "2", "-l", "32", "--plan", str(saved)]
        res = runner.invoke(app, args, env=ENV)
        assert res.exit_code == 2, res.output
        errors = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in res.output
        assert "compute capability 8.9 or newer" in errors[0]


def test_cli_plan_allow_fp8_on_a100_never_picks_it(tmp_path):
    out = tmp_path / "answer.json"
    args = ["plan", "--model", "llama-tiny", "-b", "2", "-l", "32", "--budget", "a100",
            "--allow", "fp8", "--json", str(out)]
    res = runner.invoke(app, args, env=ENV)
    assert res.exit_code == 0, res.output
    assert "fp8" not in json.dumps(json.loads(out.read_text()))
    assert "fp8" in runner.invoke(app, ["plan", "--help"], env=ENV).output


def test_search_picks_fp8_when_only_it_fits():
    import memfit

    # On llama-tiny fp8 keeps less than fp32 (its linears save bf16 inputs) and less than
    # bf16-mixed (no bf16 weight copies); with the other savings ruled out, a budget between
    # fp8's peak and fp32's is met by fp8 alone.
    forbid = (*FORBID, "mixed-precision")
    fp32 = memfit.dry_run(WORKLOAD, Plan(), device="cpu").peak_bytes
    fp8 = memfit.dry_run(WORKLOAD, Plan(precision="fp8"), device="cpu").peak_bytes
    budget = (fp32 + fp8) // 2
    result = plan(WORKLOAD, budget, allow=["fp8"], forbid=forbid, device="cpu")
    assert result.fits and result.plan.precision.mode == "fp8"
    with pytest.raises(memfit.NothingFits):
        plan(WORKLOAD, budget, forbid=forbid, device="cpu")


@pytest.mark.parametrize(("device", "hinted"), [("h100", True), ("a100", False)])
def test_nothing_fits_hints_fp8_only_where_it_runs(device, hinted):
    import memfit

    budget = get_device(device).overhead_bytes + 2**20  # 1 MiB of tensors: nothing fits
    with pytest.raises(memfit.NothingFits) as info:
        plan(WORKLOAD, budget, forbid=FORBID, device=device)
    hint = str(info.value).split("allowing ", 1)[1]
    assert ("fp8" in hint) is hinted, hint
