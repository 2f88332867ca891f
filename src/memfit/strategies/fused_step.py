"""Optimizer step fused into backward: gradients never all exist at once.

Each trainable parameter gets its own optimizer (built by the caller's factory over that single
parameter) and a post-accumulate-grad hook. As soon as autograd has finished accumulating the
parameter's gradient, the hook steps that optimizer and drops the gradient. When
``loss.backward()`` returns, every parameter is already updated and every ``.grad`` is ``None``.

Memory: instead of all gradients (4 bytes per parameter in fp32), at most the gradients that one
backward node produces together are alive: a module's weight and bias come out of one ``addmm``
backward, so the bound is the largest module's own parameters (call that the bucket), plus, for
a tied weight used twice (a language-model head tied to the embedding), its first partial
gradient, which autograd holds until the second use has been differentiated. Compute: the same
as an ordinary step (per-parameter optimizers lose the multi-tensor ``foreach`` kernels, which
matters on GPU, little on CPU).

What the fusion changes, and how each is handled:

* Gradient accumulation: the micro-batches before the last accumulate into ``.grad`` as usual
  (all gradients exist then); only the last micro-batch's hooks step and free. The saving is
  therefore on the last micro-batch and in the step.
* Clipping by global norm needs the norm of the whole gradient before any parameter steps.
  ``clip_mode="exact"`` runs one extra backward first that only measures the norm (each gradient
  is reduced to its norm and dropped as soon as it is accumulated): the cost is one backward
  per step (plus one recomputation of checkpointed segments), no gradient memory; the graph is
  kept until the real backward, which leaves the activation peak (the end of the forward)
  unchanged. ``clip_mode="approx"`` clips each step with the previous step's norm: no extra
  compute, a one-step-stale coefficient. Exact clipping with accumulation is refused: the
  measuring backward would have to see the whole accumulated gradient.
* Logging the gradient norm: a loop that measures it after backward (``clip_grad_norm_``, the
  Hugging Face Trainer's ``grad_norm``) finds no gradient and reports 0. With
  ``track_grad_norm=True`` the hooks reduce each gradient to its norm before stepping (one
  small reduction per parameter) and ``last_norm`` holds the step's true global norm.
* Parameters that get a gradient in an earlier micro-batch but none in the last one are
  stepped when the last backward returns, as an ordinary optimizer would step them.
* LR schedulers: the handle is a :class:`torch.optim.Optimizer` whose ``param_groups`` are the
  per-parameter optimizers' own group dicts, so any torch scheduler built on the handle
  (``StepLR(handle, ...)``) drives every per-parameter optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from ..errors import (
    MemfitTypeError,
    MemfitValueError,
    check_bool,
    check_int,
    check_number,
    check_type,
    describe,
)
from ..techniques import Technique

__all__ = ["OptimizerInBackward", "optimizer_in_backward"]

OptimizerFactory = Callable[[list[nn.Parameter]], Any]

_CLIP_MODES = ("exact", "approx")
_EPS = 1e-6  # the same epsilon torch.nn.utils.clip_grad_norm_ adds to the norm


def optimizer_in_backward(
    model: nn.Module,
    optimizer_factory: OptimizerFactory,
    *,
    grad_accum_steps: int = 1,
    max_grad_norm: float | None = None,
    clip_mode: str = "exact",
    track_grad_norm: bool = False,
) -> OptimizerInBackward:
    """Step every trainable parameter of ``model`` inside backward, as its gradient is ready.

    Example::

        opt = optimizer_in_backward(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100)
        for batch in data:
            opt.backward(model(**batch).loss)  # parameters are updated when this returns
            sched.step()

    Args:
        model: The model. Parameters with ``requires_grad=False`` (frozen) are skipped.
        optimizer_factory: ``factory(params)`` builds an optimizer over a list holding one
            parameter: any ``torch.optim.Optimizer`` or an object with ``step``,
            ``param_groups``, ``state_dict`` and ``load_state_dict`` (memfit's optimizers,
            precision wrappers).
        grad_accum_steps: Micro-batches per optimizer step; :meth:`OptimizerInBackward.backward`
            steps on the last one.
        max_grad_norm: Clip the gradient to this global L2 norm (``None``: no clipping).
        clip_mode: ``"exact"`` (one extra, norm-only backward per step) or ``"approx"`` (the
            previous step's norm; see :class:`OptimizerInBackward`).
        track_grad_norm: Measure every step's global gradient norm (``last_norm``) even without
            clipping, for logging: one norm per parameter in the hooks, no gradient memory.

    Returns:
        The :class:`OptimizerInBackward` handle.

    Raises:
        MemfitTypeError: for a model that is not an ``nn.Module``, a factory that is not
            callable, or an argument of another wrong kind.
        ValueError: (a :class:`~memfit.errors.MemfitError`) for an unknown ``clip_mode``, a
            bad ``grad_accum_steps`` or ``max_grad_norm``, exact clipping with accumulation,
            or a model with no trainable parameter.
    """
    return OptimizerInBackward(
        model,
        optimizer_factory,
        grad_accum_steps=grad_accum_steps,
        max_grad_norm=max_grad_norm,
        clip_mode=clip_mode,
        track_grad_norm=track_grad_norm,
    )


class OptimizerInBackward(Optimizer):
    """Handle of an optimizer fused into backward (see :func:`optimizer_in_backward`).

    Use :meth:`backward` for every micro-batch: it knows which micro-batch is the last and runs
    the norm-measuring backward for exact clipping. A bare ``loss.backward()`` also steps, but
    only in the simplest setting (``grad_accum_steps=1``, no clipping); otherwise it raises
    ``RuntimeError`` from inside backward, since the hooks cannot know whether to step or with
    which clipping coefficient.

    Approximate clipping: step ``t`` scales every gradient by
    ``min(1, max_grad_norm / (norm[t-1] + 1e-6))``, where ``norm[t-1]`` is the global norm of
    step ``t-1``'s *unclipped* (accumulated) gradient, measured in the hooks at no extra cost.
    The first step has no previous norm: with ``grad_accum_steps=1`` :meth:`backward` measures
    it exactly (one extra backward, once); when accumulating the first step is not clipped.

    It is a :class:`torch.optim.Optimizer` for the sake of LR schedulers and training loops:
    ``param_groups`` lists the per-parameter optimizers' own group dicts (a scheduler that sets
    ``group["lr"]`` sets it on them), ``state`` maps each parameter to its optimizer state,
    :meth:`step` is a no-op while the hooks are installed (the parameters were updated in
    backward), :meth:`zero_grad` drops any gradient left.

    Attributes:
        optimizers: The per-parameter optimizers, in parameter order.
        names: Qualified parameter names, parallel to ``optimizers``.
        grad_accum_steps: Micro-batches per step.
        max_grad_norm: Global-norm clipping threshold, or ``None``.
        clip_mode: ``"exact"`` or ``"approx"``.
        track_grad_norm: Whether ``last_norm`` is measured without clipping too.
        last_norm: Global norm of the last step's unclipped gradient (a 0-d tensor), when
            clipping or ``track_grad_norm``; ``None`` before the first step.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer_factory: OptimizerFactory,
        *,
        grad_accum_steps: int = 1,
        max_grad_norm: float | None = None,
        clip_mode: str = "exact",
        track_grad_norm: bool = False,
    ) -> None:
        _check_arguments(model, optimizer_factory, grad_accum_steps, max_grad_norm, clip_mode,
                         track_grad_norm)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise MemfitValueError(
                f"{type(model).__name__} has no trainable parameter (all are frozen or it has "
                "none); there is nothing to optimize"
            )
        self.names: list[str] = [n for n, _ in named]
        self.params: list[nn.Parameter] = [p for _, p in named]
        self.optimizers: list[Any] = []
        for name, p in named:
            opt = optimizer_factory([p])
            for attr in ("step", "param_groups", "state_dict", "load_state_dict"):
                if not hasattr(opt, attr):
                    raise MemfitTypeError(
                        f"optimizer_factory returned a {type(opt).__name__} (for {name!r}) "
                        f"without {attr!r}; it must return an optimizer over the given parameters"
                    )
            self.optimizers.append(opt)
        # Optimizer.__init__ installs the step-hook machinery (so the tracker sees step() calls)
        # and the attributes torch code expects; its param_groups are replaced right after.
        self._building = True
        super().__init__(self.params, {})
        self._building = False
        self.param_groups = self._shared_groups()
        # Schedulers read the defaults (OneCycleLR: does it have momentum or betas?); every
        # per-parameter optimizer comes from the same factory, so the first one's stand for all.
        self.defaults = dict(getattr(self.optimizers[0], "defaults", {}))
        self.state = _MergedState(self)  # type: ignore[assignment]
        self.grad_accum_steps = grad_accum_steps
        self.max_grad_norm = max_grad_norm
        self.clip_mode = clip_mode
        self.track_grad_norm = track_grad_norm
        self.last_norm: torch.Tensor | None = None
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._micro = 0  # micro-batches done in the current step
        self._mode: str | None = None  # None (bare backward), "accumulate", "step", "measure"
        self._coef: torch.Tensor | None = None  # clip coefficient for this step's hooks
        self._norms: list[torch.Tensor] = []  # per-parameter norms seen this pass
        self._stepped: set[int] = set()
        self._removed = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    # ------------------------------------------------------------------ training API
    def backward(self, loss: torch.Tensor, last: bool | None = None) -> None:
        """Backward of one micro-batch's (already weighted) loss; steps on the last one.

        Args:
            loss: The scalar loss of this micro-batch.
            last: Whether this micro-batch ends the optimizer step. ``None`` counts calls:
                every ``grad_accum_steps``-th call is the last.
        """
        if self._removed:
            loss.backward()
            return
        if last is None:
            last = self._micro + 1 >= self.grad_accum_steps
        self._micro = 0 if last else self._micro + 1
        if not last:
            self._run(loss, "accumulate")
            return
        if self.max_grad_norm is None:
            self._run(loss, "step")
            self._step_leftovers()
            if self.track_grad_norm:
                self.last_norm = self._finish_norm()
            return
        measure = self.clip_mode == "exact" or (
            self.last_norm is None and self.grad_accum_steps == 1
        )
        norm = self.last_norm
        if measure:
            self._check_no_stale_grads()
            self._run(loss, "measure")
            norm = self._finish_norm()
        self._coef = None if norm is None else _clip_coefficient(self.max_grad_norm, norm)
        try:
            self._run(loss, "step")
            self._step_leftovers()
        finally:
            self._coef = None
        # Exact: the measured norm. Approx: the norm of this step's unclipped gradient,
        # gathered by the hooks, which the next step clips with.
        self.last_norm = norm if self.clip_mode == "exact" else self._finish_norm()

    def begin_step(self, last: bool) -> None:
        """Tell the hooks what the next backward is, for a loop that runs it itself.

        :meth:`backward` does this around its own ``loss.backward()``. A loop that calls
        ``loss.backward()`` itself (the Hugging Face Trainer, through accelerate) calls this
        before each micro-batch's backward instead, and :meth:`end_step` after the step's
        last one. Approximate clipping only: exact clipping needs the extra, norm-measuring
        backward that only :meth:`backward` runs.

        Args:
            last: Whether this backward ends the optimizer step (the hooks step and free each
                gradient); otherwise they leave it to accumulate.
        """
        if not last:
            self._mode = "accumulate"
            return
        self._mode = "step"
        self._stepped.clear()
        self._norms.clear()
        if self.max_grad_norm is not None and self.last_norm is not None:
            self._coef = _clip_coefficient(self.max_grad_norm, self.last_norm)

    def end_step(self) -> None:
        """Finish a step whose last backward ran outside :meth:`backward` (after
        :meth:`begin_step` with ``last=True``): step the parameters that got a gradient only in
        earlier micro-batches, and record the step's norm in ``last_norm`` (for logging, and
        approximate clipping's coefficient of the next step)."""
        self._step_leftovers()
        if self.gathers_norms:
            self.last_norm = self._finish_norm()
        self._coef = None
        self._mode = None

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        """No-op while fused: the parameters were updated during backward.

        After :meth:`remove` the handle is an ordinary (unclipped) optimizer: this steps every
        parameter that holds a gradient.
        """
        if closure is not None:
            raise ValueError(
                "optimizer_in_backward steps inside backward and takes no closure; compute "
                "the loss and call .backward(loss) instead"
            )
        if not self._removed:
            return
        for p, opt in zip(self.params, self.optimizers, strict=True):
            if p.grad is not None:
                opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (or zero) any gradient left on the managed parameters.

        After a fused step there is none; this exists so loops written for an ordinary optimizer
        run unchanged (mid-accumulation it discards the gradient accumulated so far).
        """
        for p in self.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    def remove(self) -> None:
        """Remove the hooks: ``loss.backward()`` fills ``.grad`` as usual again.

        The per-parameter optimizers and their state stay usable (through :meth:`step`).
        """
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._removed = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported: the parameters are fixed when the handle is built."""
        if getattr(self, "_building", False):
            # Optimizer.__init__ registers the parameters this way while the handle is built.
            super().add_param_group(param_group)
            return
        raise NotImplementedError(
            "optimizer_in_backward fixes its parameters when built; build a new handle to "
            "train more parameters"
        )

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """Everything needed to continue exactly: per-parameter optimizer state keyed by
        parameter name, the micro-batch count and the last gradient norm.

        Like torch's, the returned dict references live state tensors: save it (``torch.save``)
        or deep-copy it before training on.
        """
        return {
            "optimizers": {
                n: opt.state_dict() for n, opt in zip(self.names, self.optimizers, strict=True)
            },
            "micro_step": self._micro,
            "last_norm": None if self.last_norm is None else self.last_norm.clone(),
            "grad_accum_steps": self.grad_accum_steps,
            "max_grad_norm": self.max_grad_norm,
            "clip_mode": self.clip_mode,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        """Restore a :meth:`state_dict`.

        Raises:
            ValueError: when the saved parameter names differ from this handle's.
        """
        saved = state_dict.get("optimizers")
        if not isinstance(saved, Mapping):
            raise ValueError(
                "this is not an optimizer_in_backward state dict (no 'optimizers' mapping of "
                "parameter names); save it with handle.state_dict()"
            )
        missing = [n for n in self.names if n not in saved]
        unexpected = [n for n in saved if n not in self._name_set()]
        if missing or unexpected:
            parts = []
            if missing:
                parts.append(
                    f"missing {', '.join(missing[:4])}" + (" ..." if len(missing) > 4 else "")
                )
            if unexpected:
                parts.append(
                    f"unexpected {', '.join(unexpected[:4])}"
                    + (" ..." if len(unexpected) > 4 else "")
                )
            raise ValueError(
                "optimizer state does not match the model's trainable parameters ("
                + "; ".join(parts)
                + "); load it into a model with the same parameters and freezing"
            )
        for name, opt in zip(self.names, self.optimizers, strict=True):
            opt.load_state_dict(saved[name])
        # Optimizer.load_state_dict builds new group dicts: share the new ones.
        self.param_groups = self._shared_groups()
        self._micro = int(state_dict.get("micro_step", 0))
        norm = state_dict.get("last_norm")
        self.last_norm = None if norm is None else torch.as_tensor(norm).clone()

    @property
    def gathers_norms(self) -> bool:
        """Whether the stepping hooks reduce each gradient to its norm (for ``last_norm``)."""
        if self.max_grad_norm is not None:
            # Approx clips the next step with this step's norm; exact measured it beforehand.
            return self.clip_mode == "approx"
        return self.track_grad_norm

    # ------------------------------------------------------------------ internals
    def _name_set(self) -> set[str]:
        return set(self.names)

    def _shared_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def _run(self, loss: torch.Tensor, mode: str) -> None:
        self._mode = mode
        self._stepped.clear()
        self._norms.clear()
        try:
            if mode == "measure":
                self._measure(loss)
            else:
                loss.backward()
        finally:
            self._mode = None

    def _measure(self, loss: torch.Tensor) -> None:
        # Keep the graph for the real backward. Only the managed parameters: other leaves that
        # require grad (inputs) must not get this pass's gradient on top of the real one.
        try:
            torch.autograd.backward(loss, inputs=self.params, retain_graph=True)
        except RuntimeError as e:
            if "use_reentrant" not in str(e):
                raise
            # Reentrant checkpointing refuses ``inputs``. The graph was retained, so measure
            # again over the whole graph; leaves outside the model that require grad then get
            # this pass's gradient as well (rare in training: inputs seldom require grad).
            self._norms.clear()
            for p in self.params:
                p.grad = None
            loss.backward(retain_graph=True)

    def _on_grad(self, p: torch.Tensor) -> None:
        mode = self._mode
        if mode is None:
            # A bare loss.backward(): only safe when every backward is a whole step.
            if self.grad_accum_steps != 1 or self.max_grad_norm is not None:
                raise RuntimeError(
                    "with gradient accumulation or clipping, optimizer_in_backward must run "
                    "the backward itself: call handle.backward(loss) instead of loss.backward()"
                )
            mode = "step"
        if mode == "accumulate" or p.grad is None:
            return
        if mode == "measure":
            self._norms.append(torch.linalg.vector_norm(p.grad.detach(), 2))
            p.grad = None
            return
        self._step_param(p)

    def _step_param(self, p: torch.Tensor) -> None:
        i = self._index[id(p)]
        grad = p.grad
        assert grad is not None
        if self.gathers_norms:
            self._norms.append(torch.linalg.vector_norm(grad.detach(), 2))
        if self._coef is not None:
            grad.detach().mul_(self._coef.to(grad.device))
        self.optimizers[i].step()
        self._stepped.add(i)
        p.grad = None
        self._opt_called = True  # tells a torch LR scheduler that the optimizer has stepped

    def _step_leftovers(self) -> None:
        # A parameter that received gradient in an earlier micro-batch but none in the last one
        # has no hook call in the last backward; an ordinary optimizer would still step it.
        self._mode = "step"
        try:
            for i, p in enumerate(self.params):
                if p.grad is not None and i not in self._stepped:
                    self._step_param(p)
        finally:
            self._mode = None
            self._stepped.clear()

    def _finish_norm(self) -> torch.Tensor:
        """Global L2 norm of the per-parameter norms gathered this pass (as clip_grad_norm_)."""
        norms, self._norms = self._norms, []
        if not norms:
            return torch.zeros(())
        device = norms[0].device
        return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), 2)

    def _check_no_stale_grads(self) -> None:
        for name, p in zip(self.names, self.params, strict=True):
            if p.grad is not None:
                raise ValueError(
                    f"exact clipping measures the norm of this backward's gradient, but "
                    f"{name!r} still holds a gradient from an earlier backward; call "
                    ".zero_grad() first (or use clip_mode 'approx')"
                )

    def __repr__(self) -> str:
        clip = (
            "" if self.max_grad_norm is None else f", clip {self.max_grad_norm} ({self.clip_mode})"
        )
        inner = type(self.optimizers[0]).__name__ if self.optimizers else "none"
        return (
            f"OptimizerInBackward({len(self.optimizers)} x {inner}, "
            f"grad_accum_steps={self.grad_accum_steps}{clip})"
        )


class _MergedState(Mapping):
    """``handle.state[p]``: the state of ``p`` in its own optimizer (empty before its step)."""

    def __init__(self, handle: OptimizerInBackward) -> None:
        self._handle = handle

    def __getitem__(self, p: Any) -> Any:
        i = self._handle._index.get(id(p)) if hasattr(self._handle, "_index") else None
        if i is None:
            raise KeyError(p)
        state = getattr(self._handle.optimizers[i], "state", {})
        return state.get(p, {}) if isinstance(state, Mapping) else {}

    def __iter__(self) -> Iterator[Any]:
        for p, opt in zip(self._handle.params, self._handle.optimizers, strict=True):
            state = getattr(opt, "state", {})
            if isinstance(state, Mapping) and state.get(p):
                yield p

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _clip_coefficient(max_norm: float, norm: torch.Tensor) -> torch.Tensor:
    # The same operations as torch.nn.utils.clip_grad_norm_, so results match it bit for bit.
    coef = max_norm / (norm + _EPS)
    return torch.clamp(coef, max=1.0)


def _check_arguments(
    model: Any,
    optimizer_factory: Any,
    grad_accum_steps: Any,
    max_grad_norm: Any,
    clip_mode: Any,
    track_grad_norm: Any,
) -> None:
    """Every argument of :func:`optimizer_in_backward`, before any hook is installed."""
    check_type(model, nn.Module, "model", "an nn.Module")
    if not callable(optimizer_factory) or isinstance(optimizer_factory, (Optimizer, nn.Module)):
        raise MemfitTypeError(
            "optimizer_factory must be a function factory(params) -> optimizer (e.g. "
            f"lambda ps: torch.optim.AdamW(ps, lr=1e-3)), got {describe(optimizer_factory)}"
        )
    if not isinstance(clip_mode, str) or clip_mode not in _CLIP_MODES:
        raise MemfitValueError(
            f"clip_mode {clip_mode!r} is not known; use 'exact' (an extra norm-only backward "
            "per step) or 'approx' (the previous step's norm, no extra compute)"
        )
    check_int(grad_accum_steps, "grad_accum_steps", 1)
    if max_grad_norm is not None:
        check_number(max_grad_norm, "max_grad_norm")
        if not max_grad_norm > 0:
            raise MemfitValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm!r}")
    check_bool(track_grad_norm, "track_grad_norm")
    if max_grad_norm is not None and clip_mode == "exact" and grad_accum_steps > 1:
        raise MemfitValueError(
            "exact gradient clipping with optimizer_in_backward needs the whole accumulated "
            "gradient before any step, which accumulation keeps in memory; use "
            "clip_mode='approx', or an ordinary optimizer with clip_grad_norm_"
        )


def _check(plan: Any) -> None:
    """The rules tying the fused step to the loss scaler and to exact clipping
    (``Technique.check``)."""
    if not isinstance(plan.optimizer_in_backward, bool):
        raise ValueError(
            "optimizer_in_backward must be true or false, got "
            f"{describe(plan.optimizer_in_backward)}"
        )
    if not plan.optimizer_in_backward:
        return
    if plan.parallel.world_size > 1 or plan.parallel.zero_stage:
        raise ValueError(
            "optimizer_in_backward cannot be combined with data parallelism: each gradient "
            "must be averaged across processes (in DDP's or FSDP2's buckets) before its "
            "step, which runs after the hooks the fused step uses; set optimizer_in_backward "
            "false"
        )
    if plan.precision.mode == "fp16-mixed":
        raise ValueError(
            "optimizer_in_backward cannot be combined with fp16-mixed: the loss scaler must "
            "see every gradient before any step; use bf16-mixed or bf16-pure instead"
        )
    if (
        plan.max_grad_norm is not None
        and plan.grad_clip_mode == "exact"
        and plan.grad_accum_steps > 1
    ):
        raise ValueError(
            "exact gradient clipping with optimizer_in_backward needs the whole accumulated "
            "gradient, which accumulation keeps; use grad_clip_mode 'approx' or set "
            "optimizer_in_backward false"
        )


#: The optimizer step fused into backward: built with the plan's optimizer (``memfit.apply``),
#: so nothing of its own is applied to the model before that.
TECHNIQUE = Technique(
    name="optimizer_in_backward",
    plan_field="optimizer_in_backward",
    order=121,
    engines=frozenset({"single", "hf", "lightning"}),
    forbid={"fused-step": "the optimizer step fused into backward"},
    summary=lambda _: "optimizer step in backward",
    check=_check,
)
