"""The records of a job's phases: each phase's peak, the job's peak phase, and the
trainer's recorder of its phases as they happen (see :mod:`memfit.train.job` for the phases
and their prediction)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..accounting import track
from ..targets import DeviceProfile
from ..units import format_bytes

__all__ = ["JOB_PHASES", "JobPhases", "PhasePeak", "PhaseRecorder", "phase_peak"]

#: A job's phases, in the order a run meets them (:mod:`memfit.train.job` says what each is).
JOB_PHASES: tuple[str, ...] = (
    "load",
    "first_step",
    "steady_step",
    "eval",
    "save",
    "load_checkpoint",
    "resume",
)


@dataclass(frozen=True)
class PhasePeak:
    """One phase's peak.

    Attributes:
        peak_allocated_bytes: Highest live tensor bytes on the device during the phase,
            everything the tracker knows included (parameters, optimizer state, inputs).
        peak_by_category: Those bytes at the peak, by category.
        peak_reserved_bytes: What the target's caching allocator holds at the peak (the
            allocator model; ``None`` for a measured phase).
        device_total_bytes: Reserved plus the device's fixed overhead (``None`` for a measured
            phase).
    """

    peak_allocated_bytes: int
    peak_by_category: dict[str, int] = field(default_factory=dict)
    peak_reserved_bytes: int | None = None
    device_total_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON (``None`` figures left out)."""
        data: dict[str, Any] = {"peak_allocated_bytes": self.peak_allocated_bytes}
        if self.peak_reserved_bytes is not None:
            data["peak_reserved_bytes"] = self.peak_reserved_bytes
        if self.device_total_bytes is not None:
            data["device_total_bytes"] = self.device_total_bytes
        data["peak_by_category"] = dict(self.peak_by_category)
        return data


@dataclass
class JobPhases:
    """Each phase's peak of one job, predicted (:func:`predict_job`) or measured
    (``TrainResult.phases``).

    Attributes:
        phases: Phase name (one of :data:`JOB_PHASES`) -> its :class:`PhasePeak`, in job order.
        meta: What was run: model, plan, target, batch size, sequence length (predictions).
    """

    phases: dict[str, PhasePeak] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def peak_phase(self) -> str | None:
        """The phase with the highest allocated peak (the earliest of equals); ``None``
        before any."""
        if not self.phases:
            return None
        return max(self.phases, key=lambda k: self.phases[k].peak_allocated_bytes)

    @property
    def peak_bytes(self) -> int:
        """The job's allocated peak: its peak phase's (0 before any phase)."""
        top = self.peak_phase
        return self.phases[top].peak_allocated_bytes if top is not None else 0

    def to_dict(self) -> dict[str, Any]:
        """``{"phases": {name: {...}}, "peak_phase": name, "peak_allocated_bytes": n}``."""
        return {
            "phases": {name: p.to_dict() for name, p in self.phases.items()},
            "peak_phase": self.peak_phase,
            "peak_allocated_bytes": self.peak_bytes,
        }

    def table(self, title: str | None = None) -> Any:
        """A rich table: one row per phase, the peak phase marked."""
        from rich.table import Table

        reserved = any(p.peak_reserved_bytes is not None for p in self.phases.values())
        table = Table(title=title)
        table.add_column("phase")
        table.add_column("allocated peak", justify="right")
        if reserved:
            table.add_column("reserved (model)", justify="right")
            table.add_column("device total", justify="right")
        top = self.peak_phase
        for name, p in self.phases.items():
            cells = [format_bytes(p.peak_allocated_bytes)]
            if reserved:
                cells += [format_bytes(p.peak_reserved_bytes or 0),
                          format_bytes(p.device_total_bytes or 0)]
            label = f"[bold]{name}[/] (peak)" if name == top else name
            table.add_row(label, *cells)
        return table


def phase_peak(tracker: Any, target: DeviceProfile | None = None) -> PhasePeak:
    """A closed tracker's peak, with the target's reserved and total when a target is given."""
    report = tracker.report()
    if target is None:
        return PhasePeak(int(report.peak_bytes), dict(report.peak_by_category))
    from ..estimate.target import add_device_memory

    add_device_memory(report, tracker, target)
    return PhasePeak(
        int(report.peak_bytes),
        dict(report.peak_by_category),
        report.peak_reserved_bytes,
        report.device_total_bytes,
    )


class PhaseRecorder:
    """The trainer's measured phases: the first time each happens, under memfit's tracker.

    The trainer opens :meth:`phase` around loading, evaluating, saving and loading a
    checkpoint; its memory report's step trackers hand their steps to :meth:`step_tracked`
    (the first two steps of a fresh run, the first after a checkpoint is loaded).

    Attributes:
        record: The phases measured so far.
    """

    def __init__(self) -> None:
        self.record = JobPhases()
        self._after_load = False  # a checkpoint was loaded and no step has run since

    def phase(
        self, name: str, model: nn.Module | None = None, optimizer: Any = None, *,
        device: torch.device | str | None = None,
    ) -> contextlib.AbstractContextManager[Any]:
        """Track the block as phase ``name`` if it has not been measured yet (else run it
        untracked); yields the tracker or ``None``."""
        if name not in JOB_PHASES:
            raise ValueError(f"unknown phase {name!r}; phases are {', '.join(JOB_PHASES)}")
        return self._phase(name, model, optimizer, device)

    @contextlib.contextmanager
    def _phase(self, name: str, model: Any, optimizer: Any, device: Any) -> Iterator[Any]:
        if name in self.record.phases:
            yield None
        else:
            tracker = track(model, optimizer, device=device)
            with tracker:
                yield tracker
            self.record.phases[name] = phase_peak(tracker)
        if name == "load_checkpoint":
            self._after_load = True

    def step_tracked(self, steps_before: int, tracker: Any) -> None:
        """A tracked training step ended; ``steps_before`` is the trainer's step count when it
        began. Records ``resume`` (the first step after a checkpoint was loaded), else
        ``first_step`` and ``steady_step`` (steps 0 and 1 of a fresh run)."""
        name = None
        if self._after_load:
            name, self._after_load = "resume", False
        elif steps_before == 0:
            name = "first_step"
        elif steps_before == 1 and "first_step" in self.record.phases:
            name = "steady_step"
        if name is not None and name not in self.record.phases:
            self.record.phases[name] = phase_peak(tracker)


