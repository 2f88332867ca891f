"""Which checkpoint a run resumes from (memfit.train.resume), verified before any work: the
latest, the newest whole one (``latest-good``), or one named (``resume_from``); a damaged or
unfinished checkpoint is named with the remedies."""

from __future__ import annotations

import pytest

from memfit.train import checkpoint as ckpt
from memfit.train.config import ConfigError, TrainConfig
from memfit.train.manifest import MANIFEST_FILE, CheckpointError
from memfit.train.resume import resume_point

from ._helpers import tiny_gpt2


@pytest.fixture
def run(tmp_path):
    model = tiny_gpt2()
    for step in (2, 4, 6):
        ckpt.save_checkpoint(tmp_path, step, model, keep=None)
    return tmp_path


def _damage(folder):
    p = folder / "model.safetensors"
    data = bytearray(p.read_bytes())
    data[-1] ^= 0xFF
    p.write_bytes(bytes(data))


def test_nothing_to_resume(tmp_path):
    assert resume_point(tmp_path, True) is None  # an empty folder: the run starts at step 0
    assert resume_point(tmp_path / "missing", "latest-good") is None
    assert resume_point(None, True) is None


def test_resume_takes_the_latest(run):
    assert resume_point(run, True).path.name == "step-00000006"
    assert resume_point(run, False) is None


def test_a_damaged_latest_checkpoint_is_refused_with_the_remedies(run):
    _damage(run / "step-00000006")
    with pytest.raises(CheckpointError) as e:
        resume_point(run, True)
    assert str(e.value) == (
        f"the latest checkpoint is damaged: checkpoint {str(run / 'step-00000006')!r} is "
        "corrupt: the checksum of model.safetensors does not match its manifest; resume from the "
        f"newest whole one with --resume latest-good (or --resume-from {run / 'step-00000004'})"
    )


def test_latest_good_passes_over_damaged_checkpoints_and_names_them(run):
    _damage(run / "step-00000006")
    (run / "step-00000004" / MANIFEST_FILE).unlink()  # a save that never finished
    point = resume_point(run, "latest-good")
    assert point.path.name == "step-00000002"
    assert [p.name for p, _ in point.passed_over] == ["step-00000006", "step-00000004"]
    assert point.describe() == (
        f"resuming from {run / 'step-00000002'} (passed over the damaged step-00000006, "
        "step-00000004)"
    )


def test_latest_good_with_no_whole_checkpoint_says_so(run):
    for step in (2, 4, 6):
        _damage(run / f"step-{step:08d}")
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* is whole \(3 damaged"):
        resume_point(run, "latest-good")


def test_resume_from_a_named_checkpoint(run):
    assert resume_point(None, False, run / "step-00000004").path == run / "step-00000004"
    _damage(run / "step-00000004")
    with pytest.raises(CheckpointError, match="--resume-from names a damaged checkpoint"):
        resume_point(None, False, run / "step-00000004")
    with pytest.raises(CheckpointError, match="is not a folder"):
        resume_point(None, False, run / "step-00000099")


def test_a_checkpoint_without_a_manifest_names_the_remedy(run):
    (run / "step-00000006" / MANIFEST_FILE).unlink()
    with pytest.raises(CheckpointError) as e:
        ckpt.read_state(run / "step-00000006")
    assert "resume from another with --resume-from PATH" in str(e.value)
    assert "--resume latest-good" in str(e.value)


def test_the_config_takes_the_resume_words(tmp_path):
    assert TrainConfig(checkpoint_dir=str(tmp_path), resume="latest").resume is True
    assert TrainConfig(checkpoint_dir=str(tmp_path), resume="latest-good").resume == "latest-good"
    with pytest.raises(ConfigError, match="resume must be true, false, 'latest' or 'latest-good'"):
        TrainConfig(checkpoint_dir=str(tmp_path), resume="newest")
    # resume_from writes on where the checkpoint lies, unless told otherwise.
    cfg = TrainConfig(resume_from=str(tmp_path / "step-00000004"))
    assert cfg.checkpoint_dir == str(tmp_path)


def test_a_verified_checkpoint_is_not_hashed_again_unless_it_changed(run, monkeypatch):
    from memfit.train import manifest

    calls = []
    real = manifest.file_sha256
    monkeypatch.setattr(manifest, "file_sha256", lambda p: calls.append(p) or real(p))
    manifest.verify(run / "step-00000006")
    hashed = len(calls)
    assert hashed > 0
    manifest.verify(run / "step-00000006")
    assert len(calls) == hashed
    _damage(run / "step-00000006")  # rewritten: its stat changes, so it is hashed again
    with pytest.raises(CheckpointError):
        manifest.verify(run / "step-00000006")
