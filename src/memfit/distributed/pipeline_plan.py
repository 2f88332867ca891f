"""Pipeline settings and their theory: :class:`PipelineConfig`, in-flight micro-batches by
schedule, and the choice of cut points.

Nothing here runs a model or needs a process group: the planner validates, predicts and
balances with it; :mod:`memfit.distributed.pipeline` builds and runs the stages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import MemfitError
from .config import PIPEDREAM_SCHEDULES, PIPELINE_SCHEDULES

#: Schedules that place one stage on each rank.
ONE_STAGE = ("gpipe", "1f1b", *PIPEDREAM_SCHEDULES)

__all__ = [
    "BlockCost",
    "PipelineConfig",
    "PipelineError",
    "check_pipeline",
    "choose_cuts",
    "even_cuts",
    "microbatches_in_flight",
    "predict_stage_activations",
]

class PipelineError(MemfitError, ValueError):
    """A pipeline setting that cannot work; the message says what would."""


@dataclass(frozen=True)
class PipelineConfig:
    """How the blocks are cut into stages and how micro-batches flow through them.

    Attributes:
        degree: Processes in the pipeline (>= 2), each holding ``stages_per_rank`` stages.
            Memory per rank: its stages' parameters, gradients and optimizer state (about
            ``1/degree`` of the model's) plus the activations of its in-flight micro-batches.
            Time: each step idles a bubble, ``bubble_fraction`` of it.
        schedule: The order of forwards and backwards. ``gpipe``: all forwards, then all
            backwards; every rank keeps all ``microbatches`` micro-batches' activations at once.
            ``1f1b``: after a warm-up of ``degree - r`` forwards, rank ``r`` alternates one
            backward and one forward, so it keeps at most ``degree - r`` micro-batches (same
            bubble as GPipe, far less memory). ``interleaved-1f1b``: ``stages_per_rank``
            smaller stages per rank in a loop (rank ``r`` holds stages ``r, r + degree, ...``):
            the bubble shrinks ``stages_per_rank`` times for more activations in flight and
            more point-to-point messages. ``zero-bubble``: torch's ZB-V, two stages per rank
            in a V (rank ``r`` holds ``r`` and ``2 degree - 1 - r``), backward split into the
            input-gradient and the weight-gradient part, the latter filling the bubble; each
            rank keeps at most ``degree`` micro-batches' activations, like 1F1B's first rank.
        microbatches: Micro-batches per step (``None``: ``2 x degree``). The batch splits into
            this many equal parts; more shrinks the bubble (``(p - 1) / (m + p - 1)``) and each
            micro-batch's activations, but GPipe keeps all of them. 1F1B needs at least
            ``degree``; interleaved 1F1B a multiple of ``degree``; zero-bubble at least
            ``degree``.
        cuts: The first block of each stage after the first, ``num_stages - 1`` strictly
            increasing block indices (``(2,)`` splits four blocks 2 + 2). ``None``: an even
            split by block count; memfit's planner passes balanced cuts
            (:func:`choose_cuts` on dry-run profiles, :mod:`memfit.estimate.pipeline`).
        stages_per_rank: Stages each rank holds (``None``: 1 for ``gpipe`` and ``1f1b``, 2
            for ``interleaved-1f1b`` and ``zero-bubble``; zero-bubble needs exactly 2).
        vertical_sync: PipeDream schedules: every stage uses stage 0's weight version for a
            micro-batch (:mod:`memfit.distributed.pipedream`).
    """

    degree: int
    schedule: str = "1f1b"
    microbatches: int | None = None
    cuts: tuple[int, ...] | None = None
    stages_per_rank: int | None = None
    vertical_sync: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.cuts, list):
            object.__setattr__(self, "cuts", tuple(self.cuts))

    # ------------------------------------------------------------------ derived
    @property
    def num_microbatches(self) -> int:
        """Micro-batches per step, the default (``2 x degree``) resolved."""
        return self.microbatches if self.microbatches is not None else 2 * self.degree

    @property
    def local_stages(self) -> int:
        """Stages per rank, the default resolved."""
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return 2 if self.schedule in ("interleaved-1f1b", "zero-bubble") else 1

    @property
    def num_stages(self) -> int:
        """Stages in all: ``degree x stages_per_rank``."""
        return self.degree * self.local_stages

    @property
    def bubble_fraction(self) -> float:
        """Share of a step each rank idles, with stages of equal time: ``(p - 1) / (m + p -
        1)`` for GPipe and 1F1B, ``(p - 1) / (v m + p - 1)`` interleaved over ``v`` stages per
        rank. For zero-bubble this is the interleaved figure for ``v = 2``, an upper bound:
        its weight-gradient work fills the bubble, entirely when forward, input-backward and
        weight-backward take equal time."""
        p, m = self.degree, self.num_microbatches
        v = 1 if self.schedule in ONE_STAGE else self.local_stages
        return (p - 1) / (v * m + p - 1)

    def stage_indices(self, rank: int) -> tuple[int, ...]:
        """The stages ``rank`` holds: a loop (``r, r + p, ...``) or, for zero-bubble, a V
        (``r, 2p - 1 - r``), as torch's schedules place them."""
        p = self.degree
        if self.schedule == "zero-bubble":
            return (rank, 2 * p - 1 - rank)
        return tuple(rank + k * p for k in range(self.local_stages))

    def rank_of_stage(self, stage: int) -> int:
        """The rank holding ``stage``."""
        p = self.degree
        if self.schedule == "zero-bubble":
            return stage if stage < p else 2 * p - 1 - stage
        return stage % p

    def resolved_cuts(self, num_blocks: int) -> tuple[int, ...]:
        """``cuts``, or the even split of ``num_blocks`` blocks when none were given."""
        return self.cuts if self.cuts is not None else even_cuts(num_blocks, self.num_stages)

    def stage_blocks(self, num_blocks: int, stage: int) -> range:
        """The block indices ``stage`` holds."""
        bounds = (0, *self.resolved_cuts(num_blocks), num_blocks)
        return range(bounds[stage], bounds[stage + 1])

    # ------------------------------------------------------------------ validation
    def problems(self, num_blocks: int | None = None) -> list[str]:
        """What is wrong with these settings, one sentence each naming what would work
        (empty when valid). With ``num_blocks``, the cuts and the stage count are checked
        against the model's blocks too."""
        out: list[str] = []
        p = self.degree
        if not _whole(p) or p < 2:
            return [f"pipeline degree must be a whole number >= 2 (the processes in the "
                    f"pipeline), got {p!r}"]
        if self.schedule not in PIPELINE_SCHEDULES:
            return [f"pipeline schedule {self.schedule!r} is not known; use one of "
                    f"{', '.join(PIPELINE_SCHEDULES)}"]
        v = self.stages_per_rank
        if v is not None and (not _whole(v) or v < 1):
            return [f"pipeline stages_per_rank must be a whole number >= 1 or null, got {v!r}"]
        v = self.local_stages
        if self.schedule in ONE_STAGE and v != 1:
            out.append(f"the {self.schedule} schedule runs one stage per rank, got "
                       f"stages_per_rank={v}; use interleaved-1f1b for several")
        if self.schedule == "interleaved-1f1b" and v < 2:
            out.append("interleaved-1f1b needs stages_per_rank >= 2 (one stage per rank is "
                       "plain 1f1b)")
        if self.schedule == "zero-bubble" and v != 2:
            out.append(f"zero-bubble (ZB-V) places exactly 2 stages per rank, got "
                       f"stages_per_rank={v}; leave it unset or use 2")
        m = self.microbatches
        if m is not None and (not _whole(m) or m < 1):
            out.append(f"pipeline microbatches must be a whole number >= 1 or null, got {m!r}")
            m = None
        m = self.num_microbatches if m is None else m
        if self.schedule in ("1f1b", "zero-bubble", *PIPEDREAM_SCHEDULES) and m < p:
            out.append(f"the {self.schedule} schedule needs at least as many micro-batches as "
                       f"the pipeline degree ({p}), got {m}; use microbatches >= {p}"
                       + (" or the gpipe schedule" if self.schedule == "1f1b" else ""))
        if self.schedule == "interleaved-1f1b" and (m < p or m % p):
            near = sorted({max(p, m // p * p), max(p, -(-m // p) * p)})
            out.append(f"interleaved-1f1b needs the micro-batch count to be a multiple of the "
                       f"pipeline degree ({p}), got {m}; use microbatches "
                       f"{' or '.join(map(str, near))}")
        if num_blocks is not None and not out:
            out.extend(self._block_problems(num_blocks))
        return out

    def _block_problems(self, num_blocks: int) -> list[str]:
        s, p, v = self.num_stages, self.degree, self.local_stages
        if num_blocks < s:
            fits = num_blocks // v
            hint = (f"use degree <= {fits}" if fits >= 2 else "use fewer stages")
            return [f"{num_blocks} blocks cannot fill {s} pipeline stages ({p} ranks x {v} "
                    f"stages each) without an empty stage; {hint} or a deeper model"]
        if self.cuts is None:
            return []
        cuts = self.cuts
        ok = (
            len(cuts) == s - 1
            and all(_whole(c) for c in cuts)
            and all(a < b for a, b in zip((0, *cuts), (*cuts, num_blocks), strict=True))
        )
        if ok:
            return []
        return [f"pipeline cuts {cuts!r} must be {s - 1} strictly increasing block indices "
                f"between 1 and {num_blocks - 1} (the first block of each stage after the "
                f"first, no stage empty), e.g. {even_cuts(num_blocks, s)!r}"]


def check_pipeline(num_blocks: int, config: PipelineConfig) -> None:
    """Raise :class:`PipelineError` when ``config`` cannot pipeline ``num_blocks`` blocks.

    Raises:
        PipelineError: naming each problem and what would work instead.
    """
    problems = config.problems(num_blocks)
    if problems:
        raise PipelineError("; ".join(problems))


def _whole(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def even_cuts(num_blocks: int, num_stages: int) -> tuple[int, ...]:
    """Cuts that give every stage ``num_blocks / num_stages`` blocks, the remainder spread
    one each over the middle stages (the first holds the embeddings, the last the head;
    between two equally central stages, the earlier)."""
    base, extra = divmod(num_blocks, num_stages)
    # The remainder goes to the stages nearest the middle, which hold neither end's extras.
    order = sorted(range(num_stages), key=lambda s: (abs(2 * s - (num_stages - 1)), s))
    sizes = [base + (1 if s in order[:extra] else 0) for s in range(num_stages)]
    cuts, at = [], 0
    for size in sizes[:-1]:
        at += size
        cuts.append(at)
    return tuple(cuts)


# ---------------------------------------------------------------------------- theory
def microbatches_in_flight(schedule: str, degree: int, microbatches: int, rank: int,
                           stages_per_rank: int | None = None) -> int:
    """The most micro-batches whose activations ``rank`` keeps at once (forward run, backward
    not yet), counted per stage chunk when a rank holds several stages.

    * GPipe: ``m`` (all forwards run before the first backward);
    * 1F1B, and the PipeDream schedules (1F1B order): ``min(m, p - r)`` (rank ``r`` warms
      up with ``p - r`` forwards);
    * interleaved 1F1B over ``v`` chunks: ``min(v m, 2 (p - r - 1) + (v - 1) p + 1)`` chunk
      micro-batches (Megatron's warm-up);
    * zero-bubble (ZB-V, two chunks): ``min(2 p, m + r + 1)`` chunk micro-batches, counted
      until each one's input-gradient backward (its weight-gradient backward follows at once
      in ZB-V's order).

    These are exactly the counts in torch's schedule orders (``pipeline_order``), which the
    tests check.
    """
    p, m, r = degree, microbatches, rank
    if schedule == "gpipe":
        return m
    if schedule in ("1f1b", *PIPEDREAM_SCHEDULES):
        return min(m, p - r)
    if schedule == "interleaved-1f1b":
        v = stages_per_rank or 2
        return min(v * m, 2 * (p - r - 1) + (v - 1) * p + 1)
    if schedule == "zero-bubble":
        return min(2 * p, m + r + 1)
    raise PipelineError(f"pipeline schedule {schedule!r} is not known; use one of "
                        f"{', '.join(PIPELINE_SCHEDULES)}")


def predict_stage_activations(per_microbatch_activation_bytes: int, degree: int,
                              microbatches: int, schedule: str, stage: int,
                              stages_per_rank: int | None = None) -> int:
    """Peak bytes of activations a rank keeps under ``schedule``.

    Args:
        per_microbatch_activation_bytes: What one micro-batch's forward through the rank's
            layers keeps for backward (all its stages together; each of ``v`` chunks is
            taken as ``1/v`` of it).
        degree: Ranks in the pipeline.
        microbatches: Micro-batches per step.
        schedule: ``gpipe``, ``1f1b``, ``interleaved-1f1b`` or ``zero-bubble``.
        stage: The rank's position in the pipeline (its stage, with one stage per rank).
        stages_per_rank: Chunks per rank for the interleaved schedules (default 2).

    Returns:
        ``microbatches_in_flight(...) x per_microbatch_activation_bytes / v``: GPipe keeps
        ``m`` micro-batches at once on every stage, 1F1B ``p - stage``.
    """
    v = 1 if schedule in ONE_STAGE else (stages_per_rank or 2)
    n = microbatches_in_flight(schedule, degree, microbatches, stage, stages_per_rank)
    return round(n * per_microbatch_activation_bytes / v)


# ---------------------------------------------------------------------------- balancing
@dataclass(frozen=True)
class BlockCost:
    """What one block (or a stage's extra part: embeddings, head and loss) costs.

    Attributes:
        state_bytes: Its parameters' bytes (gradients and optimizer state scale with them).
        activation_bytes: What one micro-batch's forward through it keeps for backward.
        compute: Its forward-plus-backward work in any unit shared by all blocks (FLOPs).
    """

    state_bytes: int = 0
    activation_bytes: int = 0
    compute: float = 0.0


def choose_cuts(block_costs: Sequence[BlockCost], degree: int, *, schedule: str = "1f1b",
                microbatches: int | None = None, stages_per_rank: int | None = None,
                first: BlockCost | None = None, last: BlockCost | None = None,
                state_factor: float = 4.0) -> tuple[int, ...]:
    """Cut points that balance the stages' memory and compute.

    Stage ``s`` holding blocks ``B_s`` costs, in memory, ``M_s = state_factor x sum(state) +
    n_s x sum(activation)`` (``n_s`` micro-batches in flight under the schedule, see
    :func:`microbatches_in_flight`; ``state_factor`` 4 is fp32 AdamW: weights, gradients and
    two moments) and, in time, ``C_s = sum(compute)``; the first stage adds ``first`` (the
    embeddings), the last ``last`` (final norm, head and loss). The objective is the
    bottleneck: minimise ``max_s max(M_s / M_mean, C_s / C_mean)``, each stage measured
    against a perfectly even share of its kind, so the cuts suit both the memory-bound rank
    and the slowest one. An exact dynamic programme over contiguous splits
    (``O(stages x blocks^2)``).

    With several stages per rank, each stage is balanced on its own, with its rank's in-flight
    count spread evenly over the rank's stages (an approximation).

    Args:
        block_costs: One :class:`BlockCost` per block, in order.
        degree: Ranks in the pipeline.
        schedule: The schedule (its in-flight counts weigh each stage's activations).
        microbatches: Micro-batches per step (default ``2 x degree``).
        stages_per_rank: Stages per rank (default as :class:`PipelineConfig`).
        first: The first stage's extra cost (embeddings).
        last: The last stage's extra cost (head and loss).
        state_factor: Bytes of training state per parameter byte.

    Returns:
        ``num_stages - 1`` cut indices (see :attr:`PipelineConfig.cuts`).

    Raises:
        PipelineError: when the blocks cannot fill the stages or the settings are invalid.
    """
    config = PipelineConfig(degree, schedule, microbatches, None, stages_per_rank)
    n = len(block_costs)
    check_pipeline(n, config)
    s_count, v = config.num_stages, config.local_stages
    first, last = first or BlockCost(), last or BlockCost()
    weights = []
    for s in range(s_count):
        rank = config.rank_of_stage(s)
        weights.append(microbatches_in_flight(
            schedule, degree, config.num_microbatches, rank, v) / v)
    state = [0.0]
    act = [0.0]
    comp = [0.0]
    for c in block_costs:
        state.append(state[-1] + state_factor * c.state_bytes)
        act.append(act[-1] + c.activation_bytes)
        comp.append(comp[-1] + c.compute)
    mean_w = sum(weights) / s_count
    mem_total = (state[-1] + mean_w * act[-1]
                 + state_factor * (first.state_bytes + last.state_bytes)
                 + weights[0] * first.activation_bytes + weights[-1] * last.activation_bytes)
    comp_total = comp[-1] + first.compute + last.compute
    mem_bar = mem_total / s_count if mem_total > 0 else 0.0
    comp_bar = comp_total / s_count if comp_total > 0 else 0.0

    def cost(s: int, i: int, j: int) -> float:
        mem = state[j] - state[i] + weights[s] * (act[j] - act[i])
        work = comp[j] - comp[i]
        if s == 0:
            mem += state_factor * first.state_bytes + weights[s] * first.activation_bytes
            work += first.compute
        if s == s_count - 1:
            mem += state_factor * last.state_bytes + weights[s] * last.activation_bytes
            work += last.compute
        out = 0.0
        if mem_bar:
            out = mem / mem_bar
        if comp_bar:
            out = max(out, work / comp_bar)
        # Without any measured cost, fall back on block counts (an even split).
        return out if (mem_bar or comp_bar) else float(j - i)

    inf = float("inf")
    # best[s][j]: the least bottleneck of stages 0..s holding blocks 0..j-1; arg for the cut.
    best = [[inf] * (n + 1) for _ in range(s_count)]
    arg = [[0] * (n + 1) for _ in range(s_count)]
    for j in range(1, n - s_count + 2):
        best[0][j] = cost(0, 0, j)
    for s in range(1, s_count):
        for j in range(s + 1, n - (s_count - 1 - s) + 1):
            for i in range(s, j):
                if best[s - 1][i] == inf:
                    continue
                val = max(best[s - 1][i], cost(s, i, j))
                if val < best[s][j]:
                    best[s][j], arg[s][j] = val, i
    cuts, j = [], n
    for s in range(s_count - 1, 0, -1):
        j = arg[s][j]
        cuts.append(j)
    return tuple(reversed(cuts))
