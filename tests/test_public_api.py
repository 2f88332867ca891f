"""memfit's public names: each imports from ``memfit``, the README's names resolve, and
``memfit.plan`` has the planner's own signature."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

import memfit

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.parametrize("name", memfit.__all__)
def test_every_public_name_imports_from_memfit(name):
    namespace: dict[str, Any] = {}
    exec(f"from memfit import {name}", namespace)
    assert namespace[name] is getattr(memfit, name)


def test_the_training_names_are_public():
    from memfit import Prepared, TrainConfig, TrainingSetup
    from memfit.apply.compose import TrainingSetup as setup_class
    from memfit.train import Prepared as prepared_class
    from memfit.train import TrainConfig as config_class

    assert (TrainConfig, TrainingSetup, Prepared) == (config_class, setup_class, prepared_class)


def test_dir_lists_the_lazy_names_and_all_lists_them():
    names = dir(memfit)
    for name in memfit._LAZY:
        assert name in names
        assert name in memfit.__all__
    assert {"Plan", "track", "plan", "__version__"} <= set(names)
    assert names == sorted(names)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        _ = memfit.no_such_name


def _resolve(dotted: str) -> Any:
    """``memfit.a.b.c``: each part an attribute of the one before, or a submodule of it."""
    obj: Any = memfit
    path = "memfit"
    for part in dotted.split(".")[1:]:
        path = f"{path}.{part}"
        obj = getattr(obj, part) if hasattr(obj, part) else importlib.import_module(path)
    return obj


def _readme_imports() -> list[tuple[str, str]]:
    """``(module, name)`` of every ``from memfit... import name`` in the README."""
    out = []
    pattern = r"^\s*from (memfit[\w.]*) import \(?([\w, ]+)\)?"
    for module, names in re.findall(pattern, README.read_text(), re.MULTILINE):
        out += [(module, n.strip()) for n in names.split(",") if n.strip()]
    return out


def _readme_names() -> list[str]:
    """Every ``memfit.x.y`` the README uses, in code or in prose."""
    found = re.findall(r"(?<![\w/])memfit(?:\.\w+)+", README.read_text())
    return sorted({name.rstrip(".") for name in found})


def test_the_readme_names_something():
    assert ("memfit.ops", "fused_linear_loss") in _readme_imports()
    assert {"memfit.track", "memfit.dry_run", "memfit.prepare"} <= set(_readme_names())


@pytest.mark.parametrize(("module", "name"), _readme_imports())
def test_the_readme_imports_work(module, name):
    namespace: dict[str, Any] = {}
    exec(f"from {module} import {name}", namespace)
    assert namespace[name] is not None


@pytest.mark.parametrize("dotted", _readme_names())
def test_the_readme_names_resolve(dotted):
    assert _resolve(dotted) is not None


def test_memfit_plan_has_the_planners_signature():
    import memfit.planner

    ours = inspect.signature(memfit.plan)
    theirs = inspect.signature(memfit.planner.plan)
    assert list(ours.parameters) == list(theirs.parameters)
    for name, parameter in theirs.parameters.items():
        # Name, kind (positional or keyword-only), default and annotation, one by one.
        assert ours.parameters[name] == parameter, name
    assert ours.return_annotation == theirs.return_annotation
    assert not any(p.kind is p.VAR_KEYWORD for p in ours.parameters.values())
