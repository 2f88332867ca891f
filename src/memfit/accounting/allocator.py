"""A model of PyTorch's CUDA caching allocator: from allocated bytes to reserved bytes.

A GPU run's tensors take what the tracker counts, but the device holds what PyTorch's caching
allocator has *reserved* from the driver: requests are rounded up, served from segments of
fixed sizes, split and cached when freed instead of returned. Replaying a run's allocation
trace (sizes, births and deaths, in order) through this model gives the reserved peak that
PyTorch's ``max_memory_reserved`` would report, and the allocated peak that
``max_memory_allocated`` would (rounded block sizes, not tensor bytes).

The rules follow ``c10/cuda/CUDACachingAllocator.cpp`` (PyTorch 2.x) and the CUDA semantics
notes on memory management:

* ``round_size``: requests are rounded up to a multiple of ``kMinBlockSize`` = 512 bytes
  (the optional ``roundup_power2_divisions`` setting is not modelled).
* Pools: requests of at most ``kSmallSize`` = 1 MiB come from the small pool, others from the
  large pool; a block never moves between pools.
* ``get_allocation_size``: a new small-pool segment is ``kSmallBuffer`` = 2 MiB; a large
  request below ``kMinLargeAlloc`` = 10 MiB gets a ``kLargeBuffer`` = 20 MiB segment; larger
  requests get a segment rounded up to ``kRoundLarge`` = 2 MiB.
* ``get_free_block``: best fit, the smallest cached block of the pool that is large enough
  (ties by segment and address: the allocator's block set orders by stream, size, address).
  With ``max_split_size`` set, a request below it is not served from an oversize block
  (one of at least ``max_split_size``), and an oversize request only from a block less than
  ``kLargeBuffer`` larger.
* ``should_split``: the remainder of a block is split off as a new cached block when it is at
  least 512 bytes in the small pool (or with expandable segments), and more than 1 MiB in the
  large pool (and the request is below ``max_split_size``); otherwise the whole block is
  handed out and counts as allocated.
* ``free_block`` / ``try_merge_blocks``: a freed block merges with free neighbours of its
  segment.
* When a new segment would not fit the device (``capacity_bytes``), the allocator frees its
  cached, entirely free segments (``release_cached_blocks``) and tries again, and reports an
  out-of-memory error if that is still not enough.
* ``expandable_segments:True``: each pool has one segment of virtual address space, mapped
  in pages as it grows (``ExpandableSegment``; pages of ``kSmallBuffer`` for the small pool
  and ``kLargeBuffer`` for the large one), so a request can extend the free block at the end
  instead of needing a new segment; blocks split whenever 512 bytes or more remain.

Not modelled: several streams (each has its own blocks), the garbage-collection threshold,
``empty_cache`` calls, and CUDA graphs' private pools.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "AllocatorConfig",
    "AllocatorReplay",
    "CachingAllocatorModel",
    "replay",
    "replay_records",
    "round_size",
    "segment_size",
]

KB = 1024
MB = 1024 * 1024
MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 * MB  # kSmallSize: largest request of the small pool
SMALL_BUFFER = 2 * MB  # kSmallBuffer: small-pool segments
LARGE_BUFFER = 20 * MB  # kLargeBuffer: segments for large requests below kMinLargeAlloc
MIN_LARGE_ALLOC = 10 * MB  # kMinLargeAlloc
ROUND_LARGE = 2 * MB  # kRoundLarge: larger segments are rounded to this


@dataclass(frozen=True)
class AllocatorConfig:
    """Settings of the modelled allocator (``PYTORCH_CUDA_ALLOC_CONF``).

    Attributes:
        expandable_segments: Map memory in growing segments (``expandable_segments:True``):
            far less fragmentation (reserved stays close to allocated), at the cost of
            mapping calls when a segment grows.
        max_split_size: Blocks of at least this size are never split (``max_split_size_mb``);
            ``None`` is PyTorch's default (unlimited). Lowers fragmentation of large blocks at
            the cost of more segments.
        capacity_bytes: Device memory the allocator may reserve (the card minus the CUDA
            context); ``None`` is unlimited. Beyond it, cached segments are released and, if
            that is not enough, the allocation fails.
    """

    expandable_segments: bool = False
    max_split_size: int | None = None
    capacity_bytes: int | None = None


def round_size(size: int) -> int:
    """The block size a request of ``size`` bytes takes (``round_size``)."""
    if size < MIN_BLOCK:
        return MIN_BLOCK
    return MIN_BLOCK * ((size + MIN_BLOCK - 1) // MIN_BLOCK)


def segment_size(size: int) -> int:
    """The segment a (rounded) request needs when no cached block fits
    (``get_allocation_size``)."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((size + ROUND_LARGE - 1) // ROUND_LARGE)


class _Block:
    __slots__ = ("addr", "allocated", "next", "prev", "segment", "size")

    def __init__(self, segment: _Segment, addr: int, size: int) -> None:
        self.segment = segment
        self.addr = addr
        self.size = size
        self.allocated = False
        self.prev: _Block | None = None
        self.next: _Block | None = None


class _Segment:
    __slots__ = ("expandable", "id", "mapped", "small")

    def __init__(self, seg_id: int, small: bool, mapped: int, expandable: bool) -> None:
        self.id = seg_id
        self.small = small
        self.mapped = mapped  # bytes backed by device memory
        self.expandable = expandable


class _Pool:
    """The cached (free) blocks of one pool, kept sorted for best-fit search."""

    def __init__(self, small: bool) -> None:
        self.small = small
        self.free: list[tuple[int, int, int]] = []  # (size, segment id, address)
        self.blocks: dict[tuple[int, int], _Block] = {}
        self.expandable: _Segment | None = None
        self.tail: _Block | None = None  # last block of the expandable segment

    def add(self, block: _Block) -> None:
        key = (block.size, block.segment.id, block.addr)
        bisect.insort(self.free, key)
        self.blocks[(block.segment.id, block.addr)] = block

    def remove(self, block: _Block) -> None:
        key = (block.size, block.segment.id, block.addr)
        i = bisect.bisect_left(self.free, key)
        del self.free[i]
        del self.blocks[(block.segment.id, block.addr)]


class CachingAllocatorModel:
    """Replay allocations and frees through a model of PyTorch's CUDA caching allocator.

    Example::

        model = CachingAllocatorModel()
        model.malloc(1, 3 * 2**20)   # a new 20 MiB segment; 3 MiB allocated
        model.free(1)                # cached, still reserved
        model.peak_reserved_bytes    # 20 MiB

    Args:
        config: The allocator settings.
    """

    def __init__(self, config: AllocatorConfig | None = None) -> None:
        self.config = config or AllocatorConfig()
        self._pools = {True: _Pool(True), False: _Pool(False)}
        self._live: dict[int, tuple[_Block, int]] = {}  # key -> (block, requested bytes)
        self._segments: dict[int, _Segment] = {}
        self._next_segment = 0
        self.allocated_bytes = 0
        self.requested_bytes = 0
        self.reserved_bytes = 0
        self.peak_allocated_bytes = 0
        self.peak_requested_bytes = 0
        self.peak_reserved_bytes = 0
        #: Called as ``listener(action, segment, offset, size)`` for each event PyTorch's
        #: memory history records (``alloc``, ``free_completed``, ``segment_alloc``,
        #: ``segment_free``, ``segment_map``, ``segment_unmap``), when set:
        #: :mod:`memfit.accounting.snapshot` builds the viewer's timeline from it.
        self.listener: Callable[[str, _Segment, int, int], None] | None = None

    @property
    def num_segments(self) -> int:
        """Segments currently reserved from the driver."""
        return len(self._segments)

    def segments(self) -> list[tuple[int, bool, bool, int, list[tuple[int, int, int, int]]]]:
        """The reserved segments now: ``(id, small, expandable, mapped bytes, blocks)``, each
        block ``(offset, size, requested bytes, key)`` (``0, -1`` for a cached block), in
        address order."""
        blocks: dict[int, list[tuple[int, int, int, int]]] = {s: [] for s in self._segments}
        for key, (block, size) in self._live.items():
            if block is not None:
                blocks[block.segment.id].append((block.addr, block.size, size, key))
        for pool in self._pools.values():
            for block in pool.blocks.values():
                blocks[block.segment.id].append((block.addr, block.size, 0, -1))
        return [
            (seg.id, seg.small, seg.expandable, seg.mapped, sorted(blocks[seg.id]))
            for seg in self._segments.values()
        ]

    # ------------------------------------------------------------------ public
    def malloc(self, key: int, size: int) -> None:
        """Allocate ``size`` bytes under ``key`` (zero bytes allocate nothing, as in PyTorch).

        Raises:
            ValueError: when ``key`` is already allocated or ``size`` is negative.
            torch.OutOfMemoryError: when the request cannot be served within
                ``capacity_bytes`` even after releasing cached segments.
        """
        if key in self._live:
            raise ValueError(f"allocation key {key} is already live")
        if size < 0:
            raise ValueError(f"allocation size must be >= 0, got {size}")
        if size == 0:
            self._live[key] = (None, 0)  # type: ignore[assignment]
            return
        rounded = round_size(size)
        pool = self._pools[rounded <= SMALL_SIZE]
        block = self._best_fit(pool, rounded)
        if block is None:
            block = self._grow(pool, rounded)
        else:
            pool.remove(block)
        block = self._split(pool, block, rounded)
        block.allocated = True
        self._live[key] = (block, size)
        if self.listener is not None:
            self.listener("alloc", block.segment, block.addr, block.size)
        self.allocated_bytes += block.size
        self.requested_bytes += size
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)
        self.peak_requested_bytes = max(self.peak_requested_bytes, self.requested_bytes)

    def free(self, key: int) -> None:
        """Free the allocation ``key``: its block is cached (merged with free neighbours).

        Raises:
            KeyError: when ``key`` is not allocated.
        """
        block, size = self._live.pop(key)
        if block is None:
            return
        self.allocated_bytes -= block.size
        self.requested_bytes -= size
        block.allocated = False
        if self.listener is not None:
            self.listener("free_completed", block.segment, block.addr, block.size)
        pool = self._pools[block.segment.small]
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                pool.remove(neighbour)
                block = _merge(block, neighbour, pool)
        pool.add(block)

    # ------------------------------------------------------------------ rules
    def _best_fit(self, pool: _Pool, size: int) -> _Block | None:
        i = bisect.bisect_left(pool.free, (size, -1, -1))
        if i == len(pool.free):
            return None
        found = pool.blocks[(pool.free[i][1], pool.free[i][2])]
        limit = self.config.max_split_size
        if limit is not None and not found.segment.expandable:
            # get_free_block: no oversize block for a small request; an oversize request
            # only from a block less than kLargeBuffer larger than itself.
            if size < limit <= found.size:
                return None
            if size >= limit and found.size >= size + LARGE_BUFFER:
                return None
        return found

    def _split(self, pool: _Pool, block: _Block, size: int) -> _Block:
        remaining = block.size - size
        if pool.small or block.segment.expandable:
            split = remaining >= MIN_BLOCK
        else:
            limit = self.config.max_split_size
            split = (limit is None or size < limit) and remaining > SMALL_SIZE
        if not split:
            return block
        rest = _Block(block.segment, block.addr + size, remaining)
        rest.prev, rest.next = block, block.next
        if block.next is not None:
            block.next.prev = rest
        block.next = rest
        block.size = size
        if pool.tail is block:
            pool.tail = rest
        pool.add(rest)
        return block

    def _grow(self, pool: _Pool, size: int) -> _Block:
        """Reserve memory for ``size`` bytes: a new segment, or more of the expandable one."""
        if self.config.expandable_segments:
            return self._expand(pool, size)
        seg_bytes = segment_size(size)
        self._make_room(seg_bytes, size)
        segment = _Segment(self._next_segment, pool.small, seg_bytes, expandable=False)
        self._next_segment += 1
        self._segments[segment.id] = segment
        self._reserve(seg_bytes)
        if self.listener is not None:
            self.listener("segment_alloc", segment, 0, seg_bytes)
        return _Block(segment, 0, seg_bytes)

    def _expand(self, pool: _Pool, size: int) -> _Block:
        page = SMALL_BUFFER if pool.small else LARGE_BUFFER
        segment = pool.expandable
        if segment is None:
            segment = _Segment(self._next_segment, pool.small, 0, expandable=True)
            self._next_segment += 1
            self._segments[segment.id] = segment
            pool.expandable = segment
        tail = pool.tail
        free_tail = tail if tail is not None and not tail.allocated else None
        have = free_tail.size if free_tail is not None else 0
        grow = page * ((size - have + page - 1) // page)
        self._make_room(grow, size)
        segment.mapped += grow
        self._reserve(grow)
        if self.listener is not None:
            self.listener("segment_map", segment, segment.mapped - grow, grow)
        if free_tail is not None:
            pool.remove(free_tail)
            free_tail.size += grow
            return free_tail
        block = _Block(segment, segment.mapped - grow, grow)
        block.prev = tail
        if tail is not None:
            tail.next = block
        pool.tail = block
        return block

    def _reserve(self, nbytes: int) -> None:
        self.reserved_bytes += nbytes
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)

    def _make_room(self, nbytes: int, request: int) -> None:
        capacity = self.config.capacity_bytes
        if capacity is None or self.reserved_bytes + nbytes <= capacity:
            return
        self._release_cached()
        if self.reserved_bytes + nbytes > capacity:
            raise torch.OutOfMemoryError(
                f"modelled CUDA allocator: allocating {request} bytes needs {nbytes} more "
                f"reserved bytes; {self.reserved_bytes} are reserved ({self.allocated_bytes} "
                f"allocated) of a capacity of {capacity}"
            )

    def _release_cached(self) -> None:
        """``release_cached_blocks``: return every entirely free segment to the driver (and,
        with expandable segments, the free pages at the end of each segment)."""
        for pool in self._pools.values():
            for size, seg_id, addr in list(pool.free):
                block = pool.blocks[(seg_id, addr)]
                segment = block.segment
                if segment.expandable:
                    if block is pool.tail:
                        # Unmap the whole pages of the free block at the end of the segment.
                        page = SMALL_BUFFER if pool.small else LARGE_BUFFER
                        first = page * ((block.addr + page - 1) // page)
                        freed = segment.mapped - first
                        if freed > 0:
                            pool.remove(block)
                            block.size -= freed
                            segment.mapped -= freed
                            self.reserved_bytes -= freed
                            if self.listener is not None:
                                self.listener("segment_unmap", segment, first, freed)
                            if block.size:
                                pool.add(block)
                            else:
                                pool.tail = block.prev
                                if block.prev is not None:
                                    block.prev.next = None
                    continue
                if block.prev is None and block.next is None:  # the whole segment is free
                    pool.remove(block)
                    del self._segments[seg_id]
                    self.reserved_bytes -= size
                    if self.listener is not None:
                        self.listener("segment_free", segment, 0, size)


def _merge(block: _Block, other: _Block, pool: _Pool) -> _Block:
    """Merge two adjacent blocks of one segment into the lower one."""
    low, high = (block, other) if block.addr < other.addr else (other, block)
    low.size += high.size
    low.next = high.next
    if high.next is not None:
        high.next.prev = low
    if pool.tail is high:
        pool.tail = low
    return low


@dataclass(frozen=True)
class AllocatorReplay:
    """What a replayed trace came to in the modelled allocator.

    Attributes:
        peak_allocated_bytes: Peak of allocated block sizes (rounded, split or not): what
            PyTorch's ``max_memory_allocated`` reports.
        peak_reserved_bytes: Peak of reserved segment bytes: ``max_memory_reserved``.
        peak_requested_bytes: Peak of the requested (tensor) bytes, for comparison.
        num_segments: Segments reserved at the end.
        expandable_segments: Whether expandable segments were modelled.
    """

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    peak_requested_bytes: int
    num_segments: int
    expandable_segments: bool


def replay(
    events: Iterable[tuple[int, int | None]], config: AllocatorConfig | None = None
) -> AllocatorReplay:
    """Replay ``events`` in order: ``(key, size)`` allocates ``size`` bytes under ``key``;
    ``(key, None)`` frees it.

    Raises:
        torch.OutOfMemoryError: when ``config.capacity_bytes`` is exceeded.
    """
    model = CachingAllocatorModel(config)
    for key, size in events:
        if size is None:
            model.free(key)
        else:
            model.malloc(key, size)
    return _result(model)


def replay_records(
    nbytes: Sequence[int],
    birth: Sequence[int],
    death: Sequence[int],
    tier: Sequence[int] | None = None,
    config: AllocatorConfig | None = None,
) -> AllocatorReplay:
    """Replay a tracker's storage records.

    Record ``i`` of ``nbytes[i]`` bytes is born at event stamp ``birth[i]`` and dies at
    ``death[i]`` (``-1``: still alive at the end). Births and deaths share one increasing
    counter, so sorting by stamp gives the allocator's order. Only device-tier records
    (``tier[i] == 0``) are replayed.
    """
    stamps: list[tuple[int, int, int | None]] = []
    for i, size in enumerate(nbytes):
        if tier is not None and tier[i] != 0:
            continue
        stamps.append((birth[i], i, int(size)))
        if death[i] >= 0:
            stamps.append((death[i], i, None))
    stamps.sort(key=lambda s: s[0])
    return replay(((i, size) for _, i, size in stamps), config)


def _result(model: CachingAllocatorModel) -> AllocatorReplay:
    return AllocatorReplay(
        peak_allocated_bytes=model.peak_allocated_bytes,
        peak_reserved_bytes=model.peak_reserved_bytes,
        peak_requested_bytes=model.peak_requested_bytes,
        num_segments=model.num_segments,
        expandable_segments=model.config.expandable_segments,
    )
