"""The technique registry: a technique defined only here is applied, swapped, refused,
searched and named on the command line like memfit's own."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

import pytest
import torch

import memfit
from memfit import techniques
from memfit.apply.compose import apply_plan
from memfit.estimate import dry_run
from memfit.plan import BUILTIN_TECHNIQUES, Plan, PlanError
from memfit.techniques import Technique, TechniqueError, register
from memfit.workload import load_workload

NAME = "freeze-wte"


@dataclass(frozen=True)
class FreezeWte:
    """Freeze the token embeddings (no gradient, no optimizer state for them)."""

    pattern: str = "wte"


class _Unfreeze:
    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params

    def remove(self) -> None:
        for p in self.params:
            p.requires_grad_(True)
        self.params = []


def _apply(model: torch.nn.Module, ctx: techniques.ApplyContext) -> _Unfreeze:
    config = dict(ctx.plan.extra)[NAME]
    params = [p for n, p in model.named_parameters() if config.pattern in n and p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    ctx.info["wte_frozen"] = len(params)
    return _Unfreeze(params)


def _technique(**changes) -> Technique:
    fields = dict(
        name=NAME,
        config_type=FreezeWte,
        apply=_apply,
        info_key="wte_frozen",
        engines=frozenset({"single", "data", "hf"}),
        allow={NAME: "freeze the token embeddings"},
        candidates=lambda plan, workload: [FreezeWte()],
        memory_rank=lambda config: 1,
        summary=lambda config: f"embeddings {config.pattern} frozen",
    )
    fields.update(changes)
    return Technique(**fields)


@pytest.fixture
def registered():
    technique = register(_technique())
    yield technique
    techniques.unregister(NAME)


@pytest.fixture(scope="module")
def workload():
    return load_workload("gpt2-tiny", 4, 32)


def test_builtins_are_registered_in_apply_order():
    names = [t.name for t in techniques.registered(builtin=True)]
    assert names[:5] == ["kv_cache_off", "lora", "freeze", "fused_pointwise", "fused_loss"]
    assert names.index("precision") < names.index("checkpointing") < names.index("optimizer")
    assert len(names) == len(BUILTIN_TECHNIQUES)
    order = techniques.apply_order(builtin=True)
    assert list(order) == names and sorted(order.values()) == list(order.values())
    # Before compile, the gradient buffer, data parallelism and the optimizer, which a
    # user's technique (DEFAULT_ORDER) must precede.
    transforms = max(o for n, o in order.items() if o < techniques.DEFAULT_ORDER)
    assert order["activation_offload"] == transforms
    assert techniques.DEFAULT_ORDER < order["compile"] < order["optimizer"]


def test_apply_plan_keeps_the_handles_and_reports_of_before_the_registry(workload):
    """The handles, their order and the info keys apply_plan gave before the registry."""
    model = workload.build_model()
    plan = Plan(freeze="embeddings", fused_pointwise=True, fused_loss=True,
                precision="bf16-mixed", checkpointing="full", grad_buffer=True)
    setup = apply_plan(model, plan)
    assert [n for n, _ in setup.handles] == [
        "kv_cache_off", "freeze", "fused_pointwise", "fused_loss", "precision", "checkpointing",
        "grad_buffer",
    ]
    assert set(setup.info) == {"frozen", "fused_pointwise", "fused_loss", "checkpointed",
                               "grad_buffer_bytes"}
    setup.remove()
    fused = apply_plan(workload.build_model(), Plan(optimizer_in_backward=True))
    assert [n for n, _ in fused.handles] == ["kv_cache_off", "precision", "optimizer_in_backward"]


def test_plan_techniques_yields_what_the_plan_turns_on_in_order():
    plan = Plan(checkpointing="full", precision="bf16-mixed", grad_accum_steps=2, freeze="body")
    names = [t.name for t, _ in plan.techniques()]
    assert names == ["kv_cache_off", "freeze", "precision", "checkpointing", "optimizer",
                     "accumulation"]
    configs = dict((t.name, c) for t, c in plan.techniques())
    assert configs["accumulation"] == (None, 2) and configs["freeze"] == ("body",)


def test_a_users_technique_round_trips_through_the_plan(registered):
    plan = Plan(extra={NAME: {"pattern": "wte"}})
    assert plan.extra == ((NAME, FreezeWte("wte")),)
    names = [t.name for t, _ in plan.techniques()]
    # Its default place: after the model transforms, before the optimizer.
    assert names.index("precision") < names.index(NAME) < names.index("optimizer")
    data = json.loads(plan.to_json())
    assert data["extra"] == {NAME: {"pattern": "wte"}}
    assert Plan.from_dict(data) == plan
    assert "extra" not in Plan().to_dict()  # plans without users' techniques read as before
    assert plan.summary().endswith("embeddings wte frozen")


def test_the_registry_refuses_bad_registrations(registered):
    with pytest.raises(TechniqueError, match="already registered"):
        register(_technique())
    with pytest.raises(TechniqueError, match="memfit's own"):
        register(_technique(name="checkpointing", allow={}))
    with pytest.raises(TechniqueError, match="already technique 'precision'"):
        register(_technique(name="other", allow={"bf16-pure": "x"}))
    with pytest.raises(TechniqueError, match="unknown engine 'gpu'"):
        _technique(engines=frozenset({"gpu"}))
    with pytest.raises(PlanError, match="'nope', which is not registered"):
        Plan(extra={"nope": {}})
    with pytest.raises(PlanError, match="bad config"):
        Plan(extra={NAME: {"colour": 1}})


def test_apply_plan_applies_and_removes_it_with_the_same_gradients(registered, workload):
    model, batch = workload.build(seed=0)
    reference = copy.deepcopy(model)
    setup = apply_plan(model, Plan(extra={NAME: {}}, optimizer={"name": "sgd", "lr": 0.1}))
    names = [n for n, _ in setup.handles]
    # Its default place: after the model transforms, before the optimizer.
    assert names.index("precision") < names.index(NAME)
    assert setup.info["wte_frozen"] == 1
    wte = model.transformer.wte.weight
    before = wte.detach().clone()
    torch.manual_seed(1)  # the same dropout masks in both runs
    setup.step(batch)
    assert torch.equal(wte, before)  # frozen: not stepped
    # The rest trained exactly as a plain loop with the same parameter frozen.
    reference.transformer.wte.weight.requires_grad_(False)
    opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1)
    torch.manual_seed(1)
    reference(**batch).loss.backward()
    opt.step()
    for (n, a), b in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)
    setup.remove()
    assert wte.requires_grad


def test_the_tracker_measures_the_saving_it_claims(registered, workload):
    plain = dry_run(workload, Plan())
    frozen = dry_run(workload, Plan(extra={NAME: {}}))
    n = workload.build_model().transformer.wte.weight.numel()
    a = plain.phase_peak_by_category["optimizer"]
    b = frozen.phase_peak_by_category["optimizer"]
    assert a["gradients"] - b["gradients"] == 4 * n  # one fp32 gradient less
    # AdamW: two fp32 moments and one 4-byte step count for the parameter.
    assert a["optimizer_state"] - b["optimizer_state"] == 8 * n + 4
    assert frozen.peak_bytes < plain.peak_bytes


def test_engines_refuse_it_where_it_is_not_supported(registered):
    from memfit.apply.compose import refuse_unsupported
    from memfit.integrations.lightning import check_plan

    plan = Plan(extra={NAME: {}})
    refuse_unsupported(plan, "hf")
    with pytest.raises(PlanError, match=f"technique '{NAME}' is not supported in a lightning"):
        check_plan(plan)


def test_the_oom_fallback_swaps_a_swappable_technique_in_place(workload):
    from memfit.train.oom import switch_plan

    register(_technique(swappable=True))
    try:
        model = workload.build_model()
        setup = apply_plan(model, Plan())
        new, rebuilt = switch_plan(setup, Plan(extra={NAME: {}}))
        assert not rebuilt and new.optimizer is setup.optimizer
        assert not model.transformer.wte.weight.requires_grad
        names = [n for n, _ in new.handles]
        assert names.index("precision") < names.index(NAME)  # at its place in the order
        back, _ = switch_plan(new, Plan())
        assert model.transformer.wte.weight.requires_grad and NAME not in dict(back.handles)
    finally:
        techniques.unregister(NAME)


def test_the_planner_considers_it_only_when_allowed(registered, workload):
    from memfit.planner import NothingFits, plan

    forbid = ["accumulation", "checkpointing", "mixed-precision", "fused-step", "foreach-off",
              "fused-loss"]
    plain = dry_run(workload, Plan()).peak_bytes
    frozen = dry_run(workload, Plan(extra={NAME: {}})).peak_bytes
    budget = (plain + frozen) // 2
    result = plan(workload, budget, allow=[NAME], forbid=forbid, device="cpu")
    assert dict(result.plan.extra) == {NAME: FreezeWte()}
    assert result.predicted_peak_bytes == frozen
    with pytest.raises(NothingFits, match=f"allowing .*{NAME}"):
        plan(workload, budget, forbid=forbid, device="cpu")


def test_the_cli_takes_its_allow_name(registered, tmp_path):
    from typer.testing import CliRunner

    from memfit.cli import app

    out = tmp_path / "plan.json"
    res = CliRunner().invoke(app, ["plan", "--model", "gpt2-tiny", "--batch-size", "4",
                                   "--seq-len", "32", "--budget", "1GiB", "--allow", NAME,
                                   "--json", str(out)])
    assert res.exit_code == 0, res.output
    bad = CliRunner().invoke(app, ["plan", "--model", "gpt2-tiny", "--budget", "1GiB",
                                   "--allow", "no-such-technique"])
    assert bad.exit_code == 2 and NAME in bad.output


def test_plugins_load_from_the_environment(monkeypatch, tmp_path):
    module = tmp_path / "my_memfit_plugin.py"
    module.write_text(
        "from memfit.techniques import Technique, register\n"
        "register(Technique(name='plugin-technique', allow={'plugin-technique': 'x'}))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("MEMFIT_TECHNIQUES", "my_memfit_plugin")
    monkeypatch.setattr(techniques, "_PLUGINS_LOADED", False)
    try:
        assert "plugin-technique" in techniques.allow_names()
    finally:
        techniques.unregister("plugin-technique")
    monkeypatch.setenv("MEMFIT_TECHNIQUES", "no_such_module_here")
    monkeypatch.setattr(techniques, "_PLUGINS_LOADED", False)
    with pytest.raises(TechniqueError, match="'no_such_module_here'"):
        techniques.registered()
    monkeypatch.setattr(techniques, "_PLUGINS_LOADED", True)


def test_memfit_exposes_the_registry():
    assert memfit.techniques.register is register
    assert callable(memfit.Plan.techniques)


def test_the_readme_example_runs():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = next(
        b.split("\n", 1)[1]
        for b in readme.split("```python")[1:]
        if "register(Technique(" in b
    ).split("```")[0]
    scope: dict = {}
    try:
        exec(compile(block, "README.md", "exec"), scope)
        result = scope["result"]
        assert result.predicted_peak_bytes <= 5 * 2**20
        assert "freeze-embeddings" in [t.name for t, _ in scope["plan"].techniques()]
    finally:
        techniques.unregister("freeze-embeddings")


@dataclass(frozen=True)
class Layers:
    """A config with a tuple field, as JSON gives it back as a list."""

    names: tuple[str, ...] = ()


def test_a_tuple_field_survives_json_and_a_name_is_given_once():
    register(Technique(name="layers", config_type=Layers, apply=_apply,
                       candidates=lambda plan, workload: [Layers(("h.0",))]))
    try:
        plan = Plan(extra={"layers": {"names": ["h.0", "h.1"]}})
        assert dict(plan.extra)["layers"] == Layers(("h.0", "h.1"))
        assert Plan.from_dict(json.loads(plan.to_json())) == plan
        hash(dict(plan.extra)["layers"])  # the planner keys its dimensions by config
        with pytest.raises(PlanError, match="twice"):
            Plan(extra=[("layers", {}), ("layers", {"names": ["x"]})])
    finally:
        techniques.unregister("layers")


def test_the_layout_path_refuses_a_users_technique(registered):
    from memfit.train.layout_run import _ignored_techniques

    plan = Plan(parallel={"tensor": 2}, extra={NAME: {}})
    assert NAME in _ignored_techniques(plan)
    assert _ignored_techniques(Plan(parallel={"tensor": 2})) == []


def test_lightning_refuses_a_technique_after_the_optimizer():
    from memfit.integrations.lightning import check_plan

    register(_technique(order=techniques.get("optimizer").order + 5,
                        engines=frozenset({"single", "lightning"})))
    try:
        with pytest.raises(PlanError, match="applies after the optimizer"):
            check_plan(Plan(extra={NAME: {}}))
    finally:
        techniques.unregister(NAME)


def test_each_users_technique_is_a_rank_dimension_of_its_own(registered, workload):
    from memfit.planner.candidates import RANK_DIMENSIONS, generate, options

    register(Technique(name="other", config_type=Layers, apply=_apply,
                       allow={"other": "x"}, candidates=lambda plan, w: [Layers()],
                       memory_rank=lambda config: 1))
    try:
        forbid = ["accumulation", "checkpointing", "mixed-precision", "fused-step",
                  "foreach-off", "fused-loss"]
        from memfit.targets import get_device

        space = options(workload, Plan(), [NAME, "other"], forbid, get_device("cpu"))
        ranks = {p.extra: r for p, r in generate(workload, Plan(), space, device="cpu")}
        assert len(space.extras) == 4  # neither, either, both
        n = len(RANK_DIMENSIONS)
        both = ranks[(("freeze-wte", FreezeWte()), ("other", Layers()))]
        one = ranks[(("freeze-wte", FreezeWte()),)]
        other = ranks[(("other", Layers()),)]
        assert len(both) == n + 2
        # Neither of the two single ones dominates the other: separate dimensions.
        assert (one[n:], other[n:]) == ((1, 0), (0, 1)) and both[n:] == (1, 1)
    finally:
        techniques.unregister("other")


def test_a_plugin_that_cannot_be_imported_is_named_every_time(monkeypatch):
    monkeypatch.setenv("MEMFIT_TECHNIQUES", "no_such_module_here")
    monkeypatch.setattr(techniques, "_PLUGINS_LOADED", False)
    for _ in range(2):
        with pytest.raises(TechniqueError, match="'no_such_module_here'"):
            techniques.registered()
    assert techniques.registered(builtin=True)  # memfit's own need no plugin
    monkeypatch.setattr(techniques, "_PLUGINS_LOADED", True)
