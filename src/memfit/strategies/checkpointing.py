"""Activation checkpointing: recompute activations in backward instead of keeping them.

:func:`apply_checkpointing` installs a small callable as the ``forward`` of each chosen block
(an instance attribute, so the class and every other instance are untouched, and the block's
own hooks stay *outside* the checkpoint: they run once, not again during recomputation). The
callable runs the block's real ``forward`` under PyTorch's non-reentrant
:func:`torch.utils.checkpoint.checkpoint`, which

* keeps only the block's inputs and recomputes everything else in backward;
* restores the RNG state for the recomputation, so dropout draws the same mask and gradients
  equal those of the unchecked model;
* needs no input to require a gradient (frozen embeddings feeding the first block are fine).

Modes (see :class:`CheckpointConfig`): ``full`` wraps every block; ``selective`` wraps every
block with a policy that keeps matmul and attention outputs and recomputes only pointwise ops;
``sqrt`` runs segments of about sqrt(n) consecutive blocks under one checkpoint each (Chen et
al., 2016); ``budget`` checkpoints, at every forward, just as many blocks as needed so that the
activations the blocks keep fit ``budget_bytes``.

Hugging Face blocks are handled like any module: keyword arguments pass through; the model's
``use_cache`` is off while it is checkpointed, and a KV cache argument is dropped all the same
(the recomputation would write it a second time), as Transformers does for its own gradient
checkpointing.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.checkpoint import (
    checkpoint,
)

from ..blocks import find_blocks
from ..device import rng_states, set_rng_states
from ..techniques import ENGINES, ApplyContext, Technique
from .kv_cache import KVCacheOff, apply_kv_cache_off, drop_cache
from .recompute import in_function_modes
from .selective import (
    SAVE_OPS,
    SELECTIVE_CHECKPOINT_KEYWORDS,
    SELECTIVE_POLICIES,
    selective_context,
    selective_policy,
)

__all__ = [
    "CHECKPOINT_MODES",
    "SAVE_OPS",
    "SELECTIVE_POLICIES",
    "BlockEstimator",
    "CheckpointConfig",
    "CheckpointHandle",
    "apply_checkpointing",
    "checkpointed_blocks",
    "measure_saved_bytes",
    "remove_checkpointing",
    "selective_policy",
]

CheckpointMode = Literal["none", "full", "selective", "sqrt", "budget"]
#: The checkpointing modes, from keeping everything to the budgeted choice.
CHECKPOINT_MODES: tuple[str, ...] = ("none", "full", "selective", "sqrt", "budget")

#: ``estimator(name, block, args, kwargs) -> bytes`` the block keeps for backward when it is
#: *not* checkpointed, given the arguments of the current call.
BlockEstimator = Callable[[str, nn.Module, tuple, dict], int]


@dataclass(frozen=True)
class CheckpointConfig:
    """Which blocks keep their activations and which recompute them in backward.

    Attributes:
        mode: ``none`` keeps every activation (most memory, no recompute). ``full`` wraps every
            repeated block: only each block's input is kept, and the whole block's forward is
            recomputed in backward (about one extra forward: ~+33% compute). ``selective``
            wraps every block but keeps matmul outputs and recomputes only cheap pointwise ops
            (most of the saving of ``full`` at a few percent of compute). ``sqrt`` checkpoints
            segments of ~sqrt(n) blocks (Chen et al. 2016): O(sqrt(n)) activation memory for
            one extra forward. ``budget`` checkpoints just as many blocks as needed to keep
            activations under ``budget_bytes``.
        blocks: Qualified-name pattern(s) of the repeated blocks (``fnmatch`` style, e.g.
            ``"bert.encoder.layer.*"``); ``None`` finds the largest list of identical blocks.
        budget_bytes: For ``budget``: the activation bytes the model may keep.
        policy: For ``selective``: which outputs a block keeps (see
            :data:`~memfit.strategies.selective.SELECTIVE_POLICIES`): ``matmuls`` (every
            matmul, convolution and fused attention output) or ``alternate-matmuls``
            (torchtitan's per-op policy: attention outputs and every other ``mm`` of a block,
            counted from the block's first).
    """

    mode: CheckpointMode = "none"
    blocks: tuple[str, ...] | None = None
    budget_bytes: int | None = None
    policy: str = "matmuls"

    def __post_init__(self) -> None:
        # A config checks itself, so a bad one fails where it is written, in the plan.
        if self.mode not in CHECKPOINT_MODES:
            raise ValueError(
                f"checkpointing mode {self.mode!r} is not known; use one of "
                f"{', '.join(CHECKPOINT_MODES)}"
            )
        if self.mode == "budget" and not self.budget_bytes:
            raise ValueError(
                "checkpointing mode 'budget' needs budget_bytes (the activation bytes allowed)"
            )
        if self.policy not in SELECTIVE_POLICIES:
            raise ValueError(
                f"selective checkpointing policy {self.policy!r} is not known; use one of "
                f"{', '.join(SELECTIVE_POLICIES)}"
            )
        if self.policy != "matmuls" and self.mode != "selective":
            raise ValueError(
                f"checkpointing policy {self.policy!r} chooses what 'selective' keeps; mode "
                f"{self.mode!r} takes none (use mode 'selective' or drop the policy)"
            )


# ---------------------------------------------------------------------------------- blocks
def _resolve_blocks(
    model: nn.Module, patterns: Sequence[str] | None
) -> list[tuple[str, nn.Module]]:
    if patterns is None:
        blocks = find_blocks(model)
        if not blocks:
            raise ValueError(
                f"{type(model).__name__} has no list of repeated blocks to checkpoint; name the "
                "blocks with CheckpointConfig(blocks=('pattern.*',)), fnmatch patterns over "
                "qualified module names"
            )
        return blocks
    if isinstance(patterns, str):
        patterns = (patterns,)
    named = [(n, m) for n, m in model.named_modules() if n]
    chosen: dict[str, nn.Module] = {}
    for pattern in patterns:
        hits = [(n, m) for n, m in named if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            examples = ", ".join(repr(n) for n, _ in named[:4])
            raise ValueError(
                f"checkpointing pattern {pattern!r} matches no module of "
                f"{type(model).__name__}; patterns are fnmatch patterns over qualified module "
                f"names such as {examples}"
            )
        chosen.update(hits)
    # A block inside another chosen block would be checkpointed twice (nested recomputation):
    # keep the outermost, in module order.
    order = {n: i for i, (n, _) in enumerate(named)}
    names = sorted(chosen, key=order.__getitem__)
    outer = [n for n in names if not any(n.startswith(o + ".") for o in names if o != n)]
    return [(n, chosen[n]) for n in outer]


# ---------------------------------------------------------------------------------- helpers
def _call_forward(module: nn.Module, original: Any, args: tuple, kwargs: dict) -> Any:
    # The class's forward (or a forward someone installed before us), never module.__call__:
    # the block's hooks already ran around our wrapper.
    if original is not None:
        return original(*args, **kwargs)
    return type(module).forward(module, *args, **kwargs)


_WARNED: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=3)


def _tensors(obj: Any) -> Iterable[torch.Tensor]:
    """The tensors in nested arguments (torch's pytree: dicts, lists, tuples, named tuples,
    model outputs; other objects, such as a KV cache, are leaves and are skipped)."""
    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _hidden_of(output: Any) -> torch.Tensor | None:
    """The hidden state a block hands to the next: the output, or its first element."""
    if isinstance(output, torch.Tensor):
        return output
    try:
        first = output[0]
    except (TypeError, IndexError, KeyError):
        return None
    return first if isinstance(first, torch.Tensor) else None


def _same(a: Any, b: Any) -> bool:
    """Whether ``a`` is the very argument ``b`` (tensors by identity, plain values by value)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, (int, float, str, bool, type(None))) and type(a) is type(b):
        return a == b
    return False


def _same_call(args: tuple, kwargs: dict, exp_args: tuple, exp_kwargs: dict) -> bool:
    return (
        len(args) == len(exp_args)
        and all(map(_same, args, exp_args))
        and kwargs.keys() == exp_kwargs.keys()
        and all(_same(kwargs[k], exp_kwargs[k]) for k in kwargs)
    )


def measure_saved_bytes(module: nn.Module, *args: Any, **kwargs: Any) -> int:
    """Bytes of the tensors ``module(*args, **kwargs)`` saves for backward (parameters excluded).

    Runs the module's forward once under a counting
    :class:`torch.autograd.graph.saved_tensors_hooks`, each storage counted once. With real
    inputs, the forward runs under :class:`~torch._subclasses.fake_tensor.FakeTensorMode`
    (no memory, no compute, the RNG untouched) when it can, else for real with the RNG state
    restored afterwards; with fake inputs, under their own fake mode.

    Returns:
        The bytes the module would keep for backward if it were not checkpointed.
    """
    return _measure(module, None, args, kwargs)


def _measure(module: nn.Module, original: Any, args: tuple, kwargs: dict) -> int:
    skip = {_storage_key(p) for p in module.parameters()} | {
        _storage_key(b) for b in module.buffers()
    }
    fake_mode = next(
        (t.fake_mode for t in _tensors((args, kwargs)) if hasattr(t, "fake_mode")), None
    )
    from torch.utils._python_dispatch import _disable_current_modes

    try:
        # Leave every active dispatch mode (a memory tracker above all) out of the
        # measurement: its fake tensors are no allocation of the run being tracked.
        with _disable_current_modes():
            from torch._subclasses.fake_tensor import FakeTensorMode

            if fake_mode is not None:
                with fake_mode:
                    return _count_saved(module, original, args, kwargs, skip)
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            with mode, _fake_state(module, mode) as fake_skip:
                # New names: the real run below, should this fail, needs the real arguments.
                fake_args, fake_kwargs = _to_fake(mode, (args, kwargs))
                return _count_saved(module, original, fake_args, fake_kwargs, fake_skip)
    except Exception:  # data-dependent or unsupported ops under fake tensors
        if fake_mode is not None:
            raise
    with torch.random.fork_rng(devices=[]):
        return _count_saved(module, original, args, kwargs, skip)


@contextlib.contextmanager
def _fake_state(module: nn.Module, mode: Any) -> Iterator[set[int | None]]:
    """Swap ``module``'s parameters and buffers for fake copies; yield their storage keys.

    Real parameters would otherwise enter the fake forward through views (``weight.t()``)
    converted on the fly, whose fake storages cannot be told apart from activations.
    """
    swapped: list[tuple[dict, str, torch.Tensor]] = []
    keys: set[int | None] = set()
    try:
        for mod in module.modules():
            for table in (mod._parameters, mod._buffers):
                for name, value in list(table.items()):
                    if value is None:
                        continue
                    fake = mode.from_tensor(value)  # memoised: tied weights stay tied
                    swapped.append((table, name, value))
                    table[name] = fake
                    keys.add(_storage_key(fake))
        yield keys
    finally:
        for table, name, value in reversed(swapped):
            table[name] = value


def _to_fake(mode: Any, obj: Any) -> Any:
    return tree_map_only(torch.Tensor, mode.from_tensor, obj)


def _count_saved(
    module: nn.Module, original: Any, args: tuple, kwargs: dict, skip: set[int | None]
) -> int:
    seen: set[int | None] = set(skip)
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        key = _storage_key(t)
        if key not in seen:
            seen.add(key)
            try:
                total += t.untyped_storage().nbytes()
            except (RuntimeError, NotImplementedError):
                total += t.numel() * t.element_size()
        # A detached alias, not ``t``: an op that saves its own output (LayerNorm's statistics,
        # a GELU's result) would otherwise hold that output through its node, and the output
        # holds the node (its grad_fn): a cycle through C++ that Python's collector never
        # frees, keeping the whole measured graph alive, and with it the block's input. In a
        # dry run that input is the run's own fake tensor, so the tracker saw one hidden state
        # stay alive to the end (budget mode's dry run kept 32 KiB more than the real run).
        return t.detach()

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = _call_forward(module, original, args, kwargs)
    del out
    return total


# ---------------------------------------------------------------------------------- wrappers
@dataclass
class _State:
    """What :func:`apply_checkpointing` did to one model (kept on the model)."""

    config: CheckpointConfig
    names: list[str]  # the checkpointed blocks (filled at each forward in budget mode)
    wrapped: list[tuple[str, nn.Module]]
    budget: _Budget | None = None
    cache_off: KVCacheOff | None = None


@dataclass
class _Budget:
    """Per-forward bookkeeping of ``budget`` mode."""

    budget_bytes: int
    order: list[str]
    estimator: BlockEstimator | None
    names: list[str]
    used: int = 0
    seen_inputs: set[int | None] = field(default_factory=set)
    decisions: dict[str, bool] = field(default_factory=dict)
    cache: dict[Any, int] = field(default_factory=dict)


class _Wrapper:
    """The callable installed as a block's ``forward``.

    It is a class (not a closure) so that ``copy.deepcopy`` of the model rebinds it to the copy
    and pickling works.
    """

    def __init__(self, name: str, module: nn.Module, context: Callable[[], tuple] | None) -> None:
        self.name = name
        self.module = module
        self.original = module.__dict__.get("forward")
        self.context = context

    def plain(self, *args: Any, **kwargs: Any) -> Any:
        return _call_forward(self.module, self.original, args, kwargs)

    def checkpointed(self, args: tuple, kwargs: dict, fn: Callable[..., Any] | None = None) -> Any:
        args, kwargs = drop_cache(args, kwargs, _warn_once)
        # Keyword arguments go in through a partial, so that none can collide with
        # checkpoint()'s own keywords (context_fn, debug, ...).
        run = in_function_modes(functools.partial(fn or self.plain, **kwargs))
        extra = ({"context_fn": self.context, **SELECTIVE_CHECKPOINT_KEYWORDS}
                 if self.context is not None else {})
        return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True, **extra)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.plain(*args, **kwargs)
        return self.checkpointed(args, kwargs)


class _SegmentHead(_Wrapper):
    """First block of a ``sqrt`` segment: runs the whole segment under one checkpoint.

    The blocks after it are chained the way a block loop chains them: each gets the previous
    block's hidden state (the output, or its first element) and the same other arguments as
    the first. Their outputs wait in ``pending`` until the loop calls each block, which then
    checks that it really was called that way and hands its output back without computing;
    if the call differs (the loop transforms the hidden state, passes per-block arguments or
    skips a block), the block computes for real under its own checkpoint, so the result is
    always right. The random generators are rewound after the head's own block and moved on
    as each chained output is handed back, so dropout draws what the unchecked model draws
    (provided the loop itself draws nothing between the blocks of a segment whose chain
    holds).
    """

    def __init__(self, name: str, module: nn.Module, members: list[_SegmentMember]) -> None:
        super().__init__(name, module, None)
        self.members = members
        self.rng_after: list[Any] = []
        for m in members:
            m.head = self

    def run_segment(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        outputs = [self.plain(*args, **kwargs)]
        # The generators' state after each block: where the next block starts drawing (its
        # dropout masks). Read by __call__ after the forward (a recomputation in backward
        # overwrites it under checkpoint's forked generators, when nobody reads it any more).
        self.rng_after = [rng_states()]
        for member in self.members:
            hidden = _hidden_of(outputs[-1])
            if hidden is None:
                break  # cannot chain: the remaining blocks compute when called
            call_args = (hidden, *args[1:])
            outputs.append(member.plain(*call_args, **kwargs))
            self.rng_after.append(rng_states())
        return tuple(outputs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        for m in self.members:
            m.pending = None
        if not torch.is_grad_enabled():
            return self.plain(*args, **kwargs)
        args, kwargs = drop_cache(args, kwargs, _warn_once)
        outputs = self.checkpointed(args, kwargs, fn=self.run_segment)
        rng_after = self.rng_after
        # The segment's later blocks drew their random numbers ahead of time. Rewind the
        # generators to where the unchecked model stands after this block: a member that must
        # compute for real (its call differs from the chained one) then draws what the
        # unchecked model draws, and one that returns its chained output moves them on to
        # where that output left them.
        set_rng_states(rng_after[0])
        for i, (member, out) in enumerate(zip(self.members, outputs[1:], strict=False)):
            member.pending = ((_hidden_of(outputs[i]), *args[1:]), kwargs, out, rng_after[i + 1])
        return outputs[0]


class _SegmentMember(_Wrapper):
    """A later block of a ``sqrt`` segment: returns the output its head computed."""

    head: _SegmentHead
    #: (expected args, expected kwargs, chained output, generators' state after it)
    pending: tuple[tuple, dict, Any, Any] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        pending, self.pending = self.pending, None
        if not torch.is_grad_enabled():
            return self.plain(*args, **kwargs)
        if pending is not None:
            exp_args, exp_kwargs, out, rng_after = pending
            call_args, call_kwargs = drop_cache(args, kwargs, _warn_once)
            if _same_call(call_args, call_kwargs, exp_args, exp_kwargs):
                set_rng_states(rng_after)
                return out
            _warn_once(
                "segment",
                f"memfit sqrt checkpointing: block {self.name!r} was not called with the "
                "previous block's output and the same arguments, so its segment's chained "
                "result is discarded and it is checkpointed on its own (correct, but the "
                "segment's blocks ran twice); use mode 'full' for this model",
            )
            for m in self.head.members:
                m.pending = None
        return self.checkpointed(args, kwargs)


class _BudgetWrapper(_Wrapper):
    """A block in ``budget`` mode: decides at every call whether to checkpoint."""

    def __init__(self, name: str, module: nn.Module, budget: _Budget, index: int) -> None:
        super().__init__(name, module, None)
        self.budget = budget
        self.index = index
        params = tuple(
            (n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters()
        )
        self.signature = (type(module), params)

    def estimate(self, args: tuple, kwargs: dict) -> int:
        b = self.budget
        if b.estimator is not None:
            return int(b.estimator(self.name, self.module, args, kwargs))
        shapes = tuple(
            (tuple(t.shape), t.dtype, t.requires_grad) for t in _tensors((args, kwargs))
        )
        key = (self.signature, self.module.training, shapes, tuple(sorted(kwargs)))
        if key not in b.cache:
            b.cache[key] = _measure(self.module, self.original, args, kwargs)
        return b.cache[key]

    def input_bytes(self, args: tuple) -> int:
        """Bytes of positional tensor inputs not already kept by an earlier block."""
        total = 0
        for t in _tensors(args):
            key = _storage_key(t)
            if key not in self.budget.seen_inputs:
                total += t.numel() * t.element_size()
        return total

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.plain(*args, **kwargs)
        b = self.budget
        if self.index == 0:
            b.used = 0
            b.seen_inputs.clear()
        kept_plain = self.estimate(args, kwargs)
        kept_ckpt = self.input_bytes(args)
        remaining = len(b.order) - self.index - 1
        # Keep this block's activations only if the rest still fits when every later block is
        # checkpointed (each keeping an input of this block's size): with identical blocks this
        # checkpoints the fewest blocks that fit, and it follows the shapes of every batch.
        keep = b.used + kept_plain + remaining * kept_ckpt <= b.budget_bytes
        b.used += kept_plain if keep else kept_ckpt
        b.seen_inputs.update(_storage_key(t) for t in _tensors(args))
        if b.decisions.get(self.name) != (not keep):
            b.decisions[self.name] = not keep
            b.names[:] = [n for n in b.order if b.decisions.get(n)]
        if keep:
            return self.plain(*args, **kwargs)
        return self.checkpointed(args, kwargs)


# ---------------------------------------------------------------------------------- public
def apply_checkpointing(
    model: nn.Module,
    config: CheckpointConfig,
    *,
    estimator: BlockEstimator | None = None,
) -> CheckpointHandle:
    """Checkpoint ``model``'s repeated blocks as ``config`` says.

    Each chosen block's ``forward`` is replaced (on that instance only) by a wrapper that runs
    it under non-reentrant :func:`torch.utils.checkpoint.checkpoint` whenever gradients are
    enabled; under ``torch.no_grad()`` blocks run as before. Works for Hugging Face blocks
    (keyword arguments pass through; a KV cache argument is dropped while checkpointing) and
    for any ``nn.Module``, with frozen parameters or inputs that need no gradient.

    Calling it again on a model that is already checkpointed is a no-op when the config is the
    same (a handle on the same wrappers is returned) and raises ``RuntimeError`` otherwise:
    remove the first first. Nothing is ever wrapped twice.

    Args:
        model: The model.
        config: Which mode and blocks; ``mode='none'`` changes nothing.
        estimator: For ``budget``: ``estimator(name, block, args, kwargs) -> bytes`` the block
            keeps when not checkpointed. Default: measured once per input shape with
            :func:`measure_saved_bytes` (fake tensors, no memory). ``budget_bytes`` bounds
            what the blocks keep (an unchecked block its activations, a checkpointed one its
            input); activations outside the blocks (embeddings, head, loss) are not covered,
            and during backward one block's recomputation comes on top.

    Returns:
        The :class:`CheckpointHandle`. Its ``names`` are the qualified names of the
        checkpointed blocks. In ``sqrt`` mode, the heads of the segments (each checkpoint
        covers its head and the blocks up to the next head). In ``budget`` mode the decision
        depends on the input shapes, so the list is empty until the first forward and is
        updated in place at every forward (see :func:`checkpointed_blocks`). Its ``remove()``
        gives every block its own forward back.

    Raises:
        ValueError: when a ``blocks`` pattern matches no module, no repeated blocks are found,
            ``budget`` mode has no ``budget_bytes``, or a block uses Transformers' own
            gradient checkpointing.
        RuntimeError: when the model is already checkpointed with another config.
    """
    existing: _State | None = model.__dict__.get("_memfit_checkpointing")
    if existing is not None:
        if existing.config == config:
            return CheckpointHandle(model, existing)
        raise RuntimeError(
            f"{type(model).__name__} is already checkpointed (mode {existing.config.mode!r}); "
            "call remove_checkpointing(model) (or remove() on the handle apply_checkpointing "
            "returned) before applying another checkpointing config"
        )
    if config.mode == "none":
        return CheckpointHandle(model, None)
    blocks = _resolve_blocks(model, config.blocks)
    _check_blocks(blocks)
    state = _State(config=config, names=[], wrapped=list(blocks))
    wrappers = _wrappers(config, blocks, state, estimator)
    # As transformers does for its own gradient checkpointing: the model builds no KV cache
    # while checkpointed (a recomputed block would write it twice); remove() turns it back on.
    # (Here, after every check that can refuse: a refusal leaves the model as it was.)
    state.cache_off = apply_kv_cache_off(model)
    for block, wrapper in wrappers:
        # An instance attribute shadows the class's forward for this block only.
        block.forward = wrapper
    model.__dict__["_memfit_checkpointing"] = state
    return CheckpointHandle(model, state)


def _check_blocks(blocks: list[tuple[str, nn.Module]]) -> None:
    """Refuse blocks that some checkpointing already wraps."""
    for name, block in blocks:
        if isinstance(block.__dict__.get("forward"), _Wrapper):
            raise RuntimeError(
                f"block {name!r} is already checkpointed by memfit (through another model that "
                "contains it); call remove_checkpointing on that model first"
            )
        if getattr(block, "gradient_checkpointing", False):
            raise ValueError(
                f"block {name!r} uses Transformers' own gradient checkpointing; call "
                "model.gradient_checkpointing_disable() before memfit's, or not both"
            )


def _wrappers(
    config: CheckpointConfig, blocks: list[tuple[str, nn.Module]], state: _State, estimator: Any
) -> list[tuple[nn.Module, _Wrapper]]:
    """The forward wrapper of each block under ``config``'s mode (names go to ``state``)."""
    wrappers: list[tuple[nn.Module, _Wrapper]] = []
    if config.mode in ("full", "selective"):
        context = (functools.partial(selective_context, config.policy)
                   if config.mode == "selective" else None)
        wrappers = [(b, _Wrapper(n, b, context)) for n, b in blocks]
        state.names = [n for n, _ in blocks]
    elif config.mode == "sqrt":
        for group in _sibling_groups(blocks):
            size = max(1, math.ceil(math.sqrt(len(group))))
            for start in range(0, len(group), size):
                seg = group[start : start + size]
                members = [_SegmentMember(n, b, None) for n, b in seg[1:]]
                head = _SegmentHead(seg[0][0], seg[0][1], members)
                wrappers.append((seg[0][1], head))
                wrappers.extend((m.module, m) for m in members)
                state.names.append(seg[0][0])
    elif config.mode == "budget":
        assert config.budget_bytes is not None
        state.budget = _Budget(
            budget_bytes=int(config.budget_bytes),
            order=[n for n, _ in blocks],
            estimator=estimator,
            names=state.names,
        )
        wrappers = [
            (b, _BudgetWrapper(n, b, state.budget, i)) for i, (n, b) in enumerate(blocks)
        ]
    return wrappers  # (a mode outside these: CheckpointConfig refuses it when built)


class CheckpointHandle:
    """The blocks :func:`apply_checkpointing` wrapped, and how to unwrap them.

    Attributes:
        names: Qualified names of the checkpointed blocks (updated at every forward in
            ``budget`` mode).
    """

    def __init__(self, model: nn.Module, state: _State | None) -> None:
        self.model = model
        self._state = state
        self.names: list[str] = state.names if state is not None else []

    def remove(self) -> None:
        """Give every wrapped block its own forward back (:func:`remove_checkpointing`), as
        long as the model is still checkpointed by this handle's call. Idempotent."""
        if self._state is not None and self.model.__dict__.get("_memfit_checkpointing") is self._state:
            remove_checkpointing(self.model)
        self._state = None

    def __repr__(self) -> str:
        return f"CheckpointHandle({self.names})"


def _sibling_groups(blocks: list[tuple[str, nn.Module]]) -> list[list[tuple[str, nn.Module]]]:
    """Split blocks into runs of siblings (same parent): a segment never spans two lists."""
    groups: list[list[tuple[str, nn.Module]]] = []
    parent = None
    for name, block in blocks:
        p = name.rpartition(".")[0]
        if not groups or p != parent:
            groups.append([])
            parent = p
        groups[-1].append((name, block))
    return groups


def checkpointed_blocks(model: nn.Module) -> list[str]:
    """Names of the blocks memfit checkpoints in ``model`` (``[]`` when none).

    In ``budget`` mode: the decision of the latest forward.
    """
    state: _State | None = model.__dict__.get("_memfit_checkpointing")
    return list(state.names) if state is not None else []


def remove_checkpointing(model: nn.Module) -> list[str]:
    """Undo :func:`apply_checkpointing`: every wrapped block gets its own forward back.

    Returns:
        Qualified names of the blocks that were unwrapped (``[]`` if none were).
    """
    state: _State | None = model.__dict__.pop("_memfit_checkpointing", None)
    if state is None:
        return []
    if state.cache_off is not None:
        state.cache_off.remove()
    for _, block in state.wrapped:
        wrapper = block.__dict__.get("forward")
        if not isinstance(wrapper, _Wrapper):
            continue
        if wrapper.original is not None:
            block.forward = wrapper.original
        else:
            del block.forward
    return [n for n, _ in state.wrapped]


def _apply_technique(model: nn.Module, ctx: ApplyContext) -> CheckpointHandle:
    handle = apply_checkpointing(model, ctx.plan.checkpointing)
    ctx.info["checkpointed"] = handle.names
    return handle


def _layout_refusal(plan: Any, engine: str) -> str | None:
    if engine == "layout" and plan.checkpointing.mode not in ("full", "selective"):
        return f"checkpointing {plan.checkpointing.mode!r} is not built by a tensor/pipeline layout"
    return None


#: After freezing and precision (it sees the final dtypes and the frozen set); swappable.
TECHNIQUE = Technique(
    name="checkpointing",
    engines=frozenset(ENGINES),  # the tensor/pipeline path builds it too
    plan_field="checkpointing",
    order=50,
    is_on=lambda plan: plan.checkpointing.mode != "none",
    apply=_apply_technique,
    info_key="checkpointed",
    refusal=_layout_refusal,
    label=lambda plan: f"checkpointing {plan.checkpointing.mode!r}",
    swappable=True,
    forbid={
        "checkpointing": "activation checkpointing (all modes)",
        "full-checkpointing": "full activation checkpointing",
    },
    summary=lambda config: f"checkpointing {config.mode}",
    # full, sqrt and budget run every checkpointed block's forward again in backward;
    # selective recomputes pointwise ops only (priced as memory traffic).
    recompute_flops=lambda plan, profile: (
        profile.block_fwd_flops_per_sample
        if plan.checkpointing.mode in ("full", "sqrt", "budget")
        else 0.0
    ),
)
