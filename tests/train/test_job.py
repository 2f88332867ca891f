"""The job's phases: predicted on fake tensors (:func:`memfit.predict_job`) equal what the
trainer measures for real (``TrainResult.phases``), phase by phase, on the CPU."""

from __future__ import annotations

import pytest
import torch

import memfit
from memfit.plan import Plan
from memfit.train import Trainer
from memfit.train.job import JOB_PHASES, JobPhases, PhasePeak, predict_job
from memfit.workload import load_workload


class _FreshBatches:
    """Evaluation data: one fresh batch of the workload per pass (made as the pass asks)."""

    def __init__(self, workload):
        self.workload = workload
        self.model, _ = workload.build()  # make_batch reads the config only

    def __iter__(self):
        w = self.workload
        yield w.make_batch(self.model, w.batch_size, w.seq_len)


def _measured(workload, plan, folder):
    """Two steps with an evaluation and a checkpoint after the last, then a resumed third step;
    the phases of both runs and the first run's optimizer (for the byte counts)."""
    settings = dict(checkpoint_dir=folder, progress=False, warmup_steps=0,
                    eval_data=_FreshBatches(workload))
    first = Trainer(workload, plan, max_steps=2, **settings)
    phases = first.fit().phases
    resumed = Trainer(workload, plan, max_steps=3, resume=True, **settings).fit().phases
    assert set(phases.phases) == {"load", "first_step", "steady_step", "eval", "save"}
    assert {"load_checkpoint", "resume"} <= set(resumed.phases)
    return {**phases.phases, **{k: resumed.phases[k] for k in ("load_checkpoint", "resume")}}, first


def _nbytes(tensors):
    seen, total = set(), 0
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


@pytest.mark.parametrize(
    "plan",
    [
        Plan(),
        Plan.from_dict({"precision": {"mode": "bf16-pure"}, "grad_accum_steps": 2,
                        "checkpointing": {"mode": "full"}}),
    ],
    ids=["adamw", "bf16-pure+accumulation+checkpointing"],
)
def test_predicted_phases_are_the_trainers_measured_phases(tmp_path, plan):
    workload = load_workload("gpt2-tiny", 2, 16)
    predicted = predict_job(workload, plan, device="cpu")
    measured, trainer = _measured(workload, plan, tmp_path)
    assert list(predicted.phases) == list(JOB_PHASES)
    # Fake and real tensors pass through the same code under the same tracker: on the CPU
    # every phase's peak is the same to the byte (tolerance 0).
    got = {k: measured[k].peak_allocated_bytes for k in JOB_PHASES}
    want = {k: p.peak_allocated_bytes for k, p in predicted.phases.items()}
    assert got == want
    assert predicted.peak_phase == max(JOB_PHASES, key=lambda k: got[k])

    # What each phase holds beyond the training state, counted from the trainer's tensors.
    params = _nbytes(trainer.model.parameters())
    stored = trainer.optimizer.state_dict()["state"]  # what a checkpoint stores
    state = _nbytes(t for s in stored.values() for t in s.values() if torch.is_tensor(t))
    rng = torch.get_rng_state().nbytes
    # The first step creates the optimizer's state inside its optimizer step; the steady step
    # holds it throughout (its peak is as high or higher).
    assert want["first_step"] <= want["steady_step"]
    # Saving copies the optimizer's state and the RNG state (which it reads) to the host,
    # which on the CPU is the device.
    assert want["save"] == params + 2 * state + 2 * rng
    # Loading reads the state file (optimizer state, RNG) and the weights file whole beside
    # the freshly built model.
    assert want["load_checkpoint"] == 2 * params + state + rng
    # Evaluation keeps no activations for backward and makes no gradients.
    assert predicted.phases["eval"].peak_by_category["activations"] == 0
    assert predicted.phases["eval"].peak_by_category["gradients"] == 0
    assert want["eval"] < want["steady_step"]


def test_the_peak_phase_is_the_largest_and_the_api_is_public():
    job = JobPhases({"load": PhasePeak(5), "save": PhasePeak(9), "resume": PhasePeak(9)})
    assert job.peak_phase == "save" and job.peak_bytes == 9
    assert job.to_dict()["phases"]["save"] == {"peak_allocated_bytes": 9, "peak_by_category": {}}
    assert JobPhases().peak_phase is None
    assert memfit.predict_job is predict_job and "predict_job" in dir(memfit)


def test_a_plan_of_several_processes_is_refused():
    with pytest.raises(ValueError, match="one process"):
        predict_job("gpt2-tiny", Plan.from_dict({"parallel": {"data": 2}}), batch_size=2,
                    seq_len=16)
