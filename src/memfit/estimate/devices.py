"""Device profiles for the cost model and device-named budgets.

A profile holds what the step-time model needs: memory, matmul throughput per precision,
memory and host-link bandwidth, per-operation launch overhead and how quickly matmul
efficiency falls for small micro-batches. Figures for GPUs are the vendors' dense peak numbers;
the CPU profile is measured on this machine, once per process.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from ..units import GiB, parse_size

__all__ = ["DEVICES", "DeviceProfile", "cpu_profile", "get_device", "parse_budget"]


@dataclass(frozen=True)
class DeviceProfile:
    """What one accelerator can do, for the step-time model.

    Attributes:
        name: Short name (``t4``, ``a100``, ``cpu``...).
        memory_bytes: Device memory as the driver reports it.
        reserve_bytes: Memory a budget keeps back for the CUDA context, the caching allocator's
            fragmentation and library workspaces (tensor bytes alone never reach the total).
        flops: Dense matmul FLOP/s by compute dtype (``fp32``, ``bf16``, ``fp16``).
        mem_bandwidth: Device memory bandwidth in bytes/s (pointwise ops, optimizer steps).
        host_bandwidth: Host-device link bandwidth in bytes/s (offload).
        launch_overhead: Seconds of fixed cost per operation (kernel launch, dispatch).
        half_tokens: Tokens per micro-batch at which matmuls reach half their peak rate.
    """

    name: str
    memory_bytes: int
    reserve_bytes: int
    flops: dict[str, float]
    mem_bandwidth: float
    host_bandwidth: float
    launch_overhead: float
    half_tokens: float
    has_bf16: bool = True

    @property
    def budget_bytes(self) -> int:
        """Memory a plan may use: total minus the reserve."""
        return self.memory_bytes - self.reserve_bytes

    @property
    def supports_bf16(self) -> bool:
        """Whether the device computes in bf16 natively (T4 does not: use fp16 there)."""
        return self.has_bf16


def _gpu(
    name: str,
    mem_gib: float,
    fp32: float,
    bf16: float,
    fp16: float,
    bw: float,
    host: float,
    has_bf16: bool = True,
) -> DeviceProfile:
    memory = int(mem_gib * GiB)
    # The CUDA context and allocator slack take about 1 GiB on every card, plus a few percent.
    reserve = int(1 * GiB + 0.03 * memory)
    return DeviceProfile(
        name=name,
        memory_bytes=memory,
        reserve_bytes=reserve,
        flops={"fp32": fp32, "bf16": bf16, "fp16": fp16},
        mem_bandwidth=bw,
        host_bandwidth=host,
        launch_overhead=6e-6,
        # Calibrated on the published BERT-large ladder: batch 1 x 32 (128 tokens per
        # micro-batch) ran 2.8x slower than batch 32, which t/(t+256) reproduces.
        half_tokens=256.0,
        has_bf16=has_bf16,
    )


#: Built-in GPU profiles (dense peak throughput; fp32 without TF32).
DEVICES: dict[str, DeviceProfile] = {
    "h100": _gpu("h100", 79.6, 67e12, 989e12, 989e12, 3.35e12, 55e9),
    "a100": _gpu("a100", 79.2, 19.5e12, 312e12, 312e12, 2.04e12, 25e9),
    "a100-40gb": _gpu("a100-40gb", 39.4, 19.5e12, 312e12, 312e12, 1.56e12, 25e9),
    "rtx4090": _gpu("rtx4090", 23.6, 82.6e12, 165e12, 165e12, 1.01e12, 25e9),
    # Turing has no bf16 units: bf16 falls back to fp32 rates; fp16 runs on tensor cores.
    "t4": _gpu("t4", 14.75, 8.1e12, 8.1e12, 65e12, 0.32e12, 12e9, has_bf16=False),
}


def _time(fn, repeat: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@functools.lru_cache(maxsize=1)
def cpu_profile() -> DeviceProfile:
    """Measure this CPU once: matmul FLOP/s per dtype, memory bandwidth, op overhead."""
    n = 384
    flops = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        a = torch.randn(n, n).to(dtype)
        seconds = _time(lambda a=a: [a @ a for _ in range(4)])
        flops[name] = 4 * 2 * n**3 / seconds
    big = torch.empty(8 * 1024 * 1024)  # 32 MiB: beyond the caches
    dst = torch.empty_like(big)
    bandwidth = 2 * big.nbytes / _time(lambda: dst.copy_(big))
    tiny = torch.ones(8)
    overhead = _time(lambda: [tiny.add(1) for _ in range(200)]) / 200
    try:
        import psutil  # type: ignore[import-not-found]

        memory = int(psutil.virtual_memory().total)
    except ImportError:
        import os

        memory = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return DeviceProfile(
        name="cpu",
        memory_bytes=memory,
        reserve_bytes=int(0.25 * memory),
        flops=flops,
        mem_bandwidth=bandwidth,
        host_bandwidth=bandwidth,
        launch_overhead=overhead,
        half_tokens=64.0,
    )


def get_device(name: str | None) -> DeviceProfile:
    """A profile by name (``cpu`` is measured); ``None`` is the current device.

    Raises:
        ValueError: for an unknown name, listing the known ones.
    """
    if name is None:
        if torch.cuda.is_available():
            from .. import device as _device

            total = _device.total_memory(_device.default_device()) or 0
            closest = min(DEVICES.values(), key=lambda d: abs(d.memory_bytes - total))
            return closest
        return cpu_profile()
    key = name.lower().replace("_", "-")
    if key == "cpu":
        return cpu_profile()
    if key not in DEVICES:
        raise ValueError(f"device {name!r} is not known; use one of cpu, {', '.join(DEVICES)}")
    return DEVICES[key]


def parse_budget(text: str | int) -> tuple[int, DeviceProfile | None]:
    """Parse a budget: a size (``4GiB``, ``4GB``, ``4096MiB``, ``0.5TiB``, bytes) or a device
    name (``t4``: that device's memory minus its stated reserve).

    Returns:
        The budget in bytes, and the device profile when a device was named.

    Raises:
        ValueError: with one sentence naming what is accepted.
    """
    if isinstance(text, str) and text.strip().lower().replace("_", "-") in DEVICES:
        dev = DEVICES[text.strip().lower().replace("_", "-")]
        return dev.budget_bytes, dev
    try:
        return parse_size(text), None
    except ValueError as e:
        if "positive" in str(e):
            raise ValueError(f"budget {text!r} must be a positive size, such as 4GiB") from None
        raise ValueError(
            f"budget {text!r} is not understood; use a size such as 4GiB, 4GB, 4096MiB, 0.5TiB "
            f"or plain bytes, or a device name ({', '.join(DEVICES)})"
        ) from None
