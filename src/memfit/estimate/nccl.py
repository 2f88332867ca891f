"""NCCL's communicator memory on each rank of a multi-process run on CUDA devices.

Every NCCL communicator a process joins holds device memory outside PyTorch's caching
allocator: per channel and per peer connection one buffer per protocol (LL, LL128, Simple),
and on Hopper nodes with NVSwitch the NVLink SHARP (NVLS) buffers. ``nvidia-smi`` shows it,
PyTorch's ``memory_reserved`` never does. Published figures: about 0.5-0.7 GB per process
group on 4 A100s (nccl#964), gigabytes with several groups (nccl#864), and "more
communicators = more memory, linearly tied to the number of channels" (NCCL's maintainer,
nccl#864 / nccl#986).

torch.distributed has no estimate of it; this module models it from NCCL's own sizes (each
constant below names where it comes from) and the process groups a plan creates
(:func:`process_groups`), and lets a user's NCCL settings override the defaults
(:meth:`NcclSettings.from_env` reads the same ``NCCL_*`` variables NCCL reads). Zero for one
process, for CPU targets and for gloo.

The model, per communicator of ``n`` ranks, on one rank:

* Ring: per channel, one connection (a receive buffer of ``LL + LL128 + Simple`` bytes from
  the previous rank, and a send-side header to the next).
* Tree: per channel, a connection each way with each tree neighbour; NCCL builds each
  channel's tree over a different order of the ranks, so a rank averages ``2 (n - 1) / n``
  neighbours (a chain's ``n - 1`` links, each with two ends).
* NVLS (Hopper, NVSwitch, more than two of the group's ranks on the node): ``channels x 2 x
  chunk x NCCL_STEPS`` bytes for each of the node's ranks, bound to a multicast object.
* Point-to-point groups (a pipeline's): per neighbouring stage, per channel, one
  connection each way; NCCL_NCHANNELS_PER_NET_PEER channels per peer across nodes.

Checked against nccl#964 (4 x A100 with NVLink, 24 channels, cuMem): 576 MiB for a 2-rank
group (measured 544 MB), 672 and 720 MiB for 3 and 4 ranks (measured 688 MB); the tests hold
the model within 10% of those figures.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..distributed.config import ParallelConfig
from ..targets import DeviceProfile
from ..units import KiB, MiB

__all__ = [
    "NcclSettings",
    "ProcessGroup",
    "communicator_bytes",
    "nccl_bytes",
    "nccl_rank_bytes",
    "process_groups",
    "rank_target",
]

#: NCCL's default buffer of each protocol, per connection (NCCL src/init.cc):
#: ``DEFAULT_LL_BUFFSIZE`` = 8 lines x 512 threads x 8 steps x 16 bytes (512 KiB),
#: ``DEFAULT_LL128_BUFFSIZE`` = 120 elements x 640 threads x 8 steps x 8 bytes (4,800 KiB),
#: ``DEFAULT_BUFFSIZE`` = 4 MiB (the Simple protocol's; NCCL docs, NCCL_BUFFSIZE: "default is
#: 4194304 (4 MiB)"). NCCL_LL_BUFFSIZE, NCCL_LL128_BUFFSIZE and NCCL_BUFFSIZE override them.
LL_BUFFSIZE = 8 * 512 * 8 * 16
LL128_BUFFSIZE = 120 * 640 * 8 * 8
SIMPLE_BUFFSIZE = 4 * MiB
#: NCCL allocates its buffers with the CUDA virtual memory API (cuMem, NCCL_CUMEM_ENABLE, on
#: by default since 2.19), in 2 MiB granules: nccl#1685 logs (8 x H100) show each
#: connection's receive side as one 10,485,760-byte allocation (LL + LL128 + Simple, 9.19 MiB,
#: rounded up) and its send side as one 2,097,152-byte allocation.
CUMEM_GRANULARITY = 2 * MiB
#: The send side's header (head/tail pointers, ``struct ncclSendMem``) without cuMem: one page.
HEADER_BYTES = 4 * KiB
#: NCCL_STEPS: slots of a connection's FIFO (NCCL src/include/device.h; nccl#391).
NCCL_STEPS = 8
#: NVLS (NCCL src/transport/nvls.cc): NCCL_NVLS_CHUNKSIZE defaults to 128 KiB, and Hopper
#: (sm90) uses ``NVLS_NCHANNELS_SM90`` = 16 channels (NCCL_NVLS_NCHANNELS overrides); NVLS
#: needs more than two GPUs (``gpuCount <= 2`` turns it off) and NVSwitch.
NVLS_CHUNKSIZE = 128 * KiB
NVLS_CHANNELS_SM90 = 16
#: NCCL_NCHANNELS_PER_NET_PEER's default (NCCL docs): channels per peer for point-to-point
#: operations across the network.
NET_CHANNELS_PER_PEER = 2
#: NCCL's most channels (MAXCHANNELS, 32; NCCL_MAX_NCHANNELS lowers it).
MAX_CHANNELS = 32
#: Channels without NVLink: NCCL's search finds one ring per PCIe path, two channels per
#: ring; not measured here (an assumption: set NCCL_MIN_NCHANNELS / NCCL_MAX_NCHANNELS to pin).
PCIE_CHANNELS = 2
#: Schedules whose processes hold several stages in a loop: the first rank also talks to the
#: last (two pipeline neighbours on every rank).
LOOPED_SCHEDULES = frozenset({"interleaved-1f1b"})

_ALGORITHMS = ("ring", "tree", "nvls")


def default_channels(target: DeviceProfile) -> int:
    """NCCL's collective channels on ``target`` within a node: two per NVLink, at most
    :data:`MAX_CHANNELS` (NCCL's logs: 16 "coll channels" on H800's 8 links, nccl#892; 24 on
    A100's 12, nccl#964's 4 x A100 matches it, see the module docstring; 32 on H100's 18,
    nccl#1685), :data:`PCIE_CHANNELS` without NVLink."""
    if not target.intra_node_bandwidth:
        return PCIE_CHANNELS
    major = (target.compute_capability or (0, 0))[0]
    links = 18 if major >= 9 else 12  # H100/H200 SXM: NVLink 4 x 18; A100 SXM: NVLink 3 x 12
    return min(2 * links, MAX_CHANNELS)


@dataclass(frozen=True)
class NcclSettings:
    """The NCCL settings that decide its buffers, as NCCL reads them from the environment.

    Attributes:
        buffsize: NCCL_BUFFSIZE, the Simple protocol's buffer per connection.
        ll_buffsize: NCCL_LL_BUFFSIZE.
        ll128_buffsize: NCCL_LL128_BUFFSIZE.
        min_channels: NCCL_MIN_NCHANNELS (``None``: NCCL's choice).
        max_channels: NCCL_MAX_NCHANNELS (``None``: NCCL's choice).
        net_channels_per_peer: NCCL_NCHANNELS_PER_NET_PEER.
        nvls: NCCL_NVLS_ENABLE (``False`` when set to 0).
        nvls_channels: NCCL_NVLS_NCHANNELS (``None``: 16 on Hopper).
        nvls_chunksize: NCCL_NVLS_CHUNKSIZE.
        cumem: NCCL_CUMEM_ENABLE (buffers in 2 MiB granules).
        algorithms: The algorithms NCCL_ALGO allows (``ring``, ``tree``, ``nvls``).
    """

    buffsize: int = SIMPLE_BUFFSIZE
    ll_buffsize: int = LL_BUFFSIZE
    ll128_buffsize: int = LL128_BUFFSIZE
    min_channels: int | None = None
    max_channels: int | None = None
    net_channels_per_peer: int = NET_CHANNELS_PER_PEER
    nvls: bool = True
    nvls_channels: int | None = None
    nvls_chunksize: int = NVLS_CHUNKSIZE
    cumem: bool = True
    algorithms: frozenset[str] = frozenset(_ALGORITHMS)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> NcclSettings:
        """The settings in ``env`` (default: this process's environment); unset ones take
        NCCL's defaults.

        Raises:
            ValueError: for a value NCCL would not take, in one sentence.
        """
        env = os.environ if env is None else env

        def number(name: str, default: int | None, low: int = 1) -> int | None:
            text = env.get(name)
            if text is None or text.strip() == "":
                return default
            try:
                value = int(text.strip(), 0)
            except ValueError:
                value = low - 1
            if value < low:
                raise ValueError(f"{name} must be a whole number >= {low}, got {text!r}")
            return value

        return cls(
            buffsize=number("NCCL_BUFFSIZE", SIMPLE_BUFFSIZE) or SIMPLE_BUFFSIZE,
            ll_buffsize=number("NCCL_LL_BUFFSIZE", LL_BUFFSIZE) or LL_BUFFSIZE,
            ll128_buffsize=number("NCCL_LL128_BUFFSIZE", LL128_BUFFSIZE) or LL128_BUFFSIZE,
            min_channels=number("NCCL_MIN_NCHANNELS", None),
            max_channels=number("NCCL_MAX_NCHANNELS", None),
            net_channels_per_peer=number("NCCL_NCHANNELS_PER_NET_PEER", NET_CHANNELS_PER_PEER)
            or NET_CHANNELS_PER_PEER,
            nvls=number("NCCL_NVLS_ENABLE", 2, low=0) != 0,
            nvls_channels=number("NCCL_NVLS_NCHANNELS", None),
            nvls_chunksize=number("NCCL_NVLS_CHUNKSIZE", NVLS_CHUNKSIZE) or NVLS_CHUNKSIZE,
            cumem=number("NCCL_CUMEM_ENABLE", 1, low=0) != 0,
            algorithms=_algorithms(env.get("NCCL_ALGO")),
        )

    def channels(self, target: DeviceProfile) -> int:
        """Collective channels per communicator on ``target``, within NCCL_MIN_NCHANNELS and
        NCCL_MAX_NCHANNELS."""
        n = default_channels(target)
        if self.min_channels is not None:
            n = max(n, self.min_channels)
        if self.max_channels is not None:
            n = min(n, self.max_channels)
        return max(1, min(n, MAX_CHANNELS))

    def connection_bytes(self) -> int:
        """One connection's bytes on a rank: its receive buffers (every protocol's) and its
        send-side header, each allocation in cuMem granules when cuMem is on."""
        recv = self.ll_buffsize + self.ll128_buffsize + self.buffsize
        return _granules(recv, self.cumem) + _granules(HEADER_BYTES, self.cumem)


def _granules(nbytes: int, cumem: bool) -> int:
    if not cumem:
        return nbytes
    return -(-nbytes // CUMEM_GRANULARITY) * CUMEM_GRANULARITY


def _algorithms(text: str | None) -> frozenset[str]:
    """NCCL_ALGO's algorithms among ring, tree and NVLS (``^`` excludes the list; the others
    NCCL knows, CollNet and PAT, hold no buffers this model counts)."""
    if text is None or not text.strip():
        return frozenset(_ALGORITHMS)
    text = text.strip()
    exclude = text.startswith("^")
    named = {a.strip().lower() for a in text.lstrip("^").split(",") if a.strip()}
    if exclude:
        return frozenset(a for a in _ALGORITHMS if a not in named)
    return frozenset(a for a in _ALGORITHMS if a in named)


@dataclass(frozen=True)
class ProcessGroup:
    """One process group (one NCCL communicator) as one rank sees it.

    Attributes:
        name: ``world``, ``data``, ``tensor``, ``pipeline``, ``context`` or ``data x
            context``.
        size: Its ranks.
        local: Its ranks on this rank's node (this rank included).
        p2p_peers: For a point-to-point group (a pipeline's, a context ring's or all-to-all's):
            the ranks this rank sends to and receives from; 0 for a group of collectives.
    """

    name: str
    size: int
    local: int
    p2p_peers: int = 0

    @property
    def crosses_nodes(self) -> bool:
        """Whether the group has ranks on other nodes."""
        return self.local < self.size


def process_groups(parallel: ParallelConfig, rank: int, gpus_per_node: int = 8) -> list[ProcessGroup]:
    """The NCCL communicators ``rank`` joins under ``parallel``.

    The default group (``world``) whenever there are several processes: DDP, ZeRO-1's
    ``ZeroRedundancyOptimizer`` and FSDP2 on a one-dimensional mesh over every rank all run on
    it (torch's ``DeviceMesh`` reuses the default group for a 1-D mesh of the whole world).
    A tensor or pipeline layout's 3-D mesh (``pp x dp x tp``) creates a group per dimension:
    ``tensor`` (consecutive ranks), ``data`` (also FSDP2's under ZeRO 2/3) and ``pipeline``
    (send/receive between neighbouring stages). The default group stays counted beside them:
    memfit's layout runs gather each rank's peak and checkpoint on it. Groups of one rank hold
    no buffers. Not counted: the small groups of the ranks sharing a tied weight across
    pipeline stages. With context parallelism the mesh has a ``cp`` dimension too
    (``context``: the ring's two neighbours, or all-to-all's every other rank, point to
    point) and the gradients are reduced on ``dp`` and ``cp`` flattened (``data x context``).

    Args:
        parallel: The plan's degrees.
        rank: The rank.
        gpus_per_node: Devices per node (ranks fill nodes in order).
    """
    world = parallel.world_size
    if world <= 1:
        return []
    g = max(1, gpus_per_node)
    node = rank // g

    def local(members: list[int]) -> int:
        return sum(1 for m in members if m // g == node)

    groups = [ProcessGroup("world", world, min(g, world - node * g))]
    if not parallel.splits_model:
        return groups
    t, d, p, c = parallel.tensor, parallel.data, parallel.pipeline, parallel.context
    at = parallel.coordinates(rank)
    stage, replica, chunk, shard = at["stage"], at["replica"], at["chunk"], at["shard"]

    def rank_of(st: int, rep: int, sh: int, ch: int = chunk) -> int:
        return ((st * d + rep) * c + ch) * t + sh

    members = {
        "tensor": [rank_of(stage, replica, i) for i in range(t)],
        "data": [rank_of(stage, i, shard) for i in range(d)],
        "pipeline": [rank_of(i, replica, shard) for i in range(p)],
        "context": [rank_of(stage, replica, shard, i) for i in range(c)],
        "data x context": ([rank_of(stage, i, shard, j) for i in range(d) for j in range(c)]
                           if d > 1 and c > 1 else []),
    }
    for name, ranks in members.items():
        size = len(ranks)
        if size <= 1:
            continue
        peers = 0
        if name == "pipeline":
            if size == 2:
                peers = 1
            elif parallel.schedule in LOOPED_SCHEDULES:
                peers = 2
            else:
                peers = int(stage > 0) + int(stage < size - 1)
        elif name == "context":
            peers = size - 1 if parallel.context_mode == "all-to-all" else min(2, size - 1)
        groups.append(ProcessGroup(name, size, local(ranks), peers))
    return groups


def communicator_bytes(group: ProcessGroup, target: DeviceProfile, settings: NcclSettings) -> int:
    """One rank's device bytes for ``group``'s communicator on ``target`` (see the module
    docstring for the model)."""
    if not target.is_cuda:
        return 0
    hopper = (target.compute_capability or (0, 0))[0] == 9
    return _group_bytes(group, settings.channels(target),
                        hopper and bool(target.intra_node_bandwidth), settings)


def _group_bytes(group: ProcessGroup, channels: int, nvls_capable: bool,
                 settings: NcclSettings) -> int:
    """:func:`communicator_bytes` for ``channels`` collective channels; ``nvls_capable``: a
    Hopper node with NVSwitch."""
    if group.size <= 1:
        return 0
    conn = settings.connection_bytes()
    if group.p2p_peers:
        per_peer = settings.net_channels_per_peer if group.crosses_nodes else channels
        return group.p2p_peers * per_peer * conn
    total = 0
    if "ring" in settings.algorithms:
        total += channels * conn
    if "tree" in settings.algorithms:
        # 2 (n - 1) / n neighbours on average, in exact integer arithmetic.
        total += channels * conn * 2 * (group.size - 1) // group.size
    if "nvls" in settings.algorithms and settings.nvls and nvls_capable and group.local > 2:
        nvls_channels = settings.nvls_channels or NVLS_CHANNELS_SM90
        total += nvls_channels * 2 * settings.nvls_chunksize * NCCL_STEPS * group.local
    return total


def nccl_bytes(
    parallel: ParallelConfig,
    rank: int,
    target: DeviceProfile,
    *,
    gpus_per_node: int = 8,
    settings: NcclSettings | None = None,
) -> int:
    """``rank``'s NCCL communicator bytes under ``parallel`` on ``target``: 0 for one process,
    a CPU target or the gloo backend.

    Raises:
        ValueError: for an ``NCCL_*`` setting NCCL would not take (when ``settings`` is read
            from the environment).
    """
    if parallel.world_size <= 1 or not target.is_cuda or parallel.backend == "gloo":
        return 0
    settings = settings or NcclSettings.from_env()
    return sum(
        communicator_bytes(g, target, settings)
        for g in process_groups(parallel, rank, gpus_per_node)
    )


def nccl_rank_bytes(
    parallel: ParallelConfig,
    target: DeviceProfile,
    *,
    gpus_per_node: int = 8,
    settings: NcclSettings | None = None,
) -> list[int]:
    """Every rank's NCCL bytes (:func:`nccl_bytes`), in rank order."""
    if parallel.world_size <= 1 or not target.is_cuda or parallel.backend == "gloo":
        return [0] * parallel.world_size
    settings = settings or NcclSettings.from_env()
    key = (parallel.data, parallel.tensor, parallel.pipeline, parallel.schedule,
           parallel.context, parallel.context_mode)
    hopper = (target.compute_capability or (0, 0))[0] == 9
    return list(_rank_bytes(key, max(1, gpus_per_node), settings.channels(target),
                            hopper and bool(target.intra_node_bandwidth), settings))


@functools.lru_cache(maxsize=1024)
def _rank_bytes(degrees: tuple[int, int, int, str, int, str], gpus_per_node: int, channels: int,
                nvls_capable: bool, settings: NcclSettings) -> tuple[int, ...]:
    """Every rank's bytes for one layout on one kind of device: the 3-D planner asks for the
    same layouts many times (once per setting it prices)."""
    data, tensor, pipeline, schedule, context, mode = degrees
    parallel = ParallelConfig(data=data, tensor=tensor, pipeline=pipeline, schedule=schedule,
                              context=context, context_mode=mode)
    known: dict[tuple[ProcessGroup, ...], int] = {}  # ranks alike cost alike
    out = []
    for r in range(parallel.world_size):
        groups = tuple(process_groups(parallel, r, gpus_per_node))
        if groups not in known:
            known[groups] = sum(_group_bytes(g, channels, nvls_capable, settings) for g in groups)
        out.append(known[groups])
    return tuple(out)


def rank_target(
    target: DeviceProfile,
    parallel: ParallelConfig,
    rank: int,
    *,
    gpus_per_node: int = 8,
    settings: NcclSettings | None = None,
) -> DeviceProfile:
    """``target`` as ``rank`` of ``parallel`` sees it: its ``nccl_bytes`` set to the rank's
    communicators (:func:`nccl_bytes`), so that everything reading ``overhead_bytes`` (the
    device total, the budget check) counts them. Setting, not adding: a profile already set
    for a rank is set again."""
    nccl = nccl_bytes(parallel, rank, target, gpus_per_node=gpus_per_node, settings=settings)
    if nccl == target.nccl_bytes:
        return target
    return dataclasses.replace(target, nccl_bytes=nccl)
