"""Property-based tests (hypothesis): size and budget parsing, plan (de)serialisation, and the
checkpoint state encoding (tensors to safetensors, the rest to JSON) round trips."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from memfit.optim import registry as optim_registry
from memfit.plan import Plan, PlanError
from memfit.targets import parse_budget
from memfit.targets.profiles import DEVICES
from memfit.train.manifest import CheckpointError, flatten, unflatten
from memfit.units import GiB, KiB, MiB, format_bytes, parse_size

SETTINGS = settings(max_examples=80, deadline=None)
UNITS = {"": 1, "B": 1, "kB": 1000, "KiB": KiB, "MB": 1000**2, "MiB": MiB, "GB": 1000**3, "GiB": GiB}


# ---------------------------------------------------------------------------------- sizes
@SETTINGS
@given(n=st.integers(1, 2**50), unit=st.sampled_from(sorted(UNITS)), space=st.sampled_from(["", " "]))
def test_whole_sizes_parse_exactly(n, unit, space):
    # Sizes go through a float: exact up to 2**53 bytes (8 PiB), far beyond any device.
    assume(n * UNITS[unit] <= 2**53)
    assert parse_size(f"{n}{space}{unit}") == n * UNITS[unit]
    assert parse_size(f"{n}{space}{unit.lower()}") == n * UNITS[unit]  # units ignore case
    assert parse_budget(f"{n}{unit}") == (n * UNITS[unit], None)


@SETTINGS
@given(x=st.floats(1e-3, 1e6, allow_nan=False), unit=st.sampled_from(["KiB", "MiB", "GiB"]))
def test_fractional_sizes_round_down_to_whole_bytes(x, unit):
    text = f"{x:.6f}{unit}"
    got = parse_size(text)
    exact = float(f"{x:.6f}") * UNITS[unit]
    assume(exact >= 1)
    assert got == int(exact)


@SETTINGS
@given(n=st.integers(1, 2**60))
def test_formatted_sizes_parse_back_within_their_precision(n):
    text = format_bytes(n, precision=2)
    back = parse_size(text.replace(" ", ""))
    if n < 1024:
        assert back == n  # plain bytes are printed whole
    else:
        assert abs(back - n) <= 0.005 / 1.0 * n + 1  # two decimals of a value >= 1 in its unit


@SETTINGS
@given(text=st.text(max_size=20))
def test_anything_else_is_one_clear_sentence(text):
    try:
        n, device = parse_budget(text)
    except ValueError as e:
        message = str(e)
        assert message.startswith("budget ") and "\n" not in message
        assert "Traceback" not in message
    else:
        assert n > 0 and isinstance(n, int)
        assert device is not None or parse_size(text) == n


@SETTINGS
@given(n=st.one_of(st.integers(max_value=0), st.sampled_from(["0", "0GiB", "-1", "nan", "inf"])))
def test_non_positive_budgets_are_refused(n):
    with pytest.raises(ValueError, match=r"^budget "):
        parse_budget(n)


@pytest.mark.parametrize("name", sorted(DEVICES))
def test_device_names_are_their_memory(name):
    n, dev = parse_budget(f"  {name.upper()} ")
    assert dev is DEVICES[name] and n == DEVICES[name].memory_bytes


# ---------------------------------------------------------------------------------- plans
plan_fields = st.fixed_dictionaries(
    {},
    optional={
        "micro_batch_size": st.one_of(st.none(), st.integers(1, 64)),
        "grad_accum_steps": st.integers(1, 16),
        "loss_normalization": st.sampled_from(["mean", "token"]),
        "checkpointing": st.fixed_dictionaries(
            {"mode": st.sampled_from(["none", "full", "selective", "sqrt", "budget"])},
            optional={"budget_bytes": st.integers(1, 2**40)},
        ),
        "precision": st.fixed_dictionaries(
            {"mode": st.sampled_from(["fp32", "bf16-mixed", "fp16-mixed", "bf16-pure"])},
            optional={
                "init_scale": st.sampled_from([2.0**10, 2.0**16]),
                "stochastic_rounding": st.booleans(),
            },
        ),
        "optimizer": st.fixed_dictionaries(
            {"name": st.sampled_from([*optim_registry.names(), "onebitadam", "AdamW_8bit"])},
            optional={"lr": st.floats(1e-6, 1.0), "foreach": st.one_of(st.none(), st.booleans())},
        ),
        "optimizer_in_backward": st.booleans(),
        "max_grad_norm": st.one_of(st.none(), st.floats(0.01, 10.0)),
        "grad_clip_mode": st.sampled_from(["exact", "approx"]),
        "freeze": st.lists(st.sampled_from(["embed", "h.0", "lm_head"]), max_size=2, unique=True),
        "max_seq_len": st.one_of(st.none(), st.integers(1, 4096)),
        "fused_pointwise": st.booleans(),
        "compile": st.booleans(),
        "sequence": st.fixed_dictionaries(
            {},
            optional={
                "group_by_length": st.booleans(),
                "pad_to_multiple_of": st.sampled_from([1, 8, 64]),
            },
        ),
        "offload": st.one_of(st.none(), st.fixed_dictionaries({"activations": st.booleans()})),
    },
)


def _plan(fields) -> Plan:
    try:
        return Plan.from_dict(fields)
    except PlanError:
        assume(False)
        raise


@SETTINGS
@given(fields=plan_fields)
def test_plans_round_trip_through_dict_json_and_yaml(fields):
    plan = _plan(fields)
    data = plan.to_dict()
    assert Plan.from_dict(data) == plan
    assert Plan.from_dict(json.loads(plan.to_json())) == plan
    assert Plan.from_dict(yaml.safe_load(plan.to_yaml())) == plan
    assert Plan.from_dict(data).to_dict() == data  # to_dict is a fixed point
    # And through a checkpoint's JSON state (what a resume restores).
    tree, tensors = flatten({"plan": data})
    assert not tensors
    assert Plan.from_dict(unflatten(json.loads(json.dumps(tree)), tensors)["plan"]) == plan


@SETTINGS
@given(fields=plan_fields, path=st.sampled_from(["p.json", "p.yaml"]))
def test_saved_plans_load_back(tmp_path_factory, fields, path):
    plan = _plan(fields)
    p = tmp_path_factory.mktemp("plan") / path
    (plan.to_json if path.endswith(".json") else plan.to_yaml)(p)
    assert Plan.load(p) == plan


# ---------------------------------------------------------------------------------- state
leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.builds(
        lambda shape, dtype: torch.randn(shape).to(dtype),
        st.lists(st.integers(0, 3), max_size=3),
        st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]),
    ),
)
keys = st.one_of(st.text(max_size=6), st.integers(-5, 50))
trees = st.recursive(
    leaf,
    lambda sub: st.one_of(
        st.lists(sub, max_size=4),
        st.lists(sub, max_size=4).map(tuple),
        st.dictionaries(keys, sub, max_size=4),
    ),
    max_leaves=20,
)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, float):
        return isinstance(b, float) and (a == b or (math.isnan(a) and math.isnan(b)))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return (
            isinstance(b, dict)
            and list(a) == list(b)
            and all(type(k) is type(j) for k, j in zip(a, b, strict=True))
            and all(_same(a[k], b[k]) for k in a)
        )
    return type(a) is type(b) and a == b


@SETTINGS
@given(tree=trees)
def test_checkpoint_state_round_trips_exactly_through_json_and_safetensors(tmp_path_factory, tree):
    from safetensors.torch import load_file, save_file

    encoded, tensors = flatten(tree)
    text = json.dumps(encoded, allow_nan=False)  # strict JSON: no NaN literals
    path = tmp_path_factory.mktemp("state") / "t.safetensors"
    save_file(tensors, str(path))
    assert _same(tree, unflatten(json.loads(text), load_file(str(path))))


def test_rng_states_round_trip():
    import random

    import numpy as np

    from memfit.train.checkpoint import restore_rng_state, rng_state

    state = rng_state()
    tree, tensors = flatten(state)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    restore_rng_state(unflatten(json.loads(json.dumps(tree)), tensors))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_objects_are_refused_not_pickled():
    with pytest.raises(CheckpointError, match=r"cannot store \.a\[1\] in a checkpoint: a set"):
        flatten({"a": [1, {2}]})
