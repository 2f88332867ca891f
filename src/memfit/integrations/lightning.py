"""Apply a memfit :class:`~memfit.plan.Plan` inside a stock ``lightning.Trainer``.

Lightning owns the training loop, so the plan is split between the two:

* **Lightning** does accumulation (``accumulate_grad_batches``), autocast precision
  (``precision="bf16-mixed"``/``"16-mixed"``), gradient clipping (``gradient_clip_val``, by
  norm) and the optimizer step. :func:`trainer_kwargs` gives those Trainer arguments for a plan;
  :class:`MemfitCallback` checks at ``setup`` that the Trainer got them.
* **The callback** applies the model-side techniques with memfit's ``apply_x`` functions at
  ``setup`` (freezing, fused pointwise, fused loss, ``bf16-pure`` weights, checkpointing) and
  removes them, last first, at ``teardown``; :meth:`MemfitCallback.configure_optimizers` builds
  the plan's optimizer (memfit's AdamW8bit/Adafactor included) for the LightningModule's own
  ``configure_optimizers`` to return.
* **Memory** is measured with memfit's tracker from ``on_train_start`` to ``on_train_end``;
  each step's live and peak bytes are logged through ``pl_module.log`` and the report (JSON
  and PNG) is written to ``report_dir`` when training ends. The callback sets gradients to
  ``None`` right after each optimizer step (Lightning itself zeroes them only after the next
  forward, so they would live beside that forward's activations); with that the measured peak
  is the dry run's, plus Lightning's prefetched next batch (one more batch of inputs).

The fused step (``optimizer_in_backward``) needs Lightning's *manual* optimization: automatic
optimization calls ``optimizer.step(closure)`` and runs backward inside that closure, after
which there is nothing left to step, and Lightning would clip gradients the hooks already
freed. Set ``self.automatic_optimization = False`` and call ``callback.backward(self, loss)``
in ``training_step`` (it weights the loss by ``1/grad_accum_steps``, runs the fused backward
and, on the last micro-batch, calls the LightningOptimizer's no-op ``step`` so that
``global_step`` counts); the handle does accumulation and clipping, so the Trainer gets
``accumulate_grad_batches=1`` and no ``gradient_clip_val``. A module left on automatic
optimization is refused at ``setup``. The gradients are freed inside backward, so nothing
after it (Lightning's ``grad_norm`` utility in ``on_before_optimizer_step``) can measure them:
the hooks measure each step's unclipped global norm and the callback logs it as
``memfit/grad_norm``.

Not supported (refused with a sentence saying why): offload,
``compile`` (use Lightning's own ``torch.compile`` of the module), ``max_seq_len``,
``loss_normalization: tokens`` (Lightning divides each micro-batch loss by the accumulation
count) and a non-default ``sequence`` config (data shaping belongs to the DataLoader). The
plan's ``micro_batch_size`` is the DataLoader's ``batch_size``, which the callback checks on
the first batch.

``lightning`` is imported only when the callback is built, so ``import memfit`` works without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..accounting import MemoryTracker
from ..plan import Plan, PlanError
from ..workload import batch_size_of

# MemfitCallback comes from the module __getattr__ (it imports lightning).
__all__ = ["LIGHTNING_PRECISION", "MemfitCallback", "check_plan", "trainer_kwargs"]  # noqa: F822

#: Lightning's precision string for each plan precision mode. ``bf16-pure`` is done by the
#: callback (bf16 weights, the plan's optimizer wrapped for them), so Lightning runs "32-true"
#: and adds no autocast of its own.
LIGHTNING_PRECISION = {
    "fp32": "32-true",
    "bf16-mixed": "bf16-mixed",
    "fp16-mixed": "16-mixed",
    "bf16-pure": "32-true",
}


def trainer_kwargs(plan: Plan) -> dict[str, Any]:
    """The ``lightning.Trainer`` arguments that carry ``plan``'s loop-side fields.

    Args:
        plan: The plan.

    Returns:
        ``accumulate_grad_batches``, ``precision``, ``gradient_clip_val`` and
        ``gradient_clip_algorithm`` (``"norm"``), to pass as ``Trainer(**kwargs, ...)``.

    Raises:
        PlanError: for a plan field Lightning cannot carry (see :func:`check_plan`).
    """
    check_plan(plan)
    fused = plan.optimizer_in_backward
    return {
        # With the fused step the callback's handle accumulates and clips (Lightning's manual
        # optimization allows neither accumulate_grad_batches nor gradient_clip_val).
        "accumulate_grad_batches": 1 if fused else plan.grad_accum_steps,
        "precision": LIGHTNING_PRECISION[plan.precision.mode],
        "gradient_clip_val": None if fused else plan.max_grad_norm,
        "gradient_clip_algorithm": "norm",
    }


def check_plan(plan: Plan) -> None:
    """Refuse the plan fields the Lightning integration cannot honour, one sentence each.

    Raises:
        PlanError: naming the field and what to do instead.
    """
    # Each technique says whether a lightning.Trainer with this callback can run it.
    from ..apply.compose import refuse_unsupported

    refuse_unsupported(plan, "lightning", PlanError)


_CALLBACK_DOC = """A ``lightning.Callback`` that applies ``plan`` and measures memory.

    The class is made on first access of ``memfit.integrations.lightning.MemfitCallback`` (a
    module ``__getattr__``), so ``lightning`` is imported only then. Use it as::

        plan = memfit.Plan(grad_accum_steps=4, checkpointing="full", precision="bf16-mixed")
        cb = MemfitCallback(plan, report_dir="memfit-report")

        class Module(L.LightningModule):
            def configure_optimizers(self):
                return cb.configure_optimizers(self)

        L.Trainer(callbacks=[cb], **trainer_kwargs(plan)).fit(Module(), loader)

    Args:
        plan: The plan.
        report_dir: Where ``memory_report.json`` and ``memory_report.png`` go at the end of
            training (``None``: not written; the report is still ``callback.report``).
        model_attr: The attribute of the LightningModule holding the model the techniques
            apply to (default ``"model"``; the LightningModule itself when it has none).
        log: Log ``memfit/live_bytes`` and ``memfit/peak_bytes`` every step, and with the
            fused step ``memfit/grad_norm`` (the step's true unclipped norm) every optimizer
            step. They reach ``trainer.callback_metrics``, and the loggers and
            ``trainer.logged_metrics`` every ``log_every_n_steps``.
        check_trainer: Raise at ``setup`` when the Trainer's accumulation, precision or clipping
            differ from the plan's.
"""

_CLASS: type | None = None


def __getattr__(name: str) -> Any:
    # MemfitCallback subclasses lightning.Callback: build it (importing lightning) on first use.
    if name == "MemfitCallback":
        global _CLASS
        if _CLASS is None:
            _CLASS = _make_class()
        return _CLASS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _make_class() -> type:
    from ..extras import import_extra

    L = import_extra("lightning", "memfit's Lightning integration (MemfitCallback)")

    class _MemfitCallback(_CallbackMethods, L.Callback):
        __doc__ = _CALLBACK_DOC

    _MemfitCallback.__name__ = _MemfitCallback.__qualname__ = "MemfitCallback"
    return _MemfitCallback


class _CallbackMethods:
    """``MemfitCallback``'s methods. The class itself (:func:`_make_class`) puts them before
    ``lightning.Callback`` in its bases, so that ``lightning`` is imported only when the class
    is made, and its hooks are these."""

    def __init__(
        self,
        plan: Plan,
        *,
        report_dir: str | Path | None = None,
        model_attr: str = "model",
        log: bool = True,
        check_trainer: bool = True,
    ) -> None:
        if not isinstance(plan, Plan):
            raise TypeError(f"MemfitCallback takes a memfit.Plan, got a {type(plan).__name__}")
        check_plan(plan)
        self.plan = plan
        self.report_dir = None if report_dir is None else Path(report_dir)
        self.model_attr = model_attr
        self.log = log
        self.check_trainer = check_trainer
        self.handles: list[tuple[str, Any]] = []
        self.precision: Any = None
        self.tracker: MemoryTracker | None = None
        self.report: Any = None
        self.info: dict[str, Any] = {}
        self._checked_batch = False
        self._last_step = 0
        self._handle: Any = None
        self._stepper: Any = None  # the FusedStepper over _handle
        self._micro = 0  # micro-batches done in the current fused step

    # ------------------------------------------------------------ model side
    def target(self, pl_module: nn.Module) -> nn.Module:
        """The module the techniques apply to (``pl_module.<model_attr>`` or itself)."""
        inner = getattr(pl_module, self.model_attr, None)
        return inner if isinstance(inner, nn.Module) else pl_module

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or self.handles:
            return
        if self.plan.optimizer_in_backward and pl_module.automatic_optimization:
            raise PlanError(
                "optimizer_in_backward needs manual optimization in Lightning: set "
                "self.automatic_optimization = False in the LightningModule and call "
                "callback.backward(self, loss) in training_step"
            )
        if self.check_trainer:
            _check_trainer(trainer, self.plan)
        self._apply(self.target(pl_module))

    def _apply(self, model: nn.Module) -> None:
        from ..apply.compose import apply_techniques
        from ..techniques import ApplyContext

        # The registry's loop up to the optimizer, which configure_optimizers builds;
        # Lightning's precision plugin autocasts (only bf16-pure changes the model) and its
        # strategy does data parallelism.
        ctx = ApplyContext(plan=self.plan, engine="lightning", info=self.info)
        self.handles.extend(apply_techniques(model, self.plan, ctx, until="optimizer"))
        self.precision = ctx.precision

    def remove(self) -> None:
        """Take the techniques off the model, last first (idempotent)."""
        while self.handles:
            self.handles.pop()[1].remove()
        self.precision = None
        self._handle = None
        self._stepper = None

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self.remove()

    def configure_optimizers(self, pl_module: nn.Module) -> torch.optim.Optimizer:
        """The plan's optimizer over the module's trainable parameters.

        Call it from the LightningModule's ``configure_optimizers`` (Lightning calls that
        after the callback's ``setup``, so frozen parameters are already left out and
        ``bf16-pure`` weights are already bf16).
        """
        if self.plan.optimizer_in_backward:
            return self._fused(pl_module)
        params = [p for p in pl_module.parameters() if p.requires_grad]
        if self.precision is not None:
            cfg = self.precision.optimizer_config(self.plan.optimizer)
            return self.precision.wrap_optimizer(cfg.build(params))
        return self.plan.optimizer.build(params)

    def _fused(self, pl_module: nn.Module) -> Any:
        from ..apply.stepper import FusedStepper
        from ..strategies.fused_step import optimizer_in_backward

        plan, runtime = self.plan, self.precision
        cfg = plan.optimizer if runtime is None else runtime.optimizer_config(plan.optimizer)

        def build(params: Any) -> Any:
            opt = cfg.build(params)
            return opt if runtime is None else runtime.wrap_optimizer(opt)

        handle = optimizer_in_backward(
            pl_module,
            build,
            grad_accum_steps=plan.grad_accum_steps,
            max_grad_norm=plan.max_grad_norm,
            clip_mode=plan.grad_clip_mode,
            track_grad_norm=True,  # logged as memfit/grad_norm: nothing else can measure it
        )
        self.handles.append(("optimizer_in_backward", handle))
        self._handle = handle
        self._stepper = FusedStepper(handle)
        fused_step = handle.step

        def step(closure: Any = None) -> None:
            # Lightning's manual step passes a closure that does nothing (the backward ran
            # in training_step); the handle refuses closures, so run it here and step.
            if closure is not None:
                closure()
            fused_step()

        handle.step = step  # on the instance: gone with the handle at teardown
        return handle

    def backward(self, pl_module: Any, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss with the fused step (manual optimization).

        The loss is weighted by ``1/grad_accum_steps`` (the plan's ``mean``); on the last
        micro-batch of a step the parameters are updated inside this backward.

        Raises:
            RuntimeError: when the plan has no ``optimizer_in_backward`` or
                ``configure_optimizers`` did not return :meth:`configure_optimizers`.
        """
        stepper = self._stepper
        if stepper is None:
            raise RuntimeError(
                "callback.backward is for plans with optimizer_in_backward whose "
                "configure_optimizers returns callback.configure_optimizers(self)"
            )
        k = self.plan.grad_accum_steps
        last = self._micro + 1 >= k
        self._micro = 0 if last else self._micro + 1
        stepper.backward(loss / k, last=last)
        if last:
            # A no-op step (the parameters moved in backward) that Lightning counts.
            pl_module.optimizers().step()

    # ------------------------------------------------------------ memory
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._last_step = trainer.global_step
        self.tracker = MemoryTracker(pl_module, list(trainer.optimizers) or None)
        self.tracker.__enter__()

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._checked_batch:
            self._checked_batch = True
            mb = self.plan.micro_batch_size
            if mb is not None and batch_size_of(batch) != mb:
                raise PlanError(
                    f"the plan's micro_batch_size is {mb} but the DataLoader gives batches "
                    f"of {batch_size_of(batch)}; set the DataLoader's batch_size to {mb}"
                )
        if self.tracker is not None:
            self.tracker.add_inputs(batch)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stepped = trainer.global_step != self._last_step
        if stepped:
            # An optimizer step ran on this batch. Lightning zeroes gradients inside the
            # next step's closure, after that step's forward: the old gradients would
            # then live through a whole forward (gradients + activations at once). Drop
            # them now, as memfit's own loop does; Lightning's later zero_grad is a no-op.
            self._last_step = trainer.global_step
            for opt in trainer.optimizers:
                opt.zero_grad(set_to_none=True)
        if not self.log:
            return
        t = self.tracker
        if t is not None:
            # Logged as floats in MiB-free bytes; on_step only, so nothing accumulates.
            live, peak = float(t.live_bytes), float(t.peak_bytes)
            pl_module.log("memfit/live_bytes", live, on_step=True, on_epoch=False)
            pl_module.log("memfit/peak_bytes", peak, on_step=True, on_epoch=False)
        norm = None if self._handle is None else self._handle.last_norm
        if stepped and norm is not None:
            pl_module.log("memfit/grad_norm", norm, on_step=True, on_epoch=False)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        t, self.tracker = self.tracker, None
        if t is None:
            return
        t.__exit__(None, None, None)
        self.report = t.report()
        if self.report_dir is not None:
            self.report_dir.mkdir(parents=True, exist_ok=True)
            self.report.to_json(self.report_dir / "memory_report.json")
            self.report.plot(self.report_dir / "memory_report.png", title="memfit: Lightning")

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.tracker is not None:
            self.tracker.__exit__(None, None, None)
            self.tracker = None
        self.remove()


def _check_trainer(trainer: Any, plan: Plan) -> None:
    """Raise when the Trainer's loop settings differ from :func:`trainer_kwargs` of ``plan``."""
    want = trainer_kwargs(plan)
    got_precision = str(trainer.precision)
    problems = []
    if trainer.accumulate_grad_batches != want["accumulate_grad_batches"]:
        problems.append(
            f"accumulate_grad_batches={trainer.accumulate_grad_batches} (plan: "
            f"{want['accumulate_grad_batches']})"
        )
    if got_precision != want["precision"]:
        problems.append(f"precision={got_precision!r} (plan: {want['precision']!r})")
    if trainer.gradient_clip_val != want["gradient_clip_val"]:
        problems.append(
            f"gradient_clip_val={trainer.gradient_clip_val} (plan: {want['gradient_clip_val']})"
        )
    if problems:
        raise PlanError(
            "the lightning.Trainer does not match the plan: "
            + "; ".join(problems)
            + "; build it with Trainer(**memfit.integrations.lightning.trainer_kwargs(plan))"
        )
