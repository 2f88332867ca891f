"""What ``torch.compile`` saves, for dry runs: measured once for real, at a small size.

A dry run executes on fake tensors, which dynamo cannot compile, so it runs a compiled plan's
model eagerly. Compiling changes memory in two ways a dry run cannot see: AOTAutograd's
min-cut partitioner keeps fewer activations for backward (it recomputes cheap pointwise
results), and inductor's fused kernels never materialise the intermediates of a pointwise
chain. The first dominates at training scale (kept activations are most of the peak), and it
is what :func:`compiled_activation_scale` measures: the saved-for-backward bytes of one step of
the same model at depth 2, batch 1 and at most 64 tokens, eager and compiled
(:func:`memfit.strategies.compiling.compiled_saved_ratio`), for real on this machine. The model's own
parameters and buffers are not counted (autograd saves them by reference). The measurement
builds that small model for real, one at a time, so it is skipped (no saving applied, and the
report says so) when its parameters exceed :data:`MEASURE_LIMIT_BYTES`. The dry
run's kept activations are scaled by that ratio. The second is not applied (temporaries are
left as eager has them), so a compiled plan's prediction errs on the high side.
"""

from __future__ import annotations

from typing import Any

from ..plan import Plan
from ..workload import Workload, call_model

__all__ = ["compiled_activation_scale"]

_CACHE: dict[tuple[Any, ...], tuple[int, int]] = {}

#: Most bytes of parameters the small model measured for real may have; a larger one is not
#: built (the saving is then not applied, and the report says so).
MEASURE_LIMIT_BYTES = 2 << 30

#: The partitioner-equivalent backend each plan backend is measured with.
_MEASURE_WITH = {"inductor": "aot_eager_decomp_partition"}


def _parameter_bytes(workload: Workload) -> int:
    """Bytes of ``workload``'s parameters, counted on fake tensors (nothing allocated)."""
    from .fake_kernels import dry_tensors

    with dry_tensors():
        model = workload.build_model()
        return sum(p.numel() * p.element_size() for p in model.parameters())


def compiled_activation_scale(workload: Workload, plan: Plan, *, seed: int = 0) -> dict[str, Any]:
    """Kept activations of a compiled step over an eager one, measured for real at a small size.

    Returns:
        ``{"scale", "eager_saved_bytes", "compiled_saved_bytes", "backend", "measured_at"}``.
    """
    from ..apply.compose import apply_plan
    from ..strategies.compiling import compiled_saved_ratio

    backend = plan.compile_backend or "inductor"
    small = workload
    if workload.with_depth is not None and (workload.depth or 0) > 2:
        small = workload.with_depth(2)
    small = small.replace(batch_size=1, seq_len=min(workload.seq_len, 64))
    eager_plan = plan.replace(compile=False, grad_accum_steps=1, micro_batch_size=None)
    key = (workload.name, workload.depth, small.seq_len, eager_plan.to_json(), backend, seed)
    if key not in _CACHE and _parameter_bytes(small) > MEASURE_LIMIT_BYTES:
        return {
            "scale": 1.0,
            "eager_saved_bytes": None,
            "compiled_saved_bytes": None,
            "backend": backend,
            "measured_at": "not measured: the model at depth 2 is too large to build here",
        }
    if key not in _CACHE:

        def build() -> Any:
            model, batch = small.build(seed=seed)
            setup = apply_plan(model, eager_plan, loss_fn=small.loss_fn)

            def run() -> Any:
                with setup.precision.autocast():
                    return setup.loss_fn(call_model(model, batch), batch)

            return model, run

        _CACHE[key] = compiled_saved_ratio(build, _MEASURE_WITH.get(backend, backend))
    eager, compiled = _CACHE[key]
    return {
        "scale": compiled / eager if eager else 1.0,
        "eager_saved_bytes": eager,
        "compiled_saved_bytes": compiled,
        "backend": backend,
        "measured_at": f"depth {small.depth or '-'}, batch 1, length {small.seq_len}",
    }
