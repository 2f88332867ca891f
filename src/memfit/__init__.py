"""memfit: make PyTorch training fit in a memory budget.

Measure where training memory goes (:func:`track`, :func:`dry_run`), predict what fits, and
apply the techniques that make it fit.
"""

from .accounting import CATEGORIES, MemoryReport, MemoryTracker, track
from .units import format_bytes, parse_size

__version__ = "0.1.0"

__all__ = [
    "CATEGORIES",
    "MemoryReport",
    "MemoryTracker",
    "__version__",
    "format_bytes",
    "parse_size",
    "track",
]
