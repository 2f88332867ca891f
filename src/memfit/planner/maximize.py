"""``memfit.maximize``: the longest sequence (or the largest batch) that fits a budget, with
its fastest plan.

The inverse of :func:`memfit.planner.plan`: instead of "does this length fit?", "what is the
longest that fits, and how?". A full plan search per length would take minutes per length on
an 8B model, so the search asks the planner only a few times and otherwise predicts ONE plan
at a time, using that memory grows with the length for a fixed plan:

1. one planner call at the model's maximum positions, held to a few predictions (or a full
   one at the given length when the model has no known maximum): if a plan fits there, the
   cap (not memory) is the answer; if not, the closest plan (the most frugal one predicted)
   is where the search starts;
2. that plan's longest fitting length is bracketed and bisected with predictions of that plan
   alone (:func:`memfit.planner.predict.predict`, then :func:`~memfit.planner.predict.confirm`
   for a length predicted to fit: the planner's own verdict for it), each guess interpolated
   from the predicted totals (memory is nearly linear in the length), every other guess a
   plain bisection step so that the bracket at least halves;
3. a planner call one step longer: if some other plan fits there, its longest length is found
   the same way (step 2) and the search goes on from there; when nothing fits, that is the
   proof that no allowed plan fits a longer length, and a planner call at the answer gives
   its fastest plan.

Granularity: a ``seq_len`` answer ``N`` is a multiple of ``g``, the largest power of two at
most ``N / 32``, and at most 64 tokens (64 is what attention kernels and padding to a
multiple of 64 work in; ``1`` below 64 tokens): the plan fits at ``N`` and nothing allowed
fits at ``N + g``, which is at most 3.2% longer, so nothing fits at ``1.05 N`` either.
``batch_size`` is exact (granularity 1). A ``granularity`` argument overrides both.

The batch-size question is the largest batch one forward and backward pass holds, so
gradient accumulation (which would fit any batch by splitting it) is forbidden; likewise the
sequence-length question refuses ``--allow shorter-seq``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..errors import MemfitError, MemfitValueError
from ..plan import Plan
from ..targets import DeviceProfile
from ..workload import PRESETS, Workload, load_workload
from .predict import confirm, predict
from .result import Candidate, NothingFits, PlanResult

__all__ = [
    "CEILING", "WHATS", "Found", "Maximized", "NothingAtAll", "Search", "maximize", "parse_what",
    "position_limit",
]

#: What can be maximized: the JSON key (and the ``what`` argument) -> the CLI word.
WHATS = {"seq_len": "seq-len", "batch_size": "batch-size"}

#: The largest value searched when the model names no maximum (a function workload's length,
#: any batch): past it the answer says the ceiling, not memory, stopped the search.
CEILING = 1 << 24

#: The coarsest step of a ``seq_len`` answer, in tokens (see the module docstring).
SEQ_GRANULARITY = 64

#: Predictions the first planner call (at the model's maximum positions) may make: it only
#: looks for a frugal plan to start from (see :attr:`Search.scout`).
SCOUT_PREDICTIONS = 6


@dataclass
class Maximized:
    """What :func:`maximize` found.

    Attributes:
        what: ``"seq_len"`` or ``"batch_size"``.
        value: The largest value that fits (a multiple of ``granularity``, or the cap).
        result: The fastest plan at ``value`` (a full planner answer for that workload).
        budget: The budget as given.
        granularity: The step: nothing allowed fits at ``value + granularity`` (unless the
            cap stopped the search).
        limited_by: ``"memory"``, ``"max_positions"`` (the model's position limit, a
            ``seq_len`` only) or ``"ceiling"`` (:data:`CEILING`, when no limit is known).
        limit: The model's maximum positions (``seq_len``), or the ceiling searched.
        next_checked: The next value up, at which the planner found that nothing fits
            (``None`` when a limit, not memory, stopped the search).
        plan_calls: Full planner calls made.
        predictions: Predictions of one plan at one value made.
        seconds: Time taken.
    """

    what: str
    value: int
    result: PlanResult
    budget: int | str
    granularity: int
    limited_by: str
    limit: int | None
    next_checked: int | None
    plan_calls: int = 0
    predictions: int = 0
    seconds: float = 0.0

    def details(self) -> dict[str, Any]:
        """How the answer was reached (the JSON's ``maximized_details``)."""
        return {
            "what": self.what,
            "granularity": self.granularity,
            "limited_by": self.limited_by,
            "limit": self.limit,
            "next_checked": self.next_checked,
            "plan_calls": self.plan_calls,
            "predictions": self.predictions,
        }

    def to_dict(self) -> dict[str, Any]:
        """The JSON of ``memfit plan --maximize``: the plan at the answer (the keys of
        :meth:`PlanResult.to_dict`), ``maximized`` (``{"seq_len": N}`` or
        ``{"batch_size": N}``) and ``maximized_details`` (:meth:`details`)."""
        data = self.result.to_dict()
        data["maximized"] = {self.what: self.value}
        data["maximized_details"] = self.details()
        return data

    def row(self) -> dict[str, Any]:
        """One budget's row of ``--budgets``' JSON list."""
        r = self.result
        return {
            "budget": str(self.budget),
            "budget_bytes": r.budget_bytes,
            self.what: self.value,
            "fits": True,
            "plan": r.plan.to_dict(),
            "summary": r.plan.summary(),
            "predicted_peak_bytes": r.predicted_peak_bytes,
            "predicted_device_total_bytes": r.predicted_device_total_bytes,
            "predicted_device_total_upper_bytes": r.predicted_device_total_upper_bytes,
            "predicted_step_time_ratio": r.predicted_step_time_ratio,
            **self.details(),
        }

    def sentence(self) -> str:
        """The answer in one sentence."""
        unit = "tokens per sample" if self.what == "seq_len" else "samples per step"
        head = f"{_label(self.what)}: {self.value} {unit}"
        if self.limited_by == "max_positions":
            return f"{head}: the model's maximum positions, not memory, are the limit"
        if self.limited_by == "ceiling":
            return f"{head}: the search stops at this ceiling, not at the memory limit"
        if self.limited_by == "limit":
            return f"{head}: the limit asked for, not memory, stops the search"
        return (
            f"{head} (granularity {self.granularity}): no allowed plan fits "
            f"{self.next_checked} {unit.split()[0]}"
        )


def _label(what: str) -> str:
    return "longest context" if what == "seq_len" else "largest batch"


def parse_what(word: str) -> str:
    """``seq-len``/``seq_len`` -> ``"seq_len"``, ``batch-size``/``batch_size`` ->
    ``"batch_size"``.

    Raises:
        ValueError: for any other word (one sentence naming those accepted).
    """
    key = str(word).strip().lower().replace("-", "_")
    if key not in WHATS:
        raise MemfitValueError(
            f"--maximize {word!r} is not known; use seq-len (the longest context) or "
            "batch-size (the largest batch)"
        )
    return key


def maximize(
    workload: Workload | str,
    budget: int | str,
    *,
    what: str = "seq_len",
    batch_size: int | None = None,
    seq_len: int | None = None,
    granularity: int | None = None,
    limit: int | None = None,
    allow: Iterable[str] = (),
    forbid: Iterable[str] = (),
    base: Plan | None = None,
    device: str | DeviceProfile | None = None,
    max_predictions: int = 60,
    progress: Callable[[str], None] | None = None,
    host_budget: int | str | None = None,
    disk_dir: str | None = None,
    jobs: int = 2,
    lora_rank: int | None = None,
) -> Maximized:
    """The largest ``seq_len`` (or ``batch_size``) whose fastest plan fits ``budget``.

    Args:
        workload: A :class:`Workload` or a ``--model`` SPEC. A SPEC is loaded again at each
            size tried (exact for every kind of SPEC); a ``Workload`` is resized with
            :meth:`Workload.replace` (its ``make_batch`` must honour the sizes it is given,
            as those of presets and configs do).
        budget: Bytes, a size string (``24GiB``) or a device name, as for ``plan``.
        what: ``"seq_len"`` or ``"batch_size"`` (``seq-len``, ``batch-size`` too).
        batch_size: With a SPEC: the batch (default 8; the starting batch when maximized).
        seq_len: With a SPEC: the length (default 128; the starting length when maximized).
        granularity: The step of the answer (default: see the module docstring).
        limit: The largest value considered (default: the model's maximum positions for
            ``seq_len``, else :data:`CEILING`).
        allow, forbid, base, device, max_predictions, host_budget, disk_dir, jobs, lora_rank:
            As for :func:`memfit.planner.plan` (one process; ``batch_size`` forbids
            accumulation).
        progress: Called with a short message as the search advances.

    Returns:
        The :class:`Maximized` answer, with the fastest plan at that value.

    Raises:
        ValueError: for a bad ``what``, ``granularity`` or ``limit``, ``shorter-seq``
            allowed when maximizing ``seq_len``, or any of ``plan``'s bad inputs.
        NothingFits: when nothing fits even at the smallest value (``.result``: the
            closest plan there).
    """
    from ..targets import get_device, parse_budget

    started = time.perf_counter()
    what = parse_what(what)
    settings = _settings(
        what, granularity, limit, allow=allow, forbid=forbid, base=base, device=device,
        max_predictions=max_predictions, host_budget=host_budget, disk_dir=disk_dir,
        jobs=jobs, lora_rank=lora_rank,
    )
    budget_bytes, budget_device = parse_budget(budget)
    host_bytes = None if host_budget is None else parse_budget(host_budget)[0]
    target = get_device(device) if device else (budget_device or get_device(None))
    make, start, positions = _maker(workload, what, batch_size, seq_len)
    if what == "seq_len" and positions is not None:
        cap, kind = min(limit or positions, positions), "max_positions"
        if limit is not None and limit < positions:
            kind = "limit"
    else:
        cap, kind = limit or CEILING, "limit" if limit is not None else "ceiling"
    binding = _Binding(
        what, make, budget, budget_bytes, host_bytes, target, progress or (lambda msg: None),
        settings,
    )
    search = Search(
        binding.plan_at, binding.fits_at, budget_bytes, min(start, cap), cap,
        planner_first=kind == "max_positions",
        fixed_step=granularity if granularity is not None else (
            1 if what == "batch_size" else None),
        scout=binding.scout,
        confirm_at=binding.confirm_at,
    )
    try:
        found = search.run()
    except NothingAtAll as e:
        raise _nothing_fits(e, what, max_predictions) from None
    return Maximized(
        what, found.value, found.answer, budget, found.granularity,
        "memory" if found.next_checked is not None else kind, cap, found.next_checked,
        search.plan_calls, search.predictions, time.perf_counter() - started,
    )


def _nothing_fits(e: NothingAtAll, what: str, max_predictions: int) -> NothingFits:
    label = "sequence length" if what == "seq_len" else "batch size"
    message = f"nothing fits even at {label} {e.value}: {e.answer}"
    if isinstance(e, PlannerGaveUp):
        message = (
            f"the planner found no plan at {label} {e.value} within {max_predictions} "
            f"predictions, though {e.plan.summary()} was predicted to fit there; raise "
            "max_predictions"
        )
    return NothingFits(e.answer.result, message)


def _settings(
    what: str, granularity: int | None, limit: int | None, **settings: Any
) -> dict[str, Any]:
    """:func:`maximize`'s arguments checked, and the planner's settings for ``what``."""
    for name, value in (("granularity", granularity), ("limit", limit)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
    allow, forbid = tuple(settings.pop("allow")), tuple(settings.pop("forbid"))
    if what == "seq_len" and "shorter-seq" in allow:
        raise ValueError(
            "--allow shorter-seq trains shorter sequences than asked, which --maximize "
            "seq-len measures; leave it out"
        )
    if what == "batch_size" and "accumulation" not in forbid:
        # Accumulation fits any batch by splitting it: the question is what one pass holds.
        forbid = (*forbid, "accumulation")
    if settings.get("lora_rank") is None:
        settings.pop("lora_rank", None)
    return dict(allow=allow, forbid=forbid, **settings)


@dataclass
class _PlanLine:
    """What is known of one plan along the axis: the longest value known to fit, the
    shortest known not to, and the exact predicted totals met (for interpolation)."""

    plan: Any
    fit: int | None = None
    misfit: int | None = None
    points: dict[int, int] = field(default_factory=dict)
    fitted: set[int] = field(default_factory=set)  # predicted to fit
    ratio: float = 1.0  # what confirmations held over the predictions, at most
    confirmed: set[int] = field(default_factory=set)  # ...and confirmed at full depth

    def __post_init__(self) -> None:
        if self.fit is not None:  # a planner's winner: confirmed there
            self.fitted.add(self.fit)
            self.confirmed.add(self.fit)


#: ``plan_at(n)``: the planner at ``n``: whether a plan fits, the plan (the winner, or the
#: closest when nothing fits) and the planner's answer as it came.
PlanAt = Callable[[int], tuple[bool, Any, Any]]
#: ``fits_at(plan, n)``: whether ``plan`` fits at ``n``, its predicted total compared with
#: the budget, and whether that total is exact (``False``: a floor, the run stopped early).
FitsAt = Callable[[Any, int], tuple[bool, int | None, bool]]


@dataclass
class Found:
    """The search's outcome: the value, the planner's answer there, the next value up where
    nothing fits (``None`` when the limit stopped the search) and the granularity there."""

    value: int
    answer: Any
    next_checked: int | None
    granularity: int


class NothingAtAll(MemfitError):
    """Nothing fits even at ``value``, the smallest: ``answer`` is the planner's there."""

    def __init__(self, value: int, answer: Any) -> None:
        super().__init__(value)
        self.value, self.answer = value, answer


class PlannerGaveUp(NothingAtAll):
    """The planner found no plan at ``value`` where ``plan`` was predicted to fit: it stopped
    at its prediction limit before reaching that plan."""

    def __init__(self, value: int, answer: Any, plan: Any) -> None:
        super().__init__(value, answer)
        self.plan = plan


@dataclass
class Search:
    """Steps 1 to 3 of the module docstring, over two callables (the planner at a value,
    one plan's verdict at a value), so that the search can be checked on any memory curve.

    Attributes:
        plan_at: The planner (see :data:`PlanAt`).
        fits_at: One plan's prediction (see :data:`FitsAt`).
        budget_bytes: The budget (what the predicted totals are compared with).
        start: The first value tried below a misfit when no fitting value is known.
        limit: The largest value considered.
        planner_first: Ask the planner at ``limit`` first (a known maximum, such as the
            model's positions), else at ``start``.
        fixed_step: The granularity; ``None``: :meth:`step`'s rule for sequence lengths.
        scout: With ``planner_first``, the planner held to a few predictions, asked at
            ``limit`` instead: far over the budget, a full search rules out one candidate
            after another (minutes each on an 8B model) before it may say that nothing fits,
            while the answer needs only a frugal plan to start from. Its "nothing fits" is
            no proof, so it bounds nothing; a fit there is asked of the full planner.
        confirm_at: ``confirm_at(plan, n)``: whether ``plan`` fits at ``n`` at full depth,
            and its total there, asked of the longest value ``fits_at`` finds (``None``:
            ``fits_at`` is final).
    """

    plan_at: PlanAt
    fits_at: FitsAt
    budget_bytes: int
    start: int
    limit: int
    planner_first: bool = True
    fixed_step: int | None = None
    scout: PlanAt | None = None
    confirm_at: Callable[[Any, int], tuple[bool, int | None]] | None = None
    predictions: int = 0
    plan_calls: int = 0
    asked: dict[int, tuple[bool, Any, Any]] = field(default_factory=dict)

    def run(self) -> Found:
        """The largest value at which a plan fits (the fastest plan there), or
        :class:`NothingAtAll`."""
        first = self.limit if self.planner_first else min(self.start, self.limit)
        scouted = self.planner_first and self.scout is not None
        if scouted:
            assert self.scout is not None
            self.plan_calls += 1
            ok, plan, answer = self.scout(first)
        else:
            ok, plan, answer = self._plan(first)
        if ok and first >= self.limit:
            line = _PlanLine(plan, fit=first)
            return Found(first, self._fastest(first, line) if scouted else answer, None,
                         self.step(first))
        fit, misfit = (first, None) if ok else (None, None if scouted else first)
        line = _PlanLine(plan, fit=fit)
        while True:
            longest = self._longest(line, misfit)
            if longest is None:
                # The closest plan fits nowhere: whether another fits at the smallest value.
                smallest = self.step(1)
                ok, plan, answer = self._plan(smallest)
                if not ok or smallest >= self.limit:
                    if ok:
                        return Found(smallest, answer, None, self.step(smallest))
                    raise NothingAtAll(smallest, answer)
                line = _PlanLine(plan, fit=smallest)
                continue
            if longest >= self.limit:
                return Found(self.limit, self._fastest(self.limit, line), None, self.step(self.limit))
            nxt = min(self._grid_after(longest), self.limit)
            ok, plan, answer = self._plan(nxt)
            if ok:
                # Another plan reaches further: follow it from there.
                if nxt >= self.limit:
                    return Found(nxt, answer, None, self.step(nxt))
                line = _PlanLine(plan, fit=nxt)
                continue
            return Found(longest, self._fastest(longest, line), nxt, nxt - longest)

    def step(self, at: int) -> int:
        """The granularity near ``at``: fixed, or the largest power of two at most
        ``at / 32``, at most :data:`SEQ_GRANULARITY`, at least 1."""
        if self.fixed_step is not None:
            return self.fixed_step
        step = 1
        while step * 2 <= min(SEQ_GRANULARITY, at // 32):
            step *= 2
        return step

    def _grid_after(self, n: int) -> int:
        g = self.step(n)
        return (n // g + 1) * g

    def _longest(self, line: _PlanLine, misfit: int | None) -> int | None:
        """The longest value ``line.plan`` fits at, below ``misfit`` (where nothing fits) and
        from ``line.fit`` up; ``None`` when it fits nowhere below. Predictions narrow it, and
        only the answer is confirmed (a full-depth dry run on a GPU target, the most costly
        step): where the confirmation says no, that value is a misfit and narrowing goes on
        below it."""
        while True:
            lo = self._narrow(line, misfit)
            if lo is None or lo in line.confirmed or self.confirm_at is None:
                return lo
            ok, total = self.confirm_at(line.plan, lo)
            if ok:
                line.confirmed.add(lo)
                return lo
            if total is not None and lo in line.points:
                # What the full depth holds over the prediction: predictions are held to
                # that fraction of the budget from now on (the planner's call one step up still proves
                # the answer, so a margin too wide costs a step, not a wrong answer).
                line.ratio = max(line.ratio, total / max(line.points[lo], 1))
            cut = self.budget_bytes / line.ratio
            line.fitted = {n for n in line.fitted if n < lo and line.points.get(n, 0) <= cut}
            misfit = line.misfit = lo if misfit is None else min(misfit, lo)
            line.fit = max(line.fitted, default=None)

    def _narrow(self, line: _PlanLine, misfit: int | None) -> int | None:
        """:meth:`_longest` by predictions alone."""
        hi, lo = misfit, line.fit
        if lo is None:
            # Down from the start (or half the misfit) until it fits.
            probe = self.start if hi is None or self.start < hi else max(1, hi // 2)
            while not self._fits(line, probe):
                hi = probe
                if probe <= 1:
                    return None
                probe = max(1, probe // 2)
                probe = max(1, probe // self.step(probe) * self.step(probe))
            lo = probe
        # Up until it does not fit (or the limit).
        while hi is None:
            if lo >= self.limit:
                return lo
            guess = min(self._extrapolate(line, lo), self.limit)
            if self._fits(line, guess):
                lo = guess
            else:
                hi = guess
        # Narrow: until no grid value between lo and hi is left untried. An interpolated
        # step that does not halve the bracket is followed by a plain bisection step.
        halve = False
        while self._grid_after(lo) < hi:
            width = hi - lo
            guess = self._between(line, lo, hi, halve)
            if self._fits(line, guess):
                lo = guess
            else:
                hi = guess
            halve = not halve and (hi - lo) * 2 > width
        return lo

    def _secant(self, line: _PlanLine, lo: int, hi: int | None) -> int | None:
        """Where the line through two exact predicted totals meets the budget: ``lo``'s and
        ``hi``'s where both are known, else ``lo``'s and the closest other below it."""
        points = line.points
        if lo not in points:
            return None
        if hi is not None and hi in points:
            other = hi
        else:
            below = [n for n in points if n < lo]
            if not below:
                return None
            other = max(below)
        (n1, m1), (n2, m2) = sorted(((lo, points[lo]), (other, points[other])))
        if m2 <= m1:
            return None
        target = int(self.budget_bytes / line.ratio)
        return lo + (target - points[lo]) * (n2 - n1) // (m2 - m1)

    def _extrapolate(self, line: _PlanLine, lo: int) -> int:
        """The next value up from ``lo`` (known to fit): the secant's, rounded down to the
        grid, at least one step up and at most eight times ``lo``; else twice ``lo``."""
        g = self.step(lo)
        guess = self._secant(line, lo, None)
        if guess is None:
            guess = 2 * lo
        return max(min(guess // g * g, 8 * lo), self._grid_after(lo))

    def _between(self, line: _PlanLine, lo: int, hi: int, halve: bool) -> int:
        """A grid value strictly between ``lo`` and ``hi``: the secant's, or the midpoint
        when ``halve`` or when there is no secant."""
        g = self.step(lo)
        first, last = self._grid_after(lo), (hi - 1) // g * g
        guess = None if halve else self._secant(line, lo, hi)
        if guess is None:
            guess = (lo + hi) // 2
        return min(max(guess // g * g, first), last)

    def _fits(self, line: _PlanLine, n: int) -> bool:
        if line.fit is not None and n <= line.fit:
            return True
        if line.misfit is not None and n >= line.misfit:
            return False
        self.predictions += 1
        ok, total, exact = self.fits_at(line.plan, n)
        if ok and total is not None and total > self.budget_bytes / line.ratio:
            ok = False
        if total is not None and exact:
            line.points[n] = total
        if ok:
            line.fit = max(line.fit or 0, n)
            line.fitted.add(n)
        else:
            line.misfit = n if line.misfit is None else min(line.misfit, n)
        return ok

    def _plan(self, n: int) -> tuple[bool, Any, Any]:
        """The planner at ``n`` (asked once per value)."""
        if n not in self.asked:
            self.plan_calls += 1
            self.asked[n] = self.plan_at(n)
        return self.asked[n]

    def _fastest(self, n: int, line: _PlanLine) -> Any:
        """The planner's answer at ``n``, where ``line.plan`` is known to fit."""
        ok, _, answer = self._plan(n)
        if not ok:  # the planner gave up before reaching it (its prediction limit)
            raise PlannerGaveUp(n, answer, line.plan)
        return answer


@dataclass
class _Binding:
    """:class:`Search`'s two callables bound to the planner, for one :func:`maximize`."""

    what: str
    make: Callable[[int], Workload]
    budget: int | str
    budget_bytes: int
    host_bytes: int | None
    target: DeviceProfile
    say: Callable[[str], None]
    settings: dict[str, Any]
    # Keyed by the plan's JSON and the value (a plan holds dicts: not hashable).
    predicted: dict[tuple[str, int], Candidate] = field(default_factory=dict)

    def confirm_at(self, plan: Plan, n: int) -> tuple[bool, int | None]:
        """``plan`` at ``n`` at full depth (:func:`~memfit.planner.predict.confirm`), after
        :meth:`fits_at` predicted that it fits: the verdict and the total compared."""
        from ..estimate.target import upper_edge

        workload = self.make(n)
        c = self.predicted.pop((_key(plan), n), None)
        if c is None:
            c = Candidate(plan=plan, rank=(), step_time=0.0)
            if not predict(c, workload, self.target, self.budget_bytes, self.host_bytes):
                return False, None
        self.say(f"{self.what} {n}: confirming {plan.summary()} at full depth")
        ok = confirm(c, workload, self.target, self.budget_bytes, self.host_bytes)
        total = c.device_total_bytes
        return ok, None if total is None else upper_edge(int(total), self.target.is_cuda)

    def plan_at(self, n: int) -> tuple[bool, Any, Any]:
        """The planner at ``n``."""
        return self._planner(n, self.settings)

    def scout(self, n: int) -> tuple[bool, Any, Any]:
        """The planner at ``n``, held to :data:`SCOUT_PREDICTIONS` (see
        :attr:`Search.scout`)."""
        limit = min(SCOUT_PREDICTIONS, self.settings["max_predictions"])
        return self._planner(n, {**self.settings, "max_predictions": limit}, "scouting")

    def _planner(
        self, n: int, settings: dict[str, Any], doing: str = "searching every allowed plan"
    ) -> tuple[bool, Any, Any]:
        from .entry import plan

        self.say(f"{self.what} {n}: {doing}")
        try:
            result = plan(
                self.make(n), self.budget,
                progress=lambda msg: self.say(f"{self.what} {n}: {msg}"), **settings,
            )
        except NothingFits as e:
            return False, e.result.plan, e
        return True, result.plan, result

    def fits_at(self, plan: Plan, n: int) -> tuple[bool, int | None, bool]:
        """``plan`` at ``n`` predicted as the planner predicts it (composed from shallow dry
        runs, stopped once over the budget); :meth:`confirm_at` checks the answer."""
        from ..estimate.target import upper_edge

        workload = self.make(n)
        c = Candidate(plan=plan, rank=(), step_time=0.0)
        self.say(f"{self.what} {n}: predicting {plan.summary()}")
        ok = predict(c, workload, self.target, self.budget_bytes, self.host_bytes)
        if ok:  # kept for its confirmation (its shallow runs' traces may spare a dry run)
            self.predicted[(_key(plan), n)] = c
        total = c.device_total_bytes if c.device_total_bytes is not None else c.peak_bytes
        if total is None:
            return ok, None, False
        return ok, upper_edge(int(total), self.target.is_cuda), not c.at_least


def _key(plan: Plan) -> str:
    import json

    return json.dumps(plan.to_dict(), sort_keys=True, default=str)


def _maker(
    workload: Workload | str, what: str, batch_size: int | None, seq_len: int | None
) -> tuple[Callable[[int], Workload], int, int | None]:
    """A maker of the workload at a value of ``what``, the starting value and the model's
    maximum positions (``None`` when unknown)."""
    if isinstance(workload, str):
        spec, b, s = workload, batch_size or 8, seq_len or 128
        first = load_workload(spec, b, s)  # bad SPECs and sizes fail here, before any work

        def make(n: int) -> Workload:
            if what == "seq_len":
                return first if n == s else load_workload(spec, b, n)
            return first if n == b else load_workload(spec, n, s)

        return make, (s if what == "seq_len" else b), position_limit(spec)
    wl = workload

    def resize(n: int) -> Workload:
        return _resized(wl, **{what: n})

    return resize, getattr(wl, what), position_limit(wl.name)


def _resized(workload: Workload, **sizes: int) -> Workload:
    """``workload`` at other sizes, its shallow copies (``with_depth``) too: a preset's or a
    config's ``with_depth`` remembers the sizes it was made with."""
    if all(getattr(workload, k) == v for k, v in sizes.items()):
        return workload
    shallow = workload.with_depth
    return workload.replace(
        **sizes,
        with_depth=None if shallow is None else (lambda d: shallow(d).replace(**sizes)),
    )


def maximize_budgets(
    workload: Workload | str,
    budgets: Iterable[int | str],
    **options: Any,
) -> list[Maximized | NothingFits]:
    """:func:`maximize` at each budget, in the order given: the table fine-tuning projects
    publish (budget, longest context, plan). A budget where nothing fits even at the smallest
    value gives its :class:`NothingFits` in its place. ``options`` are :func:`maximize`'s."""
    answers: list[Maximized | NothingFits] = []
    say = options.pop("progress", None) or (lambda msg: None)
    for budget in budgets:
        try:
            answers.append(
                maximize(workload, budget, progress=lambda m, b=budget: say(f"{b}: {m}"),
                         **options)
            )
        except NothingFits as e:
            answers.append(e)
    return answers


def budgets_json(
    budgets: Iterable[int | str], answers: list[Maximized | NothingFits], what: str
) -> dict[str, Any]:
    """The JSON of ``--budgets``: ``maximized``, one row per budget (:meth:`Maximized.row`;
    where nothing fits, the value is ``null``, ``fits`` false and ``explanation`` says why)."""
    rows = []
    for budget, answer in zip(budgets, answers, strict=True):
        if isinstance(answer, Maximized):
            rows.append(answer.row())
        else:
            rows.append({
                "budget": str(budget),
                "budget_bytes": answer.result.budget_bytes,
                what: None,
                "fits": False,
                "explanation": str(answer),
            })
    return {"maximized": rows}


def budgets_table(
    budgets: Iterable[int | str], answers: list[Maximized | NothingFits], what: str
) -> Any:
    """A rich table: budget, longest context (or largest batch), plan, predicted peak (the
    device total fitted into the budget)."""
    from rich.table import Table

    from ..units import format_bytes

    table = Table(title=f"{_label(what)} per budget")
    table.add_column("budget")
    table.add_column(_label(what), justify="right")
    table.add_column("plan")
    table.add_column("predicted peak (device total)", justify="right")
    for budget, answer in zip(budgets, answers, strict=True):
        if isinstance(answer, Maximized):
            r = answer.result
            value = str(answer.value)
            if answer.limited_by != "memory":
                value += f" ({answer.limited_by.replace('_', ' ')})"
            table.add_row(str(budget), value, r.plan.summary(),
                          format_bytes(r.predicted_device_total_upper_bytes
                                       or r.predicted_peak_bytes))
        else:
            table.add_row(str(budget), "nothing fits", "", "")
    return table


def position_limit(spec: str) -> int | None:
    """The most tokens per sample the model named by ``spec`` was configured for: its
    config's ``max_position_embeddings`` (``n_positions`` for GPT-2), transformers' default
    for the family where a preset leaves it out; ``None`` when unknown (a function SPEC, a
    hub id whose config is not at hand, a config without it).

    ``--maximize seq-len`` stops there (a preset would otherwise grow its position table, as a
    fine-tune that extends the context does)."""
    import json
    from pathlib import Path

    if spec in PRESETS:
        preset = PRESETS[spec]
        data: Any = {"model_type": preset.family, **preset.config}
    else:
        from ..weights import WeightsError, hub_folder, is_hub_id

        path = Path(spec)
        if path.is_dir():
            path = path / "config.json"
        elif not path.is_file() and is_hub_id(spec):
            try:
                path = hub_folder(spec, weights=False) / "config.json"
            except WeightsError:
                return None
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return None
    if not isinstance(data, dict) or "model_type" not in data:
        return None
    import transformers

    try:
        config = transformers.AutoConfig.for_model(**data)
    except Exception:  # a model type this transformers cannot read: no limit known
        return None
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return int(limit) if isinstance(limit, int) and limit > 0 else None
