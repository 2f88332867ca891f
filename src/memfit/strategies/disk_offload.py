"""Optimizer offload to disk: fp32 masters and optimizer state in files, stepped in a window.

:class:`DiskOffloadOptimizer` is :class:`~memfit.strategies.optimizer_offload.HostOffloadOptimizer`
(the same gradient buckets, host clipping and :class:`OffloadStepper`) with the masters and the
optimizer state of every parameter kept in files (two each), in a directory the user names
(``OffloadConfig.disk_dir``). Host memory holds at most ``host_window_bytes`` of them:

* parameters are cut into consecutive *groups* of at most half the window (master plus state
  bytes, known from shapes before the first step: the optimizer is stepped once on fake
  tensors);
* the step goes group by group through two window halves: while group ``k`` steps on the host
  (the plan's optimizer, one instance over all masters; a parameter without a gradient is
  skipped by every torch optimizer, so only the loaded group moves), one I/O thread writes group
  ``k - 1`` back and reads group ``k + 1`` ahead;
* the state tensors the optimizer sees are views into the window (``optimizer.state[m]`` is
  filled from the file before the group steps and dropped after), so any ``torch.optim``
  optimizer and memfit's (AdamW8bit, Adafactor) work unchanged; state the optimizer creates in
  its first step, or replaces, is written from wherever it lives.

File I/O rather than memory maps: a mapped file's touched pages count in the process's resident
memory until unmapped and are faulted in one page at a time, while positioned reads into two
fixed window halves keep the resident bytes at the window exactly, stream at memcpy speed, and
release the GIL (the read-ahead overlaps the step).

Crash safety is *write and swap* with two files per parameter: a write goes to the file that is
not current, data first and its header (parameter index, write counter, layout, plain-number
state) last, so the header commits it; the current file is untouched until the next write. A
crash mid write-back leaves the previous file whole, and every load checks the header's index,
counter and the file's size against what this optimizer last committed, so a stale or cut file
is noticed (``RuntimeError``) instead of read. (Overwriting the other file in place streams
about five times faster than writing a new file and renaming it, as no blocks are allocated;
the cost is twice the state on disk.) Nothing is fsynced: a process crash is covered, a power
loss may lose the last step's files.

Gradients stay in host memory (fp32, as with the host tier): the window bounds the masters and
state, the larger part (12 of 16 bytes per parameter with AdamW). Disk bytes are reported to
any active :class:`~memfit.accounting.MemoryTracker` (``account_disk``, category
``optimizer_state``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from ..accounting.tiers import host_tier, mark_host
from .offload import OffloadConfig
from .optimizer_offload import HostOffloadOptimizer

__all__ = [
    "DEFAULT_HOST_WINDOW",
    "DiskOffloadOptimizer",
    "check_disk_dir",
    "default_window",
    "footprint",
    "tier_bytes",
]

#: Largest host window when ``host_window_bytes`` is not set (see :func:`default_window`).
DEFAULT_HOST_WINDOW = 1 << 30


def footprint(master: torch.Tensor, state: list[torch.Tensor]) -> int:
    """Bytes of one parameter's region in its file (and in the window): its fp32 master and
    its state tensors, each aligned."""
    return _align(master.numel() * 4) + sum(_align(_nbytes(t)) for t in state)


def tier_bytes(footprints: list[int], host_window_bytes: int | None) -> dict[str, int]:
    """What the tier holds for parameters of these footprints (fp32 master plus state bytes
    each): ``window`` (the two host halves, each as large as the largest group), ``disk``
    (two files per parameter with their headers) and ``groups``. A dry run, which writes no
    files, reports these (:mod:`memfit.estimate.dryrun`)."""
    window = host_window_bytes or default_window(footprints)
    minimum = 2 * max(footprints, default=0)
    groups = _groups(footprints, max(window, minimum) // 2)
    largest = max((sum(footprints[i] for i in g) for g in groups), default=0)
    return {
        "window": 2 * largest,
        "disk": 2 * (sum(footprints) + _HEADER * len(footprints)),
        "groups": len(groups),
    }


def default_window(footprints: list[int]) -> int:
    """The host window when none is set: half the masters and state (so the two halves hold
    about half of what the host tier would), at most :data:`DEFAULT_HOST_WINDOW`, at least
    two of the largest parameter's footprint."""
    minimum = 2 * max(footprints, default=0)
    return max(minimum, min(DEFAULT_HOST_WINDOW, sum(footprints) // 2))

_MAGIC = b"MEMFITDISK1\n"
_HEADER = 4096  # bytes before the data: the JSON header, zero-padded
_ALIGN = 64  # every tensor starts on a 64-byte boundary (vector loads)
_MASTER = "__master__"

# (key, dtype name, shape, offset, nbytes) of one tensor in a parameter's region.
_Entry = tuple[str, str, tuple[int, ...], int, int]


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of ``t`` (made contiguous), for a file write; any dtype (bf16 included)."""
    flat = t.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def check_disk_dir(disk_dir: str | os.PathLike[str], need_bytes: int) -> None:
    """Refuse a disk directory that is missing, not writable, or short of ``need_bytes`` free.

    Raises:
        ValueError: one sentence naming the directory and what is wrong.
    """
    path = os.fspath(disk_dir)
    if not os.path.isdir(path):
        raise ValueError(f"offload disk_dir {path!r} does not exist or is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"offload disk_dir {path!r} is not writable")
    free = shutil.disk_usage(path).free
    if free < need_bytes:
        from ..units import format_bytes

        raise ValueError(
            f"offload disk_dir {path!r} has {format_bytes(free)} free but the optimizer's master "
            f"weights and state need {format_bytes(need_bytes)}; free space or choose another "
            "directory"
        )


class DiskOffloadOptimizer(HostOffloadOptimizer):
    """The plan's optimizer over fp32 masters kept, with its state, in files under ``disk_dir``.

    Args:
        params: The trainable parameters (on the compute device, any floating dtype).
        build: Builds the optimizer over a list of host master tensors.
        config: The offload settings (``disk_dir``, ``host_window_bytes``, ``bucket_bytes``,
            ``gradients_on_host``, ``pin_memory``).

    Attributes:
        optimizer: The host optimizer (over :attr:`masters`; its state is empty between steps).
        masters: One tensor per parameter whose data is a window view while its group is
            loaded, and a one-element placeholder otherwise.
        groups: Parameter indices stepped together (each within half the window).
        window_bytes: The host window (bytes of masters and state in host memory at most).
        directory: This optimizer's own directory inside ``disk_dir`` (removed by
            :meth:`remove`).

    Raises:
        ValueError: when ``disk_dir`` is missing, not writable or too small for the state, or
            the window is smaller than two of the largest parameter's master and state.
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        build: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
        config: OffloadConfig,
    ) -> None:
        from torch._guards import active_fake_mode

        if active_fake_mode() is not None:
            raise ValueError(
                "a dry run of optimizer offload to 'disk' is not available; dry-run with "
                "optimizer 'host' (the device side is the same)"
            )
        if not config.disk_dir:
            raise ValueError("offload to 'disk' needs disk_dir, the directory for its files")
        from .optimizer_offload import _buckets

        self.params = list(params)
        self.config = config
        # Placeholders of the right shape (one float each, stride 0): the optimizer is built and
        # gradients attached before any data is loaded; ``.data`` is swapped per group.
        self.masters = [_placeholder(p.shape) for p in self.params]
        self.optimizer = build(self.masters)
        listed = [m for g in self.optimizer.param_groups for m in g["params"]]
        order = {id(m): k for k, m in enumerate(listed)}
        # Index of each master in the optimizer's state_dict (its order over param groups).
        self._position = {i: order[id(m)] for i, m in enumerate(self.masters)}
        footprints = self._probe_footprints(build)
        # Two files per parameter (the current one and the one being written).
        need = 2 * (sum(footprints) + _HEADER * len(footprints))
        check_disk_dir(config.disk_dir, need)
        minimum = 2 * max(footprints, default=0)
        window = config.host_window_bytes
        if window is None:
            window = default_window(footprints)
        elif window < minimum:
            big = max(range(len(footprints)), key=footprints.__getitem__)
            raise ValueError(
                f"offload host_window_bytes ({window}) is smaller than the disk tier's minimum "
                f"of {minimum} bytes: two of its largest parameter's master and state (parameter "
                f"{big}, {tuple(self.params[big].shape)}, {footprints[big]} bytes); set it to at "
                f"least {minimum}"
            )
        self.window_bytes = window
        try:
            self.directory = tempfile.mkdtemp(prefix="memfit-optimizer-", dir=config.disk_dir)
        except OSError as e:
            raise ValueError(f"offload disk_dir {config.disk_dir!r} is not writable: {e}") from None
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.directory, True)
        self._region = [0] * len(self.params)  # data bytes of each parameter's current file
        self._file_bytes = [[0, 0] for _ in self.params]  # size of each parameter's two files
        self._version = [0] * len(self.params)
        self._laid_out = [False] * len(self.params)  # state made (its layout is known)
        self._footprint = footprints
        self._reported: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memfit-disk")
        self._halves: list[torch.Tensor] = []
        try:
            with torch.no_grad():
                for i, p in enumerate(self.params):
                    self._write(i, p.detach().to("cpu", torch.float32), {})
        except OSError as e:
            self._cleanup()
            raise ValueError(
                f"offload disk_dir {config.disk_dir!r} cannot hold the optimizer's files: {e}"
            ) from None
        self.groups = _groups(footprints, window // 2)
        self.buckets = _buckets(self.params, config.bucket_bytes)
        self._bucket_of = {i: b for b, members in enumerate(self.buckets) for i in members}
        self._pending = [len(m) for m in self.buckets]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._offloading = True
        self._hooks = [p.register_post_accumulate_grad_hook(self._ready) for p in self.params]
        self.transfers = 0
        # The host tier's stepping in backward is refused with this tier (apply_plan): its
        # attributes keep their idle values for the gradient methods shared with it.
        self.step_in_backward = False
        self.max_grad_norm: float | None = None
        self._last = False
        self._stepped: set[int] = set()
        self._sq_norm: torch.Tensor | None = None
        self._coef: torch.Tensor | None = None
        self.last_norm: torch.Tensor | None = None
        self._loaded: dict[int, tuple[torch.Tensor, dict[str, Any]]] = {}

    # ------------------------------------------------------------------ sizes
    def _probe_footprints(self, build: Callable[[list[torch.Tensor]], Any]) -> list[int]:
        """Master plus state bytes of every parameter, from one step of a fresh optimizer over
        fake tensors of the masters' shapes (no memory); 12 bytes per element (AdamW's) for an
        optimizer that cannot step fake tensors (the first real step then regroups)."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        try:
            with FakeTensorMode():
                fakes = [torch.zeros(p.shape, dtype=torch.float32) for p in self.params]
                for f in fakes:
                    f.grad = torch.zeros_like(f)
                probe = build(fakes)
                probe.step()
                out = []
                for f in fakes:
                    tensors = [v for v in probe.state.get(f, {}).values() if torch.is_tensor(v)]
                    out.append(footprint(f, tensors))
                return out
        except Exception:  # any failure of the probe falls back to an estimate
            return [_align(p.numel() * 4) + 2 * _align(p.numel() * 4) for p in self.params]

    def disk_bytes(self) -> int:
        """Bytes of this optimizer's files now (both files of each parameter, headers too)."""
        return sum(sum(sizes) for sizes in self._file_bytes)

    def _account(self, grads: list[torch.Tensor] | None = None) -> None:
        """Report the disk bytes to every tracker active now (the change since each saw), and
        label the host gradients as gradients (they are copies, made outside autograd)."""
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        from ..accounting.tracker import MemoryTracker

        total = self.disk_bytes()
        for mode in _get_current_dispatch_mode_stack():
            if isinstance(mode, MemoryTracker):
                seen = self._reported.get(mode, 0)
                if total != seen:
                    mode.account_disk(total - seen, "optimizer_state")
                    self._reported[mode] = total
                if grads:
                    mode.label(grads, "gradients")

    # ------------------------------------------------------------------ files
    def _path(self, i: int, version: int) -> str:
        """Write ``version`` of parameter ``i`` goes to file ``version % 2``: the current file
        is never the one being written."""
        return os.path.join(self.directory, f"param-{i:06d}.{version % 2}.bin")

    def _write(self, i: int, master: torch.Tensor, state: Mapping[str, Any]) -> None:
        """Write parameter ``i``'s master and optimizer state (tensors in the data region, plain
        numbers in the header) into its other file, data first and the header last: the header
        commits the write, so until it lands the file still names an older write and the current
        file stays current. Overwriting a file in place streams several times faster than a
        new file each step (no block allocation)."""
        tensors = {_MASTER: master, **{k: v for k, v in state.items() if torch.is_tensor(v)}}
        scalars = {k: v for k, v in state.items() if not torch.is_tensor(v)}
        entries: list[_Entry] = []
        offset = 0
        for key, t in tensors.items():
            n = _nbytes(t)
            entries.append((key, str(t.dtype), tuple(t.shape), offset, n))
            offset += _align(n)
        version = self._version[i] + 1
        meta = {"index": i, "version": version, "region": offset, "entries": entries}
        try:
            header = _MAGIC + json.dumps({**meta, "scalars": scalars}).encode()
        except TypeError:
            kinds = {k: type(v).__name__ for k, v in scalars.items()}
            raise ValueError(
                f"the disk tier keeps tensors and plain numbers of optimizer state; parameter "
                f"{i}'s state holds {kinds}"
            ) from None
        if len(header) > _HEADER:
            raise ValueError(f"optimizer state of parameter {i} has too many entries for a file")
        path = self._path(i, version)
        with open(path, "r+b" if os.path.exists(path) else "w+b", buffering=0) as f:
            if os.fstat(f.fileno()).st_size >= _HEADER:
                f.write(bytes(_HEADER))  # no longer any write's file until the header lands
            f.seek(_HEADER)
            contiguous = _window_run(tensors, entries)
            if contiguous is not None:
                _write_all(f, contiguous)
            else:
                for key, _, _, off, _ in entries:
                    f.seek(_HEADER + off)
                    _write_all(f, _raw(tensors[key]))
            if os.fstat(f.fileno()).st_size != _HEADER + offset:
                f.truncate(_HEADER + offset)
            f.seek(0)
            f.write(header + bytes(_HEADER - len(header)))  # the commit
        self._file_bytes[i][version % 2] = _HEADER + offset
        self._region[i] = offset
        self._version[i] = version

    def _read(self, i: int, into: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, Any]]:
        """Parameter ``i``'s master and optimizer state, the tensors read into ``into`` (a
        window view of ``_region[i]`` bytes) or new host memory; the header is checked against
        what this optimizer last wrote."""
        path = self._path(i, self._version[i])
        size = self._region[i]
        with open(path, "rb", buffering=0) as f:
            meta = _parse_header(f.read(_HEADER))
            actual = os.fstat(f.fileno()).st_size
            if (
                meta is None
                or meta.get("index") != i
                or meta.get("version") != self._version[i]
                or meta.get("region") != size
                or actual != _HEADER + size
            ):
                found = "no header" if meta is None else f"write {meta.get('version')}"
                raise RuntimeError(
                    f"optimizer state file {path!r} is damaged or stale ({found}, {actual} "
                    f"bytes; expected write {self._version[i]}, {_HEADER + size} bytes); the "
                    "disk tier cannot go on: restore the run from a checkpoint"
                )
            if into is None:
                with host_tier():
                    into = torch.empty(size, dtype=torch.uint8)
            _read_all(f, memoryview(into.numpy()))
        state: dict[str, Any] = dict(meta.get("scalars", {}))
        for key, dtype, shape, off, n in meta["entries"]:
            state[key] = into[off : off + n].view(_dtype(dtype)).view(shape)
        return state.pop(_MASTER), state

    # ------------------------------------------------------------------ optimizer face
    @property
    def state(self) -> dict[Any, Any]:
        """The host window and the state of the group loaded now (the tracker labels both as
        optimizer state); between steps only the window."""
        out: dict[Any, Any] = {}
        if self._halves:
            out[self] = {f"window_{k}": h for k, h in enumerate(self._halves)}
        for i, (master, state) in self._loaded.items():
            out[self.masters[i]] = {_MASTER: master, **state}
        return out

    def state_dict(self) -> dict[str, Any]:
        """The masters and the optimizer's state, read from the files into host memory (all of
        it at once: the same format as the host tier's, so either loads the other's)."""
        sd = self.optimizer.state_dict()
        masters = []
        for i in range(len(self.params)):
            master, state = self._read(i, None)
            masters.append(master)
            if state:
                sd["state"][self._position[i]] = state
        return {"optimizer": sd, "masters": masters}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (or the host tier's): the files are rewritten and the
        device parameters take the restored masters."""
        opt = state["optimizer"]
        self.optimizer.load_state_dict({"state": {}, "param_groups": opt["param_groups"]})
        saved = opt["state"]
        with torch.no_grad():
            for i, master in enumerate(state["masters"]):
                entry = {
                    k: v.detach().cpu() if torch.is_tensor(v) else v
                    for k, v in saved.get(self._position[i], {}).items()
                }
                master = master.detach().to("cpu", torch.float32)
                self._write(i, master, entry)
                self._laid_out[i] = bool(entry)
                p = self.params[i]
                p.copy_(master.to(p.device, p.dtype))
        self._regroup()

    # ------------------------------------------------------------------ the step
    def step(self, max_grad_norm: float | None = None) -> None:
        """Clip on the host, then step group by group: read ahead, step, copy to the device,
        write back."""
        from ..device import synchronize

        if self.params:
            synchronize(self.params[0].device)
        grads = [m.grad for m in self.masters]
        self._account([g for g in grads if g is not None])
        with _OuterStepHooks(self), host_tier():
            if max_grad_norm is not None and any(g is not None for g in grads):
                torch.nn.utils.clip_grad_norm_(
                    [m for m in self.masters if m.grad is not None], max_grad_norm
                )
            for m in self.masters:
                m.grad = None
            work = [[i for i in g if grads[i] is not None] for g in self.groups]
            work = [g for g in work if g]
            try:
                self._step_groups(work, grads)
            finally:
                for m in self.masters:
                    m.data = _placeholder(m.shape)
                self._loaded = {}
        if any(self._footprint[i] != self._region[i] for i in range(len(self.params))):
            self._regroup()
        self._account()

    def _step_groups(self, work: list[list[int]], grads: list[torch.Tensor | None]) -> None:
        from ..device import synchronize

        halves = self._window_halves(work)
        writes: list[Future[None]] = []
        reads: list[Future[dict[int, tuple[torch.Tensor, dict[str, Any]]]] | None] = []
        if work:
            reads.append(self._io.submit(self._load_group, work[0], halves, 0))
        for k, members in enumerate(work):
            if k + 1 < len(work):
                # The other half was written back (the executor runs in order) before this read.
                reads.append(self._io.submit(self._load_group, work[k + 1], halves, (k + 1) % 2))
            future = reads[k]
            assert future is not None
            self._loaded = future.result()
            reads[k] = future = None  # the future lets go of the group
            with torch.no_grad():
                for i in members:
                    m = self.masters[i]
                    m.data, state = self._loaded[i]
                    m.grad = grads[i]
                    if state:
                        self.optimizer.state[m] = state
                self.optimizer.step()
                for i in members:
                    p, m = self.params[i], self.masters[i]
                    p.copy_(m.to(p.device, p.dtype, non_blocking=True))
                synchronize(self.params[members[0]].device)  # the half is reused below
                saved = {}
                for i in members:
                    m = self.masters[i]
                    saved[i] = (m.data, self.optimizer.state.pop(m, {}))
                    # Let go of the group here: before the first step's layouts are known its
                    # tensors are new memory, freed once written.
                    m.data = _placeholder(m.shape)
                    m.grad = grads[i] = None
                    self._laid_out[i] = True
            writes.append(self._io.submit(self._save_group, saved))
            # Only the I/O thread holds the group now: it goes once written.
            del saved, state
            self._loaded = {}
        try:
            for w in writes:
                w.result()  # a failed write-back raises here, its previous file whole
        finally:
            # The I/O thread keeps its last job's arguments (the last group) alive until its
            # next job: give it an empty one, so that the group goes now.
            self._io.submit(int).result()

    def _window_halves(self, work: list[list[int]]) -> list[torch.Tensor | None]:
        """The two window halves, allocated once the layouts are known (after the first step;
        until then a group's tensors are new host memory, at most its footprint)."""
        if not all(self._laid_out[i] for g in work for i in g):
            return [None, None]
        need = max((sum(_align(self._region[i]) for i in g) for g in work), default=0)
        if not self._halves or self._halves[0].numel() < need:
            from ..device import host_buffer

            self._halves = []  # the old halves go before the new ones come
            with host_tier():
                size = max(need, max(sum(self._footprint[i] for i in g) for g in self.groups))
                self._halves = [
                    host_buffer(size, torch.uint8, pin=self.config.pin_memory) for _ in range(2)
                ]
            mark_host(self._halves)
        return list(self._halves)

    def _load_group(
        self, members: list[int], halves: list[torch.Tensor | None], half: int
    ) -> dict[int, tuple[torch.Tensor, dict[str, Any]]]:
        buf = halves[half]
        out = {}
        offset = 0
        for i in members:
            size = self._region[i]
            view = None if buf is None else buf[offset : offset + size]
            out[i] = self._read(i, view)
            offset += _align(size)
        return out

    def _save_group(self, saved: dict[int, tuple[torch.Tensor, dict[str, Any]]]) -> None:
        for i, (master, state) in saved.items():
            self._write(i, master, state)

    def _regroup(self) -> None:
        """Group again by the files' real sizes (once the optimizer made its state)."""
        self._footprint = list(self._region)
        biggest = max(self._footprint, default=0)
        if 2 * biggest > self.window_bytes:
            raise ValueError(
                f"offload host_window_bytes ({self.window_bytes}) is smaller than the disk "
                f"tier's minimum of {2 * biggest} bytes (two of the largest parameter's master "
                "and state, as the optimizer made them)"
            )
        self.groups = _groups(self._footprint, self.window_bytes // 2)

    def remove(self) -> None:
        """Take the gradient hooks off, stop the I/O thread and delete the files (idempotent)."""
        super().remove()
        self._io.shutdown(wait=True)
        self._halves = []
        self._cleanup()


# ---------------------------------------------------------------------- helpers
def _placeholder(shape: torch.Size) -> torch.Tensor:
    """A leaf fp32 tensor of ``shape`` over one float (stride 0): the shape of a master whose
    data is on disk."""
    return torch.empty(0).set_(torch.zeros(1).untyped_storage(), 0, shape, (0,) * len(shape))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _groups(footprints: list[int], limit: int) -> list[list[int]]:
    """Consecutive parameter indices whose footprints (aligned) fill at most ``limit`` each."""
    groups: list[list[int]] = []
    size = 0
    for i, n in enumerate(footprints):
        n = _align(n)
        if groups and size + n <= limit:
            groups[-1].append(i)
            size += n
        else:
            groups.append([i])
            size = n
    return groups


def _window_run(tensors: Mapping[str, torch.Tensor], entries: list[_Entry]) -> memoryview | None:
    """The bytes to write in one call when every tensor lies in one buffer at its layout offset
    (a group loaded into the window and stepped in place), else ``None``."""
    base = tensors[_MASTER]
    if base.dtype != torch.float32 or not base.is_contiguous():
        return None
    start = base.data_ptr()
    storage = base.untyped_storage()
    for key, _, _, off, _ in entries:
        t = tensors[key]
        if (
            t.untyped_storage().data_ptr() != storage.data_ptr()
            or t.data_ptr() != start + off
            or not t.is_contiguous()
        ):
            return None
    end = _align(entries[-1][3] + entries[-1][4])
    first = start - storage.data_ptr()
    if first + end > storage.nbytes():
        return None
    raw = torch.empty(0, dtype=torch.uint8).set_(storage, first, (end,), (1,))
    return memoryview(raw.numpy())


def _write_all(f: Any, data: memoryview) -> None:
    data = data.cast("B")
    while data:
        n = f.write(data)
        data = data[n:]


def _read_all(f: Any, into: memoryview) -> None:
    into = into.cast("B")
    while into:
        n = f.readinto(into)
        if not n:
            raise RuntimeError(f"optimizer state file {f.name!r} ended early")
        into = into[n:]


def _parse_header(head: bytes) -> dict[str, Any] | None:
    if not head.startswith(_MAGIC) or len(head) != _HEADER:
        return None
    body = head[len(_MAGIC) :].rstrip(b"\0")
    try:
        meta = json.loads(body)
    except ValueError:
        return None
    return meta if isinstance(meta, dict) else None


class _OuterStepHooks:
    """Fire torch's global optimizer step hooks once around the whole disk step, so that a
    tracker sees one optimizer step (the inner per-group steps nest inside it)."""

    def __init__(self, opt: Any) -> None:
        from torch.optim import optimizer as torch_optimizer

        self.opt = opt
        self.pre = getattr(torch_optimizer, "_global_optimizer_pre_hooks", {})
        self.post = getattr(torch_optimizer, "_global_optimizer_post_hooks", {})

    def __enter__(self) -> None:
        for hook in list(self.pre.values()):
            hook(self.opt, (), {})

    def __exit__(self, *exc: Any) -> None:
        for hook in list(self.post.values()):
            hook(self.opt, (), {})
