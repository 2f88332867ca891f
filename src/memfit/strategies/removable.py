"""What every ``apply_*`` returns: a handle whose :meth:`~Removable.remove` takes the technique
off the model again.

The handles are:

* :class:`~memfit.strategies.freezing.FreezeHandle` (``apply_freezing``): ``requires_grad``;
* :class:`~memfit.strategies.precision.PrecisionRuntime` (``apply_precision``): dtypes of
  parameters and buffers, bf16-pure's input-cast hook, bf16 optimizer wrappers;
* :class:`~memfit.strategies.checkpointing.CheckpointHandle` (``apply_checkpointing``): the
  blocks' forward wrappers;
* :class:`~memfit.strategies.fused_step.OptimizerInBackward` (``optimizer_in_backward``): the
  post-accumulate-grad hooks;
* :class:`~memfit.strategies.grad_buffer.GradBufferHandle` (``apply_grad_buffer``): the
  gradient buffers, their re-attach and step hooks (gradients become plain tensors again).

:meth:`memfit.apply.compose.TrainingSetup.remove` removes a whole plan, last technique
first. After removal the model has the module types, hooks, instance attributes, dtypes and
``requires_grad`` of the model before ``apply``; its values are its current ones (what
training made of them). Removing twice is a no-op.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["Removable"]


@runtime_checkable
class Removable(Protocol):
    """A technique applied to a model, which can be taken off again."""

    def remove(self) -> None:
        """Restore what ``apply`` changed (idempotent)."""
