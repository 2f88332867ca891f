"""A long run's memory tracking stays bounded: windows of tracked steps, nothing in between."""

from __future__ import annotations

import tracemalloc

import pytest
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from memfit.plan import Plan
from memfit.train import Trainer
from memfit.workload import loss_from_output

from ._helpers import text_dataset, tiny_gpt2


def _fit(steps: int, *, track_every: int = 100, seen: list[int] | None = None) -> Trainer:
    def loss_fn(output, batch):
        if seen is not None:
            seen.append(len(_get_current_dispatch_mode_stack()))
        return loss_from_output(output)

    trainer = Trainer(
        tiny_gpt2(n_embd=8, n_layer=1),
        Plan(),
        text_dataset(seq_len=8),
        batch_size=2,
        max_steps=steps,
        lr=1e-3,
        progress=False,
        track_every=track_every,
        loss_fn=loss_fn,
    )
    trainer.result = trainer.fit()
    return trainer


def test_only_windowed_steps_run_under_the_tracker():
    seen: list[int] = []
    trainer = _fit(12, track_every=5, seen=seen)
    tracked = [i for i, modes in enumerate(seen) if modes]
    # Steps 0 and 1, then every 5th step (the 5th and 10th: indices 4 and 9).
    assert tracked == [0, 1, 4, 9]
    assert trainer.result.report.meta["tracked_steps"] == 4
    assert trainer.result.peak_bytes >= trainer.result.report.peak_bytes > 0


def _python_peak(steps: int, track_every: int) -> int:
    tracemalloc.start()
    try:
        _fit(steps, track_every=track_every)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.slow
def test_host_memory_of_a_long_run_stays_bounded():
    _fit(5)  # first-use costs (imports, caches) out of the measurement
    # Ten tracked windows, then twenty: a tracker that kept what earlier windows saw grows
    # with them.
    short = _python_peak(250, track_every=25)
    long = _python_peak(500, track_every=25)
    # Twice the steps, at most 1.5 times the peak of Python allocations: what is kept is one
    # tracked step's report, the tracker of the step in flight and the loss history (measured
    # at 1000 and 2000 steps, a window every 100: 1.99 MB and 2.51 MB). Before windows the
    # tracker kept every op of every step: the demo grew by about 1.3 MB a step.
    assert long <= 1.5 * short, (short, long)
