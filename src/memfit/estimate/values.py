"""Values in a dry run: constants computed for real, and a stated policy for data-dependent shapes.

Fake tensors have shapes, not values, so a model that reads a value (``.item()``, ``.tolist()``,
``if x.any()``) or makes a tensor whose shape depends on values (``nonzero``, ``masked_select``,
``unique``, an expert's share of the tokens) cannot be followed by fake tensors alone. torch's
own answer, symbolic shapes with unbacked sizes, gives no byte counts, which is what a memory
tool needs. :class:`DryRunValues` adds what fake tensors lack, for the duration of a dry run:

* **Constants are computed for real.** A tensor made from Python numbers by a deterministic
  factory (``arange``, ``linspace``, ``tensor``, ``full``, ``zeros``, ...; at most
  :data:`SHADOW_LIMIT` elements) gets a real *shadow* on the host, and so does every result of
  an operation whose tensor inputs all have shadows. Reading such a value returns the real one,
  so ``[x.item() for x in torch.linspace(0, rate, n)]`` in a constructor works, and a
  data-dependent shape computed from constants has its real size. Shadows are tiny by
  construction and cost no device memory: the fake tensor beside each is what the tracker counts.
* **Mixture-of-experts routing follows a policy.** A router's expert choice depends on trained
  weights, which a dry run does not have. The indices of ``topk`` (and ``argmax`` over the last
  dimension) over at most :data:`MAX_EXPERTS` scores of a fake tensor are given a synthetic
  shadow: ``balanced`` by default (token ``t``'s ``j``-th choice is expert ``(t*k + j) % E``,
  so every expert gets ``T*k/E`` tokens, give or take one), or, with ``expert_load=c > 1``, a
  worst-case load where expert 0 takes ``c`` times its share (at most every token). Everything
  derived from the indices (one-hot masks, ``torch.where`` per expert, token counts) is then
  computed for real, so the per-expert buffers have the sizes the policy says.
* **Other data-dependent shapes take their upper bound.** ``nonzero``, ``masked_select`` and
  ``unique`` of a tensor without a shadow (its values come from activations) keep every
  element: the most the real run could allocate.

Every application of a policy is recorded (operator, module, policy) and lands in the report's
``meta["data_dependent"]``, so a user sees where the dry run assumed something.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

from ..device import active_values, values_closed, values_opened

__all__ = [
    "MAX_EXPERTS",
    "SHADOW_LIMIT",
    "DryRunValues",
    "PolicyUse",
    "dynamic_shape_rule",
]

#: Most elements a shadow (a real copy of a constant) may have: larger results stay fake.
SHADOW_LIMIT = 1 << 20

#: ``topk``/``argmax`` over a last dimension this small, on a fake tensor, is taken for routing.
MAX_EXPERTS = 1024

_Tensor = torch.Tensor

# Factories whose values follow from their Python arguments (or from a tensor's shape only).
_FACTORIES = {
    torch.arange,
    torch.linspace,
    torch.logspace,
    torch.tensor,
    torch.as_tensor,
    torch.scalar_tensor,
    torch.full,
    torch.zeros,
    torch.ones,
    torch.eye,
    torch.tril_indices,
    torch.triu_indices,
    # A scalar draw read at once: transformers < 5.23 draws LayerDrop's ``torch.rand([])`` and
    # compares it even with layerdrop 0 (BART, OPT, ...); a real draw, as the real run makes
    # (from a forked generator: see _real).
    torch.rand,
}
_LIKE = {
    torch.zeros_like,
    torch.ones_like,
    torch.full_like,
    _Tensor.new_tensor,
    _Tensor.new_zeros,
    _Tensor.new_ones,
    _Tensor.new_full,
}
# Reading a value out of a tensor.
_READS = {
    _Tensor.item,
    _Tensor.tolist,
    _Tensor.__bool__,
    _Tensor.__int__,
    _Tensor.__float__,
    _Tensor.__index__,
    _Tensor.__format__,
}
_ROUTERS = {torch.topk, _Tensor.topk, torch.argmax, _Tensor.argmax}
# Module names under which a top-k is a mixture-of-experts router (transformers names them
# gate, router, moe, experts, block_sparse_moe, ...; the router sits in the MLP's place).
_ROUTER_NAMES = re.compile(r"(gate|rout|moe|expert|mlp)", re.IGNORECASE)

# Operators whose output shape (or value) depends on their inputs' values.
_UPPER_BOUND = {"aten::nonzero", "aten::masked_select", "aten::_unique2", "aten::unique_dim"}


@dataclass(frozen=True)
class PolicyUse:
    """One place where a dry run assumed values: which operator, in which module, under what."""

    op: str
    module: str | None
    policy: str

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "module": self.module, "policy": self.policy}


@dataclass
class _Pending:
    """Output metadata of dynamic-shape operators, recorded from a real computation, to be
    replayed in order by the fake computation of the same call."""

    records: list[tuple[str, Any]] = field(default_factory=list)


class DryRunValues(TorchFunctionMode):
    """Real shadows of constant tensors and the dry run's data-dependent policies.

    Args:
        expert_load: ``1.0`` routes tokens to experts evenly; ``c > 1`` gives expert 0 ``c``
            times its share (at most every token), a worst case for the buffers of one expert.
        where: Returns the module running now (for the record of policies applied).
    """

    def __init__(
        self, *, expert_load: float = 1.0, where: Callable[[], str | None] | None = None
    ) -> None:
        super().__init__()
        if not (isinstance(expert_load, (int, float)) and math.isfinite(expert_load)) or (
            expert_load < 1
        ):
            raise ValueError(
                f"expert_load must be a number >= 1 (1: balanced), got {expert_load!r}"
            )
        self.expert_load = float(expert_load)
        self.where = where or (lambda: None)
        self.shadows: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # Fake tensors with shadows, by their storage: a write through any alias (a view, an
        # out= argument) makes every shadow of that storage stale.
        self._by_storage: dict[int, list[Any]] = {}
        self.uses: dict[PolicyUse, int] = {}
        self._pending: _Pending | None = None
        self._constant_calls = 0  # > 0 while a call computed from constants runs fake

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> DryRunValues:
        values_opened(self)
        self._unpatch = _patch_transformers(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._unpatch()
        values_closed(self)

    def record(self, op: str, policy: str) -> None:
        """Note that ``policy`` decided ``op``'s output here."""
        use = PolicyUse(op, self.where(), policy)
        self.uses[use] = self.uses.get(use, 0) + 1

    def summary(self) -> list[dict[str, Any]]:
        """The policies applied, once per (operator, module, policy), with a count."""
        return [{**u.to_dict(), "count": n} for u, n in self.uses.items()]

    # ------------------------------------------------------------------ the mode
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "__get__":  # attribute reads (.shape, .dtype, ...)
            return func(*args, **kwargs)
        if func in _READS and args and isinstance(args[0], _Tensor):
            shadow = self.shadows.get(args[0])
            if shadow is not None:
                return _real(func, (shadow, *args[1:]), kwargs)
            return func(*args, **kwargs)
        tensors = _flat_tensors(args, kwargs)
        if tensors is None:  # nested arguments: pytree finds them
            tensors = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, _Tensor)]
        real_in: list[Any] | None = None
        if func in _FACTORIES and not tensors:
            real_in = tree_flatten((args, kwargs))[0]
        elif func in _LIKE and all(t.numel() <= SHADOW_LIMIT for t in tensors):
            real_in = [self._stand_in(x) for x in tree_flatten((args, kwargs))[0]]
        elif tensors and all(t in self.shadows for t in tensors):
            flat = tree_flatten((args, kwargs))[0]
            real_in = [self.shadows[x] if isinstance(x, _Tensor) else x for x in flat]
        if real_in is None:
            self._forget_mutated(func, args, kwargs)
            out = func(*args, **kwargs)
            if func in _ROUTERS:
                self._route(func, args, kwargs, out)
            return out
        spec = tree_flatten((args, kwargs))[1]
        real_args, real_kwargs = tree_unflatten([_host(x) for x in real_in], spec)
        real_out: Any = _nothing
        self._constant_calls += 1
        try:
            out = func(*args, **kwargs)
        except Exception as e:
            if not _fake_limit(e):
                raise
            # A value or a data-dependent shape: compute it for real, then replay its shapes.
            pending = _Pending()
            real_out = _real(func, real_args, real_kwargs, recorder=_Recorder(pending))
            outer, self._pending = self._pending, pending
            try:
                out = func(*args, **kwargs)
            finally:
                self._pending = outer
        finally:
            self._constant_calls -= 1
        if real_out is _nothing and all(
            t.numel() <= SHADOW_LIMIT for t in tree_flatten(out)[0] if isinstance(t, _Tensor)
        ):
            with contextlib.suppress(Exception):  # a failed shadow leaves the value unknown
                real_out = _real(func, real_args, real_kwargs)
        if real_out is not _nothing:
            self._pair(out, real_out)
        return out

    # ------------------------------------------------------------------ helpers
    def _stand_in(self, x: Any) -> Any:
        if not isinstance(x, _Tensor):
            return x
        shadow = self.shadows.get(x)
        if shadow is not None:
            return shadow
        # Only the shape and dtype of ``x`` matter to a *_like or new_* factory: a stand-in
        # with no memory of its own (every element the same storage).
        with _no_modes():
            return torch.empty((), dtype=x.dtype).expand(x.shape)

    def _pair(self, out: Any, real_out: Any) -> None:
        fakes, _ = tree_flatten(out)
        reals, _ = tree_flatten(real_out)
        if len(fakes) != len(reals):
            return
        for f, r in zip(fakes, reals, strict=True):
            if (
                isinstance(f, _Tensor)
                and isinstance(r, _Tensor)
                and r.numel() <= SHADOW_LIMIT
                and tuple(f.shape) == tuple(r.shape)
                and f.dtype == r.dtype
            ):
                self._shadow(f, r)

    def _shadow(self, fake: Any, real: torch.Tensor) -> None:
        import weakref

        self.shadows[fake] = real
        key = _storage_key(fake)
        if key is not None:
            refs = self._by_storage.setdefault(key, [])
            refs[:] = [r for r in refs if r() is not None]
            refs.append(weakref.ref(fake))

    def _forget_mutated(self, func: Any, args: Any, kwargs: Any) -> None:
        """A write from values without shadows makes the target's storage's shadows stale."""
        name = getattr(func, "__name__", "")
        targets: list[Any] = []
        inplace = name == "__setitem__" or (name.endswith("_") and not name.startswith("__"))
        if inplace and args:
            first = args[0]
            targets += list(first) if isinstance(first, (list, tuple)) else [first]  # _foreach_*_
        out = kwargs.get("out")
        if out is not None:
            targets += tree_flatten(out)[0]
        for t in targets:
            if isinstance(t, _Tensor):
                self.forget(t)

    def forget(self, t: torch.Tensor) -> None:
        """``t``'s storage was written with values the dry run does not know: its shadows, and
        those of every alias, are stale."""
        self.shadows.pop(t, None)
        for ref in self._by_storage.pop(_storage_key(t), []):
            alias = ref()
            if alias is not None:
                self.shadows.pop(alias, None)

    def _route(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """Give a router's expert choice a synthetic value, by the routing policy."""
        scores = args[0] if args else kwargs.get("input")
        if not isinstance(scores, _Tensor) or not scores.is_floating_point() or scores.dim() < 1:
            return
        module = self.where()
        if module is not None and not _ROUTER_NAMES.search(module):
            return  # a top-k outside any router (a classifier's prediction): not routing
        if func in (torch.topk, _Tensor.topk):
            k = args[1] if len(args) > 1 else kwargs.get("k")
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            indices = out[1] if isinstance(out, tuple) else getattr(out, "indices", None)
        else:
            k = 1
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            indices = out
            if dim is None:
                return
        if dim not in (-1, scores.dim() - 1) or not isinstance(k, int):
            return
        experts = scores.shape[-1]
        if not 1 <= k < experts <= MAX_EXPERTS or not isinstance(indices, _Tensor):
            return
        tokens = math.prod(scores.shape[:-1])
        if tokens * k > SHADOW_LIMIT:
            return
        self._shadow(indices, _routing(tokens, k, experts, self.expert_load, indices.shape))
        policy = "balanced" if self.expert_load == 1 else f"expert_load={self.expert_load:g}"
        self.record("routing", f"{policy} expert choice ({experts} experts, top-{k})")


_nothing = object()


def _patch_transformers(values: DryRunValues) -> Callable[[], None]:
    """Let transformers read the values a dry run knows.

    transformers treats every fake tensor as a graph being traced (``is_tracing``) and then
    takes the path that reads no values: an explicit causal mask where the real run, seeing an
    all-ones mask, passes ``is_causal`` to SDPA and builds none. A fake tensor with a real
    shadow is not traced: its values are known, so the dry run takes the real run's path.
    """
    import importlib
    import importlib.util

    utils = None
    if importlib.util.find_spec("transformers") is not None:
        # Imported now, not left to the model's build: patched before transformers runs.
        utils = importlib.import_module("transformers.utils.import_utils")
    original = getattr(utils, "is_fake_tensor", None)
    if utils is None or original is None:
        return lambda: None

    def is_fake_tensor(x: Any) -> bool:
        return bool(original(x)) and x not in values.shadows

    utils.is_fake_tensor = is_fake_tensor

    def undo() -> None:
        utils.is_fake_tensor = original

    return undo


def _routing(tokens: int, k: int, experts: int, load: float, shape: Any) -> torch.Tensor:
    """Expert indices ``[tokens, k]`` (as ``shape``): balanced, or expert 0 chosen by ``load``
    times its share."""
    with _no_modes():
        slots = torch.arange(tokens * k, dtype=torch.long).reshape(tokens, k)
        choice = slots % experts
        if load > 1:
            heavy = min(tokens, math.ceil(load * tokens * k / experts))
            rows = choice[:heavy]
            has_zero = (rows == 0).any(dim=1)
            rows[~has_zero, 0] = 0  # distinct per row: expert 0 was not among the row's choices
        return choice.reshape(shape)


class _Recorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the outputs of dynamic-shape operators during a real computation."""

    def __init__(self, pending: _Pending) -> None:
        super().__init__()
        self.pending = pending

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if _is_dynamic(func):
            meta = tree_flatten(out)[0]
            self.pending.records.append(
                (
                    func.name(),
                    [(tuple(t.shape), t.dtype) if isinstance(t, _Tensor) else t for t in meta],
                )
            )
        return out


def _fake_limit(exc: BaseException) -> bool:
    """Whether ``exc`` is fake tensors' refusal of a value read or a data-dependent shape."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )

    return isinstance(exc, (DataDependentOutputException, DynamicOutputShapeException))


_DYNAMIC: dict[Any, bool] = {}


def _is_dynamic(func: Any) -> bool:
    """Whether ``func``'s output shape or value depends on its inputs' values (cached)."""
    known = _DYNAMIC.get(func)
    if known is None:
        tags = getattr(func, "tags", ())
        known = _DYNAMIC[func] = (
            torch.Tag.dynamic_output_shape in tags
            or torch.Tag.data_dependent_output in tags
            or func.name() in ("aten::_local_scalar_dense", "aten::item")
        )
    return known


def dynamic_shape_rule(fake_mode: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    """The fake implementation of a dynamic-shape operator during a dry run.

    Replays the output a real computation of the same call recorded (for values computed from
    constants); else, for ``nonzero``, ``masked_select`` and ``unique``, the upper bound (every
    element kept), recorded as a policy use; else defers to fake tensors (which raise).
    """
    values = active_values()
    if values is None:
        return NotImplemented
    name = func.name()
    pending = values._pending
    if pending is not None and pending.records and pending.records[0][0] == name:
        _, meta = pending.records.pop(0)
        return _build(fake_mode, args, meta)
    if values._constant_calls:
        return NotImplemented  # fake tensors raise; the values are then computed for real
    if name in _UPPER_BOUND:
        x = args[0]
        n = x.numel()
        if name == "aten::nonzero":
            meta = [((n, x.dim()), torch.long)]
        elif name == "aten::masked_select":
            mask = args[1]
            n = math.prod(torch.broadcast_shapes(x.shape, mask.shape))
            meta = [((n,), x.dtype)]
        elif name == "aten::unique_dim":  # (self, dim, sorted, return_inverse, return_counts)
            dim = _arg(args, 1) % x.dim()
            rows = x.shape[dim]
            inverse = (rows,) if (kwargs.get("return_inverse") or _arg(args, 3)) else (0,)
            counts = (rows,) if (kwargs.get("return_counts") or _arg(args, 4)) else (0,)
            meta = [(tuple(x.shape), x.dtype), (inverse, torch.long), (counts, torch.long)]
        else:  # _unique2: (self, sorted, return_inverse, return_counts)
            inverse = x.shape if (kwargs.get("return_inverse") or _arg(args, 2)) else (0,)
            counts = (n,) if (kwargs.get("return_counts") or _arg(args, 3)) else (0,)
            meta = [((n,), x.dtype), (tuple(inverse), torch.long), (counts, torch.long)]
        values.record(name.replace("::", "."), "upper bound: every element kept")
        return _build(fake_mode, args, meta)
    return NotImplemented


def _arg(args: Any, i: int) -> Any:
    return args[i] if len(args) > i else None


def _build(fake_mode: Any, args: Any, meta: list[Any]) -> Any:
    from torch._subclasses.fake_impls import in_kernel_invocation_manager
    from torch._subclasses.fake_tensor import FakeTensor

    device = next((a.device for a in args if isinstance(a, _Tensor)), torch.device("cpu"))
    outs: list[Any] = []
    with in_kernel_invocation_manager(fake_mode):
        for m in meta:
            if isinstance(m, tuple) and len(m) == 2 and isinstance(m[1], torch.dtype):
                outs.append(
                    FakeTensor(fake_mode, torch.empty(m[0], dtype=m[1], device="meta"), device)
                )
            else:
                outs.append(m)  # a Python scalar (a value read)
    return outs[0] if len(outs) == 1 else tuple(outs)


@contextlib.contextmanager
def _no_modes() -> Iterator[None]:
    """No dispatch or function modes: real tensors computed as in plain eager mode."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch._C.DisableTorchFunction():
        yield


def _real(func: Any, args: Any, kwargs: Any, recorder: _Recorder | None = None) -> Any:
    # Without autograd: a shadow is a value, nothing differentiates through it. A shadow of a
    # parameter requires grad (Swin's relative-position table), and an op over it would save
    # its real inputs for backward through the saved-tensor hooks, which dispatch modes do not
    # turn off: the tracker would count the shadows, which the real run does not have.
    # A real draw (torch.rand) leaves the global generator as it was: a dry run draws nothing
    # anywhere else, and one made between training steps must not change what they draw.
    drawing = torch.random.fork_rng(devices=[]) if func is torch.rand else contextlib.nullcontext()
    with _no_modes(), torch.no_grad(), recorder or contextlib.nullcontext(), drawing:
        return func(*args, **kwargs)


def _host(x: Any) -> Any:
    """Shadows live on the host: a device argument becomes ``cpu``."""
    if isinstance(x, torch.device) or (isinstance(x, str) and x.startswith(("cuda", "meta"))):
        return torch.device("cpu")
    return x


_PLAIN = frozenset(
    {int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format}
)


def _flat_tensors(args: Any, kwargs: Any) -> list[Any] | None:
    """The tensors among ``args`` and ``kwargs``' values when every other one is a plain
    scalar (the common call: found without pytree); ``None`` when anything else is there
    (a container, or an object pytree may open, such as a cache)."""
    tensors = []
    for x in (*args, *kwargs.values()):
        if isinstance(x, _Tensor):
            tensors.append(x)
        elif type(x) not in _PLAIN:
            return None
    return tensors


def _storage_key(t: Any) -> int | None:
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError, TypeError):
        return None
