"""A deep model's allocation trace, built from the traces of two shallow ones.

A model whose blocks are all alike dispatches the same operations for each of them: every
stretch of a training step that walks the blocks (their forward, their backward, the
optimizer's per-parameter updates, ``zero_grad``'s frees) is one stretch of events repeated
once per block. The trace of depth ``d`` is then a fixed word with each such stretch repeated
about ``d`` times, and the traces of two consecutive depths (2 and 3) pin it down: the deeper
trace is the shallower one with one more copy of each stretch inserted. :func:`extend_trace`
finds those insertions and writes the trace at any depth with as many copies as that depth
has blocks.

What is compared is each event as a report reads it: allocation or free, bytes, tier and
category, with the end of every operation and its phase, and the end of every training step.
From that stream alone the report's live bytes after every event follow (per category and
tier), so a report built from the extended trace has the same peaks, phases and breakdowns as
a dry run at that depth. Two things it cannot give, and leaves out: which earlier allocation a
free releases (a caching allocator's layout depends on it, so a CUDA target's reserved bytes
still need a full-depth dry run) and per-module intervals (module names hold block indices).

Nothing is assumed about where the stretches are: an insertion is accepted only where the
shallower trace holds the inserted stretch just before it, and the rest of the two traces
matches event for event. Anything else (blocks that differ, stretches whose length grows with
depth, such as buffers sized by the whole model) makes :func:`extend_trace` return ``None``,
and the caller dry-runs the full depth instead.

Frees at one instant (between two operations) come in an order that differs from run to run
(the depth-2 and depth-3 runs release a batch of temporaries in different orders), so they
are put in a fixed order in the streams. No value a report reads depends on that order but
one, refused where it would: a phase whose highest point is the first of unlike frees.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .trace import AllocationTrace

__all__ = ["extend_trace"]

#: Most choices the alignment of two traces tries before it gives up (see :func:`_insertions`).
MAX_TRIES = 2000

_BIRTH, _DEATH, _OP, _STEP = range(4)


def extend_trace(at: Mapping[int, AllocationTrace], depth: int) -> AllocationTrace | None:
    """The allocation trace of ``depth`` blocks, from the traces of two consecutive depths.

    Args:
        at: The traces of one training run at depths ``d`` and ``d + 1`` (``d >= 2``: with
            one block, the first and the last block are the same).
        depth: The depth wanted (``>= d``).

    Returns:
        The trace at ``depth``, with no module intervals and no operation names; ``None`` when
        the two traces are not one word with stretches repeated once per block, or when they
        hold what the event stream does not carry (bytes on disk).
    """
    depths = sorted(at)
    if len(depths) != 2 or depths[1] != depths[0] + 1 or depths[0] < 2:
        raise ValueError(f"extend_trace needs two consecutive depths >= 2, got {depths}")
    if depth < depths[0]:
        raise ValueError(f"depth must be >= {depths[0]}, got {depth}")
    at_two, at_three = at[depths[0]], at[depths[1]]
    if at_two.disk_peak_bytes or at_three.disk_peak_bytes:
        return None
    table: dict[tuple[int, ...], int] = {}
    two, three = _stream(at_two, table), _stream(at_three, table)
    if two is None or three is None:
        return None
    inserts = _insertions(two, three)
    if inserts is None:
        return None
    out: list[int] = []
    start = 0
    for at, chunk in inserts:
        out.extend(two[start:at])
        out.extend(chunk * (depth - depths[0]))
        start = at
    out.extend(two[start:])
    tokens = {v: k for k, v in table.items()}
    trace = _trace([tokens[t] for t in out], at_two.device)
    return trace if trace is not None and _phase_peaks_at_allocations(trace) else None


def _stream(trace: AllocationTrace, table: dict[tuple[int, ...], int]) -> list[int] | None:
    """``trace`` as one stream of interned tokens: each event (allocation or free, with bytes,
    tier and category), each operation's end (with its phase), each step's end."""
    n = trace.num_events
    kind = [0] * (n + 1)
    rec = [-1] * (n + 1)
    for i, (b, d) in enumerate(zip(trace.birth, trace.death, strict=True)):
        if not 0 < b <= n or d > n or rec[b] != -1 or (d > 0 and rec[d] != -1):
            return None  # not one event per stamp: not a trace this module understands
        rec[b], kind[b] = i, _BIRTH
        if d > 0:
            rec[d], kind[d] = i, _DEATH
    if -1 in rec[1:]:
        return None
    steps = set(trace.step_boundaries)
    out: list[int] = []
    seq = 1

    def events_to(last: int) -> None:
        nonlocal seq
        frees: list[int] = []
        for s in range(seq, last + 1):
            r = rec[s]
            tok = table.setdefault((kind[s], trace.nbytes[r], trace.tier[r], trace.category[r]), len(table))
            if kind[s] == _DEATH:
                frees.append(tok)
                continue
            out.extend(sorted(frees))
            frees.clear()
            out.append(tok)
        out.extend(sorted(frees))
        seq = max(seq, last + 1)

    for op in range(1, len(trace.op_end_event)):
        events_to(trace.op_end_event[op])
        out.append(table.setdefault((_OP, trace.op_phase[op]), len(table)))
        if op in steps:
            out.append(table.setdefault((_STEP,), len(table)))
    events_to(n)
    return out


def _insertions(two: list[int], three: list[int]) -> list[tuple[int, list[int]]] | None:
    """Where ``three`` holds one more copy of a stretch than ``two``: ``(position in two,
    stretch)`` in order, or ``None`` when ``three`` is not ``two`` with such copies inserted.

    Where the two streams part, an insertion of ``L`` tokens at position ``j`` of ``two`` is a
    candidate if the ``L`` tokens before ``j`` in ``two`` are the same stretch (the shallower
    trace holds a copy just before the point where the deeper one adds another: the last
    block may differ from the others, as when only a next block keeps a block's output), and
    if it does not reach back past the previous insertion.
    Several lengths may qualify (a run of equal tokens repeats with any short period), so the
    candidates are tried in order of how far ``three`` then matches ``two`` again, backtracking
    when a choice leads to a point where nothing qualifies; at most :data:`MAX_TRIES` choices.
    """
    n2, n3 = len(two), len(three)
    stack: list[tuple[int, int, int, list[tuple[int, list[int]]]]] = [(0, 0, 0, [])]
    tries = 0
    while stack and tries < MAX_TRIES:
        tries += 1
        i, j, floor, done = stack.pop()
        while i < n3 and j < n2 and three[i] == two[j]:
            i += 1
            j += 1
        if i == n3 and j == n2:
            return done
        rest = n2 - j
        first = three[i] if i < n3 else None
        scored: list[tuple[int, int]] = []
        for size in range(1, j - floor + 1):
            q = i + size
            if n3 - q < rest:
                break
            if (rest and three[q] != two[j]) or (not rest and q != n3) or two[j - size] != first:
                continue
            if two[j - size : j] != three[i:q]:
                continue
            k = 0
            while k < rest and q + k < n3 and three[q + k] == two[j + k]:
                k += 1
            scored.append((k, -size))
        # The most promising last, so that it is popped first.
        for _, neg in sorted(scored):
            size = -neg
            stack.append((i + size, j, j, [*done, (j, three[i : i + size])]))
    return None


def _phase_peaks_at_allocations(trace: AllocationTrace) -> bool:
    """Whether each phase's peak, as a report finds it, is a value the stream fixes.

    Frees at one instant (between two operations) are put in a fixed order in the stream,
    because their order varies from run to run; no value a report reads depends on it, except
    a phase whose highest point is the first of such frees (the phase starts with them): its
    value then depends on which is first, unless they are all alike. If not, the caller
    dry-runs instead.
    """
    n = trace.num_events + 1
    delta = np.zeros(n, dtype=np.int64)
    freed = np.full(n, -1, dtype=np.int64)  # the record each free ends
    nb = np.asarray(trace.nbytes, dtype=np.int64)
    birth = np.asarray(trace.birth, dtype=np.int64)
    death = np.asarray(trace.death, dtype=np.int64)
    dev = np.asarray(trace.tier, dtype=np.int64) == 0
    ended = death > 0
    np.add.at(delta, birth[dev], nb[dev])
    np.add.at(delta, death[dev & ended], -nb[dev & ended])
    freed[death[ended]] = np.flatnonzero(ended)
    total = np.cumsum(delta)
    op_seq = np.asarray(trace.op_end_event, dtype=np.int64)
    seq_op = np.minimum(np.searchsorted(op_seq, np.arange(n), side="left"), len(op_seq) - 1)
    phase = np.asarray(trace.op_phase, dtype=np.int64)[seq_op]

    def kind(r: int) -> tuple[int, int, int]:
        return trace.nbytes[r], trace.tier[r], trace.category[r]

    for p in range(3):
        idx = np.flatnonzero(phase == p)
        if not len(idx):
            continue
        at = int(idx[np.argmax(total[idx])])
        if freed[at] < 0:
            continue
        end = at
        while end + 1 < n and freed[end + 1] >= 0 and seq_op[end + 1] == seq_op[at]:
            end += 1
        if len({kind(int(r)) for r in freed[at : end + 1]}) > 1:
            return False
    return True


def _trace(tokens: list[tuple[int, ...]], device: str) -> AllocationTrace | None:
    """An :class:`AllocationTrace` from a token stream: each free ends a live allocation of its
    kind (which one does not change what a report reads)."""
    nbytes: list[int] = []
    birth: list[int] = []
    death: list[int] = []
    tier: list[int] = []
    cat: list[int] = []
    live: dict[tuple[int, ...], list[int]] = {}
    op_end = [0]
    op_phase = [3]
    steps: list[int] = []
    seq = 0
    total = peak = peak_seq = 0
    for tok in tokens:
        kind = tok[0]
        if kind == _OP:
            op_end.append(seq)
            op_phase.append(tok[1])
            continue
        if kind == _STEP:
            steps.append(len(op_end) - 1)
            continue
        seq += 1
        key = tok[1:]
        on_device = tok[2] == 0
        if kind == _BIRTH:
            live.setdefault(key, []).append(len(nbytes))
            nbytes.append(tok[1])
            birth.append(seq)
            death.append(-1)
            tier.append(tok[2])
            cat.append(tok[3])
            if on_device:
                total += tok[1]
                if total > peak:
                    peak, peak_seq = total, seq
        else:
            ends = live.get(key)
            if not ends:
                return None  # a free with nothing of its kind alive: not a trace
            death[ends.pop()] = seq
            if on_device:
                total -= tok[1]
    return AllocationTrace(
        nbytes=tuple(nbytes),
        birth=tuple(birth),
        death=tuple(death),
        tier=tuple(tier),
        category=tuple(cat),
        num_events=seq,
        op_end_event=tuple(op_end),
        op_phase=tuple(op_phase),
        step_boundaries=tuple(steps),
        peak_bytes=peak,
        peak_event=peak_seq,
        device=device,
    )
