"""One answer per question: the planner's answer depends on its inputs, not the machine's load.

The CPU's rates (the cost model of ``--device cpu``) are measured once per machine and stored;
a busy machine reads them back instead of timing its own slowness. A process that spins on a
core stands for the busy machine.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from memfit.cli import app
from memfit.targets import profiles


@contextlib.contextmanager
def _busy() -> Iterator[None]:
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A fresh store of measured rates, and no rates remembered by this process."""
    monkeypatch.setenv(profiles.CACHE_DIR_ENV, str(tmp_path / "cache"))
    profiles.cpu_profile.cache_clear()
    yield tmp_path / "cache" / "cpu-profile.json"
    profiles.cpu_profile.cache_clear()


@pytest.mark.subprocess
def test_the_cpus_rates_are_measured_once_and_read_back_under_load(store):
    idle = profiles.cpu_profile()
    assert store.is_file()
    profiles.cpu_profile.cache_clear()  # as a new process would
    with _busy():
        busy = profiles.cpu_profile()
    assert busy == idle  # read back, not timed again (timed, no two floats would agree)


def test_an_unreadable_store_is_measured_again_and_replaced(store):
    store.parent.mkdir(parents=True)
    store.write_text("{ not json")
    profile = profiles.cpu_profile()
    stored = json.loads(store.read_text())
    assert [entry["fp32"] for entry in stored.values()] == [profile.flops["fp32"]]


@pytest.mark.slow
@pytest.mark.subprocess
def test_the_plan_json_is_the_same_bytes_every_time(store, tmp_path):
    runner = CliRunner()
    outputs = []
    for busy in (False, True, False, True, False):
        profiles.cpu_profile.cache_clear()
        out = tmp_path / f"plan-{len(outputs)}.json"
        with _busy() if busy else contextlib.nullcontext():
            # A roomy budget: the answer is the candidate the cost model puts first, which is
            # where measured rates would show (one prediction each, so the test stays short).
            res = runner.invoke(app, [
                "plan", "--model", "gpt2-tiny", "--batch-size", "8", "--seq-len", "32",
                "--budget", "1GiB", "--device", "cpu", "--jobs", "1", "--json", str(out),
            ])  # fmt: skip
        assert res.exit_code == 0, res.output
        outputs.append(out.read_bytes())
    assert all(o == outputs[0] for o in outputs)
    assert json.loads(outputs[0])["fits"] is True


@pytest.mark.slow
@pytest.mark.subprocess
def test_train_gives_the_same_parameters_every_time(store, tmp_path):
    runner = CliRunner()
    runs = []
    for busy in (False, True):
        profiles.cpu_profile.cache_clear()
        out = tmp_path / f"run-{len(runs)}.json"
        with _busy() if busy else contextlib.nullcontext():
            res = runner.invoke(app, ["train", "--max-steps", "3", "--seed", "7", "--json", str(out)])
        assert res.exit_code == 0, res.output
        runs.append(json.loads(out.read_text()))
    assert runs[0]["plan"] == runs[1]["plan"]
    assert runs[0]["params_sha256"] == runs[1]["params_sha256"]
