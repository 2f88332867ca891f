"""The allocation trace a tracker records: every storage's size, birth, death and tier.

A frozen value, so what is built from a run (the report, the allocator model's replay) reads
no private tracker state.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CATEGORIES", "PHASES", "AllocationTrace"]

#: Categories in order of precedence: a storage's category is the lowest-ranked role it plays.
CATEGORIES: tuple[str, ...] = (
    "parameters",
    "buffers",
    "gradients",
    "optimizer_state",
    # Copies of parameters a schedule keeps for in-flight micro-batches (PipeDream's weight
    # versions): ranked above activations, since the forwards save them for backward.
    "stashed_weights",
    "inputs",
    "activations",
    "temporaries",
    "other",
)

#: Phases of a training step; ``other`` is anything outside forward, backward and the step.
PHASES: tuple[str, ...] = ("forward", "backward", "optimizer", "other")


@dataclass(frozen=True)
class AllocationTrace:
    """What a tracker recorded, as plain frozen data: everything a report is built from.

    Attributes:
        nbytes: Bytes of each storage, in the order they appeared.
        birth: Event stamp of each storage's allocation. Births and deaths share one
            increasing counter, so sorting both by stamp gives the order of allocations and
            frees.
        death: Event stamp of each storage's free; ``-1`` if alive when tracking ended.
        tier: Each storage's tier code (:mod:`memfit.accounting.tiers`): ``0`` the compute
            device, ``1`` pageable host memory, ``2`` pinned host memory.
        category: Index into :data:`CATEGORIES` of each storage's most specific role.
        num_events: Events stamped in all (the counter's last value).
        op_end_event: For each operation (index 0 is the start), the event stamp at its end.
        op_phase: For each operation, its phase (index into :data:`PHASES`).
        module_intervals: ``(qualified name, "forward" | "backward", first op, last op)``;
            the last op is ``None`` when the interval never closed.
        step_boundaries: The operation index at the end of each marked training step.
        peak_bytes: Highest live device bytes.
        peak_event: The event stamp at that peak.
        peak_op: The operation during which the peak happened (its name), if known.
        device: The compute device.
        disk_peak_bytes: Highest bytes on disk (reported by the techniques that write them).
        disk_at_peak: ``(category, bytes)`` on disk at that peak.
    """

    nbytes: tuple[int, ...]
    birth: tuple[int, ...]
    death: tuple[int, ...]
    tier: tuple[int, ...]
    category: tuple[int, ...]
    num_events: int = 0
    op_end_event: tuple[int, ...] = (0,)
    op_phase: tuple[int, ...] = (3,)
    module_intervals: tuple[tuple[str, str, int, int | None], ...] = ()
    step_boundaries: tuple[int, ...] = ()
    peak_bytes: int = 0
    peak_event: int = 0
    peak_op: str | None = None
    device: str = "cpu"
    disk_peak_bytes: int = 0
    disk_at_peak: tuple[tuple[str, int], ...] = ()

    def __len__(self) -> int:
        return len(self.nbytes)
