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
    "inputs",
    "activations",
    "temporaries",
    "other",
)

#: Phases of a training step; ``other`` is anything outside forward, backward and the step.
PHASES: tuple[str, ...] = ("forward", "backward", "optimizer", "other")


@dataclass(frozen=True)
class AllocationTrace:
    """Storages in the order they appeared.

    Attributes:
        nbytes: Bytes of each storage.
        birth: Event stamp of each storage's allocation. Births and deaths share one
            increasing counter, so sorting both by stamp gives the order of allocations and
            frees.
        death: Event stamp of each storage's free; ``-1`` if alive when tracking ended.
        tier: ``0`` for the compute device, ``1`` for host memory.
        category: Index into :data:`CATEGORIES` of each storage's
            most specific role.
    """

    nbytes: tuple[int, ...]
    birth: tuple[int, ...]
    death: tuple[int, ...]
    tier: tuple[int, ...]
    category: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.nbytes)
