"""Replaying a recorded stretch of allocations instead of dispatching it again (dry runs only).

A dry run pays for every operation it dispatches (fake tensors cost tens of microseconds an
op), and an optimizer step repeats one update per parameter: a model of 24 identical blocks
runs the same update, on tensors of the same shapes, 24 times. On fake tensors those updates
compute nothing, and the memory each one moves depends on shapes alone. So the first update of
each kind is recorded (:func:`begin`, :meth:`Recording.finish`) and the later ones are replayed
into the tracker (:meth:`Recording.replay`): the same births and deaths of the same sizes,
categories and tiers, in the same order, at the same ops, from whatever is live at that moment.
The tracker's records, timeline, peaks and the allocator model built from them are therefore
what dispatching the update would have made; only the dispatch is saved.

What torch lacks here: :class:`~torch._subclasses.fake_tensor.FakeTensorMode` caches each
op's output metadata, but still runs every op through Python; nothing in torch skips a repeated
sequence of ops.

A stretch is replayable only when it is self-contained: everything it allocates dies within
it, it frees nothing older and changes no older storage's category, and it opens no module,
writes no disk bytes and hides no saved tensors older than itself. Anything else (state created lazily, a tensor stored for later) is dispatched for
real every time. The caller vouches that two updates with the same key allocate the same:
the key names every shape, dtype and setting the update's allocations depend on.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

__all__ = ["Recording", "Stretch", "begin"]

_BIRTH, _DEATH, _OP_END = 0, 1, 2


@dataclass(frozen=True)
class Stretch:
    """A recorded, self-contained stretch of a tracker's events.

    Attributes:
        events: In order: ``(0, i)`` the birth of ``births[i]``, ``(1, i)`` its death,
            ``(2, phase)`` the end of an op in ``phase``.
        births: Each storage born: bytes, category rank, tier, the op that made it.
    """

    events: tuple[tuple[int, int], ...]
    births: tuple[tuple[int, int, int, Any], ...]


class Recording:
    """One update, either replayed from an earlier one with its key or recorded for later."""

    def __init__(self, tracker: Any, key: Hashable) -> None:
        self._tracker = tracker
        self._key = key
        self._mark: tuple[int, ...] | None = None

    def replay(self) -> bool:
        """Replay the stretch recorded under this key, if there is one; else start recording.

        Returns:
            Whether the update was replayed (the caller then skips dispatching it).
        """
        tr = self._tracker
        stretch = tr.replays.get(self._key)
        if stretch is None:
            self._mark = (
                len(tr._nbytes),
                tr._seq,
                len(tr.timeline_seq),
                len(tr._events.intervals),
                len(tr._hidden),
                tr._changes,
            )
            tr._birth_funcs = []
            return False
        _replay(tr, stretch)
        return True

    def abandon(self) -> None:
        """Drop the recording started by :meth:`replay` (the update raised)."""
        self._mark = None
        self._tracker._birth_funcs = None

    def finish(self) -> None:
        """End the recording started by :meth:`replay`; keep it if it is self-contained."""
        tr = self._tracker
        if self._mark is None:
            return
        funcs, tr._birth_funcs = tr._birth_funcs, None
        stretch = _stretch(tr, self._mark, funcs)
        self._mark = None
        if stretch is not None:
            tr.replays[self._key] = stretch


def begin(key: Hashable) -> Recording | None:
    """A :class:`Recording` for an update keyed ``key``, or ``None`` when no replay applies.

    Replay applies while exactly one memfit tracker is open; the caller checks that its tensors
    are fake (real tensors must be updated). The key is scoped to the tracker's current training
    step, so a step's first update of each kind is always dispatched.
    """
    from .tracker import _OPEN

    if len(_OPEN) != 1:
        return None
    tracker = _OPEN[0]
    return Recording(tracker, (len(tracker.step_boundaries), key))


def _stretch(tr: Any, mark: tuple[int, ...], funcs: list[Any]) -> Stretch | None:
    first, seq0, ops0, intervals, hidden, changes = mark
    n = len(tr._nbytes) - first
    if (
        len(tr._events.intervals) != intervals
        # Storages it made while another saved-tensor hook ruled (inside a checkpointed
        # forward) are fine: they die within it, so none is ever found alive and promoted to
        # an activation when backward starts (a replay need not list them).
        or any(idx < first for idx in tr._hidden[hidden:])
        or tr._changes != changes  # it promoted a storage it did not make, or wrote to disk
        or tr._seq - seq0 != 2 * n  # every event in it is a birth or a death of its own
        or len(funcs) != n
    ):
        return None
    deaths = tr._death[first:]
    if any(d < 0 for d in deaths):
        return None  # something it made outlives it
    events: list[tuple[int, int, int]] = []  # (seq, order, ...) sorted below
    births = []
    for i in range(n):
        idx = first + i
        births.append((tr._nbytes[idx], tr._cat[idx], tr._tier[idx], funcs[i]))
        events.append((tr._birth[idx], _BIRTH, i))
        events.append((deaths[i], _DEATH, i))
    # An op ends after the events stamped up to its end (an op's outputs are born inside it).
    for j in range(ops0, len(tr.timeline_seq)):
        events.append((tr.timeline_seq[j], _OP_END, tr.timeline_phase[j]))
    events.sort(key=lambda e: (e[0], e[1] == _OP_END))
    return Stretch(events=tuple((kind, a) for _, kind, a in events), births=tuple(births))


def _replay(tr: Any, stretch: Stretch) -> None:
    ids: list[int] = []
    for kind, a in stretch.events:
        if kind == _BIRTH:
            nbytes, cat, tier, func = stretch.births[a]
            tr._func = func
            ids.append(tr._record(None, 0, nbytes, cat, tier))
        elif kind == _DEATH:
            tr._end(ids[a])
        else:
            tr._op += 1
            tr.timeline_seq.append(tr._seq)
            tr.timeline_phase.append(a)
