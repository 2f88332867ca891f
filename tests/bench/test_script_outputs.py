"""Every benchmark script that writes results checks where before it measures anything: an
output it cannot write is one ``error:`` sentence naming the option and the path, exit code 2,
and nothing written."""

from __future__ import annotations

import pytest

from .scripts import run_here, run_script

# script -> (arguments with an output that cannot be written, the sentence that refuses it).
CASES = {
    "bench_fused_loss": (["--out", "{tmp}/a-file/x"], "--out {tmp}/a-file/x.md: {tmp}/a-file is a file, not a folder"),
    "bench_host_step": (["--json", "{tmp}/a-folder"], "--json {tmp}/a-folder: it is a folder; give a file name"),
    "bench_large_batch": (["--out", "{tmp}/a-file/r.md"], "--out {tmp}/a-file/r.md: {tmp}/a-file is a file, not a folder"),
    "bench_offload": (["--markdown", "{tmp}/a-file/o.md"], "--markdown {tmp}/a-file/o.md: {tmp}/a-file is a file, not a folder"),
    "bench_optimizers": (["--json", "{tmp}/a-folder"], "--json {tmp}/a-folder: it is a folder; give a file name"),
    "bench_plan_time": (["--json", "{tmp}/a-file/t.json"], "--json {tmp}/a-file/t.json: {tmp}/a-file is a file, not a folder"),
    "bench_tracker_overhead": (["--json", "{tmp}/a-folder"], "--json {tmp}/a-folder: it is a folder; give a file name"),
    "bench_zero": (["--json", "{tmp}/a-file/z.json"], "--json {tmp}/a-file/z.json: {tmp}/a-file is a file, not a folder"),
    "plan_layout": (["--out", "{tmp}/a-file"], "--out {tmp}/a-file: it is a file, not a folder"),
    "plan_405b": (["--out", "{tmp}/a-file"], "--out {tmp}/a-file: it is a file, not a folder"),
    "zero_table": (["--out", "{tmp}/a-file/zt"], "--out {tmp}/a-file/zt.json: {tmp}/a-file is a file, not a folder"),
    "gpu_offload": (["--out", "{tmp}/a-file/new"], "--out {tmp}/a-file/new: {tmp}/a-file is a file, not a folder"),
    "gpu_validate": (["--dry-only", "--out", "{tmp}/a-file"], "--out {tmp}/a-file: it is a file, not a folder"),
}  # fmt: skip


def _check_refused(tmp_path, script: str, code: int, stdout: str, stderr: str) -> None:
    sentence = CASES[script][1]
    assert code == 2, stderr
    assert stderr.strip() == f"error: {sentence.format(tmp=tmp_path)}"
    assert stdout == ""
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a-file", "a-folder"]


def _unwritable(tmp_path, script: str) -> list[str]:
    (tmp_path / "a-file").write_text("not a folder")
    (tmp_path / "a-folder").mkdir()
    return [a.format(tmp=tmp_path) for a in CASES[script][0]]


@pytest.mark.parametrize("script", sorted(CASES))
def test_an_unwritable_output_stops_the_script_before_it_measures(tmp_path, script, monkeypatch,
                                                                   capsys):
    done = run_here(script, *_unwritable(tmp_path, script), monkeypatch=monkeypatch, capsys=capsys)
    _check_refused(tmp_path, script, done.returncode, done.stdout, done.stderr)


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("script", ["bench_host_step", "gpu_validate"])
def test_an_unwritable_output_stops_the_script_run_as_a_process(tmp_path, script):
    # The same refusal from a real interpreter, once for a script whose main() exits by itself
    # and once for one run through sys.exit(main()): the exit code is the process's.
    done = run_script(script, *_unwritable(tmp_path, script))
    _check_refused(tmp_path, script, done.returncode, done.stdout, done.stderr)
