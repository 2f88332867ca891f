"""Out-of-memory step-down: when a step runs out of memory, use less and redo the same step.

* :func:`step_down` is the next plan on a simple frontier: halve the micro-batch (doubling the
  accumulation steps, so the effective batch and the gradient are unchanged), then turn on
  ``selective`` checkpointing, then ``full``.
* :func:`switch_plan` moves a :class:`~memfit.apply.compose.TrainingSetup` to another plan
  on the same model: what changes is removed and applied again (every technique's ``apply``
  returns a removable handle), and the optimizer object, with its state, carries over when
  the change allows it.
* :class:`OOMFallback` runs steps and, on ``torch.OutOfMemoryError`` (a real device OOM or
  memfit's virtual cap), frees what the failed attempt held, switches to the next plan and redoes
  the step from the same batch with the RNG state it started with: no sample is lost and the
  result is what the smaller plan would have computed from the start.

A step can be redone only while no parameter has changed. An OOM inside the optimizer step (or,
with ``optimizer_in_backward``, after the first parameter stepped) leaves the parameters and
the optimizer state half-updated; :class:`OOMFallback` then raises instead of guessing.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..apply.compose import TrainingSetup, apply_plan
from ..plan import Plan, PlanError
from ..techniques import ApplyContext, Technique, get, registered
from ..workload import Batch, batch_size_of
from .checkpoint import restore_rng_state, rng_state

__all__ = ["OOMFallback", "StepDown", "step_down", "switch_plan"]

logger = logging.getLogger("memfit.train")

# ---------------------------------------------------------------------------------- frontier
def step_down(plan: Plan, batch_size: int) -> Plan | None:
    """The next plan that uses less activation memory for the same effective batch.

    In order: halve the micro-batch and accumulate over twice as many (while the micro-batch
    is above 1), then ``selective`` checkpointing, then ``full`` checkpointing.

    Args:
        plan: The plan that ran out of memory.
        batch_size: The effective batch (samples per optimizer step).

    Returns:
        The next plan, or ``None`` when the frontier is exhausted (micro-batch 1 and full
        checkpointing).
    """
    micro = min(plan.micro_batch_for(batch_size), batch_size)
    if micro > 1:
        smaller = max(1, micro // 2)
        try:
            return plan.replace(
                micro_batch_size=smaller, grad_accum_steps=-(-batch_size // smaller)
            )
        except PlanError:
            # Accumulation is not allowed with this plan (exact clipping fused into
            # backward): go on to checkpointing.
            pass
    mode = plan.checkpointing.mode
    if mode == "full":
        return None
    # From none: selective first (most of the saving for a few percent of compute); from
    # selective, sqrt or budget: full, which keeps the least.
    nxt = "selective" if mode == "none" else "full"
    return plan.replace(checkpointing=dataclasses.replace(plan.checkpointing, mode=nxt))


def _changed(a: Plan, b: Plan) -> list[Technique]:
    """The registered techniques whose config differs between ``a`` and ``b``."""
    return [
        t for t in registered() if t.on(a) != t.on(b) or (t.on(b) and t.config(a) != t.config(b))
    ]


def _keeps_optimizer(a: Plan, b: Plan) -> bool:
    """Whether switching from ``a`` to ``b`` can keep the optimizer object and its state: every
    technique that changes says it may be swapped in place (its ``swappable``), and no plan
    field outside the techniques changed."""
    owned = {name for t in registered() for name in t.fields}
    unowned = [
        f.name
        for f in dataclasses.fields(Plan)
        if f.name not in owned and getattr(a, f.name) != getattr(b, f.name)
    ]
    return not unowned and all(t.can_swap(a, b) for t in _changed(a, b))


def switch_plan(setup: TrainingSetup, plan: Plan) -> tuple[TrainingSetup, bool]:
    """Move ``setup`` to ``plan`` on the same model: remove what changes, apply it again.

    When the change leaves the parameters and the optimizer alone (micro-batching,
    accumulation, loss normalisation, truncation, sequence shaping, checkpointing, the fused
    loss, clipping
    with an ordinary optimizer, a precision among fp32 / bf16-mixed / fp16-mixed), only the
    changed handles are replaced and the same optimizer object (with its state) goes on. Any
    other change (optimizer, bf16-pure, freezing, the fused step) removes the whole plan
    (:meth:`~memfit.apply.compose.TrainingSetup.remove`: bf16 weights back to their dtype
    with their trained values, freezing lifted, hooks and wrappers gone) and applies ``plan``
    afresh: the plan's optimizer is rebuilt and its state restarts, while an optimizer the
    caller gave is kept (unless ``plan`` fuses the step into backward).

    Args:
        setup: The current setup (it must not be used after the switch).
        plan: The plan to switch to.

    Returns:
        ``(new_setup, rebuilt)``; ``rebuilt`` tells that the optimizer is a new object (an LR
        scheduler must be re-attached to it).
    """
    model = setup.model
    if _keeps_optimizer(setup.plan, plan):
        return _swap_in_place(setup, plan), False
    optimizer = setup.optimizer if setup.optimizer_given and not plan.optimizer_in_backward else None
    adapters = None
    if plan.lora is not None and plan.lora == setup.plan.lora:
        from ..strategies.lora import adapter_state, load_adapter_state

        # Removing the plan drops LoRA's adapters; the same adapters go on with what they
        # learnt (only their optimizer state restarts, as any rebuilt optimizer's).
        adapters = adapter_state(model)
    setup.remove()
    new = apply_plan(model, plan, optimizer=optimizer, loss_fn=setup.loss_fn)
    if adapters is not None:
        load_adapter_state(model, adapters)
    new.steps_done = setup.steps_done
    return new, new.optimizer is not setup.optimizer


def _swap_in_place(setup: TrainingSetup, plan: Plan) -> TrainingSetup:
    """Take off the techniques whose config changed and apply their new config at their
    place in the order; keep the optimizer."""
    ctx = ApplyContext(
        plan=plan,
        engine="single" if setup.parallel is None else "data",
        info=dict(setup.info),
        precision=setup.precision,
        parallel=setup.parallel,
        optimizer=setup.optimizer,
        optimizer_given=setup.optimizer_given,
    )
    handles = list(setup.handles)
    for technique in _changed(setup.plan, plan):
        if technique.apply is None:
            continue  # a technique of the step: the new plan's fields are all it needs
        index = _index(handles, technique.name)
        if index is not None:
            handles.pop(index)[1].remove()
        if technique.info_key is not None:
            ctx.info.pop(technique.info_key, None)
        if technique.on(plan):
            handle = technique.apply(setup.model, ctx)
            if handle is not None:
                handles.insert(_position(handles, technique.order), (technique.name, handle))
    if plan.optimizer_in_backward:
        # The fused handle counts micro-batches itself when not told which is the last.
        setup.optimizer.grad_accum_steps = plan.grad_accum_steps
    setup.handles = []  # now owned by the new setup
    setup.removed = True
    return dataclasses.replace(
        setup,
        plan=plan,
        precision=ctx.precision,
        stepper=None,
        info=ctx.info,
        handles=handles,
        removed=False,
    )


def _position(handles: list[tuple[str, Any]], order: int) -> int:
    """Where a handle of a technique at ``order`` goes: after every one applied before it."""
    for i, (name, _) in enumerate(handles):
        if get(name).order > order:
            return i
    return len(handles)


def _index(handles: list[tuple[str, Any]], name: str) -> Any:
    return next((i for i, (n, _) in enumerate(handles) if n == name), None)


# ---------------------------------------------------------------------------------- fallback
@dataclass(frozen=True)
class StepDown:
    """One step-down taken after an out-of-memory error.

    Attributes:
        step: The optimizer step (0-based) that ran out of memory and was redone.
        error: The first line of the out-of-memory message.
        from_plan: The plan that failed (as a dict).
        to_plan: The plan the step was redone with.
        summary: One line saying what changed.
        rebuilt: Whether the optimizer had to be rebuilt (its state restarted).
    """

    step: int
    error: str
    from_plan: dict[str, Any]
    to_plan: dict[str, Any]
    summary: str
    rebuilt: bool

    def to_dict(self) -> dict[str, Any]:
        """Plain data."""
        return dataclasses.asdict(self)


class OOMFallback:
    """Run training steps; on out-of-memory, step the plan down and redo the step.

    Example::

        runner = OOMFallback(apply_plan(model, plan), batch_size=32)
        for batch in batches:
            loss = runner.step(batch)   # never loses a batch to an OOM
        runner.step_downs               # what it did

    Args:
        setup: The setup to start from.
        batch_size: The effective batch (for :func:`step_down`); default: each batch's size.
        fallback_plans: An explicit frontier (for example the planner's). Those that keep the
            optimizer are tried first, in order; then :func:`step_down`; the ones that need a
            new optimizer (state restarts) only after that (see :meth:`next_plan`).
        log: Called with one line per step-down (default: the ``memfit.train`` logger).
        on_switch: Called with ``(setup, rebuilt)`` after each switch (for example to attach
            an LR scheduler to a rebuilt optimizer).

    Attributes:
        setup: The current setup (its ``plan`` is the plan in force).
        step_downs: The :class:`StepDown` records, oldest first.
    """

    def __init__(
        self,
        setup: TrainingSetup,
        *,
        batch_size: int | None = None,
        fallback_plans: Sequence[Plan] | None = None,
        log: Callable[[str], None] | None = None,
        on_switch: Callable[[TrainingSetup, bool], None] | None = None,
    ) -> None:
        self.setup = setup
        self.batch_size = batch_size
        self._pending: list[Plan] = list(fallback_plans or [])
        self.log = log or logger.warning
        self.on_switch = on_switch
        self.step_downs: list[StepDown] = []
        self.steps = 0

    @property
    def plan(self) -> Plan:
        """The plan in force."""
        return self.setup.plan

    def next_plan(self, batch_size: int, after: Plan | None = None) -> Plan | None:
        """The plan to try after ``after`` (default: the current plan) ran out of memory.

        In this order: the explicit fallback plans that keep the optimizer (they differ only in
        micro-batching, accumulation, normalisation or checkpointing), in their order; then
        :func:`step_down`; then, when that is exhausted, the explicit plans that need a new
        optimizer (its state would restart), in their order. ``None`` when none is left.
        """
        base = after or self.plan
        for i, candidate in enumerate(self._pending):
            if candidate != base and _keeps_optimizer(self.plan, candidate):
                return self._pending.pop(i)
        nxt = step_down(base, batch_size)
        if nxt is not None:
            return nxt
        while self._pending:
            candidate = self._pending.pop(0)
            if candidate != base:
                return candidate
        return None

    def step(self, batch: Batch) -> torch.Tensor:
        """One optimizer step on ``batch``, stepping down as often as needed.

        Raises:
            torch.OutOfMemoryError: when no plan is left, or the OOM struck after parameters
                had started to change (the step cannot be redone exactly).
        """
        bs = self.batch_size or batch_size_of(batch)
        while True:
            rng = rng_state()
            watch = _StepWatch()
            message = None
            try:
                with watch:
                    loss = self.setup.step(batch)
            except torch.OutOfMemoryError as e:
                message = str(e).strip().splitlines()[0] if str(e).strip() else "out of memory"
            if message is None:
                self.steps += 1
                return loss
            # Outside the except block: the exception's traceback, which holds the failed
            # attempt's tensors, is gone, so collecting now frees them.
            self._free()
            if self.setup.parallel is not None:
                raise torch.OutOfMemoryError(
                    f"{message} This process ran out of memory in a run on several processes, "
                    "where every process must switch plans together, which is not available "
                    "yet; choose a plan with a smaller per-process peak (memfit plan "
                    "--world-size N) and start again."
                )
            if watch.stepped:
                raise torch.OutOfMemoryError(
                    f"{message} The optimizer had already updated parameters when memory ran "
                    "out, so the step cannot be redone exactly; choose a plan with less "
                    "optimizer-step memory (foreach off, a lighter optimizer)."
                )
            if not self._step_down(bs, message):
                raise torch.OutOfMemoryError(
                    f"{message} No smaller plan is left (micro-batch 1 with full "
                    "checkpointing); raise the budget or choose a lighter plan."
                )
            restore_rng_state(rng)

    def _step_down(self, batch_size: int, message: str) -> bool:
        """Switch to the next plan that can be applied; ``False`` when none is left."""
        candidate = self.next_plan(batch_size)
        while candidate is not None:
            try:
                self._switch(candidate, message)
                return True
            except ValueError as e:
                # A plan this model cannot take (checkpointing a model without repeated
                # blocks): go on down the frontier from it.
                self.log(f"cannot step down to {candidate.summary()}: {e}")
                candidate = self.next_plan(batch_size, after=candidate)
        return False

    def _switch(self, plan: Plan, message: str) -> None:
        old = self.plan
        self.setup, rebuilt = switch_plan(self.setup, plan)
        record = StepDown(
            step=self.steps,
            error=message,
            from_plan=old.to_dict(),
            to_plan=plan.to_dict(),
            summary=plan.summary(),
            rebuilt=rebuilt,
        )
        self.step_downs.append(record)
        extra = " (optimizer rebuilt: its state restarts)" if rebuilt else ""
        self.log(f"out of memory at step {self.steps + 1}; redoing it with: {plan.summary()}{extra}")
        if self.on_switch is not None:
            self.on_switch(self.setup, rebuilt)

    def _free(self) -> None:
        # Gradients accumulated by the micro-batches before the failure are discarded (the
        # step is redone from its start); cycles in the failed graph need a collection.
        self.setup.optimizer.zero_grad(set_to_none=True)
        for p in self.setup.model.parameters():
            p.grad = None
        gc.collect()
        if torch.accelerator.is_available():
            torch.accelerator.empty_cache()


class _StepWatch:
    """Notices whether any optimizer began a step while the context is open."""

    def __init__(self) -> None:
        self.stepped = False
        self._handle: Any = None

    def _hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.stepped = True

    def __enter__(self) -> _StepWatch:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self._handle = register_optimizer_step_pre_hook(self._hook)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._handle.remove()
