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
)
from ..estimate.arguments import check_callable, check_workload_type
from ..plan import Plan
from ..targets import DeviceProfile
from ..targets.profiles import parse_budget
from ..workload import Workload
from .candidates import allow_names, forbid_names

__all__ = ["check_plan_arguments"]


def check_plan_arguments(
    workload: Any,
    budget: Any,
    *,
    world_size: Any,
    gpus_per_node: Any,
    expert_load: Any,
    lora_rank: Any,
    **settings: Any,
) -> dict[str, Any]:
    """Check :func:`memfit.planner.plan`'s arguments; return the settings the searches share.

    Args:
        workload: A :class:`Workload`, or a SPEC string (which needs ``batch_size`` and
            ``seq_len``, as the docstring of :func:`memfit.plan` says).
        budget: Bytes, a size string or a device name (:func:`parse_budget`).
        world_size: Processes, or ``None``.
        gpus_per_node: Devices per node, or ``None``.
        expert_load: A number >= 1.
        lora_rank: A whole number >= 1, or ``None``.
        settings: The other keyword arguments (``batch_size`` ... ``jobs``).

    Returns:
        ``settings``, with ``allow``/``forbid`` as tuples of names, ``disk_dir`` as a string
        and ``lora_rank`` when given.

    Raises:
        MemfitTypeError: for an argument of a kind it does not accept.
        MemfitValueError: for a value it does not accept.
    """
    if lora_rank is not None:
        settings["lora_rank"] = lora_rank
    _check_workload(workload, settings)
    parse_budget(budget)
    if settings["host_budget"] is not None:
        host = settings["host_budget"]
        try:
            parse_budget(host)
        except (MemfitTypeError, MemfitValueError) as e:
            raise type(e)(f"host_budget: {e}") from None
    check_int(world_size, "world_size", 1, optional=True)
    check_int(gpus_per_node, "gpus_per_node", 1, optional=True)
    check_number(expert_load, "expert_load", 1)
    check_int(settings["jobs"], "--jobs", 1)
    check_int(settings.get("lora_rank"), "--lora-rank", 1, optional=True)
    check_int(settings["max_predictions"], "max_predictions", 0)
    check_type(settings["base"], (Plan, type(None)), "base",
               "a memfit.Plan or None (a precision is Plan(precision='bf16'))")
    check_type(settings["device"], (str, DeviceProfile, type(None)), "device",
               "a device name such as 'a100', a custom description, a DeviceProfile or None")
    check_callable(settings["progress"], "progress", "taking a message")
    disk_dir = settings["disk_dir"]
    check_type(disk_dir, (str, os.PathLike, type(None)), "disk_dir", "a folder path or None")
    out = dict(settings)
    if disk_dir is not None:
        out["disk_dir"] = os.fspath(disk_dir)
    out["allow"] = check_names(settings["allow"], allow_names(), "--allow")
    out["forbid"] = check_names(settings["forbid"], forbid_names(), "--forbid")
    _check_sizes(workload, settings)
    _check_searches(workload, out, world_size=world_size, gpus_per_node=gpus_per_node,
                    expert_load=expert_load)
    return out


def _check_workload(workload: Any, settings: dict[str, Any]) -> None:
    check_int(settings["batch_size"], "batch_size", 1, optional=True)
    check_int(settings["seq_len"], "seq_len", 1, optional=True)
    check_workload_type(workload)


def _check_sizes(workload: Any, settings: dict[str, Any]) -> None:
    if not isinstance(workload, str):
        return
    missing = [n for n in ("batch_size", "seq_len") if settings[n] is None]
    if missing:
        raise MemfitValueError(
            f"workload {workload!r} is a SPEC, which plan() builds at a size: give "
            f"{' and '.join(missing)} (samples per optimizer step, tokens per sample)"
        )


def _check_searches(
    workload: Any, settings: dict[str, Any], *, world_size: int | None,
    gpus_per_node: int | None, expert_load: float,
) -> None:
    """What the chosen search cannot honour, refused before it starts: the same sentences
    as the searches' own (and the CLI's), which would otherwise come after a model build."""
    allow, disk_dir = settings["allow"], settings["disk_dir"]
    if "lora_rank" in settings and world_size is not None:
        raise MemfitValueError(
            "--lora-rank is searched in one process only; leave out --world-size")
    if gpus_per_node is not None:
        if world_size is None:
            raise MemfitValueError(
                "--gpus-per-node describes the machines of --world-size; give both")
        _check_layout(allow, disk_dir, world_size, gpus_per_node)
        return
    if expert_load != 1:
        raise MemfitValueError(
            "--expert-load is priced by the layout planner, which splits experts; give "
            "--world-size and --gpus-per-node, or profile a plan with memfit profile "
            "--dry-run --expert-load")
    if disk_dir is not None:
        if "offload" not in allow:
            raise MemfitValueError(
                "--disk-dir is where offload puts state on disk: add --allow offload")
        if not os.path.isdir(disk_dir):
            raise MemfitValueError(
                f"--disk-dir {disk_dir!r} is not an existing directory; create it first")
    batch = workload.batch_size if isinstance(workload, Workload) else settings["batch_size"]
    if world_size is not None and batch % world_size:
        raise MemfitValueError(
            f"--world-size {world_size} does not divide the batch of {batch} samples; use a "
            f"batch size that is a multiple of {world_size}"
        )


def _check_layout(
    allow: tuple[str, ...], disk_dir: str | None, world_size: int, gpus_per_node: int
) -> None:
    """The options the layout search (``gpus_per_node``) refuses, as it words them."""
    if allow:
        raise MemfitValueError(
            f"--allow {','.join(allow)} is not searched with --gpus-per-node (the layout "
            "planner keeps the plan's precision and optimizer and offloads nothing); leave "
            "out --gpus-per-node to plan data parallelism with it, or give the optimizer or "
            "precision in --plan"
        )
    if disk_dir is not None:
        raise MemfitValueError(
            "--disk-dir is where offload puts state on disk, and the layout planner "
            "(--gpus-per-node) offloads nothing; leave out one or the other"
        )
    if world_size % gpus_per_node and world_size > gpus_per_node:
        raise MemfitValueError(
            f"--gpus-per-node {gpus_per_node} does not divide --world-size {world_size}; nodes "
            "hold the same number of devices, so use a world size that is a multiple of "
            f"{gpus_per_node}"
        )
