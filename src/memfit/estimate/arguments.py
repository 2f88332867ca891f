"""The checks the public runs of a workload (:func:`memfit.measure`, :func:`memfit.dry_run`,
:func:`memfit.predict_job`, :func:`memfit.measure_job`) make on their arguments before any
model is built (issue 37): ``measure(None)`` or ``measure(wl, plan="bf16")`` used to end in an
``AttributeError`` from deep inside, a seed of ``"x"`` in ``int()``'s own error."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..accounting.arguments import checked_cap
from ..errors import (
    MemfitTypeError,
    MemfitValueError,
    check_bool,
    check_int,
    check_number,
    check_type,
    describe,
)
from ..plan import Plan
from ..workload import Workload

__all__ = ["check_callable", "check_run_arguments", "check_workload", "check_workload_type"]


def check_workload(workload: Any, plan: Any, batch_size: Any, seq_len: Any, seed: Any) -> None:
    """The arguments every run shares: a :class:`Workload` or a SPEC string, a
    :class:`Plan` or ``None``, whole sizes >= 1 and a whole seed."""
    check_workload_type(workload)
    check_type(plan, (Plan, type(None)), "plan",
               "a memfit.Plan or None (build one with memfit.Plan(...) or Plan.from_dict(...))")
    check_int(batch_size, "batch_size", 1)
    check_int(seq_len, "seq_len", 1)
    check_int(seed, "seed")


def check_callable(value: Any, name: str, what: str) -> None:
    """``value`` is ``None`` or a function (``what`` says what it is called with); a module
    is callable too, but never a callback: passing one is a slip of position."""
    if value is not None and (not callable(value) or isinstance(value, nn.Module)):
        raise MemfitTypeError(f"{name} must be a function {what}, or None, got {describe(value)}")


def check_run_arguments(
    workload: Any,
    plan: Any,
    *,
    steps: Any,
    dry: Any,
    cap: Any,
    seed: Any,
    batch_size: Any,
    seq_len: Any,
    device: Any,
    progress: Any,
    expert_load: Any,
    stop: Any,
    at_forward_end: Any,
    keep_trace: Any,
    should_stop: Any,
) -> int | None:
    """Check :func:`~memfit.estimate.dryrun.measure`'s arguments; return the cap in bytes.

    ``device`` is only checked for its kind here: its name is the profiles' to judge
    (:func:`~memfit.targets.profiles.get_device`), which raises for an unknown one.
    """
    check_workload(workload, plan, batch_size, seq_len, seed)
    check_int(steps, "steps", 1)
    check_bool(dry, "dry")
    check_bool(keep_trace, "keep_trace")
    from ..targets import DeviceProfile

    check_type(device, (str, DeviceProfile, type(None)), "device",
               "a device name such as 'a100' or 'cpu', a custom description, a DeviceProfile "
               "or None")
    check_number(expert_load, "expert_load", 1)
    if stop not in (None, "forward"):
        raise MemfitValueError(f"stop must be 'forward' or None, got {describe(stop)}")
    check_callable(progress, "progress", "taking (step, steps)")
    check_callable(at_forward_end, "at_forward_end", "taking the tracker")
    check_callable(should_stop, "should_stop", "of no argument")
    return checked_cap(cap)



def check_workload_type(workload: Any) -> None:
    """A :class:`Workload` or a SPEC string; a bare model is told to wrap itself.

    Raises:
        MemfitTypeError: naming what was given and what is accepted.
    """
    if not isinstance(workload, (Workload, str)):
        hint = ""
        if hasattr(workload, "parameters") and hasattr(workload, "forward"):
            hint = " (a model alone has no batch or loss: wrap it in memfit.Workload)"
        raise MemfitTypeError(
            "workload must be a memfit.Workload or a SPEC string (a preset such as "
            f"'gpt2-tiny', a model folder or module:function), got {describe(workload)}{hint}"
        )
