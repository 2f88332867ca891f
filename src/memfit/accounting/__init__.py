"""Memory accounting: the dispatch-level tracker and its report."""

from .report import MemoryReport
from .tiers import TIERS, host_tier
from .tracker import CATEGORIES, PHASES, MemoryTracker, track

__all__ = ["CATEGORIES", "PHASES", "TIERS", "MemoryReport", "MemoryTracker", "host_tier", "track"]
