"""Estimation: dry runs of a workload under a plan (and, later, per-block composition)."""

from .dryrun import ModelError, dry_run, measure

__all__ = ["ModelError", "dry_run", "measure"]
