"""DeepSpeed ZeRO-2 / ZeRO-3 on several CPU processes: each rank's peak as memfit's tracker
measures it, and the step time; the memfit side of the comparison is :func:`run_memfit`.

Not run in CI and not imported by the tests: DeepSpeed is no dependency of memfit. It installs
beside the project's torch without pulling another one when pip is told to keep the installed
torch (DeepSpeed ships only a source archive whose ``setup.py`` imports torch)::

    python -m venv /tmp/dsvenv
    # see the project's torch (2.13.0+cpu) from the throwaway venv instead of downloading one
    echo /work/venv/lib/python3.11/site-packages \\
        > /tmp/dsvenv/lib/python3.11/site-packages/zz_workvenv.pth
    . /tmp/dsvenv/bin/activate
    pip install wheel setuptools
    DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed   # 0.19.8: torch "already satisfied"

Run (gloo on 127.0.0.1, ``DS_ACCELERATOR=cpu`` is set for the ranks)::

    python benchmarks/bench_zero.py --stages 2 3 --nproc 2 --steps 3 --timed-steps 5 \\
        --model gpt2-tiny --batch-size 8 --seq-len 64 --json /tmp/zero.json

For each stage and side the table gives, per rank: the tracker's peak over
``deepspeed.initialize`` and the tracked steps (the model's parameters are counted from the
start; DeepSpeed's flat fp32 partitions, gradient buffers and optimizer state as they are
allocated), the live bytes right after initialisation, and the median time of the untracked
steps that follow (the tracker's own overhead is left out of the time).

DeepSpeed's default buckets are 5e8 elements (about 1.9 GiB of fp32) and it allocates them
whole, so with its defaults a 0.2M-parameter model peaks near 1.9 GiB per rank; ``--bucket``
sets the reduce, all-gather and stage-3 prefetch buckets to compare like with like.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import queue
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

SIDES = ("deepspeed", "memfit")


def _model_and_batch(args: argparse.Namespace, rank: int, world: int) -> tuple[Any, Any]:
    """The same model on every rank (seed 0) and this rank's share of the global batch."""
    import torch

    from memfit.workload import load_workload

    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} must divide by --nproc {world}")
    workload = load_workload(args.model, args.batch_size // world, args.seq_len)
    model, _ = workload.build(seed=0)
    torch.manual_seed(1000 + rank)  # each rank its own samples
    batch = workload.make_batch(model, args.batch_size // world, args.seq_len)
    return model, batch


def run_deepspeed(rank: int, world: int, stage: int, args: argparse.Namespace) -> dict[str, Any]:
    """Train ``args.model`` with DeepSpeed at ZeRO ``stage`` on this rank; measure it.

    Returns:
        ``peak_bytes`` (tracker, over initialisation and ``args.steps`` steps),
        ``after_init_bytes``, ``step_s`` (median of ``args.timed_steps`` untracked steps) and
        the last ``loss``.
    """
    import deepspeed

    import memfit
    from memfit.workload import call_model, loss_from_output

    deepspeed.init_distributed(dist_backend="gloo")
    model, batch = _model_and_batch(args, rank, world)
    config = {
        "train_batch_size": args.batch_size,
        "train_micro_batch_size_per_gpu": args.batch_size // world,
        # torch's AdamW: DeepSpeed's CPU Adam would need its C++ op compiled.
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage, **_bucket_settings(args.bucket)},
        "steps_per_print": 10**9,
    }

    def step(engine: Any) -> float:
        loss = loss_from_output(call_model(engine, batch))
        engine.backward(loss)
        engine.step()
        return loss.item()

    with memfit.track(model) as tracker:
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        after_init = tracker.live_bytes
        for _ in range(args.steps):
            loss = step(engine)
    return _timed(rank, tracker, after_init, lambda: step(engine), loss, engine.optimizer, args)


def _timed(rank: int, tracker: Any, after_init: int, step: Any, loss: float, optimizer: Any,
           args: argparse.Namespace) -> dict[str, Any]:
    """Time ``args.timed_steps`` untracked steps; one side's result row for this rank."""
    times = []
    for _ in range(args.timed_steps):
        start = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - start)
    return {
        "rank": rank,
        "peak_bytes": tracker.peak_bytes,
        "after_init_bytes": after_init,
        "step_s": statistics.median(times) if times else None,
        "loss": loss,
        "optimizer": type(optimizer).__name__,
    }


def _bucket_settings(elements: int | None) -> dict[str, int]:
    """DeepSpeed's communication buffers, in elements (``None``: its defaults, 5e8 for the
    reduce and all-gather buckets, which it allocates whole however small the model)."""
    if elements is None:
        return {}
    return {"reduce_bucket_size": elements, "allgather_bucket_size": elements,
            "stage3_prefetch_bucket_size": elements}


def run_memfit(rank: int, world: int, stage: int, args: argparse.Namespace) -> dict[str, Any]:
    """memfit's side: the same model, batch and stage through memfit's data-parallel engine
    (DDP + ZeroRedundancyOptimizer for stage 1, FSDP2 for stages 2 and 3), the plan's AdamW
    (torch's, as DeepSpeed's side), measured the same way; returns the keys of
    :func:`run_deepspeed`."""
    import memfit
    from memfit import Plan
    from memfit.apply.compose import apply_plan
    from memfit.distributed.data import batches_are_local
    from memfit.distributed.launch import init_worker

    init_worker("gloo")
    model, batch = _model_and_batch(args, rank, world)
    parallel: dict[str, Any] = {"data": world, "zero_stage": stage}
    if args.bucket is not None:
        parallel["bucket_bytes"] = 4 * args.bucket  # DDP's buckets (stages 0-1), fp32
    plan = Plan(parallel=parallel, optimizer={"name": "adamw", "lr": 1e-3})
    # The batch made here is this rank's share already (as DeepSpeed's side gets it).
    with batches_are_local():
        with memfit.track(model) as tracker:
            setup = apply_plan(model, plan)
            after_init = tracker.live_bytes
            for _ in range(args.steps):
                loss = float(setup.step(batch))
        return _timed(rank, tracker, after_init, lambda: float(setup.step(batch)), loss,
                      setup.optimizer, args)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, side: str, stage: int,
            args: argparse.Namespace, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      DS_ACCELERATOR="cpu")
    import torch

    torch.set_num_threads(args.threads)
    try:
        fn = run_deepspeed if side == "deepspeed" else run_memfit
        results.put((rank, "ok", pickle.dumps(fn(rank, world, stage, args))))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def launch(side: str, stage: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run one side at one stage on ``args.nproc`` spawned processes; their results by rank."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, args.nproc, port, side, stage, args, results))
             for r in range(args.nproc)]
    for p in procs:
        p.start()
    outs: dict[int, Any] = {}
    try:
        while len(outs) < args.nproc:
            try:
                rank, status, out = results.get(timeout=args.timeout)
            except queue.Empty:
                raise SystemExit(f"{side} stage {stage}: ranks silent for {args.timeout} s") from None
            if status == "error":
                raise SystemExit(f"{side} stage {stage}: rank {rank} failed:\n{out}")
            outs[rank] = pickle.loads(out)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    return [outs[r] for r in range(args.nproc)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3], choices=[1, 2, 3])
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--model", default="gpt2-tiny",
                        help="a memfit workload: preset, config.json or package.module:function")
    parser.add_argument("--batch-size", type=int, default=8, help="global batch")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3, help="tracked steps")
    parser.add_argument("--timed-steps", type=int, default=5, help="untracked, timed steps")
    parser.add_argument("--bucket", type=lambda v: int(float(v)), default=None,
                        help="DeepSpeed's reduce/all-gather/prefetch bucket size in elements "
                             "(default: DeepSpeed's own, 5e8)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args(argv)
    from memfit.outputs import exit_if_unwritable, write_text

    exit_if_unwritable({"--json": args.json})
    rows = []
    print("| side | stage | rank | peak MiB | after init MiB | step ms | loss |")
    print("|---|---|---|---|---|---|---|")
    for stage in args.stages:
        for side in args.sides:
            for r in launch(side, stage, args):
                r.update(side=side, stage=stage)
                rows.append(r)
                step_ms = "-" if r["step_s"] is None else f"{r['step_s'] * 1e3:.1f}"
                print(f"| {side} | {stage} | {r['rank']} | {r['peak_bytes'] / 2**20:.3f} | "
                      f"{r['after_init_bytes'] / 2**20:.3f} | {step_ms} | {r['loss']:.4f} |",
                      flush=True)
    if args.json:
        write_text(args.json, json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
