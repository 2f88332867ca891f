"""Run a function in N real processes joined by a gloo process group on loopback.

Every distributed test uses :func:`run_ranks`: real processes, real collectives, ``127.0.0.1``
only, a free port per run, and a timeout after which every rank is killed, so a broken
collective fails the test instead of hanging CI.

The ranks are forked by multiprocessing's fork server, started once per test process with
torch, transformers and memfit imported (:data:`PRELOAD`): a fresh interpreter per rank spent
seconds of CPU on imports before any collective, which made these tests the suite's long
pole. The server has no threads and no process group of its own, so each fork starts clean,
as ``spawn`` would.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

__all__ = ["PRELOAD", "free_port", "run_ranks"]

#: What the fork server imports once, so that no rank imports it again.
PRELOAD = ["torch", "torch.distributed", "transformers", "memfit", "memfit.apply.compose",
           "memfit.estimate.dryrun", "tests.distributed.harness"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple,
           results: Any) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)  # two ranks share two cores
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        # Plain pickle bytes, not torch's shared-memory tensors: the rank may exit before the
        # parent reads them.
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # reported to the parent, which raises
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int = 2, *args: Any,
              timeout: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; return their results
    by rank. ``fn`` and its results must be picklable (a module-level function). Raises
    ``AssertionError`` with a rank's traceback when one fails, or when the run outlives
    ``timeout`` seconds (every rank is then killed)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, args, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    outs: dict[int, Any] = {}
    try:
        while len(outs) < world_size:
            try:
                rank, status, out = results.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"ranks did not finish within {timeout} s") from None
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{out}")
            outs[rank] = pickle.loads(out)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return [outs[r] for r in range(world_size)]


def step_then_track(layout: Any, inputs: Any, warm: Any = contextlib.nullcontext) -> dict:
    """A layout's first step (:func:`~memfit.distributed.layout.build_layout`'s, inputs as
    labels), then a warm step (forward, backward, AdamW step: the first inferred the shapes
    between stages and made the optimizer's state) under memfit's tracker and ``warm()``.

    Returns:
        ``loss`` (the first step's), ``grads`` (its gradients gathered whole, under the
        model's names), ``peak`` (the warm step's tracked peak), ``report`` (its memory
        report) and ``optimizer``.
    """
    import torch

    import memfit

    opt = torch.optim.AdamW(layout.parameters(), lr=1e-3)
    loss = layout.step(inputs, inputs)
    grads = layout.full_grads()
    opt.step()
    opt.zero_grad(set_to_none=True)
    with warm(), memfit.track(optimizer=opt) as tracker:
        tracker.label(layout.parameters(), "parameters")
        tracker.add_inputs((inputs,))
        layout.step(inputs, inputs)
        opt.step()
    report = tracker.report()
    return {"loss": float(loss), "grads": grads, "peak": report.peak_bytes, "report": report,
            "optimizer": opt}


def assert_gradients_close(got: dict, want: dict, rtol: float, where: str = "") -> None:
    """Every gradient of ``want`` in ``got`` to ``rtol``, absolute tolerance relative to the
    gradient's largest entry (only the order of the sums differs)."""
    import torch

    for n, g in want.items():
        torch.testing.assert_close(got[n], g, rtol=rtol, atol=rtol * float(g.abs().max()),
                                   msg=f"{where}{n}")
