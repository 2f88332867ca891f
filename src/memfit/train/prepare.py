"""``prepare``: a plan applied to a model for people who keep their own training loop.

``prepare(model, plan=None, *, optimizer=None, loss_fn=None)`` takes the arguments of
:func:`memfit.apply_plan` in the same order and wraps its
:class:`~memfit.apply.compose.TrainingSetup` in a :class:`Prepared`, which adds the
micro-batch API. Two ways to use it::

    prepared = memfit.prepare(model, plan)
    for batch in loader:
        loss = prepared.step(batch)      # one optimizer step, micro-batched as the plan says

or, when the loop computes its own loss, one micro-batch at a time::

    for micro_batch in loader:
        with prepared.accumulate():
            loss = prepared.loss(micro_batch)        # or your own forward, see below
            prepared.backward(loss, batch=micro_batch)
        # the optimizer stepped (and gradients were cleared) after every
        # grad_accum_steps-th block

``prepared.loss(micro_batch)`` is the plan's own forward and loss: truncated to
``max_seq_len``, under the plan's autocast. A loop with its own forward does the same with
``prepared.prepare_batch(micro_batch)``, ``with prepared.autocast():`` and
``prepared.module(**micro_batch)``. Both ways run the plan's
:class:`~memfit.apply.stepper.Stepper` and its pieces of the one loop
(:mod:`memfit.apply.stepper`), as the trainer does, so under one plan they train alike
(tested against ``TrainingSetup.step`` for every plan field).

Under data parallelism (``Plan(parallel={"data": N, "zero_stage": s})``, one process per rank)
``step`` takes the global batch and trains this rank on its share, as the trainer does, while
the micro-batch API takes this rank's own micro-batches (from a sharded loader). Either way the
engine averages the gradients over the ranks on the step's last micro-batch only (DDP's
``no_sync`` or FSDP2's ``set_requires_gradient_sync`` before), so every rank ends each step
with the parameters one process would have after the whole global batch. DDP (stages 0 and 1)
averages only the gradients of a forward run through its wrapper, ``prepared.module``, inside
the ``accumulate`` block: a micro-batch whose forward went through ``prepared.model`` is
refused at its ``backward``.

Do not call ``optimizer.step()`` yourself inside ``accumulate``: the context does it at the
right micro-batch, with the plan's clipping, loss scaling and optimizer-in-backward handling.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..apply.compose import LossFn, TrainingSetup, apply_plan, check_plan_arguments
from ..apply.stepper import Stepper, finish_step, forward_loss, prepare_batch
from ..errors import MemfitTypeError, MemfitValueError, describe
from ..plan import Plan
from ..workload import Batch, batch_size_of
from .arguments import check_batch_covers_accumulation

__all__ = ["Prepared", "prepare"]


def _refuse_meta(model: nn.Module) -> None:
    """A model built under ``torch.device("meta")`` has shapes but no data: training it would
    step on nothing (issue 37), so it is refused before any technique applies."""
    meta = next((n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta),
                None)
    if meta is not None:
        raise MemfitValueError(
            f"model has its weights on the meta device (shapes without data, e.g. {meta!r}), "
            "which prepare() cannot train; materialise them first (model.to_empty(device=...) "
            "and load a state dict, or build the model without torch.device('meta'))"
        )


class Prepared:
    """A model with a plan applied, steppable whole-batch or micro-batch by micro-batch.

    Args:
        setup: The :class:`~memfit.apply.compose.TrainingSetup` to drive.

    Attributes:
        setup: The setup (plan, precision runtime, info).
    """

    def __init__(self, setup: TrainingSetup) -> None:
        if not isinstance(setup, TrainingSetup):
            raise MemfitTypeError(
                f"Prepared(setup) takes the TrainingSetup of memfit.apply_plan, got "
                f"{describe(setup)}; memfit.prepare(model, plan) builds both"
            )
        self.setup = setup
        self._micro = 0  # micro-batches done towards the current optimizer step
        self._open = False
        self._tokens = 0.0  # loss terms seen towards the current step ("tokens" normalisation)
        self._forwards = 0  # forwards through DDP's wrapper in the open accumulate block
        self._forward_hook = None
        parallel = setup.parallel
        if parallel is not None and parallel.syncs_in_forward:
            self._forward_hook = parallel.module.register_forward_pre_hook(self._count_forward)

    def _count_forward(self, module: nn.Module, args: Any) -> None:
        # Only a forward that builds a graph: a no-grad one (a teacher, an evaluation)
        # through the wrapper says nothing of the forward the loss came from.
        if torch.is_grad_enabled():
            self._forwards += 1

    @property
    def model(self) -> nn.Module:
        """The model (possibly checkpointed or cast by the plan): its parameters, state dict
        and, outside data parallelism, its forward."""
        return self.setup.model

    @property
    def module(self) -> nn.Module:
        """The module to run a micro-batch's forward through: the model, or under data
        parallelism the engine's module (DDP's wrapper for ZeRO stages 0 and 1, whose forward
        arms the gradient all-reduce; the model itself, sharded in place, for 2 and 3)."""
        parallel = self.setup.parallel
        return self.model if parallel is None else parallel.module

    @property
    def optimizer(self) -> Any:
        """The optimizer (or the optimizer-in-backward handle)."""
        return self.setup.optimizer

    @property
    def plan(self) -> Plan:
        """The plan applied."""
        return self.setup.plan

    @property
    def sync_gradients(self) -> bool:
        """Whether the current (or next) micro-batch ends an optimizer step."""
        return self._micro + 1 >= self.plan.grad_accum_steps

    @property
    def stepper(self) -> Stepper:
        """The plan's :class:`~memfit.apply.stepper.Stepper`."""
        assert self.setup.stepper is not None
        return self.setup.stepper

    def step(self, batch: Batch) -> torch.Tensor:
        """One optimizer step over ``batch`` (the effective batch), micro-batched, truncated,
        cast, clipped as the plan says. Returns the (detached) loss of the whole batch.

        Under data parallelism ``batch`` is the global batch, the same on every rank: each
        trains on its share (:func:`~memfit.distributed.data.local_batch`) and the returned
        loss is the mean over the ranks.

        Raises:
            MemfitValueError: when ``batch`` has fewer samples than the plan's micro-batches
                (``grad_accum_steps``, per data-parallel process): the step would silently
                accumulate fewer of them than the plan says.
        """
        self._check_batch(batch)
        return self.setup.step(batch)

    def _check_batch(self, batch: Batch) -> None:
        check_batch_covers_accumulation(batch_size_of(batch), self.plan)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The plan's autocast context (a no-op in fp32): run the forward and loss under it."""
        return self.setup.precision.autocast()

    def prepare_batch(self, batch: Batch) -> Batch:
        """``batch`` as the plan trains on it: truncated to ``max_seq_len`` (unchanged when
        the plan has none). For loops with their own forward."""
        return prepare_batch(batch, self.plan.max_seq_len)

    def loss(self, micro_batch: Batch) -> torch.Tensor:
        """The loss of one micro-batch as the plan computes it: truncated to ``max_seq_len``,
        the forward and the loss under the plan's autocast."""
        return forward_loss(
            self.module,
            self.prepare_batch(micro_batch),
            autocast=self.setup.precision.autocast,
            loss_fn=self.setup.loss_fn,
        )

    @contextlib.contextmanager
    def accumulate(self) -> Iterator[Prepared]:
        """One micro-batch: call :meth:`backward` inside; the optimizer steps on exit after
        every ``grad_accum_steps``-th micro-batch, then gradients are cleared.

        A micro-batch whose body raises is not counted (and nothing steps).

        Under data parallelism the block's backward averages the gradients over the ranks on
        the step's last micro-batch (:attr:`sync_gradients`) and only there, through the
        plan's data-parallel stepper, which is told on entry whether this block synchronises
        (DDP decides in its forward).
        """
        if self._open:
            raise RuntimeError("prepared.accumulate() blocks cannot be nested")
        self._open = True
        self._forwards = 0
        # DDP's no_sync for every micro-batch but the last (a no-op for other steppers).
        self.stepper.before_forward(self.sync_gradients)
        try:
            yield self
        finally:
            self._open = False
        self._micro += 1
        if self._micro >= self.plan.grad_accum_steps:
            self._micro = 0
            tokens, self._tokens = self._tokens, 0.0
            finish_step(self.stepper, self.model, divide_by=tokens or None)
            self.setup.steps_done += 1

    def backward(
        self, loss: torch.Tensor, *, batch: Batch | None = None, weight: float | None = None
    ) -> None:
        """Backward of one micro-batch's loss, weighted as the plan's normalisation says.

        * ``loss_normalization="mean"``: the weight is ``1 / grad_accum_steps`` (micro-batches
          of equal size give the whole batch's mean, as :meth:`step` does).
        * ``loss_normalization="tokens"``: ``batch`` is needed. The loss (a mean over the
          micro-batch's ``t_i`` loss terms) is multiplied by ``t_i``, counted by
          :func:`~memfit.strategies.accumulation.count_loss_terms` on the micro-batch as the
          plan trains on it (truncated to ``max_seq_len``; label entries that are not
          ``-100``, after the causal shift for causal-LM labels). When the step ends, the
          accumulated gradient is divided by ``T``, the step's total: ``sum_i t_i loss_i / T``
          is the whole batch's token mean, whatever the micro-batches' sizes, which is what
          :meth:`step` computes with the weights ``t_i / T`` (the same up to float rounding:
          the division happens once, on the gradient). A micro-batch with no loss term
          (``t_i = 0``, a NaN mean) is skipped.

        Args:
            loss: The micro-batch's mean loss.
            batch: The micro-batch (as given to :meth:`loss`, before truncation).
            weight: An explicit weight for this loss instead (no division at the step).

        Raises:
            ValueError: for token normalisation without ``batch``, or with the optimizer step
                fused into backward (the step's token total is not known before its last
                backward: use :meth:`step`, which weighs the whole batch first).
            RuntimeError: under DDP (ZeRO stages 0 and 1), outside an :meth:`accumulate`
                block or when no forward in the block ran through :attr:`module`: DDP would not
                average this gradient, and the ranks' models would drift apart.
        """
        if self._forward_hook is not None and (not self._open or self._forwards == 0):
            raise RuntimeError(
                "under DDP (zero_stage 0 or 1) run each micro-batch's forward and backward "
                "inside `with prepared.accumulate():`, the forward through prepared.loss(batch) "
                "or prepared.module(...): a forward of prepared.model skips DDP's gradient "
                "averaging and the processes' models would drift apart"
            )
        if self.plan.loss_normalization == "tokens" and weight is None:
            if batch is None:
                raise ValueError(
                    "loss_normalization 'tokens' weighs each micro-batch by its label tokens: "
                    "pass the micro-batch, prepared.backward(loss, batch=micro_batch)"
                )
            if self.plan.optimizer_in_backward:
                raise ValueError(
                    "loss_normalization 'tokens' with the optimizer step fused into backward "
                    "needs the whole step's token count before its last backward; use "
                    "prepared.step(batch) for such plans"
                )
            from ..strategies.accumulation import count_loss_terms

            count = count_loss_terms(self.prepare_batch(batch))
            self._tokens += count
            if count == 0:
                return
            weight = float(count)
        elif weight is None:
            weight = 1.0 / self.plan.grad_accum_steps
        self.stepper.backward(loss * weight, last=self.sync_gradients)

    def remove(self) -> None:
        """Take the plan off the model (:meth:`TrainingSetup.remove`)."""
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None
        self.setup.remove()


def prepare(
    model: nn.Module,
    plan: Plan | None = None,
    *,
    optimizer: Any = None,
    loss_fn: LossFn | None = None,
    keep_original_weights: bool = False,
) -> Prepared:
    """Apply ``plan`` to ``model`` for a training loop you write yourself.

    The same arguments, in the same order, as :func:`memfit.apply_plan`, which returns the
    bare :class:`~memfit.apply.compose.TrainingSetup` this wraps.

    Args:
        model: The model, in train mode.
        plan: The plan (default: plain AdamW, fp32).
        optimizer: Your optimizer, used instead of the plan's (not with
            ``optimizer_in_backward``, which builds its own per-parameter optimizers).
        loss_fn: ``loss_fn(output, batch)`` for :meth:`Prepared.step` and
            :meth:`Prepared.loss`; default: the output's ``.loss``.
        keep_original_weights: For ``bf16-pure``: keep the original weights on the host so
            that :meth:`Prepared.remove` gives back every weight training did not change bit
            for bit (see :func:`~memfit.strategies.precision.apply_precision`).

    Returns:
        The :class:`Prepared` model, optimizer and step.

    Raises:
        MemfitTypeError: (a ``TypeError``) when ``plan`` is not a :class:`~memfit.plan.Plan`
            (an optimizer passed where the plan goes, as the old ``prepare(model, optimizer,
            plan)`` order did), ``optimizer`` is a plan, or another argument has the wrong kind.
        MemfitValueError: (a ``ValueError``) when the model's weights are on the meta device
            (shapes without data: nothing to train), or the plan cannot apply to it.
    """
    check_plan_arguments("prepare", model, plan, optimizer, loss_fn, keep_original_weights)
    _refuse_meta(model)
    setup = apply_plan(
        model,
        plan,
        optimizer=optimizer,
        loss_fn=loss_fn,
        keep_original_weights=keep_original_weights,
    )
    return Prepared(setup)
