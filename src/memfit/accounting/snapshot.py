"""A run's allocations as PyTorch's memory snapshot, for PyTorch's own memory viewer.

PyTorch's ``memory._snapshot()`` returns the caching allocator's segments and, when memory
history is recorded, every allocation, free and segment event with the Python frames that
caused it; https://pytorch.org/memory_viz draws both (the "Active Memory Timeline" and the
allocator state). :func:`memory_snapshot` builds the same structure from a tracker's
:class:`~memfit.accounting.trace.AllocationTrace`, replayed through
:class:`~memfit.accounting.allocator.CachingAllocatorModel`: a dry run's trace gives the
timeline of a run that has not happened, on a GPU the machine does not have.

What PyTorch lacks here: its snapshot records only a real CUDA run's allocator. What memfit
fills in: the addresses are the allocator model's (each segment at an address of its own,
an expandable segment in a 1 TiB range), the time stamps are the trace's event counter, and
each event's frames name the module that allocated (its qualified name as the file, the
phase and the memory category as the function), where the real snapshot has Python stack
frames.

:func:`write_html` writes one self-contained HTML page of the run (memfit's own drawing of
the timeline, :mod:`memfit.accounting.page`), the snapshot in it as a download. PyTorch's page
(``_memory_viz.trace_plot``) loads its viewer script from a CDN: offline, a white page.
"""

from __future__ import annotations

import bisect
import pickle
from pathlib import Path
from typing import Any

from ..outputs import write_bytes, write_text
from .allocator import AllocatorConfig, CachingAllocatorModel
from .trace import CATEGORIES, PHASES, AllocationTrace

__all__ = ["memory_snapshot", "write_html", "write_snapshot"]

#: Where the modelled segments start (any address will do; this one looks like a device's).
_BASE = 0x7F0000000000
#: The address range each expandable segment keeps for growing.
_EXPANDABLE_RANGE = 1 << 40
_ALIGN = 2 << 20


def _innermost_modules(trace: AllocationTrace) -> list[str]:
    """Each operation's innermost module (``""`` outside every module)."""
    names = [""] * len(trace.op_end_event)
    last_op = len(names) - 1
    # Outer intervals first, inner ones painted over them.
    spans = sorted(
        ((first, last_op if last is None else last, name) for name, _, first, last in
         trace.module_intervals),
        key=lambda s: (s[0], -s[1]),
    )
    for first, last, name in spans:
        for op in range(max(first, 0), min(last, last_op) + 1):
            names[op] = name
    return names


class _Frames:
    """The frames of each record: the module that allocated it, its phase and category."""

    def __init__(self, trace: AllocationTrace) -> None:
        self.trace = trace
        self.modules = _innermost_modules(trace)
        self._cache: dict[tuple[str, int, int], list[dict[str, Any]]] = {}  # (module, phase, category)

    def of(self, record: int) -> list[dict[str, Any]]:
        trace = self.trace
        op = min(bisect.bisect_left(trace.op_end_event, trace.birth[record]),
                 len(trace.op_end_event) - 1)
        # Operation 0 is the start: what existed before the first step (the model, the batch).
        module = self.modules[op] if op else "<before the first step>"
        key = (module, trace.op_phase[op] if op else -1, trace.category[record])
        if key not in self._cache:
            _, phase, category = key
            where = f"{PHASES[phase]}: " if phase >= 0 else ""
            self._cache[key] = [
                {"filename": module or "<model>", "line": 0,
                 "name": f"{where}{CATEGORIES[category]}"},
            ]  # fmt: skip
        return self._cache[key]


class _Recorder:
    """Turns the allocator model's events into the snapshot's trace entries."""

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []
        self.bases: dict[int, int] = {}
        self._next = _BASE
        self.frames: list[dict[str, Any]] = []
        self.time = 0

    def base(self, segment: Any, size: int) -> int:
        if segment.id not in self.bases:
            span = _EXPANDABLE_RANGE if segment.expandable else size
            self.bases[segment.id] = self._next
            self._next += (span + _ALIGN - 1) // _ALIGN * _ALIGN
        return self.bases[segment.id]

    def __call__(self, action: str, segment: Any, offset: int, size: int) -> None:
        addr = self.base(segment, size) + offset
        actions = ("free_requested", "free_completed") if action == "free_completed" else (action,)
        for name in actions:
            self.entries.append({"action": name, "addr": addr, "size": size, "stream": 0,
                                 "frames": self.frames, "time_us": self.time})  # fmt: skip


def memory_snapshot(
    trace: AllocationTrace, config: AllocatorConfig | None = None, *, device: int = 0
) -> dict[str, Any]:
    """A tracked run as PyTorch's ``memory._snapshot()`` returns it.

    Args:
        trace: The allocation trace of a tracked or dry run (its device-tier records are
            replayed; host and disk tiers are not the device's).
        config: The allocator settings to model (default: PyTorch's defaults).
        device: The device index the snapshot names.

    Returns:
        ``{"segments": [...], "device_traces": [[...]], "allocator_settings": {...}}``: the
        segments reserved at the end with their blocks, and every event in order.
    """
    model = CachingAllocatorModel(config)
    recorder = _Recorder()
    model.listener = recorder
    frames = _Frames(trace)
    stamps: list[tuple[int, int, bool]] = []
    for i in range(len(trace.nbytes)):
        if trace.tier[i] != 0:
            continue
        stamps.append((trace.birth[i], i, True))
        if trace.death[i] >= 0:
            stamps.append((trace.death[i], i, False))
    stamps.sort(key=lambda s: s[0])
    for stamp, i, born in stamps:
        recorder.frames, recorder.time = frames.of(i), stamp
        if born:
            model.malloc(i, int(trace.nbytes[i]))
        else:
            model.free(i)
    segments = []
    for seg_id, small, expandable, mapped, blocks in model.segments():
        base = recorder.bases[seg_id]
        entries = [
            {"address": base + offset, "size": size, "requested_size": requested,
             "state": "active_allocated" if key >= 0 else "inactive",
             "frames": frames.of(key) if key >= 0 else []}
            for offset, size, requested, key in blocks
        ]  # fmt: skip
        allocated = sum(b["size"] for b in entries if b["state"] == "active_allocated")
        segments.append({
            "device": device, "address": base, "total_size": mapped, "stream": 0,
            "segment_type": "small" if small else "large", "segment_pool_id": (0, 0),
            "is_expandable": expandable, "allocated_size": allocated,
            "active_size": allocated,
            "requested_size": sum(b["requested_size"] for b in entries), "frames": [],
            "blocks": entries,
        })  # fmt: skip
    cfg = model.config
    return {
        "segments": segments,
        "device_traces": [recorder.entries],
        "allocator_settings": {
            "expandable_segments": cfg.expandable_segments,
            "max_split_size": -1 if cfg.max_split_size is None else cfg.max_split_size,
        },
    }


def write_snapshot(trace: AllocationTrace, path: str | Path,
                   config: AllocatorConfig | None = None) -> None:
    """Pickle :func:`memory_snapshot` to ``path`` (what https://pytorch.org/memory_viz opens,
    like the file of PyTorch's ``memory._dump_snapshot``)."""
    write_bytes(path, pickle.dumps(memory_snapshot(trace, config)))


def write_html(trace: AllocationTrace, path: str | Path,
               config: AllocatorConfig | None = None, *, title: str = "") -> None:
    """Write the run's memory timeline to ``path`` as one self-contained HTML page
    (:func:`~memfit.accounting.page.timeline_page`: drawn by memfit as inline SVG, no network,
    no script), carrying :func:`memory_snapshot` for PyTorch's viewer as a download."""
    from .page import timeline_page

    page = timeline_page(trace, memory_snapshot(trace, config), title=title)
    write_text(path, page)
