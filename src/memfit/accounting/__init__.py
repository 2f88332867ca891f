"""Memory accounting: the dispatch-level tracker and its report."""

from .report import MemoryReport
from .tracker import CATEGORIES, PHASES, MemoryTracker, track

__all__ = ["CATEGORIES", "PHASES", "MemoryReport", "MemoryTracker", "track"]
