"""memfit.errors: one base for every error memfit raises on purpose, each error keeping the
built-in base callers catch, and the argument checks' sentences."""

from __future__ import annotations

import importlib
import pathlib
import re

import pytest

import memfit
from memfit.errors import (
    MemfitError,
    MemfitStateError,
    MemfitTypeError,
    MemfitValueError,
    check_bool,
    check_int,
    check_names,
    check_number,
    check_text,
    describe,
)

SRC = pathlib.Path(memfit.__file__).parent

#: Every error class memfit defines, with the built-in base it had before MemfitError, which
#: code that catches it (the CLI catches ValueError) relies on.
ERRORS = [
    ("memfit.plan", "PlanError", ValueError),
    ("memfit.workload", "WorkloadError", ValueError),
    ("memfit.weights", "WeightsError", ValueError),
    ("memfit.techniques", "TechniqueError", ValueError),
    ("memfit.outputs", "OutputError", ValueError),
    ("memfit.extras", "MissingExtra", ImportError),
    ("memfit.extras", "MissingExtra", ValueError),
    ("memfit.train.lock", "CheckpointLocked", ValueError),
    ("memfit.distributed.launch", "ProcessesStopped", Exception),
    ("memfit.versions", "UnsupportedVersion", ImportError),
    ("memfit.train.config", "ConfigError", ValueError),
    ("memfit.train.manifest", "CheckpointError", ValueError),
    ("memfit.train.trainer", "TrainingDiverged", RuntimeError),
    ("memfit.train.layout_run", "LayoutRunError", ValueError),
    ("memfit.distributed.layout", "LayoutError", ValueError),
    ("memfit.distributed.pipeline_plan", "PipelineError", ValueError),
    ("memfit.estimate.dryrun", "ModelError", RuntimeError),
    ("memfit.estimate.dryrun", "DryRunLimitation", RuntimeError),
    ("memfit.planner.result", "NothingFits", Exception),
    ("memfit.errors", "MemfitTypeError", TypeError),
    ("memfit.errors", "MemfitValueError", ValueError),
    ("memfit.errors", "MemfitStateError", RuntimeError),
]


@pytest.mark.parametrize(("module", "name", "base"), ERRORS)
def test_every_error_is_a_memfit_error_and_keeps_its_base(module, name, base):
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, MemfitError) and issubclass(cls, base)


def test_no_public_error_class_is_left_out():
    # Every exception class memfit defines is a MemfitError, found in the source so that a
    # new one cannot slip past; private control-flow exceptions (_Slow, _Stopped,
    # _OverBudget, the planner's Withdrawn) never reach a caller, and a signal's StopRequested
    # is a BaseException on purpose (as KeyboardInterrupt is: no `except Exception` may
    # swallow it), so it cannot be an Exception's subclass.
    found = []
    for path in SRC.rglob("*.py"):
        module = ".".join(("memfit", *path.relative_to(SRC).with_suffix("").parts))
        for name in re.findall(r"^class (\w+)\([\w., ]*(?:Error|Exception|Diverged|Locked|"
                               r"Version|Limitation|Fits)\b", path.read_text(), flags=re.M):
            if not name.startswith("_") and name not in ("Withdrawn", "StopRequested"):
                found.append((module.removesuffix(".__init__"), name))
    assert {name for _, name in found} >= {name for _, name, _ in ERRORS}
    for module, name in found:
        assert issubclass(getattr(importlib.import_module(module), name), MemfitError), name


def test_the_errors_are_public():
    assert memfit.MemfitError is MemfitError
    assert {"MemfitError", "MemfitTypeError", "MemfitValueError", "MemfitStateError"} <= set(
        memfit.__all__
    )


@pytest.mark.parametrize(("value", "text"), [
    (None, "None"),
    (3, "3 (an int)"),
    ("x", "'x' (a str)"),
    (4.5, "4.5 (a float)"),
    ([1], "a list ([1])"),
    ("y" * 100, "a str"),
    (object(), "an object"),
])
def test_describe_names_the_kind_and_a_short_value(value, text):
    assert describe(value).startswith(text)


def test_check_int():
    check_int(3, "n", 1)
    check_int(None, "n", 1, optional=True)
    with pytest.raises(MemfitValueError, match=r"^n must be a whole number >= 1, got 0$"):
        check_int(0, "n", 1)
    with pytest.raises(MemfitValueError, match=r"got 2\.0"):  # an int argument stays an int
        check_int(2.0, "n", 1)
    with pytest.raises(MemfitTypeError, match=r"got True \(a bool\)"):
        check_int(True, "n")
    with pytest.raises(MemfitTypeError, match=r"got '3' \(a str\)"):
        check_int("3", "n")


def test_check_number_and_bool_and_text():
    check_number(1.5, "x", 1)
    for bad in (float("nan"), float("inf"), 0.5):
        with pytest.raises(MemfitValueError, match=r"^x must be a"):
            check_number(bad, "x", 1)
    with pytest.raises(MemfitTypeError):
        check_number("1", "x")
    check_bool(False, "flag")
    with pytest.raises(MemfitTypeError, match=r"^flag must be True or False, got 1"):
        check_bool(1, "flag")
    assert check_text(pathlib.Path("a/b"), "path", "a path") == "a/b"
    with pytest.raises(MemfitTypeError, match=r"^path must be a path, got 3"):
        check_text(3, "path", "a path")


def test_check_names_takes_a_string_or_a_list_as_the_cli_does():
    known = ("lora", "qlora", "8bit")
    assert check_names("8bit", known, "--allow") == ("8bit",)
    assert check_names(" lora, qlora ,", known, "--allow") == ("lora", "qlora")
    assert check_names(["lora", "8bit,qlora"], known, "--allow") == ("lora", "8bit", "qlora")
    assert check_names(None, known, "--allow") == check_names([], known, "--allow") == ()
    with pytest.raises(MemfitValueError,
                       match=r"^--allow value 'x' does not exist; use one or more of lora, qlora"):
        check_names("lora,x", known, "--allow")
    for bad in (8, {"lora": 1}, b"lora", ["lora", 8]):
        with pytest.raises(MemfitTypeError, match=r"^--allow must be a name or a list"):
            check_names(bad, known, "--allow")


def test_a_state_error_is_a_runtime_error():
    assert issubclass(MemfitStateError, RuntimeError)
