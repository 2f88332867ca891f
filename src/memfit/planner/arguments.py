"""The checks :func:`memfit.plan` runs on its arguments before any search (issue 37).

A wrong argument used to surface minutes later, or deep inside, as an ``AttributeError``
(``plan(None, ...)``), or be misread (``allow="8bit"`` split into characters, a budget of
``4.5`` read as 4 bytes and then a 37 s search for a plan in 4 bytes). Here each argument is
checked against what it accepts, in one sentence naming it, and the names the searches take
are normalised (``allow``/``forbid`` to tuples of names).
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import (
    MemfitTypeError,
    MemfitValueError,
    check_int,
    check_names,
    check_number,
    check_type,
    describe,
)
from ..plan import Plan
from ..targets import DeviceProfile
from ..targets.profiles import parse_budget
from ..workload import Workload
from .candidates import allow_names, forbid_names

__all__ = ["check_plan_arguments"]


def check_plan_arguments(
    workload: Any, budget: Any, settings: dict[str, Any], **layout: Any
) -> dict[str, Any]:
    """Check :func:`memfit.planner.plan`'s arguments; return ``settings`` normalised.

    Args:
        workload: A :class:`Workload`, or a SPEC string (which needs ``batch_size`` and
            ``seq_len`` in ``settings``, as the docstring of :func:`memfit.plan` says).
        budget: Bytes, a size string or a device name (:func:`parse_budget`).
        settings: The keyword arguments the searches share (``batch_size`` ... ``jobs``, and
            ``lora_rank`` when given).
        layout: ``world_size``, ``gpus_per_node`` and ``expert_load``.

    Raises:
        MemfitTypeError: for an argument of a kind it does not accept.
        MemfitValueError: for a value it does not accept.
    """
    _check_workload(workload, settings)
    parse_budget(budget)
    if settings["host_budget"] is not None:
        host = settings["host_budget"]
        try:
            parse_budget(host)
        except (MemfitTypeError, MemfitValueError) as e:
            raise type(e)(f"host_budget: {e}") from None
    check_int(layout.get("world_size"), "world_size", 1, optional=True)
    check_int(layout.get("gpus_per_node"), "gpus_per_node", 1, optional=True)
    check_number(layout.get("expert_load", 1.0), "expert_load", 1)
    check_int(settings["jobs"], "--jobs", 1)
    check_int(settings.get("lora_rank"), "--lora-rank", 1, optional=True)
    check_int(settings["max_predictions"], "max_predictions", 1)
    check_type(settings["base"], (Plan, type(None)), "base",
               "a memfit.Plan or None (a precision is Plan(precision='bf16'))")
    check_type(settings["device"], (str, DeviceProfile, type(None)), "device",
               "a device name such as 'a100', a custom description, a DeviceProfile or None")
    progress = settings["progress"]
    if progress is not None and not callable(progress):
        raise MemfitTypeError(
            f"progress must be a function taking a message, or None, got {describe(progress)}"
        )
    disk_dir = settings["disk_dir"]
    check_type(disk_dir, (str, os.PathLike, type(None)), "disk_dir", "a folder path or None")
    out = dict(settings)
    if disk_dir is not None:
        out["disk_dir"] = os.fspath(disk_dir)
    out["allow"] = check_names(settings["allow"], allow_names(), "--allow")
    out["forbid"] = check_names(settings["forbid"], forbid_names(), "--forbid")
    _check_sizes(workload, settings)  # last: the SPEC's sizes are the least likely mistake
    return out


def _check_workload(workload: Any, settings: dict[str, Any]) -> None:
    check_int(settings["batch_size"], "batch_size", 1, optional=True)
    check_int(settings["seq_len"], "seq_len", 1, optional=True)
    if not isinstance(workload, (Workload, str)):
        hint = ""
        if hasattr(workload, "parameters") and hasattr(workload, "forward"):
            hint = " (a model alone has no batch or loss: wrap it in memfit.Workload)"
        raise MemfitTypeError(
            "workload must be a memfit.Workload or a SPEC string (a preset such as "
            f"'gpt2-tiny', a model folder or module:function), got {describe(workload)}{hint}"
        )


def _check_sizes(workload: Any, settings: dict[str, Any]) -> None:
    if not isinstance(workload, str):
        return
    missing = [n for n in ("batch_size", "seq_len") if settings[n] is None]
    if missing:
        raise MemfitValueError(
            f"workload {workload!r} is a SPEC, which plan() builds at a size: give "
            f"{' and '.join(missing)} (samples per optimizer step, tokens per sample)"
        )
