"""Run a memfit :class:`~memfit.plan.Plan` inside the stock Hugging Face ``Trainer``.

:func:`apply` returns ``(training_args, optimizers, callbacks)`` for
``Trainer(model, args=training_args, optimizers=optimizers, callbacks=callbacks, ...)``:

* accumulation and micro-batch: ``gradient_accumulation_steps``, ``per_device_train_batch_size``;
* full checkpointing through transformers' own ``activation_checkpointing`` (the
  ``gradient_checkpointing`` names before 5.x); selective, sqrt and budget through memfit;
* mixed precision through ``bf16`` / ``fp16``; ``bf16-pure`` casts the model (memfit);
* the optimizer is memfit's, built from the plan (the Trainer's default linear schedule drives
  it); ``max_grad_norm`` becomes the Trainer's;
* the optimizer step fused into backward: the handle is passed as the optimizer and the
  Trainer's clipping is off (``max_grad_norm=0``: the gradients no longer exist when it would
  clip); a forward pre-hook reads accelerate's ``sync_gradients`` to tell the hooks whether this
  micro-batch ends the step, and :class:`MemfitCallback` finishes the step before the Trainer's
  ``optimizer.step()`` (parameters without a gradient in the last micro-batch, the norm for
  ``approx`` clipping) and logs the step's true ``grad_norm`` (the Trainer's own measure finds
  no gradient left and would log 0);
* freezing; length grouping (``train_sampling_strategy='group_by_length'``, the
  ``group_by_length`` flag before 5.x).

transformers is imported inside the functions: this module imports without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import warnings
from pathlib import Path
from typing import Any

from torch import nn

from ..plan import Plan

__all__ = ["MemfitCallback", "apply", "emit"]


def _args_fields(training_args: Any) -> set[str]:
    return {f.name for f in dataclasses.fields(training_args)}


def _checkpoint_names(fields: set[str]) -> tuple[str, str]:
    # transformers 5.x renamed gradient_checkpointing to activation_checkpointing.
    if "activation_checkpointing" in fields:
        return "activation_checkpointing", "activation_checkpointing_kwargs"
    return "gradient_checkpointing", "gradient_checkpointing_kwargs"


def args_changes(plan: Plan, fields: set[str] | None = None) -> dict[str, Any]:
    """The ``TrainingArguments`` fields a plan sets, as a mapping (also used by ``--emit hf``).

    Args:
        plan: The plan.
        fields: The field names of the installed ``TrainingArguments`` (default: 5.x names).
    """
    fields = fields if fields is not None else {"activation_checkpointing", "train_sampling_strategy"}
    out: dict[str, Any] = {"gradient_accumulation_steps": plan.grad_accum_steps}
    if plan.micro_batch_size is not None:
        out["per_device_train_batch_size"] = plan.micro_batch_size
    # The fused step clips in its own hooks; the Trainer would clip gradients that are gone.
    fused = plan.optimizer_in_backward
    out["max_grad_norm"] = 0.0 if fused or plan.max_grad_norm is None else plan.max_grad_norm
    out["bf16"] = plan.precision.mode == "bf16-mixed"
    out["fp16"] = plan.precision.mode == "fp16-mixed"
    if plan.checkpointing.mode == "full":
        flag, kwargs = _checkpoint_names(fields)
        out[flag] = True
        out[kwargs] = {"use_reentrant": False}
    if plan.sequence.group_by_length:
        # 5.x: a sampling strategy; before: a boolean.
        if "train_sampling_strategy" in fields:
            out["train_sampling_strategy"] = "group_by_length"
        else:
            out["group_by_length"] = True
    return out


def _memfit_side(plan: Plan) -> Plan:
    """What memfit applies itself: the plan less what the Trainer does."""
    changes: dict[str, Any] = {}
    if plan.precision.mode in ("bf16-mixed", "fp16-mixed"):
        changes["precision"] = dataclasses.replace(plan.precision, mode="fp32")
    if plan.checkpointing.mode == "full":
        changes["checkpointing"] = dataclasses.replace(plan.checkpointing, mode="none")
    return plan.replace(**changes) if changes else plan


def _check_supported(plan: Plan) -> None:
    # Each technique says whether the Trainer's loop can run it (memfit.techniques).
    from ..apply.compose import refuse_unsupported

    refuse_unsupported(plan, "hf", ValueError)


def apply(plan: Plan, model: nn.Module, training_args: Any) -> tuple[Any, tuple[Any, Any], list]:
    """Apply ``plan`` to ``model`` for the stock ``transformers.Trainer``.

    Example::

        args, optimizers, callbacks = memfit.integrations.hf.apply(plan, model, args)
        Trainer(model=model, args=args, optimizers=optimizers, callbacks=callbacks,
                train_dataset=ds).train()

    Args:
        plan: The plan.
        model: The (Hugging Face) model; changed in place.
        training_args: The user's ``TrainingArguments`` (not changed: a copy is returned).

    Returns:
        ``(training_args, (optimizer, None), [MemfitCallback])``: the updated arguments, the
        ``optimizers`` pair for the Trainer (``None``: its default schedule) and callbacks.

    Raises:
        ValueError: for a combination the Trainer cannot run (offload, exact clipping with the
            fused step, ``max_seq_len``, token normalisation), or one apply_plan refuses.
        MissingExtra: without accelerate (``pip install 'memfit[hf]'``).
    """
    from ..apply.compose import applied_by, apply_plan
    from ..extras import require

    # transformers' Trainer steps through accelerate; so do memfit's hooks (GradientState).
    require("accelerate", "memfit's Hugging Face integration (transformers' Trainer)")
    if not isinstance(plan, Plan):
        raise TypeError(f"apply(plan, model, training_args) takes a memfit.Plan first, got a "
                        f"{type(plan).__name__}")
    _check_supported(plan)
    changes = args_changes(plan, _args_fields(training_args))
    with applied_by("hf"):  # the techniques see the Trainer as their engine
        setup = apply_plan(model, _memfit_side(plan))
    new_args = dataclasses.replace(training_args, **changes)
    callback = MemfitCallback(plan=plan, setup=setup)
    if plan.optimizer_in_backward:
        callback.bridge = _FusedBridge(setup.optimizer, model)
    return new_args, (setup.optimizer, None), [callback]


class _FusedBridge:
    """Tells the fused step's hooks what the Trainer's next backward is (accumulate or step),
    through the stepper's public begin/end of a step run by someone else's backward."""

    def __init__(self, handle: Any, model: nn.Module) -> None:
        from ..apply.stepper import FusedStepper

        self.handle = handle
        self.stepper = FusedStepper(handle)
        # The Trainer logs a grad_norm every logging step; only the hooks can measure it.
        handle.track_grad_norm = True
        self._hook = model.register_forward_pre_hook(self._before_forward)

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        import torch
        from accelerate.state import GradientState

        if not (module.training and torch.is_grad_enabled()):
            return
        self.stepper.begin_step(last=GradientState().sync_gradients)

    def finish_step(self) -> None:
        """Before the Trainer's ``optimizer.step()``: leftovers, and this step's norm (logged,
        and approx clipping's coefficient for the next step)."""
        self.stepper.end_step()

    def remove(self) -> None:
        self._hook.remove()


def _trainer_callback_base() -> type:
    try:
        from transformers import TrainerCallback
    except ImportError:  # memfit imports without transformers; the callback needs it to run
        return object
    return TrainerCallback


class MemfitCallback(_trainer_callback_base()):  # type: ignore[misc]
    """Measure memory per step with memfit's tracker and log it through the Trainer.

    Every training log (the entries with ``loss``) gets ``memfit/peak_bytes`` (the run's peak
    so far) and ``memfit/live_bytes`` (live at that step); under the fused step its
    ``grad_norm`` is the norm the step's hooks measured (the Trainer measures after backward,
    when the gradients are gone, and would log 0). At the end of training
    ``memfit_report.json`` and ``memfit_report.png`` are written to ``output_dir``.

    How the figures get in: ``Trainer.log`` appends a copy of ``logs`` to
    ``state.log_history`` and only then calls ``on_log``, so a value added in ``on_log`` would
    miss the history (``trainer_state.json``) and every reporter (TensorBoard, W&B, the
    printer) called before this callback. So at ``on_train_begin`` the callback wraps that
    Trainer's ``log`` (an instance attribute, taken off at ``on_train_end``) and merges the
    figures into ``logs`` before the Trainer reads them: they reach the history and every
    callback whatever the callback order, and a subclass's ``log`` override (TRL's trainers)
    sees them too. Callbacks are not handed the Trainer; it is found as the caller of the
    event (the ``Trainer`` whose ``callback_handler`` holds this callback).

    Args:
        plan: The plan applied (recorded in the report's meta).
        setup: The :class:`~memfit.apply.compose.TrainingSetup` (its optimizer is tracked).
        track: Whether to track memory (the tracker slows training; off keeps only the bridge).
        plot: Whether to write the PNG.
    """

    def __init__(self, plan: Plan | None = None, setup: Any = None, *, track: bool = True,
                 plot: bool = True) -> None:
        self.plan = plan
        self.setup = setup
        self.track = track
        self.plot = plot
        self.bridge: _FusedBridge | None = None
        self.tracker: Any = None
        self.report: Any = None
        self._trainer: Any = None
        self._log: Any = None  # the wrapper installed as the Trainer's ``log``
        self._log_before: Any = None  # the instance attribute it replaced, if any

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._wrap_log(_calling_trainer(self))
        if not self.track:
            return
        from ..accounting import track

        model = kwargs.get("model")
        optimizer = self.setup.optimizer if self.setup is not None else kwargs.get("optimizer")
        self.tracker = track(model, optimizer)
        self.tracker.__enter__()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.bridge is not None:
            self.bridge.finish_step()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.tracker is not None:
            self.tracker.mark_step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._unwrap_log()
        if self.tracker is None:
            return
        self.tracker.__exit__(None, None, None)
        self.report = self.tracker.report()
        self.tracker = None
        if self.plan is not None:
            self.report.meta["plan"] = self.plan.to_dict()
        out = Path(args.output_dir)
        self.report.to_json(out / "memfit_report.json")
        if self.plot:
            with contextlib.suppress(ImportError):  # matplotlib is optional
                self.report.plot(out / "memfit_report.png", title="memfit: Trainer memory")

    def _add_figures(self, logs: dict[str, Any]) -> None:
        """Put memfit's figures into a training log (``logs`` with ``loss``), in place."""
        if "loss" not in logs:  # evaluation metrics, the end-of-training summary
            return
        if self.tracker is not None:
            logs["memfit/peak_bytes"] = self.tracker.peak_bytes
            logs["memfit/live_bytes"] = self.tracker.live_bytes
        norm = None if self.bridge is None else self.bridge.handle.last_norm
        if norm is not None and "grad_norm" in logs:
            logs["grad_norm"] = norm.item()

    def _wrap_log(self, trainer: Any) -> None:
        self._unwrap_log()  # a train() that raised never reached on_train_end
        if trainer is None:
            warnings.warn(
                "MemfitCallback: on_train_begin was not called by a transformers.Trainer, so "
                "memfit's figures are not added to its logs",
                stacklevel=3,
            )
            return
        inner = trainer.log

        def log(logs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            self._add_figures(logs)
            return inner(logs, *args, **kwargs)

        self._trainer, self._log, self._log_before = trainer, log, vars(trainer).get("log")
        trainer.log = log

    def _unwrap_log(self) -> None:
        trainer, self._trainer = self._trainer, None
        # Only undo our own wrapper: one installed over it stays (and keeps calling ours).
        if trainer is None or vars(trainer).get("log") is not self._log:
            return
        if self._log_before is None:
            del trainer.log
        else:
            trainer.log = self._log_before


def _calling_trainer(callback: Any) -> Any:
    """The ``transformers.Trainer`` up the call stack whose callbacks include ``callback``."""
    from transformers import Trainer

    frame = inspect.currentframe()
    try:
        while frame is not None:
            obj = frame.f_locals.get("self")
            if isinstance(obj, Trainer) and callback in obj.callback_handler.callbacks:
                return obj
            frame = frame.f_back
    finally:
        del frame  # a frame referencing itself would keep every local alive until gc
    return None


def emit(plan: Plan) -> str:
    """Python that runs ``plan`` in the Hugging Face Trainer: it builds the plan, and defines
    ``train(model, train_dataset, **arguments)``, which makes the ``TrainingArguments`` the
    plan sets (``arguments`` add or override fields: ``output_dir``, ``use_cpu``, ...), applies
    the plan and trains. Valid Python as it stands (the plan a Python literal, not JSON):
    save it as a file and import it, or ``exec`` it, then call ``train``."""
    import pprint

    changes = args_changes(plan)
    literal = pprint.pformat(plan.to_dict(), indent=4, width=92, sort_dicts=False)
    lines = [
        "# memfit plan --emit hf: the chosen plan in the Hugging Face Trainer.",
        "# Run it with: train(model, train_dataset, output_dir='out')",
        "import memfit",
        "from memfit.integrations import hf",
        "",
        "plan = memfit.Plan.from_dict(",
        *("    " + line for line in literal.splitlines()),
        ")",
        "",
        "",
        "def train(model, train_dataset, **arguments):",
        '    """Train model on train_dataset under the plan; arguments: more TrainingArguments."""',
        "    from transformers import Trainer, TrainingArguments",
        "",
        "    # TrainingArguments set by the plan (hf.apply sets them too, and checks the rest)",
        "    settings = dict(",
        "        output_dir='out',",
        *(f"        {k}={v!r}," for k, v in changes.items()),
        "    )",
        "    settings.update(arguments)",
        "    args = TrainingArguments(**settings)",
        "    args, optimizers, callbacks = hf.apply(plan, model, args)",
        "    trainer = Trainer(model=model, args=args, optimizers=optimizers, callbacks=callbacks,",
        "                      train_dataset=train_dataset)",
        "    trainer.train()",
        "    return trainer",
    ]
    return "\n".join(lines) + "\n"
