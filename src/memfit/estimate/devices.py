"""Device profiles for the cost model and device-named budgets.

The profiles live in :mod:`memfit.targets.profiles` (a lower floor, so that strategies and the
allocator model can use them too); this module re-exports them for the estimators.
"""

from __future__ import annotations

from ..targets.profiles import (
    DEVICES,
    DeviceProfile,
    cpu_profile,
    get_device,
    machine_device,
    parse_budget,
    parse_device,
)

__all__ = [
    "DEVICES",
    "DeviceProfile",
    "cpu_profile",
    "get_device",
    "machine_device",
    "parse_budget",
    "parse_device",
]
