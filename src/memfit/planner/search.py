"""Search the plans that fit a memory budget for the fastest one.

The search runs in four stages, each in its own module:

1. candidate generation (:mod:`memfit.planner.candidates`): every plan in the allowed space,
   with its memory rank per dimension;
2. costing (:mod:`memfit.planner.costing`): a predicted step time for each (cheap: arithmetic
   on one measured profile), which orders the search, fastest first;
3. prediction (:mod:`memfit.planner.predict`): a candidate's memory composed from two shallow
   dry runs (expensive, so done lazily, in order of speed);
4. confirmation: the first candidate predicted to fit is checked at full depth before it is
   returned (its full-depth trace built from the two shallow runs', or a full-depth dry run,
   :func:`memfit.estimate.compose.confirm_peak`).

With ``jobs=2`` a worker process forked from the planner (:mod:`memfit.planner.worker`)
measures half of the cost profile while the planner measures the other half, then runs the
depth-3 run of each prediction while the planner runs its depth-2 run. The depth-2 run's
traces at each forward's end go to the worker as they are made, so the depth-3 run stops as
soon as the full depth passes the budget, as it would in one process; the depth-2 run stops
within a few operators then. A first forward over the budget stops the depth-3 run at its
end, at about a floor's cost, so no floor comes first. The answer does not change.

Three rules keep the number of memory predictions small (:func:`search`):

* the most frugal candidates (the seeds: those no other candidate dominates) settle a search
  where nothing fits: if none of them fits, nothing does, and the answer says how far off the
  closest is. They wait their turn, as one of the first candidates in line usually fits: their
  floors come after four candidates in line were ruled out by theirs, their predictions after
  two were predicted and misfit (:data:`SEED_FLOORS_AFTER`, :data:`SEEDS_AFTER`);
* dominance: a candidate that keeps at least as much memory as a known misfit in every
  dimension (larger micro-batch, less checkpointing, wider precision, bigger optimizer state,
  ...) cannot fit and is skipped without a prediction;
* a floor first, in one process: before a candidate is predicted, the first forward of its
  full-depth run is built from its depth-2 and depth-3 first forwards (a few blocks' forward,
  see :func:`memfit.planner.predict.probe`); if that alone passes the budget, the candidate is
  out and its figures say "at least". (With the worker, the prediction itself stops there.)

What must fit is what the target device would hold (:func:`memfit.planner.predict.fits`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..estimate.compose import composes
from ..estimate.target import error_band, upper_edge
from ..optim.registry import get as optimizer_spec
from ..plan import Plan
from ..targets import DeviceProfile
from ..units import format_bytes
from ..workload import Workload
from .ahead import Ahead
from .candidates import (
    ALLOW,
    FORBID,
    allow_names,
    check_names,
    dominated,
    forbid_names,
    generate,
    maximal,
    options,
    trainable_fractions,
)
from .costing import cost_into, tied
from .explain import nothing_fits_message, why_it_won
from .predict import confirm, predict, probe, take
from .result import Candidate, NothingFits, PlanResult
from .worker import predict_shared, start_worker

__all__ = ["ALLOW", "FORBID", "Candidate", "NothingFits", "PlanResult", "plan", "search"]

def plan(
    workload: Workload | str,
    budget: int | str,
    *,
    batch_size: int | None = None,
    seq_len: int | None = None,
    allow: Iterable[str] = (),
    forbid: Iterable[str] = (),
    base: Plan | None = None,
    device: str | DeviceProfile | None = None,
    max_predictions: int = 60,
    progress: Callable[[str], None] | None = None,
    host_budget: int | str | None = None,
    disk_dir: str | None = None,
    jobs: int = 2,
    lora_rank: int = 16,
) -> PlanResult:
    """Find the fastest plan whose peak fits ``budget``.

    Args:
        workload: The workload at its full batch and sequence length, or a SPEC.
        budget: Bytes, a size string (``4GiB``) or a device name (``t4``).
        allow: Techniques that change training or use host memory, and need consent:
            ``freeze``, ``shorter-seq``, ``8bit``, ``factored``, ``bf16-pure``, ``fp8`` (targets
            of compute capability 8.9+), ``offload``.
        forbid: Default techniques to rule out: ``accumulation``, ``checkpointing``,
            ``full-checkpointing``, ``mixed-precision``, ``fused-step``, ``foreach-off``,
            ``fused-loss``.
        base: The user's plan to start from (its optimizer family and settings are kept).
        device: Device profile for the cost model (default: the budget's device if it names
            one, else the current device; ``cpu`` is measured here).
        max_predictions: Most memory predictions before giving the best found.
        progress: Called with a short message as the search advances.
        batch_size: With a SPEC: samples per optimizer step (default 8).
        seq_len: With a SPEC: tokens per sample (default 128).
        host_budget: Host memory the offload tiers may use (bytes or a size string; ``None``:
            not checked): a plan whose predicted host-tier peak exceeds it does not fit.
        disk_dir: With ``offload`` allowed, a directory for the ``disk`` tier: the search then
            includes the optimizer state on disk (which needs little host memory).
        jobs: Processes the search may use: with 2 (the default) and a second core, a
            forked worker shares the work (see the module docstring; same answer); 1: this
            process only.
        lora_rank: The rank of the LoRA adapters tried with ``lora`` or ``qlora`` allowed
            (the rank changes what is trained, so it is the user's, not searched).

    Returns:
        The :class:`PlanResult`.

    Raises:
        ValueError: for a malformed budget or an unknown allow/forbid value.
        NothingFits: when no allowed plan fits; ``.result`` holds the closest plan.
    """
    from ..targets import get_device, parse_budget

    started = time.perf_counter()
    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"--jobs must be a whole number >= 1, got {jobs!r}")
    if isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 1:
        raise ValueError(f"--lora-rank must be a whole number >= 1, got {lora_rank!r}")
    if isinstance(workload, str):
        from ..workload import load_workload

        workload = load_workload(workload, batch_size or 8, seq_len or 128)
    allow = check_names(allow, allow_names(), "--allow")
    forbid = check_names(forbid, forbid_names(), "--forbid")
    budget_bytes, budget_device = parse_budget(budget)
    host_bytes = None if host_budget is None else parse_budget(host_budget)[0]
    if disk_dir is not None:
        _check_disk_dir(disk_dir, allow)
    target = get_device(device) if device else (budget_device or get_device(None))
    base = _base_for(base or Plan(), target)
    planner = _Planner(workload, target, budget_bytes, host_bytes, progress or (lambda msg: None))
    # 1. Candidates.
    candidates, trainable = planner.candidates(base, allow, forbid, disk_dir, lora_rank)
    # 2. to 4. Costing, prediction and confirmation.
    candidates, winner, predicted = planner.run(
        candidates, base, trainable, jobs=jobs, max_predictions=max_predictions
    )
    for c in predicted:
        c.composed = None  # the shallow traces are not part of the answer
    predicted.sort(key=lambda c: c.step_time)
    seconds = time.perf_counter() - started
    if winner is None:
        raise planner.nothing_fits(predicted, candidates, allow, seconds)
    frontier = [winner.plan] + [c.plan for c in predicted if c.fits and c.plan != winner.plan]
    result = _result(winner, True, budget_bytes, predicted, frontier, target, seconds)
    # Faster candidates the tie rule put after the winner (candidates are in search order).
    after = candidates[[id(c) for c in candidates].index(id(winner)) + 1 :]
    ties = [c for c in after if c.step_time < winner.step_time and tied(c, winner)]
    result.explanation = why_it_won(winner, predicted, budget_bytes, target, ties)
    return result


def _check_disk_dir(disk_dir: str, allow: tuple[str, ...]) -> None:
    import os

    if "offload" not in allow:
        raise ValueError("--disk-dir is where offload puts state on disk: add --allow offload")
    if not os.path.isdir(disk_dir):
        raise ValueError(f"--disk-dir {disk_dir!r} is not an existing directory; create it first")


class _Planner:
    """One :func:`plan` call's search: its workload, target and budgets, the worker that
    shares the work (``ahead``), and each candidate's prediction, floor and confirmation."""

    def __init__(
        self,
        workload: Workload,
        target: DeviceProfile,
        budget_bytes: int,
        host_bytes: int | None,
        say: Callable[[str], None],
    ) -> None:
        self.workload, self.target, self.say = workload, target, say
        self.budget_bytes, self.host_bytes = budget_bytes, host_bytes
        self.frugal: set[int] = set()  # the most frugal candidates' ids
        self.ahead: Ahead | None = None
        self.lora_rank = 16  # the rank LoRA's candidates (and the QLoRA hint) take
        self.forbid: tuple[str, ...] = ()

    def candidates(
        self,
        base: Plan,
        allow: tuple[str, ...],
        forbid: tuple[str, ...],
        disk_dir: str | None,
        lora_rank: int = 16,
    ) -> tuple[list[Candidate], dict[tuple[str, ...], float] | None]:
        """Every candidate of the allowed space (not yet costed), and the share of parameters
        that trains under each freezing choice (``None``: no choice)."""
        workload, target = self.workload, self.target
        self.lora_rank, self.forbid = lora_rank, forbid
        space = options(
            workload, base, allow, forbid, target, disk_dir=disk_dir, lora_rank=lora_rank
        )
        trainable = None
        if len(space.freezes) > 1 or base.freeze:
            trainable = trainable_fractions(workload, space.freezes)
            usable = tuple(f for f in space.freezes if f in trainable or f == tuple(base.freeze))
            space = dataclasses.replace(space, freezes=usable)
        pairs = generate(workload, base, space, trainable, device=target)
        candidates = [Candidate(plan=p, rank=r, step_time=0.0) for p, r in pairs]
        # The most frugal candidates get their peak, never a floor: when nothing fits, the
        # answer quotes the closest one's.
        self.frugal = {id(candidates[i]) for i in maximal([c.rank for c in candidates])}
        return candidates, trainable

    def run(
        self,
        candidates: list[Candidate],
        base: Plan,
        trainable: dict[tuple[str, ...], float] | None,
        *,
        jobs: int,
        max_predictions: int,
    ) -> tuple[list[Candidate], Candidate | None, list[Candidate]]:
        """Cost the candidates, then predict and confirm them in search order (with the
        worker when ``jobs > 1``): the candidates in search order, the winner (``None``:
        nothing fits) and every candidate predicted."""
        from ..estimate.cost import has_profile, profile_workload

        workload = self.workload
        with contextlib.ExitStack() as stack:
            if jobs > 1:
                self.ahead = self._start_worker(candidates)
            ahead = self.ahead
            if ahead is not None:
                stack.enter_context(ahead)
                if not has_profile(workload):
                    ahead.run("profile")
                # Dry runs compute next to nothing: a second intra-op thread only spins, on
                # the core the worker runs on.
                stack.callback(torch.set_num_threads, torch.get_num_threads())
                torch.set_num_threads(1)
            # 2. Costing.
            self.say("profiling the workload (FLOPs, activations) on fake tensors")
            profile = profile_workload(
                workload, deeper=None if ahead is None else lambda: ahead.result("profile")
            )
            candidates = cost_into(
                candidates,
                profile,
                self.target,
                batch_size=workload.batch_size,
                baseline=Plan(optimizer=base.optimizer),
                trainable=trainable,
            )
            # 3. and 4. Prediction and confirmation, in search order.
            winner, predicted = search(
                candidates,
                self.predict,
                self.confirm,
                max_predictions=max_predictions,
                # With the worker, a prediction stops where a floor would: at the first
                # forward's end, the depth-2 and depth-3 runs' traces are a probe's, so none
                # comes first.
                probe=self.probe if ahead is None else None,
            )
        return candidates, winner, predicted

    def _start_worker(self, candidates: list[Candidate]) -> Ahead | None:
        """The forked worker (``None`` where none can be forked); forked before costing, it
        measures the deeper half of the cost profile while this process measures the other."""
        return start_worker(
            self.workload, self.target, self.budget_bytes, candidates, self.frugal
        )

    def predict(self, c: Candidate) -> bool:
        """Predict ``c``'s memory (see :func:`memfit.planner.predict.predict`), its depth-3
        run made by the worker meanwhile where there is one (see
        :func:`memfit.planner.worker.predict_shared`: the same prediction)."""
        self.say(f"predicting memory: {c.plan.summary()}")
        ahead = self.ahead
        floor = id(c) not in self.frugal
        if ahead is None or not composes(self.workload, c.plan):
            return predict(
                c, self.workload, self.target, self.budget_bytes, self.host_bytes, floor=floor
            )
        prediction = predict_shared(
            ahead, c, self.workload, self.target, self.budget_bytes if floor else None
        )
        return take(c, prediction, self.budget_bytes, self.host_bytes)

    def confirm(self, c: Candidate) -> bool:
        """Check ``c`` at full size (see :func:`memfit.planner.predict.confirm`)."""
        self.say(f"confirming at full size: {c.plan.summary()}")
        return confirm(c, self.workload, self.target, self.budget_bytes, self.host_bytes)

    def probe(self, c: Candidate) -> bool:
        """``c``'s floor (see :func:`memfit.planner.predict.probe`)."""
        self.say(f"checking the first forward: {c.plan.summary()}")
        return probe(c, self.workload, self.target, self.budget_bytes)

    def nothing_fits(
        self,
        predicted: list[Candidate],
        candidates: list[Candidate],
        allow: tuple[str, ...],
        seconds: float,
    ) -> NothingFits:
        """The answer when nothing fits: the closest candidate with a peak to quote, and why
        (``predicted`` gains a most frugal candidate when none was predicted in full)."""
        budget_bytes, host_bytes, target = self.budget_bytes, self.host_bytes, self.target
        # (A candidate ruled out by a floor has no peak to quote; the most frugal ones do.)
        full = [c for c in predicted if c.device_total_bytes is not None and not c.at_least]
        if not full:  # a most frugal candidate was skipped: an equal-ranked floor ruled it out
            seed = next(c for c in candidates if id(c) in self.frugal)
            predict(seed, self.workload, target, budget_bytes, host_bytes, floor=False)
            predicted.append(seed)
            full = [seed]
        closest = min(full, key=lambda c: c.device_total_bytes or 0)
        result = _result(closest, False, budget_bytes, predicted, [], target, seconds)
        message = nothing_fits_message(result, allow, target) + self._qlora_hint(closest, allow)
        held = [c for c in predicted if c.host_misfit]
        if held and host_bytes is not None:
            least = min(held, key=lambda c: c.host_bytes or 0)
            message += (
                f" {len(held)} plan(s) fit the device but not the host budget of "
                f"{format_bytes(host_bytes)}: the least needs {format_bytes(least.host_bytes or 0)} "
                f"of host memory ({least.plan.summary()}); raise --host-budget, or give "
                "--disk-dir for optimizer state on disk."
            )
        result.explanation = message
        return NothingFits(result, message)

    def _qlora_hint(self, closest: Candidate, allow: tuple[str, ...]) -> str:
        """When QLoRA was not allowed: whether the closest plan over a 4-bit base with
        adapters would fit (one or two more predictions: as it is, then in mixed precision,
        where the frozen base is stored in the half dtype), as a sentence naming ``qlora``."""
        if "qlora" in allow or closest.plan.lora is not None:
            return ""
        plans = [closest.plan]
        if closest.plan.precision.mode == "fp32" and "mixed-precision" not in self.forbid:
            mixed = "bf16-mixed" if self.target.supports_bf16 else "fp16-mixed"
            plans.append(closest.plan.replace(precision=mixed))
        for base in plans:
            try:
                plan = base.replace(lora=_qlora_config(self.lora_rank))
            except ValueError:
                continue  # this plan cannot take adapters (the Plan says why)
            trial = Candidate(plan=plan, rank=closest.rank, step_time=closest.step_time)
            self.say(f"trying QLoRA: {plan.summary()}")
            try:
                predict(trial, self.workload, self.target, self.budget_bytes, self.host_bytes,
                        floor=False)
            except (ImportError, ValueError):
                return ""  # peft/torchao missing, or no linear layer to adapt
            if trial.fits:
                total = trial.device_total_bytes or trial.peak_bytes or 0
                return (
                    f" It would fit with qlora (--allow qlora, low-rank adapters on a 4-bit "
                    f"base, which changes what is trained): {plan.summary()} is predicted at "
                    f"{format_bytes(total)}."
                )
        return ""


def _qlora_config(rank: int) -> Any:
    from ..strategies.lora import LoraConfig

    return LoraConfig(rank=rank, quantize_base="nf4", quantize_embeddings=True)


def search(
    candidates: Sequence[Candidate],
    predict: Callable[[Candidate], bool],
    confirm: Callable[[Candidate], bool],
    *,
    max_predictions: int = 60,
    probe: Callable[[Candidate], bool] | None = None,
) -> tuple[Candidate | None, list[Candidate]]:
    """The fastest candidate that fits, with as few memory predictions as dominance allows.

    Args:
        candidates: In search order (fastest first), each with its memory ``rank``.
        predict: Predicts a candidate's memory, fills its fields and says whether it fits.
        confirm: Checks a candidate predicted to fit at full size; says whether it fits.
        max_predictions: Most calls of ``predict``; then the fastest candidate predicted to
            fit so far is confirmed and returned.
        probe: Tried on each candidate before ``predict`` (on the most frugal ones, when
            their turn comes, before any of them is predicted): says (having filled its
            fields) when it proved the candidate does not fit, more cheaply than a
            prediction; ``False`` leaves it to ``predict``.

    Returns:
        The winner (``None`` when nothing fits) and every candidate predicted, in the order
        predicted.
    """
    return _Search(candidates, predict, confirm, probe).run(max_predictions)


class _Search:
    """:func:`search`'s state: the candidates predicted, the known misfits' ranks, and the
    seeds (the most frugal candidates), whose turn waits."""

    def __init__(
        self,
        candidates: Sequence[Candidate],
        predict: Callable[[Candidate], bool],
        confirm: Callable[[Candidate], bool],
        probe: Callable[[Candidate], bool] | None,
    ) -> None:
        self.candidates = candidates
        self.predict_fn, self.confirm_fn, self.probe_fn = predict, confirm, probe
        self.predicted: list[Candidate] = []
        self.misfits: list[tuple[int, ...]] = []
        # Every candidate is dominated by a most frugal one (a seed): if none of those fits,
        # none fits. But one of the first candidates in line usually fits, so the seeds wait:
        # their floors until SEED_FLOORS_AFTER candidates in line were ruled out by theirs,
        # their predictions until SEEDS_AFTER were predicted and misfit.
        self.seeds = [candidates[i] for i in maximal([c.rank for c in candidates])]
        self.seed_ids = {id(s) for s in self.seeds}
        self.line_misfits = 0  # candidates in line predicted in full that misfit...
        self.line_floors = 0  # ...and ruled out by their floors
        self.floors_taken = probe is None  # the seeds' floors
        self.seeds_tried = False  # the seeds' predictions

    def run(self, max_predictions: int) -> tuple[Candidate | None, list[Candidate]]:
        """The winner (``None`` when nothing fits) and every candidate predicted."""
        candidates, predicted = self.candidates, self.predicted
        i = 0
        while i < len(candidates):
            c = candidates[i]
            if c.fits is None:
                if dominated(c.rank, self.misfits):
                    i += 1
                    continue
                seeds_open = [] if self.seeds_tried else self._open_seeds()
                last_chance = max_predictions - len(predicted) <= len(seeds_open)
                if seeds_open and (self.line_misfits >= SEEDS_AFTER or last_chance):
                    if self._seeds_turn(seeds_open):
                        return None, predicted
                    continue
                if seeds_open and not self.floors_taken and self.line_floors >= SEED_FLOORS_AFTER:
                    if self._seed_floors(seeds_open):
                        return None, predicted
                    continue
                if len(predicted) >= max_predictions:
                    break
                if not self._predict(c, first_probe=id(c) not in self.seed_ids):
                    i += 1
                    continue
            if c.fits and self._confirm(c):
                return c, predicted
            i += 1
        # Out of predictions: the fastest predicted to fit (a seed fits, so there is one).
        for c in sorted(predicted, key=lambda c: c.step_time):
            if c.fits and self._confirm(c):
                return c, predicted
        return None, predicted

    def _seeds_turn(self, seeds_open: list[Candidate]) -> bool:
        """The seeds' turn, each seed's floor first unless all were taken: until one fits.
        Whether none does (then nothing does)."""
        self.seeds_tried = True
        probe_first, self.floors_taken = not self.floors_taken, True
        return (
            not any(self._predict(s, first_probe=probe_first) for s in seeds_open if s.fits is None)
            and self._seeds_rule_out_all()
        )

    def _seed_floors(self, seeds_open: list[Candidate]) -> bool:
        """Floors only (cheap): whether they all pass the budget (then nothing fits)."""
        self.floors_taken = True
        assert self.probe_fn is not None
        for s in seeds_open:
            if self.probe_fn(s):
                self._note(s)
        return all(s.fits is False for s in self.seeds) and self._seeds_rule_out_all()

    def _note(self, c: Candidate) -> bool:
        self.predicted.append(c)
        if not c.fits and (c.at_least or not c.host_misfit):
            self.misfits.append(c.rank)
        if not c.fits and id(c) not in self.seed_ids:
            if c.probed:
                self.line_floors += 1
            else:
                self.line_misfits += 1
        return bool(c.fits)

    def _predict(self, c: Candidate, first_probe: bool = False) -> bool:
        if not (first_probe and self.probe_fn is not None and self.probe_fn(c)):
            self.predict_fn(c)
        return self._note(c)

    def _confirm(self, c: Candidate) -> bool:
        if self.confirm_fn(c):
            return True
        if not c.host_misfit:
            self.misfits.append(c.rank)
        return False

    def _seeds_rule_out_all(self) -> bool:
        # (A seed that only misses the host budget proves nothing: a plan that offloads less
        # uses less host memory, so the search goes on.)
        return not any(s.fits or s.host_misfit for s in self.seeds)

    def _open_seeds(self) -> list[Candidate]:
        return [s for s in self.seeds if s.fits is None and not dominated(s.rank, self.misfits)]


#: Full predictions of candidates in line that misfit before the most frugal candidates are
#: predicted (their floors come first). Predicted first, the seeds cost a prediction on the way
#: to every answer, though one of the first candidates in line usually fits; predicted after
#: two misfits, they still end a search where nothing fits after a few predictions.
SEEDS_AFTER = 2

#: Candidates in line ruled out by their floors before the seeds' floors are taken: when the
#: model is far too large for the budget, every floor passes it, the seeds' too, and those end
#: the search.
SEED_FLOORS_AFTER = 4

def _base_for(base: Plan, target: DeviceProfile) -> Plan:
    """The base plan as it runs on ``target``: torch's foreach default made explicit.

    Raises:
        ValueError: for an fp8 base plan on a target without float8 matmuls (one sentence).
    """
    if base.precision.mode == "fp8":
        from ..strategies.fp8 import fp8_problem

        problem = fp8_problem(target)
        if problem is not None:
            raise ValueError(problem)
    if (
        target.name != "cpu"
        and base.optimizer.foreach is None
        and optimizer_spec(base.optimizer.name).foreach
    ):
        # On a GPU torch's optimizers default to foreach, which costs a parameter-sized
        # temporary at the step and runs faster: the cost model and the dry runs plan for it.
        return base.replace(optimizer=dataclasses.replace(base.optimizer, foreach=True))
    return base


def _result(
    chosen: Candidate,
    fits: bool,
    budget_bytes: int,
    predicted: list[Candidate],
    frontier: list[Plan],
    target: DeviceProfile,
    seconds: float,
) -> PlanResult:
    return PlanResult(
        fits=fits,
        plan=chosen.plan,
        budget_bytes=budget_bytes,
        predicted_peak_bytes=int(chosen.peak_bytes or 0),
        predicted_peak_by_category=dict(chosen.by_category or {}),
        predicted_step_time_ratio=chosen.ratio,
        candidates=predicted,
        frontier=frontier,
        explanation="",
        device=target.name,
        seconds=seconds,
        predicted_peak_reserved_bytes=int(chosen.reserved_bytes or 0),
        predicted_device_total_bytes=int(chosen.device_total_bytes or 0),
        predicted_host_bytes=int(chosen.host_bytes or 0),
        **_band(chosen, target),
    )


def _band(chosen: Candidate, target: DeviceProfile) -> dict[str, Any]:
    """The chosen prediction's upper device total and its figures' error band."""
    total = int(chosen.device_total_bytes or 0)
    reserved = int(chosen.reserved_bytes or 0)
    band = error_band(
        {
            "peak_allocated_bytes": int(chosen.peak_bytes or 0),
            "peak_reserved_bytes": reserved,
            "predicted_device_total_bytes": total,
        },
        target,
    )
    return {
        "predicted_device_total_upper_bytes": upper_edge(total, target.is_cuda),
        "error_band": {
            "predicted_peak_bytes": band["peak_allocated_bytes"],
            "predicted_peak_reserved_bytes": band["peak_reserved_bytes"],
            "predicted_device_total_bytes": band["predicted_device_total_bytes"],
        },
    }


