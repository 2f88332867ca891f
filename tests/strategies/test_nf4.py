"""NF4 in dry runs: the chunks replayed into the tracker give the report that dispatching
every chunk gives (peaks, phases, categories, a CUDA target's reserved bytes), and a fake
weight quantised by shapes alone is torchao's 4-bit tensor, part for part."""

from __future__ import annotations

import pytest
import torch

from memfit.estimate.compose import shallow_report
from memfit.estimate.dryrun import dry_tensors
from memfit.plan import Plan
from memfit.strategies import nf4
from memfit.strategies.lora import LoraConfig
from memfit.workload import load_workload

pytest.importorskip("peft")
pytest.importorskip("torchao")

QLORA = Plan(
    precision="bf16-mixed",
    checkpointing="full",
    lora=LoraConfig(rank=4, quantize_base="nf4", quantize_embeddings=True),
)


def _facts(report):
    return (
        report.peak_bytes,
        report.peak_reserved_bytes,
        dict(report.peak_by_category),
        {phase: dict(cats) for phase, cats in report.phase_peak_by_category.items()},
        dict(report.peak_by_tier),
        report.trace.num_events,
    )


@pytest.mark.parametrize("device", ["cpu", "h100"])
def test_replayed_chunks_give_the_report_dispatched_chunks_give(monkeypatch, device):
    # 1 KiB of codes a chunk: llama-tiny's MLP weights (176 x 64) are five whole chunks and a
    # half one, its q and o projections two whole ones, k and v one: replays within a
    # weight, across layers and passes, and a shorter last chunk that must not borrow the
    # whole ones' recording.
    monkeypatch.setattr(nf4, "CHUNK", 1024)
    workload = load_workload("llama-tiny", 2, 16)
    dispatched = []
    chunk = nf4._chunk

    def counted(*args):
        dispatched.append(args[5] - args[4])
        chunk(*args)

    monkeypatch.setattr(nf4, "_chunk", counted)
    replayed = shallow_report(workload, QLORA, 3, device=device)
    with_replay = list(dispatched)
    dispatched.clear()
    monkeypatch.setattr(nf4, "_dry_chunk", lambda *args: counted(*args))
    monkeypatch.setattr(nf4, "_tracked", lambda: True)  # torchao quantises every code too
    every = shallow_report(workload, QLORA, 3, device=device)
    assert _facts(replayed) == _facts(every)
    # The replay is what saves the time: most chunks are not dispatched.
    assert 0 < len(with_replay) * 4 < len(dispatched)
    assert set(with_replay) == set(dispatched)  # both chunk lengths were dispatched once


@pytest.mark.parametrize("shape", [(176, 64), (64, 64), (1000, 64), (4096,)])
def test_a_fake_weight_quantised_by_shapes_alone_is_torchaos_tensor(monkeypatch, shape):
    def parts(q):
        return [
            (name, tuple(t.shape), tuple(t.stride()), t.dtype, t.untyped_storage().nbytes())
            for name in ("quantized_data", "quantized_scalers", "quantization_factor",
                         "scaler_mean", "nf4")
            for t in [getattr(q, name)]
        ] + [q.block_size, q.n_blocks, q.scaler_block_size, tuple(q.shape), q.dtype]

    with dry_tensors():
        weight = torch.empty(shape, dtype=torch.bfloat16)
        fast = nf4.quantize(weight)
        monkeypatch.setattr(nf4, "_tracked", lambda: True)
        full = nf4.quantize(weight)
    assert type(fast) is type(full)
    assert parts(fast) == parts(full)
