"""The one place that knows CUDA from CPU from fake tensors.

Everything device-specific (CUDA memory statistics, synchronisation) lives here so the rest of
memfit stays device-agnostic. CUDA paths cannot run on the CPU-only development machines, so
they are kept deliberately thin: each is a direct call into ``torch.cuda`` with no logic.
"""

from __future__ import annotations

import torch

__all__ = [
    "cuda_available",
    "default_device",
    "device_capability",
    "device_memory_used",
    "device_name",
    "empty_cache",
    "is_cuda",
    "is_fake",
    "max_memory_allocated",
    "max_memory_reserved",
    "mem_get_info",
    "memory_allocated",
    "memory_reserved",
    "reset_peak_memory_stats",
    "synchronize",
    "total_memory",
]


def cuda_available() -> bool:
    """Whether a CUDA device can be used."""
    return bool(torch.cuda.is_available())


def default_device() -> torch.device:
    """The device training should run on: the current CUDA device if there is one, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def is_cuda(device: torch.device | str) -> bool:
    """Whether ``device`` is a CUDA device."""
    return torch.device(device).type == "cuda"


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a fake tensor (no real memory behind it)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def synchronize(device: torch.device | str) -> None:
    """Wait for queued kernels on ``device`` (no-op off CUDA)."""
    if is_cuda(device):
        torch.cuda.synchronize(device)


def reset_peak_memory_stats(device: torch.device | str) -> None:
    """Reset the allocator's peak counter on ``device`` (no-op off CUDA)."""
    if is_cuda(device):
        torch.cuda.reset_peak_memory_stats(device)


def memory_allocated(device: torch.device | str) -> int | None:
    """Bytes the CUDA caching allocator has handed out on ``device``; ``None`` off CUDA."""
    if is_cuda(device):
        return int(torch.cuda.memory_allocated(device))
    return None


def max_memory_allocated(device: torch.device | str) -> int | None:
    """Peak bytes handed out by the CUDA allocator since the last reset; ``None`` off CUDA."""
    if is_cuda(device):
        return int(torch.cuda.max_memory_allocated(device))
    return None


def total_memory(device: torch.device | str) -> int | None:
    """Total memory of the CUDA device; ``None`` off CUDA."""
    if is_cuda(device):
        return int(torch.cuda.get_device_properties(device).total_memory)
    return None


def memory_reserved(device: torch.device | str) -> int | None:
    """Bytes the CUDA caching allocator holds from the driver now; ``None`` off CUDA."""
    if is_cuda(device):
        return int(torch.cuda.memory_reserved(device))
    return None


def max_memory_reserved(device: torch.device | str) -> int | None:
    """Peak bytes reserved by the CUDA caching allocator since the last reset; ``None`` off CUDA."""
    if is_cuda(device):
        return int(torch.cuda.max_memory_reserved(device))
    return None


def mem_get_info(device: torch.device | str) -> tuple[int, int] | None:
    """``(free, total)`` bytes of the CUDA device as the driver sees them (context included);
    ``None`` off CUDA."""
    if is_cuda(device):
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)
    return None


def empty_cache() -> None:
    """Return the caching allocator's unused cached blocks to the driver (no-op off CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def device_name(device: torch.device | str) -> str | None:
    """The CUDA device's name (``NVIDIA H100 80GB HBM3``); ``None`` off CUDA."""
    if is_cuda(device):
        return str(torch.cuda.get_device_name(device))
    return None


def device_capability(device: torch.device | str) -> tuple[int, int] | None:
    """The CUDA device's compute capability ``(major, minor)``; ``None`` off CUDA."""
    if is_cuda(device):
        major, minor = torch.cuda.get_device_capability(device)
        return int(major), int(minor)
    return None


def device_memory_used(device: torch.device | str) -> int | None:
    """Device memory in use by every process, as NVML (``nvidia-smi``) reports it; ``None`` off
    CUDA. Needs the ``pynvml`` module (raises without it). Given an explicit index (``cuda:0``)
    it creates no CUDA context, so it can measure memory before this process takes any."""
    if is_cuda(device):
        return int(torch.cuda.device_memory_used(device))
    return None
