"""memfit.outputs: which output paths a command may write, decided without writing anything.

The tests run as root too, where ``os.access`` allows nearly everything: what they refuse is
what no permission bit changes (a parent that is a file, a file where a folder is wanted).
"""

from __future__ import annotations

import os

import pytest

from memfit.outputs import OutputError, check_outputs, output_problem, write_text


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "a-folder").mkdir()
    return tmp_path


@pytest.mark.parametrize(
    ("path", "folder", "must_exist", "problem"),
    [
        ("a-folder/out.json", False, False, None),
        ("a-file", False, False, None),  # an existing file is overwritten
        ("new/deeper/out.json", False, False, "the folder {tmp}/new/deeper does not exist; create it first"),
        ("a-file/out.json", False, False, "{tmp}/a-file is a file, not a folder"),
        ("a-file/new/out.json", False, False, "{tmp}/a-file is a file, not a folder"),
        ("a-folder", False, False, "it is a folder; give a file name"),
        ("a-folder", True, False, None),
        ("new/ck", True, False, None),
        ("a-file", True, False, "it is a file, not a folder"),
        ("a-file/ck", True, False, "{tmp}/a-file is a file, not a folder"),
        ("new", True, True, "the folder does not exist; create it first"),
        ("a-folder", True, True, None),
    ],
)
def test_output_problem(tree, path, folder, must_exist, problem):
    expected = None if problem is None else problem.format(tmp=tree)
    assert output_problem(tree / path, folder=folder, must_exist=must_exist) == expected
    assert sorted(p.name for p in tree.iterdir()) == ["a-file", "a-folder"]  # nothing made


def test_a_relative_path_is_checked_from_the_working_folder(tree, monkeypatch):
    monkeypatch.chdir(tree)
    assert output_problem("out.json") is None
    assert output_problem("a-file/out.json") == f"{tree}/a-file is a file, not a folder"


def test_a_folder_without_write_permission_is_refused(tree, monkeypatch):
    # os.access stands for the permission bits, which do not stop root (these tests' user).
    monkeypatch.setattr(os, "access", lambda path, mode: os.fspath(path) != str(tree))
    assert output_problem(tree / "out.json") == f"the folder {tree} is not writable"
    assert output_problem(tree / "new" / "ck", folder=True) == f"the folder {tree} is not writable"
    assert output_problem(tree / "a-folder" / "out.json") is None


def test_check_outputs_names_the_option_and_the_path(tree):
    check_outputs({"--json": None, "--plot": tree / "a-folder" / "p.png"}, {"--dir": tree / "ck"})
    with pytest.raises(OutputError) as e:
        check_outputs({"--json": tree / "no" / "such" / "p.json"})
    assert str(e.value) == (
        f"--json {tree}/no/such/p.json: the folder {tree}/no/such does not exist; create it first"
    )
    with pytest.raises(OutputError) as e:
        check_outputs({"--json": tree / "a-folder/x.json"}, {"--checkpoint-dir": tree / "a-file"})
    assert str(e.value) == f"--checkpoint-dir {tree}/a-file: it is a file, not a folder"


def test_write_text_creates_the_missing_folders(tree):
    path = write_text(tree / "new" / "deeper" / "out.json", "{}\n")
    assert path.read_text() == "{}\n"
