"""FP8 training: torchao's float8 linears under bf16 autocast, over fp32 master weights.

``precision: fp8`` is ``bf16-mixed`` (fp32 weights, gradients and optimizer state; the forward
under bf16 autocast) with every eligible ``nn.Linear`` converted by torchao's
``convert_to_float8_training`` to a ``Float8Linear`` of torchao's default recipe (dynamic
tensorwise scaling, e4m3 forward and e5m2 gradients). This follows torchtitan, whose float8
training keeps fp32 masters and computes in bf16 around the float8 matmuls.

Eligible: an ``nn.Linear`` (not a subclass) whose ``in_features`` and ``out_features`` are
multiples of 16 (the float8 GEMM's alignment) and that is not the output head
(``get_output_embeddings()``, or a linear sharing its weight with an embedding): the head's
logits feed the loss, where float8's rounding costs the most accuracy for the least time.

What one step keeps, and why it is at most bf16-mixed's:

* a ``Float8Linear`` saves its *high-precision* input (bf16 under autocast) and its weight
  for backward, and casts both to float8 again there. The weight it saves is the fp32
  parameter itself (no copy), where autocast's ``linear`` saves a bf16 copy of every weight
  until backward; so fp8 keeps 2 bytes per converted weight less than bf16-mixed, and the same
  activations;
* the casts themselves (``abs``, ``amax``, scaling, clamping, the float8 payload and its
  0-dimensional fp32 scale) are temporaries of one linear at a time: in eager mode they are
  freed before the next op, and the peak sees at most one layer's worth.

On an H200 (``benchmarks/results/gpu_h200.md``, llama-1b, bf16 weights, eager) the float8
linears kept exactly what bf16 kept (19.54 GiB max allocated, 8.65 GiB held after one forward)
and ran 2.5x slower: eager float8 pays for its casts; its speed needs ``torch.compile``, which
fuses them (that is a plan's ``compile``). The step-time model charges that measured factor
(:data:`FP8_EAGER_SLOWDOWN`).

Where it runs: a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell:
``rtx4090``, ``h100``, ``h200``), and a CPU whose PyTorch runs ``torch._scaled_mm`` on float8
tensors (recent CPU builds do; :func:`fp8_problem` tries it once). Elsewhere (``a100``,
``t4``) a plan with fp8 is refused with one sentence. A dry run executes torchao's own code
on fake tensors (``torch._scaled_mm`` has a fake kernel that gives the output's shape and
dtype), so it keeps what the real float8 path keeps; on the CPU, dry and real runs are equal
to the byte (``tests/strategies/test_fp8.py``).

The runtime's ``remove()`` (:class:`memfit.strategies.precision.Fp8Runtime`) puts the original ``nn.Linear`` modules back: the same module
objects, holding the same parameter objects (the float8 linears only borrowed them), so an
optimizer built over the converted model keeps working on the restored one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["FP8_EAGER_SLOWDOWN", "FP8_MIN_CAPABILITY", "Fp8Conversion", "apply_fp8", "fp8_eligible", "fp8_problem"]

#: How much longer an eager step's matmuls take under ``fp8`` (torchao's float8 linears)
#: than in bf16: measured 2.46x per step on an H200 (llama-1b, 2 x 2048 tokens, tensorwise;
#: ``benchmarks/results/gpu_h200.md``), where the separate cast kernels outweigh the faster
#: float8 GEMMs. Charged on the matmul term, which dominates such a step; a compiled step
#: (which fuses the casts) is charged at the bf16 rate, not measured yet.
FP8_EAGER_SLOWDOWN = 2.46

#: The first CUDA compute capability with float8 tensor cores (Ada Lovelace, sm89).
FP8_MIN_CAPABILITY: tuple[int, int] = (8, 9)


def fp8_problem(target: Any) -> str | None:
    """Why ``target`` (a :class:`~memfit.targets.DeviceProfile`) cannot train in fp8, as one
    sentence, or ``None`` when it can."""
    if getattr(target, "is_cuda", False):
        cc = target.compute_capability
        if cc is not None and tuple(cc) >= FP8_MIN_CAPABILITY:
            return None
        shown = f"{cc[0]}.{cc[1]}" if cc is not None else "unknown"
        return (
            f"{target.name} (compute capability {shown}) has no float8 matmuls, which need "
            "compute capability 8.9 or newer (rtx4090, h100, h200), so precision 'fp8' cannot "
            "run there; use bf16-mixed"
        )
    if getattr(target, "kind", None) == "cpu":
        return _cpu_problem()
    return None


def _cpu_problem() -> str | None:
    if _cpu_scaled_mm():
        return None
    return (
        f"this PyTorch ({torch.__version__}) has no float8 matmul on the CPU "
        "(torch._scaled_mm), so precision 'fp8' cannot run here; use bf16-mixed"
    )


def _device_problem(model: nn.Module) -> str | None:
    """Why the device ``model``'s parameters are on cannot run float8 matmuls (a real run;
    under fake tensors the dry run's target was checked by ``plan_for_target``)."""
    from ..device import device_capability, is_cuda, is_fake

    p = next(iter(model.parameters()), None)
    if p is None or is_fake(p):
        return None
    if is_cuda(p.device):
        cc = device_capability(p.device)
        if cc is not None and cc < FP8_MIN_CAPABILITY:
            return (
                f"this GPU (compute capability {cc[0]}.{cc[1]}) has no float8 matmuls, which "
                "need compute capability 8.9 or newer, so precision 'fp8' cannot run here; use "
                "bf16-mixed"
            )
        return None
    return _cpu_problem() if p.device.type == "cpu" else None


@functools.cache
def _cpu_scaled_mm() -> bool:
    # One tiny float8 matmul: CPU builds that lack the kernel raise (NotImplementedError or a
    # RuntimeError naming the dtype). Real tensors even inside a dry run's fake mode, where
    # the fake kernel would answer for any build.
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    try:
        with unset_fake_temporarily():
            a = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
            b = torch.zeros(16, 16, dtype=torch.float8_e4m3fn).t()
            one = torch.ones((), dtype=torch.float32)
            torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return False
    return True


def _head_ids(model: nn.Module) -> set[int]:
    """The output head's module id (and any linear sharing an embedding's weight)."""
    ids: set[int] = set()
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if isinstance(head, nn.Module):
        ids.add(id(head))
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for m in model.modules():
        if isinstance(m, nn.Linear) and id(m.weight) in embedded:
            ids.add(id(m))
    return ids


def fp8_eligible(module: nn.Module, head_ids: set[int] | frozenset[int] = frozenset()) -> bool:
    """Whether ``module`` is converted: a plain ``nn.Linear`` whose dimensions are multiples of
    16 and that is not the output head (``head_ids``)."""
    return (
        type(module) is nn.Linear
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
        and id(module) not in head_ids
    )


def _cast_to_autocast(module: nn.Module, args: tuple) -> tuple | None:
    # torchao's Float8Linear casts its input to the autocast dtype only under CUDA autocast
    # (torch.is_autocast_enabled() with no device); CPU autocast would hand it fp32 inputs and
    # it would save those for backward. Casting here, for the input's own device, makes the CPU
    # path keep what the GPU's keeps (on CUDA torchao's own cast then finds bf16: a no-op).
    if not args or not isinstance(args[0], torch.Tensor):
        return None
    x = args[0]
    device = x.device.type
    if not x.is_floating_point() or not torch.is_autocast_enabled(device):
        return None
    dtype = torch.get_autocast_dtype(device)
    if x.dtype == dtype:
        return None
    return (x.to(dtype), *args[1:])


@dataclass
class _Swap:
    fqn: str
    parent: nn.Module
    name: str
    original: nn.Module
    hook: Any


class Fp8Conversion:
    """What :func:`apply_fp8` converted, and how to undo it."""

    def __init__(self, swaps: list[_Swap]) -> None:
        self._swaps = swaps

    @property
    def converted(self) -> list[str]:
        """Qualified names of the linears now computing in float8 (empty after removal)."""
        return [s.fqn for s in self._swaps]

    def undo(self) -> None:
        """Put every original ``nn.Linear`` back (same module and parameter objects)."""
        swaps, self._swaps = self._swaps, []
        for swap in reversed(swaps):
            current = getattr(swap.parent, swap.name)
            swap.hook.remove()
            # The float8 linear borrowed the parameters; the original still holds them. A
            # parameter replaced meanwhile (a cast, a fake-tensor swap) is carried back.
            for key in ("weight", "bias"):
                p = current._parameters.get(key)
                if p is not None and swap.original._parameters.get(key) is not p:
                    swap.original._parameters[key] = p
            setattr(swap.parent, swap.name, swap.original)


def apply_fp8(model: nn.Module) -> Fp8Conversion:
    """Convert ``model``'s eligible linears (:func:`fp8_eligible`) to torchao's float8 linears.

    Returns:
        The record of what was converted; its ``undo()`` restores the original modules.

    Raises:
        ImportError: without torchao (install ``memfit[fp8]``).
        RuntimeError: when the model already has float8 linears.
        ValueError: when the model is on a device without float8 matmuls (one sentence).
    """
    problem = _device_problem(model)
    if problem is not None:
        raise ValueError(problem)
    from ..extras import import_extra

    import_extra("torchao", "precision 'fp8' (torchao's float8 training, --allow fp8)", "fp8")
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear
    except ImportError as e:  # pragma: no cover - torchao is installed in the test env
        raise ImportError(
            "precision 'fp8' needs torchao's float8 training (pip install 'memfit[fp8]')"
        ) from e
    if any(isinstance(m, Float8Linear) for m in model.modules()):
        raise RuntimeError(
            f"{type(model).__name__} already has float8 linears; call remove() on the runtime "
            "apply_precision returned before applying precision again"
        )
    heads = _head_ids(model)
    places: dict[str, tuple[nn.Module, str, nn.Module]] = {}  # fqn -> parent, name, linear
    for parent_name, parent in model.named_modules():
        for name, child in parent.named_children():
            if fp8_eligible(child, heads):
                fqn = f"{parent_name}.{name}" if parent_name else name
                places[fqn] = (parent, name, child)

    def keep(module: nn.Module, fqn: str) -> bool:
        return fqn in places and places[fqn][2] is module

    # The default config is the tensorwise recipe (dynamic per-tensor scales).
    convert_to_float8_training(model, module_filter_fn=keep, config=Float8LinearConfig())
    swaps = []
    for fqn, (parent, name, original) in places.items():
        new = getattr(parent, name)
        if new is original:
            continue  # not swapped (torchao declined it)
        hook = new.register_forward_pre_hook(_cast_to_autocast)
        swaps.append(_Swap(fqn, parent, name, original, hook))
    return Fp8Conversion(swaps)
