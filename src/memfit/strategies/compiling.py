"""``torch.compile`` as a plan technique: :func:`apply_compile`.

Built on :meth:`torch.nn.Module.compile` (the module's calls go through the compiled
function; the module object, its parameters, hooks and state dict stay the same), which
:meth:`CompileHandle.remove` undoes. What memfit adds is the accounting: compiling changes which
activations the backward keeps (AOTAutograd's min-cut partitioner recomputes cheap pointwise
results instead of saving them) and fuses temporaries away, none of which a dry run on fake
tensors can see. :func:`compiled_saved_ratio` measures it instead (see its docstring), once per
model and plan, at a small size.

The optimizer step is compiled only where it helps: on CUDA, where torch's foreach kernels
launch one kernel per parameter group and inductor fuses them. On the CPU the eager loop is
already one pass per tensor and compiling it costs minutes of compile time for no saving.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..techniques import ApplyContext, Technique

__all__ = [
    "COMPILE_BACKENDS",
    "CompileHandle",
    "apply_compile",
    "compiled_saved_ratio",
    "saved_bytes",
]

#: ``torch.compile`` backends a plan may name: ``inductor`` (what ``compile: true`` means:
#: generated kernels), ``aot_eager_decomp_partition`` (inductor's decompositions and min-cut
#: partitioner with eager kernels: the same saved activations, no code generation) and
#: ``aot_eager`` (AOTAutograd's default partition, eager kernels).
COMPILE_BACKENDS = ("inductor", "aot_eager_decomp_partition", "aot_eager")


@dataclass
class CompileHandle:
    """A model compiled by :func:`apply_compile`; :meth:`remove` makes it eager again."""

    model: nn.Module
    backend: str

    def remove(self) -> None:
        """Drop the compiled call (idempotent); the model's next call runs eagerly."""
        self.model._compiled_call_impl = None  # what Module.compile sets


def apply_compile(model: nn.Module, backend: str = "inductor") -> CompileHandle:
    """Compile ``model``'s forward (and so its backward) with ``torch.compile``.

    Args:
        model: The model, with the plan's other techniques already applied (compiling last
            lets dynamo trace their wrappers).
        backend: One of :data:`COMPILE_BACKENDS`.

    Raises:
        ValueError: for an unknown backend.
    """
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"compile backend {backend!r} is not known; use one of {', '.join(COMPILE_BACKENDS)}")
    model.compile(backend=backend)
    return CompileHandle(model, backend)


def saved_bytes(run: Callable[[], torch.Tensor], model: nn.Module | None = None) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``run()`` computes a
    loss (counted by :func:`torch.autograd.graph.saved_tensors_hooks`, which sees the tensors a
    compiled region saves as well as eager ones), not counting ``model``'s parameters and
    buffers (saved by reference, they are no activation); backward is then run to free them."""
    seen: dict[int, int] = {}
    own = set()
    if model is not None:
        own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}

    def pack(t: torch.Tensor) -> torch.Tensor:
        with contextlib.suppress(RuntimeError):  # tensors without storage (sparse, ...)
            storage = t.untyped_storage()
            if storage.data_ptr() not in own:
                seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run()
    loss.backward()
    return sum(seen.values())


@contextlib.contextmanager
def _fresh_dynamo() -> Iterator[None]:
    """Dynamo's caches emptied before and after (process-wide: a measurement should not reuse,
    or leave behind, another model's compiled code)."""
    import torch._dynamo

    torch._dynamo.reset()
    try:
        yield
    finally:
        torch._dynamo.reset()


def compiled_saved_ratio(
    build: Callable[[], tuple[nn.Module, Callable[[], torch.Tensor]]],
    backend: str = "aot_eager_decomp_partition",
) -> tuple[int, int]:
    """Saved-for-backward bytes of one training step, eager and compiled, measured for real.

    ``build()`` returns a model small enough to run here and a function computing its loss.
    It is called twice: once the step runs eagerly, once through ``torch.compile`` with
    ``backend``. The default backend runs inductor's decompositions and its min-cut
    partitioner, which decide what the compiled backward keeps, with eager kernels: the same
    saved activations as ``inductor`` without minutes of code generation. Temporaries inside
    inductor's fused kernels are in neither figure (they live only within a kernel).

    Returns:
        ``(eager_bytes, compiled_bytes)``.
    """
    model, run = build()
    eager = saved_bytes(run, model)
    del model, run  # one model alive at a time
    model, run = build()
    with _fresh_dynamo():
        handle = apply_compile(model, backend)
        try:
            compiled = saved_bytes(run, model)
        finally:
            handle.remove()
    return eager, compiled


def _apply_technique(model: nn.Module, ctx: ApplyContext) -> CompileHandle | None:
    from torch._guards import active_fake_mode

    backend = ctx.plan.compile_backend
    if active_fake_mode() is not None:
        # Dynamo cannot trace a model of fake tensors: a dry run runs it eagerly and applies
        # the compiled step's measured saving (memfit.estimate.dryrun).
        ctx.info["compiled"] = "eager in the dry run (saving measured for real)"
        return None
    handle = apply_compile(model, backend)
    ctx.info["compiled"] = backend
    return handle


def _refusal(plan: Any, engine: str) -> str | None:
    if engine == "lightning":
        return (
            "compile is not applied by the Lightning callback; compile the LightningModule "
            "yourself (torch.compile) or set compile false"
        )
    return None


def _check(plan: Any) -> None:
    """The switch or backend (``Technique.check``)."""
    if not (
        isinstance(plan.compile, bool)
        or (isinstance(plan.compile, str) and plan.compile in COMPILE_BACKENDS)
    ):
        raise ValueError(
            f"compile must be true, false or a backend ({', '.join(COMPILE_BACKENDS)}), "
            f"got {plan.compile!r}"
        )


#: torch.compile last among the model transforms, so dynamo traces the others' wrappers.
TECHNIQUE = Technique(
    name="compile",
    plan_field="compile",
    order=90,
    is_on=lambda plan: plan.compile_backend is not None,
    apply=_apply_technique,
    info_key="compiled",
    engines=frozenset({"single", "data", "hf"}),
    refusal=_refusal,
    summary=lambda compile: (
        "compiled" if compile is True or compile == "inductor" else f"compiled ({compile})"
    ),
    check=_check,
)
