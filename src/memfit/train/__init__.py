"""Training under a memory plan: the Trainer, ``prepare`` for your own loop, and their parts.

* :class:`Trainer` / :class:`TrainResult`: a loop over one step (the plan's Stepper, through
  the OOM fallback) and callbacks (:mod:`.callbacks`: progress, evaluation, checkpoints, memory
  report, OOM fallback), with host memory bounded however long the run.
* :class:`TrainConfig`: the run's settings, one typed value for the YAML file, ``memfit train``'s
  options and the Python API; :func:`~.run.prepare_run` builds a whole run from it.
* :func:`prepare`: apply a plan to a model and optimizer you keep driving yourself.
* Parts that work alone: :mod:`.data` (corpus, files, datasets, batches), :mod:`.records`
  (JSONL, JSON, Parquet, CSV and text records), :mod:`.chat` (chat and prompt/completion
  samples, the prompt masked), :mod:`.lengths` (the length report and the worst batch),
  :mod:`.tokenizer`, :mod:`.checkpoint`, :mod:`.oom`, :mod:`.schedule`.
"""

from __future__ import annotations

from .callbacks import Callback, StepInfo
from .config import ConfigError, TrainConfig
from .manifest import CheckpointError
from .prepare import Prepared, prepare
from .trainer import Trainer, TrainingDiverged, TrainResult

__all__ = [
    "Callback",
    "CheckpointError",
    "ConfigError",
    "Prepared",
    "StepInfo",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "TrainingDiverged",
    "prepare",
]
