"""Adafactor's chunked step for large matrices: same numerics, bounded temporaries, bf16."""

from __future__ import annotations

import pytest
import torch

import memfit
from memfit.optim import Adafactor
from memfit.strategies.precision import PrecisionConfig, apply_precision

SETTINGS = [
    {},
    {"beta1": 0.9, "weight_decay": 0.01},
    {"lr": 1e-2, "relative_step": False, "scale_parameter": False},
    {"lr": 1e-2, "relative_step": False, "beta1": 0.5, "clip_threshold": 0.1},
]


@pytest.mark.parametrize("kwargs", SETTINGS)
def test_chunked_equals_unchunked(kwargs):
    torch.manual_seed(0)
    whole = torch.nn.Parameter(torch.randn(300, 64))
    chunked = torch.nn.Parameter(whole.detach().clone())
    a = Adafactor([whole], **kwargs)  # 19,200 elements: below the default chunk size
    b = Adafactor([chunked], chunk_size=1000, **kwargs)  # 15 rows a chunk, 20 chunks
    for _ in range(6):
        g = torch.randn(300, 64)
        whole.grad, chunked.grad = g.clone(), g.clone()
        a.step()
        b.step()
    # Same arithmetic, different summation order.
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)
    for key in ("exp_avg_sq_row", "exp_avg_sq_col"):
        torch.testing.assert_close(b.state[chunked][key], a.state[whole][key], rtol=1e-6, atol=0)


def _step_temporaries(chunk_size: int) -> tuple[int, int]:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(512, 256))
    p.grad = torch.randn_like(p)
    opt = Adafactor([p], lr=1e-3, relative_step=False, chunk_size=chunk_size)
    opt.step()
    with memfit.track(optimizer=opt) as tr:
        opt.step()
    return tr.report().peak_by_category["temporaries"], p.numel() * 4


def test_chunking_bounds_the_steps_temporaries():
    whole, matrix = _step_temporaries(1 << 20)
    chunked, _ = _step_temporaries(4096)
    # Unchunked: the squared gradient, then the update, are full-size fp32 temporaries.
    assert whole >= matrix
    # Chunked: a few chunk-sized temporaries (16 rows of 256) plus row/column statistics.
    chunk_bytes = 4096 * 4
    assert chunked <= 4 * chunk_bytes + 2 * (512 + 256) * 4
    assert chunked < whole / 4


def test_bf16_weights_are_updated_natively_with_stochastic_rounding():
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 512, bias=False)
    runtime = apply_precision(model, PrecisionConfig(mode="bf16-pure"))
    assert model.weight.dtype == torch.bfloat16
    opt = Adafactor(model.parameters(), lr=1e-3, relative_step=False, chunk_size=4096)
    assert runtime.wrap_optimizer(opt) is opt and opt.stochastic_rounding
    before = model.weight.detach().clone()
    model.weight.grad = torch.randn_like(model.weight)
    opt.step()
    assert model.weight.dtype == torch.bfloat16
    assert not torch.equal(model.weight, before)


def test_stochastic_rounding_keeps_updates_below_half_an_ulp():
    """Updates far below bf16's resolution vanish when rounded to nearest, not on average
    with stochastic rounding."""
    torch.manual_seed(0)
    results = {}
    for stochastic in (False, True):
        p = torch.nn.Parameter(torch.ones(64, 64, dtype=torch.bfloat16))
        opt = Adafactor(
            [p],
            lr=1e-4,
            relative_step=False,
            scale_parameter=False,
            chunk_size=512,
            stochastic_rounding=stochastic,
        )
        for _ in range(50):
            p.grad = torch.ones_like(p)  # the normalised update is 1 per element: -lr per step
            opt.step()
        results[stochastic] = p.float().mean().item()
    assert results[False] == 1.0  # 1e-4 is below half of bf16's ulp at 1.0 (2**-8)
    # Expected 1 - 50 * 1e-4 = 0.995; the mean of 4096 stochastic roundings is close to it.
    assert abs(results[True] - 0.995) < 1e-3


@pytest.mark.parametrize("device", ["cpu", "t4"])
def test_dry_run_of_two_chunks_measures_every_chunk(monkeypatch, device):
    # On fake tensors the chunked step runs only its first and last chunk (the others allocate
    # the same temporaries): the report, the emulated caching allocator's reserved peak
    # included, must equal the run that steps every chunk.
    from memfit.optim import adafactor as adafactor_module

    plan = memfit.Plan(
        optimizer={"name": "adafactor", "lr": 1e-3, "kwargs": {"chunk_size": 4096}},
        grad_accum_steps=2,
        micro_batch_size=2,
    )

    def report() -> tuple:
        r = memfit.dry_run("bert-tiny", plan, batch_size=4, seq_len=16, steps=2, device=device)
        phases = {k: dict(v) for k, v in r.phase_peak_by_category.items()}
        return r.peak_bytes, r.peak_reserved_bytes, dict(r.peak_by_category), phases

    chunks: list[int] = []
    original = adafactor_module.Adafactor._chunked_factored_step

    def counting(self, param, *args):
        chunks.append(param.shape[0])
        return original(self, param, *args)

    monkeypatch.setattr(adafactor_module.Adafactor, "_chunked_factored_step", counting)
    shortcut = report()
    assert chunks, "no matrix took the chunked step"
    monkeypatch.setattr(adafactor_module, "is_fake", lambda t: False)  # every chunk
    assert report() == shortcut
