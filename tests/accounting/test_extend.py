"""A full-depth trace built from two shallow ones reports what a full-depth dry run reports."""

from __future__ import annotations

import warnings

import pytest

import memfit
from memfit.accounting.extend import extend_trace
from memfit.accounting.report import build_report
from memfit.accounting.trace import AllocationTrace

DEPTH = 5

PLANS = {
    "plain": memfit.Plan(),
    "accumulation, selective, bf16, adafactor": memfit.Plan(
        micro_batch_size=1, grad_accum_steps=2, checkpointing="selective",
        precision="bf16-mixed", optimizer="adafactor",
    ),
    "full checkpointing, bf16, 8-bit": memfit.Plan(
        checkpointing="full", precision="bf16-mixed", optimizer="adamw8bit"
    ),
    "step in backward": memfit.Plan(optimizer_in_backward=True, optimizer="adafactor"),
    "bf16-pure, foreach": memfit.Plan(precision="bf16-pure", optimizer={"name": "adamw", "foreach": True}),
    "optimizer and parameters on the host": memfit.Plan(
        micro_batch_size=1, grad_accum_steps=2,
        offload={"optimizer": "host", "parameters": "host", "gradients_on_host": True,
                 "bucket_bytes": 4096},
    ),
    "activation offload": memfit.Plan(offload={"activations": True, "activation_min_bytes": 1024}),
    "frozen embeddings": memfit.Plan(freeze=("embeddings",)),
}  # fmt: skip

CASES = [
    ("gpt2-tiny", "plain"),
    ("gpt2-tiny", "accumulation, selective, bf16, adafactor"),
    ("gpt2-tiny", "step in backward"),
    ("gpt2-tiny", "optimizer and parameters on the host"),
    ("gpt2-tiny", "activation offload"),
    ("bert-tiny", "full checkpointing, bf16, 8-bit"),
    ("bert-tiny", "frozen embeddings"),
    ("llama-tiny", "bf16-pure, foreach"),
    ("llama-tiny", "accumulation, selective, bf16, adafactor"),
]


def _traces(model: str, plan: memfit.Plan, depths: tuple[int, ...]) -> dict[int, memfit.MemoryReport]:
    workload = memfit.load_workload(model, 2, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {d: memfit.dry_run(workload.with_depth(d), plan) for d in depths}


def _same_report(built: memfit.MemoryReport, real: memfit.MemoryReport) -> None:
    assert built.peak_bytes == real.peak_bytes
    assert built.peak_by_category == real.peak_by_category
    assert built.phase_peak_by_category == real.phase_peak_by_category
    assert built.peak_by_tier == real.peak_by_tier
    assert built.peak_by_tier_category == real.peak_by_tier_category
    assert built.step_peaks == real.step_peaks
    assert built.num_ops == real.num_ops
    assert built.timeline == real.timeline  # live bytes per category after every operation


@pytest.mark.parametrize(("model", "plan"), CASES)
def test_built_trace_reports_what_the_full_depth_dry_run_reports(model, plan):
    runs = _traces(model, PLANS[plan], (2, 3, DEPTH))
    trace = extend_trace({2: runs[2].trace, 3: runs[3].trace}, DEPTH)
    assert trace is not None
    _same_report(build_report(trace), runs[DEPTH])


def test_built_from_depths_three_and_four():
    runs = _traces("gpt2-tiny", PLANS["step in backward"], (3, 4, 6))
    trace = extend_trace({3: runs[3].trace, 4: runs[4].trace}, 6)
    assert trace is not None
    _same_report(build_report(trace), runs[6])


@pytest.mark.parametrize(
    "plan",
    [
        memfit.Plan(grad_buffer=True),  # one buffer as large as all the gradients
        memfit.Plan(max_grad_norm=1.0),  # the clipping norms stacked: one entry per parameter
    ],
    ids=["gradient buffer", "clipping"],
)
def test_allocations_sized_by_the_whole_model_are_not_extended(plan):
    runs = _traces("gpt2-tiny", plan, (2, 3))
    assert extend_trace({2: runs[2].trace, 3: runs[3].trace}, DEPTH) is None


def test_unlike_runs_are_not_extended():
    two = _traces("gpt2-tiny", memfit.Plan(), (2,))[2]
    three = _traces("llama-tiny", memfit.Plan(), (3,))[3]
    assert extend_trace({2: two.trace, 3: three.trace}, DEPTH) is None


# ---------------------------------------------------------------- hand-made traces
def _make(events: str, phases: str | None = None) -> AllocationTrace:
    """A trace from a string: ``A``..``Z`` allocate a storage of that letter's size (``a``..
    ``z`` free the oldest live one of that size), ``|`` ends an operation."""
    nbytes, birth, death, live = [], [], [], {}
    op_end, seq, total, peak, peak_seq = [0], 0, 0, 0, 0
    for ch in events:
        if ch == "|":
            op_end.append(seq)
            continue
        seq += 1
        size = ord(ch.upper()) - ord("A") + 1
        if ch.isupper():
            live.setdefault(size, []).append(len(nbytes))
            nbytes.append(size)
            birth.append(seq)
            death.append(-1)
            total += size
            if total > peak:
                peak, peak_seq = total, seq
        else:
            death[live[size].pop(0)] = seq
            total -= size
    n = len(nbytes)
    return AllocationTrace(
        nbytes=tuple(nbytes), birth=tuple(birth), death=tuple(death), tier=(0,) * n,
        category=(6,) * n, num_events=seq, op_end_event=tuple(op_end),
        op_phase=tuple(int(p) for p in (phases or "3" * len(op_end))),
        peak_bytes=peak, peak_event=peak_seq,
    )  # fmt: skip


def _totals(trace: AllocationTrace) -> list[int]:
    return build_report(trace).timeline["temporaries"]


def test_each_repeated_stretch_gets_one_copy_per_block():
    # Blocks allocate B and C; backward frees them block by block; one stretch's last copy
    # differs (the last block's output D is freed at once, the others kept: like a block's
    # output kept by the next block).
    def run(depth: int) -> AllocationTrace:
        fwd = "B|C|E|" * (depth - 1) + "B|C|D|d|"
        bwd = "c|b|" * depth
        return _make("A|" + fwd + "H|h|" + bwd + "a|")

    built = extend_trace({2: run(2), 3: run(3)}, 7)
    assert built is not None
    assert _totals(built) == _totals(run(7))
    assert build_report(built).peak_bytes == build_report(run(7)).peak_bytes


def test_frees_at_one_instant_may_come_in_any_order():
    two = _make("A|B|C|" + "abc|")
    three = _make("A|B|B|C|" + "bcab|")  # the same frees, in another order
    built = extend_trace({2: two, 3: three}, 5)
    assert built is not None
    assert _totals(built) == _totals(_make("A|B|B|B|B|C|" + "abbbbc|"))


def test_a_phase_starting_with_unlike_frees_is_refused():
    # The forward phase (0) is two frees at one instant: its peak is the value after the
    # first of them, which the stream does not fix when they differ (and does when alike).
    alike = {d: _make("A|" + "B|" * d + "b" * d + "|", phases="3" * (d + 2) + "0") for d in (2, 3)}
    assert extend_trace(alike, 5) is not None
    unlike = {d: _make("A|" + "B|" * d + "C|" + "b" * d + "c|", phases="3" * (d + 3) + "0")
              for d in (2, 3)}  # fmt: skip
    assert extend_trace(unlike, 5) is None


def test_depths_must_be_consecutive():
    t = _make("A|a|")
    with pytest.raises(ValueError, match="consecutive"):
        extend_trace({2: t, 4: t}, 6)
    with pytest.raises(ValueError, match="depth must be"):
        extend_trace({2: t, 3: t}, 1)
