"""PipeDream: asynchronous pipeline parallelism with weight stashing, and PipeDream-2BW.

torch.distributed.pipelining has only synchronous schedules (GPipe, 1F1B, interleaved,
zero-bubble): every one accumulates the step's gradients and leaves the optimizer step to the
caller, after a flush. It has no schedule that updates the weights between micro-batches, and
no weight versions. This module is that schedule, written on memfit's own stage modules
(:func:`~memfit.distributed.pipeline.build_stage`) and torch's point-to-point messages
(``dist.isend`` / ``dist.irecv``), one stage per rank.

**Order.** Every stage runs 1F1B: rank ``r`` warms up with ``min(p - r, m)`` forwards, then
alternates one micro-batch's backward and the next one's forward, then drains
(:func:`one_f_one_b`). A forward's send travels with the next action's receive, as torch's
1F1B pairs them, so a rank never waits on a send its neighbour has not yet posted a receive
for.

**Semantics** (``schedule``, both pinned down by :func:`pipedream_reference`):

* ``pipedream`` (weight stashing): a stage steps its optimizer after *every* micro-batch's
  backward, with that micro-batch's gradient alone (its mean loss; no division by the
  micro-batch count), so version ``k`` of a stage's weights is the one after the updates of
  micro-batches ``0 .. k-1``. A micro-batch's forward on a stage uses the newest version
  there (the number of backwards the stage has run: :func:`forward_versions`), and its
  backward uses the same version, kept (stashed) until then. Different stages therefore see
  the same micro-batch at different versions; with ``vertical_sync`` every stage uses the
  version stage 0 used for it, the version it entered the pipeline with (a stage then keeps
  versions older than its newest a little longer).
* ``pipedream-2bw`` (double-buffered weights): the gradients of the step's ``m`` micro-batches
  accumulate (their mean, as a synchronous step's) and the stage updates once per step, with
  the 1-stale rule ``W(t+1) = W(t) - lr * grad(W(t-1))``: the step's forwards and backwards
  all run on the previous version ``W(t-1)``, kept beside the live ``W(t)`` the optimizer
  updates. Every stage uses the same version for a micro-batch, so ``vertical_sync`` changes
  nothing here. At the first step ``W(-1) = W(0)``.

**Steps.** A step (:meth:`~memfit.distributed.layout.Layout.step`) is one pass of the
``microbatches`` micro-batches, and the pipeline drains at its end (no micro-batch is in
flight across a step boundary), so checkpoints, evaluation and the loss are those of a whole
step; version numbers restart at each step from the weights the step starts with. Asynchrony
therefore lives within a step; 2BW's stale version is carried across steps (a checkpoint holds
the live weights only: a resumed run restarts with ``W(t-1) = W(t)``).

A micro-batch runs on its version through ``torch.nn.utils.stateless``'s reparametrisation
(what ``torch.func.functional_call`` uses), held over its forward and again over its backward,
so that activation-checkpointed blocks recompute on the same version.

**Memory**, per stage: its parameters (the live version, which the optimizer updates),
optimizer state, and for ``pipedream`` one stashed copy of the stage's parameters per version
some in-flight micro-batch uses, the newest included (forwards run on a copy, never on the
live tensors the optimizer changes in place): at most ``min(p - r, m)`` copies on rank ``r``
(:func:`stashed_versions`); for ``pipedream-2bw`` one copy, ``W(t-1)``, kept across steps.
The copies are tagged ``stashed_weights`` in memfit's tracker. Gradients exist only from a
micro-batch's backward to its update (``pipedream``) or over the step (2BW). Activations: as
1F1B's, at most ``min(p - r, m)`` micro-batches in flight.

Data replicas (``data > 1``, ZeRO 0): every replica of a stage runs the same actions, and
each update first averages the gradients over the stage's replicas (an all-reduce in place,
no buckets: no memory beyond the gradients), as DDP would for a synchronous step.

Limits: one stage per rank, no tensor, context or expert split, no ZeRO sharding, no weights
tied across stages (GPT-2's tied embedding and head would need a cross-rank reduction at
every update).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..accounting.tracker import label_open
from .config import PIPEDREAM_SCHEDULES

__all__ = [
    "PIPEDREAM_SCHEDULES",
    "PipeDreamSchedule",
    "forward_versions",
    "one_f_one_b",
    "pipedream_reference",
    "stashed_versions",
]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: The tracker category of the stashed weight versions.
STASH = "stashed_weights"

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64)


# --------------------------------------------------------------------------- arithmetic
def one_f_one_b(degree: int, microbatches: int, rank: int) -> list[tuple[str, int]]:
    """Rank ``rank``'s actions in a drained 1F1B step: ``("F", i)`` and ``("B", i)``.

    ``min(degree - rank, microbatches)`` forwards, then one backward and one forward in turn,
    then the remaining backwards.
    """
    m = microbatches
    warm = min(degree - rank, m)
    out: list[tuple[str, int]] = [("F", i) for i in range(warm)]
    for j in range(m):
        out.append(("B", j))
        if j + warm < m:
            out.append(("F", j + warm))
    return out


def forward_versions(schedule: str, degree: int, microbatches: int, rank: int,
                     vertical_sync: bool = False) -> list[int]:
    """The weight version each micro-batch's forward (and backward) uses on rank ``rank``, in
    micro-batch order: the number of updates its stage has made in the step by then.

    ``pipedream``: the backwards the rank ran before the forward; with ``vertical_sync``, the
    ones rank 0 ran before it (the version the micro-batch entered the pipeline with).
    ``pipedream-2bw``: all ``0``, the one stale version the step runs on.
    """
    if schedule == "pipedream-2bw":
        return [0] * microbatches
    who = 0 if vertical_sync else rank
    done, out = 0, [0] * microbatches
    for kind, i in one_f_one_b(degree, microbatches, who):
        if kind == "B":
            done += 1
        else:
            out[i] = done
    return out


def stashed_versions(schedule: str, degree: int, microbatches: int, rank: int,
                     vertical_sync: bool = False) -> int:
    """The most stashed copies of its parameters rank ``rank`` holds at once: ``1`` for
    ``pipedream-2bw``; for ``pipedream`` the distinct versions its in-flight micro-batches
    use (the schedule replayed as :class:`PipeDreamSchedule` keeps them)."""
    if schedule == "pipedream-2bw":
        return 1
    versions = forward_versions(schedule, degree, microbatches, rank, vertical_sync)
    users = _users(versions)
    live, held = 0, {0} if users.get(0) else set()
    most = len(held)
    for kind, i in one_f_one_b(degree, microbatches, rank):
        if kind != "B":
            continue
        users[versions[i]].discard(i)
        if not users[versions[i]]:
            held.discard(versions[i])
        live += 1
        if users.get(live):
            held.add(live)
        most = max(most, len(held))
    return most


def _users(versions: Sequence[int]) -> dict[int, set[int]]:
    users: dict[int, set[int]] = {}
    for i, v in enumerate(versions):
        users.setdefault(v, set()).add(i)
    return users


# --------------------------------------------------------------------------- the stage
@dataclass
class _Flight:
    """A micro-batch between its forward and its backward on this stage."""

    out: torch.Tensor | None  # the output, whose gradient the next stage sends back
    x: torch.Tensor | None  # the received input (a leaf wanting its gradient), if any
    loss: torch.Tensor | None
    version: int


@dataclass
class PipeDreamStage:
    """One rank's stage under PipeDream: its forwards on a weight version, backwards on the
    same one, and the updates (no communication: :class:`PipeDreamSchedule` moves the
    tensors; memfit's prediction runs this same object on fake tensors).

    Attributes:
        module: The stage (:class:`~memfit.distributed.pipeline.StageModule`).
        schedule: ``pipedream`` or ``pipedream-2bw``.
        degree: Ranks in the pipeline.
        rank: This stage's (and rank's) index.
        vertical_sync: Every stage uses the version stage 0 used.
        loss_fn: The last stage's loss, a mean over the micro-batch.
        optimizer: Steps the live parameters (given before the first step).
        replica_group: With data replicas: the group of this stage's replicas, over which
            each update's gradients are averaged (an all-reduce in place) before the step.
    """

    module: nn.Module
    schedule: str
    degree: int
    rank: int
    vertical_sync: bool = False
    loss_fn: LossFn | None = None
    optimizer: Any = None
    replica_group: Any = None
    #: ``pipedream``: the stashed versions in use, by version number in the step.
    versions: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict, init=False)
    #: ``pipedream-2bw``: ``W(t-1)``, which the step's micro-batches run on.
    previous: dict[str, torch.Tensor] | None = field(default=None, init=False)
    _users: dict[int, set[int]] = field(default_factory=dict, init=False)
    _plan: list[int] = field(default_factory=list, init=False)
    _live: int = field(default=0, init=False)
    _m: int = field(default=1, init=False)
    _flights: dict[int, _Flight] = field(default_factory=dict, init=False)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.degree - 1

    def live(self) -> dict[str, nn.Parameter]:
        """The live parameters, by the stage's names."""
        return dict(self.module.named_parameters())

    def _copy(self) -> dict[str, torch.Tensor]:
        """A copy of the live weights to run micro-batches on (a leaf per parameter)."""
        with torch.no_grad():
            out = {n: p.detach().clone().requires_grad_(p.requires_grad)
                   for n, p in self.live().items()}
        label_open(list(out.values()), STASH)
        return out

    def begin(self, microbatches: int) -> None:
        """Start a step of ``microbatches`` micro-batches: the versions they will use."""
        if self.optimizer is None:
            raise RuntimeError("a pipedream schedule steps the optimizer itself: attach it "
                               "first (Layout.attach_optimizer, which LayoutStepper calls)")
        self._m, self._live, self._flights = microbatches, 0, {}
        self._plan = forward_versions(self.schedule, self.degree, microbatches, self.rank,
                                      self.vertical_sync)
        self._users = _users(self._plan)
        if self.schedule == "pipedream-2bw":
            if self.previous is None:  # the first step: W(-1) = W(0)
                self.previous = self._copy()
            label_open(list(self.previous.values()), STASH)
        else:
            self.versions = {}
            self._stash_if_used()

    def _stash_if_used(self) -> None:
        if self._users.get(self._live):
            self.versions[self._live] = self._copy()

    def _weights(self, version: int) -> dict[str, torch.Tensor]:
        if self.schedule == "pipedream-2bw":
            assert self.previous is not None
            return self.previous
        return self.versions[version]

    def forward(self, i: int, x: torch.Tensor, target: torch.Tensor | None,
                grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Micro-batch ``i``'s forward on its version; returns the output (to send on) and,
        on the last stage, the loss. ``grad=False``: an evaluation forward on the live
        weights, nothing kept."""
        if not grad:
            with torch.no_grad():
                out = self.module(x)
                out = getattr(out, "logits", out)
                loss = self.loss_fn(out, target) if self.is_last and target is not None \
                    else None
            return out, loss
        version = self._plan[i]
        if x.is_floating_point() and not self.is_first:
            x.requires_grad_(True)
        with _on(self.module, self._weights(version)):
            out = self.module(x)
        out = getattr(out, "logits", out)
        loss = self.loss_fn(out, target) if self.is_last else None
        keep_x = x if x.requires_grad else None
        # The last stage's backward starts from its loss: its logits need not be kept.
        self._flights[i] = _Flight(None if self.is_last else out, keep_x, loss, version)
        return out.detach(), (loss.detach() if loss is not None else None)

    def backward(self, i: int, grad_out: torch.Tensor | None) -> torch.Tensor | None:
        """Micro-batch ``i``'s backward on the version its forward used, then the update
        (``pipedream``: one per micro-batch; 2BW: accumulate, the update at :meth:`end`).
        Returns the input's gradient (to send back), ``None`` on the first stage."""
        f = self._flights.pop(i)
        weights = self._weights(f.version)
        names = [n for n, t in weights.items() if t.requires_grad]
        inputs = ([f.x] if f.x is not None else []) + [weights[n] for n in names]
        # On the version again: checkpointed blocks recompute their forward in backward.
        with _on(self.module, weights):
            if f.loss is not None:
                grads = torch.autograd.grad(f.loss, inputs, allow_unused=True)
            else:
                grads = torch.autograd.grad(f.out, inputs, grad_outputs=grad_out,
                                            allow_unused=True)
        del f
        grad_in = grads[0] if inputs and len(grads) > len(names) else None
        wgrads = grads[len(grads) - len(names):]
        del grads, inputs
        live = self.live()
        if self.schedule == "pipedream-2bw":
            for n, g in zip(names, wgrads, strict=True):
                if g is None:
                    continue
                p = live[n]
                if p.grad is None:
                    p.grad = g / self._m
                else:
                    p.grad.add_(g, alpha=1 / self._m)
            return grad_in
        version = self._plan[i]
        users = self._users[version]
        users.discard(i)
        if not users:
            del self.versions[version], weights  # no micro-batch in flight uses it
        for n, g in zip(names, wgrads, strict=True):
            live[n].grad = g
        del wgrads
        self._average()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._live += 1
        self._stash_if_used()
        return grad_in

    def _average(self) -> None:
        """The gradients averaged over the data replicas, in place (every replica makes the
        same updates in the same order, so the all-reduces pair up)."""
        if self.replica_group is None:
            return
        n = dist.get_world_size(self.replica_group)
        for p in self.live().values():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.replica_group)
                p.grad.div_(n)

    def end(self) -> None:
        """The step's end: 2BW's update (``W(t-1)`` becomes ``W(t)``, then ``W(t)`` steps to
        ``W(t+1)``)."""
        if self.schedule == "pipedream-2bw":
            assert self.previous is not None
            with torch.no_grad():
                for n, p in self.live().items():
                    self.previous[n].copy_(p)
            self._average()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.versions = {}


def _on(module: nn.Module, weights: dict[str, torch.Tensor]) -> Any:
    """``module`` running on ``weights`` in place of its parameters while open: what
    ``torch.func.functional_call`` does around one call, held here over a backward too (an
    activation-checkpointed block recomputes its forward then, and must see the same
    version)."""
    from torch.nn.utils.stateless import _reparametrize_module

    return _reparametrize_module(module, weights)


# --------------------------------------------------------------------------- messages
class _Links:
    """Point-to-point messages to the previous and next pipeline rank (torch's isend/irecv on
    the pipeline's group)."""

    def __init__(self, rank: int, degree: int, group: Any) -> None:
        self.group = group

        def glob(r: int) -> int:
            return dist.get_global_rank(group, r) if group is not None else r

        self.prev = glob(rank - 1) if rank > 0 else None
        self.next = glob(rank + 1) if rank < degree - 1 else None

    def exchange(self, sends: list[tuple[torch.Tensor, int]],
                 recvs: list[tuple[torch.Tensor, int]]) -> None:
        """Post every send and receive, then wait for all of them."""
        works = [dist.irecv(t, src=peer, group=self.group) for t, peer in recvs]
        works += [dist.isend(t, dst=peer, group=self.group) for t, peer in sends]
        for w in works:
            w.wait()

    def send_meta(self, out: torch.Tensor) -> None:
        """The shape and dtype of this stage's output, to the next stage (once per step)."""
        meta = torch.zeros(8, dtype=torch.int64)
        meta[0], meta[1] = _DTYPES.index(out.dtype), out.dim()
        meta[2:2 + out.dim()] = torch.tensor(out.shape)
        self.exchange([(meta, self.next)], [])

    def recv_meta(self) -> tuple[tuple[int, ...], torch.dtype]:
        meta = torch.zeros(8, dtype=torch.int64)
        self.exchange([], [(meta, self.prev)])
        n = int(meta[1])
        return tuple(int(d) for d in meta[2:2 + n]), _DTYPES[int(meta[0])]


class PipeDreamSchedule:
    """The schedule object a :class:`~memfit.distributed.pipeline.Pipeline` holds for the
    PipeDream schedules, with torch's schedules' ``step`` and ``eval`` signatures.

    Args:
        stage: This rank's stage module.
        degree: Ranks in the pipeline.
        rank: This rank's index in the pipeline group.
        microbatches: Micro-batches per step.
        schedule: ``pipedream`` or ``pipedream-2bw``.
        loss_fn: The last stage's loss.
        group: The pipeline's process group (``None``: the world).
        vertical_sync: Every stage uses the version stage 0 used for a micro-batch.
    """

    def __init__(self, stage: nn.Module, degree: int, rank: int, microbatches: int,
                 schedule: str, loss_fn: LossFn, group: Any = None,
                 vertical_sync: bool = False) -> None:
        self.stage = PipeDreamStage(stage, schedule, degree, rank, vertical_sync, loss_fn)
        self.microbatches = microbatches
        self.links = _Links(rank, degree, group)

    @property
    def optimizer(self) -> Any:
        return self.stage.optimizer

    @optimizer.setter
    def optimizer(self, value: Any) -> None:
        self.stage.optimizer = value

    def step(self, *args: torch.Tensor, target: torch.Tensor | None = None,
             losses: list[torch.Tensor] | None = None, return_outputs: bool = False) -> None:
        """One drained step of the micro-batches (forwards, backwards and updates)."""
        run_schedule(self.stage, self.links, self.microbatches, args[0] if args else None,
                     target, losses)

    def eval(self, *args: torch.Tensor, target: torch.Tensor | None = None,
             losses: list[torch.Tensor] | None = None, return_outputs: bool = False) -> None:
        """Forwards only, on the live weights (each micro-batch's loss into ``losses``)."""
        stage, links, m = self.stage, self.links, self.microbatches
        xs = args[0].chunk(m) if args else [None] * m
        ys = target.chunk(m) if target is not None else [None] * m
        shape: Any = None
        for i in range(m):
            x = xs[i]
            if not stage.is_first:
                if shape is None:
                    shape = links.recv_meta()
                x = torch.empty(shape[0], dtype=shape[1])
                links.exchange([], [(x, links.prev)])
            out, loss = stage.forward(i, x, ys[i], grad=False)
            if not stage.is_last:
                if i == 0:
                    links.send_meta(out)
                links.exchange([(out.contiguous(), links.next)], [])
            if loss is not None and losses is not None:
                losses.append(loss)


def run_schedule(stage: PipeDreamStage, links: Any, m: int, inputs: torch.Tensor | None,
                 target: torch.Tensor | None, losses: list[torch.Tensor] | None) -> None:
    """Run one drained 1F1B step of ``m`` micro-batches on ``stage``, moving tensors through
    ``links`` (each action's receives posted with the previous action's sends). ``links``
    may be a stand-in that makes the received tensors (memfit's prediction)."""
    xs = inputs.chunk(m) if inputs is not None and stage.is_first else None
    ys = target.chunk(m) if target is not None and stage.is_last else None
    stage.begin(m)
    pending: list[tuple[torch.Tensor, int]] = []
    outs: dict[int, torch.Tensor] = {}
    shape: Any = None
    for kind, i in one_f_one_b(stage.degree, m, stage.rank):
        if kind == "F":
            x = xs[i] if xs is not None else None
            if not stage.is_first:
                if shape is None:
                    shape = links.recv_meta()
                x = torch.empty(shape[0], dtype=shape[1])
                links.exchange(pending, [(x, links.prev)])
            elif pending:
                links.exchange(pending, [])
            pending = []
            out, loss = stage.forward(i, x, ys[i] if ys is not None else None)
            del x
            if loss is not None and losses is not None:
                losses.append(loss)
            if not stage.is_last:
                if i == 0:
                    links.send_meta(out)
                pending = [(out, links.next)]
                outs[i] = out
            del out
        else:
            grad_out = None
            if not stage.is_last:
                ref = outs.pop(i)
                grad_out = torch.empty(ref.shape, dtype=ref.dtype)
                del ref
                links.exchange(pending, [(grad_out, links.next)])
            elif pending:
                links.exchange(pending, [])
            pending = []
            grad_in = stage.backward(i, grad_out)
            del grad_out
            if grad_in is not None and not stage.is_first:
                pending = [(grad_in, links.prev)]
            del grad_in
    if pending:
        links.exchange(pending, [])
    stage.end()


# --------------------------------------------------------------------------- the reference
def pipedream_reference(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    schedule: str,
    degree: int,
    microbatches: int,
    stage_of: Callable[[str], int],
    optimizer: Any,
    vertical_sync: bool = False,
    loss_fn: LossFn | None = None,
    replicas: int = 1,
) -> list[list[float]]:
    """What a PipeDream pipeline computes, in one process on the whole ``model``: the same
    delayed-weight updates, for the numerics tests.

    ``pipedream``: per step, micro-batch ``i`` runs with each stage's parameters at that
    stage's version :func:`forward_versions` (version ``k`` = after the updates of the step's
    micro-batches ``0 .. k-1``); its gradient with respect to those versions updates the live
    parameters, one optimizer step per micro-batch in order (each parameter's update uses the
    gradient of its stage's copy). ``pipedream-2bw``: all micro-batches on ``W(t-1)``, the
    mean of their gradients applied to ``W(t)``.

    Args:
        model: The whole model (updated in place).
        batches: Per step, ``(input ids, labels)`` of the whole batch.
        schedule: ``pipedream`` or ``pipedream-2bw``.
        degree: Pipeline ranks.
        microbatches: Micro-batches per step.
        stage_of: The stage (rank) holding a parameter, by the model's name
            (:func:`~memfit.distributed.pipeline.stage_of_parameter`).
        optimizer: The optimizer over ``model``'s parameters.
        vertical_sync: Every stage at stage 0's version.
        loss_fn: ``loss_fn(output, labels)`` (default: the model's own loss, a Hugging Face
            causal LM called with ``labels``).
        replicas: Data replicas: each takes its consecutive share of the batch and splits
            it into the micro-batches; micro-batch ``i`` here is every replica's ``i``-th
            together (their averaged gradient is that of the mean over equal micro-batches).

    Returns:
        Each step's micro-batch losses.
    """
    live = dict(model.named_parameters())
    stage = {n: stage_of(n) for n in live}
    plans = [forward_versions(schedule, degree, microbatches, r, vertical_sync)
             for r in range(degree)]
    previous: dict[str, torch.Tensor] | None = None
    out: list[list[float]] = []
    for ids, labels in batches:
        if schedule == "pipedream-2bw" and previous is None:
            previous = {n: p.detach().clone() for n, p in live.items()}
        history = [{n: p.detach().clone() for n, p in live.items()}]
        losses = []
        for i, (x, y) in enumerate(zip(_interleave(ids, replicas, microbatches),
                                       _interleave(labels, replicas, microbatches),
                                       strict=True)):
            if schedule == "pipedream-2bw":
                assert previous is not None
                weights = {n: t.clone().requires_grad_(True) for n, t in previous.items()}
            else:
                weights = {n: history[plans[stage[n]][i]][n].clone().requires_grad_(True)
                           for n in live}
            if loss_fn is None:
                loss = torch.func.functional_call(model, weights, (x,), {"labels": y}).loss
            else:
                loss = loss_fn(torch.func.functional_call(model, weights, (x,)), y)
            grads = torch.autograd.grad(loss, list(weights.values()), allow_unused=True)
            losses.append(float(loss.detach()))
            scale = 1 / microbatches if schedule == "pipedream-2bw" else 1.0
            for (n, _), g in zip(weights.items(), grads, strict=True):
                if g is not None:
                    live[n].grad = g * scale if live[n].grad is None else live[n].grad + g * scale
            if schedule == "pipedream":
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                history.append({n: p.detach().clone() for n, p in live.items()})
        if schedule == "pipedream-2bw":
            previous = {n: p.detach().clone() for n, p in live.items()}
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        out.append(losses)
    return out


def _interleave(batch: torch.Tensor, replicas: int, microbatches: int) -> list[torch.Tensor]:
    """Micro-batch ``i`` of every replica's share of ``batch``, together, for each ``i``."""
    shares = [share.chunk(microbatches) for share in batch.chunk(replicas)]
    return [torch.cat([s[i] for s in shares]) for i in range(microbatches)]
