"""What a plan moves off the device: :class:`OffloadConfig`.

The field names are the plan JSON's (``offload: {optimizer: host, activations: true, ...}``).
Each setting is a technique in its own module:

* ``optimizer`` (ZeRO-Offload): fp32 master weights and optimizer state on the host (or on
  disk), the step computed there (:mod:`memfit.strategies.optimizer_offload`);
* ``activations``: tensors saved for backward moved to host memory
  (:mod:`memfit.strategies.activation_offload`);
* ``parameters`` (ZeRO-Infinity on one device): each block's parameters live on the host and
  are streamed to the device around the block's forward and backward
  (:mod:`memfit.strategies.parameter_offload`); ``"host"`` only, ``"disk"`` is refused.

Offload techniques that keep a host copy of a parameter record it on the parameter, and
:func:`host_copy_of` finds it: that is how the optimizer offload steps the very host copy that
parameter offload streams from, without either reading the other's internals.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["OFFLOAD_TIERS", "OffloadConfig", "host_copy_of", "offload_refusal", "set_host_copy"]

#: Where offloaded state may live.
OFFLOAD_TIERS = ("host", "disk")

MiB = 1 << 20


@dataclass(frozen=True)
class OffloadConfig:
    """What moves off the device, and where to.

    Attributes:
        optimizer: ``None`` (state on the device), ``"host"`` or ``"disk"``: fp32 master
            weights and optimizer state live there and the optimizer steps on the host. Saves
            the state (and, with a low-precision model, the master copy) and all but a bucket of
            gradients on the device; costs moving every gradient down and every updated weight
            up per step, and the host step's time (bounded by host memory bandwidth).
        parameters: ``None`` or ``"host"``: the parameters of the model's repeated blocks
            live in host memory and are copied to the device just before each block's forward
            and backward (the next block prefetched), released after; the device holds about
            two blocks' parameters. Costs two transfers of every block parameter per
            micro-batch. ``"disk"`` is not available yet. In a plan it needs ``optimizer``
            offload as well (the step updates the host copies).
        activations: Move tensors saved for backward to host memory during forward and back in
            backward. Saves their device bytes (beyond ``activation_min_bytes`` each, within
            ``host_bytes``); costs two transfers per saved byte.
        disk_dir: The directory of the ``disk`` tier's files (must exist, be writable and have
            room for the master weights and optimizer state; checked before training).
        gradients_on_host: With ``optimizer`` offload, accumulate gradients on the host across
            micro-batches (each micro-batch's gradients leave the device at once) instead of on
            the device until the last micro-batch. Saves the device gradients under
            accumulation; costs one transfer per micro-batch instead of per step.
        bucket_bytes: Gradients leave the device in buckets of this many bytes (at most one
            bucket's worth waits on the device): a constant, not a function of model size.
        activation_min_bytes: Saved tensors smaller than this stay on the device (transfers of
            small tensors cost more in latency than they save).
        host_bytes: Most host bytes the activation offload may hold (``None``: no bound); past
            it, saved tensors stay on the device.
        host_window_bytes: With ``optimizer: disk``, most bytes of master weights and optimizer
            state held in host memory at once (two halves: one group of parameters steps while
            the next is read ahead); ``None``: half the masters and state, at most 1 GiB. At least
            two of the largest parameter's master and state, else refused naming the minimum.
            Gradients (fp32, on the host as with ``host``) come on top.
        pin_memory: Use page-locked host buffers on CUDA (faster, non-blocking copies; they
            cannot be swapped out).
    """

    optimizer: str | None = None
    parameters: str | None = None
    activations: bool = False
    disk_dir: str | None = None
    gradients_on_host: bool = False
    bucket_bytes: int = 32 * MiB
    activation_min_bytes: int = 1 * MiB
    host_bytes: int | None = None
    pin_memory: bool = True
    host_window_bytes: int | None = None

    def __post_init__(self) -> None:
        for key in ("optimizer", "parameters"):
            value = getattr(self, key)
            if value is not None and value not in OFFLOAD_TIERS:
                raise ValueError(
                    f"offload {key} must be null, 'host' or 'disk', got {value!r}"
                )
        if self.parameters == "disk":
            raise ValueError(
                "offload parameters to 'disk' is not available yet: parameters stream from host "
                "memory only; set parameters to 'host'"
            )
        if "disk" in (self.optimizer, self.parameters) and not self.disk_dir:
            raise ValueError("offload to 'disk' needs disk_dir, the directory for its files")
        for key in ("activations", "gradients_on_host", "pin_memory"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"offload {key} must be true or false, got {getattr(self, key)!r}")
        if not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 1:
            raise ValueError(f"offload bucket_bytes must be a whole number >= 1, got {self.bucket_bytes!r}")
        if not isinstance(self.activation_min_bytes, int) or self.activation_min_bytes < 0:
            raise ValueError(
                "offload activation_min_bytes must be a whole number >= 0, got "
                f"{self.activation_min_bytes!r}"
            )
        if self.host_bytes is not None and (
            not isinstance(self.host_bytes, int) or self.host_bytes < self.activation_min_bytes
        ):
            raise ValueError(
                f"offload host_bytes must be at least activation_min_bytes "
                f"({self.activation_min_bytes}), the smallest tensor it moves, got {self.host_bytes!r}"
            )
        if self.host_window_bytes is not None and (
            not isinstance(self.host_window_bytes, int) or self.host_window_bytes < 1
        ):
            raise ValueError(
                "offload host_window_bytes must be a whole number >= 1, got "
                f"{self.host_window_bytes!r}"
            )
        if self.gradients_on_host and self.optimizer is None:
            raise ValueError("offload gradients_on_host needs optimizer offload ('host' or 'disk')")
        if self.optimizer is None and self.parameters is None and not self.activations:
            raise ValueError(
                "offload moves nothing: set optimizer ('host' or 'disk'), parameters ('host') or "
                "activations (true), or set offload to null"
            )

    @property
    def any(self) -> bool:
        """Whether anything moves."""
        return self.optimizer is not None or self.parameters is not None or self.activations

    def replace(self, **changes: Any) -> OffloadConfig:
        """A copy with some fields changed (checked again)."""
        return dataclasses.replace(self, **changes)

    def summary(self) -> str:
        """A few words for a plan's summary."""
        parts = []
        if self.optimizer:
            parts.append(f"optimizer on {self.optimizer}")
        if self.parameters:
            parts.append(f"parameters on {self.parameters}")
        if self.activations:
            parts.append("activations on host")
        return "offload " + " + ".join(parts)


_HOST_COPY = "_memfit_host_copy"


def host_copy_of(param: Any) -> Any:
    """The host tensor that holds ``param``'s values while parameter offload streams it, else
    ``None`` (the parameter's own storage is then the only copy)."""
    return getattr(param, _HOST_COPY, None)


def set_host_copy(param: Any, host: Any) -> None:
    """Record ``host`` as ``param``'s host copy (``None``: forget it)."""
    if host is None:
        if hasattr(param, _HOST_COPY):
            delattr(param, _HOST_COPY)
    else:
        setattr(param, _HOST_COPY, host)


def offload_refusal(plan: Any, engine: str) -> str | None:
    """Why ``engine`` cannot apply a plan's offload (``None``: it can); shared by the three
    offload techniques (optimizer, parameters, activations)."""
    if engine == "hf":
        return (
            "offload is not supported inside the Hugging Face Trainer yet; train with "
            "memfit's own Trainer (memfit.train) or set offload null"
        )
    if engine == "lightning":
        return (
            "offload is not supported in a lightning.Trainer; use memfit.Trainer or set "
            "offload null"
        )
    return None
