"""The allocation trace a tracker records: every storage's size, birth, death and tier.

A frozen value, so what is built from a run (the report, the allocator model's replay) reads
no private tracker state.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AllocationTrace"]


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
        category: Index into :data:`~memfit.accounting.tracker.CATEGORIES` of each storage's
            most specific role.
    """

    nbytes: tuple[int, ...]
    birth: tuple[int, ...]
    death: tuple[int, ...]
    tier: tuple[int, ...]
    category: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.nbytes)
