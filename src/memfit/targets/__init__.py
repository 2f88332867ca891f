"""Targets: the device a run is for, and how a dry run reproduces that device's memory.

:mod:`memfit.targets.profiles` describes devices (built-in GPUs, this CPU, custom GPUs);
:mod:`memfit.targets.kernels` makes CPU execution keep what a CUDA target's kernels keep.
"""

from __future__ import annotations

from .kernels import KernelEmulation, emulate, sdpa_backend
from .profiles import (
    CUSTOM_FIELDS,
    DEVICES,
    DeviceProfile,
    cpu_profile,
    get_device,
    machine_device,
    parse_budget,
    parse_device,
)

__all__ = [
    "CUSTOM_FIELDS",
    "DEVICES",
    "DeviceProfile",
    "KernelEmulation",
    "cpu_profile",
    "emulate",
    "get_device",
    "machine_device",
    "parse_budget",
    "parse_device",
    "sdpa_backend",
]
