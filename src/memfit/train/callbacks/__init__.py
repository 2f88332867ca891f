"""The trainer's callbacks, one concept per module.

* :mod:`.base`: :class:`Callback` (the hooks), :class:`StepInfo`, :class:`OnStep`, and
  :class:`TrainerLike` (what a callback may use of the trainer).
* :mod:`.oom`: :class:`OOMFallbackCallback`, the step itself, stepping down on out-of-memory.
* :mod:`.memory`: :class:`MemoryReportCallback`, windowed tracking and the run's report.
* :mod:`.progress`: :class:`ProgressCallback`, the progress bar and the final table.
* :mod:`.evaluation`: :class:`EvaluationCallback` and :func:`evaluate`.
* :mod:`.checkpointing`: :class:`CheckpointCallback`, saving and resuming.
"""

from __future__ import annotations

from .base import Callback, OnStep, StepInfo, TrainerLike
from .checkpointing import CheckpointCallback
from .evaluation import EvaluationCallback, evaluate
from .memory import MemoryReportCallback, TrackWindow
from .oom import OOMFallbackCallback
from .progress import ProgressCallback, TrainProgress

__all__ = [
    "Callback",
    "CheckpointCallback",
    "EvaluationCallback",
    "MemoryReportCallback",
    "OOMFallbackCallback",
    "OnStep",
    "ProgressCallback",
    "StepInfo",
    "TrackWindow",
    "TrainProgress",
    "TrainerLike",
    "evaluate",
]
