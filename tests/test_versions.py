"""The supported dependency window: named at import, the same numbers as pyproject.toml."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from memfit.versions import (
    ALLOW_OLDER,
    PYTHON,
    SUPPORTED,
    UnsupportedVersion,
    check_versions,
    parse_version,
)

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_parse_version_drops_local_and_pre_release_tags():
    assert parse_version("2.13.0+cpu") == (2, 13, 0)
    assert parse_version("5.24.0.dev0") == (5, 24, 0)
    assert parse_version("4.56.0rc1") == (4, 56, 0)


def test_the_lower_bounds_are_pyprojects():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    bounds = dict(re.fullmatch(r"([\w-]+)>=([\d.]+)", d).groups() for d in deps)
    for package, (lowest, _) in SUPPORTED.items():
        assert bounds[package] == lowest, package


def test_requires_python_is_what_the_window_needs():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    assert tomllib.loads(PYPROJECT.read_text())["project"]["requires-python"] == f">={PYTHON}"
    # The newest torch of the window is 2.15, the first to need Python 3.11.
    assert parse_version(SUPPORTED["torch"][1]) >= (2, 15)
    assert parse_version(PYTHON) == (3, 11)


def test_an_older_release_is_refused_in_one_sentence():
    lowest = SUPPORTED["transformers"][0]
    older = ".".join(map(str, (parse_version(lowest)[0] - 1, 0, 0)))
    with pytest.raises(UnsupportedVersion, match=rf"needs transformers {lowest} or newer .* "
                       rf"transformers {older} is installed; upgrade it with"):
        check_versions({"transformers": older})


def test_the_environment_may_allow_an_older_release_with_a_warning(monkeypatch):
    lowest = SUPPORTED["torch"][0]
    older = ".".join(map(str, (parse_version(lowest)[0], parse_version(lowest)[1] - 2, 0)))
    monkeypatch.delenv(ALLOW_OLDER, raising=False)
    with pytest.raises(UnsupportedVersion, match=rf"or set {ALLOW_OLDER}=1"):
        check_versions({"torch": older})
    monkeypatch.setenv(ALLOW_OLDER, "1")
    with pytest.warns(UserWarning, match=rf"torch {older} is installed.*running anyway"):
        said = check_versions({"torch": older})
    assert len(said) == 1


def test_a_newer_release_warns_and_a_patch_release_does_not():
    newest = SUPPORTED["transformers"][1]
    major, minor = parse_version(newest)[:2]
    with pytest.warns(UserWarning, match=rf"transformers {major}\.{minor + 1}\.0 is newer"):
        said = check_versions({"transformers": f"{major}.{minor + 1}.0"})
    assert len(said) == 1
    assert check_versions({"transformers": f"{major}.{minor}.9", "torch": "2.13.1"}) == []


def test_the_installed_versions_are_inside_the_window():
    # CI installs the newest releases: a newer one than SUPPORTED names fails here, so that
    # the window is moved on (after the suite passed on it) rather than warned about forever.
    assert check_versions() == []
