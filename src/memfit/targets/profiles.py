"""Device profiles: what a target device holds and how fast it computes.

A profile says what memfit needs to know of a device to predict a training run on it:

* memory: the card's memory, the CUDA context and library workspaces that live outside
  PyTorch's caching allocator (``nvidia-smi`` shows them; the allocator's ``memory_reserved`` does
  not), and whether the caching allocator models its reserved bytes (``kind == "cuda"``);
* kernels: compute capability and bf16 support, which decide the attention backend and the
  autocast dtype (see :mod:`memfit.targets.kernels`);
* speed, for the step-time model: matmul throughput per precision, memory and host-link
  bandwidth, per-operation launch overhead and how fast matmul efficiency falls for small
  micro-batches.

GPU figures are the vendors' dense peak numbers. The CPU profile is measured on this machine,
once per process. Another GPU is described by a JSON/YAML file or an inline ``key=value`` list
(:func:`parse_device`).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import MemfitTypeError, MemfitValueError, describe
from ..units import GiB, MiB, parse_size

__all__ = [
    "CUSTOM_FIELDS",
    "DEVICES",
    "DeviceProfile",
    "cpu_profile",
    "get_device",
    "machine_device",
    "parse_budget",
    "parse_device",
]


@dataclass(frozen=True)
class DeviceProfile:
    """One target device: its memory, its kernels' capabilities and its speed.

    Attributes:
        name: Short name (``t4``, ``a100``, ``cpu``, or a custom device's name).
        memory_bytes: Device memory as the driver reports it (``total_memory``).
        flops: Dense matmul FLOP/s by compute dtype (``fp32``, ``bf16``, ``fp16``).
        mem_bandwidth: Device memory bandwidth in bytes/s (pointwise ops, optimizer steps).
        host_bandwidth: Host-device link bandwidth in bytes/s (offload).
        launch_overhead: Seconds of fixed cost per operation (kernel launch, dispatch).
        half_tokens: Tokens per micro-batch at which matmuls reach half their peak rate.
        has_bf16: Whether the device computes in bf16 natively (Turing and older do not).
        kind: ``cuda`` for a GPU behind PyTorch's CUDA caching allocator, ``cpu`` otherwise.
        compute_capability: CUDA compute capability ``(major, minor)``; decides which fused
            attention kernels exist (flash attention needs 8.0 or newer).
        context_bytes: Memory the CUDA context takes outside the allocator (driver, kernels
            loaded lazily). Shown by ``nvidia-smi``, never by the allocator's ``memory_reserved``.
        workspace_bytes: The cuBLAS workspace of one handle. PyTorch allocates it through
            its caching allocator once per handle (thread) and stream: a training step holds
            two, the forward's and the autograd thread's, plus cuBLASLt's own 1 MiB
            (:attr:`workspaces_bytes`); memfit counts them here, beside the context, as fixed
            device overhead.
        nccl_bytes: NCCL's communicator buffers on one rank of a multi-process run (0 for
            one process): set per rank by :func:`memfit.estimate.nccl.rank_target`, part of
            ``overhead_bytes`` like the context.
        host_mem_bandwidth: Bytes/s a host-side optimizer step streams through host memory
            (optimizer offload's step is bound by it). Default 100 GB/s: a server socket's
            DDR5 channels give about 300 GB/s in theory; one optimizer process, like
            ZeRO-Offload's CPU Adam, reaches about a third of that.
        disk_bandwidth: Bytes/s the disk tier reads and writes optimizer state at. Default
            2 GB/s: a PCIe 4 NVMe drive's sustained writes (reads are faster).
        intra_node_bandwidth: Bytes/s one device sends to the others of its node in a
            collective (NVLink's one-direction rate, or the host link without NVLink): what
            tensor parallelism's per-layer all-reduces run at. 0: the host link.
        matmul_efficiency: The share of ``flops`` a training step's matmuls sustain with
            large micro-batches (the cost model's rate is ``flops x matmul_efficiency x t /
            (t + half_tokens)``). Built-in GPUs: 0.35, measured on an H100
            (``benchmarks/results/gpu_offload.md``: llama-1b in bf16-mixed, eager, 8 x 1024
            tokens per micro-batch, took 0.96 s a step where the vendor's peak gives 0.25 s of
            matmuls). The CPU's figure is measured, so 1.
        network_bandwidth: Bytes/s one device sends across nodes (its share of the node's
            network: 400 Gb/s InfiniBand per GPU is 50 GB/s): what data and pipeline
            parallelism run at when their groups span nodes. 0: a tenth of the host link.
    """

    name: str
    memory_bytes: int
    flops: Mapping[str, float]
    mem_bandwidth: float
    host_bandwidth: float
    launch_overhead: float
    half_tokens: float
    has_bf16: bool = True
    kind: str = "cuda"
    compute_capability: tuple[int, int] | None = None
    context_bytes: int = 0
    workspace_bytes: int = 0
    nccl_bytes: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict)
    host_mem_bandwidth: float = 100e9
    disk_bandwidth: float = 2e9
    intra_node_bandwidth: float = 0.0
    network_bandwidth: float = 0.0
    matmul_efficiency: float = 1.0

    @property
    def node_link_bandwidth(self) -> float:
        """Bytes/s for collectives within a node (``intra_node_bandwidth`` or the host link)."""
        return self.intra_node_bandwidth or self.host_bandwidth

    @property
    def cross_node_bandwidth(self) -> float:
        """Bytes/s for collectives across nodes (``network_bandwidth`` or a tenth of the host
        link)."""
        return self.network_bandwidth or self.host_bandwidth / 10

    @property
    def is_cuda(self) -> bool:
        """Whether runs on this device go through PyTorch's CUDA caching allocator."""
        return self.kind == "cuda"

    @property
    def supports_bf16(self) -> bool:
        """Whether the device computes in bf16 natively (T4 does not: use fp16 there)."""
        return self.has_bf16

    @property
    def workspaces_bytes(self) -> int:
        """The library workspaces a training step holds: cuBLAS's per handle for the forward's
        thread and the autograd engine's backward thread, and cuBLASLt's 1 MiB. Seen on an
        H100 (``benchmarks/results/gpu_h100.md``): after one step of bert-base the caching
        allocator held two 32 MiB blocks and one 1 MiB block that no tensor owned."""
        if self.workspace_bytes <= 0:
            return 0
        return CUBLAS_HANDLES_PER_STEP * self.workspace_bytes + _CUBLASLT_WORKSPACE

    @property
    def overhead_bytes(self) -> int:
        """Device memory used outside tensors: CUDA context, library workspaces and (on a rank
        of several processes) NCCL's communicators."""
        return self.context_bytes + self.workspaces_bytes + self.nccl_bytes

    @property
    def budget_bytes(self) -> int:
        """Memory the caching allocator may reserve: the card minus the fixed overhead.

        The planner compares a plan's predicted *reserved* peak (allocator model) with this.
        """
        return self.memory_bytes - self.overhead_bytes

    @property
    def reserve_bytes(self) -> int:
        """Memory a budget keeps back from the card: the fixed overhead (see ``budget_bytes``)."""
        return self.overhead_bytes


# The CUDA context with lazy module loading (CUDA >= 11.7, PyTorch's default) takes a few
# hundred MiB: NVIDIA documents lazy loading as cutting it from over 1 GiB to a few hundred
# MiB; the figure depends on the driver and the kernels a run touches. 500 MiB is the value
# used for the GPUs the validation harness (benchmarks/gpu_validate.py) has not measured.
_CONTEXT_BYTES = 500 * MiB
# Measured on an H200 (benchmarks/results/gpu_h200.md; torch 2.11+cu130, driver 580.159.04):
# the process held 617.6 MiB outside the caching allocator right after CUDA started and
# 747.6-763.6 MiB after two training steps of llama-1b (cuBLAS, cuDNN and the kernels loaded
# lazily); the larger is taken. The H100 is the same chip and software.
_CONTEXT_BYTES_HOPPER = 764 * MiB
# PyTorch's cuBLAS workspace per handle: 32 MiB on Hopper (sm90) and newer (":4096:8" in
# CUBLAS_WORKSPACE_CONFIG's format), else two 4 MiB and eight 16 KiB chunks (":4096:2:16:8",
# 8.125 MiB; Liger-Kernel's published A100 loss benchmarks hold two of them, the forward's and
# the autograd thread's, in max_memory_allocated: benchmarks/published); see
# aten/src/ATen/cuda/CublasHandlePool.cpp, getChosenWorkspaceSize / getDefaultWorkspaceSize.
_WORKSPACE_HOPPER = 32 * MiB
#: cuBLAS handles (each with its workspace) a training step uses: one per thread that runs
#: matrix products on the device, the caller's (forward) and the autograd engine's (backward).
CUBLAS_HANDLES_PER_STEP = 2
# cuBLASLt's workspace (torch's default CUBLASLT_WORKSPACE_SIZE, 1024 KiB), seen on the H100.
_CUBLASLT_WORKSPACE = 1 * MiB
_WORKSPACE_OLDER = 4096 * 1024 * 2 + 16 * 1024 * 8


# Sustained share of the vendor's peak in eager PyTorch training, measured on an H100 (see
# DeviceProfile.matmul_efficiency); taken for the other GPUs until measured on them.
_GPU_MATMUL_EFFICIENCY = 0.35


def _cuda(
    name: str,
    memory_bytes: int,
    flops: Mapping[str, float],
    bw: float,
    host: float,
    cc: tuple[int, int],
    has_bf16: bool = True,
    context_bytes: int | None = None,
    workspace_bytes: int | None = None,
    intra_node_bandwidth: float = 0.0,
    network_bandwidth: float = 0.0,
) -> DeviceProfile:
    if workspace_bytes is None:
        workspace_bytes = _WORKSPACE_HOPPER if cc >= (9, 0) else _WORKSPACE_OLDER
    return DeviceProfile(
        name=name,
        memory_bytes=memory_bytes,
        flops=dict(flops),
        mem_bandwidth=bw,
        host_bandwidth=host,
        # A CUDA kernel launch plus PyTorch's dispatch costs a few microseconds (PyTorch's
        # eager-mode overhead is commonly measured at 5-10 us per op).
        launch_overhead=6e-6,
        # Calibrated on the published BERT-large ladder (shared/REFERENCE.md): batch 1 x 32
        # (128 tokens per micro-batch) ran 2.8x slower than batch 32, which t/(t+256) gives.
        half_tokens=256.0,
        has_bf16=has_bf16,
        kind="cuda",
        compute_capability=cc,
        context_bytes=(
            (_CONTEXT_BYTES_HOPPER if cc[0] == 9 else _CONTEXT_BYTES)
            if context_bytes is None
            else context_bytes
        ),
        workspace_bytes=workspace_bytes,
        intra_node_bandwidth=intra_node_bandwidth,
        network_bandwidth=network_bandwidth,
        matmul_efficiency=_GPU_MATMUL_EFFICIENCY,
    )


def _gpu(
    name: str,
    mem_gib: float,
    fp32: float,
    bf16: float,
    fp16: float,
    bw: float,
    host: float,
    cc: tuple[int, int],
    has_bf16: bool = True,
    nvlink: float = 0.0,
    network: float = 0.0,
) -> DeviceProfile:
    flops = {"fp32": fp32, "bf16": bf16, "fp16": fp16}
    return _cuda(name, int(mem_gib * GiB), flops, bw, host, cc, has_bf16,
                 intra_node_bandwidth=nvlink, network_bandwidth=network)


#: Built-in GPU profiles (vendors' dense peak throughput; fp32 without TF32). Interconnects:
#: an HGX node's NVLink, one direction (H100 NVLink 4: 900 GB/s both ways; A100 NVLink 3:
#: 600 GB/s), and one network adapter per GPU across nodes (400 Gb/s NDR InfiniBand with H100,
#: 200 Gb/s HDR with A100). Cards without NVLink talk over PCIe.
DEVICES: dict[str, DeviceProfile] = {
    "h100": _gpu("h100", 79.6, 67e12, 989e12, 989e12, 3.35e12, 55e9, (9, 0), nvlink=450e9,
                 network=50e9),
    # H200 SXM: the H100's chip with 141 GB of HBM3e at 4.8 TB/s (NVIDIA's datasheet);
    # nvidia-smi shows 143771 MiB on the lent machine (KINDS.md), 140.4 GiB.
    "h200": _gpu("h200", 140.4, 67e12, 989e12, 989e12, 4.8e12, 55e9, (9, 0), nvlink=450e9,
                 network=50e9),
    "a100": _gpu("a100", 79.2, 19.5e12, 312e12, 312e12, 2.04e12, 25e9, (8, 0), nvlink=300e9,
                 network=25e9),
    "a100-40gb": _gpu("a100-40gb", 39.4, 19.5e12, 312e12, 312e12, 1.56e12, 25e9, (8, 0),
                      nvlink=300e9, network=25e9),
    "rtx4090": _gpu("rtx4090", 23.6, 82.6e12, 165e12, 165e12, 1.01e12, 25e9, (8, 9)),
    # Turing has no bf16 units: bf16 falls back to fp32 rates; fp16 runs on tensor cores.
    "t4": _gpu("t4", 14.75, 8.1e12, 8.1e12, 65e12, 0.32e12, 12e9, (7, 5), has_bf16=False),
}


def _time(fn: Any, repeat: int = 3) -> float:
    """The best of ``repeat`` timed calls after a warm-up; a call as slow as 50 ms is timed
    once more only (fp16 matmuls on a CPU without fp16 units: the rate is plain to see, and
    three more calls would add half a second to every plan)."""
    t0 = time.perf_counter()
    fn()
    best = time.perf_counter() - t0
    if best > 0.05:
        repeat = 1
    else:
        best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _matmul_rate(a: torch.Tensor) -> float:
    """FLOP/s of the square product ``a @ a``: the best of :func:`_time`'s calls of four
    products, or, when one product takes over 10 ms (a dtype this CPU emulates, such as fp16
    without fp16 units), one product timed after a warm-up: that rate is plain to see, and
    timing more would add a quarter of a second to every plan."""
    n = a.shape[0]
    a @ a  # warm-up
    t0 = time.perf_counter()
    a @ a
    one = time.perf_counter() - t0
    if one > 0.01:
        return 2 * n**3 / one
    return 4 * 2 * n**3 / _time(lambda: [a @ a for _ in range(4)])


#: Environment variable naming the folder where memfit keeps what it measured on this machine
#: (default: ``$XDG_CACHE_HOME/memfit``, else ``~/.cache/memfit``).
CACHE_DIR_ENV = "MEMFIT_CACHE_DIR"


def cache_dir() -> Path:
    """The folder where memfit keeps what it measured on this machine."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "memfit"


def _machine_key() -> str:
    """What a CPU measurement holds for: the processor, its cores, the threads torch uses, and
    the torch and memfit versions (a new kernel library can change every rate)."""
    model = platform.machine()  # (platform.processor() would start a process: uname -p)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                model,
            )
    except OSError:
        pass
    from ..versions import __version__

    return (
        f"{model} | {os.cpu_count()} cpus | {torch.get_num_threads()} threads | "
        f"torch {torch.__version__} | memfit {__version__}"
    )


def _measure_cpu_rates() -> dict[str, float]:
    n = 384
    rates = {
        name: _matmul_rate(torch.randn(n, n).to(dtype))
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16))
    }
    big = torch.empty(8 * 1024 * 1024)  # 32 MiB: beyond the caches
    dst = torch.empty_like(big)
    rates["mem_bandwidth"] = 2 * big.nbytes / _time(lambda: dst.copy_(big))
    tiny = torch.ones(8)
    rates["launch_overhead"] = _time(lambda: [tiny.add(1) for _ in range(200)]) / 200
    return rates


def _stored_cpu_rates() -> dict[str, float]:
    """This CPU's rates: measured once per machine (see :func:`_machine_key`), stored in
    :func:`cache_dir`, and read back by every later process.

    Timings vary with the machine's load from one run to the next; a planner that re-measured
    them would order close candidates differently on a busy machine. Stored, the answer
    depends on the inputs alone. Processes that start together (test workers, a launcher's
    ranks) take turns under a lock, so one measures and the others read what it stored. Where
    the folder cannot be written, the rates are measured in each process (and the planner's
    answer can vary with the load).
    """
    path = cache_dir() / "cpu-profile.json"
    key = _machine_key()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(path.name + ".lock"), "a")  # noqa: SIM115 (held below)
    except OSError:
        return _measure_cpu_rates()
    with lock:
        try:
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX)
        except (ImportError, OSError):  # no flock (Windows): measure and store all the same
            pass
        stored = _read_store(path)
        entry = stored.get(key)
        if isinstance(entry, dict) and all(isinstance(entry.get(k), (int, float)) for k in _RATES):
            return {k: float(entry[k]) for k in _RATES}
        rates = _measure_cpu_rates()
        stored[key] = rates
        # Written aside and renamed: a reader without the lock sees the old file or the new
        # one, never half of one.
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(stored, indent=1, sort_keys=True))
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
        return rates


_RATES = ("fp32", "bf16", "fp16", "mem_bandwidth", "launch_overhead")


def _read_store(path: Path) -> dict[str, Any]:
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return stored if isinstance(stored, dict) else {}


@functools.lru_cache(maxsize=1)
def cpu_profile() -> DeviceProfile:
    """This CPU: matmul FLOP/s per dtype, memory bandwidth, op overhead, measured once per
    machine and stored (:func:`_stored_cpu_rates`; delete ``cpu-profile.json`` in
    :func:`cache_dir` to measure again)."""
    rates = _stored_cpu_rates()
    flops = {k: rates[k] for k in ("fp32", "bf16", "fp16")}
    bandwidth = rates["mem_bandwidth"]
    overhead = rates["launch_overhead"]
    try:
        import psutil  # type: ignore[import-not-found]

        memory = int(psutil.virtual_memory().total)
    except ImportError:
        memory = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return DeviceProfile(
        name="cpu",
        memory_bytes=memory,
        flops=flops,
        mem_bandwidth=bandwidth,
        host_bandwidth=bandwidth,
        launch_overhead=overhead,
        half_tokens=64.0,
        kind="cpu",
        host_mem_bandwidth=bandwidth,
        # The host keeps a quarter for the operating system and everything else running.
        context_bytes=int(0.25 * memory),
    )


def machine_device() -> DeviceProfile:
    """This machine's own compute device: its GPU's profile (closest by memory), else the CPU."""
    from ..device import default_device, total_memory

    total = total_memory(default_device())
    if not total:
        return cpu_profile()
    return min(DEVICES.values(), key=lambda d: abs(d.memory_bytes - total))


def _known() -> str:
    return ", ".join(["cpu", *DEVICES])


def get_device(name: str | DeviceProfile | None) -> DeviceProfile:
    """A profile by name (``cpu`` is measured), a custom description, or ``None``: this machine.

    Args:
        name: A built-in name, a path to a JSON/YAML device description, an inline description
            (``name=mygpu,memory=24GiB,...``; see :func:`parse_device`), a profile (returned
            as is), or ``None`` for this machine's own device.

    Raises:
        ValueError: for an unknown name, listing the known ones, or a custom description that
            lacks a field, naming it.
    """
    if name is None:
        return machine_device()
    if isinstance(name, DeviceProfile):
        return name
    if not isinstance(name, str):
        raise MemfitTypeError(
            f"device must be a device name ({_known()}), a custom description, a "
            f"DeviceProfile or None, got {describe(name)}"
        )
    key = name.strip().lower().replace("_", "-")
    if key == "cpu":
        return cpu_profile()
    if key in DEVICES:
        return DEVICES[key]
    if "=" in name or Path(name).suffix.lower() in (".json", ".yaml", ".yml"):
        return parse_device(name)
    raise MemfitValueError(
        f"device {name!r} is not known; use one of {_known()}, or describe another GPU in a "
        f"JSON/YAML file or inline as {', '.join(CUSTOM_FIELDS)}=VALUE,..."
    )


#: Fields a custom GPU description must give (see :func:`parse_device`).
CUSTOM_FIELDS: tuple[str, ...] = (
    "name",
    "memory",
    "mem_bandwidth",
    "host_bandwidth",
    "compute_capability",
    "bf16",
)
_OPTIONAL = (
    "fp32_tflops", "bf16_tflops", "fp16_tflops", "context", "workspace", "intra_node_bandwidth",
    "network_bandwidth",
)


def parse_device(spec: str | Mapping[str, Any]) -> DeviceProfile:
    """Describe another GPU: a JSON/YAML file, an inline ``key=value,...`` list, or a mapping.

    Fields: ``name``; ``memory`` (a size: ``24GiB``); ``mem_bandwidth`` and ``host_bandwidth``
    (bytes per second: ``1.0e12``, or a size per second such as ``1TB/s``, ``32GB/s``);
    ``compute_capability`` (``8.9``); ``bf16`` (true/false). Optional: ``fp32_tflops``,
    ``bf16_tflops``, ``fp16_tflops`` (dense peak, for the step-time model; default: scaled
    from the bandwidth like an A100), ``context`` and ``workspace`` (sizes; default: the
    built-in GPUs' values), ``intra_node_bandwidth`` and ``network_bandwidth`` (rates, for
    the 3-D planner's communication times; default: the host link, and a tenth of it).

    Example: ``name=l4,memory=22.5GiB,mem_bandwidth=300GB/s,host_bandwidth=32GB/s,
    compute_capability=8.9,bf16=true,bf16_tflops=121``.

    Raises:
        ValueError: naming the first missing or malformed field.
    """
    data = _read_description(spec)
    missing = [f for f in CUSTOM_FIELDS if f not in data]
    if missing:
        raise MemfitValueError(
            f"the device description lacks the field {missing[0]!r}; a custom device needs "
            f"{', '.join(CUSTOM_FIELDS)}"
        )
    unknown = sorted(set(data) - set(CUSTOM_FIELDS) - set(_OPTIONAL))
    if unknown:
        raise MemfitValueError(
            f"the device description has an unknown field {unknown[0]!r}; fields are "
            f"{', '.join(CUSTOM_FIELDS + _OPTIONAL)}"
        )
    name = str(data["name"]).strip()
    if not name:
        raise MemfitValueError("the device description's field 'name' is empty")
    memory = _size_field(data, "memory")
    bw = _rate_field(data, "mem_bandwidth")
    host = _rate_field(data, "host_bandwidth")
    cc = _cc_field(data["compute_capability"])
    bf16 = _bool_field(data, "bf16")
    # Without throughput figures, scale an A100's by memory bandwidth (the two move together
    # across generations closely enough for ranking plans; give the figures for timings).
    scale = bw / 2.04e12
    flops = {
        "fp32": _tflops(data, "fp32_tflops", 19.5e12 * scale),
        "bf16": _tflops(data, "bf16_tflops", 312e12 * scale if bf16 else 19.5e12 * scale),
        "fp16": _tflops(data, "fp16_tflops", 312e12 * scale),
    }
    return _cuda(
        name,
        memory,
        flops,
        bw,
        host,
        cc,
        bf16,
        context_bytes=_size_field(data, "context") if "context" in data else None,
        workspace_bytes=_size_field(data, "workspace") if "workspace" in data else None,
        intra_node_bandwidth=_optional_rate(data, "intra_node_bandwidth"),
        network_bandwidth=_optional_rate(data, "network_bandwidth"),
    )


def _optional_rate(data: Mapping[str, Any], key: str) -> float:
    return _rate_field(data, key) if key in data else 0.0


def _read_description(spec: str | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(spec, Mapping):
        return dict(spec)
    path = Path(spec)
    if path.suffix.lower() in (".json", ".yaml", ".yml"):
        if not path.is_file():
            raise MemfitValueError(f"device description file {str(path)!r} does not exist")
        text = path.read_text()
        try:
            if path.suffix.lower() == ".json":
                data = json.loads(text)
            else:
                import yaml

                data = yaml.safe_load(text)
        except Exception as e:  # malformed file: say which
            raise MemfitValueError(
                f"device description file {str(path)!r} cannot be read ({e})") from None
        if not isinstance(data, Mapping):
            raise MemfitValueError(
                f"device description file {str(path)!r} must hold a mapping of fields "
                f"({', '.join(CUSTOM_FIELDS)})"
            )
        return dict(data)
    out: dict[str, Any] = {}
    for part in spec.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        if not sep:
            raise MemfitValueError(
                f"device description part {part.strip()!r} is not key=value; write "
                f"{', '.join(CUSTOM_FIELDS)}=VALUE separated by commas"
            )
        out[key.strip()] = value.strip()
    return out


def _size_field(data: Mapping[str, Any], key: str) -> int:
    value = data[key]
    if key != "memory" and str(value).strip() == "0":
        return 0  # no context or workspace to count
    try:
        return parse_size(value if isinstance(value, (int, str)) else int(value))
    except (ValueError, TypeError):
        raise MemfitValueError(
            f"device description field {key!r} must be a size such as 24GiB, got {value!r}"
        ) from None


def _rate_field(data: Mapping[str, Any], key: str) -> float:
    value = data[key]
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    text = str(value).strip()
    try:
        number = float(text)
        if number > 0:
            return number
    except ValueError:
        pass
    if text.lower().endswith("/s"):
        try:
            return float(parse_size(text[:-2]))
        except ValueError:
            pass
    raise MemfitValueError(
        f"device description field {key!r} must be bytes per second (1.5e12, 1.5TB/s, "
        f"32GB/s), got {value!r}"
    )


def _cc_field(value: Any) -> tuple[int, int]:
    text = str(value).strip()
    major, _, minor = text.partition(".")
    try:
        cc = (int(major), int(minor or 0))
    except ValueError:
        raise MemfitValueError(
            f"device description field 'compute_capability' must look like 8.0 or 9.0, got "
            f"{value!r}"
        ) from None
    if not 3 <= cc[0] <= 20:
        raise MemfitValueError(f"compute capability {text} is not a CUDA compute capability")
    return cc


def _bool_field(data: Mapping[str, Any], key: str) -> bool:
    value = data[key]
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "yes", "1", "on"):
        return True
    if text in ("false", "no", "0", "off"):
        return False
    raise MemfitValueError(f"device description field {key!r} must be true or false, got {value!r}")


def _tflops(data: Mapping[str, Any], key: str, default: float) -> float:
    if key not in data:
        return default
    try:
        value = float(data[key])
    except (TypeError, ValueError):
        raise MemfitValueError(
            f"device description field {key!r} must be a number of TFLOP/s, got {data[key]!r}"
        ) from None
    if value <= 0:
        raise MemfitValueError(f"device description field {key!r} must be > 0, got {value}")
    return value * 1e12


def parse_budget(text: str | int) -> tuple[int, DeviceProfile | None]:
    """Parse a budget: a size (``4GiB``, ``4GB``, ``4096MiB``, ``0.5TiB``, whole bytes) or a
    device name (``t4``: that device's whole memory; the planner then fits the device total,
    allocator reserve and CUDA context included). A bare number is bytes and must be whole
    (:func:`~memfit.units.parse_size`): ``4.5`` is refused, not read as 4 bytes.

    Returns:
        The budget in bytes, and the device profile when a device was named.

    Raises:
        MemfitTypeError: for anything but a string or a number.
        MemfitValueError: with one sentence naming what is accepted.
    """
    accepted = (
        f"a size such as 4GiB, 4GB, 4096MiB, 0.5TiB or whole bytes, or a device name "
        f"({', '.join(DEVICES)})"
    )
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise MemfitTypeError(f"budget must be {accepted}, got {describe(text)}")
    if isinstance(text, str) and text.strip().lower().replace("_", "-") in DEVICES:
        dev = DEVICES[text.strip().lower().replace("_", "-")]
        return dev.memory_bytes, dev
    try:
        return parse_size(text), None
    except ValueError as e:
        if "positive" in str(e) or "less than one byte" in str(e):
            raise MemfitValueError(
                f"budget {text!r} must be a positive size, such as 4GiB") from None
        if "whole number" in str(e):
            raise MemfitValueError(
                f"budget {text!r} is not a whole number of bytes; give whole bytes or a unit, "
                "such as 4.5GiB"
            ) from None
        raise MemfitValueError(f"budget {text!r} is not understood; use {accepted}") from None
