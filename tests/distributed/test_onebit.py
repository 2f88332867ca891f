"""1-bit Adam's DDP hook: sign packing, the compressed all-reduce and its error feedback, the
warm-up equal to Adam on the global batch, the bytes passed to collectives after it, and
convergence next to plain Adam; two real gloo processes where it takes more than one."""

from __future__ import annotations

import copy
import inspect
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from memfit.distributed.onebit import (
    OneBitState,
    StepTraffic,
    compressed_allreduce,
    pack_signs,
    padded_numel,
    register_onebit_adam,
    unpack_signs,
)
from memfit.optim import OneBitAdam

from .harness import run_ranks

WORLD = 2
# Small bucket caps so that the models below take two buckets (DDP rebuilds its buckets after
# the first iteration, the first one by default up to 1 MiB, unless given a list of caps).
_MULTI_BUCKET = "bucket_cap_mb_list" in inspect.signature(DistributedDataParallel).parameters


def _ddp(model: nn.Module, **kwargs) -> DistributedDataParallel:
    if _MULTI_BUCKET and "process_group" not in kwargs:
        return DistributedDataParallel(model, bucket_cap_mb_list=[0.004] * 8, **kwargs)
    return DistributedDataParallel(model, **kwargs)


def _task(n: int, seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """An MLP (about 5.6k parameters) and a noisy regression target from a teacher MLP."""
    torch.manual_seed(seed)
    teacher = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    x = torch.randn(n, 16)
    with torch.no_grad():
        y = teacher(x) + 0.1 * torch.randn(n, 4)
    model = nn.Sequential(
        nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)
    )
    return model, x, y


def _train(model, opt, x, y, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max(
        (p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


# ----------------------------------------------------------------------------- one process


def test_signs_pack_eight_to_a_byte_and_back():
    x = torch.tensor([[1.0, -2.0, 0.0, -0.0, 3.0, -1e-30, 5.0, -6.0] * 3, [-1.0] * 24])
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 3)
    # Bit k of a byte is element k (least significant first); zero and -0.0 count as +.
    assert packed[0].tolist() == [0b01011101] * 3
    assert packed[1].tolist() == [0, 0, 0]
    assert torch.equal(unpack_signs(packed), x >= 0)
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_signs(torch.ones(12))


def test_padding_gives_each_rank_a_chunk_of_whole_bytes():
    assert padded_numel(1000, 2) == 1008  # two chunks of 504 = 63 bytes each
    assert padded_numel(16, 2) == 16
    assert padded_numel(1, 4) == 32
    for numel in (1, 7, 100, 4096):
        for world in (1, 2, 3, 8):
            padded = padded_numel(numel, world)
            assert padded >= numel and padded % (8 * world) == 0 and padded - numel < 8 * world


def test_state_and_registration_refuse_what_they_cannot_hook():
    model = nn.Linear(4, 4)
    with pytest.raises(TypeError, match="OneBitAdam"):
        OneBitState(torch.optim.Adam(model.parameters()))
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        register_onebit_adam(model, OneBitAdam(model.parameters()))
    assert StepTraffic(100, 3200, 1, 1).ratio == 32.0


# ----------------------------------------------------------------------------- two processes
# Starting two processes costs more than the checks: the quick ones share one run
# (_quick_run, a module-scoped fixture), each test reading its part.

_COLLECTIVES = ("all_reduce", "all_to_all_single", "all_gather_single", "all_gather_into_tensor")
WARMUP, STEPS = 3, 8
EF_NUMEL, EF_CALLS = 1000, 64  # 1000 elements: two chunks of 504, the second one padded


def _count_collectives() -> list[int]:
    """Wrap torch.distributed's collectives to sum the send buffers handed to them (the hook
    looks them up on the module at each call), independently of the hook's own count."""
    passed = [0]

    def counting(fn, send_index):
        def wrapper(*args, **kwargs):
            passed[0] += args[send_index].nbytes
            return fn(*args, **kwargs)

        return wrapper

    for name in _COLLECTIVES:
        if hasattr(dist, name):
            send_index = 0 if name == "all_reduce" else 1
            setattr(dist, name, counting(getattr(dist, name), send_index))
    return passed


def _quick_run(rank: int, world: int):
    out = {}
    passed = _count_collectives()
    model, x, y = _task(64)
    start = copy.deepcopy(model)
    reference = copy.deepcopy(model)
    ddp = _ddp(model)
    opt = OneBitAdam(ddp.parameters(), lr=1e-2, weight_decay=0.01, warmup_steps=WARMUP)
    state = register_onebit_adam(ddp, opt)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    local_x, local_y = x.chunk(world)[rank], y.chunk(world)[rank]
    counted = []
    for step in range(STEPS):
        before = passed[0]
        _train(ddp, opt, local_x, local_y, 1)
        counted.append(passed[0] - before)
        if step < WARMUP:
            _train(reference, ref_opt, x, y, 1)  # one process, the global batch
        if step == WARMUP - 1:
            out["warmup_diff"] = _max_diff(model, reference)
    out["traffic"], out["counted"] = state.traffic, counted
    out["bytes_sent"], out["fp32_bytes"] = state.bytes_sent, state.fp32_bytes
    # After a compressed step the momentum is the decompressed 1-bit average: one magnitude
    # per chunk (rank) of each bucket, up to the rounding of the hook's inverse lerp.
    magnitudes = torch.cat([opt.state[p]["exp_avg"].abs().flatten() for p in model.parameters()])
    magnitudes = magnitudes.sort().values
    out["distinct"] = 1 + int((magnitudes[1:] / magnitudes[:-1] > 1 + 1e-4).sum())
    out["params"] = [p.detach().clone() for p in model.parameters()]
    out["error_bytes"] = sum(
        e.nbytes for e in [*state.worker_errors.values(), *state.server_errors.values()]
    )
    out["numel"] = sum(p.numel() for p in model.parameters())

    # A group of one (each rank on its own): nothing is compressed or sent, past the warm-up
    # too, and the result is the optimizer's on one process.
    groups = [dist.new_group([r]) for r in range(world)]
    solo, twin = copy.deepcopy(start), copy.deepcopy(start)
    solo_ddp = _ddp(solo, process_group=groups[rank])
    solo_opt = OneBitAdam(solo_ddp.parameters(), lr=1e-2, warmup_steps=2)
    solo_state = register_onebit_adam(solo_ddp, solo_opt)
    _train(solo_ddp, solo_opt, local_x, local_y, 5)
    _train(twin, OneBitAdam(twin.parameters(), lr=1e-2, warmup_steps=2), local_x, local_y, 5)
    out["solo_diff"], out["solo_traffic"] = _max_diff(solo, twin), solo_state.traffic

    out["feedback"] = _error_feedback(rank, world, EF_NUMEL, EF_CALLS)
    return out


def _error_feedback(rank: int, world: int, numel: int, calls: int):
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(numel, generator=gen) + 0.5 * (rank + 1)
    exact = x.clone()
    dist.all_reduce(exact)
    exact /= world
    padded = padded_numel(numel, world)
    out = {}
    for feedback in (True, False):
        worker, server = torch.zeros(padded), torch.zeros(padded // world)
        results = []
        for call in range(calls):
            result, _ = compressed_allreduce(x, worker, server, error_feedback=feedback)
            results.append(result)
            if call == 0:
                first_worker_error = worker.clone()
        first = (results[0] - exact).norm() / exact.norm()
        mean = (torch.stack(results).mean(0) - exact).norm() / exact.norm()
        out[feedback] = (
            float(first),
            float(mean),
            first_worker_error,
            server.abs().max().item(),
            results[-1],
        )
    # The residual of the first compression, by hand: chunk - sign(chunk) * ||chunk||/sqrt(n).
    chunk = padded // world
    padded_x = torch.cat([x, torch.zeros(padded - numel)]).view(world, chunk)
    counts = torch.tensor([min(chunk, max(0, numel - r * chunk)) for r in range(world)])
    scale = padded_x.norm(dim=1, keepdim=True) / counts.unsqueeze(1).sqrt()
    signs = torch.where(padded_x >= 0, 1.0, -1.0)
    real = torch.arange(chunk) < counts.unsqueeze(1)
    expected = ((padded_x - signs * scale) * real).view(-1)
    return out, expected


@pytest.fixture(scope="session")  # built once, whatever order xdist runs tests in
def quick_run():
    return run_ranks(_quick_run, WORLD, timeout=90)


@pytest.mark.distributed
def test_warmup_equals_single_process_adam_on_the_global_batch(quick_run):
    for out in quick_run:
        assert out["warmup_diff"] <= 1e-6
        # The warm-up all-reduces every gradient in fp32.
        for t in out["traffic"][:WARMUP]:
            assert t.compressed_buckets == 0 and t.bytes_sent == t.fp32_bytes
        if _MULTI_BUCKET:
            assert out["traffic"][-1].buckets >= 2
        assert out["solo_diff"] <= 1e-6
        assert all(t.bytes_sent == 0 for t in out["solo_traffic"])


@pytest.mark.distributed
def test_after_warmup_at_least_16x_fewer_bytes_than_fp32_allreduce(quick_run):
    for out in quick_run:
        traffic = out["traffic"]
        assert len(traffic) == STEPS
        # What the hook counts is what it handed to the collectives, step by step.
        assert [t.bytes_sent for t in traffic] == out["counted"] == out["bytes_sent"]
        assert out["fp32_bytes"] == [t.fp32_bytes for t in traffic]
        for t in traffic[WARMUP:]:
            assert t.compressed_buckets == t.buckets
            assert t.fp32_bytes >= 16 * t.bytes_sent, t
        assert out["distinct"] <= traffic[-1].buckets * WORLD
        # The error buffers: 4 bytes per element (worker) + 4 / WORLD (server), padding apart.
        errors = 4 * out["numel"] * (1 + 1 / WORLD)
        assert errors <= out["error_bytes"] <= errors + 4 * 8 * WORLD * 2 * traffic[-1].buckets
    # Every rank decompresses the same bits: the replicas stay identical, bit for bit.
    for p, q in zip(quick_run[0]["params"], quick_run[1]["params"], strict=True):
        assert torch.equal(p, q)


@pytest.mark.distributed
def test_error_feedback_carries_the_residual_so_errors_average_out(quick_run):
    for out in quick_run:
        with_feedback, expected = out["feedback"]
        first, mean, worker_error, server_max, _ = with_feedback[True]
        # The worker keeps exactly what compressing its tensor lost...
        torch.testing.assert_close(worker_error, expected, rtol=0, atol=1e-6)
        assert server_max > 0
        # ...and adds it back: over many calls the errors cancel, the mean of the results
        # approaches the exact average.
        assert first > 0.1
        assert mean < first / 10
        # Without error feedback nothing is carried and every call makes the same error.
        first_off, mean_off, worker_off, server_off, _ = with_feedback[False]
        assert first_off == pytest.approx(first, rel=1e-6)
        assert mean_off == pytest.approx(first_off, rel=1e-5)
        assert not worker_off.any() and server_off == 0
    for feedback in (True, False):
        assert torch.equal(
            quick_run[0]["feedback"][0][feedback][4], quick_run[1]["feedback"][0][feedback][4]
        )


def _convergence_run(rank: int, world: int, steps: int, warmup: int):
    model, x, y = _task(2048)
    local_x, local_y = x.chunk(world)[rank], y.chunk(world)[rank]
    losses = {}
    for variant in ("adam", "exact", "onebit", "onebit-no-feedback"):
        replica = copy.deepcopy(model)
        ddp = _ddp(replica)
        if variant == "adam":
            opt = torch.optim.Adam(ddp.parameters(), lr=1e-2, foreach=False)
        else:
            opt = OneBitAdam(ddp.parameters(), lr=1e-2, warmup_steps=warmup)
        if variant.startswith("onebit"):  # "exact": the same optimizer, DDP's fp32 all-reduce
            register_onebit_adam(ddp, opt, error_feedback=variant == "onebit")
        _train(ddp, opt, local_x, local_y, steps)
        with torch.no_grad():
            losses[variant] = nn.functional.mse_loss(replica(x), y).item()
    return losses


@pytest.mark.distributed
@pytest.mark.slow
def test_converges_as_plain_adam():
    # 200 full-batch steps, a quarter of them warm-up (the paper warms up for 15-25%).
    losses = run_ranks(_convergence_run, WORLD, 200, 50, timeout=90)[0]
    print("final losses:", losses)
    # Freezing the variance costs a little by itself; compressing costs little more.
    assert losses["onebit"] <= 1.2 * losses["adam"]
    assert losses["onebit"] <= 1.05 * losses["exact"]
    # Without error feedback the compression errors pile up in the momentum instead.
    assert losses["onebit-no-feedback"] >= 1.3 * losses["onebit"]


def _plan_run(rank: int, world: int) -> tuple[list[float], list[int], list[int]]:
    from memfit import Plan
    from memfit.apply.compose import apply_plan

    from ..models import Stack

    torch.manual_seed(0)
    model = Stack()
    plan = Plan(
        parallel={"data": 2},
        optimizer={"name": "onebit-adam", "lr": 1e-2, "kwargs": {"warmup_steps": 2}},
    )
    setup = apply_plan(model, plan)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(4):
        batch = {"x": torch.randn(8, 12, generator=g), "y": torch.randn(8, 5, generator=g)}
        losses.append(float(setup.step(batch)))
    state = setup.parallel.onebit
    return losses, list(state.bytes_sent), list(state.fp32_bytes)


@pytest.mark.distributed
def test_a_plan_with_onebit_adam_compresses_after_warmup():
    (losses, sent, fp32), _ = run_ranks(_plan_run, 2, timeout=180)
    assert all(math.isfinite(v) for v in losses)
    assert sent[0] == fp32[0]  # warm-up: the fp32 all-reduce
    assert fp32[-1] >= 16 * sent[-1]  # compressed


def test_onebit_adam_is_refused_beyond_stage_0():
    from memfit import Plan
    from memfit.plan import PlanError

    with pytest.raises(PlanError, match=r"'onebit-adam'.*stage 0 only"):
        Plan(parallel={"data": 2, "zero_stage": 1}, optimizer="onebit-adam")
