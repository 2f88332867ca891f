"""A write that fails mid-command (a full disk) is one sentence and exit code 2, and the file
that was there before is byte-identical afterwards: every output is written to a temporary
file beside it and renamed into place only once it is whole (memfit.outputs.atomic_file).

The full disk is made two ways: a small tmpfs filled to the brim (where the tests may mount
one: root on Linux), and, everywhere, the flush of the temporary file failing with ENOSPC, as
a full disk reports it at ``fsync`` time.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memfit import outputs
from memfit.cli import app

runner = CliRunner()
EARLIER = b"the earlier file, which a failed write must leave as it was\n"
TINY = ["--model", "gpt2-tiny", "--batch-size", "2", "--seq-len", "16"]


def _disk_full(path: Path) -> None:
    raise OSError(errno.ENOSPC, "No space left on device", str(path))


@pytest.fixture
def full_disk(monkeypatch):
    """Every atomic write of memfit fails as a full disk does."""
    monkeypatch.setattr(outputs, "_fsync", _disk_full)


def _assert_one_sentence(res, path: Path) -> None:
    assert res.exit_code == 2, res.output
    text = res.output.strip()
    assert "Traceback" not in text
    error = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(error) == 1, text
    assert str(path) in text.replace("\n", "")
    assert "the disk is full" in text
    assert "the earlier file is unchanged" in text


@pytest.mark.parametrize("option", ["--json", "--plot", "--html", "--snapshot"])
def test_profile_output_on_a_full_disk(tmp_path, full_disk, option):
    target = tmp_path / {"--json": "p.json", "--plot": "p.png", "--html": "p.html",
                         "--snapshot": "p.pickle"}[option]
    target.write_bytes(EARLIER)
    res = runner.invoke(app, ["profile", *TINY, "--dry-run", option, str(target)],
                        env={"COLUMNS": "400"})
    _assert_one_sentence(res, target)
    assert target.read_bytes() == EARLIER
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]  # no temporary left


@pytest.mark.parametrize("option", ["--json", "--save"])
def test_plan_output_on_a_full_disk(tmp_path, full_disk, option):
    target = tmp_path / ("plan.json" if option == "--save" else "answer.json")
    target.write_bytes(EARLIER)
    res = runner.invoke(app, ["plan", *TINY, "--budget", "1GiB", option, str(target)],
                        env={"COLUMNS": "400"})
    _assert_one_sentence(res, target)
    assert target.read_bytes() == EARLIER


def test_an_output_written_whole_replaces_the_earlier_file(tmp_path):
    target = tmp_path / "p.json"
    target.write_bytes(EARLIER)
    res = runner.invoke(app, ["profile", *TINY, "--dry-run", "--json", str(target)],
                        env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    assert target.read_bytes() != EARLIER and target.read_text().startswith("{")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]


def test_write_text_on_a_full_disk_keeps_the_earlier_file(tmp_path, full_disk):
    target = tmp_path / "out.json"
    target.write_bytes(EARLIER)
    with pytest.raises(outputs.OutputError, match=r"could not write .*out\.json: the disk is full"):
        outputs.write_text(target, "{}")
    assert target.read_bytes() == EARLIER
    assert os.listdir(tmp_path) == ["out.json"]


def test_a_write_failing_for_lack_of_permission_names_the_cause(tmp_path, monkeypatch):
    def denied(path):
        raise OSError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(outputs, "_fsync", denied)
    with pytest.raises(outputs.OutputError, match="permission denied; nothing was written"):
        outputs.write_text(tmp_path / "new.json", "{}")
    assert os.listdir(tmp_path) == []


def _mount_tmpfs(folder: Path, size: str) -> bool:
    if sys.platform != "linux" or os.geteuid() != 0:
        return False
    folder.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                          capture_output=True)
    return done.returncode == 0


@pytest.mark.subprocess
def test_json_on_a_real_full_tmpfs(tmp_path):
    disk = tmp_path / "small"
    if not _mount_tmpfs(disk, "64k"):
        pytest.skip("cannot mount a tmpfs here (needs root on Linux)")
    try:
        target = disk / "p.json"
        target.write_bytes(EARLIER)
        with open(disk / "filler", "wb", buffering=0) as f:  # fill the disk to the last block
            try:
                while True:
                    f.write(b"\0" * 512)
            except OSError as e:
                assert e.errno == errno.ENOSPC
        res = runner.invoke(app, ["profile", *TINY, "--dry-run", "--json", str(target)],
                            env={"COLUMNS": "400"})
        _assert_one_sentence(res, target)
        assert target.read_bytes() == EARLIER
        assert sorted(p.name for p in disk.iterdir()) == ["filler", "p.json"]
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
