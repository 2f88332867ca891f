"""A run's memory timeline as one self-contained HTML page (``memfit profile --html``).

The page needs no network and no script: memfit draws the timeline itself as inline SVG (the
tensors' bytes stacked by category over the run's operations, phases shaded, the caching
allocator's reserved bytes as a line, the peak marked), states the figures it shows (peak,
categories at the peak, each phase's peak, the allocator's reserve) and carries the PyTorch
memory snapshot as a download link, for PyTorch's own viewer (https://pytorch.org/memory_viz)
where a network is at hand. PyTorch's page for the same snapshot (``_memory_viz.trace_plot``)
loads its viewer from a CDN, pinned to ``@main``: opened offline it was a white page.
"""

from __future__ import annotations

import base64
import html
import itertools
import pickle
from typing import Any

import numpy as np

from ..units import format_bytes
from .report import _COLORS, _PHASE_COLORS, MemoryReport, build_report
from .trace import CATEGORIES, AllocationTrace

__all__ = ["timeline_page"]

#: The chart's size in CSS pixels, its margins, and its windows (about one per 1.5 pixels).
_WIDTH, _HEIGHT = 1000, 380
_LEFT, _RIGHT, _TOP, _BOTTOM = 80, 20, 20, 40
_WINDOWS = 600


def timeline_page(trace: AllocationTrace, snapshot: dict[str, Any], *, title: str = "") -> str:
    """The HTML page of a run's memory.

    Args:
        trace: The run's allocation trace (what the chart and figures are drawn from).
        snapshot: :func:`~memfit.accounting.snapshot.memory_snapshot` of it (its allocator
            events give the reserved line; the page links it whole as ``snapshot.pickle``).
        title: The page's heading (default: ``memfit: memory timeline``).

    Returns:
        The page: HTML with inline SVG and CSS, no script, no external resource.
    """
    report = build_report(trace)
    reserved = _reserved_per_op(trace, snapshot)
    heading = title or "memfit: memory timeline"
    pickled = base64.b64encode(pickle.dumps(snapshot)).decode("ascii")
    peak_reserved = max(reserved) if reserved else 0
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(heading)}</title>",
        "<style>body{font-family:sans-serif;margin:24px;color:#222}"
        "table{border-collapse:collapse;margin:8px 0 16px}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
        "th:first-child,td:first-child{text-align:left}"
        ".key{display:inline-block;width:12px;height:12px;margin-right:4px;"
        "vertical-align:middle}</style>",
        "</head><body>",
        f"<h1>{html.escape(heading)}</h1>",
        f"<p id=\"peak\">Peak: <b>{format_bytes(report.peak_bytes)}</b> of tensors "
        f"(at {html.escape(str(report.peak_op))}, {report.peak_phase})"
        + (f"; the caching allocator (model) reserves up to <b>{format_bytes(peak_reserved)}"
           "</b>" if peak_reserved else "")
        + f"; {report.num_ops:,} operations.</p>",
        _svg(report, reserved),
        _legend(reserved),
        _tables(report),
        f'<p><a download="snapshot.pickle" href="data:application/octet-stream;base64,'
        f'{pickled}">Download the PyTorch memory snapshot</a> (snapshot.pickle; open it at '
        "https://pytorch.org/memory_viz for every allocation and its module).</p>",
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def _reserved_per_op(trace: AllocationTrace, snapshot: dict[str, Any]) -> list[int]:
    """The allocator's reserved bytes, highest within each operation (``[]`` without any
    segment event)."""
    events = snapshot["device_traces"][0] if snapshot.get("device_traces") else []
    grow = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
    stamps, sizes = [], []
    for e in events:
        sign = grow.get(e["action"])
        if sign:
            stamps.append(e["time_us"])
            sizes.append(sign * e["size"])
    if not stamps:
        return []
    level = np.cumsum(np.asarray(sizes, dtype=np.int64))  # after each event (stamps ascend)
    op_end = np.asarray(trace.op_end_event, dtype=np.int64)
    # Each operation: the level its last event left (or the one before it left), raised to
    # the highest level reached within it.
    last = np.searchsorted(np.asarray(stamps), op_end, side="right") - 1
    per_op = np.where(last >= 0, level[np.maximum(last, 0)], 0)
    ops = np.minimum(np.searchsorted(op_end, np.asarray(stamps), side="left"), len(op_end) - 1)
    np.maximum.at(per_op, ops, level)
    return per_op.tolist()


def _windows(n: int) -> list[tuple[int, int]]:
    """Equal windows of ``n`` operations, at most :data:`_WINDOWS`."""
    edges = np.linspace(0, n, min(n, _WINDOWS) + 1).astype(np.int64)
    return [(int(lo), int(hi)) for lo, hi in itertools.pairwise(edges) if hi > lo]


def _svg(report: MemoryReport, reserved: list[int]) -> str:
    """The chart: categories stacked as steps (each window at its highest point), phases
    shaded, the reserved line, the peak's dashed line."""
    tl = report.timeline
    n = len(tl["op_index"])
    series = np.asarray([tl[c] for c in CATEGORIES], dtype=np.int64).reshape(len(CATEGORIES), n)
    total = series.sum(axis=0)
    windows = _windows(n)
    best = [lo + int(np.argmax(total[lo:hi])) for lo, hi in windows]
    top = max(report.peak_bytes, max(reserved, default=0), 1) * 1.1
    plot_w, plot_h = _WIDTH - _LEFT - _RIGHT, _HEIGHT - _TOP - _BOTTOM

    def x(op: float) -> float:
        return _LEFT + plot_w * op / max(n, 1)

    def y(nbytes: float) -> float:
        return _TOP + plot_h * (1 - nbytes / top)

    out = [f'<svg id="timeline" xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" '
           f'height="{_HEIGHT}" viewBox="0 0 {_WIDTH} {_HEIGHT}" role="img" '
           'aria-label="memory over the run">']
    out += _phase_bands(tl["phase"], x, plot_h)
    base = np.zeros(len(best), dtype=np.int64)
    for i, c in enumerate(CATEGORIES):
        layer = series[i, best]
        if not layer.any():
            continue
        out.append(_area(windows, base, base + layer, x, y, _COLORS[c], c))
        base = base + layer
    if reserved:
        res = np.asarray(reserved, dtype=np.int64)
        steps = [(x(lo), y(int(res[lo:hi].max())), x(hi)) for lo, hi in windows]
        path = " ".join(f"L{a:.1f},{b:.1f} L{c:.1f},{b:.1f}" for a, b, c in steps)
        out.append(f'<path d="M{path[1:]}" fill="none" stroke="#333" stroke-width="1.2">'
                   "<title>reserved by the caching allocator (model)</title></path>")
    py = y(report.peak_bytes)
    out.append(f'<line x1="{_LEFT}" x2="{_WIDTH - _RIGHT}" y1="{py:.1f}" y2="{py:.1f}" '
               'stroke="black" stroke-dasharray="5,4"/>')
    out.append(f'<text x="{x(report.peak_op_index) + 6:.1f}" y="{py - 5:.1f}" font-size="12">'
               f"peak {format_bytes(report.peak_bytes)}</text>")
    out += _axes(n, top, x, y)
    out.append("</svg>")
    return "\n".join(out)


def _phase_bands(phases: list[str], x: Any, plot_h: float) -> list[str]:
    """A pale band behind each run of operations in one phase."""
    bands = []
    start = 0
    for i in range(1, len(phases) + 1):
        if i == len(phases) or phases[i] != phases[start]:
            color = _PHASE_COLORS.get(phases[start])
            if color:
                bands.append(f'<rect x="{x(start):.1f}" y="{_TOP}" width="{x(i) - x(start):.1f}" '
                             f'height="{plot_h}" fill="{color}"/>')
            start = i
    return bands


def _area(windows: list[tuple[int, int]], low: np.ndarray, high: np.ndarray, x: Any, y: Any,
          color: str, name: str) -> str:
    """One category's band between ``low`` and ``high``, each window held flat."""
    upper = [f"{x(lo):.1f},{y(h):.1f} {x(hi):.1f},{y(h):.1f}"
             for (lo, hi), h in zip(windows, high.tolist(), strict=True)]
    lower = [f"{x(hi):.1f},{y(v):.1f} {x(lo):.1f},{y(v):.1f}"
             for (lo, hi), v in reversed(list(zip(windows, low.tolist(), strict=True)))]
    return (f'<polygon points="{" ".join(upper + lower)}" fill="{color}" fill-opacity="0.9">'
            f"<title>{name}</title></polygon>")


def _axes(n: int, top: float, x: Any, y: Any) -> list[str]:
    """The axes' lines, ticks and labels."""
    bottom, right = _HEIGHT - _BOTTOM, _WIDTH - _RIGHT
    out = [f'<line x1="{_LEFT}" x2="{_LEFT}" y1="{_TOP}" y2="{bottom}" stroke="black"/>',
           f'<line x1="{_LEFT}" x2="{right}" y1="{bottom}" y2="{bottom}" stroke="black"/>']
    for k in range(5):
        value = top / 1.1 * k / 4
        ty = y(value)
        out.append(f'<text x="{_LEFT - 6}" y="{ty + 4:.1f}" font-size="11" '
                   f'text-anchor="end">{format_bytes(int(value))}</text>')
        out.append(f'<line x1="{_LEFT - 3}" x2="{_LEFT}" y1="{ty:.1f}" y2="{ty:.1f}" '
                   'stroke="black"/>')
        op = round(n * k / 4)
        out.append(f'<text x="{x(op):.1f}" y="{bottom + 16}" font-size="11" '
                   f'text-anchor="middle">{op:,}</text>')
    out.append(f'<text x="{(_LEFT + right) / 2}" y="{_HEIGHT - 6}" font-size="12" '
               'text-anchor="middle">operation</text>')
    return out


def _legend(reserved: list[int]) -> str:
    """The colours of the categories and phases, and the reserved line."""
    keys = [f'<span><span class="key" style="background:{_COLORS[c]}"></span>{c}</span>'
            for c in CATEGORIES]
    keys += [f'<span><span class="key" style="background:{color};border:1px solid #ccc">'
             f"</span>{phase}</span>" for phase, color in _PHASE_COLORS.items()]
    if reserved:
        keys.append("<span>&#8212; reserved (caching allocator model)</span>")
    keys.append("<span>- - peak</span>")
    return '<p id="legend">' + " &nbsp; ".join(keys) + "</p>"


def _tables(report: MemoryReport) -> str:
    """The figures: categories at the peak, and each phase's peak."""
    rows = "".join(f"<tr><td>{c}</td><td>{format_bytes(v)}</td></tr>"
                   for c, v in report.peak_by_category.items() if v)
    phases = "".join(f"<tr><td>{p}</td><td>{format_bytes(v)}</td></tr>"
                     for p, v in report.phase_peaks.items())
    return ("<h2>At the peak</h2><table id=\"categories\"><tr><th>category</th><th>bytes</th>"
            f"</tr>{rows}</table><h2>Peak by phase</h2><table id=\"phases\"><tr><th>phase</th>"
            f"<th>bytes</th></tr>{phases}</table>")
