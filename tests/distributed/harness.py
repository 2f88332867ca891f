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
import random
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

__all__ = [
    "PRELOAD",
    "assert_rank_peaks",
    "assert_ranks_equal_reference",
    "collectives_released_in_order",
    "free_port",
    "receive_buffers",
    "receive_shapes",
    "run_ranks",
    "tiny_llama",
    "token_batch",
    "unsplit_reference",
]

#: What the fork server imports once, so that no rank imports it again.
PRELOAD = ["torch", "torch.distributed", "transformers", "memfit", "memfit.apply.compose",
           "memfit.estimate.dryrun", "tests.distributed.harness"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, below the kernel's ephemeral
    range: a port the kernel hands out (``bind(0)``) can be taken, before the rendezvous binds
    it, as the local port of any client connection on the machine (another test's ranks
    connecting to their store: seen as ``EADDRINUSE`` with two test workers)."""
    low = _ephemeral_low()
    rng = random.Random()  # seeded from the OS: test workers pick apart
    for _ in range(100):
        port = rng.randrange(min(10_000, low - 1), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range starts here


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


def _use_count(t: Any) -> int:
    import torch

    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


@contextlib.contextmanager
def collectives_released_in_order(timeout: float = 5.0) -> Any:
    """FSDP2's collectives (``all_gather_single``, ``reduce_scatter_single``) return only once
    gloo's worker thread has let go of their tensors.

    gloo runs each collective on a worker thread, which marks it done (waking the caller) and
    only then drops its own reference to the input and output. On a loaded machine the caller
    can free its references and run on before the worker does, so a block's gathered
    parameters or unsharded gradients outlive their collective by however long the scheduler
    keeps the worker waiting, and the run's peak gains a block (seen in CI: +263,168 bytes,
    -8.1%, on one rank in one run of several). A measured peak that is to be compared with a
    prediction must follow the program's order, not the scheduler's: this waits (polling the
    storages' reference counts, at most ``timeout`` seconds) until the worker's references are
    gone. Synchronous calls only, as FSDP2 makes them on CPU.
    """
    import time

    import torch.distributed as dist

    originals = {name: getattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single")}

    def released(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            tensors = [t for t in (*args, *kwargs.values()) if hasattr(t, "untyped_storage")]
            before = [_use_count(t) for t in tensors]
            out = fn(*args, **kwargs)
            if kwargs.get("async_op"):
                return out
            deadline = time.monotonic() + timeout
            while any(_use_count(t) > n for t, n in zip(tensors, before, strict=True)):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.0005)
            return out
        return call

    for name, fn in originals.items():
        setattr(dist, name, released(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def run_ranks(fn: Callable[..., Any], world_size: int = 2, *args: Any,
              timeout: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; return their results
    by rank. ``fn`` and its results must be picklable (a module-level function). Raises
    ``AssertionError`` with a rank's traceback when one fails, or when the run outlives
    ``timeout`` seconds (every rank is then killed)."""
    for attempt in range(3):
        try:
            return _run_once(fn, world_size, args, timeout)
        except _PortTaken:
            if attempt == 2:
                raise AssertionError("the rendezvous port was taken three times running") from None
    raise AssertionError("unreachable")


class _PortTaken(Exception):
    """The rendezvous port was taken between choosing and binding it: run again on another."""


def _run_once(fn: Callable[..., Any], world_size: int, args: tuple, timeout: float) -> list[Any]:
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
            if status == "error" and "EADDRINUSE" in out and not outs:
                raise _PortTaken
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
    with warm(), collectives_released_in_order(), memfit.track(optimizer=opt) as tracker:
        tracker.label(layout.parameters(), "parameters")
        tracker.label(receive_buffers(layout), "other")
        tracker.add_inputs((inputs,))
        layout.step(inputs, inputs)
        opt.step()
    report = tracker.report()
    return {"loss": float(loss), "grads": grads, "peak": report.peak_bytes, "report": report,
            "optimizer": opt}


def _recv_infos(layout: Any) -> list[tuple[str, Any]]:
    """Each receive of the layout's pipeline stages on this rank, as ``("activations", info)``
    or ``("gradients", info)`` (torch's ``_RecvInfo``; root arguments left out)."""
    if layout.pipeline is None:
        return []
    schedule = layout.pipeline.schedule
    out = []
    for stage in getattr(schedule, "_stages", None) or [schedule._stage]:
        for kind, table in (("activations", stage.args_recv_info),
                            ("gradients", stage.grad_recv_info)):
            out += [(kind, i) for infos in table.values() for i in infos
                    if getattr(i, "tensor_meta", None) is not None
                    and not getattr(i, "is_root_arg", False)]
    return out


def receive_buffers(layout: Any) -> list[Any]:
    """The buffers torch's pipeline stages made at the first step to receive each micro-batch's
    activations and output gradients, kept from step to step (torch 2.13, 2.14). The tracker
    learns of a tensor made before it started when an operation touches it: a buffer not yet
    written at the warm step's peak would be missing from it, though the memory is held.
    Empty on torch 2.15, which allocates each buffer at its receive (the tracker sees it made)
    and leaves ``.buffer`` ``None`` between steps."""
    return [i.buffer for _, i in _recv_infos(layout) if getattr(i, "buffer", None) is not None]


def receive_shapes(layout: Any) -> list[tuple[str, tuple[int, ...], Any]]:
    """``(kind, shape, dtype)`` of every receive of the layout's stages on this rank (``kind``:
    ``"activations"`` or ``"gradients"``), from torch's metadata for it: the same on every
    torch, whether it keeps the buffers (2.13, 2.14) or makes them per receive (2.15)."""
    return [(kind, tuple(i.tensor_meta.shape), i.tensor_meta.dtype)
            for kind, i in _recv_infos(layout)]


def tiny_llama(vocab: int, seq: int, layers: int = 4, hidden: int = 64) -> Any:
    """The layout tests' model: a Llama of ``layers`` blocks, width ``hidden``, 4 query and 2
    key-value heads, seeded alike on every rank, in training mode, no dropout."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=128,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=seq, attention_dropout=0.0)
    return LlamaForCausalLM(config).train()


def token_batch(batch: int, seq: int, vocab: int) -> Any:
    """The layout tests' batch of token ids, the same on every rank."""
    import torch

    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


def unsplit_reference(model: Any, ids: Any) -> tuple[float, dict[str, Any]]:
    """The unsplit model's loss and gradients on the whole batch (``ids`` as the labels too):
    what every layout's numerics test compares its ranks against."""
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}


def assert_rank_peaks(measured: list[int], predicted: list[int], rtol: float,
                      where: str = "") -> None:
    """Each rank's measured peak within ``rtol`` of its predicted one; the message lists every
    rank's pair and error."""
    import pytest

    rows = "; ".join(f"rank {r}: measured {m} B, predicted {p} B ({(p - m) / m:+.2%})"
                     for r, (m, p) in enumerate(zip(measured, predicted, strict=True)))
    for m, p in zip(measured, predicted, strict=True):
        assert p == pytest.approx(m, rel=rtol), f"{where}{rows}"


def assert_ranks_equal_reference(results: list[dict], name: str, parallel: Any,
                                 reference: tuple[float, dict[str, Any]], rtol: float) -> None:
    """Each rank of the run ``name`` sits at its layout coordinates and reports the unsplit
    model's loss, and the gradients gathered from every rank equal the unsplit model's."""
    import pytest

    from memfit.distributed.layout import layout_coords

    want_loss, want = reference
    got: dict[str, Any] = {}
    for r, rank_out in enumerate(results):
        out = rank_out[name]
        assert out["coords"] == layout_coords(r, parallel)
        assert out["loss"] == pytest.approx(want_loss, rel=rtol)
        got.update(out["grads"])
    assert set(got) == set(want)
    assert_gradients_close(got, want, rtol, where=f"{name}: ")


def assert_gradients_close(got: dict, want: dict, rtol: float, where: str = "") -> None:
    """Every gradient of ``want`` in ``got`` to ``rtol``, absolute tolerance relative to the
    gradient's largest entry (only the order of the sums differs)."""
    import torch

    for n, g in want.items():
        torch.testing.assert_close(got[n], g, rtol=rtol, atol=rtol * float(g.abs().max()),
                                   msg=f"{where}{n}")
