"""The whole job's memory, phase by phase: predicted on fake tensors, measured by the trainer.

A run's peak is not always its steady step's: the first step creates the optimizer's state,
a checkpoint copies it, a resume reads it back beside the model. :func:`predict_job` runs a
job's phases on fake tensors under memfit's tracker, through the code the
:class:`~memfit.train.Trainer` runs for real (``Workload.build`` and ``apply_plan``, the
plan's ``TrainingSetup.step``, :func:`~memfit.train.callbacks.evaluation.eval_losses`,
:func:`~memfit.train.checkpoint.checkpoint_state`, ``load_state_dict``), and the trainer
measures the same phases with the same tracker (:class:`~memfit.train.phases.PhaseRecorder`,
``TrainResult.phases``), so the two compare byte for byte. The phases, in a job's order (:data:`JOB_PHASES`):

* ``load``: building the model (its saved weights read in the plan's weight dtype) and
  applying the plan (casts, adapters, the optimizer built, nothing stepped);
* ``first_step``: the first training step of a fresh run, which creates the gradients and the
  optimizer's state (lazily, inside ``optimizer.step``);
* ``steady_step``: the second step, whose optimizer state exists from its start;
* ``eval``: the first batch of an evaluation after training steps, made and evaluated: no
  gradients and no optimizer step, the plan's micro-batches and autocast, beside the
  parameters and the optimizer's state (predicted for a batch of the training batch's shape);
* ``save``: writing a single-process checkpoint: the optimizer's ``state_dict`` and every
  RNG state copied to the host, contiguous (on the CPU those copies sit on the device beside
  the state; on a GPU they are host memory and the device pays nothing more);
* ``load_checkpoint``: restoring a checkpoint into a freshly built trainer (its model, and
  an optimizer with no state yet): the stored optimizer state and RNG tensors, read whole,
  beside the model's weights read from their file and copied into the parameters;
* ``resume``: the first step after ``load_checkpoint``, its optimizer state restored.

Written here, on the trainer's floor, rather than in :mod:`memfit.estimate`: the prediction
runs the trainer's own checkpoint and evaluation code, which lives on this floor.

What torch lacks and this module adds: per-phase peaks of one job (torch's allocator keeps one
peak per reset, and nothing predicts a checkpoint's copies before the run).

Not predicted yet: a data-parallel job's sharded checkpoint through
``torch.distributed.checkpoint`` (:func:`predict_job` refuses a plan of several processes);
the host memory of safetensors' byte copies (NumPy, outside any tensor operation); saved
weights loaded in a dtype other than fp32, whose dry ``load`` builds the model at random in
fp32 as a dry run always does; a QLoRA model's 4-bit weights file, whose ``load_checkpoint``
is predicted as its state dict's; a compiled plan's saving, which
:func:`~memfit.estimate.dryrun.measure` applies to its steps (the phases here are eager, as
the tracker sees a compiled model run, in the trainer too).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..accounting import track
from ..accounting.tiers import host_tier
from ..apply.compose import apply_plan
from ..errors import check_number, check_type
from ..estimate.arguments import check_workload
from ..plan import Plan
from ..strategies.precision import weights_dtype
from ..targets import DeviceProfile, emulate, get_device
from ..workload import Workload, WorkloadError, load_workload
from .callbacks.evaluation import eval_losses
from .checkpoint import checkpoint_state
from .manifest import unflatten
from .phases import JOB_PHASES, JobPhases, PhasePeak, phase_peak

__all__ = ["JOB_PHASES", "JobPhases", "PhasePeak", "measure_job", "predict_job"]


def predict_job(
    workload: Workload | str,
    plan: Plan | None = None,
    *,
    device: str | DeviceProfile | None = None,
    seed: int = 0,
    batch_size: int = 8,
    seq_len: int = 128,
    expert_load: float = 1.0,
) -> JobPhases:
    """Predict each phase's peak of a training job on ``device``, on fake tensors.

    The job is the trainer's: load the model and apply the plan, two training steps, an
    evaluation pass of one batch of the training batch's shape, a checkpoint saved, then a
    fresh trainer that loads it and takes a step (see the module's docstring for each phase).
    Each phase runs the trainer's own code under its own tracker, as
    :func:`~memfit.estimate.dryrun.measure` runs steps; on the CPU the peaks equal the
    trainer's measured ``TrainResult.phases`` to the byte.

    Args:
        workload: A :class:`~memfit.workload.Workload`, or a SPEC (then ``batch_size`` and
            ``seq_len`` apply).
        plan: The plan (default: plain AdamW, fp32). One process: a data-parallel,
            tensor- or pipeline-parallel plan is refused.
        device: The target device (see :func:`~memfit.estimate.dryrun.measure`); default this
            machine's.
        seed: Seeds the model's initialisation and the batches.
        batch_size: With a SPEC: samples per step.
        seq_len: With a SPEC: tokens per sample.
        expert_load: How a mixture-of-experts router spreads tokens (``1.0``: evenly).

    Returns:
        The :class:`JobPhases`: every phase of :data:`JOB_PHASES` and the peak phase, with
        each phase's reserved and device-total figures from the target's allocator model.

    Raises:
        ValueError: for a plan of several processes.
        PlanError: when the plan asks for what the target cannot do.
    """
    from ..estimate.dryrun import dry_tensors, model_error, plan_for_target

    check_workload(workload, plan, batch_size, seq_len, seed)  # before any work (issue 37)
    check_type(device, (str, DeviceProfile, type(None)), "device",
               "a device name such as 'a100' or 'cpu', a custom description, a DeviceProfile "
               "or None")
    check_number(expert_load, "expert_load", 1)
    if isinstance(workload, str):
        workload = load_workload(workload, batch_size, seq_len)
    target = get_device(device)
    plan = plan_for_target(plan or Plan(), target)
    if plan.parallel.world_size > 1:
        raise ValueError(
            "the job's phases are predicted for one process; a plan of several processes "
            "saves a sharded checkpoint, which predict_job does not model yet"
        )
    job = _DryJob(workload, plan, target)
    with dry_tensors(expert_load, job.where):
        try:
            job.run(seed)
        except (WorkloadError, ValueError, torch.OutOfMemoryError):
            raise
        except Exception as e:  # the model's own failure, or one fake tensors cannot follow
            raise model_error(e) from e
    job.record.meta.update(
        model=workload.name,
        batch_size=workload.batch_size,
        seq_len=workload.seq_len,
        plan=plan.to_dict(),
        target_device=target.name,
        dry_run=True,
    )
    return job.record


def measure_job(
    workload: Workload | str,
    plan: Plan | None = None,
    *,
    seed: int = 0,
    batch_size: int = 8,
    seq_len: int = 128,
) -> JobPhases:
    """Measure each phase's peak of the job :func:`predict_job` predicts, for real, in this
    process: a :class:`~memfit.train.Trainer` trains two steps, evaluates one fresh batch of
    the workload and saves a checkpoint (into a temporary folder, removed after); a second
    trainer resumes from it and takes a third step. Phases are as the trainers'
    ``TrainResult.phases`` record them (the first run's, then the resumed run's
    ``load_checkpoint`` and ``resume``).

    Args:
        workload: A :class:`~memfit.workload.Workload`, or a SPEC.
        plan: The plan (default: plain AdamW, fp32); one process.
        seed: Seeds the model's initialisation and the batches.
        batch_size: With a SPEC: samples per step.
        seq_len: With a SPEC: tokens per sample.

    Returns:
        The measured :class:`JobPhases` (allocated peaks, by memfit's tracker).
    """
    import tempfile

    from .trainer import Trainer

    check_workload(workload, plan, batch_size, seq_len, seed)  # before any work (issue 37)
    if isinstance(workload, str):
        workload = load_workload(workload, batch_size, seq_len)
    plan = plan or Plan()
    with tempfile.TemporaryDirectory(prefix="memfit-job-") as folder:
        settings = dict(checkpoint_dir=folder, progress=False, warmup_steps=0, seed=seed)
        first = Trainer(workload, plan, max_steps=2, **settings)
        first.evaluation.data = _FreshBatches(workload, first.model)
        measured = first.fit().phases
        del first
        resumed = Trainer(workload, plan, max_steps=3, resume=True, **settings)
        again = resumed.fit().phases
    for name in ("load_checkpoint", "resume"):
        measured.phases[name] = again.phases[name]
    measured.meta.update(
        model=workload.name,
        batch_size=workload.batch_size,
        seq_len=workload.seq_len,
        plan=plan.to_dict(),
        dry_run=False,
    )
    return measured


class _FreshBatches:
    """Evaluation data: one fresh batch of the workload per pass, made as the pass asks for it
    (as a dataset's batches are collated during the evaluation)."""

    def __init__(self, workload: Workload, model: nn.Module) -> None:
        self.workload, self.model = workload, model

    def __iter__(self) -> Iterator[Any]:
        w = self.workload
        yield w.make_batch(self.model, w.batch_size, w.seq_len)


class _DryJob:
    """The phases of one job on fake tensors, each under a tracker of its own."""

    def __init__(self, workload: Workload, plan: Plan, target: DeviceProfile) -> None:
        self.workload, self.plan, self.target = workload, plan, target
        self.emulation = emulate(target)
        self.record = JobPhases()
        self.tracker: Any = None

    def where(self) -> str | None:
        """The module running now (for the dry run's data-dependent policies)."""
        return self.tracker and self.tracker.current_module

    @contextlib.contextmanager
    def phase(self, name: str, model: Any = None, optimizer: Any = None) -> Iterator[Any]:
        # A dry run's fake tensors sit on the CPU whatever the target: the tracker's device.
        self.tracker = track(model, optimizer, device="cpu")
        with self.tracker, self.emulation:
            yield self.tracker
        self.record.phases[name] = phase_peak(self.tracker, self.target)

    def _load(self, seed: int) -> tuple[nn.Module, Any]:
        """Build the model as the trainer does, then apply the plan."""
        model, batch = self.workload.build(
            seed=seed, pretrained=True, dtype=weights_dtype(self.plan.precision.mode)
        )
        del batch  # the trainer's batches come from its stream
        return model, apply_plan(model, self.plan, loss_fn=self.workload.loss_fn)

    def _batch(self, model: nn.Module) -> Any:
        w = self.workload
        return w.make_batch(model, w.batch_size, w.seq_len)

    def _step(self, name: str, model: nn.Module, setup: Any) -> None:
        batch = self._batch(model)
        with self.phase(name, model, setup.optimizer) as tracker:
            tracker.add_inputs(batch)
            setup.step(batch)

    def run(self, seed: int) -> None:
        """Every phase of :data:`JOB_PHASES`, in order."""
        with self.phase("load"):
            model, setup = self._load(seed)
        self._step("first_step", model, setup)
        self._step("steady_step", model, setup)
        plan, bs = setup.plan, self.workload.batch_size
        with self.phase("eval", model, setup.optimizer):
            # Made inside the phase, as an evaluation collates its batches as it goes.
            for _ in eval_losses(
                model,
                (self._batch(model) for _ in range(1)),
                loss_fn=setup.loss_fn,
                autocast=setup.precision.autocast,
                micro_batch_size=plan.micro_batch_for(max(1, bs // plan.parallel.data)),
            ):
                pass
        on_host = host_tier() if self.target.is_cuda else contextlib.nullcontext()
        with self.phase("save", model, setup.optimizer):
            with on_host:
                tree, tensors = checkpoint_state(2, setup.optimizer)
            stored = {k: (t.shape, t.dtype, _known_value(t)) for k, t in tensors.items()}
            del tensors
        # A fresh trainer resumes: its own load is the ``load`` phase above, untracked here.
        setup.remove()
        del model, setup
        model, setup = self._load(seed)
        with self.phase("load_checkpoint", model, setup.optimizer):
            self._restore(model, setup.optimizer, tree, stored)
        self._step("resume", model, setup)

    def _restore(self, model: nn.Module, optimizer: Any, tree: Any, stored: dict) -> None:
        """``load_checkpoint``'s allocations without the files: the state file's tensors read
        whole (host memory on a GPU), the weights file's read onto the device and copied into
        the parameters, then the optimizer's ``load_state_dict`` (onto the device on a GPU)."""
        on_host = host_tier() if self.target.is_cuda else contextlib.nullcontext()
        with on_host:
            files = {
                k: torch.empty(shape, dtype=dtype) if value is None
                else torch.tensor(value, dtype=dtype).reshape(shape)
                for k, (shape, dtype, value) in stored.items()
            }
        state = unflatten(tree, files)
        del files
        weights = {name: torch.empty_like(t) for name, t in _stored_weights(model).items()}
        model.load_state_dict(weights, strict=False)
        del weights
        saved = state["optimizer"]
        if optimizer is not None and saved is not None:
            if self.target.is_cuda:
                saved = _onto_device(saved)
            optimizer.load_state_dict(saved)


def _known_value(t: torch.Tensor) -> list[Any] | None:
    """The values of a small stored tensor whose values the dry run knows (an optimizer's
    ``step`` counter, which the next step reads), else ``None``: restored with them, the
    resumed step can run on fake tensors."""
    if t.numel() > 16:
        return None
    try:
        return t.tolist()
    except Exception:  # a fake tensor whose values the dry run does not know
        return None


def _stored_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint's weights file holds: the state dict, a storage shared by
    several names (tied weights) once, as safetensors' ``save_model`` stores it."""
    seen: set[int] = set()
    kept: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        key = t.untyped_storage()._cdata
        if key not in seen:
            seen.add(key)
            kept[name] = t
    return kept


def _onto_device(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict whose state tensors are device copies, as torch's
    ``Optimizer.load_state_dict`` moves them onto their parameters' device (``step`` counters
    stay on the host)."""
    moved = {}
    for idx, entry in state.get("state", {}).items():
        moved[idx] = {
            k: v.clone() if isinstance(v, torch.Tensor) and k != "step" else v
            for k, v in entry.items()
        }
    return {**state, "state": moved}
