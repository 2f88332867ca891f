"""What a run's memory comes to on its target device: allocator reserve and fixed overhead.

The tracker counts tensor bytes. A GPU holds more: PyTorch's caching allocator rounds requests
and keeps freed blocks in cached segments (its *reserved* bytes), and outside the allocator the
CUDA context and library workspaces take a fixed amount. This module replays a tracked run's
allocation trace through the allocator model (:mod:`memfit.accounting.allocator`) and adds the
target's fixed overhead, giving the total a user sees in ``nvidia-smi``.
"""

from __future__ import annotations

from typing import Any

from ..accounting import MemoryReport
from ..targets import DeviceProfile

__all__ = ["add_device_memory", "device_memory"]


def device_memory(trace: Any, target: DeviceProfile, peak_bytes: int) -> dict[str, int]:
    """Allocated, reserved and total device bytes of a tracked run on ``target``.

    Args:
        trace: The tracker's allocation trace (``nbytes``, ``birth``, ``death``, ``tier``).
        target: The device profile.
        peak_bytes: The tracker's peak tensor bytes (the CPU's answer to every question).

    Returns:
        ``peak_allocated_bytes`` (rounded as the allocator rounds), ``peak_reserved_bytes``,
        ``overhead_bytes`` and ``device_total_bytes`` (reserved plus overhead).
    """
    if not target.is_cuda:
        # The CPU has no caching allocator: what tensors hold is what the process holds.
        return {
            "peak_allocated_bytes": peak_bytes,
            "peak_reserved_bytes": peak_bytes,
            "overhead_bytes": 0,
            "device_total_bytes": peak_bytes,
        }
    from ..accounting.allocator import AllocatorConfig, replay_records

    replay = replay_records(
        trace.nbytes, trace.birth, trace.death, trace.tier, config=AllocatorConfig()
    )
    overhead = target.overhead_bytes
    return {
        "peak_allocated_bytes": replay.peak_allocated_bytes,
        "peak_reserved_bytes": replay.peak_reserved_bytes,
        "overhead_bytes": overhead,
        "device_total_bytes": replay.peak_reserved_bytes + overhead,
    }


def add_device_memory(report: MemoryReport, tracker: Any, target: DeviceProfile) -> None:
    """Fill ``report``'s device fields for ``target`` from ``tracker``'s allocation trace."""
    values = device_memory(tracker.trace(), target, report.peak_bytes)
    report.peak_reserved_bytes = values["peak_reserved_bytes"]
    report.overhead_bytes = values["overhead_bytes"]
    report.meta.update(
        target_device=target.name,
        peak_allocated_bytes=values["peak_allocated_bytes"],
        predicted_device_total_bytes=values["device_total_bytes"],
    )
