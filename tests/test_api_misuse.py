"""The Python API under misuse (issue 37): a wrong argument to a public function is memfit's
own error (a :class:`memfit.MemfitError`, typed ``TypeError``/``ValueError`` for arguments)
with one sentence naming the argument, never an ``AttributeError``/``TypeError``/``KeyError``
from memfit's insides, and never a silent misreading.

The first half draws wrong values (hypothesis) for the arguments of every public function and
constructor; the second half pins each misuse the issue listed.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

import memfit
from memfit import MemfitError, MemfitStateError, MemfitTypeError, MemfitValueError, Plan
from tests.models import MSEModel, mlp

SPEC = "tests.models:mlp_workload"
WL = memfit.load_workload(SPEC, 4, 8)

# Text that names no file, module or hub repository: no "/" (a hub id would go to the
# network), no ":" (module:function would import whatever module the text names).
_TEXT = st.text(alphabet="abcxyz019 .,-_GiBMK", max_size=10)
#: Wrong (or at best unusual) values of every kind a caller might pass by mistake. Numbers
#: stay small: a count drawn valid (steps=3) must not start a long run.
WRONG = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.floats(-10, 10),
    st.sampled_from([float("nan"), float("inf"), -0.0, 4.5, 1e-3]),
    _TEXT,
    st.sampled_from(["", "x", "4GiB", "4.5", "-1", "cpu", "meta", "8bit", "lora,qlora",
                     "gpt2-tiny", "adam", "bf16", "full", "exact"]),
    st.lists(st.one_of(st.integers(-2, 2), _TEXT), max_size=3),
    st.tuples(st.integers(-2, 2)),
    st.dictionaries(_TEXT, st.integers(-2, 2), max_size=2),
    st.builds(object),
    st.builds(lambda: nn.Linear(2, 2)),
    st.builds(lambda: torch.zeros(2)),
)

PROPERTY = settings(max_examples=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


#: Each public callable with arguments that work (cheap: a tiny MLP workload, one step),
#: built fresh per call since some change their model. A drawn value replaces one or two.
#: ``plan`` is the exception: its SPEC comes without sizes, so every call stops at the
#: argument checks and no search runs (a search takes seconds; tests/planner has those).
BASELINES: dict[str, tuple[Callable[..., Any], Callable[[], dict[str, Any]]]] = {
    "parse_size": (memfit.parse_size, lambda: {"text": "4GiB"}),
    "format_bytes": (memfit.format_bytes, lambda: {"n": 1024, "precision": 2}),
    "load_workload": (memfit.load_workload,
                      lambda: {"spec": SPEC, "batch_size": 4, "seq_len": 8}),
    "track": (memfit.track,
              lambda: {"model": mlp(), "optimizer": None, "device": "cpu", "cap": "1GiB"}),
    "MemoryTracker": (memfit.MemoryTracker,
                      lambda: {"model": mlp(), "optimizer": None, "device": None, "cap": None}),
    "dry_run": (memfit.dry_run, lambda: dict(
        workload=WL, plan=Plan(), steps=1, cap=None, seed=0, batch_size=4, seq_len=8,
        device=None, progress=None, expert_load=1.0, stop=None, at_forward_end=None,
        should_stop=None)),
    "measure": (memfit.measure, lambda: dict(
        workload=WL, plan=Plan(), steps=1, dry=False, cap=None, seed=0, batch_size=4,
        seq_len=8, device=None, progress=None, expert_load=1.0, stop=None,
        at_forward_end=None, keep_trace=False, should_stop=None)),
    "predict_job": (memfit.predict_job, lambda: dict(
        workload=WL, plan=Plan(), device="cpu", seed=0, batch_size=4, seq_len=8,
        expert_load=1.0)),
    "measure_job": (memfit.measure_job, lambda: dict(
        workload=WL, plan=Plan(), seed=0, batch_size=4, seq_len=8)),
    "apply_plan": (memfit.apply_plan, lambda: dict(
        model=mlp(), plan=Plan(), optimizer=None, loss_fn=None, keep_original_weights=False)),
    "prepare": (memfit.prepare, lambda: dict(
        model=mlp(), plan=Plan(), optimizer=None, loss_fn=None, keep_original_weights=False)),
    "Prepared": (memfit.Prepared, lambda: {"setup": memfit.apply_plan(mlp())}),
    "optimizer_in_backward": (memfit.optimizer_in_backward, lambda: dict(
        model=mlp(), optimizer_factory=_sgd, grad_accum_steps=1, max_grad_norm=None,
        clip_mode="exact", track_grad_norm=False)),
    "plan": (memfit.plan, lambda: dict(
        workload=SPEC, budget="1MiB", world_size=None, gpus_per_node=None, batch_size=None,
        seq_len=None, allow=(), forbid=(), base=None, device="cpu", max_predictions=1,
        progress=None, host_budget=None, disk_dir=None, jobs=1, lora_rank=None,
        expert_load=1.0)),
    "Plan": (Plan, lambda: {}),
    "Plan.from_dict": (lambda **kw: Plan.from_dict(kw), lambda: {}),
    "TrainConfig": (memfit.TrainConfig, lambda: {}),
    "Trainer": (memfit.Trainer, lambda: dict(
        workload_or_model=WL, plan=Plan(), train_data=None, config=None, max_steps=1,
        batch_size=None, seed=None, cap=None, fallback_plans=None, progress=False,
        loss_fn=None, collate_fn=None, on_step=None, callbacks=(), report_png=None)),
}

#: The public callables of ``memfit.__all__`` left out above, and why.
NOT_DRAWN = {
    # Errors, and result records that only memfit builds (plain dataclasses, no checks to
    # reach): MemoryReport, PlanResult, JobPhases, TrainingSetup, Workload.
    "NothingFits", "PlanError", "WorkloadError", "MemfitError", "MemfitTypeError",
    "MemfitValueError", "MemfitStateError", "MemoryReport", "PlanResult", "JobPhases",
    "TrainingSetup", "Workload", "Maximized",
    # A search per call, over several sizes (seconds to minutes): its argument errors are
    # tested in tests/planner/test_maximize.py and tests/commands/test_plan_maximize.py.
    "maximize",
}


def _names(fn: Callable[..., Any], base: dict[str, Any]) -> list[str]:
    """The argument names a draw may replace: the baseline's, or a dataclass's fields."""
    if base:
        return sorted(base)
    fields = getattr(fn, "__dataclass_fields__", None) or Plan.__dataclass_fields__
    return sorted(fields)


def _call(name: str, overrides: dict[str, Any]) -> None:
    fn, baseline = BASELINES[name]
    kwargs = {**baseline(), **overrides}
    try:
        fn(**kwargs)
    except MemfitError as e:
        assert str(e).strip(), f"{name}: {type(e).__name__} without a message"
    except torch.OutOfMemoryError:
        # A drawn cap that the run exceeds: the documented outcome of a virtual cap.
        assert "cap" in overrides, f"{name} ran out of memory without a cap"


def test_every_public_callable_is_drawn_or_named_as_left_out():
    callables = {n for n in memfit.__all__ if callable(getattr(memfit, n))}
    assert callables - NOT_DRAWN - set(BASELINES) == set()
    assert inspect.signature(memfit.plan).parameters.keys() == BASELINES["plan"][1]().keys()


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_the_baselines_work(name):
    fn, baseline = BASELINES[name]
    if name == "plan":
        with pytest.raises(MemfitValueError, match="batch_size and seq_len"):
            fn(**baseline())  # by design: the checks end at the SPEC's missing sizes
    else:
        fn(**baseline())


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BASELINES))
@PROPERTY
@given(data=st.data())
def test_wrong_arguments_are_memfits_own_errors(name, data):
    fn, baseline = BASELINES[name]
    names = _names(fn, baseline())
    keys = data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=2, unique=True))
    overrides = {k: data.draw(WRONG, label=k) for k in keys}
    if name == "plan":
        # Both sizes valid would start a search on the SPEC; the search is tests/planner's.
        assume(not all(isinstance(overrides.get(k), int) and not isinstance(
            overrides.get(k), bool) and overrides[k] >= 1 for k in ("batch_size", "seq_len")))
    _call(name, overrides)


@PROPERTY
@given(value=WRONG)
def test_plan_from_anything_is_a_plan_or_a_plan_error(value):
    with contextlib.suppress(MemfitError):
        Plan.from_dict(value)


# ---------------------------------------------------------------------------------------
# The misuses of issue 37, one by one: the exact error type, and a message naming the
# argument.


def test_plan_of_none_is_a_type_error_naming_the_workload():
    with pytest.raises(MemfitTypeError, match=r"^workload must be a memfit\.Workload.*got None"):
        memfit.plan(None, "1GiB")


def test_plan_of_a_bare_module_says_to_wrap_it_in_a_workload():
    with pytest.raises(MemfitTypeError, match=r"workload .*got a Sequential.*memfit\.Workload"):
        memfit.plan(nn.Sequential(nn.Linear(2, 2)), "1GiB")


def test_plan_with_a_numeric_device_is_a_type_error_naming_device():
    with pytest.raises(MemfitTypeError, match=r"^device must be .*got 123 \(an int\)"):
        memfit.plan(WL, "1GiB", device=123)


def test_plan_with_a_string_base_says_a_precision_goes_in_a_plan():
    with pytest.raises(MemfitTypeError, match=r"^base must be a memfit\.Plan.*precision="):
        memfit.plan(WL, "1GiB", base="bf16")


def test_a_fractional_budget_is_refused_not_truncated():
    # Read as 4 bytes, it used to start a 37 s search for a plan in 4 bytes.
    with pytest.raises(MemfitValueError, match=r"^budget 4\.5 is not a whole number of bytes"):
        memfit.plan(WL, 4.5)
    with pytest.raises(MemfitValueError, match="not a whole number of bytes"):
        memfit.parse_size("4.5")
    assert memfit.parse_size("4.5GiB") == int(4.5 * 2**30)  # with a unit, fractions are fine
    assert memfit.parse_size(4.0) == 4 and memfit.parse_size(2**60 + 1) == 2**60 + 1


def test_allow_takes_a_string_or_a_list_as_the_cli_does():
    from memfit.planner.arguments import check_plan_arguments

    def allowed(value: Any) -> tuple[str, ...]:
        settings = check_plan_arguments(**{**BASELINES["plan"][1](), "batch_size": 4,
                                           "seq_len": 8, "allow": value})
        return settings["allow"]

    assert allowed("8bit") == ("8bit",)  # once split into '8', 'b', 'i', 't'
    assert allowed("lora,qlora") == allowed(["lora", "qlora"]) == ("lora", "qlora")
    assert allowed(["8bit", "offload,freeze"]) == ("8bit", "offload", "freeze")
    with pytest.raises(MemfitValueError, match=r"^--allow value 'teleport' does not exist; "
                                               r"use one or more of .*8bit"):
        memfit.plan(WL, "1GiB", allow="8bit,teleport")
    with pytest.raises(MemfitTypeError, match=r"^--forbid must be a name or a list"):
        memfit.plan(WL, "1GiB", forbid=7)


def test_plan_of_a_spec_without_sizes_is_refused_naming_them():
    with pytest.raises(MemfitValueError, match=r"SPEC.*give batch_size and seq_len"):
        memfit.plan(SPEC, "1GiB")
    with pytest.raises(MemfitValueError, match=r"give seq_len \("):
        memfit.plan(SPEC, "1GiB", batch_size=4)


def test_track_of_a_string_is_a_type_error_naming_the_model():
    with pytest.raises(MemfitTypeError, match=r"^model must be an nn\.Module or None, got 'x'"):
        memfit.track("x")


def test_track_with_an_optimizer_name_is_refused():
    with pytest.raises(MemfitTypeError, match=r"^optimizer must be a torch\.optim\.Optimizer"):
        memfit.track(mlp(), "adam")
    with pytest.raises(MemfitTypeError, match="optimizer"):
        memfit.track(mlp(), [torch.optim.SGD(mlp().parameters(), lr=0.1), "adam"])


def test_track_parses_a_size_cap_and_enforces_it():
    assert memfit.track(mlp(), cap="4GiB").cap == 4 * 2**30
    assert memfit.track(mlp(), cap=0).cap == 0
    model = mlp()
    with pytest.raises(torch.OutOfMemoryError, match="cap"), memfit.track(model, cap="1KiB"):
        model(torch.randn(64, 16)).sum().backward()


@pytest.mark.parametrize(("cap", "error", "match"), [
    (-1, MemfitValueError, r"^cap must be a number of bytes >= 0.*got -1"),
    ("lots", MemfitValueError, r"^cap: size 'lots' is not understood"),
    (4.5, MemfitValueError, r"^cap: size 4\.5 is not a whole number"),
    ([1], MemfitTypeError, r"^cap must be a number of bytes"),
])
def test_track_refuses_a_bad_cap(cap, error, match):
    with pytest.raises(error, match=match):
        memfit.track(mlp(), cap=cap)


def test_track_with_an_unknown_device_names_it():
    with pytest.raises(MemfitValueError, match=r"^device 'gpu0' is not a device torch knows"):
        memfit.track(mlp(), device="gpu0")
    with pytest.raises(MemfitTypeError, match=r"^device must be a torch\.device"):
        memfit.track(mlp(), device=[0])


def test_report_before_the_block_says_so():
    tracker = memfit.track(mlp())
    with pytest.raises(MemfitStateError, match=r"^report\(\) was called before the tracker's"):
        tracker.report()
    model = mlp()
    with memfit.track(model) as tracker:
        model(torch.randn(4, 16)).sum().backward()
        inside = tracker.report()  # inside the block: what was recorded so far
    assert inside.peak_bytes > 0
    assert tracker.report().peak_bytes >= inside.peak_bytes


def test_prepare_of_a_meta_model_is_refused_before_anything_applies():
    with torch.device("meta"):
        model = mlp()
    with pytest.raises(MemfitValueError, match=r"^model has its weights on the meta device"):
        memfit.prepare(model, Plan(checkpointing="full"))
    assert all(p.requires_grad and p.is_meta for p in model.parameters())


def test_a_batch_smaller_than_the_accumulation_is_refused():
    prepared = memfit.prepare(MSEModel(), Plan(grad_accum_steps=4))
    small = {"x": torch.randn(2, 16), "y": torch.randn(2, 8)}
    with pytest.raises(MemfitValueError,
                       match=r"^batch of 2 samples is smaller than the plan's grad_accum_steps=4"):
        prepared.step(small)
    assert prepared.setup.steps_done == 0
    prepared.step({"x": torch.randn(4, 16), "y": torch.randn(4, 8)})  # four micro-batches of 1
    assert prepared.setup.steps_done == 1
    # A fixed micro-batch takes any batch: its count follows the batch.
    memfit.prepare(MSEModel(), Plan(grad_accum_steps=4, micro_batch_size=1)).step(small)


def test_a_trainer_batch_smaller_than_the_accumulation_is_refused():
    with pytest.raises(MemfitValueError, match=r"batch of 4 samples .*grad_accum_steps=8"):
        memfit.Trainer(WL, Plan(grad_accum_steps=8), progress=False)
    with pytest.raises(MemfitValueError, match=r"batch of 2 samples"):
        memfit.Trainer(WL, Plan(grad_accum_steps=4), batch_size=2, progress=False)


@pytest.mark.parametrize(("call", "error", "match"), [
    (lambda: memfit.dry_run(None), MemfitTypeError, r"^workload must be"),
    (lambda: memfit.measure(WL, "bf16"), MemfitTypeError, r"^plan must be a memfit\.Plan"),
    (lambda: memfit.dry_run(WL, steps=0), MemfitValueError, r"^steps must be a whole number"),
    (lambda: memfit.measure(WL, seed="x"), MemfitTypeError, r"^seed must be a whole number"),
    (lambda: memfit.dry_run(WL, progress=mlp()), MemfitTypeError, r"^progress must be a "),
    (lambda: memfit.predict_job(WL, device=3), MemfitTypeError, r"^device must be"),
    (lambda: memfit.measure_job(WL, batch_size=1.5), MemfitValueError, r"^batch_size must be"),
    (lambda: memfit.load_workload(None), MemfitTypeError, r"^spec must be a SPEC"),
    (lambda: memfit.format_bytes("1GiB"), MemfitTypeError, r"^format_bytes takes a number"),
    (lambda: memfit.optimizer_in_backward(mlp(), "adamw"), MemfitTypeError,
     r"^optimizer_factory must be a function"),
    (lambda: memfit.prepare(mlp(), keep_original_weights="yes"), MemfitTypeError,
     r"^keep_original_weights must be True or False"),
    (lambda: memfit.Trainer("gpt2-tiny"), MemfitTypeError, r"Trainer needs a Workload"),
    (lambda: memfit.Trainer(WL, callbacks=[print]), MemfitTypeError, r"^callbacks must be"),
    (lambda: memfit.Plan(freeze=3), memfit.PlanError, r"^freeze must be a pattern"),
    (lambda: memfit.Plan(max_grad_norm="1"), memfit.PlanError, r"max_grad_norm must be > 0"),
    (lambda: memfit.TrainConfig(allow=["magic"]), MemfitError,  # a ConfigError
     r"^allow value 'magic' does not exist"),
])
def test_the_other_entry_points_name_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()
