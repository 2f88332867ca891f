"""The one place that knows CUDA from CPU from fake tensors.

Everything device-specific (CUDA memory statistics, synchronisation) lives here so the rest of
memfit stays device-agnostic. CUDA paths cannot run on the CPU-only development machines, so
they are kept deliberately thin: each is a direct call into ``torch.cuda`` with no logic.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "active_values",
    "copy_stream",
    "copy_to_host",
    "cuda_available",
    "current_event",
    "default_device",
    "device_capability",
    "device_memory_used",
    "device_name",
    "empty_cache",
    "empty_host",
    "event_done",
    "host_buffer",
    "is_cuda",
    "is_fake",
    "max_memory_allocated",
    "max_memory_reserved",
    "mem_get_info",
    "memory_allocated",
    "memory_reserved",
    "on_stream",
    "record_event",
    "record_stream",
    "reset_peak_memory_stats",
    "rng_states",
    "set_rng_states",
    "stream_ready",
    "synchronize",
    "total_memory",
    "values_closed",
    "values_opened",
    "wait_event",
    "wait_for",
]


def cuda_available() -> bool:
    """Whether a CUDA device can be used."""
    return bool(torch.cuda.is_available())


def set_device(index: int) -> None:
    """Make CUDA device ``index`` this process's current device (one per launched process)."""
    torch.cuda.set_device(index)


def default_device() -> torch.device:
    """The device training should run on: the current CUDA device if there is one, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rng_states() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The state of every random generator in use: the CPU's, and each CUDA device's once
    CUDA is initialised (for :func:`set_rng_states`)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
    return torch.get_rng_state(), cuda


def set_rng_states(states: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
    """Put back the generators' states that :func:`rng_states` returned."""
    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda:
        torch.cuda.set_rng_state_all(cuda)


def is_cuda(device: torch.device | str) -> bool:
    """Whether ``device`` is a CUDA device."""
    return torch.device(device).type == "cuda"


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a fake tensor (no real memory behind it)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


# A dry run computes some fake tensors' values for real (a constant's shadow:
# memfit.estimate.values.DryRunValues, which records itself here while open). The record
# lives on this floor, below the workload, which asks about it while it builds a model on fake
# tensors, and below the estimator, which opens it.
_OPEN_VALUES: list[Any] = []


def active_values() -> Any:
    """The innermost open :class:`~memfit.estimate.values.DryRunValues` (the values a dry
    run knows of some fake tensors), or ``None``."""
    return _OPEN_VALUES[-1] if _OPEN_VALUES else None


def values_opened(values: Any) -> None:
    """Record ``values`` as open: :func:`active_values` returns it until :func:`values_closed`."""
    _OPEN_VALUES.append(values)


def values_closed(values: Any) -> None:
    """Undo :func:`values_opened`."""
    _OPEN_VALUES.remove(values)


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


def host_buffer(shape: Any, dtype: torch.dtype, *, pin: bool = True) -> torch.Tensor:
    """An empty host tensor; page-locked when ``pin`` and CUDA is available (pinned memory is a
    CUDA facility: copies from it can be asynchronous)."""
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin and cuda_available())


def copy_to_host(t: torch.Tensor, dtype: torch.dtype, *, pin: bool = True) -> torch.Tensor:
    """A new host tensor holding ``t`` in ``dtype``: non-blocking from a CUDA tensor into
    pinned memory (call :func:`synchronize` before reading it), a plain copy otherwise."""
    out = host_buffer(t.shape, dtype, pin=pin)
    out.copy_(t, non_blocking=is_cuda(t.device) and out.is_pinned())
    return out
# ------------------------------------------------------------------ copies between tiers
# Offload techniques move bytes between the device and host memory through these. Off CUDA
# they are plain allocations and synchronous copies (streams and events are ``None``), so the
# offload logic runs unchanged on a CPU-only machine.


def empty_host(nbytes: int, *, pin: bool) -> torch.Tensor:
    """An uninitialised host byte buffer, page-locked when ``pin`` and CUDA is available
    (pinning only speeds up copies to and from a GPU, so it is skipped without one)."""
    return torch.empty(int(nbytes), dtype=torch.uint8, pin_memory=pin and cuda_available())


def copy_stream(device: torch.device | str) -> Any:
    """A new CUDA stream on ``device`` for copies beside compute; ``None`` off CUDA."""
    if is_cuda(device):
        return torch.cuda.Stream(torch.device(device))
    return None


@contextlib.contextmanager
def on_stream(stream: Any) -> Iterator[None]:
    """Queue work on ``stream`` inside the block (no-op when ``stream`` is ``None``)."""
    if stream is None:
        yield
        return
    with torch.cuda.stream(stream):
        yield


def stream_ready(stream: Any, after: torch.device | str) -> None:
    """Make ``stream`` wait for the work queued so far on ``after``'s current stream (no-op
    when ``stream`` is ``None``)."""
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(torch.device(after)))


def record_event(stream: Any) -> Any:
    """An event marking the work queued so far on ``stream``; ``None`` off CUDA."""
    if stream is None:
        return None
    return stream.record_event()


def wait_for(event: Any, device: torch.device | str) -> None:
    """Make ``device``'s current stream wait for ``event`` (no-op when ``event`` is ``None``)."""
    if event is not None:
        torch.cuda.current_stream(torch.device(device)).wait_event(event)


def record_stream(tensor: torch.Tensor, device: torch.device | str) -> None:
    """Tell the caching allocator that ``device``'s current stream uses ``tensor`` (made on
    another stream), so its memory is not reused before that work is done (no-op off CUDA)."""
    if tensor.is_cuda:
        tensor.record_stream(torch.cuda.current_stream(torch.device(device)))


def current_event(device: torch.device | str) -> Any:
    """An event marking the work queued so far on ``device``'s current stream; ``None`` off
    CUDA (where work is done when it returns)."""
    if is_cuda(device):
        return torch.cuda.current_stream(torch.device(device)).record_event()
    return None


def event_done(event: Any) -> bool:
    """Whether the work before ``event`` has run (without waiting; ``None`` is done)."""
    return event is None or bool(event.query())


def wait_event(event: Any) -> None:
    """Block the host until the work before ``event`` has run (no-op for ``None``); other
    work queued after it goes on."""
    if event is not None:
        event.synchronize()
