"""One writer per checkpoint folder (memfit.train.lock): a second run is refused in one
sentence naming the holder's pid, a lock left by a killed run is taken over, the lock is
re-entrant in its process and inherited by the processes a run launches, and pruning and
cleanup touch only what this run wrote."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from memfit.train import checkpoint as ckpt
from memfit.train import lock
from memfit.train.lock import CheckpointLocked, hold, lock_folder, release

from ._helpers import tiny_gpt2

_HOLDER = textwrap.dedent(
    """
    import sys, time
    from memfit.train.lock import lock_folder
    lock_folder(sys.argv[1])
    print("locked", flush=True)
    time.sleep(600)
    """
)


def _hold_in_another_process(folder: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(folder)], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, lock.ENV: ""})
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


@pytest.mark.subprocess
def test_a_second_holder_is_refused_naming_the_first_and_a_killed_ones_lock_is_taken_over(tmp_path):
    folder = tmp_path / "ck"
    proc = _hold_in_another_process(folder)
    try:
        with pytest.raises(CheckpointLocked) as e:
            lock_folder(folder)
        assert f"process {proc.pid}" in str(e.value)
        assert str(folder) in str(e.value) and "give another --checkpoint-dir" in str(e.value)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # The kernel dropped the dead process's lock: the next run takes the folder over.
    with hold(folder):
        assert lock.holder(folder)["pid"] == os.getpid()
    assert not lock._HELD


def test_the_lock_is_reentrant_in_its_process_and_released_by_the_last_hold(tmp_path):
    with hold(tmp_path), hold(tmp_path):
        assert lock._HELD[tmp_path.resolve()][1] == 2
        assert os.environ[lock.ENV] == str(tmp_path.resolve())
    assert tmp_path.resolve() not in lock._HELD
    assert lock.ENV not in os.environ
    release(tmp_path)  # one more release is harmless


@pytest.mark.subprocess
def test_a_launched_process_inherits_its_runs_lock(tmp_path):
    # A process whose launcher holds the folder (MEMFIT_CHECKPOINT_LOCK) writes under its hold.
    with hold(tmp_path):
        code = f"from memfit.train.lock import lock_folder; lock_folder({str(tmp_path)!r}); print('ok')"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert done.stdout.strip() == "ok", done.stderr
        # Without the inheritance it is another run, refused.
        env = {k: v for k, v in os.environ.items() if k != lock.ENV}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        assert "CheckpointLocked" in done.stderr and f"process {os.getpid()}" in done.stderr


def test_pruning_deletes_only_this_runs_checkpoints(tmp_path, monkeypatch):
    model = tiny_gpt2()
    earlier = tmp_path / "step-00000001"  # an earlier run's, which this run did not resume
    ckpt.save_checkpoint(tmp_path, 1, model)
    monkeypatch.setattr(ckpt, "_WRITTEN", set())  # a new run
    for step in (2, 3, 4):
        ckpt.save_checkpoint(tmp_path, step, model, keep=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == [
        "step-00000001", "step-00000003", "step-00000004"]
    assert earlier.exists()
    # A run that resumes them adopts them as its own.
    ckpt.adopt_checkpoints(tmp_path)
    ckpt.save_checkpoint(tmp_path, 5, model, keep=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-00000004", "step-00000005"]


@pytest.mark.subprocess
def test_cleanup_leaves_a_live_processes_save_in_progress(tmp_path):
    model = tiny_gpt2()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        in_progress = tmp_path / f".tmp-step-00000009-{live.pid}-0123abcd"
        in_progress.mkdir()
        dead = tmp_path / ".tmp-step-00000008-999999-0123abcd"
        dead.mkdir()
        ckpt.save_checkpoint(tmp_path, 1, model)
        assert in_progress.exists()  # another process's save, still running
        assert not dead.exists()  # a killed process's leftover
    finally:
        live.kill()
        live.wait()


# ---------------------------------------------------------------------------------- memfit train
def _memfit(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "memfit", "train", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _wait_for_lock(folder: Path, pid: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if lock.holder(folder).get("pid") == pid:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    raise AssertionError(f"process {pid} did not lock {folder}")


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("first_resumes", [False, True], ids=["fresh-then-resume", "resume-then-fresh"])
def test_two_memfit_train_runs_on_one_folder(tmp_path, first_resumes):
    folder = tmp_path / "ck"
    common = ["--model", "gpt2-tiny", "--batch-size", "2", "--seq-len", "16",
              "--checkpoint-dir", str(folder)]
    first = _memfit(*common, "--max-steps", "100000", *(["--resume"] if first_resumes else []))
    try:
        _wait_for_lock(folder, first.pid, first)
        second = _memfit(*common, "--max-steps", "1", *([] if first_resumes else ["--resume"]))
        _out, err = second.communicate(timeout=300)
        assert second.returncode == 2, err
        assert f"process {first.pid}" in err and "in use by another memfit run" in err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    if first_resumes:
        return
    # The killed run's lock is stale: a new run takes the folder over and trains.
    third = _memfit(*common, "--max-steps", "1")
    _out, err = third.communicate(timeout=600)
    assert third.returncode == 0, err
    assert (folder / "step-00000001").is_dir()
