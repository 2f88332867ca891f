"""The memory report: peak by category, phases, modules, timeline; JSON, table and plot."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..outputs import atomic_file, write_text
from ..units import format_bytes
from .tiers import DEVICE, HOST, HOST_PINNED
from .trace import CATEGORIES, PHASES, AllocationTrace

__all__ = ["MemoryReport", "build_report", "window_max"]

#: Most timeline points kept in ``to_dict``/JSON (the peak is always kept).
MAX_TIMELINE_POINTS = 2000
#: Windows of the PNG's timeline (:func:`window_max`): its axes are about 1000 pixels wide.
PLOT_WINDOWS = 600

_COLORS = {
    "parameters": "#4C72B0",
    "buffers": "#8172B3",
    "gradients": "#DD8452",
    "optimizer_state": "#C44E52",
    "stashed_weights": "#CCB974",
    "inputs": "#937860",
    "activations": "#55A868",
    "temporaries": "#DA8BC3",
    "other": "#8C8C8C",
}
_PHASE_COLORS = {"forward": "#E8F1FA", "backward": "#FBEDE3", "optimizer": "#F6E2E2"}


@dataclass
class MemoryReport:
    """Where a training step's device memory went.

    Attributes:
        peak_bytes: Highest live bytes on the compute device.
        peak_by_category: Bytes per category at the moment of the peak (sums to ``peak_bytes``).
        phase_peaks: Highest live bytes within each phase (forward, backward, optimizer).
        by_module: Per module (qualified name; ``""`` is the model itself), the highest live
            bytes reached inside its forward and inside its backward.
        timeline: ``op_index``, ``phase`` and one series per category, in bytes, one point per
            operation (downsampled in JSON).
        peak_op: The operation during (or right after) which the peak happened.
        peak_op_index: Its index among all operations.
        peak_module: The innermost module open at the peak (``None`` outside any module).
        peak_phase: The phase of the peak.
        step_peaks: Peak within each training step, when steps were marked.
        phase_peak_by_category: For each phase, the categories at that phase's peak.
        num_ops: Operations seen.
        device: The compute device.
        meta: Free-form facts added by the caller (``num_parameters``, ``dry_run``, ...).
        peak_reserved_bytes: Peak bytes the device's allocator holds: for a CUDA target, the
            caching allocator's reserved peak (allocator model replaying this run's
            allocations); for the CPU, ``peak_bytes``. ``None`` until a target is modelled.
        overhead_bytes: Device memory outside the allocator (CUDA context, library
            workspaces) on the modelled target; 0 on the CPU.
        peak_by_tier: Peak bytes per tier (:mod:`memfit.accounting.tiers`): ``device`` (the
            headline, ``peak_bytes``), ``host`` (pinned and pageable) and ``disk``. Each tier
            peaks at its own moment.
        peak_by_tier_category: For each tier, the categories at that tier's peak.
        host_pinned_peak_bytes: Peak of page-locked host memory alone (part of ``host``).
        trace: The allocation trace the report was built from, where the caller kept it (dry
            runs do: :mod:`memfit.accounting.extend` builds deeper traces from shallow ones);
            not exported.
    """

    peak_bytes: int
    peak_by_category: dict[str, int]
    phase_peaks: dict[str, int]
    by_module: dict[str, dict[str, int]]
    timeline: dict[str, list[Any]]
    peak_op: str | None
    peak_op_index: int
    peak_module: str | None
    peak_phase: str
    step_peaks: list[int] = field(default_factory=list)
    phase_peak_by_category: dict[str, dict[str, int]] = field(default_factory=dict)
    num_ops: int = 0
    device: str = "cpu"
    meta: dict[str, Any] = field(default_factory=dict)
    peak_reserved_bytes: int | None = None
    overhead_bytes: int = 0
    peak_by_tier: dict[str, int] = field(default_factory=dict)
    peak_by_tier_category: dict[str, dict[str, int]] = field(default_factory=dict)
    host_pinned_peak_bytes: int = 0
    trace: AllocationTrace | None = field(default=None, repr=False, compare=False)

    @property
    def device_total_bytes(self) -> int:
        """What the device holds at the peak: reserved bytes plus the fixed overhead."""
        return (self.peak_reserved_bytes or self.peak_bytes) + self.overhead_bytes

    # ------------------------------------------------------------------ export
    def to_dict(self, max_points: int = MAX_TIMELINE_POINTS) -> dict[str, Any]:
        """A JSON-ready dict; the timeline is max-pooled to at most ``max_points`` points."""
        out: dict[str, Any] = dict(self.meta)
        out.update(
            peak_bytes=self.peak_bytes,
            peak_by_category=dict(self.peak_by_category),
            phase_peaks=dict(self.phase_peaks),
            by_module={k: dict(v) for k, v in self.by_module.items()},
            peak_op=self.peak_op,
            peak_op_index=self.peak_op_index,
            peak_module=self.peak_module,
            peak_phase=self.peak_phase,
            step_peaks=list(self.step_peaks),
            phase_peak_by_category={k: dict(v) for k, v in self.phase_peak_by_category.items()},
            num_ops=self.num_ops,
            device=self.device,
            peak_reserved_bytes=self.peak_reserved_bytes,
            overhead_bytes=self.overhead_bytes,
            predicted_device_total_bytes=self.device_total_bytes,
            peak_by_tier=dict(self.peak_by_tier),
            peak_by_tier_category={k: dict(v) for k, v in self.peak_by_tier_category.items()},
            host_pinned_peak_bytes=self.host_pinned_peak_bytes,
            timeline=_downsample(self.timeline, max_points),
        )
        return out

    def to_json(self, path: str | Path) -> None:
        """Write :meth:`to_dict` as JSON to ``path`` (atomically:
        :func:`memfit.outputs.write_text`)."""
        write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")

    def top_modules(self, n: int = 10) -> list[tuple[str, dict[str, int]]]:
        """The ``n`` named submodules with the highest peak, highest first."""
        rows = [(k, v) for k, v in self.by_module.items() if k]
        rows.sort(key=lambda kv: kv[1]["peak"], reverse=True)
        return rows[:n]

    def table(self, top: int = 8) -> Any:
        """A rich renderable: categories at the peak, phase peaks and the top modules."""
        from rich.console import Group
        from rich.table import Table

        cats = Table(
            title=f"Peak device memory: {format_bytes(self.peak_bytes)}", title_justify="left"
        )
        cats.add_column("category")
        cats.add_column("bytes at peak", justify="right")
        cats.add_column("share", justify="right")
        # Host and disk tiers get a column each when anything lives there (each at its own peak).
        others = [t for t in ("host", "disk") if self.peak_by_tier.get(t)]
        for tier in others:
            cats.add_column(f"{tier} (its peak)", justify="right")
        for name in CATEGORIES:
            value = self.peak_by_category[name]
            share = value / self.peak_bytes if self.peak_bytes else 0.0
            extra = [format_bytes(self.peak_by_tier_category[t].get(name, 0)) for t in others]
            cats.add_row(name, format_bytes(value), f"{share:6.1%}", *extra)
        cats.add_row(
            "total",
            format_bytes(self.peak_bytes),
            "100.0%",
            *[format_bytes(self.peak_by_tier[t]) for t in others],
            style="bold",
        )

        phases = Table(title="Peak by phase", title_justify="left")
        phases.add_column("phase")
        phases.add_column("peak", justify="right")
        for name, value in self.phase_peaks.items():
            phases.add_row(name, format_bytes(value))
        where = f"peak at op #{self.peak_op_index} ({self.peak_op}) in {self.peak_phase}"
        if self.peak_module:
            where += f", inside {self.peak_module}"
        mods = Table(title="Top modules (peak inside forward / backward)", title_justify="left")
        mods.add_column("module")
        mods.add_column("forward", justify="right")
        mods.add_column("backward", justify="right")
        for name, v in self.top_modules(top):
            mods.add_row(name, format_bytes(v["forward"]), format_bytes(v["backward"]))
        return Group(cats, phases, where, mods)

    def print(self, top: int = 8) -> None:
        """Print :meth:`table` to the terminal."""
        from rich.console import Console

        Console().print(self.table(top))

    def plot(self, path: str | Path, title: str | None = None) -> None:
        """Write a PNG: stacked bytes by category over the step, phases shaded, peak marked."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        # One window per pixel or two, each drawn at its highest point and held across it:
        # a spike one operation wide (the loss's logits) stays as tall as it is, and wide
        # enough to see, where 4000 thin points had it vanish between pixels.
        tl = window_max(self.timeline, PLOT_WINDOWS)
        x = np.asarray(tl["op_index"])
        unit, scale = ("GiB", 1024**3) if self.peak_bytes >= 1024**3 else ("MiB", 1024**2)
        fig, ax = plt.subplots(figsize=(12, 5), dpi=110)
        phase = tl["phase"]
        if len(x):
            start = 0
            for i in range(1, len(x) + 1):
                if i == len(x) or phase[i] != phase[start]:
                    color = _PHASE_COLORS.get(phase[start])
                    if color:
                        ax.axvspan(x[start], x[min(i, len(x) - 1)], color=color, lw=0)
                    start = i
        ys = [np.asarray(tl[c], dtype=float) / scale for c in CATEGORIES]
        ax.stackplot(x, ys, labels=CATEGORIES, colors=[_COLORS[c] for c in CATEGORIES],
                     alpha=0.9, step="post")
        ax.axhline(self.peak_bytes / scale, color="black", lw=0.8, ls="--")
        ax.annotate(
            f"peak {format_bytes(self.peak_bytes)}\n{self.peak_op} ({self.peak_phase})",
            xy=(self.peak_op_index, self.peak_bytes / scale),
            xytext=(10, -30),
            textcoords="offset points",
            fontsize=8,
            arrowprops={"arrowstyle": "->", "lw": 0.8},
        )
        ax.set_xlabel("operation index")
        ax.set_ylabel(f"live device memory ({unit})")
        tiers = ", ".join(
            f"{t} peak {format_bytes(self.peak_by_tier[t])}"
            for t in ("host", "disk")
            if self.peak_by_tier.get(t)
        )
        heading = title or "memfit: memory over the training step"
        ax.set_title(f"{heading}\n(device tier; {tiers})" if tiers else heading)
        handles, _labels = ax.get_legend_handles_labels()
        from matplotlib.patches import Patch

        handles += [Patch(color=c, label=p) for p, c in _PHASE_COLORS.items()]
        ax.legend(handles=handles[::-1], loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
        ax.set_xlim(x[0] if len(x) else 0, x[-1] if len(x) else 1)
        ax.set_ylim(0, self.peak_bytes / scale * 1.15 or 1)
        fig.tight_layout()
        try:
            with atomic_file(path) as tmp:
                fig.savefig(tmp, format=Path(path).suffix.lstrip(".").lower() or "png")
        finally:
            plt.close(fig)


def build_report(trace: AllocationTrace) -> MemoryReport:
    """Resolve a tracker's :class:`~memfit.accounting.trace.AllocationTrace` into a
    :class:`MemoryReport` (the trace is all it reads)."""
    nseq = trace.num_events + 2
    nb = np.asarray(trace.nbytes, dtype=np.int64)
    birth = np.asarray(trace.birth, dtype=np.int64)
    death = np.asarray(trace.death, dtype=np.int64)
    cat = np.asarray(trace.category, dtype=np.int64)
    tier = np.asarray(trace.tier, dtype=np.int64)
    on_dev = tier == DEVICE
    alive_end = death < 0
    death = np.where(alive_end, nseq, death)  # still alive: dies past the last event
    host = _tier_peaks(nb, birth, death, cat, tier, nseq)
    nb, birth, death, cat = nb[on_dev], birth[on_dev], death[on_dev], cat[on_dev]

    # Per-category bytes after every event, as cumulative sums of births minus deaths.
    per_cat = np.zeros((len(CATEGORIES), nseq + 1), dtype=np.int64)
    np.add.at(per_cat, (cat, birth), nb)
    np.add.at(per_cat, (cat, death), -nb)
    per_cat = np.cumsum(per_cat, axis=1)[:, :nseq]
    total = per_cat.sum(axis=0)

    peak_seq = trace.peak_event
    peak_by_category = {c: int(per_cat[i, peak_seq]) for i, c in enumerate(CATEGORIES)}
    peak_bytes = int(trace.peak_bytes)
    if sum(peak_by_category.values()) != peak_bytes:  # pragma: no cover - internal invariant
        raise AssertionError("memfit tracker: category breakdown does not add up to the peak")

    op_seq = np.asarray(trace.op_end_event, dtype=np.int64)  # seq at the end of op i
    op_phase = np.asarray(trace.op_phase, dtype=np.int64)
    # Each event belongs to the first op whose end is at or after it.
    seq_op = np.searchsorted(op_seq, np.arange(nseq), side="left")
    seq_op = np.minimum(seq_op, len(op_seq) - 1)
    seq_phase = op_phase[seq_op]
    phase_peaks: dict[str, int] = {}
    phase_peak_by_category: dict[str, dict[str, int]] = {}
    for i, name in enumerate(PHASES[:3]):
        idx = np.flatnonzero(seq_phase == i)
        at = int(idx[np.argmax(total[idx])]) if len(idx) else None
        phase_peaks[name] = int(total[at]) if at is not None else 0
        phase_peak_by_category[name] = {
            c: int(per_cat[j, at]) if at is not None else 0 for j, c in enumerate(CATEGORIES)
        }

    def seq_range_max(op_start: int, op_end: int) -> int:
        lo = op_seq[max(op_start - 1, 0)]
        hi = op_seq[min(max(op_end, op_start), len(op_seq) - 1)]
        return int(total[lo : hi + 1].max()) if hi >= lo else int(total[lo])

    by_module: dict[str, dict[str, int]] = {}
    peak_op_index = int(min(seq_op[peak_seq], len(op_seq) - 1))
    best: tuple[int, str] | None = None
    last = len(op_seq) - 1
    for name, kind, start, end in trace.module_intervals:
        end = last if end is None else end
        value = seq_range_max(start, end)
        entry = by_module.setdefault(name, {"forward": 0, "backward": 0, "peak": 0})
        entry[kind] = max(entry[kind], value)
        entry["peak"] = max(entry["peak"], value)
        if start <= peak_op_index <= end and name and (best is None or end - start < best[0]):
            best = (end - start, name)

    step_peaks = []
    prev = 0
    for b in trace.step_boundaries:
        step_peaks.append(seq_range_max(prev + 1, b))
        prev = b

    timeline: dict[str, list[Any]] = {
        "op_index": list(range(len(op_seq))),
        "phase": [PHASES[p] for p in op_phase.tolist()],
    }
    for i, c in enumerate(CATEGORIES):
        timeline[c] = per_cat[i, op_seq].tolist()

    return MemoryReport(
        peak_bytes=peak_bytes,
        peak_by_category=peak_by_category,
        phase_peaks=phase_peaks,
        phase_peak_by_category=phase_peak_by_category,
        by_module=by_module,
        timeline=timeline,
        peak_op=trace.peak_op,
        peak_op_index=peak_op_index,
        peak_module=best[1] if best else None,
        peak_phase=PHASES[int(seq_phase[peak_seq])],
        step_peaks=step_peaks,
        num_ops=len(op_seq) - 1,
        device=trace.device,
        peak_by_tier={"device": peak_bytes, "host": host[0], "disk": int(trace.disk_peak_bytes)},
        peak_by_tier_category={
            "device": dict(peak_by_category),
            "host": host[1],
            "disk": {c: dict(trace.disk_at_peak).get(c, 0) for c in CATEGORIES},
        },
        host_pinned_peak_bytes=host[2],
    )


def _tier_peaks(
    nb: np.ndarray, birth: np.ndarray, death: np.ndarray, cat: np.ndarray, tier: np.ndarray, nseq: int
) -> tuple[int, dict[str, int], int]:
    """Host memory's peak, its categories at that peak, and pinned host memory's own peak."""

    def live(mask: np.ndarray) -> np.ndarray:
        out = np.zeros((len(CATEGORIES), nseq + 1), dtype=np.int64)
        np.add.at(out, (cat[mask], birth[mask]), nb[mask])
        np.add.at(out, (cat[mask], death[mask]), -nb[mask])
        return np.cumsum(out, axis=1)[:, :nseq]

    on_host = (tier == HOST) | (tier == HOST_PINNED)
    if not on_host.any():
        return 0, dict.fromkeys(CATEGORIES, 0), 0
    per_cat = live(on_host)
    total = per_cat.sum(axis=0)
    at = int(np.argmax(total))
    pinned = tier == HOST_PINNED
    pinned_peak = int(live(pinned).sum(axis=0).max()) if pinned.any() else 0
    return int(total[at]), {c: int(per_cat[i, at]) for i, c in enumerate(CATEGORIES)}, pinned_peak


def window_max(timeline: dict[str, list[Any]], windows: int) -> dict[str, list[Any]]:
    """The timeline in at most ``windows`` equal windows of operations, each as the point of
    its highest total at the window's first operation (held until the next window when drawn
    as steps), and a last point at the last operation: the highest total is kept whatever the
    number of windows, and each window is as wide as the others.

    Args:
        timeline: :attr:`MemoryReport.timeline`.
        windows: The most windows (the plot's: about one per pixel or two of its width).
    """
    if len(timeline["op_index"]) <= windows:
        return {k: list(v) for k, v in timeline.items()}
    starts, best = zip(*_window_peaks(timeline, windows), strict=True)
    out: dict[str, list[Any]] = {"op_index": [timeline["op_index"][i] for i in starts]}
    out["op_index"].append(timeline["op_index"][-1])
    for k, v in timeline.items():
        if k != "op_index":
            out[k] = [v[i] for i in best] + [v[best[-1]]]
    return out


def _downsample(timeline: dict[str, list[Any]], max_points: int) -> dict[str, list[Any]]:
    """Keep at most ``max_points`` points: in each bucket, the point with the highest total."""
    if len(timeline["op_index"]) <= max_points:
        return {k: list(v) for k, v in timeline.items()}
    keep = [best for _, best in _window_peaks(timeline, max_points)]
    return {k: [v[i] for i in keep] for k, v in timeline.items()}


def _window_peaks(timeline: dict[str, list[Any]], windows: int) -> list[tuple[int, int]]:
    """The timeline cut into ``windows`` equal windows of points: each non-empty one's first
    point and the point of its highest total (all categories)."""
    n = len(timeline["op_index"])
    total = np.zeros(n, dtype=np.int64)
    for c in CATEGORIES:
        total += np.asarray(timeline[c], dtype=np.int64)
    edges = np.linspace(0, n, windows + 1).astype(np.int64)
    return [(int(lo), int(lo + np.argmax(total[lo:hi])))
            for lo, hi in itertools.pairwise(edges) if hi > lo]
