"""The 4-D planner: data x tensor x pipeline x context degrees for a per-rank budget.

``memfit plan --world-size N --gpus-per-node G`` searches every way to write ``N = data x
tensor x pipeline`` that the model's shapes allow, and with each layout the ZeRO stage, the
pipeline schedule and micro-batch count, and activation checkpointing. Tensor parallelism stays
within a node (its ranks are consecutive, ``tensor <= G``), so its per-layer all-reduces run at
the node's link bandwidth; data and pipeline groups run over the network once they span
nodes. Ranks are numbered as :mod:`memfit.distributed.layout` places them: ``rank = ((stage x
data + replica) x context + chunk) x tensor + shard``.

Context parallelism (``N = data x tensor x context``, one stage; ring attention) is searched
only when no layout without it fits: it cuts a sample's activations, which nothing else does
for a batch of one sample too long for a device, but each block's attention then exchanges
keys and values between ranks.

How a layout is priced: :mod:`memfit.estimate.layout_cost`. The fastest layout whose every
rank fits wins; the winner's every rank is then predicted by
dry runs of its own program in a fake process group when
:func:`memfit.estimate.layout.predict_layout` is available, else by the model above.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable
from typing import Any

from ..distributed.config import ParallelConfig
from ..estimate.layout_cost import (
    LayoutCandidate,
    ModelShape,
    _divisors,
    balanced_cuts,
    estimate_layout,
    layout_problems,
    model_shape,
)
from ..estimate.prediction import Prediction
from ..estimate.predictor import Layout, layout_prediction
from ..optim.registry import get as optimizer_spec
from ..plan import Plan
from ..units import format_bytes
from ..workload import Workload, load_workload
from .predict import fits
from .result import NothingFits, PlanResult

__all__ = ["layout_table", "plan_layout"]

# -------------------------------------------------------------------------------- planning
def _layouts(world: int, gpus_per_node: int,
             context: bool = False) -> Iterable[tuple[int, int, int, int]]:
    """``(data, tensor, pipeline, context)`` with tensor parallelism inside a node: context 1,
    or (``context``) every context degree above 1, with one stage."""
    for t in _divisors(min(world, gpus_per_node)):
        if world % t or gpus_per_node % t:
            continue
        if not context:
            for p in _divisors(world // t):
                yield world // (t * p), t, p, 1
            continue
        for c in _divisors(world // t)[1:]:
            yield world // (t * c), t, 1, c


def _fixed_layout(par: ParallelConfig, world: int, shape: ModelShape, batch_size: int,
                  gpus_per_node: int, seq_len: int) -> tuple[int, int, int, int]:
    """The one layout a plan's own tensor, pipeline and context degrees leave, or one
    sentence why they cannot run."""
    t, p, c = par.tensor, par.pipeline, par.context
    if par.data > 1 and par.world_size != world:
        raise ValueError(
            f"the plan's data {par.data} x tensor {t} x pipeline {p} x context {c} is "
            f"{par.world_size} processes but --world-size is {world}; give --world-size "
            f"{par.world_size} or degrees whose product is {world}"
        )
    if world % (t * p * c):
        raise ValueError(
            f"the plan's tensor {t} x pipeline {p} x context {c} is {t * p * c} processes per "
            f"replica, which does not divide --world-size {world}; use a world size that is a "
            f"multiple of {t * p * c}"
        )
    d = world // (t * p * c)
    trial = dataclasses.replace(par, data=d)
    problems = layout_problems(shape, trial, batch_size, gpus_per_node, seq_len=seq_len)
    if problems:
        raise ValueError(problems[0])
    return d, t, p, c


def _settings(d: int, t: int, p: int, c: int, batch_size: int, base: ParallelConfig,
              shape: ModelShape, gpus_per_node: int, seq_len: int,
              fixed: bool = False, accumulate: bool = True) -> Iterable[tuple[ParallelConfig, int]]:
    """Every valid setting of one layout, with its micro-batch count (the pipeline's, or
    gradient accumulation's with one stage). ``fixed``: the plan's own schedule and
    micro-batch count, when it gives them, are kept. ``accumulate``: with one stage, more
    than one micro-batch (gradient accumulation) may be used."""
    if batch_size % d:
        return
    # With a tensor or pipeline split, replicas shard through FSDP2 (stages 2 and 3) or
    # all-reduce (stage 0); ZeroRedundancyOptimizer is not composed with them.
    # Context ranks share the parameters as replicas do: ZeRO shards over data x context.
    stages = ((0, 1, 2, 3) if t == p == c == 1 else (0, 2, 3)) if d * c > 1 else (0,)
    # Expert parallelism (a mixture-of-experts model without a tensor split): every degree
    # that divides the experts and the replicas (layout_problems drops what cannot run).
    experts = [x for x in _divisors(d) if shape.experts % x == 0] \
        if shape.experts and t == c == 1 and base.expert == 1 else [base.expert]
    schedules: tuple[str, ...] = (
        ("1f1b", "interleaved-1f1b", "zero-bubble", "gpipe") if p > 1 else ("1f1b",)
    )
    counts = _divisors(batch_size // d) if accumulate or p > 1 else [1]
    if fixed and p > 1:
        schedules = (base.schedule,)
        if base.microbatches is not None:
            counts = [base.microbatches]
    for e, stage, schedule, m in itertools.product(experts, stages, schedules, counts):
        # The plan's sequence parallelism, where a tensor split can take it (any pipeline).
        par = dataclasses.replace(base, data=d, tensor=t, pipeline=p, context=c,
                                  zero_stage=stage, schedule=schedule if p > 1 else base.schedule,
                                  microbatches=m if p > 1 else None, expert=e,
                                  sequence=base.sequence and t > 1)
        if not layout_problems(shape, par, batch_size, gpus_per_node, seq_len=seq_len):
            yield par, m


def plan_layout(
    workload: Workload | str,
    budget: int | str,
    world_size: int,
    gpus_per_node: int | None = None,
    *,
    batch_size: int | None = None,
    seq_len: int | None = None,
    allow: Iterable[str] = (),
    forbid: Iterable[str] = (),
    base: Plan | None = None,
    device: Any = None,
    max_predictions: int = 60,
    progress: Callable[[str], None] | None = None,
    host_budget: int | str | None = None,
    disk_dir: str | None = None,
    jobs: int = 2,
    confirm: bool = True,
    expert_load: float = 1.0,
) -> PlanResult:
    """The fastest 3-D layout over ``world_size`` processes whose every rank fits ``budget``.

    Args:
        workload: The workload at its global batch, or a SPEC (a Hugging Face transformer).
        budget: Per-process budget (bytes, a size string or a device name).
        world_size: Processes in all.
        gpus_per_node: Devices per node (default: ``min(world_size, 8)``); tensor
            parallelism stays within one.
        batch_size: With a SPEC: the global batch (default 8).
        seq_len: With a SPEC: tokens per sample (default 128).
        allow: As :func:`memfit.planner.search.plan`'s, but a layout keeps the plan's
            precision and optimizer and offloads nothing, so no technique that needs consent
            is searched: any value is refused (``ValueError``) rather than ignored; give an
            optimizer or precision in ``base`` instead.
        forbid: Default techniques to rule out, as :func:`memfit.planner.search.plan`'s:
            ``checkpointing`` and ``full-checkpointing`` leave out the checkpointed settings,
            ``mixed-precision`` keeps an fp32 base in fp32, ``accumulation`` keeps one
            micro-batch per replica without a pipeline; the layout search never adds the
            others (``fused-step``, ``foreach-off``, ``fused-loss``).
        base: The user's plan: its precision and optimizer are kept (default: bf16-mixed
            where the device computes in bf16, and AdamW).
        device: The target device (its memory, speed and links).
        max_predictions: Most dry-run predictions: confirming the winner takes at most
            ``min(3, max_predictions)`` (0: the layout model's figures stand).
        progress: Called with a short message as the search advances.
        host_budget: Host memory the offload tiers may use: checked for form only, since a
            layout uses no host tier.
        disk_dir: Refused (``ValueError``): the disk tier is offload, which no layout uses.
        jobs: Processes the search may use (>= 1); the layout search prices layouts with a
            model, in this process.
        confirm: Predict the winner's every rank by dry runs of its own program
            (:func:`memfit.estimate.layout.predict_layout`) when that is available.
        expert_load: Mixture-of-experts routing each layout must fit: ``1`` balanced;
            ``c > 1``: expert 0 takes ``c`` times its share of every rank's tokens, so the
            rank holding it receives that many more (its peak is the one that must fit).

    Raises:
        TypeError: for a keyword this function does not take.
        ValueError: for a world size or node size that is not a whole number >= 1, or a node
            size that does not divide the world; for an ``allow`` value or a ``disk_dir``
            (see above), an unknown ``forbid`` value or a malformed ``host_budget``.
        WorkloadError: for a model the planner cannot split.
        NothingFits: when no layout fits; ``.result`` holds the closest.
    """
    from ..targets import get_device, parse_budget

    started = time.perf_counter()
    _check_whole_numbers(("--world-size", world_size), ("--gpus-per-node", gpus_per_node))
    forbid = _check_search_options(allow, forbid, host_budget, disk_dir, jobs)
    if not isinstance(max_predictions, int) or isinstance(max_predictions, bool) or max_predictions < 0:
        raise ValueError(f"max_predictions must be a whole number >= 0, got {max_predictions!r}")
    g = gpus_per_node if gpus_per_node is not None else min(world_size, 8)
    if world_size % g and world_size > g:
        raise ValueError(
            f"--gpus-per-node {g} does not divide --world-size {world_size}; nodes hold the "
            f"same number of devices, so use a world size that is a multiple of {g}"
        )
    if isinstance(workload, str):
        workload = load_workload(workload, batch_size or 8, seq_len or 128)
    budget_bytes, budget_device = parse_budget(budget)
    target = get_device(device) if device else (budget_device or get_device(None))
    if not isinstance(expert_load, (int, float)) or isinstance(expert_load, bool) or not (
            1 <= expert_load < float("inf")):
        raise ValueError(f"--expert-load must be a number >= 1 (1: balanced), got "
                         f"{expert_load!r}")
    base, precision = _base_plan(base, target, forbid)
    search = _LayoutSearch(workload, world_size, g, base, precision, target, budget_bytes,
                           forbid, progress or (lambda msg: None), float(expert_load))
    result = search.run(confirm=confirm, max_predictions=max_predictions)
    result.seconds = time.perf_counter() - started
    return result


def _check_whole_numbers(*named: tuple[str, int | None]) -> None:
    for name, value in named:
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 1):
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")


def _base_plan(base: Plan | None, target: Any, forbid: tuple[str, ...]) -> tuple[Plan, str]:
    """The user's plan as it runs on ``target``, in bf16-mixed where an fp32 plan may change
    precision on a GPU with bf16; and that precision."""
    from ..estimate.dryrun import plan_for_target

    base = base or Plan()
    precision = base.precision.mode
    if (precision == "fp32" and target.is_cuda and target.supports_bf16
            and "mixed-precision" not in forbid):
        precision = "bf16-mixed"  # what every multi-GPU recipe trains in
    return plan_for_target(base.replace(precision=precision), target), precision


@dataclasses.dataclass
class _LayoutSearch:
    """One :func:`plan_layout` search, its arguments checked: every layout's settings
    priced, the fastest that fits chosen (and confirmed by dry runs where they apply)."""

    workload: Workload
    world_size: int
    g: int  # devices per node
    base: Plan  # the user's plan, as it runs on the target, in ``precision``
    precision: str
    target: Any
    budget_bytes: int
    forbid: tuple[str, ...]
    say: Callable[[str], None]
    expert_load: float = 1.0

    def run(self, *, confirm: bool, max_predictions: int) -> PlanResult:
        """The winner's :class:`PlanResult` (without ``seconds``).

        Raises:
            NothingFits: when no layout fits; ``.result`` holds the closest.
        """
        self.say("reading the model's shapes")
        candidates = self._price(model_shape(self.workload))
        # Equal times go to the lower ZeRO stage (it moves no more data), then the smaller peak.
        candidates.sort(key=lambda c: (round(c.step_seconds, 12), c.parallel.zero_stage,
                                       c.max_peak_bytes))
        fitting = [c for c in candidates if c.fits]
        if not fitting:
            closest = min(candidates, key=lambda c: c.max_peak_bytes)
            raise NothingFits(
                self._result(closest, candidates, fits=False, explanation=""),
                f"no layout of {self.world_size} processes fits "
                f"{format_bytes(self.budget_bytes)} per process; the closest "
                f"({closest.describe()}) needs {format_bytes(closest.max_peak_bytes)} on its "
                "largest rank. Use more processes, a smaller batch or sequence length, or a "
                "device with more memory.",
            )
        best = fitting[0]
        confirmed = None
        if confirm:
            for cand in fitting[:min(3, max_predictions)]:
                plan = self._result(cand, candidates, fits=True, explanation="").plan
                pred = _confirm(self.workload, plan, self.target, self.say, self.g)
                if pred is None:
                    break
                if fits(pred, self.budget_bytes):
                    best, confirmed = cand, pred.ranks
                    break
        runner_up = next((c for c in fitting if _layout_key(c) != _layout_key(best)), None)
        why = _explain(best, runner_up, self.world_size, self.g, confirmed is not None)
        result = self._result(best, candidates, fits=True, explanation=why)
        if confirmed is not None:
            result.rank_peak_bytes = list(confirmed)
            result.predicted_peak_bytes = max(confirmed)
        return result

    def _price(self, shape: ModelShape) -> list[LayoutCandidate]:
        """Every setting of every layout the world allows (or of the plan's own), priced;
        the context-parallel layouts only when none without context parallelism fits."""
        workload, base, g = self.workload, self.base, self.g
        fixed = base.parallel if base.parallel.splits_model else None
        if fixed is not None:
            mine = [_fixed_layout(fixed, self.world_size, shape, workload.batch_size, g,
                                  workload.seq_len)]
            candidates = self._price_layouts(shape, mine, fixed=True)
            if not any(c.fits for c in candidates) and not fixed.partition_activations:
                candidates += self._price_layouts(shape, mine, fixed=True, partition=True)
            return candidates
        refused: ValueError | None = None
        plain = list(_layouts(self.world_size, g))
        try:
            candidates = self._price_layouts(shape, plain, fixed=False)
        except ValueError as e:  # none can split it: context parallelism still might
            candidates, refused = [], e
        context: list[tuple[int, int, int, int]] = []
        if not any(c.fits for c in candidates):
            # A sample whose activations do not fit is cut along its sequence first: context
            # parallelism keeps every rank's checkpoints whole.
            self.say("no layout fits; trying context parallelism (each sample's sequence cut "
                     "over ranks)")
            try:
                context = list(_layouts(self.world_size, g, context=True))
                candidates += self._price_layouts(shape, context, fixed=False)
            except ValueError:
                context = []
        if not any(c.fits for c in candidates):
            # ZeRO-R's partitioned checkpoints cost an all-gather per block in backward: the
            # last resort, where nothing fits with whole checkpoints.
            self.say("no layout fits; trying partitioned checkpoints (ZeRO-R)")
            candidates += self._price_layouts(shape, plain, fixed=False, partition=True)
            if context:
                candidates += self._price_layouts(shape, context, fixed=False, partition=True)
        if not candidates and refused is not None:
            raise refused
        return candidates

    def _price_layouts(self, shape: ModelShape, layouts: list[tuple[int, int, int, int]], *,
                       fixed: bool, partition: bool = False) -> list[LayoutCandidate]:
        """Every setting of ``layouts`` priced, with and without checkpointing; with
        ``partition`` only the checkpointed tensor-parallel ones, their checkpoints
        partitioned (none is no error then)."""
        workload, base, g = self.workload, self.base, self.g
        # A layout's checkpointing is full or none: forbidding either kind leaves none.
        forbid = set(self.forbid)
        ckpts = (False,) if {"checkpointing", "full-checkpointing"} & forbid else (False, True)
        candidates: list[LayoutCandidate] = []
        refused: list[str] = []
        for d, t, p, c in layouts:
            settings = list(_settings(d, t, p, c, workload.batch_size, base.parallel, shape, g,
                                      workload.seq_len, fixed=fixed,
                                      accumulate="accumulation" not in forbid))
            name = f"data {d} x tensor {t} x pipeline {p}" + (f" x context {c}" if c > 1 else "")
            if not settings:
                trial = dataclasses.replace(base.parallel, data=d, tensor=t, pipeline=p,
                                            context=c, microbatches=2 * p if p > 1 else None)
                problems = layout_problems(shape, trial, workload.batch_size, g,
                                           seq_len=workload.seq_len)
                refused.append(f"{name}: " + (problems[0] if problems else "no setting works"))
                continue
            self.say(f"pricing {name}")
            for setting, m in settings:
                for ckpt in ckpts:
                    for par in _partitioned(setting, ckpt, partition):
                        priced = [estimate_layout(
                            shape, cut, batch_size=workload.batch_size,
                            seq_len=workload.seq_len, checkpointing=ckpt, device=self.target,
                            precision=self.precision, optimizer=base.optimizer,
                            gpus_per_node=g, microbatches=m, expert_load=self.expert_load,
                        ) for cut in self._cuts(shape, par, ckpt)]
                        for cand in _weigh_cuts(priced):
                            cand.fits = fits(layout_prediction(cand, self.target, g),
                                             self.budget_bytes)
                            candidates.append(cand)
        if not candidates and not partition:
            raise ValueError(
                f"no layout of {self.world_size} processes can split {workload.name} at a "
                f"batch of {workload.batch_size}: " + "; ".join(refused[:3])
            )
        return candidates

    def _cuts(self, shape: ModelShape, par: ParallelConfig, ckpt: bool) -> list[ParallelConfig]:
        """``par`` with each pipeline split the search weighs (:func:`~memfit.estimate.
        layout_cost.balanced_cuts`: the most even peaks, and the fastest split with its
        stages' peaks as even as that allows); the plan's own cuts when it gives them, and
        ``par`` alone without a pipeline."""
        if par.pipeline == 1 or par.cuts:
            return [par]
        options = balanced_cuts(
            shape, par, batch_size=self.workload.batch_size, seq_len=self.workload.seq_len,
            checkpointing=ckpt, device=self.target, precision=self.precision,
            optimizer=self.base.optimizer)
        # The memory-balanced split first: _weigh_cuts keeps it unless the other is faster.
        splits = dict.fromkeys((options["memory"], options["time"]))
        return [dataclasses.replace(par, cuts=c) for c in splits]

    def _result(self, cand: LayoutCandidate, candidates: list[LayoutCandidate], *,
                fits: bool, explanation: str) -> PlanResult:
        return _result(cand, fits=fits, explanation=explanation, workload=self.workload,
                       base=self.base, budget=self.budget_bytes, target=self.target,
                       candidates=candidates, gpus_per_node=self.g)


#: A split that evens the stages' peaks is kept in place of the fastest split when it is
#: slower by no more than this share of the step: below the cost model's resolution, and every
#: rank gains headroom (the largest rank's peak falls, the others' rise towards it).
EVEN_PEAKS_TOLERANCE = 0.03


def _partitioned(par: ParallelConfig, ckpt: bool, partition: bool) -> list[ParallelConfig]:
    """The setting to price: with ``partition``, its ZeRO-R partitioned-checkpoint variant
    where that applies (checkpointed, tensor > 1, no sequence parallelism) and nothing
    otherwise; without, the setting itself. The plan's own ``partition_activations`` is kept
    where it applies, and dropped where it does not."""
    applies = ckpt and par.tensor > 1 and not par.sequence
    if not applies:
        plain = dataclasses.replace(par, partition_activations=False, partition_offload=False)
        return [] if partition else [plain]
    if par.partition_activations:
        return [] if partition else [par]
    return [dataclasses.replace(par, partition_activations=True)] if partition else [par]


def _weigh_cuts(priced: list[LayoutCandidate]) -> list[LayoutCandidate]:
    """The pipeline splits of one setting worth searching: the memory-balanced one (first)
    alone when the fastest gains no more than :data:`EVEN_PEAKS_TOLERANCE` of the step
    over it, else both (the search takes the faster where it fits)."""
    if len(priced) < 2:
        return priced
    even, fast = priced[0], min(priced, key=lambda c: c.step_seconds)
    if even.step_seconds <= fast.step_seconds * (1 + EVEN_PEAKS_TOLERANCE):
        return [even]
    return priced


def _check_search_options(allow: Iterable[str], forbid: Iterable[str],
                          host_budget: int | str | None, disk_dir: str | None,
                          jobs: int) -> tuple[str, ...]:
    """The forbidden names, once the search's other options are known to be honoured here;
    one sentence (``ValueError``) for an option the layout search cannot honour."""
    from ..targets import parse_budget
    from .candidates import allow_names, check_names, forbid_names

    if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1:
        raise ValueError(f"--jobs must be a whole number >= 1, got {jobs!r}")
    allowed = check_names(allow, allow_names(), "--allow")
    forbidden = check_names(forbid, forbid_names(), "--forbid")
    if allowed:
        # A layout is priced by a model of its ranks in the plan's precision and optimizer,
        # without host or disk tiers: an allowed technique would be silently unused.
        raise ValueError(
            f"--allow {','.join(allowed)} is not searched with --gpus-per-node (the layout "
            "planner keeps the plan's precision and optimizer and offloads nothing); leave "
            "out --gpus-per-node to plan data parallelism with it, or give the optimizer or "
            "precision in --plan"
        )
    if disk_dir is not None:
        raise ValueError(
            "--disk-dir is where offload puts state on disk, and the layout planner "
            "(--gpus-per-node) offloads nothing; leave out one or the other"
        )
    if host_budget is not None:
        parse_budget(host_budget)  # a malformed size is refused; no layout uses host memory
    return forbidden


def _layout_key(c: LayoutCandidate) -> tuple[int, int, int, int]:
    return c.parallel.data, c.parallel.tensor, c.parallel.pipeline, c.parallel.context


def _confirm(workload: Workload, plan: Plan, target: Any,
             say: Callable[[str], None], gpus_per_node: int = 8) -> Prediction | None:
    """Each rank's peak from dry runs of its own program in a fake process group
    (:class:`memfit.estimate.predictor.Layout`), for what those dry runs model: a
    tensor or pipeline split in fp32, without checkpointing, with an optimizer the layout path
    trains with (the registry's ``layout`` ones: torch's AdamW, Adam, SGD), replicas
    all-reducing (stage 0). ``None`` otherwise (the layout model's figures stand)."""

    par = plan.parallel
    if (
        not par.splits_model
        or par.zero_stage != 0
        or plan.precision.mode != "fp32"
        or plan.checkpointing.mode != "none"
        or not optimizer_spec(plan.optimizer.name).layout
    ):
        return None
    say(f"predicting every rank of {plan.summary()}")
    try:
        return Layout(gpus_per_node).predict(workload, plan, target)
    except ValueError:
        return None


def _result(cand: LayoutCandidate, *, fits: bool, explanation: str, workload: Workload,
            base: Plan, budget: int, target: Any, candidates: list[LayoutCandidate],
            gpus_per_node: int = 8) -> PlanResult:
    from ..estimate.nccl import nccl_rank_bytes
    from ..strategies.checkpointing import CheckpointConfig

    changes: dict[str, Any] = {
        "parallel": cand.parallel,
        "checkpointing": CheckpointConfig("full") if cand.checkpointing else base.checkpointing,
    }
    if cand.parallel.pipeline == 1 and cand.microbatches > 1:
        local = workload.batch_size // cand.parallel.data
        changes.update(micro_batch_size=local // cand.microbatches,
                       grad_accum_steps=cand.microbatches)
    plan = base.replace(**changes)
    # The ideal: the same work spread perfectly, no bubble, no communication, no recompute.
    ideal = cand.parts["compute"] / (4 / 3 if cand.checkpointing else 1)
    result = PlanResult(
        fits=fits,
        plan=plan,
        budget_bytes=budget,
        predicted_peak_bytes=cand.max_peak_bytes,
        predicted_peak_by_category=dict(cand.by_category),
        predicted_step_time_ratio=cand.step_seconds / ideal if ideal else 1.0,
        candidates=[],
        frontier=[],
        explanation=explanation,
        device=target.name,
        rank_peak_bytes=list(cand.rank_peak_bytes),
        layout={
            "step_seconds": cand.step_seconds,
            "parts_seconds": dict(cand.parts),
            "stage_busy_seconds": list(cand.stage_busy_seconds),
            "checkpointing": cand.checkpointing,
            "microbatches": cand.microbatches,
            # Each rank's NCCL communicators, counted in its fit (0 on the CPU).
            "nccl_bytes": nccl_rank_bytes(cand.parallel, target, gpus_per_node=gpus_per_node),
            "alternatives": _alternatives(cand, candidates),
        },
    )
    result.layout_candidate = cand  # type: ignore[attr-defined]
    result.layouts = candidates  # type: ignore[attr-defined]
    return result


def _alternatives(chosen: LayoutCandidate, candidates: list[LayoutCandidate],
                  n: int = 3) -> list[dict[str, Any]]:
    """The fastest fitting setting of the next ``n`` layouts (``candidates`` sorted fastest
    first)."""
    seen, out = {_layout_key(chosen)}, []
    for c in candidates:
        if c.fits and _layout_key(c) not in seen:
            seen.add(_layout_key(c))
            out.append({"layout": c.describe(), "step_seconds": c.step_seconds,
                        "largest_rank_bytes": c.max_peak_bytes})
            if len(out) == n:
                break
    return out


def _explain(best: LayoutCandidate, other: LayoutCandidate | None, world: int, g: int,
             confirmed: bool) -> str:
    parts = ", ".join(f"{k} {v:.3g} s" for k, v in best.parts.items() if v > 0)
    text = (
        f"{best.describe()} on {world} processes ({g} per node): predicted "
        f"{best.step_seconds:.3g} s per step ({parts}); largest rank "
        f"{format_bytes(best.max_peak_bytes)}"
        + (" (every rank dry-run in its own program)" if confirmed else "")
        + "."
    )
    if other is not None:
        slower = other.step_seconds / best.step_seconds
        text += (
            f" The next best layout, {other.describe()}, is {slower:.2f}x slower"
            + _why_slower(best, other)
            + "."
        )
    return text


def _why_slower(best: LayoutCandidate, other: LayoutCandidate) -> str:
    diffs = {k: other.parts[k] - best.parts.get(k, 0.0) for k in other.parts}
    key = max(diffs, key=lambda k: diffs[k])
    if diffs[key] <= 0:
        return ""
    what = {"compute": "more compute per rank (recomputation or a smaller share of the work)",
            "bubble": "a larger pipeline bubble", "tensor": "more tensor-parallel all-reduces",
            "pipeline": "more point-to-point traffic between stages",
            "data": "more gradient traffic across replicas",
            "context": "more key and value traffic between context ranks",
            "expert": "more all-to-all traffic between expert ranks"}[key]
    return f": {what}, {diffs[key]:.3g} s more per step"


def layout_table(result: PlanResult, limit: int = 12) -> Any:
    """A rich renderable: the best setting of each layout, its step time and largest rank."""
    from rich.console import Group
    from rich.table import Table

    layouts: list[LayoutCandidate] = getattr(result, "layouts", [])
    chosen: LayoutCandidate | None = getattr(result, "layout_candidate", None)
    table = Table(
        title=f"Layouts weighed against {format_bytes(result.budget_bytes)} per process "
        f"(cost model: {result.device})",
        title_justify="left",
    )
    for name, justify in (("data x tensor x pipeline x context", "left"), ("settings", "left"),
                          ("step", "right"), ("largest rank", "right"), ("fits", "center")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    best_of: dict[tuple[int, int, int, int], LayoutCandidate] = {}
    for c in layouts:  # fastest first: the first fitting one of each layout, else its smallest
        key = _layout_key(c)
        held = best_of.get(key)
        if held is None or (c.fits and not held.fits) or (
            not held.fits and not c.fits and c.max_peak_bytes < held.max_peak_bytes
        ):
            best_of[key] = c
    rows = sorted(best_of.values(), key=lambda c: (not c.fits, c.step_seconds))
    for c in rows[:limit]:
        won = chosen is not None and _layout_key(c) == _layout_key(chosen)
        table.add_row(
            ("★ " if won else "") + " x ".join(map(str, _layout_key(c))),
            c.settings(),
            f"{c.step_seconds * 1e3:.1f} ms",
            format_bytes(c.max_peak_bytes),
            "yes" if c.fits else "no",
            style="bold green" if won else None,
        )
    notes: list[Any] = [table]
    if len(rows) > limit:
        notes.append(f"(+{len(rows) - limit} more layouts)")
    verdict = "Winner" if result.fits else "Closest"
    notes.append(f"{verdict}: {result.plan.summary()}: {result.explanation}")
    return Group(*notes)

