"""Training under a memory plan: the Trainer, ``prepare`` for your own loop, and their parts.

* :class:`Trainer` / :class:`TrainResult`: a plan-driven loop with OOM step-down, checkpoints,
  evaluation, progress and a memory report.
* :func:`prepare`: apply a plan to a model and optimizer you keep driving yourself.
* Parts that work alone: :mod:`.data` (corpus, files, datasets, batches), :mod:`.tokenizer`,
  :mod:`.checkpoint`, :mod:`.oom`.
"""

from __future__ import annotations

from .prepare import Prepared, prepare
from .trainer import Trainer, TrainResult

__all__ = ["Prepared", "TrainResult", "Trainer", "prepare"]
